/* launch.c — `luazero -n N`: runs N ranks of a program on this machine.
 *
 * The launcher creates the job's shared-memory segment (mode 0600, a unique
 * name passed in LZ_SHM_NAME), fork+execs each rank (plain fork would inherit
 * OpenMP state and hang, see NOTES.md) with the torchrun environment and a
 * share of the cores, relays the output of ranks other than 0 with a
 * "[rank N] " prefix, and watches them: when one fails the others get
 * SIGTERM, then SIGKILL, and the launcher exits non-zero naming the rank and
 * how it ended. Rank 0 keeps the launcher's stdin (the terminal of a REPL);
 * the others read /dev/null. The segment is unlinked on every exit path of the launcher
 * (rank 0 also unlinks it once all ranks have mapped it, so even a SIGKILLed
 * launcher leaves nothing behind: ranks die with it through PDEATHSIG).
 *
 * Environment read here: LZ_RANK_OUTPUT = prefix (default) | quiet (ranks
 * other than 0 silenced) | raw (inherited, no prefix); LZ_BACKEND=mpi runs
 * the ranks under mpirun instead. */
#define _GNU_SOURCE /* sched_getaffinity, pipe2, execvpe */
#include "comm_internal.h"

#include <arpa/inet.h>  /* htonl for the free-port probe */
#include <errno.h>      /* EINTR, ENOENT */
#include <fcntl.h>      /* O_CREAT, O_EXCL, fcntl */
#include <netinet/in.h> /* sockaddr_in */
#include <poll.h>       /* poll over the ranks' pipes */
#include <sched.h>      /* sched_getaffinity */
#include <signal.h>     /* sigaction, kill */
#include <stdio.h>      /* snprintf, fprintf */
#include <stdlib.h>     /* getenv, malloc */
#include <sys/mman.h>   /* shm_open, mmap */
#include <sys/prctl.h>  /* PR_SET_PDEATHSIG */
#include <sys/random.h> /* getrandom for the segment name */
#include <sys/socket.h> /* socket, bind */
#include <sys/wait.h>   /* waitpid */
#include <unistd.h>     /* fork, execvpe, pipe2 */

extern char **environ;

static volatile sig_atomic_t got_signal;
static void on_signal(int sig) { got_signal = sig; }

enum { OUT_PREFIX, OUT_QUIET, OUT_RAW };

typedef struct stream {
  int fd;     /* read end, -1 when closed */
  int to;     /* 1 or 2 */
  int rank;
  char *line; /* the partial line not yet written */
  size_t len, cap;
} stream;

typedef struct rank_proc {
  pid_t pid;
  int running;
  int status;
} rank_proc;

static void write_all(int fd, const char *p, size_t n) {
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return; /* the launcher's output is gone: drop, keep supervising */
    p += w;
    n -= (size_t)w;
  }
}

static void emit_line(stream *s, const char *p, size_t n) {
  char prefix[32];
  int k = snprintf(prefix, sizeof prefix, "[rank %d] ", s->rank);
  char *buf = malloc((size_t)k + n + 1);
  if (!buf) return;
  memcpy(buf, prefix, (size_t)k);
  memcpy(buf + k, p, n);
  buf[(size_t)k + n] = '\n';
  write_all(s->to, buf, (size_t)k + n + 1); /* one write: lines of ranks do not interleave */
  free(buf);
}

