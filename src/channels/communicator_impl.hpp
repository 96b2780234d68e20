// The communicator's state, shared with the connection makers of each transport.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>

#include "mori/core/bootstrap.hpp"
#include "mori/core/communicator.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/rdma/rdma.hpp"

namespace mori::core {

// Bootstrap tags of the communicator's exchanges: kind and the user's tag (< 2^24) in one non-negative int.
enum class CommTagKind : int { Memory = 1, Connect = 2, Semaphore = 3, Tcp = 4, Rdma = 5 };
constexpr int kMaxUserTag = (1 << 24) - 1;
int CommTag(CommTagKind kind, int userTag);

struct Communicator::Impl {
  std::shared_ptr<Bootstrap> bootstrap;
  HostTopology topology;
  std::unique_ptr<FdChannel> fdChannel;
  std::mutex mutex;

  // NIC device contexts by transport slot (registered_memory_impl.hpp), made on first use. IBn is the n-th
  // NIC of the IBVerbs backend, or the emulated NIC when this machine has none.
  std::map<int, std::unique_ptr<rdma::RdmaContext>> rdmaContexts;  // by rdma::RdmaBackendType
  std::map<int, rdma::RdmaDeviceContext*> nics;                    // by slot
  rdma::RdmaDeviceContext* Nic(Transport transport);
};

// Connection makers per transport: called by Communicator::Connect with the bootstrap tag of this exchange.
std::shared_future<std::shared_ptr<Connection>> ConnectCudaIpc(Communicator::Impl& comm, const EndpointConfig& config,
                                                               int remoteRank, int tag, int bootstrapTag);
std::shared_future<std::shared_ptr<Connection>> ConnectRdma(Communicator::Impl& comm, const EndpointConfig& config,
                                                            int remoteRank, int tag, int bootstrapTag);
std::shared_future<std::shared_ptr<Connection>> ConnectTcp(Communicator::Impl& comm, const EndpointConfig& config,
                                                           int remoteRank, int tag, int bootstrapTag);

}  // namespace mori::core
