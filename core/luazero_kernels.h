/* luazero_kernels.h — the kernels of the public C API (the part of
 * luazero.h that declares lz_matmul and the other ops, the optimizers' steps
 * and the hashes). Included by luazero.h, inside its extern "C" and after the
 * types it uses: include luazero.h, not this file. Its LZ_CDEF block joins
 * luazero.h's in lua/luazero/cdef.lua (tools/gen-cdef.lua). */
#ifndef LUAZERO_KERNELS_H
#define LUAZERO_KERNELS_H

/* LZ_CDEF_BEGIN */

/* ------------------------------------------------------------- kernels */

/* The public ops (each op's lz_<name> and its variants), as declared once
 * in core/mem/lz_ops.def: the i-th name from 0, NULL past the last. Lua's
 * lz.ops is built from this list. */
const char *lz_op_entry_name(int i);

/* c = alpha * op(a) @ op(b) + beta * c. a, b: f32, or both bf16 (fp32
 * accumulation); c: f32. 2-D, or 3-D batched (b may be 2-D: shared). */
lz_status lz_matmul(lz_tensor *c, const lz_tensor *a, const lz_tensor *b, int trans_a,
                    int trans_b, float alpha, float beta);

/* out[..., OC] = x[..., C] @ w[OC, C]^T + bias[OC]; bias may be NULL.
 * x, w: f32 or both bf16; out f32. */
lz_status lz_linear_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *w,
                            const lz_tensor *bias);
/* dx = dy @ w (written); dw += dy^T @ x; db += sum(dy). Any of dx, dw, db may
 * be NULL. dy, x and w share one dtype (f32, or bf16 with fp32 accumulation);
 * dx, dw, db: f32. */
lz_status lz_linear_backward(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                             const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w);
/* The same, with dw = dy^T @ x and db = sum(dy) written instead of added:
 * the first micro-step of an accumulation needs no zeroed gradients. The
 * bits are those of an add into zeros (tests/test_matmul.c), save a dw
 * element whose every product is -0: written -0 where the add gives +0. */
lz_status lz_linear_backward_write(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                   const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w);
/* lz_linear_backward (write: _write) that also takes the gradient norm's
 * partials of dw's final values right after its product wrote them (in the
 * cache, at the size of a layer's weight): dw lies in a gradient slice of
 * slice_numel elements at element dw_at, and blocks[k] becomes the sum of
 * squares of the slice's block k (lz_sq_norm's blocks of 4,096 elements,
 * its bits) for every block inside dw; the others are left as they are
 * (lz_sq_norm_blocks reads them). blocks is host memory, as in
 * lz_moe_gemm_part_backward_norm; a cuda device takes no partials. */
lz_status lz_linear_backward_norm(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                  const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                  int write, double *blocks, int64_t slice_numel, int64_t dw_at);

/* Over the last dimension C. mean, rstd: numel(x)/C floats, saved for backward. */
lz_status lz_layernorm_forward(lz_tensor *out, lz_tensor *mean, lz_tensor *rstd,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *b,
                               float eps);
lz_status lz_layernorm_backward(lz_tensor *dx, lz_tensor *dw, lz_tensor *db,
                                const lz_tensor *dy, const lz_tensor *x, const lz_tensor *w,
                                const lz_tensor *mean, const lz_tensor *rstd);

/* GELU, tanh approximation (GPT-2). out may alias x; dx may alias dy. */
lz_status lz_gelu_forward(lz_tensor *out, const lz_tensor *x);
lz_status lz_gelu_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *x);

/* Llama's layers (Hugging Face's equations), on the cpu and sim (not cuda
 * yet). Inputs f32, or bf16 with fp32 arithmetic (bitwise the f32 result on
 * the bf16 values widened); outputs and saved statistics f32, save where
 * one says bf16: the f32 result rounded to nearest even, as tensor_copy
 * rounds (an output that only feeds bf16 GEMMs, written without a cast
 * pass). An f32 output may alias an f32 input only; a bf16 one no input. */

