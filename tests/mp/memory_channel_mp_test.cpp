// Memory channels between two forked processes over a CudaIpc connection: every device handle method from
// kernels of many threads and blocks, both directions at once (copies with odd sizes and unaligned offsets,
// semaphores over many rounds, LL16 and LL8 packets reusing one buffer), and the misuses that must fail
// naming the cause (ranges past the registered memory, a flag of 0, a signal that never comes, bad pieces).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/memory_channel.hpp"

namespace mori::core {
namespace {

using test::PatternByte;

constexpr int kMaxChannels = 4;

// ---- Kernels ----

enum CopyMode : int { kPut, kGet, kPutSameOffset, kGetSameOffset };

// One copy by the whole grid.
MORI_GLOBAL void CopyKernel(MemoryChannelDeviceHandle ch, int mode, uint64_t dstOffset, uint64_t srcOffset,
                            uint64_t bytes) {
  const unsigned t = GlobalThreadIdx(), n = GlobalThreadCount();
  switch (mode) {
    case kPut:
      ch.Put(dstOffset, srcOffset, bytes, t, n);
      break;
    case kGet:
      ch.Get(dstOffset, srcOffset, bytes, t, n);
      break;
    case kPutSameOffset:
      ch.Put(dstOffset, bytes, t, n);
      break;
    case kGetSameOffset:
      ch.Get(dstOffset, bytes, t, n);
      break;
  }
}

struct ChannelSet {
  MemoryChannelDeviceHandle ch[kMaxChannels];
};

// Rounds alternate between the ranks: the sender's block b writes this round's data into its source chunk,
// puts it into the peer's destination chunk and signals on channel b; the receiver's block b waits (or polls)
// on channel b and checks the chunk. errors[0] counts wrong bytes seen.
MORI_GLOBAL void PingPong(ChannelSet set, int rank, uint32_t rounds, uint64_t chunk, uint64_t srcBase, uint64_t dstBase,
                          unsigned* errors) {
  const unsigned b = BlockIdxX(), t = ThreadIdxX(), n = BlockDimX();
  MemoryChannelDeviceHandle ch = set.ch[b];
  auto* mine = static_cast<uint8_t*>(ch.src);
  const uint64_t srcOff = srcBase + b * chunk, dstOff = dstBase + b * chunk;
  for (uint32_t r = 0; r < rounds; ++r) {
    const uint32_t seed = 1000 + r;
    if (r % 2 == static_cast<uint32_t>(rank)) {
      for (uint64_t i = t; i < chunk; i += n) mine[srcOff + i] = PatternByte(rank, b * chunk + i, seed);
      SyncThreads();
      ch.Put(dstOff, srcOff, chunk, t, n);
      SyncThreads();  // every thread's stores precede the signal
      if (t == 0) ch.Signal();
    } else {
      if (t == 0) {
        if (r % 4 < 2) {
          ch.Wait();
        } else {
          SpinDeadline deadline(ch.semaphore.timeoutNs);
          while (!ch.Poll()) {
            MORI_DEVICE_ASSERT(!deadline.Expired(), "PingPong: rank %d block %u polled in vain for round %u", rank, b,
                               r);
            SpinPause();
          }
        }
      }
      SyncThreads();
      for (uint64_t i = t; i < chunk; i += n) {
        if (mine[dstOff + i] != PatternByte(1 - rank, b * chunk + i, seed)) {
          AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(errors, 1u);
        }
      }
      SyncThreads();  // the chunk is checked before this block signals (and the peer overwrites it) again
    }
  }
}

// Thread 0 signals `count` times on channel `which`.
MORI_GLOBAL void SignalTimes(ChannelSet set, int which, uint32_t count) {
  for (uint32_t i = 0; i < count; ++i) set.ch[which].Signal();
}

// Thread 0 polls until a poll fails (at most `limit` times); out = the number of successful polls.
MORI_GLOBAL void PollUntilEmpty(ChannelSet set, int which, uint32_t limit, uint32_t* out) {
  uint32_t got = 0;
  while (got < limit && set.ch[which].Poll()) ++got;
  *out = got;
}

template <typename P>
MORI_GLOBAL void SendPackets(MemoryChannelDeviceHandle ch, uint64_t packetOffset, uint64_t srcOffset, uint64_t bytes,
                             uint32_t flag) {
  ch.PutPackets<P>(packetOffset, srcOffset, bytes, GlobalThreadIdx(), GlobalThreadCount(), flag);
}

// Reversed thread numbering, so a thread's packets come from another block of the sender than its own index.
// GetPackets and UnpackPackets are separate kernels: hipcc 5.2's AMDGPU backend fails ("failed to annotate
// CFG") on both waiting loops behind one runtime branch.
template <typename P, bool kUseGet>
MORI_GLOBAL void ReceivePackets(MemoryChannelDeviceHandle ch, uint64_t dstOffset, uint64_t packetOffset, uint64_t bytes,
                                uint32_t flag) {
  const unsigned t = GlobalThreadCount() - 1 - GlobalThreadIdx(), n = GlobalThreadCount();
  if constexpr (kUseGet) {
    ch.GetPackets<P>(dstOffset, packetOffset, bytes, t, n, flag);
  } else {
    ch.UnpackPackets<P>(dstOffset, packetOffset, bytes, t, n, flag);
  }
}

// One block streams `rounds` rounds of packets each way with no host step between them: round r uses half
// r % 2 of the packet area and flag r + 1, so the half it writes holds the packets of round r - 2 (stale).
template <typename P>
MORI_GLOBAL void PacketStream(MemoryChannelDeviceHandle ch, int rank, uint32_t rounds, uint64_t bytes,
                              uint64_t srcOffset, uint64_t packetOffset, uint64_t dstOffset, unsigned* errors) {
  const unsigned t = ThreadIdxX(), n = BlockDimX();
  auto* mine = static_cast<uint8_t*>(ch.src);
  const uint64_t halfBytes = bytes / P::kDataBytes * sizeof(P);
  for (uint32_t r = 0; r < rounds; ++r) {
    const uint32_t seed = 5000 + r;
    for (uint64_t i = t; i < bytes; i += n) mine[srcOffset + i] = PatternByte(rank, i, seed);
    SyncThreads();
    const uint64_t half = packetOffset + (r % 2) * halfBytes;
    ch.PutPackets<P>(half, srcOffset, bytes, t, n, r + 1);
    ch.UnpackPackets<P>(dstOffset, half, bytes, n - 1 - t, n, r + 1);
    SyncThreads();
    for (uint64_t i = t; i < bytes; i += n) {
      if (mine[dstOffset + i] != PatternByte(1 - rank, i, seed)) {
        AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(errors, 1u);
      }
    }
    SyncThreads();
  }
}

// One misuse, chosen by `what`; each must trap before touching memory.
// HOST only (the test skips elsewhere: a trap ends a GPU context); hipcc 5.2's AMDGPU backend also fails
// ("failed to annotate CFG") on seven trapping paths in one switch.
MORI_GLOBAL void Misuse(MemoryChannelDeviceHandle ch, int what) {
#if MORI_BACKEND_HOST
  switch (what) {
    case 0:
      ch.Put(ch.dstBytes, 0, 8, 0, 1);
      break;  // starts at the peer's end
    case 1:
      ch.Put(0, ch.srcBytes - 4, 8, 0, 1);
      break;  // source runs 4 bytes over
    case 2:
      ch.Get(0, ch.dstBytes + 100, 1, 0, 1);
      break;  // peer offset past its end
    case 3:
      ch.PutPackets<LL16Packet>(ch.dstBytes - 16, 0, 16, 0, 1, 1);
      break;  // packets run over the peer
    case 4:
      ch.UnpackPackets<LL8Packet>(0, ch.packetBufferBytes, 4, 0, 1, 1);
      break;  // past the packet buffer
    case 5:
      ch.PutPackets<LL8Packet>(0, 0, 8, 0, 1, 0);
      break;  // flag 0
    case 6:
      ch.Wait();
      break;  // nobody signals
  }
#else
  (void)ch;
  (void)what;
#endif
}

// ---- Host side ----

int SelectDevice(int rank) {
  int n = 0;
  MORI_CHECK_GPU(GpuGetDeviceCount(&n));
  const int dev = rank % n;
  MORI_CHECK_GPU(GpuSetDevice(dev));
  return dev;
}

// One process's end: a buffer registered for CudaIpc, the peer's buffer mapped here, a CudaIpc connection and
// `numChannels` memory channels (one semaphore each) over it. Members are destroyed channels first.
struct End {
  int rank = 0;
  int peer = 1;
  std::shared_ptr<SocketBootstrap> bootstrap;
  std::unique_ptr<Communicator> comm;
  GpuBuffer buffer;
  RegisteredMemory local;
  RegisteredMemory remote;
  std::shared_ptr<Connection> connection;
  std::vector<std::shared_ptr<Semaphore>> semaphores;
  std::vector<MemoryChannel> channels;

