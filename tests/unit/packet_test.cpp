// LL packets in one process: the slot layout, write/read round trips, a producer block and a consumer block
// over many rounds of one reused buffer, stale and torn packets refused, bounded reads that trap; and a
// memory channel's device handle in loopback (its own memory as the "peer"): packets, copies, range checks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/memory_channel_device.hpp"
#include "mori/channels/packet.hpp"

namespace mori::core {
namespace {

constexpr uint64_t kTimeoutNs = 20'000'000'000ull;  // a correct test never comes near it

// The data of packet `index` in round `round`: differs in every bit position across rounds and indices.
MORI_HOST_DEVICE_INLINE uint64_t RoundWord(uint32_t round, uint64_t index) {
  uint64_t x = (uint64_t{round} + 1) * 0x9E3779B97F4A7C15ull ^ (index + 1) * 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

// Packet-type helpers so that one kernel serves LL16 (8 data bytes) and LL8 (4).
template <typename P>
MORI_HOST_DEVICE_INLINE uint64_t DataMask() {
  return P::kDataBytes == 8 ? ~0ull : 0xFFFFFFFFull;
}

#if MORI_DEVICE_API_AVAILABLE
template <typename P>
MORI_DEVICE_INLINE void WritePacket(P* p, uint64_t word, uint32_t flag) {
  if constexpr (P::kDataBytes == 8) {
    p->Write(word, flag);
  } else {
    p->Write(static_cast<uint32_t>(word), flag);
  }
}

template <typename P>
MORI_DEVICE_INLINE bool ReadPacketOnce(const P* p, uint32_t flag, uint64_t* word) {
  if constexpr (P::kDataBytes == 8) {
    return p->ReadOnce(flag, word);
  } else {
    uint32_t d = 0;
    bool ok = p->ReadOnce(flag, &d);
    *word = d;
    return ok;
  }
}
#endif

// Thread t writes packets t, t + T, ... of round `flag`, then reads the packets in reverse order (so mostly
// ones other threads write, perhaps not yet written) into out.
template <typename P>
MORI_GLOBAL void WriteThenReadReversed(P* packets, uint32_t n, uint32_t flag, uint64_t* out, uint64_t timeoutNs) {
  const unsigned t = GlobalThreadIdx(), threads = GlobalThreadCount();
  for (uint32_t i = t; i < n; i += threads) WritePacket(&packets[i], RoundWord(flag, i), flag);
  for (uint32_t i = t; i < n; i += threads) {
    const uint32_t j = n - 1 - i;
    out[j] = packets[j].Read(flag, timeoutNs);
  }
}

// One look at each packet for `flag`: accepted[i] is 1 and out[i] its data when it was accepted.
template <typename P>
MORI_GLOBAL void ProbePackets(const P* packets, uint32_t n, uint32_t flag, uint32_t* accepted, uint64_t* out) {
  for (uint32_t i = GlobalThreadIdx(); i < n; i += GlobalThreadCount()) {
    uint64_t word = 0;
    accepted[i] = ReadPacketOnce(&packets[i], flag, &word) ? 1u : 0u;
    out[i] = word;
  }
}

template <typename P>
MORI_GLOBAL void ReadOne(const P* packet, uint32_t flag, uint64_t* out, uint64_t timeoutNs) {
  *out = packet->Read(flag, timeoutNs);
}

MORI_DEVICE_INLINE uint32_t FlagOf(uint32_t flagBase, uint32_t round) { return flagBase + round; }

// Block 0 produces rounds 1..rounds into two slots of n packets (round r in slot r % 2), block 1 consumes
// them. The producer reuses a slot only after the consumer acknowledged the round it held, so while the
// consumer waits for round r its slot still holds round r - 2: a stale packet that must be refused. Every
// accepted packet is checked against the data of its round.
template <typename P>
MORI_GLOBAL void ProducerConsumer(P* slots, uint32_t n, uint32_t rounds, uint32_t flagBase, uint32_t* ack,
                                  uint32_t* errors, uint64_t* firstBad, uint64_t timeoutNs) {
  const unsigned t = FlatThreadIdx(), threads = FlatBlockDim();
  if (BlockIdxX() == 0) {
    for (uint32_t r = 1; r <= rounds; ++r) {
      if (t == 0 && r > 2) {
        SpinDeadline deadline(timeoutNs);
        while (AtomicLoad<MemoryOrder::Acquire, Scope::Device>(ack) < r - 2) {
          MORI_DEVICE_ASSERT(!deadline.Expired(), "producer waited %llu ns for the consumer to finish round %u",
                             static_cast<unsigned long long>(timeoutNs), r - 2);
          SpinPause();
        }
      }
      SyncThreads();
      P* slot = slots + static_cast<size_t>(r % 2) * n;
      for (uint32_t i = t; i < n; i += threads) WritePacket(&slot[i], RoundWord(r, i), FlagOf(flagBase, r));
    }
  } else {
    for (uint32_t r = 1; r <= rounds; ++r) {
      const P* slot = slots + static_cast<size_t>(r % 2) * n;
      for (uint32_t i = t; i < n; i += threads) {
        uint64_t got = slot[i].Read(FlagOf(flagBase, r), timeoutNs);
        if (got != (RoundWord(r, i) & DataMask<P>())) {
          if (AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(errors, 1u) == 0) {
            firstBad[0] = r;
            firstBad[1] = i;
            firstBad[2] = got;
          }
        }
      }
      SyncThreads();
      if (t == 0) AtomicStore<MemoryOrder::Release, Scope::Device>(ack, r);
    }
  }
}

// Device memory the test reads back; freed at scope end.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n, int fill = 0) : buffer_(n * sizeof(T)), n_(n) {
    EXPECT_EQ(GpuMemset(buffer_.Data(), fill, n * sizeof(T)), kGpuSuccess);
  }
  T* Data() const { return buffer_.DataAs<T>(); }
  std::vector<T> Read() const {
    std::vector<T> out(n_);
    EXPECT_EQ(GpuMemcpy(out.data(), buffer_.Data(), n_ * sizeof(T)), kGpuSuccess);
    return out;
  }

