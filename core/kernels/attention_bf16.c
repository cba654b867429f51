/* attention_bf16.c — the tiled attention of attention.c with its tile
 * products on the CPU's bf16 dot-product unit (AVX-512 BF16's vdpbf16ps:
 * pairs of bf16 multiplied, summed into fp32). For bf16 training, where the
 * GEMMs around attention already round their inputs to bf16.
 *
 * Per pair of tiles (TILE queries x TILE keys) forward runs two small GEMMs,
 * S^T = K Q^T and O^T += V^T P^T (transposed, so the online softmax runs 16
 * queries a vector); backward recomputes S = Q K^T and runs dP = dO V^T,
 * dV^T += dO^T P, dK^T += Q^T dS, dQ = dS K. Each key and query tile is
 * packed once per call into the layouts its products read (O(T) memory
 * beside the output). Operands are rounded to bf16 (round to nearest even)
 * as they are packed; the softmax, its maxima,
 * sums and log-sum-exp, the masks and every accumulator stay fp32. The
 * order of the work is attention.c's (forward: one task per query tile;
 * backward: one task per key/value head, key tiles outermost), so results
 * are bitwise the same on every run and for every thread count.
 *
 * A GEMM operand is either "rows" (the reduction runs along a row: bf16
 * pairs of neighbouring columns, one 32-bit word each, broadcast) or
 * "paired" (the reduction runs down the columns: rows 2p and 2p+1
 * interleaved, 16 words a vector), the layout vdpbf16ps multiplies.
 *
 * Which kernel runs: lz_bf16_attention_path (AVX-512 BF16 when the CPU has
 * it, else attention.c's fp32 kernel); LZ_BF16_ATTENTION=native|f32
 * overrides it. There is no AMX kernel: on an AMX part the AVX-512 BF16 one
 * runs. */
#include "kernels/attention_tiles.h"

#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* getenv */
#include <string.h> /* strcmp */

#define BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define BINLINE static inline __attribute__((always_inline)) BF
#define BF_HS 32 /* the head dimension is padded to whole bf16 vectors */
#define MR 6     /* rows of a register block */
#define MV 4     /* vectors of a register block */

/* ------------------------------------------------------------- the path */

typedef struct {
  int native;
  char why[96];
} attn_path;

static attn_path path;
static pthread_once_t path_once = PTHREAD_ONCE_INIT;
static const char *path_env_bad; /* LZ_BF16_ATTENTION's value when it names no path */

static void path_choose(void) {
  const char *env = getenv("LZ_BF16_ATTENTION");
  const int can = lz_cpu_has("avx512bf16");
  if (env && *env) {
    if (strcmp(env, "native") && strcmp(env, "f32")) {
      path_env_bad = env;
      return;
    }
    path.native = can && !strcmp(env, "native");
    snprintf(path.why, sizeof path.why, "%s (LZ_BF16_ATTENTION=%s%s)",
             path.native ? "native avx512_bf16 tiles" : "f32 tiles", env,
             can || strcmp(env, "native") ? "" : "; no avx512_bf16 here");
    return;
  }
  path.native = can;
  snprintf(path.why, sizeof path.why, "%s",
           can ? "native avx512_bf16 tiles" : "f32 tiles (no avx512_bf16)");
}

lz_status lz_bf16_attention_path(const char **what) {
  pthread_once(&path_once, path_choose);
  if (path_env_bad)
    return lz_fail(LZ_ERR_INVALID,
                   "attention: LZ_BF16_ATTENTION is '%s'; set it to native or "
                   "f32, or unset it to choose by the CPU",
                   path_env_bad);
  *what = path.why;
  return LZ_OK;
}

int lz_attention_bf16_native(void) {
  const char *what;
  return lz_bf16_attention_path(&what) == LZ_OK && path.native;
}

/* ------------------------------------------------------------- decoding */

/* The forward tile's arithmetic for one query: q * scale (* log2 e) rounded
 * to bf16 once, each score a vdpbf16ps product with a cached key, the
 * softmax in base 2 over fp32 vectors; the values are widened to fp32
 * exactly and summed with fp32 weights (one query has no pair of rows for a
 * bf16 product to share). Keys in order: the same result on every run. */
