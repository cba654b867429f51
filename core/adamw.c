/* adamw.c — fused AdamW over a flat fp32 shard: one pass reads param, grad,
 * m, v and writes param, m, v and the working copy. The step is bound by
 * memory bandwidth, so everything happens in that one pass, split into
 * blocks across threads.
 *
 * The update follows torch.optim.AdamW (decoupled weight decay):
 *   p  = p * (1 - lr wd)
 *   m  = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
 *   p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 * with g = grad * grad_scale (clipping and loss-scale undo folded in). */
#include "lz_backend.h"
#include "lz_internal.h"

#include <immintrin.h> /* F16C's vcvtps2ph for the f16 working copy */
#include <math.h>      /* pow, sqrt, sqrtf, isinf, isfinite */

/* Elements per thread task: four fp32 streams of 64 KiB. */
#define BLOCK (1 << 14)

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

/* Updates element i of p, m, v and returns the new parameter. GCC
 * vectorizes the sqrtf only under -fno-math-errno: otherwise it keeps a
 * branch to libm's sqrtf (to set errno on negative input) in the loop, and
 * the step runs at well under memory bandwidth. */
static inline float adamw_update(float *p, const float *grad, float *m, float *v,
                                 const adamw_consts *k, int64_t i) {
  float g = grad[i] * k->grad_scale;
  float mi = k->beta1 * m[i] + k->one_minus_beta1 * g;
  float vi = k->beta2 * v[i] + k->one_minus_beta2 * g * g;
  float denom = sqrtf(vi) * k->inv_bc2_sqrt + k->eps;
  float pi = p[i] * k->decay - k->step_size * mi / denom;
  m[i] = mi;
  v[i] = vi;
  p[i] = pi;
  return pi;
}

/* One loop per kind of working copy, so each stays a straight vectorizable
 * loop; the bf16 conversion is integer ops that vectorize with it, in the same
 * pass. (On machines without F16C, f16 too: lz_f16_from_f32_inline.) */
LZ_DISPATCH static void adamw_block(float *restrict p, const float *restrict grad,
                                    float *restrict m, float *restrict v, void *restrict working,
                                    lz_dtype wdt, adamw_consts k, int64_t n) {
  if (working && wdt == LZ_F32) {
    float *w = working;
    for (int64_t i = 0; i < n; i++) w[i] = adamw_update(p, grad, m, v, &k, i);
  } else if (working && wdt == LZ_BF16) {
    uint16_t *w = working;
    for (int64_t i = 0; i < n; i++)
      w[i] = lz_bf16_from_f32_inline(adamw_update(p, grad, m, v, &k, i));
  } else if (working && wdt == LZ_F16) {
    uint16_t *w = working;
    for (int64_t i = 0; i < n; i++)
      w[i] = lz_f16_from_f32_inline(adamw_update(p, grad, m, v, &k, i));
  } else {
    for (int64_t i = 0; i < n; i++) adamw_update(p, grad, m, v, &k, i);
  }
}

/* The f16 copy through the hardware conversion (vcvtps2ph, round to nearest
 * even: the same bits as lz_f32_to_f16), which costs a third of the
 * branch-free integer one. Each group of 16 (8) is updated, then converted
 * from registers just written; the tail goes through the portable routine.
 * target_clones' "avx2" does not imply F16C, hence functions of their own. */
__attribute__((target("avx512f"))) static void adamw_block_f16_avx512(
    float *restrict p, const float *restrict grad, float *restrict m, float *restrict v,
    uint16_t *restrict w, adamw_consts k, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; j++) adamw_update(p, grad, m, v, &k, i + j);
    __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i *)(w + i), h);
  }
  for (; i < n; i++) w[i] = lz_f16_from_f32_inline(adamw_update(p, grad, m, v, &k, i));
}

__attribute__((target("avx2,f16c"))) static void adamw_block_f16_avx2(
    float *restrict p, const float *restrict grad, float *restrict m, float *restrict v,
    uint16_t *restrict w, adamw_consts k, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; j++) adamw_update(p, grad, m, v, &k, i + j);
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i *)(w + i), h);
  }
  for (; i < n; i++) w[i] = lz_f16_from_f32_inline(adamw_update(p, grad, m, v, &k, i));
}

