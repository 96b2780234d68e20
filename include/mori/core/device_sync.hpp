// Waiting for a GPU's work with a bound. cudaDeviceSynchronize and its HIP and HOST forms wait for as long as a
// kernel runs; a kernel that waits on something without a bound of its own would hold the caller (a barrier,
// a finalize) forever.
#pragma once

#include <string>

#include "mori/core/gpu.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core {

// Waits until the work of the calling thread's current GPU (HOST: of every stream) has finished, at most until
// `deadline`, and returns what GpuDeviceSynchronize returned. Throws TimeoutError naming `what` when the work is
// still running at the deadline: the caller must then free nothing those kernels may still touch. The wait runs
// on one helper thread of the process, which goes on waiting in the background after a timeout.
GpuStatus DeviceSynchronizeBy(const Deadline& deadline, const std::string& what);

}  // namespace mori::core
