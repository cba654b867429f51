/* layernorm.c — LayerNorm over the last dimension (GPT-2's ln_1, ln_2, ln_f).
 *
 * Forward saves each row's mean and 1/std so backward need not recompute them.
 * Backward writes dx and accumulates dw, db. The dw/db sums run over rows; to
 * keep them bitwise independent of the thread count, threads split the
 * *columns* and each walks all rows in order, rather than each summing a
 * share of the rows into a partial that would have to be merged. */
#include "lz_internal.h"

#include <math.h> /* sqrtf, isinf */

/* Sums are kept in LANES independent partial sums: without -ffast-math GCC
 * will not reorder a single running sum, and so would not vectorize it. */
#define LANES 16
/* Columns per thread task in the dw/db pass: two cache lines of floats. */
#define COL_BLOCK 32

static float sum_lanes(const float acc[LANES]) {
  float s = 0.0f;
  for (int l = 0; l < LANES; l++) s += acc[l];
  return s;
}

/* ---------------------------------------------------------------- forward */

LZ_DISPATCH static void layernorm_forward_row(float *out, float *mean_out, float *rstd_out,
                                              const float *x, const float *w, const float *b,
                                              int64_t C, float eps) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= C; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += x[i + l];
  float sum = sum_lanes(acc);
  for (; i < C; i++) sum += x[i];
  float m = sum / (float)C;

  /* Two passes (mean, then squared deviations): the one-pass E[x^2]-E[x]^2
   * cancels badly when the mean is large next to the spread. */
  float acc2[LANES] = {0};
  for (i = 0; i + LANES <= C; i += LANES)
    for (int l = 0; l < LANES; l++) {
      float d = x[i + l] - m;
      acc2[l] += d * d;
    }
  float var = sum_lanes(acc2);
  for (; i < C; i++) var += (x[i] - m) * (x[i] - m);
  var /= (float)C; /* biased variance, as PyTorch's LayerNorm */
  float s = 1.0f / sqrtf(var + eps);

  for (i = 0; i < C; i++) out[i] = (x[i] - m) * s * w[i] + b[i];
  *mean_out = m;
  *rstd_out = s;
}

lz_status lz_layernorm_forward(lz_tensor *out, lz_tensor *mean, lz_tensor *rstd,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *b,
                               float eps) {
  const char *op = "layernorm_forward";
  LZ_TRY(lz_check_dtype(op, "x", x, LZ_F32));
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  LZ_TRY(lz_check_dtype(op, "out", out, LZ_F32));
  LZ_TRY(lz_check_same_shape(op, "out", out, "x", x));
  LZ_TRY(lz_check_dtype(op, "w", w, LZ_F32));
  LZ_TRY(lz_check_numel(op, "w", w, C, "the last dimension of x"));
  LZ_TRY(lz_check_dtype(op, "b", b, LZ_F32));
  LZ_TRY(lz_check_numel(op, "b", b, C, "the last dimension of x"));
  LZ_TRY(lz_check_dtype(op, "mean", mean, LZ_F32));
  LZ_TRY(lz_check_numel(op, "mean", mean, rows, "one per row of x"));
  LZ_TRY(lz_check_dtype(op, "rstd", rstd, LZ_F32));
  LZ_TRY(lz_check_numel(op, "rstd", rstd, rows, "one per row of x"));
  if (!(eps >= 0.0f) || isinf(eps))
    return lz_fail(LZ_ERR_INVALID, "%s: eps is %g; it must be finite and >= 0", op,
                   (double)eps);

  float *o = out->data, *mu = mean->data, *rs = rstd->data;
  const float *xp = x->data, *wp = w->data, *bp = b->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
  for (int64_t r = 0; r < rows; r++)
    layernorm_forward_row(o + r * C, mu + r, rs + r, xp + r * C, wp, bp, C, eps);
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* dw[c] += sum_r norm[r,c] * dy[r,c];  db[c] += sum_r dy[r,c]  for the columns
 * [c0, c0+nc), rows in order. */
LZ_DISPATCH static void layernorm_dw_db_block(float *dw, float *db, const float *dy,
                                              const float *x, const float *mean,
                                              const float *rstd, int64_t rows, int64_t C,
                                              int64_t c0, int64_t nc) {
  float aw[COL_BLOCK] = {0}, ab[COL_BLOCK] = {0};
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * C + c0, *dyr = dy + r * C + c0;
    const float m = mean[r], s = rstd[r];
    for (int64_t j = 0; j < nc; j++) {
      aw[j] += (xr[j] - m) * s * dyr[j];
      ab[j] += dyr[j];
    }
  }
  for (int64_t j = 0; j < nc; j++) {
    dw[c0 + j] += aw[j];
    db[c0 + j] += ab[j];
  }
}

/* With norm = (x - mean) * rstd and g = w * dy:
 *   dx = rstd * (g - mean(g) - norm * mean(g * norm)).
 * dx may be dy: every element of dy is read before dx overwrites it. */
LZ_DISPATCH static void layernorm_dx_row(float *dx, const float *dy, const float *x,
                                         const float *w, float m, float s, int64_t C) {
  float ag[LANES] = {0}, agn[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= C; i += LANES)
    for (int l = 0; l < LANES; l++) {
      float g = w[i + l] * dy[i + l];
      ag[l] += g;
      agn[l] += g * (x[i + l] - m) * s;
    }
  float sum_g = sum_lanes(ag), sum_gn = sum_lanes(agn);
  for (; i < C; i++) {
    float g = w[i] * dy[i];
    sum_g += g;
    sum_gn += g * (x[i] - m) * s;
  }
  const float mean_g = sum_g / (float)C, mean_gn = sum_gn / (float)C;
  for (i = 0; i < C; i++) {
    float norm = (x[i] - m) * s;
    dx[i] = (w[i] * dy[i] - mean_g - norm * mean_gn) * s;
  }
}

lz_status lz_layernorm_backward(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                const lz_tensor *mean, const lz_tensor *rstd) {
  const char *op = "layernorm_backward";
  LZ_TRY(lz_check_dtype(op, "x", x, LZ_F32));
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  LZ_TRY(lz_check_dtype(op, "dy", dy, LZ_F32));
  LZ_TRY(lz_check_same_shape(op, "dy", dy, "x", x));
  LZ_TRY(lz_check_dtype(op, "dx", dx, LZ_F32));
  LZ_TRY(lz_check_same_shape(op, "dx", dx, "x", x));
  LZ_TRY(lz_check_dtype(op, "w", w, LZ_F32));
  LZ_TRY(lz_check_numel(op, "w", w, C, "the last dimension of x"));
  LZ_TRY(lz_check_dtype(op, "dw", dw, LZ_F32));
  LZ_TRY(lz_check_numel(op, "dw", dw, C, "the last dimension of x"));
  LZ_TRY(lz_check_dtype(op, "db", db, LZ_F32));
  LZ_TRY(lz_check_numel(op, "db", db, C, "the last dimension of x"));
  LZ_TRY(lz_check_dtype(op, "mean", mean, LZ_F32));
  LZ_TRY(lz_check_numel(op, "mean", mean, rows, "one per row of x"));
  LZ_TRY(lz_check_dtype(op, "rstd", rstd, LZ_F32));
  LZ_TRY(lz_check_numel(op, "rstd", rstd, rows, "one per row of x"));

  const float *dyp = dy->data, *xp = x->data, *wp = w->data;
  const float *mu = mean->data, *rs = rstd->data;
  float *dxp = dx->data, *dwp = dw->data, *dbp = db->data;
  const int parallel = rows * C > (1 << 15);

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
