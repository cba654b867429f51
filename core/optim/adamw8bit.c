/* adamw8bit.c — fused 8-bit AdamW, bitsandbytes' AdamW8bit/Adam8bit scheme:
 * m and v are one byte per element, each an index into a 256-entry map (m:
 * the signed dynamic map, v: the unsigned one) times the absmax of its block
 * of LZ_ADAMW8BIT_BLOCK elements. One pass per block dequantises, updates
 * param, m and v in fp32, writes the working copy, and requantises each
 * element to the index bitsandbytes 0.50.2's CPU quantiser picks
 * (optim/quant8.c). States, absmaxes and parameters are its bits
 * (tests/ref/test5_adam8bit.py). bitsandbytes keeps tensors under its
 * min_8bit_size in fp32; the same op with f32 m, v runs that update (a different arrangement of the
 * AdamW formula from adamw.c's, hence its own path).
 *
 * The arithmetic is bitsandbytes' CPU update op for op, in torch's
 * roundings: its `add_(x, alpha)` and `addcmul_` are fused multiply-adds in
 * torch's vector code, its `addcdiv_` and divisions are not:
 *   m  = fma(g, 1 - b1, m b1)          v = fma((1 - b2) g, g, v b2)
 *   8-bit:  p = p (1 - lr wd) + ((-lr / c1) m) / (sqrt(v) / c2 + eps)
 *   fp32:   p = fma(m / (sqrt(v) + eps c2), -lr c2 / c1, p (1 - lr wd))
 * with c1 = 1 - b1^t, c2 = sqrt(1 - b2^t), g = grad * grad_scale.
 *
 * Speed: the divisions, the square root and the quantiser's cell lookups
 * are the cost (the memory moved is 16 bytes per element against fp32
 * AdamW's 28). Where AVX-512 VBMI is there the map values come from byte
 * permutes instead of gathers, and whole blocks are software-pipelined
 * (blocks8_pipeline) so the quantiser's lookups overlap the next block's
 * divisions; with VBMI2 the quantiser's lookups are byte permutes too and
 * its x / absmax a corrected product (blocks8_fast, lz_q8_quantize128), and
 * the bf16 working copy is written in the same pass, by vcvtne2ps2bf16 where
 * AVX512-BF16 is there (blocks8_bf16). With AVX2 alone the map values come
 * from scalar loads (faster than gathers on Zen 3) and the quantiser's
 * x / absmax is the same corrected product. LZ_ADAMW8BIT_ISA forces a lower form;
 * docs/optimizers.md says where the cycles go. */
#include "mem/lz_backend.h"
#include "optim/lz_optim.h"
#include "optim/lz_quant8.h"
#include "optim/lz_sround.h"

#include <immintrin.h> /* the vector forms of the block update */
#include <math.h>      /* fmaf, sqrtf, fabsf, pow, sqrt */
#include <stdlib.h>    /* getenv: LZ_ADAMW8BIT_ISA */
#include <string.h>    /* memcpy: a bf16's bits; strcmp */

/* Per-step scalars, worked out once in double as bitsandbytes does in
 * Python, each rounded to fp32 where torch takes it as an operand. */
typedef struct {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float decay;    /* 1 - lr wd; 1 without weight decay (p * 1 is p) */
  float neg_step; /* 8-bit: -lr / c1;  fp32: -lr c2 / c1 */
  float c2;       /* 8-bit: sqrt(1 - b2^t) */
  float eps;      /* 8-bit: eps;  fp32: eps c2 */
  float grad_scale;
  const lz_q8_map *map_m, *map_v; /* the signed and the unsigned map */
  lz_q8_quantize_fn quantize;
} a8_consts;

/* One block (n <= LZ_ADAMW8BIT_BLOCK) of the 8-bit update: dequantise,
 * update, then requantise against the block's new absmax (from 0, skipping
 * NaN as fmaxf does: a block of NaN keeps absmax 0, as bitsandbytes' does).
 * fmaf is the one contraction allowed: the rest is rounded op by op, as
 * torch's is. The vector forms below are this loop 16 or 8 lanes at a time,
 * then it for the rest (from `from`); their max_ps keeps its second operand
 * when one is NaN, the same rule. */
static inline __attribute__((always_inline)) void block8_rest(
    float *restrict p, const float *restrict grad, const uint8_t *restrict qm,
    const uint8_t *restrict qv, float am, float av, const a8_consts *k, int64_t from, int64_t n,
    float *restrict m, float *restrict v, float *max_m, float *max_v) {
  for (int64_t i = from; i < n; i++) {
    const float g = grad[i] * k->grad_scale;
    const float mi = fmaf(g, k->one_minus_beta1, k->map_m->values[qm[i]] * am * k->beta1);
    const float vi = fmaf(k->one_minus_beta2 * g, g, k->map_v->values[qv[i]] * av * k->beta2);
    const float denom = sqrtf(vi) / k->c2 + k->eps;
    p[i] = p[i] * k->decay + k->neg_step * mi / denom;
    m[i] = mi, v[i] = vi;
    const float am_i = fabsf(mi), av_i = fabsf(vi);
    *max_m = am_i > *max_m ? am_i : *max_m, *max_v = av_i > *max_v ? av_i : *max_v;
  }
}

