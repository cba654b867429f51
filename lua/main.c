/* main.c — the luazero executable: LuaJIT with the luazero package on its
 * path, the launcher (-n N) and the REPL's line input (the REPL is
 * lua/luazero/ui/repl.lua).
 *
 *   luazero script.lua args...      run a script (arg[0] = script, arg[1..] = args)
 *   luazero -e 'code'               run a chunk
 *   luazero -n 4 script.lua ...     four ranks on this machine (shared memory)
 *   luazero -n 4 --restarts 2 --min-ranks 3 script.lua ...
 *                                   ... run again when a rank fails, on the ranks left
 *   luazero -i script.lua ...       the REPL after the script (or after its error)
 *   luazero                         the REPL
 */
#include "luazero.h"

#include <editline/readline.h> /* readline's callback interface and history, from libedit */
#include <errno.h>             /* EINTR */
#include <lauxlib.h>           /* luaL_newstate, luaL_loadfile */
#include <libgen.h>            /* dirname */
#include <limits.h>            /* PATH_MAX */
#include <lua.h>               /* the Lua C API */
#include <lualib.h>            /* luaL_openlibs */
#include <poll.h>              /* poll on stdin while the REPL waits */
#include <stdio.h>             /* fprintf, getchar */
#include <stdlib.h>            /* setenv, getenv, strtol, malloc */
#include <signal.h>            /* SIGTERM */
#include <string.h>            /* strcmp, strerror */
#include <time.h>              /* clock_gettime: a second signal's time */
#include <sys/prctl.h>         /* PR_SET_PDEATHSIG: LZ_PARENT_PID */
#include <unistd.h>            /* readlink, isatty */

static const char *usage_head =
    "usage: luazero [options] [script.lua [args...]]\n"
    "  -e CODE          run CODE (may be given more than once)\n"
    "  -m NAME          run the bundled script NAME (train, eval, generate, sweep,\n"
    "                   examples/own_model, ...: scripts/NAME.lua of the install)\n"
    "  -i               enter the REPL after the script (also when it fails)\n"
    "  -n N             run N ranks of the script on this machine\n"
    "  --backend NAME   collective backend (LZ_BACKEND); NAME is auto or one of:\n";
static const char *usage_tail =
    "  --quiet-ranks    with -n: silence the output of ranks other than 0\n"
    "  --restarts K     with -n: run the job again (up to K times) when a rank fails;\n"
    "                   the ranks see LZ_RESTART (default: LZ_RESTARTS, else 0)\n"
    "  --min-ranks M    with --restarts: the ranks that died are lost; restart on those\n"
    "                   left, never fewer than M (default: LZ_MIN_RANKS, else restart on N)\n"
    "  --version        print the version\n"
    "  --help           print this help\n"
    "With no script and no -e, starts the REPL.\n";

/* The options above that a user may also write after the script by mistake:
 * the script's argument parser (luazero.args) names them as luazero's own
 * (LUAZERO_OPTIONS: name -> whether it takes a value). */
static const struct {
  const char *name;
  int takes_value;
} own_options[] = {{"-e", 1},          {"-m", 1},         {"-i", 0},           {"-n", 1},
                   {"--backend", 1},   {"--quiet-ranks", 0}, {"--restarts", 1}, {"--min-ranks", 1}};

static void set_own_options(lua_State *L) {
  lua_newtable(L);
  for (size_t k = 0; k < sizeof own_options / sizeof own_options[0]; k++) {
    lua_pushboolean(L, own_options[k].takes_value);
    lua_setfield(L, -2, own_options[k].name);
  }
  lua_setglobal(L, "LUAZERO_OPTIONS");
}

/* A script run alone (no launcher relaying its end) stopped by SIGINT or
 * SIGTERM says so before it dies of the signal (SA_RESETHAND: the default
 * action again, taken once the handler returns). A script may set its own
 * handlers (scripts/sweep.lua stops gracefully). */
