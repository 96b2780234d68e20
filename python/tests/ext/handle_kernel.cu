// A kernel module loaded by handle (test_extension.py: test_module_loaded_by_handle): nvcc -cubin, then
// cuModuleLoad through ctypes, as a JIT-compiled kernel's module is loaded. No host code of it runs.
#define MORI_SHMEM_MODULE_BY_HANDLE 1
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori::shmem;

// out[0], out[1]: this PE and the number of PEs as the module sees them; then one block puts `count` floats
// of src into dst on `pe` and waits until they are there.
extern "C" __global__ void mori_handle_put(float* dst, const float* src, int count, int pe, int* out) {
  if (threadIdx.x == 0) {
    out[0] = ShmemMyPe();
    out[1] = ShmemNPes();
  }
  if (ShmemNPes() <= 0) return;
  ShmemPutMemNbiBlock(dst, src, static_cast<size_t>(count) * sizeof(float), pe);
  __syncthreads();
  if (threadIdx.x == 0) ShmemQuietThread();
}
