/* test_matmul.c — oneDNN GEMMs and the linear layer against double references
 * and central finite differences. */
#include "lz_test.h"

#include <dnnl.h>   /* dnnl_sgemm: the unpadded product */
#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

static uint64_t rng_state = 0x1234567ull;
static float frand(void) { /* uniform in [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

static lz_tensor *rand_tensor(lz_dtype dt, int ndim, const int64_t *shape) {
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_new(&t, dt, ndim, shape, LZ_MEM_WORKSPACE));
  int64_t n = lz_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) {
    if (dt == LZ_F32) ((float *)t->data)[i] = frand();
    else ((uint16_t *)t->data)[i] = lz_f32_to_bf16(frand());
  }
  return t;
}

static double at(const lz_tensor *t, int64_t i) {
  return t->dtype == LZ_F32 ? ((float *)t->data)[i] : lz_bf16_to_f32(((uint16_t *)t->data)[i]);
}

/* Reference c = alpha op(a) op(b) + beta c0 in double; checks max relative error. */
static void check_matmul_case(lz_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k,
                              int ta, int tb, int b_shared, float alpha, float beta) {
  int64_t sa[3] = {batch, ta ? k : m, ta ? m : k};
  int64_t sb[3] = {batch, tb ? n : k, tb ? k : n};
  int64_t sc[3] = {batch, m, n};
  int nd = batch > 1 ? 3 : 2;
  lz_tensor *a = rand_tensor(dt, nd, nd == 3 ? sa : sa + 1);
  lz_tensor *b = b_shared || nd == 2 ? rand_tensor(dt, 2, sb + 1) : rand_tensor(dt, 3, sb);
  lz_tensor *c = rand_tensor(LZ_F32, nd, nd == 3 ? sc : sc + 1);
  double *c0 = malloc(sizeof(double) * (size_t)(batch * m * n));
  for (int64_t i = 0; i < batch * m * n; i++) c0[i] = ((float *)c->data)[i];
  CHECK_OK(lz_matmul(c, a, b, ta, tb, alpha, beta));
  double max_err = 0;
  for (int64_t p = 0; p < batch; p++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double s = 0;
        for (int64_t l = 0; l < k; l++) {
          double av = at(a, p * m * k + (ta ? l * m + i : i * k + l));
          int64_t bo = (b->ndim == 3 ? p * k * n : 0) + (tb ? j * k + l : l * n + j);
          s += av * at(b, bo);
        }
        double ref = alpha * s + beta * c0[p * m * n + i * n + j];
        double got = ((float *)c->data)[p * m * n + i * n + j];
        double err = fabs(got - ref) / (fabs(ref) > 1 ? fabs(ref) : 1);
        if (err > max_err) max_err = err;
      }
  if (max_err > 1e-5)
    lz_test_fail(__FILE__, __LINE__, "%s matmul b%lld m%lld n%lld k%lld ta%d tb%d: error %g",
                 lz_dtype_name(dt), (long long)batch, (long long)m, (long long)n, (long long)k,
                 ta, tb, max_err);
  free(c0);
  lz_tensor_free(a);
  lz_tensor_free(b);
  lz_tensor_free(c);
}

/* Both transposes of each operand, batched and not, with alpha and beta. */
static void check_matmul_cases(lz_dtype dt) {
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      check_matmul_case(dt, 1, 17, 23, 31, ta, tb, 0, 1.0f, 0.0f);
      check_matmul_case(dt, 1, 64, 48, 96, ta, tb, 0, 0.5f, 1.0f);
      check_matmul_case(dt, 3, 9, 5, 13, ta, tb, 0, 1.0f, 0.0f);
      check_matmul_case(dt, 3, 9, 5, 13, ta, tb, 1, 2.0f, 0.5f);
    }
}

LZ_TEST(matmul_f32_matches_reference) { check_matmul_cases(LZ_F32); }
LZ_TEST(matmul_bf16_matches_reference) { check_matmul_cases(LZ_BF16); }

