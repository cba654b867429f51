/* elementwise.c — flat elementwise ops over whole tensors (add, axpy, scale,
 * fill) and the two reductions the engine runs over gradient buffers before
 * each step: the squared norm (for clipping) and the inf/NaN check (for the
 * fp16 loss scaler).
 *
 * Tensors are treated as flat arrays: operands need the same element count,
 * not the same shape, so a flat buffer and a view over it combine. Their
 * dtypes are the declaration's (mem/lz_ops.def), checked by lz_op_run. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_sq_blocks.h" /* LZ_SQ_BLOCK, lz_sq_f32_blocks */

#include <math.h>   /* NAN: sq_norm_blocks' entries not taken */
#include <stdlib.h> /* malloc, free: sq_norm's partial sums */
#include <string.h> /* memcpy: add_sq_norm's write */
#include <immintrin.h> /* sq_norm's AVX-512 widening */

/* Elements per thread task; small tensors stay on one thread. */
#define BLOCK (1 << 15)
/* sq_norm: elements per partial sum, and partials per parallel pass. The
 * block size is fixed (not derived from the thread count), the partials of a
 * pass are added in index order, and the passes are added in order: the same
 * bits on any number of threads, whatever the pass size. A pass spans up to
 * 256M elements: one parallel region per pass, since on a busy machine each
 * region waits for every thread to get a core (a block's experts' gradient,
 * tens of millions of elements, took one region per million). */
#define SQ_BLOCK LZ_SQ_BLOCK
#define SQ_GROUP 65536
#define SQ_STACK 256 /* partials that live on the stack */
/* Double partial sums inside a block, so the loop vectorizes. */
#define LANES 8

static int64_t block_len(int64_t n, int64_t i0, int64_t block) {
  return n - i0 < block ? n - i0 : block;
}

/* ------------------------------------------------------ add, axpy, scale, fill */

