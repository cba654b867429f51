/* comm_local.c — the one-rank backend: every collective is a copy or nothing. */
#include "comm_internal.h"

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
      a->send != a->recv)
    memmove(a->recv, a->send, n);
  return LZ_OK;
}

const lz_comm_backend_ops lz_comm_local_ops = {"local", local_init, local_free, local_run};
