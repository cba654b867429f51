/* matmul.c — GEMMs through oneDNN: fp32 through dnnl_sgemm (sgemm.c), bf16 inputs with
 * fp32 accumulation through the matmul primitive (cached per shape, since
 * creating one costs far more than running a small one). Then the linear
 * layer's forward and backward on top. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_gemm.h"
#include "kernels/lz_sq_blocks.h" /* the gradient norm's block partials */

#include <dnnl.h>    /* dnnl_sgemm, matmul primitive */
#include <omp.h>     /* omp_in_parallel: where b is packed first */
#include <pthread.h> /* the primitive cache lock */
#include <stdio.h>   /* snprintf: the bf16 path's description */
#include <stdlib.h>  /* malloc, free for widened bf16 operands; getenv */
#include <string.h>  /* strcmp */

/* ------------------------------------------------------------ bf16 cache */

/* A primitive is made for one exact shape: oneDNN's runtime-dimension
 * matmul picks another kernel (gemm:jit instead of brgemm) whose sums round
 * differently, so every shape keeps its own. The experts' GEMMs bring a
 * shape per row count (up to about 6 x the rows of a batch): the cache holds
 * that many rather than rebuilding them (some 0.2 ms and 90 KB each). */
#define CACHE_SLOTS 1024

typedef struct {
  int used;
  int busy; /* runs in flight: not evicted meanwhile */
  uint64_t stamp;
  /* key */
  int64_t batch, m, n, k;
  int64_t lda; /* a's stored rows this many elements apart (a block of a wider matrix) */
  int ta, tb, b_shared, has_bias, pack_b;
  float alpha, beta;
  /* value: memory objects are made per run, so threads run it at once */
  dnnl_primitive_t prim;
  dnnl_memory_desc_t a_md, b_md, c_md, bias_md, scratch_md;
  /* pack_b: b reordered into the kernel's own blocked layout (bw_md) before
   * the run; NULL where the kernel takes b as it is (bw_md is b_md) */
  dnnl_primitive_t b_reorder;
  dnnl_memory_desc_t bw_md, reorder_scratch_md;
} cache_entry;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static cache_entry cache[CACHE_SLOTS];
static uint64_t cache_clock;
/* The entries by their key's hash: chains of slot + 1 (0 ends a chain), so
 * a lookup reads a few entries, not every slot (an entry is some 5 KB of
 * descriptors: a training step of moe-100m, some 3,000 lookups in a cache of
 * hundreds of row counts, read about 500 entries a lookup). */
#define CACHE_BUCKETS 4096
static int bucket_head[CACHE_BUCKETS];
static int slot_next[CACHE_SLOTS];
static dnnl_engine_t engine;
/* A stream per thread: the experts' grouped GEMM runs primitives from
 * several threads at once (each single-threaded inside its parallel
 * region). */
static _Thread_local dnnl_stream_t stream;
/* This thread's scratchpad for the primitives it runs (user scratchpad
 * mode: runs on several threads at once must not share oneDNN's). */
static _Thread_local void *pad;
static _Thread_local size_t pad_bytes;
/* This thread's copy of b in the kernel's layout, for the primitives that
 * take b packed (grown, never shrunk, as pad). */
static _Thread_local void *packed_b;
static _Thread_local size_t packed_b_bytes;

static lz_status dnnl_check(dnnl_status_t s, const char *what) {
  if (s == dnnl_success) return LZ_OK;
  if (s == dnnl_unimplemented)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "matmul: oneDNN has no bf16 kernel for this processor (%s); bf16 needs "
                   "AVX-512; use fp32",
                   what);
  return lz_fail(LZ_ERR_INTERNAL, "matmul: oneDNN %s failed with status %d", what, (int)s);
}

static void entry_release(cache_entry *e) {
  if (e->prim) dnnl_primitive_destroy(e->prim);
  if (e->b_reorder) dnnl_primitive_destroy(e->b_reorder);
  memset(e, 0, sizeof *e);
}

/* Descriptor of a row-major matrix stored transposed when `trans`: 2-D for a
 * single product (oneDNN picks its plain GEMM kernels for those), its stored
 * rows ld elements apart (ld: cols, or rows when trans, unless it is a block
 * of a wider matrix), else 3-D [batch, rows, cols] where batch stride 0
 * broadcasts one matrix. */
static dnnl_status_t md_init(dnnl_memory_desc_t *md, int64_t batch, int64_t rows, int64_t cols,
                             int64_t ld, int trans, int shared, dnnl_data_type_t dt) {
  if (batch == 1) {
    dnnl_dims_t dims = {rows, cols};
    dnnl_dims_t strides = {trans ? 1 : ld, trans ? ld : 1};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
  }
  dnnl_dims_t dims = {shared ? 1 : batch, rows, cols};
  dnnl_dims_t strides = {rows * cols, trans ? 1 : cols, trans ? rows : 1};
  return dnnl_memory_desc_init_by_strides(md, 3, dims, dt, strides);
}