static void say_stopped(int sig) {
  static const char intr[] = "\nluazero: received SIGINT; stopping\n";
  static const char term[] = "luazero: received SIGTERM; stopping\n";
  ssize_t w = sig == SIGINT ? write(2, intr, sizeof intr - 1) : write(2, term, sizeof term - 1);
  (void)w;
  raise(sig);
}

/* SIGINT and SIGTERM take `sa`, each unless the parent ignores it (a
 * background job of a shell script, nohup: it stays ignored); saved[k]
 * set, old[k] holds what SIGINT's (k 0) or SIGTERM's (k 1) was, unless
 * already saved. old NULL: none kept. */
static void stop_signals_take(const struct sigaction *sa, struct sigaction *old, int *saved) {
  const int sigs[] = {SIGINT, SIGTERM};
  for (int k = 0; k < 2; k++) {
    struct sigaction was;
    if (sigaction(sigs[k], NULL, &was) == 0 && was.sa_handler == SIG_IGN) continue;
    if (sigaction(sigs[k], sa, old && !saved[k] ? &old[k] : NULL) == 0 && old) saved[k] = 1;
  }
}

static void say_when_stopped(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = say_stopped;
  sa.sa_flags = SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  stop_signals_take(&sa, NULL, NULL);
}

/* A stop at the next step's end (scripts/train.lua with --save, through
 * LUAZERO_SIGNALS): the first SIGINT or SIGTERM is noted, said once (by
 * rank 0, or a script run alone), and the run saves and stops after its
 * step. One coming within a second of the first is the same request
 * (Ctrl-C reaches a launcher's ranks, then the launcher relays it); a later
 * one stops the process at once, as without. */
static volatile sig_atomic_t stop_signal, stop_quiet;
static struct timespec stop_at;
static struct sigaction stop_old[2]; /* SIGINT's and SIGTERM's before graceful() */
static int stop_saved[2];

static void note_stop(int sig) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (!stop_signal) {
    stop_at = now; /* (before the flag: a second signal reads it once the flag is set) */
    stop_signal = sig;
    static const char intr[] = "\nluazero: received SIGINT: stopping after this step, saving it "
                               "(again to stop at once)\n";
    static const char term[] = "luazero: received SIGTERM: stopping after this step, saving it "
                               "(again to stop at once)\n";
    if (!stop_quiet) {
      ssize_t w = sig == SIGINT ? write(2, intr, sizeof intr - 1) : write(2, term, sizeof term - 1);
      (void)w;
    }
    return;
  }
  double since = (double)(now.tv_sec - stop_at.tv_sec) + 1e-9 * (double)(now.tv_nsec - stop_at.tv_nsec);
  if (since < 1.0) return;
  static const char again[] = "luazero: received the signal again; stopping at once\n";
  if (!stop_quiet) {
    ssize_t w = write(2, again, sizeof again - 1);
    (void)w;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

/* LUAZERO_SIGNALS.graceful(): SIGINT and SIGTERM (unless ignored) noted
 * from now on. */
static int signals_graceful(lua_State *L) {
  (void)L;
  const char *rank = getenv("RANK");
  stop_quiet = rank && strcmp(rank, "0") != 0;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = note_stop;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask); /* one handler at a time: SIGINT and SIGTERM wait for each other */
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGTERM);
  stop_signals_take(&sa, stop_old, stop_saved);
  return 0;
}

/* LUAZERO_SIGNALS.restore(): SIGINT and SIGTERM as before graceful() (a
 * run past its last step stops at once again). */
static int signals_restore(lua_State *L) {
  (void)L;
  const int sigs[] = {SIGINT, SIGTERM};
  for (int k = 0; k < 2; k++)
    if (stop_saved[k]) {
      sigaction(sigs[k], &stop_old[k], NULL);
      stop_saved[k] = 0;
    }
  return 0;
}

/* LUAZERO_SIGNALS.pending(): the signal noted (2, 15), or 0. */
static int signals_pending(lua_State *L) {
  lua_pushinteger(L, stop_signal);
  return 1;
}

