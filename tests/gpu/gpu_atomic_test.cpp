// Atomics of atomic.hpp from GPU threads and a host thread at the same time on host-pinned memory mapped
// into the GPU (system scope), and from many GPU threads on device memory (device scope). On HOST the
// "GPU threads" are host threads and the test runs the same way.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core {
namespace {

#if MORI_BACKEND_HOST
constexpr unsigned kBlocks = 4, kThreads = 32, kIters = 500;
#else
constexpr unsigned kBlocks = 8, kThreads = 64, kIters = 100;  // system-scope atomics cross PCIe: slow
#endif
constexpr unsigned kHostIters = 200000;
constexpr uint32_t kRounds = 2000;
constexpr unsigned kPayloadWords = 8;

// Words of mapped host memory that GPU threads and a host thread use at the same time. They share cache
// lines on purpose. Each read-modify-written word has one kind of writer (GPU or host), which is what
// every platform guarantees; RmwShared below is the word both modify, valid only with native host atomics.
struct Shared {
  uint64_t gpuCounter;   // fetch-add by GPU threads
  uint64_t gpuCas;       // compare-and-swap increments by GPU threads
  uint64_t hostCounter;  // fetch-add by the host thread
  uint32_t started;      // GPU threads that have begun
  uint32_t mailbox;      // host -> GPU: round number, released after the payload
  uint32_t echo;         // GPU -> host: round number, released after the GPU has checked the payload
  uint32_t mismatches;   // payload words the GPU found wrong
  uint64_t payload[kPayloadWords];
};

struct RmwShared {
  uint64_t counter;  // fetch-add by everybody
  uint64_t cas;      // compare-and-swap increments by the GPU, fetch-add by the host
};

MORI_DEVICE_INLINE void CasIncrement(uint64_t* word) {
  uint64_t seen = AtomicLoad<MemoryOrder::Relaxed, Scope::System>(word);
  while (true) {
    uint64_t found = AtomicCompareExchange<MemoryOrder::AcqRel, Scope::System>(word, seen, seen + 1);
    if (found == seen) break;
    seen = found;
  }
}

MORI_GLOBAL void GpuSideOfTheLine(Shared* s, uint64_t timeoutNs) {
  AtomicFetchAdd<MemoryOrder::Relaxed, Scope::System>(&s->started, 1u);
  for (unsigned i = 0; i < kIters; ++i) {
    AtomicFetchAdd<MemoryOrder::Relaxed, Scope::System>(&s->gpuCounter, uint64_t{1});
    CasIncrement(&s->gpuCas);
  }
  if (GlobalThreadIdx() != 0) return;
  // Message passing with the host, round after round, while everybody else hammers the same lines.
  for (uint32_t round = 1; round <= kRounds; ++round) {
    SpinDeadline deadline(timeoutNs);
    while (AtomicLoad<MemoryOrder::Acquire, Scope::System>(&s->mailbox) != round) {
      MORI_DEVICE_ASSERT(!deadline.Expired(), "GPU waited for round %u from the host", round);
      SpinPause();
    }
    for (unsigned w = 0; w < kPayloadWords; ++w) {
      if (AtomicLoad<MemoryOrder::Relaxed, Scope::System>(&s->payload[w]) != uint64_t(round) * 1000 + w) {
        AtomicFetchAdd<MemoryOrder::Relaxed, Scope::System>(&s->mismatches, 1u);
      }
    }
    AtomicStore<MemoryOrder::Release, Scope::System>(&s->echo, round);
  }
}

MORI_GLOBAL void HammerOneWord(RmwShared* s) {
  for (unsigned i = 0; i < kIters; ++i) {
    AtomicFetchAdd<MemoryOrder::AcqRel, Scope::System>(&s->counter, uint64_t{1});
    CasIncrement(&s->cas);
  }
}

MORI_GLOBAL void HammerDeviceScope(uint64_t* sum, uint32_t* maxSeen, uint32_t* exch) {
  unsigned gid = GlobalThreadIdx();
  for (unsigned i = 0; i < kIters; ++i) {
    AtomicFetchAdd<MemoryOrder::Relaxed, Scope::Device>(sum, uint64_t{gid});
    AtomicExchange<MemoryOrder::Relaxed, Scope::Device>(&exch[gid % 64], gid);
  }
  // A maximum built from compare-and-swap.
  uint32_t cur = AtomicLoad<MemoryOrder::Relaxed, Scope::Device>(maxSeen);
  while (cur < gid) {
    uint32_t found = AtomicCompareExchange<MemoryOrder::Relaxed, Scope::Device>(maxSeen, cur, gid);
    if (found == cur) break;
    cur = found;
  }
}

class GpuAtomics : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (GpuGetDeviceCount(&n) != kGpuSuccess || n == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }
};

