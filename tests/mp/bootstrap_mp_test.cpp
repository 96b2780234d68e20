// The socket bootstrap with several processes on loopback: every operation with rank- and
// index-dependent data, and every failure the issue names: a rank that never comes, a peer that dies,
// garbage and truncated frames, a process of another job, inconsistent world sizes, duplicate ranks.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "bootstrap_wire.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/launch.hpp"
#include "socket.hpp"

namespace mori::core {
namespace {

using test::FillPattern;
using test::FirstPatternMismatch;
using test::RunProcesses;

using test::LoopbackRoot;

// Runs `expectFn` and checks that it throws a mori::core::Error whose message contains `needle`.
template <typename Fn>
bool ThrowsMentioning(Fn&& fn, const std::string& needle, ErrorCode* code = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (code != nullptr) *code = e.Code();
    if (std::string(e.what()).find(needle) != std::string::npos) return true;
    ADD_FAILURE() << "error without '" << needle << "': " << e.what();
    return false;
  }
  ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  return false;
}

void ExerciseEverything(Bootstrap& b) {
  const int rank = b.GetRank();
  const int n = b.GetNranks();

  // All-gather, small and large (the large one keeps every ring link busy at once).
  for (size_t per : {size_t(1), size_t(1000), size_t(1) << 20}) {
    std::vector<uint8_t> all(per * n, 0);
    FillPattern(all.data() + per * rank, per, rank, static_cast<uint32_t>(per));
    b.AllGather(all.data(), per);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(FirstPatternMismatch(all.data() + per * r, per, r, static_cast<uint32_t>(per)), per)
          << "slot of rank " << r << ", " << per << " bytes per rank";
    }
  }

  // Broadcast from every root.
  for (int root = 0; root < n; ++root) {
    std::vector<uint8_t> data(100000 + root);
    if (rank == root) FillPattern(data.data(), data.size(), root, 77);
    b.Broadcast(data.data(), data.size(), root);
    EXPECT_EQ(FirstPatternMismatch(data.data(), data.size(), root, 77), data.size()) << "root " << root;
  }

  for (int i = 0; i < 10; ++i) b.Barrier();

  // Point to point with tags: every pair, tags received in the opposite order of sending.
  for (int peer = 0; peer < n; ++peer) {
    std::vector<uint8_t> first(64 + peer), second(4096 + peer);
    FillPattern(first.data(), first.size(), rank, 1000 + peer);
    FillPattern(second.data(), second.size(), rank, 2000 + peer);
    b.Send(first.data(), first.size(), peer, 1);
    b.Send(second.data(), second.size(), peer, 2);
  }
  for (int peer = 0; peer < n; ++peer) {
    std::vector<uint8_t> first(64 + rank), second(4096 + rank);
    b.Recv(second.data(), second.size(), peer, 2);
    b.Recv(first.data(), first.size(), peer, 1);
    EXPECT_EQ(FirstPatternMismatch(first.data(), first.size(), peer, 1000 + rank), first.size()) << "from " << peer;
    EXPECT_EQ(FirstPatternMismatch(second.data(), second.size(), peer, 2000 + rank), second.size()) << "from " << peer;
  }

  // Two ranks send 32 MiB to each other before either receives: only progress inside Send avoids deadlock.
  int partner = rank ^ 1;
  if (partner < n) {
    std::vector<uint8_t> out(32 << 20), in(32 << 20);
    FillPattern(out.data(), out.size(), rank, 5);
    b.Send(out.data(), out.size(), partner, 7);
    b.Recv(in.data(), in.size(), partner, 7);
    EXPECT_EQ(FirstPatternMismatch(in.data(), in.size(), partner, 5), in.size());
  }

  // Length-prefixed bytes, and the size check of Recv.
  int next = (rank + 1) % n;
  int prev = (rank + n - 1) % n;
  std::vector<uint8_t> blob(333 + rank);
  FillPattern(blob.data(), blob.size(), rank, 9);
  b.SendBytes(blob, next, 8);
  std::vector<uint8_t> got = b.RecvBytes(prev, 8);
  EXPECT_EQ(got.size(), 333u + prev);
  EXPECT_EQ(FirstPatternMismatch(got.data(), got.size(), prev, 9), got.size());

