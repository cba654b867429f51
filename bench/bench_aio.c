/* bench_aio.c — the C side of bench/bench-aio: write then read a swap file
 * (lz_swap) end to end through one staging buffer, every request in flight at
 * once so the I/O threads always have pieces to submit. One line per figure,
 * medians of --reps passes:
 *   R lz <write|read> <bytes per second> <direct 0|1>
 *   --dir DIR (default build)  --size BYTES (default 2 GiB)  --bs BYTES (1 MiB)
 *   --qd N (8)  --threads N (1)  --single-submit  --no-overlap  --reps N (3)
 *   --small-pages  the staging buffer on 4 KiB pages (as fio's malloc'd
 *                  buffers are) instead of the ledger's huge pages: O_DIRECT
 *                  pins every page of a request, so page size shows. */
#include "luazero.h"

#include <stdio.h>  /* printf */
#include <stdlib.h>   /* atoll, qsort, posix_memalign */
#include <sys/mman.h> /* madvise(MADV_NOHUGEPAGE) for --small-pages */
#include <string.h> /* strcmp, memset */
#include <time.h>   /* clock_gettime */

#include "bench_timing.h" /* now_s, median, best */

#define MAX_REQS 4096



static int fail(const char *what) {
  fprintf(stderr, "bench_aio: %s: %s\n", what, lz_last_error());
  return 1;
}

/* One pass over the whole file; returns seconds, or < 0 on an error. */
static double pass(lz_swap *s, int is_write, char *buf, int64_t chunk, int64_t size) {
  static lz_swap_req *reqs[MAX_REQS];
  int n = 0;
  double t0 = now_s();
  for (int64_t off = 0; off < size; off += chunk) {
    int64_t len = size - off < chunk ? size - off : chunk;
    lz_status st = is_write ? lz_swap_write(s, off, buf, len, &reqs[n])
                            : lz_swap_read(s, off, buf, len, &reqs[n]);
    if (st != LZ_OK) {
      fail(is_write ? "write" : "read");
      return -1.0;
    }
    n++;
  }
  int bad = 0;
  for (int i = 0; i < n; i++) bad |= lz_swap_wait(reqs[i]) != LZ_OK;
  if (bad) {
    fail("wait");
    return -1.0;
  }
  return now_s() - t0;
}

int main(int argc, char **argv) {
  const char *dir = "build";
  int64_t size = (int64_t)2 << 30;
  int reps = 3, small_pages = 0;
  lz_swap_opts o;
  lz_swap_opts_default(&o);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int has = i + 1 < argc;
    if (!strcmp(a, "--dir") && has) dir = argv[++i];
    else if (!strcmp(a, "--size") && has) size = atoll(argv[++i]);
    else if (!strcmp(a, "--bs") && has) o.block_size = atoll(argv[++i]);
    else if (!strcmp(a, "--qd") && has) o.queue_depth = atoi(argv[++i]);
    else if (!strcmp(a, "--threads") && has) o.thread_count = atoi(argv[++i]);
    else if (!strcmp(a, "--reps") && has) reps = atoi(argv[++i]);
    else if (!strcmp(a, "--single-submit")) o.single_submit = 1;
    else if (!strcmp(a, "--no-overlap")) o.overlap_events = 0;
    else if (!strcmp(a, "--small-pages")) small_pages = 1;
    else {
      fprintf(stderr, "bench_aio: unknown argument %s (see the comment in bench/bench_aio.c)\n",
              a);
      return 2;
    }
  }
  if (reps < 1 || reps > 99 || size < 4096) {
    fprintf(stderr, "bench_aio: --reps must be 1..99 and --size at least 4096\n");
    return 2;
  }
  size = (size + 4095) / 4096 * 4096;
  /* A staging buffer of at most 256 MiB, whole blocks; requests reuse it. */
  int64_t chunk = (int64_t)256 << 20;
  if (chunk > size) chunk = size;
  if (chunk < o.block_size && size >= o.block_size) chunk = o.block_size;
  chunk = chunk / 4096 * 4096;
  if ((size + chunk - 1) / chunk > MAX_REQS) chunk = (size + MAX_REQS - 1) / MAX_REQS;
  chunk = (chunk + 4095) / 4096 * 4096;

  lz_swap *s = NULL;
  if (lz_swap_open(&s, dir, size, "bench", &o) != LZ_OK) return fail("open");
  char *buf = NULL;
  if (small_pages) {
    int rc = posix_memalign((void **)&buf, 4096, (size_t)chunk);
    if (rc != 0) {
      fprintf(stderr, "bench_aio: posix_memalign of %lld bytes: %s\n", (long long)chunk,
              strerror(rc));
      return 1;
    }
    if (madvise(buf, (size_t)chunk, MADV_NOHUGEPAGE) != 0) perror("bench_aio: madvise");
  } else if (lz_mem_alloc((void **)&buf, (size_t)chunk, LZ_MEM_OFFLOAD) != LZ_OK) {
    return fail("alloc");
  }
  memset(buf, 0x5A, (size_t)chunk);
  printf("# lz_swap: %s, %lld bytes, block %lld, queue depth %d, threads %d, direct %d, "
         "buffer on %s pages\n",
         lz_swap_path(s), (long long)size, (long long)o.block_size, o.queue_depth,
         o.thread_count, lz_swap_is_direct(s), small_pages ? "4 KiB" : "huge");
  for (int is_write = 1; is_write >= 0; is_write--) {
    double t[99];
    for (int r = 0; r < reps; r++) {
      t[r] = pass(s, is_write, buf, chunk, size);
      if (t[r] < 0) return 1;
    }
    double med = median(t, reps);
    printf("R lz %s %.6e %d\n", is_write ? "write" : "read", (double)size / med,
           lz_swap_is_direct(s));
    fflush(stdout);
  }
  if (small_pages) free(buf);
  else lz_mem_free(buf);
  if (lz_swap_close(s) != LZ_OK) return fail("close");
  return 0;
}
