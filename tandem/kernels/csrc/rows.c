/* Decode's matmul on x86-64 (simd16.h: AVX-512, or AVX2 with FMA): Y[b, n] = sum_k X[b, k]
   W[n, k] for B rows at once, the weights read from memory once for all of them
   (tandem/kernels/native.py builds and loads this file).

   Every output is the same arithmetic wherever and with whatever neighbours it is computed: one
   16-lane accumulator, FMAs in ascending k (a masked tail last), then the lane tree
   (i + i+8, i + i+4, i + i+2, i + i+1). Which kernel shape covers an output (16 rows by 1 input,
   8 by 2, a lone row), how many inputs the call has and which thread runs it change
   nothing: a row's result is a function of its own input alone (issue 14's batch invariance),
   by construction rather than by measurement. Float addition commutes, so the tree's operands
   may come in either order; nothing here is compiled with -ffast-math (no reassociation). */
#include <math.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd16.h"


/* 16 accumulators to one vector of their 16 sums, each by tree1's pairs; lane order PERM. */
static inline vf16 tree16(const vf16 *a) {
  vf16 c[8], e[4], g[2];
  for (int i = 0; i < 8; i++)
    c[i] = v_add_ps(v_shuffle_f32x4(a[2*i], a[2*i+1], 0x44),
                    v_shuffle_f32x4(a[2*i], a[2*i+1], 0xEE));
  for (int i = 0; i < 4; i++)
    e[i] = v_add_ps(v_shuffle_f32x4(c[2*i], c[2*i+1], 0x88),
                    v_shuffle_f32x4(c[2*i], c[2*i+1], 0xDD));
  for (int i = 0; i < 2; i++)
    g[i] = v_add_ps(v_shuffle_ps(e[2*i], e[2*i+1], 0x44),
                    v_shuffle_ps(e[2*i], e[2*i+1], 0xEE));
  return v_add_ps(v_shuffle_ps(g[0], g[1], 0x88), v_shuffle_ps(g[0], g[1], 0xDD));
}

static int perm[16];  /* perm[j]: the lane of tree16's result that holds accumulator j's sum */
__attribute__((constructor)) static void find_perm(void) {
  for (int j = 0; j < 16; j++) {
    vf16 a[16];
    for (int i = 0; i < 16; i++) a[i] = v_setzero_ps();
    float one[16] = {0}; one[0] = 1.0f; a[j] = v_loadu_ps(one);
    float out[16]; v_storeu_ps(out, tree16(a));
    for (int l = 0; l < 16; l++) if (out[l] == 1.0f) perm[j] = l;
  }
}


/* R weight rows by BB inputs (R * BB = 16 accumulators), reading the R rows once for the BB.
   The rows are read one after another, each from its start to its end (the tile's bytes in
   address order), rather than a vector of every row in turn: on this machine's two EPYC cores
   the 16 x 1 tile read tiny's 248,320 x 256 head at 19 to 32 GB/s that way against 14 to 19
   interleaved (a standalone build, alternated; one stream the hardware prefetcher follows
   rather than 16). An accumulator's FMAs are the same in either order (ascending k, a masked
   tail last): only their interleaving across accumulators differs, so the bits do not.
   (A software prefetch two tiles on ahead once lifted an interleaved 4 x 4 tile from 16 to 22
   GB/s; rows read in order need none.) */
#define KERNEL(NAME, R, BB) \
static inline void NAME(const float *const *xs, const float *W, long K, float *const *ys) { \
  vf16 acc[16]; \
  for (int j = 0; j < 16; j++) acc[j] = v_setzero_ps(); \
  const long body = K & ~15L; \
  const mask16 m = (mask16)((1u << (K - body)) - 1); \
  for (int r = 0; r < R; r++) { \
    const float *row = W + r * K; \
    for (long k = 0; k < body; k += 16) { \
      vf16 w = v_loadu_ps(row + k); \
      for (int b = 0; b < BB; b++) \
        acc[r * BB + b] = v_fmadd_ps(w, v_loadu_ps(xs[b] + k), acc[r * BB + b]); \
    } \
    if (body < K) { \
      vf16 w = v_maskz_loadu_ps(m, row + body); \
      for (int b = 0; b < BB; b++) \
        acc[r * BB + b] = v_fmadd_ps(w, v_maskz_loadu_ps(m, xs[b] + body), \
                                     acc[r * BB + b]); \
    } \
  } \
  float out[16]; v_storeu_ps(out, tree16(acc)); \
  for (int r = 0; r < R; r++) for (int b = 0; b < BB; b++) ys[b][r] = out[perm[r * BB + b]]; \
}
KERNEL(k16x1, 16, 1)
KERNEL(k8x2, 8, 2)

