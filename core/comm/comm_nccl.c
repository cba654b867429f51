/* comm_nccl.c — the nccl collective backend: GPUs, device buffers. The
 * collectives themselves run in libluazero_cuda.so (cuda/nccl.cu) on the
 * communication stream; this file finds the rank, selects the rank's GPU
 * (LOCAL_RANK), and shares NCCL's unique id from rank 0 to every rank:
 *   - under mpirun: MPI_Bcast;
 *   - under the luazero launcher: a file in /dev/shm named after the job's
 *     shared-memory segment (LZ_SHM_NAME), written by rank 0 under a
 *     temporary name and renamed, removed once every rank has joined;
 *   - otherwise (torchrun-style environment, many machines): TCP, rank 0
 *     listening on MASTER_ADDR:MASTER_PORT and sending the id to each peer.
 * Every wait has the communicator's deadline (LZ_COMM_TIMEOUT). */
#define _GNU_SOURCE
#include "comm/comm_internal.h"
#include "mem/lz_backend.h"

#include <errno.h>      /* errno for socket and file errors */
#include <fcntl.h>      /* open */
#include <mpi.h>        /* MPI_Bcast under mpirun */
#include <netdb.h>      /* getaddrinfo */
#include <netinet/in.h> /* sockaddr_in */
#include <poll.h>       /* poll with a deadline */
#include <sched.h>      /* sched_yield */
#include <stdio.h>      /* snprintf, rename */
#include <stdlib.h>     /* getenv, calloc */
#include <string.h>     /* strstr: cuda's advice cut off */
#include <sys/socket.h> /* the TCP rendezvous */
#include <time.h>       /* nanosleep */
#include <unistd.h>     /* read, write, close, unlink */

#define ID_MAX 512

typedef struct nccl_impl {
  const lz_backend *be;
  void *nc;
  int own_mpi; /* MPI_Init was ours */
  char id_file[300];
} nccl_impl;

static int env_int_or(const char *a, const char *b, int dflt) {
  const char *s = getenv(a);
  if (!s || !*s) s = getenv(b);
  return s && *s ? atoi(s) : dflt;
}

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------- id sharing */

static lz_status share_mpi(lz_comm *c, nccl_impl *m, void *id, size_t bytes) {
  int inited = 0, provided = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
      return lz_fail(LZ_ERR_COMM, "nccl: rank %d: MPI_Init_thread failed while sharing the id",
                     c->rank);
    m->own_mpi = 1;
  }
  if (MPI_Bcast(id, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    return lz_fail(LZ_ERR_COMM, "nccl: rank %d: MPI_Bcast of the nccl id failed", c->rank);
  return LZ_OK;
}

static lz_status share_file(lz_comm *c, nccl_impl *m, const char *shm, void *id, size_t bytes) {
  while (*shm == '/') shm++;
  snprintf(m->id_file, sizeof m->id_file, "/dev/shm/%s.nccl-id", shm);
  if (c->rank == 0) {
    char tmp[320];
    snprintf(tmp, sizeof tmp, "%s.tmp", m->id_file);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || write(fd, id, bytes) != (ssize_t)bytes || close(fd) != 0 ||
        rename(tmp, m->id_file) != 0)
      return lz_fail(LZ_ERR_IO, "nccl: rank 0: writing %s failed: %s", m->id_file, strerror(errno));
    return LZ_OK;
  }
  const double deadline = lz_now_s() + c->timeout_s;
  for (;;) {
    int fd = open(m->id_file, O_RDONLY);
    if (fd >= 0) {
      ssize_t n = read(fd, id, bytes);
      close(fd);
      if (n == (ssize_t)bytes) return LZ_OK;
    }
    if (lz_now_s() > deadline)
      return lz_fail(LZ_ERR_TIMEOUT,
                     "nccl: rank %d: rank 0 did not publish the nccl id in %s within "
                     "LZ_COMM_TIMEOUT (%.0f s); did rank 0 start?",
                     c->rank, m->id_file, c->timeout_s);
    nap_ms(5);
  }
}

