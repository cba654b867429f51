/* test_attention.c — causal self-attention against a naive double-precision
 * reference (full T x T softmax) and its gradient against central finite
 * differences taken in double through that reference. */
#include "attention_ref.h"
#include "lz_test.h"

#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

static lz_tensor *new3(int64_t a, int64_t b, int64_t c) {
  lz_tensor *t = NULL;
  int64_t shape[3] = {a, b, c};
  CHECK_OK(lz_tensor_new(&t, LZ_F32, 3, shape, LZ_MEM_WORKSPACE));
  return t;
}

static lz_tensor *rand3(int64_t a, int64_t b, int64_t c, float amp) {
  lz_tensor *t = new3(a, b, c);
  float *p = t->data;
  for (int64_t i = 0; i < a * b * c; i++) p[i] = amp * frand();
  return t;
}

/* Multi-head attention as attention_ref.h's shape. */
static attn_shape mha(int64_t B, int64_t T, int64_t C, int NH) {
  return (attn_shape){B, T, NH, NH, (int)(C / NH), 0, 0, 0, 0};
}

static void check_forward(int64_t B, int64_t T, int64_t C, int NH, float amp) {
  lz_tensor *qkv = rand3(B, T, 3 * C, amp), *out = new3(B, T, C), *lse = new3(B, NH, T);
  CHECK_OK(lz_attention_forward(out, lse, qkv, NH));
  const attn_shape s = mha(B, T, C, NH);
  double *x = attn_to_double(qkv);
  double *ro = malloc(sizeof(double) * (size_t)(B * T * C));
  double *rl = malloc(sizeof(double) * (size_t)(B * NH * T));
  attn_ref_forward(ro, rl, x, NULL, &s);
  double err_o = attn_max_error(out->data, ro, B * T * C);
  double err_l = attn_max_error(lse->data, rl, B * NH * T);
  const double tol = 5e-6 * (amp > 1 ? amp * amp : 1); /* scores grow as amp^2 */
  if (!(err_o <= tol) || !(err_l <= tol))
    lz_test_fail(__FILE__, __LINE__,
                 "forward B%lld T%lld C%lld NH%d amp %g: out error %g, "
                 "lse error %g",
                 (long long)B, (long long)T, (long long)C, NH, (double)amp, err_o, err_l);
  free(x);
  free(ro);
  free(rl);
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
}

LZ_TEST(attention_forward_matches_reference) {
  check_forward(1, 1, 16, 1, 1.0f);    /* one token */
  check_forward(2, 7, 24, 3, 1.0f);    /* HS 8, less than a vector */
  check_forward(2, 64, 32, 2, 1.0f);   /* exactly one tile */
  check_forward(1, 100, 64, 1, 2.0f);  /* NH 1, T not a multiple of the tile */
  check_forward(3, 17, 192, 3, 1.0f);  /* HS 64 */
  check_forward(1, 130, 160, 2, 1.0f); /* HS 80 (5 vectors), three tiles */
  check_forward(1, 65, 6, 6, 3.0f);    /* HS 1 */
  check_forward(2, 200, 96, 2, 4.0f);  /* sharp softmax: large scores */
}

/* Analytic dqkv (fp32) against central differences in double on up to
 * max_checks elements spread over qkv. */
static void check_backward(int64_t B, int64_t T, int64_t C, int NH, int max_checks) {
  lz_tensor *qkv = rand3(B, T, 3 * C, 1.5f), *out = new3(B, T, C), *lse = new3(B, NH, T);
  lz_tensor *dout = rand3(B, T, C, 1.0f), *dqkv = rand3(B, T, 3 * C, 100.0f);
  CHECK_OK(lz_attention_forward(out, lse, qkv, NH));
  CHECK_OK(lz_attention_backward(dqkv, dout, qkv, out, lse, NH));
  const attn_shape s = mha(B, T, C, NH);
  int64_t at;
  double got, fd;
  double worst = attn_grad_error(qkv, dqkv, dout->data, NULL, &s, max_checks, 7, &at, &got, &fd);
  if (!(worst <= 1e-3))
    lz_test_fail(__FILE__, __LINE__,
                 "backward B%lld T%lld C%lld NH%d: relative error %g at element %lld "
                 "(analytic %.9g, finite difference %.9g)",
                 (long long)B, (long long)T, (long long)C, NH, worst, (long long)at, got, fd);
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(dout);
  lz_tensor_free(dqkv);
}

