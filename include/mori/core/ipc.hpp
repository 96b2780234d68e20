// Passing file descriptors (and a small payload with each) between processes of one host, over Unix
// datagram sockets with SCM_RIGHTS. This is how exported memory (memfd, CUDA VMM) reaches same-host peers.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/core/timeout.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::core {

// Who sent a received message, as the kernel reported it (SCM_CREDENTIALS), not as the message claims.
struct IpcSender {
  int rank = -1;
  pid_t pid = 0;
  uid_t uid = 0;
};

// Abstract socket names are visible to every process of the network namespace (/proc/net/unix) and open to
// any of them, whatever its uid. So the receiver accepts a message only when the kernel says it came from a
// process of this uid whose pid is the pid of the rank the message names; anything else is dropped with a
// warning naming the sender's pid and uid, and the descriptor that came with it is closed.
class FdChannel {
 public:
  static constexpr size_t kMaxPayload = 1024;

  // Collective over the bootstrap: agrees on a job id, binds this rank's socket (an abstract-namespace name
  // derived from job id and rank, so nothing is left in the filesystem), then gathers every rank's pid. When
  // it returns, every rank holds its own name, so none of the names can be taken by a stranger any more.
  // The ranks of one host must share a pid namespace (a pid is compared as the receiver sees it).
  explicit FdChannel(Bootstrap& bootstrap);
  // Without a bootstrap: `rankPids[r]` is the pid of rank r, as this process sees it.
  FdChannel(uint64_t jobId, int rank, std::vector<pid_t> rankPids);
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  // Sends `payload` and a duplicate of `fd` (none when fd < 0) to `peer`, retrying until the peer's socket
  // exists or `deadline` passes.
  void Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes, const Deadline& deadline);
  void Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes);

  // Receives the message `peer` sent with `tag` (messages of other peers or tags are kept for later
  // calls). The payload size must equal `bytes`. Returns the descriptor (invalid when none was sent) and,
  // in *sender when given, the credentials the message was checked with. A timeout names the last message
  // refused for claiming to come from `peer`, if there was one.
  UniqueFd Recv(int peer, uint64_t tag, void* payload, size_t bytes, const Deadline& deadline,
                IpcSender* sender = nullptr);
  UniqueFd Recv(int peer, uint64_t tag, void* payload, size_t bytes);

  uint64_t JobId() const;
  int Rank() const;
  // The pid every message from `rank` must come from.
  pid_t RankPid(int rank) const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core
