// Port channels between two forked processes over CudaIpc, the emulated RDMA NIC and TCP: every device handle
// method called from kernels by many threads at once, rank- and index-dependent pieces of odd sizes at unaligned
// offsets with guard bytes around them, flush semantics, a large put split into chunks, a ProxyService subclass
// with custom (multi-slot) requests, and requests the proxy must refuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/port_channel.hpp"
#include "mori/channels/proxy.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core {
namespace {

// Each pushing thread owns a 1 KiB region of the source and of the target; its piece sits inside at offsets
// and of a size that depend on the thread and the sender's rank, so the bytes around it are guards.
constexpr uint64_t kRegion = 1024;
constexpr unsigned kBlocks = 2;
constexpr unsigned kThreadsPerBlock = 16;
constexpr unsigned kPushers = kBlocks * kThreadsPerBlock;
// Odd on purpose, and large enough for a put of several TCP chunks (512 KiB each by default).
constexpr uint64_t kBufferBytes = (uint64_t{3} << 19) + 7;
static_assert(kBufferBytes > kPushers * kRegion, "every pusher has its region");

struct Piece {
  uint64_t dst;
  uint64_t src;
  uint64_t bytes;
};

MORI_HOST_DEVICE_INLINE Piece PieceOf(unsigned thread, int senderRank) {
  Piece p{};
  uint64_t t = thread;
  uint64_t r = static_cast<uint64_t>(senderRank);
  p.bytes = 1 + (t * 131 + r * 17) % 1000;     // 1 .. 1000 bytes
  p.dst = t * kRegion + 1 + (t * 7 + r) % 16;  // ends before the region does
  p.src = t * kRegion + 3 + (t * 5 + r * 3) % 20;
  return p;
}

enum PutMode : uint32_t { kPutThenSignal, kPutWithSignal, kPutThenFlush, kPutWithSignalAndFlush };

MORI_GLOBAL void PutKernel(PortChannelDeviceHandle channel, int rank, uint32_t mode) {
  unsigned t = GlobalThreadIdx();
  Piece p = PieceOf(t, rank);
  switch (mode) {
    case kPutThenSignal:
      channel.Put(p.dst, p.src, p.bytes);
      channel.Signal();
      break;
    case kPutWithSignal:
      channel.PutWithSignal(p.dst, p.src, p.bytes);
      break;
    case kPutThenFlush:
      channel.Put(p.dst, p.src, p.bytes);
      channel.Flush();
      break;
    default:
      channel.PutWithSignalAndFlush(p.dst, p.src, p.bytes);
      break;
  }
}

// Each thread writes its piece of the source with a round's pattern (plain stores), then puts it with a signal
// at once: the push's fence (the channel's putOrder) is all that makes those stores visible to the proxy's copy.
MORI_GLOBAL void WriteThenPutKernel(PortChannelDeviceHandle channel, uint8_t* src, int rank, uint32_t seed) {
  unsigned t = GlobalThreadIdx();
  Piece p = PieceOf(t, rank);
  for (uint64_t i = 0; i < p.bytes; ++i) src[p.src + i] = test::PatternByte(rank, p.src + i, seed);
  channel.PutWithSignal(p.dst, p.src, p.bytes);
}

// One thread: returns once every earlier put of the channel is complete, its source no longer read.
MORI_GLOBAL void FlushKernel(PortChannelDeviceHandle channel) { channel.Flush(); }

// One thread consumes `n` signals.
MORI_GLOBAL void WaitKernel(PortChannelDeviceHandle channel, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) channel.Wait();
}

// One thread polls until `n` signals were consumed (or the bound passed), then polls once more: out[0] is how
// many it consumed, out[1] whether an extra one was there.
MORI_GLOBAL void PollKernel(PortChannelDeviceHandle channel, uint32_t n, uint32_t* out) {
  uint32_t got = 0;
  SpinDeadline deadline(channel.semaphore.timeoutNs);
  while (got < n && !deadline.Expired()) {
    if (channel.Poll()) {
      ++got;
    } else {
      SpinPause();
    }
  }
  out[0] = got;
  out[1] = channel.Poll() ? 1u : 0u;
}

