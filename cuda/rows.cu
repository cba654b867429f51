// rows.cu — the row-wise ops on the device: LayerNorm, RMSNorm, QK-norm,
// rotary position embeddings, softmax cross-entropy and the token (+
// position) embedding, forward and backward. Same semantics as
// core/kernels/layernorm.c, core/kernels/rmsnorm.c, core/kernels/qk_norm.c,
// core/kernels/rope.c, core/kernels/cross_entropy.c and
// core/kernels/embedding.c (the core has checked shapes; the ids are checked
// here). Parameter-gradient sums run in a fixed order with no atomics, so
// every run gives the same bits.
#include "lz_cuda.h"

#include <float.h>   // FLT_MAX
#include <stdlib.h>  // malloc: host copies of ids

#define THREADS 256
#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over a block of THREADS threads; every thread gets the result.
__device__ float block_reduce(float v, bool is_max) {
  __shared__ float sh[THREADS / WARP];
  int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
  v = is_max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // sh may still be read from a previous call
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  float r = lane < THREADS / WARP ? sh[lane] : (is_max ? -FLT_MAX : 0.0f);
  return is_max ? warp_max(r) : warp_sum(r);
}

// bf16 inputs are widened exactly, so a bf16 call computes what the f32
// call computes on the widened values (as the cpu kernels do).
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
// An f32 result stored as O: as is, or rounded to nearest even into bf16.
template <typename O> __device__ __forceinline__ O narrow(float v);
template <> __device__ __forceinline__ float narrow<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// --------------------------------------------------------------- LayerNorm

// One warp per row: mean, then variance around it (two passes over the row,
// the second from cache), biased as PyTorch's LayerNorm.
__global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd, const float *x,
                                         const float *w, const float *b, int64_t rows,
                                         int64_t C, float eps) {
  int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  if (row >= rows) return;
  const float *xr = x + row * C;
  float s = 0.0f;
  for (int64_t i = lane; i < C; i += WARP) s += xr[i];
  const float m = warp_sum(s) / (float)C;
  float s2 = 0.0f;
  for (int64_t i = lane; i < C; i += WARP) {
    float d = xr[i] - m;
    s2 += d * d;
  }
  const float r = rsqrtf(warp_sum(s2) / (float)C + eps);
  float *o = out + row * C;
  for (int64_t i = lane; i < C; i += WARP) o[i] = (xr[i] - m) * r * w[i] + b[i];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dw, db partial sums over a fixed range of rows per blockIdx.y, in row order.
#define LN_ROW_CHUNKS 64

__global__ void layernorm_dw_db_kernel(float *partials, const float *dy, const float *x,
                                       const float *mean, const float *rstd, int64_t rows,
                                       int64_t C) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  int64_t per = (rows + LN_ROW_CHUNKS - 1) / LN_ROW_CHUNKS;
  int64_t r0 = blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
  float sw = 0.0f, sb = 0.0f;
  for (int64_t r = r0; r < r1; r++) {
    float g = dy[r * C + c];
    sw += g * (x[r * C + c] - mean[r]) * rstd[r];
    sb += g;
  }
  partials[(2 * (int64_t)blockIdx.y) * C + c] = sw;
  partials[(2 * (int64_t)blockIdx.y + 1) * C + c] = sb;
}

__global__ void layernorm_dw_db_sum_kernel(float *dw, float *db, const float *partials,
                                           int64_t C) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float tw = 0.0f, tb = 0.0f;
  for (int k = 0; k < LN_ROW_CHUNKS; k++) {
    tw += partials[2 * k * C + c];
    tb += partials[(2 * k + 1) * C + c];
  }
  dw[c] += tw;
  db[c] += tb;
}

// dx may be dy: each lane reads dy[i] before it writes dx[i], and the row
// sums are done before any write.
__global__ void layernorm_dx_kernel(float *dx, const float *dy, const float *x, const float *w,
                                    const float *mean, const float *rstd, int64_t rows,
                                    int64_t C) {
  int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  if (row >= rows) return;
  const float *dyr = dy + row * C, *xr = x + row * C;
  const float m = mean[row], s = rstd[row];
  float sg = 0.0f, sgn = 0.0f;
  for (int64_t i = lane; i < C; i += WARP) {
    float g = w[i] * dyr[i];
    sg += g;
    sgn += g * (xr[i] - m) * s;
  }
  const float mean_g = warp_sum(sg) / (float)C, mean_gn = warp_sum(sgn) / (float)C;
  __syncwarp();
  float *dxr = dx + row * C;
  for (int64_t i = lane; i < C; i += WARP) {
    float norm = (xr[i] - m) * s;
    dxr[i] = (w[i] * dyr[i] - mean_g - norm * mean_gn) * s;
  }
}

