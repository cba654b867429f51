/* shared_mem.c — memory the ranks of one `luazero -n N` job can all address.
 *
 * The launcher creates one sparse file per rank before it forks the ranks
 * (LZ_SHM_SHARED_BYTES each; default twice the machine's memory divided
 * among the ranks, at least 1 GiB, at most the machine's memory), holds the
 * descriptors close-on-exec for the job, and names them in
 * LZ_SHM_SHARED="<launcher pid>:<fd of rank 0>,...". Each rank, when the
 * library loads, opens every rank's file through /proc/<launcher pid>/fd,
 * maps it, closes the descriptor and unsets the variable: nothing is
 * inherited by what a rank starts. A rank allocates only from its own file; the ledger routes
 * params, grads and comm blocks of SHARED_MIN bytes and more here, so the
 * buffers the engine communicates are ones its peers can read and write with
 * plain loads and stores: the shm backend's collectives then copy at memcpy
 * speed, without the kernel (comm_shm.c).
 *
 * The files are on huge pages where the system allows it: memfds and
 * /dev/shm get 4 KiB pages on most machines (shmem_enabled=never), which
 * costs copies of 16 MiB and more up to half their speed, so the launcher
 * first makes them in a tmpfs of its own mounted with huge=always (in a
 * helper process with a private mount namespace, and a user namespace when
 * not root), then falls back to memfds. Pages are faulted in on first touch
 * and given back to the system when a block is freed (MADV_REMOVE). Nothing
 * has a visible name: the memory goes when the last rank holding a mapping
 * exits, crashes included.
 *
 * Allocation: first fit over a sorted list of free extents below a bump
 * pointer, in 4 KiB units (2 MiB, aligned, for blocks of 2 MiB and more);
 * one lock. Blocks are few and large (flat
 * parameter and gradient buffers, communication buffers). */
#define _GNU_SOURCE /* MADV_REMOVE */
#include "mem/lz_internal.h"

#include <errno.h>     /* errno */
#include <fcntl.h>     /* open */
#include <pthread.h>   /* the allocator's lock, pthread_once */
#include <sched.h>     /* unshare */
#include <stdio.h>     /* snprintf */
#include <stdlib.h>    /* getenv, strtol */
#include <sys/mman.h>  /* mmap, madvise, memfd_create */
#include <sys/mount.h> /* mount */
#include <sys/socket.h> /* socketpair, SCM_RIGHTS */
#include <sys/stat.h>  /* fstat */
#include <sys/wait.h>  /* waitpid */
#include <unistd.h>    /* readlink, close */

#define UNIT 4096u
#define HUGE_UNIT (2u << 20)
#define SHARED_MIN (64u << 10) /* smaller blocks stay private: collectives of them go through the segment */
#define MAX_RANKS 256

typedef struct {
  size_t off, len;
} extent;

static struct {
  pthread_once_t once;
  pthread_mutex_t mu;
  int ready, rank, world;
  uint8_t *map[MAX_RANKS];
  size_t bytes[MAX_RANKS];
  size_t top;          /* first never-allocated byte of this rank's memfd */
  extent *free_list;   /* sorted by offset, coalesced, all below top */
  size_t nfree, cap;
} g = {PTHREAD_ONCE_INIT, PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, {0}, {0}, 0, NULL, 0, 0};

static int env_int(const char *name, int fallback) {
  const char *s = getenv(name);
  return s && *s ? atoi(s) : fallback;
}

/* 1 if fd is the launcher's file for rank r (not some stranger):
 * "/memfd:luazero-<pid>-rank-<r> (deleted)" or ".../luazero-<pid>-rank-<r> (deleted)". */
static int is_job_file(int fd, long launcher, int r) {
  char path[64], link[512], want[96];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n <= 0) return 0;
  link[n] = 0;
  snprintf(want, sizeof want, "luazero-%ld-rank-%d (deleted)", launcher, r);
  size_t wl = strlen(want);
  return (size_t)n > wl && !strcmp(link + n - wl, want) &&
         (link[n - wl - 1] == '/' || link[n - wl - 1] == ':');
}

/* Opens rank r's file through the launcher's descriptor, /proc/<launcher>/fd/<fd>
 * (the launcher holds them for the job; nothing is inherited, so nothing
 * leaks into whatever a rank starts). -1 where it is not the job's file. */
