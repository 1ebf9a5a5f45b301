/* A byte-level BPE tokenizer for Qwen's vocabulary in a few megabytes (tandem/models/bpe.py).

   tiktoken's Rust tables for Qwen's 248k ranks take about 60 MiB of the server's memory: each
   token's bytes are kept three times (the encoder's and the decoder's hash maps, the sorted
   list), every one a heap allocation of its own. Here the vocabulary is one blob of every id's
   bytes, their offsets, and an open-addressing table of rank ids by their bytes' hash: about
   5 MiB, all of it arrays the Python side owns.

   The text is split as tiktoken splits it with Qwen's pre-tokenizer regex

     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}
     | ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+

   (fancy-regex: leftmost-first alternation, backtracking), written out by hand as the match
   each alternative makes at a position (``piece_end``), and each piece is merged as tiktoken's
   byte_pair_merge merges it: the adjacent pair whose bytes have the lowest rank, the leftmost
   of equal ones, until no pair is a token. The codepoints' classes (L, M, N, White_Space) come
   from the caller's two-level table; a codepoint the table marks UNSURE (unassigned in the
   caller's Unicode data, so perhaps assigned in tiktoken's) stops the encode, and the caller
   asks tiktoken. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { C_L = 1, C_M = 2, C_N = 4, C_WS = 8, C_UNSURE = 16 };

struct tandem_bpe {
  const uint8_t *blob;    /* every id's bytes, one after another */
  const uint32_t *off;    /* id i's bytes are blob[off[i], off[i + 1]) */
  const int32_t *table;   /* rank ids by hash, -1 where empty; cap a power of two */
  long cap;
  long n;                 /* ids (n + 1 offsets) */
  const uint16_t *stage1; /* codepoint >> 8 -> its page */
  const uint8_t *stage2;  /* page * 256 + (codepoint & 255) -> its class bits */
};

static uint64_t hash_bytes(const uint8_t *p, long len) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (long i = 0; i < len; i++) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h ^ (h >> 29);
}

/* Fills ``table`` (cap entries, all -1, cap a power of two over the ranks) with the ids whose
   ``is_rank`` is set. Returns the ranks placed, or -1 where two ranks have the same bytes. */
long tandem_bpe_index(const uint8_t *blob, const uint32_t *off, const uint8_t *is_rank, long n,
                      int32_t *table, long cap) {
  long placed = 0;
  for (long i = 0; i < n; i++) {
    if (!is_rank[i]) continue;
    const long len = off[i + 1] - off[i];
    uint64_t slot = hash_bytes(blob + off[i], len) & (uint64_t)(cap - 1);
    for (int32_t r; (r = table[slot]) >= 0; slot = (slot + 1) & (uint64_t)(cap - 1))
      if ((long)(off[r + 1] - off[r]) == len && memcmp(blob + off[r], blob + off[i], len) == 0)
        return -1;
    table[slot] = (int32_t)i;
    placed++;
  }
  return placed;
}

static int32_t rank_of(const struct tandem_bpe *b, const uint8_t *p, long len) {
  uint64_t mask = (uint64_t)(b->cap - 1);
  uint64_t slot = hash_bytes(p, len) & mask;
  for (;;) {
    int32_t r = b->table[slot];
    if (r < 0) return -1;
    if ((long)(b->off[r + 1] - b->off[r]) == len && memcmp(b->blob + b->off[r], p, len) == 0)
      return r;
    slot = (slot + 1) & mask;
  }
}

static inline int is_crlf(int32_t c) { return c == '\r' || c == '\n'; }

/* The end (exclusive, in codepoints) of the piece the regex matches at i; every class has an
   alternative that matches it, so a piece always starts where the last one ended. */
static long piece_end(const int32_t *cp, const uint8_t *cls, long i, long n) {
  const int32_t c = cp[i];
  /* (?i:'s|'t|'re|'ve|'m|'ll|'d): simple case folding, so 's is also 'S and U+017F */
  if (c == '\'' && i + 1 < n) {
    const int32_t c1 = cp[i + 1];
    if (c1 == 's' || c1 == 'S' || c1 == 0x17F || c1 == 't' || c1 == 'T' || c1 == 'm' ||
        c1 == 'M' || c1 == 'd' || c1 == 'D')
      return i + 2;
    if (i + 2 < n) {
      const int32_t c2 = cp[i + 2];
      if ((c1 == 'r' || c1 == 'R' || c1 == 'v' || c1 == 'V') && (c2 == 'e' || c2 == 'E'))
        return i + 3;
      if ((c1 == 'l' || c1 == 'L') && (c2 == 'l' || c2 == 'L')) return i + 3;
    }
  }
  /* [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+: the optional character is taken where letters follow */
  if (!is_crlf(c) && !(cls[i] & (C_L | C_N)) && i + 1 < n && (cls[i + 1] & (C_L | C_M))) {
    long j = i + 2;
    while (j < n && (cls[j] & (C_L | C_M))) j++;
    return j;
  }
  if (cls[i] & (C_L | C_M)) {
    long j = i + 1;
    while (j < n && (cls[j] & (C_L | C_M))) j++;
    return j;
  }
  /* \p{N} */
  if (cls[i] & C_N) return i + 1;
  /* ' ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*' */
#define OTHER(k) (!(cls[k] & (C_WS | C_L | C_M | C_N)))
  long s = -1;
  if (c == ' ' && i + 1 < n && OTHER(i + 1))
    s = i + 1;
  else if (OTHER(i))
    s = i;
  if (s >= 0) {
    long j = s + 1;
    while (j < n && OTHER(j)) j++;
    while (j < n && is_crlf(cp[j])) j++;
    return j;
  }
#undef OTHER
  /* what is left is White_Space: its run [i, j) */
  long j = i + 1;
  while (j < n && (cls[j] & C_WS)) j++;
  /* \s*[\r\n]+: \s* gives back from the run's end to its last CR or LF */
  for (long k = j - 1; k >= i; k--)
    if (is_crlf(cp[k])) return k + 1;
  /* \s+(?!\S): the whole run at the text's end, else all of it but its last character */
  if (j == n) return j;
  if (j - 1 > i) return j - 1;
  return j; /* \s+ */
}

