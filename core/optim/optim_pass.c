/* optim_pass.c — the pass the fused optimizer steps share (lz_optim.h): the
 * checks of their tensors and scalars, and one sweep over the fp32 master in
 * chunks. Each chunk is updated by the optimizer's own loop and then, still
 * in L1, converted into the working copy: memory sees each element once, as
 * in a single loop, while the update and the conversion each stay a straight
 * vectorizable loop. */
#include "optim/lz_optim.h"

#include <immintrin.h> /* F16C's vcvtps2ph for the f16 working copy */
#include <math.h>      /* isinf, isfinite */
#include <string.h>    /* memcpy for the f32 working copy */

/* Elements per chunk: 4 KiB per fp32 stream, so AdamW's four streams and the
 * chunk just written stay in L1 for the conversion. */
#define CHUNK 1024
/* Up to this many elements the step runs on the calling thread. */
#define SERIAL_MAX (1 << 14)

lz_status lz_optim_check_tensors(const char *op, const lz_optim_tensors *t) {
  const char *why = "the element count of param";
  LZ_TRY(lz_check_present(op, "param", t->param));
  const int64_t n = lz_tensor_numel(t->param);
  LZ_TRY(lz_check_numel(op, "grad", t->grad, n, why));
  for (int s = 0; s < t->n_states; s++)
    LZ_TRY(lz_check_numel(op, t->state_names[s], t->states[s], n, why));
  if (t->working) LZ_TRY(lz_check_numel(op, "working", t->working, n, why));
  return LZ_OK;
}

lz_status lz_optim_check_arg(const char *op, const char *name, float value, lz_optim_range range) {
  int ok;
  const char *must;
  switch (range) {
    case LZ_OPTIM_NONNEG:
      ok = value >= 0.0f && !isinf(value), must = "finite and >= 0";
      break;
    case LZ_OPTIM_UNIT:
      ok = value >= 0.0f && value < 1.0f, must = "in [0, 1)";
      break;
    default:
      ok = isfinite(value), must = "finite";
      break;
  }
  if (ok) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID, "%s: args->%s is %g; it must be %s", op, name, (double)value,
                 must);
}

/* ------------------------------------------------------------ working copy */

static void store_f32(void *restrict w, const float *restrict p, int64_t n) {
  memcpy(w, p, sizeof(float) * (size_t)n);
}

/* The bf16 rounding is integer ops that vectorize. */
LZ_DISPATCH static void store_bf16(void *restrict w, const float *restrict p, int64_t n) {
  uint16_t *h = w;
  for (int64_t i = 0; i < n; i++) h[i] = lz_bf16_from_f32_inline(p[i]);
}

/* AVX-512: the same rounding on 16 lanes (lz_optim_bf16x16), and streaming
 * stores: the working copy is read again only by the next forward, long
 * after it has left the cache, so its lines are written without first being
 * read (a plain store reads each line before writing it: 2 of the 32 bytes
 * AdamW moves a parameter). The fence orders the streamed lines before
 * whatever reads them next. */
__attribute__((target("avx512f,avx512bw"))) static void store_bf16_avx512(void *restrict w,
                                                                          const float *restrict p,
                                                                          int64_t n) {
  uint16_t *h = w;
  int64_t i = 0;
  for (; i < n && ((uintptr_t)(h + i) & 31); i++) h[i] = lz_bf16_from_f32_inline(p[i]);
  for (; i + 16 <= n; i += 16) _mm256_stream_si256((__m256i *)(h + i), lz_optim_bf16x16(p + i));
  for (; i < n; i++) h[i] = lz_bf16_from_f32_inline(p[i]);
  _mm_sfence();
}

/* On machines without F16C: the branch-free routine, bitwise lz_f32_to_f16. */
LZ_DISPATCH static void store_f16(void *restrict w, const float *restrict p, int64_t n) {
  uint16_t *h = w;
  for (int64_t i = 0; i < n; i++) h[i] = lz_f16_from_f32_inline(p[i]);
}

/* The hardware conversion (vcvtps2ph, round to nearest even: the same bits
 * as lz_f32_to_f16) costs a third of the integer one. target_clones' "avx2"
 * does not imply F16C, hence functions of their own. */
__attribute__((target("avx512f"))) static void store_f16_avx512(void *restrict w,
                                                                const float *restrict p,
                                                                int64_t n) {
  uint16_t *h = w;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i v = _mm512_cvtps_ph(_mm512_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i *)(h + i), v);
  }
  for (; i < n; i++) h[i] = lz_f16_from_f32_inline(p[i]);
}

__attribute__((target("avx2,f16c"))) static void store_f16_avx2(void *restrict w,
                                                                const float *restrict p,
                                                                int64_t n) {
  uint16_t *h = w;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i v = _mm256_cvtps_ph(_mm256_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i *)(h + i), v);
  }
  for (; i < n; i++) h[i] = lz_f16_from_f32_inline(p[i]);
}

lz_optim_store_fn lz_optim_working_store(lz_dtype dt) {
  if (dt == LZ_F32) return store_f32;
  __builtin_cpu_init();
  if (dt == LZ_BF16)
    return __builtin_cpu_supports("avx512bw") ? store_bf16_avx512 : store_bf16;
  if (__builtin_cpu_supports("avx512f")) return store_f16_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return store_f16_avx2;
  return store_f16;
}

/* -------------------------------------------------------------------- pass */

void lz_optim_run(const lz_optim_tensors *t, lz_optim_update_fn update, const void *consts) {
  const int64_t n = lz_tensor_numel(t->param);
  float *p = t->param->data, *s0 = t->states[0]->data;
  float *s1 = t->n_states > 1 ? t->states[1]->data : NULL;
  const float *g = t->grad->data;
  char *w = t->working ? t->working->data : NULL;
  const lz_optim_store_fn store = w ? lz_optim_working_store(t->working->dtype) : NULL;
  const size_t wsize = w ? lz_dtype_size(t->working->dtype) : 0;
#pragma omp parallel for schedule(static) if (n > SERIAL_MAX)
  for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
    const int64_t len = n - i0 < CHUNK ? n - i0 : CHUNK;
    update(p + i0, g + i0, s0 + i0, s1 ? s1 + i0 : NULL, consts, len);
    if (store) store(w + (size_t)i0 * wsize, p + i0, len);
  }
}
