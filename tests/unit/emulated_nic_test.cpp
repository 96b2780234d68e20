// The emulated NIC driven by the mlx5 device primitives from "GPU threads" (host threads on HOST, the GPU
// on CUDA): every opcode, ordering, queue depths 1..1024 with 100k WQEs, many threads on one QP, and every
// error an RC NIC reports (keys, access, bounds, inline size, alignment, RNR, link loss), each checked for
// the right syndrome and for memory outside the target left untouched.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../../src/rdma/emulated/faults.hpp"
#include "../../src/rdma/emulated/wire.hpp"
#include "../common/test_util.hpp"
#include "mori/core/device_scope.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/emulated.hpp"
#include "mori/rdma/rdma.hpp"
#include "socket.hpp"

namespace mori::rdma {
namespace {

namespace test = core::test;
using core::Dim3;
using core::GpuBuffer;
using core::MemoryType;
using namespace mlx5;
namespace net = core::net;
using core::UniqueFd;
constexpr ProviderType kMlx5 = ProviderType::MLX5;
constexpr uint64_t kTimeoutNs = 60'000'000'000ull;

// The queue handles of one endpoint, in host-pinned memory every posting thread can reach.
struct Queues {
  WorkQueueHandle wq;
  CompletionQueueHandle cq;
};

// ---------------------------------------------------------------- kernels

// One thread posts `count` 8-byte writes of value i into slot i % slots of the remote array, then quiets.
MORI_GLOBAL void PostManyWrites(Queues* q, const RdmaMemoryRegion* src, RdmaMemoryRegion dst, uint32_t count,
                                uint32_t slots, uint32_t* errors) {
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t s = i % slots;
    // The source array holds value i at index i % slots as well (written by the host beforehand).
    PostWriteOrdered<kMlx5>(q->wq, q->cq, src->addr + uint64_t(s) * 8, src->lkey, dst.addr + uint64_t(s) * 8, dst.rkey, 8,
                            false, kTimeoutNs);
  }
  *errors = QuietQueue<kMlx5>(q->wq, q->cq, kTimeoutNs);
}

// Every thread writes the values 1..rounds of its own 8-byte slot; the last must win (per-QP order).
MORI_GLOBAL void ManyThreadsOneQp(Queues* q, RdmaMemoryRegion src, RdmaMemoryRegion dst, uint32_t rounds, uint32_t* errors) {
  uint32_t t = core::GlobalThreadIdx();
  uint32_t n = core::GlobalThreadCount();
  for (uint32_t r = 1; r <= rounds; ++r) {
    // Source slot (t, r) holds the 8-byte value t << 32 | r.
    uintptr_t from = src.addr + (uint64_t(r - 1) * n + t) * 8;
    PostWriteOrdered<kMlx5>(q->wq, q->cq, from, src.lkey, dst.addr + uint64_t(t) * 8, dst.rkey, 8, r == rounds, kTimeoutNs);
  }
  uint32_t e = QuietQueue<kMlx5>(q->wq, q->cq, kTimeoutNs);
  if (e != 0) core::AtomicFetchAdd(errors, 1u);
}

// A queue of depth 8 signals every 4th slot. Three unsignaled writes (slots 0-2) leave the last known completion
// 3 slots before the next reservation, the worst place for it; then one reservation of MaxSlotsAtOnce (5) slots,
// which must find room from what is already known, five writes in it under one doorbell, and a quiet.
MORI_GLOBAL void WorstPlacedReservation(Queues* q, RdmaMemoryRegion src, RdmaMemoryRegion dst, uint32_t* out) {
  WorkQueueHandle& wq = q->wq;
  for (uint32_t i = 0; i < 3; ++i) {
    PostWriteOrdered<kMlx5>(wq, q->cq, src.addr + i * 8, src.lkey, dst.addr + i * 8, dst.rkey, 8, false, kTimeoutNs);
  }
  const uint32_t n = MaxSlotsAtOnce(wq);
  const uint32_t first = ReserveSendSlots<kMlx5>(wq, q->cq, n, kTimeoutNs);
  uint64_t dbr = 0;
  for (uint32_t slot = first; slot < first + n; ++slot) {
    dbr = PostWrite<kMlx5>(wq, slot, SignalNeeded(wq, slot, false), wq.qpn, src.addr + slot * 8, src.lkey,
                           dst.addr + slot * 8, dst.rkey, 8);
  }
  RingDoorbellOrdered<kMlx5>(wq, first, n, dbr, kTimeoutNs);
  out[0] = first;
  out[1] = n;
  out[2] = QuietQueue<kMlx5>(wq, q->cq, kTimeoutNs);
}

// The API.md loop: post, record, ring, poll until the completion comes, record the CQ.
struct OpResult {
  int status;
  uint32_t byteCount;
};
MORI_GLOBAL void ShortFormOp(Queues* q, int op, uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey,
                             uint64_t bytes, uint64_t v1, uint64_t v2, OpResult* out) {
  WorkQueueHandle& wq = q->wq;
  uint64_t dbr = 0;
  switch (op) {
    case 0: dbr = PostWrite<kMlx5>(wq, wq.qpn, laddr, lkey, raddr, rkey, bytes); break;
    case 1: dbr = PostRead<kMlx5>(wq, wq.qpn, laddr, lkey, raddr, rkey, bytes); break;
    case 2: dbr = PostWriteInline<kMlx5>(wq, wq.qpn, reinterpret_cast<const void*>(laddr), raddr, rkey, bytes); break;
    case 3: dbr = PostAtomic<kMlx5, uint64_t>(wq, wq.qpn, laddr, lkey, raddr, rkey, v1, v2, AtomicOp::FetchAdd); break;
    case 4: dbr = PostAtomic<kMlx5, uint64_t>(wq, wq.qpn, laddr, lkey, raddr, rkey, v1, v2, AtomicOp::CompareSwap); break;
    case 5: dbr = PostSend<kMlx5>(wq, wq.qpn, laddr, lkey, bytes); break;
  }
  UpdateSendDbrRecord<kMlx5>(wq.dbrRecAddr, wq.postIdx);
  RingDoorbell<kMlx5>(wq.dbrAddr, dbr);
  CqeInfo info{};
  int r;
  core::SpinDeadline deadline(kTimeoutNs);
  while ((r = PollCq<kMlx5>(q->cq, wq, &info)) == kCqEmpty) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "no completion for op %d", op);
    core::SpinPause();
  }
  UpdateCqDbrRecord<kMlx5>(q->cq.dbrRecAddr, q->cq.consIdx);
  out->status = r;
  out->byteCount = info.byteCount;
}

// ---------------------------------------------------------------- raw wire packets

emulated::PacketHeader Header(emulated::PacketType type, uint32_t dstQpn) {
  emulated::PacketHeader h = emulated::MakePacketHeader(type);
  h.dstQpn = dstQpn;
  return h;
}

emulated::PacketHeader Hello(uint64_t theirNonce, uint64_t ourNonce) {
  emulated::PacketHeader h = Header(emulated::PacketType::Hello, 0);
  h.raddr = theirNonce;
  h.swapAdd = ourNonce;
  return h;
}

// Sends `h` (with its integrity check computed, unless `seal` is false) and its payload.
void SendPacket(int fd, emulated::PacketHeader h, const std::vector<uint8_t>& payload = {}, bool seal = true) {
  if (seal) h.icrc = emulated::PacketCheck(h, payload.data(), payload.size());
  std::vector<uint8_t> bytes(sizeof(h) + payload.size());
  std::memcpy(bytes.data(), &h, sizeof(h));
  if (!payload.empty()) std::memcpy(bytes.data() + sizeof(h), payload.data(), payload.size());
  net::SendAll(fd, bytes.data(), bytes.size(), core::Deadline::After(10), "the emulated NIC");
}

