// SHMEM in one process (a job of one, or two processes forked with a unique id): the allocator, bad input
// on host and device (a clear message that names the cause, never a crash or corruption), a peer that dies,
// every family on the Self transport, and two forked PEs over P2P, RDMA and the Proxy transport.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/device_sync.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/stop.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"
#include "runtime.hpp"
#include "symmetric_heap.hpp"

namespace mori::shmem {
namespace test {
int LaunchFromSecondTranslationUnit(uint64_t* words);
}
namespace {

using core::Dim3;

// A pointer as the device's %p prints it.
std::string StrPointer(const void* p) {
  char text[32];
  snprintf(text, sizeof(text), "%p", p);
  return text;
}

TEST(SymmetricAllocatorTest, AlignsSplitsAndCoalescesBothSides) {
  SymmetricAllocator a(4096, 4096 + (1 << 20));
  auto x = a.Allocate(100, 64);
  auto y = a.Allocate(5000, 4096);
  auto z = a.Allocate(1, 1);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 4096u);
  EXPECT_EQ(*y % 4096, 0u);
  EXPECT_EQ(*a.SizeAt(*x), 128u);  // rounded to the granularity
  EXPECT_FALSE(a.SizeAt(*x + 64).has_value());
  uint64_t freeBefore = a.FreeBytes();
  EXPECT_TRUE(a.Free(*y));
  EXPECT_FALSE(a.Free(*y)) << "double free must be refused";
  EXPECT_TRUE(a.Free(*x));
  EXPECT_TRUE(a.Free(*z));
  EXPECT_EQ(a.Allocations(), 0u);
  EXPECT_EQ(a.LargestFree(), a.FreeBytes()) << "all ranges merged back into one";
  EXPECT_GT(a.FreeBytes(), freeBefore);
  EXPECT_FALSE(a.Allocate(a.FreeBytes() + 1, 64).has_value());
  EXPECT_FALSE(a.Allocate(0, 64).has_value());
  EXPECT_THROW(a.Allocate(64, 48), core::Error);
  // Fragmentation: every other block freed, then a request that needs two neighbours fails until they merge.
  std::vector<uint64_t> blocks;
  while (auto b = a.Allocate(1 << 16, 64)) blocks.push_back(*b);
  ASSERT_GE(blocks.size(), 8u);
  for (size_t i = 0; i < blocks.size(); i += 2) EXPECT_TRUE(a.Free(blocks[i]));
  EXPECT_FALSE(a.Allocate(2 << 16, 64).has_value());
  EXPECT_TRUE(a.Free(blocks[1]));
  auto merged = a.Allocate(3 << 16, 64);
  ASSERT_TRUE(merged.has_value());
  EXPECT_EQ(*merged, blocks[0]);
}

// The copy under every P2P put: every alignment of source and destination, sizes around the word and vector
// boundaries, one thread and a block of threads; bytes outside the range stay as they were.
MORI_GLOBAL void GroupCopyKernel(uint8_t* dst, const uint8_t* src, size_t bytes) {
  detail::GroupCopy<detail::Group::Block>(dst, src, bytes);
}

TEST(ShmemCopyTest, EveryAlignmentAndSize) {
  std::vector<uint8_t> src(4096 + 64), dst(4096 + 64);
  core::test::FillPattern(src.data(), src.size(), 3, 1);
#if MORI_BACKEND_HOST  // (device functions are host functions only here; GPUs take the block kernel below)
  std::vector<size_t> sizes;
  for (size_t b = 0; b <= 80; ++b) sizes.push_back(b);
  for (size_t b : {127, 128, 129, 1000, 4095}) sizes.push_back(b);
  for (size_t so = 0; so < 16; ++so) {
    for (size_t doff = 0; doff < 16; ++doff) {
      for (size_t b : sizes) {
        std::fill(dst.begin(), dst.end(), uint8_t{0xA5});
        detail::GroupCopy<detail::Group::Thread>(dst.data() + doff, src.data() + so, b);
        for (size_t i = 0; i < dst.size(); ++i) {
          uint8_t want = i >= doff && i < doff + b ? src[so + i - doff] : uint8_t{0xA5};
          ASSERT_EQ(dst[i], want) << "src offset " << so << " dst offset " << doff << " bytes " << b << " at " << i;
        }
      }
    }
  }
#endif
  // A block of host threads splitting the work.
  core::GpuBuffer d(dst.size()), s2(src.size());
  ASSERT_EQ(core::GpuMemcpy(s2.Data(), src.data(), src.size()), core::kGpuSuccess);
  for (size_t so : {0, 3, 8}) {
    for (size_t doff : {0, 5, 8}) {
      for (size_t b : {7, 33, 4000}) {
        std::vector<uint8_t> fill(dst.size(), 0xA5);
        ASSERT_EQ(core::GpuMemcpy(d.Data(), fill.data(), fill.size()), core::kGpuSuccess);
        core::LaunchKernel(GroupCopyKernel, Dim3(1), Dim3(MORI_BACKEND_HOST ? 3 : 96), 0, nullptr,
                           d.DataAs<uint8_t>() + doff, s2.DataAs<uint8_t>() + so, b);
        ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
        ASSERT_EQ(core::GpuMemcpy(dst.data(), d.Data(), dst.size()), core::kGpuSuccess);
        for (size_t i = 0; i < dst.size(); ++i) {
          uint8_t want = i >= doff && i < doff + b ? src[so + i - doff] : uint8_t{0xA5};
          ASSERT_EQ(dst[i], want) << "block copy: src offset " << so << " dst offset " << doff << " bytes " << b;
        }
      }
    }
  }
}

// A kernel that does one bad thing, chosen by `what`.
MORI_GLOBAL void BadKernel(int what, uint8_t* heapPtr, size_t bytes) {
  uint8_t local[16] = {1, 2, 3};
  switch (what) {
    case 0: ShmemPutMemNbiThread(heapPtr, local, 8, 0); break;          // before init / after finalize
    case 1: ShmemPutMemNbiThread(heapPtr, local, 8, 5); break;          // pe out of range
    case 2: ShmemPutMemNbiThread(local, heapPtr, 8, 0); break;          // destination outside the heap
    case 3: ShmemPutMemNbiThread(heapPtr, heapPtr, bytes, 0); break;    // size beyond the heap
    case 4: ShmemAtomicTypeFetchAddThread<uint64_t>(reinterpret_cast<uint64_t*>(heapPtr + 4), 1, 0); break;  // unaligned
    case 5: ShmemWaitUntil<uint64_t>(reinterpret_cast<uint64_t*>(heapPtr), CmpOp::EQ, 42); break;  // never comes
  }
}

// Runs BadKernel and returns what it printed; the launch must fail.
std::string RunBad(int what, uint8_t* heapPtr, size_t bytes) {
  ::testing::internal::CaptureStderr();
  core::LaunchKernel(BadKernel, Dim3(1), Dim3(1), 0, nullptr, what, heapPtr, bytes);
  core::GpuStatus launch = core::GpuGetLastError();
  core::GpuStatus sync = core::GpuDeviceSynchronize();
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(launch != core::kGpuSuccess || sync != core::kGpuSuccess) << "the kernel should have trapped";
  return err;
}

// Initialises this process as PE `rank` of a 2-PE job from `uid`.
bool InitPe(const mori_shmem_uniqueid_t& uid, int rank) {
  mori_shmem_uniqueid_t id = uid;
  mori_shmem_init_attr_t attr;
  return ShmemSetAttrUniqueIdArgs(rank, 2, &id, &attr) == 0 && ShmemInitAttr(MORI_SHMEM_INIT_WITH_UNIQUEID, &attr) == 0;
}

// Runs `pe(uid, rank)` as PE 1 in a forked child and as PE 0 here, with a fresh unique id; both must return 0
// (`name` is where the codes are explained).
void RunForkedPair(int (*pe)(const mori_shmem_uniqueid_t&, int), const char* name) {
  mori_shmem_uniqueid_t uid;
  ASSERT_EQ(ShmemGetUniqueId(&uid), 0);
  pid_t child = core::test::ForkWhenOtherThreadsSleep();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(pe(uid, 1));
  int rc = pe(uid, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(rc, 0) << "PE 0 (see " << name << " for the code)";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "PE 1 status " << status;
}

class ShmemSingleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("MORI_SHMEM_HEAP_SIZE", "8m", 1);
  }
};