TEST_F(GpuAtomics, GpuThreadsAndAHostThreadAtOnceOnMappedLines) {
  GpuBuffer buffer(sizeof(Shared), MemoryType::HostPinned);
  auto* s = buffer.DataAs<Shared>();
  std::memset(s, 0, sizeof(Shared));
  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  LaunchKernel(GpuSideOfTheLine, Dim3(kBlocks), Dim3(kThreads), 0, stream, s, uint64_t{60'000'000'000});
  ASSERT_EQ(GpuGetLastError(), kGpuSuccess);
  Deadline deadline = Deadline::After(60);
  while (AtomicLoad<MemoryOrder::Relaxed>(&s->started) == 0 && !deadline.Expired()) std::this_thread::yield();
  ASSERT_GT(AtomicLoad(&s->started), 0u) << "the kernel never started";
  // The host interleaves its own read-modify-writes with the message rounds.
  unsigned hostDone = 0;
  for (uint32_t round = 1; round <= kRounds; ++round) {
    for (unsigned w = 0; w < kPayloadWords; ++w) AtomicStore<MemoryOrder::Relaxed>(&s->payload[w], uint64_t(round) * 1000 + w);
    AtomicStore<MemoryOrder::Release>(&s->mailbox, round);
    while (AtomicLoad<MemoryOrder::Acquire>(&s->echo) != round) {
      ASSERT_FALSE(deadline.Expired()) << "the GPU never answered round " << round;
      if (hostDone < kHostIters) {
        AtomicFetchAdd(&s->hostCounter, uint64_t{1});
        ++hostDone;
      }
    }
  }
  for (; hostDone < kHostIters; ++hostDone) AtomicFetchAdd(&s->hostCounter, uint64_t{1});
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  const uint64_t gpuOps = uint64_t(kBlocks) * kThreads * kIters;
  EXPECT_EQ(s->gpuCounter, gpuOps);
  EXPECT_EQ(s->gpuCas, gpuOps);
  EXPECT_EQ(s->hostCounter, kHostIters);
  EXPECT_EQ(s->started, kBlocks * kThreads);
  EXPECT_EQ(s->echo, kRounds);
  EXPECT_EQ(s->mismatches, 0u) << "the GPU saw a round's flag before its payload";
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
}

TEST_F(GpuAtomics, GpuAndHostReadModifyWriteTheSameWord) {
  int native = 0;
  ASSERT_EQ(GpuDeviceHostNativeAtomics(&native, 0), kGpuSuccess);
  if (!native) {
    GTEST_SKIP() << "this platform's GPU-host link has no native atomics (HostNativeAtomicSupported = 0): GPU and "
                    "CPU read-modify-writes of one host word are not atomic with respect to each other here";
  }
  GpuBuffer buffer(sizeof(RmwShared), MemoryType::HostPinned);
  auto* s = buffer.DataAs<RmwShared>();
  std::memset(s, 0, sizeof(RmwShared));
  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  LaunchKernel(HammerOneWord, Dim3(kBlocks), Dim3(kThreads), 0, stream, s);
  for (unsigned i = 0; i < kHostIters; ++i) {
    AtomicFetchAdd(&s->counter, uint64_t{1});
    AtomicFetchAdd(&s->cas, uint64_t{1});
  }
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  const uint64_t total = uint64_t(kBlocks) * kThreads * kIters + kHostIters;
  EXPECT_EQ(s->counter, total);
  EXPECT_EQ(s->cas, total);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
}

TEST_F(GpuAtomics, DeviceScopeAtomicsFromManyThreads) {
  uint64_t* sum = nullptr;
  uint32_t* maxSeen = nullptr;
  uint32_t* exch = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&sum), 8), kGpuSuccess);
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&maxSeen), 4), kGpuSuccess);
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&exch), 64 * 4), kGpuSuccess);
  ASSERT_EQ(GpuMemset(sum, 0, 8), kGpuSuccess);
  ASSERT_EQ(GpuMemset(maxSeen, 0, 4), kGpuSuccess);
  ASSERT_EQ(GpuMemset(exch, 0xff, 64 * 4), kGpuSuccess);
  LaunchKernel(HammerDeviceScope, Dim3(kBlocks), Dim3(kThreads), 0, nullptr, sum, maxSeen, exch);
  ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
  uint64_t hostSum = 0;
  uint32_t hostMax = 0;
  std::vector<uint32_t> hostExch(64);
  ASSERT_EQ(GpuMemcpy(&hostSum, sum, 8), kGpuSuccess);
  ASSERT_EQ(GpuMemcpy(&hostMax, maxSeen, 4), kGpuSuccess);
  ASSERT_EQ(GpuMemcpy(hostExch.data(), exch, 64 * 4), kGpuSuccess);
  const uint64_t threads = uint64_t(kBlocks) * kThreads;
  EXPECT_EQ(hostSum, uint64_t(kIters) * threads * (threads - 1) / 2);
  EXPECT_EQ(hostMax, threads - 1);
  for (unsigned i = 0; i < 64 && i < threads; ++i) {
    EXPECT_EQ(hostExch[i] % 64, i) << "slot " << i << " holds a value only threads of its residue write";
  }
  (void)GpuFree(sum);
  (void)GpuFree(maxSeen);
  (void)GpuFree(exch);
}

}  // namespace
}  // namespace mori::core
