/* test_attention_opts.c — the attention options (window, soft-capping,
 * scale) against a naive double-precision reference, alone, together and
 * with document masking (seg); gradients against central finite
 * differences through that reference; the decode kernel's ring cache
 * against forward. */
#include "attention_ref.h"
#include "lz_test.h"

#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static float frand(void) { /* uniform in [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng_state >> 40) * 0x1p-24 * 2.0 - 1.0);
}

static lz_tensor *new_t(lz_dtype dt, int nd, int64_t a, int64_t b, int64_t c) {
  lz_tensor *t = NULL;
  int64_t shape[3] = {a, b, c};
  CHECK_OK(lz_tensor_new(&t, dt, nd, shape, LZ_MEM_WORKSPACE));
  return t;
}

static lz_tensor *rand3(int64_t a, int64_t b, int64_t c, float amp) {
  lz_tensor *t = new_t(LZ_F32, 3, a, b, c);
  float *p = t->data;
  for (int64_t i = 0; i < a * b * c; i++) p[i] = amp * frand();
  return t;
}

typedef attn_shape shape;

/* Document ids: `docs` runs of uneven length. */
static lz_tensor *make_seg(const shape *s) {
  if (!s->docs) return NULL;
  lz_tensor *seg = new_t(LZ_I32, 2, s->B, s->T, 1);
  int32_t *p = seg->data;
  for (int64_t b = 0; b < s->B; b++)
    for (int64_t t = 0; t < s->T; t++) p[b * s->T + t] = (int32_t)((t * t * s->docs) / (s->T * s->T) + b);
  return seg;
}

static void describe(char *buf, size_t n, const shape *s) {
  snprintf(buf, n, "B%lld T%lld NH%d NKV%d HS%d window %d cap %g scale %g docs %d",
           (long long)s->B, (long long)s->T, s->NH, s->NKV, s->HS, s->window, (double)s->cap,
           (double)s->scale, s->docs);
}

static void check_forward(shape s, float amp) {
  const int64_t C = (int64_t)s.NH * s.HS;
  lz_tensor *qkv = rand3(s.B, s.T, attn_row(&s), amp), *out = rand3(s.B, s.T, C, 9.0f);
  lz_tensor *lse = rand3(s.B, s.NH, s.T, 9.0f), *seg = make_seg(&s);
  CHECK_OK(lz_attention_opts_forward(out, lse, qkv, seg, s.NH, s.NKV, s.window, s.cap, s.scale));
  double *x = attn_to_double(qkv);
  double *ro = malloc(sizeof(double) * (size_t)(s.B * s.T * C));
  double *rl = malloc(sizeof(double) * (size_t)(s.B * s.NH * s.T));
  attn_ref_forward(ro, rl, x, seg ? seg->data : NULL, &s);
  double err_o = attn_max_error(out->data, ro, s.B * s.T * C);
  double err_l = attn_max_error(lse->data, rl, s.B * s.NH * s.T);
  const double tol = 5e-6 * (amp > 1 ? amp * amp : 1);
  if (!(err_o <= tol) || !(err_l <= tol)) {
    char d[160];
    describe(d, sizeof d, &s);
    lz_test_fail(__FILE__, __LINE__, "forward %s amp %g: out error %g, lse error %g", d,
                 (double)amp, err_o, err_l);
  }
  free(x);
  free(ro);
  free(rl);
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  if (seg) lz_tensor_free(seg);
}

LZ_TEST(attention_options_forward_match_reference) {
  /* window: under a tile, a tile, across tiles, >= T */
  check_forward((shape){2, 150, 4, 2, 16, 5, 0, 0, 0}, 1.0f);
  check_forward((shape){1, 200, 2, 1, 32, 64, 0, 0, 0}, 2.0f);
  check_forward((shape){1, 300, 2, 2, 8, 100, 0, 0, 0}, 1.0f);
  check_forward((shape){1, 70, 3, 3, 8, 1, 0, 0, 0}, 1.0f); /* only itself: out = v */
  check_forward((shape){2, 90, 2, 1, 24, 500, 0, 0, 0}, 1.0f);
  /* soft-capping, with scores large enough that it bites */
  check_forward((shape){2, 130, 4, 2, 16, 0, 5.0f, 0, 0}, 3.0f);
  check_forward((shape){1, 17, 2, 2, 80, 0, 1.0f, 0, 0}, 2.0f);
  /* scale */
  check_forward((shape){1, 100, 2, 1, 32, 0, 0, 0.0625f, 0}, 2.0f);
  /* together, and with documents */
  check_forward((shape){2, 200, 4, 2, 16, 37, 3.0f, 0.3f, 0}, 2.0f);
  check_forward((shape){2, 180, 2, 1, 16, 50, 0, 0, 3}, 1.0f);
  check_forward((shape){1, 260, 4, 4, 8, 70, 4.0f, 0.2f, 4}, 2.0f);
}