lz_status lz_cu_layernorm_forward(const lz_op_args *a) {
  const lz_tensor *x = a->t[3];
  int64_t C = lz_cols(x), rows = lz_rows(x);
  if (rows == 0 || C == 0) return LZ_OK;
  const int rows_per_block = THREADS / WARP;
  layernorm_forward_kernel<<<(unsigned)((rows + rows_per_block - 1) / rows_per_block), THREADS,
                             0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (float *)a->t[1]->data, (float *)a->t[2]->data,
      (const float *)x->data, (const float *)a->t[4]->data, (const float *)a->t[5]->data, rows,
      C, a->f[0]);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_layernorm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dw = a->t[1], *db = a->t[2];
  const lz_tensor *dy = a->t[3], *x = a->t[4], *w = a->t[5], *mean = a->t[6], *rstd = a->t[7];
  int64_t C = lz_cols(x), rows = lz_rows(x);
  if (rows == 0 || C == 0) return LZ_OK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, (size_t)2 * LN_ROW_CHUNKS * (size_t)C * sizeof(float)));
  // dw, db first: dx may share memory with dy.
  dim3 grid((unsigned)((C + THREADS - 1) / THREADS), LN_ROW_CHUNKS);
  layernorm_dw_db_kernel<<<grid, THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)ws, (const float *)dy->data, (const float *)x->data, (const float *)mean->data,
      (const float *)rstd->data, rows, C);
  CUDA_LAUNCH_CHECK();
  layernorm_dw_db_sum_kernel<<<(unsigned)((C + THREADS - 1) / THREADS), THREADS, 0,
                               LZ_CU_COMPUTE>>>((float *)dw->data, (float *)db->data,
                                                (const float *)ws, C);
  CUDA_LAUNCH_CHECK();
  const int rows_per_block = THREADS / WARP;
  layernorm_dx_kernel<<<(unsigned)((rows + rows_per_block - 1) / rows_per_block), THREADS, 0,
                        LZ_CU_COMPUTE>>>((float *)dx->data, (const float *)dy->data,
                                         (const float *)x->data, (const float *)w->data,
                                         (const float *)mean->data, (const float *)rstd->data,
                                         rows, C);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ----------------------------------------------------------------- RMSNorm

// One warp per row: y = w * (x * s), s = 1 / sqrt(mean(x^2) + eps); x * s is
// rounded before w multiplies it, as in LlamaRMSNorm. x and w f32 or bf16.
// out f32, or bf16 (the f32 value rounded to nearest even) for a norm whose
// output only feeds bf16 GEMMs.
template <typename T, typename O>
__global__ void rmsnorm_forward_kernel(O *out, float *rstd, const T *x, const T *w,
                                       int64_t rows, int64_t C, float eps) {
  int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  if (row >= rows) return;
  const T *xr = x + row * C;
  float s2 = 0.0f;
  for (int64_t i = lane; i < C; i += WARP) {
    float v = widen(xr[i]);
    s2 += v * v;
  }
  const float s = 1.0f / sqrtf(warp_sum(s2) / (float)C + eps);
  O *o = out + row * C;
  for (int64_t i = lane; i < C; i += WARP) o[i] = narrow<O>(widen(w[i]) * (widen(xr[i]) * s));
  if (lane == 0) rstd[row] = s;
}

// dw partial sums of dy * (x * rstd) over a fixed range of rows per
// blockIdx.y, in row order; summed in chunk order by rmsnorm_dw_sum_kernel.
#define RMS_ROW_CHUNKS 64

template <typename T>
__global__ void rmsnorm_dw_kernel(float *partials, const T *dy, const T *x, const float *rstd,
                                  int64_t rows, int64_t C) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  int64_t per = (rows + RMS_ROW_CHUNKS - 1) / RMS_ROW_CHUNKS;
  int64_t r0 = blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
  float sw = 0.0f;
  for (int64_t r = r0; r < r1; r++) sw += widen(dy[r * C + c]) * (widen(x[r * C + c]) * rstd[r]);
  partials[(int64_t)blockIdx.y * C + c] = sw;
}

__global__ void rmsnorm_dw_sum_kernel(float *dw, const float *partials, int64_t C) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float t = 0.0f;
  for (int k = 0; k < RMS_ROW_CHUNKS; k++) t += partials[k * C + c];
  dw[c] += t;
}

// With norm = x * rstd and g = w * dy: dx = rstd * (g - norm * mean(g * norm)).
// dx may be dy (f32): each lane reads dy[i] before it writes dx[i], and the
// row sum is done before any write.
template <typename T>
__global__ void rmsnorm_dx_kernel(float *dx, const T *dy, const T *x, const T *w,
                                  const float *rstd, int64_t rows, int64_t C) {
  int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  if (row >= rows) return;
  const T *dyr = dy + row * C, *xr = x + row * C;
  const float s = rstd[row];
  float sgn = 0.0f;
  for (int64_t i = lane; i < C; i += WARP)
    sgn += (widen(w[i]) * widen(dyr[i])) * (widen(xr[i]) * s);
  const float mean_gn = warp_sum(sgn) / (float)C;
  __syncwarp();
  float *dxr = dx + row * C;
  for (int64_t i = lane; i < C; i += WARP)
    dxr[i] = (widen(w[i]) * widen(dyr[i]) - widen(xr[i]) * s * mean_gn) * s;
}

