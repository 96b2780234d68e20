// mlx5 descriptor formats (the "PRM" layouts): send-queue WQE segments, completion-queue entries, opcodes,
// syndromes and doorbell-record slots, as the NIC reads and writes them. Every multi-byte field is
// big-endian. Written from the ConnectX programming model; tests/unit/mlx5_prm_test.cpp checks sizes,
// offsets and values against rdma-core's <infiniband/mlx5dv.h> where it is installed. Host and device
// include this file, so it includes nothing host-only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::rdma::mlx5 {

// Send-queue geometry: a WQE is one or more 64-byte basic blocks, made of 16-byte segments ("octowords").
constexpr uint32_t kSendWqeBasicBlock = 64;
constexpr uint32_t kSendWqeShift = 6;
constexpr uint32_t kSegmentBytes = 16;
constexpr uint32_t kReceiveWqeBytes = 16;  // one data segment per receive WQE
constexpr uint32_t kCqeBytes = 64;

enum Opcode : uint8_t {
  kOpcodeNop = 0x00,
  kOpcodeRdmaWrite = 0x08,
  kOpcodeRdmaWriteImm = 0x09,
  kOpcodeSend = 0x0a,
  kOpcodeSendImm = 0x0b,
  kOpcodeRdmaRead = 0x10,
  kOpcodeAtomicCompareSwap = 0x11,
  kOpcodeAtomicFetchAdd = 0x12,
  kOpcodeAtomicMaskedCompareSwap = 0x14,
  kOpcodeAtomicMaskedFetchAdd = 0x15,
};

// ctrl.fmCeSe bits.
constexpr uint8_t kCtrlCqUpdate = 2 << 2;  // generate a CQE when this WQE completes
constexpr uint8_t kCtrlSolicited = 1 << 1;
constexpr uint8_t kCtrlFence = 4 << 5;     // wait for earlier reads and atomics before executing

// Control segment: the first 16 bytes of every send WQE; its first 8 bytes are what the doorbell carries.
struct WqeCtrlSeg {
  uint32_t opmodIdxOpcode;  // opmod << 24 | wqe index (16 bits) << 8 | opcode
  uint32_t qpnDs;           // qpn << 8 | ds, ds = number of 16-byte segments in the WQE
  uint8_t signature;
  uint8_t dciStreamChannelId[2];
  uint8_t fmCeSe;
  uint32_t imm;
};
static_assert(sizeof(WqeCtrlSeg) == 16, "mlx5 ctrl segment is 16 bytes");
static_assert(offsetof(WqeCtrlSeg, qpnDs) == 4 && offsetof(WqeCtrlSeg, signature) == 8 &&
                  offsetof(WqeCtrlSeg, fmCeSe) == 11 && offsetof(WqeCtrlSeg, imm) == 12,
              "mlx5 ctrl segment offsets");

// Remote-address segment of RDMA write, read and atomic WQEs.
struct WqeRaddrSeg {
  uint64_t raddr;
  uint32_t rkey;
  uint32_t reserved;
};
static_assert(sizeof(WqeRaddrSeg) == 16, "mlx5 raddr segment is 16 bytes");

// Local scatter/gather entry (send WQEs and receive WQEs).
struct WqeDataSeg {
  uint32_t byteCount;
  uint32_t lkey;
  uint64_t addr;
};
static_assert(sizeof(WqeDataSeg) == 16 && offsetof(WqeDataSeg, lkey) == 4 && offsetof(WqeDataSeg, addr) == 8,
              "mlx5 data segment layout");

// Inline data: a 4-byte header (length | kInlineSegFlag) followed by the bytes themselves.
struct WqeInlineSeg {
  uint32_t byteCount;
};
static_assert(sizeof(WqeInlineSeg) == 4, "mlx5 inline header is 4 bytes");
constexpr uint32_t kInlineSegFlag = 0x80000000u;

// Atomic operands (8-byte compare-swap and fetch-add).
struct WqeAtomicSeg {
  uint64_t swapAdd;
  uint64_t compare;
};
static_assert(sizeof(WqeAtomicSeg) == 16, "mlx5 atomic segment is 16 bytes");

// The WQEs mori builds, each one basic block.
constexpr uint32_t kWriteWqeDs = (sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg) + sizeof(WqeDataSeg)) / kSegmentBytes;  // 3
constexpr uint32_t kSendWqeDs = (sizeof(WqeCtrlSeg) + sizeof(WqeDataSeg)) / kSegmentBytes;                         // 2
constexpr uint32_t kAtomicWqeDs =
    (sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg) + sizeof(WqeAtomicSeg) + sizeof(WqeDataSeg)) / kSegmentBytes;  // 4
// The largest message a WQE may describe (ConnectX NICs report max_msg_sz = 1 GiB).
constexpr uint32_t kMaxMessageBytes = 1u << 30;

