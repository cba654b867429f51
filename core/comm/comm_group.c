/* comm_group.c — sub-groups of a communicator's ranks (lz_comm_group_new):
 * the ranks agree on the lists (one all-gather on the parent, checked whole
 * on every rank, so a disagreement fails everywhere at once), then the
 * backend makes the group's communicator (its vtable's group), which has a
 * queue and progress thread of its own like any other. */
#include "comm/comm_internal.h"

#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* malloc */

/* " 0 2 5" into buf: the ranks a row of the membership table lists, in
 * the list's order. */
static const char *row_list(const int32_t *row, int W, char *buf, size_t len) {
  size_t n = 0;
  buf[0] = 0;
  for (int i = 0; i < W; i++)
    for (int q = 0; q < W && n < len; q++)
      if (row[q] == i) n += (size_t)snprintf(buf + n, len - n, " %d", q);
  return buf;
}

/* Row p of the table: where each parent rank stands in rank p's list (-1:
 * absent; -2 in every entry: rank p's list was invalid). Every rank checks
 * the whole table, so all fail alike or none does. */
static lz_status groups_agree(const lz_comm *parent, const int32_t *table) {
  int W = parent->size;
  char a[256], b[256];
  for (int p = 0; p < W; p++) {
    const int32_t *rp = table + (size_t)p * W;
    if (rp[0] == -2)
      return lz_fail(LZ_ERR_INVALID, "comm_group: rank %d passed an invalid list of ranks (its "
                     "own error says why)", p);
    for (int q = 0; q < W; q++) {
      const int32_t *rq = table + (size_t)q * W;
      if (rp[q] >= 0 && memcmp(rp, rq, sizeof *rp * (size_t)W) != 0)
        return lz_fail(LZ_ERR_INVALID,
                       "comm_group: rank %d joins the group of ranks%s, but rank %d, which it "
                       "lists, passed ranks%s; every member of a group must pass the same list",
                       p, row_list(rp, W, a, sizeof a), q, row_list(rq, W, b, sizeof b));
    }
  }
  return LZ_OK;
}

lz_status lz_comm_group_new(lz_comm *parent, const int *ranks, int n, lz_comm **out) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "comm_group: out is NULL");
  *out = NULL;
  if (!parent) return lz_fail(LZ_ERR_INVALID, "comm_group: parent communicator is NULL");
  int W = parent->size, me = parent->rank;
  int32_t *table = malloc(sizeof *table * (size_t)W * (size_t)(W + 1));
  lz_comm *c = calloc(1, sizeof *c);
  int *list = malloc(sizeof *list * (size_t)(n > 0 ? n : 1));
  if (!table || !c || !list) {
    free(table);
    free(c);
    free(list);
    return lz_fail(LZ_ERR_NOMEM, "comm_group: out of memory");
  }
  /* This rank's row, or why its list is wrong (every rank still takes part
   * in the agreement, so none is left waiting). */
  int32_t *row = table + (size_t)W * W;
  for (int q = 0; q < W; q++) row[q] = -1;
  lz_status mine = LZ_OK;
  if (n < 1 || n > W || !ranks)
    mine = lz_fail(LZ_ERR_INVALID, "comm_group: rank %d: the list has %d ranks; give 1..%d ranks "
                   "of the parent", me, n, W);
  for (int i = 0; mine == LZ_OK && i < n; i++) {
    int r = ranks[i];
    if (r < 0 || r >= W)
      mine = lz_fail(LZ_ERR_INVALID, "comm_group: rank %d: ranks[%d] is %d; the parent's ranks "
                     "are 0..%d", me, i, r, W - 1);
    else if (row[r] >= 0)
      mine = lz_fail(LZ_ERR_INVALID, "comm_group: rank %d: rank %d is listed twice", me, r);
    else row[r] = i, list[i] = r;
  }
  if (mine == LZ_OK && row[me] < 0)
    mine = lz_fail(LZ_ERR_INVALID, "comm_group: rank %d is not in its own list; each rank passes "
                   "the list of the group it joins", me);
  char why[1024] = "";
  if (mine != LZ_OK) {
    snprintf(why, sizeof why, "%s", lz_last_error());
    for (int q = 0; q < W; q++) row[q] = -2;
  }
  lz_status st = lz_comm_hold(parent, "comm_group");
  if (st == LZ_OK) {
    lz_coll_args g = {
        LZ_COLL_ALL_GATHER, row, table, (int64_t)W * W, LZ_I32, LZ_RED_SUM, 0, 0, 0, NULL, NULL, 0};
    st = parent->ops->run(parent, &g);
    if (st == LZ_OK && mine != LZ_OK) st = lz_fail(mine, "%s", why);
    if (st == LZ_OK) st = groups_agree(parent, table);
    if (st == LZ_OK) {
      c->backend = parent->backend;
      c->ops = parent->ops;
      c->timeout_s = parent->timeout_s;
      c->rank = row[me];
      c->size = n;
      c->ranks = list;
      pthread_mutex_init(&c->mu, NULL);
      pthread_cond_init(&c->cv, NULL);
      st = parent->ops->group(parent, c);
      if (st != LZ_OK) {
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
      }
    }
    lz_comm_release(parent, st);
  }
  free(table);
  if (st != LZ_OK) {
    free(list);
    free(c);
    return st;
  }
  *out = c;
  return LZ_OK;
}
