/* lz_backend.h — the backend slot: the device backend table, shared by the
 * core, the sim backend (core/devices/) and libluazero_cuda.so. Not part of
 * the public API. It sits at the bottom of the core (mem/) because tensors
 * and the ledger allocate through it; the devices fill it, the kernels
 * dispatch through it, and neither calls the other through it.
 *
 * A backend is one table over ops (ggml's shape): every op is declared once
 * in mem/lz_ops.def, and each backend — the cpu (devices/cpu.c), sim
 * (devices/sim_ops.c), cuda (cuda/backend.cu) — fills its table of kernels
 * from that declaration. A public op runs its argument checks, then
 * lz_op_run packs its tensors into lz_op_args and calls the kernel of the
 * backend their device names: the kernels never see a bad shape, and the
 * checks run once. libluazero_cuda.so exports lz_cuda_backend(), which
 * returns its table; the core finds it with dlopen/dlsym (lz_cuda_init)
 * and refuses a table of another ABI version.
 * core/devices/sim.c's table (lz_sim_backend) is built in. One of them is
 * the process's active accelerator (mem/backend_slot.c). */
#ifndef LZ_BACKEND_H
#define LZ_BACKEND_H

#include "luazero.h"
#ifdef LZ_OPS_EXTRA /* a test build's extra ops declare their public functions */
#define LZ_OPS_EXTRA_PROTOTYPES
#include "mem/lz_ops.def"
#undef LZ_OPS_EXTRA_PROTOTYPES
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define LZ_BACKEND_ABI 11

/* The ops, in the order of their declaration (mem/lz_ops.def). */
typedef enum lz_op {
#define LZ_OP(ID, ...) LZ_OP_##ID,
#include "mem/lz_ops.def"
  LZ_OP_COUNT
} lz_op;

#define LZ_OP_MAX_TENSORS 8

typedef struct lz_op_args {
  lz_tensor *t[LZ_OP_MAX_TENSORS]; /* in the public function's argument order */
  int64_t i[4];
  float f[3];
  const lz_adamw_args *adamw;
  const lz_lion_args *lion;
  double *out_f64;
  int *out_int;
  double *blocks; /* host: the gradient norm's block partials (sq_norm_blocks, moe_gemm backward) */
  const char *name; /* the public function's name, for errors (LZ_OP_RUN sets it; NULL: the op's) */
} lz_op_args;

/* The name an op's errors give: the public function that ran it (several
 * may run one op: moe_gemm_part_forward and moe_gemm_forward), else the
 * op's own. */
#define LZ_OP_NAME(op, a) ((a)->name ? (a)->name : lz_op_infos[op].name)

/* One op's kernel on one device. */
typedef lz_status (*lz_op_fn)(const lz_op_args *a);

/* The dtypes one tensor argument accepts (mem/lz_ops.def's ARG): a mask of
 * 1 << lz_dtype, or LZ_DT_SAME | i: slot i's dtype, checked against slot
 * i's own mask. */
typedef uint16_t lz_op_dtypes;
#define LZ_DT_SAME 0x8000u
#define LZ_DT_ANY 0x7fffu

typedef struct lz_op_arg {
  const char *name; /* as messages name the slot; NULL past the last */
  lz_op_dtypes dtypes;
} lz_op_arg;

/* What the declaration says of an op (mem/ops.c, from mem/lz_ops.def). */
typedef struct lz_op_info {
  const char *name;                    /* lz_<name>: the public function */
  lz_op_arg args[LZ_OP_MAX_TENSORS];   /* a->t's slots */
  int waits;                           /* hands a value back to the host */
} lz_op_info;

extern const lz_op_info lz_op_infos[LZ_OP_COUNT];

/* Each non-NULL tensor of a against the dtypes its slot accepts; the first
 * that does not fit is an error naming op_name, the slot and what it takes.
 * lz_op_run runs it first; a mask test per tensor when all fit. */
lz_status lz_op_check_dtypes(const char *op_name, lz_op op, const lz_op_args *a);

/* The cpu backend's kernels (core/kernels/, core/optim/): the op on host
 * memory, its arguments already checked. */
#define LZ_OP(ID, name, ...) lz_status lz_cpu_##name(const lz_op_args *a);
#include "mem/lz_ops.def"

/* The checks of values a kernel makes where the data is, on host memory
 * (the cpu kernel's own tensors, or a device's host copy): each op's ids
 * and rope's inverse frequencies (NULL: not checked). */
lz_status lz_embedding_check_ids(lz_op op, const lz_op_args *a, const int32_t *tokens,
                                 const int32_t *pos);
lz_status lz_rope_check_values(lz_op op, const lz_op_args *a, const float *inv_freq,
                               const int32_t *pos);
/* row_of_slot's n values (each in [0, n), already checked) a permutation
 * of 0 .. n - 1, as moe_sort makes it (core/kernels/moe.c). */
lz_status lz_moe_check_permutation(lz_op op, const int32_t *rows, int64_t n);

/* Every function returns through lz_fail with a message naming the call, the
 * file:line and the library's own error string. Work is queued on the
 * backend's streams (lz_stream_kind): ops on LZ_STREAM_COMPUTE, in order;
 * only ops that return a value to the host (sq_norm, has_inf_nan) wait. */