/* No restrict anywhere below: out may be a or b. */
LZ_DISPATCH static void add_block(float *out, const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

lz_status lz_add(lz_tensor *out, const lz_tensor *a, const lz_tensor *b) {
  const char *op = "add";
  LZ_TRY(lz_check_present(op, "a", a));
  const int64_t n = lz_tensor_numel(a);
  LZ_TRY(lz_check_numel(op, "b", b, n, "the element count of a"));
  LZ_TRY(lz_check_numel(op, "out", out, n, "the element count of a"));
  LZ_OP_RUN(op, LZ_OP_ADD, .t = {out, (lz_tensor *)a, (lz_tensor *)b});
}

lz_status lz_cpu_add(const lz_op_args *args) {
  lz_tensor *out = args->t[0];
  const lz_tensor *a = args->t[1], *b = args->t[2];
  const int64_t n = lz_tensor_numel(a);
  float *o = out->data;
  const float *ap = a->data, *bp = b->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    add_block(o + i0, ap + i0, bp + i0, block_len(n, i0, BLOCK));
  return LZ_OK;
}

/* y += alpha x, one fused multiply-add an element where the CPU has FMA,
 * as torch's vector code computes lerp_ and add_(x, alpha) (Muon's momentum
 * is bitwise torch's, tests/ref/test5_muon.py). LZ_DISPATCH's "avx2" clone
 * does not imply FMA (an AVX2 part's loops are not contracted), hence these
 * forms of our own, picked once by lz_cpu_form_here; a CPU without AVX2 and
 * FMA (or AVX-512) rounds the product. */
typedef void (*axpy_fn)(float *y, float alpha, const float *x, int64_t n);

__attribute__((target("avx512f,fma"))) static void axpy_avx512(float *y, float alpha,
                                                               const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = fmaf(alpha, x[i], y[i]);
}

__attribute__((target("avx2,fma"))) static void axpy_avx2(float *y, float alpha, const float *x,
                                                          int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = fmaf(alpha, x[i], y[i]);
}

__attribute__((optimize("fp-contract=off"))) static void axpy_plain(float *y, float alpha,
                                                                    const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

static void axpy_block(float *y, float alpha, const float *x, int64_t n) {
  static axpy_fn form; /* (threads that race store the same form) */
  axpy_fn f = __atomic_load_n(&form, __ATOMIC_RELAXED);
  if (!f) {
    const lz_cpu_form here = lz_cpu_form_here();
    f = here == LZ_FORM_AVX512 ? axpy_avx512 : here == LZ_FORM_AVX2_FMA ? axpy_avx2 : axpy_plain;
    __atomic_store_n(&form, f, __ATOMIC_RELAXED);
  }
  f(y, alpha, x, n);
}

lz_status lz_axpy(lz_tensor *y, float alpha, const lz_tensor *x) {
  const char *op = "axpy";
  LZ_TRY(lz_check_present(op, "y", y));
  const int64_t n = lz_tensor_numel(y);
  LZ_TRY(lz_check_numel(op, "x", x, n, "the element count of y"));
  LZ_OP_RUN(op, LZ_OP_AXPY, .t = {y, (lz_tensor *)x}, .f = {alpha});
}

lz_status lz_cpu_axpy(const lz_op_args *a) {
  lz_tensor *y = a->t[0];
  const lz_tensor *x = a->t[1];
  const float alpha = a->f[0];
  const int64_t n = lz_tensor_numel(y);
  float *yp = y->data;
  const float *xp = x->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK)
    axpy_block(yp + i0, alpha, xp + i0, block_len(n, i0, BLOCK));
  return LZ_OK;
}

LZ_DISPATCH static void scale_f32_block(float *t, float s, int64_t n) {
  for (int64_t i = 0; i < n; i++) t[i] *= s;
}

LZ_DISPATCH static void scale_bf16_block(uint16_t *t, float s, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    t[i] = lz_bf16_from_f32_inline(lz_bf16_to_f32_inline(t[i]) * s);
}

/* f16 goes through the library's scalar conversions: no CPU path here keeps
 * big tensors in f16, so this need not be fast. */
static void scale_f16_block(uint16_t *t, float s, int64_t n) {
  for (int64_t i = 0; i < n; i++) t[i] = lz_f32_to_f16(lz_f16_to_f32(t[i]) * s);
}

lz_status lz_scale(lz_tensor *t, float s) {
  LZ_TRY(lz_check_present("scale", "t", t));
  LZ_OP_RUN("scale", LZ_OP_SCALE, .t = {t}, .f = {s});
}

lz_status lz_cpu_scale(const lz_op_args *a) {
  lz_tensor *t = a->t[0];
  const float s = a->f[0];
  const int64_t n = lz_tensor_numel(t);
  const lz_dtype dt = t->dtype;
  void *p = t->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int64_t len = block_len(n, i0, BLOCK);
    if (dt == LZ_F32) scale_f32_block((float *)p + i0, s, len);
    else if (dt == LZ_BF16) scale_bf16_block((uint16_t *)p + i0, s, len);
    else scale_f16_block((uint16_t *)p + i0, s, len);
  }
  return LZ_OK;
}

LZ_DISPATCH static void fill_f32_block(float *t, float v, int64_t n) {
  for (int64_t i = 0; i < n; i++) t[i] = v;
}

LZ_DISPATCH static void fill_u16_block(uint16_t *t, uint16_t v, int64_t n) {
  for (int64_t i = 0; i < n; i++) t[i] = v;
}

lz_status lz_fill(lz_tensor *t, float v) {
  LZ_TRY(lz_check_present("fill", "t", t));
  LZ_OP_RUN("fill", LZ_OP_FILL, .t = {t}, .f = {v});
}

lz_status lz_cpu_fill(const lz_op_args *a) {
  lz_tensor *t = a->t[0];
  const float v = a->f[0];
  const int64_t n = lz_tensor_numel(t);
  const lz_dtype dt = t->dtype;
  /* A half-precision fill writes one bit pattern, converted once. */
  const uint16_t v16 = dt == LZ_BF16 ? lz_f32_to_bf16(v) : lz_f32_to_f16(v);
  void *p = t->data;
#pragma omp parallel for schedule(static) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int64_t len = block_len(n, i0, BLOCK);
    if (dt == LZ_F32) fill_f32_block((float *)p + i0, v, len);
    else fill_u16_block((uint16_t *)p + i0, v16, len);
  }
  return LZ_OK;
}

