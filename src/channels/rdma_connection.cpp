// The RDMA connection (IB0..IB7 and Emulated): the communicator's NIC contexts (Communicator::Impl::Nic),
// ConnectRdma (endpoint handle sent at the call, QP connected at get()) and host-posted work requests with
// flow control, selective signaling and a connection that stays failed after the first error completion.
#include "rdma_connection.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <utility>

#include "communicator_impl.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"

namespace mori::core {

namespace {

constexpr uint32_t kPeerInfoMagic = 0x4d524331;  // "MRC1"
constexpr uint32_t kPeerInfoVersion = 1;
constexpr uint32_t kReadyMagic = 0x4d524459;  // "MRDY": this side's QP is connected
// Polls that find nothing before the waiting thread starts sleeping between looks (a host proxy shares the
// CPU with the emulated NIC's engine and with other proxies).
constexpr uint64_t kBusyPolls = 2000;
constexpr auto kIdleSleep = std::chrono::microseconds(20);

bool RangeFits(uint64_t offset, uint64_t bytes, uint64_t size) { return bytes <= size && offset <= size - bytes; }

const char* OpName(rdma::HostOp op) {
  switch (op) {
    case rdma::HostOp::Write:
      return "RDMA write";
    case rdma::HostOp::WriteInline:
      return "inline RDMA write";
    case rdma::HostOp::Read:
      return "RDMA read";
    case rdma::HostOp::Send:
      return "send";
    case rdma::HostOp::FetchAdd:
      return "atomic fetch-add";
    case rdma::HostOp::CompareSwap:
      return "atomic compare-swap";
    case rdma::HostOp::Nop:
      return "NOP";
  }
  return "work request";
}

// Why an error completion happened, in the words a user can act on.
const char* SyndromeHint(int syndrome) {
  switch (syndrome) {
    case rdma::mlx5::kSyndromeRemoteAccessErr:
      return "the peer's NIC refused the key or the range: not registered there, or a wrong key";
    case rdma::mlx5::kSyndromeTransportRetryExcErr:
      return "the peer's NIC does not answer: its process died or the link is down";
    case rdma::mlx5::kSyndromeRemoteInvalReqErr:
      return "the peer's NIC found the request invalid (alignment, length)";
    case rdma::mlx5::kSyndromeLocalProtErr:
      return "the local range is not registered with this NIC";
    default:
      return nullptr;
  }
}

bool IsEmulatedBackend(rdma::RdmaBackendType backend) { return backend == rdma::RdmaBackendType::Emulated; }

const char* NicKind(rdma::RdmaBackendType backend) {
  return IsEmulatedBackend(backend) ? "the emulated NIC" : "a real NIC";
}

// The endpoint made at Connect until the connection takes it over at get() (or never: then it is destroyed).
struct PendingEndpoint {
  rdma::RdmaDeviceContext* nic = nullptr;
  std::weak_ptr<int> alive;  // the communicator that owns `nic`
  rdma::RdmaEndpoint endpoint{};
  bool handedOver = false;
  ~PendingEndpoint() {
    if (handedOver || nic == nullptr || alive.expired()) return;
    try {
      nic->DestroyRdmaEndpoint(endpoint.handle);
    } catch (const std::exception& e) {
      MORI_LOG_WARN(Rdma, "destroying the unused endpoint of QP %u: %s", endpoint.handle.qpn, e.what());
    }
  }
};

}  // namespace

// ---------------------------------------------------------------- the communicator's NICs

rdma::RdmaDeviceContext* Communicator::Impl::Nic(Transport transport) {
  MORI_CHECK(IsRdmaTransport(transport), ErrorCode::InvalidUsage, "%s is not an RDMA transport (IB0..IB7, Emulated)",
             TransportName(transport));
  std::lock_guard<std::mutex> lock(mutex);
  const int slot = RdmaSlotOf(transport);
  if (auto it = nics.find(slot); it != nics.end()) return it->second;

  auto contextOf = [this](rdma::RdmaBackendType backend) -> rdma::RdmaContext& {
    auto& context = rdmaContexts[static_cast<int>(backend)];
    if (!context) context = std::make_unique<rdma::RdmaContext>(backend);
    return *context;
  };
  // IB indices that run on the emulated NIC share the Emulated slot's context: one registration serves all.
  auto emulated = [&]() -> rdma::RdmaDeviceContext* {
    auto& shared = nics[kEmulatedRdmaSlot];
    if (shared == nullptr) {
      const rdma::RdmaDeviceList& devices = contextOf(rdma::RdmaBackendType::Emulated).GetRdmaDeviceList();
      MORI_CHECK(!devices.empty(), ErrorCode::Internal, "the Emulated RDMA backend lists no device");
      shared = devices[0]->CreateRdmaDeviceContext();
    }
    return shared;
  };

  rdma::RdmaDeviceContext* nic = nullptr;
  if (transport == Transport::Emulated) {
    nic = emulated();
  } else {
    const int index = IbIndex(transport);
    bool forcedEmulated = EnvGetChoice("MORI_RDMA_BACKEND") == "emulated";
    const rdma::RdmaDeviceList* devices =
        forcedEmulated ? nullptr : &contextOf(rdma::RdmaBackendType::IBVerbs).GetRdmaDeviceList();
    if (devices == nullptr || devices->empty()) {
      static std::atomic<bool> logged{false};
      if (!logged.exchange(true)) {
        MORI_LOG_INFO(Rdma, "%s runs on the emulated NIC (%s)", TransportName(transport),
                      forcedEmulated ? "MORI_RDMA_BACKEND=emulated" : "IBVerbs finds no RDMA device on this machine");
      }
      nic = emulated();
    } else {
      MORI_CHECK(static_cast<size_t>(index) < devices->size(), ErrorCode::InvalidUsage,
                 "%s asks for RDMA device %d, but IBVerbs has %zu device(s) here (MORI_RDMA_DEVICES filters them)",
                 TransportName(transport), index, devices->size());
      rdma::RdmaDevice* device = (*devices)[static_cast<size_t>(index)];
      nic = device->CreateRdmaDeviceContext();
      MORI_LOG_INFO(Rdma, "%s is %s (IBVerbs)", TransportName(transport), device->Name().c_str());
    }
  }
  nics[slot] = nic;
  return nic;
}

// ---------------------------------------------------------------- connecting

std::shared_future<std::shared_ptr<Connection>> ConnectRdma(Communicator::Impl& comm, const EndpointConfig& config,
                                                            int remoteRank, int tag, int bootstrapTag) {
  const Transport transport = config.transport;
  MORI_CHECK(IsRdmaTransport(transport), ErrorCode::InvalidUsage, "ConnectRdma to rank %d: %s is not an RDMA transport",
             remoteRank, TransportName(transport));
  const EndpointConfig::Ib& ib = config.ib;
  MORI_CHECK(ib.maxSendWr >= 1 && ib.maxCqSize >= 1 && ib.maxCqPollNum >= 1 && ib.maxWrPerSend >= 1,
             ErrorCode::InvalidUsage,
             "%s to rank %d: maxSendWr %u, maxCqSize %u, maxCqPollNum %u and maxWrPerSend %u must all be at least 1",
             TransportName(transport), remoteRank, ib.maxSendWr, ib.maxCqSize, ib.maxCqPollNum, ib.maxWrPerSend);
  rdma::RdmaDeviceContext* nic = comm.Nic(transport);
  rdma::RdmaDevice* device = nic->GetRdmaDevice();

  std::vector<uint32_t> ports = device->ActivePorts();
  MORI_CHECK(!ports.empty(), ErrorCode::NotSupported, "%s (%s): no port is up", TransportName(transport),
             device->Name().c_str());
  uint32_t port = ib.portId == 0 ? ports.front() : ib.portId;
  MORI_CHECK(std::find(ports.begin(), ports.end(), port) != ports.end(), ErrorCode::InvalidUsage,
             "%s (%s): port %u is not an active port", TransportName(transport), device->Name().c_str(), port);

  rdma::RdmaEndpointConfig epConfig;
  epConfig.portId = port;
  epConfig.maxMsgsNum = ib.maxSendWr;
  // Every outstanding work request may complete with an error (flushed ones included, signaled or not):
  // the CQ holds at least as many entries as the send queue, so an error never overruns it.
  epConfig.maxCqeNum = std::max(ib.maxCqSize, ib.maxSendWr);
  epConfig.maxRecvNum = 1;  // one-sided only; nothing is received
  epConfig.onGpu = false;   // the host posts

  auto pending = std::make_shared<PendingEndpoint>();
  pending->endpoint = nic->CreateRdmaEndpoint(epConfig);
  rdma::SetPeerRank(pending->endpoint.wqHandle, remoteRank);
  pending->nic = nic;
  pending->alive = comm.alive;

  if (remoteRank == comm.Rank()) {
    // Loopback: a second endpoint of the same NIC answers, so this process's own memory is reached through the
    // NIC (its atomics are atomic with the peers' atomics on that memory, which CPU atomics would not be).
    auto answerer = std::make_shared<PendingEndpoint>();
    answerer->endpoint = nic->CreateRdmaEndpoint(epConfig);
    answerer->nic = nic;
    answerer->alive = comm.alive;
    nic->ConnectEndpoint(pending->endpoint.handle, answerer->endpoint.handle);
    nic->ConnectEndpoint(answerer->endpoint.handle, pending->endpoint.handle);
    std::shared_ptr<Connection> connection = std::make_shared<RdmaConnection>(
        nic, comm.alive, pending->endpoint, config, transport, remoteRank, tag, &answerer->endpoint);
    pending->handedOver = true;
    answerer->handedOver = true;
    std::promise<std::shared_ptr<Connection>> ready;
    ready.set_value(std::move(connection));
    return ready.get_future().share();
  }

  RdmaPeerInfo mine{};
  mine.magic = kPeerInfoMagic;
  mine.version = kPeerInfoVersion;
  mine.handle = pending->endpoint.handle;
  mine.backend = static_cast<uint32_t>(device->Backend());
  mine.transport = static_cast<uint32_t>(transport);
  std::shared_ptr<Bootstrap> bootstrap = comm.bootstrap;
  bootstrap->Send(&mine, sizeof(mine), remoteRank, bootstrapTag);

  return std::async(
             std::launch::deferred,
             [bootstrap, pending, config, remoteRank, tag, bootstrapTag]() -> std::shared_ptr<Connection> {
               const Transport transport = config.transport;
               RdmaPeerInfo peer{};
               bootstrap->Recv(&peer, sizeof(peer), remoteRank, bootstrapTag);
               MORI_CHECK(peer.magic == kPeerInfoMagic && peer.version == kPeerInfoVersion, ErrorCode::Protocol,
                          "%s to rank %d: the peer's endpoint description has magic 0x%08x version %u (want "
                          "0x%08x version %u)",
                          TransportName(transport), remoteRank, peer.magic, peer.version, kPeerInfoMagic,
                          kPeerInfoVersion);
               auto remoteTransport = static_cast<Transport>(peer.transport);
               MORI_CHECK(peer.transport < kNumTransports && IsRdmaTransport(remoteTransport), ErrorCode::InvalidUsage,
                          "%s to rank %d: the peer connects with %s, not an RDMA transport", TransportName(transport),
                          remoteRank,
                          peer.transport < kNumTransports ? TransportName(remoteTransport) : "an unknown one");
               auto localBackend = pending->nic->GetRdmaDevice()->Backend();
               auto remoteBackend = static_cast<rdma::RdmaBackendType>(peer.backend);
               MORI_CHECK(IsEmulatedBackend(localBackend) == IsEmulatedBackend(remoteBackend), ErrorCode::InvalidUsage,
                          "%s here runs on %s (%s), rank %d's %s on %s: an emulated NIC cannot talk to a real one "
                          "(set MORI_RDMA_BACKEND=emulated on both, or use the Emulated transport on both)",
                          TransportName(transport), NicKind(localBackend),
                          pending->nic->GetRdmaDevice()->Name().c_str(), remoteRank, TransportName(remoteTransport),
                          NicKind(remoteBackend));
               pending->nic->ConnectEndpoint(pending->endpoint.handle, peer.handle);
               pending->nic->NameRemote(pending->endpoint.handle, StrFormat("rank %d", remoteRank));
               // A request that reaches a QP not yet connected is refused (emulated NIC) or dropped until
               // the retries run out (real NIC): neither side posts before both QPs are ready.
               uint32_t ready = kReadyMagic;
               bootstrap->Send(&ready, sizeof(ready), remoteRank, bootstrapTag);
               uint32_t peerReady = 0;
               bootstrap->Recv(&peerReady, sizeof(peerReady), remoteRank, bootstrapTag);
               MORI_CHECK(peerReady == kReadyMagic, ErrorCode::Protocol,
                          "%s to rank %d: the peer's ready note is 0x%08x (want 0x%08x)", TransportName(transport),
                          remoteRank, peerReady, kReadyMagic);
               MORI_CHECK(!pending->alive.expired(), ErrorCode::InvalidUsage,
                          "%s to rank %d: the communicator that began this Connect is gone", TransportName(transport),
                          remoteRank);
               auto connection = std::make_shared<RdmaConnection>(pending->nic, pending->alive, pending->endpoint,
                                                                  config, remoteTransport, remoteRank, tag);
               pending->handedOver = true;
               return connection;
             })
      .share();
}

// ---------------------------------------------------------------- the connection

RdmaConnection::RdmaConnection(rdma::RdmaDeviceContext* nic, std::weak_ptr<int> alive,
                               const rdma::RdmaEndpoint& endpoint, const EndpointConfig& config,
                               Transport remoteTransport, int remoteRank, int tag, const rdma::RdmaEndpoint* answerer)
    : Connection(remoteRank, tag),
      nic_(nic),
      alive_(std::move(alive)),
      endpoint_(endpoint),
      loopback_(answerer != nullptr),
      answerer_(answerer != nullptr ? *answerer : rdma::RdmaEndpoint{}),
      transport_(config.transport),
      remoteTransport_(remoteTransport),
      emulated_(IsEmulatedBackend(nic->GetRdmaDevice()->Backend())),
      nicLabel_(emulated_ ? std::string("emulated NIC") : nic->GetRdmaDevice()->Name()),
      localSlot_(RdmaSlotOf(config.transport)),
      remoteSlot_(RdmaSlotOf(remoteTransport)),
      depth_(config.ib.maxSendWr),
      signalEvery_(std::min(config.ib.maxWrPerSend, config.ib.maxSendWr)),
      inlineLimit_(endpoint.wqHandle.maxInlineData),
      pending_(config.ib.maxSendWr),
      completions_(config.ib.maxCqPollNum),
      slots_(new uint64_t[config.ib.maxSendWr]()) {
  slotsRegion_ = nic_->RegisterRdmaMemoryRegion(slots_.get(), sizeof(uint64_t) * depth_, rdma::kRdmaAccessLocalWrite);
  MORI_LOG_INFO(Rdma, "%s: connected (send-queue depth %u, a completion every %u work requests)", Describe().c_str(),
                depth_, signalEvery_);
}

RdmaConnection::~RdmaConnection() {
  // A communicator that went first took the NIC context, the QP and the slot ring's registration with it.
  if (alive_.expired()) return;
  // The QPs go first: nothing writes into the slot ring after they are gone.
  try {
    nic_->DestroyRdmaEndpoint(endpoint_.handle);
    if (loopback_) nic_->DestroyRdmaEndpoint(answerer_.handle);
  } catch (const std::exception& e) {
    MORI_LOG_WARN(Rdma, "%s: destroying the endpoint: %s", Describe().c_str(), e.what());
  }
  try {
    nic_->DeregisterRdmaMemoryRegion(slots_.get());
  } catch (const std::exception& e) {
    MORI_LOG_WARN(Rdma, "%s: deregistering the result slots: %s", Describe().c_str(), e.what());
  }
}

std::string RdmaConnection::Describe() const {
  if (loopback_) {
    return StrFormat("%s (%s) to itself (rank %d, loopback), qp %u", TransportName(transport_), nicLabel_.c_str(),
                     RemoteRank(), Qpn());
  }
  return StrFormat("%s (%s) to rank %d, qp %u", TransportName(transport_), nicLabel_.c_str(), RemoteRank(), Qpn());
}

const RdmaRegistration& RdmaConnection::LocalRegistration(const RegisteredMemory& memory, uint64_t offset,
                                                          uint64_t bytes, const char* role) const {
  const RegisteredMemory::Impl* m = memory.GetImpl();
  MORI_CHECK(m != nullptr, ErrorCode::InvalidUsage, "%s: the %s is an empty RegisteredMemory", Describe().c_str(),
             role);
  MORI_CHECK(m->local, ErrorCode::InvalidUsage,
             "%s: the %s must be memory registered in this process (it is rank %d's)", Describe().c_str(), role,
             m->ownerRank);
  const RdmaRegistration& r = m->rdma[static_cast<size_t>(localSlot_)];
  MORI_CHECK(r.valid, ErrorCode::InvalidUsage, "%s: the %s (%llu bytes at %p) is not registered for %s (only %s)",
             Describe().c_str(), role, static_cast<unsigned long long>(m->size), m->data, TransportName(transport_),
             m->transports.ToString().c_str());
  MORI_CHECK(RangeFits(offset, bytes, m->size), ErrorCode::InvalidUsage,
             "%s: [%llu, + %llu) is outside the %s, which has %llu bytes", Describe().c_str(),
             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), role,
             static_cast<unsigned long long>(m->size));
  return r;
}