/* e's primitive, b packed when `pack` (and its reorder made, e->b_reorder),
 * else b as it is. */
static lz_status entry_build_as(cache_entry *e, int pack) {
  dnnl_memory_desc_t a_md, b_md, c_md, bias_md;
  LZ_TRY(dnnl_check(md_init(&a_md, e->batch, e->m, e->k, e->lda, e->ta, 0, dnnl_bf16), "a desc"));
  LZ_TRY(dnnl_check(md_init(&b_md, e->batch, e->k, e->n, e->tb ? e->k : e->n, e->tb, e->b_shared,
                            dnnl_bf16),
                    "b desc"));
  LZ_TRY(dnnl_check(md_init(&c_md, e->batch, e->m, e->n, e->n, 0, 0, dnnl_f32), "c desc"));
  if (e->has_bias) {
    dnnl_dims_t bd = {1, 1, e->n};
    int nd = e->batch == 1 ? 2 : 3;
    LZ_TRY(dnnl_check(dnnl_memory_desc_init_by_tag(&bias_md, nd, nd == 2 ? bd + 1 : bd, dnnl_f32,
                                                   nd == 2 ? dnnl_ab : dnnl_abc),
                      "bias desc"));
  }
  /* pack: the primitive chooses b's layout (format any) */
  dnnl_memory_desc_t b_any = b_md;
  if (pack)
    LZ_TRY(dnnl_check(dnnl_memory_desc_init_by_tag(&b_any, b_md.ndims, b_md.dims, dnnl_bf16,
                                                   dnnl_format_tag_any),
                      "b desc (any)"));
  dnnl_matmul_desc_t desc;
  LZ_TRY(dnnl_check(dnnl_matmul_desc_init(&desc, &a_md, &b_any, e->has_bias ? &bias_md : NULL,
                                          &c_md),
                    "matmul_desc_init"));
  dnnl_primitive_attr_t attr;
  LZ_TRY(dnnl_check(dnnl_primitive_attr_create(&attr), "attr_create"));
  dnnl_post_ops_t ops = NULL;
  /* Each thread brings its own scratchpad (pad): runs on several threads
   * at once must not share oneDNN's. */
  dnnl_status_t s = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
  if (s == dnnl_success && e->alpha != 1.0f)
    s = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &e->alpha);
  if (s == dnnl_success && e->beta != 0.0f) {
    s = dnnl_post_ops_create(&ops);
    if (s == dnnl_success) s = dnnl_post_ops_append_sum(ops, e->beta);
    if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(attr, ops);
  }
  dnnl_primitive_desc_t pd = NULL;
  if (s == dnnl_success) s = dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL);
  if (ops) dnnl_post_ops_destroy(ops);
  dnnl_primitive_attr_destroy(attr);
  LZ_TRY(dnnl_check(s, "primitive_desc_create"));
  const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  if (smd) e->scratch_md = *smd;
  e->bw_md = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  s = dnnl_primitive_create(&e->prim, pd);
  dnnl_primitive_desc_destroy(pd);
  LZ_TRY(dnnl_check(s, "primitive_create"));
  e->a_md = a_md, e->b_md = b_md, e->c_md = c_md;
  if (e->has_bias) e->bias_md = bias_md;
  if (!pack || dnnl_memory_desc_equal(&e->bw_md, &b_md)) return LZ_OK;
  /* the reorder runs on the thread's own scratchpad too (pad) */
  dnnl_primitive_desc_t rpd = NULL;
  s = dnnl_primitive_attr_create(&attr);
  if (s == dnnl_success) {
    s = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (s == dnnl_success)
      s = dnnl_reorder_primitive_desc_create(&rpd, &b_md, engine, &e->bw_md, engine, attr);
    dnnl_primitive_attr_destroy(attr);
  }
  if (s == dnnl_success) {
    const dnnl_memory_desc_t *rsmd = dnnl_primitive_desc_query_md(rpd, dnnl_query_scratchpad_md, 0);
    if (rsmd) e->reorder_scratch_md = *rsmd;
    s = dnnl_primitive_create(&e->b_reorder, rpd);
  }
  if (rpd) dnnl_primitive_desc_destroy(rpd);
  return dnnl_check(s, "b reorder");
}

/* With pack_b, a b that oneDNN cannot reorder is multiplied as it is. */
static lz_status entry_build(cache_entry *e) {
  lz_status st = entry_build_as(e, e->pack_b);
  if (st == LZ_OK || !e->pack_b) return st;
  if (e->prim) dnnl_primitive_destroy(e->prim);
  if (e->b_reorder) dnnl_primitive_destroy(e->b_reorder);
  e->prim = e->b_reorder = NULL;
  return entry_build_as(e, 0);
}

/* Grows this thread's scratchpad to `bytes` (never shrunk: no allocation,
 * nor page faults, per run). */
