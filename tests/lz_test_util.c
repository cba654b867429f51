/* lz_test_util.c — random numbers, wrapping and error measures the kernel
 * tests share. */
#include "lz_test.h"

#include <stdio.h>  /* printf */
#include <string.h> /* strncmp */

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

lz_test_operands lz_test_operands_new(int ndim, const int64_t *shape) {
  static float buf[16];
  static int32_t ibuf[16];
  const int64_t s9[1] = {9};
  return (lz_test_operands){
      lz_test_wrap(buf, LZ_F32, ndim, shape), lz_test_wrap(ibuf, LZ_I32, ndim, shape),
      lz_test_wrap(buf, LZ_BF16, ndim, shape), lz_test_wrap(buf, LZ_F32, 1, s9)};
}

void lz_test_operands_free(lz_test_operands *o) {
  lz_tensor_free(o->f32), lz_tensor_free(o->i32), lz_tensor_free(o->bf16);
  lz_tensor_free(o->f32_9);
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

int lz_test_bf16_native(void) {
  const char *what = NULL;
  if (lz_bf16_matmul_path(&what) == LZ_OK && strncmp(what, "native", 6) == 0) return 1;
  printf("    skipped: bf16 GEMMs run widened to fp32 sgemm here (%s); this claim is oneDNN's "
         "bf16 kernels'\n", what ? what : lz_last_error());
  return 0;
}
