/* backend_slot.c — which accelerator this process uses: set once by
 * lz_cuda_init or lz_sim_init (devices/backend.c), read by the ledger, the
 * op table's dispatch, tensors and the collectives; and the cpu backend,
 * set when the library loads (devices/cpu.c). A leaf: it calls nothing in
 * the core but lz_fail and the backend's own is_device_pointer. */
#include "mem/lz_backend.h"
#include "mem/lz_internal.h" /* lz_fail */

#include <stdio.h> /* snprintf for unknown device names */

static const lz_backend *active;
static const lz_backend *cpu;
static int active_device = -1; /* written before the table is published */

const lz_backend *lz_backend_active(void) { return __atomic_load_n(&active, __ATOMIC_ACQUIRE); }

void lz_backend_active_set(const lz_backend *be, int device) {
  active_device = device;
  __atomic_store_n(&active, be, __ATOMIC_RELEASE);
}

void lz_backend_cpu_set(const lz_backend *be) { cpu = be; }

const lz_backend *lz_backend_cpu(void) { return cpu; }

const lz_backend *lz_backend_of(lz_device dev) {
  const lz_backend *be = lz_backend_active();
  return be && be->kind == dev ? be : NULL;
}

const lz_backend *lz_backend_cuda(void) { return lz_backend_of(LZ_CUDA); }

const char *lz_device_name(lz_device dev) {
  static __thread char buf[32];
  switch (dev) {
    case LZ_CPU:
      return "cpu";
    case LZ_CUDA:
      return "cuda";
    case LZ_SIM:
      return "sim";
  }
  snprintf(buf, sizeof buf, "device %d", (int)dev);
  return buf;
}

int lz_cuda_ready(void) { return lz_backend_cuda() != NULL; }
int lz_cuda_device(void) { return lz_backend_cuda() ? active_device : -1; }
int lz_sim_ready(void) { return lz_backend_of(LZ_SIM) != NULL; }

int lz_pointer_device(const void *p) {
  const lz_backend *be = lz_backend_active();
  return be && p && be->is_device_pointer(p) ? (int)be->kind : (int)LZ_CPU;
}

lz_status lz_backend_need(const char *op, lz_device dev, const lz_backend **be) {
  *be = lz_backend_of(dev);
  if (*be) return LZ_OK;
  const lz_backend *other = lz_backend_active();
  const char *name = lz_device_name(dev);
  if (other)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "%s: %s is not initialized: this process uses %s (one accelerator per "
                   "process)",
                   op, name, other->name);
  return lz_fail(LZ_ERR_UNSUPPORTED,
                 "%s: %s is not initialized; call lz_%s_init first (device = \"%s\")", op, name,
                 name, name);
}

lz_status lz_backend_need_any(const char *op, const lz_backend **be) {
  *be = lz_backend_active();
  if (*be) return LZ_OK;
  return lz_fail(LZ_ERR_UNSUPPORTED,
                 "%s: cuda is not initialized, nor sim; call lz_cuda_init or lz_sim_init first "
                 "(device = \"cuda\" or \"sim\")",
                 op);
}
