/* adamw.c — fused AdamW over a flat fp32 shard: one pass reads param, grad,
 * m, v and writes param, m, v and the working copy. The step is bound by
 * memory bandwidth, so everything happens in that one pass (optim_pass.c),
 * split into chunks across threads.
 *
 * The update follows torch.optim.AdamW (decoupled weight decay):
 *   p  = p * (1 - lr wd)
 *   m  = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
 *   p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 * with g = grad * grad_scale (clipping and loss-scale undo folded in).
 *
 * m and v may be bf16 (the bf16-moment AdamW): each chunk's moments are
 * widened to fp32, updated by the same loop, and rounded back to nearest
 * even, in the same pass. */
#include "mem/lz_backend.h"
#include "optim/lz_optim.h"

#include <math.h> /* pow, sqrt, sqrtf */

/* Per-step scalars, worked out once in double. */
typedef struct {
  float decay;        /* 1 - lr wd */
  float beta1, beta2; /* moment decay */
  float one_minus_beta1, one_minus_beta2;
  float step_size;    /* lr / (1 - b1^t) */
  float inv_bc2_sqrt; /* 1 / sqrt(1 - b2^t) */
  float eps;
  float grad_scale;
} adamw_consts;

/* One chunk of p, m, v. GCC vectorizes the sqrtf only under
 * -fno-math-errno: otherwise it keeps a branch to libm's sqrtf (to set errno
 * on negative input) in the loop, and the step runs at well under memory
 * bandwidth. */
LZ_DISPATCH static void adamw_update(float *restrict p, const float *restrict grad,
                                     float *restrict m, float *restrict v, const void *consts,
                                     int64_t n) {
  const adamw_consts k = *(const adamw_consts *)consts;
  for (int64_t i = 0; i < n; i++) {
    float g = grad[i] * k.grad_scale;
    float mi = k.beta1 * m[i] + k.one_minus_beta1 * g;
    float vi = k.beta2 * v[i] + k.one_minus_beta2 * g * g;
    float denom = sqrtf(vi) * k.inv_bc2_sqrt + k.eps;
    p[i] = p[i] * k.decay - k.step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

static lz_status check_args(const char *op, const lz_adamw_args *a) {
  if (!a) return lz_fail(LZ_ERR_INVALID, "%s: args is NULL", op);
  if (a->step < 1)
    return lz_fail(LZ_ERR_INVALID, "%s: args->step is %lld; steps count from 1", op,
                   (long long)a->step);
  LZ_TRY(lz_optim_check_arg(op, "lr", a->lr, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "beta1", a->beta1, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "beta2", a->beta2, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "eps", a->eps, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "weight_decay", a->weight_decay, LZ_OPTIM_NONNEG));
  return lz_optim_check_arg(op, "grad_scale", a->grad_scale, LZ_OPTIM_FINITE);
}

lz_status lz_adamw_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *v,
                        lz_tensor *working, const lz_adamw_args *args) {
  const char *op = "adamw_step";
  const lz_optim_tensors t = {.param = param,
                              .grad = grad,
                              .states = {m, v},
                              .state_names = {"m", "v"},
                              .n_states = 2,
                              .working = working};
  const lz_op_args a = {.t = {param, (lz_tensor *)grad, m, v, working}, .adamw = args};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_ADAMW_STEP, &a));
  LZ_TRY(lz_optim_check_tensors(op, &t));
  LZ_TRY(check_args(op, args));
  return lz_op_run(op, LZ_OP_ADAMW_STEP, &a);
}

/* Elements per chunk of the bf16-moment pass: 4 KiB per fp32 stream. */
#define BF16_CHUNK 1024

LZ_DISPATCH static void widen(float *restrict dst, const uint16_t *restrict src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_to_f32_inline(src[i]);
}

LZ_DISPATCH static void narrow(uint16_t *restrict dst, const float *restrict src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_from_f32_inline(src[i]);
}

static void run_bf16_moments(const lz_optim_tensors *t, const adamw_consts *k) {
  const int64_t n = lz_tensor_numel(t->param);
  float *p = t->param->data;
  const float *g = t->grad->data;
  uint16_t *m = t->states[0]->data, *v = t->states[1]->data;
  char *w = t->working ? t->working->data : NULL;
  const lz_optim_store_fn store = w ? lz_optim_working_store(t->working->dtype) : NULL;
  const size_t wsize = w ? lz_dtype_size(t->working->dtype) : 0;
#pragma omp parallel for schedule(static) if (n > (1 << 14))
  for (int64_t i0 = 0; i0 < n; i0 += BF16_CHUNK) {
    const int64_t len = n - i0 < BF16_CHUNK ? n - i0 : BF16_CHUNK;
    float mf[BF16_CHUNK], vf[BF16_CHUNK];
    widen(mf, m + i0, len);
    widen(vf, v + i0, len);
    adamw_update(p + i0, g + i0, mf, vf, k, len);
    narrow(m + i0, mf, len);
    narrow(v + i0, vf, len);
    if (store) store(w + (size_t)i0 * wsize, p + i0, len);
  }
}

lz_status lz_cpu_adamw_step(const lz_op_args *a) {
  const lz_optim_tensors t = {.param = a->t[0],
                              .grad = a->t[1],
                              .states = {a->t[2], a->t[3]},
                              .n_states = 2,
                              .working = a->t[4]};
  const lz_adamw_args *args = a->adamw;
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2;
  const double bc1 = 1.0 - pow(b1, (double)args->step);
  const double bc2 = 1.0 - pow(b2, (double)args->step);
  const adamw_consts k = {
      .decay = (float)(1.0 - lr * args->weight_decay),
      .beta1 = args->beta1,
      .beta2 = args->beta2,
      .one_minus_beta1 = (float)(1.0 - b1),
      .one_minus_beta2 = (float)(1.0 - b2),
      .step_size = (float)(lr / bc1),
      .inv_bc2_sqrt = (float)(1.0 / sqrt(bc2)),
      .eps = args->eps,
      .grad_scale = args->grad_scale,
  };
  if (a->t[2]->dtype == LZ_BF16) run_bf16_moments(&t, &k);
  else lz_optim_run(&t, adamw_update, &k);
  return LZ_OK;
}
