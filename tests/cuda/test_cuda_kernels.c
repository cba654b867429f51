/* test_cuda_kernels.c — every CUDA kernel against the CPU kernel on the same
 * random inputs: fp32 within 1e-5 relative, bf16 within 1e-2 (relative to
 * max(|x|, 1% of the largest |x|), so near-zero entries of a gradient are
 * judged against its scale). Kernels whose bf16 inputs are widened to f32
 * (RMSNorm, RoPE, SwiGLU, as on the CPU) are held to the f32 tolerance on
 * bf16 inputs too; Lion, whose CPU kernel rounds every product and sum on
 * its own, to the same bits. Each op of the Llama models and Lion also runs
 * twice on the device and must give the same bits both times. Also the
 * device side of the ledger, pinned memory, streams and events, and the
 * errors a device call can give.
 *
 * build/bin/lz_cuda_tests [substring]. On a machine without a usable GPU
 * each test prints "skipped: <reason>" and the summary says how many were
 * skipped; skips count neither as passes nor as failures. */
#include "luazero.h"

#include <math.h>   /* fabs, pow */
#include <stdio.h>  /* printf */
#include <stdlib.h> /* malloc */
#include <string.h> /* strstr */

static int failures, passed, failed, skipped;
static const char *skip_reason;

#define CHECK(cond)                                                \
  do {                                                             \
    if (!(cond)) {                                                 \
      printf("    %s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
      failures++;                                                  \
    }                                                              \
  } while (0)

#define CHECK_OK(expr)                                                                    \
  do {                                                                                    \
    lz_status st_ = (expr);                                                               \
    if (st_ != LZ_OK) {                                                                   \
      printf("    %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr, lz_status_name(st_), \
             lz_last_error());                                                            \
      failures++;                                                                         \
    }                                                                                     \
  } while (0)

/* ------------------------------------------------------------------ helpers */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float uniform(void) { /* [-1, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

static lz_tensor *host(lz_dtype dt, int ndim, const int64_t *shape) {
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_new(&t, dt, ndim, shape, LZ_MEM_WORKSPACE));
  return t;
}

static lz_tensor *host_rand(lz_dtype dt, int ndim, const int64_t *shape, float scale) {
  lz_tensor *t = host(dt, ndim, shape);
  if (!t) return NULL;
  int64_t n = lz_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) {
    float v = uniform() * scale;
    if (dt == LZ_F32)
      ((float *)t->data)[i] = v;
    else if (dt == LZ_BF16)
      ((uint16_t *)t->data)[i] = lz_f32_to_bf16(v);
    else if (dt == LZ_F16)
      ((uint16_t *)t->data)[i] = lz_f32_to_f16(v);
  }
  return t;
}

/* A device copy of a host tensor. */
static lz_tensor *dev(const lz_tensor *h) {
  lz_tensor *d = NULL;
  CHECK_OK(lz_tensor_new_on(&d, h->dtype, h->ndim, h->shape, LZ_MEM_WORKSPACE, LZ_CUDA));
  if (d) CHECK_OK(lz_tensor_copy(d, h));
  return d;
}

/* A host copy of a device tensor. */
static lz_tensor *back(const lz_tensor *d) {
  lz_tensor *h = host(d->dtype, d->ndim, d->shape);
  if (h) CHECK_OK(lz_tensor_copy(h, d));
  return h;
}

static double value(const lz_tensor *t, int64_t i) {
  switch (t->dtype) {
    case LZ_F32:
      return ((const float *)t->data)[i];
    case LZ_BF16:
      return lz_bf16_to_f32(((const uint16_t *)t->data)[i]);
    case LZ_F16:
      return lz_f16_to_f32(((const uint16_t *)t->data)[i]);
    case LZ_I32:
      return ((const int32_t *)t->data)[i];
    default:
      return ((const uint16_t *)t->data)[i];
  }
}

/* Compares device tensor d (copied back) with host tensor ref. */
static void expect_close(const char *what, const lz_tensor *d, const lz_tensor *ref, double tol) {
  lz_tensor *h = back(d);
  if (!h) return;
  int64_t n = lz_tensor_numel(ref);
  double big = 0.0;
  for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(value(ref, i)));
  double floor = fmax(big * 1e-2, 1e-30), worst = 0.0;
  int64_t at = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(value(h, i) - value(ref, i)) / fmax(fabs(value(ref, i)), floor);
    if (!(e <= worst)) {
      worst = e;
      at = i;
    }
  }
  if (!(worst <= tol)) {
    printf("    %s: worst relative error %.3g at %lld (cuda %.9g, cpu %.9g), tolerance %g\n", what,
           worst, (long long)at, value(h, at), value(ref, at), tol);
    failures++;
  }
  lz_tensor_free(h);
}

/* Two device tensors (same dtype and shape) hold the same bits. */
static void expect_same_bits(const char *what, const lz_tensor *d1, const lz_tensor *d2) {
  lz_tensor *h1 = back(d1), *h2 = back(d2);
  if (h1 && h2 && memcmp(h1->data, h2->data, lz_tensor_bytes(h1)) != 0) {
    printf("    %s: two runs on the device differ\n", what);
    failures++;
  }
  lz_tensor_free(h1);
  lz_tensor_free(h2);
}

/* The device tensor d holds the cpu's bits h. */
static void expect_cpu_bits(const char *what, const lz_tensor *d, const lz_tensor *h) {
  lz_tensor *b = back(d);
  if (b && memcmp(b->data, h->data, lz_tensor_bytes(h)) != 0) {
    printf("    %s: the device's bits differ from the cpu's\n", what);
    failures++;
  }
  lz_tensor_free(b);
}

#define FREE(...)                                                                       \
  do {                                                                                  \
    lz_tensor *fr_[] = {__VA_ARGS__};                                                   \
    for (size_t i_ = 0; i_ < sizeof fr_ / sizeof fr_[0]; i_++) lz_tensor_free(fr_[i_]); \
  } while (0)

/* ------------------------------------------------------------------- tests */

static void test_matmul(lz_dtype dt, double tol) {
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      int64_t m = 37, n = 53, k = 29;
      int64_t as[2] = {ta ? k : m, ta ? m : k}, bs[2] = {tb ? n : k, tb ? k : n}, cs[2] = {m, n};
      lz_tensor *a = host_rand(dt, 2, as, 1), *b = host_rand(dt, 2, bs, 1);
      lz_tensor *c = host_rand(LZ_F32, 2, cs, 1);
      lz_tensor *da = dev(a), *db = dev(b), *dc = dev(c);
      CHECK_OK(lz_matmul(c, a, b, ta, tb, 0.5f, 0.25f));
      CHECK_OK(lz_matmul(dc, da, db, ta, tb, 0.5f, 0.25f));
      expect_close("matmul 2-D", dc, c, tol);
      FREE(a, b, c, da, db, dc);
    }
  /* Batched, b 3-D and b shared. */
  for (int shared = 0; shared < 2; shared++) {
    int64_t as[3] = {3, 17, 24}, bs3[3] = {3, 24, 19}, bs2[2] = {24, 19}, cs[3] = {3, 17, 19};
    lz_tensor *a = host_rand(dt, 3, as, 1);
    lz_tensor *b = shared ? host_rand(dt, 2, bs2, 1) : host_rand(dt, 3, bs3, 1);
    lz_tensor *c = host_rand(LZ_F32, 3, cs, 1);
    lz_tensor *da = dev(a), *db = dev(b), *dc = dev(c);
    CHECK_OK(lz_matmul(c, a, b, 0, 0, 1.0f, 0.0f));
    CHECK_OK(lz_matmul(dc, da, db, 0, 0, 1.0f, 0.0f));
    expect_close(shared ? "matmul batched, b shared" : "matmul batched", dc, c, tol);
    FREE(a, b, c, da, db, dc);
  }
}

static void test_matmul_f32(void) { test_matmul(LZ_F32, 1e-5); }
static void test_matmul_bf16(void) { test_matmul(LZ_BF16, 1e-2); }

static void test_linear(lz_dtype dt, double tol) {
  int64_t xs[3] = {2, 13, 48}, ws[2] = {72, 48}, bs[1] = {72}, ys[3] = {2, 13, 72};
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    lz_tensor *x = host_rand(dt, 3, xs, 1), *w = host_rand(dt, 2, ws, 0.5f);
    lz_tensor *bias = with_bias ? host_rand(LZ_F32, 1, bs, 1) : NULL;
    lz_tensor *y = host(LZ_F32, 3, ys);
    lz_tensor *dx_ = dev(x), *dw_ = dev(w), *db_ = bias ? dev(bias) : NULL, *dy_ = dev(y);
    CHECK_OK(lz_linear_forward(y, x, w, bias));
    CHECK_OK(lz_linear_forward(dy_, dx_, dw_, db_));
    expect_close(with_bias ? "linear_forward with bias" : "linear_forward", dy_, y, tol);
    FREE(x, w, bias, y, dx_, dw_, db_, dy_);
  }
  /* Backward: dx written, dw and db accumulate. */
  lz_tensor *x = host_rand(dt, 3, xs, 1), *w = host_rand(dt, 2, ws, 0.5f);
  lz_tensor *gy = host_rand(dt, 3, ys, 1);
  lz_tensor *gx = host(LZ_F32, 3, xs), *gw = host_rand(LZ_F32, 2, ws, 1);
  lz_tensor *gb = host_rand(LZ_F32, 1, bs, 1);
  lz_tensor *d_x = dev(x), *d_w = dev(w), *d_gy = dev(gy), *d_gx = dev(gx), *d_gw = dev(gw),
            *d_gb = dev(gb);
  CHECK_OK(lz_linear_backward(gx, gw, gb, gy, x, w));
  CHECK_OK(lz_linear_backward(d_gx, d_gw, d_gb, d_gy, d_x, d_w));
  expect_close("linear_backward dx", d_gx, gx, tol);
  expect_close("linear_backward dw", d_gw, gw, tol);
  expect_close("linear_backward db", d_gb, gb, tol);
  FREE(x, w, gy, gx, gw, gb, d_x, d_w, d_gy, d_gx, d_gw, d_gb);
}

static void test_linear_f32(void) { test_linear(LZ_F32, 1e-5); }
static void test_linear_bf16(void) { test_linear(LZ_BF16, 1e-2); }

static void test_layernorm(void) {
  int64_t xs[3] = {3, 11, 96}, cs[1] = {96}, rs[2] = {3, 11};
  lz_tensor *x = host_rand(LZ_F32, 3, xs, 2), *w = host_rand(LZ_F32, 1, cs, 1);
  lz_tensor *b = host_rand(LZ_F32, 1, cs, 1), *y = host(LZ_F32, 3, xs);
  lz_tensor *mu = host(LZ_F32, 2, rs), *rs_ = host(LZ_F32, 2, rs);
  lz_tensor *d_x = dev(x), *d_w = dev(w), *d_b = dev(b), *d_y = dev(y), *d_mu = dev(mu),
            *d_rs = dev(rs_);
  CHECK_OK(lz_layernorm_forward(y, mu, rs_, x, w, b, 1e-5f));
  CHECK_OK(lz_layernorm_forward(d_y, d_mu, d_rs, d_x, d_w, d_b, 1e-5f));
  expect_close("layernorm_forward out", d_y, y, 1e-5);
  expect_close("layernorm_forward mean", d_mu, mu, 1e-5);
  expect_close("layernorm_forward rstd", d_rs, rs_, 1e-5);
  lz_tensor *gy = host_rand(LZ_F32, 3, xs, 1), *gx = host(LZ_F32, 3, xs);
  lz_tensor *gw = host_rand(LZ_F32, 1, cs, 1), *gb = host_rand(LZ_F32, 1, cs, 1);
  lz_tensor *d_gy = dev(gy), *d_gx = dev(gx), *d_gw = dev(gw), *d_gb = dev(gb);
  CHECK_OK(lz_layernorm_backward(gx, gw, gb, gy, x, w, mu, rs_));
  CHECK_OK(lz_layernorm_backward(d_gx, d_gw, d_gb, d_gy, d_x, d_w, d_mu, d_rs));
  expect_close("layernorm_backward dx", d_gx, gx, 1e-5);
  expect_close("layernorm_backward dw", d_gw, gw, 1e-5);
  expect_close("layernorm_backward db", d_gb, gb, 1e-5);
  FREE(x, w, b, y, mu, rs_, d_x, d_w, d_b, d_y, d_mu, d_rs, gy, gx, gw, gb, d_gy, d_gx, d_gw, d_gb);
}

static void test_gelu(void) {
  int64_t s[2] = {7, 301};
  lz_tensor *x = host_rand(LZ_F32, 2, s, 4), *y = host(LZ_F32, 2, s);
  lz_tensor *gy = host_rand(LZ_F32, 2, s, 1), *gx = host(LZ_F32, 2, s);
  lz_tensor *d_x = dev(x), *d_y = dev(y), *d_gy = dev(gy), *d_gx = dev(gx);
  CHECK_OK(lz_gelu_forward(y, x));
  CHECK_OK(lz_gelu_forward(d_y, d_x));
  expect_close("gelu_forward", d_y, y, 1e-5);
  CHECK_OK(lz_gelu_backward(gx, gy, x));
  CHECK_OK(lz_gelu_backward(d_gx, d_gy, d_x));
  expect_close("gelu_backward", d_gx, gx, 1e-5);
  FREE(x, y, gy, gx, d_x, d_y, d_gy, d_gx);
}

static void attention_case(int64_t B, int64_t T, int64_t C, int NH) {
  int64_t qs[3] = {B, T, 3 * C}, os[3] = {B, T, C}, ls[3] = {B, NH, T};
  lz_tensor *qkv = host_rand(LZ_F32, 3, qs, 1), *o = host(LZ_F32, 3, os), *l = host(LZ_F32, 3, ls);
  lz_tensor *d_qkv = dev(qkv), *d_o = dev(o), *d_l = dev(l);
  CHECK_OK(lz_attention_forward(o, l, qkv, NH));
  CHECK_OK(lz_attention_forward(d_o, d_l, d_qkv, NH));
  expect_close("attention_forward out", d_o, o, 1e-5);
  expect_close("attention_forward lse", d_l, l, 1e-5);
  lz_tensor *go = host_rand(LZ_F32, 3, os, 1), *gq = host(LZ_F32, 3, qs);
  lz_tensor *d_go = dev(go), *d_gq = dev(gq);
  CHECK_OK(lz_attention_backward(gq, go, qkv, o, l, NH));
  CHECK_OK(lz_attention_backward(d_gq, d_go, d_qkv, d_o, d_l, NH));
  expect_close("attention_backward dqkv", d_gq, gq, 1e-5);
  FREE(qkv, o, l, d_qkv, d_o, d_l, go, gq, d_go, d_gq);
}

static void test_attention(void) {
  attention_case(2, 37, 48, 3);   /* head size 16, T not a multiple of the tiles */
  attention_case(1, 130, 256, 2); /* head size 128, three query blocks */
  attention_case(1, 9, 192, 1);   /* head size 192: the 256 variant */
}

static void test_embedding(void) {
  int64_t V = 50, Tmax = 16, C = 40, B = 3, T = 12;
  int64_t ts[2] = {B, T}, tes[2] = {V, C}, pes[2] = {Tmax, C}, os[3] = {B, T, C};
  lz_tensor *tok = host(LZ_I32, 2, ts);
  for (int64_t i = 0; i < B * T; i++)
    ((int32_t *)tok->data)[i] = (int32_t)(i * 7 % 5); /* repeats */
  lz_tensor *wte = host_rand(LZ_F32, 2, tes, 1), *wpe = host_rand(LZ_F32, 2, pes, 1);
  lz_tensor *o = host(LZ_F32, 3, os);
  lz_tensor *d_tok = dev(tok), *d_wte = dev(wte), *d_wpe = dev(wpe), *d_o = dev(o);
  CHECK_OK(lz_embedding_forward(o, tok, wte, wpe));
  CHECK_OK(lz_embedding_forward(d_o, d_tok, d_wte, d_wpe));
  expect_close("embedding_forward", d_o, o, 1e-5);
  lz_tensor *g = host_rand(LZ_F32, 3, os, 1), *d_g = dev(g);
  CHECK_OK(lz_embedding_backward(wte, wpe, g, tok));
  CHECK_OK(lz_embedding_backward(d_wte, d_wpe, d_g, d_tok));
  expect_close("embedding_backward dwte", d_wte, wte, 1e-5);
  expect_close("embedding_backward dwpe", d_wpe, wpe, 1e-5);
  /* A bad id on the device: the cpu's message, nothing written. */
  int32_t bad = (int32_t)V;
  lz_tensor *one = NULL;
  CHECK_OK(lz_tensor_view(&one, tok, 5, 1, (int64_t[]){1}));
  ((int32_t *)tok->data)[5] = bad;
  CHECK_OK(lz_tensor_copy(d_tok, tok));
  lz_status st = lz_embedding_forward(d_o, d_tok, d_wte, d_wpe);
  CHECK(st == LZ_ERR_INVALID && strstr(lz_last_error(), "outside the vocabulary"));
  FREE(one, tok, wte, wpe, o, d_tok, d_wte, d_wpe, d_o, g, d_g);
}

static void test_cross_entropy(void) {
  int64_t B = 4, T = 9, V = 61, Vp = 64;
  int64_t ls[3] = {B, T, Vp}, ts[2] = {B, T};
  lz_tensor *logits = host_rand(LZ_F32, 3, ls, 5), *tg = host(LZ_I32, 2, ts);
  for (int64_t i = 0; i < B * T; i++)
    ((int32_t *)tg->data)[i] = i == 3 ? -1 : (int32_t)(i * 13 % V);
  lz_tensor *loss = host(LZ_F32, 2, ts), *gl = host(LZ_F32, 3, ls);
  lz_tensor *d_logits = dev(logits), *d_tg = dev(tg), *d_loss = dev(loss), *d_gl = dev(gl);
  CHECK_OK(lz_cross_entropy_forward(loss, logits, tg, V));
  CHECK_OK(lz_cross_entropy_forward(d_loss, d_logits, d_tg, V));
  expect_close("cross_entropy_forward", d_loss, loss, 1e-5);
  CHECK_OK(lz_cross_entropy_backward(gl, logits, tg, V, 0.25f));
  CHECK_OK(lz_cross_entropy_backward(d_gl, d_logits, d_tg, V, 0.25f));
  expect_close("cross_entropy_backward", d_gl, gl, 1e-5);
  /* In place: dlogits aliasing logits. */
  CHECK_OK(lz_cross_entropy_backward(d_logits, d_logits, d_tg, V, 0.25f));
  expect_close("cross_entropy_backward in place", d_logits, gl, 1e-5);
  /* A bad target is found on the device, with no wait in the call: the
   * next wait for the compute stream (reading the losses) reports the first
   * one with the cpu's message, once. */
  ((int32_t *)tg->data)[7] = (int32_t)V;
  ((int32_t *)tg->data)[20] = (int32_t)V + 1;
  CHECK_OK(lz_tensor_copy(d_tg, tg));
  CHECK_OK(lz_cross_entropy_forward(d_loss, d_logits, d_tg, V));
  lz_status st = lz_tensor_copy(loss, d_loss);
  CHECK(st == LZ_ERR_INVALID &&
        strstr(lz_last_error(), "cross_entropy_forward: targets[7] is 61, not below vocab 61"));
  CHECK_OK(lz_stream_synchronize(LZ_STREAM_COMPUTE));
  FREE(logits, tg, loss, gl, d_logits, d_tg, d_loss, d_gl);
}

static void test_elementwise(void) {
  int64_t s[1] = {100003};
  lz_tensor *a = host_rand(LZ_F32, 1, s, 1), *b = host_rand(LZ_F32, 1, s, 1),
            *o = host(LZ_F32, 1, s);
  lz_tensor *d_a = dev(a), *d_b = dev(b), *d_o = dev(o);
  CHECK_OK(lz_add(o, a, b));
  CHECK_OK(lz_add(d_o, d_a, d_b));
  expect_close("add", d_o, o, 1e-6);
  CHECK_OK(lz_axpy(o, -0.75f, a));
  CHECK_OK(lz_axpy(d_o, -0.75f, d_a));
  expect_close("axpy", d_o, o, 1e-6);
  const lz_dtype dts[3] = {LZ_F32, LZ_BF16, LZ_F16};
  for (int k = 0; k < 3; k++) {
    lz_tensor *t = host_rand(dts[k], 1, s, 3), *d_t = dev(t);
    CHECK_OK(lz_scale(t, 1.5f));
    CHECK_OK(lz_scale(d_t, 1.5f));
    expect_close("scale", d_t, t, 0.0); /* one rounding of the same product: the same bits */
    double n1 = 0, n2 = 0;
    CHECK_OK(lz_sq_norm(t, &n1));
    CHECK_OK(lz_sq_norm(d_t, &n2));
    if (!(fabs(n1 - n2) <= 1e-9 * fabs(n1))) {
      printf("    sq_norm %s: cuda %.17g vs cpu %.17g\n", lz_dtype_name(dts[k]), n2, n1);
      failures++;
    }
    int f1 = -1, f2 = -1;
    CHECK_OK(lz_has_inf_nan(d_t, &f2));
    CHECK(f2 == 0);
    CHECK_OK(lz_fill(t, -2.5f));
    CHECK_OK(lz_fill(d_t, -2.5f));
    expect_close("fill", d_t, t, 0.0);
    /* One NaN in the middle. */
    if (dts[k] == LZ_F32)
      ((float *)t->data)[77777] = NAN;
    else
      ((uint16_t *)t->data)[77777] = 0x7fff;
    CHECK_OK(lz_tensor_copy(d_t, t));
    CHECK_OK(lz_has_inf_nan(t, &f1));
    CHECK_OK(lz_has_inf_nan(d_t, &f2));
    CHECK(f1 == 1 && f2 == 1);
    FREE(t, d_t);
  }
  FREE(a, b, o, d_a, d_b, d_o);
}

static void test_convert(void) {
  int64_t s[1] = {4099};
  lz_tensor *x = host_rand(LZ_F32, 1, s, 100), *d_x = dev(x);
  const lz_dtype dts[2] = {LZ_BF16, LZ_F16};
  for (int k = 0; k < 2; k++) {
    lz_tensor *h = host(dts[k], 1, s), *d = NULL;
    CHECK_OK(lz_tensor_new_on(&d, dts[k], 1, s, LZ_MEM_WORKSPACE, LZ_CUDA));
    CHECK_OK(lz_tensor_copy(h, x));
    CHECK_OK(lz_tensor_copy(d, d_x)); /* converted on the device */
    expect_close("convert f32 to half", d, h, 0.0);
    lz_tensor *hf = host(LZ_F32, 1, s), *df = dev(hf);
    CHECK_OK(lz_tensor_copy(hf, h));
    CHECK_OK(lz_tensor_copy(df, d));
    expect_close("convert half to f32", df, hf, 0.0);
    /* Across devices and dtypes at once is refused. */
    CHECK(lz_tensor_copy(d, x) == LZ_ERR_INVALID && strstr(lz_last_error(), "one dtype"));
    FREE(h, d, hf, df);
  }
  FREE(x, d_x);
}

static void test_adamw(void) {
  int64_t s[1] = {20011};
  lz_adamw_args args = {.lr = 1e-3f,
                        .beta1 = 0.9f,
                        .beta2 = 0.95f,
                        .eps = 1e-8f,
                        .weight_decay = 0.1f,
                        .grad_scale = 0.5f,
                        .step = 3};
  const lz_dtype wdts[3] = {LZ_F32, LZ_BF16, LZ_F16};
  for (int k = 0; k < 3; k++) {
    lz_tensor *p = host_rand(LZ_F32, 1, s, 1), *g = host_rand(LZ_F32, 1, s, 1);
    lz_tensor *m = host_rand(LZ_F32, 1, s, 0.1f), *v = host_rand(LZ_F32, 1, s, 0.01f);
    for (int64_t i = 0; i < s[0]; i++) ((float *)v->data)[i] = fabsf(((float *)v->data)[i]);
    lz_tensor *w = host(wdts[k], 1, s);
    lz_tensor *dp = dev(p), *dg = dev(g), *dm = dev(m), *dv = dev(v), *dw = dev(w);
    CHECK_OK(lz_adamw_step(p, g, m, v, w, &args));
    CHECK_OK(lz_adamw_step(dp, dg, dm, dv, dw, &args));
    expect_close("adamw param", dp, p, 1e-5);
    expect_close("adamw m", dm, m, 1e-5);
    expect_close("adamw v", dv, v, 1e-5);
    expect_close("adamw working copy", dw, w, k == 0 ? 1e-5 : 1e-2);
    FREE(p, g, m, v, w, dp, dg, dm, dv, dw);
  }
}

/* ------------------------------------------------------- Llama, Lion */

/* RMSNorm on x of `dt` (w too), forward and backward (dw accumulates onto
 * nonzero values; dx also written over dy), twice on the device. dw_tol:
 * 1e-5 for a few rows; sums over many rows in another order differ more
 * near zero, where the 1% floor judges them. */
static void rmsnorm_case(lz_dtype dt, int64_t rows, int64_t C, double dw_tol) {
  int64_t xs[2] = {rows, C}, cs[1] = {C}, rs[1] = {rows};
  lz_tensor *x = host_rand(dt, 2, xs, 2), *w = host_rand(dt, 1, cs, 1.5f);
  lz_tensor *y = host(LZ_F32, 2, xs), *r = host(LZ_F32, 1, rs);
  lz_tensor *d_x = dev(x), *d_w = dev(w), *d_y = dev(y), *d_r = dev(r), *d_y2 = dev(y),
            *d_r2 = dev(r);
  CHECK_OK(lz_rmsnorm_forward(y, r, x, w, 1e-5f));
  CHECK_OK(lz_rmsnorm_forward(d_y, d_r, d_x, d_w, 1e-5f));
  CHECK_OK(lz_rmsnorm_forward(d_y2, d_r2, d_x, d_w, 1e-5f));
  expect_close("rmsnorm_forward out", d_y, y, 1e-5);
  expect_close("rmsnorm_forward rstd", d_r, r, 1e-5);
  expect_same_bits("rmsnorm_forward out", d_y, d_y2);
  expect_same_bits("rmsnorm_forward rstd", d_r, d_r2);

  lz_tensor *gy = host_rand(dt, 2, xs, 1), *gx = host(LZ_F32, 2, xs);
  lz_tensor *gw = host_rand(LZ_F32, 1, cs, 1);
  lz_tensor *d_gy = dev(gy), *d_gx = dev(gx), *d_gx2 = dev(gx), *d_gw = dev(gw), *d_gw2 = dev(gw);
  CHECK_OK(lz_rmsnorm_backward(gx, gw, gy, x, w, r));
  CHECK_OK(lz_rmsnorm_backward(d_gx, d_gw, d_gy, d_x, d_w, d_r));
  CHECK_OK(lz_rmsnorm_backward(d_gx2, d_gw2, d_gy, d_x, d_w, d_r));
  expect_close("rmsnorm_backward dx", d_gx, gx, 1e-5);
  expect_close("rmsnorm_backward dw", d_gw, gw, dw_tol);
  expect_same_bits("rmsnorm_backward dx", d_gx, d_gx2);
  expect_same_bits("rmsnorm_backward dw", d_gw, d_gw2);
  if (dt == LZ_F32) { /* dx over dy: the same as dx on its own */
    lz_tensor *d_gw3 = dev(gw);
    CHECK_OK(lz_rmsnorm_backward(d_gy, d_gw3, d_gy, d_x, d_w, d_r));
    expect_same_bits("rmsnorm_backward dx over dy", d_gy, d_gx);
    FREE(d_gw3);
  }
  FREE(x, w, y, r, d_x, d_w, d_y, d_r, d_y2, d_r2, gy, gx, gw, d_gy, d_gx, d_gx2, d_gw, d_gw2);
}

static void test_rmsnorm(void) {
  rmsnorm_case(LZ_F32, 2 * 3, 37, 1e-5);
  rmsnorm_case(LZ_F32, 4 * 16, 1024, 1e-4);
  rmsnorm_case(LZ_F32, 1000, 520, 1e-4); /* uneven row chunks */
  rmsnorm_case(LZ_BF16, 3, 37, 1e-5);
  rmsnorm_case(LZ_BF16, 64, 1024, 1e-4);
  rmsnorm_case(LZ_BF16, 5, 5000, 1e-5); /* the cpu's two-pass backward */
}

/* QK-norm on packed q|k|v rows [rows, nq hq + 2 nkv hk] (offset 0 and 1;
 * clip 0 or OLMoE's clip_qkv), forward and backward (dw accumulates onto
 * nonzero values; dx also over dy), twice on the device; the v columns pass
 * unchanged or clamped. */
static void qk_norm_case(int64_t rows, int nq, int nkv, int64_t hq, int64_t hk, float offset,
                         float clip) {
  int64_t xs[2] = {rows, nq * hq + 2 * nkv * hk}, ds[1] = {hq}, ks[1] = {hk},
          rs[1] = {rows * (nq + nkv)};
  lz_tensor *x = host_rand(LZ_F32, 2, xs, 2), *qw = host_rand(LZ_F32, 1, ds, 1.5f);
  lz_tensor *kw = host_rand(LZ_F32, 1, ks, 1.5f);
  lz_tensor *y = host(LZ_F32, 2, xs), *r = host(LZ_F32, 1, rs);
  lz_tensor *d_x = dev(x), *d_qw = dev(qw), *d_kw = dev(kw), *d_y = dev(y), *d_r = dev(r),
            *d_y2 = dev(y), *d_r2 = dev(r);
  CHECK_OK(lz_qk_norm_forward(y, r, x, qw, kw, nq, nkv, 1e-6f, offset, clip));
  CHECK_OK(lz_qk_norm_forward(d_y, d_r, d_x, d_qw, d_kw, nq, nkv, 1e-6f, offset, clip));
  CHECK_OK(lz_qk_norm_forward(d_y2, d_r2, d_x, d_qw, d_kw, nq, nkv, 1e-6f, offset, clip));
  expect_close("qk_norm_forward out", d_y, y, 1e-5);
  expect_close("qk_norm_forward rstd", d_r, r, 1e-5);
  expect_same_bits("qk_norm_forward out", d_y, d_y2);

  lz_tensor *gy = host_rand(LZ_F32, 2, xs, 1), *gx = host(LZ_F32, 2, xs);
  lz_tensor *gq = host_rand(LZ_F32, 1, ds, 1), *gk = host_rand(LZ_F32, 1, ks, 1);
  lz_tensor *d_gy = dev(gy), *d_gx = dev(gx), *d_gx2 = dev(gx), *d_gq = dev(gq), *d_gk = dev(gk),
            *d_gq2 = dev(gq), *d_gk2 = dev(gk);
  CHECK_OK(lz_qk_norm_backward(gx, gq, gk, gy, x, qw, kw, r, nq, nkv, offset, clip));
  CHECK_OK(
      lz_qk_norm_backward(d_gx, d_gq, d_gk, d_gy, d_x, d_qw, d_kw, d_r, nq, nkv, offset, clip));
  CHECK_OK(lz_qk_norm_backward(d_gx2, d_gq2, d_gk2, d_gy, d_x, d_qw, d_kw, d_r, nq, nkv, offset,
                               clip));
  expect_close("qk_norm_backward dx", d_gx, gx, 1e-5);
  expect_close("qk_norm_backward dq_w", d_gq, gq, 1e-4);
  expect_close("qk_norm_backward dk_w", d_gk, gk, 1e-4);
  expect_same_bits("qk_norm_backward dx", d_gx, d_gx2);
  expect_same_bits("qk_norm_backward dq_w", d_gq, d_gq2);
  lz_tensor *d_gq3 = dev(gq), *d_gk3 = dev(gk);
  CHECK_OK(
      lz_qk_norm_backward(d_gy, d_gq3, d_gk3, d_gy, d_x, d_qw, d_kw, d_r, nq, nkv, offset, clip));
  expect_same_bits("qk_norm_backward dx over dy", d_gy, d_gx);
  FREE(x, qw, kw, y, r, d_x, d_qw, d_kw, d_y, d_r, d_y2, d_r2, gy, gx, gq, gk, d_gy, d_gx, d_gx2,
       d_gq, d_gk, d_gq2, d_gk2, d_gq3, d_gk3);
}

static void test_qk_norm(void) {
  qk_norm_case(2 * 3, 4, 2, 8, 8, 0.0f, 0.0f);
  qk_norm_case(1000, 16, 8, 128, 128, 0.0f, 0.0f); /* Qwen3-0.6B's heads, uneven row chunks */
  qk_norm_case(64, 4, 1, 256, 256, 1.0f, 0.0f);    /* Gemma 3's offset */
  qk_norm_case(100, 1, 1, 2048, 2048, 0.0f, 0.0f); /* OLMoE-1B-7B's whole projections */
  qk_norm_case(30, 1, 1, 96, 48, 0.0f, 1.0f);      /* of another width each, clip_qkv */
}

/* RoPE with theta on x of `dt` [B, T, n_head * head_dim], forward and
 * backward, twice on the device; f32 also in place. Angles reach
 * (pos_offset + T) radians: cosf and sinf agree with the cpu's to a few ulps. */
static void rope_case(lz_dtype dt, int64_t B, int64_t T, int n_head, int head_dim,
                      int64_t pos_offset, float theta) {
  int64_t xs[3] = {B, T, (int64_t)n_head * head_dim};
  lz_tensor *x = host_rand(dt, 3, xs, 1), *y = host(LZ_F32, 3, xs), *g = host(LZ_F32, 3, xs);
  lz_tensor *d_x = dev(x), *d_y = dev(y), *d_y2 = dev(y), *d_g = dev(g);
  CHECK_OK(lz_rope_forward(y, x, n_head, head_dim, pos_offset, theta));
  CHECK_OK(lz_rope_forward(d_y, d_x, n_head, head_dim, pos_offset, theta));
  CHECK_OK(lz_rope_forward(d_y2, d_x, n_head, head_dim, pos_offset, theta));
  expect_close("rope_forward", d_y, y, 1e-5);
  expect_same_bits("rope_forward", d_y, d_y2);
  CHECK_OK(lz_rope_backward(g, x, n_head, head_dim, pos_offset, theta));
  CHECK_OK(lz_rope_backward(d_g, d_x, n_head, head_dim, pos_offset, theta));
  expect_close("rope_backward", d_g, g, 1e-5);
  if (dt == LZ_F32) {
    CHECK_OK(lz_rope_forward(d_x, d_x, n_head, head_dim, pos_offset, theta));
    expect_same_bits("rope_forward in place", d_x, d_y);
  }
  FREE(x, y, g, d_x, d_y, d_y2, d_g);
}

/* lz_rope_freqs_* on packed rows: the first n_turn heads of n_all turn by
 * the given inverse frequencies (on the device), the rest is copied; in
 * place, the rest is left alone. */
static void rope_freqs_case(lz_dtype dt, int64_t B, int64_t T, int head_dim, int n_turn,
                            int n_all, int64_t pos_offset) {
  int64_t xs[3] = {B, T, (int64_t)n_all * head_dim}, fs[1] = {head_dim / 2};
  lz_tensor *x = host_rand(dt, 3, xs, 1), *y = host(LZ_F32, 3, xs), *g = host(LZ_F32, 3, xs);
  lz_tensor *f = host(LZ_F32, 1, fs);
  for (int i = 0; i < head_dim / 2; i++) /* Llama 3-like: some scaled down */
    ((float *)f->data)[i] =
        (float)pow(500000.0, -2.0 * i / head_dim) / (i >= head_dim / 4 ? 8.0f : 1.0f);
  lz_tensor *d_x = dev(x), *d_y = dev(y), *d_y2 = dev(y), *d_g = dev(g), *d_f = dev(f);
  CHECK_OK(lz_rope_freqs_forward(y, x, f, n_turn, pos_offset));
  CHECK_OK(lz_rope_freqs_forward(d_y, d_x, d_f, n_turn, pos_offset));
  CHECK_OK(lz_rope_freqs_forward(d_y2, d_x, d_f, n_turn, pos_offset));
  expect_close("rope_freqs_forward", d_y, y, 1e-5);
  expect_same_bits("rope_freqs_forward", d_y, d_y2);
  CHECK_OK(lz_rope_freqs_backward(g, x, f, n_turn, pos_offset));
  CHECK_OK(lz_rope_freqs_backward(d_g, d_x, d_f, n_turn, pos_offset));
  expect_close("rope_freqs_backward", d_g, g, 1e-5);
  if (dt == LZ_F32) {
    CHECK_OK(lz_rope_freqs_forward(d_x, d_x, d_f, n_turn, pos_offset));
    expect_same_bits("rope_freqs_forward in place", d_x, d_y);
  }
  FREE(x, y, g, f, d_x, d_y, d_y2, d_g, d_f);
}

/* lz_rope_ext_* (Phi-3): the first rotary values of each head of n_turn of
 * n_all turn, cos and sin scaled; with per-token positions or an offset. */
static void rope_ext_case(lz_dtype dt, int64_t B, int64_t T, int head_dim, int rotary, int n_turn,
                          int n_all, int64_t pos_offset, float scale, int with_pos) {
  int64_t xs[3] = {B, T, (int64_t)n_all * head_dim}, fs[1] = {rotary / 2}, ps[2] = {B, T};
  lz_tensor *x = host_rand(dt, 3, xs, 1), *y = host(LZ_F32, 3, xs), *g = host(LZ_F32, 3, xs);
  lz_tensor *f = host(LZ_F32, 1, fs), *p = host(LZ_I32, 2, ps);
  for (int i = 0; i < rotary / 2; i++) ((float *)f->data)[i] = (float)pow(10000.0, -2.0 * i / rotary);
  for (int64_t i = 0; i < B * T; i++) ((int32_t *)p->data)[i] = (int32_t)((i * 5) % 19);
  lz_tensor *d_x = dev(x), *d_y = dev(y), *d_y2 = dev(y), *d_g = dev(g), *d_f = dev(f);
  lz_tensor *d_p = dev(p), *hp = with_pos ? p : NULL, *dp = with_pos ? d_p : NULL;
  const int64_t off = with_pos ? 0 : pos_offset;
  CHECK_OK(lz_rope_ext_forward(y, x, f, hp, n_turn, head_dim, off, scale));
  CHECK_OK(lz_rope_ext_forward(d_y, d_x, d_f, dp, n_turn, head_dim, off, scale));
  CHECK_OK(lz_rope_ext_forward(d_y2, d_x, d_f, dp, n_turn, head_dim, off, scale));
  expect_close("rope_ext_forward", d_y, y, 1e-5);
  expect_same_bits("rope_ext_forward", d_y, d_y2);
  CHECK_OK(lz_rope_ext_backward(g, x, f, hp, n_turn, head_dim, off, scale));
  CHECK_OK(lz_rope_ext_backward(d_g, d_x, d_f, dp, n_turn, head_dim, off, scale));
  expect_close("rope_ext_backward", d_g, g, 1e-5);
  if (dt == LZ_F32) {
    CHECK_OK(lz_rope_ext_forward(d_x, d_x, d_f, dp, n_turn, head_dim, off, scale));
    expect_same_bits("rope_ext_forward in place", d_x, d_y);
  }
  FREE(x, y, g, f, p, d_x, d_y, d_y2, d_g, d_f, d_p);
}

static void test_rope(void) {
  rope_ext_case(LZ_F32, 2, 9, 16, 8, 3, 5, 4, 1.19f, 0); /* half of each head, scaled */
  rope_ext_case(LZ_F32, 2, 9, 96, 32, 6, 8, 0, 0.0f, 1); /* per-token positions */
  rope_ext_case(LZ_BF16, 1, 33, 96, 96, 4, 4, 7, 1.3f, 0);
  rope_case(LZ_F32, 2, 5, 3, 8, 0, 10000.0f);
  rope_case(LZ_F32, 1, 7, 2, 12, 1000, 500000.0f);
  rope_case(LZ_F32, 2, 64, 8, 128, 3, 10000.0f);
  rope_case(LZ_BF16, 2, 5, 3, 8, 0, 10000.0f);
  rope_case(LZ_BF16, 2, 64, 8, 128, 7, 10000.0f);
  rope_freqs_case(LZ_F32, 2, 9, 8, 3, 5, 4);    /* 3 heads turn, 2 pass */
  rope_freqs_case(LZ_BF16, 2, 9, 8, 3, 5, 4);
  rope_freqs_case(LZ_F32, 2, 33, 64, 6, 8, 100); /* q|k|v of 4 + 2 + 2 heads, q and k turn */
  rope_freqs_case(LZ_BF16, 1, 64, 128, 8, 8, 0); /* no rest */
}

/* A gated unit's forward and backward (SwiGLU's, GeGLU's). */
typedef struct {
  const char *name;
  lz_status (*forward)(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up);
  lz_status (*backward)(lz_tensor *dgate, lz_tensor *dup, const lz_tensor *dout,
                        const lz_tensor *gate, const lz_tensor *up);
} glu_ops;

static const glu_ops SWIGLU = {"swiglu", lz_swiglu_forward, lz_swiglu_backward};
static const glu_ops GEGLU = {"geglu", lz_geglu_forward, lz_geglu_backward};

/* A gated unit on gate, up (and dout) of `dt`, twice on the device; with
 * in_place also with the outputs over the inputs. The cpu's e^x and tanh
 * are its own polynomials, the device's expf and tanhf: they agree to a few
 * ulps. */
static void glu_case(const glu_ops *op, lz_dtype dt, int64_t n, int in_place) {
  char what[64];
  int64_t s[2] = {n / 8, 8};
  lz_tensor *gt = host_rand(dt, 2, s, 6), *up = host_rand(dt, 2, s, 2);
  lz_tensor *go = host_rand(dt, 2, s, 1);
  lz_tensor *y = host(LZ_F32, 2, s), *dg = host(LZ_F32, 2, s), *du = host(LZ_F32, 2, s);
  lz_tensor *d_gt = dev(gt), *d_up = dev(up), *d_go = dev(go), *d_y = dev(y), *d_y2 = dev(y);
  lz_tensor *d_dg = dev(dg), *d_du = dev(du), *d_dg2 = dev(dg), *d_du2 = dev(du);
  CHECK_OK(op->forward(y, gt, up));
  CHECK_OK(op->forward(d_y, d_gt, d_up));
  CHECK_OK(op->forward(d_y2, d_gt, d_up));
  snprintf(what, sizeof what, "%s_forward", op->name);
  expect_close(what, d_y, y, 1e-5);
  expect_same_bits(what, d_y, d_y2);
  CHECK_OK(op->backward(dg, du, go, gt, up));
  CHECK_OK(op->backward(d_dg, d_du, d_go, d_gt, d_up));
  CHECK_OK(op->backward(d_dg2, d_du2, d_go, d_gt, d_up));
  snprintf(what, sizeof what, "%s_backward dgate", op->name);
  expect_close(what, d_dg, dg, 1e-5);
  expect_same_bits(what, d_dg, d_dg2);
  snprintf(what, sizeof what, "%s_backward dup", op->name);
  expect_close(what, d_du, du, 1e-5);
  expect_same_bits(what, d_du, d_du2);
  if (in_place) { /* dgate over gate, dup over up */
    CHECK_OK(op->backward(d_gt, d_up, d_go, d_gt, d_up));
    snprintf(what, sizeof what, "%s_backward in place dgate", op->name);
    expect_same_bits(what, d_gt, d_dg);
    snprintf(what, sizeof what, "%s_backward in place dup", op->name);
    expect_same_bits(what, d_up, d_du);
  }
  FREE(gt, up, go, y, dg, du, d_gt, d_up, d_go, d_y, d_y2, d_dg, d_du, d_dg2, d_du2);
}

/* lz_swiglu_packed_* (Phi-3's gate_up_proj): each row's gate then up. */
static void swiglu_packed_case(lz_dtype dt, int64_t rows, int64_t H) {
  int64_t gs[2] = {rows, 2 * H}, hs[2] = {rows, H};
  lz_tensor *gu = host_rand(dt, 2, gs, 4), *go = host_rand(dt, 2, hs, 1);
  lz_tensor *y = host(LZ_F32, 2, hs), *dgu = host(LZ_F32, 2, gs);
  lz_tensor *d_gu = dev(gu), *d_go = dev(go), *d_y = dev(y), *d_y2 = dev(y), *d_dgu = dev(dgu);
  CHECK_OK(lz_swiglu_packed_forward(y, gu));
  CHECK_OK(lz_swiglu_packed_forward(d_y, d_gu));
  CHECK_OK(lz_swiglu_packed_forward(d_y2, d_gu));
  expect_close("swiglu_packed_forward", d_y, y, 1e-5);
  expect_same_bits("swiglu_packed_forward", d_y, d_y2);
  CHECK_OK(lz_swiglu_packed_backward(dgu, go, gu));
  CHECK_OK(lz_swiglu_packed_backward(d_dgu, d_go, d_gu));
  expect_close("swiglu_packed_backward", d_dgu, dgu, 1e-5);
  FREE(gu, go, y, dgu, d_gu, d_go, d_y, d_y2, d_dgu);
}

static void test_swiglu(void) {
  swiglu_packed_case(LZ_F32, 37, 96);
  swiglu_packed_case(LZ_BF16, 300, 640);
  glu_case(&SWIGLU, LZ_F32, 8 * 37, 1);
  glu_case(&SWIGLU, LZ_F32, 8 * 50001, 1);
  glu_case(&SWIGLU, LZ_BF16, 8 * 37, 0);
  glu_case(&SWIGLU, LZ_BF16, 8 * 50001, 0);
}

static void test_geglu(void) {
  glu_case(&GEGLU, LZ_F32, 8 * 37, 0);
  glu_case(&GEGLU, LZ_F32, 8 * 50001, 0);
  glu_case(&GEGLU, LZ_BF16, 8 * 50001, 0);
}

/* A whole MoE layer (route, sort, permute, grouped GEMM, combine, and back)
 * on the device against the cpu, twice on the device for the same bits;
 * the last expert gets no token. */
static void moe_case(lz_dtype dt, int64_t N, int64_t E, int64_t K, int64_t C, int64_t D) {
  const int64_t R = N * K;
  int64_t sl[2] = {N, E}, sk[2] = {N, K}, sr[1] = {R}, so[1] = {E + 1}, sx[2] = {N, C};
  int64_t sxp[2] = {R, C}, sy[2] = {R, D}, sw[3] = {E, D, C};
  lz_tensor *lg = host_rand(LZ_F32, 2, sl, 3), *x = host_rand(LZ_F32, 2, sx, 1);
  lz_tensor *w = host_rand(dt, 3, sw, 0.3f), *gy = host_rand(LZ_F32, 2, (int64_t[]){N, D}, 1);
  for (int64_t t = 0; t < N; t++) ((float *)lg->data)[t * E + E - 1] = -30.0f;
  lz_tensor *h[16], *d[16], *d2[16];
  /* 0 weights, 1 idx, 2 probs, 3 ros, 4 sor, 5 off, 6 xp, 7 y, 8 out, 9 dy, 10 dwt,
   * 11 dxp, 12 dw, 13 dx, 14 dl */
  const struct { lz_dtype dt; int nd; int64_t *s; } sp[15] = {
      {LZ_F32, 2, sk}, {LZ_I32, 2, sk}, {LZ_F32, 2, sl}, {LZ_I32, 2, sk}, {LZ_I32, 1, sr},
      {LZ_I32, 1, so}, {dt, 2, sxp}, {LZ_F32, 2, sy}, {LZ_F32, 2, (int64_t[]){N, D}},
      {dt, 2, sy}, {LZ_F32, 2, sk}, {LZ_F32, 2, sxp}, {LZ_F32, 3, sw}, {LZ_F32, 2, sx},
      {LZ_F32, 2, sl}};
  for (int i = 0; i < 15; i++) {
    h[i] = host_rand(sp[i].dt, sp[i].nd, sp[i].s, 0.0f);
    d[i] = dev(h[i]);
    d2[i] = dev(h[i]);
  }
  lz_tensor *dlg = dev(lg), *dx_ = dev(x), *dw_ = dev(w), *dgy = dev(gy);
  for (int run = 0; run < 3; run++) {
    lz_tensor **t = run == 0 ? h : run == 1 ? d : d2;
    lz_tensor *l = run ? dlg : lg, *xx = run ? dx_ : x, *ww = run ? dw_ : w, *g = run ? dgy : gy;
    CHECK_OK(lz_moe_route_forward(t[0], t[1], t[2], l, 1));
    CHECK_OK(lz_moe_sort(t[3], t[4], t[5], t[1]));
    CHECK_OK(lz_moe_permute_forward(t[6], xx, t[4]));
    CHECK_OK(lz_moe_gemm_forward(t[7], t[6], ww, t[5]));
    CHECK_OK(lz_moe_combine_forward(t[8], t[7], t[0], t[3]));
    CHECK_OK(lz_moe_combine_backward(t[9], t[10], g, t[7], t[0], t[3]));
    CHECK_OK(lz_moe_gemm_backward(t[11], t[12], t[9], t[6], ww, t[5]));
    CHECK_OK(lz_moe_permute_backward(t[13], t[11], t[3]));
    CHECK_OK(lz_moe_route_backward(t[14], t[10], NULL, t[2], t[1], 1));
  }
  static const char *names[15] = {"moe weights", "moe idx", "moe probs", "moe row_of_slot",
                                  "moe slot_of_row", "moe offsets", "moe permuted x", "moe y",
                                  "moe out", "moe dy", "moe dweights", "moe dx rows", "moe dw",
                                  "moe dx", "moe dlogits"};
  const double tol = dt == LZ_BF16 ? 2e-2 : 1e-4;
  for (int i = 0; i < 15; i++) {
    expect_close(names[i], d[i], h[i], i == 1 || i == 3 || i == 4 || i == 5 ? 0.0 : tol);
    expect_same_bits(names[i], d[i], d2[i]);
  }
  if (K < E) CHECK(((int32_t *)h[5]->data)[E] == ((int32_t *)h[5]->data)[E - 1]);
  for (int i = 0; i < 15; i++) lz_tensor_free(h[i]), lz_tensor_free(d[i]), lz_tensor_free(d2[i]);
  FREE(lg, x, w, gy, dlg, dx_, dw_, dgy);
}

/* A row with a NaN logit and one with +inf (every probability NaN): the
 * cpu takes experts 0 .. K - 1 there, and the device the same experts. */
static void moe_route_nan_case(void) {
  const int64_t N = 3, E = 4, K = 2;
  int64_t sl[2] = {N, E}, sk[2] = {N, K};
  lz_tensor *lg = host_rand(LZ_F32, 2, sl, 3);
  ((float *)lg->data)[1] = NAN;
  ((float *)lg->data)[E + 2] = INFINITY;
  lz_tensor *w = host(LZ_F32, 2, sk), *id = host(LZ_I32, 2, sk), *p = host(LZ_F32, 2, sl);
  lz_tensor *dl = dev(lg), *dw = dev(w), *did = dev(id), *dp = dev(p);
  CHECK_OK(lz_moe_route_forward(w, id, p, lg, 1));
  CHECK_OK(lz_moe_route_forward(dw, did, dp, dl, 1));
  const int32_t *hi = id->data;
  CHECK(hi[0] == 0 && hi[1] == 1 && hi[2] == 0 && hi[3] == 1);
  expect_close("moe idx of NaN rows", did, id, 0.0);
  FREE(lg, w, id, p, dl, dw, did, dp);
}

/* A repeated row in row_of_slot and an expert id past E: refused on the
 * device with the cpu's messages (a repeated row was summed once). */
static void moe_bad_rows_case(void) {
  const int64_t N = 4, K = 2, C = 8, E = 3, R = N * K;
  int64_t sr[1] = {R}, sx[2] = {R, C}, so[2] = {N, C}, sk[2] = {N, K}, sl[2] = {N, E};
  lz_tensor *ros = host(LZ_I32, 1, sr), *xp = host_rand(LZ_F32, 2, sx, 1);
  lz_tensor *out = host(LZ_F32, 2, so), *wt = host_rand(LZ_F32, 2, sk, 1);
  for (int64_t s = 0; s < R; s++) ((int32_t *)ros->data)[s] = (int32_t)(s == 3 ? 1 : s);
  lz_tensor *d_ros = dev(ros), *d_xp = dev(xp), *d_out = dev(out), *d_wt = dev(wt);
  CHECK(lz_moe_combine_forward(out, xp, wt, ros) == LZ_ERR_INVALID);
  lz_status st = lz_moe_combine_forward(d_out, d_xp, d_wt, d_ros);
  CHECK(st == LZ_ERR_INVALID && strstr(lz_last_error(), "row_of_slot[3] is 1, as row_of_slot[1]"));
  lz_tensor *idx = host(LZ_I32, 2, sk), *probs = host_rand(LZ_F32, 2, sl, 1);
  lz_tensor *dl = host(LZ_F32, 2, sl);
  for (int64_t i = 0; i < N * K; i++) ((int32_t *)idx->data)[i] = (int32_t)(i % K);
  ((int32_t *)idx->data)[5] = (int32_t)E;
  lz_tensor *d_idx = dev(idx), *d_probs = dev(probs), *d_dl = dev(dl);
  st = lz_moe_route_backward(d_dl, d_wt, NULL, d_probs, d_idx, 1);
  CHECK(st == LZ_ERR_INVALID && strstr(lz_last_error(), "idx[5] is 3, outside [0, 3)"));
  FREE(ros, xp, out, wt, d_ros, d_xp, d_out, d_wt, idx, probs, dl, d_idx, d_probs, d_dl);
}

/* The fused 8-bit AdamW on the device: the cpu's bits (bitsandbytes'
 * indices, which are not always the nearest entry: zero moments take
 * index 131 and 7), over a few steps from zero states. */
static void test_adamw8bit(void) {
  const int64_t n = 4096 + 300, blocks = lz_adamw8bit_blocks(n);
  int64_t s[1] = {n}, sb[1] = {blocks};
  lz_adamw_args args = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                        .weight_decay = 0.01f, .grad_scale = 1.0f, .step = 1};
  lz_tensor *p = host_rand(LZ_F32, 1, s, 1), *m = host(LZ_U8, 1, s), *v = host(LZ_U8, 1, s);
  lz_tensor *am = host(LZ_F32, 1, sb), *av = host(LZ_F32, 1, sb);
  memset(m->data, 0, (size_t)n), memset(v->data, 0, (size_t)n);
  memset(am->data, 0, sizeof(float) * (size_t)blocks);
  memset(av->data, 0, sizeof(float) * (size_t)blocks);
  lz_tensor *dp = dev(p), *dm = dev(m), *dv = dev(v), *dam = dev(am), *dav = dev(av);
  for (int step = 1; step <= 3; step++, args.step++) {
    lz_tensor *g = host_rand(LZ_F32, 1, s, 1);
    for (int64_t i = 0; i < 64; i++) ((float *)g->data)[i] = 0.0f; /* zero moments */
    lz_tensor *dg = dev(g);
    CHECK_OK(lz_adamw8bit_step(p, g, m, v, am, av, NULL, &args));
    CHECK_OK(lz_adamw8bit_step(dp, dg, dm, dv, dam, dav, NULL, &args));
    FREE(g, dg);
  }
  expect_cpu_bits("adamw8bit param", dp, p);
  expect_cpu_bits("adamw8bit m", dm, m);
  expect_cpu_bits("adamw8bit v", dv, v);
  expect_cpu_bits("adamw8bit absmax_m", dam, am);
  expect_cpu_bits("adamw8bit absmax_v", dav, av);
  CHECK(((uint8_t *)m->data)[0] == 131 && ((uint8_t *)v->data)[0] == 7);
  FREE(p, m, v, am, av, dp, dm, dv, dam, dav);
}

