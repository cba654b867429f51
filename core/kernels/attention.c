/* attention.c — causal self-attention, multi-head (GPT-2) and grouped-query
 * (Llama: n_kv_head key/value heads, each shared by n_head/n_kv_head query
 * heads), forward and backward, computed in tiles of TILE queries x TILE keys (flash-attention
 * style) so no T x T matrix is ever stored.
 *
 * Forward keeps, per query row, a running maximum and sum of the softmax and
 * rescales its output accumulator when the maximum grows; it saves the row's
 * log-sum-exp so backward can recompute the probabilities tile by tile.
 * Backward walks key tiles outermost: dK and dV of a key tile build up in
 * scratch over the query heads of its group, in head order, and their query
 * tiles; dQ builds up in the output itself.
 *
 * Scores are kept in base-2 units: (1/sqrt(HS)) * log2(e) is folded into the
 * tile copy of one operand (Q in forward, K in backward), so a probability is
 * a plain exp2 of a difference, computed by a polynomial that vectorizes.
 *
 * The tile products are register-blocked with GCC vector types (16 floats:
 * one AVX-512 register, two AVX2 ones) and compiled per instruction set by
 * LZ_DISPATCH; all helpers are inlined into the two dispatched functions.
 *
 * Every output row is computed by one thread in a fixed order, so results are
 * bitwise the same on every run and for every thread count. All scratch is on
 * the stack of the thread that uses it, at most (8 * TILE * HS' + 2 * TILE^2)
 * floats (HS' = HS rounded up to 16): 160 KiB at HS = 64, 544 KiB at the
 * largest head size accepted, MAX_HS.
 *
 * Document masking (the _seg entries): seg gives each token a document id,
 * and query i sees key j only when j <= i and seg[j] == seg[i]. A pair of
 * tiles whose tokens are all in one document runs as without seg; a pair
 * with no visible key is skipped; the others mask their scores one by one.
 * A query row may then see no key of a tile, so its running maximum may
 * stay -inf: the exponentials subtract 0 instead (every row sees itself, so
 * its final sum is never 0). */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <math.h> /* log2f, sqrtf, isinf, INFINITY */

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

/* ------------------------------------------------------------ vector math */

INLINE void v_splat(vf *y, float x) {
  vf z = {0};
  *y = z + x;
}

INLINE void v_max(vf *y, const vf *a, const vf *b) {
  vi gt = *a > *b;
  *y = (vf)(((vi)*a & gt) | ((vi)*b & ~gt));
}

/* 2^x, relative error about 2e-7; 0 for x <= -127 (and for -inf). Cephes'
 * exp2f polynomial on the fraction in [-0.5, 0.5]. */
