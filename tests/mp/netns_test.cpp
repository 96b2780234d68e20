// Several "hosts" on one machine: two network namespaces joined by a veth pair, made by the test
// itself. Ranks in different namespaces must bootstrap across the link, see each other as different
// hosts, and share memory only with the ranks of their own namespace.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/core/ipc_memory.hpp"

namespace mori::core {
namespace {

int Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

// Two namespaces, nsA with 10.<s>.0.1 and nsB with 10.<s>.0.2, on a veth pair.
class TwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
    if (Sh("command -v ip") != 0) GTEST_SKIP() << "the ip command (iproute2) is not installed";
    int tag = static_cast<int>(getpid() % 200) + 20;
    nsA_ = "mori_a" + std::to_string(getpid());
    nsB_ = "mori_b" + std::to_string(getpid());
    std::string va = "mva" + std::to_string(getpid() % 100000);
    std::string vb = "mvb" + std::to_string(getpid() % 100000);
    addrA_ = "10." + std::to_string(tag) + ".0.1";
    addrB_ = "10." + std::to_string(tag) + ".0.2";
    if (Sh("ip netns add " + nsA_) != 0) GTEST_SKIP() << "creating a network namespace is not permitted here";
    created_ = true;
    bool ok = Sh("ip netns add " + nsB_) == 0 && Sh("ip link add " + va + " type veth peer name " + vb) == 0 &&
              Sh("ip link set " + va + " netns " + nsA_) == 0 && Sh("ip link set " + vb + " netns " + nsB_) == 0 &&
              Sh("ip -n " + nsA_ + " addr add " + addrA_ + "/24 dev " + va) == 0 &&
              Sh("ip -n " + nsB_ + " addr add " + addrB_ + "/24 dev " + vb) == 0 &&
              Sh("ip -n " + nsA_ + " link set " + va + " up") == 0 && Sh("ip -n " + nsB_ + " link set " + vb + " up") == 0 &&
              Sh("ip -n " + nsA_ + " link set lo up") == 0 && Sh("ip -n " + nsB_ + " link set lo up") == 0;
    if (!ok) GTEST_SKIP() << "could not build the veth link between namespaces (not permitted here?)";
  }

  void TearDown() override {
    if (!created_) return;
    Sh("ip netns del " + nsA_);
    Sh("ip netns del " + nsB_);
  }

  static void Enter(const std::string& ns) {
    int fd = open(("/var/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0) << "open netns " << ns;
    ASSERT_EQ(setns(fd, CLONE_NEWNET), 0) << "setns " << ns;
    close(fd);
  }

  std::string nsA_, nsB_, addrA_, addrB_;
  bool created_ = false;
};

TEST_F(TwoHosts, BootstrapTopologyAndSharingAcrossNamespaces) {
  const int n = 4;  // ranks 0,1 in nsA; ranks 2,3 in nsB
  const std::string root = addrA_ + ":" + std::to_string(test::FreeTcpPort());
  auto outcomes = test::RunProcesses(n, [&](int rank) {
    Enter(rank < 2 ? nsA_ : nsB_);
    if (::testing::Test::HasFatalFailure()) return 1;
    SocketBootstrap b(rank, n);
    b.Initialize(root, 30);

    // Data across the link, both directions.
    std::vector<uint8_t> out(3 << 20), in(3 << 20);
    test::FillPattern(out.data(), out.size(), rank, 3);
    int partner = (rank + 2) % n;  // always in the other namespace
    b.Send(out.data(), out.size(), partner, 1);
    b.Recv(in.data(), in.size(), partner, 1);
    EXPECT_EQ(test::FirstPatternMismatch(in.data(), in.size(), partner, 3), in.size());

    HostTopology topo = DiscoverHostTopology(b);
    EXPECT_EQ(topo.numHosts, 2);
    EXPECT_EQ(topo.localSize, 2);
    EXPECT_EQ(topo.hostIndex, rank < 2 ? 0 : 1);
    EXPECT_EQ(topo.localRank, rank % 2);
    EXPECT_TRUE(topo.SameHost(rank ^ 1));
    EXPECT_FALSE(topo.SameHost(partner));

    // Memory is shared with the namespace-mate only.
    FdChannel channel(b);
    GpuBuffer buf(64 << 10);
    test::FillPattern(buf.Data(), buf.Bytes(), rank, 8);
    b.Barrier();
    auto peers = ExchangeIpcMemory(b, topo, channel, buf.Data(), buf.Bytes());
    for (int r = 0; r < n; ++r) {
      if (r == (rank ^ 1)) {
        if (peers[r] == nullptr) {
          ADD_FAILURE() << "rank " << r << " shares this namespace but its memory was not mapped";
          return 1;
        }
        EXPECT_EQ(test::FirstPatternMismatch(peers[r]->Data(), buf.Bytes(), r, 8), buf.Bytes());
      } else {
        EXPECT_EQ(peers[r], nullptr) << "rank " << r << " is not on this host";
      }
    }
    b.Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(TwoHosts, UniqueIdFollowsTheNamedInterface) {
  // The root's id must carry its veth address when MORI_SOCKET_IFNAME names it.
  const int n = 2;
  auto outcomes = test::RunProcesses(1, [&](int) {
    Enter(nsA_);
    std::string ifname;
    {
      FILE* p = popen(("ip -o -4 addr show | grep " + addrA_ + " | awk '{print $2}'").c_str(), "r");
      char buf[64] = {};
      if (p != nullptr && fgets(buf, sizeof(buf), p) != nullptr) ifname = buf;
      if (p != nullptr) pclose(p);
      while (!ifname.empty() && (ifname.back() == '\n' || ifname.back() == ' ')) ifname.pop_back();
    }
    EXPECT_FALSE(ifname.empty());
    setenv("MORI_SOCKET_IFNAME", ifname.c_str(), 1);
    UniqueId id = SocketBootstrap::CreateUniqueId();
    EXPECT_EQ(SocketBootstrap::UniqueIdAddress(id).rfind(addrA_ + ":", 0), 0u) << SocketBootstrap::UniqueIdAddress(id);
    // And a rank in the other namespace reaches it through the link.
    auto pair = test::RunProcesses(n, [&](int rank) {
      if (rank == 1) Enter(nsB_);
      SocketBootstrap b(rank, n);
      b.Initialize(id, 20);
      auto all = b.AllGatherValue(HostIdentity());
      EXPECT_NE(all[0], all[1]);
      return 0;
    });
    test::ExpectAllSucceed(pair);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

}  // namespace
}  // namespace mori::core
