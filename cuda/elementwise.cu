// elementwise.cu — flat ops over whole tensors on the device: add, axpy,
// scale, fill, dtype conversion, GELU, SwiGLU, the fused AdamW and Lion
// steps (and the 8-bit one), bf16 stochastic rounding, and the two reductions the engine runs over gradients (squared
// norm, inf/NaN). Same semantics as core/kernels/elementwise.c, core/kernels/gelu.c,
// core/kernels/swiglu.c, core/kernels/softcap.c, core/optim/adamw.c and core/optim/lion.c; tensors are flat arrays (only
// element counts must agree, as the core checked).
#include "lz_cuda.h"
#include "optim/lz_sround.h"  // the stochastic rounding's key and hash

#include <math.h>    // pow, sqrt for AdamW's per-step constants
#include <string.h>  // memcpy of the 8-bit maps

#define THREADS 256

// ------------------------------------------------------------ dtype access

__device__ __forceinline__ float load_as_f32(const void *p, lz_dtype dt, int64_t i) {
  if (dt == LZ_F32) return ((const float *)p)[i];
  if (dt == LZ_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
  return __half2float(((const __half *)p)[i]);
}

__device__ __forceinline__ void store_from_f32(void *p, lz_dtype dt, int64_t i, float v) {
  if (dt == LZ_F32) ((float *)p)[i] = v;
  else if (dt == LZ_BF16) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
  else ((__half *)p)[i] = __float2half_rn(v);
}

#define GRID_STRIDE(i, n)                                                        \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);      \
       i += (int64_t)gridDim.x * blockDim.x)

// --------------------------------------------------- add, axpy, scale, fill

