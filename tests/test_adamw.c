/* test_adamw.c — fused AdamW against a scalar double reference over several
 * steps, working copies (f32, bf16, f16), thread independence, errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp */

static uint64_t rng = 0x94D049BB133111EBull;
static float frand(void) { return lz_test_uniform(&rng); }

/* torch.optim.AdamW, one element, in double. */
static void ref_step(double *p, double *m, double *v, double grad, const lz_adamw_args *a) {
  double g = grad * a->grad_scale, t = (double)a->step;
  *p -= (double)a->lr * a->weight_decay * *p;
  *m = a->beta1 * *m + (1.0 - a->beta1) * g;
  *v = a->beta2 * *v + (1.0 - a->beta2) * g * g;
  double mhat = *m / (1.0 - pow(a->beta1, t)), vhat = *v / (1.0 - pow(a->beta2, t));
  *p -= a->lr * mhat / (sqrt(vhat) + a->eps);
}

/* Five steps on n elements with the working copy in `wdt` (or none); checks
 * param, m, v against the reference and the working copy against param. */
static void check_case(int64_t n, int with_working, lz_dtype wdt) {
  const int64_t s1[1] = {n};
  float *p = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
  float *m = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
  float *wf = malloc(sizeof(float) * n);
  uint16_t *wh = malloc(sizeof(uint16_t) * n);
  double *pd = malloc(sizeof(double) * n), *md = malloc(sizeof(double) * n);
  double *vd = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i++) {
    p[i] = frand();
    m[i] = v[i] = 0.0f;
    pd[i] = p[i], md[i] = vd[i] = 0.0;
  }
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s1), *tg = lz_test_wrap(g, LZ_F32, 1, s1);
  lz_tensor *tm = lz_test_wrap(m, LZ_F32, 1, s1), *tv = lz_test_wrap(v, LZ_F32, 1, s1);
  lz_tensor *tw = !with_working ? NULL
                  : wdt == LZ_F32 ? lz_test_wrap(wf, LZ_F32, 1, s1)
                                  : lz_test_wrap(wh, wdt, 1, s1);
  lz_adamw_args args = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                        .weight_decay = 0.1f, .grad_scale = 0.5f, .step = 0};
  for (int step = 1; step <= 5; step++) {
    /* Gradients of mixed sizes, some zero (m = v = 0 for a while: eps matters). */
    for (int64_t i = 0; i < n; i++) g[i] = i % 11 == 0 ? 0.0f : frand() * (i % 3 ? 1.0f : 1e-3f);
    args.step = step;
    CHECK_OK(lz_adamw_step(tp, tg, tm, tv, tw, &args));
    for (int64_t i = 0; i < n; i++) ref_step(&pd[i], &md[i], &vd[i], g[i], &args);
  }
  CHECK(lz_test_rel_err(p, pd, n) <= 1e-5);
  CHECK(lz_test_rel_err(m, md, n) <= 1e-5);
  CHECK(lz_test_rel_err(v, vd, n) <= 1e-5);
  if (with_working) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) {
      if (wdt == LZ_F32) ok &= wf[i] == p[i];
      else if (wdt == LZ_BF16) ok &= wh[i] == lz_f32_to_bf16(p[i]);
      else ok &= wh[i] == lz_f32_to_f16(p[i]);
    }
    CHECK(ok);
  }
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  lz_tensor_free(tw);
  free(p), free(g), free(m), free(v), free(wf), free(wh), free(pd), free(md), free(vd);
}

LZ_TEST(adamw_against_reference) { check_case(1001, 0, LZ_F32); }
LZ_TEST(adamw_working_f32) { check_case(1001, 1, LZ_F32); }
LZ_TEST(adamw_working_bf16) { check_case(100003, 1, LZ_BF16); } /* threaded */
LZ_TEST(adamw_working_f16) { check_case(100003, 1, LZ_F16); }

