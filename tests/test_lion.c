/* test_lion.c — fused Lion: hand-computed elements, sign(0), a scalar
 * reference over several steps, working copies (f32, bf16, f16), errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0xD1B54A32D192ED03ull;
static float frand(void) { return lz_test_uniform(&rng); }

/* Values whose every product and sum is exact in fp32: b1 1/2, b2 3/4,
 * lr 1/4, wd 1/2 (decay 7/8), grad_scale 2. */
LZ_TEST(lion_hand_computed) {
  const int64_t s4[1] = {4};
  float p[4] = {1.0f, -2.0f, 0.5f, 4.0f}, m[4] = {0.0f, 1.0f, -1.0f, 0.25f};
  float g[4] = {0.5f, -1.0f, 0.5f, 0.0f};
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s4), *tg = lz_test_wrap(g, LZ_F32, 1, s4);
  lz_tensor *tm = lz_test_wrap(m, LZ_F32, 1, s4);
  const lz_lion_args args = {
      .lr = 0.25f, .beta1 = 0.5f, .beta2 = 0.75f, .weight_decay = 0.5f, .grad_scale = 2.0f};
  CHECK_OK(lz_lion_step(tp, tg, tm, NULL, &args));
  /* g = 2 grad; c = m/2 + g/2: 0.5, -0.5, 0 (sign 0: decay only), 0.125. */
  const float want_p[4] = {0.625f, -1.5f, 0.4375f, 3.25f};
  const float want_m[4] = {0.25f, 0.25f, -0.5f, 0.1875f};
  for (int i = 0; i < 4; i++) {
    CHECK(p[i] == want_p[i]);
    CHECK(m[i] == want_m[i]);
  }
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm);
}

/* No decay and nothing to follow (m = 0, grad = 0): sign(0) is 0, so the
 * parameters stay bitwise as they were; the step itself is lr exactly. */
LZ_TEST(lion_sign_zero_and_no_decay) {
  const int64_t s3[1] = {3};
  float p[3] = {0.1f, -3.0f, 0.0f}, m[3] = {0}, g[3] = {0.0f, -0.0f, 1.0f};
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s3), *tg = lz_test_wrap(g, LZ_F32, 1, s3);
  lz_tensor *tm = lz_test_wrap(m, LZ_F32, 1, s3);
  const lz_lion_args args = {
      .lr = 0.5f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.0f, .grad_scale = 1.0f};
  CHECK_OK(lz_lion_step(tp, tg, tm, NULL, &args));
  CHECK(p[0] == 0.1f);
  CHECK(p[1] == -3.0f);
  CHECK(p[2] == -0.5f);
  CHECK(m[0] == 0.0f && m[1] == 0.0f);
  CHECK(m[2] == (float)(1.0 - (double)0.99f));
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm);
}

/* The update in fp32, each operation rounded on its own (as the kernel
 * does it), one element. */
__attribute__((optimize("fp-contract=off"))) static void ref_step(float *p, float *m, float grad,
                                                                  const lz_lion_args *a) {
  const float decay = (float)(1.0 - (double)a->lr * a->weight_decay);
  const float omb1 = (float)(1.0 - (double)a->beta1), omb2 = (float)(1.0 - (double)a->beta2);
  float g = grad * a->grad_scale;
  float c = a->beta1 * *m + omb1 * g;
  float sign = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : 0.0f;
  *p = *p * decay - a->lr * sign;
  *m = a->beta2 * *m + omb2 * g;
}

/* Five steps on n elements with the working copy in `wdt` (or none): param
 * and m bitwise the reference's, the working copy the rounded param. */
static void check_case(int64_t n, int with_working, lz_dtype wdt, const lz_lion_args *args) {
  const int64_t s1[1] = {n};
  float *p = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
  float *m = malloc(sizeof(float) * n), *wf = malloc(sizeof(float) * n);
  float *pr = malloc(sizeof(float) * n), *mr = malloc(sizeof(float) * n);
  uint16_t *wh = malloc(sizeof(uint16_t) * n);
  for (int64_t i = 0; i < n; i++) p[i] = pr[i] = frand(), m[i] = mr[i] = 0.0f;
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s1), *tg = lz_test_wrap(g, LZ_F32, 1, s1);
  lz_tensor *tm = lz_test_wrap(m, LZ_F32, 1, s1);
  lz_tensor *tw = !with_working   ? NULL
                  : wdt == LZ_F32 ? lz_test_wrap(wf, LZ_F32, 1, s1)
                                  : lz_test_wrap(wh, wdt, 1, s1);
  for (int step = 1; step <= 5; step++) {
    /* Gradients of mixed sizes, some zero (c = 0 at the first step). */
    for (int64_t i = 0; i < n; i++) g[i] = i % 11 == 0 ? 0.0f : frand() * (i % 3 ? 1.0f : 1e-3f);
    CHECK_OK(lz_lion_step(tp, tg, tm, tw, args));
    for (int64_t i = 0; i < n; i++) ref_step(&pr[i], &mr[i], g[i], args);
  }
  CHECK(memcmp(p, pr, sizeof(float) * n) == 0);
  CHECK(memcmp(m, mr, sizeof(float) * n) == 0);
  int moved = 0;
  for (int64_t i = 0; i < n; i++) moved += p[i] != lz_bf16_to_f32(lz_f32_to_bf16(p[i]));
  CHECK(moved > 0); /* the working-copy check below is not of values already rounded */
  if (with_working) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) {
      if (wdt == LZ_F32)
        ok &= wf[i] == p[i];
      else if (wdt == LZ_BF16)
        ok &= wh[i] == lz_f32_to_bf16(p[i]);
      else
        ok &= wh[i] == lz_f32_to_f16(p[i]);
    }
    CHECK(ok);
  }
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tw);
  free(p), free(g), free(m), free(wf), free(pr), free(mr), free(wh);
}

