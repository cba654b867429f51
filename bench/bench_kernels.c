/* bench_kernels.c — the CPU kernels against their yardsticks, in one run.
 *
 * GEMMs: the linear layers of GPT-2 124M (qkv, attn proj, fc, fc proj, LM
 * head) at several row counts (B*T), forward and the two backward GEMMs
 * (dx = dy w, dw += dy^T x), in GFLOP/s, through
 *   ours f32   lz_linear_forward / lz_linear_backward on f32 tensors
 *   dnnl f32   raw dnnl_sgemm on the same buffers
 *   blas f32   raw OpenBLAS cblas_sgemm on the same buffers
 *   ours bf16  the same lz calls on bf16 tensors
 *   dnnl bf16  a raw oneDNN matmul primitive (bf16 in, f32 out), built once
 * and the ratios ours/raw oneDNN. The implementations take turns within each
 * repetition, so a noisy neighbour hurts them alike; figures are medians.
 *
 * Then the fwd+bwd time of attention, layernorm, GELU and cross-entropy, as
 * lines "OP <op> <shape> <ms>" that bench/bench-kernels joins with the same
 * ops timed in PyTorch (bench/bench_kernels_torch.py).
 *
 * Then the experts' grouped GEMM against one dense GEMM of the same FLOPs,
 * as lines "MOE ... ratio <grouped / dense> (loop <per-expert loop / dense>)".
 *
 * Then the tiled attention at T 2048 (B1, 12 heads of 64, causal), fp32 and
 * bf16 entries, forward + backward in GFLOP/s counting per head 4 T^2 d
 * forward and 10 T^2 d backward (recomputation), halved for the mask,
 * beside the same run's oneDNN bf16 2048^3 GEMM: one line "FLASH ...".
 *
 * Then the generation path's attention (lz_attention_decode) at 2048
 * positions, Llama's grouping (12 query heads of 64 on 4 key/value heads):
 * a prompt's call (2048 new positions, empty rows) and one decoding step
 * against the full cache, fp32 and bf16 caches: one line "DECODE ...".
 *
 *   bench_kernels [--rows "256 1024"] [--no-gemm] [--no-ops] [--no-moe] [--no-flash]
 *                 [--no-decode]
 * Threads: OMP_NUM_THREADS for ours and oneDNN, OPENBLAS_NUM_THREADS for OpenBLAS
 * (bench/bench-kernels sets both). */
#include "luazero.h"

#include <cblas.h>  /* cblas_sgemm, openblas_set_num_threads: OpenBLAS */
#include <dnnl.h>   /* dnnl_sgemm and the bf16 matmul primitive */
#include <math.h>   /* sqrt */
#include <stdio.h>  /* printf */
#include <stdlib.h> /* qsort, strtol, exit */
#include <string.h> /* strcmp */
#include <time.h>   /* clock_gettime */

#include "bench_timing.h" /* now_s, median, best */

