/* rmsnorm.c — RMSNorm over the last dimension (Llama's input_layernorm,
 * post_attention_layernorm and final norm), as Hugging Face's LlamaRMSNorm:
 *   y = w * (x / sqrt(mean(x^2) + eps)), in fp32. A cpu kernel (sim runs it too).
 *
 * x and w are f32 or both bf16; rstd, dx and dw are f32. A bf16 row is
 * widened to f32 on the stack and goes through the f32 code, so a bf16 call
 * gives bitwise what the f32 call gives on the widened inputs. out is f32, or
 * bf16 for a norm whose output only feeds bf16 GEMMs: each row is computed in
 * f32 on the stack and rounded as tensor_copy rounds, so no separate cast
 * pass reads it back, and the result is bitwise the f32 output converted.
 *
 * Forward saves each row's 1/rms so backward need not recompute it. Backward
 * writes dx and sums dw in one pass over fixed row blocks (lz_rowblocks.h),
 * so dw does not depend on the thread count. Rows wider than FUSED_MAX_COLS
 * (whose partials would not fit the stack) take two passes: dw, threads
 * splitting the columns and each walking all rows in order, then dx. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_lanes.h"     /* sums in independent lanes */
#include "kernels/lz_rowblocks.h" /* the row blocks of the dw sums */

#include <math.h> /* sqrtf, isinf */

/* Columns per thread task in the two-pass dw pass: two cache lines. */
#define COL_BLOCK 32
/* Widest rows the one-pass backward takes: 256 KiB of partials on the stack. */
#define FUSED_MAX_COLS 4096
/* Widest bf16 rows: backward widens three rows per thread on its stack. */
#define BF16_MAX_COLS 16384

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

/* bf16 x and w: the row widened, then rmsnorm_forward_row. */
LZ_DISPATCH static void rmsnorm_forward_row_bf16(float *out, float *rstd_out, const uint16_t *x,
                                                 const uint16_t *w, int64_t C, float eps) {
  float xf[C], wf[C];
  lz_row_to_f32(xf, x, LZ_BF16, C);
  lz_row_to_f32(wf, w, LZ_BF16, C);
  rmsnorm_forward_row(out, rstd_out, xf, wf, C, eps);
}

/* Row r of a bf16 out: the f32 row on the stack (from f32 or bf16 x and w),
 * then rounded to nearest even. */
LZ_DISPATCH static void rmsnorm_forward_row_to_bf16(uint16_t *out, float *rstd_out,
                                                    const lz_tensor *x, const lz_tensor *w,
                                                    int64_t r, int64_t C, float eps) {
  float of[C];
  if (x->dtype == LZ_BF16)
    rmsnorm_forward_row_bf16(of, rstd_out, (const uint16_t *)x->data + r * C, w->data, C, eps);
  else
    rmsnorm_forward_row(of, rstd_out, (const float *)x->data + r * C, w->data, C, eps);
  lz_row_to_bf16(out, of, C);
}

/* The shapes forward and backward share, their dtypes checked: x (and
 * `like`) of 1 to LZ_MAX_DIMS dimensions, w and `per_col` of C elements,
 * `out_like` shaped as x and overwriting no bf16 x, rstd one per row. */
static lz_status check_args(const char *op, const lz_tensor *x, const lz_arg *like,
                            const lz_tensor *w, const lz_arg *out_like, const lz_arg *per_col,
                            const lz_tensor *rstd) {
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  for (; like->name; like++) LZ_TRY(lz_check_same_shape(op, like->name, like->t, "x", x));
  for (; out_like->name; out_like++) {
    LZ_TRY(lz_check_same_shape(op, out_like->name, out_like->t, "x", x));
    LZ_TRY(lz_check_no_alias(op, out_like->name, out_like->t, "x", x));
  }
  LZ_TRY(lz_check_numel(op, "w", w, C, "the last dimension of x"));
  for (; per_col->name; per_col++)
    LZ_TRY(lz_check_numel(op, per_col->name, per_col->t, C, "the last dimension of x"));
  LZ_TRY(lz_check_numel(op, "rstd", rstd, rows, "one per row of x"));
  if (x->dtype == LZ_BF16 && C > BF16_MAX_COLS)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "%s: bf16 rows of %lld columns are wider than the %d supported; pass f32", op,
                   (long long)C, BF16_MAX_COLS);
  return LZ_OK;
}

