/* comm_mpi.c — collectives over OpenMPI (many machines). MPI is initialised
 * only when this backend is chosen. Reductions do not use MPI's own: each
 * rank receives its shard's pieces from every peer (point to point) and
 * reduces them with lz_reduce_fixed in rank order, then the shards are
 * exchanged back — the same per-element order as the shm backend, so results
 * are bitwise the same across ranks, runs and backends, and bf16/f16
 * accumulate in fp32. Every wait polls with a deadline (LZ_COMM_TIMEOUT) and
 * names the ranks whose messages have not arrived. All-to-all is the same
 * point-to-point exchange with per-peer counts (MPI_Alltoallv's, with the
 * timeout), after comm.c has made the ranks agree on them. A group is an
 * MPI_Comm_split of its parent; the communicators' progress threads take
 * turns calling MPI (one lock), as MPI_THREAD_SERIALIZED asks. */
#include "comm/comm_internal.h"

#include <mpi.h>    /* the whole backend */
#include <sched.h>  /* sched_yield when oversubscribed */
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* getenv */
#include <time.h>   /* nanosleep for long waits */
#include <unistd.h> /* sysconf */

#define MPI_DEFAULT_CHUNK (8u << 20) /* bytes of a reduction round (all ranks' parts) */
#define MPI_DIRECT_MAX (64u << 10)
#define MPI_MAX_MSG ((size_t)1 << 28) /* one message's bytes stay far below INT_MAX */

/* Held around every MPI call: a group's communicator has a progress thread
 * of its own. */
static pthread_mutex_t mpi_mu = PTHREAD_MUTEX_INITIALIZER;
#define LOCKED(call)                                                                               \
  ({                                                                                               \
    pthread_mutex_lock(&mpi_mu);                                                                   \
    int lz_rc_ = (call);                                                                           \
    pthread_mutex_unlock(&mpi_mu);                                                                 \
    lz_rc_;                                                                                        \
  })

/* Communicators alive (the world's and its groups'), and whether one of
 * them initialised MPI: the last one freed finalises it, whatever the order. */
static int mpi_live, mpi_finalize, mpi_broken;

typedef struct mpi_comm {
  MPI_Comm comm;
  int own_init;
  int yield;
  uint8_t *tmp;
  size_t tmp_bytes;
  MPI_Request *reqs;
  int *peer; /* the rank a receive waits for; -1 for sends */
  int nreq;
  uint64_t calls; /* collectives run on this communicator */
  int tag;        /* the running one's messages' tag (call_tag) */
  uint64_t sig[3]; /* and what it is (lz_coll_signature) */
} mpi_comm;

/* A collective's messages carry its number among the communicator's calls
 * (mod 64) and a hash of what it is (kind, dtype, reduce op, count, root,
 * an average's divisor) in their tag, so messages of ranks that called
 * different collectives never match each other's receives; a waiting rank
 * that finds a peer's message of its own call number but another hash (or
 * of another call but the next) knows the ranks parted (check_parted). */
#define TAG_CALL_BITS 6
#define TAG_HASH_BITS 9
static int call_tag(uint64_t call, const uint64_t w[3]) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < 3; i++) h = (h ^ w[i]) * 1099511628211ull; /* FNV-1a over the words */
  return (int)(((call & ((1u << TAG_CALL_BITS) - 1)) << TAG_HASH_BITS) |
               ((h ^ (h >> 32)) & ((1u << TAG_HASH_BITS) - 1)));
}

static lz_status mpi_fail(lz_comm *c, int rc, const char *op) {
  char s[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, s, &len);
  s[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = 0;
  return lz_fail(LZ_ERR_COMM, "%s: rank %d: MPI failed: %s", op, c->rank, s);
}

static lz_status setup(lz_comm *c, mpi_comm *m);

static lz_status mpi_init(lz_comm *c) {
  int inited = 0, provided = 0;
  MPI_Initialized(&inited);
  mpi_comm *m = calloc(1, sizeof *m);
  if (!m) return lz_fail(LZ_ERR_NOMEM, "mpi: out of memory");
  if (!inited) {
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
      free(m);
      return lz_fail(LZ_ERR_COMM, "mpi: MPI_Init_thread failed (code %d)", rc);
    }
    m->own_init = 1;
  }
  MPI_Comm_dup(MPI_COMM_WORLD, &m->comm);
  return setup(c, m);
}

