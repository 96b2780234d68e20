// The emulated NIC between processes: endpoint handles and memory keys exchanged through the bootstrap,
// transfers posted by kernels and verified by the receiving process; a peer that dies mid-job turns into
// error completions, not a hang; and the same across two network namespaces acting as two hosts.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/timeout.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/rdma.hpp"

namespace mori::rdma {
namespace {

namespace test = core::test;
using core::Dim3;
using core::GpuBuffer;
using core::MemoryType;
constexpr ProviderType kMlx5 = ProviderType::MLX5;
constexpr uint64_t kTimeoutNs = 60'000'000'000ull;

struct Queues {
  WorkQueueHandle wq;
  CompletionQueueHandle cq;
};

struct Peer {
  RdmaEndpointHandle handle;
  RdmaMemoryRegion region;
};

// Block b writes chunk b of src into the same chunk of the peer's buffer; then every block fetch-adds the
// peer's counter; thread 0 of each block does the posting.
MORI_GLOBAL void WriteChunksAndCount(Queues* q, RdmaMemoryRegion src, RdmaMemoryRegion dst, uint64_t chunk,
                                     uint64_t counterOffset, RdmaMemoryRegion scratch, uint32_t* errors) {
  if (core::ThreadIdxX() != 0) return;
  uint64_t b = core::BlockIdxX();
  PostWriteOrdered<kMlx5>(q->wq, q->cq, src.addr + b * chunk, src.lkey, dst.addr + b * chunk, dst.rkey, chunk, false,
                          kTimeoutNs);
  PostAtomicOrdered<kMlx5, uint64_t>(q->wq, q->cq, scratch.addr + b * 8, scratch.lkey, dst.addr + counterOffset, dst.rkey,
                                     b + 1, 0, AtomicOp::FetchAdd, true, kTimeoutNs);
  if (QuietQueue<kMlx5>(q->wq, q->cq, kTimeoutNs) != 0) core::AtomicFetchAdd(errors, 1u);
}

// Keeps writing until a completion reports an error; returns that syndrome (0 when none came in `count`).
MORI_GLOBAL void WriteUntilError(Queues* q, RdmaMemoryRegion src, RdmaMemoryRegion dst, uint32_t count, uint32_t* out) {
  for (uint32_t i = 0; i < count; ++i) {
    PostWriteOrdered<kMlx5>(q->wq, q->cq, src.addr, src.lkey, dst.addr, dst.rkey, 64, true, kTimeoutNs);
    RetireCompletions<kMlx5>(q->cq, q->wq);
    if (core::AtomicLoad(&q->cq.errorCount) != 0) break;
  }
  QuietQueue<kMlx5>(q->wq, q->cq, kTimeoutNs);
  out[0] = q->cq.errorCount;
  out[1] = q->cq.firstError >> 16;
}

// Two processes, each with its NIC, endpoint and buffer, connected through the bootstrap.
struct Side {
  std::unique_ptr<RdmaContext> context;
  RdmaDeviceContext* nic = nullptr;
  RdmaEndpoint ep;
  GpuBuffer queues;
  Peer peer;
  Queues* Q() { return queues.DataAs<Queues>(); }

  void Setup(core::Bootstrap& b, void* buffer, size_t bytes) {
    context = std::make_unique<RdmaContext>(RdmaBackendType::Emulated);
    nic = context->GetRdmaDeviceList().at(0)->CreateRdmaDeviceContext();
    ep = nic->CreateRdmaEndpoint(RdmaEndpointConfig());
    Peer mine{ep.handle, nic->RegisterRdmaMemoryRegion(buffer, bytes)};
    int other = 1 - b.GetRank();
    b.Send(&mine, sizeof(mine), other, 1);
    b.Recv(&peer, sizeof(peer), other, 1);
    nic->ConnectEndpoint(ep.handle, peer.handle);
    queues = GpuBuffer(sizeof(Queues), MemoryType::HostPinned);
    Q()->wq = ep.wqHandle;
    Q()->cq = ep.cqHandle;
    b.Barrier();
  }
};

int SelectGpu(int rank) {
  int n = 0;
  MORI_CHECK_GPU(core::GpuGetDeviceCount(&n));
  MORI_CHECK(n > 0, core::ErrorCode::NotSupported, "no GPU");
  MORI_CHECK_GPU(core::GpuSetDevice(rank % n));
  return n;
}

// The body both tests run: rank 0 and rank 1 each write their pattern into the other's buffer with kernels,
// fetch-add the other's counter from every block, then check what arrived.
int ExchangeAndVerify(core::Bootstrap& b) {
  const int rank = b.GetRank();
  SelectGpu(rank);
  constexpr uint32_t kBlocks = 4;
  constexpr uint64_t kChunk = (64 << 10) + 8;  // 8-byte aligned chunks, so the counter after them is too
  const uint64_t counterOffset = kBlocks * kChunk;
  GpuBuffer src(counterOffset), dst(counterOffset + 8 + 4096), scratch(kBlocks * 8);
  std::vector<uint8_t> pattern(src.Bytes());
  test::FillPattern(pattern.data(), pattern.size(), rank, 7);
  MORI_CHECK_GPU(core::GpuMemcpy(src.Data(), pattern.data(), pattern.size()));
  std::vector<uint8_t> guard(dst.Bytes());
  test::FillPattern(guard.data(), guard.size(), 100 + rank, 8);
  MORI_CHECK_GPU(core::GpuMemcpy(dst.Data(), guard.data(), guard.size()));
  MORI_CHECK_GPU(core::GpuMemset(dst.DataAs<uint8_t>() + counterOffset, 0, 8));
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());  // landed before the peer's NIC writes (copies return early)