TEST_F(ShmemSingleTest, DeviceBadInputTrapsWithTheCause) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "device traps end the GPU context; the HOST backend tests them";
  uint8_t dummy[64];
  EXPECT_NE(RunBad(0, dummy, 8).find("before ShmemInit"), std::string::npos);
  ASSERT_EQ(ShmemInit(), 0);
  EXPECT_EQ(ShmemNPes(), 1);
  auto* p = static_cast<uint8_t*>(ShmemMalloc(4096));
  ASSERT_NE(p, nullptr);
  std::string e = RunBad(1, p, 8);
  EXPECT_NE(e.find("target pe 5 is not in [0, 1)"), std::string::npos) << e;
  e = RunBad(2, p, 8);
  EXPECT_NE(e.find("is not inside the symmetric heap"), std::string::npos) << e;
  e = RunBad(3, p, ShmemHeapBytes() + 1);
  EXPECT_NE(e.find("is not inside the symmetric heap"), std::string::npos) << e;
  e = RunBad(4, p, 8);
  EXPECT_NE(e.find("is not aligned to 8 bytes"), std::string::npos) << e;
  ASSERT_EQ(ShmemFinalize(), 0);
  setenv("MORI_TIMEOUT_S", "1", 1);
  ASSERT_EQ(ShmemInit(), 0);
  p = static_cast<uint8_t*>(ShmemCalloc(1, 64));
  e = RunBad(5, p, 8);
  EXPECT_NE(e.find("waited"), std::string::npos) << e;
  unsetenv("MORI_TIMEOUT_S");
  ASSERT_EQ(ShmemFinalize(), 0);
  e = RunBad(0, p, 8);
  EXPECT_NE(e.find("after ShmemFinalize"), std::string::npos) << e;
}

TEST_F(ShmemSingleTest, HostBadInputIsAnErrorCode) {
  EXPECT_EQ(ShmemMalloc(64), nullptr);
  EXPECT_NE(ShmemFinalize(), 0);
  ASSERT_EQ(ShmemInit(), 0);
  EXPECT_NE(ShmemInit(), 0) << "a second init is refused";
  int x = 0;
  ShmemFree(&x);  // logged, not fatal
  EXPECT_EQ(ShmemMallocAlign(3, 64), nullptr) << "alignment that is not a power of two";
  EXPECT_EQ(ShmemCalloc(SIZE_MAX / 2, 4), nullptr);
  EXPECT_EQ(ShmemPtr(&x, 0), nullptr);
  mori_shmem_init_attr_t attr;
  EXPECT_NE(ShmemInitAttr(99, &attr), 0);
  EXPECT_NE(ShmemSetAttrUniqueIdArgs(3, 2, nullptr, &attr), 0);
  EXPECT_NE(ShmemBufferUnregister(&x), 0);
  void* p = ShmemMalloc(128);
  EXPECT_NE(p, nullptr);
  ShmemFree(p);
  ASSERT_EQ(ShmemFinalize(), 0);
  // A job of one under a forced Proxy transport has no pair to force: Self only, no proxy thread.
  setenv("MORI_SHMEM_TRANSPORT", "proxy", 1);
  ASSERT_EQ(ShmemInit(), 0);
  EXPECT_EQ(ShmemTransportType(0), TransportType::Self);
  ASSERT_EQ(ShmemFinalize(), 0);
  setenv("MORI_SHMEM_TRANSPORT", "carrier-pigeon", 1);
  EXPECT_NE(ShmemInit(), 0) << "an unknown transport";
  EXPECT_FALSE(ShmemIsInitialized());
  unsetenv("MORI_SHMEM_TRANSPORT");
}

// Every family against the calling PE itself.
MORI_GLOBAL void SelfKernel(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t* sig, uint64_t* counter,
                            uint32_t* out) {
  int me = ShmemMyPe();
  ShmemPutMemNbiSignalThread(dst, src, bytes, sig, 7, SignalOp::Set, me);
  ShmemSignalWaitUntil(sig, CmpOp::EQ, 7);
  ShmemAtomicTypeAddThread<uint64_t>(counter, 5, me);
  out[0] = static_cast<uint32_t>(ShmemAtomicTypeFetchAddThread<uint64_t>(counter, 1, me));
  out[1] = static_cast<uint32_t>(ShmemAtomicTypeCompareSwapThread<uint64_t>(counter, 6, 100, me));
  out[2] = static_cast<uint32_t>(ShmemGetTypeImmThread<uint64_t>(counter, me));
  ShmemQuietThread();
  ShmemBarrierAllThread();
}

TEST_F(ShmemSingleTest, EveryFamilyOnTheSelfTransport) {
  EXPECT_NE(ShmemBarrierAllChecked(), 0) << "before ShmemInit";
  ASSERT_EQ(ShmemInit(), 0);
  EXPECT_EQ(ShmemBarrierAllChecked(), 0);
  EXPECT_EQ(ShmemTransportType(0), TransportType::Self);
  const size_t bytes = 1234;
  auto* dst = static_cast<uint8_t*>(ShmemCalloc(1, bytes));
  auto* src = static_cast<uint8_t*>(ShmemMalloc(bytes));
  auto* sig = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  auto* counter = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  auto* out = static_cast<uint32_t*>(ShmemCalloc(3, 4));
  std::vector<uint8_t> pattern(bytes);
  core::test::FillPattern(pattern.data(), bytes, 0, 9);
  ASSERT_EQ(core::GpuMemcpy(src, pattern.data(), bytes), core::kGpuSuccess);
  core::LaunchKernel(SelfKernel, Dim3(1), Dim3(1), 0, nullptr, dst, src, bytes, sig, counter, out);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  std::vector<uint8_t> got(bytes);
  ASSERT_EQ(core::GpuMemcpy(got.data(), dst, bytes), core::kGpuSuccess);
  EXPECT_EQ(core::test::FirstPatternMismatch(got.data(), bytes, 0, 9), bytes);
  uint32_t o[3];
  ASSERT_EQ(core::GpuMemcpy(o, out, sizeof(o)), core::kGpuSuccess);
  EXPECT_EQ(o[0], 5u);
  EXPECT_EQ(o[1], 6u);
  EXPECT_EQ(o[2], 100u);
  ASSERT_EQ(ShmemFinalize(), 0);
}

// Device code in another file reads its own copy of the state: it must have been uploaded as well.
TEST_F(ShmemSingleTest, EveryTranslationUnitGetsTheState) {
  ASSERT_EQ(ShmemInit(), 0);
  auto* words = static_cast<uint64_t*>(ShmemCalloc(3, 8));
  ASSERT_NE(words, nullptr);
  ASSERT_EQ(test::LaunchFromSecondTranslationUnit(words), 0);
  uint64_t w[3];
  ASSERT_EQ(core::GpuMemcpy(w, words, sizeof(w)), core::kGpuSuccess);
  EXPECT_EQ(w[0], 1000u);
  EXPECT_EQ(w[1], 1u);
  EXPECT_EQ(w[2], 0xC0FFEEu);
  ShmemFree(words);
  ASSERT_EQ(ShmemFinalize(), 0);
}

