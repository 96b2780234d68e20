// The SHMEM device API: puts, gets, put-with-signal, waits, atomics, quiet, fence and barrier, callable from
// CUDA/HIP kernels and (HOST backend) from host threads. Destinations on the remote side are symmetric
// addresses (from ShmemMalloc); OpenSHMEM 1.5 semantics on every transport. Thread functions are called by
// one thread; Warp functions by every lane of a warp with the same arguments; Block functions by every
// thread of a block with the same arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mori/shmem/shmem_device_detail.hpp"

#if MORI_DEVICE_API_AVAILABLE

namespace mori::shmem {
namespace detail {

// The out-of-line parts of the transfers, which bandwidth loops call on every iteration, are called through
// their address passed through an empty asm statement that the compiler cannot see through. Called directly,
// ptxas fits the caller's registers around what the callee clobbers, so the spills of the inline P2P path
// depended on the RDMA posting code: 4a05ef8 changed only that code and moved spills into the put loop of a
// 1,024-thread kernel (put_bw block 14-24% slower from 1 KiB to 2 MiB on an H200). Called through the address,
// the loop kept its registers again (docs/PERF.md, 2026-11-29, night). It costs device code: compiled without
// -rdc, a kernel's code holds every function it may call, and for a call through an address ptxas cannot tell
// which, so every kernel that transfers carries every TransferRemote whose address the translation unit takes
// (85 KB for the thread put's). Quiet, called once after a loop, went back to a direct call (no slower on an
// H200, docs/PERF.md, 2026-11-30): kernels that only quiet or synchronise carry no transfer code. The other
// out-of-line parts (signals, atomics, single values) are called directly too, and scripts/check_spills.py
// holds the put loops' spills to what they were when measured fast. HIP and HOST call directly (HIP at -O0
// would keep the call indirect).
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
template <typename F>
MORI_DEVICE_INLINE F OutOfLine(F f) {
  asm volatile("" : "+l"(f));
  return f;
}
#define MORI_SHMEM_OUT_OF_LINE(...) (::mori::shmem::detail::OutOfLine(&__VA_ARGS__))
#else
#define MORI_SHMEM_OUT_OF_LINE(...) __VA_ARGS__
#endif

// Each call below has two parts: an inline hot path for PEs reached by loads and stores (Self, P2P: the
// checks, one cached load of the mapped base, the copy, the signal) and an out-of-line part for the RDMA
// and Proxy transports. A kernel that only talks over P2P thus carries neither their code nor their register
// pressure in its loops; one that uses them pays a call per operation, small beside posting a WQE or a
// request (the transfers: MORI_SHMEM_OUT_OF_LINE above; see there for the others).

// Set or add `value` at `offset` in pe's heap, ordered after this thread's earlier puts to pe (and, after a
// group barrier, after the group's: a system-scope release is cumulative).
MORI_DEVICE_NOINLINE void SignalRemote(int pe, uint64_t offset, uint64_t value, SignalOp op) {
  const ShmemDeviceState& s = State();
  // Data this thread's group stored into a mapped peer is visible before the NIC or the proxy can write the
  // signal (a doorbell or a FIFO entry is not ordered with those stores by itself).
  SystemFence();
  if (ViaProxy(s)) {
    // Data sent through this PE's own QPs is not ordered with the proxy's connection: complete it first.
    if (TransportOf(s, pe) == TransportType::RDMA) QuietPe(s, pe);
    ProxySignal(s, pe, offset, value, op);
    return;
  }
  // Not through the proxy and not by stores (SignalAt): some PE is reached over RDMA, so every signal goes
  // through the NIC (AtomicsViaNic).
  if (op == SignalOp::Set) {
    RdmaPut(s, "signal", pe, offset, &value, sizeof(value), false);
  } else {
    NicAtomic64(s, pe, offset, rdma::AtomicOp::FetchAdd, value, 0, false);
  }
}

MORI_DEVICE_INLINE void SignalAt(const ShmemDeviceState& s, int pe, uint64_t offset, uint64_t value, SignalOp op) {
  if (MORI_LIKELY(AtomicsByStores(s))) {
    uint64_t* sig = PeerAddress<uint64_t>(s, pe, offset);
    if (op == SignalOp::Set) {
      core::AtomicStore<MemoryOrder::Release, Scope::System>(sig, value);
    } else {
      core::AtomicFetchAdd<MemoryOrder::Release, Scope::System>(sig, value);
    }
    return;
  }
  SignalRemote(pe, offset, value, op);
}

enum class Direction { Put, Get };

// The RDMA and Proxy part of Transfer.
template <Group G, Direction D>
MORI_DEVICE_NOINLINE void TransferRemote(const char* op, void* dst, const void* src, size_t bytes, int pe,
                                         uint64_t offset, bool wait) {
  const ShmemDeviceState& s = State();
  if (TransportOf(s, pe) == TransportType::RDMA) {
    if constexpr (G == Group::Thread && D == Direction::Put) {
      if (!wait) {
        RdmaPutAggregated(s, op, pe, offset, src, bytes);
        return;
      }
    }
    // The whole group's source data is written before the NIC is told to read it.
    const uint64_t present = GroupSyncPresent<G>();
    if (GroupRank<G>() == 0) {
      uint32_t slot = D == Direction::Put ? RdmaPut(s, op, pe, offset, src, bytes, wait)
                                          : RdmaGet(s, op, pe, dst, offset, bytes, wait);
      if (wait) WaitSlot(s, QueueFor(s, pe), pe, slot);
    }
    GroupSyncOrLeave<G>(present);
    return;
  }
  // Proxy: every thread's part of the source is written before the proxy reads it (the barrier, then the
  // leader's release in its push).
  const uint64_t present = GroupSyncPresent<G>();
  if (GroupRank<G>() == 0) {
    ProxyTransfer(s, op, D == Direction::Put ? ProxyOp::Put : ProxyOp::Get, pe, offset,
                  D == Direction::Put ? src : static_cast<const void*>(dst), bytes, wait);
  }
  GroupSyncOrLeave<G>(present);
}

// Copies [src, src + bytes) to dst, where dst (Put) or src (Get) is a symmetric address on pe and the other
// one local. With `wait` it returns once the transfer is complete (blocking forms); otherwise at quiet. A
// warp or block starts with a group barrier, so data any of its threads wrote before the call is what travels
// (a put) and what it read before is not overwritten early (a get).
template <Group G, Direction D>
MORI_DEVICE_INLINE void Transfer(const char* op, void* dst, const void* src, size_t bytes, int pe, bool wait) {
  const ShmemDeviceState& s = State();
  uint64_t offset = TargetOffset(s, op, pe, D == Direction::Put ? static_cast<const void*>(dst) : src, bytes);
  if (bytes == 0) return;
  const uintptr_t mapped = MappedBase(s, pe);
  if (MORI_LIKELY(mapped != 0)) {
    GroupSync<G>();
    if constexpr (D == Direction::Put) {
      GroupCopy<G>(reinterpret_cast<void*>(mapped + offset), src, bytes);
      if (wait) GroupSync<G>();  // blocking: the group's whole source has been read when any thread returns
    } else {
      GroupCopy<G>(dst, reinterpret_cast<const void*>(mapped + offset), bytes);
      GroupSync<G>();  // the whole group's part has landed when any thread returns
    }
    return;
  }
  MORI_SHMEM_OUT_OF_LINE(TransferRemote<G, D>)(op, dst, src, bytes, pe, offset, wait);
}

// The RDMA and Proxy part of PutSignalNbi.
template <Group G>
MORI_DEVICE_NOINLINE void PutSignalRemote(const char* op, const void* source, size_t bytes, uint64_t offset,
                                          uint64_t sigOffset, uint64_t sigVal, SignalOp sigOp, int pe) {
  const ShmemDeviceState& s = State();
  if (TransportOf(s, pe) == TransportType::RDMA) {
    const uint64_t present = GroupSyncPresent<G>();
    if (GroupRank<G>() == 0) {
      // Same QP for data and signal: RC executes them in order, so the signal cannot pass the data.
      if (bytes > 0) RdmaPut(s, op, pe, offset, source, bytes, false);
      SignalAt(s, pe, sigOffset, sigVal, sigOp);
    }
    GroupSyncOrLeave<G>(present);
    return;
  }
  // The group's source is written before the leader's push (whose release is cumulative).
  const uint64_t present = GroupSyncPresent<G>();
  if (GroupRank<G>() == 0) {
    // One request: the proxy issues the signal after the data on the same connection, which orders it.
    if (bytes > 0) {
      MORI_DEVICE_ASSERT(ProxyReachable(s, source, bytes),
                         "mori shmem: %s on PE %d (pe %d): source %p (%llu bytes) is neither in the symmetric "
                         "heap nor registered with ShmemBufferRegister, so the proxy cannot read it",
                         op, s.rank, pe, source, static_cast<unsigned long long>(bytes));
    }
    core::ProxyTrigger r[3] = {ProxyHead(ProxyOp::PutSignal, 3, pe, bytes, static_cast<uint32_t>(sigOp)),
                               ProxyPayload(reinterpret_cast<uintptr_t>(source), offset),
                               ProxyPayload(sigVal, sigOffset)};
    // With no data the signal still follows everything this group wrote before: the system-scope release.
    ProxyPush(s, r, 3, ProxyDataOrder(s, source, bytes));
  }
  GroupSyncOrLeave<G>(present);
}

template <Group G>
MORI_DEVICE_INLINE void PutSignalNbi(const char* op, void* dest, const void* source, size_t bytes, uint64_t* sigAddr,
                                     uint64_t sigVal, SignalOp sigOp, int pe) {
  const ShmemDeviceState& s = State();
  uint64_t sigOffset = 0;
  uint64_t offset = TargetOffsets(s, op, pe, dest, bytes, sigAddr, &sigOffset);
  const uintptr_t mapped = MappedBase(s, pe);
  if (MORI_LIKELY(mapped != 0)) {
    GroupSync<G>();  // the group's source is written before any thread reads it
    GroupCopy<G>(reinterpret_cast<void*>(mapped + offset), source, bytes);
    // Every thread's part is stored before the leader signals: the barrier orders them before the leader's
    // system-scope release (cumulative), so one fence in one thread covers the whole group. A single thread
    // needs no barrier: the release orders its own stores.
    GroupSync<G>();
    if (GroupRank<G>() == 0) SignalAt(s, pe, sigOffset, sigVal, sigOp);
    return;
  }
  PutSignalRemote<G>(op, source, bytes, offset, sigOffset, sigVal, sigOp, pe);
}

template <typename T>
MORI_DEVICE_INLINE void CheckAtomicTarget([[maybe_unused]] const ShmemDeviceState& s, [[maybe_unused]] const char* op,
                                          [[maybe_unused]] int pe, [[maybe_unused]] const T* dest) {
  if constexpr (kDeviceChecks) {
    MORI_DEVICE_ASSERT(reinterpret_cast<uintptr_t>(dest) % sizeof(T) == 0,
                       "mori shmem: %s on PE %d (target pe %d): %p is not aligned to %u bytes", op, s.rank, pe,
                       static_cast<const void*>(dest), static_cast<unsigned>(sizeof(T)));
  }
}

// An 8-byte operation the NIC performs itself (fetch-add, compare-swap), used instead of the compare-swap
// loop when the atomic goes through the NIC.
struct NicNative {
  bool use;
  rdma::AtomicOp op;
  uint64_t swapOrAdd;
  uint64_t compare;
  bool fetch;  // false: the old value is not wanted (the operation completes at quiet)
};
constexpr NicNative kNoNicNative{false, rdma::AtomicOp::FetchAdd, 0, 0, true};

// One atomic: `local` runs on the mapped address when the PE is reached by loads and stores; through the NIC
// an 8-byte `native` operation when given, else `update` (old -> new, false: leave it) in a compare-swap loop.
// How the proxy performs an atomic: the operation, its operands, and whether the caller waits for the old
// value.
struct ProxyAmoArgs {
  ProxyAmo amo;
  uint64_t value;
  uint64_t compare;
  bool fetch;
};

// The NIC and Proxy part of AtomicOpImpl (once any PE is reached over RDMA or the proxy, every atomic goes
// that way: see AtomicsViaNic).
template <typename T, typename Update>
MORI_DEVICE_NOINLINE T AtomicRemote(int pe, uint64_t offset, ProxyAmoArgs viaProxy, Update update, NicNative native) {
  const ShmemDeviceState& s = State();
  if (ViaProxy(s)) {
    return static_cast<T>(
        ProxyAtomic(s, pe, offset, viaProxy.amo, sizeof(T), viaProxy.value, viaProxy.compare, viaProxy.fetch));
  }
  if (sizeof(T) == 8 && native.use) {
    return static_cast<T>(NicAtomic64(s, pe, offset, native.op, native.swapOrAdd, native.compare, native.fetch));
  }
  return NicReadModifyWrite<T>(s, pe, offset, update);
}

template <typename T, typename Local, typename Update>
MORI_DEVICE_INLINE T AtomicOpImpl(const char* op, T* dest, int pe, ProxyAmoArgs viaProxy, Local local, Update update,
                                  NicNative native = kNoNicNative) {
  static_assert(kAtomicType<T>, "SHMEM atomics take int32_t, uint32_t, int64_t or uint64_t");
  const ShmemDeviceState& s = State();
  uint64_t offset = TargetOffset(s, op, pe, dest, sizeof(T));
  CheckAtomicTarget(s, op, pe, dest);
  if (MORI_LIKELY(AtomicsByStores(s))) return local(PeerAddress<T>(s, pe, offset));
  return AtomicRemote<T>(pe, offset, viaProxy, update, native);
}

}  // namespace detail

// ---- put ----

#define MORI_SHMEM_PUT_FAMILY(Scope, G)                                                                          \
  MORI_DEVICE_INLINE void ShmemPutMemNbi##Scope(void* dest, const void* source, size_t bytes, int pe) {          \
    detail::Transfer<detail::Group::G, detail::Direction::Put>("ShmemPutMemNbi" #Scope, dest, source, bytes, pe,  \
                                                               false);                                           \
  }                                                                                                              \
  MORI_DEVICE_INLINE void ShmemPutMem##Scope(void* dest, const void* source, size_t bytes, int pe) {             \
    detail::Transfer<detail::Group::G, detail::Direction::Put>("ShmemPutMem" #Scope, dest, source, bytes, pe,     \
                                                               true);                                            \
  }                                                                                                              \
  template <typename T>                                                                                          \
  MORI_DEVICE_INLINE void ShmemPutTypeNbi##Scope(T* dest, const T* source, size_t nelems, int pe) {              \
    detail::Transfer<detail::Group::G, detail::Direction::Put>("ShmemPutTypeNbi" #Scope, dest, source,            \
                                                               nelems * sizeof(T), pe, false);                   \
  }                                                                                                              \
  template <typename T>                                                                                          \
  MORI_DEVICE_INLINE void ShmemPutType##Scope(T* dest, const T* source, size_t nelems, int pe) {                 \
    detail::Transfer<detail::Group::G, detail::Direction::Put>("ShmemPutType" #Scope, dest, source,               \
                                                               nelems * sizeof(T), pe, true);                    \
  }                                                                                                              \
  MORI_DEVICE_INLINE void ShmemGetMemNbi##Scope(void* dest, const void* source, size_t bytes, int pe) {          \
    detail::Transfer<detail::Group::G, detail::Direction::Get>("ShmemGetMemNbi" #Scope, dest, source, bytes, pe,  \
                                                               false);                                           \
  }                                                                                                              \
  MORI_DEVICE_INLINE void ShmemGetMem##Scope(void* dest, const void* source, size_t bytes, int pe) {             \
    detail::Transfer<detail::Group::G, detail::Direction::Get>("ShmemGetMem" #Scope, dest, source, bytes, pe,     \
                                                               true);                                            \
  }                                                                                                              \
  MORI_DEVICE_INLINE void ShmemPutMemNbiSignal##Scope(void* dest, const void* source, size_t bytes,              \
                                                      uint64_t* sigAddr, uint64_t sigVal, SignalOp op, int pe) { \
    detail::PutSignalNbi<detail::Group::G>("ShmemPutMemNbiSignal" #Scope, dest, source, bytes, sigAddr, sigVal,  \
                                           op, pe);                                                              \
  }