static lz_status pad_reserve(size_t bytes) {
  if (bytes <= pad_bytes) return LZ_OK;
  void *grown = realloc(pad, bytes);
  if (!grown)
    return lz_fail(LZ_ERR_NOMEM, "matmul: out of memory for a %zu-byte bf16 scratchpad", bytes);
  pad = grown, pad_bytes = bytes;
  return LZ_OK;
}

/* b into this thread's packed_b, in the layout e's kernel reads: a copy,
 * so the products are bitwise those of b as it is. */
static lz_status pack_b_run(const cache_entry *e, const void *b, const void **out) {
  const size_t bytes = dnnl_memory_desc_get_size(&e->bw_md);
  if (bytes > packed_b_bytes) {
    void *grown = realloc(packed_b, bytes);
    if (!grown)
      return lz_fail(LZ_ERR_NOMEM, "matmul: out of memory for a %zu-byte packed bf16 operand",
                     bytes);
    packed_b = grown, packed_b_bytes = bytes;
  }
  const size_t scratch = dnnl_memory_desc_get_size(&e->reorder_scratch_md);
  LZ_TRY(pad_reserve(scratch));
  dnnl_memory_t from = NULL, to = NULL, sp = NULL;
  dnnl_status_t s = dnnl_memory_create(&from, &e->b_md, engine, (void *)b);
  if (s == dnnl_success) s = dnnl_memory_create(&to, &e->bw_md, engine, packed_b);
  if (s == dnnl_success && scratch)
    s = dnnl_memory_create(&sp, &e->reorder_scratch_md, engine, pad);
  if (s == dnnl_success) {
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to},
                               {DNNL_ARG_SCRATCHPAD, sp}};
    s = dnnl_primitive_execute(e->b_reorder, stream, scratch ? 3 : 2, args);
  }
  if (s == dnnl_success) s = dnnl_stream_wait(stream);
  if (from) dnnl_memory_destroy(from);
  if (to) dnnl_memory_destroy(to);
  if (sp) dnnl_memory_destroy(sp);
  *out = packed_b;
  return dnnl_check(s, "b reorder");
}

/* One run of a cached primitive on these buffers, on this thread's stream. */
static lz_status entry_run(const cache_entry *e, const void *a, const void *b, float *c,
                           const float *bias) {
  if (!stream)
    LZ_TRY(dnnl_check(dnnl_stream_create(&stream, engine, dnnl_stream_default_flags),
                      "stream_create"));
  if (e->b_reorder) LZ_TRY(pack_b_run(e, b, &b));
  const size_t scratch = dnnl_memory_desc_get_size(&e->scratch_md);
  LZ_TRY(pad_reserve(scratch));
  dnnl_memory_t m[5] = {NULL, NULL, NULL, NULL, NULL};
  dnnl_status_t s = dnnl_memory_create(&m[0], &e->a_md, engine, (void *)a);
  if (s == dnnl_success) s = dnnl_memory_create(&m[1], &e->bw_md, engine, (void *)b);
  if (s == dnnl_success) s = dnnl_memory_create(&m[2], &e->c_md, engine, c);
  if (s == dnnl_success && scratch) s = dnnl_memory_create(&m[3], &e->scratch_md, engine, pad);
  if (s == dnnl_success && bias) s = dnnl_memory_create(&m[4], &e->bias_md, engine, (void *)bias);
  lz_status st = dnnl_check(s, "memory_create");
  if (st == LZ_OK) {
    dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, m[0]}, {DNNL_ARG_WEIGHTS, m[1]},
                               {DNNL_ARG_DST, m[2]}};
    int n = 3;
    if (scratch) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, m[3]};
    if (bias) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, m[4]};
    st = dnnl_check(dnnl_primitive_execute(e->prim, stream, n, args), "execute");
    if (st == LZ_OK) st = dnnl_check(dnnl_stream_wait(stream), "stream_wait");
  }
  for (int i = 0; i < 5; i++)
    if (m[i]) dnnl_memory_destroy(m[i]);
  return st;
}


/* How a bf16 GEMM runs on this machine, chosen once per process:
 *   native  oneDNN's bf16 matmul (fp32 accumulation): AVX512-BF16 parts run
 *           it at about twice sgemm's rate;
 *   f32     bf16 storage, fp32 compute: the inputs widened to f32 (exact)
 *           and multiplied by sgemm, also accumulating in fp32. Where the CPU
 *           lacks AVX512-BF16, oneDNN only emulates bf16 and its sgemm is
 *           the faster way.
 * LZ_BF16_MATMUL=native|f32 overrides the choice by CPU features; native
 * falls back to f32 if oneDNN has no bf16 kernel here. Either way the
 * result is the same on every rank and stage (the order of the sums is
 * fixed per path, so two paths differ in rounding only).
 *
 * Native GEMMs whose b is stored as it multiplies (not transposed: the input
 * gradient's weight, the weight gradient's activations) take it packed:
 * reordered first into the blocked layout oneDNN's kernel reads, which the
 * kernel otherwise copies b into block by block as it goes. The same kernel
 * with the same blocking runs on the same values, so the products are the
 * same bits; on llama-100m's shapes (batch 4 x 128, one thread) the
 * reorder plus the packed product took 1-5% less CPU time than the plain
 * product (the head's input gradient, k = 32000, the most). Transposed b
 * (the forward's weight) stays as it is: its reorder costs more than it
 * saves. The reorder's cost is b's size while the product's grows with a's
 * rows, so only from PACK_MIN_ROWS rows (with 64 to 256 rows of a the
 * reorder plus the packed product took 4-15% more CPU time than the plain
 * one, b in cache) and for a b of PACK_MIN_BYTES (smaller: the reorder's call
 * is mostly overhead) to PACK_MAX_BYTES, the copy's buffer living as long as
 * the thread (as the scratchpad does). Only outside parallel regions, where
 * each thread would hold its own copy (the experts' grouped GEMM).
 * LZ_BF16_PACK=0 turns it off. */
