/* lz_vecmath.h — float functions as plain arithmetic, so the loops that call
 * them vectorize (libm's are calls per element that no compiler vectorizes
 * without -ffast-math). Not part of the public API. */
#ifndef LZ_VECMATH_H
#define LZ_VECMATH_H

#include "mem/lz_internal.h" /* lz_f32_bits, lz_bits_f32 */

#include <math.h> /* INFINITY */

/* cond ? a : b as a bit select. GCC honours floating-point traps by default
 * and will not if-convert a ternary whose result feeds a multiply, which
 * leaves a branch in the loop and stops it vectorizing; this form has none. */
static inline float lz_select_f32(int cond, float a, float b) {
  uint32_t mask = -(uint32_t)cond; /* all ones or all zeros */
  return lz_bits_f32((lz_f32_bits(a) & mask) | (lz_f32_bits(b) & ~mask));
}

/* e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln(2)/2, e^r by Cephes'
 * expf polynomial (about 1 ulp). Inputs below -87 are clamped there so 2^n
 * stays a normal float (e^-87 is 1.6e-38: nothing next to 1); above 88 the
 * result is Inf (expf's is finite up to 88.72). NaN stays NaN. */
static inline float lz_exp(float x) {
  const float xc = lz_select_f32(x < -87.0f, -87.0f, lz_select_f32(x > 88.0f, 88.0f, x));
  /* Adding 1.5 * 2^23 rounds to an integer, which then sits in the low
   * mantissa bits of t: n as a float, and as an int without a conversion
   * (one that would be undefined for NaN). */
  const float magic = 12582912.0f;
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t n_int = (int32_t)(lz_f32_bits(t) - lz_f32_bits(magic));
  float r = xc - n * 0.693359375f; /* ln 2 in two parts, so n * ln2 is exact */
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float e = p * lz_bits_f32((uint32_t)(n_int + 127) << 23); /* times 2^n */
  return lz_select_f32(x > 88.0f, INFINITY, e);
}

/* Eigen's float tanh (Eigen/src/Core/MathFunctionsImpl.h): odd 13th / even
 * 6th degree rational on [-c, c]. Beyond c tanh is 1 in float, and the result
 * is set to exactly +-1 there: Eigen picked c so the rational gives 1.0 at c
 * without fused multiply-adds, but the AVX2/AVX-512 clones fuse them, and
 * then 1 + tanh for a very negative input would be an ulp instead of 0
 * (GELU(-1e30) would come out as -1e23). NaN fails every comparison and
 * stays NaN. */
static inline float lz_tanh(float x) {
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

/* GELU with the tanh approximation (GPT-2's, and transformers'
 * gelu_pytorch_tanh): gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),
 * k = sqrt(2/pi). */
#define LZ_GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */
#define LZ_GELU_CUBIC 0.044715f

static inline float lz_gelu(float x) {
  float u = LZ_GELU_SCALE * (x + LZ_GELU_CUBIC * x * x * x);
  return 0.5f * x * (1.0f + lz_tanh(u));
}

/* d/dx gelu = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2), t = tanh(u). */
static inline float lz_gelu_grad(float x) {
  float u = LZ_GELU_SCALE * (x + LZ_GELU_CUBIC * x * x * x);
  float t = lz_tanh(u);
  float du = LZ_GELU_SCALE * (1.0f + 3.0f * LZ_GELU_CUBIC * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

#endif /* LZ_VECMATH_H */