INLINE void v_exp2(vf *y, const vf *xp) {
  vf lo, hi, x = *xp;
  v_splat(&lo, -127.0f);
  v_splat(&hi, 127.0f);
  vi m = x < lo;
  x = (vf)(((vi)x & ~m) | ((vi)lo & m));
  m = x > hi;
  x = (vf)(((vi)x & ~m) | ((vi)hi & m));
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

/* ----------------------------------------------------------- tile kernels */

/* s[r][0 : nv*VL] = sum_d a[r*lda + d] * bt[d*TILE + ...], r < ROWS: one
 * register block of a (rows) x (keys) product against a transposed tile. */
INLINE void block_nt(float *restrict s, const float *restrict a, int64_t lda,
                     const float *restrict bt, int64_t n, const int nv) {
  vf acc[ROWS][MAX_NV];
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < nv; v++) v_splat(&acc[r][v], 0.0f);
  for (int64_t d = 0; d < n; d++) {
    const vf *b = (const vf *)(bt + d * TILE);
    float ar[ROWS];
    for (int r = 0; r < ROWS; r++) ar[r] = a[r * lda + d];
    for (int v = 0; v < nv; v++) {
      vf bv = b[v];
      for (int r = 0; r < ROWS; r++) acc[r][v] += ar[r] * bv;
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < nv; v++) ((vf *)(s + r * TILE))[v] = acc[r][v];
}

/* The scores of `nrows` rows (a multiple of ROWS) of a against the TILE
 * columns of bt; on the diagonal tile only the columns up to each register
 * block's last row (the rest are masked anyway). */
INLINE void tile_nt(float *restrict s, const float *restrict a, int64_t lda,
                    const float *restrict bt, int64_t n, int64_t nrows, int diag) {
  for (int64_t r0 = 0; r0 < nrows; r0 += ROWS) {
    int nv = diag ? (int)((r0 + ROWS - 1) / VL + 1) : TILE / VL;
    switch (nv) {
      case 1:
        block_nt(s + r0 * TILE, a + r0 * lda, lda, bt, n, 1);
        break;
      case 2:
        block_nt(s + r0 * TILE, a + r0 * lda, lda, bt, n, 2);
        break;
      case 3:
        block_nt(s + r0 * TILE, a + r0 * lda, lda, bt, n, 3);
        break;
      default:
        block_nt(s + r0 * TILE, a + r0 * lda, lda, bt, n, 4);
        break;
    }
  }
}

/* One register block of rows against the columns from vector v0 to the end
 * of the tile. */
INLINE void tile_nt_cols(float *restrict s, const float *restrict a, int64_t lda,
                         const float *restrict bt, int64_t n, int v0) {
  switch (TILE / VL - v0) {
    case 1:
      block_nt(s + v0 * VL, a, lda, bt + v0 * VL, n, 1);
      break;
    case 2:
      block_nt(s + v0 * VL, a, lda, bt + v0 * VL, n, 2);
      break;
    case 3:
      block_nt(s + v0 * VL, a, lda, bt + v0 * VL, n, 3);
      break;
    default:
      block_nt(s + v0 * VL, a, lda, bt + v0 * VL, n, 4);
      break;
  }
}

/* out[r][0 : nv*VL] = init_r + sum_{k0 <= k < k1} coef[r*rs + k*ks] * m[k*ldm + ...],
 * r < ROWS, where init_r is out[r] * alpha[r], or 0 when alpha is NULL. */
INLINE void block_nn(float *restrict out, int64_t ldo, const float *restrict coef, int64_t rs,
                     int64_t ks, const float *restrict m, int64_t ldm, int64_t k0, int64_t k1,
                     const float *restrict alpha, const int nv) {
  vf acc[ROWS][MAX_NV];
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < nv; v++) {
      if (alpha)
        acc[r][v] = ((const vf *)(out + r * ldo))[v] * alpha[r];
      else
        v_splat(&acc[r][v], 0.0f);
    }
  for (int64_t k = k0; k < k1; k++) {
    const vf *mv = (const vf *)(m + k * ldm);
    float cr[ROWS];
    for (int r = 0; r < ROWS; r++) cr[r] = coef[r * rs + k * ks];
    for (int v = 0; v < nv; v++) {
      vf x = mv[v];
      for (int r = 0; r < ROWS; r++) acc[r][v] += cr[r] * x;
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < nv; v++) ((vf *)(out + r * ldo))[v] = acc[r][v];
}

/* block_nn over the whole padded head dimension hsp, MAX_NV vectors at a time. */
INLINE void rows_nn(float *restrict out, int64_t ldo, const float *restrict coef, int64_t rs,
                    int64_t ks, const float *restrict m, int64_t ldm, int64_t k0, int64_t k1,
                    const float *restrict alpha, int64_t hsp) {
  for (int64_t c = 0; c < hsp; c += MAX_NV * VL) {
    int64_t nv = (hsp - c) / VL;
    switch (nv) {
      case 1:
        block_nn(out + c, ldo, coef, rs, ks, m + c, ldm, k0, k1, alpha, 1);
        break;
      case 2:
        block_nn(out + c, ldo, coef, rs, ks, m + c, ldm, k0, k1, alpha, 2);
        break;
      case 3:
        block_nn(out + c, ldo, coef, rs, ks, m + c, ldm, k0, k1, alpha, 3);
        break;
      default:
        block_nn(out + c, ldo, coef, rs, ks, m + c, ldm, k0, k1, alpha, 4);
        break;
    }
  }
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

static float *align64(float *p) { return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* ---------------------------------------------------------- document masks */

/* How queries [i0, i0+nq) meet keys [j0, j0+nk) of one sequence. */
enum { MEET_ALL, MEET_SOME, MEET_NONE };

static int tiles_meet(const int32_t *sg, int64_t i0, int64_t nq, int64_t j0, int64_t nk) {
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
static int64_t first_key_tile(const attn_dims *d, int64_t i0) {
  return d->W && i0 - d->W + 1 > 0 ? (i0 - d->W + 1) / TILE : 0;
}

/* The last query tile a key tile [j0, j0+nk) reaches. */
static int64_t last_query_tile(const attn_dims *d, int64_t j0, int64_t nk) {
  if (!d->W) return d->nb - 1;
  const int64_t last = j0 + nk - 1 + d->W - 1;
  return last < d->T ? last / TILE : d->nb - 1;
}

/* Whether some query of [i0, i0+nq) is W or more past some key from j0 on:
 * the pair's scores need the window's mask. */
static int window_cuts(const attn_dims *d, int64_t i0, int64_t nq, int64_t j0) {
  return d->W && i0 + nq - 1 - j0 >= d->W;
}

/* tanh(x), within a few fp32 ulps: Cephes' tanhf, an odd polynomial
 * below |x| = 0.625 and 1 - 2 / (e^2|x| + 1) above, with the sign. */
INLINE void v_tanh(vf *y, const vf *xp) {
  const vf x = *xp;
  vf zero, z, e, big, small;
  v_splat(&zero, 0.0f);
  const vi neg = x < zero;
  z = (vf)(((vi)-x & neg) | ((vi)x & ~neg)); /* |x| */
  vf t = z * (2.0f * LOG2E);
  v_exp2(&e, &t);
  big = 1.0f - 2.0f / (e + 1.0f);
  const vf s = z * z;
  vf p = s * -5.70498872745e-3f + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  small = p * s * z + z;
  const vi low = z <= 0.625f;
  z = (vf)(((vi)small & low) | ((vi)big & ~low));
  *y = (vf)(((vi)-z & neg) | ((vi)z & ~neg));
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

/* ---------------------------------------------------------------- forward */

/* One query tile of one (batch, head): out rows [qb*TILE, +TILE) and their lse.
 * Scores are held transposed, st[key][query], so the online softmax runs
 * down the keys with a vector of 16 queries at a time: its maxima, sums and
 * rescale factors are vectors, with no reduction across lanes. */
LZ_DISPATCH static void attention_forward_tile(float *out, float *lse, const float *qkv,
                                               const int32_t *seg, attn_dims d, int64_t b,
                                               int64_t h, int64_t qb) {
  const int64_t T = d.T, C = d.C, HS = d.HS, HSP = d.HSP, row = d.row;
  const int64_t i0 = qb * TILE, nq = T - i0 < TILE ? T - i0 : TILE;
  const float *qbase = qkv + b * T * row + h * HS;
  const float *kbase = qkv + b * T * row + C + h / (d.NH / d.NKV) * HS;
  const float *vbase = kbase + d.NKV * HS;
  const int nvq = TILE / VL;
  const int32_t *sg = seg ? seg + b * T : NULL; /* this sequence's documents */

  float scratch[4 * TILE * HSP + TILE * TILE + 16];
  float *qt = align64(scratch); /* [HSP][TILE] queries, scaled to base-2 scores */
  float *k = qt + TILE * HSP;   /* [TILE][HSP] */
  float *v = k + TILE * HSP;    /* [TILE][HSP] */
  float *o = v + TILE * HSP;    /* [TILE][HSP] unnormalised output */
  float *st = o + TILE * HSP;   /* [TILE][TILE] scores, then probabilities */
  float m[TILE] __attribute__((aligned(64))), l[TILE] __attribute__((aligned(64)));
  float alpha[TILE] __attribute__((aligned(64)));
  vf *mv = (vf *)m, *lv = (vf *)l, *av = (vf *)alpha;

  prefetch_rows(kbase, row, T < TILE ? T : TILE, HS);
  prefetch_rows(vbase, row, T < TILE ? T : TILE, HS);
  /* Capped scores take log2(e) after the cap. */
  load_transposed(qt, qbase + i0 * row, row, nq, HS, d.cap ? d.scale : d.scale * LOG2E);
  for (int64_t i = 0; i < TILE * HSP; i++) o[i] = 0.0f;
  for (int vq = 0; vq < nvq; vq++) {
    v_splat(&mv[vq], -INFINITY);
    v_splat(&lv[vq], 0.0f);
  }

  for (int64_t kb = first_key_tile(&d, i0); kb <= qb; kb++) {
    const int64_t j0 = kb * TILE, nk = T - j0 < TILE ? T - j0 : TILE;
    const int64_t nkr = (nk + ROWS - 1) / ROWS * ROWS;
    const int diag = kb == qb;
    const int meet = tiles_meet(sg, i0, nq, j0, nk);
    const int cut = window_cuts(&d, i0, nq, j0);
    if (meet == MEET_NONE) continue;
    if (kb < qb) {
      const int64_t n_next = T - j0 - TILE < TILE ? T - j0 - TILE : TILE;
      prefetch_rows(kbase + (j0 + TILE) * row, row, n_next, HS);
      prefetch_rows(vbase + (j0 + TILE) * row, row, n_next, HS);
    }
    load_rows(k, HSP, kbase + j0 * row, row, nk, HS, 1.0f);
    load_rows(v, HSP, vbase + j0 * row, row, nk, HS, 1.0f);
    /* On the diagonal, key block r0 is seen only by queries from r0 on. */
    for (int64_t r0 = 0; r0 < nkr; r0 += ROWS) {
      const int v0 = diag ? (int)(r0 / VL) : 0;
      tile_nt_cols(st + r0 * TILE, k + r0 * HSP, HSP, qt, HS, v0);
    }
    if (d.cap) soft_cap(st, NULL, nk * TILE, d.cap, LOG2E);
    if (cut) /* keys W or more behind the query */
      for (int64_t j = 0; j < nk; j++)
        for (int64_t i = 0; i < nq; i++)
          if (i0 + i - (j0 + j) >= d.W) st[j * TILE + i] = -INFINITY;

    if (meet == MEET_SOME) /* keys of another document */
      for (int64_t j = 0; j < nk; j++)
        for (int64_t i = 0; i < nq; i++)
          if (sg[j0 + j] != sg[i0 + i]) st[j * TILE + i] = -INFINITY;

    /* Padded queries (past nq) get finite, unused values: no special case. */
    for (int vq = 0; vq < nvq; vq++) {
      const int64_t q0 = (int64_t)vq * VL;
      const int64_t jend = diag ? (q0 + VL < nk ? q0 + VL : nk) : nk;
      if (diag) /* mask key j > query i, both in this vector's span */
        for (int64_t j = q0; j < jend; j++)
          for (int64_t i = q0; i < j; i++) st[j * TILE + i] = -INFINITY;
      vf mx = mv[vq];
      for (int64_t j = 0; j < jend; j++) v_max(&mx, &mx, (const vf *)(st + j * TILE) + vq);
      vf ms = mx; /* what the exponentials subtract */
      if (meet == MEET_SOME || cut) {
        vf ninf;
        v_splat(&ninf, -INFINITY);
        vi none = ms == ninf; /* rows that saw no key yet subtract 0 */
        ms = (vf)((vi)ms & ~none);
      }
      vf x = mv[vq] - ms, sum;
      v_exp2(&av[vq], &x);
      v_splat(&sum, 0.0f);
      for (int64_t j = 0; j < jend; j++) {
        vf *p = (vf *)(st + j * TILE) + vq;
        x = *p - ms;
        v_exp2(p, &x);
        sum += *p;
      }
      lv[vq] = lv[vq] * av[vq] + sum;
      mv[vq] = mx;
    }

    for (int64_t r0 = 0; r0 < nq; r0 += ROWS) {
      const int64_t k1 = diag ? (r0 + ROWS < nk ? r0 + ROWS : nk) : nk;
      rows_nn(o + r0 * HSP, HSP, st + r0, 1, TILE, v, HSP, 0, k1, alpha + r0, HSP);
    }
  }

  for (int64_t i = 0; i < nq; i++) {
    const float inv = 1.0f / l[i];
    float *dst = out + (b * T + i0 + i) * C + h * HS;
    for (int64_t cc = 0; cc < HS; cc++) dst[cc] = o[i * HSP + cc] * inv;
    lse[(b * d.NH + h) * T + i0 + i] = (m[i] + log2f(l[i])) * LN2;
  }
}

/* --------------------------------------------------------------- backward */

/* All of dk, dv of one (batch, key/value head g) and dq of the query heads
 * that share it. With P = softmax, D_i = dout_i . out_i:
 *   dv_j = sum_i P_ij dout_i,  dP_ij = dout_i . v_j,  dS_ij = P_ij (dP_ij - D_i),
 *   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i. */
LZ_DISPATCH static void attention_backward_group(float *dqkv, const float *dout, const float *qkv,
                                                 const float *out, const float *lse,
                                                 const int32_t *seg, attn_dims d, int64_t b,
                                                 int64_t g) {
  const int64_t T = d.T, C = d.C, HS = d.HS, HSP = d.HSP, row = d.row;
  const int64_t group = d.NH / d.NKV;
  const int64_t koff = b * T * row + C + g * HS, voff = koff + d.NKV * HS;
  const float *kbase = qkv + koff, *vbase = qkv + voff;
  float *dkbase = dqkv + koff, *dvbase = dqkv + voff;

  float scratch[8 * TILE * HSP + 2 * TILE * TILE + 16];
  float *k = align64(scratch); /* [TILE][HSP] */
  float *kt = k + TILE * HSP;  /* [HSP][TILE], scaled to base-2 scores */
  float *vt = kt + TILE * HSP; /* [HSP][TILE] */
  float *dk = vt + TILE * HSP; /* [TILE][HSP] */
  float *dv = dk + TILE * HSP; /* [TILE][HSP] */
  float *q = dv + TILE * HSP;  /* [TILE][HSP] */
  float *dO = q + TILE * HSP;  /* [TILE][HSP] */
  float *dq = dO + TILE * HSP; /* [TILE][HSP] */
  float *p = dq + TILE * HSP;  /* [TILE][TILE] probabilities, then dS */
  float *dp = p + TILE * TILE; /* [TILE][TILE] */
  float lse2[TILE], D[TILE], ones[ROWS];
  for (int r = 0; r < ROWS; r++) ones[r] = 1.0f;
  const float c = d.cap ? d.scale : d.scale * LOG2E; /* capped scores take log2(e) after */
  const int32_t *sg = seg ? seg + b * T : NULL; /* this sequence's documents */

  for (int64_t kb = 0; kb < d.nb; kb++) {
    const int64_t j0 = kb * TILE, nk = T - j0 < TILE ? T - j0 : TILE;
    const int64_t nkr = (nk + ROWS - 1) / ROWS * ROWS;
    load_rows(k, HSP, kbase + j0 * row, row, nk, HS, 1.0f);
    load_transposed(kt, kbase + j0 * row, row, nk, HS, c);
    load_transposed(vt, vbase + j0 * row, row, nk, HS, 1.0f);
    for (int64_t i = 0; i < TILE * HSP; i++) dk[i] = dv[i] = 0.0f;

    for (int64_t h = g * group; h < (g + 1) * group; h++) {
      const int64_t qoff = b * T * row + h * HS;
      const float *qbase = qkv + qoff;
      float *dqbase = dqkv + qoff;
      const float *obase = out + b * T * C + h * HS, *dobase = dout + b * T * C + h * HS;
      const float *lse_bh = lse + (b * d.NH + h) * T;
      const int64_t qb_end = last_query_tile(&d, j0, nk) + 1;
      for (int64_t qb = kb; qb < qb_end; qb++) {
        const int64_t i0 = qb * TILE, nq = T - i0 < TILE ? T - i0 : TILE;
        const int64_t nqr = (nq + ROWS - 1) / ROWS * ROWS;
        const int diag = kb == qb;
        const int meet = tiles_meet(sg, i0, nq, j0, nk);
        const int cut = window_cuts(&d, i0, nq, j0);
        const int first = kb == first_key_tile(&d, i0); /* writes dq; later key tiles add */
        if (meet == MEET_NONE) { /* no key here reaches these queries */
          if (first)
            for (int64_t i = 0; i < nq; i++)
              for (int64_t cc = 0; cc < HS; cc++) dqbase[(i0 + i) * row + cc] = 0.0f;
          continue;
        }
        /* Fetch ahead what the next step reads: the next query tile, or at the
         * end of this key tile the next key tile and its first query tile. */
        const int64_t nqb = qb + 1 < qb_end ? qb + 1 : kb + 1;
        if (nqb < d.nb) {
          const int64_t n_next = T - nqb * TILE < TILE ? T - nqb * TILE : TILE;
          prefetch_rows(qbase + nqb * TILE * row, row, n_next, HS);
          prefetch_rows(dobase + nqb * TILE * C, C, n_next, HS);
          prefetch_rows(obase + nqb * TILE * C, C, n_next, HS);
          prefetch_rows(dqbase + nqb * TILE * row, row, n_next, HS);
          if (qb + 1 == qb_end && h + 1 == (g + 1) * group) {
            prefetch_rows(kbase + nqb * TILE * row, row, n_next, HS);
            prefetch_rows(vbase + nqb * TILE * row, row, n_next, HS);
          }
        }
        load_rows(q, HSP, qbase + i0 * row, row, nq, HS, 1.0f);
        load_rows(dO, HSP, dobase + i0 * C, C, nq, HS, 1.0f);
        for (int64_t i = 0; i < nq; i++) {
          const float *oi = obase + (i0 + i) * C, *di = dO + i * HSP;
          float acc[VL] = {0};
          int64_t cc = 0;
          for (; cc + VL <= HS; cc += VL)
            for (int ll = 0; ll < VL; ll++) acc[ll] += di[cc + ll] * oi[cc + ll];
          float sum = 0.0f;
          for (int ll = 0; ll < VL; ll++) sum += acc[ll];
          for (; cc < HS; cc++) sum += di[cc] * oi[cc];
          D[i] = sum;
          lse2[i] = lse_bh[i0 + i] * LOG2E;
        }

        tile_nt(p, q, HSP, kt, HS, nqr, diag);
        tile_nt(dp, dO, HSP, vt, HS, nqr, diag);
        /* P = exp2(S - lse2) and dS = P (dP - D), over the same lanes forward used. */
        for (int64_t i = 0; i < nqr; i++) {
          float *pi = p + i * TILE, *dpi = dp + i * TILE;
          if (i >= nq) {
            for (int j = 0; j < TILE; j++) pi[j] = dpi[j] = 0.0f;
            continue;
          }
          const int64_t n = diag ? i + 1 : nk, nv = (n + VL - 1) / VL;
          vf ls, dd;
          v_splat(&ls, lse2[i]);
          v_splat(&dd, D[i]);
          float tn[TILE] __attribute__((aligned(64))); /* tanh of the capped scores */
          if (d.cap) soft_cap(pi, tn, nv * VL, d.cap, LOG2E);
          for (int64_t vv = 0; vv < nv; vv++) {
            vf x = ((vf *)pi)[vv] - ls;
            v_exp2((vf *)pi + vv, &x);
          }
          for (int64_t j = n; j < nv * VL; j++) pi[j] = 0.0f;
          if (meet == MEET_SOME) /* keys of another document */
            for (int64_t j = 0; j < n; j++)
              if (sg[j0 + j] != sg[i0 + i]) pi[j] = 0.0f;
          if (cut) /* keys W or more behind the query */
            for (int64_t j = 0; j < n && i0 + i - (j0 + j) >= d.W; j++) pi[j] = 0.0f;
          for (int64_t vv = 0; vv < nv; vv++)
            ((vf *)dpi)[vv] = ((vf *)pi)[vv] * (((vf *)dpi)[vv] - dd);
          if (d.cap) /* through the cap: d(cap tanh(s/cap))/ds = 1 - tanh^2 */
            for (int64_t j = 0; j < nv * VL; j++) dpi[j] *= 1.0f - tn[j] * tn[j];
        }

        /* dv, dk rows are keys: query i reaches key j only from i = j on. */
        for (int64_t r0 = 0; r0 < nkr; r0 += ROWS) {
          const int64_t i_begin = diag ? r0 : 0;
          rows_nn(dv + r0 * HSP, HSP, p + r0, 1, TILE, dO, HSP, i_begin, nq, ones, HSP);
          rows_nn(dk + r0 * HSP, HSP, dp + r0, 1, TILE, q, HSP, i_begin, nq, ones, HSP);
        }
        for (int64_t r0 = 0; r0 < nqr; r0 += ROWS) {
          const int64_t k1 = diag ? (r0 + ROWS < nk ? r0 + ROWS : nk) : nk;
          rows_nn(dq + r0 * HSP, HSP, dp + r0 * TILE, TILE, 1, k, HSP, 0, k1, NULL, HSP);
        }
        /* The first key tile to reach a query row writes, later ones add. */
        for (int64_t i = 0; i < nq; i++) {
          float *dst = dqbase + (i0 + i) * row;
          const float *src = dq + i * HSP;
          if (first)
            for (int64_t cc = 0; cc < HS; cc++) dst[cc] = src[cc] * d.scale;
          else
            for (int64_t cc = 0; cc < HS; cc++) dst[cc] += src[cc] * d.scale;
        }
      }
    }

    for (int64_t j = 0; j < nk; j++) {
      float *dkd = dkbase + (j0 + j) * row, *dvd = dvbase + (j0 + j) * row;
      for (int64_t cc = 0; cc < HS; cc++) {
        dkd[cc] = dk[j * HSP + cc] * d.scale;
        dvd[cc] = dv[j * HSP + cc];
      }
    }
  }
}

/* ------------------------------------------------------------------ checks */

static lz_status check_shape3(const char *op, const char *name, const lz_tensor *t, int64_t d0,
                              int64_t d1, int64_t d2, const char *what, const lz_tensor *qkv) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->ndim != 3 || t->shape[0] != d0 || t->shape[1] != d1 || t->shape[2] != d2) {
    char bt[96], bq[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected f32[%lld,%lld,%lld] (%s, from qkv %s)",
                   op, name, lz_tensor_describe(t, bt, sizeof bt), (long long)d0, (long long)d1,
                   (long long)d2, what, lz_tensor_describe(qkv, bq, sizeof bq));
  }
  return LZ_OK;
}

/* The sizes of qkv's heads, for n_head and n_kv_head already checked, and
 * the options window, softcap, scale (0: off, 1/sqrt(HS)). */
static attn_dims dims_of(const lz_tensor *qkv, int n_head, int n_kv_head, int64_t window,
                         float softcap, float scale) {
  attn_dims d;
  const int64_t parts = n_head + 2 * (int64_t)n_kv_head; /* heads of q, k and v in a row */
  d.B = qkv->shape[0];
  d.T = qkv->shape[1];
  d.HS = qkv->shape[2] / parts;
  d.C = d.HS * n_head;
  d.row = qkv->shape[2];
  d.NH = n_head;
  d.NKV = n_kv_head;
  d.HSP = (d.HS + VL - 1) / VL * VL;
  d.nb = (d.T + TILE - 1) / TILE;
  d.scale = scale ? scale : d.HS ? 1.0f / sqrtf((float)d.HS) : 0.0f;
  d.W = window;
  d.cap = softcap;
  return d;
}

/* Checks qkv's shape, n_head and n_kv_head and fills d. */
static lz_status check_qkv(const char *op, const lz_tensor *qkv, int n_head, int n_kv_head,
                           attn_dims *d) {
  LZ_TRY(lz_check_ndim(op, "qkv", qkv, 3, 3));
  char b[96];
  if (n_head < 1) return lz_fail(LZ_ERR_INVALID, "%s: n_head is %d; it must be >= 1", op, n_head);
  if (n_kv_head < 1 || n_head % n_kv_head != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: n_kv_head is %d; it must be >= 1 and divide n_head = %d (each key/value "
                   "head serves n_head/n_kv_head query heads)",
                   op, n_kv_head, n_head);
  const int64_t parts = n_head + 2 * (int64_t)n_kv_head; /* heads of q, k and v in a row */
  if (n_kv_head == n_head && qkv->shape[2] % 3 != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s; its last dimension must be 3C (q, k and v side by side), "
                   "and %lld is not a multiple of 3",
                   op, lz_tensor_describe(qkv, b, sizeof b), (long long)qkv->shape[2]);
  if (n_kv_head == n_head && (qkv->shape[2] / 3) % n_head != 0)
    return lz_fail(LZ_ERR_INVALID, "%s: C = %lld (qkv %s) is not divisible by n_head = %d", op,
                   (long long)(qkv->shape[2] / 3), lz_tensor_describe(qkv, b, sizeof b), n_head);
  if (qkv->shape[2] % parts != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s; its last dimension must be (n_head + 2 n_kv_head) * head_dim "
                   "= %lld * head_dim (q, then k and v of n_kv_head heads), and %lld is not a "
                   "multiple of %lld",
                   op, lz_tensor_describe(qkv, b, sizeof b), (long long)parts,
                   (long long)qkv->shape[2], (long long)parts);
  *d = dims_of(qkv, n_head, n_kv_head, 0, 0.0f, 0.0f);
  if (d->HS > MAX_HS)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "%s: head size C/n_head = %lld/%d = %lld is above the supported %d; use "
                   "more heads",
                   op, (long long)d->C, n_head, (long long)d->HS, MAX_HS);
  return LZ_OK;
}

/* ------------------------------------------------------------------ entry */

lz_status lz_attention_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv, int n_head) {
  return lz_attention_gqa_forward(out, lse, qkv, n_head, n_head);
}

lz_status lz_attention_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                const lz_tensor *out, const lz_tensor *lse, int n_head) {
  return lz_attention_gqa_backward(dqkv, dout, qkv, out, lse, n_head, n_head);
}

lz_status lz_attention_gqa_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv, int n_head,
                                   int n_kv_head) {
  return lz_attention_seg_forward(out, lse, qkv, NULL, n_head, n_kv_head);
}

