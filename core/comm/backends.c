/* backends.c — the one table of collective backends. Everything that names
 * a backend reads it: LZ_BACKEND and lz_comm_init's argument, the automatic
 * choice, which buffers a backend may move, the errors that list the
 * alternatives, and (through lz_comm_backend_*_at) the executable's
 * --backend and the Lua binding. Adding a backend is its vtable file and
 * one row here. */
#include "comm/comm_internal.h"

#include <errno.h>  /* strtol errors */
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* getenv, strtol */

/* libluazero_cuda.so, which holds nccl's device half, is built only where
 * nvcc exists (premake5.lua defines LZ_HAVE_CUDA then). */
#ifdef LZ_HAVE_CUDA
#define BUILT_WITH_CUDA 1
#else
#define BUILT_WITH_CUDA 0
#endif
#define NEEDS_CUDA "libluazero_cuda.so, which is built only where nvcc exists"

#define MOVES(dev) (1u << (dev))

/* auto_rank orders the automatic choice (0: never chosen by it): the first
 * backend whose auto_env is set (NULL: always) and whose max_ranks holds the
 * world size. mpirun's variables win over the launcher's, since a job under
 * mpirun may have been started from inside a launcher's rank. */
static const lz_comm_backend_entry table[] = {
    {.name = "local",
     .id = LZ_COMM_LOCAL,
     .ops = &lz_comm_local_ops,
     .moves = MOVES(LZ_CPU) | MOVES(LZ_SIM) | MOVES(LZ_CUDA),
     .available = 1,
     .max_ranks = 1,
     .auto_rank = 3,
     .auto_env = NULL,
     .about = "one rank, no peers"},
    {.name = "shm",
     .id = LZ_COMM_SHM,
     .ops = &lz_comm_shm_ops,
     .moves = MOVES(LZ_CPU) | MOVES(LZ_SIM),
     .available = 1,
     .max_ranks = 0,
     .auto_rank = 2,
     .auto_env = "LZ_SHM_NAME",
     .about = "ranks on this machine, shared memory (the default under -n)"},
    {.name = "mpi",
     .id = LZ_COMM_MPI,
     .ops = &lz_comm_mpi_ops,
     .moves = MOVES(LZ_CPU) | MOVES(LZ_SIM),
     .available = 1,
     .max_ranks = 0,
     .auto_rank = 1,
     .auto_env = "OMPI_COMM_WORLD_SIZE",
     .about = "OpenMPI: ranks under mpirun, many machines",
     .under_mpirun = 1},
    {.name = "nccl",
     .id = LZ_COMM_NCCL,
     .ops = &lz_comm_nccl_ops,
     .moves = MOVES(LZ_CUDA),
     .available = BUILT_WITH_CUDA,
     .needs = NEEDS_CUDA,
     .max_ranks = 0,
     .auto_rank = 0,
     .auto_env = NULL,
     .about = "NCCL: GPUs, cuda buffers"},
};

#define COUNT ((int)(sizeof table / sizeof table[0]))

const lz_comm_backend_entry *lz_comm_backend_entry_at(int i) {
  return i >= 0 && i < COUNT ? &table[i] : NULL;
}

const lz_comm_backend_entry *lz_comm_backend_entry_of(lz_comm_backend id) {
  for (int i = 0; i < COUNT; i++)
    if (table[i].id == id) return &table[i];
  return NULL;
}

/* "a, b or c": the names of the entries `keep` accepts. */
const char *lz_comm_backend_list(char *buf, size_t len,
                                 int (*keep)(const lz_comm_backend_entry *, const void *),
                                 const void *arg) {
  const lz_comm_backend_entry *picked[COUNT];
  int n = 0;
  for (int i = 0; i < COUNT; i++)
    if (!keep || keep(&table[i], arg)) picked[n++] = &table[i];
  size_t at = 0;
  buf[0] = 0;
  for (int i = 0; i < n && at < len; i++) {
    const char *sep = i == 0 ? "" : i == n - 1 ? " or " : ", ";
    int w = snprintf(buf + at, len - at, "%s%s", sep, picked[i]->name);
    if (w < 0) break;
    at += (size_t)w;
  }
  return buf;
}

static int built(const lz_comm_backend_entry *e, const void *unused) {
  (void)unused;
  return e->available;
}

