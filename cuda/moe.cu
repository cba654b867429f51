// moe.cu — the mixture-of-experts kernels on the device, with the semantics
// of core/kernels/moe.c and core/kernels/moe_gemm.c (the core has checked
// shapes; index values are checked here). Every sum runs in a fixed order in
// one thread (or one warp's fixed tree), with no atomics: the same bits on
// every run. moe_sort and the grouped GEMM read their indices on the host
// (the sort is a sequential counting sort; the GEMM needs each expert's row
// count to size its cuBLASLt call), waiting for the compute stream.
#include "lz_cuda.h"

#include <stdlib.h>  // malloc, calloc, free
#include <string.h>  // strcmp: which rows check_rows checks

#define THREADS 256
#define WARP 32

__device__ __forceinline__ float load(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float *p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}

// A host copy of an i32 tensor's values, after the compute stream's work.
static lz_status host_i32(const lz_tensor *t, int32_t **out) {
  const size_t bytes = lz_tensor_bytes(t);
  int32_t *h = (int32_t *)malloc(bytes ? bytes : 1);
  if (!h) return lz_fail(LZ_ERR_NOMEM, "cuda: out of host memory for a copy of %zu bytes", bytes);
  cudaError_t e = cudaMemcpyAsync(h, t->data, bytes, cudaMemcpyDeviceToHost, LZ_CU_COMPUTE);
  if (e == cudaSuccess) e = cudaStreamSynchronize(LZ_CU_COMPUTE);
  if (e != cudaSuccess) {
    free(h);
    CUDA_CHECK(e);
  }
  *out = h;
  return LZ_OK;
}

static lz_status ids_fail(lz_op op, const char *name, const int32_t *ids, int64_t n, int64_t hi,
                          const char *what) {
  int32_t v;
  const int64_t i = lz_ids_first_outside(ids, n, 0, hi, &v);
  if (i < 0) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID, "%s: %s[%lld] is %d, outside [0, %lld) (%s)",
                 lz_op_infos[op].name, name, (long long)i, (int)v, (long long)hi, what);
}

// ------------------------------------------------------------------- route

// One thread per token: softmax, then K picks, each the largest below the
// previous pick in (probability descending, expert ascending) order, so a
// tie goes to the lower expert; then the optional renormalisation.
template <typename T>
__global__ void route_forward_kernel(float *w, int32_t *id, float *p, const T *logits, int64_t N,
                                     int64_t E, int64_t K, int norm) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= N) return;
  const T *l = logits + t * E;
  float *pr = p + t * E;
  float m = -INFINITY, s = 0.0f;
  for (int64_t e = 0; e < E; e++) m = fmaxf(m, load(l, e));
  for (int64_t e = 0; e < E; e++) {
    pr[e] = expf(load(l, e) - m);
    s += pr[e];
  }
  for (int64_t e = 0; e < E; e++) pr[e] /= s;
  // The cpu's selection (core/kernels/moe.c route_row): the largest
  // probability of the experts not taken yet, the lowest index on a tie; a
  // row of NaN (a NaN or +inf logit) takes experts 0 .. K - 1.
  float sum = 0.0f;
  for (int64_t j = 0; j < K; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++) {
      bool taken = false;
      for (int64_t q = 0; q < j && !taken; q++) taken = id[t * K + q] == e;
      if (!taken && (best < 0 || pr[e] > pr[best])) best = e;
    }
    id[t * K + j] = (int32_t)best;
    w[t * K + j] = pr[best];
    sum += pr[best];
  }
  if (norm)
    for (int64_t j = 0; j < K; j++) w[t * K + j] /= sum;
}