#define CHECK_LZ(call)                                                             \
  do {                                                                             \
    lz_status st_ = (call);                                                        \
    if (st_ != LZ_OK) {                                                            \
      fprintf(stderr, "bench_kernels: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
              lz_last_error());                                                    \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

#define CHECK_DNNL(call)                                                                         \
  do {                                                                                           \
    dnnl_status_t st_ = (call);                                                                  \
    if (st_ != dnnl_success) {                                                                   \
      fprintf(stderr, "bench_kernels: %s:%d: %s: oneDNN status %d\n", __FILE__, __LINE__, #call, \
              (int)st_);                                                                         \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)

/* ---------------------------------------------------------------- timing */




/* Repetitions for a case whose one warm-up run took `t` seconds: at least
 * `lo`, about `budget` seconds in all, at most 50. */
static int reps_for(double t, int lo, double budget) {
  int r = t > 0 ? (int)(budget / t) : 50;
  return r < lo ? lo : r > 50 ? 50 : r;
}

/* --------------------------------------------------------------- tensors */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { /* uniform in [-1, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 40) * 0x1p-23 - 1.0);
}

static lz_tensor *tensor(lz_dtype dt, int ndim, int64_t d0, int64_t d1, int64_t d2) {
  int64_t shape[3] = {d0, d1, d2};
  lz_tensor *t = NULL;
  CHECK_LZ(lz_tensor_new(&t, dt, ndim, shape, LZ_MEM_WORKSPACE));
  return t;
}

static lz_tensor *random_f32(int ndim, int64_t d0, int64_t d1, int64_t d2, float scale) {
  lz_tensor *t = tensor(LZ_F32, ndim, d0, d1, d2);
  float *p = t->data;
  for (int64_t i = 0; i < lz_tensor_numel(t); i++) p[i] = scale * frand();
  return t;
}

static lz_tensor *to_bf16(const lz_tensor *src) {
  lz_tensor *t = tensor(LZ_BF16, src->ndim, src->shape[0], src->shape[1], src->shape[2]);
  CHECK_LZ(lz_tensor_copy(t, src));
  return t;
}

/* ------------------------------------------------- raw oneDNN bf16 matmul */

static dnnl_engine_t engine;
static dnnl_stream_t stream;

typedef struct {
  dnnl_primitive_t prim;
  dnnl_memory_t a, b, c;
} raw_bf16;

/* Row-major [rows, cols] stored transposed when `trans`. */
static void md2(dnnl_memory_desc_t *md, int64_t rows, int64_t cols, int trans,
                dnnl_data_type_t dt) {
  dnnl_dims_t dims = {rows, cols};
  dnnl_dims_t strides = {trans ? 1 : cols, trans ? rows : 1};
  CHECK_DNNL(dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides));
}

/* c[m, n] (f32) = op(a)[m, k] @ op(b)[k, n] + beta c, a and b bf16. */
static raw_bf16 raw_bf16_new(int64_t m, int64_t n, int64_t k, int ta, int tb, float beta) {
  if (!engine) {
    CHECK_DNNL(dnnl_engine_create(&engine, dnnl_cpu, 0));
    CHECK_DNNL(dnnl_stream_create(&stream, engine, dnnl_stream_default_flags));
  }
  dnnl_memory_desc_t a_md, b_md, c_md;
  md2(&a_md, m, k, ta, dnnl_bf16);
  md2(&b_md, k, n, tb, dnnl_bf16);
  md2(&c_md, m, n, 0, dnnl_f32);
  dnnl_matmul_desc_t desc;
  CHECK_DNNL(dnnl_matmul_desc_init(&desc, &a_md, &b_md, NULL, &c_md));
  dnnl_primitive_attr_t attr;
  CHECK_DNNL(dnnl_primitive_attr_create(&attr));
  dnnl_post_ops_t ops = NULL;
  if (beta != 0.0f) {
    CHECK_DNNL(dnnl_post_ops_create(&ops));
    CHECK_DNNL(dnnl_post_ops_append_sum(ops, beta));
    CHECK_DNNL(dnnl_primitive_attr_set_post_ops(attr, ops));
  }
  dnnl_primitive_desc_t pd;
  CHECK_DNNL(dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL));
  raw_bf16 r;
  CHECK_DNNL(dnnl_primitive_create(&r.prim, pd));
  dnnl_primitive_desc_destroy(pd);
  if (ops) dnnl_post_ops_destroy(ops);
  dnnl_primitive_attr_destroy(attr);
  CHECK_DNNL(dnnl_memory_create(&r.a, &a_md, engine, DNNL_MEMORY_NONE));
  CHECK_DNNL(dnnl_memory_create(&r.b, &b_md, engine, DNNL_MEMORY_NONE));
  CHECK_DNNL(dnnl_memory_create(&r.c, &c_md, engine, DNNL_MEMORY_NONE));
  return r;
}

static void raw_bf16_run(raw_bf16 *r, const void *a, const void *b, float *c) {
  CHECK_DNNL(dnnl_memory_set_data_handle(r->a, (void *)a));
  CHECK_DNNL(dnnl_memory_set_data_handle(r->b, (void *)b));
  CHECK_DNNL(dnnl_memory_set_data_handle(r->c, c));
  dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, r->a}, {DNNL_ARG_WEIGHTS, r->b}, {DNNL_ARG_DST, r->c}};
  CHECK_DNNL(dnnl_primitive_execute(r->prim, stream, 3, args));
  CHECK_DNNL(dnnl_stream_wait(stream));
}

static void raw_bf16_free(raw_bf16 *r) {
  dnnl_primitive_destroy(r->prim);
  dnnl_memory_destroy(r->a);
  dnnl_memory_destroy(r->b);
  dnnl_memory_destroy(r->c);
}

/* ------------------------------------------------------------------ GEMMs */

enum { OURS_F32, DNNL_F32, BLAS_F32, OURS_BF16, DNNL_BF16, N_IMPL };
static const char *impl_name[N_IMPL] = {"ours f32", "dnnl f32", "blas f32", "ours bf16",
                                        "dnnl bf16"};
enum { FWD, DX, DW };
static const char *dir_name[4] = {"fwd", "bwd dx", "bwd dw", "dw written"};

typedef struct {
  const char *name;
  int64_t in, out; /* C -> OC */
} layer;

static const layer gpt2_layers[] = {
    {"qkv", 768, 2304},     {"attn proj", 768, 768}, {"fc", 768, 3072},
    {"fc proj", 3072, 768}, {"lm head", 768, 50257},
};

typedef struct {
  lz_tensor *x, *w, *bias, *y, *dy, *dx, *dw; /* f32 */
  lz_tensor *xb, *wb, *dyb;                   /* bf16 copies */
  raw_bf16 raw[3];
  int bf16;
} linear_bufs;