static void test_moe(void) {
  moe_bad_rows_case();
  moe_route_nan_case();
  moe_case(LZ_F32, 300, 8, 2, 64, 96);
  moe_case(LZ_F32, 50, 6, 6, 32, 16); /* k = E */
  moe_case(LZ_BF16, 300, 8, 2, 64, 96);
}

/* Soft-capped logits and the cross-entropy backward through the cap, f32
 * and bf16 dlogits, and in place, against the cpu. */
static void test_softcap(void) {
  int64_t B = 4, T = 9, V = 1500, Vp = 1536;
  int64_t ls[3] = {B, T, Vp}, ts[2] = {B, T};
  lz_tensor *x = host_rand(LZ_F32, 3, ls, 60), *tg = host(LZ_I32, 2, ts);
  for (int64_t i = 0; i < B * T; i++)
    ((int32_t *)tg->data)[i] = i == 3 ? -1 : (int32_t)(i * 131 % V);
  lz_tensor *y = host(LZ_F32, 3, ls), *gl = host(LZ_F32, 3, ls), *gb = host(LZ_BF16, 3, ls);
  lz_tensor *d_x = dev(x), *d_tg = dev(tg), *d_y = dev(y), *d_gl = dev(gl), *d_gb = dev(gb);
  CHECK_OK(lz_softcap_forward(y, x, 30.0f));
  CHECK_OK(lz_softcap_forward(d_y, d_x, 30.0f));
  expect_close("softcap_forward", d_y, y, 1e-5);
  CHECK_OK(lz_tensor_copy(d_y, y)); /* the same capped logits on both sides */
  CHECK_OK(lz_cross_entropy_softcap_backward(gl, y, tg, V, 0.25f, 30.0f));
  CHECK_OK(lz_cross_entropy_softcap_backward(d_gl, d_y, d_tg, V, 0.25f, 30.0f));
  expect_close("cross_entropy_softcap_backward", d_gl, gl, 1e-5);
  CHECK_OK(lz_cross_entropy_softcap_backward(gb, y, tg, V, 0.25f, 30.0f));
  CHECK_OK(lz_cross_entropy_softcap_backward(d_gb, d_y, d_tg, V, 0.25f, 30.0f));
  expect_close("cross_entropy_softcap_backward bf16", d_gb, gb, 1e-2);
  CHECK_OK(lz_cross_entropy_softcap_backward(d_y, d_y, d_tg, V, 0.25f, 30.0f));
  expect_close("cross_entropy_softcap_backward in place", d_y, gl, 1e-5);
  FREE(x, tg, y, gl, gb, d_x, d_tg, d_y, d_gl, d_gb);
}

