/* lz_test_main.c — runs the registered C tests and prints "N passed, N failed". */
#include "lz_test.h"

#include <stdarg.h> /* va_list */
#include <stdlib.h> /* getenv */
#include <string.h> /* strstr */
#include <time.h>   /* clock_gettime for per-test timing */

#define LZ_MAX_TESTS 1024

static struct {
  const char *name;
  lz_test_fn fn;
} tests[LZ_MAX_TESTS];
static int n_tests;
static int current_failures;

void lz_test_register(const char *name, lz_test_fn fn) {
  if (n_tests < LZ_MAX_TESTS) {
    tests[n_tests].name = name;
    tests[n_tests].fn = fn;
    n_tests++;
  }
}

void lz_test_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("    %s:%d: ", file, line);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  current_failures++;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
  const char *filter = argc > 1 ? argv[1] : NULL;
  int passed = 0, failed = 0;
  for (int i = 0; i < n_tests; i++) {
    if (filter && !strstr(tests[i].name, filter)) continue;
    current_failures = 0;
    double t0 = now_s();
    tests[i].fn();
    double dt = now_s() - t0;
    if (current_failures == 0) {
      passed++;
      printf("ok   %-48s %7.3f s\n", tests[i].name, dt);
    } else {
      failed++;
      printf("FAIL %-48s %7.3f s\n", tests[i].name, dt);
    }
    fflush(stdout);
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
