/* comm_shm.c — collectives between ranks forked on one machine, through one
 * shared-memory segment private to the job (created by the launcher, named
 * in LZ_SHM_NAME, unlinked by rank 0 as soon as every rank has mapped it).
 *
 * Segment: a header, one record per rank (its arrival counter on its own
 * cache line, its pid, its state), then per rank two banks of `chunk` bytes.
 * Messages stream through the banks in pieces; consecutive pieces alternate
 * banks, so a rank may fill its next bank while peers still read the last
 * one (a bank is reused only after a barrier every peer passed after its
 * last read).
 *
 * Algorithms: all-reduce of small messages is direct (every rank copies its
 * whole buffer in, then reduces all of them: one barrier); larger ones are
 * chunked reduce-scatter + all-gather (each rank reduces its shard of each
 * piece, then copies the others' results out: two barriers a piece).
 * Every element is reduced by lz_reduce_fixed in rank order 0..W-1, so each
 * algorithm gives bitwise the same result on every rank and every run.
 *
 * Waiting: spin while the ranks have a core each, then sleep on a futex in
 * the segment; every 100 ms a sleeper checks the deadline (LZ_COMM_TIMEOUT)
 * and whether the ranks it waits for are still alive. */
#define _GNU_SOURCE /* sched_getaffinity, pipe2, execvpe */
#include "comm_internal.h"

#include <errno.h>       /* errno from shm_open, kill */
#include <fcntl.h>       /* O_RDWR */
#include <linux/futex.h> /* FUTEX_WAIT, FUTEX_WAKE */
#include <sched.h>       /* sched_getaffinity, sched_yield */
#include <signal.h>      /* kill(pid, 0) to check a peer */
#include <stdio.h>       /* snprintf */
#include <stdlib.h>      /* getenv, strtoll */
#include <sys/mman.h>    /* shm_open, mmap */
#include <sys/stat.h>    /* fstat */
#include <sys/syscall.h> /* SYS_futex */
#include <unistd.h>      /* getpid, close */

#define SHM_MAGIC 0x3130306d68737a6cull /* "lzshm001" */
#define SHM_DEFAULT_CHUNK (1u << 20)
#define SHM_DIRECT_MAX (64u << 10) /* all-reduce below this: direct */
#define RANK_RECORD 128

enum { RANK_EMPTY = 0, RANK_JOINED = 1, RANK_LEFT = 2 };

typedef struct shm_header {
  uint64_t magic;
  int32_t world;
  int32_t pad0;
  uint64_t chunk;  /* bytes per rank per bank */
  uint64_t data_offset;
  _Alignas(64) _Atomic uint32_t futex_word; /* bumped on every arrival */
  _Alignas(64) _Atomic uint32_t sleepers;
  _Alignas(64) _Atomic int32_t joined;
} shm_header;

typedef struct shm_rank {
  _Alignas(64) _Atomic uint64_t arrive; /* barriers this rank has reached */
  _Alignas(64) _Atomic int32_t pid;
  _Atomic int32_t state;
} shm_rank;

_Static_assert(sizeof(shm_rank) == RANK_RECORD, "rank record is two cache lines");

typedef struct shm_comm {
  uint8_t *base;
  size_t bytes;
  shm_header *hdr;
  shm_rank *ranks;
  uint8_t *data;
  size_t chunk;
  uint64_t step; /* barriers passed by this rank */
  int bank;
  double spin_s;
  char name[256];
} shm_comm;

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t chunk_from_env(void) {
  const char *s = getenv("LZ_SHM_CHUNK");
  long long v = s ? strtoll(s, NULL, 10) : 0;
  if (v < 4096 || v > (1ll << 30)) return SHM_DEFAULT_CHUNK;
  return round_up((size_t)v, 4096);
}

static size_t data_offset(int world) {
  return round_up(sizeof(shm_header) + (size_t)world * RANK_RECORD, 4096);
}

size_t lz_shm_segment_bytes(int world) {
  return data_offset(world) + (size_t)world * 2 * chunk_from_env();
}

void lz_shm_segment_format(void *base, int world) {
  shm_header *h = base;
  h->world = world;
  h->chunk = chunk_from_env();
  h->data_offset = data_offset(world);
  h->magic = SHM_MAGIC;
}

static uint8_t *bank_ptr(shm_comm *s, int rank, int bank) {
  return s->data + ((size_t)rank * 2 + (size_t)bank) * s->chunk;
}