lz_status lz_attention_gqa_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                    const lz_tensor *out, const lz_tensor *lse, int n_head,
                                    int n_kv_head) {
  return lz_attention_seg_backward(dqkv, dout, qkv, out, lse, NULL, n_head, n_kv_head);
}

/* The options of lz_attention_opts_*: each 0 (off) or a finite positive number. */
lz_status lz_attention_check_options(const char *op, int window, float softcap, float scale) {
  if (window < 0)
    return lz_fail(LZ_ERR_INVALID, "%s: window is %d; it must be >= 1 (keys a query sees, its "
                   "own included), or 0 for none", op, window);
  if (!(softcap >= 0.0f) || isinf(softcap))
    return lz_fail(LZ_ERR_INVALID, "%s: softcap is %g; it must be a finite number > 0, or 0 for "
                   "none", op, (double)softcap);
  if (!(scale >= 0.0f) || isinf(scale))
    return lz_fail(LZ_ERR_INVALID, "%s: scale is %g; it must be a finite number > 0, or 0 for "
                   "1/sqrt(head_dim)", op, (double)scale);
  return LZ_OK;
}

/* seg, when given: i32 [B, T]. Any ids: only equality matters. */
static lz_status check_seg(const char *op, const lz_tensor *seg, const attn_dims *d,
                           const lz_tensor *qkv) {
  if (!seg) return LZ_OK;
  if (seg->ndim != 2 || seg->shape[0] != d->B || seg->shape[1] != d->T) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID, "%s: seg is %s, expected i32[%lld,%lld] (from qkv %s)", op,
                   lz_tensor_describe(seg, a, sizeof a), (long long)d->B, (long long)d->T,
                   lz_tensor_describe(qkv, b, sizeof b));
  }
  return LZ_OK;
}

