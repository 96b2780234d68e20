// The transports under the SHMEM device API: argument checks, cooperative copies for Self/P2P, WQE
// posting, completion waits and fetch slots for RDMA, and requests to the host proxy for Proxy. Not part of
// the public contract; included by shmem_device_api.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mori/core/atomic.hpp"
#include "mori/core/copy.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/kernel.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/shmem/shmem_proxy_request.hpp"
#include "mori/shmem/shmem_state_access.hpp"

#if MORI_DEVICE_API_AVAILABLE

namespace mori::shmem::detail {

using core::MemoryOrder;
using core::Scope;
constexpr rdma::ProviderType kProvider = rdma::ProviderType::MLX5;

// A group of threads that performs one operation together: a thread, a warp, or a block.
enum class Group { Thread, Warp, Block };

template <Group G>
MORI_DEVICE_INLINE unsigned GroupRank() {
  if constexpr (G == Group::Thread) return 0;
  if constexpr (G == Group::Warp) return core::LaneId();
  return core::FlatThreadIdx();
}

template <Group G>
MORI_DEVICE_INLINE unsigned GroupSize() {
  if constexpr (G == Group::Thread) return 1;
  if constexpr (G == Group::Warp) return MORI_WARP_SIZE;
  return core::FlatBlockDim();
}

template <Group G>
MORI_DEVICE_INLINE void GroupSync() {
  if constexpr (G == Group::Warp) core::WarpSync();
  if constexpr (G == Group::Block) core::SyncThreads();
}

// The group barrier before a leader works for the group on a remote PE (a post, a push, a barrier), and the
// one after. Should a stop end the leader's wait, the leader leaves its kernel alone, so the barrier after
// counts who is left (a vote of the warp's lanes, a counting block barrier; a thread that left takes no part in
// either) and the rest of the group leaves with it, instead of going on as if the leader's work were done.
// GroupSyncPresent returns who was there before, for GroupSyncOrLeave. Where a stop never leaves a kernel (HIP)
// they are the plain barriers.
template <Group G>
MORI_DEVICE_INLINE uint64_t GroupSyncPresent() {
  if constexpr (core::kLeavesOnStop && G == Group::Warp) {
    core::WarpSync();
    return core::RunningLanes();
  } else if constexpr (core::kLeavesOnStop && G == Group::Block) {
    return core::SyncThreadsCounting();
  } else {
    GroupSync<G>();
    return 0;
  }
}

template <Group G>
MORI_DEVICE_INLINE void GroupSyncOrLeave([[maybe_unused]] uint64_t present) {
  if constexpr (core::kLeavesOnStop && G == Group::Warp) {
    if (core::RunningLanes() != present) core::LeaveKernelOnStop();
    core::WarpSync();  // every lane that was there still is
  } else if constexpr (core::kLeavesOnStop && G == Group::Block) {
    if (core::SyncThreadsCounting() != present) core::LeaveKernelOnStop();
  } else {
    GroupSync<G>();
  }
}

// The argument checks of every call (runtime initialised, PE in range, address range inside the heap,
// alignment of atomics) cost a few compares and one predicted branch each. MORI_SHMEM_DEVICE_CHECKS=0 before
// including the device API turns them off in that translation unit, for measuring what they cost and
// nothing else: the default, and every build mori ships, keeps them. Bounded waits stay bounded either way.
#ifndef MORI_SHMEM_DEVICE_CHECKS
#define MORI_SHMEM_DEVICE_CHECKS 1
#endif
constexpr bool kDeviceChecks = MORI_SHMEM_DEVICE_CHECKS != 0;

MORI_DEVICE_INLINE const ShmemDeviceState& Checked([[maybe_unused]] const char* op) {
  const ShmemDeviceState& s = State();
  if constexpr (kDeviceChecks) {
    MORI_DEVICE_ASSERT(s.magic == kShmemStateMagic,
                       "mori shmem: %s called before ShmemInit() or after ShmemFinalize()", op);
  }
  return s;
}

MORI_DEVICE_INLINE void CheckPe([[maybe_unused]] const ShmemDeviceState& s, [[maybe_unused]] const char* op,
                                [[maybe_unused]] int pe) {
  if constexpr (kDeviceChecks) {
    // One unsigned compare covers pe < 0 too.
    MORI_DEVICE_ASSERT(static_cast<uint32_t>(pe) < static_cast<uint32_t>(s.nPes),
                       "mori shmem: %s on PE %d: target pe %d is not in [0, %d)", op, s.rank, pe, s.nPes);
  }
}

// Traps, naming PE, peer and address, when [addr, addr + bytes) is not inside the user part of the symmetric
// heap (the report of TargetOffset's range test).
MORI_DEVICE_INLINE void CheckInHeap(const ShmemDeviceState& s, const char* op, int pe, const void* addr, size_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  bool inside = a >= s.heapBase + kShmemHeapUserOffset && bytes <= s.heapBytes && a - s.heapBase <= s.heapBytes - bytes;
  MORI_DEVICE_ASSERT(inside,
                     "mori shmem: %s on PE %d (target pe %d): %p + %llu bytes is not inside the symmetric heap "
                     "[%p, %p)",
                     op, s.rank, pe, addr, static_cast<unsigned long long>(bytes),
                     reinterpret_cast<void*>(s.heapBase + kShmemHeapUserOffset),
                     reinterpret_cast<void*>(s.heapBase + s.heapBytes));
}

// Reports why [addr, addr + bytes) at pe failed TargetOffset's test, in the order a reader needs: runtime
// not initialised, PE out of range, address range outside the heap. Out of line: the hot path only branches
// here.
[[noreturn]] MORI_DEVICE_NOINLINE void ReportBadTarget(const char* op, int pe, const void* addr, size_t bytes) {
  const ShmemDeviceState& s = Checked(op);
  CheckPe(s, op, pe);
  CheckInHeap(s, op, pe, addr, bytes);
  MORI_DEVICE_ASSERT(false, "mori shmem: %s on PE %d: target check of pe %d, %p + %llu bytes failed", op, s.rank, pe,
                     addr, static_cast<unsigned long long>(bytes));
}

// 1 when [off, off + bytes) is inside the user part of the heap (off measured from the heap base), else 0,
// without branches: the tests below combine such bits with `&` rather than `&&`, so the compiler evaluates
// all of them and branches once.
MORI_DEVICE_INLINE uint32_t InHeap(const ShmemDeviceState& s, uint64_t off, size_t bytes) {
  const uint64_t end = off + bytes;
  return static_cast<uint32_t>(off >= kShmemHeapUserOffset) & static_cast<uint32_t>(end <= s.heapBytes) &
         static_cast<uint32_t>(end >= off);
}

MORI_DEVICE_INLINE uint32_t PeInRange(const ShmemDeviceState& s, int pe) {
  return static_cast<uint32_t>(static_cast<uint32_t>(pe) < static_cast<uint32_t>(s.nPes));
}

// The checks every operation on a remote symmetric address makes (the runtime is initialised, pe in range,
// [addr, addr + bytes) inside the heap) as one predicted branch; returns the offset in the heap. A state that
// is not initialised (never, or finalised) has no PEs, so the PE test catches it.
MORI_DEVICE_INLINE uint64_t TargetOffset(const ShmemDeviceState& s, const char* op, int pe, const void* addr,
                                         size_t bytes) {
  const uint64_t off = reinterpret_cast<uintptr_t>(addr) - s.heapBase;
  if constexpr (kDeviceChecks) {
    if (MORI_UNLIKELY((PeInRange(s, pe) & InHeap(s, off, bytes)) == 0)) ReportBadTarget(op, pe, addr, bytes);
  } else {
    (void)op;
    (void)pe;
    (void)bytes;
  }
  return off;
}

// TargetOffset of a data range and a signal word at the same pe, still one branch.
MORI_DEVICE_INLINE uint64_t TargetOffsets(const ShmemDeviceState& s, const char* op, int pe, const void* addr,
                                          size_t bytes, const uint64_t* sig, uint64_t* sigOffset) {
  const uint64_t off = reinterpret_cast<uintptr_t>(addr) - s.heapBase;
  *sigOffset = reinterpret_cast<uintptr_t>(sig) - s.heapBase;
  if constexpr (kDeviceChecks) {
    if (MORI_UNLIKELY((PeInRange(s, pe) & InHeap(s, off, bytes) & InHeap(s, *sigOffset, sizeof(uint64_t))) == 0)) {
      if ((PeInRange(s, pe) & InHeap(s, off, bytes)) == 0) ReportBadTarget(op, pe, addr, bytes);
      ReportBadTarget(op, pe, sig, sizeof(uint64_t));
    }
  } else {
    (void)op;
    (void)pe;
    (void)bytes;
  }
  return off;
}

// The per-PE tables (transports, mapped bases) are written once at ShmemInit, before any kernel may use
// them, and freed at ShmemFinalize: read-only for every kernel in between.
MORI_DEVICE_INLINE TransportType TransportOf(const ShmemDeviceState& s, int pe) {
  return static_cast<TransportType>(core::LoadReadOnly(&s.transports[pe]));
}

// pe's heap mapped into this process when this thread reaches it by loads and stores (Self, P2P), else 0:
// the one load the P2P hot path makes to find its target.
MORI_DEVICE_INLINE uintptr_t MappedBase(const ShmemDeviceState& s, int pe) {
  const uint32_t i = static_cast<uint32_t>(pe - s.mappedFirst);
  if (MORI_LIKELY(i < s.mappedCount)) return s.mappedWindow[i];
  return core::LoadReadOnly(&s.peerBases[pe]);
}

// ---- Self / P2P: the group copies with its own loads and stores ----

template <Group G>
MORI_DEVICE_INLINE void GroupCopy(void* dst, const void* src, size_t bytes) {
  core::CopyCooperative(dst, src, bytes, GroupRank<G>(), GroupSize<G>());
}

// Stores of this thread become visible to every observer (the peer's GPU, its host, a NIC) before anything
// it does next.
MORI_DEVICE_INLINE void SystemFence() { core::AtomicFence<MemoryOrder::SeqCst, Scope::System>(); }

template <typename T>
MORI_DEVICE_INLINE T* PeerAddress(const ShmemDeviceState& s, int pe, uint64_t offset) {
  return reinterpret_cast<T*>(MappedBase(s, pe) + offset);
}

// Whether every atomic and signal is a load/store-path atomic on a mapped address: no PE is reached over
// RDMA (whose atomics would then have to go through the NIC too) and none through the proxy.
MORI_DEVICE_INLINE bool AtomicsByStores(const ShmemDeviceState& s) { return (s.nicAtomics | s.proxyAtomics) == 0; }

// ---- RDMA ----

// The QP this thread uses towards `pe`: fixed per warp, so a thread's operations to one PE stay in order.
MORI_DEVICE_INLINE ShmemQueuePair& QueueFor(const ShmemDeviceState& s, int pe) {
  uint32_t q = s.qpsPerPe > 1 ? (core::FlatBlockIdx() * core::FlatBlockDim() + core::FlatThreadIdx()) / MORI_WARP_SIZE %
                                    s.qpsPerPe
                              : 0;
  return s.queues[static_cast<uint32_t>(pe) * s.qpsPerPe + q];
}

// lkey of a local buffer: the heap's, a registered region's, or none (~0u).
MORI_DEVICE_INLINE uint32_t LocalKey(const ShmemDeviceState& s, const void* p, size_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a >= s.heapBase && bytes <= s.heapBytes && a - s.heapBase <= s.heapBytes - bytes) return s.heapLkey;
  for (uint32_t i = 0; i < kShmemMaxLocalRegions && s.localRegions[i].bytes != 0; ++i) {
    const ShmemLocalRegion& r = s.localRegions[i];
    if (a >= r.base && bytes <= r.bytes && a - r.base <= r.bytes - bytes) return r.lkey;
  }
  return ~0u;
}

