// Memory fit for communication on this backend, owned by an RAII object.
//   Device:     GPU memory that same-host peers can map (CUDA: a VMM allocation exportable as a file
//               descriptor, or cudaMalloc with legacy IPC handles, per MORI_CUDA_IPC; HIP: hipMalloc with
//               IPC handles; HOST: memfd-backed shared memory).
//   HostPinned: host memory pinned and mapped into the GPU's address space (FIFOs, queues a host thread
//               and the GPU both touch); on HOST memfd-backed too, so other processes can map it.
#pragma once

#include <cstddef>

namespace mori::core {

enum class MemoryType { Device, HostPinned };

class GpuBuffer {
 public:
  GpuBuffer() = default;
  explicit GpuBuffer(size_t bytes, MemoryType type = MemoryType::Device);
  ~GpuBuffer();
  GpuBuffer(GpuBuffer&& other) noexcept;
  GpuBuffer& operator=(GpuBuffer&& other) noexcept;
  GpuBuffer(const GpuBuffer&) = delete;
  GpuBuffer& operator=(const GpuBuffer&) = delete;

  // For HostPinned the pointer is valid on the host and, through unified addressing, on the GPU.
  void* Data() const { return data_; }
  template <typename T>
  T* DataAs() const {
    return static_cast<T*>(data_);
  }
  size_t Bytes() const { return bytes_; }
  MemoryType Type() const { return type_; }
  // Whether ExportIpcMemory (ipc_memory.hpp) accepts this buffer.
  bool Shareable() const;
  // How the memory was obtained, for logs: "memfd", "CUDA VMM", "cudaMalloc", "cudaHostAlloc", ...
  const char* AllocatorName() const;

 private:
  void Release() noexcept;

  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t allocationBytes_ = 0;  // rounded to the allocator's granularity
  MemoryType type_ = MemoryType::Device;
  int allocator_ = 0;           // AllocatorKind of src/core/allocation_registry.hpp
};

}  // namespace mori::core
