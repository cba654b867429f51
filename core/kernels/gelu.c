/* gelu.c — GELU with GPT-2's tanh approximation:
 *   gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),  k = sqrt(2/pi).
 *
 * libm's tanhf is a function call per element that no compiler vectorizes
 * without -ffast-math, which made this memory-bound op compute bound. tanh
 * here is Eigen's rational approximation (max error a few float ulps), plain
 * arithmetic that vectorizes. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_vecmath.h" /* lz_select_f32 */

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_CUBIC 0.044715f
/* Elements per thread task. */
#define BLOCK (1 << 14)

/* Eigen's float tanh (Eigen/src/Core/MathFunctionsImpl.h): odd 13th / even
 * 6th degree rational on [-c, c]. Beyond c tanh is 1 in float, and the result
 * is set to exactly +-1 there: Eigen picked c so the rational gives 1.0 at c
 * without fused multiply-adds, but the AVX2/AVX-512 clones fuse them, and
 * then 1 + tanh for a very negative input would be an ulp instead of 0
 * (GELU(-1e30) would come out as -1e23). NaN fails every comparison and
 * stays NaN. */
static inline float tanh_approx(float x) {
  const float c = 7.90531110763549805f;
  const float xc = lz_select_f32(x > c, c, lz_select_f32(x < -c, -c, x));
  const float x2 = xc * xc;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 - 8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * xc;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  float y = p / q;
  y = lz_select_f32((x >= c) | (y > 1.0f), 1.0f, y);
  return lz_select_f32((x <= -c) | (y < -1.0f), -1.0f, y);
}

/* ---------------------------------------------------------------- forward */

/* out may be x: each element is read before it is written. */
LZ_DISPATCH static void gelu_forward_block(float *out, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float xi = x[i];
    float u = GELU_SCALE * (xi + GELU_CUBIC * xi * xi * xi);
    out[i] = 0.5f * xi * (1.0f + tanh_approx(u));
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

/* d/dx gelu = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2),
 * t = tanh(u). dx may be dy. */
LZ_DISPATCH static void gelu_backward_block(float *dx, const float *dy, const float *x,
                                            int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float xi = x[i];
    float u = GELU_SCALE * (xi + GELU_CUBIC * xi * xi * xi);
    float t = tanh_approx(u);
    float du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * xi * xi);
    float grad = 0.5f * (1.0f + t) + 0.5f * xi * (1.0f - t * t) * du;
    dx[i] = grad * dy[i];
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