__global__ void add_kernel(float *out, const float *a, const float *b, int64_t n) {
  GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

__global__ void axpy_kernel(float *y, float alpha, const float *x, int64_t n) {
  GRID_STRIDE(i, n) y[i] += alpha * x[i];
}

__global__ void scale_kernel(void *t, lz_dtype dt, float s, int64_t n) {
  GRID_STRIDE(i, n) store_from_f32(t, dt, i, load_as_f32(t, dt, i) * s);
}

__global__ void fill_f32_kernel(float *t, float v, int64_t n) {
  GRID_STRIDE(i, n) t[i] = v;
}

__global__ void fill_u16_kernel(uint16_t *t, uint16_t v, int64_t n) {
  GRID_STRIDE(i, n) t[i] = v;
}

__global__ void convert_kernel(void *dst, lz_dtype ddt, const void *src, lz_dtype sdt,
                               int64_t n) {
  GRID_STRIDE(i, n) store_from_f32(dst, ddt, i, load_as_f32(src, sdt, i));
}

lz_status lz_cu_add(const lz_op_args *a) {
  int64_t n = lz_tensor_numel(a->t[0]);
  if (n == 0) return LZ_OK;
  add_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)a->t[1]->data, (const float *)a->t[2]->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_axpy(const lz_op_args *a) {
  int64_t n = lz_tensor_numel(a->t[0]);
  if (n == 0) return LZ_OK;
  axpy_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, a->f[0], (const float *)a->t[1]->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_scale(const lz_op_args *a) {
  lz_tensor *t = a->t[0];
  int64_t n = lz_tensor_numel(t);
  if (n == 0) return LZ_OK;
  scale_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(t->data, t->dtype,
                                                                        a->f[0], n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_fill(const lz_op_args *a) {
  lz_tensor *t = a->t[0];
  int64_t n = lz_tensor_numel(t);
  if (n == 0) return LZ_OK;
  if (t->dtype == LZ_F32) {
    fill_f32_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)t->data, a->f[0], n);
  } else {
    // One bit pattern, converted by the core's own rounding: the same bits as the cpu.
    uint16_t v = t->dtype == LZ_BF16 ? lz_f32_to_bf16(a->f[0]) : lz_f32_to_f16(a->f[0]);
    fill_u16_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (uint16_t *)t->data, v, n);
  }
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_tensor_copy(const lz_op_args *a) {
  lz_tensor *dst = a->t[0], *src = a->t[1];
  int64_t n = lz_tensor_numel(src);
  if (n == 0) return LZ_OK;
  convert_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      dst->data, dst->dtype, src->data, src->dtype, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// -------------------------------------------------------------------- GELU

#define GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)
#define GELU_CUBIC 0.044715f

__global__ void gelu_forward_kernel(float *out, const float *x, int64_t n) {
  GRID_STRIDE(i, n) {
    float xi = x[i];
    float u = GELU_SCALE * (xi + GELU_CUBIC * xi * xi * xi);
    out[i] = 0.5f * xi * (1.0f + tanhf(u));
  }
}

__global__ void gelu_backward_kernel(float *dx, const float *dy, const float *x, int64_t n) {
  GRID_STRIDE(i, n) {
    float xi = x[i];
    float u = GELU_SCALE * (xi + GELU_CUBIC * xi * xi * xi);
    float t = tanhf(u);
    float du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * xi * xi);
    float grad = 0.5f * (1.0f + t) + 0.5f * xi * (1.0f - t * t) * du;
    dx[i] = grad * dy[i];
  }
}

lz_status lz_cu_gelu_forward(const lz_op_args *a) {
  int64_t n = lz_tensor_numel(a->t[1]);
  if (n == 0) return LZ_OK;
  gelu_forward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)a->t[1]->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_gelu_backward(const lz_op_args *a) {
  int64_t n = lz_tensor_numel(a->t[2]);
  if (n == 0) return LZ_OK;
  gelu_backward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)a->t[1]->data, (const float *)a->t[2]->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ------------------------------------------------------------------ SwiGLU

// bf16 inputs are widened exactly, so a bf16 call computes what the f32
// call computes on the widened values (as core/kernels/swiglu.c does).
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

// out = silu(gate) * up, silu(g) = g / (1 + e^-g). out may be gate or up
// (f32): each element is read before it is written. A bf16 out (feeding a
// bf16 GEMM) is the f32 value rounded to nearest even, as a conversion would.
template <typename T>
__global__ void swiglu_forward_kernel(void *out, lz_dtype odt, const T *gate, const T *up,
                                      int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = widen(gate[i]);
    store_from_f32(out, odt, i, g / (1.0f + expf(-g)) * widen(up[i]));
  }
}

// With s = sigmoid(g): d silu / dg = s (1 + g (1 - s)), as torch's silu
// backward. dgate and dup may each be dout, gate or up (f32).
template <typename T>
__global__ void swiglu_backward_kernel(void *dgate, void *dup, lz_dtype odt, const T *dout,
                                       const T *gate, const T *up, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = widen(gate[i]), u = widen(up[i]), d = widen(dout[i]);
    const float s = 1.0f / (1.0f + expf(-g));
    store_from_f32(dgate, odt, i, d * u * (s * (1.0f + g * (1.0f - s))));
    store_from_f32(dup, odt, i, d * (g * s));
  }
}

// The packed form (lz_swiglu_packed_*): element i of out is row i / H's
// gate at 2H (i / H) + i % H, its up H further; dgate likewise.
template <typename T>
__global__ void swiglu_packed_forward_kernel(void *out, lz_dtype odt, const T *gu, int64_t H,
                                             int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t at = 2 * H * (i / H) + i % H;
    const float g = widen(gu[at]);
    store_from_f32(out, odt, i, g / (1.0f + expf(-g)) * widen(gu[at + H]));
  }
}

template <typename T>
__global__ void swiglu_packed_backward_kernel(void *dgu, lz_dtype odt, const T *dout, const T *gu,
                                              int64_t H, int64_t n) {
  GRID_STRIDE(i, n) {
    const int64_t at = 2 * H * (i / H) + i % H;
    const float g = widen(gu[at]), u = widen(gu[at + H]), d = widen(dout[i]);
    const float s = 1.0f / (1.0f + expf(-g));
    store_from_f32(dgu, odt, at, d * u * (s * (1.0f + g * (1.0f - s))));
    store_from_f32(dgu, odt, at + H, d * (g * s));
  }
}