/* Five Lion steps with mixed gradients (some zero) on the cpu and, twice,
 * on the device: param, m and the working copy bitwise the cpu's. */
static void lion_case(int64_t n, int with_working, lz_dtype wdt, const lz_lion_args *args) {
  int64_t s[1] = {n};
  lz_tensor *p = host_rand(LZ_F32, 1, s, 1), *m = host(LZ_F32, 1, s), *g = host(LZ_F32, 1, s);
  lz_tensor *w = with_working ? host(wdt, 1, s) : NULL;
  CHECK_OK(lz_fill(m, 0.0f));
  lz_tensor *d_p = dev(p), *d_m = dev(m), *d_g = dev(g), *d_w = w ? dev(w) : NULL;
  lz_tensor *d_p2 = dev(p), *d_m2 = dev(m), *d_w2 = w ? dev(w) : NULL;
  for (int step = 1; step <= 5; step++) {
    float *gp = g->data;
    for (int64_t i = 0; i < n; i++) gp[i] = i % 11 == 0 ? 0.0f : uniform() * (i % 3 ? 1.0f : 1e-3f);
    CHECK_OK(lz_tensor_copy(d_g, g));
    CHECK_OK(lz_lion_step(p, g, m, w, args));
    CHECK_OK(lz_lion_step(d_p, d_g, d_m, d_w, args));
    CHECK_OK(lz_lion_step(d_p2, d_g, d_m2, d_w2, args));
  }
  expect_close("lion param", d_p, p, 0.0);
  expect_close("lion m", d_m, m, 0.0);
  if (w) expect_close("lion working copy", d_w, w, 0.0);
  expect_same_bits("lion param", d_p, d_p2);
  expect_same_bits("lion m", d_m, d_m2);
  if (w) expect_same_bits("lion working copy", d_w, d_w2);
  FREE(p, m, g, w, d_p, d_m, d_g, d_w, d_p2, d_m2, d_w2);
}

