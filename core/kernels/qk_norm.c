/* qk_norm.c — QK-norm: an RMSNorm over each head of q and of k inside packed
 * q|k|v rows (Qwen3's q_norm and k_norm, Gemma 3's), before the rotary turn:
 *   y = (offset + w) * (x / sqrt(mean(x^2) + eps)), in fp32,
 * one weight for every q head (its width numel(q_w)), another for every k
 * head (numel(k_w)). offset 0 is Qwen3RMSNorm (w * x̂), 1 is Gemma3RMSNorm
 * (x̂ * (1 + w), the sum rounded to fp32 first, as transformers does it).
 * OLMoE's whole-projection norm is one q "head" of n_head * head_dim and one
 * k head of n_kv_head * head_dim; its clip_qkv (clip > 0) then clamps q, k
 * and the v columns to [-clip, clip], and backward passes no gradient
 * where a value was clamped (as torch's clamp_), finding those values again
 * from x and rstd. A cpu kernel (sim runs it too).
 *
 * A row is [q heads (n_head) | k heads (n_kv_head) | the rest (v)]; the rest
 * is copied to out (left alone when out is x and there is no clip). Forward
 * saves each head's 1/rms. Backward writes dx and sums dw in one pass over
 * fixed row blocks (lz_rowblocks.h), heads in order within a row, so dw
 * does not depend on the thread count. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_lanes.h"     /* sums in independent lanes */
#include "kernels/lz_rowblocks.h" /* the row blocks of the dw sums */

#include <math.h>   /* sqrtf, isinf */
#include <string.h> /* memcpy: the columns after the k heads */

/* Widest head: a block's q and k partials (the two widths' floats per
 * block) and a head's clipped dy live on the stack. */
#define QK_MAX_HEAD_DIM 8192

/* Where the heads of a row lie: n_q of width Dq, then heads - n_q of Dk. */
typedef struct {
  int n_q, heads;
  int64_t Dq, Dk, normed;
} qk_geom;

static qk_geom geom_of(const lz_op_args *a, const lz_tensor *q_w, const lz_tensor *k_w) {
  const int n_q = (int)a->i[0], heads = (int)(a->i[0] + a->i[1]);
  const int64_t Dq = lz_tensor_numel(q_w), Dk = lz_tensor_numel(k_w);
  return (qk_geom){n_q, heads, Dq, Dk, n_q * Dq + (heads - n_q) * Dk};
}

static inline int64_t head_at(const qk_geom *g, int h) {
  return h < g->n_q ? h * g->Dq : g->n_q * g->Dq + (h - g->n_q) * g->Dk;
}

/* Whether clip (> 0) moves x: x outside [-clip, clip] (NaN is not). */
static inline int clamped(float x, float clip) { return x > clip || x < -clip; }

/* x clamped to [-clip, clip] (clip > 0), as torch's clamp (NaN stays). */
static inline float clamp_to(float x, float clip) {
  return x > clip ? clip : x < -clip ? -clip : x;
}

/* The columns after the k heads: copied, or clamped where clip > 0. */
static void rest_forward(float *o, const float *x, int64_t n, float clip) {
  if (clip > 0.0f)
    for (int64_t i = 0; i < n; i++) o[i] = clamp_to(x[i], clip);
  else if (o != x)
    memcpy(o, x, (size_t)n * sizeof(float));
}

/* ---------------------------------------------------------------- forward */

LZ_DISPATCH static void head_forward(float *out, float *rstd_out, const float *x, const float *w,
                                     int64_t D, float eps, float offset, float clip) {
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
  if (clip > 0.0f)
    for (i = 0; i < D; i++) out[i] = clamp_to(out[i], clip);
  *rstd_out = s;
}

/* The checks forward and backward share: x [..., C] f32 holding the q heads
 * (numel(q_w) wide each) and the k heads (numel(k_w)), rstd one per head of
 * each row, every `like` shaped as x, each `per` as its weight. */
