// attention.cu — causal multi-head self-attention on the device, forward and
// backward, tiled so no T x T matrix is stored (flash-attention's shape,
// written plainly: correctness first).
//
// qkv [B, T, 3C]: q, k, v side by side, head h in columns h*HS .. h*HS+HS-1
// of each; out [B, T, C]; lse [B, NH, T] the natural-log log-sum-exp of each
// query's scaled scores, saved for backward — as core/attention.c.
//
// Forward: one thread per query, key tiles staged in shared memory, an
// online softmax per tile. Backward in two passes with no atomics (so every
// run gives the same bits): one thread per query accumulates dQ (and saves
// D = dout . out), then one thread per key walks the queries after it and
// accumulates dK and dV. Head sizes are compiled for up to 64, 128 and 256
// (MAX_HS of the cpu kernel), so the per-thread rows stay in registers.
#include "lz_cuda.h"

#include <float.h>  // FLT_MAX

#define QPB 64    // queries (or keys) per block: one per thread
#define KTILE 16  // rows staged in shared memory at a time

template <int HSM>
__global__ void attention_forward_kernel(float *out, float *lse, const float *qkv, int64_t T,
                                         int64_t C, int NH, int HS, float scale) {
  __shared__ float ks[KTILE][HSM], vs[KTILE][HSM];
  const int h = blockIdx.y;
  const int64_t b = blockIdx.z, C3 = 3 * C;
  const int64_t qi = (int64_t)blockIdx.x * QPB + threadIdx.x;
  const bool valid = qi < T;
  const float *base = qkv + b * T * C3;
  float q[HSM], acc[HSM];
#pragma unroll
  for (int d = 0; d < HSM; d++) {
    q[d] = (valid && d < HS) ? base[qi * C3 + h * HS + d] * scale : 0.0f;
    acc[d] = 0.0f;
  }
  float m = -FLT_MAX, l = 0.0f;
  int64_t kend = ((int64_t)blockIdx.x + 1) * QPB;
  if (kend > T) kend = T;
  for (int64_t k0 = 0; k0 < kend; k0 += KTILE) {
    __syncthreads();
    for (int e = threadIdx.x; e < KTILE * HS; e += QPB) {
      int r = e / HS, d = e % HS;
      int64_t kj = k0 + r;
      ks[r][d] = kj < T ? base[kj * C3 + C + h * HS + d] : 0.0f;
      vs[r][d] = kj < T ? base[kj * C3 + 2 * C + h * HS + d] : 0.0f;
    }
    __syncthreads();
    if (!valid || k0 > qi) continue;
    float s[KTILE];
    float tmax = -FLT_MAX;
#pragma unroll
    for (int r = 0; r < KTILE; r++) {
      float dot = 0.0f;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        if (d < HS) dot += q[d] * ks[r][d];
      s[r] = (k0 + r <= qi) ? dot : -FLT_MAX;
      tmax = fmaxf(tmax, s[r]);
    }
    const float m_new = fmaxf(m, tmax), corr = expf(m - m_new);
    l *= corr;
#pragma unroll
    for (int d = 0; d < HSM; d++) acc[d] *= corr;
#pragma unroll
    for (int r = 0; r < KTILE; r++) {
      if (k0 + r > qi) break;
      float p = expf(s[r] - m_new);
      l += p;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        if (d < HS) acc[d] += p * vs[r][d];
    }
    m = m_new;
  }
  if (!valid) return;
  const float inv = 1.0f / l;
  float *o = out + (b * T + qi) * C + h * HS;
#pragma unroll
  for (int d = 0; d < HSM; d++)
    if (d < HS) o[d] = acc[d] * inv;
  lse[(b * NH + h) * T + qi] = m + logf(l);
}

// dQ and D (= dout . out per query, into dsum [B, NH, T]).
template <int HSM>
__global__ void attention_dq_kernel(float *dqkv, float *dsum, const float *dout, const float *qkv,
                                    const float *out, const float *lse, int64_t T, int64_t C,
                                    int NH, int HS, float scale) {
  __shared__ float ks[KTILE][HSM], vs[KTILE][HSM];
  const int h = blockIdx.y;
  const int64_t b = blockIdx.z, C3 = 3 * C;
  const int64_t qi = (int64_t)blockIdx.x * QPB + threadIdx.x;
  const bool valid = qi < T;
  const float *base = qkv + b * T * C3;
  float q[HSM], g[HSM], dq[HSM];
  float D = 0.0f;
#pragma unroll
  for (int d = 0; d < HSM; d++) {
    bool in = valid && d < HS;
    q[d] = in ? base[qi * C3 + h * HS + d] : 0.0f;
    g[d] = in ? dout[(b * T + qi) * C + h * HS + d] : 0.0f;
    D += in ? g[d] * out[(b * T + qi) * C + h * HS + d] : 0.0f;
    dq[d] = 0.0f;
  }
  const float L = valid ? lse[(b * NH + h) * T + qi] : 0.0f;
  int64_t kend = ((int64_t)blockIdx.x + 1) * QPB;
  if (kend > T) kend = T;
  for (int64_t k0 = 0; k0 < kend; k0 += KTILE) {
    __syncthreads();
    for (int e = threadIdx.x; e < KTILE * HS; e += QPB) {
      int r = e / HS, d = e % HS;
      int64_t kj = k0 + r;
      ks[r][d] = kj < T ? base[kj * C3 + C + h * HS + d] : 0.0f;
      vs[r][d] = kj < T ? base[kj * C3 + 2 * C + h * HS + d] : 0.0f;
    }
    __syncthreads();
    if (!valid || k0 > qi) continue;
    for (int r = 0; r < KTILE; r++) {
      if (k0 + r > qi) break;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        if (d < HS) {
          s += q[d] * ks[r][d];
          dp += g[d] * vs[r][d];
        }
      const float p = expf(s * scale - L), ds = p * (dp - D) * scale;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        if (d < HS) dq[d] += ds * ks[r][d];
    }
  }
  if (!valid) return;
  float *o = dqkv + (b * T + qi) * C3 + h * HS;
#pragma unroll
  for (int d = 0; d < HSM; d++)
    if (d < HS) o[d] = dq[d];
  dsum[(b * NH + h) * T + qi] = D;
}

