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
  const struct lz_q8_fast *fast; /* the permute form of the lookup (quant8.c); NULL: none */
} lz_q8_map;

/* The signed dynamic map (is_signed 1, m) or the unsigned one (0, v). */
const lz_q8_map *lz_q8_map_get(int is_signed);

/* q[i] = the index bitsandbytes picks for x[i] / absmax, n <= one block
 * whose largest magnitude is at most absmax (an x of inf over a finite
 * absmax is taken for NaN): the fastest way this machine has. */
typedef void (*lz_q8_quantize_fn)(const lz_q8_map *map, const float *x, float absmax, uint8_t *q,
                                  int64_t n);
lz_q8_quantize_fn lz_q8_quantizer(void);

/* The same at most at a level (0 scalar, 1 AVX2, 2 AVX-512 with gathers, 3
 * with byte permutes where the map has their tables), so that tests run
 * every form the machine can; each gives the same indices. */
lz_q8_quantize_fn lz_q8_quantizer_at(int level);

/* The same for whole groups of 64 values (n a multiple of 64) without table
 * gathers, where lz_q8_fast_ok(map): AVX-512 VBMI2 and the map's steps fit
 * the permute tables (quant8.c). */
int lz_q8_fast_ok(const lz_q8_map *map);
void lz_q8_quantize_fast(const lz_q8_map *map, const float *x, float absmax, uint8_t *q, int64_t n);

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
                                                                          __m512 x, __m512 absmax) {
  const __m512 z = _mm512_div_ps(x, absmax);
  const __m512i idx = lz_q8_index16(cells, _mm512_castps_si512(z));
  return _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(z, z, _CMP_ORD_Q), idx));
}

/* The lookup as byte permutes (lz_q8_quantize64). A value's cell is
 * picked by its binade and the top bits of its mantissa, as many as that
 * binade of that sign needs for no cell to hold more than two steps; all
 * cells of both signs are numbered 0..255. A cell gives the label of its
 * first magnitude's run (labels count the runs of both signs, from the
 * smallest magnitude up) and the mantissas of its steps (0xffffff: none); the
 * value's label is the cell's plus the steps at or below its mantissa, and
 * `index` maps a label to the map index. NaN and inf land in two cells of
 * their own, labelled for index 0 (quant8.c, place_binades). */
typedef struct lz_q8_fast {
  uint16_t binade[64];     /* [sign 32 + exponent % 32]: shift | cell offset << 8 */
  uint8_t cell[7][256];    /* label, then the two steps' mantissas, byte planes */
  uint8_t index[256];      /* label -> map index */
  uint16_t sel_hi[32];     /* the permutes' selectors: the top 16 bits of 32 floats, */
  uint8_t sel_cell[64];    /* the low byte of 64 words, */
  uint8_t sel_byte[3][64]; /* byte k of 32 floats twice */
} lz_q8_fast;

/* At most this many groups of 64 share each table's loads (four measured no
 * faster in the 8-bit step). */
#define LZ_Q8_GROUPS 2

#define LZ_Q8_FAST __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2,fma")))

/* One byte plane of a cell table at 64 cells at once, for each of g groups
 * of 64 (the table's four registers loaded once for all of them). */
LZ_Q8_FAST static inline __attribute__((always_inline)) void lz_q8_plane64(const uint8_t *t, int g,
                                                                           const __m512i *cell,
                                                                           const __mmask64 *high,
                                                                           __m512i *out) {
  const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 64);
  const __m512i t2 = _mm512_loadu_si512(t + 128), t3 = _mm512_loadu_si512(t + 192);
  for (int j = 0; j < g; j++)
    out[j] = _mm512_mask_blend_epi8(high[j], _mm512_permutex2var_epi8(t0, cell[j], t1),
                                    _mm512_permutex2var_epi8(t2, cell[j], t3));
}

/* Adds 1 to each of g groups of 64 labels whose mantissa (byte planes
 * m[j][0..2], low byte first) is at or above the step of its cell in the
 * planes t[0..2]: compared byte by byte from the top, the lower bytes
 * deciding where the upper are equal. */
LZ_Q8_FAST static inline __attribute__((always_inline)) void lz_q8_count_step64(
    const uint8_t (*t)[256], int g, const __m512i *cell, const __mmask64 *high,
    const __m512i (*m)[3], __m512i *label) {
  __m512i t0[LZ_Q8_GROUPS], t1[LZ_Q8_GROUPS], t2[LZ_Q8_GROUPS];
  lz_q8_plane64(t[0], g, cell, high, t0);
  lz_q8_plane64(t[1], g, cell, high, t1);
  lz_q8_plane64(t[2], g, cell, high, t2);
  for (int j = 0; j < g; j++) {
    const __mmask64 ge10 =
        _mm512_cmpgt_epu8_mask(m[j][1], t1[j]) |
        _mm512_mask_cmpge_epu8_mask(_mm512_cmpeq_epi8_mask(m[j][1], t1[j]), m[j][0], t0[j]);
    const __mmask64 ge =
        _mm512_cmpgt_epu8_mask(m[j][2], t2[j]) | _mm512_mask_cmpeq_epi8_mask(ge10, m[j][2], t2[j]);
    label[j] = _mm512_mask_add_epi8(label[j], ge, label[j], _mm512_set1_epi8(1));
  }
}

