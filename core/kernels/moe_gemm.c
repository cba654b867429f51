/* moe_gemm.c — the experts' grouped GEMM: rows sorted by expert (moe.c's
 * moe_sort), expert e's rows offsets[e] .. offsets[e + 1] multiplied by its
 * own weight w[e] [D, C] (nn.Linear's layout, experts stacked as
 * transformers 5.x stacks them), forward and backward, through matmul.c's
 * GEMMs (lz_gemm). Or w [E, P, D, C] and a part: each expert's P matrices
 * lie side by side (w1, w3, w2 as a block's parameters hold them) and part
 * p of each is multiplied. An expert with no rows costs nothing and leaves
 * its dw as it was (zeros where dw is written: the _write backward). */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_gemm.h" /* lz_gemm */
#include "kernels/lz_sq_blocks.h" /* the gradient norm's block partials */

#include <stdio.h>  /* snprintf: a worker thread's error message */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memset: a written dw's experts without rows */

/* w's dimensions: E experts of P parts [D, C] (P = 1 for a 3-D w). */
typedef struct {
  int64_t E, P, D, C;
} expert_dims;

static expert_dims dims_of(const lz_tensor *w) {
  const int o = w->ndim == 4;
  return (expert_dims){w->shape[0], o ? w->shape[1] : 1, w->shape[o + 1], w->shape[o + 2]};
}

/* Element offset of expert e's matrix `part` in w (and dw). */
static size_t expert_at(const lz_tensor *w, int64_t part, int64_t e) {
  const expert_dims d = dims_of(w);
  return (size_t)((e * d.P + part) * d.D * d.C);
}

static lz_status gemm_shapes(const char *op, const lz_tensor *x, const lz_tensor *w,
                             const lz_tensor *y, const char *yname, const lz_tensor *offsets,
                             int64_t part) {
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "w", w, 3, 4));
  LZ_TRY(lz_check_ndim(op, "offsets", offsets, 1, 1));
  LZ_TRY(lz_check_ndim(op, yname, y, 1, LZ_MAX_DIMS));
  const expert_dims d = dims_of(w);
  const int64_t E = d.E, D = d.D, C = d.C, R = lz_rows(x);
  char bx[96], bw[96], by[96];
  if (part < 0 || part >= d.P)
    return lz_fail(LZ_ERR_INVALID, "%s: part is %lld but w is %s; part must be 0 .. %lld (w's "
                   "second dimension, of a 4-D w)", op, (long long)part,
                   lz_tensor_describe(w, bw, sizeof bw), (long long)(d.P - 1));
  if (lz_cols(x) != C)
    return lz_fail(LZ_ERR_INVALID, "%s: x is %s but w is %s; x's last dimension must be %lld",
                   op, lz_tensor_describe(x, bx, sizeof bx), lz_tensor_describe(w, bw, sizeof bw),
                   (long long)C);
  if (lz_rows(y) != R || lz_cols(y) != D)
    return lz_fail(LZ_ERR_INVALID, "%s: x is %s and w is %s, so %s must be [%lld, %lld] (got %s)",
                   op, lz_tensor_describe(x, bx, sizeof bx), lz_tensor_describe(w, bw, sizeof bw),
                   yname, (long long)R, (long long)D, lz_tensor_describe(y, by, sizeof by));
  return lz_check_numel(op, "offsets", offsets, E + 1, "E + 1: one more than w's experts");
}

/* The offsets' values, where they are: nondecreasing within [0, R]. */
static lz_status check_offsets(lz_op op, const lz_op_args *a, const int32_t *off, int64_t E,
                               int64_t R) {
  for (int64_t e = 0; e <= E; e++) {
    const int64_t lo = e ? off[e - 1] : 0;
    if (off[e] < lo || off[e] > R)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: offsets[%lld] is %d; offsets must rise from 0 or more to at most "
                     "%lld (the rows of x)",
                     LZ_OP_NAME(op, a), (long long)e, (int)off[e], (long long)R);
  }
  return LZ_OK;
}

lz_status lz_moe_gemm_part_forward(lz_tensor *y, const lz_tensor *x, const lz_tensor *w,
                                   const lz_tensor *offsets, int64_t part) {
  const char *op = "moe_gemm_part_forward";
  LZ_TRY(gemm_shapes(op, x, w, y, "y", offsets, part));
  LZ_OP_RUN(op, LZ_OP_MOE_GEMM_FORWARD,
            .t = {y, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)offsets}, .i = {part});
}

