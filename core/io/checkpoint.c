/* checkpoint.c — checkpoint shard files and the file-system steps that make a
 * save atomic. A shard is a fixed 48-byte header then one zstd stream:
 *
 *   0  magic "LZSHARD\0"     16  u64 raw bytes          32  u64 xxh64 of the stream
 *   8  u32 version (1)       24  u64 stream bytes       40  u64 xxh64 of the raw bytes
 *   12 u32 header bytes (48)
 *
 * (little endian). The writer compresses as data arrives (never holding a
 * shard), hashes both sides as it goes, and writes the header last: a shard
 * whose save was interrupted has a blank header. The reader checks the
 * header, decompresses sequentially into the caller's memory (or skips), and
 * at close reads whatever is left through the checksum, so every shard it
 * opened is verified whole. docs/checkpoints.md describes the format. */
#define _GNU_SOURCE /* nftw */
#include "mem/lz_internal.h"

#include <dirent.h>   /* opendir for lz_ckpt_steps */
#include <errno.h>    /* errno, EEXIST */
#include <fcntl.h>    /* open */
#include <ftw.h>      /* nftw for lz_ckpt_remove_tree */
#include <inttypes.h> /* PRIx64 */
#include <signal.h>   /* raise(SIGKILL) for the interrupted-save test hook */
#include <stdatomic.h> /* the test hook's byte count, shared by writer threads */
#include <stdio.h>    /* snprintf, rename */
#include <stdlib.h>   /* malloc, getenv, qsort */
#include <sys/stat.h> /* mkdir, fstat */
#include <unistd.h>   /* write, pread, fsync, close, getpid */
#include <xxhash.h>   /* XXH64 streaming state */
#include <zstd.h>     /* ZSTD_CCtx, ZSTD_DCtx */

#define SHARD_MAGIC "LZSHARD"
#define SHARD_VERSION 1u
#define SHARD_HEADER 48
#define IO_CHUNK (1 << 20)

static void put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u32(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static uint64_t get_u64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

/* write() all of it, retrying on short writes and EINTR. */
static lz_status write_all(int fd, const void *buf, size_t n, const char *path) {
  const char *p = buf;
  while (n > 0) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0)
      return lz_fail(LZ_ERR_IO, "checkpoint: %s: write failed (%s); check free space", path,
                     strerror(errno));
    p += k;
    n -= (size_t)k;
  }
  return LZ_OK;
}

/* read() up to n bytes; *got < n only at the end of the file. */
static lz_status read_some(int fd, void *buf, size_t n, size_t *got, const char *path) {
  char *p = buf;
  *got = 0;
  while (*got < n) {
    ssize_t k = read(fd, p + *got, n - *got);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0)
      return lz_fail(LZ_ERR_IO, "checkpoint: %s: read failed (%s)", path, strerror(errno));
    if (k == 0) break;
    *got += (size_t)k;
  }
  return LZ_OK;
}

/* ------------------------------------------------------------- writer */

struct lz_shard_writer {
  int fd;
  char path[4096];
  ZSTD_CCtx *cctx;
  XXH64_state_t *h_raw, *h_comp;
  unsigned char *out;
  size_t out_cap;
  uint64_t raw, comp;
  uint64_t kill_after; /* LZ_CKPT_KILL_AFTER_BYTES: 0 = never */
};

/* Compressed bytes every shard writer of this process has written: the test
 * hook counts across saves, so one number picks a save and a byte in it. */
static _Atomic uint64_t bytes_written_all;

static void writer_release(lz_shard_writer *w) {
  if (!w) return;
  if (w->fd >= 0) close(w->fd);
  ZSTD_freeCCtx(w->cctx);
  if (w->h_raw) XXH64_freeState(w->h_raw);
  if (w->h_comp) XXH64_freeState(w->h_comp);
  free(w->out);
  free(w);
}