/* 8 rows by 2 inputs with a vector of each row in turn (k outer): for rows already in the
   cache, where the 16 accumulators' FMAs interleave rather than queue behind each row's chain
   (the rows' order in memory no longer matters). The same FMAs per accumulator, in the same
   order, as k8x2. At B = 8 the later pairs over tiny's head took 11.2 to 11.8 ms this way
   against 15.1 to 15.3 row by row (standalone, alternated); at B = 4 8.8 to 10.2 against 9.3
   to 10.7. */
static inline void k8x2_cached(const float *const *xs, const float *W, long K,
                               float *const *ys) {
  vf16 acc[16];
  for (int j = 0; j < 16; j++) acc[j] = v_setzero_ps();
  const long body = K & ~15L;
  for (long k = 0; k < K; k += 16) {
    const mask16 m = k < body ? (mask16)0xFFFF : (mask16)((1u << (K - body)) - 1);
    vf16 x0 = v_maskz_loadu_ps(m, xs[0] + k), x1 = v_maskz_loadu_ps(m, xs[1] + k);
    for (int r = 0; r < 8; r++) {
      vf16 w = v_maskz_loadu_ps(m, W + r * K + k);
      acc[2 * r] = v_fmadd_ps(w, x0, acc[2 * r]);
      acc[2 * r + 1] = v_fmadd_ps(w, x1, acc[2 * r + 1]);
    }
  }
  float out[16]; v_storeu_ps(out, tree16(acc));
  for (int r = 0; r < 8; r++) for (int b = 0; b < 2; b++) ys[b][r] = out[perm[r * 2 + b]];
}

static inline float one_row(const float *x, const float *w, long K) {
  vf16 acc = v_setzero_ps();
  long k = 0;
  for (; k + 16 <= K; k += 16) acc = v_fmadd_ps(v_loadu_ps(w + k), v_loadu_ps(x + k), acc);
  if (k < K) {
    mask16 m = (mask16)((1u << (K - k)) - 1);
    acc = v_fmadd_ps(v_maskz_loadu_ps(m, w + k), v_maskz_loadu_ps(m, x + k), acc);
  }
  return tree1(acc);
}

#ifndef __AVX512F__
/* AVX2 (simd16.h's halves): sixteen accumulators are 32 registers of 8 lanes, twice the 16 the
   ISA has, so k16x1 and k8x2 keep theirs in memory (a load and a store about every FMA). These
   tiles keep theirs in registers: R weight rows by BB inputs, R * BB accumulators of two
   halves (at most 8 ymm registers here, beside the weights' two), the k axis outer. At B = 4
   on tiny's head (248,320 x 256, two EPYC Zen 3 cores, a standalone build) a call took 9.7
   ms, about B = 1's 8.4; the whole decode step at B = 4 went from 17 to 11.3 ms. Each output is
   the same arithmetic as in the tiles above (FMAs in ascending k, a masked tail last, then
   tree1's lane pairs, which tree16 takes for each of its sums too), so its bits do not change
   with the tile: they stay a function of its row's input alone. */
#define KERNEL_T1(NAME, R, BB) \
static inline void NAME(const float *const *xs, const float *W, long K, float *const *ys) { \
  vf16 acc[R * BB]; \
  for (int j = 0; j < R * BB; j++) acc[j] = v_setzero_ps(); \
  const long body = K & ~15L; \
  for (long k = 0; k < body; k += 16) \
    for (int r = 0; r < R; r++) { \
      vf16 w = v_loadu_ps(W + r * K + k); \
      for (int b = 0; b < BB; b++) \
        acc[r * BB + b] = v_fmadd_ps(w, v_loadu_ps(xs[b] + k), acc[r * BB + b]); \
    } \
  if (body < K) { \
    const mask16 m = (mask16)((1u << (K - body)) - 1); \
    for (int r = 0; r < R; r++) { \
      vf16 w = v_maskz_loadu_ps(m, W + r * K + body); \
      for (int b = 0; b < BB; b++) \
        acc[r * BB + b] = v_fmadd_ps(w, v_maskz_loadu_ps(m, xs[b] + body), acc[r * BB + b]); \
    } \
  } \
  for (int r = 0; r < R; r++) for (int b = 0; b < BB; b++) ys[b][r] = tree1(acc[r * BB + b]); \
}
KERNEL_T1(t1x4, 1, 4)
KERNEL_T1(t1x2, 1, 2)

