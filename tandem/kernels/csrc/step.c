/* A whole decode step of R sequences, a row each, in one call: every layer's norms, projections,
   GDN middle or attention and MLP, then the final norm and the head (HybridModel.forward_batch
   where the native kernels take the whole model: tandem/kernels/step.py builds the plan).

   It calls the very kernels the layer-by-layer step calls (rows.c, norms.c, gdn.c, attn.c), on
   the same operands in the same order, so its logits, states, tails and rows are the bits that
   step gives, and a row's bits are its own at any R (each kernel's invariance, composed). What it
   saves is the rest: some 40 ctypes calls a token, their tensors and Python's glue between them,
   which on `tiny` (whose layers read 17 MB beside a 254 MB head) cost more than the layers'
   arithmetic. Nothing here is compiled with -ffast-math. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* A projection whose output parts lie end to end in each output row: one matrix (a fused
   projection) or up to four, each its own call (a checkpoint whose parts are not adjacent). */
struct step_proj {
  const float *w[4];         /* part i's weight [n[i], D] */
  long n[4];
  long parts, width;         /* width: the sum of n, an output row's length */
};

/* One layer of the plan (decode's step.py packs it; the fields' order is its ctypes struct's). */
struct step_layer {
  long kind;                 /* 0: GDN, 1: attention */
  long slot;                 /* its index among its kind's layers: its sections' and rows' slot */
  const float *in_norm, *post_norm;   /* the two norms' gains (1 + w) [D] */
  struct step_proj in;       /* GDN a|b|mixed|z, attention k|qg|v */
  long off[4];               /* those parts' first columns in its output row */
  const float *w_out;        /* out_proj / o_proj [D, k_out] */
  long k_out;
  struct step_proj gate_up;  /* gate|up, ff columns each */
  const float *w_down;       /* [D, ff] */
  long ff;
  const struct gdn_layer *gdn;        /* GDN: its middle's constants */
  long nh, nkv, hd, rd;      /* attention: heads, key/value heads, head dim, rotary dim */
  const float *q_gain, *k_gain;
  float scale;
};

static void project(const struct step_proj *P, const float *h, long R, long D, float *out,
                    int threads) {
  long at = 0;
  for (long i = 0; i < P->parts; i++) {
    tandem_rows_f32(h, D, R, P->w[i], P->n[i], D, out + at, P->width, threads);
    at += P->n[i];
  }
}

struct step_model {
  long layers, D, vocab;
  const struct step_layer *layer;
  const float *final_norm, *head;   /* the final norm's gain [D], the head [vocab, D] */
  float eps;                 /* every rms norm's (the GDN's own in its gdn_layer) */
  long width;                /* the widest input projection or gate_up row */
  long middle;               /* the widest middle row (GDN hv dv, attention nh hd, ff) */
  long conv_slot, state_slot;  /* one layer slot of a sequence's conv tails, of its states */
  /* the head's screen (screen.py; head_q NULL where the model has none): its rows as int8 and
     their scales, each row's radii (per unit of |x|_1, per unit of the input's int16 error),
     the largest |weight| */
  const int8_t *head_q;
  const float *head_scale, *head_radius, *head_rq;
  float head_wmax;
  struct head_file head_file;  /* where the exact pass reads the head's rows (fd -1: mapping) */
};

static int screened(const struct step_model *M, const long *choose, long r) {
  return choose != NULL && M->head_q != NULL && choose[r] == -2;
}

/* choose[r] == -3: row r wants no head at all (a short prefill's rows before its last) */
static int headless(const long *choose, long r) { return choose != NULL && choose[r] == -3; }

/* The head over rows h [R, D]: logits [R, vocab], or where ``choose`` asks (choose[r] == -2)
   row r's greedy token alone, from the screen (tandem_head_argmax_rows_f32, up to 4 rows a
   call reading the screen once), written to choose[r] in place of its logits row (left
   unwritten); -1 there: its logits were written after all (an input the screen does not
   take); choose[r] == -3: neither (left as it is). Rows that want logits go through
   tandem_rows_f32 in runs, their bits a function of their own input alone as ever. approx: 4
   vocab floats of scratch where a row is screened. */
