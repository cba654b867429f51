/* comm_shm_a2a.c — all-to-all (equal and per-peer counts) between the ranks
 * of one shared-memory segment. First every rank writes its counts and
 * offsets into its bank and its send buffer's address into its record; after
 * one barrier every rank reads the whole table and checks it
 * (lz_comm_a2a_check: a mismatch fails every rank alike, before any data
 * moves). So every rank knows every message's size, and all choose the same
 * path and the same number of rounds:
 *   - shared memory: every send buffer is in the job's shared memory; each
 *     rank copies what its peers hold for it straight out of their buffers
 *     (one copy per byte), then a barrier keeps the buffers valid until the
 *     last peer has read them;
 *   - cross-memory attach: the same with process_vm_readv;
 *   - the segment: rounds of one bank each, the bank split into one slot per
 *     destination; every rank writes its pieces for each peer, a barrier,
 *     then reads its slot of every peer's bank.
 * A copy moves bytes unchanged, so every path gives bitwise the same result.
 * A rank with nothing to send or receive passes the same barriers. */
#include "comm/comm_shm.h"

#include <stdlib.h> /* malloc */

#define A2A_CMA_MIN (64u << 10) /* the largest message from which process_vm_readv pays */

typedef void *(*copy_fn)(void *, const void *, size_t);
static void *copy_stream(void *dst, const void *src, size_t n) {
  lz_copy_stream(dst, src, n);
  return dst;
}

/* Rank p's entry of kind k (0 send counts, 1 send offsets, 2 receive
 * counts, 3 receive offsets) for rank q, from the agreed table. */
static int64_t entry(const lz_coll_args *a, int W, int p, int k, int q) {
  return a->table[(size_t)p * 4 * W + (size_t)k * W + q];
}

/* The bytes of rank p's send buffer that anything is read from. */
static size_t send_extent(const lz_coll_args *a, int W, int p, size_t es) {
  size_t most = 0;
  for (int q = 0; q < W; q++) {
    size_t end = (size_t)(entry(a, W, p, 1, q) + entry(a, W, p, 0, q)) * es;
    if (entry(a, W, p, 0, q) && end > most) most = end;
  }
  return most;
}

static lz_status through_segment(lz_comm *c, shm_comm *s, const lz_coll_args *a, size_t most);

/* This rank's part for itself, send to recv. */
static void copy_own(lz_comm *c, const lz_coll_args *a, copy_fn copy) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt), own = (size_t)a->v[me] * es;
  if (own)
    copy((uint8_t *)a->recv + (size_t)a->v[3 * W + me] * es,
         (const uint8_t *)a->send + (size_t)a->v[W + me] * es, own);
}

/* Reads the peers' send buffers (published with the counts) in place: through
 * shared memory where every send buffer is in it, else with
 * process_vm_readv where the kernel allows it, else through the segment.
 * Every rank sees the same published buffers, so all choose alike. */
static lz_status single_copy(lz_comm *c, shm_comm *s, const lz_coll_args *a, copy_fn copy,
                             size_t most) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt);
  const uint8_t *view[W];
  int shared = s->direct;
  for (int p = 0; p < W && shared; p++) {
    uint64_t off = atomic_load(&s->ranks[p].send_off);
    size_t bytes = send_extent(a, W, p, es);
    view[p] = off == UINT64_MAX || !bytes
                  ? NULL
                  : lz_shared_view(shm_launcher_rank(s, p), (size_t)off, bytes);
    shared = view[p] != NULL || !bytes;
  }
  if (!shared && !s->cma) {
    copy_own(c, a, copy);
    return through_segment(c, s, a, most);
  }
  uint8_t *recv = a->recv;
  const int64_t *rc = a->v + 2 * W, *ro = a->v + 3 * W;
  for (int i = 1; i < W; i++) { /* start at the next rank: the ranks read different peers */
    int p = (me + i) % W;
    size_t n = (size_t)rc[p] * es, at = (size_t)entry(a, W, p, 1, me) * es;
    if (!n) continue;
    if (shared) copy(recv + (size_t)ro[p] * es, view[p] + at, n);
    else
      LZ_TRY(shm_cma_read(c, s, p, recv + (size_t)ro[p] * es, atomic_load(&s->ranks[p].send) + at,
                          n, "all_to_all"));
  }
  shm_arrive(c, s); /* this rank has read its peers: its own part overlaps their reading */
  copy_own(c, a, copy);
  return shm_wait(c, s, "all_to_all"); /* every peer has read this rank's buffer */
}