/* One GEMM of one implementation. */
static void run_gemm(linear_bufs *L, int impl, int dir, int64_t R, int64_t C, int64_t OC) {
  float *x = L->x->data, *w = L->w->data, *y = L->y->data, *dy = L->dy->data;
  float *dx = L->dx->data, *dw = L->dw->data;
  switch (impl) {
    case OURS_F32:
    case OURS_BF16: {
      int bf = impl == OURS_BF16;
      lz_tensor *xt = bf ? L->xb : L->x, *wt = bf ? L->wb : L->w, *dyt = bf ? L->dyb : L->dy;
      if (dir == FWD) CHECK_LZ(lz_linear_forward(L->y, xt, wt, L->bias));
      if (dir == DX) CHECK_LZ(lz_linear_backward(L->dx, NULL, NULL, dyt, xt, wt));
      if (dir == DW) CHECK_LZ(lz_linear_backward(NULL, L->dw, NULL, dyt, xt, wt));
      break;
    }
    case DNNL_F32:
      if (dir == FWD) CHECK_DNNL(dnnl_sgemm('N', 'T', R, OC, C, 1.0f, x, C, w, C, 0.0f, y, OC));
      if (dir == DX) CHECK_DNNL(dnnl_sgemm('N', 'N', R, C, OC, 1.0f, dy, OC, w, C, 0.0f, dx, C));
      if (dir == DW) CHECK_DNNL(dnnl_sgemm('T', 'N', OC, C, R, 1.0f, dy, OC, x, C, 1.0f, dw, C));
      break;
    case BLAS_F32:
      if (dir == FWD)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, OC, C, 1.0f, x, C, w, C, 0.0f, y,
                    OC);
      if (dir == DX)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, C, OC, 1.0f, dy, OC, w, C, 0.0f,
                    dx, C);
      if (dir == DW)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, R, 1.0f, dy, OC, x, C, 1.0f, dw,
                    C);
      break;
    case DNNL_BF16:
      if (dir == FWD) raw_bf16_run(&L->raw[FWD], L->xb->data, L->wb->data, y);
      if (dir == DX) raw_bf16_run(&L->raw[DX], L->dyb->data, L->wb->data, dx);
      if (dir == DW) raw_bf16_run(&L->raw[DW], L->dyb->data, L->xb->data, dw);
      break;
  }
}

static double time_gemm(linear_bufs *L, int impl, int dir, int64_t R, int64_t C, int64_t OC) {
  double t0 = now_s();
  run_gemm(L, impl, dir, R, C, OC);
  return now_s() - t0;
}

/* GFLOP/s summed over a row count: total flops / total median time. */
typedef struct {
  double flops, secs[N_IMPL];
} totals;

/* ratio: ours / raw oneDNN in GFLOP/s; NULL: the ratio of the times given. */
static void print_gflops_row(const char *label, double flops, const double *secs,
                             const double *ratio, int bf16) {
  double g[N_IMPL];
  for (int i = 0; i < N_IMPL; i++) g[i] = secs[i] > 0 ? flops / secs[i] / 1e9 : 0.0;
  double r32 = ratio ? ratio[0] : g[OURS_F32] / g[DNNL_F32];
  double r16 = ratio ? ratio[1] : g[OURS_BF16] / g[DNNL_BF16];
  printf("%-32s | %8.1f %8.1f %8.1f %6.3f |", label, g[OURS_F32], g[DNNL_F32], g[BLAS_F32], r32);
  if (bf16)
    printf(" %9.1f %9.1f %6.3f\n", g[OURS_BF16], g[DNNL_BF16], r16);
  else
    printf(" %9s %9s %6s\n", "-", "-", "-");
}

/* Median over repetitions of t[raw][r] / t[ours][r]: the two ran back to back,
 * so a slow moment of the machine cancels out of each pair. */
static double paired_ratio(const double *ours, const double *raw, int reps) {
  double q[50];
  for (int r = 0; r < reps; r++) q[r] = raw[r] / ours[r];
  return median(q, reps);
}

