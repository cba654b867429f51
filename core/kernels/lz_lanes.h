/* lz_lanes.h — float sums in independent lanes, for the row reductions of the
 * norm kernels and the dot products of decoding (attention_decode.c). Not
 * part of the public API.
 *
 * Without -ffast-math GCC will not reorder a single running sum, and so would
 * not vectorize it; LZ_LANES partial sums let it. The lanes are a GCC vector:
 * written as arrays with an inner lane loop, GCC vectorizes the outer loop
 * instead and drowns it in shuffles. */
#ifndef LZ_LANES_H
#define LZ_LANES_H

#include <stdint.h> /* int32_t */
#include <string.h> /* memcpy */

#define LZ_LANES 16
typedef float lz_lanes_f32 __attribute__((vector_size(LZ_LANES * sizeof(float))));
#define LZ_LOAD_LANES(v, p) memcpy(&(v), (p), sizeof(lz_lanes_f32))
#define LZ_STORE_LANES(p, v) memcpy((p), &(v), sizeof(lz_lanes_f32))

/* The lanes added in lane order. */
static inline float lz_sum_lanes(const lz_lanes_f32 *acc) {
  float s = 0.0f;
  for (int l = 0; l < LZ_LANES; l++) s += (*acc)[l];
  return s;
}

/* Eight lanes (32 bytes), for dot products summed eight at a time: the
 * vectors go by pointer (a 32-byte vector by value changes the ABI between
 * a kernel's clones). */
typedef float lz_v8 __attribute__((vector_size(32)));
typedef int32_t lz_v8i __attribute__((vector_size(32)));

/* Lane l of *y: the sum of a[l]'s lanes, in a fixed tree (pairs, quads,
 * halves), all eight at once. */
static inline __attribute__((always_inline)) void lz_sums8(lz_v8 *y, const lz_v8 *a) {
  const lz_v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const lz_v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const lz_v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  lz_v8 p[4], q[2];
  for (int i = 0; i < 4; i++)
    p[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
  for (int i = 0; i < 2; i++)
    q[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo2) +
           __builtin_shuffle(p[2 * i], p[2 * i + 1], hi2);
  *y = __builtin_shuffle(q[0], q[1], lo4) + __builtin_shuffle(q[0], q[1], hi4);
}

#endif /* LZ_LANES_H */