lz_status lz_cu_moe_route_forward(const lz_op_args *a) {
  const lz_tensor *logits = a->t[3];
  const int64_t N = lz_rows(logits), E = lz_cols(logits), K = lz_cols(a->t[0]);
  if (N == 0) return LZ_OK;
  float *w = (float *)a->t[0]->data, *p = (float *)a->t[2]->data;
  int32_t *id = (int32_t *)a->t[1]->data;
  if (logits->dtype == LZ_BF16)
    route_forward_kernel<<<lz_cu_blocks(N, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        w, id, p, (const __nv_bfloat16 *)logits->data, N, E, K, (int)a->i[0]);
  else
    route_forward_kernel<<<lz_cu_blocks(N, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        w, id, p, (const float *)logits->data, N, E, K, (int)a->i[0]);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// One thread per token: g = dprobs + each chosen expert's weight gradient
// (through the renormalisation when norm), then dl = p * (g - p . g).
// Experts are distinct within a token, so g[e] gets at most one term.
template <typename T>
__global__ void route_backward_kernel(T *dl, const float *dw, const float *dp, const float *p,
                                      const int32_t *id, int64_t N, int64_t E, int64_t K,
                                      int norm) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= N) return;
  const float *pr = p + t * E, *dwt = dw + t * K;
  const int32_t *it = id + t * K;
  float sum = 0.0f, c = 0.0f;
  if (norm) {
    for (int64_t j = 0; j < K; j++) sum += pr[it[j]];
    for (int64_t j = 0; j < K; j++) c += dwt[j] * (pr[it[j]] / sum);
  }
  float dot = 0.0f;
  for (int64_t pass = 0; pass < 2; pass++)
    for (int64_t e = 0; e < E; e++) {
      float g = dp ? dp[t * E + e] : 0.0f;
      for (int64_t j = 0; j < K; j++)
        if (it[j] == e) g += norm ? (dwt[j] - c) / sum : dwt[j];
      if (pass == 0) dot += pr[e] * g;
      else store(dl + t * E, e, pr[e] * (g - dot));
    }
}

lz_status lz_cu_moe_route_backward(const lz_op_args *a) {
  const lz_tensor *dl = a->t[0], *dp = a->t[2], *probs = a->t[3], *idx = a->t[4];
  const int64_t N = lz_rows(probs), E = lz_cols(probs), K = lz_cols(idx);
  if (N == 0) return LZ_OK;
  {  // the experts chosen, on the host, as the cpu checks them
    int32_t *h = NULL;
    LZ_TRY(host_i32(idx, &h));
    const lz_status st = ids_fail(LZ_OP_MOE_ROUTE_BACKWARD, "idx", h, N * K, E, "E, the experts");
    free(h);
    LZ_TRY(st);
  }
  const float *dw = (const float *)a->t[1]->data, *p = (const float *)probs->data;
  const float *dpp = dp ? (const float *)dp->data : NULL;
  const int32_t *id = (const int32_t *)idx->data;
  const int norm = (int)a->i[0];
  if (dl->dtype == LZ_BF16)
    route_backward_kernel<<<lz_cu_blocks(N, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (__nv_bfloat16 *)dl->data, dw, dpp, p, id, N, E, K, norm);
  else
    route_backward_kernel<<<lz_cu_blocks(N, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)dl->data, dw, dpp, p, id, N, E, K, norm);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// -------------------------------------------------------------------- sort

// On the host, as core/kernels/moe.c: a stable counting sort of the slots.
lz_status lz_cu_moe_sort(const lz_op_args *a) {
  const lz_tensor *idx = a->t[3];
  const int64_t n = lz_tensor_numel(idx), E = a->t[2]->shape[0] - 1;
  int32_t *id = NULL;
  LZ_TRY(host_i32(idx, &id));
  lz_status st = ids_fail(LZ_OP_MOE_SORT, "idx", id, n, E, "E, one less than offsets' length");
  int32_t *out = st == LZ_OK ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * n + E + 1)) : NULL;
  int64_t *cursor = out ? (int64_t *)calloc((size_t)E + 1, sizeof(int64_t)) : NULL;
  if (st == LZ_OK && !cursor)
    st = lz_fail(LZ_ERR_NOMEM, "moe_sort: out of host memory for %lld slots", (long long)n);
  if (st == LZ_OK) {
    int32_t *row = out, *slot = out + n, *off = out + 2 * n;
    for (int64_t s = 0; s < n; s++) cursor[id[s] + 1]++;
    for (int64_t e = 0; e < E; e++) cursor[e + 1] += cursor[e];
    for (int64_t e = 0; e <= E; e++) off[e] = (int32_t)cursor[e];
    for (int64_t s = 0; s < n; s++) {
      const int64_t r = cursor[id[s]]++;
      row[s] = (int32_t)r;
      slot[r] = (int32_t)s;
    }
    cudaError_t e = cudaMemcpyAsync(a->t[0]->data, row, sizeof(int32_t) * (size_t)n,
                                    cudaMemcpyHostToDevice, LZ_CU_COMPUTE);
    if (e == cudaSuccess)
      e = cudaMemcpyAsync(a->t[1]->data, slot, sizeof(int32_t) * (size_t)n,
                          cudaMemcpyHostToDevice, LZ_CU_COMPUTE);
    if (e == cudaSuccess)
      e = cudaMemcpyAsync(a->t[2]->data, off, sizeof(int32_t) * (size_t)(E + 1),
                          cudaMemcpyHostToDevice, LZ_CU_COMPUTE);
    // The host buffer is freed below: the copies must have read it.
    if (e == cudaSuccess) e = cudaStreamSynchronize(LZ_CU_COMPUTE);
    if (e != cudaSuccess) st = lz_cuda_fail(e, "moe_sort copies", __FILE__, __LINE__);
  }
  free(cursor);
  free(out);
  free(id);
  return st;
}

