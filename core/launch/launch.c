/* launch.c — `luazero -n N`: runs N ranks of a program on this machine.
 *
 * lz_launch reads top to bottom as it runs: check the arguments against the
 * machine (ranks per core, memory), make the job's shared memory, fork+exec
 * each rank (plain fork would inherit OpenMP state and hang, see NOTES.md)
 * with the torchrun environment and a share of the cores, supervise them, tear
 * down. The supervisor relays the output of ranks other than 0 with a
 * "[rank N] " prefix; when a rank fails, or the launcher gets SIGINT, SIGTERM
 * or SIGHUP (at any moment, start-up included), the ranks get SIGTERM, then
 * SIGKILL, and the launcher exits non-zero naming the rank or the signal.
 * Rank 0 keeps the launcher's stdin (a REPL's terminal); the others read
 * /dev/null. Nothing outlives a SIGKILLed launcher: the ranks die with it
 * (PDEATHSIG), and the job's memory is in memfds, which have no name.
 *
 * lz_launch_restarting runs the job again when a rank fails, up to
 * `restarts` times, with LZ_RESTART=<k> and LZ_RESTART_CAUSE=<one line> in
 * the ranks' environment (scripts/train.lua resumes from its --save folder
 * then). With min_ranks the ranks that died are lost: a restart runs on
 * those left, never fewer than min_ranks. A signal is never restarted.
 *
 * Environment: LZ_RANK_OUTPUT = prefix (default) | quiet (the stdout of ranks
 * other than 0 silenced, their stderr prefixed) | raw (inherited, no
 * prefix); LZ_BACKEND=mpi runs the ranks under mpirun instead. */
#define _GNU_SOURCE /* sched_getaffinity, pipe2, execvpe, memfd_create */
#include "comm/comm_internal.h"

#include <arpa/inet.h>  /* htonl for the free-port probe */
#include <errno.h>      /* EINTR, ENOENT */
#include <fcntl.h>      /* O_CLOEXEC, O_RDONLY */
#include <netinet/in.h> /* sockaddr_in */
#include <poll.h>       /* poll over the ranks' pipes */
#include <sched.h>      /* sched_getaffinity */
#include <signal.h>     /* sigaction, kill */
#include <stdio.h>      /* snprintf, fprintf */
#include <stdlib.h>     /* getenv, malloc */
#include <sys/mman.h>   /* memfd_create, mmap */
#include <sys/prctl.h>  /* PR_SET_PDEATHSIG */
#include <sys/random.h> /* getrandom for the segment name */
#include <sys/socket.h> /* socket, bind */
#include <sys/wait.h>   /* waitpid */
#include <time.h>       /* time, gmtime_r, strftime for a failure's time */
#include <unistd.h>     /* fork, execvpe, pipe2 */

extern char **environ;

static volatile sig_atomic_t got_signal, signals_got;
static void on_signal(int sig) { got_signal = sig, signals_got++; }

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
  int running, status;
} rank_proc;

/* What a job holds while it runs. */
typedef struct job {
  int nranks, mode, threads, port;
  char *const *argv;
  char name[96];  /* LZ_SHM_NAME: names the job (messages, the nccl id file) */
  int segment;    /* the segment's memfd: it has no name to leave behind */
  int *memfds;    /* the ranks' shared memory (shared_mem.c) */
  char *shared;   /* LZ_SHM_SHARED for the ranks, NULL without */
  rank_proc *procs;
  stream *streams; /* 2 per rank (stdout, stderr); fd -1 when not relayed */
  struct pollfd *pfds;
  int running;
  int stopping;    /* the ranks have been told to stop */
  double kill_at;  /* then SIGKILL for those still running */
  int failed_rank; /* the rank whose failure stops the job, -1 */
  int failed_status; /* its wait status, and when it was seen */
  time_t failed_at;
  int killed;      /* ranks killed by a signal before the job was stopped */
  int restart;     /* 0 for the first run, then 1.. */
  int restarts;    /* how many restarts the job may have */
  char cause[256]; /* LZ_RESTART_CAUSE of a restart */
} job;

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