#define PACK_MIN_ROWS 512
#define PACK_MIN_BYTES ((int64_t)64 << 10)
#define PACK_MAX_BYTES ((int64_t)128 << 20)
typedef struct {
  int native;
  int pack_b;
  char why[96];
} bf16_path;

static bf16_path path;
static pthread_once_t path_once = PTHREAD_ONCE_INIT;
static const char *path_env_bad; /* LZ_BF16_MATMUL's value when it names no path */
static const char *pack_env_bad; /* LZ_BF16_PACK's value when it is not 0 or 1 */

static void path_choose(void) {
  const char *pack = getenv("LZ_BF16_PACK");
  path.pack_b = 1;
  if (pack && *pack) {
    if (strcmp(pack, "0") && strcmp(pack, "1")) pack_env_bad = pack;
    path.pack_b = !strcmp(pack, "1");
  }
  const char *env = getenv("LZ_BF16_MATMUL");
  if (env && *env) {
    if (strcmp(env, "native") && strcmp(env, "f32")) {
      path_env_bad = env;
      return;
    }
    path.native = !strcmp(env, "native");
    snprintf(path.why, sizeof path.why, "%s (LZ_BF16_MATMUL%s)", env,
             path.native && !lz_cpu_has("avx512bf16") ? "; no avx512_bf16 here"
                                                      : "");
    return;
  }
  path.native = lz_cpu_has("avx512bf16");
  snprintf(path.why, sizeof path.why, "%s", path.native ? "native (avx512_bf16)"
                                                        : "f32 (no avx512_bf16: fp32 sgemm)");
}

static lz_status path_get(int *native) {
  pthread_once(&path_once, path_choose);
  if (path_env_bad)
    return lz_fail(LZ_ERR_INVALID, "matmul: LZ_BF16_MATMUL is '%s'; set it to native or f32, "
                   "or unset it to choose by the CPU", path_env_bad);
  if (pack_env_bad)
    return lz_fail(LZ_ERR_INVALID, "matmul: LZ_BF16_PACK is '%s'; set it to 0 or 1 (the "
                   "default: b packed where it is not transposed)", pack_env_bad);
  *native = __atomic_load_n(&path.native, __ATOMIC_ACQUIRE);
  return LZ_OK;
}

const char *lz_gemm_isa(void) {
  switch (dnnl_get_effective_cpu_isa()) {
  case dnnl_cpu_isa_sse41: return "sse41";
  case dnnl_cpu_isa_avx: return "avx";
  case dnnl_cpu_isa_avx2: return "avx2";
  case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
  case dnnl_cpu_isa_avx512_core: return "avx512_core";
  case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
  case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
  case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
  default: { /* (a newer one: its number, so two of them still differ) */
    static char other[32];
    snprintf(other, sizeof other, "isa 0x%x", (unsigned)dnnl_get_effective_cpu_isa());
    return other;
  }
  }
}

lz_status lz_bf16_matmul_path(const char **what) {
  int native = 0;
  LZ_TRY(path_get(&native));
  *what = path.why;
  return LZ_OK;
}

/* oneDNN said it has no bf16 kernel for this processor: f32 from now on. */
static void path_fall_back(void) {
  pthread_mutex_lock(&cache_lock);
  if (path.native) {
    snprintf(path.why, sizeof path.why, "f32 (oneDNN has no bf16 kernel here: fp32 sgemm)");
    __atomic_store_n(&path.native, 0, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&cache_lock);
}

static void widen_bf16(float *dst, const uint16_t *src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; i++) dst[i] = lz_bf16_to_f32_inline(src[i]);
}

/* a's stored rows lda apart (a block of a wider matrix: batch 1), widened
 * into a packed copy. */