MORI_DEVICE_INLINE void CheckCompletions(const ShmemDeviceState& s, ShmemQueuePair& qp, int pe) {
  uint32_t errors = core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&qp.cq.errorCount);
  uint32_t first = core::AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(&qp.cq.firstError);
  MORI_DEVICE_ASSERT(errors == 0,
                     "mori shmem: PE %d: %u RDMA operation(s) to pe %d failed (qp %u, first: syndrome 0x%x at wqe "
                     "%u); data at the target is not what was sent",
                     s.rank, errors, pe, qp.wq.qpn, first >> 16, first & 0xffffu);
}

// Waits until the WQE in `slot` (posted signaled) has completed.
MORI_DEVICE_INLINE void WaitSlot(const ShmemDeviceState& s, ShmemQueuePair& qp, int pe, uint32_t slot) {
  core::SpinDeadline deadline(s.timeoutNs, s.stopWord);
  while (static_cast<int32_t>(core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&qp.wq.doneIdx) - (slot + 1)) <
         0) {
    rdma::RetireCompletions<kProvider>(qp.cq, qp.wq);
    MORI_DEVICE_ASSERT(!deadline.Expired(),
                       "mori shmem: PE %d waited %llu ns for an RDMA completion from pe %d (qp %u, slot %u, %u done): "
                       "is pe %d alive?",
                       s.rank, static_cast<unsigned long long>(s.timeoutNs), pe, qp.wq.qpn, slot,
                       core::AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(&qp.wq.doneIdx), pe);
    core::SpinPause();
  }
  CheckCompletions(s, qp, pe);
}