lz_status lz_moe_gemm_forward(lz_tensor *y, const lz_tensor *x, const lz_tensor *w,
                              const lz_tensor *offsets) {
  const char *op = "moe_gemm_forward";
  LZ_TRY(gemm_shapes(op, x, w, y, "y", offsets, 0));
  LZ_OP_RUN(op, LZ_OP_MOE_GEMM_FORWARD,
            .t = {y, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)offsets});
}

/* The work as tasks that depend on the shapes only, never on the thread
 * count: a block of one expert's rows (forward, dx) or of its weight's
 * output rows (dw, whose sum runs over the expert's rows). The tasks run in
 * parallel, each GEMM on one thread (oneDNN runs single-threaded inside a
 * parallel region): small experts keep every thread busy, instead of each
 * one's GEMM being split thinly over all of them, and every element is the
 * same sum whatever the number of threads. */
#define TASK_ROWS 128

typedef struct {
  int32_t e, r0, n; /* expert; first row and rows of the block */
  int64_t cost;     /* its GEMM's rows (dw: times the output rows it writes) */
} gemm_task;

/* Largest first (by the rows a task's GEMM runs over), then in expert and
 * row order: the threads take the tasks in this order, so the last to
 * finish are the shortest. Which thread runs a task never changes its sums. */
static int largest_first(const void *a, const void *b) {
  const gemm_task *x = a, *y = b;
  if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
  if (x->e != y->e) return x->e < y->e ? -1 : 1;
  return (x->r0 > y->r0) - (x->r0 < y->r0);
}

/* A bf16 dw block of TASK_ROWS output rows is bitwise a block of the whole
 * expert's product only while oneDNN sums the expert's rows in one run: for
 * more than 384 rows the whole product's kernel splits the sum differently
 * from a block's (measured on oneDNN 2.6 with blocks of 128 of D = 2048, 768
 * and 300 output rows: the same bits for every row count 1 .. 384, others
 * from 385), so those experts stay one block. The blocks keep each one's
 * output (128 x C, f32) in the core's cache while the kernel adds into it:
 * the whole expert's 2048 x 768 swept by columns ran its 64-row dw at 120
 * GFLOP/s on one thread (adding into dw) against 177 in blocks. */
#define BF16_DW_BLOCKED_MAX_ROWS 384

/* An fp32 dw task's output rows. Each task's sgemm packs the expert's x
 * rows anew: in blocks of 128 output rows the grouped fp32 dW ran at 0.47-0.49
 * of one dense GEMM of the same FLOPs on an AVX2 part (Zen 3, oneDNN 2.6,
 * two threads, 64-512 rows an expert), in blocks of 512 at 0.93-1.04 (and
 * whole experts the same); 512 keeps several tasks an expert for many cores. */
#define F32_DW_TASK_ROWS 512

/* The rows of one task of expert e: of its rows (by_rows), or of its D
 * output rows (dw; all D for a bf16 expert of many rows, above). */
static int64_t task_block(lz_dtype dt, int by_rows, int64_t D, int64_t rows) {
  if (by_rows) return TASK_ROWS;
  if (dt != LZ_BF16) return F32_DW_TASK_ROWS;
  return rows <= BF16_DW_BLOCKED_MAX_ROWS ? TASK_ROWS : D;
}

/* Blocks of each expert's offsets[e] .. offsets[e + 1] (by_rows), or of the
 * D output rows of each expert that has rows, largest first. Returns the
 * count; *out is malloc'd (NULL with 0 tasks). */
static lz_status tasks_make(gemm_task **out, int64_t *count, const int32_t *off, int64_t E,
                            int64_t D, int by_rows, lz_dtype dt) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; e++) {
    const int64_t len = by_rows ? off[e + 1] - off[e] : (off[e + 1] > off[e] ? D : 0);
    const int64_t block = task_block(dt, by_rows, D, off[e + 1] - off[e]);
    n += (len + block - 1) / block;
  }
  *count = n;
  *out = NULL;
  if (n == 0) return LZ_OK;
  gemm_task *t = malloc((size_t)n * sizeof *t);
  if (!t) return lz_fail(LZ_ERR_NOMEM, "moe_gemm: out of memory for %lld tasks", (long long)n);
  int64_t k = 0;
  for (int64_t e = 0; e < E; e++) {
    const int64_t base = by_rows ? off[e] : 0;
    const int64_t len = by_rows ? off[e + 1] - off[e] : (off[e + 1] > off[e] ? D : 0);
    const int64_t block = task_block(dt, by_rows, D, off[e + 1] - off[e]);
    for (int64_t r = 0; r < len; r += block) {
      const int32_t b = (int32_t)(len - r < block ? len - r : block);
      t[k++] = (gemm_task){(int32_t)e, (int32_t)(base + r), b,
                           by_rows ? b : (int64_t)b * (off[e + 1] - off[e])};
    }
  }
  qsort(t, (size_t)n, sizeof *t, largest_first);
  *out = t;
  return LZ_OK;
}

