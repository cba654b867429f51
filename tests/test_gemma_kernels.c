/* test_gemma_kernels.c — Gemma's GeGLU (gelu_tanh(gate) * up), soft-capping
 * (cap tanh(x / cap)) and the cross-entropy backward through a soft-cap:
 * forward against double references, backward against central differences
 * of the references, bf16 inputs as their widened f32, errors. */
#include "lz_test.h"

#include <math.h>   /* tanh */
#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) { return lz_test_uniform(&rng); }

static double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

/* ------------------------------------------------------------------ GeGLU */

/* L = sum(gelu(g) * u * dy); dL/dg and dL/du by central differences. */
static double geglu_loss(const double *g, const double *u, const double *dy, int64_t n) {
  double loss = 0.0;
  for (int64_t i = 0; i < n; i++) loss += gelu_tanh(g[i]) * u[i] * dy[i];
  return loss;
}

static void geglu_case(int64_t n) {
  float *g = malloc(sizeof(float) * n), *u = malloc(sizeof(float) * n);
  float *out = malloc(sizeof(float) * n), *dy = malloc(sizeof(float) * n);
  float *dg = malloc(sizeof(float) * n), *du = malloc(sizeof(float) * n);
  double *gd = malloc(sizeof(double) * n), *ud = malloc(sizeof(double) * n);
  double *dyd = malloc(sizeof(double) * n), *outd = malloc(sizeof(double) * n);
  double *dgd = malloc(sizeof(double) * n), *dud = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i++) g[i] = 6.0f * frand(), u[i] = frand(), dy[i] = frand();
  g[0] = 30.0f, g[1] = -30.0f, g[2] = 0.0f; /* saturated tails and the middle */
  for (int64_t i = 0; i < n; i++) gd[i] = g[i], ud[i] = u[i], dyd[i] = dy[i];
  for (int64_t i = 0; i < n; i++) outd[i] = gelu_tanh(gd[i]) * ud[i];
  const double h = 1e-5;
  for (int64_t i = 0; i < n; i++) {
    /* each term holds one element: its own difference is the gradient */
    const double g1 = gd[i];
    dgd[i] = (geglu_loss((double[]){g1 + h}, &ud[i], &dyd[i], 1) -
              geglu_loss((double[]){g1 - h}, &ud[i], &dyd[i], 1)) / (2 * h);
    dud[i] = gelu_tanh(g1) * dyd[i];
  }
  const int64_t s2[2] = {n / 8, 8};
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 2, s2), *tu = lz_test_wrap(u, LZ_F32, 2, s2);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 2, s2), *tdy = lz_test_wrap(dy, LZ_F32, 2, s2);
  lz_tensor *tdg = lz_test_wrap(dg, LZ_F32, 2, s2), *tdu = lz_test_wrap(du, LZ_F32, 2, s2);
  CHECK_OK(lz_geglu_forward(tout, tg, tu));
  CHECK(lz_test_rel_err(out, outd, n) <= 1e-5);
  CHECK_OK(lz_geglu_backward(tdg, tdu, tdy, tg, tu));
  CHECK(lz_test_rel_err(dg, dgd, n) <= 1e-3);
  CHECK(lz_test_rel_err(du, dud, n) <= 1e-5);
  lz_tensor *ts[] = {tg, tu, tout, tdy, tdg, tdu};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(g), free(u), free(out), free(dy), free(dg), free(du), free(gd), free(ud), free(dyd);
  free(outd), free(dgd), free(dud);
}

LZ_TEST(geglu_small_against_reference) { geglu_case(8 * 37); }
LZ_TEST(geglu_large_against_reference) { geglu_case(8 * 50001); } /* threaded */

/* gelu(0) = 0 and gelu'(0) = 1/2: out 0, dgate = dy * up / 2, dup = 0. */
LZ_TEST(geglu_hand_values) {
  float g[2] = {0.0f, 0.0f}, u[2] = {3.0f, -2.0f}, d[2] = {1.0f, 0.5f}, o[2], dg[2], du[2];
  const int64_t s[1] = {2};
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 1, s), *tu = lz_test_wrap(u, LZ_F32, 1, s);
  lz_tensor *td = lz_test_wrap(d, LZ_F32, 1, s), *to = lz_test_wrap(o, LZ_F32, 1, s);
  lz_tensor *tdg = lz_test_wrap(dg, LZ_F32, 1, s), *tdu = lz_test_wrap(du, LZ_F32, 1, s);
  CHECK_OK(lz_geglu_forward(to, tg, tu));
  CHECK_NEAR(o[0], 0.0, 0.0);
  CHECK_OK(lz_geglu_backward(tdg, tdu, td, tg, tu));
  CHECK_NEAR(dg[0], 1.5, 1e-7);
  CHECK_NEAR(dg[1], -0.5, 1e-7);
  CHECK_NEAR(du[1], 0.0, 0.0);
  lz_tensor *ts[] = {tg, tu, td, to, tdg, tdu};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* bf16 gate and up compute what f32 computes on the widened values. */
