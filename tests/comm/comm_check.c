/* comm_check.c — the multi-rank correctness test, run by tests/comm/run.sh
 * under the launcher (shm) and under mpirun (mpi). One process run covers
 * every operation × dtype × element count for its world size, against a
 * serial reference computed here (fp32 accumulation in rank order 0..W-1,
 * rounded once): bitwise on this rank's shard; bitwise across ranks (the
 * ranks all-gather the xxh64 of their results); with --hashes, rank 0 prints
 * one hash line per case so run.sh can compare two runs and both backends.
 *
 *   comm_check [--quick] [--hashes] [--buffers shared|private|mixed]
 *                                        the matrix; buffers: comm memory, which
 *                                        the launcher's ranks share (default),
 *                                        private memory, or private send and
 *                                        shared receive buffers
 *   comm_check --never-join R            rank R skips an all_reduce; the others
 *                                        must fail with the timeout error
 *   comm_check --loop SECONDS            all_reduce in a loop (for kill -9 tests) */
#include "luazero.h"

#include <sched.h>  /* sched_yield while testing a work handle */
#include <stdio.h>  /* printf */
#include <stdlib.h> /* malloc, atoi */
#include <string.h> /* memcmp */
#include <time.h>   /* clock_gettime */
#include <dirent.h> /* the rank's descriptors */
#include <unistd.h> /* sleep, readlink */

/* The offset of a block in this rank's shared memory (core/mem/shared_mem.c;
 * exported from libluazero, not part of its API). */
uint64_t lz_shared_offset(const void *ptr);

static int rank, world, failures, cases;
static lz_comm *comm;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define FAIL(...)                                                                                  \
  do {                                                                                             \
    printf("rank %d: FAIL: ", rank);                                                               \
    printf(__VA_ARGS__);                                                                           \
    printf("\n");                                                                                  \
    failures++;                                                                                    \
  } while (0)

/* Input of rank r at element i: in [-4, 4), 2^-21 steps. */
static float gen(int r, int64_t i, uint32_t seed) {
  uint64_t x = ((uint64_t)seed << 48) ^ ((uint64_t)r << 40) ^ (uint64_t)i;
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return (float)((int64_t)(x >> 40) - (1 << 23)) * (1.0f / (1 << 21));
}

static void put(void *buf, lz_dtype dt, int64_t i, float v) {
  if (dt == LZ_F32) ((float *)buf)[i] = v;
  else if (dt == LZ_BF16) ((uint16_t *)buf)[i] = lz_f32_to_bf16(v);
  else ((uint16_t *)buf)[i] = lz_f32_to_f16(v);
}

static float as_dtype(lz_dtype dt, float v) { /* v rounded to dt, back in fp32 */
  if (dt == LZ_BF16) return lz_bf16_to_f32(lz_f32_to_bf16(v));
  if (dt == LZ_F16) return lz_f16_to_f32(lz_f32_to_f16(v));
  return v;
}

/* The serial reference for one element. */
static float reference(lz_dtype dt, lz_reduce_op op, int64_t i, uint32_t seed) {
  float acc = as_dtype(dt, gen(0, i, seed));
  for (int p = 1; p < world; p++) {
    float x = as_dtype(dt, gen(p, i, seed));
    acc = op == LZ_RED_MAX ? (x > acc ? x : acc) : acc + x;
  }
  if (op == LZ_RED_AVG) acc /= (float)world;
  return acc;
}

static int same_bits(const void *buf, lz_dtype dt, int64_t i, float v) {
  if (dt == LZ_F32) return memcmp(&((const float *)buf)[i], &v, 4) == 0;
  uint16_t want = dt == LZ_BF16 ? lz_f32_to_bf16(v) : lz_f32_to_f16(v);
  return ((const uint16_t *)buf)[i] == want;
}

