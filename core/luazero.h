/* luazero.h — the whole public C API of libluazero (its kernels in
 * luazero_kernels.h, which it includes).
 *
 * Conventions
 *   - Names are lz_<thing>_<verb>. Handles are opaque except lz_tensor, whose
 *     metadata (data pointer, shape, dtype) is plain so scripts can read it.
 *   - Every call that can fail returns lz_status; on failure lz_last_error()
 *     (thread-local) holds a message naming the thing and the fix.
 *   - Kernels never allocate. Parameter gradients accumulate (+=); input
 *     gradients are overwritten.
 *   - The block between LZ_CDEF_BEGIN and LZ_CDEF_END holds no preprocessor
 *     lines: tools/gen-cdef.lua turns it into lua/luazero/cdef.lua for LuaJIT's
 *     FFI, and a test fails if the two drift.
 */
#ifndef LUAZERO_H
#define LUAZERO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LZ_VERSION_STRING "0.1.0"
#define LZ_MAX_DIMS 4
/* Elements per absmax of the 8-bit AdamW states (lz_adamw8bit_step). */
#define LZ_ADAMW8BIT_BLOCK 256

/* LZ_CDEF_BEGIN */

/* ---------------------------------------------------------------- status */

typedef enum lz_status {
  LZ_OK = 0,
  LZ_ERR_INVALID = 1,     /* bad argument: shape, dtype, value */
  LZ_ERR_NOMEM = 2,       /* allocation failed */
  LZ_ERR_IO = 3,          /* file or system call failed */
  LZ_ERR_UNSUPPORTED = 4, /* not available on this machine or build */
  LZ_ERR_COMM = 5,        /* a collective or a peer failed */
  LZ_ERR_TIMEOUT = 6,     /* a wait ran past its limit */
  LZ_ERR_INTERNAL = 7     /* a library (oneDNN, MPI, CUDA) failed */
} lz_status;

const char *lz_last_error(void);
const char *lz_status_name(lz_status s);
const char *lz_version(void);

/* ------------------------------------------------------------- machine */

int lz_cpu_has(const char *feature); /* "avx2", "avx512f", "avx512bf16" */
lz_status lz_threads_set(int n);    /* compute threads (OpenMP, oneDNN) */
int lz_threads_get(void);
/* How bf16 GEMMs run here: "native (...)" (oneDNN bf16) or "f32 (...)"
 * (widened, fp32 sgemm), and why; LZ_BF16_MATMUL=native|f32 overrides. */
lz_status lz_bf16_matmul_path(const char **what);
/* The CPU code paths that decide a run's bits, each the machine's best
 * unless overridden: the form the hot loops were compiled for and run here
 * ("avx512f"; "avx2+fma", where the fp32 attention, training's and
 * decoding's, and axpy fuse their multiply-adds and the other loops do not;
 * "avx2"; "x86-64"), oneDNN's instruction set for the GEMMs
 * ("avx512_core_bf16", "avx2", ...), and the 8-bit AdamW update's form
 * ("base", "avx2", "avx512", "vbmi", "vbmi2", "bf16"; LZ_ADAMW8BIT_ISA picks
 * a lower one, and a name that is none, or above the machine's, fails). */
const char *lz_cpu_kernels(void);
const char *lz_gemm_isa(void);
lz_status lz_adamw8bit_form(const char **what);

/* -------------------------------------------------------------- ledger */

typedef enum lz_mem_category {
  LZ_MEM_PARAMS = 0,
  LZ_MEM_GRADS = 1,
  LZ_MEM_OPTIMIZER = 2,
  LZ_MEM_ACTIVATIONS = 3,
  LZ_MEM_COMM = 4,
  LZ_MEM_OFFLOAD = 5,
  LZ_MEM_WORKSPACE = 6,
  LZ_MEM_COUNT = 7
} lz_mem_category;

/* 64-byte aligned (LZ_MEM_OFFLOAD: 4096-byte aligned, as O_DIRECT swap I/O
 * needs); 2 MiB aligned on transparent huge pages from LZ_MEM_HUGE_THRESHOLD
 * bytes up. Memory is not zeroed. */
