// Device enumeration of each backend, called by RdmaContext.
#pragma once

#include <memory>
#include <vector>

#include "mori/rdma/rdma.hpp"

namespace mori::rdma {

std::vector<std::unique_ptr<RdmaDevice>> EnumerateEmulatedDevices();
// NICs that rdma-core sees; `direct`: only those the GPU can drive (mlx5 through mlx5dv). Empty, with a log
// line saying why, when rdma-core or a device is missing.
std::vector<std::unique_ptr<RdmaDevice>> EnumerateVerbsDevices(bool direct);

}  // namespace mori::rdma
