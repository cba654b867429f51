/* swap.c — the NVMe tier: a swap file read and written through libaio.
 *
 * A request (lz_swap_read/lz_swap_write) goes on a FIFO queue; I/O threads,
 * each with its own io_context, take it apart into block_size pieces and keep
 * up to queue_depth pieces in flight each, so one large request uses every
 * thread and several small ones overlap. A piece that completes short or with
 * an error fails its request, which stops handing out further pieces; the
 * first error's message (file, offset, reason) is kept for lz_swap_wait.
 *
 * The file is created 0600 under a unique name, unlinked at once (it cannot
 * outlive the process, however the process ends), preallocated so a full disk
 * fails at open, and switched to O_DIRECT where the file system allows it. */
#define _GNU_SOURCE /* O_DIRECT */
#include "mem/lz_internal.h"

#include <errno.h>     /* errno codes */
#include <fcntl.h>     /* open, fcntl, posix_fallocate */
#include <libaio.h>    /* io_setup, io_submit, io_getevents */
#include <limits.h>    /* PATH_MAX: the folders warned about */
#include <pthread.h>   /* I/O threads, queue lock, completion condvars */
#include <stdatomic.h> /* byte counters, the file name counter */
#include <stdio.h>     /* snprintf, fprintf for the buffered-I/O warning */
#include <stdlib.h>    /* calloc, free */
#include <string.h>    /* strcmp, strerror */
#include <sys/stat.h>  /* stat */
#include <unistd.h>    /* unlink, close, getpid, usleep */

#define ALIGN 4096
#define MAX_THREADS 64
#define MAX_QUEUE_DEPTH 1024
#define ERR_LEN 1024

struct lz_swap_req {
  lz_swap *swap;
  int is_write;
  int64_t offset; /* in the file */
  char *buf;
  int64_t bytes;
  int64_t handed; /* bytes handed out to I/O threads so far */
  int inflight;   /* pieces handed out and not yet completed */
  int done;
  int failed;
  char err[ERR_LEN];
  lz_swap_req *next_queued;           /* the pending queue (requests with pieces left) */
  lz_swap_req *prev_live, *next_live; /* every request not yet waited on */
};

/* One piece in flight: an iocb and what it belongs to. */
typedef struct {
  struct iocb cb;
  lz_swap_req *req;
  int64_t offset; /* in the file */
  int64_t len;
} piece;

typedef struct {
  lz_swap *swap;
  io_context_t ctx;
  pthread_t thread;
  int started;
  piece *pieces;   /* queue_depth slots */
  int *free_slots; /* stack of free slot indices */
  int n_free;
  struct iocb **cbs;       /* queue_depth: a batch to submit */
  struct io_event *events; /* queue_depth: completions */
} worker;

struct lz_swap {
  int fd;
  int direct;
  int64_t size;
  char path[768]; /* ERR_LEN leaves room for it in a message */
  lz_swap_opts opts;
  pthread_mutex_t mu;
  pthread_cond_t work_cv; /* I/O threads wait here for requests */
  pthread_cond_t done_cv; /* callers wait here for completions */
  lz_swap_req *queue_head, *queue_tail;
  lz_swap_req *live; /* every request not yet waited on */
  int stopping;
  worker *workers;
  atomic_uint_fast64_t bytes_read, bytes_written;
};

void lz_swap_opts_default(lz_swap_opts *o) {
  o->block_size = 1 << 20;
  o->queue_depth = 8;
  o->thread_count = 1;
  o->single_submit = 0;
  o->overlap_events = 1;
}