static void check_backward(shape s, int max_checks) {
  const int64_t C = (int64_t)s.NH * s.HS, row = attn_row(&s);
  lz_tensor *qkv = rand3(s.B, s.T, row, 1.5f), *out = rand3(s.B, s.T, C, 1.0f);
  lz_tensor *lse = rand3(s.B, s.NH, s.T, 1.0f), *seg = make_seg(&s);
  lz_tensor *dout = rand3(s.B, s.T, C, 1.0f), *dqkv = rand3(s.B, s.T, row, 100.0f);
  CHECK_OK(lz_attention_opts_forward(out, lse, qkv, seg, s.NH, s.NKV, s.window, s.cap, s.scale));
  CHECK_OK(lz_attention_opts_backward(dqkv, dout, qkv, out, lse, seg, s.NH, s.NKV, s.window, s.cap,
                                      s.scale));
  int64_t at;
  double got, fd;
  double worst = attn_grad_error(qkv, dqkv, dout->data, seg ? seg->data : NULL, &s, max_checks,
                                 5, &at, &got, &fd);
  if (!(worst <= 1e-3)) {
    char d[160];
    describe(d, sizeof d, &s);
    lz_test_fail(__FILE__, __LINE__,
                 "backward %s: relative error %g at element %lld (analytic %.9g, finite "
                 "difference %.9g)",
                 d, worst, (long long)at, got, fd);
  }
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(dout);
  lz_tensor_free(dqkv);
  if (seg) lz_tensor_free(seg);
}

LZ_TEST(attention_options_backward_match_finite_differences) {
  check_backward((shape){1, 150, 2, 1, 8, 5, 0, 0, 0}, 800);
  check_backward((shape){1, 140, 2, 2, 8, 70, 0, 0, 0}, 800);
  check_backward((shape){1, 200, 2, 1, 16, 64, 0, 0, 0}, 1000);
  check_backward((shape){2, 40, 2, 1, 16, 0, 2.0f, 0, 0}, 1500);
  check_backward((shape){1, 80, 2, 2, 8, 0, 0, 0.5f, 0}, 1500);
  check_backward((shape){1, 150, 4, 2, 8, 33, 2.5f, 0.4f, 3}, 800);
}

/* Forward and backward outputs of one run, concatenated. */
static char *run_all(const shape *s, lz_tensor *qkv, lz_tensor *dout, int with_opts,
                     size_t *bytes) {
  const int64_t C = (int64_t)s->NH * s->HS;
  lz_tensor *out = rand3(s->B, s->T, C, 1), *lse = rand3(s->B, s->NH, s->T, 1);
  lz_tensor *dqkv = rand3(s->B, s->T, attn_row(s), 1);
  if (with_opts) {
    CHECK_OK(lz_attention_opts_forward(out, lse, qkv, NULL, s->NH, s->NKV, s->window, s->cap,
                                       s->scale));
    CHECK_OK(lz_attention_opts_backward(dqkv, dout, qkv, out, lse, NULL, s->NH, s->NKV,
                                        s->window, s->cap, s->scale));
  } else {
    CHECK_OK(lz_attention_gqa_forward(out, lse, qkv, s->NH, s->NKV));
    CHECK_OK(lz_attention_gqa_backward(dqkv, dout, qkv, out, lse, s->NH, s->NKV));
  }
  size_t a = lz_tensor_bytes(out), b = lz_tensor_bytes(lse), c = lz_tensor_bytes(dqkv);
  char *all = malloc(a + b + c);
  memcpy(all, out->data, a);
  memcpy(all + a, lse->data, b);
  memcpy(all + a + b, dqkv->data, c);
  *bytes = a + b + c;
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(dqkv);
  return all;
}

/* Options that change nothing (all off; a window of T or more; the default
 * scale written out) give the plain results bit for bit. */