static int open_job_file(long launcher, int fd, int r) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%ld/fd/%d", launcher, fd);
  int mine = open(path, O_RDWR | O_CLOEXEC);
  if (mine >= 0 && !is_job_file(mine, launcher, r)) {
    close(mine);
    mine = -1;
  }
  return mine;
}

static void setup(void) {
  const char *env = getenv("LZ_SHM_SHARED"), *single = getenv("LZ_SHM_CMA");
  if (!env || !*env) return;
  char spec[4096];
  snprintf(spec, sizeof spec, "%s", env);
  /* Consumed: a program this rank starts must not take the files for its own. */
  unsetenv("LZ_SHM_SHARED");
  int world = env_int("WORLD_SIZE", 1), rank = env_int("RANK", -1);
  if (world < 2 || world > MAX_RANKS || rank < 0 || rank >= world) return;
  if (single && !strcmp(single, "0")) return; /* in-place paths off: nothing to share */
  char *end;
  long launcher = strtol(spec, &end, 10);
  if (*end != ':') return;
  const char *p = end + 1;
  int ok = 1;
  for (int r = 0; r < world && ok; r++) {
    int lfd = (int)strtol(p, &end, 10);
    ok = end != p && (r + 1 < world ? *end == ',' : *end == 0);
    p = end + 1;
    int fd = ok ? open_job_file(launcher, lfd, r) : -1;
    struct stat st;
    ok = fd >= 0 && fstat(fd, &st) == 0 && st.st_size > 0;
    void *m = ok ? mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_NORESERVE, fd, 0)
                 : MAP_FAILED;
    if (fd >= 0) close(fd); /* the mapping keeps the memory */
    if (m == MAP_FAILED) ok = 0;
    else {
      /* Huge pages for the memfd fallback where shmem allows them
       * (shmem_enabled=advise); the huge tmpfs has them already. */
      madvise(m, (size_t)st.st_size, MADV_HUGEPAGE);
      g.map[r] = m;
      g.bytes[r] = (size_t)st.st_size;
    }
  }
  if (!ok) {
    for (int r = 0; r < world; r++)
      if (g.map[r]) munmap(g.map[r], g.bytes[r]), g.map[r] = NULL;
    return;
  }
  g.rank = rank;
  g.world = world;
  g.ready = 1;
}

/* At load, before the rank can start anything that would inherit the
 * variable. */
__attribute__((constructor)) static void setup_at_load(void) { pthread_once(&g.once, setup); }

int lz_shared_ready(void) {
  pthread_once(&g.once, setup);
  return g.ready;
}

int lz_shared_wants(size_t bytes, lz_mem_category cat) {
  if (bytes < SHARED_MIN) return 0;
  if (cat != LZ_MEM_PARAMS && cat != LZ_MEM_GRADS && cat != LZ_MEM_COMM) return 0;
  return lz_shared_ready();
}

static int free_list_insert(size_t at, extent e) {
  if (g.nfree == g.cap) {
    size_t ncap = g.cap ? g.cap * 2 : 64;
    extent *n = realloc(g.free_list, ncap * sizeof *n);
    if (!n) return 0;
    g.free_list = n;
    g.cap = ncap;
  }
  memmove(g.free_list + at + 1, g.free_list + at, (g.nfree - at) * sizeof *g.free_list);
  g.free_list[at] = e;
  g.nfree++;
  return 1;
}

static void free_list_remove(size_t at) {
  memmove(g.free_list + at, g.free_list + at + 1, (g.nfree - at - 1) * sizeof *g.free_list);
  g.nfree--;
}

/* Blocks of 2 MiB and more take whole huge pages at 2 MiB offsets, so no
 * two blocks share one and a block's pages map as huge pages; smaller ones
 * pack in 4 KiB units. */
static size_t block_unit(size_t bytes) { return bytes >= HUGE_UNIT ? HUGE_UNIT : UNIT; }
static size_t block_len(size_t bytes) {
  size_t u = block_unit(bytes), len = (bytes + u - 1) / u * u;
  return len ? len : UNIT;
}

