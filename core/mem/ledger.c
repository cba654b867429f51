/* ledger.c — every byte luazero allocates, by category. Small blocks come from
 * aligned_alloc, 64-byte aligned (offload staging 4096-byte aligned, for
 * O_DIRECT); blocks from LZ_MEM_HUGE_THRESHOLD up are mmap'd, 2 MiB aligned
 * and advised onto transparent huge pages (a 256 MiB copy runs ~7x faster on
 * this kind of machine). A table keyed by address remembers size and category
 * so lz_mem_free needs only the pointer.
 *
 * Device memory and page-locked host memory come from the active
 * accelerator's table (cuda or sim), read through backend_slot.c (a leaf:
 * the ledger never calls up into devices/), and sit in the same table
 * (addresses are unified): device bytes are counted on a device side of
 * their own, pinned bytes on the host side as offload. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <errno.h>    /* errno for mmap failures */
#include <pthread.h>  /* the ledger lock */
#include <stdlib.h>   /* aligned_alloc, free */
#include <sys/mman.h> /* mmap, madvise */

#define HUGE_PAGE (2u << 20)
#define SMALL_ALIGN 64
#define OFFLOAD_ALIGN 4096 /* O_DIRECT swap I/O needs page-aligned buffers */

typedef struct {
  uintptr_t ptr; /* 0: empty, 1: deleted */
  size_t bytes;  /* bytes asked for (what the ledger counts) */
  size_t mapped; /* mmap length, 0 for aligned_alloc */
  void *base;    /* mmap base */
  int cat;
  int where; /* WHERE_HOST, WHERE_PINNED, WHERE_DEVICE, WHERE_SHARED */
} entry;