/* ------------------------------------------------------------------ waiting */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static void arrive(shm_comm *s, int me) {
  s->step++;
  atomic_store(&s->ranks[me].arrive, s->step);
  atomic_fetch_add(&s->hdr->futex_word, 1);
  if (atomic_load(&s->hdr->sleepers)) futex(&s->hdr->futex_word, FUTEX_WAKE, INT32_MAX, NULL);
}

static int all_arrived(shm_comm *s, int world, uint64_t target) {
  for (int p = 0; p < world; p++)
    if (atomic_load_explicit(&s->ranks[p].arrive, memory_order_acquire) < target) return 0;
  return 1;
}

/* "2, 3" into buf: the ranks that have not reached `target`. */
static const char *missing_ranks(shm_comm *s, int world, uint64_t target, char *buf, size_t len) {
  size_t n = 0;
  buf[0] = 0;
  for (int p = 0; p < world && n < len; p++)
    if (atomic_load(&s->ranks[p].arrive) < target)
      n += (size_t)snprintf(buf + n, len - n, n ? ", %d" : "%d", p);
  return buf;
}

static lz_status check_peers(lz_comm *c, shm_comm *s, uint64_t target, const char *op) {
  for (int p = 0; p < c->size; p++) {
    if (atomic_load(&s->ranks[p].arrive) >= target) continue;
    int state = atomic_load(&s->ranks[p].state);
    int pid = atomic_load(&s->ranks[p].pid);
    if (state == RANK_LEFT)
      return lz_fail(LZ_ERR_COMM,
                     "%s: rank %d is waiting for rank %d, which freed its communicator before "
                     "joining this collective (the ranks called different collectives)",
                     op, c->rank, p);
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
      return lz_fail(LZ_ERR_COMM, "%s: rank %d is waiting for rank %d (pid %d), which has exited",
                     op, c->rank, p, pid);
  }
  if (getppid() == 1)
    return lz_fail(LZ_ERR_COMM, "%s: rank %d: the launcher has exited; stopping", op, c->rank);
  return LZ_OK;
}

static lz_status wait_all(lz_comm *c, shm_comm *s, uint64_t target, const char *op) {
  int world = c->size;
  if (all_arrived(s, world, target)) return LZ_OK;
  double t0 = lz_now_s();
  if (s->spin_s > 0) {
    for (int i = 0;; i++) {
      __builtin_ia32_pause();
      if (all_arrived(s, world, target)) return LZ_OK;
      if ((i & 255) == 255 && lz_now_s() - t0 > s->spin_s) break;
    }
  }
  for (int i = 0; i < 4; i++) { /* a peer may be waiting for this core */
    sched_yield();
    if (all_arrived(s, world, target)) return LZ_OK;
  }
  double deadline = t0 + c->timeout_s, next_check = t0 + 0.1;
  struct timespec nap = {0, 20 * 1000 * 1000};
  for (;;) {
    atomic_fetch_add(&s->hdr->sleepers, 1);
    uint32_t v = atomic_load(&s->hdr->futex_word);
    if (!all_arrived(s, world, target)) futex(&s->hdr->futex_word, FUTEX_WAIT, v, &nap);
    atomic_fetch_sub(&s->hdr->sleepers, 1);
    if (all_arrived(s, world, target)) return LZ_OK;
    double t = lz_now_s();
    if (t >= next_check) {
      LZ_TRY(check_peers(c, s, target, op));
      next_check = t + 0.1;
    }
    if (t >= deadline) {
      char who[256];
      return lz_fail(LZ_ERR_TIMEOUT,
                     "%s: rank %d waited %.1f s (LZ_COMM_TIMEOUT) for ranks %s; they never "
                     "joined this collective (a rank stuck, or ranks calling different "
                     "collectives)",
                     op, c->rank, t - t0, missing_ranks(s, world, target, who, sizeof who));
    }
  }
}

static lz_status barrier(lz_comm *c, shm_comm *s, const char *op) {
  arrive(s, c->rank);
  return wait_all(c, s, s->step, op);
}

/* ---------------------------------------------------------------- init/free */

