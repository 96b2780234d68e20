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
#include "mori/channels/proxy_trigger.hpp"

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

// What a push orders before its request becomes visible to the proxy.
enum class FifoOrder {
  // Every write this thread (or, after a barrier, its group) made before: the request names data the proxy
  // will read (a put's source) or must follow. One system-scope release fence per push (about 0.7 us of SM
  // time on an H100 and 0.5 us on an H200, measured by fifo_bench).
  AfterWrites,
  // Every write this thread (or its group) made before to GPU memory, for a consumer that reaches that memory
  // through the GPU itself: a copy engine, or a NIC reading over PCIe peer-to-peer. A device-scope release
  // fence (about 270 SM cycles on an H200, against 1,030 for the system scope) makes those writes performed
  // at the GPU's L2, where every such reader is served, before the slot store leaves for host memory; the
  // host thread that sees the slot starts the copy only after. This is the ordering GPU-initiated
  // networking relies on before a doorbell. Not enough for data in host memory (a registered pinned buffer):
  // use AfterWrites there. HIP and HOST fence as AfterWrites.
  AfterDeviceWrites,
  // Nothing: the request carries all it needs in its own slots (an inline value, an atomic's operands, a
  // quiet, a flush), and the FIFO keeps it after this thread's earlier requests anyway.
  PayloadOnly,
};

struct FifoDeviceHandle {
  ProxyTrigger* triggers;  // [size] ring, host-pinned
  uint64_t* head;          // slots claimed by producers so far (device memory)
  uint64_t* tail;          // slots the host has popped so far (host-pinned; the host writes it)
  uint32_t* proxyFailed;   // set by the host when its proxy thread failed (host-pinned)
  uint32_t size;           // power of two
  uint32_t reserved;
  uint64_t timeoutNs;      // bound of every wait (MORI_TIMEOUT_S when built)
  // A lower bound of *tail in device memory, raised by producers whenever they read the real one. A push
  // whose slots fit below it writes at once: reading the host-pinned tail is a round trip over PCIe
  // (about a microsecond), paid only when the ring looks full from here.
  uint64_t* tailSeen;
  const uint32_t* stop;  // the process's stop word (core/stop.hpp): waits leave the kernel once it is set

#if MORI_DEVICE_API_AVAILABLE
  // How often a wait on the host's tail also reads the host's failure flag.
  static constexpr uint32_t kFailureCheckEvery = 16;

  // Pushes `n` triggers into consecutive slots; returns the first slot's number. The host sees them in slot
  // order, so the triggers of one push arrive together and after those of earlier pushes by this thread.
  MORI_DEVICE_INLINE uint64_t Push(const ProxyTrigger* items, uint32_t n, FifoOrder order = FifoOrder::AfterWrites) {
    MORI_DEVICE_ASSERT(n >= 1 && n <= size, "mori fifo: a push of %u triggers into a FIFO of %u slots", n, size);
    // Room: every slot written in the previous lap must have been popped. tailSeen is read before the claim
    // and relaxed, so the two round trips to L2 overlap (read with acquire after the claim, a payload-only
    // push took 858 SM cycles on an H100, the claim alone 613). The slots are still written only after the host read
    // their previous contents: the stores below wait for the load's value (they are only issued once the
    // comparison is decided, and GPUs do not perform stores speculatively), and the value is at most a tail
    // that the host published after reading those slots. A stale value only sends the push to WaitForRoom,
    // which reads the tail itself with acquire.
#if MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
    // hipcc 5.2's AMDGPU backend fails on the branch into WaitForRoom below ("failed to annotate CFG"):
    // HIP producers read the host's tail on every push, as before the device-side copy existed, and write
    // after the wait; every push fences (the same failure on this fence under a branch).
    uint64_t first = AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(head, static_cast<uint64_t>(n));
    WaitForRoom(first, n, items, order);
    (void)order;
    AtomicFence<MemoryOrder::Release, Scope::System>();
    StoreSlots(items, first, n);
#else
    const uint64_t seen = AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(tailSeen);
    uint64_t first = AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(head, static_cast<uint64_t>(n));
    if (MORI_UNLIKELY(first + n > seen + size)) {
      WaitForRoom(first, n, items, order);  // writes the slots
    } else {
      Write(items, first, n, order);
    }
#endif
    return first;
  }

  // The fence `order` asks for, then the slots [first, first + n): a release fence and relaxed slot stores
  // after it (a release pattern), one fence for all the slots.
  MORI_DEVICE_INLINE void Write(const ProxyTrigger* items, uint64_t first, uint32_t n, FifoOrder order) const {
    if (order == FifoOrder::AfterWrites) {
      AtomicFence<MemoryOrder::Release, Scope::System>();
    } else if (order == FifoOrder::AfterDeviceWrites) {
#if MORI_BACKEND_CUDA
      AtomicFence<MemoryOrder::Release, Scope::Device>();
#else
      AtomicFence<MemoryOrder::Release, Scope::System>();
#endif
    }
    StoreSlots(items, first, n);
  }

  MORI_DEVICE_INLINE void StoreSlots(const ProxyTrigger* items, uint64_t first, uint32_t n) const {
    for (uint32_t k = 0; k < n; ++k) {
      uint64_t slot = first + k;
      StoreSlot(&triggers[slot & (size - 1)], items[k].fst,
                (items[k].snd & ~kTriggerLapBit) | TriggerLapBit(slot, size));
    }
  }