/* The variables the launcher gives each rank (rank_env). */
static const char *const job_vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                       "LZ_SHM_NAME", "LZ_SHM_FD", "LZ_LAUNCHER_PID",
                                       "LZ_SHM_SHARED", "LZ_RESTART", "LZ_RESTART_CAUSE",
                                       "LZ_RESTARTS", NULL};

void lz_launch_leave_outer_job(void) {
  const char *p = getenv("LZ_LAUNCHER_PID");
  if (!p || strtol(p, NULL, 10) == (long)getppid()) return;
  for (int i = 0; job_vars[i]; i++) unsetenv(job_vars[i]);
}

/* environ without the variables we set, plus ours. */
static char **rank_env(const job *j, int rank) {
  size_t n = 0;
  while (environ[n]) n++;
  char **env = calloc(n + 24, sizeof *env);
  if (!env) return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    int skip = 0;
    for (int v = 0; job_vars[v]; v++) {
      const size_t len = strlen(job_vars[v]);
      if (!strncmp(environ[i], job_vars[v], len) && environ[i][len] == '=') skip = 1;
    }
    if (!skip) env[k++] = environ[i];
  }
  char tmp[512];
#define ADD(...)                                                                                   \
  do {                                                                                             \
    snprintf(tmp, sizeof tmp, __VA_ARGS__);                                                        \
    env[k++] = strdup(tmp);                                                                        \
  } while (0)
  ADD("RANK=%d", rank);
  ADD("WORLD_SIZE=%d", j->nranks);
  ADD("LOCAL_RANK=%d", rank);
  ADD("LOCAL_WORLD_SIZE=%d", j->nranks);
  ADD("LZ_SHM_NAME=%s", j->name);
  ADD("LZ_SHM_FD=%d", j->segment);
  ADD("LZ_LAUNCHER_PID=%d", (int)getpid());
  if (j->shared) {
    size_t len = strlen(j->shared) + 16;
    env[k] = malloc(len);
    if (env[k]) snprintf(env[k++], len, "LZ_SHM_SHARED=%s", j->shared);
  }
  /* A script learns that it may be restarted, and that it is a restart. */
  if (j->restarts > 0) ADD("LZ_RESTARTS=%d", j->restarts);
  if (j->restart > 0) {
    ADD("LZ_RESTART=%d", j->restart);
    ADD("LZ_RESTART_CAUSE=%s", j->cause);
  }
  if (!getenv("MASTER_ADDR")) ADD("MASTER_ADDR=127.0.0.1");
  if (!getenv("MASTER_PORT")) ADD("MASTER_PORT=%d", j->port);
  /* The user's thread settings win; otherwise each rank gets its share. */
  if (!getenv("OMP_NUM_THREADS")) ADD("OMP_NUM_THREADS=%d", j->threads);
  if (!getenv("ONEDNN_NUM_THREADS") && !getenv("OMP_NUM_THREADS"))
    ADD("ONEDNN_NUM_THREADS=%d", j->threads);
  if (!getenv("OPENBLAS_NUM_THREADS")) ADD("OPENBLAS_NUM_THREADS=%d", j->threads);
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

/* ------------------------------------------------------------ start-up */

#define MAX_RANKS 4096
/* More ranks than this per core only wait on each other. */
#define RANKS_PER_CORE 8
/* A rank's executable, LuaJIT and buffers, before any model. */
#define RANK_MIN_BYTES (64ll << 20)

/* Signals to the launcher stop the job: caught from the first line of
 * lz_launch to its last, so no moment of start-up or tear-down is left to
 * the default action (which would skip the clean-up). */
static const int job_signals[] = {SIGINT, SIGTERM, SIGHUP};
#define N_JOB_SIGNALS 3
static struct sigaction saved_actions[N_JOB_SIGNALS], saved_pipe, saved_child;

