#include "faults.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "mori/core/errors.hpp"
#include "mori/core/format.hpp"

namespace mori::rdma::emulated {

namespace {

constexpr uint32_t kMaxFaultDelayUs = 10'000'000;  // a packet delayed longer than 10 s is a lost one
constexpr uint32_t kMaxAckTimeoutMs = 3'600'000;

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t FaultDraw::Next() {
  state_ += 0x9e3779b97f4a7c15ull;
  return Mix(state_);
}

uint64_t NicFaultSeed(uint64_t specSeed, uint64_t processSalt, uint64_t nicIndex) {
  return Mix(Mix(specSeed) ^ Mix(processSalt << 16 | (nicIndex & 0xffff)));
}

EmulatedNicFaults ParseFaultSpec(const std::string& text, const char* what) {
  EmulatedNicFaults f;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string field = text.substr(pos, end - pos);
    pos = end + 1;
    if (field.empty()) continue;
    const size_t eq = field.find('=');
    MORI_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < field.size(), core::ErrorCode::InvalidUsage,
               "%s='%s': field '%s' is not name=value (names: seed, drop, corrupt, reorder, delay_us, ack_timeout_ms)",
               what, text.c_str(), field.c_str());
    const std::string name = field.substr(0, eq);
    const std::string value = field.substr(eq + 1);
    char* stop = nullptr;
    errno = 0;
    if (name == "seed" || name == "delay_us" || name == "ack_timeout_ms") {
      const unsigned long long v = std::strtoull(value.c_str(), &stop, 10);
      const bool ok = errno == 0 && *stop == '\0' && value[0] != '-' &&
                      (name == "seed" || (name == "delay_us" ? v <= kMaxFaultDelayUs : v <= kMaxAckTimeoutMs));
      MORI_CHECK(ok, core::ErrorCode::InvalidUsage, "%s='%s': field '%s' is not %s", what, text.c_str(), field.c_str(),
                 name == "seed"       ? "an unsigned integer"
                 : name == "delay_us" ? "a number of microseconds in [0, 10000000]"
                                      : "a number of milliseconds in [0, 3600000]");
      if (name == "seed") {
        f.seed = v;
      } else if (name == "delay_us") {
        f.delayUsMax = static_cast<uint32_t>(v);
      } else {
        f.ackTimeoutMs = static_cast<uint32_t>(v);
      }
    } else if (name == "drop" || name == "corrupt" || name == "reorder") {
      const double p = std::strtod(value.c_str(), &stop);
      MORI_CHECK(errno == 0 && *stop == '\0' && std::isfinite(p) && p >= 0 && p <= 1, core::ErrorCode::InvalidUsage,
                 "%s='%s': field '%s' is not a probability in [0, 1]", what, text.c_str(), field.c_str());
      (name == "drop" ? f.drop : name == "corrupt" ? f.corrupt : f.reorder) = p;
    } else {
      MORI_THROW(core::ErrorCode::InvalidUsage,
                 "%s='%s': unknown field '%s' (names: seed, drop, corrupt, reorder, delay_us, ack_timeout_ms)", what,
                 text.c_str(), field.c_str());
    }
  }
  return f;
}

std::string FaultSpecString(const EmulatedNicFaults& f) {
  return core::StrFormat("drop=%g,corrupt=%g,reorder=%g,delay_us=%u,ack_timeout_ms=%u", f.drop, f.corrupt, f.reorder,
                         f.delayUsMax, f.ackTimeoutMs);
}

}  // namespace mori::rdma::emulated
