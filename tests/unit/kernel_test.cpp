// Kernels written once with kernel.hpp, run on the backend in use (host threads on HOST, the GPU on
// CUDA/HIP): indices, block barriers, dynamic shared memory, asynchronous launch, events, traps.
#include "mori/core/kernel.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "proxy_copy.hpp"

#if MORI_BACKEND_HOST
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace mori::core {
namespace {

MORI_GLOBAL void WriteGlobalIndex(uint32_t* out) {
  unsigned gid = GlobalThreadIdx();
  out[gid] = gid * 3u + 1u;
}

MORI_GLOBAL void WriteCoordinates(uint32_t* out) {
  unsigned gid = GlobalThreadIdx();
  out[gid] = (BlockIdxX() << 24) | (BlockIdxY() << 16) | (ThreadIdxX() << 8) | ThreadIdxY();
}

// Every thread publishes a value in shared memory, waits at the barrier, then reads its neighbour's.
MORI_GLOBAL void NeighbourThroughSharedMemory(uint32_t* out) {
  uint32_t* shared = DynamicSharedMemory<uint32_t>();
  unsigned t = FlatThreadIdx();
  shared[t] = (BlockIdxX() + 1) * 1000u + t;
  SyncThreads();
  unsigned neighbour = (t + 1) % FlatBlockDim();
  uint32_t v = shared[neighbour];
  SyncThreads();
  shared[t] = v + 1;  // a second phase, checked against the first
  SyncThreads();
  out[GlobalThreadIdx()] = shared[(t + FlatBlockDim() - 1) % FlatBlockDim()];
}

MORI_GLOBAL void WaitForHostFlag(const uint32_t* flag, uint32_t* out, uint64_t timeoutNs) {
  SpinDeadline deadline(timeoutNs);
  while (AtomicLoad<MemoryOrder::Acquire>(flag) == 0) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "block %u waited %llu ns for the host flag", BlockIdxX(),
                       static_cast<unsigned long long>(timeoutNs));
    SpinPause();
  }
  out[GlobalThreadIdx()] = 0xC0FFEEu + GlobalThreadIdx();
}

MORI_GLOBAL void TrapInOneThread(uint32_t* out, unsigned victim) {
  if (GlobalThreadIdx() == victim) {
    MORI_DEVICE_ASSERT(victim == 12345u, "thread %u trips on purpose", victim);
  }
  SyncThreads();  // the others wait here for a thread that never comes: the trap must end them too
  out[GlobalThreadIdx()] = 1;
}

// The first of two kernels: lets the next one start at once, then writes its pattern late (after `delayNs`).
MORI_GLOBAL void WriteLateAllowingDependents(uint32_t* out, uint64_t delayNs) {
  AllowDependentLaunch();
  const uint64_t end = DeviceWallClockNs() + delayNs;
  while (DeviceWallClockNs() < end) SpinPause();
  out[GlobalThreadIdx()] = GlobalThreadIdx() * 7u + 5u;
}

// The second: started early, it reads the first kernel's pattern only after waiting for that kernel.
MORI_GLOBAL void ReadAfterThePrerequisite(const uint32_t* in, uint32_t* out) {
  WaitForPrerequisiteGrid();
  out[GlobalThreadIdx()] = in[GlobalThreadIdx()] + 1u;
}

// Word i of round r's data in the stream-write test: the round in the high half, a scramble of i in the low.
MORI_HOST_DEVICE_INLINE uint64_t RoundWord(uint64_t r, uint64_t i) {
  return r << 32 | static_cast<uint32_t>(i * 2654435761u);
}

