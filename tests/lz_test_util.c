/* lz_test_util.c — random numbers, wrapping and error measures the kernel
 * tests share. */
#include "lz_test.h"

uint64_t lz_test_xorshift(uint64_t *state) {
  uint64_t x = *state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *state = x;
}

float lz_test_uniform(uint64_t *state) {
  return (float)((double)(lz_test_xorshift(state) >> 40) * 0x1p-23 - 1.0);
}

lz_tensor *lz_test_wrap(void *data, lz_dtype dt, int ndim, const int64_t *shape) {
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_wrap(&t, data, dt, ndim, shape));
  return t;
}

double lz_test_rel_err(const float *a, const double *b, int64_t n) {
  double scale = 0.0, worst = 0.0;
  for (int64_t i = 0; i < n; i++) scale = fabs(b[i]) > scale ? fabs(b[i]) : scale;
  for (int64_t i = 0; i < n; i++) {
    double den = fabs(b[i]) > 1e-2 * scale ? fabs(b[i]) : 1e-2 * scale;
    double e = den > 0 ? fabs(a[i] - b[i]) / den : fabs(a[i] - b[i]);
    worst = e > worst ? e : worst;
  }
  return worst;
}