static lz_status zstd_param(lz_shard_writer *w, ZSTD_cParameter p, int v, const char *what) {
  size_t r = ZSTD_CCtx_setParameter(w->cctx, p, v);
  if (ZSTD_isError(r))
    return lz_fail(LZ_ERR_INVALID, "checkpoint: zstd %s %d refused (%s)", what, v,
                   ZSTD_getErrorName(r));
  return LZ_OK;
}

lz_status lz_shard_writer_open(lz_shard_writer **out, const char *path, int level,
                               int workers) {
  *out = NULL;
  if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel())
    return lz_fail(LZ_ERR_INVALID, "checkpoint: zstd level %d is outside %d..%d", level,
                   ZSTD_minCLevel(), ZSTD_maxCLevel());
  if (workers < 0)
    return lz_fail(LZ_ERR_INVALID, "checkpoint: zstd workers must be >= 0 (got %d)", workers);
  lz_shard_writer *w = calloc(1, sizeof *w);
  if (!w) return lz_fail(LZ_ERR_NOMEM, "checkpoint: out of memory for a shard writer");
  w->fd = -1;
  snprintf(w->path, sizeof w->path, "%s", path);
  w->out_cap = ZSTD_CStreamOutSize();
  w->out = malloc(w->out_cap);
  w->cctx = ZSTD_createCCtx();
  w->h_raw = XXH64_createState();
  w->h_comp = XXH64_createState();
  if (!w->out || !w->cctx || !w->h_raw || !w->h_comp) {
    writer_release(w);
    return lz_fail(LZ_ERR_NOMEM, "checkpoint: out of memory for a shard writer");
  }
  XXH64_reset(w->h_raw, 0);
  XXH64_reset(w->h_comp, 0);
  lz_status st = zstd_param(w, ZSTD_c_compressionLevel, level, "level");
  if (st == LZ_OK) st = zstd_param(w, ZSTD_c_checksumFlag, 1, "checksum flag");
  if (st == LZ_OK && workers > 0) st = zstd_param(w, ZSTD_c_nbWorkers, workers, "workers");
  if (st != LZ_OK) {
    writer_release(w);
    return st;
  }
  const char *kill = getenv("LZ_CKPT_KILL_AFTER_BYTES");
  if (kill && *kill) w->kill_after = strtoull(kill, NULL, 10);
  w->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    st = lz_fail(LZ_ERR_IO, "checkpoint: %s: cannot create it (%s)", path, strerror(errno));
    writer_release(w);
    return st;
  }
  unsigned char blank[SHARD_HEADER] = {0}; /* the real header goes in at close */
  st = write_all(w->fd, blank, sizeof blank, path);
  if (st != LZ_OK) {
    writer_release(w);
    unlink(path);
    return st;
  }
  *out = w;
  return LZ_OK;
}

/* Runs the compressor over `in` with `mode`, writing what it produces. */
static lz_status writer_pump(lz_shard_writer *w, ZSTD_inBuffer *in, ZSTD_EndDirective mode) {
  for (;;) {
    ZSTD_outBuffer ob = {w->out, w->out_cap, 0};
    size_t left = ZSTD_compressStream2(w->cctx, &ob, in, mode);
    if (ZSTD_isError(left))
      return lz_fail(LZ_ERR_INTERNAL, "checkpoint: %s: zstd compression failed (%s)", w->path,
                     ZSTD_getErrorName(left));
    if (ob.pos > 0) {
      XXH64_update(w->h_comp, w->out, ob.pos);
      uint64_t before = atomic_fetch_add(&bytes_written_all, ob.pos);
      if (w->kill_after && before + ob.pos >= w->kill_after) {
        /* tests only: the process dies with exactly kill_after bytes written */
        size_t head = w->kill_after > before ? (size_t)(w->kill_after - before) : 0;
        LZ_TRY(write_all(w->fd, w->out, head, w->path));
        raise(SIGKILL);
      }
      LZ_TRY(write_all(w->fd, w->out, ob.pos, w->path));
      w->comp += ob.pos;
    }
    int done = mode == ZSTD_e_continue ? in->pos == in->size : left == 0;
    if (done) return LZ_OK;
  }
}