/* RMSNorm over the last dimension C: out = w * (x / sqrt(mean(x^2) + eps)).
 * x, w: f32 or both bf16 (and dy, x, w in backward); out f32 or bf16; rstd,
 * dx, dw f32.
 * rstd: numel(x)/C floats, 1/sqrt(mean(x^2) + eps), saved for backward. */
lz_status lz_rmsnorm_forward(lz_tensor *out, lz_tensor *rstd, const lz_tensor *x,
                             const lz_tensor *w, float eps);
/* dx written (may alias dy); dw += sum over rows of dy * x * rstd. */
lz_status lz_rmsnorm_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                              const lz_tensor *x, const lz_tensor *w, const lz_tensor *rstd);

/* QK-norm (Qwen3's q_norm and k_norm, Gemma 3's, OLMoE's whole-projection
 * one): RMSNorm over each head of q and of k inside packed q|k|v rows, qkv
 * [..., C] f32, C >= n_head * numel(q_w) + n_kv_head * numel(k_w):
 * out = (offset + w) * (x / sqrt(mean(x^2) + eps)) per head, q_w for the
 * n_head q heads, k_w for the n_kv_head k heads that follow (each head as
 * wide as its weight); the columns after them are copied (offset 0: Qwen3,
 * 1: Gemma 3's x * (1 + w)). clip > 0 (OLMoE's clip_qkv) then clamps every
 * output, the copied columns too, to [-clip, clip]; 0 is none. rstd: one
 * 1/rms per q and k head of each row. out may alias qkv. All f32. */
lz_status lz_qk_norm_forward(lz_tensor *out, lz_tensor *rstd, const lz_tensor *qkv,
                             const lz_tensor *q_w, const lz_tensor *k_w, int n_head, int n_kv_head,
                             float eps, float offset, float clip);
/* dx written (may alias dy; the columns after the k heads are dy's, 0
 * where forward clamped them); dq_w, dk_w += sums over rows and heads of
 * dy * x * rstd; where forward clamped an output (clip > 0) its dy counts
 * as 0. qkv: forward's input. */
lz_status lz_qk_norm_backward(lz_tensor *dx, lz_tensor *dq_w, lz_tensor *dk_w, const lz_tensor *dy,
                              const lz_tensor *qkv, const lz_tensor *q_w, const lz_tensor *k_w,
                              const lz_tensor *rstd, int n_head, int n_kv_head, float offset,
                              float clip);

/* Rotary embeddings, rotate_half convention: x [B, T, n_head * head_dim]; in
 * each head, element i pairs with i + head_dim/2 and turns by the angle
 * (pos_offset + t) * theta^(-2i/head_dim). out may alias x. Backward turns dy
 * by the opposite angles; dx may alias dy. */
lz_status lz_rope_forward(lz_tensor *out, const lz_tensor *x, int n_head, int head_dim,
                          int64_t pos_offset, float theta);
lz_status lz_rope_backward(lz_tensor *dx, const lz_tensor *dy, int n_head, int head_dim,
                           int64_t pos_offset, float theta);
/* The same with the inverse frequencies given: inv_freq f32 [head_dim/2]
 * (Llama 3's rope_scaling). x, dy: f32 or bf16; out f32; dx f32, or bf16
 * from an f32 dy. The last
 * dimension may hold more than n_head heads: the first n_head turn, the rest
 * is copied (Llama's packed q|k|v rows: turn the q and k heads). */
lz_status lz_rope_freqs_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *inv_freq,
                                int n_head, int64_t pos_offset);
lz_status lz_rope_freqs_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *inv_freq,
                                 int n_head, int64_t pos_offset);
/* The freqs variants with a position per token: pos i32 [B, T] (>= 0),
 * the position of each row within its document (a packed batch restarts at 0
 * at each document). pos NULL is the freqs variant with pos_offset 0. */
lz_status lz_rope_pos_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *inv_freq,
                              const lz_tensor *pos, int n_head);
lz_status lz_rope_pos_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *inv_freq,
                               const lz_tensor *pos, int n_head);
