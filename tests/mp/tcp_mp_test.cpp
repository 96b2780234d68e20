// Multi-channel TCP between processes (fork, socket bootstrap on loopback): every channel count and window with
// chunk sizes that do not divide the transfer, both directions at once, 64 MiB, word updates ordered after the
// data, reads, atomics from several peers onto one word; and the failures: a receiver killed mid-transfer, a
// stalled peer, stray connections at the listeners, corrupt frames, malformed handles; and two network
// namespaces joined by two veth pairs, one channel per interface; the loopback connection of a rank to itself
// (Communicator::Connect with its own rank), whose atomics are atomic with the peers'.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/channels/connection.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/timeout.hpp"
#include "socket.hpp"
#include "tcp/tcp_link.hpp"
#include "tcp/tcp_registry.hpp"
#include "tcp/tcp_wire.hpp"

namespace mori::core::tcp {
namespace {

using test::LoopbackRoot;

TcpLinkOptions Options(int channels, int window = 16, uint64_t chunk = 512 << 10,
                       std::vector<std::string> ifnames = {"lo"}) {
  TcpLinkOptions o;
  o.numChannels = channels;
  o.windowChunks = window;
  o.chunkBytes = chunk;
  o.ifnames = std::move(ifnames);
  return o;
}

// Test memory, host or device (GpuBuffer), registered for TCP; filled and read back through the GPU runtime
// so that the same code runs on a GPU.
class Mem {
 public:
  Mem(size_t bytes, bool device) : bytes_(bytes), device_(device) {
    if (device) {
      gpu_ = GpuBuffer(bytes, MemoryType::Device);
      data_ = gpu_.DataAs<uint8_t>();
    } else {
      host_.resize(bytes);
      data_ = host_.data();
    }
    key_ = RegisterTcpMemory(data_, bytes, device);
    GrantTcpMemory(key_, kAnyTcpPeer);  // the tests hand the key to their peers themselves
  }
  ~Mem() { DeregisterTcpMemory(key_); }
  Mem(const Mem&) = delete;
  Mem& operator=(const Mem&) = delete;

  uint8_t* Data() const { return data_; }
  uint32_t Key() const { return key_; }

  void Set(const std::vector<uint8_t>& v) {
    if (device_) {
      MORI_CHECK_GPU(GpuMemcpy(data_, v.data(), v.size()));
      // A copy from pageable memory returns before its DMA lands; the link's own (non-blocking) streams would
      // not wait for it, so a peer's write could land first and be overwritten.
      MORI_CHECK_GPU(GpuDeviceSynchronize());
    } else {
      std::memcpy(data_, v.data(), v.size());
    }
  }
  void Fill(int rank, uint32_t seed) {
    std::vector<uint8_t> v(bytes_);
    test::FillPattern(v.data(), v.size(), rank, seed);
    Set(v);
  }
  std::vector<uint8_t> Contents() const {
    std::vector<uint8_t> v(bytes_);
    if (device_) {
      MORI_CHECK_GPU(GpuMemcpy(v.data(), data_, bytes_));
    } else {
      std::memcpy(v.data(), data_, bytes_);
    }
    return v;
  }

 private:
  size_t bytes_;
  bool device_;
  GpuBuffer gpu_;
  std::vector<uint8_t> host_;
  uint8_t* data_ = nullptr;
  uint32_t key_ = 0;
};

std::vector<uint8_t> Pattern(size_t bytes, int rank, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  test::FillPattern(v.data(), bytes, rank, seed);
  return v;
}

// Index of the first difference, or a.size() when equal.
size_t FirstDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return a.size() == b.size() ? a.size() : n;
}

template <typename T>
T Swap(Bootstrap& b, int peer, const T& mine, int tag) {
  T theirs{};
  b.Send(&mine, sizeof(T), peer, tag);
  b.Recv(&theirs, sizeof(T), peer, tag);
  return theirs;
}

// Waits until `pred` holds; false after `seconds`.
template <typename F>
bool WaitUntil(F&& pred, double seconds = 30) {
  Deadline d = Deadline::After(seconds);
  while (!pred()) {
    if (d.Expired()) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// Runs `f`, expecting an Error; returns it (code, message) for the caller to check.
template <typename F>
std::pair<ErrorCode, std::string> CatchError(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return {e.Code(), e.what()};
  }
  return {ErrorCode::Internal, "(no error)"};
}

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct Piece {
  uint64_t dstOffset;
  uint64_t srcOffset;
  uint64_t bytes;
};

// Both ranks write `pieces` of their source into the other's target at once, then check that exactly those
// bytes arrived and the rest of the target kept its guard pattern.
void ExchangeAndVerify(Bootstrap& b, TcpLink& link, int rank, size_t bytes, bool device,
                       const std::vector<Piece>& pieces, uint32_t seed, int tag) {
  const int peer = 1 - rank;
  Mem src(bytes, device);
  Mem dst(bytes, device);
  src.Fill(rank, seed);
  dst.Fill(rank, seed + 1000);  // guard
  uint32_t peerKey = Swap(b, peer, dst.Key(), tag);
  for (const Piece& p : pieces) link.Write(peerKey, p.dstOffset, src.Data() + p.srcOffset, device, p.bytes);
  link.Flush();
  b.Barrier();  // the peer's Flush returned: its writes into `dst` are all written

  std::vector<uint8_t> expected = Pattern(bytes, rank, seed + 1000);
  for (const Piece& p : pieces) {
    for (uint64_t i = 0; i < p.bytes; ++i) expected[p.dstOffset + i] = test::PatternByte(peer, p.srcOffset + i, seed);
  }
  std::vector<uint8_t> got = dst.Contents();
  size_t diff = FirstDiff(got, expected);
  EXPECT_EQ(diff, bytes) << "rank " << rank << ": first wrong byte at offset " << diff << " of " << bytes;
  b.Barrier();
}

// Two processes with a socket bootstrap on loopback, each running body(rank, bootstrap).
template <typename F>
void RunPair(F&& body, double timeoutSeconds = 120) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(
      2,
      [&](int rank) {
        SocketBootstrap b(rank, 2);
        b.Initialize(root, 60);
        return body(rank, b);
      },
      timeoutSeconds);
  test::ExpectAllSucceed(outcomes);
}

TEST(TcpLinkMp, EveryChannelCountAndWindowWithChunksThatDoNotDivide) {
  struct Case {
    int channels;
    int window;
    uint64_t chunk;
    bool device;
  };
  const std::vector<Case> cases = {
      {1, 1, 4096 + 1, false}, {1, 16, 512 << 10, true}, {2, 1, 65536 + 7, true}, {2, 16, 1000, false},
      {4, 1, 300000, false},   {4, 16, 65536, true},     {8, 1, 100003, true},    {8, 16, 3 * 4096 + 5, false},
  };
  const size_t bytes = (3 << 20) + 4093;
  const std::vector<Piece> pieces = {
      {1, 5, 1},                                         // one byte
      {13, 3, bytes / 2 - 100},                          // odd offsets on both sides
      {bytes / 2 + 7, bytes / 2 + 9, bytes / 2 - 4096},  // leaves guard bytes at the end
  };
  RunPair([&](int rank, Bootstrap& b) {
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      SCOPED_TRACE(::testing::Message() << c.channels << " channels, window " << c.window << ", chunk " << c.chunk
                                        << (c.device ? ", device memory" : ", host memory"));
      auto link = TcpLink::Connect(b, 1 - rank, 100 + static_cast<int>(i), Options(c.channels, c.window, c.chunk));
      EXPECT_EQ(link->NumChannels(), c.channels);
      ExchangeAndVerify(b, *link, rank, bytes, c.device, pieces, static_cast<uint32_t>(i), 200 + static_cast<int>(i));
      // Every channel carried its share in each direction.
      for (const auto& info : link->Channels()) {
        EXPECT_GT(info.bytesSent, 0u) << "channel " << info.index;
        EXPECT_GT(info.bytesReceived, 0u) << "channel " << info.index;
        EXPECT_TRUE(info.local.IsLoopback()) << info.local.ToString();
      }
    }
    return 0;
  });
}