static void bench_gemms(const int64_t *rows, int nrows, int bf16) {
  printf(
      "# GEMMs of GPT-2 124M's linear layers, GFLOP/s (median), %d threads; ratio = "
      "ours / raw oneDNN\n# (per GEMM: median of back-to-back pairs; 'all layers': total "
      "flops / summed medians)\n",
      lz_threads_get());
  printf("%-32s | %8s %8s %8s %6s | %9s %9s %6s\n", "layer  rows x in -> out  dir",
         impl_name[OURS_F32], impl_name[DNNL_F32], impl_name[BLAS_F32], "ratio",
         impl_name[OURS_BF16], impl_name[DNNL_BF16], "ratio");
  totals all = {0};
  for (int ri = 0; ri < nrows; ri++) {
    int64_t R = rows[ri];
    totals sum = {0};
    for (size_t li = 0; li < sizeof gpt2_layers / sizeof *gpt2_layers; li++) {
      const layer *ly = &gpt2_layers[li];
      int64_t C = ly->in, OC = ly->out;
      linear_bufs L = {0};
      L.bf16 = bf16;
      L.x = random_f32(2, R, C, 0, 1.0f);
      L.w = random_f32(2, OC, C, 0, 0.02f);
      L.bias = random_f32(1, OC, 0, 0, 0.1f);
      L.y = tensor(LZ_F32, 2, R, OC, 0);
      L.dy = random_f32(2, R, OC, 0, 1e-3f);
      L.dx = tensor(LZ_F32, 2, R, C, 0);
      L.dw = random_f32(2, OC, C, 0, 0.0f);
      if (bf16) {
        L.xb = to_bf16(L.x);
        L.wb = to_bf16(L.w);
        L.dyb = to_bf16(L.dy);
        L.raw[FWD] = raw_bf16_new(R, OC, C, 0, 1, 0.0f);
        L.raw[DX] = raw_bf16_new(R, C, OC, 0, 0, 0.0f);
        L.raw[DW] = raw_bf16_new(OC, C, R, 1, 0, 1.0f);
      }
      double flops = 2.0 * (double)R * (double)C * (double)OC;
      for (int dir = 0; dir < 3; dir++) {
        int nimpl = bf16 ? N_IMPL : OURS_BF16;
        double warm = 0.0;
        for (int i = 0; i < nimpl; i++) { /* warm-up: caches, primitives, pages */
          double t = time_gemm(&L, i, dir, R, C, OC);
          if (i == DNNL_F32) warm = t;
        }
        int reps = reps_for(warm * nimpl, 5, 1.5);
        double t[N_IMPL][50], med[N_IMPL] = {0};
        /* Take turns so noise hits all alike. OpenBLAS's threads spin for a
         * while after a call and slow whatever runs next, so it goes first;
         * each of ours and its oneDNN yardstick swap places every repetition. */
        static const int order[2][N_IMPL] = {
            {BLAS_F32, OURS_F32, DNNL_F32, OURS_BF16, DNNL_BF16},
            {BLAS_F32, DNNL_F32, OURS_F32, DNNL_BF16, OURS_BF16}};
        for (int r = 0; r < reps; r++)
          for (int j = 0; j < N_IMPL; j++) {
            int i = order[r & 1][j];
            if (i < nimpl) t[i][r] = time_gemm(&L, i, dir, R, C, OC);
          }
        double ratio[2] = {paired_ratio(t[OURS_F32], t[DNNL_F32], reps),
                           bf16 ? paired_ratio(t[OURS_BF16], t[DNNL_BF16], reps) : 0.0};
        for (int i = 0; i < nimpl; i++) med[i] = median(t[i], reps);
        char label[64];
        snprintf(label, sizeof label, "%-9s %4lld x %4lld->%-5lld %s", ly->name, (long long)R,
                 (long long)C, (long long)OC, dir_name[dir]);
        print_gflops_row(label, flops, med, ratio, bf16);
        fflush(stdout);
        sum.flops += flops;
        for (int i = 0; i < N_IMPL; i++) sum.secs[i] += med[i];
      }
      if (bf16)
        for (int d = 0; d < 3; d++) raw_bf16_free(&L.raw[d]);
      lz_tensor *all_t[] = {L.x, L.w, L.bias, L.y, L.dy, L.dx, L.dw, L.xb, L.wb, L.dyb};
      for (size_t i = 0; i < sizeof all_t / sizeof *all_t; i++) lz_tensor_free(all_t[i]);
    }
    char label[64];
    snprintf(label, sizeof label, "all layers, %lld rows", (long long)R);
    print_gflops_row(label, sum.flops, sum.secs, NULL, bf16);
    all.flops += sum.flops;
    for (int i = 0; i < N_IMPL; i++) all.secs[i] += sum.secs[i];
  }
  if (nrows > 1) print_gflops_row("all layers, all rows", all.flops, all.secs, NULL, bf16);
  printf("\n");
}

/* -------------------------------------------------------------- the ops */

/* Median of `reps` fwd+bwd runs (after one warm-up), in milliseconds. */
typedef void (*step_fn)(void *ctx);

static double time_ms(step_fn fn, void *ctx, int lo) {
  double t0 = now_s();
  fn(ctx);
  int reps = reps_for(now_s() - t0, lo, 2.0);
  double t[50];
  for (int r = 0; r < reps; r++) {
    double s = now_s();
    fn(ctx);
    t[r] = now_s() - s;
  }
  return 1e3 * median(t, reps);
}

typedef struct {
  int nh;
  lz_tensor *qkv, *out, *lse, *dout, *dqkv;
} attn_ctx;
static void attn_step(void *p) {
  attn_ctx *c = p;
  CHECK_LZ(lz_attention_forward(c->out, c->lse, c->qkv, c->nh));
  CHECK_LZ(lz_attention_backward(c->dqkv, c->dout, c->qkv, c->out, c->lse, c->nh));
}

typedef struct {
  lz_tensor *x, *w, *b, *out, *mean, *rstd, *dy, *dx, *dw, *db;
} ln_ctx;
static void ln_step(void *p) {
  ln_ctx *c = p;
  CHECK_LZ(lz_layernorm_forward(c->out, c->mean, c->rstd, c->x, c->w, c->b, 1e-5f));
  CHECK_LZ(lz_layernorm_backward(c->dx, c->dw, c->db, c->dy, c->x, c->w, c->mean, c->rstd));
}

typedef struct {
  lz_tensor *x, *out, *dy, *dx;
} gelu_ctx;
static void gelu_step(void *p) {
  gelu_ctx *c = p;
  CHECK_LZ(lz_gelu_forward(c->out, c->x));
  CHECK_LZ(lz_gelu_backward(c->dx, c->dy, c->x));
}

