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
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  if ((a->kind == LZ_COLL_REDUCE_SCATTER || a->kind == LZ_COLL_ALL_GATHER) && n &&
      a->send != a->recv) {
    const lz_backend *gpu = lz_backend_of(LZ_CUDA);
    if (gpu && (gpu->is_device_pointer(a->send) || gpu->is_device_pointer(a->recv))) {
      LZ_TRY(gpu->copy(a->recv, a->send, n, LZ_STREAM_COMPUTE));
      return gpu->stream_sync(LZ_STREAM_COMPUTE);
    }
    memmove(a->recv, a->send, n);
  }
  return LZ_OK;
}

const lz_comm_backend_ops lz_comm_local_ops = {local_init, local_free, local_run};
