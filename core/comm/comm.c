/* comm.c — the communicator every backend sits behind (the table of them is
 * backends.c): argument checks, the buffers a backend can move, shard
 * ranges, byte counters, the per-communicator ordering queue (blocking calls
 * run inline when nothing is queued; asynchronous ones run on a progress
 * thread, one at a time, in submission order), work handles, and the
 * fixed-order reduction all backends share. Buffers in sim device memory
 * reach the backends that move them through their host views, after the
 * compute stream's work queued before the call. */
#include "comm/comm_internal.h"
#include "devices/lz_sim.h" /* host views of sim device buffers */

#include <emmintrin.h> /* _mm_stream_si128 */
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* getenv, calloc */
#include <time.h>   /* clock_gettime */

struct lz_work {
  lz_comm *c;
  lz_coll_args a;
  lz_work *next;
  int done;
  int heap; /* allocated for an asynchronous call (freed by lz_work_wait) */
  lz_status st;
  char msg[1200];
  int64_t *v; /* all_to_all: the caller's counts, copied (freed once run) */
};

double lz_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *coll_names[LZ_COLL_COUNT] = {"all_reduce", "reduce_scatter", "all_gather",
                                                "broadcast", "barrier", "all_to_all"};

const char *lz_coll_kind_name(lz_coll_kind kind) {
  return (unsigned)kind < LZ_COLL_COUNT ? coll_names[kind] : "unknown";
}
const char *lz_coll_name(lz_coll_kind kind) { return lz_coll_kind_name(kind); }

void lz_coll_signature(const lz_coll_args *a, uint64_t w[3]) {
  int reduce = a->kind == LZ_COLL_ALL_REDUCE || a->kind == LZ_COLL_REDUCE_SCATTER;
  int data = a->kind != LZ_COLL_BARRIER;
  w[0] = (uint64_t)(a->kind + 1) | (data ? (uint64_t)a->dt << 8 : 0) |
         (reduce ? (uint64_t)a->op << 16 : 0);
  w[1] = data && a->kind != LZ_COLL_ALL_TO_ALL ? (uint64_t)a->count : 0;
  w[2] = (a->kind == LZ_COLL_BROADCAST ? (uint64_t)(uint32_t)a->root : 0) |
         (reduce && a->op == LZ_RED_AVG ? (uint64_t)(uint32_t)a->divisor << 32 : 0);
}

const char *lz_coll_signature_text(const uint64_t w[3], char *buf, size_t len) {
  static const char *ops[] = {" (sum)", " (avg)", " (max)"};
  if (w[0] == 0) return snprintf(buf, len, "joining the communicator"), buf;
  lz_coll_kind kind = (lz_coll_kind)((w[0] & 0xff) - 1);
  const char *dt = lz_dtype_name((lz_dtype)((w[0] >> 8) & 0xff));
  unsigned op = (unsigned)((w[0] >> 16) & 0xff);
  int reduce = kind == LZ_COLL_ALL_REDUCE || kind == LZ_COLL_REDUCE_SCATTER;
  if (kind == LZ_COLL_BARRIER) snprintf(buf, len, "barrier");
  else if (kind == LZ_COLL_ALL_TO_ALL) snprintf(buf, len, "all_to_all of %s", dt);
  else if (kind == LZ_COLL_BROADCAST)
    snprintf(buf, len, "broadcast of %llu %s from rank %d", (unsigned long long)w[1], dt,
             (int)(uint32_t)w[2]);
  else
    snprintf(buf, len, "%s%s of %llu %s", lz_coll_name(kind), reduce && op < 3 ? ops[op] : "",
             (unsigned long long)w[1], dt);
  return buf;
}

void lz_comm_shard(int64_t count, int size, int rank, int64_t *offset, int64_t *len) {
  if (size < 1 || rank < 0 || rank >= size || count < 0) {
    *offset = 0;
    *len = 0;
    return;
  }
  int64_t base = count / size, rem = count % size;
  *len = base + (rank < rem ? 1 : 0);
  *offset = (int64_t)rank * base + (rank < rem ? rank : rem);
}

void lz_comm_gather_own(const lz_coll_args *a, int world, int rank, int64_t *off, int64_t *len) {
  size_t es = lz_dtype_size(a->dt);
  for (int p = 0; p < world; p++) lz_comm_shard(a->count, world, p, &off[p], &len[p]);
  uint8_t *own = (uint8_t *)a->recv + off[rank] * (int64_t)es;
  if (len[rank] && (const uint8_t *)a->send != own) memmove(own, a->send, (size_t)len[rank] * es);
}