BF void lz_attention_bf16_decode_query(float *out, const float *q, const uint16_t *k,
                                       const uint16_t *v, int64_t n, int64_t stride, int64_t hs,
                                       float scale, float cap, float *scores) {
  const int64_t nw = hs / 32, nv = hs / 16, np = (n + VL - 1) / VL * VL;
  __m512bh qb[MAX_HS / 32];
  const __m512 mul = _mm512_set1_ps(cap ? scale : scale * LOG2E);
  for (int64_t c = 0; c < nw; c++)
    qb[c] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q + 32 * c + 16), mul),
                                _mm512_mul_ps(_mm512_loadu_ps(q + 32 * c), mul));
  for (int64_t j = 0; j < n; j++) {
    const uint16_t *kj = k + j * stride;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < nw; c++)
      acc = _mm512_dpbf16_ps(acc, qb[c], (__m512bh)_mm512_loadu_si512(kj + 32 * c));
    scores[j] = _mm512_reduce_add_ps(acc);
  }
  const float l = scores_to_weights(scores, n, np, cap);
  __m512 acc[MAX_HS / 16];
  for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j++) {
    const uint16_t *vj = v + j * stride;
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < nv; c++) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vj + 16 * c)));
      acc[c] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc[c]);
    }
  }
  const __m512 inv = _mm512_set1_ps(1.0f / l);
  for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inv));
}

/* ------------------------------------------------------------ tile copies */

/* The first n (<= 16) lanes of a row of fp32, the rest 0. */
BINLINE __m512 load_part(const float *src, int64_t n) {
  if (n >= 16) return _mm512_loadu_ps(src);
  if (n <= 0) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), src);
}

/* Rows layout: dst[r][0 : cols_p/2] words = bf16 of src[r][0 : cols] * mul
 * for r < n, 0 past cols up to cols_p (a multiple of 16) and in rows n..m. */
BINLINE void to_rows(uint32_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t n,
                     int64_t m, int64_t cols, int64_t cols_p, float mul) {
  const __m512 k = _mm512_set1_ps(mul);
  for (int64_t r = 0; r < m; r++)
    for (int64_t c = 0; c < cols_p; c += 16) {
      __m512 x =
          r < n ? _mm512_mul_ps(load_part(src + r * lds + c, cols - c), k) : _mm512_setzero_ps();
      _mm256_storeu_si256((__m256i *)(dst + r * ldd + c / 2), (__m256i)_mm512_cvtneps_pbh(x));
    }
}

/* Paired layout: dst[p][c] = (src[2p][c], src[2p+1][c]) in bf16, times mul,
 * for p < m/2, c < cols_p; rows from n on and columns from cols on are 0. */
BINLINE void to_paired(uint32_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t n,
                       int64_t m, int64_t cols, int64_t cols_p, float mul) {
  const __m512 k = _mm512_set1_ps(mul);
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t p = 0; p < m / 2; p++)
    for (int64_t c = 0; c < cols_p; c += 16) {
      const int64_t r0 = 2 * p, r1 = r0 + 1;
      __m512 x0 =
          r0 < n ? _mm512_mul_ps(load_part(src + r0 * lds + c, cols - c), k) : _mm512_setzero_ps();
      __m512 x1 =
          r1 < n ? _mm512_mul_ps(load_part(src + r1 * lds + c, cols - c), k) : _mm512_setzero_ps();
      __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0); /* x0's 16, then x1's */
      _mm512_storeu_si512(dst + p * ldd + c, _mm512_permutexvar_epi16(interleave, both));
    }
}

/* dst[c][r] = src[r][c], 32-bit words, r < rows, c < cols. */
BINLINE void transpose_words(uint32_t *restrict dst, int64_t ldd, const uint32_t *restrict src,
                             int64_t lds, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

/* ------------------------------------------------------------ tile GEMMs */

/* c[r][0 : nv*16] (= or +=, its columns scaled by alpha[0 : nv*16] when given)
 * sum_p a[r][p] . b[p][..], r < mr:
 * a in rows layout (one word = two bf16 broadcast), b paired. */
BINLINE void block(float *c, int64_t ldc, const uint32_t *a, int64_t lda, const uint32_t *b,
                   int64_t ldb, int64_t np, const float *alpha, int add, const int mr,
                   const int nv) {
  __m512 acc[MR][MV];
  for (int r = 0; r < mr; r++)
    for (int v = 0; v < nv; v++) {
      if (!add)
        acc[r][v] = _mm512_setzero_ps();
      else if (alpha)
        acc[r][v] =
            _mm512_mul_ps(_mm512_loadu_ps(c + r * ldc + v * 16), _mm512_loadu_ps(alpha + v * 16));
      else
        acc[r][v] = _mm512_loadu_ps(c + r * ldc + v * 16);
    }
  for (int64_t p = 0; p < np; p++) {
    __m512bh bv[MV];
    for (int v = 0; v < nv; v++) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + v * 16);
    for (int r = 0; r < mr; r++) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * lda + p]);
      for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  for (int r = 0; r < mr; r++)
    for (int v = 0; v < nv; v++) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
}