MORI_SHMEM_PUT_FAMILY(Thread, Thread)
MORI_SHMEM_PUT_FAMILY(Warp, Warp)
MORI_SHMEM_PUT_FAMILY(Block, Block)
#undef MORI_SHMEM_PUT_FAMILY

// ---- single values ----

namespace detail {

// The RDMA and Proxy part of the single-value put: `bytes` (<= 16) of the value in two words.
MORI_DEVICE_NOINLINE void PutValueRemote(const char* op, int pe, uint64_t offset, uint64_t lo, uint64_t hi,
                                         uint32_t bytes) {
  const ShmemDeviceState& s = State();
  const uint64_t words[2] = {lo, hi};
  if (TransportOf(s, pe) == TransportType::RDMA) {
    RdmaPutAggregated(s, op, pe, offset, words, bytes);  // inline: the value travels in the WQE
  } else {
    ProxyPutInline(s, pe, offset, words, bytes);  // the value travels in the request
  }
}

// The RDMA and Proxy part of the single-value get: `bytes` (<= 8) in the low bytes of the result.
MORI_DEVICE_NOINLINE uint64_t GetValueRemote(int pe, uint64_t offset, uint32_t bytes) {
  const ShmemDeviceState& s = State();
  if (TransportOf(s, pe) == TransportType::RDMA) return NicReadSmall(s, pe, offset, bytes);
  return ProxyGetSmall(s, pe, offset, bytes);
}

}  // namespace detail