 private:
  GpuBuffer buffer_;
  size_t n_;
};

class Packets : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (GpuGetDeviceCount(&n) != kGpuSuccess || n == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
    ASSERT_EQ(GpuSetDevice(0), kGpuSuccess);
  }
};

// The layout is the contract between writer and reader on different GPUs: data and flag in each 8-byte half.
TEST_F(Packets, SlotLayoutCarriesTheFlagBesideEachDataWord) {
  constexpr uint32_t kN = 5;
  DeviceArray<LL16Packet> ll16(kN);
  DeviceArray<LL8Packet> ll8(kN);
  DeviceArray<uint64_t> out(kN);
  LaunchKernel(WriteThenReadReversed<LL16Packet>, Dim3(1), Dim3(kN), 0, nullptr, ll16.Data(), kN, 0xABCD1234u,
               out.Data(), kTimeoutNs);
  LaunchKernel(WriteThenReadReversed<LL8Packet>, Dim3(1), Dim3(kN), 0, nullptr, ll8.Data(), kN, 0x5EEDu, out.Data(),
               kTimeoutNs);
  ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
  auto slots16 = ll16.Read();
  auto slots8 = ll8.Read();
  for (uint32_t i = 0; i < kN; ++i) {
    const uint64_t w16 = RoundWord(0xABCD1234u, i);
    EXPECT_EQ(slots16[i].data1, static_cast<uint32_t>(w16)) << i;
    EXPECT_EQ(slots16[i].flag1, 0xABCD1234u) << i;
    EXPECT_EQ(slots16[i].data2, static_cast<uint32_t>(w16 >> 32)) << i;
    EXPECT_EQ(slots16[i].flag2, 0xABCD1234u) << i;
    EXPECT_EQ(slots8[i].data, static_cast<uint32_t>(RoundWord(0x5EEDu, i))) << i;
    EXPECT_EQ(slots8[i].flag, 0x5EEDu) << i;
  }
}