  uint64_t small = 42;
  b.Send(&small, sizeof(small), next, 9);
  uint32_t wrongSize;
  ThrowsMentioning([&] { b.Recv(&wrongSize, sizeof(wrongSize), prev, 9); }, "sent 8 bytes");
  b.Barrier();
}

class BootstrapWorld : public ::testing::TestWithParam<int> {};

TEST_P(BootstrapWorld, EveryOperationOnLoopback) {
  const int n = GetParam();
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(n, [&](int rank) {
    SocketBootstrap b(rank, n);
    b.Initialize(root, 60);
    EXPECT_EQ(b.GetRank(), rank);
    EXPECT_EQ(b.GetNranks(), n);
    ExerciseEverything(b);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_P(BootstrapWorld, UniqueIdMadeBeforeTheRanksStart) {
  const int n = GetParam();
  UniqueId id = SocketBootstrap::CreateUniqueId();  // listens now; rank 0 (a fork of this process) adopts it
  auto outcomes = RunProcesses(n, [&](int rank) {
    auto b = std::make_shared<SocketBootstrap>(rank, n);
    b->Initialize(id, 60);
    auto ranks = b->AllGatherValue(rank * 10 + 1);
    for (int r = 0; r < n; ++r) EXPECT_EQ(ranks[r], r * 10 + 1);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Ranks, BootstrapWorld, ::testing::Values(2, 4, 8),
                         [](const testing::TestParamInfo<int>& p) { return "np" + std::to_string(p.param); });

TEST(BootstrapFailures, ARankThatNeverComesIsNamedByTheRoot) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(4, [&](int rank) {
    if (rank == 2) return 0;  // never starts its bootstrap
    SocketBootstrap b(rank, 4);
    ErrorCode code{};
    if (rank == 0) {
      ThrowsMentioning([&] { b.Initialize(root, 1.5); }, "rank(s) 2 of 4 never registered", &code);
      EXPECT_EQ(code, ErrorCode::Timeout);
    } else {
      // The root gives up and goes away: the waiting ranks hear that, within their own bound.
      ThrowsMentioning([&] { b.Initialize(root, 10); }, "bootstrap root", &code);
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(BootstrapFailures, ARootThatNeverComesTimesOut) {
  const std::string root = LoopbackRoot();
  SocketBootstrap b(1, 2);
  ErrorCode code{};
  ThrowsMentioning([&] { b.Initialize(root, 0.5); }, "could not connect to the bootstrap root (rank 0) at " + root,
                   &code);
  EXPECT_EQ(code, ErrorCode::Timeout);
}

TEST(BootstrapFailures, APeerThatDiesIsNamed) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    SocketBootstrap b(rank, 3);
    b.Initialize(root, 3);
    if (rank == 2) {
      int hello = 1;
      b.Send(&hello, sizeof(hello), 0, 1);
      return 0;  // exits: its sockets close
    }
    int v = 0;
    if (rank == 0) {
      b.Recv(&v, sizeof(v), 2, 1);
      EXPECT_EQ(v, 1);
      ErrorCode code{};
      ThrowsMentioning([&] { b.Recv(&v, sizeof(v), 2, 2); }, "rank 2 closed its bootstrap connection", &code);
      EXPECT_EQ(code, ErrorCode::RemoteFailure);
    } else {
      // Rank 1 never heard from rank 2 at all: its wait ends at the bound, naming rank 2.
      ErrorCode code{};
      ThrowsMentioning([&] { b.Recv(&v, sizeof(v), 2, 5); }, "from rank 2, which never came", &code);
      EXPECT_EQ(code, ErrorCode::Timeout);
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Connects to `addr` and writes `bytes`, then closes.
void SendRaw(const std::string& addr, const void* bytes, size_t n) {
  net::SocketAddress a = net::SocketAddress::Parse(addr);
  UniqueFd fd = net::ConnectWithRetry(a, Deadline::After(10), "test target");
  net::SendAll(fd.Get(), bytes, n, Deadline::After(10), "test target");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

// After a stranger: the two ranks' all-gather still works, and the root's log (captured since before
// Initialize) says what it did with the stranger.
void ExpectJobWentOn(SocketBootstrap& b, int rank, const char* rootLog) {
  auto all = b.AllGatherValue(rank + 100);
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(all[0], 100);
  EXPECT_EQ(all[1], 101);
  if (rank == 0) {
    EXPECT_NE(log.find(rootLog), std::string::npos) << log;
  }
}

TEST(BootstrapFailures, GarbageAtTheRootIsDroppedAndTheJobGoesOn) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    if (rank == 2) {
      // A stranger: an HTTP request, then a header with our magic but an absurd length, then a truncated
      // header. None of it may crash, hang or confuse the real job.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const char http[] = "GET / HTTP/1.0\r\n\r\n";
      SendRaw(root, http, sizeof(http));
      bootstrap_wire::FrameHeader h{};
      h.magic = bootstrap_wire::kFrameMagic;
      h.version = bootstrap_wire::kVersion;
      h.type = static_cast<uint16_t>(bootstrap_wire::FrameType::Hello);
      h.length = ~0ull;
      SendRaw(root, &h, sizeof(h));
      SendRaw(root, &h, sizeof(h) / 2);
      return 0;
    }
    SocketBootstrap b(rank, 2);
    testing::internal::CaptureStderr();
    b.Initialize(root, 20);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // let the stranger finish
    ExpectJobWentOn(b, rank, "dropped a bootstrap connection");
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A connection that passes the hello as rank 1 of the job, then speaks garbage.
void Impostor(const std::string& root, const void* tail, size_t tailBytes) {
  UniqueId id = SocketBootstrap::UniqueIdFromAddress(root);
  bootstrap_wire::UniqueIdLayout layout;
  std::memcpy(&layout, id.bytes, sizeof(layout));
  bootstrap_wire::HelloPayload hello{};
  hello.nonce = layout.nonce;
  hello.rank = 1;
  hello.nRanks = 2;
  hello.purpose = static_cast<uint32_t>(bootstrap_wire::HelloPurpose::Data);
  bootstrap_wire::FrameHeader h{};
  h.magic = bootstrap_wire::kFrameMagic;
  h.version = bootstrap_wire::kVersion;
  h.type = static_cast<uint16_t>(bootstrap_wire::FrameType::Hello);
  h.srcRank = 1;
  h.length = sizeof(hello);
  std::vector<uint8_t> bytes(sizeof(h) + sizeof(hello) + tailBytes);
  std::memcpy(bytes.data(), &h, sizeof(h));
  std::memcpy(bytes.data() + sizeof(h), &hello, sizeof(hello));
  std::memcpy(bytes.data() + sizeof(h) + sizeof(hello), tail, tailBytes);
  SendRaw(root, bytes.data(), bytes.size());
}

TEST(BootstrapFailures, MalformedOrTruncatedFramesFromAPeerAreClearErrors) {
  struct Case {
    const char* name;
    std::vector<uint8_t> tail;
    const char* expect;
  };
  bootstrap_wire::FrameHeader data{};
  data.magic = bootstrap_wire::kFrameMagic;
  data.version = bootstrap_wire::kVersion;
  data.type = static_cast<uint16_t>(bootstrap_wire::FrameType::Data);
  data.srcRank = 1;
  data.tag = 4;
  data.length = 1000;
  std::vector<uint8_t> truncated(sizeof(data) + 10);
  std::memcpy(truncated.data(), &data, sizeof(data));
  // A header announcing 1 GiB followed by 10 bytes: received in pieces as they come, nothing of the size
  // allocated up front.
  bootstrap_wire::FrameHeader huge = data;
  huge.length = 1ull << 30;
  std::vector<uint8_t> hugeTruncated(sizeof(huge) + 10, 0x33);
  std::memcpy(hugeTruncated.data(), &huge, sizeof(huge));
  std::vector<Case> cases = {
      {"garbage", std::vector<uint8_t>(64, 0x5a), "sent malformed bytes: bad magic"},
      {"truncated", truncated, "in the middle of a frame"},
      {"1 GiB announced, 10 bytes sent", hugeTruncated, "10 of 1073741824 payload bytes"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string root = LoopbackRoot();
    auto outcomes = RunProcesses(3, [&](int rank) {
      if (rank == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // after the job is up
        Impostor(root, c.tail.data(), c.tail.size());
        return 0;
      }
      SocketBootstrap b(rank, 2);
      b.Initialize(root, 10);
      if (rank == 0) {
        int v;
        ErrorCode code{};
        ThrowsMentioning([&] { b.Recv(&v, sizeof(v), 1, 4); }, c.expect, &code);
        EXPECT_EQ(code, ErrorCode::RemoteFailure);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // stays alive, sends nothing
      }
      return 0;
    });
    test::ExpectAllSucceed(outcomes);
  }
}

// A connection that never says who it is is closed after the bootstrap's timeout; the job goes on.
TEST(BootstrapFailures, ASilentStrangerIsClosedAfterFiveSeconds) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    if (rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      net::SocketAddress a = net::SocketAddress::Parse(root);
      UniqueFd fd = net::ConnectWithRetry(a, Deadline::After(10), "test target");
      // Held open, silent, until the root has closed it (a read sees the end) or 10 s.
      char c;
      net::SetNonBlocking(fd.Get(), false);
      timeval tv{10, 0};
      setsockopt(fd.Get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      return recv(fd.Get(), &c, 1, 0) == 0 ? 0 : 1;  // 0: closed by the root
    }
    SocketBootstrap b(rank, 2);
    testing::internal::CaptureStderr();
    b.Initialize(root, 15);
    // Rank 0 waits in the all-gather (where connections are served) while rank 1 is 6 s late.
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(6000));
    ExpectJobWentOn(b, rank, "sent no hello within 5 s");
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A peer that sends more than MORI_BOOTSTRAP_MAX_PENDING bytes nobody receives is dropped, and whoever waits
// for it hears why.
TEST(BootstrapFailures, APeerFloodingUnreceivedMessagesIsDropped) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(2, [&](int rank) {
    setenv("MORI_BOOTSTRAP_MAX_PENDING", "1m", 1);
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 10);
    if (rank == 1) {
      std::vector<uint8_t> big(512 << 10, 0x42);
      try {
        for (int i = 0; i < 3; ++i) b.Send(big.data(), big.size(), 0, 9);
      } catch (const Error&) {
        // the root may have closed the connection before the last one went
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return 0;
    }
    int v;
    ErrorCode code{};
    ThrowsMentioning([&] { b.Recv(&v, sizeof(v), 1, 4); }, "were not received yet", &code);
    EXPECT_EQ(code, ErrorCode::RemoteFailure);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(BootstrapFailures, AProcessOfAnotherJobIsRefused) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    if (rank == 2) {
      // Same root address, different nonce: it must not take rank 1's place.
      UniqueId foreign = SocketBootstrap::UniqueIdFromAddress(root);
      foreign.bytes[8] ^= 0xff;  // the nonce
      SocketBootstrap b(1, 2);
      ThrowsMentioning([&] { b.Initialize(foreign, 10); }, "closed the connection");
      return 0;
    }
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the stranger comes first
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 20);
    auto all = b.AllGatherValue(rank);
    EXPECT_EQ(all[1], 1);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(BootstrapFailures, InconsistentWorldSizesAbortWithTheReason) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(2, [&](int rank) {
    SocketBootstrap b(rank, rank == 0 ? 2 : 3);
    ErrorCode code{};
    ThrowsMentioning([&] { b.Initialize(root, 10); }, "rank 1 was started with world size 3", &code);
    EXPECT_EQ(code, rank == 0 ? ErrorCode::InvalidUsage : ErrorCode::RemoteFailure);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(BootstrapFailures, TwoProcessesClaimingOneRankAbort) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int proc) {
    int rank = proc == 0 ? 0 : 1;
    SocketBootstrap b(rank, 3);
    ThrowsMentioning([&] { b.Initialize(root, 10); }, "two processes registered as rank 1");
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(BootstrapLaunch, MoriVariablesStartAJob) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    setenv("MORI_RANK", std::to_string(rank).c_str(), 1);
    setenv("MORI_WORLD_SIZE", "3", 1);
    setenv("MORI_BOOTSTRAP_ADDR", root.c_str(), 1);
    auto b = CreateBootstrapFromEnvironment(30);
    auto all = b->AllGatherValue(rank * rank);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(all[r], r * r);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(BootstrapLaunch, TorchrunVariablesStartAJob) {
  int port = test::FreeTcpPort();
  auto outcomes = RunProcesses(2, [&](int rank) {
    unsetenv("MORI_RANK");
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "localhost", 1);
    setenv("MASTER_PORT", std::to_string(port - 1).c_str(), 1);  // the root takes MASTER_PORT + 1
    auto b = CreateBootstrapFromEnvironment(30);
    auto all = b->AllGatherValue(rank + 7);
    EXPECT_EQ(all[0], 7);
    EXPECT_EQ(all[1], 8);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

}  // namespace
}  // namespace mori::core