lz_status lz_shard_writer_write(lz_shard_writer *w, const void *data, size_t bytes) {
  XXH64_update(w->h_raw, data, bytes);
  w->raw += bytes;
  ZSTD_inBuffer in = {data, bytes, 0};
  return writer_pump(w, &in, ZSTD_e_continue);
}

lz_status lz_shard_writer_close(lz_shard_writer *w, lz_shard_info *info) {
  ZSTD_inBuffer none = {NULL, 0, 0};
  lz_status st = writer_pump(w, &none, ZSTD_e_end);
  lz_shard_info i = {w->raw, w->comp, XXH64_digest(w->h_comp), XXH64_digest(w->h_raw)};
  if (st == LZ_OK) {
    unsigned char h[SHARD_HEADER] = {0};
    memcpy(h, SHARD_MAGIC, 8);
    put_u32(h + 8, SHARD_VERSION);
    put_u32(h + 12, SHARD_HEADER);
    put_u64(h + 16, i.raw_bytes);
    put_u64(h + 24, i.compressed_bytes);
    put_u64(h + 32, i.xxh64_compressed);
    put_u64(h + 40, i.xxh64_raw);
    if (pwrite(w->fd, h, sizeof h, 0) != (ssize_t)sizeof h)
      st = lz_fail(LZ_ERR_IO, "checkpoint: %s: header write failed (%s)", w->path,
                   strerror(errno));
  }
  if (st == LZ_OK && fsync(w->fd) != 0)
    st = lz_fail(LZ_ERR_IO, "checkpoint: %s: fsync failed (%s)", w->path, strerror(errno));
  if (close(w->fd) != 0 && st == LZ_OK)
    st = lz_fail(LZ_ERR_IO, "checkpoint: %s: close failed (%s)", w->path, strerror(errno));
  w->fd = -1;
  if (st != LZ_OK) unlink(w->path);
  if (st == LZ_OK && info) *info = i;
  writer_release(w);
  return st;
}

void lz_shard_writer_abort(lz_shard_writer *w) {
  if (!w) return;
  if (w->fd >= 0) {
    close(w->fd);
    w->fd = -1;
  }
  unlink(w->path);
  writer_release(w);
}

/* ------------------------------------------------------------- reader */

struct lz_shard_reader {
  int fd;
  char path[4096];
  ZSTD_DCtx *dctx;
  XXH64_state_t *h_comp;
  unsigned char *in;
  ZSTD_inBuffer ib;
  unsigned char *skip;
  lz_shard_info header;
  uint64_t expect_hash; /* the manifest's, else the header's */
  uint64_t comp_read, raw_read;
  int failed;
};

static void reader_release(lz_shard_reader *r) {
  if (!r) return;
  if (r->fd >= 0) close(r->fd);
  ZSTD_freeDCtx(r->dctx);
  if (r->h_comp) XXH64_freeState(r->h_comp);
  free(r->in);
  free(r->skip);
  free(r);
}

/* Hashes the rest of the stream; fails naming expected and actual checksums
 * if they differ. `why` describes what went wrong first (or NULL). */
static lz_status reader_verify(lz_shard_reader *r, const char *why) {
  size_t got = 0;
  do {
    LZ_TRY(read_some(r->fd, r->in, IO_CHUNK, &got, r->path));
    XXH64_update(r->h_comp, r->in, got);
    r->comp_read += got;
  } while (got == IO_CHUNK);
  uint64_t actual = XXH64_digest(r->h_comp);
  if (actual != r->expect_hash || r->comp_read != r->header.compressed_bytes)
    return lz_fail(LZ_ERR_IO,
                   "checkpoint: %s: xxh64 of the compressed bytes is %016" PRIx64
                   ", expected %016" PRIx64 " (%" PRIu64 " bytes, expected %" PRIu64
                   "); the shard is damaged or truncated: restore it, or resume from another "
                   "checkpoint",
                   r->path, actual, r->expect_hash, r->comp_read, r->header.compressed_bytes);
  if (why)
    return lz_fail(LZ_ERR_IO, "checkpoint: %s: %s (the checksum matches: written that way)",
                   r->path, why);
  return LZ_OK;
}