/* The rest of a communicator on m->comm: rank, size, staging. Frees m on
 * failure. */
static lz_status setup(lz_comm *c, mpi_comm *m) {
  MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(m->comm, &c->rank);
  MPI_Comm_size(m->comm, &c->size);
  const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  m->yield = local && atoi(local) > ncpu;
  const char *cs = getenv("LZ_MPI_CHUNK");
  long long chunk = cs ? atoll(cs) : 0;
  m->tmp_bytes = chunk >= 4096 ? (size_t)chunk : MPI_DEFAULT_CHUNK;
  if (m->tmp_bytes < (size_t)c->size * 64) m->tmp_bytes = (size_t)c->size * 64;
  lz_status st = lz_mem_alloc((void **)&m->tmp, m->tmp_bytes, LZ_MEM_COMM);
  m->reqs = malloc(sizeof *m->reqs * 2 * (size_t)c->size);
  m->peer = malloc(sizeof *m->peer * 2 * (size_t)c->size);
  if (st != LZ_OK || !m->reqs || !m->peer) {
    lz_mem_free(m->tmp);
    free(m->reqs);
    free(m->peer);
    MPI_Comm_free(&m->comm);
    if (m->own_init) MPI_Finalize();
    size_t want = m->tmp_bytes;
    free(m);
    return lz_fail(LZ_ERR_NOMEM, "mpi: out of memory for %zu bytes of staging", want);
  }
  c->impl = m;
  mpi_live++;
  return LZ_OK;
}

static void mpi_free(lz_comm *c) {
  mpi_comm *m = c->impl;
  if (!m) return;
  lz_mem_free(m->tmp);
  free(m->reqs);
  free(m->peer);
  /* After a failed collective, requests may still be pending: finalizing
   * could hang, so leave it to the process exit (mpirun then stops the job). */
  mpi_finalize |= m->own_init;
  mpi_broken |= c->broken != LZ_OK;
  if (!c->broken) LOCKED(MPI_Comm_free(&m->comm));
  if (--mpi_live == 0 && mpi_finalize && !mpi_broken) MPI_Finalize();
  free(m);
  c->impl = NULL;
}

static lz_status post(lz_comm *c, mpi_comm *m, int is_recv, void *buf, size_t bytes, int p,
                      const char *op) {
  int rc = is_recv
               ? LOCKED(MPI_Irecv(buf, (int)bytes, MPI_BYTE, p, m->tag, m->comm, &m->reqs[m->nreq]))
               : LOCKED(MPI_Isend(buf, (int)bytes, MPI_BYTE, p, m->tag, m->comm, &m->reqs[m->nreq]));
  if (rc != MPI_SUCCESS) return mpi_fail(c, rc, op);
  m->peer[m->nreq++] = is_recv ? p : -1;
  return LZ_OK;
}

/* Whether a message waits from `from` (MPI_ANY_SOURCE: anyone) whose tag
 * says its sender runs another collective than this rank's: of this call
 * number with another hash, or of a call other than the next (a peer done
 * with this one may have sent the next's). Only messages no posted receive
 * took are seen, so a receive of this collective still pending from a peer
 * means its message of this collective has not come. */