LZ_TEST(geglu_bf16_is_f32_on_widened_inputs) {
  const int64_t n = 8 * 50001 + 3, s[1] = {n};
  uint16_t *gb = malloc(2 * n), *ub = malloc(2 * n), *db = malloc(2 * n);
  float *gf = malloc(4 * n), *uf = malloc(4 * n), *df = malloc(4 * n);
  float *o1 = malloc(4 * n), *o2 = malloc(4 * n), *p1 = malloc(4 * n), *p2 = malloc(4 * n);
  for (int64_t i = 0; i < n; i++) {
    gf[i] = 6.0f * frand(), uf[i] = frand(), df[i] = frand();
    gb[i] = lz_f32_to_bf16(gf[i]), ub[i] = lz_f32_to_bf16(uf[i]);
    db[i] = lz_f32_to_bf16(df[i]);
    gf[i] = lz_bf16_to_f32(gb[i]), uf[i] = lz_bf16_to_f32(ub[i]);
    df[i] = lz_bf16_to_f32(db[i]);
  }
  lz_tensor *tgb = lz_test_wrap(gb, LZ_BF16, 1, s), *tub = lz_test_wrap(ub, LZ_BF16, 1, s);
  lz_tensor *tdb = lz_test_wrap(db, LZ_BF16, 1, s), *tgf = lz_test_wrap(gf, LZ_F32, 1, s);
  lz_tensor *tuf = lz_test_wrap(uf, LZ_F32, 1, s), *tdf = lz_test_wrap(df, LZ_F32, 1, s);
  lz_tensor *to1 = lz_test_wrap(o1, LZ_F32, 1, s), *to2 = lz_test_wrap(o2, LZ_F32, 1, s);
  lz_tensor *tp1 = lz_test_wrap(p1, LZ_F32, 1, s), *tp2 = lz_test_wrap(p2, LZ_F32, 1, s);
  CHECK_OK(lz_geglu_forward(to1, tgb, tub));
  CHECK_OK(lz_geglu_forward(to2, tgf, tuf));
  CHECK(memcmp(o1, o2, 4 * n) == 0);
  CHECK_OK(lz_geglu_backward(to1, tp1, tdb, tgb, tub));
  CHECK_OK(lz_geglu_backward(to2, tp2, tdf, tgf, tuf));
  CHECK(memcmp(o1, o2, 4 * n) == 0);
  CHECK(memcmp(p1, p2, 4 * n) == 0);
  lz_tensor *ts[] = {tgb, tub, tdb, tgf, tuf, tdf, to1, to2, tp1, tp2};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(gb), free(ub), free(db), free(gf), free(uf), free(df), free(o1), free(o2), free(p1);
  free(p2);
}

LZ_TEST(geglu_errors) {
  float a[8] = {0}, b[8] = {0};
  const int64_t s8[1] = {8}, s4[1] = {4};
  lz_tensor *t8 = lz_test_wrap(a, LZ_F32, 1, s8), *t4 = lz_test_wrap(b, LZ_F32, 1, s4);
  CHECK_ERR(lz_geglu_forward(t4, t8, t8), LZ_ERR_INVALID, "geglu_forward: out is f32[4]");
  CHECK_ERR(lz_geglu_backward(t8, t8, t8, t8, t8), LZ_ERR_INVALID,
            "geglu_backward: dgate and dup are the same memory");
  lz_tensor_free(t8), lz_tensor_free(t4);
}

/* --------------------------------------------------------------- soft-cap */

LZ_TEST(softcap_forward_against_reference) {
  const int64_t n = 3 * 50001, s[1] = {n};
  const float cap = 30.0f;
  float *x = malloc(4 * n), *y = malloc(4 * n);
  double *yd = malloc(8 * n);
  for (int64_t i = 0; i < n; i++) x[i] = 200.0f * frand();
  x[0] = 1e30f, x[1] = -1e30f, x[2] = 0.0f;
  for (int64_t i = 0; i < n; i++) yd[i] = cap * tanh((double)x[i] / cap);
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 1, s), *ty = lz_test_wrap(y, LZ_F32, 1, s);
  CHECK_OK(lz_softcap_forward(ty, tx, cap));
  CHECK(lz_test_rel_err(y, yd, n) <= 1e-6);
  CHECK_NEAR(y[0], 30.0, 0.0);
  CHECK_NEAR(y[1], -30.0, 0.0);
  for (int64_t i = 0; i < n; i++) CHECK(fabsf(y[i]) <= cap);
  CHECK_OK(lz_softcap_forward(tx, tx, cap)); /* in place */
  CHECK(memcmp(x, y, 4 * n) == 0);
  CHECK_ERR(lz_softcap_forward(ty, tx, 0.0f), LZ_ERR_INVALID,
            "softcap_forward: cap is 0; it must be a number > 0");
  lz_tensor_free(tx), lz_tensor_free(ty);
  free(x), free(y), free(yd);
}