// Spins on the default stream until the word is 1, then copies `bytes` of `data` to `out`.
MORI_GLOBAL void SpinUntilWordThenCopy(const uint64_t* word, const uint8_t* data, uint8_t* out, uint64_t bytes,
                                       uint64_t timeoutNs) {
  SpinDeadline deadline(timeoutNs);
  while (AtomicLoad<MemoryOrder::Acquire>(word) != 1) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "the kernel waited %llu ns for the Tcp update of its word",
                       static_cast<unsigned long long>(timeoutNs));
    SpinPause();
  }
  for (uint64_t i = 0; i < bytes; ++i) out[i] = data[i];
}

// While a kernel spins on the default stream until data arrives, the receiver's copies into and out of
// device memory (writes, a read, an atomic) still complete: they use a stream of their own and pinned staging.
TEST(TcpLinkMp, DeviceCopiesDoNotWaitBehindAKernelSpinningOnTheDefaultStream) {
  const size_t bytes = (1 << 20) + 5;
  RunPair([&](int rank, Bootstrap& b) {
    test::ScopedEnv timeout("MORI_TIMEOUT_S", "20");
    const int peer = 1 - rank;
    auto link = TcpLink::Connect(b, peer, 1, Options(2, 4, 65536 + 3));
    Mem data(bytes, true);
    Mem words(64, true);
    Mem out(bytes, true);
    data.Fill(rank, 70);
    out.Fill(rank, 71);
    words.Set(std::vector<uint8_t>(64, 0));
    uint32_t peerData = Swap(b, peer, data.Key(), 2);
    uint32_t peerWords = Swap(b, peer, words.Key(), 3);
    if (rank == 1) {
      LaunchKernel(SpinUntilWordThenCopy, Dim3(1), Dim3(1), 0, nullptr,
                   reinterpret_cast<const uint64_t*>(words.Data() + 8), data.Data(), out.Data(), uint64_t{bytes},
                   uint64_t{60} * 1000000000ull);
      MORI_CHECK_GPU(GpuGetLastError());
      b.Barrier();  // the kernel is launched
      MORI_CHECK_GPU(GpuDeviceSynchronize());
      b.Barrier();
      std::vector<uint8_t> expected = Pattern(bytes, 1, 70);
      for (size_t i = 0; i < bytes - 9; ++i) expected[3 + i] = test::PatternByte(0, 1 + i, 70);
      EXPECT_EQ(FirstDiff(out.Contents(), expected), bytes) << "what the kernel saw after the update";
      uint64_t counter = 0;
      std::memcpy(&counter, words.Contents().data() + 16, 8);
      EXPECT_EQ(counter, 5u);
    } else {
      b.Barrier();
      link->Write(peerData, 3, data.Data() + 1, true, bytes - 9);
      uint64_t old = ~0ull;
      link->FetchAdd(peerWords, 16, 5, &old);
      std::vector<uint8_t> back(1000);
      link->Read(back.data(), false, peerData, 3 + 500, back.size());
      auto err = CatchError([&] { link->Flush(); });
      EXPECT_EQ(err.second, "(no error)") << "the receiver waited behind the spinning kernel";
      EXPECT_EQ(old, 0u);
      for (size_t i = 0; i < back.size(); ++i) {
        if (back[i] != test::PatternByte(0, 1 + 500 + i, 70)) {
          ADD_FAILURE() << "read byte " << i;
          break;
        }
      }
      link->UpdateWord(peerWords, 8, 1);  // releases the kernel
      link->Flush();
      b.Barrier();
    }
    b.Barrier();
    return 0;
  });
}

TEST(TcpLinkMp, SixtyFourMiBBothDirections) {
  const size_t bytes = 64 << 20;
  RunPair([&](int rank, Bootstrap& b) {
    auto link = TcpLink::Connect(b, 1 - rank, 1, Options(4));
    ExchangeAndVerify(b, *link, rank, bytes, false, {{0, 0, bytes}}, 77, 2);
    uint64_t total = 0;
    for (const auto& info : link->Channels()) {
      EXPECT_EQ(info.bytesSent, bytes / 4) << "channel " << info.index;  // 128 chunks dealt round-robin
      total += info.bytesReceived;
    }
    EXPECT_EQ(total, bytes);
    return 0;
  });
}

TEST(TcpLinkMp, DefaultInterfaceAndDeviceMemoryThroughTheBounceBuffers) {
  // No interface named: the listeners take the address the bootstrap would pick.
  test::ScopedEnv ifname("MORI_SOCKET_IFNAME", nullptr);
  const size_t bytes = (9 << 20) + 1;
  RunPair([&](int rank, Bootstrap& b) {
    auto link = TcpLink::Connect(b, 1 - rank, 1, Options(3, 4, 1 << 20, {}));
    ExchangeAndVerify(b, *link, rank, bytes, true, {{0, 0, bytes}}, 5, 2);
    for (const auto& info : link->Channels()) EXPECT_TRUE(info.ifname.empty());
    return 0;
  });
}

TEST(TcpLinkMp, UpdatesLandOnlyAfterTheDataBeforeThemOverManyRounds) {
  const size_t bytes = (256 << 10) + 11;
  const uint64_t rounds = 60;
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    auto link = TcpLink::Connect(b, peer, 1, Options(4, 4, 4096 + 3));
    Mem data(bytes, false);
    Mem flag(64, false);
    data.Fill(rank, 999);
    flag.Set(std::vector<uint8_t>(64, 0));
    uint32_t peerData = Swap(b, peer, data.Key(), 2);
    uint32_t peerFlag = Swap(b, peer, flag.Key(), 3);
    auto* word = reinterpret_cast<uint64_t*>(flag.Data() + 8);
    std::vector<uint8_t> src(bytes);
    for (uint64_t r = 1; r <= rounds; ++r) {
      if (rank == 0) {
        test::FillPattern(src.data(), bytes, 0, static_cast<uint32_t>(r));
        link->Write(peerData, 0, src.data(), false, bytes);
        link->UpdateWord(peerFlag, 8, r);
        // The reply: rank 1 saw round r complete; after the flush the senders are done with `src` too.
        if (!WaitUntil([&] { return AtomicLoad(word) == r; })) {
          ADD_FAILURE() << "round " << r << ": no reply";
          return 1;
        }
        link->Flush();
      } else {
        if (!WaitUntil([&] { return AtomicLoad(word) == r; })) {
          ADD_FAILURE() << "round " << r << ": the update never came";
          return 1;
        }
        size_t bad = test::FirstPatternMismatch(data.Data(), bytes, 0, static_cast<uint32_t>(r));
        if (bad != bytes) {
          ADD_FAILURE() << "round " << r << ": the update landed before byte " << bad << " of the data";
          return 1;
        }
        link->UpdateWord(peerFlag, 8, r);
      }
    }
    link->Flush();
    b.Barrier();
    return 0;
  });
}