typedef struct lz_backend {
  int abi; /* LZ_BACKEND_ABI */
  const char *name; /* "cuda", "sim": what messages call the device */
  lz_device kind;
  lz_status (*init)(int device); /* selects the device, creates streams and handles */
  /* The device's kernel of each op, indexed by lz_op; NULL where the device
   * has none yet. The core ran the op's checks before: a kernel never sees a
   * bad shape (only data the host cannot read, such as ids on the device,
   * is the kernel's to check). */
  const lz_op_fn *ops;

  /* Memory. alloc/free: device memory; host_alloc/host_free: page-locked. */
  lz_status (*alloc)(void **out, size_t bytes);
  lz_status (*free)(void *p);
  lz_status (*host_alloc)(void **out, size_t bytes);
  lz_status (*host_free)(void *p);
  /* Any direction (unified addressing), queued on stream s. */
  lz_status (*copy)(void *dst, const void *src, size_t bytes, lz_stream_kind s);

  /* Streams and events. */
  lz_status (*stream_sync)(lz_stream_kind s);
  lz_status (*sync)(void); /* the whole device */
  lz_status (*event_new)(void **out);
  lz_status (*event_free)(void *e);
  lz_status (*event_record)(void *e, lz_stream_kind s);
  lz_status (*stream_wait)(lz_stream_kind s, void *e);
  lz_status (*event_sync)(void *e);
  lz_status (*event_query)(void *e, int *done);
  int (*is_device_pointer)(const void *p);

  /* NCCL (the collectives' nccl backend, core/comm/comm_nccl.c). An id is
   * nccl_id_bytes of opaque bytes that rank 0 makes and every rank gets.
   * A backend without NCCL (sim) leaves these NULL and nccl_id_bytes 0. */
  size_t nccl_id_bytes;
  lz_status (*nccl_get_id)(void *id);
  lz_status (*nccl_init)(void **out, const void *id, int rank, int size);
  void (*nccl_free)(void *nc, int abort);
  /* One collective queued on LZ_STREAM_COMM after the compute stream's work
   * so far; waits for it until timeout_s, then aborts the communicator.
   * divisor: what avg divides by (lz_coll_args.divisor). */
  lz_status (*nccl_run)(void *nc, lz_coll_kind kind, const void *send, void *recv, int64_t count,
                        lz_dtype dt, lz_reduce_op op, int divisor, int root, double timeout_s);
  /* All-to-all: every rank's `n` host int64 (row) into table (size rows),
   * through device memory; then the exchange itself, v as in
   * lz_coll_args.v. A group: ncclCommSplit of nc. */
  lz_status (*nccl_gather_counts)(void *nc, const int64_t *row, int64_t *table, int n,
                                  double timeout_s);
  lz_status (*nccl_all_to_all)(void *nc, const void *send, void *recv, const int64_t *v,
                               lz_dtype dt, double timeout_s);
  lz_status (*nccl_split)(void *nc, int color, int key, int size, void **out);
} lz_backend;

typedef const lz_backend *(*lz_backend_entry_fn)(void);

/* ---------------------------------------------------------------- core side */

/* backend_slot.c: the active accelerator's backend, or NULL before a
 * successful lz_cuda_init or lz_sim_init; lz_backend_active_set publishes
 * it (those two only, once). lz_backend_of(dev): the active backend when it
 * is dev's, else NULL; lz_backend_cuda() is lz_backend_of(LZ_CUDA). */
const lz_backend *lz_backend_active(void);
void lz_backend_active_set(const lz_backend *be, int device);
const lz_backend *lz_backend_of(lz_device dev);
const lz_backend *lz_backend_cuda(void);
/* dev's backend (LZ_CUDA, LZ_SIM) when it is the active one, else an error
 * naming op and how to initialize dev. */
lz_status lz_backend_need(const char *op, lz_device dev, const lz_backend **be);
/* The active backend, whichever accelerator it is, else an error naming op
 * and how to initialize one. */
lz_status lz_backend_need_any(const char *op, const lz_backend **be);
/* "cpu", "cuda", "sim" (or "device <n>"): for messages. */
const char *lz_device_name(lz_device dev);

/* The cpu backend: its table is set once, when the library loads
 * (devices/cpu.c); lz_backend_cpu() returns it. */
void lz_backend_cpu_set(const lz_backend *be);
const lz_backend *lz_backend_cpu(void);

/* After an op's argument checks: checks the tensors' dtypes against the
 * declaration (lz_op_check_dtypes), then runs op on the backend of the
 * device its tensors (the non-NULL ones in a->t) live on — the cpu's, or the
 * active accelerator's — through that backend's table. Tensors on two
 * devices, or a device without the op's kernel, are an error naming op_name
 * (the public function's name) and the arguments. */
lz_status lz_op_run(const char *op_name, lz_op op, const lz_op_args *a);

/* The last line of a public op that checks no dtype itself: its arguments
 * into lz_op_args, and run. One whose checks need the dtypes first packs
 * its lz_op_args, runs lz_op_check_dtypes, and ends in lz_op_run. */
#define LZ_OP_RUN(op_name, opcode, ...) \
  return lz_op_run(op_name, opcode, &(lz_op_args){.name = op_name, __VA_ARGS__})

/* lz_tensor_copy when either side lives on a device (checks done). */
lz_status lz_tensor_copy_device(lz_tensor *dst, const lz_tensor *src);

#ifdef __cplusplus
}
#endif

#endif /* LZ_BACKEND_H */
