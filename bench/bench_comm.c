/* bench_comm.c — one side of bench/bench-comm: times all-reduce (sum),
 * reduce-scatter, all-gather, in-place all-gather and all-to-all (the size
 * is each rank's send buffer, 1/W of it to each rank) of f32 from 4 KiB to 256 MiB on the
 * communicator it finds (shm under the launcher, mpi under mpirun) and rank 0
 * prints one line per point: "R backend ranks op bytes seconds".
 *   --raw-mpi   OpenMPI's own MPI_Allreduce / MPI_Reduce_scatter_block /
 *               MPI_Allgather / MPI_Alltoall instead of luazero's backends (run under mpirun)
 *   --memcpy    single-thread memcpy of the same sizes (the ceiling), and
 *               single-thread process_vm_readv from another process (the
 *               ceiling of one cross-memory-attach copy, which both shm's
 *               single-copy path and OpenMPI's vader BTL use)
 *   --max BYTES the largest size (default 256 MiB)
 *   --min BYTES the smallest size (default 4 KiB)
 *   --only OP   that operation alone (all_reduce, ..., all_to_all)
 * After each all-to-all batch every rank memcpys its n bytes at once, the
 * same number of times: rank 0 prints "P backend ranks all_to_all bytes
 * ratio", the median over the batches of that copy's time over the
 * all-to-all's (paired in time, so a busy machine's swings cancel). */
#define _GNU_SOURCE /* process_vm_readv */
#include "luazero.h"

#include <mpi.h>      /* --raw-mpi */
#include <stdio.h>    /* printf */
#include <stdlib.h>   /* atoll */
#include <string.h>   /* memcpy */
#include <sys/uio.h>  /* process_vm_readv */
#include <sys/wait.h> /* waitpid */
#include <time.h>     /* clock_gettime */
#include <unistd.h>   /* fork, getppid */

#include "bench_timing.h" /* now_s, median, best */


/* Timed batches per point; the best is reported (this kind of machine is noisy). */
#define BATCHES 3

static size_t min_bytes = 4096;
static const char *only; /* NULL: every operation */

static int iters_for(size_t bytes) {
  size_t it = ((size_t)1536 << 20) / bytes;
  return it < 6 ? 6 : it > 300 ? 300 : (int)it;
}

/* all_gather_in_place: the send buffer is this rank's shard of the receive
 * buffer (MPI_IN_PLACE; how the ZeRO engine gathers parameters). */
#define NOPS 5
static const char *op_names[NOPS] = {"all_reduce", "reduce_scatter", "all_gather",
                                     "all_gather_in_place", "all_to_all"};

static int run_memcpy(size_t max) {
  void *a, *b;
  if (lz_mem_alloc(&a, max, LZ_MEM_WORKSPACE) || lz_mem_alloc(&b, max, LZ_MEM_WORKSPACE)) return 1;
  memset(a, 1, max);
  memset(b, 2, max);
  for (size_t n = 4096; n <= max; n *= 4) {
    int it = iters_for(n);
    memcpy(b, a, n);
    double best = 1e30;
    for (int batch = 0; batch < BATCHES; batch++) {
      double t0 = now_s();
      for (int i = 0; i < it; i++) memcpy(b, a, n);
      double t = (now_s() - t0) / it;
      if (t < best) best = t;
    }
    printf("R memcpy 1 memcpy %zu %.9f\n", n, best);
  }
  /* A child reads the parent's buffer (a parent may always be read by its
   * child under Yama's ptrace_scope 1). */
  pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    pid_t parent = getppid();
    void *dst; /* fresh huge pages: b here would be copy-on-write 4 KiB pages */
    if (lz_mem_alloc(&dst, max, LZ_MEM_WORKSPACE)) _exit(1);
    memset(dst, 3, max);
    for (size_t n = 4096; n <= max; n *= 4) {
      int it = iters_for(n);
      double best = 1e30;
      for (int batch = 0; batch <= BATCHES; batch++) { /* batch 0 warms up */
        double t0 = now_s();
        for (int i = 0; i < it; i++) {
          struct iovec l = {dst, n}, r = {a, n};
          if (process_vm_readv(parent, &l, 1, &r, 1, 0) != (ssize_t)n) _exit(0); /* no CMA here */
        }
        double t = (now_s() - t0) / it;
        if (batch && t < best) best = t;
      }
      printf("R cma 1 cma %zu %.9f\n", n, best);
    }
    _exit(0);
  }
  int st;
  waitpid(child, &st, 0);
  return 0;
}

/* The send and receive buffers of max bytes each, zeroed; nonzero when the
 * ledger refuses them. */
static int two_buffers(float **a, float **b, size_t max) {
  if (lz_mem_alloc((void **)a, max, LZ_MEM_COMM) || lz_mem_alloc((void **)b, max, LZ_MEM_COMM))
    return 1;
  memset(*a, 0, max);
  memset(*b, 0, max);
  return 0;
}

