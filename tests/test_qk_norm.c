/* test_qk_norm.c — QK-norm over the q and k heads of packed q|k|v rows:
 * forward against a naive double reference (offset 0 and 1; q and k heads
 * of one width or, as OLMoE's whole-projection norm, of two; with and
 * without clip), backward against central differences of it, hand values,
 * thread-count independence, dx over dy, the v columns, errors. */
#include "lz_test.h"

#include <math.h>   /* fabs, fabsf, copysignf */
#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

typedef struct {
  double *out; /* may be NULL */
  const double *x, *qw, *kw, *dy;
  int64_t rows, C, Dq, Dk;
  int n_q, heads;
  double eps, offset, clip;
} qk_ref;

static int64_t ref_at(const qk_ref *a, int h) {
  return h < a->n_q ? h * a->Dq : a->n_q * a->Dq + (h - a->n_q) * a->Dk;
}

/* sum(out * dy) over the q and k heads, out the naive QK-norm of x. */
static double qk_loss(const void *ctx) {
  const qk_ref *a = ctx;
  double loss = 0.0;
  for (int64_t r = 0; r < a->rows; r++)
    for (int h = 0; h < a->heads; h++) {
      const int64_t at = r * a->C + ref_at(a, h), D = h < a->n_q ? a->Dq : a->Dk;
      const double *xr = a->x + at, *w = h < a->n_q ? a->qw : a->kw;
      double ms = 0.0;
      for (int64_t i = 0; i < D; i++) ms += xr[i] * xr[i];
      const double s = 1.0 / sqrt(ms / (double)D + a->eps);
      for (int64_t i = 0; i < D; i++) {
        double o = (a->offset + w[i]) * xr[i] * s;
        if (a->clip > 0) o = o > a->clip ? a->clip : o < -a->clip ? -a->clip : o;
        if (a->out) a->out[at + i] = o;
        loss += o * a->dy[at + i];
      }
    }
  return loss;
}

static double fd(const qk_ref *ref, double *p, int64_t i) {
  const double h = 1e-5, keep = p[i];
  p[i] = keep + h;
  double up = qk_loss(ref);
  p[i] = keep - h;
  double down = qk_loss(ref);
  p[i] = keep;
  return (up - down) / (2 * h);
}

/* Worst relative error of every stride-th entry of g - g0 against central
 * differences in p. */
static double fd_err(const qk_ref *ref, const float *g, const float *g0, double *p, int64_t n,
                     int64_t stride) {
  int64_t k = 0;
  float *ga = malloc(sizeof(float) * n);
  double *gd = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i += stride, k++) {
    ga[k] = g[i] - (g0 ? g0[i] : 0.0f);
    gd[k] = fd(ref, p, i);
  }
  double err = lz_test_rel_err(ga, gd, k);
  free(ga), free(gd);
  return err;
}

