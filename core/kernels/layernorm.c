/* layernorm.c — LayerNorm over the last dimension (GPT-2's ln_1, ln_2, ln_f).
 *
 * Forward saves each row's mean and 1/std so backward need not recompute them.
 * Backward writes dx and accumulates dw, db in one pass over the rows. The
 * dw/db sums run over rows; to keep them bitwise independent of the thread
 * count, the rows are cut into a number of blocks that depends on the row
 * count alone, each block sums its rows in order into its own partial, and the
 * partials are added in block order. The partials live on the stack, so wide
 * rows (more than FUSED_MAX_COLS) take a two-pass path that sums in the same
 * order: threads split the columns, each walks all row blocks in order. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_lanes.h"     /* sums in independent lanes */
#include "kernels/lz_rowblocks.h" /* the row blocks of the dw/db sums */

#include <math.h>   /* sqrtf, isinf */

/* Columns per thread task in the two-pass dw/db pass: two cache lines. */
#define COL_BLOCK 32
/* Widest rows the one-pass backward takes: 512 KiB of partials on the stack. */
#define FUSED_MAX_COLS 4096

/* Tests set this to 0 to force the two-pass backward (no header declares it:
 * it is not API). */
int64_t lz_layernorm_fused_max_cols = FUSED_MAX_COLS;

/* ---------------------------------------------------------------- forward */

LZ_DISPATCH static void layernorm_forward_row(float *out, float *mean_out, float *rstd_out,
                                              const float *x, const float *w, const float *b,
                                              int64_t C, float eps) {
  /* One pass: sums of d = x - k and d^2, shifted by k = x[0]. The plain
   * E[x^2] - E[x]^2 cancels badly when the mean is large next to the spread;
   * after the shift the mean of d is on the order of the spread. */
  const float k = C > 0 ? x[0] : 0.0f;
  lz_lanes_f32 acc = {0}, acc2 = {0};
  int64_t i = 0;
  for (; i + LZ_LANES <= C; i += LZ_LANES) {
    lz_lanes_f32 d;
    LZ_LOAD_LANES(d, x + i);
    d -= k;
    acc += d;
    acc2 += d * d;
  }
  float sum = lz_sum_lanes(&acc), sum2 = lz_sum_lanes(&acc2);
  for (; i < C; i++) {
    float d = x[i] - k;
    sum += d;
    sum2 += d * d;
  }
  const float md = sum / (float)C, m = k + md;
  float var = sum2 / (float)C - md * md; /* biased variance, as PyTorch's LayerNorm */
  var = var > 0.0f ? var : 0.0f;
  const float s = 1.0f / sqrtf(var + eps);

  for (i = 0; i < C; i++) out[i] = (x[i] - m) * s * w[i] + b[i];
  *mean_out = m;
  *rstd_out = s;
}

lz_status lz_layernorm_forward(lz_tensor *out, lz_tensor *mean, lz_tensor *rstd,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *b,
                               float eps) {
  const char *op = "layernorm_forward";
  const lz_arg like[] = {{"out", out}, {0}}, per_col[] = {{"w", w}, {"b", b}, {0}},
               per_row[] = {{"mean", mean}, {"rstd", rstd}, {0}};
  const lz_op_args args = {
      .t = {out, mean, rstd, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)b}, .f = {eps}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_LAYERNORM_FORWARD, &args));
  LZ_TRY(lz_check_rowwise(op, x, like, per_col, per_row));
  if (!(eps >= 0.0f) || isinf(eps))
    return lz_fail(LZ_ERR_INVALID, "%s: eps is %g; it must be finite and >= 0", op,
                   (double)eps);
  return lz_op_run(op, LZ_OP_LAYERNORM_FORWARD, &args);
}