/* Elementwise, so the thread count cannot matter; check it does not. */
LZ_TEST(adamw_thread_independent) {
  enum { N = 200003 };
  const int64_t s1[1] = {N};
  float *p[2], *m[2], *v[2], *g = malloc(sizeof(float) * N);
  for (int64_t i = 0; i < N; i++) g[i] = frand();
  const int saved = lz_threads_get();
  for (int k = 0; k < 2; k++) {
    p[k] = malloc(sizeof(float) * N), m[k] = malloc(sizeof(float) * N);
    v[k] = malloc(sizeof(float) * N);
    for (int64_t i = 0; i < N; i++) p[k][i] = 1.0f, m[k][i] = 0.1f, v[k][i] = 0.01f;
    lz_tensor *tp = lz_test_wrap(p[k], LZ_F32, 1, s1), *tm = lz_test_wrap(m[k], LZ_F32, 1, s1);
    lz_tensor *tv = lz_test_wrap(v[k], LZ_F32, 1, s1), *tg = lz_test_wrap(g, LZ_F32, 1, s1);
    lz_adamw_args args = {.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                          .weight_decay = 0.0f, .grad_scale = 1.0f, .step = 7};
    CHECK_OK(lz_threads_set(k + 1));
    CHECK_OK(lz_adamw_step(tp, tg, tm, tv, NULL, &args));
    lz_tensor_free(tp), lz_tensor_free(tm), lz_tensor_free(tv), lz_tensor_free(tg);
  }
  lz_threads_set(saved);
  CHECK(memcmp(p[0], p[1], sizeof(float) * N) == 0);
  CHECK(memcmp(m[0], m[1], sizeof(float) * N) == 0);
  CHECK(memcmp(v[0], v[1], sizeof(float) * N) == 0);
  for (int k = 0; k < 2; k++) free(p[k]), free(m[k]), free(v[k]);
  free(g);
}

LZ_TEST(adamw_errors) {
  const int64_t s8[1] = {8};
  lz_test_operands o = lz_test_operands_new(1, s8);
  lz_tensor *t = o.f32, *t9 = o.f32_9, *ti = o.i32, *th = o.bf16;
  const lz_adamw_args good = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                              .weight_decay = 0.0f, .grad_scale = 1.0f, .step = 1};
  lz_adamw_args a = good;
  /* The failing calls below pass one tensor for all four: they stop before
   * touching data. param, grad, m and v must be distinct memory otherwise. */
  float pb[8] = {0}, gb[8] = {0}, mb[8] = {0}, vb[8] = {0};
  lz_tensor *tp = lz_test_wrap(pb, LZ_F32, 1, s8), *tg = lz_test_wrap(gb, LZ_F32, 1, s8);
  lz_tensor *tm = lz_test_wrap(mb, LZ_F32, 1, s8), *tv = lz_test_wrap(vb, LZ_F32, 1, s8);
  CHECK_OK(lz_adamw_step(tp, tg, tm, tv, NULL, &a));
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  CHECK_ERR(lz_adamw_step(t, t9, t, t, NULL, &a), LZ_ERR_INVALID,
            "adamw_step: grad is f32[9] (9 elements), expected 8 elements (the element count "
            "of param)");
  CHECK_ERR(lz_adamw_step(t, t, t, t9, NULL, &a), LZ_ERR_INVALID, "adamw_step: v is f32[9]");
  CHECK_ERR(lz_adamw_step(th, t, t, t, NULL, &a), LZ_ERR_INVALID,
            "adamw_step: param is bf16[8], expected dtype f32");
  CHECK_ERR(lz_adamw_step(t, t, t, t, ti, &a), LZ_ERR_INVALID,
            "adamw_step: working is i32[8], expected dtype f32, bf16 or f16");
  CHECK_ERR(lz_adamw_step(t, t, t, t, t9, &a), LZ_ERR_INVALID, "adamw_step: working is f32[9]");
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, NULL), LZ_ERR_INVALID, "adamw_step: args is NULL");
  a.step = 0;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID,
            "adamw_step: args->step is 0; steps count from 1");
  a = good, a.beta1 = 1.0f;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID,
            "adamw_step: args->beta1 is 1; it must be in [0, 1)");
  a = good, a.beta2 = NAN;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID, "args->beta2 is nan");
  a = good, a.lr = -1.0f;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID, "args->lr is -1");
  a = good, a.eps = -1.0f;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID, "args->eps is -1");
  a = good, a.weight_decay = -0.5f;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID, "args->weight_decay is -0.5");
  a = good, a.grad_scale = INFINITY;
  CHECK_ERR(lz_adamw_step(t, t, t, t, NULL, &a), LZ_ERR_INVALID, "args->grad_scale is inf");
  lz_test_operands_free(&o);
}

/* The f16 and bf16 working copies are converted in the update's own
 * vectorized pass, by other routines than lz_f32_to_f16 and lz_f32_to_bf16
 * (branch-free; AVX-512 lanes and streaming stores): they must give the same
 * bits on every kind of value. With lr 0, no decay and zero gradients the
 * step leaves each parameter as it was, so the working copy is the
 * conversion of chosen bit patterns. */
