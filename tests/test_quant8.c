/* test_quant8.c — the block-wise 8-bit code's quantiser (core/optim/quant8.c):
 * the choices bitsandbytes 0.50.2's CPU library makes where they are not the
 * nearest map entry, a non-decreasing index, NaN to 0, and the vector form
 * this machine runs equal to the scalar one on every kind of value.
 * tests/ref/test5_adam8bit.py compares with bitsandbytes itself. */
#include "lz_test.h"
#include "optim/lz_quant8.h"

#include <stdlib.h> /* malloc */

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

/* The vector quantiser against the scalar index, x / absmax, on random
 * values, zeros, NaN, denormals and values a float apart, at several
 * absmaxes (0, tiny, huge, inf included). */
LZ_TEST(quant8_vector_form_is_the_scalar_one) {
  const int64_t n = 256;
  float *x = malloc(sizeof(float) * n);
  uint8_t *q = malloc((size_t)n);
  const lz_q8_quantize_fn quantize = lz_q8_quantizer();
  const float absmaxes[] = {1.0f, 0.0f, 3.7e-3f, 1e-38f, 1e-44f, 3e38f, INFINITY};
  int ok = 1;
  for (int rep = 0; rep < 400; rep++) {
    for (int sgn = 0; sgn < 2; sgn++) {
      const lz_q8_map *map = lz_q8_map_get(sgn);
      const float am = absmaxes[rep % 7];
      for (int64_t i = 0; i < n; i++) {
        const uint64_t r = lz_test_xorshift(&rng);
        float v = lz_test_uniform(&rng) * am;
        if (r % 13 == 0) v = 0.0f;
        if (r % 17 == 0) v = from_bits((uint32_t)(r >> 32) & 0x807fffffu); /* denormal */
        if (r % 19 == 0) v = nanf("");
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
