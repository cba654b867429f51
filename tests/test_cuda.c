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
  /* (the core's, which finds the library's own: every program linked with
   * -lluazero has it) */
  count_fn count = lz_cuda_device_count;
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

/* Device tensors before lz_cuda_init, and a mix of devices: clear errors,
 * never a cpu kernel reading device memory. A tensor's device is plain
 * metadata, so a wrapped host buffer marked cuda stands in for one here. */
LZ_TEST(cuda_dispatch_errors_without_init) {
  if (lz_cuda_ready() || lz_sim_ready()) {
    printf("    skipped: an accelerator is initialized in this process\n");
    return;
  }
  float a[4] = {1, 2, 3, 4}, b[4] = {0};
  lz_tensor *ha = lz_test_wrap(a, LZ_F32, 1, (int64_t[]){4});
  lz_tensor *hb = lz_test_wrap(b, LZ_F32, 1, (int64_t[]){4});
  if (!ha || !hb) return;
  hb->device = LZ_CUDA;
  CHECK_ERR(lz_add(ha, ha, hb), LZ_ERR_INVALID, "out lives on cpu but b lives on cuda");
  CHECK(b[0] == 0.0f);
  ha->device = LZ_CUDA;
  CHECK_ERR(lz_gelu_forward(hb, ha), LZ_ERR_UNSUPPORTED, "gelu_forward: cuda is not initialized");
  CHECK_ERR(lz_tensor_copy(hb, ha), LZ_ERR_UNSUPPORTED, "cuda is not initialized");
  double n = -1;
  CHECK_ERR(lz_sq_norm(ha, &n), LZ_ERR_UNSUPPORTED, "cuda is not initialized");
  ha->device = (lz_device)7;
  CHECK_ERR(lz_scale(ha, 2.0f), LZ_ERR_INVALID, "has device 7");
  CHECK(a[0] == 1.0f);
  lz_tensor *t = NULL;
  CHECK_ERR(lz_tensor_new_on(&t, LZ_F32, 1, (int64_t[]){4}, LZ_MEM_PARAMS, LZ_CUDA),
            LZ_ERR_UNSUPPORTED, "cuda is not initialized");
  CHECK(t == NULL);
  void *p = NULL;
  CHECK_ERR(lz_mem_alloc_pinned(&p, 64), LZ_ERR_UNSUPPORTED, "cuda is not initialized");
  CHECK_ERR(lz_event_new(&(lz_event *){NULL}), LZ_ERR_UNSUPPORTED, "cuda is not initialized");
  CHECK_EQ_INT(lz_mem_device_current(LZ_MEM_PARAMS), 0);
  CHECK_EQ_INT(lz_cuda_device(), -1);
  lz_tensor_free(ha);
  lz_tensor_free(hb);
}

/* lz_cuda_init: a GPU, or the one clear error that names the fix. */
LZ_TEST(cuda_init_or_clear_error) {
  CHECK_ERR(lz_cuda_init(-1), LZ_ERR_INVALID, "devices count from 0");
  if (lz_sim_ready()) { /* test_sim.c checks the error naming both */
    printf("    skipped: sim is initialized in this process\n");
    return;
  }
  lz_status st = lz_cuda_init(0);
  if (st == LZ_OK) {
    CHECK(lz_cuda_ready());
    CHECK_EQ_INT(lz_cuda_device(), 0);
    printf("    cuda device 0 initialized\n");
    return;
  }
  CHECK_EQ_INT(st, LZ_ERR_UNSUPPORTED);
  CHECK(strstr(lz_last_error(), "cuda: ") == lz_last_error());
  CHECK(strstr(lz_last_error(), "run with --device cpu") != NULL);
  CHECK(!lz_cuda_ready());
  printf("    skipped the GPU half: %s\n", lz_last_error());
}