static const lz_lion_args typical = {
    .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f, .grad_scale = 0.5f};

LZ_TEST(lion_against_reference) { check_case(1001, 0, LZ_F32, &typical); }
LZ_TEST(lion_no_decay_large_scale) {
  const lz_lion_args a = {
      .lr = 3e-2f, .beta1 = 0.95f, .beta2 = 0.98f, .weight_decay = 0.0f, .grad_scale = 8.0f};
  check_case(1001, 0, LZ_F32, &a);
}
LZ_TEST(lion_working_f32) { check_case(1001, 1, LZ_F32, &typical); }
LZ_TEST(lion_working_bf16) { check_case(100003, 1, LZ_BF16, &typical); } /* threaded */
LZ_TEST(lion_working_f16) { check_case(100003, 1, LZ_F16, &typical); }

LZ_TEST(lion_errors) {
  const int64_t s8[1] = {8}, s9[1] = {9};
  lz_test_operands o = lz_test_operands_new(1, s8);
  lz_tensor *t = o.f32, *t9 = o.f32_9, *ti = o.i32, *th = o.bf16;
  const lz_lion_args good = {
      .lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.0f, .grad_scale = 1.0f};
  lz_lion_args a = good;
  /* The failing calls pass one tensor for all three: they stop before
   * touching data. */
  CHECK_ERR(lz_lion_step(t, t9, t, NULL, &a), LZ_ERR_INVALID,
            "lion_step: grad is f32[9] (9 elements), expected 8 elements (the element count "
            "of param)");
  CHECK_ERR(lz_lion_step(t, t, t9, NULL, &a), LZ_ERR_INVALID, "lion_step: m is f32[9]");
  CHECK_ERR(lz_lion_step(t, t, ti, NULL, &a), LZ_ERR_INVALID,
            "lion_step: m is i32[8], expected dtype f32");
  CHECK_ERR(lz_lion_step(th, t, t, NULL, &a), LZ_ERR_INVALID,
            "lion_step: param is bf16[8], expected dtype f32");
  CHECK_ERR(lz_lion_step(t, t, t, ti, &a), LZ_ERR_INVALID,
            "lion_step: working is i32[8], expected dtype f32, bf16 or f16");
  CHECK_ERR(lz_lion_step(t, t, t, t9, &a), LZ_ERR_INVALID, "lion_step: working is f32[9]");
  CHECK_ERR(lz_lion_step(t, t, t, NULL, NULL), LZ_ERR_INVALID, "lion_step: args is NULL");
  a = good, a.beta1 = 1.0f;
  CHECK_ERR(lz_lion_step(t, t, t, NULL, &a), LZ_ERR_INVALID,
            "lion_step: args->beta1 is 1; it must be in [0, 1)");
  a = good, a.beta2 = NAN;
  CHECK_ERR(lz_lion_step(t, t, t, NULL, &a), LZ_ERR_INVALID, "args->beta2 is nan");
  a = good, a.lr = -1.0f;
  CHECK_ERR(lz_lion_step(t, t, t, NULL, &a), LZ_ERR_INVALID,
            "lion_step: args->lr is -1; it must be finite and >= 0");
  a = good, a.weight_decay = INFINITY;
  CHECK_ERR(lz_lion_step(t, t, t, NULL, &a), LZ_ERR_INVALID, "args->weight_decay is inf");
  a = good, a.grad_scale = NAN;
  CHECK_ERR(lz_lion_step(t, t, t, NULL, &a), LZ_ERR_INVALID,
            "lion_step: args->grad_scale is nan; it must be finite");
  /* A tensor marked as living on cuda (no memory there is touched). */
  t9->device = LZ_CUDA;
  lz_tensor *tc = t9;
  float pb[9] = {0}, gb[9] = {0}, mb[9] = {0};
  lz_tensor *tp = lz_test_wrap(pb, LZ_F32, 1, s9), *tg = lz_test_wrap(gb, LZ_F32, 1, s9);
  lz_tensor *tm = lz_test_wrap(mb, LZ_F32, 1, s9);
  CHECK_ERR(lz_lion_step(tp, tg, tc, NULL, &good), LZ_ERR_INVALID,
            "lion_step: param lives on cpu but m lives on cuda");
  tc->device = LZ_CPU;
  CHECK_OK(lz_lion_step(tp, tg, tm, NULL, &good));
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm);
  lz_test_operands_free(&o);
}
