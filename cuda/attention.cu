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
// (MAX_HS of the cpu kernel), so the per-thread rows stay in registers.
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
#include "lz_cuda.h"

#include <float.h>  // FLT_MAX

#define QPB 64    // queries (or keys) per block: one per thread
#define KTILE 16  // rows staged in shared memory at a time

// The shape of one call. Offsets are in floats within a qkv row.
struct attn_dims {
  int64_t B, T, C;  // C = NH * HS: the width of out and of q
  int64_t row;      // floats per qkv row: (NH + 2 NKV) * HS
  int NH, NKV, HS;
  int64_t W;  // window; 0 = none
  float scale;
  float cap;  // soft-capping; 0 = none
};

// Whether query qi sees key kj by the causal mask and the window.
__device__ __forceinline__ bool in_window(const attn_dims &d, int64_t qi, int64_t kj) {
  return kj <= qi && (!d.W || qi - kj < d.W);
}

// The first key a block of queries from q0 on reaches, down to a whole tile.
__device__ __forceinline__ int64_t first_key(const attn_dims &d, int64_t q0) {
  const int64_t k = d.W && q0 - d.W + 1 > 0 ? q0 - d.W + 1 : 0;
  return k / KTILE * KTILE;
}

// Columns of key/value head g within a qkv row.
__device__ __forceinline__ int64_t k_col(const attn_dims &d, int g) {
  return d.C + (int64_t)g * d.HS;
}
__device__ __forceinline__ int64_t v_col(const attn_dims &d, int g) {
  return d.C + (int64_t)(d.NKV + g) * d.HS;
}

// Keys and values k0 .. k0 + KTILE - 1 of one key/value head into shared
// memory (zeros past T), by the block's QPB threads, between two barriers:
// the tile before is no longer read, this one is whole when it returns.
template <int HSM>
__device__ __forceinline__ void load_kv_tile(float (*ks)[HSM], float (*vs)[HSM],
                                             const float *base, int64_t k0, int64_t T,
                                             int64_t row, int64_t kc, int64_t vc, int HS) {
  __syncthreads();
  for (int e = threadIdx.x; e < KTILE * HS; e += QPB) {
    int r = e / HS, dd = e % HS;
    int64_t kj = k0 + r;
    ks[r][dd] = kj < T ? base[kj * row + kc + dd] : 0.0f;
    vs[r][dd] = kj < T ? base[kj * row + vc + dd] : 0.0f;
  }
  __syncthreads();
}

template <int HSM>
__global__ void attention_forward_kernel(float *out, float *lse, const float *qkv,
                                         const int32_t *seg, attn_dims d) {
  __shared__ float ks[KTILE][HSM], vs[KTILE][HSM];
  const int h = blockIdx.y, g = h / (d.NH / d.NKV), HS = d.HS;
  const int64_t b = blockIdx.z, T = d.T, row = d.row, kc = k_col(d, g), vc = v_col(d, g);
  const int64_t qi = (int64_t)blockIdx.x * QPB + threadIdx.x;
  const bool valid = qi < T;
  const float *base = qkv + b * T * row;
  float q[HSM], acc[HSM];
#pragma unroll
  for (int dd = 0; dd < HSM; dd++) {
    q[dd] = (valid && dd < HS) ? base[qi * row + h * HS + dd] * d.scale : 0.0f;
    acc[dd] = 0.0f;
  }
  const int32_t *sg = seg ? seg + b * T : NULL;
  const int32_t mine = sg && valid ? sg[qi] : 0;
  float m = -FLT_MAX, l = 0.0f;
  int64_t kend = ((int64_t)blockIdx.x + 1) * QPB;
  if (kend > T) kend = T;
  for (int64_t k0 = first_key(d, (int64_t)blockIdx.x * QPB); k0 < kend; k0 += KTILE) {
    load_kv_tile<HSM>(ks, vs, base, k0, T, row, kc, vc, HS);
    if (!valid || k0 > qi) continue;
    float s[KTILE];
    float tmax = -FLT_MAX;
#pragma unroll
    for (int r = 0; r < KTILE; r++) {
      float dot = 0.0f;
#pragma unroll
      for (int dd = 0; dd < HSM; dd++)
        if (dd < HS) dot += q[dd] * ks[r][dd];
      if (d.cap) dot = d.cap * tanhf(dot / d.cap);
      s[r] = (in_window(d, qi, k0 + r) && (!sg || sg[k0 + r] == mine)) ? dot : -FLT_MAX;
      tmax = fmaxf(tmax, s[r]);
    }
    const float m_new = fmaxf(m, tmax), corr = expf(m - m_new);
    l *= corr;
#pragma unroll
    for (int dd = 0; dd < HSM; dd++) acc[dd] *= corr;
#pragma unroll
    for (int r = 0; r < KTILE; r++) {
      if (k0 + r > qi) break;
      if (!in_window(d, qi, k0 + r)) continue;
      if (sg && sg[k0 + r] != mine) continue;
      float p = expf(s[r] - m_new);
      l += p;
#pragma unroll
      for (int dd = 0; dd < HSM; dd++)
        if (dd < HS) acc[dd] += p * vs[r][dd];
    }
    m = m_new;
  }
  if (!valid) return;
  const float inv = 1.0f / l;
  float *o = out + (b * T + qi) * d.C + h * HS;
#pragma unroll
  for (int dd = 0; dd < HSM; dd++)
    if (dd < HS) o[dd] = acc[dd] * inv;
  lse[(b * d.NH + h) * T + qi] = m + logf(l);
}