static inline __attribute__((always_inline)) void block8_finish(
    uint8_t *restrict qm, uint8_t *restrict qv, float *restrict absmax_m, float *restrict absmax_v,
    const a8_consts *k, int64_t n, const float *m, const float *v, float max_m, float max_v) {
  *absmax_m = max_m, *absmax_v = max_v;
  k->quantize(k->map_m, m, max_m, qm, n);
  k->quantize(k->map_v, v, max_v, qv, n);
}

#define A8_BLOCK8_ARGS                                                                       \
  float *restrict p, const float *restrict grad, uint8_t *restrict qm, uint8_t *restrict qv, \
      float *restrict absmax_m, float *restrict absmax_v, const a8_consts *k, int64_t n

__attribute__((optimize("fp-contract=off"))) static void block8_base(A8_BLOCK8_ARGS) {
  float m[LZ_ADAMW8BIT_BLOCK], v[LZ_ADAMW8BIT_BLOCK], max_m = 0.0f, max_v = 0.0f;
  block8_rest(p, grad, qm, qv, *absmax_m, *absmax_v, k, 0, n, m, v, &max_m, &max_v);
  block8_finish(qm, qv, absmax_m, absmax_v, k, n, m, v, max_m, max_v);
}

/* The AVX-512 update of 16 elements from their dequantised map values
 * (before the absmax): p is written, m and v kept for the requantising. */
typedef struct {
  __m512 am, av, gs, b1, b2, omb1, omb2, decay, neg, c2, eps;
} a8_vec512;

__attribute__((target("avx512f,fma"), optimize("fp-contract=off"))) static inline void update16(
    float *restrict p, const float *restrict grad, __m512 map_m, __m512 map_v, const a8_vec512 *c,
    float *restrict m, float *restrict v, __m512 *mm, __m512 *mv) {
  const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad), c->gs);
  const __m512 mi = _mm512_fmadd_ps(g, c->omb1, _mm512_mul_ps(_mm512_mul_ps(map_m, c->am), c->b1));
  const __m512 vi =
      _mm512_fmadd_ps(_mm512_mul_ps(c->omb2, g), g, _mm512_mul_ps(_mm512_mul_ps(map_v, c->av), c->b2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), c->c2), c->eps);
  const __m512 step = _mm512_div_ps(_mm512_mul_ps(c->neg, mi), denom);
  _mm512_storeu_ps(p, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p), c->decay), step));
  _mm512_storeu_ps(m, mi);
  _mm512_storeu_ps(v, vi);
  *mm = _mm512_max_ps(_mm512_abs_ps(mi), *mm);
  *mv = _mm512_max_ps(_mm512_abs_ps(vi), *mv);
}

__attribute__((target("avx512f,fma"))) static inline a8_vec512 vec512(const a8_consts *k, float am,
                                                                     float av) {
  return (a8_vec512){_mm512_set1_ps(am),          _mm512_set1_ps(av),
                     _mm512_set1_ps(k->grad_scale), _mm512_set1_ps(k->beta1),
                     _mm512_set1_ps(k->beta2),      _mm512_set1_ps(k->one_minus_beta1),
                     _mm512_set1_ps(k->one_minus_beta2), _mm512_set1_ps(k->decay),
                     _mm512_set1_ps(k->neg_step),   _mm512_set1_ps(k->c2),
                     _mm512_set1_ps(k->eps)};
}

__attribute__((target("avx512f,fma"), optimize("fp-contract=off"))) static void block8_avx512(
    A8_BLOCK8_ARGS) {
  float m[LZ_ADAMW8BIT_BLOCK], v[LZ_ADAMW8BIT_BLOCK];
  const float am = *absmax_m, av = *absmax_v;
  const float *map_m = k->map_m->values, *map_v = k->map_v->values;
  const a8_vec512 c = vec512(k, am, av);
  __m512 mm = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i im = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qm + i)));
    const __m512i iv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qv + i)));
    update16(p + i, grad + i, _mm512_i32gather_ps(im, map_m, 4), _mm512_i32gather_ps(iv, map_v, 4),
             &c, m + i, v + i, &mm, &mv);
  }
  float max_m = _mm512_reduce_max_ps(mm), max_v = _mm512_reduce_max_ps(mv);
  block8_rest(p, grad, qm, qv, am, av, k, i, n, m, v, &max_m, &max_v);
  block8_finish(qm, qv, absmax_m, absmax_v, k, n, m, v, max_m, max_v);
}