static lz_status check_args(const char *op, const lz_tensor *x, const lz_arg *like,
                            const lz_tensor *q_w, const lz_tensor *k_w, const lz_arg *per,
                            const lz_tensor *rstd, int n_head, int n_kv_head, float clip) {
  LZ_TRY(lz_check_ndim(op, "qkv", x, 1, LZ_MAX_DIMS));
  for (; like->name; like++) LZ_TRY(lz_check_same_shape(op, like->name, like->t, "qkv", x));
  if (n_head < 1 || n_kv_head < 1)
    return lz_fail(LZ_ERR_INVALID, "%s: n_head is %d and n_kv_head %d; both must be >= 1", op,
                   n_head, n_kv_head);
  const lz_arg weights[] = {{"q_w", q_w}, {"k_w", k_w}};
  for (int k = 0; k < 2; k++) {
    LZ_TRY(lz_check_present(op, weights[k].name, weights[k].t));
    const int64_t D = lz_tensor_numel(weights[k].t);
    if (D < 1 || D > QK_MAX_HEAD_DIM)
      return lz_fail(LZ_ERR_INVALID, "%s: %s holds %lld elements (a head's width); it must hold "
                     "1 to %d", op, weights[k].name, (long long)D, QK_MAX_HEAD_DIM);
  }
  const int64_t Dq = lz_tensor_numel(q_w), Dk = lz_tensor_numel(k_w);
  for (int k = 0; per[k].name; k++)
    LZ_TRY(lz_check_numel(op, per[k].name, per[k].t, k ? Dk : Dq, k ? "k_w's" : "q_w's"));
  const int64_t C = lz_cols(x), normed = n_head * Dq + n_kv_head * Dk;
  if (normed > C) {
    char buf[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s, but n_head * numel(q_w) + n_kv_head * numel(k_w) = %d * %lld "
                   "+ %d * %lld = %lld; its last dimension must hold the q and k heads",
                   op, lz_tensor_describe(x, buf, sizeof buf), n_head, (long long)Dq, n_kv_head,
                   (long long)Dk, (long long)normed);
  }
  if (!(clip >= 0.0f) || isinf(clip))
    return lz_fail(LZ_ERR_INVALID, "%s: clip is %g; it must be finite and > 0, or 0 for none",
                   op, (double)clip);
  return lz_check_numel(op, "rstd", rstd, lz_rows(x) * (n_head + n_kv_head),
                        "one per q and k head of each row of qkv");
}

lz_status lz_qk_norm_forward(lz_tensor *out, lz_tensor *rstd, const lz_tensor *qkv,
                             const lz_tensor *q_w, const lz_tensor *k_w, int n_head, int n_kv_head,
                             float eps, float offset, float clip) {
  const char *op = "qk_norm_forward";
  const lz_arg like[] = {{"out", out}, {0}}, none[] = {{0}};
  const lz_op_args args = {
      .t = {out, rstd, (lz_tensor *)qkv, (lz_tensor *)q_w, (lz_tensor *)k_w},
      .i = {n_head, n_kv_head}, .f = {eps, offset, clip}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_QK_NORM_FORWARD, &args));
  LZ_TRY(check_args(op, qkv, like, q_w, k_w, none, rstd, n_head, n_kv_head, clip));
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
  const qk_geom g = geom_of(a, q_w, k_w);
  const float eps = a->f[0], offset = a->f[1], clip = a->f[2];
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  float *o = out->data, *rs = rstd->data;
  const float *xp = x->data, *qw = q_w->data, *kw = k_w->data;
#pragma omp parallel for schedule(static) if (rows * g.normed > (1 << 15))
  for (int64_t r = 0; r < rows; r++) {
    for (int h = 0; h < g.heads; h++) {
      const int64_t at = r * C + head_at(&g, h);
      head_forward(o + at, rs + r * g.heads + h, xp + at, h < g.n_q ? qw : kw,
                   h < g.n_q ? g.Dq : g.Dk, eps, offset, clip);
    }
    rest_forward(o + r * C + g.normed, xp + r * C + g.normed, C - g.normed, clip);
  }
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* One head: pw += dy * (x * s); with n = x * s and g = (offset + w) * dy,
 * dx = s * (g - n * mean(g * n)). dx may be dy: the head's dy is read whole
 * (the sums) before the last loop writes dx, element by element. With clip
 * > 0, dy is first zeroed where forward clamped the output. */
