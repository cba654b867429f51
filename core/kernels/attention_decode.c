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
#include "kernels/lz_lanes.h"       /* lz_v8, lz_sums8 */
#include "mem/lz_backend.h"         /* LZ_OP_RUN */
#include "mem/lz_internal.h"

#include <math.h>   /* sqrtf, INFINITY */
#include <omp.h>    /* omp_get_max_threads */
#include <stdint.h> /* INT64_MAX */
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

/* Where one query's keys and values are: positions below p0 in the caches
 * (position j at slot j % ring of a ring, else at slot j), those from p0 on
 * in qkv's new rows, read through the cache's dtype (the values a later call
 * reads back). */
typedef struct {
  const void *kc, *vc;  /* the row's and key/value head's slot 0 */
  const float *kn, *vn; /* the row's and head's first new key and value in qkv */
  int64_t p0, ring;     /* ring 0: no ring */
  int64_t kv, row;      /* elements per cache slot, floats per qkv row */
  int bf16;
} kv_src;

/* Columns c0 .. c0 + w - 1 of key or value j (c: that cache, nw: its new
 * rows; slot: j's slot): in place where they are fp32 and all below hs,
 * else copied into buf, 0 from hs on. */
INLINE const float *cols_at(const kv_src *s, const void *c, const float *nw, int64_t j,
                            int64_t slot, int64_t c0, int64_t w, int64_t hs, float *buf) {
  const int64_t n = hs - c0 < w ? hs - c0 : w;
  if (j < s->p0 && s->bf16) {
    const uint16_t *h = (const uint16_t *)c + slot * s->kv + c0;
    for (int64_t i = 0; i < n; i++) buf[i] = lz_bf16_to_f32_inline(h[i]);
  } else {
    const float *r = (j < s->p0 ? (const float *)c + slot * s->kv : nw + (j - s->p0) * s->row) + c0;
    if (!s->bf16 && n == w) return r;
    for (int64_t i = 0; i < n; i++)
      buf[i] = s->bf16 ? lz_bf16_to_f32_inline(lz_bf16_from_f32_inline(r[i])) : r[i];
  }
  for (int64_t i = n; i < w; i++) buf[i] = 0.0f;
  return buf;
}

INLINE void ld8(lz_v8 *y, const float *p) { memcpy(y, p, sizeof *y); }

/* keys scored together; value columns summed together; keys a value block holds */
enum { KEYS = 8, CW = 64, VB = 64 };

/* nq queries of one key/value head (hs floats each, hs apart at q; their
 * outputs hs apart at out) against positions lo .. n - 1 of src: out =
 * softmax(scale q K^T, soft-capped when cap) V, the scores in base-2 units
 * as the tiled kernel keeps them (scale log2(e) folded into q). Each key and
 * value is read from memory once for all the queries. A query's arithmetic
 * is its own whatever nq: eight keys' dot products at a time, each over
 * lanes of 8 then summed by lz_sums8's tree; exp2 on vectors; the values
 * weighted in key order, CW columns at a time (VB keys' values at a time,
 * the sums kept between blocks): the same bits whatever the thread count.
 * w: the thread's scratch (decode_scratch), 64-byte aligned. */