template <typename T, typename O>
static lz_status rmsnorm_forward(const lz_op_args *a) {
  const lz_tensor *x = a->t[2];
  int64_t C = lz_cols(x), rows = lz_rows(x);
  if (rows == 0 || C == 0) return LZ_OK;
  const int rows_per_block = THREADS / WARP;
  rmsnorm_forward_kernel<T, O><<<(unsigned)((rows + rows_per_block - 1) / rows_per_block),
                                 THREADS, 0, LZ_CU_COMPUTE>>>(
      (O *)a->t[0]->data, (float *)a->t[1]->data, (const T *)x->data, (const T *)a->t[3]->data,
      rows, C, a->f[0]);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

template <typename T>
static lz_status rmsnorm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dw = a->t[1];
  const lz_tensor *dy = a->t[2], *x = a->t[3], *w = a->t[4], *rstd = a->t[5];
  int64_t C = lz_cols(x), rows = lz_rows(x);
  if (rows == 0 || C == 0) return LZ_OK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, (size_t)RMS_ROW_CHUNKS * (size_t)C * sizeof(float)));
  // dw first: dx may share memory with dy.
  dim3 grid((unsigned)((C + THREADS - 1) / THREADS), RMS_ROW_CHUNKS);
  rmsnorm_dw_kernel<T><<<grid, THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)ws, (const T *)dy->data, (const T *)x->data, (const float *)rstd->data, rows, C);
  CUDA_LAUNCH_CHECK();
  rmsnorm_dw_sum_kernel<<<(unsigned)((C + THREADS - 1) / THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)dw->data, (const float *)ws, C);
  CUDA_LAUNCH_CHECK();
  const int rows_per_block = THREADS / WARP;
  rmsnorm_dx_kernel<T><<<(unsigned)((rows + rows_per_block - 1) / rows_per_block), THREADS, 0,
                         LZ_CU_COMPUTE>>>((float *)dx->data, (const T *)dy->data,
                                          (const T *)x->data, (const T *)w->data,
                                          (const float *)rstd->data, rows, C);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_rmsnorm_forward(const lz_op_args *a) {
  const bool bf16_in = a->t[2]->dtype == LZ_BF16;
  if (a->t[0]->dtype == LZ_BF16)
    return bf16_in ? rmsnorm_forward<__nv_bfloat16, __nv_bfloat16>(a)
                   : rmsnorm_forward<float, __nv_bfloat16>(a);
  return bf16_in ? rmsnorm_forward<__nv_bfloat16, float>(a) : rmsnorm_forward<float, float>(a);
}

lz_status lz_cu_rmsnorm_backward(const lz_op_args *a) {
  return a->t[3]->dtype == LZ_BF16 ? rmsnorm_backward<__nv_bfloat16>(a)
                                   : rmsnorm_backward<float>(a);
}

// ---------------------------------------------------------------- QK-norm

// Where head h of a row starts: n_q q heads of Dq, then k heads of Dk.
static __device__ __forceinline__ int64_t qk_head_at(int h, int n_q, int64_t Dq, int64_t Dk) {
  return h < n_q ? h * Dq : n_q * Dq + (h - n_q) * Dk;
}

// Whether clip (> 0) moves x: x outside [-clip, clip] (NaN is not).
static __device__ __forceinline__ bool qk_clamped(float x, float clip) {
  return x > clip || x < -clip;
}

// x clamped to [-clip, clip] (clip > 0), as torch's clamp (NaN stays).
static __device__ __forceinline__ float qk_clamp(float x, float clip) {
  return x > clip ? clip : x < -clip ? -clip : x;
}

// One warp per (row, head) of the q and k heads (core/kernels/qk_norm.c):
// y = (offset + w) * (x * s), clamped where clip > 0; warp `heads` of a row
// copies (or clamps) the columns after the k heads.
__global__ void qk_norm_forward_kernel(float *out, float *rstd, const float *x, const float *qw,
                                       const float *kw, int64_t rows, int64_t C, int64_t Dq,
                                       int64_t Dk, int n_q, int heads, float eps, float offset,
                                       float clip) {
  int64_t warp = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  int64_t row = warp / (heads + 1);
  int h = (int)(warp % (heads + 1));
  if (row >= rows) return;
  if (h == heads) {
    for (int64_t i = qk_head_at(heads, n_q, Dq, Dk) + lane; i < C; i += WARP) {
      const float v = x[row * C + i];
      if (clip > 0.0f || out != x) out[row * C + i] = clip > 0.0f ? qk_clamp(v, clip) : v;
    }
    return;
  }
  const int64_t D = h < n_q ? Dq : Dk, at = row * C + qk_head_at(h, n_q, Dq, Dk);
  const float *xr = x + at, *w = h < n_q ? qw : kw;
  float s2 = 0.0f;
  for (int64_t i = lane; i < D; i += WARP) s2 += xr[i] * xr[i];
  const float s = 1.0f / sqrtf(warp_sum(s2) / (float)D + eps);
  __syncwarp();  // every lane has read its x before out (which may be x) is written
  float *o = out + at;
  for (int64_t i = lane; i < D; i += WARP) {
    const float y = (offset + w[i]) * (xr[i] * s);
    o[i] = clip > 0.0f ? qk_clamp(y, clip) : y;
  }
  if (lane == 0) rstd[row * heads + h] = s;
}

