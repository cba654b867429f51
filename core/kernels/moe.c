/* moe.c — the token side of a mixture-of-experts block, as transformers'
 * routers and expert loops compute it: route (softmax in fp32, top-k, the
 * optional renormalisation), sort (each slot's row in expert order), permute
 * (gather token rows into that order) and combine (the weighted sum of each
 * token's expert rows), with their backwards. The experts' GEMMs are
 * moe_gemm.c's.
 *
 * Every sum runs in one fixed order inside one thread task (a token's row,
 * or a row of the permuted matrix), and no two tasks write one element: no
 * atomics, and the same bits whatever the number of threads. A token's K
 * rows are summed in row order, which is expert order since the rows are
 * sorted by expert: transformers' loop over experts with index_add_ adds in
 * that order too. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <math.h>   /* expf */
#include <stdint.h> /* INT32_MAX */
#include <stdlib.h> /* calloc, malloc, free */

/* Rows per thread task where rows are short. */
#define ROWS_PER_TASK 16

static int64_t moe_tasks(int64_t rows, int64_t cols) {
  return rows * cols > (1 << 14) ? rows : 0;
}

static lz_status shape_fail(const char *op, const char *name, const lz_tensor *t,
                            const char *want) {
  char b[96];
  return lz_fail(LZ_ERR_INVALID, "%s: %s is %s; it must be %s", op, name,
                 lz_tensor_describe(t, b, sizeof b), want);
}

/* A tensor of `rows` rows of `cols` (any leading dimensions). */
static lz_status check_matrix(const char *op, const char *name, const lz_tensor *t, int64_t rows,
                              int64_t cols, const char *want) {
  LZ_TRY(lz_check_ndim(op, name, t, 1, LZ_MAX_DIMS));
  if (lz_rows(t) != rows || lz_cols(t) != cols) return shape_fail(op, name, t, want);
  return LZ_OK;
}

/* An index tensor's values: the first outside [0, hi) names the tensor. */
static lz_status check_ids(lz_op op, const char *name, const int32_t *ids, int64_t n,
                           int64_t hi, const char *what) {
  int32_t v;
  const int64_t i = lz_ids_first_outside(ids, n, 0, hi, &v);
  if (i < 0) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID, "%s: %s[%lld] is %d, outside [0, %lld) (%s)",
                 lz_op_infos[op].name, name, (long long)i, (int)v, (long long)hi, what);
}

/* row_of_slot as moe_sort makes it: its n values (each in [0, n), already
 * checked) a permutation of 0 .. n - 1. A repeated row would be summed once
 * by combine forward and permute backward, and written by two threads at
 * once by combine backward: refused, naming both slots. */
lz_status lz_moe_check_permutation(lz_op op, const int32_t *rows, int64_t n) {
  int64_t *first = malloc((size_t)(n ? n : 1) * sizeof *first);
  if (!first)
    return lz_fail(LZ_ERR_NOMEM, "%s: out of memory checking row_of_slot's %lld rows",
                   lz_op_infos[op].name, (long long)n);
  for (int64_t r = 0; r < n; r++) first[r] = -1;
  for (int64_t s = 0; s < n; s++) {
    if (first[rows[s]] < 0) {
      first[rows[s]] = s;
      continue;
    }
    const int64_t was = first[rows[s]];
    free(first);
    return lz_fail(LZ_ERR_INVALID,
                   "%s: row_of_slot[%lld] is %d, as row_of_slot[%lld] is: each row must be one "
                   "slot's; pass row_of_slot as moe_sort makes it (a permutation of 0 .. %lld)",
                   lz_op_infos[op].name, (long long)s, (int)rows[s], (long long)was,
                   (long long)(n - 1));
  }
  free(first);
  return LZ_OK;
}

