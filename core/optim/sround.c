/* sround.c — lz_bf16_round_stochastic: fp32 to bf16, rounded up or down at
 * random in proportion to the distance (so unbiased), the random bits keyed
 * by (seed, step, global element index) (lz_sround.h). What bf16 master
 * weights round through instead of round-to-nearest, whose small updates
 * would vanish. A cpu kernel (sim runs it too; cuda/elementwise.cu draws
 * the same bits). */
#include <string.h> /* memcpy for the float's bits */

#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "optim/lz_sround.h"

/* One straight loop of 32-bit integer ops: the clones vectorize it. */
LZ_DISPATCH void lz_sround_block(uint16_t *restrict dst, const float *restrict src,
                                 lz_sround_key k, int64_t index, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = lz_sround_bf16(u, lz_sround_bits(k, index + i));
  }
}

lz_status lz_bf16_round_stochastic(lz_tensor *dst, const lz_tensor *src, uint64_t seed,
                                   uint64_t step, int64_t index) {
  const char *op = "bf16_round_stochastic";
  LZ_TRY(lz_check_present(op, "dst", dst));
  LZ_TRY(lz_check_present(op, "src", src));
  LZ_TRY(lz_check_numel(op, "dst", dst, lz_tensor_numel(src), "the element count of src"));
  if (index < 0)
    return lz_fail(LZ_ERR_INVALID, "%s: index is %lld; it must be >= 0 (the global index of "
                   "src's first element)", op, (long long)index);
  LZ_OP_RUN(op, LZ_OP_BF16_ROUND_STOCHASTIC, .t = {dst, (lz_tensor *)src},
            .i = {(int64_t)seed, (int64_t)step, index});
}

lz_status lz_cpu_bf16_round_stochastic(const lz_op_args *a) {
  uint16_t *dst = a->t[0]->data;
  const float *src = a->t[1]->data;
  const int64_t n = lz_tensor_numel(a->t[1]);
  const lz_sround_key k = lz_sround_key_of((uint64_t)a->i[0], (uint64_t)a->i[1]);
  const int64_t block = 1 << 16;
#pragma omp parallel for schedule(static) if (n > block)
  for (int64_t i0 = 0; i0 < n; i0 += block) {
    const int64_t len = n - i0 < block ? n - i0 : block;
    lz_sround_block(dst + i0, src + i0, k, a->i[2] + i0, len);
  }
  return LZ_OK;
}