/* 64 map values at once without a gather: each of a value's four bytes is a
 * 256-entry byte table, two vpermi2b and a blend on the index's top bit.
 * Interleaving the four byte vectors works within 128-bit lanes, so the
 * indices are first put in the order that makes out[j] elements 16j..16j+15
 * (index byte 16L + 4j + w comes from 16j + 4L + w: a transpose of L and j). */
#define A8_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi,fma"), optimize("fp-contract=off")))

#define A8_FAST                                                                         \
  __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2,fma"),                 \
                 optimize("fp-contract=off")))

A8_VBMI static inline void lookup64(const uint8_t (*planes)[256], const uint8_t *q, __m512 out[4]) {
  const __m512i order = _mm512_set_epi8(
      63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12, 59, 58, 57, 56, 43, 42, 41,
      40, 27, 26, 25, 24, 11, 10, 9, 8, 55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
      51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(q));
  const __mmask64 high = _mm512_movepi8_mask(idx);
  __m512i b[4];
  for (int k = 0; k < 4; k++) {
    const uint8_t *t = planes[k];
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), idx, _mm512_loadu_si512(t + 64));
    const __m512i hi =
        _mm512_permutex2var_epi8(_mm512_loadu_si512(t + 128), idx, _mm512_loadu_si512(t + 192));
    b[k] = _mm512_mask_blend_epi8(high, lo, hi);
  }
  const __m512i t0 = _mm512_unpacklo_epi8(b[0], b[1]), t1 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i t2 = _mm512_unpacklo_epi8(b[2], b[3]), t3 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(t0, t2));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(t0, t2));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(t1, t3));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(t1, t3));
}

A8_VBMI static void block8_vbmi(A8_BLOCK8_ARGS) {
  float m[LZ_ADAMW8BIT_BLOCK], v[LZ_ADAMW8BIT_BLOCK];
  const float am = *absmax_m, av = *absmax_v;
  const a8_vec512 c = vec512(k, am, av);
  __m512 mm = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512 dm[4], dv[4];
    lookup64(k->map_m->planes, qm + i, dm);
    lookup64(k->map_v->planes, qv + i, dv);
    for (int j = 0; j < 4; j++)
      update16(p + i + 16 * j, grad + i + 16 * j, dm[j], dv[j], &c, m + i + 16 * j, v + i + 16 * j,
               &mm, &mv);
  }
  float max_m = _mm512_reduce_max_ps(mm), max_v = _mm512_reduce_max_ps(mv);
  block8_rest(p, grad, qm, qv, am, av, k, i, n, m, v, &max_m, &max_v);
  block8_finish(qm, qv, absmax_m, absmax_v, k, n, m, v, max_m, max_v);
}

/* The AVX2 update of 8 elements: update16's arithmetic 8 lanes at a time
 * (the maps' values with the step's scalars, read once a block). */
typedef struct {
  __m256 am, av, gs, b1, b2, omb1, omb2, decay, neg, c2, eps;
  const float *map_m, *map_v;
} a8_vec256;

#define A8_AVX2 __attribute__((target("avx2,fma"), optimize("fp-contract=off")))

A8_AVX2 static inline a8_vec256 vec256(const a8_consts *k, float am, float av) {
  return (a8_vec256){_mm256_set1_ps(am),          _mm256_set1_ps(av),
                     _mm256_set1_ps(k->grad_scale), _mm256_set1_ps(k->beta1),
                     _mm256_set1_ps(k->beta2),      _mm256_set1_ps(k->one_minus_beta1),
                     _mm256_set1_ps(k->one_minus_beta2), _mm256_set1_ps(k->decay),
                     _mm256_set1_ps(k->neg_step),   _mm256_set1_ps(k->c2),
                     _mm256_set1_ps(k->eps), k->map_m->values, k->map_v->values};
}

/* Eight map values by scalar loads: on an AVX2 part (Zen 3) faster than a
 * gather (docs/optimizers.md). */
A8_AVX2 static inline __m256 map8(const float *t, const uint8_t *q) {
  return _mm256_setr_ps(t[q[0]], t[q[1]], t[q[2]], t[q[3]], t[q[4]], t[q[5]], t[q[6]], t[q[7]]);
}

A8_AVX2 static inline void update8(float *restrict p, const float *restrict grad,
                                   const uint8_t *qm, const uint8_t *qv, const a8_vec256 *c,
                                   float *restrict m, float *restrict v, __m256 *mm, __m256 *mv) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad), c->gs);
  const __m256 m0 = _mm256_mul_ps(_mm256_mul_ps(map8(c->map_m, qm), c->am), c->b1);
  const __m256 v0 = _mm256_mul_ps(_mm256_mul_ps(map8(c->map_v, qv), c->av), c->b2);
  const __m256 mi = _mm256_fmadd_ps(g, c->omb1, m0);
  const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(c->omb2, g), g, v0);
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), c->c2), c->eps);
  const __m256 step = _mm256_div_ps(_mm256_mul_ps(c->neg, mi), denom);
  _mm256_storeu_ps(p, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p), c->decay), step));
  _mm256_storeu_ps(m, mi);
  _mm256_storeu_ps(v, vi);
  *mm = _mm256_max_ps(_mm256_andnot_ps(sign, mi), *mm);
  *mv = _mm256_max_ps(_mm256_andnot_ps(sign, vi), *mv);
}

