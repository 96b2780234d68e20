// The requests a kernel pushes into the SHMEM proxy's FIFO (the Proxy transport), shared by the device API
// and the host proxy; includes nothing host-only. A request takes 1 to 3 consecutive slots of one Push.
#pragma once

#include <cstdint>

#include "mori/core/device.hpp"
#include "mori/channels/proxy_trigger.hpp"

namespace mori::shmem {

// Slot 0 (the header):
//   fst [ 0, 8)  op              ProxyOp
//   fst [ 8,16)  slots           1..3, the header included
//   fst [16,24)  sub             ProxyAmo for Atomic, SignalOp for Signal/PutSignal, kProxyFlagFlush for Put/Get
//   fst [24,32)  width           4 or 8: the atomic's value size
//   fst [32,64)  pe              target PE; kProxyAllPes for a quiet or fence of every PE
//   snd [ 0,63)  bytes           of a Put, Get, PutInline, GetInline, PutSignal
//   snd 63                       the FIFO's lap bit
// Slots 1 and 2: fst a 64-bit value (a local address, a value), snd [0,63) a heap offset or a result index.
enum class ProxyOp : uint32_t {
  Put = 1,        // slot 1: {local source address, heap offset at pe}
  Get = 2,        // slot 1: {local destination address, heap offset at pe}
  PutInline = 3,  // slot 1: {bytes 0..7, heap offset}; slot 2: {bytes 8..15, 0}; at most 16 bytes
  GetInline = 4,  // slot 1: {0, heap offset}; slot 2: {0, result index}; at most 8 bytes, into the result word
  Signal = 5,     // slot 1: {value, heap offset of the signal word}
  PutSignal = 6,  // slot 1: {local source address, heap offset}; slot 2: {signal value, signal offset}
  Atomic = 7,     // slot 1: {value, heap offset}; slot 2: {compare, result index or kProxyNoResult}
  Quiet = 8,      // every earlier request of every thread is complete at its target when the slot is popped
  Fence = 9,      // later puts to a PE are not applied before earlier ones
};

enum class ProxyAmo : uint32_t { FetchAdd = 0, Add = 1, CompareSwap = 2, Swap = 3, Fetch = 4, Set = 5 };

constexpr uint32_t kProxyFlagFlush = 1;  // Put/Get: complete at the target before the slot is popped
constexpr uint32_t kProxyAllPes = 0xffffffffu;
constexpr uint64_t kProxyNoResult = (uint64_t{1} << 63) - 1;
constexpr uint64_t kProxyFieldMask = ~core::kTriggerLapBit;  // the 63 bits of `snd` a request owns
constexpr uint32_t kProxyMaxSlots = 3;
constexpr uint32_t kProxyInlineBytes = 16;

struct ProxyHeader {
  ProxyOp op;
  uint32_t slots;
  uint32_t sub;
  uint32_t width;
  uint32_t pe;
  uint64_t bytes;
};

MORI_HOST_DEVICE_INLINE constexpr core::ProxyTrigger EncodeProxyHeader(const ProxyHeader& h) {
  core::ProxyTrigger t{};
  t.fst = (static_cast<uint64_t>(h.op) & 0xffu) | ((static_cast<uint64_t>(h.slots) & 0xffu) << 8) |
          ((static_cast<uint64_t>(h.sub) & 0xffu) << 16) | ((static_cast<uint64_t>(h.width) & 0xffu) << 24) |
          (static_cast<uint64_t>(h.pe) << 32);
  t.snd = h.bytes & kProxyFieldMask;
  return t;
}

MORI_HOST_DEVICE_INLINE constexpr ProxyHeader DecodeProxyHeader(const core::ProxyTrigger& t) {
  ProxyHeader h{};
  h.op = static_cast<ProxyOp>(t.fst & 0xffu);
  h.slots = static_cast<uint32_t>((t.fst >> 8) & 0xffu);
  h.sub = static_cast<uint32_t>((t.fst >> 16) & 0xffu);
  h.width = static_cast<uint32_t>((t.fst >> 24) & 0xffu);
  h.pe = static_cast<uint32_t>(t.fst >> 32);
  h.bytes = t.snd & kProxyFieldMask;
  return h;
}

// A payload slot: a 64-bit value and a 63-bit field.
MORI_HOST_DEVICE_INLINE constexpr core::ProxyTrigger ProxyPayload(uint64_t value, uint64_t field) {
  return core::ProxyTrigger{value, field & kProxyFieldMask};
}

}  // namespace mori::shmem