// One thread: a put larger than a TCP chunk, at odd offsets, flushed.
MORI_GLOBAL void LargePutKernel(PortChannelDeviceHandle channel, uint64_t dst, uint64_t src, uint64_t bytes) {
  channel.PutWithSignalAndFlush(dst, src, bytes);
}

// Each thread: its piece, a one-slot and a two-slot custom request, then a signal.
constexpr uint64_t kCustomParts = 40;  // snd bits [40, 42): parts of a custom request (the type bits stay 0)
MORI_GLOBAL void MixedKernel(PortChannelDeviceHandle channel, int rank) {
  unsigned t = GlobalThreadIdx();
  Piece p = PieceOf(t, rank);
  channel.Put(p.dst, p.src, p.bytes);
  uint64_t value = static_cast<uint64_t>(rank) << 32 | t;
  channel.fifo.Push(ProxyTrigger{value, uint64_t{1} << kCustomParts | t});
  ProxyTrigger two[2] = {{value + 1000, uint64_t{2} << kCustomParts | t}, {~(value + 1000), t}};
  channel.fifo.Push(two, 2);
  channel.Signal();
}

// A service with its own requests: the values it was given, checked whole (the second slot of a two-slot
// request carries the complement of the first).
class CustomService : public ProxyService {
 public:
  CustomService() : ProxyService(64) {}
  ~CustomService() override { StopProxyWithoutDraining(); }
  std::vector<uint64_t> seen;  // written by the proxy thread; read after StopProxy
  uint64_t notReady = 0;

 protected:
  uint32_t HandleCustomTrigger(const ProxyTrigger& t) override {
    uint64_t parts = t.snd >> kCustomParts & 3;
    if (parts == 1) {
      seen.push_back(t.fst);
      return 1;
    }
    MORI_CHECK(parts == 2, ErrorCode::Protocol, "custom request of %llu parts", static_cast<unsigned long long>(parts));
    ProxyTrigger second{};
    if (!GetFifo().Poll(&second, 1)) {
      ++notReady;
      return 0;
    }
    MORI_CHECK(second.fst == ~t.fst, ErrorCode::Protocol, "two-slot request torn: 0x%llx then 0x%llx",
               static_cast<unsigned long long>(t.fst), static_cast<unsigned long long>(second.fst));
    seen.push_back(t.fst);
    return 2;
  }
};

// Pushes one request through a handle the test may have spoiled; no flush, so the kernel ends either way.
MORI_GLOBAL void OnePutKernel(PortChannelDeviceHandle channel, uint64_t dst, uint64_t src, uint64_t bytes,
                              uint32_t signal) {
  if (signal != 0) {
    channel.Signal();
  } else {
    channel.Put(dst, src, bytes);
  }
}

MORI_GLOBAL void PutThenFlushKernel(PortChannelDeviceHandle channel, uint64_t dst, uint64_t src, uint64_t bytes) {
  channel.Put(dst, src, bytes);
  channel.Flush();
}

std::vector<uint8_t> Pattern(size_t bytes, int rank, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  test::FillPattern(v.data(), bytes, rank, seed);
  return v;
}

// Both ends of one port channel in this process: memories, connection, semaphore, a proxy service.
class Pair {
 public:
  Pair(int rank, const std::string& root, Transport transport, std::unique_ptr<ProxyService> service = nullptr)
      : rank_(rank), peer_(1 - rank), transport_(transport) {
    int gpus = 0;
    MORI_CHECK_GPU(GpuGetDeviceCount(&gpus));
    MORI_CHECK_GPU(GpuSetDevice(rank % gpus));
    bootstrap_ = std::make_shared<SocketBootstrap>(rank, 2);
    bootstrap_->Initialize(root, 60);
    comm_ = std::make_unique<Communicator>(bootstrap_);
    src_ = GpuBuffer(kBufferBytes, MemoryType::Device);
    dst_ = GpuBuffer(kBufferBytes, MemoryType::Device);
    srcReg_ = comm_->RegisterMemory(src_.Data(), kBufferBytes, transport);
    dstReg_ = comm_->RegisterMemory(dst_.Data(), kBufferBytes, transport);
    comm_->SendMemory(dstReg_, peer_);
    auto peerDst = comm_->RecvMemory(peer_);
    EndpointConfig config;
    config.transport = transport;
    config.tcp.numChannels = 2;
    config.tcp.ifnames = "lo";
    connection_ = comm_->Connect(config, peer_).get();
    auto semaphore = comm_->BuildSemaphore(connection_, peer_);
    peerDst_ = peerDst.get();
    semaphore_ = semaphore.get();
    service_ = service != nullptr ? std::move(service) : std::make_unique<ProxyService>();
    channel_ = MakeChannel(*service_);
    service_->StartProxy();
  }