A8_AVX2 static float max8(__m256 x) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

A8_AVX2 static void block8_avx2(A8_BLOCK8_ARGS) {
  float m[LZ_ADAMW8BIT_BLOCK], v[LZ_ADAMW8BIT_BLOCK];
  const float am = *absmax_m, av = *absmax_v;
  const a8_vec256 c = vec256(k, am, av);
  __m256 mm = _mm256_setzero_ps(), mv = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    update8(p + i, grad + i, qm + i, qv + i, &c, m + i, v + i, &mm, &mv);
  float max_m = max8(mm), max_v = max8(mv);
  block8_rest(p, grad, qm, qv, am, av, k, i, n, m, v, &max_m, &max_v);
  block8_finish(qm, qv, absmax_m, absmax_v, k, n, m, v, max_m, max_v);
}

static inline __attribute__((always_inline)) void block32_body(float *restrict p,
                                                               const float *restrict grad,
                                                               float *restrict m, float *restrict v,
                                                               const a8_consts *k, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i] * k->grad_scale;
    const float mi = fmaf(g, k->one_minus_beta1, m[i] * k->beta1);
    const float vi = fmaf(k->one_minus_beta2 * g, g, v[i] * k->beta2);
    p[i] = fmaf(mi / (sqrtf(vi) + k->eps), k->neg_step, p[i] * k->decay);
    m[i] = mi, v[i] = vi;
  }
}

/* 16 parameters to bf16 as lz_bf16_from_f32_inline rounds them. */
A8_VBMI static inline void store_bf16x16(uint16_t *w, const float *p) {
  _mm256_storeu_si256((__m256i *)w, lz_optim_bf16x16(p));
}

/* Writes the working copy of 64 updated parameters. */
typedef void (*a8_store64_fn)(uint16_t *w, const float *p);

A8_VBMI static inline __attribute__((always_inline)) void store64_shifts(uint16_t *w,
                                                                         const float *p) {
  for (int j = 0; j < 64; j += 16) store_bf16x16(w + j, p + j);
}

#define A8_BF16                                                                             \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi,avx512vbmi2,avx512bf16,fma"), \
                 optimize("fp-contract=off")))

/* vcvtne2ps2bf16 rounds as lz_bf16_from_f32 does (nearest even, NaN
 * quieted the same way) except that it flushes subnormals: 64 values
 * without one take it, 2 instructions where the shifts take 14. */
A8_BF16 static inline __attribute__((always_inline)) void store64_convert(uint16_t *w,
                                                                          const float *p) {
  __m512 x[4];
  __mmask16 sub = 0;
  for (int j = 0; j < 4; j++)
    x[j] = _mm512_loadu_ps(p + 16 * j), sub |= _mm512_fpclass_ps_mask(x[j], 0x20);
  if (sub) {
    store64_shifts(w, p);
    return;
  }
  for (int j = 0; j < 4; j += 2)
    _mm512_storeu_si512(w + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(x[j + 1], x[j]));
}

/* A block's absmax as the quantisers take it: broadcast, and (for the
 * permute quantiser) its reciprocal and whether lz_q8_div16 may use it. */
typedef struct {
  __m512 s, r;
  int recip;
} a8_scale;

/* Quantises 128 values x of a block scaled by s into q. */
typedef void (*a8_quantise128_fn)(const lz_q8_map *map, const float *x, const a8_scale *s,
                                  uint8_t *q);

A8_VBMI static inline __attribute__((always_inline)) void quantise128_gather(const lz_q8_map *map,
                                                                             const float *x,
                                                                             const a8_scale *s,
                                                                             uint8_t *q) {
  for (int j = 0; j < 128; j += 16)
    _mm_storeu_si128((__m128i *)(q + j), lz_q8_quantize16(map->cells, _mm512_load_ps(x + j), s->s));
}

A8_FAST static inline __attribute__((always_inline)) void quantise128_permute(const lz_q8_map *map,
                                                                              const float *x,
                                                                              const a8_scale *s,
                                                                              uint8_t *q) {
  lz_q8_quantize128(map->fast, x, s->s, s->recip, s->r, q);
}