template <typename P>
void RoundTripsInOneBuffer() {
  // Odd count, several blocks, threads reading packets others write; then the same buffer again with other
  // flags, and each round's data must be that round's.
  constexpr uint32_t kN = 1021;
  DeviceArray<P> packets(kN);
  DeviceArray<uint64_t> out(kN);
  DeviceArray<uint32_t> accepted(kN);
  DeviceArray<uint64_t> probed(kN);
  const uint32_t flags[] = {1u, 2u, 0x80000000u, 0xFFFFFFFFu, 3u};
  uint32_t previous = 0;
  for (uint32_t flag : flags) {
    LaunchKernel(WriteThenReadReversed<P>, Dim3(3), Dim3(32), 0, nullptr, packets.Data(), kN, flag, out.Data(),
                 kTimeoutNs);
    ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess) << "flag " << flag;
    auto got = out.Read();
    for (uint32_t i = 0; i < kN; ++i) {
      ASSERT_EQ(got[i], RoundWord(flag, i) & DataMask<P>()) << "packet " << i << " of flag " << flag;
    }
    // The previous round's flag no longer matches anything, this round's matches everything.
    LaunchKernel(ProbePackets<P>, Dim3(2), Dim3(64), 0, nullptr, packets.Data(), kN, previous, accepted.Data(),
                 probed.Data());
    ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
    auto stale = accepted.Read();
    for (uint32_t i = 0; i < kN; ++i) ASSERT_EQ(stale[i], 0u) << "packet " << i << " accepted stale flag " << previous;
    LaunchKernel(ProbePackets<P>, Dim3(2), Dim3(64), 0, nullptr, packets.Data(), kN, flag, accepted.Data(),
                 probed.Data());
    ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
    auto fresh = accepted.Read();
    auto data = probed.Read();
    for (uint32_t i = 0; i < kN; ++i) {
      ASSERT_EQ(fresh[i], 1u) << "packet " << i << " of flag " << flag;
      ASSERT_EQ(data[i], RoundWord(flag, i) & DataMask<P>()) << "packet " << i;
    }
    previous = flag;
  }
}

TEST_F(Packets, LL16RoundTripsInOneBuffer) { RoundTripsInOneBuffer<LL16Packet>(); }
TEST_F(Packets, LL8RoundTripsInOneBuffer) { RoundTripsInOneBuffer<LL8Packet>(); }

template <typename P>
void ProducerAndConsumerOverManyRounds() {
  // Two blocks of one launch (co-resident on every backend with a grid this small).
#if MORI_BACKEND_HOST
  constexpr uint32_t kThreads = 16, kN = 131, kRounds = 1000;
#else
  constexpr uint32_t kThreads = 256, kN = 4099, kRounds = 2000;
#endif
  // Flags wrap through zero halfway; by then both slots hold non-zero flags of earlier rounds.
  const uint32_t flagBase = 0u - kRounds / 2;
  DeviceArray<P> slots(2 * kN);
  DeviceArray<uint32_t> ack(1);
  DeviceArray<uint32_t> errors(1);
  DeviceArray<uint64_t> firstBad(3);
  LaunchKernel(ProducerConsumer<P>, Dim3(2), Dim3(kThreads), 0, nullptr, slots.Data(), kN, kRounds, flagBase,
               ack.Data(), errors.Data(), firstBad.Data(), kTimeoutNs);
  ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
  auto bad = firstBad.Read();
  EXPECT_EQ(errors.Read()[0], 0u) << "first wrong packet: round " << bad[0] << " index " << bad[1] << " data "
                                  << bad[2];
  EXPECT_EQ(ack.Read()[0], kRounds);
}

TEST_F(Packets, LL16ProducerAndConsumerOverManyRounds) { ProducerAndConsumerOverManyRounds<LL16Packet>(); }
TEST_F(Packets, LL8ProducerAndConsumerOverManyRounds) { ProducerAndConsumerOverManyRounds<LL8Packet>(); }

