// LL ("low latency") packets: data and a flag travel in one store, so a reader that sees the flag it expects
// sees the data with it, with no fence and no separate signal. LL16 carries 8 data bytes in 16 (two 4-byte
// data words, each beside a copy of the flag); LL8 carries 4 in 8. The flag changes every round, so a
// packet buffer is reused without clearing. Includes nothing host-only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/atomic.hpp"
#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"

namespace mori::core {

// Each 8-byte half holds a data word and the flag, so even a reader that sees the halves at different times
// accepts the packet only once both halves are of this round: a 16-byte store is a speed-up, not a need.
struct alignas(16) LL16Packet {
  uint32_t data1;
  uint32_t flag1;
  uint32_t data2;
  uint32_t flag2;

  static constexpr uint32_t kDataBytes = 8;

#if MORI_DEVICE_API_AVAILABLE
  MORI_DEVICE_INLINE void Write(uint32_t d1, uint32_t d2, uint32_t flag) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(this), "r"(d1), "r"(flag), "r"(d2), "r"(flag)
                 : "memory");
#else
    auto* w = reinterpret_cast<uint64_t*>(this);
    AtomicStore<MemoryOrder::Relaxed, Scope::System>(&w[0], uint64_t{d1} | (uint64_t{flag} << 32));
    AtomicStore<MemoryOrder::Relaxed, Scope::System>(&w[1], uint64_t{d2} | (uint64_t{flag} << 32));
#endif
  }
  MORI_DEVICE_INLINE void Write(uint64_t data, uint32_t flag) {
    Write(static_cast<uint32_t>(data), static_cast<uint32_t>(data >> 32), flag);
  }

  // One look: true and the 8 data bytes when both halves carry `flag`.
  MORI_DEVICE_INLINE bool ReadOnce(uint32_t flag, uint64_t* data) const {
    uint32_t d1, f1, d2, f2;
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d1), "=r"(f1), "=r"(d2), "=r"(f2)
                 : "l"(this)
                 : "memory");
#else
    const auto* w = reinterpret_cast<const uint64_t*>(this);
    uint64_t lo = AtomicLoad<MemoryOrder::Relaxed, Scope::System>(&w[0]);
    uint64_t hi = AtomicLoad<MemoryOrder::Relaxed, Scope::System>(&w[1]);
    d1 = static_cast<uint32_t>(lo);
    f1 = static_cast<uint32_t>(lo >> 32);
    d2 = static_cast<uint32_t>(hi);
    f2 = static_cast<uint32_t>(hi >> 32);
#endif
    if (f1 != flag || f2 != flag) return false;
    *data = uint64_t{d1} | (uint64_t{d2} << 32);
    return true;
  }

  // Waits (bounded; traps naming the packet and the flag) for the packet of round `flag`; leaves the kernel once
  // `stop` (the process's stop word, core/stop.hpp) is set.
  MORI_DEVICE_INLINE uint64_t Read(uint32_t flag, uint64_t timeoutNs, const uint32_t* stop = nullptr) const {
    uint64_t data = 0;
    SpinDeadline deadline(timeoutNs, stop);
    while (!ReadOnce(flag, &data)) {
      MORI_DEVICE_ASSERT(!deadline.Expired(), "mori LL16 packet at %p: flag %u did not arrive within %llu ns (seen %u/%u)",
                         static_cast<const void*>(this), flag, static_cast<unsigned long long>(timeoutNs),
                         AtomicLoad<MemoryOrder::Relaxed, Scope::System>(&flag1),
                         AtomicLoad<MemoryOrder::Relaxed, Scope::System>(&flag2));
      SpinPause();
    }
    return data;
  }
#endif
};
static_assert(sizeof(LL16Packet) == 16 && std::is_trivially_copyable_v<LL16Packet>, "LL16 is one 16-byte slot");

struct alignas(8) LL8Packet {
  uint32_t data;
  uint32_t flag;

  static constexpr uint32_t kDataBytes = 4;

#if MORI_DEVICE_API_AVAILABLE
  MORI_DEVICE_INLINE void Write(uint32_t d, uint32_t f) {
    AtomicStore<MemoryOrder::Relaxed, Scope::System>(reinterpret_cast<uint64_t*>(this), uint64_t{d} | (uint64_t{f} << 32));
  }
  MORI_DEVICE_INLINE bool ReadOnce(uint32_t f, uint32_t* out) const {
    uint64_t w = AtomicLoad<MemoryOrder::Relaxed, Scope::System>(reinterpret_cast<const uint64_t*>(this));
    if (static_cast<uint32_t>(w >> 32) != f) return false;
    *out = static_cast<uint32_t>(w);
    return true;
  }
  MORI_DEVICE_INLINE uint32_t Read(uint32_t f, uint64_t timeoutNs, const uint32_t* stop = nullptr) const {
    uint32_t d = 0;
    SpinDeadline deadline(timeoutNs, stop);
    while (!ReadOnce(f, &d)) {
      MORI_DEVICE_ASSERT(!deadline.Expired(), "mori LL8 packet at %p: flag %u did not arrive within %llu ns",
                         static_cast<const void*>(this), f, static_cast<unsigned long long>(timeoutNs));
      SpinPause();
    }
    return d;
  }
#endif
};
static_assert(sizeof(LL8Packet) == 8 && std::is_trivially_copyable_v<LL8Packet>, "LL8 is one 8-byte slot");

}  // namespace mori::core