static lz_status swiglu_packed(const lz_op_args *a, bool backward) {
  const lz_tensor *gu = backward ? a->t[3] : a->t[1];
  const int64_t H = a->i[0], n = H ? lz_tensor_numel(gu) / 2 : 0;
  if (n == 0) return LZ_OK;
  const unsigned blocks = lz_cu_blocks(n, THREADS);
  void *o = a->t[0]->data;
  const lz_dtype odt = a->t[0]->dtype;
  if (gu->dtype == LZ_BF16) {
    const __nv_bfloat16 *g = (const __nv_bfloat16 *)gu->data;
    if (backward)
      swiglu_packed_backward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
          o, odt, (const __nv_bfloat16 *)a->t[2]->data, g, H, n);
    else
      swiglu_packed_forward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
          o, odt, g, H, n);
  } else {
    const float *g = (const float *)gu->data;
    if (backward)
      swiglu_packed_backward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
          o, odt, (const float *)a->t[2]->data, g, H, n);
    else
      swiglu_packed_forward_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(
          o, odt, g, H, n);
  }
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_swiglu_forward(const lz_op_args *a) {
  const lz_tensor *gate = a->t[1], *up = a->t[2];
  if (!up) return swiglu_packed(a, false);
  int64_t n = lz_tensor_numel(gate);
  if (n == 0) return LZ_OK;
  void *out = a->t[0]->data;
  const lz_dtype odt = a->t[0]->dtype;
  if (gate->dtype == LZ_BF16)
    swiglu_forward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        out, odt, (const __nv_bfloat16 *)gate->data, (const __nv_bfloat16 *)up->data, n);
  else
    swiglu_forward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        out, odt, (const float *)gate->data, (const float *)up->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_swiglu_backward(const lz_op_args *a) {
  const lz_tensor *dout = a->t[2], *gate = a->t[3], *up = a->t[4];
  if (!up) return swiglu_packed(a, true);
  int64_t n = lz_tensor_numel(gate);
  if (n == 0) return LZ_OK;
  void *dg = a->t[0]->data, *du = a->t[1]->data;
  const lz_dtype odt = a->t[0]->dtype;
  if (gate->dtype == LZ_BF16)
    swiglu_backward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        dg, du, odt, (const __nv_bfloat16 *)dout->data, (const __nv_bfloat16 *)gate->data,
        (const __nv_bfloat16 *)up->data, n);
  else
    swiglu_backward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        dg, du, odt, (const float *)dout->data, (const float *)gate->data, (const float *)up->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ------------------------------------------------------------------- GeGLU

// Gemma's gated activation: out = gelu(gate) * up, GELU with tanh as
// gelu_forward_kernel computes it; shapes and aliasing as SwiGLU's.
__device__ __forceinline__ float gelu_tanh(float x) {
  float u = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float gelu_tanh_grad(float x) {
  float u = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
  float t = tanhf(u);
  float du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

template <typename T>
__global__ void geglu_forward_kernel(void *out, lz_dtype odt, const T *gate, const T *up,
                                     int64_t n) {
  GRID_STRIDE(i, n) { store_from_f32(out, odt, i, gelu_tanh(widen(gate[i])) * widen(up[i])); }
}

template <typename T>
__global__ void geglu_backward_kernel(void *dgate, void *dup, lz_dtype odt, const T *dout,
                                      const T *gate, const T *up, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = widen(gate[i]), u = widen(up[i]), d = widen(dout[i]);
    store_from_f32(dgate, odt, i, d * u * gelu_tanh_grad(g));
    store_from_f32(dup, odt, i, d * gelu_tanh(g));
  }
}

lz_status lz_cu_geglu_forward(const lz_op_args *a) {
  const lz_tensor *gate = a->t[1], *up = a->t[2];
  int64_t n = lz_tensor_numel(gate);
  if (n == 0) return LZ_OK;
  void *out = a->t[0]->data;
  const lz_dtype odt = a->t[0]->dtype;
  if (gate->dtype == LZ_BF16)
    geglu_forward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        out, odt, (const __nv_bfloat16 *)gate->data, (const __nv_bfloat16 *)up->data, n);
  else
    geglu_forward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        out, odt, (const float *)gate->data, (const float *)up->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_geglu_backward(const lz_op_args *a) {
  const lz_tensor *dout = a->t[2], *gate = a->t[3], *up = a->t[4];
  int64_t n = lz_tensor_numel(gate);
  if (n == 0) return LZ_OK;
  void *dg = a->t[0]->data, *du = a->t[1]->data;
  const lz_dtype odt = a->t[0]->dtype;
  if (gate->dtype == LZ_BF16)
    geglu_backward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        dg, du, odt, (const __nv_bfloat16 *)dout->data, (const __nv_bfloat16 *)gate->data,
        (const __nv_bfloat16 *)up->data, n);
  else
    geglu_backward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        dg, du, odt, (const float *)dout->data, (const float *)gate->data, (const float *)up->data, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ----------------------------------------------------------------- soft-cap

// out = cap * tanh(x / cap), as core/kernels/softcap.c; out may be x.
__global__ void softcap_forward_kernel(float *out, const float *x, int64_t n, float cap) {
  GRID_STRIDE(i, n) { out[i] = tanhf(x[i] / cap) * cap; }
}

lz_status lz_cu_softcap_forward(const lz_op_args *a) {
  int64_t n = lz_tensor_numel(a->t[1]);
  if (n == 0) return LZ_OK;
  softcap_forward_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)a->t[1]->data, n, a->f[0]);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ------------------------------------------------------------------- AdamW

