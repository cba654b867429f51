/* lz_sim.h — what the core's collectives and the tests see of the sim
 * device (core/devices/) beyond its backend table. Not part of the public API. */
#ifndef LZ_SIM_H
#define LZ_SIM_H

#include "mem/lz_backend.h"

/* The built-in sim backend's table, which lz_sim_init publishes. */
const lz_backend *lz_sim_backend(void);

/* The host's view of sim device memory: device_ptr translated into the
 * read-write alias mapping of the same bytes; NULL when device_ptr is not
 * sim device memory (or sim is not initialized). */
void *lz_sim_host_view(const void *device_ptr);

/* A point on the compute stream: the work queued on it so far. Waiting for
 * it returns once that work has run (and its sticky error, if any). Both
 * fail with the sticky error of an earlier failed item. */
lz_status lz_sim_compute_point(uint64_t *point);
lz_status lz_sim_wait_compute(uint64_t point);

/* LZ_SIM_MEMORY's syntax: bytes, or a number with KiB, MiB or GiB. */
lz_status lz_sim_parse_memory(const char *value, size_t *out);

/* For the tests: the next compute item queued fails with `why` (as a kernel
 * failing on the device would); and forgetting the sticky error it leaves. */
void lz_sim_inject_failure(const char *why);
void lz_sim_clear_error(void);
/* For the tests: the jitter as LZ_SIM_JITTER=seed and LZ_SIM_JITTER_US=us
 * would set it at init (seed 0: none), from the next item on. */
void lz_sim_set_jitter(uint64_t seed, unsigned us);

#endif /* LZ_SIM_H */