static lz_status check_opts(const lz_swap_opts *o) {
  if (o->block_size <= 0 || o->block_size % ALIGN)
    return lz_fail(LZ_ERR_INVALID,
                   "swap: aio.block_size %lld is not a multiple of 4096 (O_DIRECT transfers "
                   "whole pages; e.g. 1048576)",
                   (long long)o->block_size);
  if (o->queue_depth < 1 || o->queue_depth > MAX_QUEUE_DEPTH)
    return lz_fail(LZ_ERR_INVALID, "swap: aio.queue_depth %d must be 1..%d (e.g. 8)",
                   o->queue_depth, MAX_QUEUE_DEPTH);
  if (o->thread_count < 1 || o->thread_count > MAX_THREADS)
    return lz_fail(LZ_ERR_INVALID, "swap: aio.thread_count %d must be 1..%d (e.g. 1)",
                   o->thread_count, MAX_THREADS);
  if (o->single_submit != 0 && o->single_submit != 1)
    return lz_fail(LZ_ERR_INVALID, "swap: aio.single_submit %d must be 0 or 1 (false or true)",
                   o->single_submit);
  if (o->overlap_events != 0 && o->overlap_events != 1)
    return lz_fail(LZ_ERR_INVALID, "swap: aio.overlap_events %d must be 0 or 1 (false or true)",
                   o->overlap_events);
  return LZ_OK;
}

/* ------------------------------------------------------------ I/O threads */

/* Caller holds mu. The next piece of the oldest request with pieces left. */
static int take_piece(lz_swap *s, piece *p) {
  lz_swap_req *r = s->queue_head;
  if (!r) return 0;
  int64_t len = r->bytes - r->handed;
  if (len > s->opts.block_size) len = s->opts.block_size;
  p->req = r;
  p->offset = r->offset + r->handed;
  p->len = len;
  char *buf = r->buf + r->handed;
  if (r->is_write)
    io_prep_pwrite(&p->cb, s->fd, buf, (size_t)len, p->offset);
  else
    io_prep_pread(&p->cb, s->fd, buf, (size_t)len, p->offset);
  p->cb.data = p;
  r->handed += len;
  r->inflight++;
  if (r->handed == r->bytes) {
    s->queue_head = r->next_queued;
    if (!s->queue_head) s->queue_tail = NULL;
    r->next_queued = NULL;
  }
  return 1;
}

/* Caller holds mu. Removes a request that still has pieces left (it is then
 * the queue's head: only the head is ever partly handed out). */
static void unqueue_rest(lz_swap *s, lz_swap_req *r) {
  if (r->handed == r->bytes) return;
  r->handed = r->bytes;
  if (s->queue_head == r) {
    s->queue_head = r->next_queued;
    if (!s->queue_head) s->queue_tail = NULL;
  }
  r->next_queued = NULL;
}

/* Caller holds mu. res: bytes transferred, or -errno. */
static void complete_piece(lz_swap *s, piece *p, long res) {
  lz_swap_req *r = p->req;
  if (res == p->len) {
    atomic_fetch_add(r->is_write ? &s->bytes_written : &s->bytes_read, (uint64_t)res);
  } else if (!r->failed) {
    r->failed = 1;
    const char *what = r->is_write ? "write" : "read";
    if (res < 0)
      snprintf(r->err, sizeof r->err, "swap: %s: %s of %lld bytes at offset %lld failed: %s",
               s->path, what, (long long)p->len, (long long)p->offset, strerror((int)-res));
    else
      snprintf(r->err, sizeof r->err,
               "swap: %s: %s of %lld bytes at offset %lld transferred only %ld bytes (short "
               "transfer: the disk is full or failing)",
               s->path, what, (long long)p->len, (long long)p->offset, res);
    unqueue_rest(s, r);
  }
  r->inflight--;
  if (r->handed == r->bytes && r->inflight == 0) {
    r->done = 1;
    pthread_cond_broadcast(&s->done_cv);
  }
}

static void fail_submit(worker *w, piece *p, long err) {
  lz_swap *s = w->swap;
  pthread_mutex_lock(&s->mu);
  complete_piece(s, p, err);
  pthread_mutex_unlock(&s->mu);
  w->free_slots[w->n_free++] = (int)(p - w->pieces);
}

