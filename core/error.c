/* error.c — the thread-local error message, status names, version, CPU
 * features and thread count, and the argument checks kernels share. */
#include "lz_internal.h"

#include <omp.h>   /* omp_set_num_threads */
#include <stdio.h> /* vsnprintf */

static _Thread_local char last_error[1024];

lz_status lz_fail(lz_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return st;
}

const char *lz_last_error(void) { return last_error; }

const char *lz_status_name(lz_status s) {
  switch (s) {
  case LZ_OK: return "ok";
  case LZ_ERR_INVALID: return "invalid argument";
  case LZ_ERR_NOMEM: return "out of memory";
  case LZ_ERR_IO: return "i/o error";
  case LZ_ERR_UNSUPPORTED: return "unsupported";
  case LZ_ERR_COMM: return "communication error";
  case LZ_ERR_TIMEOUT: return "timeout";
  case LZ_ERR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

const char *lz_version(void) { return LZ_VERSION_STRING; }

int lz_cpu_has(const char *feature) {
  __builtin_cpu_init();
  if (!strcmp(feature, "avx2")) return __builtin_cpu_supports("avx2");
  if (!strcmp(feature, "avx512f")) return __builtin_cpu_supports("avx512f");
  if (!strcmp(feature, "avx512bf16")) {
    /* CPUID leaf 7, sub-leaf 1, EAX bit 5. */
    unsigned a = 7, b = 0, c = 1, d = 0;
    __asm__ volatile("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d));
    return (a >> 5) & 1;
  }
  return 0;
}

lz_status lz_threads_set(int n) {
  if (n < 1) return lz_fail(LZ_ERR_INVALID, "threads: count must be >= 1 (got %d)", n);
  omp_set_num_threads(n);
  return LZ_OK;
}

int lz_threads_get(void) { return omp_get_max_threads(); }

/* ------------------------------------------------------- argument checks */

lz_status lz_check_present(const char *op, const char *name, const lz_tensor *t) {
  if (!t) return lz_fail(LZ_ERR_INVALID, "%s: %s is missing (NULL)", op, name);
  return LZ_OK;
}

lz_status lz_check_cpu(const char *op, const char *name, const lz_tensor *t) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->device != LZ_CPU)
    return lz_fail(LZ_ERR_UNSUPPORTED, "%s: %s lives on cuda; this is the cpu kernel", op,
                   name);
  return LZ_OK;
}

/* The shape and dtype checks accept tensors on any device: each kernel ends
 * its checks with LZ_DEVICE_DISPATCH, which sends cuda tensors to the
 * backend and refuses a mix of devices. */
lz_status lz_check_dtype(const char *op, const char *name, const lz_tensor *t, lz_dtype dt) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->dtype != dt) {
    char buf[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected dtype %s", op, name,
                   lz_tensor_describe(t, buf, sizeof buf), lz_dtype_name(dt));
  }
  return LZ_OK;
}

lz_status lz_check_ndim(const char *op, const char *name, const lz_tensor *t, int lo, int hi) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->ndim < lo || t->ndim > hi) {
    char buf[96];
    if (lo == hi)
      return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected %d dimensions", op, name,
                     lz_tensor_describe(t, buf, sizeof buf), lo);
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected %d to %d dimensions", op, name,
                   lz_tensor_describe(t, buf, sizeof buf), lo, hi);
  }
  return LZ_OK;
}

lz_status lz_check_numel(const char *op, const char *name, const lz_tensor *t, int64_t n,
                         const char *why) {
  LZ_TRY(lz_check_present(op, name, t));
  if (lz_tensor_numel(t) != n) {
    char buf[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s (%lld elements), expected %lld elements (%s)",
                   op, name, lz_tensor_describe(t, buf, sizeof buf),
                   (long long)lz_tensor_numel(t), (long long)n, why);
  }
  return LZ_OK;
}

lz_status lz_check_same_shape(const char *op, const char *name_a, const lz_tensor *a,
                              const char *name_b, const lz_tensor *b) {
  LZ_TRY(lz_check_present(op, name_a, a));
  LZ_TRY(lz_check_present(op, name_b, b));
  int same = a->ndim == b->ndim;
  for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
  if (!same) {
    char ba[96], bb[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s but %s is %s; they must have the same shape",
                   op, name_a, lz_tensor_describe(a, ba, sizeof ba), name_b,
                   lz_tensor_describe(b, bb, sizeof bb));
  }
  return LZ_OK;
}

int64_t lz_cols(const lz_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

int64_t lz_rows(const lz_tensor *t) {
  int64_t c = lz_cols(t);
  return c ? lz_tensor_numel(t) / c : 0;
}
