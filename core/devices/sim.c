/* sim.c — the sim device: an accelerator CI can test exactly. It runs the
 * cpu kernels, but on memory the host cannot touch and on streams that run
 * asynchronously, so a missing copy, a host read of device memory or a
 * missing wait shows up as a fault or a wrong result, as on a GPU.
 *
 *   - Memory: one memfd of LZ_SIM_MEMORY bytes mapped twice. The device
 *     mapping is PROT_NONE: its addresses are what alloc hands out, so any
 *     host access through a device pointer faults. The alias mapping is
 *     read-write and known only here: ops and copies run on device pointers
 *     translated into it. First fit over the region, 256-byte aligned;
 *     freed blocks of 1 MiB and more give their pages back (hole punching).
 *   - Streams: one worker thread per lz_stream_kind, each running its FIFO
 *     queue in order. An op is copied by value into its queue item (tensor
 *     headers translated to the alias, marked cpu) and the worker calls the
 *     public cpu function on them: it checks again and runs the cpu kernel.
 *   - Events: per stream a count of items queued and one done; an event is
 *     (stream, queued count) at its record.
 *   - Jitter (LZ_SIM_JITTER=<seed>): each item first sleeps a pseudo-random
 *     0..LZ_SIM_JITTER_US microseconds.
 *   - Errors: a failing item leaves a sticky error that every later call
 *     returns, as CUDA's do. */
#define _GNU_SOURCE /* memfd_create, fallocate */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"
#include "devices/lz_sim.h"

#include <assert.h>   /* programmer errors */
#include <ctype.h>    /* isdigit for LZ_SIM_MEMORY */
#include <errno.h>    /* strtoull, mmap errors */
#include <fcntl.h>    /* fallocate, FALLOC_FL_PUNCH_HOLE */
#include <omp.h>      /* omp_set_num_threads in the workers */
#include <pthread.h>  /* workers, the queue lock */
#include <stdio.h>    /* snprintf */
#include <stdlib.h>   /* getenv, calloc, atexit */
#include <sys/mman.h> /* memfd_create, mmap, madvise */
#include <time.h>     /* nanosleep for the jitter */
#include <unistd.h>   /* ftruncate, close */

#define SIM_ALIGN 256
#define PUNCH_MIN ((size_t)1 << 20)
#define PAGE ((size_t)4096)
#define HUGE_PAGE ((size_t)2 << 20)
#define DEFAULT_MEMORY "8GiB"

static const char *stream_names[LZ_STREAM_COUNT] = {"compute", "comm", "copy"};

static const char *op_names[LZ_OP_COUNT] = {
    [LZ_OP_MATMUL] = "matmul",
    [LZ_OP_LINEAR_FORWARD] = "linear_forward",
    [LZ_OP_LINEAR_BACKWARD] = "linear_backward",
    [LZ_OP_LAYERNORM_FORWARD] = "layernorm_forward",
    [LZ_OP_LAYERNORM_BACKWARD] = "layernorm_backward",
    [LZ_OP_GELU_FORWARD] = "gelu_forward",
    [LZ_OP_GELU_BACKWARD] = "gelu_backward",
    [LZ_OP_ATTENTION_FORWARD] = "attention_forward",
    [LZ_OP_ATTENTION_BACKWARD] = "attention_backward",
    [LZ_OP_EMBEDDING_FORWARD] = "embedding_forward",
    [LZ_OP_EMBEDDING_BACKWARD] = "embedding_backward",
    [LZ_OP_CROSS_ENTROPY_FORWARD] = "cross_entropy_forward",
    [LZ_OP_CROSS_ENTROPY_BACKWARD] = "cross_entropy_backward",
    [LZ_OP_ADD] = "add",
    [LZ_OP_AXPY] = "axpy",
    [LZ_OP_SCALE] = "scale",
    [LZ_OP_FILL] = "fill",
    [LZ_OP_SQ_NORM] = "sq_norm",
    [LZ_OP_HAS_INF_NAN] = "has_inf_nan",
    [LZ_OP_ADAMW_STEP] = "adamw_step",
    [LZ_OP_CONVERT] = "tensor_copy",
    [LZ_OP_LION_STEP] = "lion_step",
    [LZ_OP_RMSNORM_FORWARD] = "rmsnorm_forward",
    [LZ_OP_RMSNORM_BACKWARD] = "rmsnorm_backward",
    [LZ_OP_ROPE_FORWARD] = "rope_forward",
    [LZ_OP_ROPE_BACKWARD] = "rope_backward",
    [LZ_OP_SWIGLU_FORWARD] = "swiglu_forward",
    [LZ_OP_SWIGLU_BACKWARD] = "swiglu_backward",
};

