/* lz_lanes.h — float sums in independent lanes, for the row reductions of the
 * norm kernels. Not part of the public API.
 *
 * Without -ffast-math GCC will not reorder a single running sum, and so would
 * not vectorize it; LZ_LANES partial sums let it. The lanes are a GCC vector:
 * written as arrays with an inner lane loop, GCC vectorizes the outer loop
 * instead and drowns it in shuffles. */
#ifndef LZ_LANES_H
#define LZ_LANES_H

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

#endif /* LZ_LANES_H */