static void head(const struct step_model *M, const float *h, long R, float *logits, long *choose,
                 float *approx, int threads) {
  const long D = M->D, V = M->vocab;
  long r = 0;
  while (r < R) {  /* the rows that want logits, in runs */
    if (screened(M, choose, r) || headless(choose, r)) { r++; continue; }
    long r1 = r + 1;
    while (r1 < R && !screened(M, choose, r1) && !headless(choose, r1)) r1++;
    tandem_rows_f32(h + r * D, D, r1 - r, M->head, V, D, logits + r * V, V, threads);
    for (long k = r; k < r1; k++) if (choose != NULL) choose[k] = -1;
    r = r1;
  }
  const float *xs[4];
  long rows[4], tokens[4], n = 0;
  for (r = 0; r <= R; r++) {  /* the screened ones, up to 4 a call, wherever they lie */
    if (r < R) {
      /* a row between them (logits, or no head: a tail's) does not split a call: each
         token is its own row's alone, the call only reads the screen once for them all */
      if (!screened(M, choose, r)) continue;
      xs[n] = h + r * D, rows[n++] = r;
      if (n < 4) continue;
    }
    if (n == 0) continue;
    tandem_head_argmax_rows_f32(xs, n, D, M->head, V, M->head_q, M->head_scale,
                                M->head_radius, M->head_rq, M->head_wmax, approx, tokens, NULL,
                                NULL, threads, &M->head_file);
    for (long i = 0; i < n; i++) {
      if (tokens[i] < 0)
        tandem_rows_f32(xs[i], D, 1, M->head, V, D, logits + rows[i] * V, V, threads);
      choose[rows[i]] = tokens[i];
    }
    n = 0;
  }
}

/* x: the R embedding rows (ldx apart, read only). seqs[8 r .. 8 r + 7]: row r's conv tails
   and recurrent states to read and to write (the addresses of each section's first layer
   slot: a decode reads and writes its sequence's own in place; a verify block's row t reads
   what its row t - 1 wrote, its sequence's at t = 0, and writes a copy of its own, the step's
   steps), its sequence's key rows and value rows, then their strides in floats: one layer
   slot, one head. at[r]: the position row r writes and attends up to; a sequence's rows lie
   together in order, so attention (a row at a time, its key row written first) sees the
   block's rows before it. The GDN middle runs a wave at a time: wave w is rows
   wave_rows[wave_at[w] .. wave_at[w + 1]), every block's row w, so that its row t runs after
   row t - 1 (waves 0: one call over every row, as a decode step). cos, sin [R, rd] (sin's
   first half negated). logits [R, vocab], choose as head()'s (NULL: every row's logits).
   h_out (NULL: not written): every row's final normed hidden row [R, D], the rows the head
   reads. Returns 0, or -1 where a buffer could not be allocated (nothing is then written: the
   allocations come first). */
