#include "runtime.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <future>
#include <string>

#include "mori/core/copy_stream.hpp"
#include "mori/core/device.hpp"
#include "mori/core/device_sync.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/format.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"
#include "mori/core/timeout.hpp"
#include "mori/rdma/emulated.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "stream_ops.hpp"

namespace mori::shmem {

using core::ErrorCode;

namespace {

// What every PE tells the others at init.
struct PeInfo {
  uint64_t heapBytes;
  uint64_t heapBase;
  int32_t device;
  int32_t transportChoice;  // index into kTransportChoices
  uint32_t qpsPerPe;
  uint32_t gpuPosts;  // 1: this PE's NIC lets the GPU post (IBGDA: a real mlx5 through DirectVerbs, or emulated)
  uint32_t refused;   // 1: device code of another layout is registered here (detail::RefusedUploaderError)
};

const char* const kTransportChoices[] = {"auto", "p2p", "rdma", "proxy"};

constexpr int32_t kTransportChoiceCount = sizeof(kTransportChoices) / sizeof(kTransportChoices[0]);

int TransportChoiceIndex(const std::string& choice) {
  for (int i = 0; i < kTransportChoiceCount; ++i) {
    if (choice == kTransportChoices[i]) return i;
  }
  return 0;
}

// Where the device-visible control words live: one allocation, carved.
struct ControlLayout {
  size_t transports, peerBases, remoteBases, rkeys, queues, fetchTicket, fetchTurn, barrierSeq, localRegions, teams,
      teamMembers, teamSyncSeq, total;
};

ControlLayout LayOutControl(int nPes, uint32_t qps) {
  auto n = static_cast<size_t>(nPes);
  ControlLayout l{};
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    size_t here = (at + 63) / 64 * 64;
    at = here + bytes;
    return here;
  };
  l.transports = take(n);
  l.peerBases = take(n * sizeof(uintptr_t));
  l.remoteBases = take(n * sizeof(uintptr_t));
  l.rkeys = take(n * sizeof(uint32_t));
  l.queues = take(n * qps * sizeof(ShmemQueuePair));
  l.fetchTicket = take(sizeof(uint32_t));
  l.fetchTurn = take(kShmemFetchSlots * sizeof(uint32_t));
  l.barrierSeq = take(sizeof(uint64_t));
  l.localRegions = take(kShmemMaxLocalRegions * sizeof(ShmemLocalRegion));
  l.teams = take(kShmemMaxTeams * sizeof(ShmemTeamState));
  l.teamMembers = take(kShmemMaxTeams * n * sizeof(int32_t));
  l.teamSyncSeq = take(kShmemMaxTeams * sizeof(uint64_t));
  l.total = (at + 4095) / 4096 * 4096;
  return l;
}

size_t HeapBytesFromEnvironment() {
  size_t bytes = core::EnvGetSize("MORI_SHMEM_HEAP_SIZE");
  MORI_CHECK(bytes >= 2 * kShmemHeapUserOffset, ErrorCode::InvalidUsage,
             "MORI_SHMEM_HEAP_SIZE=%zu is too small (at least %llu bytes)", bytes,
             static_cast<unsigned long long>(2 * kShmemHeapUserOffset));
  return bytes;
}

}  // namespace

const char* TransportChoiceName(int32_t index) {
  return index >= 0 && index < kTransportChoiceCount ? kTransportChoices[index] : "an unknown choice";
}