/* SIGCHLD back to its default too: ignored (as a parent may leave it, and
 * exec keeps), the kernel would reap the ranks itself and the launcher
 * would never see them end. */
static void signals_catch(void) {
  struct sigaction sa = {0}, ign = {0}, dfl = {0};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  got_signal = 0;
  for (int i = 0; i < N_JOB_SIGNALS; i++) sigaction(job_signals[i], &sa, &saved_actions[i]);
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &saved_pipe);
  dfl.sa_handler = SIG_DFL;
  sigaction(SIGCHLD, &dfl, &saved_child);
}

static void signals_restore(void) {
  for (int i = 0; i < N_JOB_SIGNALS; i++) sigaction(job_signals[i], &saved_actions[i], NULL);
  sigaction(SIGPIPE, &saved_pipe, NULL);
  sigaction(SIGCHLD, &saved_child, NULL);
}

/* Bytes of memory the system can give without swapping (MemAvailable), 0
 * where unknown. */
static long long memory_available(void) {
  FILE *f = fopen("/proc/meminfo", "re");
  long long kib = 0;
  char line[128];
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  if (f) fclose(f);
  return kib * 1024;
}

/* The job fits this machine: ranks within MAX_RANKS, RANKS_PER_CORE per core
 * and RANK_MIN_BYTES each of available memory; a program to run; a known
 * LZ_RANK_OUTPUT. */
static lz_status check_args(int nranks, char *const *argv, int *mode) {
  if (nranks < 1 || nranks > MAX_RANKS)
    return lz_fail(LZ_ERR_INVALID, "launch: -n %d: the number of ranks must be 1..%d", nranks,
                   MAX_RANKS);
  int cores = cpus_available();
  if (nranks > RANKS_PER_CORE * cores)
    return lz_fail(LZ_ERR_INVALID, "launch: -n %d: at most %d ranks run on this machine's %d "
                   "core%s (%d per core); use fewer ranks, or more machines through mpirun",
                   nranks, RANKS_PER_CORE * cores, cores, cores == 1 ? "" : "s", RANKS_PER_CORE);
  long long avail = memory_available();
  if (avail > 0 && nranks * RANK_MIN_BYTES > avail)
    return lz_fail(LZ_ERR_INVALID, "launch: -n %d: at most %lld ranks fit in this machine's "
                   "%.1f GiB of available memory (%lld MiB each at least); use fewer ranks",
                   nranks, avail / RANK_MIN_BYTES, (double)avail / (1 << 30),
                   RANK_MIN_BYTES >> 20);
  if (!argv || !argv[0])
    return lz_fail(LZ_ERR_INVALID, "launch: no program to run (argv is empty)");
  const char *om = getenv("LZ_RANK_OUTPUT");
  *mode = OUT_PREFIX;
  if (om && !strcmp(om, "quiet")) *mode = OUT_QUIET;
  else if (om && !strcmp(om, "raw")) *mode = OUT_RAW;
  else if (om && *om && strcmp(om, "prefix"))
    return lz_fail(LZ_ERR_INVALID, "launch: LZ_RANK_OUTPUT=\"%s\" must be prefix, quiet or raw",
                   om);
  return LZ_OK;
}

/* LZ_BACKEND=mpi: mpirun starts the ranks; we wait for it, passing on the
 * signals we get. It dies with the launcher (PDEATHSIG), and so do its
 * ranks. */
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
  pid_t self = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    free(av);
    return lz_fail(LZ_ERR_IO, "launch: fork failed: %s", strerror(errno));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* mpirun stops its ranks on SIGTERM */
    if (getppid() != self) _exit(127);
    for (int i = 0; i < N_JOB_SIGNALS; i++) signal(job_signals[i], SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    execvp("mpirun", av);
    fprintf(stderr, "luazero: cannot run mpirun (LZ_BACKEND=mpi): %s\n", strerror(errno));
    _exit(127);
  }
  free(av);
  int status = 0, passed_on = 0;
  for (;;) {
    if (got_signal && !passed_on) {
      fprintf(stderr, "luazero: received %s; stopping mpirun\n", signal_name(got_signal));
      kill(pid, got_signal);
      passed_on = 1;
    }
    if (waitpid(pid, &status, 0) >= 0 || errno != EINTR) break;
  }
  *exit_code = got_signal ? 128 + got_signal : status_code(status);
  return LZ_OK;
}

