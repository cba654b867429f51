/* test_layernorm.c — layernorm forward against a double reference, backward
 * against central differences of that reference, determinism (thread count,
 * one-pass against two-pass backward), errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { return lz_test_uniform(&rng); }

/* The double reference: out = (x - mean) / sqrt(var + eps) * w + b per row;
 * returns L = sum(out * dy), the loss whose gradient backward computes. */
static double ref_forward(double *out, const double *x, const double *w, const double *b,
                          const double *dy, int64_t rows, int64_t C, double eps) {
  double loss = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    const double *xr = x + r * C;
    double m = 0.0, v = 0.0;
    for (int64_t i = 0; i < C; i++) m += xr[i];
    m /= (double)C;
    for (int64_t i = 0; i < C; i++) v += (xr[i] - m) * (xr[i] - m);
    v /= (double)C;
    double s = 1.0 / sqrt(v + eps);
    for (int64_t i = 0; i < C; i++) {
      double o = (xr[i] - m) * s * w[i] + b[i];
      if (out) out[r * C + i] = o;
      loss += o * dy[r * C + i];
    }
  }
  return loss;
}

/* Central difference of ref_forward's loss in element i of `p`. */
static double fd(double *p, int64_t i, const double *x, const double *w, const double *b,
                 const double *dy, int64_t rows, int64_t C, double eps) {
  const double h = 1e-5, keep = p[i];
  p[i] = keep + h;
  double up = ref_forward(NULL, x, w, b, dy, rows, C, eps);
  p[i] = keep - h;
  double down = ref_forward(NULL, x, w, b, dy, rows, C, eps);
  p[i] = keep;
  return (up - down) / (2 * h);
}

/* Runs forward and backward on random data of the given size and checks them
 * against the reference; `stride` > 1 checks only every stride-th gradient
 * entry (central differences cost a full forward each). */
static void check_case(int64_t B, int64_t T, int64_t C, int64_t stride) {
  const int64_t rows = B * T, n = rows * C;
  const float eps = 1e-5f;
  float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
  float *dy = malloc(sizeof(float) * n), *dx = malloc(sizeof(float) * n);
  float *w = malloc(sizeof(float) * C), *b = malloc(sizeof(float) * C);
  float *dw = malloc(sizeof(float) * C), *db = malloc(sizeof(float) * C);
  float *dw0 = malloc(sizeof(float) * C), *db0 = malloc(sizeof(float) * C);
  float *mean = malloc(sizeof(float) * rows), *rstd = malloc(sizeof(float) * rows);
  double *xd = malloc(sizeof(double) * n), *dyd = malloc(sizeof(double) * n);
  double *outd = malloc(sizeof(double) * n), *wd = malloc(sizeof(double) * C);
  double *bd = malloc(sizeof(double) * C);
  /* Rows with a mean far from zero test the two-pass variance. */
  for (int64_t i = 0; i < n; i++) x[i] = 3.0f + 2.0f * frand();
  for (int64_t i = 0; i < n; i++) dy[i] = frand();
  for (int64_t i = 0; i < C; i++) {
    w[i] = 1.0f + 0.5f * frand();
    b[i] = 0.5f * frand();
    dw0[i] = dw[i] = frand(); /* parameter gradients accumulate */
    db0[i] = db[i] = frand();
  }
  for (int64_t i = 0; i < n; i++) xd[i] = x[i], dyd[i] = dy[i];
  for (int64_t i = 0; i < C; i++) wd[i] = w[i], bd[i] = b[i];

  const int64_t s3[3] = {B, T, C}, sc[1] = {C}, sr[2] = {B, T};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *tout = lz_test_wrap(out, LZ_F32, 3, s3);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 3, s3), *tdx = lz_test_wrap(dx, LZ_F32, 3, s3);
  lz_tensor *tw = lz_test_wrap(w, LZ_F32, 1, sc), *tb = lz_test_wrap(b, LZ_F32, 1, sc);
  lz_tensor *tdw = lz_test_wrap(dw, LZ_F32, 1, sc), *tdb = lz_test_wrap(db, LZ_F32, 1, sc);
  lz_tensor *tmean = lz_test_wrap(mean, LZ_F32, 2, sr), *trstd = lz_test_wrap(rstd, LZ_F32, 2, sr);

  CHECK_OK(lz_layernorm_forward(tout, tmean, trstd, tx, tw, tb, eps));
  ref_forward(outd, xd, wd, bd, dyd, rows, C, eps);
  /* fp32 rounding of x - mean (x near 3, so ulp ~ 5e-7) bounds this. */
  CHECK(lz_test_rel_err(out, outd, n) <= 5e-5);
  for (int64_t r = 0; r < rows; r++) {
    double m = 0.0;
    for (int64_t i = 0; i < C; i++) m += xd[r * C + i];
    CHECK_NEAR(mean[r], m / (double)C, 1e-6);
  }

  CHECK_OK(lz_layernorm_backward(tdx, tdw, tdb, tdy, tx, tw, tmean, trstd));
  /* Compare the sampled entries: analytic (fp32) against differences (double). */
  int64_t nx = 0, nc = 0;
  float *ga = malloc(sizeof(float) * (n + 2 * C));
  double *gd = malloc(sizeof(double) * (n + 2 * C));
  for (int64_t i = 0; i < n; i += stride, nx++) {
    ga[nx] = dx[i];
    gd[nx] = fd(xd, i, xd, wd, bd, dyd, rows, C, eps);
  }
  CHECK(lz_test_rel_err(ga, gd, nx) <= 1e-3);
  for (int64_t i = 0; i < C; i += (stride > 1 ? 7 : 1), nc++) {
    ga[nc] = dw[i] - dw0[i];
    gd[nc] = fd(wd, i, xd, wd, bd, dyd, rows, C, eps);
  }
  CHECK(lz_test_rel_err(ga, gd, nc) <= 1e-3);
  nc = 0;
  for (int64_t i = 0; i < C; i += (stride > 1 ? 7 : 1), nc++) {
    ga[nc] = db[i] - db0[i];
    gd[nc] = fd(bd, i, xd, wd, bd, dyd, rows, C, eps);
  }
  CHECK(lz_test_rel_err(ga, gd, nc) <= 1e-3);

  free(ga), free(gd);
  lz_tensor *ts[] = {tx, tout, tdy, tdx, tw, tb, tdw, tdb, tmean, trstd};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(out), free(dy), free(dx), free(w), free(b), free(dw), free(db);
  free(dw0), free(db0), free(mean), free(rstd), free(xd), free(dyd), free(outd), free(wd);
  free(bd);
}