/* ------------------------------------------------------ fixed-order reduction */

#define RED_BLOCK 512

/* acc[j] = x (first source) or op(acc[j], x) for one source's block, one
 * loop per dtype and op so each vectorizes. */
#define RED_LOOP(EXPR)                                                                             \
  do {                                                                                             \
    if (first)                                                                                     \
      for (int j = 0; j < n; j++) acc[j] = (EXPR);                                                 \
    else if (op == LZ_RED_MAX)                                                                     \
      for (int j = 0; j < n; j++) {                                                                \
        float x = (EXPR);                                                                          \
        acc[j] = x > acc[j] ? x : acc[j];                                                          \
      }                                                                                            \
    else                                                                                           \
      for (int j = 0; j < n; j++) acc[j] += (EXPR);                                                \
  } while (0)

static inline void accumulate(float *restrict acc, const void *src, lz_dtype dt, int n, int first,
                              lz_reduce_op op) {
  if (dt == LZ_F32) {
    const float *restrict s = src;
    RED_LOOP(s[j]);
  } else if (dt == LZ_BF16) {
    const uint16_t *restrict s = src;
    RED_LOOP(lz_bits_f32((uint32_t)s[j] << 16));
  } else {
    const uint16_t *restrict s = src;
    RED_LOOP(lz_f16_to_f32_inline(s[j]));
  }
}

/* The last source, summed into `first` (the first source itself when there
 * are two, else the block accumulated so far) and stored: one fused pass.
 * dst may alias any source: each index is read before it is written. */
#define RED_FINISH(FIRST, LOAD, STORE)                                                             \
  do {                                                                                             \
    if (avg)                                                                                       \
      for (int j = 0; j < n; j++) STORE((FIRST + LOAD(last, j)) / w);                              \
    else                                                                                           \
      for (int j = 0; j < n; j++) STORE(FIRST + LOAD(last, j));                                    \
  } while (0)
#define LD_F32(p, j) (((const float *)(p))[j])
#define LD_BF16(p, j) lz_bits_f32((uint32_t)((const uint16_t *)(p))[j] << 16)
#define LD_F16(p, j) lz_f16_to_f32_inline(((const uint16_t *)(p))[j])
#define ST_F32(x) (((float *)d)[j] = (x))
#define ST_BF16(x) (((uint16_t *)d)[j] = lz_bf16_from_f32_inline(x))
#define ST_F16(x) (((uint16_t *)d)[j] = lz_f16_from_f32_inline(x))

LZ_DISPATCH static void reduce_blocks(void *dst, const void *const *srcs, int nsrc,
                                      int64_t count, lz_dtype dt, lz_reduce_op op, int world) {
  float acc[RED_BLOCK];
  float w = (float)world;
  int avg = op == LZ_RED_AVG;
  size_t es = lz_dtype_size(dt);
  for (int64_t i0 = 0; i0 < count; i0 += RED_BLOCK) {
    int n = (int)(count - i0 < RED_BLOCK ? count - i0 : RED_BLOCK);
    size_t at = (size_t)i0 * es;
    void *d = (uint8_t *)dst + at;
    if (op != LZ_RED_MAX && nsrc >= 2) {
      /* Sum and average: sources 0..W-2 into acc (none for two sources),
       * then the last one fused with the store. */
      const void *first = (const uint8_t *)srcs[0] + at, *last = (const uint8_t *)srcs[nsrc - 1] + at;
      if (nsrc > 2) {
        for (int p = 0; p < nsrc - 1; p++)
          accumulate(acc, (const uint8_t *)srcs[p] + at, dt, n, p == 0, op);
        if (dt == LZ_F32) RED_FINISH(acc[j], LD_F32, ST_F32);
        else if (dt == LZ_BF16) RED_FINISH(acc[j], LD_BF16, ST_BF16);
        else RED_FINISH(acc[j], LD_F16, ST_F16);
      } else {
        if (dt == LZ_F32) RED_FINISH(LD_F32(first, j), LD_F32, ST_F32);
        else if (dt == LZ_BF16) RED_FINISH(LD_BF16(first, j), LD_BF16, ST_BF16);
        else RED_FINISH(LD_F16(first, j), LD_F16, ST_F16);
      }
      continue;
    }
    for (int p = 0; p < nsrc; p++)
      accumulate(acc, (const uint8_t *)srcs[p] + at, dt, n, p == 0, op);
    if (avg)
      for (int j = 0; j < n; j++) acc[j] /= w;
    if (dt == LZ_F32)
      for (int j = 0; j < n; j++) ST_F32(acc[j]);
    else if (dt == LZ_BF16)
      for (int j = 0; j < n; j++) ST_BF16(acc[j]);
    else
      for (int j = 0; j < n; j++) ST_F16(acc[j]);
  }
}