Runtime::Runtime(std::shared_ptr<core::Bootstrap> bootstrap)
    : bootstrap_(std::move(bootstrap)),
      heapBytes_(HeapBytesFromEnvironment()),
      allocator_(kShmemHeapUserOffset, heapBytes_) {
  rank_ = bootstrap_->GetRank();
  nPes_ = bootstrap_->GetNranks();
  topology_ = core::DiscoverHostTopology(*bootstrap_);

  int gpus = 0;
  MORI_CHECK_GPU(core::GpuGetDeviceCount(&gpus));
  MORI_CHECK(gpus > 0, ErrorCode::NotSupported, "PE %d: no GPU visible", rank_);
  if (gpus > 1) MORI_CHECK_GPU(core::GpuSetDevice(topology_.localRank % gpus));
  int device = 0;
  MORI_CHECK_GPU(core::GpuGetDevice(&device));
  // The proxies' and the emulated NIC's copies get their stream now, among the process's first (so on a
  // hardware queue of its own unless the application makes more streams than CUDA has queues).
  (void)core::HostCopyStream(device);

  int64_t qps = core::EnvGetInt("MORI_SHMEM_QPS_PER_PE");
  MORI_CHECK(qps >= 1 && qps <= 64, ErrorCode::InvalidUsage, "MORI_SHMEM_QPS_PER_PE=%lld is not in [1, 64]",
             static_cast<long long>(qps));
  qpsPerPe_ = static_cast<uint32_t>(qps);

  heap_ = core::GpuBuffer(heapBytes_, core::MemoryType::Device);
  MORI_CHECK_GPU(core::GpuMemset(heap_.Data(), 0, kShmemHeapUserOffset));
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());

  const std::string choice = core::EnvGetChoice("MORI_SHMEM_TRANSPORT");
  bool everyPeHere = true;
  for (int pe = 0; pe < nPes_; ++pe) everyPeHere = everyPeHere && topology_.SameHost(pe);
  // Only auto with peers on other hosts asks which RDMA backend runs (a host-posting one means Proxy).
  uint32_t gpuPosts = 1;
  if (choice == "auto" && !everyPeHere) {
    gpuPosts = rdma::RdmaBackendFromEnvironment() != rdma::RdmaBackendType::IBVerbs ? 1u : 0u;
  }
  // Device code of another layout makes this PE fail where it publishes the state; told here, every PE fails
  // with it instead of waiting at the next collective step for one that left.
  const std::string refused = detail::RefusedUploaderError();
  PeInfo mine{heapBytes_,
              reinterpret_cast<uintptr_t>(heap_.Data()),
              device,
              TransportChoiceIndex(choice),
              qpsPerPe_,
              gpuPosts,
              refused.empty() ? 0u : 1u};
  auto all = bootstrap_->AllGatherValue(mine);
  MORI_CHECK(refused.empty(), ErrorCode::InvalidUsage, "PE %d: %s", rank_, refused.c_str());
  for (int pe = 0; pe < nPes_; ++pe) {
    const PeInfo& p = all[static_cast<size_t>(pe)];
    MORI_CHECK(p.refused == 0, ErrorCode::InvalidUsage,
               "PE %d cannot take the SHMEM state: device code compiled against other mori headers is registered "
               "there (its log names the layouts), so no PE goes up",
               pe);
    MORI_CHECK(p.heapBytes == mine.heapBytes, ErrorCode::InvalidUsage,
               "the symmetric heap must be the same size on every PE: PE %d has MORI_SHMEM_HEAP_SIZE=%llu, PE %d "
               "has %llu",
               pe, static_cast<unsigned long long>(p.heapBytes), rank_,
               static_cast<unsigned long long>(mine.heapBytes));
    MORI_CHECK(p.transportChoice == mine.transportChoice, ErrorCode::InvalidUsage,
               "MORI_SHMEM_TRANSPORT differs between PEs: PE %d has %s, PE %d has %s", pe,
               TransportChoiceName(p.transportChoice), rank_, TransportChoiceName(mine.transportChoice));
    MORI_CHECK(p.qpsPerPe == mine.qpsPerPe, ErrorCode::InvalidUsage,
               "MORI_SHMEM_QPS_PER_PE differs between PEs: PE %d has %u, PE %d has %u", pe, p.qpsPerPe, rank_,
               mine.qpsPerPe);
  }
  std::vector<int> devices;
  for (const auto& p : all) devices.push_back(p.device);

  const std::string forced = kTransportChoices[mine.transportChoice];

  // Per-peer transport: the same rule on every PE, so the matrix is symmetric.
  transports_.assign(static_cast<size_t>(nPes_), TransportType::RDMA);
  for (int pe = 0; pe < nPes_; ++pe) {
    auto& t = transports_[static_cast<size_t>(pe)];
    if (pe == rank_) {
      t = TransportType::Self;
      continue;
    }
    bool mappable = topology_.SameHost(pe);
#if MORI_BACKEND_GPU
    if (mappable && devices[static_cast<size_t>(pe)] != device) {
      int can = 0;
      MORI_CHECK_GPU(core::GpuDeviceCanAccessPeer(&can, device, devices[static_cast<size_t>(pe)]));
      mappable = can != 0;
    }
#endif
    if (forced == "p2p") {
      MORI_CHECK(mappable, ErrorCode::InvalidUsage,
                 "MORI_SHMEM_TRANSPORT=p2p, but PE %d cannot map PE %d's memory (%s)", rank_, pe,
                 topology_.SameHost(pe) ? "no peer access between their GPUs" : "it is on another host");
      t = TransportType::P2P;
    } else if (forced == "proxy") {
      t = TransportType::Proxy;
    } else if (forced == "auto") {
      if (mappable) {
        t = TransportType::P2P;
      } else if (mine.gpuPosts == 0 || all[static_cast<size_t>(pe)].gpuPosts == 0) {
        t = TransportType::Proxy;  // a NIC the GPU cannot post to on either side: the host posts
      }
    }
  }

  // Which transports any PE uses decides the collective set-up steps every PE takes part in.
  struct Uses {
    int p2p, rdma, proxy;
  };
  bool anyP2p = false;
  bool anyProxy = false;
  for (const Uses& u : bootstrap_->AllGatherValue(
           Uses{static_cast<int>(std::count(transports_.begin(), transports_.end(), TransportType::P2P)),
                static_cast<int>(std::count(transports_.begin(), transports_.end(), TransportType::RDMA)),
                static_cast<int>(std::count(transports_.begin(), transports_.end(), TransportType::Proxy))})) {
    anyP2p = anyP2p || u.p2p > 0;
    nicAtomics_ = nicAtomics_ || u.rdma > 0;
    anyProxy = anyProxy || u.proxy > 0;
  }

  // Same-host heaps mapped here (collective over all PEs; cheap where nothing is shared).
  peerBases_.assign(static_cast<size_t>(nPes_), 0);
  peerBases_[static_cast<size_t>(rank_)] = reinterpret_cast<uintptr_t>(heap_.Data());
  if (anyP2p) {
    fdChannel_ = std::make_unique<core::FdChannel>(*bootstrap_);
    peerHeaps_ = core::ExchangeIpcMemory(*bootstrap_, topology_, *fdChannel_, heap_.Data(), heapBytes_);
    for (int pe = 0; pe < nPes_; ++pe) {
      if (transports_[static_cast<size_t>(pe)] != TransportType::P2P) continue;
      MORI_CHECK(peerHeaps_[static_cast<size_t>(pe)] != nullptr, ErrorCode::Internal, "PE %d's heap was not mapped",
                 pe);
      peerBases_[static_cast<size_t>(pe)] = reinterpret_cast<uintptr_t>(peerHeaps_[static_cast<size_t>(pe)]->Data());
    }
  }

  remoteBases_.resize(static_cast<size_t>(nPes_));
  for (int pe = 0; pe < nPes_; ++pe) remoteBases_[static_cast<size_t>(pe)] = all[static_cast<size_t>(pe)].heapBase;
  rkeys_.assign(static_cast<size_t>(nPes_), 0);
  if (nicAtomics_) SetUpRdma();
  if (anyProxy) SetUpProxy(device);

  BuildDeviceState();
  teams_.assign(kShmemMaxTeams, Team{});
  std::vector<int> world(static_cast<size_t>(nPes_));
  for (int pe = 0; pe < nPes_; ++pe) world[static_cast<size_t>(pe)] = pe;
  InstallTeam(static_cast<uint32_t>(kShmemTeamWorld), world);
  InstallTeam(static_cast<uint32_t>(kShmemTeamNode), topology_.localRanks);
  PublishDeviceState(state_);
  bootstrap_->Barrier();

  std::string summary;
  for (int pe = 0; pe < nPes_; ++pe) {
    summary += (pe ? " " : "") + std::to_string(pe) + ":" + TransportTypeName(transports_[static_cast<size_t>(pe)]);
  }
  std::string atomics = proxy_ ? std::string(", atomics through the proxy over ") + core::TransportName(proxyConn_)
                        : nicAtomics_ ? ", atomics through the NIC"
                                      : "";
  MORI_LOG_INFO(Shmem, "PE %d of %d: heap %zu bytes at %p (%s), device %d, transports [%s]%s", rank_, nPes_, heapBytes_,
                heap_.Data(), heap_.AllocatorName(), device, summary.c_str(), atomics.c_str());
}

