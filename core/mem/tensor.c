/* tensor.c — tensors (metadata over refcounted storage), views, and the
 * activation arena. Calls only the
 * ledger and error.c below it (copies between tensors are copy.c). */
#include "mem/lz_backend.h" /* lz_backend_need: device tensors */
#include "mem/lz_internal.h"

#include <math.h>   /* isnan, isinf */
#include <stdatomic.h> /* storage refcount */
#include <stdint.h> /* uintptr_t for the arena alignment check */
#include <stdio.h>  /* snprintf for describe */
#include <stdlib.h> /* malloc for tensor headers */

enum { TENSOR_ARENA = 1 };

struct lz_storage {
  void *data;
  size_t bytes;
  atomic_int refs;
};

int64_t lz_tensor_numel(const lz_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

size_t lz_tensor_bytes(const lz_tensor *t) {
  return (size_t)lz_tensor_numel(t) * lz_dtype_size(t->dtype);
}

const char *lz_tensor_describe(const lz_tensor *t, char *buf, size_t len) {
  if (!t) {
    snprintf(buf, len, "NULL");
    return buf;
  }
  size_t n = (size_t)snprintf(buf, len, "%s[", lz_dtype_name(t->dtype));
  for (int i = 0; i < t->ndim && n < len; i++)
    n += (size_t)snprintf(buf + n, len - n, i ? ",%lld" : "%lld", (long long)t->shape[i]);
  if (n < len) snprintf(buf + n, len - n, "]");
  return buf;
}

static lz_status check_shape(const char *op, lz_dtype dt, int ndim, const int64_t *shape) {
  if ((unsigned)dt >= LZ_DTYPE_COUNT)
    return lz_fail(LZ_ERR_INVALID, "%s: dtype %d is not one of f32, bf16, f16, i32, u16", op,
                   (int)dt);
  if (ndim < 0 || ndim > LZ_MAX_DIMS)
    return lz_fail(LZ_ERR_INVALID, "%s: %d dimensions; tensors have 0 to %d", op, ndim,
                   LZ_MAX_DIMS);
  int64_t bytes = (int64_t)lz_dtype_size(dt), zero = 0, over = 0;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return lz_fail(LZ_ERR_INVALID, "%s: dimension %d is %lld; sizes must be >= 0", op, i,
                     (long long)shape[i]);
    zero |= shape[i] == 0; /* an empty shape overflows nothing */
    over |= !zero && __builtin_mul_overflow(bytes, shape[i], &bytes);
  }
  if (over && !zero)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: the shape's %s elements are over 2^63 bytes; check the sizes", op,
                   lz_dtype_name(dt));
  return LZ_OK;
}

static void set_meta(lz_tensor *t, void *data, lz_dtype dt, int ndim, const int64_t *shape) {
  memset(t, 0, sizeof *t);
  t->data = data;
  t->ndim = ndim;
  t->dtype = dt;
  t->device = LZ_CPU;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
}

lz_status lz_tensor_new(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape,
                        lz_mem_category cat) {
  return lz_tensor_new_on(out, dt, ndim, shape, cat, LZ_CPU);
}

/* pinned: host memory from lz_mem_alloc_pinned (dev is LZ_CPU). */
static lz_status tensor_new(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape,
                            lz_mem_category cat, lz_device dev, int pinned);

lz_status lz_tensor_new_on(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape,
                           lz_mem_category cat, lz_device dev) {
  return tensor_new(out, dt, ndim, shape, cat, dev, 0);
}

lz_status lz_tensor_new_pinned(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape) {
  return tensor_new(out, dt, ndim, shape, LZ_MEM_OFFLOAD, LZ_CPU, 1);
}

