// The device side of a semaphore between two peers: a token the peer raises (inbound), a count of signals
// this side has consumed (expected) and one of signals it has sent (outbound). Plain data; includes nothing
// host-only. Wait and Poll are called by one thread at a time; Signal (memory channels: the peer's token is
// mapped here) by one thread after the data it announces is written (a block synchronises first).
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/atomic.hpp"
#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"

namespace mori::core {

struct SemaphoreDeviceHandle {
  uint64_t* inboundToken;          // raised by the peer (its kernel, its proxy, or a NIC/TCP write)
  uint64_t* expectedInboundToken;  // signals this side has waited for (device memory)
  uint64_t* outboundToken;         // signals this side's kernels have sent (device memory)
  uint64_t* remoteInboundToken;    // the peer's inbound token mapped here (CudaIpc); nullptr otherwise
  uint64_t timeoutNs;              // bound of Wait (MORI_TIMEOUT_S when built)
  int32_t rank;                    // this side and the peer, for messages
  int32_t remoteRank;
  const uint32_t* stop;            // the process's stop word (core/stop.hpp): Wait leaves the kernel once set

#if MORI_DEVICE_API_AVAILABLE
  // Consumes one signal if one has arrived.
  MORI_DEVICE_INLINE bool Poll() {
    uint64_t expected = AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(expectedInboundToken) + 1;
    if (AtomicLoad<MemoryOrder::Acquire, Scope::System>(inboundToken) < expected) return false;
    AtomicStore<MemoryOrder::Relaxed, Scope::Device>(expectedInboundToken, expected);
    return true;
  }

  // Waits for the next signal; traps, naming both ranks and the counts, when none comes within the timeout.
  MORI_DEVICE_INLINE void Wait() {
    uint64_t expected = AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(expectedInboundToken) + 1;
    AtomicStore<MemoryOrder::Relaxed, Scope::Device>(expectedInboundToken, expected);
    SpinDeadline deadline(timeoutNs, stop);
    for (;;) {
      uint64_t seen = AtomicLoad<MemoryOrder::Acquire, Scope::System>(inboundToken);
      if (seen >= expected) return;
      MORI_DEVICE_ASSERT(!deadline.Expired(),
                         "mori semaphore: rank %d waited %llu ns for signal #%llu from rank %d (%llu arrived): did "
                         "the peer die or never signal?",
                         rank, static_cast<unsigned long long>(timeoutNs), static_cast<unsigned long long>(expected),
                         remoteRank, static_cast<unsigned long long>(seen));
      SpinPause();
    }
  }

  // Raises the peer's token directly (memory channels). Every store this thread made before, and every store
  // of the threads it synchronised with, is visible at the peer before the token is.
  MORI_DEVICE_INLINE void Signal() {
    MORI_DEVICE_ASSERT(remoteInboundToken != nullptr,
                       "mori semaphore: rank %d signals rank %d from a kernel, but the peer's token is not mapped "
                       "here (a CudaIpc connection is needed; port channels signal through their proxy)",
                       rank, remoteRank);
    uint64_t next = AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(outboundToken, uint64_t{1}) + 1;
    AtomicStore<MemoryOrder::Release, Scope::System>(remoteInboundToken, next);
  }
#endif
};
static_assert(std::is_trivially_copyable_v<SemaphoreDeviceHandle>, "device handles are copied into kernels as bytes");

}  // namespace mori::core
