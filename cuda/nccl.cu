// nccl.cu — the device half of the nccl collective backend: the NCCL
// communicator and one collective at a time on the communication stream.
// core/comm/comm_nccl.c does the rest (rank and size, sharing the unique id,
// argument checks, byte counters, the ordering queue).
//
// Communicators are non-blocking (ncclConfig_t.blocking = 0), so every wait
// — joining, a collective — polls with a deadline and aborts the
// communicator when it passes: a rank that dies makes the others fail with a
// message, never hang. Collectives start after the work queued so far on the
// compute stream (an event), and kernels queued after them see their results.
// Shards that do not divide evenly (lz_comm_shard gives the first count %
// size ranks one element more) go through grouped per-rank reduce or
// broadcast calls; even ones through ncclReduceScatter / ncclAllGather.
// All-to-all is grouped ncclSend/ncclRecv, after the ranks' counts went
// through an all-gather (comm_nccl.c checks them); a group is ncclCommSplit.
#include "lz_cuda.h"

#include <cuda_bf16.h> // __nv_bfloat16: the scalar of an average over another count
#include <cuda_fp16.h> // __half: the same for f16
#include <nccl.h>      // the whole file
#include <sched.h>     // sched_yield while polling
#include <stdlib.h>    // calloc
#include <string.h>    // memcpy
#include <time.h>      // clock_gettime for deadlines

const size_t lz_cu_nccl_id_bytes = sizeof(ncclUniqueId);

typedef struct nccl_comm {
  ncclComm_t comm;
  int rank, size;
  cudaEvent_t ready, done;
  float *one;  // a device float for the barrier
} nccl_comm;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static lz_status nccl_fail(ncclResult_t r, const char *call, const char *file, int line) {
  return lz_fail(r == ncclSystemError || r == ncclRemoteError ? LZ_ERR_COMM : LZ_ERR_INTERNAL,
                 "nccl: %s failed at %s:%d: %s (%s)", call, file, line, ncclGetErrorString(r),
                 ncclGetLastError(NULL));
}

#define NCCL_CHECK(call)                                                          \
  do {                                                                            \
    ncclResult_t lz_nr_ = (call);                                                 \
    if (lz_nr_ != ncclSuccess && lz_nr_ != ncclInProgress)                        \
      return nccl_fail(lz_nr_, #call, __FILE__, __LINE__);                        \
  } while (0)

// Polls the communicator's asynchronous state until it leaves ncclInProgress.
static lz_status wait_comm(nccl_comm *c, const char *what, double deadline) {
  for (;;) {
    ncclResult_t r = ncclInProgress;
    NCCL_CHECK(ncclCommGetAsyncError(c->comm, &r));
    if (r == ncclSuccess) return LZ_OK;
    if (r != ncclInProgress) return nccl_fail(r, what, __FILE__, __LINE__);
    if (now_s() > deadline) {
      ncclCommAbort(c->comm);
      c->comm = NULL;
      return lz_fail(LZ_ERR_TIMEOUT,
                     "nccl: %s: rank %d waited past LZ_COMM_TIMEOUT for its peers; a rank "
                     "stopped or is stuck (communicator aborted)",
                     what, c->rank);
    }
    sched_yield();
  }
}

lz_status lz_cu_nccl_get_id(void *id) {
  ncclUniqueId u;
  NCCL_CHECK(ncclGetUniqueId(&u));
  memcpy(id, &u, sizeof u);
  return LZ_OK;
}

static lz_status joined(nccl_comm *c, lz_status st, void **out);

lz_status lz_cu_nccl_init(void **out, const void *id, int rank, int size) {
  *out = NULL;
  nccl_comm *c = (nccl_comm *)calloc(1, sizeof *c);
  if (!c) return lz_fail(LZ_ERR_NOMEM, "nccl: out of memory");
  c->rank = rank;
  c->size = size;
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  lz_status st = LZ_OK;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, size, u, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) st = nccl_fail(r, "ncclCommInitRankConfig", __FILE__, __LINE__);
  return joined(c, st, out);
}

