/* test_cross_entropy.c — softmax cross-entropy: forward against a double
 * reference, backward against central differences of it, padded vocabulary,
 * ignored targets, aliasing, large logits, errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0xA0761D6478BD642Full;
static uint64_t next_u64(void) { return lz_test_xorshift(&rng); }
static float frand(void) { return lz_test_uniform(&rng); }

/* -log softmax(row[0:vocab])[target], or 0 for a negative target. */
static double ref_row_loss(const double *row, int64_t vocab, int32_t target) {
  if (target < 0) return 0.0;
  double m = row[0], s = 0.0;
  for (int64_t i = 1; i < vocab; i++) m = row[i] > m ? row[i] : m;
  for (int64_t i = 0; i < vocab; i++) s += exp(row[i] - m);
  return log(s) + m - row[target];
}

/* Runs forward and backward on B*T rows of Vp logits (vocab real ones) at
 * the given logit scale; checks every `stride`-th gradient entry and the
 * target entries (a central difference costs two row losses). */
static void check_case(int64_t B, int64_t T, int64_t Vp, int64_t vocab, float scale,
                       int64_t stride) {
  const int64_t rows = B * T, n = rows * Vp;
  const float dloss = 1.0f / (float)rows;
  float *logits = malloc(sizeof(float) * n), *dlogits = malloc(sizeof(float) * n);
  float *losses = malloc(sizeof(float) * rows), *ga = malloc(sizeof(float) * n);
  double *ld = malloc(sizeof(double) * n), *gd = malloc(sizeof(double) * n);
  double *ref = malloc(sizeof(double) * rows);
  int32_t *targets = malloc(sizeof(int32_t) * rows);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < Vp; i++)
      /* Padding holds big numbers: if it took part, it would dominate. */
      logits[r * Vp + i] = i < vocab ? scale * frand() : 50.0f + scale;
  for (int64_t r = 0; r < rows; r++) targets[r] = (int32_t)(next_u64() % (uint64_t)vocab);
  targets[0] = (int32_t)vocab - 1;
  if (rows > 2) targets[2] = -1; /* ignored */
  for (int64_t i = 0; i < n; i++) ld[i] = logits[i];

  const int64_t s_lg[3] = {B, T, Vp}, s_bt[2] = {B, T};
  lz_tensor *tl = lz_test_wrap(logits, LZ_F32, 3, s_lg), *tdl = lz_test_wrap(dlogits, LZ_F32, 3, s_lg);
  lz_tensor *tloss = lz_test_wrap(losses, LZ_F32, 2, s_bt), *tt = lz_test_wrap(targets, LZ_I32, 2, s_bt);

  CHECK_OK(lz_cross_entropy_forward(tloss, tl, tt, vocab));
  for (int64_t r = 0; r < rows; r++) ref[r] = ref_row_loss(ld + r * Vp, vocab, targets[r]);
  CHECK(lz_test_rel_err(losses, ref, rows) <= 1e-5);
  if (rows > 2) CHECK(losses[2] == 0.0f);

  /* L = dloss * sum of the row losses. */
  CHECK_OK(lz_cross_entropy_backward(tdl, tl, tt, vocab, dloss));
  int64_t k = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t r = i / Vp, c = i % Vp;
    if (c >= vocab || (i % stride != 0 && c != targets[r])) continue; /* targets always */
    const double h = 1e-5, keep = ld[i];
    double *row = ld + r * Vp;
    ld[i] = keep + h;
    double up = ref_row_loss(row, vocab, targets[r]);
    ld[i] = keep - h;
    double down = ref_row_loss(row, vocab, targets[r]);
    ld[i] = keep;
    ga[k] = dlogits[i];
    gd[k++] = (up - down) / (2 * h) * dloss;
  }
  CHECK(lz_test_rel_err(ga, gd, k) <= 1e-3);
  /* Padded columns and ignored rows: exactly zero. */
  int zeros = 1;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = vocab; c < Vp; c++) zeros &= dlogits[r * Vp + c] == 0.0f;
  if (rows > 2)
    for (int64_t c = 0; c < Vp; c++) zeros &= dlogits[2 * Vp + c] == 0.0f;
  CHECK(zeros);

  /* dlogits may be logits. */
  CHECK_OK(lz_cross_entropy_backward(tl, tl, tt, vocab, dloss));
  CHECK(memcmp(logits, dlogits, sizeof(float) * n) == 0);

  lz_tensor_free(tl), lz_tensor_free(tdl), lz_tensor_free(tloss), lz_tensor_free(tt);
  free(logits), free(dlogits), free(losses), free(ga), free(ld), free(gd), free(ref);
  free(targets);
}

LZ_TEST(cross_entropy_small_against_reference) { check_case(2, 3, 13, 11, 3.0f, 1); }

/* GPT-2's padded vocabulary, threaded. */
LZ_TEST(cross_entropy_large_against_reference) { check_case(2, 8, 50304, 50257, 5.0f, 4001); }

/* Logits in the thousands: subtracting the row maximum keeps exp finite. */
LZ_TEST(cross_entropy_large_logits) { check_case(1, 4, 37, 37, 2000.0f, 1); }

/* A NaN logit makes its row's loss and gradient NaN, not a quiet number. */
/* A bf16 dlogits holds bitwise the f32 gradients converted to bf16, padded
 * columns and an ignored row included; it may not alias the logits. */
