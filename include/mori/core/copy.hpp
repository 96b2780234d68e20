// A copy that a group of threads does together (a warp, a block, or any threadId/numThreads split), for
// copies into a peer's mapped memory and back: bytes up to a common alignment, then 16-byte vectors with
// up to four loads in flight per thread, then words and the last bytes. Includes nothing host-only.
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
// Thread `rank` of `n` copies vectors rank, rank + n, ... of `count`: four loads in flight before the stores
// (one vector per thread at a time leaves NVLink idle), then one at a time. `Index` is 32-bit where the count
// allows: half the instructions of 64-bit indices, which matters when every thread of a block runs the loop
// control for a short copy.
template <typename Index>
MORI_DEVICE_INLINE void CopyVectors(Vec16* dv, const Vec16* sv, Index count, Index rank, Index n) {
  Index i = rank;
  for (; i + 3 * n < count; i += 4 * n) {
    Vec16 v0 = sv[i], v1 = sv[i + n], v2 = sv[i + 2 * n], v3 = sv[i + 3 * n];
    dv[i] = v0;
    dv[i + n] = v1;
    dv[i + 2 * n] = v2;
    dv[i + 3 * n] = v3;
  }
  // At most three vectors are left for this thread: their loads go out together too (a block copying 32 KiB
  // has two vectors per thread, and one at a time would wait for memory twice). hipcc 5.2's AMDGPU backend
  // fails on these predicated loads in some kernels ("failed to annotate CFG"): HIP keeps the plain loop.
#if MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  for (; i < count; i += n) dv[i] = sv[i];
#else
  if (i < count) {
    const bool has1 = i + n < count, has2 = i + 2 * n < count;
    Vec16 v0 = sv[i], v1{}, v2{};
    if (has1) v1 = sv[i + n];
    if (has2) v2 = sv[i + 2 * n];
    dv[i] = v0;
    if (has1) dv[i + n] = v1;
    if (has2) dv[i + 2 * n] = v2;
  }
#endif
}

// Thread `rank` of `n` copies its share of [src, src + bytes) to dst; the copy is whole once all n did.
MORI_DEVICE_INLINE void CopyCooperative(void* dst, const void* src, size_t bytes, size_t rank, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* sp = static_cast<const uint8_t*>(src);
  // Both ends 16-byte aligned and whole vectors (symmetric buffers, most messages): one vector loop. The
  // bound keeps i + 3n of 32-bit indices from wrapping.
  const uintptr_t all = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(sp) | bytes;
  if ((all & 15) == 0 && bytes < (size_t(1) << 35) && n <= (1u << 20)) {
    CopyVectors<uint32_t>(reinterpret_cast<Vec16*>(d), reinterpret_cast<const Vec16*>(sp),
                          static_cast<uint32_t>(bytes >> 4), static_cast<uint32_t>(rank), static_cast<uint32_t>(n));
    return;
  }
  // Short messages of whole 8-byte words (a signal-sized payload, a few values): one word loop.
  if ((all & 7) == 0 && bytes <= 256 && n <= (1u << 20)) {
    auto* dw = reinterpret_cast<uint64_t*>(d);
    const auto* sw = reinterpret_cast<const uint64_t*>(sp);
    for (uint32_t i = static_cast<uint32_t>(rank); i < static_cast<uint32_t>(bytes >> 3); i += static_cast<uint32_t>(n)) {
      dw[i] = sw[i];
    }
    return;
  }
  const uintptr_t mis = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(sp);
  size_t done = 0;
  if ((mis & 7) == 0) {
    // Same alignment mod 8: bytes up to an 8-byte boundary, one word to a 16-byte boundary when both agree
    // mod 16, then 16-byte vectors, then words, then the last bytes.
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
      CopyVectors<size_t>(reinterpret_cast<Vec16*>(d + done), reinterpret_cast<const Vec16*>(sp + done), vecs, rank,
                          n);
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