// A shared library that includes the device API, loaded after ShmemInit and unloaded before
// ShmemFinalize: its kernels see the state, and the unload leaves nothing behind for finalize to call.
TEST_F(ShmemSingleTest, ModuleLoadedAfterInitGetsTheState) {
  EXPECT_NE(ShmemModuleInit(), 0) << "before ShmemInit";
  ASSERT_EQ(ShmemInit(), 0);
  auto* words = static_cast<uint64_t*>(ShmemCalloc(3, 8));
  ASSERT_NE(words, nullptr);
  void* module = dlopen(MORI_TEST_SHMEM_MODULE, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(module, nullptr) << dlerror();
  EXPECT_EQ(ShmemModuleInit(), 0);
  auto run = reinterpret_cast<int (*)(uint64_t*)>(dlsym(module, "MoriTestModuleRun"));
  ASSERT_NE(run, nullptr) << dlerror();
  ASSERT_EQ(run(words), 0);
  uint64_t w[3];
  ASSERT_EQ(core::GpuMemcpy(w, words, sizeof(w)), core::kGpuSuccess);
  EXPECT_EQ(w[0], 7000u);
  EXPECT_EQ(w[1], 1u);
  EXPECT_EQ(w[2], 0xD15C0u);
  EXPECT_EQ(dlclose(module), 0);
  EXPECT_EQ(ShmemModuleInit(), 0) << "the unloaded module's uploader is gone";
  EXPECT_NE(ShmemModuleFinalize(module), 0) << "a handle ShmemModuleInit never saw";
  ShmemFree(words);
  ASSERT_EQ(ShmemFinalize(), 0);
}

// Two processes started from a unique id; the second dies after init. The first learns it within
// MORI_TIMEOUT_S, from a message that names the dead PE, and neither hangs nor crashes.
TEST_F(ShmemSingleTest, UniqueIdInitAndAPeerThatDies) {
  setenv("MORI_TIMEOUT_S", "3", 1);
  mori_shmem_uniqueid_t uid;
  ASSERT_EQ(ShmemGetUniqueId(&uid), 0);
  pid_t child = core::test::ForkWhenOtherThreadsSleep();
  ASSERT_GE(child, 0);
  if (child == 0) {
    mori_shmem_init_attr_t attr;
    if (ShmemSetAttrUniqueIdArgs(1, 2, &uid, &attr) != 0 || ShmemInitAttr(MORI_SHMEM_INIT_WITH_UNIQUEID, &attr) != 0) {
      _exit(2);
    }
    mori::core::test::DieAbruptly(ShmemMyPe() == 1 && ShmemNPes() == 2 ? 0 : 3);  // dies without finalize
  }
  mori_shmem_init_attr_t attr;
  ASSERT_EQ(ShmemSetAttrUniqueIdArgs(0, 2, &uid, &attr), 0);
  ASSERT_EQ(ShmemInitAttr(MORI_SHMEM_INIT_WITH_UNIQUEID, &attr), 0);
  EXPECT_EQ(ShmemMyPe(), 0);
  EXPECT_EQ(ShmemNPes(), 2);
  EXPECT_EQ(ShmemTransportType(1), TransportType::P2P);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ::testing::internal::CaptureStderr();
  ShmemBarrierAll();
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
  // The same barrier, checked: it says it failed, and names the dead PE again.
  ::testing::internal::CaptureStderr();
  EXPECT_NE(ShmemBarrierAllChecked(), 0);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
  unsetenv("MORI_TIMEOUT_S");
}

// Two PEs forked from one unique id exchange data with every family over a forced transport. Runs under
// the sanitizers too (the mpirun suite cannot: Open MPI is not TSan-clean).
MORI_GLOBAL void PairKernel(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t* sig, uint64_t* counter,
                            uint32_t* counter32, uint32_t* bad) {
  int me = ShmemMyPe(), peer = 1 - me;
  unsigned t = core::FlatThreadIdx(), n = core::FlatBlockDim();
  size_t chunk = bytes / n;
  ShmemPutMemNbiThread(dst + t * chunk, src + t * chunk, chunk, peer);
  for (int i = 0; i < 25; ++i) {
    ShmemAtomicTypeFetchAddThread<uint64_t>(counter, 1, peer);
    ShmemAtomicTypeAddThread<uint32_t>(counter32, 2, 0);
  }
  ShmemQuietThread();
  core::SyncThreads();
  if (t == 0) ShmemSignalOpThread(sig, 1, SignalOp::Add, peer);
  if (t == 0) ShmemSignalWaitUntil(sig, CmpOp::EQ, 1);
  core::SyncThreads();
  const volatile uint8_t* got = dst;
  for (size_t i = t * chunk; i < (t + 1) * chunk; ++i) {
    if (got[i] != core::test::PatternByte(peer, i, 5)) {
      core::AtomicFetchAdd(bad, 1u);
      break;
    }
  }
  ShmemBarrierAllBlock();
}

MORI_HOST_DEVICE_INLINE uint16_t PairValue(int pe, size_t i) {
  return static_cast<uint16_t>(static_cast<size_t>(pe) * 40503u + i * 7u + 1u);
}

// More single-value puts than the proxy's staging ring holds, odd-sized values at every 2-byte offset, then
// single-value gets of what this PE put at the peer.
MORI_GLOBAL void PairValuesKernel(uint16_t* vals, size_t count, uint32_t* bad) {
  int me = ShmemMyPe(), peer = 1 - me;
  unsigned t = core::FlatThreadIdx(), n = core::FlatBlockDim();
  for (size_t i = t; i < count; i += n) ShmemPutTypeImmNbiThread<uint16_t>(&vals[i], PairValue(me, i), peer);
  ShmemQuietThread();
  ShmemBarrierAllBlock();
  const volatile uint16_t* got = vals;
  for (size_t i = t; i < count; i += n) {
    bool wrong = got[i] != PairValue(peer, i);
    if (i % 97 == 0) wrong = wrong || ShmemGetTypeImmThread<uint16_t>(&vals[i], peer) != PairValue(me, i);
    if (wrong) {
      core::AtomicFetchAdd(bad, 1u);
      break;
    }
  }
  ShmemBarrierAllBlock();
}

int RunPair(const mori_shmem_uniqueid_t& uid, int rank) {
  if (!InitPe(uid, rank)) return 10;
  const unsigned threads = 4;
  const size_t bytes = threads * 4099;
  auto* dst = static_cast<uint8_t*>(ShmemCalloc(1, bytes));
  auto* src = static_cast<uint8_t*>(ShmemMalloc(bytes));
  auto* words = static_cast<uint64_t*>(ShmemCalloc(4, 8));
  auto* bad = static_cast<uint32_t*>(ShmemCalloc(1, 4));
  const size_t values = 5003;
  auto* vals = static_cast<uint16_t*>(ShmemCalloc(values, sizeof(uint16_t)));
  if (!dst || !src || !words || !bad || !vals) return 11;
  std::vector<uint8_t> pattern(bytes);
  core::test::FillPattern(pattern.data(), bytes, rank, 5);
  if (core::GpuMemcpy(src, pattern.data(), bytes) != core::kGpuSuccess) return 12;
  ShmemBarrierAll();
  core::LaunchKernel(PairKernel, Dim3(1), Dim3(threads), 0, nullptr, dst, src, bytes, &words[0], &words[1],
                     reinterpret_cast<uint32_t*>(&words[2]), bad);
  if (core::GpuDeviceSynchronize() != core::kGpuSuccess) return 13;
  ShmemBarrierAll();
  uint64_t w[4];
  uint32_t b = 0;
  if (core::GpuMemcpy(w, words, sizeof(w)) != core::kGpuSuccess || core::GpuMemcpy(&b, bad, 4) != core::kGpuSuccess) {
    return 14;
  }
  int rc = 0;
  if (b != 0) rc = 15;                                    // data did not arrive whole before the signal
  if (w[1] != threads * 25) rc = 16;                      // fetch-adds from the peer
  uint64_t want32 = rank == 0 ? uint64_t(2) * 2 * threads * 25 : 0;
  if ((w[2] & 0xffffffffu) != want32 || (w[2] >> 32) != 0) rc = 17;  // 32-bit adds from both PEs to PE 0
  core::LaunchKernel(PairValuesKernel, Dim3(1), Dim3(threads), 0, nullptr, vals, values, bad);
  if (core::GpuDeviceSynchronize() != core::kGpuSuccess) return 19;
  if (core::GpuMemcpy(&b, bad, 4) != core::kGpuSuccess || b != 0) rc = 20;  // single values lost or wrong
  if (ShmemFinalize() != 0 && rc == 0) rc = 18;
  return rc;
}

class ShmemPairTest : public ShmemSingleTest, public ::testing::WithParamInterface<const char*> {};

// "proxy:tcp" -> MORI_SHMEM_TRANSPORT=proxy, MORI_SHMEM_PROXY_CONN=tcp.
void SetTransportFromParam(const std::string& param) {
  size_t colon = param.find(':');
  setenv("MORI_SHMEM_TRANSPORT", param.substr(0, colon).c_str(), 1);
  if (colon != std::string::npos) {
    setenv("MORI_SHMEM_PROXY_CONN", param.substr(colon + 1).c_str(), 1);
  } else {
    unsetenv("MORI_SHMEM_PROXY_CONN");
  }
}

// A transport parameter as a test name: "proxy:tcp" -> "proxy_tcp".
std::string TransportParamName(const ::testing::TestParamInfo<const char*>& info) {
  std::string name = info.param;
  std::replace(name.begin(), name.end(), ':', '_');
  return name;
}

TEST_P(ShmemPairTest, EveryFamilyBetweenTwoForkedPes) {
  if (IsSkipped()) return;
  SetTransportFromParam(GetParam());
  setenv("MORI_TIMEOUT_S", "60", 1);
  RunForkedPair(RunPair, "RunPair");
  unsetenv("MORI_SHMEM_TRANSPORT");
  unsetenv("MORI_SHMEM_PROXY_CONN");
}

INSTANTIATE_TEST_SUITE_P(Transports, ShmemPairTest, ::testing::Values("p2p", "rdma", "proxy:tcp", "proxy:rdma"),
                         TransportParamName);

// A kernel that puts and ends without quieting: the host's ShmemBarrierAll completes the puts, as NVSHMEM's
// does, so the peer reads them right after its own barrier. Every WQE of the emulated NIC waits 300 ms here, so
// a barrier that only waited for the kernel would come long before the data.
MORI_GLOBAL void PutAndLeaveKernel(uint8_t* dst, const uint8_t* src, size_t bytes, int pe) {
  ShmemPutMemNbiThread(dst, src, bytes, pe);
}

int RunUnquieted(const mori_shmem_uniqueid_t& uid, int rank) {
  if (!InitPe(uid, rank)) return 10;
  const size_t bytes = 65536 + 24;
  auto* dst = static_cast<uint8_t*>(ShmemCalloc(1, bytes));
  auto* src = static_cast<uint8_t*>(ShmemMalloc(bytes));
  if (dst == nullptr || src == nullptr) return 11;
  std::vector<uint8_t> pattern(bytes);
  core::test::FillPattern(pattern.data(), bytes, rank, 31);
  if (core::GpuMemcpy(src, pattern.data(), bytes) != core::kGpuSuccess) return 12;
  ShmemBarrierAll();
  core::LaunchKernel(PutAndLeaveKernel, Dim3(1), Dim3(1), 0, nullptr, dst, src, bytes, 1 - rank);
  if (core::GpuDeviceSynchronize() != core::kGpuSuccess) return 13;
  ShmemBarrierAll();
  std::vector<uint8_t> got(bytes);
  if (core::GpuMemcpy(got.data(), dst, bytes) != core::kGpuSuccess) return 14;
  int rc = core::test::FirstPatternMismatch(got.data(), bytes, 1 - rank, 31) == bytes ? 0 : 15;  // not all there
  if (ShmemFinalize() != 0 && rc == 0) rc = 16;
  return rc;
}

class ShmemUnquietedTest : public ShmemSingleTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(ShmemUnquietedTest, TheHostBarrierCompletesPutsAKernelLeftUnquieted) {
  if (IsSkipped()) return;
  SetTransportFromParam(GetParam());
  setenv("MORI_TIMEOUT_S", "60", 1);
  setenv("MORI_EMULATED_NIC_DELAY_US", "300000", 1);
  RunForkedPair(RunUnquieted, "RunUnquieted");
  unsetenv("MORI_EMULATED_NIC_DELAY_US");
  unsetenv("MORI_SHMEM_TRANSPORT");
  unsetenv("MORI_SHMEM_PROXY_CONN");
}

INSTANTIATE_TEST_SUITE_P(Transports, ShmemUnquietedTest, ::testing::Values("rdma", "proxy:rdma"),
                         TransportParamName);

// Bad input over the Proxy transport: a PE out of range, a target outside the heap and a source the proxy
// cannot reach trap with a message naming PE, peer and address; the runtime still finalises afterwards.
MORI_GLOBAL void ProxyBadKernel(int what, uint8_t* heapPtr, uint8_t* outside) {
  int peer = 1 - ShmemMyPe();
  switch (what) {
    case 0:
      ShmemPutMemNbiThread(heapPtr, heapPtr + 8, 8, 7);
      break;
    case 1:
      ShmemPutMemNbiThread(outside, heapPtr, 8, peer);
      break;
    case 2:
      ShmemPutMemNbiSignalThread(heapPtr, outside, 8, reinterpret_cast<uint64_t*>(heapPtr), 1, SignalOp::Set, peer);
      break;
    case 3:
      ShmemGetMemThread(outside, heapPtr, 8, peer);
      break;
    case 4:
      ShmemPutMemNbiThread(heapPtr, outside, 8, peer);
      break;
  }
}

int RunProxyBad(const mori_shmem_uniqueid_t& uid, int rank) {
  if (!InitPe(uid, rank)) return 10;
  if (ShmemTransportType(1 - rank) != TransportType::Proxy) return 11;
  auto* heap = static_cast<uint8_t*>(ShmemCalloc(1, 64));
  core::GpuBuffer outside(64);
  if (heap == nullptr) return 12;
  const char* expected[] = {"target pe 7 is not in [0, 2)", "is not inside the symmetric heap",
                            "so the proxy cannot read it", "so the proxy cannot reach it",
                            "so the proxy cannot reach it"};
  for (int what = 0; what < 5; ++what) {
    ::testing::internal::CaptureStderr();
    core::LaunchKernel(ProxyBadKernel, Dim3(1), Dim3(1), 0, nullptr, what, heap, outside.DataAs<uint8_t>());
    core::GpuStatus launch = core::GpuGetLastError();
    core::GpuStatus sync = core::GpuDeviceSynchronize();
    std::string err = ::testing::internal::GetCapturedStderr();
    if (launch == core::kGpuSuccess && sync == core::kGpuSuccess) return 20 + what;  // it should have trapped
    if (err.find(expected[what]) == std::string::npos) {
      fprintf(stderr, "PE %d, case %d: expected '%s' in: %s\n", rank, what, expected[what], err.c_str());
      return 30 + what;
    }
    if (what >= 2 && err.find(StrPointer(outside.Data())) == std::string::npos) {
      fprintf(stderr, "PE %d, case %d: the message does not name %p: %s\n", rank, what, outside.Data(), err.c_str());
      return 40 + what;
    }
  }
  // After registering it, the same buffer is a fine source and destination.
  if (ShmemBufferRegister(outside.Data(), 64) != 0) return 50;
  ShmemBarrierAll();
  if (ShmemFinalize() != 0) return 51;
  return 0;
}

TEST_F(ShmemSingleTest, ProxyBadInputTrapsWithTheCause) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "device traps end the GPU context; the HOST backend tests them";
  setenv("MORI_SHMEM_TRANSPORT", "proxy", 1);
  setenv("MORI_SHMEM_PROXY_CONN", "tcp", 1);
  setenv("MORI_TIMEOUT_S", "60", 1);
  RunForkedPair(RunProxyBad, "RunProxyBad");
  unsetenv("MORI_SHMEM_TRANSPORT");
  unsetenv("MORI_SHMEM_PROXY_CONN");
}

