/* sim_memory.c — the sim device's memory: one memfd of LZ_SIM_MEMORY bytes
 * mapped twice, PROT_NONE where the host sees device pointers (any host
 * access faults) and read-write in an alias known only to the device, where
 * ops and copies run. First fit over the region, 256-byte aligned; freed
 * blocks of 1 MiB and more give their pages back (hole punching). And its
 * "pinned" host memory, which is ordinary host memory. */
#define _GNU_SOURCE /* memfd_create, fallocate */
#include "devices/lz_sim.h"
#include "devices/sim_internal.h"
#include "mem/lz_internal.h"

#include <assert.h>   /* programmer errors */
#include <ctype.h>    /* isdigit for LZ_SIM_MEMORY */
#include <errno.h>    /* strtoull, mmap errors */
#include <fcntl.h>    /* fallocate, FALLOC_FL_PUNCH_HOLE */
#include <pthread.h>  /* the allocator's lock */
#include <stdio.h>    /* snprintf */
#include <stdlib.h>   /* malloc, aligned_alloc */
#include <sys/mman.h> /* memfd_create, mmap, madvise */
#include <unistd.h>   /* ftruncate, close */

#define SIM_ALIGN 256
#define PUNCH_MIN ((size_t)1 << 20)
#define PAGE ((size_t)4096)
#define HUGE_PAGE ((size_t)2 << 20)
#define DEFAULT_MEMORY "8GiB"

typedef struct block {
  size_t off, len;
  int used;
  struct block *prev, *next;
} block;

static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static int mem_fd = -1;
static uint8_t *dev_base;   /* PROT_NONE: what the host sees and faults on */
static uint8_t *alias_base; /* read-write: where ops and copies run */
static size_t capacity, in_use;
static char memory_setting[96]; /* LZ_SIM_MEMORY as given, for messages */
static block *blocks;           /* every block, in address order */

/* Big pinned blocks are mmap'd: their mappings, to unmap them. */
typedef struct pinned_map {
  void *ptr, *base;
  size_t len;
  struct pinned_map *next;
} pinned_map;
static pinned_map *pinned_maps;

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static int in_device(const void *p) {
  return dev_base && (const uint8_t *)p >= dev_base && (const uint8_t *)p < dev_base + capacity;
}

/* p..p+bytes in device memory: the alias address; NULL when p is not device
 * memory; *bad when it starts there but runs past the end. */
void *lz_sim_translate(const void *p, size_t bytes, int *bad) {
  *bad = 0;
  if (!in_device(p)) return NULL;
  size_t off = (size_t)((const uint8_t *)p - dev_base);
  if (bytes > capacity - off) *bad = 1;
  return alias_base + off;
}

void *lz_sim_host_view(const void *device_ptr) {
  int bad;
  return lz_sim_translate(device_ptr, 0, &bad);
}

lz_status lz_sim_parse_memory(const char *value, size_t *out) {
  const char *s = value ? value : "";
  char *end = NULL;
  errno = 0;
  unsigned long long v = isdigit((unsigned char)s[0]) ? strtoull(s, &end, 10) : 0;
  unsigned long long unit = 0;
  if (end && !errno) {
    if (!*end)
      unit = 1;
    else if (!strcmp(end, "KiB"))
      unit = 1ull << 10;
    else if (!strcmp(end, "MiB"))
      unit = 1ull << 20;
    else if (!strcmp(end, "GiB"))
      unit = 1ull << 30;
  }
  if (!unit || v == 0 || v > (1ull << 46) / unit)
    return lz_fail(LZ_ERR_INVALID,
                   "sim: LZ_SIM_MEMORY=\"%s\" is not a size; give bytes, or a whole number with "
                   "KiB, MiB or GiB (e.g. 8GiB), at most 64 TiB",
                   s);
  *out = (size_t)(v * unit);
  return LZ_OK;
}

lz_status lz_sim_mem_alloc(void **out, size_t bytes) {
  *out = NULL;
  LZ_TRY(lz_sim_sticky_error());
  size_t need = round_up(bytes ? bytes : 1, SIM_ALIGN);
  pthread_mutex_lock(&mem_mu);
  block *b = blocks;
  size_t largest = 0;
  for (; b; b = b->next) {
    if (b->used) continue;
    if (b->len >= need) break;
    if (b->len > largest) largest = b->len;
  }
  if (!b) {
    size_t used = in_use;
    pthread_mutex_unlock(&mem_mu);
    char a[32], u[32], c[32], l[32], frag[96] = "";
    if (need <= capacity - used)
      snprintf(frag, sizeof frag, "; the largest free block is %zu (%s)", largest,
               lz_format_bytes(largest, l, sizeof l));
    return lz_fail(LZ_ERR_NOMEM,
                   "sim: out of device memory: %zu bytes (%s) asked with %zu (%s) of %zu (%s) in "
                   "use (LZ_SIM_MEMORY=%s)%s; use a higher ZeRO stage, offload, or a smaller "
                   "batch, or raise LZ_SIM_MEMORY",
                   bytes, lz_format_bytes(bytes, a, sizeof a), used,
                   lz_format_bytes(used, u, sizeof u), capacity,
                   lz_format_bytes(capacity, c, sizeof c), memory_setting, frag);
  }
  if (b->len > need) {
    block *rest = malloc(sizeof *rest);
    if (!rest) {
      pthread_mutex_unlock(&mem_mu);
      return lz_fail(LZ_ERR_NOMEM, "sim: out of host memory for the allocator's bookkeeping");
    }
    *rest = (block){.off = b->off + need, .len = b->len - need, .prev = b, .next = b->next};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->len = need;
  }
  b->used = 1;
  in_use += b->len;
  *out = dev_base + b->off;
  pthread_mutex_unlock(&mem_mu);
  return LZ_OK;
}