// Round r (from 1): thread 0 waits until the stream has written r into `word` and checks the last word of `data` at
// once; then the block checks every word against round r's pattern, last words first (a copy that had not finished
// would show at its end), counting those that differ; then thread 0 answers r in `answer` (host-mapped), so that
// the host writes the next round only then.
MORI_GLOBAL void CheckEachRoundAfterItsWord(const uint64_t* word, const uint64_t* data, int words, int rounds,
                                            uint64_t* answer, uint32_t* wrong, uint64_t timeoutNs) {
  const unsigned t = FlatThreadIdx();
  for (uint64_t r = 1; r <= static_cast<uint64_t>(rounds); ++r) {
    if (t == 0) {
      SpinDeadline deadline(timeoutNs);
      while (AtomicLoad<MemoryOrder::Acquire, Scope::System>(word) < r) {
        MORI_DEVICE_ASSERT(!deadline.Expired(), "round %llu: the stream's word never came",
                           static_cast<unsigned long long>(r));
        SpinPause();
      }
      // At once, the word a copy in order writes last: the most likely to be missing if the number came early.
      if (data[words - 1] != RoundWord(r, static_cast<uint64_t>(words - 1))) {
        AtomicFetchAdd<MemoryOrder::Relaxed>(wrong, 1u);
      }
    }
    SyncThreads();
    uint32_t bad = 0;
    for (int i = words - 1 - static_cast<int>(t); i >= 0; i -= static_cast<int>(FlatBlockDim())) {
      if (data[i] != RoundWord(r, static_cast<uint64_t>(i))) ++bad;
    }
    if (bad != 0) AtomicFetchAdd<MemoryOrder::Relaxed>(wrong, bad);
    SyncThreads();
    if (t == 0) AtomicStore<MemoryOrder::Release, Scope::System>(answer, r);
  }
}

class Kernel : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (GpuGetDeviceCount(&n) != kGpuSuccess || n == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }

  std::vector<uint32_t> Run(void (*kernel)(uint32_t*), Dim3 grid, Dim3 block, size_t shared = 0) {
    size_t n = size_t(grid.x) * grid.y * block.x * block.y;
    uint32_t* dev = nullptr;
    EXPECT_EQ(GpuMalloc(reinterpret_cast<void**>(&dev), n * 4), kGpuSuccess);
    EXPECT_EQ(GpuMemset(dev, 0xff, n * 4), kGpuSuccess);
    LaunchKernel(kernel, grid, block, shared, nullptr, dev);
    EXPECT_EQ(GpuGetLastError(), kGpuSuccess);
    EXPECT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
    std::vector<uint32_t> host(n);
    EXPECT_EQ(GpuMemcpy(host.data(), dev, n * 4), kGpuSuccess);
    EXPECT_EQ(GpuFree(dev), kGpuSuccess);
    return host;
  }
};

TEST_F(Kernel, EveryThreadRunsOnceWithItsIndex) {
  auto out = Run(WriteGlobalIndex, Dim3(4), Dim3(32));
  for (uint32_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], i * 3 + 1) << "thread " << i;
}

// LaunchKernelEarly: the kernel may start before the one before it ends (CUDA, sm_90), and what that kernel
// wrote is visible after WaitForPrerequisiteGrid; on HIP and HOST it is a plain launch. Either way the second
// kernel must read the whole pattern, the last of it written 200 us after the first kernel started.
TEST_F(Kernel, AKernelLaunchedEarlyReadsWhatTheKernelBeforeItWrote) {
  constexpr unsigned kBlocks = 8, kThreads = 64, n = kBlocks * kThreads;
  uint32_t *first = nullptr, *second = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&first), n * 4), kGpuSuccess);
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&second), n * 4), kGpuSuccess);
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(GpuMemset(first, 0xff, n * 4), kGpuSuccess);
    ASSERT_EQ(GpuMemset(second, 0xff, n * 4), kGpuSuccess);
    LaunchKernel(WriteLateAllowingDependents, Dim3(kBlocks), Dim3(kThreads), 0, nullptr, first, uint64_t{200'000});
    LaunchKernelEarly(ReadAfterThePrerequisite, Dim3(kBlocks), Dim3(kThreads), 0, nullptr,
                      static_cast<const uint32_t*>(first), second);
    ASSERT_EQ(GpuGetLastError(), kGpuSuccess);
    ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
    std::vector<uint32_t> host(n);
    ASSERT_EQ(GpuMemcpy(host.data(), second, n * 4), kGpuSuccess);
    for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(host[i], i * 7u + 6u) << "round " << round << ", thread " << i;
  }
  EXPECT_EQ(GpuFree(first), kGpuSuccess);
  EXPECT_EQ(GpuFree(second), kGpuSuccess);
}