static int run_raw_mpi(size_t max) {
  MPI_Init(NULL, NULL);
  int rank, W;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  float *a, *b;
  if (two_buffers(&a, &b, max)) return 1;
  for (size_t n = min_bytes; n <= max; n *= 4) {
    int count = (int)(n / 4), shard = count / W;
    for (int op = 0; op < NOPS; op++) {
      if (only && strcmp(only, op_names[op])) continue;
      int it = (iters_for(n) + BATCHES - 1) / BATCHES;
      double best = 1e30;
      for (int batch = 0; batch < BATCHES; batch++) {
        double t0 = 0;
        for (int i = batch ? 0 : -1; i < it; i++) {
          if (i == 0) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = now_s();
          }
          if (op == 0) MPI_Allreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          else if (op == 1)
            MPI_Reduce_scatter_block(a, b, shard, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          else if (op == 2) MPI_Allgather(a, shard, MPI_FLOAT, b, shard, MPI_FLOAT, MPI_COMM_WORLD);
          else if (op == 4) MPI_Alltoall(a, shard, MPI_FLOAT, b, shard, MPI_FLOAT, MPI_COMM_WORLD);
          else
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, b, shard, MPI_FLOAT, MPI_COMM_WORLD);
        }
        double t = (now_s() - t0) / it, tmax;
        MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (tmax < best) best = tmax;
      }
      if (rank == 0) printf("R ompi %d %s %zu %.9f\n", W, op_names[op], n, best);
    }
  }
  MPI_Finalize();
  return 0;
}

static int run_luazero(size_t max) {
  lz_comm *c;
  if (lz_comm_init(&c, LZ_COMM_AUTO) != LZ_OK) {
    fprintf(stderr, "bench_comm: %s\n", lz_last_error());
    return 1;
  }
  int rank = lz_comm_rank(c), W = lz_comm_size(c);
  float *a, *b;
  if (two_buffers(&a, &b, max)) return 1;
  for (size_t n = min_bytes; n <= max; n *= 4) {
    int64_t count = (int64_t)(n / 4), off, len;
    lz_comm_shard(count, W, rank, &off, &len);
    for (int op = 0; op < NOPS; op++) {
      if (only && strcmp(only, op_names[op])) continue;
      int it = (iters_for(n) + BATCHES - 1) / BATCHES;
      float best = 1e30f;
      double ratios[BATCHES]; /* all-to-all: time over the ranks' memcpy beside it */
      for (int batch = 0; batch < BATCHES; batch++) {
        double t0 = 0;
        lz_status st = LZ_OK;
        for (int i = batch ? 0 : -1; i < it && st == LZ_OK; i++) {
          if (i == 0) {
            lz_comm_barrier(c);
            t0 = now_s();
          }
          if (op == 0) st = lz_comm_all_reduce(c, a, count, LZ_F32, LZ_RED_SUM, NULL);
          else if (op == 1) st = lz_comm_reduce_scatter(c, a, b, count, LZ_F32, LZ_RED_SUM, NULL);
          else if (op == 2) st = lz_comm_all_gather(c, a + off, b, count, LZ_F32, NULL);
          else if (op == 4) st = lz_comm_all_to_all(c, a, b, count / W, LZ_F32, NULL);
          else st = lz_comm_all_gather(c, b + off, b, count, LZ_F32, NULL);
        }
        float t = (float)((now_s() - t0) / it);
        if (st != LZ_OK || lz_comm_all_reduce(c, &t, 1, LZ_F32, LZ_RED_MAX, NULL) != LZ_OK) {
          fprintf(stderr, "bench_comm: %s\n", lz_last_error());
          return 1;
        }
        if (t < best) best = t;
        if (op == 4) { /* every rank copies its n bytes at once: the ceiling of a copy-once exchange */
          lz_comm_barrier(c);
          double c0 = now_s();
          for (int i = 0; i < it; i++) memcpy(b, a, n);
          float tc = (float)((now_s() - c0) / it);
          if (lz_comm_all_reduce(c, &tc, 1, LZ_F32, LZ_RED_MAX, NULL) != LZ_OK) {
            fprintf(stderr, "bench_comm: %s\n", lz_last_error());
            return 1;
          }
          ratios[batch] = (double)tc / (double)t;
        }
      }
      if (rank == 0)
        printf("R %s %d %s %zu %.9f\n", lz_comm_backend_name(c), W, op_names[op], n, (double)best);
      if (rank == 0 && op == 4)
        printf("P %s %d %s %zu %.3f\n", lz_comm_backend_name(c), W, op_names[op], n,
               median(ratios, BATCHES));
    }
  }
  lz_mem_free(a);
  lz_mem_free(b);
  lz_comm_free(c);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int raw = 0, mcp = 0;
  size_t max = (size_t)256 << 20;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--raw-mpi")) raw = 1;
    else if (!strcmp(argv[i], "--memcpy")) mcp = 1;
    else if (!strcmp(argv[i], "--max") && i + 1 < argc) max = (size_t)atoll(argv[++i]);
    else if (!strcmp(argv[i], "--min") && i + 1 < argc) min_bytes = (size_t)atoll(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      printf("usage: lz_run -n N bench_comm [--raw-mpi] [--max BYTES] [--min BYTES] [--only OP]\n"
             "       bench_comm --memcpy [--max BYTES]\n(bench/bench-comm runs it; its header "
             "says what it prints)\n");
      return 0;
    } else {
      fprintf(stderr, "bench_comm: unknown argument %s (--help)\n", argv[i]);
      return 2;
    }
  }
  if (max < 4096) max = 4096;
  if (mcp) return run_memcpy(max);
  if (raw) return run_raw_mpi(max);
  return run_luazero(max);
}
