/* attention.c — causal self-attention, multi-head (GPT-2) and grouped-query
 * (Llama: n_kv_head key/value heads, each shared by n_head/n_kv_head query
 * heads), forward and backward in fp32, computed in tiles of TILE queries x
 * TILE keys (flash-attention style) so no T x T matrix is ever stored. Its
 * results define the fp32 runs' checksums. The pieces it shares with the
 * bf16 kernel (attention_bf16.c) are in attention_tiles.h.
 *
 * Forward keeps, per query row, a running maximum and sum of the softmax and
 * rescales its output accumulator when the maximum grows; it saves the row's
 * log-sum-exp so backward can recompute the probabilities tile by tile.
 * Backward walks key tiles outermost: dK and dV of a key tile build up in
 * scratch over the query heads of its group, in head order, and their query
 * tiles; dQ builds up in the output itself.
 *
 * The tile products are register-blocked with GCC vector types (16 floats:
 * one AVX-512 register, two AVX2 ones) and compiled per instruction set by
 * LZ_DISPATCH; where AVX2 and FMA are there but not AVX-512, kernels of their
 * own (the _fma ones) run the same sums on 8-float vectors, fused as the
 * AVX-512 clone's are. All helpers are inlined into the dispatched functions.
 *
 * Every output row is computed by one thread in a fixed order, so results are
 * bitwise the same on every run and for every thread count. All scratch is on
 * the stack of the thread that uses it, at most (8 * TILE * HS' + 2 * TILE^2)
 * floats (HS' = HS rounded up to 16): 160 KiB at HS = 64, 544 KiB at the
 * largest head size accepted, MAX_HS. */
#include "kernels/attention_tiles.h"

#include <math.h> /* log2f */

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

/* ------------------------------------------------ AVX2 + FMA tile products */

/* On a part with AVX2 but not AVX-512, a 64-byte vf is a pair of 8-float
 * registers and a block of 4 rows x 4 of them needs 32 of the 16 there are:
 * the products above spilled every accumulator and, with no FMA in GCC's
 * "avx2" clone, ran unfused (6 GFLOP/s at T 2048 on a 2-core Zen 3). These
 * forms compute the same sums, each element in the same order, on 8-float
 * vectors in blocks of ROWS rows x up to NC8 vectors (8 accumulators, the
 * vectors of b and the broadcasts of a: 3 vectors spilled one accumulator,
 * and that loop ran at the latency of a store and a load); they are inlined
 * only into the _fma kernels below, compiled for AVX2 and FMA, where every
 * acc += x * y is one fused multiply-add, as it is in the AVX-512 clone. */
typedef float v8 __attribute__((vector_size(32)));
#define NC8 2 /* 8-float vectors of a register block */

/* s[r][c0 : c0 + nc*8] = sum_d a[r*lda + d] * bt[d*TILE + c0 ...], r < ROWS
 * (s, bt: at column c0 already). */
INLINE void block8_nt(float *restrict s, const float *restrict a, int64_t lda,
                      const float *restrict bt, int64_t n, const int nc) {
  const v8 zero = {0};
  v8 acc[ROWS][NC8];
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < nc; c++) acc[r][c] = zero;
  for (int64_t d = 0; d < n; d++) {
    const v8 *b = (const v8 *)(bt + d * TILE);
    for (int c = 0; c < nc; c++) {
      const v8 bv = b[c];
      for (int r = 0; r < ROWS; r++) acc[r][c] += a[r * lda + d] * bv;
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < nc; c++) ((v8 *)(s + r * TILE))[c] = acc[r][c];
}

/* One register block of rows against the tile's columns c0 .. c1 (multiples
 * of 8). */
INLINE void row8_nt(float *restrict s, const float *restrict a, int64_t lda,
                    const float *restrict bt, int64_t n, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += NC8 * 8) {
    switch ((c1 - c) / 8) {
      case 1:
        block8_nt(s + c, a, lda, bt + c, n, 1);
        break;
      default:
        block8_nt(s + c, a, lda, bt + c, n, 2);
        break;
    }
  }
}

/* block_nn's sums on 8-float vectors, nc of them. */
INLINE void block8_nn(float *restrict out, int64_t ldo, const float *restrict coef, int64_t rs,
                      int64_t ks, const float *restrict m, int64_t ldm, int64_t k0, int64_t k1,
                      const float *restrict alpha, const int nc) {
  const v8 zero = {0};
  v8 acc[ROWS][NC8];
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < nc; c++)
      acc[r][c] = alpha ? ((const v8 *)(out + r * ldo))[c] * alpha[r] : zero;
  for (int64_t k = k0; k < k1; k++) {
    const v8 *mv = (const v8 *)(m + k * ldm);
    for (int c = 0; c < nc; c++) {
      const v8 x = mv[c];
      for (int r = 0; r < ROWS; r++) acc[r][c] += coef[r * rs + k * ks] * x;
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < nc; c++) ((v8 *)(out + r * ldo))[c] = acc[r][c];
}