LZ_TEST(attention_backward_matches_finite_differences) {
  check_backward(1, 1, 8, 2, 100000);   /* one token: dq, dk are 0, dv = dout */
  check_backward(2, 5, 12, 3, 100000);  /* HS 4 */
  check_backward(1, 70, 16, 1, 100000); /* NH 1, two tiles, the second partial */
  check_backward(2, 33, 48, 3, 100000); /* HS 16 */
  check_backward(1, 131, 40, 2, 1000);  /* HS 20, three tiles */
  check_backward(1, 80, 128, 2, 800);   /* HS 64 */
  check_backward(1, 20, 160, 2, 2000);  /* HS 80: head dimension in two chunks */
}

/* Forward and backward outputs of one run, concatenated. */
static float *run_all(lz_tensor *qkv, lz_tensor *dout, int NH, size_t *bytes) {
  int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
  lz_tensor *out = new3(B, T, C), *lse = new3(B, NH, T), *dqkv = new3(B, T, 3 * C);
  CHECK_OK(lz_attention_forward(out, lse, qkv, NH));
  CHECK_OK(lz_attention_backward(dqkv, dout, qkv, out, lse, NH));
  size_t a = lz_tensor_bytes(out), b = lz_tensor_bytes(lse), c = lz_tensor_bytes(dqkv);
  char *all = malloc(a + b + c);
  memcpy(all, out->data, a);
  memcpy(all + a, lse->data, b);
  memcpy(all + a + b, dqkv->data, c);
  *bytes = a + b + c;
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(dqkv);
  return (float *)all;
}

LZ_TEST(attention_is_deterministic) {
  const int NH = 4;
  lz_tensor *qkv = rand3(3, 150, 3 * 128, 1.0f), *dout = rand3(3, 150, 128, 1.0f);
  const int threads = lz_threads_get();
  size_t n1, n2, n3;
  CHECK_OK(lz_threads_set(2));
  float *a = run_all(qkv, dout, NH, &n1);
  float *b = run_all(qkv, dout, NH, &n2);
  CHECK_OK(lz_threads_set(1));
  float *c = run_all(qkv, dout, NH, &n3);
  CHECK_OK(lz_threads_set(threads));
  CHECK(n1 == n2 && n1 == n3);
  CHECK(memcmp(a, b, n1) == 0); /* same bits on a second run */
  CHECK(memcmp(a, c, n1) == 0); /* and with one thread */
  free(a);
  free(b);
  free(c);
  lz_tensor_free(qkv);
  lz_tensor_free(dout);
}

LZ_TEST(attention_backward_overwrites_dqkv) {
  /* dqkv starts as garbage (NaN); every element must be written. */
  const int64_t B = 2, T = 70, C = 24;
  const int NH = 3;
  lz_tensor *qkv = rand3(B, T, 3 * C, 1.0f), *dout = rand3(B, T, C, 1.0f);
  lz_tensor *out = new3(B, T, C), *lse = new3(B, NH, T), *dqkv = new3(B, T, 3 * C);
  for (int64_t i = 0; i < B * T * 3 * C; i++) ((float *)dqkv->data)[i] = NAN;
  CHECK_OK(lz_attention_forward(out, lse, qkv, NH));
  CHECK_OK(lz_attention_backward(dqkv, dout, qkv, out, lse, NH));
  int bad = 0;
  for (int64_t i = 0; i < B * T * 3 * C; i++) bad += !isfinite(((float *)dqkv->data)[i]);
  CHECK_EQ_INT(bad, 0);
  lz_tensor_free(qkv);
  lz_tensor_free(dout);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(dqkv);
}