/* The job's segment (comm_shm.c's layout) in a memfd: the ranks open it
 * through /proc/<launcher>/fd (LZ_SHM_FD), and it goes with the last process
 * holding it, whoever is killed when. */
static lz_status make_segment(job *j) {
  uint64_t rnd = 0;
  if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd) rnd = (uint64_t)lz_now_s() * 1000003u;
  snprintf(j->name, sizeof j->name, "/luazero-%d-%016llx", (int)getpid(), (unsigned long long)rnd);
  char label[64];
  snprintf(label, sizeof label, "luazero-%d-segment", (int)getpid());
  j->segment = memfd_create(label, MFD_CLOEXEC);
  if (j->segment < 0)
    return lz_fail(LZ_ERR_IO, "launch: cannot create the job's shared memory: memfd_create: %s",
                   strerror(errno));
  size_t seg = lz_shm_segment_bytes(j->nranks);
  void *hdr = MAP_FAILED;
  if (ftruncate(j->segment, (off_t)seg) == 0)
    hdr = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, j->segment, 0);
  if (hdr == MAP_FAILED)
    return lz_fail(LZ_ERR_IO, "launch: cannot size the job's shared memory to %zu bytes: %s "
                   "(is memory short?)", seg, strerror(errno));
  lz_shm_segment_format(hdr, j->nranks);
  munmap(hdr, 4096);
  return LZ_OK;
}

/* In the child: becomes rank r of the job. */
__attribute__((noreturn)) static void exec_rank(const job *j, int r, pid_t launcher, const int *pout, const int *perr,
                      char **env) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* the launcher gone: the ranks go too */
  if (getppid() != launcher) _exit(127);
  signal(SIGPIPE, SIG_DFL);
  for (int i = 0; i < N_JOB_SIGNALS; i++) signal(job_signals[i], SIG_DFL);
  /* Only rank 0 reads the terminal (the REPL of `-n N -i` runs there); the
   * others would steal its input. */
  if (r > 0) {
    int dn = open("/dev/null", O_RDONLY);
    if (dn < 0 || dup2(dn, 0) < 0) {
      fprintf(stderr, "luazero: rank %d: cannot point stdin at /dev/null: %s\n", r,
              strerror(errno));
      _exit(127);
    }
    if (dn != 0) close(dn);
  }
  if (pout[1] >= 0) dup2(pout[1], 1);
  if (perr[1] >= 0) dup2(perr[1], 2);
  if (r > 0 && j->mode == OUT_QUIET) {
    int dn = open("/dev/null", O_WRONLY);
    if (dn >= 0) dup2(dn, 1);
  }
  execvpe(j->argv[0], j->argv, env);
  fprintf(stderr, "luazero: rank %d: cannot run %s: %s\n", r, j->argv[0], strerror(errno));
  _exit(127);
}

static void close_pair(int *p) {
  for (int i = 0; i < 2; i++)
    if (p[i] >= 0) close(p[i]), p[i] = -1;
}