static lz_status run_op(lz_coll_kind kind, const void *send, void *recv, int64_t count,
                        lz_dtype dt, lz_reduce_op op, int root, int async) {
  lz_work *w = NULL, **wp = async ? &w : NULL;
  lz_status st;
  switch (kind) {
  case LZ_COLL_ALL_REDUCE: st = lz_comm_all_reduce(comm, recv, count, dt, op, wp); break;
  case LZ_COLL_REDUCE_SCATTER:
    st = lz_comm_reduce_scatter(comm, send, recv, count, dt, op, wp);
    break;
  case LZ_COLL_ALL_GATHER: st = lz_comm_all_gather(comm, send, recv, count, dt, wp); break;
  default: st = lz_comm_broadcast(comm, recv, count, dt, root, wp); break;
  }
  if (st != LZ_OK || !async) return st;
  int done = 0;
  while (!done) { /* exercise test, then wait */
    if ((st = lz_work_test(w, &done)) != LZ_OK) break;
    if (!done) sched_yield();
  }
  lz_status st2 = lz_work_wait(w);
  return st != LZ_OK ? st : st2;
}

static uint64_t expected_bytes(lz_coll_kind kind, int64_t count, lz_dtype dt, int root) {
  uint64_t n = (uint64_t)count * lz_dtype_size(dt), W = (uint64_t)world;
  switch (kind) {
  case LZ_COLL_ALL_REDUCE: return n * 2 * (W - 1) / W;
  case LZ_COLL_REDUCE_SCATTER:
  case LZ_COLL_ALL_GATHER: return n * (W - 1) / W;
  case LZ_COLL_BROADCAST: return rank == root && world > 1 ? n : 0;
  default: return 0;
  }
}

/* Gathers every rank's hash; 1 if all equal. out: rank 0's, or the xor of all. */
static int hashes_agree(uint64_t h, int want_equal, uint64_t *out) {
  uint64_t all[world];
  if (lz_comm_all_gather(comm, &h, all, 2 * world, LZ_I32, NULL) != LZ_OK) {
    FAIL("hash all_gather: %s", lz_last_error());
    return 0;
  }
  uint64_t x = 0;
  int eq = 1;
  for (int p = 0; p < world; p++) {
    x ^= all[p] * (uint64_t)(2 * p + 1);
    if (all[p] != all[0]) eq = 0;
  }
  *out = want_equal ? all[0] : x;
  return eq;
}

/* A case of its own: all-gather whose send buffer is this rank's shard of
 * the receive buffer (as the ZeRO engine gathers parameters). */
#define ALL_GATHER_IN_PLACE LZ_COLL_COUNT

