/* lz_backend.h — the backend slot: the device backend table, shared by the
 * core, the sim backend (core/devices/) and libluazero_cuda.so. Not part of
 * the public API. It sits at the bottom of the core (mem/) because tensors
 * and the ledger allocate through it; the devices fill it, the kernels
 * dispatch through it, and neither calls the other through it.
 *
 * A backend is one switch over ops, guarded by "does this backend support
 * it" (ggml's shape). The core runs every argument check, then, when the
 * op's tensors live on a device, packs them into lz_op_args and hands the op
 * to the backend: the kernels never see a bad shape. libluazero_cuda.so
 * exports lz_cuda_backend(), which returns its table; the core finds it with
 * dlopen/dlsym (lz_cuda_init) and refuses a table of another ABI version.
 * core/devices/sim.c's table (lz_sim_backend) is built in. One of them is
 * the process's active accelerator (mem/backend_slot.c). */
#ifndef LZ_BACKEND_H
#define LZ_BACKEND_H

#include "luazero.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LZ_BACKEND_ABI 2

typedef enum lz_op {
  LZ_OP_MATMUL = 0,             /* t: c, a, b; i: trans_a, trans_b; f: alpha, beta */
  LZ_OP_LINEAR_FORWARD,         /* t: out, x, w, bias (may be NULL) */
  LZ_OP_LINEAR_BACKWARD,        /* t: dx, dw, db (each may be NULL), dy, x, w */
  LZ_OP_LAYERNORM_FORWARD,      /* t: out, mean, rstd, x, w, b; f: eps */
  LZ_OP_LAYERNORM_BACKWARD,     /* t: dx, dw, db, dy, x, w, mean, rstd */
  LZ_OP_GELU_FORWARD,           /* t: out, x */
  LZ_OP_GELU_BACKWARD,          /* t: dx, dy, x */
  LZ_OP_ATTENTION_FORWARD,      /* t: out, lse, qkv, seg (may be NULL); i: n_head, n_kv_head */
  LZ_OP_ATTENTION_BACKWARD,     /* t: dqkv, dout, qkv, out, lse, seg; i: n_head, n_kv_head */
  LZ_OP_EMBEDDING_FORWARD,      /* t: out, tokens, wte, wpe, pos (may be NULL) */
  LZ_OP_EMBEDDING_BACKWARD,     /* t: dwte, dwpe (either may be NULL), dout, tokens, pos */
  LZ_OP_CROSS_ENTROPY_FORWARD,  /* t: losses, logits, targets; i: vocab */
  LZ_OP_CROSS_ENTROPY_BACKWARD, /* t: dlogits, logits, targets; i: vocab; f: dloss */
  LZ_OP_ADD,                    /* t: out, a, b */
  LZ_OP_AXPY,                   /* t: y, x; f: alpha */
  LZ_OP_SCALE,                  /* t: t; f: s */
  LZ_OP_FILL,                   /* t: t; f: v */
  LZ_OP_SQ_NORM,                /* t: t; out_f64 */
  LZ_OP_HAS_INF_NAN,            /* t: t; out_int */
  LZ_OP_ADAMW_STEP,             /* t: param, grad, m, v, working (may be NULL); adamw */
  LZ_OP_CONVERT,                /* t: dst, src: same element count, both on the device */
  LZ_OP_LION_STEP,              /* t: param, grad, m, working (may be NULL); lion */
  LZ_OP_RMSNORM_FORWARD,        /* t: out, rstd, x, w; f: eps */
  LZ_OP_RMSNORM_BACKWARD,       /* t: dx, dw, dy, x, w, rstd */
  LZ_OP_ROPE_FORWARD,           /* t: out, x, inv_freq, pos; i: n_head, hd, pos_offset; f: theta */
  LZ_OP_ROPE_BACKWARD,          /* t: dx, dy, inv_freq, pos; i: n_head, hd, pos_offset; f: theta */
  LZ_OP_SWIGLU_FORWARD,         /* t: out, gate, up */
  LZ_OP_SWIGLU_BACKWARD,        /* t: dgate, dup, dout, gate, up */
  LZ_OP_COUNT
} lz_op;

#define LZ_OP_MAX_TENSORS 8

typedef struct lz_op_args {
  lz_tensor *t[LZ_OP_MAX_TENSORS]; /* in the public function's argument order */
  int64_t i[3];
  float f[2];
  const lz_adamw_args *adamw;
  const lz_lion_args *lion;
  double *out_f64;
  int *out_int;
} lz_op_args;

/* Every function returns through lz_fail with a message naming the call, the
 * file:line and the library's own error string. Work is queued on the
 * backend's streams (lz_stream_kind): ops on LZ_STREAM_COMPUTE, in order;
 * only ops that return a value to the host (sq_norm, has_inf_nan) wait. */
typedef struct lz_backend {
  int abi; /* LZ_BACKEND_ABI */
  const char *name; /* "cuda", "sim": what messages call the device */
  lz_device kind;
  lz_status (*init)(int device); /* selects the device, creates streams and handles */
  int (*supports)(lz_op op, const lz_op_args *a);
  lz_status (*compute)(lz_op op, const lz_op_args *a);

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
   * so far; waits for it until timeout_s, then aborts the communicator. */
  lz_status (*nccl_run)(void *nc, lz_coll_kind kind, const void *send, void *recv, int64_t count,
                        lz_dtype dt, lz_reduce_op op, int root, double timeout_s);
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

/* After an op's argument checks: when its tensors (the non-NULL ones in
 * a->t) live on an accelerator, runs it there and sets *handled; when they
 * live on the cpu, leaves *handled 0 for the caller's cpu kernel. Tensors on
 * two devices are an error naming both. */
lz_status lz_backend_dispatch(const char *op_name, lz_op op, lz_op_args *a, int *handled);

/* The op's checks and then the device switch, in one line at the end of the
 * checks of each public kernel. */
#define LZ_DEVICE_DISPATCH(op_name, opcode, ...)                                               \
  do {                                                                                         \
    lz_op_args lz_dd_args_ = {__VA_ARGS__};                                                    \
    int lz_dd_handled_ = 0;                                                                    \
    lz_status lz_dd_st_ = lz_backend_dispatch(op_name, opcode, &lz_dd_args_, &lz_dd_handled_); \
    if (lz_dd_st_ != LZ_OK || lz_dd_handled_) return lz_dd_st_;                                \
  } while (0)

/* i32 ids checked on the host: returns the data of a cpu tensor, or a
 * malloc'd host copy of a cuda one in *copy (free it); NULL for a sim
 * one, whose ops check the ids where they run. */
lz_status lz_backend_host_ids(const char *op, const lz_tensor *t, const int32_t **ids,
                              int32_t **copy);

/* lz_tensor_copy when either side lives on a device (checks done). */
lz_status lz_tensor_copy_device(lz_tensor *dst, const lz_tensor *src);

#ifdef __cplusplus
}
#endif

#endif /* LZ_BACKEND_H */