LZ_TEST(layernorm_small_against_reference) { check_case(2, 3, 37, 1); }

/* Big enough for the threaded path (and C a multiple of the lane count). */
LZ_TEST(layernorm_large_against_reference) { check_case(4, 16, 768, 97); }

/* Tensors over the arrays of one layernorm of rows x C: activations and
 * their gradients [rows, C], weights and theirs [C], statistics [rows]. */
typedef struct {
  lz_tensor *x, *dy, *out, *dx, *w, *b, *dw, *db, *mean, *rstd;
} ln_tensors;

static ln_tensors ln_wrap(int64_t rows, int64_t C, float *x, float *dy, float *out, float *dx,
                          float *w, float *b, float *dw, float *db, float *mean, float *rstd) {
  const int64_t s2[2] = {rows, C}, sc[1] = {C}, sr[1] = {rows};
  return (ln_tensors){lz_test_wrap(x, LZ_F32, 2, s2),    lz_test_wrap(dy, LZ_F32, 2, s2),
                      lz_test_wrap(out, LZ_F32, 2, s2),  lz_test_wrap(dx, LZ_F32, 2, s2),
                      lz_test_wrap(w, LZ_F32, 1, sc),    lz_test_wrap(b, LZ_F32, 1, sc),
                      lz_test_wrap(dw, LZ_F32, 1, sc),   lz_test_wrap(db, LZ_F32, 1, sc),
                      lz_test_wrap(mean, LZ_F32, 1, sr), lz_test_wrap(rstd, LZ_F32, 1, sr)};
}

