// RDMA device primitives: what a GPU thread (or, on HOST, a host thread) calls to build work-queue entries,
// announce them to the NIC and reap completions, templated on the NIC's provider (MLX5 today; the template
// leaves room for others). Two families:
//   - the short forms of API.md (PostWrite(wq, qpn, ...), UpdateSendDbrRecord, RingDoorbell, PollCq(cqAddr,
//     ...)): raw building blocks for one posting thread that keeps at most sqWqeNum WQEs outstanding;
//   - ordered forms (Post*Ordered, QuietQueue): any number of threads may post to one QP at once; each
//     reserves a slot, waits (bounded) while the send queue is full, retiring completions itself, and
//     doorbells are rung in slot order. One loop does the three steps (PostOrdered), so that they also
//     progress where the lanes of a warp run in lockstep (AMD wavefronts); the group forms
//     (ReserveSendSlotsForGroup) wait in one lane only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/atomic.hpp"
#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/warp.hpp"
#include "mori/rdma/queue_handles.hpp"

namespace mori::rdma {

enum class AtomicOp : uint32_t { FetchAdd = 0, CompareSwap = 1 };

// PollCq results: an opcode (>= 0), nothing yet, or an error completion carrying its syndrome.
constexpr int kCqEmpty = -1;
constexpr int kCqErrorBase = -0x100;
MORI_HOST_DEVICE_INLINE constexpr int CqErrorCode(uint8_t syndrome) { return kCqErrorBase - syndrome; }
MORI_HOST_DEVICE_INLINE constexpr bool IsCqError(int result) { return result <= kCqErrorBase; }
MORI_HOST_DEVICE_INLINE constexpr uint8_t CqErrorSyndrome(int result) {
  return static_cast<uint8_t>(kCqErrorBase - result);
}

// What a completion said beyond its opcode.
struct CqeInfo {
  uint32_t wqeCounter;  // 16-bit index of the completed WQE (send or receive queue)
  uint32_t byteCount;   // bytes received or read
  uint32_t qpn;
  bool isSend;          // a send-queue completion (else a receive)
};

#if MORI_DEVICE_API_AVAILABLE

// ---- Provider-specific primitives ----
// Each provider specialises ProviderOps<P> (mlx5/mlx5_primitives.hpp); the functions below forward to it.
template <ProviderType P>
struct ProviderOps;

// Short forms: reserve the next slot with an atomic add, build the WQE (signaled), return the doorbell value.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostWrite(WorkQueueHandle& wq, uint32_t qpn, uintptr_t laddr, uint32_t lkey,
                                           uintptr_t raddr, uint32_t rkey, size_t bytes) {
  return ProviderOps<P>::Write(wq, ProviderOps<P>::NextSlot(wq), true, qpn, laddr, lkey, raddr, rkey, bytes);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostRead(WorkQueueHandle& wq, uint32_t qpn, uintptr_t laddr, uint32_t lkey,
                                          uintptr_t raddr, uint32_t rkey, size_t bytes) {
  return ProviderOps<P>::Read(wq, ProviderOps<P>::NextSlot(wq), true, qpn, laddr, lkey, raddr, rkey, bytes);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostWriteInline(WorkQueueHandle& wq, uint32_t qpn, const void* val, uintptr_t raddr,
                                                 uint32_t rkey, size_t bytes) {
  return ProviderOps<P>::WriteInline(wq, ProviderOps<P>::NextSlot(wq), true, qpn, val, raddr, rkey, bytes);
}
// 8-byte atomics: val1 is the addend (FetchAdd) or the new value (CompareSwap), val2 the compare value.
template <ProviderType P, typename T>
MORI_HOST_DEVICE_INLINE uint64_t PostAtomic(WorkQueueHandle& wq, uint32_t qpn, uintptr_t laddr, uint32_t lkey,
                                            uintptr_t raddr, uint32_t rkey, T val1, T val2, AtomicOp op) {
  return ProviderOps<P>::template Atomic<T>(wq, ProviderOps<P>::NextSlot(wq), true, qpn, laddr, lkey, raddr, rkey, val1,
                                            val2, op);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostSend(WorkQueueHandle& wq, uint32_t qpn, uintptr_t laddr, uint32_t lkey,
                                          size_t bytes) {
  return ProviderOps<P>::Send(wq, ProviderOps<P>::NextSlot(wq), true, qpn, laddr, lkey, bytes);
}
// Posts a receive buffer and publishes it to the NIC (one thread at a time per QP).
template <ProviderType P>
MORI_HOST_DEVICE_INLINE void PostRecv(WorkQueueHandle& wq, uintptr_t laddr, uint32_t lkey, size_t bytes) {
  ProviderOps<P>::Recv(wq, laddr, lkey, bytes);
}

// Full forms: build the WQE in the given slot, signaled or not; return the doorbell value.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostWrite(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                           uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey, size_t bytes) {
  return ProviderOps<P>::Write(wq, slot, signal, qpn, laddr, lkey, raddr, rkey, bytes);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostRead(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn, uintptr_t laddr,
                                          uint32_t lkey, uintptr_t raddr, uint32_t rkey, size_t bytes) {
  return ProviderOps<P>::Read(wq, slot, signal, qpn, laddr, lkey, raddr, rkey, bytes);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostWriteInline(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                                 const void* val, uintptr_t raddr, uint32_t rkey, size_t bytes) {
  return ProviderOps<P>::WriteInline(wq, slot, signal, qpn, val, raddr, rkey, bytes);
}
template <ProviderType P, typename T>
MORI_HOST_DEVICE_INLINE uint64_t PostAtomic(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                            uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey, T val1,
                                            T val2, AtomicOp op) {
  return ProviderOps<P>::template Atomic<T>(wq, slot, signal, qpn, laddr, lkey, raddr, rkey, val1, val2, op);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostSend(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                          uintptr_t laddr, uint32_t lkey, size_t bytes) {
  return ProviderOps<P>::Send(wq, slot, signal, qpn, laddr, lkey, bytes);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint64_t PostNop(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn) {
  return ProviderOps<P>::Nop(wq, slot, signal, qpn);
}

template <ProviderType P>
MORI_HOST_DEVICE_INLINE void UpdateSendDbrRecord(void* dbrRecAddr, uint32_t wqeIdx) {
  ProviderOps<P>::UpdateSendDbrRecord(dbrRecAddr, wqeIdx);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE void RingDoorbell(void* dbrAddr, uint64_t dbrVal) {
  ProviderOps<P>::RingDoorbell(dbrAddr, dbrVal);
}
// kCqEmpty, the completion's opcode, or CqErrorCode(syndrome). Advances *consIdx past what it returns.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE int PollCq(void* cqAddr, uint32_t cqeNum, uint32_t* consIdx) {
  return ProviderOps<P>::PollCq(cqAddr, cqeNum, consIdx, nullptr);
}
template <ProviderType P>
MORI_HOST_DEVICE_INLINE void UpdateCqDbrRecord(void* dbrRecAddr, uint32_t consIdx) {
  ProviderOps<P>::UpdateCqDbrRecord(dbrRecAddr, consIdx);
}
namespace cq_detail {

// Consumes the entry at cq.consIdx (with the CQ's lock held) unless it is empty. With `sendOnly`, a receive
// completion is set aside in the CQ's stash for whoever polls for receives (left in place when the stash is
// full). Errors are counted before the slots they complete are published, so whoever sees a slot done also
// sees its error.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE int Consume(CompletionQueueHandle& cq, WorkQueueHandle& wq, CqeInfo* out, bool sendOnly) {
  using core::MemoryOrder;
  using core::Scope;
  int r = ProviderOps<P>::PeekCq(cq.cqAddr, cq.cqeNum, cq.consIdx, out);
  if (r == kCqEmpty) return kCqEmpty;
  bool stash = sendOnly && !out->isSend;
  if (stash && cq.stashTail - cq.stashHead >= CompletionQueueHandle::kStashSize) return kCqEmpty;
  cq.consIdx += 1;
  if (IsCqError(r) && core::AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(&cq.errorCount, 1u) == 0u) {
    core::AtomicStore<MemoryOrder::Relaxed, Scope::Device>(&cq.firstError,
                                                           (uint32_t(CqErrorSyndrome(r)) << 16) | (out->wqeCounter & 0xffff));
  }
  if (stash) {
    cq.stash[cq.stashTail % CompletionQueueHandle::kStashSize] =
        CqStashEntry{r, out->wqeCounter, out->byteCount, out->qpn};
    cq.stashTail += 1;
  }
  if (out->qpn != wq.qpn) return r;  // another QP's completion on a shared CQ: not this queue's progress
  if (out->isSend) {
    // RC completes in order: the slot named and all before it are done (16-bit counter, 32-bit slots). A
    // counter outside the window of outstanding slots is stale and moves nothing.
    uint32_t done = core::AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(&wq.doneIdx);
    uint32_t advance = ((out->wqeCounter - done) & 0xffffu) + 1;
    if (advance <= wq.sqWqeNum) core::AtomicStore<MemoryOrder::Release, Scope::Device>(&wq.doneIdx, done + advance);
  } else {
    core::AtomicFetchAdd<MemoryOrder::Release, Scope::Device>(&wq.rqDoneIdx, 1u);  // one CQE per receive WQE
  }
  return r;
}

MORI_HOST_DEVICE_INLINE bool TryLock(CompletionQueueHandle& cq) {
  return core::AtomicCompareExchange<core::MemoryOrder::Acquire, core::Scope::Device>(&cq.pollLock, 0u, 1u) == 0u;
}
MORI_HOST_DEVICE_INLINE void Unlock(CompletionQueueHandle& cq) {
  core::AtomicStore<core::MemoryOrder::Release, core::Scope::Device>(&cq.pollLock, 0u);
}

}  // namespace cq_detail

// Polls one completion of `cq` for the queue pair `wq`: first any receive completion set aside while send
// completions were retired, then the CQ itself. A send completion (success or error) marks every slot up to
// the one it names as done, a receive completion one receive slot; errors are counted in cq.errorCount (the
// first in cq.firstError); the CQ's doorbell record is updated. Returns kCqEmpty also while another thread
// holds the CQ. *info (if given) receives the rest of the completion.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE int PollCq(CompletionQueueHandle& cq, WorkQueueHandle& wq, CqeInfo* info = nullptr) {
  CqeInfo local{};
  CqeInfo* out = info != nullptr ? info : &local;
  if (!cq_detail::TryLock(cq)) return kCqEmpty;
  int r;
  if (cq.stashHead != cq.stashTail) {
    const CqStashEntry& e = cq.stash[cq.stashHead % CompletionQueueHandle::kStashSize];
    *out = CqeInfo{e.wqeCounter, e.byteCount, e.qpn, false};
    r = e.result;
    cq.stashHead += 1;
  } else {
    r = cq_detail::Consume<P>(cq, wq, out, false);
    if (r != kCqEmpty) UpdateCqDbrRecord<P>(cq.dbrRecAddr, cq.consIdx);
  }
  cq_detail::Unlock(cq);
  return r;
}

// ---- Ordered posting, built on the primitives above ----

// Retires the completions available now (if no other thread holds the CQ), advancing wq.doneIdx and
// counting errors. Receive completions are set aside for whoever polls for receives (retiring stops while
// that stash is full). Returns how many it retired.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t RetireCompletions(CompletionQueueHandle& cq, WorkQueueHandle& wq) {
  if (!cq_detail::TryLock(cq)) return 0;
  uint32_t retired = 0;
  CqeInfo info{};
  while (cq_detail::Consume<P>(cq, wq, &info, true) != kCqEmpty) ++retired;
  if (retired > 0) UpdateCqDbrRecord<P>(cq.dbrRecAddr, cq.consIdx);
  cq_detail::Unlock(cq);
  return retired;
}

// An unsignaled WQE completes only through a later signaled one; so that a full queue can always drain,
// ordered posting signals the last slot of every half-queue whatever the caller asked.
MORI_HOST_DEVICE_INLINE uint32_t HalfQueue(const WorkQueueHandle& wq) { return wq.sqWqeNum > 1 ? wq.sqWqeNum / 2 : 1; }
MORI_HOST_DEVICE_INLINE bool SignalNeeded(const WorkQueueHandle& wq, uint32_t slot, bool signal) {
  const uint32_t half = HalfQueue(wq);
  return signal || (slot & (half - 1)) == half - 1;
}

// The most slots one reservation may take at once. The room for slots [first, first + n) comes only from
// completions of slots before `first`, and those are known only up to the last signaled one, which can lie up to
// half a queue - 1 before `first` (the slots after it complete through a signaled slot of the reservation
// itself). So n <= depth - (half - 1) always finds room; a larger reservation could wait for itself.
MORI_HOST_DEVICE_INLINE uint32_t MaxSlotsAtOnce(const WorkQueueHandle& wq) { return wq.sqWqeNum - HalfQueue(wq) + 1; }

MORI_HOST_DEVICE_INLINE void CheckReservation(const WorkQueueHandle& wq, uint32_t n, const char* who) {
  MORI_DEVICE_ASSERT(n <= MaxSlotsAtOnce(wq),
                     "qp %u (to rank %d): %s reserves %u send slots at once, more than a queue of depth %u can "
                     "always make room for (%u): post in turns of at most %u",
                     wq.qpn, PeerRank(wq), who, n, wq.sqWqeNum, MaxSlotsAtOnce(wq), MaxSlotsAtOnce(wq));
}

namespace ordered_detail {

// Whether the send queue has room for slots [slot, slot + n).
MORI_HOST_DEVICE_INLINE bool HasRoom(const WorkQueueHandle& wq, uint32_t slot, uint32_t n) {
  return slot + n - core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::Device>(&wq.doneIdx) <= wq.sqWqeNum;
}

// The traps of the ordered waits, naming the QP, the rank at its other end and the indices (`expired`: the wait's
// deadline passed).
MORI_HOST_DEVICE_INLINE void CheckRoomWait(bool expired, const WorkQueueHandle& wq, uint32_t slot, uint64_t timeoutNs) {
  MORI_DEVICE_ASSERT(!expired,
                     "qp %u (to rank %d): no room in the send queue for %llu ns (slot %u, %u completed, depth %u): "
                     "completions stopped coming (rank %d gone? link down?)",
                     wq.qpn, PeerRank(wq), static_cast<unsigned long long>(timeoutNs), slot,
                     core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::Device>(&wq.doneIdx), wq.sqWqeNum,
                     PeerRank(wq));
}
MORI_HOST_DEVICE_INLINE void CheckOrderWait(bool expired, const WorkQueueHandle& wq, uint32_t slot,
                                            uint64_t timeoutNs) {
  MORI_DEVICE_ASSERT(!expired, "qp %u (to rank %d): slot %u waited %llu ns for earlier slots' doorbells (at %u)",
                     wq.qpn, PeerRank(wq), slot, static_cast<unsigned long long>(timeoutNs),
                     core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::Device>(&wq.dbTouchIdx));
}

// Announces slots [slot, slot + n), whose turn it is (every earlier slot is announced).
template <ProviderType P>
MORI_HOST_DEVICE_INLINE void Announce(WorkQueueHandle& wq, uint32_t slot, uint32_t n, uint64_t dbrVal) {
  UpdateSendDbrRecord<P>(wq.dbrRecAddr, slot + n);
  RingDoorbell<P>(wq.dbrAddr, dbrVal);
  core::AtomicStore<core::MemoryOrder::Release, core::Scope::Device>(&wq.dbTouchIdx, slot + n);
}

}  // namespace ordered_detail

// Waits while the send queue has no room for slots [slot, slot + n), retiring completions. Traps, naming the QP
// and the indices, when `timeoutNs` passes first. Returns false only when a stop ended the wait (OnStop::Report).
template <ProviderType P>
MORI_HOST_DEVICE_INLINE bool WaitForSendRoom(WorkQueueHandle& wq, CompletionQueueHandle& cq, uint32_t slot, uint32_t n,
                                             uint64_t timeoutNs, core::OnStop onStop) {
  core::SpinDeadline deadline(timeoutNs, wq.stop, onStop);
  while (!ordered_detail::HasRoom(wq, slot, n)) {
    RetireCompletions<P>(cq, wq);
    ordered_detail::CheckRoomWait(deadline.Expired(), wq, slot, timeoutNs);
    if (deadline.Stopped()) return false;
    core::SpinPause();
  }
  return true;
}

// Reserves `n` consecutive slots, waiting while the send queue has no room for them (WaitForSendRoom).
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t ReserveSendSlots(WorkQueueHandle& wq, CompletionQueueHandle& cq, uint32_t n,
                                                  uint64_t timeoutNs) {
  CheckReservation(wq, n, "a thread");
  uint32_t slot = core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&wq.postIdx, n);
  WaitForSendRoom<P>(wq, cq, slot, n, timeoutNs, core::OnStop::Leave);
  return slot;
}

// Announces slots [slot, slot + n) once every earlier slot has been announced, so the NIC never sees an
// index whose WQE is not written yet.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE void RingDoorbellOrdered(WorkQueueHandle& wq, uint32_t slot, uint32_t n, uint64_t dbrVal,
                                                 uint64_t timeoutNs) {
  core::SpinDeadline deadline(timeoutNs, wq.stop);
  while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::Device>(&wq.dbTouchIdx) != slot) {
    ordered_detail::CheckOrderWait(deadline.Expired(), wq, slot, timeoutNs);
    core::SpinPause();
  }
  ordered_detail::Announce<P>(wq, slot, n, dbrVal);
}