lz_status lz_mem_alloc(void **out, size_t bytes, lz_mem_category cat);
lz_status lz_mem_free(void *ptr); /* NULL is fine */
int64_t lz_mem_current(lz_mem_category cat);
int64_t lz_mem_peak(lz_mem_category cat);
int64_t lz_mem_total_current(void);
int64_t lz_mem_total_peak(void); /* the most held at once, all categories together */
void lz_mem_reset_peak(void); /* peak := current, every category */
const char *lz_mem_category_name(lz_mem_category cat);
int64_t lz_mem_huge_threshold(void);
/* 1 if ptr lies in this rank's job-shared memory: under `luazero -n N`,
 * params, grads and comm blocks of 64 KiB and more are allocated where the
 * other ranks can address them, and the shm backend's collectives on them
 * copy without the kernel (LZ_SHM_SHARED_BYTES=0 turns this off). */
int lz_mem_shared(const void *ptr);
/* Bytes of the other ranks' shared memory this process has mapped in
 * (collectives read and write it in place): counted in its RSS, but not its
 * own. lz.peak_rss subtracts them. */
int64_t lz_mem_shared_peer_rss(void);

/* ------------------------------------------------------------- tensors */

typedef enum lz_dtype {
  LZ_F32 = 0,
  LZ_BF16 = 1,
  LZ_F16 = 2,
  LZ_I32 = 3,
  LZ_U16 = 4,
  LZ_U8 = 5, /* 8-bit optimizer states */
  LZ_DTYPE_COUNT = 6
} lz_dtype;

/* One accelerator per process: cuda (a GPU) or sim (docs/devices.md: the
 * cpu kernels on memory the host cannot touch, on asynchronous streams). */
typedef enum lz_device { LZ_CPU = 0, LZ_CUDA = 1, LZ_SIM = 2 } lz_device;

typedef struct lz_storage lz_storage;

/* Contiguous, row-major. A view shares its base's storage. */
typedef struct lz_tensor {
  void *data;
  lz_storage *storage; /* NULL for arena and wrapped tensors */
  int64_t shape[4];
  int32_t ndim;
  lz_dtype dtype;
  lz_device device;
  int32_t flags;
} lz_tensor;

size_t lz_dtype_size(lz_dtype dt);
const char *lz_dtype_name(lz_dtype dt);
int64_t lz_tensor_numel(const lz_tensor *t);
size_t lz_tensor_bytes(const lz_tensor *t);

lz_status lz_tensor_new(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape,
                        lz_mem_category cat);
/* A view of numel(shape) elements starting at element `offset` of base. */
lz_status lz_tensor_view(lz_tensor **out, const lz_tensor *base, int64_t offset, int ndim,
                         const int64_t *shape);
/* Borrowed memory: the caller keeps it alive and frees it. */
lz_status lz_tensor_wrap(lz_tensor **out, void *data, lz_dtype dt, int ndim,
                         const int64_t *shape);
lz_status lz_tensor_free(lz_tensor *t); /* NULL is fine; arena tensors: no-op */
/* Same element count; converts between f32, bf16 and f16 (round to nearest even). */
lz_status lz_tensor_copy(lz_tensor *dst, const lz_tensor *src);
/* "f32[2,3,4]" into buf. */
const char *lz_tensor_describe(const lz_tensor *t, char *buf, size_t len);

/* Scalar conversions, round to nearest even; NaN stays NaN. */
uint16_t lz_f32_to_bf16(float x);
float lz_bf16_to_f32(uint16_t x);
uint16_t lz_f32_to_f16(float x);
float lz_f16_to_f32(uint16_t x);

/* --------------------------------------------------------------- arena */

/* Bump allocator for activations, reset once per micro-step. Tensors it
 * returns live until the next reset. Each starts at a multiple of
 * LZ_ARENA_ALIGN bytes, so a tensor of n bytes takes n rounded up to it:
 * what models size their arenas by. */
enum { LZ_ARENA_ALIGN = 64 };
typedef struct lz_arena lz_arena;
lz_status lz_arena_new(lz_arena **out, size_t bytes, lz_mem_category cat);
/* An arena in device memory (dev LZ_SIM or LZ_CUDA, once initialized; LZ_CPU:
 * lz_arena_new): its tensors live on dev. */
lz_status lz_arena_new_on(lz_arena **out, size_t bytes, lz_mem_category cat, lz_device dev);
/* An arena over borrowed memory (64-byte aligned; the caller keeps it alive
 * and frees it, and it stays on the ledger under the owner's category):
 * arenas whose lifetimes do not overlap can share one buffer. Over device
 * memory its tensors live on that device. */