static inline float load(const void *p, lz_dtype dt, int64_t i) {
  return dt == LZ_BF16 ? lz_bf16_to_f32_inline(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, lz_dtype dt, int64_t i, float v) {
  if (dt == LZ_BF16) ((uint16_t *)p)[i] = lz_bf16_from_f32_inline(v);
  else ((float *)p)[i] = v;
}

/* ------------------------------------------------------------------ route */

lz_status lz_moe_route_forward(lz_tensor *weights, lz_tensor *idx, lz_tensor *probs,
                               const lz_tensor *logits, int norm) {
  const char *op = "moe_route_forward";
  LZ_TRY(lz_check_ndim(op, "logits", logits, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "weights", weights, 1, LZ_MAX_DIMS));
  const int64_t N = lz_rows(logits), E = lz_cols(logits), K = lz_cols(weights);
  if (K < 1 || K > E)
    return shape_fail(op, "weights", weights, "[N, K] with 1 <= K <= E (the columns of logits)");
  LZ_TRY(check_matrix(op, "weights", weights, N, K, "[N, K]: one row per row of logits"));
  LZ_TRY(lz_check_same_shape(op, "idx", idx, "weights", weights));
  LZ_TRY(lz_check_numel(op, "probs", probs, N * E, "the shape of logits"));
  LZ_OP_RUN(op, LZ_OP_MOE_ROUTE_FORWARD, .t = {weights, idx, probs, (lz_tensor *)logits},
            .i = {norm != 0});
}

/* One token: softmax over its E logits, then K selections of the largest
 * remaining probability (strictly larger wins, so a tie goes to the lower
 * expert), then the optional division by their sum (summed in slot order). */
static void route_row(float *w, int32_t *id, float *p, const void *logits, lz_dtype dt,
                      int64_t E, int64_t K, int norm) {
  float m = -INFINITY;
  for (int64_t e = 0; e < E; e++) {
    p[e] = load(logits, dt, e);
    m = p[e] > m ? p[e] : m;
  }
  float s = 0.0f;
  for (int64_t e = 0; e < E; e++) {
    p[e] = expf(p[e] - m);
    s += p[e];
  }
  for (int64_t e = 0; e < E; e++) p[e] /= s;
  for (int64_t j = 0; j < K; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++) {
      int taken = 0;
      for (int64_t q = 0; q < j && !taken; q++) taken = id[q] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    id[j] = (int32_t)best;
    w[j] = p[best];
  }
  if (!norm) return;
  float sum = 0.0f;
  for (int64_t j = 0; j < K; j++) sum += w[j];
  for (int64_t j = 0; j < K; j++) w[j] /= sum;
}

lz_status lz_cpu_moe_route_forward(const lz_op_args *a) {
  const lz_tensor *logits = a->t[3];
  const int64_t N = lz_rows(logits), E = lz_cols(logits), K = lz_cols(a->t[0]);
  float *w = a->t[0]->data, *p = a->t[2]->data;
  int32_t *id = a->t[1]->data;
  const size_t es = lz_dtype_size(logits->dtype);
  const char *l = logits->data;
  const int norm = (int)a->i[0];
#pragma omp parallel for schedule(static) if (moe_tasks(N, E * K))
  for (int64_t t = 0; t < N; t++)
    route_row(w + t * K, id + t * K, p + t * E, l + (size_t)(t * E) * es, logits->dtype, E, K,
              norm);
  return LZ_OK;
}

lz_status lz_moe_route_backward(lz_tensor *dlogits, const lz_tensor *dweights,
                                const lz_tensor *dprobs, const lz_tensor *probs,
                                const lz_tensor *idx, int norm) {
  const char *op = "moe_route_backward";
  LZ_TRY(lz_check_ndim(op, "probs", probs, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "idx", idx, 1, LZ_MAX_DIMS));
  const int64_t N = lz_rows(probs), E = lz_cols(probs), K = lz_cols(idx);
  if (K < 1 || K > E) return shape_fail(op, "idx", idx, "[N, K] with 1 <= K <= E");
  LZ_TRY(check_matrix(op, "idx", idx, N, K, "[N, K]: one row per row of probs"));
  LZ_TRY(lz_check_numel(op, "dweights", dweights, N * K, "the shape of idx"));
  LZ_TRY(lz_check_numel(op, "dlogits", dlogits, N * E, "the shape of probs"));
  if (dprobs) LZ_TRY(lz_check_numel(op, "dprobs", dprobs, N * E, "the shape of probs"));
  LZ_OP_RUN(op, LZ_OP_MOE_ROUTE_BACKWARD,
            .t = {dlogits, (lz_tensor *)dweights, (lz_tensor *)dprobs, (lz_tensor *)probs,
                  (lz_tensor *)idx},
            .i = {norm != 0});
}

/* One token: g = d(probs) (the aux loss's part, then each chosen expert's
 * weight gradient, through the division by the sum when norm), then
 * softmax's backward dl = p * (g - p . g). g lives in dl's f32 scratch row. */
static void route_backward_row(float *g, const float *dw, const float *dp, const float *p,
                               const int32_t *id, int64_t E, int64_t K, int norm) {
  for (int64_t e = 0; e < E; e++) g[e] = dp ? dp[e] : 0.0f;
  if (norm) {
    float sum = 0.0f, c = 0.0f;
    for (int64_t j = 0; j < K; j++) sum += p[id[j]];
    for (int64_t j = 0; j < K; j++) c += dw[j] * (p[id[j]] / sum);
    for (int64_t j = 0; j < K; j++) g[id[j]] += (dw[j] - c) / sum;
  } else {
    for (int64_t j = 0; j < K; j++) g[id[j]] += dw[j];
  }
  float dot = 0.0f;
  for (int64_t e = 0; e < E; e++) dot += p[e] * g[e];
  for (int64_t e = 0; e < E; e++) g[e] = p[e] * (g[e] - dot);
}

lz_status lz_cpu_moe_route_backward(const lz_op_args *a) {
  const lz_tensor *dl = a->t[0], *dp = a->t[2], *probs = a->t[3], *idx = a->t[4];
  const int64_t N = lz_rows(probs), E = lz_cols(probs), K = lz_cols(idx);
  LZ_TRY(check_ids(LZ_OP_MOE_ROUTE_BACKWARD, "idx", idx->data, N * K, E, "E, the experts"));
  const float *dw = a->t[1]->data, *p = probs->data;
  const float *dpp = dp ? dp->data : NULL;
  const int32_t *id = idx->data;
  const int norm = (int)a->i[0];
  float *scratch = NULL;
  if (dl->dtype != LZ_F32 && !(scratch = malloc((size_t)(N * E) * sizeof(float))))
    return lz_fail(LZ_ERR_NOMEM, "moe_route_backward: out of memory for %lld x %lld floats",
                   (long long)N, (long long)E);
  float *g = scratch ? scratch : dl->data;
#pragma omp parallel for schedule(static) if (moe_tasks(N, E * K))
  for (int64_t t = 0; t < N; t++) {
    route_backward_row(g + t * E, dw + t * K, dpp ? dpp + t * E : NULL, p + t * E, id + t * K, E,
                       K, norm);
    if (scratch)
      for (int64_t e = 0; e < E; e++) store(dl->data, dl->dtype, t * E + e, g[t * E + e]);
  }
  free(scratch);
  return LZ_OK;
}

/* ------------------------------------------------------------------- sort */

lz_status lz_moe_sort(lz_tensor *row_of_slot, lz_tensor *slot_of_row, lz_tensor *offsets,
                      const lz_tensor *idx) {
  const char *op = "moe_sort";
  LZ_TRY(lz_check_ndim(op, "idx", idx, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "offsets", offsets, 1, 1));
  if (offsets->shape[0] < 2)
    return shape_fail(op, "offsets", offsets, "i32[E + 1] with E >= 1 experts");
  LZ_TRY(lz_check_same_shape(op, "row_of_slot", row_of_slot, "idx", idx));
  LZ_TRY(lz_check_numel(op, "slot_of_row", slot_of_row, lz_tensor_numel(idx),
                        "one row per slot of idx"));
  if (lz_tensor_numel(idx) > INT32_MAX)
    return lz_fail(LZ_ERR_INVALID,
                   "moe_sort: idx has %lld slots (tokens x top-k); rows and offsets are i32, so "
                   "at most %d: route fewer tokens per call (a smaller micro-batch or sequence)",
                   (long long)lz_tensor_numel(idx), INT32_MAX);
  LZ_OP_RUN(op, LZ_OP_MOE_SORT,
            .t = {row_of_slot, slot_of_row, offsets, (lz_tensor *)idx});
}

/* A counting sort, sequential: stable, so rows of one expert keep slot
 * order, which is token order then slot order. */
lz_status lz_cpu_moe_sort(const lz_op_args *a) {
  const lz_tensor *idx = a->t[3];
  const int64_t n = lz_tensor_numel(idx), E = a->t[2]->shape[0] - 1;
  const int32_t *id = idx->data;
  LZ_TRY(check_ids(LZ_OP_MOE_SORT, "idx", id, n, E, "E, one less than offsets' length"));
  int32_t *row = a->t[0]->data, *slot = a->t[1]->data, *off = a->t[2]->data;
  int64_t *cursor = calloc((size_t)E + 1, sizeof(int64_t));
  if (!cursor) return lz_fail(LZ_ERR_NOMEM, "moe_sort: out of memory for %lld experts",
                              (long long)E);
  for (int64_t s = 0; s < n; s++) cursor[id[s] + 1]++;
  for (int64_t e = 0; e < E; e++) cursor[e + 1] += cursor[e];
  for (int64_t e = 0; e <= E; e++) off[e] = (int32_t)cursor[e];
  for (int64_t s = 0; s < n; s++) {
    const int64_t r = cursor[id[s]]++;
    row[s] = (int32_t)r;
    slot[r] = (int32_t)s;
  }
  free(cursor);
  return LZ_OK;
}

/* ---------------------------------------------------------------- permute */

lz_status lz_moe_permute_forward(lz_tensor *out, const lz_tensor *x,
                                 const lz_tensor *slot_of_row) {
  const char *op = "moe_permute_forward";
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "slot_of_row", slot_of_row, 1, 1));
  const int64_t N = lz_rows(x), H = lz_cols(x), R = slot_of_row->shape[0];
  if (N == 0 ? R != 0 : R % N != 0)
    return shape_fail(op, "slot_of_row", slot_of_row,
                      "i32[N * K]: a whole number K of slots per row of x");
  LZ_TRY(check_matrix(op, "out", out, R, H, "[R, H]: one row per slot, x's columns"));
  LZ_OP_RUN(op, LZ_OP_MOE_PERMUTE_FORWARD,
            .t = {out, (lz_tensor *)x, (lz_tensor *)slot_of_row});
}

