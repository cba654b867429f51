/* test_llama_kernels.c — Llama's RMSNorm, rotary embeddings and SwiGLU:
 * forward against double references and hand values, backward against
 * central differences of the references, determinism, aliasing, errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

static uint64_t rng = 0x853C49E6748FEA9Bull;
static float frand(void) { return lz_test_uniform(&rng); }

/* A loss L(p) = sum(f(p) * dy) of a double reference; central differences of
 * it give the gradient backward must match. */
typedef double (*loss_fn)(const void *ctx);

static double fd(loss_fn loss, const void *ctx, double *p, int64_t i) {
  const double h = 1e-5, keep = p[i];
  p[i] = keep + h;
  double up = loss(ctx);
  p[i] = keep - h;
  double down = loss(ctx);
  p[i] = keep;
  return (up - down) / (2 * h);
}

/* Compares every stride-th entry of an fp32 gradient (minus its starting
 * value `g0`, NULL for 0) with central differences in the same entry of p. */
static double fd_err(const float *g, const float *g0, loss_fn loss, const void *ctx, double *p,
                     int64_t n, int64_t stride) {
  int64_t k = 0;
  float *ga = malloc(sizeof(float) * n);
  double *gd = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i += stride, k++) {
    ga[k] = g[i] - (g0 ? g0[i] : 0.0f);
    gd[k] = fd(loss, ctx, p, i);
  }
  double err = lz_test_rel_err(ga, gd, k);
  free(ga), free(gd);
  return err;
}

static lz_tensor *on_cuda(lz_tensor *t) {
  t->device = LZ_CUDA; /* a header only: the kernel must refuse before touching data */
  return t;
}

/* ---------------------------------------------------------------- rmsnorm */

typedef struct {
  double *out; /* may be NULL */
  const double *x, *w, *dy;
  int64_t rows, C;
  double eps;
} rms_ref;

static double rms_loss(const void *ctx) {
  const rms_ref *a = ctx;
  double loss = 0.0;
  for (int64_t r = 0; r < a->rows; r++) {
    const double *xr = a->x + r * a->C;
    double ms = 0.0;
    for (int64_t i = 0; i < a->C; i++) ms += xr[i] * xr[i];
    const double s = 1.0 / sqrt(ms / (double)a->C + a->eps);
    for (int64_t i = 0; i < a->C; i++) {
      const double o = a->w[i] * xr[i] * s;
      if (a->out) a->out[r * a->C + i] = o;
      loss += o * a->dy[r * a->C + i];
    }
  }
  return loss;
}

static void rmsnorm_case(int64_t B, int64_t T, int64_t C, int64_t stride) {
  const int64_t rows = B * T, n = rows * C;
  const float eps = 1e-6f;
  float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
  float *dy = malloc(sizeof(float) * n), *dx = malloc(sizeof(float) * n);
  float *w = malloc(sizeof(float) * C), *dw = malloc(sizeof(float) * C);
  float *dw0 = malloc(sizeof(float) * C), *rstd = malloc(sizeof(float) * rows);
  double *xd = malloc(sizeof(double) * n), *dyd = malloc(sizeof(double) * n);
  double *outd = malloc(sizeof(double) * n), *wd = malloc(sizeof(double) * C);
  for (int64_t i = 0; i < n; i++) x[i] = 0.5f + 2.0f * frand(), dy[i] = frand();
  for (int64_t i = 0; i < C; i++) w[i] = 1.0f + 0.5f * frand(), dw0[i] = dw[i] = frand();
  for (int64_t i = 0; i < n; i++) xd[i] = x[i], dyd[i] = dy[i];
  for (int64_t i = 0; i < C; i++) wd[i] = w[i];

  const int64_t s3[3] = {B, T, C}, sc[1] = {C}, sr[2] = {B, T};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *tout = lz_test_wrap(out, LZ_F32, 3, s3);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 3, s3), *tdx = lz_test_wrap(dx, LZ_F32, 3, s3);
  lz_tensor *tw = lz_test_wrap(w, LZ_F32, 1, sc), *tdw = lz_test_wrap(dw, LZ_F32, 1, sc);
  lz_tensor *trstd = lz_test_wrap(rstd, LZ_F32, 2, sr);

  CHECK_OK(lz_rmsnorm_forward(tout, trstd, tx, tw, eps));
  rms_ref ref = {outd, xd, wd, dyd, rows, C, eps};
  rms_loss(&ref);
  ref.out = NULL;
  CHECK(lz_test_rel_err(out, outd, n) <= 1e-5);
  for (int64_t r = 0; r < rows; r++) {
    double ms = 0.0;
    for (int64_t i = 0; i < C; i++) ms += xd[r * C + i] * xd[r * C + i];
    CHECK_NEAR(rstd[r], 1.0 / sqrt(ms / (double)C + eps), 1e-5);
  }

  CHECK_OK(lz_rmsnorm_backward(tdx, tdw, tdy, tx, tw, trstd));
  CHECK(fd_err(dx, NULL, rms_loss, &ref, xd, n, stride) <= 1e-3);
  CHECK(fd_err(dw, dw0, rms_loss, &ref, wd, C, stride > 1 ? 7 : 1) <= 1e-3);

  lz_tensor *ts[] = {tx, tout, tdy, tdx, tw, tdw, trstd};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(out), free(dy), free(dx), free(w), free(dw), free(dw0), free(rstd);
  free(xd), free(dyd), free(outd), free(wd);
}

LZ_TEST(rmsnorm_small_against_reference) { rmsnorm_case(2, 3, 37, 1); }
LZ_TEST(rmsnorm_large_against_reference) { rmsnorm_case(4, 16, 1024, 97); } /* threaded */

/* x = [3, 4, 0, 0]: mean(x^2) = 25/4, so 1/rms = 0.4 and out = w * [1.2, 1.6, 0, 0]. */
LZ_TEST(rmsnorm_hand_values) {
  float x[4] = {3, 4, 0, 0}, w[4] = {1, 2, 3, 4}, out[4], rstd[1];
  float dy[4] = {1, 0, 0, 0}, dx[4], dw[4] = {10, 10, 10, 10};
  const int64_t s4[1] = {4}, s1[1] = {1};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 1, s4), *tw = lz_test_wrap(w, LZ_F32, 1, s4);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 1, s4), *tr = lz_test_wrap(rstd, LZ_F32, 1, s1);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 1, s4), *tdx = lz_test_wrap(dx, LZ_F32, 1, s4);
  lz_tensor *tdw = lz_test_wrap(dw, LZ_F32, 1, s4);
  CHECK_OK(lz_rmsnorm_forward(tout, tr, tx, tw, 0.0f));
  CHECK_NEAR(rstd[0], 0.4, 1e-7);
  CHECK_NEAR(out[0], 1.2, 1e-6);
  CHECK_NEAR(out[1], 3.2, 1e-6);
  CHECK(out[2] == 0.0f && out[3] == 0.0f);
  /* dy = e0: dw = [1.2, 0, 0, 0] added to 10; dx = 0.4 * (e0 - n * n0 / 4) with
   * n = [1.2, 1.6, 0, 0]: [0.4 * (1 - 0.36), -0.4 * 1.6 * 0.3, 0, 0]. */
  CHECK_OK(lz_rmsnorm_backward(tdx, tdw, tdy, tx, tw, tr));
  CHECK_NEAR(dw[0], 11.2, 1e-6);
  CHECK(dw[1] == 10.0f && dw[2] == 10.0f && dw[3] == 10.0f);
  CHECK_NEAR(dx[0], 0.256, 1e-6);
  CHECK_NEAR(dx[1], -0.192, 1e-6);
  CHECK(dx[2] == 0.0f && dx[3] == 0.0f);
  lz_tensor *ts[] = {tx, tw, tout, tr, tdy, tdx, tdw};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* Backward of fixed random data on `threads` threads into dx, dw (dw starts
 * from the same nonzero values each time); dx_is_dy: dx written over dy. */