/* Whole blocks, software-pipelined: each pass over a block updates it and
 * quantises the block before it (whose absmax is now known), so the
 * quantiser's table lookups run beside the update's divisions and square
 * root instead of after them; the bf16 working copy (wbf, or NULL) is
 * written while p is in cache. Every element's arithmetic is block8_vbmi's.
 * Inlined into one function per quantiser (its target the quantiser's). */
A8_VBMI static inline __attribute__((always_inline)) void blocks8_pipeline(
    float *restrict p, const float *restrict grad, uint8_t *restrict qm, uint8_t *restrict qv,
    float *restrict absmax_m, float *restrict absmax_v, const a8_consts *k, int64_t blocks,
    uint16_t *restrict wbf, a8_quantise128_fn quantise128, a8_store64_fn store64) {
  enum { B = LZ_ADAMW8BIT_BLOCK };
  float m[2][B] __attribute__((aligned(64))), v[2][B] __attribute__((aligned(64)));
  a8_scale sm = {_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f), 0}, sv = sm; /* the previous block's */
  for (int64_t b = 0; b <= blocks; b++) {
    const int cur = (int)(b & 1), prev = cur ^ 1, update = b < blocks, quantise = b > 0;
    const int64_t o = b * B, q = o - B;
    const a8_vec512 c = vec512(k, update ? absmax_m[b] : 0.0f, update ? absmax_v[b] : 0.0f);
    __m512 mm = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    for (int i = 0; i < B; i += 128) {
      if (update)
        for (int h = i; h < i + 128; h += 64) {
          __m512 dm[4], dv[4];
          lookup64(k->map_m->planes, qm + o + h, dm);
          lookup64(k->map_v->planes, qv + o + h, dv);
          for (int j = 0; j < 4; j++)
            update16(p + o + h + 16 * j, grad + o + h + 16 * j, dm[j], dv[j], &c,
                     m[cur] + h + 16 * j, v[cur] + h + 16 * j, &mm, &mv);
          if (wbf) store64(wbf + o + h, p + o + h);
        }
      if (quantise) {
        quantise128(k->map_m, m[prev] + i, &sm, qm + q + i);
        quantise128(k->map_v, v[prev] + i, &sv, qv + q + i);
      }
    }
    if (update) {
      const float am = _mm512_reduce_max_ps(mm), av = _mm512_reduce_max_ps(mv);
      absmax_m[b] = am, absmax_v[b] = av;
      sm = (a8_scale){_mm512_set1_ps(am), _mm512_set1_ps(1.0f / am), lz_q8_recip_ok(am)};
      sv = (a8_scale){_mm512_set1_ps(av), _mm512_set1_ps(1.0f / av), lz_q8_recip_ok(av)};
    }
  }
}

#define A8_BLOCKS8_ARGS                                                                       \
  float *restrict p, const float *restrict grad, uint8_t *restrict qm, uint8_t *restrict qv,  \
      float *restrict absmax_m, float *restrict absmax_v, const a8_consts *k, int64_t blocks, \
      uint16_t *restrict wbf

/* The quantiser's lookups as gathers into the cells. */
A8_VBMI static void blocks8_vbmi(A8_BLOCKS8_ARGS) {
  blocks8_pipeline(p, grad, qm, qv, absmax_m, absmax_v, k, blocks, wbf, quantise128_gather,
                   store64_shifts);
}

/* The quantiser's lookups as byte permutes and its x / absmax a corrected
 * product (lz_q8_quantize128), where the maps have those tables. */
A8_FAST static void blocks8_fast(A8_BLOCKS8_ARGS) {
  blocks8_pipeline(p, grad, qm, qv, absmax_m, absmax_v, k, blocks, wbf, quantise128_permute,
                   store64_shifts);
}

/* blocks8_fast with the working copy rounded by vcvtne2ps2bf16. */
A8_BF16 static void blocks8_bf16(A8_BLOCKS8_ARGS) {
  blocks8_pipeline(p, grad, qm, qv, absmax_m, absmax_v, k, blocks, wbf, quantise128_permute,
                   store64_convert);
}

/* fmaf is one instruction only where FMA is enabled, which target_clones'
 * "avx2" does not imply: hence clones of our own, picked once. */
#define A8_CLONES(X)                                                             \
  X(avx512, __attribute__((target("avx512f,fma"), optimize("fp-contract=off")))) \
  X(avx2, __attribute__((target("avx2,fma"), optimize("fp-contract=off"))))      \
  X(base, __attribute__((optimize("fp-contract=off"))))

#define A8_DEFINE(suffix, attrs)                                                               \
  attrs static void block32_##suffix(float *restrict p, const float *restrict grad,            \
                                     float *restrict m, float *restrict v, const a8_consts *k, \
                                     int64_t n) {                                              \
    block32_body(p, grad, m, v, k, n);                                                         \
  }
A8_CLONES(A8_DEFINE)

typedef void (*block8_fn)(float *restrict, const float *restrict, uint8_t *restrict,
                          uint8_t *restrict, float *restrict, float *restrict, const a8_consts *,
                          int64_t);