LZ_DISPATCH static void permute_row(void *out, lz_dtype odt, const void *x, lz_dtype xdt,
                                    int64_t H) {
  if (odt == xdt) {
    memcpy(out, x, (size_t)H * lz_dtype_size(xdt));
    return;
  }
  for (int64_t c = 0; c < H; c++) store(out, odt, c, load(x, xdt, c));
}

lz_status lz_cpu_moe_permute_forward(const lz_op_args *a) {
  const lz_tensor *out = a->t[0], *x = a->t[1], *sor = a->t[2];
  const int64_t N = lz_rows(x), H = lz_cols(x), R = sor->shape[0];
  if (R == 0) return LZ_OK;
  const int64_t K = R / N;
  const int32_t *slot = sor->data;
  LZ_TRY(check_ids(LZ_OP_MOE_PERMUTE_FORWARD, "slot_of_row", slot, R, R, "R, the slots"));
  const size_t oes = lz_dtype_size(out->dtype), xes = lz_dtype_size(x->dtype);
  char *o = out->data;
  const char *xp = x->data;
#pragma omp parallel for schedule(static) if (moe_tasks(R, H))
  for (int64_t r = 0; r < R; r++)
    permute_row(o + (size_t)(r * H) * oes, out->dtype, xp + (size_t)(slot[r] / K * H) * xes,
                x->dtype, H);
  return LZ_OK;
}

