// SipHash-2-4 (Aumasson and Bernstein, 2012): a keyed 64-bit hash. Whoever sees some of its outputs learns
// nothing of the key nor of the hash of any other input, which is what FNV and other plain hashes do not give.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::core {

struct SipKey {
  uint64_t k0;  // key bytes 0..7, little-endian
  uint64_t k1;  // key bytes 8..15
};

uint64_t SipHash24(const SipKey& key, const void* data, size_t bytes);

}  // namespace mori::core