/* The freqs variants for heads that turn in part, with cos and sin scaled
 * (Phi-3's partial_rotary_factor and LongRoPE's attention factor): in each
 * head of head_dim values the first rotary_dim = 2 * numel(inv_freq) turn
 * (element i pairs with i + rotary_dim/2) and the rest pass; cos and sin are
 * each multiplied by scale in fp32 (0: not multiplied). pos may be NULL
 * (pos_offset + t), else as the pos variants' (pos_offset then 0). */
lz_status lz_rope_ext_forward(lz_tensor *out, const lz_tensor *x, const lz_tensor *inv_freq,
                              const lz_tensor *pos, int n_head, int head_dim, int64_t pos_offset,
                              float scale);
lz_status lz_rope_ext_backward(lz_tensor *dx, const lz_tensor *dy, const lz_tensor *inv_freq,
                               const lz_tensor *pos, int n_head, int head_dim, int64_t pos_offset,
                               float scale);

/* out = silu(gate) * up, all one shape; out may alias gate or up. Backward
 * writes dgate and dup (two buffers; each may alias dout, gate or up).
 * gate, up (and dout): f32 or all bf16; out f32 or bf16; dgate, dup both f32
 * or both bf16. The GeGLU and packed forms likewise. */
lz_status lz_swiglu_forward(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up);
lz_status lz_swiglu_backward(lz_tensor *dgate, lz_tensor *dup, const lz_tensor *dout,
                             const lz_tensor *gate, const lz_tensor *up);
/* The same with gate and up in one tensor, gate [..., 2H]: each row's H
 * gate values, then its H up values (Phi-3's gate_up_proj); out, dout
 * [..., H]. dgate (shaped as gate) gets the gradients of both halves in
 * each row; it may be gate when that is f32. */
lz_status lz_swiglu_packed_forward(lz_tensor *out, const lz_tensor *gate);
lz_status lz_swiglu_packed_backward(lz_tensor *dgate, const lz_tensor *dout,
                                    const lz_tensor *gate);

/* out = gelu_tanh(gate) * up (Gemma's GeGLU; gelu as lz_gelu_forward's);
 * shapes, dtypes and aliasing as lz_swiglu_forward and lz_swiglu_backward. */
lz_status lz_geglu_forward(lz_tensor *out, const lz_tensor *gate, const lz_tensor *up);
lz_status lz_geglu_backward(lz_tensor *dgate, lz_tensor *dup, const lz_tensor *dout,
                            const lz_tensor *gate, const lz_tensor *up);

/* Causal multi-head self-attention. qkv [B, T, 3C] (q, k, v each [B, T, NH, C/NH]),
 * out [B, T, C], lse [B, NH, T] (row log-sum-exp, saved for backward).
 * Scale 1/sqrt(C/NH). */
lz_status lz_attention_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                               int n_head);
lz_status lz_attention_backward(lz_tensor *dqkv, const lz_tensor *dout,
                                const lz_tensor *qkv, const lz_tensor *out,
                                const lz_tensor *lse, int n_head);
/* Grouped-query attention (Llama): qkv rows pack [q: n_head * hd | k:
 * n_kv_head * hd | v: n_kv_head * hd], hd the head size; query head h reads
 * key/value head h / (n_head / n_kv_head). out [B, T, n_head * hd], lse
 * [B, n_head, T]. n_kv_head must divide n_head; n_kv_head = n_head is the
 * multi-head attention above (which calls these). */
lz_status lz_attention_gqa_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                   int n_head, int n_kv_head);
lz_status lz_attention_gqa_backward(lz_tensor *dqkv, const lz_tensor *dout,
                                    const lz_tensor *qkv, const lz_tensor *out,
                                    const lz_tensor *lse, int n_head, int n_kv_head);
/* Document masking: seg i32 [B, T], a document id per token; query t sees
 * key s only when s <= t and seg[b, s] == seg[b, t] (a packed batch's
 * documents never see each other). seg NULL is the plain causal attention
 * above, bitwise. n_kv_head = n_head for multi-head attention. */