/* ------------------------------------------------- the products, either form */

/* tile_nt (fma8: in row8_nt's blocks). */
INLINE void products_nt(float *restrict s, const float *restrict a, int64_t lda,
                        const float *restrict bt, int64_t n, int64_t nrows, int diag,
                        const int fma8) {
  if (!fma8) {
    tile_nt(s, a, lda, bt, n, nrows, diag);
    return;
  }
  for (int64_t r0 = 0; r0 < nrows; r0 += ROWS) {
    const int64_t nv = diag ? (r0 + ROWS - 1) / VL + 1 : TILE / VL;
    row8_nt(s + r0 * TILE, a + r0 * lda, lda, bt, n, 0, nv * VL);
  }
}

/* tile_nt_cols: columns from vector v0 (of VL floats) on. */
INLINE void products_nt_cols(float *restrict s, const float *restrict a, int64_t lda,
                             const float *restrict bt, int64_t n, int v0, const int fma8) {
  if (fma8) row8_nt(s, a, lda, bt, n, (int64_t)v0 * VL, TILE);
  else tile_nt_cols(s, a, lda, bt, n, v0);
}

/* rows_nn. */
INLINE void products_nn(float *restrict out, int64_t ldo, const float *restrict coef, int64_t rs,
                        int64_t ks, const float *restrict m, int64_t ldm, int64_t k0, int64_t k1,
                        const float *restrict alpha, int64_t hsp, const int fma8) {
  if (!fma8) {
    rows_nn(out, ldo, coef, rs, ks, m, ldm, k0, k1, alpha, hsp);
    return;
  }
  for (int64_t c = 0; c < hsp; c += NC8 * 8) {
    switch ((hsp - c) / 8) {
      case 1:
        block8_nn(out + c, ldo, coef, rs, ks, m + c, ldm, k0, k1, alpha, 1);
        break;
      default:
        block8_nn(out + c, ldo, coef, rs, ks, m + c, ldm, k0, k1, alpha, 2);
        break;
    }
  }
}

/* The kernels' forms: LZ_DISPATCH's clones (AVX-512, AVX2 without FMA,
 * plain), and LZ_FMA8's, run where AVX2 and FMA are there but not AVX-512F. */
static int fma8_here(void) { return lz_cpu_form_here() == LZ_FORM_AVX2_FMA; }

/* ---------------------------------------------------------------- forward */

/* One query tile of one (batch, head): out rows [qb*TILE, +TILE) and their lse.
 * Scores are held transposed, st[key][query], so the online softmax runs
 * down the keys with a vector of 16 queries at a time: its maxima, sums and
 * rescale factors are vectors, with no reduction across lanes. */
INLINE void forward_tile(float *out, float *lse, const float *qkv, const int32_t *seg,
                         attn_dims d, int64_t b, int64_t h, int64_t qb, const int fma8) {
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
      products_nt_cols(st + r0 * TILE, k + r0 * HSP, HSP, qt, HS, v0, fma8);
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
      if (meet == MEET_SOME || cut) /* rows that saw no key yet subtract 0 */
        for (int l = 0; l < VL; l++) ms[l] = ms[l] == -INFINITY ? 0.0f : ms[l];
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
      products_nn(o + r0 * HSP, HSP, st + r0, 1, TILE, v, HSP, 0, k1, alpha + r0, HSP, fma8);
    }
  }

  for (int64_t i = 0; i < nq; i++) {
    const float inv = 1.0f / l[i];
    float *dst = out + (b * T + i0 + i) * C + h * HS;
    for (int64_t cc = 0; cc < HS; cc++) dst[cc] = o[i * HSP + cc] * inv;
    lse[(b * d.NH + h) * T + i0 + i] = (m[i] + log2f(l[i])) * LN2;
  }
}

LZ_DISPATCH static void attention_forward_tile(float *out, float *lse, const float *qkv,
                                               const int32_t *seg, attn_dims d, int64_t b,
                                               int64_t h, int64_t qb) {
  forward_tile(out, lse, qkv, seg, d, b, h, qb, 0);
}

LZ_FMA8 static void attention_forward_tile_fma(float *out, float *lse, const float *qkv,
                                               const int32_t *seg, attn_dims d, int64_t b,
                                               int64_t h, int64_t qb) {
  forward_tile(out, lse, qkv, seg, d, b, h, qb, 1);
}

/* --------------------------------------------------------------- backward */

