// device.cu — CUDA devices as luazero sees them: how many, and their names.
// A machine without a GPU (or without a driver) is a clear error, not a crash.
// The core's lz_cuda_device_count and lz_cuda_device_name (devices/backend.c)
// reach these through dlsym, as lz_cuda_init reaches the backend table.
#include "lz_cuda.h"
#include "mem/lz_internal.h"

#include <cuda_runtime.h>  // cudaGetDeviceCount, cudaGetDeviceProperties
#include <unistd.h>        // access

extern "C" lz_status lz_cu_device_count(int *out) {
  *out = 0;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    // (no driver at all reads as "driver version is insufficient")
    if (access("/dev/nvidiactl", F_OK) != 0)
      return lz_fail(LZ_ERR_UNSUPPORTED,
                     "cuda: no usable GPU on this machine (no NVIDIA driver: /dev/nvidiactl is "
                     "absent); run with --device cpu");
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "cuda: no usable GPU on this machine (%s); run with --device cpu",
                   cudaGetErrorString(e));
  }
  if (n == 0)
    return lz_fail(LZ_ERR_UNSUPPORTED,
                   "cuda: no usable GPU on this machine (the driver sees no device); run with "
                   "--device cpu");
  *out = n;
  return LZ_OK;
}

extern "C" const char *lz_cu_device_name(int device) {
  static thread_local cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "unknown";
  }
  return prop.name;
}
