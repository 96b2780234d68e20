// The communicator: registering memory for transports, moving registered memory between ranks (bytes over the
// bootstrap, descriptors over the FdChannel), and the Connect handshake in front of each transport's maker.
#include "mori/channels/communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "communicator_impl.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"
#include "tcp/tcp_link.hpp"
#include "tcp/tcp_registry.hpp"

namespace mori::core {

namespace {

// Beside the bytes of CudaIpc memory sent to a same-host peer: says whether a descriptor came and which
// memory it belongs to, so that a note can never be paired with the wrong bytes unnoticed.
struct IpcNote {
  uint32_t magic;
  uint32_t hasFd;
  uint64_t ownerPid;
  uint64_t originalData;
};
constexpr uint32_t kIpcNoteMagic = 0x4d49504eU;  // "MIPN"

bool CarriesIpcNote(const Communicator::Impl& comm, TransportFlags transports, int peer) {
  return transports.Has(Transport::CudaIpc) && peer != comm.Rank() && comm.topology.SameHost(peer);
}

void CheckRank(const Communicator::Impl& comm, int rank, const char* what) {
  MORI_CHECK(rank >= 0 && rank < comm.NRanks(), ErrorCode::InvalidUsage, "rank %d: %s rank %d, but ranks are 0..%d",
             comm.Rank(), what, rank, comm.NRanks() - 1);
}

// Which connections can pair: the two ends of one connection use the same kind of transport.
int TransportKind(Transport t) {
  if (t == Transport::CudaIpc) return 0;
  if (IsRdmaTransport(t)) return 1;
  return 2;
}

bool ValidTransport(Transport t) {
  return t != Transport::Unknown && static_cast<uint32_t>(t) < static_cast<uint32_t>(kNumTransports);
}

}  // namespace

int CommTag(CommTagKind kind, int userTag) {
  MORI_CHECK(userTag >= 0 && userTag <= kMaxUserTag, ErrorCode::InvalidUsage, "communicator tag %d is outside [0, %d]",
             userTag, kMaxUserTag);
  return static_cast<int>(kind) << 24 | userTag;
}

void CheckCommunicatorAlive(const std::weak_ptr<int>& alive, const std::string& what) {
  MORI_CHECK(!alive.expired(), ErrorCode::InvalidUsage,
             "%s: the Communicator was destroyed before this future's get() (keep it alive until every future of "
             "it is taken)",
             what.c_str());
}

void RethrowWithContext(const Error& e, const std::string& context) {
  std::string inner = e.what();
  const std::string prefix = std::string("mori ") + ErrorCodeName(e.Code()) + ": ";
  if (inner.compare(0, prefix.size(), prefix) == 0) inner.erase(0, prefix.size());
  std::string message = context + ": " + inner;
  if (auto* sys = dynamic_cast<const SysError*>(&e)) throw SysError(sys->Errno(), message);
  if (auto* gpu = dynamic_cast<const GpuError*>(&e)) throw GpuError(gpu->Status(), message);
  if (auto* nic = dynamic_cast<const RdmaError*>(&e)) throw RdmaError(nic->Status(), message);
  if (e.Code() == ErrorCode::Timeout) throw TimeoutError(message);
  throw Error(e.Code(), message);
}

RegisteredMemory RegisterCommMemory(Communicator::Impl& comm, void* ptr, size_t bytes, TransportFlags transports) {
  const int rank = comm.Rank();
  MORI_CHECK(ptr != nullptr && bytes > 0, ErrorCode::InvalidUsage,
             "rank %d: RegisterMemory(%p, %zu bytes) for %s: null pointer or empty range", rank, ptr, bytes,
             transports.ToString().c_str());
  MORI_CHECK(!transports.Empty(), ErrorCode::InvalidUsage,
             "rank %d: RegisterMemory(%p, %zu bytes) names no transport (Unknown is none)", rank, ptr, bytes);
  auto m = std::make_shared<RegisteredMemory::Impl>();
  m->data = ptr;
  m->originalData = ptr;
  m->size = bytes;
  m->ownerRank = rank;
  m->ownerHostId = comm.topology.hostIds.at(static_cast<size_t>(rank));
  m->ownerPid = static_cast<uint64_t>(getpid());
  m->ownerToken = core::ProcessToken();
  m->local = true;
  m->deviceMemory = IsDeviceMemoryPointer(ptr);
  m->transports = transports;
  // Registrations made before a failure are undone by m's releasers as it goes.
  for (int i = 0; i < kNumTransports; ++i) {
    auto t = static_cast<Transport>(i);
    if (!transports.Has(t)) continue;
    if (t == Transport::CudaIpc) {
      try {
        m->ipcHandle = ExportIpcMemory(ptr, bytes, &m->ipcFd);
      } catch (const Error& e) {
        MORI_THROW(ErrorCode::InvalidUsage,
                   "rank %d: RegisterMemory(%p, %zu bytes) for CudaIpc: the memory cannot be shared with same-host "
                   "peers (a GpuBuffer or a device allocation is needed): %s",
                   rank, ptr, bytes, e.what());
      }
      m->ipcHandle.ownerRank = rank;
      m->hasIpc = true;
    } else if (IsRdmaTransport(t)) {
      rdma::RdmaDeviceContext* nic = comm.Nic(t);
      rdma::RdmaMemoryRegion mr;
      try {
        mr = nic->RegisterRdmaMemoryRegion(ptr, bytes);
      } catch (const Error& e) {
        RethrowWithContext(
            e, StrFormat("rank %d: RegisterMemory(%p, %zu bytes) for %s", rank, ptr, bytes, TransportName(t)));
      }
      RdmaRegistration& reg = m->rdma[static_cast<size_t>(RdmaSlotOf(t))];
      reg.valid = true;
      reg.addr = mr.addr;
      reg.lkey = mr.lkey;
      reg.rkey = mr.rkey;
      reg.backend = static_cast<uint32_t>(nic->GetRdmaDevice()->Backend());
      std::weak_ptr<int> alive = comm.alive;
      m->releasers.push_back([alive, nic, ptr] {
        if (alive.lock() == nullptr) return;
        try {
          nic->DeregisterRdmaMemoryRegion(ptr);
        } catch (const Error& e) {
          MORI_LOG_WARN(Rdma, "deregistering %p from its NIC failed: %s", ptr, e.what());
        }
      });
    } else {
      m->tcpKey = tcp::RegisterTcpMemory(ptr, bytes, m->deviceMemory);
      m->hasTcp = true;
      uint32_t key = m->tcpKey;
      m->releasers.push_back([key] { tcp::DeregisterTcpMemory(key); });
      tcp::GrantTcpMemory(key, rank);  // its owner, through a loopback connection
    }
  }
  return RegisteredMemory(std::move(m));
}

void SendMemoryTo(Communicator::Impl& comm, const RegisteredMemory& memory, int remoteRank, int bootstrapTag) {
  const RegisteredMemory::Impl& m = *memory.GetImpl();
  // The receiving rank (this one too, for a loopback connection), and only it, may address the memory over
  // TCP from now on.
  if (m.local && m.hasTcp) tcp::GrantTcpMemory(m.tcpKey, remoteRank);
  if (remoteRank == comm.Rank()) {
    std::lock_guard<std::mutex> lock(comm.mutex);
    comm.selfMemory[bootstrapTag].push_back(memory);
    return;
  }
  comm.bootstrap->SendBytes(SerializeRegisteredMemory(m), remoteRank, bootstrapTag);
  if (!CarriesIpcNote(comm, m.transports, remoteRank)) return;
  int fd = m.IpcFd();
  IpcNote note{kIpcNoteMagic, fd >= 0 ? 1u : 0u, m.ownerPid, reinterpret_cast<uintptr_t>(m.originalData)};
  comm.fdChannel->Send(remoteRank, static_cast<uint64_t>(bootstrapTag), fd, &note, sizeof(note));
}

ReceivedMemory RecvMemoryUnmapped(Communicator::Impl& comm, int remoteRank, int bootstrapTag) {
  MORI_CHECK(remoteRank != comm.Rank(), ErrorCode::Internal,
             "rank %d: memory from self is taken whole (RecvMemoryFrom), not parsed", remoteRank);
  ReceivedMemory out;
  out.memory = ParseRegisteredMemory(comm.bootstrap->RecvBytes(remoteRank, bootstrapTag));
  const RegisteredMemory::Impl& m = *out.memory;
  if (!CarriesIpcNote(comm, m.transports, remoteRank)) return out;
  IpcNote note{};
  out.fd = comm.fdChannel->Recv(remoteRank, static_cast<uint64_t>(bootstrapTag), &note, sizeof(note));
  MORI_CHECK(note.magic == kIpcNoteMagic && note.ownerPid == m.ownerPid &&
                 note.originalData == reinterpret_cast<uintptr_t>(m.originalData),
             ErrorCode::Protocol,
             "the descriptor note (magic 0x%08x) names memory %p of pid %llu, the bytes it came beside name %p of "
             "pid %llu",
             note.magic, reinterpret_cast<void*>(static_cast<uintptr_t>(note.originalData)),
             static_cast<unsigned long long>(note.ownerPid), m.originalData,
             static_cast<unsigned long long>(m.ownerPid));
  MORI_CHECK((note.hasFd != 0) == out.fd.Valid(), ErrorCode::Protocol,
             "the descriptor note says %s descriptor, but %s came", note.hasFd != 0 ? "a" : "no",
             out.fd.Valid() ? "one" : "none");
  return out;
}

RegisteredMemory RecvMemoryFrom(Communicator::Impl& comm, int remoteRank, int bootstrapTag) {
  if (remoteRank == comm.Rank()) {
    // Nothing can arrive later from another thread in a way the caller could rely on: sent already, or never.
    std::lock_guard<std::mutex> lock(comm.mutex);
    auto it = comm.selfMemory.find(bootstrapTag);
    MORI_CHECK(it != comm.selfMemory.end() && !it->second.empty(), ErrorCode::InvalidUsage,
               "nothing was sent to self under this tag before (the matching send to rank %d must come first)",
               remoteRank);
    RegisteredMemory memory = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) comm.selfMemory.erase(it);
    return memory;
  }
  ReceivedMemory r = RecvMemoryUnmapped(comm, remoteRank, bootstrapTag);
  if (NeedsIpcMapping(*r.memory) && (r.fd.Valid() || !IpcKindNeedsFd(r.memory->ipcHandle))) {
    MapRegisteredMemory(*r.memory, std::move(r.fd));
  }
  return RegisteredMemory(std::move(r.memory));
}

