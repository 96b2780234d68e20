// shmem_chaos: the job that tests/chaos/chaos.py kills a PE of. Rounds of all-to-all put-with-signal plus
// fetch-add atomics, each round verified, until --rounds is reached or a peer stops answering.
// A PE that sees the job fail says which PEs went silent, checks its receive area and exits promptly,
// without the collective ShmemFinalize (it would wait for the dead PE).
//
// Every byte of a PE's receive area has exactly one writer PE, or none (the guards), and each writer only ever
// writes values of a known sequence: its slot's data of each round, its signal (the round), its counter (after
// each round's fetch-add). A PE is at most one round ahead of another (round R+1 needs every PE's round-R
// signal), so in round R every signal lies in R-1..R+1, every counter is one of its writer's values after rounds
// R-1..R+1, every slot its writer signalled for holds exactly that round, and every guard is intact. After a
// death that is checked for the dead PE's words and the survivors' alike; only slots a put may still be writing
// are left out (reading them would race with the put).
//
//   MORI_RANK=r MORI_WORLD_SIZE=4 MORI_BOOTSTRAP_ADDR=127.0.0.1:port ./shmem_chaos [options]
//     --bytes B        bytes each PE puts to each PE per round (multiple of 8, default 4096)
//     --rounds N       stop after N rounds, then barrier and finalize (default 1000000: until killed)
//     --ready-after K  print the ready line after K verified rounds (default 2)
//     --barrier-every K  a host ShmemBarrierAll after every K rounds (default 0: none)
//
// Lines on stdout (the driver reads them): "... ready ...", "... done ...", "... FAILED ..." (exit 1),
// "... CORRUPTION ..." (exit 3, also after a failure). Usage errors exit 2.
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/atomic.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

