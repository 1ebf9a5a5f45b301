/* A Gated DeltaNet layer's decode middle for R rows at once, on x86-64 (simd16.h: AVX-512, or
   AVX2 with FMA): the causal conv of each row's token on its own tail, the gates, the recurrent
   step on its own state, and the gated RMS norm, between the layer's in_proj and out_proj
   matmuls (rows.c). It replaces some hundred small torch ops a layer (HybridModel._gdn_rows's
   torch path) by one call.

   Every output is the same arithmetic wherever and with whatever neighbours it is computed: a
   row's work reads only its own inputs, tail and state, each element passes through one fixed
   sequence of operations (vectors of 16 lanes along a head's or a row's last axis, a masked
   last vector through the same code, sums over an axis in ascending order or by one fixed
   lane tree), and a (row, head) task is the same code on whichever thread runs it. So a row's
   bits are a function of its own inputs alone, at any R, place, thread count (issue 14's batch
   invariance), by construction. Nothing here is compiled with -ffast-math.

   States are read from one pointer and written to another (the same for a decode step, which
   advances its state in place; the next position's copy for a verify block's row), so a
   verify row runs the very arithmetic of a decode. Where in and out are the same, every
   element is read before it is written. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd16.h"


/* sum of x[i]^2 over n: a 16-lane accumulator in ascending vectors, then the lane tree */
static inline float sum_squares(const float *x, long n) {
  vf16 acc = v_setzero_ps();
  for (long i = 0; i < n; i += 16) {
    vf16 v = v_maskz_loadu_ps(tail_mask(n - i), x + i);
    acc = v_fmadd_ps(v, v, acc);
  }
  return tree1(acc);
}

/* e^x on 16 lanes: x = n ln2 + r (ln2 in two parts), Cephes' degree-6 polynomial for e^r on
   |r| <= ln2 / 2, then scalef by 2^n. x is clamped first to [-104, 89], past which e^x is 0 and
   inf in fp32 (scalef gives them), so that r stays small; a NaN lane stays NaN. */
