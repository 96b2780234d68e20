// mori's mlx5 layouts against rdma-core's <infiniband/mlx5dv.h>; WQE encoding by the device primitives,
// field by field; CQE parsing for every opcode, owner-bit lap and error syndrome.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "mori/core/atomic.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"

#if __has_include(<infiniband/mlx5dv.h>)
#include <infiniband/mlx5dv.h>
#define MORI_TEST_HAVE_MLX5DV 1
#endif

namespace mori::rdma {
namespace {

using namespace mlx5;
using core::BeToHost16;
using core::BeToHost32;
using core::BeToHost64;
constexpr ProviderType kMlx5 = ProviderType::MLX5;

TEST(Mlx5Prm, LayoutsAndConstantsMatchRdmaCore) {
#ifndef MORI_TEST_HAVE_MLX5DV
  GTEST_SKIP() << "rdma-core's infiniband/mlx5dv.h is not installed (apt-get install libibverbs-dev)";
#else
  EXPECT_EQ(sizeof(WqeCtrlSeg), sizeof(mlx5_wqe_ctrl_seg));
  EXPECT_EQ(offsetof(WqeCtrlSeg, opmodIdxOpcode), offsetof(mlx5_wqe_ctrl_seg, opmod_idx_opcode));
  EXPECT_EQ(offsetof(WqeCtrlSeg, qpnDs), offsetof(mlx5_wqe_ctrl_seg, qpn_ds));
  EXPECT_EQ(offsetof(WqeCtrlSeg, signature), offsetof(mlx5_wqe_ctrl_seg, signature));
  EXPECT_EQ(offsetof(WqeCtrlSeg, fmCeSe), offsetof(mlx5_wqe_ctrl_seg, fm_ce_se));
  EXPECT_EQ(offsetof(WqeCtrlSeg, imm), offsetof(mlx5_wqe_ctrl_seg, imm));
  EXPECT_EQ(sizeof(WqeRaddrSeg), sizeof(mlx5_wqe_raddr_seg));
  EXPECT_EQ(offsetof(WqeRaddrSeg, rkey), offsetof(mlx5_wqe_raddr_seg, rkey));
  EXPECT_EQ(sizeof(WqeDataSeg), sizeof(mlx5_wqe_data_seg));
  EXPECT_EQ(offsetof(WqeDataSeg, lkey), offsetof(mlx5_wqe_data_seg, lkey));
  EXPECT_EQ(offsetof(WqeDataSeg, addr), offsetof(mlx5_wqe_data_seg, addr));
  EXPECT_EQ(sizeof(WqeInlineSeg), sizeof(mlx5_wqe_inl_data_seg));
  EXPECT_EQ(sizeof(WqeAtomicSeg), sizeof(mlx5_wqe_atomic_seg));
  EXPECT_EQ(offsetof(WqeAtomicSeg, compare), offsetof(mlx5_wqe_atomic_seg, compare));
  EXPECT_EQ(sizeof(Cqe64), sizeof(mlx5_cqe64));
  EXPECT_EQ(offsetof(Cqe64, byteCnt), offsetof(mlx5_cqe64, byte_cnt));
  EXPECT_EQ(offsetof(Cqe64, sopDropQpn), offsetof(mlx5_cqe64, sop_drop_qpn));
  EXPECT_EQ(offsetof(Cqe64, wqeCounter), offsetof(mlx5_cqe64, wqe_counter));
  EXPECT_EQ(offsetof(Cqe64, opOwn), offsetof(mlx5_cqe64, op_own));
  EXPECT_EQ(sizeof(ErrCqe), sizeof(mlx5_err_cqe));
  EXPECT_EQ(offsetof(ErrCqe, vendorErrSynd), offsetof(mlx5_err_cqe, vendor_err_synd));
  EXPECT_EQ(offsetof(ErrCqe, syndrome), offsetof(mlx5_err_cqe, syndrome));
  EXPECT_EQ(offsetof(ErrCqe, sWqeOpcodeQpn), offsetof(mlx5_err_cqe, s_wqe_opcode_qpn));
  EXPECT_EQ(offsetof(ErrCqe, wqeCounter), offsetof(mlx5_err_cqe, wqe_counter));

  EXPECT_EQ(kOpcodeNop, MLX5_OPCODE_NOP);
  EXPECT_EQ(kOpcodeRdmaWrite, MLX5_OPCODE_RDMA_WRITE);
  EXPECT_EQ(kOpcodeRdmaWriteImm, MLX5_OPCODE_RDMA_WRITE_IMM);
  EXPECT_EQ(kOpcodeSend, MLX5_OPCODE_SEND);
  EXPECT_EQ(kOpcodeSendImm, MLX5_OPCODE_SEND_IMM);
  EXPECT_EQ(kOpcodeRdmaRead, MLX5_OPCODE_RDMA_READ);
  EXPECT_EQ(kOpcodeAtomicCompareSwap, MLX5_OPCODE_ATOMIC_CS);
  EXPECT_EQ(kOpcodeAtomicFetchAdd, MLX5_OPCODE_ATOMIC_FA);
  EXPECT_EQ(kOpcodeAtomicMaskedCompareSwap, MLX5_OPCODE_ATOMIC_MASKED_CS);
  EXPECT_EQ(kOpcodeAtomicMaskedFetchAdd, MLX5_OPCODE_ATOMIC_MASKED_FA);
  EXPECT_EQ(kCtrlCqUpdate, MLX5_WQE_CTRL_CQ_UPDATE);
  EXPECT_EQ(kCtrlSolicited, MLX5_WQE_CTRL_SOLICITED);
  EXPECT_EQ(kCtrlFence, MLX5_WQE_CTRL_FENCE);
  EXPECT_EQ(kSendWqeBasicBlock, static_cast<uint32_t>(MLX5_SEND_WQE_BB));
  EXPECT_EQ(kSendWqeShift, static_cast<uint32_t>(MLX5_SEND_WQE_SHIFT));
  EXPECT_EQ(kInlineSegFlag, static_cast<uint32_t>(MLX5_INLINE_SEG));
  EXPECT_EQ(kCqeReq, MLX5_CQE_REQ);
  EXPECT_EQ(kCqeRespWrImm, MLX5_CQE_RESP_WR_IMM);
  EXPECT_EQ(kCqeRespSend, MLX5_CQE_RESP_SEND);
  EXPECT_EQ(kCqeRespSendImm, MLX5_CQE_RESP_SEND_IMM);
  EXPECT_EQ(kCqeRespSendInv, MLX5_CQE_RESP_SEND_INV);
  EXPECT_EQ(kCqeReqErr, MLX5_CQE_REQ_ERR);
  EXPECT_EQ(kCqeRespErr, MLX5_CQE_RESP_ERR);
  EXPECT_EQ(kCqeInvalid, MLX5_CQE_INVALID);
  EXPECT_EQ(kCqeOwnerMask, MLX5_CQE_OWNER_MASK);
  EXPECT_EQ(kReceiveDbrIndex, static_cast<uint32_t>(MLX5_RCV_DBR));
  EXPECT_EQ(kSendDbrIndex, static_cast<uint32_t>(MLX5_SND_DBR));
  EXPECT_EQ(kSyndromeLocalLengthErr, MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
  EXPECT_EQ(kSyndromeLocalQpOpErr, MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR);
  EXPECT_EQ(kSyndromeLocalProtErr, MLX5_CQE_SYNDROME_LOCAL_PROT_ERR);
  EXPECT_EQ(kSyndromeWrFlushErr, MLX5_CQE_SYNDROME_WR_FLUSH_ERR);
  EXPECT_EQ(kSyndromeMwBindErr, MLX5_CQE_SYNDROME_MW_BIND_ERR);
  EXPECT_EQ(kSyndromeBadRespErr, MLX5_CQE_SYNDROME_BAD_RESP_ERR);
  EXPECT_EQ(kSyndromeLocalAccessErr, MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR);
  EXPECT_EQ(kSyndromeRemoteInvalReqErr, MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR);
  EXPECT_EQ(kSyndromeRemoteAccessErr, MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR);
  EXPECT_EQ(kSyndromeRemoteOpErr, MLX5_CQE_SYNDROME_REMOTE_OP_ERR);
  EXPECT_EQ(kSyndromeTransportRetryExcErr, MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR);
  EXPECT_EQ(kSyndromeRnrRetryExcErr, MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR);
  EXPECT_EQ(kSyndromeRemoteAbortedErr, MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR);
#endif
}

// A send queue of `depth` slots, a receive queue and records in plain host memory.
struct FakeQueues {
  explicit FakeQueues(uint32_t depth, uint32_t cqDepth = 8)
      : sq(depth * kSendWqeBasicBlock, 0xee), rq(8 * kReceiveWqeBytes, 0xee), dbrec(2, 0), uar(0), cq(cqDepth * kCqeBytes, 0),
        cqDbrec(2, 0) {
    wq = WorkQueueHandle{};
    wq.sqAddr = sq.data();
    wq.sqWqeNum = depth;
    wq.dbrRecAddr = &dbrec[kSendDbrIndex];
    wq.dbrAddr = &uar;
    wq.rqAddr = rq.data();
    wq.rqWqeNum = 8;
    wq.rqDbrRecAddr = &dbrec[kReceiveDbrIndex];
    wq.qpn = 0x1234;
    wq.maxInlineData = kMaxInlineInOneBlock;
    cqh = CompletionQueueHandle{};
    cqh.cqAddr = cq.data();
    cqh.cqeNum = cqDepth;
    cqh.cqeSize = kCqeBytes;
    cqh.dbrRecAddr = cqDbrec.data();
    for (uint32_t i = 0; i < cqDepth; ++i) cq[i * kCqeBytes + offsetof(Cqe64, opOwn)] = kCqeInvalid << 4;
  }
  const uint8_t* Wqe(uint32_t slot) const { return sq.data() + (slot % wq.sqWqeNum) * kSendWqeBasicBlock; }
  // Writes a CQE at consumer position `index` as hardware would (owner bit of that lap).
  void Complete(uint32_t index, uint8_t opcode, uint16_t counter, uint8_t syndrome = 0, uint32_t bytes = 0) {
    uint8_t* e = cq.data() + (index % cqh.cqeNum) * kCqeBytes;
    std::memset(e, 0, kCqeBytes);
    uint32_t b = core::HostToBe32(bytes);
    std::memcpy(e + offsetof(Cqe64, byteCnt), &b, 4);
    uint32_t q = core::HostToBe32(wq.qpn);
    std::memcpy(e + offsetof(Cqe64, sopDropQpn), &q, 4);
    e[offsetof(ErrCqe, syndrome)] = syndrome;
    uint16_t c = core::HostToBe16(counter);
    std::memcpy(e + offsetof(Cqe64, wqeCounter), &c, 2);
    e[offsetof(Cqe64, opOwn)] = static_cast<uint8_t>(opcode << 4 | ((index / cqh.cqeNum) & 1));
  }
  std::vector<uint8_t> sq, rq;
  std::vector<uint32_t> dbrec;
  uint64_t uar;
  std::vector<uint8_t> cq;
  std::vector<uint32_t> cqDbrec;
  WorkQueueHandle wq;
  CompletionQueueHandle cqh;
};

uint32_t Be32At(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return BeToHost32(v);
}
uint64_t Be64At(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return BeToHost64(v);
}

void ExpectCtrl(const uint8_t* w, uint32_t slot, uint8_t opcode, uint32_t qpn, uint32_t ds, bool signaled) {
  EXPECT_EQ(Be32At(w), (slot & 0xffff) << 8 | opcode);
  EXPECT_EQ(Be32At(w + 4), qpn << 8 | ds);
  EXPECT_EQ(w[offsetof(WqeCtrlSeg, fmCeSe)], signaled ? kCtrlCqUpdate : 0);
  EXPECT_EQ(w[offsetof(WqeCtrlSeg, signature)], 0);
}

TEST(Mlx5Wqe, WriteAndReadEncodeEverySegment) {
  FakeQueues q(4);
  uint64_t dbr = PostWrite<kMlx5>(q.wq, 0x77, 0x1122334455667788ull, 0xabcdef01, 0x0102030405060708ull, 0x55aa55aa, 4096);
  EXPECT_EQ(q.wq.postIdx, 1u);
  const uint8_t* w = q.Wqe(0);
  ExpectCtrl(w, 0, kOpcodeRdmaWrite, 0x77, 3, true);
  EXPECT_EQ(Be64At(w + 16), 0x0102030405060708ull);
  EXPECT_EQ(Be32At(w + 24), 0x55aa55aau);
  EXPECT_EQ(Be32At(w + 32), 4096u);
  EXPECT_EQ(Be32At(w + 36), 0xabcdef01u);
  EXPECT_EQ(Be64At(w + 40), 0x1122334455667788ull);
  uint64_t firstEight;
  std::memcpy(&firstEight, w, 8);
  EXPECT_EQ(dbr, firstEight) << "the doorbell carries the ctrl segment's first 8 bytes";
  // Full form in a later lap: slot 6 of a 4-deep queue lands in slot 2 with index 6.
  PostRead<kMlx5>(q.wq, 6, false, 0x77, 0x1000, 7, 0x2000, 8, 64);
  ExpectCtrl(q.Wqe(6), 6, kOpcodeRdmaRead, 0x77, 3, false);
  EXPECT_EQ(Be64At(q.Wqe(6) + 16), 0x2000u);
  EXPECT_EQ(Be32At(q.Wqe(6) + 32), 64u);
}

TEST(Mlx5Wqe, InlineAtomicSendNopAndRecv) {
  FakeQueues q(8);
  const char msg[] = "twenty-two bytes here";
  PostWriteInline<kMlx5>(q.wq, 5, msg, 0xdead0000, 9, sizeof(msg));
  const uint8_t* w = q.Wqe(0);
  ExpectCtrl(w, 0, kOpcodeRdmaWrite, 5, DescriptorSegments(16 + 16 + 4 + sizeof(msg)), true);
  EXPECT_EQ(Be32At(w + 32), sizeof(msg) | kInlineSegFlag);
  EXPECT_EQ(std::memcmp(w + 36, msg, sizeof(msg)), 0);
  // A handle claiming more inline room than one block: the length is declared in full (the NIC, which knows
  // the QP's real limit, answers it), only one block is written and the next slot stays intact.
  std::vector<uint8_t> big(40, 0x42);
  q.wq.maxInlineData = 64;
  PostWriteInline<kMlx5>(q.wq, 5, big.data(), 0xdead0000, 9, big.size());
  q.wq.maxInlineData = kMaxInlineInOneBlock;
  EXPECT_EQ(Be32At(q.Wqe(1) + 32), 40u | kInlineSegFlag);
  EXPECT_EQ(Be32At(q.Wqe(1) + 4) & 0x3f, 4u);
  EXPECT_EQ(q.Wqe(2)[0], 0xee) << "an oversize inline WQE spilled into the next slot";

  PostAtomic<kMlx5, uint64_t>(q.wq, 5, 0x3000, 11, 0x4000, 12, 7, 0, AtomicOp::FetchAdd);
  ExpectCtrl(q.Wqe(2), 2, kOpcodeAtomicFetchAdd, 5, 4, true);
  EXPECT_EQ(Be64At(q.Wqe(2) + 32), 7u);
  EXPECT_EQ(Be32At(q.Wqe(2) + 48), 8u);
  EXPECT_EQ(Be64At(q.Wqe(2) + 56), 0x3000u);
  PostAtomic<kMlx5, int64_t>(q.wq, 5, 0x3000, 11, 0x4000, 12, -5, 99, AtomicOp::CompareSwap);
  ExpectCtrl(q.Wqe(3), 3, kOpcodeAtomicCompareSwap, 5, 4, true);
  EXPECT_EQ(Be64At(q.Wqe(3) + 32), static_cast<uint64_t>(-5));
  EXPECT_EQ(Be64At(q.Wqe(3) + 40), 99u);

  PostSend<kMlx5>(q.wq, 5, 0x5000, 13, 300);
  ExpectCtrl(q.Wqe(4), 4, kOpcodeSend, 5, 2, true);
  EXPECT_EQ(Be32At(q.Wqe(4) + 16), 300u);
  PostNop<kMlx5>(q.wq, 5, true, 5);
  ExpectCtrl(q.Wqe(5), 5, kOpcodeNop, 5, 1, true);

  PostRecv<kMlx5>(q.wq, 0x6000, 14, 512);
  EXPECT_EQ(Be32At(q.rq.data()), 512u);
  EXPECT_EQ(Be32At(q.rq.data() + 4), 14u);
  EXPECT_EQ(Be64At(q.rq.data() + 8), 0x6000u);
  EXPECT_EQ(BeToHost32(q.dbrec[kReceiveDbrIndex]), 1u);
}

#if MORI_BACKEND_HOST
// More inline bytes than the QP allows, or a message beyond the NIC's limit, is the caller's error: the
// primitive traps (on HOST the trap is an exception) instead of building a WQE a NIC would misread.
TEST(Mlx5Wqe, OversizeRequestsTrapInsteadOfPosting) {
  FakeQueues q(4);
  std::vector<uint8_t> big(40, 0x42);
  testing::internal::CaptureStderr();
  EXPECT_THROW(PostWriteInline<kMlx5>(q.wq, 5, big.data(), 0xdead0000, 9, big.size()), core::host::KernelTrap);
  EXPECT_THROW(PostWrite<kMlx5>(q.wq, 5, 0x1000, 1, 0x2000, 2, size_t(kMaxMessageBytes) + 1), core::host::KernelTrap);
  EXPECT_THROW(PostSend<kMlx5>(q.wq, 5, 0x1000, 1, size_t(3) << 31), core::host::KernelTrap);
  for (uint32_t i = 0; i < 8; ++i) PostRecv<kMlx5>(q.wq, 0x1000, 1, 64);  // fills the 8-deep receive queue
  EXPECT_THROW(PostRecv<kMlx5>(q.wq, 0x1000, 1, 64), core::host::KernelTrap);
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("40 inline bytes exceed the QP's 28"), std::string::npos) << log;
  EXPECT_NE(log.find("exceeds the NIC's 1073741824-byte limit"), std::string::npos) << log;
  EXPECT_NE(log.find("the receive queue is full"), std::string::npos) << log;
}

// A bounded wait on a queue whose peer went silent traps naming the QP and the rank at its other end (what a
// job's survivors must say when a PE dies), or "rank -1" where whoever connected the QP did not say.
TEST(Mlx5Wqe, WaitsThatTimeOutNameThePeerRank) {
  constexpr uint64_t kTimeoutNs = 50'000'000;
  EXPECT_EQ(PeerRank(WorkQueueHandle{}), -1) << "a handle nobody connected names no rank";
  auto trapText = [](auto wait) {
    testing::internal::CaptureStderr();
    EXPECT_THROW(wait(), core::host::KernelTrap);
    return testing::internal::GetCapturedStderr();
  };
  // Quiet: the NOP is posted and announced; no completion comes.
  FakeQueues quiet(8);
  SetPeerRank(quiet.wq, 6);
  quiet.cqh.pollLock = 1;  // another poller holds the CQ: nothing is retired
  std::string log = trapText([&] { QuietQueue<kMlx5>(quiet.wq, quiet.cqh, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank 6): quiet waited 50000000 ns for slot 0 (0 completed): is rank 6 alive?"),
            std::string::npos)
      << log;
  EXPECT_EQ(quiet.wq.dbTouchIdx, 1u) << "the quiet's NOP was announced before the wait";
  // Room: all 4 slots are taken and none completes.
  FakeQueues full(4);
  SetPeerRank(full.wq, 2);
  full.wq.postIdx = 4;
  full.cqh.pollLock = 1;
  log = trapText([&] { ReserveSendSlots<kMlx5>(full.wq, full.cqh, 1, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank 2): no room in the send queue for 50000000 ns (slot 4, 0 completed, depth 4)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("(rank 2 gone? link down?)"), std::string::npos) << log;
  // Doorbell order: slot 3 waits for slots 0-2, whose poster never announces them.
  FakeQueues order(8);
  SetPeerRank(order.wq, 0);
  log = trapText([&] { RingDoorbellOrdered<kMlx5>(order.wq, 3, 1, 0, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank 0): slot 3 waited 50000000 ns for earlier slots' doorbells (at 0)"),
            std::string::npos)
      << log;
  EXPECT_EQ(order.uar, 0u) << "the doorbell rang out of order";
  // The ordered posts (here the quiet's NOP) wait for room and for their turn in one loop, with the same words.
  FakeQueues fullPost(4);
  SetPeerRank(fullPost.wq, 3);
  fullPost.wq.postIdx = 4;
  fullPost.cqh.pollLock = 1;
  log = trapText([&] { QuietQueue<kMlx5>(fullPost.wq, fullPost.cqh, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank 3): no room in the send queue for 50000000 ns (slot 4, 0 completed, depth 4)"),
            std::string::npos)
      << log;
  FakeQueues turn(8);
  SetPeerRank(turn.wq, 1);
  turn.wq.postIdx = 3;  // slots 0-2 reserved by posters that never announce them
  log = trapText([&] { QuietQueue<kMlx5>(turn.wq, turn.cqh, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank 1): slot 3 waited 50000000 ns for earlier slots' doorbells (at 0)"),
            std::string::npos)
      << log;
  EXPECT_EQ(turn.uar, 0u) << "the doorbell rang out of order";
  EXPECT_EQ(turn.wq.dbTouchIdx, 0u);
  // A reservation larger than any queue of its depth can always make room for traps at once, naming the limit:
  // depth 8 signals every 4th slot, so the last known completion can lie 3 slots before a reservation, and 5 is
  // the most that always fits.
  EXPECT_EQ(MaxSlotsAtOnce(FakeQueues(1).wq), 1u);
  EXPECT_EQ(MaxSlotsAtOnce(FakeQueues(2).wq), 2u);
  EXPECT_EQ(MaxSlotsAtOnce(FakeQueues(8).wq), 5u);
  EXPECT_EQ(MaxSlotsAtOnce(FakeQueues(64).wq), 33u);
  FakeQueues big(8);
  SetPeerRank(big.wq, 4);
  log = trapText([&] { ReserveSendSlots<kMlx5>(big.wq, big.cqh, 6, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank 4): a thread reserves 6 send slots at once, more than a queue of depth 8 can "
                     "always make room for (5): post in turns of at most 5"),
            std::string::npos)
      << log;
  EXPECT_EQ(big.wq.postIdx, 0u) << "the refused reservation took no slot";
  // Unnamed: the message says so rather than naming rank 0.
  FakeQueues unnamed(4);
  unnamed.wq.postIdx = 4;
  unnamed.cqh.pollLock = 1;
  log = trapText([&] { ReserveSendSlots<kMlx5>(unnamed.wq, unnamed.cqh, 1, kTimeoutNs); });
  EXPECT_NE(log.find("qp 4660 (to rank -1): no room"), std::string::npos) << log;
}
#endif

TEST(Mlx5Wqe, DoorbellRecordAndRegister) {
  FakeQueues q(4);
  uint64_t dbr = PostWrite<kMlx5>(q.wq, 3, 0, 0, 0, 0, 0);
  UpdateSendDbrRecord<kMlx5>(q.wq.dbrRecAddr, q.wq.postIdx);
  RingDoorbell<kMlx5>(q.wq.dbrAddr, dbr);
  EXPECT_EQ(BeToHost32(q.dbrec[kSendDbrIndex]), 1u);
  EXPECT_EQ(q.uar, dbr);
  UpdateSendDbrRecord<kMlx5>(q.wq.dbrRecAddr, 0x12345);  // 16 bits on the wire
  EXPECT_EQ(BeToHost32(q.dbrec[kSendDbrIndex]), 0x2345u);
  UpdateCqDbrRecord<kMlx5>(q.cqh.dbrRecAddr, 0x1abcdef1);  // 24 bits
  EXPECT_EQ(BeToHost32(q.cqDbrec[0]), 0xbcdef1u);
}

TEST(Mlx5Cqe, OwnerBitAcrossLaps) {
  FakeQueues q(4, 4);
  uint32_t ci = 0;
  EXPECT_EQ(PollCq<kMlx5>(q.cqh.cqAddr, 4, &ci), kCqEmpty) << "an invalid entry is empty";
  for (uint32_t i = 0; i < 11; ++i) {
    EXPECT_EQ(PollCq<kMlx5>(q.cqh.cqAddr, 4, &ci), kCqEmpty) << "entry " << i << " before it is written";
    q.Complete(i, kCqeReq, static_cast<uint16_t>(i));
    CqeInfo info{};
    q.cqh.consIdx = ci;
    EXPECT_EQ(PollCq<kMlx5>(q.cqh, q.wq, &info), kCqeReq) << "entry " << i;
    ci = q.cqh.consIdx;
    EXPECT_EQ(info.wqeCounter, i);
    EXPECT_TRUE(info.isSend);
    EXPECT_EQ(info.qpn, 0x1234u);
    EXPECT_EQ(q.wq.doneIdx, i + 1) << "a send completion retires its slot and all before it";
  }
  EXPECT_EQ(ci, 11u);
  // A stale entry of the previous lap (owner bit of lap 2 at position 12) is not new.
  q.Complete(11 - 4, kCqeReq, 99);  // position 11 holds lap 1's entry, owner bit 1; lap 2 expects 0
  EXPECT_EQ(PollCq<kMlx5>(q.cqh.cqAddr, 4, &ci), kCqEmpty);
}

TEST(Mlx5Cqe, EverySyndromeComesBackAsADistinctError) {
  const uint8_t syndromes[] = {kSyndromeLocalLengthErr,       kSyndromeLocalQpOpErr,   kSyndromeLocalProtErr,
                               kSyndromeWrFlushErr,           kSyndromeMwBindErr,      kSyndromeBadRespErr,
                               kSyndromeLocalAccessErr,       kSyndromeRemoteInvalReqErr, kSyndromeRemoteAccessErr,
                               kSyndromeRemoteOpErr,          kSyndromeTransportRetryExcErr, kSyndromeRnrRetryExcErr,
                               kSyndromeRemoteAbortedErr};
  FakeQueues q(64, 64);
  uint32_t ci = 0;
  for (uint32_t i = 0; i < sizeof(syndromes); ++i) {
    bool requester = i % 2 == 0;
    q.Complete(i, requester ? kCqeReqErr : kCqeRespErr, static_cast<uint16_t>(100 + i), syndromes[i]);
    CqeInfo info{};
    q.cqh.consIdx = ci;
    int r = PollCq<kMlx5>(q.cqh, q.wq, &info);
    ci = q.cqh.consIdx;
    ASSERT_TRUE(IsCqError(r)) << "syndrome " << int(syndromes[i]);
    EXPECT_LT(r, kCqEmpty);
    EXPECT_EQ(CqErrorSyndrome(r), syndromes[i]);
    EXPECT_EQ(info.isSend, requester);
    EXPECT_EQ(info.wqeCounter, 100 + i);
    EXPECT_STRNE(SyndromeName(syndromes[i]), "unknown syndrome");
  }
  // A receive completion reports its byte count and does not retire send slots.
  FakeQueues r(4, 4);
  r.Complete(0, kCqeRespSend, 3, 0, 777);
  CqeInfo info{};
  EXPECT_EQ(PollCq<kMlx5>(r.cqh, r.wq, &info), kCqeRespSend);
  EXPECT_EQ(info.byteCount, 777u);
  EXPECT_FALSE(info.isSend);
  EXPECT_EQ(r.wq.doneIdx, 0u);
}

TEST(Mlx5Cqe, RetireCompletionsCountsErrorsAndUpdatesTheRecord) {
  FakeQueues q(8, 8);
  q.wq.postIdx = 3;
  q.Complete(0, kCqeReq, 0);
  q.Complete(1, kCqeReqErr, 1, kSyndromeRemoteAccessErr);
  q.Complete(2, kCqeReqErr, 2, kSyndromeWrFlushErr);
  EXPECT_EQ(RetireCompletions<kMlx5>(q.cqh, q.wq), 3u);
  EXPECT_EQ(q.wq.doneIdx, 3u);
  EXPECT_EQ(q.cqh.errorCount, 2u);
  EXPECT_EQ(q.cqh.firstError, (uint32_t(kSyndromeRemoteAccessErr) << 16) | 1u);
  EXPECT_EQ(BeToHost32(q.cqDbrec[0]), 3u);
  EXPECT_EQ(q.cqh.pollLock, 0u);
}

}  // namespace
}  // namespace mori::rdma
