/* comm_internal.h — what the collective backends (comm_local.c, comm_shm.c,
 * comm_mpi.c, comm_nccl.c) share with comm.c: the backend vtable, the table
 * of backends (backends.c), the communicator struct, the fixed-order
 * reduction and the launcher's shared-memory contract. Not part of the
 * public API. */
#ifndef LZ_COMM_INTERNAL_H
#define LZ_COMM_INTERNAL_H

#include "mem/lz_internal.h"

#include <pthread.h>   /* the work queue's lock and progress thread */
#include <stdatomic.h> /* byte counters */

/* One operation, as queued on a communicator. Buffers are the caller's. */
typedef struct lz_coll_args {
  lz_coll_kind kind;
  const void *send; /* all_reduce: == recv (in place) */
  void *recv;
  int64_t count;
  lz_dtype dt;
  lz_reduce_op op;
  int root;
  /* Set by comm.c when send or recv is sim device memory: the collective
   * runs after the compute stream's work up to sim_point (queued before the
   * call, as NCCL orders it), on the buffers' host views. */
  int on_sim;
  uint64_t sim_point;
  /* all_to_all: this rank's send counts, send offsets, receive counts and
   * receive offsets, size entries each; and every rank's four rows (size
   * rows of 4 * size, rank order) as the ranks agreed on them before any
   * data moved (comm.c fills it unless the backend agrees itself). */
  const int64_t *v;
  const int64_t *table;
  /* avg: what the rank-order sum is divided by before its one rounding to
   * dt; comm.c sets it (the communicator's size, or what
   * lz_comm_*_avg_over names). Backends pass it to lz_reduce_fixed. */
  int divisor;
} lz_coll_args;

/* A backend: one function per operation, ggml style. Each runs one
 * collective to completion on the calling thread; comm.c guarantees that
 * calls on one communicator never overlap and come in the same order on every
 * rank. Errors go through lz_fail and must name the operation and this rank. */
typedef struct lz_comm_backend_ops {
  lz_status (*init)(lz_comm *c); /* sets c->rank, c->size, c->impl */
  void (*free)(lz_comm *c);
  lz_status (*run)(lz_comm *c, const lz_coll_args *a);
  /* Makes `child` a sub-group of `parent` (lz_comm_group_new has set its
   * rank, size and ranks, and checked the lists agree): sets child->impl.
   * Runs while no other operation of the parent does, so it may run the
   * parent's collectives itself (parent->ops->run). */
  lz_status (*group)(lz_comm *parent, lz_comm *child);
  /* 1: run() agrees on all-to-all counts itself (a->table NULL; it calls
   * lz_comm_a2a_check); 0: comm.c all-gathers them first. */
  int agrees_counts;
} lz_comm_backend_ops;

extern const lz_comm_backend_ops lz_comm_local_ops;
extern const lz_comm_backend_ops lz_comm_shm_ops;
extern const lz_comm_backend_ops lz_comm_mpi_ops;
extern const lz_comm_backend_ops lz_comm_nccl_ops; /* comm_nccl.c: needs lz_cuda_init */

/* One row of the table of backends (backends.c): all a backend is besides
 * its vtable, as data. */
typedef struct lz_comm_backend_entry {
  const char *name; /* LZ_BACKEND, --backend, comm.init, lz_comm_backend_name */
  lz_comm_backend id;
  const lz_comm_backend_ops *ops;
  unsigned moves;       /* the buffers it can move: bit 1 << lz_device (cpu, cuda, sim) */
  int available;        /* compiled into this build; else lz_comm_init refuses it */
  const char *needs;    /* what an unavailable backend lacks, for its error */
  int max_ranks;        /* the largest world it serves; 0: any */
  int auto_rank;        /* the automatic choice's order (lowest first); 0: never chosen by it */
  const char *auto_env; /* chosen automatically when this variable is set; NULL: always */
  const char *about;    /* one line for help texts */
  int under_mpirun;     /* the launcher starts its ranks through mpirun, not by fork */
} lz_comm_backend_entry;

/* Entry i of the table, or NULL past its end; the entry with that enum
 * value, or NULL. */
const lz_comm_backend_entry *lz_comm_backend_entry_at(int i);
const lz_comm_backend_entry *lz_comm_backend_entry_of(lz_comm_backend id);
/* The backend to run: `asked`, else LZ_BACKEND, else the automatic choice
 * for the environment's world size. Errors name the table's backends. */
