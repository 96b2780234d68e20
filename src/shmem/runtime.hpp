// The SHMEM runtime of one process: bootstrap, symmetric heap, per-peer transports and the device state
// that kernels read. One instance between ShmemInit and ShmemFinalize.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/core/ipc_memory.hpp"
#include "mori/rdma/rdma.hpp"
#include "mori/shmem/shmem_device_state.hpp"
#include "mori/shmem/shmem_types.hpp"
#include "shmem_proxy.hpp"
#include "symmetric_heap.hpp"

namespace mori::shmem {

class Runtime {
 public:
  explicit Runtime(std::shared_ptr<core::Bootstrap> bootstrap);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int Rank() const { return rank_; }
  int NPes() const { return nPes_; }
  core::Bootstrap& Bootstrap() { return *bootstrap_; }
  const ShmemDeviceState& State() const { return state_; }
  TransportType Transport(int pe) const;
  void* HeapBase() const { return heap_.Data(); }
  size_t HeapBytes() const { return heapBytes_; }
  void* PeerPointer(const void* dest, int pe) const;

  // Collective.
  void* Allocate(size_t bytes, size_t alignment, bool zero);
  void Free(void* ptr);
  void Barrier();

  void RegisterBuffer(void* ptr, size_t bytes);
  void UnregisterBuffer(void* ptr);

  // Collective teardown (a barrier first, so nobody still writes into memory about to go).
  void Finalize();

 private:
  void ChooseTransports();
  void SetUpRdma();
  void SetUpProxy(int device);
  void BuildDeviceState();
  void UploadLocalRegions();

  std::shared_ptr<core::Bootstrap> bootstrap_;
  int rank_ = 0;
  int nPes_ = 1;
  size_t heapBytes_ = 0;
  uint32_t qpsPerPe_ = 1;
  core::HostTopology topology_;
  std::unique_ptr<core::FdChannel> fdChannel_;
  core::GpuBuffer heap_;
  std::vector<std::shared_ptr<core::IpcMemoryMapping>> peerHeaps_;
  std::vector<TransportType> transports_;
  std::vector<uintptr_t> peerBases_;
  std::vector<uintptr_t> remoteBases_;
  std::vector<uint32_t> rkeys_;
  bool nicAtomics_ = false;

  // RDMA: one endpoint per (peer, qp); to itself a loopback pair (the second end only answers).
  std::unique_ptr<rdma::RdmaContext> rdmaContext_;
  rdma::RdmaDeviceContext* nic_ = nullptr;
  std::vector<rdma::RdmaEndpoint> endpoints_;  // [pe * qps + q], empty handle where unused
  std::vector<rdma::RdmaEndpoint> loopbackPeers_;
  rdma::RdmaMemoryRegion heapRegion_{};
  std::vector<ShmemLocalRegion> localRegions_;

  // Device-visible arrays the state points into.
  core::GpuBuffer control_;
  ShmemLocalRegion* deviceLocalRegions_ = nullptr;
  ShmemDeviceState state_{};

  // Proxy transport (when any PE uses it): connections to every PE over one channel transport, and the
  // thread that executes the kernels' requests on them. Declared last: stopped before the heap goes.
  core::Transport proxyConn_ = core::Transport::Unknown;
  std::unique_ptr<core::Communicator> comm_;
  core::GpuBuffer proxyScratch_;
  std::unique_ptr<ShmemProxy> proxy_;

  std::mutex mutex_;
  SymmetricAllocator allocator_;
  bool finalized_ = false;
};

// Installs `state` for kernels: the library's own copy (HOST) and every registered translation unit (GPU).
void PublishDeviceState(const ShmemDeviceState& state);

}  // namespace mori::shmem
