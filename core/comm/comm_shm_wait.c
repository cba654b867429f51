/* comm_shm_wait.c — how the ranks of a shared-memory segment wait for each
 * other (comm_shm.c's barriers): spin while the ranks have a core each, then
 * sleep on a futex in the segment; every 100 ms a sleeper checks the
 * deadline (LZ_COMM_TIMEOUT) and whether the ranks it waits for are still
 * alive, and a long wait says so. Each arrival also carries the collective
 * the rank is running (shm_comm.sig: its number, kind, dtype, count, op,
 * root), and after each barrier every rank compares its peers' with its
 * own: ranks that called different collectives fail there, every one of
 * them, before any reads another's data. */
#define _GNU_SOURCE
#include "comm/comm_shm.h"

#include <errno.h>       /* errno from kill */
#include <linux/futex.h> /* FUTEX_WAIT, FUTEX_WAKE */
#include <sched.h>       /* sched_yield */
#include <signal.h>      /* kill(pid, 0) to check a peer */
#include <stdio.h>       /* snprintf, fprintf */
#include <string.h>      /* strlen */
#include <sys/syscall.h> /* SYS_futex */
#include <unistd.h>      /* getppid, syscall */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static void arrive(shm_comm *s, int me) {
  s->step++;
  for (int i = 0; i < 4; i++)
    atomic_store_explicit(&s->ranks[me].sig[s->step & 1][i], s->sig[i], memory_order_relaxed);
  atomic_store(&s->ranks[me].arrive, s->step);
  atomic_fetch_add(&s->hdr->futex_word, 1);
  if (atomic_load(&s->hdr->sleepers)) futex(&s->hdr->futex_word, FUTEX_WAKE, INT32_MAX, NULL);
}

static int all_arrived(shm_comm *s, int world, uint64_t target) {
  for (int p = 0; p < world; p++)
    if (atomic_load_explicit(&s->ranks[p].arrive, memory_order_acquire) < target) return 0;
  return 1;
}

/* "2, 3" into buf: the ranks that have not reached `target`. */
static const char *missing_ranks(shm_comm *s, int world, uint64_t target, char *buf, size_t len) {
  size_t n = 0;
  buf[0] = 0;
  for (int p = 0; p < world && n < len; p++)
    if (atomic_load(&s->ranks[p].arrive) < target)
      n += (size_t)snprintf(buf + n, len - n, n ? ", %d" : "%d", p);
  return buf;
}

static lz_status check_peers(lz_comm *c, shm_comm *s, uint64_t target, const char *op) {
  for (int p = 0; p < c->size; p++) {
    if (atomic_load(&s->ranks[p].arrive) >= target) continue;
    int state = atomic_load(&s->ranks[p].state);
    int pid = atomic_load(&s->ranks[p].pid);
    if (state == RANK_LEFT)
      return lz_fail(LZ_ERR_COMM,
                     "%s: rank %d is waiting for rank %d, which freed its communicator before "
                     "joining this collective (the ranks called different collectives)",
                     op, c->rank, p);
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
      return lz_fail(LZ_ERR_COMM, "%s: rank %d is waiting for rank %d (pid %d), which has exited%s",
                     op, c->rank, p, pid, state == RANK_EMPTY ? " without joining (before its "
                     "comm.init)" : "");
  }
  if (getppid() == 1)
    return lz_fail(LZ_ERR_COMM, "%s: rank %d: the launcher has exited; stopping", op, c->rank);
  return LZ_OK;
}

/* A wait this long says so on stderr, and again as often: a third of
 * LZ_COMM_TIMEOUT, at most 60 s. */
#define SHM_WAIT_NOTE_S(c) ((c)->timeout_s / 3 < 60.0 ? (c)->timeout_s / 3 : 60.0)