  PortChannel MakeChannel(ProxyService& service) {
    SemaphoreId sem = service.AddSemaphore(semaphore_);
    MemoryId dst = service.AddMemory(peerDst_);
    MemoryId src = service.AddMemory(srcReg_);
    return service.PortChannel(sem, dst, src);
  }

  const std::shared_ptr<Connection>& Conn() const { return connection_; }
  const PortChannel& Channel() const { return channel_; }
  Communicator& Comm() { return *comm_; }
  uint8_t* Source() const { return src_.DataAs<uint8_t>(); }

  // Whether a signal beyond those consumed is there (consumed by a kernel's Poll: the host keeps its own counts).
  bool ExtraSignal() {
    GpuBuffer out(2 * sizeof(uint32_t), MemoryType::HostPinned);
    std::memset(out.Data(), 0, out.Bytes());
    LaunchKernel(PollKernel, Dim3(1), Dim3(1), 0, nullptr, Handle(), 0u, out.DataAs<uint32_t>());
    Sync();
    return out.DataAs<uint32_t>()[1] != 0;
  }

  int Rank() const { return rank_; }
  Bootstrap& Boot() { return *bootstrap_; }
  ProxyService& Service() { return *service_; }
  PortChannelDeviceHandle Handle() const { return channel_.DeviceHandle(); }

  // Source: this rank's pattern; target: a guard pattern the peer's puts must replace exactly where they land.
  void Fill(uint32_t seed) {
    std::vector<uint8_t> s = Pattern(kBufferBytes, rank_, seed);
    std::vector<uint8_t> d = Pattern(kBufferBytes, rank_, seed + 1000);
    MORI_CHECK_GPU(GpuMemcpy(src_.Data(), s.data(), s.size()));
    MORI_CHECK_GPU(GpuMemcpy(dst_.Data(), d.data(), d.size()));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // landed before a peer may write (pageable copies return early)
  }

  std::vector<uint8_t> Target() const {
    std::vector<uint8_t> v(kBufferBytes);
    MORI_CHECK_GPU(GpuMemcpy(v.data(), dst_.Data(), v.size()));
    return v;
  }

  // The target holds the peer's pieces (from its source pattern of `pieceSeed`, by default what Fill(seed)
  // wrote) and the guard pattern of Fill(seed) everywhere else.
  void ExpectPeerPieces(uint32_t seed, const std::vector<Piece>& pieces) const { ExpectPeerPieces(seed, pieces, seed); }
  void ExpectPeerPieces(uint32_t seed, const std::vector<Piece>& pieces, uint32_t pieceSeed) const {
    std::vector<uint8_t> expected = Pattern(kBufferBytes, rank_, seed + 1000);
    for (const Piece& p : pieces) {
      for (uint64_t i = 0; i < p.bytes; ++i) expected[p.dst + i] = test::PatternByte(peer_, p.src + i, pieceSeed);
    }
    std::vector<uint8_t> got = Target();
    auto diff = std::mismatch(got.begin(), got.end(), expected.begin());
    size_t at = static_cast<size_t>(diff.first - got.begin());
    EXPECT_EQ(at, got.size()) << "rank " << rank_ << " over " << TransportName(transport_)
                              << ": first wrong byte of the target at offset " << at << " (region " << at / kRegion
                              << ")";
  }

