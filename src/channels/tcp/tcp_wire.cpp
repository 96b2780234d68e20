// Encoding and validation of the TCP transport's handle, frames and hello.
#include "tcp/tcp_wire.hpp"

#include <cstring>

#include "mori/core/errors.hpp"

namespace mori::core::tcp {

std::vector<uint8_t> EncodeHandle(const TcpHandle& handle) {
  MORI_CHECK(!handle.addresses.empty() && handle.addresses.size() <= static_cast<size_t>(kMaxChannels),
             ErrorCode::InvalidUsage, "a TCP handle holds 1 to %d channel addresses, not %zu", kMaxChannels,
             handle.addresses.size());
  HandleHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kHandleMagic;
  h.version = kWireVersion;
  h.count = static_cast<uint16_t>(handle.addresses.size());
  h.nonce = handle.nonce;
  h.rank = handle.rank;
  std::vector<uint8_t> bytes(sizeof(h) + handle.addresses.size() * sizeof(net::WireAddress));
  std::memcpy(bytes.data(), &h, sizeof(h));
  for (size_t i = 0; i < handle.addresses.size(); ++i) {
    net::WireAddress w = handle.addresses[i].ToWire();
    std::memcpy(bytes.data() + sizeof(h) + i * sizeof(w), &w, sizeof(w));
  }
  return bytes;
}

TcpHandle DecodeHandle(const std::vector<uint8_t>& bytes) {
  HandleHeader h;
  MORI_CHECK(bytes.size() >= sizeof(h), ErrorCode::Protocol,
             "malformed TCP handle: %zu bytes, shorter than its %zu-byte header", bytes.size(), sizeof(h));
  std::memcpy(&h, bytes.data(), sizeof(h));
  MORI_CHECK(h.magic == kHandleMagic, ErrorCode::Protocol, "malformed TCP handle: bad magic 0x%08x (expected 0x%08x)",
             h.magic, kHandleMagic);
  MORI_CHECK(h.version == kWireVersion, ErrorCode::Protocol, "malformed TCP handle: version %u, this build speaks %u",
             static_cast<unsigned>(h.version), static_cast<unsigned>(kWireVersion));
  MORI_CHECK(h.count >= 1 && h.count <= kMaxChannels, ErrorCode::Protocol,
             "malformed TCP handle: %u channels, outside [1, %d]", static_cast<unsigned>(h.count), kMaxChannels);
  size_t expected = sizeof(h) + static_cast<size_t>(h.count) * sizeof(net::WireAddress);
  MORI_CHECK(bytes.size() == expected, ErrorCode::Protocol,
             "malformed TCP handle: %zu bytes, expected %zu for %u channels (%s)", bytes.size(), expected,
             static_cast<unsigned>(h.count), bytes.size() < expected ? "truncated" : "trailing bytes");
  MORI_CHECK(h.nonce != 0, ErrorCode::Protocol, "malformed TCP handle: zero connection nonce");
  MORI_CHECK(h.rank >= 0, ErrorCode::Protocol, "malformed TCP handle: rank %d", h.rank);

  TcpHandle out;
  out.nonce = h.nonce;
  out.rank = h.rank;
  for (unsigned i = 0; i < h.count; ++i) {
    net::WireAddress w;
    std::memcpy(&w, bytes.data() + sizeof(h) + i * sizeof(w), sizeof(w));
    MORI_CHECK(w.family == AF_INET || w.family == AF_INET6, ErrorCode::Protocol,
               "malformed TCP handle: channel %u has unknown address family %u", i, static_cast<unsigned>(w.family));
    MORI_CHECK(w.port != 0, ErrorCode::Protocol, "malformed TCP handle: channel %u has port 0", i);
    out.addresses.push_back(net::SocketAddress::FromWire(w));
  }
  return out;
}

FrameHeader MakeFrame(FrameType type) {
  FrameHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.type = static_cast<uint16_t>(type);
  return h;
}

const char* FrameTypeName(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::Hello:
      return "Hello";
    case FrameType::HelloAck:
      return "HelloAck";
    case FrameType::Write:
      return "Write";
    case FrameType::Update:
      return "Update";
    case FrameType::FetchAdd:
      return "FetchAdd";
    case FrameType::CompareSwap:
      return "CompareSwap";
    case FrameType::ReadRequest:
      return "ReadRequest";
    case FrameType::Ack:
      return "Ack";
    case FrameType::ReadData:
      return "ReadData";
    case FrameType::AtomicResult:
      return "AtomicResult";
    case FrameType::Fail:
      return "Fail";
    case FrameType::Close:
      return "Close";
  }
  return "unknown";
}