static lz_status wait_arrived(lz_comm *c, shm_comm *s, uint64_t target, const char *op) {
  int world = c->size;
  if (all_arrived(s, world, target)) return LZ_OK;
  double t0 = lz_now_s();
  if (s->spin_s > 0) {
    for (int i = 0;; i++) {
      __builtin_ia32_pause();
      if (all_arrived(s, world, target)) return LZ_OK;
      if ((i & 255) == 255 && lz_now_s() - t0 > s->spin_s) break;
    }
  }
  for (int i = 0; i < 4; i++) { /* a peer may be waiting for this core */
    sched_yield();
    if (all_arrived(s, world, target)) return LZ_OK;
  }
  double deadline = t0 + c->timeout_s, next_check = t0 + 0.1, next_note = t0 + SHM_WAIT_NOTE_S(c);
  struct timespec nap = {0, 20 * 1000 * 1000};
  for (;;) {
    atomic_fetch_add(&s->hdr->sleepers, 1);
    uint32_t v = atomic_load(&s->hdr->futex_word);
    if (!all_arrived(s, world, target)) futex(&s->hdr->futex_word, FUTEX_WAIT, v, &nap);
    atomic_fetch_sub(&s->hdr->sleepers, 1);
    if (all_arrived(s, world, target)) return LZ_OK;
    double t = lz_now_s();
    if (t >= next_check) {
      LZ_TRY(check_peers(c, s, target, op));
      next_check = t + 0.1;
    }
    if (t >= next_note && t < deadline) { /* a long wait is said, not silent */
      char who[256];
      fprintf(stderr, "luazero: %s: rank %d has waited %.0f s for ranks %s (a rank stuck or busy "
              "elsewhere); LZ_COMM_TIMEOUT stops the run at %.0f s\n", op, c->rank, t - t0,
              missing_ranks(s, world, target, who, sizeof who), c->timeout_s);
      next_note = t + SHM_WAIT_NOTE_S(c);
    }
    if (t >= deadline) {
      char who[256];
      return lz_fail(LZ_ERR_TIMEOUT,
                     "%s: rank %d waited %.1f s (LZ_COMM_TIMEOUT) for ranks %s; they never "
                     "joined this collective (a rank stuck, or ranks calling different "
                     "collectives)",
                     op, c->rank, t - t0, missing_ranks(s, world, target, who, sizeof who));
    }
  }
}

/* After the barrier at `target`: every rank arrived there running the same
 * collective, as the same one of its calls. Each rank compares every
 * peer's record, so a mismatch fails every rank at this barrier, before
 * any of them reads a peer's data. */
static lz_status check_sigs(lz_comm *c, shm_comm *s, uint64_t target, const char *op) {
  for (int p = 0; p < c->size; p++) {
    uint64_t peer[4];
    int same = 1;
    for (int i = 0; i < 4; i++) {
      peer[i] = atomic_load_explicit(&s->ranks[p].sig[target & 1][i], memory_order_relaxed);
      same &= peer[i] == s->sig[i];
    }
    if (same) continue;
    char mine[160], theirs[160];
    return lz_fail(LZ_ERR_COMM,
                   "%s: the ranks called different collectives: rank %d's collective #%llu is "
                   "%s, rank %d's #%llu is %s. Every rank must make the same collective calls "
                   "in the same order (a call made on some ranks only, such as a save or an "
                   "evaluation under `if rank == 0`, puts them out of step)",
                   op, c->rank, (unsigned long long)s->sig[0],
                   lz_coll_signature_text(s->sig + 1, mine, sizeof mine), p, (unsigned long long)peer[0],
                   lz_coll_signature_text(peer + 1, theirs, sizeof theirs));
  }
  return LZ_OK;
}

static lz_status wait_all(lz_comm *c, shm_comm *s, uint64_t target, const char *op) {
  LZ_TRY(wait_arrived(c, s, target, op));
  return check_sigs(c, s, target, op);
}

void shm_arrive(lz_comm *c, shm_comm *s) { arrive(s, c->rank); }

void shm_wake_all(shm_comm *s) {
  atomic_fetch_add(&s->hdr->futex_word, 1);
  futex(&s->hdr->futex_word, FUTEX_WAKE, INT32_MAX, NULL);
}
lz_status shm_wait(lz_comm *c, shm_comm *s, const char *op) {
  return wait_all(c, s, s->step, op);
}

lz_status shm_barrier(lz_comm *c, shm_comm *s, const char *op) {
  arrive(s, c->rank);
  return wait_all(c, s, s->step, op);
}