/* WHERE_SHARED: host memory the job's ranks share (shared_mem.c). */
enum { WHERE_HOST = 0, WHERE_PINNED = 1, WHERE_DEVICE = 2, WHERE_SHARED = 3 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static entry *table;
static size_t table_cap, table_used; /* used counts live + deleted slots */

/* The bytes of one side of the ledger, per category and all together: host
 * memory (pinned and shared included) on one, device memory on the other. */
typedef struct {
  int64_t current[LZ_MEM_COUNT], peak[LZ_MEM_COUNT];
  int64_t total_current, total_peak;
} side;
static side host_side, device_side;

static side *side_of(int where) { return where == WHERE_DEVICE ? &device_side : &host_side; }

/* Caller holds the lock. */
static void side_add(side *s, int cat, int64_t bytes) {
  s->current[cat] += bytes;
  if (s->current[cat] > s->peak[cat]) s->peak[cat] = s->current[cat];
  s->total_current += bytes;
  if (s->total_current > s->total_peak) s->total_peak = s->total_current;
}

static const char *category_names[LZ_MEM_COUNT] = {
    "params", "grads", "optimizer", "activations", "comm", "offload", "workspace"};

const char *lz_mem_category_name(lz_mem_category cat) {
  return (unsigned)cat < LZ_MEM_COUNT ? category_names[cat] : "unknown";
}

int64_t lz_mem_huge_threshold(void) { return HUGE_PAGE; }

static size_t slot_of(uintptr_t p, size_t cap) {
  uint64_t h = (uint64_t)p * 0x9E3779B97F4A7C15ull;
  return (size_t)(h >> 20) & (cap - 1);
}

/* Caller holds the lock. */
static int table_grow(void) {
  size_t ncap = table_cap ? table_cap * 2 : 1024;
  entry *nt = calloc(ncap, sizeof *nt);
  if (!nt) return 0;
  size_t live = 0;
  for (size_t i = 0; i < table_cap; i++) {
    if (table[i].ptr > 1) {
      size_t s = slot_of(table[i].ptr, ncap);
      while (nt[s].ptr) s = (s + 1) & (ncap - 1);
      nt[s] = table[i];
      live++;
    }
  }
  free(table);
  table = nt;
  table_cap = ncap;
  table_used = live;
  return 1;
}

static int table_insert(entry e) {
  if ((table_used + 1) * 2 > table_cap && !table_grow()) return 0;
  size_t s = slot_of(e.ptr, table_cap);
  while (table[s].ptr > 1) s = (s + 1) & (table_cap - 1);
  if (table[s].ptr == 0) table_used++;
  table[s] = e;
  return 1;
}

static entry *table_find(uintptr_t p) {
  if (!table_cap || p <= 1) return NULL; /* 0 and 1 mark empty and deleted slots */
  size_t s = slot_of(p, table_cap);
  while (table[s].ptr) {
    if (table[s].ptr == p) return &table[s];
    s = (s + 1) & (table_cap - 1);
  }
  return NULL;
}

/* Puts a new block in the table and counts it on its side; 0 when the
 * table cannot grow. */
static int record(entry e) {
  pthread_mutex_lock(&lock);
  int ok = table_insert(e);
  if (ok) side_add(side_of(e.where), e.cat, (int64_t)e.bytes);
  pthread_mutex_unlock(&lock);
  return ok;
}

lz_status lz_mem_alloc(void **out, size_t bytes, lz_mem_category cat) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "mem_alloc: out is NULL");
  *out = NULL;
  if ((unsigned)cat >= LZ_MEM_COUNT)
    return lz_fail(LZ_ERR_INVALID, "mem_alloc: category %d is not one of 0..%d", (int)cat,
                   LZ_MEM_COUNT - 1);
  /* Rounding a size this close to SIZE_MAX up to pages would wrap to a small
   * mapping; and the ledger counts in int64_t. */
  if (bytes > (size_t)INT64_MAX - 2 * (size_t)HUGE_PAGE)
    return lz_fail(LZ_ERR_NOMEM, "mem_alloc: %zu bytes for %s is more than any machine has",
                   bytes, lz_mem_category_name(cat));
  entry e = {0};
  e.bytes = bytes;
  e.cat = (int)cat;
  size_t asked = bytes ? bytes : 1;
  void *sp;
  if (lz_shared_wants(asked, cat) && lz_shared_alloc(&sp, asked) == LZ_OK) {
    e.ptr = (uintptr_t)sp;
    e.where = WHERE_SHARED;
  } else if (asked >= HUGE_PAGE) {
    size_t len = (asked + HUGE_PAGE - 1) & ~(size_t)(HUGE_PAGE - 1);
    size_t map_len = len + HUGE_PAGE;
    void *base = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
      return lz_fail(LZ_ERR_NOMEM, "mem_alloc: mmap of %zu bytes for %s failed: %s", map_len,
                     lz_mem_category_name(cat), strerror(errno));
    uintptr_t p = ((uintptr_t)base + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    madvise((void *)p, len, MADV_HUGEPAGE); /* advice: ignored where THP is off */
    e.ptr = p;
    e.base = base;
    e.mapped = map_len;
  } else {
    size_t align = cat == LZ_MEM_OFFLOAD ? OFFLOAD_ALIGN : SMALL_ALIGN;
    size_t len = (asked + align - 1) & ~(align - 1);
    void *p = aligned_alloc(align, len);
    if (!p)
      return lz_fail(LZ_ERR_NOMEM, "mem_alloc: %zu bytes for %s: out of memory", bytes,
                     lz_mem_category_name(cat));
    e.ptr = (uintptr_t)p;
  }
  if (!record(e)) {
    if (e.where == WHERE_SHARED) lz_shared_free((void *)e.ptr, e.bytes);
    else if (e.mapped) munmap(e.base, e.mapped);
    else free((void *)e.ptr);
    return lz_fail(LZ_ERR_NOMEM, "mem_alloc: ledger table full (out of memory)");
  }
  *out = (void *)e.ptr;
  return LZ_OK;
}

