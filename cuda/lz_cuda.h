// lz_cuda.h — what the files of libluazero_cuda.so share: the check macros,
// the streams and handles of the selected device, the device scratch buffer,
// and each op's kernel, one per op of core/mem/lz_ops.def, for backend.cu's
// table.
#ifndef LZ_CUDA_H
#define LZ_CUDA_H

#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <cublasLt.h>      // cublasLtHandle_t
#include <cuda_bf16.h>     // __nv_bfloat16
#include <cuda_fp16.h>     // __half
#include <cuda_runtime.h>  // cudaStream_t, cudaError_t

// Turns a CUDA or cuBLAS failure into luazero's error: the call, file:line
// and the library's own string. Out of memory is LZ_ERR_NOMEM.
lz_status lz_cuda_fail(cudaError_t e, const char *call, const char *file, int line);
lz_status lz_cublas_fail(cublasStatus_t s, const char *call, const char *file, int line);

#define CUDA_CHECK(call)                                                          \
  do {                                                                            \
    cudaError_t lz_ce_ = (call);                                                  \
    if (lz_ce_ != cudaSuccess) return lz_cuda_fail(lz_ce_, #call, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(call)                                                        \
  do {                                                                            \
    cublasStatus_t lz_cs_ = (call);                                               \
    if (lz_cs_ != CUBLAS_STATUS_SUCCESS)                                          \
      return lz_cublas_fail(lz_cs_, #call, __FILE__, __LINE__);                   \
  } while (0)

// After a kernel launch: a bad configuration shows up here.
#define CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// The selected device's streams (indexed by lz_stream_kind) and cuBLASLt.
extern cudaStream_t lz_cu_stream[LZ_STREAM_COUNT];
extern cublasLtHandle_t lz_cu_lt;
extern void *lz_cu_lt_workspace; // cuBLASLt's workspace, LZ_CU_LT_WORKSPACE bytes
#define LZ_CU_LT_WORKSPACE ((size_t)32 << 20)
#define LZ_CU_COMPUTE (lz_cu_stream[LZ_STREAM_COMPUTE])

// device.cu: the devices (the core's lz_cuda_device_count and
// lz_cuda_device_name find these by name in this library).
extern "C" lz_status lz_cu_device_count(int *out);
extern "C" const char *lz_cu_device_name(int device);

// A device scratch buffer of at least `bytes`, grown on demand (on the ledger
// as workspace). Valid until the next call; ops on the compute stream only.
lz_status lz_cu_scratch(void **out, size_t bytes);

// A grid of at most 65535 * 16 blocks for n elements, `threads` per block;
// kernels loop over the rest (grid-stride).
static inline unsigned lz_cu_blocks(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return (unsigned)(b > 65535 * 16 ? 65535 * 16 : b);
}

// gemm.cu: one GEMM on the compute stream, row-major c[m, n] = alpha op(a)
// op(b) + beta c, a and b both f32 or both bf16, c f32 (the experts' grouped
// GEMM in moe.cu runs one per expert).
lz_status lz_cu_gemm(lz_dtype dt, int64_t m, int64_t n, int64_t k, int ta, int tb, float alpha,
                     const void *a, const void *b, float beta, float *c);

// Each op's kernel (core/mem/lz_ops.def: lz_cu_<name>), in the file of its
// family; backend.cu's table holds them, called with the checked arguments
// (layout in lz_backend.h).
#define LZ_OP(ID, name, ...) lz_status lz_cu_##name(const lz_op_args *a);
#include "mem/lz_ops.def"

// rows.cu: cross-entropy's targets are checked on the device; a bad one is
// reported at the next wait for the compute stream (the loss is read after
// one), and this returns it (LZ_OK when none).
lz_status lz_cu_xent_report(void);

// NCCL (nccl.cu).
extern const size_t lz_cu_nccl_id_bytes;
lz_status lz_cu_nccl_get_id(void *id);
lz_status lz_cu_nccl_init(void **out, const void *id, int rank, int size);
void lz_cu_nccl_free(void *nc, int abort);
lz_status lz_cu_nccl_run(void *nc, lz_coll_kind kind, const void *send, void *recv, int64_t count,
                         lz_dtype dt, lz_reduce_op op, int divisor, int root, double timeout_s);
lz_status lz_cu_nccl_gather_counts(void *nc, const int64_t *row, int64_t *table, int n,
                                   double timeout_s);
lz_status lz_cu_nccl_all_to_all(void *nc, const void *send, void *recv, const int64_t *v,
                                lz_dtype dt, double timeout_s);
lz_status lz_cu_nccl_split(void *nc, int color, int key, int size, void **out);

#endif  // LZ_CUDA_H
