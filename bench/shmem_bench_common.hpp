// What shmem_bench (mori) and nvshmem_bench (NVSHMEM) share: the command line, the iteration counts, the
// data pattern and the output (one machine-readable line per measurement, human tables, CSV rows
// `bench,impl,size,blocks,value,unit`). Both programs print through this header so that compare_shmem.py
// can join their rows. Standard library only: nvshmem_bench does not link mori.
#pragma once

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace mori::bench {

// Defaults differ between a GPU and the HOST backend, where every "GPU thread" is an OS thread.
struct Machine {
  bool hostThreads;  // true on mori's HOST backend
};

struct Options {
  bool putBw = false;
  bool putBwWarp = false;
  bool pLatency = false;
  bool signalLatency = false;
  size_t minBytes = 1024;
  size_t maxBytes = 0;
  std::vector<unsigned> blocks;
  unsigned threads = 0;        // per block, put_bw
  unsigned signalThreads = 0;  // per block, block-scope put-with-signal ping-pong
  int iters = 0;               // 0: the per-benchmark default below
  int warmup = -1;             // -1: a tenth of the iterations
  int reps = 0;                // timed runs of every put_bw measurement, the best reported; 0: PutBwReps's default
  size_t srcOffset = 0;        // put_bw: bytes between the source allocation's start and the source
  size_t dstOffset = 0;        // put_bw: the same for the target
  size_t align = 0;            // put_bw: the alignment of both allocations; 0: the library's own
  int places = 1;              // put_bw: places in the allocations each measurement is taken at (PutPlaces)
  std::string csv;
};

inline const char* Usage() {
  return "usage: mpirun -np 2 PROGRAM [put_bw|put_bw_warp|p_latency|signal_latency|all] [--min SIZE] [--max SIZE]\n"
         "           [--blocks N,N,...] [--threads N] [--signal-threads N] [--iters N] [--warmup N] [--reps N]\n"
         "           [--src-offset SIZE] [--dst-offset SIZE] [--align SIZE] [--places N] [--csv FILE]\n"
         "  Defaults: --min 1k --max 256m --blocks 1,8,32,132 --threads 1024 --signal-threads 512\n"
         "  (HOST backend: --max 1m --blocks 1,2,4 --threads 4 --signal-threads 4).\n"
         "  SIZE takes k, m, g suffixes (powers of 1024). PE 0 initiates, PE 1 is the target.\n"
         "  put_bw: `blocks` blocks put SIZE bytes together (block scope), for each power of two in [min, max];\n"
         "  put_bw_warp: the same with every warp of those blocks putting its slice (warp scope).\n"
         "  p_latency: single-value put ping-pong; signal_latency: put-with-signal ping-pong, 8 B / 4 KiB / 64 KiB,\n"
         "  thread, warp and block scope.\n"
         "  --iters: iterations of every measurement (default: by size, see shmem_bench_common.hpp).\n"
         "  --reps: timed runs of every put_bw measurement, the fastest reported (default 3; HOST backend 1).\n"
         "  --src-offset / --dst-offset: put_bw's source / target start that many bytes into their allocations\n"
         "  (default 0), which grow by as much: the same message at other addresses and alignments.\n"
         "  --align: put_bw's allocations aligned to SIZE, a power of two (default: what the library's malloc "
         "gives).\n"
         "  --places: put_bw measures each message at up to N places in its allocations, the message's size\n"
         "  rounded up to 2 MiB apart (as many as fit in --max), and reports the median (default 1): the rate of\n"
         "  a copy depends on which physical pages its target lies on, which no program chooses.\n";
}

[[noreturn]] inline void UsageError(const std::string& what) {
  std::fprintf(stderr, "%s\n%s", what.c_str(), Usage());
  std::exit(2);
}

inline size_t ParseSize(const std::string& text) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (end == text.c_str() || errno != 0) UsageError("not a size: '" + text + "'");
  std::string suffix(end);
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  unsigned long long scale = 1;
  if (suffix.empty() || suffix == "b") {
    scale = 1;
  } else if (suffix == "k" || suffix == "kb" || suffix == "kib") {
    scale = 1ull << 10;
  } else if (suffix == "m" || suffix == "mb" || suffix == "mib") {
    scale = 1ull << 20;
  } else if (suffix == "g" || suffix == "gb" || suffix == "gib") {
    scale = 1ull << 30;
  } else {
    UsageError("not a size: '" + text + "'");
  }
  return static_cast<size_t>(v * scale);
}