/* All of dk, dv of one (batch, key/value head g) and dq of the query heads
 * that share it. With P = softmax, D_i = dout_i . out_i:
 *   dv_j = sum_i P_ij dout_i,  dP_ij = dout_i . v_j,  dS_ij = P_ij (dP_ij - D_i),
 *   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i. */
INLINE void backward_group(float *dqkv, const float *dout, const float *qkv, const float *out,
                           const float *lse, const int32_t *seg, attn_dims d, int64_t b,
                           int64_t g, const int fma8) {
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

        products_nt(p, q, HSP, kt, HS, nqr, diag, fma8);
        products_nt(dp, dO, HSP, vt, HS, nqr, diag, fma8);
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
          products_nn(dv + r0 * HSP, HSP, p + r0, 1, TILE, dO, HSP, i_begin, nq, ones, HSP, fma8);
          products_nn(dk + r0 * HSP, HSP, dp + r0, 1, TILE, q, HSP, i_begin, nq, ones, HSP, fma8);
        }
        for (int64_t r0 = 0; r0 < nqr; r0 += ROWS) {
          const int64_t k1 = diag ? (r0 + ROWS < nk ? r0 + ROWS : nk) : nk;
          products_nn(dq + r0 * HSP, HSP, dp + r0 * TILE, TILE, 1, k, HSP, 0, k1, NULL, HSP, fma8);
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

LZ_DISPATCH static void attention_backward_group(float *dqkv, const float *dout, const float *qkv,
                                                 const float *out, const float *lse,
                                                 const int32_t *seg, attn_dims d, int64_t b,
                                                 int64_t g) {
  backward_group(dqkv, dout, qkv, out, lse, seg, d, b, g, 0);
}

LZ_FMA8 static void attention_backward_group_fma(float *dqkv, const float *dout,
                                                 const float *qkv, const float *out,
                                                 const float *lse, const int32_t *seg,
                                                 attn_dims d, int64_t b, int64_t g) {
  backward_group(dqkv, dout, qkv, out, lse, seg, d, b, g, 1);
}

/* ------------------------------------------------------------------ runners */

lz_status lz_cpu_attention_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0], *lse = a->t[1];
  const lz_tensor *qkv = a->t[2], *seg = a->t[3];
  const attn_dims d = lz_attention_dims(qkv, (int)a->i[0], (int)a->i[1], a->i[2], a->f[0], a->f[1]);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;

  float *o = out->data, *l = lse->data;
  const float *x = qkv->data;
  const int32_t *sg = seg ? seg->data : NULL;
  if (a->i[3] && lz_attention_bf16_native()) /* bf16 tile products asked for, and here */
    return lz_attention_bf16_forward_run(o, l, x, sg, d);
  const int64_t BH = d.B * d.NH, n_tasks = BH * d.nb;
  const int fma8 = fma8_here();
  /* Head by head, so the threads share its keys and values in cache; within
   * a head the longest tasks (last query tiles) first, for balance. */
#pragma omp parallel for schedule(dynamic, 1) if (n_tasks > 1)
  for (int64_t t = 0; t < n_tasks; t++) {
    const int64_t bh = t / d.nb, qb = d.nb - 1 - t % d.nb;
    if (fma8) attention_forward_tile_fma(o, l, x, sg, d, bh / d.NH, bh % d.NH, qb);
    else attention_forward_tile(o, l, x, sg, d, bh / d.NH, bh % d.NH, qb);
  }
  return LZ_OK;
}

lz_status lz_cpu_attention_backward(const lz_op_args *a) {
  lz_tensor *dqkv = a->t[0];
  const lz_tensor *dout = a->t[1], *qkv = a->t[2], *out = a->t[3], *lse = a->t[4], *seg = a->t[5];
  const attn_dims d = lz_attention_dims(qkv, (int)a->i[0], (int)a->i[1], a->i[2], a->f[0], a->f[1]);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;

  float *dx = dqkv->data;
  const float *dy = dout->data, *x = qkv->data, *y = out->data, *l = lse->data;
  const int32_t *sg = seg ? seg->data : NULL;
  if (a->i[3] && lz_attention_bf16_native())
    return lz_attention_bf16_backward_run(dx, dy, x, y, l, sg, d);
  /* One task per key/value head: it alone writes its dk and dv. */
  const int64_t BG = d.B * d.NKV;
  const int fma8 = fma8_here();
#pragma omp parallel for schedule(dynamic, 1) if (BG > 1)
  for (int64_t bg = 0; bg < BG; bg++)
    if (fma8) attention_backward_group_fma(dx, dy, x, y, l, sg, d, bg / d.NKV, bg % d.NKV);
    else attention_backward_group(dx, dy, x, y, l, sg, d, bg / d.NKV, bg % d.NKV);
  return LZ_OK;
}