// The rest of a new communicator (init or split): wait for it, its events
// and the barrier's float. Frees c on failure.
static lz_status joined(nccl_comm *c, lz_status st, void **out) {
  const char *ts = getenv("LZ_COMM_TIMEOUT");
  double timeout = ts && atof(ts) > 0 ? atof(ts) : 300.0;
  if (st == LZ_OK) st = wait_comm(c, "joining the communicator", now_s() + timeout);
  if (st == LZ_OK && cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming) != cudaSuccess)
    st = lz_fail(LZ_ERR_INTERNAL, "nccl: cudaEventCreate failed");
  if (st == LZ_OK && cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming) != cudaSuccess)
    st = lz_fail(LZ_ERR_INTERNAL, "nccl: cudaEventCreate failed");
  if (st == LZ_OK && cudaMalloc(&c->one, sizeof(float)) != cudaSuccess)
    st = lz_fail(LZ_ERR_NOMEM, "nccl: cudaMalloc of the barrier's float failed");
  if (st != LZ_OK) {
    cudaGetLastError();
    lz_cu_nccl_free(c, 1);
    return st;
  }
  *out = c;
  return LZ_OK;
}

void lz_cu_nccl_free(void *p, int abort) {
  nccl_comm *c = (nccl_comm *)p;
  if (!c) return;
  if (c->comm) {
    if (abort) ncclCommAbort(c->comm);
    else {
      ncclCommFinalize(c->comm);
      wait_comm(c, "finalizing", now_s() + 30.0);
      if (c->comm) ncclCommDestroy(c->comm);
    }
  }
  if (c->ready) cudaEventDestroy(c->ready);
  if (c->done) cudaEventDestroy(c->done);
  if (c->one) cudaFree(c->one);
  free(c);
}

static ncclDataType_t nccl_type(lz_dtype dt, int64_t *count) {
  switch (dt) {
  case LZ_F32: return ncclFloat32;
  case LZ_BF16: return ncclBfloat16;
  case LZ_F16: return ncclFloat16;
  case LZ_I32: return ncclInt32;
  default: *count *= (int64_t)lz_dtype_size(dt); return ncclUint8;  // u16: moved as bytes
  }
}

static ncclRedOp_t nccl_op(lz_reduce_op op) {
  return op == LZ_RED_AVG ? ncclAvg : op == LZ_RED_MAX ? ncclMax : ncclSum;
}

// An average over `divisor` ranks where this communicator has another
// count (a group's part of its parent's average): NCCL's pre-multiplied
// sum by 1/divisor, the form its own ncclAvg takes for floating types, so
// the division runs on the device inside the collective. The scalar is in
// the data's type, as NCCL requires.
static lz_status avg_over_op(nccl_comm *c, lz_dtype dt, int divisor, ncclRedOp_t *out) {
  float inv = 1.0f / (float)divisor;
  switch (dt) {
  case LZ_F32:
    NCCL_CHECK(ncclRedOpCreatePreMulSum(out, &inv, ncclFloat32, ncclScalarHostImmediate, c->comm));
    return LZ_OK;
  case LZ_BF16: {
    __nv_bfloat16 h = __float2bfloat16(inv);
    NCCL_CHECK(ncclRedOpCreatePreMulSum(out, &h, ncclBfloat16, ncclScalarHostImmediate, c->comm));
    return LZ_OK;
  }
  case LZ_F16: {
    __half h = __float2half(inv);
    NCCL_CHECK(ncclRedOpCreatePreMulSum(out, &h, ncclFloat16, ncclScalarHostImmediate, c->comm));
    return LZ_OK;
  }
  default:
    return lz_fail(LZ_ERR_INVALID, "nccl: an average over %d ranks needs f32, bf16 or f16 data",
                   divisor);
  }
}

static lz_status enqueue(nccl_comm *c, lz_coll_kind kind, const void *send, void *recv,
                         int64_t count, lz_dtype dt, ncclRedOp_t rop, int root);

static lz_status enqueue_reduce(nccl_comm *c, lz_coll_kind kind, const void *send, void *recv,
                                int64_t count, lz_dtype dt, lz_reduce_op op, int divisor,
                                int root) {
  if (op != LZ_RED_AVG || divisor == c->size)
    return enqueue(c, kind, send, recv, count, dt, nccl_op(op), root);
  ncclRedOp_t rop;
  LZ_TRY(avg_over_op(c, dt, divisor, &rop));
  lz_status st = enqueue(c, kind, send, recv, count, dt, rop, root);
  ncclRedOpDestroy(rop, c->comm); // (allowed once the calls that use it have returned)
  return st;
}