// dQ and D (= dout . out per query, into dsum [B, NH, T]).
template <int HSM>
__global__ void attention_dq_kernel(float *dqkv, float *dsum, const float *dout, const float *qkv,
                                    const float *out, const float *lse, const int32_t *seg,
                                    attn_dims d) {
  __shared__ float ks[KTILE][HSM], vs[KTILE][HSM];
  const int h = blockIdx.y, g = h / (d.NH / d.NKV), HS = d.HS;
  const int64_t b = blockIdx.z, T = d.T, C = d.C, row = d.row, kc = k_col(d, g), vc = v_col(d, g);
  const int64_t qi = (int64_t)blockIdx.x * QPB + threadIdx.x;
  const bool valid = qi < T;
  const float *base = qkv + b * T * row;
  float q[HSM], gr[HSM], dq[HSM];
  float D = 0.0f;
#pragma unroll
  for (int dd = 0; dd < HSM; dd++) {
    bool in = valid && dd < HS;
    q[dd] = in ? base[qi * row + h * HS + dd] : 0.0f;
    gr[dd] = in ? dout[(b * T + qi) * C + h * HS + dd] : 0.0f;
    D += in ? gr[dd] * out[(b * T + qi) * C + h * HS + dd] : 0.0f;
    dq[dd] = 0.0f;
  }
  const float L = valid ? lse[(b * d.NH + h) * T + qi] : 0.0f;
  const int32_t *sg = seg ? seg + b * T : NULL;
  const int32_t mine = sg && valid ? sg[qi] : 0;
  int64_t kend = ((int64_t)blockIdx.x + 1) * QPB;
  if (kend > T) kend = T;
  for (int64_t k0 = first_key(d, (int64_t)blockIdx.x * QPB); k0 < kend; k0 += KTILE) {
    load_kv_tile<HSM>(ks, vs, base, k0, T, row, kc, vc, HS);
    if (!valid || k0 > qi) continue;
    for (int r = 0; r < KTILE; r++) {
      if (k0 + r > qi) break;
      if (!in_window(d, qi, k0 + r)) continue;
      if (sg && sg[k0 + r] != mine) continue;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int dd = 0; dd < HSM; dd++)
        if (dd < HS) {
          s += q[dd] * ks[r][dd];
          dp += gr[dd] * vs[r][dd];
        }
      float p, ds;
      if (d.cap) {
        const float t = tanhf(s * d.scale / d.cap);
        p = expf(d.cap * t - L);
        ds = p * (dp - D) * (1.0f - t * t) * d.scale;
      } else {
        p = expf(s * d.scale - L);
        ds = p * (dp - D) * d.scale;
      }
#pragma unroll
      for (int dd = 0; dd < HSM; dd++)
        if (dd < HS) dq[dd] += ds * ks[r][dd];
    }
  }
  if (!valid) return;
  float *o = dqkv + (b * T + qi) * row + h * HS;
#pragma unroll
  for (int dd = 0; dd < HSM; dd++)
    if (dd < HS) o[dd] = dq[dd];
  dsum[(b * d.NH + h) * T + qi] = D;
}