static lz_status gemm_bf16_widened(int64_t batch, int64_t m, int64_t n, int64_t k, int ta,
                                   int tb, int b_shared, float alpha, const void *a, int64_t lda,
                                   const void *b, float beta, float *c, const float *bias) {
  const int64_t ldb = lz_sgemm_padded_ldb(m, n, tb); /* b widened straight into padded rows */
  const int64_t na = batch * m * k, nb = (b_shared ? 1 : batch) * k * (ldb ? ldb : n);
  float *fa = malloc((size_t)(na + nb) * sizeof(float));
  if (!fa)
    return lz_fail(LZ_ERR_NOMEM, "matmul: out of memory widening a %lld x %lld x %lld bf16 GEMM",
                   (long long)m, (long long)n, (long long)k);
  float *fb = fa + na;
  const int64_t stored_rows = ta ? k : m, stored_cols = ta ? m : k;
  if (lda == stored_cols) widen_bf16(fa, a, na);
  else
    for (int64_t r = 0; r < stored_rows; r++)
      widen_bf16(fa + r * stored_cols, (const uint16_t *)a + r * lda, stored_cols);
  if (!ldb) widen_bf16(fb, b, nb);
  else
    for (int64_t r = 0; r < nb / ldb; r++) widen_bf16(fb + r * ldb, (const uint16_t *)b + r * n, n);
  lz_status st =
      lz_sgemm_batch(batch, m, n, k, ta, tb, b_shared, alpha, fa, ta ? m : k, fb, ldb, beta, c);
  free(fa);
  if (st == LZ_OK && bias) /* only with alpha 1, beta 0 (linear_forward) */
    for (int64_t r = 0; r < batch * m; r++)
      for (int64_t j = 0; j < n; j++) c[r * n + j] += bias[j];
  return st;
}

/* Whether cached entry e was made for key's shape and attributes. */
static int entry_matches(const cache_entry *e, const cache_entry *key) {
  return e->used && e->batch == key->batch && e->m == key->m && e->n == key->n &&
         e->k == key->k && e->lda == key->lda && e->ta == key->ta && e->tb == key->tb &&
         e->b_shared == key->b_shared && e->has_bias == key->has_bias &&
         e->pack_b == key->pack_b && e->alpha == key->alpha && e->beta == key->beta;
}

/* e, marked running (busy) and recently used. Under cache_lock. */
static cache_entry *entry_take(cache_entry *e) {
  e->stamp = ++cache_clock;
  e->busy++;
  return e;
}

/* key's bucket: of every field entry_matches compares. */
static int key_bucket(const cache_entry *key) {
  uint32_t alpha, beta;
  memcpy(&alpha, &key->alpha, sizeof alpha);
  memcpy(&beta, &key->beta, sizeof beta);
  const uint64_t v[] = {(uint64_t)key->batch, (uint64_t)key->m, (uint64_t)key->n,
                        (uint64_t)key->k, (uint64_t)key->lda,
                        (uint64_t)(key->ta | key->tb << 1 | key->b_shared << 2 |
                                   key->has_bias << 3 | key->pack_b << 4),
                        (uint64_t)alpha << 32 | beta};
  return (int)(lz_hash_xxh64(v, sizeof v, 0) % CACHE_BUCKETS);
}

/* key's cached entry, taken (entry_take), or NULL. Under cache_lock. */
static cache_entry *cache_take(const cache_entry *key) {
  for (int i = bucket_head[key_bucket(key)]; i; i = slot_next[i - 1])
    if (entry_matches(&cache[i - 1], key)) return entry_take(&cache[i - 1]);
  return NULL;
}

/* Slot e out of its bucket's chain (e used), or into it. Under cache_lock. */
static void chain_unlink(const cache_entry *e) {
  const int slot = (int)(e - cache);
  int *link = &bucket_head[key_bucket(e)];
  while (*link && *link != slot + 1) link = &slot_next[*link - 1];
  if (*link) *link = slot_next[slot];
  slot_next[slot] = 0;
}

static void chain_link(const cache_entry *e) {
  const int slot = (int)(e - cache), b = key_bucket(e);
  slot_next[slot] = bucket_head[b];
  bucket_head[b] = slot + 1;
}

/* An unused slot, else the least recently used entry not running; NULL if
 * every one is running. Under cache_lock. */
static cache_entry *cache_victim(void) {
  cache_entry *victim = NULL;
  for (int i = 0; i < CACHE_SLOTS; i++) {
    cache_entry *e = &cache[i];
    if (e->busy) continue;
    if (!e->used) return e;
    if (!victim || e->stamp < victim->stamp) victim = e;
  }
  return victim;
}

/* c[batch, m, n] = alpha * op(a) @ op(b) + beta * c (+ bias[n]); a and b
 * bf16, a's stored rows lda apart (k, or m when ta, unless a is a block of a
 * wider matrix: batch 1 only). */