static void one_case(lz_coll_kind kind, lz_dtype dt, lz_reduce_op op, int64_t count, int async,
                     int print_hash, void *a, void *b) {
  int in_place = kind == ALL_GATHER_IN_PLACE;
  if (in_place) kind = LZ_COLL_ALL_GATHER;
  uint32_t seed = (uint32_t)(cases * 7919 + 17);
  cases++;
  size_t es = lz_dtype_size(dt);
  int64_t off, len;
  lz_comm_shard(count, world, rank, &off, &len);
  int root = (int)(count % world);
  const char *name = in_place ? "all_gather_in_place" : lz_coll_kind_name(kind);
  const char *opn = kind == LZ_COLL_ALL_GATHER || kind == LZ_COLL_BROADCAST ? "-"
                    : op == LZ_RED_SUM                                       ? "sum"
                    : op == LZ_RED_AVG                                       ? "avg"
                                                                             : "max";
  char tag[128];
  snprintf(tag, sizeof tag, "%s %s %s count %lld%s", name, opn, lz_dtype_name(dt),
           (long long)count, async ? " async" : "");
  /* inputs */
  const void *send = a;
  void *recv = b;
  switch (kind) {
  case LZ_COLL_ALL_REDUCE:
    for (int64_t i = 0; i < count; i++) put(a, dt, i, gen(rank, i, seed));
    recv = a;
    break;
  case LZ_COLL_REDUCE_SCATTER:
    for (int64_t i = 0; i < count; i++) put(a, dt, i, gen(rank, i, seed));
    memset(b, 0xEE, (size_t)len * es);
    break;
  case LZ_COLL_ALL_GATHER:
    memset(b, 0xEE, (size_t)count * es);
    if (in_place) {
      for (int64_t i = off; i < off + len; i++) put(b, dt, i, gen(rank, i, seed));
      send = (const uint8_t *)b + (size_t)off * es;
    } else
      for (int64_t i = 0; i < len; i++) put(a, dt, i, gen(rank, off + i, seed));
    break;
  default:
    recv = a;
    if (rank == root)
      for (int64_t i = 0; i < count; i++) put(a, dt, i, gen(root, i, seed));
    else memset(a, 0xEE, (size_t)count * es);
    break;
  }
  uint64_t bytes0 = lz_comm_bytes(comm, kind);
  lz_status st = run_op(kind, send, recv, count, dt, op, root, async);
  if (st != LZ_OK) {
    FAIL("%s: %s", tag, lz_last_error());
    return;
  }
  uint64_t sent = lz_comm_bytes(comm, kind) - bytes0;
  if (sent != expected_bytes(kind, count, dt, root))
    FAIL("%s: byte counter grew by %llu, expected %llu", tag, (unsigned long long)sent,
         (unsigned long long)expected_bytes(kind, count, dt, root));
  /* check */
  int64_t bad = 0, first_bad = -1;
  size_t hbytes = 0;
  const void *hbuf = recv;
  switch (kind) {
  case LZ_COLL_ALL_REDUCE:
    for (int64_t i = off; i < off + len; i++)
      if (!same_bits(recv, dt, i, reference(dt, op, i, seed)) && !bad++) first_bad = i;
    hbytes = (size_t)count * es;
    break;
  case LZ_COLL_REDUCE_SCATTER:
    for (int64_t i = 0; i < len; i++)
      if (!same_bits(recv, dt, i, reference(dt, op, off + i, seed)) && !bad++) first_bad = off + i;
    hbytes = (size_t)len * es;
    break;
  case LZ_COLL_ALL_GATHER:
    for (int p = 0; p < world; p++) {
      int64_t po, pl;
      lz_comm_shard(count, world, p, &po, &pl);
      for (int64_t i = po; i < po + pl; i++)
        if (!same_bits(recv, dt, i, as_dtype(dt, gen(p, i, seed))) && !bad++) first_bad = i;
    }
    hbytes = (size_t)count * es;
    break;
  default:
    for (int64_t i = 0; i < count; i++)
      if (!same_bits(recv, dt, i, as_dtype(dt, gen(root, i, seed))) && !bad++) first_bad = i;
    hbytes = (size_t)count * es;
    break;
  }
  if (bad) FAIL("%s: %lld elements differ from the serial reference (first at %lld)", tag,
                (long long)bad, (long long)first_bad);
  uint64_t h = lz_hash_xxh64(hbuf, hbytes, 0), agreed;
  int want_equal = kind != LZ_COLL_REDUCE_SCATTER;
  if (!hashes_agree(h, want_equal, &agreed) && want_equal)
    FAIL("%s: the ranks' results are not bitwise the same", tag);
  if (print_hash && rank == 0)
    printf("hash %s %s %s %lld %016llx\n", name, opn, lz_dtype_name(dt), (long long)count,
           (unsigned long long)agreed);
}

/* Two operations in flight at once, then a blocking one behind them. */
static void async_overlap(void *a, void *b) {
  int64_t n = 100003;
  float *x = a, *y = b, z[8];
  for (int64_t i = 0; i < n; i++) x[i] = (float)(rank + 1);
  for (int i = 0; i < 8; i++) z[i] = (float)rank;
  int64_t off, len;
  lz_comm_shard(n, world, rank, &off, &len);
  float *shard = malloc(sizeof(float) * (size_t)(len ? len : 1));
  for (int64_t i = 0; i < len; i++) shard[i] = (float)(off + i);
  lz_work *w1, *w2;
  cases++;
  if (lz_comm_all_reduce(comm, x, n, LZ_F32, LZ_RED_SUM, &w1) != LZ_OK ||
      lz_comm_all_gather(comm, shard, y, n, LZ_F32, &w2) != LZ_OK ||
      lz_comm_all_reduce(comm, z, 8, LZ_F32, LZ_RED_MAX, NULL) != LZ_OK ||
      lz_work_wait(w2) != LZ_OK || lz_work_wait(w1) != LZ_OK) {
    FAIL("async overlap: %s", lz_last_error());
    free(shard);
    return;
  }
  float want = (float)(world * (world + 1) / 2);
  for (int64_t i = 0; i < n; i++)
    if (x[i] != want || y[i] != (float)i) {
      FAIL("async overlap: element %lld: %g, %g (expected %g, %g)", (long long)i, x[i], y[i], want,
           (double)i);
      break;
    }
  if (z[0] != (float)(world - 1)) FAIL("async overlap: max gave %g", z[0]);
  free(shard);
}

