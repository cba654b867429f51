/* bench_timing.h — the clock and the statistics every benchmark uses:
 * monotonic seconds, the median and the best of repeated timings. Header
 * only: each benchmark is one C file plus this. */
#ifndef LZ_BENCH_TIMING_H
#define LZ_BENCH_TIMING_H

#include <stdlib.h> /* qsort */
#include <time.h>   /* clock_gettime */

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Sorts t in place. */
static inline double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static inline double best(const double *t, int n) {
  double b = t[0];
  for (int i = 1; i < n; i++) b = t[i] < b ? t[i] : b;
  return b;
}

#endif