void Runtime::SetUpRdma() {
  rdma::RdmaBackendType backend = rdma::RdmaBackendFromEnvironment();
  rdmaContext_ = std::make_unique<rdma::RdmaContext>(backend);
  auto ports = rdma::GetActiveDevicePortList(rdmaContext_->GetRdmaDeviceList());
  MORI_CHECK(!ports.empty(), ErrorCode::NotSupported, "PE %d needs RDMA but has no active %s port", rank_,
             rdma::RdmaBackendName(backend));
  nic_ = ports[0].first->CreateRdmaDeviceContext();

  int64_t depth = core::EnvGetInt("MORI_SHMEM_QUEUE_DEPTH");
  MORI_CHECK(depth >= 2 && depth <= 32768 && (depth & (depth - 1)) == 0, ErrorCode::InvalidUsage,
             "MORI_SHMEM_QUEUE_DEPTH=%lld is not a power of two in [2, 32768]", static_cast<long long>(depth));
  rdma::RdmaEndpointConfig config;
  config.portId = ports[0].second;
  config.maxMsgsNum = static_cast<uint32_t>(depth);
  config.maxCqeNum = static_cast<uint32_t>(depth) * 2;
  config.maxRecvNum = 2;
  config.onGpu = MORI_BACKEND_GPU != 0;

  // Every pair gets QPs (and each PE a loopback to itself): once any PE is reached over RDMA, atomics to
  // every PE go through the NIC.
  const size_t n = static_cast<size_t>(nPes_);
  endpoints_.assign(n * qpsPerPe_, rdma::RdmaEndpoint{});
  std::vector<rdma::RdmaEndpointHandle> mine(n * qpsPerPe_);
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    endpoints_[i] = nic_->CreateRdmaEndpoint(config);
    mine[i] = endpoints_[i].handle;
  }
  std::vector<rdma::RdmaEndpointHandle> all(n * n * qpsPerPe_);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(rank_) * n * qpsPerPe_));
  bootstrap_->AllGather(all.data(), mine.size() * sizeof(rdma::RdmaEndpointHandle));
  for (int pe = 0; pe < nPes_; ++pe) {
    for (uint32_t q = 0; q < qpsPerPe_; ++q) {
      rdma::RdmaEndpoint& local = endpoints_[static_cast<size_t>(pe) * qpsPerPe_ + q];
      rdma::SetPeerRank(local.wqHandle, pe);  // the device's waits on this QP name the PE when they time out
      if (pe == rank_) {
        rdma::RdmaEndpoint peer = nic_->CreateRdmaEndpoint(config);
        nic_->ConnectEndpoint(local.handle, peer.handle);
        nic_->ConnectEndpoint(peer.handle, local.handle);
        loopbackPeers_.push_back(peer);
      } else {
        const auto& remote = all[(static_cast<size_t>(pe) * n + static_cast<size_t>(rank_)) * qpsPerPe_ + q];
        nic_->ConnectEndpoint(local.handle, remote);
        nic_->NameRemote(local.handle, core::StrFormat("PE %d", pe));
      }
    }
  }

  heapRegion_ = nic_->RegisterRdmaMemoryRegion(heap_.Data(), heapBytes_);
  auto keys = bootstrap_->AllGatherValue(heapRegion_.rkey);
  for (int pe = 0; pe < nPes_; ++pe) rkeys_[static_cast<size_t>(pe)] = keys[static_cast<size_t>(pe)];
  MORI_LOG_INFO(Shmem, "PE %d: %zu RDMA queue pairs on %s (%s), depth %lld", rank_, endpoints_.size(),
                ports[0].first->Name().c_str(), rdma::RdmaBackendName(backend), static_cast<long long>(depth));
}

