/* test_swap.c — the NVMe tier's swap file: bitwise round trips through libaio
 * under every aio setting, requests really in flight, alignment and option
 * errors, directories that cannot hold a swap file, the file unlinked at
 * open, the buffered fallback where O_DIRECT is refused, and I/O errors
 * (EFBIG under RLIMIT_FSIZE) naming the file and the offset. */
#define _GNU_SOURCE /* O_DIRECT, unshare */
#include "lz_test.h"

#include <dirent.h>       /* opendir: the scratch folder stays empty */
#include <errno.h>        /* errno */
#include <fcntl.h>        /* open for the O_DIRECT probe */
#include <sched.h>        /* unshare(CLONE_NEWNS) for the ramfs mount */
#include <signal.h>       /* SIGXFSZ */
#include <stdlib.h>       /* mkdtemp, free */
#include <sys/mount.h>    /* mount ramfs */
#include <sys/resource.h> /* setrlimit(RLIMIT_FSIZE) */
#include <sys/stat.h>     /* stat */
#include <sys/wait.h>     /* waitpid */
#include <unistd.h>       /* fork, rmdir, readlink */

#define KIB 1024
#define MIB (1024 * 1024)

static uint64_t rng = 0xD1B54A32D192ED03ull;

/* A fresh folder under $TMPDIR (default /tmp: the work disk). */
static void scratch_dir(char *buf, size_t len) {
  const char *tmp = getenv("TMPDIR");
  snprintf(buf, len, "%s/lz-swap-test-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(buf)) lz_test_fail(__FILE__, __LINE__, "mkdtemp %s: %s", buf, strerror(errno));
}

static int dir_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  return n;
}

/* Swap files of this process in dir (other files may live there: /dev/shm). */
static int swap_entries(const char *dir) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "luazero-swap-%d-", (int)getpid());
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  closedir(d);
  return n;
}

/* Whether the file system under dir takes O_DIRECT, asked independently. */
static int probe_direct(const char *dir) {
  char path[512];
  snprintf(path, sizeof path, "%s/lz-probe-direct-%d", dir, (int)getpid());
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
  int ok = fd >= 0;
  if (fd >= 0) close(fd);
  unlink(path);
  return ok;
}

static void *offload_buf(size_t bytes) {
  void *p = NULL;
  CHECK_OK(lz_mem_alloc(&p, bytes, LZ_MEM_OFFLOAD));
  return p;
}

static void fill_random(void *buf, size_t bytes) {
  uint64_t *w = buf;
  for (size_t i = 0; i < bytes / 8; i++) w[i] = lz_test_xorshift(&rng);
}

/* Cuts [0, bytes) into pieces of 1..max_pages pages (so most are not a
 * multiple of the block size). Returns how many. */
static int random_segments(int64_t bytes, int max_pages, int64_t *off, int64_t *len, int cap) {
  int n = 0;
  for (int64_t o = 0; o < bytes && n < cap; n++) {
    int64_t l = (int64_t)(1 + lz_test_xorshift(&rng) % (uint64_t)max_pages) * 4096;
    if (l > bytes - o) l = bytes - o;
    off[n] = o, len[n] = l;
    o += l;
  }
  return n;
}

/* Writes `bytes` of random data as many requests all in flight at once, reads
 * it back cut differently (also all in flight), compares bitwise. */