// Over the Proxy transport a peer that died fails the proxy with a message naming it; the kernel waiting on
// the proxy traps instead of hanging.
MORI_GLOBAL void ProxyPutQuietKernel(uint8_t* dst, size_t bytes, int pe) {
  ShmemPutMemNbiThread(dst, dst + bytes, bytes, pe);
  ShmemQuietThread();
}

TEST_F(ShmemSingleTest, ProxyPeerThatDiesFailsTheProxyNamingIt) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "device traps end the GPU context; the HOST backend tests them";
  setenv("MORI_SHMEM_TRANSPORT", "proxy", 1);
  setenv("MORI_SHMEM_PROXY_CONN", "tcp", 1);
  setenv("MORI_TIMEOUT_S", "5", 1);
  mori_shmem_uniqueid_t uid;
  ASSERT_EQ(ShmemGetUniqueId(&uid), 0);
  const size_t bytes = 100000;
  auto start = [&uid](int rank) { return InitPe(uid, rank); };
  pid_t child = core::test::ForkWhenOtherThreadsSleep();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!start(1) || ShmemMalloc(2 * bytes) == nullptr) _exit(2);
    ShmemBarrierAll();
    mori::core::test::DieAbruptly(0);  // dies without finalize
  }
  ASSERT_TRUE(start(0));
  auto* p = static_cast<uint8_t*>(ShmemMalloc(2 * bytes));
  ASSERT_NE(p, nullptr);
  ShmemBarrierAll();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "PE 1 status " << status;
  // Its own stream, synchronised alone: the dead link's threads release their streams meanwhile.
  core::GpuStream stream = nullptr;
  ASSERT_EQ(core::GpuStreamCreate(&stream), core::kGpuSuccess);
  ::testing::internal::CaptureStderr();
  core::LaunchKernel(ProxyPutQuietKernel, Dim3(1), Dim3(1), 0, stream, p, bytes, 1);
  core::GpuStatus launch = core::GpuGetLastError();
  core::GpuStatus sync = core::GpuStreamSynchronize(stream);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(core::GpuStreamDestroy(stream), core::kGpuSuccess);
  EXPECT_TRUE(launch != core::kGpuSuccess || sync != core::kGpuSuccess) << "the kernel should have trapped";
  EXPECT_NE(err.find("proxy serving this FIFO failed"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
  unsetenv("MORI_SHMEM_TRANSPORT");
  unsetenv("MORI_SHMEM_PROXY_CONN");
  unsetenv("MORI_TIMEOUT_S");
}

// A connection choice that is not one of auto|rdma|tcp fails init on both PEs (no hang).
TEST_F(ShmemSingleTest, ProxyConnectionChoiceMustBeKnown) {
  setenv("MORI_SHMEM_TRANSPORT", "proxy", 1);
  setenv("MORI_SHMEM_PROXY_CONN", "smoke-signals", 1);
  setenv("MORI_TIMEOUT_S", "20", 1);
  mori_shmem_uniqueid_t uid;
  ASSERT_EQ(ShmemGetUniqueId(&uid), 0);
  auto init = [&uid](int rank) {
    mori_shmem_uniqueid_t id = uid;
    mori_shmem_init_attr_t attr;
    if (ShmemSetAttrUniqueIdArgs(rank, 2, &id, &attr) != 0) return 2;
    return ShmemInitAttr(MORI_SHMEM_INIT_WITH_UNIQUEID, &attr) != 0 && !ShmemIsInitialized() ? 0 : 1;
  };
  pid_t child = core::test::ForkWhenOtherThreadsSleep();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(init(1));
  ::testing::internal::CaptureStderr();
  int rc = init(0);
  std::string err = ::testing::internal::GetCapturedStderr();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(rc, 0) << "PE 0's init should have failed";
  EXPECT_NE(err.find("MORI_SHMEM_PROXY_CONN"), std::string::npos) << err;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "PE 1 status " << status;
  unsetenv("MORI_SHMEM_TRANSPORT");
  unsetenv("MORI_SHMEM_PROXY_CONN");
}

// What PEs exchange at init names their MORI_SHMEM_TRANSPORT by index; the error that reports a mismatch
// names a peer's index without reading outside the table, whatever the peer sent.
TEST(ShmemInitExchange, TransportChoiceNamesStayInsideTheTable) {
  EXPECT_STREQ(TransportChoiceName(0), "auto");
  EXPECT_STREQ(TransportChoiceName(1), "p2p");
  EXPECT_STREQ(TransportChoiceName(2), "rdma");
  EXPECT_STREQ(TransportChoiceName(3), "proxy");
  for (int32_t bad : {-1, 4, 5, 1000, INT_MAX, INT_MIN}) EXPECT_STREQ(TransportChoiceName(bad), "an unknown choice");
}

// A finalize that fails at its barrier (the peer died) has cleared the device state first: a kernel that uses
// the device API afterwards is told the runtime is gone, instead of writing into the heap freed with it.
TEST_F(ShmemSingleTest, AFinalizeWhoseBarrierFailsLeavesNoStateOnTheFreedHeap) {
  if (!MORI_BACKEND_HOST) GTEST_SKIP() << "device traps end the GPU context; the HOST backend tests them";
  setenv("MORI_TIMEOUT_S", "10", 1);
  mori_shmem_uniqueid_t uid;
  ASSERT_EQ(ShmemGetUniqueId(&uid), 0);
  auto init = [&](int rank) { return InitPe(uid, rank); };
  pid_t child = core::test::ForkWhenOtherThreadsSleep();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(init(1) && ShmemCalloc(1, 64) != nullptr ? 0 : 1);  // leaves without finalizing
  ASSERT_TRUE(init(0));
  auto* p = static_cast<uint8_t*>(ShmemCalloc(1, 64));
  ASSERT_NE(p, nullptr);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "PE 1 status " << status;
  ::testing::internal::CaptureStderr();
  const int finalized = ShmemFinalize();
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(finalized, 0) << "the barrier with a dead peer should have failed";
  EXPECT_NE(err.find("ShmemFinalize"), std::string::npos) << err;
  err = RunBad(0, p, 8);
  EXPECT_NE(err.find("after ShmemFinalize"), std::string::npos) << err;
  unsetenv("MORI_TIMEOUT_S");
}

// A kernel that never ends (here: until the host lets it go) holds neither a host barrier nor finalize past
// MORI_TIMEOUT_S; finalize then frees nothing, so the kernel's late writes land in memory that is still the heap.
MORI_GLOBAL void WaitForHostKernel(const uint32_t* release, uint64_t* heapWord, uint64_t value) {
  core::SpinDeadline deadline(uint64_t{60} * 1000000000ull);
  while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(release) == 0 && !deadline.Expired()) {
    core::SpinPause();
  }
  core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::System>(heapWord, value);
}