void Runtime::SetUpProxy(int device) {
  // Every PE connects over the same channel transport: RDMA (a real NIC, else the emulated one) or TCP.
  const std::string conn = core::EnvGetChoice("MORI_SHMEM_PROXY_CONN");
  bool realNic = false;
  if (conn != "tcp") realNic = rdma::RdmaBackendFromEnvironment() != rdma::RdmaBackendType::Emulated;
  core::Transport t = conn == "tcp"    ? core::Transport::Tcp
                      : conn == "rdma" ? (realNic ? core::Transport::IB0 : core::Transport::Emulated)
                                       : (realNic ? core::Transport::IB0 : core::Transport::Tcp);
  auto chosen = bootstrap_->AllGatherValue(static_cast<uint32_t>(t));
  for (int pe = 0; pe < nPes_; ++pe) {
    auto theirs = static_cast<core::Transport>(chosen[static_cast<size_t>(pe)]);
    if (theirs == t) continue;
    MORI_CHECK(conn == "auto", ErrorCode::InvalidUsage,
               "MORI_SHMEM_PROXY_CONN=%s: PE %d connects over %s but PE %d over %s (one has a real NIC, the other "
               "not); every PE must use the same transport",
               conn.c_str(), rank_, core::TransportName(t), pe, core::TransportName(theirs));
  }
  if (conn == "auto" && std::any_of(chosen.begin(), chosen.end(), [&](uint32_t c) { return c != chosen[0]; })) {
    t = core::Transport::Tcp;  // not every PE has a NIC: the one transport they all have
  }
  proxyConn_ = t;

  // Tags of this runtime's exchanges, apart from what a program's own communicator might use.
  constexpr int kTag = 0x5348;
  comm_ = std::make_unique<core::Communicator>(bootstrap_);
  ShmemProxy::Setup setup;
  setup.rank = rank_;
  setup.nPes = nPes_;
  setup.heapBase = reinterpret_cast<uintptr_t>(heap_.Data());
  setup.heapBytes = heapBytes_;
  setup.heap = comm_->RegisterMemory(heap_.Data(), heapBytes_, t);
  proxyScratch_ = core::GpuBuffer(ShmemProxy::ScratchBytes(), core::MemoryType::HostPinned);
  std::memset(proxyScratch_.Data(), 0, ShmemProxy::ScratchBytes());
  setup.scratch = comm_->RegisterMemory(proxyScratch_.Data(), ShmemProxy::ScratchBytes(), t);

  for (int pe = 0; pe < nPes_; ++pe) comm_->SendMemory(setup.heap, pe, kTag);
  std::vector<std::shared_future<core::RegisteredMemory>> heaps;
  for (int pe = 0; pe < nPes_; ++pe) heaps.push_back(comm_->RecvMemory(pe, kTag));
  core::EndpointConfig config;
  config.transport = t;
  config.device = device;
  std::vector<std::shared_future<std::shared_ptr<core::Connection>>> connections;
  for (int pe = 0; pe < nPes_; ++pe) connections.push_back(comm_->Connect(config, pe, kTag));
  for (int pe = 0; pe < nPes_; ++pe) {
    setup.heaps.push_back(heaps[static_cast<size_t>(pe)].get());
    setup.connections.push_back(connections[static_cast<size_t>(pe)].get());
  }
  proxy_ = std::make_unique<ShmemProxy>(std::move(setup), device);
  proxy_->StartProxy();
  MORI_LOG_INFO(Shmem, "PE %d: SHMEM proxy started, %d connections over %s (MORI_SHMEM_PROXY_CONN=%s)", rank_, nPes_,
                core::TransportName(t), conn.c_str());
}

void Runtime::BuildDeviceState() {
  ControlLayout l = LayOutControl(nPes_, qpsPerPe_);
  control_ = core::GpuBuffer(l.total, core::MemoryType::Device);
  auto* base = control_.DataAs<uint8_t>();
  MORI_CHECK_GPU(core::GpuMemset(base, 0, l.total));

  const size_t n = static_cast<size_t>(nPes_);
  std::vector<uint8_t> transports(n);
  for (size_t i = 0; i < n; ++i) transports[i] = static_cast<uint8_t>(transports_[i]);
  std::vector<ShmemQueuePair> queues(n * qpsPerPe_);
  std::memset(static_cast<void*>(queues.data()), 0, queues.size() * sizeof(ShmemQueuePair));
  for (size_t i = 0; i < endpoints_.size(); ++i) queues[i] = ShmemQueuePair{endpoints_[i].wqHandle, endpoints_[i].cqHandle};

  MORI_CHECK_GPU(core::GpuMemcpy(base + l.transports, transports.data(), n));
  MORI_CHECK_GPU(core::GpuMemcpy(base + l.peerBases, peerBases_.data(), n * sizeof(uintptr_t)));
  MORI_CHECK_GPU(core::GpuMemcpy(base + l.remoteBases, remoteBases_.data(), n * sizeof(uintptr_t)));
  MORI_CHECK_GPU(core::GpuMemcpy(base + l.rkeys, rkeys_.data(), n * sizeof(uint32_t)));
  MORI_CHECK_GPU(core::GpuMemcpy(base + l.queues, queues.data(), queues.size() * sizeof(ShmemQueuePair)));
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());

  state_ = ShmemDeviceState{};
  state_.magic = kShmemStateMagic;
  state_.rank = rank_;
  state_.nPes = nPes_;
  state_.qpsPerPe = qpsPerPe_;
  state_.heapBase = reinterpret_cast<uintptr_t>(heap_.Data());
  state_.heapBytes = heapBytes_;
  state_.timeoutNs = static_cast<uint64_t>(core::TimeoutSeconds() * 1e9);
  state_.heapLkey = heapRegion_.lkey;
  state_.nicAtomics = nicAtomics_ ? 1u : 0u;
  state_.transports = base + l.transports;
  state_.peerBases = reinterpret_cast<const uintptr_t*>(base + l.peerBases);
  state_.remoteBases = reinterpret_cast<const uintptr_t*>(base + l.remoteBases);
  state_.rkeys = reinterpret_cast<const uint32_t*>(base + l.rkeys);
  state_.queues = endpoints_.empty() ? nullptr : reinterpret_cast<ShmemQueuePair*>(base + l.queues);
  state_.fetchTicket = reinterpret_cast<uint32_t*>(base + l.fetchTicket);
  state_.fetchTurn = reinterpret_cast<uint32_t*>(base + l.fetchTurn);
  state_.barrierSeq = reinterpret_cast<uint64_t*>(base + l.barrierSeq);
  deviceLocalRegions_ = reinterpret_cast<ShmemLocalRegion*>(base + l.localRegions);
  state_.localRegions = deviceLocalRegions_;
  deviceTeams_ = reinterpret_cast<ShmemTeamState*>(base + l.teams);
  deviceTeamMembers_ = reinterpret_cast<int32_t*>(base + l.teamMembers);
  state_.teams = deviceTeams_;
  state_.teamSyncSeq = reinterpret_cast<uint64_t*>(base + l.teamSyncSeq);
  state_.stopWord = core::DeviceStopWord();
  // The inline window of mapped bases: all mapped PEs when they fit in one window, else the window around
  // this PE.
  int lo = rank_, hi = rank_;
  for (int pe = 0; pe < nPes_; ++pe) {
    if (peerBases_[static_cast<size_t>(pe)] == 0) continue;
    lo = std::min(lo, pe);
    hi = std::max(hi, pe);
  }
  constexpr int kWindow = static_cast<int>(kShmemMappedWindow);
  if (hi - lo + 1 > kWindow) lo = std::clamp(rank_ - kWindow / 2, 0, std::max(0, nPes_ - kWindow));
  state_.mappedFirst = lo;
  state_.mappedCount = static_cast<uint32_t>(std::min(kWindow, nPes_ - lo));
  for (uint32_t i = 0; i < state_.mappedCount; ++i) state_.mappedWindow[i] = peerBases_[static_cast<size_t>(lo) + i];
  if (proxy_) {
    state_.proxyFifo = proxy_->FifoHandle();
    state_.proxyResults = proxyScratch_.DataAs<uint64_t>();
    state_.proxyAtomics = 1;
  }
}