struct adamw_consts {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_bc2_sqrt, eps,
      grad_scale;
};

// m and v f32, or bf16 (mdt): widened, updated, rounded to nearest even.
__global__ void adamw_kernel(float *p, const float *grad, void *m, void *v, lz_dtype mdt,
                             void *working, lz_dtype wdt, adamw_consts k, int64_t n) {
  GRID_STRIDE(i, n) {
    float g = grad[i] * k.grad_scale;
    float mi = k.beta1 * load_as_f32(m, mdt, i) + k.one_minus_beta1 * g;
    float vi = k.beta2 * load_as_f32(v, mdt, i) + k.one_minus_beta2 * g * g;
    float denom = sqrtf(vi) * k.inv_bc2_sqrt + k.eps;
    float pi = p[i] * k.decay - k.step_size * mi / denom;
    store_from_f32(m, mdt, i, mi);
    store_from_f32(v, mdt, i, vi);
    p[i] = pi;
    if (working) store_from_f32(working, wdt, i, pi);
  }
}

lz_status lz_cu_adamw_step(const lz_op_args *a) {
  const lz_adamw_args *args = a->adamw;
  int64_t n = lz_tensor_numel(a->t[0]);
  if (n == 0) return LZ_OK;
  // The per-step constants exactly as core/optim/adamw.c works them out.
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2;
  const double bc1 = 1.0 - pow(b1, (double)args->step);
  const double bc2 = 1.0 - pow(b2, (double)args->step);
  adamw_consts k;
  k.decay = (float)(1.0 - lr * args->weight_decay);
  k.beta1 = args->beta1;
  k.beta2 = args->beta2;
  k.one_minus_beta1 = (float)(1.0 - b1);
  k.one_minus_beta2 = (float)(1.0 - b2);
  k.step_size = (float)(lr / bc1);
  k.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
  k.eps = args->eps;
  k.grad_scale = args->grad_scale;
  lz_tensor *w = a->t[4];
  adamw_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)a->t[1]->data, a->t[2]->data, a->t[3]->data,
      a->t[2]->dtype, w ? w->data : NULL, w ? w->dtype : LZ_F32, k, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// -------------------------------------------------------------------- Lion

struct lion_consts {
  float decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, grad_scale;
};