Communicator::Communicator(std::shared_ptr<Bootstrap> bootstrap) : impl_(std::make_unique<Impl>()) {
  MORI_CHECK(bootstrap != nullptr, ErrorCode::InvalidUsage, "Communicator needs a bootstrap (got nullptr)");
  impl_->bootstrap = std::move(bootstrap);
  impl_->topology = DiscoverHostTopology(*impl_->bootstrap);
  impl_->fdChannel = std::make_unique<FdChannel>(*impl_->bootstrap);
}

Communicator::~Communicator() = default;

void Communicator::Impl::TrackListener(const std::shared_ptr<tcp::TcpListener>& listener) {
  std::lock_guard<std::mutex> lock(mutex);
  pendingListeners.erase(std::remove_if(pendingListeners.begin(), pendingListeners.end(),
                                        [](const std::weak_ptr<tcp::TcpListener>& w) { return w.expired(); }),
                         pendingListeners.end());
  pendingListeners.push_back(listener);
}

Communicator::Impl::~Impl() {
  for (const auto& w : pendingListeners) {
    if (auto listener = w.lock()) listener->Close();
  }
}

const std::shared_ptr<Bootstrap>& Communicator::GetBootstrap() const { return impl_->bootstrap; }
int Communicator::Rank() const { return impl_->Rank(); }
int Communicator::NRanks() const { return impl_->NRanks(); }