static void rows_block(const float *X, long ldx, long B, const float *W, long K, float *Y,
                       long ldy, long n0, long n1) {
  long n = n0;
  if (B == 1) {  /* k16x1 all the same: rows read one after another outrun the cache's
                   loads and stores (tiny's head at 30-37 GB/s, t4x1's four rows at a time 24) */
    const float *xs[1] = {X};
    for (; n + 16 <= n1; n += 16) { float *ys[1] = {Y + n}; k16x1(xs, W + n * K, K, ys); }
    for (; n < n1; n++) Y[n] = one_row(X, W + n * K, K);
    return;
  }
  /* A weight row at a time for every input, four inputs a tile: the row from memory for the
     first four, from the cache for the rest. */
  for (; n < n1; n++) {
    const float *w = W + n * K;
    long b = 0;
    for (; b + 4 <= B; b += 4) {
      const float *xs[4] = {X + b * ldx, X + (b + 1) * ldx, X + (b + 2) * ldx, X + (b + 3) * ldx};
      float *ys[4] = {Y + b * ldy + n, Y + (b + 1) * ldy + n, Y + (b + 2) * ldy + n,
                      Y + (b + 3) * ldy + n};
      t1x4(xs, w, K, ys);
    }
    for (; b + 2 <= B; b += 2) {
      const float *xs[2] = {X + b * ldx, X + (b + 1) * ldx};
      float *ys[2] = {Y + b * ldy + n, Y + (b + 1) * ldy + n};
      t1x2(xs, w, K, ys);
    }
    if (b < B) Y[b * ldy + n] = one_row(X + b * ldx, w, K);
  }
}
#else
static void rows_block(const float *X, long ldx, long B, const float *W, long K, float *Y,
                       long ldy, long n0, long n1) {
  float dump[16];
  if (B == 1) {
    const float *xs[1] = {X};
    long n = n0;
    for (; n + 16 <= n1; n += 16) { float *ys[1] = {Y + n}; k16x1(xs, W + n * K, K, ys); }
    for (; n < n1; n++) Y[n] = one_row(X, W + n * K, K);
    return;
  }
  /* Two or more inputs: 8 rows by 2 of them, the pairs in turn over the same 8 rows (their 8
     to 28 KB read from memory by the first pair, from the cache by the rest). Measured on the
     head (248,320 x 256 and 62,080 x 1,024, 2 threads, a standalone build, alternated): at
     B = 4 9.4 to 12.1 ms against 10.7 to 13.8 for the 4 x 4 tile it replaces, and at
     K = 1,024 10.3 against 13.8; B = 2 reads at B = 1's rate. */
  long n = n0;
  for (; n + 8 <= n1; n += 8)
    for (long b0 = 0; b0 < B; b0 += 2) {
      long b1 = b0 + 1 < B ? b0 + 1 : b0;  /* an odd last input twice, its copy dropped */
      const float *xs[2] = {X + b0 * ldx, X + b1 * ldx};
      float *ys[2] = {Y + b0 * ldy + n, b1 > b0 ? Y + b1 * ldy + n : dump};
      if (b0 == 0) k8x2(xs, W + n * K, K, ys);  /* the rows from memory */
      else k8x2_cached(xs, W + n * K, K, ys);
    }
  for (; n < n1; n++) for (long b = 0; b < B; b++) Y[b * ldy + n] = one_row(X + b * ldx, W + n * K, K);
}
#endif