LZ_TEST(matmul_rejects_bad_shapes) {
  int64_t s23[2] = {2, 3}, s43[2] = {4, 3}, s24[2] = {2, 4};
  lz_tensor *a = rand_tensor(LZ_F32, 2, s23), *b = rand_tensor(LZ_F32, 2, s43);
  lz_tensor *c = rand_tensor(LZ_F32, 2, s24), *h = rand_tensor(LZ_BF16, 2, s43);
  CHECK_ERR(lz_matmul(c, a, b, 0, 0, 1, 0), LZ_ERR_INVALID, "matmul: a f32[2,3], b f32[4,3]");
  CHECK_OK(lz_matmul(c, a, b, 0, 1, 1, 0));
  CHECK_ERR(lz_matmul(c, a, h, 0, 1, 1, 0), LZ_ERR_INVALID, "both must be f32 or both bf16");
  CHECK_ERR(lz_matmul(c, a, NULL, 0, 1, 1, 0), LZ_ERR_INVALID, "b is missing");
  lz_tensor_free(a);
  lz_tensor_free(b);
  lz_tensor_free(c);
  lz_tensor_free(h);
}

/* Scalar loss L = sum(r * (x w^T + bias)) in double, for finite differences. */
static double linear_loss(const double *x, const double *w, const double *bias, const double *r,
                          int64_t rows, int64_t in, int64_t outc) {
  double l = 0;
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < outc; j++) {
      double s = bias[j];
      for (int64_t p = 0; p < in; p++) s += x[i * in + p] * w[j * in + p];
      l += r[i * outc + j] * s;
    }
  return l;
}

static double rel_err(double got, double ref) {
  return fabs(got - ref) / (fabs(ref) > 1e-2 ? fabs(ref) : 1e-2);
}

/* The worst rel_err of grad / passes against central differences of
 * linear_loss over each of the n entries of p (one of xd, wd, bd). */
static double worst_fd_err(const float *grad, double passes, double *p, int64_t n, double *xd,
                           double *wd, double *bd, const double *rd, int64_t rows, int64_t in,
                           int64_t outc) {
  const double h = 1e-6;
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double keep = p[i];
    p[i] = keep + h;
    double lp = linear_loss(xd, wd, bd, rd, rows, in, outc);
    p[i] = keep - h;
    double lm = linear_loss(xd, wd, bd, rd, rows, in, outc);
    p[i] = keep;
    double e = rel_err(grad[i] / passes, (lp - lm) / (2 * h));
    if (e > worst) worst = e;
  }
  return worst;
}

LZ_TEST(linear_forward_backward_vs_finite_differences) {
  const int64_t B = 3, T = 5, in = 12, outc = 7, rows = B * T;
  int64_t sx[3] = {B, T, in}, sw[2] = {outc, in}, sb[1] = {outc}, sy[3] = {B, T, outc};
  lz_tensor *x = rand_tensor(LZ_F32, 3, sx), *w = rand_tensor(LZ_F32, 2, sw);
  lz_tensor *bias = rand_tensor(LZ_F32, 1, sb), *y = rand_tensor(LZ_F32, 3, sy);
  lz_tensor *dy = rand_tensor(LZ_F32, 3, sy), *dx = rand_tensor(LZ_F32, 3, sx);
  lz_tensor *dw = NULL, *db = NULL;
  CHECK_OK(lz_tensor_new(&dw, LZ_F32, 2, sw, LZ_MEM_GRADS));
  CHECK_OK(lz_tensor_new(&db, LZ_F32, 1, sb, LZ_MEM_GRADS));
  memset(dw->data, 0, lz_tensor_bytes(dw));
  memset(db->data, 0, lz_tensor_bytes(db));
  double xd[B * T * in], wd[outc * in], bd[outc], rd[B * T * outc];
  for (int64_t i = 0; i < rows * in; i++) xd[i] = ((float *)x->data)[i];
  for (int64_t i = 0; i < outc * in; i++) wd[i] = ((float *)w->data)[i];
  for (int64_t i = 0; i < outc; i++) bd[i] = ((float *)bias->data)[i];
  for (int64_t i = 0; i < rows * outc; i++) rd[i] = ((float *)dy->data)[i];

  CHECK_OK(lz_linear_forward(y, x, w, bias));
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < outc; j++) {
      double s = bd[j];
      for (int64_t p = 0; p < in; p++) s += xd[i * in + p] * wd[j * in + p];
      CHECK_NEAR(((float *)y->data)[i * outc + j], s, 1e-5);
    }

  /* Twice: dw and db accumulate, dx is overwritten. */
  CHECK_OK(lz_linear_backward(dx, dw, db, dy, x, w));
  CHECK_OK(lz_linear_backward(dx, dw, db, dy, x, w));
  double worst = worst_fd_err(dx->data, 1, xd, rows * in, xd, wd, bd, rd, rows, in, outc);
  double e = worst_fd_err(dw->data, 2, wd, outc * in, xd, wd, bd, rd, rows, in, outc);
  if (e > worst) worst = e;
  e = worst_fd_err(db->data, 2, bd, outc, xd, wd, bd, rd, rows, in, outc);
  if (e > worst) worst = e;
  CHECK(worst <= 1e-3);
  if (worst > 1e-3) printf("    worst relative error %g\n", worst);

  /* Shape errors name the op and both shapes. */
  int64_t bad[2] = {outc, in + 1};
  lz_tensor *wbad = rand_tensor(LZ_F32, 2, bad);
  CHECK_ERR(lz_linear_forward(y, x, wbad, bias), LZ_ERR_INVALID,
            "linear_forward: x is f32[3,5,12] but w is f32[7,13]");
  lz_tensor_free(wbad);
  lz_tensor *xs[] = {x, w, bias, y, dy, dx, dw, db};
  for (int i = 0; i < 8; i++) lz_tensor_free(xs[i]);
}