lz_status lz_rmsnorm_forward(lz_tensor *out, lz_tensor *rstd, const lz_tensor *x,
                             const lz_tensor *w, float eps) {
  const char *op = "rmsnorm_forward";
  const lz_arg none[] = {{0}}, out_like[] = {{"out", out}, {0}};
  const lz_op_args args = {.t = {out, rstd, (lz_tensor *)x, (lz_tensor *)w}, .f = {eps}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_RMSNORM_FORWARD, &args)); /* check_args reads them */
  LZ_TRY(check_args(op, x, none, w, out_like, none, rstd));
  if (!(eps >= 0.0f) || isinf(eps))
    return lz_fail(LZ_ERR_INVALID, "%s: eps is %g; it must be finite and >= 0", op, (double)eps);
  if (out->dtype == LZ_BF16 && (out->data == x->data || lz_cols(x) > BF16_MAX_COLS))
    return lz_fail(LZ_ERR_INVALID,
                   "%s: a bf16 out must be its own memory, rows of at most %d columns (got %lld); "
                   "pass an f32 out",
                   op, BF16_MAX_COLS, (long long)lz_cols(x));
  return lz_op_run(op, LZ_OP_RMSNORM_FORWARD, &args);
}

lz_status lz_cpu_rmsnorm_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0], *rstd = a->t[1];
  const lz_tensor *x = a->t[2], *w = a->t[3];
  const float eps = a->f[0];
  const int64_t C = lz_cols(x), rows = lz_rows(x);

  float *o = out->data, *rs = rstd->data;
  if (out->dtype == LZ_BF16) {
    uint16_t *ob = out->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
    for (int64_t r = 0; r < rows; r++)
      rmsnorm_forward_row_to_bf16(ob + r * C, rs + r, x, w, r, C, eps);
    return LZ_OK;
  }
  if (x->dtype == LZ_BF16) {
    const uint16_t *xp = x->data, *wp = w->data;
#pragma omp parallel for schedule(static) if (rows * C > (1 << 15))
    for (int64_t r = 0; r < rows; r++)
      rmsnorm_forward_row_bf16(o + r * C, rs + r, xp + r * C, wp, C, eps);
    return LZ_OK;
  }
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

/* bf16 dy, x, w: rmsnorm_backward_rows on widened rows. */
LZ_DISPATCH static void rmsnorm_backward_rows_bf16(float *dx, float *restrict pw,
                                                   const uint16_t *dy, const uint16_t *x,
                                                   const uint16_t *w, const float *rstd, int64_t r0,
                                                   int64_t r1, int64_t C) {
  float wf[C], dyf[C], xf[C];
  lz_row_to_f32(wf, w, LZ_BF16, C);
  for (int64_t i = 0; i < C; i++) pw[i] = 0.0f;
  for (int64_t r = r0; r < r1; r++) {
    lz_row_to_f32(dyf, dy + r * C, LZ_BF16, C);
    lz_row_to_f32(xf, x + r * C, LZ_BF16, C);
    const float s = rstd[r];
    for (int64_t i = 0; i < C; i++) pw[i] += dyf[i] * (xf[i] * s);
    rmsnorm_dx_row(dx + r * C, dyf, xf, wf, s, C);
  }
}

/* The two-pass path's dw for bf16 dy and x: rmsnorm_dw_block's sums. */
LZ_DISPATCH static void rmsnorm_dw_block_bf16(float *dw, const uint16_t *dy, const uint16_t *x,
                                              const float *rstd, int64_t rows, int64_t C,
                                              int64_t c0, int64_t nc) {
  float acc[COL_BLOCK] = {0}, xf[COL_BLOCK], dyf[COL_BLOCK];
  for (int64_t r = 0; r < rows; r++) {
    lz_row_to_f32(xf, x + r * C + c0, LZ_BF16, nc);
    lz_row_to_f32(dyf, dy + r * C + c0, LZ_BF16, nc);
    const float s = rstd[r];
    for (int64_t j = 0; j < nc; j++) acc[j] += dyf[j] * (xf[j] * s);
  }
  for (int64_t j = 0; j < nc; j++) dw[c0 + j] += acc[j];
}