/* tiktoken's byte_pair_merge over piece p (len >= 2): parts start[0..m), the rank of each part
   with the next in rank[]; appends the parts' ids to out. Returns the ids written, or -1 where
   a part is no token (a vocabulary without one of its bytes). */
static long merge_piece(const struct tandem_bpe *b, const uint8_t *p, long len, long *start,
                        int64_t *rank, int32_t *out) {
  const int64_t none = INT64_MAX;
  long m = len + 1; /* parts' starts, the last one the end */
  for (long i = 0; i < m; i++) {
    start[i] = i;
    rank[i] = none;
  }
  for (long i = 0; i + 2 < m; i++) {
    int32_t r = rank_of(b, p + i, 2);
    rank[i] = r < 0 ? none : r;
  }
  for (;;) {
    long best = -1;
    int64_t min = none;
    for (long i = 0; i + 1 < m; i++)
      if (rank[i] < min) {
        min = rank[i];
        best = i;
      }
    if (best < 0) break;
    /* parts best and best + 1 become one: drop start[best + 1] */
    memmove(start + best + 1, start + best + 2, (m - best - 2) * sizeof(long));
    memmove(rank + best + 1, rank + best + 2, (m - best - 2) * sizeof(int64_t));
    m--;
    for (long i = best - 1; i <= best; i++) {
      if (i < 0) continue;
      if (i + 2 < m) {
        int32_t r = rank_of(b, p + start[i], start[i + 2] - start[i]);
        rank[i] = r < 0 ? none : r;
      } else {
        rank[i] = none;
      }
    }
  }
  for (long i = 0; i + 1 < m; i++) {
    int32_t r = rank_of(b, p + start[i], start[i + 1] - start[i]);
    if (r < 0) return -1;
    out[i] = r;
  }
  return m - 1;
}

/* The same merges for a long piece in O(len log len): the parts a linked list, the pairs in a
   min-heap by (rank, start), so the pair popped is the lowest rank and, among equal ones, the
   leftmost, as merge_piece's scan takes it; an entry whose part is gone or whose rank changed
   since it was pushed is stale and skipped (a start's pair only grows, so its rank never
   comes back to an earlier value). A run of 100,000 spaces (the part tokenizer.py cuts a
   longer run into) takes 36 ms this way, about tiktoken's 30 ms; the scan took minutes. */
struct heap_entry {
  int64_t rank;
  long start;
};

static int entry_less(struct heap_entry a, struct heap_entry b) {
  return a.rank < b.rank || (a.rank == b.rank && a.start < b.start);
}

static void heap_push(struct heap_entry *h, long *size, struct heap_entry e) {
  long i = (*size)++;
  while (i > 0) {
    long parent = (i - 1) / 2;
    if (!entry_less(e, h[parent])) break;
    h[i] = h[parent];
    i = parent;
  }
  h[i] = e;
}