lz_status lz_moe_permute_backward(lz_tensor *dx, const lz_tensor *dout,
                                  const lz_tensor *row_of_slot) {
  const char *op = "moe_permute_backward";
  LZ_TRY(lz_check_ndim(op, "row_of_slot", row_of_slot, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "dout", dout, 1, LZ_MAX_DIMS));
  const int64_t N = lz_rows(row_of_slot), K = lz_cols(row_of_slot), H = lz_cols(dout);
  LZ_TRY(check_matrix(op, "dout", dout, N * K, H, "[N * K, H]: one row per slot of row_of_slot"));
  LZ_TRY(check_matrix(op, "dx", dx, N, H, "[N, H]: one row per row of row_of_slot"));
  LZ_OP_RUN(op, LZ_OP_MOE_PERMUTE_BACKWARD,
            .t = {dx, (lz_tensor *)dout, (lz_tensor *)row_of_slot});
}

/* The next of a token's rows in ascending order after `prev` (-1: the first):
 * K is small, and a scan keeps the order without a sorted copy. */
static inline int64_t next_row(const int32_t *rows, int64_t K, int64_t prev) {
  int64_t best = -1;
  for (int64_t j = 0; j < K; j++)
    if (rows[j] > prev && (best < 0 || rows[j] < rows[best])) best = j;
  return best;
}

