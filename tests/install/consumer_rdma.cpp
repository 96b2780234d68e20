// Links mori::rdma alone (mori::core comes through it): configuration, environment registry, a bootstrap of
// one, the emulated NIC. Started with a clean environment, it loads only through the installed run paths.
#include <cstdio>

#include "mori/core/bootstrap.hpp"
#include "mori/core/config.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/launch.hpp"
#include "mori/rdma/rdma.hpp"

int main() {
  auto bootstrap = mori::core::CreateBootstrapFromEnvironment(10);
  auto values = bootstrap->AllGatherValue(41 + 1);
  if (bootstrap->GetNranks() != 1 || values.at(0) != 42) return 1;
  try {
    mori::core::EnvGetInt("MORI_NOT_A_VARIABLE");
    return 2;
  } catch (const mori::core::Error&) {
  }
  mori::rdma::RdmaContext rdma(mori::rdma::RdmaBackendType::Emulated);
  if (rdma.GetRdmaDeviceList().size() != 1) return 3;
  std::printf("rdma consumer of mori %s (%s backend): %zu registered variables, ok\n", MORI_VERSION_STRING,
              MORI_BACKEND_NAME, mori::core::EnvRegistry().size());
  return 0;
}
