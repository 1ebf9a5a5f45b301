/* What the native kernels share: the one lane tree every 16-lane sum ends with, the tail's mask. */
#ifndef TANDEM_LANES_H
#define TANDEM_LANES_H
#include <immintrin.h>

/* A vector's 16 lanes summed as i + i+8, i + i+4, i + i+2, i + i+1: the tree every output of
   rows.c (tree16 pairs lanes alike) and every row sum of norms.c ends with. */
static inline float tree1(__m512 a) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}


/* The lanes of a vector that hold elements when ``left`` remain: all 16, or the first ``left``. */
static inline __mmask16 tail_mask(long left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

#endif
