// attention_kernels.cuh — the attention kernels (attention.cu's header
// comment describes them), included once by each attention_hsN.cu, which
// instantiates them for one head-size bound with LZ_ATTN_DEFINE(N).
#ifndef LZ_ATTENTION_KERNELS_CUH
#define LZ_ATTENTION_KERNELS_CUH

#include "attention.cuh"

// Whether query qi sees key kj by the causal mask and the window.
static __device__ __forceinline__ bool in_window(const attn_dims &d, int64_t qi, int64_t kj) {
  return kj <= qi && (!d.W || qi - kj < d.W);
}

// The first key a block of queries from q0 on reaches, down to a whole tile.
static __device__ __forceinline__ int64_t first_key(const attn_dims &d, int64_t q0) {
  const int64_t k = d.W && q0 - d.W + 1 > 0 ? q0 - d.W + 1 : 0;
  return k / KTILE * KTILE;
}

// Columns of key/value head g within a qkv row.
static __device__ __forceinline__ int64_t k_col(const attn_dims &d, int g) {
  return d.C + (int64_t)g * d.HS;
}
static __device__ __forceinline__ int64_t v_col(const attn_dims &d, int g) {
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

#define LZ_ATTN_DEFINE(HSM)                                                                 \
  lz_status lz_cu_attn_forward_##HSM(dim3 grid, float *out, float *lse, const float *qkv,   \
                                     const int32_t *seg, attn_dims d) {                     \
    attention_forward_kernel<HSM><<<grid, QPB, 0, LZ_CU_COMPUTE>>>(out, lse, qkv, seg, d);  \
    CUDA_LAUNCH_CHECK();                                                                    \
    return LZ_OK;                                                                           \
  }                                                                                         \
  lz_status lz_cu_attn_dq_##HSM(dim3 grid, float *dqkv, float *dsum, const float *dout,     \
                                const float *qkv, const float *out, const float *lse,       \
                                const int32_t *seg, attn_dims d) {                          \
    attention_dq_kernel<HSM><<<grid, QPB, 0, LZ_CU_COMPUTE>>>(dqkv, dsum, dout, qkv, out,   \
                                                              lse, seg, d);                 \
    CUDA_LAUNCH_CHECK();                                                                    \
    return LZ_OK;                                                                           \
  }                                                                                         \
  lz_status lz_cu_attn_dkv_##HSM(dim3 grid, float *dqkv, const float *dsum,                 \
                                 const float *dout, const float *qkv, const float *lse,     \
                                 const int32_t *seg, attn_dims d) {                         \
    attention_dkv_kernel<HSM><<<grid, QPB, 0, LZ_CU_COMPUTE>>>(dqkv, dsum, dout, qkv, lse,  \
                                                               seg, d);                     \
    CUDA_LAUNCH_CHECK();                                                                    \
    return LZ_OK;                                                                           \
  }

#endif