Runtime::~Runtime() {
  // Reached without Finalize only at process exit: no collective steps then (peers may be gone), the
  // members release what they hold in reverse order (NIC engines stop before the heap goes).
  if (finalized_) return;
  // Which peers' NICs vanished before this exit, first first: after a death, the PE that names a survivor
  // that failed before it still says here which peer went first.
  std::string lost;
  for (const rdma::EmulatedPeerLoss& l : rdma::EmulatedNicPeerLosses()) {
    lost += core::StrFormat("%s%s (%.2f s ago: %s)", lost.empty() ? "" : ", ", l.name.c_str(), l.secondsAgo,
                            l.reason.c_str());
  }
  if (lost.empty()) {
    MORI_LOG_WARN(Shmem, "PE %d exits without ShmemFinalize()", rank_);
  } else {
    MORI_LOG_WARN(Shmem, "PE %d exits without ShmemFinalize(); peers lost before, first first: %s", rank_,
                  lost.c_str());
  }
}

void Runtime::Finalize() {
  if (finalized_) return;
  finalized_ = true;
  try {  // a kernel's failure (a trap) does not stop the teardown; one still running does
    (void)core::DeviceSynchronizeBy(core::Deadline::Default(), core::StrFormat("ShmemFinalize on PE %d", rank_));
  } catch (const core::TimeoutError&) {
    kernelsMayRun_ = true;
    throw;
  }
  // No kernel of this PE runs now. The device API learns at once that the runtime is gone, so that whatever
  // fails below (a barrier with a dead peer) leaves no state pointing at the heap freed with this runtime.
  ShmemDeviceState cleared{};
  PublishDeviceState(cleared);
  std::exception_ptr proxyError;
  if (proxy_) {
    // What this PE's kernels asked for is complete at its targets before the others may tear down.
    try {
      proxy_->StopProxy();
      proxy_->FlushAll();
    } catch (...) {
      proxyError = std::current_exception();
    }
  }
  bootstrap_->Barrier();  // every PE's kernels are done: nothing writes into the heaps any more
  if (nic_ != nullptr) {
    for (const auto& r : localRegions_) nic_->DeregisterRdmaMemoryRegion(reinterpret_cast<void*>(r.base));
    nic_->DeregisterRdmaMemoryRegion(heap_.Data());
    for (auto& ep : endpoints_) nic_->DestroyRdmaEndpoint(ep.handle);
    for (auto& ep : loopbackPeers_) nic_->DestroyRdmaEndpoint(ep.handle);
  }
  endpoints_.clear();
  loopbackPeers_.clear();
  localRegions_.clear();
  nic_ = nullptr;
  rdmaContext_.reset();
  proxy_.reset();  // its connections close
  comm_.reset();
  bootstrap_->Barrier();  // every PE's NIC and connections have stopped before the mappings go
  peerHeaps_.clear();
  fdChannel_.reset();
  control_ = core::GpuBuffer();
  heap_ = core::GpuBuffer();
  proxyScratch_ = core::GpuBuffer();
  if (proxyError) std::rethrow_exception(proxyError);
}

TransportType Runtime::Transport(int pe) const {
  MORI_CHECK(pe >= 0 && pe < nPes_, ErrorCode::InvalidUsage, "PE %d is not in [0, %d)", pe, nPes_);
  return transports_[static_cast<size_t>(pe)];
}