TEST(TcpLinkMp, ReadsSeeThePeersMemoryAndEarlierWrites) {
  const size_t bytes = (2 << 20) + 333;
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    auto link = TcpLink::Connect(b, peer, 1, Options(4, 8, 100000));
    Mem host(bytes, false);
    Mem device(bytes, true);
    host.Fill(rank, 31);
    device.Fill(rank, 32);
    uint32_t peerHost = Swap(b, peer, host.Key(), 2);
    uint32_t peerDevice = Swap(b, peer, device.Key(), 3);
    if (rank == 0) {
      Mem outHost(bytes, false);
      Mem outDevice(bytes, true);
      outHost.Fill(0, 40);
      outDevice.Fill(0, 41);
      link->Read(outHost.Data(), false, peerHost, 0, 1);
      link->Read(outHost.Data() + 7, false, peerHost, 3, bytes - 10);
      link->Read(outDevice.Data() + 5, true, peerDevice, 1, (1 << 20) + 3);
      // A read after a write on another channel sees the write (outside the ranges read above): the first
      // write takes chunk 0 (channel 0), the second chunk 1 (channel 1); the read goes on channel 0.
      const uint64_t freshAt = (3 << 19) + 1;
      std::vector<uint8_t> first = Pattern(3000, 0, 43);
      std::vector<uint8_t> fresh = Pattern(5000, 0, 42);
      link->Write(peerDevice, (7 << 18) + 5, first.data(), false, first.size());
      link->Write(peerDevice, freshAt, fresh.data(), false, fresh.size());
      std::vector<uint8_t> back(5000);
      link->Read(back.data(), false, peerDevice, freshAt, back.size());
      link->Flush();
      EXPECT_EQ(FirstDiff(back, fresh), fresh.size());

      std::vector<uint8_t> expected = Pattern(bytes, 0, 40);
      expected[0] = test::PatternByte(1, 0, 31);
      for (size_t i = 0; i < bytes - 10; ++i) expected[7 + i] = test::PatternByte(1, 3 + i, 31);
      EXPECT_EQ(FirstDiff(outHost.Contents(), expected), bytes);
      expected = Pattern(bytes, 0, 41);
      for (size_t i = 0; i < (1 << 20) + 3; ++i) expected[5 + i] = test::PatternByte(1, 1 + i, 32);
      EXPECT_EQ(FirstDiff(outDevice.Contents(), expected), bytes);
    }
    b.Barrier();
    return 0;
  });
}

TEST(TcpLinkMp, AtomicsFromSeveralPeersOntoOneWordAreExact) {
  // Ranks 1 and 2 hammer words of rank 0 (host and device memory) through their own links while rank 0 adds to
  // the host word with CPU atomics: the totals are exact and every fetch-add saw a distinct old value.
  const int n = 3;
  const uint64_t adds = 400;
  const uint64_t swaps = 40;
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(n, [&](int rank) {
    SocketBootstrap b(rank, n);
    b.Initialize(root, 60);
    if (rank == 0) {
      Mem host(64, false);
      Mem device(64, true);
      std::vector<uint8_t> init(64, 0);
      host.Set(init);
      device.Set(init);
      std::vector<std::unique_ptr<TcpLink>> links;
      for (int r = 1; r < n; ++r) {
        uint32_t hostKey = host.Key();
        uint32_t deviceKey = device.Key();
        b.Send(&hostKey, 4, r, 2);
        b.Send(&deviceKey, 4, r, 3);
        links.push_back(TcpLink::Connect(b, r, 1, Options(2, 4, 4096)));
      }
      auto* word = reinterpret_cast<uint64_t*>(host.Data() + 8);
      for (uint64_t i = 0; i < adds; ++i) AtomicFetchAdd(word, uint64_t{1000});
      std::set<uint64_t> seen;
      for (int r = 1; r < n; ++r) {
        std::vector<uint64_t> olds = [&] {
          std::vector<uint8_t> bytes = b.RecvBytes(r, 4);
          std::vector<uint64_t> v(bytes.size() / 8);
          std::memcpy(v.data(), bytes.data(), bytes.size());
          return v;
        }();
        EXPECT_EQ(olds.size(), adds);
        for (uint64_t v : olds) EXPECT_TRUE(seen.insert(v).second) << "old value " << v << " returned twice";
      }
      b.Barrier();  // every peer flushed
      EXPECT_EQ(AtomicLoad(word), adds * 1000 + adds * (1 + 2));
      uint64_t dev = 0;
      MORI_CHECK_GPU(GpuMemcpy(&dev, device.Data() + 16, 8));
      EXPECT_EQ(dev, (adds + swaps) * (n - 1));
      b.Barrier();
    } else {
      uint32_t hostKey = 0;
      uint32_t deviceKey = 0;
      b.Recv(&hostKey, 4, 0, 2);
      b.Recv(&deviceKey, 4, 0, 3);
      auto link = TcpLink::Connect(b, 0, 1, Options(2, 4, 4096));
      std::vector<uint64_t> olds(adds, ~0ull);
      for (uint64_t i = 0; i < adds; ++i) {
        link->FetchAdd(hostKey, 8, static_cast<uint64_t>(rank), &olds[i]);
        link->FetchAdd(deviceKey, 16, 1, nullptr);
      }
      // Increments by compare-and-swap on the device word, retried on contention.
      for (uint64_t i = 0; i < swaps; ++i) {
        uint64_t guess = 0;
        for (int attempt = 0;; ++attempt) {
          uint64_t old = ~0ull;
          link->CompareSwap(deviceKey, 16, guess, guess + 1, &old);
          link->Flush();
          if (old == guess) break;
          guess = old;
          if (attempt > 100000) {
            ADD_FAILURE() << "compare-and-swap never succeeded";
            return 1;
          }
        }
      }
      link->Flush();
      std::vector<uint8_t> bytes(olds.size() * 8);
      std::memcpy(bytes.data(), olds.data(), bytes.size());
      b.SendBytes(bytes, 0, 4);
      b.Barrier();
      b.Barrier();
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST(TcpLinkMp, ReceiverKilledMidTransferFailsTheSendersFlushNamingTheChannel) {
  const size_t bytes = 64 << 20;
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    test::ScopedEnv timeout("MORI_TIMEOUT_S", "30");
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    Mem buf(bytes, false);
    buf.Fill(rank, 1);
    uint32_t peerKey = Swap(b, 1 - rank, buf.Key(), 2);
    auto link = TcpLink::Connect(b, 1 - rank, 1, Options(4, 16, 256 << 10));
    if (rank == 1) {
      // Dies as soon as the transfer reaches the middle of the buffer.
      auto* probe = reinterpret_cast<uint64_t*>(buf.Data() + bytes / 2);
      uint64_t expected = 0;
      std::vector<uint8_t> pattern = Pattern(bytes / 2 + 8, 0, 1);
      std::memcpy(&expected, pattern.data() + bytes / 2, 8);
      WaitUntil([&] { return test::RacyLoad64(probe) == expected; }, 60);
      raise(SIGKILL);
    }
    std::pair<ErrorCode, std::string> err{ErrorCode::Internal, "(no error)"};
    for (int round = 0; round < 50 && err.second == "(no error)"; ++round) {
      err = CatchError([&] {
        link->Write(peerKey, 0, buf.Data(), false, bytes);
        link->Flush();
      });
    }
    EXPECT_EQ(err.first, ErrorCode::RemoteFailure) << err.second;
    EXPECT_TRUE(Contains(err.second, "channel ")) << err.second;
    EXPECT_TRUE(Contains(err.second, "rank 1")) << err.second;
    EXPECT_TRUE(Contains(err.second, "127.0.0.1:")) << err.second;  // the channel's addresses
    EXPECT_TRUE(link->Failed());
    // Everything after fails the same way, at once.
    auto again = CatchError([&] { link->Write(peerKey, 0, buf.Data(), false, 10); });
    EXPECT_EQ(again.second, err.second);
    link.reset();  // closing towards a dead peer returns
    return 0;
  });
  EXPECT_TRUE(outcomes[0].Ok()) << outcomes[0].Describe();
  EXPECT_EQ(outcomes[1].signal, SIGKILL) << outcomes[1].Describe();
}

bool ProcessStopped(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'T';
}

// A Flush that times out fails the link (what is queued may never complete) and returns only once the link's
// threads have let go of the caller's buffers; the stalled peer, resumed, finds the link failed.
TEST(TcpLinkMp, AFlushThatTimesOutFailsTheLinkWhileThePeerStalls) {
  const size_t bytes = 8 << 20;
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    Mem buf(bytes, false);
    buf.Fill(rank, 3);
    uint32_t peerKey = Swap(b, peer, buf.Key(), 2);
    auto link = TcpLink::Connect(b, peer, 1, Options(2, 2, 64 << 10));
    pid_t pid = getpid();
    pid_t peerPid = Swap(b, peer, pid, 3);
    if (rank == 1) {
      raise(SIGSTOP);  // rank 0 resumes it
    } else {
      if (!WaitUntil([&] { return ProcessStopped(peerPid); })) {
        ADD_FAILURE() << "rank 1 did not stop";
        kill(peerPid, SIGCONT);
        return 1;
      }
      link->Write(peerKey, 0, buf.Data(), false, bytes);
      auto err = CatchError([&] { link->Flush(300000); });
      EXPECT_EQ(err.first, ErrorCode::Timeout) << err.second;
      EXPECT_TRUE(Contains(err.second, "unacknowledged")) << err.second;
      EXPECT_TRUE(Contains(err.second, "the link is failed")) << err.second;
      EXPECT_TRUE(link->Failed());
      buf.Fill(rank, 4);  // the caller's memory is its own again: nothing sends from it any more
      EXPECT_EQ(CatchError([&] { link->Write(peerKey, 0, buf.Data(), false, 64); }).first, ErrorCode::Timeout);
      kill(peerPid, SIGCONT);
    }
    if (rank == 1) {
      EXPECT_TRUE(WaitUntil([&] { return link->Failed(); })) << "the resumed peer did not learn of the failure";
      auto err = CatchError([&] { link->Flush(); });
      EXPECT_EQ(err.first, ErrorCode::RemoteFailure) << err.second;
    }
    b.Barrier();
    return 0;
  });
}

