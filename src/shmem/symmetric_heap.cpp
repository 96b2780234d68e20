#include "symmetric_heap.hpp"

#include "mori/core/errors.hpp"

namespace mori::shmem {

SymmetricAllocator::SymmetricAllocator(uint64_t begin, uint64_t end) {
  MORI_CHECK(begin < end, core::ErrorCode::InvalidUsage, "empty heap range [%llu, %llu)",
             static_cast<unsigned long long>(begin), static_cast<unsigned long long>(end));
  free_[begin] = end - begin;
}

std::optional<uint64_t> SymmetricAllocator::Allocate(uint64_t bytes, uint64_t alignment) {
  MORI_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, core::ErrorCode::InvalidUsage,
             "alignment %llu is not a power of two", static_cast<unsigned long long>(alignment));
  if (alignment < kGranularity) alignment = kGranularity;
  if (bytes == 0 || bytes > UINT64_MAX - kGranularity) return std::nullopt;
  bytes = (bytes + kGranularity - 1) / kGranularity * kGranularity;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    uint64_t start = (it->first + alignment - 1) & ~(alignment - 1);
    uint64_t end = it->first + it->second;
    if (start < it->first || start > end || end - start < bytes) continue;
    uint64_t rangeStart = it->first;
    free_.erase(it);
    if (start > rangeStart) free_[rangeStart] = start - rangeStart;
    if (start + bytes < end) free_[start + bytes] = end - (start + bytes);
    used_[start] = bytes;
    return start;
  }
  return std::nullopt;
}

std::optional<uint64_t> SymmetricAllocator::SizeAt(uint64_t offset) const {
  auto it = used_.find(offset);
  if (it == used_.end()) return std::nullopt;
  return it->second;
}

bool SymmetricAllocator::Free(uint64_t offset) {
  auto it = used_.find(offset);
  if (it == used_.end()) return false;
  uint64_t start = offset;
  uint64_t bytes = it->second;
  used_.erase(it);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + bytes) {  // merge with the free range after
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // and with the one before
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      bytes += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = bytes;
  return true;
}

uint64_t SymmetricAllocator::FreeBytes() const {
  uint64_t total = 0;
  for (const auto& [offset, bytes] : free_) total += bytes;
  return total;
}

uint64_t SymmetricAllocator::LargestFree() const {
  uint64_t best = 0;
  for (const auto& [offset, bytes] : free_) best = bytes > best ? bytes : best;
  return best;
}

}  // namespace mori::shmem