/* ------------------------------------------------------------------ sq_norm */

LZ_DISPATCH static double sq_f32_block(const float *x, int64_t n) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += (double)x[i + l] * (double)x[i + l];
  double s = 0.0;
  for (int l = 0; l < LANES; l++) s += acc[l];
  for (; i < n; i++) s += (double)x[i] * (double)x[i];
  return s;
}

/* SQ_QUAD whole blocks' sums at once, each bitwise sq_f32_block's: every
 * block keeps its own LANES running sums, added in the same order. A block
 * alone is one chain of dependent adds per lane (about 2 elements a cycle,
 * the adds' latency); SQ_QUAD blocks side by side run SQ_QUAD chains. */
#define SQ_QUAD 4
typedef double sq_v8d __attribute__((vector_size(LANES * sizeof(double))));
typedef float sq_v8f __attribute__((vector_size(LANES * sizeof(float))));

/* Each block's LANES sums added in order, as sq_f32_block adds its acc. */
static void sq_quad_out(double acc[SQ_QUAD][LANES], double out[SQ_QUAD]) {
  for (int b = 0; b < SQ_QUAD; b++) {
    double s = 0.0;
    for (int l = 0; l < LANES; l++) s += acc[b][l];
    out[b] = s;
  }
}

LZ_DISPATCH static void sq_f32_quad_vec(const float *x, double out[SQ_QUAD]) {
  sq_v8d acc[SQ_QUAD] = {{0}};
  for (int64_t i = 0; i < SQ_BLOCK; i += LANES)
    for (int b = 0; b < SQ_QUAD; b++) {
      sq_v8f f;
      memcpy(&f, x + (int64_t)b * SQ_BLOCK + i, sizeof f);
      const sq_v8d v = __builtin_convertvector(f, sq_v8d);
      acc[b] += v * v; /* v * v is exact in double: with or without an fma, the same sum */
    }
  double a[SQ_QUAD][LANES];
  memcpy(a, acc, sizeof a);
  sq_quad_out(a, out);
}

/* AVX-512: each 8 floats widened by one instruction (the generic vectors'
 * code widens them in halves). */
__attribute__((target("avx512f"))) static void sq_f32_quad_avx512(const float *x,
                                                                   double out[SQ_QUAD]) {
  __m512d acc[SQ_QUAD];
  for (int b = 0; b < SQ_QUAD; b++) acc[b] = _mm512_setzero_pd();
  for (int64_t i = 0; i < SQ_BLOCK; i += LANES)
    for (int b = 0; b < SQ_QUAD; b++) {
      const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + (int64_t)b * SQ_BLOCK + i));
      acc[b] = _mm512_fmadd_pd(v, v, acc[b]);
    }
  double a[SQ_QUAD][LANES];
  for (int b = 0; b < SQ_QUAD; b++) _mm512_storeu_pd(a[b], acc[b]);
  sq_quad_out(a, out);
}

/* Once per SQ_QUAD blocks: the feature test is a load (no lz_cpu_has's
 * string compares in the loop). */
static void sq_f32_quad(const float *x, double out[SQ_QUAD]) {
  if (__builtin_cpu_supports("avx512f")) sq_f32_quad_avx512(x, out);
  else sq_f32_quad_vec(x, out);
}

LZ_DISPATCH static double sq_bf16_block(const uint16_t *x, int64_t n) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) {
      double v = lz_bf16_to_f32_inline(x[i + l]);
      acc[l] += v * v;
    }
  double s = 0.0;
  for (int l = 0; l < LANES; l++) s += acc[l];
  for (; i < n; i++) {
    double v = lz_bf16_to_f32_inline(x[i]);
    s += v * v;
  }
  return s;
}

static double sq_f16_block(const uint16_t *x, int64_t n) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) {
      double v = lz_f16_to_f32(x[i + l]);
      acc[l] += v * v;
    }
  double s = 0.0;
  for (int l = 0; l < LANES; l++) s += acc[l];
  for (; i < n; i++) {
    double v = lz_f16_to_f32(x[i]);
    s += v * v;
  }
  return s;
}