// Whether the NIC closed the connection within `seconds` (what it sent before is skipped).
bool ClosedByPeer(int fd, int seconds) {
  core::Deadline deadline = core::Deadline::After(seconds);
  uint8_t sink[256];
  while (!deadline.Expired()) {
    ssize_t n = recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
    if (n < 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// ---------------------------------------------------------------- fixture

class EmulatedNic : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (core::GpuGetDeviceCount(&n) != core::kGpuSuccess || n == 0) {
      GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
    }
    context_ = std::make_unique<RdmaContext>(RdmaBackendType::Emulated);
    ASSERT_EQ(context_->GetRdmaDeviceList().size(), 1u);
    auto ports = GetActiveDevicePortList(context_->GetRdmaDeviceList());
    ASSERT_EQ(ports.size(), 1u);
    a_ = ports[0].first->CreateRdmaDeviceContext();
    b_ = ports[0].first->CreateRdmaDeviceContext();
    queues_ = GpuBuffer(2 * sizeof(Queues), MemoryType::HostPinned);
  }

  // Threads of `grid` x `block` post `rounds` rounds of ordered writes to one QP whose send queue has `depth`
  // slots, then quiet; each thread's destination word must end with its last round's value.
  void ManyThreadsOnOneQp(uint32_t depth, Dim3 grid, Dim3 block, uint32_t rounds);

  // Endpoints on NIC a and NIC b, connected to each other; their handles go to pinned memory.
  void Connect(RdmaEndpointConfig config = RdmaEndpointConfig()) {
    epA_ = a_->CreateRdmaEndpoint(config);
    epB_ = b_->CreateRdmaEndpoint(config);
    a_->ConnectEndpoint(epA_.handle, epB_.handle);
    b_->ConnectEndpoint(epB_.handle, epA_.handle);
    QA()->wq = epA_.wqHandle;
    QA()->cq = epA_.cqHandle;
    QB()->wq = epB_.wqHandle;
    QB()->cq = epB_.cqHandle;
  }

  // Buffers live as long as the fixture and are freed after the NICs stop (TearDown), as memory must
  // outlive every NIC that may still touch it: a flushed write may still land at the responder.
  GpuBuffer& Alloc(size_t bytes, MemoryType type = MemoryType::Device) {
    buffers_.push_back(std::make_unique<GpuBuffer>(bytes, type));
    return *buffers_.back();
  }

  void TearDown() override { context_.reset(); }

  Queues* QA() { return queues_.DataAs<Queues>(); }
  Queues* QB() { return queues_.DataAs<Queues>() + 1; }

  // Runs one short-form operation from A on a single "GPU thread" and returns the completion.
  OpResult RunOp(int op, uintptr_t laddr, uint32_t lkey, uintptr_t raddr, uint32_t rkey, uint64_t bytes, uint64_t v1 = 0,
                 uint64_t v2 = 0) {
    GpuBuffer result(sizeof(OpResult), MemoryType::HostPinned);
    core::LaunchKernel(ShortFormOp, Dim3(1), Dim3(1), 0, nullptr, QA(), op, laddr, lkey, raddr, rkey, bytes, v1, v2,
                       result.DataAs<OpResult>());
    EXPECT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
    return *result.DataAs<OpResult>();
  }

  static HostWorkRequest WriteRequest(const RdmaMemoryRegion& src, const RdmaMemoryRegion& dst, size_t bytes,
                                      uint64_t wrId) {
    HostWorkRequest wr;
    wr.op = HostOp::Write;
    wr.laddr = src.addr;
    wr.lkey = src.lkey;
    wr.raddr = dst.addr;
    wr.rkey = dst.rkey;
    wr.bytes = bytes;
    wr.wrId = wrId;
    return wr;
  }

  static std::vector<uint8_t> Read(const GpuBuffer& b, size_t offset, size_t bytes) {
    std::vector<uint8_t> out(bytes);
    EXPECT_EQ(core::GpuMemcpy(out.data(), b.DataAs<uint8_t>() + offset, bytes), core::kGpuSuccess);
    return out;
  }
  static void Fill(GpuBuffer& b, int rank, uint32_t seed) {
    std::vector<uint8_t> v(b.Bytes());
    test::FillPattern(v.data(), v.size(), rank, seed);
    EXPECT_EQ(core::GpuMemcpy(b.Data(), v.data(), v.size()), core::kGpuSuccess);
    // Landed before the NIC (its own non-blocking stream) may write there: a copy from pageable memory
    // returns before its DMA is done.
    EXPECT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  }
  static size_t Mismatch(const GpuBuffer& b, size_t offset, size_t bytes, int rank, uint32_t seed, size_t patternOffset) {
    auto v = Read(b, offset, bytes);
    for (size_t i = 0; i < bytes; ++i) {
      if (v[i] != test::PatternByte(rank, patternOffset + i, seed)) return i;
    }
    return bytes;
  }

  // The wire address of an endpoint's NIC, for raw connections to it.
  static net::SocketAddress WireOf(const RdmaEndpointHandle& h) {
    net::WireAddress w{};
    w.family = AF_INET;
    w.port = h.wirePort;
    std::memcpy(w.addr, h.gid + 12, 4);
    return net::SocketAddress::FromWire(w);
  }

  std::unique_ptr<RdmaContext> context_;
  RdmaDeviceContext* a_ = nullptr;
  RdmaDeviceContext* b_ = nullptr;
  RdmaEndpoint epA_, epB_;
  GpuBuffer queues_;
  std::vector<std::unique_ptr<GpuBuffer>> buffers_;
};

// ---------------------------------------------------------------- operations

TEST_F(EmulatedNic, EveryOperationMovesTheRightBytesAndNothingElse) {
  Connect();
  constexpr size_t kBytes = (1 << 20) + 37;
  GpuBuffer& src = Alloc(kBytes);
  GpuBuffer& dst = Alloc(kBytes + 8192);
  Fill(src, 1, 10);
  Fill(dst, 2, 20);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());

  // Write 1 MiB + 37 bytes into dst at offset 4096; the 4096 bytes on either side stay as they were.
  OpResult w = RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr + 4096, dstMr.rkey, kBytes);
  EXPECT_EQ(w.status, kCqeReq);
  EXPECT_EQ(Mismatch(dst, 4096, kBytes, 1, 10, 0), kBytes) << "written bytes";
  EXPECT_EQ(Mismatch(dst, 0, 4096, 2, 20, 0), 4096u) << "bytes before the target";
  EXPECT_EQ(Mismatch(dst, 4096 + kBytes, 4096, 2, 20, 4096 + kBytes), 4096u) << "bytes after the target";

  // Read 100000 bytes of dst (its untouched head) back into src at offset 8.
  OpResult r = RunOp(1, srcMr.addr + 8, srcMr.lkey, dstMr.addr, dstMr.rkey, 100000);
  EXPECT_EQ(r.status, kCqeReq);
  EXPECT_EQ(r.byteCount, 100000u);
  auto got = Read(src, 8, 100000);
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(got[i], test::PatternByte(2, i, 20)) << i;
  for (size_t i = 4096; i < 100000; ++i) ASSERT_EQ(got[i], test::PatternByte(1, i - 4096, 10)) << i;
  EXPECT_EQ(Mismatch(src, 0, 8, 1, 10, 0), 8u);

  // Inline write of 23 bytes from pinned host memory.
  GpuBuffer& inlineSrc = Alloc(64, MemoryType::HostPinned);
  const char text[] = "inline: 23 bytes here.";
  std::memcpy(inlineSrc.Data(), text, sizeof(text));
  OpResult in = RunOp(2, reinterpret_cast<uintptr_t>(inlineSrc.Data()), 0, dstMr.addr + 64, dstMr.rkey, sizeof(text));
  EXPECT_EQ(in.status, kCqeReq);
  auto inl = Read(dst, 64, sizeof(text));
  EXPECT_EQ(std::memcmp(inl.data(), text, sizeof(text)), 0);
  EXPECT_EQ(Read(dst, 64 + sizeof(text), 1)[0], test::PatternByte(2, 64 + sizeof(text), 20));

  // Atomics on an 8-byte word of dst; the original value lands in src.
  uint64_t start = 1000;
  ASSERT_EQ(core::GpuMemcpy(dst.DataAs<uint8_t>() + 256, &start, 8), core::kGpuSuccess);
  OpResult fa = RunOp(3, srcMr.addr, srcMr.lkey, dstMr.addr + 256, dstMr.rkey, 8, 234);
  EXPECT_EQ(fa.status, kCqeReq);
  uint64_t v = 0;
  ASSERT_EQ(core::GpuMemcpy(&v, src.Data(), 8), core::kGpuSuccess);
  EXPECT_EQ(v, 1000u);
  OpResult csMiss = RunOp(4, srcMr.addr, srcMr.lkey, dstMr.addr + 256, dstMr.rkey, 8, 7, 1000);
  EXPECT_EQ(csMiss.status, kCqeReq);
  ASSERT_EQ(core::GpuMemcpy(&v, src.Data(), 8), core::kGpuSuccess);
  EXPECT_EQ(v, 1234u) << "compare-swap returns the value found";
  OpResult csHit = RunOp(4, srcMr.addr, srcMr.lkey, dstMr.addr + 256, dstMr.rkey, 8, 77, 1234);
  EXPECT_EQ(csHit.status, kCqeReq);
  ASSERT_EQ(core::GpuMemcpy(&v, dst.DataAs<uint8_t>() + 256, 8), core::kGpuSuccess);
  EXPECT_EQ(v, 77u);

  // Send into a receive buffer B posts from the host; B's CQ reports it.
  b_->HostPostRecv(epB_, dstMr.addr + 8192, dstMr.lkey, 5000, 0xabc);
  QB()->wq.rqPostIdx = epB_.wqHandle.rqPostIdx;
  OpResult s = RunOp(5, srcMr.addr + 200000, srcMr.lkey, 0, 0, 3000);  // a part of src no earlier op touched
  EXPECT_EQ(s.status, kCqeReq);
  HostCompletion c[4];
  int n = 0;
  core::Deadline deadline = core::Deadline::After(30);
  while ((n = b_->HostPoll(epB_, c, 4)) == 0 && !deadline.Expired()) std::this_thread::yield();
  ASSERT_EQ(n, 1);
  EXPECT_TRUE(c[0].isReceive);
  EXPECT_EQ(c[0].status, 0);
  EXPECT_EQ(c[0].bytes, 3000u);
  EXPECT_EQ(c[0].wrId, 0xabcu);
  EXPECT_EQ(Mismatch(dst, 8192, 3000, 1, 10, 200000), 3000u);
  EXPECT_EQ(Mismatch(dst, 8192 + 3000, 100, 1, 10, 8192 + 3000 - 4096), 100u) << "bytes after the received message";
}

// Memory of a GPU other than the one current on the NIC's engine thread (found on two H100s: every write and
// read into GPU 1 failed with 'invalid argument', the copy's stream being GPU 1's).
TEST_F(EmulatedNic, WritesReadsAndAtomicsReachMemoryOfASecondGpu) {
  int gpus = 0;
  ASSERT_EQ(core::GpuGetDeviceCount(&gpus), core::kGpuSuccess);
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs (" << gpus << " visible)";
  Connect();
  constexpr size_t kBytes = (3 << 20) + 5;
  GpuBuffer& src = Alloc(kBytes);
  GpuBuffer* dst = nullptr;
  {
    core::DeviceScope second(1);
    dst = &Alloc(kBytes + 8192);
    Fill(*dst, 2, 21);  // synchronises GPU 1
  }
  Fill(src, 1, 11);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst->Data(), dst->Bytes());
  OpResult w = RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr + 4096, dstMr.rkey, kBytes);
  EXPECT_EQ(w.status, kCqeReq);
  EXPECT_EQ(Mismatch(*dst, 4096, kBytes, 1, 11, 0), kBytes) << "written bytes on GPU 1";
  EXPECT_EQ(Mismatch(*dst, 0, 4096, 2, 21, 0), 4096u) << "bytes before the target";
  OpResult r = RunOp(1, srcMr.addr + 16, srcMr.lkey, dstMr.addr, dstMr.rkey, 4096);
  EXPECT_EQ(r.status, kCqeReq);
  EXPECT_EQ(Mismatch(src, 16, 4096, 2, 21, 0), 4096u) << "bytes read from GPU 1";
  uint64_t start = 5000, v = 0;
  ASSERT_EQ(core::GpuMemcpy(dst->DataAs<uint8_t>() + 256, &start, 8), core::kGpuSuccess);
  OpResult fa = RunOp(3, srcMr.addr, srcMr.lkey, dstMr.addr + 256, dstMr.rkey, 8, 37);
  EXPECT_EQ(fa.status, kCqeReq);
  ASSERT_EQ(core::GpuMemcpy(&v, src.Data(), 8), core::kGpuSuccess);
  EXPECT_EQ(v, 5000u) << "fetch-add returns the value found";
  ASSERT_EQ(core::GpuMemcpy(&v, dst->DataAs<uint8_t>() + 256, 8), core::kGpuSuccess);
  EXPECT_EQ(v, 5037u);
}