  MORI_DEVICE_INLINE uint64_t Push(ProxyTrigger trigger, FifoOrder order = FifoOrder::AfterWrites) {
    return Push(&trigger, 1, order);
  }

  // Writes one slot: `fst`, the payload word, is visible no later than `snd`, whose lap bit makes the slot
  // valid. On a GPU both words go in one 16-byte store: the slot is 16-byte aligned and reaches host memory
  // as one PCIe write, which the host sees whole (it reads snd, then fst). Two stores would need a system
  // fence between them on every push, even one that orders nothing else. Host threads (HOST backend) make
  // two stores, a release between them, which the C++ memory model orders.
  MORI_DEVICE_INLINE static void StoreSlot(ProxyTrigger* p, uint64_t fst, uint64_t snd) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
    asm volatile("st.relaxed.sys.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(fst), "l"(snd) : "memory");
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
    using Words = uint64_t __attribute__((ext_vector_type(2)));
    Words w = {fst, snd};
    __builtin_nontemporal_store(w, reinterpret_cast<Words*>(p));
#else
    AtomicStore<MemoryOrder::Relaxed, Scope::System>(&p->fst, fst);
    AtomicStore<MemoryOrder::Release, Scope::System>(&p->snd, snd);
#endif
  }

  // Producers whose first slot is within this many slots of the next one to be freed read the host's tail
  // themselves while they wait; the others watch tailSeen in device memory. The producer whose slot is freed
  // next is always among the readers (its slot is at most tailSeen + size: the claim before it found room).
  static constexpr uint64_t kTailReadersWindow = 64;
  static constexpr uint32_t kFarFailureCheckEvery = 1024;

  // Waits (bounded) until the host has popped enough for slots [first, first + n), writes them (Write with
  // `items` and `order`; on HIP the caller writes them after), and publishes what it saw of the host's tail
  // in tailSeen for the producers after it. The slots are written inside the wait, as soon as there is room:
  // the lanes of one warp that push together claim consecutive slots, so in a ring of fewer slots than a
  // warp's lanes a lane's room waits for another lane's slot to be written and popped. Written after the
  // wait returned, that slot came only once the lanes of the warp left the wait together, when the scheduler
  // gave up waiting for the lanes still in it (4,096 pushers through a 4-slot ring: 12 thousand triggers a
  // second on an H200, docs/PERF.md, 2026-11-29). Only those near the front of the queue read
  // the host's tail: 4,096 producers all reading it over PCIe took the FIFO from 36 to 1.6 million triggers
  // per second (fifo_bench, H100, 2026-11-26), each pop then waiting for a read queued behind thousands.
  MORI_DEVICE_NOINLINE void WaitForRoom(uint64_t first, uint32_t n, const ProxyTrigger* items, FifoOrder order) const {
    SpinDeadline deadline(timeoutNs, stop);
    uint32_t polls = 0;
    for (;;) {
      // Acquire: tailSeen was raised (release) by a producer that had read the host's tail with acquire, so
      // the host's reads of the slots' previous contents come before our stores into them.
      uint64_t seen = AtomicLoad<MemoryOrder::Acquire, Scope::Device>(tailSeen);
      bool room = first + n <= seen + size;
      const bool reader = first <= seen + size + kTailReadersWindow;
      if (!room && reader) {
        uint64_t popped = AtomicLoad<MemoryOrder::Acquire, Scope::System>(tail);
        // Raised only when it moves: the readers would otherwise queue on the word every poll.
        if (popped > seen) AtomicFetchMax<MemoryOrder::Release, Scope::Device>(tailSeen, popped);
        room = first + n <= popped + size;
      }
      if (room) {
#if MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
        (void)items;
        (void)order;
#else
        Write(items, first, n, order);
#endif
        return;
      }
      // A failed proxy pops nothing more: the readers notice soon, the rest seldom (host memory again).
      if (++polls % (reader ? kFailureCheckEvery : kFarFailureCheckEvery) == 0) CheckProxy();
      MORI_DEVICE_ASSERT(!deadline.Expired(),
                         "mori fifo: waited %llu ns for room for slot %llu (the proxy popped %llu of a %u-slot "
                         "ring): is the proxy running?",
                         static_cast<unsigned long long>(timeoutNs), static_cast<unsigned long long>(first),
                         static_cast<unsigned long long>(AtomicLoad<MemoryOrder::Relaxed, Scope::System>(tail)),
                         size);
      if (reader) {
        SpinPause();
      } else {
        FarWaiterPause();
      }
    }
  }

  // A producer far from the front has nothing to do until hundreds of slots are popped: it leaves the SM's
  // issue slots and the L2 line of tailSeen to the others for a while.
  MORI_DEVICE_INLINE static void FarWaiterPause() {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
    __nanosleep(256);
#else
    SpinPause();
#endif
  }

  // Whether the host has popped (finished handling) `slot`.
  MORI_DEVICE_INLINE bool Popped(uint64_t slot) const {
    return AtomicLoad<MemoryOrder::Acquire, Scope::System>(tail) > slot;
  }

  // Waits until the host has popped `slot`: for a flush request, until the flush is done.
  MORI_DEVICE_INLINE void Sync(uint64_t slot) const {
    SpinDeadline deadline(timeoutNs, stop);
    uint32_t polls = 0;
    while (!Popped(slot)) {
      // The failure flag is host memory too: reading it on every poll would put a second PCIe round trip
      // between two reads of the tail (measured: 1.3 us more per round trip on an H100).
      if (++polls % kFailureCheckEvery == 0) CheckProxy();
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
