// SipHash-2-4 against the reference vectors of its authors (key 00..0f, message 00..len-1), and the properties
// the bootstrap relies on: the key changes every output, so does any change of the message.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "siphash.hpp"

namespace mori::core {
namespace {

const SipKey kReferenceKey{0x0706050403020100ull, 0x0f0e0d0c0b0a0908ull};

std::vector<uint8_t> Counting(size_t n) {
  std::vector<uint8_t> m(n);
  for (size_t i = 0; i < n; ++i) m[i] = static_cast<uint8_t>(i);
  return m;
}

TEST(SipHash, ReferenceVectors) {
  // Lengths that end on a whole word, one byte past it, one short of it, and the paper's 15-byte example.
  const struct {
    size_t length;
    uint64_t hash;
  } vectors[] = {
      {0, 0x726fdb47dd0e0e31ull}, {1, 0x74f839c593dc67fdull},  {7, 0xab0200f58b01d137ull},
      {8, 0x93f5f5799a932462ull}, {15, 0xa129ca6149be45e5ull}, {63, 0x958a324ceb064572ull},
  };
  for (const auto& v : vectors) {
    std::vector<uint8_t> m = Counting(v.length);
    EXPECT_EQ(SipHash24(kReferenceKey, m.data(), m.size()), v.hash) << v.length << " bytes";
  }
}

TEST(SipHash, EveryKeyBitAndMessageByteCounts) {
  std::vector<uint8_t> m = Counting(21);
  const uint64_t base = SipHash24(kReferenceKey, m.data(), m.size());
  for (int bit = 0; bit < 128; ++bit) {
    SipKey k = kReferenceKey;
    (bit < 64 ? k.k0 : k.k1) ^= 1ull << (bit % 64);
    EXPECT_NE(SipHash24(k, m.data(), m.size()), base) << "key bit " << bit;
  }
  for (size_t i = 0; i < m.size(); ++i) {
    std::vector<uint8_t> changed = m;
    changed[i] ^= 0x01;
    EXPECT_NE(SipHash24(kReferenceKey, changed.data(), changed.size()), base) << "message byte " << i;
  }
  // A trailing zero byte is not the same message: the length is hashed too.
  m.push_back(0);
  EXPECT_NE(SipHash24(kReferenceKey, m.data(), m.size()), base);
}

}  // namespace
}  // namespace mori::core