/* The one summation order of sq_norm and add_sq_norm: blocks of SQ_BLOCK
 * elements, each block's sum from block(ctx, i0, len), the partials of a
 * group added in index order, the groups in order. quad, where given, sums
 * SQ_QUAD whole blocks from i0 at once, each as block would. */
typedef double (*sq_block_fn)(void *ctx, int64_t i0, int64_t len);
typedef void (*sq_quad_fn)(void *ctx, int64_t i0, double out[SQ_QUAD]);

static lz_status sq_sum(const char *op, int64_t n, sq_block_fn block, sq_quad_fn quad, void *ctx,
                        double *out) {
  const int64_t blocks = (n + SQ_BLOCK - 1) / SQ_BLOCK;
  const int64_t group = blocks < SQ_GROUP ? blocks : SQ_GROUP;
  double stack[SQ_STACK];
  double *partial = group <= SQ_STACK ? stack : malloc((size_t)group * sizeof(double));
  if (!partial)
    return lz_fail(LZ_ERR_NOMEM, "%s: out of memory for %lld partial sums", op, (long long)group);
  double total = 0.0;
  for (int64_t g0 = 0; g0 < n; g0 += (int64_t)SQ_BLOCK * group) {
    const int64_t g_len = block_len(n, g0, (int64_t)SQ_BLOCK * group);
    const int64_t nb = (g_len + SQ_BLOCK - 1) / SQ_BLOCK;
    const int64_t nq = (nb + SQ_QUAD - 1) / SQ_QUAD;
#pragma omp parallel for schedule(static) if (nb > 8)
    for (int64_t q = 0; q < nq; q++) {
      const int64_t k0 = q * SQ_QUAD, i0 = g0 + k0 * SQ_BLOCK;
      if (quad && i0 + SQ_QUAD * SQ_BLOCK <= g0 + g_len) { /* SQ_QUAD whole blocks of the group */
        quad(ctx, i0, partial + k0);
        continue;
      }
      for (int64_t k = k0; k < nb && k < k0 + SQ_QUAD; k++) {
        const int64_t b0 = g0 + k * SQ_BLOCK;
        partial[k] = block(ctx, b0, block_len(n, b0, SQ_BLOCK));
      }
    }
    for (int64_t k = 0; k < nb; k++) total += partial[k];
  }
  if (partial != stack) free(partial);
  *out = total;
  return LZ_OK;
}

static double sq_block(void *ctx, int64_t i0, int64_t len) {
  const lz_tensor *t = ctx;
  if (t->dtype == LZ_F32) return sq_f32_block((const float *)t->data + i0, len);
  if (t->dtype == LZ_BF16) return sq_bf16_block((const uint16_t *)t->data + i0, len);
  return sq_f16_block((const uint16_t *)t->data + i0, len);
}

static void sq_quad(void *ctx, int64_t i0, double out[SQ_QUAD]) {
  const lz_tensor *t = ctx;
  sq_f32_quad((const float *)t->data + i0, out);
}

lz_status lz_sq_norm(const lz_tensor *t, double *out) {
  const char *op = "sq_norm";
  if (!out) return lz_fail(LZ_ERR_INVALID, "%s: out is NULL", op);
  *out = 0.0;
  LZ_TRY(lz_check_present(op, "t", t));
  LZ_OP_RUN(op, LZ_OP_SQ_NORM, .t = {(lz_tensor *)t}, .out_f64 = out);
}

lz_status lz_cpu_sq_norm(const lz_op_args *a) {
  const lz_tensor *t = a->t[0];
  return sq_sum("sq_norm", lz_tensor_numel(t), sq_block, t->dtype == LZ_F32 ? sq_quad : NULL,
                (void *)t, a->out_f64);
}

lz_status lz_add_sq_norm(lz_tensor *y, const lz_tensor *x, int write, double *out) {
  const char *op = "add_sq_norm";
  if (!out) return lz_fail(LZ_ERR_INVALID, "%s: out is NULL", op);
  *out = 0.0;
  LZ_TRY(lz_check_present(op, "y", y));
  LZ_TRY(lz_check_numel(op, "x", x, lz_tensor_numel(y), "the element count of y"));
  LZ_OP_RUN(op, LZ_OP_ADD_SQ_NORM, .t = {y, (lz_tensor *)x}, .i = {write != 0}, .out_f64 = out);
}