void* Runtime::PeerPointer(const void* dest, int pe) const {
  if (pe < 0 || pe >= nPes_) return nullptr;
  auto a = reinterpret_cast<uintptr_t>(dest);
  auto base = reinterpret_cast<uintptr_t>(heap_.Data());
  if (a < base || a - base >= heapBytes_) return nullptr;
  uintptr_t peer = peerBases_[static_cast<size_t>(pe)];
  return peer == 0 ? nullptr : reinterpret_cast<void*>(peer + (a - base));
}

void* Runtime::Allocate(size_t bytes, size_t alignment, bool zero) {
  std::lock_guard<std::mutex> lock(mutex_);
  struct Request {
    uint64_t bytes, alignment;
  };
  auto requests = bootstrap_->AllGatherValue(Request{bytes, alignment});
  for (int pe = 0; pe < nPes_; ++pe) {
    const Request& r = requests[static_cast<size_t>(pe)];
    MORI_CHECK(r.bytes == bytes && r.alignment == alignment, ErrorCode::InvalidUsage,
               "ShmemMalloc is collective and symmetric: PE %d asked for %llu bytes (alignment %llu), PE %d for %zu "
               "(alignment %zu)",
               pe, static_cast<unsigned long long>(r.bytes), static_cast<unsigned long long>(r.alignment), rank_,
               bytes, alignment);
  }
  if (bytes == 0) return nullptr;
  std::optional<uint64_t> offset = allocator_.Allocate(bytes, alignment);
  // Every PE learns every PE's outcome: all succeed at the same offset, or all give theirs back.
  auto offsets = bootstrap_->AllGatherValue(offset.value_or(UINT64_MAX));
  bool agreed = true;
  for (uint64_t o : offsets) agreed = agreed && o == offsets[0] && o != UINT64_MAX;
  if (!agreed) {
    if (offset) allocator_.Free(*offset);
    std::string detail;
    for (int pe = 0; pe < nPes_; ++pe) {
      if (offsets[static_cast<size_t>(pe)] == UINT64_MAX) detail += " " + std::to_string(pe);
    }
    MORI_LOG_ERROR(Shmem,
                   "ShmemMalloc(%zu) failed on PE %d: the symmetric heap cannot hold it (out of space on PEs:%s; "
                   "this PE has %llu bytes free, largest free range %llu; MORI_SHMEM_HEAP_SIZE=%zu)",
                   bytes, rank_, detail.empty() ? " none, offsets differ" : detail.c_str(),
                   static_cast<unsigned long long>(allocator_.FreeBytes()),
                   static_cast<unsigned long long>(allocator_.LargestFree()), heapBytes_);
    return nullptr;
  }
  void* ptr = heap_.DataAs<uint8_t>() + *offset;
  if (zero) {
    MORI_CHECK_GPU(core::GpuMemset(ptr, 0, bytes));
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  }
  bootstrap_->Barrier();  // nobody writes into a peer's new block before the peer has it (and zeroed it)
  return ptr;
}

void Runtime::Free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto a = reinterpret_cast<uintptr_t>(ptr);
  auto base = reinterpret_cast<uintptr_t>(heap_.Data());
  uint64_t offset = ptr == nullptr ? UINT64_MAX : a - base;
  bool known = ptr != nullptr && a >= base && a - base < heapBytes_ && allocator_.SizeAt(offset).has_value();
  MORI_CHECK(ptr == nullptr || known, ErrorCode::InvalidUsage,
             "ShmemFree(%p) on PE %d: not a block from ShmemMalloc (heap [%p, %p))", ptr, rank_, heap_.Data(),
             static_cast<void*>(heap_.DataAs<uint8_t>() + heapBytes_));
  auto offsets = bootstrap_->AllGatherValue(offset);
  for (int pe = 0; pe < nPes_; ++pe) {
    MORI_CHECK(offsets[static_cast<size_t>(pe)] == offset, ErrorCode::InvalidUsage,
               "ShmemFree is collective: PE %d frees heap offset %lld, PE %d offset %lld", pe,
               static_cast<long long>(offsets[static_cast<size_t>(pe)]), rank_, static_cast<long long>(offset));
  }
  if (ptr == nullptr) return;
  QuietAndSynchronize();
  bootstrap_->Barrier();  // no PE still reads or writes the block
  allocator_.Free(offset);
}

void Runtime::Barrier() {
  QuietAndSynchronize();
  bootstrap_->Barrier();
}

// The host barrier and ShmemFree complete what kernels posted and left unquieted, as NVSHMEM's do: with a NIC
// or a proxy set up, a finished kernel's puts and atomics may still be in a NIC's queue or a proxy's FIFO (its
// own atomics too, through the loopback QP or connection), and the memory they target or read may be reused
// once the barrier returns. P2P stores are complete when their kernel is.
void Runtime::QuietAndSynchronize() {
  if (nic_ != nullptr || proxy_) detail::LaunchQuietAll(nullptr);
  MORI_CHECK_GPU(core::DeviceSynchronizeBy(core::Deadline::Default(),
                                           core::StrFormat("PE %d, waiting for its kernels before a host barrier", rank_)));
}

bool Runtime::LocalReachable(const void* p, size_t bytes, int pe) {
  TransportType t = Transport(pe);
  if (t == TransportType::Self || t == TransportType::P2P) return true;
  auto inside = [a = reinterpret_cast<uintptr_t>(p), bytes](uintptr_t base, uint64_t size) {
    return a >= base && bytes <= size && a - base <= size - bytes;
  };
  if (inside(reinterpret_cast<uintptr_t>(heap_.Data()), heapBytes_)) return true;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& r : localRegions_) {
    if (inside(r.base, r.bytes)) return true;
  }
  return false;
}

