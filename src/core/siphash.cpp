#include "siphash.hpp"

#include <cstring>

namespace mori::core {

namespace {

constexpr uint64_t Rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

struct SipState {
  uint64_t v0, v1, v2, v3;

  void Round() {
    v0 += v1;
    v1 = Rotl(v1, 13) ^ v0;
    v0 = Rotl(v0, 32);
    v2 += v3;
    v3 = Rotl(v3, 16) ^ v2;
    v0 += v3;
    v3 = Rotl(v3, 21) ^ v0;
    v2 += v1;
    v1 = Rotl(v1, 17) ^ v2;
    v2 = Rotl(v2, 32);
  }

  // "2" of SipHash-2-4: two rounds per message word.
  void Absorb(uint64_t m) {
    v3 ^= m;
    Round();
    Round();
    v0 ^= m;
  }
};

}  // namespace

uint64_t SipHash24(const SipKey& key, const void* data, size_t bytes) {
  // The initial constants are the ASCII of "somepseudorandomlygeneratedbytes", as the specification fixes them.
  SipState s{key.k0 ^ 0x736f6d6570736575ull, key.k1 ^ 0x646f72616e646f6dull, key.k0 ^ 0x6c7967656e657261ull,
             key.k1 ^ 0x7465646279746573ull};
  const auto* p = static_cast<const uint8_t*>(data);
  size_t whole = bytes & ~size_t{7};
  for (size_t i = 0; i < whole; i += 8) {
    uint64_t m;
    std::memcpy(&m, p + i, 8);  // little-endian hosts only (atomic.hpp checks)
    s.Absorb(m);
  }
  // The last word: the 0 to 7 bytes left, and the message length (mod 256) in the top byte.
  uint64_t last = static_cast<uint64_t>(bytes & 0xff) << 56;
  for (size_t i = whole; i < bytes; ++i) last |= static_cast<uint64_t>(p[i]) << (8 * (i - whole));
  s.Absorb(last);
  // "4": four finalization rounds.
  s.v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) s.Round();
  return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

}  // namespace mori::core
