// The producer side of a proxy FIFO: GPU threads (host threads on HOST) push 16-byte triggers into a
// host-pinned ring that one host thread pops in order. A push claims its slots with one atomic add, waits
// (bounded) while the ring is full, writes the payload word and then the word with the lap parity, so the
// host never reads a half-written or stale trigger. Plain data; includes nothing host-only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/atomic.hpp"
#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/proxy_trigger.hpp"

namespace mori::core {

// What *proxyFailed holds once the proxy failed: 1 + the host's ErrorCode (errors.hpp; fifo.cpp checks the order
// against the names below), or kFifoFailedUnknown for a failure that was not a mori error.
constexpr uint32_t kFifoFailedUnknown = 0xFFFFFFFFu;

// ErrorCodeName's words, for device messages (the FIFO test checks that they agree).
MORI_HOST_DEVICE_INLINE const char* FifoFailureName(uint32_t failed) {
  switch (failed) {
    case 1:
      return "invalid usage";
    case 2:
      return "system error";
    case 3:
      return "GPU error";
    case 4:
      return "RDMA error";
    case 5:
      return "timeout";
    case 6:
      return "remote failure";
    case 7:
      return "protocol error";
    case 8:
      return "not supported";
    case 9:
      return "internal error";
    default:
      return "unknown error";
  }
}

struct FifoDeviceHandle {
  ProxyTrigger* triggers;  // [size] ring, host-pinned
  uint64_t* head;          // slots claimed by producers so far (device memory)
  uint64_t* tail;          // slots the host has popped so far (host-pinned; the host writes it)
  uint32_t* proxyFailed;   // set by the host when its proxy thread failed (host-pinned)
  uint32_t size;           // power of two
  uint32_t reserved;
  uint64_t timeoutNs;  // bound of every wait (MORI_TIMEOUT_S when built)

#if MORI_DEVICE_API_AVAILABLE
  // Pushes `n` triggers into consecutive slots; returns the first slot's number. The host sees them in slot
  // order, so the triggers of one push arrive together and after those of earlier pushes by this thread.
  MORI_DEVICE_INLINE uint64_t Push(const ProxyTrigger* items, uint32_t n) {
    MORI_DEVICE_ASSERT(n >= 1 && n <= size, "mori fifo: a push of %u triggers into a FIFO of %u slots", n, size);
    uint64_t first = AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(head, static_cast<uint64_t>(n));
    // Room: every slot written in the previous lap must have been popped (the acquire orders the host's reads
    // of those slots before these writes).
    SpinDeadline deadline(timeoutNs);
    for (;;) {
      uint64_t popped = AtomicLoad<MemoryOrder::Acquire, Scope::System>(tail);
      if (first + n <= popped + size) break;
      CheckProxy();
      MORI_DEVICE_ASSERT(!deadline.Expired(),
                         "mori fifo: waited %llu ns for room for slot %llu (the proxy popped %llu of a %u-slot "
                         "ring): is the proxy running?",
                         static_cast<unsigned long long>(timeoutNs), static_cast<unsigned long long>(first),
                         static_cast<unsigned long long>(popped), size);
      SpinPause();
    }
    for (uint32_t k = 0; k < n; ++k) {
      uint64_t slot = first + k;
      ProxyTrigger* p = &triggers[slot & (size - 1)];
      AtomicStore<MemoryOrder::Relaxed, Scope::System>(&p->fst, items[k].fst);
      // The payload word is visible before the word that makes the slot valid.
      AtomicStore<MemoryOrder::Release, Scope::System>(&p->snd,
                                                       (items[k].snd & ~kTriggerLapBit) | TriggerLapBit(slot, size));
    }
    return first;
  }

  MORI_DEVICE_INLINE uint64_t Push(ProxyTrigger trigger) { return Push(&trigger, 1); }

  // Whether the host has popped (finished handling) `slot`.
  MORI_DEVICE_INLINE bool Popped(uint64_t slot) const {
    return AtomicLoad<MemoryOrder::Acquire, Scope::System>(tail) > slot;
  }

  // Waits until the host has popped `slot`: for a flush request, until the flush is done.
  MORI_DEVICE_INLINE void Sync(uint64_t slot) const {
    SpinDeadline deadline(timeoutNs);
    while (!Popped(slot)) {
      CheckProxy();
      MORI_DEVICE_ASSERT(!deadline.Expired(),
                         "mori fifo: waited %llu ns for the proxy to handle slot %llu (%llu handled): is the proxy "
                         "running?",
                         static_cast<unsigned long long>(timeoutNs), static_cast<unsigned long long>(slot),
                         static_cast<unsigned long long>(AtomicLoad<MemoryOrder::Relaxed, Scope::System>(tail)));
      SpinPause();
    }
  }

  // The failing trigger is never popped, so the tail names it.
  MORI_DEVICE_INLINE void CheckProxy() const {
    uint32_t failed = AtomicLoad<MemoryOrder::Relaxed, Scope::System>(proxyFailed);
    MORI_DEVICE_ASSERT(failed == 0,
                       "mori fifo: the proxy serving this FIFO failed (%s at the trigger in slot %llu; the host "
                       "log has its message)",
                       FifoFailureName(failed),
                       static_cast<unsigned long long>(AtomicLoad<MemoryOrder::Relaxed, Scope::System>(tail)));
  }
#endif
};
static_assert(std::is_trivially_copyable_v<FifoDeviceHandle>, "device handles are copied into kernels as bytes");

}  // namespace mori::core