static void qk_case(int64_t B, int64_t T, int n_q, int n_kv, int64_t Dq, int64_t Dk, float offset,
                    float clip, int64_t stride) {
  uint64_t rng = 0x853C49E6748FEA9Bull;
  const int heads = n_q + n_kv;
  const int64_t rows = B * T, normed = n_q * Dq + n_kv * Dk, C = normed + n_kv * Dk,
                n = rows * C, D = Dq > Dk ? Dq : Dk;
  const float eps = 1e-6f;
  float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
  float *dy = malloc(sizeof(float) * n), *dx = malloc(sizeof(float) * n);
  float *qw = malloc(sizeof(float) * D), *kw = malloc(sizeof(float) * D);
  float *dqw = malloc(sizeof(float) * D), *dkw = malloc(sizeof(float) * D);
  float *dqw0 = malloc(sizeof(float) * D), *dkw0 = malloc(sizeof(float) * D);
  float *rstd = malloc(sizeof(float) * rows * heads);
  double *xd = malloc(sizeof(double) * n), *dyd = malloc(sizeof(double) * n);
  double *outd = malloc(sizeof(double) * n);
  double *qwd = malloc(sizeof(double) * D), *kwd = malloc(sizeof(double) * D);
  for (int64_t i = 0; i < n; i++) {
    x[i] = 0.5f + 2.0f * lz_test_uniform(&rng), dy[i] = lz_test_uniform(&rng);
    if (i % 3 == 0) x[i] = -x[i];
    xd[i] = x[i], dyd[i] = dy[i];
  }
  for (int64_t i = 0; i < D; i++) {
    qw[i] = 1.0f + 0.5f * lz_test_uniform(&rng), kw[i] = 0.5f * lz_test_uniform(&rng);
    dqw0[i] = dqw[i] = lz_test_uniform(&rng), dkw0[i] = dkw[i] = lz_test_uniform(&rng);
    qwd[i] = qw[i], kwd[i] = kw[i];
  }
  const int64_t s3[3] = {B, T, C}, sq[1] = {Dq}, sk[1] = {Dk}, sr[1] = {rows * heads};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *tout = lz_test_wrap(out, LZ_F32, 3, s3);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 3, s3), *tdx = lz_test_wrap(dx, LZ_F32, 3, s3);
  lz_tensor *tqw = lz_test_wrap(qw, LZ_F32, 1, sq), *tkw = lz_test_wrap(kw, LZ_F32, 1, sk);
  lz_tensor *tdqw = lz_test_wrap(dqw, LZ_F32, 1, sq), *tdkw = lz_test_wrap(dkw, LZ_F32, 1, sk);
  lz_tensor *tr = lz_test_wrap(rstd, LZ_F32, 1, sr);

  CHECK_OK(lz_qk_norm_forward(tout, tr, tx, tqw, tkw, n_q, n_kv, eps, offset, clip));
  qk_ref ref = {outd, xd, qwd, kwd, dyd, rows, C, Dq, Dk, n_q, heads, eps, offset, clip};
  qk_loss(&ref);
  ref.out = NULL;
  int clamped = 0;
  for (int64_t r = 0; r < rows; r++) {
    float got[normed];
    double want[normed];
    for (int64_t i = 0; i < normed; i++) {
      got[i] = out[r * C + i], want[i] = outd[r * C + i];
      clamped += clip > 0 && fabs(want[i]) == clip;
    }
    CHECK(lz_test_rel_err(got, want, normed) <= 1e-5);
    /* v passes unchanged, or clamped */
    for (int64_t i = normed; i < C; i++) {
      const float v = x[r * C + i], c = clip > 0 && fabsf(v) > clip ? copysignf(clip, v) : v;
      CHECK(out[r * C + i] == c);
    }
  }
  if (clip > 0) CHECK(clamped > 0 && clamped < rows * normed); /* some values clamped, not all */

  CHECK_OK(lz_qk_norm_backward(tdx, tdqw, tdkw, tdy, tx, tqw, tkw, tr, n_q, n_kv, offset, clip));
  /* dx of the q and k heads against differences; v's dx is dy, or 0 where clamped */
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = normed; i < C; i++) {
      const float v = x[r * C + i];
      CHECK(dx[r * C + i] == (clip > 0 && fabsf(v) > clip ? 0.0f : dy[r * C + i]));
    }
  for (int64_t i = 0; i < n; i += stride) {
    if (i % C >= normed) continue;
    CHECK_NEAR(dx[i], fd(&ref, xd, i), 1e-3);
  }
  CHECK(fd_err(&ref, dqw, dqw0, qwd, Dq, 1) <= 1e-3);
  CHECK(fd_err(&ref, dkw, dkw0, kwd, Dk, 1) <= 1e-3);

  lz_tensor *ts[] = {tx, tout, tdy, tdx, tqw, tkw, tdqw, tdkw, tr};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(out), free(dy), free(dx), free(qw), free(kw), free(dqw), free(dkw), free(dqw0);
  free(dkw0), free(rstd), free(xd), free(dyd), free(outd), free(qwd), free(kwd);
}

LZ_TEST(qk_norm_qwen3_against_reference) { qk_case(2, 3, 4, 2, 8, 8, 0.0f, 0.0f, 1); }
LZ_TEST(qk_norm_gemma3_offset_against_reference) { qk_case(2, 3, 4, 1, 8, 8, 1.0f, 0.0f, 1); }
LZ_TEST(qk_norm_large_against_reference) { /* threaded */
  qk_case(2, 64, 8, 2, 128, 128, 0.0f, 0.0f, 997);
}
/* OLMoE: one q head of n_head * head_dim, one k head of n_kv_head *
 * head_dim (here 32 and 16), with and without clip_qkv */
LZ_TEST(qk_norm_whole_projection_against_reference) {
  qk_case(2, 3, 1, 1, 32, 16, 0.0f, 0.0f, 1);
  qk_case(2, 3, 1, 1, 32, 16, 0.0f, 1.5f, 1);
  qk_case(2, 3, 1, 1, 24, 24, 0.0f, 1.2f, 1);
}