static void test_lion(void) {
  const lz_lion_args typical = {
      .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f, .grad_scale = 0.5f};
  const lz_lion_args big = {
      .lr = 3e-2f, .beta1 = 0.95f, .beta2 = 0.98f, .weight_decay = 0.0f, .grad_scale = 8.0f};
  lion_case(1001, 0, LZ_F32, &typical);
  lion_case(1001, 0, LZ_F32, &big);
  lion_case(1001, 1, LZ_F32, &typical);
  lion_case(100003, 1, LZ_BF16, &typical);
  lion_case(100003, 1, LZ_F16, &typical);
}

/* bf16 stochastic rounding: the device draws the cpu's bits (the same key
 * and hash), at a global index past 2^32, twice the same. */
static void test_sround(void) {
  int64_t s[1] = {100003};
  lz_tensor *x = host_rand(LZ_F32, 1, s, 100.0f), *h = host(LZ_BF16, 1, s);
  lz_tensor *d_x = dev(x), *d_h = dev(h), *d_h2 = dev(h);
  const int64_t index = (1ll << 32) + 5;
  CHECK_OK(lz_bf16_round_stochastic(h, x, 1234, 17, index));
  CHECK_OK(lz_bf16_round_stochastic(d_h, d_x, 1234, 17, index));
  CHECK_OK(lz_bf16_round_stochastic(d_h2, d_x, 1234, 17, index));
  expect_close("bf16_round_stochastic", d_h, h, 0.0);
  expect_same_bits("bf16_round_stochastic", d_h, d_h2);
  FREE(x, h, d_x, d_h, d_h2);
}

