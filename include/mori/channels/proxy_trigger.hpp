// The 16-byte request a kernel pushes into a proxy FIFO, shared by host and device; includes nothing
// host-only. The FIFO owns bit 63 of `snd` (lap parity: a slot written in an earlier lap is never read as
// new); the other 127 bits belong to whoever defines the request. Port channels use the layout below;
// other services (the SHMEM proxy) define their own and say how many slots a request takes.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/device.hpp"

namespace mori::core {

struct alignas(16) ProxyTrigger {
  uint64_t fst;
  uint64_t snd;
};
static_assert(sizeof(ProxyTrigger) == 16 && alignof(ProxyTrigger) == 16, "a trigger is one 16-byte slot");
static_assert(std::is_trivially_copyable_v<ProxyTrigger>, "triggers are copied as bytes");

constexpr unsigned kTriggerLapBitShift = 63;
constexpr uint64_t kTriggerLapBit = uint64_t{1} << kTriggerLapBitShift;

// The lap-parity value a trigger in `slot` carries (slot counts from 0 and never wraps; fifoSize is a power
// of two, as Fifo requires). Lap 0 carries 1, so the zeroed memory of a new FIFO reads as empty. The lap's
// parity is the slot's bit of weight fifoSize: a division by the size, which the compiler cannot see is a
// power of two, cost every push a 64-bit division routine on the GPU after its claim.
MORI_HOST_DEVICE_INLINE constexpr uint64_t TriggerLapBit(uint64_t slot, uint32_t fifoSize) {
  return uint64_t{(slot & fifoSize) == 0} << kTriggerLapBitShift;
}

// ---- the port channel request ----
//   fst  [ 0,32)  size            bytes to copy
//   fst  [32,64)  srcOffset       in the source memory
//   snd  [ 0,32)  dstOffset       in the destination memory
//   snd  [32,41)  srcMemoryId     ProxyService::AddMemory ids
//   snd  [41,50)  dstMemoryId
//   snd  [50,53)  type            kTriggerData | kTriggerSignal | kTriggerFlush; 0: a custom request
//   snd  [53,63)  semaphoreId     ProxyService::AddSemaphore id (its connection executes the request)
//   snd  63       lap parity      the FIFO's
constexpr unsigned kTriggerSizeBits = 32;
constexpr unsigned kTriggerOffsetBits = 32;
constexpr unsigned kTriggerMemoryIdBits = 9;
constexpr unsigned kTriggerTypeBits = 3;
constexpr unsigned kTriggerSemaphoreIdBits = 10;
static_assert(kTriggerSizeBits + 2 * kTriggerOffsetBits + 2 * kTriggerMemoryIdBits + kTriggerTypeBits +
                      kTriggerSemaphoreIdBits + 1 ==
                  128,
              "the port channel request fills the 16 bytes exactly");

constexpr unsigned kTriggerSrcMemoryIdShift = 32;
constexpr unsigned kTriggerDstMemoryIdShift = kTriggerSrcMemoryIdShift + kTriggerMemoryIdBits;
constexpr unsigned kTriggerTypeShift = kTriggerDstMemoryIdShift + kTriggerMemoryIdBits;
constexpr unsigned kTriggerSemaphoreIdShift = kTriggerTypeShift + kTriggerTypeBits;
static_assert(kTriggerSemaphoreIdShift + kTriggerSemaphoreIdBits == kTriggerLapBitShift, "fields end at the lap bit");

constexpr uint32_t kTriggerData = 1;    // copy size bytes from src to dst
constexpr uint32_t kTriggerSignal = 2;  // then signal the semaphore's peer
constexpr uint32_t kTriggerFlush = 4;   // then wait until the connection has completed everything

constexpr uint32_t kMaxProxyMemories = 1u << kTriggerMemoryIdBits;
constexpr uint32_t kMaxProxySemaphores = 1u << kTriggerSemaphoreIdBits;
constexpr uint64_t kMaxTriggerSize = (uint64_t{1} << kTriggerSizeBits) - 1;
constexpr uint64_t kMaxTriggerOffset = (uint64_t{1} << kTriggerOffsetBits) - 1;

using MemoryId = uint32_t;
using SemaphoreId = uint32_t;

struct PortRequest {
  uint32_t type;
  uint32_t semaphoreId;
  MemoryId dstMemoryId;
  MemoryId srcMemoryId;
  uint64_t dstOffset;
  uint64_t srcOffset;
  uint64_t size;
};

MORI_HOST_DEVICE_INLINE constexpr ProxyTrigger EncodePortRequest(const PortRequest& r) {
  ProxyTrigger t{};
  t.fst = (r.size & kMaxTriggerSize) | ((r.srcOffset & kMaxTriggerOffset) << kTriggerSizeBits);
  t.snd = (r.dstOffset & kMaxTriggerOffset) |
          (static_cast<uint64_t>(r.srcMemoryId & (kMaxProxyMemories - 1)) << kTriggerSrcMemoryIdShift) |
          (static_cast<uint64_t>(r.dstMemoryId & (kMaxProxyMemories - 1)) << kTriggerDstMemoryIdShift) |
          (static_cast<uint64_t>(r.type & ((1u << kTriggerTypeBits) - 1)) << kTriggerTypeShift) |
          (static_cast<uint64_t>(r.semaphoreId & (kMaxProxySemaphores - 1)) << kTriggerSemaphoreIdShift);
  return t;
}

MORI_HOST_DEVICE_INLINE constexpr PortRequest DecodePortRequest(const ProxyTrigger& t) {
  PortRequest r{};
  r.size = t.fst & kMaxTriggerSize;
  r.srcOffset = t.fst >> kTriggerSizeBits;
  r.dstOffset = t.snd & kMaxTriggerOffset;
  r.srcMemoryId = static_cast<MemoryId>((t.snd >> kTriggerSrcMemoryIdShift) & (kMaxProxyMemories - 1));
  r.dstMemoryId = static_cast<MemoryId>((t.snd >> kTriggerDstMemoryIdShift) & (kMaxProxyMemories - 1));
  r.type = static_cast<uint32_t>((t.snd >> kTriggerTypeShift) & ((1u << kTriggerTypeBits) - 1));
  r.semaphoreId = static_cast<SemaphoreId>((t.snd >> kTriggerSemaphoreIdShift) & (kMaxProxySemaphores - 1));
  return r;
}

}  // namespace mori::core
