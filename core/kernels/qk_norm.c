/* qk_norm.c — QK-norm: an RMSNorm over each head of q and of k inside packed
 * q|k|v rows (Qwen3's q_norm and k_norm, Gemma 3's), before the rotary turn:
 *   y = (offset + w) * (x / sqrt(mean(x^2) + eps)), in fp32,
 * one weight of head_dim for every q head, another for every k head. offset
 * 0 is Qwen3RMSNorm (w * x̂), 1 is Gemma3RMSNorm (x̂ * (1 + w), the sum
 * rounded to fp32 first, as transformers does it). A cpu kernel (sim runs
 * it too).
 *
 * A row is [q heads (n_head) | k heads (n_kv_head) | the rest (v)]; the rest
 * is copied to out (left alone when out is x). Forward saves each head's
 * 1/rms. Backward writes dx and sums dw in one pass over fixed row blocks
 * (lz_rowblocks.h), heads in order within a row, so dw does not depend on
 * the thread count. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_lanes.h"     /* sums in independent lanes */
#include "kernels/lz_rowblocks.h" /* the row blocks of the dw sums */

#include <math.h>   /* sqrtf, isinf */
#include <string.h> /* memcpy: the columns after the k heads */

/* Widest head: a block's q and k partials (2 * head_dim floats per block)
 * live on the stack. */
#define QK_MAX_HEAD_DIM 1024

/* ---------------------------------------------------------------- forward */

LZ_DISPATCH static void head_forward(float *out, float *rstd_out, const float *x, const float *w,
                                     int64_t D, float eps, float offset) {
  lz_lanes_f32 acc = {0};
  int64_t i = 0;
  for (; i + LZ_LANES <= D; i += LZ_LANES) {
    lz_lanes_f32 v;
    LZ_LOAD_LANES(v, x + i);
    acc += v * v;
  }
  float sum2 = lz_sum_lanes(&acc);
  for (; i < D; i++) sum2 += x[i] * x[i];
  const float s = 1.0f / sqrtf(sum2 / (float)D + eps);
  /* x * s is rounded before the weight multiplies it, as in Qwen3RMSNorm. */
  for (i = 0; i < D; i++) out[i] = (offset + w[i]) * (x[i] * s);
  *rstd_out = s;
}

/* The checks forward and backward share: x [..., C] f32 with C >= (n_head
 * + n_kv_head) * head_dim, head_dim = numel(q_w) = numel(k_w), rstd one per
 * head of each row, every `like` shaped as x. */
static lz_status check_args(const char *op, const lz_tensor *x, const lz_arg *like,
                            const lz_tensor *q_w, const lz_tensor *k_w, const lz_arg *per_head_dim,
                            const lz_tensor *rstd, int n_head, int n_kv_head) {
  LZ_TRY(lz_check_ndim(op, "qkv", x, 1, LZ_MAX_DIMS));
  for (; like->name; like++) LZ_TRY(lz_check_same_shape(op, like->name, like->t, "qkv", x));
  if (n_head < 1 || n_kv_head < 1)
    return lz_fail(LZ_ERR_INVALID, "%s: n_head is %d and n_kv_head %d; both must be >= 1", op,
                   n_head, n_kv_head);
  LZ_TRY(lz_check_present(op, "q_w", q_w));
  const int64_t D = lz_tensor_numel(q_w);
  if (D < 1 || D > QK_MAX_HEAD_DIM)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: q_w holds %lld elements (head_dim); it must hold 1 to %d", op,
                   (long long)D, QK_MAX_HEAD_DIM);
  LZ_TRY(lz_check_numel(op, "k_w", k_w, D, "head_dim, as q_w"));
  for (; per_head_dim->name; per_head_dim++)
    LZ_TRY(lz_check_numel(op, per_head_dim->name, per_head_dim->t, D, "head_dim, as q_w"));
  const int64_t C = lz_cols(x), normed = (int64_t)(n_head + n_kv_head) * D;
  if (normed > C) {
    char buf[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s, but (n_head + n_kv_head) * head_dim = (%d + %d) * %lld = %lld; "
                   "its last dimension must hold the q and k heads",
                   op, lz_tensor_describe(x, buf, sizeof buf), n_head, n_kv_head, (long long)D,
                   (long long)normed);
  }
  return lz_check_numel(op, "rstd", rstd, lz_rows(x) * (n_head + n_kv_head),
                        "one per q and k head of each row of qkv");
}

lz_status lz_qk_norm_forward(lz_tensor *out, lz_tensor *rstd, const lz_tensor *qkv,
                             const lz_tensor *q_w, const lz_tensor *k_w, int n_head, int n_kv_head,
                             float eps, float offset) {
  const char *op = "qk_norm_forward";
  const lz_arg like[] = {{"out", out}, {0}}, none[] = {{0}};
  const lz_op_args args = {
      .t = {out, rstd, (lz_tensor *)qkv, (lz_tensor *)q_w, (lz_tensor *)k_w},
      .i = {n_head, n_kv_head}, .f = {eps, offset}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_QK_NORM_FORWARD, &args));
  LZ_TRY(check_args(op, qkv, like, q_w, k_w, none, rstd, n_head, n_kv_head));
  if (!(eps >= 0.0f) || isinf(eps))
    return lz_fail(LZ_ERR_INVALID, "%s: eps is %g; it must be finite and >= 0", op, (double)eps);
  if (isnan(offset) || isinf(offset))
    return lz_fail(LZ_ERR_INVALID, "%s: offset is %g; it must be finite (Qwen3 0, Gemma 3 1)", op,
                   (double)offset);
  return lz_op_run(op, LZ_OP_QK_NORM_FORWARD, &args);
}

