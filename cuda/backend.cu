// backend.cu — the cuda backend's table (lz_backend.h): device selection,
// streams, events, memory, copies, and the table of op kernels, one per op
// of the declaration (core/mem/lz_ops.def). The core finds the table with dlsym
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
  LZ_TRY(lz_cu_device_count(&n));  // (device.cu: the clear "no GPU" errors)
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

// The kernel of each op, in the declaration's order (C++ has no designated
// array initializers): an op declared without its lz_cu_<name> does not
// compile. The core's checks already pinned the dtypes and shapes to what
// the kernels take.
// An op without a cuda kernel yet holds NULL: lz_op_run refuses it as "not
// supported on cuda yet", naming the op and its first tensor.
#define lz_cu_attention_decode nullptr
#define lz_cu_adamw8bit_step_bf16 nullptr // (the engine rounds in three passes there)
static const lz_op_fn cu_ops[] = {
#define LZ_OP(ID, name, ...) lz_cu_##name,
#include "mem/lz_ops.def"
};
#undef lz_cu_attention_decode
#undef lz_cu_adamw8bit_step_bf16
static_assert(sizeof cu_ops / sizeof cu_ops[0] == LZ_OP_COUNT, "one kernel per declared op");

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

// A wait that covers the compute stream also reports a bad target its
// cross-entropy kernels found.
static lz_status cu_stream_sync(lz_stream_kind s) {
  CUDA_CHECK(cudaStreamSynchronize(lz_cu_stream[s]));
  return s == LZ_STREAM_COMPUTE ? lz_cu_xent_report() : LZ_OK;
}

static lz_status cu_sync(void) {
  CUDA_CHECK(cudaDeviceSynchronize());
  return lz_cu_xent_report();
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
  table.ops = cu_ops;
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
  table.nccl_gather_counts = lz_cu_nccl_gather_counts;
  table.nccl_all_to_all = lz_cu_nccl_all_to_all;
  table.nccl_split = lz_cu_nccl_split;
  return &table;
}
