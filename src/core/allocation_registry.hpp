// Allocations made by GpuBuffer, so that a pointer into one can be exported later (the memfd of a HOST
// buffer, the allocator of a device buffer).
#pragma once

#include <fcntl.h>

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

// The seals of a HostMemfd allocation: its size fixed (a peer that shrank it would SIGBUS every mapper) and
// no seal added or removed later. Writes stay allowed, they are the point.
constexpr int kMemfdSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

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
