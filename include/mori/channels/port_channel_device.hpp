// The device side of a port channel: one thread calls its methods, each of which pushes one request into the
// proxy's FIFO (Wait and Poll read the semaphore directly). Offsets are bytes into the channel's destination
// and source memories; they and each put's size must fit 32 bits (larger puts are split into several
// requests). Plain data; includes nothing host-only.
#pragma once

#include <cstddef>
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
  // The fence before a put of data from `src` (Put, PutWithSignal of at least a byte) is pushed: a FifoOrder,
  // set by ProxyService::PortChannel for `src` (change both together). AfterDeviceWrites where `src` is device
  // memory of the proxy's GPU: the pushing thread runs there, and a device-scope release makes its writes to
  // that memory visible to the copy engine or NIC that reads it (0.2 us less per push than the system scope on
  // an H200). AfterWrites (0) otherwise, and any other value counts as AfterWrites. This word was `reserved`
  // before; a uint32_t still, so a handle aggregate-initialized with a 0 there keeps compiling.
  uint32_t putOrder;
  SemaphoreDeviceHandle semaphore;
  FifoDeviceHandle fifo;

  // The fence a request of `type` carrying `bytes` of data needs. A flush alone names nothing; a put of data
  // from `src` needs its source visible (putOrder); anything else, a signal with no data included, tells the
  // peer that whatever this thread wrote before is there (the system scope).
  MORI_HOST_DEVICE_INLINE FifoOrder OrderOf(uint32_t type, uint64_t bytes) const {
    if (type == kTriggerFlush) return FifoOrder::PayloadOnly;
    const bool putOfData = (type & kTriggerData) != 0 && bytes > 0;
    if (putOfData && putOrder == static_cast<uint32_t>(FifoOrder::AfterDeviceWrites)) {
      return FifoOrder::AfterDeviceWrites;
    }
    return FifoOrder::AfterWrites;
  }

#if MORI_DEVICE_API_AVAILABLE
  // Copies local [srcOffset, + bytes) to the peer's [dstOffset, + bytes), asynchronously.
  MORI_DEVICE_INLINE void Put(uint64_t dstOffset, uint64_t srcOffset, uint64_t bytes) {
    Request(kTriggerData, dstOffset, srcOffset, bytes);
  }
  MORI_DEVICE_INLINE void Put(uint64_t offset, uint64_t bytes) { Put(offset, offset, bytes); }

  // Raises the peer's semaphore once every earlier Put of this channel has landed, and after every write this
  // thread made before (a system-scope release).
  MORI_DEVICE_INLINE void Signal() { Request(kTriggerSignal, 0, 0, 0); }

  // Put, then the peer's semaphore raised once it and every earlier Put of this channel have landed. Of this
  // thread's other writes it orders only the put's source (putOrder): writes the peer reads elsewhere (host
  // memory, memory-channel stores into the peer) need Put then Signal.
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
      slot = fifo.Push(EncodePortRequest(PortRequest{t, semaphoreId, dst, src, dstOffset, srcOffset, chunk}),
                       OrderOf(t, chunk));
      dstOffset += chunk;
      srcOffset += chunk;
      bytes -= chunk;
    } while (bytes > 0);
    return slot;
  }
#endif
};
static_assert(std::is_trivially_copyable_v<PortChannelDeviceHandle>, "device handles are copied into kernels as bytes");
static_assert(static_cast<uint32_t>(FifoOrder::AfterWrites) == 0, "a zeroed putOrder is the system scope");
static_assert(offsetof(PortChannelDeviceHandle, putOrder) == 12 && offsetof(PortChannelDeviceHandle, semaphore) == 16,
              "the handle's layout is that of the first release (putOrder was its reserved word)");

}  // namespace mori::core
