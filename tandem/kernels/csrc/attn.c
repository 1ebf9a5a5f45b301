/* Decode's gated attention for fp32 rows, the part between the kqv projection and o_proj
   (HybridModel._attention_rows where the native kernels are on). Row r belongs to one
   sequence: its q and gate heads, its k and v heads, its rotary cos and sin (sin's first half
   negated: rotate_half folded in), its sequence's key and value rows and the position it
   writes. The rows run in order, each writing its key and value before it attends, so a
   verify block's row sees the rows before it; a row's arithmetic is its own (batch-invariant
   by construction). Nothing is compiled with -ffast-math. */
#include <math.h>

#include "simd16.h"

static inline float dot(const float *a, const float *b, long d) {
  vf16 acc = v_setzero_ps();
  for (long i = 0; i < d; i += 16) {
    mask16 m = tail_mask(d - i);
    acc = v_fmadd_ps(v_maskz_loadu_ps(m, a + i), v_maskz_loadu_ps(m, b + i), acc);
  }
  return tree1(acc);
}

/* y = rope(rms(x) * gain) for one head of hd (rotary over its first rd). */
static void norm_rope(const float *x, long hd, const float *gain, float eps, const float *cos,
                      const float *sin, long rd, float *y) {
  float r = 1.0f / sqrtf(dot(x, x, hd) / (float)hd + eps);
  float t[1024];
  for (long i = 0; i < hd; i++) t[i] = x[i] * r * gain[i];
  long half = rd / 2;
  for (long i = 0; i < rd; i++)
    y[i] = t[i] * cos[i] + t[i < half ? i + half : i - half] * sin[i];
  for (long i = rd; i < hd; i++) y[i] = t[i];
}

/* rows rows. q and gate heads lie in qg (row stride ldqg; head h's q at h * 2hd, its gate at
   h * 2hd + hd), k and v heads in k and v (row strides ldk, ldv; head g at g * hd); cos, sin
   [rows, rd]; kbufs[r], vbufs[r] row r's sequence's [nkv, window, hd] rows (head stride hs[r]:
   sequences of other windows may share a call);
   at[r] the position row r writes and attends up to. out [rows, nh * hd] = attention * sigmoid
   (gate). hd is at most 1024. */
void tandem_attn_rows_f32(const float *qg, long ldqg, const float *k, long ldk, const float *v,
                          long ldv, long rows, long nh, long nkv, long hd, long rd,
                          const float *q_gain, const float *k_gain, float eps,
                          const float *cos, const float *sin, const long *kbufs,
                          const long *vbufs, const long *hs, const long *at, float scale,
                          float *scores, float *out) {
  long group = nh / nkv;
  for (long r = 0; r < rows; r++) {
    float *kb = (float *)kbufs[r], *vb = (float *)vbufs[r];
    long pos = at[r], stride = hs[r];
    const float *c = cos + r * rd, *s = sin + r * rd;
    for (long g = 0; g < nkv; g++) {
      norm_rope(k + r * ldk + g * hd, hd, k_gain, eps, c, s, rd, kb + g * stride + pos * hd);
      const float *vs = v + r * ldv + g * hd;
      float *vd = vb + g * stride + pos * hd;
      for (long i = 0; i < hd; i++) vd[i] = vs[i];
    }
    for (long h = 0; h < nh; h++) {
      float q[1024], o[1024];
      const float *head = qg + r * ldqg + h * 2 * hd;
      norm_rope(head, hd, q_gain, eps, c, s, rd, q);
      const float *keys = kb + (h / group) * stride, *vals = vb + (h / group) * stride;
      float top = -INFINITY;
      for (long j = 0; j <= pos; j++) {
        scores[j] = dot(q, keys + j * hd, hd) * scale;
        if (scores[j] > top) top = scores[j];
      }
      float total = 0.0f;
      for (long j = 0; j <= pos; j++) {
        scores[j] = expf(scores[j] - top);
        total += scores[j];
      }
      for (long i = 0; i < hd; i++) o[i] = 0.0f;
      for (long j = 0; j <= pos; j++) {
        vf16 p = v_set1_ps(scores[j]);
        const float *vj = vals + j * hd;
        for (long i = 0; i < hd; i += 16) {
          mask16 m = tail_mask(hd - i);
          v_mask_storeu_ps(o + i, m, v_fmadd_ps(p, v_maskz_loadu_ps(m, vj + i),
                                                v_maskz_loadu_ps(m, o + i)));
        }
      }
      const float *gate = head + hd;
      float *dst = out + r * nh * hd + h * hd;
      for (long i = 0; i < hd; i++) dst[i] = o[i] / total / (1.0f + expf(-gate[i]));
    }
  }
}