static lz_status gemm_bf16(int64_t batch, int64_t m, int64_t n, int64_t k, int ta, int tb,
                           int b_shared, float alpha, const void *a, int64_t lda, const void *b,
                           float beta, float *c, const float *bias) {
  int native = 0;
  LZ_TRY(path_get(&native));
  if (!native)
    return gemm_bf16_widened(batch, m, n, k, ta, tb, b_shared, alpha, a, lda, b, beta, c, bias);
  const int pack_b = path.pack_b && batch == 1 && !tb && m >= PACK_MIN_ROWS &&
                     k * n * 2 >= PACK_MIN_BYTES && k * n * 2 <= PACK_MAX_BYTES &&
                     !omp_in_parallel();
  const cache_entry key = {.used = 1, .batch = batch, .m = m, .n = n, .k = k, .lda = lda, .ta = ta,
                           .tb = tb, .b_shared = b_shared, .has_bias = bias != NULL,
                           .pack_b = pack_b, .alpha = alpha, .beta = beta};
  pthread_mutex_lock(&cache_lock);
  lz_status st = engine ? LZ_OK
                        : dnnl_check(dnnl_engine_create(&engine, dnnl_cpu, 0), "engine_create");
  cache_entry *hit = st == LZ_OK ? cache_take(&key) : NULL;
  pthread_mutex_unlock(&cache_lock);
  if (st == LZ_OK && !hit) {
    /* Built outside the lock (oneDNN's primitive creation is thread-safe):
     * a build takes 0.2-0.8 ms, and the grouped GEMM's other threads keep
     * running their cached shapes meanwhile instead of waiting on the lock. */
    cache_entry built = key;
    st = entry_build(&built);
    if (st == LZ_OK) {
      pthread_mutex_lock(&cache_lock);
      hit = cache_take(&key); /* another thread may have built it meanwhile */
      int keep = 0;
      if (!hit) {
        cache_entry *victim = cache_victim();
        if (!victim)
          st = lz_fail(LZ_ERR_INTERNAL, "matmul: all %d cached bf16 primitives are running at "
                       "once; run fewer GEMMs in parallel", CACHE_SLOTS);
        else {
          if (victim->used) chain_unlink(victim);
          entry_release(victim);
          *victim = built, keep = 1;
          chain_link(victim);
          hit = entry_take(victim);
        }
      }
      pthread_mutex_unlock(&cache_lock);
      if (!keep) entry_release(&built);
    } else {
      entry_release(&built);
    }
  }
  if (st == LZ_OK) {
    st = entry_run(hit, a, b, c, bias);
    pthread_mutex_lock(&cache_lock);
    hit->busy--;
    pthread_mutex_unlock(&cache_lock);
  }
  if (st == LZ_ERR_UNSUPPORTED) {
    path_fall_back();
    return gemm_bf16_widened(batch, m, n, k, ta, tb, b_shared, alpha, a, lda, b, beta, c, bias);
  }
  return st;
}

static lz_status gemm(lz_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k, int ta,
                      int tb, int b_shared, float alpha, const void *a, const void *b,
                      float beta, float *c) {
  if (m == 0 || n == 0 || batch == 0) return LZ_OK;
  if (k == 0) { /* empty sum: c = beta * c */
    for (int64_t i = 0; i < batch * m * n; i++) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return LZ_OK;
  }
  if (dt == LZ_BF16)
    return gemm_bf16(batch, m, n, k, ta, tb, b_shared, alpha, a, ta ? m : k, b, beta, c, NULL);
  return lz_sgemm_batch(batch, m, n, k, ta, tb, b_shared, alpha, a, ta ? m : k, b, 0, beta, c);
}

lz_status lz_gemm(lz_dtype dt, int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha,
                  const void *a, int64_t lda, const void *b, float beta, float *c) {
  if (lda == (ta ? m : k) || m == 0 || n == 0 || k == 0)
    return gemm(dt, 1, m, n, k, ta, tb, 0, alpha, a, b, beta, c);
  if (dt == LZ_BF16) return gemm_bf16(1, m, n, k, ta, tb, 0, alpha, a, lda, b, beta, c, NULL);
  return lz_sgemm_batch(1, m, n, k, ta, tb, 0, alpha, a, lda, b, 0, beta, c);
}

/* ----------------------------------------------------------------- matmul */

static lz_status shape_error(const char *op, const lz_tensor *a, const lz_tensor *b,
                             const lz_tensor *c, const char *why) {
  char ba[96], bb[96], bc[96];
  return lz_fail(LZ_ERR_INVALID, "%s: a %s, b %s, c %s: %s", op,
                 lz_tensor_describe(a, ba, sizeof ba), lz_tensor_describe(b, bb, sizeof bb),
                 lz_tensor_describe(c, bc, sizeof bc), why);
}

/* The sizes of c = op(a) @ op(b): the batch, m, n, and k of op(a) and of
 * op(b) (kb), which the checks compare. */
typedef struct {
  int batched;
  int64_t batch, m, n, k, kb;
} mm_dims;

static mm_dims matmul_dims(const lz_tensor *a, const lz_tensor *b, int trans_a, int trans_b) {
  mm_dims d;
  d.batched = a->ndim == 3;
  d.batch = d.batched ? a->shape[0] : 1;
  const int o = d.batched, ob = b->ndim == 3;
  d.m = trans_a ? a->shape[o + 1] : a->shape[o];
  d.k = trans_a ? a->shape[o] : a->shape[o + 1];
  d.kb = trans_b ? b->shape[ob + 1] : b->shape[ob];
  d.n = trans_b ? b->shape[ob] : b->shape[ob + 1];
  return d;
}

