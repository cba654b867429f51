/* comm_shm.c — collectives between ranks forked on one machine, through one
 * shared-memory segment private to the job (a memfd the launcher holds,
 * opened through /proc/<LZ_LAUNCHER_PID>/fd/<LZ_SHM_FD>: it has no name, so
 * nothing is left behind whoever is killed when).
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
 * Single copy (Linux cross-memory attach): from SHM_CMA_MIN bytes up,
 * all-reduce, reduce-scatter and all-gather skip the segment. Each rank
 * publishes its buffers' addresses in its record, a barrier, then every rank
 * reads the parts it needs straight out of its peers' memory with
 * process_vm_readv (all-gather: into its receive buffer; reductions: into a
 * small cache-resident staging buffer, reduced with its own part in rank
 * order), and a closing barrier keeps every buffer valid until the last
 * peer has read it. Each byte is copied once instead of twice, and the copy
 * lands in the caller's (huge-page) memory rather than the 4 KiB pages of
 * /dev/shm. At init every rank probes a read from a peer; if any probe fails
 * (EPERM: ptrace restrictions such as Yama or a seccomp filter; ENOSYS) or
 * LZ_SHM_CMA=0, all ranks use the segment paths.
 *
 * Shared memory: under the launcher, params, grads and comm buffers of 64
 * KiB and more live in memory every rank maps (shared_mem.c, huge pages
 * where possible). When every buffer an operation reads in place is there,
 * the ranks copy and reduce with plain loads and stores instead of
 * process_vm_readv: all-gather reads the peers' shards (or, with private
 * send buffers, writes its shard into every peer's receive buffer);
 * reduce-scatter and all-reduce reduce this rank's shard straight out of
 * every rank's buffer, all-reduce writing the result into every buffer in
 * the same pass (one barrier in, one out). From SHM_STREAM_MIN bytes the
 * copies use non-temporal stores, which skip the read-for-ownership of the
 * destination: 1.5x less memory traffic on messages that do not stay in
 * cache.
 *
 * Waiting and the barriers' check that every rank runs the same collective:
 * comm_shm_wait.c. */
#define _GNU_SOURCE /* sched_getaffinity, pipe2, execvpe */
#include "comm/comm_shm.h"

#include <errno.h>       /* errno from open, kill */
#include <fcntl.h>       /* open, O_RDWR */
#include <sched.h>       /* sched_getaffinity, sched_yield */
#include <signal.h>      /* kill(pid, 0) to check a peer */
#include <stdio.h>       /* snprintf */
#include <stdlib.h>      /* getenv, strtoll */
#include <sys/mman.h>    /* mmap */
#include <sys/stat.h>    /* fstat */
#include <sys/prctl.h>   /* PR_SET_PTRACER: let sibling ranks read this one under Yama */
#include <sys/uio.h>     /* process_vm_readv */
#include <unistd.h>      /* getpid, close */


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

void lz_shm_segment_rank_started(int fd, int world, int rank, int pid) {
  const size_t bytes = data_offset(world);
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return; /* a rank that never joins is then found by the timeout */
  shm_rank *ranks = (shm_rank *)((uint8_t *)base + sizeof(shm_header));
  atomic_store(&ranks[rank].pid, (int32_t)pid);
  munmap(base, bytes);
}

void lz_shm_segment_format(void *base, int world) {
  shm_header *h = base;
  h->world = world;
  h->chunk = chunk_from_env();
  h->data_offset = data_offset(world);
  h->magic = SHM_MAGIC;
}

uint8_t *shm_bank(shm_comm *s, int rank, int bank) {
  return s->data + ((size_t)rank * 2 + (size_t)bank) * s->chunk;
}

/* ---------------------------------------------------------------- init/free */