// Completes every WQE posted to `qp` so far (nothing to do when none is outstanding).
MORI_DEVICE_INLINE void QuietQueuePair(const ShmemDeviceState& s, ShmemQueuePair& qp, int pe) {
  uint32_t posted = core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&qp.wq.postIdx);
  if (posted != core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&qp.wq.doneIdx)) {
    rdma::QuietQueue<kProvider>(qp.wq, qp.cq, s.timeoutNs);
  }
  CheckCompletions(s, qp, pe);
}

MORI_DEVICE_INLINE void QuietPe(const ShmemDeviceState& s, int pe) {
  if (s.queues == nullptr) return;
  for (uint32_t q = 0; q < s.qpsPerPe; ++q) {
    ShmemQueuePair& qp = s.queues[static_cast<uint32_t>(pe) * s.qpsPerPe + q];
    if (qp.wq.sqAddr != nullptr) QuietQueuePair(s, qp, pe);
  }
}

// Posts [laddr, laddr + bytes) <-> [raddr, ...) as WQEs of at most the NIC's message size; only the last
// one signaled when `signal`. Returns the last slot.
template <typename PostOne>
MORI_DEVICE_INLINE uint32_t PostInChunks(uintptr_t laddr, uintptr_t raddr, size_t bytes, bool signal, PostOne post) {
  uint32_t slot = 0;
  do {
    size_t chunk = bytes < rdma::mlx5::kMaxMessageBytes ? bytes : rdma::mlx5::kMaxMessageBytes;
    slot = post(laddr, raddr, chunk, signal && chunk == bytes);
    laddr += chunk;
    raddr += chunk;
    bytes -= chunk;
  } while (bytes > 0);
  return slot;
}