INLINE void query_body(float *out, const float *q, int64_t nq, const kv_src *s, int64_t lo,
                       int64_t n, int64_t hs, float scale, float cap, float *w) {
  const int64_t hsp = (hs + VL - 1) / VL * VL, m = n - lo, np = (m + VL - 1) / VL * VL;
  float *qs = w, *zero = qs + nq * hsp, *acc = zero + hsp, *buf = acc + nq * hsp;
  float *sc = buf + (KEYS * hsp > VB * CW ? KEYS * hsp : VB * CW);
  const float mul = cap ? scale : scale * LOG2E;
  for (int64_t i = 0; i < hsp; i++) {
    zero[i] = 0.0f;
    for (int64_t h = 0; h < nq; h++) qs[h * hsp + i] = i < hs ? q[h * hs + i] * mul : 0.0f;
  }
  int64_t slot = s->ring ? lo % s->ring : lo;
  for (int64_t j0 = lo; j0 < n; j0 += KEYS) {
    const float *k[KEYS];
    for (int l = 0; l < KEYS; l++) {
      k[l] = j0 + l < n ? cols_at(s, s->kc, s->kn, j0 + l, slot, 0, hsp, hs, buf + l * hsp)
                        : zero;
      if (j0 + l < n && ++slot == s->ring) slot = 0;
    }
    for (int64_t h = 0; h < nq; h++) {
      lz_v8 a[KEYS] = {{0}}, x, y, t;
      for (int64_t c = 0; c < hsp; c += 8) {
        ld8(&x, qs + h * hsp + c);
        for (int l = 0; l < KEYS; l++) {
          ld8(&y, k[l] + c);
          a[l] += x * y;
        }
      }
      lz_sums8(&t, a);
      memcpy(sc + h * np + (j0 - lo), &t, sizeof t); /* np >= m rounded up to KEYS */
    }
  }
  float *inv = sc + nq * np;
  for (int64_t h = 0; h < nq; h++) inv[h] = 1.0f / scores_to_weights(sc + h * np, m, np, cap);
  for (int64_t c0 = 0; c0 < hsp; c0 += CW) {
    const int64_t cw = hsp - c0 < CW ? hsp - c0 : CW;
    for (int64_t h = 0; h < nq; h++)
      for (int64_t i = 0; i < cw; i++) acc[h * hsp + c0 + i] = 0.0f;
    slot = s->ring ? lo % s->ring : lo;
    for (int64_t j0 = lo; j0 < n; j0 += VB) {
      const int64_t nb = n - j0 < VB ? n - j0 : VB;
      const float *v[VB];
      for (int64_t r = 0; r < nb; r++) {
        v[r] = cols_at(s, s->vc, s->vn, j0 + r, slot, c0, cw, hs, buf + r * CW);
        if (++slot == s->ring) slot = 0;
      }
      for (int64_t h = 0; h < nq; h++) {
        const float *p = sc + h * np + (j0 - lo);
        float *ah = acc + h * hsp + c0;
        lz_v8 a[CW / 8], x;
        for (int u = 0; u < cw / 8; u++) ld8(&a[u], ah + 8 * u);
        for (int64_t r = 0; r < nb; r++) {
          if (cw == CW) {
            for (int u = 0; u < CW / 8; u++) ld8(&x, v[r] + 8 * u), a[u] += p[r] * x;
          } else {
            for (int u = 0; u < cw / 8; u++) ld8(&x, v[r] + 8 * u), a[u] += p[r] * x;
          }
        }
        for (int u = 0; u < cw / 8; u++) memcpy(ah + 8 * u, &a[u], sizeof a[u]);
      }
    }
    for (int64_t h = 0; h < nq; h++)
      for (int64_t i = c0; i < c0 + cw && i < hs; i++) out[h * hs + i] = acc[h * hsp + i] * inv[h];
  }
}

/* The forms, as the tiled kernel's: LZ_DISPATCH's clones, and LZ_FMA8's where
 * AVX2 and FMA are there but not AVX-512F. */
LZ_DISPATCH static void decode_query(float *out, const float *q, int64_t nq, const kv_src *s,
                                     int64_t lo, int64_t n, int64_t hs, float scale, float cap,
                                     float *w) {
  query_body(out, q, nq, s, lo, n, hs, scale, cap, w);
}

LZ_FMA8 static void decode_query_fma(float *out, const float *q, int64_t nq, const kv_src *s,
                                     int64_t lo, int64_t n, int64_t hs, float scale, float cap,
                                     float *w) {
  query_body(out, q, nq, s, lo, n, hs, scale, cap, w);
}

/* Floats of a thread's scratch for nq queries of up to n keys. */
static size_t decode_scratch(int64_t nq, int64_t n, int64_t hs) {
  const int64_t hsp = (hs + VL - 1) / VL * VL, np = (n + VL - 1) / VL * VL;
  return (size_t)((2 * nq + 1) * hsp + (KEYS * hsp > VB * CW ? KEYS * hsp : VB * CW) + nq * np +
                  nq);
}

/* Query heads h .. h + nq - 1 (of one key/value head) of new position t in
 * row b, with positions lo .. n - 1 (p0 of them, or all where p0 is past n,
 * already in the caches). */
