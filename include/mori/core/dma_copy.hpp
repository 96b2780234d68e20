// A host-side copy that stands in for a DMA engine (HOST backend copies, the emulated NIC, TCP receivers).
// Kernels poll words such engines write; a real engine is outside the C++ memory model, a host thread is
// not. Under ThreadSanitizer the aligned 8-byte words are stored atomically so polling them is not a
// reported race (release stores: a flag written after data publishes it); otherwise it is memmove.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mori::core {

inline void DmaCopy(void* dst, const void* src, size_t n) {
#if defined(__SANITIZE_THREAD__)
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const bool overlap = d < s + n && s < d + n;
  if (!overlap) {
    size_t head = (8 - reinterpret_cast<uintptr_t>(d) % 8) % 8;
    if (head > n) head = n;
    std::memcpy(d, s, head);
    size_t i = head;
    // Words of an equally aligned source are loaded atomically too: another engine may write them.
    const bool aligned = reinterpret_cast<uintptr_t>(s + head) % 8 == 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      if (aligned) {
        w = __atomic_load_n(reinterpret_cast<const uint64_t*>(s + i), __ATOMIC_ACQUIRE);
      } else {
        std::memcpy(&w, s + i, 8);
      }
      __atomic_store_n(reinterpret_cast<uint64_t*>(d + i), w, __ATOMIC_RELEASE);
    }
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  std::memmove(dst, src, n);
}

}  // namespace mori::core