static void check_half_bits(const uint32_t *bits, int64_t n, lz_dtype dt, int64_t w_at) {
  const int64_t s1[1] = {n};
  float *p = malloc(sizeof(float) * n), *g = calloc((size_t)n, sizeof(float));
  float *m = calloc((size_t)n, sizeof(float)), *v = calloc((size_t)n, sizeof(float));
  /* the working copy w_at elements into a 64-byte-aligned buffer: off the
   * vector stores' alignment, so a vector pass meets a ragged head */
  const size_t w_bytes = (sizeof(uint16_t) * (size_t)(n + w_at) + 63) / 64 * 64;
  uint16_t *w_buf = aligned_alloc(64, w_bytes), *w = w_buf + w_at;
  for (int64_t i = 0; i < n; i++) memcpy(&p[i], &bits[i], 4);
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s1), *tg = lz_test_wrap(g, LZ_F32, 1, s1);
  lz_tensor *tm = lz_test_wrap(m, LZ_F32, 1, s1), *tv = lz_test_wrap(v, LZ_F32, 1, s1);
  lz_tensor *tw = lz_test_wrap(w, dt, 1, s1);
  const lz_adamw_args args = {.lr = 0.0f,
                              .beta1 = 0.9f,
                              .beta2 = 0.999f,
                              .eps = 1e-8f,
                              .weight_decay = 0.0f,
                              .grad_scale = 1.0f,
                              .step = 1};
  CHECK_OK(lz_adamw_step(tp, tg, tm, tv, tw, &args));
  int64_t bad = 0, changed = 0;
  for (int64_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &p[i], 4);
    /* Arithmetic quiets a signaling NaN; every other value comes through as is. */
    int is_nan = (bits[i] & 0x7fffffffu) > 0x7f800000u;
    if (is_nan ? u != (bits[i] | 0x400000u) : u != bits[i]) changed++;
    uint16_t want = dt == LZ_F16 ? lz_f32_to_f16(p[i]) : lz_f32_to_bf16(p[i]);
    if (w[i] != want) {
      if (bad < 5)
        printf("    f32 0x%08x: working copy 0x%04x, lz_f32_to_%s 0x%04x\n", (unsigned)u,
               (unsigned)w[i], dt == LZ_F16 ? "f16" : "bf16", (unsigned)want);
      bad++;
    }
  }
  CHECK_EQ_INT(changed, 0);
  CHECK_EQ_INT(bad, 0);
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  lz_tensor_free(tw);
  free(p), free(g), free(m), free(v), free(w_buf);
}

LZ_TEST(adamw_half_copies_are_bitwise_the_scalar_conversions) {
  enum { MAX = 1 << 20 };
  uint32_t *bits = malloc(sizeof(uint32_t) * MAX);
  int64_t n = 0;
  static const uint32_t special[] = {
      0x00000000u, 0x00000001u, 0x007fffffu, 0x00800000u, /* zero, f32 subnormals, min normal */
      0x33000000u, 0x33000001u, 0x32ffffffu,              /* 2^-25: the tie that goes to zero */
      0x33800000u, 0x33c00000u, 0x33a00000u,              /* 2^-24, 1.5 and 1.25 units */
      0x387fc000u, 0x387fe000u, 0x387ff000u, 0x387fffffu, /* just below 2^-14 (may carry) */
      0x38800000u, 0x38801000u, 0x38802000u, 0x38803000u, /* 2^-14 and its ties */
      0x3f800000u, 0x3f801000u, 0x3f803000u, 0x3f800fffu, /* 1 and its ties */
      0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, /* 65504, up to the overflow tie */
      0x47800000u, 0x7f7fffffu, 0x7f800000u,              /* 65536, FLT_MAX, Inf */
      0x7f800001u, 0x7fbfffffu, 0x7fc00000u, 0x7fc02000u, /* NaNs: signaling, quiet, payloads */
      0x7fffffffu, 0x7f802000u, 0x7fa00000u, 0x7f801fffu,
      0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, /* bf16's ties at 1, either way */
      0x7f7f8000u, 0x7f7f7fffu, 0x00008000u, 0x00018000u, /* its overflow tie, subnormal ties */
  };
  for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
    bits[n++] = special[i];
    bits[n++] = special[i] | 0x80000000u;
  }
  /* Every half's value and the midpoints to its neighbours, and one f32
   * ulp either side of each midpoint. */
  for (uint32_t h = 0; h < 0x7c00u; h++) {
    float lo = lz_f16_to_f32((uint16_t)h), hi = lz_f16_to_f32((uint16_t)(h + 1));
    float mid = (float)(((double)lo + (double)hi) / 2);
    uint32_t mb;
    memcpy(&mb, &mid, 4);
    memcpy(&bits[n++], &lo, 4);
    bits[n++] = mb, bits[n++] = mb - 1, bits[n++] = mb + 1;
    bits[n++] = mb | 0x80000000u;
  }
  /* Random bit patterns over every exponent, and random values near 1. */
  uint64_t r = 0x9E3779B97F4A7C15ull;
  while (n < MAX - 2) {
    bits[n++] = (uint32_t)lz_test_xorshift(&r);
    float f = lz_test_uniform(&r) * 4.0f;
    memcpy(&bits[n++], &f, 4);
  }
  for (int k = 0; k < 2; k++) {
    const lz_dtype dt = k ? LZ_BF16 : LZ_F16;
    check_half_bits(bits, n, dt, 0);        /* over 2^16 elements: threaded blocks */
    check_half_bits(bits + 3, 1001, dt, 3); /* a short, odd tail, the copy unaligned */
  }
  free(bits);
}

