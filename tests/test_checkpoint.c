/* test_checkpoint.c — checkpoint shard files: a round trip through zstd with
 * reads and skips of any length, the header's sizes and checksums, and the
 * refusals: a flipped byte, a truncated file, a blank header (an interrupted
 * save), a manifest that disagrees; the atomic-write and listing helpers. */
#include "lz_test.h"

#include <stdlib.h> /* malloc, mkdtemp */
#include <unistd.h> /* truncate */

static char dir[256];

static const char *scratch(const char *name) {
  static char path[512];
  if (!dir[0]) {
    snprintf(dir, sizeof dir, "/tmp/lz_ckpt_test_XXXXXX");
    if (!mkdtemp(dir)) lz_test_fail(__FILE__, __LINE__, "mkdtemp failed");
  }
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return path;
}

/* n floats of a smooth signal with noise: compressible, not trivially. */
static float *sample(size_t n) {
  float *x = malloc(n * sizeof *x);
  uint64_t s = 42;
  for (size_t i = 0; i < n; i++) x[i] = (float)(i % 1000) * 1e-3f + 1e-4f * lz_test_uniform(&s);
  return x;
}

static lz_shard_info write_shard(const char *path, const float *x, size_t n, int workers) {
  lz_shard_writer *w = NULL;
  lz_shard_info info = {0};
  CHECK_OK(lz_shard_writer_open(&w, path, 3, workers));
  if (!w) return info;
  /* Uneven pieces: the stream does not depend on how data arrives. */
  size_t pos = 0, step = 777;
  while (pos < n) {
    size_t k = n - pos < step ? n - pos : step;
    CHECK_OK(lz_shard_writer_write(w, x + pos, k * sizeof *x));
    pos += k;
    step = step * 3 % 100003 + 1;
  }
  CHECK_OK(lz_shard_writer_close(w, &info));
  return info;
}

LZ_TEST(checkpoint_shard_round_trip_with_skips) {
  const size_t n = 600000;
  float *x = sample(n);
  for (int workers = 0; workers <= 2; workers += 2) {
    const char *path = scratch("a.zst");
    lz_shard_info info = write_shard(path, x, n, workers);
    CHECK_EQ_INT(info.raw_bytes, n * 4);
    CHECK(info.compressed_bytes > 0 && info.compressed_bytes < n * 4);
    CHECK(info.xxh64_raw == lz_hash_xxh64(x, n * 4, 0));
    lz_shard_reader *r = NULL;
    CHECK_OK(lz_shard_reader_open(&r, path, &info));
    if (!r) continue;
    lz_shard_info got;
    CHECK_OK(lz_shard_reader_info(r, &got));
    CHECK(got.xxh64_compressed == info.xxh64_compressed);
    float *y = calloc(n, sizeof *y);
    CHECK_OK(lz_shard_reader_read(r, y, 1000 * 4));
    CHECK_OK(lz_shard_reader_read(r, NULL, 300000 * 4)); /* skipped */
    CHECK_OK(lz_shard_reader_read(r, y + 301000, (n - 301000 - 5) * 4));
    CHECK(memcmp(y, x, 1000 * 4) == 0);
    CHECK(memcmp(y + 301000, x + 301000, (n - 301000 - 5) * 4) == 0);
    CHECK(y[1000] == 0 && y[300999] == 0);
    CHECK_ERR(lz_shard_reader_read(r, y, 6 * 4), LZ_ERR_IO, "goes past");
    CHECK_OK(lz_shard_reader_close(r, 0));
    /* Stopping early still verifies the whole file at close. */
    CHECK_OK(lz_shard_reader_open(&r, path, NULL));
    CHECK_OK(lz_shard_reader_read(r, y, 16));
    CHECK_OK(lz_shard_reader_close(r, 1));
    free(y);
  }
  free(x);
}

/* Rewrites one byte of a file at `off`. */
static void flip(const char *path, long off) {
  FILE *f = fopen(path, "r+b");
  CHECK(f != NULL);
  if (!f) return;
  fseek(f, off, SEEK_SET);
  int c = fgetc(f);
  fseek(f, off, SEEK_SET);
  fputc(c ^ 0x20, f);
  fclose(f);
}

