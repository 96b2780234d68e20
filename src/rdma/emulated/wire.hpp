// The emulated NIC's wire: fixed-size packet headers on TCP connections between emulated NICs. Requests go
// out on connections a NIC opens; responses come back on the connection their request arrived on, so
// each connection keeps RC's per-QP order. A connection opens with a hello that carries the nonce of the NIC
// it reaches (from that NIC's endpoint handles, which only the job has) and the nonce of the NIC that opens
// it; the accepting NIC takes nothing else first, and runs requests only for QPs connected to that NIC.
// Every packet carries an integrity check of its header and payload (IB's ICRC): a packet that fails it is
// dropped by the receiver, never executed or accepted.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "../../core/socket.hpp"

namespace mori::rdma::emulated {

constexpr uint32_t kWireMagic = 0x4e454f4dU;  // "MOEN"
constexpr uint8_t kWireVersion = 3;           // 3: 64-byte header with the integrity check
constexpr uint64_t kMaxWirePayload = 1ull << 31;

enum class PacketType : uint8_t {
  WriteRequest = 1,
  ReadRequest = 2,
  AtomicRequest = 3,
  SendRequest = 4,
  Ack = 5,             // success, or a NAK when `syndrome` is set
  ReadResponse = 6,
  AtomicResponse = 7,
  Hello = 8,           // raddr: the nonce of the NIC connected to; swapAdd: the nonce of the NIC connecting
};

struct PacketHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t type;       // PacketType
  uint8_t atomicOp;   // AtomicOp of an atomic request
  uint8_t syndrome;   // responses: 0, or the mlx5 syndrome the requester completes with
  uint32_t srcQpn;
  uint32_t dstQpn;
  uint32_t psn;
  uint32_t rkey;
  uint64_t raddr;
  uint64_t swapAdd;   // atomic operand; an atomic response's original value
  uint64_t compare;
  uint64_t length;    // payload bytes that follow; a read request's requested length
  uint64_t icrc;      // PacketCheck of this header (this field as zero) and the payload
};
// 56 bytes of fields and the 8-byte check: the header keeps 8-byte alignment for the payload that follows.
static_assert(sizeof(PacketHeader) == 64, "the wire header is 64 bytes");
static_assert(offsetof(PacketHeader, icrc) == 56, "the integrity check ends the header");

inline bool IsRequest(uint8_t type) { return type >= 1 && type <= 4; }
inline bool IsResponse(uint8_t type) { return type >= 5 && type <= 7; }
inline bool IsHello(uint8_t type) { return type == static_cast<uint8_t>(PacketType::Hello); }

// A header of this wire version and `type`, every other field zero.
inline PacketHeader MakePacketHeader(PacketType type) {
  PacketHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.type = static_cast<uint8_t>(type);
  return h;
}

// Bytes that follow the header on the wire (a read request's length is what it asks for, not what it carries).
inline uint64_t PayloadBytes(const PacketHeader& h) {
  return h.type == static_cast<uint8_t>(PacketType::ReadRequest) ? 0 : h.length;
}

// The integrity check of a packet: multiply-xor chains over 8-byte words of the header (its icrc as zero) and
// the payload (four interleaved chains, folded in at the end, so it runs at several GB/s). Each step is a
// bijection of the running value for a fixed word and of the word for a fixed value, so a packet that differs from the
// checked one in a single word (any one flipped bit, in particular) always fails; other damage passes with
// probability about 2^-64.
uint64_t PacketCheck(const PacketHeader& h, const void* payload, size_t bytes);
inline bool PacketCheckPasses(const PacketHeader& h, const void* payload, size_t bytes) {
  return PacketCheck(h, payload, bytes) == h.icrc;
}

// Empty when the header is well formed, else why not.
std::string CheckPacketHeader(const PacketHeader& h);

// Whether `h` is a hello that a NIC whose nonce is `myNonce` admits: it names that nonce and its sender's own.
inline bool HelloAdmits(const PacketHeader& h, uint64_t myNonce) {
  return IsHello(h.type) && h.raddr == myNonce && h.swapAdd != 0;
}

// Where an emulated NIC's endpoint listens: its GID (an IPv4-mapped IPv6 address for IPv4) and wire port.
inline core::net::WireAddress WireAddressOf(const uint8_t (&gid)[16], uint16_t port) {
  static const uint8_t kMappedPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  core::net::WireAddress w{};
  if (std::memcmp(gid, kMappedPrefix, sizeof(kMappedPrefix)) == 0) {
    w.family = AF_INET;
    std::memcpy(w.addr, gid + 12, 4);
  } else {
    w.family = AF_INET6;
    std::memcpy(w.addr, gid, 16);
  }
  w.port = port;
  return w;
}

}  // namespace mori::rdma::emulated
