// The communicator's state, shared with the connection makers of each transport, and the exchanges they
// build on.
//
// Bootstrap tags: CommTag(kind, userTag) = kind << 24 | userTag, so the exchanges of each kind and user tag
// have a (peer, tag) queue of their own; messages of one queue arrive in the order sent.
//
// Connect(config, peer, tag) does, in this order:
//   1. validates (transport, ranks, tag; CudaIpc needs the peer on this host);
//   2. sends a ConnectHello (below) to the peer under CommTag(Connect, tag);
//   3. calls the maker of the transport (ConnectCudaIpc / ConnectRdma / ConnectTcp) with
//      bootstrapTag = CommTag(Connect, tag): the maker sends what it must at once and returns a future whose
//      get() receives (its messages queue behind the hello under the same tag, or use CommTag(Rdma|Tcp, tag));
//   4. the returned future's get() receives the peer's hello first and throws InvalidUsage on both sides when
//      the transports do not pair (CudaIpc with CudaIpc, Tcp with Tcp, IBn/Emulated with IBn/Emulated: a maker
//      of RDMA connections checks that the two NICs can talk), and only then gets the maker's future.
// ConnectRdma's get() ends with a ready note each way after connecting its QP, so it returns only once the
// peer's get() has run too. So a maker needs no handshake of its own for the transport kind. After a failed Connect the peer's maker
// messages may remain queued under that tag: do not reuse the (peer, tag) pair.
//
// Loopback (peer == own rank; IBn, Emulated and Tcp, not CudaIpc): no hello is exchanged and the maker is
// called with remoteRank == comm.Rank(); it must not rely on the bootstrap delivering messages to self (a
// user's bootstrap need not). ConnectRdma connects two endpoints of this process to each other. Memory sent
// to self (SendMemory, a semaphore's token) never touches the bootstrap either: it waits in selfMemory.
#pragma once

#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/rdma/rdma.hpp"
#include "registered_memory_impl.hpp"

namespace mori::core {

// Bootstrap tags of the communicator's exchanges: kind and the user's tag (< 2^24) in one non-negative int.
enum class CommTagKind : int { Memory = 1, Connect = 2, Semaphore = 3, Tcp = 4, Rdma = 5 };
constexpr int kMaxUserTag = (1 << 24) - 1;
// Throws InvalidUsage naming the tag when userTag is outside [0, kMaxUserTag].
int CommTag(CommTagKind kind, int userTag);

// The first message of every Connect, both ways (step 2 above).
struct ConnectHello {
  uint32_t magic;
  uint32_t version;
  uint32_t transport;  // Transport of the sender's end
  int32_t rank;        // the sender
  int32_t userTag;
  uint32_t reserved;
};
constexpr uint32_t kConnectHelloMagic = 0x4d434f4eU;  // "MCON"
constexpr uint32_t kConnectHelloVersion = 1;
static_assert(sizeof(ConnectHello) == 24, "ConnectHello travels as bytes");

class SemaphorePool;  // semaphore.cpp
namespace tcp {
class TcpListener;
}

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

  // Expires with the communicator: releasers of NIC registrations that outlive it skip the deregistration
  // (the NIC context, and every region on it, went with the communicator).
  std::shared_ptr<int> alive = std::make_shared<int>(0);

  // Semaphore tokens (one pool per communicator; semaphores share its ownership).
  std::shared_ptr<SemaphorePool> semaphorePool;

  // Memory this rank sent to itself, by bootstrap tag, in the order sent (guarded by `mutex`).
  std::map<int, std::deque<RegisteredMemory>> selfMemory;

  // The listeners of Tcp connects whose futures are not taken yet (guarded by `mutex`). The communicator closes
  // them when it goes: a future taken after that fails anyway, and one never taken would otherwise hold its
  // ports for as long as the caller keeps it.
  std::vector<std::weak_ptr<tcp::TcpListener>> pendingListeners;
  void TrackListener(const std::shared_ptr<tcp::TcpListener>& listener);

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  int Rank() const { return topology.rank; }
  int NRanks() const { return topology.nRanks; }
};

// Throws InvalidUsage when the communicator behind `alive` is gone: a deferred future (RecvMemory, Connect,
// BuildSemaphore) whose get() comes after the Communicator was destroyed has nothing left to receive with.
void CheckCommunicatorAlive(const std::weak_ptr<int>& alive, const std::string& what);

// RegisterMemory's work (the semaphore pool registers its memory through it too).
RegisteredMemory RegisterCommMemory(Communicator::Impl& comm, void* ptr, size_t bytes, TransportFlags transports);

// Memory on the wire: the serialized bytes over the bootstrap under `bootstrapTag` and, for a same-host peer
// when the memory has CudaIpc, a note with the descriptor (none for legacy IPC kinds) on the FdChannel
// under the same tag. Sender and receiver decide "same host and CudaIpc" alike, so the two stay paired.
void SendMemoryTo(Communicator::Impl& comm, const RegisteredMemory& memory, int remoteRank, int bootstrapTag);
struct ReceivedMemory {
  std::shared_ptr<RegisteredMemory::Impl> memory;  // parsed, not mapped
  UniqueFd fd;                                     // the descriptor that came with it, if any
};
ReceivedMemory RecvMemoryUnmapped(Communicator::Impl& comm, int remoteRank, int bootstrapTag);
// The same, mapped where it can be (RegisteredMemory::Deserialize's rule). From self: the memory sent.
RegisteredMemory RecvMemoryFrom(Communicator::Impl& comm, int remoteRank, int bootstrapTag);

// Rethrows `e` with `context` in front of its message, keeping its code (and TimeoutError's class).
[[noreturn]] void RethrowWithContext(const Error& e, const std::string& context);

// BuildSemaphore's work (semaphore.cpp).
std::shared_future<std::shared_ptr<Semaphore>> BuildSemaphoreWith(Communicator::Impl& comm,
                                                                  const std::shared_ptr<Connection>& connection,
                                                                  int remoteRank, int tag);

// Connection makers per transport: called by Communicator::Connect with the bootstrap tag of this exchange.
std::shared_future<std::shared_ptr<Connection>> ConnectCudaIpc(Communicator::Impl& comm, const EndpointConfig& config,
                                                               int remoteRank, int tag, int bootstrapTag);
std::shared_future<std::shared_ptr<Connection>> ConnectRdma(Communicator::Impl& comm, const EndpointConfig& config,
                                                            int remoteRank, int tag, int bootstrapTag);
std::shared_future<std::shared_ptr<Connection>> ConnectTcp(Communicator::Impl& comm, const EndpointConfig& config,
                                                           int remoteRank, int tag, int bootstrapTag);

}  // namespace mori::core
