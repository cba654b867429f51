/* lion.c — fused Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
 * Algorithms") over a flat fp32 shard: one pass reads param, grad, m and
 * writes param, m and the working copy (optim_pass.c). One state per
 * parameter against AdamW's two. A cpu kernel (sim runs it too; cuda/
 * elementwise.cu has the same arithmetic).
 *
 * The update follows lion-pytorch and DeepSpeed's FusedLion:
 *   c = b1 m + (1 - b1) g
 *   p = p * (1 - lr wd) - lr sign(c)       (sign(0) = 0)
 *   m = b2 m + (1 - b2) g
 * with g = grad * grad_scale (clipping and loss-scale undo folded in). */
#include "mem/lz_backend.h"
#include "optim/lz_optim.h"

/* Per-step scalars, worked out once in double. */
typedef struct {
  float decay; /* 1 - lr wd */
  float lr;
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float grad_scale;
} lion_consts;

/* sign() turns a last-place difference of c into a step of 2 lr, so each
 * product and sum is rounded on its own, never contracted into an FMA: the
 * result is then the same on every machine and clone (AVX-512 has FMA, the
 * others do not) and bitwise that of the same fp32 ops in PyTorch. The sign
 * is torch.sign's: +1, -1, or 0 for zero and NaN. */
__attribute__((optimize("fp-contract=off"))) LZ_DISPATCH static void lion_update(
    float *restrict p, const float *restrict grad, float *restrict m, float *restrict unused,
    const void *consts, int64_t n) {
  (void)unused;
  const lion_consts k = *(const lion_consts *)consts;
  for (int64_t i = 0; i < n; i++) {
    float g = grad[i] * k.grad_scale;
    float c = k.beta1 * m[i] + k.one_minus_beta1 * g;
    float sign = (float)(c > 0.0f) - (float)(c < 0.0f);
    p[i] = p[i] * k.decay - k.lr * sign;
    m[i] = k.beta2 * m[i] + k.one_minus_beta2 * g;
  }
}

static lz_status check_args(const char *op, const lz_lion_args *a) {
  if (!a) return lz_fail(LZ_ERR_INVALID, "%s: args is NULL", op);
  LZ_TRY(lz_optim_check_arg(op, "lr", a->lr, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "beta1", a->beta1, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "beta2", a->beta2, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "weight_decay", a->weight_decay, LZ_OPTIM_NONNEG));
  return lz_optim_check_arg(op, "grad_scale", a->grad_scale, LZ_OPTIM_FINITE);
}

lz_status lz_lion_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *working,
                       const lz_lion_args *args) {
  const char *op = "lion_step";
  const lz_optim_tensors t = {.param = param,
                              .grad = grad,
                              .states = {m},
                              .state_names = {"m"},
                              .n_states = 1,
                              .working = working};
  const lz_op_args a = {.t = {param, (lz_tensor *)grad, m, working}, .lion = args};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_LION_STEP, &a));
  LZ_TRY(lz_optim_check_tensors(op, &t));
  LZ_TRY(check_args(op, args));
  return lz_op_run(op, LZ_OP_LION_STEP, &a);
}

lz_status lz_cpu_lion_step(const lz_op_args *a) {
  const lz_optim_tensors t = {
      .param = a->t[0], .grad = a->t[1], .states = {a->t[2]}, .n_states = 1, .working = a->t[3]};
  const lz_lion_args *args = a->lion;
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2;
  const lion_consts k = {
      .decay = (float)(1.0 - lr * args->weight_decay),
      .lr = args->lr,
      .beta1 = args->beta1,
      .beta2 = args->beta2,
      .one_minus_beta1 = (float)(1.0 - b1),
      .one_minus_beta2 = (float)(1.0 - b2),
      .grad_scale = args->grad_scale,
  };
  lz_optim_run(&t, lion_update, &k);
  return LZ_OK;
}