/* Submits cbs[0..n): all at once or one at a time. Pieces the kernel refuses
 * complete with its error. Returns how many are in flight now. -EAGAIN (no
 * room for now: the worker never has more than queue_depth in flight, so
 * this is the kernel's) is tried again after a pause, for at most
 * SUBMIT_AGAIN_MAX tries (about 10 s), then fails the piece: a submission
 * that never gets room ends as an error, not a spinning thread. */
#define SUBMIT_AGAIN_MAX 100000
static int submit(worker *w, struct iocb **cbs, int n) {
  int inflight = 0, i = 0, again = 0;
  while (i < n) {
    int batch = w->swap->opts.single_submit ? 1 : n - i;
    int rc = io_submit(w->ctx, batch, cbs + i);
    if (rc == -EINTR) continue;
    if (rc == -EAGAIN && ++again < SUBMIT_AGAIN_MAX) {
      usleep(100);
      continue;
    }
    again = 0;
    if (rc <= 0) { /* the first of the batch was refused; the rest are tried again */
      fail_submit(w, cbs[i]->data, rc < 0 ? rc : -EIO);
      i++;
      continue;
    }
    inflight += rc;
    i += rc;
  }
  return inflight;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  lz_swap *s = w->swap;
  const int qd = s->opts.queue_depth;
  struct iocb **cbs = w->cbs;
  struct io_event *events = w->events;
  int inflight = 0;
  for (;;) {
    int n_new = 0;
    pthread_mutex_lock(&s->mu);
    /* Without overlap_events a batch is refilled only once it has drained. */
    if (s->opts.overlap_events || inflight == 0) {
      while (inflight + n_new < qd && s->queue_head) {
        piece *p = &w->pieces[w->free_slots[--w->n_free]];
        take_piece(s, p);
        cbs[n_new++] = &p->cb;
      }
    }
    if (inflight + n_new == 0) {
      if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        break;
      }
      pthread_cond_wait(&s->work_cv, &s->mu);
      pthread_mutex_unlock(&s->mu);
      continue;
    }
    pthread_mutex_unlock(&s->mu);
    if (n_new) inflight += submit(w, cbs, n_new);
    if (inflight == 0) continue;
    int min_nr = s->opts.overlap_events ? 1 : inflight;
    int got = io_getevents(w->ctx, min_nr, qd, events, NULL);
    if (got == -EINTR) continue;
    if (got < 0) { /* the context itself failed: fail what is in flight */
      pthread_mutex_lock(&s->mu);
      for (int i = 0; i < qd; i++) {
        int used = 1;
        for (int j = 0; j < w->n_free; j++) used &= w->free_slots[j] != i;
        if (used) complete_piece(s, &w->pieces[i], got), w->free_slots[w->n_free++] = i;
      }
      pthread_mutex_unlock(&s->mu);
      inflight = 0;
      continue;
    }
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < got; i++) {
      piece *p = events[i].data;
      complete_piece(s, p, (long)events[i].res);
      w->free_slots[w->n_free++] = (int)(p - w->pieces);
    }
    pthread_mutex_unlock(&s->mu);
    inflight -= got;
  }
  return NULL;
}

/* ------------------------------------------------------------------ open */

