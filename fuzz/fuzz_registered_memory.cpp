// RegisteredMemory's wire format, as a peer's SendMemory delivers it: ParseRegisteredMemory must either accept
// the bytes or throw mori's Error, and every accepted input must be the canonical encoding of what was parsed
// (SerializeRegisteredMemory(Parse(x)) == x): two encodings of one memory would let a forged one pass checks
// that look at the bytes.
#include <cstdint>
#include <memory>
#include <vector>

#include "fuzz_util.hpp"
#include "mori/core/errors.hpp"
#include "registered_memory_impl.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);
  std::shared_ptr<mori::core::RegisteredMemory::Impl> m;
  try {
    m = mori::core::ParseRegisteredMemory(bytes);
  } catch (const mori::core::Error&) {
    return 0;  // refused with a named reason
  }
  MORI_FUZZ_ASSERT(m != nullptr, "accepted bytes gave no memory");
  MORI_FUZZ_ASSERT(m->size > 0 && m->originalData != nullptr, "accepted an empty registration");
  MORI_FUZZ_ASSERT(!m->transports.Empty(), "accepted memory with no transport");
  std::vector<uint8_t> again = mori::core::SerializeRegisteredMemory(*m);
  size_t firstDiff = 0;
  while (firstDiff < again.size() && firstDiff < bytes.size() && again[firstDiff] == bytes[firstDiff]) ++firstDiff;
  MORI_FUZZ_ASSERT(again == bytes, "round trip changed the bytes: %zu in, %zu out, first difference at %zu",
                   bytes.size(), again.size(), firstDiff);
  return 0;
}
