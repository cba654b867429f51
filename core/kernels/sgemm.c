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

/* A transposed a (a weight gradient: dy^T x) whose rows are a multiple of 2
 * KB apart gains a little from the same copy: two threads, dy of 2048
 * columns, 256-4096 tokens, 162-172 GFLOP/s on a as it lies, 168-181 on the
 * copy (1024 columns: 94-180 against 129-182; 512 columns: none, so not
 * below 1024). The same bits. */
#define PAD_MIN_COLS_A 1024

static int64_t padded_lda(int64_t m, int64_t lda, int ta) {
  return ta && lda == m && m >= PAD_MIN_COLS_A && m % 512 == 0 ? m + PAD_COLS : 0;
}

/* This thread's copies of a and b with their rows padded (grown; one over
 * 64 MB is freed after its GEMM by pad_release). */
typedef struct {
  float *p;
  size_t bytes;
} pad_buf;
static _Thread_local pad_buf padded[2]; /* a, b */
#define PAD_KEEP_BYTES ((size_t)64 << 20)

/* rows x n of src, rows n apart, into buf's rows ld apart. */
static const float *pad_copy(pad_buf *buf, const float *src, int64_t rows, int64_t n,
                             int64_t ld) {
  const size_t bytes = (size_t)(rows * ld) * sizeof(float);
  if (bytes > buf->bytes) {
    float *grown = realloc(buf->p, bytes);
    if (!grown) return NULL;
    buf->p = grown, buf->bytes = bytes;
  }
  float *to = buf->p;
#pragma omp parallel for if (!omp_in_parallel() && rows * n >= (1 << 18))
  for (int64_t r = 0; r < rows; r++) memcpy(to + r * ld, src + r * n, (size_t)n * sizeof(float));
  return to;
}

static void pad_release(void) {
  for (int i = 0; i < 2; i++)
    if (padded[i].bytes > PAD_KEEP_BYTES) {
      free(padded[i].p);
      padded[i] = (pad_buf){NULL, 0};
    }
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
 * comes padded (b_ld); a transposed one where padded_lda says. */
lz_status lz_sgemm_batch(int64_t batch, int64_t m, int64_t n, int64_t k, int ta, int tb,
                         int b_shared, float alpha, const float *a, int64_t lda, const float *b,
                         int64_t b_ld, float beta, float *c) {
  /* the padded rows of the copies made here (0: none) */
  const int64_t ldb_p = b_ld ? 0 : lz_sgemm_padded_ldb(m, n, tb);
  const int64_t lda_p = padded_lda(m, lda, ta);
  lz_status st = LZ_OK;
  const float *bp = NULL, *ap = NULL;
  for (int64_t i = 0; i < batch && st == LZ_OK; i++) {
    const float *bi = b + (b_shared ? 0 : i * k * (b_ld ? b_ld : n)), *ai = a + i * m * k;
    if (ldb_p && (!bp || !b_shared)) bp = pad_copy(&padded[1], bi, k, n, ldb_p);
    if (lda_p) ap = pad_copy(&padded[0], ai, k, m, lda_p);
    if ((ldb_p && !bp) || (lda_p && !ap)) {
      st = lz_fail(LZ_ERR_NOMEM, "matmul: out of memory copying %s (%lld x %lld) for sgemm",
                   lda_p && !ap ? "a" : "b", (long long)k, (long long)(lda_p && !ap ? m : n));
      break;
    }
    st = sgemm(m, n, k, ta, tb, alpha, lda_p ? ap : ai, lda_p ? lda_p : lda, ldb_p ? bp : bi,
               ldb_p ? ldb_p : b_ld, beta, c + i * m * n);
  }
  if (ldb_p || lda_p) pad_release();
  return st;
}