LZ_DISPATCH static void head_backward(float *dx, float *restrict pw, const float *dy,
                                      const float *x, const float *w, float s, int64_t D,
                                      float offset, float clip) {
  float kept[clip > 0.0f ? D : 1];
  if (clip > 0.0f) {
    for (int64_t i = 0; i < D; i++) {
      const float y = (offset + w[i]) * (x[i] * s);
      kept[i] = clamped(y, clip) ? 0.0f : dy[i];
    }
    dy = kept;
  }
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

/* The columns after the k heads: dy passes, but where forward clamped x. */
static void rest_backward(float *dx, const float *dy, const float *x, int64_t n, float clip) {
  if (clip > 0.0f)
    for (int64_t i = 0; i < n; i++) dx[i] = clamped(x[i], clip) ? 0.0f : dy[i];
  else if (dx != dy)
    memcpy(dx, dy, (size_t)n * sizeof(float));
}

lz_status lz_qk_norm_backward(lz_tensor *dx, lz_tensor *dq_w, lz_tensor *dk_w, const lz_tensor *dy,
                              const lz_tensor *qkv, const lz_tensor *q_w, const lz_tensor *k_w,
                              const lz_tensor *rstd, int n_head, int n_kv_head, float offset,
                              float clip) {
  const char *op = "qk_norm_backward";
  const lz_arg like[] = {{"dx", dx}, {"dy", dy}, {0}},
               per_weight[] = {{"dq_w", dq_w}, {"dk_w", dk_w}, {0}};
  const lz_op_args args = {.t = {dx, dq_w, dk_w, (lz_tensor *)dy, (lz_tensor *)qkv,
                                 (lz_tensor *)q_w, (lz_tensor *)k_w, (lz_tensor *)rstd},
                           .i = {n_head, n_kv_head}, .f = {offset, clip}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_QK_NORM_BACKWARD, &args));
  LZ_TRY(check_args(op, qkv, like, q_w, k_w, per_weight, rstd, n_head, n_kv_head, clip));
  if (isnan(offset) || isinf(offset))
    return lz_fail(LZ_ERR_INVALID, "%s: offset is %g; it must be finite (Qwen3 0, Gemma 3 1)", op,
                   (double)offset);
  return lz_op_run(op, LZ_OP_QK_NORM_BACKWARD, &args);
}

lz_status lz_cpu_qk_norm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dq_w = a->t[1], *dk_w = a->t[2];
  const lz_tensor *dy = a->t[3], *x = a->t[4], *q_w = a->t[5], *k_w = a->t[6], *rstd = a->t[7];
  const qk_geom g = geom_of(a, q_w, k_w);
  const float offset = a->f[0], clip = a->f[1];
  const int64_t C = lz_cols(x), rows = lz_rows(x), W = g.Dq + g.Dk;
  float *dxp = dx->data;
  const float *dyp = dy->data, *xp = x->data, *qw = q_w->data, *kw = k_w->data, *rs = rstd->data;

  const int64_t n = lz_row_blocks(rows);
  float partial[n * W]; /* block k's q sums at kW, its k sums at kW + Dq */
#pragma omp parallel for schedule(static) if (rows * g.normed > (1 << 15))
  for (int64_t k = 0; k < n; k++) {
    float *pw = partial + k * W;
    for (int64_t i = 0; i < W; i++) pw[i] = 0.0f;
    const int64_t r0 = lz_block_start(k, n, rows), r1 = lz_block_start(k + 1, n, rows);
    for (int64_t r = r0; r < r1; r++) {
      for (int h = 0; h < g.heads; h++) {
        const int64_t at = r * C + head_at(&g, h);
        const int q = h < g.n_q;
        head_backward(dxp + at, q ? pw : pw + g.Dq, dyp + at, xp + at, q ? qw : kw,
                      rs[r * g.heads + h], q ? g.Dq : g.Dk, offset, clip);
      }
      const int64_t at = r * C + g.normed;
      rest_backward(dxp + at, dyp + at, xp + at, C - g.normed, clip);
    }
  }
  lz_add_block_partials(dq_w->data, partial, n, g.Dq, W);
  lz_add_block_partials(dk_w->data, partial + g.Dq, n, g.Dk, W);
  return LZ_OK;
}