static int cpus_available(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* 1 if this rank can read its neighbour's memory with process_vm_readv
 * (and wants to: LZ_SHM_CMA=0 turns single copy off). Allocates the
 * staging buffer when it can. */
static int cma_probe(lz_comm *c, shm_comm *s) {
  const char *env = getenv("LZ_SHM_CMA");
  if (c->size < 2 || (env && !strcmp(env, "0"))) return 0;
  int peer = (c->rank + 1) % c->size;
  uint64_t got = 0;
  struct iovec local = {&got, sizeof got};
  struct iovec remote = {(void *)(uintptr_t)atomic_load(&s->ranks[peer].probe), sizeof got};
  ssize_t r = process_vm_readv((pid_t)atomic_load(&s->ranks[peer].pid), &local, 1, &remote, 1, 0);
  if (r != (ssize_t)sizeof got || got != (SHM_MAGIC ^ (uint64_t)peer)) return 0;
  s->stage = aligned_alloc(4096, SHM_STAGE_BYTES);
  return s->stage != NULL;
}

/* The launcher's memfd, through /proc (nothing is inherited, so nothing
 * leaks into what a rank starts). */
static lz_status open_segment(int rank, const char *name, int *fd) {
  const char *pid = getenv("LZ_LAUNCHER_PID"), *lfd = getenv("LZ_SHM_FD");
  if (!pid || !lfd)
    return lz_fail(LZ_ERR_INVALID, "shm: LZ_LAUNCHER_PID and LZ_SHM_FD must be set (the "
                                   "launcher sets them)");
  char path[96];
  snprintf(path, sizeof path, "/proc/%s/fd/%s", pid, lfd);
  *fd = open(path, O_RDWR | O_CLOEXEC);
  if (*fd < 0)
    return lz_fail(LZ_ERR_IO, "shm: rank %d cannot open the job's segment %s through %s: %s (is "
                   "the launcher still running?)", rank, name, path, strerror(errno));
  return LZ_OK;
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
  int fd = -1;
  LZ_TRY(open_segment(rank, name, &fd));
  return shm_attach(c, fd, name, rank, world, NULL);
}

lz_status shm_attach(lz_comm *c, int fd, const char *name, int rank, int world,
                     int *launcher_rank) {
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < data_offset(world)) {
    close(fd);
    free(launcher_rank);
    return lz_fail(LZ_ERR_IO, "shm: segment %s is too small for %d ranks", name, world);
  }
  size_t bytes = (size_t)st.st_size;
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  shm_comm *s = base == MAP_FAILED ? NULL : calloc(1, sizeof *s);
  if (!s) {
    free(launcher_rank);
    if (base == MAP_FAILED)
      return lz_fail(LZ_ERR_IO, "shm: mmap of %zu bytes of %s failed: %s", bytes, name,
                     strerror(errno));
    munmap(base, bytes);
    return lz_fail(LZ_ERR_NOMEM, "shm: out of memory");
  }
  s->launcher_rank = launcher_rank;
  s->base = base;
  s->bytes = bytes;
  s->hdr = base;
  s->ranks = (shm_rank *)((uint8_t *)base + sizeof(shm_header));
  snprintf(s->name, sizeof s->name, "%s", name);
  if (s->hdr->magic != SHM_MAGIC || s->hdr->world != world ||
      s->hdr->data_offset + (size_t)world * 2 * s->hdr->chunk > bytes) {
    munmap(base, bytes);
    free(s->launcher_rank);
    free(s);
    return lz_fail(LZ_ERR_INVALID, "shm: segment %s was not made for %d ranks by this launcher",
                   name, world);
  }
  if (atomic_load(&s->ranks[rank].state) != RANK_EMPTY) {
    munmap(base, bytes);
    free(s->launcher_rank);
    free(s);
    return lz_fail(LZ_ERR_INVALID, "shm: rank %d has joined segment %s already; one "
                   "communicator per process", rank, name);
  }
  s->chunk = s->hdr->chunk;
  s->data = (uint8_t *)base + s->hdr->data_offset;
  const char *spin = getenv("LZ_SHM_SPIN_US");
  s->spin_s = spin ? atof(spin) * 1e-6 : (world <= cpus_available() ? 50e-6 : 0);
  c->rank = rank;
  c->size = world;
  c->impl = s;

  s->probe_word = SHM_MAGIC ^ (uint64_t)rank;
  atomic_store(&s->ranks[rank].probe, (uint64_t)(uintptr_t)&s->probe_word);
  /* Under Yama ptrace_scope 1 only ancestors may read this process; the
   * ranks are siblings. Harmless where Yama is absent. */
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  atomic_store(&s->ranks[rank].pid, (int32_t)getpid());
  atomic_store(&s->ranks[rank].state, RANK_JOINED);
  atomic_fetch_add(&s->hdr->joined, 1);
  lz_status st_join = shm_barrier(c, s, "comm_init");
  if (st_join == LZ_OK) {
    atomic_store(&s->ranks[rank].cma_ok, cma_probe(c, s));
    if (lz_shared_ready()) s->piece = aligned_alloc(64, SHM_PIECE);
    atomic_store(&s->ranks[rank].shared_ok, s->piece != NULL);
    st_join = shm_barrier(c, s, "comm_init"); /* every probe done: all agree on the path */
  }
  if (st_join != LZ_OK) {
    free(s->stage);
    free(s->piece);
    munmap(base, bytes);
    free(s->launcher_rank);
    free(s);
    c->impl = NULL;
    return st_join;
  }
  s->cma = s->direct = world > 1;
  for (int p = 0; p < world; p++) {
    s->cma &= atomic_load(&s->ranks[p].cma_ok);
    s->direct &= atomic_load(&s->ranks[p].shared_ok);
  }
  return LZ_OK;
}

