/* backend.c — choosing the process's one accelerator: lz_cuda_init loads
 * libluazero_cuda.so at run time, lz_sim_init takes the built-in sim table;
 * either publishes its table in the backend slot (mem/backend_slot.c), through
 * which tensors, the ledger and the kernels reach it. */
#define _GNU_SOURCE         /* dladdr */
#include "devices/lz_sim.h" /* lz_sim_backend */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h"

#include <dlfcn.h>   /* dlopen, dlsym, dladdr */
#include <libgen.h>  /* dirname */
#include <limits.h>  /* PATH_MAX */
#include <pthread.h> /* the init lock */
#include <stdio.h>   /* snprintf */

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;

/* Caller holds init_lock: the other accelerator already in use is an error
 * naming both. */
static lz_status one_accelerator(const char *op, const char *asked) {
  const lz_backend *be = lz_backend_active();
  if (!be || !strcmp(be->name, asked)) return LZ_OK;
  return lz_fail(LZ_ERR_INVALID,
                 "%s: this process already uses %s; one accelerator per process (asked for %s): "
                 "run %s in another process",
                 op, be->name, asked, asked);
}

/* libluazero_cuda.so beside this library (build/lib/), else wherever the
 * loader finds it. */
static void *open_cuda_library(char *why, size_t len) {
  Dl_info info;
  if (dladdr((void *)&lz_cuda_init, &info) && info.dli_fname) {
    char self[PATH_MAX], lib[PATH_MAX + 32];
    snprintf(self, sizeof self, "%s", info.dli_fname);
    snprintf(lib, sizeof lib, "%s/libluazero_cuda.so", dirname(self));
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    snprintf(why, len, "%s", dlerror());
  }
  void *h = dlopen("libluazero_cuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!h && !*why) snprintf(why, len, "%s", dlerror());
  return h;
}

lz_status lz_cuda_init(int device) {
  if (device < 0)
    return lz_fail(LZ_ERR_INVALID, "cuda_init: device %d; devices count from 0", device);
  pthread_mutex_lock(&init_lock);
  lz_status st = one_accelerator("cuda_init", "cuda");
  if (st != LZ_OK) {
    pthread_mutex_unlock(&init_lock);
    return st;
  }
  if (lz_cuda_ready()) {
    if (device != lz_cuda_device())
      st = lz_fail(LZ_ERR_INVALID,
                   "cuda_init: this process already uses cuda device %d; one device per "
                   "process (asked for %d)",
                   lz_cuda_device(), device);
    pthread_mutex_unlock(&init_lock);
    return st;
  }
  char why[512] = "";
  void *h = open_cuda_library(why, sizeof why);
  if (!h) {
    pthread_mutex_unlock(&init_lock);
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "cuda: libluazero_cuda.so could not be loaded (%s); build where nvcc exists, "
                   "or run with --device cpu",
                   why);
  }
  lz_backend_entry_fn entry = (lz_backend_entry_fn)dlsym(h, "lz_cuda_backend");
  const lz_backend *be = entry ? entry() : NULL;
  if (!be || be->abi != LZ_BACKEND_ABI || be->kind != LZ_CUDA) {
    pthread_mutex_unlock(&init_lock);
    /* The handle stays open: CUDA's runtime does not unload cleanly. */
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "cuda: libluazero_cuda.so %s (backend ABI %d, this libluazero wants %d); "
                   "rebuild both together",
                   be ? "is from another build" : "has no lz_cuda_backend table", be ? be->abi : -1,
                   LZ_BACKEND_ABI);
  }
  st = be->init(device);
  if (st == LZ_OK) lz_backend_active_set(be, device);
  pthread_mutex_unlock(&init_lock);
  return st;
}

/* The devices, from libluazero_cuda.so's device.cu (loaded, or loaded
 * now: counting needs no lz_cuda_init). */
static void *cuda_symbol(const char *name, char *why, size_t len) {
  static void *h;
  pthread_mutex_lock(&init_lock);
  if (!h) h = open_cuda_library(why, len);
  void *f = h ? dlsym(h, name) : NULL;
  if (h && !f) snprintf(why, len, "%s", dlerror());
  pthread_mutex_unlock(&init_lock);
  return f;
}

lz_status lz_cuda_device_count(int *out) {
  *out = 0;
  char why[512] = "";
  lz_status (*count)(int *) = (lz_status(*)(int *))cuda_symbol("lz_cu_device_count", why,
                                                               sizeof why);
  if (!count)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "cuda: libluazero_cuda.so could not be loaded (%s); build where nvcc exists, "
                   "or run with --device cpu",
                   why);
  return count(out);
}

const char *lz_cuda_device_name(int device) {
  char why[512] = "";
  const char *(*name)(int) = (const char *(*)(int))cuda_symbol("lz_cu_device_name", why,
                                                                 sizeof why);
  return name ? name(device) : "unknown";
}

lz_status lz_sim_init(void) {
  pthread_mutex_lock(&init_lock);
  lz_status st = one_accelerator("sim_init", "sim");
  if (st == LZ_OK && !lz_sim_ready()) {
    const lz_backend *be = lz_sim_backend();
    st = be->init(0);
    if (st == LZ_OK) lz_backend_active_set(be, 0);
  }
  pthread_mutex_unlock(&init_lock);
  return st;
}
