/* main.c — the luazero executable: LuaJIT with the luazero package on its
 * path, the launcher (-n N) and a plain REPL.
 *
 *   luazero script.lua args...      run a script (arg[0] = script, arg[1..] = args)
 *   luazero -e 'code'               run a chunk
 *   luazero -n 4 script.lua ...     four ranks on this machine (shared memory)
 *   luazero -i script.lua ...       the REPL after the script (or after its error)
 *   luazero                         the REPL
 */
#include "luazero.h"

#include <lauxlib.h> /* luaL_newstate, luaL_loadfile */
#include <libgen.h>  /* dirname */
#include <limits.h>  /* PATH_MAX */
#include <lua.h>     /* the Lua C API */
#include <lualib.h>  /* luaL_openlibs */
#include <stdio.h>   /* fprintf, fgets */
#include <stdlib.h>  /* setenv, getenv, strtol */
#include <string.h>  /* strcmp */
#include <unistd.h>  /* readlink, isatty */

static const char *usage =
    "usage: luazero [options] [script.lua [args...]]\n"
    "  -e CODE          run CODE (may be given more than once)\n"
    "  -i               enter the REPL after the script (also when it fails)\n"
    "  -n N             run N ranks of the script on this machine\n"
    "  --backend NAME   collective backend for -n: shm (default) or mpi\n"
    "  --quiet-ranks    with -n: silence the output of ranks other than 0\n"
    "  --version        print the version\n"
    "  --help           print this help\n"
    "With no script and no -e, starts the REPL.\n";

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
  char *dir = dirname(exe);        /* build/bin */
  char *up = dirname(dirname(dir)); /* the root */
  snprintf(root, len, "%s", up);
}

