/* test_phi3_kernels.c — what Phi-3 adds to Llama's kernels: rotary embeddings
 * on the first rotary_dim values of each head with cos and sin scaled
 * (lz_rope_ext_*: partial_rotary_factor, LongRoPE's attention factor), and
 * SwiGLU reading gate and up from one packed row (lz_swiglu_packed_*:
 * gate_up_proj). Against a naive double reference and finite differences,
 * bitwise against the Llama kernels where they compute the same, errors. */
#include "lz_test.h"

#include <math.h>   /* cos, sin, exp */
#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp, memcpy */

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float frand(void) { return lz_test_uniform(&rng); }

/* ------------------------------------------------------------- rope_ext */

typedef struct {
  double *out; /* may be NULL */
  const double *x, *dy;
  const float *inv_freq; /* rotary / 2 */
  const int32_t *pos;    /* NULL: pos_offset + t */
  int64_t B, T, C, n_head, head_dim, rotary, pos_offset;
  float scale; /* 0: none */
} rope_ext_ref;

/* The angle an fp32 product, cos and sin times scale in fp32 (as
 * transformers' Phi3RotaryEmbedding), the rest in double; values past
 * rotary_dim in a head, and columns past the heads, pass. */
static double rope_ext_loss(const void *ctx) {
  const rope_ext_ref *a = ctx;
  const int64_t half = a->rotary / 2;
  double loss = 0.0;
  for (int64_t r = 0; r < a->B * a->T; r++) {
    const float pos = a->pos ? (float)a->pos[r] : (float)(a->pos_offset + r % a->T);
    for (int64_t j = 0; j < a->C; j++) {
      const int64_t h = j / a->head_dim, i = j % a->head_dim;
      double o = a->x[r * a->C + j];
      if (h < a->n_head && i < 2 * half) {
        const int64_t k = i % half;
        const float angle = pos * a->inv_freq[k];
        float c = (float)cos((double)angle), s = (float)sin((double)angle);
        if (a->scale != 0.0f) c *= a->scale, s *= a->scale;
        const int64_t base = r * a->C + h * a->head_dim;
        const double x1 = a->x[base + k], x2 = a->x[base + k + half];
        o = i < half ? x1 * c - x2 * s : x2 * c + x1 * s;
      }
      if (a->out) a->out[r * a->C + j] = o;
      loss += o * a->dy[r * a->C + j];
    }
  }
  return loss;
}

static void rope_ext_case(int64_t B, int64_t T, int n_head, int head_dim, int rotary, int extra,
                          int64_t pos_offset, float scale, int with_pos) {
  const int64_t C = (int64_t)n_head * head_dim + extra, n = B * T * C;
  float *x = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
  float *dy = malloc(sizeof(float) * n), *dx = malloc(sizeof(float) * n);
  double *xd = malloc(sizeof(double) * n), *dyd = malloc(sizeof(double) * n);
  double *outd = malloc(sizeof(double) * n);
  float inv[64];
  int32_t *pos = malloc(sizeof(int32_t) * B * T);
  for (int i = 0; i < rotary / 2; i++) inv[i] = (float)pow(500.0, -2.0 * i / rotary) * 0.7f;
  for (int64_t i = 0; i < B * T; i++) pos[i] = (int32_t)((i * 7) % 23);
  for (int64_t i = 0; i < n; i++) x[i] = frand(), dy[i] = frand(), xd[i] = x[i], dyd[i] = dy[i];
  const int64_t s3[3] = {B, T, C}, s1[1] = {rotary / 2}, s2[2] = {B, T};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *tout = lz_test_wrap(out, LZ_F32, 3, s3);
  lz_tensor *tdy = lz_test_wrap(dy, LZ_F32, 3, s3), *tdx = lz_test_wrap(dx, LZ_F32, 3, s3);
  lz_tensor *tf = lz_test_wrap(inv, LZ_F32, 1, s1), *tp = lz_test_wrap(pos, LZ_I32, 2, s2);
  lz_tensor *pt = with_pos ? tp : NULL;
  const int64_t off = with_pos ? 0 : pos_offset;
  CHECK_OK(lz_rope_ext_forward(tout, tx, tf, pt, n_head, head_dim, off, scale));
  rope_ext_ref ref = {outd, xd,  dyd,      inv,     with_pos ? pos : NULL, B, T, C, n_head,
                      head_dim, rotary, off, scale};
  rope_ext_loss(&ref);
  ref.out = NULL;
  CHECK(lz_test_rel_err(out, outd, n) <= 1e-5);
  CHECK_OK(lz_rope_ext_backward(tdx, tdy, tf, pt, n_head, head_dim, off, scale));
  int64_t k = 0;
  float *ga = malloc(sizeof(float) * n);
  double *gd = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i += n > 4000 ? 97 : 1, k++) {
    const double h = 1e-5, keep = xd[i];
    xd[i] = keep + h;
    const double up = rope_ext_loss(&ref);
    xd[i] = keep - h;
    const double down = rope_ext_loss(&ref);
    xd[i] = keep;
    ga[k] = dx[i], gd[k] = (up - down) / (2 * h);
  }
  CHECK(lz_test_rel_err(ga, gd, k) <= 1e-3);
  /* in place: the same bits */
  memcpy(dx, x, sizeof(float) * n);
  CHECK_OK(lz_rope_ext_forward(tdx, tdx, tf, pt, n_head, head_dim, off, scale));
  CHECK(memcmp(dx, out, sizeof(float) * n) == 0);
  lz_tensor *ts[] = {tx, tout, tdy, tdx, tf, tp};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(x), free(out), free(dy), free(dx), free(xd), free(dyd), free(outd), free(pos), free(ga);
  free(gd);
}