lz_status lz_cpu_layernorm_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0], *mean = a->t[1], *rstd = a->t[2];
  const lz_tensor *x = a->t[3], *w = a->t[4], *b = a->t[5];
  const float eps = a->f[0];
  const int64_t C = lz_cols(x), rows = lz_rows(x);

  float *o = out->data, *mu = mean->data, *rs = rstd->data;
  const float *xp = x->data, *wp = w->data, *bp = b->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
  for (int64_t r = 0; r < rows; r++)
    layernorm_forward_row(o + r * C, mu + r, rs + r, xp + r * C, wp, bp, C, eps);
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* With norm = (x - mean) * rstd and g = w * dy:
 *   dx = rstd * (g - mean(g) - norm * mean(g * norm)).
 * The rows [r0, r1) also add norm * dy into pw and dy into pb, in row order.
 * dx may be dy: a row of dy is read whole before that row of dx is written. */
LZ_DISPATCH static void layernorm_backward_rows(float *dx, float *restrict pw, float *restrict pb,
                                                const float *dy, const float *x, const float *w,
                                                const float *mean, const float *rstd, int64_t r0,
                                                int64_t r1, int64_t C) {
  for (int64_t i = 0; i < C; i++) pw[i] = pb[i] = 0.0f;
  for (int64_t r = r0; r < r1; r++) {
    const float *xr = x + r * C, *dyr = dy + r * C;
    float *dxr = dx + r * C;
    const float m = mean[r], s = rstd[r];
    lz_lanes_f32 ag = {0}, agn = {0};
    int64_t i = 0;
    for (; i + LZ_LANES <= C; i += LZ_LANES) {
      lz_lanes_f32 d, xv, wv, aw, ab;
      LZ_LOAD_LANES(d, dyr + i), LZ_LOAD_LANES(xv, xr + i), LZ_LOAD_LANES(wv, w + i);
      LZ_LOAD_LANES(aw, pw + i), LZ_LOAD_LANES(ab, pb + i);
      const lz_lanes_f32 norm = (xv - m) * s, g = wv * d;
      ag += g;
      agn += g * norm;
      aw += norm * d;
      ab += d;
      LZ_STORE_LANES(pw + i, aw), LZ_STORE_LANES(pb + i, ab);
    }
    float sum_g = lz_sum_lanes(&ag), sum_gn = lz_sum_lanes(&agn);
    for (; i < C; i++) {
      const float d = dyr[i], norm = (xr[i] - m) * s, g = w[i] * d;
      sum_g += g;
      sum_gn += g * norm;
      pw[i] += norm * d;
      pb[i] += d;
    }
    const float mean_g = sum_g / (float)C, mean_gn = sum_gn / (float)C;
    for (i = 0; i < C; i++) {
      const float norm = (xr[i] - m) * s;
      dxr[i] = (w[i] * dyr[i] - mean_g - norm * mean_gn) * s;
    }
  }
}

/* The two-pass path's dw/db for the columns [c0, c0+nc): the same sums, in the
 * same order, as the one-pass path's row-block partials added in block order. */
LZ_DISPATCH static void layernorm_dw_db_block(float *dw, float *db, const float *dy,
                                              const float *x, const float *mean,
                                              const float *rstd, int64_t rows, int64_t C,
                                              int64_t c0, int64_t nc) {
  float tw[COL_BLOCK] = {0}, tb[COL_BLOCK] = {0};
  const int64_t n = lz_row_blocks(rows);
  for (int64_t k = 0; k < n; k++) {
    float aw[COL_BLOCK] = {0}, ab[COL_BLOCK] = {0};
    for (int64_t r = lz_block_start(k, n, rows); r < lz_block_start(k + 1, n, rows); r++) {
      const float *xr = x + r * C + c0, *dyr = dy + r * C + c0;
      const float m = mean[r], s = rstd[r];
      for (int64_t j = 0; j < nc; j++) {
        const float d = dyr[j], norm = (xr[j] - m) * s;
        aw[j] += norm * d;
        ab[j] += d;
      }
    }
    for (int64_t j = 0; j < nc; j++) tw[j] += aw[j], tb[j] += ab[j];
  }
  for (int64_t j = 0; j < nc; j++) {
    dw[c0 + j] += tw[j];
    db[c0 + j] += tb[j];
  }
}