static void round_trip(const char *dir, const lz_swap_opts *o, int64_t bytes) {
  lz_swap *s = NULL;
  CHECK_OK(lz_swap_open(&s, dir, bytes, "optimizer", o));
  if (!s) return;
  CHECK_EQ_INT(lz_swap_size(s), bytes);
  char *src = offload_buf((size_t)bytes), *dst = offload_buf((size_t)bytes);
  fill_random(src, (size_t)bytes);
  memset(dst, 0xAB, (size_t)bytes);
  enum { CAP = 512 };
  int64_t off[CAP], len[CAP];
  lz_swap_req *req[CAP];
  int n = random_segments(bytes, 40, off, len, CAP);
  /* In shuffled order: requests complete in any order anyway. */
  for (int i = n - 1; i > 0; i--) {
    int j = (int)(lz_test_xorshift(&rng) % (uint64_t)(i + 1));
    int64_t t = off[i];
    off[i] = off[j], off[j] = t;
    t = len[i], len[i] = len[j], len[j] = t;
  }
  for (int i = 0; i < n; i++) CHECK_OK(lz_swap_write(s, off[i], src + off[i], len[i], &req[i]));
  for (int i = 0; i < n; i++) CHECK_OK(lz_swap_wait(req[i]));
  CHECK_EQ_INT(lz_swap_bytes_written(s), bytes);
  n = random_segments(bytes, 70, off, len, CAP);
  for (int i = 0; i < n; i++) CHECK_OK(lz_swap_read(s, off[i], dst + off[i], len[i], &req[i]));
  for (int i = n - 1; i >= 0; i--) CHECK_OK(lz_swap_wait(req[i]));
  CHECK_EQ_INT(lz_swap_bytes_read(s), bytes);
  CHECK(memcmp(src, dst, (size_t)bytes) == 0);
  /* Blocking calls, one whole-file read. */
  memset(dst, 0, (size_t)bytes);
  CHECK_OK(lz_swap_read(s, 0, dst, bytes, NULL));
  CHECK(memcmp(src, dst, (size_t)bytes) == 0);
  CHECK_OK(lz_swap_close(s));
  lz_mem_free(src), lz_mem_free(dst);
}

LZ_TEST(swap_round_trip_every_aio_setting) {
  char dir[256];
  scratch_dir(dir, sizeof dir);
  for (int threads = 1; threads <= 2; threads++)
    for (int single = 0; single <= 1; single++)
      for (int overlap = 0; overlap <= 1; overlap++) {
        lz_swap_opts o;
        lz_swap_opts_default(&o);
        o.block_size = 64 * KIB;
        o.queue_depth = 4;
        o.thread_count = threads;
        o.single_submit = single;
        o.overlap_events = overlap;
        round_trip(dir, &o, 6 * MIB + 12 * KIB);
      }
  lz_swap_opts d;
  lz_swap_opts_default(&d);
  CHECK(d.block_size == MIB && d.queue_depth == 8 && d.thread_count == 1);
  CHECK(d.single_submit == 0 && d.overlap_events == 1);
  round_trip(dir, NULL, 3 * MIB); /* defaults: pieces of 1 MiB */
  CHECK_EQ_INT(dir_entries(dir), 0);
  rmdir(dir);
}

LZ_TEST(swap_requests_run_while_the_caller_computes) {
  char dir[256];
  scratch_dir(dir, sizeof dir);
  const int64_t bytes = 32 * MIB;
  lz_swap *s = NULL;
  CHECK_OK(lz_swap_open(&s, dir, bytes, NULL, NULL));
  if (!s) return;
  char *buf = offload_buf((size_t)bytes), *back = offload_buf((size_t)bytes);
  fill_random(buf, (size_t)bytes);
  lz_swap_req *w = NULL;
  CHECK_OK(lz_swap_write(s, 0, buf, bytes, &w));
  /* 32 MiB cannot reach the disk in the moment between the two calls: the
   * request is in flight and the call returned without waiting for it. */
  CHECK(!lz_swap_req_done(w));
  /* The caller computes meanwhile; the request completes by itself. */
  uint64_t sum = 0;
  while (!lz_swap_req_done(w)) sum += lz_test_xorshift(&rng) & 1;
  CHECK_OK(lz_swap_wait(w));
  CHECK_EQ_INT(lz_swap_bytes_written(s), bytes);
  lz_swap_req *r = NULL;
  CHECK_OK(lz_swap_read(s, 0, back, bytes, &r));
  CHECK(!lz_swap_req_done(r));
  CHECK_OK(lz_swap_wait(r));
  CHECK(memcmp(buf, back, (size_t)bytes) == 0);
  /* Close waits for requests nobody waited on, and frees them. */
  CHECK_OK(lz_swap_write(s, 0, buf, bytes, &w));
  CHECK_OK(lz_swap_read(s, 0, back, 4096, &r));
  CHECK_OK(lz_swap_close(s));
  (void)sum;
  lz_mem_free(buf), lz_mem_free(back);
  rmdir(dir);
}