static lz_status tensor_new(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape,
                            lz_mem_category cat, lz_device dev, int pinned) {
  *out = NULL;
  const char *op = pinned ? "tensor_new_pinned" : dev == LZ_CPU ? "tensor_new" : "tensor_new_on";
  LZ_TRY(check_shape(op, dt, ndim, shape));
  if (dev != LZ_CPU && dev != LZ_CUDA && dev != LZ_SIM)
    return lz_fail(LZ_ERR_INVALID, "%s: device %d is not cpu (0), cuda (1) or sim (2)", op,
                   (int)dev);
  const lz_backend *be;
  if (dev != LZ_CPU) LZ_TRY(lz_backend_need(op, dev, &be));
  lz_tensor *t = malloc(sizeof *t);
  lz_storage *s = malloc(sizeof *s);
  if (!t || !s) {
    free(t);
    free(s);
    return lz_fail(LZ_ERR_NOMEM, "tensor_new: out of memory for metadata");
  }
  set_meta(t, NULL, dt, ndim, shape);
  t->device = dev;
  s->bytes = lz_tensor_bytes(t);
  lz_status st = dev != LZ_CPU ? lz_mem_alloc_device(&s->data, s->bytes, cat)
                 : pinned      ? lz_mem_alloc_pinned(&s->data, s->bytes)
                               : lz_mem_alloc(&s->data, s->bytes, cat);
  if (st != LZ_OK) {
    free(t);
    free(s);
    return st;
  }
  atomic_init(&s->refs, 1);
  t->data = s->data;
  t->storage = s;
  *out = t;
  return LZ_OK;
}

lz_status lz_tensor_view(lz_tensor **out, const lz_tensor *base, int64_t offset, int ndim,
                         const int64_t *shape) {
  *out = NULL;
  if (!base) return lz_fail(LZ_ERR_INVALID, "tensor_view: base is missing (NULL)");
  LZ_TRY(check_shape("tensor_view", base->dtype, ndim, shape));
  lz_tensor tmp;
  set_meta(&tmp, NULL, base->dtype, ndim, shape);
  int64_t n = lz_tensor_numel(&tmp), have = lz_tensor_numel(base);
  if (offset < 0 || offset > have || n > have - offset) {
    char b[96];
    return lz_fail(LZ_ERR_INVALID,
                   "tensor_view: elements [%lld, %lld) are outside the base %s (%lld elements)",
                   (long long)offset, (long long)(offset + n),
                   lz_tensor_describe(base, b, sizeof b), (long long)have);
  }
  lz_tensor *t = malloc(sizeof *t);
  if (!t) return lz_fail(LZ_ERR_NOMEM, "tensor_view: out of memory for metadata");
  *t = tmp;
  t->device = base->device;
  t->data = (char *)base->data + (size_t)offset * lz_dtype_size(base->dtype);
  t->storage = base->storage;
  if (t->storage) atomic_fetch_add(&t->storage->refs, 1);
  *out = t;
  return LZ_OK;
}

lz_status lz_tensor_wrap(lz_tensor **out, void *data, lz_dtype dt, int ndim,
                         const int64_t *shape) {
  *out = NULL;
  LZ_TRY(check_shape("tensor_wrap", dt, ndim, shape));
  lz_tensor *t = malloc(sizeof *t);
  if (!t) return lz_fail(LZ_ERR_NOMEM, "tensor_wrap: out of memory for metadata");
  set_meta(t, data, dt, ndim, shape);
  *out = t;
  return LZ_OK;
}

lz_status lz_tensor_free(lz_tensor *t) {
  if (!t || (t->flags & TENSOR_ARENA)) return LZ_OK;
  lz_storage *s = t->storage;
  free(t);
  if (s && atomic_fetch_sub(&s->refs, 1) == 1) {
    lz_status st = lz_mem_free(s->data);
    free(s);
    return st;
  }
  return LZ_OK;
}

/* ------------------------------------------------------------------ arena */

#define ARENA_ALIGN 64
#define ARENA_MAX_TENSORS 16384

struct lz_arena {
  char *data;
  size_t capacity, used, peak;
  lz_tensor *headers;
  int n_headers;
  int borrowed;     /* data belongs to the caller (lz_arena_wrap) */
  lz_device device; /* where data lives, and so its tensors */
};

lz_status lz_arena_new(lz_arena **out, size_t bytes, lz_mem_category cat) {
  return lz_arena_new_on(out, bytes, cat, LZ_CPU);
}

