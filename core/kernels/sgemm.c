/* sgemm.c — fp32 GEMMs through oneDNN's dnnl_sgemm, for matmul.c (and the
 * bf16 GEMMs it widens to fp32), with b first copied to padded rows where
 * sgemm reads it slowly as it lies. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_gemm.h"

#include <dnnl.h>   /* dnnl_sgemm */
#include <omp.h>    /* omp_in_parallel: the copy runs on the threads outside one */
#include <stdlib.h> /* realloc, free */
#include <string.h> /* memcpy */

/* b's rows for sgemm. Below some 256 rows of a (m), oneDNN 2.6's sgemm
 * reads b as it lies, without packing it; where b's rows are a multiple of
 * 2 KB apart (n a multiple of 512) its loads of a column block then fall in
 * the same few sets of the core's cache and evict each other. On a Zen 3
 * (AVX2), one thread, k 512 or 2048: 40-67 GFLOP/s for n 512-4096 and m
 * 32-256, 71-96 with b first copied to rows n + 16 apart, copy included;
 * two threads, m 128-256: 88-136 against 147-184. The same bits: the copy
 * changes where b's rows lie, not the sums. */
#define PAD_MAX_ROWS 256
#define PAD_COLS 16

int64_t lz_sgemm_padded_ldb(int64_t m, int64_t n, int tb) {
  return !tb && m <= PAD_MAX_ROWS && n % 512 == 0 ? n + PAD_COLS : 0;
}

/* This thread's copy of b with its rows ldb apart (grown; one over 64 MB is
 * freed after its GEMM by pad_release). */
static _Thread_local float *padded_b;
static _Thread_local size_t padded_b_bytes;
#define PAD_KEEP_BYTES ((size_t)64 << 20)

static const float *pad_b(const float *b, int64_t k, int64_t n, int64_t ldb) {
  const size_t bytes = (size_t)(k * ldb) * sizeof(float);
  if (bytes > padded_b_bytes) {
    float *grown = realloc(padded_b, bytes);
    if (!grown) return NULL;
    padded_b = grown, padded_b_bytes = bytes;
  }
  float *to = padded_b;
#pragma omp parallel for if (!omp_in_parallel() && k * n >= (1 << 18))
  for (int64_t r = 0; r < k; r++) memcpy(to + r * ldb, b + r * n, (size_t)n * sizeof(float));
  return to;
}

static void pad_release(void) {
  if (padded_b_bytes <= PAD_KEEP_BYTES) return;
  free(padded_b);
  padded_b = NULL, padded_b_bytes = 0;
}

/* One dnnl_sgemm, b's rows ldb apart (0: as op(b) is stored, k or n). */
static lz_status sgemm(int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha,
                       const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                       float *c) {
  const dnnl_status_t s = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b,
                                     ldb ? ldb : tb ? k : n, beta, c, n);
  if (s == dnnl_success) return LZ_OK;
  return lz_fail(LZ_ERR_INTERNAL, "matmul: dnnl_sgemm(%lld x %lld x %lld, lda %lld) failed: "
                 "status %d", (long long)m, (long long)n, (long long)k, (long long)lda, (int)s);
}

/* lz_gemm.h's contract: b padded where lz_sgemm_padded_ldb says, unless it
 * comes padded (b_ld). */
lz_status lz_sgemm_batch(int64_t batch, int64_t m, int64_t n, int64_t k, int ta, int tb,
                         int b_shared, float alpha, const float *a, int64_t lda, const float *b,
                         int64_t b_ld, float beta, float *c) {
  const int64_t ldb = b_ld ? b_ld : lz_sgemm_padded_ldb(m, n, tb);
  lz_status st = LZ_OK;
  const float *bp = NULL;
  for (int64_t i = 0; i < batch && st == LZ_OK; i++) {
    const float *bi = b + (b_shared ? 0 : i * k * (b_ld ? b_ld : n));
    if (ldb && !b_ld && (!bp || !b_shared)) {
      bp = pad_b(bi, k, n, ldb);
      if (!bp) {
        st = lz_fail(LZ_ERR_NOMEM, "matmul: out of memory copying b (%lld x %lld) for sgemm",
                     (long long)k, (long long)n);
        break;
      }
    }
    st = sgemm(m, n, k, ta, tb, alpha, a + i * m * k, lda, ldb && !b_ld ? bp : bi, ldb, beta,
               c + i * m * n);
  }
  if (ldb && !b_ld) pad_release();
  return st;
}
