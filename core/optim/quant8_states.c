/* quant8_states.c — the 8-bit AdamW states as fp32 values and back, for
 * checkpoints and state conversions (host memory). A checkpoint holds each
 * element of a u8 state as the value the update reads for it, map[q] times
 * its block's absmax: the number the state means, which converts to f32 or
 * bf16 states as it stands. Requantising finds, block by block, an absmax
 * and indices that give those values back bit for bit when they came from a
 * dequantisation (the update then computes the same bits, whatever the
 * indices were); values from elsewhere (fp32 states converted to 8-bit) are
 * quantised as the update quantises: absmax the largest magnitude, indices
 * bitsandbytes' quantiser picks (optim/quant8.c). */
#include "mem/lz_backend.h"
#include "optim/lz_quant8.h"

#include <math.h>   /* fabsf, isfinite, isnormal, nextafterf */
#include <string.h> /* memcpy: comparing bits */

static int same_bits(float a, float b) {
  uint32_t x, y;
  memcpy(&x, &a, 4), memcpy(&y, &b, 4);
  return x == y;
}

/* An index whose map value times am has d's bits, or -1: a normal d lies
 * within an ulp or two of its entry times am, so usually within four
 * entries of the quantiser's choice for d / am; else (entries the
 * quantiser never picks, zeros of either sign, subnormals where several
 * entries round alike, infinities, NaN) every entry is looked at. */
static int index_of(const lz_q8_map *map, float am, float d) {
  if (isnormal(d) && isnormal(am)) {
    const int g = lz_q8_index(map, d / am);
    for (int k = g - 4; k <= g + 4; k++)
      if (k >= 0 && k < 256 && same_bits(map->values[k] * am, d)) return k;
  }
  for (int k = 0; k < 256; k++)
    if (same_bits(map->values[k] * am, d)) return k;
  return -1;
}

static int exact_block(const lz_q8_map *map, const float *x, int64_t n, float am, uint8_t *q) {
  for (int64_t i = 0; i < n; i++) {
    const int k = index_of(map, am, x[i]);
    if (k < 0) return 0;
    q[i] = (uint8_t)k;
  }
  return 1;
}

/* One block: the absmax a dequantisation used is its largest magnitude
 * where that element was stored as +-1.0, else that magnitude over the
 * magnitude of its map entry: the update stores a block's largest element
 * as the map's entry of largest magnitude of its sign, -0.99296875 for a
 * negative one in the signed map (it has no -1.0); the fp32 quotients
 * around it are tried, then the update's own quantisation. */
static void requantize_block(const lz_q8_map *map, lz_q8_quantize_fn quantize, const float *x,
                             int64_t n, uint8_t *q, float *absmax) {
  float mx = 0.0f, top = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const float a = fabsf(x[i]);
    if (a > mx) mx = a, top = x[i];
  }
  if (exact_block(map, x, n, mx, q)) {
    *absmax = mx;
    return;
  }
  float c = 0.0f; /* the largest magnitude below 1 of top's sign */
  for (int k = 0; k < 256; k++) {
    const float e = map->values[k];
    if ((e < 0.0f) == (top < 0.0f) && fabsf(e) < 1.0f && fabsf(e) > c) c = fabsf(e);
  }
  if (c > 0.0f && isfinite(mx)) {
    float am = nextafterf(nextafterf(mx / c, 0.0f), 0.0f);
    for (int t = 0; t < 5; t++, am = nextafterf(am, INFINITY)) {
      if (exact_block(map, x, n, am, q)) {
        *absmax = am;
        return;
      }
    }
  }
  *absmax = mx;
  quantize(map, x, mx, q, n);
}

static lz_status check_pair(const char *op, const lz_tensor *q, const lz_tensor *absmax,
                            const lz_tensor *x) {
  if (!q || !absmax || !x) return lz_fail(LZ_ERR_INVALID, "%s: a tensor is NULL", op);
  if (q->dtype != LZ_U8 || absmax->dtype != LZ_F32 || x->dtype != LZ_F32)
    return lz_fail(LZ_ERR_INVALID, "%s: q must be u8, absmax and values f32 (got %s, %s, %s)",
                   op, lz_dtype_name(q->dtype), lz_dtype_name(absmax->dtype),
                   lz_dtype_name(x->dtype));
  if (q->device != LZ_CPU || absmax->device != LZ_CPU || x->device != LZ_CPU)
    return lz_fail(LZ_ERR_INVALID, "%s: the tensors must be in host memory (copy them there)",
                   op);
  LZ_TRY(lz_check_numel(op, "values", x, lz_tensor_numel(q), "one per element of q"));
  return lz_check_numel(op, "absmax", absmax, lz_adamw8bit_blocks(lz_tensor_numel(q)),
                        "one per 256 elements of q");
}

lz_status lz_adamw8bit_dequantize(const lz_tensor *q, const lz_tensor *absmax, int is_signed,
                                  lz_tensor *out) {
  LZ_TRY(check_pair("adamw8bit_dequantize", q, absmax, out));
  const float *map = lz_q8_map_get(is_signed)->values;
  const uint8_t *qd = q->data;
  const float *am = absmax->data;
  float *o = out->data;
  const int64_t n = lz_tensor_numel(q);
  for (int64_t i = 0; i < n; i++) o[i] = map[qd[i]] * am[i / LZ_ADAMW8BIT_BLOCK];
  return LZ_OK;
}

lz_status lz_adamw8bit_requantize(const lz_tensor *x, int is_signed, lz_tensor *q,
                                  lz_tensor *absmax) {
  LZ_TRY(check_pair("adamw8bit_requantize", q, absmax, x));
  const lz_q8_map *map = lz_q8_map_get(is_signed);
  const lz_q8_quantize_fn quantize = lz_q8_quantizer();
  const int64_t n = lz_tensor_numel(q), B = LZ_ADAMW8BIT_BLOCK;
  const float *xd = x->data;
  uint8_t *qd = q->data;
  float *am = absmax->data;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i0 = 0; i0 < n; i0 += B)
    requantize_block(map, quantize, xd + i0, n - i0 < B ? n - i0 : B, qd + i0, am + i0 / B);
  return LZ_OK;
}
