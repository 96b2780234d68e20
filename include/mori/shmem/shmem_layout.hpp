// The layout signature of the SHMEM device state: one number for the layout of ShmemDeviceState, of the tables
// it points to and of the proxy requests kernels push. Code compiled against mori's headers carries the
// signature of those headers, and the runtime takes device code only when the two agree: a kernel module built
// against other headers would otherwise read the runtime's tables with its own strides (a stale test module
// did, on an H200 on 2026-11-29, and the illegal address took down every process sharing the GPU under MPS).
// Plain data; includes nothing host-only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/shmem/shmem_device_state.hpp"
#include "mori/shmem/shmem_proxy_request.hpp"

namespace mori::shmem {

// Raised by hand when a meaning changes that no size or offset below shows (a field of a pointed-to struct
// reused for something else, a new proxy op); sizes, offsets and the request encoding are checked anyway.
constexpr uint64_t kShmemLayoutVersion = 1;

// The name of the signature in a module loaded by handle (see MORI_SHMEM_MODULE_BY_HANDLE).
constexpr const char kShmemModuleLayoutSymbol[] = "mori_shmem_module_layout";

namespace layout_detail {

// FNV-1a over the eight bytes of each value.
MORI_HOST_DEVICE_INLINE constexpr uint64_t Fold(uint64_t hash, uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    hash ^= (value >> (8 * i)) & 0xffu;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

#define MORI_SHMEM_STATE_OFFSET(field) static_cast<uint64_t>(offsetof(ShmemDeviceState, field))

MORI_HOST_DEVICE_INLINE constexpr uint64_t Signature() {
  const ProxyHeader sample{ProxyOp::PutSignal, 3, 1, 8, 0x12345u, 0x6789abcdefull};
  const core::ProxyTrigger encoded = EncodeProxyHeader(sample);
  // Grouped by kind, several to a line.
  // clang-format off
  const uint64_t parts[] = {
      kShmemLayoutVersion,
      sizeof(ShmemDeviceState), alignof(ShmemDeviceState), sizeof(ShmemQueuePair),
      sizeof(rdma::WorkQueueHandle), sizeof(rdma::CompletionQueueHandle), sizeof(ShmemTeamState),
      sizeof(ShmemLocalRegion), sizeof(core::FifoDeviceHandle), sizeof(core::ProxyTrigger),
      kShmemStateMagic, kShmemMaxTeams, kShmemMaxLocalRegions, kShmemMappedWindow, kShmemFetchSlots,
      kShmemBarrierCounterOffset, kShmemDiscardOffset, kShmemFetchSlotsOffset, kShmemTeamSyncOffset,
      kShmemHeapUserOffset, kProxyMaxSlots, kProxyInlineBytes, encoded.fst, encoded.snd,
      MORI_SHMEM_STATE_OFFSET(magic), MORI_SHMEM_STATE_OFFSET(rank), MORI_SHMEM_STATE_OFFSET(nPes),
      MORI_SHMEM_STATE_OFFSET(qpsPerPe), MORI_SHMEM_STATE_OFFSET(heapBase), MORI_SHMEM_STATE_OFFSET(heapBytes),
      MORI_SHMEM_STATE_OFFSET(timeoutNs), MORI_SHMEM_STATE_OFFSET(heapLkey), MORI_SHMEM_STATE_OFFSET(nicAtomics),
      MORI_SHMEM_STATE_OFFSET(transports), MORI_SHMEM_STATE_OFFSET(peerBases),
      MORI_SHMEM_STATE_OFFSET(remoteBases), MORI_SHMEM_STATE_OFFSET(rkeys), MORI_SHMEM_STATE_OFFSET(queues),
      MORI_SHMEM_STATE_OFFSET(fetchTicket), MORI_SHMEM_STATE_OFFSET(fetchTurn),
      MORI_SHMEM_STATE_OFFSET(barrierSeq), MORI_SHMEM_STATE_OFFSET(localRegions),
      MORI_SHMEM_STATE_OFFSET(proxyFifo), MORI_SHMEM_STATE_OFFSET(proxyResults),
      MORI_SHMEM_STATE_OFFSET(proxyAtomics), MORI_SHMEM_STATE_OFFSET(mappedFirst),
      MORI_SHMEM_STATE_OFFSET(mappedCount), MORI_SHMEM_STATE_OFFSET(mappedWindow), MORI_SHMEM_STATE_OFFSET(teams),
      MORI_SHMEM_STATE_OFFSET(teamSyncSeq), MORI_SHMEM_STATE_OFFSET(stopWord),
  };
  // clang-format on
  uint64_t hash = 0xcbf29ce484222325ull;
  for (uint64_t part : parts) hash = Fold(hash, part);
  return hash;
}

#undef MORI_SHMEM_STATE_OFFSET

}  // namespace layout_detail

constexpr uint64_t kShmemLayoutSignature = layout_detail::Signature();

}  // namespace mori::shmem
