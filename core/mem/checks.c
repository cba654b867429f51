/* checks.c — the argument checks kernels share: each names the op, the
 * argument and, through lz_tensor_describe, its shape; and the row and
 * column counts of a tensor. Above tensor.c, which uses none of them. */
#include "mem/lz_internal.h"

lz_status lz_check_present(const char *op, const char *name, const lz_tensor *t) {
  if (!t) return lz_fail(LZ_ERR_INVALID, "%s: %s is missing (NULL)", op, name);
  return LZ_OK;
}

/* The shape checks accept tensors on any device: each public op ends its
 * checks with lz_op_run, which checks the declared dtypes, runs the kernel
 * of the tensors' device and refuses a mix of devices. */
lz_status lz_check_ndim(const char *op, const char *name, const lz_tensor *t, int lo, int hi) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->ndim < lo || t->ndim > hi) {
    char buf[96];
    if (lo == hi)
      return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected %d dimensions", op, name,
                     lz_tensor_describe(t, buf, sizeof buf), lo);
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected %d to %d dimensions", op, name,
                   lz_tensor_describe(t, buf, sizeof buf), lo, hi);
  }
  return LZ_OK;
}

lz_status lz_check_numel(const char *op, const char *name, const lz_tensor *t, int64_t n,
                         const char *why) {
  LZ_TRY(lz_check_present(op, name, t));
  if (lz_tensor_numel(t) != n) {
    char buf[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s (%lld elements), expected %lld elements (%s)", op,
                   name, lz_tensor_describe(t, buf, sizeof buf), (long long)lz_tensor_numel(t),
                   (long long)n, why);
  }
  return LZ_OK;
}

lz_status lz_check_same_shape(const char *op, const char *name_a, const lz_tensor *a,
                              const char *name_b, const lz_tensor *b) {
  LZ_TRY(lz_check_present(op, name_a, a));
  LZ_TRY(lz_check_present(op, name_b, b));
  int same = a->ndim == b->ndim;
  for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
  if (!same) {
    char ba[96], bb[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s but %s is %s; they must have the same shape", op,
                   name_a, lz_tensor_describe(a, ba, sizeof ba), name_b,
                   lz_tensor_describe(b, bb, sizeof bb));
  }
  return LZ_OK;
}

lz_status lz_check_rowwise(const char *op, const lz_tensor *x, const lz_arg *like,
                           const lz_arg *per_col, const lz_arg *per_row) {
  LZ_TRY(lz_check_ndim(op, "x", x, 1, LZ_MAX_DIMS));
  const int64_t C = lz_cols(x), rows = lz_rows(x);
  for (; like->name; like++) LZ_TRY(lz_check_same_shape(op, like->name, like->t, "x", x));
  for (; per_col->name; per_col++)
    LZ_TRY(lz_check_numel(op, per_col->name, per_col->t, C, "the last dimension of x"));
  for (; per_row->name; per_row++)
    LZ_TRY(lz_check_numel(op, per_row->name, per_row->t, rows, "one per row of x"));
  return LZ_OK;
}

lz_status lz_check_no_alias(const char *op, const char *out_name, const lz_tensor *out,
                            const char *in_name, const lz_tensor *in) {
  if (in->dtype != LZ_F32 && out->data == in->data)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s (f32) and %s (%s) are the same memory; only an f32 input may be "
                   "overwritten by its result",
                   op, out_name, in_name, lz_dtype_name(in->dtype));
  return LZ_OK;
}

int64_t lz_cols(const lz_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

int64_t lz_rows(const lz_tensor *t) {
  int64_t c = lz_cols(t);
  return c ? lz_tensor_numel(t) / c : 0;
}

/* ids: n i32 values in host memory (a kernel checks the ids where it runs).
 * The index of the first outside [lo, hi), or -1; its value in *value. Each
 * caller words the refusal itself (the meaning of the range is its own). */
int64_t lz_ids_first_outside(const int32_t *ids, int64_t n, int64_t lo, int64_t hi,
                             int32_t *value) {
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < lo || ids[i] >= hi) {
      *value = ids[i];
      return i;
    }
  return -1;
}