/* X [B, K] (rows ldx apart), W [N, K] contiguous, Y [B, N] (rows ldy apart). A matrix under
   64 KiB runs on the calling thread (a region's fork and join cost more than its rows); a
   larger one in four tasks a thread, of whole groups of 16 rows, over torch's OpenMP team (this
   library links the libgomp that torch loaded: one team in the process), taken as threads come
   free: where the event loop takes a core from one thread, the other takes its tasks rather
   than wait at the join. */
void tandem_rows_f32(const float *X, long ldx, long B, const float *W, long N, long K, float *Y,
                     long ldy, int threads) {
  if (threads <= 1 || N < 32 || N * K < 16384) {
    rows_block(X, ldx, B, W, K, Y, ldy, 0, N);
    return;
  }
  long chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = (chunk + 15) / 16 * 16;
  long tasks = (N + chunk - 1) / chunk;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (long t = 0; t < tasks; t++) {
    long n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    rows_block(X, ldx, B, W, K, Y, ldy, n0, n1);
  }
}


/* Pass 1's integer sums. Each input is quantised to int16 (xq = round(x / t), |xq| <= X, t =
   max|x| / X a float, X small enough that no sum over K terms of 127 X leaves int32), so a
   row's screened sum S = sum_k q[k] xq[k] is exact: vpmaddwd takes 16 int8-widened weights by
   16 int16 inputs a uop, twice the fp32 FMA path's 8 lanes, and the inputs' quantisation
   error enters the bound as d * rq[n] (screen.py). Integer addition associates, so how the
   lanes are summed does not matter. */

/* The screen's rows as screen.py packs them: 16 rows a block, and in a block the K columns' P
   = (K + 1) / 2 pairs one after the other, each pair's 16 rows with their two weights side by
   side: row n's weight k at Q[((n / 16) P + k / 2) 32 + (n % 16) 2 + k % 2] (a padded column's
   and padded rows' weights 0). A 16-byte load widened to int16 is 8 rows by one pair, and
   vpmaddwd by an input's pair (both int16 in every 32-bit lane) gives those 8 rows' partial sums
   in their own int32 lanes: a block's sums need no horizontal adds, and each input's pair is
   read once for 16 rows rather than once a row (4 inputs: 6 loads for 8 vpmaddwd, where rows
   one after another took 5 loads for 4 and a horizontal sum a row). */
#define SCREEN_BLOCK 16  /* screen.py's BLOCK */
typedef int32_t v8si __attribute__((vector_size(32)));  /* += on lanes: no spilled accumulator */
typedef int32_t pair16 __attribute__((may_alias));  /* two int16 inputs read as one 32-bit lane */
static inline long screen_at(long n, long k, long P) {
  return ((n / SCREEN_BLOCK) * P + k / 2) * (2 * SCREEN_BLOCK) + (n % SCREEN_BLOCK) * 2 + k % 2;
}

/* The 16 rows of the block at row n (n % 16 == 0; rows past N are padding, not stored) by BB
   int16 inputs, the block read once for them all: approx[b * N + n + r] = scale (t[b] S). */
#define BKERNEL(NAME, BB) \
static inline void NAME(const int16_t *const *xq, const float *t, const int8_t *Q, \
                        const float *scale, long P, long N, long n, float *approx) { \
  const int8_t *q = Q + (n / SCREEN_BLOCK) * P * (2 * SCREEN_BLOCK); \
  v8si acc[2 * BB]; \
  for (int j = 0; j < 2 * BB; j++) acc[j] = (v8si){0}; \
  const pair16 *x32[BB];  /* xq[b] 4-byte aligned: calloc's, 2 P int16 an input */ \
  for (int b = 0; b < BB; b++) x32[b] = (const pair16 *)xq[b]; \
  for (long p = 0; p < P; p++) { \
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * p))); \
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16))); \
    for (int b = 0; b < BB; b++) { \
      const __m256i x = _mm256_set1_epi32(x32[b][p]); \
      acc[b] += (v8si)_mm256_madd_epi16(w0, x); \
      acc[BB + b] += (v8si)_mm256_madd_epi16(w1, x); \
    } \
  } \
  const long rows = N - n < SCREEN_BLOCK ? N - n : SCREEN_BLOCK; \
  for (int b = 0; b < BB; b++) { \
    float *out = approx + b * N + n; \
    if (rows == SCREEN_BLOCK) { \
      const __m256 tb = _mm256_set1_ps(t[b]); \
      for (int h = 0; h < 2; h++) \
        _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_loadu_ps(scale + n + 8 * h), \
                         _mm256_mul_ps(tb, _mm256_cvtepi32_ps((__m256i)acc[h * BB + b])))); \
    } else { \
      int32_t s[SCREEN_BLOCK]; \
      _mm256_storeu_si256((__m256i *)s, (__m256i)acc[b]); \
      _mm256_storeu_si256((__m256i *)(s + 8), (__m256i)acc[BB + b]); \
      for (long r = 0; r < rows; r++) out[r] = scale[n + r] * (t[b] * (float)s[r]); \
    } \
  } \
}
BKERNEL(b1, 1)
BKERNEL(b2, 2)
BKERNEL(b3, 3)
BKERNEL(b4, 4)

