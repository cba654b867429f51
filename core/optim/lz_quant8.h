/* lz_quant8.h — bitsandbytes' block-wise 8-bit code as its CPU library
 * (0.50.2) computes it: the signed and unsigned dynamic maps, and the index
 * its quantiser picks for a value scaled into [-1, 1]. Shared by the 8-bit
 * optimizer step and the state conversions. Not part of the public API. */
#ifndef LZ_QUANT8_H
#define LZ_QUANT8_H

#include "mem/lz_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A map: its 256 fp32 entries, and the lookup table of its quantiser
 * (quant8.c says how it is laid out). */
typedef struct lz_q8_map {
  const float *values;
  const uint32_t *cells;
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

#ifdef __cplusplus
}
#endif

#endif /* LZ_QUANT8_H */
