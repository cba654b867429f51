/* a2a_check.c — the multi-rank test of all-to-all and of sub-groups, run by
 * tests/comm/run.sh under the launcher (shm) and under mpirun (mpi) at 1-4
 * ranks. Against a naive reference computed here (every rank can rebuild
 * every rank's send buffer):
 *   - all_to_all with equal counts, all_to_all_v with uneven counts, zero
 *     counts, a rank that sends and receives nothing, permuted offsets with
 *     gaps (which must stay untouched), blocking and asynchronous, several
 *     dtypes; bitwise, and the byte counter;
 *   - groups: two disjoint groups running every collective at the same time
 *     (a different number of them), expert-parallel and expert-data-parallel
 *     groups (blocks and strides) used in turn, groups of one rank and of all;
 *   - averages over the world: a group's lz_comm_*_avg_over the world size
 *     gives the world's own average, with zeros from the ranks outside the
 *     group, bitwise in f32, bf16 and f16 (expert gradients reduced over
 *     their expert-data-parallel group);
 *   - mismatches: counts that disagree, and group lists that disagree, fail
 *     on every rank at once with an error naming the ranks (no timeout).
 * With --hashes rank 0 prints one line per all-to-all case (the xor of every
 * rank's result hash) so run.sh can compare backends and paths.
 *
 *   a2a_check [--hashes] [--buffers shared|private]
 *   a2a_check --never-join R    rank R skips an all_to_all_v; the others must
 *                               fail with the timeout error naming it */
#include "luazero.h"

#include <stdio.h>  /* printf */
#include <stdlib.h> /* malloc */
#include <string.h> /* memcmp, strstr */
#include <time.h>   /* clock_gettime */
#include <unistd.h> /* sleep */

static int rank, world, failures, cases, print_hash;
static lz_comm *comm;
static lz_mem_category category = LZ_MEM_COMM;