inline long ParsePositive(const std::string& text, const char* what) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v <= 0) UsageError(std::string(what) + " must be a positive integer");
  return v;
}

inline std::vector<unsigned> ParseList(const std::string& text) {
  std::vector<unsigned> out;
  size_t at = 0;
  while (at <= text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    out.push_back(static_cast<unsigned>(ParsePositive(text.substr(at, comma - at), "--blocks entry")));
    at = comma + 1;
  }
  return out;
}

inline Options ParseOptions(int argc, char** argv, Machine m) {
  Options o;
  o.maxBytes = m.hostThreads ? (size_t(1) << 20) : (size_t(256) << 20);
  o.blocks = m.hostThreads ? std::vector<unsigned>{1, 2, 4} : std::vector<unsigned>{1, 8, 32, 132};
  o.threads = m.hostThreads ? 4 : 1024;
  // 512, not 1024: the block-scope put-with-signal kernel needs about 64 registers per thread, the most that
  // 1024 threads can have.
  o.signalThreads = m.hostThreads ? 4 : 512;
  std::string which = "all";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--min") {
      o.minBytes = ParseSize(value());
    } else if (a == "--max") {
      o.maxBytes = ParseSize(value());
    } else if (a == "--blocks") {
      o.blocks = ParseList(value());
    } else if (a == "--threads") {
      o.threads = static_cast<unsigned>(ParsePositive(value(), "--threads"));
    } else if (a == "--signal-threads") {
      o.signalThreads = static_cast<unsigned>(ParsePositive(value(), "--signal-threads"));
    } else if (a == "--iters") {
      o.iters = static_cast<int>(ParsePositive(value(), "--iters"));
    } else if (a == "--warmup") {
      std::string v = value();
      o.warmup = v == "0" ? 0 : static_cast<int>(ParsePositive(v, "--warmup"));
    } else if (a == "--reps") {
      o.reps = static_cast<int>(ParsePositive(value(), "--reps"));
    } else if (a == "--src-offset") {
      o.srcOffset = ParseSize(value());
    } else if (a == "--dst-offset") {
      o.dstOffset = ParseSize(value());
    } else if (a == "--align") {
      o.align = ParseSize(value());
      if (o.align == 0 || (o.align & (o.align - 1)) != 0) UsageError("--align must be a power of two");
    } else if (a == "--places") {
      o.places = static_cast<int>(ParsePositive(value(), "--places"));
    } else if (a == "--csv") {
      o.csv = value();
    } else if (a == "-h" || a == "--help") {
      std::fputs(Usage(), stdout);
      std::exit(0);
    } else if (!a.empty() && a[0] != '-') {
      which = a;
    } else {
      UsageError("unknown option '" + a + "'");
    }
  }
  if (which == "all") {
    o.putBw = o.putBwWarp = o.pLatency = o.signalLatency = true;
  } else if (which == "put_bw") {
    o.putBw = true;
  } else if (which == "put_bw_warp") {
    o.putBwWarp = true;
  } else if (which == "p_latency") {
    o.pLatency = true;
  } else if (which == "signal_latency") {
    o.signalLatency = true;
  } else {
    UsageError("unknown benchmark '" + which + "'");
  }
  if (o.minBytes == 0 || o.minBytes > o.maxBytes) UsageError("need 0 < --min <= --max");
  return o;
}

// Sizes of put_bw: min, 2 min, 4 min, ... up to max.
inline std::vector<size_t> PutSizes(const Options& o) {
  std::vector<size_t> out;
  for (size_t s = o.minBytes; s <= o.maxBytes; s *= 2) out.push_back(s);
  return out;
}

// Where put_bw puts a `size`-byte message, as offsets from the source and the target (both move): up to
// --places of them, PlaceStride apart, as many as fit in --max bytes. On an H200 the rate of put_bw_warp's copy
// at 1-2 MiB is set by which physical 2 MiB page the target lies on, from 1,640 to 1,900 GB/s between pages of
// one allocation and the same on each page launch after launch; the source's page does not matter
// (bench/experiments/sm_placement.cu `pages`, docs/PERF.md 2026-12-03 ninth session). Which pages a program's
// buffers get depends on what was allocated on the GPU before it, so one place per run made the two programs'
// ratio at 1-2 MiB a draw; the median over several places measures the copy instead.
constexpr size_t kLargePage = size_t(2) << 20;

inline size_t PlaceStride(size_t size) { return (size + kLargePage - 1) / kLargePage * kLargePage; }