/* Runs every task's GEMM; the first failure is returned, its message
 * carried over from the worker thread (messages are thread-local). */
typedef lz_status (*task_fn)(const lz_op_args *a, const gemm_task *t);

static lz_status tasks_run(const lz_op_args *a, const gemm_task *t, int64_t n, task_fn fn) {
  lz_status st = LZ_OK;
  char why[256] = "";
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; i++) {
    lz_status s;
#pragma omp atomic read
    s = st;
    if (s != LZ_OK) continue;
    s = fn(a, &t[i]);
    if (s != LZ_OK) {
#pragma omp critical(moe_gemm_status)
      if (st == LZ_OK) {
        snprintf(why, sizeof why, "%s", lz_last_error());
#pragma omp atomic write
        st = s;
      }
    }
  }
  return st == LZ_OK ? LZ_OK : lz_fail(st, "%s", why);
}

static lz_status tasks_for(const lz_op_args *a, lz_dtype dt, const int32_t *off, int64_t E,
                           int64_t D, int by_rows, task_fn fn) {
  gemm_task *t = NULL;
  int64_t n = 0;
  LZ_TRY(tasks_make(&t, &n, off, E, D, by_rows, dt));
  lz_status st = tasks_run(a, t, n, fn);
  free(t);
  return st;
}

/* y rows r0 .. r0 + n = x rows @ w[e]^T */
static lz_status forward_task(const lz_op_args *a, const gemm_task *t) {
  const lz_tensor *y = a->t[0], *x = a->t[1], *w = a->t[2];
  const expert_dims d = dims_of(w);
  const size_t es = lz_dtype_size(x->dtype);
  return lz_gemm(x->dtype, t->n, d.D, d.C, 0, 1, 1.0f,
                 (const char *)x->data + (size_t)t->r0 * d.C * es, d.C,
                 (const char *)w->data + expert_at(w, a->i[0], t->e) * es, 0.0f,
                 (float *)y->data + (size_t)t->r0 * d.D);
}

lz_status lz_cpu_moe_gemm_forward(const lz_op_args *a) {
  const lz_tensor *x = a->t[1], *w = a->t[2];
  const expert_dims d = dims_of(w);
  const int32_t *off = a->t[3]->data;
  LZ_TRY(check_offsets(LZ_OP_MOE_GEMM_FORWARD, a, off, d.E, lz_rows(x)));
  return tasks_for(a, x->dtype, off, d.E, d.D, 1, forward_task);
}

static lz_status backward_checks(const char *op, lz_tensor *dx, lz_tensor *dw,
                                 const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                 const lz_tensor *offsets, int64_t part) {
  LZ_TRY(gemm_shapes(op, x, w, dy, "dy", offsets, part));
  if (dx) LZ_TRY(lz_check_numel(op, "dx", dx, lz_tensor_numel(x), "the shape of x"));
  if (dw) LZ_TRY(lz_check_numel(op, "dw", dw, lz_tensor_numel(w), "the shape of w"));
  return LZ_OK;
}

/* One part's backward; write: dw written (beta 0), not added into;
 * blocks, slice, dw_at: the _norm variant's partials (blocks NULL: none). */
static lz_status part_backward(const char *op, lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *offsets,
                               int64_t part, int64_t write, double *blocks, int64_t slice,
                               int64_t dw_at) {
  LZ_TRY(backward_checks(op, dx, dw, dy, x, w, offsets, part));
  LZ_OP_RUN(op, LZ_OP_MOE_GEMM_BACKWARD,
            .t = {dx, dw, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w,
                  (lz_tensor *)offsets}, .i = {part, write, dw_at, slice}, .blocks = blocks);
}

lz_status lz_moe_gemm_part_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                                    const lz_tensor *x, const lz_tensor *w,
                                    const lz_tensor *offsets, int64_t part) {
  return part_backward("moe_gemm_part_backward", dx, dw, dy, x, w, offsets, part, 0, NULL, 0,
                       0);
}

lz_status lz_moe_gemm_part_backward_write(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                                          const lz_tensor *x, const lz_tensor *w,
                                          const lz_tensor *offsets, int64_t part) {
  return part_backward("moe_gemm_part_backward_write", dx, dw, dy, x, w, offsets, part, 1,
                       NULL, 0, 0);
}