/* Merges b's successor into b (both free). */
static void merge_next(block *b) {
  block *n = b->next;
  b->len += n->len;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  free(n);
}

/* As cudaFree: waits for all streams first, since queued work may still use
 * the block. */
lz_status lz_sim_mem_free(void *p) {
  lz_sim_wait_all();
  assert(in_device(p));
  size_t off = (size_t)((uint8_t *)p - dev_base);
  pthread_mutex_lock(&mem_mu);
  block *b = blocks;
  while (b && b->off != off) b = b->next;
  assert(b && b->used); /* the ledger hands back only what alloc gave */
  b->used = 0;
  size_t freed = b->len;
  in_use -= freed;
  if (b->next && !b->next->used) merge_next(b);
  if (b->prev && !b->prev->used) {
    b = b->prev;
    merge_next(b);
  }
  if (freed >= PUNCH_MIN) {
    /* The whole pages of the free region go back to the system; the next
     * use of them reads zeros, which nothing may rely on. */
    size_t lo = round_up(b->off, PAGE), hi = (b->off + b->len) / PAGE * PAGE;
    if (hi > lo)
      fallocate(mem_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)lo, (off_t)(hi - lo));
  }
  pthread_mutex_unlock(&mem_mu);
  return LZ_OK;
}

/* "Pinned" memory is ordinary host memory here: 4096-aligned, on 2 MiB
 * transparent huge pages from 2 MiB up (as the ledger's big blocks). */
lz_status lz_sim_pinned_alloc(void **out, size_t bytes) {
  *out = NULL;
  if (bytes < HUGE_PAGE) {
    *out = aligned_alloc(PAGE, round_up(bytes ? bytes : 1, PAGE));
    if (!*out)
      return lz_fail(LZ_ERR_NOMEM, "sim: %zu bytes of pinned host memory: out of memory", bytes);
    return LZ_OK;
  }
  size_t len = round_up(bytes, HUGE_PAGE) + HUGE_PAGE;
  void *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  pinned_map *m = malloc(sizeof *m);
  if (base == MAP_FAILED || !m) {
    if (base != MAP_FAILED) munmap(base, len);
    free(m);
    return lz_fail(LZ_ERR_NOMEM, "sim: mmap of %zu bytes of pinned host memory failed: %s", len,
                   strerror(errno));
  }
  void *p = (void *)round_up((uintptr_t)base, HUGE_PAGE);
  madvise(p, len - HUGE_PAGE, MADV_HUGEPAGE); /* advice: ignored where THP is off */
  *m = (pinned_map){.ptr = p, .base = base, .len = len};
  pthread_mutex_lock(&mem_mu);
  m->next = pinned_maps;
  pinned_maps = m;
  pthread_mutex_unlock(&mem_mu);
  *out = p;
  return LZ_OK;
}

lz_status lz_sim_pinned_free(void *p) {
  lz_sim_wait_all(); /* a queued copy may still read or write it */
  pthread_mutex_lock(&mem_mu);
  pinned_map **at = &pinned_maps;
  while (*at && (*at)->ptr != p) at = &(*at)->next;
  pinned_map *m = *at;
  if (m) *at = m->next;
  pthread_mutex_unlock(&mem_mu);
  if (!m) {
    free(p);
    return LZ_OK;
  }
  munmap(m->base, m->len);
  free(m);
  return LZ_OK;
}

int lz_sim_is_device_pointer(const void *p) { return in_device(p); }

lz_status lz_sim_memory_open(void) {
  const char *setting = getenv("LZ_SIM_MEMORY");
  size_t cap;
  if (setting && *setting) {
    LZ_TRY(lz_sim_parse_memory(setting, &cap));
    snprintf(memory_setting, sizeof memory_setting, "%.60s", setting);
  } else {
    LZ_TRY(lz_sim_parse_memory(DEFAULT_MEMORY, &cap));
    snprintf(memory_setting, sizeof memory_setting, "%s, the default", DEFAULT_MEMORY);
  }
  cap = round_up(cap, PAGE);

  int fd = memfd_create("luazero-sim", MFD_CLOEXEC);
  if (fd < 0) return lz_fail(LZ_ERR_INTERNAL, "sim: memfd_create failed: %s", strerror(errno));
  char c[32];
  if (ftruncate(fd, (off_t)cap) != 0) {
    int e = errno;
    close(fd);
    return lz_fail(LZ_ERR_NOMEM,
                   "sim: sizing device memory to %zu bytes (%s, LZ_SIM_MEMORY=%s) failed: %s", cap,
                   lz_format_bytes(cap, c, sizeof c), memory_setting, strerror(e));
  }
  void *d = mmap(NULL, cap, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  void *h = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (d == MAP_FAILED || h == MAP_FAILED) {
    int e = errno;
    if (d != MAP_FAILED) munmap(d, cap);
    if (h != MAP_FAILED) munmap(h, cap);
    close(fd);
    return lz_fail(LZ_ERR_NOMEM,
                   "sim: mapping %zu bytes (%s, LZ_SIM_MEMORY=%s) of device memory failed: %s", cap,
                   lz_format_bytes(cap, c, sizeof c), memory_setting, strerror(e));
  }
  block *all = malloc(sizeof *all);
  if (!all) {
    munmap(d, cap);
    munmap(h, cap);
    close(fd);
    return lz_fail(LZ_ERR_NOMEM, "sim: out of host memory");
  }
  *all = (block){.off = 0, .len = cap};
  mem_fd = fd;
  dev_base = d;
  alias_base = h;
  capacity = cap;
  in_use = 0;
  blocks = all;
  return LZ_OK;
}

int64_t lz_sim_capacity(void) { return lz_sim_ready() ? (int64_t)capacity : 0; }
