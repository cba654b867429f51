/* test_elementwise.c — add, axpy, scale, fill (f32 and half types), sq_norm
 * (against double, and bitwise the same on any thread count), has_inf_nan,
 * errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0x8BB84B93962EACC9ull;
static float frand(void) { return lz_test_uniform(&rng); }

/* Sizes on both sides of the one-thread cutoff, none a multiple of a block. */
static const int64_t sizes[] = {1, 17, 1000, 3 * 65536 + 5};

LZ_TEST(elementwise_add_axpy_scale_fill) {
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    const int64_t n = sizes[k], s1[1] = {n};
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
    float *out = malloc(sizeof(float) * n), *keep = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) a[i] = frand(), b[i] = frand();
    memcpy(keep, a, sizeof(float) * n);
    lz_tensor *ta = lz_test_wrap(a, LZ_F32, 1, s1), *tb = lz_test_wrap(b, LZ_F32, 1, s1);
    lz_tensor *tout = lz_test_wrap(out, LZ_F32, 1, s1);
    int ok = 1;

    CHECK_OK(lz_add(tout, ta, tb));
    for (int64_t i = 0; i < n; i++) ok &= out[i] == a[i] + b[i];
    CHECK_OK(lz_add(ta, ta, tb)); /* out may alias a */
    for (int64_t i = 0; i < n; i++) ok &= a[i] == out[i];
    memcpy(a, keep, sizeof(float) * n);

    CHECK_OK(lz_axpy(ta, 0.5f, tb));
    for (int64_t i = 0; i < n; i++) ok &= a[i] == keep[i] + 0.5f * b[i];
    CHECK_OK(lz_scale(ta, -2.0f));
    for (int64_t i = 0; i < n; i++) ok &= a[i] == -2.0f * (keep[i] + 0.5f * b[i]);
    CHECK_OK(lz_fill(ta, 3.25f));
    for (int64_t i = 0; i < n; i++) ok &= a[i] == 3.25f;
    CHECK(ok);

    lz_tensor_free(ta), lz_tensor_free(tb), lz_tensor_free(tout);
    free(a), free(b), free(out), free(keep);
  }
}

/* Half types: fill writes the rounded pattern, scale rounds each product. */
LZ_TEST(elementwise_half_fill_scale) {
  const int64_t n = 70001, s1[1] = {n};
  uint16_t *h = malloc(sizeof(uint16_t) * n), *keep = malloc(sizeof(uint16_t) * n);
  const lz_dtype dts[2] = {LZ_BF16, LZ_F16};
  for (int d = 0; d < 2; d++) {
    lz_tensor *t = lz_test_wrap(h, dts[d], 1, s1);
    int ok = 1;
    CHECK_OK(lz_fill(t, 1.0f / 3.0f));
    const uint16_t third =
        dts[d] == LZ_BF16 ? lz_f32_to_bf16(1.0f / 3.0f) : lz_f32_to_f16(1.0f / 3.0f);
    for (int64_t i = 0; i < n; i++) ok &= h[i] == third;
    for (int64_t i = 0; i < n; i++)
      h[i] = dts[d] == LZ_BF16 ? lz_f32_to_bf16(frand()) : lz_f32_to_f16(frand());
    memcpy(keep, h, sizeof(uint16_t) * n);
    CHECK_OK(lz_scale(t, 0.3f));
    for (int64_t i = 0; i < n; i++) {
      uint16_t want = dts[d] == LZ_BF16 ? lz_f32_to_bf16(lz_bf16_to_f32(keep[i]) * 0.3f)
                                        : lz_f32_to_f16(lz_f16_to_f32(keep[i]) * 0.3f);
      ok &= h[i] == want;
    }
    CHECK(ok);
    lz_tensor_free(t);
  }
  free(h), free(keep);
}

LZ_TEST(elementwise_sq_norm_against_double) {
  const int64_t n = 2500003, s1[1] = {n};
  float *x = malloc(sizeof(float) * n);
  uint16_t *hb = malloc(sizeof(uint16_t) * n), *hf = malloc(sizeof(uint16_t) * n);
  double ref = 0.0, ref_b = 0.0, ref_f = 0.0;
  for (int64_t i = 0; i < n; i++) {
    x[i] = frand();
    hb[i] = lz_f32_to_bf16(x[i]);
    hf[i] = lz_f32_to_f16(x[i]);
    ref += (double)x[i] * x[i];
    ref_b += (double)lz_bf16_to_f32(hb[i]) * lz_bf16_to_f32(hb[i]);
    ref_f += (double)lz_f16_to_f32(hf[i]) * lz_f16_to_f32(hf[i]);
  }
  lz_tensor *t = lz_test_wrap(x, LZ_F32, 1, s1), *tb = lz_test_wrap(hb, LZ_BF16, 1, s1);
  lz_tensor *tf = lz_test_wrap(hf, LZ_F16, 1, s1);
  double got = -1.0;
  CHECK_OK(lz_sq_norm(t, &got));
  CHECK_NEAR(got, ref, 1e-10); /* both sum in double, in different orders */
  CHECK_OK(lz_sq_norm(tb, &got));
  CHECK_NEAR(got, ref_b, 1e-10);
  CHECK_OK(lz_sq_norm(tf, &got));
  CHECK_NEAR(got, ref_f, 1e-10);
  const int64_t s0[1] = {0};
  lz_tensor *empty = lz_test_wrap(x, LZ_F32, 1, s0);
  CHECK_OK(lz_sq_norm(empty, &got));
  CHECK(got == 0.0);
  lz_tensor_free(t), lz_tensor_free(tb), lz_tensor_free(tf), lz_tensor_free(empty);
  free(x), free(hb), free(hf);
}