static lz_status enqueue(nccl_comm *c, lz_coll_kind kind, const void *send, void *recv,
                         int64_t count, lz_dtype dt, ncclRedOp_t rop, int root) {
  cudaStream_t s = lz_cu_stream[LZ_STREAM_COMM];
  const size_t es = lz_dtype_size(dt);
  const int W = c->size;
  int64_t n = count;
  switch (kind) {
  case LZ_COLL_ALL_REDUCE: {
    ncclDataType_t t = nccl_type(dt, &n);
    NCCL_CHECK(ncclAllReduce(send, recv, (size_t)n, t, rop, c->comm, s));
    return LZ_OK;
  }
  case LZ_COLL_BROADCAST: {
    ncclDataType_t t = nccl_type(dt, &n);
    NCCL_CHECK(ncclBroadcast(recv, recv, (size_t)n, t, root, c->comm, s));
    return LZ_OK;
  }
  case LZ_COLL_BARRIER:
    NCCL_CHECK(ncclAllReduce(c->one, c->one, 1, ncclFloat32, ncclSum, c->comm, s));
    return LZ_OK;
  case LZ_COLL_REDUCE_SCATTER:
  case LZ_COLL_ALL_GATHER: break;
  default: return lz_fail(LZ_ERR_INVALID, "nccl: collective kind %d is unknown", (int)kind);
  }
  if (count % W == 0) {
    int64_t shard = count / W;
    ncclDataType_t t = nccl_type(dt, &shard);
    if (kind == LZ_COLL_REDUCE_SCATTER)
      NCCL_CHECK(ncclReduceScatter(send, recv, (size_t)shard, t, rop, c->comm, s));
    else NCCL_CHECK(ncclAllGather(send, recv, (size_t)shard, t, c->comm, s));
    return LZ_OK;
  }
  NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < W; r++) {
    int64_t off, len;
    lz_comm_shard(count, W, r, &off, &len);
    ncclDataType_t t = nccl_type(dt, &len);
    if (kind == LZ_COLL_REDUCE_SCATTER) {
      const char *src = (const char *)send + (size_t)off * es;
      NCCL_CHECK(ncclReduce(src, recv, (size_t)len, t, rop, r, c->comm, s));
    } else {
      char *dst = (char *)recv + (size_t)off * es;
      NCCL_CHECK(ncclBroadcast(send, dst, (size_t)len, t, r, c->comm, s));
    }
  }
  NCCL_CHECK(ncclGroupEnd());
  return LZ_OK;
}

static lz_status start(nccl_comm *c, const char *what);
static lz_status finish(nccl_comm *c, const char *what, double deadline, double timeout_s);

lz_status lz_cu_nccl_run(void *p, lz_coll_kind kind, const void *send, void *recv,
                                    int64_t count, lz_dtype dt, lz_reduce_op op, int divisor,
                                    int root, double timeout_s) {
  nccl_comm *c = (nccl_comm *)p;
  const char *what = lz_coll_kind_name(kind);
  const double deadline = now_s() + timeout_s;
  LZ_TRY(start(c, what));
  LZ_TRY(enqueue_reduce(c, kind, send, recv, count, dt, op, divisor, root));
  return finish(c, what, deadline, timeout_s);
}

// The communication stream waits for the compute stream's work so far.
static lz_status start(nccl_comm *c, const char *what) {
  if (!c->comm)
    return lz_fail(LZ_ERR_COMM, "nccl: %s: rank %d: the communicator was aborted earlier", what,
                   c->rank);
  CUDA_CHECK(cudaEventRecord(c->ready, LZ_CU_COMPUTE));
  CUDA_CHECK(cudaStreamWaitEvent(lz_cu_stream[LZ_STREAM_COMM], c->ready, 0));
  return LZ_OK;
}