void lz_reduce_fixed(void *dst, const void *const *srcs, int nsrc, int64_t count, lz_dtype dt,
                     lz_reduce_op op, int world) {
  if (count <= 0 || nsrc <= 0) return;
  reduce_blocks(dst, srcs, nsrc, count, dt, op, world);
}

void lz_comm_one_rank(const lz_coll_args *a) {
  size_t n = (size_t)a->count * lz_dtype_size(a->dt);
  int reducing = a->kind == LZ_COLL_ALL_REDUCE || a->kind == LZ_COLL_REDUCE_SCATTER;
  if (reducing && a->op == LZ_RED_AVG && a->divisor != 1) {
    const void *src = a->send;
    lz_reduce_fixed(a->recv, &src, 1, a->count, a->dt, a->op, a->divisor);
  } else if ((a->kind == LZ_COLL_REDUCE_SCATTER || a->kind == LZ_COLL_ALL_GATHER) &&
             a->send != a->recv) {
    memmove(a->recv, a->send, n);
  }
}

/* ------------------------------------------------------------ streaming copy */

/* Non-temporal stores write whole lines without first reading them in
 * (no read-for-ownership), so a copy that goes to memory moves 2 bytes per
 * byte instead of 3: measured 20 GB/s against memcpy's 12-13 at 64-256 MiB
 * on the 2-core machine, two processes copying at once included. SSE2, so
 * every x86-64 has it; the head up to 16-byte alignment and the tail go
 * through memcpy. */
void lz_copy_stream(void *dst, const void *src, size_t n) {
  uint8_t *d = dst;
  const uint8_t *s = src;
  size_t head = (16 - ((uintptr_t)d & 15)) & 15;
  if (head > n) head = n;
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t body = n & ~(size_t)63;
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a);
    _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c);
    _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  _mm_sfence(); /* the stores are visible before whatever this rank publishes next */
  memcpy(d + body, s + body, n - body);
}

/* ------------------------------------------------------------ communicator */

lz_status lz_comm_init(lz_comm **out, lz_comm_backend backend) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "comm_init: out is NULL");
  *out = NULL;
  const lz_comm_backend_entry *b;
  LZ_TRY(lz_comm_backend_choose(backend, &b));
  double timeout = 300.0;
  const char *ts = getenv("LZ_COMM_TIMEOUT");
  if (ts && *ts) {
    char *end;
    timeout = strtod(ts, &end);
    if (end == ts || *end || !(timeout > 0))
      return lz_fail(LZ_ERR_INVALID,
                     "comm: LZ_COMM_TIMEOUT=\"%s\" must be a number of seconds > 0", ts);
  }
  lz_comm *c = calloc(1, sizeof *c);
  if (!c) return lz_fail(LZ_ERR_NOMEM, "comm_init: out of memory");
  c->backend = b;
  c->ops = b->ops;
  c->timeout_s = timeout;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  lz_status st = c->ops->init(c);
  if (st != LZ_OK) {
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    return st;
  }
  *out = c;
  return LZ_OK;
}

lz_status lz_comm_free(lz_comm *c) {
  if (!c) return LZ_OK;
  pthread_mutex_lock(&c->mu);
  while (c->head || c->busy) pthread_cond_wait(&c->cv, &c->mu); /* let queued work finish */
  c->stopping = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (c->thread_started) pthread_join(c->thread, NULL);
  c->ops->free(c);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c->ranks);
  free(c);
  return LZ_OK;
}

int lz_comm_rank(const lz_comm *c) { return c ? c->rank : 0; }
int lz_comm_size(const lz_comm *c) { return c ? c->size : 1; }
int lz_comm_parent_rank(const lz_comm *c, int r) { return c && c->ranks ? c->ranks[r] : r; }
const char *lz_comm_backend_name(const lz_comm *c) { return c ? c->backend->name : "none"; }

uint64_t lz_comm_bytes(const lz_comm *c, lz_coll_kind kind) {
  if (!c || (unsigned)kind >= LZ_COLL_COUNT) return 0;
  return atomic_load(&((lz_comm *)c)->bytes[kind]);
}