lz_status lz_matmul(lz_tensor *c, const lz_tensor *a, const lz_tensor *b, int trans_a,
                    int trans_b, float alpha, float beta) {
  const char *op = "matmul";
  const lz_op_args args = {.t = {c, (lz_tensor *)a, (lz_tensor *)b},
                           .i = {trans_a, trans_b}, .f = {alpha, beta}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_MATMUL, &args));
  LZ_TRY(lz_check_ndim(op, "a", a, 2, 3));
  LZ_TRY(lz_check_ndim(op, "b", b, 2, 3));
  LZ_TRY(lz_check_ndim(op, "c", c, 2, 3));
  const mm_dims d = matmul_dims(a, b, trans_a, trans_b);
  if (c->ndim != a->ndim || (b->ndim == 3 && !d.batched))
    return shape_error(op, a, b, c, "a and c must both be 2-D or both 3-D; b 3-D only if a is");
  if (d.batched && (c->shape[0] != d.batch || (b->ndim == 3 && b->shape[0] != d.batch)))
    return shape_error(op, a, b, c, "batch sizes differ");
  const int o = d.batched;
  if (d.k != d.kb) return shape_error(op, a, b, c, "inner dimensions of op(a) and op(b) differ");
  if (c->shape[o] != d.m || c->shape[o + 1] != d.n)
    return shape_error(op, a, b, c, "c must be [rows of op(a), columns of op(b)]");
  return lz_op_run(op, LZ_OP_MATMUL, &args);
}

lz_status lz_cpu_matmul(const lz_op_args *args) {
  const lz_tensor *a = args->t[1], *b = args->t[2];
  const int trans_a = (int)args->i[0], trans_b = (int)args->i[1];
  const mm_dims d = matmul_dims(a, b, trans_a, trans_b);
  return gemm(a->dtype, d.batch, d.m, d.n, d.k, trans_a != 0, trans_b != 0,
              d.batched && b->ndim == 2, args->f[0], a->data, b->data, args->f[1],
              args->t[0]->data);
}

/* ----------------------------------------------------------------- linear */

/* Shapes of a linear layer: x [..., C], w [OC, C], y [..., OC]. */
static lz_status linear_shapes(const char *op, const lz_tensor *x, const lz_tensor *w,
                               const lz_tensor *y, const char *yname, int64_t *rows,
                               int64_t *in, int64_t *outc) {
  LZ_TRY(lz_check_ndim(op, "x", x, 1, 4));
  LZ_TRY(lz_check_ndim(op, "w", w, 2, 2));
  LZ_TRY(lz_check_ndim(op, yname, y, 1, 4));
  *in = w->shape[1];
  *outc = w->shape[0];
  *rows = lz_rows(x);
  char bx[96], bw[96], by[96];
  if (lz_cols(x) != *in)
    return lz_fail(LZ_ERR_INVALID, "%s: x is %s but w is %s; x's last dimension must be %lld",
                   op, lz_tensor_describe(x, bx, sizeof bx), lz_tensor_describe(w, bw, sizeof bw),
                   (long long)*in);
  if (lz_cols(y) != *outc || lz_rows(y) != *rows)
    return lz_fail(LZ_ERR_INVALID, "%s: x is %s and w is %s, so %s must be [..., %lld] with "
                   "%lld rows (got %s)",
                   op, lz_tensor_describe(x, bx, sizeof bx), lz_tensor_describe(w, bw, sizeof bw),
                   yname, (long long)*outc, (long long)*rows,
                   lz_tensor_describe(y, by, sizeof by));
  return LZ_OK;
}

LZ_DISPATCH static void fill_rows(float *y, const float *bias, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; r++) memcpy(y + r * n, bias, (size_t)n * sizeof(float));
}

lz_status lz_linear_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *w,
                            const lz_tensor *bias) {
  const char *op = "linear_forward";
  int64_t rows, in, outc;
  const lz_op_args args = {.t = {out, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)bias}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_LINEAR_FORWARD, &args));
  LZ_TRY(linear_shapes(op, x, w, out, "out", &rows, &in, &outc));
  if (bias) LZ_TRY(lz_check_numel(op, "bias", bias, outc, "the rows of w"));
  return lz_op_run(op, LZ_OP_LINEAR_FORWARD, &args);
}

