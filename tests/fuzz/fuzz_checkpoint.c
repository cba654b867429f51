/* fuzz_checkpoint.c — libFuzzer target for what a checkpoint loader reads
 * from disk. The first input byte picks the reader:
 *   even: a shard file (core/io/checkpoint.c, built in with ASan): open, read
 *         everything in uneven pieces, verify; any status is fine, a crash
 *         or sanitizer report is not.
 *   odd:  manifest.json text through luazero.checkpoint.manifest (embedded
 *         LuaJIT + cjson): it must either accept or raise a one-line
 *         "checkpoint: ..." error naming the file — any other error aborts.
 * Built and run by tests/fuzz/run.sh (clang -fsanitize=fuzzer,address). */
#include "luazero.h"

#include <lauxlib.h> /* luaL_newstate, luaL_loadstring */
#include <lua.h>     /* lua_pcall */
#include <lualib.h>  /* luaL_openlibs */
#include <stdio.h>   /* fprintf */
#include <stdlib.h>  /* abort, getenv */
#include <string.h>  /* strncmp */
#include <unistd.h>  /* write, close, getpid */

static lua_State *L;
static char shard_path[256];

static void init(void) {
  const char *root = getenv("LZ_ROOT");
  if (!root) root = ".";
  L = luaL_newstate();
  luaL_openlibs(L);
  char code[2048];
  snprintf(code, sizeof code,
           "package.path = '%s/lua/?.lua;%s/lua/?/init.lua;' .. package.path\n"
           "package.cpath = '/usr/lib/x86_64-linux-gnu/lua/5.1/?.so;' .. package.cpath\n"
           "local m = require('luazero.checkpoint.manifest')\n"
           "return function(text) return m.decode(text, 'fuzz/manifest.json') end",
           root, root);
  if (luaL_loadstring(L, code) != 0 || lua_pcall(L, 0, 1, 0) != 0) {
    fprintf(stderr, "fuzz: cannot load the manifest validator: %s\n", lua_tostring(L, -1));
    abort();
  }
  lua_setglobal(L, "validate");
  snprintf(shard_path, sizeof shard_path, "/tmp/lz_fuzz_shard_%ld.zst", (long)getpid());
}

static void fuzz_manifest(const uint8_t *data, size_t size) {
  lua_getglobal(L, "validate");
  lua_pushlstring(L, (const char *)data, size);
  if (lua_pcall(L, 1, 0, 0) != 0) {
    const char *err = lua_tostring(L, -1);
    const char *want = "checkpoint: fuzz/manifest.json: ";
    if (!err || strncmp(err, want, strlen(want)) != 0) {
      fprintf(stderr, "fuzz: the manifest validator raised a stray error: %s\n",
              err ? err : "(not a string)");
      abort();
    }
  }
  lua_settop(L, 0);
}

static void fuzz_shard(const uint8_t *data, size_t size) {
  FILE *f = fopen(shard_path, "wb");
  if (!f) abort();
  if (size && fwrite(data, 1, size, f) != size) abort();
  fclose(f);
  lz_shard_reader *r = NULL;
  if (lz_shard_reader_open(&r, shard_path, NULL) != LZ_OK) return;
  lz_shard_info info;
  lz_shard_reader_info(r, &info);
  static uint8_t buf[1 << 16];
  uint64_t left = info.raw_bytes < (1u << 24) ? info.raw_bytes : (1u << 24);
  size_t piece = 1 + (size % 5000);
  lz_status st = LZ_OK;
  int skip = 0;
  while (left > 0 && st == LZ_OK) {
    size_t k = left < piece ? (size_t)left : piece;
    if (k > sizeof buf) k = sizeof buf;
    st = lz_shard_reader_read(r, skip ? NULL : buf, k);
    skip = !skip;
    left -= k;
  }
  lz_shard_reader_close(r, st == LZ_OK);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!L) init();
  if (size < 1) return 0;
  if (data[0] & 1) {
    fuzz_manifest(data + 1, size - 1);
  } else {
    fuzz_shard(data + 1, size - 1);
  }
  return 0;
}