const RdmaRegistration& RdmaConnection::RemoteRegistration(const RegisteredMemory& memory, uint64_t offset,
                                                           uint64_t bytes, const char* role) const {
  const RegisteredMemory::Impl* m = memory.GetImpl();
  MORI_CHECK(m != nullptr, ErrorCode::InvalidUsage, "%s: the %s is an empty RegisteredMemory", Describe().c_str(),
             role);
  if (loopback_) {
    MORI_CHECK(m->local, ErrorCode::InvalidUsage,
               "%s: the %s must be memory registered in this process (a loopback connection reaches only its own), "
               "not rank %d's",
               Describe().c_str(), role, m->ownerRank);
  } else {
    MORI_CHECK(!m->local && (m->ownerRank < 0 || m->ownerRank == RemoteRank()), ErrorCode::InvalidUsage,
               "%s: the %s must be rank %d's memory (from RecvMemory), not %s", Describe().c_str(), role, RemoteRank(),
               m->local ? "local memory" : StrFormat("rank %d's", m->ownerRank).c_str());
  }
  const RdmaRegistration& r = m->rdma[static_cast<size_t>(remoteSlot_)];
  MORI_CHECK(r.valid, ErrorCode::InvalidUsage,
             "%s: the %s (%llu bytes of rank %d) is not registered for %s, the transport rank %d connected with "
             "(only %s): there is no key for it",
             Describe().c_str(), role, static_cast<unsigned long long>(m->size), m->ownerRank,
             TransportName(remoteTransport_), RemoteRank(), m->transports.ToString().c_str());
  MORI_CHECK(IsEmulatedBackend(static_cast<rdma::RdmaBackendType>(r.backend)) == emulated_, ErrorCode::InvalidUsage,
             "%s: the %s was registered with %s, this connection's peer NIC is %s (key 0x%x is not its)",
             Describe().c_str(), role, NicKind(static_cast<rdma::RdmaBackendType>(r.backend)),
             emulated_ ? "the emulated NIC" : "a real NIC", r.rkey);
  MORI_CHECK(RangeFits(offset, bytes, m->size), ErrorCode::InvalidUsage,
             "%s: [%llu, + %llu) is outside the %s (%llu bytes of rank %d, key 0x%x)", Describe().c_str(),
             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), role,
             static_cast<unsigned long long>(m->size), m->ownerRank, r.rkey);
  return r;
}

