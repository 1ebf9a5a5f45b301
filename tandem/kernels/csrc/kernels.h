/* The native kernels' exported functions, for the one that chains them (step.c): each is
   defined, and documented, in its own file. */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H

#include <stdint.h>

/* rows.c */
/* where a weight matrix's rows lie in its file (fd -1: nowhere; read the mapping) */
struct head_file {
  long fd;
  long offset;
};
void tandem_rows_f32(const float *X, long ldx, long B, const float *W, long N, long K, float *Y,
                     long ldy, int threads);
void tandem_head_argmax_rows_f32(const float *const *xs, long R, long K, const float *W, long N,
                                 const int8_t *Q, const float *scale, const float *radius,
                                 const float *rq, float wmax, float *approx, long *tokens,
                                 long *exact, double *xerr, int threads,
                                 const struct head_file *file);
long tandem_gather_rows_fd(int fd, long offset, long row_bytes, long N, const long *ids, long n,
                           char *out, int threads);

/* norms.c */
void tandem_rms_rows_f32(const float *x, long ldx, long rows, long d, const float *gain,
                         float eps, float *out);
void tandem_add_rms_rows_f32(const float *x, long ldx, const float *h, long ldh, long rows,
                             long d, const float *gain, float eps, float *sum, float *out);
void tandem_silu_mul_rows_f32(const float *gate, const float *up, long ldg, long rows, long d,
                              float *out);

/* attn.c */
void tandem_attn_rows_f32(const float *qg, long ldqg, const float *k, long ldk, const float *v,
                          long ldv, long rows, long nh, long nkv, long hd, long rd,
                          const float *q_gain, const float *k_gain, float eps,
                          const float *cos, const float *sin, const long *kbufs,
                          const long *vbufs, const long *hs, const long *at, float scale,
                          float *scores, float *out);

/* gdn.c: a GDN layer's constants, as decode.GdnLayer builds them once a layer */
struct gdn_layer {
  const float *conv_w;  /* [C, K] */
  const float *neg_A, *dt_bias;  /* [hv]: -exp(A_log), dt_bias */
  const float *norm_w;  /* [dv] */
  long K, hk, hv, dk, dv;
  float l2_eps, q_scale, eps;
};
void tandem_gdn_rows_f32(const struct gdn_layer *L, long R, const long *rows, const float *mixed,
                         long ld_mixed, const float *a, long ld_a, const float *b, long ld_b,
                         const float *z, long ld_z, float *const *ptrs, float *out, long ld_out,
                         int threads);

#endif
