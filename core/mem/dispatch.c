/* dispatch.c — the calls that reach a backend through the backend slot:
 * the op table every public op ends its checks with (lz_op_run), the
 * cross-device copies and their byte counters, and the public stream and
 * event calls, which forward to the backend's table. Below the kernels and the devices: it knows a
 * backend only by its table. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <stdatomic.h> /* the copy counters */
#include <stdlib.h>    /* calloc: events */

static _Atomic uint64_t copy_bytes[2]; /* h2d, d2h */

static lz_status need_device(const char *op, lz_device dev, const lz_backend **be) {
  return lz_backend_need(op, dev, be);
}

lz_status lz_cuda_synchronize(void) {
  const lz_backend *be;
  LZ_TRY(need_device("cuda_synchronize", LZ_CUDA, &be));
  return be->sync();
}

lz_status lz_device_synchronize(void) {
  const lz_backend *be;
  LZ_TRY(lz_backend_need_any("device_synchronize", &be));
  return be->sync();
}

uint64_t lz_device_copy_bytes(int dir) {
  return dir == 0 || dir == 1 ? atomic_load(&copy_bytes[dir]) : 0;
}

void lz_device_copy_bytes_reset(void) {
  atomic_store(&copy_bytes[0], 0);
  atomic_store(&copy_bytes[1], 0);
}

/* Counts a copy between host and device memory by its direction. */
static void count_copy(lz_device dst, lz_device src, size_t bytes) {
  if (dst != LZ_CPU && src == LZ_CPU)
    atomic_fetch_add(&copy_bytes[0], bytes);
  else if (dst == LZ_CPU && src != LZ_CPU)
    atomic_fetch_add(&copy_bytes[1], bytes);
}

/* --------------------------------------------------------------- op table */

static const char *device_name(lz_device d) { return lz_device_name(d); }

static const char *arg_name(lz_op op, int i) {
  return lz_op_infos[op].args[i].name ? lz_op_infos[op].args[i].name : "a tensor";
}

lz_status lz_op_run(const char *op_name, lz_op op, const lz_op_args *a) {
  int first = -1;
  for (int i = 0; i < LZ_OP_MAX_TENSORS; i++) {
    const lz_tensor *t = a->t[i];
    if (!t) continue;
    if (t->device != LZ_CPU && t->device != LZ_CUDA && t->device != LZ_SIM)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: %s has device %d; devices are cpu (0), cuda (1) and sim (2)", op_name,
                     arg_name(op, i), (int)t->device);
    if (first < 0)
      first = i;
    else if (t->device != a->t[first]->device)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: %s lives on %s but %s lives on %s; move them to one device "
                     "(lz_tensor_copy) first",
                     op_name, arg_name(op, first), device_name(a->t[first]->device),
                     arg_name(op, i), device_name(t->device));
  }
  LZ_TRY(lz_op_check_dtypes(op_name, op, a));
  const lz_backend *be = lz_backend_cpu();
  if (first >= 0 && a->t[first]->device != LZ_CPU)
    LZ_TRY(need_device(op_name, a->t[first]->device, &be));
  const lz_op_fn fn = be->ops[op];
  if (!fn) {
    char buf[96];
    return lz_fail(LZ_ERR_UNSUPPORTED, "%s: not supported on %s yet: %s with %s %s", op_name,
                   be->name, op_name, arg_name(op, first < 0 ? 0 : first),
                   first < 0 ? "" : lz_tensor_describe(a->t[first], buf, sizeof buf));
  }
  return fn(a);
}

/* ---------------------------------------------------------- device copies */

/* The backend of the device tensor(s) of a copy; two accelerators at once
 * cannot be (one per process), a cpu-to-cpu copy takes the active one. */
static lz_status need_copy_backend(const char *op, const lz_tensor *dst, const lz_tensor *src,
                                   const lz_backend **be) {
  for (int i = 0; i < 2; i++) {
    lz_device d = (i ? src : dst)->device;
    if (d != LZ_CPU && d != LZ_CUDA && d != LZ_SIM)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: %s has device %d; devices are cpu (0), cuda (1) and sim (2)", op,
                     i ? "src" : "dst", (int)d);
  }
  if (dst->device != LZ_CPU) LZ_TRY(need_device(op, dst->device, be));
  if (src->device != LZ_CPU) LZ_TRY(need_device(op, src->device, be));
  if (dst->device == LZ_CPU && src->device == LZ_CPU) LZ_TRY(lz_backend_need_any(op, be));
  return LZ_OK;
}

static lz_status check_stream(const char *op, lz_stream_kind s) {
  if ((unsigned)s >= LZ_STREAM_COUNT)
    return lz_fail(LZ_ERR_INVALID, "%s: stream %d is not compute (0), comm (1) or copy (2)", op,
                   (int)s);
  return LZ_OK;
}

