// Same-host memory sharing between processes: descriptors over Unix sockets, and memory that each
// process maps from the others and writes with its own kernels, seen both ways. On HOST the memory is
// memfd-backed; on CUDA it is GPU memory (each process on its own GPU), shared as VMM file descriptors
// or legacy IPC handles (MORI_CUDA_IPC), written by kernels straight across NVLink.
#include <gtest/gtest.h>

#include <dirent.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/ipc.hpp"
#include "mori/core/ipc_memory.hpp"
#include "mori/core/kernel.hpp"

namespace mori::core {
namespace {

using test::FirstPatternMismatch;
using test::PatternByte;

using test::LoopbackRoot;

// Writes the pattern of (rank, seed) into dst, grid-stride: a kernel storing into another process's memory.
MORI_GLOBAL void WritePattern(uint8_t* dst, size_t bytes, int rank, uint32_t seed) {
  for (size_t i = GlobalThreadIdx(); i < bytes; i += GlobalThreadCount()) dst[i] = PatternByte(rank, i, seed);
}

int SelectDevice(const HostTopology& topo) {
  int n = 0;
  MORI_CHECK_GPU(GpuGetDeviceCount(&n));
  int dev = topo.localRank % n;
  MORI_CHECK_GPU(GpuSetDevice(dev));
  return dev;
}

std::vector<uint8_t> ReadBack(const void* src, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  MORI_CHECK_GPU(GpuMemcpy(out.data(), src, bytes));
  return out;
}

struct SharingCase {
  int ranks;
  const char* cudaIpc;  // MORI_CUDA_IPC for the CUDA backend
};

class MemorySharing : public ::testing::TestWithParam<SharingCase> {
 protected:
  void SetUp() override {
    gpus_ = test::ProbeGpuCount();
    if (gpus_ == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
#if MORI_BACKEND_GPU
    if (gpus_ < 2) GTEST_SKIP() << "needs two GPUs, " << gpus_ << " visible";
#endif
  }
  int gpus_ = 0;
};

TEST_P(MemorySharing, KernelsWriteIntoPeersAndEveryoneSeesIt) {
  const SharingCase c = GetParam();
  const std::string root = LoopbackRoot();
  constexpr size_t kChunk = (256 << 10) + 123;  // odd size: no alignment luck
  auto outcomes = test::RunProcesses(c.ranks, [&](int rank) {
    setenv("MORI_CUDA_IPC", c.cudaIpc, 1);
    SocketBootstrap b(rank, c.ranks);
    b.Initialize(root, 60);
    HostTopology topo = DiscoverHostTopology(b);
    EXPECT_EQ(topo.localSize, c.ranks);
    EXPECT_EQ(topo.localRank, rank);
    SelectDevice(topo);
    FdChannel channel(b);

    // Region r of my buffer is where rank r writes; it starts with my own pattern (seed 1).
    const size_t bytes = kChunk * c.ranks;
    GpuBuffer mine(bytes);
    LaunchKernel(WritePattern, Dim3(8), Dim3(128), 0, nullptr, mine.DataAs<uint8_t>(), bytes, rank, 1u);
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    b.Barrier();

    auto peers = ExchangeIpcMemory(b, topo, channel, mine.Data(), bytes);
    for (int r = 0; r < c.ranks; ++r) {
      if (r == rank) {
        EXPECT_EQ(peers[r], nullptr);
        continue;
      }
      if (peers[r] == nullptr) {
        ADD_FAILURE() << "rank " << r << "'s memory was not mapped";
        return 1;
      }
      EXPECT_EQ(peers[r]->Bytes(), bytes);
      EXPECT_EQ(peers[r]->Handle().ownerRank, r);
      // Read the peer's memory as the peer left it.
      auto seen = ReadBack(peers[r]->Data(), bytes);
      EXPECT_EQ(FirstPatternMismatch(seen.data(), bytes, r, 1), bytes) << "reading rank " << r << "'s memory";
    }
    b.Barrier();  // every rank has read the original contents

    // Write my region of every peer's buffer with a kernel: seed encodes the receiver.
    for (int r = 0; r < c.ranks; ++r) {
      if (r == rank) continue;
      auto* region = static_cast<uint8_t*>(peers[r]->Data()) + kChunk * rank;
      LaunchKernel(WritePattern, Dim3(4), Dim3(64), 0, nullptr, region, kChunk, rank, 100u + r);
    }
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    b.Barrier();  // all writes done

    auto now = ReadBack(mine.Data(), bytes);
    for (int r = 0; r < c.ranks; ++r) {
      const uint8_t* region = now.data() + kChunk * r;
      if (r == rank) {
        // Nobody writes my own region: it still holds my pattern at its original offsets.
        for (size_t i = 0; i < kChunk; ++i) {
          if (region[i] != PatternByte(rank, kChunk * r + i, 1)) {
            ADD_FAILURE() << "my own region was touched at byte " << i;
            break;
          }
        }
      } else {
        EXPECT_EQ(FirstPatternMismatch(region, kChunk, r, 100u + rank), kChunk) << "region written by rank " << r;
      }
    }
    b.Barrier();  // nobody unmaps while a peer may still read
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

std::vector<SharingCase> SharingCases() {
#if MORI_BACKEND_CUDA
  return {{2, "auto"}, {2, "legacy"}, {4, "auto"}};
#else
  return {{2, "auto"}, {4, "auto"}};
#endif
}

INSTANTIATE_TEST_SUITE_P(Ranks, MemorySharing, ::testing::ValuesIn(SharingCases()),
                         [](const testing::TestParamInfo<SharingCase>& p) {
                           return "np" + std::to_string(p.param.ranks) + "_" + p.param.cudaIpc;
                         });

TEST(FdChannelTest, DescriptorsAndPayloadsReachTheRightPeerAndTag) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(3, [&](int rank) {
    SocketBootstrap b(rank, 3);
    b.Initialize(root, 30);
    FdChannel channel(b);
    // Each rank sends every other rank a pipe's read end with two tags, in the reverse order of receipt.
    std::vector<UniqueFd> writeEnds;
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == rank) continue;
      for (uint64_t tag : {7u, 3u}) {
        int fds[2];
        EXPECT_EQ(pipe(fds), 0);
        uint64_t payload = rank * 1000 + peer * 10 + tag;
        channel.Send(peer, tag, fds[0], &payload, sizeof(payload));
        close(fds[0]);
        uint32_t token = static_cast<uint32_t>(payload) ^ 0xabcd;
        EXPECT_EQ(write(fds[1], &token, sizeof(token)), static_cast<ssize_t>(sizeof(token)));
        writeEnds.emplace_back(fds[1]);
      }
    }
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == rank) continue;
      for (uint64_t tag : {3u, 7u}) {
        uint64_t payload = 0;
        UniqueFd fd = channel.Recv(peer, tag, &payload, sizeof(payload));
        EXPECT_EQ(payload, static_cast<uint64_t>(peer * 1000 + rank * 10 + tag));
        if (!fd.Valid()) {
          ADD_FAILURE() << "no descriptor from rank " << peer;
          return 1;
        }
        uint32_t token = 0;
        EXPECT_EQ(read(fd.Get(), &token, sizeof(token)), static_cast<ssize_t>(sizeof(token)));
        EXPECT_EQ(token, static_cast<uint32_t>(payload) ^ 0xabcd) << "the descriptor is the sender's pipe";
      }
    }
    b.Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(FdChannelTest, ForeignDatagramsAreDroppedAndMissingMessagesTimeOut) {
  const std::vector<pid_t> pids{getpid(), getpid()};  // both ranks are this process
  FdChannel channel(0x1234, 0, pids);
  // A stranger writes junk (with a descriptor) to our socket address.
  int junkFd = socket(AF_UNIX, SOCK_DGRAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  int n = std::snprintf(addr.sun_path + 1, sizeof(addr.sun_path) - 1, "mori-ipc-%016llx-%d", 0x1234ull, 0);
  const char junk[] = "not a mori message at all, just bytes";
  ASSERT_GE(sendto(junkFd, junk, sizeof(junk), 0, reinterpret_cast<sockaddr*>(&addr),
                   static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)),
            0);
  close(junkFd);
  // A real message from "rank 1" of the same job follows and must still be delivered.
  FdChannel peer(0x1234, 1, pids);
  uint32_t value = 0xfeedface;
  peer.Send(0, 5, -1, &value, sizeof(value));
  testing::internal::CaptureStderr();
  uint32_t got = 0;
  UniqueFd none = channel.Recv(1, 5, &got, sizeof(got), Deadline::After(5));
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(got, 0xfeedfaceu);
  EXPECT_FALSE(none.Valid());
  EXPECT_NE(log.find("dropped a malformed IPC message"), std::string::npos) << log;
  try {
    channel.Recv(1, 6, &got, sizeof(got), Deadline::After(0.3));
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("from rank 1, which never came"), std::string::npos) << e.what();
  }
  // Sending to a rank whose socket does not exist ends at the bound, naming the rank.
  EXPECT_THROW(peer.Send(7, 1, -1, &value, sizeof(value), Deadline::After(0.2)), TimeoutError);
  // A size mismatch is reported with both sizes.
  peer.Send(0, 8, -1, &value, sizeof(value));
  uint64_t wide;
  EXPECT_THROW(channel.Recv(1, 8, &wide, sizeof(wide), Deadline::After(5)), Error);
}

// Descriptors this process has open (the listing's own descriptor included, the same in every count).
int OpenFdCount() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n;
}

// A job id of its own, so that a concurrent run of these tests binds other names.
uint64_t FreshJobId() {
  std::random_device random;
  return random() * 0x100000001ull + 1;
}

constexpr int kCannotSwitchUid = 7;

// Runs a process outside the job (forked from this one, so of a pid no rank has) that binds rank 1's name while
// it is free and sends rank 0 a message with `tag`, carrying a pipe whose other end it writes a token into,
// as rank 1 would. With `uid` >= 0 it first drops to that uid. Returns the stranger's pid; 0 if it could not
// switch uids.
pid_t StrangerSendsAsRank1(uint64_t job, uint64_t tag, int uid) {
  const pid_t jobPid = getpid();
  int pidPipe[2];
  EXPECT_EQ(pipe(pidPipe), 0);
  auto outcome = test::RunProcesses(
      1,
      [&](int) {
        close(pidPipe[0]);
        if (uid >= 0) {
          if (setgroups(0, nullptr) != 0 || setresgid(uid, uid, uid) != 0) return kCannotSwitchUid;
          if (setresuid(uid, uid, uid) != 0) return kCannotSwitchUid;
        }
        pid_t me = getpid();
        if (write(pidPipe[1], &me, sizeof(me)) != static_cast<ssize_t>(sizeof(me))) return 2;
        FdChannel impostor(job, 1, {jobPid, me});
        int fds[2];
        if (pipe(fds) != 0) return 2;
        uint32_t forged = 0xbadbad00u;
        impostor.Send(0, tag, fds[0], &forged, sizeof(forged), Deadline::After(10));
        return 0;
      },
      30);
  close(pidPipe[1]);
  pid_t stranger = 0;
  if (outcome[0].exitCode == kCannotSwitchUid) {
    close(pidPipe[0]);
    return 0;
  }
  test::ExpectAllSucceed(outcome);
  EXPECT_EQ(read(pidPipe[0], &stranger, sizeof(stranger)), static_cast<ssize_t>(sizeof(stranger)));
  close(pidPipe[0]);
  return stranger;
}

// Waits (boundedly) for rank 1's message on `tag` where only a refused one came: the timeout names the refusal.
std::string RecvRefused(FdChannel& channel, uint64_t tag) {
  uint32_t got = 0;
  try {
    channel.Recv(1, tag, &got, sizeof(got), Deadline::After(0.5));
    ADD_FAILURE() << "a stranger's message was taken as rank 1's (payload 0x" << std::hex << got << ")";
    return "";
  } catch (const TimeoutError& e) {
    return e.what();
  }
}

// Abstract socket names can be read from /proc/net/unix: a process of the same uid that is not in the job can
// learn them and send. What it sends is dropped, its descriptor closed, and rank 1 itself is still heard.
TEST(FdChannelTest, AProcessOutsideTheJobIsRefusedAndItsDescriptorClosed) {
  const uint64_t job = FreshJobId();
  const pid_t me = getpid();
  const std::vector<pid_t> pids{me, me};  // ranks 0 and 1 are this process
  FdChannel channel(job, 0, pids);
  const int fdsBefore = OpenFdCount();
  const pid_t stranger = StrangerSendsAsRank1(job, 5, -1);
  ASSERT_GT(stranger, 0);

  testing::internal::CaptureStderr();
  const std::string timeout = RecvRefused(channel, 5);
  const std::string log = testing::internal::GetCapturedStderr();
  const std::string cause = "from pid " + std::to_string(stranger) + " (uid " + std::to_string(getuid()) +
                            "): it claims to be rank 1, whose pid is " + std::to_string(me);
  EXPECT_NE(timeout.find("refused: " + cause), std::string::npos) << timeout;
  EXPECT_NE(log.find("refused an IPC message (tag 5) " + cause + "; the descriptor that came with it is closed"),
            std::string::npos)
      << log;
  EXPECT_EQ(OpenFdCount(), fdsBefore) << "the stranger's pipe is still open here";

  // Rank 1 itself, on the same tag: its payload and its pipe come through, with the kernel's word on the sender.
  FdChannel rank1(job, 1, pids);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  UniqueFd writeEnd(fds[1]);
  const uint32_t value = 0x600dd00du;
  rank1.Send(0, 5, fds[0], &value, sizeof(value), Deadline::After(10));
  close(fds[0]);
  ASSERT_EQ(write(writeEnd.Get(), &value, sizeof(value)), static_cast<ssize_t>(sizeof(value)));
  uint32_t got = 0;
  IpcSender sender;
  UniqueFd fd = channel.Recv(1, 5, &got, sizeof(got), Deadline::After(10), &sender);
  EXPECT_EQ(got, value);
  EXPECT_EQ(sender.rank, 1);
  EXPECT_EQ(sender.pid, me);
  EXPECT_EQ(sender.uid, getuid());
  ASSERT_TRUE(fd.Valid());
  uint32_t token = 0;
  EXPECT_EQ(read(fd.Get(), &token, sizeof(token)), static_cast<ssize_t>(sizeof(token)));
  EXPECT_EQ(token, value) << "the descriptor is rank 1's pipe";
}

// Abstract sockets take datagrams from any uid. A sender under another uid is refused for it.
TEST(FdChannelTest, ASenderUnderAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a sender under another uid";
  const uint64_t job = FreshJobId();
  FdChannel channel(job, 0, {getpid(), getpid()});
  const int fdsBefore = OpenFdCount();
  constexpr int kNobody = 65534;
  const pid_t stranger = StrangerSendsAsRank1(job, 6, kNobody);
  if (stranger == 0) GTEST_SKIP() << "cannot switch a child to uid " << kNobody << " here";
  testing::internal::CaptureStderr();
  const std::string timeout = RecvRefused(channel, 6);
  const std::string log = testing::internal::GetCapturedStderr();
  const std::string cause = "from pid " + std::to_string(stranger) + " (uid 65534): the sender runs as uid 65534, "
                            "this job as uid " + std::to_string(getuid());
  EXPECT_NE(timeout.find(cause), std::string::npos) << timeout;
  EXPECT_NE(log.find("refused an IPC message (tag 6) " + cause), std::string::npos) << log;
  EXPECT_EQ(OpenFdCount(), fdsBefore) << "the stranger's pipe is still open here";
}

class HeapExchangeTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if !MORI_BACKEND_HOST
    GTEST_SKIP() << "the stranger is a fork of a rank, and a forked process cannot use the GPU runtime";
#endif
  }
};