static void rmsnorm_backward_with(float *dx, float *dw, int64_t rows, int64_t C, int threads,
                                  int dx_is_dy) {
  const int64_t n = rows * C;
  float *x = malloc(sizeof(float) * n), *dy = malloc(sizeof(float) * n);
  float *out = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * C);
  float *rstd = malloc(sizeof(float) * rows);
  uint64_t r = 0x243F6A8885A308D3ull; /* the same data on every call */
  for (int64_t i = 0; i < n; i++) x[i] = lz_test_uniform(&r), dy[i] = lz_test_uniform(&r);
  for (int64_t i = 0; i < C; i++) w[i] = lz_test_uniform(&r), dw[i] = lz_test_uniform(&r);
  const int64_t s2[2] = {rows, C}, sc[1] = {C}, sr[1] = {rows};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 2, s2), *tdy = lz_test_wrap(dy, LZ_F32, 2, s2);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 2, s2), *tw = lz_test_wrap(w, LZ_F32, 1, sc);
  lz_tensor *tdw = lz_test_wrap(dw, LZ_F32, 1, sc), *tr = lz_test_wrap(rstd, LZ_F32, 1, sr);
  lz_tensor *tdx = dx_is_dy ? tdy : lz_test_wrap(dx, LZ_F32, 2, s2);
  const int saved = lz_threads_get();
  CHECK_OK(lz_threads_set(threads));
  CHECK_OK(lz_rmsnorm_forward(tout, tr, tx, tw, 1e-5f));
  CHECK_OK(lz_rmsnorm_backward(tdx, tdw, tdy, tx, tw, tr));
  lz_threads_set(saved);
  if (dx_is_dy)
    memcpy(dx, dy, sizeof(float) * n);
  else
    lz_tensor_free(tdx);
  lz_tensor *ts[] = {tx, tdy, tout, tw, tdw, tr};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(dy), free(out), free(w), free(rstd);
}

/* 1, 2 and 3 threads (3 splits the blocks unevenly) give the same bits, and
 * dx written over dy is the same as dx on its own: one-pass rows (520
 * columns, uneven row blocks) and two-pass rows (4136 columns). */
LZ_TEST(rmsnorm_backward_thread_count_independent) {
  const int64_t shapes[2][2] = {{1000, 520}, {1024, 4096 + 40}};
  for (int k = 0; k < 2; k++) {
    const int64_t rows = shapes[k][0], C = shapes[k][1];
    float *dx[4], *dw[4];
    for (int t = 0; t < 4; t++) {
      dx[t] = malloc(sizeof(float) * rows * C), dw[t] = malloc(sizeof(float) * C);
      rmsnorm_backward_with(dx[t], dw[t], rows, C, t < 3 ? t + 1 : 2, t == 3);
    }
    for (int t = 1; t < 4; t++) {
      CHECK(memcmp(dx[0], dx[t], sizeof(float) * rows * C) == 0);
      CHECK(memcmp(dw[0], dw[t], sizeof(float) * C) == 0);
    }
    for (int t = 0; t < 4; t++) free(dx[t]), free(dw[t]);
  }
}

