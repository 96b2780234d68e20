// The device side of a port channel: one thread calls its methods, each of which pushes one request into the
// proxy's FIFO (Wait and Poll read the semaphore directly). Offsets are bytes into the channel's destination
// and source memories; they and each put's size must fit 32 bits (larger puts are split into several
// requests). Plain data; includes nothing host-only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/channels/fifo_device.hpp"
#include "mori/channels/proxy_trigger.hpp"
#include "mori/channels/semaphore_device.hpp"

namespace mori::core {

struct PortChannelDeviceHandle {
  SemaphoreId semaphoreId;
  MemoryId dst;
  MemoryId src;
  // The fence a push of a put (Put, PutWithSignal) makes before its request becomes visible to the proxy,
  // chosen by ProxyService::PortChannel: AfterDeviceWrites where the source is device memory of the proxy's
  // GPU, whose kernels push (the data a put names is then written by this GPU: a device-scope release makes it
  // visible to the copy engine or NIC that reads it, 0.2 us less per push on an H200); AfterWrites
  // otherwise, and in a handle made by value-initialization. Signal and Flush alone do not use it.
  FifoOrder putOrder;
  SemaphoreDeviceHandle semaphore;
  FifoDeviceHandle fifo;

#if MORI_DEVICE_API_AVAILABLE
  // Copies local [srcOffset, + bytes) to the peer's [dstOffset, + bytes), asynchronously.
  MORI_DEVICE_INLINE void Put(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes) {
    Request(kTriggerData, dstOffset, srcOffset, bytes);
  }
  MORI_DEVICE_INLINE void Put(uint64_t offset, uint64_t bytes) { Put(offset, offset, bytes); }

  // Raises the peer's semaphore once every earlier Put of this channel has landed.
  MORI_DEVICE_INLINE void Signal() { Request(kTriggerSignal, 0, 0, 0); }

  MORI_DEVICE_INLINE void PutWithSignal(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes) {
    Request(kTriggerData | kTriggerSignal, dstOffset, srcOffset, bytes);
  }
  MORI_DEVICE_INLINE void PutWithSignal(uint64_t offset, uint64_t bytes) { PutWithSignal(offset, offset, bytes); }

  // PutWithSignal, then returns once the put, the signal and everything before is complete at the peer.
  MORI_DEVICE_INLINE void PutWithSignalAndFlush(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes) {
    fifo.Sync(Request(kTriggerData | kTriggerSignal | kTriggerFlush, dstOffset, srcOffset, bytes));
  }
  MORI_DEVICE_INLINE void PutWithSignalAndFlush(uint64_t offset, uint64_t bytes) {
    PutWithSignalAndFlush(offset, offset, bytes);
  }

  // Returns once every earlier request of this channel is complete at the peer.
  MORI_DEVICE_INLINE void Flush() { fifo.Sync(Request(kTriggerFlush, 0, 0, 0)); }

  // Waits for (consumes) the peer's next signal; Poll consumes one if it has arrived.
  MORI_DEVICE_INLINE void Wait() { semaphore.Wait(); }
  MORI_DEVICE_INLINE bool Poll() { return semaphore.Poll(); }

 private:
  // Pushes the request (split into requests of at most kMaxTriggerSize bytes); returns the last slot.
  MORI_DEVICE_INLINE uint64_t Request(uint32_t type, uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes) {
    MORI_DEVICE_ASSERT(
        bytes == 0 || (dstOffset + bytes - 1 <= kMaxTriggerOffset && srcOffset + bytes - 1 <= kMaxTriggerOffset),
        "mori port channel (rank %d to %d): [dst %llu, src %llu) + %llu bytes reach beyond the 32-bit "
        "offsets of a request",
        semaphore.rank, semaphore.remoteRank, static_cast<unsigned long long>(dstOffset),
        static_cast<unsigned long long>(srcOffset), static_cast<unsigned long long>(bytes));
    uint64_t slot = 0;
    do {
      uint64_t chunk = bytes < kMaxTriggerSize ? bytes : kMaxTriggerSize;
      bool last = chunk == bytes;
      // Only the last piece carries the signal and the flush, so they follow the whole put.
      uint32_t t = last ? type : (type & kTriggerData);
      // A flush alone names no data; a put does (putOrder covers its source), and a signal alone tells the peer
      // that whatever this thread wrote before is there.
      const FifoOrder order = t == kTriggerFlush        ? FifoOrder::PayloadOnly
                              : (t & kTriggerData) != 0 ? putOrder
                                                        : FifoOrder::AfterWrites;
      slot = fifo.Push(EncodePortRequest(PortRequest{t, semaphoreId, dst, src, dstOffset, srcOffset, chunk}), order);
      dstOffset += chunk;
      srcOffset += chunk;
      bytes -= chunk;
    } while (bytes > 0);
    return slot;
  }
#endif
};
static_assert(std::is_trivially_copyable_v<PortChannelDeviceHandle>, "device handles are copied into kernels as bytes");

}  // namespace mori::core