lz_status lz_attention_seg_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                   const lz_tensor *seg, int n_head, int n_kv_head);
lz_status lz_attention_seg_backward(lz_tensor *dqkv, const lz_tensor *dout,
                                    const lz_tensor *qkv, const lz_tensor *out,
                                    const lz_tensor *lse, const lz_tensor *seg, int n_head,
                                    int n_kv_head);
/* The attention above with a family's options, each 0 for off (then the
 * results are the plain ones, bitwise):
 *   window   a query at t sees keys s with t - window < s <= t (window keys,
 *            its own included; Mistral's sliding_window, as transformers 5.x
 *            masks it); key tiles wholly outside are skipped.
 *   softcap  each scaled score s becomes softcap * tanh(s / softcap)
 *            (Gemma 2's attn_logit_softcapping).
 *   scale    the scores' factor instead of 1/sqrt(head_dim) (Gemma's
 *            query_pre_attn_scalar ** -0.5).
 * Backward takes the options forward ran with. */
lz_status lz_attention_opts_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                    const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                    float softcap, float scale);
lz_status lz_attention_opts_backward(lz_tensor *dqkv, const lz_tensor *dout,
                                     const lz_tensor *qkv, const lz_tensor *out,
                                     const lz_tensor *lse, const lz_tensor *seg, int n_head,
                                     int n_kv_head, int window, float softcap, float scale);
/* lz_attention_opts_* for bf16 training: the tile products (Q K^T, P V and
 * backward's four) take their operands rounded to bf16 and accumulate in
 * fp32, on the CPU's bf16 dot-product unit; the softmax and masks stay fp32.
 * Where the CPU has none (lz_bf16_attention_path), and on a device backend
 * (its attention computes in fp32), these are the fp32 entries. */
lz_status lz_attention_bf16_forward(lz_tensor *out, lz_tensor *lse, const lz_tensor *qkv,
                                    const lz_tensor *seg, int n_head, int n_kv_head, int window,
                                    float softcap, float scale);
lz_status lz_attention_bf16_backward(lz_tensor *dqkv, const lz_tensor *dout,
                                     const lz_tensor *qkv, const lz_tensor *out,
                                     const lz_tensor *lse, const lz_tensor *seg, int n_head,
                                     int n_kv_head, int window, float softcap, float scale);
/* How lz_attention_bf16_* run here: "native avx512_bf16 tiles" or "f32 tiles
 * (...)"; LZ_BF16_ATTENTION=native|f32 overrides the choice by CPU. */
lz_status lz_bf16_attention_path(const char **what);
/* Attention against a key/value cache (generation). qkv f32 [B, T, W]: the
 * packed q|k|v rows above for T new positions. k_cache, v_cache [B, S,
 * n_kv_head * hd], f32 or bf16, row b holding pos[b] positions (pos: i32
 * [B], host memory). The new keys and values are written at pos[b] ..
 * pos[b] + T - 1 (pos[b] + T <= S), then query t of row b attends to
 * positions 0 .. pos[b] + t. out f32 [B, T, n_head * hd]. pos is left as it
 * is (the caller advances it). Cpu tensors only. */
lz_status lz_attention_decode(lz_tensor *out, const lz_tensor *qkv, lz_tensor *k_cache,
                              lz_tensor *v_cache, const lz_tensor *pos, int n_head,
                              int n_kv_head);
/* lz_attention_decode with lz_attention_opts_forward's options. With a
 * window, the caches are rings: position s lives at s % S, so S >= window
 * slots hold all a query sees, however long the context (pos[b] + T may
 * pass S; a shorter cache must hold every position); the T new positions'
 * keys are read from qkv, and the last S of them are written once every
 * query has run. */
lz_status lz_attention_opts_decode(lz_tensor *out, const lz_tensor *qkv, lz_tensor *k_cache,
                                   lz_tensor *v_cache, const lz_tensor *pos, int n_head,
                                   int n_kv_head, int window, float softcap, float scale);

/* out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]. tokens i32 [B, T]. wpe
 * may be NULL: the token rows alone (Llama's embed_tokens). */