static void ln_free(ln_tensors *t) {
  lz_tensor *ts[] = {t->x, t->dy, t->out, t->dx, t->w, t->b, t->dw, t->db, t->mean, t->rstd};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* dw, db, dx do not depend on the thread count, to the bit. */
LZ_TEST(layernorm_backward_deterministic) {
  enum { ROWS = 96, C = 520 };
  static float x[ROWS * C], dy[ROWS * C], out[ROWS * C], w[C], b[C], mean[ROWS], rstd[ROWS];
  static float dx[2][ROWS * C], dw[2][C], db[2][C];
  for (int i = 0; i < ROWS * C; i++) x[i] = frand(), dy[i] = frand();
  for (int i = 0; i < C; i++) w[i] = frand(), b[i] = frand();
  ln_tensors t[2];
  for (int k = 0; k < 2; k++)
    t[k] = ln_wrap(ROWS, C, x, dy, out, dx[k], w, b, dw[k], db[k], mean, rstd);
  CHECK_OK(lz_layernorm_forward(t[0].out, t[0].mean, t[0].rstd, t[0].x, t[0].w, t[0].b, 1e-5f));
  const int saved = lz_threads_get();
  for (int k = 0; k < 2; k++) {
    CHECK_OK(lz_threads_set(k + 1));
    CHECK_OK(lz_layernorm_backward(t[k].dx, t[k].dw, t[k].db, t[k].dy, t[k].x, t[k].w, t[k].mean,
                                   t[k].rstd));
  }
  lz_threads_set(saved);
  CHECK(memcmp(dx[0], dx[1], sizeof dx[0]) == 0);
  CHECK(memcmp(dw[0], dw[1], sizeof dw[0]) == 0);
  CHECK(memcmp(db[0], db[1], sizeof db[0]) == 0);
  for (int k = 0; k < 2; k++) ln_free(&t[k]);
}

/* Not API: layernorm.c's widest rows for the one-pass backward; 0 forces the
 * two-pass path. */
extern int64_t lz_layernorm_fused_max_cols;

/* Backward of rows x C random rows into dx, dw, db (which start from the same
 * nonzero dw, db each time), on `threads` threads, one-pass or two-pass. */
static void backward_with(float *dx, float *dw, float *db, int64_t rows, int64_t C, int threads,
                          int two_pass) {
  const int64_t n = rows * C;
  float *x = malloc(sizeof(float) * n), *dy = malloc(sizeof(float) * n);
  float *out = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * C);
  float *b = malloc(sizeof(float) * C), *mean = malloc(sizeof(float) * rows);
  float *rstd = malloc(sizeof(float) * rows);
  uint64_t keep = rng;
  rng = 0x243F6A8885A308D3ull; /* the same data on every call */
  for (int64_t i = 0; i < n; i++) x[i] = 3.0f + frand(), dy[i] = frand();
  for (int64_t i = 0; i < C; i++) w[i] = frand(), b[i] = frand(), dw[i] = frand(), db[i] = frand();
  rng = keep;
  ln_tensors t = ln_wrap(rows, C, x, dy, out, dx, w, b, dw, db, mean, rstd);
  const int saved_threads = lz_threads_get();
  const int64_t saved_cols = lz_layernorm_fused_max_cols;
  CHECK_OK(lz_threads_set(threads));
  if (two_pass) lz_layernorm_fused_max_cols = 0;
  CHECK_OK(lz_layernorm_forward(t.out, t.mean, t.rstd, t.x, t.w, t.b, 1e-5f));
  CHECK_OK(lz_layernorm_backward(t.dx, t.dw, t.db, t.dy, t.x, t.w, t.mean, t.rstd));
  lz_layernorm_fused_max_cols = saved_cols;
  lz_threads_set(saved_threads);
  ln_free(&t);
  free(x), free(dy), free(out), free(w), free(b), free(mean), free(rstd);
}

/* The one-pass and two-pass backward sum dw, db in the same order: equal to
 * the bit, and so are dx. Odd sizes: uneven row blocks, a scalar tail. */
LZ_TEST(layernorm_backward_two_pass_matches_one_pass) {
  const int64_t shapes[3][2] = {{300, 520}, {7, 37}, {1000, 768}};
  for (int k = 0; k < 3; k++) {
    const int64_t rows = shapes[k][0], C = shapes[k][1];
    float *dx[2], *dw[2], *db[2];
    for (int p = 0; p < 2; p++) {
      dx[p] = malloc(sizeof(float) * rows * C);
      dw[p] = malloc(sizeof(float) * C), db[p] = malloc(sizeof(float) * C);
      backward_with(dx[p], dw[p], db[p], rows, C, 2, p);
    }
    CHECK(memcmp(dx[0], dx[1], sizeof(float) * rows * C) == 0);
    CHECK(memcmp(dw[0], dw[1], sizeof(float) * C) == 0);
    CHECK(memcmp(db[0], db[1], sizeof(float) * C) == 0);
    for (int p = 0; p < 2; p++) free(dx[p]), free(dw[p]), free(db[p]);
  }
}

/* Many row blocks (4096 rows, GPT-2's width): 1, 2 and 3 threads (3 splits
 * the blocks unevenly) give the same bits. */
LZ_TEST(layernorm_backward_thread_count_independent) {
  const int64_t rows = 4096, C = 768;
  float *dx[3], *dw[3], *db[3];
  for (int t = 0; t < 3; t++) {
    dx[t] = malloc(sizeof(float) * rows * C);
    dw[t] = malloc(sizeof(float) * C), db[t] = malloc(sizeof(float) * C);
    backward_with(dx[t], dw[t], db[t], rows, C, t + 1, 0);
  }
  for (int t = 1; t < 3; t++) {
    CHECK(memcmp(dx[0], dx[t], sizeof(float) * rows * C) == 0);
    CHECK(memcmp(dw[0], dw[t], sizeof(float) * C) == 0);
    CHECK(memcmp(db[0], db[t], sizeof(float) * C) == 0);
  }
  for (int t = 0; t < 3; t++) free(dx[t]), free(dw[t]), free(db[t]);
}