/* The loss of row r: log-softmax cross-entropy of cap tanh(x / cap). */
static double capped_loss(const double *x, int64_t vocab, int32_t target, double cap) {
  double m = -INFINITY, s = 0.0;
  for (int64_t i = 0; i < vocab; i++) m = fmax(m, cap * tanh(x[i] / cap));
  for (int64_t i = 0; i < vocab; i++) s += exp(cap * tanh(x[i] / cap) - m);
  return log(s) + m - cap * tanh(x[target] / cap);
}

/* dlogits of the capped logits' cross-entropy, as the gradient of the raw
 * logits: central differences through the cap; padded columns 0, ignored
 * rows 0; f32 and bf16 dlogits; in place. */
LZ_TEST(cross_entropy_softcap_backward_against_differences) {
  const int64_t rows = 5, vocab = 1500, Vp = 1536, n = rows * Vp; /* spans and a tail */
  const float cap = 4.0f, dloss = 0.5f;
  float *x = malloc(4 * n), *y = malloc(4 * n), *dl = malloc(4 * n);
  uint16_t *dlb = malloc(2 * n);
  double *xd = malloc(8 * Vp);
  int32_t tg[5] = {3, -100, 1499, 0, 777};
  for (int64_t i = 0; i < n; i++) x[i] = 12.0f * frand();
  const int64_t s2[2] = {rows, Vp}, sr[1] = {rows};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 2, s2), *ty = lz_test_wrap(y, LZ_F32, 2, s2);
  lz_tensor *tdl = lz_test_wrap(dl, LZ_F32, 2, s2), *tdlb = lz_test_wrap(dlb, LZ_BF16, 2, s2);
  lz_tensor *tt = lz_test_wrap(tg, LZ_I32, 1, sr);
  CHECK_OK(lz_softcap_forward(ty, tx, cap));
  CHECK_OK(lz_cross_entropy_softcap_backward(tdl, ty, tt, vocab, dloss, cap));
  double worst = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < Vp; i++) xd[i] = x[r * Vp + i];
    for (int64_t i = 0; i < Vp; i += (i < vocab ? 7 : 1)) {
      double want = 0.0;
      if (tg[r] >= 0 && i < vocab) {
        const double h = 1e-4, keep = xd[i];
        xd[i] = keep + h;
        const double up = capped_loss(xd, vocab, tg[r], cap);
        xd[i] = keep - h;
        const double down = capped_loss(xd, vocab, tg[r], cap);
        xd[i] = keep;
        want = dloss * (up - down) / (2 * h);
      }
      const double err = fabs(dl[r * Vp + i] - want);
      worst = err > worst ? err : worst;
      if (i == tg[r] && i % 7) i--; /* the target's column too */
    }
    if (tg[r] >= 0) {
      const double h = 1e-4, keep = xd[tg[r]];
      xd[tg[r]] = keep + h;
      const double up = capped_loss(xd, vocab, tg[r], cap);
      xd[tg[r]] = keep - h;
      const double down = capped_loss(xd, vocab, tg[r], cap);
      const double err = fabs(dl[r * Vp + tg[r]] - dloss * (up - down) / (2 * h));
      worst = err > worst ? err : worst;
    }
  }
  CHECK(worst <= 1e-6);
  for (int64_t i = 0; i < Vp; i++) CHECK(dl[1 * Vp + i] == 0.0f); /* the ignored row */
  for (int64_t i = vocab; i < Vp; i++) CHECK(dl[i] == 0.0f);      /* padding */
  CHECK_OK(lz_cross_entropy_softcap_backward(tdlb, ty, tt, vocab, dloss, cap));
  int same = 1;
  for (int64_t i = 0; i < n; i++) same &= dlb[i] == lz_f32_to_bf16(dl[i]);
  CHECK(same);
  CHECK_OK(lz_cross_entropy_softcap_backward(ty, ty, tt, vocab, dloss, cap)); /* in place */
  CHECK(memcmp(y, dl, 4 * n) == 0);
  CHECK_ERR(lz_cross_entropy_softcap_backward(tdl, tx, tt, vocab, dloss, -1.0f), LZ_ERR_INVALID,
            "cross_entropy_softcap_backward: cap is -1; it must be a number > 0");
  lz_tensor *ts[] = {tx, ty, tdl, tdlb, tt};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(y), free(dl), free(dlb), free(xd);
}
