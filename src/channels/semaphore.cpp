// Semaphores: token words carved from slabs of device memory that the communicator's pool registers once per
// transport, exchanged as views (one 8-byte inbound token each) so that the peer's connection can update them.
//
// Token block of one semaphore (kTokenBlockBytes, in a slab):
//   +0  inbound   raised by the peer (its proxy through the connection, or its kernels through a mapping)
//   +8  expected  signals this side's kernels have consumed
//   +16 outbound  signals this side's kernels have sent (memory channels)
// The host side (Semaphore::Signal, Poll, Wait) keeps its own counts.
#include "mori/channels/semaphore.hpp"

#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "communicator_impl.hpp"
#include "device_zero.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/format.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"
#include "mori/core/timeout.hpp"
#include "proxy_copy.hpp"
#include "registered_memory_impl.hpp"
#include "semaphore_impl.hpp"

namespace mori::core {

namespace {

constexpr size_t kTokenBlockBytes = 32;
constexpr size_t kSlabBytes = 64 * 1024;
constexpr size_t kBlocksPerSlab = kSlabBytes / kTokenBlockBytes;

// What follows the inbound token's bytes on the bootstrap: which semaphore it belongs to, so a message of
// another exchange can never be taken for it unnoticed.
struct TokenNote {
  uint32_t magic;
  int32_t rank;
  int32_t userTag;
  uint32_t transport;
};
constexpr uint32_t kTokenNoteMagic = 0x4d53454dU;  // "MSEM"

}  // namespace

// Slabs of zeroed device memory, each registered for a transport when a semaphore of it first asks.
class SemaphorePool {
 public:
  struct Block {
    uint64_t* words;           // kTokenBlockBytes / 8 words, zero
    RegisteredMemory inbound;  // view of words[0], registered for the transport
  };

  Block Take(Communicator::Impl& comm, Transport transport) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slabs& slabs = byTransport_[static_cast<int>(transport)];
    if (slabs.used == kBlocksPerSlab || slabs.memory.empty()) {
      auto buffer = std::make_unique<GpuBuffer>(kSlabBytes, MemoryType::Device);
      if (IsDeviceMemoryPointer(buffer->Data())) {
        ZeroDeviceMemory(buffer->Data(), kSlabBytes);
      } else {
        std::memset(buffer->Data(), 0, kSlabBytes);
      }
      RegisteredMemory reg = RegisterCommMemory(comm, buffer->Data(), kSlabBytes, TransportFlags(transport));
      slabs.buffers.push_back(std::move(buffer));
      slabs.memory.push_back(std::move(reg));
      slabs.used = 0;
    }
    size_t offset = slabs.used++ * kTokenBlockBytes;
    Block block;
    block.words = reinterpret_cast<uint64_t*>(slabs.buffers.back()->DataAs<uint8_t>() + offset);
    block.inbound = MakeRegisteredView(slabs.memory.back(), offset, sizeof(uint64_t));
    return block;
  }

 private:
  struct Slabs {
    // Registrations go before their buffers (declared after: destroyed first).
    std::vector<std::unique_ptr<GpuBuffer>> buffers;
    std::vector<RegisteredMemory> memory;
    size_t used = 0;
  };
  std::mutex mutex_;
  std::map<int, Slabs> byTransport_;
};

Semaphore::Semaphore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Semaphore::~Semaphore() = default;

const std::shared_ptr<Connection>& Semaphore::GetConnection() const { return impl_->connection; }
int Semaphore::RemoteRank() const { return impl_->remoteRank; }
const RegisteredMemory& Semaphore::LocalInboundToken() const { return impl_->localInbound; }
const RegisteredMemory& Semaphore::RemoteInboundToken() const { return impl_->remoteInbound; }

void Semaphore::Signal() {
  Impl& s = *impl_;
  uint64_t next = s.hostOutbound + 1;
  s.connection->UpdateAndSync(s.remoteInbound, 0, &s.hostOutbound, next);
}

bool Semaphore::Poll() {
  Impl& s = *impl_;
  if (s.LoadInbound() <= s.hostExpected) return false;
  ++s.hostExpected;
  return true;
}

void Semaphore::Wait(int64_t timeoutUs) {
  Impl& s = *impl_;
  Deadline deadline = timeoutUs < 0 ? Deadline::Default() : Deadline::After(static_cast<double>(timeoutUs) * 1e-6);
  uint64_t expected = s.hostExpected + 1;
  for (;;) {
    uint64_t seen = s.LoadInbound();
    if (seen >= expected) break;
    if (deadline.Expired()) {
      throw TimeoutError(StrFormat(
          "rank %d: waited %.3f s for signal #%llu from rank %d over %s (%llu arrived): did the peer die or never "
          "signal?",
          s.rank, deadline.TotalSeconds(), static_cast<unsigned long long>(expected), s.remoteRank,
          s.connection->Describe().c_str(), static_cast<unsigned long long>(seen)));
    }
    std::this_thread::yield();
  }
  s.hostExpected = expected;
}

