/* sim.c — the sim device: an accelerator CI can test exactly. It runs the
 * cpu kernels, but on memory the host cannot touch and on streams that run
 * asynchronously, so a missing copy, a host read of device memory or a
 * missing wait shows up as a fault or a wrong result, as on a GPU.
 *
 *   - Memory (sim_memory.c): one memfd of LZ_SIM_MEMORY bytes mapped twice. The device
 *     mapping is PROT_NONE: its addresses are what alloc hands out, so any
 *     host access through a device pointer faults. The alias mapping is
 *     read-write and known only here: ops and copies run on device pointers
 *     translated into it. First fit over the region, 256-byte aligned;
 *     freed blocks of 1 MiB and more give their pages back (hole punching).
 *   - Streams (sim_streams.c): one worker thread per lz_stream_kind, each running its FIFO
 *     queue in order. An op is copied by value into its queue item (tensor
 *     headers translated to the alias, marked cpu) and the worker runs the
 *     cpu backend's kernel of the op on them (sim_ops.c); the public op
 *     checked the arguments before it was queued.
 *   - Events: per stream a count of items queued and one done; an event is
 *     (stream, queued count) at its record.
 *   - Jitter (LZ_SIM_JITTER=<seed>): each item first sleeps a pseudo-random
 *     0..LZ_SIM_JITTER_US microseconds.
 *   - Errors: a failing item leaves a sticky error that every later call
 *     returns, as CUDA's do. */
#include "devices/lz_sim.h"
#include "devices/sim_internal.h"
#include "mem/lz_internal.h"

#include <ctype.h>  /* isdigit */
#include <errno.h>  /* strtoull */
#include <stdlib.h> /* getenv, strtod */

static lz_status env_uint(const char *name, uint64_t *out, uint64_t dflt) {
  const char *s = getenv(name);
  *out = dflt;
  if (!s || !*s) return LZ_OK;
  char *end;
  errno = 0;
  unsigned long long v = isdigit((unsigned char)s[0]) ? strtoull(s, &end, 10) : 0;
  if (!isdigit((unsigned char)s[0]) || errno || *end)
    return lz_fail(LZ_ERR_INVALID, "sim: %s=\"%s\" is not a whole number >= 0", name, s);
  *out = v;
  return LZ_OK;
}

/* Called by lz_sim_init (devices/backend.c) once per process, under its
 * lock. In a forked rank nothing of the parent's is used: all state starts
 * here. The settings are read first, then the memory is mapped and the
 * workers start. */
static lz_status sim_init(int device) {
  (void)device;
  uint64_t seed, us;
  LZ_TRY(env_uint("LZ_SIM_JITTER", &seed, 0));
  LZ_TRY(env_uint("LZ_SIM_JITTER_US", &us, 200));
  if (us > 10000000)
    return lz_fail(LZ_ERR_INVALID, "sim: LZ_SIM_JITTER_US=%llu is more than 10 s",
                   (unsigned long long)us);
  const char *gbps = getenv("LZ_SIM_COPY_GBPS");
  double copy_gbps = 0;
  if (gbps && *gbps) {
    char *end;
    copy_gbps = strtod(gbps, &end);
    if (*end || copy_gbps < 0)
      return lz_fail(LZ_ERR_INVALID,
                     "sim: LZ_SIM_COPY_GBPS=\"%s\" is not a bandwidth; give GB/s (e.g. 25), or 0 "
                     "for memcpy's pace",
                     gbps);
  }
  LZ_TRY(lz_sim_memory_open());
  return lz_sim_streams_start(seed, (unsigned)us, copy_gbps);
}

static lz_backend table = {
    .abi = LZ_BACKEND_ABI,
    .name = "sim",
    .kind = LZ_SIM,
    .init = sim_init,
    .ops = lz_sim_ops,
    .alloc = lz_sim_mem_alloc,
    .free = lz_sim_mem_free,
    .host_alloc = lz_sim_pinned_alloc,
    .host_free = lz_sim_pinned_free,
    .copy = lz_sim_copy,
    .stream_sync = lz_sim_stream_sync,
    .sync = lz_sim_sync,
    .event_new = lz_sim_event_new,
    .event_free = lz_sim_event_free,
    .event_record = lz_sim_event_record,
    .stream_wait = lz_sim_stream_wait,
    .event_sync = lz_sim_event_sync,
    .event_query = lz_sim_event_query,
    .is_device_pointer = lz_sim_is_device_pointer,
    .nccl_id_bytes = 0, /* no NCCL: collectives on sim buffers go through shm, mpi, local */
};

const lz_backend *lz_sim_backend(void) { return &table; }
