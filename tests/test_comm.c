/* test_comm.c — the communicator on one rank (local backend): shard math,
 * copies, the asynchronous queue, byte counters, argument and environment
 * errors; and the launcher on small shell jobs (environment, a killed rank,
 * a missing program, no segment left behind). The multi-rank matrix is
 * tests/comm/run.sh. */
#include "lz_test.h"

#include <dirent.h>   /* scanning /dev/shm for leftovers */
#include <stdint.h>   /* uint16_t */
#include <stdlib.h>   /* setenv, unsetenv */
#include <time.h>     /* clock_gettime */
#include <unistd.h>   /* getpid */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A process outside any launcher, whatever ran this test. */
static void clear_env(void) {
  const char *vars[] = {"LZ_BACKEND", "LZ_SHM_NAME", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                        "WORLD_SIZE", "RANK", "LZ_COMM_TIMEOUT", NULL};
  for (int i = 0; vars[i]; i++) unsetenv(vars[i]);
}

/* A communicator of `kind` outside any launcher; NULL (a failure recorded)
 * when it cannot be made. */
static lz_comm *fresh_comm(lz_comm_backend kind) {
  clear_env();
  lz_comm *c = NULL;
  CHECK_OK(lz_comm_init(&c, kind));
  return c;
}

static int shm_leftovers(void) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "luazero-%d-", (int)getpid());
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
  closedir(d);
  return n;
}

LZ_TEST(comm_shard_covers_the_count_in_order) {
  int64_t counts[] = {0, 1, 7, 4097, 1000003};
  for (int ci = 0; ci < 5; ci++)
    for (int size = 1; size <= 8; size++) {
      int64_t next = 0, c = counts[ci];
      for (int r = 0; r < size; r++) {
        int64_t off, len;
        lz_comm_shard(c, size, r, &off, &len);
        CHECK_EQ_INT(off, next);
        CHECK_EQ_INT(len, c / size + (r < c % size ? 1 : 0));
        next = off + len;
      }
      CHECK_EQ_INT(next, c);
    }
  int64_t off, len;
  lz_comm_shard(10, 4, 7, &off, &len); /* not a rank: empty */
  CHECK_EQ_INT(len, 0);
}

LZ_TEST(comm_local_ops_copy_and_count_nothing) {
  lz_comm *c = fresh_comm(LZ_COMM_AUTO);
  if (!c) return;
  CHECK(!strcmp(lz_comm_backend_name(c), "local"));
  CHECK_EQ_INT(lz_comm_rank(c), 0);
  CHECK_EQ_INT(lz_comm_size(c), 1);
  float a[7] = {1, 2, 3, 4, 5, 6, 7}, b[7] = {0};
  uint16_t h[7] = {0x3f80, 0x4000, 0x4040, 0x4080, 0xbf80, 0, 0x7f80};
  CHECK_OK(lz_comm_all_reduce(c, a, 7, LZ_F32, LZ_RED_AVG, NULL));
  CHECK(a[6] == 7.0f);
  CHECK_OK(lz_comm_all_reduce(c, h, 7, LZ_BF16, LZ_RED_SUM, NULL));
  CHECK_EQ_INT(h[4], 0xbf80);
  CHECK_OK(lz_comm_reduce_scatter(c, a, b, 7, LZ_F32, LZ_RED_SUM, NULL));
  CHECK(b[0] == 1.0f && b[6] == 7.0f);
  memset(b, 0, sizeof b);
  CHECK_OK(lz_comm_all_gather(c, a, b, 7, LZ_F32, NULL));
  CHECK(b[3] == 4.0f);
  CHECK_OK(lz_comm_broadcast(c, a, 7, LZ_F32, 0, NULL));
  CHECK_OK(lz_comm_all_reduce(c, NULL, 0, LZ_F16, LZ_RED_MAX, NULL)); /* empty is fine */
  CHECK_OK(lz_comm_barrier(c));
  for (int k = 0; k < LZ_COLL_COUNT; k++) CHECK_EQ_INT(lz_comm_bytes(c, (lz_coll_kind)k), 0);
  CHECK(!strcmp(lz_coll_kind_name(LZ_COLL_REDUCE_SCATTER), "reduce_scatter"));
  CHECK_OK(lz_comm_free(c));
}

