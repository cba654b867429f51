/* test_cuda.c — the CUDA library loads and reports devices; without a GPU it
 * must fail with luazero's "no GPU" error, not crash. */
#include "lz_test.h"

#include <dlfcn.h>  /* dlopen: the CUDA library is loaded at run time */
#include <limits.h> /* PATH_MAX */
#include <unistd.h> /* readlink */
#include <libgen.h> /* dirname */

typedef lz_status (*count_fn)(int *);

LZ_TEST(cuda_device_count_or_clear_error) {
  char exe[PATH_MAX], lib[PATH_MAX + 64];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return;
  exe[n] = 0;
  snprintf(lib, sizeof lib, "%s/../lib/libluazero_cuda.so", dirname(exe));
  void *h = dlopen(lib, RTLD_NOW);
  if (!h) {
    printf("    skipped: %s not built (no nvcc): %s\n", lib, dlerror());
    return;
  }
  count_fn count = (count_fn)dlsym(h, "lz_cuda_device_count");
  CHECK(count != NULL);
  if (!count) return;
  int devices = -1;
  lz_status st = count(&devices);
  if (st == LZ_OK) {
    CHECK(devices >= 1);
    printf("    %d CUDA device(s)\n", devices);
  } else {
    CHECK_EQ_INT(st, LZ_ERR_UNSUPPORTED);
    CHECK_EQ_INT(devices, 0);
    CHECK(strstr(lz_last_error(), "cuda: no") != NULL);
    printf("    skipped: no GPU here (%s)\n", lz_last_error());
  }
  /* CUDA's runtime keeps threads and handlers: not unloaded on purpose. */
}