inline std::vector<size_t> PutPlaces(const Options& o, size_t size) {
  std::vector<size_t> out{0};
  const size_t stride = PlaceStride(size);
  while (static_cast<int>(out.size()) < o.places && out.back() + stride + size <= o.maxBytes) {
    out.push_back(out.back() + stride);
  }
  return out;
}

// The median of one rate per place: `rateAt(place)` measures at one; `each`, when given, gets them in order.
template <typename RateAt>
double MedianOverPlaces(const std::vector<size_t>& places, RateAt&& rateAt, std::vector<double>* each = nullptr) {
  std::vector<double> rates;
  for (size_t p : places) rates.push_back(rateAt(p));
  if (each != nullptr) *each = rates;
  std::sort(rates.begin(), rates.end());
  const size_t n = rates.size();
  return n % 2 == 1 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2;
}

// The put-with-signal message sizes of the issue.
inline std::vector<size_t> SignalSizes() { return {8, 4096, 65536}; }

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MORI_BENCH_HOST_DEVICE __host__ __device__
#else
#define MORI_BENCH_HOST_DEVICE
#endif

// Part `index` of `parts` of [0, size): 16-byte aligned slices that cover it once (the last ones may be
// empty). The put_bw kernels of both programs split the message this way, per block or per warp.
MORI_BENCH_HOST_DEVICE inline void SliceOf(size_t size, size_t parts, size_t index, size_t* begin, size_t* bytes) {
  const size_t slice = ((size + parts - 1) / parts + 15) / 16 * 16;
  const size_t b = slice * index < size ? slice * index : size;
  *begin = b;
  *bytes = size - b < slice ? size - b : slice;
}

// Who puts in a put-with-signal ping-pong round: one thread, one warp, or a whole block.
enum SignalScope : int { kScopeThread = 0, kScopeWarp = 1, kScopeBlock = 2 };

// put_bw iterations: enough bytes that one launch (about 5 us) is noise, few enough that 256 MiB takes
// milliseconds, not seconds.
inline int PutBwIters(const Options& o, Machine m, size_t size) {
  if (o.iters > 0) return o.iters;
  const double budget = m.hostThreads ? 64.0 * (1 << 20) : 4.0 * (1u << 30);
  const int lo = m.hostThreads ? 3 : 10, hi = m.hostThreads ? 50 : 1000;
  return std::clamp(static_cast<int>(budget / static_cast<double>(size)), lo, hi);
}

// Timed runs of a put_bw measurement; the fastest is reported. One copy kernel launched again and again on an
// H200 alternates between two rates at 2 and 4 MiB, run by run (about 1,560 / 1,705 GB/s at 2 MiB and 1,656 /
// 1,800 at 4 MiB, 32 blocks, nothing launched between: bench/experiments/warp_slice_copy.cu, docs/PERF.md
// 2026-12-02 sixth session), so a single run lands on either, and a ratio of two programs' single runs moved with
// it (8-9%, once 21%).
inline int PutBwReps(const Options& o, Machine m) { return o.reps > 0 ? o.reps : (m.hostThreads ? 1 : 3); }

// The fastest of `reps` calls of `timeMs` (each returns one timed run's milliseconds).
template <typename TimeMs>
double FastestMs(int reps, TimeMs&& timeMs) {
  double best = timeMs();
  for (int r = 1; r < reps; ++r) best = std::min(best, timeMs());
  return best;
}

// Ping-pong iterations: fewer for large messages (a thread-scope 64 KiB put is one thread's copy).
inline int LatencyIters(const Options& o, Machine m, size_t size) {
  if (o.iters > 0) return o.iters;
  const int base = m.hostThreads ? 200 : 10000;
  const int floor = std::min(base, 100);
  return std::max(floor, static_cast<int>(static_cast<long long>(base) * 4096 / std::max<size_t>(size, 4096)));
}

inline int WarmupIters(const Options& o, int iters) { return o.warmup >= 0 ? o.warmup : std::max(1, iters / 10); }

// Source bytes: never zero (destinations are cleared to zero before a measurement), different per PE.
inline uint8_t PatternByte(int pe, size_t i) {
  return static_cast<uint8_t>((i * 7 + static_cast<size_t>(pe) * 13) % 251 + 1);
}

inline std::vector<uint8_t> Pattern(int pe, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = PatternByte(pe, i);
  return out;
}

// Index of the first byte of `got` that is not the pattern of `pe`, or SIZE_MAX.
inline size_t FirstMismatch(const std::vector<uint8_t>& got, int pe) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != PatternByte(pe, i)) return i;
  }
  return SIZE_MAX;
}

