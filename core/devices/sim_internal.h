/* sim_internal.h — what the sim device's files (sim.c, sim_memory.c,
 * sim_streams.c, sim_ops.c) share with one another; nothing outside
 * core/devices/ includes it. */
#ifndef LZ_SIM_INTERNAL_H
#define LZ_SIM_INTERNAL_H

#include "mem/lz_backend.h"

/* sim_memory.c. lz_sim_memory_open maps LZ_SIM_MEMORY bytes (at init).
 * lz_sim_translate: p..p+bytes in device memory as the alias address; NULL
 * when p is not device memory; *bad when it starts there but runs past the
 * end. The rest are the table's memory calls. */
lz_status lz_sim_memory_open(void);
void *lz_sim_translate(const void *p, size_t bytes, int *bad);
lz_status lz_sim_mem_alloc(void **out, size_t bytes);
lz_status lz_sim_mem_free(void *p);
lz_status lz_sim_pinned_alloc(void **out, size_t bytes);
lz_status lz_sim_pinned_free(void *p);
int lz_sim_is_device_pointer(const void *p);

/* sim_streams.c. lz_sim_streams_start starts the workers (at init), with
 * the jitter's seed and bound and the copies' pace (GB/s, 0: memcpy's).
 * lz_sim_sticky_error: the error a failed item left, set as the last error
 * (LZ_OK when none); lz_sim_wait_all: until every stream has run what is
 * queued on it now. The rest are the table's stream and event calls. */
lz_status lz_sim_streams_start(uint64_t seed, unsigned jitter_us, double copy_gbps);
lz_status lz_sim_sticky_error(void);
void lz_sim_wait_all(void);
lz_status lz_sim_compute(lz_op op, const lz_op_args *a); /* queues op */
lz_status lz_sim_copy(void *dst, const void *src, size_t bytes, lz_stream_kind s);
lz_status lz_sim_stream_sync(lz_stream_kind s);
lz_status lz_sim_sync(void);
lz_status lz_sim_event_new(void **out);
lz_status lz_sim_event_free(void *e);
lz_status lz_sim_event_record(void *ev, lz_stream_kind s);
lz_status lz_sim_stream_wait(lz_stream_kind s, void *ev);
lz_status lz_sim_event_sync(void *ev);
lz_status lz_sim_event_query(void *ev, int *done);

/* sim_ops.c: the device's table (each op queued by lz_sim_compute), the
 * cpu backend's kernel of an op on tensors in the alias (the worker's), and
 * the op's name for messages. */
extern const lz_op_fn lz_sim_ops[LZ_OP_COUNT];
lz_status lz_sim_run_op(lz_op op, const lz_op_args *a);
const char *lz_sim_op_name(lz_op op);

#endif /* LZ_SIM_INTERNAL_H */