lz_status lz_comm_backend_choose(lz_comm_backend asked, const lz_comm_backend_entry **out);
/* The names of the entries keep() accepts (NULL: all) as "a, b or c", in buf. */
const char *lz_comm_backend_list(char *buf, size_t len,
                                 int (*keep)(const lz_comm_backend_entry *, const void *),
                                 const void *arg);

struct lz_comm {
  const lz_comm_backend_entry *backend;
  const lz_comm_backend_ops *ops; /* backend->ops */
  void *impl;
  int rank, size;
  int *ranks; /* a group: its ranks' ranks in the parent; NULL otherwise */
  double timeout_s; /* LZ_COMM_TIMEOUT */
  _Atomic uint64_t bytes[LZ_COLL_COUNT];

  /* The ordering queue: operations run one at a time, in submission order,
   * on the caller's thread (blocking, queue empty) or the progress thread. */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* queue changed, an operation finished */
  lz_work *head, *tail;
  int busy; /* an operation is running */
  int stopping;
  int thread_started;
  pthread_t thread;
  lz_status broken; /* sticky: after a failed collective the ranks are out of step */
  char broken_msg[1024];
};

const char *lz_coll_name(lz_coll_kind kind); /* "all_reduce", ... for messages */

/* What names a collective for the check that every rank runs the same one
 * (shm's barriers, mpi's message tags): w[0] its kind + 1 | its dtype << 8 |
 * its reduce op << 16 (those that apply), w[1] its count (0 for a barrier
 * and an all-to-all, whose counts agree apart), w[2] a broadcast's root |
 * an average's divisor << 32. */
void lz_coll_signature(const lz_coll_args *a, uint64_t w[3]);
/* w as words for messages: "all_reduce (sum) of 8 f32", "broadcast of 4 bf16
 * from rank 1"; all zeros: "joining the communicator". Returns buf. */
const char *lz_coll_signature_text(const uint64_t w[3], char *buf, size_t len);

/* No other operation of c runs between hold and release: the caller may run
 * c's collectives itself (c->ops->run), in order with the queued ones.
 * release marks c unusable after a failure other than a refusal every rank
 * made alike (LZ_ERR_INVALID). */
lz_status lz_comm_hold(lz_comm *c, const char *op);
void lz_comm_release(lz_comm *c, lz_status st);

/* The start of an all_gather on the host: every rank's shard of a->count
 * (off and len, world entries each) and this rank's own shard moved from
 * send to its place in recv (unless it is there already). */
void lz_comm_gather_own(const lz_coll_args *a, int world, int rank, int64_t *off, int64_t *len);

/* The all-to-all agreement: LZ_OK when every rank's receive count from
 * each peer equals what that peer sends it in `table` (lz_coll_args.table),
 * else LZ_ERR_INVALID naming the first such pair; every rank reads the same
 * table, so every rank gives the same answer. */
lz_status lz_comm_a2a_check(const lz_comm *c, const int64_t *table);

/* dst[i] = op(srcs[0][i], ..., srcs[n-1][i]) in fp32, in source order, then
 * rounded once to dt. The one definition of a reduction every backend and
 * the tests' serial reference use, so results are bitwise the same
 * everywhere. dst may alias any source. */
void lz_reduce_fixed(void *dst, const void *const *srcs, int nsrc, int64_t count, lz_dtype dt,
                     lz_reduce_op op, int world);

/* A reduce or copy on a one-rank communicator's host buffers: recv =
 * send (all_gather, reduce_scatter), and an average over more ranks than
 * one (a->divisor) divided as lz_reduce_fixed divides. */
void lz_comm_one_rank(const lz_coll_args *a);

/* memcpy with non-temporal stores, for copies too big to stay in cache:
 * about 1.5x faster to memory, and it leaves the cache to the caller. */
void lz_copy_stream(void *dst, const void *src, size_t n);

double lz_now_s(void); /* CLOCK_MONOTONIC seconds */

/* The shared-memory segment: the launcher creates and sizes it; the shm
 * backend maps it. Its size depends on the world size and LZ_SHM_CHUNK. */
size_t lz_shm_segment_bytes(int world);
/* Writes the header into the launcher's freshly sized (zeroed) segment. */
void lz_shm_segment_format(void *base, int world);
/* Records rank's pid in the segment (memfd fd) as the launcher starts it, so
 * the others see it gone even if it exits before joining. */
void lz_shm_segment_rank_started(int fd, int world, int rank, int pid);

#endif /* LZ_COMM_INTERNAL_H */