// One WQE posted in slot order: reserves a slot, waits for room, has `write(slot)` build the WQE (it returns
// the doorbell value) and announces it once every earlier slot is announced. The three steps share one loop,
// and a thread that can take its next step takes it inside the loop: where the lanes of a warp run in lockstep
// (AMD wavefronts), a lane that leaves a wait is held at the loop's end until the other lanes leave it too, so
// a lane with room that waited there would never announce the slot that a later lane of its own warp waits
// for (slot order), nor complete the WQE whose completion makes room for it. Traps as WaitForSendRoom and
// RingDoorbellOrdered do.
template <ProviderType P, typename Write>
MORI_HOST_DEVICE_INLINE uint32_t PostOrdered(WorkQueueHandle& wq, CompletionQueueHandle& cq, uint64_t timeoutNs,
                                             Write write) {
  const uint32_t slot = core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&wq.postIdx, 1u);
  core::SpinDeadline deadline(timeoutNs, wq.stop);
  bool written = false;
  uint64_t dbrVal = 0;
  for (;;) {
    if (!written && ordered_detail::HasRoom(wq, slot, 1)) {
      dbrVal = write(slot);
      written = true;
    }
    if (written && core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::Device>(&wq.dbTouchIdx) == slot) {
      ordered_detail::Announce<P>(wq, slot, 1, dbrVal);
      return slot;
    }
    if (!written) RetireCompletions<P>(cq, wq);
    const bool expired = deadline.Expired();
    if (written) {
      ordered_detail::CheckOrderWait(expired, wq, slot, timeoutNs);
    } else {
      ordered_detail::CheckRoomWait(expired, wq, slot, timeoutNs);
    }
    core::SpinPause();
  }
}