void lz_comm_bytes_reset(lz_comm *c) {
  if (!c) return;
  for (int k = 0; k < LZ_COLL_COUNT; k++) atomic_store(&c->bytes[k], 0);
}

/* ------------------------------------------------------------- all-to-all */

lz_status lz_comm_a2a_check(const lz_comm *c, const int64_t *table) {
  int W = c->size;
  for (int p = 0; p < W; p++)
    for (int q = 0; q < W; q++) {
      int64_t sends = table[(size_t)p * 4 * W + q], takes = table[(size_t)q * 4 * W + 2 * W + p];
      if (sends != takes)
        return lz_fail(LZ_ERR_INVALID,
                       "all_to_all: rank %d sends %lld elements to rank %d, which expects %lld "
                       "from it; rank q's recv_counts[p] must equal rank p's send_counts[q] "
                       "(noticed by rank %d)",
                       lz_comm_parent_rank(c, p), (long long)sends, lz_comm_parent_rank(c, q),
                       (long long)takes, lz_comm_parent_rank(c, c->rank));
    }
  return LZ_OK;
}

/* The all-to-all with the ranks' counts agreed first: one all-gather of
 * every rank's four rows, so a mismatch fails on every rank at once, the
 * same way, instead of leaving the ranks that expect more waiting. (shm
 * folds this into its own first barrier, nccl goes through device memory.) */
static lz_status run_on_host(lz_comm *c, const lz_coll_args *a) {
  if (a->kind != LZ_COLL_ALL_TO_ALL || c->ops->agrees_counts) return c->ops->run(c, a);
  size_t row = 4 * (size_t)c->size;
  int64_t *table = malloc(row * (size_t)c->size * sizeof *table);
  if (!table) return lz_fail(LZ_ERR_NOMEM, "all_to_all: rank %d: out of memory", c->rank);
  lz_coll_args g = {LZ_COLL_ALL_GATHER, a->v, table, (int64_t)(2 * row) * c->size, LZ_I32,
                    LZ_RED_SUM, 0, 0, 0, NULL, NULL, 0};
  lz_status st = c->ops->run(c, &g);
  if (st != LZ_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", lz_last_error());
    st = lz_fail(st, "all_to_all (sharing the counts): %s", why);
  }
  if (st == LZ_OK) st = lz_comm_a2a_check(c, table);
  if (st == LZ_OK) {
    lz_coll_args b = *a;
    b.table = table;
    st = c->ops->run(c, &b);
  }
  free(table);
  return st;
}

/* ------------------------------------------------------------------ queue */

/* One collective, on this thread. Sim device buffers: first the compute
 * stream's work queued before the call, then the host backend on the
 * buffers' host views; when this returns the result is in device memory. */
static lz_status run_on_host(lz_comm *c, const lz_coll_args *a);

static lz_status run_coll(lz_comm *c, const lz_coll_args *a) {
  if (!a->on_sim) return run_on_host(c, a);
  if (lz_sim_wait_compute(a->sim_point) != LZ_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", lz_last_error());
    return lz_fail(LZ_ERR_INTERNAL, "%s: rank %d: the device work before it failed: %s",
                   lz_coll_name(a->kind), c->rank, why);
  }
  lz_coll_args h = *a;
  void *v;
  if (a->send && (v = lz_sim_host_view(a->send))) h.send = v;
  if (a->recv && (v = lz_sim_host_view(a->recv))) h.recv = v;
  return run_on_host(c, &h);
}

/* Caller holds c->mu. LZ_ERR_INVALID from a backend is a refusal every
 * rank made alike (all-to-all counts that disagree): the ranks are still in
 * step, so the communicator stays usable. */
static void mark_broken(lz_comm *c, lz_status st, const char *msg) {
  if (c->broken || st == LZ_ERR_INVALID) return;
  c->broken = st;
  snprintf(c->broken_msg, sizeof c->broken_msg, "%.1000s", msg);
}