static void shm_free(lz_comm *c) {
  shm_comm *s = c->impl;
  if (!s) return;
  atomic_store(&s->ranks[c->rank].state, RANK_LEFT);
  shm_wake_all(s);
  munmap(s->base, s->bytes);
  free(s->stage);
  free(s->piece);
  free(s->launcher_rank);
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
  memcpy(shm_bank(s, me, s->bank), a->recv, n);
  LZ_TRY(shm_barrier(c, s, "all_reduce"));
  const void *srcs[W];
  for (int p = 0; p < W; p++) srcs[p] = p == me ? a->recv : shm_bank(s, p, s->bank);
  lz_reduce_fixed(a->recv, srcs, W, a->count, a->dt, a->op, a->divisor);
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
    uint8_t *mine = shm_bank(s, me, s->bank);
    for (int q = 0; q < W; q++) {
      int64_t k = len[q] - j0 < m ? len[q] - j0 : m;
      if (q != me && k > 0) memcpy(mine + q * sub_bytes, send + (off[q] + j0) * es, (size_t)k * es);
    }
    LZ_TRY(shm_barrier(c, s, op));
    int64_t k = len[me] - j0 < m ? len[me] - j0 : m;
    if (k > 0) {
      for (int p = 0; p < W; p++)
        srcs[p] = p == me ? (const void *)(send + (off[me] + j0) * es)
                          : shm_bank(s, p, s->bank) + me * sub_bytes;
      uint8_t *dst = all ? recv + (off[me] + j0) * es : recv + j0 * es;
      lz_reduce_fixed(dst, srcs, W, k, a->dt, a->op, a->divisor);
      if (all) memcpy(mine + me * sub_bytes, dst, (size_t)k * es);
    }
    if (all) {
      LZ_TRY(shm_barrier(c, s, op));
      for (int q = 0; q < W; q++) {
        int64_t kq = len[q] - j0 < m ? len[q] - j0 : m;
        if (q != me && kq > 0)
          memcpy(recv + (off[q] + j0) * es, shm_bank(s, q, s->bank) + q * sub_bytes,
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
  lz_comm_gather_own(a, W, me, off, len);
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  for (int64_t j0 = 0; j0 < len[0]; j0 += m) {
    int64_t k = len[me] - j0 < m ? len[me] - j0 : m;
    if (k > 0) memcpy(shm_bank(s, me, s->bank), send + j0 * es, (size_t)k * es);
    LZ_TRY(shm_barrier(c, s, "all_gather"));
    for (int p = 0; p < W; p++) {
      int64_t kp = len[p] - j0 < m ? len[p] - j0 : m;
      if (p != me && kp > 0)
        memcpy(recv + (off[p] + j0) * es, shm_bank(s, p, s->bank), (size_t)kp * es);
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
    if (me == root) memcpy(shm_bank(s, root, s->bank), buf + j0, k);
    LZ_TRY(shm_barrier(c, s, "broadcast"));
    if (me != root) memcpy(buf + j0, shm_bank(s, root, s->bank), k);
    s->bank ^= 1;
  }
  return LZ_OK;
}

/* -------------------------------------------------------------- single copy */

/* Copies `bytes` at address `remote` of rank p into `local`. */
lz_status shm_cma_read(lz_comm *c, shm_comm *s, int p, void *local, uint64_t remote,
                       size_t bytes, const char *op) {
  pid_t pid = (pid_t)atomic_load(&s->ranks[p].pid);
  uint8_t *dst = local;
  while (bytes > 0) {
    struct iovec l = {dst, bytes}, r = {(void *)(uintptr_t)remote, bytes};
    ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got > 0) {
      dst += got;
      remote += (uint64_t)got;
      bytes -= (size_t)got;
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && errno == ESRCH)
      return lz_fail(LZ_ERR_COMM, "%s: rank %d is reading from rank %d (pid %d), which has exited",
                     op, c->rank, p, (int)pid);
    return lz_fail(LZ_ERR_COMM,
                   "%s: rank %d cannot read %zu bytes of rank %d's buffer (pid %d): %s (set "
                   "LZ_SHM_CMA=0 to copy through the segment instead)",
                   op, c->rank, bytes, p, (int)pid, got < 0 ? strerror(errno) : "no progress");
  }
  return LZ_OK;
}

/* The peers' buffers can be read in place (shared memory or cross-memory
 * attach) for this operation: big enough (check_args in comm.c has already
 * refused send and receive buffers that overlap other than in place). */
static int single_copy_fits(shm_comm *s, const lz_coll_args *a) {
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  int shared = s->direct && n >= SHM_SHARED_MIN, cma = s->cma && n >= SHM_CMA_MIN;
  switch (a->kind) {
  case LZ_COLL_ALL_REDUCE:
  case LZ_COLL_REDUCE_SCATTER:
  case LZ_COLL_ALL_GATHER: return shared || cma;
  case LZ_COLL_BROADCAST: return shared;
  default: return 0;
  }
}

/* Every rank's buffer (its send buffer, or with `recv` its receive buffer)
 * as this rank sees it in the job's shared memory, bytes[p] long: 1 when
 * all of them are there. */
static int shared_views(lz_comm *c, shm_comm *s, int recv, const size_t *bytes, uint8_t **view) {
  if (!s->direct) return 0;
  for (int p = 0; p < c->size; p++) {
    uint64_t off = atomic_load(recv ? &s->ranks[p].recv_off : &s->ranks[p].send_off);
    view[p] = off == UINT64_MAX ? NULL : lz_shared_view(shm_launcher_rank(s, p), (size_t)off, bytes[p]);
    if (!view[p]) return 0;
  }
  return 1;
}

/* Copies within a collective: memcpy while the message fits in cache,
 * non-temporal stores beyond (SHM_STREAM_MIN). */
typedef void *(*copy_fn)(void *, const void *, size_t);
static void *copy_stream(void *dst, const void *src, size_t n) {
  lz_copy_stream(dst, src, n);
  return dst;
}
size_t shm_stream_min(void) {
  static size_t v;
  if (!v) {
    const char *e = getenv("LZ_SHM_STREAM_MIN");
    v = e && atoll(e) > 0 ? (size_t)atoll(e) : SHM_STREAM_MIN;
  }
  return v;
}
static copy_fn copy_for(const lz_coll_args *a) {
  /* All-reduce writes where it has just read (in place): non-temporal
   * stores to lines in cache cost more than they save (measured: 8 against
   * 13-22 GB/s at 16-256 MiB, 2 ranks). */
  if (a->kind == LZ_COLL_ALL_REDUCE) return memcpy;
  return (size_t)a->count * lz_dtype_size(a->dt) >= shm_stream_min() ? copy_stream : memcpy;
}

/* All-gather reading the peers' shards in place: from their shared memory
 * (view) or with process_vm_readv (view NULL). */
static lz_status all_gather_read(lz_comm *c, shm_comm *s, const lz_coll_args *a, uint8_t **view) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt);
  int64_t off[W], len[W];
  for (int p = 0; p < W; p++) lz_comm_shard(a->count, W, p, &off[p], &len[p]);
  uint8_t *recv = a->recv;
  copy_fn copy = copy_for(a);
  for (int i = 1; i < W; i++) { /* start at the next rank: the ranks read different peers */
    int p = (me + i) % W;
    if (!len[p]) continue;
    if (view) copy(recv + off[p] * es, view[p], (size_t)len[p] * es);
    else
      LZ_TRY(shm_cma_read(c, s, p, recv + off[p] * es, atomic_load(&s->ranks[p].send),
                      (size_t)len[p] * es, "all_gather"));
  }
  shm_arrive(c, s); /* this rank has read its peers: its own copy overlaps their reading */
  if (len[me] && a->send != recv + off[me] * es)
    copy(recv + off[me] * es, a->send, (size_t)len[me] * es);
  return shm_wait(c, s, "all_gather"); /* every peer has read this rank's shard */
}

/* All-gather writing this rank's shard into every rank's shared receive
 * buffer (the send buffers are private). */
static lz_status all_gather_push(lz_comm *c, shm_comm *s, const lz_coll_args *a, uint8_t **rview) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt);
  int64_t off, len;
  lz_comm_shard(a->count, W, me, &off, &len);
  copy_fn copy = copy_for(a);
  for (int i = 0; i < W; i++) {
    int p = (me + i) % W;
    if (len && rview[p] + off * es != (const uint8_t *)a->send)
      copy(rview[p] + off * es, a->send, (size_t)len * es);
  }
  return shm_barrier(c, s, "all_gather"); /* every shard is in every buffer */
}