namespace mori_chaos {
namespace {

namespace core = mori::core;
namespace shmem = mori::shmem;

constexpr int kMaxPes = 16;
constexpr unsigned kThreadsPerBlock = MORI_BACKEND_HOST ? 4 : 64;
constexpr uint8_t kGuardByte = 0xA5;
constexpr size_t kGuardBytes = 64;  // before every slot and word, and after the last

// ---- what each writer writes ----

MORI_HOST_DEVICE_INLINE uint64_t Mix(uint64_t x) {
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return x;
}

// Byte `i` of what `src` puts into `dst`'s slot in `round` (rounds -1 and 0: the fill before round 1).
MORI_HOST_DEVICE_INLINE uint8_t PatternByte(int src, int dst, int64_t round, size_t i) {
  uint64_t x = (static_cast<uint64_t>(src) + 1) * 0x9E3779B97F4A7C15ull ^
               (static_cast<uint64_t>(dst) + 1) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(round + 2) * 0x94D049BB133111EBull ^ (i + 1) * 0xD6E8FEB86659FD93ull;
  return static_cast<uint8_t>(Mix(x) >> 56);
}

// The counter `src` adds to on `dst`: its start (set by dst) and its value after src's first k fetch-adds.
MORI_HOST_DEVICE_INLINE uint64_t CounterBase(int src, int dst) {
  return (static_cast<uint64_t>(src) + 1) << 40 | (static_cast<uint64_t>(dst) + 1) << 32;
}
MORI_HOST_DEVICE_INLINE uint64_t CounterAfter(int src, int dst, int64_t k) {
  const uint64_t step = (static_cast<uint64_t>(src) + 1) * 1000 + static_cast<uint64_t>(dst) + 1;  // k-th add: step + k
  const auto n = static_cast<uint64_t>(k);
  return CounterBase(src, dst) + 0x5EED + n * step + n * (n + 1) / 2;
}
MORI_HOST_DEVICE_INLINE uint64_t CounterAdd(int src, int dst, int64_t round) {
  return CounterAfter(src, dst, round) - CounterAfter(src, dst, round - 1);
}

// ---- the receive area (same offsets on every PE) ----

// [guard | slot(parity 0, src 0) | guard | slot(0, 1) | ... | slot(1, n-1) | guard | signal(0) | guard |
// counter(0) | guard | signal(1) | ... | counter(n-1) | guard]
struct Area {
  uint8_t* base;
  size_t slotBytes;
  int nPes;
};

MORI_HOST_DEVICE_INLINE size_t SlotOffset(const Area& a, int parity, int src) {
  return kGuardBytes + static_cast<size_t>(parity * a.nPes + src) * (a.slotBytes + kGuardBytes);
}
MORI_HOST_DEVICE_INLINE size_t WordsOffset(const Area& a) { return SlotOffset(a, 2, 0); }
MORI_HOST_DEVICE_INLINE size_t SignalOffset(const Area& a, int src) {
  return WordsOffset(a) + static_cast<size_t>(2 * src) * (8 + kGuardBytes);
}
MORI_HOST_DEVICE_INLINE size_t CounterOffset(const Area& a, int src) {
  return WordsOffset(a) + static_cast<size_t>(2 * src + 1) * (8 + kGuardBytes);
}
MORI_HOST_DEVICE_INLINE size_t AreaBytes(const Area& a) { return CounterOffset(a, a.nPes - 1) + 8 + kGuardBytes; }

MORI_HOST_DEVICE_INLINE uint64_t* SignalOf(const Area& a, int src) {
  return reinterpret_cast<uint64_t*>(a.base + SignalOffset(a, src));
}
MORI_HOST_DEVICE_INLINE uint64_t* CounterOf(const Area& a, int src) {
  return reinterpret_cast<uint64_t*>(a.base + CounterOffset(a, src));
}

// Kernel errors of this PE: fetch-adds that returned a value their writer's sequence cannot have produced.
struct KernelReport {
  uint32_t badFetches;
  int32_t firstPe;
  uint64_t firstSeen;
};

// One round. Block b fetch-adds to its counter on PE me + b, puts this round's slot there with a signal set to
// the round, and waits for the signal of PE me - b (whose block b puts here). A dead PE's signal never comes:
// the wait traps after MORI_TIMEOUT_S, as do the RDMA and proxy operations aimed at it.
MORI_GLOBAL void RoundKernel(Area area, const uint8_t* send, int64_t round, KernelReport* report) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int b = static_cast<int>(core::FlatBlockIdx());
  const int to = (me + b) % n, from = (me - b + n) % n;
  const int parity = static_cast<int>(round & 1);
  if (core::FlatThreadIdx() == 0) {
    uint64_t old = shmem::ShmemAtomicTypeFetchAddThread<uint64_t>(CounterOf(area, me), CounterAdd(me, to, round), to);
    if (old != CounterAfter(me, to, round - 1) &&
        core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&report->badFetches, 1u) == 0) {
      report->firstPe = to;
      report->firstSeen = old;
    }
  }
  shmem::ShmemPutMemNbiSignalBlock(area.base + SlotOffset(area, parity, me),
                                   send + static_cast<size_t>(to) * area.slotBytes, area.slotBytes, SignalOf(area, me),
                                   static_cast<uint64_t>(round), shmem::SignalOp::Set, to);
  if (core::FlatThreadIdx() == 0) {
    shmem::ShmemSignalWaitUntil(SignalOf(area, from), shmem::CmpOp::GE, static_cast<uint64_t>(round));
    shmem::ShmemQuietThread();
  }
}

// ---- host side ----

struct Options {
  size_t bytes = 4096;
  int64_t rounds = 1000000;
  int64_t readyAfter = 2;
  int64_t barrierEvery = 0;
};

bool ParseOptions(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (i + 1 >= argc) return false;
    std::string value = argv[++i];
    if (arg == "--bytes") {
      o->bytes = core::ParseSize(value, "--bytes");
    } else if (arg == "--rounds") {
      o->rounds = core::ParseInt(value, "--rounds");
    } else if (arg == "--ready-after") {
      o->readyAfter = core::ParseInt(value, "--ready-after");
    } else if (arg == "--barrier-every") {
      o->barrierEvery = core::ParseInt(value, "--barrier-every");
    } else {
      return false;
    }
  }
  return o->bytes > 0 && o->bytes % 8 == 0 && o->rounds >= 1 && o->readyAfter >= 1 && o->barrierEvery >= 0;
}