static int cpus_available(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

static lz_status shm_init(lz_comm *c) {
  const char *name = getenv("LZ_SHM_NAME");
  if (!name || !*name)
    return lz_fail(LZ_ERR_INVALID, "shm: LZ_SHM_NAME is unset; the shm backend runs under the "
                                   "luazero launcher (`luazero -n N ...`)");
  int rank = 0, world = 1;
  const char *rs = getenv("RANK"), *ws = getenv("WORLD_SIZE");
  if (!rs || !ws)
    return lz_fail(LZ_ERR_INVALID, "shm: RANK and WORLD_SIZE must be set (the launcher sets them)");
  rank = atoi(rs);
  world = atoi(ws);
  if (world < 1 || rank < 0 || rank >= world)
    return lz_fail(LZ_ERR_INVALID, "shm: RANK=%s WORLD_SIZE=%s: need 0 <= RANK < WORLD_SIZE", rs,
                   ws);
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0)
    return lz_fail(LZ_ERR_IO, "shm: rank %d cannot open the job's segment %s: %s (it is removed "
                   "once every rank has joined; one communicator per process)",
                   rank, name, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < data_offset(world)) {
    close(fd);
    return lz_fail(LZ_ERR_IO, "shm: segment %s is too small for %d ranks", name, world);
  }
  size_t bytes = (size_t)st.st_size;
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (base == MAP_FAILED)
    return lz_fail(LZ_ERR_IO, "shm: mmap of %zu bytes of %s failed: %s", bytes, name,
                   strerror(errno));
  shm_comm *s = calloc(1, sizeof *s);
  if (!s) {
    munmap(base, bytes);
    return lz_fail(LZ_ERR_NOMEM, "shm: out of memory");
  }
  s->base = base;
  s->bytes = bytes;
  s->hdr = base;
  s->ranks = (shm_rank *)((uint8_t *)base + sizeof(shm_header));
  snprintf(s->name, sizeof s->name, "%s", name);
  if (s->hdr->magic != SHM_MAGIC || s->hdr->world != world ||
      s->hdr->data_offset + (size_t)world * 2 * s->hdr->chunk > bytes) {
    munmap(base, bytes);
    free(s);
    return lz_fail(LZ_ERR_INVALID, "shm: segment %s was not made for %d ranks by this launcher",
                   name, world);
  }
  s->chunk = s->hdr->chunk;
  s->data = (uint8_t *)base + s->hdr->data_offset;
  const char *spin = getenv("LZ_SHM_SPIN_US");
  s->spin_s = spin ? atof(spin) * 1e-6 : (world <= cpus_available() ? 50e-6 : 0);
  c->rank = rank;
  c->size = world;
  c->impl = s;

  atomic_store(&s->ranks[rank].pid, (int32_t)getpid());
  atomic_store(&s->ranks[rank].state, RANK_JOINED);
  atomic_fetch_add(&s->hdr->joined, 1);
  lz_status st_join = barrier(c, s, "comm_init");
  if (st_join != LZ_OK) {
    munmap(base, bytes);
    free(s);
    c->impl = NULL;
    return st_join;
  }
  if (rank == 0) shm_unlink(name); /* everyone has it mapped: nothing outlives the job */
  return LZ_OK;
}

static void shm_free(lz_comm *c) {
  shm_comm *s = c->impl;
  if (!s) return;
  atomic_store(&s->ranks[c->rank].state, RANK_LEFT);
  atomic_fetch_add(&s->hdr->futex_word, 1);
  futex(&s->hdr->futex_word, FUTEX_WAKE, INT32_MAX, NULL);
  munmap(s->base, s->bytes);
  free(s);
  c->impl = NULL;
}

/* -------------------------------------------------------------- algorithms */

/* Elements per rank per round in the chunked algorithms: a bank split in W
 * sub-slots, each a multiple of 64 bytes. */
static int64_t sub_elems(shm_comm *s, int world, size_t es) {
  size_t sub = s->chunk / (size_t)world / 64 * 64;
  return (int64_t)(sub / es);
}

static lz_status all_reduce_direct(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  memcpy(bank_ptr(s, me, s->bank), a->recv, n);
  LZ_TRY(barrier(c, s, "all_reduce"));
  const void *srcs[W];
  for (int p = 0; p < W; p++) srcs[p] = p == me ? a->recv : bank_ptr(s, p, s->bank);
  lz_reduce_fixed(a->recv, srcs, W, a->count, a->dt, a->op, W);
  s->bank ^= 1;
  return LZ_OK;
}

/* Chunked reduce-scatter (and, for all-reduce, the all-gather after it) over
 * the shards of lz_comm_shard. Round j handles elements [j*m, (j+1)*m) of
 * every shard: each rank copies the other ranks' parts into its bank's
 * sub-slots, then reduces its own part from every rank's bank. */
