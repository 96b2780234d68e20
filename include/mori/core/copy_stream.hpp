// HostCopyStream: the one stream per device of a process for the copies that host threads make for kernels
// that may be waiting for them (the proxies' TCP links, the emulated NIC, CudaIpc connections, FIFO and
// semaphore reads, clears of fresh device memory). src/core/proxy_copy.hpp says why they share it.
#pragma once

#include "mori/core/gpu.hpp"

namespace mori::core {

// The stream of this process for those copies on `device` (negative: the current device), made at the first
// call and kept until the process ends (a forked child makes its own). Copies of several threads share it:
// each thread waits for its own copy by an event recorded after it, which in stream order may also wait for
// another thread's earlier copy, never for a kernel. Made early (ShmemInit) so that it is among the first
// streams of the process and so on a hardware queue of its own unless the application makes more streams
// than there are queues.
GpuStream HostCopyStream(int device = -1);

}  // namespace mori::core