LZ_TEST(swap_file_is_private_preallocated_and_unlinked) {
  char dir[256];
  scratch_dir(dir, sizeof dir);
  lz_swap *a = NULL, *b = NULL;
  CHECK_OK(lz_swap_open(&a, dir, 5 * MIB + 1, "params", NULL));
  CHECK_OK(lz_swap_open(&b, dir, 4096, NULL, NULL));
  if (!a || !b) return;
  CHECK_EQ_INT(lz_swap_size(a), 5 * MIB + 4096); /* rounded up to pages */
  char prefix[320];
  snprintf(prefix, sizeof prefix, "%s/luazero-swap-%d-", dir, (int)getpid());
  const char *pa = lz_swap_path(a), *pb = lz_swap_path(b);
  CHECK(strncmp(pa, prefix, strlen(prefix)) == 0);
  CHECK(strlen(pa) > 7 && strcmp(pa + strlen(pa) - 7, "-params") == 0);
  CHECK(strncmp(pb, prefix, strlen(prefix)) == 0 && strcmp(pa, pb) != 0);
  CHECK(lz_swap_is_direct(a) == probe_direct(dir));
  /* Gone from the folder already; still open, as /proc/self/fd shows. */
  CHECK_EQ_INT(dir_entries(dir), 0);
  struct stat st;
  CHECK(stat(pa, &st) != 0 && errno == ENOENT);
  char want[800], link[800], fdpath[64];
  snprintf(want, sizeof want, "%s (deleted)", pa);
  int found = 0;
  for (int fd = 0; fd < 1024 && !found; fd++) {
    snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(fdpath, link, sizeof link - 1);
    if (n <= 0) continue;
    link[n] = 0;
    if (strcmp(link, want) || stat(fdpath, &st) != 0) continue;
    found = 1;
    CHECK_EQ_INT(st.st_mode & 0777, 0600);
    CHECK_EQ_INT(st.st_size, 5 * MIB + 4096);
    CHECK((int64_t)st.st_blocks * 512 >= 5 * MIB + 4096); /* preallocated, not sparse */
  }
  CHECK(found);
  CHECK_OK(lz_swap_close(a));
  CHECK_OK(lz_swap_close(b));
  CHECK_OK(lz_swap_close(NULL));
  rmdir(dir);
}

LZ_TEST(swap_alignment_and_range_errors) {
  char dir[256];
  scratch_dir(dir, sizeof dir);
  lz_swap *s = NULL;
  CHECK_OK(lz_swap_open(&s, dir, MIB, "optimizer", NULL));
  if (!s) return;
  char *buf = offload_buf(2 * MIB);
  CHECK(((uintptr_t)buf & 4095) == 0);
  void *small = offload_buf(100); /* small offload blocks are page-aligned too */
  CHECK(((uintptr_t)small & 4095) == 0);
  lz_mem_free(small);
  lz_swap_req *r = (lz_swap_req *)&r;
  CHECK_ERR(lz_swap_read(s, 100, buf, 4096, &r), LZ_ERR_INVALID,
            "offset 100 is not a multiple of 4096 (O_DIRECT");
  CHECK(r == NULL); /* a refused request leaves no handle */
  CHECK_ERR(lz_swap_write(s, 0, buf, 1000, NULL), LZ_ERR_INVALID,
            "size 1000 bytes is not a multiple of 4096");
  CHECK_ERR(lz_swap_write(s, 0, buf + 64, 4096, NULL), LZ_ERR_INVALID,
            "is not 4096-byte aligned (O_DIRECT needs it; allocate with lz_mem_alloc(..., "
            "LZ_MEM_OFFLOAD))");
  CHECK_ERR(lz_swap_read(s, MIB - 4096, buf, 8192, NULL), LZ_ERR_INVALID,
            "8192 bytes at offset 1044480 go past the end of the 1048576-byte swap file");
  CHECK_ERR(lz_swap_read(s, -4096, buf, 4096, NULL), LZ_ERR_INVALID, "offset -4096");
  CHECK_ERR(lz_swap_read(s, 0, NULL, 4096, NULL), LZ_ERR_INVALID, "buffer is NULL");
  CHECK_ERR(lz_swap_read(NULL, 0, buf, 4096, NULL), LZ_ERR_INVALID, "swap is NULL");
  CHECK_ERR(lz_swap_wait(NULL), LZ_ERR_INVALID, "request is NULL");
  /* Messages name the file. */
  CHECK_ERR(lz_swap_read(s, 4097, buf, 4096, NULL), LZ_ERR_INVALID, lz_swap_path(s));
  CHECK_OK(lz_swap_read(s, 0, buf, 0, NULL)); /* nothing to do */
  CHECK_OK(lz_swap_read(s, MIB, buf, 0, &r));
  CHECK_OK(lz_swap_wait(r));
  CHECK_OK(lz_swap_close(s));
  lz_mem_free(buf);
  rmdir(dir);
}