void RdmaConnection::Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src,
                           uint64_t srcOffset, uint64_t bytes) {
  CheckUsable();
  const RdmaRegistration& to = RemoteRegistration(dst, dstOffset, bytes, "Write destination");
  const RdmaRegistration& from = LocalRegistration(src, srcOffset, bytes, "Write source");
  PostTransfer(rdma::HostOp::Write, from.addr + srcOffset, from.lkey, to.addr + dstOffset, to.rkey, bytes);
}

void RdmaConnection::PostTransfer(rdma::HostOp op, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                  uint64_t bytes) {
  Deadline deadline = Deadline::Default();
  for (uint64_t done = 0; done < bytes;) {
    uint64_t chunk = std::min<uint64_t>(bytes - done, rdma::mlx5::kMaxMessageBytes);
    rdma::HostWorkRequest wr;
    wr.op = op;
    wr.laddr = static_cast<uintptr_t>(laddr + done);
    wr.lkey = lkey;
    wr.raddr = static_cast<uintptr_t>(raddr + done);
    wr.rkey = rkey;
    wr.bytes = static_cast<size_t>(chunk);
    Post(wr, Pending{wr.op, chunk, wr.raddr, nullptr}, deadline);
    done += chunk;
  }
}

void RdmaConnection::UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) {
  CheckUsable();
  MORI_CHECK(src != nullptr, ErrorCode::InvalidUsage, "%s: UpdateAndSync with a null local word", Describe().c_str());
  const RdmaRegistration& to = RemoteRegistration(dst, dstOffset, sizeof(uint64_t), "UpdateAndSync destination");
  *src = newValue;
  rdma::HostWorkRequest wr;
  wr.raddr = static_cast<uintptr_t>(to.addr + dstOffset);
  wr.rkey = to.rkey;
  wr.bytes = sizeof(uint64_t);
  Deadline deadline = Deadline::Default();
  if (inlineLimit_ >= sizeof(uint64_t)) {
    // The value is copied into the work request at posting: nothing to keep alive until completion.
    wr.op = rdma::HostOp::WriteInline;
    wr.inlineData = &newValue;
    Post(wr, Pending{wr.op, sizeof(uint64_t), wr.raddr, nullptr}, deadline);
  } else {
    // Staged in the slot of the id this request will get, which no other request uses until it retires.
    WaitForRoom(deadline);
    uint64_t* staging = Slot(posted_ + 1);
    *staging = newValue;
    wr.op = rdma::HostOp::Write;
    wr.laddr = reinterpret_cast<uintptr_t>(staging);
    wr.lkey = slotsRegion_.lkey;
    Post(wr, Pending{wr.op, sizeof(uint64_t), wr.raddr, nullptr}, deadline);
  }
}