/* dx for one row, without dw/db: the second pass of the two-pass path. */
LZ_DISPATCH static void layernorm_dx_row(float *dx, const float *dy, const float *x,
                                         const float *w, float m, float s, int64_t C) {
  lz_lanes_f32 ag = {0}, agn = {0};
  int64_t i = 0;
  for (; i + LZ_LANES <= C; i += LZ_LANES) {
    lz_lanes_f32 d, xv, wv;
    LZ_LOAD_LANES(d, dy + i), LZ_LOAD_LANES(xv, x + i), LZ_LOAD_LANES(wv, w + i);
    const lz_lanes_f32 norm = (xv - m) * s, g = wv * d;
    ag += g;
    agn += g * norm;
  }
  float sum_g = lz_sum_lanes(&ag), sum_gn = lz_sum_lanes(&agn);
  for (; i < C; i++) {
    const float norm = (x[i] - m) * s, g = w[i] * dy[i];
    sum_g += g;
    sum_gn += g * norm;
  }
  const float mean_g = sum_g / (float)C, mean_gn = sum_gn / (float)C;
  for (i = 0; i < C; i++) {
    const float norm = (x[i] - m) * s;
    dx[i] = (w[i] * dy[i] - mean_g - norm * mean_gn) * s;
  }
}

lz_status lz_layernorm_backward(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                const lz_tensor *mean, const lz_tensor *rstd) {
  const char *op = "layernorm_backward";
  const lz_arg like[] = {{"dy", dy}, {"dx", dx}, {0}},
               per_col[] = {{"w", w}, {"dw", dw}, {"db", db}, {0}},
               per_row[] = {{"mean", mean}, {"rstd", rstd}, {0}};
  const lz_op_args args = {.t = {dx, dw, db, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w,
                                 (lz_tensor *)mean, (lz_tensor *)rstd}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_LAYERNORM_BACKWARD, &args));
  LZ_TRY(lz_check_rowwise(op, x, like, per_col, per_row));
  return lz_op_run(op, LZ_OP_LAYERNORM_BACKWARD, &args);
}

lz_status lz_cpu_layernorm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dw = a->t[1], *db = a->t[2];
  const lz_tensor *dy = a->t[3], *x = a->t[4], *w = a->t[5], *mean = a->t[6], *rstd = a->t[7];
  const int64_t C = lz_cols(x), rows = lz_rows(x);

  const float *dyp = dy->data, *xp = x->data, *wp = w->data;
  const float *mu = mean->data, *rs = rstd->data;
  float *dxp = dx->data, *dwp = dw->data, *dbp = db->data;
  const int parallel = rows * C > (1 << 15);

  if (C > 0 && C <= lz_layernorm_fused_max_cols) { /* C > 0: no empty VLA */
    const int64_t n = lz_row_blocks(rows);
    float partial[2 * n * C]; /* block k: dw sums at 2kC, db sums at (2k+1)C */
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t k = 0; k < n; k++)
      layernorm_backward_rows(dxp, partial + 2 * k * C, partial + (2 * k + 1) * C, dyp, xp, wp, mu,
                              rs, lz_block_start(k, n, rows), lz_block_start(k + 1, n, rows), C);
    lz_add_block_partials(dwp, partial, n, C, 2 * C);
    lz_add_block_partials(dbp, partial + C, n, C, 2 * C);
    return LZ_OK;
  }

  /* dw, db first: dx may share memory with dy, and the row pass overwrites it. */
  const int64_t n_blocks = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t k = 0; k < n_blocks; k++) {
    int64_t c0 = k * COL_BLOCK, nc = C - c0 < COL_BLOCK ? C - c0 : COL_BLOCK;
    layernorm_dw_db_block(dwp, dbp, dyp, xp, mu, rs, rows, C, c0, nc);
  }

#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; r++)
    layernorm_dx_row(dxp + r * C, dyp + r * C, xp + r * C, wp, mu[r], rs[r], C);
  return LZ_OK;
}