static lz_status fork_rank(job *j, int r) {
  int pout[2] = {-1, -1}, perr[2] = {-1, -1};
  /* quiet: the others' stderr still comes through (prefixed), so a failing
   * rank's own error is seen; their stdout goes to /dev/null */
  if (r > 0 && j->mode != OUT_RAW &&
      ((j->mode == OUT_PREFIX && pipe2(pout, O_CLOEXEC)) || pipe2(perr, O_CLOEXEC))) {
    int e = errno;
    close_pair(pout);
    close_pair(perr);
    return lz_fail(LZ_ERR_IO, "launch: pipe for rank %d: %s", r, strerror(e));
  }
  char **env = rank_env(j, r);
  pid_t launcher = getpid();
  pid_t pid = env ? fork() : -1;
  if (pid == 0) exec_rank(j, r, launcher, pout, perr, env);
  int e = errno;
  if (env) free_rank_env(env);
  if (pout[1] >= 0) close(pout[1]);
  if (perr[1] >= 0) close(perr[1]);
  if (pid < 0) {
    if (pout[0] >= 0) close(pout[0]);
    if (perr[0] >= 0) close(perr[0]);
    return env ? lz_fail(LZ_ERR_IO, "launch: fork of rank %d failed: %s", r, strerror(e))
               : lz_fail(LZ_ERR_NOMEM, "launch: out of memory");
  }
  j->procs[r] = (rank_proc){pid, 1, 0};
  j->running++;
  if (j->segment >= 0) lz_shm_segment_rank_started(j->segment, j->nranks, r, pid);
  if (pout[0] >= 0) j->streams[2 * r] = (stream){pout[0], 1, r, NULL, 0, 0};
  if (perr[0] >= 0) j->streams[2 * r + 1] = (stream){perr[0], 2, r, NULL, 0, 0};
  return LZ_OK;
}

/* Starts the ranks one after the other; a signal stops the start-up (the
 * ranks started so far are then stopped by supervise). */
static lz_status fork_ranks(job *j) {
  for (int r = 0; r < j->nranks && !got_signal; r++) LZ_TRY(fork_rank(j, r));
  return LZ_OK;
}

/* ------------------------------------------------------------ the run */

static void kill_all(job *j, int sig) {
  for (int r = 0; r < j->nranks; r++)
    if (j->procs[r].running) kill(j->procs[r].pid, sig);
}

/* The ranks' time to stop after a signal, before SIGKILL (train.lua --save
 * saves its step first): LZ_STOP_GRACE s, 30 (a failure: 3 s). */
static double stop_grace(void) {
  const char *e = getenv("LZ_STOP_GRACE");
  return e && *e && atof(e) >= 0 ? atof(e) : 30.0;
}
/* SIGTERM now, SIGKILL for whoever still runs `grace` s later. */
static void stop_all(job *j, double grace) {
  j->stopping = 1;
  kill_all(j, SIGTERM);
  j->kill_at = lz_now_s() + grace;
}

/* Relays what the ranks wrote, waiting up to timeout_ms; returns how many
 * pipes are still open. */
static int relay_output(job *j, int timeout_ms) {
  int np = 0;
  for (int i = 0; i < j->nranks * 2; i++)
    if (j->streams[i].fd >= 0) j->pfds[np++] = (struct pollfd){j->streams[i].fd, POLLIN, 0};
  if (!np) {
    /* No pipe open (the ranks' output not relayed, or closed as they end):
     * up to timeout_ms for a rank to end (none left: no wait) or a new
     * signal, in naps of 1, 2, 4 ... ms, so a job's end is seen within a
     * few ms of its last rank's and a long run wakes a few times per
     * timeout, not every millisecond. */
    const sig_atomic_t had = got_signal;
    for (int waited = 0, nap = 1; waited < timeout_ms && got_signal == had;) {
      siginfo_t ended = {0};
      if (waitid(P_ALL, 0, &ended, WEXITED | WNOHANG | WNOWAIT) != 0 || ended.si_pid) break;
      if (nap > timeout_ms - waited) nap = timeout_ms - waited;
      usleep((useconds_t)nap * 1000);
      waited += nap;
      if (nap < 64) nap *= 2;
    }
    return 0;
  }
  if (poll(j->pfds, (nfds_t)np, timeout_ms) <= 0) return np;
  for (int i = 0, k = 0; i < j->nranks * 2; i++) {
    if (j->streams[i].fd < 0) continue;
    if (j->pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) pump(&j->streams[i]);
    k++;
  }
  return np;
}