void RdmaConnection::Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src,
                          uint64_t srcOffset, uint64_t bytes) {
  CheckUsable();
  const RdmaRegistration& to = LocalRegistration(dst, dstOffset, bytes, "Read destination");
  const RdmaRegistration& from = RemoteRegistration(src, srcOffset, bytes, "Read source");
  PostTransfer(rdma::HostOp::Read, to.addr + dstOffset, to.lkey, from.addr + srcOffset, from.rkey, bytes);
}

void RdmaConnection::AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) {
  PostAtomic(rdma::HostOp::FetchAdd, dst, dstOffset, value, 0, result);
}

void RdmaConnection::AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                                       uint64_t* result) {
  PostAtomic(rdma::HostOp::CompareSwap, dst, dstOffset, swap, compare, result);
}

void RdmaConnection::PostAtomic(rdma::HostOp op, const RegisteredMemory& dst, uint64_t dstOffset, uint64_t swapAdd,
                                uint64_t compare, uint64_t* result) {
  CheckUsable();
  const char* role = op == rdma::HostOp::FetchAdd ? "fetch-add target" : "compare-swap target";
  const RdmaRegistration& to = RemoteRegistration(dst, dstOffset, sizeof(uint64_t), role);
  uint64_t raddr = to.addr + dstOffset;
  MORI_CHECK(raddr % sizeof(uint64_t) == 0, ErrorCode::InvalidUsage,
             "%s: the %s at offset %llu (address 0x%llx of rank %d) is not 8-byte aligned", Describe().c_str(), role,
             static_cast<unsigned long long>(dstOffset), static_cast<unsigned long long>(raddr), RemoteRank());
  Deadline deadline = Deadline::Default();
  WaitForRoom(deadline);
  rdma::HostWorkRequest wr;
  wr.op = op;
  wr.laddr = reinterpret_cast<uintptr_t>(Slot(posted_ + 1));  // the old value lands in this request's slot
  wr.lkey = slotsRegion_.lkey;
  wr.raddr = static_cast<uintptr_t>(raddr);
  wr.rkey = to.rkey;
  wr.bytes = sizeof(uint64_t);
  wr.swapAdd = swapAdd;
  wr.compare = compare;
  Post(wr, Pending{op, sizeof(uint64_t), raddr, result}, deadline);
}

