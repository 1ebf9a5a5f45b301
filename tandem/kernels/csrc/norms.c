/* Decode's per-row elementwise steps between its matmuls, for fp32 rows (tandem/kernels/native.py
   loads them; HybridModel's decode step calls them where the native kernels are on). A row's
   result is a function of that row alone: one loop a row, the same for any number of rows, so
   they are batch-invariant by construction. Nothing is compiled with -ffast-math. */
#include <math.h>

#include "simd16.h"


/* out = x * rsqrt(mean(x * x) + eps) * gain over one row of d. */
static inline void rms_row(const float *x, long d, const float *gain, float eps, float *out) {
  vf16 acc = v_setzero_ps();
  for (long i = 0; i < d; i += 16) {
    vf16 v = v_maskz_loadu_ps(tail_mask(d - i), x + i);
    acc = v_fmadd_ps(v, v, acc);
  }
  float r = 1.0f / sqrtf(tree1(acc) / (float)d + eps);
  vf16 rv = v_set1_ps(r);
  for (long i = 0; i < d; i += 16) {
    mask16 m = tail_mask(d - i);
    vf16 v = v_mul_ps(v_maskz_loadu_ps(m, x + i), rv);
    v_mask_storeu_ps(out + i, m, v_mul_ps(v, v_maskz_loadu_ps(m, gain + i)));
  }
}

/* rows rows of d: out[r] = rms(x[r]) * gain (x rows ldx apart, out contiguous). */
void tandem_rms_rows_f32(const float *x, long ldx, long rows, long d, const float *gain,
                         float eps, float *out) {
  for (long r = 0; r < rows; r++) rms_row(x + r * ldx, d, gain, eps, out + r * d);
}

/* The residual and the next norm: sum[r] = x[r] + h[r], out[r] = rms(sum[r]) * gain (x, h rows
   ldx, ldh apart; sum, out contiguous). */
void tandem_add_rms_rows_f32(const float *x, long ldx, const float *h, long ldh, long rows,
                             long d, const float *gain, float eps, float *sum, float *out) {
  for (long r = 0; r < rows; r++) {
    float *s = sum + r * d;
    for (long i = 0; i < d; i += 16) {
      mask16 m = tail_mask(d - i);
      v_mask_storeu_ps(s + i, m, v_add_ps(v_maskz_loadu_ps(m, x + r * ldx + i),
                                          v_maskz_loadu_ps(m, h + r * ldh + i)));
    }
    rms_row(s, d, gain, eps, out + r * d);
  }
}

/* out[r] = silu(gate[r]) * up[r] = gate / (1 + exp(-gate)) * up (gate, up rows ldg apart, as a
   fused gate_up projection's halves lie; out contiguous). */
void tandem_silu_mul_rows_f32(const float *gate, const float *up, long ldg, long rows, long d,
                              float *out) {
  for (long r = 0; r < rows; r++) {
    const float *g = gate + r * ldg, *u = up + r * ldg;
    float *o = out + r * d;
    for (long i = 0; i < d; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}