static lz_status check_parted(lz_comm *c, mpi_comm *m, int from, const char *op) {
  int flag = 0;
  MPI_Status st;
  if (LOCKED(MPI_Iprobe(from, MPI_ANY_TAG, m->comm, &flag, &st)) != MPI_SUCCESS || !flag)
    return LZ_OK;
  unsigned mask = (1u << TAG_CALL_BITS) - 1;
  char what[160];
  unsigned call = (unsigned)st.MPI_TAG >> TAG_HASH_BITS, mine = (unsigned)m->tag >> TAG_HASH_BITS;
  if (st.MPI_TAG == m->tag || call == ((mine + 1) & mask)) return LZ_OK;
  return lz_fail(LZ_ERR_COMM,
                 "%s: the ranks called different collectives: rank %d's collective #%llu is %s, "
                 "rank %d sent a message of %s. Every rank must make the same collective calls in "
                 "the same order (a call made on some ranks only, such as a save or an evaluation "
                 "under `if rank == 0`, puts them out of step)",
                 op, c->rank, (unsigned long long)m->calls,
                 lz_coll_signature_text(m->sig, what, sizeof what), st.MPI_SOURCE,
                 call == (mine & mask) ? "another kind, count, dtype, op or root at that number"
                                       : "a collective of another number");
}

/* Waits for the posted requests; `who` names the peers for collectives MPI
 * runs itself (broadcast, barrier). */
static lz_status wait_posted(lz_comm *c, mpi_comm *m, const char *op, const char *who) {
  double t0 = lz_now_s(), deadline = t0 + c->timeout_s;
  for (unsigned i = 1;; i++) {
    int done = 0;
    int rc = LOCKED(MPI_Testall(m->nreq, m->reqs, &done, MPI_STATUSES_IGNORE));
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, op);
    if (done) {
      m->nreq = 0;
      return LZ_OK;
    }
    if (m->yield) sched_yield();
    if ((i & 1023) == 0) {
      if (who) LZ_TRY(check_parted(c, m, MPI_ANY_SOURCE, op));
      for (int r = 0; !who && r < m->nreq; r++) {
        int done = 1;
        if (m->peer[r] >= 0) LOCKED(MPI_Request_get_status(m->reqs[r], &done, MPI_STATUS_IGNORE));
        if (!done) LZ_TRY(check_parted(c, m, m->peer[r], op));
      }
      double t = lz_now_s();
      if (t - t0 > 1.0) { /* a long wait: stop burning the core */
        struct timespec nap = {0, 1000 * 1000};
        nanosleep(&nap, NULL);
      }
      if (t >= deadline) {
        char buf[256];
        size_t n = 0;
        buf[0] = 0;
        for (int r = 0; r < m->nreq && n < sizeof buf; r++) {
          int flag = 1;
          if (m->peer[r] >= 0) LOCKED(MPI_Request_get_status(m->reqs[r], &flag, MPI_STATUS_IGNORE));
          if (!flag) n += (size_t)snprintf(buf + n, sizeof buf - n, n ? ", %d" : "%d", m->peer[r]);
        }
        return lz_fail(LZ_ERR_TIMEOUT,
                       "%s: rank %d waited %.1f s (LZ_COMM_TIMEOUT) for %s%s; they never joined "
                       "this collective (a rank stuck, or ranks calling different collectives)",
                       op, c->rank, t - t0, who ? who : "ranks ", who ? "" : buf);
      }
    }
  }
}

