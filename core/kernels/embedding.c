/* embedding.c — token plus position embedding (GPT-2's wte and wpe).
 *
 * Backward scatters rows of dout into dwte at the token ids, and a token that
 * repeats adds into the same row. Threads that split the (b, t) positions
 * would race on those rows, and atomics would make the sum order (and so the
 * bits) depend on timing. Threads split the channels instead: each owns a
 * column block of dwte and dwpe and walks every position in order, so the
 * result is the same on any thread count.
 *
 * The _pos variants take each token's position row from a tensor (a packed
 * batch restarts positions at each document); without one, position t. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"


/* Channels per thread task in backward: two cache lines of floats. */
#define COL_BLOCK 32

/* tokens: i32 [B, T]; its values are the kernel's to check (ids_check). */
static lz_status check_tokens(const char *op, const lz_tensor *tokens) {
  return lz_check_ndim(op, "tokens", tokens, 2, 2);
}

/* `name` must be [B, T, C] (f32) for tokens [B, T]. */
static lz_status check_activation(const char *op, const char *name, const lz_tensor *t,
                                  const lz_tensor *tokens, int64_t C) {
  LZ_TRY(lz_check_present(op, name, t));
  if (t->ndim != 3 || t->shape[0] != tokens->shape[0] || t->shape[1] != tokens->shape[1] ||
      t->shape[2] != C) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s, expected f32[%lld,%lld,%lld] (tokens is %s)", op,
                   name, lz_tensor_describe(t, a, sizeof a), (long long)tokens->shape[0],
                   (long long)tokens->shape[1], (long long)C,
                   lz_tensor_describe(tokens, b, sizeof b));
  }
  return LZ_OK;
}

/* A 2-D table [rows, C] whose C matches `ref_name`'s channels. */
static lz_status check_table_shape(const char *op, const char *name, const lz_tensor *t,
                                   int64_t C, const char *ref_name, const lz_tensor *ref) {
  LZ_TRY(lz_check_ndim(op, name, t, 2, 2));
  if (t->shape[1] != C) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID, "%s: %s is %s but %s is %s; they need the same channels C", op,
                   name, lz_tensor_describe(t, a, sizeof a), ref_name,
                   lz_tensor_describe(ref, b, sizeof b));
  }
  return LZ_OK;
}

/* The position table must have a row for each of the T positions. */
static lz_status check_positions(const char *op, const char *name, const lz_tensor *wpe,
                                 int64_t T) {
  if (T > wpe->shape[0]) {
    char a[96];
    return lz_fail(
        LZ_ERR_INVALID, "%s: sequence length T = %lld is longer than %s %s allows (%lld positions)",
        op, (long long)T, name, lz_tensor_describe(wpe, a, sizeof a), (long long)wpe->shape[0]);
  }
  return LZ_OK;
}

/* pos: i32 [B, T] like tokens; its values are the kernel's to check. */
static lz_status check_pos(const char *op, const lz_tensor *pos, const lz_tensor *tokens) {
  if (pos->ndim != 2 || pos->shape[0] != tokens->shape[0] || pos->shape[1] != tokens->shape[1]) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID, "%s: pos is %s but tokens is %s; they need the same shape", op,
                   lz_tensor_describe(pos, a, sizeof a), lz_tensor_describe(tokens, b, sizeof b));
  }
  return LZ_OK;
}

lz_status lz_embedding_check_ids(lz_op op, const lz_op_args *a, const int32_t *tok,
                                 const int32_t *pos) {
  const int fwd = op == LZ_OP_EMBEDDING_FORWARD;
  const char *name = lz_op_infos[op].name;
  const lz_tensor *tokens = a->t[fwd ? 1 : 3], *table = a->t[fwd ? 2 : 0];
  const lz_tensor *pe = a->t[fwd ? 3 : 1];
  /* With no dwte there is no vocabulary to check ids against: any id >= 0
   * is harmless since nothing is indexed by it. */
  const int64_t V = table ? table->shape[0] : INT32_MAX, T = tokens->shape[1];
  const int64_t n = lz_tensor_numel(tokens);
  int32_t id;
  int64_t i = lz_ids_first_outside(tok, n, 0, V, &id);
  if (i >= 0)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: tokens[%lld, %lld] is %d, outside the vocabulary [0, %lld) (V, the "
                   "rows of the token embedding)",
                   name, (long long)(i / T), (long long)(i % T), (int)id, (long long)V);
  if (!pos) return LZ_OK;
  const int64_t n_rows = pe->shape[0];
  i = lz_ids_first_outside(pos, n, 0, n_rows, &id);
  if (i < 0) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID,
                 "%s: pos[%lld, %lld] is %d, outside the %lld positions of %s; positions "
                 "must be in [0, %lld)",
                 name, (long long)(i / T), (long long)(i % T), (int)id, (long long)n_rows,
                 fwd ? "wpe" : "dwpe", (long long)n_rows);
}