// Inline bytes that fit in one basic block after ctrl, raddr and the inline header.
constexpr uint32_t kMaxInlineInOneBlock =
    kSendWqeBasicBlock - sizeof(WqeCtrlSeg) - sizeof(WqeRaddrSeg) - sizeof(WqeInlineSeg);  // 28

// Completion-queue entry, 64 bytes; the NIC writes opOwn last.
struct Cqe64 {
  uint8_t rsvd0[32];
  uint32_t srqnUidx;
  uint32_t immInvalPkey;
  uint8_t app;
  uint8_t appOp;
  uint16_t appInfo;
  uint32_t byteCnt;       // bytes received (receives) or read (RDMA read)
  uint64_t timestamp;
  uint32_t sopDropQpn;    // low 24 bits: the QP number
  uint16_t wqeCounter;    // index (16 bits) of the completed WQE
  uint8_t signature;
  uint8_t opOwn;          // opcode << 4 | ... | owner bit
};
static_assert(sizeof(Cqe64) == kCqeBytes, "mlx5 CQE is 64 bytes");
static_assert(offsetof(Cqe64, byteCnt) == 44 && offsetof(Cqe64, sopDropQpn) == 56 && offsetof(Cqe64, wqeCounter) == 60 &&
                  offsetof(Cqe64, opOwn) == 63,
              "mlx5 CQE offsets");

// The same 64 bytes as written for an error completion.
struct ErrCqe {
  uint8_t rsvd0[32];
  uint32_t srqn;
  uint8_t rsvd1[18];
  uint8_t vendorErrSynd;
  uint8_t syndrome;
  uint32_t sWqeOpcodeQpn;  // opcode of the failed WQE << 24 | qpn
  uint16_t wqeCounter;
  uint8_t signature;
  uint8_t opOwn;
};
static_assert(sizeof(ErrCqe) == kCqeBytes && offsetof(ErrCqe, syndrome) == 55 && offsetof(ErrCqe, sWqeOpcodeQpn) == 56,
              "mlx5 error CQE layout");

// CQE opcodes (opOwn >> 4).
enum CqeOpcode : uint8_t {
  kCqeReq = 0,          // a send-queue WQE completed
  kCqeRespWrImm = 1,
  kCqeRespSend = 2,     // a receive WQE consumed a send
  kCqeRespSendImm = 3,
  kCqeRespSendInv = 4,
  kCqeReqErr = 13,
  kCqeRespErr = 14,
  kCqeInvalid = 15,     // never written by hardware: how software marks an empty entry
};
constexpr uint8_t kCqeOwnerMask = 1;

// Error syndromes of ErrCqe::syndrome.
enum CqeSyndrome : uint8_t {
  kSyndromeLocalLengthErr = 0x01,
  kSyndromeLocalQpOpErr = 0x02,
  kSyndromeLocalProtErr = 0x04,
  kSyndromeWrFlushErr = 0x05,
  kSyndromeMwBindErr = 0x06,
  kSyndromeBadRespErr = 0x10,
  kSyndromeLocalAccessErr = 0x11,
  kSyndromeRemoteInvalReqErr = 0x12,
  kSyndromeRemoteAccessErr = 0x13,
  kSyndromeRemoteOpErr = 0x14,
  kSyndromeTransportRetryExcErr = 0x15,
  kSyndromeRnrRetryExcErr = 0x16,
  kSyndromeRemoteAbortedErr = 0x22,
};

// Doorbell records: two big-endian words per QP (receive head, send head) and two per CQ (consumer index,
// arm).
constexpr uint32_t kReceiveDbrIndex = 0;
constexpr uint32_t kSendDbrIndex = 1;
constexpr uint32_t kCqSetCiDbrIndex = 0;
constexpr uint32_t kCqArmDbrIndex = 1;
constexpr uint32_t kCqConsumerIndexMask = 0xffffff;

// Number of 16-byte segments a WQE of `bytes` occupies, the `ds` field of the ctrl segment.
constexpr uint32_t DescriptorSegments(uint32_t bytes) { return (bytes + kSegmentBytes - 1) / kSegmentBytes; }

constexpr uint32_t MakeOpmodIdxOpcode(uint8_t opmod, uint32_t wqeIndex, uint8_t opcode) {
  return (static_cast<uint32_t>(opmod) << 24) | ((wqeIndex & 0xffffu) << 8) | opcode;
}
constexpr uint32_t MakeQpnDs(uint32_t qpn, uint32_t ds) { return (qpn << 8) | (ds & 0x3fu); }

const char* SyndromeName(uint8_t syndrome);
const char* OpcodeName(uint8_t opcode);

}  // namespace mori::rdma::mlx5