/* Collects the ranks that ended. The first rank to fail is often a victim:
 * a peer that saw another rank die or stall. A rank killed by a signal is
 * the cause; else the first to fail. *grace_until: when to stop waiting for
 * the cause to show itself. */
static void reap(job *j, double *grace_until) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    for (int r = 0; r < j->nranks; r++) {
      rank_proc *p = &j->procs[r];
      if (p->pid != pid || !p->running) continue;
      p->running = 0;
      p->status = status;
      j->running--;
      if (j->stopping || (WIFEXITED(status) && WEXITSTATUS(status) == 0)) continue;
      int killed = WIFSIGNALED(status);
      int cause_killed = j->failed_rank >= 0 && WIFSIGNALED(j->procs[j->failed_rank].status);
      if (j->failed_rank < 0 || (killed && !cause_killed)) {
        j->failed_rank = r;
        j->failed_status = status;
        j->failed_at = time(NULL);
      }
      j->killed += killed;
      if (*grace_until == 0) *grace_until = lz_now_s() + 0.5;
      if (killed) *grace_until = lz_now_s();
    }
  }
}

/* Watches the ranks until every one has ended: a failed rank or a signal to
 * the launcher stops the others. Returns the job's exit code. */
static int supervise(job *j) {
  double grace_until = 0;
  if (got_signal)
    fprintf(stderr, "luazero: received %s during start-up; stopping the %d rank%s started\n",
            signal_name(got_signal), j->running, j->running == 1 ? "" : "s");
  if (got_signal || j->stopping) stop_all(j, got_signal ? stop_grace() : 3.0);
  sig_atomic_t signals_at_stop = signals_got;
  double stopped_at = lz_now_s();
  while (j->running > 0) {
    relay_output(j, 100);
    reap(j, &grace_until);
    if (j->failed_rank >= 0 && !j->stopping && (lz_now_s() >= grace_until || !j->running)) {
      char how[96];
      describe(j->procs[j->failed_rank].status, how, sizeof how);
      if (j->running > 0)
        fprintf(stderr, "luazero: rank %d %s; stopping the other %d rank%s\n", j->failed_rank,
                how, j->running, j->running == 1 ? "" : "s");
      else fprintf(stderr, "luazero: rank %d %s\n", j->failed_rank, how);
      stop_all(j, 3.0);
      stopped_at = lz_now_s();
    }
    if (got_signal && !j->stopping) {
      fprintf(stderr, "luazero: received %s; stopping %d rank%s\n", signal_name(got_signal),
              j->running, j->running == 1 ? "" : "s");
      stop_all(j, stop_grace());
      signals_at_stop = signals_got;
      stopped_at = lz_now_s();
    } else if (j->stopping && signals_got != signals_at_stop) {
      /* a second signal a second or more after the stop: SIGKILL at once */
      signals_at_stop = signals_got;
      if (lz_now_s() - stopped_at >= 1.0 && j->kill_at > lz_now_s()) {
        fprintf(stderr, "luazero: received %s again; killing %d rank%s\n",
                signal_name(got_signal), j->running, j->running == 1 ? "" : "s");
        j->kill_at = lz_now_s();
      }
    }
    if (j->stopping && j->running > 0 && lz_now_s() > j->kill_at) {
      if (got_signal && lz_now_s() - stopped_at >= stop_grace())
        fprintf(stderr, "luazero: %d rank%s still running %.0f s after the stop "
                "(LZ_STOP_GRACE); killing them\n", j->running, j->running == 1 ? "" : "s",
                lz_now_s() - stopped_at);
      kill_all(j, SIGKILL);
      j->kill_at = lz_now_s() + 1e9;
    }
  }
  /* What the ranks wrote before exiting (bounded: a grandchild may hold a pipe). */
  for (double until = lz_now_s() + 1.0; lz_now_s() < until && relay_output(j, 50) > 0;) {
  }
  if (j->failed_rank >= 0) {
    int code = status_code(j->procs[j->failed_rank].status);
    return code ? code : 1;
  }
  int done = 1; /* a signal every rank finished despite (each exited 0): the job is done */
  for (int r = 0; r < j->nranks; r++)
    done &= j->procs[r].pid > 0 && WIFEXITED(j->procs[r].status) && !WEXITSTATUS(j->procs[r].status);
  return got_signal && !done ? 128 + got_signal : 0;
}