template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t PostWriteOrdered(WorkQueueHandle& wq, CompletionQueueHandle& cq, uintptr_t laddr,
                                                  uint32_t lkey, uintptr_t raddr, uint32_t rkey, size_t bytes,
                                                  bool signal, uint64_t timeoutNs) {
  return PostOrdered<P>(wq, cq, timeoutNs, [&](uint32_t slot) {
    return PostWrite<P>(wq, slot, SignalNeeded(wq, slot, signal), wq.qpn, laddr, lkey, raddr, rkey, bytes);
  });
}

template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t PostReadOrdered(WorkQueueHandle& wq, CompletionQueueHandle& cq, uintptr_t laddr,
                                                 uint32_t lkey, uintptr_t raddr, uint32_t rkey, size_t bytes,
                                                 bool signal, uint64_t timeoutNs) {
  return PostOrdered<P>(wq, cq, timeoutNs, [&](uint32_t slot) {
    return PostRead<P>(wq, slot, SignalNeeded(wq, slot, signal), wq.qpn, laddr, lkey, raddr, rkey, bytes);
  });
}

template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t PostWriteInlineOrdered(WorkQueueHandle& wq, CompletionQueueHandle& cq, const void* val,
                                                        uintptr_t raddr, uint32_t rkey, size_t bytes, bool signal,
                                                        uint64_t timeoutNs) {
  return PostOrdered<P>(wq, cq, timeoutNs, [&](uint32_t slot) {
    return PostWriteInline<P>(wq, slot, SignalNeeded(wq, slot, signal), wq.qpn, val, raddr, rkey, bytes);
  });
}

