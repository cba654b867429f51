// attention.cu — causal self-attention on the device, multi-head (GPT-2)
// and grouped-query (Llama: n_kv_head key/value heads, each shared by
// n_head/n_kv_head query heads), forward and backward, tiled so no T x T
// matrix is stored (flash-attention's shape, written plainly: correctness
// first).
//
// qkv [B, T, (NH + 2 NKV) HS]: q of NH heads, then k and v of NKV heads
// each; query head h reads key/value head h / (NH / NKV). Multi-head is
// NKV = NH (rows of 3C). out [B, T, C], C = NH HS; lse [B, NH, T] the
// natural-log log-sum-exp of each query's scaled scores, saved for backward
// — as core/kernels/attention.c.
//
// Forward: one thread per query, key tiles staged in shared memory, an
// online softmax per tile. Backward in two passes with no atomics (so every
// run gives the same bits): one thread per query accumulates dQ (and saves
// D = dout . out), then one thread per key of a key/value head walks the
// query heads of its group in head order, and in each the queries after it,
// accumulating dK and dV. Head sizes are compiled for up to 64, 128 and 256
// (MAX_HS of the cpu kernel), so the per-thread rows stay in registers; the
// kernels are in attention_kernels.cuh, each bound in attention_hsN.cu.
//
// seg (NULL: none), i32 [B, T]: a document id per token; a query sees a key
// only when both are in one document (lz_attention_seg_*). Keys of another
// document are skipped outright, so a query whose tile holds none of its
// own keys adds nothing.
//
// Options (lz_attention_opts_*, each 0 for off): a window W (a query sees
// its W latest keys; tiles before them are not loaded), soft-capping of the
// scaled scores (s -> cap tanh(s / cap), with the factor 1 - tanh^2 in
// backward) and the scores' scale.
#include "attention.cuh"

// i[0] n_head, i[1] n_kv_head (0: n_head), i[2] window; f[0] softcap, f[1]
// scale (0: 1/sqrt(HS)), as the core checked them.
static attn_dims dims_of(const lz_tensor *qkv, const lz_op_args *a) {
  attn_dims d;
  d.NH = (int)a->i[0];
  d.NKV = a->i[1] == 0 ? d.NH : (int)a->i[1];
  d.B = qkv->shape[0];
  d.T = qkv->shape[1];
  d.row = qkv->shape[2];
  d.HS = (int)(d.row / (d.NH + 2 * (int64_t)d.NKV));
  d.C = (int64_t)d.HS * d.NH;
  d.scale = a->f[1] ? a->f[1] : d.HS ? 1.0f / sqrtf((float)d.HS) : 0.0f;
  d.W = a->i[2];
  d.cap = a->f[0];
  return d;
}

// The launch of kernel `name` compiled for the smallest bound that holds HS.
#define LAUNCH_BY_HS(name, ...)                                                 \
  LZ_TRY(d.HS <= 64    ? lz_cu_attn_##name##_64(__VA_ARGS__)                    \
         : d.HS <= 128 ? lz_cu_attn_##name##_128(__VA_ARGS__)                   \
                       : lz_cu_attn_##name##_256(__VA_ARGS__))

lz_status lz_cu_attention_forward(const lz_op_args *a) {
  const lz_tensor *qkv = a->t[2];
  attn_dims d = dims_of(qkv, a);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;
  dim3 grid((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NH, (unsigned)d.B);
  LAUNCH_BY_HS(forward, grid, (float *)a->t[0]->data, (float *)a->t[1]->data,
               (const float *)qkv->data, a->t[3] ? (const int32_t *)a->t[3]->data : NULL, d);
  return LZ_OK;
}

lz_status lz_cu_attention_backward(const lz_op_args *a) {
  lz_tensor *dqkv = a->t[0];
  const lz_tensor *dout = a->t[1], *qkv = a->t[2], *out = a->t[3], *lse = a->t[4];
  const int32_t *seg = a->t[5] ? (const int32_t *)a->t[5]->data : NULL;
  attn_dims d = dims_of(qkv, a);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, (size_t)(d.B * d.NH * d.T) * sizeof(float)));
  dim3 grid_q((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NH, (unsigned)d.B);
  LAUNCH_BY_HS(dq, grid_q, (float *)dqkv->data, (float *)ws,
               (const float *)dout->data, (const float *)qkv->data, (const float *)out->data,
               (const float *)lse->data, seg, d);
  dim3 grid_kv((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NKV, (unsigned)d.B);
  LAUNCH_BY_HS(dkv, grid_kv, (float *)dqkv->data, (const float *)ws,
               (const float *)dout->data, (const float *)qkv->data, (const float *)lse->data, seg,
               d);
  return LZ_OK;
}