static void tear_down(job *j) {
  if (j->segment >= 0) close(j->segment);
  if (j->memfds) lz_shared_close(j->nranks, j->memfds);
  free(j->memfds);
  free(j->shared);
  for (int i = 0; j->streams && i < j->nranks * 2; i++) {
    stream *s = &j->streams[i];
    if (s->fd >= 0) {
      if (s->len) emit_line(s, s->line, s->len);
      close(s->fd);
    }
    free(s->line);
  }
  free(j->procs);
  free(j->streams);
  free(j->pfds);
}

/* Everything up to the first fork: the segment, the ranks' shared memory
 * and the launcher's tables. */
static lz_status prepare(job *j) {
  LZ_TRY(make_segment(j));
  j->threads = cpus_available() / j->nranks;
  if (j->threads < 1) j->threads = 1;
  j->port = free_port();
  size_t n = (size_t)j->nranks;
  j->memfds = calloc(n, sizeof *j->memfds);
  j->procs = calloc(n, sizeof *j->procs);
  j->streams = calloc(n * 2, sizeof *j->streams);
  j->pfds = calloc(n * 2, sizeof *j->pfds);
  if (!j->memfds || !j->procs || !j->streams || !j->pfds)
    return lz_fail(LZ_ERR_NOMEM, "launch: out of memory");
  for (size_t i = 0; i < n * 2; i++) j->streams[i].fd = -1;
  j->shared = lz_shared_create(j->nranks, j->memfds);
  return LZ_OK;
}

/* Runs the job once: its ranks from start to end. *code: the job's exit
 * code. */
static lz_status run_once(job *j, int *code) {
  lz_status st = LZ_OK;
  if (!got_signal) st = prepare(j);
  if (st == LZ_OK && !got_signal) st = fork_ranks(j);
  if (j->procs) {
    j->stopping = st != LZ_OK;
    int c = supervise(j);
    if (st == LZ_OK) *code = c;
  } else if (st == LZ_OK && got_signal) {
    fprintf(stderr, "luazero: received %s during start-up; no rank was started\n",
            signal_name(got_signal));
    *code = 128 + got_signal;
  }
  tear_down(j);
  return st;
}

/* After a failed run (torn down: only the failure's fields are left): the
 * world size of the next one (0: none), saying why on stderr. Ranks killed
 * by a signal are lost under min_ranks (they died; the others were
 * stopped); with none killed, the failed rank is. */
static int next_world(job *j, int min_ranks, int *exit_code) {
  char how[96], when[32];
  struct tm tm;
  describe(j->failed_status, how, sizeof how);
  gmtime_r(&j->failed_at, &tm);
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  snprintf(j->cause, sizeof j->cause, "rank %d %s at %s", j->failed_rank, how, when);
  int lost = j->killed > 0 ? j->killed : 1;
  int world = min_ranks > 0 ? j->nranks - lost : j->nranks;
  if (j->restart >= j->restarts) {
    fprintf(stderr, "luazero: %s; no restart left (%d restart%s used, --restarts %d)\n", j->cause,
            j->restarts, j->restarts == 1 ? "" : "s", j->restarts);
    *exit_code = 1;
    return 0;
  }
  if (world < min_ranks) {
    fprintf(stderr, "luazero: %s; %d rank%s left, fewer than --min-ranks %d: not restarting\n",
            j->cause, world, world == 1 ? "" : "s", min_ranks);
    *exit_code = 1;
    return 0;
  }
  fprintf(stderr, "luazero: %s; restart %d of %d on %d rank%s", j->cause, j->restart + 1,
          j->restarts, world, world == 1 ? "" : "s");
  if (min_ranks > 0) fprintf(stderr, " (%d lost, --min-ranks %d)", j->nranks - world, min_ranks);
  fprintf(stderr, "\n");
  return world;
}