template <ProviderType P, typename T>
MORI_HOST_DEVICE_INLINE uint32_t PostAtomicOrdered(WorkQueueHandle& wq, CompletionQueueHandle& cq, uintptr_t laddr,
                                                   uint32_t lkey, uintptr_t raddr, uint32_t rkey, T val1, T val2,
                                                   AtomicOp op, bool signal, uint64_t timeoutNs) {
  return PostOrdered<P>(wq, cq, timeoutNs, [&](uint32_t slot) {
    return PostAtomic<P, T>(wq, slot, SignalNeeded(wq, slot, signal), wq.qpn, laddr, lkey, raddr, rkey, val1, val2, op);
  });
}

template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t PostSendOrdered(WorkQueueHandle& wq, CompletionQueueHandle& cq, uintptr_t laddr,
                                                 uint32_t lkey, size_t bytes, bool signal, uint64_t timeoutNs) {
  return PostOrdered<P>(wq, cq, timeoutNs, [&](uint32_t slot) {
    return PostSend<P>(wq, slot, SignalNeeded(wq, slot, signal), wq.qpn, laddr, lkey, bytes);
  });
}

// ---- Warp-aggregated posting ----

// Slots of a group of lanes of one warp that each post one WQE to the same queue at the same time.
struct GroupSlots {
  core::LaneMask group;  // the lanes posting together
  uint32_t first;        // the group's first slot
  uint32_t count;        // one per lane
  uint32_t slot;         // the calling lane's
};