typedef void (*f16_block_fn)(float *restrict, const float *restrict, float *restrict,
                             float *restrict, uint16_t *restrict, adamw_consts, int64_t);

/* NULL where the CPU has neither: adamw_block's portable f16 loop then. */
static f16_block_fn f16_block(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return adamw_block_f16_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    return adamw_block_f16_avx2;
  return NULL;
}

static lz_status check_args(const char *op, const lz_adamw_args *a) {
  if (!a) return lz_fail(LZ_ERR_INVALID, "%s: args is NULL", op);
  if (a->step < 1)
    return lz_fail(LZ_ERR_INVALID, "%s: args->step is %lld; steps count from 1", op,
                   (long long)a->step);
  if (!(a->lr >= 0.0f) || isinf(a->lr))
    return lz_fail(LZ_ERR_INVALID, "%s: args->lr is %g; it must be finite and >= 0", op,
                   (double)a->lr);
  if (!(a->beta1 >= 0.0f && a->beta1 < 1.0f))
    return lz_fail(LZ_ERR_INVALID, "%s: args->beta1 is %g; it must be in [0, 1)", op,
                   (double)a->beta1);
  if (!(a->beta2 >= 0.0f && a->beta2 < 1.0f))
    return lz_fail(LZ_ERR_INVALID, "%s: args->beta2 is %g; it must be in [0, 1)", op,
                   (double)a->beta2);
  if (!(a->eps >= 0.0f) || isinf(a->eps))
    return lz_fail(LZ_ERR_INVALID, "%s: args->eps is %g; it must be finite and >= 0", op,
                   (double)a->eps);
  if (!(a->weight_decay >= 0.0f) || isinf(a->weight_decay))
    return lz_fail(LZ_ERR_INVALID, "%s: args->weight_decay is %g; it must be finite and >= 0",
                   op, (double)a->weight_decay);
  if (!isfinite(a->grad_scale))
    return lz_fail(LZ_ERR_INVALID, "%s: args->grad_scale is %g; it must be finite", op,
                   (double)a->grad_scale);
  return LZ_OK;
}

lz_status lz_adamw_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *v,
                        lz_tensor *working, const lz_adamw_args *args) {
  const char *op = "adamw_step";
  LZ_TRY(lz_check_dtype(op, "param", param, LZ_F32));
  const int64_t n = lz_tensor_numel(param);
  LZ_TRY(lz_check_dtype(op, "grad", grad, LZ_F32));
  LZ_TRY(lz_check_numel(op, "grad", grad, n, "the element count of param"));
  LZ_TRY(lz_check_dtype(op, "m", m, LZ_F32));
  LZ_TRY(lz_check_numel(op, "m", m, n, "the element count of param"));
  LZ_TRY(lz_check_dtype(op, "v", v, LZ_F32));
  LZ_TRY(lz_check_numel(op, "v", v, n, "the element count of param"));
  if (working) {
    LZ_TRY(lz_check_present(op, "working", working));
    if (working->dtype != LZ_F32 && working->dtype != LZ_BF16 && working->dtype != LZ_F16) {
      char buf[96];
      return lz_fail(LZ_ERR_INVALID, "%s: working is %s, expected dtype f32, bf16 or f16", op,
                     lz_tensor_describe(working, buf, sizeof buf));
    }
    LZ_TRY(lz_check_numel(op, "working", working, n, "the element count of param"));
  }
  LZ_TRY(check_args(op, args));
  LZ_DEVICE_DISPATCH(op, LZ_OP_ADAMW_STEP, .t = {param, (lz_tensor *)grad, m, v, working},
                     .adamw = args);

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

  float *pp = param->data, *mp = m->data, *vp = v->data;
  const float *gp = grad->data;
  const lz_dtype wdt = working ? working->dtype : LZ_F32;
  char *wp = working ? working->data : NULL;
  const size_t wsize = lz_dtype_size(wdt);
  const f16_block_fn f16 = wp && wdt == LZ_F16 ? f16_block() : NULL;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int64_t len = n - i0 < BLOCK ? n - i0 : BLOCK;
    void *w = wp ? wp + (size_t)i0 * wsize : NULL;
    if (f16) f16(pp + i0, gp + i0, mp + i0, vp + i0, w, k, len);
    else adamw_block(pp + i0, gp + i0, mp + i0, vp + i0, w, wdt, k, len);
  }
  return LZ_OK;
}