lz_status lz_embedding_forward(lz_tensor *out, const lz_tensor *tokens, const lz_tensor *wte,
                               const lz_tensor *wpe);
/* dwte, dwpe accumulate; either may be NULL. Deterministic. */
lz_status lz_embedding_backward(lz_tensor *dwte, lz_tensor *dwpe, const lz_tensor *dout,
                                const lz_tensor *tokens);
/* The same with the position rows given: out[b, t, :] = wte[tokens[b, t], :] +
 * wpe[pos[b, t], :], pos i32 [B, T] in [0, rows of wpe) (a packed batch's
 * positions restart at each document). pos NULL: position t, as above. */
lz_status lz_embedding_pos_forward(lz_tensor *out, const lz_tensor *tokens, const lz_tensor *pos,
                                   const lz_tensor *wte, const lz_tensor *wpe);
lz_status lz_embedding_pos_backward(lz_tensor *dwte, lz_tensor *dwpe, const lz_tensor *dout,
                                    const lz_tensor *tokens, const lz_tensor *pos);
/* lz_embedding_pos_backward where dwte's row `skip` takes nothing (torch's
 * nn.Embedding padding_idx: the positions holding that token add no
 * gradient to its row; dwpe's rows take theirs). skip < 0: none. */
lz_status lz_embedding_skip_backward(lz_tensor *dwte, lz_tensor *dwpe, const lz_tensor *dout,
                                     const lz_tensor *tokens, const lz_tensor *pos, int64_t skip);

/* logits [B, T, Vp]; only the first `vocab` columns take part (Vp >= vocab
 * allows padding). targets i32 [B, T]; a negative target is ignored (loss 0,
 * gradient 0). losses f32 [B, T]. */
lz_status lz_cross_entropy_forward(lz_tensor *losses, const lz_tensor *logits,
                                   const lz_tensor *targets, int64_t vocab);
/* dlogits = (softmax(logits) - onehot(target)) * dloss; padded columns get 0.
 * dlogits may alias logits. */
lz_status lz_cross_entropy_backward(lz_tensor *dlogits, const lz_tensor *logits,
                                    const lz_tensor *targets, int64_t vocab, float dloss);
/* As lz_cross_entropy_backward, through a soft-cap: logits are the capped
 * y = cap * tanh(x / cap) (lz_softcap_forward) and dlogits is the gradient
 * of x, each one times 1 - (y / cap)^2. cap > 0. */
lz_status lz_cross_entropy_softcap_backward(lz_tensor *dlogits, const lz_tensor *logits,
                                            const lz_tensor *targets, int64_t vocab, float dloss,
                                            float cap);
/* out = cap * tanh(x / cap) (Gemma 2's final-logit soft-capping), f32, the
 * same element count; out may alias x. cap > 0. */
lz_status lz_softcap_forward(lz_tensor *out, const lz_tensor *x, float cap);

/* Mixture of experts. N tokens, E experts, K slots per token (top-k), R = N * K
 * rows sorted by expert; indices i32, weights and probabilities f32.
 * Route, as transformers' routers: probs [N, E] = softmax(logits) in fp32
 * (logits f32 or bf16); idx [N, K] the K most probable experts, descending,
 * a tie going to the lower expert (torch.topk's order); weights [N, K] their
 * probabilities, divided by their sum when norm (norm_topk_prob). Backward:
 * dlogits (f32 or bf16) from dweights and, when not NULL, dprobs (the
 * gradient reaching probs from the auxiliary loss). */
lz_status lz_moe_route_forward(lz_tensor *weights, lz_tensor *idx, lz_tensor *probs,
                               const lz_tensor *logits, int norm);
lz_status lz_moe_route_backward(lz_tensor *dlogits, const lz_tensor *dweights,
                                const lz_tensor *dprobs, const lz_tensor *probs,
                                const lz_tensor *idx, int norm);
/* The expert order of idx's slots (slot s = token * K + j): slot_of_row [R],
 * its inverse row_of_slot [N, K], and offsets [E + 1], expert e's rows being
 * offsets[e] .. offsets[e + 1], by token then slot: the same for the same idx.
 * The ops below take row_of_slot as this makes it: a permutation of the
 * rows, so that no two slots write one row. */