/* Reads what is there; returns 0 at end of file. */
static int pump(stream *s) {
  char buf[65536];
  ssize_t r = read(s->fd, buf, sizeof buf);
  if (r < 0 && (errno == EINTR || errno == EAGAIN)) return 1;
  if (r <= 0) {
    if (s->len) emit_line(s, s->line, s->len);
    s->len = 0;
    close(s->fd);
    s->fd = -1;
    return 0;
  }
  size_t start = 0;
  for (size_t i = 0; i < (size_t)r; i++) {
    if (buf[i] != '\n') continue;
    if (s->len) {
      size_t need = s->len + (i - start);
      if (need > s->cap) {
        char *nl = realloc(s->line, need);
        if (!nl) return 1;
        s->line = nl;
        s->cap = need;
      }
      memcpy(s->line + s->len, buf + start, i - start);
      emit_line(s, s->line, need);
      s->len = 0;
    } else {
      emit_line(s, buf + start, i - start);
    }
    start = i + 1;
  }
  size_t rest = (size_t)r - start;
  if (rest) {
    if (s->len + rest > s->cap) {
      size_t ncap = (s->len + rest) * 2;
      char *nl = realloc(s->line, ncap);
      if (!nl) return 1;
      s->line = nl;
      s->cap = ncap;
    }
    memcpy(s->line + s->len, buf + start, rest);
    s->len += rest;
    if (s->len > (1u << 20)) { /* a huge line without newline: pass it on */
      emit_line(s, s->line, s->len);
      s->len = 0;
    }
  }
  return 1;
}

static int cpus_available(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 29500;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

/* environ without the variables we set, plus ours. */
static char **rank_env(int rank, int nranks, const char *shm_name, const char *shared, int port,
                       int threads) {
  static const char *ours[] = {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=",
                               "LZ_SHM_NAME=", "LZ_LAUNCHER_PID=", "LZ_SHM_SHARED=", NULL};
  size_t n = 0;
  while (environ[n]) n++;
  char **env = calloc(n + 16, sizeof *env);
  if (!env) return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    int skip = 0;
    for (int j = 0; ours[j]; j++)
      if (!strncmp(environ[i], ours[j], strlen(ours[j]))) skip = 1;
    if (!skip) env[k++] = environ[i];
  }
  char tmp[512];
#define ADD(...)                                                                                   \
  do {                                                                                             \
    snprintf(tmp, sizeof tmp, __VA_ARGS__);                                                        \
    env[k++] = strdup(tmp);                                                                        \
  } while (0)
  ADD("RANK=%d", rank);
  ADD("WORLD_SIZE=%d", nranks);
  ADD("LOCAL_RANK=%d", rank);
  ADD("LOCAL_WORLD_SIZE=%d", nranks);
  ADD("LZ_SHM_NAME=%s", shm_name);
  ADD("LZ_LAUNCHER_PID=%d", (int)getpid());
  if (shared) {
    size_t len = strlen(shared) + 16;
    env[k] = malloc(len);
    if (env[k]) snprintf(env[k++], len, "LZ_SHM_SHARED=%s", shared);
  }
  if (!getenv("MASTER_ADDR")) ADD("MASTER_ADDR=127.0.0.1");
  if (!getenv("MASTER_PORT")) ADD("MASTER_PORT=%d", port);
  /* The user's thread settings win; otherwise each rank gets its share. */
  if (!getenv("OMP_NUM_THREADS")) ADD("OMP_NUM_THREADS=%d", threads);
  if (!getenv("ONEDNN_NUM_THREADS") && !getenv("OMP_NUM_THREADS"))
    ADD("ONEDNN_NUM_THREADS=%d", threads);
  if (!getenv("OPENBLAS_NUM_THREADS")) ADD("OPENBLAS_NUM_THREADS=%d", threads);
#undef ADD
  env[k] = NULL;
  return env;
}

static void free_rank_env(char **env) {
  for (size_t i = 0; env[i]; i++) {
    int inherited = 0;
    for (size_t j = 0; environ[j] && !inherited; j++) inherited = env[i] == environ[j];
    if (!inherited) free(env[i]);
  }
  free(env);
}

static const char *signal_name(int sig) {
  switch (sig) {
  case SIGKILL: return "SIGKILL";
  case SIGTERM: return "SIGTERM";
  case SIGINT: return "SIGINT";
  case SIGSEGV: return "SIGSEGV";
  case SIGABRT: return "SIGABRT";
  case SIGBUS: return "SIGBUS";
  case SIGFPE: return "SIGFPE";
  case SIGILL: return "SIGILL";
  case SIGHUP: return "SIGHUP";
  case SIGPIPE: return "SIGPIPE";
  default: return "signal";
  }
}