/* Grouped-query attention (qkv rows of q for NH heads, k and v for NKV),
 * forward and backward against the cpu, the backward twice. */
static void gqa_case(int64_t B, int64_t T, int NH, int NKV, int64_t HS) {
  const int64_t row = (NH + 2 * (int64_t)NKV) * HS, C = NH * HS;
  int64_t qs[3] = {B, T, row}, os[3] = {B, T, C}, ls[3] = {B, NH, T};
  lz_tensor *qkv = host_rand(LZ_F32, 3, qs, 1.5f), *o = host(LZ_F32, 3, os);
  lz_tensor *l = host(LZ_F32, 3, ls);
  lz_tensor *d_qkv = dev(qkv), *d_o = dev(o), *d_l = dev(l);
  CHECK_OK(lz_attention_gqa_forward(o, l, qkv, NH, NKV));
  CHECK_OK(lz_attention_gqa_forward(d_o, d_l, d_qkv, NH, NKV));
  expect_close("attention_gqa_forward out", d_o, o, 1e-5);
  expect_close("attention_gqa_forward lse", d_l, l, 1e-5);
  lz_tensor *go = host_rand(LZ_F32, 3, os, 1), *gq = host(LZ_F32, 3, qs);
  lz_tensor *d_go = dev(go), *d_gq = dev(gq), *d_gq2 = dev(gq);
  CHECK_OK(lz_attention_gqa_backward(gq, go, qkv, o, l, NH, NKV));
  CHECK_OK(lz_attention_gqa_backward(d_gq, d_go, d_qkv, d_o, d_l, NH, NKV));
  CHECK_OK(lz_attention_gqa_backward(d_gq2, d_go, d_qkv, d_o, d_l, NH, NKV));
  expect_close("attention_gqa_backward dqkv", d_gq, gq, 1e-5);
  expect_same_bits("attention_gqa_backward dqkv", d_gq, d_gq2);
  FREE(qkv, o, l, d_qkv, d_o, d_l, go, gq, d_go, d_gq, d_gq2);
}

