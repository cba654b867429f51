/* copy.c — lz_tensor_copy: the same dtype or a conversion between f32, bf16
 * and f16 on the cpu, and the switch to the device copies (mem/dispatch.c) when
 * a device tensor is on either side. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

LZ_DISPATCH static void f32_to_bf16_block(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_from_f32_inline(src[i]);
}

LZ_DISPATCH static void bf16_to_f32_block(float *dst, const uint16_t *src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_to_f32_inline(src[i]);
}

static int is_float(lz_dtype dt) { return dt == LZ_F32 || dt == LZ_BF16 || dt == LZ_F16; }

lz_status lz_tensor_copy(lz_tensor *dst, const lz_tensor *src) {
  LZ_TRY(lz_check_present("tensor_copy", "dst", dst));
  LZ_TRY(lz_check_present("tensor_copy", "src", src));
  int64_t n = lz_tensor_numel(src);
  LZ_TRY(lz_check_numel("tensor_copy", "dst", dst, n, "the element count of src"));
  if ((dst->dtype != src->dtype) && (!is_float(dst->dtype) || !is_float(src->dtype))) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID,
                   "tensor_copy: cannot convert %s into %s; conversions are between f32, bf16 "
                   "and f16 only",
                   lz_tensor_describe(src, a, sizeof a), lz_tensor_describe(dst, b, sizeof b));
  }
  if (dst->device != LZ_CPU || src->device != LZ_CPU) return lz_tensor_copy_device(dst, src);
  LZ_OP_RUN("tensor_copy", LZ_OP_CONVERT, .t = {dst, (lz_tensor *)src});
}

/* The cpu kernel of the op (also sim's conversions on its device). */
lz_status lz_cpu_tensor_copy(const lz_op_args *a) {
  lz_tensor *dst = a->t[0];
  const lz_tensor *src = a->t[1];
  const int64_t n = lz_tensor_numel(src);
  if (dst->dtype == src->dtype) {
    if (dst->data != src->data) memmove(dst->data, src->data, lz_tensor_bytes(src));
    return LZ_OK;
  }
  const int64_t block = 1 << 16;
#pragma omp parallel for schedule(static) if (n > block)
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    int64_t len = n - i0 < block ? n - i0 : block;
    if (src->dtype == LZ_F32 && dst->dtype == LZ_BF16) {
      f32_to_bf16_block((uint16_t *)dst->data + i0, (const float *)src->data + i0, len);
    } else if (src->dtype == LZ_BF16 && dst->dtype == LZ_F32) {
      bf16_to_f32_block((float *)dst->data + i0, (const uint16_t *)src->data + i0, len);
    } else {
      for (int64_t i = i0; i < i0 + len; i++) {
        float v = lz_load_float(src->data, src->dtype, i);
        if (dst->dtype == LZ_F32) ((float *)dst->data)[i] = v;
        else if (dst->dtype == LZ_BF16) ((uint16_t *)dst->data)[i] = lz_bf16_from_f32_inline(v);
        else ((uint16_t *)dst->data)[i] = lz_f32_to_f16(v);
      }
    }
  }
  return LZ_OK;
}