lz_status lz_moe_sort(lz_tensor *row_of_slot, lz_tensor *slot_of_row, lz_tensor *offsets,
                      const lz_tensor *idx);
/* out [R, H] row r = x [N, H] row slot_of_row[r] / K (f32 or bf16 each: the
 * gather converts). Backward: dx [N, H] row t = the sum of dout [R, H]'s rows
 * row_of_slot[t, :] taken in row order (no atomics: bitwise reproducible). */
lz_status lz_moe_permute_forward(lz_tensor *out, const lz_tensor *x,
                                 const lz_tensor *slot_of_row);
lz_status lz_moe_permute_backward(lz_tensor *dx, const lz_tensor *dout,
                                  const lz_tensor *row_of_slot);
/* out [N, H] (f32) row t = the sum, in row (= expert) order as transformers'
 * index_add_ loop, of weights[t, j] * y [R, H] row row_of_slot[t, j]. Backward:
 * dy row row_of_slot[t, j] = weights[t, j] * dout row t (f32 or bf16);
 * dweights[t, j] = dout row t . that row of y; either may be NULL. */
lz_status lz_moe_combine_forward(lz_tensor *out, const lz_tensor *y, const lz_tensor *weights,
                                 const lz_tensor *row_of_slot);
lz_status lz_moe_combine_backward(lz_tensor *dy, lz_tensor *dweights, const lz_tensor *dout,
                                  const lz_tensor *y, const lz_tensor *weights,
                                  const lz_tensor *row_of_slot);
/* Grouped GEMM: for each expert e, y [R, D] rows offsets[e] .. offsets[e + 1]
 * = x [R, C]'s rows @ w[e]^T, w [E, D, C] (each expert as nn.Linear's [out,
 * in]); rows outside offsets[0] .. offsets[E] are not touched; an expert with
 * no rows is skipped. x and w f32, or both bf16 (fp32 accumulation); y f32.
 * Backward: dx = dy @ w[e] (written), dw[e] += dy^T @ x; either may be NULL;
 * dy has x's dtype. */
lz_status lz_moe_gemm_forward(lz_tensor *y, const lz_tensor *x, const lz_tensor *w,
                              const lz_tensor *offsets);
lz_status lz_moe_gemm_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                               const lz_tensor *x, const lz_tensor *w, const lz_tensor *offsets);
/* The same where each expert holds P matrices side by side, w [E, P, D, C]
 * (a block's experts as their checkpoint lays them out, w1, w3, w2 each):
 * part p (0 <= p < P) of each expert is the one multiplied; dw has w's
 * layout. */
lz_status lz_moe_gemm_part_forward(lz_tensor *y, const lz_tensor *x, const lz_tensor *w,
                                   const lz_tensor *offsets, int64_t part);
lz_status lz_moe_gemm_part_backward(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                                    const lz_tensor *x, const lz_tensor *w,
                                    const lz_tensor *offsets, int64_t part);
/* moe_gemm_part_backward with dw's part written, not added to: every
 * expert's, zeros where it has no rows (the first micro-step of an
 * accumulation needs no zeroed gradients). */
lz_status lz_moe_gemm_part_backward_write(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                                          const lz_tensor *x, const lz_tensor *w,
                                          const lz_tensor *offsets, int64_t part);
/* moe_gemm_part_backward (write: dw's part written, as _write) that also
 * takes the gradient norm's partials of dw's final values while each task's
 * block of them is still in cache. dw lies in a gradient slice of
 * slice_numel elements at element dw_at; blocks[k] becomes the sum of
 * squares of the slice's block k (lz_sq_norm's blocks of 4,096 elements,
 * its bits) for every block that lies inside one task's rows or one row-less
 * written expert; the other entries are left as they are. blocks is host
 * memory: the sim device's worker writes it when the op runs there, a cuda
 * device's kernel takes no partials and leaves them all. dx or dw may be
 * NULL, as in moe_gemm_part_backward. */