LZ_TEST(checkpoint_shard_refusals_name_file_and_checksums) {
  const size_t n = 200000;
  float *x = sample(n);
  float *y = malloc(n * sizeof *y);
  const char *path = scratch("b.zst");
  lz_shard_info info = write_shard(path, x, n, 0);
  char expect[17];
  snprintf(expect, sizeof expect, "%016llx", (unsigned long long)info.xxh64_compressed);
  lz_shard_reader *r = NULL;

  /* A flipped byte in the middle of the stream. */
  flip(path, 48 + (long)info.compressed_bytes / 2);
  CHECK_OK(lz_shard_reader_open(&r, path, &info));
  lz_status st = lz_shard_reader_read(r, y, n * 4);
  if (st == LZ_OK) st = lz_shard_reader_close(r, 1);
  else lz_shard_reader_close(r, 0);
  CHECK(st == LZ_ERR_IO);
  CHECK(strstr(lz_last_error(), "b.zst") && strstr(lz_last_error(), expect));
  CHECK(strstr(lz_last_error(), "xxh64"));

  /* Truncated. */
  info = write_shard(path, x, n, 0);
  snprintf(expect, sizeof expect, "%016llx", (unsigned long long)info.xxh64_compressed);
  CHECK(truncate(path, 48 + (long)info.compressed_bytes - 100) == 0);
  CHECK_OK(lz_shard_reader_open(&r, path, &info));
  st = lz_shard_reader_read(r, y, n * 4);
  if (st == LZ_OK) st = lz_shard_reader_close(r, 1);
  else lz_shard_reader_close(r, 0);
  CHECK(st == LZ_ERR_IO);
  CHECK(strstr(lz_last_error(), "b.zst") && strstr(lz_last_error(), expect));

  /* The manifest disagrees with the header. */
  info = write_shard(path, x, n, 0);
  lz_shard_info other = info;
  other.xxh64_compressed ^= 1;
  CHECK_ERR(lz_shard_reader_open(&r, path, &other), LZ_ERR_IO, "expected");

  /* An interrupted save: the header is still blank. */
  lz_shard_writer *w = NULL;
  CHECK_OK(lz_shard_writer_open(&w, path, 1, 0));
  CHECK_OK(lz_shard_writer_write(w, x, 4096));
  lz_shard_writer_abort(w);
  CHECK(access(path, F_OK) != 0); /* abort removes it */
  FILE *f = fopen(path, "wb");
  char zeros[64] = {0};
  fwrite(zeros, 1, sizeof zeros, f);
  fclose(f);
  CHECK_ERR(lz_shard_reader_open(&r, path, NULL), LZ_ERR_IO, "never finished");
  CHECK_ERR(lz_shard_reader_open(&r, scratch("none.zst"), NULL), LZ_ERR_IO, "none.zst");
  CHECK_ERR(lz_shard_writer_open(&w, path, 99, 0), LZ_ERR_INVALID, "level");
  free(x);
  free(y);
}

LZ_TEST(checkpoint_atomic_file_and_step_listing) {
  const char *d = scratch("run/deep");
  char base[512];
  snprintf(base, sizeof base, "%s", d);
  CHECK_OK(lz_ckpt_mkdir(base));
  char p[600];
  snprintf(p, sizeof p, "%s/latest", base);
  CHECK_OK(lz_ckpt_write_file(p, "step-000002\n", 12));
  CHECK_OK(lz_ckpt_write_file(p, "step-000010\n", 12)); /* replaced whole */
  char buf[32] = {0};
  FILE *f = fopen(p, "rb");
  CHECK(f && fread(buf, 1, sizeof buf - 1, f) == 12);
  if (f) fclose(f);
  CHECK(strcmp(buf, "step-000010\n") == 0);
  const int steps[] = {20, 3, 100};
  for (int i = 0; i < 3; i++) {
    snprintf(p, sizeof p, "%s/step-%06d", base, steps[i]);
    CHECK_OK(lz_ckpt_mkdir(p));
  }
  snprintf(p, sizeof p, "%s/.step-000200.tmp-1", base);
  CHECK_OK(lz_ckpt_mkdir(p));
  /* names no save writes: not steps */
  const char *odd[] = {"step-7", "step-+000008", "step-0000009", "step-", "step-00001x"};
  for (int i = 0; i < 5; i++) {
    snprintf(p, sizeof p, "%s/%s", base, odd[i]);
    CHECK_OK(lz_ckpt_mkdir(p));
  }
  int64_t got[8];
  int count = 0;
  CHECK_OK(lz_ckpt_steps(base, got, 8, &count));
  CHECK_EQ_INT(count, 3);
  CHECK(got[0] == 3 && got[1] == 20 && got[2] == 100);
  snprintf(p, sizeof p, "%s/step-000003", base);
  char q[600];
  snprintf(q, sizeof q, "%s/step-000004", base);
  CHECK_OK(lz_ckpt_rename(p, q));
  CHECK_OK(lz_ckpt_fsync(q));
  CHECK_OK(lz_ckpt_remove_tree(dir));
  CHECK_OK(lz_ckpt_remove_tree(dir)); /* gone already: fine */
  CHECK_ERR(lz_ckpt_steps(base, got, 8, &count), LZ_ERR_IO, "cannot list");
  dir[0] = 0;
}