// RDMA write of [src, src + bytes) to `offset` in pe's heap. Sources the NIC cannot read (not in the heap,
// not registered) go inline when they fit one WQE.
MORI_DEVICE_INLINE uint32_t RdmaPut(const ShmemDeviceState& s, const char* op, int pe, uint64_t offset, const void* src,
                                    size_t bytes, bool signal) {
  ShmemQueuePair& qp = QueueFor(s, pe);
  uintptr_t raddr = s.remoteBases[pe] + offset;
  uint32_t lkey = LocalKey(s, src, bytes);
  if (lkey == ~0u) {
    MORI_DEVICE_ASSERT(bytes <= qp.wq.maxInlineData,
                       "mori shmem: %s on PE %d (to pe %d): source %p (%llu bytes) is neither in the symmetric heap "
                       "nor registered with ShmemBufferRegister, and too large to send inline (%u bytes)",
                       op, s.rank, pe, src, static_cast<unsigned long long>(bytes), qp.wq.maxInlineData);
    return rdma::PostWriteInlineOrdered<kProvider>(qp.wq, qp.cq, src, raddr, s.rkeys[pe], bytes, signal, s.timeoutNs);
  }
  uint32_t rkey = s.rkeys[pe];
  return PostInChunks(reinterpret_cast<uintptr_t>(src), raddr, bytes, signal,
                      [&](uintptr_t l, uintptr_t r, size_t n, bool sig) {
                        return rdma::PostWriteOrdered<kProvider>(qp.wq, qp.cq, l, lkey, r, rkey, n, sig, s.timeoutNs);
                      });
}