typedef struct {
  int64_t vocab;
  float dloss;
  lz_tensor *logits, *targets, *losses, *dlogits;
} ce_ctx;
static void ce_step(void *p) {
  ce_ctx *c = p;
  CHECK_LZ(lz_cross_entropy_forward(c->losses, c->logits, c->targets, c->vocab));
  CHECK_LZ(lz_cross_entropy_backward(c->dlogits, c->logits, c->targets, c->vocab, c->dloss));
}

typedef struct {
  int nh;
  lz_tensor *qkv, *out, *lse, *dout, *dqkv;
} flash_ctx;
static void flash_f32_step(void *p) {
  flash_ctx *c = p;
  CHECK_LZ(lz_attention_opts_forward(c->out, c->lse, c->qkv, NULL, c->nh, c->nh, 0, 0, 0));
  CHECK_LZ(lz_attention_opts_backward(c->dqkv, c->dout, c->qkv, c->out, c->lse, NULL, c->nh,
                                      c->nh, 0, 0, 0));
}
static void flash_bf16_step(void *p) {
  flash_ctx *c = p;
  CHECK_LZ(lz_attention_bf16_forward(c->out, c->lse, c->qkv, NULL, c->nh, c->nh, 0, 0, 0));
  CHECK_LZ(lz_attention_bf16_backward(c->dqkv, c->dout, c->qkv, c->out, c->lse, NULL, c->nh,
                                      c->nh, 0, 0, 0));
}

typedef struct {
  raw_bf16 r;
  lz_tensor *a, *b, *c;
} yard_ctx;
static void yard_step(void *p) {
  yard_ctx *y = p;
  raw_bf16_run(&y->r, y->a->data, y->b->data, y->c->data);
}

static void free_all(lz_tensor **t, int n);

static void bench_flash(int bf16) {
  const int64_t T = 2048, NH = 12, HS = 64, C = NH * HS, N = 2048;
  flash_ctx c = {(int)NH, random_f32(3, 1, T, 3 * C, 1.0f), tensor(LZ_F32, 3, 1, T, C),
                 tensor(LZ_F32, 3, 1, NH, T), random_f32(3, 1, T, C, 1.0f),
                 tensor(LZ_F32, 3, 1, T, 3 * C)};
  const double flops = (double)NH * 14.0 * (double)T * (double)T * (double)HS / 2.0;
  const double f32_ms = time_ms(flash_f32_step, &c, 3), bf16_ms = time_ms(flash_bf16_step, &c, 3);
  double yard = 0;
  if (bf16) {
    yard_ctx y = {raw_bf16_new(N, N, N, 0, 0, 0.0f), NULL, NULL, tensor(LZ_F32, 2, N, N, 0)};
    lz_tensor *fa = random_f32(2, N, N, 0, 1.0f);
    y.a = to_bf16(fa);
    y.b = to_bf16(fa);
    yard = 2.0 * N * N * N / (time_ms(yard_step, &y, 3) * 1e-3) * 1e-9;
    raw_bf16_free(&y.r);
    free_all((lz_tensor *[]){fa, y.a, y.b, y.c}, 4);
  }
  const char *path = "?";
  CHECK_LZ(lz_bf16_attention_path(&path));
  const double g32 = flops / (f32_ms * 1e-3) * 1e-9, g16 = flops / (bf16_ms * 1e-3) * 1e-9;
  printf("FLASH attention B=1,T=%lld,NH=%lld,HS=%lld causal fwd+bwd: f32 %.1f ms %.1f GFLOP/s; "
         "bf16 [%s] %.1f ms %.1f GFLOP/s (%.2fx f32); oneDNN bf16 %lld^3 %.1f GFLOP/s: bf16 at "
         "%.0f%%\n",
         (long long)T, (long long)NH, (long long)HS, f32_ms, g32, path, bf16_ms, g16,
         g16 / g32, (long long)N, yard, yard > 0 ? 100.0 * g16 / yard : 0.0);
  fflush(stdout);
  free_all((lz_tensor *[]){c.qkv, c.out, c.lse, c.dout, c.dqkv}, 5);
}

typedef struct {
  lz_tensor *qkv, *out, *kc, *vc, *pos;
  int32_t at;
  int reps;
} decode_ctx;
static void decode_calls(void *p) {
  decode_ctx *c = p;
  for (int r = 0; r < c->reps; r++) {
    ((int32_t *)c->pos->data)[0] = c->at;
    CHECK_LZ(lz_attention_decode(c->out, c->qkv, c->kc, c->vc, c->pos, 12, 4));
  }
}