static lz_status reduce(lz_comm *c, mpi_comm *m, const lz_coll_args *a) {
  int W = c->size, me = c->rank, all = a->kind == LZ_COLL_ALL_REDUCE;
  const char *op = lz_coll_name(a->kind);
  size_t es = lz_dtype_size(a->dt), n = (size_t)a->count * es;
  const void *srcs[W];
  if (all && n <= MPI_DIRECT_MAX && n * (size_t)(W - 1) <= m->tmp_bytes) {
    for (int p = 0; p < W; p++) {
      if (p == me) continue;
      int slot = p < me ? p : p - 1;
      LZ_TRY(post(c, m, 1, m->tmp + (size_t)slot * n, n, p, op));
      LZ_TRY(post(c, m, 0, a->recv, n, p, op));
    }
    LZ_TRY(wait_posted(c, m, op, NULL));
    for (int p = 0; p < W; p++)
      srcs[p] = p == me ? a->recv : m->tmp + (size_t)(p < me ? p : p - 1) * n;
    lz_reduce_fixed(a->recv, srcs, W, a->count, a->dt, a->op, a->divisor);
    return LZ_OK;
  }
  size_t sub_bytes = m->tmp_bytes / (size_t)W / 64 * 64;
  if (sub_bytes > MPI_MAX_MSG) sub_bytes = MPI_MAX_MSG;
  int64_t mm = (int64_t)(sub_bytes / es);
  sub_bytes = (size_t)mm * es;
  int64_t off[W], len[W];
  for (int p = 0; p < W; p++) lz_comm_shard(a->count, W, p, &off[p], &len[p]);
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  for (int64_t j0 = 0; j0 < len[0]; j0 += mm) {
    int64_t k[W];
    for (int p = 0; p < W; p++) k[p] = len[p] - j0 < mm ? (len[p] - j0 > 0 ? len[p] - j0 : 0) : mm;
    for (int p = 0; p < W; p++) {
      if (p == me) continue;
      if (k[me]) LZ_TRY(post(c, m, 1, m->tmp + (size_t)p * sub_bytes, (size_t)k[me] * es, p, op));
      if (k[p]) LZ_TRY(post(c, m, 0, (void *)(send + (off[p] + j0) * es), (size_t)k[p] * es, p, op));
    }
    LZ_TRY(wait_posted(c, m, op, NULL));
    uint8_t *dst = all ? recv + (off[me] + j0) * es : recv + j0 * es;
    if (k[me]) {
      for (int p = 0; p < W; p++)
        srcs[p] = p == me ? (const void *)(send + (off[me] + j0) * es) : m->tmp + (size_t)p * sub_bytes;
      lz_reduce_fixed(dst, srcs, W, k[me], a->dt, a->op, a->divisor);
    }
    if (!all) continue;
    for (int p = 0; p < W; p++) {
      if (p == me) continue;
      if (k[p]) LZ_TRY(post(c, m, 1, recv + (off[p] + j0) * es, (size_t)k[p] * es, p, op));
      if (k[me]) LZ_TRY(post(c, m, 0, dst, (size_t)k[me] * es, p, op));
    }
    LZ_TRY(wait_posted(c, m, op, NULL));
  }
  return LZ_OK;
}

static lz_status all_gather(lz_comm *c, mpi_comm *m, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt);
  int64_t mm = (int64_t)(MPI_MAX_MSG / es);
  int64_t off[W], len[W];
  lz_comm_gather_own(a, W, me, off, len);
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  for (int64_t j0 = 0; j0 < len[0]; j0 += mm) {
    for (int p = 0; p < W; p++) {
      if (p == me) continue;
      int64_t kp = len[p] - j0 < mm ? len[p] - j0 : mm, km = len[me] - j0 < mm ? len[me] - j0 : mm;
      if (kp > 0) LZ_TRY(post(c, m, 1, recv + (off[p] + j0) * es, (size_t)kp * es, p, "all_gather"));
      if (km > 0)
        LZ_TRY(post(c, m, 0, (void *)(send + j0 * es), (size_t)km * es, p, "all_gather"));
    }
    LZ_TRY(wait_posted(c, m, "all_gather", NULL));
  }
  return LZ_OK;
}

/* Rounds of at most MPI_MAX_MSG bytes per peer, each peer's receive and
 * send posted together; this rank's own part is a copy. */