// The `p` of OpenSHMEM: stores `value` at dest on pe (complete at quiet).
template <typename T>
MORI_DEVICE_INLINE void ShmemPutTypeImmNbiThread(T* dest, T value, int pe) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16, "single-value put takes a small plain value");
  const char* op = "ShmemPutTypeImmNbiThread";
  const ShmemDeviceState& s = detail::State();
  uint64_t offset = detail::TargetOffset(s, op, pe, dest, sizeof(T));
  const uintptr_t mapped = detail::MappedBase(s, pe);
  if (MORI_LIKELY(mapped != 0)) {
    *reinterpret_cast<volatile T*>(mapped + offset) = value;
    return;
  }
  uint64_t words[2] = {0, 0};
  memcpy(words, &value, sizeof(T));
  detail::PutValueRemote(op, pe, offset, words[0], words[1], sizeof(T));
}

// The `g` of OpenSHMEM: the value at source on pe.
template <typename T>
MORI_DEVICE_INLINE T ShmemGetTypeImmThread(const T* source, int pe) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "single-value get takes a value of up to 8 bytes");
  const char* op = "ShmemGetTypeImmThread";
  const ShmemDeviceState& s = detail::State();
  uint64_t offset = detail::TargetOffset(s, op, pe, source, sizeof(T));
  const uintptr_t mapped = detail::MappedBase(s, pe);
  if (MORI_LIKELY(mapped != 0)) return *reinterpret_cast<const volatile T*>(mapped + offset);
  uint64_t word = detail::GetValueRemote(pe, offset, sizeof(T));
  T out;
  memcpy(&out, &word, sizeof(T));
  return out;
}