// Each NIC's engine thread is named "mori-nic:<index>" (top -H, ps -L, gdb, perf): this fixture made two NICs.
TEST_F(EmulatedNic, EveryEngineThreadIsNamed) {
  using core::test::ThreadNames;
  if (ThreadNames().empty()) GTEST_SKIP() << "no /proc/self/task here";
  Connect();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  size_t engines = 0;
  while (true) {
    engines = 0;
    for (const std::string& name : ThreadNames()) engines += name.rfind("mori-nic:", 0) == 0;
    if (engines >= 2 || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(engines, 2u) << "threads named mori-nic:<index>, one per NIC of this fixture";
}

TEST_F(EmulatedNic, ZeroLengthWritesAndSendsComplete) {
  Connect();
  GpuBuffer& src = Alloc(64);
  GpuBuffer& dst = Alloc(64);
  Fill(dst, 8, 80);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  EXPECT_EQ(RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 0).status, kCqeReq);
  b_->HostPostRecv(epB_, dstMr.addr, dstMr.lkey, 64, 5);
  EXPECT_EQ(RunOp(5, srcMr.addr, srcMr.lkey, 0, 0, 0).status, kCqeReq);
  HostCompletion c[1];
  int n = 0;
  core::Deadline deadline = core::Deadline::After(30);
  while ((n = b_->HostPoll(epB_, c, 1)) == 0 && !deadline.Expired()) std::this_thread::yield();
  ASSERT_EQ(n, 1);
  EXPECT_EQ(c[0].status, 0);
  EXPECT_EQ(c[0].bytes, 0u);
  EXPECT_EQ(c[0].wrId, 5u);
  EXPECT_EQ(Mismatch(dst, 0, 64, 8, 80, 0), 64u) << "zero-length operations wrote something";
}

// A kernel posts and quiets on an endpoint that also receives: the receive completion in its CQ is set aside
// for the application, not eaten by the retiring of send completions, and does not block it either.
MORI_GLOBAL void WritesThenQuiet(Queues* q, RdmaMemoryRegion src, RdmaMemoryRegion dst, uint32_t count, uint32_t* errors) {
  for (uint32_t i = 0; i < count; ++i) {
    PostWriteOrdered<kMlx5>(q->wq, q->cq, src.addr, src.lkey, dst.addr, dst.rkey, 8, i % 4 == 0, kTimeoutNs);
  }
  *errors = QuietQueue<kMlx5>(q->wq, q->cq, kTimeoutNs);
}

TEST_F(EmulatedNic, ReceiveCompletionsSurviveSendRetirement) {
  Connect();
  GpuBuffer& src = Alloc(256);
  GpuBuffer& dst = Alloc(256);
  GpuBuffer& inbox = Alloc(128);
  Fill(src, 9, 90);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion inboxMr = a_->RegisterRdmaMemoryRegion(inbox.Data(), inbox.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  RdmaMemoryRegion bSrc = b_->RegisterRdmaMemoryRegion(dst.DataAs<uint8_t>() + 128, 100);
  a_->HostPostRecv(epA_, inboxMr.addr, inboxMr.lkey, 128, 0x77);
  QA()->wq.rqPostIdx = epA_.wqHandle.rqPostIdx;
  // B sends 100 bytes to A; A's CQ now holds a receive completion before any of A's send completions.
  HostWorkRequest send;
  send.op = HostOp::Send;
  send.laddr = bSrc.addr;
  send.lkey = bSrc.lkey;
  send.bytes = 100;
  send.wrId = 1;
  b_->HostPost(epB_, send);
  HostCompletion bc[1];
  core::Deadline deadline = core::Deadline::After(30);
  while (b_->HostPoll(epB_, bc, 1) == 0 && !deadline.Expired()) std::this_thread::yield();
  GpuBuffer& errors = Alloc(4, MemoryType::HostPinned);
  *errors.DataAs<uint32_t>() = 99;
  core::LaunchKernel(WritesThenQuiet, Dim3(1), Dim3(1), 0, nullptr, QA(), srcMr, dstMr, 300u, errors.DataAs<uint32_t>());
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  EXPECT_EQ(*errors.DataAs<uint32_t>(), 0u);
  // The application's poll still finds the receive, with its byte count.
  epA_.wqHandle = QA()->wq;
  epA_.cqHandle = QA()->cq;
  HostCompletion c[4];
  int n = a_->HostPoll(epA_, c, 4);
  ASSERT_GE(n, 1);
  EXPECT_TRUE(c[0].isReceive);
  EXPECT_EQ(c[0].status, 0);
  EXPECT_EQ(c[0].bytes, 100u);
  EXPECT_EQ(c[0].wrId, 0x77u);
  EXPECT_EQ(QA()->wq.rqDoneIdx, 1u);
}

TEST_F(EmulatedNic, WritesLandInPostingOrder) {
  Connect();
  constexpr uint32_t kCount = 2000;
  GpuBuffer& src = Alloc(kCount * 8, MemoryType::HostPinned);
  GpuBuffer& dst = Alloc(8);
  auto* values = src.DataAs<uint64_t>();
  for (uint32_t i = 0; i < kCount; ++i) values[i] = 0x5000000000ull + i;
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  // Host-posted: every write goes to the same word; after each completion the word must hold that write.
  for (uint32_t i = 0; i < kCount; ++i) {
    HostWorkRequest wr = WriteRequest(srcMr, dstMr, 8, i);
    wr.laddr += i * 8;
    wr.signaled = (i % 16 == 15) || i == kCount - 1;
    while (epA_.wqHandle.postIdx - epA_.wqHandle.doneIdx >= epA_.wqHandle.sqWqeNum - 1) {
      HostCompletion c[16];
      int n = a_->HostPoll(epA_, c, 16);
      for (int k = 0; k < n; ++k) ASSERT_EQ(c[k].status, 0);
    }
    a_->HostPost(epA_, wr);
  }
  core::Deadline deadline = core::Deadline::After(60);
  uint64_t lastId = 0;
  while (epA_.wqHandle.doneIdx != kCount && !deadline.Expired()) {
    HostCompletion c[16];
    int n = a_->HostPoll(epA_, c, 16);
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(c[k].status, 0);
      EXPECT_GT(c[k].wrId + 1, lastId) << "completions in order";
      lastId = c[k].wrId + 1;
    }
  }
  ASSERT_EQ(epA_.wqHandle.doneIdx, kCount);
  uint64_t final = 0;
  ASSERT_EQ(core::GpuMemcpy(&final, dst.Data(), 8), core::kGpuSuccess);
  EXPECT_EQ(final, 0x5000000000ull + kCount - 1) << "the last write posted is the last to land";
}

class EmulatedNicDepth : public EmulatedNic, public ::testing::WithParamInterface<uint32_t> {};

TEST_P(EmulatedNicDepth, HundredThousandWqesWrapEveryQueue) {
  const uint32_t depth = GetParam();
  RdmaEndpointConfig config;
  config.maxMsgsNum = depth;
  config.maxCqeNum = depth;  // the CQ wraps as often as the send queue
  Connect(config);
  EXPECT_GE(QA()->wq.sqWqeNum, depth);
  constexpr uint32_t kCount = 100000;
  constexpr uint32_t kSlots = 1024;
  GpuBuffer& src = Alloc(kSlots * 8);
  GpuBuffer& dst = Alloc(kSlots * 8 + 64);
  std::vector<uint64_t> init(kSlots);
  for (uint32_t s = 0; s < kSlots; ++s) init[s] = 0xfeed000000000000ull | s;
  ASSERT_EQ(core::GpuMemcpy(src.Data(), init.data(), src.Bytes()), core::kGpuSuccess);
  Fill(dst, 3, 30);
  GpuBuffer& meta = Alloc(sizeof(RdmaMemoryRegion) + sizeof(uint32_t), MemoryType::HostPinned);
  auto* srcMr = meta.DataAs<RdmaMemoryRegion>();
  *srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  auto* errors = reinterpret_cast<uint32_t*>(srcMr + 1);
  *errors = 99;
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  auto stats0 = GetEmulatedNicControl(a_)->Stats();
  core::LaunchKernel(PostManyWrites, Dim3(1), Dim3(1), 0, nullptr, QA(), srcMr, dstMr, kCount, kSlots, errors);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  EXPECT_EQ(*errors, 0u);
  EXPECT_EQ(QA()->wq.doneIdx, QA()->wq.postIdx);
  EXPECT_EQ(QA()->wq.postIdx, kCount + 1) << "100k writes and the quiet's NOP";
  auto stats = GetEmulatedNicControl(a_)->Stats();
  EXPECT_EQ(stats.wqesExecuted - stats0.wqesExecuted, kCount + 1);
  std::vector<uint64_t> out(kSlots);
  ASSERT_EQ(core::GpuMemcpy(out.data(), dst.Data(), kSlots * 8), core::kGpuSuccess);
  for (uint32_t s = 0; s < kSlots; ++s) ASSERT_EQ(out[s], init[s]) << "slot " << s;
  EXPECT_EQ(Mismatch(dst, kSlots * 8, 64, 3, 30, kSlots * 8), 64u) << "bytes past the array";
}

INSTANTIATE_TEST_SUITE_P(Depths, EmulatedNicDepth, ::testing::Values(1u, 2u, 3u, 1024u),
                         [](const testing::TestParamInfo<uint32_t>& p) { return "depth" + std::to_string(p.param); });

TEST_F(EmulatedNic, ManyThreadsPostToOneQueuePair) {
  // Far fewer slots than threads x rounds: reservation and flow control both work.
#if MORI_BACKEND_HOST
  ManyThreadsOnOneQp(64, Dim3(2), Dim3(16), 50);
#else
  ManyThreadsOnOneQp(64, Dim3(8), Dim3(64), 20);
#endif
}

// A queue shallower than a warp: the lanes of one warp wait for room that completions of their own warp's WQEs
// make, and for doorbells that lanes of their own warp ring (PostOrdered does both in one loop).
TEST_F(EmulatedNic, ManyThreadsPostToAQueueShallowerThanAWarp) {
#if MORI_BACKEND_HOST
  ManyThreadsOnOneQp(4, Dim3(1), Dim3(16), 20);
#else
  ManyThreadsOnOneQp(8, Dim3(2), Dim3(64), 10);
#endif
}

TEST_F(EmulatedNic, AReservationOfTheMostSlotsAtOnceFindsRoomWhereverItFalls) {
  RdmaEndpointConfig config;
  config.maxMsgsNum = 8;
  Connect(config);
  constexpr uint32_t kWords = 8;
  GpuBuffer& src = Alloc(kWords * 8);
  GpuBuffer& dst = Alloc(kWords * 8 + 64);
  std::vector<uint64_t> values(kWords);
  for (uint32_t i = 0; i < kWords; ++i) values[i] = 0xab0000000000ull + i * 0x10001ull;
  ASSERT_EQ(core::GpuMemcpy(src.Data(), values.data(), src.Bytes()), core::kGpuSuccess);
  Fill(dst, 7, 70);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  GpuBuffer& out = Alloc(3 * sizeof(uint32_t), MemoryType::HostPinned);
  core::LaunchKernel(WorstPlacedReservation, Dim3(1), Dim3(1), 0, nullptr, QA(), srcMr, dstMr, out.DataAs<uint32_t>());
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  const uint32_t* o = out.DataAs<uint32_t>();
  EXPECT_EQ(o[0], 3u) << "the reservation starts 3 slots after the last signaled one";
  EXPECT_EQ(o[1], 5u);
  EXPECT_EQ(o[2], 0u) << "error completions";
  std::vector<uint64_t> got(kWords);
  ASSERT_EQ(core::GpuMemcpy(got.data(), dst.Data(), kWords * 8), core::kGpuSuccess);
  for (uint32_t i = 0; i < kWords; ++i) EXPECT_EQ(got[i], values[i]) << "word " << i;
  EXPECT_EQ(Mismatch(dst, kWords * 8, 64, 7, 70, kWords * 8), 64u) << "bytes past the written words";
}

void EmulatedNic::ManyThreadsOnOneQp(uint32_t depth, Dim3 grid, Dim3 block, uint32_t rounds) {
  RdmaEndpointConfig config;
  config.maxMsgsNum = depth;
  Connect(config);
  const uint32_t threads = grid.x * block.x;
  GpuBuffer& src = Alloc(size_t(threads) * rounds * 8);
  GpuBuffer& dst = Alloc(threads * 8);
  std::vector<uint64_t> values(size_t(threads) * rounds);
  for (uint32_t r = 1; r <= rounds; ++r) {
    for (uint32_t t = 0; t < threads; ++t) values[size_t(r - 1) * threads + t] = (uint64_t(t) << 32) | r;
  }
  ASSERT_EQ(core::GpuMemcpy(src.Data(), values.data(), src.Bytes()), core::kGpuSuccess);
  ASSERT_EQ(core::GpuMemset(dst.Data(), 0, dst.Bytes()), core::kGpuSuccess);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  GpuBuffer& errors = Alloc(4, MemoryType::HostPinned);
  *errors.DataAs<uint32_t>() = 0;
  core::LaunchKernel(ManyThreadsOneQp, grid, block, 0, nullptr, QA(), srcMr, dstMr, rounds, errors.DataAs<uint32_t>());
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  EXPECT_EQ(*errors.DataAs<uint32_t>(), 0u);
  std::vector<uint64_t> out(threads);
  ASSERT_EQ(core::GpuMemcpy(out.data(), dst.Data(), dst.Bytes()), core::kGpuSuccess);
  for (uint32_t t = 0; t < threads; ++t) EXPECT_EQ(out[t], (uint64_t(t) << 32) | rounds) << "thread " << t;
  EXPECT_EQ(QA()->wq.dbTouchIdx, QA()->wq.postIdx) << "every reserved slot was announced";
}

// ---------------------------------------------------------------- errors

struct ErrorCase {
  const char* name;
  int op;
  uint8_t syndrome;
};

TEST_F(EmulatedNic, ViolationsGiveTheRightSyndromeAndTouchNothing) {
  Connect();
  GpuBuffer& src = Alloc(8192);
  GpuBuffer& dst = Alloc(3 * 4096);
  Fill(src, 4, 40);
  Fill(dst, 5, 50);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), 4096);
  // Only the middle page of dst is registered; its neighbours must never change.
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.DataAs<uint8_t>() + 4096, 4096);
  RdmaMemoryRegion readOnly = b_->RegisterRdmaMemoryRegion(dst.DataAs<uint8_t>() + 8192, 4096, kRdmaAccessRemoteRead);
  RdmaMemoryRegion noLocalWrite = a_->RegisterRdmaMemoryRegion(src.DataAs<uint8_t>() + 4096, 4096, kRdmaAccessRemoteRead);
  GpuBuffer& big = Alloc(40, MemoryType::HostPinned);
  std::memset(big.Data(), 0x42, 40);

  struct Case {
    const char* what;
    int op;
    uintptr_t laddr;
    uint32_t lkey;
    uintptr_t raddr;
    uint32_t rkey;
    uint64_t bytes;
    uint8_t syndrome;
  };
  const Case cases[] = {
      {"bad lkey", 0, srcMr.addr, srcMr.lkey ^ 0x1111, dstMr.addr, dstMr.rkey, 64, kSyndromeLocalProtErr},
      {"local range past its region", 0, srcMr.addr + 4000, srcMr.lkey, dstMr.addr, dstMr.rkey, 200,
       kSyndromeLocalProtErr},
      {"bad rkey", 0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey ^ 0x2222, 64, kSyndromeRemoteAccessErr},
      {"remote range past its region", 0, srcMr.addr, srcMr.lkey, dstMr.addr + 4000, dstMr.rkey, 200,
       kSyndromeRemoteAccessErr},
      {"remote address before its region", 0, srcMr.addr, srcMr.lkey, dstMr.addr - 8, dstMr.rkey, 16,
       kSyndromeRemoteAccessErr},
      {"write into a read-only region", 0, srcMr.addr, srcMr.lkey, readOnly.addr, readOnly.rkey, 64,
       kSyndromeRemoteAccessErr},
      {"read into memory without local write", 1, noLocalWrite.addr, noLocalWrite.lkey, dstMr.addr, dstMr.rkey, 64,
       kSyndromeLocalProtErr},
      // A handle claiming more inline room than the QP has: the NIC checks the QP's real limit.
      {"oversize inline", 2, reinterpret_cast<uintptr_t>(big.Data()), 0, dstMr.addr, dstMr.rkey, 40,
       kSyndromeLocalLengthErr},
      {"atomic on a region without remote atomics", 3, srcMr.addr, srcMr.lkey, readOnly.addr, readOnly.rkey, 8,
       kSyndromeRemoteAccessErr},
      {"misaligned atomic", 3, srcMr.addr, srcMr.lkey, dstMr.addr + 4, dstMr.rkey, 8, kSyndromeRemoteInvalReqErr},
      // Zero bytes are checked like any other length: the address must lie in the region.
      {"zero-length write before its region", 0, srcMr.addr, srcMr.lkey, dstMr.addr - 8, dstMr.rkey, 0,
       kSyndromeRemoteAccessErr},
      {"zero-length read past its region", 1, srcMr.addr, srcMr.lkey, dstMr.addr + 4097, dstMr.rkey, 0,
       kSyndromeRemoteAccessErr},
      {"zero-length write with a bad rkey", 0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey ^ 0x3333, 0,
       kSyndromeRemoteAccessErr},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    // A fresh pair per case: an error leaves the QP in the error state.
    a_->DestroyRdmaEndpoint(epA_.handle);
    b_->DestroyRdmaEndpoint(epB_.handle);
    Connect();
    if (c.op == 2) QA()->wq.maxInlineData = 64;
    OpResult r = RunOp(c.op, c.laddr, c.lkey, c.raddr, c.rkey, c.bytes);
    ASSERT_TRUE(IsCqError(r.status)) << "status " << r.status;
    EXPECT_EQ(CqErrorSyndrome(r.status), c.syndrome) << SyndromeName(CqErrorSyndrome(r.status));
    EXPECT_EQ(Mismatch(dst, 0, dst.Bytes(), 5, 50, 0), dst.Bytes()) << "destination memory changed";
    EXPECT_EQ(Mismatch(src, 0, src.Bytes(), 4, 40, 0), src.Bytes()) << "source memory changed";
  }
}