static lz_status reader_fail(lz_shard_reader *r, const char *why) {
  r->failed = 1;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", why);
  return reader_verify(r, msg);
}

lz_status lz_shard_reader_open(lz_shard_reader **out, const char *path,
                               const lz_shard_info *expect) {
  *out = NULL;
  lz_shard_reader *r = calloc(1, sizeof *r);
  if (!r) return lz_fail(LZ_ERR_NOMEM, "checkpoint: out of memory for a shard reader");
  r->fd = -1;
  snprintf(r->path, sizeof r->path, "%s", path);
  r->in = malloc(IO_CHUNK);
  r->dctx = ZSTD_createDCtx();
  r->h_comp = XXH64_createState();
  if (!r->in || !r->dctx || !r->h_comp) {
    reader_release(r);
    return lz_fail(LZ_ERR_NOMEM, "checkpoint: out of memory for a shard reader");
  }
  XXH64_reset(r->h_comp, 0);
  lz_status st = LZ_OK;
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  if (r->fd < 0) {
    st = lz_fail(LZ_ERR_IO, "checkpoint: %s: cannot open it (%s)", path, strerror(errno));
    reader_release(r);
    return st;
  }
  unsigned char h[SHARD_HEADER];
  size_t got = 0;
  st = read_some(r->fd, h, sizeof h, &got, path);
  if (st == LZ_OK && got < sizeof h)
    st = lz_fail(LZ_ERR_IO,
                 "checkpoint: %s: truncated: %zu bytes, shorter than the %d-byte shard header",
                 path, got, SHARD_HEADER);
  int blank = 1;
  for (size_t i = 0; st == LZ_OK && i < sizeof h; i++) blank &= h[i] == 0;
  if (st == LZ_OK && blank)
    st = lz_fail(LZ_ERR_IO,
                 "checkpoint: %s: the header is blank: this shard's save never finished; "
                 "resume from another checkpoint",
                 path);
  if (st == LZ_OK && memcmp(h, SHARD_MAGIC, 8) != 0)
    st = lz_fail(LZ_ERR_IO, "checkpoint: %s: header magic is not \"%s\": not a luazero shard",
                 path, SHARD_MAGIC);
  if (st == LZ_OK && (get_u32(h + 8) != SHARD_VERSION || get_u32(h + 12) != SHARD_HEADER))
    st = lz_fail(LZ_ERR_IO,
                 "checkpoint: %s: shard version %u (header %u bytes) is not supported "
                 "(expected version %u, %d bytes)",
                 path, get_u32(h + 8), get_u32(h + 12), SHARD_VERSION, SHARD_HEADER);
  if (st != LZ_OK) {
    reader_release(r);
    return st;
  }
  r->header = (lz_shard_info){get_u64(h + 16), get_u64(h + 24), get_u64(h + 32),
                              get_u64(h + 40)};
  r->expect_hash = r->header.xxh64_compressed;
  if (expect) {
    r->expect_hash = expect->xxh64_compressed;
    if (expect->raw_bytes != r->header.raw_bytes ||
        expect->compressed_bytes != r->header.compressed_bytes ||
        expect->xxh64_compressed != r->header.xxh64_compressed) {
      r->failed = 1;
      r->header.compressed_bytes = expect->compressed_bytes;
      st = reader_verify(r, "its header disagrees with the manifest (sizes or checksum)");
      reader_release(r);
      return st;
    }
  }
  r->ib = (ZSTD_inBuffer){r->in, 0, 0};
  *out = r;
  return LZ_OK;
}

