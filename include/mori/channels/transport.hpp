// The transports a channel connection can use, and sets of them (a memory region is registered for several).
// CudaIpc: same-host GPU memory mapped into the peer (copy engine from a proxy, SM stores from a kernel).
// IB0..IB7: the n-th RDMA NIC through host-posted verbs; on a machine with no NIC, the emulated NIC.
// Tcp: multi-channel TCP sockets. Emulated: the emulated NIC even where a real one exists.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mori::core {

enum class Transport : uint32_t {
  Unknown = 0,
  CudaIpc = 1,
  IB0 = 2,
  IB1 = 3,
  IB2 = 4,
  IB3 = 5,
  IB4 = 6,
  IB5 = 7,
  IB6 = 8,
  IB7 = 9,
  Tcp = 10,
  Emulated = 11,
};
constexpr int kNumTransports = 12;
constexpr int kNumIbTransports = 8;

const char* TransportName(Transport t);
// "CudaIpc", "IB0".."IB7", "Tcp", "Emulated" (case-insensitive); nothing for anything else.
std::optional<Transport> ParseTransport(const std::string& text);

constexpr bool IsIbTransport(Transport t) { return t >= Transport::IB0 && t <= Transport::IB7; }
// Whether connections of `t` move data through an RDMA NIC (real or emulated).
constexpr bool IsRdmaTransport(Transport t) { return IsIbTransport(t) || t == Transport::Emulated; }
constexpr int IbIndex(Transport t) { return static_cast<int>(t) - static_cast<int>(Transport::IB0); }
constexpr Transport IbTransport(int index) { return static_cast<Transport>(static_cast<int>(Transport::IB0) + index); }

// A set of transports (RegisterMemory takes one: Transport::CudaIpc | Transport::IB0).
class TransportFlags {
 public:
  constexpr TransportFlags() = default;
  constexpr TransportFlags(Transport t) : bits_(t == Transport::Unknown ? 0u : 1u << static_cast<uint32_t>(t)) {}
  static constexpr TransportFlags FromBits(uint32_t bits) {
    TransportFlags f;
    f.bits_ = bits & ((1u << kNumTransports) - 2u);  // Unknown is never a member
    return f;
  }

  constexpr bool Has(Transport t) const { return (bits_ & TransportFlags(t).bits_) != 0; }
  constexpr bool Empty() const { return bits_ == 0; }
  constexpr uint32_t Bits() const { return bits_; }
  constexpr bool HasRdma() const {
    for (int i = 0; i < kNumTransports; ++i) {
      if ((bits_ >> i & 1u) != 0 && IsRdmaTransport(static_cast<Transport>(i))) return true;
    }
    return false;
  }

  constexpr TransportFlags operator|(TransportFlags o) const { return FromBits(bits_ | o.bits_); }
  constexpr TransportFlags operator&(TransportFlags o) const { return FromBits(bits_ & o.bits_); }
  constexpr TransportFlags& operator|=(TransportFlags o) {
    bits_ |= o.bits_;
    return *this;
  }
  constexpr bool operator==(TransportFlags o) const { return bits_ == o.bits_; }
  constexpr bool operator!=(TransportFlags o) const { return bits_ != o.bits_; }

  // "CudaIpc|IB0", or "none".
  std::string ToString() const;

 private:
  uint32_t bits_ = 0;
};

constexpr TransportFlags operator|(Transport a, Transport b) { return TransportFlags(a) | TransportFlags(b); }

}  // namespace mori::core