// A read's data is held by the side that answers it only until it is on the wire, and the read is acknowledged
// only then, so a peer that keeps to its window makes that side hold at most window x chunk. A peer that
// does not (raw ReadRequests of 64 MiB, then it stops reading) is refused once it asks for more than 256 MiB
// unsent; before, every request was copied whole and held, without bound.
TEST(TcpLinkMp, ReadsBeyondTheWindowAreRefused) {
  const size_t bytes = 64 << 20;
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    Mem src(bytes, false);
    src.Fill(rank, 8);
    uint32_t peerKey = Swap(b, peer, src.Key(), 2);
    // Rank 1 reads nothing from its link (before, it stopped itself with SIGSTOP 500 ms after sending, and a
    // loaded machine let it take a reply first and fail the link for an unknown read).
    TcpLinkOptions options = Options(1, 4, 64 << 20);
    options.receive = rank == 0;
    auto link = TcpLink::Connect(b, peer, 1, options);
    if (rank == 1) {  // asks for 5 x 64 MiB at once, and never reads a reply
      std::vector<uint8_t> raw;
      for (uint64_t i = 1; i <= 5; ++i) {
        FrameHeader h = MakeFrame(FrameType::ReadRequest);
        h.key = peerKey;
        h.seq = i;
        h.id = i;
        h.arg0 = bytes;
        raw.insert(raw.end(), reinterpret_cast<uint8_t*>(&h), reinterpret_cast<uint8_t*>(&h) + sizeof(h));
      }
      link->InjectRawBytesForTest(0, raw);
    } else {
      EXPECT_TRUE(WaitUntil([&] { return link->Failed(); }, 60)) << "5 x 64 MiB of reads were all taken";
      auto err = CatchError([&] { link->Flush(); });
      EXPECT_EQ(err.first, ErrorCode::Protocol) << err.second;
      EXPECT_TRUE(Contains(err.second, "does not keep to its window")) << err.second;
    }
    b.Barrier();
    return 0;
  });
}

