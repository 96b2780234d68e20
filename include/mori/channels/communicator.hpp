// Setting up channels between the ranks of a bootstrap: register memory for transports, exchange it, connect
// to peers and build semaphores over the connections. Exchanges are matched by (peer, tag) and by call order:
// both sides make the matching calls in the same order. Results come as futures: the sending half of an
// exchange happens at the call, the receiving half at get().
#pragma once

#include <cstddef>
#include <future>
#include <memory>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/connection.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/channels/semaphore.hpp"
#include "mori/channels/transport.hpp"

namespace mori::core {

class Communicator {
 public:
  // Collective over the bootstrap's ranks (learns which ranks share this host and opens the channel that
  // hands memory descriptors to them).
  explicit Communicator(std::shared_ptr<Bootstrap> bootstrap);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const std::shared_ptr<Bootstrap>& GetBootstrap() const;
  int Rank() const;
  int NRanks() const;
  // Whether `rank` runs on this host (can share memory through CudaIpc).
  bool SameHost(int rank) const;

  // Registers [ptr, ptr + bytes) for `transports` (CudaIpc: a shareable GpuBuffer or device allocation; IBn
  // and Emulated: registered with that NIC; Tcp: writable by the TCP receiver). Throws InvalidUsage naming
  // the pointer and the transport when the memory cannot be registered for it.
  RegisteredMemory RegisterMemory(void* ptr, size_t bytes, TransportFlags transports);

  // To self (remoteRank == Rank()): the matching RecvMemory gets the same memory back, no bootstrap involved.
  void SendMemory(const RegisteredMemory& memory, int remoteRank, int tag = 0);
  std::shared_future<RegisteredMemory> RecvMemory(int remoteRank, int tag = 0);

  // Both sides call Connect towards each other with the same tag and transport. Over IBn/Emulated, get() also
  // waits until the peer's get() has connected its end (no request may reach a queue pair not yet ready), so
  // ranks take their connections' get() in one consistent order (by increasing peer rank, say).
  // remoteRank == Rank(): a loopback connection to this process's own memory (IBn, Emulated, Tcp; not CudaIpc),
  // made without bootstrap messages; its atomics are atomic with the peers' atomics through that NIC.
  std::shared_future<std::shared_ptr<Connection>> Connect(const EndpointConfig& config, int remoteRank, int tag = 0);

  // Both sides call it for their ends of one connection.
  std::shared_future<std::shared_ptr<Semaphore>> BuildSemaphore(const std::shared_ptr<Connection>& connection,
                                                                int remoteRank, int tag = 0);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core