  ChannelSet Set() const {
    ChannelSet s{};
    for (size_t i = 0; i < channels.size(); ++i) s.ch[i] = channels[i].DeviceHandle();
    return s;
  }
  void Write(uint64_t offset, const uint8_t* data, size_t bytes) {
    MORI_CHECK_GPU(GpuMemcpy(buffer.DataAs<uint8_t>() + offset, data, bytes));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // landed before a peer may write (pageable copies return early)
  }
  std::vector<uint8_t> Contents() const {
    std::vector<uint8_t> v(buffer.Bytes());
    MORI_CHECK_GPU(GpuMemcpy(v.data(), buffer.Data(), v.size()));
    return v;
  }
};

std::unique_ptr<End> Open(int rank, const std::string& root, size_t bytes, int numChannels = 1) {
  auto e = std::make_unique<End>();
  e->rank = rank;
  e->peer = 1 - rank;
  const int dev = SelectDevice(rank);
  e->bootstrap = std::make_shared<SocketBootstrap>(rank, 2);
  e->bootstrap->Initialize(root, 60);
  e->comm = std::make_unique<Communicator>(e->bootstrap);
  e->buffer = GpuBuffer(bytes);
  e->local = e->comm->RegisterMemory(e->buffer.Data(), bytes, Transport::CudaIpc);
  e->comm->SendMemory(e->local, e->peer);
  e->remote = e->comm->RecvMemory(e->peer).get();
  EndpointConfig config;
  config.transport = Transport::CudaIpc;
  config.device = dev;
  e->connection = e->comm->Connect(config, e->peer).get();
  for (int i = 0; i < numChannels; ++i) {
    e->semaphores.push_back(e->comm->BuildSemaphore(e->connection, e->peer, i).get());
    e->channels.emplace_back(e->semaphores.back(), e->remote, e->local);
  }
  return e;
}

using test::LoopbackRoot;

std::vector<uint8_t> Pattern(size_t bytes, int rank, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  test::FillPattern(v.data(), bytes, rank, seed);
  return v;
}

// First index where `got` differs from `want`, or want.size().
size_t FirstDiff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) return i;
  }
  return want.size();
}