/* Rows [r0, r0 + mr) of c against its columns [c_begin, n), MV vectors at a time. */
BINLINE void block_row(float *c, int64_t ldc, const uint32_t *a, int64_t lda, const uint32_t *b,
                       int64_t ldb, int64_t c_begin, int64_t n, int64_t np, const float *alpha,
                       int add, const int mr) {
  for (int64_t c0 = c_begin; c0 < n; c0 += MV * 16) {
    float *cc = c + c0;
    const uint32_t *bc = b + c0;
    const float *al = alpha ? alpha + c0 : NULL;
    switch ((n - c0) / 16) {
      case 1:
        block(cc, ldc, a, lda, bc, ldb, np, al, add, mr, 1);
        break;
      case 2:
        block(cc, ldc, a, lda, bc, ldb, np, al, add, mr, 2);
        break;
      case 3:
        block(cc, ldc, a, lda, bc, ldb, np, al, add, mr, 3);
        break;
      default:
        block(cc, ldc, a, lda, bc, ldb, np, al, add, mr, 4);
        break;
    }
  }
}

/* On a diagonal tile, the part of a product a row block needs (the rest is
 * masked, or multiplies zeros): all of it; the columns from the block's first
 * row on (S^T: keys are rows, a key is seen from its own query on); the
 * columns up to its last row (S, dP: queries are rows, each sees keys up to
 * itself); the reduction's words up to its last row (dQ: over keys). */
enum { TRI_NONE, TRI_COLS_FROM, TRI_COLS_TO, TRI_SUM_TO };

BINLINE void gemm_rows(float *c, int64_t ldc, const uint32_t *a, int64_t lda, const uint32_t *b,
                       int64_t ldb, int64_t r0, int64_t n, int64_t np, const float *alpha, int add,
                       int tri, const int mr) {
  int64_t c_begin = 0, c_end = n, p_end = np;
  if (tri == TRI_COLS_FROM) c_begin = r0 / 16 * 16;
  if (tri == TRI_COLS_TO && ((r0 + mr - 1) / 16 + 1) * 16 < n)
    c_end = ((r0 + mr - 1) / 16 + 1) * 16;
  if (tri == TRI_SUM_TO && (r0 + mr + 1) / 2 < np) p_end = (r0 + mr + 1) / 2;
  block_row(c + r0 * ldc, ldc, a + r0 * lda, lda, b, ldb, c_begin, c_end, p_end, alpha, add, mr);
}

/* c [m][n] (= or +=) a [m][np words] x b [np][n]; m a multiple of 2, n of 16;
 * on a diagonal tile only the part `tri` says. Six rows a block (24
 * accumulators of the 32 registers), then what is left. */
BINLINE void gemm(float *c, int64_t ldc, const uint32_t *a, int64_t lda, const uint32_t *b,
                  int64_t ldb, int64_t m, int64_t n, int64_t np, const float *alpha, int add,
                  int tri) {
  int64_t r0 = 0;
  for (; r0 + MR <= m; r0 += MR) gemm_rows(c, ldc, a, lda, b, ldb, r0, n, np, alpha, add, tri, MR);
  if (m - r0 == 4)
    gemm_rows(c, ldc, a, lda, b, ldb, r0, n, np, alpha, add, tri, 4);
  else if (m - r0 == 2)
    gemm_rows(c, ldc, a, lda, b, ldb, r0, n, np, alpha, add, tri, 2);
}

/* ------------------------------------------------------------------ masks */

/* Sets to `fill` the scores of row i (query i0 + i) that its keys j0.. may
 * not see: past nk, after the query on the diagonal tile, another document,
 * W or more behind. */
