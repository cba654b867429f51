// gemm.cu — matmul and the linear layer on the device through cuBLASLt.
//
// luazero's tensors are row-major, cuBLASLt's matrices column-major: a
// row-major [m, n] matrix is a column-major [n, m] one, so C = op(A) op(B)
// is computed as C^T = op(B)^T op(A)^T with the operands swapped and the
// transposes kept. Inputs f32 (fp32 compute, no TF32 unless LZ_CUDA_TF32=1)
// or bf16 (fp32 accumulation); the output is always f32, as on the cpu.
// linear_forward folds its bias into the GEMM (cuBLASLt's bias epilogue);
// linear_backward's bias gradient is a column sum of dy in a fixed order.
#include "lz_cuda.h"

#include <stdlib.h>  // getenv

// One GEMM: row-major c[batch][m][n] = alpha op(a) op(b) + beta c, b shared
// across the batch when b_shared. bias (length n, f32) may be NULL.
static lz_status gemm(lz_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k, int ta,
                      int tb, int b_shared, float alpha, const void *a, const void *b,
                      float beta, float *c, const float *bias) {
  if (batch == 0 || m == 0 || n == 0) return LZ_OK;
  cudaDataType_t in_t = dt == LZ_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  static int tf32 = -1;
  if (tf32 < 0) {
    const char *e = getenv("LZ_CUDA_TF32");
    tf32 = e && *e == '1';
  }
  cublasComputeType_t compute =
      (dt == LZ_F32 && tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

  // Column-major view: D'[n, m] = op(B') op(A'), B' = b's memory, A' = a's.
  const int64_t lda_b = tb ? k : n;  // b row-major [k, n] (or [n, k] transposed)
  const int64_t lda_a = ta ? m : k;  // a row-major [m, k] (or [k, m] transposed)
  cublasOperation_t op1 = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op2 = ta ? CUBLAS_OP_T : CUBLAS_OP_N;

  cublasLtMatmulDesc_t desc = NULL;
  cublasLtMatrixLayout_t l1 = NULL, l2 = NULL, lc = NULL;
  cublasLtMatmulPreference_t pref = NULL;
  lz_status st = LZ_OK;
#define LT(call)                                                    \
  do {                                                              \
    cublasStatus_t s_ = (call);                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                              \
      st = lz_cublas_fail(s_, #call, __FILE__, __LINE__);           \
      goto done;                                                    \
    }                                                               \
  } while (0)
  {
    LT(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op1, sizeof op1));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op2, sizeof op2));
    if (bias) {
      cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      cudaDataType_t bias_t = CUDA_R_32F;
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                        sizeof bias));
      LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_t,
                                        sizeof bias_t));
    }
    // Stored shapes (rows x cols, column-major) before the op.
    LT(cublasLtMatrixLayoutCreate(&l1, in_t, tb ? k : n, tb ? n : k, lda_b));
    LT(cublasLtMatrixLayoutCreate(&l2, in_t, ta ? m : k, ta ? k : m, lda_a));
    LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, n, m, n));
    if (batch > 1) {
      int32_t bc = (int32_t)batch;
      int64_t s1 = b_shared ? 0 : k * n, s2 = m * k, sc = m * n;
      LT(cublasLtMatrixLayoutSetAttribute(l1, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      LT(cublasLtMatrixLayoutSetAttribute(l1, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s1,
                                          sizeof s1));
      LT(cublasLtMatrixLayoutSetAttribute(l2, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      LT(cublasLtMatrixLayoutSetAttribute(l2, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s2,
                                          sizeof s2));
      LT(cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      LT(cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sc,
                                          sizeof sc));
    }
    LT(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = LZ_CU_LT_WORKSPACE;
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof ws));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(lz_cu_lt, desc, l1, l2, lc, lc, pref, 1, &heur, &found));
    if (found == 0) {
      st = lz_fail(LZ_ERR_UNSUPPORTED,
                   "cublas: no cuBLASLt algorithm for %s [%lld x %lld x %lld]%s; not supported "
                   "on cuda yet with these shapes",
                   lz_dtype_name(dt), (long long)m, (long long)n, (long long)k,
                   bias ? " with bias" : "");
      goto done;
    }
    LT(cublasLtMatmul(lz_cu_lt, desc, &alpha, b, l1, a, l2, &beta, c, lc, c, lc, &heur.algo,
                      lz_cu_lt_workspace, LZ_CU_LT_WORKSPACE, LZ_CU_COMPUTE));
  }
done:
#undef LT
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (l2) cublasLtMatrixLayoutDestroy(l2);
  if (l1) cublasLtMatrixLayoutDestroy(l1);
  if (desc) cublasLtMatmulDescDestroy(desc);
  return st;
}

// k == 0: op(a) op(b) is zero, so c = beta c (cuBLASLt wants k >= 1).
__global__ void scale_c_kernel(float *c, float beta, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    c[i] = beta == 0.0f ? 0.0f : beta * c[i];
}