lz_status lz_moe_gemm_part_backward_norm(lz_tensor *dx, lz_tensor *dw, const lz_tensor *dy,
                                         const lz_tensor *x, const lz_tensor *w,
                                         const lz_tensor *offsets, int64_t part, int write,
                                         double *blocks, int64_t slice_numel, int64_t dw_at);

/* Elementwise, f32 (fill and scale also bf16/f16, on any device). out may alias a or b. */
lz_status lz_add(lz_tensor *out, const lz_tensor *a, const lz_tensor *b);
lz_status lz_axpy(lz_tensor *y, float alpha, const lz_tensor *x); /* y += alpha*x */
lz_status lz_scale(lz_tensor *t, float s);
lz_status lz_fill(lz_tensor *t, float v);

/* Sum of squares in double, over fixed-size blocks summed in a fixed order:
 * the result does not depend on the number of threads. f32, bf16, f16. */
lz_status lz_sq_norm(const lz_tensor *t, double *out);
/* y += x (write: y = x), then *out = the squared norm of y: the bits of
 * lz_axpy(y, 1, x) (or a copy) and lz_sq_norm(y), in one pass over y. The
 * last micro-step's add into the gradients the optimizer reads gives the
 * gradient norm's partial without a pass of its own. y, x: f32, one count. */
lz_status lz_add_sq_norm(lz_tensor *y, const lz_tensor *x, int write, double *out);
/* lz_sq_norm(t), f32, where blocks[k] (one per 4,096-element block of t),
 * unless NaN, is taken as block k's sum of squares instead of reading the
 * block; every entry is set back to NaN. The bits of lz_sq_norm(t) when each
 * entry given is its block's sum (as lz_moe_gemm_part_backward_norm writes
 * them); a NaN entry costs the block's read. (On a cuda device every
 * block is read, in its own sq_norm's order, and the entries set to NaN.) */
lz_status lz_sq_norm_blocks(const lz_tensor *t, double *blocks, double *out);
/* Elements per block of lz_sq_norm_blocks' partials (4,096). */
int64_t lz_sq_norm_block_size(void);
/* 1 if any element is NaN or Inf. */
lz_status lz_has_inf_nan(const lz_tensor *t, int *out);

typedef struct lz_adamw_args {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay; /* decoupled: param -= lr * wd * param */
  float grad_scale;   /* grads are multiplied by this first (clipping, 1/loss scale) */
  int64_t step;       /* 1-based, for bias correction */
} lz_adamw_args;

/* One fused AdamW step over fp32 master `param` with fp32 `grad`, moments m, v
 * (f32, or both bf16: updated in fp32 and rounded to nearest even).
 * `working` (may be NULL) receives the updated parameters in its dtype
 * (f32, bf16 or f16). All tensors the same element count. */
lz_status lz_adamw_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *v,
                        lz_tensor *working, const lz_adamw_args *args);

/* One fused step of bitsandbytes' 8-bit AdamW (AdamW8bit; docs/optimizers.md)
 * over fp32 master `param` with fp32 `grad`. m, v u8: indices into the signed
 * and the unsigned dynamic map, times absmax_m, absmax_v (f32, one per
 * LZ_ADAMW8BIT_BLOCK elements: lz_adamw8bit_blocks(n)); zeros are a fresh
 * state. m, v f32 (absmax_* may be NULL): bitsandbytes' fp32 update, what it
 * keeps for tensors under min_8bit_size. args as lz_adamw_step's, weight
 * decay decoupled. `working` (may be NULL) receives the updated parameters. */
lz_status lz_adamw8bit_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *v,
                            lz_tensor *absmax_m, lz_tensor *absmax_v, lz_tensor *working,
                            const lz_adamw_args *args);
/* lz_adamw8bit_step over a bf16 master: each element widened to fp32,
 * updated, and rounded back as lz_bf16_round_stochastic(param, updated,
 * seed, args->step, index) rounds it, in one pass; `working` (bf16, may be
 * NULL) receives the rounded master. */