/* acc = sum over the token's rows in row order of (w ? w[j] : 1) * src row. */
LZ_DISPATCH static void gather_sum_row(float *acc, const void *src, lz_dtype dt,
                                       const int32_t *rows, const float *w, int64_t K,
                                       int64_t H) {
  for (int64_t c = 0; c < H; c++) acc[c] = 0.0f;
  const size_t es = lz_dtype_size(dt);
  for (int64_t j = next_row(rows, K, -1); j >= 0; j = next_row(rows, K, rows[j])) {
    const char *s = (const char *)src + (size_t)rows[j] * (size_t)H * es;
    const float wj = w ? w[j] : 1.0f;
    if (dt == LZ_BF16) {
      for (int64_t c = 0; c < H; c++)
        acc[c] += wj * lz_bf16_to_f32_inline(((const uint16_t *)s)[c]);
    } else if (w) {
      for (int64_t c = 0; c < H; c++) acc[c] += wj * ((const float *)s)[c];
    } else {
      for (int64_t c = 0; c < H; c++) acc[c] += ((const float *)s)[c];
    }
  }
}

lz_status lz_cpu_moe_permute_backward(const lz_op_args *a) {
  const lz_tensor *dx = a->t[0], *dout = a->t[1], *ros = a->t[2];
  const int64_t N = lz_rows(ros), K = lz_cols(ros), H = lz_cols(dout);
  const int32_t *rows = ros->data;
  LZ_TRY(check_ids(LZ_OP_MOE_PERMUTE_BACKWARD, "row_of_slot", rows, N * K, N * K,
                   "R, the rows of dout"));
  LZ_TRY(lz_moe_check_permutation(LZ_OP_MOE_PERMUTE_BACKWARD, rows, N * K));
  float *d = dx->data;
#pragma omp parallel for schedule(static) if (moe_tasks(N, K * H))
  for (int64_t t = 0; t < N; t++)
    gather_sum_row(d + t * H, dout->data, dout->dtype, rows + t * K, NULL, K, H);
  return LZ_OK;
}

/* ---------------------------------------------------------------- combine */

static lz_status combine_shapes(const char *op, const lz_tensor *row_of_slot,
                                const lz_tensor *weights, const lz_tensor *y,
                                const lz_tensor *tok, const char *tok_name) {
  LZ_TRY(lz_check_ndim(op, "row_of_slot", row_of_slot, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "y", y, 1, LZ_MAX_DIMS));
  const int64_t N = lz_rows(row_of_slot), K = lz_cols(row_of_slot), H = lz_cols(y);
  LZ_TRY(lz_check_numel(op, "weights", weights, N * K, "the shape of row_of_slot"));
  LZ_TRY(check_matrix(op, "y", y, N * K, H, "[N * K, H]: one row per slot of row_of_slot"));
  return check_matrix(op, tok_name, tok, N, H, "[N, H]: one row per row of row_of_slot");
}

lz_status lz_moe_combine_forward(lz_tensor *out, const lz_tensor *y, const lz_tensor *weights,
                                 const lz_tensor *row_of_slot) {
  const char *op = "moe_combine_forward";
  LZ_TRY(combine_shapes(op, row_of_slot, weights, y, out, "out"));
  LZ_OP_RUN(op, LZ_OP_MOE_COMBINE_FORWARD,
            .t = {out, (lz_tensor *)y, (lz_tensor *)weights, (lz_tensor *)row_of_slot});
}