BINLINE void mask_row(float *s, int64_t i, int64_t i0, int64_t j0, int64_t nk, int diag, int meet,
                      int cut, const int32_t *sg, const attn_dims *d, float fill) {
  const int64_t n = diag ? (i + 1 < nk ? i + 1 : nk) : nk;
  for (int64_t j = n; j < TILE; j++) s[j] = fill;
  if (meet == MEET_SOME)
    for (int64_t j = 0; j < n; j++)
      if (sg[j0 + j] != sg[i0 + i]) s[j] = fill;
  if (cut)
    for (int64_t j = 0; j < n && i0 + i - (j0 + j) >= d->W; j++) s[j] = fill;
}

/* ------------------------------------------------------------ packing */

/* Head size padded, in floats (HP) and words (HW); words of one packed tile. */
#define HP_OF(d) (((d).HS + BF_HS - 1) / BF_HS * BF_HS)

/* Key tile kb of key/value head g of sequence b, packed for its products.
 * Forward: kr [TILE][HW] (K in rows, for S^T = K Q^T), vt_fwd [HP][TILE/2]
 * (V^T in rows along the keys, for O^T += V^T P^T). Backward: kt [HW][TILE] (K^T,
 * times mul, for S = Q K^T), vt [HW][TILE] (V^T, for dP = dO V^T), kp
 * [TILE/2][HP] (K paired, for dQ = dS K). Absent ones are skipped. */
BINLINE void pack_keys(uint32_t *kr, uint32_t *kt, uint32_t *vt_fwd, uint32_t *vt, uint32_t *kp,
                       const float *qkv, const attn_dims *d, int64_t b, int64_t g, int64_t kb,
                       float mul) {
  const int64_t T = d->T, HS = d->HS, row = d->row, HP = HP_OF(*d), HW = HP / 2;
  const int64_t j0 = kb * TILE, nk = T - j0 < TILE ? T - j0 : TILE;
  const float *kbase = qkv + b * T * row + d->C + g * HS + j0 * row;
  const float *vbase = kbase + d->NKV * HS;
  uint32_t tmp[TILE * HW];
  if (kr) to_rows(kr, HW, kbase, row, nk, TILE, HS, HP, mul);
  if (kt) {
    to_rows(tmp, HW, kbase, row, nk, TILE, HS, HP, mul);
    transpose_words(kt, TILE, tmp, HW, TILE, HW);
  }
  if (vt_fwd) {
    to_paired(tmp, HP, vbase, row, nk, TILE, HS, HP, 1.0f);
    transpose_words(vt_fwd, TILE / 2, tmp, HP, TILE / 2, HP);
  }
  if (vt) {
    to_rows(tmp, HW, vbase, row, nk, TILE, HS, HP, 1.0f);
    transpose_words(vt, TILE, tmp, HW, TILE, HW);
  }
  if (kp) to_paired(kp, HP, kbase, row, nk, TILE, HS, HP, 1.0f);
}

/* ---------------------------------------------------------------- forward */

/* One query tile of one (batch, head): out rows [qb*TILE, +TILE) and their
 * lse. kr_all, vt_all: its key/value head's tiles, packed. Scores are held
 * transposed, st[key][query], as attention.c holds them, so the online
 * softmax runs down the keys with 16 queries a vector and no reduction
 * across lanes; the output builds up transposed too, o^T[c][query]. */