  std::vector<Piece> PeerPieces() const {
    std::vector<Piece> v;
    for (unsigned t = 0; t < kPushers; ++t) v.push_back(PieceOf(t, peer_));
    return v;
  }

  void Sync() {
    MORI_CHECK_GPU(GpuGetLastError());
    MORI_CHECK_GPU(GpuDeviceSynchronize());
  }

 private:
  int rank_;
  int peer_;
  Transport transport_;
  std::shared_ptr<SocketBootstrap> bootstrap_;
  std::unique_ptr<Communicator> comm_;
  GpuBuffer src_;
  GpuBuffer dst_;
  RegisteredMemory srcReg_;
  RegisteredMemory dstReg_;
  RegisteredMemory peerDst_;
  std::shared_ptr<Connection> connection_;
  std::shared_ptr<Semaphore> semaphore_;
  std::unique_ptr<ProxyService> service_;
  PortChannel channel_;
};

class PortChannelMp : public ::testing::TestWithParam<Transport> {
 protected:
  // Two processes, each running body(pair) over the test's transport.
  template <typename F>
  void RunPair(F&& body, std::function<std::unique_ptr<ProxyService>()> makeService = nullptr) {
    test::ScopedEnv timeout("MORI_TIMEOUT_S", "60");
    const std::string root = "127.0.0.1:" + std::to_string(test::FreeTcpPort());
    const Transport transport = GetParam();
    auto outcomes = test::RunProcesses(
        2,
        [&](int rank) {
          Pair pair(rank, root, transport, makeService ? makeService() : nullptr);
          body(pair);
          pair.Boot().Barrier();  // neither side tears down while the other still moves data
          pair.Service().StopProxy();
          pair.Boot().Barrier();
          return ::testing::Test::HasFailure() ? 1 : 0;
        },
        150);
    test::ExpectAllSucceed(outcomes);
  }
};

TEST_P(PortChannelMp, PutThenSignalFromManyThreadsAndWait) {
  RunPair([](Pair& p) {
    p.Fill(11);
    p.Boot().Barrier();
    PreloadKernels(PutKernel, WaitKernel);
    LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank(),
                 uint32_t{kPutThenSignal});
    p.Sync();
    // Each pusher signalled after its put: once all signals are in, so is every piece.
    LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kPushers);
    p.Sync();
    p.ExpectPeerPieces(11, p.PeerPieces());
    p.Boot().Barrier();
    EXPECT_FALSE(p.ExtraSignal()) << "no signal beyond the " << kPushers << " sent";
  });
}

TEST_P(PortChannelMp, PutWithSignalFromManyThreadsAndPoll) {
  RunPair([](Pair& p) {
    if (p.Conn()->GetTransport() == Transport::CudaIpc && !MORI_BACKEND_HIP) {
      // The default: the stream writes the words (every CUDA device of CUDA 12 and later can, and HOST).
      int device = 0;
      ASSERT_EQ(GpuGetDevice(&device), kGpuSuccess);
      EXPECT_TRUE(GpuCanStreamWriteValue64(device)) << "device " << device;
      const std::string how = p.Conn()->Describe();
      EXPECT_NE(how.find("words written by the stream"), std::string::npos) << how;
    }
    p.Fill(22);
    GpuBuffer out(2 * sizeof(uint32_t), MemoryType::HostPinned);
    std::memset(out.Data(), 0xFF, out.Bytes());
    p.Boot().Barrier();
    PreloadKernels(PutKernel, PollKernel);
    LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank(),
                 uint32_t{kPutWithSignal});
    p.Sync();
    LaunchKernel(PollKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kPushers, out.DataAs<uint32_t>());
    p.Sync();
    EXPECT_EQ(out.DataAs<uint32_t>()[0], kPushers) << "signals consumed by Poll";
    p.ExpectPeerPieces(22, p.PeerPieces());
    // The peer finished its kernel's polls too: nothing more can arrive now.
    p.Boot().Barrier();
    EXPECT_EQ(out.DataAs<uint32_t>()[1], 0u) << "Poll consumed a signal nobody sent";
  });
}

