/* test_quant8.c — the block-wise 8-bit code's quantiser (core/optim/quant8.c):
 * the choices bitsandbytes 0.50.2's CPU library makes where they are not the
 * nearest map entry, a non-decreasing index, NaN to 0, and the vector form
 * this machine runs equal to the scalar one on every kind of value.
 * tests/ref/test5_adam8bit.py compares with bitsandbytes itself. */
#include "lz_test.h"
#include "optim/lz_optim.h"
#include "optim/lz_quant8.h"

#include <stdlib.h> /* malloc, setenv */

static uint64_t rng = 0x2545F4914F6CDD1Dull;

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* What bitsandbytes' quantiser returned for these values (probed through
 * cquantize_blockwise_cpu_fp32 with absmax 1). */
LZ_TEST(quant8_bitsandbytes_choices) {
  const lz_q8_map *s = lz_q8_map_get(1), *u = lz_q8_map_get(0);
  const float z[] = {1.0f,   0.0f,   -0.0f,    1e-30f,   0.5f,        -0.5f, 1e-7f,
                     3e-5f,  -3e-5f, 1e-3f,    -1e-3f,   0.1f,        -0.1f, 0.99f,
                     -0.99f, -1.0f,  0x1p-15f, 0x1p-16f, 3 * 0x1p-16f};
  const uint8_t want_s[] = {255, 131, 131, 131, 219, 35, 131, 131, 123, 142,
                            112, 190, 64,  254, 0,   0,  132, 131, 132};
  const uint8_t want_u[] = {255, 7, 7, 7, 183, 0, 7, 7, 0, 30, 0, 126, 0, 253, 0, 0, 10, 7, 10};
  int ok = 1;
  for (size_t i = 0; i < sizeof z / sizeof *z; i++) {
    ok &= lz_q8_index(s, z[i]) == want_s[i];
    ok &= lz_q8_index(u, z[i]) == want_u[i];
  }
  CHECK(ok);
  CHECK(lz_q8_index(s, from_bits(0x7fc00000u)) == 0 && lz_q8_index(u, from_bits(0xffc00000u)) == 0);
  /* 0.0 is not the nearest entry's index (127 is the signed map's 0.0). */
  CHECK(s->values[127] == 0.0f && lz_q8_index(s, 0.0f) != 127);
}

/* Over every fp32 in [-1, 1] in steps of 97 floats, and around the powers
 * of two, the index never decreases as z grows. */
LZ_TEST(quant8_index_is_monotone) {
  for (int sgn = 0; sgn < 2; sgn++) {
    const lz_q8_map *map = lz_q8_map_get(sgn);
    int ok = 1;
    int last = -1;
    /* from -1 up to -0, then from +0 up to 1 */
    for (int64_t b = 0x3f800000; b >= 0; b -= 97) {
      const int i = lz_q8_index(map, from_bits(0x80000000u | (uint32_t)b));
      ok &= i >= last, last = i;
    }
    for (int64_t b = 0; b <= 0x3f800000; b += 97) {
      const int i = lz_q8_index(map, from_bits((uint32_t)b));
      ok &= i >= last, last = i;
    }
    CHECK(ok);
    CHECK(last == 255);
  }
}

/* The vector quantisers (each form this machine runs) against the scalar
 * index, x / absmax, on random values, zeros, NaN of both signs, denormals and values a
 * float apart, at several absmaxes (0, tiny, huge, inf included). */
