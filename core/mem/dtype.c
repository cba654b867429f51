/* dtype.c — dtypes by name and size, and the conversions of one value the
 * public API offers, all from mem/lz_dtype.h's one implementation. */
#include "mem/lz_internal.h"

static const size_t dtype_sizes[LZ_DTYPE_COUNT] = {4, 2, 2, 4, 2, 1};
static const char *dtype_names[LZ_DTYPE_COUNT] = {"f32", "bf16", "f16", "i32", "u16", "u8"};

size_t lz_dtype_size(lz_dtype dt) { return (unsigned)dt < LZ_DTYPE_COUNT ? dtype_sizes[dt] : 0; }
const char *lz_dtype_name(lz_dtype dt) {
  return (unsigned)dt < LZ_DTYPE_COUNT ? dtype_names[dt] : "unknown";
}

uint16_t lz_f32_to_bf16(float x) { return lz_bf16_from_f32_inline(x); }
float lz_bf16_to_f32(uint16_t x) { return lz_bf16_to_f32_inline(x); }
uint16_t lz_f32_to_f16(float x) { return lz_f16_from_f32_inline(x); }
float lz_f16_to_f32(uint16_t x) { return lz_f16_to_f32_inline(x); }

float lz_load_float(const void *data, lz_dtype dt, int64_t i) {
  switch (dt) {
    case LZ_F32:
      return ((const float *)data)[i];
    case LZ_BF16:
      return lz_bf16_to_f32_inline(((const uint16_t *)data)[i]);
    case LZ_F16:
      return lz_f16_to_f32_inline(((const uint16_t *)data)[i]);
    case LZ_I32:
      return (float)((const int32_t *)data)[i];
    case LZ_U16:
      return (float)((const uint16_t *)data)[i];
    case LZ_U8:
      return (float)((const uint8_t *)data)[i];
    default:
      return 0.0f;
  }
}