lz_status lz_tensor_copy_async(lz_tensor *dst, const lz_tensor *src, lz_stream_kind s) {
  const char *op = "tensor_copy_async";
  LZ_TRY(lz_check_present(op, "dst", dst));
  LZ_TRY(lz_check_present(op, "src", src));
  LZ_TRY(check_stream(op, s));
  LZ_TRY(lz_check_numel(op, "dst", dst, lz_tensor_numel(src), "the element count of src"));
  if (dst->dtype != src->dtype) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: src is %s and dst is %s; copies across devices keep the dtype "
                   "(convert on one device with lz_tensor_copy)",
                   op, lz_tensor_describe(src, a, sizeof a), lz_tensor_describe(dst, b, sizeof b));
  }
  const lz_backend *be;
  LZ_TRY(need_copy_backend(op, dst, src, &be));
  count_copy(dst->device, src->device, lz_tensor_bytes(src));
  return be->copy(dst->data, src->data, lz_tensor_bytes(src), s);
}

/* lz_tensor_copy with a device tensor on either side: in order with the
 * kernels (the compute stream), and done when it returns. */
lz_status lz_tensor_copy_device(lz_tensor *dst, const lz_tensor *src) {
  const char *op = "tensor_copy";
  const lz_backend *be;
  LZ_TRY(need_copy_backend(op, dst, src, &be));
  if (dst->dtype == src->dtype) {
    count_copy(dst->device, src->device, lz_tensor_bytes(src));
    LZ_TRY(be->copy(dst->data, src->data, lz_tensor_bytes(src), LZ_STREAM_COMPUTE));
    return be->stream_sync(LZ_STREAM_COMPUTE);
  }
  if (dst->device != src->device) {
    char a[96], b[96];
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s on %s into %s on %s: copy across devices in one dtype, then convert "
                   "on one device",
                   op, lz_tensor_describe(src, a, sizeof a), device_name(src->device),
                   lz_tensor_describe(dst, b, sizeof b), device_name(dst->device));
  }
  return lz_op_run(op, LZ_OP_CONVERT, &(lz_op_args){.t = {dst, (lz_tensor *)src}});
}

/* ------------------------------------------------------- streams and events */

struct lz_event {
  void *impl;
};

lz_status lz_stream_synchronize(lz_stream_kind s) {
  const lz_backend *be;
  LZ_TRY(check_stream("stream_synchronize", s));
  LZ_TRY(lz_backend_need_any("stream_synchronize", &be));
  return be->stream_sync(s);
}

lz_status lz_event_new(lz_event **out) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "event_new: out is NULL");
  *out = NULL;
  const lz_backend *be;
  LZ_TRY(lz_backend_need_any("event_new", &be));
  lz_event *e = calloc(1, sizeof *e);
  if (!e) return lz_fail(LZ_ERR_NOMEM, "event_new: out of memory");
  lz_status st = be->event_new(&e->impl);
  if (st != LZ_OK) {
    free(e);
    return st;
  }
  *out = e;
  return LZ_OK;
}

lz_status lz_event_free(lz_event *e) {
  if (!e) return LZ_OK;
  const lz_backend *be = lz_backend_active();
  lz_status st = be ? be->event_free(e->impl) : LZ_OK;
  free(e);
  return st;
}

lz_status lz_event_record(lz_event *e, lz_stream_kind s) {
  const lz_backend *be;
  if (!e) return lz_fail(LZ_ERR_INVALID, "event_record: event is NULL");
  LZ_TRY(check_stream("event_record", s));
  LZ_TRY(lz_backend_need_any("event_record", &be));
  return be->event_record(e->impl, s);
}

lz_status lz_stream_wait_event(lz_stream_kind s, lz_event *e) {
  const lz_backend *be;
  if (!e) return lz_fail(LZ_ERR_INVALID, "stream_wait_event: event is NULL");
  LZ_TRY(check_stream("stream_wait_event", s));
  LZ_TRY(lz_backend_need_any("stream_wait_event", &be));
  return be->stream_wait(s, e->impl);
}

lz_status lz_event_synchronize(lz_event *e) {
  const lz_backend *be;
  if (!e) return lz_fail(LZ_ERR_INVALID, "event_synchronize: event is NULL");
  LZ_TRY(lz_backend_need_any("event_synchronize", &be));
  return be->event_sync(e->impl);
}

lz_status lz_event_query(lz_event *e, int *done) {
  const lz_backend *be;
  if (!e || !done) return lz_fail(LZ_ERR_INVALID, "event_query: event or done is NULL");
  *done = 0;
  LZ_TRY(lz_backend_need_any("event_query", &be));
  return be->event_query(e->impl, done);
}