static inline vf16 exp16(vf16 x) {
  const vf16 hi = v_set1_ps(89.0f), lo = v_set1_ps(-104.0f);
  vf16 xc = v_max_ps(v_min_ps(x, hi), lo);
  vf16 n = v_roundscale_ps(v_mul_ps(xc, v_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf16 r = v_fnmadd_ps(n, v_set1_ps(0.693359375f), xc);
  r = v_fnmadd_ps(n, v_set1_ps(-2.12194440e-4f), r);
  vf16 p = v_set1_ps(1.9875691500e-4f);
  p = v_fmadd_ps(p, r, v_set1_ps(1.3981999507e-3f));
  p = v_fmadd_ps(p, r, v_set1_ps(8.3334519073e-3f));
  p = v_fmadd_ps(p, r, v_set1_ps(4.1665795894e-2f));
  p = v_fmadd_ps(p, r, v_set1_ps(1.6666665459e-1f));
  p = v_fmadd_ps(p, r, v_set1_ps(5.0000001201e-1f));
  p = v_fmadd_ps(p, v_mul_ps(r, r), v_add_ps(r, v_set1_ps(1.0f)));
  vf16 e = v_scalef_ps(p, n);
  /* the clamp turned a NaN into a bound (min/max return their second operand on NaN) */
  return v_mask_mov_ps(e, v_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* x / (1 + e^-x) */
static inline vf16 silu16(vf16 x) {
  vf16 d = v_add_ps(v_set1_ps(1.0f), exp16(v_sub_ps(v_setzero_ps(), x)));
  return v_div_ps(x, d);
}

/* One row's causal conv with SiLU: y[c] = silu(sum_j full[c, j] w[c, j]) over the K taps of
   full = [tail_in[c, :], x[c]] in ascending j (a product, then FMAs); tail_out[c, :] = full[c,
   1:]. Sixteen channels a vector, their taps and tails gathered (a masked last group through
   the same code). A group's reads come before its writes, so tail_in may be tail_out. */
static void conv_row(const float *x, const float *tail_in, float *tail_out, const float *w,
                     long C, long K, float *y) {
  const long km = K - 1;
  const vi16 lane = v_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const vi16 tail_at = v_mullo_epi32(lane, v_set1_epi32((int)km));
  const vi16 w_at = v_mullo_epi32(lane, v_set1_epi32((int)K));
  for (long c = 0; c < C; c += 16) {
    mask16 m = tail_mask(C - c);
    const float *t = tail_in + c * km, *wc = w + c * K;
    vf16 full[16];
    for (long j = 0; j < km; j++)
      full[j] = v_mask_i32gather_ps(v_setzero_ps(), m,
                                    v_add_epi32(tail_at, v_set1_epi32((int)j)), t, 4);
    full[km] = v_maskz_loadu_ps(m, x + c);
    vf16 acc = v_setzero_ps();
    for (long j = 0; j < K; j++) {
      vf16 wj = v_mask_i32gather_ps(v_setzero_ps(), m,
                                    v_add_epi32(w_at, v_set1_epi32((int)j)), wc, 4);
      acc = j == 0 ? v_mul_ps(full[0], wj) : v_fmadd_ps(full[j], wj, acc);
    }
    float *to = tail_out + c * km;
    for (long j = 0; j < km; j++)
      v_mask_i32scatter_ps(to, m, v_add_epi32(tail_at, v_set1_epi32((int)j)),
                           full[j + 1], 4);
    v_mask_storeu_ps(y + c, m, silu16(acc));
  }
}

/* q or k's head in place: x * (1 / sqrt(sum x^2 + eps)) (reference.l2norm), then * scale */
static void l2norm_head(float *x, long d, float eps, float scale, int scaled) {
  float r = 1.0f / sqrtf(sum_squares(x, d) + eps);
  for (long i = 0; i < d; i += 16) {
    mask16 m = tail_mask(d - i);
    vf16 v = v_mul_ps(v_maskz_loadu_ps(m, x + i), v_set1_ps(r));
    if (scaled) v = v_mul_ps(v, v_set1_ps(scale));
    v_mask_storeu_ps(x + i, m, v);
  }
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* torch's F.softplus at beta 1, threshold 20 */
static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* decay = exp(-exp(A_log) * softplus(a + dt_bias)) (neg_A = -exp(A_log)), beta = sigmoid(b) */
/* the log decay -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) of a row's heads
   (a prefill's delta rule sums the logs; decode takes their exp, gates) */
static inline void log_gates(const float *a, const float *b, const float *neg_A,
                             const float *dt_bias, long hv, float *log_decay, float *beta) {
  for (long h = 0; h < hv; h++) {
    log_decay[h] = neg_A[h] * softplusf(a[h] + dt_bias[h]);
    beta[h] = sigmoidf(b[h]);
  }
}

static inline void gates(const float *a, const float *b, const float *neg_A, const float *dt_bias,
                         long hv, float *decay, float *beta) {
  log_gates(a, b, neg_A, dt_bias, hv, decay, beta);
  for (long h = 0; h < hv; h++) decay[h] = expf(decay[h]);
}

#define JB 8  /* vectors of a state row's columns carried at once: 128 floats */

/* One head's recurrent step: S = decay * S_in; delta = (v - k^T S) * beta; S_out = S + k delta^T;
   o = q S_out (S [dk, dv], rows dv apart). Pass 1 reads S_in and sums k^T S over the rows in
   ascending order; pass 2 recomputes decay * S_in (the same bits), writes S_out and sums q S_out
   in ascending rows. So S_in may be S_out: pass 2 reads each element before it writes it. */
static void delta_head(const float *q, const float *k, const float *v, float decay, float beta,
                       const float *s_in, float *s_out, long dk, long dv, float *o) {
  const vf16 dvec = v_set1_ps(decay), bvec = v_set1_ps(beta);
  for (long j0 = 0; j0 < dv; j0 += 16 * JB) {
    long width = dv - j0 < 16 * JB ? dv - j0 : 16 * JB;
    int nv = (int)((width + 15) / 16);
    mask16 m[JB];
    vf16 acc[JB], delta[JB];
    for (int u = 0; u < JB; u++) {
      m[u] = u < nv ? tail_mask(width - 16 * u) : 0;
      acc[u] = v_setzero_ps();
    }
    for (long i = 0; i < dk; i++) {
      const float *row = s_in + i * dv + j0;
      vf16 ki = v_set1_ps(k[i]);
      for (int u = 0; u < nv; u++) {
        vf16 s = v_mul_ps(dvec, v_maskz_loadu_ps(m[u], row + 16 * u));
        acc[u] = v_fmadd_ps(ki, s, acc[u]);
      }
    }
    for (int u = 0; u < nv; u++) {
      vf16 vv = v_maskz_loadu_ps(m[u], v + j0 + 16 * u);
      delta[u] = v_mul_ps(v_sub_ps(vv, acc[u]), bvec);
      acc[u] = v_setzero_ps();
    }
    for (long i = 0; i < dk; i++) {
      const float *row = s_in + i * dv + j0;
      float *dst = s_out + i * dv + j0;
      vf16 ki = v_set1_ps(k[i]), qi = v_set1_ps(q[i]);
      for (int u = 0; u < nv; u++) {
        vf16 s = v_mul_ps(dvec, v_maskz_loadu_ps(m[u], row + 16 * u));
        s = v_fmadd_ps(ki, delta[u], s);
        v_mask_storeu_ps(dst + 16 * u, m[u], s);
        acc[u] = v_fmadd_ps(qi, s, acc[u]);
      }
    }
    for (int u = 0; u < nv; u++) v_mask_storeu_ps(o + j0 + 16 * u, m[u], acc[u]);
  }
}

/* The GDN output norm of one head in place: w * (o * (1 / sqrt(mean(o^2) + eps))) * silu(z) */
static void gated_norm_head(float *o, const float *z, const float *w, long dv, float eps) {
  float r = 1.0f / sqrtf(sum_squares(o, dv) / (float)dv + eps);
  for (long j = 0; j < dv; j += 16) {
    mask16 m = tail_mask(dv - j);
    vf16 x = v_mul_ps(v_maskz_loadu_ps(m, o + j), v_set1_ps(r));
    x = v_mul_ps(v_maskz_loadu_ps(m, w + j), x);
    x = v_mul_ps(x, silu16(v_maskz_loadu_ps(m, z + j)));
    v_mask_storeu_ps(o + j, m, x);
  }
}

/* Whether a call's work (rows x state elements) is worth a parallel region: its fork and join
   cost some microseconds, more than tiny's whole layer (4 heads of 32 x 32, about 2 us a row);
   a 0.8B-like layer (16 heads of 128 x 128) took 87 us on one thread and 56 on two (two
   shared cores, scripts/bench_gdn_rows.py). */
static inline int team(int threads, long work) {
  return threads > 1 && work >= (1L << 16) ? threads : 1;
}

/* The conv for R rows: row r reads x + r * ldx and its tail ptrs[r] (tails_in) and writes
   ptrs[R + r] (tails_out) and y + r * ldy. */
void tandem_conv_rows_f32(long R, const float *x, long ldx, float *const *ptrs, const float *w,
                          long C, long K, float *y, long ldy) {
  for (long r = 0; r < R; r++) conv_row(x + r * ldx, ptrs[r], ptrs[R + r], w, C, K, y + r * ldy);
}

/* The recurrent step for R rows on prepared inputs (q, k [R, hv, dk] normalised, q scaled,
   heads repeated; v [R, hv, dv]; decay, beta [R, hv]; all contiguous): row r's state [hv, dk,
   dv] from ptrs[r], to ptrs[R + r]; o [R, hv, dv]. */
void tandem_delta_rows_f32(long R, const float *q, const float *k, const float *v,
                           const float *decay, const float *beta, float *const *ptrs, long hv,
                           long dk, long dv, float *o, int threads) {
  long tasks = R * hv;
  const int nt = team(threads, tasks * dk * dv);
  #pragma omp parallel for if(nt > 1) num_threads(nt) schedule(static)
  for (long t = 0; t < tasks; t++) {
    long r = t / hv, h = t % hv;
    delta_head(q + t * dk, k + t * dk, v + t * dv, decay[t], beta[t],
               ptrs[r] + h * dk * dv, ptrs[R + r] + h * dk * dv, dk, dv, o + t * dv);
  }
}

/* A GDN layer's whole decode middle for R rows. Row r reads input row i = rows[r] (rows NULL:
   i = r) of mixed [., C] (the in_proj's q, k, v parts before the conv, C = 2 hk dk + hv dv),
   a, b [., hv] and z [., hv dv] (each at its own row stride), its tail [C, K-1] from ptrs[r]
   to ptrs[R + r] and its state [hv, dk, dv] from ptrs[2R + r] to ptrs[3R + r], and writes out
   row i [hv dv], ready for out_proj. q and k are l2-normalised per key head (eps l2_eps), q
   scaled by q_scale, value head h reading key head h / (hv / hk) (repeat_interleave). */
void tandem_gdn_rows_f32(const struct gdn_layer *L, long R, const long *rows, const float *mixed,
                         long ld_mixed, const float *a, long ld_a, const float *b, long ld_b,
                         const float *z, long ld_z, float *const *ptrs, float *out, long ld_out,
                         int threads) {
  const long hk = L->hk, hv = L->hv, dk = L->dk, dv = L->dv;
  const long kd = hk * dk, C = 2 * kd + hv * dv, ratio = hv / hk;
  const long per_row = C + 2 * hv;  /* a row's scratch: the conv's output, then decay, beta */
  float *scratch = aligned_alloc(64, (size_t)((R * per_row * 4 + 63) / 64 * 64));
  if (scratch == NULL) return;
  const int nt = team(threads, R * hv * dk * dv);
  #pragma omp parallel if(nt > 1) num_threads(nt)
  {
    #pragma omp for schedule(static)
    for (long r = 0; r < R; r++) {
      long i = rows ? rows[r] : r;
      float *y = scratch + r * per_row;
      conv_row(mixed + i * ld_mixed, ptrs[r], ptrs[R + r], L->conv_w, C, L->K, y);
      for (long h = 0; h < 2 * hk; h++)
        l2norm_head(y + h * dk, dk, L->l2_eps, L->q_scale, h < hk);
      gates(a + i * ld_a, b + i * ld_b, L->neg_A, L->dt_bias, hv, y + C, y + C + hv);
    }
    #pragma omp for schedule(static)
    for (long t = 0; t < R * hv; t++) {
      long r = t / hv, h = t % hv, i = rows ? rows[r] : r;
      const float *y = scratch + r * per_row;
      float *o = out + i * ld_out + h * dv;
      long g = h / ratio;
      delta_head(y + g * dk, y + kd + g * dk, y + 2 * kd + h * dv, y[C + h], y[C + hv + h],
                 ptrs[2 * R + r] + h * dk * dv, ptrs[3 * R + r] + h * dk * dv, dk, dv, o);
      gated_norm_head(o, z + i * ld_z + h * dv, L->norm_w, dv, L->eps);
    }
  }
  free(scratch);
}


/* -- prefill: a GDN layer's middle over a chunk of one sequence ------------------------------

   The same layer middle for T consecutive rows of one sequence, the delta rule in its chunked
   form (reference.chunk_gated_delta_rule's): the conv of every row on the inputs before it,
   the gates, then, a head at a time, the rows in blocks of CH (64) from the chunk's start:

     v'_i = beta_i (v_i - e^{G_i} k_i S) - sum_{j<i} A_ij v'_j       (the block's new values)
     o_i  = e^{G_i} q_i S + sum_{j<=i} (q_i . k_j) D_ij v'_j
     S   <- e^{G_n} S + sum_j e^{G_n - G_j} k_j^T v'_j

   with G the decays' running sum in the block, D_ij = e^{G_i - G_j} and A_ij = beta_i (k_i .
   k_j) D_ij. Every exponent below LOG_FLOOR counts as 0 (reference.LOG_FLOOR: the reference
   drops those terms too, and keeps every product in fp32's normal range). It is the
   reference's algebra with its two triangular solves folded into one (the rows past a
   block's floored prefix, which the reference solves without the state's term, differ from it
   by less than e^LOG_FLOOR of that term).

   A row's output reads only the rows before it in its block and the state at the block's
   start, each element through one fixed sequence of operations; a block's state reads its
   rows in ascending order; a head is one thread's, start to end. So the bits are a function
   of the inputs and of where the blocks start (the call's first row), at any T past a row and
   on any thread count: a prefill resumed on the grid (a multiple of CH) computes what a cold
   one computed. */

#define CH 64            /* reference.GDN_CHUNK */
#define LOG_FLOOR -30.0f /* reference.LOG_FLOOR */

/* e^x for x <= 0, x below LOG_FLOOR taken as exactly 0 (reference._floored_exp) */
static inline vf16 floored_exp16(vf16 x) {
  const vf16 floor = v_set1_ps(LOG_FLOOR);
  mask16 live = v_cmp_ps_mask(x, floor, _CMP_GE_OQ);
  vf16 e = exp16(v_min_ps(v_max_ps(x, floor), v_setzero_ps()));
  return v_maskz_mov_ps(live, e);
}

static inline float floored_expf(float x) {
  vf16 e = floored_exp16(v_set1_ps(x));
  return v_first(e);
}

/* One row's conv over the sequence: y[c] = silu(sum_j w[c, j] x_{t-K+1+j}[c]) in ascending j
   (a product, then FMAs: conv_row's order), the inputs before row 0 read from tailT [K-1, C]
   (the tail's columns as rows), wT [K, C] the taps as rows. */
static void conv_seq_row(const float *mixed, long ld, long t, const float *tailT,
                         const float *wT, long C, long K, float *y) {
  for (long c = 0; c < C; c += 16) {
    mask16 m = tail_mask(C - c);
    vf16 acc = v_setzero_ps();
    for (long j = 0; j < K; j++) {
      long src = t - (K - 1) + j;
      const float *xj = src >= 0 ? mixed + src * ld : tailT + (src + K - 1) * C;
      vf16 xv = v_maskz_loadu_ps(m, xj + c);
      vf16 wv = v_maskz_loadu_ps(m, wT + j * C + c);
      acc = j == 0 ? v_mul_ps(xv, wv) : v_fmadd_ps(xv, wv, acc);
    }
    v_mask_storeu_ps(y + c, m, silu16(acc));
  }
}

/* A block of up to 32 columns, ``left`` of them from its first: its two vectors' lanes */
static inline void two_masks(long left, mask16 *m0, mask16 *m1) {
  *m0 = tail_mask(left);
  *m1 = left > 16 ? tail_mask(left - 16) : 0;
}

/* xa . R and xb . R over n rows of R (rows ld apart) on one block of 32 columns (masks m0, m1),
   the rows in ascending order, a product's FMA each: s = {a[0:16], a[16:32], b[0:16],
   b[16:32]}. Four sums in registers (a loop over a variable count of vectors kept them in
   memory, a store and a load on every FMA). */
static inline void two_sums(const float *xa, const float *xb, long n, const float *R, long ld,
                            mask16 m0, mask16 m1, vf16 s[4]) {
  vf16 a0 = v_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  for (long r = 0; r < n; r++) {
    const vf16 a = v_set1_ps(xa[r]), b = v_set1_ps(xb[r]);
    const float *row = R + r * ld;
    vf16 x0 = v_maskz_loadu_ps(m0, row), x1 = v_maskz_loadu_ps(m1, row + 16);
    a0 = v_fmadd_ps(a, x0, a0);
    a1 = v_fmadd_ps(a, x1, a1);
    b0 = v_fmadd_ps(b, x0, b0);
    b1 = v_fmadd_ps(b, x1, b1);
  }
  s[0] = a0, s[1] = a1, s[2] = b0, s[3] = b1;
}

/* A head's scratch: the block's keys as columns [dk, CH], its new values [CH, dv], each row's A
   and intra weights over the block's columns [CH, CH], the block's running decays, their
   exponentials and the state's weights. */
struct head_scratch {
  float *kT, *vnew, *A, *In;
  float G[CH], eG[CH], to_end[CH];
};

/* Vectors of a row's k.k and q.k sums kept in registers at once: AVX-512's 32 registers hold
   the block's four of each; AVX2's 16 (two a vector) hold two of each, so its rows take the
   block's columns in two passes (the same FMAs, each sum's in the same order). */
#ifdef __AVX512F__
#define KQ_SPAN 4
#else
#define KQ_SPAN 2
#endif

/* Row i's A (beta_i k_i . k_j e^(G_i - G_j), j < i) and intra weights (q_i . k_j e^(G_i - G_j),
   j <= i) over the block's columns j, the sums over a in ascending order. */
static void row_weights(const float *qi, const float *ki, float bi, long i, long dk,
                        const struct head_scratch *sc, float *A, float *In) {
  const vf16 Gi = v_set1_ps(sc->G[i]), bv = v_set1_ps(bi);
  for (int u0 = 0; u0 < CH / 16; u0 += KQ_SPAN) {
    vf16 kk[KQ_SPAN], qk[KQ_SPAN];
    for (int u = 0; u < KQ_SPAN; u++) kk[u] = qk[u] = v_setzero_ps();
    for (long a = 0; a < dk; a++) {
      const vf16 ka = v_set1_ps(ki[a]), qa = v_set1_ps(qi[a]);
      const float *col = sc->kT + a * CH + 16 * u0;
      for (int u = 0; u < KQ_SPAN; u++) {
        vf16 x = v_loadu_ps(col + 16 * u);
        kk[u] = v_fmadd_ps(ka, x, kk[u]);
        qk[u] = v_fmadd_ps(qa, x, qk[u]);
      }
    }
    for (int u = 0; u < KQ_SPAN; u++) {
      long j0 = 16 * (u0 + u);
      mask16 below = j0 >= i ? 0 : tail_mask(i - j0);        /* j < i */
      mask16 upto = j0 > i ? 0 : tail_mask(i + 1 - j0);      /* j <= i */
      vf16 D = floored_exp16(v_sub_ps(Gi, v_loadu_ps(sc->G + j0)));
      v_storeu_ps(A + j0, v_maskz_mul_ps(below, v_mul_ps(bv, kk[u]), D));
      v_storeu_ps(In + j0, v_maskz_mul_ps(upto, qk[u], D));
    }
  }
}

/* One head over T rows: y [T, Cy] (the conv's output, q and k normalised), g, beta [T, hv],
   S [dk, dv] in place, out rows [dv] ld_out apart (before the norm).

   A block's rows take their new values and outputs 32 columns at a time, every row for one
   block of columns before the next: a column of v'_i and o_i reads the state's and the earlier
   rows' same column only, so the order of the two loops changes no sum, and the state's 32
   columns (dk rows of them, 16 KB at dk 128) stay in the L1 cache through the block's rows,
   where a row's sweep over the whole state (64 KB) read it again from L2 for every row. */
static void chunk_head(const float *y, long Cy, long T, const float *g, const float *beta,
                       long hv, long h, long qoff, long koff, long voff, long dk, long dv,
                       float *S, float *out, long ld_out, struct head_scratch *sc) {
  for (long c0 = 0; c0 < T; c0 += CH) {
    const long n = T - c0 < CH ? T - c0 : CH;
    float run = 0.0f;
    for (long i = 0; i < CH; i++) {
      if (i < n) run += g[(c0 + i) * hv + h];
      sc->G[i] = run;  /* rows past n repeat the last: their columns are masked off below */
    }
    for (long i = 0; i < n; i++) sc->eG[i] = floored_expf(sc->G[i]);
    for (long a = 0; a < dk; a++)
      for (long i = 0; i < CH; i++)
        sc->kT[a * CH + i] = i < n ? y[(c0 + i) * Cy + koff + a] : 0.0f;
    for (long i = 0; i < n; i++) {
      const float *yi = y + (c0 + i) * Cy;
      row_weights(yi + qoff, yi + koff, beta[(c0 + i) * hv + h], i, dk, sc, sc->A + i * CH,
                  sc->In + i * CH);
    }
    /* k_i S and q_i S, then v'_i and o_i from the block's rows before it */
    for (long c = 0; c < dv; c += 32) {
      mask16 m[2];
      two_masks(dv - c, &m[0], &m[1]);
      for (long i = 0; i < n; i++) {
        const float *yi = y + (c0 + i) * Cy;
        const float *qi = yi + qoff, *ki = yi + koff, *vi = yi + voff;
        const vf16 bv = v_set1_ps(beta[(c0 + i) * hv + h]);
        const vf16 eGi = v_set1_ps(sc->eG[i]), Ii = v_set1_ps(sc->In[i * CH + i]);
        float *vn = sc->vnew + i * dv, *oi = out + (c0 + i) * ld_out;
        vf16 kq[4], vo[4];
        two_sums(ki, qi, dk, S + c, dv, m[0], m[1], kq);
        two_sums(sc->A + i * CH, sc->In + i * CH, i, sc->vnew + c, dv, m[0], m[1], vo);
        for (int u = 0; u < 2; u++) {
          long at = c + 16 * u;
          vf16 r = v_fnmadd_ps(eGi, kq[u], v_maskz_loadu_ps(m[u], vi + at));
          vf16 x = v_sub_ps(v_mul_ps(bv, r), vo[u]);
          v_mask_storeu_ps(vn + at, m[u], x);
          vf16 o = v_fmadd_ps(eGi, kq[2 + u], vo[2 + u]);
          v_mask_storeu_ps(oi + at, m[u], v_fmadd_ps(Ii, x, o));
        }
      }
    }
    /* the state at the block's end, two of its rows and 32 columns at a time */
    const float last = sc->G[n - 1];
    const vf16 eL = v_set1_ps(sc->eG[n - 1]);
    for (long j = 0; j < n; j++) sc->to_end[j] = floored_expf(last - sc->G[j]);
    for (long a = 0; a < dk; a += 2) {
      const int pair = a + 1 < dk;
      const float *k0 = sc->kT + a * CH, *k1 = sc->kT + (a + pair) * CH;
      float *r0 = S + a * dv, *r1 = S + (a + pair) * dv;
      for (long c = 0; c < dv; c += 32) {
        mask16 m0, m1;
        two_masks(dv - c, &m0, &m1);
        vf16 s00 = v_mul_ps(eL, v_maskz_loadu_ps(m0, r0 + c));
        vf16 s01 = v_mul_ps(eL, v_maskz_loadu_ps(m1, r0 + c + 16));
        vf16 s10 = v_mul_ps(eL, v_maskz_loadu_ps(m0, r1 + c));
        vf16 s11 = v_mul_ps(eL, v_maskz_loadu_ps(m1, r1 + c + 16));
        for (long j = 0; j < n; j++) {
          const vf16 w0 = v_set1_ps(sc->to_end[j] * k0[j]);
          const vf16 w1 = v_set1_ps(sc->to_end[j] * k1[j]);
          const float *vj = sc->vnew + j * dv + c;
          vf16 x0 = v_maskz_loadu_ps(m0, vj), x1 = v_maskz_loadu_ps(m1, vj + 16);
          s00 = v_fmadd_ps(w0, x0, s00);
          s01 = v_fmadd_ps(w0, x1, s01);
          s10 = v_fmadd_ps(w1, x0, s10);
          s11 = v_fmadd_ps(w1, x1, s11);
        }
        /* a lone last row (dk odd) computed twice, stored once */
        v_mask_storeu_ps(r1 + c, m0, s10);
        v_mask_storeu_ps(r1 + c + 16, m1, s11);
        v_mask_storeu_ps(r0 + c, m0, s00);
        v_mask_storeu_ps(r0 + c + 16, m1, s01);
      }
    }
  }
}

/* A GDN layer's prefill middle for T rows of one sequence: mixed [T, C] (the in_proj's q, k, v
   before the conv), a, b [T, hv], z [T, hv dv] (each at its row stride), its tail [C, K-1] and
   state [hv, dk, dv] advanced in place; writes out [T, hv dv] (rows ld_out apart), the gated
   norm's output, ready for out_proj. Returns 0, or -1 where its buffers could not be had
   (nothing written then). */
int tandem_gdn_prefill_f32(const struct gdn_layer *L, long T, const float *mixed, long ld_mixed,
                           const float *a, long ld_a, const float *b, long ld_b, const float *z,
                           long ld_z, float *tail, float *state, float *out, long ld_out,
                           int threads) {
  const long hk = L->hk, hv = L->hv, dk = L->dk, dv = L->dv, K = L->K;
  const long kd = hk * dk, C = 2 * kd + hv * dv, ratio = hv / hk, km = K - 1;
  if (T <= 0) return 0;
  size_t head_floats = (size_t)(dk * CH + CH * dv + 2 * CH * CH);
  size_t floats = (size_t)(T * C + 2 * T * hv + (km + K) * C) + (size_t)hv * head_floats;
  float *buf = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
  if (buf == NULL) return -1;
  float *y = buf, *gl = y + T * C, *bt = gl + T * hv, *tailT = bt + T * hv, *wT = tailT + km * C;
  float *heads = wT + K * C;
  for (long c = 0; c < C; c++) {
    for (long j = 0; j < km; j++) tailT[j * C + c] = tail[c * km + j];
    for (long j = 0; j < K; j++) wT[j * C + c] = L->conv_w[c * K + j];
  }
  /* the tail after the call: the last K-1 inputs, from the rows or from the tail before */
  for (long j = 0; j < km; j++) {
    long src = T - km + j;
    for (long c = 0; c < C; c++)
      tail[c * km + j] = src >= 0 ? mixed[src * ld_mixed + c] : tailT[(src + km) * C + c];
  }
  const int nt = team(threads, T * hv * dk * dv);
  #pragma omp parallel if(nt > 1) num_threads(nt)
  {
    #pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
      float *yt = y + t * C;
      conv_seq_row(mixed, ld_mixed, t, tailT, wT, C, K, yt);
      for (long h = 0; h < 2 * hk; h++) l2norm_head(yt + h * dk, dk, L->l2_eps, L->q_scale, h < hk);
      log_gates(a + t * ld_a, b + t * ld_b, L->neg_A, L->dt_bias, hv, gl + t * hv, bt + t * hv);
    }
    #pragma omp for schedule(static)
    for (long h = 0; h < hv; h++) {
      struct head_scratch sc;
      float *mine = heads + (size_t)h * head_floats;
      sc.kT = mine;
      sc.vnew = sc.kT + dk * CH;
      sc.A = sc.vnew + CH * dv;
      sc.In = sc.A + CH * CH;
      long g = h / ratio;
      chunk_head(y, C, T, gl, bt, hv, h, g * dk, kd + g * dk, 2 * kd + h * dv, dk, dv,
                 state + h * dk * dv, out + h * dv, ld_out, &sc);
    }
    #pragma omp for schedule(static)
    for (long t = 0; t < T; t++)
      for (long h = 0; h < hv; h++)
        gated_norm_head(out + t * ld_out + h * dv, z + t * ld_z + h * dv, L->norm_w, dv, L->eps);
  }
  free(buf);
  return 0;
}