static lz_status gemm_or_scale(lz_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k,
                               int ta, int tb, int b_shared, float alpha, const void *a,
                               const void *b, float beta, float *c, const float *bias) {
  if (k > 0 || batch * m * n == 0)
    return gemm(dt, batch, m, n, k, ta, tb, b_shared, alpha, a, b, beta, c, bias);
  int64_t total = batch * m * n;
  scale_c_kernel<<<lz_cu_blocks(total, 256), 256, 0, LZ_CU_COMPUTE>>>(c, beta, total);
  CUDA_LAUNCH_CHECK();
  return LZ_OK;
}

lz_status lz_cu_gemm(lz_dtype dt, int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha,
                     const void *a, const void *b, float beta, float *c) {
  return gemm_or_scale(dt, 1, m, n, k, ta, tb, 0, alpha, a, b, beta, c, NULL);
}

lz_status lz_cu_matmul(const lz_op_args *args) {
  lz_tensor *c = args->t[0];
  const lz_tensor *a = args->t[1], *b = args->t[2];
  int ta = args->i[0] != 0, tb = args->i[1] != 0;
  int batched = a->ndim == 3;
  int64_t batch = batched ? a->shape[0] : 1;
  int o = batched, ob = b->ndim == 3;
  int64_t m = ta ? a->shape[o + 1] : a->shape[o];
  int64_t k = ta ? a->shape[o] : a->shape[o + 1];
  int64_t n = tb ? b->shape[ob] : b->shape[ob + 1];
  return gemm_or_scale(a->dtype, batch, m, n, k, ta, tb, batched && b->ndim == 2, args->f[0],
                       a->data, b->data, args->f[1], (float *)c->data, NULL);
}

// Fills each row of y [rows, n] with bias: the fallback if a bias epilogue
// is refused, and the k == 0 case.
__global__ void bias_rows_kernel(float *y, const float *bias, int64_t rows, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = bias[i % n];
}

lz_status lz_cu_linear_forward(const lz_op_args *args) {
  lz_tensor *out = args->t[0];
  const lz_tensor *x = args->t[1], *w = args->t[2], *bias = args->t[3];
  int64_t in = w->shape[1], outc = w->shape[0], rows = lz_rows(x);
  if (rows == 0 || outc == 0) return LZ_OK;
  if (bias && in > 0) {
    lz_status st = gemm(x->dtype, 1, rows, outc, in, 0, 1, 0, 1.0f, x->data, w->data, 0.0f,
                        (float *)out->data, (const float *)bias->data);
    if (st != LZ_ERR_UNSUPPORTED) return st;  // else: bias as a fill, then beta = 1
  }
  float beta = 0.0f;
  if (bias) {
    bias_rows_kernel<<<lz_cu_blocks(rows * outc, 256), 256, 0, LZ_CU_COMPUTE>>>(
        (float *)out->data, (const float *)bias->data, rows, outc);
    CUDA_LAUNCH_CHECK();
    beta = 1.0f;
  }
  return gemm_or_scale(x->dtype, 1, rows, outc, in, 0, 1, 0, 1.0f, x->data, w->data, beta,
                       (float *)out->data, NULL);
}

// db[j] += sum over rows of dy[r, j] (write: db[j] = the sum, never -0 as
// it starts from +0): one thread per column, rows in order (the cpu's
// order, so the same bits for f32).
__global__ void bias_grad_kernel(float *db, const void *dy, lz_dtype dt, int64_t rows,
                                 int64_t n, int write) {
  int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float acc = 0.0f;
  if (dt == LZ_BF16) {
    const __nv_bfloat16 *p = (const __nv_bfloat16 *)dy;
    for (int64_t r = 0; r < rows; r++) acc += __bfloat162float(p[r * n + j]);
  } else {
    const float *p = (const float *)dy;
    for (int64_t r = 0; r < rows; r++) acc += p[r * n + j];
  }
  db[j] = write ? acc : db[j] + acc;
}

lz_status lz_cu_linear_backward(const lz_op_args *args) {
  lz_tensor *dx = args->t[0], *dw = args->t[1], *db = args->t[2];
  const lz_tensor *dy = args->t[3], *x = args->t[4], *w = args->t[5];
  int64_t in = w->shape[1], outc = w->shape[0], rows = lz_rows(x);
  lz_dtype dt = x->dtype;
  const int write = args->i[0] != 0; // linear_backward_write: dw, db written
  if (dx)
    LZ_TRY(gemm_or_scale(dt, 1, rows, in, outc, 0, 0, 0, 1.0f, dy->data, w->data, 0.0f,
                         (float *)dx->data, NULL));
  if (dw)
    LZ_TRY(gemm_or_scale(dt, 1, outc, in, rows, 1, 0, 0, 1.0f, dy->data, x->data,
                         write ? 0.0f : 1.0f, (float *)dw->data, NULL));
  if (db && outc > 0 && (rows > 0 || write)) {
    bias_grad_kernel<<<(unsigned)((outc + 255) / 256), 256, 0, LZ_CU_COMPUTE>>>(
        (float *)db->data, dy->data, dt, rows, outc, write);
    CUDA_LAUNCH_CHECK();
  }
  return LZ_OK;
}