typedef void (*block32_fn)(float *restrict, const float *restrict, float *restrict, float *restrict,
                           const a8_consts *, int64_t);
typedef void (*blocks8_fn)(A8_BLOCKS8_ARGS);

/* The forms of the update, by what the machine has: the scalar loop, AVX2
 * and AVX-512 with gathers, AVX-512 VBMI's pipelined blocks, those with the
 * permute quantiser (VBMI2, where the maps have its tables), and those with
 * the bf16 working copy converted by AVX512-BF16. */
enum { ISA_BASE, ISA_AVX2, ISA_AVX512, ISA_VBMI, ISA_VBMI2, ISA_BF16, ISA_LEVELS };
static const char *const a8_level_names[ISA_LEVELS] = {"base", "avx2",  "avx512",
                                                       "vbmi", "vbmi2", "bf16"};

static int machine_level(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("fma")) return ISA_BASE;
  if (!__builtin_cpu_supports("avx512f"))
    return __builtin_cpu_supports("avx2") ? ISA_AVX2 : ISA_BASE;
  if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vbmi"))
    return ISA_AVX512;
  const lz_q8_map *sm = lz_q8_map_get(1), *um = lz_q8_map_get(0);
  if (!lz_q8_fast_ok(sm) || !lz_q8_fast_ok(um)) return ISA_VBMI;
  const int bf16 = __builtin_cpu_supports("avx512dq") && lz_cpu_has("avx512bf16");
  return bf16 ? ISA_BF16 : ISA_VBMI2;
}

/* The machine's best form, or the one LZ_ADAMW8BIT_ISA names (base, avx2,
 * avx512, vbmi, vbmi2, bf16) at or below it: every form gives the same bits,
 * and the tests run each one this machine can. A name that is no form, or a
 * form above the machine's, is refused (op names the caller) rather than
 * run as the best form in silence. */
static lz_status isa_checked(const char *op, int *level) {
  const int best = machine_level();
  const char *want = getenv("LZ_ADAMW8BIT_ISA");
  *level = best;
  if (!want || !*want) return LZ_OK;
  for (int l = 0; l < ISA_LEVELS; l++)
    if (!strcmp(want, a8_level_names[l])) {
      if (l > best)
        return lz_fail(LZ_ERR_INVALID,
                       "%s: LZ_ADAMW8BIT_ISA is '%s', above this machine's best form, %s; set "
                       "it to %s or a form below it, or unset it",
                       op, want, a8_level_names[best], a8_level_names[best]);
      *level = l;
      return LZ_OK;
    }
  return lz_fail(LZ_ERR_INVALID,
                 "%s: LZ_ADAMW8BIT_ISA is '%s'; set it to base, avx2, avx512, vbmi, vbmi2 or "
                 "bf16 (this machine's best: %s), or unset it",
                 op, want, a8_level_names[best]);
}

/* The form a step runs (the entry points have checked LZ_ADAMW8BIT_ISA). */
static int isa_level(void) {
  int level;
  return isa_checked("adamw8bit", &level) == LZ_OK ? level : machine_level();
}

lz_status lz_adamw8bit_form(const char **what) {
  int level;
  LZ_TRY(isa_checked("adamw8bit", &level));
  *what = a8_level_names[level];
  return LZ_OK;
}

/* ------------------------------------------------------------------ checks */

static lz_status check_args(const char *op, const lz_adamw_args *a) {
  if (!a) return lz_fail(LZ_ERR_INVALID, "%s: args is NULL", op);
  if (a->step < 1)
    return lz_fail(LZ_ERR_INVALID, "%s: args->step is %lld; steps count from 1", op,
                   (long long)a->step);
  LZ_TRY(lz_optim_check_arg(op, "lr", a->lr, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "beta1", a->beta1, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "beta2", a->beta2, LZ_OPTIM_UNIT));
  LZ_TRY(lz_optim_check_arg(op, "eps", a->eps, LZ_OPTIM_NONNEG));
  LZ_TRY(lz_optim_check_arg(op, "weight_decay", a->weight_decay, LZ_OPTIM_NONNEG));
  return lz_optim_check_arg(op, "grad_scale", a->grad_scale, LZ_OPTIM_FINITE);
}

int64_t lz_adamw8bit_blocks(int64_t n) {
  return n <= 0 ? 0 : (n + LZ_ADAMW8BIT_BLOCK - 1) / LZ_ADAMW8BIT_BLOCK;
}

const float *lz_adamw8bit_map(int is_signed) { return lz_q8_map_get(is_signed)->values; }

const uint32_t *lz_adamw8bit_cells(int is_signed, uint32_t bounds[3]) {
  bounds[0] = Q8_LO, bounds[1] = Q8_ONE, bounds[2] = Q8_SIDE;
  return lz_q8_map_get(is_signed)->cells;
}