/* dx may be dy (the backward of an in-place residual path). */
LZ_TEST(layernorm_backward_dx_aliases_dy) {
  enum { ROWS = 5, C = 33 };
  float x[ROWS * C], dy[ROWS * C], out[ROWS * C], dx[ROWS * C], w[C], b[C];
  float dw[C] = {0}, db[C] = {0}, mean[ROWS], rstd[ROWS];
  for (int i = 0; i < ROWS * C; i++) x[i] = frand(), dy[i] = frand();
  for (int i = 0; i < C; i++) w[i] = frand(), b[i] = frand();
  ln_tensors t = ln_wrap(ROWS, C, x, dy, out, dx, w, b, dw, db, mean, rstd);
  CHECK_OK(lz_layernorm_forward(t.out, t.mean, t.rstd, t.x, t.w, t.b, 1e-5f));
  CHECK_OK(lz_layernorm_backward(t.dx, t.dw, t.db, t.dy, t.x, t.w, t.mean, t.rstd));
  memset(dw, 0, sizeof dw), memset(db, 0, sizeof db);
  CHECK_OK(lz_layernorm_backward(t.dy, t.dw, t.db, t.dy, t.x, t.w, t.mean, t.rstd));
  CHECK(memcmp(dx, dy, sizeof dx) == 0);
  ln_free(&t);
}

LZ_TEST(layernorm_errors) {
  float buf[4096] = {0};
  int32_t ibuf[256] = {0};
  const int64_t s3[3] = {2, 4, 128}, s64[1] = {64}, s128[1] = {128}, s8[1] = {8},
                s7[1] = {7}, s3b[3] = {2, 4, 64};
  lz_tensor *x = lz_test_wrap(buf, LZ_F32, 3, s3), *out = lz_test_wrap(buf, LZ_F32, 3, s3);
  lz_tensor *w = lz_test_wrap(buf, LZ_F32, 1, s128), *w64 = lz_test_wrap(buf, LZ_F32, 1, s64);
  lz_tensor *mean = lz_test_wrap(buf, LZ_F32, 1, s8), *mean7 = lz_test_wrap(buf, LZ_F32, 1, s7);
  lz_tensor *xi = lz_test_wrap(ibuf, LZ_I32, 1, s128), *out_bad = lz_test_wrap(buf, LZ_F32, 3, s3b);
  CHECK_ERR(lz_layernorm_forward(out, mean, mean, x, w64, w, 1e-5f), LZ_ERR_INVALID,
            "layernorm_forward: w is f32[64] (64 elements), expected 128 elements (the last "
            "dimension of x)");
  CHECK_ERR(lz_layernorm_forward(out, mean, mean, x, w, w64, 1e-5f), LZ_ERR_INVALID,
            "layernorm_forward: b is f32[64]");
  CHECK_ERR(lz_layernorm_forward(out, mean7, mean, x, w, w, 1e-5f), LZ_ERR_INVALID,
            "layernorm_forward: mean is f32[7] (7 elements), expected 8 elements (one per row");
  CHECK_ERR(lz_layernorm_forward(out_bad, mean, mean, x, w, w, 1e-5f), LZ_ERR_INVALID,
            "layernorm_forward: out is f32[2,4,64] but x is f32[2,4,128]");
  CHECK_ERR(lz_layernorm_forward(out, mean, mean, x, xi, w, 1e-5f), LZ_ERR_INVALID,
            "layernorm_forward: w is i32[128], expected dtype f32");
  CHECK_ERR(lz_layernorm_forward(out, mean, mean, NULL, w, w, 1e-5f), LZ_ERR_INVALID,
            "layernorm_forward: x is missing");
  CHECK_ERR(lz_layernorm_forward(out, mean, mean, x, w, w, -1.0f), LZ_ERR_INVALID,
            "layernorm_forward: eps is -1");
  CHECK_ERR(lz_layernorm_backward(out, w64, w, x, x, w, mean, mean), LZ_ERR_INVALID,
            "layernorm_backward: dw is f32[64]");
  CHECK_ERR(lz_layernorm_backward(out, w, w, out_bad, x, w, mean, mean), LZ_ERR_INVALID,
            "layernorm_backward: dy is f32[2,4,64] but x is f32[2,4,128]");
  CHECK_ERR(lz_layernorm_backward(out, w, NULL, x, x, w, mean, mean), LZ_ERR_INVALID,
            "layernorm_backward: db is missing");
  CHECK_ERR(lz_layernorm_backward(out, w, w, x, x, w, mean, mean7), LZ_ERR_INVALID,
            "layernorm_backward: rstd is f32[7]");
  lz_tensor *ts[] = {x, out, w, w64, mean, mean7, xi, out_bad};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}
