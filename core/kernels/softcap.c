/* softcap.c — soft-capping (Gemma 2's final_logit_softcapping): out = cap *
 * tanh(x / cap), as transformers computes it (divide, tanh, multiply), which
 * bounds every value to (-cap, cap) and leaves small ones almost unchanged.
 * Its backward rides on the cross-entropy's (cross_entropy.c:
 * cross_entropy_softcap_backward), which reads the capped logits it already
 * holds rather than a second copy of the raw ones. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_vecmath.h" /* lz_tanh */

/* Elements per thread task. */
#define BLOCK (1 << 14)

/* out may be x: each element is read before it is written. */
LZ_DISPATCH static void softcap_forward_block(float *out, const float *x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; i++) out[i] = lz_tanh(x[i] / cap) * cap;
}

lz_status lz_softcap_forward(lz_tensor *out, const lz_tensor *x, float cap) {
  const char *op = "softcap_forward";
  LZ_TRY(lz_check_present(op, "x", x));
  LZ_TRY(lz_check_numel(op, "out", out, lz_tensor_numel(x), "the element count of x"));
  if (!(cap > 0))
    return lz_fail(LZ_ERR_INVALID, "softcap_forward: cap is %g; it must be a number > 0",
                   (double)cap);
  LZ_OP_RUN(op, LZ_OP_SOFTCAP_FORWARD, .t = {out, (lz_tensor *)x}, .f = {cap});
}

lz_status lz_cpu_softcap_forward(const lz_op_args *a) {
  const int64_t n = lz_tensor_numel(a->t[1]);
  float *o = a->t[0]->data;
  const float *xp = a->t[1]->data;
  const float cap = a->f[0];
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    softcap_forward_block(o + i0, xp + i0, n - i0 < BLOCK ? n - i0 : BLOCK, cap);
  return LZ_OK;
}
