// Links mori::channels alone: a communicator over a bootstrap of one, memory registered for the TCP transport
// and sent to itself. Started with a clean environment, it loads only through the installed run paths.
#include <cstdio>
#include <vector>

#include "mori/channels/communicator.hpp"
#include "mori/core/config.hpp"
#include "mori/core/launch.hpp"

int main() {
  using namespace mori::core;
  Communicator comm(CreateBootstrapFromEnvironment(10));
  if (comm.Rank() != 0 || comm.NRanks() != 1) return 1;
  std::vector<char> buf(4096, 'm');
  RegisteredMemory local = comm.RegisterMemory(buf.data(), buf.size(), Transport::Tcp);
  comm.SendMemory(local, 0);
  RegisteredMemory back = comm.RecvMemory(0).get();
  if (back.Size() != buf.size() || !back.Transports().Has(Transport::Tcp)) return 2;
  std::printf("channels consumer of mori %s (%s backend): %s memory of %zu bytes, ok\n", MORI_VERSION_STRING,
              MORI_BACKEND_NAME, TransportName(Transport::Tcp), back.Size());
  return 0;
}
