// The SHMEM runtime and device API under `mpirun -np N` (ctest runs 2 and 4 PEs under each forced
// transport: MORI_SHMEM_TRANSPORT=p2p, rdma and proxy). Kernels run many threads at once; every test fills with
// rank- and index-dependent patterns, checks every byte that should have arrived and that the bytes around
// it were not touched.
#include "shmem_mpi_test.hpp"

namespace mori::shmem {
namespace {

using namespace mpi_test;  // NOLINT(google-build-using-namespace): the suite's own helpers

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
}  // namespace
}  // namespace mori::shmem