// ----------------------------------------------------------------- permute

template <typename TO, typename TI>
__global__ void permute_forward_kernel(TO *out, const TI *x, const int32_t *slot, int64_t R,
                                       int64_t H, int64_t K) {
  const int64_t n = R * H;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / H, c = i % H;
    store(out, i, load(x, (int64_t)(slot[r] / K) * H + c));
  }
}

// slot_of_row's or row_of_slot's values, on the host: a bad one would read
// outside x; row_of_slot's must also be a permutation, as the cpu checks
// (a repeated row would be summed once, or written by two threads at once).
static lz_status check_rows(lz_op op, const lz_tensor *t, const char *name, int64_t hi,
                            const char *what) {
  int32_t *h = NULL;
  LZ_TRY(host_i32(t, &h));
  const int64_t n = lz_tensor_numel(t);
  lz_status st = ids_fail(op, name, h, n, hi, what);
  if (st == LZ_OK && !strcmp(name, "row_of_slot")) st = lz_moe_check_permutation(op, h, n);
  free(h);
  return st;
}

lz_status lz_cu_moe_permute_forward(const lz_op_args *a) {
  const lz_tensor *out = a->t[0], *x = a->t[1], *sor = a->t[2];
  const int64_t N = lz_rows(x), H = lz_cols(x), R = sor->shape[0];
  if (R == 0 || H == 0) return LZ_OK;
  LZ_TRY(check_rows(LZ_OP_MOE_PERMUTE_FORWARD, sor, "slot_of_row", R, "R, the slots"));
  const int32_t *slot = (const int32_t *)sor->data;
  const unsigned blocks = lz_cu_blocks(R * H, THREADS);
  const bool ob = out->dtype == LZ_BF16, xb = x->dtype == LZ_BF16;
  if (ob && xb)
    permute_forward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
        (__nv_bfloat16 *)out->data, (const __nv_bfloat16 *)x->data, slot, R, H, R / N);
  else if (ob)
    permute_forward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
        (__nv_bfloat16 *)out->data, (const float *)x->data, slot, R, H, R / N);
  else if (xb)
    permute_forward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)out->data, (const __nv_bfloat16 *)x->data, slot, R, H, R / N);
  else
    permute_forward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)out->data, (const float *)x->data, slot, R, H, R / N);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// The next of a token's rows in ascending order after prev (-1: the first).
__device__ __forceinline__ int64_t next_row(const int32_t *rows, int64_t K, int64_t prev) {
  int64_t best = -1;
  for (int64_t j = 0; j < K; j++)
    if (rows[j] > prev && (best < 0 || rows[j] < rows[best])) best = j;
  return best;
}

// out[t, c] = the sum over t's rows in row order of (w ? w[t, j] : 1) *
// src[row, c]: permute's backward (w NULL) and combine's forward.
template <typename T>
__global__ void gather_sum_kernel(float *out, const T *src, const int32_t *rows, const float *w,
                                  int64_t N, int64_t K, int64_t H) {
  const int64_t n = N * H;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / H, c = i % H;
    const int32_t *rt = rows + t * K;
    float acc = 0.0f;
    for (int64_t j = next_row(rt, K, -1); j >= 0; j = next_row(rt, K, rt[j]))
      acc += (w ? w[t * K + j] : 1.0f) * load(src, (int64_t)rt[j] * H + c);
    out[i] = acc;
  }
}