/* LUAZERO_SIGNALS.die(sig): ends the process by that signal (its default
 * action), as an unhandled one would: the exit status is 128 + sig. */
static int signals_die(lua_State *L) {
  int sig = (int)luaL_checkinteger(L, 1);
  fflush(stdout);
  fflush(stderr);
  signal(sig, SIG_DFL);
  raise(sig);
  _exit(128 + sig);
}

static void set_signals(lua_State *L) {
  lua_newtable(L);
  lua_pushcfunction(L, signals_graceful);
  lua_setfield(L, -2, "graceful");
  lua_pushcfunction(L, signals_pending);
  lua_setfield(L, -2, "pending");
  lua_pushcfunction(L, signals_die);
  lua_setfield(L, -2, "die");
  lua_pushcfunction(L, signals_restore);
  lua_setfield(L, -2, "restore");
  lua_setglobal(L, "LUAZERO_SIGNALS");
}

/* The collective backends, from the library's table (core/comm/backends.c). */
static void print_backends(void) {
  for (int i = 0; i < lz_comm_backend_count(); i++)
    printf("                     %-6s %s%s\n", lz_comm_backend_name_at(i),
           lz_comm_backend_about_at(i),
           lz_comm_backend_available_at(i) ? "" : " (not in this build)");
}

/* The repository root: two levels above build/bin/luazero, unless LUAZERO_HOME says. */
static void find_root(char *root, size_t len) {
  const char *home = getenv("LUAZERO_HOME");
  if (home && *home) {
    snprintf(root, len, "%s", home);
    return;
  }
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    snprintf(root, len, ".");
    return;
  }
  exe[n] = 0;
  char *dir = dirname(exe);         /* build/bin */
  char *up = dirname(dirname(dir)); /* the root */
  snprintf(root, len, "%s", up);
}

/* LZ_DEBUG=1 (anything but empty or 0), or -i (a debugging session after the
 * script): errors come with their traceback. */
static int with_traceback;
static int debug_on(void) {
  const char *d = getenv("LZ_DEBUG");
  return with_traceback || (d && *d && strcmp(d, "0") != 0);
}

/* The length of a "chunk.lua:123: " location before a message, or 0. */
static size_t location_prefix(const char *msg) {
  const char *p = msg;
  while (*p && *p != ':' && *p != ' ') p++;
  if (p - msg < 5 || strncmp(p - 4, ".lua", 4) != 0 || *p != ':') return 0;
  const char *digits = ++p;
  while (*p >= '0' && *p <= '9') p++;
  if (p == digits || p[0] != ':' || p[1] != ' ') return 0;
  return (size_t)(p + 2 - msg);
}

/* Without LZ_DEBUG or -i an error is one line: a luazero message ("name: what is
 * wrong; what to do") loses the Lua location in front of it; anything else
 * keeps it and says how to see the traceback. */
static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) msg = "(error object is not a string)";
  if (debug_on()) {
    luaL_traceback(L, L, msg, 1);
    return 1;
  }
  size_t skip = location_prefix(msg);
  const char *rest = msg + skip;
  const char *word = rest;
  while ((*word >= 'a' && *word <= 'z') || (*word >= '0' && *word <= '9') || *word == '_' ||
         *word == '.' || *word == '-')
    word++;
  if (skip && word > rest && word[0] == ':' && word[1] == ' ')
    lua_pushstring(L, rest);
  else
    lua_pushfstring(L, "%s (LZ_DEBUG=1 shows the traceback)", msg);
  return 1;
}

