/* The native kernels' one vector type: 16 fp32 lanes (vf16), 16 int32 lanes (vi16) and a
   16-bit lane mask (mask16), with the operations the kernels use, named as AVX-512's
   intrinsics with v_ for _mm512_.

   With AVX-512 (-mavx512f ...) each is that intrinsic. Without it, on AVX2 with FMA, a vector is
   two 8-lane halves and each operation does, lane by lane, what the AVX-512 one does: the same
   IEEE operation on every lane (an FMA is fused in both), the same lanes moved by the shuffles,
   masked loads that read no masked lane, v_scalef_ps's one rounding (below). So a kernel
   written once runs on both, and every sum the kernels make (16 lanes, FMAs in ascending order,
   one fixed lane tree) is the same arithmetic on either: a row's bits are still its own at any
   batch (issue 14's batch invariance), by construction. */
#ifndef TANDEM_SIMD16_H
#define TANDEM_SIMD16_H
#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__

typedef __m512 vf16;
typedef __m512i vi16;
typedef __mmask16 mask16;
#define v_setzero_ps _mm512_setzero_ps
#define v_set1_ps _mm512_set1_ps
#define v_loadu_ps _mm512_loadu_ps
#define v_storeu_ps _mm512_storeu_ps
#define v_maskz_loadu_ps _mm512_maskz_loadu_ps
#define v_mask_storeu_ps _mm512_mask_storeu_ps
#define v_add_ps _mm512_add_ps
#define v_sub_ps _mm512_sub_ps
#define v_mul_ps _mm512_mul_ps
#define v_div_ps _mm512_div_ps
#define v_min_ps _mm512_min_ps
#define v_max_ps _mm512_max_ps
#define v_fmadd_ps _mm512_fmadd_ps
#define v_fnmadd_ps _mm512_fnmadd_ps
#define v_maskz_mul_ps _mm512_maskz_mul_ps
#define v_mask_mov_ps _mm512_mask_mov_ps
#define v_maskz_mov_ps _mm512_maskz_mov_ps
#define v_cmp_ps_mask _mm512_cmp_ps_mask
#define v_roundscale_ps _mm512_roundscale_ps
#define v_scalef_ps _mm512_scalef_ps
#define v_shuffle_ps _mm512_shuffle_ps
#define v_shuffle_f32x4 _mm512_shuffle_f32x4
#define v_set1_epi32 _mm512_set1_epi32
#define v_set_epi32 _mm512_set_epi32
#define v_add_epi32 _mm512_add_epi32
#define v_mullo_epi32 _mm512_mullo_epi32
#define v_mask_i32gather_ps _mm512_mask_i32gather_ps
#define v_mask_i32scatter_ps _mm512_mask_i32scatter_ps

/* lane 0 */
static inline float v_first(vf16 a) { return _mm_cvtss_f32(_mm512_castps512_ps128(a)); }

/* A vector's 16 lanes summed as i + i+8, i + i+4, i + i+2, i + i+1: the tree every output of
   rows.c (tree16 pairs lanes alike) and every row sum of norms.c ends with. */
static inline float tree1(vf16 a) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}


#else  /* AVX2 with FMA: two halves, lanes 0-7 and 8-15 */

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the native kernels need AVX-512F, or AVX2 with FMA"
#endif

typedef struct { __m256 lo, hi; } vf16;
typedef struct { __m256i lo, hi; } vi16;
typedef uint16_t mask16;

#define TANDEM_INLINE static inline __attribute__((always_inline))
#define V2(LO, HI) ((vf16){(LO), (HI)})
#define VI2(LO, HI) ((vi16){(LO), (HI)})

/* the 8 lanes of a half whose bits are set in ``bits``: all ones, or zero */
TANDEM_INLINE __m256i lanes8(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}

