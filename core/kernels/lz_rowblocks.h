/* lz_rowblocks.h — the fixed row blocks over which the norm kernels sum their
 * parameter gradients. Not part of the public API.
 *
 * A sum over rows that threads share is bitwise independent of the thread
 * count when the rows are cut into a number of blocks that depends on the row
 * count alone, each block sums its rows in order into its own partial, and
 * the partials are added in block order. */
#ifndef LZ_ROWBLOCKS_H
#define LZ_ROWBLOCKS_H

#include <stdint.h>

/* At most LZ_MAX_ROW_BLOCKS blocks, of at least LZ_MIN_BLOCK_ROWS rows. */
#define LZ_MAX_ROW_BLOCKS 16
#define LZ_MIN_BLOCK_ROWS 16

static inline int64_t lz_row_blocks(int64_t rows) {
  int64_t n = rows / LZ_MIN_BLOCK_ROWS;
  return n < 1 ? 1 : n > LZ_MAX_ROW_BLOCKS ? LZ_MAX_ROW_BLOCKS : n;
}

/* Block k of n covers rows [k * rows / n, (k + 1) * rows / n). */
static inline int64_t lz_block_start(int64_t k, int64_t n, int64_t rows) { return k * rows / n; }

/* dst[c] += the n blocks' partial sums of column c, added in block order;
 * block k's partials start at partial + k * stride. */
static inline void lz_add_block_partials(float *dst, const float *partial, int64_t n, int64_t C,
                                         int64_t stride) {
  for (int64_t c = 0; c < C; c++) {
    float t = 0.0f;
    for (int64_t k = 0; k < n; k++) t += partial[k * stride + c];
    dst[c] += t;
  }
}

#endif /* LZ_ROWBLOCKS_H */