static int status_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

static void describe(int status, char *buf, size_t len) {
  if (WIFEXITED(status)) snprintf(buf, len, "exited with code %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, len, "was killed by signal %d (%s)%s", WTERMSIG(status),
             signal_name(WTERMSIG(status)), WCOREDUMP(status) ? ", core dumped" : "");
  else snprintf(buf, len, "ended with status %d", status);
}

/* LZ_BACKEND=mpi: mpirun starts the ranks; we wait for it. */
static lz_status launch_mpirun(int nranks, char *const *argv, int *exit_code) {
  int argc = 0;
  while (argv[argc]) argc++;
  char **av = calloc((size_t)argc + 8, sizeof *av);
  if (!av) return lz_fail(LZ_ERR_NOMEM, "launch: out of memory");
  char np[16];
  snprintf(np, sizeof np, "%d", nranks);
  int k = 0;
  av[k++] = "mpirun";
  av[k++] = "-np";
  av[k++] = np;
  if (geteuid() == 0) av[k++] = "--allow-run-as-root";
  if (nranks > cpus_available()) av[k++] = "--oversubscribe";
  for (int i = 0; i < argc; i++) av[k++] = argv[i];
  av[k] = NULL;
  pid_t pid = fork();
  if (pid < 0) {
    free(av);
    return lz_fail(LZ_ERR_IO, "launch: fork failed: %s", strerror(errno));
  }
  if (pid == 0) {
    execvp("mpirun", av);
    fprintf(stderr, "luazero: cannot run mpirun (LZ_BACKEND=mpi): %s\n", strerror(errno));
    _exit(127);
  }
  free(av);
  int status;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  *exit_code = status_code(status);
  return LZ_OK;
}

