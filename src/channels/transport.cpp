// Transport names (parsing them back, case-insensitively) and the printable form of a set of transports.
#include "mori/channels/transport.hpp"

#include <cctype>

namespace mori::core {

const char* TransportName(Transport t) {
  switch (t) {
    case Transport::Unknown:
      return "Unknown";
    case Transport::CudaIpc:
      return "CudaIpc";
    case Transport::IB0:
      return "IB0";
    case Transport::IB1:
      return "IB1";
    case Transport::IB2:
      return "IB2";
    case Transport::IB3:
      return "IB3";
    case Transport::IB4:
      return "IB4";
    case Transport::IB5:
      return "IB5";
    case Transport::IB6:
      return "IB6";
    case Transport::IB7:
      return "IB7";
    case Transport::Tcp:
      return "Tcp";
    case Transport::Emulated:
      return "Emulated";
  }
  return "?";
}

std::optional<Transport> ParseTransport(const std::string& text) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (int i = 1; i < kNumTransports; ++i) {
    std::string name;
    for (const char* p = TransportName(static_cast<Transport>(i)); *p != '\0'; ++p) {
      name += static_cast<char>(std::tolower(static_cast<unsigned char>(*p)));
    }
    if (name == lower) return static_cast<Transport>(i);
  }
  return std::nullopt;
}

std::string TransportFlags::ToString() const {
  std::string s;
  for (int i = 1; i < kNumTransports; ++i) {
    if (!Has(static_cast<Transport>(i))) continue;
    if (!s.empty()) s += "|";
    s += TransportName(static_cast<Transport>(i));
  }
  return s.empty() ? "none" : s;
}

}  // namespace mori::core