LZ_TEST(swap_option_errors_name_the_key) {
  char dir[256];
  scratch_dir(dir, sizeof dir);
  lz_swap *s = (lz_swap *)&s;
  lz_swap_opts o;
  lz_swap_opts_default(&o);
  o.block_size = 1000;
  CHECK_ERR(lz_swap_open(&s, dir, MIB, NULL, &o), LZ_ERR_INVALID,
            "swap: aio.block_size 1000 is not a multiple of 4096");
  CHECK(s == NULL);
  lz_swap_opts_default(&o), o.block_size = 0;
  CHECK_ERR(lz_swap_open(&s, dir, MIB, NULL, &o), LZ_ERR_INVALID, "aio.block_size 0");
  lz_swap_opts_default(&o), o.queue_depth = 0;
  CHECK_ERR(lz_swap_open(&s, dir, MIB, NULL, &o), LZ_ERR_INVALID,
            "swap: aio.queue_depth 0 must be 1..1024");
  lz_swap_opts_default(&o), o.thread_count = -1;
  CHECK_ERR(lz_swap_open(&s, dir, MIB, NULL, &o), LZ_ERR_INVALID,
            "swap: aio.thread_count -1 must be 1..64");
  lz_swap_opts_default(&o), o.single_submit = 2;
  CHECK_ERR(lz_swap_open(&s, dir, MIB, NULL, &o), LZ_ERR_INVALID,
            "swap: aio.single_submit 2 must be 0 or 1");
  lz_swap_opts_default(&o), o.overlap_events = 5;
  CHECK_ERR(lz_swap_open(&s, dir, MIB, NULL, &o), LZ_ERR_INVALID,
            "swap: aio.overlap_events 5 must be 0 or 1");
  CHECK_ERR(lz_swap_open(&s, dir, 0, NULL, NULL), LZ_ERR_INVALID, "size 0 bytes");
  CHECK_ERR(lz_swap_open(&s, dir, MIB, "a/b", NULL), LZ_ERR_INVALID, "tag \"a/b\"");
  CHECK_EQ_INT(dir_entries(dir), 0);
  rmdir(dir);
}

LZ_TEST(swap_directory_errors_name_it) {
  char dir[256], missing[300], file[300];
  scratch_dir(dir, sizeof dir);
  lz_swap *s = NULL;
  snprintf(missing, sizeof missing, "%s/no-such-dir", dir);
  CHECK_ERR(lz_swap_open(&s, missing, MIB, NULL, NULL), LZ_ERR_IO, "does not exist");
  CHECK_ERR(lz_swap_open(&s, missing, MIB, NULL, NULL), LZ_ERR_IO, missing);
  CHECK_ERR(lz_swap_open(&s, missing, MIB, NULL, NULL), LZ_ERR_IO,
            "create it or point nvme_path at a writable directory");
  /* A file where a directory should be. */
  snprintf(file, sizeof file, "%s/plain-file", dir);
  FILE *f = fopen(file, "w");
  CHECK(f != NULL);
  if (f) fclose(f);
  CHECK_ERR(lz_swap_open(&s, file, MIB, NULL, NULL), LZ_ERR_IO, "is not a directory");
  CHECK_ERR(lz_swap_open(&s, file, MIB, NULL, NULL), LZ_ERR_IO, file);
  unlink(file);
  /* A directory nobody may create files in, root included (chmod 0500 would
   * not stop root). */
  CHECK_ERR(lz_swap_open(&s, "/proc", MIB, NULL, NULL), LZ_ERR_IO,
            "swap: cannot create a swap file in directory /proc");
  CHECK_ERR(lz_swap_open(&s, NULL, MIB, NULL, NULL), LZ_ERR_INVALID, "no directory given");
  CHECK(s == NULL);
  rmdir(dir);
}

