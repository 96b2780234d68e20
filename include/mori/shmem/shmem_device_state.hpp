// The state a kernel needs to reach every PE, built by ShmemInit and uploaded to each translation unit that
// includes the device API (shmem_state_access.hpp). Plain data; includes nothing host-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "mori/channels/fifo_device.hpp"
#include "mori/rdma/queue_handles.hpp"

namespace mori::shmem {

constexpr uint32_t kShmemStateMagic = 0x53484d31;  // "SHM1": set while the runtime is initialised
// The name of the state in a module loaded by handle (see MORI_SHMEM_MODULE_BY_HANDLE).
constexpr const char kShmemModuleStateSymbol[] = "mori_shmem_module_state";

// One QP to a peer with its CQ, in memory every posting thread reaches.
struct ShmemQueuePair {
  rdma::WorkQueueHandle wq;
  rdma::CompletionQueueHandle cq;
};

// A local buffer registered with the NIC outside the heap (ShmemBufferRegister): puts may read from it and
// gets may land in it over RDMA.
struct ShmemLocalRegion {
  uintptr_t base;
  uint64_t bytes;
  uint32_t lkey;
  uint32_t reserved;
};

// The runtime's own words at the start of every PE's heap (same offsets everywhere); user allocations start
// at kShmemHeapUserOffset.
constexpr uint64_t kShmemBarrierCounterOffset = 0;  // uint64: barrier arrivals at this PE
constexpr uint64_t kShmemDiscardOffset = 64;        // uint64: where non-fetching NIC atomics put the old value
constexpr uint64_t kShmemFetchSlotsOffset = 128;    // uint64[kShmemFetchSlots]: results of fetching NIC ops
constexpr uint32_t kShmemFetchSlots = 1024;
constexpr uint64_t kShmemTeamSyncOffset = 8448;    // uint64[kShmemMaxTeams]: team sync arrivals at this PE
constexpr uint32_t kShmemMaxTeams = 32;             // team slots per PE, world and node included
constexpr uint64_t kShmemHeapUserOffset = 16384;
static_assert(kShmemFetchSlotsOffset + kShmemFetchSlots * 8 <= kShmemTeamSyncOffset, "internal heap area overlaps");
static_assert(kShmemTeamSyncOffset + kShmemMaxTeams * 8 <= kShmemHeapUserOffset, "internal heap area overlaps");

constexpr uint32_t kShmemMaxLocalRegions = 32;

// How many PEs' mapped heap bases the state carries inline (see ShmemDeviceState::mappedWindow).
constexpr uint32_t kShmemMappedWindow = 64;

// One team slot as kernels see it (the same slot number on every member).
struct ShmemTeamState {
  int32_t size;            // PEs in the team; 0: the slot holds no team
  int32_t myIndex;         // this PE's number in the team, -1 when it is not a member
  int32_t start;           // world PE of member 0
  int32_t stride;          // > 0: member i is world PE start + i * stride; 0: look it up in `members`
  const int32_t* members;  // [size] world PEs, ascending
};

struct ShmemDeviceState {
  uint32_t magic;
  int32_t rank;
  int32_t nPes;
  uint32_t qpsPerPe;
  uintptr_t heapBase;      // this PE's heap
  uint64_t heapBytes;      // the same on every PE
  uint64_t timeoutNs;      // MORI_TIMEOUT_S: every device-side wait is bounded by it
  uint32_t heapLkey;
  uint32_t nicAtomics;     // 1: every atomic and signal goes through the NIC (some PE is reached over RDMA)
  uint32_t reserved[2];
  const uint8_t* transports;     // [nPes] TransportType
  const uintptr_t* peerBases;    // [nPes] the PE's heap mapped here (Self, P2P); 0 otherwise
  const uintptr_t* remoteBases;  // [nPes] the PE's heap address in its own process (the RDMA target address)
  const uint32_t* rkeys;         // [nPes]
  ShmemQueuePair* queues;        // [nPes * qpsPerPe] QPs to each RDMA-reached PE (to itself: loopback)
  uint32_t* fetchTicket;         // next fetch slot ticket
  uint32_t* fetchTurn;           // [kShmemFetchSlots] the ticket lap that owns each slot now
  uint64_t* barrierSeq;          // device barriers entered by this PE
  const ShmemLocalRegion* localRegions;  // [kShmemMaxLocalRegions], the used ones first (bytes 0 ends them)
  // The Proxy transport (all zero when no PE uses it).
  core::FifoDeviceHandle proxyFifo;  // requests of shmem_proxy_request.hpp, popped by this PE's proxy thread
  uint64_t* proxyResults;            // [kShmemFetchSlots] host-pinned: results of fetching proxy requests
  uint32_t proxyAtomics;             // 1: every atomic, signal and quiet goes through the proxy (some PE uses it)
  uint32_t reserved2;
  // peerBases of PEs [mappedFirst, mappedFirst + mappedCount) inline, so that the P2P hot path reads its
  // target from the state itself (constant memory on GPUs, whose cache an acquire does not invalidate) rather
  // than from the global table. The window holds every mapped PE when they lie within kShmemMappedWindow
  // consecutive PEs (one host of a job with its ranks in host order); PEs outside it use the table.
  int32_t mappedFirst;
  uint32_t mappedCount;
  uintptr_t mappedWindow[kShmemMappedWindow];
  // Teams (ShmemTeam is the slot number), in device memory; their contents change at splits and destroys.
  const ShmemTeamState* teams;  // [kShmemMaxTeams]
  uint64_t* teamSyncSeq;        // [kShmemMaxTeams] device team syncs entered by this PE, per slot
  // The process's stop word (core/stop.hpp): every wait leaves the kernel once it is set. nullptr: no stop.
  const uint32_t* stopWord;
};
static_assert(std::is_trivially_copyable_v<ShmemDeviceState>, "ShmemDeviceState is copied as bytes");

}  // namespace mori::shmem