lz_status lz_arena_wrap(lz_arena **out, void *data, size_t bytes);
lz_status lz_arena_free(lz_arena *a);
lz_status lz_arena_tensor(lz_arena *a, lz_tensor **out, lz_dtype dt, int ndim,
                          const int64_t *shape);
lz_status lz_arena_reset(lz_arena *a);
/* Gives back the bytes taken since lz_arena_used(a) said `used`: the tensors
 * made since then are dead (their memory goes to the next ones), those made
 * before live on. Each tensor still counts towards the arena's tensors until
 * the next reset. */
lz_status lz_arena_rewind(lz_arena *a, size_t used);
size_t lz_arena_used(const lz_arena *a);
size_t lz_arena_peak(const lz_arena *a);
size_t lz_arena_capacity(const lz_arena *a);

/* LZ_CDEF_END */

#include "luazero_kernels.h" /* the kernels: their own LZ_CDEF block */

/* LZ_CDEF_BEGIN */

/* --------------------------------------------------------- collectives */

typedef enum lz_comm_backend {
  LZ_COMM_AUTO = 0, /* mpi under mpirun, shm under the launcher, else local */
  LZ_COMM_LOCAL = 1,
  LZ_COMM_SHM = 2,
  LZ_COMM_MPI = 3,
  LZ_COMM_NCCL = 4
} lz_comm_backend;

typedef enum lz_reduce_op { LZ_RED_SUM = 0, LZ_RED_AVG = 1, LZ_RED_MAX = 2 } lz_reduce_op;

typedef enum lz_coll_kind {
  LZ_COLL_ALL_REDUCE = 0,
  LZ_COLL_REDUCE_SCATTER = 1,
  LZ_COLL_ALL_GATHER = 2,
  LZ_COLL_BROADCAST = 3,
  LZ_COLL_BARRIER = 4,
  LZ_COLL_ALL_TO_ALL = 5, /* all_to_all and all_to_all_v */
  LZ_COLL_COUNT = 6
} lz_coll_kind;

typedef struct lz_comm lz_comm;
typedef struct lz_work lz_work;

/* The backends this library knows, one table (core/comm/backends.c), in its
 * order: entry i's name, a line about it, the buffers it can move (bit
 * 1 << lz_device: cpu, cuda, sim) and whether this build has it. Past the
 * end: NULL, NULL, 0, 0. */
int lz_comm_backend_count(void);
const char *lz_comm_backend_name_at(int i);
const char *lz_comm_backend_about_at(int i);
unsigned lz_comm_backend_moves_at(int i);
int lz_comm_backend_available_at(int i);
/* A name from the table, or "auto"; otherwise LZ_ERR_INVALID, naming them. */
lz_status lz_comm_backend_parse(const char *name, lz_comm_backend *out);

/* Rank and size from the environment (RANK/WORLD_SIZE, or OpenMPI's).
 * LZ_COMM_AUTO: LZ_BACKEND names the backend, else the environment does. */
lz_status lz_comm_init(lz_comm **out, lz_comm_backend backend);
lz_status lz_comm_free(lz_comm *c);
int lz_comm_rank(const lz_comm *c);
int lz_comm_size(const lz_comm *c);
const char *lz_comm_backend_name(const lz_comm *c);

/* The contiguous range of `count` elements that `rank` owns: the first
 * count % size ranks get one element more. */
void lz_comm_shard(int64_t count, int size, int rank, int64_t *offset, int64_t *len);

/* `work` NULL: blocking. Otherwise the operation is queued in order on the
 * communicator and *work receives a handle to wait on or test. Buffers may be
 * host memory or device memory of the communicator's device. */
lz_status lz_comm_all_reduce(lz_comm *c, void *buf, int64_t count, lz_dtype dt,
                             lz_reduce_op op, lz_work **work);
/* send: count elements; recv: this rank's shard (lz_comm_shard). */
lz_status lz_comm_reduce_scatter(lz_comm *c, const void *send, void *recv, int64_t count,
                                 lz_dtype dt, lz_reduce_op op, lz_work **work);
