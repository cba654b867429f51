/* lz_sq_blocks.h — sq_norm's block sums (kernels/elementwise.c) for the
 * kernels that take them where they write gradients: the gradient norm's
 * partials of a block read while it is still in cache, the same bits as
 * sq_norm's own pass (lz_sq_norm_blocks sums them). */
#ifndef LZ_SQ_BLOCKS_H
#define LZ_SQ_BLOCKS_H

#include "luazero.h" /* lz_status, lz_tensor */

#include <stdint.h>

/* Elements per partial sum of sq_norm. */
#define LZ_SQ_BLOCK 4096

/* out[k] = the sum of squares of x's block k (elements k * LZ_SQ_BLOCK on,
 * the last block what remains of len), as lz_sq_norm sums each block, for
 * every k < ceil(len / LZ_SQ_BLOCK); on the calling thread. */
void lz_sq_f32_blocks(const float *x, int64_t len, double *out);

/* A gradient slice of `slice` elements, whose elements at .. at + n were
 * just written and are held at p: the sums of its blocks that lie wholly
 * inside them into blocks[k] (also the slice's last, short block where
 * at + n is the slice's end); the blocks reaching past them are left as
 * they are. p NULL: the elements are +0, each sum 0 without a read.
 * parallel: the blocks shared among the threads (an OpenMP loop of its
 * own), else all on the calling thread. */
void lz_sq_f32_take_blocks(const float *p, int64_t at, int64_t n, int64_t slice, double *blocks,
                           int parallel);

/* A _norm op's own checks of its partials: blocks given, and dw (where
 * given) inside a slice of slice_numel elements at dw_at; plain names the
 * op to call without partials. */
lz_status lz_check_norm_blocks(const char *op, const lz_tensor *dw, const double *blocks,
                               int64_t slice_numel, int64_t dw_at, const char *plain);

#endif