// dy where forward did not clamp the output (offset + w) * (x * s).
static __device__ __forceinline__ float qk_kept(float dy, float x, float w, float s, float offset,
                                                float clip) {
  if (!(clip > 0.0f)) return dy;
  const float y = (offset + w) * (x * s);
  return qk_clamped(y, clip) ? 0.0f : dy;
}

// dw partials: column c of [q | k] (Dq + Dk of them) summed over a fixed
// range of rows per blockIdx.y, heads in order within a row.
__global__ void qk_norm_dw_kernel(float *partials, const float *dy, const float *x,
                                  const float *qw, const float *kw, const float *rstd,
                                  int64_t rows, int64_t C, int64_t Dq, int64_t Dk, int n_q,
                                  int heads, float offset, float clip) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= Dq + Dk) return;
  int64_t per = (rows + RMS_ROW_CHUNKS - 1) / RMS_ROW_CHUNKS;
  int64_t r0 = blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
  const int q = c < Dq;
  int h0 = q ? 0 : n_q, h1 = q ? n_q : heads;
  int64_t col = q ? c : c - Dq;
  const float w = q ? qw[col] : kw[col];
  float sw = 0.0f;
  for (int64_t r = r0; r < r1; r++)
    for (int h = h0; h < h1; h++) {
      int64_t at = r * C + qk_head_at(h, n_q, Dq, Dk) + col;
      const float s = rstd[r * heads + h];
      sw += qk_kept(dy[at], x[at], w, s, offset, clip) * (x[at] * s);
    }
  partials[(int64_t)blockIdx.y * (Dq + Dk) + c] = sw;
}

__global__ void qk_norm_dw_sum_kernel(float *dqw, float *dkw, const float *partials, int64_t Dq,
                                      int64_t Dk) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= Dq + Dk) return;
  float t = 0.0f;
  for (int k = 0; k < RMS_ROW_CHUNKS; k++) t += partials[k * (Dq + Dk) + c];
  if (c < Dq)
    dqw[c] += t;
  else
    dkw[c - Dq] += t;
}

// dx per (row, head) as qk_norm_forward_kernel's warps; dx may be dy.
__global__ void qk_norm_dx_kernel(float *dx, const float *dy, const float *x, const float *qw,
                                  const float *kw, const float *rstd, int64_t rows, int64_t C,
                                  int64_t Dq, int64_t Dk, int n_q, int heads, float offset,
                                  float clip) {
  int64_t warp = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  int lane = threadIdx.x % WARP;
  int64_t row = warp / (heads + 1);
  int h = (int)(warp % (heads + 1));
  if (row >= rows) return;
  if (h == heads) {
    for (int64_t i = qk_head_at(heads, n_q, Dq, Dk) + lane; i < C; i += WARP) {
      const float v = x[row * C + i], d = dy[row * C + i];
      if (clip > 0.0f || dx != dy)
        dx[row * C + i] = clip > 0.0f && qk_clamped(v, clip) ? 0.0f : d;
    }
    return;
  }
  const int64_t D = h < n_q ? Dq : Dk, at = row * C + qk_head_at(h, n_q, Dq, Dk);
  const float *dyr = dy + at, *xr = x + at, *w = h < n_q ? qw : kw;
  const float s = rstd[row * heads + h];
  float sgn = 0.0f;
  for (int64_t i = lane; i < D; i += WARP)
    sgn += ((offset + w[i]) * qk_kept(dyr[i], xr[i], w[i], s, offset, clip)) * (xr[i] * s);
  const float mean_gn = warp_sum(sgn) / (float)D;
  __syncwarp();
  float *dxr = dx + at;
  for (int64_t i = lane; i < D; i += WARP) {
    const float d = qk_kept(dyr[i], xr[i], w[i], s, offset, clip);
    dxr[i] = ((offset + w[i]) * d - xr[i] * s * mean_gn) * s;
  }
}

