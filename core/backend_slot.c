/* backend_slot.c — which device backend is loaded: set once by lz_cuda_init
 * (backend.c), read by the ledger, the kernels' device switch and the
 * collectives. A leaf: it calls nothing in the core. */
#include "lz_backend.h"

static const lz_backend *cuda_backend;
static int cuda_device = -1; /* written before the table is published */

const lz_backend *lz_backend_cuda(void) { return __atomic_load_n(&cuda_backend, __ATOMIC_ACQUIRE); }

void lz_backend_cuda_set(const lz_backend *be, int device) {
  cuda_device = device;
  __atomic_store_n(&cuda_backend, be, __ATOMIC_RELEASE);
}

int lz_cuda_ready(void) { return lz_backend_cuda() != NULL; }
int lz_cuda_device(void) { return lz_backend_cuda() ? cuda_device : -1; }