typedef struct {
  float *y;
  const float *x;
  int write;
} add_sq_ctx;

/* Each block first added into (axpy's arithmetic, alpha 1) or copied: its
 * squares are read while it is in cache. Returns y's block. */
static const float *add_sq_add(const add_sq_ctx *c, int64_t i0, int64_t len) {
  if (c->write) memcpy(c->y + i0, c->x + i0, (size_t)len * sizeof(float));
  else axpy_block(c->y + i0, 1.0f, c->x + i0, len);
  return c->y + i0;
}

static double add_sq_block(void *ctx, int64_t i0, int64_t len) {
  return sq_f32_block(add_sq_add(ctx, i0, len), len);
}

static void add_sq_quad(void *ctx, int64_t i0, double out[SQ_QUAD]) {
  sq_f32_quad(add_sq_add(ctx, i0, (int64_t)SQ_QUAD * SQ_BLOCK), out);
}

lz_status lz_cpu_add_sq_norm(const lz_op_args *a) {
  add_sq_ctx c = {a->t[0]->data, a->t[1]->data, a->i[0] != 0};
  return sq_sum("add_sq_norm", lz_tensor_numel(a->t[0]), add_sq_block, add_sq_quad, &c,
                a->out_f64);
}

/* ---------------------------------------------- block partials, sq_norm_blocks */

void lz_sq_f32_blocks(const float *x, int64_t len, double *out) {
  int64_t i = 0, k = 0;
  for (; i + (int64_t)SQ_QUAD * SQ_BLOCK <= len; i += (int64_t)SQ_QUAD * SQ_BLOCK, k += SQ_QUAD)
    sq_f32_quad(x + i, out + k);
  for (; i < len; i += SQ_BLOCK, k++) out[k] = sq_f32_block(x + i, block_len(len, i, SQ_BLOCK));
}

void lz_sq_f32_take_blocks(const float *p, int64_t at, int64_t n, int64_t slice, double *blocks,
                           int parallel) {
  if (n <= 0) return;
  const int64_t B = SQ_BLOCK, k0 = (at + B - 1) / B;
  const int64_t k1 = at + n == slice ? (slice + B - 1) / B : (at + n) / B;
  if (k1 <= k0) return;
  if (!p) {
    for (int64_t k = k0; k < k1; k++) blocks[k] = 0.0; /* a sum of +0 squares */
    return;
  }
  const float *from = p + (k0 * B - at);
  const int64_t len = (k1 * B < slice ? k1 * B : slice) - k0 * B;
  if (!parallel) {
    lz_sq_f32_blocks(from, len, blocks + k0);
    return;
  }
  const int64_t quads = (k1 - k0 + SQ_QUAD - 1) / SQ_QUAD, step = (int64_t)SQ_QUAD * B;
#pragma omp parallel for schedule(static) if (quads > 1)
  for (int64_t q = 0; q < quads; q++)
    lz_sq_f32_blocks(from + q * step, block_len(len, q * step, step), blocks + k0 + q * SQ_QUAD);
}

lz_status lz_check_norm_blocks(const char *op, const lz_tensor *dw, const double *blocks,
                               int64_t slice_numel, int64_t dw_at, const char *plain) {
  if (!blocks)
    return lz_fail(LZ_ERR_INVALID, "%s: blocks is NULL; pass one double per %d elements of the "
                   "slice, or call %s", op, SQ_BLOCK, plain);
  if (dw && (dw_at < 0 || dw_at + lz_tensor_numel(dw) > slice_numel))
    return lz_fail(LZ_ERR_INVALID, "%s: dw (%lld elements) at element %lld does not lie in a "
                   "slice of %lld; dw_at must be 0 .. slice_numel - dw's elements", op,
                   (long long)lz_tensor_numel(dw), (long long)dw_at, (long long)slice_numel);
  return LZ_OK;
}

int64_t lz_sq_norm_block_size(void) { return SQ_BLOCK; }

