// A copy that a group of threads does together (a warp, a block, or any threadId/numThreads split), for
// copies into a peer's mapped memory and back: bytes up to a common alignment, then 16-byte vectors with
// four loads in flight per thread, then words and the last bytes. Includes nothing host-only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/device.hpp"

#if MORI_BACKEND_HIP && MORI_GPU_COMPILER
#include <hip/hip_runtime.h>
#endif

namespace mori::core {

#if MORI_GPU_COMPILER
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint64_t lo, hi;
};
#endif

#if MORI_DEVICE_API_AVAILABLE
// Thread `rank` of `n` copies its share of [src, src + bytes) to dst; the copy is whole once all n did.
MORI_DEVICE_INLINE void CopyCooperative(void* dst, const void* src, size_t bytes, size_t rank, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* sp = static_cast<const uint8_t*>(src);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(sp);
  size_t done = 0;
  if ((mis & 7) == 0) {
    // Same alignment mod 8: bytes up to an 8-byte boundary, one word to a 16-byte boundary when both agree
    // mod 16, then 16-byte vectors (four loads in flight before the stores: one vector per thread at a time
    // leaves NVLink idle), then words, then the last bytes.
    size_t head = (8 - (reinterpret_cast<uintptr_t>(d) & 7)) & 7;
    if (head > bytes) head = bytes;
    for (size_t i = rank; i < head; i += n) d[i] = sp[i];
    done = head;
    if ((mis & 15) == 0) {
      if (((reinterpret_cast<uintptr_t>(d) + done) & 15) != 0 && bytes - done >= 8) {
        if (rank == 0) *reinterpret_cast<uint64_t*>(d + done) = *reinterpret_cast<const uint64_t*>(sp + done);
        done += 8;
      }
      const size_t vecs = (bytes - done) / 16;
      auto* dv = reinterpret_cast<Vec16*>(d + done);
      const auto* sv = reinterpret_cast<const Vec16*>(sp + done);
      size_t i = rank;
      for (; i + 3 * n < vecs; i += 4 * n) {
        Vec16 v0 = sv[i], v1 = sv[i + n], v2 = sv[i + 2 * n], v3 = sv[i + 3 * n];
        dv[i] = v0;
        dv[i + n] = v1;
        dv[i + 2 * n] = v2;
        dv[i + 3 * n] = v3;
      }
      for (; i < vecs; i += n) dv[i] = sv[i];
      done += vecs * 16;
    }
    const size_t words = (bytes - done) / 8;
    auto* dw = reinterpret_cast<uint64_t*>(d + done);
    const auto* sw = reinterpret_cast<const uint64_t*>(sp + done);
    for (size_t i = rank; i < words; i += n) dw[i] = sw[i];
    done += words * 8;
  }
  for (size_t i = done + rank; i < bytes; i += n) d[i] = sp[i];
}
#endif

}  // namespace mori::core