/* lz_q8_count_step64 on the top two of the three bytes only (mantissa bits
 * 8-22): a larger or smaller top decides alone; where they are equal
 * (`tie`, to which those lanes are added) the low byte would decide, and
 * the caller takes the three-byte count instead. */
LZ_Q8_FAST static inline __attribute__((always_inline)) void lz_q8_count_step64_top(
    const uint8_t (*t)[256], int g, const __m512i *cell, const __mmask64 *high,
    const __m512i (*m)[3], __m512i *label, __mmask64 *tie) {
  __m512i t1[LZ_Q8_GROUPS], t2[LZ_Q8_GROUPS];
  lz_q8_plane64(t[1], g, cell, high, t1);
  lz_q8_plane64(t[2], g, cell, high, t2);
  for (int j = 0; j < g; j++) {
    const __mmask64 eq2 = _mm512_cmpeq_epi8_mask(m[j][2], t2[j]);
    const __mmask64 gt =
        _mm512_cmpgt_epu8_mask(m[j][2], t2[j]) | _mm512_mask_cmpgt_epu8_mask(eq2, m[j][1], t1[j]);
    tie[j] |= _mm512_mask_cmpeq_epi8_mask(eq2, m[j][1], t1[j]);
    label[j] = _mm512_mask_add_epi8(label[j], gt, label[j], _mm512_set1_epi8(1));
  }
}

/* x / b as RN(x * r) corrected by its remainder (Markstein's step), r =
 * RN(1 / b), for b in [2^-52, 2^64] (lz_q8_recip_ok). The result is x / b
 * or its neighbour on the other side of x / b (a faithful rounding: the
 * product is within 1.5 units in the last place and the corrected value
 * within a small fraction of one before its rounding). Where |x / b| >=
 * 2^-27 every intermediate is normal, so the result depends on the
 * mantissas of x and b alone; below, it stays under 2^-26, in the one cell
 * of magnitudes under 2^-25, whose index is that of 0 of either sign. So the
 * index can only differ from the true quotient's where x / b lies between a
 * step and the float below it: test_quant8 checks those quotients for every
 * step of both maps. */
LZ_Q8_FAST static inline __m512 lz_q8_div16(__m512 x, __m512 b, __m512 r) {
  const __m512 q0 = _mm512_mul_ps(x, r);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, b, x), r, q0);
}

static inline int lz_q8_recip_ok(float absmax) { return absmax >= 0x1p-52f && absmax <= 0x1p64f; }

/* The indices of g (1 or 2) groups of 64 values x of a block with this
 * absmax (broadcast; with recip, r its reciprocal and the division
 * lz_q8_div16's): the cell from the top 16 bits of z = x / absmax (sign,
 * exponent, 7 mantissa bits) in 16-bit lanes, the cell's label and steps by
 * byte permutes, the steps compared with z's mantissa as bytes, 64 values
 * per compare. Two groups share each table's loads. With `top`, only the
 * mantissa's top two bytes are compared (lz_q8_count_step64_top): returns 0,
 * storing nothing, where a value's top bytes equal a step's, for the caller
 * to take the three-byte form (in a cell of k top mantissa bits about
 * 2^(k-15) of the values per step lie there: 5-18% of groups of 128 on
 * random values); 1 where it stored. */