lz_status lz_sq_norm_blocks(const lz_tensor *t, double *blocks, double *out) {
  const char *op = "sq_norm_blocks";
  if (!out) return lz_fail(LZ_ERR_INVALID, "%s: out is NULL", op);
  *out = 0.0;
  LZ_TRY(lz_check_norm_blocks(op, NULL, blocks, 0, 0, "sq_norm"));
  LZ_TRY(lz_check_present(op, "t", t));
  LZ_OP_RUN(op, LZ_OP_SQ_NORM_BLOCKS, .t = {(lz_tensor *)t}, .blocks = blocks, .out_f64 = out);
}

typedef struct {
  const float *x;
  double *blocks;
} sq_given_ctx;

/* A NaN entry is a block's sum not taken (or a block holding NaN, whose
 * sum read again is NaN too). */
static int sq_given(double v) { return v == v; }

static double sq_given_block(void *ctx, int64_t i0, int64_t len) {
  const sq_given_ctx *c = ctx;
  double *b = c->blocks + i0 / SQ_BLOCK;
  const double s = sq_given(*b) ? *b : sq_f32_block(c->x + i0, len);
  *b = NAN;
  return s;
}

static void sq_given_quad(void *ctx, int64_t i0, double out[SQ_QUAD]) {
  const sq_given_ctx *c = ctx;
  double *b = c->blocks + i0 / SQ_BLOCK;
  int known = 0;
  for (int k = 0; k < SQ_QUAD; k++) known += sq_given(b[k]);
  if (known == 0) sq_f32_quad(c->x + i0, out);
  else
    for (int k = 0; k < SQ_QUAD; k++)
      out[k] = sq_given(b[k]) ? b[k] : sq_f32_block(c->x + i0 + (int64_t)k * SQ_BLOCK, SQ_BLOCK);
  for (int k = 0; k < SQ_QUAD; k++) b[k] = NAN;
}

lz_status lz_cpu_sq_norm_blocks(const lz_op_args *a) {
  sq_given_ctx c = {a->t[0]->data, a->blocks};
  return sq_sum("sq_norm_blocks", lz_tensor_numel(a->t[0]), sq_given_block, sq_given_quad, &c,
                a->out_f64);
}

/* -------------------------------------------------------------- has_inf_nan */

/* An exponent field of all ones is Inf or NaN, whatever the mantissa. */
LZ_DISPATCH static int inf_nan_f32_block(const float *x, int64_t n) {
  int found = 0;
  for (int64_t i = 0; i < n; i++) found |= (lz_f32_bits(x[i]) & 0x7f800000u) == 0x7f800000u;
  return found;
}

LZ_DISPATCH static int inf_nan_u16_block(const uint16_t *x, uint16_t exp_mask, int64_t n) {
  int found = 0;
  for (int64_t i = 0; i < n; i++) found |= (x[i] & exp_mask) == exp_mask;
  return found;
}

lz_status lz_has_inf_nan(const lz_tensor *t, int *out) {
  const char *op = "has_inf_nan";
  if (!out) return lz_fail(LZ_ERR_INVALID, "%s: out is NULL", op);
  *out = 0;
  LZ_TRY(lz_check_present(op, "t", t));
  LZ_OP_RUN(op, LZ_OP_HAS_INF_NAN, .t = {(lz_tensor *)t}, .out_int = out);
}

lz_status lz_cpu_has_inf_nan(const lz_op_args *a) {
  const lz_tensor *t = a->t[0];
  int *out = a->out_int;
  const int64_t n = lz_tensor_numel(t);
  const lz_dtype dt = t->dtype;
  const uint16_t mask = dt == LZ_BF16 ? 0x7f80u : 0x7c00u;
  const void *p = t->data;
  int found = 0;
#pragma omp parallel for schedule(static) reduction(| : found) if (n > BLOCK)
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int64_t len = block_len(n, i0, BLOCK);
    if (dt == LZ_F32) found |= inf_nan_f32_block((const float *)p + i0, len);
    else found |= inf_nan_u16_block((const uint16_t *)p + i0, mask, len);
  }
  *out = found;
  return LZ_OK;
}
