/* test_masking.c — document masking in the kernels: attention with a
 * document id per token equals attention run on each document alone;
 * position tensors restart the learned (GPT-2) and rotary (Llama) positions
 * at each document; without seg or pos everything is bitwise as before. */
#include "lz_test.h"

#include <stdlib.h> /* malloc, free */
#include <string.h> /* memcmp, memcpy */

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) { return lz_test_uniform(&rng); }

static float *rand_floats(int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) p[i] = frand();
  return p;
}

static float *zeros(int64_t n) { return calloc((size_t)n, sizeof(float)); }

static lz_tensor *wrap3(float *p, int64_t a, int64_t b, int64_t c) {
  return lz_test_wrap(p, LZ_F32, 3, (int64_t[]){a, b, c});
}

static lz_tensor *wrap_ids(int32_t *p, int64_t a, int64_t b) {
  return lz_test_wrap(p, LZ_I32, 2, (int64_t[]){a, b});
}

/* Worst |a - b| / max(1, |b|). */
static double worst_err(const float *a, const float *b, int64_t n) {
  double w = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs((double)a[i] - b[i]) / (fabs(b[i]) > 1 ? fabs(b[i]) : 1);
    if (!(e <= w)) w = e; /* NaN sticks */
  }
  return w;
}

/* ------------------------------------------------------------- attention */

/* Row b of a batch packs documents of the lengths in lens[b] (0-ended):
 * forward and backward with seg must equal plain attention run on each
 * document as a batch of its own. */
static void check_documents(int64_t B, int64_t T, int NH, int NKV, int64_t HS,
                            const int64_t lens[][8]) {
  const int64_t W = (NH + 2 * (int64_t)NKV) * HS, C = NH * HS;
  float *qkv = rand_floats(B * T * W), *dout = rand_floats(B * T * C);
  float *out = zeros(B * T * C), *lse = zeros(B * NH * T), *dqkv = zeros(B * T * W);
  int32_t *seg = malloc(sizeof(int32_t) * (size_t)(B * T));
  for (int64_t b = 0; b < B; b++) {
    int64_t t = 0;
    for (int d = 0; lens[b][d]; d++)
      for (int64_t k = 0; k < lens[b][d]; k++) seg[b * T + t++] = 7 * d + 3; /* any ids */
    CHECK_EQ_INT(t, T);
  }
  lz_tensor *tq = wrap3(qkv, B, T, W), *to = wrap3(out, B, T, C), *tl = wrap3(lse, B, NH, T);
  lz_tensor *tdo = wrap3(dout, B, T, C), *tdq = wrap3(dqkv, B, T, W), *ts = wrap_ids(seg, B, T);
  CHECK_OK(lz_attention_seg_forward(to, tl, tq, ts, NH, NKV));
  CHECK_OK(lz_attention_seg_backward(tdq, tdo, tq, to, tl, ts, NH, NKV));

  double err_o = 0, err_l = 0, err_d = 0;
  for (int64_t b = 0; b < B; b++) {
    int64_t t0 = 0;
    for (int d = 0; lens[b][d]; t0 += lens[b][d], d++) {
      const int64_t L = lens[b][d];
      float *q1 = malloc(sizeof(float) * (size_t)(L * W)), *do1 = malloc(sizeof(float) * L * C);
      memcpy(q1, qkv + (b * T + t0) * W, sizeof(float) * (size_t)(L * W));
      memcpy(do1, dout + (b * T + t0) * C, sizeof(float) * (size_t)(L * C));
      float *o1 = zeros(L * C), *l1 = zeros(NH * L), *dq1 = zeros(L * W);
      lz_tensor *a = wrap3(q1, 1, L, W), *o = wrap3(o1, 1, L, C), *l = wrap3(l1, 1, NH, L);
      lz_tensor *g = wrap3(do1, 1, L, C), *dq = wrap3(dq1, 1, L, W);
      CHECK_OK(lz_attention_gqa_forward(o, l, a, NH, NKV));
      CHECK_OK(lz_attention_gqa_backward(dq, g, a, o, l, NH, NKV));
      double e = worst_err(out + (b * T + t0) * C, o1, L * C);
      err_o = e > err_o ? e : err_o;
      for (int h = 0; h < NH; h++) {
        e = worst_err(lse + (b * NH + h) * T + t0, l1 + h * L, L);
        err_l = e > err_l ? e : err_l;
      }
      e = worst_err(dqkv + (b * T + t0) * W, dq1, L * W);
      err_d = e > err_d ? e : err_d;
      lz_tensor_free(a), lz_tensor_free(o), lz_tensor_free(l), lz_tensor_free(g);
      lz_tensor_free(dq);
      free(q1), free(do1), free(o1), free(l1), free(dq1);
    }
  }
  CHECK(err_o <= 1e-6);
  CHECK(err_l <= 1e-6);
  CHECK(err_d <= 1e-6);
  if (!(err_o <= 1e-6 && err_l <= 1e-6 && err_d <= 1e-6))
    printf("  B=%lld T=%lld NH=%d NKV=%d: out %.3g lse %.3g dqkv %.3g\n", (long long)B,
           (long long)T, NH, NKV, err_o, err_l, err_d);
  lz_tensor_free(tq), lz_tensor_free(to), lz_tensor_free(tl), lz_tensor_free(tdo);
  lz_tensor_free(tdq), lz_tensor_free(ts);
  free(qkv), free(dout), free(out), free(lse), free(dqkv), free(seg);
}

