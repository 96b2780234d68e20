// Atomics of atomic.hpp hammered from many threads at once (host threads here; the GPU variant is in
// tests/gpu/gpu_atomic_test.cpp), plus the byte-order helpers against known values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "mori/core/atomic.hpp"

namespace mori::core {
namespace {

constexpr int kThreads = 16;
constexpr int kIters = 20000;

TEST(Atomic, FetchAddFromManyThreadsLosesNothing) {
  uint64_t counter64 = 0;
  uint32_t counter32 = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i) {
        AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(&counter64, static_cast<uint64_t>(t + 1));
        AtomicFetchAdd(&counter32, 1u);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(counter64, static_cast<uint64_t>(kIters) * kThreads * (kThreads + 1) / 2);
  EXPECT_EQ(counter32, static_cast<uint32_t>(kIters * kThreads));
}

TEST(Atomic, CompareExchangeLoopsBuildAnExactSum) {
  int64_t value = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters / 4; ++i) {
        int64_t seen = AtomicLoad<MemoryOrder::Relaxed>(&value);
        while (true) {
          int64_t found = AtomicCompareExchange(&value, seen, seen + (t % 2 == 0 ? 3 : -1));
          if (found == seen) break;
          seen = found;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(value, static_cast<int64_t>(kIters / 4) * (kThreads / 2) * 3 - static_cast<int64_t>(kIters / 4) * (kThreads / 2));
}

TEST(Atomic, CompareExchangeReturnsTheValueFound) {
  uint32_t v = 7;
  EXPECT_EQ(AtomicCompareExchange(&v, 5u, 9u), 7u);  // no swap
  EXPECT_EQ(v, 7u);
  EXPECT_EQ(AtomicCompareExchange(&v, 7u, 9u), 7u);  // swap
  EXPECT_EQ(v, 9u);
}

TEST(Atomic, ExchangeHandsEachTokenToExactlyOneThread) {
  // Every thread swaps its own id into a slot and keeps what it found: each id is seen exactly once.
  uint64_t slot = 0;  // 0 = initial token
  std::vector<std::vector<uint64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) {
        uint64_t token = (static_cast<uint64_t>(t) << 32) | static_cast<uint64_t>(i + 1);
        seen[t].push_back(AtomicExchange(&slot, token));
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<uint64_t> all;
  for (auto& v : seen) all.insert(all.end(), v.begin(), v.end());
  all.push_back(AtomicLoad(&slot));
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kThreads * 1000 + 1));
  EXPECT_EQ(all[0], 0u);
  for (size_t i = 1; i < all.size(); ++i) EXPECT_NE(all[i], all[i - 1]) << "token handed out twice";
}

TEST(Atomic, ReleaseAcquirePublishesData) {
  // A writer fills a payload then raises a flag with release; readers that see the flag see the payload.
  constexpr int kRounds = 2000;
  std::vector<uint64_t> payload(64, 0);
  uint64_t flag = 0;
  uint64_t ack = 0;
  std::thread writer([&] {
    for (uint64_t round = 1; round <= kRounds; ++round) {
      for (size_t i = 0; i < payload.size(); ++i) AtomicStore<MemoryOrder::Relaxed>(&payload[i], round * 1000 + i);
      AtomicStore<MemoryOrder::Release>(&flag, round);
      while (AtomicLoad<MemoryOrder::Acquire>(&ack) != round) std::this_thread::yield();
    }
  });
  int bad = 0;
  for (uint64_t round = 1; round <= kRounds; ++round) {
    while (AtomicLoad<MemoryOrder::Acquire>(&flag) != round) std::this_thread::yield();
    for (size_t i = 0; i < payload.size(); ++i) bad += AtomicLoad<MemoryOrder::Relaxed>(&payload[i]) != round * 1000 + i;
    AtomicStore<MemoryOrder::Release>(&ack, round);
  }
  writer.join();
  EXPECT_EQ(bad, 0);
}

TEST(Atomic, FetchSubAndFetchOr) {
  int32_t v = 100;
  EXPECT_EQ(AtomicFetchSub(&v, 30), 100);
  EXPECT_EQ(v, 70);
  uint64_t bits = 0x10;
  EXPECT_EQ(AtomicFetchOr(&bits, uint64_t{0x3}), 0x10u);
  EXPECT_EQ(bits, 0x13u);
  AtomicFence();
  AtomicFence<MemoryOrder::Release, Scope::Device>();
}

TEST(Atomic, MmioStoreWritesAllEightBytes) {
  alignas(8) uint64_t reg = 0;
  MmioStore64(&reg, 0x1122334455667788ull);
  EXPECT_EQ(reg, 0x1122334455667788ull);
}

TEST(Atomic, ByteOrderHelpers) {
  static_assert(HostToBe16(0x1234) == 0x3412, "16-bit swap");
  static_assert(HostToBe32(0x11223344u) == 0x44332211u, "32-bit swap");
  static_assert(HostToBe64(0x0102030405060708ull) == 0x0807060504030201ull, "64-bit swap");
  uint32_t x = 0xdeadbeef;
  EXPECT_EQ(BeToHost32(HostToBe32(x)), x);
  uint8_t bytes[4];
  uint32_t be = HostToBe32(0x0a0b0c0du);
  std::memcpy(bytes, &be, 4);
  EXPECT_EQ(bytes[0], 0x0a);  // big-endian: most significant byte first in memory
  EXPECT_EQ(bytes[3], 0x0d);
  EXPECT_EQ(BeToHost64(HostToBe64(0xfedcba9876543210ull)), 0xfedcba9876543210ull);
  EXPECT_EQ(BeToHost16(HostToBe16(0xbeef)), 0xbeef);
}

}  // namespace
}  // namespace mori::core
