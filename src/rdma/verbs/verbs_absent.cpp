// Built when rdma-core's headers were missing at build time: the real-NIC backends report no device.
#include "../backends.hpp"
#include "mori/core/logging.hpp"

namespace mori::rdma {

std::vector<std::unique_ptr<RdmaDevice>> EnumerateVerbsDevices(bool direct) {
  MORI_LOG_INFO(Rdma, "%s: no devices: mori was built without rdma-core's headers (libibverbs-dev)",
                direct ? "DirectVerbs" : "IBVerbs");
  return {};
}

}  // namespace mori::rdma