// A thread's non-blocking RDMA put, aggregated with the other lanes of its warp that post to the same QP in
// the same call: the group's lowest lane reserves the group's slots with one atomic, every lane writes its
// own WQE, and one doorbell announces them all (the NIC reads them in one pass). A put that needs more than
// one WQE posts alone.
MORI_DEVICE_INLINE void RdmaPutAggregated(const ShmemDeviceState& s, const char* op, int pe, uint64_t offset,
                                          const void* src, size_t bytes) {
  ShmemQueuePair& qp = QueueFor(s, pe);
  const uint32_t lkey = LocalKey(s, src, bytes);
  const bool inlined = lkey == ~0u;
  const bool oneWqe = inlined ? bytes <= qp.wq.maxInlineData : bytes <= rdma::mlx5::kMaxMessageBytes;
  const core::LaneMask active = core::ActiveLanes();
  // Every active lane takes part in the match; one that posts alone has a key no QP address can equal.
  const uint64_t key = oneWqe ? reinterpret_cast<uintptr_t>(&qp) : ~uint64_t(core::LaneId());
  const core::LaneMask group = core::MatchAny(active, key);
  if (!oneWqe) {
    RdmaPut(s, op, pe, offset, src, bytes, false);  // traps naming the source when it cannot go inline
    return;
  }
  // A queue too shallow for the whole group at once (MORI_SHMEM_QUEUE_DEPTH below about two warps' width) takes it
  // in turns of at most rdma::MaxSlotsAtOnce lanes, one turn after the other: each turn's WQEs are announced
  // before the next turn waits for room. Every lane of the group runs every turn, so lanes in lockstep (AMD) do
  // not wait for each other.
  const uint32_t perTurn = rdma::MaxSlotsAtOnce(qp.wq);
  const uint32_t rank = core::LaneCount(group & core::LanesBelow());
  const uint32_t turns = (core::LaneCount(group) + perTurn - 1) / perTurn;
  for (uint32_t turn = 0; turn < turns; ++turn) {
    const core::LaneMask part = turns == 1 ? group : core::Ballot(group, rank / perTurn == turn);
    if (rank / perTurn != turn) continue;
    const rdma::GroupSlots g = rdma::ReserveSendSlotsForGroup<kProvider>(qp.wq, qp.cq, part, s.timeoutNs);
    const uintptr_t raddr = s.remoteBases[pe] + offset;
    const bool signal = rdma::SignalNeeded(qp.wq, g.slot, false);
    const uint64_t dbr =
        inlined ? rdma::PostWriteInline<kProvider>(qp.wq, g.slot, signal, qp.wq.qpn, src, raddr, s.rkeys[pe], bytes)
                : rdma::PostWrite<kProvider>(qp.wq, g.slot, signal, qp.wq.qpn, reinterpret_cast<uintptr_t>(src), lkey,
                                             raddr, s.rkeys[pe], bytes);
    rdma::RingDoorbellForGroup<kProvider>(qp.wq, g, dbr, s.timeoutNs);
  }
}

// RDMA read of `bytes` from `offset` in pe's heap into local [dst, dst + bytes) (heap or registered).
MORI_DEVICE_INLINE uint32_t RdmaGet(const ShmemDeviceState& s, const char* op, int pe, void* dst, uint64_t offset,
                                    size_t bytes, bool signal) {
  ShmemQueuePair& qp = QueueFor(s, pe);
  uint32_t lkey = LocalKey(s, dst, bytes);
  MORI_DEVICE_ASSERT(lkey != ~0u,
                     "mori shmem: %s on PE %d (from pe %d): destination %p (%llu bytes) is neither in the symmetric "
                     "heap nor registered with ShmemBufferRegister, so the NIC cannot write it",
                     op, s.rank, pe, dst, static_cast<unsigned long long>(bytes));
  uint32_t rkey = s.rkeys[pe];
  return PostInChunks(reinterpret_cast<uintptr_t>(dst), s.remoteBases[pe] + offset, bytes, signal,
                      [&](uintptr_t l, uintptr_t r, size_t n, bool sig) {
                        return rdma::PostReadOrdered<kProvider>(qp.wq, qp.cq, l, lkey, r, rkey, n, sig, s.timeoutNs);
                      });
}

// A slot of the local fetch area, owned by one thread between Acquire and Release: tickets are dealt in
// order and a slot serves its next ticket only after the previous holder released it, so a result is never
// overwritten before it was read.
struct FetchSlot {
  uint32_t ticket;
  uint64_t* word;
};

MORI_DEVICE_INLINE FetchSlot AcquireFetchSlot(const ShmemDeviceState& s) {
  uint32_t ticket = core::AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(s.fetchTicket, 1u);
  uint32_t idx = ticket % kShmemFetchSlots;
  core::SpinDeadline deadline(s.timeoutNs, s.stopWord);
  while (core::AtomicLoad<MemoryOrder::Acquire, Scope::Device>(&s.fetchTurn[idx]) != ticket / kShmemFetchSlots) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "mori shmem: PE %d: fetch slot %u stayed busy for %llu ns", s.rank, idx,
                       static_cast<unsigned long long>(s.timeoutNs));
    core::SpinPause();
  }
  return FetchSlot{ticket, reinterpret_cast<uint64_t*>(s.heapBase + kShmemFetchSlotsOffset) + idx};
}

MORI_DEVICE_INLINE void ReleaseFetchSlot(const ShmemDeviceState& s, const FetchSlot& slot) {
  core::AtomicStore<MemoryOrder::Release, Scope::Device>(&s.fetchTurn[slot.ticket % kShmemFetchSlots],
                                                         slot.ticket / kShmemFetchSlots + 1);
}