// A channel whose source is device memory of the proxy's GPU fences its puts at device scope, any other at
// system scope. Three launches, each writing the source with a new pattern in the kernel and putting it at
// once; after each, the peer's target holds exactly that launch's pieces. Each side flushes its channel before
// the next launch rewrites its source: the peer's signals say the data arrived, not that this side's
// connection (TCP's sender threads) stopped reading it.
TEST_P(PortChannelMp, PutsCarryWhatTheKernelJustWroteToTheSource) {
  RunPair([](Pair& p) {
    int device = 0;
    ASSERT_EQ(GpuGetDevice(&device), kGpuSuccess);
    EXPECT_EQ(p.Service().Device(), device);
    const FifoOrder expected = MORI_BACKEND_HOST ? FifoOrder::AfterWrites : FifoOrder::AfterDeviceWrites;
    EXPECT_EQ(p.Channel().PutOrder(), expected) << "a source in this GPU's device memory";
    EXPECT_EQ(p.Handle().putOrder, static_cast<uint32_t>(expected));
    {
      // Other sources, in a service of their own: host-pinned memory (the system scope), and device memory mori
      // did not allocate (found by the runtime's pointer attributes), as the pair's source.
      GpuBuffer pinned(4096, MemoryType::HostPinned);
      void* raw = nullptr;
      ASSERT_EQ(GpuMalloc(&raw, 4096), kGpuSuccess);
      {
        ProxyService other(16);
        const std::shared_ptr<Semaphore>& semaphore = p.Channel().GetSemaphore();
        SemaphoreId sem = other.AddSemaphore(semaphore);
        MemoryId pinnedId = other.AddMemory(p.Comm().RegisterMemory(pinned.Data(), pinned.Bytes(), Transport::Tcp));
        MemoryId rawId = other.AddMemory(p.Comm().RegisterMemory(raw, 4096, Transport::Tcp));
        EXPECT_EQ(other.PortChannel(sem, 0, pinnedId).PutOrder(), FifoOrder::AfterWrites);
        EXPECT_EQ(other.PortChannel(sem, 0, pinnedId).DeviceHandle().putOrder, 0u);
        EXPECT_EQ(other.PortChannel(sem, 0, rawId).PutOrder(), expected) << "cudaMalloc'd memory";
        // Chosen by hand: kept; an order that fences nothing before a put is refused.
        PortChannel system(sem, semaphore, other.FifoHandle(), 0, rawId, FifoOrder::AfterWrites);
        EXPECT_EQ(system.DeviceHandle().putOrder, 0u);
        EXPECT_THROW(PortChannel(sem, semaphore, other.FifoHandle(), 0, rawId, FifoOrder::PayloadOnly), Error);
      }
      EXPECT_EQ(GpuFree(raw), kGpuSuccess);
    }
    PreloadKernels(WriteThenPutKernel, WaitKernel, FlushKernel);
    for (uint32_t launch = 0; launch < 3; ++launch) {
      const uint32_t seed = 500 + launch;
      p.Fill(seed);  // the host's pattern of `seed`; the kernel overwrites the pieces with that of seed + 1
      p.Boot().Barrier();
      LaunchKernel(WriteThenPutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Source(),
                   p.Rank(), seed + 1);
      p.Sync();
      LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kPushers);
      p.Sync();
      LaunchKernel(FlushKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle());
      p.Sync();
      SCOPED_TRACE("launch " + std::to_string(launch));
      p.ExpectPeerPieces(seed, p.PeerPieces(), seed + 1);  // the kernel's pattern, not the host's
      p.Boot().Barrier();
      EXPECT_FALSE(p.ExtraSignal()) << "launch " << launch;
    }
  });
}

