// mlx5 implementation of the RDMA device primitives: WQE construction in the send queue, doorbell record and
// doorbell register writes, and CQE parsing. The same code drives a real ConnectX NIC (DirectVerbs) and the
// emulated NIC, whose queues have the same layout.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mori/core/atomic.hpp"
#include "mori/core/device.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"
#include "mori/rdma/device_primitives.hpp"  // the generic layer this specialises (include-guarded both ways)
#include "mori/rdma/queue_handles.hpp"

namespace mori::rdma {

#if MORI_DEVICE_API_AVAILABLE

namespace mlx5_detail {

using namespace mlx5;

MORI_HOST_DEVICE_INLINE uint8_t* WqeAt(const WorkQueueHandle& wq, uint32_t slot) {
  return static_cast<uint8_t*>(wq.sqAddr) + (static_cast<uintptr_t>(slot & (wq.sqWqeNum - 1)) << kSendWqeShift);
}

MORI_HOST_DEVICE_INLINE void Store32(void* p, uint32_t v) { *static_cast<volatile uint32_t*>(p) = v; }
MORI_HOST_DEVICE_INLINE void Store64(void* p, uint64_t v) {
  // Two 4-byte stores: WQE segments are only 4-byte aligned relative to one another in general.
  Store32(p, static_cast<uint32_t>(v));
  Store32(static_cast<uint8_t*>(p) + 4, static_cast<uint32_t>(v >> 32));
}

// Writes the control segment and returns its first 8 bytes, the value the doorbell carries.
MORI_HOST_DEVICE_INLINE uint64_t WriteCtrl(uint8_t* wqe, uint32_t slot, uint8_t opcode, uint32_t qpn, uint32_t ds,
                                           bool signal) {
  uint32_t opmodIdxOpcode = core::HostToBe32(MakeOpmodIdxOpcode(0, slot, opcode));
  uint32_t qpnDs = core::HostToBe32(MakeQpnDs(qpn, ds));
  Store32(wqe + 0, opmodIdxOpcode);
  Store32(wqe + 4, qpnDs);
  // signature, dci stream id and fm_ce_se share one word: signature 0, stream 0, completion flag.
  Store32(wqe + 8, static_cast<uint32_t>(signal ? kCtrlCqUpdate : 0) << 24);
  Store32(wqe + 12, 0);  // immediate
  return static_cast<uint64_t>(opmodIdxOpcode) | (static_cast<uint64_t>(qpnDs) << 32);
}

MORI_HOST_DEVICE_INLINE void WriteRaddr(uint8_t* seg, uintptr_t raddr, uint32_t rkey) {
  Store64(seg, core::HostToBe64(raddr));
  Store32(seg + 8, core::HostToBe32(rkey));
  Store32(seg + 12, 0);
}

MORI_HOST_DEVICE_INLINE void WriteData(uint8_t* seg, uint32_t bytes, uint32_t lkey, uintptr_t addr) {
  Store32(seg, core::HostToBe32(bytes));
  Store32(seg + 4, core::HostToBe32(lkey));
  Store64(seg + 8, core::HostToBe64(addr));
}

MORI_HOST_DEVICE_INLINE void CheckMessageSize(const WorkQueueHandle& wq, size_t bytes) {
  MORI_DEVICE_ASSERT(bytes <= kMaxMessageBytes, "qp %u: a message of %llu bytes exceeds the NIC's %u-byte limit",
                     wq.qpn, static_cast<unsigned long long>(bytes), kMaxMessageBytes);
}

MORI_HOST_DEVICE_INLINE uint64_t WriteRemoteOp(const WorkQueueHandle& wq, uint32_t slot, bool signal, uint8_t opcode,
                                               uint32_t qpn, uintptr_t laddr, uint32_t lkey, uintptr_t raddr,
                                               uint32_t rkey, size_t bytes) {
  CheckMessageSize(wq, bytes);
  uint8_t* wqe = WqeAt(wq, slot);
  WriteRaddr(wqe + sizeof(WqeCtrlSeg), raddr, rkey);
  WriteData(wqe + sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg), static_cast<uint32_t>(bytes), lkey, laddr);
  return WriteCtrl(wqe, slot, opcode, qpn, kWriteWqeDs, signal);
}

}  // namespace mlx5_detail

