// The device side of a memory channel: the threads of a kernel copy straight into (Put) or out of (Get) the
// peer's memory mapped here, or exchange LL packets; a semaphore orders the rounds. Put/Get/packets are
// cooperative (every one of numThreads threads calls with its threadId and the same arguments); Signal, Wait
// and Poll are called by one thread. Offsets are bytes; every range is checked against the memory's size.
// Plain data; includes nothing host-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "mori/core/copy.hpp"
#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/channels/packet.hpp"
#include "mori/channels/semaphore_device.hpp"

namespace mori::core {

struct MemoryChannelDeviceHandle {
  SemaphoreDeviceHandle semaphore;
  void* dst;           // the peer's memory, mapped here
  void* src;           // this side's memory
  void* packetBuffer;  // this side's memory that the peer's PutPackets write into
  uint64_t dstBytes;
  uint64_t srcBytes;
  uint64_t packetBufferBytes;

#if MORI_DEVICE_API_AVAILABLE
  // Copies local [srcOffset, + bytes) to the peer's [dstOffset, + bytes).
  MORI_DEVICE_INLINE void Put(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes, uint32_t threadId,
                              uint32_t numThreads) {
    CheckRange("Put", "destination", dstOffset, bytes, dstBytes);
    CheckRange("Put", "source", srcOffset, bytes, srcBytes);
    CopyCooperative(static_cast<uint8_t*>(dst) + dstOffset, static_cast<const uint8_t*>(src) + srcOffset, bytes,
                    threadId, numThreads);
  }
  MORI_DEVICE_INLINE void Put(uint64_t offset, uint64_t bytes, uint32_t threadId, uint32_t numThreads) {
    Put(offset, offset, bytes, threadId, numThreads);
  }

  // Copies the peer's [srcOffset, + bytes) to local [dstOffset, + bytes).
  MORI_DEVICE_INLINE void Get(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes, uint32_t threadId,
                              uint32_t numThreads) {
    CheckRange("Get", "destination", dstOffset, bytes, srcBytes);
    CheckRange("Get", "source", srcOffset, bytes, dstBytes);
    CopyCooperative(static_cast<uint8_t*>(src) + dstOffset, static_cast<const uint8_t*>(dst) + srcOffset, bytes,
                    threadId, numThreads);
  }
  MORI_DEVICE_INLINE void Get(uint64_t offset, uint64_t bytes, uint32_t threadId, uint32_t numThreads) {
    Get(offset, offset, bytes, threadId, numThreads);
  }

  // Sends local [srcOffset, + bytes) as packets of round `flag` into the peer's memory at dstOffset (the
  // packets take bytes / P::kDataBytes * sizeof(P) bytes there). `bytes` is a multiple of P::kDataBytes and
  // srcOffset is aligned to it; dstOffset is aligned to sizeof(P). `flag` is never 0 and differs from the
  // flag of the packets already at dstOffset (the previous round's there).
  template <typename P = LL16Packet>
  MORI_DEVICE_INLINE void PutPackets(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes, uint32_t threadId,
                                     uint32_t numThreads, uint32_t flag) {
    MORI_DEVICE_ASSERT(bytes % P::kDataBytes == 0 && srcOffset % P::kDataBytes == 0 && dstOffset % sizeof(P) == 0,
                       "mori memory channel (rank %d to %d): PutPackets of %llu bytes from offset %llu to %llu is not "
                       "aligned to the packet (%u data bytes in %u)",
                       semaphore.rank, semaphore.remoteRank, static_cast<unsigned long long>(bytes),
                       static_cast<unsigned long long>(srcOffset), static_cast<unsigned long long>(dstOffset),
                       P::kDataBytes, static_cast<unsigned>(sizeof(P)));
    CheckFlag("PutPackets", flag);
    const uint64_t n = bytes / P::kDataBytes;
    CheckRange("PutPackets", "destination", dstOffset, n * sizeof(P), dstBytes);
    CheckRange("PutPackets", "source", srcOffset, bytes, srcBytes);
    P* out = reinterpret_cast<P*>(static_cast<uint8_t*>(dst) + dstOffset);
    const uint8_t* in = static_cast<const uint8_t*>(src) + srcOffset;
    for (uint64_t i = threadId; i < n; i += numThreads) {
      if constexpr (P::kDataBytes == 8) {
        out[i].Write(*reinterpret_cast<const uint64_t*>(in + i * 8), flag);
      } else {
        out[i].Write(*reinterpret_cast<const uint32_t*>(in + i * 4), flag);
      }
    }
  }