static void bench_decode(void) {
  const int64_t T = 2048, NH = 12, NKV = 4, HS = 64, C = NH * HS, row = (NH + 2 * NKV) * HS;
  double prompt_ms[2], step_ms[2];
  for (int k = 0; k < 2; k++) {
    const lz_dtype dt = k ? LZ_BF16 : LZ_F32;
    decode_ctx prompt = {random_f32(3, 1, T, row, 1.0f), tensor(LZ_F32, 3, 1, T, C),
                         tensor(dt, 3, 1, T, NKV * HS), tensor(dt, 3, 1, T, NKV * HS),
                         tensor(LZ_I32, 1, 1, 0, 0), 0, 1};
    prompt_ms[k] = time_ms(decode_calls, &prompt, 3);
    decode_ctx one = {random_f32(3, 1, 1, row, 1.0f), tensor(LZ_F32, 3, 1, 1, C), prompt.kc,
                      prompt.vc, prompt.pos, (int32_t)(T - 1), 20};
    step_ms[k] = time_ms(decode_calls, &one, 5) / one.reps;
    free_all((lz_tensor *[]){prompt.qkv, prompt.out, prompt.kc, prompt.vc, prompt.pos, one.qkv,
                             one.out},
             7);
  }
  const double fp = (double)NH * 4.0 * (double)T * (double)T * (double)HS / 2.0;
  const double cache_bytes = 2.0 * (double)T * (double)(NKV * HS);
  printf("DECODE attention B=1,NH=%lld,NKV=%lld,HS=%lld: a prompt of %lld: f32 cache %.1f ms "
         "%.1f GFLOP/s, bf16 %.1f ms %.1f GFLOP/s; a step at %lld positions: f32 %.3f ms (cache "
         "read at %.1f GB/s), bf16 %.3f ms (%.1f GB/s)\n",
         (long long)NH, (long long)NKV, (long long)HS, (long long)T, prompt_ms[0],
         fp / (prompt_ms[0] * 1e6), prompt_ms[1], fp / (prompt_ms[1] * 1e6), (long long)T,
         step_ms[0], 4.0 * cache_bytes / (step_ms[0] * 1e6), step_ms[1],
         2.0 * cache_bytes / (step_ms[1] * 1e6));
  fflush(stdout);
}

static void free_all(lz_tensor **t, int n) {
  for (int i = 0; i < n; i++) lz_tensor_free(t[i]);
}

static void bench_ops(void) {
  printf("# fwd+bwd, ms (median), %d threads\n", lz_threads_get());
  const int64_t B = 4, C = 768;
  const int64_t attn_T[2] = {256, 1024};
  for (int i = 0; i < 2; i++) {
    int64_t T = attn_T[i];
    attn_ctx c = {12,
                  random_f32(3, B, T, 3 * C, 1.0f),
                  tensor(LZ_F32, 3, B, T, C),
                  tensor(LZ_F32, 3, B, 12, T),
                  random_f32(3, B, T, C, 1.0f),
                  tensor(LZ_F32, 3, B, T, 3 * C)};
    printf("OP attention B=%lld,T=%lld,C=%lld,NH=12 %.3f\n", (long long)B, (long long)T,
           (long long)C, time_ms(attn_step, &c, 5));
    fflush(stdout);
    free_all((lz_tensor *[]){c.qkv, c.out, c.lse, c.dout, c.dqkv}, 5);
  }
  const int64_t rows_T[2] = {256, 1024};
  for (int i = 0; i < 2; i++) {
    int64_t T = rows_T[i];
    ln_ctx c = {random_f32(3, B, T, C, 2.0f), random_f32(1, C, 0, 0, 1.0f),
                random_f32(1, C, 0, 0, 1.0f), tensor(LZ_F32, 3, B, T, C),
                tensor(LZ_F32, 2, B, T, 0),   tensor(LZ_F32, 2, B, T, 0),
                random_f32(3, B, T, C, 1.0f), tensor(LZ_F32, 3, B, T, C),
                random_f32(1, C, 0, 0, 0.0f), random_f32(1, C, 0, 0, 0.0f)};
    printf("OP layernorm B=%lld,T=%lld,C=%lld %.3f\n", (long long)B, (long long)T, (long long)C,
           time_ms(ln_step, &c, 10));
    fflush(stdout);
    free_all((lz_tensor *[]){c.x, c.w, c.b, c.out, c.mean, c.rstd, c.dy, c.dx, c.dw, c.db}, 10);
  }
  for (int i = 0; i < 2; i++) {
    int64_t T = rows_T[i];
    gelu_ctx c = {random_f32(3, B, T, 4 * C, 3.0f), tensor(LZ_F32, 3, B, T, 4 * C),
                  random_f32(3, B, T, 4 * C, 1.0f), tensor(LZ_F32, 3, B, T, 4 * C)};
    printf("OP gelu B=%lld,T=%lld,C=%lld %.3f\n", (long long)B, (long long)T, (long long)(4 * C),
           time_ms(gelu_step, &c, 10));
    fflush(stdout);
    free_all((lz_tensor *[]){c.x, c.out, c.dy, c.dx}, 4);
  }
  {
    const int64_t T = 256, V = 50257;
    ce_ctx c = {V,
                1.0f / (float)(B * T),
                random_f32(3, B, T, V, 4.0f),
                tensor(LZ_I32, 2, B, T, 0),
                tensor(LZ_F32, 2, B, T, 0),
                tensor(LZ_F32, 3, B, T, V)};
    int32_t *tg = c.targets->data;
    for (int64_t i = 0; i < B * T; i++) tg[i] = (int32_t)((frand() + 1.0f) * 0.5f * (float)V) % V;
    printf("OP cross_entropy B=%lld,T=%lld,V=%lld %.3f\n", (long long)B, (long long)T, (long long)V,
           time_ms(ce_step, &c, 5));
    fflush(stdout);
    free_all((lz_tensor *[]){c.logits, c.targets, c.losses, c.dlogits}, 4);
  }
}