static lz_status lookup(const char *name, lz_comm_backend *out) {
  if (!strcmp(name, "auto")) {
    *out = LZ_COMM_AUTO;
    return LZ_OK;
  }
  for (int i = 0; i < COUNT; i++)
    if (!strcmp(name, table[i].name)) {
      *out = table[i].id;
      return LZ_OK;
    }
  return LZ_ERR_INVALID;
}

/* The automatic choice: rank by rank through auto_rank. */
static const lz_comm_backend_entry *automatic(int world) {
  const lz_comm_backend_entry *best = NULL;
  for (int i = 0; i < COUNT; i++) {
    const lz_comm_backend_entry *e = &table[i];
    if (!e->auto_rank || (best && best->auto_rank <= e->auto_rank)) continue;
    if (e->auto_env && !getenv(e->auto_env)) continue;
    if (e->max_ranks && world > e->max_ranks) continue;
    best = e;
  }
  return best;
}

static lz_status env_int(const char *name, int *out, int lo) {
  const char *s = getenv(name);
  if (!s) return LZ_ERR_INVALID;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > 1 << 20)
    return lz_fail(LZ_ERR_INVALID, "comm: environment variable %s=\"%s\" is not an integer >= %d",
                   name, s, lo);
  *out = (int)v;
  return LZ_OK;
}

/* World size from the environment: 1 where nothing says otherwise. */
static int env_world(void) {
  int w = 1;
  if (getenv("OMPI_COMM_WORLD_SIZE") && env_int("OMPI_COMM_WORLD_SIZE", &w, 1) == LZ_OK) return w;
  if (getenv("WORLD_SIZE") && env_int("WORLD_SIZE", &w, 1) == LZ_OK) return w;
  return 1;
}

lz_status lz_comm_backend_choose(lz_comm_backend asked, const lz_comm_backend_entry **out) {
  char names[256];
  if (asked == LZ_COMM_AUTO) {
    const char *b = getenv("LZ_BACKEND");
    if (b && *b && lookup(b, &asked) != LZ_OK)
      return lz_fail(LZ_ERR_INVALID, "comm: LZ_BACKEND=\"%s\" is not a backend; use %s", b,
                     lz_comm_backend_list(names, sizeof names, NULL, NULL));
  }
  if (asked == LZ_COMM_AUTO) {
    int world = env_world();
    *out = automatic(world);
    if (!*out)
      return lz_fail(LZ_ERR_INVALID,
                     "comm: WORLD_SIZE=%d but this process was not started by the luazero "
                     "launcher (LZ_SHM_NAME is unset) nor by mpirun; run `luazero -n %d ...` "
                     "or `mpirun -np %d ...`",
                     world, world, world);
    return LZ_OK;
  }
  *out = lz_comm_backend_entry_of(asked);
  if (!*out)
    return lz_fail(LZ_ERR_INVALID, "comm: backend %d is not one of auto, %s", (int)asked,
                   lz_comm_backend_list(names, sizeof names, NULL, NULL));
  if (!(*out)->available)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "comm: the %s backend is not in this build: it needs %s; rebuild there, or "
                   "use %s",
                   (*out)->name, (*out)->needs,
                   lz_comm_backend_list(names, sizeof names, built, NULL));
  return LZ_OK;
}

/* ------------------------------------------------------------- public API */

int lz_comm_backend_count(void) { return COUNT; }

const char *lz_comm_backend_name_at(int i) {
  const lz_comm_backend_entry *e = lz_comm_backend_entry_at(i);
  return e ? e->name : NULL;
}

const char *lz_comm_backend_about_at(int i) {
  const lz_comm_backend_entry *e = lz_comm_backend_entry_at(i);
  return e ? e->about : NULL;
}

unsigned lz_comm_backend_moves_at(int i) {
  const lz_comm_backend_entry *e = lz_comm_backend_entry_at(i);
  return e ? e->moves : 0;
}

int lz_comm_backend_available_at(int i) {
  const lz_comm_backend_entry *e = lz_comm_backend_entry_at(i);
  return e ? e->available : 0;
}

lz_status lz_comm_backend_parse(const char *name, lz_comm_backend *out) {
  char names[256];
  if (!out) return lz_fail(LZ_ERR_INVALID, "comm_backend_parse: out is NULL");
  if (name && lookup(name, out) == LZ_OK) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID, "'%s' is not a collective backend; use auto, %s", name ? name : "",
                 lz_comm_backend_list(names, sizeof names, NULL, NULL));
}