// Over CudaIpc the signals' words are written by the copy stream itself by default; MORI_CUDA_IPC_WORDS=copy
// (and a device that cannot) copies them from a ring of 64 pinned staging words instead. 96 signals with no
// flush between them go round that ring once and a half (it waits for the stream when it wraps); once all 96
// are in, so is every piece, and no signal more came.
TEST_P(PortChannelMp, CopiedSignalWordsGoRoundTheirStagingRing) {
  if (GetParam() != Transport::CudaIpc) GTEST_SKIP() << "a CudaIpc setting";
  test::ScopedEnv words("MORI_CUDA_IPC_WORDS", "copy");
  RunPair([](Pair& p) {
    const std::string how = p.Conn()->Describe();
    EXPECT_NE(how.find("words copied from staging"), std::string::npos) << how;
    constexpr uint32_t kLaunches = 3;
    p.Fill(44);
    p.Boot().Barrier();
    PreloadKernels(PutKernel, WaitKernel);
    for (uint32_t i = 0; i < kLaunches; ++i) {
      LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank(),
                   uint32_t{kPutWithSignal});
    }
    p.Sync();
    LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kLaunches * kPushers);
    p.Sync();
    p.ExpectPeerPieces(44, p.PeerPieces());
    p.Boot().Barrier();
    EXPECT_FALSE(p.ExtraSignal()) << "no signal beyond the " << kLaunches * kPushers << " sent";
  });
}

TEST_P(PortChannelMp, AfterFlushTheDataIsAtTheTarget) {
  RunPair([](Pair& p) {
    p.Fill(33);
    p.Boot().Barrier();
    PreloadKernels(PutKernel, WaitKernel);
    // Put + Flush, no signal: the peer looks as soon as this side's kernel (every flush) returned.
    LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank(),
                 uint32_t{kPutThenFlush});
    p.Sync();
    p.Boot().Barrier();
    p.ExpectPeerPieces(33, p.PeerPieces());
    EXPECT_FALSE(p.ExtraSignal()) << "a flush signalled";

    p.Boot().Barrier();
    p.Fill(44);
    p.Boot().Barrier();
    LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank(),
                 uint32_t{kPutWithSignalAndFlush});
    p.Sync();
    p.Boot().Barrier();
    p.ExpectPeerPieces(44, p.PeerPieces());
    LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kPushers);
    p.Sync();
  });
}

TEST_P(PortChannelMp, LargePutAtOddOffsetsIsSplitAndComplete) {
  // Most of the buffer in one request, at odd offsets: several TCP chunks (2 channels) and RDMA writes.
  RunPair([](Pair& p) {
    p.Fill(55);
    p.Boot().Barrier();
    PreloadKernels(LargePutKernel, WaitKernel);
    const uint64_t bytes = kBufferBytes - 9;
    LaunchKernel(LargePutKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), uint64_t{5}, uint64_t{3}, bytes);
    p.Sync();
    p.Boot().Barrier();
    p.ExpectPeerPieces(55, {Piece{5, 3, bytes}});
    LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), 1u);
    p.Sync();
  });
}

TEST_P(PortChannelMp, ACustomServiceHandlesItsRequestsBetweenPortRequests) {
  RunPair(
      [](Pair& p) {
        p.Fill(66);
        p.Boot().Barrier();
        PreloadKernels(MixedKernel, WaitKernel);
        LaunchKernel(MixedKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank());
        p.Sync();
        LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kPushers);
        p.Sync();
        p.ExpectPeerPieces(66, p.PeerPieces());
        p.Service().StopProxy();
        auto& service = static_cast<CustomService&>(p.Service());
        std::vector<uint64_t> seen = service.seen;
        std::sort(seen.begin(), seen.end());
        std::vector<uint64_t> expected;
        for (unsigned t = 0; t < kPushers; ++t) {
          uint64_t value = static_cast<uint64_t>(p.Rank()) << 32 | t;
          expected.push_back(value);
          expected.push_back(value + 1000);
        }
        std::sort(expected.begin(), expected.end());
        EXPECT_EQ(seen, expected) << "each custom request handled once, whole";
      },
      [] { return std::unique_ptr<ProxyService>(new CustomService()); });
}