/* ------------------------------------------------------ MoE grouped GEMM */

/* The experts' grouped GEMM (lz_moe_gemm_*) against one dense GEMM
 * (lz_linear_*) of the same rows and so the same FLOPs, and against a loop
 * of one lz_linear_* per expert (`loop`, its ratio to dense beside): R rows of C in, D
 * out, split evenly over E experts (each expert's own [D, C] weight), or
 * (vary) unevenly and differently at each repetition, as a router splits
 * them: each expert at least `per` rows, R = 2 * E * per. The two take
 * turns within each repetition; the ratio is the median of the paired time
 * ratios. */
typedef struct {
  lz_tensor *x, *w, *we, *y, *dy, *dx, *dw, *dwe, *off;
} moe_bufs;

/* Each expert's own lz_linear_* on its rows: how a block ran its experts
 * before the grouped GEMM (the `loop` column). */
static void moe_loop(moe_bufs *b, int dir) {
  const int64_t E = b->we->shape[0], D = b->we->shape[1], C = b->we->shape[2];
  const int32_t *off = b->off->data;
  for (int64_t e = 0; e < E; e++) {
    const int64_t n = off[e + 1] - off[e];
    if (n == 0) continue;
    lz_tensor *v[6];
    CHECK_LZ(lz_tensor_view(&v[0], b->x, off[e] * C, 2, (int64_t[]){n, C}));
    CHECK_LZ(lz_tensor_view(&v[1], b->we, e * D * C, 2, (int64_t[]){D, C}));
    CHECK_LZ(lz_tensor_view(&v[2], b->y, off[e] * D, 2, (int64_t[]){n, D}));
    CHECK_LZ(lz_tensor_view(&v[3], b->dy, off[e] * D, 2, (int64_t[]){n, D}));
    CHECK_LZ(lz_tensor_view(&v[4], b->dx, off[e] * C, 2, (int64_t[]){n, C}));
    CHECK_LZ(lz_tensor_view(&v[5], b->dwe, e * D * C, 2, (int64_t[]){D, C}));
    if (dir == 0) CHECK_LZ(lz_linear_forward(v[2], v[0], v[1], NULL));
    else if (dir == 3) CHECK_LZ(lz_linear_backward_write(NULL, v[5], NULL, v[3], v[0], v[1]));
    else CHECK_LZ(lz_linear_backward(dir == 1 ? v[4] : NULL, dir == 2 ? v[5] : NULL, NULL, v[3],
                                     v[0], v[1]));
    free_all(v, 6);
  }
}

static void moe_run(moe_bufs *b, int grouped, int dir) {
  if (grouped == 2) {
    moe_loop(b, dir);
    return;
  }
  if (dir == 0) {
    CHECK_LZ(grouped ? lz_moe_gemm_forward(b->y, b->x, b->we, b->off)
                     : lz_linear_forward(b->y, b->x, b->w, NULL));
  } else if (dir == 3) { /* a step's only (or first) micro-step writes dw */
    CHECK_LZ(grouped ? lz_moe_gemm_part_backward_write(NULL, b->dwe, b->dy, b->x, b->we, b->off, 0)
                     : lz_linear_backward_write(NULL, b->dw, NULL, b->dy, b->x, b->w));
  } else {
    lz_tensor *dx = dir == 1 ? b->dx : NULL;
    CHECK_LZ(grouped ? lz_moe_gemm_backward(dx, dir == 2 ? b->dwe : NULL, b->dy, b->x, b->we, b->off)
                     : lz_linear_backward(dx, dir == 2 ? b->dw : NULL, NULL, b->dy, b->x, b->w));
  }
}

/* Expert e's rows: per, plus (vary) a share of the other E * per rows that
 * changes with the repetition r. */
static void moe_split(int32_t *off, int64_t E, int64_t per, int vary, int r) {
  uint32_t h = 2166136261u + (uint32_t)r * 16777619u;
  int64_t left = vary ? E * per : 0;
  off[0] = 0;
  for (int64_t e = 0; e < E; e++) {
    h = h * 1103515245u + 12345u;
    int64_t extra = e == E - 1 ? left : (int64_t)((h >> 8) % (uint32_t)(left + 1));
    left -= extra;
    off[e + 1] = off[e] + (int32_t)(per + extra);
  }
}