lz_status lz_shared_alloc(void **out, size_t bytes) {
  if (!lz_shared_ready()) return LZ_ERR_INVALID;
  size_t len = block_len(bytes), unit = block_unit(bytes);
  pthread_mutex_lock(&g.mu);
  size_t off = SIZE_MAX;
  for (size_t i = 0; i < g.nfree; i++) {
    extent e = g.free_list[i];
    size_t start = (e.off + unit - 1) / unit * unit;
    if (start + len > e.off + e.len) continue;
    extent head = {e.off, start - e.off}, tail = {start + len, e.off + e.len - start - len};
    if (head.len && tail.len) {
      g.free_list[i] = head;
      if (!free_list_insert(i + 1, tail)) { /* no memory for the list: try elsewhere */
        g.free_list[i] = e;
        continue;
      }
    } else if (head.len) g.free_list[i] = head;
    else if (tail.len) g.free_list[i] = tail;
    else free_list_remove(i);
    off = start;
    break;
  }
  if (off == SIZE_MAX) {
    size_t start = (g.top + unit - 1) / unit * unit;
    if (start <= g.bytes[g.rank] && g.bytes[g.rank] - start >= len &&
        (start == g.top || free_list_insert(g.nfree, (extent){g.top, start - g.top}))) {
      off = start;
      g.top = start + len;
    }
  }
  pthread_mutex_unlock(&g.mu);
  if (off == SIZE_MAX) return LZ_ERR_NOMEM; /* the caller falls back to private memory */
  *out = g.map[g.rank] + off;
  return LZ_OK;
}

void lz_shared_free(void *ptr, size_t bytes) {
  size_t len = block_len(bytes);
  size_t off = (size_t)((uint8_t *)ptr - g.map[g.rank]);
  madvise(ptr, len, MADV_REMOVE); /* the pages go back to the system, in every rank's mapping */
  pthread_mutex_lock(&g.mu);
  size_t i = 0;
  while (i < g.nfree && g.free_list[i].off < off) i++;
  extent e = {off, len};
  if (i > 0 && g.free_list[i - 1].off + g.free_list[i - 1].len == off) {
    e.off = g.free_list[i - 1].off;
    e.len += g.free_list[i - 1].len;
    free_list_remove(--i);
  }
  if (i < g.nfree && e.off + e.len == g.free_list[i].off) {
    e.len += g.free_list[i].len;
    free_list_remove(i);
  }
  if (e.off + e.len == g.top) g.top = e.off; /* the end comes back to the bump pointer */
  else if (!free_list_insert(i, e)) {
    /* Out of memory for the list itself: the extent is lost to reuse, its
     * pages were given back all the same. */
  }
  pthread_mutex_unlock(&g.mu);
}

int lz_mem_shared(const void *ptr) {
  if (!g.ready || !ptr) return 0;
  uintptr_t p = (uintptr_t)ptr, b = (uintptr_t)g.map[g.rank];
  return p >= b && p < b + g.bytes[g.rank];
}

int64_t lz_mem_shared_peer_rss(void) {
  if (!g.ready) return 0;
  FILE *f = fopen("/proc/self/smaps", "re");
  if (!f) return 0;
  char line[512];
  int in_peer = 0;
  int64_t total = 0;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    long kb;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) { /* a mapping's first line */
      in_peer = 0;
      for (int r = 0; r < g.world; r++)
        if (r != g.rank && (uint8_t *)lo == g.map[r]) in_peer = 1;
    } else if (in_peer && sscanf(line, "Rss: %ld kB", &kb) == 1) {
      total += (int64_t)kb * 1024;
      in_peer = 0;
    }
  }
  fclose(f);
  return total;
}

uint8_t *lz_shared_view(int rank, size_t offset, size_t bytes) {
  if (!g.ready || rank < 0 || rank >= g.world) return NULL;
  if (offset > g.bytes[rank] || bytes > g.bytes[rank] - offset) return NULL;
  return g.map[rank] + offset;
}

uint64_t lz_shared_offset(const void *ptr) {
  return lz_mem_shared(ptr) ? (uint64_t)((const uint8_t *)ptr - g.map[g.rank]) : UINT64_MAX;
}

/* ------------------------------------------------------- the launcher's side */

#define FDS_PER_MESSAGE 64 /* SCM_RIGHTS carries at most 253 */

static int write_text(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = write(fd, text, strlen(text));
  close(fd);
  return n == (ssize_t)strlen(text);
}