int tandem_step_f32(const struct step_model *M, long R, const float *x, long ldx,
                    const long *seqs, const long *at, const long *wave_rows,
                    const long *wave_at, long waves, const float *cos, const float *sin,
                    float *logits, long *choose, int threads, float *h_out) {
  const long D = M->D;
  long top = 0;
  for (long r = 0; r < R; r++) top = at[r] > top ? at[r] : top;
  size_t floats = (size_t)R * (3 * D + M->width + M->middle) + (size_t)top + 1;
  float *buf = malloc(floats * sizeof(float));
  float **ptrs = malloc((size_t)(4 * R) * sizeof(float *));
  long *kbufs = malloc((size_t)(3 * R) * sizeof(long));
  int screens = 0;
  for (long r = 0; r < R; r++) screens |= screened(M, choose, r);
  float *approx = screens ? malloc((size_t)4 * M->vocab * sizeof(float)) : NULL;
  if (buf == NULL || ptrs == NULL || kbufs == NULL || (screens && approx == NULL)) {
    free(buf); free(ptrs); free(kbufs); free(approx);
    return -1;
  }
  float *resid = buf, *h = resid + R * D, *o = h + R * D, *proj = o + R * D;
  float *mid = proj + R * M->width, *scores = mid + R * M->middle;
  long *vbufs = kbufs + R, *heads = kbufs + 2 * R;
  for (long r = 0; r < R; r++) heads[r] = seqs[8 * r + 7];
  const float *xr = x;  /* the residual stream: the embedding, then resid */
  long ldr = ldx;
  for (long l = 0; l < M->layers; l++) {
    const struct step_layer *L = M->layer + l;
    if (l == 0) {
      tandem_rms_rows_f32(x, ldx, R, D, L->in_norm, M->eps, h);
    } else {
      tandem_add_rms_rows_f32(xr, ldr, o, D, R, D, L->in_norm, M->eps, resid, h);
      xr = resid, ldr = D;
    }
    project(&L->in, h, R, D, proj, threads);
    if (L->kind == 0) {
      const long n = L->in.width;
      for (long w = 0; w < (waves > 0 ? waves : 1); w++) {
        const long *rows = waves > 0 ? wave_rows + wave_at[w] : NULL;
        const long Rw = waves > 0 ? wave_at[w + 1] - wave_at[w] : R;
        for (long k = 0; k < Rw; k++) {
          const long *q = seqs + 8 * (rows ? rows[k] : k);
          ptrs[k] = (float *)q[0] + L->slot * M->conv_slot;
          ptrs[Rw + k] = (float *)q[1] + L->slot * M->conv_slot;
          ptrs[2 * Rw + k] = (float *)q[2] + L->slot * M->state_slot;
          ptrs[3 * Rw + k] = (float *)q[3] + L->slot * M->state_slot;
        }
        tandem_gdn_rows_f32(L->gdn, Rw, rows, proj + L->off[2], n, proj + L->off[0], n,
                            proj + L->off[1], n, proj + L->off[3], n, ptrs, mid, L->k_out,
                            threads);
      }
    } else {
      for (long r = 0; r < R; r++) {
        long slot = (long)sizeof(float) * L->slot * seqs[8 * r + 6];
        kbufs[r] = seqs[8 * r + 4] + slot;
        vbufs[r] = seqs[8 * r + 5] + slot;
      }
      const long n = L->in.width;
      tandem_attn_rows_f32(proj + L->off[1], n, proj + L->off[0], n, proj + L->off[2], n, R,
                           L->nh, L->nkv, L->hd, L->rd, L->q_gain, L->k_gain, M->eps, cos, sin,
                           kbufs, vbufs, heads, at, L->scale, scores, mid);
    }
    tandem_rows_f32(mid, L->k_out, R, L->w_out, D, L->k_out, o, D, threads);
    tandem_add_rms_rows_f32(xr, ldr, o, D, R, D, L->post_norm, M->eps, resid, h);
    xr = resid, ldr = D;
    project(&L->gate_up, h, R, D, proj, threads);
    tandem_silu_mul_rows_f32(proj, proj + L->ff, 2 * L->ff, R, L->ff, mid);
    tandem_rows_f32(mid, L->ff, R, L->w_down, D, L->ff, o, D, threads);
  }
  if (M->layers == 0) {
    tandem_rms_rows_f32(x, ldx, R, D, M->final_norm, M->eps, h);
  } else {
    tandem_add_rms_rows_f32(xr, ldr, o, D, R, D, M->final_norm, M->eps, resid, h);
  }
  if (h_out != NULL) memcpy(h_out, h, (size_t)R * D * sizeof(float));
  head(M, h, R, logits, choose, approx, threads);
  free(buf); free(ptrs); free(kbufs); free(approx);
  return 0;
}