TEST_F(EmulatedNic, AnErrorFlushesEverythingAfterItInOrder) {
  Connect();
  GpuBuffer& src = Alloc(4096);
  GpuBuffer& dst = Alloc(4096);
  Fill(src, 6, 60);
  Fill(dst, 7, 70);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  GetEmulatedNicControl(a_)->SetDelayMicroseconds(2000);  // all five are posted before the NIC looks
  for (uint32_t i = 0; i < 5; ++i) {
    HostWorkRequest wr = WriteRequest(srcMr, dstMr, 16, 100 + i);
    wr.raddr += 16 * i;  // each to its own 16 bytes of dst
    if (i == 1) wr.rkey ^= 1;  // the second one is bad
    wr.signaled = i != 3;  // an unsignaled WQE after the error still completes (flushed)
    a_->HostPost(epA_, wr);
  }
  GetEmulatedNicControl(a_)->SetDelayMicroseconds(0);
  std::vector<HostCompletion> got;
  core::Deadline deadline = core::Deadline::After(30);
  while (got.size() < 5 && !deadline.Expired()) {
    HostCompletion c[8];
    int n = a_->HostPoll(epA_, c, 8);
    got.insert(got.end(), c, c + n);
  }
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[0].status, 0);
  EXPECT_EQ(got[1].status, kSyndromeRemoteAccessErr);
  for (int i = 2; i < 5; ++i) EXPECT_EQ(got[i].status, kSyndromeWrFlushErr) << i;
  // Writes behind the refused one may already have been on the wire, but the responder drops them (out of
  // sequence after a refusal): a flag written after bad data never lands.
  EXPECT_EQ(Mismatch(dst, 0, 16, 6, 60, 0), 16u) << "the write before the error landed";
  EXPECT_EQ(Mismatch(dst, 16, dst.Bytes() - 16, 7, 70, 16), dst.Bytes() - 16) << "nothing after the error landed";
  for (int i = 0; i < 5; ++i) {
    if (i != 3) {
      EXPECT_EQ(got[i].wrId, 100u + i);
    }
  }
  // The QP stays in error: a new post is flushed too.
  a_->HostPost(epA_, WriteRequest(srcMr, dstMr, 8, 7));
  HostCompletion c[1];
  deadline = core::Deadline::After(30);
  int n = 0;
  while ((n = a_->HostPoll(epA_, c, 1)) == 0 && !deadline.Expired()) std::this_thread::yield();
  ASSERT_EQ(n, 1);
  EXPECT_EQ(c[0].status, kSyndromeWrFlushErr);
  EXPECT_EQ(c[0].wrId, 7u);
}

TEST_F(EmulatedNic, SendsWithoutReceiveBuffersOrTooLargeFail) {
  Connect();
  GetEmulatedNicControl(b_)->SetRnrTimeoutMilliseconds(200);
  GpuBuffer& src = Alloc(4096);
  GpuBuffer& dst = Alloc(4096);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  OpResult rnr = RunOp(5, srcMr.addr, srcMr.lkey, 0, 0, 100);
  ASSERT_TRUE(IsCqError(rnr.status));
  EXPECT_EQ(CqErrorSyndrome(rnr.status), kSyndromeRnrRetryExcErr);

  a_->DestroyRdmaEndpoint(epA_.handle);
  b_->DestroyRdmaEndpoint(epB_.handle);
  Connect();
  b_->HostPostRecv(epB_, dstMr.addr, dstMr.lkey, 64, 1);
  OpResult tooBig = RunOp(5, srcMr.addr, srcMr.lkey, 0, 0, 100);
  ASSERT_TRUE(IsCqError(tooBig.status));
  EXPECT_EQ(CqErrorSyndrome(tooBig.status), kSyndromeRemoteInvalReqErr);
  HostCompletion c[2];
  int n = 0;
  core::Deadline deadline = core::Deadline::After(30);
  while ((n = b_->HostPoll(epB_, c, 2)) == 0 && !deadline.Expired()) std::this_thread::yield();
  ASSERT_GE(n, 1);
  EXPECT_TRUE(c[0].isReceive);
  EXPECT_EQ(c[0].status, kSyndromeLocalLengthErr) << "the responder reports the overflow on its own CQ";
}

TEST_F(EmulatedNic, ACorruptedKeyIsARemoteAccessError) {
  Connect();
  GpuBuffer& src = Alloc(256);
  GpuBuffer& dst = Alloc(256);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  GetEmulatedNicControl(a_)->CorruptNextRemoteKey();
  OpResult r = RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 64);
  ASSERT_TRUE(IsCqError(r.status));
  EXPECT_EQ(CqErrorSyndrome(r.status), kSyndromeRemoteAccessErr);
}

// A peer on the NIC's wire (greeted with the NIC's nonce) announcing a 1 GiB write and sending 16 bytes of it:
// the NIC receives payloads in pieces as they come (its memory does not grow by the announced size), drops
// the connection when it closes, and the connected QPs go on working.
TEST_F(EmulatedNic, AHugeAnnouncedPayloadCostsNothingUntilItArrives) {
  Connect();
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  {
    UniqueFd fd = net::ConnectWithRetry(WireOf(epB_.handle), core::Deadline::After(10), "the emulated NIC");
    SendPacket(fd.Get(), Hello(epB_.handle.wireNonce, 0x1234));
    emulated::PacketHeader h = Header(emulated::PacketType::WriteRequest, epB_.handle.qpn);
    h.length = 1ull << 30;
    SendPacket(fd.Get(), h, std::vector<uint8_t>(16, 0x6b));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the NIC reads what came
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 256 * 1024) << "KiB of peak memory the announcement cost";

  GpuBuffer& src = Alloc(4096);
  GpuBuffer& dst = Alloc(4096);
  Fill(src, 3, 7);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  OpResult r = RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 4096);
  EXPECT_FALSE(IsCqError(r.status));
  EXPECT_EQ(Read(dst, 0, 4096), Read(src, 0, 4096));
}

// Only holders of an endpoint handle can talk to a NIC. A connection whose first packet is not a hello with the
// NIC's nonce (a write straight away, another NIC's nonce, silence) is closed before any payload is taken. A
// greeted connection gets one answer for every request it may not make (a QP connected to another NIC, a PSN
// out of sequence, no such QP): the NAK a bad key gets. A response on a connection its QP did not ask on is
// dropped. Nothing lands, and the real pair goes on working.
TEST_F(EmulatedNic, StrangersOnTheWireAreRefused) {
  Connect();
  GpuBuffer& src = Alloc(4096);
  GpuBuffer& dst = Alloc(4096);
  Fill(src, 6, 60);
  Fill(dst, 7, 70);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  EmulatedNicControl* nicA = GetEmulatedNicControl(a_);
  EmulatedNicControl* nicB = GetEmulatedNicControl(b_);
  const uint64_t refusedA = nicA->Stats().strangersRefused, refusedB = nicB->Stats().strangersRefused;
  const uint64_t served = nicB->Stats().requestsServed;
  const net::SocketAddress wireB = WireOf(epB_.handle);
  auto connect = [&](const net::SocketAddress& to) {
    return net::ConnectWithRetry(to, core::Deadline::After(10), "the emulated NIC");
  };
  // A write that would be valid if it came from A: right QPs, PSN, key and address.
  emulated::PacketHeader write = Header(emulated::PacketType::WriteRequest, epB_.handle.qpn);
  write.srcQpn = epA_.handle.qpn;
  write.psn = epA_.handle.psn;
  write.rkey = dstMr.rkey;
  write.raddr = dstMr.addr;
  write.length = 64;
  const std::vector<uint8_t> junk(64, 0x6b);

  UniqueFd silent = connect(wireB);  // says nothing: closed after the hello wait
  UniqueFd noHello = connect(wireB);
  SendPacket(noHello.Get(), write, junk);
  EXPECT_TRUE(ClosedByPeer(noHello.Get(), 10)) << "a connection that skipped the hello stayed open";
  UniqueFd wrongNonce = connect(wireB);
  SendPacket(wrongNonce.Get(), Hello(epB_.handle.wireNonce ^ 1, 0x77));
  SendPacket(wrongNonce.Get(), write, junk);
  EXPECT_TRUE(ClosedByPeer(wrongNonce.Get(), 10)) << "a hello with another NIC's nonce was taken";

  // Greeted, but as a NIC that B's QP is not connected to: the same NAK for each request.
  UniqueFd other = connect(wireB);
  SendPacket(other.Get(), Hello(epB_.handle.wireNonce, epA_.handle.wireNonce ^ 0x5a5a));
  emulated::PacketHeader outOfSequence = write;
  outOfSequence.psn = (epA_.handle.psn + 7) & 0xffffff;
  emulated::PacketHeader noSuchQp = write;
  noSuchQp.dstQpn = epB_.handle.qpn ^ 0x800000;
  for (const emulated::PacketHeader& h : {write, outOfSequence, noSuchQp}) {
    SendPacket(other.Get(), h, junk);
    emulated::PacketHeader answer{};
    net::RecvAll(other.Get(), &answer, sizeof(answer), core::Deadline::After(10), "the emulated NIC");
    EXPECT_EQ(answer.type, static_cast<uint8_t>(emulated::PacketType::Ack));
    EXPECT_EQ(answer.syndrome, kSyndromeRemoteAccessErr) << "psn " << h.psn << " qp " << h.dstQpn;
    EXPECT_EQ(answer.psn, h.psn);
  }
  // A response to A's QP, greeted with A's own nonce, on a connection A's QP never asked on.
  UniqueFd spoof = connect(WireOf(epA_.handle));
  SendPacket(spoof.Get(), Hello(epA_.handle.wireNonce, epB_.handle.wireNonce));
  emulated::PacketHeader response = Header(emulated::PacketType::ReadResponse, epA_.handle.qpn);
  response.srcQpn = epB_.handle.qpn;
  response.psn = epA_.handle.psn;
  response.length = 64;
  SendPacket(spoof.Get(), response, junk);

  EXPECT_TRUE(ClosedByPeer(silent.Get(), 15)) << "a silent connection stayed open";
  EXPECT_EQ(nicB->Stats().strangersRefused - refusedB, 3u) << "no hello, a wrong nonce, silence";
  core::Deadline deadline = core::Deadline::After(10);
  while (nicA->Stats().strangersRefused == refusedA && !deadline.Expired()) std::this_thread::yield();
  EXPECT_EQ(nicA->Stats().strangersRefused - refusedA, 1u) << "the spoofed response";
  EXPECT_EQ(nicB->Stats().requestsServed, served) << "a stranger's request ran";
  EXPECT_EQ(Mismatch(dst, 0, dst.Bytes(), 7, 70, 0), dst.Bytes()) << "a stranger's bytes landed";

  // The real pair: A reads B's first 64 bytes, then writes its own over them.
  OpResult r = RunOp(1, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 64);
  ASSERT_EQ(r.status, kCqeReq);
  EXPECT_EQ(Mismatch(src, 0, 64, 7, 70, 0), 64u) << "the read returned other bytes";
  Fill(src, 6, 60);
  ASSERT_EQ(RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 64).status, kCqeReq);
  EXPECT_EQ(Mismatch(dst, 0, 64, 6, 60, 0), 64u);
  EXPECT_EQ(Mismatch(dst, 64, dst.Bytes() - 64, 7, 70, 64), dst.Bytes() - 64);
}

