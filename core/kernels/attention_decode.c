/* attention_decode.c — causal attention against a key/value cache, the
 * generation path: each call appends the keys and values of T new positions
 * (T = 1 for a decoding step, the prompt's length to fill the cache) to the
 * cache of each row, then every new query attends to all the cached
 * positions up to its own. Multi-head (GPT-2) and grouped-query (Llama)
 * alike: the packed q|k|v rows of lz_attention_gqa_forward.
 *
 * The cache holds f32 or bf16 (half the memory; each key and value is
 * rounded once, when it is written). A bf16 cache runs on the bf16 attention
 * kernel's path (attention_bf16.c: the query rounded to bf16, the scores on
 * the bf16 dot-product unit, exp2 on vectors) where that path is chosen
 * (lz_attention_bf16_native) and head_dim is a multiple of 32; otherwise,
 * and with a window, the arithmetic is fp32 on the widened cache. A
 * query row is one task: its scores in a buffer of the thread's, a softmax
 * over them, then the weighted sum of the values, in key order, so results
 * do not depend on the thread count.
 *
 * With a window (lz_attention_opts_decode) the caches are rings: position s
 * at slot s % S. A query reads its older keys from the ring and the new ones
 * from qkv (through the cache's dtype, so the values are the ones a later
 * call reads back), and the last S new positions are written only after
 * every query ran: a prompt longer than the ring overwrites nothing a query
 * of it still needs. */
#include "kernels/attention_tiles.h" /* lz_attention_bf16_decode_query */
#include "mem/lz_backend.h"         /* LZ_OP_RUN */
#include "mem/lz_internal.h"

#include <math.h>   /* expf, sqrtf, INFINITY */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memcpy */

typedef struct {
  int64_t B, T, S;     /* rows, new positions, cache length */
  int64_t NH, NKV, HS; /* query heads, key/value heads, head size */
  int64_t row;         /* floats per qkv row: (NH + 2 NKV) * HS */
  int64_t kv;          /* elements per cache position: NKV * HS */
  int64_t W;           /* window (0: none; else the caches are rings) */
  float scale;         /* 1/sqrt(HS) unless set */
  float cap;           /* soft-capping of the scaled scores; 0 = none */
} decode_dims;

/* Writes n floats at x into the cache at dst, in the cache's dtype. */
static void store_row(void *dst, int64_t at, const float *x, int64_t n, int bf16) {
  if (bf16) {
    uint16_t *d = (uint16_t *)dst + at;
    for (int64_t i = 0; i < n; i++) d[i] = lz_bf16_from_f32_inline(x[i]);
  } else {
    memcpy((float *)dst + at, x, (size_t)n * sizeof(float));
  }
}