LZ_TEST(rmsnorm_errors) {
  float buf[1024] = {0};
  int32_t ibuf[128] = {0};
  const int64_t s3[3] = {2, 4, 128}, s64[1] = {64}, s128[1] = {128}, s8[1] = {8}, s7[1] = {7},
                s3b[3] = {2, 4, 64};
  lz_tensor *x = lz_test_wrap(buf, LZ_F32, 3, s3), *out = lz_test_wrap(buf, LZ_F32, 3, s3);
  lz_tensor *w = lz_test_wrap(buf, LZ_F32, 1, s128), *w64 = lz_test_wrap(buf, LZ_F32, 1, s64);
  lz_tensor *r8 = lz_test_wrap(buf, LZ_F32, 1, s8), *r7 = lz_test_wrap(buf, LZ_F32, 1, s7);
  lz_tensor *wi = lz_test_wrap(ibuf, LZ_I32, 1, s128), *xb = lz_test_wrap(buf, LZ_BF16, 3, s3);
  lz_tensor *bad = lz_test_wrap(buf, LZ_F32, 3, s3b);
  lz_tensor *xc = on_cuda(lz_test_wrap(buf, LZ_F32, 3, s3));
  CHECK_ERR(lz_rmsnorm_forward(out, r8, x, w64, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: w is f32[64] (64 elements), expected 128 elements (the last "
            "dimension of x)");
  CHECK_ERR(lz_rmsnorm_forward(out, r7, x, w, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: rstd is f32[7] (7 elements), expected 8 elements (one per row");
  CHECK_ERR(lz_rmsnorm_forward(bad, r8, x, w, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: out is f32[2,4,64] but x is f32[2,4,128]");
  CHECK_ERR(lz_rmsnorm_forward(out, r8, x, wi, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: x is f32[2,4,128] and w is i32[128]; both must be f32 or both bf16");
  /* x and w of one dtype (bf16 both): the aliasing is the only fault. */
  lz_tensor *wb = lz_test_wrap(buf, LZ_BF16, 1, s128);
  CHECK_ERR(lz_rmsnorm_forward(out, r8, xb, wb, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: out (f32) and x (bf16) are the same memory");
  CHECK_ERR(lz_rmsnorm_forward(out, r8, wi, w, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: x is i32[128], expected dtype f32 or bf16");
  CHECK_ERR(lz_rmsnorm_forward(out, r8, NULL, w, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: x is missing");
  CHECK_ERR(lz_rmsnorm_forward(out, r8, x, w, NAN), LZ_ERR_INVALID,
            "rmsnorm_forward: eps is nan; it must be finite and >= 0");
  CHECK_ERR(lz_rmsnorm_forward(out, r8, xc, w, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: out lives on cpu but x lives on cuda");
  CHECK_ERR(lz_rmsnorm_backward(out, w64, x, x, w, r8), LZ_ERR_INVALID,
            "rmsnorm_backward: dw is f32[64]");
  CHECK_ERR(lz_rmsnorm_backward(out, w, bad, x, w, r8), LZ_ERR_INVALID,
            "rmsnorm_backward: dy is f32[2,4,64] but x is f32[2,4,128]");
  CHECK_ERR(lz_rmsnorm_backward(NULL, w, x, x, w, r8), LZ_ERR_INVALID,
            "rmsnorm_backward: dx is missing");
  CHECK_ERR(lz_rmsnorm_backward(out, w, x, x, w, r7), LZ_ERR_INVALID,
            "rmsnorm_backward: rstd is f32[7]");
  CHECK_ERR(lz_rmsnorm_backward(out, w, xc, x, w, r8), LZ_ERR_INVALID,
            "rmsnorm_backward: dx lives on cpu but dy lives on cuda");
  lz_tensor *ts[] = {x, out, w, w64, r8, r7, wi, xb, wb, bad, xc};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* ------------------------------------------------------------------- rope */

typedef struct {
  double *out; /* may be NULL */
  const double *x, *dy;
  int64_t B, T, n_head, head_dim, pos_offset;
  float theta;
} rope_ref;

/* The angle is an fp32 product of the position and an fp32 inverse frequency
 * (as LlamaRotaryEmbedding computes it); the rest in double. */
static double rope_loss(const void *ctx) {
  const rope_ref *a = ctx;
  const int64_t half = a->head_dim / 2, C = a->n_head * a->head_dim;
  double loss = 0.0;
  for (int64_t r = 0; r < a->B * a->T; r++) {
    const float pos = (float)(a->pos_offset + r % a->T);
    for (int64_t h = 0; h < a->n_head; h++)
      for (int64_t i = 0; i < half; i++) {
        const float inv = (float)pow(a->theta, -2.0 * (double)i / (double)a->head_dim);
        const double angle = (double)(pos * inv), c = cos(angle), s = sin(angle);
        const int64_t j1 = r * C + h * a->head_dim + i, j2 = j1 + half;
        const double o1 = a->x[j1] * c - a->x[j2] * s, o2 = a->x[j2] * c + a->x[j1] * s;
        if (a->out) a->out[j1] = o1, a->out[j2] = o2;
        loss += o1 * a->dy[j1] + o2 * a->dy[j2];
      }
  }
  return loss;
}

static void rope_case(int64_t B, int64_t T, int n_head, int head_dim, int64_t pos_offset,
                      float theta, int64_t stride) {
  const int64_t C = (int64_t)n_head * head_dim, n = B * T * C;
  float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
  float *dy = malloc(sizeof(float) * n), *dx = malloc(sizeof(float) * n);
  double *xd = malloc(sizeof(double) * n), *dyd = malloc(sizeof(double) * n);
  double *outd = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i++) x[i] = frand(), dy[i] = frand(), xd[i] = x[i], dyd[i] = dy[i];
  const int64_t s3[3] = {B, T, C};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *tout = lz_test_wrap(out, LZ_F32, 3, s3);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 3, s3), *tdx = lz_test_wrap(dx, LZ_F32, 3, s3);
  CHECK_OK(lz_rope_forward(tout, tx, n_head, head_dim, pos_offset, theta));
  rope_ref ref = {outd, xd, dyd, B, T, n_head, head_dim, pos_offset, theta};
  rope_loss(&ref);
  ref.out = NULL;
  CHECK(lz_test_rel_err(out, outd, n) <= 1e-5);
  CHECK_OK(lz_rope_backward(tdx, tdy, n_head, head_dim, pos_offset, theta));
  CHECK(fd_err(dx, NULL, rope_loss, &ref, xd, n, stride) <= 1e-3);
  lz_tensor_free(tx), lz_tensor_free(tout), lz_tensor_free(tdy), lz_tensor_free(tdx);
  free(x), free(out), free(dy), free(dx), free(xd), free(dyd), free(outd);
}

LZ_TEST(rope_small_against_reference) { rope_case(2, 5, 3, 8, 0, 10000.0f, 1); }
LZ_TEST(rope_offset_against_reference) { rope_case(1, 7, 2, 12, 1000, 500000.0f, 1); }
LZ_TEST(rope_large_against_reference) { rope_case(2, 64, 8, 128, 3, 10000.0f, 1009); }

/* head_dim 4, theta 100: inverse frequencies 1 and 0.1; element 0 pairs with
 * 2, element 1 with 3. x = [1, 1, 0, 0] at position 10 turns to
 * [cos 10, cos 1, sin 10, sin 1]; backward turns it back. */
LZ_TEST(rope_hand_values) {
  float x[8] = {1, 1, 0, 0, 0, 0, 1, 0}, out[8], back[8];
  const int64_t s3[3] = {1, 2, 4};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *tout = lz_test_wrap(out, LZ_F32, 3, s3);
  lz_tensor *tback = lz_test_wrap(back, LZ_F32, 3, s3);
  CHECK_OK(lz_rope_forward(tout, tx, 1, 4, 10, 100.0f));
  CHECK_NEAR(out[0], cos(10.0), 1e-6);
  CHECK_NEAR(out[1], cos(1.0), 1e-6);
  CHECK_NEAR(out[2], sin(10.0), 1e-6);
  CHECK_NEAR(out[3], sin(1.0), 1e-6);
  /* position 11: [0, 0, 1, 0] is the second half of pair 0, so out0 = -sin 11. */
  CHECK_NEAR(out[4], -sin(11.0), 1e-6);
  CHECK(out[5] == 0.0f && out[7] == 0.0f);
  CHECK_NEAR(out[6], cos(11.0), 1e-6);
  CHECK_OK(lz_rope_backward(tback, tout, 1, 4, 10, 100.0f));
  for (int i = 0; i < 8; i++) CHECK_NEAR(back[i], x[i], 1e-6);
  lz_tensor_free(tx), lz_tensor_free(tout), lz_tensor_free(tback);
}

/* out may be x, dx may be dy: the same bits as out of place, on 1 or 3 threads. */
LZ_TEST(rope_in_place_and_threads) {
  enum { B = 2, T = 32, NH = 4, HD = 64, N = B * T * NH * HD };
  static float x[N], y[N], buf[N], y3[N];
  for (int i = 0; i < N; i++) x[i] = frand();
  const int64_t s3[3] = {B, T, NH * HD};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *ty = lz_test_wrap(y, LZ_F32, 3, s3);
  lz_tensor *tbuf = lz_test_wrap(buf, LZ_F32, 3, s3), *ty3 = lz_test_wrap(y3, LZ_F32, 3, s3);
  const int saved = lz_threads_get();
  for (int back = 0; back < 2; back++) {
    lz_status (*fn)(lz_tensor *, const lz_tensor *, int, int, int64_t, float) =
        back ? lz_rope_backward : lz_rope_forward;
    CHECK_OK(lz_threads_set(1));
    CHECK_OK(fn(ty, tx, NH, HD, 5, 10000.0f));
    CHECK_OK(lz_threads_set(3));
    CHECK_OK(fn(ty3, tx, NH, HD, 5, 10000.0f));
    memcpy(buf, x, sizeof x);
    CHECK_OK(fn(tbuf, tbuf, NH, HD, 5, 10000.0f));
    CHECK(memcmp(y, y3, sizeof y) == 0);
    CHECK(memcmp(y, buf, sizeof y) == 0);
  }
  lz_threads_set(saved);
  lz_tensor_free(tx), lz_tensor_free(ty), lz_tensor_free(tbuf), lz_tensor_free(ty3);
}

LZ_TEST(rope_errors) {
  float buf[256] = {0};
  const int64_t s3[3] = {2, 4, 24}, s2[2] = {8, 24}, s3b[3] = {2, 4, 12};
  lz_tensor *x = lz_test_wrap(buf, LZ_F32, 3, s3), *x2 = lz_test_wrap(buf, LZ_F32, 2, s2);
  lz_tensor *bad = lz_test_wrap(buf, LZ_F32, 3, s3b), *xb = lz_test_wrap(buf, LZ_BF16, 3, s3);
  lz_tensor *xc = on_cuda(lz_test_wrap(buf, LZ_F32, 3, s3));
  CHECK_ERR(lz_rope_forward(x, x, 3, 7, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: head_dim is 7; it must be even");
  CHECK_ERR(lz_rope_forward(x, x, 2, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: x is f32[2,4,24], but n_head * head_dim = 2 * 8 = 16");
  CHECK_ERR(lz_rope_forward(x, x, 0, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: n_head is 0; it must be >= 1");
  CHECK_ERR(lz_rope_forward(x, x, 3, 8, -1, 1e4f), LZ_ERR_INVALID,
            "rope_forward: pos_offset is -1; it must be >= 0");
  CHECK_ERR(lz_rope_forward(x, x, 3, 8, 0, 0.0f), LZ_ERR_INVALID,
            "rope_forward: theta is 0; it must be finite and > 0");
  CHECK_ERR(lz_rope_forward(x2, x2, 3, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: x is f32[8,24], expected 3 dimensions");
  CHECK_ERR(lz_rope_forward(bad, x, 3, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: out is f32[2,4,12] but x is f32[2,4,24]");
  CHECK_ERR(lz_rope_forward(x, xb, 3, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: out (f32) and x (bf16) are the same memory");
  CHECK_ERR(lz_rope_forward(xc, x, 3, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_forward: out lives on cuda but x lives on cpu");
  CHECK_ERR(lz_rope_backward(x, bad, 3, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_backward: dx is f32[2,4,24] but dy is f32[2,4,12]");
  CHECK_ERR(lz_rope_backward(NULL, x, 3, 8, 0, 1e4f), LZ_ERR_INVALID,
            "rope_backward: dx is missing");
  lz_tensor_free(x), lz_tensor_free(x2), lz_tensor_free(bad), lz_tensor_free(xb);
  lz_tensor_free(xc);
}

/* ----------------------------------------------------------------- swiglu */

typedef struct {
  double *out; /* may be NULL */
  const double *gate, *up, *dy;
  int64_t n;
} swiglu_ref;

static double swiglu_loss(const void *ctx) {
  const swiglu_ref *a = ctx;
  double loss = 0.0;
  for (int64_t i = 0; i < a->n; i++) {
    const double g = a->gate[i], o = g / (1.0 + exp(-g)) * a->up[i];
    if (a->out) a->out[i] = o;
    loss += o * a->dy[i];
  }
  return loss;
}

static void swiglu_case(int64_t n) {
  float *g = malloc(sizeof(float) * n), *u = malloc(sizeof(float) * n);
  float *out = malloc(sizeof(float) * n), *dy = malloc(sizeof(float) * n);
  float *dg = malloc(sizeof(float) * n), *du = malloc(sizeof(float) * n);
  double *gd = malloc(sizeof(double) * n), *ud = malloc(sizeof(double) * n);
  double *dyd = malloc(sizeof(double) * n), *outd = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i++) g[i] = 6.0f * frand(), u[i] = frand(), dy[i] = frand();
  g[0] = 30.0f, g[1] = -30.0f, g[2] = 0.0f; /* saturated tails and the middle */
  for (int64_t i = 0; i < n; i++) gd[i] = g[i], ud[i] = u[i], dyd[i] = dy[i];
  const int64_t s2[2] = {n / 8, 8};
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 2, s2), *tu = lz_test_wrap(u, LZ_F32, 2, s2);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 2, s2), *tdy = lz_test_wrap(dy, LZ_F32, 2, s2);
  lz_tensor *tdg = lz_test_wrap(dg, LZ_F32, 2, s2), *tdu = lz_test_wrap(du, LZ_F32, 2, s2);
  CHECK_OK(lz_swiglu_forward(tout, tg, tu));
  swiglu_ref ref = {outd, gd, ud, dyd, n};
  swiglu_loss(&ref);
  ref.out = NULL;
  CHECK(lz_test_rel_err(out, outd, n) <= 1e-5);
  CHECK_OK(lz_swiglu_backward(tdg, tdu, tdy, tg, tu));
  /* L is a sum of terms in one element each: the difference of element i is
   * its term's, so every entry is checked. */
  CHECK(fd_err(dg, NULL, swiglu_loss, &ref, gd, n, n > 1000 ? 9973 : 1) <= 1e-3);
  CHECK(fd_err(du, NULL, swiglu_loss, &ref, ud, n, n > 1000 ? 9973 : 1) <= 1e-3);
  lz_tensor *ts[] = {tg, tu, tout, tdy, tdg, tdu};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(g), free(u), free(out), free(dy), free(dg), free(du), free(gd), free(ud), free(dyd);
  free(outd);
}

LZ_TEST(swiglu_small_against_reference) { swiglu_case(8 * 37); }
LZ_TEST(swiglu_large_against_reference) { swiglu_case(8 * 50001); } /* threaded */

/* silu(0) = 0 with slope 1/2; silu(2) = 2 / (1 + e^-2). */
LZ_TEST(swiglu_hand_values) {
  float g[2] = {0.0f, 2.0f}, u[2] = {3.0f, 5.0f}, out[2], d[2] = {1.0f, 1.0f}, dg[2], du[2];
  const int64_t s[1] = {2};
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 1, s), *tu = lz_test_wrap(u, LZ_F32, 1, s);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 1, s), *td = lz_test_wrap(d, LZ_F32, 1, s);
  lz_tensor *tdg = lz_test_wrap(dg, LZ_F32, 1, s), *tdu = lz_test_wrap(du, LZ_F32, 1, s);
  CHECK_OK(lz_swiglu_forward(tout, tg, tu));
  const double sig2 = 1.0 / (1.0 + exp(-2.0));
  CHECK(out[0] == 0.0f);
  CHECK_NEAR(out[1], 2.0 * sig2 * 5.0, 1e-6);
  CHECK_OK(lz_swiglu_backward(tdg, tdu, td, tg, tu));
  CHECK_NEAR(dg[0], 1.5, 1e-7); /* 3 * 1/2 */
  CHECK(du[0] == 0.0f);
  CHECK_NEAR(dg[1], 5.0 * sig2 * (1.0 + 2.0 * (1.0 - sig2)), 1e-6);
  CHECK_NEAR(du[1], 2.0 * sig2, 1e-6);
  lz_tensor *ts[] = {tg, tu, tout, td, tdg, tdu};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* out over gate, dgate over dout and dup over up: the same numbers. */
LZ_TEST(swiglu_in_place) {
  enum { N = 1000 };
  float g[N], u[N], d[N], out[N], dg[N], du[N], b1[N], b2[N], b3[N];
  for (int i = 0; i < N; i++) g[i] = 4.0f * frand(), u[i] = frand(), d[i] = frand();
  const int64_t s[1] = {N};
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 1, s), *tu = lz_test_wrap(u, LZ_F32, 1, s);
  lz_tensor *td = lz_test_wrap(d, LZ_F32, 1, s), *tout = lz_test_wrap(out, LZ_F32, 1, s);
  lz_tensor *tdg = lz_test_wrap(dg, LZ_F32, 1, s), *tdu = lz_test_wrap(du, LZ_F32, 1, s);
  lz_tensor *t1 = lz_test_wrap(b1, LZ_F32, 1, s), *t2 = lz_test_wrap(b2, LZ_F32, 1, s);
  lz_tensor *t3 = lz_test_wrap(b3, LZ_F32, 1, s);
  CHECK_OK(lz_swiglu_forward(tout, tg, tu));
  memcpy(b1, g, sizeof g);
  CHECK_OK(lz_swiglu_forward(t1, t1, tu));
  CHECK(memcmp(b1, out, sizeof out) == 0);
  CHECK_OK(lz_swiglu_backward(tdg, tdu, td, tg, tu));
  memcpy(b1, d, sizeof d), memcpy(b2, g, sizeof g), memcpy(b3, u, sizeof u);
  CHECK_OK(lz_swiglu_backward(t1, t3, t1, t2, t3));
  CHECK(memcmp(b1, dg, sizeof dg) == 0);
  CHECK(memcmp(b3, du, sizeof du) == 0);
  lz_tensor *ts[] = {tg, tu, td, tout, tdg, tdu, t1, t2, t3};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

LZ_TEST(swiglu_errors) {
  float buf[64] = {0};
  const int64_t s8[2] = {2, 4}, s9[1] = {9};
  lz_tensor *a = lz_test_wrap(buf, LZ_F32, 2, s8), *b = lz_test_wrap(buf + 8, LZ_F32, 2, s8);
  lz_tensor *y9 = lz_test_wrap(buf, LZ_F32, 1, s9), *ab = lz_test_wrap(buf, LZ_BF16, 2, s8);
  lz_tensor *ac = on_cuda(lz_test_wrap(buf, LZ_F32, 2, s8));
  CHECK_ERR(lz_swiglu_forward(y9, a, a), LZ_ERR_INVALID,
            "swiglu_forward: out is f32[9] but gate is f32[2,4]");
  CHECK_ERR(lz_swiglu_forward(a, a, y9), LZ_ERR_INVALID,
            "swiglu_forward: up is f32[9] but gate is f32[2,4]");
  CHECK_ERR(lz_swiglu_forward(a, ab, a), LZ_ERR_INVALID,
            "swiglu_forward: gate is bf16[2,4] and up is f32[2,4]; both must be f32 or both bf16");
  CHECK_ERR(lz_swiglu_forward(a, ab, ab), LZ_ERR_INVALID,
            "swiglu_forward: out (f32) and gate (bf16) are the same memory");
  CHECK_ERR(lz_swiglu_forward(NULL, a, a), LZ_ERR_INVALID, "swiglu_forward: out is missing");
  CHECK_ERR(lz_swiglu_forward(a, a, ac), LZ_ERR_INVALID,
            "swiglu_forward: out lives on cpu but up lives on cuda");
  /* All on cuda without cuda (with a GPU, the kernel would run on ac's host
   * memory: tests/cuda runs it on device memory). */
  if (!lz_cuda_ready())
    CHECK_ERR(lz_swiglu_forward(ac, ac, ac), LZ_ERR_UNSUPPORTED,
              "swiglu_forward: cuda is not initialized");
  CHECK_ERR(lz_swiglu_backward(a, b, y9, a, a), LZ_ERR_INVALID, "swiglu_backward: dout is f32[9]");
  CHECK_ERR(lz_swiglu_backward(a, y9, a, a, a), LZ_ERR_INVALID, "swiglu_backward: dup is f32[9]");
  CHECK_ERR(lz_swiglu_backward(a, a, a, a, a), LZ_ERR_INVALID,
            "swiglu_backward: dgate and dup are the same memory");
  lz_tensor_free(a), lz_tensor_free(b), lz_tensor_free(y9), lz_tensor_free(ab);
  lz_tensor_free(ac);
}

/* silu over a dense sweep of gates (the exponential is swiglu.c's own):
 * within 1e-6 of the double value, element by element, down to gate -60;
 * below, where e^-g nears the end of the floats, tiny. NaN stays NaN,
 * silu(Inf) is Inf, silu(-Inf) is NaN (as in PyTorch). */
LZ_TEST(swiglu_silu_dense) {
  enum { N = 200000 };
  static float g[N], u[N], out[N];
  for (int i = 0; i < N; i++) g[i] = -100.0f + 200.0f * (float)i / N, u[i] = 1.0f;
  g[0] = NAN, g[1] = INFINITY, g[2] = -INFINITY;
  const int64_t s[1] = {N};
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 1, s), *tu = lz_test_wrap(u, LZ_F32, 1, s);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 1, s);
  CHECK_OK(lz_swiglu_forward(tout, tg, tu));
  double worst = 0.0, tail = 0.0;
  for (int i = 3; i < N; i++) {
    const double ref = (double)g[i] / (1.0 + exp(-(double)g[i]));
    if (g[i] >= -60.0f) {
      const double e = fabs(out[i] - ref) / fmax(fabs(ref), 1e-30);
      worst = e > worst ? e : worst;
    } else {
      tail = fabs(out[i]) > tail ? fabs(out[i]) : tail;
    }
  }
  CHECK(worst <= 1e-6);
  CHECK(tail <= 1e-24);
  CHECK(isnan(out[0]));
  CHECK(out[1] == INFINITY);
  CHECK(isnan(out[2]));
  lz_tensor_free(tg), lz_tensor_free(tu), lz_tensor_free(tout);
}

/* ------------------------------------------------------------------- bf16 */

/* bf16 inputs are widened and go through the f32 code: each kernel must give
 * bitwise what it gives on the widened values as f32. */

static lz_tensor *new_t(lz_dtype dt, int ndim, const int64_t *shape) {
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_new(&t, dt, ndim, shape, LZ_MEM_WORKSPACE));
  return t;
}

/* A random bf16 tensor and its f32 widening. */
static void rand_pair(lz_tensor **b, lz_tensor **f, int ndim, const int64_t *shape, float amp) {
  *b = new_t(LZ_BF16, ndim, shape);
  *f = new_t(LZ_F32, ndim, shape);
  const int64_t n = lz_tensor_numel(*f);
  uint16_t *hb = (*b)->data;
  float *pf = (*f)->data;
  for (int64_t i = 0; i < n; i++) {
    hb[i] = lz_f32_to_bf16(amp * frand());
    pf[i] = lz_bf16_to_f32(hb[i]);
  }
}

static void check_same_bits(const char *what, const lz_tensor *a, const lz_tensor *b) {
  const int64_t n = lz_tensor_numel(a);
  if (memcmp(a->data, b->data, (size_t)n * sizeof(float)) != 0)
    lz_test_fail(__FILE__, __LINE__, "%s: bf16 result differs from the f32 one", what);
}

static void free_all(lz_tensor **ts, int n) {
  for (int i = 0; i < n; i++) lz_tensor_free(ts[i]);
}

static void rmsnorm_bf16_case(int64_t rows, int64_t C) {
  const int64_t sx[2] = {rows, C}, sw[1] = {C}, sr[1] = {rows};
  lz_tensor *xb, *xf, *wb, *wf, *dyb, *dyf;
  rand_pair(&xb, &xf, 2, sx, 2.0f);
  rand_pair(&wb, &wf, 1, sw, 1.5f);
  rand_pair(&dyb, &dyf, 2, sx, 1.0f);
  lz_tensor *o1 = new_t(LZ_F32, 2, sx), *o2 = new_t(LZ_F32, 2, sx);
  lz_tensor *r1 = new_t(LZ_F32, 1, sr), *r2 = new_t(LZ_F32, 1, sr);
  lz_tensor *d1 = new_t(LZ_F32, 2, sx), *d2 = new_t(LZ_F32, 2, sx);
  lz_tensor *g1 = new_t(LZ_F32, 1, sw), *g2 = new_t(LZ_F32, 1, sw);
  CHECK_OK(lz_rmsnorm_forward(o1, r1, xb, wb, 1e-5f));
  CHECK_OK(lz_rmsnorm_forward(o2, r2, xf, wf, 1e-5f));
  check_same_bits("rmsnorm forward out", o1, o2);
  check_same_bits("rmsnorm forward rstd", r1, r2);
  CHECK_OK(lz_fill(g1, 0.25f));
  CHECK_OK(lz_fill(g2, 0.25f));
  CHECK_OK(lz_rmsnorm_backward(d1, g1, dyb, xb, wb, r1));
  CHECK_OK(lz_rmsnorm_backward(d2, g2, dyf, xf, wf, r2));
  check_same_bits("rmsnorm backward dx", d1, d2);
  check_same_bits("rmsnorm backward dw", g1, g2);
  lz_tensor *ts[] = {xb, xf, wb, wf, dyb, dyf, o1, o2, r1, r2, d1, d2, g1, g2};
  free_all(ts, 14);
}

LZ_TEST(rmsnorm_bf16_is_f32_on_widened_inputs) {
  rmsnorm_bf16_case(3, 37);
  rmsnorm_bf16_case(64, 1024); /* threaded */
  rmsnorm_bf16_case(5, 5000);  /* the two-pass backward */
}

LZ_TEST(rmsnorm_bf16_errors) {
  const int64_t sx[2] = {2, 8}, sw[1] = {8}, sr[1] = {2};
  lz_tensor *xb = new_t(LZ_BF16, 2, sx), *wf = new_t(LZ_F32, 1, sw), *out = new_t(LZ_F32, 2, sx);
  lz_tensor *r = new_t(LZ_F32, 1, sr), *xf = new_t(LZ_F32, 2, sx);
  CHECK_ERR(lz_rmsnorm_forward(out, r, xb, wf, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: x is bf16[2,8] and w is f32[8]; both must be f32 or both bf16");
  CHECK_ERR(lz_rmsnorm_backward(out, wf, xf, xb, wf, r), LZ_ERR_INVALID,
            "rmsnorm_backward: x is bf16[2,8] and dy is f32[2,8]; both must be f32 or both bf16");
  lz_tensor *ts[] = {xb, wf, out, r, xf};
  free_all(ts, 5);
}

static void rope_bf16_case(int64_t B, int64_t T, int n_head, int head_dim, int64_t pos) {
  const int64_t sx[3] = {B, T, (int64_t)n_head * head_dim}, sf[1] = {head_dim / 2};
  lz_tensor *xb, *xf;
  rand_pair(&xb, &xf, 3, sx, 1.0f);
  lz_tensor *o1 = new_t(LZ_F32, 3, sx), *o2 = new_t(LZ_F32, 3, sx), *o3 = new_t(LZ_F32, 3, sx);
  lz_tensor *freqs = new_t(LZ_F32, 1, sf);
  float *fp = freqs->data;
  for (int i = 0; i < head_dim / 2; i++) fp[i] = (float)pow(10000.0, -2.0 * i / (double)head_dim);
  /* the theta form and the inv_freq form agree, bf16 or f32 */
  CHECK_OK(lz_rope_forward(o1, xb, n_head, head_dim, pos, 10000.0f));
  CHECK_OK(lz_rope_forward(o2, xf, n_head, head_dim, pos, 10000.0f));
  CHECK_OK(lz_rope_freqs_forward(o3, xb, freqs, n_head, pos));
  check_same_bits("rope forward", o1, o2);
  check_same_bits("rope_freqs forward", o3, o2);
  CHECK_OK(lz_rope_backward(o1, xb, n_head, head_dim, pos, 10000.0f));
  CHECK_OK(lz_rope_backward(o2, xf, n_head, head_dim, pos, 10000.0f));
  CHECK_OK(lz_rope_freqs_backward(o3, xf, freqs, n_head, pos));
  check_same_bits("rope backward", o1, o2);
  check_same_bits("rope_freqs backward", o3, o2);
  lz_tensor *ts[] = {xb, xf, o1, o2, o3, freqs};
  free_all(ts, 6);
}

LZ_TEST(rope_bf16_and_freqs_match) {
  rope_bf16_case(2, 5, 3, 8, 0);
  rope_bf16_case(2, 64, 8, 128, 7); /* threaded */
}

/* Scaled frequencies (Llama 3) turn each pair by pos * inv_freq[i]: a row at
 * position p of a unit vector (1 at i, 0 at i + half) becomes (cos, sin). */
LZ_TEST(rope_freqs_uses_the_given_frequencies) {
  const int64_t sx[3] = {1, 3, 4}, sf[1] = {2};
  float xd[12] = {1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0}, fd_[3] = {0.5f, 0.0078125f, 1.0f}, od[12];
  lz_tensor *x = lz_test_wrap(xd, LZ_F32, 3, sx), *o = lz_test_wrap(od, LZ_F32, 3, sx);
  lz_tensor *f = lz_test_wrap(fd_, LZ_F32, 1, sf);
  CHECK_OK(lz_rope_freqs_forward(o, x, f, 1, 10));
  for (int t = 0; t < 3; t++) {
    CHECK_NEAR(od[4 * t], cos((10 + t) * 0.5), 1e-6);
    CHECK_NEAR(od[4 * t + 2], sin((10 + t) * 0.5), 1e-6);
    CHECK_NEAR(od[4 * t + 1], 0.0, 1e-7);
  }
  fd_[1] = NAN;
  CHECK_ERR(lz_rope_freqs_forward(o, x, f, 1, 0), LZ_ERR_INVALID,
            "rope_forward: inv_freq[1] is nan; it must be finite");
  fd_[1] = 0.25f;
  const int64_t s3[1] = {3};
  lz_tensor *f3 = lz_test_wrap(fd_, LZ_F32, 1, s3);
  CHECK_ERR(lz_rope_freqs_forward(o, x, f3, 1, 0), LZ_ERR_INVALID,
            "rope_forward: x is f32[1,3,4], but n_head * head_dim = 1 * 6 = 6; the last "
            "dimension must hold the heads (it may hold more)");
  lz_tensor_free(x), lz_tensor_free(o), lz_tensor_free(f), lz_tensor_free(f3);
}

static void swiglu_bf16_case(int64_t n) {
  const int64_t s[1] = {n};
  lz_tensor *gb, *gf, *ub, *uf, *db, *df;
  rand_pair(&gb, &gf, 1, s, 6.0f);
  rand_pair(&ub, &uf, 1, s, 2.0f);
  rand_pair(&db, &df, 1, s, 1.0f);
  lz_tensor *o1 = new_t(LZ_F32, 1, s), *o2 = new_t(LZ_F32, 1, s);
  lz_tensor *p1 = new_t(LZ_F32, 1, s), *p2 = new_t(LZ_F32, 1, s);
  CHECK_OK(lz_swiglu_forward(o1, gb, ub));
  CHECK_OK(lz_swiglu_forward(o2, gf, uf));
  check_same_bits("swiglu forward", o1, o2);
  CHECK_OK(lz_swiglu_backward(o1, p1, db, gb, ub));
  CHECK_OK(lz_swiglu_backward(o2, p2, df, gf, uf));
  check_same_bits("swiglu backward dgate", o1, o2);
  check_same_bits("swiglu backward dup", p1, p2);
  lz_tensor *ts[] = {gb, gf, ub, uf, db, df, o1, o2, p1, p2};
  free_all(ts, 10);
}

LZ_TEST(swiglu_bf16_is_f32_on_widened_inputs) {
  swiglu_bf16_case(8 * 37 + 3);
  swiglu_bf16_case(8 * 50001); /* threaded, chunks and a tail */
}

/* Packed rows: the first n_head heads turn (as a tensor of those heads
 * alone would), the rest is copied, or left alone in place. */
LZ_TEST(rope_freqs_turns_the_leading_heads_of_a_packed_row) {
  const int64_t B = 2, T = 9, HD = 8, NR = 3, NT = 5; /* 3 heads turn, 2 pass */
  const int64_t sp[3] = {B, T, NT * HD}, sr[3] = {B, T, NR * HD}, sf[1] = {HD / 2};
  lz_tensor *xb, *x;
  rand_pair(&xb, &x, 3, sp, 1.0f);
  lz_tensor *o = new_t(LZ_F32, 3, sp), *ob = new_t(LZ_F32, 3, sp), *lead = new_t(LZ_F32, 3, sr);
  lz_tensor *lo = new_t(LZ_F32, 3, sr), *f = new_t(LZ_F32, 1, sf);
  float *fp = f->data, *xp = x->data, *lp = lead->data;
  for (int i = 0; i < HD / 2; i++) fp[i] = 1.0f / (float)(i + 2);
  for (int64_t r = 0; r < B * T; r++)
    for (int64_t c = 0; c < NR * HD; c++) lp[r * NR * HD + c] = xp[r * NT * HD + c];
  CHECK_OK(lz_rope_freqs_forward(o, x, f, (int)NR, 4));
  CHECK_OK(lz_rope_freqs_forward(ob, xb, f, (int)NR, 4));
  CHECK_OK(lz_rope_freqs_forward(lo, lead, f, (int)NR, 4));
  check_same_bits("packed rope: bf16 = f32", ob, o);
  const float *op = o->data, *lop = lo->data;
  for (int64_t r = 0; r < B * T; r++) {
    CHECK(memcmp(op + r * NT * HD, lop + r * NR * HD, sizeof(float) * NR * HD) == 0);
    CHECK(memcmp(op + r * NT * HD + NR * HD, xp + r * NT * HD + NR * HD,
                 sizeof(float) * (NT - NR) * HD) == 0);
  }
  CHECK_OK(lz_rope_freqs_forward(x, x, f, (int)NR, 4)); /* in place */
  check_same_bits("packed rope in place", x, o);
  lz_tensor *ts[] = {xb, x, o, ob, lead, lo, f};
  free_all(ts, 7);
}

/* ------------------------------------------------------- bf16 outputs */

/* A kernel's bf16 out (a GEMM operand written directly) must be bitwise its
 * f32 out converted by tensor_copy: the cast pass it replaces. */
static void check_rounded(const char *what, const lz_tensor *out_bf16, const lz_tensor *out_f32) {
  lz_tensor *want = new_t(LZ_BF16, out_f32->ndim, out_f32->shape);
  CHECK_OK(lz_tensor_copy(want, out_f32));
  const int64_t n = lz_tensor_numel(want);
  if (memcmp(want->data, out_bf16->data, (size_t)n * 2) != 0)
    lz_test_fail(__FILE__, __LINE__, "%s: bf16 out differs from the f32 out converted", what);
  lz_tensor_free(want);
}

static void rmsnorm_bf16_out_case(int64_t rows, int64_t C) {
  const int64_t sx[2] = {rows, C}, sw[1] = {C}, sr[1] = {rows};
  lz_tensor *xb, *xf, *wb, *wf;
  rand_pair(&xb, &xf, 2, sx, 2.0f);
  rand_pair(&wb, &wf, 1, sw, 1.5f);
  lz_tensor *of = new_t(LZ_F32, 2, sx), *ob = new_t(LZ_BF16, 2, sx);
  lz_tensor *r1 = new_t(LZ_F32, 1, sr), *r2 = new_t(LZ_F32, 1, sr);
  for (int in_bf16 = 0; in_bf16 < 2; in_bf16++) {
    const lz_tensor *x = in_bf16 ? xb : xf, *w = in_bf16 ? wb : wf;
    CHECK_OK(lz_rmsnorm_forward(of, r1, x, w, 1e-5f));
    CHECK_OK(lz_rmsnorm_forward(ob, r2, x, w, 1e-5f));
    check_rounded("rmsnorm forward", ob, of);
    check_same_bits("rmsnorm forward rstd (bf16 out)", r2, r1);
  }
  lz_tensor *ts[] = {xb, xf, wb, wf, of, ob, r1, r2};
  free_all(ts, 8);
}

LZ_TEST(rmsnorm_bf16_out_is_the_f32_out_rounded) {
  rmsnorm_bf16_out_case(3, 37);
  rmsnorm_bf16_out_case(64, 1024); /* threaded */
  const int64_t sx[2] = {2, 8}, sw[1] = {8}, sr[1] = {2};
  lz_tensor *x = new_t(LZ_F32, 2, sx), *w = new_t(LZ_F32, 1, sw), *r = new_t(LZ_F32, 1, sr);
  CHECK_OK(lz_fill(x, 1.0f));
  CHECK_OK(lz_fill(w, 1.0f));
  lz_tensor over = *x;
  over.dtype = LZ_BF16; /* a bf16 view of x's own memory */
  CHECK_ERR(lz_rmsnorm_forward(&over, r, x, w, 1e-5f), LZ_ERR_INVALID,
            "rmsnorm_forward: a bf16 out must be its own memory");
  lz_tensor *ts[] = {x, w, r};
  free_all(ts, 3);
}

/* SwiGLU and GeGLU, f32 and bf16 inputs, and the packed form. */
static void gated_bf16_out_case(int64_t rows, int64_t H) {
  const int64_t s[2] = {rows, H}, sp[2] = {rows, 2 * H};
  lz_tensor *gb, *gf, *ub, *uf, *pb, *pf;
  rand_pair(&gb, &gf, 2, s, 6.0f);
  rand_pair(&ub, &uf, 2, s, 2.0f);
  rand_pair(&pb, &pf, 2, sp, 4.0f);
  lz_tensor *of = new_t(LZ_F32, 2, s), *ob = new_t(LZ_BF16, 2, s);
  for (int in_bf16 = 0; in_bf16 < 2; in_bf16++) {
    const lz_tensor *g = in_bf16 ? gb : gf, *u = in_bf16 ? ub : uf, *p = in_bf16 ? pb : pf;
    CHECK_OK(lz_swiglu_forward(of, g, u));
    CHECK_OK(lz_swiglu_forward(ob, g, u));
    check_rounded("swiglu forward", ob, of);
    CHECK_OK(lz_geglu_forward(of, g, u));
    CHECK_OK(lz_geglu_forward(ob, g, u));
    check_rounded("geglu forward", ob, of);
    CHECK_OK(lz_swiglu_packed_forward(of, p));
    CHECK_OK(lz_swiglu_packed_forward(ob, p));
    check_rounded("swiglu packed forward", ob, of);
  }
  /* backward: dgate and dup (dgu packed) in bf16 */
  lz_tensor *db, *df, *dgf = new_t(LZ_F32, 2, s), *duf = new_t(LZ_F32, 2, s);
  lz_tensor *dgb = new_t(LZ_BF16, 2, s), *dub = new_t(LZ_BF16, 2, s);
  lz_tensor *dpf = new_t(LZ_F32, 2, sp), *dpb = new_t(LZ_BF16, 2, sp);
  rand_pair(&db, &df, 2, s, 1.0f);
  for (int in_bf16 = 0; in_bf16 < 2; in_bf16++) {
    const lz_tensor *g = in_bf16 ? gb : gf, *u = in_bf16 ? ub : uf, *p = in_bf16 ? pb : pf;
    const lz_tensor *d = in_bf16 ? db : df;
    CHECK_OK(lz_swiglu_backward(dgf, duf, d, g, u));
    CHECK_OK(lz_swiglu_backward(dgb, dub, d, g, u));
    check_rounded("swiglu backward dgate", dgb, dgf);
    check_rounded("swiglu backward dup", dub, duf);
    CHECK_OK(lz_geglu_backward(dgf, duf, d, g, u));
    CHECK_OK(lz_geglu_backward(dgb, dub, d, g, u));
    check_rounded("geglu backward dgate", dgb, dgf);
    check_rounded("geglu backward dup", dub, duf);
    CHECK_OK(lz_swiglu_packed_backward(dpf, d, p));
    CHECK_OK(lz_swiglu_packed_backward(dpb, d, p));
    check_rounded("swiglu packed backward", dpb, dpf);
  }
  lz_tensor over = *gf;
  over.dtype = LZ_BF16;
  CHECK_ERR(lz_swiglu_forward(&over, gf, uf), LZ_ERR_INVALID,
            "swiglu_forward: a bf16 out shares memory with an input");
  CHECK_ERR(lz_swiglu_backward(dgb, &over, df, gf, uf), LZ_ERR_INVALID,
            "swiglu_backward: a bf16 out shares memory with an input");
  lz_tensor *ts[] = {gb, gf, ub, uf, pb, pf, of, ob, db, df, dgf, duf, dgb, dub, dpf, dpb};
  free_all(ts, 16);
}

LZ_TEST(gated_bf16_out_is_the_f32_out_rounded) {
  gated_bf16_out_case(3, 37);
  gated_bf16_out_case(16, 2048); /* threaded, chunks and rows */
}

/* RoPE's backward into a bf16 dx (the q|k|v projection's output gradient):
 * packed rows (q and k heads turn, v passes), positions from an offset, from
 * pos, and partial heads with scaled cos and sin. */
LZ_TEST(rope_backward_bf16_dx_is_the_f32_dx_rounded) {
  const int64_t B = 2, T = 9, HD = 8, NR = 3, NT = 5;
  const int64_t sp[3] = {B, T, NT * HD}, sf[1] = {HD / 2}, sf2[1] = {HD / 4}, spos[2] = {B, T};
  lz_tensor *yb, *y;
  rand_pair(&yb, &y, 3, sp, 1.0f);
  lz_tensor *df = new_t(LZ_F32, 3, sp), *db = new_t(LZ_BF16, 3, sp);
  lz_tensor *f = new_t(LZ_F32, 1, sf), *f2 = new_t(LZ_F32, 1, sf2), *pos = new_t(LZ_I32, 2, spos);
  float *fp = f->data, *fp2 = f2->data;
  for (int i = 0; i < HD / 2; i++) fp[i] = 1.0f / (float)(i + 2);
  for (int i = 0; i < HD / 4; i++) fp2[i] = 1.0f / (float)(i + 3);
  int32_t *pp = pos->data;
  for (int64_t i = 0; i < B * T; i++) pp[i] = (int32_t)((i * 5) % 7);
  CHECK_OK(lz_rope_freqs_backward(df, y, f, (int)NR, 4));
  CHECK_OK(lz_rope_freqs_backward(db, y, f, (int)NR, 4));
  check_rounded("rope_freqs backward", db, df);
  CHECK_OK(lz_rope_pos_backward(df, y, f, pos, (int)NR));
  CHECK_OK(lz_rope_pos_backward(db, y, f, pos, (int)NR));
  check_rounded("rope_pos backward", db, df);
  CHECK_OK(lz_rope_ext_backward(df, y, f2, NULL, (int)NR, (int)HD, 3, 1.25f));
  CHECK_OK(lz_rope_ext_backward(db, y, f2, NULL, (int)NR, (int)HD, 3, 1.25f));
  check_rounded("rope_ext backward", db, df);
  CHECK_ERR(lz_rope_freqs_backward(db, yb, f, (int)NR, 4), LZ_ERR_INVALID,
            "rope_backward: a bf16 dx takes an f32 dy");
  lz_tensor *ts[] = {yb, y, df, db, f, f2, pos};
  free_all(ts, 7);
}