// An atomic request whose opcode is neither fetch-add nor compare-swap is an invalid request, NAKed like a
// misaligned one, and changes nothing (it ran as a compare-swap before; fuzz_emulated_nic found it). The request
// comes from a raw connection greeted with A's nonce, with A's QP number and next PSN, so that only the opcode is
// wrong; A's own atomic with that PSN runs afterwards.
TEST_F(EmulatedNic, AnUnknownAtomicOpcodeIsAnInvalidRequest) {
  Connect();
  GpuBuffer& word = Alloc(64);
  GpuBuffer& old = Alloc(8);
  Fill(word, 8, 80);
  RdmaMemoryRegion wordMr = b_->RegisterRdmaMemoryRegion(word.Data(), word.Bytes());
  RdmaMemoryRegion oldMr = a_->RegisterRdmaMemoryRegion(old.Data(), old.Bytes());
  UniqueFd fd = net::ConnectWithRetry(WireOf(epB_.handle), core::Deadline::After(10), "the emulated NIC");
  SendPacket(fd.Get(), Hello(epB_.handle.wireNonce, epA_.handle.wireNonce));
  for (uint8_t op : {uint8_t{2}, uint8_t{0x80}, uint8_t{0xff}}) {
    emulated::PacketHeader h = Header(emulated::PacketType::AtomicRequest, epB_.handle.qpn);
    h.srcQpn = epA_.handle.qpn;
    h.psn = epA_.handle.psn;
    h.rkey = wordMr.rkey;
    h.raddr = wordMr.addr + 8;
    h.atomicOp = op;
    h.swapAdd = 0x1234;
    h.compare = 0;
    SendPacket(fd.Get(), h);
    emulated::PacketHeader answer{};
    net::RecvAll(fd.Get(), &answer, sizeof(answer), core::Deadline::After(10), "the emulated NIC");
    EXPECT_EQ(answer.type, static_cast<uint8_t>(emulated::PacketType::Ack)) << "atomic op " << int(op);
    EXPECT_EQ(answer.syndrome, kSyndromeRemoteInvalReqErr) << "atomic op " << int(op);
    EXPECT_EQ(answer.psn, h.psn);
  }
  EXPECT_EQ(Mismatch(word, 0, word.Bytes(), 8, 80, 0), word.Bytes()) << "an unknown atomic changed memory";
  // The refused requests did not take A's PSN: A's fetch-add with it runs.
  OpResult r = RunOp(3, oldMr.addr, oldMr.lkey, wordMr.addr + 8, wordMr.rkey, 8, 1);
  EXPECT_EQ(r.status, kCqeReq);
  EXPECT_EQ(Mismatch(word, 0, 8, 8, 80, 0), 8u);
  EXPECT_EQ(Mismatch(word, 16, word.Bytes() - 16, 8, 80, 16), word.Bytes() - 16);
}