// A 64-bit NIC atomic on `offset` in pe's heap. Fetching forms wait for the result; the others leave the old
// value in the discard word and complete at quiet.
MORI_DEVICE_INLINE uint64_t NicAtomic64(const ShmemDeviceState& s, int pe, uint64_t offset, rdma::AtomicOp op,
                                        uint64_t swapOrAdd, uint64_t compare, bool fetch) {
  ShmemQueuePair& qp = QueueFor(s, pe);
  uintptr_t raddr = s.remoteBases[pe] + offset;
  // PostAtomic takes (value, compare) for compare-swap and (addend, unused) for fetch-add.
  if (!fetch) {
    rdma::PostAtomicOrdered<kProvider, uint64_t>(qp.wq, qp.cq, s.heapBase + kShmemDiscardOffset, s.heapLkey, raddr,
                                                 s.rkeys[pe], swapOrAdd, compare, op, false, s.timeoutNs);
    return 0;
  }
  FetchSlot fs = AcquireFetchSlot(s);
  uint32_t slot = rdma::PostAtomicOrdered<kProvider, uint64_t>(qp.wq, qp.cq, reinterpret_cast<uintptr_t>(fs.word),
                                                               s.heapLkey, raddr, s.rkeys[pe], swapOrAdd, compare, op,
                                                               true, s.timeoutNs);
  WaitSlot(s, qp, pe, slot);
  uint64_t old = core::AtomicLoad<MemoryOrder::Relaxed, Scope::System>(fs.word);
  ReleaseFetchSlot(s, fs);
  return old;
}

// Reads `bytes` (<= 8) at `offset` in pe's heap with one RDMA read into a fetch slot.
MORI_DEVICE_INLINE uint64_t NicReadSmall(const ShmemDeviceState& s, int pe, uint64_t offset, size_t bytes) {
  ShmemQueuePair& qp = QueueFor(s, pe);
  FetchSlot fs = AcquireFetchSlot(s);
  uint32_t slot = rdma::PostReadOrdered<kProvider>(qp.wq, qp.cq, reinterpret_cast<uintptr_t>(fs.word), s.heapLkey,
                                                   s.remoteBases[pe] + offset, s.rkeys[pe], bytes, true, s.timeoutNs);
  WaitSlot(s, qp, pe, slot);
  uint64_t v = core::AtomicLoad<MemoryOrder::Relaxed, Scope::System>(fs.word);
  ReleaseFetchSlot(s, fs);
  return v;
}

// A read-modify-write of a 4- or 8-byte value through the NIC. 8-byte fetch-add and compare-swap are native;
// everything else is a compare-swap loop on the aligned 8-byte word that holds the value. `update` maps the
// old value to the new one and says whether to write at all.
// A contender that lost backs off before it retries, for a time that doubles with every loss (from 1 to
// 256 us, shifted per thread so that losers do not come back together): N contenders retrying at once make
// the NIC execute about N compare-swaps per success, and under enough load one thread lost for a minute
// (the atomic_counter example, 2048 threads drawing tickets from one 32-bit counter over the emulated NIC,
// beside other jobs on the same GPU).
template <typename T, typename Update>
MORI_DEVICE_INLINE T NicReadModifyWrite(const ShmemDeviceState& s, int pe, uint64_t offset, Update update) {
  uint64_t wordOffset = offset & ~uint64_t(7);
  unsigned shift = static_cast<unsigned>(offset - wordOffset) * 8;  // little-endian: the value's bit position
  uint64_t mask = sizeof(T) == 8 ? ~0ull : ((1ull << (8 * sizeof(T))) - 1) << shift;
  uint64_t word = NicAtomic64(s, pe, wordOffset, rdma::AtomicOp::FetchAdd, 0, 0, true);
  core::SpinDeadline deadline(s.timeoutNs, s.stopWord);
  constexpr uint64_t kMaxBackoffNs = 256000;
  uint64_t backoffNs = 1000;
  for (;;) {
    T old = static_cast<T>((word & mask) >> shift);
    T next = old;
    if (!update(old, &next)) return old;
    uint64_t desired = (word & ~mask) | ((static_cast<uint64_t>(next) << shift) & mask);
    uint64_t seen = NicAtomic64(s, pe, wordOffset, rdma::AtomicOp::CompareSwap, desired, word, true);
    if (seen == word) return old;
    word = seen;
    const uint64_t until = core::DeviceWallClockNs() + backoffNs + (core::GlobalThreadIdx() & 7) * (backoffNs >> 3);
    while (core::DeviceWallClockNs() < until) core::SpinPause();
    if (backoffNs < kMaxBackoffNs) backoffNs *= 2;
    MORI_DEVICE_ASSERT(!deadline.Expired(), "mori shmem: PE %d: atomic on pe %d at offset %llu kept losing for %llu ns",
                       s.rank, pe, static_cast<unsigned long long>(offset),
                       static_cast<unsigned long long>(s.timeoutNs));
  }
}

