// Runs under `mpirun -np N` (ctest starts it with 2, 4 and 8 ranks): the MPI bootstrap, the bootstrap
// that the launch environment yields under mpirun, the socket bootstrap with its unique id passed by MPI,
// and same-host memory sharing among the ranks mpirun placed on this host.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/core/ipc_memory.hpp"
#include "mori/core/launch.hpp"
#include "mori/core/mpi_bootstrap.hpp"

namespace mori::core {
namespace {

using test::FillPattern;
using test::FirstPatternMismatch;

void Exercise(Bootstrap& b) {
  const int rank = b.GetRank();
  const int n = b.GetNranks();
  for (size_t per : {size_t(8), size_t(256) << 10}) {
    std::vector<uint8_t> all(per * n);
    FillPattern(all.data() + per * rank, per, rank, 31);
    b.AllGather(all.data(), per);
    for (int r = 0; r < n; ++r) EXPECT_EQ(FirstPatternMismatch(all.data() + per * r, per, r, 31), per) << "rank " << r;
  }
  for (int root = 0; root < n; ++root) {
    std::vector<uint8_t> data(5000 + root);
    if (rank == root) FillPattern(data.data(), data.size(), root, 32);
    b.Broadcast(data.data(), data.size(), root);
    EXPECT_EQ(FirstPatternMismatch(data.data(), data.size(), root, 32), data.size());
  }
  b.Barrier();
  int next = (rank + 1) % n;
  int prev = (rank + n - 1) % n;
  std::vector<uint8_t> out(70000), in(70000);
  FillPattern(out.data(), out.size(), rank, 33);
  b.Send(out.data(), out.size(), next, 11);
  b.Recv(in.data(), in.size(), prev, 11);
  EXPECT_EQ(FirstPatternMismatch(in.data(), in.size(), prev, 33), in.size());
}

TEST(MpiBootstrapTest, CollectivesAndPointToPoint) {
  MpiBootstrap b(MPI_COMM_WORLD, 60);
  int worldRank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &worldRank);
  EXPECT_EQ(b.GetRank(), worldRank);
  Exercise(b);
}

TEST(MpiBootstrapTest, WrongSizesAndTagsAreClearErrors) {
  MpiBootstrap b(MPI_COMM_WORLD, 60);
  int n = b.GetNranks();
  int next = (b.GetRank() + 1) % n;
  int prev = (b.GetRank() + n - 1) % n;
  uint64_t v = 7;
  b.Send(&v, sizeof(v), next, 3);
  uint32_t narrow;
  try {
    b.Recv(&narrow, sizeof(narrow), prev, 3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sent 8 bytes"), std::string::npos) << e.what();
  }
  EXPECT_THROW(b.Send(&v, sizeof(v), n, 1), Error);
  EXPECT_THROW(b.Send(&v, sizeof(v), next, -1), Error);
  // The message stays unread after the size error; take it so the next test starts clean.
  b.Recv(&v, sizeof(v), prev, 3);
  b.Barrier();
}

TEST(MpiBootstrapTest, ARecvThatNobodyAnswersTimesOut) {
  MpiBootstrap b(MPI_COMM_WORLD, 0.3);
  int peer = (b.GetRank() + 1) % b.GetNranks();
  uint32_t v;
  try {
    b.Recv(&v, sizeof(v), peer, 999);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("from rank " + std::to_string(peer)), std::string::npos) << e.what();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiBootstrapTest, LaunchEnvironmentUnderMpirunIsMpi) {
  LaunchEnvironment env = DetectLaunchEnvironment();
  EXPECT_EQ(env.launcher, Launcher::Mpi);
  int rank = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  EXPECT_EQ(env.rank, rank);
  EXPECT_EQ(env.worldSize, n);
  auto b = CreateBootstrapFromEnvironment(60);
  EXPECT_NE(dynamic_cast<MpiBootstrap*>(b.get()), nullptr);
  Exercise(*b);
}

TEST(MpiBootstrapTest, SocketBootstrapWithItsIdSentByMpi) {
  int rank = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  UniqueId id;
  if (rank == 0) id = SocketBootstrap::CreateUniqueId();
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  auto b = std::make_shared<SocketBootstrap>(rank, n);
  b->Initialize(id, 60);
  Exercise(*b);
}

TEST(MpiBootstrapTest, SameHostRanksShareMemory) {
#if !MORI_BACKEND_HOST
  GTEST_SKIP() << "host-side writes need HOST memory; GPU memory sharing is tested by ipc_memory_mp_test";
#else
  MpiBootstrap b(MPI_COMM_WORLD, 60);
  HostTopology topo = DiscoverHostTopology(b);
  EXPECT_EQ(topo.numHosts, 1);
  EXPECT_EQ(topo.localSize, b.GetNranks());
  FdChannel channel(b);
  GpuBuffer buf((1 << 20) + 5);
  FillPattern(buf.Data(), buf.Bytes(), b.GetRank(), 34);
  b.Barrier();
  auto peers = ExchangeIpcMemory(b, topo, channel, buf.Data(), buf.Bytes());
  for (int r = 0; r < b.GetNranks(); ++r) {
    if (r == b.GetRank()) continue;
    ASSERT_NE(peers[r], nullptr);
    EXPECT_EQ(FirstPatternMismatch(peers[r]->Data(), buf.Bytes(), r, 34), buf.Bytes()) << "rank " << r;
  }
  // Write a word into each peer's buffer; each rank then finds every peer's word in its own.
  b.Barrier();
  for (int r = 0; r < b.GetNranks(); ++r) {
    if (r == b.GetRank()) continue;
    static_cast<uint32_t*>(peers[r]->Data())[b.GetRank()] = 0xA0000000u + b.GetRank() * 16 + r;
  }
  b.Barrier();
  for (int r = 0; r < b.GetNranks(); ++r) {
    if (r == b.GetRank()) continue;
    EXPECT_EQ(buf.DataAs<uint32_t>()[r], 0xA0000000u + r * 16 + b.GetRank());
  }
  b.Barrier();
#endif
}

}  // namespace
}  // namespace mori::core