LZ_TEST(attention_options_off_are_bitwise_plain) {
  shape s = {2, 200, 4, 2, 16, 0, 0, 0, 0};
  lz_tensor *qkv = rand3(s.B, s.T, attn_row(&s), 1.5f), *dout = rand3(s.B, s.T, 64, 1.0f);
  size_t n0, n1;
  char *plain = run_all(&s, qkv, dout, 0, &n0);
  const shape same[] = {s, {2, 200, 4, 2, 16, 200, 0, 0, 0}, {2, 200, 4, 2, 16, 4096, 0, 0, 0},
                        {2, 200, 4, 2, 16, 0, 0, 0.25f, 0}};
  for (size_t k = 0; k < sizeof same / sizeof same[0]; k++) {
    char *got = run_all(&same[k], qkv, dout, 1, &n1);
    CHECK(n0 == n1 && memcmp(plain, got, n0) == 0);
    free(got);
  }
  /* and a window that bites does change them */
  shape w = s;
  w.window = 50;
  char *cut = run_all(&w, qkv, dout, 1, &n1);
  CHECK(memcmp(plain, cut, n0) != 0);
  free(cut);
  free(plain);
  lz_tensor_free(qkv);
  lz_tensor_free(dout);
}

LZ_TEST(attention_options_reject_bad_values) {
  lz_tensor *qkv = rand3(1, 4, 48, 1), *out = rand3(1, 4, 16, 1), *lse = rand3(1, 2, 4, 1);
  CHECK_ERR(lz_attention_opts_forward(out, lse, qkv, NULL, 2, 2, -1, 0, 0), LZ_ERR_INVALID,
            "window is -1");
  CHECK_ERR(lz_attention_opts_forward(out, lse, qkv, NULL, 2, 2, 0, -2.0f, 0), LZ_ERR_INVALID,
            "softcap is -2");
  CHECK_ERR(lz_attention_opts_forward(out, lse, qkv, NULL, 2, 2, 0, 0, NAN), LZ_ERR_INVALID,
            "scale is nan");
  CHECK_ERR(lz_attention_opts_backward(qkv, out, qkv, out, lse, NULL, 2, 2, 0, INFINITY, 0),
            LZ_ERR_INVALID, "softcap is inf");
  lz_tensor *kc = rand3(1, 3, 16, 1), *vc = rand3(1, 3, 16, 1);
  lz_tensor *pos = new_t(LZ_I32, 1, 1, 1, 1);
  ((int32_t *)pos->data)[0] = 0;
  CHECK_OK(lz_attention_opts_decode(out, qkv, kc, vc, pos, 2, 2, 3, 0, 0)); /* a ring */
  CHECK_ERR(lz_attention_opts_decode(out, qkv, kc, vc, pos, 2, 2, 4, 0, 0), LZ_ERR_INVALID,
            "fewer than the window 4");
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(kc);
  lz_tensor_free(vc);
  lz_tensor_free(pos);
}

/* A prompt of P positions, three more in one call, then one position a call
 * through a ring cache of S slots (S < P + n), against forward over the
 * whole sequence; the prompt's call, whose rows start empty, runs as forward
 * and equals it bit for bit with an fp32 cache. */
static void check_decode_ring(shape s, int64_t P, int64_t S, lz_dtype cache_dt) {
  const int64_t row = attn_row(&s), C = (int64_t)s.NH * s.HS, kvw = (int64_t)s.NKV * s.HS;
  lz_tensor *qkv = rand3(s.B, s.T, row, 1.5f), *out = rand3(s.B, s.T, C, 1);
  lz_tensor *lse = rand3(s.B, s.NH, s.T, 1);
  if (cache_dt == LZ_BF16) { /* forward sees what the cache holds */
    float *x = qkv->data;
    for (int64_t i = 0; i < s.B * s.T * row; i++)
      if (i % row >= C) x[i] = lz_bf16_to_f32(lz_f32_to_bf16(x[i]));
  }
  CHECK_OK(lz_attention_opts_forward(out, lse, qkv, NULL, s.NH, s.NKV, s.window, s.cap, s.scale));
  lz_tensor *kc = new_t(cache_dt, 3, s.B, S, kvw), *vc = new_t(cache_dt, 3, s.B, S, kvw);
  lz_tensor *pos = new_t(LZ_I32, 1, s.B, 1, 1);
  int32_t *p = pos->data;
  for (int64_t b = 0; b < s.B; b++) p[b] = 0;
  double worst = 0;
  int differs = 0;
  for (int64_t t0 = 0; t0 < s.T;) {
    const int64_t n = t0 == 0 ? P : t0 == P && t0 + 3 <= s.T ? 3 : 1;
    lz_tensor *x = new_t(LZ_F32, 3, s.B, n, row), *y = new_t(LZ_F32, 3, s.B, n, C);
    for (int64_t b = 0; b < s.B; b++)
      memcpy((float *)x->data + b * n * row, (float *)qkv->data + (b * s.T + t0) * row,
             sizeof(float) * (size_t)(n * row));
    CHECK_OK(lz_attention_opts_decode(y, x, kc, vc, pos, s.NH, s.NKV, s.window, s.cap, s.scale));
    for (int64_t b = 0; b < s.B; b++) {
      for (int64_t i = 0; i < n * C; i++) {
        double want = ((float *)out->data)[(b * s.T + t0) * C + i];
        double e = fabs(((float *)y->data)[b * n * C + i] - want);
        if (!(e <= worst)) worst = e;
        if (t0 == 0 && cache_dt == LZ_F32 && e != 0 && !differs) {
          differs = 1;
          lz_test_fail(__FILE__, __LINE__, "prompt of %lld: element %lld of row %lld is %g, "
                       "forward's %g", (long long)P, (long long)i, (long long)b,
                       ((float *)y->data)[b * n * C + i], want);
        }
      }
      p[b] += (int32_t)n;
    }
    lz_tensor_free(x);
    lz_tensor_free(y);
    t0 += n;
  }
  if (!(worst <= 2e-6)) {
    char d[160];
    describe(d, sizeof d, &s);
    lz_test_fail(__FILE__, __LINE__, "decode %s prompt %lld ring %lld: error %g", d,
                 (long long)P, (long long)S, worst);
  }
  lz_tensor_free(qkv);
  lz_tensor_free(out);
  lz_tensor_free(lse);
  lz_tensor_free(kc);
  lz_tensor_free(vc);
  lz_tensor_free(pos);
}