// dK and dV: one thread per key, over the queries at or after it.
template <int HSM>
__global__ void attention_dkv_kernel(float *dqkv, const float *dsum, const float *dout,
                                     const float *qkv, const float *lse, int64_t T, int64_t C,
                                     int NH, int HS, float scale) {
  __shared__ float qs[KTILE][HSM], gs[KTILE][HSM];
  __shared__ float ls[KTILE], ds_[KTILE];
  const int h = blockIdx.y;
  const int64_t b = blockIdx.z, C3 = 3 * C;
  const int64_t kj = (int64_t)blockIdx.x * QPB + threadIdx.x;
  const bool valid = kj < T;
  const float *base = qkv + b * T * C3;
  float k[HSM], v[HSM], dk[HSM], dv[HSM];
#pragma unroll
  for (int d = 0; d < HSM; d++) {
    bool in = valid && d < HS;
    k[d] = in ? base[kj * C3 + C + h * HS + d] : 0.0f;
    v[d] = in ? base[kj * C3 + 2 * C + h * HS + d] : 0.0f;
    dk[d] = dv[d] = 0.0f;
  }
  for (int64_t q0 = (int64_t)blockIdx.x * QPB; q0 < T; q0 += KTILE) {
    __syncthreads();
    for (int e = threadIdx.x; e < KTILE * HS; e += QPB) {
      int r = e / HS, d = e % HS;
      int64_t qi = q0 + r;
      qs[r][d] = qi < T ? base[qi * C3 + h * HS + d] : 0.0f;
      gs[r][d] = qi < T ? dout[(b * T + qi) * C + h * HS + d] : 0.0f;
    }
    if (threadIdx.x < KTILE) {
      int64_t qi = q0 + threadIdx.x;
      ls[threadIdx.x] = qi < T ? lse[(b * NH + h) * T + qi] : 0.0f;
      ds_[threadIdx.x] = qi < T ? dsum[(b * NH + h) * T + qi] : 0.0f;
    }
    __syncthreads();
    if (!valid) continue;
    for (int r = 0; r < KTILE; r++) {
      int64_t qi = q0 + r;
      if (qi < kj || qi >= T) continue;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        if (d < HS) {
          s += qs[r][d] * k[d];
          dp += gs[r][d] * v[d];
        }
      const float p = expf(s * scale - ls[r]), ds = p * (dp - ds_[r]) * scale;
#pragma unroll
      for (int d = 0; d < HSM; d++)
        if (d < HS) {
          dv[d] += p * gs[r][d];
          dk[d] += ds * qs[r][d];
        }
    }
  }
  if (!valid) return;
  float *ok = dqkv + (b * T + kj) * C3 + C + h * HS, *ov = ok + C;
#pragma unroll
  for (int d = 0; d < HSM; d++)
    if (d < HS) {
      ok[d] = dk[d];
      ov[d] = dv[d];
    }
}

struct attn_dims {
  int64_t B, T, C;
  int NH, HS;
  float scale;
};

static attn_dims dims_of(const lz_tensor *qkv, int n_head) {
  attn_dims d;
  d.B = qkv->shape[0];
  d.T = qkv->shape[1];
  d.C = qkv->shape[2] / 3;
  d.NH = n_head;
  d.HS = (int)(d.C / n_head);
  d.scale = 1.0f / sqrtf((float)d.HS);
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
  attn_dims d = dims_of(qkv, (int)a->i[0]);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;
  dim3 grid((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NH, (unsigned)d.B);
  LAUNCH_BY_HS(attention_forward_kernel, grid, (float *)a->t[0]->data, (float *)a->t[1]->data,
               (const float *)qkv->data, d.T, d.C, d.NH, d.HS, d.scale);
  return LZ_OK;
}

lz_status lz_cu_attention_backward(const lz_op_args *a) {
  lz_tensor *dqkv = a->t[0];
  const lz_tensor *dout = a->t[1], *qkv = a->t[2], *out = a->t[3], *lse = a->t[4];
  attn_dims d = dims_of(qkv, (int)a->i[0]);
  if (d.B == 0 || d.T == 0 || d.C == 0) return LZ_OK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, (size_t)(d.B * d.NH * d.T) * sizeof(float)));
  dim3 grid((unsigned)((d.T + QPB - 1) / QPB), (unsigned)d.NH, (unsigned)d.B);
  LAUNCH_BY_HS(attention_dq_kernel, grid, (float *)dqkv->data, (float *)ws,
               (const float *)dout->data, (const float *)qkv->data, (const float *)out->data,
               (const float *)lse->data, d.T, d.C, d.NH, d.HS, d.scale);
  LAUNCH_BY_HS(attention_dkv_kernel, grid, (float *)dqkv->data, (const float *)ws,
               (const float *)dout->data, (const float *)qkv->data, (const float *)lse->data,
               d.T, d.C, d.NH, d.HS, d.scale);
  return LZ_OK;
}