/* all_reduce and reduce_scatter averaging over `divisor` ranks instead of
 * this communicator's size: the rank-order sum divided by divisor before
 * its one rounding to dt. A group's part of its parent's average (experts'
 * gradients summed over their expert-data-parallel group, averaged over
 * the world): the parent's avg bit for bit where the ranks outside the
 * group add zeros, in every dtype. */
lz_status lz_comm_all_reduce_avg_over(lz_comm *c, void *buf, int64_t count, lz_dtype dt,
                                      int divisor, lz_work **work);
lz_status lz_comm_reduce_scatter_avg_over(lz_comm *c, const void *send, void *recv, int64_t count,
                                          lz_dtype dt, int divisor, lz_work **work);
/* send: this rank's shard; recv: count elements. */
lz_status lz_comm_all_gather(lz_comm *c, const void *send, void *recv, int64_t count,
                             lz_dtype dt, lz_work **work);
lz_status lz_comm_broadcast(lz_comm *c, void *buf, int64_t count, lz_dtype dt, int root,
                            lz_work **work);
lz_status lz_comm_barrier(lz_comm *c);
/* send: `count` elements for each rank, in rank order; recv: `count` from
 * each rank, in rank order (W * count elements each). */
lz_status lz_comm_all_to_all(lz_comm *c, const void *send, void *recv, int64_t count,
                             lz_dtype dt, lz_work **work);
/* The token exchange of expert parallelism: send_counts[p] elements at
 * send + send_offsets[p] go to rank p; recv_counts[p] elements from rank p
 * land at recv + recv_offsets[p] (arrays of lz_comm_size entries, counted in
 * elements; copied, so they may be freed once the call returns). A rank with
 * nothing to send or receive still calls it. Before any data moves the ranks
 * agree on every count: where rank q's recv_counts[p] differs from rank p's
 * send_counts[q], every rank fails with LZ_ERR_INVALID naming p and q (and
 * the communicator stays usable: the ranks are still in step). The
 * receive ranges must not overlap each other or the send buffer. */
lz_status lz_comm_all_to_all_v(lz_comm *c, const void *send, const int64_t *send_counts,
                               const int64_t *send_offsets, void *recv,
                               const int64_t *recv_counts, const int64_t *recv_offsets,
                               lz_dtype dt, lz_work **work);

/* A sub-group of `parent`'s ranks (expert-parallel and expert-data-parallel
 * groups): a communicator of its own, on the parent's backend, that every
 * collective above runs on; its rank is this rank's index in `ranks`.
 * Collective over the parent: every parent rank calls it with the list of
 * the group it joins (parent ranks, ascending or not; the lists partition the
 * parent's ranks). Lists that disagree (rank q missing from, or listing
 * differently from, a group that names it) fail on every rank, naming them.
 * Disjoint groups run concurrently; free a group with lz_comm_free, before
 * its parent. */
lz_status lz_comm_group_new(lz_comm *parent, const int *ranks, int n, lz_comm **out);
/* The parent rank of this communicator's rank r (a group's list; identity
 * for a communicator made by lz_comm_init). */
int lz_comm_parent_rank(const lz_comm *c, int r);

lz_status lz_work_wait(lz_work *w); /* waits, then frees the handle */
lz_status lz_work_test(lz_work *w, int *done);

/* Bytes this rank sent, per kind, counted as nccl-tests' bus volume:
 * all-reduce 2(W-1)/W*n, reduce-scatter and all-gather (W-1)/W*n, broadcast n
 * (root) — n being the full buffer in bytes; all-to-all: the bytes this
 * rank sends to other ranks. */
uint64_t lz_comm_bytes(const lz_comm *c, lz_coll_kind kind);
void lz_comm_bytes_reset(lz_comm *c);
const char *lz_coll_kind_name(lz_coll_kind kind);

/* ------------------------------------------------- swap: the NVMe tier */

/* A swap file for optimizer states and parameters moved out of memory
 * (ZeRO-Infinity), read and written through libaio by I/O threads while the
 * caller computes. Buffers are plain host pointers; allocate them with
 * lz_mem_alloc(..., LZ_MEM_OFFLOAD), which aligns to 4096 bytes. */
typedef struct lz_swap lz_swap;
typedef struct lz_swap_req lz_swap_req;