TEST_F(Kernel, TwoDimensionalGridsAndBlocks) {
  auto out = Run(WriteCoordinates, Dim3(3, 2), Dim3(4, 2));
  size_t i = 0;
  for (unsigned by = 0; by < 2; ++by) {
    for (unsigned bx = 0; bx < 3; ++bx) {
      for (unsigned ty = 0; ty < 2; ++ty) {
        for (unsigned tx = 0; tx < 4; ++tx, ++i) {
          EXPECT_EQ(out[i], (bx << 24) | (by << 16) | (tx << 8) | ty) << "slot " << i;
        }
      }
    }
  }
}

TEST_F(Kernel, BlockBarrierAndDynamicSharedMemory) {
  constexpr unsigned kBlock = 16;
  auto out = Run(NeighbourThroughSharedMemory, Dim3(3), Dim3(kBlock), kBlock * sizeof(uint32_t));
  for (unsigned b = 0; b < 3; ++b) {
    for (unsigned t = 0; t < kBlock; ++t) {
      // Phase 2 stored neighbour(t)+1 at t; thread t reads slot t-1, which holds value of thread t.
      uint32_t expect = (b + 1) * 1000u + t + 1;
      EXPECT_EQ(out[b * kBlock + t], expect) << "block " << b << " thread " << t;
    }
  }
}

TEST_F(Kernel, LaunchIsAsynchronousAndSeesHostWritesThroughMappedMemory) {
  uint32_t* flag = nullptr;
  ASSERT_EQ(GpuHostAllocMapped(reinterpret_cast<void**>(&flag), sizeof(uint32_t)), kGpuSuccess);
  *flag = 0;
  uint32_t* devFlag = nullptr;
  ASSERT_EQ(GpuHostGetDevicePointer(reinterpret_cast<void**>(&devFlag), flag), kGpuSuccess);
  uint32_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), 8 * sizeof(uint32_t)), kGpuSuccess);
  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  GpuEvent start, stop;
  ASSERT_EQ(GpuEventCreate(&start), kGpuSuccess);
  ASSERT_EQ(GpuEventCreate(&stop), kGpuSuccess);
  ASSERT_EQ(GpuEventRecord(start, stream), kGpuSuccess);
  LaunchKernel(WaitForHostFlag, Dim3(2), Dim3(4), 0, stream, devFlag, out, uint64_t{30'000'000'000});
  ASSERT_EQ(GpuEventRecord(stop, stream), kGpuSuccess);
  // The kernel cannot finish before the flag is raised, so the stream must still be busy.
  EXPECT_EQ(GpuStreamQuery(stream), kGpuErrorNotReady);
  AtomicStore<MemoryOrder::Release>(flag, 1u);
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  float ms = -1;
  ASSERT_EQ(GpuEventElapsedTime(&ms, start, stop), kGpuSuccess);
  EXPECT_GE(ms, 0.0f);
  std::vector<uint32_t> host(8);
  ASSERT_EQ(GpuMemcpy(host.data(), out, 8 * sizeof(uint32_t)), kGpuSuccess);
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(host[i], 0xC0FFEEu + i);
  EXPECT_EQ(GpuEventDestroy(start), kGpuSuccess);
  EXPECT_EQ(GpuEventDestroy(stop), kGpuSuccess);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
  EXPECT_EQ(GpuFree(out), kGpuSuccess);
  EXPECT_EQ(GpuFreeHost(flag), kGpuSuccess);
}

TEST_F(Kernel, ABoundedWaitThatRunsOutTrapsAndFailsTheLaunch) {
  uint32_t* flag = nullptr;
  uint32_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&flag), 4), kGpuSuccess);
  ASSERT_EQ(GpuMemset(flag, 0, 4), kGpuSuccess);
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), 4 * 4), kGpuSuccess);
  testing::internal::CaptureStderr();
  LaunchKernel(WaitForHostFlag, Dim3(1), Dim3(4), 0, nullptr, flag, out, uint64_t{50'000'000});
  GpuStatus s = GpuDeviceSynchronize();
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(s, kGpuSuccess) << "a trapped kernel must report an error";
#if MORI_BACKEND_HOST
  EXPECT_NE(log.find("waited 50000000 ns for the host flag"), std::string::npos) << log;
  (void)GpuFree(flag);
  (void)GpuFree(out);
