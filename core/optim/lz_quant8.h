/* lz_quant8.h — bitsandbytes' block-wise 8-bit code as its CPU library
 * (0.50.2) computes it: the signed and unsigned dynamic maps, and the index
 * its quantiser picks for a value scaled into [-1, 1]. Shared by the 8-bit
 * optimizer step and the state conversions. Not part of the public API. */
#ifndef LZ_QUANT8_H
#define LZ_QUANT8_H

#include "mem/lz_internal.h"

#include <immintrin.h> /* the 16-lane quantiser below */

#ifdef __cplusplus
extern "C" {
#endif

/* A map: its 256 fp32 entries, the same split into four planes (planes[k][i]
 * is byte k of values[i], for byte-wide table lookups), and the lookup table
 * of its quantiser (quant8.c says how it is laid out). */
typedef struct lz_q8_map {
  const float *values;
  const uint32_t *cells;
  const uint8_t (*planes)[256];
} lz_q8_map;

/* The signed dynamic map (is_signed 1, m) or the unsigned one (0, v). */
const lz_q8_map *lz_q8_map_get(int is_signed);

/* q[i] = the index bitsandbytes picks for x[i] / absmax, n <= one block:
 * the fastest way this machine has. */
typedef void (*lz_q8_quantize_fn)(const lz_q8_map *map, const float *x, float absmax, uint8_t *q,
                                  int64_t n);
lz_q8_quantize_fn lz_q8_quantizer(void);

/* The scalar form of the same choice, for one value z = x / absmax. */
uint8_t lz_q8_index(const lz_q8_map *map, float z);

/* The cells: the magnitude's fp32 bits, clamped to [2^-26, 1], cut by their
 * top bits into cells of 2^16 consecutive floats, Q8_SIDE per sign. */
#define Q8_LO 0x32800000u /* 2^-26: every smaller magnitude has its index */
#define Q8_ONE 0x3f800000u
#define Q8_SIDE (((Q8_ONE - Q8_LO) >> 16) + 1)

/* The vector quantisers divide by absmax only where they must. With
 * r = 1 / absmax rounded, x * r rounded is within 3 units in the last place
 * of x / absmax rounded (two roundings against one), as long as r and the
 * quotients are normal: absmax in [2^-125, 2^125], where |x| <= absmax
 * keeps |x r| <= 1. Bit patterns that close are at most Q8_SLACK apart, so
 * where x * r's magnitude is further than that from its cell's step and from
 * the cell's edges (or far below 2^-26, where every magnitude has the same
 * index), x / absmax has the same index; a vector with a lane that is not
 * divides. A block's own absmax element (z = 1, a cell edge) is one such
 * lane, so about one vector in 16 divides. */
#define Q8_SLACK 8u
#define Q8_FAST_MIN 0x1p-125f
#define Q8_FAST_MAX 0x1p125f

__attribute__((target("avx512f"))) static inline __m512i lz_q8_index16(const uint32_t *cells, __m512i u,
                                                                 __mmask16 *near) {
  const __m512i lo = _mm512_set1_epi32((int)Q8_LO), low16 = _mm512_set1_epi32(0xffff);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i ac = _mm512_min_epu32(_mm512_max_epu32(a, lo), _mm512_set1_epi32((int)Q8_ONE));
  __m512i cell = _mm512_srli_epi32(_mm512_sub_epi32(ac, lo), 16);
  cell = _mm512_mask_add_epi32(cell, _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512()), cell,
                               _mm512_set1_epi32((int)Q8_SIDE));
  const __m512i e = _mm512_i32gather_epi32(cell, (const int *)cells, 4);
  const __m512i l = _mm512_and_si512(ac, low16), s = _mm512_and_si512(e, low16);
  const __mmask16 up = _mm512_cmpge_epu32_mask(l, s);
  if (near) {
    const __m512i slack = _mm512_set1_epi32((int)Q8_SLACK);
    const __m512i width = _mm512_set1_epi32((int)(2 * Q8_SLACK));
    const __m512i to_step = _mm512_and_si512(_mm512_add_epi32(_mm512_sub_epi32(l, s), slack), low16);
    const __m512i to_edge = _mm512_and_si512(_mm512_add_epi32(l, slack), low16);
    const __mmask16 far_below =
        _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)(Q8_LO - Q8_SLACK)));
    *near = (_mm512_cmple_epu32_mask(to_step, width) | _mm512_cmple_epu32_mask(to_edge, width)) &
            (__mmask16)~far_below;
  }
  return _mm512_mask_blend_epi32(
      up, _mm512_and_si512(_mm512_srli_epi32(e, 16), _mm512_set1_epi32(0xff)),
      _mm512_srli_epi32(e, 24));
}


/* What quantising a block against its absmax needs, set once per block. */
typedef struct {
  __m512 absmax, r;
  int fast;
} lz_q8_scale16;

__attribute__((target("avx512f"))) static inline lz_q8_scale16 lz_q8_scale16_of(float absmax) {
  return (lz_q8_scale16){_mm512_set1_ps(absmax), _mm512_set1_ps(1.0f / absmax),
                         absmax >= Q8_FAST_MIN && absmax <= Q8_FAST_MAX};
}

/* The indices of 16 values x of a block. */
__attribute__((target("avx512f"))) static inline __m128i lz_q8_quantize16(const uint32_t *cells,
                                                                          __m512 x,
                                                                          const lz_q8_scale16 *sc) {
  __mmask16 near = 0xffff;
  __m512i idx = _mm512_setzero_si512();
  if (sc->fast) idx = lz_q8_index16(cells, _mm512_castps_si512(_mm512_mul_ps(x, sc->r)), &near);
  if (near) {
    const __m512 z = _mm512_div_ps(x, sc->absmax);
    idx = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(z, z, _CMP_ORD_Q),
                                 lz_q8_index16(cells, _mm512_castps_si512(z), NULL));
  }
  return _mm512_cvtepi32_epi8(idx);
}

#ifdef __cplusplus
}
#endif

#endif /* LZ_QUANT8_H */
