// backend.cu — the cuda backend's table (lz_backend.h): device selection,
// streams, events, memory, copies, and the one switch over ops that sends
// each to its kernel file. The core finds the table with dlsym
// ("lz_cuda_backend") once lz_cuda_init has loaded this library.
#include "lz_cuda.h"

#include <stdio.h>  // snprintf

cudaStream_t lz_cu_stream[LZ_STREAM_COUNT];
cublasLtHandle_t lz_cu_lt;
void *lz_cu_lt_workspace;
static void *scratch;
static size_t scratch_bytes;

lz_status lz_cuda_fail(cudaError_t e, const char *call, const char *file, int line) {
  lz_status st = e == cudaErrorMemoryAllocation ? LZ_ERR_NOMEM : LZ_ERR_INTERNAL;
  return lz_fail(st, "cuda: %s failed at %s:%d: %s (%s)", call, file, line, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}

lz_status lz_cublas_fail(cublasStatus_t s, const char *call, const char *file, int line) {
  lz_status st = s == CUBLAS_STATUS_ALLOC_FAILED ? LZ_ERR_NOMEM : LZ_ERR_INTERNAL;
  return lz_fail(st, "cublas: %s failed at %s:%d: %s", call, file, line,
                 cublasLtGetStatusString(s));
}

lz_status lz_cu_scratch(void **out, size_t bytes) {
  if (bytes > scratch_bytes) {
    // Work queued on the compute stream may still read the old buffer.
    CUDA_CHECK(cudaStreamSynchronize(LZ_CU_COMPUTE));
    LZ_TRY(lz_mem_free(scratch));
    scratch = NULL;
    scratch_bytes = 0;
    size_t want = bytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : bytes;
    LZ_TRY(lz_mem_alloc_device(&scratch, want, LZ_MEM_WORKSPACE));
    scratch_bytes = want;
  }
  *out = scratch;
  return LZ_OK;
}

// ------------------------------------------------------------------- init

static lz_status cu_init(int device) {
  int n = 0;
  LZ_TRY(lz_cuda_device_count(&n));  // (device.cu: the clear "no GPU" errors)
  if (device >= n)
    return lz_fail(LZ_ERR_INVALID, "cuda: device %d does not exist; this machine has %d (0..%d)",
                   device, n, n - 1);
  CUDA_CHECK(cudaSetDevice(device));
  for (int s = 0; s < LZ_STREAM_COUNT; s++)
    CUDA_CHECK(cudaStreamCreateWithFlags(&lz_cu_stream[s], cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasLtCreate(&lz_cu_lt));
  CUDA_CHECK(cudaMalloc(&lz_cu_lt_workspace, LZ_CU_LT_WORKSPACE));
  return LZ_OK;
}

// The core's checks already pinned the dtypes and shapes to what the kernels
// take, so support depends on the op alone: an op added to lz_backend.h is
// refused here until it has a kernel.
static int cu_supports(lz_op op, const lz_op_args *a) {
  (void)a;
  switch (op) {
  case LZ_OP_MATMUL:
  case LZ_OP_LINEAR_FORWARD:
  case LZ_OP_LINEAR_BACKWARD:
  case LZ_OP_LAYERNORM_FORWARD:
  case LZ_OP_LAYERNORM_BACKWARD:
  case LZ_OP_GELU_FORWARD:
  case LZ_OP_GELU_BACKWARD:
  case LZ_OP_ATTENTION_FORWARD:  // multi-head and grouped-query
  case LZ_OP_ATTENTION_BACKWARD:
  case LZ_OP_EMBEDDING_FORWARD:  // with or without a position table
  case LZ_OP_EMBEDDING_BACKWARD:
  case LZ_OP_CROSS_ENTROPY_FORWARD:
  case LZ_OP_CROSS_ENTROPY_BACKWARD:
  case LZ_OP_ADD:
  case LZ_OP_AXPY:
  case LZ_OP_SCALE:
  case LZ_OP_FILL:
  case LZ_OP_SQ_NORM:
  case LZ_OP_HAS_INF_NAN:
  case LZ_OP_ADAMW_STEP:
  case LZ_OP_CONVERT:
  case LZ_OP_LION_STEP:
  case LZ_OP_RMSNORM_FORWARD:
  case LZ_OP_RMSNORM_BACKWARD:
  case LZ_OP_ROPE_FORWARD:  // theta or given inverse frequencies
  case LZ_OP_ROPE_BACKWARD:
  case LZ_OP_SWIGLU_FORWARD:
  case LZ_OP_SWIGLU_BACKWARD: return 1;
  default: return 0;
  }
}

static lz_status cu_compute(lz_op op, const lz_op_args *a) {
  switch (op) {
    case LZ_OP_MATMUL:
      return lz_cu_matmul(a);
    case LZ_OP_LINEAR_FORWARD:
      return lz_cu_linear_forward(a);
    case LZ_OP_LINEAR_BACKWARD:
      return lz_cu_linear_backward(a);
    case LZ_OP_LAYERNORM_FORWARD:
      return lz_cu_layernorm_forward(a);
    case LZ_OP_LAYERNORM_BACKWARD:
      return lz_cu_layernorm_backward(a);
    case LZ_OP_GELU_FORWARD:
      return lz_cu_gelu_forward(a);
    case LZ_OP_GELU_BACKWARD:
      return lz_cu_gelu_backward(a);
    case LZ_OP_ATTENTION_FORWARD:
      return lz_cu_attention_forward(a);
    case LZ_OP_ATTENTION_BACKWARD:
      return lz_cu_attention_backward(a);
    case LZ_OP_EMBEDDING_FORWARD:
      return lz_cu_embedding_forward(a);
    case LZ_OP_EMBEDDING_BACKWARD:
      return lz_cu_embedding_backward(a);
    case LZ_OP_CROSS_ENTROPY_FORWARD:
      return lz_cu_cross_entropy_forward(a);
    case LZ_OP_CROSS_ENTROPY_BACKWARD:
      return lz_cu_cross_entropy_backward(a);
    case LZ_OP_ADD:
      return lz_cu_add(a);
    case LZ_OP_AXPY:
      return lz_cu_axpy(a);
    case LZ_OP_SCALE:
      return lz_cu_scale(a);
    case LZ_OP_FILL:
      return lz_cu_fill(a);
    case LZ_OP_SQ_NORM:
      return lz_cu_sq_norm(a);
    case LZ_OP_HAS_INF_NAN:
      return lz_cu_has_inf_nan(a);
    case LZ_OP_ADAMW_STEP:
      return lz_cu_adamw_step(a);
    case LZ_OP_CONVERT:
      return lz_cu_convert(a);
    case LZ_OP_LION_STEP:
      return lz_cu_lion_step(a);
    case LZ_OP_RMSNORM_FORWARD:
      return lz_cu_rmsnorm_forward(a);
    case LZ_OP_RMSNORM_BACKWARD:
      return lz_cu_rmsnorm_backward(a);
    case LZ_OP_ROPE_FORWARD:
      return lz_cu_rope_forward(a);
    case LZ_OP_ROPE_BACKWARD:
      return lz_cu_rope_backward(a);
    case LZ_OP_SWIGLU_FORWARD:
      return lz_cu_swiglu_forward(a);
    case LZ_OP_SWIGLU_BACKWARD:
      return lz_cu_swiglu_backward(a);
    default:
      break;
  }
  return lz_fail(LZ_ERR_UNSUPPORTED, "cuda: op %d is not supported on cuda yet", (int)op);
}

// ----------------------------------------------------------------- memory

static lz_status cu_alloc(void **out, size_t bytes) {
  *out = NULL;
  cudaError_t e = cudaMalloc(out, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    char asked[32], used[32], total[32];
    return lz_fail(LZ_ERR_NOMEM,
                   "cuda: out of device memory: %zu bytes (%s) asked with %zu (%s) of %zu (%s) in "
                   "use; use a higher ZeRO stage, offload, or a smaller batch",
                   bytes, lz_format_bytes(bytes, asked, sizeof asked), total_b - free_b,
                   lz_format_bytes(total_b - free_b, used, sizeof used), total_b,
                   lz_format_bytes(total_b, total, sizeof total));
  }
  CUDA_CHECK(e);
  return LZ_OK;
}

static lz_status cu_free(void *p) {
  CUDA_CHECK(cudaFree(p));
  return LZ_OK;
}

static lz_status cu_host_alloc(void **out, size_t bytes) {
  *out = NULL;
  CUDA_CHECK(cudaHostAlloc(out, bytes, cudaHostAllocPortable));
  return LZ_OK;
}

static lz_status cu_host_free(void *p) {
  CUDA_CHECK(cudaFreeHost(p));
  return LZ_OK;
}

static lz_status cu_copy(void *dst, const void *src, size_t bytes, lz_stream_kind s) {
  if (bytes == 0 || dst == src) return LZ_OK;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, lz_cu_stream[s]));
  return LZ_OK;
}