// ---- signals and waits ----

MORI_DEVICE_INLINE void ShmemSignalOpThread(uint64_t* sigAddr, uint64_t val, SignalOp op, int pe) {
  const char* name = "ShmemSignalOpThread";
  const ShmemDeviceState& s = detail::State();
  uint64_t offset = detail::TargetOffset(s, name, pe, sigAddr, sizeof(uint64_t));
  detail::SignalAt(s, pe, offset, val, op);
}

// Waits until `*ivar cmp val` holds for a local variable that peers update; returns the value that satisfied
// it. Traps after MORI_TIMEOUT_S.
template <typename T>
MORI_DEVICE_INLINE T ShmemWaitUntil(T* ivar, CmpOp cmp, T val) {
  static_assert(std::is_integral_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "wait takes a 4- or 8-byte integer");
  const ShmemDeviceState& s = detail::Checked("ShmemWaitUntil");
  core::SpinDeadline deadline(s.timeoutNs, s.stopWord);
  for (;;) {
    T seen = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(ivar);
    if (detail::Compare(seen, cmp, val)) return seen;
    MORI_DEVICE_ASSERT(!deadline.Expired(),
                       "mori shmem: PE %d waited %llu ns at %p for (value cmp#%u %lld); last seen %lld: did the PE "
                       "that should update it die or never send?",
                       s.rank, static_cast<unsigned long long>(s.timeoutNs), static_cast<void*>(ivar),
                       static_cast<unsigned>(cmp), static_cast<long long>(val), static_cast<long long>(seen));
    core::SpinPause();
  }
}