// As core/optim/lion.c: sign() turns a last-place difference of c into a step of
// 2 lr, so each product and sum is rounded on its own (the _rn intrinsics
// are never contracted into an FMA). The result is then bitwise the cpu's.
// The sign is torch.sign's: +1, -1, or 0 for zero and NaN.
__global__ void lion_kernel(float *p, const float *grad, float *m, void *working, lz_dtype wdt,
                            lion_consts k, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = __fmul_rn(grad[i], k.grad_scale), mi = m[i];
    const float c = __fadd_rn(__fmul_rn(k.beta1, mi), __fmul_rn(k.one_minus_beta1, g));
    const float sign = (float)(c > 0.0f) - (float)(c < 0.0f);
    const float pi = __fsub_rn(__fmul_rn(p[i], k.decay), __fmul_rn(k.lr, sign));
    p[i] = pi;
    m[i] = __fadd_rn(__fmul_rn(k.beta2, mi), __fmul_rn(k.one_minus_beta2, g));
    if (working) store_from_f32(working, wdt, i, pi);
  }
}

lz_status lz_cu_lion_step(const lz_op_args *a) {
  const lz_lion_args *args = a->lion;
  int64_t n = lz_tensor_numel(a->t[0]);
  if (n == 0) return LZ_OK;
  // The per-step constants exactly as core/optim/lion.c works them out.
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2;
  lion_consts k;
  k.decay = (float)(1.0 - lr * args->weight_decay);
  k.lr = args->lr;
  k.beta1 = args->beta1;
  k.beta2 = args->beta2;
  k.one_minus_beta1 = (float)(1.0 - b1);
  k.one_minus_beta2 = (float)(1.0 - b2);
  k.grad_scale = args->grad_scale;
  lz_tensor *w = a->t[3];
  lion_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (float *)a->t[0]->data, (const float *)a->t[1]->data, (float *)a->t[2]->data,
      w ? w->data : NULL, w ? w->dtype : LZ_F32, k, n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ------------------------------------------------------------- 8-bit AdamW

// As core/optim/adamw8bit.c, op for op in the _rn intrinsics (never
// contracted, so the bits are the cpu's): one thread block of
// LZ_ADAMW8BIT_BLOCK threads per block of elements, which dequantises,
// updates, takes the new absmax (from 0; fmaxf skips NaN, as the cpu's does) and
// requantises with the cpu's cells (lz_adamw8bit_cells: bitsandbytes'
// index, which is not always the nearest entry), copied to the device once.
struct a8_consts {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, decay, neg_step, c2, eps, grad_scale;
};

__constant__ float a8_maps[2][256];  // [0] signed (m), [1] unsigned (v)

struct a8_cells {
  const uint32_t *m, *v;  // the signed map's cells, the unsigned one's (device)
  uint32_t lo, one, side;
};

// core/optim/quant8.c's index_of, on the device.
__device__ __forceinline__ unsigned char a8_index(const uint32_t *cells, const a8_cells &c,
                                                  float z) {
  const uint32_t u = __float_as_uint(z);
  uint32_t a = u & 0x7fffffffu;
  a = a < c.lo ? c.lo : a > c.one ? c.one : a;
  const uint32_t e = __ldg(cells + ((a - c.lo) >> 16) + (u >> 31) * c.side);
  const unsigned char i = (unsigned char)((a & 0xffffu) >= (e & 0xffffu) ? e >> 24 : e >> 16);
  return z == z ? i : 0;
}

// The cells on the current device, copied at its first 8-bit step.
static lz_status a8_device_cells(a8_cells *out) {
  static uint32_t *copies[64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return lz_fail(LZ_ERR_INVALID, "adamw8bit_step: device %d", dev);
  uint32_t bounds[3];
  const uint32_t *m = lz_adamw8bit_cells(1, bounds), *v = lz_adamw8bit_cells(0, bounds);
  const size_t n = 2 * (size_t)bounds[2];
  if (!copies[dev]) {
    uint32_t *d = NULL;
    CUDA_CHECK(cudaMalloc((void **)&d, 2 * n * sizeof(uint32_t)));
    CUDA_CHECK(cudaMemcpy(d, m, n * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d + n, v, n * sizeof(uint32_t), cudaMemcpyHostToDevice));
    copies[dev] = d;
  }
  *out = a8_cells{copies[dev], copies[dev] + n, bounds[0], bounds[1], bounds[2]};
  return LZ_OK;
}

__global__ void adamw8bit_kernel(float *p, const float *grad, unsigned char *qm, unsigned char *qv,
                                 float *absmax_m, float *absmax_v, void *working, lz_dtype wdt,
                                 a8_consts k, a8_cells cells, int64_t n) {
  __shared__ float red_m[LZ_ADAMW8BIT_BLOCK], red_v[LZ_ADAMW8BIT_BLOCK];
  const int64_t b = blockIdx.x, i = b * LZ_ADAMW8BIT_BLOCK + threadIdx.x;
  float mi = 0.0f, vi = 0.0f;
  const bool in = i < n;
  if (in) {
    const float g = __fmul_rn(grad[i], k.grad_scale);
    const float m0 = __fmul_rn(__fmul_rn(a8_maps[0][qm[i]], absmax_m[b]), k.beta1);
    const float v0 = __fmul_rn(__fmul_rn(a8_maps[1][qv[i]], absmax_v[b]), k.beta2);
    mi = __fmaf_rn(g, k.one_minus_beta1, m0);
    vi = __fmaf_rn(__fmul_rn(k.one_minus_beta2, g), g, v0);
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.c2), k.eps);
    const float pi =
        __fadd_rn(__fmul_rn(p[i], k.decay), __fdiv_rn(__fmul_rn(k.neg_step, mi), denom));
    p[i] = pi;
    if (working) store_from_f32(working, wdt, i, pi);
  }
  red_m[threadIdx.x] = in ? fabsf(mi) : 0.0f;
  red_v[threadIdx.x] = in ? fabsf(vi) : 0.0f;
  __syncthreads();
  for (int w = LZ_ADAMW8BIT_BLOCK / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) {
      red_m[threadIdx.x] = fmaxf(red_m[threadIdx.x], red_m[threadIdx.x + w]);
      red_v[threadIdx.x] = fmaxf(red_v[threadIdx.x], red_v[threadIdx.x + w]);
    }
    __syncthreads();
  }
  const float am = red_m[0], av = red_v[0];
  if (threadIdx.x == 0) absmax_m[b] = am, absmax_v[b] = av;
  if (in) {
    qm[i] = a8_index(cells.m, cells, __fdiv_rn(mi, am));
    qv[i] = a8_index(cells.v, cells, __fdiv_rn(vi, av));
  }
}

