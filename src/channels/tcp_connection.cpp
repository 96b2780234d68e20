// The Tcp connection: checks the RegisteredMemory arguments and hands the work to the TCP link; and ConnectTcp,
// the connection maker Communicator::Connect calls (handle sent at the call, channels set up at get(); to its own
// rank: a loopback link, no bootstrap message).
#include "tcp_connection.hpp"

#include <utility>
#include <vector>

#include "communicator_impl.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/timeout.hpp"
#include "registered_memory_impl.hpp"

namespace mori::core {

namespace {

bool RangeFits(uint64_t offset, uint64_t bytes, uint64_t size) { return bytes <= size && offset <= size - bytes; }

}  // namespace

TcpConnection::TcpConnection(std::unique_ptr<tcp::TcpLink> link, int remoteRank, int tag)
    : Connection(remoteRank, tag), link_(std::move(link)) {}

TcpConnection::~TcpConnection() = default;

std::string TcpConnection::Describe() const {
  if (link_->IsLoopback())
    return StrFormat("Tcp loopback of rank %d (%d channels)", RemoteRank(), link_->NumChannels());
  return StrFormat("Tcp to rank %d (%d channels)", RemoteRank(), link_->NumChannels());
}

uint32_t TcpConnection::PeerKey(const RegisteredMemory& memory, uint64_t offset, uint64_t bytes,
                                const char* role) const {
  const RegisteredMemory::Impl* m = memory.GetImpl();
  MORI_CHECK(m != nullptr, ErrorCode::InvalidUsage, "%s: the %s is an empty RegisteredMemory", Describe().c_str(),
             role);
  if (link_->IsLoopback()) {
    // The serving end is this process: its own memory, registered here or received from itself.
    MORI_CHECK(m->local, ErrorCode::InvalidUsage,
               "%s: the %s must be memory of this process (a loopback connection reaches no other), not rank %d's",
               Describe().c_str(), role, m->ownerRank);
  } else {
    MORI_CHECK(!m->local && (m->ownerRank < 0 || m->ownerRank == RemoteRank()), ErrorCode::InvalidUsage,
               "%s: the %s must be rank %d's memory (from RecvMemory), not %s", Describe().c_str(), role, RemoteRank(),
               m->local ? "local memory" : StrFormat("rank %d's", m->ownerRank).c_str());
  }
  MORI_CHECK(m->hasTcp, ErrorCode::InvalidUsage, "%s: the %s (%llu bytes of rank %d) is not registered for Tcp (%s)",
             Describe().c_str(), role, static_cast<unsigned long long>(m->size), m->ownerRank,
             m->transports.ToString().c_str());
  MORI_CHECK(RangeFits(offset, bytes, m->size), ErrorCode::InvalidUsage,
             "%s: [%llu, + %llu) is outside the %s, which has %llu bytes", Describe().c_str(),
             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), role,
             static_cast<unsigned long long>(m->size));
  return m->tcpKey;
}

uint8_t* TcpConnection::LocalRange(const RegisteredMemory& memory, uint64_t offset, uint64_t bytes,
                                   const char* role) const {
  const RegisteredMemory::Impl* m = memory.GetImpl();
  MORI_CHECK(m != nullptr, ErrorCode::InvalidUsage, "%s: the %s is an empty RegisteredMemory", Describe().c_str(),
             role);
  MORI_CHECK(m->local && m->data != nullptr, ErrorCode::InvalidUsage,
             "%s: the %s must be memory registered in this process (it is rank %d's)", Describe().c_str(), role,
             m->ownerRank);
  MORI_CHECK(RangeFits(offset, bytes, m->size), ErrorCode::InvalidUsage,
             "%s: [%llu, + %llu) is outside the %s, which has %llu bytes", Describe().c_str(),
             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), role,
             static_cast<unsigned long long>(m->size));
  return static_cast<uint8_t*>(m->data) + offset;
}

void TcpConnection::Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src,
                          uint64_t srcOffset, uint64_t bytes) {
  uint32_t key = PeerKey(dst, dstOffset, bytes, "Write destination");
  uint8_t* from = LocalRange(src, srcOffset, bytes, "Write source");
  link_->Write(key, dstOffset, from, src.GetImpl()->deviceMemory, bytes);
}

void TcpConnection::UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) {
  MORI_CHECK(src != nullptr, ErrorCode::InvalidUsage, "%s: UpdateAndSync with a null local word", Describe().c_str());
  uint32_t key = PeerKey(dst, dstOffset, sizeof(uint64_t), "UpdateAndSync destination");
  *src = newValue;
  link_->UpdateWord(key, dstOffset, newValue);
}

void TcpConnection::Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src,
                         uint64_t srcOffset, uint64_t bytes) {
  uint8_t* to = LocalRange(dst, dstOffset, bytes, "Read destination");
  uint32_t key = PeerKey(src, srcOffset, bytes, "Read source");
  link_->Read(to, dst.GetImpl()->deviceMemory, key, srcOffset, bytes);
}

void TcpConnection::AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) {
  link_->FetchAdd(PeerKey(dst, dstOffset, sizeof(uint64_t), "atomic's target"), dstOffset, value, result);
}

void TcpConnection::AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                                      uint64_t* result) {
  link_->CompareSwap(PeerKey(dst, dstOffset, sizeof(uint64_t), "atomic's target"), dstOffset, compare, swap, result);
}

void TcpConnection::Flush(int64_t timeoutUs) { link_->Flush(timeoutUs); }

std::shared_future<std::shared_ptr<Connection>> ConnectTcp(Communicator::Impl& comm, const EndpointConfig& config,
                                                           int remoteRank, int tag, int bootstrapTag) {
  int device = config.device;
  if (device < 0 && GpuGetDevice(&device) != kGpuSuccess) device = -1;  // no GPU: host memory only
  tcp::TcpLinkOptions options = tcp::TcpLinkOptions::Resolve(config.tcp, device);
  if (remoteRank == comm.Rank()) {
    const int rank = remoteRank;
    return std::async(std::launch::deferred,
                      [options, rank, tag]() -> std::shared_ptr<Connection> {
                        return std::make_shared<TcpConnection>(tcp::TcpLink::Loopback(options, rank), rank, tag);
                      })
        .share();
  }
  std::shared_ptr<Bootstrap> bootstrap = comm.bootstrap;
  auto listener = std::make_shared<tcp::TcpListener>(options, bootstrap->GetRank());
  tcp::TcpLink::SendHandle(*bootstrap, *listener, remoteRank, bootstrapTag);
  comm.TrackListener(listener);
  return std::async(std::launch::deferred,
                    [bootstrap, listener, remoteRank, tag, bootstrapTag]() -> std::shared_ptr<Connection> {
                      std::vector<uint8_t> peerHandle = tcp::TcpLink::RecvHandle(*bootstrap, remoteRank, bootstrapTag);
                      auto link = std::make_unique<tcp::TcpLink>(std::move(*listener), peerHandle, remoteRank,
                                                                 Deadline::After(TimeoutSeconds()));
                      return std::make_shared<TcpConnection>(std::move(link), remoteRank, tag);
                    })
      .share();
}

}  // namespace mori::core