MORI_DEVICE_INLINE uint64_t ShmemSignalWaitUntil(uint64_t* sigAddr, CmpOp cmp, uint64_t val) {
  return ShmemWaitUntil<uint64_t>(sigAddr, cmp, val);
}

// ---- atomics (T: int32_t, uint32_t, int64_t, uint64_t) ----

template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicTypeFetchAddThread(T* dest, T value, int pe) {
  return detail::AtomicOpImpl(
      "ShmemAtomicTypeFetchAddThread", dest, pe,
      detail::ProxyAmoArgs{ProxyAmo::FetchAdd, static_cast<uint64_t>(value), 0, true},
      [&](T* p) { return core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::System>(p, value); },
      [=](T old, T* next) {
        *next = static_cast<T>(old + value);
        return true;
      },
      detail::NicNative{true, rdma::AtomicOp::FetchAdd, static_cast<uint64_t>(value), 0, true});
}

// Adds without returning the old value; over the NIC (8 bytes) it completes at quiet.
template <typename T>
MORI_DEVICE_INLINE void ShmemAtomicTypeAddThread(T* dest, T value, int pe) {
  detail::AtomicOpImpl(
      "ShmemAtomicTypeAddThread", dest, pe, detail::ProxyAmoArgs{ProxyAmo::Add, static_cast<uint64_t>(value), 0, false},
      [&](T* p) { return core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::System>(p, value); },
      [=](T old, T* next) {
        *next = static_cast<T>(old + value);
        return true;
      },
      detail::NicNative{true, rdma::AtomicOp::FetchAdd, static_cast<uint64_t>(value), 0, false});
}