__global__ void adamw8bit_f32_kernel(float *p, const float *grad, float *m, float *v,
                                     void *working, lz_dtype wdt, a8_consts k, int64_t n) {
  GRID_STRIDE(i, n) {
    const float g = __fmul_rn(grad[i], k.grad_scale);
    const float mi = __fmaf_rn(g, k.one_minus_beta1, __fmul_rn(m[i], k.beta1));
    const float vi = __fmaf_rn(__fmul_rn(k.one_minus_beta2, g), g, __fmul_rn(v[i], k.beta2));
    const float u = __fdiv_rn(mi, __fadd_rn(__fsqrt_rn(vi), k.eps));
    const float pi = __fmaf_rn(u, k.neg_step, __fmul_rn(p[i], k.decay));
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (working) store_from_f32(working, wdt, i, pi);
  }
}

lz_status lz_cu_adamw8bit_step(const lz_op_args *a) {
  const lz_adamw_args *args = a->adamw;
  const int64_t n = lz_tensor_numel(a->t[0]);
  if (n == 0) return LZ_OK;
  const bool eight = a->t[2]->dtype == LZ_U8;
  // The per-step constants exactly as core/optim/adamw8bit.c works them out.
  const double lr = args->lr, b1 = args->beta1, b2 = args->beta2, wd = args->weight_decay;
  const double c1 = 1.0 - pow(b1, (double)args->step);
  const double c2 = sqrt(1.0 - pow(b2, (double)args->step));
  a8_consts k;
  k.beta1 = args->beta1;
  k.beta2 = args->beta2;
  k.one_minus_beta1 = (float)(1.0 - b1);
  k.one_minus_beta2 = (float)(1.0 - b2);
  k.decay = wd > 0.0 ? (float)(1.0 - lr * wd) : 1.0f;
  k.neg_step = eight ? (float)(-lr / c1) : (float)(-lr * c2 / c1);
  k.c2 = (float)c2;
  k.eps = eight ? args->eps : (float)((double)args->eps * c2);
  k.grad_scale = args->grad_scale;
  lz_tensor *w = a->t[6];
  void *wd_ = w ? w->data : NULL;
  const lz_dtype wdt = w ? w->dtype : LZ_F32;
  float *p = (float *)a->t[0]->data;
  const float *g = (const float *)a->t[1]->data;
  if (eight) {
    float maps[2][256];
    memcpy(maps[0], lz_adamw8bit_map(1), sizeof maps[0]);
    memcpy(maps[1], lz_adamw8bit_map(0), sizeof maps[1]);
    CUDA_CHECK(cudaMemcpyToSymbolAsync(a8_maps, maps, sizeof maps, 0, cudaMemcpyHostToDevice,
                                       LZ_CU_COMPUTE));
    a8_cells cells;
    LZ_TRY(a8_device_cells(&cells));
    const unsigned blocks = (unsigned)lz_adamw8bit_blocks(n);
    adamw8bit_kernel<<<blocks, LZ_ADAMW8BIT_BLOCK, 0, LZ_CU_COMPUTE>>>(
        p, g, (unsigned char *)a->t[2]->data, (unsigned char *)a->t[3]->data,
        (float *)a->t[4]->data, (float *)a->t[5]->data, wd_, wdt, k, cells, n);
  } else {
    adamw8bit_f32_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        p, g, (float *)a->t[2]->data, (float *)a->t[3]->data, wd_, wdt, k, n);
  }
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