static lz_status io_all(int fd, void *buf, size_t bytes, int sending, double deadline,
                        const char *who) {
  size_t done = 0;
  while (done < bytes) {
    struct pollfd p = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
    int left_ms = (int)((deadline - lz_now_s()) * 1000);
    if (left_ms <= 0 || poll(&p, 1, left_ms) <= 0)
      return lz_fail(LZ_ERR_TIMEOUT, "nccl: %s: the id exchange timed out", who);
    ssize_t n = sending ? write(fd, (char *)buf + done, bytes - done)
                        : read(fd, (char *)buf + done, bytes - done);
    if (n <= 0)
      return lz_fail(LZ_ERR_COMM, "nccl: %s: the id exchange failed: %s", who,
                     n == 0 ? "connection closed" : strerror(errno));
    done += (size_t)n;
  }
  return LZ_OK;
}

static lz_status share_tcp(lz_comm *c, void *id, size_t bytes) {
  const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
  if (!addr || !*addr || !port || !*port)
    return lz_fail(LZ_ERR_INVALID,
                   "nccl: WORLD_SIZE=%d but MASTER_ADDR and MASTER_PORT are not both set; set "
                   "them to rank 0's address and a free port (or run under mpirun or `luazero "
                   "-n`)",
                   c->size);
  const double deadline = lz_now_s() + c->timeout_s;
  char who[64];
  snprintf(who, sizeof who, "rank %d", c->rank);
  if (c->rank == 0) {
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)atoi(port)),
                             .sin_addr.s_addr = htonl(INADDR_ANY)};
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ls < 0 || bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 128) != 0) {
      lz_status st = lz_fail(LZ_ERR_COMM,
                             "nccl: rank 0: cannot listen on port %s: %s; pick "
                             "another MASTER_PORT",
                             port, strerror(errno));
      if (ls >= 0) close(ls);
      return st;
    }
    lz_status st = LZ_OK;
    for (int served = 1; served < c->size && st == LZ_OK; served++) {
      struct pollfd p = {.fd = ls, .events = POLLIN};
      int left_ms = (int)((deadline - lz_now_s()) * 1000);
      if (left_ms <= 0 || poll(&p, 1, left_ms) <= 0) {
        st = lz_fail(LZ_ERR_TIMEOUT,
                     "nccl: rank 0: only %d of %d ranks connected to port %s within "
                     "LZ_COMM_TIMEOUT (%.0f s)",
                     served, c->size, port, c->timeout_s);
        break;
      }
      int fd = accept(ls, NULL, NULL);
      if (fd < 0) continue;
      st = io_all(fd, id, bytes, 1, deadline, who);
      close(fd);
    }
    close(ls);
    return st;
  }
  struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res = NULL;
  int gai = getaddrinfo(addr, port, &hints, &res);
  if (gai != 0)
    return lz_fail(LZ_ERR_COMM, "nccl: rank %d: MASTER_ADDR=%s: %s", c->rank, addr,
                   gai_strerror(gai));
  lz_status st = LZ_OK;
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      st = io_all(fd, id, bytes, 0, deadline, who);
      close(fd);
      break;
    }
    if (fd >= 0) close(fd);
    if (lz_now_s() > deadline) {
      st = lz_fail(LZ_ERR_TIMEOUT,
                   "nccl: rank %d: could not reach rank 0 at %s:%s within LZ_COMM_TIMEOUT "
                   "(%.0f s)",
                   c->rank, addr, port, c->timeout_s);
      break;
    }
    nap_ms(50);
  }
  freeaddrinfo(res);
  return st;
}

/* ---------------------------------------------------------------- backend */