/* Cache element i as f32. */
static inline float cached(const void *c, int64_t i, int bf16) {
  return bf16 ? lz_bf16_to_f32_inline(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}

/* Element i of a new position's key or value x, as the cache will hold it. */
static inline float as_cached(const float *x, int64_t i, int bf16) {
  return bf16 ? lz_bf16_to_f32_inline(lz_bf16_from_f32_inline(x[i])) : x[i];
}

/* The windowed query: keys lo .. n - 1, those before p0 (the row's cached
 * length) from the rings, the rest from qkv's new rows. */
static void decode_query_ring(float *out, const float *qkv, const void *kc, const void *vc,
                              int bf16, decode_dims d, int64_t b, int64_t t, int64_t h,
                              int64_t p0, float *scores) {
  const float *q = qkv + (b * d.T + t) * d.row + h * d.HS;
  const int64_t g = h / (d.NH / d.NKV);
  const int64_t n = p0 + t + 1, lo = n - d.W > 0 ? n - d.W : 0;
  const float *knew = qkv + b * d.T * d.row + d.NH * d.HS + g * d.HS;
  const float *vnew = knew + d.NKV * d.HS;
  float max = -INFINITY;
  for (int64_t j = lo; j < n; j++) {
    float s = 0.0f;
    if (j < p0) {
      const int64_t k0 = (b * d.S + j % d.S) * d.kv + g * d.HS;
      for (int64_t i = 0; i < d.HS; i++) s += q[i] * cached(kc, k0 + i, bf16);
    } else {
      const float *k = knew + (j - p0) * d.row;
      for (int64_t i = 0; i < d.HS; i++) s += q[i] * as_cached(k, i, bf16);
    }
    s *= d.scale;
    if (d.cap) s = d.cap * tanhf(s / d.cap);
    scores[j - lo] = s;
    if (s > max) max = s;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n - lo; j++) {
    scores[j] = expf(scores[j] - max);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  float *o = out + (b * d.T + t) * d.NH * d.HS + h * d.HS;
  for (int64_t i = 0; i < d.HS; i++) o[i] = 0.0f;
  for (int64_t j = lo; j < n; j++) {
    const float p = scores[j - lo] * inv;
    if (j < p0) {
      const int64_t v0 = (b * d.S + j % d.S) * d.kv + g * d.HS;
      for (int64_t i = 0; i < d.HS; i++) o[i] += p * cached(vc, v0 + i, bf16);
    } else {
      const float *v = vnew + (j - p0) * d.row;
      for (int64_t i = 0; i < d.HS; i++) o[i] += p * as_cached(v, i, bf16);
    }
  }
}

/* Query head h of new position t in row b: out = softmax(q K^T * scale) V
 * over the cached positions 0 .. n - 1. scores: n floats of the thread's. */
LZ_DISPATCH static void decode_query(float *out, const float *qkv, const void *kc, const void *vc,
                                     int bf16, decode_dims d, int64_t b, int64_t t, int64_t h,
                                     int64_t n, float *scores) {
  const float *q = qkv + (b * d.T + t) * d.row + h * d.HS;
  const int64_t g = h / (d.NH / d.NKV); /* the key/value head serving query head h */
  const int64_t base = b * d.S * d.kv + g * d.HS;
  float max = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    const int64_t k0 = base + j * d.kv;
    float s = 0.0f;
    if (bf16) {
      for (int64_t i = 0; i < d.HS; i++) s += q[i] * cached(kc, k0 + i, 1);
    } else {
      const float *k = (const float *)kc + k0;
      for (int64_t i = 0; i < d.HS; i++) s += q[i] * k[i];
    }
    s *= d.scale;
    if (d.cap) s = d.cap * tanhf(s / d.cap);
    scores[j] = s;
    if (s > max) max = s;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; j++) {
    scores[j] = expf(scores[j] - max);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  float *o = out + (b * d.T + t) * d.NH * d.HS + h * d.HS;
  for (int64_t i = 0; i < d.HS; i++) o[i] = 0.0f;
  for (int64_t j = 0; j < n; j++) {
    const float p = scores[j] * inv;
    const int64_t v0 = base + j * d.kv;
    if (bf16) {
      for (int64_t i = 0; i < d.HS; i++) o[i] += p * cached(vc, v0 + i, 1);
    } else {
      const float *v = (const float *)vc + v0;
      for (int64_t i = 0; i < d.HS; i++) o[i] += p * v[i];
    }
  }
}

/* The sizes of a checked call: qkv [B, T, (NH + 2 NKV) HS], caches
 * [B, S, NKV HS]. */
static decode_dims dims_of(const lz_tensor *qkv, const lz_tensor *k_cache, int n_head,
                           int n_kv_head, int64_t window, float softcap, float scale) {
  decode_dims d;
  d.B = qkv->shape[0];
  d.T = qkv->shape[1];
  d.NH = n_head;
  d.NKV = n_kv_head;
  d.HS = qkv->shape[2] / (n_head + 2 * (int64_t)n_kv_head);
  d.row = qkv->shape[2];
  d.kv = d.NKV * d.HS;
  d.S = k_cache->shape[1];
  d.scale = scale ? scale : d.HS ? 1.0f / sqrtf((float)d.HS) : 0.0f;
  d.W = window;
  d.cap = softcap;
  return d;
}

lz_status lz_attention_decode(lz_tensor *out, const lz_tensor *qkv, lz_tensor *k_cache,
                              lz_tensor *v_cache, const lz_tensor *pos, int n_head, int n_kv_head) {
  return lz_attention_opts_decode(out, qkv, k_cache, v_cache, pos, n_head, n_kv_head, 0, 0.0f,
                                  0.0f);
}

lz_status lz_attention_opts_decode(lz_tensor *out, const lz_tensor *qkv, lz_tensor *k_cache,
                                   lz_tensor *v_cache, const lz_tensor *pos, int n_head,
                                   int n_kv_head, int window, float softcap, float scale) {
  const char *op = "attention_decode";
  char b1[96], b2[96];
  LZ_TRY(lz_check_present(op, "out", out));
  LZ_TRY(lz_check_present(op, "qkv", qkv));
  LZ_TRY(lz_check_present(op, "k_cache", k_cache));
  LZ_TRY(lz_check_present(op, "v_cache", v_cache));
  LZ_TRY(lz_check_present(op, "pos", pos));
  LZ_TRY(lz_check_ndim(op, "qkv", qkv, 3, 3));
  LZ_TRY(lz_check_ndim(op, "k_cache", k_cache, 3, 3));
  LZ_TRY(lz_check_same_shape(op, "v_cache", v_cache, "k_cache", k_cache));
  if (n_head < 1 || n_kv_head < 1 || n_head % n_kv_head != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: n_head %d, n_kv_head %d; both must be >= 1 and n_kv_head must divide "
                   "n_head",
                   op, n_head, n_kv_head);
  const int64_t parts = n_head + 2 * (int64_t)n_kv_head;
  if (qkv->shape[2] % parts != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s; its last dimension must be (n_head + 2 n_kv_head) * "
                   "head_dim = %lld * head_dim",
                   op, lz_tensor_describe(qkv, b1, sizeof b1), (long long)parts);
  LZ_TRY(lz_attention_check_options(op, window, softcap, scale));
  const decode_dims d = dims_of(qkv, k_cache, n_head, n_kv_head, window, softcap, scale);
  if (k_cache->shape[0] != d.B || k_cache->shape[2] != d.kv)
    return lz_fail(LZ_ERR_INVALID, "%s: k_cache is %s; expected [%lld, S, %lld] for qkv %s", op,
                   lz_tensor_describe(k_cache, b1, sizeof b1), (long long)d.B, (long long)d.kv,
                   lz_tensor_describe(qkv, b2, sizeof b2));
  LZ_TRY(lz_check_numel(op, "pos", pos, d.B, "one cached length per row of qkv"));
  if (out->ndim != 3 || out->shape[0] != d.B || out->shape[1] != d.T ||
      out->shape[2] != d.NH * d.HS)
    return lz_fail(LZ_ERR_INVALID, "%s: out is %s; expected f32[%lld, %lld, %lld] for qkv %s", op,
                   lz_tensor_describe(out, b1, sizeof b1), (long long)d.B, (long long)d.T,
                   (long long)(d.NH * d.HS), lz_tensor_describe(qkv, b2, sizeof b2));
  LZ_OP_RUN(op, LZ_OP_ATTENTION_DECODE,
            .t = {out, (lz_tensor *)qkv, k_cache, v_cache, (lz_tensor *)pos},
            .i = {n_head, n_kv_head, window}, .f = {softcap, scale});
}

/* The windowed call: every query first, reading the new keys from qkv, then
 * the last S new positions of each row into the rings. */
static lz_status decode_ring(lz_tensor *out, const lz_tensor *qkv, lz_tensor *k_cache,
                             lz_tensor *v_cache, const int32_t *p, decode_dims d) {
  for (int64_t b = 0; b < d.B; b++) {
    if (p[b] < 0)
      return lz_fail(LZ_ERR_INVALID, "attention_decode: row %lld holds %d cached positions; "
                     "it must be >= 0", (long long)b, p[b]);
    if (d.S < d.W && p[b] + d.T > d.S) /* a ring shorter than the window loses keys */
      return lz_fail(LZ_ERR_INVALID,
                     "attention_decode: row %lld reaches position %lld but the cache holds %lld, "
                     "fewer than the window %lld: give it the window's length or more",
                     (long long)b, (long long)(p[b] + d.T), (long long)d.S, (long long)d.W);
  }
  if (d.B == 0 || d.T == 0 || d.HS == 0) return LZ_OK;
  const int bf16 = k_cache->dtype == LZ_BF16;
  const float *x = qkv->data;
  const int64_t n_tasks = d.B * d.T * d.NH;
  lz_status st = LZ_OK;
  float *o = out->data;
#pragma omp parallel if (n_tasks > 1)
  {
    float *scores = malloc((size_t)d.W * sizeof(float)); /* a query sees W keys at most */
    if (!scores) {
#pragma omp atomic write
      st = LZ_ERR_NOMEM;
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_tasks; i++) {
      if (!scores) continue;
      const int64_t h = i % d.NH, bt = i / d.NH, b = bt / d.T, t = bt % d.T;
      decode_query_ring(o, x, k_cache->data, v_cache->data, bf16, d, b, t, h, p[b], scores);
    }
    free(scores);
  }
  if (st != LZ_OK)
    return lz_fail(st, "attention_decode: no memory for %lld scores per thread", (long long)d.W);
  for (int64_t b = 0; b < d.B; b++)
    for (int64_t t = d.T > d.S ? d.T - d.S : 0; t < d.T; t++) {
      const float *r = x + (b * d.T + t) * d.row;
      const int64_t at = (b * d.S + (p[b] + t) % d.S) * d.kv;
      store_row(k_cache->data, at, r + d.NH * d.HS, d.kv, bf16);
      store_row(v_cache->data, at, r + (d.NH + d.NKV) * d.HS, d.kv, bf16);
    }
  return LZ_OK;
}

/* Checked by lz_attention_decode but pos's values, read here (where the
 * cache lives): each row's cached length leaves room for the T new ones. */
lz_status lz_cpu_attention_decode(const lz_op_args *a) {
  const char *op = "attention_decode";
  lz_tensor *out = a->t[0], *k_cache = a->t[2], *v_cache = a->t[3];
  const lz_tensor *qkv = a->t[1], *pos = a->t[4];
  const decode_dims d = dims_of(qkv, k_cache, (int)a->i[0], (int)a->i[1], a->i[2], a->f[0], a->f[1]);
  const int32_t *p = pos->data;
  if (d.W) return decode_ring(out, qkv, k_cache, v_cache, p, d);
  for (int64_t b = 0; b < d.B; b++) {
    if (p[b] < 0 || p[b] + d.T > d.S)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: row %lld holds %d cached positions and %lld new ones come; the cache "
                     "has room for %lld: make it longer (prompt plus new tokens)",
                     op, (long long)b, p[b], (long long)d.T, (long long)d.S);
  }
  if (d.B == 0 || d.T == 0 || d.HS == 0) return LZ_OK;

  const int bf16 = k_cache->dtype == LZ_BF16;
  const float *x = qkv->data;
  for (int64_t b = 0; b < d.B; b++) {
    for (int64_t t = 0; t < d.T; t++) {
      const float *r = x + (b * d.T + t) * d.row;
      const int64_t at = (b * d.S + p[b] + t) * d.kv;
      store_row(k_cache->data, at, r + d.NH * d.HS, d.kv, bf16);
      store_row(v_cache->data, at, r + (d.NH + d.NKV) * d.HS, d.kv, bf16);
    }
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < d.B; b++)
    if (p[b] + d.T > longest) longest = p[b] + d.T;
  const int64_t n_tasks = d.B * d.T * d.NH;
  const int tiles = bf16 && d.HS % 32 == 0 && d.HS <= MAX_HS && lz_attention_bf16_native();
  lz_status st = LZ_OK;
  float *o = out->data;
#pragma omp parallel if (n_tasks > 1)
  {
    /* whole aligned vectors of scores for the vector softmax */
    float *scores = aligned_alloc(64, (size_t)(longest + 15) / 16 * 64);
    if (!scores) {
#pragma omp atomic write
      st = LZ_ERR_NOMEM;
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_tasks; i++) {
      if (!scores) continue;
      const int64_t h = i % d.NH, bt = i / d.NH, b = bt / d.T, t = bt % d.T;
      if (tiles) {
        const int64_t c0 = b * d.S * d.kv + h / (d.NH / d.NKV) * d.HS;
        lz_attention_bf16_decode_query(o + (b * d.T + t) * d.NH * d.HS + h * d.HS,
                                       x + (b * d.T + t) * d.row + h * d.HS,
                                       (const uint16_t *)k_cache->data + c0,
                                       (const uint16_t *)v_cache->data + c0, p[b] + t + 1, d.kv,
                                       d.HS, d.scale, d.cap, scores);
      } else {
        decode_query(o, x, k_cache->data, v_cache->data, bf16, d, b, t, h, p[b] + t + 1, scores);
      }
    }
    free(scores);
  }
  if (st != LZ_OK)
    return lz_fail(st, "%s: no memory for %lld scores per thread", op, (long long)longest);
  return LZ_OK;
}