TEST_F(ShmemSingleTest, AKernelThatNeverEndsFailsTheBarrierAndFinalizeWithinTheTimeout) {
  setenv("MORI_TIMEOUT_S", "2", 1);
  ASSERT_EQ(ShmemInit(), 0);
  auto* word = static_cast<uint64_t*>(ShmemCalloc(1, sizeof(uint64_t)));
  ASSERT_NE(word, nullptr);
  core::GpuBuffer release(sizeof(uint32_t), core::MemoryType::HostPinned);
  std::memset(release.Data(), 0, sizeof(uint32_t));
  const uint64_t value = 0x5eed0000u + static_cast<uint64_t>(getpid() & 0xffff);
  core::LaunchKernel(WaitForHostKernel, Dim3(1), Dim3(1), 0, nullptr, release.DataAs<const uint32_t>(), word, value);
  auto t0 = std::chrono::steady_clock::now();
  ::testing::internal::CaptureStderr();
  ShmemBarrierAll();
  const int finalized = ShmemFinalize();
  std::string err = ::testing::internal::GetCapturedStderr();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(finalized, 0);
  EXPECT_LT(took, 30.0) << "the barrier and finalize waited for the kernel";
  EXPECT_NE(err.find("waiting for its kernels before a host barrier"), std::string::npos) << err;
  EXPECT_NE(err.find("had not finished after 2 s"), std::string::npos) << err;
  EXPECT_NE(err.find("heap and state are left in place"), std::string::npos) << err;
  core::AtomicStore<core::MemoryOrder::Release, core::Scope::System>(release.DataAs<uint32_t>(), 1u);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  // The helper thread finishes the waits that timed out before it takes this one: idle afterwards.
  ASSERT_EQ(core::DeviceSynchronizeBy(core::Deadline::After(30), "the test"), core::kGpuSuccess);
  uint64_t got = 0;
  ASSERT_EQ(core::GpuMemcpy(&got, word, sizeof(got)), core::kGpuSuccess);
  EXPECT_EQ(got, value) << "the kernel's late write did not land in the heap";
  unsetenv("MORI_TIMEOUT_S");
}


