/* test_comm_backends.c — the one table of collective backends
 * (core/comm/backends.c): every row whole, names and enum values unique,
 * each name parsing to its row, and unknown names and values refused with
 * the table's names. */
#include "comm/comm_internal.h" /* the rows themselves: vtables, enum values */
#include "lz_test.h"

#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* setenv, unsetenv */

static void clear_env(void) {
  const char *vars[] = {"LZ_BACKEND", "LZ_SHM_NAME", "OMPI_COMM_WORLD_SIZE",
                        "WORLD_SIZE", "RANK",        NULL};
  for (int i = 0; vars[i]; i++) unsetenv(vars[i]);
}

/* The error names every backend of the table. */
static void check_lists_the_table(const char *what) {
  for (int i = 0; i < lz_comm_backend_count(); i++)
    if (!strstr(lz_last_error(), lz_comm_backend_name_at(i)))
      lz_test_fail(__FILE__, __LINE__, "%s: \"%s\" does not name %s", what, lz_last_error(),
                   lz_comm_backend_name_at(i));
}

LZ_TEST(comm_backend_table_rows_are_whole_and_unique) {
  int n = lz_comm_backend_count();
  CHECK(n >= 1);
  const unsigned kinds = 1u << LZ_CPU | 1u << LZ_CUDA | 1u << LZ_SIM;
  int automatic = 0;
  for (int i = 0; i < n; i++) {
    const lz_comm_backend_entry *e = lz_comm_backend_entry_at(i);
    CHECK(e != NULL);
    if (!e) continue;
    CHECK(e->name && *e->name);
    CHECK(e->about && *e->about);
    CHECK(e->ops && e->ops->init && e->ops->free && e->ops->run);
    CHECK(e->moves != 0 && (e->moves & ~kinds) == 0);
    CHECK(e->id != LZ_COMM_AUTO);
    CHECK(e->available || (e->needs && *e->needs)); /* an absent backend says what it lacks */
    CHECK(e->max_ranks >= 0 && e->auto_rank >= 0);
    if (e->auto_rank && !e->auto_env) automatic++;
    CHECK(lz_comm_backend_entry_of(e->id) == e);
    /* The public accessors read the same row. */
    CHECK(!strcmp(lz_comm_backend_name_at(i), e->name));
    CHECK(!strcmp(lz_comm_backend_about_at(i), e->about));
    CHECK_EQ_INT(lz_comm_backend_moves_at(i), e->moves);
    CHECK_EQ_INT(lz_comm_backend_available_at(i), e->available);
    for (int j = 0; j < i; j++) {
      const lz_comm_backend_entry *o = lz_comm_backend_entry_at(j);
      if (!strcmp(o->name, e->name) || o->id == e->id)
        lz_test_fail(__FILE__, __LINE__, "rows %d and %d share a name or an enum value", j, i);
    }
  }
  /* The automatic choice always has a backend for a world of one. */
  CHECK_EQ_INT(automatic, 1);
  CHECK(lz_comm_backend_entry_at(n) == NULL && lz_comm_backend_entry_at(-1) == NULL);
  CHECK(lz_comm_backend_name_at(n) == NULL && lz_comm_backend_about_at(n) == NULL);
  CHECK_EQ_INT(lz_comm_backend_moves_at(n), 0);
}

LZ_TEST(comm_backend_names_parse_to_their_row) {
  for (int i = 0; i < lz_comm_backend_count(); i++) {
    lz_comm_backend id = LZ_COMM_AUTO;
    CHECK_OK(lz_comm_backend_parse(lz_comm_backend_name_at(i), &id));
    CHECK_EQ_INT(id, lz_comm_backend_entry_at(i)->id);
  }
  lz_comm_backend id = LZ_COMM_LOCAL;
  CHECK_OK(lz_comm_backend_parse("auto", &id));
  CHECK_EQ_INT(id, LZ_COMM_AUTO);
  CHECK_ERR(lz_comm_backend_parse("carrier-pigeon", &id), LZ_ERR_INVALID,
            "'carrier-pigeon' is not a collective backend; use auto, ");
  check_lists_the_table("lz_comm_backend_parse");
  CHECK_ERR(lz_comm_backend_parse("", &id), LZ_ERR_INVALID, "is not a collective backend");
  CHECK_ERR(lz_comm_backend_parse(NULL, &id), LZ_ERR_INVALID, "is not a collective backend");
  /* Names are exact: no case folding, no prefixes. */
  CHECK_ERR(lz_comm_backend_parse("LOCAL", &id), LZ_ERR_INVALID, "not a collective backend");
}

LZ_TEST(comm_backend_unknown_names_and_values_are_refused_with_the_table) {
  clear_env();
  lz_comm *c = NULL;
  setenv("LZ_BACKEND", "carrier-pigeon", 1);
  CHECK_ERR(lz_comm_init(&c, LZ_COMM_AUTO), LZ_ERR_INVALID,
            "comm: LZ_BACKEND=\"carrier-pigeon\" is not a backend; use ");
  check_lists_the_table("LZ_BACKEND");
  unsetenv("LZ_BACKEND");
  CHECK_ERR(lz_comm_init(&c, (lz_comm_backend)99), LZ_ERR_INVALID,
            "comm: backend 99 is not one of auto, ");
  check_lists_the_table("lz_comm_init(99)");
  CHECK(c == NULL);
}

LZ_TEST(comm_backend_automatic_choice_follows_the_table) {
  clear_env();
  lz_comm *c = NULL;
  /* Nothing set, one rank: the row chosen always. */
  CHECK_OK(lz_comm_init(&c, LZ_COMM_AUTO));
  const lz_comm_backend_entry *always = NULL;
  for (int i = 0; i < lz_comm_backend_count(); i++)
    if (lz_comm_backend_entry_at(i)->auto_rank && !lz_comm_backend_entry_at(i)->auto_env)
      always = lz_comm_backend_entry_at(i);
  CHECK(always && !strcmp(lz_comm_backend_name(c), always->name));
  CHECK_OK(lz_comm_free(c));
  c = NULL;
  /* LZ_BACKEND=auto is the automatic choice, as unset. */
  setenv("LZ_BACKEND", "auto", 1);
  CHECK_OK(lz_comm_init(&c, LZ_COMM_AUTO));
  CHECK_OK(lz_comm_free(c));
  c = NULL;
  unsetenv("LZ_BACKEND");
  /* The launcher's variable picks the row that names it; that backend
   * then finds no segment and says so. */
  for (int i = 0; i < lz_comm_backend_count(); i++) {
    const lz_comm_backend_entry *e = lz_comm_backend_entry_at(i);
    if (!e->auto_env || strcmp(e->auto_env, "LZ_SHM_NAME")) continue;
    setenv("LZ_SHM_NAME", "/luazero-no-such-segment", 1);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s: ", e->name);
    lz_status st = lz_comm_init(&c, LZ_COMM_AUTO);
    CHECK(st != LZ_OK);
    CHECK(!strncmp(lz_last_error(), prefix, strlen(prefix)));
    unsetenv("LZ_SHM_NAME");
  }
  /* A world of two with nothing to reach the peers: refused. */
  setenv("WORLD_SIZE", "2", 1);
  CHECK_ERR(lz_comm_init(&c, LZ_COMM_AUTO), LZ_ERR_INVALID, "luazero -n 2");
  clear_env();
  CHECK(c == NULL);
}
