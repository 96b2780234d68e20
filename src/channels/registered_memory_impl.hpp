// What a RegisteredMemory holds, shared by the communicator and the connections of every transport, and the
// pieces of its wire format that the communicator and the semaphores use beside the public Serialize.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mori/core/ipc_memory.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/channels/transport.hpp"
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
  uint64_t ownerToken = 0;       // ProcessToken() of the owner: local only where it, the host id and pid match
  bool local = false;
  bool deviceMemory = false;
  TransportFlags transports;

  // CudaIpc: the exported handle (local) or the peer's (remote) and, for a peer's memory, its mapping here
  // (shared: the semaphore pool maps a peer's pool once for all of its tokens).
  bool hasIpc = false;
  IpcMemoryHandle ipcHandle{};
  UniqueFd ipcFd;  // local: the exported descriptor that SendMemory hands to same-host peers
  std::shared_ptr<IpcMemoryMapping> mapping;

  std::array<RdmaRegistration, kRdmaSlots> rdma{};

  // Tcp: the key under which this process's TCP receivers accept writes into it (owner's key for a peer's).
  // Offsets on the wire are relative to this memory's start: a view has a key of its own.
  bool hasTcp = false;
  uint32_t tcpKey = 0;

  // A view (MakeRegisteredView) keeps the registration it is carved from alive.
  RegisteredMemory parent;

  // Undo the local registrations (NIC regions, TCP key) when the last copy goes.
  std::vector<std::function<void()>> releasers;

  // The descriptor to hand to same-host peers (a view's comes from the memory it is carved from); -1: none.
  int IpcFd() const {
    for (const Impl* m = this; m != nullptr; m = m->parent.GetImpl()) {
      if (m->ipcFd.Valid()) return m->ipcFd.Get();
    }
    return -1;
  }

  ~Impl() {
    for (auto it = releasers.rbegin(); it != releasers.rend(); ++it) (*it)();
  }
};

// Serialize's bytes (little-endian, packed):
//   header   u32 magic "MGRM", u16 version, u16 entry count, u32 total bytes, i32 owner rank, u64 owner host id,
//            u64 owner pid, u64 original pointer, u64 size, u32 transport bits, u8 device memory, u8[3] zero,
//            u64 owner process token (version 2)
//   entries  one per transport in the bits, in increasing transport order: u32 transport, u32 payload bytes, then
//            CudaIpc: IpcMemoryHandle (112 bytes); IBn/Emulated: u64 addr, u32 lkey, u32 rkey, u32 backend,
//            u32 zero (24 bytes); Tcp: u32 key (4 bytes).
constexpr uint32_t kRegisteredMemoryMagic = 0x4d52474dU;  // "MGRM"
constexpr uint16_t kRegisteredMemoryVersion = 2;
constexpr size_t kRegisteredMemoryHeaderBytes = 64;
constexpr size_t kRegisteredMemoryEntryHeaderBytes = 8;
constexpr size_t kRdmaEntryBytes = 24;
constexpr size_t kTcpEntryBytes = 4;

// RegisteredMemory::Serialize's bytes without granting TCP access to anyone (Communicator::SendMemory grants
// the receiving rank itself).
std::vector<uint8_t> SerializeRegisteredMemory(const RegisteredMemory::Impl& m);

// Validates `bytes` (Error(Protocol) naming what is wrong) and builds the memory without mapping anything:
// in the owner's process (same host id, pid and process token) data is the original pointer and the memory is local, else
// data is nullptr.
std::shared_ptr<RegisteredMemory::Impl> ParseRegisteredMemory(const std::vector<uint8_t>& bytes);

// CudaIpc memory of another process on this host: what MapRegisteredMemory can map.
bool NeedsIpcMapping(const RegisteredMemory::Impl& memory);
// Whether the mapping needs a descriptor beside the handle (memfd, CUDA VMM).
bool IpcKindNeedsFd(const IpcMemoryHandle& handle);
// Maps memory for which NeedsIpcMapping holds (data = the mapping); `fd` as IpcMemoryMapping::Import takes it.
void MapRegisteredMemory(RegisteredMemory::Impl& memory, UniqueFd fd);

// [offset, offset + bytes) of local memory `parent` as memory of its own: the same registrations (CudaIpc
// handle, NIC keys; a TCP key of its own), Data() and OriginalDataPtr() moved by `offset`. Keeps `parent` alive.
RegisteredMemory MakeRegisteredView(const RegisteredMemory& parent, uint64_t offset, uint64_t bytes);

// Whether the host cannot load and store `ptr` directly (CUDA/HIP device memory; never on HOST).
bool IsDeviceMemoryPointer(const void* ptr);
// The GPU whose device memory holds `ptr`, or -1 for any other memory (host memory, pinned or not; HOST).
int DeviceOfMemoryPointer(const void* ptr);

}  // namespace mori::core
