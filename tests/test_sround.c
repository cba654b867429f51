/* test_sround.c — lz_bf16_round_stochastic: unbiased (the mean error over
 * 1e6 draws within 3 sigma of 0), every result one of the two bf16
 * neighbours, the bits a function of (seed, step, global index) alone
 * (reproducible, the same for any split, different for another seed or
 * step), the hash as specified (an independent scalar transcription),
 * NaN / infinity / zero / exact values, and the argument errors. */
#include "lz_test.h"

#include <stdlib.h> /* malloc */
#include <string.h> /* memcpy, memcmp */

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static double bf16_value(uint16_t h) { return (double)f32_of((uint32_t)h << 16); }

/* The specification (core/luazero.h, core/optim/lz_sround.h), written out. */
static uint64_t ref_mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint32_t ref_lowbias32(uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  return x;
}
static uint16_t ref_round(float f, uint64_t seed, uint64_t step, int64_t index) {
  const uint64_t key = ref_mix64(seed ^ ref_mix64(step));
  const uint64_t j = (uint64_t)index;
  const uint32_t h = ref_lowbias32(ref_lowbias32((uint32_t)j ^ (uint32_t)key) ^
                                   (uint32_t)(j >> 32) ^ (uint32_t)(key >> 32));
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + (h >> 16)) >> 16);
}

static lz_status round_n(uint16_t *dst, const float *src, int64_t n, uint64_t seed,
                         uint64_t step, int64_t index) {
  const int64_t s[1] = {n};
  lz_tensor *td = lz_test_wrap(dst, LZ_BF16, 1, s), *ts = lz_test_wrap((void *)src, LZ_F32, 1, s);
  lz_status st = lz_bf16_round_stochastic(td, ts, seed, step, index);
  lz_tensor_free(td), lz_tensor_free(ts);
  return st;
}

LZ_TEST(sround_unbiased_over_a_million_draws) {
  const int64_t n = 1000000;
  float *x = malloc(sizeof(float) * (size_t)n);
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
  /* A third of the way, most of the way, a sliver, negative, a denormal. */
  const float values[] = {1.0f + 1.0f / 3.0f, -2.7182817f, 0.1f, 1.0f + 0x1p-20f, 3.0e-39f};
  for (size_t v = 0; v < sizeof values / sizeof values[0]; v++) {
    const float f = values[v];
    for (int64_t i = 0; i < n; i++) x[i] = f;
    CHECK_OK(round_n(h, x, n, 20251205, 7, 123456789));
    const uint16_t lo = (uint16_t)(bits_of(f) >> 16), hi = (uint16_t)(lo + 1);
    const double down = bf16_value(lo), up = bf16_value(hi);
    const double p = ((double)f - down) / (up - down); /* the chance of rounding up */
    double sum = 0;
    int64_t ups = 0, others = 0;
    for (int64_t i = 0; i < n; i++) {
      if (h[i] == hi) ups++;
      else if (h[i] != lo) others++;
      sum += bf16_value(h[i]) - (double)f;
    }
    CHECK_EQ_INT(others, 0);
    const double mean = sum / (double)n;
    const double sigma = fabs(up - down) * sqrt(p * (1 - p) / (double)n);
    if (!(fabs(mean) <= 3 * sigma))
      lz_test_fail(__FILE__, __LINE__, "value %.9g: mean error %.3g, 3 sigma %.3g", (double)f,
                   mean, 3 * sigma);
    CHECK(fabs((double)ups / (double)n - p) <= 3 * sqrt(p * (1 - p) / (double)n));
  }
  free(x), free(h);
}