  // Waits for the packets of round `flag` in this side's packet buffer at srcOffset and writes their data to
  // local [dstOffset, + bytes).
  template <typename P = LL16Packet>
  MORI_DEVICE_INLINE void UnpackPackets(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes, uint32_t threadId,
                                        uint32_t numThreads, uint32_t flag) {
    MORI_DEVICE_ASSERT(bytes % P::kDataBytes == 0 && dstOffset % P::kDataBytes == 0 && srcOffset % sizeof(P) == 0,
                       "mori memory channel (rank %d from %d): UnpackPackets of %llu bytes from offset %llu to %llu "
                       "is not aligned to the packet (%u data bytes in %u)",
                       semaphore.rank, semaphore.remoteRank, static_cast<unsigned long long>(bytes),
                       static_cast<unsigned long long>(srcOffset), static_cast<unsigned long long>(dstOffset),
                       P::kDataBytes, static_cast<unsigned>(sizeof(P)));
    CheckFlag("UnpackPackets", flag);
    const uint64_t n = bytes / P::kDataBytes;
    CheckRange("UnpackPackets", "packet buffer", srcOffset, n * sizeof(P), packetBufferBytes);
    CheckRange("UnpackPackets", "destination", dstOffset, bytes, srcBytes);
    const P* in = reinterpret_cast<const P*>(static_cast<const uint8_t*>(packetBuffer) + srcOffset);
    uint8_t* out = static_cast<uint8_t*>(src) + dstOffset;
    for (uint64_t i = threadId; i < n; i += numThreads) {
      if constexpr (P::kDataBytes == 8) {
        *reinterpret_cast<uint64_t*>(out + i * 8) = in[i].Read(flag, semaphore.timeoutNs, semaphore.stop);
      } else {
        *reinterpret_cast<uint32_t*>(out + i * 4) = in[i].Read(flag, semaphore.timeoutNs, semaphore.stop);
      }
    }
  }
  template <typename P = LL16Packet>
  MORI_DEVICE_INLINE void GetPackets(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes, uint32_t threadId,
                                     uint32_t numThreads, uint32_t flag) {
    UnpackPackets<P>(dstOffset, srcOffset, bytes, threadId, numThreads, flag);
  }

  MORI_DEVICE_INLINE void Signal() { semaphore.Signal(); }
  MORI_DEVICE_INLINE void Wait() { semaphore.Wait(); }
  MORI_DEVICE_INLINE bool Poll() { return semaphore.Poll(); }

 private:
  MORI_DEVICE_INLINE void CheckRange(const char* op, const char* what, uint64_t offset, uint64_t bytes,
                                     uint64_t limit) const {
    MORI_DEVICE_ASSERT(bytes <= limit && offset <= limit - bytes,
                       "mori memory channel (rank %d, peer %d): %s: %s range [%llu, + %llu) is outside its %llu bytes",
                       semaphore.rank, semaphore.remoteRank, op, what, static_cast<unsigned long long>(offset),
                       static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(limit));
  }
  // Memory that was never written (or was cleared) reads as flag 0 with data 0: a round of flag 0 would
  // accept it as arrived.
  MORI_DEVICE_INLINE void CheckFlag(const char* op, uint32_t flag) const {
    MORI_DEVICE_ASSERT(flag != 0,
                       "mori memory channel (rank %d, peer %d): %s with flag 0, which cleared memory already carries; "
                       "number rounds from 1",
                       semaphore.rank, semaphore.remoteRank, op);
  }
#endif
};
static_assert(std::is_trivially_copyable_v<MemoryChannelDeviceHandle>,
              "device handles are copied into kernels as bytes");

}  // namespace mori::core