lz_status lz_arena_new_on(lz_arena **out, size_t bytes, lz_mem_category cat, lz_device dev) {
  *out = NULL;
  const char *op = dev == LZ_CPU ? "arena_new" : "arena_new_on";
  if (dev != LZ_CPU && dev != LZ_CUDA && dev != LZ_SIM)
    return lz_fail(LZ_ERR_INVALID, "%s: device %d is not cpu (0), cuda (1) or sim (2)", op,
                   (int)dev);
  const lz_backend *be;
  if (dev != LZ_CPU) LZ_TRY(lz_backend_need(op, dev, &be));
  lz_arena *a = calloc(1, sizeof *a);
  if (!a) return lz_fail(LZ_ERR_NOMEM, "%s: out of memory for metadata", op);
  a->device = dev;
  lz_status st = dev != LZ_CPU ? lz_mem_alloc_device((void **)&a->data, bytes, cat)
                               : lz_mem_alloc((void **)&a->data, bytes, cat);
  if (st == LZ_OK)
    st = lz_mem_alloc((void **)&a->headers, sizeof(lz_tensor) * ARENA_MAX_TENSORS,
                      LZ_MEM_WORKSPACE);
  if (st != LZ_OK) {
    lz_mem_free(a->data);
    free(a);
    return st;
  }
  a->capacity = bytes;
  *out = a;
  return LZ_OK;
}

lz_status lz_arena_wrap(lz_arena **out, void *data, size_t bytes) {
  *out = NULL;
  if (!data && bytes > 0) return lz_fail(LZ_ERR_INVALID, "arena_wrap: data is NULL");
  if ((uintptr_t)data % ARENA_ALIGN != 0)
    return lz_fail(LZ_ERR_INVALID,
                   "arena_wrap: data %p is not %d-byte aligned; pass an aligned offset into "
                   "the buffer",
                   data, ARENA_ALIGN);
  lz_arena *a = calloc(1, sizeof *a);
  if (!a) return lz_fail(LZ_ERR_NOMEM, "arena_wrap: out of memory for metadata");
  lz_status st =
      lz_mem_alloc((void **)&a->headers, sizeof(lz_tensor) * ARENA_MAX_TENSORS, LZ_MEM_WORKSPACE);
  if (st != LZ_OK) {
    free(a);
    return st;
  }
  a->data = data;
  a->capacity = bytes;
  a->borrowed = 1;
  a->device = (lz_device)lz_pointer_device(data);
  *out = a;
  return LZ_OK;
}

lz_status lz_arena_free(lz_arena *a) {
  if (!a) return LZ_OK;
  lz_mem_free(a->headers);
  lz_status st = a->borrowed ? LZ_OK : lz_mem_free(a->data);
  free(a);
  return st;
}

lz_status lz_arena_tensor(lz_arena *a, lz_tensor **out, lz_dtype dt, int ndim,
                          const int64_t *shape) {
  *out = NULL;
  LZ_TRY(check_shape("arena_tensor", dt, ndim, shape));
  if (a->n_headers >= ARENA_MAX_TENSORS)
    return lz_fail(LZ_ERR_NOMEM, "arena: more than %d tensors since the last reset",
                   ARENA_MAX_TENSORS);
  lz_tensor *t = &a->headers[a->n_headers];
  set_meta(t, NULL, dt, ndim, shape);
  size_t bytes = (lz_tensor_bytes(t) + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
  if (a->used + bytes > a->capacity)
    return lz_fail(LZ_ERR_NOMEM,
                   "arena: %zu bytes asked with %zu of %zu in use; make the arena larger",
                   bytes, a->used, a->capacity);
  t->data = a->data + a->used;
  t->device = a->device;
  t->flags = TENSOR_ARENA;
  a->used += bytes;
  if (a->used > a->peak) a->peak = a->used;
  a->n_headers++;
  *out = t;
  return LZ_OK;
}

lz_status lz_arena_reset(lz_arena *a) {
  a->used = 0;
  a->n_headers = 0;
  return LZ_OK;
}

lz_status lz_arena_rewind(lz_arena *a, size_t used) {
  if (used > a->used || used % ARENA_ALIGN)
    return lz_fail(LZ_ERR_INVALID,
                   "arena_rewind: %zu bytes; give what lz_arena_used said before the tensors "
                   "to drop (%zu in use now)",
                   used, a->used);
  a->used = used;
  return LZ_OK;
}

size_t lz_arena_used(const lz_arena *a) { return a->used; }
size_t lz_arena_peak(const lz_arena *a) { return a->peak; }
size_t lz_arena_capacity(const lz_arena *a) { return a->capacity; }