LZ_TEST(comm_async_work_runs_in_order) {
  lz_comm *c = fresh_comm(LZ_COMM_LOCAL);
  if (!c) return;
  enum { N = 16, LEN = 1000 };
  static float src[N][LEN], dst[N][LEN];
  lz_work *w[N];
  for (int i = 0; i < N; i++)
    for (int j = 0; j < LEN; j++) src[i][j] = (float)(i * LEN + j);
  for (int i = 0; i < N; i++) {
    CHECK_OK(lz_comm_all_gather(c, src[i], dst[i], LEN, LZ_F32, &w[i]));
    if (i == N / 2) CHECK_OK(lz_comm_barrier(c)); /* a blocking call queues behind them */
  }
  int done = 0;
  for (int spins = 0; !done && spins < 1000000; spins++) CHECK_OK(lz_work_test(w[N - 1], &done));
  CHECK(done);
  for (int i = 0; i < N; i++) CHECK_OK(lz_work_wait(w[i]));
  for (int i = 0; i < N; i++) CHECK(dst[i][LEN - 1] == (float)(i * LEN + LEN - 1));
  CHECK_OK(lz_comm_free(c));
}

LZ_TEST(comm_bad_arguments_are_named) {
  lz_comm *c = fresh_comm(LZ_COMM_LOCAL);
  if (!c) return;
  int32_t x[4] = {0};
  float f[4] = {0};
  CHECK_ERR(lz_comm_all_reduce(c, x, 4, LZ_I32, LZ_RED_SUM, NULL), LZ_ERR_INVALID, "dtype i32");
  CHECK_ERR(lz_comm_all_reduce(c, f, -1, LZ_F32, LZ_RED_SUM, NULL), LZ_ERR_INVALID, "count is -1");
  CHECK_ERR(lz_comm_all_reduce(c, f, 4, LZ_F32, (lz_reduce_op)9, NULL), LZ_ERR_INVALID, "reduce op 9");
  CHECK_ERR(lz_comm_broadcast(c, f, 4, LZ_F32, 1, NULL), LZ_ERR_INVALID, "root 1");
  CHECK_ERR(lz_comm_all_gather(c, NULL, f, 4, LZ_F32, NULL), LZ_ERR_INVALID, "send buffer");
  float g[8] = {0};
  CHECK_ERR(lz_comm_all_gather(c, g + 1, g, 4, LZ_F32, NULL), LZ_ERR_INVALID, "overlap");
  CHECK_ERR(lz_comm_reduce_scatter(c, g, g + 2, 4, LZ_F32, LZ_RED_SUM, NULL), LZ_ERR_INVALID,
            "only in place");
  CHECK_OK(lz_comm_all_gather(c, g, g, 4, LZ_F32, NULL));           /* in place */
  CHECK_OK(lz_comm_reduce_scatter(c, g, g, 4, LZ_F32, LZ_RED_SUM, NULL)); /* in place */
  CHECK_OK(lz_comm_all_gather(c, g + 4, g, 4, LZ_F32, NULL));       /* touching, not overlapping */
  CHECK_OK(lz_comm_broadcast(c, x, 4, LZ_I32, 0, NULL)); /* copies take any dtype */
  CHECK_OK(lz_comm_free(c));
}