LZ_TEST(quant8_vector_form_is_the_scalar_one) {
  const int64_t n = 256;
  float *x = malloc(sizeof(float) * n);
  uint8_t *q = malloc((size_t)n);
  const float absmaxes[] = {1.0f, 0.0f, 3.7e-3f, 1e-38f, 1e-44f, 3e38f, INFINITY};
  int ok = 1;
  for (int rep = 0; rep < 400; rep++) {
    const lz_q8_quantize_fn quantize = lz_q8_quantizer_at(rep % 4);
    for (int sgn = 0; sgn < 2; sgn++) {
      const lz_q8_map *map = lz_q8_map_get(sgn);
      const float am = absmaxes[rep % 7];
      for (int64_t i = 0; i < n; i++) {
        const uint64_t r = lz_test_xorshift(&rng);
        float v = lz_test_uniform(&rng) * am;
        if (r % 13 == 0) v = 0.0f;
        if (r % 17 == 0) v = from_bits((uint32_t)(r >> 32) & 0x807fffffu); /* denormal */
        if (r % 19 == 0) v = r & 128 ? -nanf("") : nanf(""); /* NaN of either sign */
        if (r % 23 == 0) v = from_bits((uint32_t)(r >> 40)) * am; /* tiny multiples */
        if (i > 0 && r % 5 == 0) v = nextafterf(x[i - 1], r & 64 ? INFINITY : -INFINITY);
        x[i] = fabsf(v) <= am || v != v ? v : am;
      }
      quantize(map, x, am, q, n);
      for (int64_t i = 0; i < n; i++) ok &= q[i] == lz_q8_index(map, x[i] / am);
    }
  }
  CHECK(ok);
  free(x), free(q);
}

/* The vector quantisers against the scalar index where a wrong rounding or
 * a wrong cell would show first: around every step of both maps, around the
 * cells' edges, 2^-26 and 1, at absmaxes from tiny to huge, every value
 * within 12 floats of x / absmax landing there; each form this machine runs. */
static int near_steps_and_edges(lz_q8_quantize_fn quantize) {
  enum { N = 256 };
  float x[N];
  uint8_t q[N];
  const float absmaxes[] = {1.0f,    0x1.8p-3f, 3.7e-3f, 0x1.234566p-60f, 0x1.fffffep-126f,
                            0x1p-125f, 0x1p125f, 0x1.000002p125f, 7.5e20f, 1.3e-12f};
  int ok = 1, points = 0;
  for (int sgn = 0; sgn < 2; sgn++) {
    const lz_q8_map *map = lz_q8_map_get(sgn);
    /* the places to probe: each step (found by bisection), each cell edge */
    uint32_t at[8192];
    int n_at = 0;
    for (int side = 0; side < 2; side++) {
      const uint32_t s = (uint32_t)side << 31;
      uint32_t prev = 0;
      for (uint32_t b = 1024; b <= Q8_ONE + 1024; b += 1024) {
        const uint32_t hi = b > Q8_ONE ? Q8_ONE : b;
        if (lz_q8_index(map, from_bits(s | prev)) != lz_q8_index(map, from_bits(s | hi))) {
          uint32_t lo = prev, h = hi; /* the first pattern with hi's index */
          while (h - lo > 1) {
            const uint32_t mid = lo + (h - lo) / 2;
            if (lz_q8_index(map, from_bits(s | mid)) == lz_q8_index(map, from_bits(s | hi)))
              h = mid;
            else
              lo = mid;
          }
          if (n_at < 8192) at[n_at++] = s | h;
        }
        prev = hi;
      }
      for (uint32_t c = Q8_LO; c <= Q8_ONE && n_at < 8192; c += 0x10000 * 97) at[n_at++] = s | c;
      at[n_at++] = s | Q8_LO, at[n_at++] = s | Q8_ONE;
    }
    for (size_t a = 0; a < sizeof absmaxes / sizeof *absmaxes; a++) {
      const float am = absmaxes[a];
      int fill = 0;
      for (int t = 0; t < n_at; t++)
        for (int d = -12; d <= 12; d++) {
          const float z = from_bits(at[t] + (uint32_t)d);
          const float v = z * am;
          x[fill++] = fabsf(v) <= am ? v : copysignf(am, v);
          if (fill == N || (t == n_at - 1 && d == 12)) {
            quantize(map, x, am, q, fill);
            for (int i = 0; i < fill; i++) ok &= q[i] == lz_q8_index(map, x[i] / am);
            points += fill, fill = 0;
          }
        }
    }
  }
  return ok && points > 100000;
}

