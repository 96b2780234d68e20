// The Connection base: what every transport's connection shares.
#include "mori/channels/connection.hpp"

#include "mori/core/format.hpp"

namespace mori::core {

Connection::~Connection() = default;

std::string Connection::Describe() const {
  return StrFormat("%s to rank %d", TransportName(GetTransport()), RemoteRank());
}

}  // namespace mori::core
