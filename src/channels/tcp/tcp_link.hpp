// The multi-channel TCP link between two processes: N sockets (channels), each bound to an interface
// round-robin; transfers cut into chunks dealt round-robin to the channels, each channel with a sliding window
// of unacknowledged chunks. The receiver validates every frame (tcp_wire.hpp) and the target range
// (tcp_registry.hpp) before writing, and acknowledges a chunk only once it is written. Internal API: usable
// from a bootstrap without a Communicator; TcpConnection (tcp_connection.hpp) wraps it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/connection.hpp"
#include "mori/core/timeout.hpp"
#include "socket.hpp"
#include "tcp/tcp_wire.hpp"

namespace mori::core::tcp {

struct TcpLinkOptions {
  int numChannels = 4;
  int windowChunks = 16;  // ordered frames in flight per channel
  uint64_t chunkBytes = 512 << 10;
  std::vector<std::string> ifnames;  // channel i binds to ifnames[i % size]; empty: see TcpListener
  int device = -1;                   // GPU whose memory the link copies (-1: none named)
  bool receive = true;  // tests only: false parks the receivers, as a peer that stops reading would
  std::function<void()> beforeApplyForTest;  // tests only: runs in a receiver before it applies a Write frame

  // `tcp`'s fields where set, else MORI_TCP_CHANNELS / MORI_TCP_WINDOW / MORI_TCP_CHUNK_SIZE and
  // MORI_SOCKET_IFNAME; throws InvalidUsage naming a value out of range.
  static TcpLinkOptions Resolve(const EndpointConfig::Tcp& tcp, int device = -1);
};

// The first half of setting up a link: one listening socket per channel, at the address of the channel's
// interface (no interfaces named: the address the bootstrap would pick, PickLocalAddress), and the handle
// that tells the peer where they are.
class TcpListener {
 public:
  TcpListener(const TcpLinkOptions& options, int rank);
  TcpListener(TcpListener&&) noexcept;
  TcpListener& operator=(TcpListener&&) noexcept;
  ~TcpListener();

  // Closes the listening sockets now (a link made from this listener afterwards fails to connect).
  void Close();

  const TcpHandle& Handle() const;
  std::vector<uint8_t> HandleBytes() const;

  struct State;  // tcp_setup.hpp
  State& GetState() { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

struct TcpChannelInfo {
  int index = 0;
  std::string ifname;  // empty: none named
  net::SocketAddress local;
  net::SocketAddress peer;
  uint64_t bytesSent = 0;  // Write and ReadData payload
  uint64_t bytesReceived = 0;
};

class TcpLink {
 public:
  // The second half: establishes the channels with the peer whose handle arrived. The side with the lower
  // (rank, nonce) accepts, the other connects, channel by channel, with a hello carrying both nonces; stray or
  // foreign connections to a listener are refused (logged, counted) and do not disturb the setup. Throws
  // Protocol for a malformed handle, InvalidUsage when the two sides ask for different channel counts,
  // TimeoutError when the peer does not come by `deadline`.
  TcpLink(TcpListener listener, const std::vector<uint8_t>& peerHandle, int peerRank, const Deadline& deadline);
  // Both halves through a bootstrap: sends this side's handle under `tag`, receives the peer's.
  static std::unique_ptr<TcpLink> Connect(Bootstrap& bootstrap, int peerRank, int tag, const TcpLinkOptions& options);
  // A link of this process to itself, no bootstrap involved: the returned end issues, a second end it owns
  // serves, over real sockets, so writes, reads and word operations on this process's memory take the same
  // receiver path (and the same word locks) as a peer's.
  static std::unique_ptr<TcpLink> Loopback(const TcpLinkOptions& options, int rank);
  // Does not wait for work in flight; never hangs on a peer that is gone.
  ~TcpLink();
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  // The handle exchange of Connect, for callers that hold the halves apart. RecvHandle refuses (Protocol)
  // anything that is not a well-formed handle before allocating for it.
  static void SendHandle(Bootstrap& bootstrap, const TcpListener& listener, int peerRank, int tag);
  static std::vector<uint8_t> RecvHandle(Bootstrap& bootstrap, int peerRank, int tag);

  // The operations of core::Connection on keys of the peer's TCP registry (tcp_registry.hpp) and local
  // pointers (`*Device`: device memory of this process's GPU, copied through a pinned bounce buffer). They
  // return once queued; Flush waits for completion. One thread drives them. A failed link throws its error.
  void Write(uint32_t dstKey, uint64_t dstOffset, const void* src, bool srcDevice, uint64_t bytes);
  void UpdateWord(uint32_t dstKey, uint64_t dstOffset, uint64_t value);
  void Read(void* dst, bool dstDevice, uint32_t srcKey, uint64_t srcOffset, uint64_t bytes);
  void FetchAdd(uint32_t dstKey, uint64_t dstOffset, uint64_t value, uint64_t* result);
  void CompareSwap(uint32_t dstKey, uint64_t dstOffset, uint64_t compare, uint64_t swap, uint64_t* result);
  // Returns once everything issued before is acknowledged (writes written, reads and atomic results landed);
  // throws the link's first failure (naming the channel), or TimeoutError after `timeoutUs` (negative:
  // MORI_TIMEOUT_S) naming what is outstanding.
  void Flush(int64_t timeoutUs = -1);

  int NumChannels() const;
  const TcpLinkOptions& Options() const;
  int PeerRank() const;
  bool IsLoopback() const;
  bool Failed() const;
  std::vector<TcpChannelInfo> Channels() const;
  // Connections refused at the listeners during setup (stray, foreign, malformed hello).
  int RefusedConnections() const;
  // "Tcp rank 0 <-> rank 1 (4 channels)".
  std::string Describe() const;

  // Tests: puts raw bytes on channel `channel`'s socket between two frames, as a corrupt peer would.
  void InjectRawBytesForTest(int channel, std::vector<uint8_t> bytes);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core::tcp
