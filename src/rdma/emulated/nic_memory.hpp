// How the emulated NIC reaches registered memory: host memory directly, GPU memory through the GPU runtime
// (a copy-engine transfer on the NIC's own stream, staged through pinned memory so that it never waits for
// the kernels that are running), the way a real NIC's DMA engine would reach either. Failures throw
// core::Error naming the address.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "mori/core/gpu.hpp"
#include "mori/rdma/device_primitives.hpp"

namespace mori::rdma::emulated {

class NicMemory {
 public:
  NicMemory() = default;
  ~NicMemory();
  NicMemory(const NicMemory&) = delete;
  NicMemory& operator=(const NicMemory&) = delete;

  // Whether `p` is GPU memory (device memory of a GPU backend), and of which GPU.
  static bool IsDeviceMemory(const void* p, int* gpu);

  // Makes the stream and the pinned staging buffer for `gpu` now. Registering GPU memory calls it, so that
  // the GPU runtime's allocations happen before kernels use the memory and never on the data path: pinning
  // host memory can wait for the process's running kernels (seen under CUDA MPS), and a kernel that waits
  // for this NIC then never finishes. Any thread may call it.
  void Prepare(int gpu);

  // Copies in pieces of the staging buffer's size: the buffer is made once and never grows.
  void Read(void* dst, uintptr_t src, size_t bytes, bool device, int gpu);
  void Write(uintptr_t dst, const void* src, size_t bytes, bool device, int gpu);
  // 8-byte atomic at `addr` (8-aligned). On host memory it is a CPU atomic, so host threads' atomics on the
  // same word stay atomic with it; on GPU memory it is a read-modify-write serialised by the NIC, atomic
  // with respect to other RDMA atomics, as on real NICs.
  uint64_t Atomic(uintptr_t addr, AtomicOp op, uint64_t swapAdd, uint64_t compare, bool device, int gpu);

 private:
  static constexpr size_t kStagingBytes = size_t(4) << 20;
  void UseGpu(int gpu);  // with mutex_ held and `gpu` current on the calling thread
  // One copy on the NIC's stream, waited for; an error names `what` ("reading"/"writing") and the GPU address.
  void CopyOnStream(void* dst, const void* src, size_t bytes, const char* what, uintptr_t gpuAddr, int gpu);
  std::mutex mutex_;     // the NIC's engine thread and registering threads
  core::GpuStream stream_ = nullptr;
  int streamGpu_ = -1;
  uint8_t* staging_ = nullptr;  // kStagingBytes, host-pinned
};

}  // namespace mori::rdma::emulated