static lz_status gather_sum(lz_op op, float *out, const lz_tensor *src, const lz_tensor *ros,
                            const float *w) {
  const int64_t N = lz_rows(ros), K = lz_cols(ros), H = lz_cols(src);
  if (N * H == 0) return LZ_OK;
  LZ_TRY(check_rows(op, ros, "row_of_slot", N * K, "R, the permuted rows"));
  const int32_t *rows = (const int32_t *)ros->data;
  const unsigned blocks = lz_cu_blocks(N * H, THREADS);
  if (src->dtype == LZ_BF16)
    gather_sum_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
        out, (const __nv_bfloat16 *)src->data, rows, w, N, K, H);
  else
    gather_sum_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(out, (const float *)src->data, rows,
                                                             w, N, K, H);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_moe_permute_backward(const lz_op_args *a) {
  return gather_sum(LZ_OP_MOE_PERMUTE_BACKWARD, (float *)a->t[0]->data, a->t[1], a->t[2], NULL);
}

// ----------------------------------------------------------------- combine

lz_status lz_cu_moe_combine_forward(const lz_op_args *a) {
  return gather_sum(LZ_OP_MOE_COMBINE_FORWARD, (float *)a->t[0]->data, a->t[1], a->t[3],
                    (const float *)a->t[2]->data);
}

template <typename T>
__global__ void combine_dy_kernel(T *dy, const float *dout, const float *w, const int32_t *rows,
                                  int64_t N, int64_t K, int64_t H) {
  const int64_t n = N * K * H;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t s = i / H, c = i % H;
    store(dy, (int64_t)rows[s] * H + c, w[s] * dout[s / K * H + c]);
  }
}

// One warp per slot (grid-stride): dout row . y row, lanes striding the
// columns, then a fixed butterfly.
template <typename T>
__global__ void combine_dw_kernel(float *dw, const float *dout, const T *y, const int32_t *rows,
                                  int64_t N, int64_t K, int64_t H) {
  const int lane = threadIdx.x % WARP;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / WARP;
  for (int64_t s = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / WARP; s < N * K;
       s += warps) {
    const float *d = dout + s / K * H;
    const int64_t r = rows[s];
    float acc = 0.0f;
    for (int64_t c = lane; c < H; c += WARP) acc += d[c] * load(y, r * H + c);
    for (int o = WARP / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) dw[s] = acc;
  }
}

lz_status lz_cu_moe_combine_backward(const lz_op_args *a) {
  const lz_tensor *dy = a->t[0], *dw = a->t[1], *y = a->t[3], *ros = a->t[5];
  const int64_t N = lz_rows(ros), K = lz_cols(ros), H = lz_cols(y);
  if (N * K == 0) return LZ_OK;
  LZ_TRY(check_rows(LZ_OP_MOE_COMBINE_BACKWARD, ros, "row_of_slot", N * K,
                    "R, the rows of y"));
  const float *dout = (const float *)a->t[2]->data, *w = (const float *)a->t[4]->data;
  const int32_t *rows = (const int32_t *)ros->data;
  if (dy && H > 0) {
    const unsigned blocks = lz_cu_blocks(N * K * H, THREADS);
    if (dy->dtype == LZ_BF16)
      combine_dy_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>((__nv_bfloat16 *)dy->data, dout, w,
                                                               rows, N, K, H);
    else
      combine_dy_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>((float *)dy->data, dout, w, rows,
                                                               N, K, H);
    CUDA_LAUNCH_CHECK();
  }
  if (dw) {
    const unsigned blocks = lz_cu_blocks(N * K * WARP, THREADS);
    if (y->dtype == LZ_BF16)
      combine_dw_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
          (float *)dw->data, dout, (const __nv_bfloat16 *)y->data, rows, N, K, H);
    else
      combine_dw_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
          (float *)dw->data, dout, (const float *)y->data, rows, N, K, H);
    CUDA_LAUNCH_CHECK();
  }
  return LZ_OK;
}

// ------------------------------------------------------------ grouped GEMM