TANDEM_INLINE vf16 v_setzero_ps(void) { return V2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
TANDEM_INLINE vf16 v_set1_ps(float x) { return V2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
TANDEM_INLINE vf16 v_loadu_ps(const float *p) {
  return V2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
TANDEM_INLINE void v_storeu_ps(float *p, vf16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
/* A masked lane is neither read (no fault past an array's end) nor, on a store, written. A
   whole vector goes through the plain load or store. */
TANDEM_INLINE vf16 v_maskz_loadu_ps(mask16 m, const float *p) {
  if (m == 0xFFFF) return v_loadu_ps(p);
  vf16 r = V2(_mm256_setzero_ps(), _mm256_setzero_ps());
  if (m & 0xFF) r.lo = _mm256_maskload_ps(p, lanes8(m & 0xFF));
  if (m >> 8) r.hi = _mm256_maskload_ps(p + 8, lanes8(m >> 8));
  return r;
}
TANDEM_INLINE void v_mask_storeu_ps(float *p, mask16 m, vf16 a) {
  if (m == 0xFFFF) { v_storeu_ps(p, a); return; }
  if (m & 0xFF) _mm256_maskstore_ps(p, lanes8(m & 0xFF), a.lo);
  if (m >> 8) _mm256_maskstore_ps(p + 8, lanes8(m >> 8), a.hi);
}

#define V_BINARY(NAME, OP) \
  TANDEM_INLINE vf16 NAME(vf16 a, vf16 b) { return V2(OP(a.lo, b.lo), OP(a.hi, b.hi)); }
V_BINARY(v_add_ps, _mm256_add_ps)
V_BINARY(v_sub_ps, _mm256_sub_ps)
V_BINARY(v_mul_ps, _mm256_mul_ps)
V_BINARY(v_div_ps, _mm256_div_ps)
V_BINARY(v_min_ps, _mm256_min_ps)  /* the second operand where either is NaN, as AVX-512's */
V_BINARY(v_max_ps, _mm256_max_ps)
#undef V_BINARY

TANDEM_INLINE vf16 v_fmadd_ps(vf16 a, vf16 b, vf16 c) {
  return V2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
TANDEM_INLINE vf16 v_fnmadd_ps(vf16 a, vf16 b, vf16 c) {
  return V2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
/* a where m is set, else src */
TANDEM_INLINE vf16 v_mask_mov_ps(vf16 src, mask16 m, vf16 a) {
  return V2(_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(lanes8(m & 0xFF))),
            _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(lanes8(m >> 8))));
}
TANDEM_INLINE vf16 v_maskz_mov_ps(mask16 m, vf16 a) {
  return V2(_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes8(m & 0xFF))),
            _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes8(m >> 8))));
}
TANDEM_INLINE vf16 v_maskz_mul_ps(mask16 m, vf16 a, vf16 b) {
  return v_maskz_mov_ps(m, v_mul_ps(a, b));
}
/* the lanes where a PRED b (a _CMP_ constant; macros, as the immediates must be constants,
   each argument evaluated once) */
#define v_cmp_ps_mask(A, B, PRED) ({ \
  const vf16 a_ = (A), b_ = (B); \
  (mask16)(_mm256_movemask_ps(_mm256_cmp_ps(a_.lo, b_.lo, (PRED))) \
           | (_mm256_movemask_ps(_mm256_cmp_ps(a_.hi, b_.hi, (PRED))) << 8)); })
/* rounded to an integer (IMM's rounding, no scale: its high four bits are 0 here) */
#define v_roundscale_ps(A, IMM) ({ \
  const vf16 a_ = (A); \
  V2(_mm256_round_ps(a_.lo, (IMM)), _mm256_round_ps(a_.hi, (IMM))); })

/* a * 2^n for integral n (exp16's, |n| <= 150): AVX-512's scalef rounds a * 2^n once. Here two
   multiplications, by 2^floor(n/2) and 2^(n - floor(n/2)), each a normal float: the first is
   exact while its product stays normal (exp16's a is in [0.7, 1.5], so down to n/2 = -75),
   and only the second rounds, to the same float (a denormal, 0 or inf alike). */