lz_status lz_cu_qk_norm_forward(const lz_op_args *a) {
  const lz_tensor *x = a->t[2];
  const int n_q = (int)a->i[0], heads = (int)(a->i[0] + a->i[1]);
  const int64_t C = lz_cols(x), rows = lz_rows(x), Dq = lz_tensor_numel(a->t[3]),
                Dk = lz_tensor_numel(a->t[4]);
  if (rows == 0) return LZ_OK;
  const int64_t warps = rows * (heads + 1), per_block = THREADS / WARP;
  qk_norm_forward_kernel<<<(unsigned)((warps + per_block - 1) / per_block), THREADS, 0,
                           LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (float *)a->t[1]->data, (const float *)x->data,
      (const float *)a->t[3]->data, (const float *)a->t[4]->data, rows, C, Dq, Dk, n_q, heads,
      a->f[0], a->f[1], a->f[2]);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_qk_norm_backward(const lz_op_args *a) {
  lz_tensor *dx = a->t[0], *dqw = a->t[1], *dkw = a->t[2];
  const lz_tensor *dy = a->t[3], *x = a->t[4], *qw = a->t[5], *kw = a->t[6], *rstd = a->t[7];
  const int n_q = (int)a->i[0], heads = (int)(a->i[0] + a->i[1]);
  const float offset = a->f[0], clip = a->f[1];
  const int64_t C = lz_cols(x), rows = lz_rows(x), Dq = lz_tensor_numel(qw),
                Dk = lz_tensor_numel(kw), W = Dq + Dk;
  if (rows == 0) return LZ_OK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, (size_t)RMS_ROW_CHUNKS * (size_t)W * sizeof(float)));
  // dw first: dx may share memory with dy.
  dim3 grid((unsigned)((W + THREADS - 1) / THREADS), RMS_ROW_CHUNKS);
  qk_norm_dw_kernel<<<grid, THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)ws, (const float *)dy->data, (const float *)x->data, (const float *)qw->data,
      (const float *)kw->data, (const float *)rstd->data, rows, C, Dq, Dk, n_q, heads, offset,
      clip);
  CUDA_LAUNCH_CHECK();
  qk_norm_dw_sum_kernel<<<(unsigned)((W + THREADS - 1) / THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)dqw->data, (float *)dkw->data, (const float *)ws, Dq, Dk);
  CUDA_LAUNCH_CHECK();
  const int64_t warps = rows * (heads + 1), per_block = THREADS / WARP;
  qk_norm_dx_kernel<<<(unsigned)((warps + per_block - 1) / per_block), THREADS, 0,
                      LZ_CU_COMPUTE>>>((float *)dx->data, (const float *)dy->data,
                                       (const float *)x->data, (const float *)qw->data,
                                       (const float *)kw->data, (const float *)rstd->data, rows,
                                       C, Dq, Dk, n_q, heads, offset, clip);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ------------------------------------------------------------ ids on the host

// A copy of t's ids (NULL: none) on the host, where the core's checks read
// them (the same message as on the cpu); the compute stream is waited for,
// since the kernels before may have written them. Free *out.
static lz_status host_ids(const lz_tensor *t, int32_t **out) {
  *out = NULL;
  if (!t) return LZ_OK;
  const size_t bytes = lz_tensor_bytes(t);
  int32_t *h = (int32_t *)malloc(bytes ? bytes : 1);
  if (!h) return lz_fail(LZ_ERR_NOMEM, "cuda: out of host memory for a copy of the ids");
  cudaError_t e = cudaMemcpyAsync(h, t->data, bytes, cudaMemcpyDeviceToHost, LZ_CU_COMPUTE);
  if (e == cudaSuccess) e = cudaStreamSynchronize(LZ_CU_COMPUTE);
  if (e != cudaSuccess) {
    free(h);
    CUDA_CHECK(e);
  }
  *out = h;
  return LZ_OK;
}

static lz_status check_embedding_ids(lz_op op, const lz_op_args *a, const lz_tensor *tokens) {
  int32_t *tok, *pos = NULL;
  LZ_TRY(host_ids(tokens, &tok));
  lz_status st = host_ids(a->t[4], &pos);
  if (st == LZ_OK) st = lz_embedding_check_ids(op, a, tok, pos);
  free(tok);
  free(pos);
  return st;
}

static lz_status check_rope_pos(lz_op op, const lz_op_args *a) {
  int32_t *pos;
  LZ_TRY(host_ids(a->t[3], &pos));
  lz_status st = pos ? lz_rope_check_values(op, a, NULL, pos) : LZ_OK;
  free(pos);
  return st;
}

// -------------------------------------------------------------------- RoPE

// The inverse frequencies of the theta form, worked out in double and
// rounded to fp32, as core/kernels/rope.c does.
__global__ void rope_inv_freq_kernel(float *inv_freq, double theta, int64_t half, int head_dim) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < half) inv_freq[i] = (float)pow(theta, -2.0 * (double)i / (double)head_dim);
}

// One thread per pair (element i and i + half of a head of `stride` values)
// of the first n_head heads of each row: the pair turns by sign * pos *
// inv_freq[i], the angle an fp32 product; cos and sin multiplied by scale
// unless it is 0. out may be x (f32): a thread reads its pair before it
// writes it.
// pos (NULL: pos_offset + t): each row's position, as lz_rope_pos_*.
template <typename T, typename O>
__global__ void rope_kernel(O *out, const T *x, const float *inv_freq, const int32_t *pos,
                            int64_t rows, int64_t seq, int64_t C, int64_t n_head, int64_t half,
                            int64_t stride, int64_t pos_offset, float sign, float scale) {
  const int64_t n = rows * n_head * half;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e % half, rh = e / half, h = rh % n_head, r = rh / n_head;
    const float p = pos ? (float)pos[r] : (float)(pos_offset + r % seq);
    const float angle = p * inv_freq[i];
    float sn, cs;
    sincosf(angle, &sn, &cs);
    if (scale != 0.0f) cs *= scale, sn *= scale;
    sn *= sign;
    const int64_t at = r * C + h * stride + i;
    const float x1 = widen(x[at]), x2 = widen(x[at + half]);
    out[at] = narrow<O>(x1 * cs - x2 * sn);
    out[at + half] = narrow<O>(x2 * cs + x1 * sn);
  }
}