typedef struct lz_swap_opts { /* DeepSpeed's "aio" block */
  int64_t block_size;         /* bytes per I/O request; a multiple of 4096 (default 1048576) */
  int queue_depth;            /* requests in flight per thread (default 8) */
  int thread_count;           /* I/O threads, each with its own io_context (default 1) */
  int single_submit;          /* 1: io_submit one request at a time (default 0: batch) */
  int overlap_events;         /* 1: submit new requests as each completes (default 1) */
} lz_swap_opts;

void lz_swap_opts_default(lz_swap_opts *o);
/* Creates a swap file of `bytes` (rounded up to 4096) in directory `dir`: a
 * unique name (luazero-swap-<pid>-<n>-<tag>), mode 0600, preallocated (a full
 * disk fails here, naming the file), opened O_DIRECT. Where O_DIRECT is
 * refused it warns once on stderr, naming the directory, and uses buffered
 * I/O. The file is unlinked as soon as it is open, so it disappears on every
 * exit path; lz_swap_path still names it for messages. `tag` names the
 * contents ("optimizer", "params") and may be NULL; opts NULL: defaults. */
lz_status lz_swap_open(lz_swap **out, const char *dir, int64_t bytes, const char *tag,
                       const lz_swap_opts *opts);
/* Waits for outstanding requests and frees handles not yet waited on
 * (reporting the first error among them); NULL is fine. */
lz_status lz_swap_close(lz_swap *s);
/* offset, bytes and the buffer address must be multiples of 4096 (O_DIRECT).
 * req NULL: blocking; else the request is queued and *req is a handle to wait
 * on. Requests complete in any order; each is split into block_size pieces,
 * up to queue_depth in flight per thread. */
lz_status lz_swap_read(lz_swap *s, int64_t offset, void *dst, int64_t bytes, lz_swap_req **req);
lz_status lz_swap_write(lz_swap *s, int64_t offset, const void *src, int64_t bytes,
                        lz_swap_req **req);
/* Waits, frees the handle, and reports the request's I/O error (naming the
 * file, the offset and the system's reason). */
lz_status lz_swap_wait(lz_swap_req *r);
/* 1 once the request has completed (wait still frees it). */
int lz_swap_req_done(lz_swap_req *r);
const char *lz_swap_path(const lz_swap *s);
int lz_swap_is_direct(const lz_swap *s);
int64_t lz_swap_size(const lz_swap *s);
uint64_t lz_swap_bytes_read(const lz_swap *s);
uint64_t lz_swap_bytes_written(const lz_swap *s);

/* --------------------------------------------------------- checkpoints */

/* A shard file: a 48-byte header (magic "LZSHARD", version, these four
 * numbers) then one zstd stream. docs/checkpoints.md. */
typedef struct lz_shard_info {
  uint64_t raw_bytes;        /* bytes before compression */
  uint64_t compressed_bytes; /* bytes of the zstd stream after the header */
  uint64_t xxh64_compressed; /* of the zstd stream */
  uint64_t xxh64_raw;        /* of the raw bytes */
} lz_shard_info;

typedef struct lz_shard_writer lz_shard_writer;
/* Creates (truncates) `path`; zstd `level`, `workers` compression threads (0:
 * in the caller's thread). Data streams through: nothing is held whole. */
lz_status lz_shard_writer_open(lz_shard_writer **out, const char *path, int level,
                               int workers);
lz_status lz_shard_writer_write(lz_shard_writer *w, const void *data, size_t bytes);
/* Ends the stream, writes the header, fsyncs and closes the file; *info (may
 * be NULL) receives its sizes and checksums. Frees w (on failure the file is
 * removed). */
lz_status lz_shard_writer_close(lz_shard_writer *w, lz_shard_info *info);
void lz_shard_writer_abort(lz_shard_writer *w); /* closes, removes the file; NULL is fine */

/* A shard written by a thread of its own (an asynchronous save): `bytes` of
 * `data` (the raw bytes in the shard's order) go through a shard writer in
 * pieces of `piece` bytes, so the file is the one lz_shard_writer_write
 * calls of that size make. `data` must stay unchanged until the join. */
typedef struct lz_shard_job lz_shard_job;
lz_status lz_shard_job_start(lz_shard_job **out, const char *path, const void *data,
                             size_t bytes, size_t piece, int level, int workers);
int lz_shard_job_done(const lz_shard_job *j); /* 1: finished (the join will not wait) */
/* Waits for the thread; its outcome: *info (may be NULL), or its error (the
 * file removed). Frees j; NULL is fine. */