lz_status lz_cpu_linear_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0];
  const lz_tensor *x = a->t[1], *w = a->t[2], *bias = a->t[3];
  const int64_t rows = lz_rows(x), in = w->shape[1], outc = w->shape[0];
  if (rows == 0 || outc == 0) return LZ_OK;
  if (x->dtype == LZ_BF16)
    return gemm_bf16(1, rows, outc, in, 0, 1, 0, 1.0f, x->data, in, w->data, 0.0f, out->data,
                     bias ? bias->data : NULL);
  float beta = 0.0f;
  if (bias) {
    fill_rows(out->data, bias->data, rows, outc);
    beta = 1.0f;
  }
  return gemm(LZ_F32, 1, rows, outc, in, 0, 1, 0, 1.0f, x->data, w->data, beta, out->data);
}

/* db[j] += sum over rows of dy[r, j] (write: db[j] = the sum), column
 * blocks in parallel: each column's sum runs over rows in order, so the
 * result does not depend on threads. The sum starts from +0, so it is never
 * -0 and writing it gives the bits adding it to +0 gives. */
LZ_DISPATCH static void bias_grad_block(float *db, const void *dy, lz_dtype dt, int64_t rows,
                                        int64_t n, int64_t j0, int64_t j1, int write) {
  float acc[256];
  for (int64_t j = j0; j < j1; j++) acc[j - j0] = 0.0f;
  for (int64_t r = 0; r < rows; r++) {
    if (dt == LZ_BF16) {
      const uint16_t *row = (const uint16_t *)dy + r * n;
      for (int64_t j = j0; j < j1; j++) acc[j - j0] += lz_bf16_to_f32_inline(row[j]);
    } else {
      const float *row = (const float *)dy + r * n;
      for (int64_t j = j0; j < j1; j++) acc[j - j0] += row[j];
    }
  }
  if (write)
    for (int64_t j = j0; j < j1; j++) db[j] = acc[j - j0];
  else
    for (int64_t j = j0; j < j1; j++) db[j] += acc[j - j0];
}

/* blocks, slice, dw_at: the _norm variant's partials (blocks NULL: none). */
static lz_status linear_backward_op(const char *op, lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                    const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                    int write, double *blocks, int64_t slice, int64_t dw_at) {
  int64_t rows, in, outc;
  const lz_op_args args = {
      .t = {dx, dw, db, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w},
      .i = {write, dw_at, slice}, .blocks = blocks};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_LINEAR_BACKWARD, &args)); /* dy, x and w: one dtype */
  LZ_TRY(linear_shapes(op, x, w, dy, "dy", &rows, &in, &outc));
  if (dx) LZ_TRY(lz_check_numel(op, "dx", dx, rows * in, "the shape of x"));
  if (dw) LZ_TRY(lz_check_numel(op, "dw", dw, outc * in, "the shape of w"));
  if (db) LZ_TRY(lz_check_numel(op, "db", db, outc, "the rows of w"));
  return lz_op_run(op, LZ_OP_LINEAR_BACKWARD, &args);
}

lz_status lz_linear_backward(lz_tensor *dx, lz_tensor *dw, lz_tensor *db, const lz_tensor *dy,
                             const lz_tensor *x, const lz_tensor *w) {
  return linear_backward_op("linear_backward", dx, dw, db, dy, x, w, 0, NULL, 0, 0);
}

lz_status lz_linear_backward_write(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                   const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w) {
  return linear_backward_op("linear_backward_write", dx, dw, db, dy, x, w, 1, NULL, 0, 0);
}

lz_status lz_linear_backward_norm(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                  const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                  int write, double *blocks, int64_t slice_numel, int64_t dw_at) {
  const char *op = "linear_backward_norm";
  LZ_TRY(lz_check_norm_blocks(op, dw, blocks, slice_numel, dw_at, "linear_backward"));
  return linear_backward_op(op, dx, dw, db, dy, x, w, write != 0, blocks, slice_numel, dw_at);
}

lz_status lz_cpu_linear_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dw = a->t[1], *db = a->t[2];
  const lz_tensor *dy = a->t[3], *x = a->t[4], *w = a->t[5];
  const int64_t rows = lz_rows(x), in = w->shape[1], outc = w->shape[0];
  lz_dtype dt = x->dtype;
  const int write = a->i[0] != 0;
  if (dx) LZ_TRY(gemm(dt, 1, rows, in, outc, 0, 0, 0, 1.0f, dy->data, w->data, 0.0f, dx->data));
  if (dw)
    LZ_TRY(gemm(dt, 1, outc, in, rows, 1, 0, 0, 1.0f, dy->data, x->data, write ? 0.0f : 1.0f,
                dw->data));
  if (dw && a->blocks) /* the norm's partials, in cache */
    lz_sq_f32_take_blocks(dw->data, a->i[1], outc * in, a->i[2], a->blocks, 1);
  if (db && rows == 0 && write) memset(db->data, 0, (size_t)outc * sizeof(float));
  if (db && rows > 0) {
    const int64_t block = 256;
#pragma omp parallel for schedule(static) if (outc >= 2 * block)
    for (int64_t j0 = 0; j0 < outc; j0 += block)
      bias_grad_block(db->data, dy->data, dt, rows, outc, j0, j0 + block < outc ? j0 + block : outc,
                      write);
  }
  return LZ_OK;
}