// Closing a link whose receiver is stuck (in a copy into GPU memory that never ends; here a test hook that
// blocks until released) returns within MORI_TIMEOUT_S and the goodbyes' bound, leaving the link's state to
// the stuck thread instead of waiting for it forever; the thread ends once it is let go. Before, the
// destructor joined it without a bound.
TEST(TcpLinkMp, ClosingALinkWhoseReceiverIsStuckReturnsWithinTheTimeout) {
  const size_t bytes = 64 << 10;
  RunPair([&](int rank, Bootstrap& b) {
    test::ScopedEnv timeout("MORI_TIMEOUT_S", "2");
    const int peer = 1 - rank;
    Mem target(bytes, false);
    target.Fill(rank, 21);
    uint32_t peerKey = Swap(b, peer, target.Key(), 2);
    auto stuck = std::make_shared<std::atomic<int>>(0);  // 1: inside the hook, 2: let go
    TcpLinkOptions options = Options(1);
    if (rank == 1) {
      options.beforeApplyForTest = [stuck] {
        stuck->store(1);
        Deadline bound = Deadline::After(60);
        while (stuck->load() != 2 && !bound.Expired()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      };
    }
    Mem src(bytes, false);  // before the link: rank 0's link (and its sender, still reading src) goes first
    src.Fill(rank, 22);
    auto link = TcpLink::Connect(b, peer, 1, options);
    if (rank == 0) link->Write(peerKey, 0, src.Data(), false, bytes);
    if (rank == 1) {
      EXPECT_TRUE(WaitUntil([&] { return stuck->load() == 1; })) << "the Write frame never reached the hook";
      ::testing::internal::CaptureStderr();
      auto start = std::chrono::steady_clock::now();
      link.reset();
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::string log = ::testing::internal::GetCapturedStderr();
      EXPECT_LT(took, 15.0) << "closing the link waited for its stuck receiver";
      EXPECT_GE(took, 1.5);
      EXPECT_NE(log.find("1 of 2 channel threads did not end within 4 s"), std::string::npos) << log;
      stuck->store(2);
      // Let go, the receiver ends on its own (applying the frame it holds: the registration keeps the target
      // alive until it lets go of it, so `target`'s deregistration below waits for that).
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    b.Barrier();
    return 0;
  });
}

// Reads larger than a chunk go out a chunk per request and come back whole, into host and device memory.
TEST(TcpLinkMp, ReadsOfManyChunksComeBackWhole) {
  const size_t bytes = (5 << 20) + 77;
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    Mem src(bytes, rank == 0);
    src.Fill(rank, 12);
    uint32_t peerKey = Swap(b, peer, src.Key(), 2);
    auto link = TcpLink::Connect(b, peer, 1, Options(3, 2, 256 << 10));
    Mem dst(bytes + 64, rank == 1);
    dst.Fill(rank, 13);
    link->Read(dst.Data() + 32, rank == 1, peerKey, 0, bytes);
    link->Flush();
    std::vector<uint8_t> got = dst.Contents();
    EXPECT_EQ(test::FirstPatternMismatch(got.data() + 32, bytes, peer, 12), bytes) << "the read's bytes";
    std::vector<uint8_t> guard = Pattern(bytes + 64, rank, 13);
    EXPECT_EQ(std::memcmp(got.data(), guard.data(), 32), 0) << "bytes before the read changed";
    EXPECT_EQ(std::memcmp(got.data() + 32 + bytes, guard.data() + 32 + bytes, 32), 0) << "bytes after it changed";
    b.Barrier();
    return 0;
  });
}

// A peer that sends a frame's bytes one at a time, slowly, holds the target only for MORI_TIMEOUT_S: the bound
// is on the frame, not on the silence between its bytes. Before, each byte restarted the clock.
TEST(TcpLinkMp, ATricklingPeerFailsTheLinkWithinTheTimeout) {
  RunPair([&](int rank, Bootstrap& b) {
    test::ScopedEnv timeout("MORI_TIMEOUT_S", "2");
    const int peer = 1 - rank;
    Mem target(4096, false);
    uint32_t peerKey = Swap(b, peer, target.Key(), 2);
    auto link = TcpLink::Connect(b, peer, 1, Options(1));
    if (rank == 1) {  // the trickler: a Write frame of 4096 bytes, then a byte every 200 ms for up to 12 s
      FrameHeader h = MakeFrame(FrameType::Write);
      h.key = peerKey;
      h.seq = 1;
      h.length = 4096;
      std::vector<uint8_t> raw(sizeof(h) + 16, 0x5c);
      std::memcpy(raw.data(), &h, sizeof(h));
      link->InjectRawBytesForTest(0, raw);
      Deadline budget = Deadline::After(12);
      while (!link->Failed() && !budget.Expired()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        link->InjectRawBytesForTest(0, {0x5c});
      }
      EXPECT_FALSE(budget.Expired()) << "the receiver was still taking a byte every 200 ms after 12 s";
    } else {
      EXPECT_TRUE(WaitUntil([&] { return link->Failed(); }, 20)) << "the trickle never failed the link";
      auto err = CatchError([&] { link->Flush(); });
      EXPECT_EQ(err.first, ErrorCode::Timeout) << err.second;
      EXPECT_TRUE(Contains(err.second, "too slow, or gone")) << err.second;
    }
    b.Barrier();
    return 0;
  });
}

TEST(TcpLinkMp, APeerClosingInOrderEndsTheLinkWithoutFailingCompletedWork) {
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    Mem buf(4096, false);
    uint32_t peerKey = Swap(b, peer, buf.Key(), 2);
    auto link = TcpLink::Connect(b, peer, 1, Options(2));
    std::vector<uint8_t> src = Pattern(4096, rank, 1);
    link->Write(peerKey, 0, src.data(), false, src.size());
    link->Flush();
    b.Barrier();
    if (rank == 1) {
      link.reset();
    } else {
      EXPECT_TRUE(WaitUntil([&] { return link->Failed(); })) << "the Close never arrived";
      link->Flush();  // nothing was outstanding
      auto err = CatchError([&] { link->Write(peerKey, 0, src.data(), false, 10); });
      EXPECT_EQ(err.first, ErrorCode::RemoteFailure);
      EXPECT_TRUE(Contains(err.second, "rank 1 closed the connection")) << err.second;
    }
    b.Barrier();
    return 0;
  });
}

// Waits for the other end to close `fd`; false if it stays open for `seconds`.
bool ClosedByPeer(int fd, double seconds = 30) {
  Deadline d = Deadline::After(seconds);
  while (!d.Expired()) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

TEST(TcpLinkMp, StrayConnectionsAtTheListenersAreRefused) {
  const size_t bytes = (1 << 20) + 17;
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    TcpLinkOptions o = Options(2, 4, 65536);
    TcpListener listener(o, rank);
    TcpHandle mine = listener.Handle();
    TcpLink::SendHandle(b, listener, peer, 1);
    std::vector<uint8_t> peerHandle = TcpLink::RecvHandle(b, peer, 1);
    if (rank == 1) {
      // Rank 0 accepts (lower rank): knock on its listeners first.
      TcpHandle target = DecodeHandle(peerHandle);
      Deadline d = Deadline::After(30);
      {
        UniqueFd raw = net::ConnectWithRetry(target.addresses[0], d, "rank 0's listener");
        std::string junk = "GET / HTTP/1.1\r\nHost: mori\r\n\r\n";
        junk.resize(200, 'x');
        net::SendAll(raw.Get(), junk.data(), junk.size(), d, "rank 0");
        EXPECT_TRUE(ClosedByPeer(raw.Get())) << "a connection sending junk was kept";
      }
      FrameHeader h = MakeFrame(FrameType::Hello);
      h.length = sizeof(HelloPayload);
      HelloPayload hello{};
      hello.nonce = target.nonce ^ 1;  // another connection's
      hello.senderNonce = mine.nonce;
      hello.channel = 1;
      hello.numChannels = 2;
      hello.rank = 1;
      for (int variant = 0; variant < 2; ++variant) {
        if (variant == 1) {
          hello.nonce = target.nonce;
          hello.channel = 0;  // right connection, wrong listener
        }
        UniqueFd raw = net::ConnectWithRetry(target.addresses[1], d, "rank 0's listener");
        net::SendAll(raw.Get(), &h, sizeof(h), d, "rank 0");
        net::SendAll(raw.Get(), &hello, sizeof(hello), d, "rank 0");
        EXPECT_TRUE(ClosedByPeer(raw.Get())) << "hello variant " << variant << " was accepted";
      }
    }
    TcpLink link(std::move(listener), peerHandle, peer, Deadline::After(60));
    if (rank == 0) {
      EXPECT_EQ(link.RefusedConnections(), 3);
    }
    ExchangeAndVerify(b, link, rank, bytes, false, {{3, 1, bytes - 5}}, 9, 2);
    return 0;
  });
}