LZ_TEST(linear_bf16_close_to_f32) {
  const int64_t rows = 32, in = 64, outc = 48;
  int64_t sx[2] = {rows, in}, sw[2] = {outc, in}, sb[1] = {outc}, sy[2] = {rows, outc};
  lz_tensor *x = rand_tensor(LZ_BF16, 2, sx), *w = rand_tensor(LZ_BF16, 2, sw);
  lz_tensor *bias = rand_tensor(LZ_F32, 1, sb), *y = rand_tensor(LZ_F32, 2, sy);
  lz_tensor *xf = rand_tensor(LZ_F32, 2, sx), *wf = rand_tensor(LZ_F32, 2, sw);
  lz_tensor *yf = rand_tensor(LZ_F32, 2, sy);
  CHECK_OK(lz_tensor_copy(xf, x));
  CHECK_OK(lz_tensor_copy(wf, w));
  CHECK_OK(lz_linear_forward(y, x, w, bias));
  CHECK_OK(lz_linear_forward(yf, xf, wf, bias));
  for (int64_t i = 0; i < rows * outc; i++)
    CHECK_NEAR(((float *)y->data)[i], ((float *)yf->data)[i], 1e-5);
  lz_tensor *xs[] = {x, w, bias, y, xf, wf, yf};
  for (int i = 0; i < 7; i++) lz_tensor_free(xs[i]);
}

/* linear_backward_write over garbage gives the bits linear_backward gives
 * added into zeros (dx too), on shapes small and as a model's layers have
 * them: the first micro-step of an accumulation writes its gradients. A
 * later linear_backward adds into the written ones as into the added ones. */
static void check_write_case(lz_dtype dt, int64_t rows, int64_t in, int64_t outc) {
  int64_t sx[2] = {rows, in}, sw[2] = {outc, in}, sb[1] = {outc}, sy[2] = {rows, outc};
  lz_tensor *x = rand_tensor(dt, 2, sx), *w = rand_tensor(dt, 2, sw), *dy = rand_tensor(dt, 2, sy);
  lz_tensor *dx[2], *dw[2], *db[2];
  for (int v = 0; v < 2; v++) {
    dx[v] = rand_tensor(LZ_F32, 2, sx);
    dw[v] = rand_tensor(LZ_F32, 2, sw);
    db[v] = rand_tensor(LZ_F32, 1, sb);
  }
  memset(dw[0]->data, 0, lz_tensor_bytes(dw[0]));
  memset(db[0]->data, 0, lz_tensor_bytes(db[0]));
  CHECK_OK(lz_linear_backward(dx[0], dw[0], db[0], dy, x, w));
  CHECK_OK(lz_linear_backward_write(dx[1], dw[1], db[1], dy, x, w));
  CHECK(memcmp(dx[0]->data, dx[1]->data, lz_tensor_bytes(dx[0])) == 0);
  CHECK(memcmp(dw[0]->data, dw[1]->data, lz_tensor_bytes(dw[0])) == 0);
  CHECK(memcmp(db[0]->data, db[1]->data, lz_tensor_bytes(db[0])) == 0);
  for (int v = 0; v < 2; v++) CHECK_OK(lz_linear_backward(NULL, dw[v], db[v], dy, x, w));
  CHECK(memcmp(dw[0]->data, dw[1]->data, lz_tensor_bytes(dw[0])) == 0);
  CHECK(memcmp(db[0]->data, db[1]->data, lz_tensor_bytes(db[0])) == 0);
  /* No rows: the gradients written are zeros. */
  int64_t s0[2] = {0, in}, s0y[2] = {0, outc};
  lz_tensor *x0 = rand_tensor(dt, 2, s0), *dy0 = rand_tensor(dt, 2, s0y);
  CHECK_OK(lz_linear_backward_write(NULL, dw[1], db[1], dy0, x0, w));
  int zeros = 1;
  for (int64_t i = 0; i < outc * in; i++) zeros &= ((float *)dw[1]->data)[i] == 0.0f;
  for (int64_t i = 0; i < outc; i++) zeros &= ((float *)db[1]->data)[i] == 0.0f;
  CHECK(zeros);
  lz_tensor *xs[] = {x, w, dy, x0, dy0, dx[0], dx[1], dw[0], dw[1], db[0], db[1]};
  for (int i = 0; i < 11; i++) lz_tensor_free(xs[i]);
}