LZ_TEST(quant8_vector_form_near_steps_and_edges) {
  for (int level = 0; level < 4; level++) CHECK(near_steps_and_edges(lz_q8_quantizer_at(level)));
}

/* bitsandbytes' CPU update for one block, op for op (adamw8bit.c's
 * formula, written out here as the reference). */
__attribute__((optimize("fp-contract=off"))) static void ref_block(
    float *p, const float *grad, uint8_t *qm, uint8_t *qv, float *am, float *av,
    const lz_adamw_args *a, int64_t n) {
  const double c1 = 1.0 - pow(a->beta1, (double)a->step);
  const double c2 = sqrt(1.0 - pow(a->beta2, (double)a->step));
  const float omb1 = (float)(1.0 - a->beta1), omb2 = (float)(1.0 - a->beta2);
  const float decay = a->weight_decay > 0 ? (float)(1.0 - (double)a->lr * a->weight_decay) : 1.0f;
  const float neg = (float)(-(double)a->lr / c1), fc2 = (float)c2;
  const lz_q8_map *mm = lz_q8_map_get(1), *mv = lz_q8_map_get(0);
  float m[256], v[256], max_m = 0.0f, max_v = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * a->grad_scale;
    m[i] = fmaf(g, omb1, mm->values[qm[i]] * *am * a->beta1);
    v[i] = fmaf(omb2 * g, g, mv->values[qv[i]] * *av * a->beta2);
    const float denom = sqrtf(v[i]) / fc2 + a->eps;
    p[i] = p[i] * decay + neg * m[i] / denom;
    max_m = fabsf(m[i]) > max_m ? fabsf(m[i]) : max_m;
    max_v = fabsf(v[i]) > max_v ? fabsf(v[i]) : max_v;
  }
  *am = max_m, *av = max_v;
  for (int64_t i = 0; i < n; i++)
    qm[i] = lz_q8_index(mm, m[i] / max_m), qv[i] = lz_q8_index(mv, v[i] / max_v);
}

/* The forms of the 8-bit update (adamw8bit.c), lowest first. */
static const char *const forms[] = {"base", "avx2", "avx512", "vbmi", "vbmi2", "bf16"};

/* The fused step (in the form LZ_ADAMW8BIT_ISA names, over several threads'
 * chunks and a partial last block) against ref_block, bit for bit, over 4
 * steps of gradients with zeros, denormals, NaN, a block of zeros and huge
 * outliers. */
static int step_is_the_blockwise_reference(void) {
  const int64_t n = 3 * 16384 + 5 * 256 + 77, blocks = (n + 255) / 256, s1[1] = {n};
  const int64_t sb[1] = {blocks};
  float *p = malloc(sizeof(float) * n), *rp = malloc(sizeof(float) * n);
  float *g = malloc(sizeof(float) * n), *am = calloc((size_t)blocks, sizeof(float));
  float *av = calloc((size_t)blocks, sizeof(float)), *ram = calloc((size_t)blocks, sizeof(float));
  float *rav = calloc((size_t)blocks, sizeof(float));
  uint8_t *qm = calloc((size_t)n, 1), *qv = calloc((size_t)n, 1), *rqm = calloc((size_t)n, 1);
  uint8_t *rqv = calloc((size_t)n, 1);
  for (int64_t i = 0; i < n; i++) rp[i] = p[i] = 0.05f * lz_test_uniform(&rng);
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s1), *tg = lz_test_wrap(g, LZ_F32, 1, s1);
  lz_tensor *tm = lz_test_wrap(qm, LZ_U8, 1, s1), *tv = lz_test_wrap(qv, LZ_U8, 1, s1);
  lz_tensor *tam = lz_test_wrap(am, LZ_F32, 1, sb), *tav = lz_test_wrap(av, LZ_F32, 1, sb);
  lz_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                     .weight_decay = 0.1f, .grad_scale = 0.5f, .step = 1};
  int ok = 1;
  for (; a.step <= 4; a.step++) {
    const float scale = a.step == 3 ? 1e-6f : 1.0f;
    for (int64_t i = 0; i < n; i++) {
      const uint64_t r = lz_test_xorshift(&rng);
      g[i] = scale * lz_test_uniform(&rng) * (float)(1 << (r % 8));
      if (r % 11 == 0) g[i] = 0.0f;
      if (r % 29 == 0) g[i] = from_bits((uint32_t)(r >> 40)); /* denormal */
      if (i == 1000 && a.step == 2) g[i] = nanf("");
      if (i >= 2048 && i < 2304) g[i] = 0.0f;            /* a block of zeros */
      if (i >= 4096 && i < 4100) g[i] *= 1e6f;           /* outliers */
    }
    ok &= lz_adamw8bit_step(tp, tg, tm, tv, tam, tav, NULL, &a) == LZ_OK;
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t o = b * 256, len = n - o < 256 ? n - o : 256;
      ref_block(rp + o, g + o, rqm + o, rqv + o, ram + b, rav + b, &a, len);
    }
    ok &= !memcmp(p, rp, sizeof(float) * n) && !memcmp(qm, rqm, (size_t)n) &&
          !memcmp(qv, rqv, (size_t)n) && !memcmp(am, ram, sizeof(float) * blocks) &&
          !memcmp(av, rav, sizeof(float) * blocks);
  }
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  lz_tensor_free(tam), lz_tensor_free(tav);
  free(p), free(rp), free(g), free(am), free(av), free(ram), free(rav);
  free(qm), free(qv), free(rqm), free(rqv);
  return ok;
}

