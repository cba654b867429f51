/* attention_tiles.h — what the tiled attention kernels share (attention.c in
 * fp32, attention_bf16.c on bf16 tile products): the sizes of one call, the
 * vector math of the online softmax (exp2, tanh, soft-capping), the tile
 * copies, and the masks (causal, document, window) at the level of a pair of
 * tiles.
 *
 * Scores are kept in base-2 units: scale * log2(e) is folded into one
 * operand's tile copy, so a probability is a plain exp2 of a difference,
 * computed by a polynomial that vectorizes.
 *
 * Document masking (the _seg entries): seg gives each token a document id,
 * and query i sees key j only when j <= i and seg[j] == seg[i]. A pair of
 * tiles whose tokens are all in one document runs as without seg; a pair
 * with no visible key is skipped; the others mask their scores one by one.
 * A query row may then see no key of a tile, so its running maximum may
 * stay -inf: the exponentials subtract 0 instead (every row sees itself, so
 * its final sum is never 0).
 *
 * Everything here is inlined into the kernels' dispatched functions: a
 * function without LZ_DISPATCH would be compiled for plain x86-64 only. */
#ifndef LZ_ATTENTION_TILES_H
#define LZ_ATTENTION_TILES_H

#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <math.h> /* INFINITY */

#define TILE 64    /* queries and keys per tile */
#define VL 16      /* floats per vector (a 64-byte vector; two halves on AVX2) */
#define ROWS 4     /* rows of a register block */
#define MAX_NV 4   /* vectors of a register block along the head dimension */
#define MAX_HS 256 /* bounds the stack scratch */

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

/* Helpers are always inlined: a function without LZ_DISPATCH would be
 * compiled for plain x86-64 only. They take vectors by pointer, since passing
 * 64-byte vectors by value changes the ABI between the clones. */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
  int64_t B, T, C, NH, HS; /* C = NH * HS: the width of out (and of q) */
  int64_t NKV;             /* key/value heads; NH is a multiple */
  int64_t row;             /* floats per qkv row: (NH + 2 NKV) * HS */
  int64_t HSP;             /* HS rounded up to whole vectors: the row length of tiles */
  int64_t nb;              /* tiles along T */
  int64_t W;               /* window: a query sees its W latest keys; 0 = all */
  float scale;             /* scores' factor, 1/sqrt(HS) unless set */
  float cap;               /* soft-capping of the scaled scores; 0 = none */
} attn_dims;


/* The sizes of qkv's heads (n_head, n_kv_head checked) and the options
 * window, softcap, scale (0: off, 1/sqrt(HS)); attention_entry.c. */
attn_dims lz_attention_dims(const lz_tensor *qkv, int n_head, int n_kv_head, int64_t window,
                            float softcap, float scale);

/* attention_bf16.c: whether its kernel runs here (lz_bf16_attention_path),
 * and the kernel, over every head and tile. */
int lz_attention_bf16_native(void);
lz_status lz_attention_bf16_forward_run(float *out, float *lse, const float *qkv,
                                        const int32_t *seg, attn_dims d);
lz_status lz_attention_bf16_backward_run(float *dqkv, const float *dout, const float *qkv,
                                         const float *out, const float *lse, const int32_t *seg,
                                         attn_dims d);
/* One decoding query (head_dim hs, a multiple of 32, at most MAX_HS) against
 * n positions of a bf16 cache (keys and values stride elements apart): out =
 * softmax(scale q K^T, soft-capped when cap) V. scores: room for n rounded up
 * to 16 floats, 64-byte aligned. */
void lz_attention_bf16_decode_query(float *out, const float *q, const uint16_t *k,
                                    const uint16_t *v, int64_t n, int64_t stride, int64_t hs,
                                    float scale, float cap, float *scores);

/* ------------------------------------------------------------ vector math */

INLINE void v_splat(vf *y, float x) {
  vf z = {0};
  *y = z + x;
}