lz_status lz_attention_seg_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                   const lz_tensor *seg, int n_head, int n_kv_head) {
  return lz_attention_opts_forward(out, lse, qkv, seg, n_head, n_kv_head, 0, 0.0f, 0.0f);
}

lz_status lz_attention_opts_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                    const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                    float softcap, float scale) {
  const char *op = "attention_forward";
  const lz_op_args args = {.t = {out, lse, (lz_tensor *)qkv, (lz_tensor *)seg},
                           .i = {n_head, n_kv_head, window},
                           .f = {softcap, scale}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_ATTENTION_FORWARD, &args));
  LZ_TRY(lz_attention_check_options(op, window, softcap, scale));
  attn_dims d;
  LZ_TRY(check_qkv(op, qkv, n_head, n_kv_head, &d));
  LZ_TRY(check_shape3(op, "out", out, d.B, d.T, d.C, "[B, T, C]", qkv));
  LZ_TRY(check_shape3(op, "lse", lse, d.B, d.NH, d.T, "[B, n_head, T]", qkv));
  LZ_TRY(check_seg(op, seg, &d, qkv));
  return lz_op_run(op, LZ_OP_ATTENTION_FORWARD, &args);
}

lz_status lz_cpu_attention_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0], *lse = a->t[1];
  const lz_tensor *qkv = a->t[2], *seg = a->t[3];
  const attn_dims d = dims_of(qkv, (int)a->i[0], (int)a->i[1], a->i[2], a->f[0], a->f[1]);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;

  float *o = out->data, *l = lse->data;
  const float *x = qkv->data;
  const int32_t *sg = seg ? seg->data : NULL;
  const int64_t BH = d.B * d.NH, n_tasks = BH * d.nb;
  /* Head by head, so the threads share its keys and values in cache; within
   * a head the longest tasks (last query tiles) first, for balance. */
