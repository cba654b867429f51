/* test_embedding.c — token + position embedding: forward against a double
 * reference, backward against central differences, accumulation, NULL
 * gradients, bitwise determinism, errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0xD1B54A32D192ED03ull;
static uint64_t next_u64(void) { return lz_test_xorshift(&rng); }
static float frand(void) { return lz_test_uniform(&rng); }

/* L = sum over b, t, c of (wte[tok, c] + wpe[t, c]) * dout[b, t, c]. */
static double ref_loss(const double *wte, const double *wpe, const int32_t *tok,
                       const double *dout, int64_t B, int64_t T, int64_t C) {
  double loss = 0.0;
  for (int64_t bt = 0; bt < B * T; bt++)
    for (int64_t c = 0; c < C; c++)
      loss += (wte[tok[bt] * C + c] + wpe[(bt % T) * C + c]) * dout[bt * C + c];
  return loss;
}

static double fd(double *p, int64_t i, const double *wte, const double *wpe,
                 const int32_t *tok, const double *dout, int64_t B, int64_t T, int64_t C) {
  const double h = 1e-5, keep = p[i];
  p[i] = keep + h;
  double up = ref_loss(wte, wpe, tok, dout, B, T, C);
  p[i] = keep - h;
  double down = ref_loss(wte, wpe, tok, dout, B, T, C);
  p[i] = keep;
  return (up - down) / (2 * h);
}