template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicTypeFetchIncThread(T* dest, int pe) {
  return ShmemAtomicTypeFetchAddThread<T>(dest, T{1}, pe);
}

template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicTypeCompareSwapThread(T* dest, T cond, T value, int pe) {
  return detail::AtomicOpImpl(
      "ShmemAtomicTypeCompareSwapThread", dest, pe,
      detail::ProxyAmoArgs{ProxyAmo::CompareSwap, static_cast<uint64_t>(value), static_cast<uint64_t>(cond), true},
      [&](T* p) {
        return core::AtomicCompareExchange<core::MemoryOrder::Relaxed, core::Scope::System>(p, cond, value);
      },
      [=](T old, T* next) {
        *next = value;
        return old == cond;
      },
      detail::NicNative{true, rdma::AtomicOp::CompareSwap, static_cast<uint64_t>(value), static_cast<uint64_t>(cond),
                        true});
}

template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicTypeSwapThread(T* dest, T value, int pe) {
  return detail::AtomicOpImpl(
      "ShmemAtomicTypeSwapThread", dest, pe,
      detail::ProxyAmoArgs{ProxyAmo::Swap, static_cast<uint64_t>(value), 0, true},
      [&](T* p) { return core::AtomicExchange<core::MemoryOrder::Relaxed, core::Scope::System>(p, value); },
      [=](T, T* next) {
        *next = value;
        return true;
      });
}

