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

/* The cell entries of 16 values z = x / absmax (their fp32 bits u): the
 * index each gets, NaN aside. */
__attribute__((target("avx512f"))) static inline __m512i lz_q8_index16(const uint32_t *cells,
                                                                       __m512i u) {
  const __m512i lo = _mm512_set1_epi32((int)Q8_LO), low16 = _mm512_set1_epi32(0xffff);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i ac = _mm512_min_epu32(_mm512_max_epu32(a, lo), _mm512_set1_epi32((int)Q8_ONE));
  __m512i cell = _mm512_srli_epi32(_mm512_sub_epi32(ac, lo), 16);
  cell = _mm512_mask_add_epi32(cell, _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512()), cell,
                               _mm512_set1_epi32((int)Q8_SIDE));
  const __m512i e = _mm512_i32gather_epi32(cell, (const int *)cells, 4);
  const __m512i l = _mm512_and_si512(ac, low16), s = _mm512_and_si512(e, low16);
  const __mmask16 up = _mm512_cmpge_epu32_mask(l, s);
  return _mm512_mask_blend_epi32(
      up, _mm512_and_si512(_mm512_srli_epi32(e, 16), _mm512_set1_epi32(0xff)),
      _mm512_srli_epi32(e, 24));
}


/* The indices of 16 values x of a block with this absmax (broadcast). The
 * division is bitsandbytes' own: multiplying by 1 / absmax and dividing only
 * where that could change an index was measured slower than dividing (the
 * check costs more than the division, which runs beside the lookups). */
__attribute__((target("avx512f"))) static inline __m128i lz_q8_quantize16(const uint32_t *cells,
                                                                          __m512 x,
                                                                          __m512 absmax) {
  const __m512 z = _mm512_div_ps(x, absmax);
  const __m512i idx = lz_q8_index16(cells, _mm512_castps_si512(z));
  return _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(z, z, _CMP_ORD_Q), idx));
}

#ifdef __cplusplus
}
#endif

#endif /* LZ_QUANT8_H */