// Waits that only a stop ends (core/stop.hpp): in block 0, thread 0 waits for a signal nobody sends while the
// block's other threads wait for it at a block barrier; in block 1, PE 0 enters a device barrier that PE 1 never
// joins (a one-PE job: every thread waits for a signal); in block 2, every thread waits for a value nobody
// writes. `started` (host-pinned) counts the threads that got there.
MORI_GLOBAL void NeverSatisfiedKernel(uint64_t* words, int rank, int nPes, uint32_t* started) {
  const unsigned b = core::FlatBlockIdx(), t = core::FlatThreadIdx();
  core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::System>(started, 1u);
  if (b == 0) {
    if (t == 0) ShmemWaitUntil<uint64_t>(&words[0], CmpOp::EQ, 0x600d);
    core::SyncThreads();
  } else if (b == 1 && rank == 0 && nPes > 1) {
    ShmemBarrierAllBlock();
  } else {
    ShmemWaitUntil<uint64_t>(&words[1 + t % 2], CmpOp::GE, 1000 + t);
  }
}

MORI_GLOBAL void WaitSatisfiedKernel(uint64_t* words) {
  ShmemWaitUntil<uint64_t>(&words[3], CmpOp::EQ, 0x5eed);
  words[3] = 0x5eed + 1;
}

constexpr unsigned kStopBlocks = 3;
constexpr unsigned kStopThreads = 4;

// Waits, bounded, until the kernel's threads have all started.
bool AllStarted(const uint32_t* started, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(started) < kStopBlocks * kStopThreads) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// The stop word set while every kind of wait spins: the kernel ends long before MORI_TIMEOUT_S (60 s here), and
// with the word cleared again, waits work as before.
TEST_F(ShmemSingleTest, TheStopWordEndsEveryKindOfDeviceWait) {
  if (MORI_BACKEND_HIP) GTEST_SKIP() << "on HIP a stop does not leave a kernel (docs/GUIDE.md)";
  setenv("MORI_TIMEOUT_S", "60", 1);
  ASSERT_EQ(ShmemInit(), 0);
  auto* words = static_cast<uint64_t*>(ShmemCalloc(4, sizeof(uint64_t)));
  ASSERT_NE(words, nullptr);
  core::GpuBuffer started(sizeof(uint32_t), core::MemoryType::HostPinned);
  std::memset(started.Data(), 0, sizeof(uint32_t));
  core::LaunchKernel(NeverSatisfiedKernel, Dim3(kStopBlocks), Dim3(kStopThreads), 0, nullptr, words, 0, 1,
                     started.DataAs<uint32_t>());
  ASSERT_TRUE(AllStarted(started.DataAs<uint32_t>(), 30)) << "the kernel did not start";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  core::detail::SetStopWordForTesting(true);
  const auto t0 = std::chrono::steady_clock::now();
  // HOST fails a launch whose threads were stopped; a GPU kernel just ends, without an error. Either way it ends,
  // well within 10 s.
  core::GpuStatus status = core::kGpuSuccess;
  EXPECT_NO_THROW(status = core::DeviceSynchronizeBy(core::Deadline::After(10), "the stopped kernel"));
#if MORI_BACKEND_HOST
  EXPECT_NE(status, core::kGpuSuccess) << "HOST reports a stopped launch as failed";
#else
  EXPECT_EQ(status, core::kGpuSuccess) << "a stopped kernel must not fail its context";
#endif
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 10.0);
  core::detail::SetStopWordForTesting(false);
  (void)core::GpuGetLastError();
  // Waits that are satisfied still return what they waited for.
  const uint64_t go = 0x5eed;
  ASSERT_EQ(core::GpuMemcpy(&words[3], &go, sizeof(go)), core::kGpuSuccess);
  core::LaunchKernel(WaitSatisfiedKernel, Dim3(1), Dim3(1), 0, nullptr, words);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  uint64_t got = 0;
  ASSERT_EQ(core::GpuMemcpy(&got, &words[3], sizeof(got)), core::kGpuSuccess);
  EXPECT_EQ(got, go + 1);
  EXPECT_EQ(ShmemFinalize(), 0);
  unsetenv("MORI_TIMEOUT_S");
}

// Groups whose leader waits for them, stopped (core::OnStop::Report): a warp whose lowest lane reserves send
// slots for all its lanes in a queue with no room, and warps and a block whose thread 0 waits between the group
// barriers of a remote operation. Every thread counts itself in `started` and, if it gets past the leader's
// wait, writes its mark: a stopped leader must take its group with it, so no mark is written.
constexpr unsigned kGroupThreads = 48;  // a full warp and a partial one on CUDA