LZ_TEST(linear_backward_write_is_add_into_zeros) {
  const lz_dtype dts[2] = {LZ_F32, LZ_BF16};
  for (int d = 0; d < 2; d++) {
    check_write_case(dts[d], 15, 12, 7);
    check_write_case(dts[d], 512, 768, 768);
    check_write_case(dts[d], 512, 768, 2048);
    check_write_case(dts[d], 512, 2048, 768);
  }
}

/* linear_backward_norm: dw, db and dx the bits of linear_backward (written,
 * then added into), every block of the slice inside dw given sq_norm's bits
 * of it, none other touched, the slice's short last block where dw ends it;
 * dw at `at` in a slice of at + numel(dw) + after elements. */
static void check_norm_case(lz_dtype dt, int64_t rows, int64_t in, int64_t outc, int64_t at,
                            int64_t after) {
  int64_t sx[2] = {rows, in}, sw[2] = {outc, in}, sy[2] = {rows, outc};
  lz_tensor *x = rand_tensor(dt, 2, sx), *w = rand_tensor(dt, 2, sw), *dy = rand_tensor(dt, 2, sy);
  const int64_t n = at + outc * in + after, nb = (n + 4095) / 4096;
  int64_t sn[1] = {n};
  lz_tensor *slice = rand_tensor(LZ_F32, 1, sn), *plain = NULL, *dwn = NULL;
  CHECK_OK(lz_tensor_new(&plain, LZ_F32, 2, sw, LZ_MEM_WORKSPACE));
  CHECK_OK(lz_tensor_view(&dwn, slice, at, 2, sw));
  double *blocks = malloc(sizeof(double) * (size_t)nb);
  for (int write = 1; write >= 0; write--) {
    for (int64_t k = 0; k < nb; k++) blocks[k] = -1.0;
    if (write) CHECK_OK(lz_linear_backward_write(NULL, plain, NULL, dy, x, w));
    else CHECK_OK(lz_linear_backward(NULL, plain, NULL, dy, x, w));
    CHECK_OK(lz_linear_backward_norm(NULL, dwn, NULL, dy, x, w, write, blocks, n, at));
    CHECK(memcmp(plain->data, dwn->data, lz_tensor_bytes(plain)) == 0);
    int64_t wrong = 0, given = 0;
    for (int64_t k = 0; k < nb; k++) {
      const int64_t lo = 4096 * k, len = n - lo < 4096 ? n - lo : 4096;
      const int inside = lo >= at && lo + len <= at + outc * in;
      if (!inside) {
        wrong += blocks[k] != -1.0;
        continue;
      }
      int64_t sl[1] = {len};
      lz_tensor *b = NULL;
      double want = -2.0;
      CHECK_OK(lz_tensor_view(&b, slice, lo, 1, sl));
      CHECK_OK(lz_sq_norm(b, &want));
      lz_tensor_free(b);
      wrong += memcmp(&want, &blocks[k], sizeof want) != 0;
      given++;
    }
    CHECK(wrong == 0);
    CHECK(given == (at + outc * in) / 4096 - (at + 4095) / 4096 + (after == 0 && n % 4096 != 0));
  }
  CHECK_ERR(lz_linear_backward_norm(NULL, dwn, NULL, dy, x, w, 1, blocks, n - 1, at + after),
            LZ_ERR_INVALID, "does not lie in a slice");
  CHECK_ERR(lz_linear_backward_norm(NULL, dwn, NULL, dy, x, w, 1, NULL, n, at), LZ_ERR_INVALID,
            "blocks is NULL");
  free(blocks);
  lz_tensor *ts[] = {x, w, dy, slice, plain, dwn};
  for (int i = 0; i < 6; i++) lz_tensor_free(ts[i]);
}