SemaphoreDeviceHandle Semaphore::DeviceHandle() const {
  const Impl& s = *impl_;
  SemaphoreDeviceHandle h{};
  h.inboundToken = s.words;
  h.expectedInboundToken = s.words + 1;
  h.outboundToken = s.words + 2;
  h.remoteInboundToken =
      s.connection->GetTransport() == Transport::CudaIpc ? static_cast<uint64_t*>(s.remoteInbound.Data()) : nullptr;
  h.timeoutNs = static_cast<uint64_t>(TimeoutSeconds() * 1e9);
  h.rank = s.rank;
  h.remoteRank = s.remoteRank;
  h.stop = DeviceStopWord();
  return h;
}

std::shared_future<std::shared_ptr<Semaphore>> BuildSemaphoreWith(Communicator::Impl& comm,
                                                                  const std::shared_ptr<Connection>& connection,
                                                                  int remoteRank, int tag) {
  const int rank = comm.Rank();
  MORI_CHECK(connection != nullptr, ErrorCode::InvalidUsage, "rank %d: BuildSemaphore with rank %d: no connection",
             rank, remoteRank);
  MORI_CHECK(connection->RemoteRank() == remoteRank, ErrorCode::InvalidUsage,
             "rank %d: BuildSemaphore with rank %d over %s, a connection to rank %d", rank, remoteRank,
             connection->Describe().c_str(), connection->RemoteRank());
  const int bootstrapTag = CommTag(CommTagKind::Semaphore, tag);
  const Transport transport = connection->GetTransport();
  const std::string context = StrFormat("rank %d: BuildSemaphore with rank %d over %s (tag %d)", rank, remoteRank,
                                        connection->Describe().c_str(), tag);

  auto impl = std::make_unique<Semaphore::Impl>();
  impl->connection = connection;
  impl->rank = rank;
  impl->remoteRank = remoteRank;
  try {
    {
      std::lock_guard<std::mutex> lock(comm.mutex);
      if (comm.semaphorePool == nullptr) comm.semaphorePool = std::make_shared<SemaphorePool>();
      impl->pool = comm.semaphorePool;
    }
    SemaphorePool::Block block = impl->pool->Take(comm, transport);
    impl->words = block.words;
    impl->localInbound = std::move(block.inbound);
    impl->deviceTokens = IsDeviceMemoryPointer(impl->words);
    if (impl->deviceTokens) {
      impl->stream = HostCopyStream();
      MORI_CHECK_GPU(GpuEventCreate(&impl->read));
      impl->landing = GpuBuffer(sizeof(uint64_t), MemoryType::HostPinned);
    }
    // Over a loopback connection the semaphore is its own peer: its signals raise its own token, and nothing
    // is exchanged (so no two loopback semaphores can swap tokens, whatever order their get()s come in).
    if (remoteRank != rank) {
      SendMemoryTo(comm, impl->localInbound, remoteRank, bootstrapTag);
      TokenNote note{kTokenNoteMagic, rank, tag, static_cast<uint32_t>(transport)};
      comm.bootstrap->Send(&note, sizeof(note), remoteRank, bootstrapTag);
    } else {
      impl->remoteInbound = impl->localInbound;
    }
  } catch (const Error& e) {
    RethrowWithContext(e, context);
  }

  Communicator::Impl* c = &comm;
  std::weak_ptr<int> alive = comm.alive;
  const bool loopback = remoteRank == rank;
  std::shared_ptr<Semaphore::Impl> pending(impl.release());
  return std::async(
             std::launch::deferred,
             [c, alive, loopback, pending, remoteRank, tag, bootstrapTag, context]() -> std::shared_ptr<Semaphore> {
               CheckCommunicatorAlive(alive, context);
               try {
                 if (!loopback) {
                   pending->remoteInbound = RecvMemoryFrom(*c, remoteRank, bootstrapTag);
                   TokenNote note{};
                   c->bootstrap->Recv(&note, sizeof(note), remoteRank, bootstrapTag);
                   MORI_CHECK(note.magic == kTokenNoteMagic && note.rank == remoteRank && note.userTag == tag,
                              ErrorCode::Protocol, "the peer's token note is malformed (magic 0x%08x, rank %d, tag %d)",
                              note.magic, note.rank, note.userTag);
                 }
                 const RegisteredMemory& remote = pending->remoteInbound;
                 MORI_CHECK(remote.Size() == sizeof(uint64_t) && remote.Rank() == remoteRank, ErrorCode::Protocol,
                            "the peer's token is %zu bytes of rank %d (expected 8 bytes of rank %d)", remote.Size(),
                            remote.Rank(), remoteRank);
                 MORI_CHECK(pending->connection->GetTransport() != Transport::CudaIpc || remote.Data() != nullptr,
                            ErrorCode::Protocol, "the peer's token came without a mapping for CudaIpc");
               } catch (const Error& e) {
                 RethrowWithContext(e, context);
               }
               // The Impl moves into the semaphore; `pending` is the only owner until then.
               auto owned = std::make_unique<Semaphore::Impl>();
               std::swap(owned->pool, pending->pool);
               owned->connection = pending->connection;
               owned->rank = pending->rank;
               owned->remoteRank = pending->remoteRank;
               owned->words = pending->words;
               owned->localInbound = pending->localInbound;
               owned->remoteInbound = pending->remoteInbound;
               owned->deviceTokens = pending->deviceTokens;
               owned->stream = pending->stream;
               owned->read = pending->read;
               owned->landing = std::move(pending->landing);
               pending->deviceTokens = false;  // the event is owned's now
               return std::make_shared<Semaphore>(std::move(owned));
             })
      .share();
}

}  // namespace mori::core