#pragma omp parallel for schedule(dynamic, 1) if (n_tasks > 1)
  for (int64_t t = 0; t < n_tasks; t++) {
    const int64_t bh = t / d.nb, qb = d.nb - 1 - t % d.nb;
    attention_forward_tile(o, l, x, sg, d, bh / d.NH, bh % d.NH, qb);
  }
  return LZ_OK;
}

lz_status lz_attention_seg_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                    const lz_tensor *out, const lz_tensor *lse,
                                    const lz_tensor *seg, int n_head, int n_kv_head) {
  return lz_attention_opts_backward(dqkv, dout, qkv, out, lse, seg, n_head, n_kv_head, 0, 0.0f,
                                    0.0f);
}

lz_status lz_attention_opts_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                     const lz_tensor *out, const lz_tensor *lse,
                                     const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                     float softcap, float scale) {
  const char *op = "attention_backward";
  const lz_op_args args = {.t = {dqkv, (lz_tensor *)dout, (lz_tensor *)qkv, (lz_tensor *)out,
                                 (lz_tensor *)lse, (lz_tensor *)seg},
                           .i = {n_head, n_kv_head, window},
                           .f = {softcap, scale}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_ATTENTION_BACKWARD, &args));
  LZ_TRY(lz_attention_check_options(op, window, softcap, scale));
  attn_dims d;
  LZ_TRY(check_qkv(op, qkv, n_head, n_kv_head, &d));
  LZ_TRY(lz_check_same_shape(op, "dqkv", dqkv, "qkv", qkv));
  LZ_TRY(check_shape3(op, "dout", dout, d.B, d.T, d.C, "[B, T, C]", qkv));
  LZ_TRY(check_shape3(op, "out", out, d.B, d.T, d.C, "[B, T, C]", qkv));
  LZ_TRY(check_shape3(op, "lse", lse, d.B, d.NH, d.T, "[B, n_head, T]", qkv));
  LZ_TRY(check_seg(op, seg, &d, qkv));
  return lz_op_run(op, LZ_OP_ATTENTION_BACKWARD, &args);
}

lz_status lz_cpu_attention_backward(const lz_op_args *a) {
  lz_tensor *dqkv = a->t[0];
  const lz_tensor *dout = a->t[1], *qkv = a->t[2], *out = a->t[3], *lse = a->t[4], *seg = a->t[5];
  const attn_dims d = dims_of(qkv, (int)a->i[0], (int)a->i[1], a->i[2], a->f[0], a->f[1]);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;

  float *dx = dqkv->data;
  const float *dy = dout->data, *x = qkv->data, *y = out->data, *l = lse->data;
  const int32_t *sg = seg ? seg->data : NULL;
  /* One task per key/value head: it alone writes its dk and dv. */
  const int64_t BG = d.B * d.NKV;
#pragma omp parallel for schedule(dynamic, 1) if (BG > 1)
  for (int64_t bg = 0; bg < BG; bg++)
    attention_backward_group(dx, dy, x, y, l, sg, d, bg / d.NKV, bg % d.NKV);
  return LZ_OK;
}