/* ------------------------------------------------------------- the queues */

enum { ITEM_OP, ITEM_COPY, ITEM_WAIT };

typedef struct item {
  int kind;
  struct item *next;
  /* ITEM_OP: the op's arguments by value; args.t points into shadow. */
  lz_op op;
  lz_op_args args;
  lz_tensor shadow[LZ_OP_MAX_TENSORS];
  lz_adamw_args adamw;
  lz_lion_args lion;
  int threads; /* the caller's OpenMP thread count */
  char *fail;  /* injected failure (tests): the message, malloc'd */
  /* ITEM_COPY */
  void *dst;
  const void *src;
  size_t bytes;
  /* ITEM_WAIT: until stream wait_stream has done wait_count items */
  int wait_stream;
  uint64_t wait_count;
} item;

typedef struct {
  item *head, *tail;
  uint64_t queued, done;
  pthread_t thread;
  uint64_t rng; /* the jitter's xorshift state (the worker's own) */
} stream;

/* One lock and one condition for the queues, the counts and the sticky
 * error: the workers wait on it for work, the host for progress. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static stream streams[LZ_STREAM_COUNT];
static int started, stopping;
static char sticky[1024];
static char *fail_next;    /* lz_sim_inject_failure */
static unsigned jitter_us; /* read by the workers: atomic loads */
/* LZ_SIM_COPY_GBPS: host<->device copies take at least bytes / this (a
 * PCIe link's pace; 0: as fast as memcpy). copy_ns: time copies took. */
static double copy_gbps;
static uint64_t copy_ns;
static uint64_t jitter_seed;

/* ------------------------------------------------------------ the memory */

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
static void *translate(const void *p, size_t bytes, int *bad) {
  *bad = 0;
  if (!in_device(p)) return NULL;
  size_t off = (size_t)((const uint8_t *)p - dev_base);
  if (bytes > capacity - off) *bad = 1;
  return alias_base + off;
}