MORI_GLOBAL void GroupReserveKernel(rdma::WorkQueueHandle* wq, rdma::CompletionQueueHandle* cq, uint32_t* marks,
                                    uint32_t* started) {
  core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::System>(started, 1u);
  const rdma::GroupSlots g =
      rdma::ReserveSendSlotsForGroup<rdma::ProviderType::MLX5>(*wq, *cq, core::ActiveLanes(), 60'000'000'000ull);
  marks[core::FlatThreadIdx()] = 0x1000 + g.slot;
}

template <detail::Group G>
MORI_GLOBAL void GroupLeaderWaitKernel(const uint64_t* word, const uint32_t* stop, uint32_t* marks,
                                       uint32_t* started) {
  core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::System>(started, 1u);
  const uint32_t present = detail::GroupSyncPresent<G>();
  if (detail::GroupRank<G>() == 0) {
    core::SpinDeadline deadline(60'000'000'000ull, stop);
    while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(word) != 0x600d) {
      MORI_DEVICE_ASSERT(!deadline.Expired(), "the leader's word never came");
      core::SpinPause();
    }
  }
  detail::GroupSyncOrLeave<G>(present);
  marks[core::FlatThreadIdx()] = 0x2000 + core::FlatThreadIdx();
}

#if MORI_BACKEND_CUDA
// The same with a plain block barrier after the leader's wait, as before the counted one: what it would let by.
MORI_GLOBAL void BlockLeaderWaitPlainBarrierKernel(const uint64_t* word, const uint32_t* stop, uint32_t* marks,
                                                   uint32_t* started) {
  core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::System>(started, 1u);
  core::SyncThreads();
  if (core::FlatThreadIdx() == 0) {
    core::SpinDeadline deadline(60'000'000'000ull, stop);
    while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(word) != 0x600d) {
      MORI_DEVICE_ASSERT(!deadline.Expired(), "the leader's word never came");
      core::SpinPause();
    }
  }
  core::SyncThreads();
  marks[core::FlatThreadIdx()] = 0x2000 + core::FlatThreadIdx();
}
#endif

// Launches `launch` (kGroupThreads threads that count themselves in `started`), sets the stop word once they all
// started, and expects the kernel to end within 10 s with none of `marks` written (or, with `leaderOnly`, all
// but the leader's).
template <typename Launch>
void ExpectStoppedGroupLeaves(const char* what, uint32_t* marks, uint32_t* started, Launch launch,
                              bool leaderOnly = false) {
  ASSERT_EQ(core::GpuMemset(marks, 0, kGroupThreads * sizeof(uint32_t)), core::kGpuSuccess);
  core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::System>(started, 0u);
  launch();
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(started) < kGroupThreads &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const uint32_t arrived = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(started);
  ASSERT_EQ(arrived, kGroupThreads) << what;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  core::detail::SetStopWordForTesting(true);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NO_THROW((void)core::DeviceSynchronizeBy(core::Deadline::After(10), what));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0) << what;
  core::detail::SetStopWordForTesting(false);
  (void)core::GpuGetLastError();
  std::vector<uint32_t> got(kGroupThreads, 1);
  ASSERT_EQ(core::GpuMemcpy(got.data(), marks, kGroupThreads * sizeof(uint32_t)), core::kGpuSuccess);
  for (unsigned t = 0; t < kGroupThreads; ++t) {
    if (leaderOnly && t > 0) {
      EXPECT_EQ(got[t], 0x2000 + t) << what << ": thread " << t << " did not go on past its stopped leader";
    } else {
      EXPECT_EQ(got[t], 0u) << what << ": thread " << t << " went on past its stopped leader";
    }
  }
}

TEST_F(ShmemSingleTest, AGroupWhoseLeaderIsStoppedLeavesWithIt) {
  if (MORI_BACKEND_HIP) GTEST_SKIP() << "on HIP a stop does not leave a kernel (docs/GUIDE.md)";
  ASSERT_EQ(ShmemInit(), 0);
  core::GpuBuffer marks(kGroupThreads * sizeof(uint32_t), core::MemoryType::Device);
  core::GpuBuffer started(sizeof(uint32_t), core::MemoryType::HostPinned);
  core::GpuBuffer word(sizeof(uint64_t), core::MemoryType::Device);
  core::GpuBuffer queues(sizeof(rdma::WorkQueueHandle) + sizeof(rdma::CompletionQueueHandle),
                         core::MemoryType::Device);
  auto* wq = queues.DataAs<rdma::WorkQueueHandle>();
  auto* cq = reinterpret_cast<rdma::CompletionQueueHandle*>(queues.DataAs<uint8_t>() + sizeof(rdma::WorkQueueHandle));
  // A send queue of `depth` slots, `posted` of them taken and none completed; the CQ's lock is held, so nothing
  // is polled.
  auto setQueues = [&](uint32_t depth, uint32_t posted) {
    rdma::WorkQueueHandle w{};
    w.sqWqeNum = depth;
    w.postIdx = posted;
    w.stop = core::DeviceStopWord();
    rdma::CompletionQueueHandle c{};
    c.pollLock = 1;
    ASSERT_EQ(core::GpuMemcpy(wq, &w, sizeof(w)), core::kGpuSuccess);
    ASSERT_EQ(core::GpuMemcpy(cq, &c, sizeof(c)), core::kGpuSuccess);
  };
  auto* m = marks.DataAs<uint32_t>();
  auto* st = started.DataAs<uint32_t>();
  auto* w = word.DataAs<uint64_t>();
  const uint32_t* stop = core::DeviceStopWord();

  setQueues(64, 64);  // room for a warp's group (a group above MaxSlotsAtOnce, 33 here, traps at once)
  ExpectStoppedGroupLeaves("the send-slot reservation", m, st, [&] {
    core::LaunchKernel(GroupReserveKernel, Dim3(1), Dim3(kGroupThreads), 0, nullptr, wq, cq, m, st);
  });
  ASSERT_EQ(core::GpuMemset(w, 0, sizeof(uint64_t)), core::kGpuSuccess);
  ExpectStoppedGroupLeaves("warps", m, st, [&] {
    core::LaunchKernel(GroupLeaderWaitKernel<detail::Group::Warp>, Dim3(1), Dim3(kGroupThreads), 0, nullptr,
                       static_cast<const uint64_t*>(w), stop, m, st);
  });
  ExpectStoppedGroupLeaves("a block", m, st, [&] {
    core::LaunchKernel(GroupLeaderWaitKernel<detail::Group::Block>, Dim3(1), Dim3(kGroupThreads), 0, nullptr,
                       static_cast<const uint64_t*>(w), stop, m, st);
  });

#if MORI_BACKEND_CUDA
  // The hazard the counted barrier closes, shown: past a plain one, the block's other threads go on as if thread
  // 0's wait had ended (PTX `exit` releases a CTA barrier that waits only for the exiting thread).
  ExpectStoppedGroupLeaves(
      "a block behind a plain barrier", m, st,
      [&] {
        core::LaunchKernel(BlockLeaderWaitPlainBarrierKernel, Dim3(1), Dim3(kGroupThreads), 0, nullptr,
                           static_cast<const uint64_t*>(w), stop, m, st);
      },
      true);
#endif

  // With room and with the word written, the same kernels go on: every thread gets its slot (the slots of a
  // warp's lanes are consecutive) and writes its mark.
  setQueues(64, 0);
  ASSERT_EQ(core::GpuMemset(m, 0, kGroupThreads * sizeof(uint32_t)), core::kGpuSuccess);
  core::LaunchKernel(GroupReserveKernel, Dim3(1), Dim3(kGroupThreads), 0, nullptr, wq, cq, m, st);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  std::vector<uint32_t> got(kGroupThreads);
  ASSERT_EQ(core::GpuMemcpy(got.data(), m, kGroupThreads * sizeof(uint32_t)), core::kGpuSuccess);
  std::vector<uint32_t> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (unsigned t = 0; t < kGroupThreads; ++t) EXPECT_EQ(sorted[t], 0x1000 + t) << "slots are not one each";
  const uint64_t go = 0x600d;
  ASSERT_EQ(core::GpuMemcpy(w, &go, sizeof(go)), core::kGpuSuccess);
  for (int block = 0; block < 2; ++block) {
    ASSERT_EQ(core::GpuMemset(m, 0, kGroupThreads * sizeof(uint32_t)), core::kGpuSuccess);
    if (block == 0) {
      core::LaunchKernel(GroupLeaderWaitKernel<detail::Group::Warp>, Dim3(1), Dim3(kGroupThreads), 0, nullptr,
                         static_cast<const uint64_t*>(w), stop, m, st);
    } else {
      core::LaunchKernel(GroupLeaderWaitKernel<detail::Group::Block>, Dim3(1), Dim3(kGroupThreads), 0, nullptr,
                         static_cast<const uint64_t*>(w), stop, m, st);
    }
    ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
    ASSERT_EQ(core::GpuMemcpy(got.data(), m, kGroupThreads * sizeof(uint32_t)), core::kGpuSuccess);
    for (unsigned t = 0; t < kGroupThreads; ++t) EXPECT_EQ(got[t], 0x2000 + t) << "thread " << t << ", " << block;
  }
  EXPECT_EQ(ShmemFinalize(), 0);
}