static void test_attention_gqa(void) {
  gqa_case(2, 7, 4, 2, 8);    /* short */
  gqa_case(1, 130, 8, 2, 16); /* three query blocks, groups of 4 */
  gqa_case(2, 65, 6, 1, 32);  /* one key/value head (multi-query) */
  gqa_case(1, 64, 4, 4, 16);  /* n_kv_head = n_head: plain multi-head */
  gqa_case(1, 40, 4, 2, 128); /* Llama's head size */
}

/* The attention options (window, soft-capping, scale), with and without
 * documents, forward and backward against the cpu. */
static void opts_case(int64_t T, int NH, int NKV, int64_t HS, int window, float cap, float scale,
                      int docs) {
  const int64_t B = 2, row = (NH + 2 * (int64_t)NKV) * HS, C = NH * HS;
  int64_t qs[3] = {B, T, row}, os[3] = {B, T, C}, ls[3] = {B, NH, T}, ss[2] = {B, T};
  lz_tensor *qkv = host_rand(LZ_F32, 3, qs, 2.0f), *o = host(LZ_F32, 3, os);
  lz_tensor *l = host(LZ_F32, 3, ls), *seg = NULL, *d_seg = NULL;
  if (docs) {
    seg = host(LZ_I32, 2, ss);
    for (int64_t i = 0; i < B * T; i++) ((int32_t *)seg->data)[i] = (int32_t)((i % T) * docs / T);
    d_seg = dev(seg);
  }
  lz_tensor *d_qkv = dev(qkv), *d_o = dev(o), *d_l = dev(l);
  CHECK_OK(lz_attention_opts_forward(o, l, qkv, seg, NH, NKV, window, cap, scale));
  CHECK_OK(lz_attention_opts_forward(d_o, d_l, d_qkv, d_seg, NH, NKV, window, cap, scale));
  expect_close("attention_opts_forward out", d_o, o, 1e-5);
  expect_close("attention_opts_forward lse", d_l, l, 1e-5);
  lz_tensor *go = host_rand(LZ_F32, 3, os, 1), *gq = host(LZ_F32, 3, qs);
  lz_tensor *d_go = dev(go), *d_gq = dev(gq);
  CHECK_OK(lz_attention_opts_backward(gq, go, qkv, o, l, seg, NH, NKV, window, cap, scale));
  CHECK_OK(lz_attention_opts_backward(d_gq, d_go, d_qkv, d_o, d_l, d_seg, NH, NKV, window, cap,
                                      scale));
  expect_close("attention_opts_backward dqkv", d_gq, gq, 1e-5);
  FREE(qkv, o, l, d_qkv, d_o, d_l, go, gq, d_go, d_gq);
  if (docs) FREE(seg, d_seg);
}

