/* sim_streams.c — the sim device's streams: one worker thread per
 * lz_stream_kind, each running its FIFO queue in order. An op is copied by
 * value into its queue item (tensor headers translated to the memory's
 * alias, marked cpu); copies and waits are items too. Events are (stream,
 * queued count) at their record. Each item may first sleep a pseudo-random
 * jitter; a failing item leaves a sticky error every later call returns. */
#include "devices/lz_sim.h"
#include "devices/sim_internal.h"
#include "mem/lz_internal.h"

#include <assert.h>  /* programmer errors */
#include <omp.h>     /* omp_set_num_threads in the workers */
#include <pthread.h> /* workers, the queue lock */
#include <stdio.h>   /* snprintf */
#include <stdlib.h>  /* calloc, atexit */
#include <time.h>    /* nanosleep for the jitter and the copy pace */

static const char *stream_names[LZ_STREAM_COUNT] = {"compute", "comm", "copy"};

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

lz_status lz_sim_sticky_error(void) {
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

void lz_sim_wait_all(void) {
  uint64_t want[LZ_STREAM_COUNT];
  pthread_mutex_lock(&mu);
  for (int s = 0; s < LZ_STREAM_COUNT; s++) want[s] = streams[s].queued;
  pthread_mutex_unlock(&mu);
  for (int s = 0; s < LZ_STREAM_COUNT; s++) wait_for(s, want[s]);
}

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
      lz_status st =
          it->fail ? lz_fail(LZ_ERR_INTERNAL, "%s", it->fail) : lz_sim_run_op(it->op, &it->args);
      if (st != LZ_OK) set_sticky(s, lz_sim_op_name(it->op), lz_last_error());
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

lz_status lz_sim_compute(lz_op op, const lz_op_args *a) {
  assert((unsigned)op < LZ_OP_COUNT);
  LZ_TRY(lz_sim_sticky_error());
  item *it = calloc(1, sizeof *it);
  if (!it)
    return lz_fail(LZ_ERR_NOMEM, "sim: %s: out of host memory for the queue", lz_sim_op_name(op));
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
    void *h = lz_sim_translate(t->data, bytes, &bad);
    if ((!h && bytes) || bad) {
      free(it);
      char buf[96];
      return lz_fail(LZ_ERR_INVALID, "sim: %s: a tensor %s at %p is not sim device memory",
                     lz_sim_op_name(op), lz_tensor_describe(t, buf, sizeof buf), t->data);
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
  if (lz_op_infos[op].waits) { /* the host waits for the value */
    wait_for(LZ_STREAM_COMPUTE, ticket);
    return lz_sim_sticky_error();
  }
  return LZ_OK;
}

lz_status lz_sim_copy(void *dst, const void *src, size_t bytes, lz_stream_kind s) {
  LZ_TRY(lz_sim_sticky_error());
  if (bytes == 0) return LZ_OK;
  int bad_d, bad_s;
  void *d = lz_sim_translate(dst, bytes, &bad_d);
  const void *h = lz_sim_translate(src, bytes, &bad_s);
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

lz_status lz_sim_stream_sync(lz_stream_kind s) {
  pthread_mutex_lock(&mu);
  uint64_t want = streams[s].queued;
  pthread_mutex_unlock(&mu);
  wait_for(s, want);
  return lz_sim_sticky_error();
}

lz_status lz_sim_sync(void) {
  lz_sim_wait_all();
  return lz_sim_sticky_error();
}

typedef struct {
  int recorded;
  int stream;
  uint64_t count;
} sim_event;

lz_status lz_sim_event_new(void **out) {
  *out = NULL;
  LZ_TRY(lz_sim_sticky_error());
  sim_event *e = calloc(1, sizeof *e);
  if (!e) return lz_fail(LZ_ERR_NOMEM, "sim: event_new: out of memory");
  *out = e;
  return LZ_OK;
}

lz_status lz_sim_event_free(void *e) {
  free(e);
  return LZ_OK;
}

lz_status lz_sim_event_record(void *ev, lz_stream_kind s) {
  LZ_TRY(lz_sim_sticky_error());
  sim_event *e = ev;
  pthread_mutex_lock(&mu);
  e->recorded = 1;
  e->stream = (int)s;
  e->count = streams[s].queued;
  pthread_mutex_unlock(&mu);
  return LZ_OK;
}

lz_status lz_sim_stream_wait(lz_stream_kind s, void *ev) {
  LZ_TRY(lz_sim_sticky_error());
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

lz_status lz_sim_event_sync(void *ev) {
  LZ_TRY(lz_sim_sticky_error());
  const sim_event *e = ev;
  if (e->recorded) wait_for(e->stream, e->count);
  return lz_sim_sticky_error();
}

lz_status lz_sim_event_query(void *ev, int *done) {
  LZ_TRY(lz_sim_sticky_error());
  const sim_event *e = ev;
  pthread_mutex_lock(&mu);
  *done = !e->recorded || streams[e->stream].done >= e->count;
  pthread_mutex_unlock(&mu);
  return LZ_OK;
}

lz_status lz_sim_compute_point(uint64_t *point) {
  LZ_TRY(lz_sim_sticky_error());
  pthread_mutex_lock(&mu);
  *point = streams[LZ_STREAM_COMPUTE].queued;
  pthread_mutex_unlock(&mu);
  return LZ_OK;
}

lz_status lz_sim_wait_compute(uint64_t point) {
  wait_for(LZ_STREAM_COMPUTE, point);
  return lz_sim_sticky_error();
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

lz_status lz_sim_streams_start(uint64_t seed, unsigned us, double gbps) {
  jitter_seed = seed;
  jitter_us = us;
  copy_gbps = gbps;
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

uint64_t lz_sim_copy_ns(void) { return __atomic_load_n(&copy_ns, __ATOMIC_RELAXED); }
