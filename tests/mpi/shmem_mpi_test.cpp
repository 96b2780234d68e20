// The SHMEM runtime and device API under `mpirun -np N` (ctest runs 2 and 4 PEs under each forced
// transport: MORI_SHMEM_TRANSPORT=p2p, rdma and proxy). Kernels run many threads at once; every test fills with
// rank- and index-dependent patterns, checks every byte that should have arrived and that the bytes around
// it were not touched.
#include <gtest/gtest.h>
#include <mpi.h>

#include <dirent.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/logging.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

#if MORI_BACKEND_CUDA
#include <cuda.h>  // modules loaded by handle
#endif

namespace mori::shmem {
namespace {

using core::Dim3;
using core::test::PatternByte;

constexpr uint8_t kGuard = 0xA5;
constexpr unsigned kBlocks = 2;
constexpr unsigned kThreads = 4;  // per block; on GPUs the warp and block variants use 64 threads per block

unsigned ThreadsPerBlock() { return MORI_BACKEND_HOST ? kThreads : 64; }

#define MORI_CHECK_KERNEL()                             \
  do {                                                  \
    ASSERT_EQ(core::GpuGetLastError(), core::kGpuSuccess); \
    ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess); \
  } while (0)

int Me() { return ShmemMyPe(); }
int N() { return ShmemNPes(); }

std::vector<uint8_t> ToHost(const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(core::GpuMemcpy(out.data(), p, bytes), core::kGpuSuccess);
  return out;
}

void FromHost(void* p, const std::vector<uint8_t>& data) {
  ASSERT_EQ(core::GpuMemcpy(p, data.data(), data.size()), core::kGpuSuccess);
}

// Symmetric buffer of `bytes` filled with the guard byte.
uint8_t* GuardedBuffer(size_t bytes) {
  auto* p = static_cast<uint8_t*>(ShmemMalloc(bytes));
  EXPECT_NE(p, nullptr);
  if (p != nullptr) FromHost(p, std::vector<uint8_t>(bytes, kGuard));
  ShmemBarrierAll();
  return p;
}

// Checks [0, bytes) of `got`: [begin, end) holds PatternByte(rank, i - begin, seed), the rest is the guard.
void ExpectRegion(const std::vector<uint8_t>& got, size_t begin, size_t end, int rank, uint32_t seed,
                  const char* what) {
  size_t bad = 0, first = SIZE_MAX;
  for (size_t i = 0; i < got.size(); ++i) {
    uint8_t want = i >= begin && i < end ? PatternByte(rank, i - begin, seed) : kGuard;
    if (got[i] != want) {
      ++bad;
      if (first == SIZE_MAX) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " wrong bytes on PE " << Me() << ", first at " << first
                     << " (data from PE " << rank << " expected in [" << begin << ", " << end << "))";
}

enum class Variant : int { ThreadNbi, ThreadBlocking, WarpNbi, WarpBlocking, BlockNbi, BlockBlocking, TypedNbi };
const Variant kVariants[] = {Variant::ThreadNbi, Variant::ThreadBlocking, Variant::WarpNbi, Variant::WarpBlocking,
                             Variant::BlockNbi,  Variant::BlockBlocking,  Variant::TypedNbi};

// Each unit (thread, warp or block) puts chunk u of src to the same place in dst on `pe`.
MORI_GLOBAL void PutKernel(int variant, uint8_t* dst, const uint8_t* src, size_t chunk, int pe) {
  auto v = static_cast<Variant>(variant);
  unsigned unit;
  if (v == Variant::WarpNbi || v == Variant::WarpBlocking) {
    unit = core::GlobalThreadIdx() / MORI_WARP_SIZE;
  } else if (v == Variant::BlockNbi || v == Variant::BlockBlocking) {
    unit = core::FlatBlockIdx();
  } else {
    unit = core::GlobalThreadIdx();
  }
  uint8_t* d = dst + unit * chunk;
  const uint8_t* s = src + unit * chunk;
  switch (v) {
    case Variant::ThreadNbi: ShmemPutMemNbiThread(d, s, chunk, pe); break;
    case Variant::ThreadBlocking: ShmemPutMemThread(d, s, chunk, pe); break;
    case Variant::WarpNbi: ShmemPutMemNbiWarp(d, s, chunk, pe); break;
    case Variant::WarpBlocking: ShmemPutMemWarp(d, s, chunk, pe); break;
    case Variant::BlockNbi: ShmemPutMemNbiBlock(d, s, chunk, pe); break;
    case Variant::BlockBlocking: ShmemPutMemBlock(d, s, chunk, pe); break;
    case Variant::TypedNbi: ShmemPutTypeNbiThread<uint8_t>(d, s, chunk, pe); break;
  }
  ShmemQuietThread();
}

TEST(ShmemTest, InitQueriesAndTransports) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(Me(), rank);
  EXPECT_EQ(N(), size);
  const char* forced = std::getenv("MORI_SHMEM_TRANSPORT");
  std::string f = forced ? forced : "auto";
  for (int pe = 0; pe < N(); ++pe) {
    TransportType t = ShmemTransportType(pe);
    if (pe == Me()) {
      EXPECT_EQ(t, TransportType::Self);
    } else if (f == "p2p" || f == "auto") {
      EXPECT_EQ(t, TransportType::P2P) << "pe " << pe;
    } else if (f == "rdma") {
      EXPECT_EQ(t, TransportType::RDMA) << "pe " << pe;
    } else if (f == "proxy") {
      EXPECT_EQ(t, TransportType::Proxy) << "pe " << pe;
    }
  }
  auto* p = static_cast<uint8_t*>(ShmemMalloc(4096));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(ShmemPtr(p, Me()), p);
  for (int pe = 0; pe < N(); ++pe) {
    bool mapped = ShmemTransportType(pe) == TransportType::Self || ShmemTransportType(pe) == TransportType::P2P;
    EXPECT_EQ(ShmemPtr(p, pe) != nullptr, mapped) << "pe " << pe;
  }
  EXPECT_EQ(ShmemPtr(reinterpret_cast<uint8_t*>(ShmemHeapBase()) + ShmemHeapBytes() + 100000, 0), nullptr);
  EXPECT_EQ(ShmemPtr(p, N()), nullptr);
  ShmemFree(p);
}

TEST(ShmemTest, AllocationIsSymmetricCoalescesAndFailsWhole) {
  auto offsetOf = [](void* p) {
    return static_cast<long long>(static_cast<uint8_t*>(p) - static_cast<uint8_t*>(ShmemHeapBase()));
  };
  void* a = ShmemMalloc(1000);
  void* b = ShmemMallocAlign(4096, 3000);
  void* c = ShmemCalloc(17, 33);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 4096, 0u);
  long long mine[3] = {offsetOf(a), offsetOf(b), offsetOf(c)};
  std::vector<long long> all(3 * static_cast<size_t>(N()));
  MPI_Allgather(mine, 3, MPI_LONG_LONG, all.data(), 3, MPI_LONG_LONG, MPI_COMM_WORLD);
  for (int pe = 0; pe < N(); ++pe) {
    for (int k = 0; k < 3; ++k) EXPECT_EQ(all[static_cast<size_t>(pe) * 3 + k], mine[k]) << "PE " << pe;
  }
  auto zeros = ToHost(c, 17 * 33);
  for (uint8_t z : zeros) ASSERT_EQ(z, 0);
  ShmemFree(b);
  ShmemFree(a);
  // Three neighbours; free the middle, then the first: one range again, handed out whole.
  void* x = ShmemMalloc(65536);  // too large for the holes left above: taken from the free tail, in order
  void* y = ShmemMalloc(65536);
  void* z = ShmemMalloc(65536);
  ASSERT_TRUE(x && y && z);
  ASSERT_EQ(offsetOf(y), offsetOf(x) + 65536);
  ShmemFree(y);
  ShmemFree(x);
  void* big = ShmemMalloc(2 * 65536);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(offsetOf(big), offsetOf(x));
  ShmemFree(z);
  // Larger than the heap: nullptr everywhere, and the heap still works.
  EXPECT_EQ(ShmemMalloc(ShmemHeapBytes() + 1), nullptr);
  // Sizes that differ between PEs: an error on every PE, nothing allocated anywhere.
  EXPECT_EQ(ShmemMalloc(1024 + static_cast<size_t>(Me())), N() > 1 ? nullptr : ShmemHeapBase());
  void* after = ShmemMalloc(64);
  EXPECT_NE(after, nullptr);
  ShmemFree(after);
  ShmemFree(big);
  ShmemFree(c);
}

TEST(ShmemTest, PutEveryVariantOddSizesUnalignedOffsets) {
  const unsigned tpb = ThreadsPerBlock();
  for (Variant v : kVariants) {
    for (size_t chunk : {size_t(1), size_t(13), size_t(1000), size_t(65536 + 7)}) {
      unsigned units = v == Variant::BlockNbi || v == Variant::BlockBlocking ? kBlocks
                       : v == Variant::WarpNbi || v == Variant::WarpBlocking
                           ? kBlocks * tpb / MORI_WARP_SIZE
                           : kBlocks * tpb;
      const size_t skew = 5;  // unaligned start
      const size_t payload = units * chunk;
      const size_t bytes = payload + 2 * skew + 64;
      uint8_t* dst = GuardedBuffer(bytes);
      uint8_t* src = static_cast<uint8_t*>(ShmemMalloc(bytes));
      ASSERT_TRUE(dst && src);
      std::vector<uint8_t> pattern(bytes, 0);
      for (size_t i = 0; i < payload; ++i) pattern[skew + i] = PatternByte(Me(), i, static_cast<uint32_t>(v));
      FromHost(src, pattern);
      ShmemBarrierAll();
      int right = (Me() + 1) % N();
      core::LaunchKernel(PutKernel, Dim3(kBlocks), Dim3(tpb), 0, nullptr, static_cast<int>(v), dst + skew, src + skew,
                         chunk, right);
      MORI_CHECK_KERNEL();
      ShmemBarrierAll();
      int left = (Me() + N() - 1) % N();
      ExpectRegion(ToHost(dst, bytes), skew, skew + payload, left, static_cast<uint32_t>(v),
                   ("variant " + std::to_string(static_cast<int>(v)) + " chunk " + std::to_string(chunk)).c_str());
      ShmemFree(src);
      ShmemFree(dst);
    }
  }
}

// A warp or block call begins with a barrier of its group, so words its threads stored just before the call,
// without a barrier of their own, are what travels. Round r of unit u (a warp or a block) fills its slice of
// src[r] one word per thread and puts it at once (and, for every other unit, with put-with-signal).
constexpr int kGroupRounds = 4;

MORI_HOST_DEVICE_INLINE uint64_t GroupWord(int sender, int round, size_t index) {
  return (uint64_t(sender + 1) << 56) ^ (uint64_t(round + 1) << 40) ^ (index * 0x9E3779B1ull) ^ 0x0123456789ull;
}

MORI_GLOBAL void GroupJustWroteKernel(int blockScope, uint64_t* dst, uint64_t* src, uint64_t* sig, int pe) {
  const int me = ShmemMyPe();
  const unsigned groupSize = blockScope ? core::FlatBlockDim() : MORI_WARP_SIZE;
  const unsigned rank = blockScope ? core::FlatThreadIdx() : core::LaneId();
  const size_t unit = blockScope ? core::FlatBlockIdx() : core::GlobalThreadIdx() / MORI_WARP_SIZE;
  const size_t units = blockScope ? core::FlatGridDim() : core::GlobalThreadCount() / MORI_WARP_SIZE;
  for (int r = 0; r < kGroupRounds; ++r) {
    const size_t base = (static_cast<size_t>(r) * units + unit) * groupSize;
    // A plain store, no barrier before the call; in reverse, so that the thread that copies a word is not
    // the one that wrote it.
    const size_t mine = base + (groupSize - 1 - rank);
    src[mine] = GroupWord(me, r, mine);
    const size_t bytes = groupSize * sizeof(uint64_t);
    if (unit % 2 == 0) {
      if (blockScope) {
        ShmemPutMemNbiBlock(dst + base, src + base, bytes, pe);
      } else {
        ShmemPutMemNbiWarp(dst + base, src + base, bytes, pe);
      }
    } else if (blockScope) {
      ShmemPutMemNbiSignalBlock(dst + base, src + base, bytes, sig, 1, SignalOp::Add, pe);
    } else {
      ShmemPutMemNbiSignalWarp(dst + base, src + base, bytes, sig, 1, SignalOp::Add, pe);
    }
  }
  ShmemQuietThread();
}

TEST(ShmemTest, GroupCallsSendWhatTheGroupJustWrote) {
  const unsigned tpb = ThreadsPerBlock();
  for (int blockScope : {0, 1}) {
    const size_t words = size_t{kGroupRounds} * kBlocks * tpb;
    const size_t bytes = (words + 8) * sizeof(uint64_t);  // 8 guard words after the payload
    auto* dst = reinterpret_cast<uint64_t*>(GuardedBuffer(bytes));
    auto* src = static_cast<uint64_t*>(ShmemCalloc(words, sizeof(uint64_t)));
    auto* sig = static_cast<uint64_t*>(ShmemCalloc(1, sizeof(uint64_t)));
    ASSERT_TRUE(dst && src && sig);
    ShmemBarrierAll();
    core::LaunchKernel(GroupJustWroteKernel, Dim3(kBlocks), Dim3(tpb), 0, nullptr, blockScope, dst, src, sig,
                       (Me() + 1) % N());
    MORI_CHECK_KERNEL();
    ShmemBarrierAll();
    const int left = (Me() + N() - 1) % N();
    std::vector<uint64_t> got(words + 8);
    ASSERT_EQ(core::GpuMemcpy(got.data(), dst, bytes), core::kGpuSuccess);
    const size_t groupSize = blockScope ? tpb : MORI_WARP_SIZE;
    const size_t units = blockScope ? kBlocks : kBlocks * tpb / MORI_WARP_SIZE;
    size_t bad = 0, first = SIZE_MAX;
    for (size_t i = 0; i < words; ++i) {
      const int round = static_cast<int>(i / (units * groupSize));
      if (got[i] != GroupWord(left, round, i) && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0u) << (blockScope ? "block" : "warp") << " scope: " << bad << " words not what PE " << left
                       << " wrote just before its call; first at word " << first;
    uint64_t guard = 0;
    std::memset(&guard, kGuard, sizeof(guard));
    for (size_t i = words; i < words + 8; ++i) EXPECT_EQ(got[i], guard) << "guard word " << i << " was touched";
    uint64_t signals = 0;
    ASSERT_EQ(core::GpuMemcpy(&signals, sig, sizeof(signals)), core::kGpuSuccess);
    EXPECT_EQ(signals, uint64_t{kGroupRounds} * (units / 2)) << "one signal per put-with-signal of the left PE";
    ShmemBarrierAll();
    ShmemFree(sig);
    ShmemFree(src);
    ShmemFree(dst);
  }
}

// Lanes of one warp put at the same time to different PEs, from the heap or inline, while other lanes of the
// warp put nothing (over RDMA the lanes that share a QP are posted as one batch). Thread t of sender r writes
// slot t of r's row: 3 words (t % 3 == 1, from the heap) or 1 word (t % 3 == 2, a single value).
constexpr unsigned kMixedWords = 4;  // per slot

MORI_HOST_DEVICE_INLINE int MixedTarget(int sender, unsigned t, int n) {
  return (sender + 1 + static_cast<int>(t / 3 % static_cast<unsigned>(n))) % n;
}
MORI_HOST_DEVICE_INLINE uint64_t MixedWord(int sender, unsigned t, unsigned j) {
  return (uint64_t(sender + 1) << 48) ^ (uint64_t(t) << 8) ^ (j + 1) ^ 0x5a5a000000000000ull;
}

MORI_GLOBAL void MixedLanesKernel(uint64_t* rows, const uint64_t* src, unsigned threads) {
  const int me = ShmemMyPe(), n = ShmemNPes();
  const unsigned t = core::GlobalThreadIdx();
  uint64_t* slot = rows + (static_cast<size_t>(me) * threads + t) * kMixedWords;
  const int pe = MixedTarget(me, t, n);
  if (t % 3 == 1) {
    ShmemPutMemNbiThread(slot, src + static_cast<size_t>(t) * 3, 3 * sizeof(uint64_t), pe);
  } else if (t % 3 == 2) {
    ShmemPutTypeImmNbiThread<uint64_t>(slot, MixedWord(me, t, 0), pe);
  }
  ShmemQuietThread();
}

TEST(ShmemTest, ThreadPutsFromMixedLanesOfAWarp) {
  const unsigned tpb = MORI_BACKEND_HOST ? kThreads : 128;
  const unsigned threads = kBlocks * tpb;
  const size_t words = static_cast<size_t>(N()) * threads * kMixedWords;
  auto* rows = reinterpret_cast<uint64_t*>(GuardedBuffer(words * sizeof(uint64_t)));
  auto* src = static_cast<uint64_t*>(ShmemMalloc(threads * 3 * sizeof(uint64_t)));
  ASSERT_TRUE(rows && src);
  std::vector<uint64_t> values(threads * 3);
  for (unsigned t = 0; t < threads; ++t) {
    for (unsigned j = 0; j < 3; ++j) values[t * 3 + j] = MixedWord(Me(), t, j);
  }
  ASSERT_EQ(core::GpuMemcpy(src, values.data(), values.size() * sizeof(uint64_t)), core::kGpuSuccess);
  ShmemBarrierAll();
  core::LaunchKernel(MixedLanesKernel, Dim3(kBlocks), Dim3(tpb), 0, nullptr, rows, static_cast<const uint64_t*>(src),
                     threads);
  MORI_CHECK_KERNEL();
  ShmemBarrierAll();
  std::vector<uint64_t> got(words);
  ASSERT_EQ(core::GpuMemcpy(got.data(), rows, words * sizeof(uint64_t)), core::kGpuSuccess);
  uint64_t guard;
  std::memset(&guard, kGuard, sizeof(guard));
  size_t bad = 0;
  for (int r = 0; r < N(); ++r) {
    for (unsigned t = 0; t < threads; ++t) {
      unsigned filled = MixedTarget(r, t, N()) != Me() ? 0 : t % 3 == 1 ? 3 : t % 3 == 2 ? 1 : 0;
      for (unsigned j = 0; j < kMixedWords; ++j) {
        uint64_t want = j < filled ? MixedWord(r, t, j) : guard;
        uint64_t have = got[(static_cast<size_t>(r) * threads + t) * kMixedWords + j];
        if (have != want && bad++ < 5) {
          ADD_FAILURE() << "PE " << Me() << ": sender " << r << " thread " << t << " word " << j << ": 0x" << std::hex
                        << have << ", expected 0x" << want;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0u);
  ShmemBarrierAll();
  ShmemFree(src);
  ShmemFree(rows);
}

// Every thread gets its slice of the peer's buffer (nbi + quiet, or blocking), into the local heap.
MORI_GLOBAL void GetKernel(int blocking, int group, uint8_t* dst, const uint8_t* src, size_t chunk, int pe) {
  if (group == 2) {
    uint8_t* d = dst + core::FlatBlockIdx() * chunk;
    const uint8_t* s = src + core::FlatBlockIdx() * chunk;
    blocking ? ShmemGetMemBlock(d, s, chunk, pe) : ShmemGetMemNbiBlock(d, s, chunk, pe);
  } else if (group == 1) {
    unsigned w = core::GlobalThreadIdx() / MORI_WARP_SIZE;
    blocking ? ShmemGetMemWarp(dst + w * chunk, src + w * chunk, chunk, pe)
             : ShmemGetMemNbiWarp(dst + w * chunk, src + w * chunk, chunk, pe);
  } else {
    unsigned t = core::GlobalThreadIdx();
    blocking ? ShmemGetMemThread(dst + t * chunk, src + t * chunk, chunk, pe)
             : ShmemGetMemNbiThread(dst + t * chunk, src + t * chunk, chunk, pe);
  }
  if (!blocking) ShmemQuietThread();
}

TEST(ShmemTest, GetBlockingAndNbiEveryGroup) {
  const unsigned tpb = ThreadsPerBlock();
  for (int group = 0; group < 3; ++group) {
    for (int blocking = 0; blocking < 2; ++blocking) {
      const size_t chunk = 777;
      unsigned units = group == 2 ? kBlocks : group == 1 ? kBlocks * tpb / MORI_WARP_SIZE : kBlocks * tpb;
      const size_t payload = units * chunk, skew = 3, bytes = payload + 64;
      uint8_t* src = static_cast<uint8_t*>(ShmemMalloc(bytes));
      uint8_t* dst = GuardedBuffer(bytes);
      std::vector<uint8_t> pattern(bytes, 0);
      for (size_t i = 0; i < payload; ++i) pattern[skew + i] = PatternByte(Me(), i, 40 + group);
      FromHost(src, pattern);
      ShmemBarrierAll();
      int right = (Me() + 1) % N();
      core::LaunchKernel(GetKernel, Dim3(kBlocks), Dim3(tpb), 0, nullptr, blocking, group, dst + skew, src + skew,
                         chunk, right);
      MORI_CHECK_KERNEL();
      ExpectRegion(ToHost(dst, bytes), skew, skew + payload, right, 40 + group, "get");
      ShmemBarrierAll();
      ShmemFree(dst);
      ShmemFree(src);
    }
  }
}

// Ring of put-with-signal: in round r every PE sends its block to the right and waits for round r from the
// left, then checks the data that the signal announced (so a signal that overtook its data shows).
MORI_GLOBAL void SignalRingKernel(int group, uint8_t* buf, uint8_t* src, size_t bytes, uint64_t* sig, int rounds,
                                  int op, uint32_t* mismatches) {
  int me = ShmemMyPe(), n = ShmemNPes();
  int right = (me + 1) % n, left = (me + n - 1) % n;
  for (int r = 1; r <= rounds; ++r) {
    // Source for this round: pattern of (me, round).
    if (group == 0 || core::FlatThreadIdx() == 0) {
      for (size_t i = 0; i < bytes; ++i) src[(r & 1) * bytes + i] = PatternByte(me, i, static_cast<uint32_t>(r));
    }
    if (group == 2) core::SyncThreads();
    uint8_t* slot = buf + (r & 1) * bytes;
    uint64_t val = op == 0 ? static_cast<uint64_t>(r) : 1;
    SignalOp sop = op == 0 ? SignalOp::Set : SignalOp::Add;
    if (group == 2) {
      ShmemPutMemNbiSignalBlock(slot, src + (r & 1) * bytes, bytes, sig, val, sop, right);
    } else {
      ShmemPutMemNbiSignalThread(slot, src + (r & 1) * bytes, bytes, sig, val, sop, right);
    }
    if (group == 0 || core::FlatThreadIdx() == 0) {
      ShmemSignalWaitUntil(sig, CmpOp::GE, static_cast<uint64_t>(r));
      const volatile uint8_t* seen = slot;  // the NIC may have written it behind this thread's caches
      for (size_t i = 0; i < bytes; ++i) {
        if (seen[i] != PatternByte(left, i, static_cast<uint32_t>(r))) core::AtomicFetchAdd(mismatches, 1u);
      }
      ShmemQuietThread();
    }
    if (group == 2) core::SyncThreads();
    // Nobody reuses a slot before the receiver has read it: the two-slot ring plus a barrier every round.
    if (group == 2) {
      ShmemBarrierAllBlock();
    } else {
      ShmemBarrierAllThread();
    }
  }
}

TEST(ShmemTest, PutWithSignalNeverOvertakesData) {
  for (int group : {0, 2}) {
    for (int op : {0, 1}) {
      for (size_t bytes : {size_t(8), size_t(4099), size_t(65536)}) {
        uint8_t* buf = static_cast<uint8_t*>(ShmemMalloc(2 * bytes));
        uint8_t* src = static_cast<uint8_t*>(ShmemMalloc(2 * bytes));
        auto* sig = static_cast<uint64_t*>(ShmemCalloc(1, sizeof(uint64_t)));
        auto* mismatches = static_cast<uint32_t*>(ShmemCalloc(1, sizeof(uint32_t)));
        ASSERT_TRUE(buf && src && sig && mismatches);
        core::LaunchKernel(SignalRingKernel, Dim3(1), Dim3(group == 2 ? ThreadsPerBlock() : 1), 0, nullptr, group, buf,
                           src, bytes, sig, 6, op, mismatches);
        MORI_CHECK_KERNEL();
        uint32_t bad = 0;
        ASSERT_EQ(core::GpuMemcpy(&bad, mismatches, sizeof(bad)), core::kGpuSuccess);
        EXPECT_EQ(bad, 0u) << "group " << group << " op " << op << " bytes " << bytes;
        uint64_t finalSig = 0;
        ASSERT_EQ(core::GpuMemcpy(&finalSig, sig, sizeof(finalSig)), core::kGpuSuccess);
        EXPECT_EQ(finalSig, 6u);
        ShmemBarrierAll();
        ShmemFree(mismatches);
        ShmemFree(sig);
        ShmemFree(src);
        ShmemFree(buf);
      }
    }
  }
}

// Every comparison of the waits: PE p sets its right neighbour's word to a known value, the neighbour waits
// with each operator, and a single-value put and get round out the family.
MORI_GLOBAL void WaitAndValueKernel(uint64_t* sig, int32_t* ivar, uint64_t* putTarget, uint64_t* results) {
  int me = ShmemMyPe(), n = ShmemNPes();
  int right = (me + 1) % n, left = (me + n - 1) % n;
  ShmemSignalOpThread(sig, 100 + static_cast<uint64_t>(me), SignalOp::Set, right);
  ShmemPutTypeImmNbiThread<int32_t>(ivar, -50 - me, right);
  ShmemPutTypeImmNbiThread<uint64_t>(putTarget, 0x1234000000000000ull + static_cast<uint64_t>(me), right);
  ShmemQuietThread();
  uint64_t want = 100 + static_cast<uint64_t>(left);
  results[0] = ShmemSignalWaitUntil(sig, CmpOp::EQ, want);
  results[1] = ShmemSignalWaitUntil(sig, CmpOp::GE, want);
  results[2] = ShmemSignalWaitUntil(sig, CmpOp::GT, want - 1);
  results[3] = ShmemSignalWaitUntil(sig, CmpOp::LE, want);
  results[4] = ShmemSignalWaitUntil(sig, CmpOp::LT, want + 1);
  results[5] = ShmemSignalWaitUntil(sig, CmpOp::NE, 0);
  results[6] = static_cast<uint64_t>(static_cast<int64_t>(ShmemWaitUntil<int32_t>(ivar, CmpOp::LT, -49)));
  results[7] = ShmemWaitUntil<uint64_t>(putTarget, CmpOp::NE, 0);
  ShmemBarrierAllThread();
  // g: read the right neighbour's words.
  results[8] = ShmemGetTypeImmThread<uint64_t>(sig, right);
  results[9] = static_cast<uint64_t>(static_cast<int64_t>(ShmemGetTypeImmThread<int32_t>(ivar, right)));
}

TEST(ShmemTest, SignalOpWaitsAndSingleValues) {
  auto* sig = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  auto* ivar = static_cast<int32_t*>(ShmemCalloc(2, 4));
  auto* put = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  auto* results = static_cast<uint64_t*>(ShmemCalloc(10, 8));
  ASSERT_TRUE(sig && ivar && put && results);
  core::LaunchKernel(WaitAndValueKernel, Dim3(1), Dim3(1), 0, nullptr, sig, ivar, put, results);
  MORI_CHECK_KERNEL();
  std::vector<uint64_t> r(10);
  ASSERT_EQ(core::GpuMemcpy(r.data(), results, 80), core::kGpuSuccess);
  int left = (Me() + N() - 1) % N();
  for (int k = 0; k < 6; ++k) EXPECT_EQ(r[k], 100u + static_cast<uint64_t>(left)) << "wait " << k;
  EXPECT_EQ(static_cast<int64_t>(r[6]), -50 - left);
  EXPECT_EQ(r[7], 0x1234000000000000ull + static_cast<uint64_t>(left));
  EXPECT_EQ(r[8], 100u + static_cast<uint64_t>(Me()));  // what I wrote into my right neighbour
  EXPECT_EQ(static_cast<int64_t>(r[9]), -50 - Me());
  ShmemBarrierAll();
  ShmemFree(results);
  ShmemFree(put);
  ShmemFree(ivar);
  ShmemFree(sig);
}

// Every thread of every PE hammers the counters on every PE with each atomic. A 32-bit counter shares its
// 8-byte word with a neighbour that must stay as it was.
template <typename T>
MORI_GLOBAL void AtomicKernel(T* counters, T* tickets, int iters, uint32_t* errors) {
  int n = ShmemNPes();
  for (int i = 0; i < iters; ++i) {
    for (int pe = 0; pe < n; ++pe) {
      // counters[0]: fetch-add 3; [2]: add 5; [4]: compare-swap increments; [6]: fetch-inc.
      ShmemAtomicTypeFetchAddThread<T>(&counters[0], T(3), pe);
      ShmemAtomicTypeAddThread<T>(&counters[2], T(5), pe);
      T seen = ShmemAtomicTypeFetchThread<T>(&counters[4], pe);
      for (;;) {
        T old = ShmemAtomicTypeCompareSwapThread<T>(&counters[4], seen, T(seen + 1), pe);
        if (old == seen) break;
        seen = old;
      }
      T ticket = ShmemAtomicTypeFetchIncThread<T>(&counters[6], pe);
      // Every ticket (they start at 60) is handed out once: mark it.
      T was = ShmemAtomicTypeSwapThread<T>(&tickets[static_cast<size_t>(ticket) - 60], T(1), pe);
      if (was != T(0)) core::AtomicFetchAdd(errors, 1u);
    }
  }
  ShmemQuietThread();
}

// Threads per block and iterations of the atomics tests; MORI_TEST_ATOMICS="threads,iters" overrides them (to
// measure how the time scales with contention).
// On a GPU whose atomics go through a NIC or the proxy (any PE reached over RDMA or Proxy), every atomic is a
// round trip through the emulated NIC or a proxy connection, which executes an atomic on GPU memory with
// synchronous copies (tens of microseconds), and the compare-swap increments retry once per competing thread:
// the work grows with the square of the threads. Measured on an H100 (2 PEs under MPS, rdma, 5 iterations):
// 4 / 8 / 16 / 32 threads per block took 2 / 3 / 4 / 8 s (uint64) and 3 / 5 / 7 / 14 s (int32); 32 threads and
// 50 iterations did not finish in 150 s; through the proxy over the emulated NIC (one request at a time),
// 8 threads and 10 iterations of the four tests took 263 s. There the test keeps every kind of contention
// (lanes of a warp, two blocks, every PE on one word) at 4 threads per block and 5 iterations.
bool AtomicsThroughNicOrProxy() {
  for (int pe = 0; pe < N(); ++pe) {
    TransportType t = ShmemTransportType(pe);
    if (t == TransportType::RDMA || t == TransportType::Proxy) return true;
  }
  return false;
}

std::pair<unsigned, int> AtomicsShape() {
  unsigned tpb = MORI_BACKEND_HOST ? 3 : AtomicsThroughNicOrProxy() ? 4 : 32;
  int iters = MORI_BACKEND_HOST ? 20 : AtomicsThroughNicOrProxy() ? 5 : 50;
  if (const char* v = std::getenv("MORI_TEST_ATOMICS")) {
    unsigned t = 0;
    int i = 0;
    if (std::sscanf(v, "%u,%d", &t, &i) == 2 && t > 0 && i > 0) {
      tpb = t;
      iters = i;
    }
  }
  return {tpb, iters};
}

template <typename T>
void RunAtomics() {
  const auto [tpb, iters] = AtomicsShape();
  const size_t total = static_cast<size_t>(N()) * kBlocks * tpb * static_cast<size_t>(iters);
  T* counters = static_cast<T*>(ShmemMalloc(8 * sizeof(T)));
  T* tickets = static_cast<T*>(ShmemCalloc(total, sizeof(T)));
  auto* errors = static_cast<uint32_t*>(ShmemCalloc(1, 4));
  ASSERT_TRUE(counters && tickets && errors);
  std::vector<T> init(8);
  for (int k = 0; k < 8; ++k) init[k] = (k & 1) ? T(0x5A5A5A5A) : T(10 * k);  // odd slots: untouched neighbours
  ASSERT_EQ(core::GpuMemcpy(counters, init.data(), 8 * sizeof(T)), core::kGpuSuccess);
  ShmemBarrierAll();
  core::LaunchKernel(AtomicKernel<T>, Dim3(kBlocks), Dim3(tpb), 0, nullptr, counters, tickets, iters, errors);
  MORI_CHECK_KERNEL();
  ShmemBarrierAll();
  std::vector<T> got(8);
  ASSERT_EQ(core::GpuMemcpy(got.data(), counters, 8 * sizeof(T)), core::kGpuSuccess);
  EXPECT_EQ(got[0], T(0 + 3 * total));
  EXPECT_EQ(got[2], T(20 + 5 * total));
  EXPECT_EQ(got[4], T(40 + total));
  EXPECT_EQ(got[6], T(60 + total));
  for (int k = 1; k < 8; k += 2) EXPECT_EQ(got[k], T(0x5A5A5A5A)) << "neighbour word " << k << " was touched";
  uint32_t errs = 0;
  ASSERT_EQ(core::GpuMemcpy(&errs, errors, 4), core::kGpuSuccess);
  EXPECT_EQ(errs, 0u) << "tickets handed out twice";
  // Tickets 60 .. 60 + total - 1 were handed out here, each marked once.
  std::vector<T> marks(total);
  ASSERT_EQ(core::GpuMemcpy(marks.data(), tickets, total * sizeof(T)), core::kGpuSuccess);
  size_t marked = 0;
  for (T m : marks) marked += m == T(1);
  EXPECT_EQ(marked, total);
  ShmemBarrierAll();
  ShmemFree(errors);
  ShmemFree(tickets);
  ShmemFree(counters);
}

TEST(ShmemTest, AtomicsInt32) { RunAtomics<int32_t>(); }
TEST(ShmemTest, AtomicsUint32) { RunAtomics<uint32_t>(); }
TEST(ShmemTest, AtomicsInt64) { RunAtomics<int64_t>(); }
TEST(ShmemTest, AtomicsUint64) { RunAtomics<uint64_t>(); }

// Set and swap leave the last writer's value; the PEs take turns so the final value is known.
MORI_GLOBAL void SetSwapKernel(uint64_t* word, int32_t* word32, uint64_t* out) {
  int me = ShmemMyPe(), n = ShmemNPes();
  for (int turn = 0; turn < n; ++turn) {
    if (turn == me) {
      for (int pe = 0; pe < n; ++pe) {
        ShmemAtomicTypeSetThread<uint64_t>(word, 0xABC00000ull + static_cast<uint64_t>(me), pe);
        out[pe] = ShmemAtomicTypeSwapThread<int32_t>(word32, -7 - me, pe);
      }
      ShmemQuietThread();
    }
    ShmemBarrierAllThread();
  }
}

TEST(ShmemTest, AtomicSetAndSwap) {
  auto* word = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  auto* word32 = static_cast<int32_t*>(ShmemCalloc(2, 4));
  auto* out = static_cast<uint64_t*>(ShmemCalloc(static_cast<size_t>(N()), 8));
  ASSERT_TRUE(word && word32 && out);
  core::LaunchKernel(SetSwapKernel, Dim3(1), Dim3(1), 0, nullptr, word, word32, out);
  MORI_CHECK_KERNEL();
  uint64_t w = 0;
  int32_t w32[2] = {0, 0};
  ASSERT_EQ(core::GpuMemcpy(&w, word, 8), core::kGpuSuccess);
  ASSERT_EQ(core::GpuMemcpy(w32, word32, 8), core::kGpuSuccess);
  EXPECT_EQ(w, 0xABC00000ull + static_cast<uint64_t>(N() - 1));
  EXPECT_EQ(w32[0], -7 - (N() - 1));
  EXPECT_EQ(w32[1], 0) << "the word beside the 32-bit target was touched";
  std::vector<uint64_t> o(static_cast<size_t>(N()));
  ASSERT_EQ(core::GpuMemcpy(o.data(), out, o.size() * 8), core::kGpuSuccess);
  for (int pe = 0; pe < N(); ++pe) {
    int32_t want = Me() == 0 ? 0 : -7 - (Me() - 1);  // the previous turn's value
    EXPECT_EQ(static_cast<int32_t>(o[static_cast<size_t>(pe)]), want) << "swap at pe " << pe;
  }
  ShmemBarrierAll();
  ShmemFree(out);
  ShmemFree(word32);
  ShmemFree(word);
}

// Fence: data put, fence, flag put; the receiver that sees the flag must see the data. Quiet(pe) too.
MORI_GLOBAL void FenceKernel(uint8_t* data, const uint8_t* src, size_t bytes, uint64_t* flag, int rounds,
                             uint32_t* bad) {
  int me = ShmemMyPe(), n = ShmemNPes();
  int right = (me + 1) % n, left = (me + n - 1) % n;
  for (int r = 1; r <= rounds; ++r) {
    ShmemPutMemNbiThread(data, src + static_cast<size_t>(r) * bytes, bytes, right);
    ShmemFenceThread();
    ShmemPutTypeImmNbiThread<uint64_t>(flag, static_cast<uint64_t>(r), right);
    ShmemQuietThread(right);
    ShmemWaitUntil<uint64_t>(flag, CmpOp::GE, static_cast<uint64_t>(r));
    const volatile uint8_t* seen = data;
    for (size_t i = 0; i < bytes; ++i) {
      if (seen[i] != PatternByte(left, i, static_cast<uint32_t>(r))) {
        core::AtomicFetchAdd(bad, 1u);
        break;
      }
    }
    ShmemBarrierAllThread();
  }
}

TEST(ShmemTest, FenceOrdersPutsToOnePe) {
  const size_t bytes = 3001;
  const int rounds = 5;
  auto* data = static_cast<uint8_t*>(ShmemMalloc(bytes));
  auto* src = static_cast<uint8_t*>(ShmemMalloc(bytes * (rounds + 1)));
  auto* flag = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  auto* bad = static_cast<uint32_t*>(ShmemCalloc(1, 4));
  ASSERT_TRUE(data && src && flag && bad);
  std::vector<uint8_t> pattern(bytes * (rounds + 1));
  for (int r = 1; r <= rounds; ++r) {
    for (size_t i = 0; i < bytes; ++i) pattern[static_cast<size_t>(r) * bytes + i] = PatternByte(Me(), i, r);
  }
  FromHost(src, pattern);
  ShmemBarrierAll();
  core::LaunchKernel(FenceKernel, Dim3(1), Dim3(1), 0, nullptr, data, src, bytes, flag, rounds, bad);
  MORI_CHECK_KERNEL();
  uint32_t b = 0;
  ASSERT_EQ(core::GpuMemcpy(&b, bad, 4), core::kGpuSuccess);
  EXPECT_EQ(b, 0u);
  ShmemBarrierAll();
  ShmemFree(bad);
  ShmemFree(flag);
  ShmemFree(src);
  ShmemFree(data);
}

// A registered buffer outside the heap as put source and get destination.
MORI_GLOBAL void RegisteredKernel(uint8_t* heapDst, uint8_t* outside, size_t bytes, int pe) {
  ShmemPutMemNbiThread(heapDst, outside, bytes, pe);
  ShmemQuietThread();
  ShmemBarrierAllThread();
  ShmemGetMemThread(outside + bytes, heapDst, bytes, pe);
}

TEST(ShmemTest, RegisteredBufferOutsideTheHeap) {
  const size_t bytes = 50000;
  auto* heapDst = GuardedBuffer(bytes);
  core::GpuBuffer outside(2 * bytes);
  std::vector<uint8_t> pattern(2 * bytes, kGuard);
  for (size_t i = 0; i < bytes; ++i) pattern[i] = PatternByte(Me(), i, 77);
  FromHost(outside.Data(), pattern);
  ASSERT_EQ(ShmemBufferRegister(outside.Data(), 2 * bytes), 0);
  int right = (Me() + 1) % N(), left = (Me() + N() - 1) % N();
  core::LaunchKernel(RegisteredKernel, Dim3(1), Dim3(1), 0, nullptr, heapDst, outside.DataAs<uint8_t>(), bytes, right);
  MORI_CHECK_KERNEL();
  ShmemBarrierAll();
  ExpectRegion(ToHost(heapDst, bytes), 0, bytes, left, 77, "put from a registered buffer");
  auto back = ToHost(outside.DataAs<uint8_t>() + bytes, bytes);
  // What I got back from my right neighbour's heap is what I had put there.
  ExpectRegion(back, 0, bytes, Me(), 77, "get into a registered buffer");
  EXPECT_EQ(ShmemBufferUnregister(outside.Data()), 0);
  EXPECT_NE(ShmemBufferUnregister(outside.Data()), 0);
  ShmemFree(heapDst);
}

MORI_GLOBAL void BarrierKernel(uint64_t* slots, int rounds) {
  int me = ShmemMyPe(), n = ShmemNPes();
  for (int r = 1; r <= rounds; ++r) {
    // Everybody writes round r into its slot on every PE, barrier, then all n slots must show round r.
    if (core::FlatThreadIdx() == 0) {
      for (int pe = 0; pe < n; ++pe) ShmemPutTypeImmNbiThread<uint64_t>(&slots[me], static_cast<uint64_t>(r), pe);
    }
    ShmemBarrierAllBlock();
    if (core::FlatThreadIdx() == 0) {
      for (int pe = 0; pe < n; ++pe) {
        uint64_t v = core::AtomicLoad(&slots[pe]);
        MORI_DEVICE_ASSERT(v == static_cast<uint64_t>(r), "barrier round %d: slot of pe %d shows %llu", r, pe,
                           static_cast<unsigned long long>(v));
      }
    }
    ShmemBarrierAllBlock();
  }
}

TEST(ShmemTest, DeviceBarrierSeparatesRounds) {
  auto* slots = static_cast<uint64_t*>(ShmemCalloc(static_cast<size_t>(N()), 8));
  ASSERT_NE(slots, nullptr);
  core::LaunchKernel(BarrierKernel, Dim3(1), Dim3(ThreadsPerBlock()), 0, nullptr, slots, 20);
  MORI_CHECK_KERNEL();
  ShmemBarrierAll();
  ShmemFree(slots);
}

// ---- teams ----

// The team queries of world, node, `team` and two invalid handles, and translations to and from `team`: run
// by a kernel and by the host, which must agree.
MORI_HOST_DEVICE_INLINE void TeamQueries(ShmemTeam team, int32_t* out) {
  out[0] = ShmemTeamMyPe(kShmemTeamWorld);
  out[1] = ShmemTeamNPes(kShmemTeamWorld);
  out[2] = ShmemTeamMyPe(kShmemTeamNode);
  out[3] = ShmemTeamNPes(kShmemTeamNode);
  out[4] = ShmemTeamMyPe(team);
  out[5] = ShmemTeamNPes(team);
  out[6] = ShmemTeamMyPe(kShmemTeamInvalid);
  out[7] = ShmemTeamNPes(static_cast<ShmemTeam>(kShmemMaxTeams + 3));
  for (int pe = 0; pe < 8; ++pe) {
    out[8 + pe] = ShmemTeamTranslatePe(kShmemTeamWorld, pe, team);
    out[16 + pe] = ShmemTeamTranslatePe(team, pe, kShmemTeamWorld);
  }
}

MORI_GLOBAL void TeamQueryKernel(ShmemTeam team, int32_t* out) { TeamQueries(team, out); }

std::vector<int32_t> HostTeamQueries(ShmemTeam team) {
  std::vector<int32_t> out(24);
  TeamQueries(team, out.data());
  return out;
}

std::vector<int32_t> DeviceTeamQueries(ShmemTeam team) {
  core::GpuBuffer out(24 * sizeof(int32_t), core::MemoryType::Device);
  core::LaunchKernel(TeamQueryKernel, Dim3(1), Dim3(1), 0, nullptr, team, out.DataAs<int32_t>());
  EXPECT_EQ(core::GpuGetLastError(), core::kGpuSuccess);
  EXPECT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  auto bytes = ToHost(out.Data(), 24 * sizeof(int32_t));
  std::vector<int32_t> v(24);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

// Splits the world into the even and the odd PEs; every PE gets the handle of its own half.
ShmemTeam SplitHalves(ShmemTeam* evens, ShmemTeam* odds) {
  const int n = N();
  EXPECT_EQ(ShmemTeamSplitStrided(kShmemTeamWorld, 0, 2, (n + 1) / 2, evens), 0);
  EXPECT_EQ(ShmemTeamSplitStrided(kShmemTeamWorld, 1, 2, n / 2, odds), 0);
  return Me() % 2 == 0 ? *evens : *odds;
}

TEST(ShmemTest, TeamsWorldNodeAndStridedSplitsOnHostAndDevice) {
  const int n = N(), me = Me();
  // Every PE of these jobs is on one host: the node team is the world.
  EXPECT_EQ(ShmemTeamMyPe(kShmemTeamWorld), me);
  EXPECT_EQ(ShmemTeamNPes(kShmemTeamWorld), n);
  EXPECT_EQ(ShmemTeamMyPe(kShmemTeamNode), me);
  EXPECT_EQ(ShmemTeamNPes(kShmemTeamNode), n);
  ShmemTeam evens = kShmemTeamInvalid, odds = kShmemTeamInvalid;
  ShmemTeam mine = SplitHalves(&evens, &odds);
  EXPECT_EQ(me % 2 == 0 ? odds : evens, kShmemTeamInvalid) << "a PE outside a new team gets the invalid handle";
  ASSERT_NE(mine, kShmemTeamInvalid);
  EXPECT_EQ(ShmemTeamMyPe(mine), me / 2);
  EXPECT_EQ(ShmemTeamNPes(mine), me % 2 == 0 ? (n + 1) / 2 : n / 2);
  for (int pe = 0; pe < 8; ++pe) {
    const bool sameHalf = pe < n && pe % 2 == me % 2;
    EXPECT_EQ(ShmemTeamTranslatePe(kShmemTeamWorld, pe, mine), sameHalf ? pe / 2 : -1) << "world pe " << pe;
    EXPECT_EQ(ShmemTeamTranslatePe(mine, pe, kShmemTeamWorld), pe < ShmemTeamNPes(mine) ? 2 * pe + me % 2 : -1);
  }
  EXPECT_EQ(HostTeamQueries(mine), DeviceTeamQueries(mine)) << "kernels and the host see the same teams";

  // A split of a split: the last member of my half alone, numbered from its world number.
  ShmemTeam last = kShmemTeamInvalid;
  const int halfSize = ShmemTeamNPes(mine);
  ASSERT_EQ(ShmemTeamSplitStrided(mine, halfSize - 1, 1, 1, &last), 0);
  const bool amLast = ShmemTeamMyPe(mine) == halfSize - 1;
  EXPECT_EQ(last != kShmemTeamInvalid, amLast);
  if (amLast) {
    EXPECT_EQ(ShmemTeamNPes(last), 1);
    EXPECT_EQ(ShmemTeamTranslatePe(last, 0, kShmemTeamWorld), me);
    EXPECT_EQ(ShmemTeamTranslatePe(last, 0, mine), halfSize - 1);
    EXPECT_EQ(HostTeamQueries(last), DeviceTeamQueries(last));
    ShmemTeamDestroy(last);
    EXPECT_EQ(ShmemTeamNPes(last), -1);
    EXPECT_EQ(DeviceTeamQueries(last)[5], -1) << "kernels see the destroyed team gone";
  }
  ShmemTeamDestroy(mine);
  EXPECT_EQ(ShmemTeamMyPe(mine), -1);
  ShmemTeamDestroy(mine);  // twice: an error logged, nothing else
  ShmemTeamDestroy(kShmemTeamWorld);
  EXPECT_EQ(ShmemTeamNPes(kShmemTeamWorld), n) << "the world team cannot be destroyed";
  ShmemBarrierAll();
}

TEST(ShmemTest, TeamSplitBadInputFailsOnEveryMember) {
  const int n = N(), me = Me();
  ShmemTeam t = kShmemTeamWorld;
  EXPECT_NE(ShmemTeamSplitStrided(kShmemTeamWorld, 0, 0, 2, &t), 0) << "stride 0";
  EXPECT_EQ(t, kShmemTeamInvalid);
  EXPECT_NE(ShmemTeamSplitStrided(kShmemTeamWorld, 1, 1, n, &t), 0) << "past the parent's last PE";
  EXPECT_NE(ShmemTeamSplitStrided(kShmemTeamWorld, -1, 1, 1, &t), 0) << "negative start";
  // Arguments that differ between PEs: refused on every PE (none waits for the others).
  EXPECT_NE(ShmemTeamSplitStrided(kShmemTeamWorld, 0, 1, me == 0 ? 1 : n, &t), 0);
  EXPECT_EQ(t, kShmemTeamInvalid);
  EXPECT_NE(ShmemTeamSplitStrided(static_cast<ShmemTeam>(7), 0, 1, 1, &t), 0) << "a parent that does not exist";
  EXPECT_NE(ShmemTeamSplitStrided(kShmemTeamWorld, 0, 1, 1, nullptr), 0);
  // Every slot in use: the splits past the last slot fail on every PE, and destroying gives them back.
  std::vector<ShmemTeam> made;
  int refused = 0;
  for (uint32_t i = 0; i < kShmemMaxTeams + 2; ++i) {
    ShmemTeam x = kShmemTeamInvalid;
    if (ShmemTeamSplitStrided(kShmemTeamWorld, 0, 1, n, &x) == 0) {
      made.push_back(x);
    } else {
      ++refused;
      EXPECT_EQ(x, kShmemTeamInvalid);
    }
  }
  EXPECT_EQ(made.size(), kShmemMaxTeams - 2) << "world and node hold two slots";
  EXPECT_EQ(refused, 4);
  for (ShmemTeam x : made) ShmemTeamDestroy(x);
  ShmemTeam again = kShmemTeamInvalid;
  EXPECT_EQ(ShmemTeamSplitStrided(kShmemTeamWorld, 0, 1, n, &again), 0);
  EXPECT_EQ(ShmemTeamNPes(again), n);
  EXPECT_EQ(ShmemTeamSync(again), 0);
  ShmemTeamDestroy(again);
  // Syncing a team this PE is not in.
  EXPECT_NE(ShmemTeamSync(static_cast<ShmemTeam>(9)), 0);
  EXPECT_NE(ShmemTeamSyncOnStream(static_cast<ShmemTeam>(9), nullptr), 0);
  ShmemBarrierAll();
}

// Rounds of: every member writes round r into its slot on every member of `team`, team sync, then every
// member's slot must show round r. The two halves of the world do this at the same time on their own teams.
MORI_GLOBAL void TeamSyncKernel(ShmemTeam team, uint64_t* slots, int rounds) {
  const int me = ShmemTeamMyPe(team), n = ShmemTeamNPes(team);
  for (int r = 1; r <= rounds; ++r) {
    if (core::FlatThreadIdx() == 0) {
      for (int i = 0; i < n; ++i) {
        ShmemPutTypeImmNbiThread<uint64_t>(&slots[me], static_cast<uint64_t>(r),
                                           ShmemTeamTranslatePe(team, i, kShmemTeamWorld));
      }
    }
    ShmemTeamSyncBlock(team);
    if (core::FlatThreadIdx() == 0) {
      for (int i = 0; i < n; ++i) {
        uint64_t v = core::AtomicLoad(&slots[i]);
        MORI_DEVICE_ASSERT(v == static_cast<uint64_t>(r), "team sync round %d: slot of member %d shows %llu", r, i,
                           static_cast<unsigned long long>(v));
      }
    }
    ShmemTeamSyncBlock(team);
  }
}

TEST(ShmemTest, TeamSyncOnDeviceHostAndStreamSeparatesRounds) {
  const int n = N(), me = Me();
  ShmemTeam evens = kShmemTeamInvalid, odds = kShmemTeamInvalid;
  ShmemTeam mine = SplitHalves(&evens, &odds);
  ASSERT_NE(mine, kShmemTeamInvalid);
  auto* slots = static_cast<uint64_t*>(ShmemCalloc(static_cast<size_t>(n), 8));
  ASSERT_NE(slots, nullptr);
  core::LaunchKernel(TeamSyncKernel, Dim3(1), Dim3(ThreadsPerBlock()), 0, nullptr, mine, slots, 20);
  MORI_CHECK_KERNEL();
  // The world team on the device too (its own counters, apart from the barrier's), in slots of its own: the
  // other half may still be in its rounds.
  auto* worldSlots = static_cast<uint64_t*>(ShmemCalloc(static_cast<size_t>(n), 8));
  ASSERT_NE(worldSlots, nullptr);
  core::LaunchKernel(TeamSyncKernel, Dim3(1), Dim3(ThreadsPerBlock()), 0, nullptr, kShmemTeamWorld, worldSlots, 5);
  MORI_CHECK_KERNEL();
  EXPECT_EQ(ShmemTeamSync(mine), 0);
  // On a stream: a put to every member of my half, the team's sync on the stream; after it every member's
  // word has arrived here.
  auto* words = GuardedBuffer(static_cast<size_t>(n) * 8);
  ASSERT_NE(words, nullptr);
  std::vector<uint8_t> out(8);
  for (size_t i = 0; i < 8; ++i) out[i] = PatternByte(me, i, 77);
  uint8_t* src = GuardedBuffer(8);  // in the heap: every transport reads it
  ASSERT_NE(src, nullptr);
  FromHost(src, out);
  core::GpuStream stream{};
  ASSERT_EQ(core::GpuStreamCreate(&stream), core::kGpuSuccess);
  for (int i = 0; i < ShmemTeamNPes(mine); ++i) {
    EXPECT_EQ(ShmemPutMemOnStream(words + 8 * static_cast<size_t>(me), src, 8,
                                  ShmemTeamTranslatePe(mine, i, kShmemTeamWorld), stream),
              0);
  }
  EXPECT_EQ(ShmemTeamSyncOnStream(mine, stream), 0);
  ASSERT_EQ(core::GpuStreamSynchronize(stream), core::kGpuSuccess);
  auto got = ToHost(words, static_cast<size_t>(n) * 8);
  for (int pe = 0; pe < n; ++pe) {
    std::vector<uint8_t> slot(got.begin() + 8 * pe, got.begin() + 8 * pe + 8);
    ExpectRegion(slot, 0, pe % 2 == me % 2 ? 8 : 0, pe, 77, "team put on a stream");
  }
  ASSERT_EQ(core::GpuStreamDestroy(stream), core::kGpuSuccess);
  ShmemBarrierAll();
  ShmemFree(src);
  ShmemFree(words);
  ShmemFree(worldSlots);
  ShmemFree(slots);
  ShmemTeamDestroy(mine);
}

// ---- host calls ordered on a stream ----

TEST(ShmemTest, OnStreamPutSignalGetQuietAndBarrier) {
  const int n = N(), me = Me(), right = (me + 1) % n, left = (me + n - 1) % n;
  constexpr size_t kBytes = (size_t(3) << 20) + 40;  // several blocks of the put kernel, an odd tail
  uint8_t* dst = GuardedBuffer(kBytes + 256);
  uint8_t* sigDst = GuardedBuffer(kBytes + 256);
  auto* sig = static_cast<uint64_t*>(ShmemCalloc(1, 8));
  ASSERT_TRUE(dst && sigDst && sig);
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = PatternByte(me, i, 31);
  core::GpuBuffer src(kBytes, core::MemoryType::Device);
  FromHost(src.Data(), pattern);
  // Over RDMA and the proxy a source outside the heap must be registered (ShmemBufferRegister), as in kernels;
  // the host refuses it before any kernel runs.
  const bool mapped = ShmemTransportType(right) == TransportType::Self || ShmemTransportType(right) == TransportType::P2P;
  EXPECT_EQ(ShmemPutMemOnStream(dst, src.Data(), 8, right, nullptr) == 0, mapped);
  ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess);
  ShmemBarrierAll();
  FromHost(dst, std::vector<uint8_t>(kBytes + 256, kGuard));
  ShmemBarrierAll();
  ASSERT_EQ(ShmemBufferRegister(src.Data(), kBytes), 0);
  core::GpuStream stream{};
  ASSERT_EQ(core::GpuStreamCreate(&stream), core::kGpuSuccess);
  // Put to the right at offset 128, quiet and barrier on the stream: then the left neighbour's data is here.
  EXPECT_EQ(ShmemPutMemOnStream(dst + 128, src.Data(), kBytes, right, stream), 0);
  EXPECT_EQ(ShmemQuietOnStream(stream), 0);
  EXPECT_EQ(ShmemBarrierAllOnStream(stream), 0);
  ASSERT_EQ(core::GpuStreamSynchronize(stream), core::kGpuSuccess);
  ExpectRegion(ToHost(dst, kBytes + 256), 128, 128 + kBytes, left, 31, "ShmemPutMemOnStream");
  // Put-with-signal to the right, and the wait for the left's signal on the stream: no host barrier between.
  EXPECT_EQ(ShmemPutMemSignalOnStream(sigDst + 64, src.Data(), kBytes, sig, 5, SignalOp::Add, right, stream), 0);
  EXPECT_EQ(ShmemSignalWaitUntilOnStream(sig, CmpOp::GE, 5, stream), 0);
  ASSERT_EQ(core::GpuStreamSynchronize(stream), core::kGpuSuccess);
  ExpectRegion(ToHost(sigDst, kBytes + 256), 64, 64 + kBytes, left, 31, "ShmemPutMemSignalOnStream");
  uint64_t sv = 0;
  ASSERT_EQ(core::GpuMemcpy(&sv, sig, 8), core::kGpuSuccess);
  EXPECT_EQ(sv, 5u);
  // Get the right neighbour's copy of what its left (this PE) put there, into local memory.
  core::GpuBuffer back(kBytes + 64, core::MemoryType::Device);
  FromHost(back.Data(), std::vector<uint8_t>(kBytes + 64, kGuard));
  ASSERT_EQ(ShmemBufferRegister(back.Data(), kBytes + 64), 0);
  EXPECT_EQ(ShmemBarrierAllOnStream(stream), 0);
  EXPECT_EQ(ShmemGetMemOnStream(back.Data(), dst + 128, kBytes, right, stream), 0);
  ASSERT_EQ(core::GpuStreamSynchronize(stream), core::kGpuSuccess);
  ExpectRegion(ToHost(back.Data(), kBytes + 64), 0, kBytes, me, 31, "ShmemGetMemOnStream");
  // Bad input: an error code, nothing launched, nothing written.
  ShmemBarrierAll();
  EXPECT_NE(ShmemPutMemOnStream(dst, src.Data(), 8, n, stream), 0) << "pe out of range";
  EXPECT_NE(ShmemPutMemOnStream(dst, src.Data(), 8, -1, stream), 0);
  EXPECT_NE(ShmemPutMemOnStream(src.Data(), src.Data(), 8, right, stream), 0) << "dest outside the heap";
  uint8_t* heapEnd = static_cast<uint8_t*>(ShmemHeapBase()) + kShmemHeapUserOffset + ShmemHeapBytes();
  EXPECT_NE(ShmemPutMemOnStream(heapEnd - 8, src.Data(), 16, right, stream), 0) << "dest past the heap's end";
  EXPECT_NE(ShmemGetMemOnStream(back.Data(), src.Data(), 8, right, stream), 0) << "source outside the heap";
  EXPECT_NE(ShmemPutMemSignalOnStream(dst, src.Data(), 8, reinterpret_cast<uint64_t*>(dst + 4), 1, SignalOp::Set,
                                      right, stream),
            0)
      << "misaligned signal";
  EXPECT_NE(ShmemSignalWaitUntilOnStream(reinterpret_cast<uint64_t*>(src.Data()), CmpOp::EQ, 1, stream), 0);
  EXPECT_NE(ShmemSignalWaitUntilOnStream(sig, static_cast<CmpOp>(9), 1, stream), 0);
  ASSERT_EQ(core::GpuStreamSynchronize(stream), core::kGpuSuccess);
  ShmemBarrierAll();
  ExpectRegion(ToHost(dst, kBytes + 256), 128, 128 + kBytes, left, 31, "after refused calls");
  ASSERT_EQ(core::GpuStreamDestroy(stream), core::kGpuSuccess);
  EXPECT_EQ(ShmemBufferUnregister(back.Data()), 0);
  EXPECT_EQ(ShmemBufferUnregister(src.Data()), 0);
  ShmemFree(sig);
  ShmemFree(sigDst);
  ShmemFree(dst);
}

size_t CountEntries(const char* dir) {
  size_t n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

size_t CountMappings() {
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);) ++n;
  return n;
}

MORI_GLOBAL void TouchKernel(uint64_t* word, uint64_t value) {
  int n = ShmemNPes();
  for (int pe = 0; pe < n; ++pe) ShmemAtomicTypeAddThread<uint64_t>(word, value, pe);
  ShmemQuietThread();
}

// Init and finalize 50 times: every round allocates, communicates and frees; nothing is left behind.
// Also a heap size that differs on one PE, which every PE must refuse. Runs last: it re-initialises.
// Modules loaded by handle (ShmemModuleInit(module)): a cubin and PTX that the driver JIT-compiles, built on
// their own from shmem_handle_module.cu, run a put-with-signal ring on the symmetric heap, see the runtime go
// down at ShmemFinalize and come back at ShmemInit; one built without MORI_SHMEM_MODULE_BY_HANDLE is refused
// with a message that names the macro. HOST has no GPU modules: every handle is refused there.
#if MORI_BACKEND_CUDA || MORI_BACKEND_HIP
#if MORI_BACKEND_CUDA
using ModuleHandle = CUmodule;
using KernelHandle = CUfunction;
bool LoadModule(const std::string& path, ModuleHandle* m) { return cuModuleLoad(m, path.c_str()) == CUDA_SUCCESS; }
bool UnloadModule(ModuleHandle m) { return cuModuleUnload(m) == CUDA_SUCCESS; }
bool GetKernel(ModuleHandle m, KernelHandle* f) {
  return cuModuleGetFunction(f, m, "mori_handle_ring") == CUDA_SUCCESS;
}
bool Launch(KernelHandle f, void** args) {
  return cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, nullptr, args, nullptr) == CUDA_SUCCESS &&
         cuCtxSynchronize() == CUDA_SUCCESS;
}
const char* const kHandleModules[] = {"shmem_handle_module_cubin.cubin", "shmem_handle_module_ptx.ptx"};
const char* const kPlainModule = "shmem_handle_module_plain.cubin";
#else
using ModuleHandle = hipModule_t;
using KernelHandle = hipFunction_t;
bool LoadModule(const std::string& path, ModuleHandle* m) { return hipModuleLoad(m, path.c_str()) == hipSuccess; }
bool UnloadModule(ModuleHandle m) { return hipModuleUnload(m) == hipSuccess; }
bool GetKernel(ModuleHandle m, KernelHandle* f) {
  return hipModuleGetFunction(f, m, "mori_handle_ring") == hipSuccess;
}
bool Launch(KernelHandle f, void** args) {
  return hipModuleLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, nullptr, args, nullptr) == hipSuccess &&
         hipDeviceSynchronize() == hipSuccess;
}
const char* const kHandleModules[] = {"shmem_handle_module_codeobj.hsaco"};
const char* const kPlainModule = "shmem_handle_module_plain.hsaco";
#endif

// One ring round through module kernel `f`: every PE puts `bytes` of its pattern for `round` into its right
// neighbour's buffer with the signal, checks what its left neighbour sent, and the buffer around it is intact.
void HandleRingRound(KernelHandle f, size_t bytes, uint64_t round) {
  constexpr size_t kPad = 64;
  uint8_t* buf = GuardedBuffer(bytes + 2 * kPad);
  auto* src = static_cast<uint8_t*>(ShmemMalloc(bytes));
  auto* sig = static_cast<uint64_t*>(ShmemCalloc(1, sizeof(uint64_t)));
  ASSERT_TRUE(buf && src && sig);
  std::vector<uint8_t> pattern(bytes);
  for (size_t i = 0; i < bytes; ++i) pattern[i] = PatternByte(Me(), i, static_cast<uint32_t>(round));
  FromHost(src, pattern);
  core::GpuBuffer out(4 * sizeof(uint32_t));
  ASSERT_EQ(core::GpuMemset(out.Data(), 0xFF, out.Bytes()), core::kGpuSuccess);
  ShmemBarrierAll();
  uint8_t* dst = buf + kPad;
  auto* outPtr = out.DataAs<uint32_t>();
  void* args[] = {&dst, &src, &bytes, &sig, &round, &outPtr};
  ASSERT_TRUE(Launch(f, args)) << "round " << round;
  uint32_t o[4];
  ASSERT_EQ(core::GpuMemcpy(o, out.Data(), sizeof(o)), core::kGpuSuccess);
  EXPECT_EQ(o[0], static_cast<uint32_t>(Me()));
  EXPECT_EQ(o[1], static_cast<uint32_t>(N()));
  EXPECT_EQ(o[2], static_cast<uint32_t>(N()));
  EXPECT_EQ(o[3], 0u) << "bytes from the left neighbour that differ, round " << round;
  ExpectRegion(ToHost(buf, bytes + 2 * kPad), kPad, kPad + bytes, (Me() + N() - 1) % N(),
               static_cast<uint32_t>(round), "module by handle");
  ShmemBarrierAll();
  ShmemFree(sig);
  ShmemFree(src);
  ShmemFree(buf);
}

TEST(ShmemTest, ModulesLoadedByHandle) {
  const std::string dir = MORI_TEST_HANDLE_MODULE_DIR;
  ModuleHandle plain{};
  ASSERT_TRUE(LoadModule(dir + "/" + kPlainModule, &plain));
  core::ClearLastError();
  EXPECT_NE(ShmemModuleInit(plain), 0) << "a module built without MORI_SHMEM_MODULE_BY_HANDLE";
  EXPECT_NE(std::string(core::LastError()).find("MORI_SHMEM_MODULE_BY_HANDLE"), std::string::npos)
      << core::LastError();
  EXPECT_NE(ShmemModuleFinalize(plain), 0) << "never initialised";
  EXPECT_TRUE(UnloadModule(plain));

  std::vector<ModuleHandle> modules;
  std::vector<KernelHandle> kernels;
  for (const char* name : kHandleModules) {
    ModuleHandle m{};
    KernelHandle f{};
    ASSERT_TRUE(LoadModule(dir + "/" + name, &m)) << name;
    ASSERT_TRUE(GetKernel(m, &f)) << name;
    EXPECT_NE(ShmemModuleFinalize(m), 0) << "finalize before init";
    ASSERT_EQ(ShmemModuleInit(m), 0) << name << ": " << core::LastError();
    ASSERT_EQ(ShmemModuleInit(m), 0) << "a second init only uploads again";
    modules.push_back(m);
    kernels.push_back(f);
  }
  uint64_t round = 1;
  for (KernelHandle f : kernels) {
    for (size_t bytes : {size_t(8), size_t(12345), size_t(256 << 10)}) HandleRingRound(f, bytes, round++);
  }

  // Down and up again: the modules see the cleared state (no PEs), then the new runtime's heap.
  ASSERT_EQ(ShmemFinalize(), 0);
  core::GpuBuffer out(4 * sizeof(uint32_t));
  for (KernelHandle f : kernels) {
    ASSERT_EQ(core::GpuMemset(out.Data(), 0xFF, out.Bytes()), core::kGpuSuccess);
    void* nothing = nullptr;
    size_t zero = 0;
    uint64_t r = 0;
    auto* outPtr = out.DataAs<uint32_t>();
    void* args[] = {&nothing, &nothing, &zero, &nothing, &r, &outPtr};
    ASSERT_TRUE(Launch(f, args));
    uint32_t o[4];
    ASSERT_EQ(core::GpuMemcpy(o, out.Data(), sizeof(o)), core::kGpuSuccess);
    EXPECT_EQ(o[1], 0u) << "the module still saw " << o[1] << " PEs after ShmemFinalize";
  }
  ASSERT_EQ(ShmemInit(), 0);
  for (KernelHandle f : kernels) HandleRingRound(f, 4099, round++);

  for (ModuleHandle m : modules) {
    EXPECT_EQ(ShmemModuleFinalize(m), 0);
    EXPECT_NE(ShmemModuleFinalize(m), 0) << "finalized twice";
    EXPECT_TRUE(UnloadModule(m));
  }
  // The forgotten modules take no more uploads: a finalize and init after their unload are clean.
  ASSERT_EQ(ShmemFinalize(), 0);
  ASSERT_EQ(ShmemInit(), 0);
}
#else
TEST(ShmemTest, ModulesLoadedByHandle) {
  int fake = 0;
  core::ClearLastError();
  EXPECT_NE(ShmemModuleInit(&fake), 0) << "HOST loads no GPU modules";
  EXPECT_NE(std::string(core::LastError()).find("HOST"), std::string::npos) << core::LastError();
  EXPECT_NE(ShmemModuleFinalize(&fake), 0);
  EXPECT_NE(ShmemModuleFinalize(nullptr), 0);
  EXPECT_EQ(ShmemModuleInit(), 0);
}
#endif

TEST(ShmemTest, ZzInitFinalizeLoopLeaksNothingAndHeapSizesMustAgree) {
  ASSERT_EQ(ShmemFinalize(), 0);
  EXPECT_NE(ShmemFinalize(), 0);
  EXPECT_EQ(ShmemMalloc(64), nullptr);  // use after finalize: an error, not a crash
  // Warm-up round so lazily created process-wide things (loaded libraries, thread pools) exist already.
  ASSERT_EQ(ShmemInit(), 0);
  ASSERT_EQ(ShmemFinalize(), 0);
  size_t fds = CountEntries("/proc/self/fd");
  size_t maps = CountMappings();
  for (int round = 0; round < 50; ++round) {
    ASSERT_EQ(ShmemInit(), 0) << "round " << round;
    auto* w = static_cast<uint64_t*>(ShmemCalloc(1, 8));
    ASSERT_NE(w, nullptr);
    core::LaunchKernel(TouchKernel, Dim3(1), Dim3(1), 0, nullptr, w, static_cast<uint64_t>(round + 1));
    MORI_CHECK_KERNEL();
    ShmemBarrierAll();
    uint64_t v = 0;
    ASSERT_EQ(core::GpuMemcpy(&v, w, 8), core::kGpuSuccess);
    EXPECT_EQ(v, static_cast<uint64_t>(N()) * static_cast<uint64_t>(round + 1));
    ShmemFree(w);
    ASSERT_EQ(ShmemFinalize(), 0);
  }
  EXPECT_EQ(CountEntries("/proc/self/fd"), fds) << "file descriptors leaked";
#if defined(__SANITIZE_ADDRESS__)
  // ASan's quarantine keeps freed memory and maps more as the rounds allocate: mappings say nothing there.
  (void)maps;
#else
  EXPECT_LE(CountMappings(), maps + 4) << "mappings leaked";
#endif

  if (N() > 1) {
    std::string saved = std::getenv("MORI_SHMEM_HEAP_SIZE") ? std::getenv("MORI_SHMEM_HEAP_SIZE") : "";
    setenv("MORI_SHMEM_HEAP_SIZE", Me() == 1 ? "96m" : "64m", 1);
    EXPECT_NE(ShmemInit(), 0) << "a heap size that differs on PE 1 must be refused on every PE";
    if (saved.empty()) {
      unsetenv("MORI_SHMEM_HEAP_SIZE");
    } else {
      setenv("MORI_SHMEM_HEAP_SIZE", saved.c_str(), 1);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ASSERT_EQ(ShmemInit(), 0);
}

class ShmemEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { ASSERT_EQ(ShmemInit(), 0); }
  void TearDown() override { EXPECT_EQ(ShmemFinalize(), 0); }
};

[[maybe_unused]] ::testing::Environment* const kShmemEnv = ::testing::AddGlobalTestEnvironment(new ShmemEnvironment);

}  // namespace
}  // namespace mori::shmem