/* ---------------------------------------------------------------- forward */

/* wpe_row NULL: the token row alone (Llama has no position table). Rows are
 * f32 or bf16 (both tables in one dtype): a bf16 table widens only the rows
 * it reads, exactly, so a step never converts the whole table. */
LZ_DISPATCH static void embedding_forward_row(float *out, const void *wte_row,
                                              const void *wpe_row, lz_dtype dt, int64_t C) {
  lz_row_to_f32(out, wte_row, dt, C);
  if (!wpe_row) return;
  if (dt == LZ_BF16) {
    const uint16_t *pe = wpe_row;
    for (int64_t c = 0; c < C; c++) out[c] += lz_bf16_to_f32_inline(pe[c]);
  } else {
    const float *pe = wpe_row;
    for (int64_t c = 0; c < C; c++) out[c] += pe[c];
  }
}

lz_status lz_embedding_forward(lz_tensor *out, const lz_tensor *tokens, const lz_tensor *wte,
                               const lz_tensor *wpe) {
  return lz_embedding_pos_forward(out, tokens, NULL, wte, wpe);
}

lz_status lz_embedding_pos_forward(lz_tensor *out, const lz_tensor *tokens, const lz_tensor *pos,
                                   const lz_tensor *wte, const lz_tensor *wpe) {
  const char *op = "embedding_forward";
  if (!wpe) pos = NULL; /* no position table: nothing to index */
  const lz_op_args args = {
      .t = {out, (lz_tensor *)tokens, (lz_tensor *)wte, (lz_tensor *)wpe, (lz_tensor *)pos}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_EMBEDDING_FORWARD, &args));
  LZ_TRY(lz_check_ndim(op, "wte", wte, 2, 2));
  const int64_t C = wte->shape[1];
  if (wpe) LZ_TRY(check_table_shape(op, "wpe", wpe, C, "wte", wte));
  LZ_TRY(check_tokens(op, tokens));
  const int64_t T = tokens->shape[1];
  if (wpe && pos)
    LZ_TRY(check_pos(op, pos, tokens));
  else if (wpe)
    LZ_TRY(check_positions(op, "wpe", wpe, T));
  LZ_TRY(check_activation(op, "out", out, tokens, C));
  return lz_op_run(op, LZ_OP_EMBEDDING_FORWARD, &args);
}

lz_status lz_cpu_embedding_forward(const lz_op_args *a) {
  lz_tensor *out = a->t[0];
  const lz_tensor *tokens = a->t[1], *wte = a->t[2], *wpe = a->t[3], *pos = a->t[4];
  LZ_TRY(lz_embedding_check_ids(LZ_OP_EMBEDDING_FORWARD, a, tokens->data, pos ? pos->data : NULL));
  const int64_t B = tokens->shape[0], T = tokens->shape[1], C = wte->shape[1];

  float *o = out->data;
  const lz_dtype dt = wte->dtype;
  const size_t es = lz_dtype_size(dt);
  const char *te = wte->data, *pe = wpe ? wpe->data : NULL;
  const int32_t *tok = tokens->data, *pp = pos ? pos->data : NULL;
#pragma omp parallel for schedule(static) if (B * T * C > (1 << 15))
  for (int64_t bt = 0; bt < B * T; bt++) {
    const int64_t p = pp ? pp[bt] : bt % T;
    embedding_forward_row(o + bt * C, te + (size_t)tok[bt] * C * es,
                          pe ? pe + (size_t)p * C * es : NULL, dt, C);
  }
  return LZ_OK;
}

/* --------------------------------------------------------------- backward */