// ---- Proxy: requests a host thread executes over its connections ----

// Whether atomics, signals and quiet go through the proxy: once any PE uses the Proxy transport, every PE's
// atomics do (they are atomic only with respect to other atomics its connections perform), itself included
// (over a loopback connection).
MORI_DEVICE_INLINE bool ViaProxy(const ShmemDeviceState& s) { return s.proxyAtomics != 0; }

// Whether the proxy reaches local [p, p + bytes): the heap or a ShmemBufferRegister region.
MORI_DEVICE_INLINE bool ProxyReachable(const ShmemDeviceState& s, const void* p, size_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a >= s.heapBase && bytes <= s.heapBytes && a - s.heapBase <= s.heapBytes - bytes) return true;
  for (uint32_t i = 0; i < kShmemMaxLocalRegions && s.localRegions[i].bytes != 0; ++i) {
    const ShmemLocalRegion& r = s.localRegions[i];
    if (a >= r.base && bytes <= r.bytes && a - r.base <= r.bytes - bytes) return true;
  }
  return false;
}

// Requests that name data (puts, gets) are pushed after this thread's earlier writes (a release fence of the
// scope the data needs); self-contained ones (inline values, signals after their own fence, atomics, quiet)
// are not.
MORI_DEVICE_INLINE uint64_t ProxyPush(const ShmemDeviceState& s, const core::ProxyTrigger* items, uint32_t n,
                                      core::FifoOrder order = core::FifoOrder::AfterWrites) {
  core::FifoDeviceHandle fifo = s.proxyFifo;  // Push changes only what the handle points to
  return fifo.Push(items, n, order);
}

MORI_DEVICE_INLINE core::ProxyTrigger ProxyHead(ProxyOp op, uint32_t slots, int pe, uint64_t bytes, uint32_t sub = 0,
                                                uint32_t width = 0) {
  return EncodeProxyHeader(ProxyHeader{op, slots, sub, width, static_cast<uint32_t>(pe), bytes});
}

// What a push naming local [p, p + bytes) orders before it. The heap is GPU memory, which the proxy's copy
// engine or NIC reads (or writes, for a get) through this GPU: a device-scope release orders the writes
// before them (FifoOrder::AfterDeviceWrites). A ShmemBufferRegister region may be host memory and takes the
// system-scope one. Either release is cumulative: after a group barrier it covers the whole group's writes,
// so only the leader that pushes fences.
MORI_DEVICE_INLINE core::FifoOrder ProxyDataOrder(const ShmemDeviceState& s, const void* p, size_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  bool inHeap = bytes > 0 && a >= s.heapBase && bytes <= s.heapBytes && a - s.heapBase <= s.heapBytes - bytes;
  return inHeap ? core::FifoOrder::AfterDeviceWrites : core::FifoOrder::AfterWrites;
}

// A put (local -> offset at pe) or get (offset at pe -> local) the proxy performs. With `wait` it returns once
// the transfer is complete at its target; otherwise at quiet.
MORI_DEVICE_INLINE void ProxyTransfer(const ShmemDeviceState& s, const char* op, ProxyOp kind, int pe, uint64_t offset,
                                      const void* local, size_t bytes, bool wait) {
  MORI_DEVICE_ASSERT(ProxyReachable(s, local, bytes),
                     "mori shmem: %s on PE %d (pe %d): local %s %p (%llu bytes) is neither in the symmetric heap nor "
                     "registered with ShmemBufferRegister, so the proxy cannot reach it",
                     op, s.rank, pe, kind == ProxyOp::Put ? "source" : "destination", local,
                     static_cast<unsigned long long>(bytes));
  core::ProxyTrigger r[2] = {ProxyHead(kind, 2, pe, bytes, wait ? kProxyFlagFlush : 0),
                             ProxyPayload(reinterpret_cast<uintptr_t>(local), offset)};
  uint64_t slot = ProxyPush(s, r, 2, ProxyDataOrder(s, local, bytes));
  if (wait) s.proxyFifo.Sync(slot);
}

// Puts `bytes` (<= 16) from `value` inside the request itself.
MORI_DEVICE_INLINE void ProxyPutInline(const ShmemDeviceState& s, int pe, uint64_t offset, const void* value,
                                       size_t bytes) {
  uint64_t words[2] = {0, 0};
  memcpy(words, value, bytes);
  core::ProxyTrigger r[3] = {ProxyHead(ProxyOp::PutInline, 3, pe, bytes), ProxyPayload(words[0], offset),
                             ProxyPayload(words[1], 0)};
  ProxyPush(s, r, 3, core::FifoOrder::PayloadOnly);
}