/* One q head [3, 4], one k head [0, 2], v [7, 8]; q_w = [1, 2], k_w = [1, 1]:
 * q's 1/rms = 1/sqrt(12.5), out [3, 8] / sqrt(12.5); k's 1/rms = 1/sqrt(2),
 * out [0, sqrt(2)]; v unchanged. With offset 1 the weights act as 1 + w. */
LZ_TEST(qk_norm_hand_values) {
  float x[6] = {3, 4, 0, 2, 7, 8}, qw[2] = {1, 2}, kw[2] = {1, 1}, out[6], rstd[2];
  const int64_t s6[2] = {1, 6}, s2[1] = {2};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 2, s6), *tout = lz_test_wrap(out, LZ_F32, 2, s6);
  lz_tensor *tqw = lz_test_wrap(qw, LZ_F32, 1, s2), *tkw = lz_test_wrap(kw, LZ_F32, 1, s2);
  lz_tensor *tr = lz_test_wrap(rstd, LZ_F32, 1, s2);
  CHECK_OK(lz_qk_norm_forward(tout, tr, tx, tqw, tkw, 1, 1, 0.0f, 0.0f, 0.0f));
  const double sq = 1.0 / sqrt(12.5);
  CHECK_NEAR(rstd[0], sq, 1e-7);
  CHECK_NEAR(out[0], 3 * sq, 1e-6);
  CHECK_NEAR(out[1], 2 * 4 * sq, 1e-6);
  CHECK(out[2] == 0.0f);
  CHECK_NEAR(out[3], sqrt(2.0), 1e-6);
  CHECK(out[4] == 7.0f && out[5] == 8.0f);
  CHECK_OK(lz_qk_norm_forward(tout, tr, tx, tqw, tkw, 1, 1, 0.0f, 1.0f, 0.0f));
  CHECK_NEAR(out[0], 2 * 3 * sq, 1e-6);
  CHECK_NEAR(out[1], 3 * 4 * sq, 1e-6);
  CHECK_NEAR(out[3], 2 * sqrt(2.0), 1e-6);
  lz_tensor *ts[] = {tx, tout, tqw, tkw, tr};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* Backward of fixed data on `threads` threads (dx over dy when dx_is_dy;
 * clip as the op takes it). */
static void qk_backward_with(float *dx, float *dw, int64_t rows, int threads, int dx_is_dy,
                             float clip) {
  const int n_q = 4, n_kv = 2, heads = 6;
  const int64_t D = 64, C = 8 * D, n = rows * C;
  float *x = malloc(sizeof(float) * n), *dy = malloc(sizeof(float) * n);
  float *out = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * 2 * D);
  float *rstd = malloc(sizeof(float) * rows * heads);
  uint64_t r = 0x243F6A8885A308D3ull;
  for (int64_t i = 0; i < n; i++) x[i] = lz_test_uniform(&r), dy[i] = lz_test_uniform(&r);
  for (int64_t i = 0; i < 2 * D; i++) w[i] = lz_test_uniform(&r), dw[i] = lz_test_uniform(&r);
  const int64_t s2[2] = {rows, C}, sd[1] = {D}, sr[1] = {rows * heads};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 2, s2), *tdy = lz_test_wrap(dy, LZ_F32, 2, s2);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 2, s2), *tr = lz_test_wrap(rstd, LZ_F32, 1, sr);
  lz_tensor *tqw = lz_test_wrap(w, LZ_F32, 1, sd), *tkw = lz_test_wrap(w + D, LZ_F32, 1, sd);
  lz_tensor *tdqw = lz_test_wrap(dw, LZ_F32, 1, sd), *tdkw = lz_test_wrap(dw + D, LZ_F32, 1, sd);
  lz_tensor *tdx = dx_is_dy ? tdy : lz_test_wrap(dx, LZ_F32, 2, s2);
  const int saved = lz_threads_get();
  CHECK_OK(lz_threads_set(threads));
  CHECK_OK(lz_qk_norm_forward(tout, tr, tx, tqw, tkw, n_q, n_kv, 1e-6f, 0.0f, clip));
  CHECK_OK(lz_qk_norm_backward(tdx, tdqw, tdkw, tdy, tx, tqw, tkw, tr, n_q, n_kv, 0.0f, clip));
  lz_threads_set(saved);
  if (dx_is_dy)
    memcpy(dx, dy, sizeof(float) * n);
  else
    lz_tensor_free(tdx);
  lz_tensor *ts[] = {tx, tdy, tout, tr, tqw, tkw, tdqw, tdkw};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(dy), free(out), free(w), free(rstd);
}