lz_status lz_cpu_moe_combine_forward(const lz_op_args *a) {
  const lz_tensor *out = a->t[0], *y = a->t[1], *ros = a->t[3];
  const int64_t N = lz_rows(ros), K = lz_cols(ros), H = lz_cols(y);
  const int32_t *rows = ros->data;
  LZ_TRY(check_ids(LZ_OP_MOE_COMBINE_FORWARD, "row_of_slot", rows, N * K, N * K,
                   "R, the rows of y"));
  LZ_TRY(lz_moe_check_permutation(LZ_OP_MOE_COMBINE_FORWARD, rows, N * K));
  const float *w = a->t[2]->data;
  float *o = out->data;
#pragma omp parallel for schedule(static) if (moe_tasks(N, K * H))
  for (int64_t t = 0; t < N; t++)
    gather_sum_row(o + t * H, y->data, y->dtype, rows + t * K, w + t * K, K, H);
  return LZ_OK;
}

lz_status lz_moe_combine_backward(lz_tensor *dy, lz_tensor *dweights, const lz_tensor *dout,
                                  const lz_tensor *y, const lz_tensor *weights,
                                  const lz_tensor *row_of_slot) {
  const char *op = "moe_combine_backward";
  LZ_TRY(combine_shapes(op, row_of_slot, weights, y, dout, "dout"));
  if (dy) LZ_TRY(lz_check_same_shape(op, "dy", dy, "y", y));
  if (dweights)
    LZ_TRY(lz_check_numel(op, "dweights", dweights, lz_tensor_numel(weights),
                          "the shape of weights"));
  LZ_OP_RUN(op, LZ_OP_MOE_COMBINE_BACKWARD,
            .t = {dy, dweights, (lz_tensor *)dout, (lz_tensor *)y, (lz_tensor *)weights,
                  (lz_tensor *)row_of_slot});
}

/* One token's K slots: each dy row is a scaled copy of dout's row; each
 * dweight a dot product summed in column order. */
LZ_DISPATCH static void combine_backward_row(void *dy, lz_dtype dydt, float *dw,
                                             const float *dout, const void *y, lz_dtype ydt,
                                             const float *w, const int32_t *rows, int64_t K,
                                             int64_t H) {
  for (int64_t j = 0; j < K; j++) {
    const int64_t r = rows[j];
    if (dy) {
      if (dydt == LZ_BF16) {
        uint16_t *d = (uint16_t *)dy + r * H;
        for (int64_t c = 0; c < H; c++) d[c] = lz_bf16_from_f32_inline(w[j] * dout[c]);
      } else {
        float *d = (float *)dy + r * H;
        for (int64_t c = 0; c < H; c++) d[c] = w[j] * dout[c];
      }
    }
    if (dw) {
      float s = 0.0f;
      for (int64_t c = 0; c < H; c++) s += dout[c] * load(y, ydt, r * H + c);
      dw[j] = s;
    }
  }
}

lz_status lz_cpu_moe_combine_backward(const lz_op_args *a) {
  const lz_tensor *dy = a->t[0], *dw = a->t[1], *dout = a->t[2], *y = a->t[3], *ros = a->t[5];
  const int64_t N = lz_rows(ros), K = lz_cols(ros), H = lz_cols(y);
  const int32_t *rows = ros->data;
  LZ_TRY(check_ids(LZ_OP_MOE_COMBINE_BACKWARD, "row_of_slot", rows, N * K, N * K,
                   "R, the rows of y"));
  LZ_TRY(lz_moe_check_permutation(LZ_OP_MOE_COMBINE_BACKWARD, rows, N * K));
  const float *w = a->t[4]->data, *d = dout->data;
#pragma omp parallel for schedule(static) if (moe_tasks(N, K * H))
  for (int64_t t = 0; t < N; t++)
    combine_backward_row(dy ? dy->data : NULL, dy ? dy->dtype : LZ_F32,
                         dw ? (float *)dw->data + t * K : NULL, d + t * H, y->data, y->dtype,
                         w + t * K, rows + t * K, K, H);
  return LZ_OK;
}