static struct heap_entry heap_pop(struct heap_entry *h, long *size) {
  struct heap_entry top = h[0], last = h[--(*size)];
  long i = 0;
  for (;;) {
    long c = 2 * i + 1;
    if (c >= *size) break;
    if (c + 1 < *size && entry_less(h[c + 1], h[c])) c++;
    if (!entry_less(h[c], last)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = last;
  return top;
}

static long merge_long_piece(const struct tandem_bpe *b, const uint8_t *p, long len,
                             int32_t *out) {
  const int64_t none = INT64_MAX;
  long *next = malloc((len + 1) * sizeof(long));
  long *prev = malloc((len + 1) * sizeof(long));
  int64_t *rank = malloc((len + 1) * sizeof(int64_t));
  uint8_t *alive = malloc(len + 1);
  struct heap_entry *heap = malloc(3 * (len + 1) * sizeof(struct heap_entry));
  long result = -3, size = 0;
  if (!next || !prev || !rank || !alive || !heap) goto done;
  for (long i = 0; i < len; i++) {
    next[i] = i + 1;
    prev[i] = i - 1;
    alive[i] = 1;
    int32_t r = i + 1 < len ? rank_of(b, p + i, 2) : -1;
    rank[i] = r < 0 ? none : r;
    if (r >= 0) heap_push(heap, &size, (struct heap_entry){r, i});
  }
  while (size > 0) {
    struct heap_entry e = heap_pop(heap, &size);
    long i = e.start;
    if (!alive[i] || rank[i] != e.rank) continue;
    long j = next[i], k = next[j]; /* part i takes part j: it now ends at k */
    alive[j] = 0;
    next[i] = k;
    if (k < len) prev[k] = i;
    int32_t r = k < len ? rank_of(b, p + i, next[k] - i) : -1;
    rank[i] = r < 0 ? none : r;
    if (r >= 0) heap_push(heap, &size, (struct heap_entry){r, i});
    long q = prev[i];
    if (q >= 0) {
      r = rank_of(b, p + q, k - q);
      rank[q] = r < 0 ? none : r;
      if (r >= 0) heap_push(heap, &size, (struct heap_entry){r, q});
    }
  }
  long count = 0;
  for (long i = 0; i < len; i = next[i]) {
    int32_t r = rank_of(b, p + i, next[i] - i);
    if (r < 0) {
      result = -2;
      goto done;
    }
    out[count++] = r;
  }
  result = count;
done:
  free(next);
  free(prev);
  free(rank);
  free(alive);
  free(heap);
  return result;
}

/* Pieces at least this long take merge_long_piece (the scan's cost grows as len squared). */
#define LONG_PIECE 128

static long utf8_next(const uint8_t *s, long len, long i, int32_t *cp) {
  uint8_t c = s[i];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  if ((c >> 5) == 6 && i + 1 < len) {
    *cp = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F);
    return 2;
  }
  if ((c >> 4) == 14 && i + 2 < len) {
    *cp = ((c & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
    return 3;
  }
  if ((c >> 3) == 30 && i + 3 < len) {
    *cp = ((c & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) |
          (s[i + 3] & 0x3F);
    return 4;
  }
  return 0;
}

/* The ids of UTF-8 ``text`` (valid: the caller's str encoded) without special tokens, into
   ``out`` (room for len ids: a piece never has more ids than bytes). Returns the count, -1
   where a codepoint is UNSURE or the text is not valid UTF-8, -2 where a piece's part is no
   token, -3 where memory ran out: then the caller asks tiktoken. */
long tandem_bpe_encode(const struct tandem_bpe *b, const uint8_t *text, long len, int32_t *out) {
  if (len == 0) return 0;
  int32_t *cp = malloc(len * sizeof(int32_t));
  uint8_t *cls = malloc(len);
  long *pos = malloc((len + 1) * sizeof(long));
  long *start = malloc((len + 1) * sizeof(long));
  int64_t *rank = malloc((len + 1) * sizeof(int64_t));
  long result = -3;
  if (!cp || !cls || !pos || !start || !rank) goto done;
  long n = 0;
  for (long i = 0; i < len; n++) {
    long k = utf8_next(text, len, i, &cp[n]);
    if (k == 0 || cp[n] > 0x10FFFF) {
      result = -1;
      goto done;
    }
    cls[n] = b->stage2[(long)b->stage1[cp[n] >> 8] * 256 + (cp[n] & 255)];
    if (cls[n] & C_UNSURE) {
      result = -1;
      goto done;
    }
    pos[n] = i;
    i += k;
  }
  pos[n] = len;
  long count = 0;
  for (long i = 0; i < n;) {
    long j = piece_end(cp, cls, i, n);
    const uint8_t *p = text + pos[i];
    long plen = pos[j] - pos[i];
    int32_t whole = rank_of(b, p, plen);
    if (whole >= 0) {
      out[count++] = whole;
    } else if (plen == 1) {
      result = -2;
      goto done;
    } else {
      long got = plen >= LONG_PIECE ? merge_long_piece(b, p, plen, out + count)
                                    : merge_piece(b, p, plen, start, rank, out + count);
      if (got < 0) {
        result = got;
        goto done;
      }
      count += got;
    }
    i = j;
  }
  result = count;
done:
  free(cp);
  free(cls);
  free(pos);
  free(start);
  free(rank);
  return result;
}

/* The bytes of ``ids`` one after another into ``out`` (NULL: only counted). Returns their
   length, or -1 where an id is out of range or has no bytes recorded (``present``). */
long tandem_bpe_decode(const struct tandem_bpe *b, const uint8_t *present, const int64_t *ids,
                       long m, uint8_t *out) {
  long total = 0;
  for (long i = 0; i < m; i++) {
    int64_t id = ids[i];
    if (id < 0 || id >= b->n || !present[id]) return -1;
    long k = b->off[id + 1] - b->off[id];
    if (out) memcpy(out + total, b->blob + b->off[id], k);
    total += k;
  }
  return total;
}