/* Each form this machine has, LZ_ADAMW8BIT_ISA selecting it; a form above
 * the machine's, or a name that is no form, is refused by the step and by
 * lz_adamw8bit_form, naming the best; then the machine's best again. */
LZ_TEST(adamw8bit_step_is_the_blockwise_reference) {
  unsetenv("LZ_ADAMW8BIT_ISA");
  const char *best = NULL, *form = NULL;
  CHECK(lz_adamw8bit_form(&best) == LZ_OK);
  int below = 1;
  for (size_t f = 0; f < sizeof forms / sizeof *forms; f++) {
    CHECK(setenv("LZ_ADAMW8BIT_ISA", forms[f], 1) == 0);
    if (below) {
      CHECK(lz_adamw8bit_form(&form) == LZ_OK && !strcmp(form, forms[f]));
      CHECK(step_is_the_blockwise_reference());
    } else {
      CHECK(lz_adamw8bit_form(&form) == LZ_ERR_INVALID);
      CHECK(strstr(lz_last_error(), "above this machine's best form") != NULL);
      CHECK(strstr(lz_last_error(), best) != NULL);
    }
    if (!strcmp(forms[f], best)) below = 0;
  }
  CHECK(setenv("LZ_ADAMW8BIT_ISA", "AVX-2", 1) == 0);
  CHECK(lz_adamw8bit_form(&form) == LZ_ERR_INVALID);
  CHECK(strstr(lz_last_error(), "LZ_ADAMW8BIT_ISA is 'AVX-2'; set it to base, avx2") != NULL);
  float p = 1, g = 1, m = 0, v = 0;
  const int64_t one[1] = {1};
  lz_tensor *tp = lz_test_wrap(&p, LZ_F32, 1, one), *tg = lz_test_wrap(&g, LZ_F32, 1, one);
  lz_tensor *tm = lz_test_wrap(&m, LZ_F32, 1, one), *tv = lz_test_wrap(&v, LZ_F32, 1, one);
  const lz_adamw_args args = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1,
                              .grad_scale = 1};
  CHECK(lz_adamw8bit_step(tp, tg, tm, tv, NULL, NULL, NULL, &args) == LZ_ERR_INVALID);
  CHECK(strstr(lz_last_error(), "adamw8bit_step: LZ_ADAMW8BIT_ISA is 'AVX-2'") != NULL);
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  unsetenv("LZ_ADAMW8BIT_ISA");
  CHECK(lz_adamw8bit_form(&form) == LZ_OK && !strcmp(form, best));
}

/* The steps of a map as the first z of each new index, magnitudes in
 * [2^-26, 1] of both signs (no two steps lie within 2^16 floats). */