static lz_status check_dir(const char *dir) {
  struct stat st;
  if (stat(dir, &st) != 0) {
    if (errno == ENOENT)
      return lz_fail(LZ_ERR_IO,
                     "swap: directory %s does not exist (create it or point nvme_path at a "
                     "writable directory)",
                     dir);
    return lz_fail(LZ_ERR_IO, "swap: directory %s: %s (point nvme_path at a writable directory)",
                   dir, strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    return lz_fail(LZ_ERR_IO,
                   "swap: %s is not a directory (point nvme_path at a writable directory)", dir);
  return LZ_OK;
}

static lz_status start_workers(lz_swap *s) {
  const int qd = s->opts.queue_depth;
  s->workers = calloc((size_t)s->opts.thread_count, sizeof *s->workers);
  if (!s->workers) return lz_fail(LZ_ERR_NOMEM, "swap: out of memory for I/O threads");
  for (int t = 0; t < s->opts.thread_count; t++) {
    worker *w = &s->workers[t];
    w->swap = s;
    w->pieces = calloc((size_t)qd, sizeof *w->pieces);
    w->free_slots = calloc((size_t)qd, sizeof *w->free_slots);
    w->cbs = calloc((size_t)qd, sizeof *w->cbs);
    w->events = calloc((size_t)qd, sizeof *w->events);
    if (!w->pieces || !w->free_slots || !w->cbs || !w->events)
      return lz_fail(LZ_ERR_NOMEM, "swap: out of memory for I/O threads");
    for (int i = 0; i < qd; i++) w->free_slots[i] = qd - 1 - i;
    w->n_free = qd;
    int rc = io_setup(qd, &w->ctx);
    if (rc < 0) {
      w->ctx = 0;
      return lz_fail(LZ_ERR_IO,
                     "swap: %s: io_setup(%d) failed: %s (lower aio.queue_depth or "
                     "aio.thread_count, or raise /proc/sys/fs/aio-max-nr)",
                     s->path, qd, strerror(-rc));
    }
    rc = pthread_create(&w->thread, NULL, worker_main, w);
    if (rc != 0)
      return lz_fail(LZ_ERR_INTERNAL, "swap: %s: cannot start an I/O thread: %s", s->path,
                     strerror(rc));
    w->started = 1;
  }
  return LZ_OK;
}

/* Stops the I/O threads (after they drain) and frees everything but s. */
static void stop_workers(lz_swap *s) {
  if (!s->workers) return;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  pthread_cond_broadcast(&s->work_cv);
  pthread_mutex_unlock(&s->mu);
  for (int t = 0; t < s->opts.thread_count; t++) {
    worker *w = &s->workers[t];
    if (w->started) pthread_join(w->thread, NULL);
    if (w->ctx) io_destroy(w->ctx);
    free(w->pieces);
    free(w->free_slots);
    free(w->cbs);
    free(w->events);
  }
  free(s->workers);
  s->workers = NULL;
}

static void destroy(lz_swap *s) {
  stop_workers(s);
  if (s->fd >= 0) close(s->fd);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->work_cv);
  pthread_cond_destroy(&s->done_cv);
  free(s);
}

static atomic_int file_counter;

lz_status lz_swap_open(lz_swap **out, const char *dir, int64_t bytes, const char *tag,
                       const lz_swap_opts *opts) {
  if (!out) return lz_fail(LZ_ERR_INVALID, "swap: out is NULL");
  *out = NULL;
  if (!dir || !*dir)
    return lz_fail(LZ_ERR_INVALID,
                   "swap: no directory given (set nvme_path to a writable "
                   "directory on a fast disk)");
  if (bytes <= 0)
    return lz_fail(LZ_ERR_INVALID, "swap: size %lld bytes; a swap file needs at least 1 byte",
                   (long long)bytes);
  if (bytes > INT64_MAX - ALIGN)
    return lz_fail(LZ_ERR_INVALID, "swap: size %lld bytes is larger than any file",
                   (long long)bytes);
  lz_swap_opts o;
  lz_swap_opts_default(&o);
  if (opts) o = *opts;
  LZ_TRY(check_opts(&o));
  if (tag)
    for (const char *c = tag; *c; c++)
      if (*c == '/' || *c < ' ')
        return lz_fail(LZ_ERR_INVALID,
                       "swap: tag \"%s\" must not hold '/' or control characters (it becomes "
                       "part of a file name)",
                       tag);
  LZ_TRY(check_dir(dir));

  lz_swap *s = calloc(1, sizeof *s);
  if (!s) return lz_fail(LZ_ERR_NOMEM, "swap: out of memory");
  s->fd = -1;
  s->opts = o;
  s->size = (bytes + ALIGN - 1) / ALIGN * ALIGN;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->work_cv, NULL);
  pthread_cond_init(&s->done_cv, NULL);
  int n = atomic_fetch_add(&file_counter, 1);
  int len = snprintf(s->path, sizeof s->path, "%s/luazero-swap-%d-%d%s%s", dir, (int)getpid(), n,
                     tag ? "-" : "", tag ? tag : "");
  if (len < 0 || (size_t)len >= sizeof s->path) {
    destroy(s);
    return lz_fail(LZ_ERR_INVALID, "swap: directory %s: path too long for a swap file", dir);
  }

  s->fd = open(s->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (s->fd < 0) {
    int e = errno;
    destroy(s);
    return lz_fail(LZ_ERR_IO,
                   "swap: cannot create a swap file in directory %s: %s (point nvme_path at a "
                   "writable directory)",
                   dir, strerror(e));
  }
  if (unlink(s->path) != 0) {
    int e = errno;
    destroy(s);
    return lz_fail(LZ_ERR_IO, "swap: %s: cannot unlink the new swap file: %s", dir, strerror(e));
  }
  int rc = posix_fallocate(s->fd, 0, s->size);
  if (rc != 0) {
    char path[sizeof s->path];
    memcpy(path, s->path, sizeof path);
    destroy(s);
    return lz_fail(LZ_ERR_IO,
                   "swap: %s: cannot preallocate %lld bytes: %s (free space in %s or point "
                   "nvme_path at a larger disk)",
                   path, (long long)bytes, strerror(rc), dir);
  }
  int flags = fcntl(s->fd, F_GETFL);
  if (flags < 0) {
    int e = errno;
    destroy(s);
    return lz_fail(LZ_ERR_IO, "swap: %s: fcntl(F_GETFL): %s", dir, strerror(e));
  }
  if (fcntl(s->fd, F_SETFL, flags | O_DIRECT) == 0) {
    s->direct = 1;
  } else if (errno == EINVAL) {
    /* once per folder in a process: its params, optimizer and grads files
     * would each say it */
    static char warned[4][PATH_MAX];
    int seen = 0;
    for (int i = 0; i < 4 && warned[i][0] && !seen; i++) seen = !strcmp(warned[i], dir);
    if (!seen) {
      fprintf(stderr,
              "luazero: swap: %s does not allow O_DIRECT (tmpfs or similar); using buffered "
              "I/O, which goes through the page cache\n",
              dir);
      for (int i = 0; i < 4; i++)
        if (!warned[i][0]) {
          snprintf(warned[i], sizeof warned[i], "%s", dir);
          break;
        }
    }
  } else {
    int e = errno;
    destroy(s);
    return lz_fail(LZ_ERR_IO, "swap: %s: cannot switch to O_DIRECT: %s", dir, strerror(e));
  }
  lz_status st = start_workers(s);
  if (st != LZ_OK) {
    destroy(s);
    return st;
  }
  *out = s;
  return LZ_OK;
}

lz_status lz_swap_close(lz_swap *s) {
  if (!s) return LZ_OK;
  stop_workers(s); /* they drain the queue before they stop */
  lz_status st = LZ_OK;
  for (lz_swap_req *r = s->live, *next; r; r = next) {
    next = r->next_live;
    if (r->failed && st == LZ_OK) st = lz_fail(LZ_ERR_IO, "%s", r->err);
    free(r);
  }
  s->live = NULL;
  if (close(s->fd) != 0 && st == LZ_OK)
    st = lz_fail(LZ_ERR_IO, "swap: %s: close: %s", s->path, strerror(errno));
  s->fd = -1;
  destroy(s);
  return st;
}

/* --------------------------------------------------------------- requests */

static lz_status submit_request(lz_swap *s, int is_write, int64_t offset, void *buf, int64_t bytes,
                                lz_swap_req **req) {
  const char *op = is_write ? "swap_write" : "swap_read";
  if (req) *req = NULL;
  if (!s) return lz_fail(LZ_ERR_INVALID, "%s: swap is NULL", op);
  if (!buf) return lz_fail(LZ_ERR_INVALID, "%s: %s: buffer is NULL", op, s->path);
  if (offset < 0 || offset % ALIGN)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s: offset %lld is not a multiple of 4096 (O_DIRECT transfers whole "
                   "pages)",
                   op, s->path, (long long)offset);
  if (bytes < 0 || bytes % ALIGN)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s: size %lld bytes is not a multiple of 4096 (O_DIRECT transfers "
                   "whole pages; pad the buffer)",
                   op, s->path, (long long)bytes);
  if ((uintptr_t)buf % ALIGN)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s: buffer %p is not 4096-byte aligned (O_DIRECT needs it; allocate "
                   "with lz_mem_alloc(..., LZ_MEM_OFFLOAD))",
                   op, s->path, buf);
  if (offset > s->size || bytes > s->size - offset)
    return lz_fail(LZ_ERR_INVALID,
                   "%s: %s: %lld bytes at offset %lld go past the end of the %lld-byte swap "
                   "file",
                   op, s->path, (long long)bytes, (long long)offset, (long long)s->size);
  lz_swap_req *r = calloc(1, sizeof *r);
  if (!r) return lz_fail(LZ_ERR_NOMEM, "%s: out of memory for a request", op);
  r->swap = s;
  r->is_write = is_write;
  r->offset = offset;
  r->buf = buf;
  r->bytes = bytes;
  pthread_mutex_lock(&s->mu);
  r->next_live = s->live;
  if (s->live) s->live->prev_live = r;
  s->live = r;
  if (bytes == 0) {
    r->done = 1;
  } else {
    if (s->queue_tail)
      s->queue_tail->next_queued = r;
    else
      s->queue_head = r;
    s->queue_tail = r;
    pthread_cond_broadcast(&s->work_cv);
  }
  pthread_mutex_unlock(&s->mu);
  if (req) {
    *req = r;
    return LZ_OK;
  }
  return lz_swap_wait(r);
}

lz_status lz_swap_read(lz_swap *s, int64_t offset, void *dst, int64_t bytes, lz_swap_req **req) {
  return submit_request(s, 0, offset, dst, bytes, req);
}

lz_status lz_swap_write(lz_swap *s, int64_t offset, const void *src, int64_t bytes,
                        lz_swap_req **req) {
  /* The buffer is only read from: io_prep_pwrite takes a plain pointer. */
  return submit_request(s, 1, offset, (void *)(uintptr_t)src, bytes, req);
}

lz_status lz_swap_wait(lz_swap_req *r) {
  if (!r) return lz_fail(LZ_ERR_INVALID, "swap_wait: request is NULL");
  lz_swap *s = r->swap;
  pthread_mutex_lock(&s->mu);
  while (!r->done) pthread_cond_wait(&s->done_cv, &s->mu);
  if (r->prev_live)
    r->prev_live->next_live = r->next_live;
  else
    s->live = r->next_live;
  if (r->next_live) r->next_live->prev_live = r->prev_live;
  pthread_mutex_unlock(&s->mu);
  lz_status st = r->failed ? lz_fail(LZ_ERR_IO, "%s", r->err) : LZ_OK;
  free(r);
  return st;
}

int lz_swap_req_done(lz_swap_req *r) {
  if (!r) return 1;
  lz_swap *s = r->swap;
  pthread_mutex_lock(&s->mu);
  int done = r->done;
  pthread_mutex_unlock(&s->mu);
  return done;
}

const char *lz_swap_path(const lz_swap *s) { return s ? s->path : ""; }
int lz_swap_is_direct(const lz_swap *s) { return s ? s->direct : 0; }
int64_t lz_swap_size(const lz_swap *s) { return s ? s->size : 0; }

uint64_t lz_swap_bytes_read(const lz_swap *s) {
  return s ? atomic_load(&((lz_swap *)s)->bytes_read) : 0;
}

uint64_t lz_swap_bytes_written(const lz_swap *s) {
  return s ? atomic_load(&((lz_swap *)s)->bytes_written) : 0;
}
