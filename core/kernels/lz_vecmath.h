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

#endif /* LZ_VECMATH_H */
