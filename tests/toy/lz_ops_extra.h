/* lz_ops_extra.h — the toy op's public function, as core/luazero.h would
 * declare it (mem/lz_backend.h includes this in the lz_ops_toy build). */
#ifndef LZ_OPS_EXTRA_H
#define LZ_OPS_EXTRA_H

#include "luazero.h"

/* y = alpha x + beta y; x, y: f32 of one shape. */
lz_status lz_toy_axpby(lz_tensor *y, const lz_tensor *x, float alpha, float beta);

#endif /* LZ_OPS_EXTRA_H */
