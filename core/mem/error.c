/* error.c — the thread-local error message, status names, version, CPU
 * features and thread count. The bottom of the core: it calls nothing else
 * in it (the argument checks, which describe tensors, are checks.c). */
#include "mem/lz_internal.h"

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

/* The clone of an LZ_DISPATCH function (mem/lz_internal.h) GCC's resolver
 * picks here: avx512f where the CPU has it, else avx2, else the default;
 * with AVX2 and FMA, the fused forms beside the avx2 clones. */
lz_cpu_form lz_cpu_form_here(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return LZ_FORM_AVX512;
  if (!__builtin_cpu_supports("avx2")) return LZ_FORM_PLAIN;
  return __builtin_cpu_supports("fma") ? LZ_FORM_AVX2_FMA : LZ_FORM_AVX2;
}

const char *lz_cpu_kernels(void) {
  static const char *const names[] = {
      [LZ_FORM_PLAIN] = "x86-64", [LZ_FORM_AVX2] = "avx2", [LZ_FORM_AVX2_FMA] = "avx2+fma",
      [LZ_FORM_AVX512] = "avx512f"};
  return names[lz_cpu_form_here()];
}

lz_status lz_threads_set(int n) {
  if (n < 1) return lz_fail(LZ_ERR_INVALID, "threads: count must be >= 1 (got %d)", n);
  omp_set_num_threads(n);
  return LZ_OK;
}

int lz_threads_get(void) { return omp_get_max_threads(); }

const char *lz_format_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, u++;
  if (u == 0)
    snprintf(buf, len, "%llu B", (unsigned long long)bytes);
  else
    snprintf(buf, len, "%.2f %s", v, units[u]);
  return buf;
}