void RdmaConnection::Flush(int64_t timeoutUs) {
  CheckUsable();
  Deadline deadline = timeoutUs < 0 ? Deadline::Default() : Deadline::After(static_cast<double>(timeoutUs) / 1e6);
  // Unsignaled requests at the tail complete silently: a signaled NOP behind them reports that they are done.
  if (lastSignaled_ < posted_) Post(rdma::HostWorkRequest{rdma::HostOp::Nop}, Pending{}, deadline);
  uint64_t idle = 0;
  while (retired_ < posted_) {
    if (PollOnce()) {
      CheckUsable();
      idle = 0;
      continue;
    }
    if (deadline.Expired()) {
      throw TimeoutError(
          StrFormat("%s: Flush timed out after %.3g s with %llu of %llu work requests not completed "
                    "(rank %d's NIC stopped answering?)",
                    Describe().c_str(), deadline.TotalSeconds(), static_cast<unsigned long long>(posted_ - retired_),
                    static_cast<unsigned long long>(posted_), RemoteRank()));
    }
    Backoff(idle);
  }
}

void RdmaConnection::Post(rdma::HostWorkRequest wr, const Pending& what, const Deadline& deadline) {
  WaitForRoom(deadline);
  const uint64_t id = posted_ + 1;
  // Signal at least every signalEvery_ requests, and on the one that fills the queue: otherwise a full queue
  // could hold no request whose completion would free it.
  wr.signaled = wr.op == rdma::HostOp::Nop || sinceSignal_ + 1 >= signalEvery_ || id - retired_ >= depth_;
  wr.wrId = id;
  pending_[(id - 1) % depth_] = what;
  nic_->HostPost(endpoint_, wr);
  posted_ = id;
  if (wr.signaled) {
    lastSignaled_ = id;
    sinceSignal_ = 0;
  } else {
    ++sinceSignal_;
  }
}