LZ_TEST(comm_local_all_to_all_and_groups) {
  lz_comm *c = fresh_comm(LZ_COMM_LOCAL);
  if (!c) return;
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {0};
  CHECK_OK(lz_comm_all_to_all(c, a, b, 6, LZ_F32, NULL));
  CHECK(b[0] == 1.0f && b[5] == 6.0f);
  /* Per-peer counts and offsets: 2 elements from a + 3 to b + 1. */
  int64_t sc[1] = {2}, so[1] = {3}, rc[1] = {2}, ro[1] = {1};
  memset(b, 0, sizeof b);
  lz_work *w = NULL;
  CHECK_OK(lz_comm_all_to_all_v(c, a, sc, so, b, rc, ro, LZ_F32, &w));
  sc[0] = 99; /* the call copied the counts */
  CHECK_OK(lz_work_wait(w));
  CHECK(b[0] == 0.0f && b[1] == 4.0f && b[2] == 5.0f && b[3] == 0.0f);
  CHECK_EQ_INT(lz_comm_bytes(c, LZ_COLL_ALL_TO_ALL), 0); /* nothing left the rank */
  CHECK(!strcmp(lz_coll_kind_name(LZ_COLL_ALL_TO_ALL), "all_to_all"));
  sc[0] = 2;
  rc[0] = 3;
  CHECK_ERR(lz_comm_all_to_all_v(c, a, sc, so, b, rc, ro, LZ_F32, NULL), LZ_ERR_INVALID,
            "rank 0 sends 2 elements to rank 0, which expects 3");
  lz_comm_free(c);
  c = fresh_comm(LZ_COMM_LOCAL);
  if (!c) return;
  int64_t neg[1] = {-1};
  CHECK_ERR(lz_comm_all_to_all_v(c, a, neg, so, b, rc, ro, LZ_F32, NULL), LZ_ERR_INVALID,
            "send_counts[0] is -1");
  CHECK_ERR(lz_comm_all_to_all_v(c, a, sc, NULL, b, rc, ro, LZ_F32, NULL), LZ_ERR_INVALID,
            "count or offset array is NULL");
  CHECK_ERR(lz_comm_all_to_all(c, a, b, -2, LZ_F32, NULL), LZ_ERR_INVALID, "count is -2");
  /* Groups of the one rank. */
  int me[1] = {0}, bad[2] = {0, 0}, out[1] = {1};
  lz_comm *g = NULL;
  CHECK_ERR(lz_comm_group_new(c, bad, 2, &g), LZ_ERR_INVALID, "the list has 2 ranks");
  CHECK_ERR(lz_comm_group_new(c, out, 1, &g), LZ_ERR_INVALID, "ranks[0] is 1");
  CHECK_ERR(lz_comm_group_new(c, me, 0, &g), LZ_ERR_INVALID, "give 1..1 ranks");
  CHECK(g == NULL);
  CHECK_OK(lz_comm_group_new(c, me, 1, &g));
  CHECK_EQ_INT(lz_comm_size(g), 1);
  CHECK_EQ_INT(lz_comm_parent_rank(g, 0), 0);
  memset(b, 0, sizeof b);
  CHECK_OK(lz_comm_all_gather(g, a, b, 6, LZ_F32, NULL));
  CHECK(b[5] == 6.0f);
  CHECK_OK(lz_comm_free(g));
  CHECK_OK(lz_comm_barrier(c)); /* the parent is still usable */
  CHECK_OK(lz_comm_free(c));
}

