/* shard_job.c — a shard written by a thread of its own, so a save does not
 * stop training: the caller hands it a snapshot of its states (raw bytes in
 * the shard's order, docs/checkpoints.md), polls it at step boundaries and
 * joins it. The thread runs the ordinary shard writer (checkpoint.c: zstd,
 * both checksums, the header last, fsync), fed in the caller's piece size,
 * so its file is byte for byte the one a synchronous save writes. It runs
 * at the lowest CPU priority (nice 19, inherited by zstd's workers): on a
 * busy CPU training goes first, on an idle one the writer takes it all.
 * A join that has to wait gives the job's threads the process's priority
 * back (where the system lets it: lowering a nice value needs privilege),
 * so the waiting caller does not wait behind other processes.
 * No Lua here: the snapshot stays the caller's until the job is joined. */
#define _GNU_SOURCE /* gettid */
#include "mem/lz_internal.h"

#include <dirent.h>       /* /proc/self/task: the job's threads, zstd's workers among them */
#include <pthread.h>      /* pthread_create, pthread_join */
#include <stdatomic.h>    /* the done flag, read without a lock */
#include <stdio.h>        /* snprintf */
#include <stdlib.h>       /* calloc */
#include <sys/resource.h> /* setpriority */
#include <unistd.h>       /* gettid */

#define JOB_NICE 19 /* the lowest CPU priority */

struct lz_shard_job {
  pthread_t thread;
  char path[4096];
  const unsigned char *data;
  size_t bytes, piece;
  int level, workers;
  lz_status status;
  lz_shard_info info;
  char error[1024]; /* the thread's lz_last_error, carried to the joiner */
  atomic_int done;
};

static void *job_run(void *arg) {
  lz_shard_job *j = arg;
  setpriority(PRIO_PROCESS, (id_t)gettid(), JOB_NICE); /* a refusal only costs speed */
  lz_shard_writer *w = NULL;
  lz_status st = lz_shard_writer_open(&w, j->path, j->level, j->workers);
  for (size_t at = 0; st == LZ_OK && at < j->bytes; at += j->piece) {
    size_t n = j->bytes - at < j->piece ? j->bytes - at : j->piece;
    st = lz_shard_writer_write(w, j->data + at, n);
  }
  if (st == LZ_OK) {
    st = lz_shard_writer_close(w, &j->info);
  } else if (w) {
    lz_shard_writer_abort(w);
  }
  j->status = st;
  if (st != LZ_OK) snprintf(j->error, sizeof j->error, "%s", lz_last_error());
  atomic_store(&j->done, 1);
  return NULL;
}

lz_status lz_shard_job_start(lz_shard_job **out, const char *path, const void *data, size_t bytes,
                             size_t piece, int level, int workers) {
  *out = NULL;
  if (piece == 0)
    return lz_fail(LZ_ERR_INVALID, "checkpoint: a shard job's piece size must be > 0");
  lz_shard_job *j = calloc(1, sizeof *j);
  if (!j) return lz_fail(LZ_ERR_NOMEM, "checkpoint: out of memory for a shard job");
  snprintf(j->path, sizeof j->path, "%s", path);
  j->data = data;
  j->bytes = bytes;
  j->piece = piece;
  j->level = level;
  j->workers = workers;
  atomic_init(&j->done, 0);
  int rc = pthread_create(&j->thread, NULL, job_run, j);
  if (rc != 0) {
    free(j);
    return lz_fail(LZ_ERR_INTERNAL, "checkpoint: cannot start a writer thread for %s (%s)", path,
                   strerror(rc));
  }
  *out = j;
  return LZ_OK;
}

int lz_shard_job_done(const lz_shard_job *j) { return atomic_load((atomic_int *)&j->done); }

/* The threads at the job's nice value (the writer and the zstd workers it
 * started) get the process's own back. */
static void job_hurry(void) {
  int own = getpriority(PRIO_PROCESS, 0);
  if (own >= JOB_NICE) return;
  DIR *d = opendir("/proc/self/task");
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    id_t tid = (id_t)strtol(e->d_name, NULL, 10);
    if (tid > 0 && getpriority(PRIO_PROCESS, tid) == JOB_NICE)
      setpriority(PRIO_PROCESS, tid, own); /* refused without privilege: only slower */
  }
  closedir(d);
}

lz_status lz_shard_job_join(lz_shard_job *j, lz_shard_info *info) {
  if (!j) return LZ_OK;
  if (!atomic_load(&j->done)) job_hurry();
  pthread_join(j->thread, NULL);
  lz_status st = j->status;
  if (st == LZ_OK && info) *info = j->info;
  if (st != LZ_OK) lz_fail(st, "%s", j->error);
  free(j);
  return st;
}