LZ_TEST(embedding_against_reference) {
  enum { B = 3, T = 5, C = 19, V = 7, MAXT = 8 };
  float wte[V * C], wpe[MAXT * C], out[B * T * C], dout[B * T * C];
  float dwte[V * C], dwpe[MAXT * C], dwte0[V * C], dwpe0[MAXT * C];
  double wted[V * C], wped[MAXT * C], doutd[B * T * C], ref[B * T * C];
  float ga[MAXT * C + V * C];
  int32_t tok[B * T];
  for (int i = 0; i < V * C; i++) wte[i] = frand(), dwte0[i] = dwte[i] = frand();
  for (int i = 0; i < MAXT * C; i++) wpe[i] = frand(), dwpe0[i] = dwpe[i] = frand();
  for (int i = 0; i < B * T * C; i++) dout[i] = frand();
  /* Token 6 never appears (its gradient must stay put); 2 repeats a lot. */
  for (int i = 0; i < B * T; i++) tok[i] = i % 3 == 0 ? 2 : (int32_t)(next_u64() % 6);
  for (int i = 0; i < V * C; i++) wted[i] = wte[i];
  for (int i = 0; i < MAXT * C; i++) wped[i] = wpe[i];
  for (int i = 0; i < B * T * C; i++) doutd[i] = dout[i];

  const int64_t s_tok[2] = {B, T}, s_out[3] = {B, T, C}, s_wte[2] = {V, C},
                s_wpe[2] = {MAXT, C};
  lz_tensor *ttok = lz_test_wrap(tok, LZ_I32, 2, s_tok), *tout = lz_test_wrap(out, LZ_F32, 3, s_out);
  lz_tensor *tdout = lz_test_wrap(dout, LZ_F32, 3, s_out), *twte = lz_test_wrap(wte, LZ_F32, 2, s_wte);
  lz_tensor *twpe = lz_test_wrap(wpe, LZ_F32, 2, s_wpe), *tdwte = lz_test_wrap(dwte, LZ_F32, 2, s_wte);
  lz_tensor *tdwpe = lz_test_wrap(dwpe, LZ_F32, 2, s_wpe);

  CHECK_OK(lz_embedding_forward(tout, ttok, twte, twpe));
  for (int bt = 0; bt < B * T; bt++)
    for (int c = 0; c < C; c++)
      ref[bt * C + c] = wted[tok[bt] * C + c] + wped[(bt % T) * C + c];
  CHECK(lz_test_rel_err(out, ref, B * T * C) <= 1e-6);

  CHECK_OK(lz_embedding_backward(tdwte, tdwpe, tdout, ttok));
  double gd[MAXT * C + V * C];
  for (int i = 0; i < V * C; i++) {
    ga[i] = dwte[i] - dwte0[i];
    gd[i] = fd(wted, i, wted, wped, tok, doutd, B, T, C);
  }
  CHECK(lz_test_rel_err(ga, gd, V * C) <= 1e-3);
  for (int c = 0; c < C; c++) CHECK(dwte[6 * C + c] == dwte0[6 * C + c]);
  for (int i = 0; i < MAXT * C; i++) {
    ga[i] = dwpe[i] - dwpe0[i];
    gd[i] = fd(wped, i, wted, wped, tok, doutd, B, T, C);
  }
  CHECK(lz_test_rel_err(ga, gd, MAXT * C) <= 1e-3);
  for (int i = T * C; i < MAXT * C; i++) CHECK(dwpe[i] == dwpe0[i]); /* positions >= T */

  /* Either gradient may be NULL; the other is the same as before. */
  float dwte1[V * C], dwpe1[MAXT * C];
  memcpy(dwte1, dwte0, sizeof dwte1);
  memcpy(dwpe1, dwpe0, sizeof dwpe1);
  lz_tensor *tdwte1 = lz_test_wrap(dwte1, LZ_F32, 2, s_wte), *tdwpe1 = lz_test_wrap(dwpe1, LZ_F32, 2, s_wpe);
  CHECK_OK(lz_embedding_backward(tdwte1, NULL, tdout, ttok));
  CHECK(memcmp(dwte1, dwte, sizeof dwte) == 0);
  CHECK_OK(lz_embedding_backward(NULL, tdwpe1, tdout, ttok));
  CHECK(memcmp(dwpe1, dwpe, sizeof dwpe) == 0);
  CHECK_OK(lz_embedding_backward(NULL, NULL, tdout, ttok));

  lz_tensor *ts[] = {ttok, tout, tdout, twte, twpe, tdwte, tdwpe, tdwte1, tdwpe1};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* bf16 tables: the lookup widens the rows it reads, so the result is bitwise
 * the f32 lookup on the widened tables, with and without a position table;
 * tables of two dtypes are refused. */
LZ_TEST(embedding_bf16_tables) {
  enum { B = 2, T = 6, C = 37, V = 11 };
  uint16_t hte[V * C], hpe[T * C];
  float wte[V * C], wpe[T * C], out[B * T * C], want[B * T * C];
  int32_t tok[B * T];
  for (int i = 0; i < V * C; i++) hte[i] = lz_f32_to_bf16(frand()), wte[i] = lz_bf16_to_f32(hte[i]);
  for (int i = 0; i < T * C; i++) hpe[i] = lz_f32_to_bf16(frand()), wpe[i] = lz_bf16_to_f32(hpe[i]);
  for (int i = 0; i < B * T; i++) tok[i] = (int32_t)(next_u64() % V);
  const int64_t s_tok[2] = {B, T}, s_out[3] = {B, T, C}, s_wte[2] = {V, C}, s_wpe[2] = {T, C};
  lz_tensor *ttok = lz_test_wrap(tok, LZ_I32, 2, s_tok), *tout = lz_test_wrap(out, LZ_F32, 3, s_out);
  lz_tensor *twant = lz_test_wrap(want, LZ_F32, 3, s_out);
  lz_tensor *fte = lz_test_wrap(wte, LZ_F32, 2, s_wte), *fpe = lz_test_wrap(wpe, LZ_F32, 2, s_wpe);
  lz_tensor *bte = lz_test_wrap(hte, LZ_BF16, 2, s_wte), *bpe = lz_test_wrap(hpe, LZ_BF16, 2, s_wpe);
  CHECK_OK(lz_embedding_forward(twant, ttok, fte, fpe));
  CHECK_OK(lz_embedding_forward(tout, ttok, bte, bpe));
  CHECK(memcmp(out, want, sizeof out) == 0);
  CHECK_OK(lz_embedding_forward(twant, ttok, fte, NULL));
  CHECK_OK(lz_embedding_forward(tout, ttok, bte, NULL));
  CHECK(memcmp(out, want, sizeof out) == 0);
  CHECK_ERR(lz_embedding_forward(tout, ttok, bte, fpe), LZ_ERR_INVALID,
            "embedding_forward: wte is bf16[11,37] and wpe is f32[6,37]; both must be f32 or "
            "both bf16");
  lz_tensor *ts[] = {ttok, tout, twant, fte, fpe, bte, bpe};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* Backward twice from the same start, on 1, 2 and 3 threads, with a tiny
 * vocabulary so every row of dwte collects many positions: the same bits. */
LZ_TEST(embedding_backward_deterministic) {
  enum { B = 8, T = 64, C = 200, V = 5 };
  float *dout = malloc(sizeof(float) * B * T * C);
  float *dwte[3], *dwpe[3];
  int32_t tok[B * T];
  for (int i = 0; i < B * T * C; i++) dout[i] = frand();
  for (int i = 0; i < B * T; i++) tok[i] = (int32_t)(next_u64() % V);
  const int64_t s_tok[2] = {B, T}, s_out[3] = {B, T, C}, s_wte[2] = {V, C}, s_wpe[2] = {T, C};
  lz_tensor *ttok = lz_test_wrap(tok, LZ_I32, 2, s_tok), *tdout = lz_test_wrap(dout, LZ_F32, 3, s_out);
  const int saved = lz_threads_get();
  for (int k = 0; k < 3; k++) {
    dwte[k] = malloc(sizeof(float) * V * C);
    dwpe[k] = malloc(sizeof(float) * T * C);
    for (int i = 0; i < V * C; i++) dwte[k][i] = 0.25f;
    for (int i = 0; i < T * C; i++) dwpe[k][i] = -0.25f;
    lz_tensor *a = lz_test_wrap(dwte[k], LZ_F32, 2, s_wte), *b = lz_test_wrap(dwpe[k], LZ_F32, 2, s_wpe);
    CHECK_OK(lz_threads_set(k + 1));
    CHECK_OK(lz_embedding_backward(a, b, tdout, ttok));
    lz_tensor_free(a), lz_tensor_free(b);
  }
  lz_threads_set(saved);
  for (int k = 1; k < 3; k++) {
    CHECK(memcmp(dwte[0], dwte[k], sizeof(float) * V * C) == 0);
    CHECK(memcmp(dwpe[0], dwpe[k], sizeof(float) * T * C) == 0);
  }
  for (int k = 0; k < 3; k++) free(dwte[k]), free(dwpe[k]);
  lz_tensor_free(ttok), lz_tensor_free(tdout);
  free(dout);
}

/* skip: the positions holding that token add nothing to its dwte row (and
 * their dwpe rows take theirs); every other row as without it. */
LZ_TEST(embedding_skip_backward_leaves_the_padding_row) {
  enum { B = 2, T = 6, C = 5, V = 4 };
  float dout[B * T * C], dwte[2][V * C], dwpe[2][T * C];
  int32_t tok[B * T];
  for (int i = 0; i < B * T * C; i++) dout[i] = frand();
  for (int i = 0; i < B * T; i++) tok[i] = i % V;
  const int64_t s_tok[2] = {B, T}, s_out[3] = {B, T, C}, s_wte[2] = {V, C}, s_wpe[2] = {T, C};
  lz_tensor *ttok = lz_test_wrap(tok, LZ_I32, 2, s_tok), *tdout = lz_test_wrap(dout, LZ_F32, 3, s_out);
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < V * C; i++) dwte[k][i] = 0.5f;
    for (int i = 0; i < T * C; i++) dwpe[k][i] = 0.0f;
    lz_tensor *a = lz_test_wrap(dwte[k], LZ_F32, 2, s_wte), *b = lz_test_wrap(dwpe[k], LZ_F32, 2, s_wpe);
    if (k == 0)
      CHECK_OK(lz_embedding_backward(a, b, tdout, ttok));
    else
      CHECK_OK(lz_embedding_skip_backward(a, b, tdout, ttok, NULL, 2));
    lz_tensor_free(a), lz_tensor_free(b);
  }
  for (int v = 0; v < V; v++)
    for (int c = 0; c < C; c++) {
      if (v == 2)
        CHECK(dwte[1][v * C + c] == 0.5f && dwte[0][v * C + c] != 0.5f);
      else
        CHECK(dwte[1][v * C + c] == dwte[0][v * C + c]);
    }
  CHECK(memcmp(dwpe[0], dwpe[1], sizeof dwpe[0]) == 0);
  lz_tensor_free(ttok), lz_tensor_free(tdout);
}