template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicTypeFetchThread(const T* source, int pe) {
  return detail::AtomicOpImpl(
      "ShmemAtomicTypeFetchThread", const_cast<T*>(source), pe, detail::ProxyAmoArgs{ProxyAmo::Fetch, 0, 0, true},
      [&](T* p) { return core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::System>(p); },
      [](T, T*) { return false; });
}

template <typename T>
MORI_DEVICE_INLINE void ShmemAtomicTypeSetThread(T* dest, T value, int pe) {
  detail::AtomicOpImpl(
      "ShmemAtomicTypeSetThread", dest, pe, detail::ProxyAmoArgs{ProxyAmo::Set, static_cast<uint64_t>(value), 0, false},
      [&](T* p) {
        core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::System>(p, value);
        return T{};
      },
      [=](T, T* next) {
        *next = value;
        return true;
      });
}

// ---- ordering ----

// Every put, get and atomic this thread issued before is complete: visible at its target (and gets landed).
namespace detail {
// The RDMA and Proxy part of quiet: every QP's completions, then the proxy's.
MORI_DEVICE_NOINLINE void QuietRemote() {
  const ShmemDeviceState& s = State();
  if (s.queues != nullptr) {
    for (int pe = 0; pe < s.nPes; ++pe) QuietPe(s, pe);
  }
  if (ViaProxy(s)) ProxyQuiet(s, -1);
}
}  // namespace detail

MORI_DEVICE_INLINE void ShmemQuietThread() {
  const ShmemDeviceState& s = detail::Checked("ShmemQuietThread");
  detail::SystemFence();
  if (MORI_UNLIKELY(s.queues != nullptr || detail::ViaProxy(s))) detail::QuietRemote();
}

MORI_DEVICE_INLINE void ShmemQuietThread(int pe) {
  const ShmemDeviceState& s = detail::Checked("ShmemQuietThread(pe)");
  detail::CheckPe(s, "ShmemQuietThread(pe)", pe);
  detail::SystemFence();
  detail::QuietPe(s, pe);
  if (detail::ViaProxy(s)) detail::ProxyQuiet(s, pe);
}

// Puts, signals and atomics to one PE issued before the fence arrive before those issued after it.
MORI_DEVICE_INLINE void ShmemFenceThread() {
  const ShmemDeviceState& s = detail::Checked("ShmemFenceThread");
  detail::SystemFence();
  // One QP per PE: RC keeps its operations in order. With several, a thread's operations may use another
  // QP after a block-scope call, so the fence completes everything.
  if (s.qpsPerPe > 1) ShmemQuietThread();
  // Connections that may apply writes out of order (TCP channels) are flushed by the proxy at the fence.
  if (detail::ViaProxy(s)) detail::ProxyFence(s);
}

// ---- barrier ----