MORI_DEVICE_INLINE void ProxySignal(const ShmemDeviceState& s, int pe, uint64_t offset, uint64_t value, SignalOp op) {
  core::ProxyTrigger r[2] = {ProxyHead(ProxyOp::Signal, 2, pe, 0, static_cast<uint32_t>(op)),
                             ProxyPayload(value, offset)};
  ProxyPush(s, r, 2, core::FifoOrder::PayloadOnly);  // SignalRemote fenced the data before
}

// Pushes a request whose result the proxy leaves in a result word, waits until it is handled and returns
// the result. `r[2].snd` is filled with the result index.
MORI_DEVICE_INLINE uint64_t ProxyFetch(const ShmemDeviceState& s, core::ProxyTrigger* r) {
  FetchSlot fs = AcquireFetchSlot(s);
  uint32_t idx = fs.ticket % kShmemFetchSlots;
  r[2].snd = idx;
  s.proxyFifo.Sync(ProxyPush(s, r, 3, core::FifoOrder::PayloadOnly));
  uint64_t v = core::AtomicLoad<MemoryOrder::Acquire, Scope::System>(&s.proxyResults[idx]);
  ReleaseFetchSlot(s, fs);
  return v;
}

MORI_DEVICE_INLINE uint64_t ProxyGetSmall(const ShmemDeviceState& s, int pe, uint64_t offset, size_t bytes) {
  core::ProxyTrigger r[3] = {ProxyHead(ProxyOp::GetInline, 3, pe, bytes), ProxyPayload(0, offset), ProxyPayload(0, 0)};
  return ProxyFetch(s, r);
}

// An atomic of `width` (4 or 8) bytes at `offset` on pe. Non-fetching ones return at once and complete at
// quiet.
MORI_DEVICE_INLINE uint64_t ProxyAtomic(const ShmemDeviceState& s, int pe, uint64_t offset, ProxyAmo amo,
                                        uint32_t width, uint64_t value, uint64_t compare, bool fetch) {
  core::ProxyTrigger r[3] = {ProxyHead(ProxyOp::Atomic, 3, pe, 0, static_cast<uint32_t>(amo), width),
                             ProxyPayload(value, offset), ProxyPayload(compare, kProxyNoResult)};
  if (!fetch) {
    ProxyPush(s, r, 3, core::FifoOrder::PayloadOnly);
    return 0;
  }
  return ProxyFetch(s, r);
}

// Quiet of every PE (pe < 0) or one: returns once the proxy has completed everything pushed before.
MORI_DEVICE_INLINE void ProxyQuiet(const ShmemDeviceState& s, int pe) {
  core::ProxyTrigger r = ProxyHead(ProxyOp::Quiet, 1, pe < 0 ? static_cast<int>(kProxyAllPes) : pe, 0);
  s.proxyFifo.Sync(ProxyPush(s, &r, 1, core::FifoOrder::PayloadOnly));
}

MORI_DEVICE_INLINE void ProxyFence(const ShmemDeviceState& s) {
  core::ProxyTrigger r = ProxyHead(ProxyOp::Fence, 1, static_cast<int>(kProxyAllPes), 0);
  ProxyPush(s, &r, 1, core::FifoOrder::PayloadOnly);
}

// Whether atomics and signals to `pe` go through the NIC (RDMA peers, and everyone once any PE is reached
// over RDMA: NIC atomics are atomic only with respect to other NIC atomics). The proxy, when in use, takes
// them all.
MORI_DEVICE_INLINE bool AtomicsViaNic(const ShmemDeviceState& s, int pe) {
  return !ViaProxy(s) && (s.nicAtomics != 0 || TransportOf(s, pe) == TransportType::RDMA);
}

template <typename T>
MORI_DEVICE_INLINE bool Compare(T a, CmpOp cmp, T b) {
  switch (cmp) {
    case CmpOp::EQ: return a == b;
    case CmpOp::NE: return a != b;
    case CmpOp::GT: return a > b;
    case CmpOp::GE: return a >= b;
    case CmpOp::LT: return a < b;
    case CmpOp::LE: return a <= b;
  }
  return false;
}

template <typename T>
inline constexpr bool kAtomicType =
    std::is_same_v<T, int32_t> || std::is_same_v<T, uint32_t> || std::is_same_v<T, int64_t> ||
    std::is_same_v<T, uint64_t> || std::is_same_v<T, long long> || std::is_same_v<T, unsigned long long>;

}  // namespace mori::shmem::detail

#endif  // MORI_DEVICE_API_AVAILABLE