// Runs one spoiled request through a fresh service on this side; its proxy must fail naming `expect`.
void ExpectRefused(Pair& p, const char* what,
                   const std::function<PortChannelDeviceHandle(PortChannelDeviceHandle)>& spoil, uint64_t dst,
                   uint64_t src, uint64_t bytes, uint32_t signal, const std::string& expect) {
  ProxyService service(16);
  PortChannel channel = p.MakeChannel(service);
  service.StartProxy();
  LaunchKernel(OnePutKernel, Dim3(1), Dim3(1), 0, nullptr, spoil(channel.DeviceHandle()), dst, src, bytes, signal);
  p.Sync();
  Deadline deadline = Deadline::After(30);
  while (service.Running() && !deadline.Expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_FALSE(service.Running()) << what << ": the proxy kept running after a request it cannot serve";
  try {
    service.StopProxy();
    ADD_FAILURE() << what << ": the request was served";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << what << ": " << e.what();
  }
}

TEST_P(PortChannelMp, RequestsOutOfRangeFailTheProxyNamingThem) {
  RunPair([](Pair& p) {
    p.Fill(77);
    p.Boot().Barrier();
    PreloadKernels(OnePutKernel);
    auto same = [](PortChannelDeviceHandle h) { return h; };
    ExpectRefused(
        p, "memory id",
        [](PortChannelDeviceHandle h) {
          h.dst = 9;
          return h;
        },
        0, 0, 8, 0, "names memories dst 9");
    ExpectRefused(
        p, "semaphore id",
        [](PortChannelDeviceHandle h) {
          h.semaphoreId = 5;
          return h;
        },
        0, 0, 0, 1, "names semaphore 5");
    ExpectRefused(p, "target offset", same, kBufferBytes - 10, 0, 11, 0, "reaches beyond a memory");
    ExpectRefused(p, "source offset", same, 0, kBufferBytes - 1, 2, 0, "reaches beyond a memory");
    if (MORI_BACKEND_HOST) {  // on a GPU the trap would end the context
      // A kernel flushing behind a refused put traps, naming the failure and the trigger, instead of waiting.
      ProxyService service(16);
      PortChannel channel = p.MakeChannel(service);
      service.StartProxy();
      PreloadKernels(PutThenFlushKernel);
      ::testing::internal::CaptureStderr();
      LaunchKernel(PutThenFlushKernel, Dim3(1), Dim3(1), 0, nullptr, channel.DeviceHandle(), kBufferBytes, uint64_t{0},
                   uint64_t{1});
      GpuStatus synced = GpuDeviceSynchronize();
      std::string err = ::testing::internal::GetCapturedStderr();
      EXPECT_NE(synced, kGpuSuccess) << "the flushing kernel should have trapped";
      EXPECT_NE(err.find("the proxy serving this FIFO failed (invalid usage at the trigger in slot 0"),
                std::string::npos)
          << err;
      EXPECT_NE(err.find("reaches beyond a memory"), std::string::npos) << "the host log names the cause: " << err;
      EXPECT_THROW(service.StopProxy(), Error);
    }
    // Host-side construction refuses ids it does not have.
    EXPECT_THROW(p.Service().PortChannel(7, 0, 1), Error);
    EXPECT_THROW(p.Service().PortChannel(0, 5, 0), Error);
    // Nothing of the refused requests reached the peer, and the healthy channel still works.
    p.Boot().Barrier();
    p.ExpectPeerPieces(77, {});
    EXPECT_FALSE(p.ExtraSignal()) << "a refused request signalled";
    p.Boot().Barrier();
    PreloadKernels(PutKernel, WaitKernel);
    LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, p.Handle(), p.Rank(),
                 uint32_t{kPutWithSignal});
    p.Sync();
    LaunchKernel(WaitKernel, Dim3(1), Dim3(1), 0, nullptr, p.Handle(), kPushers);
    p.Sync();
    p.ExpectPeerPieces(77, p.PeerPieces());
  });
}

std::string Name(const ::testing::TestParamInfo<Transport>& info) { return TransportName(info.param); }

INSTANTIATE_TEST_SUITE_P(Transports, PortChannelMp,
                         ::testing::Values(Transport::CudaIpc, Transport::Emulated, Transport::Tcp), Name);

}  // namespace
}  // namespace mori::core