static lz_status all_to_all(lz_comm *c, mpi_comm *m, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt), most = 0;
  const int64_t *sc = a->v, *so = a->v + W, *rc = a->v + 2 * W, *ro = a->v + 3 * W;
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  if (sc[me]) memmove(recv + (size_t)ro[me] * es, send + (size_t)so[me] * es, (size_t)sc[me] * es);
  for (int p = 0; p < W; p++)
    if (p != me) {
      if ((size_t)sc[p] * es > most) most = (size_t)sc[p] * es;
      if ((size_t)rc[p] * es > most) most = (size_t)rc[p] * es;
    }
  for (size_t j0 = 0; j0 < most; j0 += MPI_MAX_MSG) {
    for (int i = 1; i < W; i++) {
      int to = (me + i) % W, from = (me - i + W) % W;
      size_t nr = (size_t)rc[from] * es, ns = (size_t)sc[to] * es;
      if (nr > j0)
        LZ_TRY(post(c, m, 1, recv + (size_t)ro[from] * es + j0,
                    nr - j0 < MPI_MAX_MSG ? nr - j0 : MPI_MAX_MSG, from, "all_to_all"));
      if (ns > j0)
        LZ_TRY(post(c, m, 0, (void *)(send + (size_t)so[to] * es + j0),
                    ns - j0 < MPI_MAX_MSG ? ns - j0 : MPI_MAX_MSG, to, "all_to_all"));
    }
    LZ_TRY(wait_posted(c, m, "all_to_all", NULL));
  }
  return LZ_OK;
}

static lz_status mpi_group(lz_comm *parent, lz_comm *c) {
  mpi_comm *pm = parent->impl;
  int color = c->ranks[0];
  for (int i = 1; i < c->size; i++)
    if (c->ranks[i] < color) color = c->ranks[i];
  mpi_comm *m = calloc(1, sizeof *m);
  if (!m) return lz_fail(LZ_ERR_NOMEM, "mpi: out of memory");
  int want_rank = c->rank, want_size = c->size;
  int rc = LOCKED(MPI_Comm_split(pm->comm, color, want_rank, &m->comm));
  if (rc != MPI_SUCCESS) {
    free(m);
    return mpi_fail(parent, rc, "comm_group");
  }
  LZ_TRY(setup(c, m));
  if (c->rank != want_rank || c->size != want_size)
    return lz_fail(LZ_ERR_INTERNAL, "comm_group: MPI_Comm_split made rank %d of %d, not %d of %d",
                   c->rank, c->size, want_rank, want_size);
  return LZ_OK;
}

static lz_status mpi_run(lz_comm *c, const lz_coll_args *a) {
  mpi_comm *m = c->impl;
  m->nreq = 0;
  lz_coll_signature(a, m->sig);
  m->tag = call_tag(++m->calls, m->sig);
  if (a->kind == LZ_COLL_ALL_TO_ALL) return all_to_all(c, m, a);
  if (a->kind == LZ_COLL_BARRIER) {
    int rc = LOCKED(MPI_Ibarrier(m->comm, &m->reqs[0]));
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "barrier");
    m->peer[0] = -1;
    m->nreq = 1;
    return wait_posted(c, m, "barrier", "the other ranks (MPI cannot tell which)");
  }
  if (a->count == 0) return LZ_OK;
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  if (c->size == 1) {
    lz_comm_one_rank(a);
    return LZ_OK;
  }
  switch (a->kind) {
  case LZ_COLL_ALL_REDUCE:
  case LZ_COLL_REDUCE_SCATTER: return reduce(c, m, a);
  case LZ_COLL_ALL_GATHER: return all_gather(c, m, a);
  case LZ_COLL_BROADCAST: {
    char who[64];
    snprintf(who, sizeof who, "root rank %d", a->root);
    for (size_t j0 = 0; j0 < n; j0 += MPI_MAX_MSG) {
      size_t k = n - j0 < MPI_MAX_MSG ? n - j0 : MPI_MAX_MSG;
      int rc = LOCKED(MPI_Ibcast((uint8_t *)a->recv + j0, (int)k, MPI_BYTE, a->root, m->comm, &m->reqs[0]));
      if (rc != MPI_SUCCESS) return mpi_fail(c, rc, "broadcast");
      m->peer[0] = -1;
      m->nreq = 1;
      LZ_TRY(wait_posted(c, m, "broadcast", who));
    }
    return LZ_OK;
  }
  default: return lz_fail(LZ_ERR_INVALID, "mpi: unknown collective %d", (int)a->kind);
  }
}

const lz_comm_backend_ops lz_comm_mpi_ops = {mpi_init, mpi_free, mpi_run, mpi_group, 0};