void RdmaConnection::WaitForRoom(const Deadline& deadline) {
  uint64_t idle = 0;
  while (posted_ - retired_ >= depth_) {
    if (PollOnce()) {
      CheckUsable();
      idle = 0;
      continue;
    }
    if (deadline.Expired()) {
      throw TimeoutError(
          StrFormat("%s: the send queue stayed full for %.3g s (%llu work requests outstanding, "
                    "none completed; rank %d's NIC stopped answering?)",
                    Describe().c_str(), deadline.TotalSeconds(), static_cast<unsigned long long>(posted_ - retired_),
                    RemoteRank()));
    }
    Backoff(idle);
  }
}

bool RdmaConnection::PollOnce() {
  int n = nic_->HostPoll(endpoint_, completions_.data(), static_cast<int>(completions_.size()));
  for (int i = 0; i < n; ++i) {
    const rdma::HostCompletion& c = completions_[static_cast<size_t>(i)];
    if (c.isReceive) continue;  // nothing is received on these QPs
    if (c.status != 0) {
      Fail(c);
    } else if (!failed_) {
      Retire(c.wrId);
    }
  }
  return n > 0;
}

void RdmaConnection::Retire(uint64_t upTo) {
  if (upTo <= retired_ || upTo > posted_) return;  // not one of the outstanding ids: nothing it proves
  for (uint64_t id = retired_ + 1; id <= upTo; ++id) {
    const Pending& p = pending_[(id - 1) % depth_];
    if (p.result != nullptr) *p.result = *Slot(id);
  }
  retired_ = upTo;
}

