#include "proxy_copy.hpp"

#include <chrono>

#include "mori/core/format.hpp"

namespace mori::core {

std::string SlowProxyCopyHint(double seconds) {
  if (seconds < kSlowProxyCopyS) return {};
  return StrFormat(
      " (the copy took %.1f s: a cudaFree, cudaFreeHost or cudaHostUnregister in this process while a kernel "
      "runs holds every copy of the process until the kernels end, and a kernel waiting for this copy then waits "
      "until its bounded wait gives up: free memory between such kernels, docs/GUIDE.md)",
      seconds);
}

GpuStatus TimedStreamCopy(void* dst, const void* src, size_t bytes, GpuStream stream, double* seconds) {
  const auto start = std::chrono::steady_clock::now();
  GpuStatus s = GpuMemcpyAsync(dst, src, bytes, stream);
  if (s == kGpuSuccess) s = GpuStreamSynchronize(stream);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

}  // namespace mori::core
