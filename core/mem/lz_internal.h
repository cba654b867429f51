/* lz_internal.h — shared by the core sources only: error reporting, argument
 * checks, shared memory, and (through mem/lz_dtype.h) the dtype conversions.
 * Not part of the public API. */
#ifndef LZ_INTERNAL_H
#define LZ_INTERNAL_H

#include "luazero.h"
#include "mem/lz_dtype.h" /* conversions between f32, bf16 and f16 */

#include <stdarg.h> /* va_list for lz_fail */

#ifdef __cplusplus
extern "C" {
#endif

/* Hot loops are compiled for AVX-512, AVX2 and plain x86-64 and picked at
 * load time. GCC does not clone the bodies of OpenMP regions, so put the
 * per-row or per-block work in a function carrying this attribute and call it
 * from the parallel loop. */
#define LZ_DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
/* A kernel's form for parts with AVX2 and FMA but not AVX-512F
 * (LZ_FORM_AVX2_FMA), beside its LZ_DISPATCH clones, whose "avx2" has no FMA. */
#define LZ_FMA8 __attribute__((target("avx2,fma")))

/* The form this CPU's hot loops run in: LZ_DISPATCH's clone (AVX-512, AVX2
 * or plain), and where AVX2 comes with FMA (and not AVX-512) the forms of
 * their own that fuse multiply-adds there (the fp32 attention, the decode
 * attention, axpy).
 * lz_cpu_kernels names it. */
typedef enum { LZ_FORM_PLAIN, LZ_FORM_AVX2, LZ_FORM_AVX2_FMA, LZ_FORM_AVX512 } lz_cpu_form;
lz_cpu_form lz_cpu_form_here(void);

/* Records a message for lz_last_error() and returns `st`, so callers write
 * `return lz_fail(LZ_ERR_INVALID, "op: ...", ...)`. */
lz_status lz_fail(lz_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Propagates a failing status unchanged (the message is already set). */
#define LZ_TRY(expr)                                                                       \
  do {                                                                                     \
    lz_status lz_try_st_ = (expr);                                                         \
    if (lz_try_st_ != LZ_OK) return lz_try_st_;                                            \
  } while (0)

/* Argument checks for kernels: each sets an error naming the op, the
 * argument and its shape, e.g.
 * "layernorm_forward: w is f32[64], expected f32[128] (the last dimension of x)".
 * Dtypes are the op declaration's (mem/lz_ops.def, lz_op_check_dtypes). */
lz_status lz_check_present(const char *op, const char *name, const lz_tensor *t);
lz_status lz_check_ndim(const char *op, const char *name, const lz_tensor *t, int lo, int hi);
int64_t lz_ids_first_outside(const int32_t *ids, int64_t n, int64_t lo, int64_t hi,
                             int32_t *value);
lz_status lz_check_numel(const char *op, const char *name, const lz_tensor *t, int64_t n,
                         const char *why);
lz_status lz_check_same_shape(const char *op, const char *name_a, const lz_tensor *a,
                              const char *name_b, const lz_tensor *b);
/* The attention options (window, softcap, scale): 0 or in range. */
lz_status lz_attention_check_options(const char *op, int window, float softcap, float scale);
/* A named argument, for the checks that take lists (ended by {NULL}). */
typedef struct lz_arg {
  const char *name;
  const lz_tensor *t;
} lz_arg;
/* A row-wise op's shapes (its dtypes are the declaration's): x of 1 to
 * LZ_MAX_DIMS dimensions, the `like` tensors shaped as x, the `per_col` ones
 * holding one value per column of x (its last dimension), the `per_row` ones
 * one per row. */
lz_status lz_check_rowwise(const char *op, const lz_tensor *x, const lz_arg *like,
                           const lz_arg *per_col, const lz_arg *per_row);
/* An f32 output that must not share memory with a bf16 input (it could
 * alias an f32 one): names both when it does. */
lz_status lz_check_no_alias(const char *op, const char *out_name, const lz_tensor *out,
                            const char *in_name, const lz_tensor *in);
/* Product of all dims but the last, and the last. */
int64_t lz_rows(const lz_tensor *t);
int64_t lz_cols(const lz_tensor *t);

/* shared_mem.c: memory every rank of a `luazero -n N` job maps (the
 * launcher's memfds). lz_shared_wants: this block should live there (a
 * params, grads or comm block of 64 KiB or more, in a rank of such a job).
 * lz_shared_alloc fails (without a message) when the memfd is full; the
 * caller then allocates privately. lz_shared_offset: UINT64_MAX for memory
 * that is not this rank's shared memory; lz_shared_view: rank r's shared
 * memory at that offset as mapped here, NULL where out of range. */
int lz_shared_ready(void);
int lz_shared_wants(size_t bytes, lz_mem_category cat);
lz_status lz_shared_alloc(void **out, size_t bytes);
void lz_shared_free(void *ptr, size_t bytes);
uint64_t lz_shared_offset(const void *ptr);
uint8_t *lz_shared_view(int rank, size_t offset, size_t bytes);
/* The launcher's side: one file per rank, to be inherited through exec;
 * returns the LZ_SHM_SHARED value to give the ranks (malloc'd) or NULL where
 * turned off (LZ_SHM_SHARED_BYTES=0) or impossible. lz_shared_close closes
 * the launcher's descriptors (fds[r] == -1 is skipped). */
char *lz_shared_create(int nranks, int *fds);
void lz_shared_close(int nranks, int *fds);

/* "1.50 GiB", "512 B": a byte count in the largest binary unit it reaches,
 * into buf, for messages. */
const char *lz_format_bytes(uint64_t bytes, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* LZ_INTERNAL_H */
