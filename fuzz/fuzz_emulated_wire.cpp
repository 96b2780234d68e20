// The emulated NIC's wire as a peer NIC (or a stranger) writes it: packet headers (CheckPacketHeader, run on
// every 64 bytes a wire connection delivers), the integrity check over a header and payload (PacketCheck), and
// the hello that admits a connection (HelloAdmits).
// Input: a u64 nonce of the receiving NIC, then 64-byte packet headers, each followed by a u8 count of payload
// bytes and those bytes; short inputs read as zeros.
#include <cstdint>
#include <string>
#include <vector>

#include "emulated/wire.hpp"
#include "fuzz_util.hpp"

namespace em = mori::rdma::emulated;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mori::fuzz::FuzzInput in(data, size);
  const auto myNonce = in.Take<uint64_t>();
  do {
    auto h = in.Take<em::PacketHeader>();
    if (em::CheckPacketHeader(h).empty()) {
      MORI_FUZZ_ASSERT(h.magic == em::kWireMagic && h.version == em::kWireVersion, "accepted a foreign header");
      MORI_FUZZ_ASSERT(em::IsRequest(h.type) || em::IsResponse(h.type) || em::IsHello(h.type), "accepted type %u",
                       h.type);
      // The receiver sizes its payload buffer from this: it must stay within the limit.
      MORI_FUZZ_ASSERT(em::PayloadBytes(h) <= em::kMaxWirePayload, "payload of %llu bytes",
                       static_cast<unsigned long long>(em::PayloadBytes(h)));
      const bool carries = h.type == static_cast<uint8_t>(em::PacketType::WriteRequest) ||
                           h.type == static_cast<uint8_t>(em::PacketType::SendRequest) ||
                           h.type == static_cast<uint8_t>(em::PacketType::ReadResponse);
      MORI_FUZZ_ASSERT(carries || em::PayloadBytes(h) == 0, "type %u carries %llu bytes", h.type,
                       static_cast<unsigned long long>(em::PayloadBytes(h)));
    }
    std::vector<uint8_t> payload(in.Take<uint8_t>());
    for (auto& byte : payload) byte = in.Take<uint8_t>();
    // A packet that passes its check fails it after any one bit of it flips (the corrupt fault's promise).
    if (em::PacketCheckPasses(h, payload.data(), payload.size())) {
      const size_t bits = (sizeof(h) + payload.size()) * 8;
      const size_t bit = static_cast<size_t>(h.icrc ^ h.raddr) % bits;
      em::PacketHeader flipped = h;
      std::vector<uint8_t> flippedPayload = payload;
      if (bit < sizeof(h) * 8) {
        reinterpret_cast<uint8_t*>(&flipped)[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      } else {
        flippedPayload[bit / 8 - sizeof(h)] ^= static_cast<uint8_t>(1u << (bit % 8));
      }
      MORI_FUZZ_ASSERT(!em::PacketCheckPasses(flipped, flippedPayload.data(), flippedPayload.size()),
                       "bit %zu flipped and the check still passed", bit);
    }
    if (em::HelloAdmits(h, myNonce)) {
      MORI_FUZZ_ASSERT(h.raddr == myNonce && h.swapAdd != 0, "admitted a hello for another NIC");
    }
  } while (in.Left() > 0);
  return 0;
}