LZ_TEST(attention_seg_equals_each_document_alone) {
  /* Documents that cross tile edges (64), a one-token document, a row that
   * is one document, many short ones. */
  const int64_t lens[3][8] = {{40, 70, 1, 39, 0}, {150, 0}, {5, 9, 64, 64, 8, 0}};
  check_documents(3, 150, 4, 4, 16, lens);     /* multi-head */
  check_documents(3, 150, 4, 2, 24, lens);     /* grouped-query, padded head */
  const int64_t one[1][8] = {{1, 2, 3, 4, 0}}; /* below one tile */
  check_documents(1, 10, 2, 1, 8, one);
}

/* One document per row is the plain causal attention, bitwise. */
LZ_TEST(attention_seg_one_document_is_bitwise_plain) {
  const int64_t B = 2, T = 130, NH = 4, NKV = 2, HS = 16, W = (NH + 2 * NKV) * HS, C = NH * HS;
  float *qkv = rand_floats(B * T * W), *dout = rand_floats(B * T * C);
  float *o[2], *l[2], *d[2];
  int32_t *seg = calloc((size_t)(B * T), sizeof(int32_t));
  lz_tensor *tq = wrap3(qkv, B, T, W), *tdo = wrap3(dout, B, T, C), *ts = wrap_ids(seg, B, T);
  for (int k = 0; k < 2; k++) {
    o[k] = zeros(B * T * C), l[k] = zeros(B * NH * T), d[k] = zeros(B * T * W);
    lz_tensor *to = wrap3(o[k], B, T, C), *tl = wrap3(l[k], B, NH, T), *td = wrap3(d[k], B, T, W);
    CHECK_OK(lz_attention_seg_forward(to, tl, tq, k ? ts : NULL, NH, NKV));
    CHECK_OK(lz_attention_seg_backward(td, tdo, tq, to, tl, k ? ts : NULL, NH, NKV));
    lz_tensor_free(to), lz_tensor_free(tl), lz_tensor_free(td);
  }
  CHECK(memcmp(o[0], o[1], sizeof(float) * (size_t)(B * T * C)) == 0);
  CHECK(memcmp(l[0], l[1], sizeof(float) * (size_t)(B * NH * T)) == 0);
  CHECK(memcmp(d[0], d[1], sizeof(float) * (size_t)(B * T * W)) == 0);
  lz_tensor_free(tq), lz_tensor_free(tdo), lz_tensor_free(ts);
  for (int k = 0; k < 2; k++) free(o[k]), free(l[k]), free(d[k]);
  free(qkv), free(dout), free(seg);
}