lz_status lz_launch_restarting(int nranks, char *const *argv, int restarts, int min_ranks,
                               int *exit_code) {
  if (!exit_code) return lz_fail(LZ_ERR_INVALID, "launch: exit_code is NULL");
  *exit_code = 1;
  if (restarts < 0)
    return lz_fail(LZ_ERR_INVALID, "launch: --restarts %d: must be 0 or more", restarts);
  if (min_ranks < 0 || min_ranks > nranks)
    return lz_fail(LZ_ERR_INVALID, "launch: --min-ranks %d: must be 1..%d (-n %d)", min_ranks,
                   nranks, nranks);
  signals_catch();
  job j = {.nranks = nranks, .argv = argv, .segment = -1, .failed_rank = -1, .restarts = restarts};
  lz_status st = check_args(nranks, argv, &j.mode);
  /* LZ_BACKEND as the ranks will read it; a bad name is their one-line refusal. */
  const char *backend = getenv("LZ_BACKEND");
  lz_comm_backend asked;
  const lz_comm_backend_entry *be = backend && *backend &&
                                    lz_comm_backend_parse(backend, &asked) == LZ_OK
                                        ? lz_comm_backend_entry_of(asked)
                                        : NULL;
  /* A backend of one rank (local) under -n N would run N jobs of one rank
   * each, writing the same files: refused before any starts. */
  if (st == LZ_OK && be && be->max_ranks && nranks > be->max_ranks)
    st = lz_fail(LZ_ERR_INVALID, "launch: --backend %s (LZ_BACKEND) serves at most %d rank%s, "
                 "but -n asks for %d: use shm (the default) or mpi, or drop -n", be->name,
                 be->max_ranks, be->max_ranks == 1 ? "" : "s", nranks);
  if (st == LZ_OK && be && be->under_mpirun) {
    if (restarts > 0)
      st = lz_fail(LZ_ERR_INVALID, "launch: --restarts %d under --backend %s: mpirun does not "
                   "say which rank failed; restart under the shm backend (the default)", restarts,
                   be->name);
    else st = launch_mpirun(nranks, argv, exit_code);
    signals_restore();
    return st;
  }
  while (st == LZ_OK) {
    st = run_once(&j, exit_code);
    if (st != LZ_OK || *exit_code == 0 || got_signal || j.failed_rank < 0) break;
    if (restarts == 0) break; /* as without restarts: the rank's own code */
    if (WIFEXITED(j.failed_status) && WEXITSTATUS(j.failed_status) == 2) {
      /* Bad input fails the same way every time: a restart would only repeat it. */
      fprintf(stderr, "luazero: rank %d refused its input (exit 2): not restarting\n", j.failed_rank);
      break;
    }
    if (WIFSIGNALED(j.failed_status) &&
        (WTERMSIG(j.failed_status) == SIGTERM || WTERMSIG(j.failed_status) == SIGINT)) {
      /* Asked to stop (train.lua --save ends so, saved), not a fault. */
      fprintf(stderr, "luazero: rank %d stopped on %s: not restarting\n", j.failed_rank,
              signal_name(WTERMSIG(j.failed_status)));
      break;
    }
    int world = next_world(&j, min_ranks, exit_code);
    if (!world) break;
    job next = {.nranks = world, .argv = argv, .mode = j.mode, .segment = -1,
                .failed_rank = -1, .restart = j.restart + 1, .restarts = restarts};
    memcpy(next.cause, j.cause, sizeof next.cause);
    j = next;
  }
  signals_restore();
  return st;
}

lz_status lz_launch(int nranks, char *const *argv, int *exit_code) {
  return lz_launch_restarting(nranks, argv, 0, 0, exit_code);
}
