// The socket bootstrap's bytes from other processes: the unique id (DecodeId, through UniqueIdAddress, which
// every non-root rank runs on the id it was handed), a frame header (CheckHeader) and a hello (CheckHello).
// Input: 128 id bytes, a 24-byte frame header, a 48-byte hello, 4 bytes of world size; short inputs read as zeros.
#include <cstdint>
#include <cstring>
#include <string>

#include "bootstrap_wire.hpp"
#include "fuzz_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"

namespace bw = mori::core::bootstrap_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mori::fuzz::FuzzInput in(data, size);
  auto id = in.Take<mori::core::UniqueId>();
  auto header = in.Take<bw::FrameHeader>();
  auto hello = in.Take<bw::HelloPayload>();
  auto nRanks = in.Take<int32_t>();

  uint64_t nonce = 0;
  try {
    std::string address = mori::core::SocketBootstrap::UniqueIdAddress(id);
    MORI_FUZZ_ASSERT(!address.empty(), "an accepted id names an address");
    bw::UniqueIdLayout layout;
    std::memcpy(&layout, id.bytes, sizeof(layout));
    MORI_FUZZ_ASSERT(layout.magic == bw::kUniqueIdMagic && layout.version == bw::kVersion, "magic 0x%08x",
                     layout.magic);
    nonce = layout.nonce;
  } catch (const mori::core::Error&) {
    // Expected for malformed ids: the rank stops with a named error.
  }

  std::string bad = bw::CheckHeader(header);
  if (bad.empty()) {
    MORI_FUZZ_ASSERT(header.magic == bw::kFrameMagic && header.version == bw::kVersion, "accepted a foreign header");
    MORI_FUZZ_ASSERT(header.length <= bw::kMaxPayload, "accepted length %llu",
                     static_cast<unsigned long long>(header.length));
    MORI_FUZZ_ASSERT(std::string(bw::FrameTypeName(header.type)) != "unknown", "accepted type %u",
                     static_cast<unsigned>(header.type));
    MORI_FUZZ_ASSERT(
        header.type != static_cast<uint16_t>(bw::FrameType::Hello) || header.length == sizeof(bw::HelloPayload),
        "accepted a hello of %llu bytes", static_cast<unsigned long long>(header.length));
  }

  if (nRanks > 0) {
    bad = bw::CheckHello(hello, nonce, nRanks);
    if (bad.empty()) {
      MORI_FUZZ_ASSERT(hello.nonce == nonce, "accepted another job's nonce");
      MORI_FUZZ_ASSERT(hello.rank >= 0 && hello.rank < nRanks, "accepted rank %d of %d", hello.rank, nRanks);
    }
  }
  return 0;
}