lz_status lz_mem_free(void *ptr) {
  if (!ptr) return LZ_OK;
  pthread_mutex_lock(&lock);
  entry *f = table_find((uintptr_t)ptr);
  if (!f) {
    pthread_mutex_unlock(&lock);
    return lz_fail(LZ_ERR_INVALID, "mem_free: %p was not allocated by lz_mem_alloc (or was "
                   "freed already)", ptr);
  }
  entry e = *f;
  f->ptr = 1; /* tombstone */
  side *sd = side_of(e.where);
  sd->current[e.cat] -= (int64_t)e.bytes;
  sd->total_current -= (int64_t)e.bytes;
  pthread_mutex_unlock(&lock);
  if (e.where == WHERE_SHARED) {
    lz_shared_free(ptr, e.bytes);
    return LZ_OK;
  }
  if (e.where != WHERE_HOST) {
    const lz_backend *be = lz_backend_active();
    if (!be)
      return lz_fail(LZ_ERR_INTERNAL, "mem_free: %p is device memory but no backend is loaded",
                     ptr);
    return e.where == WHERE_DEVICE ? be->free(ptr) : be->host_free(ptr);
  }
  if (e.mapped) munmap(e.base, e.mapped);
  else free(ptr);
  return LZ_OK;
}

/* A count read under the lock; per category, one out of range reads 0. */
static int64_t read_locked(const int64_t *v) {
  pthread_mutex_lock(&lock);
  int64_t x = *v;
  pthread_mutex_unlock(&lock);
  return x;
}
static int64_t read_cat(const int64_t *v, lz_mem_category cat) {
  return (unsigned)cat < LZ_MEM_COUNT ? read_locked(&v[cat]) : 0;
}

int64_t lz_mem_current(lz_mem_category cat) { return read_cat(host_side.current, cat); }
int64_t lz_mem_peak(lz_mem_category cat) { return read_cat(host_side.peak, cat); }
int64_t lz_mem_total_current(void) { return read_locked(&host_side.total_current); }
int64_t lz_mem_total_peak(void) { return read_locked(&host_side.total_peak); }
int64_t lz_mem_device_current(lz_mem_category cat) { return read_cat(device_side.current, cat); }
int64_t lz_mem_device_peak(lz_mem_category cat) { return read_cat(device_side.peak, cat); }
int64_t lz_mem_device_total_current(void) { return read_locked(&device_side.total_current); }
int64_t lz_mem_device_total_peak(void) { return read_locked(&device_side.total_peak); }

void lz_mem_reset_peak(void) {
  pthread_mutex_lock(&lock);
  side *sides[2] = {&host_side, &device_side};
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < LZ_MEM_COUNT; i++) sides[k]->peak[i] = sides[k]->current[i];
    sides[k]->total_peak = sides[k]->total_current;
  }
  pthread_mutex_unlock(&lock);
}

/* ------------------------------------------------- device and pinned memory */

static lz_status device_alloc(void **out, size_t bytes, lz_mem_category cat, int where) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "mem_alloc_%s: out is NULL",
                           where == WHERE_DEVICE ? "device" : "pinned");
  *out = NULL;
  const char *what = where == WHERE_DEVICE ? "mem_alloc_device" : "mem_alloc_pinned";
  if ((unsigned)cat >= LZ_MEM_COUNT)
    return lz_fail(LZ_ERR_INVALID, "%s: category %d is not one of 0..%d", what, (int)cat,
                   LZ_MEM_COUNT - 1);
  const lz_backend *be;
  LZ_TRY(lz_backend_need_any(what, &be));
  void *p = NULL;
  /* A zero-byte block still gets a unique address, as on the host side. */
  size_t asked = bytes ? bytes : 1;
  LZ_TRY(where == WHERE_DEVICE ? be->alloc(&p, asked) : be->host_alloc(&p, asked));
  entry e = {.ptr = (uintptr_t)p, .bytes = bytes, .cat = (int)cat, .where = where};
  if (!record(e)) {
    if (where == WHERE_DEVICE) be->free(p);
    else be->host_free(p);
    return lz_fail(LZ_ERR_NOMEM, "%s: ledger table full (out of memory)", what);
  }
  *out = p;
  return LZ_OK;
}

lz_status lz_mem_alloc_device(void **out, size_t bytes, lz_mem_category cat) {
  return device_alloc(out, bytes, cat, WHERE_DEVICE);
}

lz_status lz_mem_alloc_pinned(void **out, size_t bytes) {
  return device_alloc(out, bytes, LZ_MEM_OFFLOAD, WHERE_PINNED);
}