// ------------------------------------------------------ sq_norm, inf/NaN

// sq_norm: each block sums fixed SQ_CHUNK-element chunks in double (a
// tree inside the block, so its order is fixed), one partial per chunk; a
// single block then adds the partials in index order. The same bits on
// every run (not the cpu's bits: the order differs).
#define SQ_CHUNK 4096

__global__ void sq_partials_kernel(const void *x, lz_dtype dt, int64_t n, double *partials,
                                   int64_t n_chunks) {
  __shared__ double sh[THREADS];
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    int64_t i0 = c * SQ_CHUNK, i1 = i0 + SQ_CHUNK < n ? i0 + SQ_CHUNK : n;
    double s = 0.0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += THREADS) {
      double v = load_as_f32(x, dt, i);
      s += v * v;
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = THREADS / 2; w > 0; w >>= 1) {
      if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
      __syncthreads();
    }
    if (threadIdx.x == 0) partials[c] = sh[0];
    __syncthreads();
  }
}

__global__ void sum_partials_kernel(const double *partials, int64_t n, double *out) {
  __shared__ double sh[THREADS];
  // Each thread sums a contiguous run in order, then a fixed tree.
  int64_t per = (n + THREADS - 1) / THREADS;
  int64_t i0 = threadIdx.x * per, i1 = i0 + per < n ? i0 + per : n;
  double s = 0.0;
  for (int64_t i = i0; i < i1; i++) s += partials[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = THREADS / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0];
}

lz_status lz_cu_sq_norm(const lz_op_args *a) {
  const lz_tensor *t = a->t[0];
  int64_t n = lz_tensor_numel(t);
  *a->out_f64 = 0.0;
  if (n == 0) return LZ_OK;
  int64_t n_chunks = (n + SQ_CHUNK - 1) / SQ_CHUNK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, (size_t)(n_chunks + 1) * sizeof(double)));
  double *partials = (double *)ws, *result = partials + n_chunks;
  unsigned blocks = (unsigned)(n_chunks < 65535 * 4 ? n_chunks : 65535 * 4);
  sq_partials_kernel<<<blocks, THREADS, 0, LZ_CU_COMPUTE>>>(t->data, t->dtype, n, partials,
                                                            n_chunks);
  CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<1, THREADS, 0, LZ_CU_COMPUTE>>>(partials, n_chunks, result);
  CUDA_LAUNCH_CHECK();
  double host = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof host, cudaMemcpyDeviceToHost, LZ_CU_COMPUTE));
  CUDA_CHECK(cudaStreamSynchronize(LZ_CU_COMPUTE));
  *a->out_f64 = host;
  return LZ_OK;
}

