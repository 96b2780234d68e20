// Plain structs that describe an RDMA endpoint's queues and keys, shared by host and device code and
// safe to send to a peer as bytes. A kernel works on WorkQueueHandle / CompletionQueueHandle placed in
// memory it can reach (device or host-pinned memory): their index fields are updated atomically by the
// threads that post and poll. Includes nothing host-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "mori/core/device.hpp"

namespace mori::rdma {

enum class ProviderType : uint32_t { Unknown = 0, MLX5 = 1, IBVerbs = 2 };

// What a peer needs to connect to an endpoint: plain bytes. `gid` is the RoCE/IB GID (the emulated NIC
// uses the IPv4-mapped address of its wire); `wirePort` is the emulated NIC's TCP port and `wireNonce` the
// random secret its wire asks of every connection (only holders of a handle can talk to it); both 0 otherwise.
struct RdmaEndpointHandle {
  uint32_t psn;
  uint32_t qpn;
  uint32_t portId;
  uint16_t lid;
  uint16_t wirePort;
  uint8_t gid[16];
  uint32_t mtu;       // path MTU in bytes
  uint32_t provider;  // ProviderType of the NIC that made it
  uint64_t wireNonce;
};
static_assert(sizeof(RdmaEndpointHandle) == 48 && std::is_trivially_copyable_v<RdmaEndpointHandle>,
              "RdmaEndpointHandle travels as bytes");

// A registered memory region: what a local post needs (addr, lkey) and what a remote post needs (addr, rkey).
struct RdmaMemoryRegion {
  uintptr_t addr;
  uint32_t lkey;
  uint32_t rkey;
  size_t length;
};
static_assert(std::is_trivially_copyable_v<RdmaMemoryRegion>, "RdmaMemoryRegion travels as bytes");

// A send queue (and the receive queue of the same QP). Slots are numbered by a free-running 32-bit counter;
// slot s lives at sqAddr + (s % sqWqeNum) * 64.
//   postIdx     next slot to reserve (threads reserve with an atomic add)
//   dbTouchIdx  slots before it are announced to the NIC: doorbells are rung in slot order
//   doneIdx     slots before it have completed (advanced from CQEs by whoever polls)
struct WorkQueueHandle {
  void* sqAddr;
  uint32_t sqWqeNum;  // power of two
  uint32_t postIdx;
  uint32_t dbTouchIdx;
  uint32_t doneIdx;
  void* dbrRecAddr;    // the send-queue doorbell record (a big-endian word: the next slot's index)
  void* dbrAddr;       // the doorbell register (UAR / BlueFlame), written with 8 bytes
  void* rqAddr;
  uint32_t rqWqeNum;   // power of two
  uint32_t rqPostIdx;  // next receive slot
  uint32_t rqDoneIdx;  // receive slots before it have completed
  void* rqDbrRecAddr;  // the receive-queue doorbell record
  uint32_t qpn;
  uint32_t maxInlineData;
  const uint32_t* stop;  // the process's stop word (core/stop.hpp): waits on this queue leave the kernel once set
  // The rank at the other end plus one, set by whoever connected the QP (SetPeerRank); 0, as in a zeroed handle:
  // not said. The device traps of waits on this queue name it (PeerRank), so a report says who went silent.
  uint32_t peerRankPlus1;
};
static_assert(std::is_trivially_copyable_v<WorkQueueHandle> && std::is_standard_layout_v<WorkQueueHandle> &&
                  std::is_trivially_default_constructible_v<WorkQueueHandle>,
              "WorkQueueHandle is plain data");

// The rank at the other end of `wq`'s QP, -1 when nobody said.
MORI_HOST_DEVICE_INLINE int PeerRank(const WorkQueueHandle& wq) { return static_cast<int>(wq.peerRankPlus1) - 1; }
MORI_HOST_DEVICE_INLINE void SetPeerRank(WorkQueueHandle& wq, int rank) {
  wq.peerRankPlus1 = static_cast<uint32_t>(rank) + 1;
}

// A receive completion taken off the CQ by a thread that was retiring send completions, kept for whoever
// polls for receives.
struct CqStashEntry {
  int32_t result;  // what PollCq returns for it
  uint32_t wqeCounter;
  uint32_t byteCount;
  uint32_t qpn;
};

// A completion queue. consIdx counts consumed entries; entry i lives at cqAddr + (i % cqeNum) * cqeSize and
// belongs to software when its owner bit equals (i / cqeNum) & 1.
struct CompletionQueueHandle {
  static constexpr uint32_t kStashSize = 16;

  void* cqAddr;
  uint32_t cqeNum;  // power of two
  uint32_t cqeSize;
  uint32_t consIdx;
  uint32_t pollLock;     // held by the thread consuming entries
  void* dbrRecAddr;      // consumer-index doorbell record
  uint32_t errorCount;   // error CQEs consumed through the full-form poll or while retiring
  uint32_t firstError;   // syndrome << 16 | wqe counter of the first of them
  uint32_t stashHead;    // receive completions set aside: [stashHead, stashTail) of the ring below
  uint32_t stashTail;
  CqStashEntry stash[kStashSize];
};
static_assert(std::is_trivially_copyable_v<CompletionQueueHandle>, "CompletionQueueHandle is plain data");

}  // namespace mori::rdma
