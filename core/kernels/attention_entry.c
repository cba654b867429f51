/* attention_entry.c — the public attention entries: their shape and option
 * checks, then the op (attention.c's kernels on the cpu backend). */
#include "kernels/attention_tiles.h"

#include <math.h> /* sqrtf, isinf */

/* ------------------------------------------------------------------ checks */

static lz_status check_shape3(const char *op, const char *name, const lz_tensor *t, int64_t d0,
                              int64_t d1, int64_t d2, const char *what, const lz_tensor *qkv) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->ndim != 3 || t->shape[0] != d0 || t->shape[1] != d1 || t->shape[2] != d2) {
    char bt[96], bq[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected f32[%lld,%lld,%lld] (%s, from qkv %s)",
                   op, name, lz_tensor_describe(t, bt, sizeof bt), (long long)d0, (long long)d1,
                   (long long)d2, what, lz_tensor_describe(qkv, bq, sizeof bq));
  }
  return LZ_OK;
}

/* The sizes of qkv's heads, for n_head and n_kv_head already checked, and
 * the options window, softcap, scale (0: off, 1/sqrt(HS)). */
attn_dims lz_attention_dims(const lz_tensor *qkv, int n_head, int n_kv_head, int64_t window,
                            float softcap, float scale) {
  attn_dims d;
  const int64_t parts = n_head + 2 * (int64_t)n_kv_head; /* heads of q, k and v in a row */
  d.B = qkv->shape[0];
  d.T = qkv->shape[1];
  d.HS = qkv->shape[2] / parts;
  d.C = d.HS * n_head;
  d.row = qkv->shape[2];
  d.NH = n_head;
  d.NKV = n_kv_head;
  d.HSP = (d.HS + VL - 1) / VL * VL;
  d.nb = (d.T + TILE - 1) / TILE;
  d.scale = scale ? scale : d.HS ? 1.0f / sqrtf((float)d.HS) : 0.0f;
  d.W = window;
  d.cap = softcap;
  return d;
}

/* Checks qkv's shape, n_head and n_kv_head and fills d. */
static lz_status check_qkv(const char *op, const lz_tensor *qkv, int n_head, int n_kv_head,
                           attn_dims *d) {
  LZ_TRY(lz_check_ndim(op, "qkv", qkv, 3, 3));
  char b[96];
  if (n_head < 1) return lz_fail(LZ_ERR_INVALID, "%s: n_head is %d; it must be >= 1", op, n_head);
  if (n_kv_head < 1 || n_head % n_kv_head != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: n_kv_head is %d; it must be >= 1 and divide n_head = %d (each key/value "
                   "head serves n_head/n_kv_head query heads)",
                   op, n_kv_head, n_head);
  const int64_t parts = n_head + 2 * (int64_t)n_kv_head; /* heads of q, k and v in a row */
  if (n_kv_head == n_head && qkv->shape[2] % 3 != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s; its last dimension must be 3C (q, k and v side by side), "
                   "and %lld is not a multiple of 3",
                   op, lz_tensor_describe(qkv, b, sizeof b), (long long)qkv->shape[2]);
  if (n_kv_head == n_head && (qkv->shape[2] / 3) % n_head != 0)
    return lz_fail(LZ_ERR_INVALID, "%s: C = %lld (qkv %s) is not divisible by n_head = %d", op,
                   (long long)(qkv->shape[2] / 3), lz_tensor_describe(qkv, b, sizeof b), n_head);
  if (qkv->shape[2] % parts != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: qkv is %s; its last dimension must be (n_head + 2 n_kv_head) * head_dim "
                   "= %lld * head_dim (q, then k and v of n_kv_head heads), and %lld is not a "
                   "multiple of %lld",
                   op, lz_tensor_describe(qkv, b, sizeof b), (long long)parts,
                   (long long)qkv->shape[2], (long long)parts);
  *d = lz_attention_dims(qkv, n_head, n_kv_head, 0, 0.0f, 0.0f);
  if (d->HS > MAX_HS)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "%s: head size C/n_head = %lld/%d = %lld is above the supported %d; use "
                   "more heads",
                   op, (long long)d->C, n_head, (long long)d->HS, MAX_HS);
  return LZ_OK;
}

/* ------------------------------------------------------------------ entry */

lz_status lz_attention_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv, int n_head) {
  return lz_attention_gqa_forward(out, lse, qkv, n_head, n_head);
}

lz_status lz_attention_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                const lz_tensor *out, const lz_tensor *lse, int n_head) {
  return lz_attention_gqa_backward(dqkv, dout, qkv, out, lse, n_head, n_head);
}

lz_status lz_attention_gqa_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv, int n_head,
                                   int n_kv_head) {
  return lz_attention_seg_forward(out, lse, qkv, NULL, n_head, n_kv_head);
}

lz_status lz_attention_gqa_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                    const lz_tensor *out, const lz_tensor *lse, int n_head,
                                    int n_kv_head) {
  return lz_attention_seg_backward(dqkv, dout, qkv, out, lse, NULL, n_head, n_kv_head);
}

/* The options of lz_attention_opts_*: each 0 (off) or a finite positive number. */
lz_status lz_attention_check_options(const char *op, int window, float softcap, float scale) {
  if (window < 0)
    return lz_fail(LZ_ERR_INVALID, "%s: window is %d; it must be >= 1 (keys a query sees, its "
                   "own included), or 0 for none", op, window);
  if (!(softcap >= 0.0f) || isinf(softcap))
    return lz_fail(LZ_ERR_INVALID, "%s: softcap is %g; it must be a finite number > 0, or 0 for "
                   "none", op, (double)softcap);
  if (!(scale >= 0.0f) || isinf(scale))
    return lz_fail(LZ_ERR_INVALID, "%s: scale is %g; it must be a finite number > 0, or 0 for "
                   "1/sqrt(head_dim)", op, (double)scale);
  return LZ_OK;
}

