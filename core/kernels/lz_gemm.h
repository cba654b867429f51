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

/* sgemm.c: c[batch, m, n] = alpha * op(a) @ op(b) + beta * c in fp32, a
 * loop of dnnl_sgemm (each one multithreaded outside a parallel region); a's
 * rows lda apart; b's batches k x n apart (one b for all when b_shared).
 * b_ld: b already stored with its rows b_ld apart (the padded rows that
 * lz_sgemm_padded_ldb gives); 0: as op(b) is stored, copied to padded rows
 * first where lz_sgemm_padded_ldb says. */
lz_status lz_sgemm_batch(int64_t batch, int64_t m, int64_t n, int64_t k, int ta, int tb,
                         int b_shared, float alpha, const float *a, int64_t lda, const float *b,
                         int64_t b_ld, float beta, float *c);

/* Where sgemm runs faster on b with its rows padded: the padded row length,
 * else 0. */
int64_t lz_sgemm_padded_ldb(int64_t m, int64_t n, int tb);

#endif /* LZ_GEMM_H */