/* Screened logits approx[b * N + n] of the blocks of rows [n0, n1) (n0 % 16 == 0) for R (1 to
   4) inputs: a loop for each R, so that each kernel's epilogue is straight code. */
static void screen_rows(const int16_t *const *xq, const float *t, long R, const int8_t *Q,
                        const float *scale, long P, long N, long n0, long n1, float *approx) {
  for (long n = n0; n < n1; n += SCREEN_BLOCK)
    switch (R) {
      case 1: b1(xq, t, Q, scale, P, N, n, approx); break;
      case 2: b2(xq, t, Q, scale, P, N, n, approx); break;
      case 3: b3(xq, t, Q, scale, P, N, n, approx); break;
      default: b4(xq, t, Q, scale, P, N, n, approx); break;
    }
}

/* A lower bound of the largest logit from rows [n0, n1) for one input (approx, a, d): the
   exact (double) lower bound approx[j] - r[j] of the row j whose float estimate of it is the
   largest. Any row's lower bound is one of the largest logit's, so the float estimate only
   picks the row (NaN and -inf estimates never); -inf where no row gives a finite one. */
static double lower_max(const float *approx, const float *radius, const float *rq, double a,
                        double d, double margin, long n0, long n1) {
  const vf16 af = v_set1_ps((float)a), df = v_set1_ps((float)d), none = v_set1_ps(-INFINITY);
#define LOWER(J, LANES) v_mask_mov_ps(none, (LANES), v_sub_ps( \
    v_maskz_loadu_ps((LANES), approx + (J)), v_fmadd_ps(af, v_maskz_loadu_ps((LANES), radius + (J)), \
    v_mul_ps(df, v_maskz_loadu_ps((LANES), rq + (J))))))
  vf16 best = none;
  for (long j = n0; j < n1; j += 16) best = v_max_ps(LOWER(j, tail_mask(n1 - j)), best);
  float lanes[16], top = -INFINITY;
  v_storeu_ps(lanes, best);
  for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
  if (!(top > -INFINITY)) return -INFINITY;
  for (long j = n0; j < n1; j += 16) {  /* the first row that gave it */
    mask16 hit = v_cmp_ps_mask(LOWER(j, tail_mask(n1 - j)), v_set1_ps(top), _CMP_EQ_OQ);
    if (!hit) continue;
    const long at = j + __builtin_ctz(hit);
    return (double)approx[at] - (a * (double)radius[at] + d * (double)rq[at] + margin);
  }
#undef LOWER
  return -INFINITY;
}

/* Row j of the head W [N, K]: read from the file where ``file`` names it (fd >= 0; the bytes
   at offset + j K 4 are the mapping's, screen.py's build checks) into rowbuf, so the exact
   pass maps none of the head's pages (a touched page maps its whole page-cache folio, up to
   megabytes); the mapping's own row where there is no file or the read falls short. The same
   floats either way, so the same bits from one_row. */
static const float *head_row(const float *W, long K, long j, const struct head_file *file,
                             float *rowbuf) {
  if (file != NULL && file->fd >= 0 && rowbuf != NULL) {
    size_t want = (size_t)K * sizeof(float), got = 0;
    off_t at = (off_t)file->offset + (off_t)j * (off_t)want;
    while (got < want) {
      ssize_t r = pread(file->fd, (char *)rowbuf + got, want - got, at + (off_t)got);
      if (r <= 0) break;
      got += (size_t)r;
    }
    if (got == want) return rowbuf;
  }
  return W + j * K;
}