#endif
}

TEST_F(Kernel, ATrapEndsThreadsWaitingAtABarrier) {
  uint32_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), 8 * 4), kGpuSuccess);
  testing::internal::CaptureStderr();
  LaunchKernel(TrapInOneThread, Dim3(1), Dim3(8), 0, nullptr, out, 3u);
  GpuStatus s = GpuDeviceSynchronize();
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(s, kGpuSuccess);
#if MORI_BACKEND_HOST
  EXPECT_NE(log.find("thread 3 trips on purpose"), std::string::npos) << log;
  (void)GpuFree(out);
#endif
}

TEST_F(Kernel, InvalidConfigurationIsReported) {
  uint32_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), 4), kGpuSuccess);
  (void)GpuGetLastError();
  LaunchKernel(WriteGlobalIndex, Dim3(1), Dim3(4096), 0, nullptr, out);  // above every backend's block limit
  EXPECT_NE(GpuGetLastError(), kGpuSuccess);
  EXPECT_EQ(GpuGetLastError(), kGpuSuccess) << "the error is reported once";
  EXPECT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
  EXPECT_EQ(GpuFree(out), kGpuSuccess);
}

// A word a stream writes (GpuStreamWriteValue64, the CudaIpc connection's signals) lands after the copies issued
// before it on that stream, with their data visible to a kernel that sees the word: 200 rounds of a 64 KiB copy
// then the round's number, a kernel on another stream checking every word of each round's data.
TEST_F(Kernel, AWordAStreamWritesLandsAfterTheCopiesBeforeIt) {
  constexpr int kWords = 8192, kRounds = 200;
  const GpuStream copies = HostCopyStream();
  GpuBuffer word(sizeof(uint64_t), MemoryType::Device), data(kWords * sizeof(uint64_t), MemoryType::Device);
  GpuBuffer wrong(sizeof(uint32_t), MemoryType::Device);
  GpuBuffer answer(sizeof(uint64_t), MemoryType::HostPinned), staged(kWords * sizeof(uint64_t), MemoryType::HostPinned);
  ASSERT_EQ(GpuMemset(word.Data(), 0, word.Bytes()), kGpuSuccess);
  ASSERT_EQ(GpuMemset(data.Data(), 0, data.Bytes()), kGpuSuccess);
  ASSERT_EQ(GpuMemset(wrong.Data(), 0, wrong.Bytes()), kGpuSuccess);
  uint64_t* const answered = answer.DataAs<uint64_t>();
  *answered = 0;

  // Bad words are refused with nothing enqueued.
  EXPECT_EQ(GpuStreamWriteValue64(nullptr, 1, copies), kGpuErrorInvalidValue);
  (void)GpuGetLastError();
  EXPECT_EQ(GpuStreamWriteValue64(reinterpret_cast<uint64_t*>(word.DataAs<uint8_t>() + 4), 1, copies),
            kGpuErrorInvalidValue);
  (void)GpuGetLastError();
  // The support query answers for devices that exist only, and agrees with the call itself.
  int device = 0, devices = 0;
  ASSERT_EQ(GpuGetDevice(&device), kGpuSuccess);
  ASSERT_EQ(GpuGetDeviceCount(&devices), kGpuSuccess);
  EXPECT_FALSE(GpuCanStreamWriteValue64(-1));
  EXPECT_FALSE(GpuCanStreamWriteValue64(devices));
  // Every CUDA device of CUDA 12 and later can (and HOST): a "no" there would quietly cost each signal a copy.
  if (!MORI_BACKEND_HIP) {
    EXPECT_TRUE(GpuCanStreamWriteValue64(device)) << "device " << device;
  }
  const GpuStatus probe = GpuStreamWriteValue64(word.DataAs<uint64_t>(), 0, copies);
  if (!GpuCanStreamWriteValue64(device)) {
    EXPECT_EQ(probe, kGpuErrorNotSupported) << "a device that cannot must say so, with nothing enqueued";
    GTEST_SKIP() << "device " << device << " cannot write words from a stream";
  }
  ASSERT_EQ(probe, kGpuSuccess);
  ASSERT_EQ(GpuStreamSynchronize(copies), kGpuSuccess);

  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  LaunchKernel(CheckEachRoundAfterItsWord, Dim3(1), Dim3(256), 0, stream, word.DataAs<const uint64_t>(),
               data.DataAs<const uint64_t>(), kWords, kRounds, answered, wrong.DataAs<uint32_t>(),
               uint64_t{20'000'000'000});
  ASSERT_EQ(GpuGetLastError(), kGpuSuccess);
  uint64_t done = 0;  // rounds the kernel answered
  uint64_t* const staging = staged.DataAs<uint64_t>();
  for (uint64_t r = 1; r <= kRounds; ++r) {
    for (uint64_t i = 0; i < kWords; ++i) staging[i] = RoundWord(r, i);
    if (GpuMemcpyAsync(data.Data(), staging, data.Bytes(), copies) != kGpuSuccess ||
        GpuStreamWriteValue64(word.DataAs<uint64_t>(), r, copies) != kGpuSuccess) {
      ADD_FAILURE() << "round " << r << ": the copy or the word could not be issued";
      break;
    }
    // The kernel's answer also means the copy has read `staging`: it may be rewritten for the next round.
    const auto giveUp = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (AtomicLoad<MemoryOrder::Acquire>(answered) < r && std::chrono::steady_clock::now() < giveUp) {
      std::this_thread::yield();
    }
    if (AtomicLoad<MemoryOrder::Acquire>(answered) < r) {
      ADD_FAILURE() << "round " << r << ": no answer from the kernel in 20 s";
      break;
    }
    done = r;
  }
  if (done < kRounds) {
    // Lets the kernel run through its remaining rounds rather than trap (which would end this process's GPU
    // context for every later test).
    uint64_t release = ~uint64_t{0};
    double seconds = 0;
    (void)TimedStreamCopy(word.Data(), &release, sizeof(release), copies, &seconds);
  }
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
  uint32_t bad = 1;
  uint64_t last = 0;
  ASSERT_EQ(GpuMemcpy(&bad, wrong.Data(), sizeof(bad)), kGpuSuccess);
  ASSERT_EQ(GpuMemcpy(&last, word.Data(), sizeof(last)), kGpuSuccess);
  if (done == kRounds) {
    EXPECT_EQ(bad, 0u) << "words of a round's data had not landed when its number did";
    EXPECT_EQ(last, uint64_t{kRounds});
  }
}

#if MORI_BACKEND_HOST
MORI_GLOBAL void WriteOsThreadId(uint64_t* out) {
  out[GlobalThreadIdx()] = static_cast<uint64_t>(syscall(SYS_gettid)) * 1000u + GlobalThreadIdx() % 1000u;
}

// HOST: a launch takes idle OS threads before it starts new ones, so launches one after another run on the
// threads of the first (starting and ending them per launch was most of what HOST tests cost). A thread that
// has finished its GPU thread may play another of the same launch (it can no longer be waited for); threads
// that wait for each other, at a barrier or on a flag, all run at once.
TEST_F(Kernel, HostLaunchesRunOnTheThreadsOfTheLaunchBefore) {
  constexpr unsigned kBlocks = 4, kThreads = 32, n = kBlocks * kThreads;
  uint64_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), n * 8), kGpuSuccess);
  std::set<uint64_t> every;
  for (int round = 0; round < 5; ++round) {
    ASSERT_EQ(GpuMemset(out, 0, n * 8), kGpuSuccess);
    LaunchKernel(WriteOsThreadId, Dim3(kBlocks), Dim3(kThreads), 0, nullptr, out);
    ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
    std::vector<uint64_t> host(n);
    ASSERT_EQ(GpuMemcpy(host.data(), out, n * 8), kGpuSuccess);
    for (unsigned i = 0; i < n; ++i) {
      ASSERT_EQ(host[i] % 1000u, i % 1000u) << "round " << round << ": thread " << i << " did not write its slot";
      every.insert(host[i] / 1000u);
    }
  }
  // One launch never needs more than n; a thread per GPU thread per launch would be 5 n.
  EXPECT_LE(every.size(), n) << "launches after the first started OS threads instead of taking the idle ones";
  EXPECT_EQ(GpuFree(out), kGpuSuccess);
}

