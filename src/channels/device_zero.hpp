// Clearing fresh device memory from a host thread without the legacy default stream: cudaMemset returns
// before it is done and queues behind whatever kernel runs there, so later accesses on other streams (NIC,
// peers' copies, proxy reads) could see the old bytes or be undone by the late clear.
#pragma once

#include <cstddef>

#include "mori/core/gpu.hpp"

namespace mori::core {

// Zeroes [ptr, ptr + bytes) of device memory on a stream of its own and returns when it is done.
inline void ZeroDeviceMemory(void* ptr, size_t bytes) {
  GpuStream stream{};
  MORI_CHECK_GPU(GpuStreamCreate(&stream));
  GpuStatus set = GpuMemsetAsync(ptr, 0, bytes, stream);
  GpuStatus sync = set == kGpuSuccess ? GpuStreamSynchronize(stream) : set;
  (void)GpuStreamDestroy(stream);
  MORI_CHECK_GPU(sync);
}

}  // namespace mori::core