template <>
struct ProviderOps<ProviderType::MLX5> {
  MORI_HOST_DEVICE_INLINE static uint32_t NextSlot(WorkQueueHandle& wq) {
    return core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&wq.postIdx, 1u);
  }

  MORI_HOST_DEVICE_INLINE static uint64_t Write(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                                uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey,
                                                size_t bytes) {
    return mlx5_detail::WriteRemoteOp(wq, slot, signal, mlx5::kOpcodeRdmaWrite, qpn, laddr, lkey, raddr, rkey, bytes);
  }

  MORI_HOST_DEVICE_INLINE static uint64_t Read(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                               uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey,
                                               size_t bytes) {
    return mlx5_detail::WriteRemoteOp(wq, slot, signal, mlx5::kOpcodeRdmaRead, qpn, laddr, lkey, raddr, rkey, bytes);
  }

  // Inline data follows the raddr segment in the same basic block. More than the QP allows is a caller's
  // error and traps (a NIC would read the declared length past the block). Only what fits in the block is
  // ever copied, so a handle that claims more than the QP has cannot spill into the next slot either: the
  // NIC then answers with a local length error.
  MORI_HOST_DEVICE_INLINE static uint64_t WriteInline(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                                      const void* val, uintptr_t raddr, uint32_t rkey, size_t bytes) {
    using namespace mlx5;
    MORI_DEVICE_ASSERT(bytes <= wq.maxInlineData, "qp %u: %llu inline bytes exceed the QP's %u", wq.qpn,
                       static_cast<unsigned long long>(bytes), wq.maxInlineData);
    uint8_t* wqe = mlx5_detail::WqeAt(wq, slot);
    uint8_t* seg = wqe + sizeof(WqeCtrlSeg);
    mlx5_detail::WriteRaddr(seg, raddr, rkey);
    seg += sizeof(WqeRaddrSeg);
    mlx5_detail::Store32(seg, core::HostToBe32(static_cast<uint32_t>(bytes) | kInlineSegFlag));
    uint32_t copied = bytes < kMaxInlineInOneBlock ? static_cast<uint32_t>(bytes) : kMaxInlineInOneBlock;
    const auto* src = static_cast<const uint8_t*>(val);
    volatile uint8_t* dst = seg + sizeof(WqeInlineSeg);
    for (uint32_t i = 0; i < copied; ++i) dst[i] = src[i];
    uint32_t ds = DescriptorSegments(sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg) + sizeof(WqeInlineSeg) + copied);
    return mlx5_detail::WriteCtrl(wqe, slot, kOpcodeRdmaWrite, qpn, ds, signal);
  }

  template <typename T>
  MORI_HOST_DEVICE_INLINE static uint64_t Atomic(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                                 uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey, T val1,
                                                 T val2, AtomicOp op) {
    static_assert(sizeof(T) == 8 && std::is_integral_v<T>, "mlx5 RDMA atomics operate on 8-byte integers");
    using namespace mlx5;
    uint8_t* wqe = mlx5_detail::WqeAt(wq, slot);
    uint8_t* seg = wqe + sizeof(WqeCtrlSeg);
    mlx5_detail::WriteRaddr(seg, raddr, rkey);
    seg += sizeof(WqeRaddrSeg);
    mlx5_detail::Store64(seg, core::HostToBe64(static_cast<uint64_t>(val1)));
    mlx5_detail::Store64(seg + 8, core::HostToBe64(op == AtomicOp::CompareSwap ? static_cast<uint64_t>(val2) : 0));
    seg += sizeof(WqeAtomicSeg);
    mlx5_detail::WriteData(seg, sizeof(T), lkey, laddr);  // where the original value lands
    uint8_t opcode = op == AtomicOp::CompareSwap ? kOpcodeAtomicCompareSwap : kOpcodeAtomicFetchAdd;
    return mlx5_detail::WriteCtrl(wqe, slot, opcode, qpn, kAtomicWqeDs, signal);
  }

  MORI_HOST_DEVICE_INLINE static uint64_t Send(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn,
                                               uintptr_t laddr, uint32_t lkey, size_t bytes) {
    mlx5_detail::CheckMessageSize(wq, bytes);
    uint8_t* wqe = mlx5_detail::WqeAt(wq, slot);
    mlx5_detail::WriteData(wqe + sizeof(mlx5::WqeCtrlSeg), static_cast<uint32_t>(bytes), lkey, laddr);
    return mlx5_detail::WriteCtrl(wqe, slot, mlx5::kOpcodeSend, qpn, mlx5::kSendWqeDs, signal);
  }

  MORI_HOST_DEVICE_INLINE static uint64_t Nop(WorkQueueHandle& wq, uint32_t slot, bool signal, uint32_t qpn) {
    return mlx5_detail::WriteCtrl(mlx5_detail::WqeAt(wq, slot), slot, mlx5::kOpcodeNop, qpn, 1, signal);
  }

  MORI_HOST_DEVICE_INLINE static void Recv(WorkQueueHandle& wq, uintptr_t laddr, uint32_t lkey, size_t bytes) {
    uint32_t slot = wq.rqPostIdx;
    uint32_t completed = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::Device>(&wq.rqDoneIdx);
    MORI_DEVICE_ASSERT(slot - completed < wq.rqWqeNum,
                       "qp %u: the receive queue is full (%u posted, %u completed); poll receive completions first",
                       wq.qpn, slot, completed);
    uint8_t* wqe = static_cast<uint8_t*>(wq.rqAddr) + (slot & (wq.rqWqeNum - 1)) * mlx5::kReceiveWqeBytes;
    mlx5_detail::WriteData(wqe, static_cast<uint32_t>(bytes), lkey, laddr);
    wq.rqPostIdx = slot + 1;
    // Release: the receive descriptor is written before the record that hands it to the NIC.
    core::AtomicStore<core::MemoryOrder::Release, core::Scope::System>(static_cast<uint32_t*>(wq.rqDbrRecAddr),
                                                                       core::HostToBe32((slot + 1) & 0xffffu));
  }

  MORI_HOST_DEVICE_INLINE static void UpdateSendDbrRecord(void* dbrRecAddr, uint32_t wqeIdx) {
    // Release: descriptors are written before the doorbell record that makes them the NIC's.
    core::AtomicStore<core::MemoryOrder::Release, core::Scope::System>(static_cast<uint32_t*>(dbrRecAddr),
                                                                       core::HostToBe32(wqeIdx & 0xffffu));
  }

  MORI_HOST_DEVICE_INLINE static void RingDoorbell(void* dbrAddr, uint64_t dbrVal) {
    // The doorbell record is updated before the doorbell rings: the NIC reads the record when it hears it.
    core::AtomicFence<core::MemoryOrder::SeqCst, core::Scope::System>();
    core::MmioStore64(dbrAddr, dbrVal);
  }

  // Looks at the entry at consIdx without consuming it. The owner bit and opcode share the CQE's last
  // 4-byte word with the WQE counter, so one aligned load sees them together.
  MORI_HOST_DEVICE_INLINE static int PeekCq(void* cqAddr, uint32_t cqeNum, uint32_t consIdx, CqeInfo* info) {
    using namespace mlx5;
    uint8_t* cqe = static_cast<uint8_t*>(cqAddr) + static_cast<uintptr_t>(consIdx & (cqeNum - 1)) * kCqeBytes;
    // Acquire: the rest of the entry is read only after its owner bit says it is complete.
    uint32_t tail = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(
        reinterpret_cast<const uint32_t*>(cqe + offsetof(Cqe64, wqeCounter)));
    uint8_t opOwn = static_cast<uint8_t>(tail >> 24);
    uint8_t opcode = opOwn >> 4;
    uint8_t expectedOwner = (consIdx & cqeNum) ? 1 : 0;
    if (opcode == kCqeInvalid || (opOwn & kCqeOwnerMask) != expectedOwner) return kCqEmpty;
    bool error = opcode == kCqeReqErr || opcode == kCqeRespErr;
    if (info != nullptr) {
      info->wqeCounter = core::BeToHost16(static_cast<uint16_t>(tail & 0xffffu));
      info->byteCount = core::BeToHost32(*reinterpret_cast<volatile uint32_t*>(cqe + offsetof(Cqe64, byteCnt)));
      info->qpn = core::BeToHost32(*reinterpret_cast<volatile uint32_t*>(cqe + offsetof(Cqe64, sopDropQpn))) & 0xffffffu;
      info->isSend = opcode == kCqeReq || opcode == kCqeReqErr;
    }
    if (error) return CqErrorCode(*reinterpret_cast<volatile uint8_t*>(cqe + offsetof(ErrCqe, syndrome)));
    return opcode;
  }

  MORI_HOST_DEVICE_INLINE static int PollCq(void* cqAddr, uint32_t cqeNum, uint32_t* consIdx, CqeInfo* info) {
    int r = PeekCq(cqAddr, cqeNum, *consIdx, info);
    if (r != kCqEmpty) *consIdx += 1;
    return r;
  }

  MORI_HOST_DEVICE_INLINE static void UpdateCqDbrRecord(void* dbrRecAddr, uint32_t consIdx) {
    core::AtomicStore<core::MemoryOrder::Release, core::Scope::System>(
        static_cast<uint32_t*>(dbrRecAddr), core::HostToBe32(consIdx & kCqConsumerIndexMaskValue));
  }

  static constexpr uint32_t kCqConsumerIndexMaskValue = mlx5::kCqConsumerIndexMask;
};

#endif  // MORI_DEVICE_API_AVAILABLE

}  // namespace mori::rdma