void RdmaConnection::Fail(const rdma::HostCompletion& c) {
  if (failed_) return;  // the first error is the cause; what follows it is flushed
  const bool known = c.wrId > retired_ && c.wrId <= posted_;
  const Pending p = known ? pending_[(c.wrId - 1) % depth_] : Pending{};
  std::string what = known
                         ? StrFormat("%s of %llu bytes to 0x%llx (request %llu of %llu)", OpName(p.op),
                                     static_cast<unsigned long long>(p.bytes), static_cast<unsigned long long>(p.raddr),
                                     static_cast<unsigned long long>(c.wrId), static_cast<unsigned long long>(posted_))
                         : StrFormat("a work request (id %llu)", static_cast<unsigned long long>(c.wrId));
  const char* hint = SyndromeHint(c.status);
  failed_ = true;
  failStatus_ = c.status;
  failMessage_ = StrFormat(
      "%s: %s failed at rank %d: %s (mlx5 syndrome 0x%02x)%s%s; the connection is unusable from "
      "now on",
      Describe().c_str(), what.c_str(), RemoteRank(), rdma::mlx5::SyndromeName(static_cast<uint8_t>(c.status)),
      c.status, hint ? ": " : "", hint ? hint : "");
  MORI_LOG_ERROR(Rdma, "%s", failMessage_.c_str());
}

void RdmaConnection::CheckUsable() const {
  if (failed_) throw RdmaError(failStatus_, failMessage_);
  MORI_CHECK(!alive_.expired(), ErrorCode::InvalidUsage,
             "%s: the communicator that made this connection is gone (and its NIC context with it)",
             Describe().c_str());
}

void RdmaConnection::Backoff(uint64_t& idlePolls) {
  if (++idlePolls < kBusyPolls) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(kIdleSleep);
  }
}

}  // namespace mori::core