// The values of the first n_head heads that do not turn (from 2 * half to
// stride in each): copied (widened) from x to out.
template <typename T, typename O>
__global__ void rope_copy_pass_kernel(O *out, const T *x, int64_t rows, int64_t C,
                                      int64_t n_head, int64_t half, int64_t stride) {
  const int64_t w = stride - 2 * half, n = rows * n_head * w;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = e % w, rh = e / w, h = rh % n_head, r = rh / n_head;
    const int64_t at = r * C + h * stride + 2 * half + j;
    out[at] = narrow<O>(widen(x[at]));
  }
}

// Columns [turned, C) of each row: copied (widened) from x to out.
template <typename T, typename O>
__global__ void rope_copy_rest_kernel(O *out, const T *x, int64_t rows, int64_t C,
                                      int64_t turned) {
  const int64_t w = C - turned, n = rows * w;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t at = (e / w) * C + turned + e % w;
    out[at] = narrow<O>(widen(x[at]));
  }
}

// t: out, x, inv_freq (NULL: from theta), pos (NULL: pos_offset + t); i:
// n_head, head_dim, pos_offset, rotary_dim (0: head_dim); f: theta, scale
// (0: none). With inv_freq given a row may hold
// more than the n_head heads: the rest is copied to out (left alone when out
// is x). out is f32, or bf16 (the f32 values rounded to nearest even).
template <typename T, typename O>
static lz_status rope(const lz_op_args *a, float sign) {
  lz_tensor *out = a->t[0];
  const lz_tensor *x = a->t[1], *freqs = a->t[2];
  const int64_t n_head = a->i[0], head_dim = a->i[1], pos_offset = a->i[2];
  const int64_t half = (a->i[3] ? a->i[3] : head_dim) / 2;
  const int64_t seq = x->shape[1], rows = x->shape[0] * seq, C = x->shape[2];
  const int64_t turned = n_head * head_dim;
  if (rows == 0) return LZ_OK;
  const float *inv_freq;
  if (freqs) {
    inv_freq = (const float *)freqs->data;
  } else {
    void *ws;
    LZ_TRY(lz_cu_scratch(&ws, (size_t)half * sizeof(float)));
    rope_inv_freq_kernel<<<(unsigned)((half + THREADS - 1) / THREADS), THREADS, 0,
                           LZ_CU_COMPUTE>>>((float *)ws, (double)a->f[0], half, (int)head_dim);
    CUDA_LAUNCH_CHECK();
    inv_freq = (const float *)ws;
  }
  rope_kernel<T, O><<<lz_cu_blocks(rows * n_head * half, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (O *)out->data, (const T *)x->data, inv_freq,
      a->t[3] ? (const int32_t *)a->t[3]->data : NULL, rows, seq, C, n_head, half, head_dim,
      pos_offset, sign, a->f[1]);
  CUDA_LAUNCH_CHECK();
  if (2 * half < head_dim && out->data != x->data) {
    rope_copy_pass_kernel<T, O><<<lz_cu_blocks(rows * n_head * (head_dim - 2 * half), THREADS),
                                  THREADS, 0, LZ_CU_COMPUTE>>>((O *)out->data,
                                                            (const T *)x->data, rows, C, n_head,
                                                            half, head_dim);
    CUDA_LAUNCH_CHECK();
  }
  if (C > turned && out->data != x->data) {
    rope_copy_rest_kernel<T, O><<<lz_cu_blocks(rows * (C - turned), THREADS), THREADS, 0,
                                  LZ_CU_COMPUTE>>>((O *)out->data, (const T *)x->data, rows, C,
                                                turned);
    CUDA_LAUNCH_CHECK();
  }
  return LZ_OK;
}

lz_status lz_cu_rope_forward(const lz_op_args *a) {
  LZ_TRY(check_rope_pos(LZ_OP_ROPE_FORWARD, a));
  return a->t[1]->dtype == LZ_BF16 ? rope<__nv_bfloat16, float>(a, 1.0f)
                                   : rope<float, float>(a, 1.0f);
}

// The rotation's transpose: the angles turned the other way.
lz_status lz_cu_rope_backward(const lz_op_args *a) {
  LZ_TRY(check_rope_pos(LZ_OP_ROPE_BACKWARD, a));
  // a bf16 dx comes from an f32 dy (core/kernels/rope.c checks)
  if (a->t[0]->dtype == LZ_BF16) return rope<float, __nv_bfloat16>(a, -1.0f);
  return a->t[1]->dtype == LZ_BF16 ? rope<__nv_bfloat16, float>(a, -1.0f)
                                   : rope<float, float>(a, -1.0f);
}

// ------------------------------------------------------------ cross-entropy

// One block per row: the row's maximum and sum of exp(logit - max) over the
// first `vocab` columns.
__device__ void softmax_stats(const float *lg, int64_t vocab, float *m_out, float *s_out) {
  float m = -FLT_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += THREADS) m = fmaxf(m, lg[i]);
  m = block_reduce(m, true);
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < vocab; i += THREADS) s += expf(lg[i] - m);
  s = block_reduce(s, false);
  *m_out = m;
  *s_out = s;
}