void Runtime::RegisterBuffer(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  MORI_CHECK(ptr != nullptr && bytes > 0, ErrorCode::InvalidUsage, "ShmemBufferRegister(%p, %zu): empty buffer", ptr,
             bytes);
  MORI_CHECK(localRegions_.size() < kShmemMaxLocalRegions, ErrorCode::InvalidUsage,
             "ShmemBufferRegister: at most %u buffers may be registered", kShmemMaxLocalRegions);
  for (const auto& r : localRegions_) {
    MORI_CHECK(r.base != reinterpret_cast<uintptr_t>(ptr), ErrorCode::InvalidUsage,
               "ShmemBufferRegister(%p): already registered", ptr);
  }
  // Without a NIC nothing reads local memory through one (loads and stores reach it all): only remembered.
  uint32_t lkey = nic_ != nullptr ? nic_->RegisterRdmaMemoryRegion(ptr, bytes).lkey : ~0u;
  if (proxy_) proxy_->AddRegion(ptr, comm_->RegisterMemory(ptr, bytes, proxyConn_));
  localRegions_.push_back(ShmemLocalRegion{reinterpret_cast<uintptr_t>(ptr), bytes, lkey, 0});
  UploadLocalRegions();
}

void Runtime::UnregisterBuffer(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(localRegions_.begin(), localRegions_.end(),
                         [ptr](const ShmemLocalRegion& r) { return r.base == reinterpret_cast<uintptr_t>(ptr); });
  MORI_CHECK(it != localRegions_.end(), ErrorCode::InvalidUsage, "ShmemBufferUnregister(%p): not registered", ptr);
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  localRegions_.erase(it);
  UploadLocalRegions();
  if (proxy_) proxy_->RemoveRegion(ptr);
  if (nic_ != nullptr) nic_->DeregisterRdmaMemoryRegion(ptr);
}

void Runtime::UploadLocalRegions() {
  std::vector<ShmemLocalRegion> table(kShmemMaxLocalRegions, ShmemLocalRegion{0, 0, 0, 0});
  std::copy(localRegions_.begin(), localRegions_.end(), table.begin());
  MORI_CHECK_GPU(core::GpuMemcpy(deviceLocalRegions_, table.data(), table.size() * sizeof(ShmemLocalRegion)));
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
}

}  // namespace mori::shmem

// ---------------------------------------------------------------------------------------------------------
// Teams