/* bf16 moments: bitwise the fp32 step whose m and v are rounded to bf16
 * (nearest even) after every step, with a working copy, over threads. */
LZ_TEST(adamw_bf16_moments_are_the_fp32_step_rounded) {
  const int64_t n = 100003, s1[1] = {n};
  float *p = malloc(sizeof(float) * n), *q = malloc(sizeof(float) * n);
  float *g = malloc(sizeof(float) * n), *m = malloc(sizeof(float) * n);
  float *v = malloc(sizeof(float) * n);
  uint16_t *mh = malloc(sizeof(uint16_t) * n), *vh = malloc(sizeof(uint16_t) * n);
  uint16_t *w = malloc(sizeof(uint16_t) * n);
  for (int64_t i = 0; i < n; i++) p[i] = q[i] = frand(), m[i] = v[i] = 0.0f, mh[i] = vh[i] = 0;
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s1), *tq = lz_test_wrap(q, LZ_F32, 1, s1);
  lz_tensor *tg = lz_test_wrap(g, LZ_F32, 1, s1), *tm = lz_test_wrap(m, LZ_F32, 1, s1);
  lz_tensor *tv = lz_test_wrap(v, LZ_F32, 1, s1), *tmh = lz_test_wrap(mh, LZ_BF16, 1, s1);
  lz_tensor *tvh = lz_test_wrap(vh, LZ_BF16, 1, s1), *tw = lz_test_wrap(w, LZ_BF16, 1, s1);
  lz_adamw_args args = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                        .weight_decay = 0.1f, .grad_scale = 0.5f, .step = 0};
  int same = 1, moved = 0;
  for (int step = 1; step <= 5; step++) {
    for (int64_t i = 0; i < n; i++) g[i] = i % 11 == 0 ? 0.0f : frand() * (i % 3 ? 1.0f : 1e-3f);
    args.step = step;
    CHECK_OK(lz_adamw_step(tp, tg, tm, tv, NULL, &args));
    for (int64_t i = 0; i < n; i++) {
      m[i] = lz_bf16_to_f32(lz_f32_to_bf16(m[i]));
      v[i] = lz_bf16_to_f32(lz_f32_to_bf16(v[i]));
    }
    CHECK_OK(lz_adamw_step(tq, tg, tmh, tvh, tw, &args));
    for (int64_t i = 0; i < n; i++) {
      same &= memcmp(&p[i], &q[i], 4) == 0 && mh[i] == lz_f32_to_bf16(m[i]) &&
              vh[i] == lz_f32_to_bf16(v[i]) && w[i] == lz_f32_to_bf16(q[i]);
      moved |= mh[i] != 0;
    }
  }
  CHECK(same);
  CHECK(moved);
  /* One moment bf16 and the other f32 is refused. */
  CHECK(lz_adamw_step(tq, tg, tmh, tv, NULL, &args) == LZ_ERR_INVALID);
  lz_tensor *all[] = {tp, tq, tg, tm, tv, tmh, tvh, tw};
  for (int i = 0; i < 8; i++) lz_tensor_free(all[i]);
  free(p), free(q), free(g), free(m), free(v), free(mh), free(vh), free(w);
}