static int steps_of(const lz_q8_map *map, float *at, int max) {
  int n = 0;
  for (uint32_t side = 0; side < 2; side++) {
    const uint32_t s = side << 31;
    for (uint32_t u = Q8_LO; u < Q8_ONE; u += 1u << 15) {
      const uint32_t e = u + (1u << 15) > Q8_ONE ? Q8_ONE : u + (1u << 15);
      const uint8_t hi = lz_q8_index(map, from_bits(s | e));
      if (lz_q8_index(map, from_bits(s | u)) == hi) continue;
      uint32_t lo = u, h = e; /* the first magnitude with e's index */
      while (h - lo > 1) {
        const uint32_t mid = lo + (h - lo) / 2;
        if (lz_q8_index(map, from_bits(s | mid)) == hi)
          h = mid;
        else
          lo = mid;
      }
      if (n < max) at[n++] = from_bits(s | h);
    }
  }
  return n;
}

/* lz_q8_div16's quotient is x / absmax or the float on its other side, so
 * the index it gives can differ from the true quotient's only where x /
 * absmax lies between a step and the float below it. Every such x (and its
 * neighbours) for each step of both maps, at absmaxes of 2,047 mantissas
 * (the all-ones one among them) scaled by powers of two from 2^-52 to 2^63,
 * through quantize (the permute quantiser, or the AVX2 one, which divides
 * the same way) against the scalar index of the true quotient. With a
 * stride of 1 (all 2^23 mantissas, minutes) the permute one passed too. */
static int recip_division_indices(lz_q8_quantize_fn quantize, int64_t mantissa_stride) {
  enum { MAXS = 600, PER = 7 };
  static float at[MAXS];
  int ok = 1;
  for (int sgn = 0; sgn < 2 && ok; sgn++) {
    const lz_q8_map *map = lz_q8_map_get(sgn);
    const int n_at = steps_of(map, at, MAXS);
    const int64_t len = ((int64_t)n_at * PER + 63) / 64 * 64;
    float *x = calloc((size_t)len, sizeof(float));
    uint8_t *q = malloc((size_t)len);
    const int scales[] = {0, -52, 63, -23, 41};
    for (int64_t m = 0; m < (1 << 23) && ok; m += mantissa_stride) {
      const uint32_t bm = m == 0 ? 0x7fffffu : (uint32_t)m;
      const float b = ldexpf(from_bits(0x3f800000u | bm), scales[(m / mantissa_stride) % 5]);
      int64_t k = 0;
      for (int t = 0; t < n_at; t++) {
        uint32_t c;
        const float cf = fabsf(at[t]) * b;
        memcpy(&c, &cf, sizeof c);
        for (int d = -4; d <= 2; d++) x[k++] = copysignf(from_bits(c + (uint32_t)d), at[t]);
      }
      CHECK(lz_q8_recip_ok(b));
      quantize(map, x, b, q, len);
      for (int64_t i = 0; i < len; i++) ok &= q[i] == lz_q8_index(map, x[i] / b);
    }
    free(x), free(q);
  }
  return ok;
}

LZ_TEST(quant8_reciprocal_division_keeps_every_step) {
  /* below 2^-25 the index does not depend on the sign (lz_q8_div16's claim) */
  for (int sgn = 0; sgn < 2; sgn++) {
    const lz_q8_map *map = lz_q8_map_get(sgn);
    const float tiny[] = {0.0f, 1e-45f, 0x1p-126f, 0x1p-27f, 0x1p-26f, 0x1.fffffep-26f};
    for (size_t i = 0; i < sizeof tiny / sizeof *tiny; i++)
      CHECK(lz_q8_index(map, tiny[i]) == lz_q8_index(map, 0.0f) &&
            lz_q8_index(map, -tiny[i]) == lz_q8_index(map, 0.0f));
  }
  int tried = 0;
  if (lz_q8_fast_ok(lz_q8_map_get(0)) && lz_q8_fast_ok(lz_q8_map_get(1))) {
    CHECK(recip_division_indices(lz_q8_quantize_fast, 4099));
    tried++;
  }
  if (lz_q8_quantizer_at(1) != lz_q8_quantizer_at(0)) { /* the AVX2 quantiser is there */
    CHECK(recip_division_indices(lz_q8_quantizer_at(1), 4099));
    tried++;
  }
  if (!tried) printf("  (no vector quantiser on this machine: the scalar one divides)\n");
}