lz_status lz_shard_job_join(lz_shard_job *j, lz_shard_info *info);

typedef struct lz_shard_reader lz_shard_reader;
/* Opens `path` and checks its header; `expect` (may be NULL): what the
 * manifest says (sizes and the compressed checksum must agree). */
lz_status lz_shard_reader_open(lz_shard_reader **out, const char *path,
                               const lz_shard_info *expect);
lz_status lz_shard_reader_info(const lz_shard_reader *r, lz_shard_info *out);
/* The next `bytes` raw bytes, in order, into dst (NULL: decompress and drop). */
lz_status lz_shard_reader_read(lz_shard_reader *r, void *dst, size_t bytes);
/* verify: read the rest of the file through the checksum and fail (naming the
 * file, expected and actual xxh64) on a mismatch. Frees r either way. */
lz_status lz_shard_reader_close(lz_shard_reader *r, int verify);

/* The file-system steps of an atomic save: mkdir -p; fsync a file or folder;
 * rename then fsync the destination's folder; write a small file under a
 * temporary name, fsync, rename over `path`; rm -r; the numbers N of the
 * step-N folders in `dir`, ascending (*count may exceed cap: only cap are written). */
lz_status lz_ckpt_mkdir(const char *path);
lz_status lz_ckpt_fsync(const char *path);
lz_status lz_ckpt_rename(const char *from, const char *to);
lz_status lz_ckpt_write_file(const char *path, const void *data, size_t bytes);
lz_status lz_ckpt_remove_tree(const char *path);
lz_status lz_ckpt_steps(const char *dir, int64_t *steps, int cap, int *count);
/* What is at `path` without opening it (a FIFO would block): its st_mode's
 * type bits (S_IFREG 0x8000, S_IFDIR 0x4000, S_IFLNK 0xA000, ...), following
 * a last link when `follow`, and where id is not NULL its device and inode;
 * -1 when nothing is there. */
int lz_path_kind(const char *path, int follow, uint64_t id[2]);

/* ------------------------------------------------------------ launcher */

/* Runs argv (argv[0] an executable) as `nranks` processes on this machine with
 * RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
 * the job's shared-memory name set; shares the cores among them; stops them all
 * when one fails. *exit_code: 0 when every rank exited 0. */
lz_status lz_launch(int nranks, char *const *argv, int *exit_code);
/* In a process a rank started (a sweep's run, os.execute in a script): it
 * inherits the launcher's variables but is none of its ranks (the launcher
 * is not its parent), so they are dropped and it runs as a job of its own
 * instead of joining the outer one's segment. Does nothing elsewhere. */
void lz_launch_leave_outer_job(void);
/* lz_launch, and when a rank fails (a non-zero exit, a signal) the job again, up to
 * `restarts` times, its ranks told by LZ_RESTART=<k> and LZ_RESTART_CAUSE=<one line>
 * (and LZ_RESTARTS=<restarts> from the first run). min_ranks 0: every run has nranks
 * ranks; 1..nranks: the ranks that died are lost, a restart runs on those left but never
 * fewer than min_ranks. A signal to the launcher is never restarted. Restarts used up, or
 * fewer ranks than min_ranks: *exit_code 1 after a line on stderr saying why. */
lz_status lz_launch_restarting(int nranks, char *const *argv, int restarts, int min_ranks,
                               int *exit_code);

/* ------------------------------------------------- devices: cuda, sim */

/* A process uses one accelerator: cuda or sim. Initializing one after the
 * other is an error naming both. Device tensors, device memory, copies
 * across devices, streams and events below work on whichever is initialized,
 * and their errors name it. */

/* The CUDA devices, through libluazero_cuda.so (built where nvcc exists,
 * loaded at run time: by the first of these or lz_cuda_init). Without the
 * library or a GPU: LZ_ERR_UNSUPPORTED naming why, and "unknown". */
lz_status lz_cuda_device_count(int *out);
const char *lz_cuda_device_name(int device);

/* Loads libluazero_cuda.so (from the folder of libluazero.so, else the
 * loader's search path) and selects `device`. Without the library or a usable
 * GPU: LZ_ERR_UNSUPPORTED, "cuda: no usable GPU on this machine (<reason>);
 * run with --device cpu". Again with the same device: no-op; another: error. */