static void decode_heads(float *out, const float *qkv, const void *kc, const void *vc, int bf16,
                         const decode_dims *d, int64_t b, int64_t t, int64_t h, int64_t nq,
                         int64_t p0, int64_t lo, int64_t n, int fma8, float *w) {
  const int64_t g = h / (d->NH / d->NKV); /* the key/value head serving query head h */
  const size_t esize = bf16 ? sizeof(uint16_t) : sizeof(float);
  const size_t c0 = (size_t)(b * d->S * d->kv + g * d->HS) * esize;
  const float *kn = qkv + b * d->T * d->row + d->NH * d->HS + g * d->HS;
  const kv_src s = {.kc = (const char *)kc + c0, .vc = (const char *)vc + c0,
                    .kn = kn, .vn = kn + d->NKV * d->HS, .p0 = p0, .ring = d->W ? d->S : 0,
                    .kv = d->kv, .row = d->row, .bf16 = bf16};
  const float *q = qkv + (b * d->T + t) * d->row + h * d->HS;
  float *o = out + (b * d->T + t) * d->NH * d->HS + h * d->HS;
  if (fma8) decode_query_fma(o, q, nq, &s, lo, n, d->HS, d->scale, d->cap, w);
  else decode_query(o, q, nq, &s, lo, n, d->HS, d->scale, d->cap, w);
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

/* A call whose rows all start empty (prompts filling their caches): each
 * query sees only the call's own keys, so this is the training forward's
 * causal attention over qkv, with its window and soft-capping, and the
 * tiled kernel (attention.c, or attention_bf16.c's where a bf16 cache
 * decodes on it) runs it, O(T) memory. A bf16 cache's keys and values are
 * read through bf16 first, as the cache will hold them. */
static lz_status prefill(lz_tensor *out, const lz_tensor *qkv, const decode_dims *d, int bf16,
                         int tiles) {
  const int64_t n = d->B * d->T * d->row;
  float *lse = malloc((size_t)(d->B * d->NH * d->T) * sizeof(float));
  float *copy = bf16 ? malloc((size_t)n * sizeof(float)) : NULL;
  lz_tensor *tl = NULL, *tx = NULL;
  lz_status st = LZ_ERR_NOMEM;
  const int64_t lshape[3] = {d->B, d->NH, d->T};
  if (!lse || (bf16 && !copy) || lz_tensor_wrap(&tl, lse, LZ_F32, 3, lshape) != LZ_OK ||
      (bf16 && lz_tensor_wrap(&tx, copy, LZ_F32, 3, qkv->shape) != LZ_OK))
    goto done;
  if (bf16) {
    const float *x = qkv->data;
    const int64_t q = d->NH * d->HS;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t r = 0; r < d->B * d->T; r++)
      for (int64_t i = 0; i < d->row; i++) {
        const float v = x[r * d->row + i];
        copy[r * d->row + i] = i < q ? v : lz_bf16_to_f32_inline(lz_bf16_from_f32_inline(v));
      }
  }
  const lz_op_args a = {.t = {out, tl, bf16 ? tx : (lz_tensor *)qkv, NULL},
                        .i = {d->NH, d->NKV, d->W, tiles},
                        .f = {d->cap, d->scale}};
  st = lz_cpu_attention_forward(&a);
done:
  lz_tensor_free(tl), lz_tensor_free(tx);
  free(lse), free(copy);
  if (st != LZ_OK)
    return lz_fail(st, "attention_decode: no memory for a prompt of %lld positions' scratch",
                   (long long)d->T);
  return LZ_OK;
}

/* Every query of the call, one task per row, position and key/value head
 * (its query heads together, each key and value read once for them) where
 * that gives every thread a task, else per query head (the same bits
 * either way), each thread with scratch for the most keys a query sees.
 * ring: the windowed caches, whose new keys are read from qkv (written
 * after). */
