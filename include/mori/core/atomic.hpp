// Scoped atomics, fences, the doorbell MMIO store and byte-order helpers, one spelling for CUDA, HIP and HOST.
// Order and scope are template arguments so each call compiles to one instruction; HIP keeps the scope (a
// device-scope atomic is cheaper there than a system-scope one), HOST has a single coherence domain.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/device.hpp"

#if MORI_BACKEND_CUDA && MORI_GPU_COMPILER
#include <cuda/atomic>
#endif

namespace mori::core {

enum class MemoryOrder { Relaxed, Acquire, Release, AcqRel, SeqCst };

// Who must observe the operation: threads of one block, of one GPU, or the whole system (host threads,
// other GPUs and the NIC through mapped memory).
enum class Scope { Block, Device, System };

namespace atomic_detail {

template <MemoryOrder O>
MORI_HOST_DEVICE_INLINE constexpr int GccOrder() {
  if constexpr (O == MemoryOrder::Relaxed) return __ATOMIC_RELAXED;
  if constexpr (O == MemoryOrder::Acquire) return __ATOMIC_ACQUIRE;
  if constexpr (O == MemoryOrder::Release) return __ATOMIC_RELEASE;
  if constexpr (O == MemoryOrder::AcqRel) return __ATOMIC_ACQ_REL;
  return __ATOMIC_SEQ_CST;
}

// The order a compare-exchange uses when the comparison fails: it stores nothing, so no release part.
template <MemoryOrder O>
MORI_HOST_DEVICE_INLINE constexpr MemoryOrder FailureOrder() {
  if constexpr (O == MemoryOrder::Release) return MemoryOrder::Relaxed;
  if constexpr (O == MemoryOrder::AcqRel) return MemoryOrder::Acquire;
  return O;
}

template <typename T>
constexpr bool kAtomicSize = (sizeof(T) == 4 || sizeof(T) == 8) && std::is_trivially_copyable_v<T>;

#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
template <Scope S>
constexpr cuda::thread_scope CudaScope() {
  if constexpr (S == Scope::Block) return cuda::thread_scope_block;
  if constexpr (S == Scope::Device) return cuda::thread_scope_device;
  return cuda::thread_scope_system;
}
template <MemoryOrder O>
constexpr cuda::memory_order CudaOrder() {
  if constexpr (O == MemoryOrder::Relaxed) return cuda::memory_order_relaxed;
  if constexpr (O == MemoryOrder::Acquire) return cuda::memory_order_acquire;
  if constexpr (O == MemoryOrder::Release) return cuda::memory_order_release;
  if constexpr (O == MemoryOrder::AcqRel) return cuda::memory_order_acq_rel;
  return cuda::memory_order_seq_cst;
}
template <Scope S, typename T>
MORI_DEVICE_INLINE cuda::atomic_ref<T, CudaScope<S>()> Ref(T* p) {
  return cuda::atomic_ref<T, CudaScope<S>()>(*p);
}
#endif

#if MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
template <Scope S>
constexpr int HipScope() {
  if constexpr (S == Scope::Block) return __HIP_MEMORY_SCOPE_WORKGROUP;
  if constexpr (S == Scope::Device) return __HIP_MEMORY_SCOPE_AGENT;
  return __HIP_MEMORY_SCOPE_SYSTEM;
}
#endif

}  // namespace atomic_detail

template <MemoryOrder O = MemoryOrder::Acquire, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicLoad(const T* p) {
  static_assert(atomic_detail::kAtomicSize<T>, "atomics need a 4- or 8-byte trivially copyable type");
  static_assert(O == MemoryOrder::Relaxed || O == MemoryOrder::Acquire || O == MemoryOrder::SeqCst,
                "a load is relaxed, acquire or seq_cst");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return atomic_detail::Ref<S>(const_cast<T*>(p)).load(atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return __hip_atomic_load(p, atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  return __atomic_load_n(p, atomic_detail::GccOrder<O>());
#endif
}

template <MemoryOrder O = MemoryOrder::Release, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE void AtomicStore(T* p, T v) {
  static_assert(atomic_detail::kAtomicSize<T>, "atomics need a 4- or 8-byte trivially copyable type");
  static_assert(O == MemoryOrder::Relaxed || O == MemoryOrder::Release || O == MemoryOrder::SeqCst,
                "a store is relaxed, release or seq_cst");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  atomic_detail::Ref<S>(p).store(v, atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  __hip_atomic_store(p, v, atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  __atomic_store_n(p, v, atomic_detail::GccOrder<O>());
#endif
}

template <MemoryOrder O = MemoryOrder::AcqRel, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicFetchAdd(T* p, T v) {
  static_assert(atomic_detail::kAtomicSize<T> && std::is_integral_v<T>, "fetch-add needs a 4- or 8-byte integer");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return atomic_detail::Ref<S>(p).fetch_add(v, atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return __hip_atomic_fetch_add(p, v, atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  return __atomic_fetch_add(p, v, atomic_detail::GccOrder<O>());
#endif
}

template <MemoryOrder O = MemoryOrder::AcqRel, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicFetchSub(T* p, T v) {
  static_assert(atomic_detail::kAtomicSize<T> && std::is_integral_v<T>, "fetch-sub needs a 4- or 8-byte integer");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return atomic_detail::Ref<S>(p).fetch_sub(v, atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return __hip_atomic_fetch_add(p, static_cast<T>(T(0) - v), atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  return __atomic_fetch_sub(p, v, atomic_detail::GccOrder<O>());
#endif
}

template <MemoryOrder O = MemoryOrder::AcqRel, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicFetchOr(T* p, T v) {
  static_assert(atomic_detail::kAtomicSize<T> && std::is_integral_v<T>, "fetch-or needs a 4- or 8-byte integer");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return atomic_detail::Ref<S>(p).fetch_or(v, atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return __hip_atomic_fetch_or(p, v, atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  return __atomic_fetch_or(p, v, atomic_detail::GccOrder<O>());
#endif
}

// Raises *p to v if it is below; returns the value before.
template <MemoryOrder O = MemoryOrder::AcqRel, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicFetchMax(T* p, T v) {
  static_assert(atomic_detail::kAtomicSize<T> && std::is_integral_v<T>, "fetch-max needs a 4- or 8-byte integer");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return atomic_detail::Ref<S>(p).fetch_max(v, atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return __hip_atomic_fetch_max(p, v, atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  T seen = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (seen < v && !__atomic_compare_exchange_n(p, &seen, v, true, atomic_detail::GccOrder<O>(), __ATOMIC_RELAXED)) {
  }
  return seen;
#endif
}

template <MemoryOrder O = MemoryOrder::AcqRel, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicExchange(T* p, T v) {
  static_assert(atomic_detail::kAtomicSize<T>, "atomics need a 4- or 8-byte trivially copyable type");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return atomic_detail::Ref<S>(p).exchange(v, atomic_detail::CudaOrder<O>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return __hip_atomic_exchange(p, v, atomic_detail::GccOrder<O>(), atomic_detail::HipScope<S>());
#else
  return __atomic_exchange_n(p, v, atomic_detail::GccOrder<O>());
#endif
}

// Compare-and-swap that returns the value found at *p (equal to `expected` exactly when the swap happened),
// the form GPU code and the SHMEM compare-swap want.
template <MemoryOrder O = MemoryOrder::AcqRel, Scope S = Scope::System, typename T>
MORI_HOST_DEVICE_INLINE T AtomicCompareExchange(T* p, T expected, T desired) {
  static_assert(atomic_detail::kAtomicSize<T>, "atomics need a 4- or 8-byte trivially copyable type");
  constexpr MemoryOrder kFail = atomic_detail::FailureOrder<O>();
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  atomic_detail::Ref<S>(p).compare_exchange_strong(expected, desired, atomic_detail::CudaOrder<O>(),
                                                   atomic_detail::CudaOrder<kFail>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  __hip_atomic_compare_exchange_strong(p, &expected, desired, atomic_detail::GccOrder<O>(),
                                       atomic_detail::GccOrder<kFail>(), atomic_detail::HipScope<S>());
#else
  __atomic_compare_exchange_n(p, &expected, desired, false, atomic_detail::GccOrder<O>(),
                              atomic_detail::GccOrder<kFail>());
#endif
  return expected;
}

template <MemoryOrder O = MemoryOrder::SeqCst, Scope S = Scope::System>
MORI_HOST_DEVICE_INLINE void AtomicFence() {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  cuda::atomic_thread_fence(atomic_detail::CudaOrder<O>(), atomic_detail::CudaScope<S>());
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  // Literal arguments only: clang 15 crashes on a template-dependent order in __builtin_amdgcn_fence.
#define MORI_HIP_FENCE_FOR_ORDER(scopeName)                                          \
  if constexpr (O == MemoryOrder::Acquire) {                                         \
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, scopeName);                             \
  } else if constexpr (O == MemoryOrder::Release) {                                  \
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, scopeName);                             \
  } else if constexpr (O == MemoryOrder::AcqRel) {                                   \
    __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, scopeName);                             \
  } else if constexpr (O != MemoryOrder::Relaxed) {                                  \
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, scopeName);                             \
  }
  if constexpr (S == Scope::Block) {
    MORI_HIP_FENCE_FOR_ORDER("workgroup")
  } else if constexpr (S == Scope::Device) {
    MORI_HIP_FENCE_FOR_ORDER("agent")
  } else {
    MORI_HIP_FENCE_FOR_ORDER("")
  }
#undef MORI_HIP_FENCE_FOR_ORDER
#elif defined(__SANITIZE_THREAD__)
  // ThreadSanitizer does not model fences (GCC refuses them under -Werror): a read-modify-write with the same
  // order on a private word is still a full barrier on the CPU and keeps TSan's happens-before for it.
  static uint32_t fenceWord = 0;
  if constexpr (O != MemoryOrder::Relaxed) __atomic_fetch_add(&fenceWord, 0u, atomic_detail::GccOrder<O>());
#else
  __atomic_thread_fence(atomic_detail::GccOrder<O>());
#endif
}

// A 64-bit store to a device register (a NIC doorbell or BlueFlame register mapped into the address space).
// It must reach the device as one 8-byte write, uncached and unmerged; ordering against earlier memory writes
// is the caller's business (a named fence before it).
MORI_HOST_DEVICE_INLINE void MmioStore64(void* reg, uint64_t value) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
#if __CUDA_ARCH__ >= 700
  asm volatile("st.mmio.relaxed.sys.global.b64 [%0], %1;" ::"l"(reg), "l"(value) : "memory");
#else
  *static_cast<volatile uint64_t*>(reg) = value;
#endif
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  __hip_atomic_store(static_cast<uint64_t*>(reg), value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  // An atomic store (a plain 8-byte mov on x86-64): a software NIC may be reading the register concurrently.
  __atomic_store_n(static_cast<uint64_t*>(reg), value, __ATOMIC_RELAXED);
#endif
}

// Byte order of NIC descriptors (mlx5 WQEs and CQEs are big-endian). Shifts compile to one byte-permute or
// bswap instruction on every target, so no backend-specific intrinsic is needed.
MORI_HOST_DEVICE_INLINE constexpr uint16_t ByteSwap16(uint16_t v) {
  return static_cast<uint16_t>((v >> 8) | (v << 8));
}
MORI_HOST_DEVICE_INLINE constexpr uint32_t ByteSwap32(uint32_t v) {
  return ((v & 0x000000ffu) << 24) | ((v & 0x0000ff00u) << 8) | ((v & 0x00ff0000u) >> 8) | ((v & 0xff000000u) >> 24);
}
MORI_HOST_DEVICE_INLINE constexpr uint64_t ByteSwap64(uint64_t v) {
  return (static_cast<uint64_t>(ByteSwap32(static_cast<uint32_t>(v))) << 32) | ByteSwap32(static_cast<uint32_t>(v >> 32));
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mori assumes a little-endian host and device"
#endif
MORI_HOST_DEVICE_INLINE constexpr uint16_t HostToBe16(uint16_t v) { return ByteSwap16(v); }
MORI_HOST_DEVICE_INLINE constexpr uint32_t HostToBe32(uint32_t v) { return ByteSwap32(v); }
MORI_HOST_DEVICE_INLINE constexpr uint64_t HostToBe64(uint64_t v) { return ByteSwap64(v); }
MORI_HOST_DEVICE_INLINE constexpr uint16_t BeToHost16(uint16_t v) { return ByteSwap16(v); }
MORI_HOST_DEVICE_INLINE constexpr uint32_t BeToHost32(uint32_t v) { return ByteSwap32(v); }
MORI_HOST_DEVICE_INLINE constexpr uint64_t BeToHost64(uint64_t v) { return ByteSwap64(v); }

}  // namespace mori::core