static void test_attention_options(void) {
  opts_case(150, 4, 2, 16, 5, 0, 0, 0);        /* window under a key tile */
  opts_case(200, 4, 1, 32, 70, 0, 0, 0);       /* window across query blocks */
  opts_case(130, 4, 2, 16, 0, 5.0f, 0, 0);     /* soft-capping */
  opts_case(100, 2, 2, 64, 0, 0, 0.0625f, 0);  /* scale */
  opts_case(180, 8, 2, 128, 33, 3.0f, 0.2f, 3); /* all, with documents */
}

/* Token-only embedding (no position table), as Llama's. */
static void test_embedding_tokens_only(void) {
  int64_t V = 50, C = 40, B = 3, T = 12;
  int64_t ts[2] = {B, T}, tes[2] = {V, C}, os[3] = {B, T, C};
  lz_tensor *tok = host(LZ_I32, 2, ts);
  for (int64_t i = 0; i < B * T; i++) ((int32_t *)tok->data)[i] = (int32_t)(i * 7 % 5);
  lz_tensor *wte = host_rand(LZ_F32, 2, tes, 1), *o = host(LZ_F32, 3, os);
  lz_tensor *d_tok = dev(tok), *d_wte = dev(wte), *d_o = dev(o);
  CHECK_OK(lz_embedding_forward(o, tok, wte, NULL));
  CHECK_OK(lz_embedding_forward(d_o, d_tok, d_wte, NULL));
  expect_close("embedding_forward tokens only", d_o, o, 0.0); /* copies */
  lz_tensor *g = host_rand(LZ_F32, 3, os, 1), *d_g = dev(g);
  CHECK_OK(lz_embedding_backward(wte, NULL, g, tok));
  CHECK_OK(lz_embedding_backward(d_wte, NULL, d_g, d_tok));
  expect_close("embedding_backward dwte only", d_wte, wte, 0.0); /* the cpu's order */
  FREE(tok, wte, o, d_tok, d_wte, d_o, g, d_g);
}

