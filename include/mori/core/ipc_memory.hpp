// Sharing memory with processes on the same host: export a range as a handle (plus a file descriptor for
// memfd and CUDA VMM memory), send both to the peer (FdChannel), and map it there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::core {

enum class IpcMemoryKind : uint32_t {
  HostMemfd = 1,   // memfd, mapped with mmap
  CudaVmm = 2,     // CUDA VMM allocation exported as a POSIX file descriptor
  CudaLegacy = 3,  // cudaIpcMemHandle_t in `legacyHandle`
  HipLegacy = 4,   // hipIpcMemHandle_t in `legacyHandle`
};

const char* IpcMemoryKindName(IpcMemoryKind kind);

// Plain bytes, safe to send to a peer. For HostMemfd and CudaVmm a file descriptor travels with it.
struct IpcMemoryHandle {
  uint32_t magic;
  uint32_t kind;             // IpcMemoryKind
  int32_t ownerRank;         // set by whoever sends it; -1 when unknown
  int32_t ownerDevice;
  uint64_t ownerPid;
  uint64_t allocationBytes;  // the whole exported allocation
  uint64_t offset;           // of the shared range inside it
  uint64_t bytes;            // of the shared range
  uint8_t legacyHandle[64];
};
static_assert(std::is_trivially_copyable_v<IpcMemoryHandle> && sizeof(IpcMemoryHandle) == 112,
              "IpcMemoryHandle travels as bytes");

// Exports [ptr, ptr + bytes). ptr must lie inside a shareable GpuBuffer, or on CUDA/HIP inside any device
// allocation. *fd receives the descriptor to send along (invalid for the legacy kinds). Throws
// InvalidUsage naming the pointer when the range is not shareable memory.
IpcMemoryHandle ExportIpcMemory(const void* ptr, size_t bytes, UniqueFd* fd);

// A peer's memory mapped into this process (on CUDA/HIP: into the current device's address space).
class IpcMemoryMapping {
 public:
  // Validates the handle (malformed -> Protocol error) and maps it.
  static std::unique_ptr<IpcMemoryMapping> Import(const IpcMemoryHandle& handle, UniqueFd fd);
  ~IpcMemoryMapping();
  IpcMemoryMapping(const IpcMemoryMapping&) = delete;
  IpcMemoryMapping& operator=(const IpcMemoryMapping&) = delete;

  void* Data() const { return data_; }
  size_t Bytes() const { return handle_.bytes; }
  const IpcMemoryHandle& Handle() const { return handle_; }

 private:
  IpcMemoryMapping() = default;
  IpcMemoryHandle handle_{};
  void* base_ = nullptr;  // of the whole mapping
  void* data_ = nullptr;  // base_ + offset
};

// Collective over the ranks of the bootstrap: each rank exports [ptr, ptr + bytes) and maps every
// same-host peer's. Entry r of the result is rank r's range, mapped here; nullptr for this rank and for
// ranks on other hosts. `tag` separates concurrent exchanges.
std::vector<std::shared_ptr<IpcMemoryMapping>> ExchangeIpcMemory(Bootstrap& bootstrap, const HostTopology& topology,
                                                                 FdChannel& channel, const void* ptr, size_t bytes,
                                                                 uint64_t tag = 0);

}  // namespace mori::core
