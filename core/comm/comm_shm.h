/* comm_shm.h — what the shared-memory backend's files share: the segment's
 * layout (header, rank records, banks), a rank's view of it, and the steps
 * every algorithm is made of. comm_shm.c holds the segment and the
 * reductions; comm_shm_wait.c the waiting and the barriers' check that the
 * ranks run the same collective; comm_shm_a2a.c the all-to-all;
 * comm_shm_group.c the segments of sub-groups. Not part of the public API. */
#ifndef LZ_COMM_SHM_H
#define LZ_COMM_SHM_H

#include "comm/comm_internal.h"

#define SHM_MAGIC 0x3130306d68737a6cull /* "lzshm001" */
#define SHM_DEFAULT_CHUNK (1u << 20)
#define SHM_DIRECT_MAX (64u << 10) /* all-reduce below this: direct */
#define RANK_RECORD 192
#define SHM_CMA_MIN (256u << 10)     /* single copy from this many bytes */
#define SHM_STAGE_BYTES (512u << 10) /* reduction staging, all peers together */
#define SHM_SHARED_MIN (64u << 10)   /* in place through shared memory from this many bytes */
#define SHM_STREAM_MIN (8u << 20)    /* non-temporal stores from this many bytes */
#define SHM_PIECE (64u << 10)        /* reduced in cache, then written out */

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
  _Atomic int32_t cma_ok;    /* this rank's probe read of a peer worked */
  _Atomic int32_t shared_ok; /* this rank maps the job's shared memory */
  _Atomic uint64_t send;     /* single copy: this rank's send buffer, in its address space */
  _Atomic uint64_t probe;    /* address of probe_word */
  _Atomic uint64_t send_off; /* its send and receive buffers' offsets in its shared memory */
  _Atomic uint64_t recv_off; /* (UINT64_MAX: private memory) */
  /* The collective of each barrier this rank arrived at, by the barrier's
   * parity (shm_sig): a peer reads slot step & 1 after the barrier, and
   * this rank cannot reach step + 2 before that peer reaches step + 1. */
  _Alignas(64) _Atomic uint64_t sig[2][4];
} shm_rank;

_Static_assert(sizeof(shm_rank) == RANK_RECORD, "rank record is three cache lines");

typedef struct shm_comm {
  uint8_t *base;
  size_t bytes;
  shm_header *hdr;
  shm_rank *ranks;
  uint8_t *data;
  size_t chunk;
  uint64_t step; /* barriers passed by this rank */
  uint64_t calls;  /* collectives run on this communicator (shm_run) */
  uint64_t sig[4]; /* the one running: calls, what, count, extra (shm_sig) */
  int bank;
  int cma;             /* every rank can read every other's memory */
  int direct;          /* every rank maps every rank's shared memory */
  uint64_t probe_word; /* what peers read at init */
  uint8_t *stage;      /* SHM_STAGE_BYTES for the single-copy reductions */
  uint8_t *piece;      /* SHM_PIECE: a reduced piece on its way out (shared memory) */
  double spin_s;
  int *launcher_rank; /* a group's segment: each of its ranks' rank under the launcher */
  char name[256];
} shm_comm;

/* Rank r of this segment as the launcher numbered it (shared-memory views). */
static inline int shm_launcher_rank(const shm_comm *s, int r) {
  return s->launcher_rank ? s->launcher_rank[r] : r;
}

uint8_t *shm_bank(shm_comm *s, int rank, int bank);
/* Copies of at least this many bytes use non-temporal stores (LZ_SHM_STREAM_MIN). */
size_t shm_stream_min(void);
/* Every rank of the segment reaches this point, or the error names the
 * missing ones (timeout, a rank that exited or left). */
lz_status shm_barrier(lz_comm *c, shm_comm *s, const char *op);
/* A barrier in two halves, so that work in between overlaps the peers':
 * this rank arrives, then waits for the others to arrive too. */
void shm_arrive(lz_comm *c, shm_comm *s);
lz_status shm_wait(lz_comm *c, shm_comm *s, const char *op);
/* Wakes every rank asleep in a wait (this rank left: they look again). */
void shm_wake_all(shm_comm *s);
/* Copies `bytes` at address `remote` of rank p into `local` (process_vm_readv). */
lz_status shm_cma_read(lz_comm *c, shm_comm *s, int p, void *local, uint64_t remote,
                       size_t bytes, const char *op);
/* Maps the segment open on `fd` (closed here) as `rank` of `world` and joins
 * it with the other ranks (a barrier): sets c->rank, c->size, c->impl.
 * launcher_rank: for a group's segment (taken over), else NULL. */
lz_status shm_attach(lz_comm *c, int fd, const char *name, int rank, int world,
                     int *launcher_rank);

lz_status shm_all_to_all(lz_comm *c, shm_comm *s, const lz_coll_args *a);
lz_status shm_group(lz_comm *parent, lz_comm *child);

#endif /* LZ_COMM_SHM_H */