lz_status lz_cuda_init(int device);
int lz_cuda_ready(void);  /* 1 after a successful lz_cuda_init */
int lz_cuda_device(void); /* the selected device, -1 before lz_cuda_init */
lz_status lz_cuda_synchronize(void); /* waits for all work on the device */

/* The simulated accelerator (core/devices/, always built): runs the cpu
 * kernels on worker threads, one per stream, over device memory the host
 * cannot read or write (a host access faults). LZ_SIM_MEMORY sets its
 * capacity (bytes, or with KiB/MiB/GiB; default 8GiB); LZ_SIM_JITTER=<seed>
 * delays each queued item by up to LZ_SIM_JITTER_US (default 200) us, so a
 * missing wait shows as a wrong result. Again: no-op. */
lz_status lz_sim_init(void);
int lz_sim_ready(void); /* 1 after a successful lz_sim_init */
int64_t lz_sim_capacity(void); /* bytes of device memory (LZ_SIM_MEMORY); 0 before lz_sim_init */
/* Nanoseconds the sim's host<->device copies have taken so far (on any
 * stream; LZ_SIM_COPY_GBPS paces them like a link of that bandwidth). */
uint64_t lz_sim_copy_ns(void);

/* LZ_CPU, or the accelerator whose device memory holds p. */
int lz_pointer_device(const void *p);
/* Waits for all streams of the initialized accelerator. */
lz_status lz_device_synchronize(void);
/* Bytes this process has queued across devices (lz_tensor_copy,
 * lz_tensor_copy_async): dir 0 host to device, 1 device to host. */
uint64_t lz_device_copy_bytes(int dir);
void lz_device_copy_bytes_reset(void);

/* Device work runs on three streams, each in order: kernels on COMPUTE,
 * collectives (nccl) on COMM, host<->device copies on COPY. Events order them:
 * record on one, make another wait. Kernels called through the API queue on
 * COMPUTE and return; lz_tensor_copy, lz_sq_norm and lz_has_inf_nan wait. */
typedef enum lz_stream_kind {
  LZ_STREAM_COMPUTE = 0,
  LZ_STREAM_COMM = 1,
  LZ_STREAM_COPY = 2,
  LZ_STREAM_COUNT = 3
} lz_stream_kind;
typedef struct lz_event lz_event;
lz_status lz_stream_synchronize(lz_stream_kind s);
lz_status lz_event_new(lz_event **out);
lz_status lz_event_free(lz_event *e); /* NULL is fine */
lz_status lz_event_record(lz_event *e, lz_stream_kind s);
lz_status lz_stream_wait_event(lz_stream_kind s, lz_event *e); /* s waits for e, the host does not */
lz_status lz_event_synchronize(lz_event *e);
lz_status lz_event_query(lz_event *e, int *done);

/* A tensor in device memory (dev LZ_CUDA or LZ_SIM, once initialized) or host memory
 * (LZ_CPU: as lz_tensor_new). Device bytes go on the ledger's device side. */
lz_status lz_tensor_new_on(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape,
                           lz_mem_category cat, lz_device dev);
/* A host tensor in pinned memory (lz_mem_alloc_pinned: category offload, on
 * the host side of the ledger), for copies to and from the device. */
lz_status lz_tensor_new_pinned(lz_tensor **out, lz_dtype dt, int ndim, const int64_t *shape);
/* Copy across devices, queued on stream s: same dtype and element count
 * (convert on one device with lz_tensor_copy). Host memory should be pinned
 * (lz_mem_alloc_pinned) for the copy to overlap; order it with events. */
lz_status lz_tensor_copy_async(lz_tensor *dst, const lz_tensor *src, lz_stream_kind s);

/* Device memory of the initialized accelerator on the ledger's device side;
 * freed by lz_mem_free. */
lz_status lz_mem_alloc_device(void **out, size_t bytes, lz_mem_category cat);
/* Page-locked host memory (cudaHostAlloc; sim: aligned host memory) for the offload tiers: category
 * offload on the host side of the ledger; freed by lz_mem_free. */
lz_status lz_mem_alloc_pinned(void **out, size_t bytes);
int64_t lz_mem_device_current(lz_mem_category cat);
int64_t lz_mem_device_peak(lz_mem_category cat);
int64_t lz_mem_device_total_current(void);
int64_t lz_mem_device_total_peak(void);

/* LZ_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* LUAZERO_H */
