#include "mlx5_host_queue.hpp"

#include "mori/core/errors.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"

namespace mori::rdma {

void Mlx5HostQueues::Post(RdmaEndpoint& ep, const HostWorkRequest& wr) {
  constexpr ProviderType P = ProviderType::MLX5;
  WorkQueueHandle& wq = ep.wqHandle;
  uint32_t slot = wq.postIdx;
  MORI_CHECK(slot - wq.doneIdx < wq.sqWqeNum, core::ErrorCode::InvalidUsage,
             "QP %u: the send queue is full (%u WQEs outstanding); poll completions before posting more", wq.qpn,
             slot - wq.doneIdx);
  MORI_CHECK(wr.op != HostOp::WriteInline || wr.bytes <= wq.maxInlineData, core::ErrorCode::InvalidUsage,
             "QP %u: %zu inline bytes exceed the QP's %u", wq.qpn, wr.bytes, wq.maxInlineData);
  MORI_CHECK(wr.bytes <= mlx5::kMaxMessageBytes, core::ErrorCode::InvalidUsage,
             "QP %u: a message of %zu bytes exceeds the NIC's %u-byte limit", wq.qpn, wr.bytes, mlx5::kMaxMessageBytes);
  uint64_t dbr = 0;
  switch (wr.op) {
    case HostOp::Write:
      dbr = PostWrite<P>(wq, slot, wr.signaled, wq.qpn, wr.laddr, wr.lkey, wr.raddr, wr.rkey, wr.bytes);
      break;
    case HostOp::WriteInline:
      dbr = PostWriteInline<P>(wq, slot, wr.signaled, wq.qpn, wr.inlineData, wr.raddr, wr.rkey, wr.bytes);
      break;
    case HostOp::Read:
      dbr = PostRead<P>(wq, slot, wr.signaled, wq.qpn, wr.laddr, wr.lkey, wr.raddr, wr.rkey, wr.bytes);
      break;
    case HostOp::Send:
      dbr = PostSend<P>(wq, slot, wr.signaled, wq.qpn, wr.laddr, wr.lkey, wr.bytes);
      break;
    case HostOp::FetchAdd:
    case HostOp::CompareSwap:
      dbr = PostAtomic<P, uint64_t>(wq, slot, wr.signaled, wq.qpn, wr.laddr, wr.lkey, wr.raddr, wr.rkey, wr.swapAdd,
                                    wr.compare, wr.op == HostOp::FetchAdd ? AtomicOp::FetchAdd : AtomicOp::CompareSwap);
      break;
    case HostOp::Nop:
      dbr = PostNop<P>(wq, slot, wr.signaled, wq.qpn);
      break;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ids_[wq.qpn].send.emplace_back(slot, wr.wrId);
  }
  wq.postIdx = slot + 1;
  UpdateSendDbrRecord<P>(wq.dbrRecAddr, slot + 1);
  RingDoorbell<P>(wq.dbrAddr, dbr);
  wq.dbTouchIdx = slot + 1;
}

void Mlx5HostQueues::PostRecv(RdmaEndpoint& ep, uintptr_t laddr, uint32_t lkey, size_t bytes, uint64_t wrId) {
  std::lock_guard<std::mutex> lock(mutex_);
  Ids& ids = ids_[ep.wqHandle.qpn];
  MORI_CHECK(ep.wqHandle.rqPostIdx - ep.wqHandle.rqDoneIdx < ep.wqHandle.rqWqeNum, core::ErrorCode::InvalidUsage,
             "QP %u: the receive queue is full (%u buffers posted, none consumed since)", ep.wqHandle.qpn,
             ep.wqHandle.rqPostIdx - ep.wqHandle.rqDoneIdx);
  ids.recv.emplace_back(ep.wqHandle.rqPostIdx, wrId);
  rdma::PostRecv<ProviderType::MLX5>(ep.wqHandle, laddr, lkey, bytes);
}

int Mlx5HostQueues::Poll(RdmaEndpoint& ep, HostCompletion* out, int maxCompletions) {
  int n = 0;
  while (n < maxCompletions) {
    CqeInfo info{};
    int r = PollCq<ProviderType::MLX5>(ep.cqHandle, ep.wqHandle, &info);
    if (r == kCqEmpty) break;
    HostCompletion& c = out[n++];
    c.status = IsCqError(r) ? CqErrorSyndrome(r) : 0;
    c.isReceive = !info.isSend;
    c.bytes = info.byteCount;
    c.wrId = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    auto& ids = info.isSend ? ids_[ep.wqHandle.qpn].send : ids_[ep.wqHandle.qpn].recv;
    // Completions come in slot order: the oldest outstanding slot whose 16-bit index the CQE names is this
    // one, and those before it (unsignaled sends completed with it) retire with it.
    for (size_t i = 0; i < ids.size(); ++i) {
      if ((ids[i].first & 0xffffu) != info.wqeCounter) continue;
      c.wrId = ids[i].second;
      ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      break;
    }
  }
  return n;
}

void Mlx5HostQueues::Forget(uint32_t qpn) {
  std::lock_guard<std::mutex> lock(mutex_);
  ids_.erase(qpn);
}

}  // namespace mori::rdma
