// Atomics of atomic.hpp from GPU threads and a host thread at the same time, on the same words of
// host-pinned memory mapped into the GPU (system scope), and from many GPU threads on device memory
// (device scope). On HOST the "GPU threads" are host threads and the test runs the same way.
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

namespace mori {
namespace {

#if MORI_BACKEND_HOST
constexpr unsigned kBlocks = 4, kThreads = 32, kIters = 500;
#else
constexpr unsigned kBlocks = 64, kThreads = 256, kIters = 2000;
#endif
constexpr unsigned kHostIters = 200000;

struct Shared {
  uint64_t counter;     // fetch-add by everybody
  uint64_t casCounter;  // compare-and-swap increments by everybody
  uint32_t started;     // GPU threads that have begun, so the host overlaps with them
};

MORI_GLOBAL void HammerSystemScope(Shared* s, uint32_t* tickets, uint64_t ticketCount) {
  AtomicFetchAdd<MemoryOrder::Relaxed, Scope::System>(&s->started, 1u);
  for (unsigned i = 0; i < kIters; ++i) {
    uint64_t t = AtomicFetchAdd<MemoryOrder::AcqRel, Scope::System>(&s->counter, uint64_t{1});
    // Each ticket value is handed out once: mark it; a second mark would show as 2.
    if (t < ticketCount) AtomicFetchAdd<MemoryOrder::Relaxed, Scope::System>(&tickets[t], 1u);
    uint64_t seen = AtomicLoad<MemoryOrder::Relaxed, Scope::System>(&s->casCounter);
    while (true) {
      uint64_t found = AtomicCompareExchange<MemoryOrder::AcqRel, Scope::System>(&s->casCounter, seen, seen + 1);
      if (found == seen) break;
      seen = found;
    }
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

TEST_F(GpuAtomics, GpuThreadsAndAHostThreadShareMappedCounters) {
  const uint64_t gpuOps = uint64_t(kBlocks) * kThreads * kIters;
  const uint64_t total = gpuOps + kHostIters;
  GpuBuffer shared(sizeof(Shared), MemoryType::HostPinned);
  GpuBuffer tickets(total * sizeof(uint32_t), MemoryType::HostPinned);
  auto* s = shared.DataAs<Shared>();
  std::memset(s, 0, sizeof(Shared));
  std::memset(tickets.Data(), 0, tickets.Bytes());
  auto* t = tickets.DataAs<uint32_t>();

  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  LaunchKernel(HammerSystemScope, Dim3(kBlocks), Dim3(kThreads), 0, stream, s, t, total);
  ASSERT_EQ(GpuGetLastError(), kGpuSuccess);
  // Start hammering once the GPU is hammering too, so the two really overlap.
  Deadline deadline = Deadline::After(60);
  while (AtomicLoad<MemoryOrder::Relaxed>(&s->started) == 0 && !deadline.Expired()) std::this_thread::yield();
  EXPECT_GT(AtomicLoad(&s->started), 0u) << "the kernel never started";
  uint64_t hostOverlap = 0;
  for (unsigned i = 0; i < kHostIters; ++i) {
    uint64_t ticket = AtomicFetchAdd(&s->counter, uint64_t{1});
    if (ticket < total) AtomicFetchAdd<MemoryOrder::Relaxed>(&t[ticket], 1u);
    AtomicFetchAdd(&s->casCounter, uint64_t{1});
    if (i == kHostIters / 2) hostOverlap = AtomicLoad(&s->counter);
  }
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  EXPECT_EQ(s->counter, total);
  EXPECT_EQ(s->casCounter, total);
  EXPECT_EQ(s->started, kBlocks * kThreads);
  uint64_t bad = 0;
  for (uint64_t i = 0; i < total; ++i) bad += t[i] != 1;
  EXPECT_EQ(bad, 0u) << "tickets handed out zero or several times";
  // Not an assertion on timing: a note of how much of the GPU's work overlapped the host's.
  std::printf("counter halfway through the host loop: %llu of %llu\n", static_cast<unsigned long long>(hostOverlap),
              static_cast<unsigned long long>(total));
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
}  // namespace mori