LZ_TEST(sround_bits_are_keyed_by_seed_step_and_index) {
  const int64_t n = 100003;
  float *x = malloc(sizeof(float) * (size_t)n);
  uint16_t *a = malloc(2 * (size_t)n), *b = malloc(2 * (size_t)n);
  uint64_t rng = 5;
  for (int64_t i = 0; i < n; i++) x[i] = lz_test_uniform(&rng) * 100.0f;
  CHECK_OK(round_n(a, x, n, 42, 3, 1000));
  /* Reproducible, and the same for any split of the elements. */
  CHECK_OK(round_n(b, x, n, 42, 3, 1000));
  CHECK(memcmp(a, b, 2 * (size_t)n) == 0);
  memset(b, 0, 2 * (size_t)n);
  CHECK_OK(round_n(b, x, 777, 42, 3, 1000));
  CHECK_OK(round_n(b + 777, x + 777, n - 777, 42, 3, 1000 + 777));
  CHECK(memcmp(a, b, 2 * (size_t)n) == 0);
  /* The specification's bits, whichever clone ran. */
  int64_t off_spec = 0;
  for (int64_t i = 0; i < n; i++) off_spec += a[i] != ref_round(x[i], 42, 3, 1000 + i);
  CHECK_EQ_INT(off_spec, 0);
  /* Another seed, step or index: other draws. Two independent draws of a
   * value rounded up with chance p differ with chance 2p(1 - p), 1/3 on
   * average over uniform p. */
  const uint64_t keys[3][2] = {{43, 3}, {42, 4}, {42, 3}};
  const int64_t index[3] = {1000, 1000, 1001};
  for (int k = 0; k < 3; k++) {
    CHECK_OK(round_n(b, x, n, keys[k][0], keys[k][1], index[k]));
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += a[i] != b[i];
    CHECK(differ > n * 3 / 10 && differ < n * 11 / 30);
  }
  /* A global index past 2^32 keys on its high word too. */
  CHECK_OK(round_n(b, x, 1000, 42, 3, (1ll << 32) + 1000));
  int64_t differ = 0;
  for (int64_t i = 0; i < 1000; i++) differ += a[i] != b[i];
  CHECK(differ > 250 && differ < 420);
  free(x), free(a), free(b);
}

LZ_TEST(sround_special_values) {
  const float inf = f32_of(0x7f800000u), nan = f32_of(0x7f800001u); /* a signalling NaN */
  float x[8] = {0.0f, -0.0f, 1.5f, -3.0f, inf, -inf, nan, f32_of(0x7f7fffffu)};
  uint16_t h[8];
  for (uint64_t seed = 0; seed < 64; seed++) {
    CHECK_OK(round_n(h, x, 8, seed, 1, 0));
    CHECK(h[0] == 0x0000 && h[1] == 0x8000); /* zeros keep their sign */
    CHECK(h[2] == 0x3fc0 && h[3] == 0xc040); /* bf16 values are kept exactly */
    CHECK(h[4] == 0x7f80 && h[5] == 0xff80); /* infinities stay */
    CHECK(h[6] == 0x7fc0);                   /* NaN: a quiet NaN, never infinity */
    CHECK(h[7] == 0x7f7f || h[7] == 0x7f80); /* the largest float: down, or up to infinity */
  }
}

LZ_TEST(sround_argument_errors) {
  const int64_t s4[1] = {4}, s5[1] = {5};
  float x[5] = {0};
  uint16_t h[5];
  lz_tensor *t32 = lz_test_wrap(x, LZ_F32, 1, s4), *t16 = lz_test_wrap(h, LZ_BF16, 1, s4);
  lz_tensor *t16_5 = lz_test_wrap(h, LZ_BF16, 1, s5);
  CHECK_ERR(lz_bf16_round_stochastic(t32, t32, 1, 1, 0), LZ_ERR_INVALID, "dst is f32");
  CHECK_ERR(lz_bf16_round_stochastic(t16_5, t32, 1, 1, 0), LZ_ERR_INVALID, "dst");
  CHECK_ERR(lz_bf16_round_stochastic(t16, t32, 1, 1, -1), LZ_ERR_INVALID, "index is -1");
  CHECK_ERR(lz_bf16_round_stochastic(t16, NULL, 1, 1, 0), LZ_ERR_INVALID, "src");
  lz_tensor_free(t32), lz_tensor_free(t16), lz_tensor_free(t16_5);
}