// put_bw's target as read back from its allocation's start: zeros for `lead` bytes (the --dst-offset), then at
// each of `count` places `stride` apart `bytes` bytes of the source (the pattern of `pe`, from the same place in
// the source as in the target), zeros between and after.
inline uint8_t ExpectedTargetByte(size_t i, size_t lead, size_t bytes, int pe, size_t stride, size_t count) {
  if (i < lead) return 0;
  const size_t at = i - lead;
  const size_t place = at / stride;
  const size_t into = at - place * stride;
  return place < count && into < bytes ? PatternByte(pe, at) : uint8_t{0};
}

// How many bytes after put_bw's message its check reads back (they must still be zero).
constexpr size_t kTargetTail = 4096;

// The bytes from put_bw's target to the end of its last place's message: what a measurement may write, and
// what the target is cleared over before one.
inline size_t TargetSpan(const Options& o, size_t bytes) { return PutPlaces(o, bytes).back() + bytes; }

// How many bytes of put_bw's target allocation its check reads back, from the allocation's start.
inline size_t TargetCheckBytes(const Options& o, size_t bytes) { return o.dstOffset + TargetSpan(o, bytes) + kTargetTail; }

// Whether `got` (TargetCheckBytes of the target allocation, read from its start) holds PE 0's `bytes`-byte
// message at the --dst-offset, once at each of its places, and zeros around them; if not, `program` on PE `me`
// names the first wrong byte.
inline bool TargetIsRight(const char* program, int me, const std::string& what, const std::vector<uint8_t>& got,
                          const Options& o, size_t bytes) {
  const size_t count = PutPlaces(o, bytes).size();
  const size_t stride = PlaceStride(bytes);
  for (size_t i = 0; i < got.size(); ++i) {
    const uint8_t want = ExpectedTargetByte(i, o.dstOffset, bytes, 0, stride, count);
    if (got[i] == want) continue;
    std::fprintf(stderr,
                 "%s: PE %d: %s: %zu-byte message from PE 0 at offset %zu (%zu places %zu bytes apart): byte %zu of "
                 "the allocation is %u, want %u\n",
                 program, me, what.c_str(), bytes, o.dstOffset, count, stride, i, got[i], want);
    return false;
  }
  return true;
}

// For put_bw's table title: what each figure is.
inline std::string RunsNote(const Options& o, int reps) {
  const std::string runs = "the fastest of " + std::to_string(reps) + " timed runs";
  if (o.places <= 1) return runs;
  return "the median over up to " + std::to_string(o.places) +
         " places of the message in its buffers, its size rounded up to 2 MiB apart, of " + runs + " at each";
}

// PE 0's line of one put_bw measurement's rates at its places, when there are several.
inline void PrintPlaces(const char* bench, size_t size, unsigned blocks, const std::vector<double>& rates) {
  if (rates.size() <= 1) return;
  std::printf("%s size=%zu blocks=%u GBps at each place:", bench, size, blocks);
  for (double r : rates) std::printf(" %.1f", r);
  std::printf("\n");
}

// For put_bw's table title: where in their allocations the source and target start, when not at 0.
inline std::string OffsetsNote(const Options& o) {
  std::string out;
  if (o.align != 0) out += ", allocations aligned to " + std::to_string(o.align) + " bytes";
  if (o.srcOffset != 0 || o.dstOffset != 0) {
    out +=
        ", source / target " + std::to_string(o.srcOffset) + " / " + std::to_string(o.dstOffset) + " bytes into them";
  }
  return out;
}

// Where put_bw's buffers lie, for its table: their addresses modulo 2 MiB (the GPU's large page), where the
// offset inside a page decides how many pages a message spans.
inline std::string PlacementNote(const void* src, const void* dst) {
  return "source / target at " + std::to_string(reinterpret_cast<uintptr_t>(src) % kLargePage) + " / " +
         std::to_string(reinterpret_cast<uintptr_t>(dst) % kLargePage) + " bytes into a 2 MiB page";
}

inline std::string HumanSize(size_t bytes) {
  char buf[32];
  if (bytes >= (size_t(1) << 30) && bytes % (size_t(1) << 30) == 0) {
    std::snprintf(buf, sizeof(buf), "%zu GiB", bytes >> 30);
  } else if (bytes >= (size_t(1) << 20) && bytes % (size_t(1) << 20) == 0) {
    std::snprintf(buf, sizeof(buf), "%zu MiB", bytes >> 20);
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    std::snprintf(buf, sizeof(buf), "%zu KiB", bytes >> 10);
  } else {
    std::snprintf(buf, sizeof(buf), "%zu B", bytes);
  }
  return buf;
}