static lz_status through_segment(lz_comm *c, shm_comm *s, const lz_coll_args *a, size_t most) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt), sub = s->chunk / (size_t)W / 64 * 64;
  const int64_t *sc = a->v, *so = a->v + W, *rc = a->v + 2 * W, *ro = a->v + 3 * W;
  const uint8_t *send = a->send;
  uint8_t *recv = a->recv;
  for (size_t j0 = 0; j0 < most; j0 += sub) {
    uint8_t *mine = shm_bank(s, me, s->bank);
    for (int q = 0; q < W; q++) {
      size_t n = (size_t)sc[q] * es;
      if (q != me && n > j0)
        memcpy(mine + (size_t)q * sub, send + (size_t)so[q] * es + j0,
               n - j0 < sub ? n - j0 : sub);
    }
    LZ_TRY(shm_barrier(c, s, "all_to_all"));
    for (int p = 0; p < W; p++) {
      size_t n = (size_t)rc[p] * es;
      if (p != me && n > j0)
        memcpy(recv + (size_t)ro[p] * es + j0, shm_bank(s, p, s->bank) + (size_t)me * sub,
               n - j0 < sub ? n - j0 : sub);
    }
    s->bank ^= 1;
  }
  return LZ_OK;
}

static lz_status exchange(lz_comm *c, shm_comm *s, const lz_coll_args *a);

lz_status shm_all_to_all(lz_comm *c, shm_comm *s, const lz_coll_args *in) {
  int W = c->size, me = c->rank;
  size_t row = 4 * (size_t)W * sizeof(int64_t);
  /* 64 bytes a rank: through_segment's share of a bank for each rank (a
   * smaller bank would move 0 bytes a turn, forever), more than the counts'
   * row (32 a rank). The bank is the segment's: every rank refuses alike. */
  const size_t need = 64 * (size_t)W;
  if (need > s->chunk)
    return lz_fail(LZ_ERR_INVALID, "all_to_all: %d ranks need a bank of %zu bytes or more (got "
                   "%zu); set LZ_SHM_CHUNK to %zu or more", W, need, s->chunk, need);
  int64_t *table = malloc(row * (size_t)W);
  if (!table) return lz_fail(LZ_ERR_NOMEM, "all_to_all: rank %d: out of memory", me);
  memcpy(shm_bank(s, me, s->bank), in->v, row);
  atomic_store(&s->ranks[me].send, (uint64_t)(uintptr_t)in->send);
  atomic_store(&s->ranks[me].send_off, lz_shared_offset(in->send));
  lz_status st = shm_barrier(c, s, "all_to_all"); /* every rank has published */
  if (st == LZ_OK) {
    for (int p = 0; p < W; p++) memcpy(table + (size_t)p * 4 * W, shm_bank(s, p, s->bank), row);
    s->bank ^= 1;
    st = lz_comm_a2a_check(c, table);
  }
  if (st == LZ_OK) {
    lz_coll_args a = *in;
    a.table = table;
    st = exchange(c, s, &a);
  }
  free(table);
  return st;
}

static lz_status exchange(lz_comm *c, shm_comm *s, const lz_coll_args *a) {
  int W = c->size, me = c->rank;
  size_t es = lz_dtype_size(a->dt), most = 0, total = 0;
  for (int p = 0; p < W; p++)
    for (int q = 0; q < W; q++) {
      size_t n = (size_t)entry(a, W, p, 0, q) * es;
      if (p != q && n > most) most = n;
      if (q == me) total += n;
    }
  copy_fn copy = total >= shm_stream_min() ? copy_stream : memcpy;
  if (most && (s->direct || (s->cma && most >= A2A_CMA_MIN)))
    return single_copy(c, s, a, copy, most); /* its own part after the peers' */
  copy_own(c, a, copy);
  if (most == 0) return LZ_OK; /* every rank sees the same table: none waits for another */
  return through_segment(c, s, a, most);
}