/* Child-side checks: a failure prints and makes the child exit 1. */
static int child_failures;
#define CHILD_CHECK(cond, ...)                                  \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stdout, "    child %s:%d: ", __FILE__, __LINE__); \
      fprintf(stdout, __VA_ARGS__);                             \
      fprintf(stdout, "\n");                                    \
      child_failures++;                                         \
    }                                                           \
  } while (0)

static int run_child(void (*fn)(const char *), const char *dir) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    fn(dir);
    fflush(stdout);
    _exit(child_failures ? 1 : 0);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int has(const char *msg, const char *needle) { return strstr(msg, needle) != NULL; }

/* A file size limit: preallocation past it fails at open, and a write past it
 * fails at wait; both name the file, and the write names the offset. */
static void efbig_child(const char *dir) {
  signal(SIGXFSZ, SIG_IGN);
  lz_swap_opts o;
  lz_swap_opts_default(&o);
  o.block_size = 256 * KIB;
  lz_swap *s = NULL;
  CHILD_CHECK(lz_swap_open(&s, dir, 4 * MIB, "optimizer", &o) == LZ_OK, "%s", lz_last_error());
  char *buf = NULL;
  CHILD_CHECK(lz_mem_alloc((void **)&buf, 2 * MIB, LZ_MEM_OFFLOAD) == LZ_OK, "alloc");
  if (!s || !buf) return;
  memset(buf, 7, 2 * MIB);
  struct rlimit lim = {.rlim_cur = MIB, .rlim_max = RLIM_INFINITY};
  CHILD_CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0, "setrlimit: %s", strerror(errno));
  const char *path = lz_swap_path(s);
  /* Below the limit: fine. */
  CHILD_CHECK(lz_swap_write(s, 0, buf, MIB, NULL) == LZ_OK, "%s", lz_last_error());
  /* Straddling it: the pieces past 1 MiB fail, and so does the request. */
  lz_swap_req *r = NULL;
  CHILD_CHECK(lz_swap_write(s, 0, buf, 2 * MIB, &r) == LZ_OK, "%s", lz_last_error());
  lz_status st = lz_swap_wait(r);
  const char *msg = lz_last_error();
  CHILD_CHECK(st == LZ_ERR_IO, "straddling write: %s", lz_status_name(st));
  CHILD_CHECK(has(msg, path) && has(msg, "write of 262144 bytes at offset 1048576") &&
                  has(msg, strerror(EFBIG)),
              "message: %s", msg);
  st = lz_swap_write(s, 3 * MIB, buf, MIB, NULL);
  msg = lz_last_error();
  CHILD_CHECK(st == LZ_ERR_IO && has(msg, path) && has(msg, "at offset 3145728") &&
                  has(msg, "File too large"),
              "write past the limit: %s", msg);
  /* Reads are not limited. */
  CHILD_CHECK(lz_swap_read(s, 3 * MIB, buf, MIB, NULL) == LZ_OK, "%s", lz_last_error());
  CHILD_CHECK(lz_swap_close(s) == LZ_OK, "%s", lz_last_error());
  /* A new file larger than the limit fails at open, naming it. */
  s = NULL;
  st = lz_swap_open(&s, dir, 4 * MIB, "params", NULL);
  msg = lz_last_error();
  CHILD_CHECK(st == LZ_ERR_IO && s == NULL, "open past the limit: %s", lz_status_name(st));
  CHILD_CHECK(has(msg, "cannot preallocate 4194304 bytes") && has(msg, dir) &&
                  has(msg, "/luazero-swap-") && has(msg, "-params") && has(msg, "File too large"),
              "message: %s", msg);
  lz_mem_free(buf);
}

LZ_TEST(swap_io_errors_name_file_and_offset) {
  char dir[256];
  scratch_dir(dir, sizeof dir);
  CHECK_EQ_INT(run_child(efbig_child, dir), 0);
  CHECK_EQ_INT(dir_entries(dir), 0); /* nothing left behind by the failed open */
  rmdir(dir);
}

/* A file system that refuses O_DIRECT: buffered I/O, one warning naming the
 * directory, the same bytes back. */
