/* lz_optim.h — what the fused optimizer steps (adamw.c, lion.c) share: the
 * checks of their tensors and scalars, and the one pass over the fp32 master
 * that updates it chunk by chunk and writes the working copy of each chunk
 * while it is still in L1. Not part of the public API. */
#ifndef LZ_OPTIM_H
#define LZ_OPTIM_H

#include "mem/lz_internal.h"

#include <immintrin.h> /* lz_optim_bf16x16 */

#ifdef __cplusplus
extern "C" {
#endif

/* States per element beside the parameter (AdamW: m, v; Lion: m). */
#define LZ_OPTIM_MAX_STATES 2

/* Updates n elements in place: the parameter p, the states s0 and s1 (s1 is
 * NULL for an optimizer of one state), from the gradient. `consts` is the
 * optimizer's own per-step scalars. Called once per chunk of at most a few
 * KiB, so mark it LZ_DISPATCH and keep it one straight loop. */
typedef void (*lz_optim_update_fn)(float *restrict p, const float *restrict grad,
                                   float *restrict s0, float *restrict s1, const void *consts,
                                   int64_t n);

/* An optimizer step's tensors: param, grad and the states f32 with param's
 * element count; working (may be NULL) f32, bf16 or f16 of the same count. */
typedef struct lz_optim_tensors {
  lz_tensor *param;
  const lz_tensor *grad;
  lz_tensor *states[LZ_OPTIM_MAX_STATES];
  const char *state_names[LZ_OPTIM_MAX_STATES];
  int n_states;
  lz_tensor *working;
} lz_optim_tensors;

/* The element-count checks (the dtypes are the declaration's, checked
 * first by the step's public op), each error naming op and the tensor,
 * e.g. "adamw_step: grad is f32[9] (9 elements), expected 8 elements (the
 * element count of param)". */
lz_status lz_optim_check_tensors(const char *op, const lz_optim_tensors *t);

/* What an args field may hold: finite and >= 0 (rates, decays, eps), in
 * [0, 1) (betas), finite (grad_scale). The error reads
 * "op: args->name is X; it must be ...". */
typedef enum lz_optim_range { LZ_OPTIM_NONNEG, LZ_OPTIM_UNIT, LZ_OPTIM_FINITE } lz_optim_range;
lz_status lz_optim_check_arg(const char *op, const char *name, float value, lz_optim_range range);

/* Writes n updated parameters into a working copy of dtype dt (f32, bf16,
 * f16), the fastest way this machine has. */
typedef void (*lz_optim_store_fn)(void *restrict w, const float *restrict p, int64_t n);
lz_optim_store_fn lz_optim_working_store(lz_dtype dt);

/* 16 floats at p as bf16, rounded as lz_bf16_from_f32_inline rounds them
 * (nearest even, NaN quieted; not vcvtneps2bf16, which flushes subnormals):
 * the working copy's vector rounding, for optim_pass.c's store and the
 * 8-bit step's. Inlined into AVX-512 code only. */
static inline __attribute__((always_inline, target("avx512f"))) __m256i
lz_optim_bf16x16(const float *p) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(p)), top = _mm512_srli_epi32(u, 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_or_epi32(r, nan, top, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

/* The pass, checks done and the tensors on the cpu: chunks of the element
 * range, spread over threads in contiguous static ranges, each updated by
 * `update` and then, where working is given, converted into it. */
void lz_optim_run(const lz_optim_tensors *t, lz_optim_update_fn update, const void *consts);

#ifdef __cplusplus
}
#endif

#endif /* LZ_OPTIM_H */
