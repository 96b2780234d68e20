// The SHMEM runtime of one process: bootstrap, symmetric heap, per-peer transports and the device state
// that kernels read. One instance between ShmemInit and ShmemFinalize.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
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

// The MORI_SHMEM_TRANSPORT choice that index `index` stands for in what PEs exchange at init ("auto", "p2p",
// "rdma", "proxy"); a value outside them (a peer's corrupt or hostile bytes) gets "an unknown choice".
const char* TransportChoiceName(int32_t index);

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
  void QuietAndSynchronize();

  // Teams (ShmemTeam is the slot in teams_). Split is collective over the parent; the queries answer -1 for
  // what is not a team (or not a member).
  ShmemTeam SplitStrided(ShmemTeam parent, int start, int stride, int size);
  void DestroyTeam(ShmemTeam team);
  void TeamSync(ShmemTeam team);
  int TeamMyPe(ShmemTeam team) const;
  int TeamNPes(ShmemTeam team) const;
  int TeamTranslatePe(ShmemTeam from, int pe, ShmemTeam to) const;

  // Whether kernels of this PE may use [p, p + bytes) as the local side of an operation with `pe`: always over
  // Self and P2P (loads and stores), else only inside the heap or a registered buffer (the NIC or the proxy
  // reads and writes it).
  bool LocalReachable(const void* p, size_t bytes, int pe);

  void RegisterBuffer(void* ptr, size_t bytes);
  void UnregisterBuffer(void* ptr);

  // Collective teardown (a barrier first, so nobody still writes into memory about to go). Kernels of this PE
  // that are still running after MORI_TIMEOUT_S make it throw a TimeoutError before anything is freed or
  // cleared, and KernelsMayStillRun() then says so: the runtime must not be destroyed.
  void Finalize();
  bool KernelsMayStillRun() const { return kernelsMayRun_; }

 private:
  void ChooseTransports();
  void SetUpRdma();
  void SetUpProxy(int device);
  void BuildDeviceState();
  void UploadLocalRegions();
  struct Team {
    std::vector<int> members;  // world PEs, ascending; empty: the slot is free
    int myIndex = -1;          // -1: this PE is not a member (it then holds no team in the slot)
    ShmemTeamState state{};    // what kernels see, with `members` pointing at the vector above
  };
  const Team* TeamAt(ShmemTeam team) const;
  // Puts `members` into slot `id` here and for kernels (its sync counters start again at zero).
  void InstallTeam(uint32_t id, std::vector<int> members);
  // Gather to the team's first member and release, over the bootstrap: every member has arrived.
  void TeamBarrier(const std::vector<int>& members, int tag);

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
  ShmemTeamState* deviceTeams_ = nullptr;   // [kShmemMaxTeams]
  int32_t* deviceTeamMembers_ = nullptr;    // [kShmemMaxTeams][nPes]
  std::vector<Team> teams_;                 // [kShmemMaxTeams]
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
  bool kernelsMayRun_ = false;
};

// Installs `state` for kernels: the library's own copy (HOST) and every registered translation unit (GPU).
void PublishDeviceState(const ShmemDeviceState& state);

namespace detail {
// Why this process's device code cannot take the state (an uploader of another layout is registered), or "".
std::string RefusedUploaderError();
}  // namespace detail

}  // namespace mori::shmem
