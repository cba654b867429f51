/* rmsnorm.c — RMSNorm over the last dimension (Llama's input_layernorm,
 * post_attention_layernorm and final norm), as Hugging Face's LlamaRMSNorm:
 *   y = w * (x / sqrt(mean(x^2) + eps)), in fp32. A cpu kernel (sim runs it too).
 *
 * Forward saves each row's 1/rms so backward need not recompute it. Backward
 * writes dx and sums dw in one pass over fixed row blocks (lz_rowblocks.h),
 * so dw does not depend on the thread count. Rows wider than FUSED_MAX_COLS
 * (whose partials would not fit the stack) take two passes: dw, threads
 * splitting the columns and each walking all rows in order, then dx. */
#include "lz_backend.h"
#include "lz_internal.h"
#include "lz_lanes.h"     /* sums in independent lanes */
#include "lz_rowblocks.h" /* the row blocks of the dw sums */

#include <math.h> /* sqrtf, isinf */

/* Columns per thread task in the two-pass dw pass: two cache lines. */
#define COL_BLOCK 32
/* Widest rows the one-pass backward takes: 256 KiB of partials on the stack. */
#define FUSED_MAX_COLS 4096

/* ---------------------------------------------------------------- forward */

LZ_DISPATCH static void rmsnorm_forward_row(float *out, float *rstd_out, const float *x,
                                            const float *w, int64_t C, float eps) {
  lz_lanes_f32 acc = {0};
  int64_t i = 0;
  for (; i + LZ_LANES <= C; i += LZ_LANES) {
    lz_lanes_f32 v;
    LZ_LOAD_LANES(v, x + i);
    acc += v * v;
  }
  float sum2 = lz_sum_lanes(&acc);
  for (; i < C; i++) sum2 += x[i] * x[i];
  const float s = 1.0f / sqrtf(sum2 / (float)C + eps);
  /* x * s is rounded before the weight multiplies it, as in LlamaRMSNorm. */
  for (i = 0; i < C; i++) out[i] = w[i] * (x[i] * s);
  *rstd_out = s;
}

lz_status lz_rmsnorm_forward(lz_tensor *out, lz_tensor *rstd, const lz_tensor *x,
                             const lz_tensor *w, float eps) {
  const char *op = "rmsnorm_forward";
  const lz_arg like[] = {{"out", out}, {0}}, per_col[] = {{"w", w}, {0}},
               per_row[] = {{"rstd", rstd}, {0}};
  LZ_TRY(lz_check_rowwise(op, x, like, per_col, per_row));
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  if (!(eps >= 0.0f) || isinf(eps))
    return lz_fail(LZ_ERR_INVALID, "%s: eps is %g; it must be finite and >= 0", op, (double)eps);
  LZ_DEVICE_DISPATCH(op, LZ_OP_RMSNORM_FORWARD, .t = {out, rstd, (lz_tensor *)x, (lz_tensor *)w},
                     .f = {eps});

  float *o = out->data, *rs = rstd->data;
  const float *xp = x->data, *wp = w->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
  for (int64_t r = 0; r < rows; r++) rmsnorm_forward_row(o + r * C, rs + r, xp + r * C, wp, C, eps);
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* dw[c0, c0+nc) += sum over rows, in row order, of dy * (x * rstd). */
LZ_DISPATCH static void rmsnorm_dw_block(float *dw, const float *dy, const float *x,
                                         const float *rstd, int64_t rows, int64_t C, int64_t c0,
                                         int64_t nc) {
  float acc[COL_BLOCK] = {0};
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * C + c0, *dyr = dy + r * C + c0;
    const float s = rstd[r];
    for (int64_t j = 0; j < nc; j++) acc[j] += dyr[j] * (xr[j] * s);
  }
  for (int64_t j = 0; j < nc; j++) dw[c0 + j] += acc[j];
}

/* With norm = x * rstd and g = w * dy:  dx = rstd * (g - norm * mean(g * norm)).
 * dx may be dy: the row of dy is read whole before dx is written. */
LZ_DISPATCH static void rmsnorm_dx_row(float *dx, const float *dy, const float *x, const float *w,
                                       float s, int64_t C) {
  lz_lanes_f32 acc = {0};
  int64_t i = 0;
  for (; i + LZ_LANES <= C; i += LZ_LANES) {
    lz_lanes_f32 d, xv, wv;
    LZ_LOAD_LANES(d, dy + i), LZ_LOAD_LANES(xv, x + i), LZ_LOAD_LANES(wv, w + i);
    acc += (wv * d) * (xv * s);
  }
  float sum_gn = lz_sum_lanes(&acc);
  for (; i < C; i++) sum_gn += (w[i] * dy[i]) * (x[i] * s);
  const float mean_gn = sum_gn / (float)C;
  for (i = 0; i < C; i++) dx[i] = (w[i] * dy[i] - x[i] * s * mean_gn) * s;
}

/* The one-pass path: rows [r0, r1) write dx and sum dy * (x * rstd) in row
 * order into pw. dx may be dy: a row's dw terms are taken before its dx is
 * written. */
LZ_DISPATCH static void rmsnorm_backward_rows(float *dx, float *restrict pw, const float *dy,
                                              const float *x, const float *w, const float *rstd,
                                              int64_t r0, int64_t r1, int64_t C) {
  for (int64_t i = 0; i < C; i++) pw[i] = 0.0f;
  for (int64_t r = r0; r < r1; r++) {
    const float *xr = x + r * C, *dyr = dy + r * C;
    const float s = rstd[r];
    for (int64_t i = 0; i < C; i++) pw[i] += dyr[i] * (xr[i] * s);
    rmsnorm_dx_row(dx + r * C, dyr, xr, w, s, C);
  }
}

lz_status lz_rmsnorm_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy, const lz_tensor *x,
                              const lz_tensor *w, const lz_tensor *rstd) {
  const char *op = "rmsnorm_backward";
  const lz_arg like[] = {{"dy", dy}, {"dx", dx}, {0}}, per_col[] = {{"w", w}, {"dw", dw}, {0}},
               per_row[] = {{"rstd", rstd}, {0}};
  LZ_TRY(lz_check_rowwise(op, x, like, per_col, per_row));
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  LZ_DEVICE_DISPATCH(
      op, LZ_OP_RMSNORM_BACKWARD,
      .t = {dx, dw, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)rstd});

  const float *dyp = dy->data, *xp = x->data, *wp = w->data, *rs = rstd->data;
  float *dxp = dx->data, *dwp = dw->data;
  const int parallel = rows * C > (1 << 15);

  if (C > 0 && C <= FUSED_MAX_COLS) { /* C > 0: no empty VLA */
    const int64_t n = lz_row_blocks(rows);
    float partial[n * C]; /* block k's dw sums at kC */
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t k = 0; k < n; k++)
      rmsnorm_backward_rows(dxp, partial + k * C, dyp, xp, wp, rs, lz_block_start(k, n, rows),
                            lz_block_start(k + 1, n, rows), C);
    lz_add_block_partials(dwp, partial, n, C, C);
    return LZ_OK;
  }

  /* dw first: dx may share memory with dy, and the row pass overwrites it. */
  const int64_t n_blocks = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t k = 0; k < n_blocks; k++) {
    int64_t c0 = k * COL_BLOCK, nc = C - c0 < COL_BLOCK ? C - c0 : COL_BLOCK;
    rmsnorm_dw_block(dwp, dyp, xp, rs, rows, C, c0, nc);
  }
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; r++)
    rmsnorm_dx_row(dxp + r * C, dyp + r * C, xp + r * C, wp, rs[r], C);
  return LZ_OK;
}