static lz_status nccl_init(lz_comm *c) {
  const int in_mpi = getenv("OMPI_COMM_WORLD_SIZE") != NULL;
  c->rank = env_int_or(in_mpi ? "OMPI_COMM_WORLD_RANK" : "RANK", "RANK", 0);
  c->size = env_int_or(in_mpi ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE", "WORLD_SIZE", 1);
  if (c->size < 1 || c->rank < 0 || c->rank >= c->size)
    return lz_fail(LZ_ERR_INVALID, "nccl: rank %d of world size %d is out of range", c->rank,
                   c->size);
  int local = env_int_or(in_mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "LOCAL_RANK", "LOCAL_RANK", 0);
  if (!lz_cuda_ready()) {
    lz_status st = lz_cuda_init(local);
    if (st != LZ_OK) {
      /* cuda's advice (--device cpu) is not this backend's: it is the
       * backend that needs the GPU */
      char why[1024];
      snprintf(why, sizeof why, "%s", lz_last_error());
      char *advice = strstr(why, "; run with --device cpu");
      if (advice) *advice = '\0';
      return lz_fail(st,
                     "nccl: rank %d needs GPU %d: %s; the nccl backend runs between GPUs: "
                     "without one use --backend shm (one machine) or mpi",
                     c->rank, local, why);
    }
  }
  const lz_backend *be = lz_backend_cuda();
  if (be->nccl_id_bytes > ID_MAX)
    return lz_fail(LZ_ERR_INTERNAL, "nccl: the id is %zu bytes (at most %d expected)",
                   be->nccl_id_bytes, ID_MAX);
  nccl_impl *m = calloc(1, sizeof *m);
  if (!m) return lz_fail(LZ_ERR_NOMEM, "nccl: out of memory");
  m->be = be;
  unsigned char id[ID_MAX] = {0};
  lz_status st = c->rank == 0 ? be->nccl_get_id(id) : LZ_OK;
  const char *shm = getenv("LZ_SHM_NAME");
  if (st == LZ_OK && c->size > 1) {
    if (in_mpi)
      st = share_mpi(c, m, id, be->nccl_id_bytes);
    else if (shm && *shm)
      st = share_file(c, m, shm, id, be->nccl_id_bytes);
    else
      st = share_tcp(c, id, be->nccl_id_bytes);
  }
  if (st == LZ_OK) st = be->nccl_init(&m->nc, id, c->rank, c->size);
  /* Every rank has joined (or failed): the id file has done its work. */
  if (c->rank == 0 && m->id_file[0]) unlink(m->id_file);
  if (st != LZ_OK) {
    if (m->own_mpi) MPI_Finalize();
    free(m);
    return st;
  }
  c->impl = m;
  return LZ_OK;
}

static void nccl_free(lz_comm *c) {
  nccl_impl *m = c->impl;
  if (!m) return;
  m->be->nccl_free(m->nc, c->broken != LZ_OK);
  if (m->own_mpi) MPI_Finalize();
  free(m);
}

/* Host and sim buffers never get here: the table says nccl moves cuda
 * buffers only, and comm.c refuses the others before queueing. */
static lz_status nccl_run(lz_comm *c, const lz_coll_args *a) {
  nccl_impl *m = c->impl;
  if (a->kind == LZ_COLL_ALL_TO_ALL) { /* the counts agree first, as on the host backends */
    int64_t *table = malloc(sizeof *table * 4 * (size_t)c->size * (size_t)c->size);
    if (!table) return lz_fail(LZ_ERR_NOMEM, "all_to_all: rank %d: out of memory", c->rank);
    lz_status st = m->be->nccl_gather_counts(m->nc, a->v, table, 4 * c->size, c->timeout_s);
    if (st == LZ_OK) st = lz_comm_a2a_check(c, table);
    free(table);
    LZ_TRY(st);
    return m->be->nccl_all_to_all(m->nc, a->send, a->recv, a->v, a->dt, c->timeout_s);
  }
  return m->be->nccl_run(m->nc, a->kind, a->send, a->recv, a->count, a->dt, a->op, a->divisor,
                         a->root, c->timeout_s);
}

static lz_status nccl_group(lz_comm *parent, lz_comm *child) {
  nccl_impl *pm = parent->impl, *m = calloc(1, sizeof *m);
  if (!m) return lz_fail(LZ_ERR_NOMEM, "nccl: out of memory");
  m->be = pm->be;
  int color = child->ranks[0];
  for (int i = 1; i < child->size; i++)
    if (child->ranks[i] < color) color = child->ranks[i];
  lz_status st = m->be->nccl_split(pm->nc, color, child->rank, child->size, &m->nc);
  if (st != LZ_OK) {
    free(m);
    return st;
  }
  child->impl = m;
  return LZ_OK;
}

const lz_comm_backend_ops lz_comm_nccl_ops = {nccl_init, nccl_free, nccl_run, nccl_group, 1};