typedef union {
  char buf[CMSG_SPACE(FDS_PER_MESSAGE * sizeof(int))];
  struct cmsghdr align; /* control data must be aligned like a cmsghdr */
} fd_control;

/* A one-byte message with room for a batch of descriptors. */
static struct msghdr fd_message(struct iovec *io, char *byte, fd_control *ctl, size_t controllen) {
  *io = (struct iovec){byte, 1};
  struct msghdr m = {0};
  m.msg_iov = io;
  m.msg_iovlen = 1;
  m.msg_control = ctl->buf;
  m.msg_controllen = controllen;
  return m;
}

static int send_fds(int sock, const int *fds, int n) {
  char byte = 0;
  fd_control ctl;
  struct iovec io;
  struct msghdr m = fd_message(&io, &byte, &ctl, CMSG_SPACE((size_t)n * sizeof(int)));
  struct cmsghdr *h = CMSG_FIRSTHDR(&m);
  h->cmsg_level = SOL_SOCKET;
  h->cmsg_type = SCM_RIGHTS;
  h->cmsg_len = CMSG_LEN((size_t)n * sizeof(int));
  memcpy(CMSG_DATA(h), fds, (size_t)n * sizeof(int));
  return sendmsg(sock, &m, 0) == 1;
}

static int recv_fds(int sock, int *fds, int n) {
  char byte;
  fd_control ctl;
  struct iovec io;
  struct msghdr m = fd_message(&io, &byte, &ctl, sizeof ctl.buf);
  if (recvmsg(sock, &m, MSG_CMSG_CLOEXEC) != 1) return 0;
  struct cmsghdr *h = CMSG_FIRSTHDR(&m);
  if (!h || h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) return 0;
  size_t got = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
  int tmp[FDS_PER_MESSAGE];
  memcpy(tmp, CMSG_DATA(h), got * sizeof(int));
  if (got != (size_t)n) { /* not what was sent: close what came */
    for (size_t i = 0; i < got; i++) close(tmp[i]);
    return 0;
  }
  memcpy(fds, tmp, got * sizeof(int));
  return 1;
}

/* The helper: a private mount namespace (and user namespace, mapping this
 * user to root in it, when not root), a tmpfs with huge=always over
 * /dev/shm there, one unlinked file per rank sent back. Exits 0 on success. */
static int huge_helper(int sock, int nranks, unsigned long long bytes, int launcher, uid_t uid,
                       gid_t gid) {
  if (uid != 0) {
    char map[64];
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) return 1;
    snprintf(map, sizeof map, "0 %u 1", (unsigned)uid);
    if (!write_text("/proc/self/setgroups", "deny") || !write_text("/proc/self/uid_map", map))
      return 1;
    snprintf(map, sizeof map, "0 %u 1", (unsigned)gid);
    if (!write_text("/proc/self/gid_map", map)) return 1;
  } else if (unshare(CLONE_NEWNS)) return 1;
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) return 1;
  /* size=0: no limit of its own, like a memfd (a full tmpfs would SIGBUS a
   * rank touching a fresh page; memory itself is the limit, and strict
   * overcommit, where that too would be a SIGBUS, is refused above). */
  if (mount("luazero", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
            "huge=always,size=0,mode=0700"))
    return 1;
  int batch[FDS_PER_MESSAGE];
  for (int r0 = 0; r0 < nranks; r0 += FDS_PER_MESSAGE) {
    int k = nranks - r0 < FDS_PER_MESSAGE ? nranks - r0 : FDS_PER_MESSAGE;
    for (int i = 0; i < k; i++) {
      char path[96];
      snprintf(path, sizeof path, "/dev/shm/luazero-%d-rank-%d", launcher, r0 + i);
      batch[i] = open(path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (batch[i] < 0 || unlink(path) || ftruncate(batch[i], (off_t)bytes)) return 1;
    }
    if (!send_fds(sock, batch, k)) return 1;
    for (int i = 0; i < k; i++) close(batch[i]);
  }
  return 0;
}