/* The bf16 working copy the 8-bit step writes (in its pass over the blocks,
 * or after them) is lz_bf16_from_f32 of the new parameters bit for bit:
 * parameters of every bit pattern (NaN, infinities, subnormals, halfway
 * cases) kept by lr 0, then a step that moves them; in every form, with
 * groups of 64 parameters that hold a subnormal and groups that do not. */
static int working_copy_is_the_rounded_parameters(void) {
  const int64_t n = 2 * 16384 + 3 * 256 + 45, blocks = (n + 255) / 256, s1[1] = {n};
  const int64_t sb[1] = {blocks};
  float *p = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
  float *am = calloc((size_t)blocks, sizeof(float)), *av = calloc((size_t)blocks, sizeof(float));
  uint8_t *qm = calloc((size_t)n, 1), *qv = calloc((size_t)n, 1);
  uint16_t *w = malloc(sizeof(uint16_t) * n);
  for (int64_t i = 0; i < n; i++) {
    const uint64_t r = lz_test_xorshift(&rng);
    p[i] = from_bits((uint32_t)r);
    if (r % 7 == 0 && i / 1024 % 4 == 0) /* subnormal, in some groups of 64 only */
      p[i] = from_bits((uint32_t)(r >> 32) & 0x807fffffu);
    if (r % 11 == 0) p[i] = from_bits(((uint32_t)(r >> 32) & ~0xffffu) | 0x8000u); /* tie */
    g[i] = lz_test_uniform(&rng);
  }
  lz_tensor *tp = lz_test_wrap(p, LZ_F32, 1, s1), *tg = lz_test_wrap(g, LZ_F32, 1, s1);
  lz_tensor *tm = lz_test_wrap(qm, LZ_U8, 1, s1), *tv = lz_test_wrap(qv, LZ_U8, 1, s1);
  lz_tensor *tam = lz_test_wrap(am, LZ_F32, 1, sb), *tav = lz_test_wrap(av, LZ_F32, 1, sb);
  lz_tensor *tw = lz_test_wrap(w, LZ_BF16, 1, s1);
  lz_adamw_args a = {.lr = 0.0f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                     .weight_decay = 0.0f, .grad_scale = 1.0f, .step = 1};
  int ok = 1;
  for (; a.step <= 2; a.step++, a.lr = 1e-3f, a.weight_decay = 0.01f) {
    ok &= lz_adamw8bit_step(tp, tg, tm, tv, tam, tav, tw, &a) == LZ_OK;
    for (int64_t i = 0; i < n; i++) ok &= w[i] == lz_bf16_from_f32_inline(p[i]);
  }
  lz_tensor_free(tp), lz_tensor_free(tg), lz_tensor_free(tm), lz_tensor_free(tv);
  lz_tensor_free(tam), lz_tensor_free(tav), lz_tensor_free(tw);
  free(p), free(g), free(am), free(av), free(qm), free(qv), free(w);
  return ok;
}

LZ_TEST(adamw8bit_step_bf16_working_copy_is_the_rounded_parameters) {
  const char *best = NULL;
  unsetenv("LZ_ADAMW8BIT_ISA");
  CHECK(lz_adamw8bit_form(&best) == LZ_OK);
  for (size_t f = 0; f < sizeof forms / sizeof *forms; f++) { /* each form up to the machine's */
    CHECK(setenv("LZ_ADAMW8BIT_ISA", forms[f], 1) == 0);
    CHECK(working_copy_is_the_rounded_parameters());
    if (!strcmp(forms[f], best)) break;
  }
  unsetenv("LZ_ADAMW8BIT_ISA");
}