LZ_TEST(embedding_errors) {
  enum { B = 2, T = 3, C = 4, V = 7 };
  float wte[V * C] = {0}, wpe[8 * C] = {0}, out[B * T * C] = {0};
  int32_t tok[B * T] = {1, 2, 3, 4, 5, 6};
  const int64_t s_tok[2] = {B, T}, s_out[3] = {B, T, C}, s_wte[2] = {V, C},
                s_wpe[2] = {8, C}, s_short[2] = {2, C}, s_wide[2] = {8, C + 1},
                s_bad_out[3] = {B, T, C + 1};
  lz_tensor *ttok = lz_test_wrap(tok, LZ_I32, 2, s_tok), *tout = lz_test_wrap(out, LZ_F32, 3, s_out);
  lz_tensor *twte = lz_test_wrap(wte, LZ_F32, 2, s_wte), *twpe = lz_test_wrap(wpe, LZ_F32, 2, s_wpe);
  lz_tensor *tshort = lz_test_wrap(wpe, LZ_F32, 2, s_short), *twide = lz_test_wrap(wpe, LZ_F32, 2, s_wide);
  lz_tensor *tbad_out = lz_test_wrap(out, LZ_F32, 3, s_bad_out);
  lz_tensor *tok_f = lz_test_wrap(wte, LZ_F32, 2, s_tok);

  CHECK_OK(lz_embedding_forward(tout, ttok, twte, twpe));
  tok[4] = 7; /* == V */
  CHECK_ERR(lz_embedding_forward(tout, ttok, twte, twpe), LZ_ERR_INVALID,
            "embedding_forward: tokens[1, 1] is 7, outside the vocabulary [0, 7)");
  CHECK_ERR(lz_embedding_backward(twte, twpe, tout, ttok), LZ_ERR_INVALID,
            "embedding_backward: tokens[1, 1] is 7, outside the vocabulary [0, 7)");
  tok[4] = -3;
  CHECK_ERR(lz_embedding_forward(tout, ttok, twte, twpe), LZ_ERR_INVALID,
            "tokens[1, 1] is -3");
  tok[4] = 5;
  CHECK_ERR(lz_embedding_forward(tout, ttok, twte, tshort), LZ_ERR_INVALID,
            "embedding_forward: sequence length T = 3 is longer than wpe f32[2,4] allows");
  CHECK_ERR(lz_embedding_forward(tout, ttok, twte, twide), LZ_ERR_INVALID,
            "embedding_forward: wpe is f32[8,5] but wte is f32[7,4]; they need the same "
            "channels");
  CHECK_ERR(lz_embedding_forward(tbad_out, ttok, twte, twpe), LZ_ERR_INVALID,
            "embedding_forward: out is f32[2,3,5], expected f32[2,3,4]");
  CHECK_ERR(lz_embedding_forward(tout, tok_f, twte, twpe), LZ_ERR_INVALID,
            "embedding_forward: tokens is f32[2,3], expected dtype i32");
  CHECK_ERR(lz_embedding_backward(twide, NULL, tout, ttok), LZ_ERR_INVALID,
            "embedding_backward: dwte is f32[8,5] but dout is f32[2,3,4]");
  CHECK_ERR(lz_embedding_backward(NULL, tshort, tout, ttok), LZ_ERR_INVALID,
            "embedding_backward: sequence length T = 3 is longer than dwpe");
  CHECK_ERR(lz_embedding_backward(twte, twpe, tbad_out, ttok), LZ_ERR_INVALID,
            "embedding_backward: dwte is f32[7,4] but dout is f32[2,3,5]");
  /* Nothing was written by the failed calls. */
  for (int i = 0; i < V * C; i++) CHECK(wte[i] == 0.0f);

  lz_tensor *ts[] = {ttok, tout, twte, twpe, tshort, twide, tbad_out, tok_f};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}