// dK and dV of key/value head g (blockIdx.y): one thread per key, over the
// query heads of the group in head order and, in each, the queries at or
// after the key.
template <int HSM>
__global__ void attention_dkv_kernel(float *dqkv, const float *dsum, const float *dout,
                                     const float *qkv, const float *lse, const int32_t *seg,
                                     attn_dims d) {
  __shared__ float qs[KTILE][HSM], gs[KTILE][HSM];
  __shared__ float ls[KTILE], ds_[KTILE];
  const int g = blockIdx.y, group = d.NH / d.NKV, HS = d.HS;
  const int64_t b = blockIdx.z, T = d.T, C = d.C, row = d.row, kc = k_col(d, g), vc = v_col(d, g);
  const int64_t kj = (int64_t)blockIdx.x * QPB + threadIdx.x;
  const bool valid = kj < T;
  const float *base = qkv + b * T * row;
  const int32_t *sg = seg ? seg + b * T : NULL;
  const int32_t mine = sg && valid ? sg[kj] : 0;
  float k[HSM], v[HSM], dk[HSM], dv[HSM];
#pragma unroll
  for (int dd = 0; dd < HSM; dd++) {
    bool in = valid && dd < HS;
    k[dd] = in ? base[kj * row + kc + dd] : 0.0f;
    v[dd] = in ? base[kj * row + vc + dd] : 0.0f;
    dk[dd] = dv[dd] = 0.0f;
  }
  for (int h = g * group; h < (g + 1) * group; h++) {
    const float *lse_bh = lse + (b * d.NH + h) * T, *dsum_bh = dsum + (b * d.NH + h) * T;
    // With a window, the block's last key is seen by queries up to W - 1 after it.
    const int64_t last = ((int64_t)blockIdx.x + 1) * QPB - 1 + d.W;
    const int64_t qend = d.W && last < T ? last : T;
    for (int64_t q0 = (int64_t)blockIdx.x * QPB; q0 < qend; q0 += KTILE) {
      __syncthreads();
      for (int e = threadIdx.x; e < KTILE * HS; e += QPB) {
        int r = e / HS, dd = e % HS;
        int64_t qi = q0 + r;
        qs[r][dd] = qi < T ? base[qi * row + h * HS + dd] : 0.0f;
        gs[r][dd] = qi < T ? dout[(b * T + qi) * C + h * HS + dd] : 0.0f;
      }
      if (threadIdx.x < KTILE) {
        int64_t qi = q0 + threadIdx.x;
        ls[threadIdx.x] = qi < T ? lse_bh[qi] : 0.0f;
        ds_[threadIdx.x] = qi < T ? dsum_bh[qi] : 0.0f;
      }
      __syncthreads();
      if (!valid) continue;
      for (int r = 0; r < KTILE; r++) {
        int64_t qi = q0 + r;
        if (qi < kj || qi >= T || !in_window(d, qi, kj)) continue;
        if (sg && sg[qi] != mine) continue;
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int dd = 0; dd < HSM; dd++)
          if (dd < HS) {
            s += qs[r][dd] * k[dd];
            dp += gs[r][dd] * v[dd];
          }
        float p, ds;
        if (d.cap) {
          const float t = tanhf(s * d.scale / d.cap);
          p = expf(d.cap * t - ls[r]);
          ds = p * (dp - ds_[r]) * (1.0f - t * t) * d.scale;
        } else {
          p = expf(s * d.scale - ls[r]);
          ds = p * (dp - ds_[r]) * d.scale;
        }
#pragma unroll
        for (int dd = 0; dd < HSM; dd++)
          if (dd < HS) {
            dv[dd] += p * gs[r][dd];
            dk[dd] += ds * qs[r][dd];
          }
      }
    }
  }
  if (!valid) return;
  float *ok = dqkv + (b * T + kj) * row + kc, *ov = dqkv + (b * T + kj) * row + vc;
#pragma unroll
  for (int dd = 0; dd < HSM; dd++)
    if (dd < HS) {
      ok[dd] = dk[dd];
      ov[dd] = dv[dd];
    }
}

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

#define LAUNCH_BY_HS(kernel, grid, ...)                                          \
  do {                                                                           \
    if (d.HS <= 64) kernel<64><<<grid, QPB, 0, LZ_CU_COMPUTE>>>(__VA_ARGS__);    \
    else if (d.HS <= 128) kernel<128><<<grid, QPB, 0, LZ_CU_COMPUTE>>>(__VA_ARGS__); \
    else kernel<256><<<grid, QPB, 0, LZ_CU_COMPUTE>>>(__VA_ARGS__);              \
    CUDA_LAUNCH_CHECK();                                                         \
  } while (0)

lz_status lz_cu_attention_forward(const lz_op_args *a) {
  const lz_tensor *qkv = a->t[2];
  attn_dims d = dims_of(qkv, a);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;
  dim3 grid((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NH, (unsigned)d.B);
  LAUNCH_BY_HS(attention_forward_kernel, grid, (float *)a->t[0]->data, (float *)a->t[1]->data,
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
  LAUNCH_BY_HS(attention_dq_kernel, grid_q, (float *)dqkv->data, (float *)ws,
               (const float *)dout->data, (const float *)qkv->data, (const float *)out->data,
               (const float *)lse->data, seg, d);
  dim3 grid_kv((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NKV, (unsigned)d.B);
  LAUNCH_BY_HS(attention_dkv_kernel, grid_kv, (float *)dqkv->data, (const float *)ws,
               (const float *)dout->data, (const float *)qkv->data, (const float *)lse->data, seg,
               d);
  return LZ_OK;
}