// HOST: a child forked after launches has none of the parent's idle kernel threads; its launches start their own
// (before it forgot them, its first launch would hand its work to threads that do not exist, and hang).
TEST_F(Kernel, AForkedChildLaunchesOnThreadsOfItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer ends a child that starts threads after a multi-threaded fork";
#endif
  auto parent = Run(NeighbourThroughSharedMemory, Dim3(2), Dim3(16), 16 * 4);
  ASSERT_EQ(parent.size(), 32u);
  const pid_t pid = test::ForkWhenOtherThreadsSleep();
  if (pid == 0) {
    constexpr unsigned n = 3 * 8;
    uint32_t* dev = nullptr;
    int code = 10;
    if (GpuMalloc(reinterpret_cast<void**>(&dev), n * 4) == kGpuSuccess) {
      LaunchKernel(NeighbourThroughSharedMemory, Dim3(3), Dim3(8), 8 * 4, nullptr, dev);
      std::vector<uint32_t> host(n, 0);
      code = GpuDeviceSynchronize() == kGpuSuccess && GpuMemcpy(host.data(), dev, n * 4) == kGpuSuccess ? 0 : 11;
      for (unsigned i = 0; code == 0 && i < n; ++i) {
        const unsigned b = i / 8, t = i % 8;
        if (host[i] != (b + 1) * 1000u + t + 1) code = 12;  // its own value, read back by its right neighbour
      }
    }
    _exit(code);
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "the forked child's launch did not end in 30 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: no memory, 11: the launch failed, 12: wrong values";
}

// The process's copy stream (HostCopyStream) is one per device and is not held up by a kernel that waits on
// another stream: copies of four threads on it at once all arrive (each its own pattern, nothing else
// touched) while the kernel, which waits for the host flag, still runs, as a proxy's copies must while a kernel
// waits for them. Made first, as ShmemInit makes it, so that on a GPU it has a hardware queue of its own.
TEST_F(Kernel, CopiesOnTheHostCopyStreamPassAKernelThatWaitsForThem) {
  const GpuStream copies = HostCopyStream();
  ASSERT_NE(copies, nullptr);
  EXPECT_EQ(HostCopyStream(), copies);
  int device = -1;
  ASSERT_EQ(GpuGetDevice(&device), kGpuSuccess);
  EXPECT_EQ(HostCopyStream(device), copies);

  uint32_t* flag = nullptr;
  ASSERT_EQ(GpuHostAllocMapped(reinterpret_cast<void**>(&flag), sizeof(uint32_t)), kGpuSuccess);
  *flag = 0;
  uint32_t* devFlag = nullptr;
  ASSERT_EQ(GpuHostGetDevicePointer(reinterpret_cast<void**>(&devFlag), flag), kGpuSuccess);
  uint32_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), 8 * sizeof(uint32_t)), kGpuSuccess);
  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  GpuEvent after;
  ASSERT_EQ(GpuEventCreate(&after), kGpuSuccess);
  EXPECT_EQ(GpuEventQuery(after), kGpuSuccess);  // never recorded
  LaunchKernel(WaitForHostFlag, Dim3(2), Dim3(4), 0, stream, devFlag, out, uint64_t{30'000'000'000});
  ASSERT_EQ(GpuEventRecord(after, stream), kGpuSuccess);
  EXPECT_EQ(GpuEventQuery(after), kGpuErrorNotReady);

  constexpr int kThreads = 4;
  constexpr size_t kBytes = 64 * 1024, kRounds = 20;
  uint8_t* device_buf = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&device_buf), kThreads * kBytes + 64), kGpuSuccess);
  std::vector<uint8_t> guard(64, 0xA5);
  ASSERT_EQ(GpuMemcpy(device_buf + kThreads * kBytes, guard.data(), 64), kGpuSuccess);
  std::vector<int> bad(kThreads, -1);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint8_t> up(kBytes), down(kBytes);
      int wrong = 0;
      for (size_t round = 0; round < kRounds; ++round) {
        for (size_t i = 0; i < kBytes; ++i) up[i] = static_cast<uint8_t>(i * 7 + t * 31 + round * 13 + 1);
        double seconds = 0;
        uint8_t* mine = device_buf + t * kBytes;
        if (TimedStreamCopy(mine, up.data(), kBytes, copies, &seconds) != kGpuSuccess ||
            TimedStreamCopy(down.data(), mine, kBytes, copies, &seconds) != kGpuSuccess || down != up) {
          ++wrong;
        }
      }
      bad[t] = wrong;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t << ": copies failed or came back wrong";
  // The kernel is still waiting: the copies did not wait for it.
  EXPECT_EQ(GpuEventQuery(after), kGpuErrorNotReady);
  std::vector<uint8_t> guardBack(64);
  double seconds = 0;
  ASSERT_EQ(TimedStreamCopy(guardBack.data(), device_buf + kThreads * kBytes, 64, copies, &seconds), kGpuSuccess);
  EXPECT_EQ(guardBack, guard) << "a copy wrote past its region";

  AtomicStore<MemoryOrder::Release>(flag, 1u);
  ASSERT_EQ(GpuEventSynchronize(after), kGpuSuccess);
  EXPECT_EQ(GpuEventQuery(after), kGpuSuccess);
  std::vector<uint32_t> host(8);
  ASSERT_EQ(GpuMemcpy(host.data(), out, 8 * sizeof(uint32_t)), kGpuSuccess);
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(host[i], 0xC0FFEEu + i);
  EXPECT_EQ(GpuEventDestroy(after), kGpuSuccess);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
  EXPECT_EQ(GpuFree(device_buf), kGpuSuccess);
  EXPECT_EQ(GpuFree(out), kGpuSuccess);
  EXPECT_EQ(GpuFreeHost(flag), kGpuSuccess);
}