/* all_reduce and reduce_scatter of the same input give bitwise the same
 * shard (the ZeRO engine mixes them): on the segment path and on the single
 * copy path, for every reducing dtype. */
static void all_reduce_matches_reduce_scatter(void *a, void *b) {
  int64_t counts[] = {40009, (1 << 20) + 3};
  lz_dtype dts[] = {LZ_F32, LZ_BF16, LZ_F16};
  lz_reduce_op ops[] = {LZ_RED_SUM, LZ_RED_AVG};
  for (int ci = 0; ci < 2; ci++)
    for (int d = 0; d < 3; d++)
      for (int o = 0; o < 2; o++) {
        int64_t count = counts[ci], off, len;
        lz_dtype dt = dts[d];
        size_t es = lz_dtype_size(dt);
        lz_comm_shard(count, world, rank, &off, &len);
        uint32_t seed = (uint32_t)(cases * 7919 + 17);
        cases++;
        for (int64_t i = 0; i < count; i++) put(a, dt, i, gen(rank, i, seed));
        if (lz_comm_reduce_scatter(comm, a, b, count, dt, ops[o], NULL) != LZ_OK ||
            lz_comm_all_reduce(comm, a, count, dt, ops[o], NULL) != LZ_OK) {
          FAIL("all_reduce vs reduce_scatter: %s", lz_last_error());
          return;
        }
        if (memcmp((char *)a + (size_t)off * es, b, (size_t)len * es) != 0)
          FAIL("all_reduce and reduce_scatter %s %s count %lld: shards differ", lz_dtype_name(dt),
               ops[o] == LZ_RED_SUM ? "sum" : "avg", (long long)count);
      }
}

/* The ranks' shared memory: blocks are reused first fit after a free,
 * small and private categories stay private, and the pages of peers this
 * rank touched in collectives are counted apart from its own. */
