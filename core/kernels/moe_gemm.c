/* moe_gemm.c — the experts' grouped GEMM: rows sorted by expert (moe.c's
 * moe_sort), expert e's rows offsets[e] .. offsets[e + 1] multiplied by its
 * own weight w[e] [D, C] (nn.Linear's layout, experts stacked as
 * transformers 5.x stacks them), forward and backward. Each expert's product
 * is one GEMM of matmul.c's (lz_gemm), so an expert's rows come out bitwise
 * as a plain linear layer over those rows would give them. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "kernels/lz_gemm.h" /* lz_gemm */

static lz_status gemm_shapes(const char *op, const lz_tensor *x, const lz_tensor *w,
                             const lz_tensor *y, const char *yname, const lz_tensor *offsets) {
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  LZ_TRY(lz_check_ndim(op, "w", w, 3, 3));
  LZ_TRY(lz_check_ndim(op, "offsets", offsets, 1, 1));
  LZ_TRY(lz_check_ndim(op, yname, y, 1, LZ_MAX_DIMS));
  const int64_t E = w->shape[0], D = w->shape[1], C = w->shape[2], R = lz_rows(x);
  char bx[96], bw[96], by[96];
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
static lz_status check_offsets(lz_op op, const int32_t *off, int64_t E, int64_t R) {
  for (int64_t e = 0; e <= E; e++) {
    const int64_t lo = e ? off[e - 1] : 0;
    if (off[e] < lo || off[e] > R)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: offsets[%lld] is %d; offsets must rise from 0 or more to at most "
                     "%lld (the rows of x)",
                     lz_op_infos[op].name, (long long)e, (int)off[e], (long long)R);
  }
  return LZ_OK;
}

lz_status lz_moe_gemm_forward(lz_tensor *y, const lz_tensor *x, const lz_tensor *w,
                              const lz_tensor *offsets) {
  const char *op = "moe_gemm_forward";
  LZ_TRY(gemm_shapes(op, x, w, y, "y", offsets));
  LZ_OP_RUN(op, LZ_OP_MOE_GEMM_FORWARD,
            .t = {y, (lz_tensor *)x, (lz_tensor *)w, (lz_tensor *)offsets});
}

lz_status lz_cpu_moe_gemm_forward(const lz_op_args *a) {
  const lz_tensor *y = a->t[0], *x = a->t[1], *w = a->t[2];
  const int64_t E = w->shape[0], D = w->shape[1], C = w->shape[2], R = lz_rows(x);
  const int32_t *off = a->t[3]->data;
  LZ_TRY(check_offsets(LZ_OP_MOE_GEMM_FORWARD, off, E, R));
  const size_t es = lz_dtype_size(x->dtype);
  const char *xp = x->data, *wp = w->data;
  float *yp = y->data;
  for (int64_t e = 0; e < E; e++) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    LZ_TRY(lz_gemm(x->dtype, n, D, C, 0, 1, 1.0f, xp + (size_t)(r0 * C) * es,
                   wp + (size_t)(e * D * C) * es, 0.0f, yp + r0 * D));
  }
  return LZ_OK;
}

lz_status lz_moe_gemm_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *offsets) {
  const char *op = "moe_gemm_backward";
  LZ_TRY(gemm_shapes(op, x, w, dy, "dy", offsets));
  if (dx) LZ_TRY(lz_check_numel(op, "dx", dx, lz_tensor_numel(x), "the shape of x"));
  if (dw) LZ_TRY(lz_check_numel(op, "dw", dw, lz_tensor_numel(w), "the shape of w"));
  LZ_OP_RUN(op, LZ_OP_MOE_GEMM_BACKWARD,
            .t = {dx, dw, (lz_tensor *)dy, (lz_tensor *)x, (lz_tensor *)w,
                  (lz_tensor *)offsets});
}

lz_status lz_cpu_moe_gemm_backward(const lz_op_args *a) {
  const lz_tensor *dx = a->t[0], *dw = a->t[1], *dy = a->t[2], *x = a->t[3], *w = a->t[4];
  const int64_t E = w->shape[0], D = w->shape[1], C = w->shape[2], R = lz_rows(x);
  const int32_t *off = a->t[5]->data;
  LZ_TRY(check_offsets(LZ_OP_MOE_GEMM_BACKWARD, off, E, R));
  const lz_dtype dt = x->dtype;
  const size_t es = lz_dtype_size(dt);
  const char *xp = x->data, *wp = w->data, *dyp = dy->data;
  for (int64_t e = 0; e < E; e++) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    if (dx)
      LZ_TRY(lz_gemm(dt, n, C, D, 0, 0, 1.0f, dyp + (size_t)(r0 * D) * es,
                     wp + (size_t)(e * D * C) * es, 0.0f, (float *)dx->data + r0 * C));
    if (dw)
      LZ_TRY(lz_gemm(dt, D, C, n, 1, 0, 1.0f, dyp + (size_t)(r0 * D) * es,
                     xp + (size_t)(r0 * C) * es, 1.0f, (float *)dw->data + e * D * C));
  }
  return LZ_OK;
}