// A fork of rank 1 has rank 1's socket, name and memory but not its pid. The handle it offers before rank 1's
// own is refused, and rank 0 maps rank 1's memory, every byte of it.
TEST_F(HeapExchangeTest, OnlyTheRankItselfCanOfferItsMemory) {
  const std::string root = LoopbackRoot();
  constexpr size_t kBytes = 3 * 4096 + 321;
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 30);
    HostTopology topo = DiscoverHostTopology(b);
    FdChannel channel(b);
    GpuBuffer mine(kBytes);
    test::FillPattern(mine.Data(), kBytes, rank, 7);
    if (rank == 1) {
      auto stranger = test::RunProcesses(
          1,
          [&](int) {
            GpuBuffer bait(kBytes);
            test::FillPattern(bait.Data(), kBytes, 9, 7);
            UniqueFd fd;
            IpcMemoryHandle h = ExportIpcMemory(bait.Data(), kBytes, &fd);
            h.ownerRank = 1;
            h.ownerPid = static_cast<uint64_t>(getppid());  // rank 1's, to the letter
            channel.Send(0, 0, fd.Get(), &h, sizeof(h), Deadline::After(10));
            return 0;
          },
          30);
      test::ExpectAllSucceed(stranger);
    }
    b.Barrier();  // the stranger's message is queued at rank 0, ahead of rank 1's
    if (rank == 0) testing::internal::CaptureStderr();
    auto peers = ExchangeIpcMemory(b, topo, channel, mine.Data(), kBytes);
    const int other = 1 - rank;
    if (peers[other] == nullptr) {
      if (rank == 0) testing::internal::GetCapturedStderr();
      ADD_FAILURE() << "rank " << other << "'s memory was not mapped";
      return 1;
    }
    EXPECT_EQ(peers[other]->Handle().ownerPid, static_cast<uint64_t>(channel.RankPid(other)));
    EXPECT_EQ(FirstPatternMismatch(peers[other]->Data(), kBytes, other, 7), kBytes) << "rank " << other << "'s memory";
    if (rank == 0) {
      const std::string log = testing::internal::GetCapturedStderr();
      EXPECT_NE(log.find("refused an IPC message (tag 0) from pid "), std::string::npos) << log;
      EXPECT_NE(log.find("it claims to be rank 1, whose pid is " + std::to_string(channel.RankPid(1))),
                std::string::npos)
          << log;
    }
    b.Barrier();  // nobody unmaps while a peer may still read
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Rank 1 itself sends a handle that names another process as the memory's owner: the exchange refuses it,
// naming the pid the handle claims and the pid it came from.
TEST_F(HeapExchangeTest, AHandleMustNameTheProcessItCameFrom) {
  const std::string root = LoopbackRoot();
  constexpr size_t kBytes = 8192;
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 30);
    HostTopology topo = DiscoverHostTopology(b);
    FdChannel channel(b);
    GpuBuffer mine(kBytes);
    test::FillPattern(mine.Data(), kBytes, rank, 3);
    const pid_t claimed = getppid();  // the test runner: on this host, in no rank
    if (rank == 1) {
      UniqueFd fd;
      IpcMemoryHandle h = ExportIpcMemory(mine.Data(), kBytes, &fd);
      h.ownerRank = 1;
      h.ownerPid = static_cast<uint64_t>(claimed);
      channel.Send(0, 0, fd.Get(), &h, sizeof(h), Deadline::After(10));
    } else {
      try {
        ExchangeIpcMemory(b, topo, channel, mine.Data(), kBytes);
        ADD_FAILURE() << "a handle naming pid " << claimed << " was mapped";
      } catch (const Error& e) {
        EXPECT_EQ(e.Code(), ErrorCode::Protocol) << e.what();
        const std::string want = "names rank 1 (pid " + std::to_string(claimed) +
                                 ") as its owner, but it came from pid " + std::to_string(channel.RankPid(1));
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
    b.Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A legacy CUDA/HIP IPC handle opens the whole allocation it was made for, whatever sizes it claims. A claim
// beyond what the driver reports for that allocation is refused after opening (and closed again); the true
// handle maps and reads the owner's pattern.
TEST(LegacyIpcHandle, ARangeBeyondTheRealAllocationIsRefused) {
#if !MORI_BACKEND_GPU
  GTEST_SKIP() << "legacy IPC handles exist on CUDA and HIP only";
#else
  if (test::ProbeGpuCount() == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  const std::string root = LoopbackRoot();
  constexpr size_t kBytes = (1 << 20) + 77;
  constexpr int kNotLegacy = 9;
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    setenv("MORI_CUDA_IPC", "legacy", 1);
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    HostTopology topo = DiscoverHostTopology(b);
    SelectDevice(topo);  // with one GPU both ranks share it, which legacy IPC allows between processes
    FdChannel channel(b);
    GpuBuffer mine(kBytes);
    std::vector<uint8_t> pattern(kBytes);
    test::FillPattern(pattern.data(), kBytes, rank, 5);
    MORI_CHECK_GPU(GpuMemcpy(mine.Data(), pattern.data(), kBytes));
    int code = 0;
    if (rank == 1) {
      UniqueFd fd;
      IpcMemoryHandle h = ExportIpcMemory(mine.Data(), kBytes, &fd);
      h.ownerRank = 1;
      auto kind = static_cast<IpcMemoryKind>(h.kind);
      if (kind != IpcMemoryKind::CudaLegacy && kind != IpcMemoryKind::HipLegacy) code = kNotLegacy;
      IpcMemoryHandle inflated = h;
      inflated.allocationBytes = h.allocationBytes + (1ull << 30);
      inflated.bytes = inflated.allocationBytes;
      channel.Send(0, 1, -1, &inflated, sizeof(inflated));
      channel.Send(0, 2, -1, &h, sizeof(h));
    } else {
      IpcMemoryHandle inflated, h;
      channel.Recv(1, 1, &inflated, sizeof(inflated));
      channel.Recv(1, 2, &h, sizeof(h));
      if (h.kind == static_cast<uint32_t>(IpcMemoryKind::CudaLegacy) ||
          h.kind == static_cast<uint32_t>(IpcMemoryKind::HipLegacy)) {
        try {
          IpcMemoryMapping::Import(inflated, UniqueFd());
          ADD_FAILURE() << "a handle claiming " << inflated.bytes << " bytes was mapped";
        } catch (const Error& e) {
          EXPECT_EQ(e.Code(), ErrorCode::Protocol) << e.what();
          const std::string want = "claims [0, +" + std::to_string(inflated.bytes) + ") of a " +
                                   std::to_string(inflated.allocationBytes) + "-byte allocation, but what it opened";
          EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        }
        auto mapping = IpcMemoryMapping::Import(h, UniqueFd());
        EXPECT_EQ(FirstPatternMismatch(ReadBack(mapping->Data(), kBytes).data(), kBytes, 1, 5), kBytes);
      } else {
        code = kNotLegacy;
      }
    }
    b.Barrier();  // rank 1 frees nothing while rank 0 may still read
    return code;
  });
  if (outcomes[0].exitCode == kNotLegacy || outcomes[1].exitCode == kNotLegacy) {
    GTEST_SKIP() << "MORI_CUDA_IPC=legacy did not give legacy handles";
  }
  test::ExpectAllSucceed(outcomes);
#endif
}

}  // namespace
}  // namespace mori::core