/* The gradient norm decides clipping, so every rank and every thread count
 * must see the same bits. Values of very different sizes make the sum order
 * visible in the last bits. */
LZ_TEST(elementwise_sq_norm_thread_independent) {
  const int64_t n = 3 * 1048576 + 12345, s1[1] = {n};
  float *x = malloc(sizeof(float) * n);
  for (int64_t i = 0; i < n; i++) x[i] = frand() * (i % 7 == 0 ? 1e3f : 1e-2f);
  lz_tensor *t = lz_test_wrap(x, LZ_F32, 1, s1);
  const int saved = lz_threads_get();
  double got[3];
  for (int k = 0; k < 3; k++) {
    CHECK_OK(lz_threads_set(k + 1));
    CHECK_OK(lz_sq_norm(t, &got[k]));
  }
  lz_threads_set(saved);
  CHECK(memcmp(&got[0], &got[1], sizeof(double)) == 0);
  CHECK(memcmp(&got[0], &got[2], sizeof(double)) == 0);
  lz_tensor_free(t);
  free(x);
}

/* sq_norm's documented order, written out: blocks of 4,096 elements, each
 * summed in 8 lanes (element i into lane i % 8, in order), the lanes added
 * 0 to 7, then the block's tail; the blocks' sums added in order. The fast
 * path (four blocks at once) must give these bits exactly, for every count
 * of whole and partial blocks. */
static double sq_norm_by_the_order(const float *x, int64_t n) {
  double total = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += 4096) {
    const int64_t len = n - i0 < 4096 ? n - i0 : 4096;
    double acc[8] = {0}, s = 0.0;
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      for (int l = 0; l < 8; l++) acc[l] += (double)x[i0 + i + l] * (double)x[i0 + i + l];
    for (int l = 0; l < 8; l++) s += acc[l];
    for (; i < len; i++) s += (double)x[i0 + i] * (double)x[i0 + i];
    total += s;
  }
  return total;
}

LZ_TEST(elementwise_sq_norm_is_its_documented_order) {
  const int64_t ns[] = {4096 * 4, 4096 * 4 + 1, 4096 * 7 + 77, 4096 * 12 + 4096 * 2 + 5,
                        41 * 4096 + 3, 65536 * 4 + 4096 * 3 + 9};
  for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
    const int64_t n = ns[k], s1[1] = {n};
    float *x = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) x[i] = frand() * (i % 5 == 0 ? 3e3f : i % 3 ? 1e-3f : 1.0f);
    lz_tensor *t = lz_test_wrap(x, LZ_F32, 1, s1);
    const double want = sq_norm_by_the_order(x, n);
    const int saved = lz_threads_get();
    for (int th = 1; th <= 2; th++) {
      double got = -1.0;
      CHECK_OK(lz_threads_set(th));
      CHECK_OK(lz_sq_norm(t, &got));
      CHECK(memcmp(&got, &want, sizeof got) == 0);
    }
    lz_threads_set(saved);
    lz_tensor_free(t);
    free(x);
  }
}

/* add_sq_norm: the bits of axpy(y, 1, x) (or a copy of x) and sq_norm(y),
 * the squares in the same blocks (several, and on threads, from 8 on). */
LZ_TEST(elementwise_add_sq_norm_is_axpy_then_sq_norm) {
  const int64_t more[] = {1, 17, 4096, 4097, 3 * 65536 + 5, 41 * 4096 + 3};
  for (size_t k = 0; k < sizeof more / sizeof more[0]; k++) {
    const int64_t n = more[k], s1[1] = {n};
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    float *y2 = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i += 997) x[i] = frand(), y[i] = frand();
    for (int64_t i = 0; i < n; i++)
      if (i % 997) x[i] = x[i - i % 997] * 0.5f, y[i] = y[i - i % 997] * 0.25f;
    lz_tensor *tx = lz_test_wrap(x, LZ_F32, 1, s1), *ty = lz_test_wrap(y, LZ_F32, 1, s1);
    lz_tensor *ty2 = lz_test_wrap(y2, LZ_F32, 1, s1);
    for (int write = 0; write < 2; write++) {
      memcpy(y2, y, sizeof(float) * n);
      double want = 0.0, got = -1.0;
      if (write) CHECK_OK(lz_tensor_copy(ty, tx));
      else CHECK_OK(lz_axpy(ty, 1.0f, tx));
      CHECK_OK(lz_sq_norm(ty, &want));
      CHECK_OK(lz_add_sq_norm(ty2, tx, write, &got));
      CHECK(memcmp(y, y2, sizeof(float) * n) == 0);
      CHECK(memcmp(&want, &got, sizeof want) == 0);
      memcpy(y, y2, sizeof(float) * n);
    }
    lz_tensor_free(tx), lz_tensor_free(ty), lz_tensor_free(ty2);
    free(x), free(y), free(y2);
  }
}