// The host writes one 8-byte half of a packet at a time into host-pinned memory the GPU reads.
void StoreHalf(LL16Packet* p, int half, uint32_t data, uint32_t flag) {
  AtomicStore<MemoryOrder::Release>(reinterpret_cast<uint64_t*>(p) + half, uint64_t{data} | (uint64_t{flag} << 32));
}

TEST_F(Packets, TornLL16HalvesAreRefusedUntilBothArrive) {
  GpuBuffer mem(sizeof(LL16Packet) * 2, MemoryType::HostPinned);
  auto* packets = mem.DataAs<LL16Packet>();
  DeviceArray<uint32_t> accepted(2);
  DeviceArray<uint64_t> out(2);
  const uint64_t word5 = RoundWord(5, 0), word6 = RoundWord(6, 0);
  auto probe = [&](uint32_t flag) {
    LaunchKernel(ProbePackets<LL16Packet>, Dim3(1), Dim3(2), 0, nullptr, packets, 2u, flag, accepted.Data(), out.Data());
    EXPECT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
    return accepted.Read();
  };
  // Both packets whole at round 5.
  for (int p = 0; p < 2; ++p) {
    StoreHalf(&packets[p], 0, static_cast<uint32_t>(word5), 5);
    StoreHalf(&packets[p], 1, static_cast<uint32_t>(word5 >> 32), 5);
  }
  EXPECT_EQ(probe(5), (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(out.Read()[0], word5);
  // Round 6 arrives half at a time: packet 0 low half first, packet 1 high half first.
  StoreHalf(&packets[0], 0, static_cast<uint32_t>(word6), 6);
  StoreHalf(&packets[1], 1, static_cast<uint32_t>(word6 >> 32), 6);
  EXPECT_EQ(probe(6), (std::vector<uint32_t>{0, 0})) << "half of round 6 was accepted";
  EXPECT_EQ(probe(5), (std::vector<uint32_t>{0, 0})) << "a packet half overwritten by round 6 passed as round 5";
  StoreHalf(&packets[0], 1, static_cast<uint32_t>(word6 >> 32), 6);
  StoreHalf(&packets[1], 0, static_cast<uint32_t>(word6), 6);
  EXPECT_EQ(probe(6), (std::vector<uint32_t>{1, 1}));
  auto data = out.Read();
  EXPECT_EQ(data[0], word6);
  EXPECT_EQ(data[1], word6);

  // A reader already waiting for round 7 stays waiting on half a packet and takes the whole one.
  GpuStream stream = nullptr;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  const uint64_t word7 = RoundWord(7, 0);
  LaunchKernel(ReadOne<LL16Packet>, Dim3(1), Dim3(1), 0, stream, static_cast<const LL16Packet*>(packets), 7u,
               out.Data(), kTimeoutNs);
  StoreHalf(&packets[0], 1, static_cast<uint32_t>(word7 >> 32), 7);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(GpuStreamQuery(stream), kGpuErrorNotReady) << "the reader accepted half a packet";
  StoreHalf(&packets[0], 0, static_cast<uint32_t>(word7), 7);
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  EXPECT_EQ(out.Read()[0], word7);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
}

template <typename P>
std::string ReadThatNeverCompletes(uint32_t flag, uint64_t timeoutNs) {
  DeviceArray<P> packet(1);
  DeviceArray<uint64_t> out(1);
  testing::internal::CaptureStderr();
  LaunchKernel(ReadOne<P>, Dim3(1), Dim3(1), 0, nullptr, static_cast<const P*>(packet.Data()), flag, out.Data(),
               timeoutNs);
  GpuStatus s = GpuDeviceSynchronize();
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(s, kGpuSuccess) << "a read of a flag that never comes must trap";
  return log;
}

TEST_F(Packets, AReadOfAFlagThatNeverComesTrapsNamingIt) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "a device trap ends the GPU context; the HOST backend tests the message";
  std::string log16 = ReadThatNeverCompletes<LL16Packet>(7, 30'000'000);
  EXPECT_NE(log16.find("LL16 packet"), std::string::npos) << log16;
  EXPECT_NE(log16.find("flag 7 did not arrive within 30000000 ns (seen 0/0)"), std::string::npos) << log16;
  std::string log8 = ReadThatNeverCompletes<LL8Packet>(9, 30'000'000);
  EXPECT_NE(log8.find("LL8 packet"), std::string::npos) << log8;
  EXPECT_NE(log8.find("flag 9 did not arrive within 30000000 ns"), std::string::npos) << log8;
}

// ---- A memory channel's device handle in loopback: this process's own memory plays the peer's. ----

// The handle as MemoryChannel fills it, over local buffers: `peer` is the destination and also where packets
// arrive (what the peer's PutPackets would target is our own packet buffer), `mine` the source. The
// semaphore signals itself.
struct Loopback {
  GpuBuffer peer;
  GpuBuffer mine;
  GpuBuffer tokens{4 * sizeof(uint64_t)};
  MemoryChannelDeviceHandle handle{};

  Loopback(size_t peerBytes, size_t mineBytes) : peer(peerBytes), mine(mineBytes) {
    EXPECT_EQ(GpuMemset(peer.Data(), 0, peer.Bytes()), kGpuSuccess);
    EXPECT_EQ(GpuMemset(mine.Data(), 0, mine.Bytes()), kGpuSuccess);
    EXPECT_EQ(GpuMemset(tokens.Data(), 0, tokens.Bytes()), kGpuSuccess);
    auto* t = tokens.DataAs<uint64_t>();
    handle.semaphore.inboundToken = &t[0];
    handle.semaphore.expectedInboundToken = &t[1];
    handle.semaphore.outboundToken = &t[2];
    handle.semaphore.remoteInboundToken = &t[0];
    handle.semaphore.timeoutNs = kTimeoutNs;
    handle.semaphore.rank = 3;
    handle.semaphore.remoteRank = 3;
    handle.dst = peer.Data();
    handle.src = mine.Data();
    handle.packetBuffer = peer.Data();
    handle.dstBytes = peer.Bytes();
    handle.srcBytes = mine.Bytes();
    handle.packetBufferBytes = peer.Bytes();
  }
};

// Sends [srcOffset, + bytes) as packets into the packet buffer at packetOffset, then unpacks them to
// [dstOffset, + bytes) in `mine`: the whole grid on both sides, a block reading packets another block wrote.
template <typename P>
MORI_GLOBAL void LoopbackPackets(MemoryChannelDeviceHandle ch, uint64_t packetOffset, uint64_t srcOffset,
                                 uint64_t dstOffset, uint64_t bytes, uint32_t flag) {
  ch.PutPackets<P>(packetOffset, srcOffset, bytes, GlobalThreadIdx(), GlobalThreadCount(), flag);
  // Reversed thread numbering: each thread unpacks packets another thread sent.
  ch.UnpackPackets<P>(dstOffset, packetOffset, bytes, GlobalThreadCount() - 1 - GlobalThreadIdx(),
                      GlobalThreadCount(), flag);
}

template <typename P>
void LoopbackPacketRounds() {
  constexpr size_t kBytes = 4096 + 8 * 13;  // a multiple of both packets' data bytes
  constexpr size_t kSrc = 64, kDst = kSrc + kBytes + 64, kMine = kDst + kBytes + 40;
  constexpr size_t kPacketOffset = 2 * sizeof(P), kPeer = kPacketOffset + kBytes / P::kDataBytes * sizeof(P) + 48;
  Loopback lb(kPeer, kMine);
  for (uint32_t round = 1; round <= 6; ++round) {
    const uint32_t flag = round * 0x01010101u;
    // The source holds this round's pattern; everything else starts as guard bytes.
    std::vector<uint8_t> mine(kMine, 0xA5);
    test::FillPattern(mine.data() + kSrc, kBytes, static_cast<int>(round));
    ASSERT_EQ(GpuMemcpy(lb.mine.Data(), mine.data(), kMine), kGpuSuccess);
    LaunchKernel(LoopbackPackets<P>, Dim3(2), Dim3(24), 0, nullptr, lb.handle, uint64_t{kPacketOffset},
                 uint64_t{kSrc}, uint64_t{kDst}, uint64_t{kBytes}, flag);
    ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess) << "round " << round;
    std::vector<uint8_t> after(kMine);
    ASSERT_EQ(GpuMemcpy(after.data(), lb.mine.Data(), kMine), kGpuSuccess);
    EXPECT_EQ(test::FirstPatternMismatch(after.data() + kDst, kBytes, static_cast<int>(round)), kBytes)
        << "round " << round;
    for (size_t i = 0; i < kMine; ++i) {
      if (i >= kDst && i < kDst + kBytes) continue;
      ASSERT_EQ(after[i], mine[i]) << "byte " << i << " outside the unpacked range changed in round " << round;
    }
    std::vector<uint8_t> peer(kPeer);
    ASSERT_EQ(GpuMemcpy(peer.data(), lb.peer.Data(), kPeer), kGpuSuccess);
    for (size_t i = 0; i < kPeer; ++i) {
      if (i >= kPacketOffset && i < kPeer - 48) continue;
      ASSERT_EQ(peer[i], 0) << "byte " << i << " of the packet buffer outside the packets changed in round " << round;
    }
  }
}