lz_status lz_shard_reader_info(const lz_shard_reader *r, lz_shard_info *out) {
  *out = r->header;
  return LZ_OK;
}

lz_status lz_shard_reader_read(lz_shard_reader *r, void *dst, size_t bytes) {
  if (r->failed) return lz_fail(LZ_ERR_INVALID, "checkpoint: %s: read after a failure", r->path);
  if (r->raw_read + bytes > r->header.raw_bytes) {
    char why[160];
    snprintf(why, sizeof why,
             "a read up to raw byte %" PRIu64 " goes past its %" PRIu64 " raw bytes",
             r->raw_read + bytes, r->header.raw_bytes);
    return reader_fail(r, why);
  }
  if (!dst && !r->skip) {
    r->skip = malloc(IO_CHUNK);
    if (!r->skip) return lz_fail(LZ_ERR_NOMEM, "checkpoint: out of memory for a shard reader");
  }
  size_t done = 0;
  while (done < bytes) {
    size_t want = bytes - done;
    ZSTD_outBuffer ob;
    if (dst) {
      ob = (ZSTD_outBuffer){(char *)dst + done, want, 0};
    } else {
      ob = (ZSTD_outBuffer){r->skip, want < IO_CHUNK ? want : IO_CHUNK, 0};
    }
    if (r->ib.pos == r->ib.size) {
      size_t got = 0;
      LZ_TRY(read_some(r->fd, r->in, IO_CHUNK, &got, r->path));
      if (got == 0) return reader_fail(r, "the zstd stream ends early");
      XXH64_update(r->h_comp, r->in, got);
      r->comp_read += got;
      r->ib = (ZSTD_inBuffer){r->in, got, 0};
    }
    size_t ret = ZSTD_decompressStream(r->dctx, &ob, &r->ib);
    if (ZSTD_isError(ret)) {
      char why[160];
      snprintf(why, sizeof why, "zstd cannot decompress it (%s)", ZSTD_getErrorName(ret));
      return reader_fail(r, why);
    }
    done += ob.pos;
    r->raw_read += ob.pos;
    if (ret == 0 && done < bytes) return reader_fail(r, "the zstd stream ends early");
  }
  return LZ_OK;
}

lz_status lz_shard_reader_close(lz_shard_reader *r, int verify) {
  if (!r) return LZ_OK;
  lz_status st = LZ_OK;
  if (verify && !r->failed) st = reader_verify(r, NULL);
  reader_release(r);
  return st;
}

/* -------------------------------------------------------- file system */

int lz_path_kind(const char *path, int follow, uint64_t id[2]) {
  struct stat st;
  if (!path || (follow ? stat(path, &st) : lstat(path, &st)) != 0) return -1;
  if (id) id[0] = (uint64_t)st.st_dev, id[1] = (uint64_t)st.st_ino;
  return (int)(st.st_mode & S_IFMT);
}

lz_status lz_ckpt_mkdir(const char *path) {
  char buf[4096];
  int n = snprintf(buf, sizeof buf, "%s", path);
  if (n <= 0 || (size_t)n >= sizeof buf)
    return lz_fail(LZ_ERR_INVALID, "checkpoint: path too long: %s", path);
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == 0) {
      char c = *p;
      *p = 0;
      if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return lz_fail(LZ_ERR_IO, "checkpoint: cannot create folder %s (%s)", buf,
                       strerror(errno));
      *p = c;
      if (!c) break;
    }
  }
  struct stat s;
  if (stat(path, &s) != 0 || !S_ISDIR(s.st_mode))
    return lz_fail(LZ_ERR_IO, "checkpoint: %s exists and is not a folder; give a folder path",
                   path);
  return LZ_OK;
}

