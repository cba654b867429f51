/* gelu.c — GELU with GPT-2's tanh approximation:
 *   gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),  k = sqrt(2/pi).
 *
 * libm's tanhf is a function call per element that no compiler vectorizes
 * without -ffast-math, which made this memory-bound op compute bound. tanh
 * here is lz_tanh, plain arithmetic that vectorizes (GeGLU, in swiglu.c,
 * shares lz_gelu). */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_vecmath.h" /* lz_gelu, lz_gelu_grad */

/* Elements per thread task. */
#define BLOCK (1 << 14)

/* ---------------------------------------------------------------- forward */

/* out may be x: each element is read before it is written. */
LZ_DISPATCH static void gelu_forward_block(float *out, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    out[i] = lz_gelu(x[i]);
  }
}

lz_status lz_gelu_forward(lz_tensor *out, const lz_tensor *x) {
  const char *op = "gelu_forward";
  LZ_TRY(lz_check_same_shape(op, "out", out, "x", x));
  LZ_OP_RUN(op, LZ_OP_GELU_FORWARD, .t = {out, (lz_tensor *)x});
}

lz_status lz_cpu_gelu_forward(const lz_op_args *a) {
  const int64_t n = lz_tensor_numel(a->t[1]);
  float *o = a->t[0]->data;
  const float *xp = a->t[1]->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    gelu_forward_block(o + i0, xp + i0, n - i0 < BLOCK ? n - i0 : BLOCK);
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* dx may be dy. */
LZ_DISPATCH static void gelu_backward_block(float *dx, const float *dy, const float *x,
                                            int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    dx[i] = lz_gelu_grad(x[i]) * dy[i];
  }
}

lz_status lz_gelu_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *x) {
  const char *op = "gelu_backward";
  LZ_TRY(lz_check_present(op, "x", x));
  LZ_TRY(lz_check_same_shape(op, "dy", dy, "x", x));
  LZ_TRY(lz_check_same_shape(op, "dx", dx, "x", x));
  LZ_OP_RUN(op, LZ_OP_GELU_BACKWARD, .t = {dx, (lz_tensor *)dy, (lz_tensor *)x});
}

lz_status lz_cpu_gelu_backward(const lz_op_args *a) {
  const int64_t n = lz_tensor_numel(a->t[2]);
  float *dxp = a->t[0]->data;
  const float *dyp = a->t[1]->data, *xp = a->t[2]->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    gelu_backward_block(dxp + i0, dyp + i0, xp + i0, n - i0 < BLOCK ? n - i0 : BLOCK);
  return LZ_OK;
}
