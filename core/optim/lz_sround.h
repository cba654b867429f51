/* lz_sround.h — stochastic rounding of fp32 to bf16 with counter-based
 * random bits (torchao's bf16_stochastic_round idea): what the cpu kernel
 * (sround.c) and the cuda one share, so both draw the same bits. Not part
 * of the public API.
 *
 * The 16 random bits of an element are a hash of (seed, step, its global
 * index), not a stream's next draw: any rank, stage, chunking or world size
 * that rounds the same element at the same step draws the same bits. The
 * hash is Wellons' lowbias32 twice, 32-bit multiplies and shifts only, so
 * the loop vectorizes on AVX2 and AVX-512. */
#ifndef LZ_SROUND_H
#define LZ_SROUND_H

#include <stdint.h>

#ifdef __CUDACC__
#define LZ_SROUND_FN __host__ __device__ static inline
#else
#define LZ_SROUND_FN static inline
#endif

/* The per-call key: two 32-bit words from (seed, step), splitmix64's
 * finaliser over each. */
typedef struct lz_sround_key {
  uint32_t k0, k1;
} lz_sround_key;

LZ_SROUND_FN uint64_t lz_sround_mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

LZ_SROUND_FN lz_sround_key lz_sround_key_of(uint64_t seed, uint64_t step) {
  const uint64_t z = lz_sround_mix64(seed ^ lz_sround_mix64(step));
  lz_sround_key k = {(uint32_t)z, (uint32_t)(z >> 32)};
  return k;
}

LZ_SROUND_FN uint32_t lz_sround_lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

/* The 16 random bits of the element at global index i. */
LZ_SROUND_FN uint32_t lz_sround_bits(lz_sround_key k, int64_t i) {
  const uint64_t u = (uint64_t)i;
  const uint32_t h = lz_sround_lowbias32(lz_sround_lowbias32((uint32_t)u ^ k.k0) ^
                                         (uint32_t)(u >> 32) ^ k.k1);
  return h >> 16;
}

/* f32 bits u rounded to bf16 bits with random bits r (0..65535): the 16
 * bits dropped plus r carry into the kept ones with probability (dropped /
 * 2^16), so the expected result is the fp32 value itself. NaN stays a quiet
 * NaN, as round-to-nearest makes it; infinities stay (their dropped bits are
 * zero); the largest finite values may round up to infinity. */
LZ_SROUND_FN uint16_t lz_sround_bf16(uint32_t u, uint32_t r) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + r) >> 16);
}

#ifndef __CUDACC__
/* dst[i] = src[i] rounded with the bits of global index index + i (the cpu
 * kernel's loop, sround.c; what fused optimizer steps round through). */
void lz_sround_block(uint16_t *restrict dst, const float *restrict src, lz_sround_key k,
                     int64_t index, int64_t n);
#endif

#endif /* LZ_SROUND_H */
