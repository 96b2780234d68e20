// Clearing fresh device memory from a host thread without the legacy default stream: cudaMemset returns
// before it is done and queues behind whatever kernel runs there, so later accesses on other streams (NIC,
// peers' copies, proxy reads) could see the old bytes or be undone by the late clear.
#pragma once

#include <cstddef>

#include "mori/core/gpu.hpp"
#include "proxy_copy.hpp"

namespace mori::core {

// Zeroes [ptr, ptr + bytes) of device memory on the process's copy stream (HostCopyStream: no new stream, so
// none more to share a hardware queue with a kernel) and returns when it is done.
inline void ZeroDeviceMemory(void* ptr, size_t bytes) {
  GpuStream stream = HostCopyStream();
  GpuEvent done = nullptr;
  MORI_CHECK_GPU(GpuEventCreate(&done));
  GpuStatus s = GpuMemsetAsync(ptr, 0, bytes, stream);
  if (s == kGpuSuccess) s = GpuEventRecord(done, stream);
  if (s == kGpuSuccess) s = GpuEventSynchronize(done);
  (void)GpuEventDestroy(done);
  MORI_CHECK_GPU(s);
}

}  // namespace mori::core