LZ_TEST(linear_backward_norm_partials_are_sq_norms_bits) {
  check_norm_case(LZ_F32, 15, 12, 7, 0, 0);          /* the slice one short block, in dw */
  check_norm_case(LZ_F32, 64, 100, 333, 5, 0);       /* off the blocks, a short last block */
  check_norm_case(LZ_BF16, 512, 768, 768, 4096, 7);  /* 144 blocks, two threads' share */
  check_norm_case(LZ_BF16, 256, 768, 2048, 1000, 0); /* off the blocks, the slice ends in dw */
}

/* A bf16 b not transposed is packed into oneDNN's blocked layout before the
 * product (matmul.c); a transposed b is not. The same values either way give
 * the same bits: the packed copy is what the kernel reads b as. Shapes grow
 * and shrink so the thread's packed buffer is reused at each size. */
static void check_packed_case(int64_t m, int64_t n, int64_t k, int ta, float alpha, float beta) {
  int64_t sa[2] = {ta ? k : m, ta ? m : k}, sb[2] = {k, n}, sbt[2] = {n, k}, sc[2] = {m, n};
  lz_tensor *a = rand_tensor(LZ_BF16, 2, sa), *b = rand_tensor(LZ_BF16, 2, sb);
  lz_tensor *bt = NULL, *c = rand_tensor(LZ_F32, 2, sc), *ct = NULL;
  CHECK_OK(lz_tensor_new(&bt, LZ_BF16, 2, sbt, LZ_MEM_WORKSPACE));
  CHECK_OK(lz_tensor_new(&ct, LZ_F32, 2, sc, LZ_MEM_WORKSPACE));
  for (int64_t l = 0; l < k; l++)
    for (int64_t j = 0; j < n; j++)
      ((uint16_t *)bt->data)[j * k + l] = ((uint16_t *)b->data)[l * n + j];
  memcpy(ct->data, c->data, (size_t)(m * n) * sizeof(float));
  CHECK_OK(lz_matmul(c, a, b, ta, 0, alpha, beta));
  CHECK_OK(lz_matmul(ct, a, bt, ta, 1, alpha, beta));
  int64_t differ = 0;
  for (int64_t i = 0; i < m * n; i++)
    differ += ((uint32_t *)c->data)[i] != ((uint32_t *)ct->data)[i];
  if (differ)
    lz_test_fail(__FILE__, __LINE__, "bf16 m%lld n%lld k%lld ta%d: %lld of %lld products differ "
                 "between b packed and b transposed", (long long)m, (long long)n, (long long)k,
                 ta, (long long)differ, (long long)(m * n));
  lz_tensor *ts[] = {a, b, bt, c, ct};
  for (int i = 0; i < 5; i++) lz_tensor_free(ts[i]);
}

/* c = 0.5 a @ b + c (b not transposed) through lz_matmul against
 * dnnl_sgemm on b as it lies: matmul.c copies b to rows n + 16 apart where a
 * has few rows and b's rows are a multiple of 2 KB apart, which must change
 * nothing but the speed. bf16 where it runs widened to fp32: its widened b
 * is padded in the same pass. */