lz_status lz_launch(int nranks, char *const *argv, int *exit_code) {
  if (!exit_code) return lz_fail(LZ_ERR_INVALID, "launch: exit_code is NULL");
  *exit_code = 1;
  if (nranks < 1 || nranks > 4096)
    return lz_fail(LZ_ERR_INVALID, "launch: -n %d: the number of ranks must be 1..4096", nranks);
  if (!argv || !argv[0])
    return lz_fail(LZ_ERR_INVALID, "launch: no program to run (argv is empty)");
  const char *backend = getenv("LZ_BACKEND");
  if (backend && !strcmp(backend, "mpi")) return launch_mpirun(nranks, argv, exit_code);
  int mode = OUT_PREFIX;
  const char *om = getenv("LZ_RANK_OUTPUT");
  if (om && !strcmp(om, "quiet")) mode = OUT_QUIET;
  else if (om && !strcmp(om, "raw")) mode = OUT_RAW;
  else if (om && *om && strcmp(om, "prefix"))
    return lz_fail(LZ_ERR_INVALID, "launch: LZ_RANK_OUTPUT=\"%s\" must be prefix, quiet or raw",
                   om);

  /* The job's segment. */
  uint64_t rnd = 0;
  if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd) rnd = (uint64_t)lz_now_s() * 1000003u;
  char name[96];
  snprintf(name, sizeof name, "/luazero-%d-%016llx", (int)getpid(), (unsigned long long)rnd);
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    return lz_fail(LZ_ERR_IO, "launch: cannot create shared memory %s: %s (is /dev/shm mounted "
                   "and writable?)", name, strerror(errno));
  size_t seg = lz_shm_segment_bytes(nranks);
  void *hdr = MAP_FAILED;
  if (ftruncate(fd, (off_t)seg) == 0)
    hdr = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (hdr == MAP_FAILED) {
    int e = errno;
    close(fd);
    shm_unlink(name);
    return lz_fail(LZ_ERR_IO, "launch: cannot size shared memory %s to %zu bytes: %s", name, seg,
                   strerror(e));
  }
  lz_shm_segment_format(hdr, nranks);
  munmap(hdr, 4096);
  close(fd);

  /* Signals to the launcher stop the job (and remove the segment). */
  struct sigaction sa = {0}, old_int, old_term, old_hup, old_pipe;
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  got_signal = 0;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGHUP, &sa, &old_hup);
  struct sigaction ign = {0};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &old_pipe);

  int threads = cpus_available() / nranks;
  if (threads < 1) threads = 1;
  int port = free_port();
  int *memfds = calloc((size_t)nranks, sizeof *memfds);
  char *shared = memfds ? lz_shared_create(nranks, memfds) : NULL;
  rank_proc *procs = calloc((size_t)nranks, sizeof *procs);
  stream *streams = calloc((size_t)nranks * 2, sizeof *streams);
  struct pollfd *pfds = calloc((size_t)nranks * 2, sizeof *pfds);
  lz_status st = LZ_OK;
  int started = 0, running = 0;
  if (!procs || !streams || !pfds) {
    st = lz_fail(LZ_ERR_NOMEM, "launch: out of memory");
    goto done;
  }
  for (int i = 0; i < nranks * 2; i++) streams[i].fd = -1;
  pid_t self = getpid();
  for (int r = 0; r < nranks; r++) {
    int pout[2] = {-1, -1}, perr[2] = {-1, -1};
    if (r > 0 && mode == OUT_PREFIX && (pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC))) {
      st = lz_fail(LZ_ERR_IO, "launch: pipe for rank %d: %s", r, strerror(errno));
      goto stop;
    }
    char **env = rank_env(r, nranks, name, shared, port, threads);
    if (!env) {
      st = lz_fail(LZ_ERR_NOMEM, "launch: out of memory");
      goto stop;
    }
    pid_t pid = fork();
    if (pid < 0) {
      st = lz_fail(LZ_ERR_IO, "launch: fork of rank %d failed: %s", r, strerror(errno));
      goto stop;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL); /* the launcher gone: the ranks go too */
      if (getppid() != self) _exit(127);
      signal(SIGPIPE, SIG_DFL);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      /* Only rank 0 reads the terminal (the REPL of `-n N -i` runs there);
       * the others would steal its input. */
      if (r > 0) {
        int dn = open("/dev/null", O_RDONLY);
        if (dn < 0 || dup2(dn, 0) < 0) {
          fprintf(stderr, "luazero: rank %d: cannot point stdin at /dev/null: %s\n", r,
                  strerror(errno));
          _exit(127);
        }
        if (dn != 0) close(dn);
      }
      if (pout[1] >= 0) {
        dup2(pout[1], 1);
        dup2(perr[1], 2);
      } else if (r > 0 && mode == OUT_QUIET) {
        int dn = open("/dev/null", O_WRONLY);
        if (dn >= 0) {
          dup2(dn, 1);
          dup2(dn, 2);
        }
      }
      execvpe(argv[0], argv, env);
      fprintf(stderr, "luazero: rank %d: cannot run %s: %s\n", r, argv[0], strerror(errno));
      _exit(127);
    }
    free_rank_env(env);
    procs[r].pid = pid;
    procs[r].running = 1;
    started++;
    running++;
    if (pout[0] >= 0) {
      close(pout[1]);
      close(perr[1]);
      streams[2 * r] = (stream){pout[0], 1, r, NULL, 0, 0};
      streams[2 * r + 1] = (stream){perr[0], 2, r, NULL, 0, 0};
    }
  }