LZ_TEST(comm_environment_errors_name_the_fix) {
  clear_env();
  lz_comm *c = NULL;
  setenv("LZ_BACKEND", "carrier-pigeon", 1);
  CHECK_ERR(lz_comm_init(&c, LZ_COMM_AUTO), LZ_ERR_INVALID, "LZ_BACKEND");
  unsetenv("LZ_BACKEND");
  /* nccl without a GPU: the cuda error, prefixed with the backend; in a
   * build without nvcc, the table's refusal. With a GPU, a world of 1 works. */
  int nccl_built = 0;
  for (int i = 0; i < lz_comm_backend_count(); i++)
    if (!strcmp(lz_comm_backend_name_at(i), "nccl")) nccl_built = lz_comm_backend_available_at(i);
  lz_status st = lz_comm_init(&c, LZ_COMM_NCCL);
  if (st == LZ_OK) {
    CHECK_EQ_INT(lz_comm_size(c), 1);
    CHECK_OK(lz_comm_free(c));
    c = NULL;
  } else {
    CHECK_EQ_INT(st, LZ_ERR_UNSUPPORTED);
    CHECK(strstr(lz_last_error(), nccl_built ? "nccl: rank 0 needs GPU 0: cuda: "
                                             : "comm: the nccl backend is not in this build") !=
          NULL);
    if (nccl_built) {
      CHECK(strstr(lz_last_error(), "without one use --backend shm (one machine) or mpi"));
      CHECK(!strstr(lz_last_error(), "--device cpu"));
    }
  }
  setenv("WORLD_SIZE", "2", 1);
  CHECK_ERR(lz_comm_init(&c, LZ_COMM_AUTO), LZ_ERR_INVALID, "luazero -n 2");
  unsetenv("WORLD_SIZE");
  CHECK_ERR(lz_comm_init(&c, LZ_COMM_SHM), LZ_ERR_INVALID, "LZ_SHM_NAME");
  setenv("LZ_COMM_TIMEOUT", "soon", 1);
  CHECK_ERR(lz_comm_init(&c, LZ_COMM_LOCAL), LZ_ERR_INVALID, "LZ_COMM_TIMEOUT");
  unsetenv("LZ_COMM_TIMEOUT");
  CHECK(c == NULL);
}

LZ_TEST(launch_sets_the_torchrun_environment) {
  clear_env();
  char *argv[] = {"/bin/sh", "-c",
                  "test \"$WORLD_SIZE\" = 3 && test \"$LOCAL_WORLD_SIZE\" = 3 && "
                  "test \"$LOCAL_RANK\" = \"$RANK\" && test \"$RANK\" -lt 3 && "
                  "test -n \"$MASTER_ADDR\" && test -n \"$MASTER_PORT\" && "
                  "test -n \"$OMP_NUM_THREADS\" && test -e \"/proc/$LZ_LAUNCHER_PID/fd/$LZ_SHM_FD\"",
                  NULL};
  int code = -1;
  CHECK_OK(lz_launch(3, argv, &code));
  CHECK_EQ_INT(code, 0);
  CHECK_EQ_INT(shm_leftovers(), 0);
}

LZ_TEST(launch_stops_the_job_when_a_rank_is_killed) {
  clear_env();
  setenv("LZ_RANK_OUTPUT", "quiet", 1);
  char *argv[] = {"/bin/sh", "-c", "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 30", NULL};
  int code = -1;
  double t0 = now_s();
  CHECK_OK(lz_launch(3, argv, &code));
  CHECK_EQ_INT(code, 128 + 9);
  CHECK(now_s() - t0 < 10);
  CHECK_EQ_INT(shm_leftovers(), 0);
  char *missing[] = {"/nonexistent/program", NULL};
  CHECK_OK(lz_launch(2, missing, &code));
  CHECK_EQ_INT(code, 127);
  unsetenv("LZ_RANK_OUTPUT");
  CHECK_ERR(lz_launch(0, argv, &code), LZ_ERR_INVALID, "-n 0");
  CHECK_EQ_INT(shm_leftovers(), 0);
}

LZ_TEST(launch_refuses_more_ranks_than_the_machine_runs) {
  clear_env();
  char *argv[] = {"/bin/true", NULL};
  int code = -1;
  CHECK_ERR(lz_launch(4097, argv, &code), LZ_ERR_INVALID,
            "-n 4097: the number of ranks must be 1..4096");
  /* 4096 ranks need 512 cores and 256 GiB available: more than these tests run on. */
  CHECK_ERR(lz_launch(4096, argv, &code), LZ_ERR_INVALID, "-n 4096: at most ");
  CHECK_EQ_INT(code, 1);
  CHECK_EQ_INT(shm_leftovers(), 0);
}
