// The allocator behind ShmemMalloc: offsets in [begin, end) of the heap, first fit, neighbours coalesced on
// free. Deterministic, so PEs that make the same calls in the same order get the same offsets.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace mori::shmem {

class SymmetricAllocator {
 public:
  static constexpr uint64_t kGranularity = 64;

  SymmetricAllocator(uint64_t begin, uint64_t end);

  // nullopt when no free range holds `bytes` at `alignment` (a power of two).
  std::optional<uint64_t> Allocate(uint64_t bytes, uint64_t alignment);
  // The size that was allocated at `offset`, or nullopt when nothing was.
  std::optional<uint64_t> SizeAt(uint64_t offset) const;
  // false when nothing is allocated at `offset`.
  bool Free(uint64_t offset);

  uint64_t FreeBytes() const;
  uint64_t LargestFree() const;
  size_t Allocations() const { return used_.size(); }

 private:
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes
  std::map<uint64_t, uint64_t> used_;  // offset -> bytes (the range handed out, rounded to kGranularity)
};

}  // namespace mori::shmem
