/* test_gelu.c — GELU (tanh approximation) forward against a double
 * reference, backward against central differences of it, aliasing, errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) { return lz_test_uniform(&rng); }

static double ref_gelu(double x) {
  const double k = sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
}

/* Inputs over the range activations take, plus tails where tanh saturates. */
static void fill_inputs(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = 4.0f * frand();
  if (n >= 6) x[0] = 12.0f, x[1] = -12.0f, x[2] = 0.0f, x[3] = -0.75f, x[4] = 1e-20f,
              x[5] = -30.0f;
}

static void check_case(int64_t n) {
  float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
  float *dy = malloc(sizeof(float) * n), *dx = malloc(sizeof(float) * n);
  double *ref = malloc(sizeof(double) * n);
  fill_inputs(x, n);
  for (int64_t i = 0; i < n; i++) dy[i] = frand();
  const int64_t shape[2] = {n / 4, 4};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 2, shape), *tout = lz_test_wrap(out, LZ_F32, 2, shape);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 2, shape), *tdx = lz_test_wrap(dx, LZ_F32, 2, shape);

  CHECK_OK(lz_gelu_forward(tout, tx));
  for (int64_t i = 0; i < n; i++) ref[i] = ref_gelu(x[i]);
  CHECK(lz_test_rel_err(out, ref, n) <= 1e-5);
  CHECK(out[0] == 12.0f && out[1] == 0.0f && out[2] == 0.0f);

  /* L = sum(gelu(x) * dy): dL/dx_i depends on x_i alone, so the central
   * difference of the full loss is that of its i-th term. */
  CHECK_OK(lz_gelu_backward(tdx, tdy, tx));
  const double h = 1e-5;
  for (int64_t i = 0; i < n; i++)
    ref[i] = (ref_gelu((double)x[i] + h) - ref_gelu((double)x[i] - h)) / (2 * h) * dy[i];
  CHECK(lz_test_rel_err(dx, ref, n) <= 1e-3);

  lz_tensor_free(tx), lz_tensor_free(tout), lz_tensor_free(tdy), lz_tensor_free(tdx);
  free(x), free(out), free(dy), free(dx), free(ref);
}

LZ_TEST(gelu_small_against_reference) { check_case(4 * 37); }
LZ_TEST(gelu_large_against_reference) { check_case(4 * 50001); } /* threaded path */

/* out may be x, dx may be dy: the same numbers as out of place. */
LZ_TEST(gelu_in_place) {
  enum { N = 1000 };
  float x[N], y[N], dy[N], dx[N], buf[N];
  fill_inputs(x, N);
  for (int i = 0; i < N; i++) dy[i] = frand();
  const int64_t shape[1] = {N};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 1, shape), *ty = lz_test_wrap(y, LZ_F32, 1, shape);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 1, shape), *tdx = lz_test_wrap(dx, LZ_F32, 1, shape);
  lz_tensor *tbuf = lz_test_wrap(buf, LZ_F32, 1, shape);
  CHECK_OK(lz_gelu_forward(ty, tx));
  memcpy(buf, x, sizeof x);
  CHECK_OK(lz_gelu_forward(tbuf, tbuf));
  CHECK(memcmp(buf, y, sizeof y) == 0);
  CHECK_OK(lz_gelu_backward(tdx, tdy, tx));
  memcpy(buf, dy, sizeof dy);
  CHECK_OK(lz_gelu_backward(tbuf, tbuf, tx));
  CHECK(memcmp(buf, dx, sizeof dx) == 0);
  lz_tensor_free(tx), lz_tensor_free(ty), lz_tensor_free(tdy), lz_tensor_free(tdx);
  lz_tensor_free(tbuf);
}

/* A NaN must come out as NaN (the loss scaler looks for it), Inf as Inf;
 * huge inputs saturate cleanly. */
LZ_TEST(gelu_nan_inf) {
  float x[4] = {NAN, INFINITY, -1e30f, 1e30f}, y[4];
  const int64_t shape[1] = {4};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 1, shape), *ty = lz_test_wrap(y, LZ_F32, 1, shape);
  CHECK_OK(lz_gelu_forward(ty, tx));
  CHECK(isnan(y[0]));
  CHECK(y[1] == INFINITY);
  CHECK(y[2] == 0.0f); /* tanh saturates to exactly -1 */
  CHECK(y[3] == 1e30f);
  lz_tensor_free(tx), lz_tensor_free(ty);
}

LZ_TEST(gelu_errors) {
  const int64_t s8[2] = {2, 4};
  lz_test_operands o = lz_test_operands_new(2, s8);
  lz_tensor *x = o.f32, *y9 = o.f32_9, *xi = o.i32;
  CHECK_ERR(lz_gelu_forward(y9, x), LZ_ERR_INVALID, "gelu_forward: out is f32[9] but x is "
                                                    "f32[2,4]");
  CHECK_ERR(lz_gelu_forward(x, xi), LZ_ERR_INVALID, "gelu_forward: x is i32[2,4], expected "
                                                    "dtype f32");
  CHECK_ERR(lz_gelu_forward(NULL, x), LZ_ERR_INVALID, "gelu_forward: out is missing");
  CHECK_ERR(lz_gelu_backward(x, y9, x), LZ_ERR_INVALID, "gelu_backward: dy is f32[9]");
  CHECK_ERR(lz_gelu_backward(y9, x, x), LZ_ERR_INVALID, "gelu_backward: dx is f32[9]");
  lz_test_operands_free(&o);
}