/* The per-rank files on huge pages, through the helper: 1 on success. */
static int huge_files(int nranks, unsigned long long bytes, int *fds) {
  int sp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp)) return 0;
  int launcher = (int)getpid();
  uid_t uid = geteuid();
  gid_t gid = getegid();
  pid_t pid = fork();
  if (pid == 0) {
    close(sp[0]);
    _exit(huge_helper(sp[1], nranks, bytes, launcher, uid, gid));
  }
  close(sp[1]);
  int ok = pid > 0;
  for (int r0 = 0; ok && r0 < nranks; r0 += FDS_PER_MESSAGE) {
    int k = nranks - r0 < FDS_PER_MESSAGE ? nranks - r0 : FDS_PER_MESSAGE;
    ok = recv_fds(sp[0], fds + r0, k);
  }
  close(sp[0]);
  int st = 0;
  if (pid > 0)
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
  if (ok && WIFEXITED(st) && WEXITSTATUS(st) == 0) return 1;
  for (int r = 0; r < nranks; r++)
    if (fds[r] >= 0) close(fds[r]), fds[r] = -1;
  return 0;
}

/* Plain memfds (4 KiB pages where shmem gets no huge pages): 1 on success. */
static int mem_files(int nranks, unsigned long long bytes, int *fds) {
  for (int r = 0; r < nranks; r++) {
    char name[64];
    snprintf(name, sizeof name, "luazero-%d-rank-%d", (int)getpid(), r);
    fds[r] = memfd_create(name, MFD_CLOEXEC);
    if (fds[r] < 0 || ftruncate(fds[r], (off_t)bytes) != 0) {
      for (int q = 0; q <= r; q++)
        if (fds[q] >= 0) close(fds[q]), fds[q] = -1;
      return 0;
    }
  }
  return 1;
}

char *lz_shared_create(int nranks, int *fds) {
  for (int r = 0; r < nranks; r++) fds[r] = -1;
  if (nranks < 2 || nranks > MAX_RANKS) return NULL;
  const char *env = getenv("LZ_SHM_SHARED_BYTES");
  unsigned long long bytes;
  if (env && *env) {
    char *end;
    bytes = strtoull(env, &end, 10);
    if (*end) {
      fprintf(stderr, "luazero: LZ_SHM_SHARED_BYTES=\"%s\" is not a byte count; the ranks use "
                      "private memory\n", env);
      return NULL;
    }
    if (!bytes) return NULL;
  } else {
    /* Every rank maps every file: twice a fair share each keeps the address
     * space bounded however many ranks there are. A rank that fills its
     * file allocates privately (slower collectives, the same results). */
    unsigned long long ram =
        (unsigned long long)sysconf(_SC_PHYS_PAGES) * (unsigned long long)sysconf(_SC_PAGESIZE);
    bytes = 2 * ram / (unsigned long long)nranks;
    if (bytes < (1ull << 30)) bytes = 1ull << 30;
    if (bytes > ram) bytes = ram;
  }
  /* Under strict overcommit a shmem page is charged when first touched, and
   * a refused charge is a SIGBUS, not an error: keep to private memory. */
  char mode[8] = {0};
  int ofd = open("/proc/sys/vm/overcommit_memory", O_RDONLY | O_CLOEXEC);
  if (ofd >= 0) {
    ssize_t got = read(ofd, mode, sizeof mode - 1);
    close(ofd);
    if (got > 0 && mode[0] == '2') return NULL;
  }
  bytes = (bytes + (2ull << 20) - 1) & ~((2ull << 20) - 1);
  const char *huge = getenv("LZ_SHM_HUGE");
  int try_huge = !(huge && !strcmp(huge, "0"));
  if (!(try_huge && huge_files(nranks, bytes, fds)) && !mem_files(nranks, bytes, fds)) {
    fprintf(stderr, "luazero: cannot create the ranks' shared memory (%s); the ranks use "
                    "private memory\n", strerror(errno));
    return NULL;
  }
  size_t cap = (size_t)nranks * 12 + 32;
  char *spec = malloc(cap);
  if (!spec) {
    lz_shared_close(nranks, fds);
    return NULL;
  }
  size_t n = (size_t)snprintf(spec, cap, "%d:", (int)getpid());
  for (int r = 0; r < nranks; r++) {
    n += (size_t)snprintf(spec + n, cap - n, r ? ",%d" : "%d", fds[r]);
  }
  return spec;
}

void lz_shared_close(int nranks, int *fds) {
  for (int r = 0; fds && r < nranks; r++)
    if (fds[r] >= 0) close(fds[r]), fds[r] = -1;
}
