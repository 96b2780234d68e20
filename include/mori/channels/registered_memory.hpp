// A memory range made reachable by peers through one or more transports, and the same range as a peer sees
// it after the exchange (Communicator::SendMemory / RecvMemory). Serialises to bytes: address, size, owner,
// transports, IPC handle, RDMA keys, TCP key. Copies share one registration; the last copy releases it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "mori/channels/transport.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::core {

class RegisteredMemory {
 public:
  RegisteredMemory() = default;

  // Where this process reaches the memory: the registered pointer for local memory; for a peer's memory the
  // address it is mapped at here (CudaIpc on the same host), else nullptr.
  void* Data() const;
  // The pointer in the owner's process.
  void* OriginalDataPtr() const;
  size_t Size() const;
  // The rank that registered it (-1 when made without a communicator).
  int Rank() const;
  TransportFlags Transports() const;
  // Registered in this process.
  bool IsLocal() const;
  // Device memory of the owner's GPU (false: host memory, pinned or not).
  bool IsDeviceMemory() const;
  bool Valid() const { return impl_ != nullptr; }

  // Count-prefixed, versioned bytes. A file descriptor that the mapping needs (CUDA VMM, memfd) does not
  // travel in them; Communicator::SendMemory passes it beside them to same-host peers.
  std::vector<uint8_t> Serialize() const;
  // Validates the bytes (malformed, truncated or foreign: Error with code Protocol naming what is wrong).
  // Maps the memory here when it is CudaIpc memory of another process on this host and the mapping needs no
  // descriptor or `fd` carries it.
  static RegisteredMemory Deserialize(const std::vector<uint8_t>& data, UniqueFd fd = UniqueFd());

  struct Impl;
  explicit RegisteredMemory(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Impl* GetImpl() const { return impl_.get(); }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace mori::core