LZ_TEST(rope_ext_partial_against_reference) { rope_ext_case(2, 5, 3, 16, 8, 0, 0, 0.0f, 0); }
LZ_TEST(rope_ext_scaled_against_reference) { rope_ext_case(1, 9, 2, 12, 12, 0, 40, 1.19f, 0); }
/* Phi-3's q|k|v rows: q and k turn (in part), v passes; positions per token */
LZ_TEST(rope_ext_packed_pos_against_reference) { rope_ext_case(2, 6, 3, 16, 6, 32, 0, 1.1f, 1); }
LZ_TEST(rope_ext_large_against_reference) { rope_ext_case(2, 40, 8, 96, 48, 0, 3, 1.2f, 0); }

/* All of each head turning and no scale is Llama's rope, bit for bit; so is
 * a scale of 1 (a product by 1 is exact). */
LZ_TEST(rope_ext_full_is_rope_freqs) {
  enum { B = 2, T = 7, NH = 3, HD = 16, C = NH * HD + 16, N = B * T * C };
  static float x[N], a[N], b[N], c[N];
  float inv[HD / 2];
  for (int i = 0; i < HD / 2; i++) inv[i] = (float)pow(10000.0, -2.0 * i / HD);
  for (int i = 0; i < N; i++) x[i] = frand();
  const int64_t s3[3] = {B, T, C}, s1[1] = {HD / 2};
  lz_tensor *tx = lz_test_wrap(x, LZ_F32, 3, s3), *ta = lz_test_wrap(a, LZ_F32, 3, s3);
  lz_tensor *tb = lz_test_wrap(b, LZ_F32, 3, s3), *tc = lz_test_wrap(c, LZ_F32, 3, s3);
  lz_tensor *tf = lz_test_wrap(inv, LZ_F32, 1, s1);
  for (int back = 0; back < 2; back++) {
    CHECK_OK((back ? lz_rope_freqs_backward : lz_rope_freqs_forward)(ta, tx, tf, NH, 5));
    CHECK_OK((back ? lz_rope_ext_backward : lz_rope_ext_forward)(tb, tx, tf, NULL, NH, HD, 5, 0));
    CHECK_OK((back ? lz_rope_ext_backward : lz_rope_ext_forward)(tc, tx, tf, NULL, NH, HD, 5, 1));
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(a, c, sizeof a) == 0);
  }
  lz_tensor *ts[] = {tx, ta, tb, tc, tf};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* bf16 input: bitwise the f32 result on the widened values. */
