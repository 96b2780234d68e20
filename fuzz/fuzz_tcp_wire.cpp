// The multi-channel TCP transport's bytes from a peer: the handle that comes through the bootstrap
// (DecodeHandle), a channel's frame headers (CheckFrame) and the hello that binds an accepted socket (CheckHello).
// Input: u16 handle length, the handle's bytes, then 64-byte frame headers until 32 bytes are left for a hello.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "mori/core/errors.hpp"
#include "tcp/tcp_wire.hpp"

namespace tcp = mori::core::tcp;

namespace {

void CheckAcceptedFrame(const tcp::FrameHeader& h) {
  MORI_FUZZ_ASSERT(h.magic == tcp::kFrameMagic && h.version == tcp::kWireVersion, "accepted a foreign frame");
  MORI_FUZZ_ASSERT(h.type >= 1 && h.type <= tcp::kLastFrameType, "accepted type %u", static_cast<unsigned>(h.type));
  MORI_FUZZ_ASSERT(h.length <= tcp::kMaxChunkBytes, "accepted a %u-byte payload", h.length);
  auto type = static_cast<tcp::FrameType>(h.type);
  if (type == tcp::FrameType::Hello) MORI_FUZZ_ASSERT(h.length == sizeof(tcp::HelloPayload), "hello of %u", h.length);
  if (type == tcp::FrameType::Fail) MORI_FUZZ_ASSERT(h.length <= tcp::kMaxFailReasonBytes, "fail of %u", h.length);
  if (type == tcp::FrameType::ReadRequest) {
    MORI_FUZZ_ASSERT(h.arg0 > 0 && h.arg0 <= tcp::kMaxChunkBytes, "read of %llu",
                     static_cast<unsigned long long>(h.arg0));
  }
  if (tcp::IsOrderedFrame(h.type)) MORI_FUZZ_ASSERT(h.seq != 0, "ordered frame with sequence 0");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mori::fuzz::FuzzInput in(data, size);
  size_t handleBytes = in.Take<uint16_t>();
  if (handleBytes > in.Left()) handleBytes = in.Left();
  std::vector<uint8_t> handle(in.Rest(), in.Rest() + handleBytes);
  for (size_t i = 0; i < handleBytes; ++i) in.Take<uint8_t>();

  uint64_t peerNonce = 0;
  int numChannels = 0;
  try {
    tcp::TcpHandle h = tcp::DecodeHandle(handle);
    MORI_FUZZ_ASSERT(h.nonce != 0 && h.rank >= 0, "accepted nonce %llu rank %d",
                     static_cast<unsigned long long>(h.nonce), h.rank);
    MORI_FUZZ_ASSERT(!h.addresses.empty() && h.addresses.size() <= tcp::kMaxChannels, "accepted %zu channels",
                     h.addresses.size());
    // What was decoded encodes to bytes that decode to the same handle.
    tcp::TcpHandle again = tcp::DecodeHandle(tcp::EncodeHandle(h));
    MORI_FUZZ_ASSERT(again.nonce == h.nonce && again.rank == h.rank && again.addresses.size() == h.addresses.size(),
                     "re-encoded handle differs");
    for (size_t i = 0; i < h.addresses.size(); ++i) {
      MORI_FUZZ_ASSERT(again.addresses[i].ToString() == h.addresses[i].ToString(), "channel %zu: %s became %s", i,
                       h.addresses[i].ToString().c_str(), again.addresses[i].ToString().c_str());
    }
    peerNonce = h.nonce;
    numChannels = static_cast<int>(h.addresses.size());
  } catch (const mori::core::Error&) {
    // Expected: a malformed handle fails the connection with a named reason.
  }

  while (in.Left() > sizeof(tcp::HelloPayload)) {
    auto frame = in.Take<tcp::FrameHeader>();
    if (tcp::CheckFrame(frame).empty()) CheckAcceptedFrame(frame);
  }
  auto hello = in.Take<tcp::HelloPayload>();
  const uint64_t myNonce = hello.nonce ^ (size & 1);  // odd sizes try a hello for another listener
  if (tcp::CheckHello(hello, myNonce, peerNonce, numChannels).empty()) {
    MORI_FUZZ_ASSERT(hello.nonce == myNonce && hello.senderNonce == peerNonce, "accepted a stray hello");
    MORI_FUZZ_ASSERT(static_cast<int>(hello.numChannels) == numChannels && hello.channel < hello.numChannels,
                     "accepted channel %u of %u (side has %d)", hello.channel, hello.numChannels, numChannels);
  }
  return 0;
}