/* Columns [c0, c0+nc) of dwte and dwpe, positions in order; dwte's row
 * skip (< 0: none) takes nothing. */
LZ_DISPATCH static void embedding_backward_block(float *dwte, float *dwpe, const float *dout,
                                                 const int32_t *tok, const int32_t *pos, int64_t B,
                                                 int64_t T, int64_t C, int64_t c0, int64_t nc,
                                                 int64_t skip) {
  for (int64_t bt = 0; bt < B * T; bt++) {
    const float *d = dout + bt * C + c0;
    if (dwte && tok[bt] != skip) {
      float *row = dwte + (int64_t)tok[bt] * C + c0;
      for (int64_t j = 0; j < nc; j++) row[j] += d[j];
    }
    if (dwpe) {
      float *row = dwpe + (pos ? (int64_t)pos[bt] : bt % T) * C + c0;
      for (int64_t j = 0; j < nc; j++) row[j] += d[j];
    }
  }
}

lz_status lz_embedding_backward(lz_tensor *dwte, lz_tensor *dwpe, const lz_tensor *dout,
                                const lz_tensor *tokens) {
  return lz_embedding_pos_backward(dwte, dwpe, dout, tokens, NULL);
}

lz_status lz_embedding_pos_backward(lz_tensor *dwte, lz_tensor *dwpe, const lz_tensor *dout,
                                    const lz_tensor *tokens, const lz_tensor *pos) {
  return lz_embedding_skip_backward(dwte, dwpe, dout, tokens, pos, -1);
}

lz_status lz_embedding_skip_backward(lz_tensor *dwte, lz_tensor *dwpe, const lz_tensor *dout,
                                     const lz_tensor *tokens, const lz_tensor *pos, int64_t skip) {
  const char *op = "embedding_backward";
  if (!dwpe) pos = NULL; /* no position table: nothing to index */
  const lz_op_args args = {
      .t = {dwte, dwpe, (lz_tensor *)dout, (lz_tensor *)tokens, (lz_tensor *)pos},
      .i = {skip < 0 ? 0 : skip + 1}};
  LZ_TRY(lz_op_check_dtypes(op, LZ_OP_EMBEDDING_BACKWARD, &args));
  LZ_TRY(lz_check_ndim(op, "dout", dout, 3, 3));
  const int64_t C = dout->shape[2];
  if (dwte) LZ_TRY(check_table_shape(op, "dwte", dwte, C, "dout", dout));
  LZ_TRY(check_tokens(op, tokens));
  LZ_TRY(check_activation(op, "dout", dout, tokens, C));
  const int64_t T = tokens->shape[1];
  if (dwpe) {
    LZ_TRY(check_table_shape(op, "dwpe", dwpe, C, "dout", dout));
    if (pos)
      LZ_TRY(check_pos(op, pos, tokens));
    else
      LZ_TRY(check_positions(op, "dwpe", dwpe, T));
  }
  return lz_op_run(op, LZ_OP_EMBEDDING_BACKWARD, &args);
}

lz_status lz_cpu_embedding_backward(const lz_op_args *a) {
  lz_tensor *dwte = a->t[0], *dwpe = a->t[1];
  const lz_tensor *dout = a->t[2], *tokens = a->t[3], *pos = a->t[4];
  LZ_TRY(lz_embedding_check_ids(LZ_OP_EMBEDDING_BACKWARD, a, tokens->data, pos ? pos->data : NULL));
  const int64_t B = tokens->shape[0], T = tokens->shape[1], C = dout->shape[2];
  if (!dwte && !dwpe) return LZ_OK;

  float *te = dwte ? dwte->data : NULL, *pe = dwpe ? dwpe->data : NULL;
  const float *d = dout->data;
  const int32_t *tok = tokens->data, *pp = pos ? pos->data : NULL;
  const int64_t n_blocks = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static) if (B * T * C > (1 << 15))
  for (int64_t k = 0; k < n_blocks; k++) {
    int64_t c0 = k * COL_BLOCK, nc = C - c0 < COL_BLOCK ? C - c0 : COL_BLOCK;
    embedding_backward_block(te, pe, d, tok, pp, B, T, C, c0, nc, a->i[0] - 1);
  }
  return LZ_OK;
}
