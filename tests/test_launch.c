/* test_launch.c — the launcher's restarts on small shell jobs: a rank
 * SIGKILLed once, restarted on the ranks left with LZ_RESTART and
 * LZ_RESTART_CAUSE set; restarts used up; fewer ranks left than
 * --min-ranks; arguments out of range. The run of scripts/train.lua through
 * a restart is tests/lua/test_restart.lua. */
#include "lz_test.h"

#include <stdio.h>  /* the file counting the runs */
#include <stdlib.h> /* setenv, unsetenv */
#include <unistd.h> /* getpid */

/* Only the launcher's own variables reach the job. */
static void launch_env(void) {
  const char *vars[] = {"LZ_BACKEND", "LZ_SHM_NAME",      "WORLD_SIZE",  "RANK",
                        "LZ_RESTART", "LZ_RESTART_CAUSE", "LZ_RESTARTS", NULL};
  for (int i = 0; vars[i]; i++) unsetenv(vars[i]);
  setenv("LZ_RANK_OUTPUT", "quiet", 1);
}

/* Lines in `path` (the runs rank 0 counted there), then the file removed. */
static int runs_counted(const char *path) {
  FILE *f = fopen(path, "r");
  int n = 0, c;
  while (f && (c = fgetc(f)) != EOF) n += c == '\n';
  if (f) fclose(f);
  remove(path);
  return n;
}

LZ_TEST(launch_restarts_on_the_ranks_left_after_a_rank_is_killed) {
  launch_env();
  /* The first run: rank 2 kills itself. The restart: 2 ranks, told why. */
  char *argv[] = {
      "/bin/sh", "-c",
      "if [ -z \"$LZ_RESTART\" ]; then [ $RANK = 2 ] && kill -9 $$; exec sleep 30; fi; "
      "test \"$WORLD_SIZE\" = 2 && test \"$LZ_RESTART\" = 1 && "
      "test \"$LZ_RESTARTS\" = 1 && "
      "case \"$LZ_RESTART_CAUSE\" in \"rank 2 was killed by signal 9 (SIGKILL) at \"*Z) ;; "
      "*) exit 5 ;; esac",
      NULL};
  int code = -1;
  CHECK_OK(lz_launch_restarting(3, argv, 1, 2, &code));
  CHECK_EQ_INT(code, 0);
  /* Without --min-ranks the restart has all 3 ranks: WORLD_SIZE=2 fails it. */
  CHECK_OK(lz_launch_restarting(3, argv, 1, 0, &code));
  CHECK_EQ_INT(code, 1);
  unsetenv("LZ_RANK_OUTPUT");
}

LZ_TEST(launch_gives_up_when_restarts_are_used_or_too_few_ranks_are_left) {
  launch_env();
  char path[64], cmd[256];
  snprintf(path, sizeof path, "/tmp/lz-test-launch-%d", (int)getpid());
  snprintf(cmd, sizeof cmd,
           "[ $RANK = 0 ] && echo run >> %s; [ $RANK = 1 ] && exit 3; exec sleep 30", path);
  char *argv[] = {"/bin/sh", "-c", cmd, NULL};
  int code = -1;
  /* Every run fails: the first and 2 restarts, then exit 1. */
  CHECK_OK(lz_launch_restarting(2, argv, 2, 0, &code));
  CHECK_EQ_INT(code, 1);
  CHECK_EQ_INT(runs_counted(path), 3);
  /* One rank lost of 2, at least 2 wanted: no restart. */
  CHECK_OK(lz_launch_restarting(2, argv, 3, 2, &code));
  CHECK_EQ_INT(code, 1);
  CHECK_EQ_INT(runs_counted(path), 1);
  /* No restarts: the rank's own code, as lz_launch. */
  CHECK_OK(lz_launch_restarting(2, argv, 0, 0, &code));
  CHECK_EQ_INT(code, 3);
  CHECK_EQ_INT(runs_counted(path), 1);
  unsetenv("LZ_RANK_OUTPUT");
}

LZ_TEST(launch_refuses_restart_arguments_out_of_range) {
  launch_env();
  char *argv[] = {"/bin/true", NULL};
  int code = -1;
  CHECK_ERR(lz_launch_restarting(3, argv, 1, 4, &code), LZ_ERR_INVALID,
            "--min-ranks 4: must be 1..3");
  CHECK_ERR(lz_launch_restarting(3, argv, -1, 0, &code), LZ_ERR_INVALID, "--restarts -1");
  setenv("LZ_BACKEND", "mpi", 1);
  CHECK_ERR(lz_launch_restarting(2, argv, 1, 0, &code), LZ_ERR_INVALID, "under --backend mpi");
  unsetenv("LZ_BACKEND");
  unsetenv("LZ_RANK_OUTPUT");
}