LZ_TEST(attention_decode_window_ring_equals_forward) {
  check_decode_ring((shape){2, 90, 4, 2, 16, 12, 0, 0, 0}, 40, 12, LZ_F32); /* prompt > ring */
  check_decode_ring((shape){1, 70, 2, 1, 8, 16, 0, 0, 0}, 5, 20, LZ_F32);   /* ring > window */
  check_decode_ring((shape){1, 80, 2, 2, 16, 9, 2.0f, 0.3f, 0}, 30, 9, LZ_F32);
  check_decode_ring((shape){2, 60, 2, 1, 16, 10, 0, 0, 0}, 25, 10, LZ_BF16);
  check_decode_ring((shape){1, 50, 2, 2, 8, 0, 3.0f, 0.5f, 0}, 20, 50, LZ_F32); /* no window */
  check_decode_ring((shape){1, 40, 4, 2, 16, 0, 0, 0, 0}, 16, 40, LZ_BF16);
  check_decode_ring((shape){2, 30, 3, 1, 24, 0, 1.5f, 0, 0}, 10, 30, LZ_F32); /* head of 24 */
}

/* A decoding step runs a key/value head's query heads together where every
 * thread gets a task (one thread here), else head by head (eight threads
 * for two key/value heads): each head's output has the same bits. */
LZ_TEST(attention_decode_grouped_heads_give_each_heads_bits) {
  const int NH = 8, NKV = 2, HS = 24, P = 50, row = (NH + 2 * NKV) * HS;
  const int saved = lz_threads_get();
  for (int k = 0; k < 2; k++) {
    const lz_dtype dt = k ? LZ_BF16 : LZ_F32;
    lz_tensor *prompt = rand3(1, P, row, 1.5f), *step = rand3(1, 1, row, 1.5f);
    lz_tensor *kc = new_t(dt, 3, 1, P + 1, NKV * HS), *vc = new_t(dt, 3, 1, P + 1, NKV * HS);
    lz_tensor *pos = new_t(LZ_I32, 1, 1, 1, 1), *yp = rand3(1, P, NH * HS, 1);
    lz_tensor *y[2] = {rand3(1, 1, NH * HS, 1), rand3(1, 1, NH * HS, 1)};
    ((int32_t *)pos->data)[0] = 0;
    CHECK_OK(lz_attention_decode(yp, prompt, kc, vc, pos, NH, NKV));
    for (int t = 0; t < 2; t++) {
      CHECK_OK(lz_threads_set(t ? 8 : 1));
      ((int32_t *)pos->data)[0] = P;
      CHECK_OK(lz_attention_decode(y[t], step, kc, vc, pos, NH, NKV));
    }
    lz_threads_set(saved);
    CHECK(memcmp(y[0]->data, y[1]->data, sizeof(float) * NH * HS) == 0);
    lz_tensor_free(prompt), lz_tensor_free(step), lz_tensor_free(kc), lz_tensor_free(vc);
    lz_tensor_free(pos), lz_tensor_free(yp), lz_tensor_free(y[0]), lz_tensor_free(y[1]);
  }
}