stop:;
  int failed_rank = -1, failed_code = 0, stopping = st != LZ_OK;
  double kill_at = 0, grace_until = 0;
  if (stopping) {
    for (int r = 0; r < nranks; r++)
      if (procs[r].running) kill(procs[r].pid, SIGTERM);
    kill_at = lz_now_s() + 3.0;
  }
  while (running > 0) {
    int np = 0;
    for (int i = 0; i < nranks * 2; i++)
      if (streams[i].fd >= 0) pfds[np++] = (struct pollfd){streams[i].fd, POLLIN, 0};
    int pr = np ? poll(pfds, (nfds_t)np, 100) : (usleep(50 * 1000), 0);
    if (pr > 0) {
      for (int i = 0, j = 0; i < nranks * 2; i++) {
        if (streams[i].fd < 0) continue;
        if (pfds[j].fd == streams[i].fd && (pfds[j].revents & (POLLIN | POLLHUP | POLLERR)))
          pump(&streams[i]);
        j++;
      }
    }
    for (;;) {
      int status;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (int r = 0; r < nranks; r++) {
        if (procs[r].pid != pid || !procs[r].running) continue;
        procs[r].running = 0;
        procs[r].status = status;
        running--;
        if (stopping || (WIFEXITED(status) && WEXITSTATUS(status) == 0)) continue;
        /* The first rank to fail is often a victim: a peer that saw another
         * rank die or stall. A rank killed by a signal is the cause; else
         * the first to fail. Wait a moment so the cause can show itself. */
        int killed = WIFSIGNALED(status);
        int cause_killed = failed_rank >= 0 && WIFSIGNALED(procs[failed_rank].status);
        if (failed_rank < 0 || (killed && !cause_killed)) failed_rank = r;
        if (grace_until == 0) grace_until = lz_now_s() + 0.5;
        if (killed) grace_until = lz_now_s();
      }
    }
    if (failed_rank >= 0 && !stopping && (lz_now_s() >= grace_until || running == 0)) {
      char how[96];
      describe(procs[failed_rank].status, how, sizeof how);
      if (running > 0)
        fprintf(stderr, "luazero: rank %d %s; stopping the other %d rank%s\n", failed_rank, how,
                running, running == 1 ? "" : "s");
      else fprintf(stderr, "luazero: rank %d %s\n", failed_rank, how);
      failed_code = status_code(procs[failed_rank].status);
      stopping = 1;
      for (int q = 0; q < nranks; q++)
        if (procs[q].running) kill(procs[q].pid, SIGTERM);
      kill_at = lz_now_s() + 3.0;
    }
    if (got_signal && !stopping) {
      fprintf(stderr, "luazero: received %s; stopping %d rank%s\n", signal_name(got_signal),
              running, running == 1 ? "" : "s");
      stopping = 1;
      for (int q = 0; q < nranks; q++)
        if (procs[q].running) kill(procs[q].pid, SIGTERM);
      kill_at = lz_now_s() + 3.0;
    }
    if (stopping && running > 0 && lz_now_s() > kill_at) {
      for (int q = 0; q < nranks; q++)
        if (procs[q].running) kill(procs[q].pid, SIGKILL);
      kill_at = lz_now_s() + 1e9;
    }
  }
  /* What the ranks wrote before exiting (bounded: a grandchild may hold a pipe). */
  for (double until = lz_now_s() + 1.0; lz_now_s() < until;) {
    int np = 0;
    for (int i = 0; i < nranks * 2; i++)
      if (streams[i].fd >= 0) pfds[np++] = (struct pollfd){streams[i].fd, POLLIN, 0};
    if (!np || poll(pfds, (nfds_t)np, 50) <= 0) break;
    for (int i = 0, j = 0; i < nranks * 2; i++) {
      if (streams[i].fd < 0) continue;
      if (pfds[j].revents) pump(&streams[i]);
      j++;
    }
  }
  if (st == LZ_OK) {
    if (failed_rank >= 0) *exit_code = failed_code ? failed_code : 1;
    else if (got_signal) *exit_code = 128 + got_signal;
    else *exit_code = 0;
  }
done:
  shm_unlink(name);
  lz_shared_close(nranks, memfds);
  free(memfds);
  free(shared);
  for (int i = 0; streams && i < nranks * 2; i++) {
    if (streams[i].fd >= 0) {
      if (streams[i].len) emit_line(&streams[i], streams[i].line, streams[i].len);
      close(streams[i].fd);
    }
    free(streams[i].line);
  }
  free(procs);
  free(streams);
  free(pfds);
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGHUP, &old_hup, NULL);
  sigaction(SIGPIPE, &old_pipe, NULL);
  (void)started;
  return st;
}