LZ_TEST(cross_entropy_backward_bf16_is_the_converted_f32) {
  enum { R = 5, Vp = 1000, V = 987 };
  float *logits = malloc(sizeof(float) * R * Vp), *df = malloc(sizeof(float) * R * Vp);
  uint16_t *db = malloc(sizeof(uint16_t) * R * Vp), *want = malloc(sizeof(uint16_t) * R * Vp);
  int32_t tg[R] = {3, 986, -100, 0, 500};
  for (int i = 0; i < R * Vp; i++) logits[i] = 4.0f * frand();
  const int64_t s_l[2] = {R, Vp}, s_t[1] = {R};
  lz_tensor *tl = lz_test_wrap(logits, LZ_F32, 2, s_l), *tf = lz_test_wrap(df, LZ_F32, 2, s_l);
  lz_tensor *tb = lz_test_wrap(db, LZ_BF16, 2, s_l), *tw = lz_test_wrap(want, LZ_BF16, 2, s_l);
  lz_tensor *tt = lz_test_wrap(tg, LZ_I32, 1, s_t);
  CHECK_OK(lz_cross_entropy_backward(tf, tl, tt, V, 0.125f));
  CHECK_OK(lz_tensor_copy(tw, tf));
  CHECK_OK(lz_cross_entropy_backward(tb, tl, tt, V, 0.125f));
  CHECK(memcmp(db, want, sizeof(uint16_t) * R * Vp) == 0);
  lz_tensor *alias = lz_test_wrap(logits, LZ_BF16, 2, s_l);
  CHECK_ERR(lz_cross_entropy_backward(alias, tl, tt, V, 0.125f), LZ_ERR_INVALID,
            "are the same memory");
  lz_tensor *ts[] = {tl, tf, tb, tw, tt, alias};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(logits), free(df), free(db), free(want);
}

LZ_TEST(cross_entropy_nan_propagates) {
  float lg[2 * 5] = {0.1f, 0.2f, NAN, 0.4f, 0.5f, 1, 2, 3, 4, 5}, loss[2], dl[2 * 5];
  int32_t tg[2] = {0, 4};
  const int64_t s_lg[2] = {2, 5}, s_r[1] = {2};
  lz_tensor *tl = lz_test_wrap(lg, LZ_F32, 2, s_lg), *tdl = lz_test_wrap(dl, LZ_F32, 2, s_lg);
  lz_tensor *tloss = lz_test_wrap(loss, LZ_F32, 1, s_r), *tt = lz_test_wrap(tg, LZ_I32, 1, s_r);
  CHECK_OK(lz_cross_entropy_forward(tloss, tl, tt, 5));
  CHECK(isnan(loss[0]) && isfinite(loss[1]));
  CHECK_OK(lz_cross_entropy_backward(tdl, tl, tt, 5, 1.0f));
  CHECK(isnan(dl[0]) && isnan(dl[4]) && isfinite(dl[5]));
  lz_tensor_free(tl), lz_tensor_free(tdl), lz_tensor_free(tloss), lz_tensor_free(tt);
}

LZ_TEST(cross_entropy_errors) {
  float lg[2 * 3 * 8] = {0}, loss[6] = {0};
  int32_t tg[6] = {0, 1, 2, 3, 4, 5};
  const int64_t s_lg[3] = {2, 3, 8}, s_bt[2] = {2, 3}, s5[1] = {5};
  lz_tensor *tl = lz_test_wrap(lg, LZ_F32, 3, s_lg), *tloss = lz_test_wrap(loss, LZ_F32, 2, s_bt);
  lz_tensor *tt = lz_test_wrap(tg, LZ_I32, 2, s_bt), *tt_f = lz_test_wrap(loss, LZ_F32, 2, s_bt);
  lz_tensor *tloss5 = lz_test_wrap(loss, LZ_F32, 1, s5), *tt5 = lz_test_wrap(tg, LZ_I32, 1, s5);
  CHECK_OK(lz_cross_entropy_forward(tloss, tl, tt, 6));
  CHECK_ERR(lz_cross_entropy_forward(tloss, tl, tt, 5), LZ_ERR_INVALID,
            "cross_entropy_forward: targets[5] is 5, not below vocab 5");
  CHECK_ERR(lz_cross_entropy_backward(tl, tl, tt, 5, 1.0f), LZ_ERR_INVALID,
            "cross_entropy_backward: targets[5] is 5, not below vocab 5");
  CHECK_ERR(lz_cross_entropy_forward(tloss, tl, tt, 9), LZ_ERR_INVALID,
            "cross_entropy_forward: vocab is 9 but logits is f32[2,3,8]; vocab must be 1..8");
  CHECK_ERR(lz_cross_entropy_forward(tloss, tl, tt, 0), LZ_ERR_INVALID, "vocab is 0");
  CHECK_ERR(lz_cross_entropy_forward(tloss, tl, tt_f, 8), LZ_ERR_INVALID,
            "cross_entropy_forward: targets is f32[2,3], expected dtype i32");
  CHECK_ERR(lz_cross_entropy_forward(tloss, tl, tt5, 8), LZ_ERR_INVALID,
            "cross_entropy_forward: targets is i32[5] (5 elements), expected 6 elements (one "
            "per row of logits)");
  CHECK_ERR(lz_cross_entropy_forward(tloss5, tl, tt, 8), LZ_ERR_INVALID,
            "cross_entropy_forward: losses is f32[5]");
  CHECK_ERR(lz_cross_entropy_backward(tloss, tl, tt, 8, 1.0f), LZ_ERR_INVALID,
            "cross_entropy_backward: dlogits is f32[2,3] but logits is f32[2,3,8]");
  lz_tensor_free(tl), lz_tensor_free(tloss), lz_tensor_free(tt), lz_tensor_free(tt_f);
  lz_tensor_free(tloss5), lz_tensor_free(tt5);
}