bool Communicator::SameHost(int rank) const {
  CheckRank(*impl_, rank, "SameHost asks about");
  return impl_->topology.SameHost(rank);
}

RegisteredMemory Communicator::RegisterMemory(void* ptr, size_t bytes, TransportFlags transports) {
  return RegisterCommMemory(*impl_, ptr, bytes, transports);
}

void Communicator::SendMemory(const RegisteredMemory& memory, int remoteRank, int tag) {
  MORI_CHECK(memory.Valid(), ErrorCode::InvalidUsage, "rank %d: SendMemory to rank %d of an empty RegisteredMemory",
             Rank(), remoteRank);
  CheckRank(*impl_, remoteRank, "SendMemory to");
  int bootstrapTag = CommTag(CommTagKind::Memory, tag);
  try {
    SendMemoryTo(*impl_, memory, remoteRank, bootstrapTag);
  } catch (const Error& e) {
    RethrowWithContext(e, StrFormat("rank %d: SendMemory to rank %d (tag %d)", Rank(), remoteRank, tag));
  }
}

std::shared_future<RegisteredMemory> Communicator::RecvMemory(int remoteRank, int tag) {
  CheckRank(*impl_, remoteRank, "RecvMemory from");
  int bootstrapTag = CommTag(CommTagKind::Memory, tag);
  Impl* impl = impl_.get();
  std::weak_ptr<int> alive = impl_->alive;
  const int rank = Rank();
  return std::async(std::launch::deferred,
                    [impl, alive, rank, remoteRank, tag, bootstrapTag] {
                      CheckCommunicatorAlive(
                          alive, StrFormat("rank %d: RecvMemory from rank %d (tag %d)", rank, remoteRank, tag));
                      try {
                        return RecvMemoryFrom(*impl, remoteRank, bootstrapTag);
                      } catch (const Error& e) {
                        RethrowWithContext(
                            e, StrFormat("rank %d: RecvMemory from rank %d (tag %d)", impl->Rank(), remoteRank, tag));
                      }
                    })
      .share();
}

