// Allocations made by GpuBuffer, so that a pointer into one can be exported later (the memfd of a HOST
// buffer, the allocator of a device buffer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace mori::core::alloc {

enum class AllocatorKind : int {
  None = 0,
  HostMemfd,
  CudaVmm,
  CudaMalloc,
  CudaHostAlloc,
  HipMalloc,
  HipHostMalloc,
};

const char* AllocatorName(AllocatorKind kind);

struct Record {
  uintptr_t base;
  size_t bytes;  // of the whole allocation
  AllocatorKind kind;
  int fd;        // HostMemfd: the memfd (owned by the registry); else -1
  int device;
};

void Register(const Record& record);
// Removes the record and closes its fd.
void Unregister(uintptr_t base);
std::optional<Record> Find(const void* ptr);

}  // namespace mori::core::alloc