  Side side;
  side.Setup(b, dst.Data(), counterOffset + 8);  // the guard page after the counter is not registered
  RdmaMemoryRegion srcMr = side.nic->RegisterRdmaMemoryRegion(src.Data(), src.Bytes());
  RdmaMemoryRegion scratchMr = side.nic->RegisterRdmaMemoryRegion(scratch.Data(), scratch.Bytes());
  GpuBuffer errors(4, MemoryType::HostPinned);
  *errors.DataAs<uint32_t>() = 0;
  core::LaunchKernel(WriteChunksAndCount, Dim3(kBlocks), Dim3(32), 0, nullptr, side.Q(), srcMr, side.peer.region,
                     kChunk, counterOffset, scratchMr, errors.DataAs<uint32_t>());
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  EXPECT_EQ(*errors.DataAs<uint32_t>(), 0u);
  b.Barrier();  // both sides' writes are complete at their targets (quiet returned)

  std::vector<uint8_t> got(dst.Bytes());
  MORI_CHECK_GPU(core::GpuMemcpy(got.data(), dst.Data(), got.size()));
  int peer = 1 - rank;
  EXPECT_EQ(test::FirstPatternMismatch(got.data(), counterOffset, peer, 7), counterOffset) << "data from rank " << peer;
  uint64_t counter = 0;
  std::memcpy(&counter, got.data() + counterOffset, 8);
  EXPECT_EQ(counter, uint64_t(kBlocks) * (kBlocks + 1) / 2) << "fetch-adds from every block of rank " << peer;
  for (size_t i = counterOffset + 8; i < got.size(); ++i) {
    if (got[i] != test::PatternByte(100 + rank, i, 8)) {
      ADD_FAILURE() << "byte " << i << " past the registered region changed";
      break;
    }
  }
  b.Barrier();  // nobody tears down while the peer may still read
  return 0;
}

using test::LoopbackRoot;

class RdmaAcrossProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    gpus_ = test::ProbeGpuCount();
    if (gpus_ == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }
  int gpus_ = 0;
};

TEST_F(RdmaAcrossProcesses, KernelsWriteAndCountIntoTheOtherProcess) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    core::SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    return ExchangeAndVerify(b);
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(RdmaAcrossProcesses, APeerThatDiesBecomesErrorCompletions) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    core::SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    SelectGpu(rank);
    GpuBuffer buf(4096);
    Side side;
    side.Setup(b, buf.Data(), buf.Bytes());
    if (rank == 1) {
      b.Barrier();
      test::DieAbruptly(0);  // gone without a word: its NIC's sockets close with it
    }
    GpuBuffer srcBuf(4096);
    RdmaMemoryRegion src = side.nic->RegisterRdmaMemoryRegion(srcBuf.Data(), srcBuf.Bytes());
    b.Barrier();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    GpuBuffer out(8, MemoryType::HostPinned);
    core::LaunchKernel(WriteUntilError, Dim3(1), Dim3(1), 0, nullptr, side.Q(), src, side.peer.region, 100000u,
                       out.DataAs<uint32_t>());
    EXPECT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess) << "the kernel must finish, not hang";
    EXPECT_GE(out.DataAs<uint32_t>()[0], 1u) << "writes to a dead peer must fail";
    EXPECT_EQ(out.DataAs<uint32_t>()[1], uint32_t{mlx5::kSyndromeTransportRetryExcErr});
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

int Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

TEST_F(RdmaAcrossProcesses, AcrossTwoNetworkNamespaces) {
  if (geteuid() != 0 || Sh("command -v ip") != 0) GTEST_SKIP() << "needs root and iproute2 to build two hosts";
  std::string nsA = "mori_ra" + std::to_string(getpid()), nsB = "mori_rb" + std::to_string(getpid());
  std::string va = "mra" + std::to_string(getpid() % 100000), vb = "mrb" + std::to_string(getpid() % 100000);
  std::string net = "10." + std::to_string(getpid() % 200 + 20) + ".1.";
  if (Sh("ip netns add " + nsA) != 0) GTEST_SKIP() << "creating network namespaces is not permitted here";
  bool ok = Sh("ip netns add " + nsB) == 0 && Sh("ip link add " + va + " type veth peer name " + vb) == 0 &&
            Sh("ip link set " + va + " netns " + nsA) == 0 && Sh("ip link set " + vb + " netns " + nsB) == 0 &&
            Sh("ip -n " + nsA + " addr add " + net + "1/24 dev " + va) == 0 &&
            Sh("ip -n " + nsB + " addr add " + net + "2/24 dev " + vb) == 0 &&
            Sh("ip -n " + nsA + " link set " + va + " up") == 0 && Sh("ip -n " + nsB + " link set " + vb + " up") == 0 &&
            Sh("ip -n " + nsA + " link set lo up") == 0 && Sh("ip -n " + nsB + " link set lo up") == 0;
  if (!ok) {
    Sh("ip netns del " + nsA);
    Sh("ip netns del " + nsB);
    GTEST_SKIP() << "could not build the veth link between namespaces";
  }
  const std::string root = net + "1:" + std::to_string(test::FreeTcpPort());
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    int fd = open(("/var/run/netns/" + (rank == 0 ? nsA : nsB)).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) return 5;
    close(fd);
    // Each NIC's wire listens on the namespace's veth address (the only non-loopback interface there).
    core::SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    return ExchangeAndVerify(b);
  });
  test::ExpectAllSucceed(outcomes);
  Sh("ip netns del " + nsA);
  Sh("ip netns del " + nsB);
}

}  // namespace
}  // namespace mori::rdma