LZ_TEST(attention_rejects_bad_arguments) {
  lz_tensor *qkv = rand3(2, 5, 48, 1.0f), *out = new3(2, 5, 16), *lse = new3(2, 4, 5);
  lz_tensor *dqkv = new3(2, 5, 48), *dout = new3(2, 5, 16);
  lz_tensor *qkv_bad3 = new3(2, 5, 47), *out_bad = new3(2, 5, 15), *lse_bad = new3(2, 4, 6);
  lz_tensor *dqkv_bad = new3(2, 5, 45), *qkv_wide = new3(1, 2, 3 * 520);
  lz_tensor *out_wide = new3(1, 2, 520), *lse_wide = new3(1, 1, 2);
  lz_tensor *qkv_bf16 = NULL;
  int64_t shape[3] = {2, 5, 48};
  CHECK_OK(lz_tensor_new(&qkv_bf16, LZ_BF16, 3, shape, LZ_MEM_WORKSPACE));

  CHECK_OK(lz_attention_forward(out, lse, qkv, 4));
  CHECK_ERR(lz_attention_forward(out, lse, qkv, 3), LZ_ERR_INVALID,
            "C = 16 (qkv f32[2,5,48]) is not divisible by n_head = 3");
  CHECK_ERR(lz_attention_forward(out, lse, qkv, 0), LZ_ERR_INVALID, "n_head is 0");
  CHECK_ERR(lz_attention_forward(out, lse, qkv_bad3, 4), LZ_ERR_INVALID,
            "attention_forward: qkv is f32[2,5,47]; its last dimension must be 3C");
  CHECK_ERR(lz_attention_forward(out_bad, lse, qkv, 4), LZ_ERR_INVALID,
            "attention_forward: out is f32[2,5,15], expected f32[2,5,16]");
  CHECK_ERR(lz_attention_forward(out, lse_bad, qkv, 4), LZ_ERR_INVALID,
            "attention_forward: lse is f32[2,4,6], expected f32[2,4,5] ([B, n_head, T]");
  CHECK_ERR(lz_attention_forward(out, lse, qkv, 2), LZ_ERR_INVALID,
            "lse is f32[2,4,5], expected f32[2,2,5]");
  CHECK_ERR(lz_attention_forward(out, lse, qkv_bf16, 4), LZ_ERR_INVALID, "expected dtype f32");
  CHECK_ERR(lz_attention_forward(NULL, lse, qkv, 4), LZ_ERR_INVALID, "out is missing");
  CHECK_ERR(lz_attention_forward(out_wide, lse_wide, qkv_wide, 1), LZ_ERR_UNSUPPORTED, "head size");

  CHECK_OK(lz_attention_backward(dqkv, dout, qkv, out, lse, 4));
  CHECK_ERR(lz_attention_backward(dqkv_bad, dout, qkv, out, lse, 4), LZ_ERR_INVALID,
            "attention_backward: dqkv is f32[2,5,45] but qkv is f32[2,5,48]");
  CHECK_ERR(lz_attention_backward(dqkv, out_bad, qkv, out, lse, 4), LZ_ERR_INVALID,
            "attention_backward: dout is f32[2,5,15]");
  CHECK_ERR(lz_attention_backward(dqkv, dout, qkv, out, lse_bad, 4), LZ_ERR_INVALID,
            "attention_backward: lse is f32[2,4,6]");
  CHECK_ERR(lz_attention_backward(dqkv, dout, qkv, out, lse, 5), LZ_ERR_INVALID,
            "not divisible by n_head = 5");
  CHECK_ERR(lz_attention_backward(dqkv, dout, qkv, NULL, lse, 4), LZ_ERR_INVALID, "out is missing");

  lz_tensor *all[] = {qkv,     out,      lse,      dqkv,     dout,     qkv_bad3, out_bad,
                      lse_bad, dqkv_bad, qkv_wide, out_wide, lse_wide, qkv_bf16};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) lz_tensor_free(all[i]);
}

LZ_TEST(attention_single_token_is_v) {
  /* T = 1: out = v, lse = q.k * scale, dq = dk = 0, dv = dout. */
  const int64_t B = 2, C = 32;
  const int NH = 2;
  lz_tensor *qkv = rand3(B, 1, 3 * C, 1.0f), *out = new3(B, 1, C), *lse = new3(B, NH, 1);
  lz_tensor *dout = rand3(B, 1, C, 1.0f), *dqkv = new3(B, 1, 3 * C);
  CHECK_OK(lz_attention_forward(out, lse, qkv, NH));
  CHECK_OK(lz_attention_backward(dqkv, dout, qkv, out, lse, NH));
  const float *x = qkv->data, *o = out->data, *l = lse->data, *dy = dout->data, *dx = dqkv->data;
  for (int64_t b = 0; b < B; b++) {
    for (int64_t c = 0; c < C; c++) {
      CHECK_NEAR(o[b * C + c], x[b * 3 * C + 2 * C + c], 1e-6);
      CHECK_NEAR(dx[b * 3 * C + c], 0.0, 1e-6);
      CHECK_NEAR(dx[b * 3 * C + C + c], 0.0, 1e-6);
      CHECK_NEAR(dx[b * 3 * C + 2 * C + c], dy[b * C + c], 1e-6);
    }
    for (int64_t h = 0; h < NH; h++) {
      double dot = 0;
      for (int64_t c = 0; c < C / NH; c++)
        dot += (double)x[b * 3 * C + h * (C / NH) + c] * x[b * 3 * C + C + h * (C / NH) + c];
      CHECK_NEAR(l[b * NH + h], dot / sqrt((double)(C / NH)), 1e-6);
    }
  }
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(dout);
  lz_tensor_free(dqkv);
}

/* ------------------------------------------------------- grouped-query */

/* Grouped-query attention is multi-head attention on k and v repeated for
 * each query head of a group: forward bitwise (each query head computes the
 * same products), dq bitwise, dk and dv the sums of the repeated heads'. */