TEST_F(Packets, LL16ThroughAMemoryChannelHandleInLoopback) { LoopbackPacketRounds<LL16Packet>(); }
TEST_F(Packets, LL8ThroughAMemoryChannelHandleInLoopback) { LoopbackPacketRounds<LL8Packet>(); }

// One misuse of the handle, chosen by `what`.
MORI_GLOBAL void MisuseHandle(MemoryChannelDeviceHandle ch, int what) {
  switch (what) {
    case 0: ch.Put(ch.dstBytes - 8, 0, 9, 0, 1); break;                       // destination one byte too long
    case 1: ch.Put(0, ch.srcBytes, 1, 0, 1); break;                           // source starts at the end
    case 2: ch.Get(0, 0, ~0ull, 0, 1); break;                                 // bytes larger than any memory
    case 3: ch.PutPackets<LL16Packet>(0, 4, 8, 0, 1, 1); break;               // source not 8-byte aligned
    case 4: ch.UnpackPackets<LL8Packet>(0, ch.packetBufferBytes, 4, 0, 1, 1); break;  // packets past the buffer
    case 5: ch.Wait(); break;                                                 // nobody signals
  }
}

TEST_F(Packets, MisusedHandleTrapsNamingTheRange) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "a device trap ends the GPU context; the HOST backend tests the message";
  Loopback lb(256, 128);
  lb.handle.semaphore.timeoutNs = 30'000'000;
  const char* expected[] = {
      "Put: destination range [248, + 9) is outside its 256 bytes",
      "Put: source range [128, + 1) is outside its 128 bytes",
      "Get: destination range [0, + 18446744073709551615) is outside its 128 bytes",
      "PutPackets of 8 bytes from offset 4 to 0 is not aligned to the packet (8 data bytes in 16)",
      "UnpackPackets: packet buffer range [256, + 8) is outside its 256 bytes",
      "rank 3 waited 30000000 ns for signal #1 from rank 3 (0 arrived)",
  };
  for (int what = 0; what < 6; ++what) {
    testing::internal::CaptureStderr();
    LaunchKernel(MisuseHandle, Dim3(1), Dim3(1), 0, nullptr, lb.handle, what);
    GpuStatus s = GpuDeviceSynchronize();
    std::string log = testing::internal::GetCapturedStderr();
    EXPECT_NE(s, kGpuSuccess) << "misuse " << what << " did not trap";
    EXPECT_NE(log.find(expected[what]), std::string::npos) << "misuse " << what << ": " << log;
  }
}

}  // namespace
}  // namespace mori::core