BF static void forward_tile(float *out, float *lse, const float *qkv, const int32_t *seg,
                            const uint32_t *kr_all, const uint32_t *vt_all, attn_dims d, int64_t b,
                            int64_t h, int64_t qb) {
  const int64_t T = d.T, C = d.C, HS = d.HS, row = d.row, HP = HP_OF(d), HW = HP / 2;
  const int64_t i0 = qb * TILE, nq = T - i0 < TILE ? T - i0 : TILE;
  const float *qbase = qkv + b * T * row + h * HS;
  const int32_t *sg = seg ? seg + b * T : NULL;
  const int nvq = TILE / VL;

  uint32_t qt[HW * TILE], pp[TILE / 2 * TILE];
  float ot[HP * TILE];
  float st[TILE * TILE] __attribute__((aligned(64))); /* scores, then probabilities */
  float m[TILE] __attribute__((aligned(64))), l[TILE] __attribute__((aligned(64)));
  float alpha[TILE] __attribute__((aligned(64)));
  vf *mv = (vf *)m, *lv = (vf *)l, *av = (vf *)alpha;
  {
    uint32_t qa[TILE * HW];
    to_rows(qa, HW, qbase + i0 * row, row, nq, TILE, HS, HP, d.cap ? d.scale : d.scale * LOG2E);
    transpose_words(qt, TILE, qa, HW, TILE, HW);
  }
  for (int vq = 0; vq < nvq; vq++) {
    v_splat(&mv[vq], -INFINITY);
    v_splat(&lv[vq], 0.0f);
  }
  for (int64_t i = 0; i < HP * TILE; i++) ot[i] = 0.0f;

  for (int64_t kb = first_key_tile(&d, i0); kb <= qb; kb++) {
    const int64_t j0 = kb * TILE, nk = T - j0 < TILE ? T - j0 : TILE;
    const int64_t nkr = (nk + 3) / 4 * 4;
    const int diag = kb == qb;
    const int meet = tiles_meet(sg, i0, nq, j0, nk);
    const int cut = window_cuts(&d, i0, nq, j0);
    if (meet == MEET_NONE) continue;
    gemm(st, TILE, kr_all + kb * TILE * HW, HW, qt, TILE, nkr, TILE, HW, NULL, 0,
         diag ? TRI_COLS_FROM : TRI_NONE);
    if (d.cap) soft_cap(st, NULL, nk * TILE, d.cap, LOG2E);
    for (int64_t j = nk; j < TILE; j++) /* keys past T: probability 0 */
      for (int64_t i = 0; i < TILE; i++) st[j * TILE + i] = -INFINITY;
    if (cut)
      for (int64_t j = 0; j < nk; j++)
        for (int64_t i = 0; i < nq; i++)
          if (i0 + i - (j0 + j) >= d.W) st[j * TILE + i] = -INFINITY;
    if (meet == MEET_SOME)
      for (int64_t j = 0; j < nk; j++)
        for (int64_t i = 0; i < nq; i++)
          if (sg[j0 + j] != sg[i0 + i]) st[j * TILE + i] = -INFINITY;
    if (diag) /* key j after query i */
      for (int64_t j = 1; j < nk; j++)
        for (int64_t i = 0; i < j; i++) st[j * TILE + i] = -INFINITY;

    /* Padded queries (past nq) see key 0 with score 0: finite, unused. */
    for (int vq = 0; vq < nvq; vq++) {
      vf mx = mv[vq];
      for (int64_t j = 0; j < TILE; j++) v_max(&mx, &mx, (const vf *)(st + j * TILE) + vq);
      vf ms = mx, ninf, x, sum;
      v_splat(&ninf, -INFINITY);
      vi none = ms == ninf; /* queries that saw no key yet subtract 0 */
      ms = (vf)((vi)ms & ~none);
      x = mv[vq] - ms;
      v_exp2(&av[vq], &x);
      v_splat(&sum, 0.0f);
      for (int64_t j = 0; j < TILE; j++) {
        vf *p = (vf *)(st + j * TILE) + vq;
        x = *p - ms;
        v_exp2(p, &x);
        sum += *p;
      }
      lv[vq] = lv[vq] * av[vq] + sum;
      mv[vq] = mx;
    }
    to_paired(pp, TILE, st, TILE, TILE, TILE, TILE, TILE, 1.0f);
    gemm(ot, TILE, vt_all + kb * TILE * HW, TILE / 2, pp, TILE, HP, TILE, TILE / 2, alpha, 1,
         TRI_NONE);
  }

  for (int64_t i = 0; i < nq; i++) {
    const float inv = 1.0f / l[i];
    float *dst = out + (b * T + i0 + i) * C + h * HS;
    for (int64_t cc = 0; cc < HS; cc++) dst[cc] = ot[cc * TILE + i] * inv;
    lse[(b * d.NH + h) * T + i0 + i] = (m[i] + log2f(l[i])) * LN2;
  }
}

BF static void pack_forward_keys(uint32_t *kr, uint32_t *vt, const float *qkv, const attn_dims *d,
                                 int64_t b, int64_t g, int64_t kb) {
  pack_keys(kr, NULL, vt, NULL, NULL, qkv, d, b, g, kb, 1.0f);
}