// Every lane of `group` calls this: the group's lowest lane reserves `count` slots with one atomic (waiting
// for room as ReserveSendSlots does) and each lane gets its own, in lane order. A stop that ends the leader's
// wait ends the whole group's kernel here, before any lane writes a slot.
template <ProviderType P>
MORI_DEVICE_INLINE GroupSlots ReserveSendSlotsForGroup(WorkQueueHandle& wq, CompletionQueueHandle& cq,
                                                       core::LaneMask group, uint64_t timeoutNs) {
  const unsigned leader = core::LowestLane(group);
  GroupSlots g{group, 0, core::LaneCount(group), 0};
  CheckReservation(wq, g.count, "a group of lanes");  // the group's slots are reserved together
  uint32_t room = 1;
  if (core::LaneId() == leader) {
    g.first = core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&wq.postIdx, g.count);
    room = WaitForSendRoom<P>(wq, cq, g.first, g.count, timeoutNs, core::OnStop::Report) ? 1u : 0u;
  }
  if constexpr (core::kLeavesOnStop) {
    if (core::ShuffleFrom(group, room, leader) == 0) core::LeaveKernelOnStop();
  }
  g.first = core::ShuffleFrom(group, g.first, leader);
  g.slot = g.first + core::LaneCount(group & core::LanesBelow());
  return g;
}