// What comes back is checked against what was asked and against what is still registered: a read whose
// destination is deregistered while it is in flight completes with a local protection error and writes nothing,
// and so does an answer of the wrong kind (an ACK to a read). The peer is the test itself on a raw socket
// posing as a NIC; it also checks the hello A opens the connection with.
TEST_F(EmulatedNic, ResponsesAreCheckedAgainstTheRequestAndTheRegistration) {
  Connect();
  GpuBuffer& dst = Alloc(256);
  Fill(dst, 9, 90);
  net::SocketAddress at = WireOf(epB_.handle);
  at.SetPort(0);
  UniqueFd listener = net::Listen(at);
  RdmaEndpointHandle fake = epB_.handle;
  fake.wirePort = at.Port();
  fake.wireNonce = 0xfeedfacecafe;
  fake.qpn = 0x123456;
  fake.psn = 100;
  auto postRead = [&](RdmaEndpoint& ep, const RdmaMemoryRegion& into) {
    HostWorkRequest wr;
    wr.op = HostOp::Read;
    wr.laddr = into.addr;
    wr.lkey = into.lkey;
    wr.raddr = 0x10000;
    wr.rkey = 0x99;
    wr.bytes = 64;
    a_->HostPost(ep, wr);
  };
  auto completion = [&](RdmaEndpoint& ep) {
    HostCompletion c{};
    core::Deadline deadline = core::Deadline::After(30);
    while (a_->HostPoll(ep, &c, 1) == 0 && !deadline.Expired()) std::this_thread::yield();
    return c.status;
  };
  auto answer = [&](int fd, const emulated::PacketHeader& request, emulated::PacketType type) {
    emulated::PacketHeader h = Header(type, request.srcQpn);
    h.srcQpn = request.dstQpn;
    h.psn = request.psn;
    h.length = type == emulated::PacketType::ReadResponse ? request.length : 0;
    SendPacket(fd, h, std::vector<uint8_t>(h.length, 0x6b));
  };

  RdmaEndpoint first = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  a_->ConnectEndpoint(first.handle, fake);
  RdmaMemoryRegion mr = a_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  postRead(first, mr);
  UniqueFd peer = net::AcceptOne(listener.Get(), core::Deadline::After(10));
  ASSERT_TRUE(peer);
  emulated::PacketHeader hello{}, request{};
  net::RecvAll(peer.Get(), &hello, sizeof(hello), core::Deadline::After(10), "NIC A");
  EXPECT_EQ(hello.type, static_cast<uint8_t>(emulated::PacketType::Hello));
  EXPECT_EQ(hello.raddr, fake.wireNonce) << "the hello must name the nonce of the NIC it reaches";
  EXPECT_EQ(hello.swapAdd, epA_.handle.wireNonce) << "and the nonce of the NIC it comes from";
  EXPECT_TRUE(emulated::PacketCheckPasses(hello, nullptr, 0)) << "the hello's integrity check";
  net::RecvAll(peer.Get(), &request, sizeof(request), core::Deadline::After(10), "NIC A");
  ASSERT_EQ(request.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  EXPECT_EQ(request.dstQpn, fake.qpn);
  EXPECT_EQ(request.psn, first.handle.psn);
  a_->DeregisterRdmaMemoryRegion(dst.Data());  // while the read is in flight
  answer(peer.Get(), request, emulated::PacketType::ReadResponse);
  EXPECT_EQ(completion(first), kSyndromeLocalProtErr);
  EXPECT_EQ(Mismatch(dst, 0, dst.Bytes(), 9, 90, 0), dst.Bytes()) << "a response wrote deregistered memory";

  RdmaEndpoint second = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  a_->ConnectEndpoint(second.handle, fake);
  mr = a_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  postRead(second, mr);
  net::RecvAll(peer.Get(), &request, sizeof(request), core::Deadline::After(10), "NIC A");  // the same connection
  ASSERT_EQ(request.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  answer(peer.Get(), request, emulated::PacketType::Ack);
  EXPECT_EQ(completion(second), kSyndromeBadRespErr);
  EXPECT_EQ(Mismatch(dst, 0, dst.Bytes(), 9, 90, 0), dst.Bytes());

  // A NAK completes its request with the responder's error only where RC has one for a requester; a code that
  // would pass for a local error or a flush is a bad response.
  for (const auto& [wire, want] : {std::pair<uint8_t, uint8_t>{kSyndromeRemoteAccessErr, kSyndromeRemoteAccessErr},
                                   {kSyndromeRnrRetryExcErr, kSyndromeRnrRetryExcErr},
                                   {kSyndromeWrFlushErr, kSyndromeBadRespErr},
                                   {kSyndromeLocalProtErr, kSyndromeBadRespErr},
                                   {0x7f, kSyndromeBadRespErr}}) {
    RdmaEndpoint ep = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
    a_->ConnectEndpoint(ep.handle, fake);
    postRead(ep, mr);
    net::RecvAll(peer.Get(), &request, sizeof(request), core::Deadline::After(10), "NIC A");
    ASSERT_EQ(request.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
    emulated::PacketHeader nak = Header(emulated::PacketType::Ack, request.srcQpn);
    nak.srcQpn = request.dstQpn;
    nak.psn = request.psn;
    nak.syndrome = wire;
    SendPacket(peer.Get(), nak, {});
    EXPECT_EQ(completion(ep), want) << "a NAK of 0x" << std::hex << unsigned{wire};
    EXPECT_EQ(Mismatch(dst, 0, dst.Bytes(), 9, 90, 0), dst.Bytes());
  }
}

// RC's ack timer. A peer that takes requests and never answers (its NIC stopped or stuck while its kernel keeps the
// TCP connection up) fails the oldest request with transport-retry-exceeded once the ack timeout has passed, the
// QP goes to the error state and what follows, posted before or after, is flushed; a read that timed out writes
// nothing, even when its response comes late. A peer that answers within the timeout, each answer later than the
// timeout after the first request went out, and a WQE that the delay knob holds back for longer than the timeout
// before it is sent, complete. The silent and the slow peer are the test on a raw socket posing as a NIC.
TEST_F(EmulatedNic, ARequestNobodyAnswersFailsAfterTheAckTimeout) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kAckTimeout = std::chrono::milliseconds(1500);
  Connect();
  EmulatedNicControl* nic = GetEmulatedNicControl(a_);
  nic->SetAckTimeoutMilliseconds(static_cast<uint32_t>(kAckTimeout.count()));
  GpuBuffer& src = Alloc(64);
  GpuBuffer& dst = Alloc(256);   // A's, for reads
  GpuBuffer& bDst = Alloc(64);   // B's, for the delayed write
  Fill(src, 3, 31);
  Fill(dst, 4, 41);
  Fill(bDst, 5, 51);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = a_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  RdmaMemoryRegion bMr = b_->RegisterRdmaMemoryRegion(bDst.Data(), bDst.Bytes());
  auto next = [&](RdmaEndpoint& ep, double seconds) {
    HostCompletion c{};
    c.status = -1;
    core::Deadline deadline = core::Deadline::After(seconds);
    while (a_->HostPoll(ep, &c, 1) == 0 && !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return c;
  };
  auto read = [&](size_t offset, uint64_t wrId) {
    HostWorkRequest wr;
    wr.op = HostOp::Read;
    wr.laddr = dstMr.addr + offset;
    wr.lkey = dstMr.lkey;
    wr.raddr = 0x10000;
    wr.rkey = 0x99;
    wr.bytes = 64;
    wr.wrId = wrId;
    return wr;
  };

  // The delay knob holds the write back longer than the ack timeout: its timer starts only when it is sent.
  nic->SetDelayMicroseconds(static_cast<uint32_t>((kAckTimeout.count() + 300) * 1000));
  a_->HostPost(epA_, WriteRequest(srcMr, bMr, 64, 7));
  HostCompletion delayed = next(epA_, 30);
  nic->SetDelayMicroseconds(0);
  EXPECT_EQ(delayed.status, 0) << "a WQE held back by the delay knob timed out";
  EXPECT_EQ(delayed.wrId, 7u);
  EXPECT_EQ(Mismatch(bDst, 0, 64, 3, 31, 0), 64u) << "the delayed write did not land";

  net::SocketAddress at = WireOf(epB_.handle);
  at.SetPort(0);
  UniqueFd listener = net::Listen(at);
  RdmaEndpointHandle fake = epB_.handle;
  fake.wirePort = at.Port();
  fake.wireNonce = 0xfeedfacecafe;
  fake.qpn = 0x234567;
  fake.psn = 300;
  UniqueFd peer;
  auto request = [&] {  // the next request A sends the fake peer (its payload skipped)
    emulated::PacketHeader h{};
    net::RecvAll(peer.Get(), &h, sizeof(h), core::Deadline::After(10), "NIC A");
    std::vector<uint8_t> payload(emulated::PayloadBytes(h));
    if (!payload.empty()) net::RecvAll(peer.Get(), payload.data(), payload.size(), core::Deadline::After(10), "NIC A");
    return h;
  };
  auto answerRead = [&](const emulated::PacketHeader& r, uint8_t fill) {
    emulated::PacketHeader h = Header(emulated::PacketType::ReadResponse, r.srcQpn);
    h.srcQpn = r.dstQpn;
    h.psn = r.psn;
    h.length = r.length;
    SendPacket(peer.Get(), h, std::vector<uint8_t>(h.length, fill));
  };

  // Slow but alive: each read is answered 900 ms after the last event, the second 1.8 s after it was sent.
  RdmaEndpoint slow = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  a_->ConnectEndpoint(slow.handle, fake);
  a_->HostPost(slow, read(0, 1));
  a_->HostPost(slow, read(64, 2));
  peer = net::AcceptOne(listener.Get(), core::Deadline::After(10));
  ASSERT_TRUE(peer);
  emulated::PacketHeader hello{};
  net::RecvAll(peer.Get(), &hello, sizeof(hello), core::Deadline::After(10), "NIC A");
  ASSERT_EQ(hello.type, static_cast<uint8_t>(emulated::PacketType::Hello));
  emulated::PacketHeader r1 = request(), r2 = request();
  ASSERT_EQ(r1.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  ASSERT_EQ(r2.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  std::this_thread::sleep_for(kAckTimeout * 6 / 10);
  answerRead(r1, 0x51);
  std::this_thread::sleep_for(kAckTimeout * 6 / 10);
  answerRead(r2, 0x52);
  for (uint64_t wrId = 1; wrId <= 2; ++wrId) {
    HostCompletion c = next(slow, 30);
    EXPECT_EQ(c.status, 0) << "read " << wrId << " of a slow peer failed";
    EXPECT_EQ(c.wrId, wrId);
    EXPECT_EQ(Read(dst, (wrId - 1) * 64, 64), std::vector<uint8_t>(64, static_cast<uint8_t>(0x50 + wrId)));
  }

  // Silent: a read, a write and a read go out and nothing comes back.
  RdmaEndpoint silent = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  a_->ConnectEndpoint(silent.handle, fake);
  ::testing::internal::CaptureStderr();
  const Clock::time_point posted = Clock::now();
  a_->HostPost(silent, read(128, 11));
  HostWorkRequest write = WriteRequest(srcMr, bMr, 64, 12);
  write.rkey = 0x99;
  a_->HostPost(silent, write);
  a_->HostPost(silent, read(192, 13));
  emulated::PacketHeader lost = request();  // on the same connection
  ASSERT_EQ(lost.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  EXPECT_EQ(request().type, static_cast<uint8_t>(emulated::PacketType::WriteRequest));
  EXPECT_EQ(request().type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  HostCompletion first = next(silent, 15);
  const auto waited = Clock::now() - posted;
  std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(first.status, int{kSyndromeTransportRetryExcErr}) << "the unanswered read did not time out";
  EXPECT_EQ(first.wrId, 11u);
  EXPECT_GE(waited, kAckTimeout) << "it failed before the ack timeout";
  EXPECT_LT(waited, kAckTimeout + std::chrono::seconds(3)) << "it failed long after the ack timeout";
  if (core::LogEnabled(core::LogLevel::Warn, core::LogSubsys::Rdma)) {
    const std::string line = core::StrFormat("emulated QP %u: no response from QP %u at ", silent.handle.qpn, fake.qpn);
    EXPECT_NE(log.find(line), std::string::npos) << log;
  }
  for (uint64_t wrId = 12; wrId <= 13; ++wrId) {
    HostCompletion c = next(silent, 30);
    EXPECT_EQ(c.status, int{kSyndromeWrFlushErr}) << "WQE " << wrId << " was not flushed";
    EXPECT_EQ(c.wrId, wrId);
  }
  a_->HostPost(silent, WriteRequest(srcMr, bMr, 8, 14));  // the QP is in error: flushed without being sent
  HostCompletion after = next(silent, 30);
  EXPECT_EQ(after.status, int{kSyndromeWrFlushErr}) << "a WQE posted after the timeout ran";
  EXPECT_EQ(after.wrId, 14u);

  // The read's response comes after all: it is dropped. A read of a fresh QP, answered on the same connection
  // after it, shows that A has taken it.
  answerRead(lost, 0x6b);
  RdmaEndpoint probe = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  a_->ConnectEndpoint(probe.handle, fake);
  GpuBuffer& probeDst = Alloc(64);
  RdmaMemoryRegion probeMr = a_->RegisterRdmaMemoryRegion(probeDst.Data(), probeDst.Bytes());
  HostWorkRequest probeRead = read(0, 21);
  probeRead.laddr = probeMr.addr;
  probeRead.lkey = probeMr.lkey;
  a_->HostPost(probe, probeRead);
  emulated::PacketHeader pr = request();
  ASSERT_EQ(pr.type, static_cast<uint8_t>(emulated::PacketType::ReadRequest));
  answerRead(pr, 0x77);
  HostCompletion probed = next(probe, 30);
  EXPECT_EQ(probed.status, 0);
  EXPECT_EQ(Read(probeDst, 0, 64), std::vector<uint8_t>(64, 0x77));
  EXPECT_EQ(Mismatch(dst, 128, 128, 4, 41, 128), 128u) << "a read that timed out wrote local memory";
  EXPECT_EQ(Mismatch(bDst, 0, 64, 3, 31, 0), 64u);
}

// A QP whose peer NIC does not answer the connect (its listener's backlog is full, so SYNs are dropped) stalls
// no other QP: the NIC starts connections without waiting for them under its lock. The real pair's write
// completes while the stranded QP still waits; before, the engine sat in the connect for 2 s and the stranded
// QP's failure came first.
TEST_F(EmulatedNic, AConnectThatHangsStallsNoOtherQueuePair) {
  Connect();
  GpuBuffer& src = Alloc(64);
  GpuBuffer& dst = Alloc(64);
  Fill(src, 2, 12);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  net::SocketAddress at = WireOf(epB_.handle);
  at.SetPort(0);
  UniqueFd deaf = net::Listen(at, 0);  // never accepts: one queued connection fills it
  std::vector<UniqueFd> queued;
  for (int i = 0; i < 2; ++i) {
    UniqueFd fd(socket(at.Family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    ASSERT_TRUE(fd);
    (void)connect(fd.Get(), at.Sockaddr(), at.Length());
    queued.push_back(std::move(fd));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  RdmaEndpointHandle nowhere = epB_.handle;
  nowhere.wirePort = at.Port();
  nowhere.qpn = 0x345678;
  RdmaEndpoint stranded = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  a_->ConnectEndpoint(stranded.handle, nowhere);
  a_->HostPost(stranded, WriteRequest(srcMr, dstMr, 8, 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the NIC takes it up
  ASSERT_EQ(RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 64).status, kCqeReq);
  HostCompletion c{};
  EXPECT_EQ(a_->HostPoll(stranded, &c, 1), 0) << "the stranded QP completed (status " << c.status
                                               << ") before the real pair's write: its connect held the NIC";
  EXPECT_EQ(Mismatch(dst, 0, 64, 2, 12, 0), 64u);
}

// The NIC acts only on what a doorbell announced, as a ConnectX does. A WQE in the doorbell record that no
// doorbell rang for, or one behind a stale doorbell (an earlier WQE's value rung again), is never read and the
// stall watch reports the queue; a doorbell write that names no WQE of the queue is ignored and counted.
TEST_F(EmulatedNic, OnlyWhatADoorbellAnnouncedRuns) {
  Connect();
  GpuBuffer& src = Alloc(64);
  GpuBuffer& dst = Alloc(64);
  Fill(src, 4, 40);
  Fill(dst, 5, 50);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  EmulatedNicControl* nic = GetEmulatedNicControl(a_);
  nic->SetStallReportMilliseconds(100);
  WorkQueueHandle& wq = QA()->wq;
  // Posts an 8-byte write of src[off] to dst[off] into the next slot and records it; rings nothing.
  auto postAndRecord = [&](size_t off) {
    uint32_t slot = wq.postIdx++;
    uint64_t dbr = PostWrite<kMlx5>(wq, slot, true, wq.qpn, srcMr.addr + off, srcMr.lkey, dstMr.addr + off,
                                    dstMr.rkey, 8);
    UpdateSendDbrRecord<kMlx5>(wq.dbrRecAddr, wq.postIdx);
    return dbr;
  };
  auto completion = [&](int ms) {
    core::Deadline deadline = core::Deadline::After(ms / 1000.0);
    int r;
    while ((r = PollCq<kMlx5>(QA()->cq, wq, nullptr)) == kCqEmpty && !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    UpdateCqDbrRecord<kMlx5>(QA()->cq.dbrRecAddr, QA()->cq.consIdx);
    return r;
  };
  // Each window below starts with nothing in flight, so the only stall it can report is the one tested.
  EmulatedNicStats before = nic->Stats();
  const uint64_t first = postAndRecord(0);
  EXPECT_EQ(completion(500), kCqEmpty) << "a WQE ran without a doorbell";
  EXPECT_EQ(Mismatch(dst, 0, 64, 5, 50, 0), 64u);
  EXPECT_EQ(nic->Stats().stallReports - before.stallReports, 1u) << "the unrung WQE was not reported";
  RingDoorbell<kMlx5>(wq.dbrAddr, first);
  EXPECT_EQ(completion(30000), kCqeReq);
  EXPECT_EQ(Mismatch(dst, 0, 8, 4, 40, 0), 8u) << "the rung write did not land";

  before = nic->Stats();
  const uint64_t second = postAndRecord(8);
  RingDoorbell<kMlx5>(wq.dbrAddr, first);  // stale: the first WQE's doorbell again
  EXPECT_EQ(completion(500), kCqEmpty) << "a WQE behind a stale doorbell ran";
  EXPECT_EQ(nic->Stats().stallReports - before.stallReports, 1u) << "the stale doorbell's queue was not reported";
  RingDoorbell<kMlx5>(wq.dbrAddr, second ^ (uint64_t{1} << 63));  // not the WQE's control word
  EXPECT_EQ(completion(300), kCqEmpty) << "a doorbell naming no WQE ran one";
  EXPECT_EQ(nic->Stats().doorbellFaults - before.doorbellFaults, 1u);
  EXPECT_EQ(Mismatch(dst, 8, 56, 5, 50, 8), 56u);
  RingDoorbell<kMlx5>(wq.dbrAddr, second);
  EXPECT_EQ(completion(30000), kCqeReq);
  EXPECT_EQ(Mismatch(dst, 0, 16, 4, 40, 0), 16u);
  EXPECT_EQ(Mismatch(dst, 16, 48, 5, 50, 16), 48u) << "bytes after the two writes changed";
}

TEST_F(EmulatedNic, ADroppedLinkFailsWhatIsInFlightWithoutHanging) {
  RdmaEndpointConfig config;
  config.maxMsgsNum = 256;
  Connect(config);
  GpuBuffer& src = Alloc(4096);
  GpuBuffer& dst = Alloc(4096);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  // Warm the link, then let work pile up behind a delay and cut the link under it. The NIC starts one WQE of a
  // queue per delay, so the 200 take 400 ms to go through and the cut, 5 ms in, finds most still queued. (With
  // 200 us, 40 ms in all, a TSan run on two loaded cores once let all 200 through before the cut: the test
  // thread's 5-ms sleep had lasted longer than that.)
  OpResult first = RunOp(0, srcMr.addr, srcMr.lkey, dstMr.addr, dstMr.rkey, 64);
  ASSERT_EQ(first.status, kCqeReq);
  EmulatedNicControl* nic = GetEmulatedNicControl(a_);
  nic->SetDelayMicroseconds(2000);
  for (uint32_t i = 0; i < 200; ++i) a_->HostPost(epA_, WriteRequest(srcMr, dstMr, 64, i));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  nic->DropLink();
  nic->SetDelayMicroseconds(0);
  uint32_t ok = 0, transport = 0, flushed = 0, other = 0;
  core::Deadline deadline = core::Deadline::After(60);
  while (ok + transport + flushed + other < 200 && !deadline.Expired()) {
    HostCompletion c[32];
    int n = a_->HostPoll(epA_, c, 32);
    for (int k = 0; k < n; ++k) {
      if (c[k].status == 0) {
        ++ok;
      } else if (c[k].status == kSyndromeTransportRetryExcErr) {
        ++transport;
      } else if (c[k].status == kSyndromeWrFlushErr) {
        ++flushed;
      } else {
        ++other;
      }
    }
  }
  EXPECT_EQ(ok + transport + flushed + other, 200u) << "every WQE completed";
  EXPECT_EQ(transport, 1u) << "the first WQE the link took down reports it";
  EXPECT_EQ(other, 0u);
  EXPECT_LT(ok, 200u) << "the link was dropped before everything went through";
  nic->RestoreLink();
}

// ---------------------------------------------------------------- random packet faults

// One trial of faulted traffic on a fresh QP pair: kWrites writes of 64 bytes, two into each of every other 64-byte
// slot of B's area (the slots between are never written; of a pair, the second must win), kReads reads of 64 bytes from
// B into A, kAtomics fetch-adds on B's counters, all posted at once, all completions collected within a bound. Every
// completion is a success or an error; the bytes are checked for each WQE against what its completion says, and
// everything no WQE targets is checked untouched.
struct FaultTrialResult {
  uint32_t ok = 0;
  uint32_t errors = 0;
  uint32_t unexpectedStatus = 0;  // a syndrome no lossy fabric explains
  uint32_t missing = 0;           // WQEs without a completion when the bound ran out
  uint32_t wrongBytes = 0;        // destinations holding bytes that neither the old nor the new content explains

  FaultTrialResult& operator+=(const FaultTrialResult& o) {
    ok += o.ok;
    errors += o.errors;
    unexpectedStatus += o.unexpectedStatus;
    missing += o.missing;
    wrongBytes += o.wrongBytes;
    return *this;
  }
};

class EmulatedNicUnderFaults : public EmulatedNic {
 protected:
  static constexpr uint32_t kWrites = 48, kReads = 24, kAtomics = 16;
  static constexpr size_t kSlot = 64;

  void SetFaultsOnBoth(const EmulatedNicFaults& f, uint32_t ackTimeoutMs) {
    for (RdmaDeviceContext* nic : {a_, b_}) {
      GetEmulatedNicControl(nic)->SetFaults(f);
      GetEmulatedNicControl(nic)->SetAckTimeoutMilliseconds(ackTimeoutMs);
    }
  }
  EmulatedNicStats Sum() const {
    EmulatedNicStats a = GetEmulatedNicControl(a_)->Stats(), b = GetEmulatedNicControl(b_)->Stats();
    EmulatedNicStats s{};
    s.faultsDropped = a.faultsDropped + b.faultsDropped;
    s.faultsCorrupted = a.faultsCorrupted + b.faultsCorrupted;
    s.faultsReordered = a.faultsReordered + b.faultsReordered;
    s.faultsDelayed = a.faultsDelayed + b.faultsDelayed;
    s.integrityDrops = a.integrityDrops + b.integrityDrops;
    s.outOfSequence = a.outOfSequence + b.outOfSequence;
    return s;
  }

  FaultTrialResult RunTrial(uint32_t trial) {
    FaultTrialResult res;
    RdmaEndpointConfig config;
    config.maxMsgsNum = 128;
    Connect(config);
    const int rankA = 10 + static_cast<int>(trial), rankB = 50 + static_cast<int>(trial);
    // A: write sources, read landing slots (every other one), fetched values. B: write targets, read sources,
    // counters.
    GpuBuffer& aMem = Alloc(kWrites * kSlot + 2 * kReads * kSlot + kAtomics * 16);
    GpuBuffer& bMem = Alloc(2 * kWrites * kSlot + kReads * kSlot + kAtomics * 16);
    Fill(aMem, rankA, trial);
    Fill(bMem, rankB, trial);
    const std::vector<uint8_t> aOld = Read(aMem, 0, aMem.Bytes()), bOld = Read(bMem, 0, bMem.Bytes());
    RdmaMemoryRegion aMr = a_->RegisterRdmaMemoryRegion(aMem.Data(), aMem.Bytes());
    RdmaMemoryRegion bMr = b_->RegisterRdmaMemoryRegion(bMem.Data(), bMem.Bytes());
    const size_t aReads = kWrites * kSlot, aFetched = aReads + 2 * kReads * kSlot;
    const size_t bReads = 2 * kWrites * kSlot, bCounters = bReads + kReads * kSlot;
    const uint32_t total = kWrites + kReads + kAtomics;
    for (uint32_t i = 0; i < total; ++i) {
      HostWorkRequest wr;
      wr.wrId = i;
      wr.lkey = aMr.lkey;
      wr.rkey = bMr.rkey;
      if (i < kWrites) {
        wr.op = HostOp::Write;
        wr.laddr = aMr.addr + i * kSlot;
        wr.raddr = bMr.addr + 2 * (i / 2) * kSlot;
        wr.bytes = kSlot;
      } else if (i < kWrites + kReads) {
        const uint32_t r = i - kWrites;
        wr.op = HostOp::Read;
        wr.laddr = aMr.addr + aReads + 2 * r * kSlot;
        wr.raddr = bMr.addr + bReads + r * kSlot;
        wr.bytes = kSlot;
      } else {
        const uint32_t k = i - kWrites - kReads;
        wr.op = HostOp::FetchAdd;
        wr.laddr = aMr.addr + aFetched + k * 16;
        wr.raddr = bMr.addr + bCounters + k * 16;
        wr.bytes = 8;
        wr.swapAdd = 0x100000001ull * (k + 1);
      }
      a_->HostPost(epA_, wr);
    }
    std::vector<int> status(total, -1);
    uint32_t got = 0;
    core::Deadline deadline = core::Deadline::After(20);
    while (got < total && !deadline.Expired()) {
      HostCompletion c[32];
      int n = a_->HostPoll(epA_, c, 32);
      for (int k = 0; k < n; ++k) {
        if (c[k].wrId < total && status[c[k].wrId] < 0) {
          status[c[k].wrId] = c[k].status;
          ++got;
        }
      }
      if (n == 0) std::this_thread::yield();
    }
    // Late packets of a failed trial may still land (a write whose ack was lost): wait for the wire to settle.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::vector<uint8_t> aNow = Read(aMem, 0, aMem.Bytes()), bNow = Read(bMem, 0, bMem.Bytes());
    auto same = [](const std::vector<uint8_t>& x, size_t xo, const std::vector<uint8_t>& y, size_t yo, size_t n) {
      return std::memcmp(x.data() + xo, y.data() + yo, n) == 0;
    };
    std::vector<bool> targeted(bNow.size(), false), landed(aNow.size(), false);
    for (uint32_t i = 0; i < total; ++i) {
      const int st = status[i];
      if (st < 0) {
        ++res.missing;
      } else if (st == 0) {
        ++res.ok;
      } else {
        ++res.errors;
        if (st != kSyndromeTransportRetryExcErr && st != kSyndromeWrFlushErr && st != kSyndromeRemoteAccessErr) {
          ++res.unexpectedStatus;
          ADD_FAILURE() << "trial " << trial << " WQE " << i << ": status 0x" << std::hex << st;
        }
      }
      bool right;
      if (i < kWrites) {
        // Checked at the second write of a pair: the first's bytes, the second's or the old ones, whole, as the
        // statuses allow. The second succeeded: its bytes (the first, if it ran, ran before it). It failed: the
        // first's bytes too (executed, the ack lost), or the old ones if the first failed as well.
        const size_t at = 2 * (i / 2) * kSlot;
        for (size_t b = at; b < at + kSlot; ++b) targeted[b] = true;
        right = true;
        if (i % 2 == 1) {
          const int first = status[i - 1];
          const bool second = same(bNow, at, aOld, i * kSlot, kSlot);
          const bool firsts = same(bNow, at, aOld, (i - 1) * kSlot, kSlot);
          const bool old = same(bNow, at, bOld, at, kSlot);
          right = second || (st != 0 && (firsts || (first != 0 && old)));
        }
      } else if (i < kWrites + kReads) {
        const uint32_t r = i - kWrites;
        const size_t at = aReads + 2 * r * kSlot;
        for (size_t b = at; b < at + kSlot; ++b) landed[b] = true;
        const bool isNew = same(aNow, at, bOld, bReads + r * kSlot, kSlot);
        right = isNew || (st != 0 && same(aNow, at, aOld, at, kSlot));
      } else {
        const uint32_t k = i - kWrites - kReads;
        const size_t counter = bCounters + k * 16, fetched = aFetched + k * 16;
        for (size_t b = counter; b < counter + 8; ++b) targeted[b] = true;
        for (size_t b = fetched; b < fetched + 8; ++b) landed[b] = true;
        uint64_t oldCounter, nowCounter, oldFetched, nowFetched;
        std::memcpy(&oldCounter, bOld.data() + counter, 8);
        std::memcpy(&nowCounter, bNow.data() + counter, 8);
        std::memcpy(&oldFetched, aOld.data() + fetched, 8);
        std::memcpy(&nowFetched, aNow.data() + fetched, 8);
        const uint64_t added = oldCounter + 0x100000001ull * (k + 1);
        right = st == 0 ? nowCounter == added && nowFetched == oldCounter
                        : (nowCounter == added || nowCounter == oldCounter) &&
                              (nowFetched == oldFetched || nowFetched == oldCounter);
      }
      if (!right) {
        ++res.wrongBytes;
        ADD_FAILURE() << "trial " << trial << " WQE " << i << " (status 0x" << std::hex << st
                      << "): its destination holds bytes it cannot explain";
      }
    }
    for (size_t b = 0; b < bNow.size(); ++b) {
      if (!targeted[b] && bNow[b] != bOld[b]) {
        ++res.wrongBytes;
        ADD_FAILURE() << "trial " << trial << ": B's byte " << b << " changed and no WQE targets it";
        break;
      }
    }
    for (size_t b = 0; b < aNow.size(); ++b) {
      if (!landed[b] && aNow[b] != aOld[b]) {
        ++res.wrongBytes;
        ADD_FAILURE() << "trial " << trial << ": A's byte " << b << " changed and no WQE writes it";
        break;
      }
    }
    a_->DestroyRdmaEndpoint(epA_.handle);
    b_->DestroyRdmaEndpoint(epB_.handle);
    return res;
  }

  // Trials at a high and a low rate of one fault: returns the outcomes summed; every trial must end in time.
  FaultTrialResult RunTrials(EmulatedNicFaults f, double EmulatedNicFaults::*rate, uint32_t trialsPerRate) {
    FaultTrialResult sum;
    uint32_t trial = 0;
    for (double r : {0.2, 0.004}) {
      f.*rate = r;
      for (uint32_t t = 0; t < trialsPerRate; ++t, ++trial) {
        f.seed = 1000 + trial;
        SetFaultsOnBoth(f, 150);
        sum += RunTrial(trial);
      }
    }
    SetFaultsOnBoth(EmulatedNicFaults{}, 150);
    return sum;
  }
};

// Dropped packets: every WQE completes, with success (its bytes exact) or an error; the losses are counted.
TEST_F(EmulatedNicUnderFaults, DroppedPacketsFailWqesAndNeverLeaveWrongBytes) {
  EmulatedNicFaults f;
  FaultTrialResult r = RunTrials(f, &EmulatedNicFaults::drop, 6);
  EXPECT_EQ(r.missing, 0u) << "WQEs without a completion (a hang)";
  EXPECT_EQ(r.wrongBytes, 0u);
  EXPECT_EQ(r.unexpectedStatus, 0u);
  EXPECT_GT(r.errors, 0u) << "no drop ever failed a WQE: the fault did not fire";
  EXPECT_GT(r.ok, 0u) << "nothing succeeded: the low rate should let whole trials through";
  EXPECT_GT(Sum().faultsDropped, 0u);
}

// Corrupted packets: each one is caught by the receiver's integrity check (every corruption injected is counted as
// detected), and none is executed or accepted.
TEST_F(EmulatedNicUnderFaults, CorruptedPacketsAreAllDetectedAndNeverExecuted) {
  EmulatedNicFaults f;
  FaultTrialResult r = RunTrials(f, &EmulatedNicFaults::corrupt, 6);
  EXPECT_EQ(r.missing, 0u);
  EXPECT_EQ(r.wrongBytes, 0u);
  EXPECT_EQ(r.unexpectedStatus, 0u);
  EXPECT_GT(r.errors, 0u);
  EXPECT_GT(r.ok, 0u);
  EmulatedNicStats s = Sum();
  EXPECT_GT(s.faultsCorrupted, 0u);
  EXPECT_EQ(s.integrityDrops, s.faultsCorrupted) << "a corrupted packet went undetected";
}

// Requests of one QP reordered on the wire: the one that overtook is refused (an error completion), never
// applied out of order.
TEST_F(EmulatedNicUnderFaults, ReorderedRequestsOfOneQpAreRefusedNeverAppliedOutOfOrder) {
  EmulatedNicFaults f;
  FaultTrialResult r = RunTrials(f, &EmulatedNicFaults::reorder, 6);
  EXPECT_EQ(r.missing, 0u);
  EXPECT_EQ(r.wrongBytes, 0u);
  EXPECT_EQ(r.unexpectedStatus, 0u);
  EXPECT_GT(r.errors, 0u);
  EXPECT_GT(r.ok, 0u);
  EmulatedNicStats s = Sum();
  EXPECT_GT(s.faultsReordered, 0u);
  EXPECT_GT(s.outOfSequence, 0u) << "no reordered request was noticed out of sequence";
}

// Every fault at once, at the high rate only.
TEST_F(EmulatedNicUnderFaults, AllFaultsAtOnceNeverLeaveWrongBytes) {
  EmulatedNicFaults f;
  f.delayUsMax = 300;
  f.drop = 0.05;
  f.corrupt = 0.05;
  FaultTrialResult r;
  for (uint32_t t = 0; t < 6; ++t) {
    f.seed = 77 + t;
    f.reorder = 0.05;
    SetFaultsOnBoth(f, 150);
    r += RunTrial(t);
  }
  SetFaultsOnBoth(EmulatedNicFaults{}, 150);
  EXPECT_EQ(r.missing, 0u);
  EXPECT_EQ(r.wrongBytes, 0u);
  EXPECT_EQ(r.unexpectedStatus, 0u);
  EXPECT_GT(r.errors, 0u);
  EmulatedNicStats s = Sum();
  EXPECT_EQ(s.integrityDrops, s.faultsCorrupted);
}

// Delay and reordering between QPs are what a healthy RC fabric does: four QP pairs, each with one request on the
// wire at a time (so that a swap on the shared connection is always between two QPs), under random delays and a
// high reorder rate; every operation succeeds with exact bytes.
TEST_F(EmulatedNicUnderFaults, DelayAndCrossQpReorderLoseNothing) {
  constexpr uint32_t kQps = 4, kOps = 60;
  EmulatedNicFaults f;
  f.seed = 4242;
  f.reorder = 0.3;
  f.delayUsMax = 400;
  SetFaultsOnBoth(f, 5000);
  GpuBuffer& aMem = Alloc(kQps * kOps * kSlot * 2);
  GpuBuffer& bMem = Alloc(kQps * kOps * kSlot * 2);
  Fill(aMem, 3, 33);
  Fill(bMem, 4, 44);
  RdmaMemoryRegion aMr = a_->RegisterRdmaMemoryRegion(aMem.Data(), aMem.Bytes());
  RdmaMemoryRegion bMr = b_->RegisterRdmaMemoryRegion(bMem.Data(), bMem.Bytes());
  std::vector<RdmaEndpoint> as(kQps), bs(kQps);
  for (uint32_t q = 0; q < kQps; ++q) {
    as[q] = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
    bs[q] = b_->CreateRdmaEndpoint(RdmaEndpointConfig());
    a_->ConnectEndpoint(as[q].handle, bs[q].handle);
    b_->ConnectEndpoint(bs[q].handle, as[q].handle);
  }
  const EmulatedNicStats before = Sum();
  std::atomic<uint32_t> failures{0};
  std::vector<std::thread> threads;
  for (uint32_t q = 0; q < kQps; ++q) {
    threads.emplace_back([&, q] {
      for (uint32_t i = 0; i < kOps; ++i) {
        // Op i of QP q: A's slot (q, i) to B's slot (q, i) by a write, then B's slot (q, i) + half back by a read.
        const size_t slot = (size_t(q) * kOps + i) * kSlot;
        const size_t half = kQps * kOps * kSlot;
        HostWorkRequest wr;
        wr.wrId = i;
        wr.lkey = aMr.lkey;
        wr.rkey = bMr.rkey;
        wr.op = i % 2 == 0 ? HostOp::Write : HostOp::Read;
        wr.laddr = aMr.addr + slot + (wr.op == HostOp::Read ? half : 0);
        wr.raddr = bMr.addr + slot + (wr.op == HostOp::Read ? half : 0);
        wr.bytes = kSlot;
        a_->HostPost(as[q], wr);
        HostCompletion c{};
        c.status = -1;
        core::Deadline deadline = core::Deadline::After(20);
        while (a_->HostPoll(as[q], &c, 1) == 0 && !deadline.Expired()) std::this_thread::yield();
        if (c.status != 0 || c.wrId != i) {
          failures.fetch_add(1);
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0u) << "a WQE failed or none came under delay and cross-QP reordering";
  for (uint32_t q = 0; q < kQps; ++q) {
    for (uint32_t i = 0; i < kOps; ++i) {
      const size_t slot = (size_t(q) * kOps + i) * kSlot;
      const size_t half = kQps * kOps * kSlot;
      if (i % 2 == 0) {
        EXPECT_EQ(Mismatch(bMem, slot, kSlot, 3, 33, slot), kSlot) << "write " << q << "/" << i;
        EXPECT_EQ(Mismatch(bMem, slot + half, kSlot, 4, 44, slot + half), kSlot) << "untouched " << q << "/" << i;
      } else {
        EXPECT_EQ(Mismatch(aMem, slot + half, kSlot, 4, 44, slot + half), kSlot) << "read " << q << "/" << i;
        EXPECT_EQ(Mismatch(bMem, slot, kSlot, 4, 44, slot), kSlot) << "untouched " << q << "/" << i;
      }
    }
  }
  const EmulatedNicStats after = Sum();
  EXPECT_GT(after.faultsReordered - before.faultsReordered, 0u) << "nothing was reordered";
  EXPECT_GT(after.faultsDelayed - before.faultsDelayed, 0u) << "nothing was delayed";
  EXPECT_EQ(after.outOfSequence - before.outOfSequence, 0u);
  EXPECT_EQ(after.faultsDropped + after.faultsCorrupted + after.integrityDrops, 0u);
  SetFaultsOnBoth(EmulatedNicFaults{}, 5000);
}

// The spec's parser: what it accepts, and each malformed field named with the variable.
TEST(EmulatedNicFaultSpec, ParsesAndRejectsWithTheVariableAndField) {
  EmulatedNicFaults f =
      emulated::ParseFaultSpec("seed=9,drop=0.25,corrupt=1,reorder=0,delay_us=1500,ack_timeout_ms=300", "VAR");
  EXPECT_EQ(f.ackTimeoutMs, 300u);
  EXPECT_EQ(f.seed, 9u);
  EXPECT_DOUBLE_EQ(f.drop, 0.25);
  EXPECT_DOUBLE_EQ(f.corrupt, 1.0);
  EXPECT_DOUBLE_EQ(f.reorder, 0.0);
  EXPECT_EQ(f.delayUsMax, 1500u);
  EXPECT_FALSE(emulated::ParseFaultSpec("", "VAR").Any());
  for (const char* bad : {"drop=2", "drop=-0.1", "drop=x", "drop=nan", "corrupt=", "reorder", "delay_us=-1",
                          "delay_us=1.5", "delay_us=20000000", "seed=-3", "loss=0.1", "ack_timeout_ms=x"}) {
    try {
      emulated::ParseFaultSpec(std::string("seed=1,") + bad, "MORI_EMULATED_NIC_FAULTS");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const core::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("MORI_EMULATED_NIC_FAULTS"), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << "the field is not named: " << what;
    }
  }
  // Two NICs with one spec draw differently; one NIC's draws repeat for its seed.
  EXPECT_NE(emulated::NicFaultSeed(1, 100, 0), emulated::NicFaultSeed(1, 100, 1));
  EXPECT_NE(emulated::NicFaultSeed(1, 100, 0), emulated::NicFaultSeed(1, 101, 0));
  emulated::FaultDraw x, y;
  f.drop = 0.5;
  x.Reset(f, 5);
  y.Reset(f, 5);
  uint32_t drops = 0;
  for (int i = 0; i < 1000; ++i) {
    const bool dx = x.Drop();
    EXPECT_EQ(dx, y.Drop());
    drops += dx;
  }
  EXPECT_GT(drops, 400u);
  EXPECT_LT(drops, 600u);
}

// The variable is read when a NIC is created: a malformed one fails the creation, naming it.
TEST_F(EmulatedNic, AMalformedFaultSpecFailsTheNicCreation) {
  setenv("MORI_EMULATED_NIC_FAULTS", "drop=0.1,corrupt=7", 1);
  auto ports = GetActiveDevicePortList(context_->GetRdmaDeviceList());
  try {
    ports[0].first->CreateRdmaDeviceContext();
    ADD_FAILURE() << "a NIC was created under a malformed MORI_EMULATED_NIC_FAULTS";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MORI_EMULATED_NIC_FAULTS"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'corrupt=7'"), std::string::npos) << e.what();
  }
  unsetenv("MORI_EMULATED_NIC_FAULTS");
}

// A QP that has work but cannot move (here: every WQE held back by the delay knob) is reported once per
// stall, and moves on when the cause goes.
TEST_F(EmulatedNic, AStalledQueueIsReportedOnceWithItsState) {
  Connect();
  GpuBuffer& src = Alloc(64);
  GpuBuffer& dst = Alloc(64);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  EmulatedNicControl* nic = GetEmulatedNicControl(a_);
  nic->SetStallReportMilliseconds(100);
  nic->SetDelayMicroseconds(2000000);
  uint64_t before = nic->Stats().stallReports;
  a_->HostPost(epA_, WriteRequest(srcMr, dstMr, 8, 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  EXPECT_EQ(nic->Stats().stallReports - before, 1u) << "one report per stall";
  nic->SetDelayMicroseconds(0);
  int completed = 0;
  core::Deadline deadline = core::Deadline::After(30);
  while (completed < 1 && !deadline.Expired()) {
    HostCompletion c[1];
    completed += a_->HostPoll(epA_, c, 1);
  }
  EXPECT_EQ(completed, 1);
}

TEST_F(EmulatedNic, HostPostingRefusesAFullQueueAndBadInput) {
  RdmaEndpointConfig config;
  config.maxMsgsNum = 4;
  Connect(config);
  GpuBuffer& src = Alloc(64);
  GpuBuffer& dst = Alloc(64);
  RdmaMemoryRegion srcMr = a_->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion dstMr = b_->RegisterRdmaMemoryRegion(dst.Data(), dst.Bytes());
  GetEmulatedNicControl(a_)->SetDelayMicroseconds(100000);
  HostWorkRequest wr = WriteRequest(srcMr, dstMr, 8, 0);
  for (int i = 0; i < 4; ++i) a_->HostPost(epA_, wr);
  try {
    a_->HostPost(epA_, wr);
    FAIL() << "a fifth WQE was accepted into a 4-deep queue";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("send queue is full"), std::string::npos) << e.what();
  }
  GetEmulatedNicControl(a_)->SetDelayMicroseconds(0);
  int completed = 0;
  core::Deadline deadline = core::Deadline::After(30);
  while (completed < 4 && !deadline.Expired()) {
    HostCompletion c[4];
    completed += a_->HostPoll(epA_, c, 4);
  }
  EXPECT_EQ(completed, 4);
  EXPECT_THROW(a_->RegisterRdmaMemoryRegion(nullptr, 10), core::Error);
  EXPECT_THROW(a_->RegisterRdmaMemoryRegion(src.Data(), 64, 0x100), core::Error);
  EXPECT_THROW(a_->DeregisterRdmaMemoryRegion(dst.Data()), core::Error);
  RdmaEndpointConfig bad;
  bad.maxMsgsNum = 0;
  EXPECT_THROW(a_->CreateRdmaEndpoint(bad), core::Error);
  bad.maxMsgsNum = 1 << 20;
  EXPECT_THROW(a_->CreateRdmaEndpoint(bad), core::Error);
  bad = RdmaEndpointConfig();
  bad.portId = 2;
  EXPECT_THROW(a_->CreateRdmaEndpoint(bad), core::Error);
  RdmaEndpointHandle foreign = epB_.handle;
  foreign.wirePort = 0;
  RdmaEndpoint fresh = a_->CreateRdmaEndpoint(RdmaEndpointConfig());
  EXPECT_THROW(a_->ConnectEndpoint(fresh.handle, foreign), core::Error);
  EXPECT_THROW(a_->ConnectEndpoint(epB_.handle, epA_.handle), core::Error) << "QP of another context";
}

TEST(RdmaBackends, RealNicBackendsReportNoDeviceCleanly) {
  for (RdmaBackendType backend : {RdmaBackendType::DirectVerbs, RdmaBackendType::IBVerbs}) {
    RdmaContext context(backend);
    if (!context.GetRdmaDeviceList().empty()) {
      GTEST_SKIP() << "this machine has an RDMA NIC; the no-device path cannot be exercised here";
    }
    EXPECT_TRUE(GetActiveDevicePortList(context.GetRdmaDeviceList()).empty());
  }
  test::ScopedEnv backend("MORI_RDMA_BACKEND", "auto");
  EXPECT_EQ(RdmaBackendFromEnvironment(), RdmaBackendType::Emulated);
  test::ScopedEnv forced("MORI_RDMA_BACKEND", "ibverbs");
  EXPECT_EQ(RdmaBackendFromEnvironment(), RdmaBackendType::IBVerbs);
}

}  // namespace
}  // namespace mori::rdma