static lz_status reduce_chunked(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  const char *op = lz_coll_name(a->kind);
  int all = a->kind == LZ_COLL_ALL_REDUCE;
  size_t es = lz_dtype_size(a->dt);
  int64_t m = sub_elems(s, W, es);
  size_t sub_bytes = (size_t)m * es;
  int64_t off[W], len[W];
  for (int p = 0; p < W; p++) lz_comm_shard(a->count, W, p, &off[p], &len[p]);
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv; /* all-reduce: the whole buffer; reduce-scatter: my shard */
  const void *srcs[W];
  for (int64_t j0 = 0; j0 < len[0]; j0 += m) {
    uint8_t *mine = bank_ptr(s, me, s->bank);
    for (int q = 0; q < W; q++) {
      int64_t k = len[q] - j0 < m ? len[q] - j0 : m;
      if (q != me && k > 0) memcpy(mine + q * sub_bytes, send + (off[q] + j0) * es, (size_t)k * es);
    }
    LZ_TRY(barrier(c, s, op));
    int64_t k = len[me] - j0 < m ? len[me] - j0 : m;
    if (k > 0) {
      for (int p = 0; p < W; p++)
        srcs[p] = p == me ? (const void *)(send + (off[me] + j0) * es)
                          : bank_ptr(s, p, s->bank) + me * sub_bytes;
      uint8_t *dst = all ? recv + (off[me] + j0) * es : recv + j0 * es;
      lz_reduce_fixed(dst, srcs, W, k, a->dt, a->op, W);
      if (all) memcpy(mine + me * sub_bytes, dst, (size_t)k * es);
    }
    if (all) {
      LZ_TRY(barrier(c, s, op));
      for (int q = 0; q < W; q++) {
        int64_t kq = len[q] - j0 < m ? len[q] - j0 : m;
        if (q != me && kq > 0)
          memcpy(recv + (off[q] + j0) * es, bank_ptr(s, q, s->bank) + q * sub_bytes,
                 (size_t)kq * es);
      }
    }
    s->bank ^= 1;
  }
  return LZ_OK;
}

static lz_status all_gather(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt);
  int64_t m = (int64_t)(s->chunk / es);
  int64_t off[W], len[W];
  for (int p = 0; p < W; p++) lz_comm_shard(a->count, W, p, &off[p], &len[p]);
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  if (len[me] && send != recv + off[me] * es)
    memmove(recv + off[me] * es, send, (size_t)len[me] * es);
  for (int64_t j0 = 0; j0 < len[0]; j0 += m) {
    int64_t k = len[me] - j0 < m ? len[me] - j0 : m;
    if (k > 0) memcpy(bank_ptr(s, me, s->bank), send + j0 * es, (size_t)k * es);
    LZ_TRY(barrier(c, s, "all_gather"));
    for (int p = 0; p < W; p++) {
      int64_t kp = len[p] - j0 < m ? len[p] - j0 : m;
      if (p != me && kp > 0)
        memcpy(recv + (off[p] + j0) * es, bank_ptr(s, p, s->bank), (size_t)kp * es);
    }
    s->bank ^= 1;
  }
  return LZ_OK;
}

static lz_status broadcast(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int me = c->rank, root = a->root;
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  uint8_t *buf = a->recv;
  for (size_t j0 = 0; j0 < n; j0 += s->chunk) {
    size_t k = n - j0 < s->chunk ? n - j0 : s->chunk;
    if (me == root) memcpy(bank_ptr(s, root, s->bank), buf + j0, k);
    LZ_TRY(barrier(c, s, "broadcast"));
    if (me != root) memcpy(buf + j0, bank_ptr(s, root, s->bank), k);
    s->bank ^= 1;
  }
  return LZ_OK;
}

static lz_status shm_run(lz_comm *c, const lz_coll_args *a) {
  shm_comm *s = c->impl;
  if (a->kind == LZ_COLL_BARRIER) return barrier(c, s, "barrier");
  if (a->count == 0) return LZ_OK;
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  if (c->size == 1) {
    if (a->kind == LZ_COLL_REDUCE_SCATTER || a->kind == LZ_COLL_ALL_GATHER)
      if (a->send != a->recv) memmove(a->recv, a->send, n);
    return LZ_OK;
  }
  switch (a->kind) {
  case LZ_COLL_ALL_REDUCE:
    if (n <= SHM_DIRECT_MAX && n <= s->chunk) return all_reduce_direct(c, s, a);
    return reduce_chunked(c, s, a);
  case LZ_COLL_REDUCE_SCATTER: return reduce_chunked(c, s, a);
  case LZ_COLL_ALL_GATHER: return all_gather(c, s, a);
  case LZ_COLL_BROADCAST: return broadcast(c, s, a);
  default: return lz_fail(LZ_ERR_INVALID, "shm: unknown collective %d", (int)a->kind);
  }
}

const lz_comm_backend_ops lz_comm_shm_ops = {"shm", shm_init, shm_free, shm_run};