void Say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Say(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vprintf(fmt, args);
  va_end(args);
  std::fflush(stdout);
}

// The first few problems found in the receive area, and how many in all.
struct Findings {
  size_t count = 0;
  std::string text;
  void Add(const std::string& what) {
    if (count++ < 6) text += (text.empty() ? "" : "; ") + what;
  }
};

std::string Format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

std::vector<uint8_t> CopyOut(const uint8_t* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  MORI_CHECK_GPU(core::GpuMemcpy(out.data(), p, bytes));
  return out;
}

// Checks this PE's receive area while it is in `round` (its kernel for the round has ended, well or not), and
// reads only memory no put can still be landing in: reading a slot while a put writes it is a race (and
// ThreadSanitizer says so where a host thread of this process lands the put). Guards are never written; signals
// and counters are written atomically; a slot is stable once its writer signalled for it, since the writer
// puts the next round of that parity only after this PE's signal for the round after this one. A slot not
// signalled for may be landing (after a failure) and is counted in `unchecked` instead. With `complete`, every
// PE's signal for `round` came (the kernel ended well).
Findings CheckArea(const Area& a, int me, int64_t round, bool complete, size_t* unchecked) {
  Findings f;
  Area local = a;
  local.base = nullptr;
  // The words, from the guard after the last slot on.
  const size_t wordsAt = WordsOffset(local) - kGuardBytes;
  const std::vector<uint8_t> words = CopyOut(a.base + wordsAt, AreaBytes(local) - wordsAt);
  auto word = [&](size_t offset) {
    uint64_t v;
    std::memcpy(&v, words.data() + offset - wordsAt, sizeof(v));
    return v;
  };
  auto guardRun = [&](const uint8_t* bytes, const char* where) {
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (bytes[i] != kGuardByte) {
        f.Add(Format("guard byte %zu %s is 0x%02x", i, where, bytes[i]));
        return;
      }
    }
  };
  for (int src = 0; src < a.nPes; ++src) {
    std::string where = Format("before the signal of PE %d", src);
    guardRun(words.data() + SignalOffset(local, src) - kGuardBytes - wordsAt, where.c_str());
    where = Format("before the counter of PE %d", src);
    guardRun(words.data() + CounterOffset(local, src) - kGuardBytes - wordsAt, where.c_str());
  }
  guardRun(words.data() + words.size() - kGuardBytes, "after the last counter");

  for (int src = 0; src < a.nPes; ++src) {
    // A PE is at most one round ahead of this one, and has finished the round before this one.
    const auto sig = static_cast<int64_t>(word(SignalOffset(local, src)));
    const int64_t lo = complete ? round : round - 1;
    const bool sigOk = sig >= lo && sig <= round + 1;
    if (!sigOk) {
      f.Add(Format("signal of PE %d is %lld, expected %lld..%lld", src, static_cast<long long>(sig),
                   static_cast<long long>(lo), static_cast<long long>(round + 1)));
    }
    const uint64_t counter = word(CounterOffset(local, src));
    bool counterOk = !sigOk;  // with a wrong signal the counter's range is unknown: reported above
    for (int64_t k = sig; k <= round + 1 && !counterOk; ++k) counterOk = counter == CounterAfter(src, me, k);
    if (!counterOk) {
      f.Add(Format("counter of PE %d is %#llx, not its value after any of fetch-adds %lld..%lld", src,
                   static_cast<unsigned long long>(counter), static_cast<long long>(sig),
                   static_cast<long long>(round + 1)));
    }
    for (int64_t r = round; r <= round + 1; ++r) {
      const int parity = static_cast<int>(r & 1);
      const bool stable = sigOk && sig >= r;
      const size_t at = SlotOffset(local, parity, src) - kGuardBytes;
      const std::vector<uint8_t> got = CopyOut(a.base + at, kGuardBytes + (stable ? a.slotBytes : 0));
      std::string where = Format("before the slot of PE %d (parity %d)", src, parity);
      guardRun(got.data(), where.c_str());
      if (!stable) {
        ++*unchecked;
        continue;
      }
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < a.slotBytes; ++i) {
        if (got[kGuardBytes + i] != PatternByte(src, me, r, i) && bad++ == 0) first = i;
      }
      if (bad != 0) {
        f.Add(Format("slot of PE %d (parity %d): %zu bytes differ from its round %lld, first at %zu", src, parity, bad,
                     static_cast<long long>(r), first));
      }
    }
  }
  return f;
}