// Bench names, also the first CSV column.
constexpr const char* kPutBw = "put_bw";
constexpr const char* kPutBwWarp = "put_bw_warp";
constexpr const char* kPLatency = "p_latency";
constexpr const char* kSignalThread = "signal_latency_thread";
constexpr const char* kSignalWarp = "signal_latency_warp";
constexpr const char* kSignalBlock = "signal_latency_block";

inline const char* SignalBenchName(int scope) {
  return scope == kScopeThread ? kSignalThread : scope == kScopeWarp ? kSignalWarp : kSignalBlock;
}

inline const char* PutBwBenchName(bool warpScope) { return warpScope ? kPutBwWarp : kPutBw; }

struct Row {
  std::string bench;
  size_t size;
  unsigned blocks;
  double value;
  std::string unit;  // GBps or us
};

// Collects the measurements of one program (PE 0 prints), one line each as they are taken.
class Report {
 public:
  explicit Report(std::string impl) : impl_(std::move(impl)) {}

  void Add(const char* bench, size_t size, unsigned blocks, int iters, double value, const char* unit) {
    rows_.push_back(Row{bench, size, blocks, value, unit});
    std::printf("%s impl=%s size=%zu blocks=%u iters=%d %s=%.3f\n", bench, impl_.c_str(), size, blocks, iters, unit,
                value);
    std::fflush(stdout);
  }

  const Row* Find(const std::string& bench, size_t size, unsigned blocks) const {
    for (const Row& r : rows_) {
      if (r.bench == bench && r.size == size && r.blocks == blocks) return &r;
    }
    return nullptr;
  }

  void PrintPutBwTable(const Options& o, const char* bench, const std::string& setting) const {
    std::printf("\n%s (%s), GB/s = size x iterations / time; %s\n", bench, impl_.c_str(), setting.c_str());
    std::printf("%10s", "size");
    for (unsigned b : o.blocks) std::printf(" %11s", ("blocks=" + std::to_string(b)).c_str());
    std::printf(" %9s\n", "best");
    for (size_t size : PutSizes(o)) {
      double best = 0;
      std::printf("%10s", HumanSize(size).c_str());
      for (unsigned b : o.blocks) {
        const Row* r = Find(bench, size, b);
        if (r == nullptr) {
          std::printf(" %11s", "-");
          continue;
        }
        best = std::max(best, r->value);
        std::printf(" %11.2f", r->value);
      }
      std::printf(" %9.2f\n", best);
    }
    std::fflush(stdout);
  }

  void PrintLatencyTable(unsigned signalThreads) const {
    std::printf("\nping-pong latency (%s), half round trip in us\n", impl_.c_str());
    if (const Row* r = Find(kPLatency, 8, 1)) std::printf("  single-value put (8 B, one thread): %.3f us\n", r->value);
    bool any = false;
    for (size_t size : SignalSizes()) {
      for (int scope : {kScopeThread, kScopeWarp, kScopeBlock}) any = any || Find(SignalBenchName(scope), size, 1);
    }
    if (!any) return;
    std::printf("  put-with-signal %10s %12s %12s %12s\n", "size", "thread", "warp",
                ("block(" + std::to_string(signalThreads) + ")").c_str());
    for (size_t size : SignalSizes()) {
      std::printf("                  %10s", HumanSize(size).c_str());
      for (int scope : {kScopeThread, kScopeWarp, kScopeBlock}) {
        const Row* r = Find(SignalBenchName(scope), size, 1);
        std::printf(" %12s", r ? Fixed(r->value).c_str() : "-");
      }
      std::printf("\n");
    }
    std::fflush(stdout);
  }

  // Returns false (after a message) when the file cannot be written.
  bool WriteCsv(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s: %s\n", path.c_str(), std::strerror(errno));
      return false;
    }
    std::fprintf(f, "bench,impl,size,blocks,value,unit\n");
    for (const Row& r : rows_) {
      std::fprintf(f, "%s,%s,%zu,%u,%.4f,%s\n", r.bench.c_str(), impl_.c_str(), r.size, r.blocks, r.value,
                   r.unit.c_str());
    }
    bool ok = std::fclose(f) == 0;
    if (ok) std::printf("\nwrote %zu rows to %s\n", rows_.size(), path.c_str());
    return ok;
  }

 private:
  static std::string Fixed(double v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3f", v);
    return buf;
  }

  std::string impl_;
  std::vector<Row> rows_;
};

}  // namespace mori::bench