static void run_work(lz_work *w) {
  lz_comm *c = w->c;
  lz_status st = run_coll(c, &w->a);
  free(w->v);
  w->v = NULL;
  pthread_mutex_lock(&c->mu);
  if (st != LZ_OK) {
    snprintf(w->msg, sizeof w->msg, "%.1000s", lz_last_error());
    mark_broken(c, st, w->msg);
  }
  w->st = st;
  w->done = 1;
  c->busy = 0;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void *progress_main(void *arg) {
  lz_comm *c = arg;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    while (!c->head || c->busy) {
      if (c->stopping && !c->head) goto out;
      pthread_cond_wait(&c->cv, &c->mu);
    }
    lz_work *w = c->head;
    c->head = w->next;
    if (!c->head) c->tail = NULL;
    if (c->broken) { /* the ranks are out of step: fail without touching the peers */
      w->st = c->broken;
      snprintf(w->msg, sizeof w->msg, "%s: not run, an earlier collective failed: %s",
               lz_coll_name(w->a.kind), c->broken_msg);
      free(w->v);
      w->v = NULL;
      w->done = 1;
      pthread_cond_broadcast(&c->cv);
      continue;
    }
    c->busy = 1;
    pthread_mutex_unlock(&c->mu);
    run_work(w);
    pthread_mutex_lock(&c->mu);
  }
out:
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

static void count_bytes(lz_comm *c, const lz_coll_args *a) {
  uint64_t n = (uint64_t)a->count * lz_dtype_size(a->dt), W = (uint64_t)c->size, v = 0;
  switch (a->kind) {
  case LZ_COLL_ALL_REDUCE: v = n * 2 * (W - 1) / W; break;
  case LZ_COLL_REDUCE_SCATTER:
  case LZ_COLL_ALL_GATHER: v = n * (W - 1) / W; break;
  case LZ_COLL_BROADCAST: v = (c->rank == a->root && W > 1) ? n : 0; break;
  case LZ_COLL_ALL_TO_ALL:
    for (int p = 0; p < c->size; p++)
      if (p != c->rank) v += (uint64_t)a->v[p] * lz_dtype_size(a->dt);
    break;
  default: break;
  }
  atomic_fetch_add(&c->bytes[a->kind], v);
}

static lz_status check_args(lz_comm *c, const lz_coll_args *a) {
  const char *op = lz_coll_name(a->kind);
  if (!c) return lz_fail(LZ_ERR_INVALID, "%s: communicator is NULL", op);
  if (a->kind == LZ_COLL_BARRIER) return LZ_OK;
  if (a->kind == LZ_COLL_ALL_TO_ALL) {
    if ((unsigned)a->dt >= LZ_DTYPE_COUNT)
      return lz_fail(LZ_ERR_INVALID, "all_to_all: dtype %d is not a dtype", (int)a->dt);
    if (!a->v) return lz_fail(LZ_ERR_INVALID, "all_to_all: a count or offset array is NULL");
    int W = c->size;
    int64_t sends = 0, takes = 0;
    for (int i = 0; i < 4 * W; i++)
      if (a->v[i] < 0)
        return lz_fail(LZ_ERR_INVALID, "all_to_all: %s[%d] is %lld; it must be >= 0",
                       (const char *[]){"send_counts", "send_offsets", "recv_counts",
                                        "recv_offsets"}[i / W],
                       i % W, (long long)a->v[i]);
    for (int p = 0; p < W; p++) {
      sends += a->v[p];
      takes += a->v[2 * W + p];
    }
    if (sends > 0 && !a->send) return lz_fail(LZ_ERR_INVALID, "all_to_all: send buffer is NULL");
    if (takes > 0 && !a->recv)
      return lz_fail(LZ_ERR_INVALID, "all_to_all: receive buffer is NULL");
    return LZ_OK;
  }
  if (a->count < 0)
    return lz_fail(LZ_ERR_INVALID, "%s: count is %lld; it must be >= 0", op, (long long)a->count);
  int reducing = a->kind == LZ_COLL_ALL_REDUCE || a->kind == LZ_COLL_REDUCE_SCATTER;
  if ((unsigned)a->dt >= LZ_DTYPE_COUNT ||
      (reducing && a->dt != LZ_F32 && a->dt != LZ_BF16 && a->dt != LZ_F16))
    return lz_fail(LZ_ERR_INVALID, "%s: dtype %s (%d) is not supported; use f32, bf16 or f16%s",
                   op, lz_dtype_name(a->dt), (int)a->dt,
                   reducing ? "" : " (or i32, u16 for copies)");
  if (reducing && a->divisor < 0)
    return lz_fail(LZ_ERR_INVALID, "%s: the average's divisor is %d; it must be >= 1", op,
                   a->divisor);
  if (reducing && (unsigned)a->op > LZ_RED_MAX)
    return lz_fail(LZ_ERR_INVALID, "%s: reduce op %d is not one of sum (0), avg (1), max (2)", op,
                   (int)a->op);
  if (a->kind == LZ_COLL_BROADCAST && (a->root < 0 || a->root >= c->size))
    return lz_fail(LZ_ERR_INVALID, "broadcast: root %d is not a rank of this communicator (0..%d)",
                   a->root, c->size - 1);
  int64_t off, len;
  lz_comm_shard(a->count, c->size, c->rank, &off, &len);
  int64_t send_n = a->kind == LZ_COLL_ALL_GATHER ? len : a->count;
  int64_t recv_n = a->kind == LZ_COLL_REDUCE_SCATTER ? len : a->count;
  if (send_n > 0 && !a->send) return lz_fail(LZ_ERR_INVALID, "%s: send buffer is NULL", op);
  if (recv_n > 0 && !a->recv) return lz_fail(LZ_ERR_INVALID, "%s: receive buffer is NULL", op);
  /* Send and receive buffers may be one only in the in-place form (as
   * MPI_IN_PLACE): all_gather's send is this rank's shard of recv,
   * reduce_scatter's recv is this rank's shard of send. Any other overlap
   * has no defined result (and ranks would disagree on the path). */
  if (a->kind == LZ_COLL_ALL_GATHER || a->kind == LZ_COLL_REDUCE_SCATTER) {
    size_t es = lz_dtype_size(a->dt);
    uintptr_t s0 = (uintptr_t)a->send, r0 = (uintptr_t)a->recv;
    uintptr_t s1 = s0 + (size_t)send_n * es, r1 = r0 + (size_t)recv_n * es;
    int in_place = a->kind == LZ_COLL_ALL_GATHER ? s0 == r0 + (size_t)off * es
                                                 : r0 == s0 + (size_t)off * es;
    if (send_n > 0 && recv_n > 0 && s0 < r1 && r0 < s1 && !in_place)
      return lz_fail(LZ_ERR_INVALID,
                     "%s: the send and receive buffers overlap; they may share memory only in "
                     "place (%s)",
                     op, a->kind == LZ_COLL_ALL_GATHER
                             ? "send = recv + this rank's shard offset, lz_comm_shard"
                             : "recv = send + this rank's shard offset, lz_comm_shard");
  }
  return LZ_OK;
}

/* Where a buffer lives: host memory, or the loaded device's (cuda, sim). */
static lz_device kind_of(const void *p) { return p ? (lz_device)lz_pointer_device(p) : LZ_CPU; }

static int moves_kind(const lz_comm_backend_entry *e, const void *arg) {
  const int *want = arg; /* {kind, world} */
  return e->available && (e->moves >> want[0] & 1u) && (!e->max_ranks || want[1] <= e->max_ranks);
}

/* The backend moves this kind of buffer, or the error names the backends
 * that would, for this world size. */
static lz_status check_buffers(lz_comm *c, const void *p, lz_coll_kind kind) {
  lz_device dev = kind_of(p);
  if (!p || (c->backend->moves >> dev & 1u)) return LZ_OK;
  int want[2] = {(int)dev, c->size};
  char names[256];
  lz_comm_backend_list(names, sizeof names, moves_kind, want);
  return lz_fail(LZ_ERR_UNSUPPORTED,
                 "%s: the %s backend cannot move %s buffers; use %s (LZ_BACKEND=NAME)",
                 lz_coll_name(kind), c->backend->name, lz_device_name(dev), names);
}

/* *owned (may be NULL): memory in->v points into that a queued operation
 * takes over (then *owned is set to NULL). */
static lz_status submit_owned(lz_comm *c, const lz_coll_args *in, lz_work **work,
                              int64_t **owned) {
  if (work) *work = NULL;
  LZ_TRY(check_args(c, in));
  lz_coll_args sa = *in, *a = &sa;
  if (!a->divisor) a->divisor = c->size;
  if (a->kind != LZ_COLL_BARRIER) {
    LZ_TRY(check_buffers(c, a->send, a->kind));
    LZ_TRY(check_buffers(c, a->recv, a->kind));
    if (kind_of(a->send) == LZ_SIM || kind_of(a->recv) == LZ_SIM) {
      a->on_sim = 1;
      LZ_TRY(lz_sim_compute_point(&a->sim_point));
    }
  }
  pthread_mutex_lock(&c->mu);
  if (c->broken) {
    lz_status st = c->broken;
    pthread_mutex_unlock(&c->mu);
    return lz_fail(st, "%s: communicator unusable, an earlier collective failed: %s",
                   lz_coll_name(a->kind), c->broken_msg);
  }
  count_bytes(c, a);
  if (!work && !c->busy && !c->head) { /* nothing queued: run on this thread */
    c->busy = 1;
    pthread_mutex_unlock(&c->mu);
    lz_status st = run_coll(c, a);
    pthread_mutex_lock(&c->mu);
    if (st != LZ_OK) mark_broken(c, st, lz_last_error());
    c->busy = 0;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return st;
  }
  lz_work local, *w = &local;
  if (work) {
    w = malloc(sizeof *w);
    if (!w) {
      pthread_mutex_unlock(&c->mu);
      return lz_fail(LZ_ERR_NOMEM, "%s: out of memory for the work handle", lz_coll_name(a->kind));
    }
  }
  memset(w, 0, sizeof *w);
  w->c = c;
  w->a = *a;
  w->heap = work != NULL;
  w->v = *owned;
  *owned = NULL;
  if (!c->thread_started) {
    if (pthread_create(&c->thread, NULL, progress_main, c) != 0) {
      pthread_mutex_unlock(&c->mu);
      if (work) free(w);
      return lz_fail(LZ_ERR_INTERNAL, "%s: could not start the progress thread",
                     lz_coll_name(a->kind));
    }
    c->thread_started = 1;
  }
  if (c->tail) c->tail->next = w;
  else c->head = w;
  c->tail = w;
  pthread_cond_broadcast(&c->cv);
  if (work) {
    *work = w;
    pthread_mutex_unlock(&c->mu);
    return LZ_OK;
  }
  while (!w->done) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  if (w->st != LZ_OK) return lz_fail(w->st, "%s", w->msg);
  return LZ_OK;
}

static lz_status submit(lz_comm *c, const lz_coll_args *in, lz_work **work) {
  int64_t *none = NULL;
  return submit_owned(c, in, work, &none);
}

lz_status lz_work_wait(lz_work *w) {
  if (!w) return lz_fail(LZ_ERR_INVALID, "work_wait: work handle is NULL");
  lz_comm *c = w->c;
  pthread_mutex_lock(&c->mu);
  while (!w->done) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  lz_status st = w->st;
  if (st != LZ_OK) lz_fail(st, "%s", w->msg);
  free(w);
  return st;
}

lz_status lz_work_test(lz_work *w, int *done) {
  if (!w || !done) return lz_fail(LZ_ERR_INVALID, "work_test: work handle or done is NULL");
  lz_comm *c = w->c;
  pthread_mutex_lock(&c->mu);
  *done = w->done;
  pthread_mutex_unlock(&c->mu);
  if (*done && w->st != LZ_OK) return lz_fail(w->st, "%s", w->msg);
  return LZ_OK;
}

/* ------------------------------------------------------------- operations */

lz_status lz_comm_all_reduce(lz_comm *c, void *buf, int64_t count, lz_dtype dt, lz_reduce_op op,
                             lz_work **work) {
  lz_coll_args a = {LZ_COLL_ALL_REDUCE, buf, buf, count, dt, op, 0, 0, 0, NULL, NULL, 0};
  return submit(c, &a, work);
}

lz_status lz_comm_reduce_scatter(lz_comm *c, const void *send, void *recv, int64_t count,
                                 lz_dtype dt, lz_reduce_op op, lz_work **work) {
  lz_coll_args a = {LZ_COLL_REDUCE_SCATTER, send, recv, count, dt, op, 0, 0, 0, NULL, NULL, 0};
  return submit(c, &a, work);
}

/* An average over `divisor` ranks' worth (the world's, for a group's
 * collective): the collective's sum divided by it before its one rounding. */
static lz_status submit_avg_over(lz_comm *c, lz_coll_kind kind, const void *send, void *recv,
                                 int64_t count, lz_dtype dt, int divisor, lz_work **work) {
  if (divisor < 1) {
    if (work) *work = NULL;
    return lz_fail(LZ_ERR_INVALID, "%s: the average's divisor is %d; it must be >= 1",
                   coll_names[kind], divisor);
  }
  lz_coll_args a = {kind, send, recv, count, dt, LZ_RED_AVG, 0, 0, 0, NULL, NULL, divisor};
  return submit(c, &a, work);
}

lz_status lz_comm_all_reduce_avg_over(lz_comm *c, void *buf, int64_t count, lz_dtype dt,
                                      int divisor, lz_work **work) {
  return submit_avg_over(c, LZ_COLL_ALL_REDUCE, buf, buf, count, dt, divisor, work);
}

lz_status lz_comm_reduce_scatter_avg_over(lz_comm *c, const void *send, void *recv, int64_t count,
                                          lz_dtype dt, int divisor, lz_work **work) {
  return submit_avg_over(c, LZ_COLL_REDUCE_SCATTER, send, recv, count, dt, divisor, work);
}

lz_status lz_comm_all_gather(lz_comm *c, const void *send, void *recv, int64_t count,
                             lz_dtype dt, lz_work **work) {
  lz_coll_args a = {LZ_COLL_ALL_GATHER, send, recv, count, dt, LZ_RED_SUM, 0, 0, 0, NULL, NULL, 0};
  return submit(c, &a, work);
}

lz_status lz_comm_broadcast(lz_comm *c, void *buf, int64_t count, lz_dtype dt, int root,
                            lz_work **work) {
  lz_coll_args a = {LZ_COLL_BROADCAST, buf, buf, count, dt, LZ_RED_SUM, root, 0, 0, NULL, NULL, 0};
  return submit(c, &a, work);
}

lz_status lz_comm_barrier(lz_comm *c) {
  lz_coll_args a = {LZ_COLL_BARRIER, NULL, NULL, 0, LZ_F32, LZ_RED_SUM, 0, 0, 0, NULL, NULL, 0};
  return submit(c, &a, NULL);
}

/* The four count and offset arrays, copied for the operation to own
 * (NULL arrays: the equal split, `count` per rank). */
static lz_status all_to_all(lz_comm *c, const void *send, void *recv, const int64_t *const in[4],
                            int64_t count, lz_dtype dt, lz_work **work) {
  if (work) *work = NULL;
  if (!c) return lz_fail(LZ_ERR_INVALID, "all_to_all: communicator is NULL");
  int W = c->size;
  int64_t *v = malloc(4 * (size_t)W * sizeof *v);
  if (!v) return lz_fail(LZ_ERR_NOMEM, "all_to_all: out of memory for %d ranks' counts", W);
  for (int k = 0; k < 4; k++)
    for (int p = 0; p < W; p++)
      v[k * W + p] = in ? (in[k] ? in[k][p] : -1) : (k & 1) ? (int64_t)p * count : count;
  lz_coll_args a = {LZ_COLL_ALL_TO_ALL, send, recv, 0, dt, LZ_RED_SUM, 0, 0, 0, v, NULL, 0};
  lz_status st = in && (!in[0] || !in[1] || !in[2] || !in[3])
                     ? lz_fail(LZ_ERR_INVALID, "all_to_all: a count or offset array is NULL")
                     : submit_owned(c, &a, work, &v);
  free(v);
  return st;
}

lz_status lz_comm_all_to_all(lz_comm *c, const void *send, void *recv, int64_t count,
                             lz_dtype dt, lz_work **work) {
  if (count < 0)
    return lz_fail(LZ_ERR_INVALID, "all_to_all: count is %lld; it must be >= 0",
                   (long long)count);
  return all_to_all(c, send, recv, NULL, count, dt, work);
}

lz_status lz_comm_all_to_all_v(lz_comm *c, const void *send, const int64_t *send_counts,
                               const int64_t *send_offsets, void *recv,
                               const int64_t *recv_counts, const int64_t *recv_offsets,
                               lz_dtype dt, lz_work **work) {
  const int64_t *const in[4] = {send_counts, send_offsets, recv_counts, recv_offsets};
  return all_to_all(c, send, recv, in, 0, dt, work);
}

/* ----------------------------------------------- holding (comm_group.c) */

lz_status lz_comm_hold(lz_comm *c, const char *op) {
  pthread_mutex_lock(&c->mu);
  while (c->busy || c->head) pthread_cond_wait(&c->cv, &c->mu);
  lz_status st = c->broken;
  if (st) {
    pthread_mutex_unlock(&c->mu);
    return lz_fail(st, "%s: communicator unusable, an earlier collective failed: %s", op,
                   c->broken_msg);
  }
  c->busy = 1;
  pthread_mutex_unlock(&c->mu);
  return LZ_OK;
}

void lz_comm_release(lz_comm *c, lz_status st) {
  pthread_mutex_lock(&c->mu);
  if (st != LZ_OK) mark_broken(c, st, lz_last_error());
  c->busy = 0;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}