lz_status lz_adamw8bit_step_bf16(lz_tensor *param, const lz_tensor *grad, lz_tensor *m,
                                 lz_tensor *v, lz_tensor *absmax_m, lz_tensor *absmax_v,
                                 lz_tensor *working, const lz_adamw_args *args, uint64_t seed,
                                 int64_t index);
/* Absmax entries for n elements: ceil(n / LZ_ADAMW8BIT_BLOCK). */
int64_t lz_adamw8bit_blocks(int64_t n);
/* The 256 fp32 entries of the signed (m) or unsigned (v) map. */
const float *lz_adamw8bit_map(int is_signed);
/* The cells that give bitsandbytes' index of z = x / absmax for that map
 * (core/optim/quant8.c's index_of): bounds[0] and [1] the fp32 bits of
 * 2^-26 and 1, between which |z|'s bits are clamped, bounds[2] the cells
 * per sign; cell ((|z| bits - bounds[0]) >> 16) + sign * bounds[2] holds in
 * bits 16-23 the index below its step, in 24-31 the one at and above it,
 * in 0-15 where the step is (the low 16 bits of |z|); NaN gets index 0.
 * 2 * bounds[2] entries. */
const uint32_t *lz_adamw8bit_cells(int is_signed, uint32_t bounds[3]);
/* The values an 8-bit state stands for: out[i] = map[q[i]] * absmax[i / 256]
 * (f32; the signed map for m, the unsigned one for v), in host memory. */
lz_status lz_adamw8bit_dequantize(const lz_tensor *q, const lz_tensor *absmax, int is_signed,
                                  lz_tensor *out);
/* Its inverse: q and absmax (one per 256 elements) that dequantise to x bit
 * for bit where x came from lz_adamw8bit_dequantize; other values quantised
 * as the 8-bit update quantises its states. Host memory. */
lz_status lz_adamw8bit_requantize(const lz_tensor *x, int is_signed, lz_tensor *q,
                                  lz_tensor *absmax);

/* dst (bf16) = src (f32) rounded stochastically: up or down with
 * probabilities that make the expected result src itself (torchao's
 * bf16_stochastic_round). The random bits of src[i] are a hash of (seed,
 * step, index + i): index is the global index of src[0], so any split of the
 * same elements draws the same bits. NaN stays NaN, infinities stay. */
lz_status lz_bf16_round_stochastic(lz_tensor *dst, const lz_tensor *src, uint64_t seed,
                                   uint64_t step, int64_t index);

typedef struct lz_lion_args {
  float lr;
  float beta1;        /* the sign's interpolation: c = b1 m + (1 - b1) g */
  float beta2;        /* the momentum's decay: m = b2 m + (1 - b2) g */
  float weight_decay; /* decoupled: param -= lr * wd * param */
  float grad_scale;   /* grads are multiplied by this first (clipping, 1/loss scale) */
} lz_lion_args;

/* One fused Lion step over fp32 master `param` with fp32 `grad` and momentum
 * m: param = param (1 - lr wd) - lr sign(b1 m + (1 - b1) g), then
 * m = b2 m + (1 - b2) g. `working` (may be NULL) receives the updated
 * parameters in its dtype (f32, bf16 or f16). All tensors the same element
 * count. */
lz_status lz_lion_step(lz_tensor *param, const lz_tensor *grad, lz_tensor *m, lz_tensor *working,
                       const lz_lion_args *args);

/* xxh64 of a byte range. */
uint64_t lz_hash_xxh64(const void *data, size_t bytes, uint64_t seed);
/* Streaming xxh64: the digest of the concatenated updates equals the one-shot
 * hash of the same bytes. */
typedef struct lz_hasher lz_hasher;
lz_status lz_hasher_new(lz_hasher **out, uint64_t seed);
lz_status lz_hasher_update(lz_hasher *h, const void *data, size_t bytes);
uint64_t lz_hasher_digest(const lz_hasher *h);
lz_status lz_hasher_free(lz_hasher *h); /* NULL is fine */

/* LZ_CDEF_END */

#endif /* LUAZERO_KERNELS_H */