void *lz_sim_host_view(const void *device_ptr) {
  int bad;
  return translate(device_ptr, 0, &bad);
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

static lz_status sticky_error(void) {
  char msg[sizeof sticky];
  pthread_mutex_lock(&mu);
  snprintf(msg, sizeof msg, "%s", sticky);
  pthread_mutex_unlock(&mu);
  if (!msg[0]) return LZ_OK;
  return lz_fail(LZ_ERR_INTERNAL, "%s", msg);
}

static void wait_for(int s, uint64_t count) {
  pthread_mutex_lock(&mu);
  while (streams[s].done < count) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
}

static void wait_all(void) {
  uint64_t want[LZ_STREAM_COUNT];
  pthread_mutex_lock(&mu);
  for (int s = 0; s < LZ_STREAM_COUNT; s++) want[s] = streams[s].queued;
  pthread_mutex_unlock(&mu);
  for (int s = 0; s < LZ_STREAM_COUNT; s++) wait_for(s, want[s]);
}

static lz_status sim_alloc(void **out, size_t bytes) {
  *out = NULL;
  LZ_TRY(sticky_error());
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
static lz_status sim_free(void *p) {
  wait_all();
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
static lz_status sim_host_alloc(void **out, size_t bytes) {
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

static lz_status sim_host_free(void *p) {
  wait_all(); /* a queued copy may still read or write it */
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

static int sim_is_device_pointer(const void *p) { return in_device(p); }

/* ------------------------------------------------------------ the workers */

static void jitter(stream *s) {
  uint64_t seed = __atomic_load_n(&jitter_seed, __ATOMIC_RELAXED);
  unsigned max_us = __atomic_load_n(&jitter_us, __ATOMIC_RELAXED);
  if (!seed || !max_us) return;
  uint64_t x = s->rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  s->rng = x;
  uint64_t us = x % ((uint64_t)max_us + 1);
  struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* The public cpu function of op on the item's shadow tensors. */
static lz_status run_op(const item *it) {
  const lz_op_args *a = &it->args;
  lz_tensor *const *t = a->t;
  switch (it->op) {
    case LZ_OP_MATMUL:
      return lz_matmul(t[0], t[1], t[2], (int)a->i[0], (int)a->i[1], a->f[0], a->f[1]);
    case LZ_OP_LINEAR_FORWARD:
      return lz_linear_forward(t[0], t[1], t[2], t[3]);
    case LZ_OP_LINEAR_BACKWARD:
      return lz_linear_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
    case LZ_OP_LAYERNORM_FORWARD:
      return lz_layernorm_forward(t[0], t[1], t[2], t[3], t[4], t[5], a->f[0]);
    case LZ_OP_LAYERNORM_BACKWARD:
      return lz_layernorm_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]);
    case LZ_OP_GELU_FORWARD:
      return lz_gelu_forward(t[0], t[1]);
    case LZ_OP_GELU_BACKWARD:
      return lz_gelu_backward(t[0], t[1], t[2]);
    case LZ_OP_ATTENTION_FORWARD: /* i[1]: n_kv_head, 0 for n_head */
      return lz_attention_gqa_forward(t[0], t[1], t[2], (int)a->i[0],
                                      (int)(a->i[1] ? a->i[1] : a->i[0]));
    case LZ_OP_ATTENTION_BACKWARD:
      return lz_attention_gqa_backward(t[0], t[1], t[2], t[3], t[4], (int)a->i[0],
                                       (int)(a->i[1] ? a->i[1] : a->i[0]));
    case LZ_OP_EMBEDDING_FORWARD:
      return lz_embedding_forward(t[0], t[1], t[2], t[3]);
    case LZ_OP_EMBEDDING_BACKWARD:
      return lz_embedding_backward(t[0], t[1], t[2], t[3]);
    case LZ_OP_CROSS_ENTROPY_FORWARD:
      return lz_cross_entropy_forward(t[0], t[1], t[2], a->i[0]);
    case LZ_OP_CROSS_ENTROPY_BACKWARD:
      return lz_cross_entropy_backward(t[0], t[1], t[2], a->i[0], a->f[0]);
    case LZ_OP_ADD:
      return lz_add(t[0], t[1], t[2]);
    case LZ_OP_AXPY:
      return lz_axpy(t[0], a->f[0], t[1]);
    case LZ_OP_SCALE:
      return lz_scale(t[0], a->f[0]);
    case LZ_OP_FILL:
      return lz_fill(t[0], a->f[0]);
    case LZ_OP_SQ_NORM:
      return lz_sq_norm(t[0], a->out_f64);
    case LZ_OP_HAS_INF_NAN:
      return lz_has_inf_nan(t[0], a->out_int);
    case LZ_OP_ADAMW_STEP:
      return lz_adamw_step(t[0], t[1], t[2], t[3], t[4], a->adamw);
    case LZ_OP_CONVERT:
      return lz_tensor_copy(t[0], t[1]);
    case LZ_OP_LION_STEP:
      return lz_lion_step(t[0], t[1], t[2], t[3], a->lion);
    case LZ_OP_RMSNORM_FORWARD:
      return lz_rmsnorm_forward(t[0], t[1], t[2], t[3], a->f[0]);
    case LZ_OP_RMSNORM_BACKWARD:
      return lz_rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]);
    case LZ_OP_ROPE_FORWARD:
      if (t[2]) return lz_rope_freqs_forward(t[0], t[1], t[2], (int)a->i[0], a->i[2]);
      return lz_rope_forward(t[0], t[1], (int)a->i[0], (int)a->i[1], a->i[2], a->f[0]);
    case LZ_OP_ROPE_BACKWARD:
      if (t[2]) return lz_rope_freqs_backward(t[0], t[1], t[2], (int)a->i[0], a->i[2]);
      return lz_rope_backward(t[0], t[1], (int)a->i[0], (int)a->i[1], a->i[2], a->f[0]);
    case LZ_OP_SWIGLU_FORWARD:
      return lz_swiglu_forward(t[0], t[1], t[2]);
    case LZ_OP_SWIGLU_BACKWARD:
      return lz_swiglu_backward(t[0], t[1], t[2], t[3], t[4]);
    case LZ_OP_COUNT:
      break;
  }
  assert(!"sim: an op without a case");
  return LZ_ERR_INTERNAL;
}

static int has_sticky(void) {
  pthread_mutex_lock(&mu);
  int set = sticky[0] != 0;
  pthread_mutex_unlock(&mu);
  return set;
}

static void set_sticky(int s, const char *what, const char *msg) {
  pthread_mutex_lock(&mu);
  if (!sticky[0])
    snprintf(sticky, sizeof sticky, "sim: %s on the %s stream failed: %.900s", what,
             stream_names[s], msg);
  pthread_mutex_unlock(&mu);
}

static void run_item(int s, item *it, int *threads) {
  switch (it->kind) {
    case ITEM_OP: {
      /* After a failure nothing more runs on the device, as on a GPU. */
      if (has_sticky()) return;
      if (it->threads != *threads) {
        omp_set_num_threads(it->threads);
        *threads = it->threads;
      }
      lz_status st = it->fail ? lz_fail(LZ_ERR_INTERNAL, "%s", it->fail) : run_op(it);
      if (st != LZ_OK) set_sticky(s, op_names[it->op], lz_last_error());
      return;
    }
    case ITEM_COPY: {
      struct timespec a, b;
      clock_gettime(CLOCK_MONOTONIC, &a);
      if (!has_sticky()) memmove(it->dst, it->src, it->bytes);
      if (copy_gbps > 0) {
        double want = (double)it->bytes / (copy_gbps * 1e9);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double took = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        if (want > took) {
          double rest = want - took;
          struct timespec ts = {.tv_sec = (time_t)rest,
                                .tv_nsec = (long)((rest - (double)(time_t)rest) * 1e9)};
          nanosleep(&ts, NULL);
        }
      }
      clock_gettime(CLOCK_MONOTONIC, &b);
      __atomic_fetch_add(&copy_ns,
                         (uint64_t)((b.tv_sec - a.tv_sec) * 1000000000ll + (b.tv_nsec - a.tv_nsec)),
                         __ATOMIC_RELAXED);
      return;
    }
    case ITEM_WAIT:
      pthread_mutex_lock(&mu);
      while (streams[it->wait_stream].done < it->wait_count && !stopping)
        pthread_cond_wait(&cv, &mu);
      pthread_mutex_unlock(&mu);
      return;
  }
}

static void *worker_main(void *arg) {
  int s = (int)(intptr_t)arg;
  stream *st = &streams[s];
  int threads = omp_get_max_threads();
  pthread_mutex_lock(&mu);
  for (;;) {
    while (!st->head && !stopping) pthread_cond_wait(&cv, &mu);
    item *it = st->head;
    if (!it) break; /* stopping, and nothing left */
    st->head = it->next;
    if (!st->head) st->tail = NULL;
    int drop = stopping; /* at exit: what is left is not run */
    pthread_mutex_unlock(&mu);
    if (!drop) {
      jitter(st);
      run_item(s, it, &threads);
    }
    free(it->fail);
    free(it);
    pthread_mutex_lock(&mu);
    st->done++;
    pthread_cond_broadcast(&cv);
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

/* Queues it on stream s; returns its ticket (done >= ticket: it has run). */
static uint64_t enqueue(int s, item *it) {
  pthread_mutex_lock(&mu);
  uint64_t ticket = ++streams[s].queued;
  if (stopping) { /* exiting: the workers are gone or going */
    streams[s].done++;
    pthread_mutex_unlock(&mu);
    free(it->fail);
    free(it);
    return ticket;
  }
  if (streams[s].tail)
    streams[s].tail->next = it;
  else
    streams[s].head = it;
  streams[s].tail = it;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  return ticket;
}

/* At exit: work still queued is dropped (the process is going), the item
 * running finishes, the workers are joined. */
static void shutdown_workers(void) {
  pthread_mutex_lock(&mu);
  if (!started) {
    pthread_mutex_unlock(&mu);
    return;
  }
  stopping = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  for (int s = 0; s < LZ_STREAM_COUNT; s++) pthread_join(streams[s].thread, NULL);
}

/* ------------------------------------------------------------- the table */

static lz_status sim_compute(lz_op op, const lz_op_args *a) {
  assert((unsigned)op < LZ_OP_COUNT);
  LZ_TRY(sticky_error());
  item *it = calloc(1, sizeof *it);
  if (!it) return lz_fail(LZ_ERR_NOMEM, "sim: %s: out of host memory for the queue", op_names[op]);
  it->kind = ITEM_OP;
  it->op = op;
  it->args = *a;
  for (int i = 0; i < LZ_OP_MAX_TENSORS; i++) {
    const lz_tensor *t = a->t[i];
    if (!t) continue;
    int same = -1; /* one tensor passed twice stays one */
    for (int j = 0; j < i && same < 0; j++)
      if (a->t[j] == t) same = j;
    if (same >= 0) {
      it->args.t[i] = it->args.t[same];
      continue;
    }
    size_t bytes = lz_tensor_bytes(t);
    int bad;
    void *h = translate(t->data, bytes, &bad);
    if ((!h && bytes) || bad) {
      free(it);
      char buf[96];
      return lz_fail(LZ_ERR_INVALID, "sim: %s: a tensor %s at %p is not sim device memory",
                     op_names[op], lz_tensor_describe(t, buf, sizeof buf), t->data);
    }
    it->shadow[i] = *t;
    if (h) it->shadow[i].data = h;
    it->shadow[i].device = LZ_CPU;
    it->shadow[i].storage = NULL;
    it->shadow[i].flags = 0;
    it->args.t[i] = &it->shadow[i];
  }
  if (a->adamw) {
    it->adamw = *a->adamw;
    it->args.adamw = &it->adamw;
  }
  if (a->lion) {
    it->lion = *a->lion;
    it->args.lion = &it->lion;
  }
  it->threads = lz_threads_get();
  pthread_mutex_lock(&mu);
  it->fail = fail_next;
  fail_next = NULL;
  pthread_mutex_unlock(&mu);
  uint64_t ticket = enqueue(LZ_STREAM_COMPUTE, it);
  if (op == LZ_OP_SQ_NORM || op == LZ_OP_HAS_INF_NAN) { /* the host waits for the value */
    wait_for(LZ_STREAM_COMPUTE, ticket);
    return sticky_error();
  }
  return LZ_OK;
}

static int sim_supports(lz_op op, const lz_op_args *a) {
  (void)a;
  return (unsigned)op < LZ_OP_COUNT;
}

static lz_status sim_copy(void *dst, const void *src, size_t bytes, lz_stream_kind s) {
  LZ_TRY(sticky_error());
  if (bytes == 0) return LZ_OK;
  int bad_d, bad_s;
  void *d = translate(dst, bytes, &bad_d);
  const void *h = translate(src, bytes, &bad_s);
  if (bad_d || bad_s)
    return lz_fail(LZ_ERR_INVALID, "sim: copy of %zu bytes runs past the end of device memory",
                   bytes);
  item *it = calloc(1, sizeof *it);
  if (!it) return lz_fail(LZ_ERR_NOMEM, "sim: copy: out of host memory for the queue");
  it->kind = ITEM_COPY;
  it->dst = d ? d : dst;
  it->src = h ? h : src;
  it->bytes = bytes;
  enqueue(s, it);
  return LZ_OK;
}

static lz_status sim_stream_sync(lz_stream_kind s) {
  pthread_mutex_lock(&mu);
  uint64_t want = streams[s].queued;
  pthread_mutex_unlock(&mu);
  wait_for(s, want);
  return sticky_error();
}

static lz_status sim_sync(void) {
  wait_all();
  return sticky_error();
}

typedef struct {
  int recorded;
  int stream;
  uint64_t count;
} sim_event;

static lz_status sim_event_new(void **out) {
  *out = NULL;
  LZ_TRY(sticky_error());
  sim_event *e = calloc(1, sizeof *e);
  if (!e) return lz_fail(LZ_ERR_NOMEM, "sim: event_new: out of memory");
  *out = e;
  return LZ_OK;
}

static lz_status sim_event_free(void *e) {
  free(e);
  return LZ_OK;
}

static lz_status sim_event_record(void *ev, lz_stream_kind s) {
  LZ_TRY(sticky_error());
  sim_event *e = ev;
  pthread_mutex_lock(&mu);
  e->recorded = 1;
  e->stream = (int)s;
  e->count = streams[s].queued;
  pthread_mutex_unlock(&mu);
  return LZ_OK;
}

static lz_status sim_stream_wait(lz_stream_kind s, void *ev) {
  LZ_TRY(sticky_error());
  const sim_event *e = ev;
  if (!e->recorded) return LZ_OK; /* as CUDA: a never-recorded event is complete */
  item *it = calloc(1, sizeof *it);
  if (!it) return lz_fail(LZ_ERR_NOMEM, "sim: stream_wait: out of host memory for the queue");
  it->kind = ITEM_WAIT;
  it->wait_stream = e->stream;
  it->wait_count = e->count;
  enqueue(s, it);
  return LZ_OK;
}

static lz_status sim_event_sync(void *ev) {
  LZ_TRY(sticky_error());
  const sim_event *e = ev;
  if (e->recorded) wait_for(e->stream, e->count);
  return sticky_error();
}

static lz_status sim_event_query(void *ev, int *done) {
  LZ_TRY(sticky_error());
  const sim_event *e = ev;
  pthread_mutex_lock(&mu);
  *done = !e->recorded || streams[e->stream].done >= e->count;
  pthread_mutex_unlock(&mu);
  return LZ_OK;
}

lz_status lz_sim_compute_point(uint64_t *point) {
  LZ_TRY(sticky_error());
  pthread_mutex_lock(&mu);
  *point = streams[LZ_STREAM_COMPUTE].queued;
  pthread_mutex_unlock(&mu);
  return LZ_OK;
}

lz_status lz_sim_wait_compute(uint64_t point) {
  wait_for(LZ_STREAM_COMPUTE, point);
  return sticky_error();
}

void lz_sim_inject_failure(const char *why) {
  char *copy = strdup(why ? why : "injected failure");
  pthread_mutex_lock(&mu);
  free(fail_next);
  fail_next = copy;
  pthread_mutex_unlock(&mu);
}

void lz_sim_set_jitter(uint64_t seed, unsigned us) {
  __atomic_store_n(&jitter_us, us, __ATOMIC_RELAXED);
  __atomic_store_n(&jitter_seed, seed, __ATOMIC_RELAXED);
}

void lz_sim_clear_error(void) {
  pthread_mutex_lock(&mu);
  sticky[0] = 0;
  pthread_mutex_unlock(&mu);
}

/* ------------------------------------------------------------------ init */

static lz_status env_uint(const char *name, uint64_t *out, uint64_t dflt) {
  const char *s = getenv(name);
  *out = dflt;
  if (!s || !*s) return LZ_OK;
  char *end;
  errno = 0;
  unsigned long long v = isdigit((unsigned char)s[0]) ? strtoull(s, &end, 10) : 0;
  if (!isdigit((unsigned char)s[0]) || errno || *end)
    return lz_fail(LZ_ERR_INVALID, "sim: %s=\"%s\" is not a whole number >= 0", name, s);
  *out = v;
  return LZ_OK;
}

/* Called by lz_sim_init (devices/backend.c) once per process, under its lock. In a
 * forked rank nothing of the parent's is used: all state starts here. */
static lz_status sim_init(int device) {
  (void)device;
  const char *setting = getenv("LZ_SIM_MEMORY");
  size_t cap;
  if (setting && *setting) {
    LZ_TRY(lz_sim_parse_memory(setting, &cap));
    snprintf(memory_setting, sizeof memory_setting, "%.60s", setting);
  } else {
    LZ_TRY(lz_sim_parse_memory(DEFAULT_MEMORY, &cap));
    snprintf(memory_setting, sizeof memory_setting, "%s, the default", DEFAULT_MEMORY);
  }
  uint64_t seed, us;
  LZ_TRY(env_uint("LZ_SIM_JITTER", &seed, 0));
  LZ_TRY(env_uint("LZ_SIM_JITTER_US", &us, 200));
  if (us > 10000000)
    return lz_fail(LZ_ERR_INVALID, "sim: LZ_SIM_JITTER_US=%llu is more than 10 s",
                   (unsigned long long)us);
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

  jitter_seed = seed;
  jitter_us = (unsigned)us;
  const char *gbps = getenv("LZ_SIM_COPY_GBPS");
  copy_gbps = 0;
  if (gbps && *gbps) {
    char *end;
    copy_gbps = strtod(gbps, &end);
    if (*end || copy_gbps < 0) {
      munmap(d, cap);
      munmap(h, cap);
      close(fd);
      free(all);
      return lz_fail(LZ_ERR_INVALID,
                     "sim: LZ_SIM_COPY_GBPS=\"%s\" is not a bandwidth; give GB/s (e.g. 25), or 0 "
                     "for memcpy's pace",
                     gbps);
    }
  }
  memset(streams, 0, sizeof streams);
  sticky[0] = 0;
  stopping = 0;
  for (int s = 0; s < LZ_STREAM_COUNT; s++) {
    uint64_t r = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(s + 1) * 0xBF58476D1CE4E5B9ull;
    streams[s].rng = r ? r : 1;
    if (pthread_create(&streams[s].thread, NULL, worker_main, (void *)(intptr_t)s) != 0) {
      pthread_mutex_lock(&mu);
      stopping = 1;
      pthread_cond_broadcast(&cv);
      pthread_mutex_unlock(&mu);
      for (int k = 0; k < s; k++) pthread_join(streams[k].thread, NULL);
      return lz_fail(LZ_ERR_INTERNAL, "sim: could not start the %s stream's worker thread",
                     stream_names[s]);
    }
  }
  pthread_mutex_lock(&mu);
  started = 1;
  pthread_mutex_unlock(&mu);
  atexit(shutdown_workers);
  return LZ_OK;
}

static lz_backend table = {
    .abi = LZ_BACKEND_ABI,
    .name = "sim",
    .kind = LZ_SIM,
    .init = sim_init,
    .supports = sim_supports,
    .compute = sim_compute,
    .alloc = sim_alloc,
    .free = sim_free,
    .host_alloc = sim_host_alloc,
    .host_free = sim_host_free,
    .copy = sim_copy,
    .stream_sync = sim_stream_sync,
    .sync = sim_sync,
    .event_new = sim_event_new,
    .event_free = sim_event_free,
    .event_record = sim_event_record,
    .stream_wait = sim_stream_wait,
    .event_sync = sim_event_sync,
    .event_query = sim_event_query,
    .is_device_pointer = sim_is_device_pointer,
    .nccl_id_bytes = 0, /* no NCCL: collectives on sim buffers go through shm, mpi, local */
};

const lz_backend *lz_sim_backend(void) { return &table; }

int64_t lz_sim_capacity(void) { return lz_sim_ready() ? (int64_t)capacity : 0; }

uint64_t lz_sim_copy_ns(void) { return __atomic_load_n(&copy_ns, __ATOMIC_RELAXED); }