static void bench_moe_case(int64_t E, int64_t per, int64_t C, int64_t D, lz_dtype dt, int vary) {
  const int64_t R = (vary ? 2 : 1) * E * per;
  moe_bufs b = {random_f32(2, R, C, 0, 1.0f), random_f32(2, D, C, 0, 0.1f),
                random_f32(3, E, D, C, 0.1f), tensor(LZ_F32, 2, R, D, 0),
                random_f32(2, R, D, 0, 1.0f), tensor(LZ_F32, 2, R, C, 0),
                random_f32(2, D, C, 0, 0.0f), random_f32(3, E, D, C, 0.0f),
                tensor(LZ_I32, 1, E + 1, 0, 0)};
  if (dt == LZ_BF16) {
    lz_tensor *keep[4] = {b.x, b.w, b.we, b.dy};
    b.x = to_bf16(keep[0]), b.w = to_bf16(keep[1]), b.we = to_bf16(keep[2]), b.dy = to_bf16(keep[3]);
    free_all(keep, 4);
  }
  int32_t *off = b.off->data;
  moe_split(off, E, per, vary, 0);
  const double flops = 2.0 * (double)R * (double)C * (double)D;
  for (int dir = 0; dir < 4; dir++) {
    moe_run(&b, 1, dir), moe_run(&b, 0, dir); /* warm-up: oneDNN's caches */
    double t0 = now_s();
    moe_run(&b, 0, dir);
    const int reps = reps_for(now_s() - t0, 5, 1.0);
    double tg[50], td[50], tl[50];
    for (int r = 0; r < reps; r++) {
      moe_split(off, E, per, vary, 1 + r + 50 * dir);
      double s = now_s();
      moe_run(&b, 1, dir);
      tg[r] = now_s() - s;
      s = now_s();
      moe_run(&b, 0, dir);
      td[r] = now_s() - s;
      s = now_s();
      moe_run(&b, 2, dir);
      tl[r] = now_s() - s;
    }
    const double gg = flops / median(tg, reps) / 1e9, gd = flops / median(td, reps) / 1e9;
    printf("MOE %s E=%lld rows/expert=%lld%s C=%lld D=%lld %-6s | grouped %7.1f dense %7.1f "
           "loop %7.1f GFLOP/s | ratio %.3f (loop %.3f)\n",
           lz_dtype_name(dt), (long long)E, (long long)per, vary ? "+ (varying)" : "",
           (long long)C, (long long)D, dir_name[dir], gg, gd,
           flops / median(tl, reps) / 1e9, paired_ratio(tg, td, reps),
           paired_ratio(tl, td, reps));
    fflush(stdout);
  }
  free_all((lz_tensor *[]){b.x, b.w, b.we, b.y, b.dy, b.dx, b.dw, b.dwe, b.off}, 9);
}

static void bench_moe(int bf16) {
  printf("# MoE grouped GEMM vs one dense GEMM of the same FLOPs, %d threads "
         "(ratio: grouped / dense GFLOP/s)\n", lz_threads_get());
  const int64_t per[3] = {64, 128, 512};
  for (int i = 0; i < 3; i++) bench_moe_case(8, per[i], 768, 2048, LZ_F32, 0);
  bench_moe_case(8, 64, 768, 2048, LZ_F32, 1);
  bench_moe_case(64, 64, 1024, 512, LZ_F32, 0); /* OLMoE-like: many narrow experts */
  if (bf16) {
    for (int i = 0; i < 2; i++) bench_moe_case(8, per[i], 768, 2048, LZ_BF16, 0);
    bench_moe_case(8, 64, 768, 2048, LZ_BF16, 1);
  }
}

int main(int argc, char **argv) {
  int64_t rows[16] = {256, 1024};
  int nrows = 2, gemms = 1, ops = 1, moe = 1, flash = 1, decode = 1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rows") && i + 1 < argc) {
      nrows = 0;
      char *s = argv[++i], *end;
      for (long v; nrows < 16 && (v = strtol(s, &end, 10)) > 0; s = end) rows[nrows++] = v;
      if (nrows == 0) {
        fprintf(stderr, "bench_kernels: --rows wants positive counts, like \"256 1024\"\n");
        return 2;
      }
    } else if (!strcmp(argv[i], "--no-gemm")) {
      gemms = 0;
    } else if (!strcmp(argv[i], "--no-ops")) {
      ops = 0;
    } else if (!strcmp(argv[i], "--no-moe")) {
      moe = 0;
    } else if (!strcmp(argv[i], "--no-flash")) {
      flash = 0;
    } else if (!strcmp(argv[i], "--no-decode")) {
      decode = 0;
    } else {
      fprintf(stderr, "usage: bench_kernels [--rows \"256 1024\"] [--no-gemm] [--no-ops] "
                      "[--no-moe] [--no-flash] [--no-decode]\n");
      return 2;
    }
  }
  int bf16 = lz_cpu_has("avx512bf16");
  const char *blas_threads = getenv("OPENBLAS_NUM_THREADS");
  openblas_set_num_threads(blas_threads ? atoi(blas_threads) : lz_threads_get());
  printf("# luazero %s; OpenBLAS core %s; oneDNN %d.%d.%d%s\n", lz_version(),
         openblas_get_corename(), dnnl_version()->major, dnnl_version()->minor,
         dnnl_version()->patch, bf16 ? "" : "; no AVX512-BF16: bf16 columns skipped");
  if (gemms) bench_gemms(rows, nrows, bf16);
  if (ops) bench_ops();
  if (moe) bench_moe(bf16);
  if (flash) bench_flash(bf16);
  if (decode) bench_decode();
  return 0;
}