/* One input's pass 2 over rows [n0, n1): the rows whose upper bound reaches M computed
   exactly (count), and best, the first index of their largest (its value top) or of their
   first NaN (nan_seen 1); best -1 where none is computed. */
struct picked { long best, count; float top; int nan_seen; };

static struct picked pick(const float *x, long K, const float *W, long n0, long n1,
                          const float *radius, const float *rq, const float *approx, double a,
                          double d, double M, const struct head_file *file, float *rowbuf) {
  const double margin = (double)(2 * K + 16) * 0x1p-149;  /* subnormal products' error */
  /* 16 rows at a time: a float test lets through every row the double test below would, so
     the double test runs on the few that pass. The radius a r + d rq (no cancellation: every
     term >= 0) is widened by 2^-20 past its float rounding, so it is never under the double
     one; approx + radius then rounds once, relative to itself, which 2^-18 |hi| covers (and
     1e-37 an underflow); a NaN passes. */
  const float Mf = nextafterf((float)M, -INFINITY);
  const vf16 af = v_set1_ps(nextafterf((float)a, INFINITY)), slack = v_set1_ps(0x1p-18f);
  const vf16 df = v_set1_ps(nextafterf((float)d, INFINITY)), grow = v_set1_ps(1.0f + 0x1p-20f);
  const vf16 mv = v_set1_ps(Mf), zero = v_setzero_ps(), least = v_set1_ps(1e-37f);
  long best = -1, count = 0;
  float top = 0.0f;
  int nan_seen = 0;
  for (long j0 = n0; j0 < n1; j0 += 16) {
    const mask16 lanes = tail_mask(n1 - j0);
    vf16 rad = v_fmadd_ps(af, v_maskz_loadu_ps(lanes, radius + j0),
                          v_mul_ps(df, v_maskz_loadu_ps(lanes, rq + j0)));
    vf16 hi = v_add_ps(v_maskz_loadu_ps(lanes, approx + j0), v_mul_ps(rad, grow));
    vf16 mag = v_max_ps(hi, v_sub_ps(zero, hi));
    hi = v_add_ps(v_add_ps(hi, v_mul_ps(slack, mag)), least);
    mask16 pass = v_cmp_ps_mask(hi, mv, _CMP_NLT_UQ) & lanes;
    for (long j = j0; pass; j++, pass >>= 1) {
      if (!(pass & 1)) continue;
      double r = a * (double)radius[j] + d * (double)rq[j] + margin;
      if (!((double)approx[j] + r >= M) && isfinite(approx[j]) && isfinite(radius[j]))
        continue;  /* provably below */
      float v = one_row(x, head_row(W, K, j, file, rowbuf), K);
      count++;
      if (nan_seen) continue;
      if (isnan(v)) { nan_seen = 1; best = j; continue; }
      if (best < 0 || v > top) { top = v; best = j; }
    }
  }
  return (struct picked){best, count, top, nan_seen};
}

/* Greedy's token from the head without reading its fp32 bytes (tandem/kernels/screen.py builds
   the operands and states the bound). Q (int8, packed as screen_at says) and scale [N] are
   the head's rows quantised (W[n] ~ scale[n] Q[n]); radius[n] bounds, per unit of |x|_1, how
   far row n's screened logit may lie from the fp32 one this file's kernels compute (the weights'
   quantisation error, the fp32 sum's rounding and the screened product's), +inf for a row
   that is not finite; rq[n] bounds it per unit of the input's own quantisation error d.

   Pass 1 screens every row over Q (a quarter of the fp32 bytes) with the input quantised to
   int16, in exact integer sums: approx[n], and M, a lower bound of the largest logit: the
   largest (or close to it) of the rows' lower bounds approx[n] - r[n] (r[n] = |x|_1 radius[n]
   + d rq[n] + a subnormal margin). Every row whose upper bound reaches M,
   the largest logit's rows among them (ties and all), is then computed by one_row: the very
   arithmetic of tandem_rows_f32's output for that row, so the row's value is the full head's
   bit for bit. The answer is the first index of the largest of them, or of the first NaN, as
   argmax over the full head's logits gives it (numpy's and torch's).

   R inputs xs[b] (1 to 4) at once, the screen read once for them all: tokens[b] the token,
   or -1 where xs[b] is not finite or so large that a sum could overflow (the caller computes
   the full head then); approx [R, N] the screened logits (scratch); *exact (may be NULL): how
   many rows pass 1 left to compute, over every input; xerr[b] (may be NULL): input b's d;
   file (may be NULL): where the exact pass reads W's rows from (head_row). */