static void check_padded_case(lz_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k,
                              int ta, int b_shared) {
  const int64_t sa[3] = {batch, ta ? k : m, ta ? m : k}, sb[3] = {batch, k, n},
                sc[3] = {batch, m, n};
  const int nd = batch > 1 ? 3 : 2;
  lz_tensor *a = rand_tensor(dt, nd, sa + 3 - nd);
  lz_tensor *b = b_shared ? rand_tensor(dt, 2, sb + 1) : rand_tensor(dt, nd, sb + 3 - nd);
  lz_tensor *c = rand_tensor(LZ_F32, nd, sc + 3 - nd);
  float *want = malloc(sizeof(float) * (size_t)(batch * m * n));
  float *fa = malloc(sizeof(float) * (size_t)(batch * m * k));
  float *fb = malloc(sizeof(float) * (size_t)lz_tensor_numel(b));
  for (int64_t i = 0; i < batch * m * k; i++) fa[i] = (float)at(a, i);
  for (int64_t i = 0; i < lz_tensor_numel(b); i++) fb[i] = (float)at(b, i);
  memcpy(want, c->data, sizeof(float) * (size_t)(batch * m * n));
  for (int64_t p = 0; p < batch; p++)
    CHECK(dnnl_sgemm(ta ? 'T' : 'N', 'N', m, n, k, 0.5f, fa + p * m * k, ta ? m : k,
                     fb + (b_shared ? 0 : p * k * n), n, 1.0f, want + p * m * n,
                     n) == dnnl_success);
  CHECK_OK(lz_matmul(c, a, b, ta, 0, 0.5f, 1.0f));
  if (memcmp(c->data, want, sizeof(float) * (size_t)(batch * m * n)) != 0)
    lz_test_fail(__FILE__, __LINE__,
                 "%s b%lld m%lld n%lld k%lld ta %d shared %d: not sgemm's bits",
                 lz_dtype_name(dt), (long long)batch, (long long)m, (long long)n, (long long)k,
                 ta, b_shared);
  free(want);
  free(fa);
  free(fb);
  lz_tensor_free(a);
  lz_tensor_free(b);
  lz_tensor_free(c);
}

static void check_padded_cases(lz_dtype dt) {
  check_padded_case(dt, 1, 64, 1024, 512, 0, 0); /* an expert's input gradient */
  check_padded_case(dt, 1, 256, 512, 300, 0, 0);
  check_padded_case(dt, 1, 17, 2048, 65, 0, 0);
  check_padded_case(dt, 1, 257, 1024, 64, 0, 0); /* past the rows that pad: as it lies */
  check_padded_case(dt, 3, 40, 512, 33, 0, 0);
  check_padded_case(dt, 3, 40, 512, 33, 0, 1);
  check_padded_case(dt, 1, 2048, 96, 300, 1, 0); /* a weight gradient: a transposed */
  check_padded_case(dt, 1, 1024, 512, 64, 1, 0); /* both padded */
  check_padded_case(dt, 2, 1024, 40, 20, 1, 1);
}

LZ_TEST(matmul_f32_padded_b_gives_sgemms_bits) { check_padded_cases(LZ_F32); }

LZ_TEST(matmul_bf16_widened_padded_b_gives_sgemms_bits) {
  const char *what = NULL;
  CHECK_OK(lz_bf16_matmul_path(&what));
  if (strncmp(what, "native", 6) == 0) {
    printf("    skipped: bf16 GEMMs run natively here (%s); this claim is the widened path's\n",
           what);
    return;
  }
  check_padded_cases(LZ_BF16);
}

LZ_TEST(matmul_bf16_packed_b_gives_the_bits_of_b_as_it_is) {
  if (!lz_test_bf16_native()) return;
  /* (from 512 rows of a and 64 KiB of b: smaller ones are multiplied as
   * they are) */
  check_packed_case(512, 768, 2048, 0, 1.0f, 0.0f); /* an input gradient */
  check_packed_case(517, 129, 300, 0, 0.5f, 1.0f);  /* sizes off the blocks */
  check_packed_case(768, 768, 512, 1, 1.0f, 1.0f);  /* a weight gradient, accumulated */
  check_packed_case(515, 200, 190, 1, 1.0f, 0.0f);
}

/* bf16 primitives are built outside the cache's lock (matmul.c), so the
 * experts' grouped GEMM builds new shapes on several threads at once, the
 * same shape too (an expert of 300 rows runs two 128-row blocks side by
 * side; the first to finish building keeps its primitive). Every expert's
 * rows must be the bits of its own linear layer run alone afterwards. The
 * shapes (C 40, D 56) are used nowhere else, so none is cached before. */