bool IsOrderedFrame(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::Write:
    case FrameType::Update:
    case FrameType::FetchAdd:
    case FrameType::CompareSwap:
    case FrameType::ReadRequest:
      return true;
    default:
      return false;
  }
}

std::string CheckFrame(const FrameHeader& h) {
  if (h.magic != kFrameMagic) return StrFormat("bad magic 0x%08x (not a mori TCP peer)", h.magic);
  if (h.version != kWireVersion) {
    return StrFormat("protocol version %u, this build speaks %u", static_cast<unsigned>(h.version),
                     static_cast<unsigned>(kWireVersion));
  }
  if (h.type < static_cast<uint16_t>(FrameType::Hello) || h.type > kLastFrameType) {
    return StrFormat("unknown frame type %u", static_cast<unsigned>(h.type));
  }
  const char* name = FrameTypeName(h.type);
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::Hello:
      if (h.length != sizeof(HelloPayload)) {
        return StrFormat("Hello frame of %u bytes, expected %zu", h.length, sizeof(HelloPayload));
      }
      break;
    case FrameType::Write:
    case FrameType::ReadData:
      if (h.length == 0 || h.length > kMaxChunkBytes) {
        return StrFormat("%s frame of %u bytes, outside [1, %llu]", name, h.length,
                         static_cast<unsigned long long>(kMaxChunkBytes));
      }
      break;
    case FrameType::Fail:
      if (h.length > kMaxFailReasonBytes) {
        return StrFormat("Fail frame of %u bytes, beyond the %u-byte limit", h.length, kMaxFailReasonBytes);
      }
      break;
    case FrameType::ReadRequest:
      if (h.arg0 == 0) return "ReadRequest of 0 bytes";
      if (h.arg0 > kMaxChunkBytes) {
        return StrFormat("ReadRequest of %llu bytes, beyond a chunk (%llu: reads go out a chunk at a time)",
                         static_cast<unsigned long long>(h.arg0), static_cast<unsigned long long>(kMaxChunkBytes));
      }
      if (h.length != 0) return StrFormat("ReadRequest frame carries %u payload bytes, expected none", h.length);
      break;
    default:
      if (h.length != 0) return StrFormat("%s frame carries %u payload bytes, expected none", name, h.length);
      break;
  }
  if (IsOrderedFrame(h.type) && h.seq == 0) return StrFormat("%s frame with sequence number 0", name);
  return "";
}

std::string CheckHello(const HelloPayload& hello, uint64_t myNonce, uint64_t peerNonce, int numChannels) {
  if (hello.nonce != myNonce) {
    return StrFormat("hello for connection %016llx, this listener serves %016llx (a stray or foreign connection)",
                     static_cast<unsigned long long>(hello.nonce), static_cast<unsigned long long>(myNonce));
  }
  if (hello.senderNonce != peerNonce) {
    return StrFormat("hello from connection %016llx, the peer's handle names %016llx",
                     static_cast<unsigned long long>(hello.senderNonce), static_cast<unsigned long long>(peerNonce));
  }
  if (static_cast<int>(hello.numChannels) != numChannels) {
    return StrFormat("hello for %u channels, this side has %d", hello.numChannels, numChannels);
  }
  if (hello.channel >= hello.numChannels) {
    return StrFormat("hello for channel %u of %u", hello.channel, hello.numChannels);
  }
  return "";
}

}  // namespace mori::core::tcp