static void shared_memory(void) {
  void *x, *y, *z, *again, *small, *opt;
  size_t mb = (size_t)1 << 20;
  cases++;
  /* The files came through /proc/<launcher>/fd: no descriptor of them is
   * open here, and the variable naming them is gone, so nothing this rank
   * starts can take them. */
  if (getenv("LZ_SHM_SHARED")) FAIL("shared memory: LZ_SHM_SHARED is still set in the rank");
  DIR *fds = opendir("/proc/self/fd");
  for (struct dirent *d; fds && (d = readdir(fds));) {
    char path[300], link[512];
    snprintf(path, sizeof path, "/proc/self/fd/%s", d->d_name);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n > 0 && (link[n] = 0, strstr(link, "luazero-") && strstr(link, "-rank-")))
      FAIL("shared memory: descriptor %s of the rank is open on %s", d->d_name, link);
  }
  if (fds) closedir(fds);
  if (lz_mem_alloc(&x, 3 * mb, LZ_MEM_COMM) || lz_mem_alloc(&y, 5 * mb, LZ_MEM_GRADS) ||
      lz_mem_alloc(&z, mb, LZ_MEM_PARAMS) || lz_mem_alloc(&small, 1000, LZ_MEM_COMM) ||
      lz_mem_alloc(&opt, 4 * mb, LZ_MEM_OPTIMIZER)) {
    FAIL("shared memory: alloc: %s", lz_last_error());
    return;
  }
  if (!lz_mem_shared(x) || !lz_mem_shared(y) || !lz_mem_shared(z) || lz_mem_shared(small) ||
      lz_mem_shared(opt))
    FAIL("shared memory: comm/grads/params blocks shared (%d %d %d), a 1000-byte block and an "
         "optimizer block private (%d %d)", lz_mem_shared(x), lz_mem_shared(y), lz_mem_shared(z),
         lz_mem_shared(small), lz_mem_shared(opt));
  memset(y, 7, 5 * mb);
  lz_mem_free(y);
  if (lz_mem_alloc(&again, 4 * mb, LZ_MEM_COMM) || again != y)
    FAIL("shared memory: a 4 MiB block after freeing 5 MiB at %p came at %p", y, again);
  else if (lz_shared_offset(x) % (2 * mb) || lz_shared_offset(y) % (2 * mb))
    FAIL("shared memory: blocks of 2 MiB and more start on huge-page offsets (%llu, %llu)",
         (unsigned long long)lz_shared_offset(x), (unsigned long long)lz_shared_offset(y));
  else if (((unsigned char *)again)[0] != 0)
    FAIL("shared memory: a freed block's pages were not given back (old bytes still there)");
  lz_comm_barrier(comm); /* every rank's frees done: peers' pages counted below are new */
  int64_t before = lz_mem_shared_peer_rss();
  float *t = again;
  int64_t n = (int64_t)(4 * mb / 4);
  for (int64_t i = 0; i < n; i++) t[i] = 1.0f;
  if (lz_comm_all_reduce(comm, t, n, LZ_F32, LZ_RED_SUM, NULL) != LZ_OK)
    FAIL("shared memory: all_reduce: %s", lz_last_error());
  else if (t[0] != (float)world || t[n - 1] != (float)world)
    FAIL("shared memory: all_reduce gave %g, %g", t[0], t[n - 1]);
  int64_t peer = lz_mem_shared_peer_rss() - before;
  lz_comm_barrier(comm); /* no rank frees what another is still counting */
  if (peer < (int64_t)(4 * mb) / world)
    FAIL("shared memory: peers' pages mapped by the all_reduce: %lld bytes, expected at least %zu",
         (long long)peer, 4 * mb / (size_t)world);
  lz_mem_free(x);
  lz_mem_free(z);
  lz_mem_free(again);
  lz_mem_free(small);
  lz_mem_free(opt);
}

static int matrix(int quick, int print_hash, const char *buffers) {
  int64_t counts[] = {0, 1, 7, 4097, (1 << 20) + 3, 16 << 20};
  int ncounts = quick ? 5 : 6;
  size_t maxb = (size_t)counts[ncounts - 1] * 4;
  void *a, *b;
  lz_mem_category ca = !strcmp(buffers, "shared") ? LZ_MEM_COMM : LZ_MEM_WORKSPACE;
  lz_mem_category cb = !strcmp(buffers, "private") ? LZ_MEM_WORKSPACE : LZ_MEM_COMM;
  if (lz_mem_alloc(&a, maxb + 64, ca) != LZ_OK || lz_mem_alloc(&b, maxb + 64, cb) != LZ_OK) {
    FAIL("alloc: %s", lz_last_error());
    return 1;
  }
  /* Where the buffers are decides the path (shared memory, cross-memory
   * attach, segment): run.sh checks it is the one it asked for. */
  if (rank == 0)
    printf("buffers: send %s, receive %s\n", lz_mem_shared(a) ? "shared" : "private",
           lz_mem_shared(b) ? "shared" : "private");
  lz_dtype dts[] = {LZ_F32, LZ_BF16, LZ_F16};
  lz_reduce_op ops[] = {LZ_RED_SUM, LZ_RED_AVG, LZ_RED_MAX};
  double t0 = now_s();
  int k = 0;
  for (int ci = 0; ci < ncounts; ci++)
    for (int d = 0; d < 3; d++) {
      for (int o = 0; o < 3; o++) {
        one_case(LZ_COLL_ALL_REDUCE, dts[d], ops[o], counts[ci], k++ & 1, print_hash, a, b);
        one_case(LZ_COLL_REDUCE_SCATTER, dts[d], ops[o], counts[ci], k++ & 1, print_hash, a, b);
      }
      one_case(LZ_COLL_ALL_GATHER, dts[d], LZ_RED_SUM, counts[ci], k++ & 1, print_hash, a, b);
      one_case(ALL_GATHER_IN_PLACE, dts[d], LZ_RED_SUM, counts[ci], k++ & 1, print_hash, a, b);
      one_case(LZ_COLL_BROADCAST, dts[d], LZ_RED_SUM, counts[ci], k++ & 1, print_hash, a, b);
    }
  async_overlap(a, b);
  all_reduce_matches_reduce_scatter(a, b);
  if (lz_mem_shared(b)) shared_memory();
  cases++;
  if (lz_comm_barrier(comm) != LZ_OK) FAIL("barrier: %s", lz_last_error());
  lz_mem_free(a);
  lz_mem_free(b);
  /* Every rank learns whether any failed. */
  float f = (float)failures;
  if (lz_comm_all_reduce(comm, &f, 1, LZ_F32, LZ_RED_SUM, NULL) != LZ_OK) f = 1;
  if (rank == 0)
    printf("comm_check: backend %s, %d ranks: %d cases, %s (%.1f s)\n",
           lz_comm_backend_name(comm), world, cases,
           f == 0 ? "all passed" : "FAILURES", now_s() - t0);
  return f == 0 ? 0 : 1;
}