lz_status lz_attention_bf16_forward_run(float *out, float *lse, const float *qkv,
                                        const int32_t *seg, attn_dims d) {
  /* Every key tile packed once, then read by each query tile that meets it. */
  const int64_t tile_words = TILE * HP_OF(d) / 2, n_kt = d.B * d.NKV * d.nb;
  uint32_t *packed = aligned_alloc(64, (size_t)(2 * n_kt * tile_words) * sizeof(uint32_t));
  if (!packed)
    return lz_fail(LZ_ERR_NOMEM, "attention_forward: out of memory for %lld packed key tiles",
                   (long long)n_kt);
  uint32_t *kr = packed, *vt = packed + n_kt * tile_words;
#pragma omp parallel for schedule(static) if (n_kt > 1)
  for (int64_t t = 0; t < n_kt; t++)
    pack_forward_keys(kr + t * tile_words, vt + t * tile_words, qkv, &d, t / d.nb / d.NKV,
                      t / d.nb % d.NKV, t % d.nb);
  const int64_t BH = d.B * d.NH, n_tasks = BH * d.nb, group = d.NH / d.NKV;
#pragma omp parallel for schedule(dynamic, 1) if (n_tasks > 1)
  for (int64_t t = 0; t < n_tasks; t++) {
    const int64_t bh = t / d.nb, qb = d.nb - 1 - t % d.nb, b = bh / d.NH, h = bh % d.NH;
    const int64_t first = (b * d.NKV + h / group) * d.nb * tile_words;
    forward_tile(out, lse, qkv, seg, kr + first, vt + first, d, b, h, qb);
  }
  free(packed);
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* A query tile of one head, packed once for every key tile it meets: Q and
 * dO in rows layout (for S, dP), Q^T and dO^T in rows layout along the
 * queries (for dK^T, dV^T), D_i = dO_i . O_i and lse in base 2. */
typedef struct {
  uint32_t *qa, *qt, *da, *dt;
  float *D, *lse2;
} query_tile;

static int64_t query_tile_words(int64_t HP) { return 4 * TILE * HP / 2 + 2 * TILE; }

static query_tile query_tile_at(uint32_t *p, int64_t HP) {
  const int64_t w = TILE * HP / 2;
  query_tile q = {
      p, p + w, p + 2 * w, p + 3 * w, (float *)(p + 4 * w), (float *)(p + 4 * w) + TILE};
  return q;
}

BF static void pack_query_tile(query_tile q, const float *qkv, const float *out, const float *dout,
                               const float *lse, const attn_dims *d, int64_t b, int64_t h,
                               int64_t qb) {
  const int64_t T = d->T, C = d->C, HS = d->HS, row = d->row, HP = HP_OF(*d), HW = HP / 2;
  const int64_t i0 = qb * TILE, nq = T - i0 < TILE ? T - i0 : TILE;
  const float *qs = qkv + (b * T + i0) * row + h * HS, *ds = dout + (b * T + i0) * C + h * HS;
  const float *os = out + (b * T + i0) * C + h * HS;
  uint32_t tmp[TILE / 2 * HP];
  to_rows(q.qa, HW, qs, row, nq, TILE, HS, HP, 1.0f);
  to_paired(tmp, HP, qs, row, nq, TILE, HS, HP, 1.0f);
  transpose_words(q.qt, TILE / 2, tmp, HP, TILE / 2, HP);
  to_rows(q.da, HW, ds, C, nq, TILE, HS, HP, 1.0f);
  to_paired(tmp, HP, ds, C, nq, TILE, HS, HP, 1.0f);
  transpose_words(q.dt, TILE / 2, tmp, HP, TILE / 2, HP);
  for (int64_t i = 0; i < TILE; i++) {
    float sum = 0.0f;
    if (i < nq)
      for (int64_t cc = 0; cc < HS; cc++) sum += ds[i * C + cc] * os[i * C + cc];
    q.D[i] = sum;
    q.lse2[i] = i < nq ? lse[(b * d->NH + h) * T + i0 + i] * LOG2E : 0.0f;
  }
}

/* The scratch of one backward task. */
typedef struct {
  uint32_t *kt, *vt, *kp;          /* K (scaled) and V transposed for S, dP; K paired for dQ */
  uint32_t *pp, *dsp, *dsa;        /* P and dS paired along the queries; dS in rows */
  float *dkt, *dvt, *dq, *s, *dps; /* dK^T, dV^T [HP][TILE]; dQ [TILE][HP]; S, dP */
} bwd_scratch;

/* As attention.c's backward: dk, dv of one (batch, key/value head g) and dq
 * of its query heads, from their packed query tiles. */
BF static void backward_group(float *dqkv, const uint32_t *qtiles, const int32_t *seg,
                              const float *qkv, attn_dims d, int64_t b, int64_t g, bwd_scratch w) {
  const int64_t T = d.T, C = d.C, HS = d.HS, row = d.row, HP = HP_OF(d), HW = HP / 2;
  const int64_t group = d.NH / d.NKV, qw = query_tile_words(HP);
  const int64_t koff = b * T * row + C + g * HS, voff = koff + d.NKV * HS;
  float *dkbase = dqkv + koff, *dvbase = dqkv + voff;
  const float c = d.cap ? d.scale : d.scale * LOG2E;
  const int32_t *sg = seg ? seg + b * T : NULL;

  for (int64_t kb = 0; kb < d.nb; kb++) {
    const int64_t j0 = kb * TILE, nk = T - j0 < TILE ? T - j0 : TILE;
    pack_keys(NULL, w.kt, NULL, w.vt, w.kp, qkv, &d, b, g, kb, c);
    for (int64_t i = 0; i < TILE * HP; i++) w.dkt[i] = w.dvt[i] = 0.0f;

    for (int64_t h = g * group; h < (g + 1) * group; h++) {
      float *dqbase = dqkv + b * T * row + h * HS;
      const int64_t qb_end = last_query_tile(&d, j0, nk) + 1;
      for (int64_t qb = kb; qb < qb_end; qb++) {
        const int64_t i0 = qb * TILE, nq = T - i0 < TILE ? T - i0 : TILE;
        const int64_t nqr = (nq + 3) / 4 * 4; /* rows the products run: whole register blocks */
        const int diag = kb == qb;
        const int meet = tiles_meet(sg, i0, nq, j0, nk);
        const int cut = window_cuts(&d, i0, nq, j0);
        const int first = kb == first_key_tile(&d, i0);
        if (meet == MEET_NONE) {
          if (first)
            for (int64_t i = 0; i < nq; i++)
              for (int64_t cc = 0; cc < HS; cc++) dqbase[(i0 + i) * row + cc] = 0.0f;
          continue;
        }
        const query_tile q =
            query_tile_at((uint32_t *)qtiles + ((b * d.NH + h) * d.nb + qb) * qw, HP);
        if (qb + 1 < qb_end) /* the next tile's dq rows, a qkv row apart: no prefetcher follows */
          prefetch_rows(dqbase + (i0 + TILE) * row, row,
                        T - i0 - TILE < TILE ? T - i0 - TILE : TILE, HS);
        const int tri = diag ? TRI_COLS_TO : TRI_NONE;
        gemm(w.s, TILE, q.qa, HW, w.kt, TILE, nqr, TILE, HW, NULL, 0, tri);
        gemm(w.dps, TILE, q.da, HW, w.vt, TILE, nqr, TILE, HW, NULL, 0, tri);
        for (int64_t i = 0; i < TILE; i++) {
          float *pi = w.s + i * TILE, *dpi = w.dps + i * TILE;
          if (i >= nq) {
            for (int64_t j = 0; j < TILE; j++) pi[j] = dpi[j] = 0.0f;
            continue;
          }
          if (diag) /* keys after the query: products skipped, finite zeros instead */
            for (int64_t j = i + 1; j < TILE; j++) pi[j] = dpi[j] = 0.0f;
          float tn[TILE] __attribute__((aligned(64)));
          if (d.cap) soft_cap(pi, tn, TILE, d.cap, LOG2E);
          vf ls, dd, x;
          v_splat(&ls, q.lse2[i]);
          v_splat(&dd, q.D[i]);
          for (int v = 0; v < TILE / VL; v++) {
            x = ((vf *)pi)[v] - ls;
            v_exp2((vf *)pi + v, &x);
          }
          mask_row(pi, i, i0, j0, nk, diag, meet, cut, sg, &d, 0.0f);
          for (int v = 0; v < TILE / VL; v++)
            ((vf *)dpi)[v] = ((vf *)pi)[v] * (((vf *)dpi)[v] - dd);
          if (d.cap)
            for (int64_t j = 0; j < TILE; j++) dpi[j] *= 1.0f - tn[j] * tn[j];
        }
        /* dV^T += dO^T P and dK^T += Q^T dS: the reduction runs over queries. */
        to_paired(w.pp, TILE, w.s, TILE, TILE, TILE, TILE, TILE, 1.0f);
        to_paired(w.dsp, TILE, w.dps, TILE, TILE, TILE, TILE, TILE, 1.0f);
        to_rows(w.dsa, TILE / 2, w.dps, TILE, nqr, nqr, TILE, TILE, 1.0f);
        gemm(w.dvt, TILE, q.dt, TILE / 2, w.pp, TILE, HP, TILE, TILE / 2, NULL, 1, TRI_NONE);
        gemm(w.dkt, TILE, q.qt, TILE / 2, w.dsp, TILE, HP, TILE, TILE / 2, NULL, 1, TRI_NONE);
        gemm(w.dq, HP, w.dsa, TILE / 2, w.kp, HP, nqr, HP, TILE / 2, NULL, 0,
             diag ? TRI_SUM_TO : TRI_NONE);
        for (int64_t i = 0; i < nq; i++) {
          float *dqd = dqbase + (i0 + i) * row;
          const float *src = w.dq + i * HP;
          if (first)
            for (int64_t cc = 0; cc < HS; cc++) dqd[cc] = src[cc] * d.scale;
          else
            for (int64_t cc = 0; cc < HS; cc++) dqd[cc] += src[cc] * d.scale;
        }
      }
    }
    /* Reading dK^T and dV^T along their rows; the writes are a qkv row apart. */
    for (int64_t cc = 0; cc < HS; cc++)
      for (int64_t j = 0; j < nk; j++) {
        dkbase[(j0 + j) * row + cc] = w.dkt[cc * TILE + j] * d.scale;
        dvbase[(j0 + j) * row + cc] = w.dvt[cc * TILE + j];
      }
  }
}

/* Words of scratch one backward task needs; each part a multiple of 64 bytes. */
static int64_t bwd_words(int64_t HP) {
  return 3 * TILE * HP / 2 + 3 * TILE * TILE / 2 + 3 * TILE * HP + 2 * TILE * TILE;
}

static bwd_scratch bwd_carve(uint32_t *p, int64_t HP) {
  const int64_t tw = TILE * HP / 2;
  bwd_scratch w;
  w.kt = p, p += tw;
  w.vt = p, p += tw;
  w.kp = p, p += tw;
  w.pp = p, p += TILE * TILE / 2;
  w.dsp = p, p += TILE * TILE / 2;
  w.dsa = p, p += TILE * TILE / 2;
  w.dkt = (float *)p, p += TILE * HP;
  w.dvt = (float *)p, p += TILE * HP;
  w.dq = (float *)p, p += TILE * HP;
  w.s = (float *)p, p += TILE * TILE;
  w.dps = (float *)p;
  return w;
}

lz_status lz_attention_bf16_backward_run(float *dqkv, const float *dout, const float *qkv,
                                         const float *out, const float *lse, const int32_t *seg,
                                         attn_dims d) {
  const int64_t HP = HP_OF(d), qw = query_tile_words(HP), n_qt = d.B * d.NH * d.nb;
  const int64_t BG = d.B * d.NKV, words = bwd_words(HP);
  const int nt = omp_get_max_threads();
  uint32_t *all = aligned_alloc(64, (size_t)(words * nt + qw * n_qt) * sizeof(uint32_t));
  if (!all)
    return lz_fail(LZ_ERR_NOMEM, "attention_backward: out of memory for %lld packed query tiles",
                   (long long)n_qt);
  uint32_t *qtiles = all + words * nt;
#pragma omp parallel for schedule(static) if (n_qt > 1)
  for (int64_t t = 0; t < n_qt; t++)
    pack_query_tile(query_tile_at(qtiles + t * qw, HP), qkv, out, dout, lse, &d, t / d.nb / d.NH,
                    t / d.nb % d.NH, t % d.nb);
#pragma omp parallel for schedule(dynamic, 1) if (BG > 1)
  for (int64_t bg = 0; bg < BG; bg++) {
    const bwd_scratch w = bwd_carve(all + omp_get_thread_num() * words, HP);
    backward_group(dqkv, qtiles, seg, qkv, d, bg / d.NKV, bg % d.NKV, w);
  }
  free(all);
  return LZ_OK;
}
