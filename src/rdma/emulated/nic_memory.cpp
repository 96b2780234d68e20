#include "nic_memory.hpp"

#include <cstring>

#include "mori/core/errors.hpp"

namespace mori::rdma::emulated {

NicMemory::~NicMemory() {
  if (stream_ != nullptr) (void)core::GpuStreamDestroy(stream_);
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

void NicMemory::UseGpu(int gpu) {
  if (streamGpu_ == gpu && stream_ != nullptr) return;
  MORI_CHECK_GPU(core::GpuSetDevice(gpu));
  if (stream_ != nullptr) (void)core::GpuStreamDestroy(stream_);
  MORI_CHECK_GPU(core::GpuStreamCreate(&stream_));
  streamGpu_ = gpu;
}

void NicMemory::Read(void* dst, uintptr_t src, size_t bytes, bool device, int gpu) {
  if (bytes == 0) return;
  if (!device) {
    std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
    return;
  }
  UseGpu(gpu);
  MORI_CHECK_GPU(core::GpuMemcpyAsync(dst, reinterpret_cast<const void*>(src), bytes, stream_));
  MORI_CHECK_GPU(core::GpuStreamSynchronize(stream_));
}

void NicMemory::Write(uintptr_t dst, const void* src, size_t bytes, bool device, int gpu) {
  if (bytes == 0) return;
  if (!device) {
    std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
    // Later writes (a flag after data) must not become visible first: order them at system scope.
    core::AtomicFence<core::MemoryOrder::Release, core::Scope::System>();
    return;
  }
  UseGpu(gpu);
  MORI_CHECK_GPU(core::GpuMemcpyAsync(reinterpret_cast<void*>(dst), src, bytes, stream_));
  MORI_CHECK_GPU(core::GpuStreamSynchronize(stream_));
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