/* The checks both entry points make (a's tensors are param, grad, m, v,
 * absmax_m, absmax_v, working; a's dtypes are checked against op_id's). */
static lz_status check_8bit(const char *op, lz_op op_id, const lz_op_args *a) {
  lz_tensor *param = a->t[0], *m = a->t[2], *v = a->t[3];
  const lz_optim_tensors t = {.param = param,
                              .grad = a->t[1],
                              .states = {m, v},
                              .state_names = {"m", "v"},
                              .n_states = 2,
                              .working = a->t[6]};
  LZ_TRY(lz_op_check_dtypes(op, op_id, a));
  LZ_TRY(lz_optim_check_tensors(op, &t));
  int level;
  LZ_TRY(isa_checked(op, &level));
  if (m->dtype == LZ_U8) {
    const int64_t blocks = lz_adamw8bit_blocks(lz_tensor_numel(param));
    const char *why = "one per 256 elements of param";
    LZ_TRY(lz_check_numel(op, "absmax_m", a->t[4], blocks, why));
    LZ_TRY(lz_check_numel(op, "absmax_v", a->t[5], blocks, why));
  }
  return check_args(op, a->adamw);
}

lz_status lz_adamw8bit_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *v,
                            lz_tensor *absmax_m, lz_tensor *absmax_v, lz_tensor *working,
                            const lz_adamw_args *args) {
  const char *op = "adamw8bit_step";
  const lz_op_args a = {.t = {param, (lz_tensor *)grad, m, v, absmax_m, absmax_v, working},
                        .adamw = args};
  LZ_TRY(check_8bit(op, LZ_OP_ADAMW8BIT_STEP, &a));
  return lz_op_run(op, LZ_OP_ADAMW8BIT_STEP, &a);
}

/* ------------------------------------------------------------------- pass */

/* lz_q8_quantizer_at's level for each form (vbmi's quantiser gathers). */
static const int quantizer_level[ISA_LEVELS] = {0, 1, 2, 2, 3, 3};

/* The step's scalars (eight: u8 states; else the fp32 update's). */
static a8_consts consts_of(const lz_adamw_args *args, int eight, int isa) {
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2, wd = args->weight_decay;
  const double c1 = 1.0 - pow(b1, (double)args->step);
  const double c2 = sqrt(1.0 - pow(b2, (double)args->step));
  const a8_consts k = {
      .beta1 = args->beta1,
      .beta2 = args->beta2,
      .one_minus_beta1 = (float)(1.0 - b1),
      .one_minus_beta2 = (float)(1.0 - b2),
      .decay = wd > 0.0 ? (float)(1.0 - lr * wd) : 1.0f,
      .neg_step = eight ? (float)(-lr / c1) : (float)(-lr * c2 / c1),
      .c2 = (float)c2,
      .eps = eight ? args->eps : (float)((double)args->eps * c2),
      .grad_scale = args->grad_scale,
      .map_m = lz_q8_map_get(1),
      .map_v = lz_q8_map_get(0),
      .quantize = lz_q8_quantizer_at(quantizer_level[isa]),
  };
  return k;
}

static const block8_fn b8[ISA_LEVELS] = {block8_base, block8_avx2, block8_avx512,
                                         block8_vbmi, block8_vbmi, block8_vbmi};
static const block32_fn b32[ISA_LEVELS] = {block32_base,   block32_avx2,   block32_avx512,
                                           block32_avx512, block32_avx512, block32_avx512};
static const blocks8_fn bs8[ISA_LEVELS] = {NULL,         NULL,         NULL,
                                           blocks8_vbmi, blocks8_fast, blocks8_bf16};

/* Elements [i0, i0 + len) of the update over p (their fp32 values; p[0] is
 * element i0; wbf, or NULL, their bf16 working copy): whole blocks
 * software-pipelined where VBMI is there, else block by block, each form
 * giving every element the same arithmetic. Returns how many elements of
 * wbf it wrote (from the first). */
static int64_t a8_tile(float *p, const lz_op_args *a, const a8_consts *k, int eight, int isa,
                       int64_t i0, int64_t len, uint16_t *wbf) {
  const int64_t B = LZ_ADAMW8BIT_BLOCK;
  const float *g = (const float *)a->t[1]->data + i0;
  if (!eight) {
    float *m = (float *)a->t[2]->data + i0, *v = (float *)a->t[3]->data + i0;
    for (int64_t j = 0; j < len; j += B)
      b32[isa](p + j, g + j, m + j, v + j, k, len - j < B ? len - j : B);
    return 0;
  }
  uint8_t *qm = (uint8_t *)a->t[2]->data + i0, *qv = (uint8_t *)a->t[3]->data + i0;
  float *am = (float *)a->t[4]->data + i0 / B, *av = (float *)a->t[5]->data + i0 / B;
  int64_t j = 0;
  /* without a working copy the bf16 form is vbmi2's, whose build (no DQ)
   * measured a few per cent faster */
  const blocks8_fn blocks8 = isa == ISA_BF16 && !wbf ? blocks8_fast : bs8[isa];
  if (blocks8) {
    j = len / B * B;
    blocks8(p, g, qm, qv, am, av, k, j / B, wbf);
  }
  const int64_t stored = wbf ? j : 0;
  for (; j < len; j += B)
    b8[isa](p + j, g + j, qm + j, qv + j, am + j / B, av + j / B, k, len - j < B ? len - j : B);
  return stored;
}

