// Same-host memory sharing between processes: descriptors over Unix sockets, and memory that each
// process maps from the others and writes with its own kernels, seen both ways. On HOST the memory is
// memfd-backed; on CUDA it is GPU memory (each process on its own GPU), shared as VMM file descriptors
// or legacy IPC handles (MORI_CUDA_IPC), written by kernels straight across NVLink.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
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
  FdChannel channel(0x1234, 0);
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
  FdChannel peer(0x1234, 1);
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

}  // namespace
}  // namespace mori::core