// A target at or past vocab: its row is skipped (no read past the row) and
// the first such (row, target) kept in *bad, the least row winning: row in
// the high half, the target's bits in the low.
__device__ __forceinline__ bool xent_bad_target(unsigned long long *bad, int64_t r, int32_t tg,
                                                int64_t vocab) {
  if (tg < vocab) return false;
  if (threadIdx.x == 0)
    atomicMin(bad, ((unsigned long long)r << 32) | (unsigned long long)(uint32_t)tg);
  return true;
}

__global__ void xent_forward_kernel(float *losses, const float *logits, const int32_t *targets,
                                    int64_t vocab, int64_t Vp, unsigned long long *bad) {
  int64_t r = blockIdx.x;
  int32_t tg = targets[r];
  if (tg < 0 || xent_bad_target(bad, r, tg, vocab)) {
    if (threadIdx.x == 0) losses[r] = 0.0f;
    return;
  }
  const float *lg = logits + r * Vp;
  float m, s;
  softmax_stats(lg, vocab, &m, &s);
  if (threadIdx.x == 0) losses[r] = logf(s) + m - lg[tg];
}

// dlogits may be logits: the statistics and the target's logit are read
// before the first write (block_reduce ends on a barrier; the extra one
// covers the target logit). A bf16 dlogits gets each gradient rounded as
// the cpu rounds it.
__device__ __forceinline__ void store_grad(float *p, float v) { *p = v; }
__device__ __forceinline__ void store_grad(__nv_bfloat16 *p, float v) {
  *p = __float2bfloat16_rn(v);
}

// cap > 0: the logits are soft-capped (y = cap tanh(x / cap)) and each
// gradient is carried to x by 1 - (y / cap)^2, as core/kernels/cross_entropy.c.
__device__ __forceinline__ float through_cap(float g, float y, float cap) {
  if (cap == 0.0f) return g;
  const float t = y / cap;
  return g * (1.0f - t * t);
}

template <typename G>
__global__ void xent_backward_kernel(G *dlogits, const float *logits, const int32_t *targets,
                                     int64_t vocab, int64_t Vp, float dloss, float cap,
                                     unsigned long long *bad) {
  int64_t r = blockIdx.x;
  int32_t tg = targets[r];
  G *dl = dlogits + r * Vp;
  if (tg < 0 || xent_bad_target(bad, r, tg, vocab)) {
    for (int64_t i = threadIdx.x; i < Vp; i += THREADS) store_grad(dl + i, 0.0f);
    return;
  }
  const float *lg = logits + r * Vp;
  float m, s;
  softmax_stats(lg, vocab, &m, &s);
  const float logit_target = lg[tg], inv = 1.0f / s;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < vocab; i += THREADS)
    store_grad(dl + i, through_cap(expf(lg[i] - m) * inv * dloss, lg[i], cap));
  for (int64_t i = vocab + threadIdx.x; i < Vp; i += THREADS) store_grad(dl + i, 0.0f);
  __syncthreads();
  if (threadIdx.x == 0)
    store_grad(dl + tg, through_cap((expf(logit_target - m) * inv - 1.0f) * dloss, logit_target,
                                    cap));
}

// The device word the kernels report a bad target in (all ones: none), and
// what the host knows of the launches since the last report: the first
// one's op and vocab, for the message.
static unsigned long long *xent_bad;
static const char *xent_op;
static int64_t xent_vocab;

static lz_status xent_launch(lz_op op, int64_t vocab, unsigned long long **bad) {
  if (!xent_bad) {
    // Off the ledger, as cuBLASLt's workspace is: 8 bytes for the process.
    CUDA_CHECK(cudaMalloc(&xent_bad, sizeof *xent_bad));
    CUDA_CHECK(cudaMemsetAsync(xent_bad, 0xff, sizeof *xent_bad, LZ_CU_COMPUTE));
  }
  if (!xent_op) {
    xent_op = lz_op_infos[op].name;
    xent_vocab = vocab;
  }
  *bad = xent_bad;
  return LZ_OK;
}

lz_status lz_cu_xent_report(void) {
  if (!xent_op) return LZ_OK;  // no cross-entropy since the last report
  unsigned long long bad;
  CUDA_CHECK(cudaMemcpyAsync(&bad, xent_bad, sizeof bad, cudaMemcpyDeviceToHost, LZ_CU_COMPUTE));
  CUDA_CHECK(cudaStreamSynchronize(LZ_CU_COMPUTE));
  const char *op = xent_op;
  xent_op = NULL;
  if (bad == ~0ULL) return LZ_OK;
  CUDA_CHECK(cudaMemsetAsync(xent_bad, 0xff, sizeof *xent_bad, LZ_CU_COMPUTE));
  return lz_fail(LZ_ERR_INVALID,
                 "%s: targets[%lld] is %d, not below vocab %lld (negative targets are ignored)",
                 op, (long long)(bad >> 32), (int)(int32_t)(uint32_t)bad, (long long)xent_vocab);
}

