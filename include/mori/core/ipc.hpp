// Passing file descriptors (and a small payload with each) between processes of one host, over Unix
// datagram sockets with SCM_RIGHTS. This is how exported memory (memfd, CUDA VMM) reaches same-host peers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mori/core/bootstrap.hpp"
#include "mori/core/timeout.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::core {

class FdChannel {
 public:
  static constexpr size_t kMaxPayload = 1024;

  // Collective over the bootstrap: agrees on a job id, then binds this rank's socket (an abstract-namespace
  // name derived from job id and rank, so nothing is left in the filesystem).
  explicit FdChannel(Bootstrap& bootstrap);
  FdChannel(uint64_t jobId, int rank);
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  // Sends `payload` and a duplicate of `fd` (none when fd < 0) to `peer`, retrying until the peer's socket
  // exists or `deadline` passes.
  void Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes, const Deadline& deadline);
  void Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes);

  // Receives the message `peer` sent with `tag` (messages of other peers or tags are kept for later
  // calls). The payload size must equal `bytes`. Returns the descriptor (invalid when none was sent).
  UniqueFd Recv(int peer, uint64_t tag, void* payload, size_t bytes, const Deadline& deadline);
  UniqueFd Recv(int peer, uint64_t tag, void* payload, size_t bytes);

  uint64_t JobId() const;
  int Rank() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core