LZ_TEST(matmul_bf16_shapes_built_on_threads_at_once) {
  if (!lz_test_bf16_native()) return;
  const int threads = lz_threads_get();
  CHECK_OK(lz_threads_set(4));
  enum { E = 12 };
  const int64_t C = 40, D = 56, rows[E] = {300, 7, 129, 300, 13, 1, 64, 255, 300, 3, 0, 90};
  int64_t R = 0;
  for (int e = 0; e < E; e++) R += rows[e];
  lz_tensor *x = rand_tensor(LZ_BF16, 2, (int64_t[]){R, C});
  lz_tensor *w = rand_tensor(LZ_BF16, 3, (int64_t[]){E, D, C});
  lz_tensor *y = rand_tensor(LZ_F32, 2, (int64_t[]){R, D});
  lz_tensor *alone = rand_tensor(LZ_F32, 2, (int64_t[]){R, D}), *off = NULL;
  CHECK_OK(lz_tensor_new(&off, LZ_I32, 1, (int64_t[]){E + 1}, LZ_MEM_WORKSPACE));
  int32_t *o = off->data;
  o[0] = 0;
  for (int e = 0; e < E; e++) o[e + 1] = o[e] + (int32_t)rows[e];
  CHECK_OK(lz_moe_gemm_forward(y, x, w, off));
  for (int e = 0; e < E; e++) {
    if (!rows[e]) continue;
    lz_tensor *xe = NULL, *we = NULL, *ye = NULL;
    CHECK_OK(lz_tensor_view(&xe, x, o[e] * C, 2, (int64_t[]){rows[e], C}));
    CHECK_OK(lz_tensor_view(&we, w, e * D * C, 2, (int64_t[]){D, C}));
    CHECK_OK(lz_tensor_view(&ye, alone, o[e] * D, 2, (int64_t[]){rows[e], D}));
    CHECK_OK(lz_linear_forward(ye, xe, we, NULL));
    lz_tensor_free(xe), lz_tensor_free(we), lz_tensor_free(ye);
  }
  CHECK(memcmp(y->data, alone->data, (size_t)(R * D) * sizeof(float)) == 0);
  CHECK_OK(lz_threads_set(threads));
  lz_tensor *ts[] = {x, w, y, alone, off};
  for (int i = 0; i < 5; i++) lz_tensor_free(ts[i]);
}

/* More shapes than the bf16 primitive cache holds (1024): the first ones
 * are evicted and rebuilt, the last ones found again, each product the same
 * bits as its first run (the cache's chains by hash stay whole across
 * evictions). */
LZ_TEST(matmul_bf16_cache_evicts_and_finds_again) {
  enum { SHAPES = 1100, K = 16, N = 8, KEEP = 12 };
  lz_tensor *a = rand_tensor(LZ_BF16, 2, (int64_t[]){SHAPES, K});
  lz_tensor *b = rand_tensor(LZ_BF16, 2, (int64_t[]){K, N});
  float *first = malloc((size_t)2 * KEEP * SHAPES * N * sizeof(float));
  CHECK(first != NULL);
  const int64_t probe[KEEP] = {1, 2, 3, 5, 64, 500, 1023, 1024, 1050, 1098, 1099, 1100};
  for (int pass = 0; pass < 2; pass++) {
    int kept = 0;
    for (int64_t m = 1; m <= SHAPES; m++) {
      int is_probe = 0;
      for (int i = 0; i < KEEP; i++) is_probe |= probe[i] == m;
      if (pass == 1 && !is_probe) continue;
      lz_tensor *am = NULL, *c = NULL;
      CHECK_OK(lz_tensor_view(&am, a, 0, 2, (int64_t[]){m, K}));
      CHECK_OK(lz_tensor_new(&c, LZ_F32, 2, (int64_t[]){m, N}, LZ_MEM_WORKSPACE));
      CHECK_OK(lz_matmul(c, am, b, 0, 0, 1.0f, 0.0f));
      if (is_probe) {
        float *at = first + ((size_t)pass * KEEP + kept++) * SHAPES * N;
        memcpy(at, c->data, (size_t)(m * N) * sizeof(float));
        if (pass == 1)
          CHECK(memcmp(at, first + (size_t)(kept - 1) * SHAPES * N,
                       (size_t)(m * N) * sizeof(float)) == 0);
      }
      lz_tensor_free(am), lz_tensor_free(c);
    }
  }
  free(first);
  lz_tensor_free(a), lz_tensor_free(b);
}