lz_status lz_cu_cross_entropy_forward(const lz_op_args *a) {
  const lz_tensor *logits = a->t[1];
  int64_t Vp = lz_cols(logits), rows = lz_rows(logits);
  if (rows == 0) return LZ_OK;
  unsigned long long *bad;
  LZ_TRY(xent_launch(LZ_OP_CROSS_ENTROPY_FORWARD, a->i[0], &bad));
  xent_forward_kernel<<<(unsigned)rows, THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)logits->data, (const int32_t *)a->t[2]->data,
      a->i[0], Vp, bad);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_cross_entropy_backward(const lz_op_args *a) {
  const lz_tensor *logits = a->t[1];
  int64_t Vp = lz_cols(logits), rows = lz_rows(logits);
  if (rows == 0) return LZ_OK;
  unsigned long long *bad;
  LZ_TRY(xent_launch(LZ_OP_CROSS_ENTROPY_BACKWARD, a->i[0], &bad));
  if (a->t[0]->dtype == LZ_BF16)
    xent_backward_kernel<<<(unsigned)rows, THREADS, 0, LZ_CU_COMPUTE>>>(
        (__nv_bfloat16 *)a->t[0]->data, (const float *)logits->data,
        (const int32_t *)a->t[2]->data, a->i[0], Vp, a->f[0], a->f[1], bad);
  else
    xent_backward_kernel<<<(unsigned)rows, THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)a->t[0]->data, (const float *)logits->data, (const int32_t *)a->t[2]->data,
        a->i[0], Vp, a->f[0], a->f[1], bad);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ---------------------------------------------------------------- embedding

// wpe NULL: the token row alone (Llama has no position table). pos NULL:
// position t; else each token's row of wpe. Tables f32 or bf16 (widened
// exactly, as the cpu does).
template <typename W>
__global__ void embedding_forward_kernel(float *out, const int32_t *tok, const int32_t *pos,
                                         const W *wte, const W *wpe, int64_t BT, int64_t T,
                                         int64_t C) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < BT * C;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t bt = i / C, c = i % C;
    const float te = widen(wte[(int64_t)tok[bt] * C + c]);
    out[i] = wpe ? te + widen(wpe[(pos ? (int64_t)pos[bt] : bt % T) * C + c]) : te;
  }
}

// One thread per channel walks every position in order, as the cpu does:
// repeated tokens add into their row in the same order, so the bits match
// the cpu's. dwte's row skip (< 0: none) takes nothing.
__global__ void embedding_backward_kernel(float *dwte, float *dwpe, const float *dout,
                                          const int32_t *tok, const int32_t *pos, int64_t BT,
                                          int64_t T, int64_t C, int64_t skip) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t bt = 0; bt < BT; bt++) {
    float d = dout[bt * C + c];
    if (dwte && tok[bt] != skip) dwte[(int64_t)tok[bt] * C + c] += d;
    if (dwpe) dwpe[(pos ? (int64_t)pos[bt] : bt % T) * C + c] += d;
  }
}

lz_status lz_cu_embedding_forward(const lz_op_args *a) {
  const lz_tensor *tokens = a->t[1], *wte = a->t[2];
  LZ_TRY(check_embedding_ids(LZ_OP_EMBEDDING_FORWARD, a, tokens));
  int64_t B = tokens->shape[0], T = tokens->shape[1], C = wte->shape[1];
  if (B * T * C == 0) return LZ_OK;
  const int32_t *pos = a->t[4] ? (const int32_t *)a->t[4]->data : NULL;
  const void *wpe = a->t[3] ? a->t[3]->data : NULL;
  if (wte->dtype == LZ_BF16)
    embedding_forward_kernel<<<lz_cu_blocks(B * T * C, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)a->t[0]->data, (const int32_t *)tokens->data, pos,
        (const __nv_bfloat16 *)wte->data, (const __nv_bfloat16 *)wpe, B * T, T, C);
  else
    embedding_forward_kernel<<<lz_cu_blocks(B * T * C, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)a->t[0]->data, (const int32_t *)tokens->data, pos, (const float *)wte->data,
        (const float *)wpe, B * T, T, C);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_embedding_backward(const lz_op_args *a) {
  lz_tensor *dwte = a->t[0], *dwpe = a->t[1];
  const lz_tensor *dout = a->t[2], *tokens = a->t[3];
  LZ_TRY(check_embedding_ids(LZ_OP_EMBEDDING_BACKWARD, a, tokens));
  int64_t B = tokens->shape[0], T = tokens->shape[1], C = dout->shape[2];
  if ((!dwte && !dwpe) || B * T * C == 0) return LZ_OK;
  embedding_backward_kernel<<<(unsigned)((C + 63) / 64), 64, 0, LZ_CU_COMPUTE>>>(
      dwte ? (float *)dwte->data : NULL, dwpe ? (float *)dwpe->data : NULL,
      (const float *)dout->data, (const int32_t *)tokens->data,
      a->t[4] ? (const int32_t *)a->t[4]->data : NULL, B * T, T, C, a->i[0] - 1);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}