class MemoryChannelMp : public ::testing::Test {
 protected:
  void SetUp() override {
    const int gpus = test::ProbeGpuCount();
    if (gpus == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
    // With one GPU both processes use it (rank % count): slower (their contexts take turns), same checks.
  }
};

// Buffer layout of the copy test: [0, R) is only read (sources), [R, 2R) only written (destinations), and a
// guard tail. Same-offset copies read and write one range, so rank 0 uses the first half of [R, 2R), rank 1
// the second.
constexpr uint64_t kRegion = (256 << 10) + 48;
constexpr uint64_t kCopyBuffer = 2 * kRegion + 64;

struct CopyCase {
  int mode;
  uint64_t dst, src, bytes;
  unsigned blocks, threads;
};

CopyCase ForRank(CopyCase c, int rank) {
  if (c.mode == kPutSameOffset || c.mode == kGetSameOffset) {
    c.dst = kRegion + static_cast<uint64_t>(rank) * (kRegion / 2) + c.dst;
    c.src = c.dst;
  }
  return c;
}

const CopyCase kCopyCases[] = {
    {kPut, kRegion, 0, 1, 1, 1},
    {kPut, kRegion + 1, 3, 15, 1, 32},
    {kPut, kRegion + 7, 9, 4097, 2, 64},     // alignments differ mod 8: bytes only
    {kPut, kRegion + 5, 13, 100003, 3, 96},  // equal mod 8, not mod 16: 8-byte words
    {kPut, kRegion + 8, 24, 65544, 4, 128},  // equal mod 16: a word, then 16-byte vectors
    {kPut, kRegion + 16, 32, 200001, 8, 128},
    {kPut, kRegion + 3, 3, 0, 2, 32},     // nothing
    {kPut, kRegion, 0, kRegion, 8, 128},  // a whole region
    {kGet, kRegion + 2, 6, 33, 1, 7},
    {kGet, kRegion + 11, 3, 77777, 3, 100},
    {kGet, kRegion + 16, 48, 131072, 4, 128},
    {kGet, kRegion + 9, 1, 1, 2, 2},  // more threads than bytes
    {kGet, kRegion, 0, kRegion, 8, 128},
    {kPutSameOffset, 5, 0, 12345, 2, 64},
    {kGetSameOffset, 16, 0, 65539, 3, 96},
};

TEST_F(MemoryChannelMp, PutAndGetMoveExactlyTheirRangesBothWaysAtOnce) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    auto e = Open(rank, root, kCopyBuffer);
    const int peer = e->peer;
    const MemoryChannelDeviceHandle h = e->channels[0].DeviceHandle();
    EXPECT_EQ(h.dstBytes, kCopyBuffer);
    EXPECT_EQ(h.srcBytes, kCopyBuffer);
    EXPECT_EQ(h.src, e->buffer.Data());
    EXPECT_EQ(h.dst, e->remote.Data());
    for (size_t k = 0; k < std::size(kCopyCases); ++k) {
      const uint32_t seed = 17 + static_cast<uint32_t>(k);
      const CopyCase mine = ForRank(kCopyCases[k], rank), theirs = ForRank(kCopyCases[k], peer);
      std::vector<uint8_t> want = Pattern(kCopyBuffer, rank, seed);
      e->Write(0, want.data(), want.size());
      e->bootstrap->Barrier();  // both filled before either copies

      LaunchKernel(CopyKernel, Dim3(mine.blocks), Dim3(mine.threads), 0, nullptr, h, mine.mode, mine.dst, mine.src,
                   mine.bytes);
      MORI_CHECK_GPU(GpuDeviceSynchronize());
      e->bootstrap->Barrier();  // both copies done

      // Into my buffer: the peer's Put, or my Get; each brings the peer's bytes of its source range.
      auto bring = [&](const CopyCase& c) {
        for (uint64_t i = 0; i < c.bytes; ++i) want[c.dst + i] = PatternByte(peer, c.src + i, seed);
      };
      if (theirs.mode == kPut || theirs.mode == kPutSameOffset) bring(theirs);
      if (mine.mode == kGet || mine.mode == kGetSameOffset) bring(mine);
      const std::vector<uint8_t> got = e->Contents();
      const size_t bad = FirstDiff(got, want);
      EXPECT_EQ(bad, want.size()) << "case " << k << " (mode " << mine.mode << ", dst " << mine.dst << ", src "
                                  << mine.src << ", " << mine.bytes << " bytes, " << mine.blocks << "x" << mine.threads
                                  << "): byte " << bad << " is wrong";
    }
    e->bootstrap->Barrier();  // nobody unmaps while the peer may still copy
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(MemoryChannelMp, SignalWaitAndPollOrderDataOverManyRoundsOnSeveralChannels) {
  const std::string root = LoopbackRoot();
  constexpr uint64_t kChunk = 4099;  // per block
  constexpr uint64_t kSrcBase = 8, kDstBase = kSrcBase + kMaxChannels * kChunk + 29;
  constexpr uint64_t kBytes = kDstBase + kMaxChannels * kChunk + 40;
  constexpr uint32_t kRounds = 40;
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    auto e = Open(rank, root, kBytes, kMaxChannels);
    GpuBuffer counters(4 * sizeof(uint32_t));
    MORI_CHECK_GPU(GpuMemset(counters.Data(), 0, counters.Bytes()));
    auto* errors = counters.DataAs<unsigned>();
    auto* polled = counters.DataAs<uint32_t>() + 1;
    const ChannelSet set = e->Set();
    // Guard bytes outside the chunks: nothing may touch them.
    std::vector<uint8_t> guard = Pattern(kBytes, rank, 3);
    e->Write(0, guard.data(), guard.size());
    e->bootstrap->Barrier();

    PreloadKernels(PingPong, SignalTimes, PollUntilEmpty);
    LaunchKernel(PingPong, Dim3(kMaxChannels), Dim3(64), 0, nullptr, set, rank, kRounds, kChunk, kSrcBase, kDstBase,
                 errors);
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    uint32_t errorCount = 0;
    MORI_CHECK_GPU(GpuMemcpy(&errorCount, errors, sizeof(errorCount)));
    EXPECT_EQ(errorCount, 0u) << "bytes seen wrong after a signal";
    e->bootstrap->Barrier();

    // The last round was rank (kRounds - 1) % 2's to send: its chunks carry the sender's data, everything
    // else in my buffer is my guard or my own last source data.
    std::vector<uint8_t> got = e->Contents();
    const int lastSender = static_cast<int>((kRounds - 1) % 2);
    const uint32_t lastSeed = 1000 + kRounds - 1, myLastSeed = 1000 + kRounds - (rank == lastSender ? 1 : 2);
    std::vector<uint8_t> want = guard;
    for (uint64_t i = 0; i < kMaxChannels * kChunk; ++i) {
      want[kSrcBase + i] = PatternByte(rank, i, myLastSeed);
      want[kDstBase + i] = PatternByte(1 - rank, i, rank == lastSender ? lastSeed - 1 : lastSeed);
    }
    EXPECT_EQ(FirstDiff(got, want), want.size()) << "byte " << FirstDiff(got, want) << " of rank " << rank;

    // Counting: nothing is pending now; three signals on channel 2 are three polls, then none, and the other
    // channels stay empty.
    LaunchKernel(PollUntilEmpty, Dim3(1), Dim3(1), 0, nullptr, set, 2, 10u, polled);
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    uint32_t count = 99;
    MORI_CHECK_GPU(GpuMemcpy(&count, polled, sizeof(count)));
    EXPECT_EQ(count, 0u) << "a poll succeeded with nothing signalled";
    e->bootstrap->Barrier();
    LaunchKernel(SignalTimes, Dim3(1), Dim3(1), 0, nullptr, set, 2, 3u);
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    e->bootstrap->Barrier();
    for (int which : {2, 1}) {
      LaunchKernel(PollUntilEmpty, Dim3(1), Dim3(1), 0, nullptr, set, which, 10u, polled);
      MORI_CHECK_GPU(GpuDeviceSynchronize());
      MORI_CHECK_GPU(GpuMemcpy(&count, polled, sizeof(count)));
      EXPECT_EQ(count, which == 2 ? 3u : 0u) << "polls on channel " << which;
    }
    e->bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Round r of a packet test: flag, never 0, never the previous round's.
uint32_t FlagOfRound(uint32_t r) { return (r + 1) * 0x01000193u; }

// Packet buffer layout: source, packets (guarded), unpacked destination (4 mod 8 for LL8), guard tail.
template <typename P>
struct PacketLayout {
  static constexpr uint64_t kBytes = 8 * 1237;
  static constexpr uint64_t kSrc = 24;
  static constexpr uint64_t kPackets = (kSrc + kBytes + 64 + 15) / 16 * 16;
  static constexpr uint64_t kPacketBytes = kBytes / P::kDataBytes * sizeof(P);
  static constexpr uint64_t kDst = (kPackets + kPacketBytes + 40 + 7) / 8 * 8 + (P::kDataBytes == 4 ? 4 : 0);
  static constexpr uint64_t kTotal = kDst + kBytes + 40;
  static_assert(kPackets >= kSrc + kBytes && kDst >= kPackets + kPacketBytes, "source, packets, destination apart");
};

// Each round, both ranks start receivers that find the previous round's packets in their buffer, then send;
// the receivers must take only this round's packets, and nothing outside the packets and the unpacked range
// may change.
template <typename P>
void PacketRoundsBothWays() {
  using L = PacketLayout<P>;
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    auto e = Open(rank, root, L::kTotal);
    const int peer = e->peer;
    const MemoryChannelDeviceHandle h = e->channels[0].DeviceHandle();
    EXPECT_EQ(h.packetBuffer, e->buffer.Data()) << "packets land in this side's memory by default";
    std::vector<uint8_t> want = Pattern(L::kTotal, rank, 77);
    std::fill(want.begin() + L::kPackets, want.begin() + L::kPackets + L::kPacketBytes, 0);
    e->Write(0, want.data(), want.size());
    GpuStream recvStream, sendStream;
    MORI_CHECK_GPU(GpuStreamCreate(&recvStream));
    MORI_CHECK_GPU(GpuStreamCreate(&sendStream));
    PreloadKernels(SendPackets<P>, ReceivePackets<P, false>, ReceivePackets<P, true>);
    e->bootstrap->Barrier();

    for (uint32_t r = 0; r < 10; ++r) {
      const uint32_t seed = 300 + r, flag = FlagOfRound(r);
      const std::vector<uint8_t> src = Pattern(L::kBytes, rank, seed);
      std::copy(src.begin(), src.end(), want.begin() + L::kSrc);
      std::vector<uint8_t> guard(L::kBytes);
      for (uint64_t i = 0; i < L::kBytes; ++i) guard[i] = PatternByte(rank, L::kDst + i, 77);
      e->Write(L::kSrc, src.data(), src.size());
      e->Write(L::kDst, guard.data(), guard.size());  // last round's unpacked data back to guard bytes

      if (r % 2 == 1) {
        LaunchKernel(ReceivePackets<P, true>, Dim3(3), Dim3(50), 0, recvStream, h, L::kDst, L::kPackets, L::kBytes,
                     flag);
      } else {
        LaunchKernel(ReceivePackets<P, false>, Dim3(3), Dim3(50), 0, recvStream, h, L::kDst, L::kPackets, L::kBytes,
                     flag);
      }
      e->bootstrap->Barrier();  // both receivers launched on last round's packets, both sources filled
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let them look at the stale packets
      LaunchKernel(SendPackets<P>, Dim3(4), Dim3(64), 0, sendStream, h, L::kPackets, L::kSrc, L::kBytes, flag);
      MORI_CHECK_GPU(GpuStreamSynchronize(sendStream));
      MORI_CHECK_GPU(GpuStreamSynchronize(recvStream));
      e->bootstrap->Barrier();

      for (uint64_t i = 0; i < L::kBytes; ++i) want[L::kDst + i] = PatternByte(peer, i, seed);
      std::vector<uint8_t> got = e->Contents();
      // The packets themselves are the peer's to write; everything else is checked.
      std::copy(got.begin() + L::kPackets, got.begin() + L::kPackets + L::kPacketBytes, want.begin() + L::kPackets);
      const size_t bad = FirstDiff(got, want);
      EXPECT_EQ(bad, want.size()) << "round " << r << ": byte " << bad << " (source at " << L::kSrc << ", packets at "
                                  << L::kPackets << ", unpacked at " << L::kDst << ")";
      if (bad != want.size()) break;
      // Every packet carries this round's flag now.
      for (uint64_t p = 0; p < L::kPacketBytes; p += 8) {
        uint32_t f;
        std::memcpy(&f, got.data() + L::kPackets + p + 4, 4);
        if (f != flag) {
          ADD_FAILURE() << "round " << r << ": packet word at " << p << " has flag " << f << ", not " << flag;
          break;
        }
      }
    }
    MORI_CHECK_GPU(GpuStreamDestroy(recvStream));
    MORI_CHECK_GPU(GpuStreamDestroy(sendStream));
    e->bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(MemoryChannelMp, LL16PacketsOverRoundsBothWaysNeverTakeStaleFlags) { PacketRoundsBothWays<LL16Packet>(); }
TEST_F(MemoryChannelMp, LL8PacketsOverRoundsBothWaysNeverTakeStaleFlags) { PacketRoundsBothWays<LL8Packet>(); }

template <typename P>
void PacketStreamBothWays() {
  constexpr uint64_t kBytes = 8 * 301, kSrc = 8, kPackets = kSrc + kBytes + 48;  // 16-byte aligned
  constexpr uint64_t kDst = kPackets + 2 * (kBytes / P::kDataBytes * sizeof(P)) + 24, kTotal = kDst + kBytes + 32;
  constexpr uint32_t kRounds = 200;
  static_assert(kPackets % 16 == 0 && kPackets >= kSrc + kBytes, "packets after the source, slot-aligned");
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    auto e = Open(rank, root, kTotal);
    MORI_CHECK_GPU(GpuMemset(e->buffer.Data(), 0, kTotal));
    GpuBuffer counter(sizeof(unsigned));
    MORI_CHECK_GPU(GpuMemset(counter.Data(), 0, counter.Bytes()));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // the peer writes into e->buffer after the barrier
    e->bootstrap->Barrier();
    LaunchKernel(PacketStream<P>, Dim3(1), Dim3(96), 0, nullptr, e->channels[0].DeviceHandle(), rank, kRounds, kBytes,
                 kSrc, kPackets, kDst, counter.DataAs<unsigned>());
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    unsigned errors = 1;
    MORI_CHECK_GPU(GpuMemcpy(&errors, counter.Data(), sizeof(errors)));
    EXPECT_EQ(errors, 0u) << "wrong bytes unpacked over " << kRounds << " rounds";
    e->bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_F(MemoryChannelMp, LL16PacketsStreamManyRoundsInOneKernel) { PacketStreamBothWays<LL16Packet>(); }
TEST_F(MemoryChannelMp, LL8PacketsStreamManyRoundsInOneKernel) { PacketStreamBothWays<LL8Packet>(); }

TEST_F(MemoryChannelMp, OutOfRangeOffsetsAndFlagZeroTrapNamingTheRangeAndTouchNothing) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "a device trap ends the GPU context; the HOST backend tests the message";
  const std::string root = LoopbackRoot();
  constexpr uint64_t kBytes = 4096 + 32;  // the last 16 bytes are one LL16 slot
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    auto e = Open(rank, root, kBytes);
    const std::vector<uint8_t> mine = Pattern(kBytes, rank, 9);
    e->Write(0, mine.data(), mine.size());
    e->bootstrap->Barrier();
    if (rank == 0) {
      MemoryChannelDeviceHandle h = e->channels[0].DeviceHandle();
      h.semaphore.timeoutNs = 50'000'000;
      const std::string n = std::to_string(kBytes);
      const std::string expected[] = {
          "Put: destination range [" + n + ", + 8) is outside its " + n + " bytes",
          "Put: source range [" + std::to_string(kBytes - 4) + ", + 8) is outside its " + n + " bytes",
          "Get: source range [" + std::to_string(kBytes + 100) + ", + 1) is outside its " + n + " bytes",
          "PutPackets: destination range [" + std::to_string(kBytes - 16) + ", + 32) is outside its " + n + " bytes",
          "UnpackPackets: packet buffer range [" + n + ", + 8) is outside its " + n + " bytes",
          "PutPackets with flag 0",
          "rank 0 waited 50000000 ns for signal #1 from rank 1 (0 arrived)",
      };
      for (int what = 0; what < 7; ++what) {
        testing::internal::CaptureStderr();
        LaunchKernel(Misuse, Dim3(1), Dim3(1), 0, nullptr, h, what);
        const GpuStatus s = GpuDeviceSynchronize();
        const std::string log = testing::internal::GetCapturedStderr();
        EXPECT_NE(s, kGpuSuccess) << "misuse " << what << " did not trap";
        EXPECT_NE(log.find(expected[what]), std::string::npos) << "misuse " << what << ": " << log;
        if (what < 6) {
          EXPECT_NE(log.find("mori memory channel (rank 0"), std::string::npos) << log;
        }
      }
    }
    e->bootstrap->Barrier();
    // The traps came before any store: both buffers still hold their own patterns.
    const std::vector<uint8_t> got = e->Contents();
    EXPECT_EQ(FirstDiff(got, mine), mine.size()) << "rank " << rank << "'s buffer was written";
    e->bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Runs `f`, expecting an InvalidUsage error whose message has `needle`.
template <typename F>
void ExpectInvalidUsage(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming \"" << needle << "\"";
  } catch (const Error& err) {
    EXPECT_EQ(err.Code(), ErrorCode::InvalidUsage) << err.what();
    EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
  }
}

TEST_F(MemoryChannelMp, PiecesThatDoNotFitAreRefusedNamingWhy) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    auto e = Open(rank, root, 8192);
    // Host memory registered for TCP only: the peer's copy of it is not mapped here.
    std::vector<uint8_t> host(4096);
    RegisteredMemory tcpOnly = e->comm->RegisterMemory(host.data(), host.size(), Transport::Tcp);
    e->comm->SendMemory(tcpOnly, e->peer, 5);
    RegisteredMemory peersTcpOnly = e->comm->RecvMemory(e->peer, 5).get();
    const auto& sema = e->semaphores[0];

    ExpectInvalidUsage([&] { MemoryChannel c(nullptr, e->remote, e->local); }, "the semaphore is null");
    ExpectInvalidUsage([&] { MemoryChannel c(sema, RegisteredMemory(), e->local); }, "destination memory is empty");
    ExpectInvalidUsage([&] { MemoryChannel c(sema, peersTcpOnly, e->local); },
                       "is not mapped in this process; it must be CudaIpc memory of a peer on this host");
    ExpectInvalidUsage([&] { MemoryChannel c(sema, e->remote, e->remote); }, "source (8192 bytes of rank " +
                                                                                 std::to_string(e->peer) +
                                                                                 ") is not memory registered in this "
                                                                                 "process");
    ExpectInvalidUsage([&] { MemoryChannel c(sema, e->remote, e->local, e->buffer.Data(), 0); },
                       "give both or neither");

    // An explicit packet buffer goes into the handle as given.
    MemoryChannel withPackets(sema, e->remote, e->local, e->buffer.DataAs<uint8_t>() + 4096, 4096);
    EXPECT_EQ(withPackets.DeviceHandle().packetBuffer, e->buffer.DataAs<uint8_t>() + 4096);
    EXPECT_EQ(withPackets.DeviceHandle().packetBufferBytes, 4096u);
    EXPECT_EQ(withPackets.GetSemaphore(), sema);
    e->bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

}  // namespace
}  // namespace mori::core
