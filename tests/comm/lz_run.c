/* lz_run.c — the launcher without Lua, for the multi-rank tests and the
 * benchmark: `lz_run -n N [--quiet-ranks] program args...` runs N ranks of
 * program through lz_launch and exits with the job's code. */
#include "luazero.h"

#include <limits.h> /* INT_MAX */
#include <stdio.h>  /* fprintf */
#include <stdlib.h> /* strtol, setenv */
#include <string.h> /* strcmp */

int main(int argc, char **argv) {
  int n = 1, i = 1;
  for (; i < argc && argv[i][0] == '-'; i++) {
    if (!strcmp(argv[i], "-n") && i + 1 < argc) {
      char *end;
      long v = strtol(argv[++i], &end, 10);
      n = *end || v < 0 || v > INT_MAX ? 0 : (int)v; /* lz_launch refuses 0 */
    }
    else if (!strcmp(argv[i], "--quiet-ranks")) setenv("LZ_RANK_OUTPUT", "quiet", 1);
    else if (!strcmp(argv[i], "--backend") && i + 1 < argc) setenv("LZ_BACKEND", argv[++i], 1);
    else break;
  }
  if (i >= argc) {
    fprintf(stderr, "usage: lz_run -n N [--quiet-ranks] [--backend shm|mpi] program args...\n");
    return 2;
  }
  int code = 1;
  if (lz_launch(n, argv + i, &code) != LZ_OK) {
    fprintf(stderr, "lz_run: %s\n", lz_last_error());
    return 1;
  }
  return code;
}