LZ_Q8_FAST static inline __attribute__((always_inline)) int lz_q8_quantize_groups(
    const lz_q8_fast *f, const float *x, __m512 absmax, int recip, __m512 r, uint8_t *q, int g,
    int top) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i hi_words = _mm512_loadu_si512(f->sel_hi),
                sel_cell = _mm512_loadu_si512(f->sel_cell);
  const __m512i bin0 = _mm512_loadu_si512(f->binade), bin1 = _mm512_loadu_si512(f->binade + 32);
  __m512i z[LZ_Q8_GROUPS][4], cell[LZ_Q8_GROUPS], m[LZ_Q8_GROUPS][3], label[LZ_Q8_GROUPS],
      idx[LZ_Q8_GROUPS];
  __mmask64 high[LZ_Q8_GROUPS], tie[LZ_Q8_GROUPS] = {0};
  for (int j = 0; j < g; j++) {
    __m512i c[2], hw[2];
    for (int i = 0; i < 4; i++) {
      const __m512 xi = _mm512_loadu_ps(x + 64 * j + 16 * i);
      z[j][i] = _mm512_castps_si512(recip ? lz_q8_div16(xi, absmax, r) : _mm512_div_ps(xi, absmax));
    }
    for (int h = 0; h < 2; h++) {
      hw[h] = _mm512_permutex2var_epi16(z[j][2 * h], hi_words, z[j][2 * h + 1]);
      const __m512i mag = _mm512_and_si512(hw[h], _mm512_set1_epi16(0x7fff));
      /* |z| <= 1 (a quotient of |x| <= absmax, correctly or faithfully
       * rounded) but for NaN and inf (0 / 0; inf / a finite absmax), whose
       * cells quant8.c places so that they give index 0: only the bottom
       * needs clamping */
      const __m512i a = _mm512_max_epu16(mag, _mm512_set1_epi16((short)(Q8_LO >> 16)));
      /* the binade % 32 with bit 5 (set in every binade here) the sign: 0xd8 is c ? b : a */
      const __m512i bi = _mm512_ternarylogic_epi32(
          _mm512_srli_epi16(a, 7), _mm512_srli_epi16(hw[h], 10), _mm512_set1_epi16(0x20), 0xd8);
      const __m512i ent = _mm512_permutex2var_epi16(bin0, bi, bin1);
      c[h] = _mm512_add_epi16(_mm512_shrdv_epi16(a, zero, ent), _mm512_srli_epi16(ent, 8));
    }
    cell[j] = _mm512_permutex2var_epi8(c[0], sel_cell, c[1]);
    high[j] = _mm512_movepi8_mask(cell[j]);
    /* the mantissa's top byte is the top words' low byte, the exponent's low bit off */
    m[j][2] =
        _mm512_and_si512(_mm512_permutex2var_epi8(hw[0], sel_cell, hw[1]), _mm512_set1_epi8(0x7f));
  }
  for (int k = top ? 1 : 0; k < 2; k++) { /* z's mantissa as byte planes, elements in order */
    const __m512i sel = _mm512_loadu_si512(f->sel_byte[k]);
    for (int j = 0; j < g; j++)
      m[j][k] = _mm512_mask_blend_epi8(0xffffffff00000000ull,
                                       _mm512_permutex2var_epi8(z[j][0], sel, z[j][1]),
                                       _mm512_permutex2var_epi8(z[j][2], sel, z[j][3]));
  }
  lz_q8_plane64(f->cell[0], g, cell, high, label);
  if (top) {
    lz_q8_count_step64_top((const uint8_t(*)[256])f->cell[1], g, cell, high, (const __m512i(*)[3])m,
                           label, tie);
    lz_q8_count_step64_top((const uint8_t(*)[256])f->cell[4], g, cell, high, (const __m512i(*)[3])m,
                           label, tie);
    __mmask64 any = 0;
    for (int j = 0; j < g; j++) any |= tie[j];
    if (any) return 0;
  } else {
    lz_q8_count_step64((const uint8_t(*)[256])f->cell[1], g, cell, high, (const __m512i(*)[3])m,
                       label);
    lz_q8_count_step64((const uint8_t(*)[256])f->cell[4], g, cell, high, (const __m512i(*)[3])m,
                       label);
  }
  for (int j = 0; j < g; j++) high[j] = _mm512_movepi8_mask(label[j]);
  lz_q8_plane64(f->index, g, label, high, idx);
  for (int j = 0; j < g; j++) _mm512_storeu_si512(q + 64 * j, idx[j]);
  return 1;
}

/* Three-byte forms, out of line (quant8.c): the rare groups the two-byte
 * compare leaves undecided. */
void lz_q8_quantize64_exact(const lz_q8_fast *f, const float *x, __m512 absmax, int recip, __m512 r,
                            uint8_t *q);
void lz_q8_quantize128_exact(const lz_q8_fast *f, const float *x, __m512 absmax, int recip,
                             __m512 r, uint8_t *q);

LZ_Q8_FAST static inline void lz_q8_quantize64(const lz_q8_fast *f, const float *x, __m512 absmax,
                                               int recip, __m512 r, uint8_t *q) {
  if (!lz_q8_quantize_groups(f, x, absmax, recip, r, q, 1, 1))
    lz_q8_quantize64_exact(f, x, absmax, recip, r, q);
}

LZ_Q8_FAST static inline void lz_q8_quantize128(const lz_q8_fast *f, const float *x, __m512 absmax,
                                                int recip, __m512 r, uint8_t *q) {
  if (!lz_q8_quantize_groups(f, x, absmax, recip, r, q, 2, 1))
    lz_q8_quantize128_exact(f, x, absmax, recip, r, q);
}

#ifdef __cplusplus
}
#endif

#endif /* LZ_QUANT8_H */
