// The SHMEM MPI suite, second part: set and swap, fences, registered buffers, device barriers, teams, stream
// operations and modules loaded by handle, then the init/finalize loop, which runs last (this file is linked
// last: gtest runs a suite's tests in the order they were registered).
#include "shmem_mpi_test.hpp"

namespace mori::shmem {
namespace {

using namespace mpi_test;  // NOLINT(google-build-using-namespace): the suite's own helpers

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

// Device code compiled against headers of another layout is refused. A translation unit's uploader that
// registers with another signature, or through the older form without one, is never called, and while it is
// registered ShmemModuleInit (which uploads to every registered unit) fails, naming both signatures; the same
// uploader with the runtime's signature is called at once (the runtime is up) and at every upload after.
int layoutUploads = 0;
int CountingUploader(const ShmemDeviceState* state) {
  ++layoutUploads;
  return state->magic == kShmemStateMagic && state->nPes == N() ? 0 : 1;
}

std::string SignatureHex(uint64_t signature) {
  char text[32];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(signature));
  return text;
}

TEST(ShmemTest, DeviceCodeOfAnotherLayoutIsRefused) {
  static_assert(kShmemLayoutSignature != 0, "0 stands for no signature");
  layoutUploads = 0;
  const uint64_t other = kShmemLayoutSignature ^ 0x10;
  EXPECT_FALSE(detail::RegisterStateUploader(&CountingUploader, other));
  EXPECT_EQ(layoutUploads, 0) << "a refused uploader was called";
  core::ClearLastError();
  EXPECT_NE(ShmemModuleInit(), 0);
  std::string error = core::LastError();
  EXPECT_NE(error.find(SignatureHex(other)), std::string::npos) << error;
  EXPECT_NE(error.find(SignatureHex(kShmemLayoutSignature)), std::string::npos) << error;
  detail::UnregisterStateUploader(&CountingUploader);
  EXPECT_EQ(ShmemModuleInit(), 0) << "the refused uploader is gone: " << core::LastError();

  EXPECT_FALSE(detail::RegisterStateUploader(&CountingUploader));
  core::ClearLastError();
  EXPECT_NE(ShmemModuleInit(), 0);
  error = core::LastError();
  EXPECT_NE(error.find("older than the layout signature"), std::string::npos) << error;
  detail::UnregisterStateUploader(&CountingUploader);
  EXPECT_EQ(layoutUploads, 0);

  EXPECT_TRUE(detail::RegisterStateUploader(&CountingUploader, kShmemLayoutSignature));
  EXPECT_EQ(layoutUploads, 1) << "registered while the runtime is up: uploaded at once";
  EXPECT_EQ(ShmemModuleInit(), 0) << core::LastError();
  EXPECT_EQ(layoutUploads, 2);
  detail::UnregisterStateUploader(&CountingUploader);
  EXPECT_EQ(ShmemModuleInit(), 0);
  EXPECT_EQ(layoutUploads, 2) << "unregistered, not called";
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
const char* const kStaleModule = "shmem_handle_module_stale.cubin";
const char* const kUnsignedModule = "shmem_handle_module_unsigned.cubin";
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
const char* const kStaleModule = "shmem_handle_module_stale.hsaco";
const char* const kUnsignedModule = "shmem_handle_module_unsigned.hsaco";
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

  // A state of the right size is not enough: a module of another layout signature, or of none, takes no upload.
  const std::string ours = SignatureHex(kShmemLayoutSignature);
  for (const char* name : {kStaleModule, kUnsignedModule}) {
    ModuleHandle m{};
    ASSERT_TRUE(LoadModule(dir + "/" + name, &m)) << name;
    core::ClearLastError();
    EXPECT_NE(ShmemModuleInit(m), 0) << name;
    const std::string error = core::LastError();
    EXPECT_NE(error.find(ours), std::string::npos) << name << ": " << error;
    const bool stale = name == kStaleModule;
    EXPECT_NE(error.find(stale ? SignatureHex(kShmemLayoutSignature ^ 0x5a5a) : std::string("older than")),
              std::string::npos)
        << name << ": " << error;
    EXPECT_NE(ShmemModuleFinalize(m), 0) << name << " was never taken";
    EXPECT_TRUE(UnloadModule(m));
  }

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

    // Device code of another layout registered on the last PE only: every PE refuses, the last naming the
    // layouts, the others naming it (before, they waited at a bootstrap barrier for it until the timeout and
    // failed naming that).
    const int odd = N() - 1;
    if (Me() == odd) {
      EXPECT_FALSE(detail::RegisterStateUploader(&CountingUploader, kShmemLayoutSignature ^ 0x20));
    }
    layoutUploads = 0;
    core::ClearLastError();
    EXPECT_NE(ShmemInit(), 0) << "device code of another layout on PE " << odd << " must be refused on every PE";
    std::string error = core::LastError();
    if (Me() == odd) {
      EXPECT_NE(error.find(SignatureHex(kShmemLayoutSignature ^ 0x20)), std::string::npos) << error;
      detail::UnregisterStateUploader(&CountingUploader);
    } else {
      EXPECT_NE(error.find("PE " + std::to_string(odd) + " cannot take the SHMEM state"), std::string::npos) << error;
    }
    EXPECT_EQ(layoutUploads, 0) << "a refused uploader was called";
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