/* Reduce-scatter (and, for all-reduce, the all-gather after it) reading the
 * peers' buffers in place with process_vm_readv: each rank reduces its shard
 * in pieces, the peers' parts of a piece staged, in rank order 0..W-1 like
 * every other path. The all-gather reads the peers' reduced shards straight
 * into the buffer. */
static lz_status reduce_cma(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  const char *op = lz_coll_name(a->kind);
  int all = a->kind == LZ_COLL_ALL_REDUCE;
  size_t es = lz_dtype_size(a->dt);
  int64_t off[W], len[W];
  for (int p = 0; p < W; p++) lz_comm_shard(a->count, W, p, &off[p], &len[p]);
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  size_t piece = SHM_STAGE_BYTES / (size_t)(W - 1) / 4096 * 4096;
  int64_t m = (int64_t)(piece / es);
  const void *srcs[W];
  for (int64_t j0 = 0; j0 < len[me]; j0 += m) {
    int64_t k = len[me] - j0 < m ? len[me] - j0 : m;
    size_t at = (size_t)(off[me] + j0) * es;
    for (int p = 0, slot = 0; p < W; p++) {
      if (p == me) {
        srcs[p] = send + at;
        continue;
      }
      uint8_t *st = s->stage + (size_t)slot++ * piece;
      LZ_TRY(shm_cma_read(c, s, p, st, atomic_load(&s->ranks[p].send) + at, (size_t)k * es, op));
      srcs[p] = st;
    }
    lz_reduce_fixed(all ? recv + at : recv + (size_t)j0 * es, srcs, W, k, a->dt, a->op, a->divisor);
  }
  if (all) {
    LZ_TRY(shm_barrier(c, s, op)); /* every shard reduced */
    for (int i = 1; i < W; i++) {
      int p = (me + i) % W;
      size_t at = (size_t)off[p] * es;
      if (len[p])
        LZ_TRY(shm_cma_read(c, s, p, recv + at, atomic_load(&s->ranks[p].send) + at,
                        (size_t)len[p] * es, op));
    }
  }
  return shm_barrier(c, s, op); /* every peer has read this rank's buffer */
}

