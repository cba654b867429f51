/* test_quant8_states.c — the 8-bit states as fp32 values and back
 * (core/optim/quant8_states.c): blocks quantised as the 8-bit update
 * quantises them (absmax the largest magnitude, bitsandbytes' index)
 * dequantise to values that requantise to the same values bit for bit,
 * whatever the block holds (negative largest magnitudes, zeros, denormals,
 * huge values); values that no dequantisation gave are quantised as the
 * update does. */
#include "lz_test.h"
#include "optim/lz_quant8.h"

#include <stdlib.h> /* malloc */

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static lz_tensor *wrap(void *data, lz_dtype dt, int64_t n) {
  lz_tensor *t = NULL;
  const int64_t shape[1] = {n};
  lz_tensor_wrap(&t, data, dt, 1, shape);
  return t;
}

/* A block of the kind b (0..5) of values the update's m or v could hold. */
static void fill(float *x, int64_t n, int kind, int is_signed) {
  const float scale[] = {1.0f, 3e-3f, 1e-36f, 2e30f, 0.0f, 1.0f};
  for (int64_t i = 0; i < n; i++) {
    float v = lz_test_uniform(&rng) * scale[kind];
    if (kind == 5 && i % 3 == 0) v = 0.0f;
    x[i] = is_signed ? v : fabsf(v);
  }
  if (kind == 1 && is_signed) x[n / 2] = -2 * 3e-3f; /* the largest magnitude negative */
}

LZ_TEST(quant8_states_requantize_gives_dequantized_values_back) {
  const int64_t B = LZ_ADAMW8BIT_BLOCK, nb = 6, n = B * nb - 45;
  float *x = malloc(sizeof(float) * (size_t)n), *d = malloc(sizeof(float) * (size_t)n);
  float *d2 = malloc(sizeof(float) * (size_t)n);
  uint8_t *q = malloc((size_t)n), *q2 = malloc((size_t)n);
  float am[6], am2[6];
  lz_tensor *tx = wrap(x, LZ_F32, n), *td = wrap(d, LZ_F32, n), *td2 = wrap(d2, LZ_F32, n);
  lz_tensor *tq = wrap(q, LZ_U8, n), *tq2 = wrap(q2, LZ_U8, n);
  lz_tensor *tam = wrap(am, LZ_F32, nb), *tam2 = wrap(am2, LZ_F32, nb);
  const lz_q8_quantize_fn quantize = lz_q8_quantizer();
  int exact = 1, as_update = 1;
  for (int rep = 0; rep < 50; rep++) {
    for (int sgn = 0; sgn < 2; sgn++) {
      const lz_q8_map *map = lz_q8_map_get(sgn);
      for (int64_t b = 0; b < nb; b++) {
        const int64_t len = b == nb - 1 ? n - b * B : B;
        fill(x + b * B, len, (int)((b + rep) % 6), sgn);
        float mx = 0.0f;
        for (int64_t i = 0; i < len; i++) mx = fabsf(x[b * B + i]) > mx ? fabsf(x[b * B + i]) : mx;
        am[b] = mx;
        quantize(map, x + b * B, mx, q + b * B, len);
      }
      CHECK_OK(lz_adamw8bit_dequantize(tq, tam, sgn, td));
      CHECK_OK(lz_adamw8bit_requantize(td, sgn, tq2, tam2));
      CHECK_OK(lz_adamw8bit_dequantize(tq2, tam2, sgn, td2));
      exact &= memcmp(d, d2, sizeof(float) * (size_t)n) == 0;
      /* The raw values (no dequantisation gave them): the update's own
       * quantisation, absmax the largest magnitude; a block of zeros is
       * exact (zeros keep their sign, where the update's 0 / 0 stores the
       * signed map's -0). */
      CHECK_OK(lz_adamw8bit_requantize(tx, sgn, tq2, tam2));
      CHECK_OK(lz_adamw8bit_dequantize(tq2, tam2, sgn, td2));
      as_update &= memcmp(am, am2, sizeof am) == 0;
      for (int64_t i = 0; i < n; i++)
        as_update &= memcmp(d2 + i, am[i / B] == 0.0f ? x + i : d + i, sizeof(float)) == 0;
    }
  }
  CHECK(exact);
  CHECK(as_update);
  /* Wrong dtypes and sizes are refused. */
  CHECK(lz_adamw8bit_requantize(tq, 1, tq2, tam2) == LZ_ERR_INVALID);
  lz_tensor *short_am = wrap(am, LZ_F32, nb - 1);
  CHECK(lz_adamw8bit_dequantize(tq, short_am, 1, td) == LZ_ERR_INVALID);
  lz_tensor *all[] = {tx, td, td2, tq, tq2, tam, tam2, short_am};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) lz_tensor_free(all[i]);
  free(x), free(d), free(d2), free(q), free(q2);
}