static void test_ledger_and_streams(void) {
  int64_t before = lz_mem_device_current(LZ_MEM_PARAMS);
  lz_mem_reset_peak();
  lz_tensor *t = NULL;
  CHECK_OK(lz_tensor_new_on(&t, LZ_F32, 2, (int64_t[]){1000, 1000}, LZ_MEM_PARAMS, LZ_CUDA));
  CHECK(lz_mem_device_current(LZ_MEM_PARAMS) == before + 4000000);
  CHECK(lz_mem_device_peak(LZ_MEM_PARAMS) >= before + 4000000);
  CHECK(t && t->device == LZ_CUDA);
  lz_tensor_free(t);
  CHECK(lz_mem_device_current(LZ_MEM_PARAMS) == before);
  CHECK(lz_mem_device_peak(LZ_MEM_PARAMS) >= before + 4000000);
  /* Pinned host memory is host-side offload; an async round trip through it. */
  int64_t off0 = lz_mem_current(LZ_MEM_OFFLOAD);
  float *pin = NULL;
  size_t n = 1 << 20;
  CHECK_OK(lz_mem_alloc_pinned((void **)&pin, n * sizeof(float)));
  CHECK(lz_mem_current(LZ_MEM_OFFLOAD) == off0 + (int64_t)(n * sizeof(float)));
  if (!pin) return;
  for (size_t i = 0; i < n; i++) pin[i] = (float)i;
  lz_tensor *hp = NULL, *d = NULL;
  CHECK_OK(lz_tensor_wrap(&hp, pin, LZ_F32, 1, (int64_t[]){(int64_t)n}));
  CHECK_OK(lz_tensor_new_on(&d, LZ_F32, 1, (int64_t[]){(int64_t)n}, LZ_MEM_WORKSPACE, LZ_CUDA));
  lz_event *e1 = NULL, *e2 = NULL;
  CHECK_OK(lz_event_new(&e1));
  CHECK_OK(lz_event_new(&e2));
  CHECK_OK(lz_tensor_copy_async(d, hp, LZ_STREAM_COPY));
  CHECK_OK(lz_event_record(e1, LZ_STREAM_COPY));
  CHECK_OK(lz_stream_wait_event(LZ_STREAM_COMPUTE, e1));
  CHECK_OK(lz_scale(d, 2.0f)); /* on compute, after the copy */
  CHECK_OK(lz_event_record(e2, LZ_STREAM_COMPUTE));
  CHECK_OK(lz_stream_wait_event(LZ_STREAM_COPY, e2));
  CHECK_OK(lz_tensor_copy_async(hp, d, LZ_STREAM_COPY));
  CHECK_OK(lz_stream_synchronize(LZ_STREAM_COPY));
  int done = 0;
  CHECK_OK(lz_event_query(e2, &done));
  CHECK(done == 1);
  CHECK(pin[12345] == 24690.0f && pin[n - 1] == 2.0f * (float)(n - 1));
  lz_event_free(e1);
  lz_event_free(e2);
  FREE(hp, d);
  CHECK_OK(lz_mem_free(pin));
  CHECK(lz_mem_current(LZ_MEM_OFFLOAD) == off0);
}

/* Document masking: attention with seg (GPT-2's and Llama's shapes), the
 * position table and the rotary turn indexed by pos, against the cpu. */
static void test_masking(void) {
  int64_t B = 2, T = 150, NH = 4, NKV = 2, HS = 16, W = (NH + 2 * NKV) * HS, C = NH * HS;
  int64_t ss[2] = {B, T}, os[3] = {B, T, C}, ls[3] = {B, NH, T};
  lz_tensor *seg = host(LZ_I32, 2, ss), *pos = host(LZ_I32, 2, ss);
  const int64_t lens[2][4] = {{40, 70, 1, 39}, {5, 9, 64, 72}};
  for (int64_t b = 0; b < B; b++)
    for (int64_t d = 0, t = 0; d < 4; d++)
      for (int64_t k = 0; k < lens[b][d]; k++, t++) {
        ((int32_t *)seg->data)[b * T + t] = (int32_t)(d * 3 + 1);
        ((int32_t *)pos->data)[b * T + t] = (int32_t)k;
      }
  lz_tensor *d_seg = dev(seg), *d_pos = dev(pos);
  for (int nkv = (int)NKV; nkv <= NH; nkv += (int)(NH - NKV)) {
    int64_t w = (NH + 2 * nkv) * HS, q2[3] = {B, T, w};
    lz_tensor *qkv = host_rand(LZ_F32, 3, q2, 1), *o = host(LZ_F32, 3, os),
              *l = host(LZ_F32, 3, ls);
    lz_tensor *d_qkv = dev(qkv), *d_o = dev(o), *d_l = dev(l);
    CHECK_OK(lz_attention_seg_forward(o, l, qkv, seg, (int)NH, nkv));
    CHECK_OK(lz_attention_seg_forward(d_o, d_l, d_qkv, d_seg, (int)NH, nkv));
    expect_close("attention_seg_forward out", d_o, o, 1e-5);
    expect_close("attention_seg_forward lse", d_l, l, 1e-5);
    lz_tensor *go = host_rand(LZ_F32, 3, os, 1), *gq = host(LZ_F32, 3, q2);
    lz_tensor *d_go = dev(go), *d_gq = dev(gq);
    CHECK_OK(lz_attention_seg_backward(gq, go, qkv, o, l, seg, (int)NH, nkv));
    CHECK_OK(lz_attention_seg_backward(d_gq, d_go, d_qkv, d_o, d_l, d_seg, (int)NH, nkv));
    expect_close("attention_seg_backward dqkv", d_gq, gq, 1e-5);
    FREE(qkv, o, l, d_qkv, d_o, d_l, go, gq, d_go, d_gq);
  }

  int64_t V = 50, P = 80, es[2] = {V, C}, ps[2] = {P, C};
  lz_tensor *tok = host(LZ_I32, 2, ss);
  for (int64_t i = 0; i < B * T; i++) ((int32_t *)tok->data)[i] = (int32_t)(i * 7 % V);
  lz_tensor *wte = host_rand(LZ_F32, 2, es, 1), *wpe = host_rand(LZ_F32, 2, ps, 1);
  lz_tensor *o = host(LZ_F32, 3, os), *g = host_rand(LZ_F32, 3, os, 1);
  lz_tensor *d_tok = dev(tok), *d_wte = dev(wte), *d_wpe = dev(wpe), *d_o = dev(o), *d_g = dev(g);
  CHECK_OK(lz_embedding_pos_forward(o, tok, pos, wte, wpe));
  CHECK_OK(lz_embedding_pos_forward(d_o, d_tok, d_pos, d_wte, d_wpe));
  expect_close("embedding_pos_forward", d_o, o, 1e-5);
  CHECK_OK(lz_embedding_pos_backward(wte, wpe, g, tok, pos));
  CHECK_OK(lz_embedding_pos_backward(d_wte, d_wpe, d_g, d_tok, d_pos));
  expect_close("embedding_pos_backward dwpe", d_wpe, wpe, 1e-5);

  int64_t fs[1] = {HS / 2}, rs[3] = {B, T, W};
  lz_tensor *freqs = host(LZ_F32, 1, fs);
  for (int64_t i = 0; i < HS / 2; i++)
    ((float *)freqs->data)[i] = (float)pow(10000.0, -2.0 * (double)i / (double)HS);
  lz_tensor *x = host_rand(LZ_F32, 3, rs, 1), *y = host(LZ_F32, 3, rs);
  lz_tensor *d_freqs = dev(freqs), *d_x = dev(x), *d_y = dev(y);
  CHECK_OK(lz_rope_pos_forward(y, x, freqs, pos, (int)(NH + NKV)));
  CHECK_OK(lz_rope_pos_forward(d_y, d_x, d_freqs, d_pos, (int)(NH + NKV)));
  expect_close("rope_pos_forward", d_y, y, 1e-5);
  CHECK_OK(lz_rope_pos_backward(y, x, freqs, pos, (int)(NH + NKV)));
  CHECK_OK(lz_rope_pos_backward(d_y, d_x, d_freqs, d_pos, (int)(NH + NKV)));
  expect_close("rope_pos_backward", d_y, y, 1e-5);
  FREE(seg, pos, d_seg, d_pos, tok, wte, wpe, o, g, d_tok, d_wte, d_wpe, d_o, d_g);
  FREE(freqs, x, y, d_freqs, d_x, d_y);
}

static void test_errors(void) {
  int64_t s[1] = {8};
  lz_tensor *h = host_rand(LZ_F32, 1, s, 1), *d = dev(h);
  lz_status st = lz_add(d, d, h);
  CHECK(st == LZ_ERR_INVALID && strstr(lz_last_error(), "lives on cuda but b lives on cpu"));
  st = lz_cuda_init(lz_cuda_device() + 1);
  CHECK(st == LZ_ERR_INVALID && strstr(lz_last_error(), "already uses cuda device"));
  FREE(h, d);
}

/* ------------------------------------------------------------------- runner */

static const struct {
  const char *name;
  void (*fn)(void);
} tests[] = {
    {"cuda_matmul_f32", test_matmul_f32},
    {"cuda_matmul_bf16", test_matmul_bf16},
    {"cuda_linear_f32", test_linear_f32},
    {"cuda_linear_bf16", test_linear_bf16},
    {"cuda_layernorm", test_layernorm},
    {"cuda_gelu", test_gelu},
    {"cuda_attention", test_attention},
    {"cuda_embedding", test_embedding},
    {"cuda_cross_entropy", test_cross_entropy},
    {"cuda_elementwise", test_elementwise},
    {"cuda_convert", test_convert},
    {"cuda_adamw", test_adamw},
    {"cuda_adamw8bit", test_adamw8bit},
    {"cuda_rmsnorm", test_rmsnorm},
    {"cuda_qk_norm", test_qk_norm},
    {"cuda_rope", test_rope},
    {"cuda_swiglu", test_swiglu},
    {"cuda_geglu", test_geglu},
    {"cuda_softcap", test_softcap},
    {"cuda_moe", test_moe},
    {"cuda_lion", test_lion},
    {"cuda_bf16_round_stochastic", test_sround},
    {"cuda_attention_gqa", test_attention_gqa},
    {"cuda_attention_options", test_attention_options},
    {"cuda_embedding_tokens_only", test_embedding_tokens_only},
    {"cuda_ledger_and_streams", test_ledger_and_streams},
    {"cuda_masking", test_masking},
    {"cuda_errors", test_errors},
};

int main(int argc, char **argv) {
  const char *filter = argc > 1 ? argv[1] : NULL;
  static char why[1024];
  if (lz_cuda_init(0) != LZ_OK) {
    snprintf(why, sizeof why, "%s", lz_last_error());
    skip_reason = why;
  }
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
    if (filter && !strstr(tests[i].name, filter)) continue;
    if (skip_reason) {
      printf("skip %-40s skipped: %s\n", tests[i].name, skip_reason);
      skipped++;
      continue;
    }
    failures = 0;
    tests[i].fn();
    if (failures == 0) {
      passed++;
      printf("ok   %s\n", tests[i].name);
    } else {
      failed++;
      printf("FAIL %s\n", tests[i].name);
    }
    fflush(stdout);
  }
  if (skipped)
    printf("%d passed, %d failed (%d skipped: no GPU)\n", passed, failed, skipped);
  else
    printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