// Completes this PE's operations, then waits until every PE has arrived. One thread per PE calls it.
MORI_DEVICE_NOINLINE void ShmemBarrierAllThread() {
  const ShmemDeviceState& s = detail::Checked("ShmemBarrierAllThread");
  ShmemQuietThread();
  uint64_t generation =
      core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(s.barrierSeq, uint64_t{1}) + 1;
  for (int pe = 0; pe < s.nPes; ++pe) {
    detail::SignalAt(s, pe, kShmemBarrierCounterOffset, 1, SignalOp::Add);
  }
  auto* arrivals = reinterpret_cast<uint64_t*>(s.heapBase + kShmemBarrierCounterOffset);
  uint64_t expected = generation * static_cast<uint64_t>(s.nPes);
  core::SpinDeadline deadline(s.timeoutNs, s.stopWord);
  for (;;) {
    uint64_t seen = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(arrivals);
    if (seen >= expected) break;
    MORI_DEVICE_ASSERT(!deadline.Expired(),
                       "mori shmem: PE %d waited %llu ns in device barrier #%llu: %llu of %d PEs arrived (some PE "
                       "died or never called it)",
                       s.rank, static_cast<unsigned long long>(s.timeoutNs),
                       static_cast<unsigned long long>(generation),
                       static_cast<unsigned long long>(seen - (generation - 1) * s.nPes), s.nPes);
    core::SpinPause();
  }
  ShmemQuietThread();  // the arrival atomics sent through the NIC are complete too
}

// Every thread of the block calls it.
MORI_DEVICE_INLINE void ShmemBarrierAllBlock() {
  detail::SystemFence();
  const uint64_t present = detail::GroupSyncPresent<detail::Group::Block>();
  if (core::FlatThreadIdx() == 0) ShmemBarrierAllThread();
  detail::GroupSyncOrLeave<detail::Group::Block>(present);  // thread 0 stopped in its wait: the block leaves
}

// ---- teams ----

// Completes this PE's operations, then waits until every member of `team` has arrived. One thread per member
// calls it; every member calls it as often as the others (each call is one generation of the team's
// arrival counter). Traps, naming the team, when this PE is not a member.
MORI_DEVICE_NOINLINE void ShmemTeamSyncThread(ShmemTeam team) {
  const ShmemDeviceState& s = detail::Checked("ShmemTeamSyncThread");
  const ShmemTeamState* t = detail::TeamAt(s, team);
  MORI_DEVICE_ASSERT(t != nullptr && t->myIndex >= 0,
                     "mori shmem: ShmemTeamSyncThread on PE %d: team %d is not a team this PE belongs to", s.rank,
                     static_cast<int>(team));
  const auto id = static_cast<uint32_t>(team);
  ShmemQuietThread();
  uint64_t generation =
      core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&s.teamSyncSeq[id], uint64_t{1}) + 1;
  const uint64_t offset = kShmemTeamSyncOffset + id * sizeof(uint64_t);
  for (int i = 0; i < t->size; ++i) detail::SignalAt(s, detail::TeamWorldPe(*t, i), offset, 1, SignalOp::Add);
  auto* arrivals = reinterpret_cast<uint64_t*>(s.heapBase + offset);
  const uint64_t expected = generation * static_cast<uint64_t>(t->size);
  core::SpinDeadline deadline(s.timeoutNs, s.stopWord);
  for (;;) {
    uint64_t seen = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(arrivals);
    if (seen >= expected) break;
    MORI_DEVICE_ASSERT(!deadline.Expired(),
                       "mori shmem: PE %d waited %llu ns in sync #%llu of team %d: %llu of its %d PEs arrived "
                       "(some member died or never called it)",
                       s.rank, static_cast<unsigned long long>(s.timeoutNs),
                       static_cast<unsigned long long>(generation), static_cast<int>(team),
                       static_cast<unsigned long long>(seen - (generation - 1) * t->size), t->size);
    core::SpinPause();
  }
  ShmemQuietThread();  // the arrival atomics sent through the NIC or the proxy are complete too
}

// Every thread of the block calls it.
MORI_DEVICE_INLINE void ShmemTeamSyncBlock(ShmemTeam team) {
  detail::SystemFence();
  const uint64_t present = detail::GroupSyncPresent<detail::Group::Block>();
  if (core::FlatThreadIdx() == 0) ShmemTeamSyncThread(team);
  detail::GroupSyncOrLeave<detail::Group::Block>(present);  // thread 0 stopped in its wait: the block leaves
}

}  // namespace mori::shmem

#endif  // MORI_DEVICE_API_AVAILABLE