static void check_gqa(int64_t B, int64_t T, int NH, int NKV, int64_t HS) {
  const int64_t C = NH * HS, KV = NKV * HS, row = C + 2 * KV, G = NH / NKV;
  lz_tensor *qkv = rand3(B, T, row, 1.5f), *mha = new3(B, T, 3 * C);
  const float *g = qkv->data;
  float *m = mha->data;
  for (int64_t bt = 0; bt < B * T; bt++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t c = 0; c < HS; c++) {
        const int64_t kv = h / G;
        m[bt * 3 * C + h * HS + c] = g[bt * row + h * HS + c];
        m[bt * 3 * C + C + h * HS + c] = g[bt * row + C + kv * HS + c];
        m[bt * 3 * C + 2 * C + h * HS + c] = g[bt * row + C + KV + kv * HS + c];
      }
  lz_tensor *o1 = new3(B, T, C), *o2 = new3(B, T, C), *l1 = new3(B, NH, T), *l2 = new3(B, NH, T);
  CHECK_OK(lz_attention_gqa_forward(o1, l1, qkv, NH, NKV));
  CHECK_OK(lz_attention_forward(o2, l2, mha, NH));
  CHECK(memcmp(o1->data, o2->data, sizeof(float) * (size_t)(B * T * C)) == 0);
  CHECK(memcmp(l1->data, l2->data, sizeof(float) * (size_t)(B * NH * T)) == 0);

  lz_tensor *dout = rand3(B, T, C, 1.0f), *d1 = new3(B, T, row), *d2 = new3(B, T, 3 * C);
  CHECK_OK(lz_attention_gqa_backward(d1, dout, qkv, o1, l1, NH, NKV));
  CHECK_OK(lz_attention_backward(d2, dout, mha, o2, l2, NH));
  const float *a = d1->data, *b = d2->data;
  double err = 0;
  for (int64_t bt = 0; bt < B * T; bt++) {
    for (int64_t i = 0; i < C; i++) CHECK(a[bt * row + i] == b[bt * 3 * C + i]); /* dq */
    for (int64_t kv = 0; kv < NKV; kv++)
      for (int64_t c = 0; c < HS; c++)
        for (int part = 1; part <= 2; part++) { /* dk, dv */
          double want = 0;
          for (int64_t h = kv * G; h < (kv + 1) * G; h++)
            want += b[bt * 3 * C + part * C + h * HS + c];
          const double got = a[bt * row + C + (part - 1) * KV + kv * HS + c];
          const double e = fabs(got - want) / (fabs(want) > 1 ? fabs(want) : 1);
          if (!(e <= err)) err = e;
        }
  }
  if (!(err <= 1e-5))
    lz_test_fail(__FILE__, __LINE__, "gqa B%lld T%lld NH%d NKV%d HS%lld: dk/dv error %g",
                 (long long)B, (long long)T, NH, NKV, (long long)HS, err);
  lz_tensor *ts[] = {qkv, mha, o1, o2, l1, l2, dout, d1, d2};
  for (int i = 0; i < 9; i++) lz_tensor_free(ts[i]);
}

LZ_TEST(attention_gqa_is_mha_on_repeated_kv) {
  check_gqa(2, 7, 4, 2, 8);    /* short */
  check_gqa(1, 130, 8, 2, 16); /* three tiles, groups of 4 */
  check_gqa(2, 65, 6, 1, 32);  /* one key/value head (multi-query) */
  check_gqa(1, 64, 4, 4, 16);  /* n_kv_head = n_head: plain multi-head */
}

LZ_TEST(attention_gqa_rejects_bad_arguments) {
  lz_tensor *qkv = rand3(1, 4, 64, 1.0f), *out = new3(1, 4, 32), *lse = new3(1, 4, 4);
  CHECK_OK(lz_attention_gqa_forward(out, lse, qkv, 4, 2)); /* hd 8: 4*8 + 2*2*8 = 64 */
  CHECK_ERR(lz_attention_gqa_forward(out, lse, qkv, 4, 3), LZ_ERR_INVALID,
            "attention_forward: n_kv_head is 3; it must be >= 1 and divide n_head = 4");
  CHECK_ERR(lz_attention_gqa_forward(out, lse, qkv, 4, 0), LZ_ERR_INVALID,
            "attention_forward: n_kv_head is 0");
  CHECK_ERR(lz_attention_gqa_forward(out, lse, qkv, 6, 2), LZ_ERR_INVALID,
            "attention_forward: qkv is f32[1,4,64]; its last dimension must be (n_head + 2 "
            "n_kv_head) * head_dim = 10 * head_dim");
  lz_tensor_free(qkv), lz_tensor_free(out), lz_tensor_free(lse);
}