// A PE of a pair: initialises, starts NeverSatisfiedKernel, tells the parent on `readyFd`, and waits for the
// kernel. Only the stop and the signal after it end the process; returning is a failure (the code says where).
int WaitUntilStopped(const mori_shmem_uniqueid_t& uid, int rank, int readyFd) {
  if (!InitPe(uid, rank)) return 10;
  auto* words = static_cast<uint64_t*>(ShmemCalloc(4, sizeof(uint64_t)));
  if (words == nullptr) return 11;
  core::GpuBuffer started(sizeof(uint32_t), core::MemoryType::HostPinned);
  std::memset(started.Data(), 0, sizeof(uint32_t));
  ShmemBarrierAll();
  core::LaunchKernel(NeverSatisfiedKernel, Dim3(kStopBlocks), Dim3(kStopThreads), 0, nullptr, words, rank, 2,
                     started.DataAs<uint32_t>());
  if (!AllStarted(started.DataAs<uint32_t>(), 30)) return 12;
  const char c = 'k';
  if (write(readyFd, &c, 1) != 1) return 13;
  (void)core::GpuDeviceSynchronize();
  // The kernel has left; the signal ends the process right after. Still here after 10 s: no stop happened.
  for (int i = 0; i < 100; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return 14;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class ShmemStopTest : public ShmemPairTest {};

// Both PEs of a pair wait in kernels that nothing but a stop ends (MORI_TIMEOUT_S is 60 s); SIGTERM to each
// ends it within seconds, by SIGTERM (what the sender sees), and its log says its device waits were stopped and
// the device went idle first.
TEST_P(ShmemStopTest, SigtermEndsPesWaitingInKernelsPromptlyAndWithTheSignal) {
  if (IsSkipped()) return;
  SetTransportFromParam(GetParam());
  setenv("MORI_TIMEOUT_S", "60", 1);
  setenv("MORI_STOP_DRAIN_MS", "5000", 1);  // a loaded machine may take a while to let the kernels go
  mori_shmem_uniqueid_t uid;
  ASSERT_EQ(ShmemGetUniqueId(&uid), 0);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t pids[2];
  std::string logs[2];
  for (int rank = 0; rank < 2; ++rank) {
    logs[rank] = "/tmp/mori_stop_test_" + std::to_string(getpid()) + "_" + std::to_string(rank) + ".log";
    pids[rank] = core::test::ForkWhenOtherThreadsSleep();
    ASSERT_GE(pids[rank], 0);
    if (pids[rank] == 0) {
      close(ready[0]);
      FILE* log = std::fopen(logs[rank].c_str(), "w");
      if (log == nullptr || dup2(fileno(log), STDERR_FILENO) < 0) _exit(30);
      _exit(WaitUntilStopped(uid, rank, ready[1]));
    }
  }
  close(ready[1]);
  int readyCount = 0;
  const auto readyBy = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (readyCount < 2 && std::chrono::steady_clock::now() < readyBy) {
    pollfd p{ready[0], POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char c;
    if (read(ready[0], &c, 1) != 1) break;  // both children gone before they were ready
    ++readyCount;
  }
  close(ready[0]);
  EXPECT_EQ(readyCount, 2) << "the PEs did not both reach their kernels";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the waits spin
  const auto t0 = std::chrono::steady_clock::now();
  for (pid_t pid : pids) kill(pid, SIGTERM);
  int status[2] = {0, 0};
  bool ended[2] = {false, false};
  double took[2] = {0, 0};
  while (!(ended[0] && ended[1]) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
    for (int r = 0; r < 2; ++r) {
      if (!ended[r] && waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
        ended[r] = true;
        took[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < 2; ++r) {
    if (!ended[r]) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &status[r], 0);
    }
    const std::string log = ReadFile(logs[r]);
    std::remove(logs[r].c_str());
    EXPECT_TRUE(ended[r]) << "PE " << r << " still ran 30 s after SIGTERM; its log:\n" << log;
    EXPECT_LT(took[r], 10.0) << "PE " << r << " ended only when its waits timed out; its log:\n" << log;
    EXPECT_TRUE(WIFSIGNALED(status[r]) && WTERMSIG(status[r]) == SIGTERM)
        << "PE " << r << " status " << status[r] << " (exited with " << (WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : -1)
        << "); its log:\n" << log;
    EXPECT_NE(log.find("received SIGTERM: device waits stopped, the device was idle after"), std::string::npos)
        << "PE " << r << "'s log:\n" << log;
  }
  unsetenv("MORI_SHMEM_TRANSPORT");
  unsetenv("MORI_SHMEM_PROXY_CONN");
  unsetenv("MORI_TIMEOUT_S");
  unsetenv("MORI_STOP_DRAIN_MS");
}

INSTANTIATE_TEST_SUITE_P(Transports, ShmemStopTest, ::testing::Values("p2p", "rdma", "proxy:tcp", "proxy:rdma"),
                         TransportParamName);

void ApplicationHandler(int) {}

// mori takes SIGTERM and SIGINT only where their action is the default: an application's handler stays, and
// MORI_STOP_ON_SIGNAL=0 takes neither. Checked in forked children (the handlers are installed once per process).
int HandlersAfterInit(bool appHandlesSigint, bool off) {
  if (appHandlesSigint) {
    struct sigaction app{};
    app.sa_handler = ApplicationHandler;
    sigemptyset(&app.sa_mask);
    if (sigaction(SIGINT, &app, nullptr) != 0) return 10;
  }
  if (off) setenv("MORI_STOP_ON_SIGNAL", "0", 1);
  if (ShmemInit() != 0) return 11;
  struct sigaction term{}, intr{};
  sigaction(SIGTERM, nullptr, &term);
  sigaction(SIGINT, nullptr, &intr);
  int rc = 0;
  if (off) {
    if (term.sa_handler != SIG_DFL || intr.sa_handler != SIG_DFL) rc = 12;
  } else {
    if (term.sa_handler == SIG_DFL) rc = 13;  // mori's
    if (appHandlesSigint && intr.sa_handler != ApplicationHandler) rc = 14;
    if (!appHandlesSigint && intr.sa_handler == SIG_DFL) rc = 15;
  }
  if (ShmemFinalize() != 0 && rc == 0) rc = 16;
  return rc;
}

TEST_F(ShmemSingleTest, StopHandlersOnlyWhereTheApplicationHasNone) {
  struct sigaction term{};
  sigaction(SIGTERM, nullptr, &term);
  if (term.sa_handler != SIG_DFL) GTEST_SKIP() << "an earlier test of this process installed them (ctest runs each alone)";
  const struct {
    bool appHandlesSigint, off;
  } cases[] = {{false, false}, {true, false}, {false, true}};
  for (const auto& c : cases) {
    pid_t child = core::test::ForkWhenOtherThreadsSleep();
    ASSERT_GE(child, 0);
    if (child == 0) _exit(HandlersAfterInit(c.appHandlesSigint, c.off));
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "application handles SIGINT: " << c.appHandlesSigint << ", MORI_STOP_ON_SIGNAL=0: " << c.off
        << ": status " << status << " (codes in HandlersAfterInit)";
  }
}

}  // namespace
}  // namespace mori::shmem