#if MORI_BACKEND_HOST
// A forked child makes a copy stream of its own (its parent's stream's worker thread is not in the child)
// and copies on it; the parent's stream still works after the fork.
TEST_F(Kernel, AForkedChildCopiesOnACopyStreamOfItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer ends a child that starts threads after a multi-threaded fork";
#endif
  const GpuStream parents = HostCopyStream();
  pid_t pid = test::ForkWhenOtherThreadsSleep();  // the parent's stream's worker may still be starting
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::vector<uint8_t> up(4096), down(4096, 0);
    for (size_t i = 0; i < up.size(); ++i) up[i] = static_cast<uint8_t>(i * 5 + 3);
    uint8_t* dev = nullptr;
    if (GpuMalloc(reinterpret_cast<void**>(&dev), up.size()) != kGpuSuccess) _exit(10);
    double seconds = 0;
    GpuStream mine = HostCopyStream();
    if (mine == nullptr) _exit(11);
    if (TimedStreamCopy(dev, up.data(), up.size(), mine, &seconds) != kGpuSuccess ||
        TimedStreamCopy(down.data(), dev, down.size(), mine, &seconds) != kGpuSuccess)
      _exit(12);
    _exit(down == up ? 0 : 13);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      (void)waitpid(pid, &status, 0);
      FAIL() << "the child's copies did not finish in 30 s (it waited on its parent's stream?)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: no memory, 11: no stream, 12: a copy failed, 13: wrong bytes";
  EXPECT_EQ(HostCopyStream(), parents);
  std::vector<uint8_t> up(256), down(256);
  for (size_t i = 0; i < up.size(); ++i) up[i] = static_cast<uint8_t>(255 - i);
  uint8_t* dev = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&dev), up.size()), kGpuSuccess);
  double seconds = 0;
  ASSERT_EQ(TimedStreamCopy(dev, up.data(), up.size(), parents, &seconds), kGpuSuccess);
  ASSERT_EQ(TimedStreamCopy(down.data(), dev, down.size(), parents, &seconds), kGpuSuccess);
  EXPECT_EQ(down, up);
  EXPECT_EQ(GpuFree(dev), kGpuSuccess);
}
#endif

