/* comm_shm_group.c — a sub-group's own segment, so that disjoint groups run
 * collectives at the same time without sharing arrival counters or banks.
 * The group's first rank makes a memfd of the segment's layout for the
 * group's size; the parent's ranks all-gather its pid and descriptor; the
 * members open it through /proc/<pid>/fd/<fd> (it has no name, as the
 * launcher's has none) and all-gather whether that worked, so that a failure
 * anywhere fails every rank at once; then the first rank may close its
 * descriptor, and the members join the segment as they join the launcher's. */
#define _GNU_SOURCE /* memfd_create */
#include "comm/comm_shm.h"

#include <errno.h>    /* errno of memfd_create, open */
#include <fcntl.h>    /* open */
#include <stdio.h>    /* snprintf */
#include <stdlib.h>   /* malloc */
#include <sys/mman.h> /* memfd_create, mmap */
#include <unistd.h>   /* ftruncate, getpid, close */

/* The leader's new segment, formatted for n ranks; -1 and the error set on failure. */
static int make_segment(int n) {
  int fd = memfd_create("luazero-group", MFD_CLOEXEC);
  if (fd < 0) {
    lz_fail(LZ_ERR_IO, "comm_group: memfd_create: %s", strerror(errno));
    return -1;
  }
  size_t bytes = lz_shm_segment_bytes(n);
  void *base = ftruncate(fd, (off_t)bytes) == 0
                   ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  if (base == MAP_FAILED) {
    lz_fail(LZ_ERR_IO, "comm_group: sizing the group's segment (%zu bytes): %s", bytes,
            strerror(errno));
    close(fd);
    return -1;
  }
  lz_shm_segment_format(base, n);
  munmap(base, bytes);
  return fd;
}

/* One all-gather of `k` int32 per parent rank, on the parent. */
static lz_status gather(lz_comm *parent, const int32_t *mine, int32_t *all, int k) {
  lz_coll_args g = {LZ_COLL_ALL_GATHER, mine, all, (int64_t)k * parent->size, LZ_I32,
                    LZ_RED_SUM, 0, 0, 0, NULL, NULL, 0};
  return parent->ops->run(parent, &g);
}

lz_status shm_group(lz_comm *parent, lz_comm *child) {
  shm_comm *ps = parent->impl;
  int W = parent->size, me = parent->rank, n = child->size, leader = child->ranks[0];
  int32_t *all = malloc(sizeof *all * 2 * (size_t)W);
  int *launcher_rank = malloc(sizeof *launcher_rank * (size_t)n);
  if (!all || !launcher_rank) {
    free(all);
    free(launcher_rank);
    return lz_fail(LZ_ERR_NOMEM, "comm_group: out of memory");
  }
  for (int i = 0; i < n; i++) launcher_rank[i] = shm_launcher_rank(ps, child->ranks[i]);
  char why[1024] = "";
  int fd = -1;
  if (me == leader && (fd = make_segment(n)) < 0) snprintf(why, sizeof why, "%s", lz_last_error());
  int32_t id[2] = {me == leader ? (int32_t)getpid() : 0, fd};
  lz_status st = gather(parent, id, all, 2);
  int lpid = all[2 * leader], lfd = all[2 * leader + 1];
  if (st == LZ_OK && me != leader && lfd >= 0) {
    char path[96];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", lpid, lfd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
      snprintf(why, sizeof why, "comm_group: rank %d cannot open its group's segment through %s: %s",
               me, path, strerror(errno));
  }
  if (st == LZ_OK) { /* did every rank get its group's segment? */
    int32_t ok = fd >= 0;
    st = gather(parent, &ok, all, 1);
    for (int p = 0; st == LZ_OK && p < W; p++)
      if (!all[p])
        st = why[0] ? lz_fail(LZ_ERR_IO, "%s", why)
                    : lz_fail(LZ_ERR_IO, "comm_group: rank %d could not %s its group's segment "
                              "(its own error says why)", p, p == leader ? "make" : "open");
  }
  free(all);
  if (st != LZ_OK) {
    if (fd >= 0) close(fd);
    free(launcher_rank);
    return st;
  }
  char name[300];
  snprintf(name, sizeof name, "%.200s group of rank %d", ps->name, leader);
  return shm_attach(child, fd, name, child->rank, n, launcher_rank);
}