lz_status lz_cpu_qk_norm_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0], *rstd = a->t[1];
  const lz_tensor *x = a->t[2], *q_w = a->t[3], *k_w = a->t[4];
  const int n_q = (int)a->i[0], heads = (int)(a->i[0] + a->i[1]);
  const float eps = a->f[0], offset = a->f[1];
  const int64_t D = lz_tensor_numel(q_w), C = lz_cols(x), rows = lz_rows(x);
  const int64_t normed = heads * D;
  float *o = out->data, *rs = rstd->data;
  const float *xp = x->data, *qw = q_w->data, *kw = k_w->data;
#pragma omp parallel for schedule(static) if (rows * normed > (1 << 15))
  for (int64_t r = 0; r < rows; r++) {
    for (int h = 0; h < heads; h++)
      head_forward(o + r * C + h * D, rs + r * heads + h, xp + r * C + h * D, h < n_q ? qw : kw, D,
                   eps, offset);
    if (o != xp && C > normed)
      memcpy(o + r * C + normed, xp + r * C + normed, (size_t)(C - normed) * sizeof(float));
  }
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* One head: pw += dy * (x * s); with n = x * s and g = (offset + w) * dy,
 * dx = s * (g - n * mean(g * n)). dx may be dy: the head's dy is read whole
 * (the sums) before the last loop writes dx, element by element. */
LZ_DISPATCH static void head_backward(float *dx, float *restrict pw, const float *dy,
                                      const float *x, const float *w, float s, int64_t D,
                                      float offset) {
  lz_lanes_f32 acc = {0};
  int64_t i = 0;
  for (; i + LZ_LANES <= D; i += LZ_LANES) {
    lz_lanes_f32 d, xv, wv;
    LZ_LOAD_LANES(d, dy + i), LZ_LOAD_LANES(xv, x + i), LZ_LOAD_LANES(wv, w + i);
    acc += ((offset + wv) * d) * (xv * s);
  }
  float sum_gn = lz_sum_lanes(&acc);
  for (; i < D; i++) sum_gn += ((offset + w[i]) * dy[i]) * (x[i] * s);
  for (i = 0; i < D; i++) pw[i] += dy[i] * (x[i] * s);
  const float mean_gn = sum_gn / (float)D;
  for (i = 0; i < D; i++) dx[i] = ((offset + w[i]) * dy[i] - x[i] * s * mean_gn) * s;
}

lz_status lz_qk_norm_backward(lz_tensor *dx, lz_tensor *dq_w, lz_tensor *dk_w, const lz_tensor *dy,
                              const lz_tensor *qkv, const lz_tensor *q_w, const lz_tensor *k_w,
                              const lz_tensor *rstd, int n_head, int n_kv_head, float offset) {
  const char *op = "qk_norm_backward";
  const lz_arg like[] = {{"dx", dx}, {"dy", dy}, {0}},
               per_head_dim[] = {{"dq_w", dq_w}, {"dk_w", dk_w}, {0}};
  const lz_op_args args = {.t = {dx, dq_w, dk_w, (lz_tensor *)dy, (lz_tensor *)qkv,
                                 (lz_tensor *)q_w, (lz_tensor *)k_w, (lz_tensor *)rstd},
                           .i = {n_head, n_kv_head}, .f = {offset}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_QK_NORM_BACKWARD, &args));
  LZ_TRY(check_args(op, qkv, like, q_w, k_w, per_head_dim, rstd, n_head, n_kv_head));
  if (isnan(offset) || isinf(offset))
    return lz_fail(LZ_ERR_INVALID, "%s: offset is %g; it must be finite (Qwen3 0, Gemma 3 1)", op,
                   (double)offset);
  return lz_op_run(op, LZ_OP_QK_NORM_BACKWARD, &args);
}

lz_status lz_cpu_qk_norm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dq_w = a->t[1], *dk_w = a->t[2];
  const lz_tensor *dy = a->t[3], *x = a->t[4], *q_w = a->t[5], *k_w = a->t[6], *rstd = a->t[7];
  const int n_q = (int)a->i[0], heads = (int)(a->i[0] + a->i[1]);
  const float offset = a->f[0];
  const int64_t D = lz_tensor_numel(q_w), C = lz_cols(x), rows = lz_rows(x);
  const int64_t normed = heads * D;
  float *dxp = dx->data;
  const float *dyp = dy->data, *xp = x->data, *qw = q_w->data, *kw = k_w->data, *rs = rstd->data;

  const int64_t n = lz_row_blocks(rows);
  float partial[n * 2 * D]; /* block k's q sums at 2kD, its k sums at 2kD + D */
#pragma omp parallel for schedule(static) if (rows * normed > (1 << 15))
  for (int64_t k = 0; k < n; k++) {
    float *pw = partial + k * 2 * D;
    for (int64_t i = 0; i < 2 * D; i++) pw[i] = 0.0f;
    const int64_t r0 = lz_block_start(k, n, rows), r1 = lz_block_start(k + 1, n, rows);
    for (int64_t r = r0; r < r1; r++) {
      for (int h = 0; h < heads; h++) {
        const int64_t at = r * C + h * D;
        head_backward(dxp + at, h < n_q ? pw : pw + D, dyp + at, xp + at, h < n_q ? qw : kw,
                      rs[r * heads + h], D, offset);
      }
      if (dxp != dyp && C > normed)
        memcpy(dxp + r * C + normed, dyp + r * C + normed, (size_t)(C - normed) * sizeof(float));
    }
  }
  lz_add_block_partials(dq_w->data, partial, n, D, 2 * D);
  lz_add_block_partials(dk_w->data, partial + D, n, D, 2 * D);
  return LZ_OK;
}
