/* lz_gemm.h — one GEMM on host memory through matmul.c's paths (oneDNN's
 * sgemm, or bf16 with fp32 accumulation), for kernels built of GEMMs (the
 * experts' grouped GEMM). Not part of the public API. */
#ifndef LZ_GEMM_H
#define LZ_GEMM_H

#include "luazero.h"

/* c[m, n] = alpha * op(a) @ op(b) + beta * c, row-major; a and b both of dt
 * (f32 or bf16), c f32. a's stored rows lie lda elements apart: k (m when
 * ta) for a whole matrix, more for a block of a wider one. k = 0 leaves
 * beta * c. */
lz_status lz_gemm(lz_dtype dt, int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha,
                  const void *a, int64_t lda, const void *b, float beta, float *c);

#endif /* LZ_GEMM_H */