static int cu_is_device_pointer(const void *p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// --------------------------------------------------------- streams, events

static lz_status cu_stream_sync(lz_stream_kind s) {
  CUDA_CHECK(cudaStreamSynchronize(lz_cu_stream[s]));
  return LZ_OK;
}

static lz_status cu_sync(void) {
  CUDA_CHECK(cudaDeviceSynchronize());
  return LZ_OK;
}

static lz_status cu_event_new(void **out) {
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *out = (void *)e;
  return LZ_OK;
}

static lz_status cu_event_free(void *e) {
  CUDA_CHECK(cudaEventDestroy((cudaEvent_t)e));
  return LZ_OK;
}

static lz_status cu_event_record(void *e, lz_stream_kind s) {
  CUDA_CHECK(cudaEventRecord((cudaEvent_t)e, lz_cu_stream[s]));
  return LZ_OK;
}

static lz_status cu_stream_wait(lz_stream_kind s, void *e) {
  CUDA_CHECK(cudaStreamWaitEvent(lz_cu_stream[s], (cudaEvent_t)e, 0));
  return LZ_OK;
}

static lz_status cu_event_sync(void *e) {
  CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)e));
  return LZ_OK;
}

static lz_status cu_event_query(void *e, int *done) {
  cudaError_t r = cudaEventQuery((cudaEvent_t)e);
  if (r == cudaErrorNotReady) {
    cudaGetLastError();
    *done = 0;
    return LZ_OK;
  }
  CUDA_CHECK(r);
  *done = 1;
  return LZ_OK;
}

static lz_backend table;

extern "C" const lz_backend *lz_cuda_backend(void) {
  table.abi = LZ_BACKEND_ABI;
  table.name = "cuda";
  table.kind = LZ_CUDA;
  table.init = cu_init;
  table.supports = cu_supports;
  table.compute = cu_compute;
  table.alloc = cu_alloc;
  table.free = cu_free;
  table.host_alloc = cu_host_alloc;
  table.host_free = cu_host_free;
  table.copy = cu_copy;
  table.stream_sync = cu_stream_sync;
  table.sync = cu_sync;
  table.event_new = cu_event_new;
  table.event_free = cu_event_free;
  table.event_record = cu_event_record;
  table.stream_wait = cu_stream_wait;
  table.event_sync = cu_event_sync;
  table.event_query = cu_event_query;
  table.is_device_pointer = cu_is_device_pointer;
  table.nccl_id_bytes = lz_cu_nccl_id_bytes;
  table.nccl_get_id = lz_cu_nccl_get_id;
  table.nccl_init = lz_cu_nccl_init;
  table.nccl_free = lz_cu_nccl_free;
  table.nccl_run = lz_cu_nccl_run;
  return &table;
}
