/* comm_local.c — the one-rank backend: every collective is a copy or nothing.
 * A copy between GPU buffers goes through the device (in order with the
 * compute stream's kernels). */
#include "comm/comm_internal.h"
#include "mem/lz_backend.h"

static lz_status local_init(lz_comm *c) {
  c->rank = 0;
  c->size = 1;
  return LZ_OK;
}

static void local_free(lz_comm *c) { (void)c; }

static lz_status local_run(lz_comm *c, const lz_coll_args *a) {
  (void)c;
  const lz_backend *gpu = lz_backend_of(LZ_CUDA);
  int on_gpu = gpu && (gpu->is_device_pointer(a->send) || gpu->is_device_pointer(a->recv));
  int dividing = (a->kind == LZ_COLL_ALL_REDUCE || a->kind == LZ_COLL_REDUCE_SCATTER) &&
                 a->op == LZ_RED_AVG && a->divisor != 1;
  if (dividing && on_gpu)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "%s: the local backend averages over %d ranks only on host buffers; run "
                   "cuda buffers over nccl (LZ_BACKEND=nccl)",
                   lz_coll_name(a->kind), a->divisor);
  if (dividing) {
    lz_comm_one_rank(a);
    return LZ_OK;
  }
  size_t es = lz_dtype_size(a->dt), n = (size_t)a->count * es;
  const void *send = a->send;
  void *recv = a->recv;
  if (a->kind == LZ_COLL_ALL_TO_ALL) { /* this rank's part to itself */
    n = (size_t)a->v[0] * es;
    send = (const uint8_t *)send + (size_t)a->v[1] * es;
    recv = (uint8_t *)recv + (size_t)a->v[3] * es;
  }
  if ((a->kind == LZ_COLL_REDUCE_SCATTER || a->kind == LZ_COLL_ALL_GATHER ||
       a->kind == LZ_COLL_ALL_TO_ALL) && n && send != recv) {
    if (on_gpu) {
      LZ_TRY(gpu->copy(recv, send, n, LZ_STREAM_COMPUTE));
      return gpu->stream_sync(LZ_STREAM_COMPUTE);
    }
    memmove(recv, send, n);
  }
  return LZ_OK;
}

static lz_status local_group(lz_comm *parent, lz_comm *child) {
  (void)parent;
  child->impl = NULL;
  return LZ_OK;
}

const lz_comm_backend_ops lz_comm_local_ops = {local_init, local_free, local_run, local_group, 0};