// The offsets on the host, checked as the cpu checks them. Free *out.
static lz_status host_offsets(lz_op op, const lz_op_args *a, const lz_tensor *t, int64_t E,
                              int64_t R, int32_t **out) {
  LZ_TRY(host_i32(t, out));
  const int32_t *off = *out;
  for (int64_t e = 0; e <= E; e++) {
    const int64_t lo = e ? off[e - 1] : 0;
    if (off[e] < lo || off[e] > R) {
      lz_status st = lz_fail(LZ_ERR_INVALID,
                             "%s: offsets[%lld] is %d; offsets must rise from 0 or more to at "
                             "most %lld (the rows of x)",
                             LZ_OP_NAME(op, a), (long long)e, (int)off[e], (long long)R);
      free(*out);
      *out = NULL;
      return st;
    }
  }
  return LZ_OK;
}

// w [E, D, C], or [E, P, D, C] with part a->i[0] of each expert multiplied:
// expert e's matrix starts (e * P + part) * D * C elements in.
static void expert_dims(const lz_op_args *a, const lz_tensor *w, int64_t *E, int64_t *D,
                        int64_t *C, int64_t *first, int64_t *step) {
  const int o = w->ndim == 4;
  const int64_t P = o ? w->shape[1] : 1;
  *E = w->shape[0], *D = w->shape[o + 1], *C = w->shape[o + 2];
  *first = a->i[0] * *D * *C, *step = P * *D * *C;
}

lz_status lz_cu_moe_gemm_forward(const lz_op_args *a) {
  const lz_tensor *y = a->t[0], *x = a->t[1], *w = a->t[2];
  int64_t E, D, C, first, step;
  expert_dims(a, w, &E, &D, &C, &first, &step);
  const int64_t R = lz_rows(x);
  int32_t *off = NULL;
  LZ_TRY(host_offsets(LZ_OP_MOE_GEMM_FORWARD, a, a->t[3], E, R, &off));
  const size_t es = lz_dtype_size(x->dtype);
  lz_status st = LZ_OK;
  for (int64_t e = 0; e < E && st == LZ_OK; e++) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n > 0)
      st = lz_cu_gemm(x->dtype, n, D, C, 0, 1, 1.0f, (const char *)x->data + (size_t)(r0 * C) * es,
                      (const char *)w->data + (size_t)(first + e * step) * es, 0.0f,
                      (float *)y->data + r0 * D);
  }
  free(off);
  return st;
}

lz_status lz_cu_moe_gemm_backward(const lz_op_args *a) {
  const lz_tensor *dx = a->t[0], *dw = a->t[1], *dy = a->t[2], *x = a->t[3], *w = a->t[4];
  int64_t E, D, C, first, step;
  expert_dims(a, w, &E, &D, &C, &first, &step);
  const int64_t R = lz_rows(x);
  int32_t *off = NULL;
  LZ_TRY(host_offsets(LZ_OP_MOE_GEMM_BACKWARD, a, a->t[5], E, R, &off));
  const lz_dtype dt = x->dtype;
  const size_t es = lz_dtype_size(dt);
  const char *xp = (const char *)x->data, *wp = (const char *)w->data;
  const char *dyp = (const char *)dy->data;
  const int write = a->i[1] != 0; // moe_gemm_part_backward_write: dw written
  lz_status st = LZ_OK;
  for (int64_t e = 0; e < E && st == LZ_OK; e++) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0 && dw && write) {
      const cudaError_t z = cudaMemsetAsync((float *)dw->data + first + e * step, 0,
                                            (size_t)(D * C) * sizeof(float), LZ_CU_COMPUTE);
      if (z != cudaSuccess) st = lz_cuda_fail(z, "cudaMemsetAsync", __FILE__, __LINE__);
    }
    if (n == 0) continue;
    if (dx)
      st = lz_cu_gemm(dt, n, C, D, 0, 0, 1.0f, dyp + (size_t)(r0 * D) * es,
                      wp + (size_t)(first + e * step) * es, 0.0f, (float *)dx->data + r0 * C);
    if (dw && st == LZ_OK)
      st = lz_cu_gemm(dt, D, C, n, 1, 0, 1.0f, dyp + (size_t)(r0 * D) * es,
                      xp + (size_t)(r0 * C) * es, write ? 0.0f : 1.0f,
                      (float *)dw->data + first + e * step);
  }
  free(off);
  return st;
}
