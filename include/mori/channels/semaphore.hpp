// A semaphore between this process and one peer over a connection (Communicator::BuildSemaphore). Kernels
// wait on it through its device handle; the peer raises it either from its proxy (Semaphore::Signal, which a
// port channel's Signal becomes) or from its kernels (memory channels, CudaIpc only). One side signals either
// from its proxy or from its kernels, not both: the two keep separate counts.
#pragma once

#include <cstdint>
#include <memory>

#include "mori/channels/connection.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/channels/semaphore_device.hpp"

namespace mori::core {

class Semaphore {
 public:
  struct Impl;
  explicit Semaphore(std::unique_ptr<Impl> impl);
  ~Semaphore();
  Semaphore(const Semaphore&) = delete;
  Semaphore& operator=(const Semaphore&) = delete;

  const std::shared_ptr<Connection>& GetConnection() const;
  int RemoteRank() const;

  // From a host thread (the proxy): one more signal to the peer, after every write issued before on the
  // connection. Complete at the connection's Flush.
  void Signal();
  // Host-side consumption of the peer's signals (host-to-host use and tests).
  bool Poll();
  void Wait(int64_t timeoutUs = -1);  // negative: MORI_TIMEOUT_S; throws TimeoutError naming the peer

  // The local token words (device memory) and the peer's inbound token as registered memory.
  const RegisteredMemory& LocalInboundToken() const;
  const RegisteredMemory& RemoteInboundToken() const;

  SemaphoreDeviceHandle DeviceHandle() const;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core