static int never_join(int who) {
  if (rank == who) {
    sleep(60); /* the others must give up long before */
    return 0;
  }
  float x[4097] = {0};
  double t0 = now_s();
  lz_status st = lz_comm_all_reduce(comm, x, 4097, LZ_F32, LZ_RED_SUM, NULL);
  if (st == LZ_ERR_TIMEOUT) {
    fprintf(stderr, "rank %d: timed out after %.1f s: %s\n", rank, now_s() - t0, lz_last_error());
    return 3;
  }
  fprintf(stderr, "rank %d: expected a timeout, got %s: %s\n", rank, lz_status_name(st),
          lz_last_error());
  return 4;
}

static int loop(double seconds) {
  int64_t n = 4 << 20;
  float *x;
  if (lz_mem_alloc((void **)&x, (size_t)n * 4, LZ_MEM_COMM) != LZ_OK) return 5;
  for (int64_t i = 0; i < n; i++) x[i] = 1.0f;
  printf("looping\n");
  fflush(stdout);
  double t0 = now_s();
  for (;;) {
    /* Rank 0's clock decides for all, so every rank runs the same number
     * of collectives. */
    int32_t go = rank == 0 && now_s() - t0 < seconds;
    if (lz_comm_broadcast(comm, &go, 1, LZ_I32, 0, NULL) != LZ_OK ||
        (go && lz_comm_all_reduce(comm, x, n, LZ_F32, LZ_RED_AVG, NULL) != LZ_OK)) {
      fprintf(stderr, "rank %d: %s\n", rank, lz_last_error());
      return 3;
    }
    if (!go) return 0;
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int quick = 0, print_hash = 0, never = -1;
  double loop_s = -1;
  const char *buffers = "shared";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) quick = 1;
    else if (!strcmp(argv[i], "--hashes")) print_hash = 1;
    else if (!strcmp(argv[i], "--never-join") && i + 1 < argc) never = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--loop") && i + 1 < argc) loop_s = atof(argv[++i]);
    else if (!strcmp(argv[i], "--buffers") && i + 1 < argc &&
             (!strcmp(argv[i + 1], "shared") || !strcmp(argv[i + 1], "private") ||
              !strcmp(argv[i + 1], "mixed")))
      buffers = argv[++i];
    else {
      fprintf(stderr, "comm_check: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (lz_comm_init(&comm, LZ_COMM_AUTO) != LZ_OK) {
    fprintf(stderr, "comm_check: %s\n", lz_last_error());
    return 2;
  }
  rank = lz_comm_rank(comm);
  world = lz_comm_size(comm);
  int code;
  if (never >= 0) code = never_join(never);
  else if (loop_s >= 0) code = loop(loop_s);
  else code = matrix(quick, print_hash, buffers);
  if (code == 0) lz_comm_free(comm);
  return code;
}
