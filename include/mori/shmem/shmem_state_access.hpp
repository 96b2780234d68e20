// How device code finds the SHMEM state. On CUDA and HIP every translation unit that includes this header
// holds its own copy in constant memory (so no -rdc is needed) and registers an uploader with the runtime
// at static initialisation; ShmemInit and ShmemFinalize call every registered uploader. On HOST one state
// in the library serves all. Also the query functions that both host and device code call.
#pragma once

#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/shmem/shmem_device_state.hpp"
#include "mori/shmem/shmem_types.hpp"

#if MORI_BACKEND_CUDA && MORI_GPU_COMPILER
#include <cuda_runtime.h>
#elif MORI_BACKEND_HIP && MORI_GPU_COMPILER
#include <hip/hip_runtime.h>
#endif

namespace mori::shmem {
namespace detail {

// Host side of the library (libmori_shmem).
using StateUploader = int (*)(const ShmemDeviceState* state);
// Remembers `uploader` and, if the runtime is already initialised, calls it at once.
bool RegisterStateUploader(StateUploader uploader);
int HostMyPe();
int HostNPes();
void* HostPtr(const void* dest, int pe);

#if MORI_BACKEND_HOST
extern ShmemDeviceState hostState;
MORI_HOST_DEVICE_INLINE const ShmemDeviceState& State() { return hostState; }
#elif MORI_GPU_COMPILER
namespace {
__constant__ ShmemDeviceState tuState;

int UploadTuState(const ShmemDeviceState* state) {
#if MORI_BACKEND_CUDA
  return static_cast<int>(cudaMemcpyToSymbol(tuState, state, sizeof(ShmemDeviceState)));
#else
  return static_cast<int>(hipMemcpyToSymbol(HIP_SYMBOL(tuState), state, sizeof(ShmemDeviceState)));
#endif
}

[[maybe_unused]] const bool tuStateRegistered = RegisterStateUploader(&UploadTuState);
}  // namespace

MORI_DEVICE_INLINE const ShmemDeviceState& State() { return tuState; }
#endif

}  // namespace detail

// This PE's number and the number of PEs (host and device). -1 and 0 before ShmemInit.
#if MORI_DEVICE_API_AVAILABLE
MORI_HOST_DEVICE_INLINE int ShmemMyPe() {
#if MORI_DEVICE_COMPILE
  return detail::State().rank;
#else
  return detail::HostMyPe();
#endif
}

MORI_HOST_DEVICE_INLINE int ShmemNPes() {
#if MORI_DEVICE_COMPILE
  return detail::State().nPes;
#else
  return detail::HostNPes();
#endif
}

// The address through which this thread can load and store `dest` (a symmetric address) on `pe`: the
// peer's heap mapped here (Self, P2P), else nullptr (RDMA, Proxy, or not a heap address).
MORI_HOST_DEVICE_INLINE void* ShmemPtr(const void* dest, int pe) {
#if MORI_DEVICE_COMPILE
  const ShmemDeviceState& s = detail::State();
  uintptr_t a = reinterpret_cast<uintptr_t>(dest);
  if (s.magic != kShmemStateMagic || pe < 0 || pe >= s.nPes || a < s.heapBase || a - s.heapBase >= s.heapBytes) {
    return nullptr;
  }
  uintptr_t peer = s.peerBases[pe];
  return peer == 0 ? nullptr : reinterpret_cast<void*>(peer + (a - s.heapBase));
#else
  return detail::HostPtr(dest, pe);
#endif
}
#else
inline int ShmemMyPe() { return detail::HostMyPe(); }
inline int ShmemNPes() { return detail::HostNPes(); }
inline void* ShmemPtr(const void* dest, int pe) { return detail::HostPtr(dest, pe); }
#endif

}  // namespace mori::shmem