static lz_status queries(float *o, const float *x, const lz_tensor *k_cache,
                         const lz_tensor *v_cache, const int32_t *p, const decode_dims *d,
                         int tiles) {
  const int bf16 = k_cache->dtype == LZ_BF16, ring = d->W != 0;
  const int fma8 = lz_cpu_form_here() == LZ_FORM_AVX2_FMA;
  int64_t longest = 0;
  for (int64_t b = 0; b < d->B; b++)
    if (p[b] + d->T > longest) longest = p[b] + d->T;
  if (ring && d->W < longest) longest = d->W;
  const int64_t group = d->NH / d->NKV;
  const int64_t nq = !tiles && d->B * d->T * d->NKV >= omp_get_max_threads() ? group : 1;
  const int64_t per_row = d->NH / nq, n_tasks = d->B * d->T * per_row;
  const size_t bytes = (decode_scratch(nq, longest, d->HS) * sizeof(float) + 63) / 64 * 64;
  lz_status st = LZ_OK;
#pragma omp parallel if (n_tasks > 1)
  {
    float *w = aligned_alloc(64, bytes);
    if (!w) {
#pragma omp atomic write
      st = LZ_ERR_NOMEM;
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_tasks; i++) {
      if (!w) continue;
      const int64_t h = i % per_row * nq, bt = i / per_row, b = bt / d->T, t = bt % d->T;
      const int64_t n = p[b] + t + 1, lo = ring && n > d->W ? n - d->W : 0;
      if (tiles) {
        const int64_t c0 = b * d->S * d->kv + h / group * d->HS;
        lz_attention_bf16_decode_query(o + (b * d->T + t) * d->NH * d->HS + h * d->HS,
                                       x + (b * d->T + t) * d->row + h * d->HS,
                                       (const uint16_t *)k_cache->data + c0,
                                       (const uint16_t *)v_cache->data + c0, n, d->kv, d->HS,
                                       d->scale, d->cap, w);
      } else {
        decode_heads(o, x, k_cache->data, v_cache->data, bf16, d, b, t, h, nq,
                     ring ? p[b] : INT64_MAX, lo, n, fma8, w);
      }
    }
    free(w);
  }
  if (st != LZ_OK)
    return lz_fail(st, "attention_decode: no memory for %lld scores per thread",
                   (long long)longest);
  return LZ_OK;
}

/* The windowed call: every query first, reading the new keys from qkv, then
 * the last S new positions of each row into the rings. */
static lz_status decode_ring(lz_tensor *out, const lz_tensor *qkv, lz_tensor *k_cache,
                             lz_tensor *v_cache, const int32_t *p, const decode_dims *d,
                             int fresh) {
  for (int64_t b = 0; b < d->B; b++) {
    if (p[b] < 0)
      return lz_fail(LZ_ERR_INVALID, "attention_decode: row %lld holds %d cached positions; "
                     "it must be >= 0", (long long)b, p[b]);
    if (d->S < d->W && p[b] + d->T > d->S) /* a ring shorter than the window loses keys */
      return lz_fail(LZ_ERR_INVALID,
                     "attention_decode: row %lld reaches position %lld but the cache holds %lld, "
                     "fewer than the window %lld: give it the window's length or more",
                     (long long)b, (long long)(p[b] + d->T), (long long)d->S, (long long)d->W);
  }
  if (d->B == 0 || d->T == 0 || d->HS == 0) return LZ_OK;
  const int bf16 = k_cache->dtype == LZ_BF16;
  const float *x = qkv->data;
  if (fresh) LZ_TRY(prefill(out, qkv, d, bf16, 0));
  else LZ_TRY(queries(out->data, x, k_cache, v_cache, p, d, 0));
  for (int64_t b = 0; b < d->B; b++)
    for (int64_t t = d->T > d->S ? d->T - d->S : 0; t < d->T; t++) {
      const float *r = x + (b * d->T + t) * d->row;
      const int64_t at = (b * d->S + (p[b] + t) % d->S) * d->kv;
      store_row(k_cache->data, at, r + d->NH * d->HS, d->kv, bf16);
      store_row(v_cache->data, at, r + (d->NH + d->NKV) * d->HS, d->kv, bf16);
    }
  return LZ_OK;
}

/* Checked by lz_attention_decode but pos's values, read here (where the
 * cache lives): each row's cached length leaves room for the T new ones.
 * Rows that all start empty with more than one new position (prompts) run
 * as the training forward (prefill); the others query by query. */
lz_status lz_cpu_attention_decode(const lz_op_args *a) {
  const char *op = "attention_decode";
  lz_tensor *out = a->t[0], *k_cache = a->t[2], *v_cache = a->t[3];
  const lz_tensor *qkv = a->t[1], *pos = a->t[4];
  const decode_dims d =
      dims_of(qkv, k_cache, (int)a->i[0], (int)a->i[1], a->i[2], a->f[0], a->f[1]);
  const int32_t *p = pos->data;
  int fresh = d.T > 1;
  for (int64_t b = 0; b < d.B; b++) fresh = fresh && p[b] == 0;
  if (d.W) return decode_ring(out, qkv, k_cache, v_cache, p, &d, fresh);
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
  const int tiles = bf16 && d.HS % 32 == 0 && d.HS <= MAX_HS && lz_attention_bf16_native();
  if (fresh) return prefill(out, qkv, &d, bf16, tiles);
  return queries(out->data, x, k_cache, v_cache, p, &d, tiles);
}