// Waits for what was enqueued on the communication stream, with the deadline.
static lz_status finish(nccl_comm *c, const char *what, double deadline, double timeout_s) {
  LZ_TRY(wait_comm(c, what, deadline));
  CUDA_CHECK(cudaEventRecord(c->done, lz_cu_stream[LZ_STREAM_COMM]));
  // Kernels queued from here on run after the collective.
  CUDA_CHECK(cudaStreamWaitEvent(LZ_CU_COMPUTE, c->done, 0));
  for (;;) {
    cudaError_t e = cudaEventQuery(c->done);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) return lz_cuda_fail(e, "cudaEventQuery(done)", __FILE__, __LINE__);
    ncclResult_t r = ncclSuccess;
    ncclCommGetAsyncError(c->comm, &r);
    if (r != ncclSuccess && r != ncclInProgress) {
      ncclCommAbort(c->comm);
      c->comm = NULL;
      return nccl_fail(r, what, __FILE__, __LINE__);
    }
    if (now_s() > deadline) {
      ncclCommAbort(c->comm);
      c->comm = NULL;
      return lz_fail(LZ_ERR_TIMEOUT,
                     "nccl: %s: rank %d waited past LZ_COMM_TIMEOUT (%.0f s) for its peers; a "
                     "rank stopped or is stuck (communicator aborted)",
                     what, c->rank, timeout_s);
    }
    sched_yield();
  }
  return LZ_OK;
}

lz_status lz_cu_nccl_gather_counts(void *p, const int64_t *row, int64_t *table, int n,
                                   double timeout_s) {
  nccl_comm *c = (nccl_comm *)p;
  const double deadline = now_s() + timeout_s;
  cudaStream_t s = lz_cu_stream[LZ_STREAM_COMM];
  int64_t *d = NULL;
  size_t bytes = sizeof(int64_t) * (size_t)n;
  if (cudaMalloc(&d, bytes * (size_t)(c->size + 1)) != cudaSuccess) {
    cudaGetLastError();
    return lz_fail(LZ_ERR_NOMEM, "nccl: all_to_all: rank %d: no device memory for the counts",
                   c->rank);
  }
  lz_status st = start(c, "all_to_all");
  if (st == LZ_OK && cudaMemcpyAsync(d, row, bytes, cudaMemcpyHostToDevice, s) != cudaSuccess)
    st = lz_fail(LZ_ERR_INTERNAL, "nccl: all_to_all: copying the counts to the device failed");
  ncclResult_t r = st == LZ_OK ? ncclAllGather(d, d + n, bytes, ncclUint8, c->comm, s) : ncclSuccess;
  if (r != ncclSuccess && r != ncclInProgress) st = nccl_fail(r, "ncclAllGather", __FILE__, __LINE__);
  if (st == LZ_OK) st = finish(c, "all_to_all", deadline, timeout_s);
  if (st == LZ_OK && cudaMemcpy(table, d + n, bytes * (size_t)c->size, cudaMemcpyDeviceToHost) != cudaSuccess)
    st = lz_fail(LZ_ERR_INTERNAL, "nccl: all_to_all: copying the counts back failed");
  cudaFree(d);
  return st;
}

lz_status lz_cu_nccl_all_to_all(void *p, const void *send, void *recv, const int64_t *v,
                                lz_dtype dt, double timeout_s) {
  nccl_comm *c = (nccl_comm *)p;
  const double deadline = now_s() + timeout_s;
  const int W = c->size;
  const size_t es = lz_dtype_size(dt);
  cudaStream_t s = lz_cu_stream[LZ_STREAM_COMM];
  LZ_TRY(start(c, "all_to_all"));
  NCCL_CHECK(ncclGroupStart());
  for (int q = 0; q < W; q++) {
    if (v[q])
      NCCL_CHECK(ncclSend((const char *)send + (size_t)v[W + q] * es, (size_t)v[q] * es,
                          ncclUint8, q, c->comm, s));
    if (v[2 * W + q])
      NCCL_CHECK(ncclRecv((char *)recv + (size_t)v[3 * W + q] * es, (size_t)v[2 * W + q] * es,
                          ncclUint8, q, c->comm, s));
  }
  NCCL_CHECK(ncclGroupEnd());
  return finish(c, "all_to_all", deadline, timeout_s);
}

lz_status lz_cu_nccl_split(void *p, int color, int key, int size, void **out) {
  *out = NULL;
  nccl_comm *parent = (nccl_comm *)p;
  nccl_comm *c = (nccl_comm *)calloc(1, sizeof *c);
  if (!c) return lz_fail(LZ_ERR_NOMEM, "nccl: out of memory");
  c->rank = key;  // keys are the group's ranks, 0..size-1
  c->size = size;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  lz_status st = LZ_OK;
  ncclResult_t r = ncclCommSplit(parent->comm, color, key, &c->comm, &config);
  if (r != ncclSuccess && r != ncclInProgress) st = nccl_fail(r, "ncclCommSplit", __FILE__, __LINE__);
  return joined(c, st, out);
}