void tandem_head_argmax_rows_f32(const float *const *xs, long R, long K, const float *W, long N,
                                 const int8_t *Q, const float *scale, const float *radius,
                                 const float *rq, float wmax, float *approx, long *tokens,
                                 long *exact, double *xerr, int threads,
                                 const struct head_file *file) {
  double a[4], d[4], M[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  const float *ok[4];
  long live = 0, at[4];
  for (long b = 0; b < R; b++) {
    double sum = 0.0;
    int finite = 1;
    for (long k = 0; k < K && finite; k++) {
      finite = isfinite(xs[b][k]);
      sum += fabs((double)xs[b][k]);
    }
    sum *= 1.0 + 1e-12;  /* the double sum's own rounding (K terms of 2^-53) */
    tokens[b] = -1;
    if (xerr) xerr[b] = 0.0;
    /* every partial sum of either path stays under a |W|max <= 1e36 and 127 a <= 1e36 */
    if (!finite || sum > 1e34 || sum * (double)wmax > 1e36) continue;
    a[live] = sum, ok[live] = xs[b], at[live++] = b;
  }
  if (exact) *exact = 0;
  if (live == 0) return;
  /* the inputs in int16 with |xq| <= X: K products of 127 X stay within int32 */
  const long X = K <= 2147483647L / (127L * 32767L) ? 32767L : 2147483647L / (127L * K);
  const long P = (K + 1) / 2;  /* column pairs; an odd K's last pair has a 0 input */
  int16_t *xq = calloc((size_t)(live * 2 * P), sizeof(int16_t));
  if (xq == NULL) return;  /* every token -1: the full head */
  const int16_t *xqs[4];
  float t[4];
  for (long b = 0; b < live; b++) {
    const float *x = ok[b];
    int16_t *o = xq + b * 2 * P;
    float A = 0.0f;
    for (long k = 0; k < K; k++) A = fabsf(x[k]) > A ? fabsf(x[k]) : A;
    const float tb = A / (float)X;
    double err = 0.0;
    for (long k = 0; k < K; k++) {
      float v = tb > 0.0f ? nearbyintf(x[k] / tb) : 0.0f;
      v = v > (float)X ? (float)X : v < -(float)X ? -(float)X : v;
      o[k] = (int16_t)v;
      double e = fabs((double)x[k] - (double)tb * (double)v);  /* tb v is exact in double */
      err = e > err ? e : err;
    }
    t[b] = tb, d[b] = err * (1.0 + 0x1p-50), xqs[b] = o;  /* the subtraction's rounding */
    if (xerr) xerr[at[b]] = d[b];
  }
  const double margin = (double)(2 * K + 16) * 0x1p-149;
  long chunk = (N + 16 * threads - 1) / (16 * threads);
  chunk = (chunk + SCREEN_BLOCK - 1) / SCREEN_BLOCK * SCREEN_BLOCK;  /* whole blocks */
  long tasks = (N + chunk - 1) / chunk;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(max: M[:4]) \
      if(threads > 1 && N * K >= 16384)
  for (long i = 0; i < tasks; i++) {
    long n0 = i * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    screen_rows(xqs, t, live, Q, scale, P, N, n0, n1, approx);
    for (long b = 0; b < live; b++) {
      double lo = lower_max(approx + b * N, radius, rq, a[b], d[b], margin, n0, n1);
      if (lo > M[b]) M[b] = lo;  /* a NaN bound never raises it */
    }
  }
  free(xq);
  /* Pass 2 over the same chunks, for every input in parallel; the chunks' answers then in
     row order: the first NaN wherever one was computed, else the first of the largest. */
  struct picked *part = malloc(sizeof(struct picked) * tasks * live);
  if (part == NULL) return;  /* every token -1: the full head */
  #pragma omp parallel num_threads(threads) if(threads > 1 && N * K >= 16384)
  {
    float *rowbuf = file != NULL && file->fd >= 0 ? malloc(sizeof(float) * K) : NULL;
    #pragma omp for schedule(dynamic, 1)
    for (long i = 0; i < tasks * live; i++) {
      const long b = i / tasks, n0 = (i % tasks) * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
      part[i] = pick(ok[b], K, W, n0, n1, radius, rq, approx + b * N, a[b], d[b], M[b], file,
                     rowbuf);
    }
    free(rowbuf);
  }
  long count = 0;
  for (long b = 0; b < live; b++) {
    long best = -1;
    float top = 0.0f;
    for (long c = 0; c < tasks; c++) {
      const struct picked p = part[b * tasks + c];
      count += p.count;
      if (p.best < 0 || (best >= 0 && isnan(top))) continue;
      if (p.nan_seen || best < 0 || p.top > top) best = p.best, top = p.nan_seen ? NAN : p.top;
    }
    tokens[at[b]] = best;
  }
  free(part);
  if (exact) *exact = count;
}

/* The screen's rows (screen.py's build): for each row of W [N, K] its largest |weight| m[n]
   (0 for a row that is not finite, finite[n] 0), the scale s = m / 127 in fp32, Q = round(W /
   s) in [-127, 127] (0 where s is 0 or the row is not finite), the largest |W - s Q| in
   double (s Q is exact there), e[n], and sum_k |Q[n, k]|, q1[n]. Rows in parallel. W is rows
   n0 .. n0 + N of the head, scale to finite their entries; Q is the whole packed screen (every
   byte 0 beforehand: the padding stays 0), these rows written where screen_at puts them. */
void tandem_head_screen_rows_f32(const float *W, long N, long K, int8_t *Q, float *scale,
                                 double *m_out, double *e_out, double *q1_out, uint8_t *finite,
                                 long n0, int threads) {
  const long P = (K + 1) / 2;
  #pragma omp parallel for num_threads(threads) schedule(static) if(threads > 1)
  for (long n = 0; n < N; n++) {
    const float *w = W + n * K;
    int8_t *q = Q + screen_at(n0 + n, 0, P);  /* weight k at q[(k / 2) 32 + k % 2] */
    float m = 0.0f;
    int ok = 1;
    for (long k = 0; k < K; k++) {
      if (!isfinite(w[k])) ok = 0;
      float a = fabsf(w[k]);
      if (a > m) m = a;
    }
    if (!ok) m = 0.0f;
    const float s = m / 127.0f;
    double e = 0.0, q1 = 0.0;
    for (long k = 0; k < K; k++) {
      float r = s > 0.0f && ok ? nearbyintf(w[k] / s) : 0.0f;
      r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
      q[(k / 2) * (2 * SCREEN_BLOCK) + k % 2] = (int8_t)r;
      q1 += fabsf(r);
      if (ok) {
        double d = fabs((double)w[k] - (double)s * (double)r);
        if (d > e) e = d;
      }
    }
    scale[n] = s, m_out[n] = m, e_out[n] = e, q1_out[n] = q1, finite[n] = (uint8_t)ok;
  }
}

/* Rows ids[0..n) of a matrix stored row after row in a file (row_bytes each from offset) into
   out [n, row_bytes], by pread: an embedding lookup that maps none of the matrix's pages (the
   tied head's, screen.py). Returns 0, or -1 where an id is not one of the N rows or a read
   fell short (the caller looks them up in the mapping then, which says which). */
long tandem_gather_rows_fd(int fd, long offset, long row_bytes, long N, const long *ids, long n,
                           char *out, int threads) {
  for (long i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= N) return -1;
  long bad = 0;
  #pragma omp parallel for num_threads(threads) schedule(static) reduction(+: bad) \
      if(threads > 1 && n >= 256)
  for (long i = 0; i < n; i++) {
    size_t got = 0;
    const off_t at = (off_t)offset + (off_t)ids[i] * (off_t)row_bytes;
    char *o = out + i * row_bytes;
    while (got < (size_t)row_bytes) {
      ssize_t r = pread(fd, o + got, (size_t)row_bytes - got, at + (off_t)got);
      if (r <= 0) break;
      got += (size_t)r;
    }
    bad += got != (size_t)row_bytes;
  }
  return bad ? -1 : 0;
}
