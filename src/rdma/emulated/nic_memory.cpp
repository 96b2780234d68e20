#include "nic_memory.hpp"

#include <algorithm>
#include <cstring>

#include "mori/core/device_scope.hpp"
#include "mori/core/dma_copy.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "proxy_copy.hpp"

namespace mori::rdma::emulated {

NicMemory::~NicMemory() {
  if (staging_ != nullptr) (void)core::GpuFreeHost(staging_);
}

bool NicMemory::IsDeviceMemory(const void* p, int* gpu) {
  *gpu = -1;
#if MORI_BACKEND_CUDA
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  *gpu = attr.device;
  return attr.type == cudaMemoryTypeDevice;
#elif MORI_BACKEND_HIP
  hipPointerAttribute_t attr;
  if (hipPointerGetAttributes(&attr, p) != hipSuccess) {
    (void)hipGetLastError();
    return false;
  }
  *gpu = attr.device;
  return attr.memoryType == hipMemoryTypeDevice;
#else
  (void)p;
  return false;
#endif
}

// Pageable host memory would make a device copy synchronous with the device's other work (a copy behind a
// kernel that waits for this very NIC would never run); pinned staging keeps it on the NIC's stream.
void NicMemory::UseGpu(int gpu) {
  if (staging_ == nullptr) {
    void* p = nullptr;
    MORI_CHECK_GPU(core::GpuHostAllocMapped(&p, kStagingBytes));
    staging_ = static_cast<uint8_t*>(p);
  }
  if (streamGpu_ == gpu && stream_ != nullptr) return;
  stream_ = core::HostCopyStream(gpu);  // the process's, shared with its other host-side copies
  streamGpu_ = gpu;
}

void NicMemory::Prepare(int gpu) {
  std::lock_guard<std::mutex> lock(mutex_);
  core::DeviceScope scope(gpu);  // the caller's thread keeps its device
  UseGpu(gpu);
}

void NicMemory::CopyOnStream(void* dst, const void* src, size_t bytes, const char* what, uintptr_t gpuAddr, int gpu) {
  double seconds = 0;
  core::GpuStatus s = core::TimedStreamCopy(dst, src, bytes, stream_, &seconds);
  MORI_CHECK(s == core::kGpuSuccess, core::ErrorCode::Gpu, "emulated NIC: %s %zu bytes of GPU %d memory at %p: %s%s",
             what, bytes, gpu, reinterpret_cast<void*>(gpuAddr), core::GpuGetErrorString(s),
             core::SlowProxyCopyHint(seconds).c_str());
  if (seconds >= core::kSlowProxyCopyS)
    MORI_LOG_WARN(Rdma, "emulated NIC: %s %zu bytes of GPU %d memory at %p%s", what, bytes, gpu,
                  reinterpret_cast<void*>(gpuAddr), core::SlowProxyCopyHint(seconds).c_str());
}

void NicMemory::Read(void* dst, uintptr_t src, size_t bytes, bool device, int gpu) {
  if (bytes == 0) return;
  if (!device) {
    std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // The stream is the GPU's: the engine thread must have that GPU current for the copy (with another one, the
  // copy fails with 'invalid argument': every NIC write into GPU 1 of a two-GPU machine, 2026-11-26).
  core::DeviceScope scope(gpu);
  UseGpu(gpu);
  for (size_t done = 0; done < bytes; done += kStagingBytes) {
    const size_t n = std::min(kStagingBytes, bytes - done);
    CopyOnStream(staging_, reinterpret_cast<const void*>(src + done), n, "reading", src + done, gpu);
    std::memcpy(static_cast<uint8_t*>(dst) + done, staging_, n);
  }
}

void NicMemory::Write(uintptr_t dst, const void* src, size_t bytes, bool device, int gpu) {
  if (bytes == 0) return;
  if (!device) {
    core::DmaCopy(reinterpret_cast<void*>(dst), src, bytes);
    // Later writes (a flag after data) must not become visible first: order them at system scope.
    core::AtomicFence<core::MemoryOrder::Release, core::Scope::System>();
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  core::DeviceScope scope(gpu);  // as in Read
  UseGpu(gpu);
  for (size_t done = 0; done < bytes; done += kStagingBytes) {
    const size_t n = std::min(kStagingBytes, bytes - done);
    std::memcpy(staging_, static_cast<const uint8_t*>(src) + done, n);
    CopyOnStream(reinterpret_cast<void*>(dst + done), staging_, n, "writing", dst + done, gpu);
  }
}

uint64_t NicMemory::Atomic(uintptr_t addr, AtomicOp op, uint64_t swapAdd, uint64_t compare, bool device, int gpu) {
  if (!device) {
    auto* word = reinterpret_cast<uint64_t*>(addr);
    if (op == AtomicOp::FetchAdd) return core::AtomicFetchAdd(word, swapAdd);
    return core::AtomicCompareExchange(word, compare, swapAdd);
  }
  uint64_t old = 0;
  Read(&old, addr, sizeof(old), true, gpu);
  uint64_t updated = op == AtomicOp::FetchAdd ? old + swapAdd : (old == compare ? swapAdd : old);
  if (updated != old) Write(addr, &updated, sizeof(updated), true, gpu);
  return old;
}

}  // namespace mori::rdma::emulated