static void buffered_round_trip(const char *dir, int expect_direct) {
  lz_swap_opts o;
  lz_swap_opts_default(&o);
  o.block_size = 128 * KIB;
  o.thread_count = 2;
  lz_swap *s = NULL;
  CHILD_CHECK(lz_swap_open(&s, dir, 2 * MIB, "params", &o) == LZ_OK, "%s", lz_last_error());
  if (!s) return;
  CHILD_CHECK(lz_swap_is_direct(s) == expect_direct, "is_direct %d, expected %d",
              lz_swap_is_direct(s), expect_direct);
  char *a = NULL, *b = NULL;
  CHILD_CHECK(lz_mem_alloc((void **)&a, 2 * MIB, LZ_MEM_OFFLOAD) == LZ_OK, "alloc");
  CHILD_CHECK(lz_mem_alloc((void **)&b, 2 * MIB, LZ_MEM_OFFLOAD) == LZ_OK, "alloc");
  if (!a || !b) return;
  fill_random(a, 2 * MIB);
  lz_swap_req *r1 = NULL, *r2 = NULL;
  CHILD_CHECK(lz_swap_write(s, 0, a, MIB + 12 * KIB, &r1) == LZ_OK, "%s", lz_last_error());
  CHILD_CHECK(lz_swap_write(s, MIB + 12 * KIB, a + MIB + 12 * KIB, MIB - 12 * KIB, &r2) == LZ_OK,
              "%s", lz_last_error());
  CHILD_CHECK(lz_swap_wait(r1) == LZ_OK && lz_swap_wait(r2) == LZ_OK, "%s", lz_last_error());
  CHILD_CHECK(lz_swap_read(s, 0, b, 2 * MIB, NULL) == LZ_OK, "%s", lz_last_error());
  CHILD_CHECK(memcmp(a, b, 2 * MIB) == 0, "data differs after the round trip");
  CHILD_CHECK(swap_entries(dir) == 0, "the swap file is still in %s", dir);
  CHILD_CHECK(lz_swap_close(s) == LZ_OK, "%s", lz_last_error());
  lz_mem_free(a), lz_mem_free(b);
}

static void shm_child(const char *dir) { buffered_round_trip(dir, probe_direct(dir)); }

/* ramfs refuses O_DIRECT on every kernel (tmpfs takes it since Linux 6.6).
 * Mounted in a private mount namespace, so nothing outside sees it. */
static void ramfs_child(const char *dir) {
  if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
      mount("none", dir, "ramfs", 0, NULL) != 0) {
    _exit(77); /* no CAP_SYS_ADMIN here */
  }
  CHILD_CHECK(!probe_direct(dir), "ramfs took O_DIRECT");
  /* The warning goes to stderr: catch it in a file outside the mount. */
  char log[] = "/tmp/lz-swap-warn-XXXXXX";
  int fd = mkstemp(log);
  CHILD_CHECK(fd >= 0, "mkstemp: %s", strerror(errno));
  if (fd < 0) return;
  unlink(log);
  int saved = dup(2);
  dup2(fd, 2);
  buffered_round_trip(dir, 0);
  fflush(stderr);
  dup2(saved, 2);
  char text[1024] = {0};
  ssize_t n = pread(fd, text, sizeof text - 1, 0);
  CHILD_CHECK(n > 0 && has(text, dir) && has(text, "O_DIRECT") && has(text, "buffered"),
              "warning on stderr: \"%s\"", n > 0 ? text : "");
  char *nl = strchr(text, '\n');
  CHILD_CHECK(nl && nl[1] == 0, "more than one line of warning: \"%s\"", text);
  close(fd);
}

LZ_TEST(swap_without_o_direct_falls_back_to_buffered) {
  /* /dev/shm: works either way; is_direct tells the truth. */
  struct stat st;
  if (stat("/dev/shm", &st) == 0) CHECK_EQ_INT(run_child(shm_child, "/dev/shm"), 0);
  char dir[256];
  scratch_dir(dir, sizeof dir);
  int rc = run_child(ramfs_child, dir);
  if (rc == 77)
    printf("    (ramfs part skipped: mounting needs CAP_SYS_ADMIN)\n");
  else
    CHECK_EQ_INT(rc, 0);
  rmdir(dir);
}