TANDEM_INLINE __m256 scalef8(__m256 a, __m256 n) {
  __m256i ni = _mm256_cvtps_epi32(n);
  __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
TANDEM_INLINE vf16 v_scalef_ps(vf16 a, vf16 n) {
  return V2(scalef8(a.lo, n.lo), scalef8(a.hi, n.hi));
}

/* within each 128-bit quarter, as AVX-512's: the halves' quarters take the same IMM */
#define v_shuffle_ps(A, B, IMM) ({ \
  const vf16 a_ = (A), b_ = (B); \
  V2(_mm256_shuffle_ps(a_.lo, b_.lo, (IMM)), _mm256_shuffle_ps(a_.hi, b_.hi, (IMM))); })

/* quarter i (0-3) of a */
TANDEM_INLINE __m128 quarter(vf16 a, int i) {
  switch (i & 3) {
    case 0: return _mm256_castps256_ps128(a.lo);
    case 1: return _mm256_extractf128_ps(a.lo, 1);
    case 2: return _mm256_castps256_ps128(a.hi);
    default: return _mm256_extractf128_ps(a.hi, 1);
  }
}
/* quarters a[IMM & 3], a[IMM >> 2 & 3], b[IMM >> 4 & 3], b[IMM >> 6 & 3] */
TANDEM_INLINE vf16 v_shuffle_f32x4(vf16 a, vf16 b, const int imm) {
  return V2(_mm256_set_m128(quarter(a, imm >> 2), quarter(a, imm)),
            _mm256_set_m128(quarter(b, imm >> 6), quarter(b, imm >> 4)));
}

TANDEM_INLINE vi16 v_set1_epi32(int x) { return VI2(_mm256_set1_epi32(x), _mm256_set1_epi32(x)); }
/* lanes 15 down to 0, as _mm512_set_epi32 */
TANDEM_INLINE vi16 v_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9,
                               int e8, int e7, int e6, int e5, int e4, int e3, int e2, int e1,
                               int e0) {
  return VI2(_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0),
             _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8));
}
TANDEM_INLINE vi16 v_add_epi32(vi16 a, vi16 b) {
  return VI2(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi));
}
TANDEM_INLINE vi16 v_mullo_epi32(vi16 a, vi16 b) {
  return VI2(_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi));
}
/* base[idx] (floats: SCALE is 4, the only one the kernels use) where m is set, else src */
#define v_mask_i32gather_ps(SRC, M, IDX, BASE, SCALE) \
  v_gather4((SRC), (M), (IDX), (BASE))
TANDEM_INLINE vf16 v_gather4(vf16 src, mask16 m, vi16 idx, const float *base) {
  return V2(_mm256_mask_i32gather_ps(src.lo, base, idx.lo,
                                     _mm256_castsi256_ps(lanes8(m & 0xFF)), 4),
            _mm256_mask_i32gather_ps(src.hi, base, idx.hi,
                                     _mm256_castsi256_ps(lanes8(m >> 8)), 4));
}
/* base[idx] = a where m is set, lane 0 first (SCALE 4): no AVX2 scatter, so lane by lane */
#define v_mask_i32scatter_ps(BASE, M, IDX, A, SCALE) v_scatter4((BASE), (M), (IDX), (A))
TANDEM_INLINE void v_scatter4(float *base, mask16 m, vi16 idx, vf16 a) {
  int at[16];
  float x[16];
  _mm256_storeu_si256((__m256i *)at, idx.lo);
  _mm256_storeu_si256((__m256i *)(at + 8), idx.hi);
  v_storeu_ps(x, a);
  for (int l = 0; l < 16; l++)
    if (m >> l & 1) base[at[l]] = x[l];
}

TANDEM_INLINE float v_first(vf16 a) { return _mm256_cvtss_f32(a.lo); }

/* tree1 as AVX-512's: i + i+8 (the halves), i + i+4, i + i+2, i + i+1 */
TANDEM_INLINE float tree1(vf16 a) {
  __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}


#endif

/* The lanes of a vector that hold elements when ``left`` remain: all 16, or the first ``left``. */
static inline mask16 tail_mask(long left) {
  return left >= 16 ? (mask16)0xFFFF : (mask16)((1u << left) - 1);
}

#endif