/* Reduce-scatter and all-reduce over shared memory, one pass: each rank
 * reduces its shard piece by piece straight from every rank's buffer, in
 * rank order, and writes each reduced piece while it is in cache into its
 * receive buffer (reduce-scatter) or into every rank's buffer (all-reduce:
 * only this rank reads or writes its shard of any buffer, so in place is
 * safe). Beyond the cache the piece is reduced into scratch and streamed. */
static lz_status reduce_shared(lz_comm *c, shm_comm *s, const lz_coll_args *a, uint8_t **view) {
  int W = c->size, me = c->rank, all = a->kind == LZ_COLL_ALL_REDUCE;
  size_t es = lz_dtype_size(a->dt);
  int64_t off, len;
  lz_comm_shard(a->count, W, me, &off, &len);
  int64_t m = (int64_t)(SHM_PIECE / es);
  int stream = copy_for(a) != memcpy, nd = all ? W : 1;
  const void *srcs[W];
  uint8_t *dst[W];
  for (int64_t j0 = 0; j0 < len; j0 += m) {
    int64_t k = len - j0 < m ? len - j0 : m;
    size_t at = (size_t)(off + j0) * es, bytes = (size_t)k * es;
    for (int p = 0; p < W; p++) srcs[p] = view[p] + at;
    for (int i = 0; i < nd; i++)
      dst[i] = all ? view[(me + i) % W] + at : (uint8_t *)a->recv + (size_t)j0 * es;
    if (stream) {
      lz_reduce_fixed(s->piece, srcs, W, k, a->dt, a->op, a->divisor);
      for (int i = 0; i < nd; i++) lz_copy_stream(dst[i], s->piece, bytes);
    } else {
      lz_reduce_fixed(dst[0], srcs, W, k, a->dt, a->op, a->divisor);
      for (int i = 1; i < nd; i++) memcpy(dst[i], dst[0], bytes);
    }
  }
  /* every shard is in every buffer; every peer has read this rank's buffer */
  return shm_barrier(c, s, lz_coll_name(a->kind));
}

