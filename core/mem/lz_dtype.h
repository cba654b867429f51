/* lz_dtype.h — the one implementation of the conversions between f32, bf16
 * and f16, inline so the loops that call them vectorize; dtype.c gives them
 * to the public API (lz_f32_to_bf16 and the rest). Not part of the public
 * API. */
#ifndef LZ_DTYPE_H
#define LZ_DTYPE_H

#include "luazero.h"

#include <string.h> /* memcpy in the bit casts */

#ifdef __cplusplus
extern "C" {
#endif

/* Float bits. */
static inline uint32_t lz_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float lz_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t lz_bf16_from_f32_inline(float f) {
  uint32_t u = lz_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}
static inline float lz_bf16_to_f32_inline(uint16_t h) { return lz_bits_f32((uint32_t)h << 16); }

/* f16 to f32: exact (every half is a float), subnormals in units of 2^-24. */
static inline float lz_f16_to_f32_inline(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return lz_bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    float v = (float)m * 0x1p-24f;
    return sign ? -v : v;
  }
  return lz_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* f32 to f16 without branches, so loops that call it vectorize; the core's
 * one f32 to f16 (lz_f32_to_f16 is this one). Round to nearest even, Inf,
 * NaN keeping its top payload bits, subnormal halves: a value below 2^-14 is
 * added to 0.5f, the sum's last place is 2^-24, a half's subnormal unit, so
 * the FPU rounds it to even and the sum's low bits are the half's. Needs the
 * default rounding mode and no denormals-are-zero. */
static inline uint16_t lz_f16_from_f32_inline(float f) {
  uint32_t u = lz_f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t r = a - 0x38000000u; /* normal: exponent 127 -> 15 */
  r += 0xfffu + ((r >> 13) & 1u);
  uint32_t normal = r >> 13;
  uint32_t subnormal = lz_f32_bits(lz_bits_f32(a) + 0.5f) - 0x3f000000u;
  uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  /* Selects by masks: a ?: would read as control flow, and GCC does not
   * if-convert a float add it thinks may trap. */
  uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);
  uint32_t is_inf = 0u - (uint32_t)(a >= 0x477ff000u); /* rounds to >= 65520 */
  uint32_t is_nan = 0u - (uint32_t)(a > 0x7f800000u);
  uint32_t h = (subnormal & is_sub) | (normal & ~is_sub);
  h = (0x7c00u & is_inf) | (h & ~is_inf);
  h = (nan & is_nan) | (h & ~is_nan);
  return (uint16_t)(sign | h);
}

/* dst[0:n] = src[0:n] (f32 or bf16) as f32; inlined into the LZ_DISPATCH
 * loops that call it, which vectorize it. */
static inline void lz_row_to_f32(float *dst, const void *src, lz_dtype dt, int64_t n) {
  if (dt == LZ_BF16) {
    const uint16_t *h = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_to_f32_inline(h[i]);
  } else {
    memcpy(dst, src, (size_t)n * sizeof(float));
  }
}

/* dst[0:n] = src[0:n] rounded to bf16 as tensor_copy rounds (nearest even),
 * for kernels that write a bf16 output from f32 arithmetic. */
static inline void lz_row_to_bf16(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_from_f32_inline(src[i]);
}

/* Reads element i of a float-typed buffer (f32, bf16, f16) as float. */
float lz_load_float(const void *data, lz_dtype dt, int64_t i);

#ifdef __cplusplus
}
#endif

#endif /* LZ_DTYPE_H */
