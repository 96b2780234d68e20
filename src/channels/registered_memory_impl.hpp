// What a RegisteredMemory holds, shared by the communicator and the connections of every transport.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mori/core/ipc_memory.hpp"
#include "mori/core/registered_memory.hpp"
#include "mori/core/transport.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::core {

// RDMA registrations: IB0..IB7 at their index, Emulated at kEmulatedRdmaSlot.
constexpr int kEmulatedRdmaSlot = kNumIbTransports;
constexpr int kRdmaSlots = kNumIbTransports + 1;
inline int RdmaSlotOf(Transport t) { return t == Transport::Emulated ? kEmulatedRdmaSlot : IbIndex(t); }

struct RdmaRegistration {
  bool valid = false;
  uint64_t addr = 0;  // the address the NIC knows the memory by (the owner's pointer)
  uint32_t lkey = 0;  // meaningful in the owner's process only
  uint32_t rkey = 0;
  uint32_t backend = 0;  // rdma::RdmaBackendType of the NIC that registered it
};

struct RegisteredMemory::Impl {
  void* data = nullptr;          // local: the registered pointer; a peer's: where it is mapped here, or nullptr
  void* originalData = nullptr;  // the pointer in the owner's process
  uint64_t size = 0;
  int ownerRank = -1;
  uint64_t ownerHostId = 0;      // HostIdentity() of the owner
  uint64_t ownerPid = 0;
  bool local = false;
  bool deviceMemory = false;
  TransportFlags transports;

  // CudaIpc: the exported handle (local) or the peer's (remote) and, for a peer's memory, its mapping here.
  bool hasIpc = false;
  IpcMemoryHandle ipcHandle{};
  UniqueFd ipcFd;  // local: the exported descriptor that SendMemory hands to same-host peers
  std::unique_ptr<IpcMemoryMapping> mapping;

  std::array<RdmaRegistration, kRdmaSlots> rdma{};

  // Tcp: the key under which this process's TCP receivers accept writes into it (owner's key for a peer's).
  bool hasTcp = false;
  uint32_t tcpKey = 0;

  // Undo the local registrations (NIC regions, TCP key) when the last copy goes.
  std::vector<std::function<void()>> releasers;

  ~Impl() {
    for (auto it = releasers.rbegin(); it != releasers.rend(); ++it) (*it)();
  }
};

}  // namespace mori::core