TEST(TcpLinkMp, CorruptOrForbiddenFramesFailTheLinkAndWriteNothing) {
  struct Variant {
    const char* name;
    int channel;         // where the victim sees it
    const char* reason;  // in the victim's error
  };
  const std::vector<Variant> variants = {
      {"junk bytes", 1, "bad magic"},
      {"oversized length", 1, "outside [1, 67108864]"},
      {"sequence gap", 1, "sequence number 1000, expected 1"},
      {"unknown key", 0, "which is not registered here"},
      {"range outside the memory", 0, "which holds 65536 bytes"},
      {"read outside the memory", 0, "which holds 65536 bytes"},
      {"word update off channel 0", 1, "they travel on channel 0"},
  };
  const size_t bytes = 65536;
  RunPair([&](int rank, Bootstrap& b) {
    for (size_t v = 0; v < variants.size(); ++v) {
      const Variant& var = variants[v];
      SCOPED_TRACE(var.name);
      const int tag = 10 + static_cast<int>(v) * 4;
      Mem target(bytes, v % 2 == 1);
      target.Fill(rank, 50);
      uint32_t peerKey = Swap(b, 1 - rank, target.Key(), tag);
      // Declared before the link: its sender may still read queued writes from it until the link is gone.
      const std::vector<uint8_t> src = Pattern(bytes, 1, 51);
      auto link = TcpLink::Connect(b, 1 - rank, tag + 1, Options(2, 4, 4096));
      if (rank == 1) {  // the attacker
        FrameHeader h = MakeFrame(FrameType::Write);
        std::vector<uint8_t> raw;
        auto put = [&](const void* p, size_t n) {
          raw.insert(raw.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
        };
        switch (v) {
          case 0:
            raw.assign(200, 'x');
            break;
          case 1:
            h.key = peerKey;
            h.seq = 1;
            h.length = 1u << 30;
            put(&h, sizeof(h));
            break;
          case 2:
            h.key = peerKey;
            h.seq = 1000;
            h.length = 16;
            h.before = 1;
            put(&h, sizeof(h));
            put(src.data(), 16);
            break;
          case 3:
            link->Write(0xdead, 0, src.data(), false, 4096);
            break;
          case 4:
            link->Write(peerKey, bytes - 100, src.data(), false, 4096);
            break;
          case 5: {
            std::vector<uint8_t> out(200);
            link->Read(out.data(), false, peerKey, bytes - 10, 100);
            break;
          }
          case 6:
            h = MakeFrame(FrameType::Update);
            h.key = peerKey;
            h.seq = 1;
            h.arg0 = 0x1122334455667788ull;
            put(&h, sizeof(h));
            break;
        }
        if (!raw.empty()) link->InjectRawBytesForTest(var.channel, raw);
      }
      if (!WaitUntil([&] { return link->Failed(); })) {
        ADD_FAILURE() << "rank " << rank << ": the link did not fail";
      }
      auto err = CatchError([&] { link->Flush(); });
      if (rank == 0) {
        EXPECT_EQ(err.first, ErrorCode::Protocol) << err.second;
        EXPECT_TRUE(Contains(err.second, "channel " + std::to_string(var.channel) + " ")) << err.second;
        EXPECT_TRUE(Contains(err.second, var.reason)) << err.second;
        EXPECT_EQ(test::FirstPatternMismatch(target.Contents().data(), bytes, 0, 50), bytes)
            << "target memory was touched";
      } else {
        // The attacker learns why, from the victim's Fail frame or at least from the closed channels.
        EXPECT_EQ(err.first, ErrorCode::RemoteFailure) << err.second;
        EXPECT_TRUE(Contains(err.second, "rank 0")) << err.second;
      }
      link.reset();
      b.Barrier();
    }
    return 0;
  });
}

TEST(TcpLinkMp, MalformedHandlesAndMismatchedChannelCountsAreRefused) {
  RunPair([&](int rank, Bootstrap& b) {
    const int peer = 1 - rank;
    if (rank == 1) {
      TcpListener listener(Options(2), 1);
      std::vector<uint8_t> good = listener.HandleBytes();
      std::vector<uint8_t> badMagic = good;
      badMagic[0] ^= 0xff;
      b.SendBytes(badMagic, peer, 1);
      b.SendBytes(std::vector<uint8_t>(good.begin(), good.end() - 3), peer, 2);
      b.SendBytes(std::vector<uint8_t>(5000, 0), peer, 3);
      std::vector<uint8_t> noChannels = good;
      noChannels[6] = 0;  // count
      noChannels[7] = 0;
      b.SendBytes(noChannels, peer, 4);
    } else {
      auto expectRefused = [&](int tag, const std::string& part) {
        TcpListener listener(Options(2), 0);
        auto err = CatchError([&] {
          std::vector<uint8_t> bytes = TcpLink::RecvHandle(b, peer, tag);
          TcpLink link(std::move(listener), bytes, peer, Deadline::After(10));
        });
        EXPECT_EQ(err.first, ErrorCode::Protocol) << err.second;
        EXPECT_TRUE(Contains(err.second, part)) << err.second;
        EXPECT_TRUE(Contains(err.second, "rank 1")) << err.second;
      };
      expectRefused(1, "bad magic");
      expectRefused(2, "truncated");
      expectRefused(3, "malformed TCP handle of 5000 bytes");
      expectRefused(4, "0 channels, outside [1, 64]");
    }
    b.Barrier();
    // Both sides must ask for the same number of channels.
    auto err = CatchError([&] { TcpLink::Connect(b, peer, 9, Options(rank == 0 ? 2 : 4)); });
    EXPECT_EQ(err.first, ErrorCode::InvalidUsage) << err.second;
    EXPECT_TRUE(Contains(err.second, "same number")) << err.second;
    b.Barrier();
    return 0;
  });
}

EndpointConfig TcpConfig(int channels = 0, int window = 0, size_t chunk = 0) {
  EndpointConfig c;
  c.transport = Transport::Tcp;
  c.tcp.numChannels = channels;
  c.tcp.windowChunks = window;
  c.tcp.chunkBytes = chunk;
  c.tcp.ifnames = "lo";
  return c;
}

std::vector<uint8_t> ReadBack(const void* p, size_t bytes, bool device) {
  std::vector<uint8_t> v(bytes);
  if (device) {
    MORI_CHECK_GPU(GpuMemcpy(v.data(), p, bytes));
  } else {
    std::memcpy(v.data(), p, bytes);
  }
  return v;
}

void WriteTo(void* p, const std::vector<uint8_t>& v, bool device) {
  if (device) {
    MORI_CHECK_GPU(GpuMemcpy(p, v.data(), v.size()));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // landed before a peer's write may (see Mem::Set)
  } else {
    std::memcpy(p, v.data(), v.size());
  }
}

// A rank's loopback connection writes, updates and reads its own memory through the TCP receiver path, with
// one channel and a window of one, and with four channels and a window of 16; chunks that do not divide.
TEST(TcpLoopbackMp, WritesUpdatesAndReadsOfOwnMemory) {
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(1, [&](int rank) {
    auto b = std::make_shared<SocketBootstrap>(rank, 1);
    b->Initialize(root, 60);
    Communicator comm(b);
    const size_t bytes = (1 << 20) + 77;
    struct Case {
      int channels;
      int window;
      size_t chunk;
      bool device;
    };
    const std::vector<Case> cases = {{1, 1, 4096 + 5, false}, {4, 16, 65536 + 3, true}, {4, 16, 1000, false}};
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      SCOPED_TRACE(::testing::Message() << c.channels << " channels, window " << c.window << ", chunk " << c.chunk
                                        << (c.device ? ", device target" : ", host target"));
      std::vector<uint8_t> src(bytes);
      GpuBuffer dstDevice;
      std::vector<uint8_t> dstHost;
      uint8_t* dst = nullptr;
      if (c.device) {
        dstDevice = GpuBuffer(bytes, MemoryType::Device);
        dst = dstDevice.DataAs<uint8_t>();
      } else {
        dstHost.resize(bytes);
        dst = dstHost.data();
      }
      WriteTo(dst, Pattern(bytes, 0, 900), c.device);  // guard
      std::vector<uint64_t> flag(8, 0);
      std::vector<uint8_t> back = Pattern(bytes, 0, 901);
      RegisteredMemory srcMem = comm.RegisterMemory(src.data(), bytes, Transport::Tcp);
      RegisteredMemory dstMem = comm.RegisterMemory(dst, bytes, Transport::Tcp);
      RegisteredMemory flagMem = comm.RegisterMemory(flag.data(), 64, Transport::Tcp);
      RegisteredMemory backMem = comm.RegisterMemory(back.data(), bytes, Transport::Tcp);
      auto conn = comm.Connect(TcpConfig(c.channels, c.window, c.chunk), rank, static_cast<int>(ci)).get();
      EXPECT_EQ(conn->GetTransport(), Transport::Tcp);
      EXPECT_TRUE(Contains(conn->Describe(), "loopback")) << conn->Describe();

      // Rounds of data then flag: when the flag shows a round, the round's data is all there.
      const uint64_t n = bytes - 20;
      uint64_t local = 0;
      for (uint64_t r = 1; r <= 12; ++r) {
        test::FillPattern(src.data(), bytes, 0, static_cast<uint32_t>(r));
        conn->Write(dstMem, 13, srcMem, 3, n);
        conn->UpdateAndSync(flagMem, 16, &local, r);
        EXPECT_EQ(local, r);
        if (!WaitUntil([&] { return AtomicLoad(&flag[2]) == r; })) {
          ADD_FAILURE() << "round " << r << ": the update never came";
          return 1;
        }
        conn->Flush();  // the senders are done with `src` before the next round refills it
        std::vector<uint8_t> got = ReadBack(dst, bytes, c.device);
        std::vector<uint8_t> expected = Pattern(bytes, 0, 900);
        for (uint64_t i = 0; i < n; ++i) expected[13 + i] = test::PatternByte(0, 3 + i, static_cast<uint32_t>(r));
        size_t diff = FirstDiff(got, expected);
        if (diff != bytes) {
          ADD_FAILURE() << "round " << r << ": first wrong byte at " << diff;
          return 1;
        }
      }
      EXPECT_EQ(flag[0] + flag[1] + flag[3], 0u) << "words beside the flag were touched";
      conn->Read(backMem, 5, dstMem, 1, bytes - 9);
      conn->Flush();
      std::vector<uint8_t> expectedBack = Pattern(bytes, 0, 901);
      std::vector<uint8_t> now = ReadBack(dst, bytes, c.device);
      for (size_t i = 0; i < bytes - 9; ++i) expectedBack[5 + i] = now[1 + i];
      EXPECT_EQ(FirstDiff(back, expectedBack), bytes);
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Rank 0's loopback and ranks 1 and 2 add to and compare-and-swap words of rank 0 (host and device memory)
// while rank 0 also adds to the host word with CPU atomics: exact totals, no old value seen twice.
TEST(TcpLoopbackMp, LoopbackAtomicsAreAtomicWithThePeersAtomics) {
  const int n = 3;
  const uint64_t adds = 300;
  const uint64_t swaps = 30;
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(n, [&](int rank) {
    auto b = std::make_shared<SocketBootstrap>(rank, n);
    b->Initialize(root, 60);
    Communicator comm(b);
    std::vector<uint64_t> hostWords(8, 0);
    GpuBuffer deviceWords(64, MemoryType::Device);
    MORI_CHECK_GPU(GpuMemset(deviceWords.Data(), 0, 64));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // a memset of device memory returns before it runs
    std::vector<uint8_t> mine(256, static_cast<uint8_t>(rank));
    RegisteredMemory hostMem = comm.RegisterMemory(hostWords.data(), 64, Transport::Tcp);
    RegisteredMemory deviceMem = comm.RegisterMemory(deviceWords.Data(), 64, Transport::Tcp);
    RegisteredMemory mineMem = comm.RegisterMemory(mine.data(), mine.size(), Transport::Tcp);
    std::shared_ptr<Connection> conn;
    std::vector<std::shared_ptr<Connection>> peerEnds;
    RegisteredMemory hostTarget;
    RegisteredMemory deviceTarget;
    if (rank == 0) {
      for (int r = 1; r < n; ++r) {
        comm.SendMemory(hostMem, r, 1);
        comm.SendMemory(deviceMem, r, 2);
      }
      conn = comm.Connect(TcpConfig(2, 4, 4096), 0, 9).get();
      hostTarget = hostMem;
      deviceTarget = deviceMem;
      // A loopback connection reaches only this process's memory.
      RegisteredMemory peers = comm.RecvMemory(1, 3).get();
      auto err = CatchError([&] { conn->Write(peers, 0, mineMem, 0, 16); });
      EXPECT_EQ(err.first, ErrorCode::InvalidUsage) << err.second;
      EXPECT_TRUE(Contains(err.second, "must be memory of this process")) << err.second;
      std::vector<std::shared_future<std::shared_ptr<Connection>>> made;
      for (int r = 1; r < n; ++r) made.push_back(comm.Connect(TcpConfig(2, 4, 4096), r, 5));
      for (auto& f : made) peerEnds.push_back(f.get());  // the peers' connections end here
    } else {
      hostTarget = comm.RecvMemory(0, 1).get();
      deviceTarget = comm.RecvMemory(0, 2).get();
      if (rank == 1) comm.SendMemory(mineMem, 0, 3);
      conn = comm.Connect(TcpConfig(2, 4, 4096), 0, 5).get();
    }
    b->Barrier();

    const uint64_t add = static_cast<uint64_t>(rank) + 1;
    std::vector<uint64_t> olds(adds, ~0ull);
    for (uint64_t i = 0; i < adds; ++i) {
      conn->AtomicFetchAdd(hostTarget, 8, add, &olds[i]);
      conn->AtomicFetchAdd(deviceTarget, 16, 1, nullptr);
      if (rank == 0) AtomicFetchAdd(&hostWords[1], uint64_t{1000000});
    }
    for (uint64_t i = 0, seen = 0; i < swaps;) {
      uint64_t old = ~0ull;
      conn->AtomicCompareSwap(deviceTarget, 24, seen, seen + 1, &old);
      conn->Flush();
      if (old == seen) ++i;
      seen = old == seen ? seen + 1 : old;
    }
    conn->Flush();
    for (uint64_t i = 1; i < adds; ++i) {
      if (olds[i] <= olds[i - 1]) {
        ADD_FAILURE() << "rank " << rank << ": fetch-add " << i << " saw " << olds[i] << " after " << olds[i - 1];
        return 1;
      }
    }
    if (rank != 0) {
      std::vector<uint8_t> bytes(olds.size() * 8);
      std::memcpy(bytes.data(), olds.data(), bytes.size());
      b->SendBytes(bytes, 0, 4);
    } else {
      std::set<uint64_t> seen(olds.begin(), olds.end());
      for (int r = 1; r < n; ++r) {
        std::vector<uint8_t> bytes = b->RecvBytes(r, 4);
        EXPECT_EQ(bytes.size(), adds * 8);
        std::vector<uint64_t> theirs(bytes.size() / 8);
        std::memcpy(theirs.data(), bytes.data(), bytes.size());
        for (uint64_t v : theirs) EXPECT_TRUE(seen.insert(v).second) << "old value " << v << " returned twice";
      }
    }
    b->Barrier();  // every rank flushed
    if (rank == 0) {
      EXPECT_EQ(AtomicLoad(&hostWords[1]), adds * 1000000 + adds * (1 + 2 + 3));
      uint64_t dev[4] = {};
      MORI_CHECK_GPU(GpuMemcpy(dev, deviceWords.Data(), sizeof(dev)));
      EXPECT_EQ(dev[2], adds * n);
      EXPECT_EQ(dev[3], swaps * n);
      EXPECT_EQ(dev[0] + dev[1] + hostWords[0] + hostWords[2], 0u) << "neighbouring words were touched";
    }
    b->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Two namespaces joined by two veth pairs (10.<t>.0.0/24 and 10.<t>.1.0/24): four channels, two per pair.
class TcpTwoHosts : public ::testing::Test {
 protected:
  static int Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
    if (Sh("command -v ip") != 0) GTEST_SKIP() << "the ip command (iproute2) is not installed";
    const std::string id = std::to_string(getpid() % 100000);
    const int t = static_cast<int>(getpid() % 200) + 30;
    nsA_ = "mori_ta" + id;
    nsB_ = "mori_tb" + id;
    if (Sh("ip netns add " + nsA_) != 0) GTEST_SKIP() << "creating a network namespace is not permitted here";
    created_ = true;
    bool ok = Sh("ip netns add " + nsB_) == 0;
    for (int pair = 0; pair < 2 && ok; ++pair) {
      std::string va = "mta" + std::to_string(pair) + "_" + id;
      std::string vb = "mtb" + std::to_string(pair) + "_" + id;
      std::string net = "10." + std::to_string(t) + "." + std::to_string(pair) + ".";
      ifA_.push_back(va);
      ifB_.push_back(vb);
      addrA_.push_back(net + "1");
      addrB_.push_back(net + "2");
      ok = Sh("ip link add " + va + " type veth peer name " + vb) == 0 &&
           Sh("ip link set " + va + " netns " + nsA_) == 0 && Sh("ip link set " + vb + " netns " + nsB_) == 0 &&
           Sh("ip -n " + nsA_ + " addr add " + net + "1/24 dev " + va) == 0 &&
           Sh("ip -n " + nsB_ + " addr add " + net + "2/24 dev " + vb) == 0 &&
           Sh("ip -n " + nsA_ + " link set " + va + " up") == 0 && Sh("ip -n " + nsB_ + " link set " + vb + " up") == 0;
    }
    ok = ok && Sh("ip -n " + nsA_ + " link set lo up") == 0 && Sh("ip -n " + nsB_ + " link set lo up") == 0;
    if (!ok) GTEST_SKIP() << "could not build the veth links between namespaces (not permitted here?)";
  }

  void TearDown() override {
    if (!created_) return;
    Sh("ip netns del " + nsA_);
    Sh("ip netns del " + nsB_);
  }

  static bool Enter(const std::string& ns) {
    int fd = open(("/var/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = setns(fd, CLONE_NEWNET) == 0;
    close(fd);
    return ok;
  }

  std::string nsA_, nsB_;
  std::vector<std::string> ifA_, ifB_, addrA_, addrB_;
  bool created_ = false;
};

TEST_F(TcpTwoHosts, ChannelsSpreadOverBothLinksBetweenNamespaces) {
  const size_t bytes = (16 << 20) + 3;
  const std::string root = addrA_[0] + ":" + std::to_string(test::FreeTcpPort());
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    if (!Enter(rank == 0 ? nsA_ : nsB_)) {
      ADD_FAILURE() << "cannot enter the namespace";
      return 1;
    }
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    const auto& ifs = rank == 0 ? ifA_ : ifB_;
    const auto& addrs = rank == 0 ? addrA_ : addrB_;
    auto link = TcpLink::Connect(b, 1 - rank, 1, Options(4, 16, 256 << 10, ifs));
    for (const auto& info : link->Channels()) {
      EXPECT_EQ(info.ifname, ifs[static_cast<size_t>(info.index) % 2]);
      EXPECT_EQ(info.local.HostString(), addrs[static_cast<size_t>(info.index) % 2]) << "channel " << info.index;
    }
    ExchangeAndVerify(b, *link, rank, bytes, false, {{1, 2, bytes - 3}}, 61, 2);
    for (const auto& info : link->Channels()) EXPECT_GT(info.bytesReceived, 0u) << "channel " << info.index;
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A partition that drops every packet without a reset (the peer's veth goes down) is noticed within about
// MORI_TIMEOUT_S by both ends of an idle link, through keepalive and TCP_USER_TIMEOUT; before, an idle link
// waited for as long as the partition lasted. The bootstrap runs over the other veth pair, which stays up.
TEST_F(TcpTwoHosts, APartitionFailsAnIdleLinkOnBothEnds) {
  const std::string root = addrA_[0] + ":" + std::to_string(test::FreeTcpPort());
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    if (!Enter(rank == 0 ? nsA_ : nsB_)) {
      ADD_FAILURE() << "cannot enter the namespace";
      return 1;
    }
    test::ScopedEnv timeout("MORI_TIMEOUT_S", "3");
    SocketBootstrap b(rank, 2);
    b.Initialize(root, 60);
    const auto& ifs = rank == 0 ? ifA_ : ifB_;
    auto link = TcpLink::Connect(b, 1 - rank, 1, Options(1, 16, 64 << 10, {ifs[1]}));
    ExchangeAndVerify(b, *link, rank, 100000, false, {{0, 0, 100000}}, 71, 2);  // the link works
    if (rank == 0 && Sh("ip -n " + nsB_ + " link set " + ifB_[1] + " down") != 0) {
      ADD_FAILURE() << "could not take the veth down";
    }
    EXPECT_TRUE(WaitUntil([&] { return link->Failed(); }, 30)) << "rank " << rank << ": the partition went unnoticed";
    auto err = CatchError([&] { link->Flush(); });
    EXPECT_NE(err.first, ErrorCode::Internal) << err.second;
    b.Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

}  // namespace
}  // namespace mori::core::tcp