lz_status lz_moe_gemm_part_backward_norm(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                                         const lz_tensor *x, const lz_tensor *w,
                                         const lz_tensor *offsets, int64_t part, int write,
                                         double *blocks, int64_t slice_numel, int64_t dw_at) {
  const char *op = "moe_gemm_part_backward_norm";
  LZ_TRY(lz_check_norm_blocks(op, dw, blocks, slice_numel, dw_at, "moe_gemm_part_backward"));
  return part_backward(op, dx, dw, dy, x, w, offsets, part, write != 0, blocks, slice_numel,
                       dw_at);
}

lz_status lz_moe_gemm_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *offsets) {
  const char *op = "moe_gemm_backward";
  LZ_TRY(backward_checks(op, dx, dw, dy, x, w, offsets, 0));
  LZ_OP_RUN(op, LZ_OP_MOE_GEMM_BACKWARD,
            .t = {dx, dw, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w,
                  (lz_tensor *)offsets});
}

/* dx rows r0 .. r0 + n = dy rows @ w[e] */
static lz_status dx_task(const lz_op_args *a, const gemm_task *t) {
  const lz_tensor *dx = a->t[0], *dy = a->t[2], *w = a->t[4];
  const expert_dims d = dims_of(w);
  const size_t es = lz_dtype_size(w->dtype);
  return lz_gemm(w->dtype, t->n, d.C, d.D, 0, 0, 1.0f,
                 (const char *)dy->data + (size_t)t->r0 * d.D * es, d.D,
                 (const char *)w->data + expert_at(w, a->i[0], t->e) * es, 0.0f,
                 (float *)dx->data + (size_t)t->r0 * d.C);
}

/* The gradient norm's partials (a->blocks: the _norm backward) of the
 * slice's blocks that lie wholly in dw's elements lo .. lo + n, just
 * written: their sums in the slice's blocks, the same bits as sq_norm's
 * pass. Blocks that reach past lo .. lo + n are someone else's (another
 * task's, or sq_norm_blocks' to read). zeros: the elements are +0. */
static void dw_norm_partials(const lz_op_args *a, int64_t lo, int64_t n, int zeros) {
  if (!a->blocks) return;
  lz_sq_f32_take_blocks(zeros ? NULL : (const float *)a->t[1]->data + lo, a->i[2] + lo, n,
                        a->i[3], a->blocks, 0);
}

/* dw[e] rows r0 .. r0 + n += (the expert's dy columns r0 .. r0 + n)^T @ its
 * x rows (= where i[1] says dw is written): a GEMM over a column block of
 * dy, whose rows are D apart; then its block's norm partials, in cache. */
static lz_status dw_task(const lz_op_args *a, const gemm_task *t) {
  const lz_tensor *dw = a->t[1], *dy = a->t[2], *x = a->t[3], *w = a->t[4];
  const expert_dims d = dims_of(w);
  const int64_t D = d.D, C = d.C;
  const int32_t *off = a->t[5]->data;
  const size_t es = lz_dtype_size(x->dtype);
  const int64_t at = (int64_t)expert_at(w, a->i[0], t->e) + (int64_t)t->r0 * C;
  LZ_TRY(lz_gemm(x->dtype, t->n, C, off[t->e + 1] - off[t->e], 1, 0, 1.0f,
                 (const char *)dy->data + ((size_t)off[t->e] * D + (size_t)t->r0) * es, D,
                 (const char *)x->data + (size_t)off[t->e] * C * es, a->i[1] ? 0.0f : 1.0f,
                 (float *)dw->data + at));
  dw_norm_partials(a, at, (int64_t)t->n * C, 0);
  return LZ_OK;
}

lz_status lz_cpu_moe_gemm_backward(const lz_op_args *a) {
  const lz_tensor *dx = a->t[0], *dw = a->t[1], *x = a->t[3], *w = a->t[4];
  const expert_dims d = dims_of(w);
  const int32_t *off = a->t[5]->data;
  LZ_TRY(check_offsets(LZ_OP_MOE_GEMM_BACKWARD, a, off, d.E, lz_rows(x)));
  if (dx) LZ_TRY(tasks_for(a, x->dtype, off, d.E, d.D, 1, dx_task));
  if (dw && a->i[1]) /* written: an expert no row reached gets zeros */
    for (int64_t e = 0; e < d.E; e++)
      if (off[e + 1] == off[e]) {
        memset((float *)dw->data + expert_at(w, a->i[0], e), 0,
               (size_t)(d.D * d.C) * sizeof(float));
        dw_norm_partials(a, (int64_t)expert_at(w, a->i[0], e), d.D * d.C, 1);
      }
  if (dw) LZ_TRY(tasks_for(a, x->dtype, off, d.E, d.D, 0, dw_task));
  return LZ_OK;
}