// Every lane of the group calls this after writing its WQE (`dbrVal` is what the post returned): one
// doorbell, rung by the lowest lane with the last WQE's control word, announces the group's slots.
template <ProviderType P>
MORI_DEVICE_INLINE void RingDoorbellForGroup(WorkQueueHandle& wq, const GroupSlots& g, uint64_t dbrVal,
                                             uint64_t timeoutNs) {
  const uint64_t last = core::ShuffleFrom(g.group, dbrVal, core::HighestLane(g.group));
  // Each lane's WQE is written before the lane that announces it goes on.
  core::AtomicFence<core::MemoryOrder::Release, core::Scope::System>();
  core::SyncLanes(g.group);
  if (core::LaneId() == core::LowestLane(g.group)) RingDoorbellOrdered<P>(wq, g.first, g.count, last, timeoutNs);
}

// Waits until every WQE posted to `wq` before the call has completed (a signaled NOP covers unsignaled
// ones). Returns the number of error completions seen so far on `cq`.
template <ProviderType P>
MORI_HOST_DEVICE_INLINE uint32_t QuietQueue(WorkQueueHandle& wq, CompletionQueueHandle& cq, uint64_t timeoutNs) {
  using core::MemoryOrder;
  using core::Scope;
  const uint32_t slot = PostOrdered<P>(wq, cq, timeoutNs, [&](uint32_t s) { return PostNop<P>(wq, s, true, wq.qpn); });
  core::SpinDeadline deadline(timeoutNs, wq.stop);
  while (static_cast<int32_t>(core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&wq.doneIdx) - (slot + 1)) < 0) {
    RetireCompletions<P>(cq, wq);
    MORI_DEVICE_ASSERT(!deadline.Expired(),
                       "qp %u (to rank %d): quiet waited %llu ns for slot %u (%u completed): is rank %d alive?", wq.qpn,
                       PeerRank(wq), static_cast<unsigned long long>(timeoutNs), slot,
                       core::AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(&wq.doneIdx), PeerRank(wq));
    core::SpinPause();
  }
  return core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&cq.errorCount);
}

#endif  // MORI_DEVICE_API_AVAILABLE

}  // namespace mori::rdma

#include "mori/rdma/mlx5/mlx5_primitives.hpp"
