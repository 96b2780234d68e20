// The communicator between forked processes: registering memory for each transport, sending it to peers
// (same-host CudaIpc memory arrives mapped), Connect over each transport and its refusals, semaphores over
// each transport (host Signal/Wait/Poll rounds and a kernel's Wait), and a peer that is gone.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"

namespace mori::core {
namespace {

using test::FillPattern;
using test::FirstPatternMismatch;

using test::LoopbackRoot;

EndpointConfig Config(Transport t) {
  EndpointConfig c;
  c.transport = t;
  return c;
}

struct Rank {
  std::shared_ptr<SocketBootstrap> bootstrap;
  std::unique_ptr<Communicator> comm;
  Rank(int rank, int n, const std::string& root, double timeout = 60) {
    bootstrap = std::make_shared<SocketBootstrap>(rank, n);
    bootstrap->Initialize(root, timeout);
    int gpus = 0;
    MORI_CHECK_GPU(GpuGetDeviceCount(&gpus));
    MORI_CHECK_GPU(GpuSetDevice(rank % gpus));
    comm = std::make_unique<Communicator>(bootstrap);
  }
};

template <typename Fn>
void ExpectError(Fn&& fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error (expected " << ErrorCodeName(code) << " about \"" << needle << "\")";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

std::vector<uint8_t> ReadBack(const void* src, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  MORI_CHECK_GPU(GpuMemcpy(out.data(), src, bytes));
  return out;
}

class CommunicatorMp : public ::testing::Test {
 protected:
  void SetUp() override {
    gpus_ = test::ProbeGpuCount();
    if (gpus_ == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }
  int gpus_ = 0;
};

// Three ranks register memory for every transport at once and send it around; the same-host CudaIpc memory
// of each peer arrives mapped, readable and writable here.
TEST_F(CommunicatorMp, RegisteredMemoryTravelsAndSameHostMemoryArrivesMapped) {
  const std::string root = LoopbackRoot();
  constexpr int kRanks = 3;
  constexpr size_t kBytes = (64 << 10) + 13;
  constexpr size_t kSlot = 4099;  // each peer writes its own slot after the pattern
  auto outcomes = test::RunProcesses(kRanks, [&](int rank) {
    Rank r(rank, kRanks, root);
    EXPECT_EQ(r.comm->Rank(), rank);
    EXPECT_EQ(r.comm->NRanks(), kRanks);
    for (int p = 0; p < kRanks; ++p) EXPECT_TRUE(r.comm->SameHost(p));
    const size_t total = kBytes + kRanks * kSlot;
    GpuBuffer buf(total);
    std::vector<uint8_t> host(total);
    FillPattern(host.data(), total, rank, 11);
    MORI_CHECK_GPU(GpuMemcpy(buf.Data(), host.data(), total));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // landed before a peer may write (pageable copies return early)
    const TransportFlags all = Transport::CudaIpc | Transport::Emulated | Transport::Tcp;
    RegisteredMemory mem = r.comm->RegisterMemory(buf.Data(), total, all);
    EXPECT_TRUE(mem.IsLocal());
    EXPECT_EQ(mem.Data(), buf.Data());
    EXPECT_EQ(mem.Transports(), all);
    EXPECT_EQ(mem.Rank(), rank);
    // A second registration of part of it for one transport only: it travels without a mapping.
    RegisteredMemory rdmaOnly = r.comm->RegisterMemory(buf.DataAs<uint8_t>() + 64, 1000, Transport::IB0);

    for (int p = 0; p < kRanks; ++p) {
      if (p == rank) continue;
      r.comm->SendMemory(mem, p, 7);
      r.comm->SendMemory(rdmaOnly, p, 8);
    }
    std::vector<RegisteredMemory> peers(kRanks);
    for (int p = 0; p < kRanks; ++p) {
      if (p == rank) continue;
      auto mapped = r.comm->RecvMemory(p, 7);
      auto unmapped = r.comm->RecvMemory(p, 8);
      peers[static_cast<size_t>(p)] = mapped.get();
      RegisteredMemory u = unmapped.get();
      EXPECT_FALSE(u.IsLocal());
      EXPECT_EQ(u.Data(), nullptr) << "IB0-only memory of rank " << p << " cannot be mapped";
      EXPECT_EQ(u.Size(), 1000u);
      EXPECT_EQ(u.Transports(), TransportFlags(Transport::IB0));
    }
    for (int p = 0; p < kRanks; ++p) {
      if (p == rank) continue;
      const RegisteredMemory& m = peers[static_cast<size_t>(p)];
      EXPECT_FALSE(m.IsLocal());
      EXPECT_EQ(m.Rank(), p);
      EXPECT_EQ(m.Size(), total);
      EXPECT_EQ(m.Transports(), all);
      EXPECT_NE(m.Data(), nullptr) << "same-host CudaIpc memory of rank " << p << " must arrive mapped";
      if (m.Data() == nullptr) return 1;
      std::vector<uint8_t> got = ReadBack(m.Data(), kBytes);
      EXPECT_EQ(FirstPatternMismatch(got.data(), kBytes, p, 11), kBytes) << "rank " << p << "'s memory read here";
      // Our slot in the peer's memory.
      std::vector<uint8_t> mine(kSlot);
      FillPattern(mine.data(), kSlot, 50 + rank, 12);
      MORI_CHECK_GPU(GpuMemcpy(static_cast<uint8_t*>(m.Data()) + kBytes + rank * kSlot, mine.data(), kSlot));
      // A copy from pageable memory may return before its DMA lands: the owner reads after the barrier.
      MORI_CHECK_GPU(GpuDeviceSynchronize());
    }
    r.bootstrap->Barrier();
    std::vector<uint8_t> got = ReadBack(buf.Data(), total);
    EXPECT_EQ(FirstPatternMismatch(got.data(), kBytes, rank, 11), kBytes) << "the part nobody writes";
    for (int p = 0; p < kRanks; ++p) {
      const uint8_t* slot = got.data() + kBytes + p * kSlot;
      if (p == rank) {
        std::vector<uint8_t> want(total);
        FillPattern(want.data(), total, rank, 11);
        EXPECT_EQ(std::memcmp(slot, want.data() + kBytes + p * kSlot, kSlot), 0)
            << "own slot was written";  // nobody writes it
      } else {
        EXPECT_EQ(FirstPatternMismatch(slot, kSlot, 50 + p, 12), kSlot) << "slot of rank " << p;
      }
    }
    r.bootstrap->Barrier();  // peers unmap before the owner frees
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(CommunicatorMp, RegisterAndSendRefuseWhatCannotWork) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    GpuBuffer buf(4096);
    std::vector<uint8_t> plain(4096);
    ExpectError([&] { r.comm->RegisterMemory(nullptr, 64, Transport::Tcp); }, ErrorCode::InvalidUsage, "null pointer");
    ExpectError([&] { r.comm->RegisterMemory(buf.Data(), 0, Transport::Tcp); }, ErrorCode::InvalidUsage, "empty range");
    ExpectError([&] { r.comm->RegisterMemory(buf.Data(), 64, TransportFlags()); }, ErrorCode::InvalidUsage,
                "names no transport");
    ExpectError([&] { r.comm->RegisterMemory(plain.data(), plain.size(), Transport::CudaIpc); },
                ErrorCode::InvalidUsage, "cannot be shared");
    RegisteredMemory mem = r.comm->RegisterMemory(buf.Data(), 4096, Transport::Emulated);
    ExpectError([&] { r.comm->SendMemory(mem, 2); }, ErrorCode::InvalidUsage, "rank 2");
    ExpectError([&] { r.comm->SendMemory(mem, -1); }, ErrorCode::InvalidUsage, "rank -1");
    ExpectError([&] { r.comm->SendMemory(mem, 1 - rank, -1); }, ErrorCode::InvalidUsage, "tag -1");
    ExpectError([&] { r.comm->SendMemory(mem, 1 - rank, 1 << 24); }, ErrorCode::InvalidUsage, "tag 16777216");
    ExpectError([&] { r.comm->SendMemory(RegisteredMemory(), 1 - rank); }, ErrorCode::InvalidUsage, "empty");
    ExpectError([&] { (void)r.comm->RecvMemory(3); }, ErrorCode::InvalidUsage, "rank 3");
    ExpectError([&] { (void)r.comm->SameHost(9); }, ErrorCode::InvalidUsage, "rank 9");
    // Memory sent to self comes back whole.
    r.comm->SendMemory(mem, rank, 4);
    RegisteredMemory self = r.comm->RecvMemory(rank, 4).get();
    EXPECT_TRUE(self.IsLocal());
    EXPECT_EQ(self.Data(), buf.Data());
    EXPECT_EQ(self.GetImpl(), mem.GetImpl());
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Counts the signals of a semaphore from a kernel: waits `n` times, then records how many it took.
MORI_GLOBAL void WaitSignals(SemaphoreDeviceHandle sem, int n, uint64_t* done) {
  if (ThreadIdxX() != 0 || BlockIdxX() != 0) return;
  for (int i = 0; i < n; ++i) sem.Wait();
  AtomicStore<MemoryOrder::Release, Scope::System>(done, static_cast<uint64_t>(n));
}

struct TransportCase {
  Transport transport;
  int ranks;
};

class ConnectEachTransport : public ::testing::TestWithParam<TransportCase> {
 protected:
  void SetUp() override {
    if (test::ProbeGpuCount() == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }
};

// Every pair of ranks connects over the transport, builds two semaphores per connection, plays host
// ping-pong rounds on one and signals a kernel that waits on the other.
TEST_P(ConnectEachTransport, ConnectsAndSemaphoresWorkBothWays) {
  const TransportCase c = GetParam();
  const std::string root = LoopbackRoot();
  constexpr int kRounds = 25;
  constexpr int kKernelSignals = 9;
  auto outcomes = test::RunProcesses(c.ranks, [&](int rank) {
    Rank r(rank, c.ranks, root);
    // Calls first, then get()s, both by increasing peer rank (the order Connect asks for).
    std::vector<std::shared_future<std::shared_ptr<Connection>>> pending(static_cast<size_t>(c.ranks));
    for (int p = 0; p < c.ranks; ++p) {
      if (p != rank) pending[static_cast<size_t>(p)] = r.comm->Connect(Config(c.transport), p, 3);
    }
    std::vector<std::shared_ptr<Connection>> conns(static_cast<size_t>(c.ranks));
    for (int p = 0; p < c.ranks; ++p) {
      if (p == rank) continue;
      conns[static_cast<size_t>(p)] = pending[static_cast<size_t>(p)].get();
      EXPECT_EQ(conns[static_cast<size_t>(p)]->RemoteRank(), p);
      EXPECT_EQ(conns[static_cast<size_t>(p)]->Tag(), 3);
      EXPECT_EQ(conns[static_cast<size_t>(p)]->GetTransport(), c.transport);
      EXPECT_EQ(conns[static_cast<size_t>(p)]->GetRemoteTransport(), c.transport);
    }
    std::vector<std::shared_future<std::shared_ptr<Semaphore>>> hostSems(static_cast<size_t>(c.ranks)),
        kernelSems(static_cast<size_t>(c.ranks));
    for (int p = 0; p < c.ranks; ++p) {
      if (p == rank) continue;
      hostSems[static_cast<size_t>(p)] = r.comm->BuildSemaphore(conns[static_cast<size_t>(p)], p, 1);
      kernelSems[static_cast<size_t>(p)] = r.comm->BuildSemaphore(conns[static_cast<size_t>(p)], p, 2);
    }
    std::vector<std::shared_ptr<Semaphore>> sems(static_cast<size_t>(c.ranks));
    for (int p = 0; p < c.ranks; ++p) {
      if (p == rank) continue;
      sems[static_cast<size_t>(p)] = hostSems[static_cast<size_t>(p)].get();
      EXPECT_EQ(sems[static_cast<size_t>(p)]->RemoteRank(), p);
      EXPECT_FALSE(sems[static_cast<size_t>(p)]->Poll()) << "nothing signalled yet by rank " << p;
    }
    r.bootstrap->Barrier();
    // One pair at a time, in the same order everywhere; the others wait at the barrier.
    for (int a = 0; a < c.ranks; ++a) {
      for (int b = a + 1; b < c.ranks; ++b) {
        if (rank == a || rank == b) {
          const int p = rank == a ? b : a;
          Semaphore& sem = *sems[static_cast<size_t>(p)];
          Connection& conn = *conns[static_cast<size_t>(p)];
          for (int i = 0; i < kRounds; ++i) {  // ping-pong: the lower rank starts each round
            if (rank == a) {
              sem.Signal();
              conn.Flush();
              sem.Wait();
            } else {
              sem.Wait();
              sem.Signal();
              conn.Flush();
            }
          }
          // Three signals at once are three signals, each consumed once.
          sem.Signal();
          sem.Signal();
          sem.Signal();
          conn.Flush();
          for (int k = 0; k < 3; ++k) sem.Wait();
          EXPECT_FALSE(sem.Poll()) << "a fourth signal from rank " << p;
          ExpectError([&] { sem.Wait(10000); }, ErrorCode::Timeout, "from rank " + std::to_string(p));
        }
        r.bootstrap->Barrier();
      }
    }
    for (int p = 0; p < c.ranks; ++p) {
      if (p == rank) continue;
      std::shared_ptr<Semaphore> sem = kernelSems[static_cast<size_t>(p)].get();
      GpuBuffer done(8, MemoryType::HostPinned);
      *done.DataAs<uint64_t>() = 0;
      GpuStream stream{};
      MORI_CHECK_GPU(GpuStreamCreate(&stream));
      LaunchKernel(WaitSignals, Dim3(1), Dim3(1), 0, stream, sem->DeviceHandle(), kKernelSignals,
                   done.DataAs<uint64_t>());
      for (int i = 0; i < kKernelSignals; ++i) sem->Signal();
      conns[static_cast<size_t>(p)]->Flush();
      MORI_CHECK_GPU(GpuStreamSynchronize(stream));
      MORI_CHECK_GPU(GpuStreamDestroy(stream));
      EXPECT_EQ(*done.DataAs<uint64_t>(), uint64_t{kKernelSignals}) << "the kernel waiting on rank " << p;
    }
    r.bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Transports, ConnectEachTransport,
                         ::testing::Values(TransportCase{Transport::CudaIpc, 2}, TransportCase{Transport::Emulated, 2},
                                           TransportCase{Transport::IB0, 2}, TransportCase{Transport::Tcp, 2},
                                           TransportCase{Transport::CudaIpc, 3}, TransportCase{Transport::Emulated, 3},
                                           TransportCase{Transport::Tcp, 3}),
                         [](const ::testing::TestParamInfo<TransportCase>& info) {
                           return std::string(TransportName(info.param.transport)) + "_" +
                                  std::to_string(info.param.ranks) + "ranks";
                         });

// Rank 0 and rank 1 name transports that do not pair: both sides refuse, naming the other's transport.
TEST_F(CommunicatorMp, MismatchedTransportsAreRefusedOnBothSides) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    const int peer = 1 - rank;
    struct Pair {
      Transport mine[2];
    };
    const std::vector<Pair> pairs = {{{Transport::Tcp, Transport::Emulated}},
                                     {{Transport::CudaIpc, Transport::IB0}},
                                     {{Transport::Tcp, Transport::CudaIpc}}};
    for (size_t i = 0; i < pairs.size(); ++i) {
      const Transport mine = pairs[i].mine[rank], theirs = pairs[i].mine[peer];
      SCOPED_TRACE(std::string(TransportName(mine)) + " against " + TransportName(theirs));
      // A fresh tag per attempt: a refused Connect may leave the peer's messages queued under its tag.
      ExpectError([&] { (void)r.comm->Connect(Config(mine), peer, 100 + static_cast<int>(i)).get(); },
                  ErrorCode::InvalidUsage, std::string("connects over ") + TransportName(theirs));
    }
    // IB0 and Emulated are both RDMA and run on the same (emulated) NIC here: they pair.
    auto conn = r.comm->Connect(Config(rank == 0 ? Transport::IB0 : Transport::Emulated), peer, 200).get();
    EXPECT_EQ(conn->GetRemoteTransport(), rank == 0 ? Transport::Emulated : Transport::IB0);
    r.bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(CommunicatorMp, BadRanksTagsAndTransportsAreRefusedAtTheCall) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    ExpectError([&] { (void)r.comm->Connect(Config(Transport::Emulated), 2); }, ErrorCode::InvalidUsage, "rank 2");
    ExpectError([&] { (void)r.comm->Connect(Config(Transport::Emulated), -1); }, ErrorCode::InvalidUsage, "rank -1");
    ExpectError([&] { (void)r.comm->Connect(Config(Transport::Emulated), 1 - rank, -5); }, ErrorCode::InvalidUsage,
                "tag -5");
    ExpectError([&] { (void)r.comm->Connect(Config(Transport::Unknown), 1 - rank); }, ErrorCode::InvalidUsage,
                "choose CudaIpc");
    ExpectError([&] { (void)r.comm->Connect(Config(static_cast<Transport>(40)), 1 - rank); }, ErrorCode::InvalidUsage,
                "transport 40");
    ExpectError([&] { (void)r.comm->Connect(Config(Transport::CudaIpc), rank); }, ErrorCode::InvalidUsage,
                "CudaIpc to itself");
    EndpointConfig bad = Config(Transport::Emulated);
    bad.ib.maxSendWr = 0;
    ExpectError([&] { (void)r.comm->Connect(bad, 1 - rank, 9); }, ErrorCode::InvalidUsage, "maxSendWr 0");
    ExpectError([&] { (void)r.comm->BuildSemaphore(nullptr, 1 - rank); }, ErrorCode::InvalidUsage, "no connection");
    // A connection to one peer cannot make a semaphore with another.
    auto self = r.comm->Connect(Config(Transport::Emulated), rank, 1).get();
    ExpectError([&] { (void)r.comm->BuildSemaphore(self, 1 - rank); }, ErrorCode::InvalidUsage,
                "a connection to rank " + std::to_string(rank));
    r.bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Listening sockets of this process (any kind).
int ListeningSockets() { return static_cast<int>(test::ListeningFds().size()); }

// Futures of a Communicator taken after it is gone are an error naming the call, not a use of freed state; a
// Tcp connect whose future is never taken closes its listeners with the communicator (before, they stayed
// open for as long as the future was kept).
TEST_F(CommunicatorMp, FuturesOutlivingTheirCommunicatorAreAClearError) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    auto memory = r.comm->RecvMemory(1 - rank, 3);
    const int listeningBefore = ListeningSockets();
    EndpointConfig tcp = Config(Transport::Tcp);
    tcp.tcp.numChannels = 3;
    auto connection = r.comm->Connect(tcp, 1 - rank, 4);
    EXPECT_EQ(ListeningSockets(), listeningBefore + 3) << "a listener per channel while the future waits";
    auto self = r.comm->Connect(Config(Transport::Emulated), rank, 5).get();
    auto semaphore = r.comm->BuildSemaphore(self, rank, 6);
    r.comm.reset();
    EXPECT_EQ(ListeningSockets(), listeningBefore) << "the untaken connect's listeners outlived the communicator";
    ExpectError([&] { (void)memory.get(); }, ErrorCode::InvalidUsage,
                "RecvMemory from rank " + std::to_string(1 - rank));
    ExpectError([&] { (void)connection.get(); }, ErrorCode::InvalidUsage, "Communicator was destroyed");
    ExpectError([&] { (void)semaphore.get(); }, ErrorCode::InvalidUsage, "Communicator was destroyed");
    r.bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Rank 1 leaves right after setup. Rank 0's Connect and RecvMemory towards it end in an error naming it,
// well within the bootstrap's timeout.
TEST_F(CommunicatorMp, APeerThatExitsEarlyIsAClearErrorNotAHang) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(
      2,
      [&](int rank) {
        Rank r(rank, 2, root, 8);
        r.bootstrap->Barrier();
        if (rank == 1) test::DieAbruptly(0);
        for (Transport t : {Transport::Emulated, Transport::Tcp, Transport::CudaIpc}) {
          SCOPED_TRACE(TransportName(t));
          try {
            (void)r.comm->Connect(Config(t), 1, static_cast<int>(t)).get();
            ADD_FAILURE() << "Connect to a rank that is gone succeeded";
          } catch (const Error& e) {
            EXPECT_TRUE(e.Code() == ErrorCode::RemoteFailure || e.Code() == ErrorCode::Timeout) << e.what();
            EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
          }
        }
        try {
          (void)r.comm->RecvMemory(1).get();
          ADD_FAILURE() << "RecvMemory from a rank that is gone succeeded";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
        }
        return 0;
      },
      90);
  test::ExpectAllSucceed(outcomes);
}

}  // namespace
}  // namespace mori::core