LZ_DISPATCH static void rmsnorm_dx_row_bf16(float *dx, const uint16_t *dy, const uint16_t *x,
                                            const uint16_t *w, float s, int64_t C) {
  float wf[C], dyf[C], xf[C];
  lz_row_to_f32(wf, w, LZ_BF16, C);
  lz_row_to_f32(dyf, dy, LZ_BF16, C);
  lz_row_to_f32(xf, x, LZ_BF16, C);
  rmsnorm_dx_row(dx, dyf, xf, wf, s, C);
}

lz_status lz_rmsnorm_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy, const lz_tensor *x,
                              const lz_tensor *w, const lz_tensor *rstd) {
  const char *op = "rmsnorm_backward";
  const lz_arg like[] = {{"dy", dy}, {0}}, out_like[] = {{"dx", dx}, {0}},
               per_col[] = {{"dw", dw}, {0}};
  const lz_op_args args = {
      .t = {dx, dw, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)rstd}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_RMSNORM_BACKWARD, &args));
  LZ_TRY(check_args(op, x, like, w, out_like, per_col, rstd));
  if (dy->dtype != LZ_F32 && dx->data == dy->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: dx (f32) and dy (bf16) are the same memory; only an f32 dy may be "
                   "overwritten by dx",
                   op);
  return lz_op_run(op, LZ_OP_RMSNORM_BACKWARD, &args);
}

lz_status lz_cpu_rmsnorm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dw = a->t[1];
  const lz_tensor *dy = a->t[2], *x = a->t[3], *w = a->t[4], *rstd = a->t[5];
  const int64_t C = lz_cols(x), rows = lz_rows(x);

  const int bf16 = x->dtype == LZ_BF16;
  const void *dyp = dy->data, *xp = x->data, *wp = w->data;
  const float *rs = rstd->data;
  float *dxp = dx->data, *dwp = dw->data;
  const int parallel = rows * C > (1 << 15);

  if (C > 0 && C <= FUSED_MAX_COLS) { /* C > 0: no empty VLA */
    const int64_t n = lz_row_blocks(rows);
    float partial[n * C]; /* block k's dw sums at kC */
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t k = 0; k < n; k++) {
      const int64_t r0 = lz_block_start(k, n, rows), r1 = lz_block_start(k + 1, n, rows);
      if (bf16)
        rmsnorm_backward_rows_bf16(dxp, partial + k * C, dyp, xp, wp, rs, r0, r1, C);
      else
        rmsnorm_backward_rows(dxp, partial + k * C, dyp, xp, wp, rs, r0, r1, C);
    }
    lz_add_block_partials(dwp, partial, n, C, C);
    return LZ_OK;
  }

  /* dw first: dx may share memory with dy, and the row pass overwrites it. */
  const int64_t n_blocks = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t k = 0; k < n_blocks; k++) {
    int64_t c0 = k * COL_BLOCK, nc = C - c0 < COL_BLOCK ? C - c0 : COL_BLOCK;
    if (bf16)
      rmsnorm_dw_block_bf16(dwp, dyp, xp, rs, rows, C, c0, nc);
    else
      rmsnorm_dw_block(dwp, dyp, xp, rs, rows, C, c0, nc);
  }
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; r++) {
    if (bf16)
      rmsnorm_dx_row_bf16(dxp + r * C, (const uint16_t *)dyp + r * C, (const uint16_t *)xp + r * C,
                          wp, rs[r], C);
    else
      rmsnorm_dx_row(dxp + r * C, (const float *)dyp + r * C, (const float *)xp + r * C, wp, rs[r],
                     C);
  }
  return LZ_OK;
}