static int run_chunk_results(lua_State *L, int nargs, int nresults) {
  int base = lua_gettop(L) - nargs;
  lua_pushcfunction(L, traceback);
  lua_insert(L, base);
  int st = lua_pcall(L, nargs, nresults, base);
  lua_remove(L, base);
  if (st != 0) {
    fprintf(stderr, "luazero: %s\n", lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return st;
}

static int run_chunk(lua_State *L, int nargs) { return run_chunk_results(L, nargs, 0); }

static void setup_paths(lua_State *L, const char *root) {
  char buf[4 * PATH_MAX + 256];
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "path");
  snprintf(buf, sizeof buf, "%s/lua/?.lua;%s/lua/?/init.lua;%s/?.lua;%s", root, root, root,
           lua_tostring(L, -1));
  lua_pop(L, 1);
  lua_pushstring(L, buf);
  lua_setfield(L, -2, "path");
  lua_getfield(L, -1, "cpath");
  snprintf(buf, sizeof buf, "%s/build/lib/?.so;%s", root, lua_tostring(L, -1));
  lua_pop(L, 1);
  lua_pushstring(L, buf);
  lua_setfield(L, -2, "cpath");
  lua_pop(L, 1);
  lua_pushstring(L, root);
  lua_setglobal(L, "LUAZERO_ROOT");
}

/* Line input for the REPL (lua/luazero/ui/repl.lua does the rest), as the module
 * luazero.lineedit:
 *
 *   lineedit.read(prompt [, idle_s, on_idle]) -> line without its newline, or nil at EOF
 *   lineedit.tty                                 whether stdin is a terminal
 *
 * On a terminal it edits with libedit and keeps a history in
 * $LUAZERO_HISTORY (default ~/.luazero_history); otherwise it reads plain
 * lines. While it waits, on_idle() runs every idle_s seconds: a multi-rank
 * REPL keeps the other ranks' collective waits short that way. */
static char history_path[PATH_MAX];
static char *edited_line;
static int edited_done;

static void on_edited_line(char *line) {
  edited_line = line;
  edited_done = 1;
  rl_callback_handler_remove(); /* no prompt redrawn after the line */
}

/* Waits until stdin is readable or idle_s passes (then runs on_idle, at
 * stack index 3). Returns 1 when readable, raises on_idle's errors. */
static int wait_input(lua_State *L, double idle_s) {
  for (;;) {
    struct pollfd p = {0, POLLIN, 0};
    int ms = idle_s > 0 ? (int)(idle_s * 1000) : -1;
    int r = poll(&p, 1, ms);
    if (r > 0) return 1;
    if (r < 0 && errno != EINTR)
      return luaL_error(L, "lineedit: poll on stdin: %s", strerror(errno));
    if (r == 0 && lua_isfunction(L, 3)) {
      lua_pushvalue(L, 3);
      lua_call(L, 0, 0);
    }
  }
}

static int lineedit_read_tty(lua_State *L, const char *prompt, double idle_s) {
  edited_line = NULL;
  edited_done = 0;
  rl_callback_handler_install(prompt, on_edited_line);
  while (!edited_done) {
    struct pollfd p = {0, POLLIN, 0};
    int r = poll(&p, 1, idle_s > 0 ? (int)(idle_s * 1000) : -1);
    if (r > 0) {
      rl_callback_read_char();
    } else if (r == 0 && lua_isfunction(L, 3)) {
      lua_pushvalue(L, 3);
      if (lua_pcall(L, 0, 0, 0) != 0) { /* give the terminal back before raising */
        rl_callback_handler_remove();
        return lua_error(L);
      }
    } else if (r < 0 && errno != EINTR) {
      rl_callback_handler_remove();
      return luaL_error(L, "lineedit: poll on stdin: %s", strerror(errno));
    }
  }
  if (!edited_line) {
    lua_pushnil(L);
    return 1;
  }
  const char *s = edited_line;
  while (*s == ' ' || *s == '\t') s++;
  if (*s) {
    add_history(edited_line);
    if (history_path[0] && write_history(history_path) != 0 && history_path[0]) {
      fprintf(stderr,
              "luazero: cannot write the REPL history to %s (set LUAZERO_HISTORY to a "
              "writable file); history is off\n",
              history_path);
      history_path[0] = 0;
    }
  }
  lua_pushstring(L, edited_line);
  free(edited_line);
  edited_line = NULL;
  return 1;
}

static int lineedit_read(lua_State *L) {
  const char *prompt = luaL_optstring(L, 1, "> ");
  double idle_s = luaL_optnumber(L, 2, 0);
  lua_settop(L, 3);
  if (isatty(0)) return lineedit_read_tty(L, prompt, idle_s);
  fflush(stdout); /* no prompt: piped input makes no conversation */
  wait_input(L, idle_s);
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  int c, any = 0;
  /* stdin is unbuffered here (see lineedit_open): poll sees every line. */
  while ((c = getchar()) != EOF && c != '\n') {
    luaL_addchar(&b, (char)c);
    any = 1;
  }
  if (c == EOF && !any) {
    lua_pushnil(L);
    return 1;
  }
  luaL_pushresult(&b);
  return 1;
}

static int lineedit_open(lua_State *L) {
  static int ready;
  if (!ready && isatty(0)) {
    const char *h = getenv("LUAZERO_HISTORY");
    const char *home = getenv("HOME");
    if (h && *h)
      snprintf(history_path, sizeof history_path, "%s", h);
    else if (home && *home)
      snprintf(history_path, sizeof history_path, "%s/.luazero_history", home);
    using_history();
    stifle_history(1000);
    if (history_path[0]) read_history(history_path); /* none yet is fine */
  } else if (!ready) {
    setvbuf(stdin, NULL, _IONBF, 0);
  }
  ready = 1;
  lua_newtable(L);
  lua_pushcfunction(L, lineedit_read);
  lua_setfield(L, -2, "read");
  lua_pushboolean(L, isatty(0));
  lua_setfield(L, -2, "tty");
  return 1;
}

/* The REPL itself is lua/luazero/ui/repl.lua; script_failed says how the
 * script before it ended. */
static int repl(lua_State *L, int script_failed) {
  lua_getglobal(L, "require");
  lua_pushstring(L, "luazero.ui.repl");
  if (run_chunk_results(L, 1, 1) != 0) return 1;
  lua_getfield(L, -1, "run");
  lua_remove(L, -2);
  lua_newtable(L);
  lua_pushboolean(L, script_failed);
  lua_setfield(L, -2, "script_failed");
  return run_chunk_results(L, 1, 0);
}

/* A count flag's value (or an environment variable's): 1 and *out when v is a
 * whole number in lo..hi, else 0 after a line naming `what` and the range. */
static int count_arg(const char *what, const char *v, long lo, long hi, int *out) {
  char *end = NULL;
  errno = 0;
  long n = strtol(v, &end, 10);
  if (errno || end == v || *end || n < lo || n > hi) {
    fprintf(stderr, "luazero: %s takes a whole number from %ld to %ld (got '%s')\n", what, lo, hi,
            v);
    return 0;
  }
  *out = (int)n;
  return 1;
}

/* Under mpirun: the torchrun variables (which scripts read to know their
 * rank) from OpenMPI's, where unset, and the cores shared among the ranks
 * of this machine as the luazero launcher shares them, unless
 * OMP_NUM_THREADS says otherwise. */
static void adopt_mpirun_ranks(void) {
  static const char *names[][2] = {{"RANK", "OMPI_COMM_WORLD_RANK"},
                                   {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"},
                                   {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"},
                                   {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"}};
  if (!getenv("OMPI_COMM_WORLD_RANK")) return;
  for (int i = 0; i < 4; i++) {
    const char *v = getenv(names[i][1]);
    if (v && !getenv(names[i][0])) setenv(names[i][0], v, 0);
  }
  const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  long ranks_here = local ? strtol(local, NULL, 10) : 1;
  if (getenv("OMP_NUM_THREADS") || ranks_here < 1) return;
  int threads = lz_threads_get() / (int)ranks_here; /* the cores this process may use */
  if (threads < 1) threads = 1;
  char buf[16];
  snprintf(buf, sizeof buf, "%d", threads);
  setenv("OMP_NUM_THREADS", buf, 1);
  lz_threads_set(threads);
}

/* LZ_PARENT_PID=N (a sweep sets it for its runs): this process stops with
 * SIGTERM when that parent goes, killed or not, as a launcher's ranks stop
 * when it goes; gone already (this process reparented), it stops now. Not
 * passed on: a launcher's ranks follow the launcher. */
static void follow_parent(void) {
  const char *p = getenv("LZ_PARENT_PID");
  if (!p) return;
  const long want = strtol(p, NULL, 10);
  unsetenv("LZ_PARENT_PID");
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if ((long)getppid() != want) {
    fprintf(stderr, "luazero: the process that started this one (pid %ld, LZ_PARENT_PID) has "
                    "ended; stopping\n", want);
    exit(143);
  }
}

/* A launcher option given twice: refused (the last one would win). */
static int given_twice(const char *flag) {
  fprintf(stderr, "luazero: %s given twice; give it once\n", flag);
  return 2;
}

int main(int argc, char **argv) {
  follow_parent();
  lz_launch_leave_outer_job();
  int interactive = 0, nranks = 0, quiet = 0, first_script = 0, by_name = 0;
  const char *backend = NULL, *restarts_flag = NULL, *min_ranks_flag = NULL;
  int n_exec = 0;
  const char *exec_chunks[64];
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--version")) {
      printf("luazero %s\n", lz_version());
      return 0;
    } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      fputs(usage_head, stdout);
      print_backends();
      fputs(usage_tail, stdout);
      return 0;
    } else if (!strcmp(a, "-e")) {
      if (i + 1 >= argc) {
        fprintf(stderr, "luazero: -e needs a chunk of Lua code (luazero -e 'print(1)')\n");
        return 2;
      }
      if (n_exec == 64) {
        fprintf(stderr, "luazero: at most 64 -e chunks; join some with ';'\n");
        return 2;
      }
      exec_chunks[n_exec++] = argv[++i];
    } else if (!strcmp(a, "-m")) {
      if (i + 1 >= argc || !argv[i + 1][0]) {
        fprintf(stderr, "luazero: -m needs a bundled script's name (luazero -m train --help)\n");
        return 2;
      }
      by_name = 1;
      first_script = i + 1;
      break;
    } else if (!strcmp(a, "-i")) {
      interactive = 1;
      with_traceback = 1;
    } else if (!strcmp(a, "-n")) {
      if (nranks) return given_twice(a);
      const char *v = i + 1 < argc ? argv[++i] : "";
      char *end = NULL;
      errno = 0;
      long n = strtol(v, &end, 10);
      /* The launcher checks the number against the machine; here it only
       * has to be a number that an int holds. */
      if (errno || end == v || *end || n < 1 || n > INT_MAX) {
        fprintf(stderr, "luazero: -n takes a number of ranks from 1 to 4096 (got '%s')\n", v);
        return 2;
      }
      nranks = (int)n;
    } else if (!strcmp(a, "--backend")) {
      if (backend) return given_twice(a);
      lz_comm_backend parsed;
      if (lz_comm_backend_parse(i + 1 < argc ? argv[i + 1] : "", &parsed) != LZ_OK) {
        fprintf(stderr, "luazero: --backend: %s\n", lz_last_error());
        return 2;
      }
      backend = argv[++i];
    } else if (!strcmp(a, "--quiet-ranks")) {
      quiet = 1;
    } else if (!strcmp(a, "--restarts") || !strcmp(a, "--min-ranks")) {
      const char **v = a[2] == 'r' ? &restarts_flag : &min_ranks_flag;
      if (*v) return given_twice(a);
      *v = i + 1 < argc ? argv[++i] : "";
    } else if (a[0] == '-' && a[1] != 0) {
      fprintf(stderr, "luazero: unknown option '%s' (see luazero --help)\n", a);
      return 2;
    } else {
      first_script = i;
      break;
    }
  }
  if (backend) setenv("LZ_BACKEND", backend, 1);
  if (quiet) setenv("LZ_RANK_OUTPUT", "quiet", 1);

  if (!nranks && (restarts_flag || min_ranks_flag)) {
    fprintf(stderr, "luazero: %s restarts the ranks of a job: give -n N too (luazero -n 2 "
            "--restarts 1 train.lua ...)\n", restarts_flag ? "--restarts" : "--min-ranks");
    return 2;
  }

  if (nranks > 0) {
    /* Each rank runs this executable again without -n: fork+exec keeps
     * OpenMP state out of the children. */
    if (!first_script && !n_exec) {
      fprintf(stderr, "luazero: -n needs a script to run (luazero -n 2 train.lua ...)\n");
      return 2;
    }
    /* A script that is not there: said once, before any rank starts. */
    if (first_script && !by_name && strcmp(argv[first_script], "-") &&
        access(argv[first_script], R_OK) != 0) {
      fprintf(stderr, "luazero: cannot open script '%s' (%s)\n", argv[first_script],
              strerror(errno));
      return 2;
    }
    /* Restarts: the flags, else LZ_RESTARTS and LZ_MIN_RANKS (only here: the
     * ranks, run without -n, inherit them). */
    int restarts = 0, min_ranks = 0;
    const char *r_env = getenv("LZ_RESTARTS"), *m_env = getenv("LZ_MIN_RANKS");
    const char *r_src = restarts_flag ? "--restarts" : "LZ_RESTARTS";
    const char *m_src = min_ranks_flag ? "--min-ranks" : "LZ_MIN_RANKS";
    const char *r_val = restarts_flag ? restarts_flag : r_env && *r_env ? r_env : NULL;
    const char *m_val = min_ranks_flag ? min_ranks_flag : m_env && *m_env ? m_env : NULL;
    if (r_val && !count_arg(r_src, r_val, 0, 1000, &restarts)) return 2;
    if (m_val && !count_arg(m_src, m_val, 1, 4096, &min_ranks)) return 2;
    if (m_val && min_ranks > nranks) {
      fprintf(stderr, "luazero: %s %d is more than -n %d: a restart never has more ranks than the "
              "first run; give %s 1..%d\n", m_src, min_ranks, nranks, m_src, nranks);
      return 2;
    }
    if (min_ranks_flag && !restarts) {
      fprintf(stderr, "luazero: --min-ranks %d does nothing without --restarts K: add --restarts "
              "(how many times to run the job again)\n", min_ranks);
      return 2;
    }
    /* every argument passed on: the exe, each -e and its chunk, -i, -m,
     * the script and its arguments, the NULL */
    char **child = malloc(sizeof *child * (size_t)(2 * n_exec + argc + 4));
    if (!child) {
      fprintf(stderr, "luazero: out of memory for %d arguments\n", argc);
      return 1;
    }
    int c = 0;
    child[c++] = "/proc/self/exe";
    for (int k = 0; k < n_exec; k++) {
      child[c++] = "-e";
      child[c++] = (char *)exec_chunks[k];
    }
    if (interactive) child[c++] = "-i";
    if (by_name) child[c++] = "-m";
    for (int k = first_script; first_script && k < argc; k++) child[c++] = argv[k];
    child[c] = NULL;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      exe[n] = 0;
      child[0] = exe;
    }
    int code = 1;
    lz_status st = lz_launch_restarting(nranks, child, restarts, min_ranks, &code);
    free(child);
    if (st != LZ_OK) {
      fprintf(stderr, "luazero: %s\n", lz_last_error());
      return st == LZ_ERR_INVALID ? 2 : 1; /* a job this machine cannot run is bad input */
    }
    return code;
  }

  adopt_mpirun_ranks();
  /* A rank's output goes through the launcher's pipes: flush it by line so
   * it arrives while the job runs. */
  if (getenv("LZ_SHM_NAME") || getenv("OMPI_COMM_WORLD_RANK")) setvbuf(stdout, NULL, _IOLBF, 0);
  /* --quiet-ranks under mpirun, whose output the launcher does not carry:
   * ranks other than 0 silence their own stdout. */
  const char *om = getenv("LZ_RANK_OUTPUT"), *mpi_rank = getenv("OMPI_COMM_WORLD_RANK");
  if (om && !strcmp(om, "quiet") && mpi_rank && strcmp(mpi_rank, "0") &&
      !freopen("/dev/null", "w", stdout))
    fprintf(stderr, "luazero: rank %s: cannot silence stdout (--quiet-ranks): %s\n", mpi_rank,
            strerror(errno));

  lua_State *L = luaL_newstate();
  if (!L) {
    fprintf(stderr, "luazero: cannot create a Lua state (out of memory)\n");
    return 1;
  }
  luaL_openlibs(L);
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, lineedit_open);
  lua_setfield(L, -2, "luazero.lineedit");
  lua_pop(L, 2);
  char root[PATH_MAX];
  find_root(root, sizeof root);
  setup_paths(L, root);

  /* arg, as the standalone lua sets it. */
  lua_newtable(L);
  for (int k = 0; k < argc; k++) {
    lua_pushstring(L, argv[k]);
    lua_rawseti(L, -2, first_script ? k - first_script : k - argc);
  }
  lua_setglobal(L, "arg");
  int repl_after = interactive || (!first_script && !n_exec);
  /* (a rank of a job: its launcher says it, once; ours, OpenMPI's, MPICH's, Slurm's) */
  if (!repl_after && !getenv("LZ_SHM_NAME") && !getenv("OMPI_COMM_WORLD_RANK") &&
      !getenv("PMI_RANK") && !getenv("SLURM_PROCID"))
    say_when_stopped();
  /* A script can keep what the REPL should see (scripts/train.lua keeps its engine). */
  lua_pushboolean(L, repl_after);
  lua_setglobal(L, "LUAZERO_INTERACTIVE");
  set_own_options(L);
  set_signals(L);

  int status = 0;
  for (int k = 0; k < n_exec && status == 0; k++) {
    if (luaL_loadbuffer(L, exec_chunks[k], strlen(exec_chunks[k]), "=(command line)") != 0) {
      fprintf(stderr, "luazero: %s\n", lua_tostring(L, -1));
      lua_pop(L, 1);
      status = 1;
    } else {
      status = run_chunk(L, 0);
    }
  }
  if (status == 0 && first_script) {
    const char *script = argv[first_script];
    char bundled[PATH_MAX + 64];
    if (by_name) {
      /* (-m train and -m train.lua alike) */
      const size_t sl = strlen(script);
      const int has_ext = sl > 4 && !strcmp(script + sl - 4, ".lua");
      snprintf(bundled, sizeof bundled, "%s/scripts/%s%s", root, script, has_ext ? "" : ".lua");
      if (strstr(script, "..") || access(bundled, R_OK) != 0) {
        fprintf(stderr, "luazero: -m %s: no bundled script %s; the bundled scripts are the .lua "
                "files under %s/scripts (luazero -m train, -m examples/own_model)\n", script,
                bundled, root);
        fflush(NULL);
        _exit(2);
      }
      script = bundled;
    }
    if (luaL_loadfile(L, strcmp(script, "-") ? script : NULL) != 0) {
      const char *msg = lua_tostring(L, -1);
      if (strstr(msg, "cannot open")) {
        fprintf(stderr, "luazero: cannot open script '%s' (no such file?)\n", script);
        fflush(NULL);
        _exit(2); /* bad input, as everywhere */
      }
      fprintf(stderr, "luazero: %s\n", msg);
      lua_pop(L, 1);
      status = 1;
    } else {
      int nargs = 0;
      for (int k = first_script + 1; k < argc; k++, nargs++) lua_pushstring(L, argv[k]);
      status = run_chunk(L, nargs);
    }
  }
  if (repl_after && repl(L, status != 0) != 0) status = 1;
  /* A failed script exits without lua_close: closing would run finalizers
   * (an MPI communicator's among them) that make peers wait out a timeout
   * instead of being stopped at once. */
  if (status) {
    fflush(NULL);
    _exit(1);
  }
  lua_close(L);
  return 0;
}