static lz_status broadcast_shared(lz_comm *c, shm_comm *s, const lz_coll_args *a,
                                  const uint8_t *root) {
  if (c->rank != a->root) copy_for(a)(a->recv, root, (size_t)a->count * lz_dtype_size(a->dt));
  return shm_barrier(c, s, "broadcast"); /* every rank has read the root's buffer */
}

static lz_status segment_path(lz_comm *c, shm_comm *s, const lz_coll_args *a);

/* Publishes this rank's buffers, then reads (or writes) the peers' in
 * place: through shared memory where every buffer involved is in it, else
 * with process_vm_readv where the kernel allows it, else (buffers turned
 * out private, CMA refused) through the segment. Every rank sees the same
 * published buffers, so all choose the same path. */
static lz_status single_copy(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  const char *op = lz_coll_name(a->kind);
  size_t es = lz_dtype_size(a->dt), n = (size_t)a->count * es;
  shm_rank *r = &s->ranks[me];
  atomic_store(&r->send, (uint64_t)(uintptr_t)a->send);
  atomic_store(&r->send_off, lz_shared_offset(a->send));
  atomic_store(&r->recv_off, lz_shared_offset(a->recv));
  LZ_TRY(shm_barrier(c, s, op)); /* every rank has published */
  size_t bytes[W];
  uint8_t *view[W];
  int64_t off, len;
  for (int p = 0; p < W; p++) bytes[p] = n;
  int cma = s->cma && n >= SHM_CMA_MIN;
  switch (a->kind) {
  case LZ_COLL_ALL_GATHER: {
    size_t shard[W]; /* what each rank sends */
    for (int p = 0; p < W; p++) {
      lz_comm_shard(a->count, W, p, &off, &len);
      shard[p] = (size_t)len * es;
    }
    if (shared_views(c, s, 0, shard, view)) return all_gather_read(c, s, a, view);
    if (shared_views(c, s, 1, bytes, view)) return all_gather_push(c, s, a, view);
    if (cma) return all_gather_read(c, s, a, NULL);
    break;
  }
  case LZ_COLL_REDUCE_SCATTER:
  case LZ_COLL_ALL_REDUCE:
    if (shared_views(c, s, 0, bytes, view)) return reduce_shared(c, s, a, view);
    if (cma) return reduce_cma(c, s, a);
    break;
  case LZ_COLL_BROADCAST: {
    uint64_t o = atomic_load(&s->ranks[a->root].send_off);
    const uint8_t *root =
        o == UINT64_MAX ? NULL : lz_shared_view(shm_launcher_rank(s, a->root), (size_t)o, n);
    if (root) return broadcast_shared(c, s, a, root);
    break;
  }
  default: break;
  }
  return segment_path(c, s, a);
}

static lz_status segment_path(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
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

/* The signature every rank's barriers carry while `a` runs (check_sigs in
 * comm_shm_wait.c): its number among this communicator's calls, then
 * lz_coll_signature's words. */
static void set_sig(shm_comm *s, const lz_coll_args *a) {
  s->sig[0] = ++s->calls;
  lz_coll_signature(a, s->sig + 1);
}

static lz_status shm_run(lz_comm *c, const lz_coll_args *a) {
  shm_comm *s = c->impl;
  set_sig(s, a);
  if (a->kind == LZ_COLL_BARRIER) return shm_barrier(c, s, "barrier");
  if (a->kind == LZ_COLL_ALL_TO_ALL) return shm_all_to_all(c, s, a);
  if (a->count == 0) return LZ_OK;
  if (c->size == 1) {
    lz_comm_one_rank(a);
    return LZ_OK;
  }
  if (single_copy_fits(s, a)) return single_copy(c, s, a);
  return segment_path(c, s, a);
}

const lz_comm_backend_ops lz_comm_shm_ops = {shm_init, shm_free, shm_run, shm_group, 1};