lz_status lz_ckpt_fsync(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return lz_fail(LZ_ERR_IO, "checkpoint: cannot open %s to sync it (%s)", path,
                   strerror(errno));
  lz_status st = LZ_OK;
  if (fsync(fd) != 0)
    st = lz_fail(LZ_ERR_IO, "checkpoint: fsync %s failed (%s)", path, strerror(errno));
  if (close(fd) != 0 && st == LZ_OK)
    st = lz_fail(LZ_ERR_IO, "checkpoint: close %s failed (%s)", path, strerror(errno));
  return st;
}

/* The folder holding `path`, into buf. */
static void parent_of(const char *path, char *buf, size_t len) {
  snprintf(buf, len, "%s", path);
  char *slash = strrchr(buf, '/');
  if (!slash) {
    snprintf(buf, len, ".");
  } else if (slash == buf) {
    buf[1] = 0;
  } else {
    *slash = 0;
  }
}

lz_status lz_ckpt_rename(const char *from, const char *to) {
  if (rename(from, to) != 0)
    return lz_fail(LZ_ERR_IO, "checkpoint: cannot rename %s to %s (%s)", from, to,
                   strerror(errno));
  char dir[4096];
  parent_of(to, dir, sizeof dir);
  return lz_ckpt_fsync(dir);
}

lz_status lz_ckpt_write_file(const char *path, const void *data, size_t bytes) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return lz_fail(LZ_ERR_IO, "checkpoint: cannot create %s (%s)", tmp, strerror(errno));
  lz_status st = write_all(fd, data, bytes, tmp);
  if (st == LZ_OK && fsync(fd) != 0)
    st = lz_fail(LZ_ERR_IO, "checkpoint: fsync %s failed (%s)", tmp, strerror(errno));
  if (close(fd) != 0 && st == LZ_OK)
    st = lz_fail(LZ_ERR_IO, "checkpoint: close %s failed (%s)", tmp, strerror(errno));
  if (st == LZ_OK) st = lz_ckpt_rename(tmp, path);
  if (st != LZ_OK) unlink(tmp);
  return st;
}

static int remove_one(const char *path, const struct stat *s, int flag, struct FTW *f) {
  (void)s;
  (void)f;
  return flag == FTW_DP ? rmdir(path) : unlink(path);
}

lz_status lz_ckpt_remove_tree(const char *path) {
  struct stat s;
  if (lstat(path, &s) != 0) {
    if (errno == ENOENT) return LZ_OK;
    return lz_fail(LZ_ERR_IO, "checkpoint: cannot read %s (%s)", path, strerror(errno));
  }
  if (nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0)
    return lz_fail(LZ_ERR_IO, "checkpoint: cannot remove %s (%s)", path, strerror(errno));
  return LZ_OK;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

lz_status lz_ckpt_steps(const char *dir, int64_t *steps, int cap, int *count) {
  *count = 0;
  DIR *d = opendir(dir);
  if (!d) return lz_fail(LZ_ERR_IO, "checkpoint: cannot list %s (%s)", dir, strerror(errno));
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d)) != NULL) {
    const char *s = e->d_name;
    if (strncmp(s, "step-", 5) != 0 || !s[5]) continue;
    char *end = NULL;
    long long v = strtoll(s + 5, &end, 10);
    if (*end || v < 0) continue;
    /* only the names a save writes (step-%06lld): "step-7" or "step-+7"
     * would count as step 7, whose folder is another name */
    char want[40];
    snprintf(want, sizeof want, "step-%06lld", v);
    if (strcmp(want, s) != 0) continue;
    if (n < cap) steps[n] = v;
    n++;
  }
  if (closedir(d) != 0)
    return lz_fail(LZ_ERR_IO, "checkpoint: closedir %s failed (%s)", dir, strerror(errno));
  qsort(steps, (size_t)(n < cap ? n : cap), sizeof *steps, cmp_i64);
  *count = n;
  return LZ_OK;
}