/* Selects are written lane by lane (a > b ? a : b): GCC makes one max, min
 * or blend per register of them, while a comparison of whole 64-byte
 * vectors where AVX-512 is not there became a compare and a move per lane. */
INLINE void v_max(vf *y, const vf *a, const vf *b) {
  vf r;
  for (int l = 0; l < VL; l++) r[l] = (*a)[l] > (*b)[l] ? (*a)[l] : (*b)[l];
  *y = r;
}

/* 2^x, relative error about 2e-7; 0 for x <= -127 (and for -inf). Cephes'
 * exp2f polynomial on the fraction in [-0.5, 0.5]. */
INLINE void v_exp2(vf *y, const vf *xp) {
  vf x; /* x clamped to [-127, 127] (NaN stays NaN) */
  for (int l = 0; l < VL; l++) {
    const float t = -127.0f > (*xp)[l] ? -127.0f : (*xp)[l];
    x[l] = 127.0f < t ? 127.0f : t;
  }
  vf r = x + 12582912.0f; /* 1.5 * 2^23: rounds x to an integer in the low bits */
  vf n = r - 12582912.0f;
  vf f = x - n;
  vi ni = (vi)r - 0x4B400000;
  vf pow2n = (vf)((ni + 127) << 23); /* 0.0 when n = -127 */
  vf p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  *y = (p * f + 1.0f) * pow2n;
}

/* tanh(x), within a few fp32 ulps: Cephes' tanhf, an odd polynomial
 * below |x| = 0.625 and 1 - 2 / (e^2|x| + 1) above, with the sign. */
INLINE void v_tanh(vf *y, const vf *xp) {
  const vf x = *xp;
  vf z, e, big, small;
  for (int l = 0; l < VL; l++) z[l] = x[l] < 0.0f ? -x[l] : x[l]; /* |x| */
  vf t = z * (2.0f * LOG2E);
  v_exp2(&e, &t);
  big = 1.0f - 2.0f / (e + 1.0f);
  const vf s = z * z;
  vf p = s * -5.70498872745e-3f + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  small = p * s * z + z;
  for (int l = 0; l < VL; l++) {
    const float r = z[l] <= 0.625f ? small[l] : big[l];
    (*y)[l] = x[l] < 0.0f ? -r : r;
  }
}

/* s -> cap tanh(s / cap) * mul over n floats (a multiple of VL, s aligned);
 * tn, when given, takes the tanh values. */
INLINE void soft_cap(float *s, float *tn, int64_t n, float cap, float mul) {
  const float inv = 1.0f / cap, cm = cap * mul;
  for (int64_t i = 0; i < n; i += VL) {
    vf x = *(vf *)(s + i) * inv, t;
    v_tanh(&t, &x);
    if (tn) *(vf *)(tn + i) = t;
    *(vf *)(s + i) = t * cm;
  }
}

/* A query's n scores (base-2 units; with cap, scaled scores, capped and
 * turned base-2 here) become its softmax's weights before normalizing,
 * exp2(s - max), in place over np floats (n rounded up to VL, 64-byte
 * aligned; the padding gets 0). Returns their sum. */
INLINE float scores_to_weights(float *sc, int64_t n, int64_t np, float cap) {
  for (int64_t j = n; j < np; j++) sc[j] = 0.0f;
  if (cap) soft_cap(sc, NULL, np, cap, LOG2E);
  for (int64_t j = n; j < np; j++) sc[j] = -INFINITY; /* exp2 gives them 0 */
  vf mx;
  v_splat(&mx, -INFINITY);
  for (int64_t j = 0; j < np; j += VL) v_max(&mx, &mx, (const vf *)(sc + j));
  float m = -INFINITY;
  for (int i = 0; i < VL; i++) m = mx[i] > m ? mx[i] : m;
  vf sum = {0};
  for (int64_t j = 0; j < np; j += VL) {
    vf x = *(vf *)(sc + j) - m, e;
    v_exp2(&e, &x);
    *(vf *)(sc + j) = e;
    sum += e;
  }
  float l = 0.0f;
  for (int i = 0; i < VL; i++) l += sum[i];
  return l;
}