LZ_TEST(elementwise_has_inf_nan) {
  const int64_t n = 100003, s1[1] = {n};
  float *x = malloc(sizeof(float) * n);
  uint16_t *h = malloc(sizeof(uint16_t) * n);
  const int64_t where[3] = {0, 65537, n - 1};
  /* f32 */
  lz_tensor *t = lz_test_wrap(x, LZ_F32, 1, s1);
  for (int64_t i = 0; i < n; i++) x[i] = 3.0e38f * frand(); /* big, but finite */
  int found = -1;
  CHECK_OK(lz_has_inf_nan(t, &found));
  CHECK(found == 0);
  const float bad[3] = {NAN, INFINITY, -INFINITY};
  for (int w = 0; w < 3; w++)
    for (int b = 0; b < 3; b++) {
      float keep = x[where[w]];
      x[where[w]] = bad[b];
      CHECK_OK(lz_has_inf_nan(t, &found));
      CHECK(found == 1);
      x[where[w]] = keep;
    }
  lz_tensor_free(t);
  /* bf16, f16: largest finite values are not flagged, Inf and NaN are. */
  const lz_dtype dts[2] = {LZ_BF16, LZ_F16};
  const uint16_t max_finite[2] = {0x7f7f, 0x7bff}, inf[2] = {0x7f80, 0x7c00},
                 nan[2] = {0x7fc1, 0x7e01};
  for (int d = 0; d < 2; d++) {
    lz_tensor *th = lz_test_wrap(h, dts[d], 1, s1);
    for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)(max_finite[d] | (i & 1 ? 0x8000 : 0));
    CHECK_OK(lz_has_inf_nan(th, &found));
    CHECK(found == 0);
    for (int w = 0; w < 3; w++) {
      uint16_t keep = h[where[w]];
      h[where[w]] = (uint16_t)(inf[d] | 0x8000);
      CHECK_OK(lz_has_inf_nan(th, &found));
      CHECK(found == 1);
      h[where[w]] = nan[d];
      CHECK_OK(lz_has_inf_nan(th, &found));
      CHECK(found == 1);
      h[where[w]] = keep;
    }
    lz_tensor_free(th);
  }
  free(x), free(h);
}

LZ_TEST(elementwise_errors) {
  const int64_t s8[2] = {2, 4};
  lz_test_operands o = lz_test_operands_new(2, s8);
  lz_tensor *a = o.f32, *b9 = o.f32_9, *ai = o.i32, *ah = o.bf16;
  double d;
  int flag;
  CHECK_ERR(lz_add(a, a, b9), LZ_ERR_INVALID,
            "add: b is f32[9] (9 elements), expected 8 elements (the element count of a)");
  CHECK_ERR(lz_add(b9, a, a), LZ_ERR_INVALID, "add: out is f32[9]");
  CHECK_ERR(lz_add(a, ah, a), LZ_ERR_INVALID, "add: a is bf16[2,4], expected dtype f32");
  CHECK_ERR(lz_axpy(a, 1.0f, b9), LZ_ERR_INVALID, "axpy: x is f32[9]");
  CHECK_ERR(lz_axpy(ah, 1.0f, a), LZ_ERR_INVALID, "axpy: y is bf16[2,4], expected dtype f32");
  CHECK_ERR(lz_scale(ai, 2.0f), LZ_ERR_INVALID, "scale: t is i32[2,4], expected dtype f32, "
                                                "bf16 or f16");
  CHECK_ERR(lz_fill(ai, 2.0f), LZ_ERR_INVALID, "fill: t is i32[2,4]");
  CHECK_ERR(lz_fill(NULL, 2.0f), LZ_ERR_INVALID, "fill: t is missing");
  CHECK_ERR(lz_sq_norm(ai, &d), LZ_ERR_INVALID, "sq_norm: t is i32[2,4]");
  CHECK_ERR(lz_sq_norm(a, NULL), LZ_ERR_INVALID, "sq_norm: out is NULL");
  CHECK_ERR(lz_has_inf_nan(ai, &flag), LZ_ERR_INVALID, "has_inf_nan: t is i32[2,4]");
  CHECK_ERR(lz_has_inf_nan(a, NULL), LZ_ERR_INVALID, "has_inf_nan: out is NULL");
  lz_test_operands_free(&o);
}