namespace mori::shmem {

namespace {
// Bootstrap tags of the team collectives, one per slot: a sync of one team never takes another's message.
constexpr int kTeamSyncTag = 0x5400;   // + slot
constexpr int kTeamSplitTag = 0x5440;  // + parent slot

// What every member of the parent says in a split; the first member checks that all say the same.
struct SplitNote {
  int32_t start, stride, size;
  uint32_t reserved;
  uint64_t usedSlots;  // bit i: this PE holds a team in slot i
};
// The first member's answer: the slot of the new team, or why there is none.
struct SplitAnswer {
  int32_t slot;    // >= 0, or -1
  int32_t badPe;   // the first PE whose arguments differ from the first member's, -1 when none
  SplitNote first; // the first member's arguments (for the message)
  SplitNote bad;   // the differing PE's
};
}  // namespace

void Runtime::InstallTeam(uint32_t id, std::vector<int> members) {
  Team& t = teams_[id];
  t.members = std::move(members);
  auto it = std::find(t.members.begin(), t.members.end(), rank_);
  t.myIndex = it == t.members.end() ? -1 : static_cast<int>(it - t.members.begin());
  ShmemTeamState d{};
  d.size = static_cast<int32_t>(t.members.size());
  d.myIndex = t.myIndex;
  d.start = t.members.empty() ? 0 : t.members[0];
  d.stride = t.members.size() > 1 ? t.members[1] - t.members[0] : 1;
  for (size_t i = 1; i < t.members.size() && d.stride > 0; ++i) {
    if (t.members[i] - t.members[i - 1] != d.stride) d.stride = 0;  // not evenly spaced: the table answers
  }
  static_assert(sizeof(int) == sizeof(int32_t), "the member table is copied as it is");
  t.state = d;  // the host's queries answer from this copy, with the table in host memory
  t.state.members = t.members.data();
  int32_t* table = deviceTeamMembers_ + static_cast<size_t>(id) * static_cast<size_t>(nPes_);
  d.members = table;
  const uint64_t zero = 0;
  if (!t.members.empty()) MORI_CHECK_GPU(core::GpuMemcpy(table, t.members.data(), t.members.size() * sizeof(int32_t)));
  MORI_CHECK_GPU(core::GpuMemcpy(deviceTeams_ + id, &d, sizeof(d)));
  MORI_CHECK_GPU(core::GpuMemcpy(state_.teamSyncSeq + id, &zero, sizeof(zero)));
  MORI_CHECK_GPU(core::GpuMemcpy(heap_.DataAs<uint8_t>() + kShmemTeamSyncOffset + id * sizeof(uint64_t), &zero,
                                 sizeof(zero)));
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
}

void Runtime::TeamBarrier(const std::vector<int>& members, int tag) {
  const int leader = members.front();
  uint8_t token = 1;
  if (rank_ == leader) {
    for (int pe : members) {
      if (pe != rank_) bootstrap_->Recv(&token, 1, pe, tag);
    }
    for (int pe : members) {
      if (pe != rank_) bootstrap_->Send(&token, 1, pe, tag);
    }
  } else {
    bootstrap_->Send(&token, 1, leader, tag);
    bootstrap_->Recv(&token, 1, leader, tag);
  }
}

const Runtime::Team* Runtime::TeamAt(ShmemTeam team) const {
  const auto id = static_cast<uint32_t>(team);
  if (id >= teams_.size() || teams_[id].members.empty()) return nullptr;
  return &teams_[id];
}

int Runtime::TeamMyPe(ShmemTeam team) const {
  const Team* t = TeamAt(team);
  return t == nullptr ? -1 : t->myIndex;
}

int Runtime::TeamNPes(ShmemTeam team) const {
  const Team* t = TeamAt(team);
  return t == nullptr ? -1 : static_cast<int>(t->members.size());
}

int Runtime::TeamTranslatePe(ShmemTeam from, int pe, ShmemTeam to) const {
  const Team* f = TeamAt(from);
  const Team* t = TeamAt(to);
  return detail::TeamTranslate(f == nullptr ? nullptr : &f->state, pe, t == nullptr ? nullptr : &t->state);
}

ShmemTeam Runtime::SplitStrided(ShmemTeam parent, int start, int stride, int size) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Team* p = TeamAt(parent);
  MORI_CHECK(p != nullptr && p->myIndex >= 0, ErrorCode::InvalidUsage,
             "ShmemTeamSplitStrided on PE %d: parent team %d is not a team this PE belongs to", rank_,
             static_cast<int>(parent));
  const std::vector<int> parentMembers = p->members;
  const int n = static_cast<int>(parentMembers.size());
  uint64_t used = 0;
  for (uint32_t i = 0; i < kShmemMaxTeams; ++i) used |= teams_[i].members.empty() ? 0 : uint64_t{1} << i;
  SplitNote mine{start, stride, size, 0, used};
  SplitAnswer answer{};
  const int tag = kTeamSplitTag + static_cast<int>(parent);
  const int leader = parentMembers.front();
  if (rank_ == leader) {
    answer.slot = -1;
    answer.badPe = -1;
    answer.first = mine;
    uint64_t all = used;
    for (int pe : parentMembers) {
      if (pe == rank_) continue;
      SplitNote theirs{};
      bootstrap_->Recv(&theirs, sizeof(theirs), pe, tag);
      all |= theirs.usedSlots;
      if (answer.badPe < 0 && (theirs.start != start || theirs.stride != stride || theirs.size != size)) {
        answer.badPe = pe;
        answer.bad = theirs;
      }
    }
    for (uint32_t i = 0; i < kShmemMaxTeams; ++i) {
      if ((all >> i & 1) == 0) {
        answer.slot = static_cast<int32_t>(i);
        break;
      }
    }
    for (int pe : parentMembers) {
      if (pe != rank_) bootstrap_->Send(&answer, sizeof(answer), pe, tag);
    }
  } else {
    bootstrap_->Send(&mine, sizeof(mine), leader, tag);
    bootstrap_->Recv(&answer, sizeof(answer), leader, tag);
  }
  // Every member reaches the same verdict from the same answer.
  MORI_CHECK(answer.badPe < 0, ErrorCode::InvalidUsage,
             "ShmemTeamSplitStrided is collective with the same arguments on every member of team %d: PE %d gave "
             "(start %d, stride %d, size %d), PE %d gave (start %d, stride %d, size %d)",
             static_cast<int>(parent), leader, answer.first.start, answer.first.stride, answer.first.size,
             answer.badPe, answer.bad.start, answer.bad.stride, answer.bad.size);
  const long long last = static_cast<long long>(start) + static_cast<long long>(size - 1) * stride;
  MORI_CHECK(size >= 1 && start >= 0 && stride >= 1 && last < n, ErrorCode::InvalidUsage,
             "ShmemTeamSplitStrided(team %d, start %d, stride %d, size %d): the members must lie in the parent's "
             "[0, %d) with stride >= 1 and size >= 1",
             static_cast<int>(parent), start, stride, size, n);
  MORI_CHECK(answer.slot >= 0, ErrorCode::InvalidUsage,
             "ShmemTeamSplitStrided on PE %d: all %u team slots are in use on some PE of team %d (destroy teams "
             "that are done)",
             rank_, kShmemMaxTeams, static_cast<int>(parent));
  std::vector<int> members;
  for (int i = 0; i < size; ++i) members.push_back(parentMembers[static_cast<size_t>(start + i * stride)]);
  const bool member = std::find(members.begin(), members.end(), rank_) != members.end();
  if (member) InstallTeam(static_cast<uint32_t>(answer.slot), members);
  // Nobody signals the new team's counters before every member has reset them.
  TeamBarrier(parentMembers, tag);
  return member ? static_cast<ShmemTeam>(answer.slot) : kShmemTeamInvalid;
}

void Runtime::DestroyTeam(ShmemTeam team) {
  std::lock_guard<std::mutex> lock(mutex_);
  MORI_CHECK(team != kShmemTeamWorld && team != kShmemTeamNode, ErrorCode::InvalidUsage,
             "ShmemTeamDestroy on PE %d: the world and node teams live until ShmemFinalize", rank_);
  MORI_CHECK(TeamAt(team) != nullptr, ErrorCode::InvalidUsage,
             "ShmemTeamDestroy on PE %d: team %d is not a team of this PE (destroyed twice?)", rank_,
             static_cast<int>(team));
  InstallTeam(static_cast<uint32_t>(team), {});
}

void Runtime::TeamSync(ShmemTeam team) {
  std::vector<int> members;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Team* t = TeamAt(team);
    MORI_CHECK(t != nullptr && t->myIndex >= 0, ErrorCode::InvalidUsage,
               "ShmemTeamSync on PE %d: team %d is not a team this PE belongs to", rank_, static_cast<int>(team));
    members = t->members;
  }
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  TeamBarrier(members, kTeamSyncTag + static_cast<int>(team));
}

}  // namespace mori::shmem
