// Copies that a host thread makes for a kernel that may be waiting for them (the TCP link's writes and word
// operations into GPU memory, the emulated NIC's, the CudaIpc connection's): issued on a stream of their own
// and waited for, with the time taken watched. A copy held up for seconds is almost always the CUDA driver
// holding every copy of the process while a cudaFree, cudaFreeHost or cudaHostUnregister of another thread
// waits for the running kernels to end (measured on H100/H200, with and without MPS: docs/PERF.md); when the
// kernel is the one waiting for this copy, both wait until the kernel's bounded wait gives up. The error or
// warning then says so instead of leaving only the kernel's timeout.
#pragma once

#include <cstddef>
#include <string>

#include "mori/core/gpu.hpp"

namespace mori::core {

// A copy slower than this is reported (a warning when it completes, the hint in the error when it fails).
constexpr double kSlowProxyCopyS = 2.0;

// The sentence appended to a report of a copy that took `seconds` (empty below kSlowProxyCopyS).
std::string SlowProxyCopyHint(double seconds);

// cudaMemcpyAsync on `stream`, then its synchronize; returns the first failure's status. `seconds` receives
// the time the two took. Throws nothing.
GpuStatus TimedStreamCopy(void* dst, const void* src, size_t bytes, GpuStream stream, double* seconds);

}  // namespace mori::core