namespace {

std::shared_future<std::shared_ptr<Connection>> ConnectSelf(Communicator::Impl& comm, const EndpointConfig& config,
                                                            int tag, int bootstrapTag) {
  // Both ends are ours and use one transport: no hello to pair them.
  const Transport t = config.transport;
  const std::string context =
      StrFormat("rank %d: Connect over %s to itself (tag %d)", comm.Rank(), TransportName(t), tag);
  std::shared_future<std::shared_ptr<Connection>> made;
  try {
    made = IsRdmaTransport(t) ? ConnectRdma(comm, config, comm.Rank(), tag, bootstrapTag)
                              : ConnectTcp(comm, config, comm.Rank(), tag, bootstrapTag);
  } catch (const Error& e) {
    RethrowWithContext(e, context);
  }
  return std::async(std::launch::deferred,
                    [made, context]() -> std::shared_ptr<Connection> {
                      try {
                        return made.get();
                      } catch (const Error& e) {
                        RethrowWithContext(e, context);
                      }
                    })
      .share();
}

}  // namespace

std::shared_future<std::shared_ptr<Connection>> Communicator::Connect(const EndpointConfig& config, int remoteRank,
                                                                      int tag) {
  const int rank = Rank();
  const Transport t = config.transport;
  MORI_CHECK(ValidTransport(t), ErrorCode::InvalidUsage,
             "rank %d: Connect to rank %d (tag %d) names transport %u (%s): choose CudaIpc, IB0..IB7, Tcp or Emulated",
             rank, remoteRank, tag, static_cast<unsigned>(t), ValidTransport(t) ? TransportName(t) : "Unknown");
  MORI_CHECK(remoteRank >= 0 && remoteRank < NRanks(), ErrorCode::InvalidUsage,
             "rank %d: Connect over %s to rank %d: ranks are 0..%d", rank, TransportName(t), remoteRank, NRanks() - 1);
  const int bootstrapTag = CommTag(CommTagKind::Connect, tag);
  MORI_CHECK(t != Transport::CudaIpc || remoteRank != rank, ErrorCode::InvalidUsage,
             "rank %d: Connect over CudaIpc to itself: a loopback connection needs IB0..IB7, Emulated or Tcp (local "
             "memory needs no CudaIpc connection)",
             rank);
  MORI_CHECK(t != Transport::CudaIpc || impl_->topology.SameHost(remoteRank), ErrorCode::InvalidUsage,
             "rank %d: Connect over CudaIpc to rank %d: rank %d runs on another host (CudaIpc shares memory within "
             "one host; use IB0..IB7, Emulated or Tcp)",
             rank, remoteRank, remoteRank);
  if (remoteRank == rank) return ConnectSelf(*impl_, config, tag, bootstrapTag);

  ConnectHello hello{kConnectHelloMagic, kConnectHelloVersion, static_cast<uint32_t>(t), rank, tag, 0};
  std::shared_future<std::shared_ptr<Connection>> made;
  try {
    impl_->bootstrap->Send(&hello, sizeof(hello), remoteRank, bootstrapTag);
    if (t == Transport::CudaIpc) {
      made = ConnectCudaIpc(*impl_, config, remoteRank, tag, bootstrapTag);
    } else if (IsRdmaTransport(t)) {
      made = ConnectRdma(*impl_, config, remoteRank, tag, bootstrapTag);
    } else {
      made = ConnectTcp(*impl_, config, remoteRank, tag, bootstrapTag);
    }
  } catch (const Error& e) {
    RethrowWithContext(
        e, StrFormat("rank %d: Connect over %s to rank %d (tag %d)", rank, TransportName(t), remoteRank, tag));
  }

  Impl* impl = impl_.get();
  std::weak_ptr<int> alive = impl_->alive;
  return std::async(std::launch::deferred,
                    [impl, alive, made, t, rank, remoteRank, tag, bootstrapTag]() -> std::shared_ptr<Connection> {
                      const std::string context = StrFormat("rank %d: Connect over %s to rank %d (tag %d)", rank,
                                                            TransportName(t), remoteRank, tag);
                      CheckCommunicatorAlive(alive, context);
                      ConnectHello theirs{};
                      try {
                        impl->bootstrap->Recv(&theirs, sizeof(theirs), remoteRank, bootstrapTag);
                      } catch (const Error& e) {
                        RethrowWithContext(e, context);
                      }
                      MORI_CHECK(theirs.magic == kConnectHelloMagic && theirs.version == kConnectHelloVersion &&
                                     theirs.rank == remoteRank && theirs.userTag == tag,
                                 ErrorCode::Protocol,
                                 "%s: the peer's hello is malformed (magic 0x%08x, version %u, rank %d, tag %d)",
                                 context.c_str(), theirs.magic, theirs.version, theirs.rank, theirs.userTag);
                      auto remote = static_cast<Transport>(theirs.transport);
                      MORI_CHECK(ValidTransport(remote), ErrorCode::Protocol, "%s: the peer names transport %u",
                                 context.c_str(), theirs.transport);
                      MORI_CHECK(TransportKind(remote) == TransportKind(t), ErrorCode::InvalidUsage,
                                 "%s: rank %d connects over %s: both sides of a connection must use the same "
                                 "transport",
                                 context.c_str(), remoteRank, TransportName(remote));
                      try {
                        return made.get();
                      } catch (const Error& e) {
                        RethrowWithContext(e, context);
                      }
                    })
      .share();
}

std::shared_future<std::shared_ptr<Semaphore>> Communicator::BuildSemaphore(
    const std::shared_ptr<Connection>& connection, int remoteRank, int tag) {
  return BuildSemaphoreWith(*impl_, connection, remoteRank, tag);
}

}  // namespace mori::core