lz_status lz_cpu_adamw8bit_step(const lz_op_args *a) {
  const int64_t n = lz_tensor_numel(a->t[0]);
  const int eight = a->t[2]->dtype == LZ_U8, isa = isa_level();
  const a8_consts k = consts_of(a->adamw, eight, isa);
  float *p = a->t[0]->data;
  lz_tensor *w = a->t[6];
  const lz_optim_store_fn store = w ? lz_optim_working_store(w->dtype) : NULL;
  const size_t wsize = w ? lz_dtype_size(w->dtype) : 0;
  /* pipelined blocks run in chunks of 64 blocks, the others block by block */
  const int64_t chunk = (eight && bs8[isa] ? 64 : 1) * LZ_ADAMW8BIT_BLOCK;
#pragma omp parallel for schedule(static) if (n > (1 << 14))
  for (int64_t i0 = 0; i0 < n; i0 += chunk) {
    const int64_t len = n - i0 < chunk ? n - i0 : chunk;
    uint16_t *wbf = w && w->dtype == LZ_BF16 ? (uint16_t *)w->data + i0 : NULL;
    const int64_t stored = a8_tile(p + i0, a, &k, eight, isa, i0, len, wbf);
    if (store && len > stored)
      store((char *)w->data + (size_t)(i0 + stored) * wsize, p + i0 + stored, len - stored);
  }
  return LZ_OK;
}

/* ------------------------------------------------- over a bf16 master */

/* bf16 to fp32 is exact: the bits shifted up. */
LZ_DISPATCH static void widen_bf16(float *restrict dst, const uint16_t *restrict src, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const uint32_t u = (uint32_t)src[i] << 16;
    memcpy(dst + i, &u, sizeof u);
  }
}

lz_status lz_adamw8bit_step_bf16(lz_tensor *param, const lz_tensor *grad, lz_tensor *m,
                                 lz_tensor *v, lz_tensor *absmax_m, lz_tensor *absmax_v,
                                 lz_tensor *working, const lz_adamw_args *args, uint64_t seed,
                                 int64_t index) {
  const char *op = "adamw8bit_step_bf16";
  const lz_op_args a = {.t = {param, (lz_tensor *)grad, m, v, absmax_m, absmax_v, working},
                        .adamw = args,
                        .i = {(int64_t)seed, index}};
  LZ_TRY(check_8bit(op, LZ_OP_ADAMW8BIT_STEP_BF16, &a));
  if (index < 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: index is %lld; it must be >= 0 (the global index of "
                   "param's first element)",
                   op, (long long)index);
  return lz_op_run(op, LZ_OP_ADAMW8BIT_STEP_BF16, &a);
}

/* One pass where the unfused step takes three (widen the master into fp32
 * scratch, update it, round it back): each tile is widened on the stack,
 * updated as lz_cpu_adamw8bit_step updates it, and rounded stochastically
 * with the bits of (seed, step, index + i), so memory sees the bf16 master
 * once each way and the bits are the three passes' exactly. */
lz_status lz_cpu_adamw8bit_step_bf16(const lz_op_args *a) {
  enum { TILE = 64 * LZ_ADAMW8BIT_BLOCK };
  const int64_t n = lz_tensor_numel(a->t[0]);
  const int eight = a->t[2]->dtype == LZ_U8;
  const int isa = isa_level();
  const a8_consts k = consts_of(a->adamw, eight, isa);
  const lz_sround_key key = lz_sround_key_of((uint64_t)a->i[0], (uint64_t)a->adamw->step);
  uint16_t *master = a->t[0]->data;
  uint16_t *w = a->t[6] ? a->t[6]->data : NULL;
#pragma omp parallel for schedule(static) if (n > (1 << 14))
  for (int64_t i0 = 0; i0 < n; i0 += TILE) {
    float p[TILE] __attribute__((aligned(64)));
    const int64_t len = n - i0 < TILE ? n - i0 : TILE;
    widen_bf16(p, master + i0, len);
    a8_tile(p, a, &k, eight, isa, i0, len, NULL);
    lz_sround_block(master + i0, p, key, a->i[1] + i0, len);
    if (w) memcpy(w + i0, master + i0, sizeof *w * (size_t)len);
  }
  return LZ_OK;
}