static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) msg = "(error object is not a string)";
  /* A luazero user error (a table or a string starting "luazero:") needs no
   * traceback; everything else gets one. */
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static int run_chunk(lua_State *L, int nargs) {
  int base = lua_gettop(L) - nargs;
  lua_pushcfunction(L, traceback);
  lua_insert(L, base);
  int st = lua_pcall(L, nargs, 0, base);
  lua_remove(L, base);
  if (st != 0) {
    fprintf(stderr, "luazero: %s\n", lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return st;
}

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

/* The REPL: a line at a time; "=expr" or a bare expression prints its values;
 * an incomplete chunk asks for more lines. */
static void repl(lua_State *L) {
  char line[4096], chunk[65536];
  size_t used = 0;
  int tty = isatty(0);
  if (tty) printf("luazero %s  (LuaJIT; `lz = require \"luazero\"`; Ctrl-D quits)\n", lz_version());
  for (;;) {
    if (tty) {
      fputs(used ? ">> " : "> ", stdout);
      fflush(stdout);
    }
    if (!fgets(line, sizeof line, stdin)) break;
    size_t n = strlen(line);
    if (used + n + 1 >= sizeof chunk) used = 0;
    memcpy(chunk + used, line, n + 1);
    used += n;
    /* Try as an expression first, then as a statement. */
    char expr[65536 + 16];
    snprintf(expr, sizeof expr, "return %s", chunk[0] == '=' ? chunk + 1 : chunk);
    int st = luaL_loadbuffer(L, expr, strlen(expr), "=stdin");
    if (st != 0) {
      lua_pop(L, 1);
      st = luaL_loadbuffer(L, chunk, used, "=stdin");
    }
    if (st == LUA_ERRSYNTAX) {
      const char *msg = lua_tostring(L, -1);
      if (strstr(msg, "<eof>")) { /* incomplete: read more */
        lua_pop(L, 1);
        continue;
      }
      fprintf(stderr, "%s\n", msg);
      lua_pop(L, 1);
      used = 0;
      continue;
    }
    used = 0;
    int top = lua_gettop(L) - 1;
    lua_pushcfunction(L, traceback);
    lua_insert(L, top + 1);
    if (lua_pcall(L, 0, LUA_MULTRET, top + 1) != 0) {
      fprintf(stderr, "%s\n", lua_tostring(L, -1));
      lua_settop(L, top);
      continue;
    }
    int nres = lua_gettop(L) - (top + 1);
    if (nres > 0) {
      lua_getglobal(L, "print");
      for (int i = 0; i < nres; i++) lua_pushvalue(L, top + 2 + i);
      if (lua_pcall(L, nres, 0, 0) != 0) fprintf(stderr, "%s\n", lua_tostring(L, -1));
    }
    lua_settop(L, top);
  }
  if (tty) printf("\n");
}

int main(int argc, char **argv) {
  int interactive = 0, nranks = 0, quiet = 0, first_script = 0;
  const char *backend = NULL;
  int n_exec = 0;
  const char *exec_chunks[64];
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--version")) {
      printf("luazero %s\n", lz_version());
      return 0;
    } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      fputs(usage, stdout);
      return 0;
    } else if (!strcmp(a, "-e")) {
      if (i + 1 >= argc || n_exec == 64) {
        fprintf(stderr, "luazero: -e needs a chunk of Lua code (luazero -e 'print(1)')\n");
        return 2;
      }
      exec_chunks[n_exec++] = argv[++i];
    } else if (!strcmp(a, "-i")) {
      interactive = 1;
    } else if (!strcmp(a, "-n")) {
      char *end = NULL;
      nranks = i + 1 < argc ? (int)strtol(argv[i + 1], &end, 10) : 0;
      if (!end || *end || nranks < 1) {
        fprintf(stderr, "luazero: -n needs a number of ranks >= 1 (got '%s')\n",
                i + 1 < argc ? argv[i + 1] : "");
        return 2;
      }
      i++;
    } else if (!strcmp(a, "--backend")) {
      if (i + 1 >= argc || (strcmp(argv[i + 1], "shm") && strcmp(argv[i + 1], "mpi") &&
                            strcmp(argv[i + 1], "local"))) {
        fprintf(stderr, "luazero: --backend takes shm, mpi or local (got '%s')\n",
                i + 1 < argc ? argv[i + 1] : "");
        return 2;
      }
      backend = argv[++i];
    } else if (!strcmp(a, "--quiet-ranks")) {
      quiet = 1;
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

  if (nranks > 0) {
    /* Each rank runs this executable again without -n: fork+exec keeps
     * OpenMP state out of the children. */
    if (!first_script && !n_exec) {
      fprintf(stderr, "luazero: -n needs a script to run (luazero -n 2 train.lua ...)\n");
      return 2;
    }
    char *child[512];
    int c = 0;
    child[c++] = "/proc/self/exe";
    for (int k = 0; k < n_exec && c < 508; k++) {
      child[c++] = "-e";
      child[c++] = (char *)exec_chunks[k];
    }
    if (interactive) child[c++] = "-i";
    for (int k = first_script; first_script && k < argc && c < 511; k++) child[c++] = argv[k];
    child[c] = NULL;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      exe[n] = 0;
      child[0] = exe;
    }
    int code = 1;
    if (lz_launch(nranks, child, &code) != LZ_OK) {
      fprintf(stderr, "luazero: %s\n", lz_last_error());
      return 1;
    }
    return code;
  }

  /* A rank's output goes through the launcher's pipes: flush it by line so
   * it arrives while the job runs. */
  if (getenv("LZ_SHM_NAME") || getenv("OMPI_COMM_WORLD_RANK")) setvbuf(stdout, NULL, _IOLBF, 0);

  lua_State *L = luaL_newstate();
  if (!L) {
    fprintf(stderr, "luazero: cannot create a Lua state (out of memory)\n");
    return 1;
  }
  luaL_openlibs(L);
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
    if (luaL_loadfile(L, strcmp(script, "-") ? script : NULL) != 0) {
      const char *msg = lua_tostring(L, -1);
      if (strstr(msg, "cannot open"))
        fprintf(stderr, "luazero: cannot open script '%s' (no such file?)\n", script);
      else
        fprintf(stderr, "luazero: %s\n", msg);
      lua_pop(L, 1);
      status = 1;
    } else {
      int nargs = 0;
      for (int k = first_script + 1; k < argc; k++, nargs++) lua_pushstring(L, argv[k]);
      status = run_chunk(L, nargs);
    }
  }
  if (interactive || (!first_script && !n_exec)) {
    repl(L);
  }
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