/* 1, 2 and 3 threads give the same bits, and dx over dy is dx on its own;
 * without a clip and with one that clamps some values (x in [0, 1) normed
 * with weights in [0, 1): clip 0.8 cuts the largest). */
LZ_TEST(qk_norm_backward_thread_count_independent) {
  const int64_t rows = 300, n = rows * 8 * 64;
  for (int c = 0; c < 2; c++) {
    const float clip = c ? 0.8f : 0.0f;
    float *dx[4], *dw[4];
    for (int t = 0; t < 4; t++) {
      dx[t] = malloc(sizeof(float) * n), dw[t] = malloc(sizeof(float) * 128);
      qk_backward_with(dx[t], dw[t], rows, t < 3 ? t + 1 : 2, t == 3, clip);
    }
    for (int t = 1; t < 4; t++) {
      CHECK(memcmp(dx[0], dx[t], sizeof(float) * n) == 0);
      CHECK(memcmp(dw[0], dw[t], sizeof(float) * 128) == 0);
    }
    int64_t zeros = 0;
    for (int64_t i = 0; i < n; i++) zeros += dx[0][i] == 0.0f;
    CHECK(c ? zeros > 0 : zeros == 0); /* clamped values pass no gradient */
    for (int t = 0; t < 4; t++) free(dx[t]), free(dw[t]);
  }
}

LZ_TEST(qk_norm_errors) {
  float buf[256] = {0};
  const int64_t s3[3] = {2, 2, 32}, s4[1] = {4}, s5[1] = {5}, s8[1] = {8}, s9[1] = {9};
  lz_tensor *x = lz_test_wrap(buf, LZ_F32, 3, s3), *out = lz_test_wrap(buf, LZ_F32, 3, s3);
  lz_tensor *w4 = lz_test_wrap(buf, LZ_F32, 1, s4), *w5 = lz_test_wrap(buf, LZ_F32, 1, s5);
  lz_tensor *r8 = lz_test_wrap(buf, LZ_F32, 1, s8), *r9 = lz_test_wrap(buf, LZ_F32, 1, s9);
  lz_tensor *bf = lz_test_wrap(buf, LZ_BF16, 3, s3);
  /* 4 rows x 2 heads (1 q + 1 k) of 4: 8 rstd */
  CHECK_OK(lz_qk_norm_forward(out, r8, x, w4, w4, 1, 1, 1e-6f, 0.0f, 0.0f));
  CHECK_OK(lz_qk_norm_forward(out, r8, x, w4, w5, 1, 1, 1e-6f, 0.0f, 0.0f)); /* k heads of 5 */
  CHECK_ERR(lz_qk_norm_forward(out, r9, x, w4, w4, 1, 1, 1e-6f, 0.0f, 0.0f), LZ_ERR_INVALID, "rstd");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, w4, 0, 1, 1e-6f, 0.0f, 0.0f), LZ_ERR_INVALID,
            "n_head");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, w4, 7, 2, 1e-6f, 0.0f, 0.0f), LZ_ERR_INVALID,
            "must hold the q and k heads");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, w4, 1, 1, -1.0f, 0.0f, 0.0f), LZ_ERR_INVALID, "eps");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, w4, 1, 1, 1e-6f, INFINITY, 0.0f), LZ_ERR_INVALID,
            "offset");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, w4, 1, 1, 1e-6f, 0.0f, -1.0f), LZ_ERR_INVALID,
            "clip");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, w4, 1, 1, 1e-6f, 0.0f, NAN), LZ_ERR_INVALID, "clip");
  CHECK_ERR(lz_qk_norm_forward(out, r8, bf, w4, w4, 1, 1, 1e-6f, 0.0f, 0.0f), LZ_ERR_INVALID, "qkv");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, NULL, w4, 1, 1, 1e-6f, 0.0f, 0.0f), LZ_ERR_INVALID,
            "q_w");
  CHECK_ERR(lz_qk_norm_forward(out, r8, x, w4, NULL, 1, 1, 1e-6f, 0.0f, 0.0f), LZ_ERR_INVALID,
            "k_w");
  CHECK_ERR(lz_qk_norm_backward(out, w4, w4, x, x, w4, w5, r8, 1, 1, 0.0f, 0.0f), LZ_ERR_INVALID,
            "dk_w");
  CHECK_ERR(lz_qk_norm_backward(out, w5, w4, x, x, w4, w4, r8, 1, 1, 0.0f, 0.0f), LZ_ERR_INVALID,
            "dq_w");
  lz_tensor *ts[] = {x, out, w4, w5, r8, r9, bf};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}