// HOST: a kernel that never ends (here, until the test lets it go) holds no synchronisation longer than twice
// MORI_TIMEOUT_S and 10 s: stream, event and device synchronisation return kGpuErrorTimeout and say why; once
// the kernel ends, the stream works as before. Before, each of them waited for as long as the kernel ran.
TEST_F(Kernel, HostSynchronisationsOfAKernelThatNeverEndsTimeOut) {
  setenv("MORI_TIMEOUT_S", "1", 1);
  uint32_t* flag = nullptr;
  ASSERT_EQ(GpuHostAllocMapped(reinterpret_cast<void**>(&flag), sizeof(uint32_t)), kGpuSuccess);
  *flag = 0;
  uint32_t* out = nullptr;
  ASSERT_EQ(GpuMalloc(reinterpret_cast<void**>(&out), 2 * sizeof(uint32_t)), kGpuSuccess);
  GpuStream stream;
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  GpuEvent after;
  ASSERT_EQ(GpuEventCreate(&after), kGpuSuccess);
  LaunchKernel(WaitForHostFlag, Dim3(1), Dim3(2), 0, stream, flag, out, uint64_t{60'000'000'000});
  ASSERT_EQ(GpuEventRecord(after, stream), kGpuSuccess);
  testing::internal::CaptureStderr();
  const auto start = std::chrono::steady_clock::now();
  GpuStatus streamSync = kGpuSuccess, eventSync = kGpuSuccess, deviceSync = kGpuSuccess;
  {  // all three at once: each has its own bound of 12 s
    std::thread a([&] { streamSync = GpuStreamSynchronize(stream); });
    std::thread b([&] { eventSync = GpuEventSynchronize(after); });
    deviceSync = GpuDeviceSynchronize();
    a.join();
    b.join();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string log = testing::internal::GetCapturedStderr();
  unsetenv("MORI_TIMEOUT_S");
  EXPECT_EQ(streamSync, kGpuErrorTimeout);
  EXPECT_EQ(eventSync, kGpuErrorTimeout);
  EXPECT_EQ(deviceSync, kGpuErrorTimeout);
  EXPECT_GE(took, 11.0);
  EXPECT_LT(took, 40.0);
  for (const char* call : {"GpuStreamSynchronize", "GpuEventSynchronize", "GpuDeviceSynchronize"}) {
    EXPECT_NE(log.find(std::string(call) + ": the HOST work it waits for has not finished after 12 s"),
              std::string::npos)
        << log;
  }
  EXPECT_NE(std::string(GpuGetErrorString(kGpuErrorTimeout)).find("twice MORI_TIMEOUT_S"), std::string::npos);
  AtomicStore<MemoryOrder::Release>(flag, 1u);
  ASSERT_EQ(GpuStreamSynchronize(stream), kGpuSuccess);
  ASSERT_EQ(GpuEventSynchronize(after), kGpuSuccess);
  std::vector<uint32_t> host(2);
  ASSERT_EQ(GpuMemcpy(host.data(), out, 2 * sizeof(uint32_t)), kGpuSuccess);
  EXPECT_EQ(host[0], 0xC0FFEEu);
  EXPECT_EQ(host[1], 0xC0FFEEu + 1);
  EXPECT_EQ(GpuEventDestroy(after), kGpuSuccess);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
  EXPECT_EQ(GpuFree(out), kGpuSuccess);
  EXPECT_EQ(GpuFreeHost(flag), kGpuSuccess);
}
#endif

}  // namespace
}  // namespace mori::core