/* seg, when given: i32 [B, T]. Any ids: only equality matters. */
static lz_status check_seg(const char *op, const lz_tensor *seg, const attn_dims *d,
                           const lz_tensor *qkv) {
  if (!seg) return LZ_OK;
  if (seg->ndim != 2 || seg->shape[0] != d->B || seg->shape[1] != d->T) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID, "%s: seg is %s, expected i32[%lld,%lld] (from qkv %s)", op,
                   lz_tensor_describe(seg, a, sizeof a), (long long)d->B, (long long)d->T,
                   lz_tensor_describe(qkv, b, sizeof b));
  }
  return LZ_OK;
}

lz_status lz_attention_seg_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                   const lz_tensor *seg, int n_head, int n_kv_head) {
  return lz_attention_opts_forward(out, lse, qkv, seg, n_head, n_kv_head, 0, 0.0f, 0.0f);
}

/* The forward op; bf16: its tile products in bf16 (i[3]), where the CPU can. */
static lz_status forward_op(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                            const lz_tensor *seg, int n_head, int n_kv_head, int window,
                            float softcap, float scale, int bf16) {
  const char *op = "attention_forward";
  const lz_op_args args = {.t = {out, lse, (lz_tensor *)qkv, (lz_tensor *)seg},
                           .i = {n_head, n_kv_head, window, bf16},
                           .f = {softcap, scale}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_ATTENTION_FORWARD, &args));
  LZ_TRY(lz_attention_check_options(op, window, softcap, scale));
  const char *path;
  if (bf16) LZ_TRY(lz_bf16_attention_path(&path)); /* refuses a bad LZ_BF16_ATTENTION */
  attn_dims d;
  LZ_TRY(check_qkv(op, qkv, n_head, n_kv_head, &d));
  LZ_TRY(check_shape3(op, "out", out, d.B, d.T, d.C, "[B, T, C]", qkv));
  LZ_TRY(check_shape3(op, "lse", lse, d.B, d.NH, d.T, "[B, n_head, T]", qkv));
  LZ_TRY(check_seg(op, seg, &d, qkv));
  return lz_op_run(op, LZ_OP_ATTENTION_FORWARD, &args);
}

lz_status lz_attention_opts_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                    const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                    float softcap, float scale) {
  return forward_op(out, lse, qkv, seg, n_head, n_kv_head, window, softcap, scale, 0);
}

lz_status lz_attention_bf16_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                    const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                    float softcap, float scale) {
  return forward_op(out, lse, qkv, seg, n_head, n_kv_head, window, softcap, scale, 1);
}

lz_status lz_attention_seg_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                    const lz_tensor *out, const lz_tensor *lse,
                                    const lz_tensor *seg, int n_head, int n_kv_head) {
  return lz_attention_opts_backward(dqkv, dout, qkv, out, lse, seg, n_head, n_kv_head, 0, 0.0f,
                                    0.0f);
}

static lz_status backward_op(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                             const lz_tensor *out, const lz_tensor *lse, const lz_tensor *seg,
                             int n_head, int n_kv_head, int window, float softcap, float scale,
                             int bf16) {
  const char *op = "attention_backward";
  const lz_op_args args = {.t = {dqkv, (lz_tensor *)dout, (lz_tensor *)qkv, (lz_tensor *)out,
                                 (lz_tensor *)lse, (lz_tensor *)seg},
                           .i = {n_head, n_kv_head, window, bf16},
                           .f = {softcap, scale}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_ATTENTION_BACKWARD, &args));
  LZ_TRY(lz_attention_check_options(op, window, softcap, scale));
  const char *path;
  if (bf16) LZ_TRY(lz_bf16_attention_path(&path));
  attn_dims d;
  LZ_TRY(check_qkv(op, qkv, n_head, n_kv_head, &d));
  LZ_TRY(lz_check_same_shape(op, "dqkv", dqkv, "qkv", qkv));
  LZ_TRY(check_shape3(op, "dout", dout, d.B, d.T, d.C, "[B, T, C]", qkv));
  LZ_TRY(check_shape3(op, "out", out, d.B, d.T, d.C, "[B, T, C]", qkv));
  LZ_TRY(check_shape3(op, "lse", lse, d.B, d.NH, d.T, "[B, n_head, T]", qkv));
  LZ_TRY(check_seg(op, seg, &d, qkv));
  return lz_op_run(op, LZ_OP_ATTENTION_BACKWARD, &args);
}

lz_status lz_attention_opts_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                     const lz_tensor *out, const lz_tensor *lse,
                                     const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                     float softcap, float scale) {
  return backward_op(dqkv, dout, qkv, out, lse, seg, n_head, n_kv_head, window, softcap, scale, 0);
}

lz_status lz_attention_bf16_backward(lz_tensor *dqkv, const lz_tensor *dout, const lz_tensor *qkv,
                                     const lz_tensor *out, const lz_tensor *lse,
                                     const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                     float softcap, float scale) {
  return backward_op(dqkv, dout, qkv, out, lse, seg, n_head, n_kv_head, window, softcap, scale, 1);
}