LZ_TEST(attention_seg_rejects_bad_seg) {
  const int64_t W = 3 * 8;
  float *qkv = rand_floats(2 * 4 * W), *out = zeros(2 * 4 * 8), *lse = zeros(2 * 2 * 4);
  int32_t seg[8] = {0};
  lz_tensor *tq = wrap3(qkv, 2, 4, W), *to = wrap3(out, 2, 4, 8), *tl = wrap3(lse, 2, 2, 4);
  lz_tensor *ts = wrap_ids(seg, 4, 2);
  CHECK_ERR(lz_attention_seg_forward(to, tl, tq, ts, 2, 2), LZ_ERR_INVALID, "seg is");
  lz_tensor *tf = lz_test_wrap(out, LZ_F32, 2, (int64_t[]){2, 4});
  CHECK_ERR(lz_attention_seg_forward(to, tl, tq, tf, 2, 2), LZ_ERR_INVALID, "seg");
  lz_tensor_free(tq), lz_tensor_free(to), lz_tensor_free(tl), lz_tensor_free(ts);
  lz_tensor_free(tf);
  free(qkv), free(out), free(lse);
}

/* ------------------------------------------------------------- embedding */

LZ_TEST(embedding_pos_indexes_the_position_table) {
  const int64_t B = 2, T = 6, V = 11, P = 8, C = 37; /* C not a multiple of the column block */
  int32_t tok[12], pos[12] = {0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5};
  for (int i = 0; i < 12; i++) tok[i] = (int32_t)(lz_test_xorshift(&rng) % V);
  float *wte = rand_floats(V * C), *wpe = rand_floats(P * C), *dout = rand_floats(B * T * C);
  float *out = zeros(B * T * C), *dwte = zeros(V * C), *dwpe = zeros(P * C);
  lz_tensor *tt = wrap_ids(tok, B, T), *tp = wrap_ids(pos, B, T);
  lz_tensor *te = lz_test_wrap(wte, LZ_F32, 2, (int64_t[]){V, C});
  lz_tensor *tpe = lz_test_wrap(wpe, LZ_F32, 2, (int64_t[]){P, C});
  lz_tensor *dte = lz_test_wrap(dwte, LZ_F32, 2, (int64_t[]){V, C});
  lz_tensor *dpe = lz_test_wrap(dwpe, LZ_F32, 2, (int64_t[]){P, C});
  lz_tensor *to = wrap3(out, B, T, C), *tdo = wrap3(dout, B, T, C);
  CHECK_OK(lz_embedding_pos_forward(to, tt, tp, te, tpe));
  CHECK_OK(lz_embedding_pos_backward(dte, dpe, tdo, tt, tp));
  int bad = 0;
  for (int64_t i = 0; i < B * T; i++)
    for (int64_t c = 0; c < C; c++)
      bad += out[i * C + c] != wte[tok[i] * C + c] + wpe[pos[i] * C + c];
  CHECK_EQ_INT(bad, 0);
  double *ref = calloc((size_t)(P * C), sizeof(double));
  for (int64_t i = 0; i < B * T; i++)
    for (int64_t c = 0; c < C; c++) ref[pos[i] * C + c] += dout[i * C + c];
  CHECK(lz_test_rel_err(dwpe, ref, P * C) <= 1e-6);
  CHECK(dwpe[7 * C] == 0.0f); /* a row no position reached */

  /* pos NULL is position t, as lz_embedding_forward */
  float *o2 = zeros(B * T * C), *o3 = zeros(B * T * C);
  lz_tensor *t2 = wrap3(o2, B, T, C), *t3 = wrap3(o3, B, T, C);
  CHECK_OK(lz_embedding_pos_forward(t2, tt, NULL, te, tpe));
  CHECK_OK(lz_embedding_forward(t3, tt, te, tpe));
  CHECK(memcmp(o2, o3, sizeof(float) * (size_t)(B * T * C)) == 0);

  /* A position outside the table is an error naming it; nothing written. */
  pos[5] = (int32_t)P;
  memset(o2, 0, sizeof(float) * (size_t)(B * T * C));
  CHECK_ERR(lz_embedding_pos_forward(t2, tt, tp, te, tpe), LZ_ERR_INVALID, "pos[0, 5] is 8");
  CHECK(o2[0] == 0.0f);
  CHECK_ERR(lz_embedding_pos_backward(dte, dpe, tdo, tt, tp), LZ_ERR_INVALID, "pos[0, 5]");

  lz_tensor_free(tt), lz_tensor_free(tp), lz_tensor_free(te), lz_tensor_free(tpe);
  lz_tensor_free(dte), lz_tensor_free(dpe), lz_tensor_free(to), lz_tensor_free(tdo);
  lz_tensor_free(t2), lz_tensor_free(t3);
  free(wte), free(wpe), free(dout), free(out), free(dwte), free(dwpe), free(ref), free(o2);
  free(o3);
}

