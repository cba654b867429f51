/* cross_entropy.c — softmax cross-entropy over the vocabulary, fused: the
 * probabilities are never stored, backward recomputes them row by row.
 *
 * The last dimension Vp may be padded past the real vocabulary (llm.c pads
 * 50257 to 50304 for aligned GEMMs); padded columns take no part in the
 * softmax and get a zero gradient. A negative target marks a position to
 * ignore (padding in a batch): loss 0, gradient 0.
 *
 * cross_entropy_softcap_backward is the backward through a soft-cap too
 * (softcap.c): the logits it reads are the capped ones, y = cap tanh(x /
 * cap), and each gradient is carried to x by dy/dx = 1 - (y / cap)^2. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_vecmath.h" /* lz_exp */

#include <math.h> /* logf */

/* Sums and maxima are kept in LANES independent partials so the loops
 * vectorize without -ffast-math. */
#define LANES 16

/* max over the row and sum of exp(logit - max), the softmax normalizer. */
LZ_DISPATCH static void softmax_stats(const float *logits, int64_t V, float *max_out,
                                      float *sum_out) {
  float mx[LANES];
  for (int l = 0; l < LANES; l++) mx[l] = logits[0];
  int64_t i = 0;
  for (; i + LANES <= V; i += LANES)
    for (int l = 0; l < LANES; l++) mx[l] = logits[i + l] > mx[l] ? logits[i + l] : mx[l];
  float m = mx[0];
  for (int l = 1; l < LANES; l++) m = mx[l] > m ? mx[l] : m;
  for (; i < V; i++) m = logits[i] > m ? logits[i] : m;

  float acc[LANES] = {0};
  for (i = 0; i + LANES <= V; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += lz_exp(logits[i + l] - m);
  float s = 0.0f;
  for (int l = 0; l < LANES; l++) s += acc[l];
  for (; i < V; i++) s += lz_exp(logits[i] - m);
  *max_out = m;
  *sum_out = s;
}

/* Shared by forward and backward, the dtypes checked: everything but the
 * targets' values. */
static lz_status check_args(const char *op, const lz_tensor *logits, const lz_tensor *targets,
                            int64_t vocab) {
  LZ_TRY(lz_check_ndim(op, "logits", logits, 2, LZ_MAX_DIMS));
  const int64_t Vp = lz_cols(logits), rows = lz_rows(logits);
  if (vocab < 1 || vocab > Vp) {
    char a[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: vocab is %lld but logits is %s; vocab must be 1..%lld (the last "
                   "dimension of logits)",
                   op, (long long)vocab, lz_tensor_describe(logits, a, sizeof a), (long long)Vp);
  }
  return lz_check_numel(op, "targets", targets, rows, "one per row of logits");
}

/* The targets' values, where the kernel runs (they may live on a device):
 * all of them before anything is written, so a bad one leaves the outputs
 * untouched. */
static lz_status check_targets(const char *op, const int32_t *tg, int64_t rows, int64_t vocab) {
  for (int64_t r = 0; r < rows; r++)
    if (tg[r] >= vocab)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: targets[%lld] is %d, not below vocab %lld (negative targets are "
                     "ignored)",
                     op, (long long)r, (int)tg[r], (long long)vocab);
  return LZ_OK;
}

/* ---------------------------------------------------------------- forward */

/* loss = log(sum_j exp(l_j)) - l_target, computed as log(sum exp(l_j - max))
 * + max - l_target so no exp overflows. */
static float row_loss(const float *logits, int64_t vocab, int32_t target) {
  if (target < 0) return 0.0f;
  float m, s;
  softmax_stats(logits, vocab, &m, &s);
  return logf(s) + m - logits[target];
}

lz_status lz_cross_entropy_forward(lz_tensor *losses, const lz_tensor *logits,
                                   const lz_tensor *targets, int64_t vocab) {
  const char *op = "cross_entropy_forward";
  const lz_op_args args = {.t = {losses, (lz_tensor *)logits, (lz_tensor *)targets},
                           .i = {vocab}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_CROSS_ENTROPY_FORWARD, &args));
  LZ_TRY(check_args(op, logits, targets, vocab));
  LZ_TRY(lz_check_numel(op, "losses", losses, lz_rows(logits), "one per row of logits"));
  return lz_op_run(op, LZ_OP_CROSS_ENTROPY_FORWARD, &args);
}

lz_status lz_cpu_cross_entropy_forward(const lz_op_args *a) {
  lz_tensor *losses = a->t[0];
  const lz_tensor *logits = a->t[1], *targets = a->t[2];
  const int64_t vocab = a->i[0], Vp = lz_cols(logits), rows = lz_rows(logits);
  LZ_TRY(check_targets("cross_entropy_forward", targets->data, rows, vocab));

  float *loss = losses->data;
  const float *lg = logits->data;
  const int32_t *tg = targets->data;
#pragma omp parallel for schedule(static) if (rows * vocab > (1 << 15))
  for (int64_t r = 0; r < rows; r++) loss[r] = row_loss(lg + r * Vp, vocab, tg[r]);
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* Columns [i0, i1) of one row's gradient in f32, into dl[0, i1 - i0). One
 * out-of-line function for both output dtypes, so a bf16 dlogits holds
 * exactly the f32 values rounded (however the compiler would fuse the
 * arithmetic of two copies). */
LZ_DISPATCH __attribute__((noinline)) static void xent_grad_span(
    float *dl, const float *logits, int64_t i0, int64_t i1, int64_t vocab, int32_t target,
    float logit_target, float m, float inv, float dloss) {
  const int64_t end = i1 < vocab ? i1 : vocab;
  for (int64_t i = i0; i < end; i++) dl[i - i0] = lz_exp(logits[i] - m) * inv * dloss;
  if (target >= i0 && target < i1)
    dl[target - i0] = (lz_exp(logit_target - m) * inv - 1.0f) * dloss;
  for (int64_t i = end > i0 ? end : i0; i < i1; i++) dl[i - i0] = 0.0f;
}

/* Columns per bf16 span: its f32 values sit on the stack. */
#define BF16_SPAN 1024

/* Through the soft-cap: each gradient of span times 1 - (y / cap)^2, y the
 * capped logit (torch's tanh backward, 1 - t^2 with t = y / cap). */
LZ_DISPATCH static void softcap_chain(float *span, const float *y, int64_t n, float cap) {
  for (int64_t i = 0; i < n; i++) {
    const float t = y[i] / cap;
    span[i] = span[i] * (1.0f - t * t);
  }
}

/* dlogits may be logits: the row's statistics and the target's logit are
 * read before the first gradient overwrites them, and a capped row goes
 * span by span through the stack, each span's logits read before it is
 * written. A bf16 dlogits (what a bf16 LM head's backward GEMM reads) gets
 * the f32 gradients rounded span by span, as a conversion would round them,
 * with no f32 copy of the rows. cap 0: no soft-cap. */
LZ_DISPATCH static void xent_backward_row(void *dlogits, lz_dtype dt, const float *logits,
                                          int64_t vocab, int64_t Vp, int32_t target, float dloss,
                                          float cap) {
  float m = 0.0f, s = 1.0f, logit_target = 0.0f;
  if (target < 0) {
    vocab = 0; /* every column a zero, as for padding */
  } else {
    softmax_stats(logits, vocab, &m, &s);
    logit_target = logits[target];
  }
  const float inv = 1.0f / s;
  if (dt == LZ_F32 && cap == 0.0f) {
    xent_grad_span(dlogits, logits, 0, Vp, vocab, target, logit_target, m, inv, dloss);
    return;
  }
  uint16_t *dl = dlogits;
  float *dl32 = dlogits;
  float span[BF16_SPAN];
  for (int64_t i0 = 0; i0 < Vp; i0 += BF16_SPAN) {
    const int64_t i1 = Vp - i0 < BF16_SPAN ? Vp : i0 + BF16_SPAN;
    xent_grad_span(span, logits, i0, i1, vocab, target, logit_target, m, inv, dloss);
    if (cap != 0.0f) softcap_chain(span, logits + i0, i1 - i0, cap);
    if (dt == LZ_F32)
      for (int64_t i = i0; i < i1; i++) dl32[i] = span[i - i0];
    else
      for (int64_t i = i0; i < i1; i++) dl[i] = lz_bf16_from_f32_inline(span[i - i0]);
  }
}

static lz_status xent_backward(const char *op, lz_tensor *dlogits, const lz_tensor *logits,
                               const lz_tensor *targets, int64_t vocab, float dloss, float cap) {
  const lz_op_args args = {.t = {dlogits, (lz_tensor *)logits, (lz_tensor *)targets},
                           .i = {vocab}, .f = {dloss, cap}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_CROSS_ENTROPY_BACKWARD, &args));
  LZ_TRY(check_args(op, logits, targets, vocab));
  LZ_TRY(lz_check_same_shape(op, "dlogits", dlogits, "logits", logits));
  LZ_TRY(lz_check_no_alias(op, "logits", logits, "dlogits", dlogits));
  return lz_op_run(op, LZ_OP_CROSS_ENTROPY_BACKWARD, &args);
}

lz_status lz_cross_entropy_backward(lz_tensor *dlogits, const lz_tensor *logits,
                                    const lz_tensor *targets, int64_t vocab, float dloss) {
  return xent_backward("cross_entropy_backward", dlogits, logits, targets, vocab, dloss, 0.0f);
}

lz_status lz_cross_entropy_softcap_backward(lz_tensor *dlogits, const lz_tensor *logits,
                                            const lz_tensor *targets, int64_t vocab, float dloss,
                                            float cap) {
  const char *op = "cross_entropy_softcap_backward";
  if (!(cap > 0))
    return lz_fail(LZ_ERR_INVALID, "%s: cap is %g; it must be a number > 0", op, (double)cap);
  return xent_backward(op, dlogits, logits, targets, vocab, dloss, cap);
}

lz_status lz_cpu_cross_entropy_backward(const lz_op_args *a) {
  lz_tensor *dlogits = a->t[0];
  const lz_tensor *logits = a->t[1], *targets = a->t[2];
  const int64_t vocab = a->i[0], Vp = lz_cols(logits), rows = lz_rows(logits);
  const float dloss = a->f[0], cap = a->f[1];
  LZ_TRY(check_targets("cross_entropy_backward", targets->data, rows, vocab));

  const lz_dtype dt = dlogits->dtype;
  const size_t es = lz_dtype_size(dt);
  char *dl = dlogits->data;
  const float *lg = logits->data;
  const int32_t *tg = targets->data;
#pragma omp parallel for schedule(static) if (rows * vocab > (1 << 15))
  for (int64_t r = 0; r < rows; r++)
    xent_backward_row(dl + (size_t)(r * Vp) * es, dt, lg + r * Vp, vocab, Vp, tg[r], dloss,
                      cap);
  return LZ_OK;
}