/* ------------------------------------------------------------ tile copies */

/* dst[i][0:hsp] = src[i*stride + 0:hs] * mul for i < n, zero beyond (columns
 * hs..hsp and rows n..TILE). */
INLINE void load_rows(float *restrict dst, int64_t hsp, const float *restrict src, int64_t stride,
                      int64_t n, int64_t hs, float mul) {
  for (int64_t i = 0; i < TILE; i++) {
    float *d = dst + i * hsp;
    if (i < n) {
      const float *s = src + i * stride;
      for (int64_t c = 0; c < hs; c++) d[c] = s[c] * mul;
      for (int64_t c = hs; c < hsp; c++) d[c] = 0.0f;
    } else {
      for (int64_t c = 0; c < hsp; c++) d[c] = 0.0f;
    }
  }
}

/* dst[c][j] = src[j*stride + c] * mul for c < hs, j < n; columns n..TILE zero. */
INLINE void load_transposed(float *restrict dst, const float *restrict src, int64_t stride,
                            int64_t n, int64_t hs, float mul) {
  for (int64_t j = 0; j < n; j++) {
    const float *s = src + j * stride;
    for (int64_t c = 0; c < hs; c++) dst[c * TILE + j] = s[c] * mul;
  }
  if (n < TILE)
    for (int64_t c = 0; c < hs; c++)
      for (int64_t j = n; j < TILE; j++) dst[c * TILE + j] = 0.0f;
}

/* Asks for n rows of hs floats, `stride` apart, ahead of use: rows of a head
 * sit 3C floats apart, each on its own page, which the hardware prefetcher
 * does not follow. */
INLINE void prefetch_rows(const float *src, int64_t stride, int64_t n, int64_t hs) {
  for (int64_t j = 0; j < n; j++) {
    const char *p = (const char *)(src + j * stride);
    for (int64_t off = 0; off < hs * 4; off += 64) __builtin_prefetch(p + off, 0, 3);
    __builtin_prefetch(p + hs * 4 - 1, 0, 3);
  }
}

static inline float *align64(float *p) { return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* ---------------------------------------------------------- document masks */

/* How queries [i0, i0+nq) meet keys [j0, j0+nk) of one sequence. */
enum { MEET_ALL, MEET_SOME, MEET_NONE };

static inline int tiles_meet(const int32_t *sg, int64_t i0, int64_t nq, int64_t j0, int64_t nk) {
  if (!sg) return MEET_ALL;
  const int32_t first = sg[j0];
  int one = 1;
  for (int64_t j = j0; j < j0 + nk && one; j++) one = sg[j] == first;
  for (int64_t i = i0; i < i0 + nq && one; i++) one = sg[i] == first;
  if (one) return MEET_ALL;
  for (int64_t i = i0; i < i0 + nq; i++)
    for (int64_t j = j0; j < j0 + nk && j <= i; j++)
      if (sg[j] == sg[i]) return MEET_SOME;
  return MEET_NONE;
}

/* ----------------------------------------------------------- window masks */

/* The first key tile a query tile starting at i0 reaches. */
static inline int64_t first_key_tile(const attn_dims *d, int64_t i0) {
  return d->W && i0 - d->W + 1 > 0 ? (i0 - d->W + 1) / TILE : 0;
}

/* The last query tile a key tile [j0, j0+nk) reaches. */
static inline int64_t last_query_tile(const attn_dims *d, int64_t j0, int64_t nk) {
  if (!d->W) return d->nb - 1;
  const int64_t last = j0 + nk - 1 + d->W - 1;
  return last < d->T ? last / TILE : d->nb - 1;
}

/* Whether some query of [i0, i0+nq) is W or more past some key from j0 on:
 * the pair's scores need the window's mask. */
static inline int window_cuts(const attn_dims *d, int64_t i0, int64_t nq, int64_t j0) {
  return d->W && i0 + nq - 1 - j0 >= d->W;
}

#endif