// y += x (or y = x), then sq_norm of y: two launches here (the cpu's one
// pass is a cache's matter; the bits are axpy's and sq_norm's either way).
lz_status lz_cu_add_sq_norm(const lz_op_args *a) {
  lz_tensor *y = a->t[0];
  int64_t n = lz_tensor_numel(y);
  if (n > 0 && a->i[0]) {
    CUDA_CHECK(cudaMemcpyAsync(y->data, a->t[1]->data, (size_t)n * sizeof(float),
                               cudaMemcpyDeviceToDevice, LZ_CU_COMPUTE));
  } else if (n > 0) {
    axpy_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
        (float *)y->data, 1.0f, (const float *)a->t[1]->data, n);
    CUDA_LAUNCH_CHECK();
  }
  lz_op_args s = {};
  s.t[0] = y;
  s.out_f64 = a->out_f64;
  return lz_cu_sq_norm(&s);
}

// sq_norm with the block partials a kernel took: the cuda kernels take
// none (their sums run in chunks of their own), so the entries are all NaN
// and the norm is sq_norm's; each is set back to NaN all the same.
lz_status lz_cu_sq_norm_blocks(const lz_op_args *a) {
  const int64_t n = lz_tensor_numel(a->t[0]), nb = (n + 4095) / 4096;
  for (int64_t k = 0; k < nb; k++) a->blocks[k] = NAN;
  lz_op_args s = {};
  s.t[0] = a->t[0];
  s.out_f64 = a->out_f64;
  return lz_cu_sq_norm(&s);
}

// An exponent field of all ones is Inf or NaN, whatever the mantissa.
__global__ void inf_nan_kernel(const void *x, lz_dtype dt, int64_t n, int *found) {
  int f = 0;
  GRID_STRIDE(i, n) {
    if (dt == LZ_F32) f |= (((const uint32_t *)x)[i] & 0x7f800000u) == 0x7f800000u;
    else {
      uint16_t mask = dt == LZ_BF16 ? 0x7f80u : 0x7c00u;
      f |= (((const uint16_t *)x)[i] & mask) == mask;
    }
  }
  if (__syncthreads_or(f) && threadIdx.x == 0) *found = 1;
}

lz_status lz_cu_has_inf_nan(const lz_op_args *a) {
  const lz_tensor *t = a->t[0];
  int64_t n = lz_tensor_numel(t);
  *a->out_int = 0;
  if (n == 0) return LZ_OK;
  void *ws;
  LZ_TRY(lz_cu_scratch(&ws, sizeof(int)));
  int *found = (int *)ws;
  CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(int), LZ_CU_COMPUTE));
  inf_nan_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(t->data, t->dtype, n,
                                                                          found);
  CUDA_LAUNCH_CHECK();
  int host = 0;
  CUDA_CHECK(cudaMemcpyAsync(&host, found, sizeof host, cudaMemcpyDeviceToHost, LZ_CU_COMPUTE));
  CUDA_CHECK(cudaStreamSynchronize(LZ_CU_COMPUTE));
  *a->out_int = host != 0;
  return LZ_OK;
}

// ----------------------------------------------------- stochastic rounding

// The cpu's bits: the same key and hash (core/optim/lz_sround.h).
__global__ void bf16_round_stochastic_kernel(uint16_t *dst, const float *src, lz_sround_key k,
                                             int64_t index, int64_t n) {
  GRID_STRIDE(i, n) dst[i] = lz_sround_bf16(__float_as_uint(src[i]), lz_sround_bits(k, index + i));
}

lz_status lz_cu_bf16_round_stochastic(const lz_op_args *a) {
  const int64_t n = lz_tensor_numel(a->t[1]);
  if (n == 0) return LZ_OK;
  const lz_sround_key k = lz_sround_key_of((uint64_t)a->i[0], (uint64_t)a->i[1]);
  bf16_round_stochastic_kernel<<<lz_cu_blocks(n, THREADS), THREADS, 0, LZ_CU_COMPUTE>>>(
      (uint16_t *)a->t[0]->data, (const float *)a->t[1]->data, k, a->i[2], n);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}