// A barrier that failed (the runtime's log line above names why): the job cannot go on.
int BarrierFailed(int me, int64_t round) {
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  Say("shmem_chaos: PE %d FAILED in the barrier after round %lld (see the log above) [monotonic %.3f s]\n", me,
      static_cast<long long>(round), now);
  return 1;
}

int Run(int argc, char** argv) {
  Options opt;
  if (!ParseOptions(argc, argv, &opt)) {
    std::fprintf(stderr,
                 "usage: shmem_chaos [--bytes B (multiple of 8)] [--rounds N] [--ready-after K] [--barrier-every K]\n");
    return 2;
  }
  if (shmem::ShmemInit() != 0) {
    Say("shmem_chaos: FAILED at init (ShmemInit, see the log above)\n");
    return 1;
  }
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  if (n > kMaxPes) {
    Say("shmem_chaos: PE %d: FAILED: %d PEs, at most %d\n", me, n, kMaxPes);
    return 2;
  }
  Area area{nullptr, opt.bytes, n};
  area.base = static_cast<uint8_t*>(shmem::ShmemMalloc(AreaBytes(area)));
  auto* send = static_cast<uint8_t*>(shmem::ShmemMalloc(static_cast<size_t>(n) * opt.bytes));
  auto* report = static_cast<KernelReport*>(shmem::ShmemCalloc(1, sizeof(KernelReport)));
  if (area.base == nullptr || send == nullptr || report == nullptr) {
    Say("shmem_chaos: PE %d: FAILED at init: ShmemMalloc of %zu bytes (raise MORI_SHMEM_HEAP_SIZE)\n", me,
        AreaBytes(area) + static_cast<size_t>(n) * opt.bytes);
    return 1;
  }

  // As if rounds -1 and 0 had happened: every slot, signal and counter already holds its writer's sequence.
  {
    std::vector<uint8_t> init(AreaBytes(area), kGuardByte);
    Area local = area;
    local.base = init.data();
    for (int src = 0; src < n; ++src) {
      for (int64_t r = -1; r <= 0; ++r) {
        uint8_t* slot = init.data() + SlotOffset(local, static_cast<int>(r & 1), src);
        for (size_t i = 0; i < opt.bytes; ++i) slot[i] = PatternByte(src, me, r, i);
      }
      *SignalOf(local, src) = 0;
      *CounterOf(local, src) = CounterAfter(src, me, 0);
    }
    MORI_CHECK_GPU(core::GpuMemcpy(area.base, init.data(), init.size()));
  }
  // Nobody puts into an area its owner is still filling.
  if (shmem::ShmemBarrierAllChecked() != 0) return BarrierFailed(me, 0);

  std::vector<uint8_t> out(static_cast<size_t>(n) * opt.bytes);
  int64_t round = 1;
  for (;; ++round) {
    for (int to = 0; to < n; ++to) {
      uint8_t* slot = out.data() + static_cast<size_t>(to) * opt.bytes;
      for (size_t i = 0; i < opt.bytes; ++i) slot[i] = PatternByte(me, to, round, i);
    }
    MORI_CHECK_GPU(core::GpuMemcpy(send, out.data(), out.size()));
    core::LaunchKernel(RoundKernel, core::Dim3(static_cast<unsigned>(n)), core::Dim3(kThreadsPerBlock), 0, nullptr,
                       area, static_cast<const uint8_t*>(send), round, report);
    core::GpuStatus launched = core::GpuGetLastError();
    core::GpuStatus ran = launched != core::kGpuSuccess ? launched : core::GpuDeviceSynchronize();

    // After a failed kernel the copies below still work on HOST; on a GPU the context may be gone, and the
    // report says so instead.
    Findings f;
    size_t unchecked = 0;
    std::vector<uint64_t> signals(static_cast<size_t>(n));
    KernelReport kr{};
    std::string unreadable;
    try {
      for (int src = 0; src < n; ++src) {
        MORI_CHECK_GPU(core::GpuMemcpy(&signals[static_cast<size_t>(src)], SignalOf(area, src), sizeof(uint64_t)));
      }
      f = CheckArea(area, me, round, ran == core::kGpuSuccess, &unchecked);
      MORI_CHECK_GPU(core::GpuMemcpy(&kr, report, sizeof(kr)));
    } catch (const core::Error& e) {
      unreadable = e.what();
    }
    if (kr.badFetches != 0) {
      f.Add(Format("%u fetch-adds returned values outside their sequence (first from PE %d: %#llx)", kr.badFetches,
                   kr.firstPe, static_cast<unsigned long long>(kr.firstSeen)));
    }

    if (ran != core::kGpuSuccess) {
      std::string silent;
      // This PE's own signal may be missing too, when the kernel ended before its put to itself.
      for (int src = 0; src < n && unreadable.empty(); ++src) {
        if (src == me) continue;
        const uint64_t sig = signals[static_cast<size_t>(src)];
        if (static_cast<int64_t>(sig) >= round) continue;
        silent +=
            Format("%sPE %d (at round %llu)", silent.empty() ? "" : ", ", src, static_cast<unsigned long long>(sig));
      }
      std::string check = !unreadable.empty() ? "receive area unreadable: " + unreadable
                          : f.count == 0
                              ? Format("receive area intact (%zu slots a put may still be writing not read)", unchecked)
                              : Format("receive area has %zu problems", f.count);
      // The steady clock is CLOCK_MONOTONIC, which the driver shares: it tells the report from the exit.
      const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
      Say("shmem_chaos: PE %d FAILED in round %lld: %s; no round-%lld signal from %s; %s [monotonic %.3f s]\n", me,
          static_cast<long long>(round), core::GpuGetErrorString(ran), static_cast<long long>(round),
          silent.empty() ? "nobody (every PE's signal came)" : silent.c_str(), check.c_str(), now);
    }
    if (f.count != 0) {
      Say("shmem_chaos: PE %d CORRUPTION in round %lld: %s\n", me, static_cast<long long>(round), f.text.c_str());
      return 3;
    }
    if (ran != core::kGpuSuccess) return 1;

    if (round == opt.readyAfter) {
      std::string transports;
      for (int pe = 0; pe < n; ++pe) {
        transports += Format("%s%d:%s", pe ? " " : "", pe, shmem::TransportTypeName(shmem::ShmemTransportType(pe)));
      }
      Say("shmem_chaos: PE %d ready after %lld rounds (%d PEs, %zu bytes per pair, transports %s)\n", me,
          static_cast<long long>(round), n, opt.bytes, transports.c_str());
    }
    if (round >= opt.rounds) break;
    if (opt.barrierEvery > 0 && round % opt.barrierEvery == 0 && shmem::ShmemBarrierAllChecked() != 0) {
      return BarrierFailed(me, round);
    }
  }
  if (shmem::ShmemBarrierAllChecked() != 0) return BarrierFailed(me, round);
  if (shmem::ShmemFinalize() != 0) {
    Say("shmem_chaos: PE %d FAILED in ShmemFinalize after %lld rounds\n", me, static_cast<long long>(round));
    return 1;
  }
  Say("shmem_chaos: PE %d done: %lld rounds verified\n", me, static_cast<long long>(round));
  return 0;
}

}  // namespace
}  // namespace mori_chaos

int main(int argc, char** argv) {
  try {
    return mori_chaos::Run(argc, argv);
  } catch (const mori::core::Error& e) {
    std::printf("shmem_chaos: FAILED: %s\n", e.what());
    return 1;
  }
}
