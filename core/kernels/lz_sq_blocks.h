/* lz_sq_blocks.h — sq_norm's block sums (kernels/elementwise.c) for the
 * kernels that take them where they write gradients: the gradient norm's
 * partials of a block read while it is still in cache, the same bits as
 * sq_norm's own pass (lz_sq_norm_blocks sums them). */
#ifndef LZ_SQ_BLOCKS_H
#define LZ_SQ_BLOCKS_H

#include <stdint.h>

/* Elements per partial sum of sq_norm. */
#define LZ_SQ_BLOCK 4096

/* out[k] = the sum of squares of x's block k (elements k * LZ_SQ_BLOCK on,
 * the last block what remains of len), as lz_sq_norm sums each block, for
 * every k < ceil(len / LZ_SQ_BLOCK); on the calling thread. */
void lz_sq_f32_blocks(const float *x, int64_t len, double *out);

#endif
