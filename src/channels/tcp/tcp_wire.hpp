// Bytes the multi-channel TCP transport puts on the wire: the handle exchanged through the bootstrap (where
// each channel listens), the frames of a channel socket and the hello that binds an accepted socket to its
// channel. Fixed-size little-endian fields (mori runs on little-endian hosts only); every decoder validates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "socket.hpp"

namespace mori::core::tcp {

constexpr uint32_t kHandleMagic = 0x48544d4dU;  // "MMTH" in memory order
constexpr uint32_t kFrameMagic = 0x46544d4dU;   // "MMTF"
constexpr uint16_t kWireVersion = 1;
constexpr int kMaxChannels = 64;
// A frame's payload is at most one chunk; chunks are capped so that a corrupt length cannot make a receiver
// wait for gigabytes.
constexpr uint64_t kMinChunkBytes = 64;
constexpr uint64_t kMaxChunkBytes = 64ull << 20;
constexpr uint32_t kMaxFailReasonBytes = 4096;

// ---- handle: the listening addresses of one side's channels ----

struct HandleHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t count;  // channels, each with one net::WireAddress after the header
  uint64_t nonce;  // this side's connection nonce: a hello must carry it to be accepted
  int32_t rank;
  uint32_t reserved;
};
static_assert(sizeof(HandleHeader) == 24, "HandleHeader is 24 bytes on the wire");

struct TcpHandle {
  uint64_t nonce = 0;
  int rank = -1;
  std::vector<net::SocketAddress> addresses;  // one per channel
};

std::vector<uint8_t> EncodeHandle(const TcpHandle& handle);
// Throws Error(Protocol) naming the problem: short or trailing bytes, bad magic or version, a count outside
// [1, kMaxChannels], a zero nonce, an entry with an unknown family or port 0.
TcpHandle DecodeHandle(const std::vector<uint8_t>& bytes);

// ---- frames on a channel socket ----

enum class FrameType : uint16_t {
  Hello = 1,          // connector -> acceptor, first on every channel: a HelloPayload
  HelloAck = 2,       // acceptor -> connector: the channel is accepted
  Write = 3,          // ordered: `length` bytes for [offset, + length) of memory `key`
  Update = 4,         // ordered: the 8-byte word at key/offset takes `arg0`
  FetchAdd = 5,       // ordered: adds `arg0` to the word at key/offset; answered by AtomicResult `id`
  CompareSwap = 6,    // ordered: word == arg0 ? arg1 : unchanged; answered by AtomicResult `id`
  ReadRequest = 7,    // ordered: `arg0` bytes of key/offset, answered by ReadData frames of request `id`
  Ack = 8,            // every ordered frame of this channel up to `seq` is applied at the receiver
  ReadData = 9,       // `length` bytes of read `id` at `offset` within the read
  AtomicResult = 10,  // the old value `arg0` of atomic `id`
  Fail = 11,          // the sender failed the connection; the payload is why
  Close = 12,         // the sender closes the connection in order
};
constexpr uint16_t kLastFrameType = static_cast<uint16_t>(FrameType::Close);

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t key;     // memory key of the target (Write, Update, atomics, ReadRequest)
  uint32_t length;  // payload bytes after the header
  uint64_t offset;  // into the key's memory; ReadData: into the read
  uint64_t seq;     // ordered frames: this channel's sequence number from 1; Ack: the last one applied
  uint64_t id;      // request id (atomics, ReadRequest, ReadData, AtomicResult)
  uint64_t before;  // Update, atomics, ReadRequest: Write chunks issued before it, over all channels
  uint64_t arg0;
  uint64_t arg1;
};
static_assert(sizeof(FrameHeader) == 64, "FrameHeader is 64 bytes on the wire");

struct HelloPayload {
  uint64_t nonce;        // the acceptor's nonce, learned from its handle
  uint64_t senderNonce;  // the connector's own nonce, as in its handle
  uint32_t channel;
  uint32_t numChannels;
  int32_t rank;
  uint32_t reserved;
};
static_assert(sizeof(HelloPayload) == 32, "HelloPayload is 32 bytes on the wire");

FrameHeader MakeFrame(FrameType type);
const char* FrameTypeName(uint16_t type);
bool IsOrderedFrame(uint16_t type);

// Empty when `h` is a well-formed frame of this version (magic, version, type, and a length that fits its
// type), else the reason it is not.
std::string CheckFrame(const FrameHeader& h);

// Empty when `hello` is addressed to this acceptor (nonce), comes from the peer whose handle was received
// (senderNonce) and names a channel it has, else the reason.
std::string CheckHello(const HelloPayload& hello, uint64_t myNonce, uint64_t peerNonce, int numChannels);

}  // namespace mori::core::tcp