/* ------------------------------------------------------------------ rope */

/* Each row turns by its own position: a packed row equals its documents
 * turned alone (bitwise: rows are independent), and pos = t is the freqs
 * variant. Forward then backward is the identity up to rounding. */
LZ_TEST(rope_pos_turns_each_row_by_its_position) {
  const int64_t B = 2, T = 9, NH = 3, HD = 8, C = 4 * HD; /* 3 heads turn, 1 is copied */
  float freqs[4];
  for (int i = 0; i < 4; i++) freqs[i] = (float)pow(10000.0, -2.0 * i / HD);
  int32_t pos[18] = {0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  float *x = rand_floats(B * T * C), *out = zeros(B * T * C), *back = zeros(B * T * C);
  lz_tensor *tf = lz_test_wrap(freqs, LZ_F32, 1, (int64_t[]){4}), *tp = wrap_ids(pos, B, T);
  lz_tensor *tx = wrap3(x, B, T, C), *to = wrap3(out, B, T, C), *tb = wrap3(back, B, T, C);
  CHECK_OK(lz_rope_pos_forward(to, tx, tf, tp, (int)NH));
  int bad = 0;
  const int64_t starts[] = {0, 4, 7, 9, 18}; /* documents, both rows in a row */
  for (int d = 0; d < 4; d++) {
    const int64_t L = starts[d + 1] - starts[d];
    float *o1 = zeros(L * C);
    lz_tensor *a = wrap3(x + starts[d] * C, 1, L, C), *o = wrap3(o1, 1, L, C);
    CHECK_OK(lz_rope_freqs_forward(o, a, tf, (int)NH, 0));
    bad += memcmp(o1, out + starts[d] * C, sizeof(float) * (size_t)(L * C)) != 0;
    lz_tensor_free(a), lz_tensor_free(o);
    free(o1);
  }
  CHECK_EQ_INT(bad, 0);
  CHECK_OK(lz_rope_pos_backward(tb, to, tf, tp, (int)NH));
  double err = 0;
  for (int64_t i = 0; i < B * T * C; i++) err = fmax(err, fabs(back[i] - x[i]));
  CHECK(err <= 1e-6);

  for (int i = 0; i < 18; i++) pos[i] = i % 9;
  float *o2 = zeros(B * T * C);
  lz_tensor *t2 = wrap3(o2, B, T, C);
  CHECK_OK(lz_rope_pos_forward(to, tx, tf, tp, (int)NH));
  CHECK_OK(lz_rope_freqs_forward(t2, tx, tf, (int)NH, 0));
  CHECK(memcmp(out, o2, sizeof(float) * (size_t)(B * T * C)) == 0);

  pos[3] = -2;
  CHECK_ERR(lz_rope_pos_forward(to, tx, tf, tp, (int)NH), LZ_ERR_INVALID, "pos[0, 3] is -2");
  lz_tensor *tbad = wrap_ids(pos, T, B);
  CHECK_ERR(lz_rope_pos_forward(to, tx, tf, tbad, (int)NH), LZ_ERR_INVALID, "pos is");

  lz_tensor_free(tf), lz_tensor_free(tp), lz_tensor_free(tx), lz_tensor_free(to);
  lz_tensor_free(tb), lz_tensor_free(t2), lz_tensor_free(tbad);
  free(x), free(out), free(back), free(o2);
}