LZ_TEST(rope_ext_bf16_is_f32_on_widened) {
  enum { B = 1, T = 5, NH = 2, HD = 12, C = NH * HD + 12, N = B * T * C };
  uint16_t xb[N];
  float xf[N], a[N], b[N];
  float inv[3] = {1.0f, 0.1f, 0.01f};
  for (int i = 0; i < N; i++) {
    float v = frand();
    uint32_t u;
    memcpy(&u, &v, 4);
    xb[i] = (uint16_t)(u >> 16);
    u = (uint32_t)xb[i] << 16;
    memcpy(&xf[i], &u, 4);
  }
  const int64_t s3[3] = {B, T, C}, s1[1] = {3};
  lz_tensor *txb = lz_test_wrap(xb, LZ_BF16, 3, s3), *txf = lz_test_wrap(xf, LZ_F32, 3, s3);
  lz_tensor *ta = lz_test_wrap(a, LZ_F32, 3, s3), *tb = lz_test_wrap(b, LZ_F32, 3, s3);
  lz_tensor *tf = lz_test_wrap(inv, LZ_F32, 1, s1);
  CHECK_OK(lz_rope_ext_forward(ta, txb, tf, NULL, NH, HD, 2, 1.3f));
  CHECK_OK(lz_rope_ext_forward(tb, txf, tf, NULL, NH, HD, 2, 1.3f));
  CHECK(memcmp(a, b, sizeof a) == 0);
  lz_tensor *ts[] = {txb, txf, ta, tb, tf};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

LZ_TEST(rope_ext_errors) {
  float buf[2 * 4 * 24] = {0}, inv[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  int32_t pos[8] = {0};
  const int64_t s3[3] = {2, 4, 24}, s1[1] = {5}, s5[1] = {4}, sp[2] = {2, 4};
  lz_tensor *x = lz_test_wrap(buf, LZ_F32, 3, s3), *odd = lz_test_wrap(inv, LZ_F32, 1, s1);
  lz_tensor *wide = lz_test_wrap(inv, LZ_F32, 1, s5), *tp = lz_test_wrap(pos, LZ_I32, 2, sp);
  CHECK_ERR(lz_rope_ext_forward(x, x, odd, NULL, 3, 8, 0, 0), LZ_ERR_INVALID,
            "rope_forward: rotary_dim is 10; it must be even, from 2 to head_dim 8");
  CHECK_ERR(lz_rope_ext_forward(x, x, wide, NULL, 3, 8, 0, -1.0f), LZ_ERR_INVALID,
            "rope_forward: scale is -1; it must be finite and > 0 (0: none)");
  CHECK_ERR(lz_rope_ext_forward(x, x, wide, tp, 3, 8, 4, 0), LZ_ERR_INVALID,
            "rope_forward: pos_offset is 4 with pos given; pass 0");
  CHECK_ERR(lz_rope_ext_backward(x, x, NULL, NULL, 3, 8, 0, 0), LZ_ERR_INVALID,
            "rope_backward: inv_freq is missing");
  lz_tensor *ts[] = {x, odd, wide, tp};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}

/* --------------------------------------------------------- swiglu_packed */

/* The packed kernel computes what lz_swiglu_* compute on the two halves of
 * each row (f32 and bf16), forward and backward: the same arithmetic, though
 * a row's last elements may take the vector loop's scalar tail where the
 * unpacked call's do not (lz_exp's two paths may differ in the last bit). */
static int close_to(const float *a, const float *b, int64_t n) {
  double worst = 0.0, big = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs((double)a[i] - (double)b[i]);
    if (d > worst) worst = d;
    if (fabs((double)b[i]) > big) big = fabs((double)b[i]);
  }
  return worst / big <= 1e-6;
}

static void swiglu_packed_case(int64_t rows, int64_t H, lz_dtype dt) {
  const int64_t n = rows * H;
  const size_t es = dt == LZ_BF16 ? 2 : 4;
  char *gu = malloc(es * 2 * n), *g = malloc(es * n), *u = malloc(es * n), *d = malloc(es * n);
  float *out = malloc(4 * n), *ref = malloc(4 * n), *dgu = malloc(8 * n);
  float *dg = malloc(4 * n), *du = malloc(4 * n);
  for (int64_t i = 0; i < 2 * n; i++) {
    float v = 5.0f * frand();
    if (dt == LZ_BF16) {
      uint32_t w;
      memcpy(&w, &v, 4);
      ((uint16_t *)gu)[i] = (uint16_t)(w >> 16);
    } else {
      ((float *)gu)[i] = v;
    }
  }
  for (int64_t i = 0; i < n; i++) {
    float v = frand();
    if (dt == LZ_BF16) {
      uint32_t w;
      memcpy(&w, &v, 4);
      ((uint16_t *)d)[i] = (uint16_t)(w >> 16);
    } else {
      ((float *)d)[i] = v;
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    memcpy(g + es * r * H, gu + es * 2 * H * r, es * H);
    memcpy(u + es * r * H, gu + es * (2 * H * r + H), es * H);
  }
  const int64_t s_gu[3] = {1, rows, 2 * H}, s_h[3] = {1, rows, H};
  lz_tensor *tgu = lz_test_wrap(gu, dt, 3, s_gu), *tg = lz_test_wrap(g, dt, 3, s_h);
  lz_tensor *tu = lz_test_wrap(u, dt, 3, s_h), *td = lz_test_wrap(d, dt, 3, s_h);
  lz_tensor *tout = lz_test_wrap(out, LZ_F32, 3, s_h), *tref = lz_test_wrap(ref, LZ_F32, 3, s_h);
  lz_tensor *tdgu = lz_test_wrap(dgu, LZ_F32, 3, s_gu), *tdg = lz_test_wrap(dg, LZ_F32, 3, s_h);
  lz_tensor *tdu = lz_test_wrap(du, LZ_F32, 3, s_h);
  CHECK_OK(lz_swiglu_packed_forward(tout, tgu));
  CHECK_OK(lz_swiglu_forward(tref, tg, tu));
  CHECK(close_to(out, ref, n));
  CHECK_OK(lz_swiglu_packed_backward(tdgu, td, tgu));
  CHECK_OK(lz_swiglu_backward(tdg, tdu, td, tg, tu));
  int same = 1;
  for (int64_t r = 0; r < rows; r++) {
    same &= close_to(dgu + 2 * H * r, dg + H * r, H);
    same &= close_to(dgu + 2 * H * r + H, du + H * r, H);
  }
  CHECK(same);
  if (dt == LZ_F32) { /* dgate over gate */
    CHECK_OK(lz_swiglu_packed_backward(tgu, td, tgu));
    CHECK(memcmp(gu, dgu, 8 * n) == 0);
  }
  lz_tensor *ts[] = {tgu, tg, tu, td, tout, tref, tdgu, tdg, tdu};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
  free(gu), free(g), free(u), free(d), free(out), free(ref), free(dgu), free(dg), free(du);
}

LZ_TEST(swiglu_packed_is_swiglu_of_halves) { swiglu_packed_case(7, 37, LZ_F32); }
LZ_TEST(swiglu_packed_large_is_swiglu_of_halves) { swiglu_packed_case(300, 600, LZ_F32); }
LZ_TEST(swiglu_packed_bf16_is_swiglu_of_halves) { swiglu_packed_case(9, 40, LZ_BF16); }

/* silu(2) * 5 from the row [2, 5]. */
LZ_TEST(swiglu_packed_hand_values) {
  float gu[2] = {2.0f, 5.0f}, out[1];
  const int64_t s2[2] = {1, 2}, s1[2] = {1, 1};
  lz_tensor *tgu = lz_test_wrap(gu, LZ_F32, 2, s2), *tout = lz_test_wrap(out, LZ_F32, 2, s1);
  CHECK_OK(lz_swiglu_packed_forward(tout, tgu));
  CHECK_NEAR(out[0], 2.0 / (1.0 + exp(-2.0)) * 5.0, 1e-6);
  lz_tensor_free(tgu), lz_tensor_free(tout);
}

LZ_TEST(swiglu_packed_errors) {
  float buf[64] = {0};
  const int64_t s_gu[2] = {2, 8}, s_bad[2] = {2, 3}, s_h[2] = {2, 4};
  lz_tensor *gu = lz_test_wrap(buf, LZ_F32, 2, s_gu), *bad = lz_test_wrap(buf + 16, LZ_F32, 2, s_bad);
  lz_tensor *h = lz_test_wrap(buf + 32, LZ_F32, 2, s_h), *alias = lz_test_wrap(buf, LZ_F32, 2, s_h);
  CHECK_ERR(lz_swiglu_packed_forward(bad, gu), LZ_ERR_INVALID,
            "swiglu_forward: out is f32[2,3] but gate is f32[2,8]; gate's last dimension "
            "must be twice out's");
  CHECK_ERR(lz_swiglu_packed_forward(alias, gu), LZ_ERR_INVALID,
            "swiglu_forward: out and gate are the same memory");
  CHECK_ERR(lz_swiglu_packed_forward(h, NULL), LZ_ERR_INVALID, "gate is missing");
  CHECK_ERR(lz_swiglu_packed_backward(h, h, gu), LZ_ERR_INVALID,
            "swiglu_backward: dgate is f32[2,4] but gate is f32[2,8]");
  lz_tensor *ts[] = {gu, bad, h, alias};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) lz_tensor_free(ts[i]);
}
