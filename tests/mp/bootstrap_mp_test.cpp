// The socket bootstrap with several processes on loopback: every operation with rank- and
// index-dependent data, and every failure the issue names: a rank that never comes, a peer that dies,
// garbage and truncated frames, a process of another job, inconsistent world sizes, duplicate ranks, and
// strangers who know the root's address (with and without MORI_BOOTSTRAP_SECRET).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
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

// MORI_BOOTSTRAP_JOIN_TIMEOUT_S bounds the join alone: a rank that starts 3.5 s after the others joins a job
// whose bound is 2 s, and the waits after the join keep those 2 s (rank 1 gives up on rank 2, alive but silent,
// after 2 s, not after the join's 30).
TEST(BootstrapFailures, ALateRankJoinsWithinTheJoinBoundWhileLaterWaitsKeepTheirs) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    setenv("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", "30", 1);
    if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(3500));
    SocketBootstrap b(rank, 3);
    b.Initialize(root, 2);
    EXPECT_DOUBLE_EQ(b.TimeoutSeconds(), 2.0);
    auto all = b.AllGatherValue(rank * 7 + 3);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(all[r], r * 7 + 3) << "slot of rank " << r;
    if (rank == 1) {
      int v = 0;
      ErrorCode code{};
      const auto start = std::chrono::steady_clock::now();
      ThrowsMentioning([&] { b.Recv(&v, sizeof(v), 2, 5); }, "rank 1 waited 2 s for a", &code);
      EXPECT_EQ(code, ErrorCode::Timeout);
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "the join's bound was used";
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(7));  // alive and silent until rank 1 gave up
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A join that outlasts MORI_BOOTSTRAP_JOIN_TIMEOUT_S fails at that bound, naming the variable, though the
// bootstrap's own bound is 60 s.
TEST(BootstrapFailures, AJoinPastItsBoundNamesTheVariable) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    if (rank == 2) return 0;  // never starts its bootstrap
    setenv("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", rank == 0 ? "1" : "2", 1);
    SocketBootstrap b(rank, 3);
    ErrorCode code{};
    const auto start = std::chrono::steady_clock::now();
    if (rank == 0) {
      ThrowsMentioning([&] { b.Initialize(root, 60); }, "waited 1 s (the join's bound, from "
                       "MORI_BOOTSTRAP_JOIN_TIMEOUT_S); rank(s) 2 of 3 never registered", &code);
      EXPECT_EQ(code, ErrorCode::Timeout);
    } else {
      // Told by the root when it gave up, or at its own 2 s if that comes first.
      ThrowsMentioning([&] { b.Initialize(root, 60); }, "bootstrap root", &code);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A rank whose root never comes gives up at the join's bound and says where the bound came from.
TEST(BootstrapFailures, ARankPastItsJoinBoundNamesWhereTheBoundCameFrom) {
  const std::string root = LoopbackRoot();
  test::ScopedEnv join("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", "1");
  SocketBootstrap b(1, 2);
  ErrorCode code{};
  const auto start = std::chrono::steady_clock::now();
  ThrowsMentioning([&] { b.Initialize(root, 60); }, "(the join's bound, from MORI_BOOTSTRAP_JOIN_TIMEOUT_S)", &code);
  EXPECT_EQ(code, ErrorCode::Timeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // Without the variable the caller's bound is the join's, and the message says so.
  test::ScopedEnv unset("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", nullptr);
  SocketBootstrap c(1, 2);
  ThrowsMentioning([&] { c.Initialize(root, 0.5); }, "(the join's bound, from the bound given to Initialize)", &code);
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

// A one-way message between the forked processes of a test: a pipe made before the fork.
class Signal {
 public:
  Signal() { EXPECT_EQ(pipe2(fds_, O_CLOEXEC), 0); }
  ~Signal() {
    close(fds_[0]);
    close(fds_[1]);
  }
  Signal(const Signal&) = delete;
  Signal& operator=(const Signal&) = delete;

  void Post(const std::string& text = "go") {
    EXPECT_EQ(write(fds_[1], text.data(), text.size()), static_cast<ssize_t>(text.size()));
  }
  // What was posted, waiting at most `seconds`; a test failure and "" when nothing came.
  std::string Await(double seconds = 20) {
    pollfd p{fds_[0], POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(seconds * 1000)) != 1) {
      ADD_FAILURE() << "no signal within " << seconds << " s";
      return "";
    }
    char buf[256];
    ssize_t n = read(fds_[0], buf, sizeof(buf));
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

 private:
  int fds_[2] = {-1, -1};
};

// Rank `rank` of `n` launched by the MORI_* variables, with `secret` (nullptr: none).
void SetMoriLaunch(int rank, int n, const std::string& root, const char* secret) {
  setenv("MORI_RANK", std::to_string(rank).c_str(), 1);
  setenv("MORI_WORLD_SIZE", std::to_string(n).c_str(), 1);
  setenv("MORI_BOOTSTRAP_ADDR", root.c_str(), 1);
  if (secret != nullptr) {
    setenv("MORI_BOOTSTRAP_SECRET", secret, 1);
  } else {
    unsetenv("MORI_BOOTSTRAP_SECRET");
  }
}

// An all-gather of 4 KiB per rank whose every byte depends on rank, index and `seed`, checked whole.
void ExpectExactAllGather(Bootstrap& b, uint32_t seed) {
  const size_t per = 4096;
  const int n = b.GetNranks();
  std::vector<uint8_t> all(per * n, 0);
  FillPattern(all.data() + per * b.GetRank(), per, b.GetRank(), seed);
  b.AllGather(all.data(), per);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(FirstPatternMismatch(all.data() + per * r, per, r, seed), per) << "slot of rank " << r;
  }
}

// The bytes of a hello (and of what follows it) as a process that claims `rank` of a 2-rank job would send.
std::vector<uint8_t> HelloBytes(uint64_t nonce, int rank, bootstrap_wire::HelloPurpose purpose) {
  bootstrap_wire::HelloPayload hello{};
  hello.nonce = nonce;
  hello.rank = rank;
  hello.nRanks = 2;
  hello.purpose = static_cast<uint32_t>(purpose);
  bootstrap_wire::FrameHeader h{};
  h.magic = bootstrap_wire::kFrameMagic;
  h.version = bootstrap_wire::kVersion;
  h.type = static_cast<uint16_t>(bootstrap_wire::FrameType::Hello);
  h.srcRank = rank;
  h.length = sizeof(hello);
  std::vector<uint8_t> bytes(sizeof(h) + sizeof(hello));
  std::memcpy(bytes.data(), &h, sizeof(h));
  std::memcpy(bytes.data() + sizeof(h), &hello, sizeof(hello));
  return bytes;
}

// A frame of `type` and `tag` from `rank` whose payload is `bytes` of a pattern no rank sends (seed `seed`).
void AppendFrame(std::vector<uint8_t>& out, bootstrap_wire::FrameType type, int rank, int tag, size_t bytes,
                 uint32_t seed) {
  bootstrap_wire::FrameHeader h{};
  h.magic = bootstrap_wire::kFrameMagic;
  h.version = bootstrap_wire::kVersion;
  h.type = static_cast<uint16_t>(type);
  h.srcRank = rank;
  h.tag = tag;
  h.length = bytes;
  size_t at = out.size();
  out.resize(at + sizeof(h) + bytes);
  std::memcpy(out.data() + at, &h, sizeof(h));
  FillPattern(out.data() + at + sizeof(h), bytes, 99, seed);
}

// The job nonce of a root address as anyone can compute it without the secret.
uint64_t PublicNonce(const std::string& root) { return bootstrap_wire::AddressNonce(root, ""); }

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// With MORI_BOOTSTRAP_SECRET a stranger who knows the root's address and computes the nonce from it (FNV-1a, as
// every job derived it before) cannot register as a rank nor open a data connection; the job's all-gather
// carries exactly the ranks' bytes, and the root does not call its bootstrap unauthenticated.
TEST(BootstrapSecret, AStrangerWhoKnowsOnlyTheAddressIsRefused) {
  const std::string root = LoopbackRoot();
  Signal strangerDone;
  auto outcomes = RunProcesses(3, [&](int proc) {
    if (proc == 2) {
      unsetenv("MORI_BOOTSTRAP_SECRET");
      UniqueId guessed = SocketBootstrap::UniqueIdFromAddress(root);  // no secret here: the public nonce
      // Registers as rank 1 before the real rank 1 comes.
      SocketBootstrap b(1, 2);
      ErrorCode code{};
      ThrowsMentioning([&] { b.Initialize(guessed, 10); }, "refused this rank's hello", &code);
      EXPECT_EQ(code, ErrorCode::RemoteFailure);
      // Then, as rank 1 on a data connection, the first all-gather step with bytes of its own.
      std::vector<uint8_t> bytes = HelloBytes(PublicNonce(root), 1, bootstrap_wire::HelloPurpose::Data);
      AppendFrame(bytes, bootstrap_wire::FrameType::Collective, 1, 0, 4096, 41);
      SendRaw(root, bytes.data(), bytes.size());
      strangerDone.Post();
      return 0;
    }
    if (proc == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the stranger comes first
    SetMoriLaunch(proc, 2, root, "a long random secret, the same for both ranks");
    testing::internal::CaptureStderr();
    auto b = CreateBootstrapFromEnvironment(20);
    if (proc == 0) strangerDone.Await();  // its data connection waits to be read in the all-gather
    ExpectExactAllGather(*b, 41);
    std::string log = testing::internal::GetCapturedStderr();
    if (proc == 0) {
      EXPECT_EQ(Count(log, "refused: job nonce"), 2u) << log;
      EXPECT_EQ(Count(log, "unauthenticated"), 0u) << log;
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Ranks given different secrets fail, each naming the mismatch, within MORI_TIMEOUT_S: the rank with the other
// secret at once (the root answers its hello), the root when its wait ends, and a rank that registered hears
// the root's reason. The rank that registered waits longer than the root, so the root speaks first.
TEST(BootstrapSecret, RanksWithDifferentSecretsFailNamingTheMismatch) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    SetMoriLaunch(rank, 3, root, rank == 2 ? "the secret of rank 2" : "the secret of ranks 0 and 1");
    setenv("MORI_TIMEOUT_S", rank == 1 ? "10" : "3", 1);
    auto start = std::chrono::steady_clock::now();
    std::string what;
    ErrorCode code{};
    try {
      CreateBootstrapFromEnvironment();
      ADD_FAILURE() << "rank " << rank << " started a job with mismatched secrets";
    } catch (const Error& e) {
      what = e.what();
      code = e.Code();
    }
    double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(what.find("MORI_BOOTSTRAP_SECRET"), std::string::npos) << what;
    EXPECT_LT(took, 8.0) << what;
    if (rank == 0) {
      EXPECT_EQ(code, ErrorCode::Timeout);
      EXPECT_NE(what.find("rank(s) 2 of 3 never registered"), std::string::npos) << what;
      EXPECT_NE(what.find("a registration as rank 2 from 127.0.0.1:"), std::string::npos) << what;
    } else if (rank == 2) {
      EXPECT_EQ(code, ErrorCode::RemoteFailure);
      EXPECT_NE(what.find("refused this rank's hello"), std::string::npos) << what;
      EXPECT_LT(took, 2.5) << "refused at once, not at the end of the wait: " << what;
    } else {
      EXPECT_EQ(code, ErrorCode::RemoteFailure);
      EXPECT_NE(what.find("the bootstrap root refused the job"), std::string::npos) << what;
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Without a secret the root says once that its bootstrap is open to anyone who reaches its port; the other
// ranks say nothing of it, and the job runs as it always did.
TEST(BootstrapSecret, WithoutOneTheRootWarnsOnce) {
  const std::string root = LoopbackRoot();
  auto outcomes = RunProcesses(3, [&](int rank) {
    SetMoriLaunch(rank, 3, root, nullptr);
    testing::internal::CaptureStderr();
    auto b = CreateBootstrapFromEnvironment(20);
    ExpectExactAllGather(*b, 43);
    b->Barrier();
    std::string log = testing::internal::GetCapturedStderr();
    if (rank == 0) {
      EXPECT_EQ(Count(log, "unauthenticated"), 1u) << log;
      EXPECT_EQ(Count(log, "anyone who can reach " + root + " can join"), 1u) << log;
      EXPECT_EQ(Count(log, "MORI_BOOTSTRAP_SECRET"), 1u) << log;
    } else {
      EXPECT_EQ(Count(log, "unauthenticated"), 0u) << log;
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A connection to `addr`, leaving from `fromIp` when given (its port chosen by the kernel).
UniqueFd ConnectFrom(const std::string& addr, const char* fromIp = nullptr) {
  std::optional<net::SocketAddress> from;
  if (fromIp != nullptr) from = net::SocketAddress::Parse(std::string(fromIp) + ":0");
  return net::ConnectWithRetry(net::SocketAddress::Parse(addr), Deadline::After(10), "test target", {from});
}

// Whether the other end closed `fd` (an orderly end or a reset) within `seconds`; what it sent is skipped.
bool AwaitClosed(int fd, double seconds) {
  Deadline deadline = Deadline::After(seconds);
  while (!deadline.Expired()) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, deadline.RemainingMs()) != 1) continue;
    char buf[512];
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

// Loopback is 127.0.0.0/8 on Linux, so a test can speak from a second local IP; not every sandbox allows it.
bool CanBindSecondLoopbackIp() {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  net::SocketAddress a = net::SocketAddress::Parse("127.0.0.2:0");
  return fd && bind(fd.Get(), a.Sockaddr(), a.Length()) == 0;
}

void ExpectPattern(const std::vector<uint8_t>& got, int rank, uint32_t seed) {
  EXPECT_EQ(FirstPatternMismatch(got.data(), got.size(), rank, seed), got.size()) << "seed " << seed;
}

// A stranger's data connection claiming rank 1 (from `fromIp`, or any local address) that carries rank 1's next
// message (tag 2), forged: posts the stranger's address, then expects the root to close the connection.
void ForgeRank1sData(const std::string& root, const char* fromIp, size_t bytes, Signal& strangerAddress,
                     const char* keptMessage) {
  std::vector<uint8_t> out = HelloBytes(PublicNonce(root), 1, bootstrap_wire::HelloPurpose::Data);
  AppendFrame(out, bootstrap_wire::FrameType::Data, 1, 2, bytes, 2);
  UniqueFd fd = ConnectFrom(root, fromIp);
  net::SendAll(fd.Get(), out.data(), out.size(), Deadline::After(10), "the root");
  strangerAddress.Post(net::LocalAddressOf(fd.Get()).ToString());
  EXPECT_TRUE(AwaitClosed(fd.Get(), 10)) << keptMessage;
}

// A second data connection claiming rank 1, from rank 1's own IP and with the job's nonce (no secret here, so
// anyone can compute it), while rank 1's real one is up: the root refuses and closes it with a line naming
// rank 1 and the peer's address. The frame it carried is not taken for rank 1's, and rank 1's own connection
// goes on carrying its messages.
TEST(BootstrapPeers, ASecondDataConnectionClaimingARankIsRefused) {
  const std::string root = LoopbackRoot();
  const size_t bytes = 3000;
  Signal rank1Connected, strangerAddress, strangerDone;
  auto outcomes = RunProcesses(3, [&](int proc) {
    if (proc == 2) {
      rank1Connected.Await();
      ForgeRank1sData(root, nullptr, bytes, strangerAddress, "the root kept the second connection of rank 1");
      strangerDone.Post();
      return 0;
    }
    SocketBootstrap b(proc, 2);
    testing::internal::CaptureStderr();
    b.Initialize(root, 20);
    std::vector<uint8_t> msg(bytes);
    if (proc == 1) {
      FillPattern(msg.data(), bytes, 1, 1);
      b.Send(msg.data(), bytes, 0, 1);
      strangerDone.Await();
      FillPattern(msg.data(), bytes, 1, 2);
      b.Send(msg.data(), bytes, 0, 2);
    } else {
      b.Recv(msg.data(), bytes, 1, 1);
      ExpectPattern(msg, 1, 1);
      rank1Connected.Post();
      std::string stranger = strangerAddress.Await();
      b.Recv(msg.data(), bytes, 1, 2);
      ExpectPattern(msg, 1, 2);
      std::string log = testing::internal::GetCapturedStderr();
      EXPECT_EQ(Count(log, "dropped a bootstrap connection from " + stranger +
                               ": refused: a second data connection claiming rank 1"),
                1u)
          << log;
      EXPECT_EQ(Count(log, "connection from rank 1 failed"), 0u) << log;
    }
    ExpectExactAllGather(b, 45);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A data connection claiming rank 1 from an IP that is not rank 1's in the address table (127.0.0.2, where
// rank 1 is at 127.0.0.1) is refused even before rank 1 has opened its own, and what it carried is not taken.
TEST(BootstrapPeers, ADataConnectionFromAnIpNotTheRanksIsRefused) {
  if (!CanBindSecondLoopbackIp()) GTEST_SKIP() << "cannot bind 127.0.0.2 here";
  const std::string root = LoopbackRoot();
  const size_t bytes = 3000;
  Signal rootUp, strangerAddress, strangerDone;
  auto outcomes = RunProcesses(3, [&](int proc) {
    if (proc == 2) {
      rootUp.Await();
      ForgeRank1sData(root, "127.0.0.2", bytes, strangerAddress, "the root kept a connection from another IP as "
                                                                  "rank 1's");
      strangerDone.Post();
      return 0;
    }
    SocketBootstrap b(proc, 2);
    testing::internal::CaptureStderr();
    b.Initialize(root, 20);
    std::vector<uint8_t> msg(bytes);
    if (proc == 1) {
      strangerDone.Await();  // rank 1 has sent nothing to rank 0 until now
      FillPattern(msg.data(), bytes, 1, 2);
      b.Send(msg.data(), bytes, 0, 2);
    } else {
      rootUp.Post();
      std::string stranger = strangerAddress.Await();
      EXPECT_EQ(stranger.rfind("127.0.0.2:", 0), 0u) << stranger;
      b.Recv(msg.data(), bytes, 1, 2);
      ExpectPattern(msg, 1, 2);
      std::string log = testing::internal::GetCapturedStderr();
      EXPECT_EQ(Count(log, "dropped a bootstrap connection from " + stranger +
                               ": refused: a data connection claiming rank 1 comes from 127.0.0.2, but rank 1 is "
                               "at 127.0.0.1:"),
                1u)
          << log;
    }
    ExpectExactAllGather(b, 47);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Strangers that connect and close (without a word, halfway through a header, after a hello claiming rank 1
// with the job's nonce while rank 1 is connected, after one claiming rank 0 itself, after one from another IP)
// mark no rank dead: only the end of a rank's accepted connection does that. Rank 1's next message arrives.
TEST(BootstrapPeers, StrangersThatConnectAndCloseMarkNoRankDead) {
  const std::string root = LoopbackRoot();
  const bool secondIp = CanBindSecondLoopbackIp();
  Signal rank1Connected, strangersDone;
  auto outcomes = RunProcesses(3, [&](int proc) {
    if (proc == 2) {
      rank1Connected.Await();
      const uint64_t nonce = PublicNonce(root);
      { UniqueFd silent = ConnectFrom(root); }  // opened and closed without a word
      bootstrap_wire::FrameHeader h{};
      h.magic = bootstrap_wire::kFrameMagic;
      SendRaw(root, &h, sizeof(h) / 2);
      std::vector<uint8_t> asRank1 = HelloBytes(nonce, 1, bootstrap_wire::HelloPurpose::Data);
      SendRaw(root, asRank1.data(), asRank1.size());
      std::vector<uint8_t> asRank0 = HelloBytes(nonce, 0, bootstrap_wire::HelloPurpose::Data);
      SendRaw(root, asRank0.data(), asRank0.size());
      if (secondIp) {
        UniqueFd fd = ConnectFrom(root, "127.0.0.2");
        net::SendAll(fd.Get(), asRank1.data(), asRank1.size(), Deadline::After(10), "the root");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the root reads every close first
      strangersDone.Post();
      return 0;
    }
    SocketBootstrap b(proc, 2);
    testing::internal::CaptureStderr();
    b.Initialize(root, 20);
    std::vector<uint8_t> msg(2000);
    if (proc == 1) {
      FillPattern(msg.data(), msg.size(), 1, 1);
      b.Send(msg.data(), msg.size(), 0, 1);
      strangersDone.Await();
      FillPattern(msg.data(), msg.size(), 1, 2);
      b.Send(msg.data(), msg.size(), 0, 2);
    } else {
      b.Recv(msg.data(), msg.size(), 1, 1);
      ExpectPattern(msg, 1, 1);
      rank1Connected.Post();
      b.Recv(msg.data(), msg.size(), 1, 2);  // serves the strangers while it waits
      ExpectPattern(msg, 1, 2);
      std::string log = testing::internal::GetCapturedStderr();
      EXPECT_EQ(Count(log, "dropped a bootstrap connection from 127.0.0."), secondIp ? 5u : 4u) << log;
      EXPECT_EQ(Count(log, "connection from rank"), 0u) << log;
    }
    ExpectExactAllGather(b, 49);
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

}  // namespace
}  // namespace mori::core