#define FAIL(...)                                                                                  \
  do {                                                                                             \
    printf("rank %d: FAIL: ", rank);                                                               \
    printf(__VA_ARGS__);                                                                           \
    printf("\n");                                                                                  \
    failures++;                                                                                    \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Bytes [from, from + n) of rank r's send buffer in case `seed`. */
static void fill(uint8_t *dst, int r, size_t from, size_t n, uint32_t seed) {
  for (size_t b = 0; b < n; b++) {
    size_t at = from + b;
    dst[b] = (uint8_t)(mix(((uint64_t)seed << 40) ^ ((uint64_t)r << 32) ^ (at / 8)) >> (8 * (at % 8)));
  }
}

/* One layout of an all_to_all_v case: counts and offsets of every rank. */
typedef struct layout {
  int W;
  int64_t cnt[4][4];        /* cnt[p][q]: elements p sends q */
  int64_t so[4][4], ro[4][4]; /* send and receive offsets */
  int64_t send_n[4], recv_n[4];
} layout;

/* Uneven counts up to `scale`, some zero; rank `idle` (-1: none) sends and
 * receives nothing. Send offsets run the destinations backwards with gaps
 * of 3, receive offsets the sources forwards from 1 with gaps of 5. */
static void make_layout(layout *L, int W, uint32_t seed, int64_t scale, int idle) {
  memset(L, 0, sizeof *L);
  L->W = W;
  for (int p = 0; p < W; p++)
    for (int q = 0; q < W; q++) {
      uint64_t h = mix(((uint64_t)seed << 16) ^ (uint64_t)(p * 4 + q));
      L->cnt[p][q] = p == idle || q == idle || h % 4 == 0 ? 0 : (int64_t)((h >> 8) % (uint64_t)scale) + 1;
    }
  for (int p = 0; p < W; p++) {
    int64_t at = 0;
    for (int q = W - 1; q >= 0; q--) {
      L->so[p][q] = at;
      at += L->cnt[p][q] + 3;
    }
    L->send_n[p] = at;
    at = 1;
    for (int q = 0; q < W; q++) {
      L->ro[p][q] = at;
      at += L->cnt[q][p] + 5;
    }
    L->recv_n[p] = at;
  }
}

static uint64_t hash_all(uint64_t h) { /* xor of every rank's hash, weighted by rank */
  uint64_t all[4] = {0};
  if (lz_comm_all_gather(comm, &h, all, 2 * world, LZ_I32, NULL) != LZ_OK) {
    FAIL("hash all_gather: %s", lz_last_error());
    return 0;
  }
  uint64_t x = 0;
  for (int p = 0; p < world; p++) x ^= all[p] * (uint64_t)(2 * p + 1);
  return x;
}

/* Runs one layout on communicator c (its own rank numbers). */
static void run_layout(lz_comm *c, const layout *L, lz_dtype dt, uint32_t seed, int async,
                       int equal, const char *what) {
  int me = lz_comm_rank(c), W = L->W;
  size_t es = lz_dtype_size(dt);
  cases++;
  uint8_t *send, *recv, *want;
  size_t sb = (size_t)L->send_n[me] * es, rb = (size_t)L->recv_n[me] * es;
  if (lz_mem_alloc((void **)&send, sb + 64, category) != LZ_OK ||
      lz_mem_alloc((void **)&recv, rb + 64, category) != LZ_OK ||
      lz_mem_alloc((void **)&want, rb + 64, LZ_MEM_WORKSPACE) != LZ_OK) {
    FAIL("%s: alloc: %s", what, lz_last_error());
    return;
  }
  fill(send, me, 0, sb, seed);
  memset(recv, 0xEE, rb);
  memset(want, 0xEE, rb);
  for (int p = 0; p < W; p++)
    fill(want + (size_t)L->ro[me][p] * es, p, (size_t)L->so[p][me] * es,
         (size_t)L->cnt[p][me] * es, seed);
  int64_t sc[4], so[4], rc[4], ro[4];
  uint64_t expect_bytes = 0;
  for (int q = 0; q < W; q++) {
    sc[q] = L->cnt[me][q];
    so[q] = L->so[me][q];
    rc[q] = L->cnt[q][me];
    ro[q] = L->ro[me][q];
    if (q != me) expect_bytes += (uint64_t)sc[q] * es;
  }
  uint64_t bytes0 = lz_comm_bytes(c, LZ_COLL_ALL_TO_ALL);
  lz_work *w = NULL;
  lz_status st = equal ? lz_comm_all_to_all(c, send, recv, L->cnt[0][0], dt, async ? &w : NULL)
                       : lz_comm_all_to_all_v(c, send, sc, so, recv, rc, ro, dt, async ? &w : NULL);
  if (st == LZ_OK && async) st = lz_work_wait(w);
  if (st != LZ_OK) FAIL("%s: %s", what, lz_last_error());
  else if (memcmp(recv, want, rb) != 0) {
    size_t b = 0;
    while (recv[b] == want[b]) b++;
    FAIL("%s: the received bytes differ from the reference (first at byte %zu of %zu)", what, b,
         rb);
  }
  uint64_t sent = lz_comm_bytes(c, LZ_COLL_ALL_TO_ALL) - bytes0;
  if (st == LZ_OK && sent != expect_bytes)
    FAIL("%s: the byte counter grew by %llu, expected %llu", what, (unsigned long long)sent,
         (unsigned long long)expect_bytes);
  if (c == comm) {
    uint64_t h = hash_all(lz_hash_xxh64(recv, rb, 0));
    if (print_hash && rank == 0) printf("hash %s %016llx\n", what, (unsigned long long)h);
  }
  lz_mem_free(send);
  lz_mem_free(recv);
  lz_mem_free(want);
}

/* all_to_all's layout: count for every pair, no gaps, destinations in order. */
static void equal_layout(layout *L, int W, int64_t count) {
  memset(L, 0, sizeof *L);
  L->W = W;
  for (int p = 0; p < W; p++) {
    for (int q = 0; q < W; q++) {
      L->cnt[p][q] = count;
      L->so[p][q] = L->ro[p][q] = (int64_t)q * count;
    }
    L->send_n[p] = L->recv_n[p] = (int64_t)W * count;
  }
}

static void all_to_all_cases(void) {
  lz_dtype dts[] = {LZ_F32, LZ_BF16, LZ_I32};
  int64_t counts[] = {0, 1, 7, 4097, 262147};
  char what[160];
  layout L;
  for (int d = 0; d < 3; d++)
    for (int i = 0; i < 5; i++) {
      equal_layout(&L, world, counts[i]);
      snprintf(what, sizeof what, "all_to_all %s count %lld", lz_dtype_name(dts[d]),
               (long long)counts[i]);
      run_layout(comm, &L, dts[d], (uint32_t)(100 + cases), i & 1, 1, what);
    }
  int64_t scales[] = {1, 5, 3000, 100000, 400000};
  for (int d = 0; d < 3; d++)
    for (int i = 0; i < 5; i++)
      for (int idle = -1; idle < world; idle += world > 1 ? world : 1) {
        uint32_t seed = (uint32_t)(1000 + 10 * i + d);
        make_layout(&L, world, seed, scales[i], idle);
        snprintf(what, sizeof what, "all_to_all_v %s scale %lld idle %d", lz_dtype_name(dts[d]),
                 (long long)scales[i], idle);
        run_layout(comm, &L, dts[d], seed, (i + d) & 1, 0, what);
      }
}

/* ------------------------------------------------------------------ groups */

static lz_comm *group_of(const int *ranks, int n, const char *what) {
  lz_comm *g = NULL;
  if (lz_comm_group_new(comm, ranks, n, &g) != LZ_OK) {
    FAIL("%s: comm_group: %s", what, lz_last_error());
    return NULL;
  }
  int at = -1;
  for (int i = 0; i < n; i++)
    if (ranks[i] == rank) at = i;
  if (lz_comm_rank(g) != at || lz_comm_size(g) != n)
    FAIL("%s: group rank %d of %d, expected %d of %d", what, lz_comm_rank(g), lz_comm_size(g), at,
         n);
  for (int i = 0; i < n; i++)
    if (lz_comm_parent_rank(g, i) != ranks[i])
      FAIL("%s: parent rank of %d is %d, expected %d", what, i, lz_comm_parent_rank(g, i),
           ranks[i]);
  return g;
}

/* `rounds` times every collective on group g of parent ranks `ranks`,
 * checked against the values the members put in. */
static void exercise(lz_comm *g, const int *ranks, int n, int rounds, const char *what) {
  int me = lz_comm_rank(g);
  float x[1000], shard[1000], full[1000];
  for (int r = 0; r < rounds; r++) {
    cases++;
    for (int i = 0; i < 1000; i++) x[i] = (float)(rank * 1000 + i + r);
    float sum0 = 0;
    for (int p = 0; p < n; p++) sum0 += (float)(ranks[p] * 1000 + r);
    if (lz_comm_all_reduce(g, x, 1000, LZ_F32, LZ_RED_SUM, NULL) != LZ_OK) {
      FAIL("%s: all_reduce: %s", what, lz_last_error());
      return;
    }
    if (x[0] != sum0) FAIL("%s: all_reduce gave %g, expected %g", what, x[0], sum0);
    int64_t off, len;
    lz_comm_shard(1000, n, me, &off, &len);
    for (int i = 0; i < len; i++) shard[i] = (float)(ranks[me] + 10 * (off + i));
    if (lz_comm_all_gather(g, shard, full, 1000, LZ_F32, NULL) != LZ_OK) {
      FAIL("%s: all_gather: %s", what, lz_last_error());
      return;
    }
    for (int p = 0; p < n; p++) {
      int64_t po, pl;
      lz_comm_shard(1000, n, p, &po, &pl);
      if (pl && full[po] != (float)(ranks[p] + 10 * po))
        FAIL("%s: all_gather: element %lld is %g, expected %g", what, (long long)po, full[po],
             (double)(ranks[p] + 10 * po));
    }
    for (int i = 0; i < 1000; i++) x[i] = (float)ranks[me];
    if (me != n - 1)
      for (int i = 0; i < 1000; i++) full[i] = -1;
    if (lz_comm_reduce_scatter(g, x, shard, 1000, LZ_F32, LZ_RED_MAX, NULL) != LZ_OK ||
        lz_comm_broadcast(g, full, 1000, LZ_F32, n - 1, NULL) != LZ_OK ||
        lz_comm_barrier(g) != LZ_OK) {
      FAIL("%s: reduce_scatter, broadcast, barrier: %s", what, lz_last_error());
      return;
    }
    int top = 0;
    for (int p = 0; p < n; p++) top = ranks[p] > top ? ranks[p] : top;
    if (len && shard[0] != (float)top) FAIL("%s: reduce_scatter max gave %g", what, shard[0]);
    int64_t lo, ll;
    lz_comm_shard(1000, n, n - 1, &lo, &ll);
    if (full[lo] != (float)(ranks[n - 1] + 10 * lo))
      FAIL("%s: broadcast from group rank %d gave %g", what, n - 1, full[lo]);
    layout L;
    make_layout(&L, n, (uint32_t)(7000 + r), r & 1 ? 20000 : 9, -1);
    run_layout(g, &L, LZ_F32, (uint32_t)(7000 + r), r & 1, 0, what);
  }
}

/* ------------------------------------------------- averages over the world */

/* n terms of rank r in dtype dt (bits), case `seed`: finite, nonzero, of
 * both signs and a spread of exponents, so that a rounding before the
 * division would show where the divisor is not a power of two. */
static void terms(uint8_t *dst, lz_dtype dt, int r, int n, uint32_t seed) {
  for (int i = 0; i < n; i++) {
    uint64_t m = mix(((uint64_t)seed << 40) ^ ((uint64_t)r << 32) ^ (uint64_t)i);
    uint32_t sign = (uint32_t)(m & 1), e = (uint32_t)(m >> 1) % 12;
    if (dt == LZ_F32) {
      uint32_t bits = sign << 31 | (120 + e) << 23 | ((uint32_t)(m >> 8) & 0x7fffff);
      memcpy(dst + 4 * (size_t)i, &bits, 4);
    } else {
      uint16_t bits = dt == LZ_BF16 ? (uint16_t)(sign << 15 | (120 + e) << 7 | (m >> 8 & 0x7f))
                                    : (uint16_t)(sign << 15 | (9 + e) << 10 | (m >> 8 & 0x3ff));
      memcpy(dst + 2 * (size_t)i, &bits, 2);
    }
  }
}

/* The expert-data-parallel groups of every ep_size that divides the world
 * (stride ep_size; ep_size = world: groups of one, ep_size 1: the world
 * itself): a group's all_reduce and reduce_scatter averaged over the world
 * size equal, bit for bit, the world's all_reduce average where the ranks
 * outside the group put zeros, in f32, bf16 and f16. */
static void averages_over_the_world(void) {
  enum { N = 1003 };
  const lz_dtype dts[3] = {LZ_F32, LZ_BF16, LZ_F16};
  static uint8_t mine[4 * N], want[4 * N], got[4 * N], shard[4 * N], y[4 * N];
  for (int ep = 1; ep <= world; ep++) {
    if (world % ep) continue;
    int members[4], n = 0;
    for (int p = rank % ep; p < world; p += ep) members[n++] = p;
    lz_comm *g = group_of(members, n, "average group");
    if (!g) continue;
    for (int d = 0; d < 3; d++) {
      lz_dtype dt = dts[d];
      size_t es = dt == LZ_F32 ? 4 : 2;
      cases++;
      terms(mine, dt, rank, N, (uint32_t)(900 + 10 * ep + d));
      for (int k = 0; k < ep; k++) { /* the world's average for group k */
        if (rank % ep == k)
          memcpy(y, mine, N * es);
        else
          memset(y, 0, N * es);
        if (lz_comm_all_reduce(comm, y, N, dt, LZ_RED_AVG, NULL) != LZ_OK) {
          FAIL("world average, ep_size %d: %s", ep, lz_last_error());
          break;
        }
        if (rank % ep == k) memcpy(want, y, N * es);
      }
      memcpy(got, mine, N * es);
      int64_t off, len;
      lz_comm_shard(N, n, lz_comm_rank(g), &off, &len);
      if (lz_comm_all_reduce_avg_over(g, got, N, dt, world, NULL) != LZ_OK ||
          lz_comm_reduce_scatter_avg_over(g, mine, shard, N, dt, world, NULL) != LZ_OK) {
        FAIL("group average over %d ranks, ep_size %d: %s", world, ep, lz_last_error());
        continue;
      }
      if (memcmp(got, want, N * es))
        FAIL("all_reduce_avg_over, ep_size %d, %s: not the world's average", ep, lz_dtype_name(dt));
      if (memcmp(shard, want + (size_t)off * es, (size_t)len * es))
        FAIL("reduce_scatter_avg_over, ep_size %d, %s: not the world's average", ep,
             lz_dtype_name(dt));
    }
    lz_comm_free(g);
  }
  cases++; /* a divisor under 1 is refused before anything moves */
  float x = 1;
  if (lz_comm_all_reduce_avg_over(comm, &x, 1, LZ_F32, 0, NULL) != LZ_ERR_INVALID ||
      !strstr(lz_last_error(), "divisor is 0"))
    FAIL("all_reduce_avg_over with divisor 0: %s", lz_last_error());
}

static void groups(void) {
  int all[4], even[4], odd[4], ne = 0, no = 0;
  for (int p = 0; p < world; p++) {
    all[p] = p;
    if (p % 2 == 0) even[ne++] = p;
    else odd[no++] = p;
  }
  /* Two disjoint groups, a different number of operations each, then the
   * world: each group's counters are its own. */
  const int *mine = rank % 2 == 0 ? even : odd;
  int n = rank % 2 == 0 ? ne : no;
  lz_comm *g = group_of(mine, n, "even/odd groups");
  if (g) {
    exercise(g, mine, n, rank % 2 == 0 ? 3 : 1, "even/odd groups");
    float one = 1;
    if (lz_comm_all_reduce(comm, &one, 1, LZ_F32, LZ_RED_SUM, NULL) != LZ_OK || one != world)
      FAIL("world all_reduce after the groups: %g (%s)", one, lz_last_error());
    lz_comm_free(g);
  }
  /* Expert-parallel groups (blocks of 2) and expert-data-parallel groups
   * (stride 2), both alive, used in turn. */
  if (world % 2 == 0) {
    int ep[2] = {rank / 2 * 2, rank / 2 * 2 + 1}, edp[2], k = 0;
    for (int p = rank % 2; p < world; p += 2) edp[k++] = p;
    lz_comm *ge = group_of(ep, 2, "expert-parallel group"), *gd = group_of(edp, k, "expert-data-parallel group");
    for (int r = 0; ge && gd && r < 2; r++) {
      exercise(ge, ep, 2, 1, "expert-parallel group");
      exercise(gd, edp, k, 1, "expert-data-parallel group");
    }
    if (gd) lz_comm_free(gd);
    if (ge) lz_comm_free(ge);
  }
  int self[1] = {rank};
  if ((g = group_of(self, 1, "group of one"))) {
    exercise(g, self, 1, 1, "group of one");
    lz_comm_free(g);
  }
  int rev[4]; /* the whole world, listed backwards: group rank 0 is the last rank */
  for (int p = 0; p < world; p++) rev[p] = world - 1 - p;
  if ((g = group_of(rev, world, "whole world, reversed"))) {
    exercise(g, rev, world, 2, "whole world, reversed");
    /* A group of that group: pairs of its ranks (world ranks 3 2 and 1 0). */
    if (world % 2 == 0) {
      int me = lz_comm_rank(g), pair[2] = {me / 2 * 2, me / 2 * 2 + 1}, wpair[2];
      for (int i = 0; i < 2; i++) wpair[i] = rev[pair[i]];
      lz_comm *sub = NULL;
      if (lz_comm_group_new(g, pair, 2, &sub) != LZ_OK)
        FAIL("group of a group: %s", lz_last_error());
      else {
        if (lz_comm_parent_rank(sub, 1) != pair[1] || lz_comm_rank(sub) != me % 2)
          FAIL("group of a group: rank %d, parent rank of 1 is %d", lz_comm_rank(sub),
               lz_comm_parent_rank(sub, 1));
        exercise(sub, wpair, 2, 2, "group of a group");
        lz_comm_free(sub);
      }
    }
    lz_comm_free(g);
  }
  (void)all;
}

/* -------------------------------------------------------------- mismatches */

static void expect_error(lz_status st, const char *what, const char *needle, double t0) {
  cases++;
  double dt = now_s() - t0;
  if (st != LZ_ERR_INVALID)
    FAIL("%s: expected LZ_ERR_INVALID, got %s: %s", what, lz_status_name(st), lz_last_error());
  else if (!strstr(lz_last_error(), needle))
    FAIL("%s: the error \"%s\" does not say \"%s\"", what, lz_last_error(), needle);
  else if (dt > 5) FAIL("%s: the error took %.1f s", what, dt);
  else if (rank == 0) printf("mismatch: %s: %s\n", what, lz_last_error());
}

static void mismatches(void) {
  if (world < 2) return;
  /* Counts that disagree: rank 1 expects one element more from rank 0 than
   * rank 0 sends; on a group of everyone. */
  int all[4];
  for (int p = 0; p < world; p++) all[p] = p;
  lz_comm *g = group_of(all, world, "mismatch group");
  if (!g) return;
  int64_t sc[4], so[4], rc[4], ro[4];
  for (int q = 0; q < world; q++) {
    sc[q] = rc[q] = 2;
    so[q] = ro[q] = 2 * q;
  }
  if (rank == 1) rc[0] = 3;
  float send[8] = {0}, recv[9];
  double t0 = now_s();
  lz_status st = lz_comm_all_to_all_v(g, send, sc, so, recv, rc, ro, LZ_F32, NULL);
  expect_error(st, "all_to_all_v counts", "rank 0 sends 2 elements to rank 1, which expects 3", t0);
  rc[0] = 2; /* every rank refused alike, so the group is still usable */
  cases++;
  if (lz_comm_all_to_all_v(g, send, sc, so, recv, rc, ro, LZ_F32, NULL) != LZ_OK)
    FAIL("all_to_all_v after the refused counts: %s", lz_last_error());
  lz_comm_free(g);
  /* Group lists that disagree: rank 0 puts rank 1 in its group, rank 1
   * forms a group alone. Then a list without the caller. Then the world
   * still works. */
  int pair[2] = {0, 1}, alone[1] = {rank}, others[1] = {(rank + 1) % world};
  lz_comm *bad = NULL;
  t0 = now_s();
  st = lz_comm_group_new(comm, rank == 0 ? pair : alone, rank == 0 ? 2 : 1, &bad);
  expect_error(st, "group lists", "rank 0 joins the group of ranks 0 1, but rank 1", t0);
  t0 = now_s();
  st = lz_comm_group_new(comm, rank == world - 1 ? others : alone, 1, &bad);
  expect_error(st, "a list without the caller",
               rank == world - 1 ? "is not in its own list" : "passed an invalid list", t0);
  if (bad) FAIL("group lists: a group was made");
  float one = 1;
  cases++;
  if (lz_comm_all_reduce(comm, &one, 1, LZ_F32, LZ_RED_SUM, NULL) != LZ_OK || one != world)
    FAIL("world all_reduce after the refused groups: %g (%s)", one, lz_last_error());
}

static int never_join(int who) {
  if (rank == who) {
    sleep(60); /* the others must give up long before */
    return 0;
  }
  int64_t one[4] = {1, 1, 1, 1}, at[4] = {0, 1, 2, 3};
  float send[4] = {0}, recv[4];
  double t0 = now_s();
  lz_status st = lz_comm_all_to_all_v(comm, send, one, at, recv, one, at, LZ_F32, NULL);
  if (st == LZ_ERR_TIMEOUT) {
    fprintf(stderr, "rank %d: timed out after %.1f s: %s\n", rank, now_s() - t0, lz_last_error());
    return 3;
  }
  fprintf(stderr, "rank %d: expected a timeout, got %s: %s\n", rank, lz_status_name(st),
          lz_last_error());
  return 4;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int never = -1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--hashes")) print_hash = 1;
    else if (!strcmp(argv[i], "--never-join") && i + 1 < argc) never = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--buffers") && i + 1 < argc && !strcmp(argv[i + 1], "private"))
      category = LZ_MEM_WORKSPACE, i++;
    else if (!strcmp(argv[i], "--buffers") && i + 1 < argc && !strcmp(argv[i + 1], "shared"))
      i++;
    else {
      fprintf(stderr, "a2a_check: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (lz_comm_init(&comm, LZ_COMM_AUTO) != LZ_OK) {
    fprintf(stderr, "a2a_check: %s\n", lz_last_error());
    return 2;
  }
  rank = lz_comm_rank(comm);
  world = lz_comm_size(comm);
  if (world > 4) {
    fprintf(stderr, "a2a_check: at most 4 ranks (got %d)\n", world);
    return 2;
  }
  if (never >= 0) return never_join(never);
  double t0 = now_s();
  all_to_all_cases();
  groups();
  averages_over_the_world();
  mismatches();
  float f = (float)failures;
  if (lz_comm_all_reduce(comm, &f, 1, LZ_F32, LZ_RED_SUM, NULL) != LZ_OK) f = 1;
  if (rank == 0)
    printf("a2a_check: backend %s, %d ranks: %d cases, %s (%.1f s)\n", lz_comm_backend_name(comm),
           world, cases, f == 0 ? "all passed" : "FAILURES", now_s() - t0);
  lz_comm_free(comm);
  return f == 0 ? 0 : 1;
}
