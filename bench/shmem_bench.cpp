// shmem_bench: the SHMEM device API between two PEs. PE 0 initiates, PE 1 is the target or the partner.
//   put_bw          `blocks` blocks put `size` bytes together (each block its slice, ShmemPutMemNbiBlock),
//                   `iters` times in one launch, then quiet; GB/s = size x iters / time (GPU events).
//   put_bw_warp     the same with every warp of those blocks putting its slice (ShmemPutMemNbiWarp).
//   p_latency       single-value put ping-pong (ShmemPutTypeImmNbiThread + ShmemWaitUntil), one thread.
//   signal_latency  put-with-signal ping-pong, 8 B / 4 KiB / 64 KiB, thread scope (one thread), warp scope
//                   (one warp puts, lane 0 waits) and block scope (the whole block puts, thread 0 waits).
// Latencies are half a round trip. nvshmem_bench.cu measures the same with NVSHMEM and prints the same lines
// and CSV; compare_shmem.py puts the two side by side.
//
//   mpirun -np 2 ./shmem_bench [put_bw|p_latency|signal_latency|all] [--min 1k] [--max 256m]
//          [--blocks 1,8,32,132] [--threads 1024] [--signal-threads N] [--iters N] [--warmup N] [--csv FILE]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"
#include "mori_bench_util.hpp"
#include "shmem_bench_common.hpp"

namespace mori::shmem {
namespace {

using core::Dim3;

constexpr bench::Machine kMachine{MORI_BACKEND_HOST != 0};

// Block b puts its 16-byte aligned slice of [0, size) `iters` times; the slices cover [0, size) once.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(1024)
    PutBwKernel(uint8_t* dst, const uint8_t* src, size_t size, int iters, int pe) {
  size_t begin = 0, bytes = 0;
  bench::SliceOf(size, core::FlatGridDim(), core::FlatBlockIdx(), &begin, &bytes);
  if (bytes > 0) {
    for (int i = 0; i < iters; ++i) ShmemPutMemNbiBlock(dst + begin, src + begin, bytes, pe);
  }
  ShmemQuietThread();
}

// The same per warp: every warp of the grid puts its slice.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(1024)
    PutBwWarpKernel(uint8_t* dst, const uint8_t* src, size_t size, int iters, int pe) {
  const size_t warpsPerBlock = (core::FlatBlockDim() + MORI_WARP_SIZE - 1) / MORI_WARP_SIZE;
  size_t begin = 0, bytes = 0;
  bench::SliceOf(size, core::FlatGridDim() * warpsPerBlock, core::FlatBlockIdx() * warpsPerBlock + core::WarpId(),
                 &begin, &bytes);
  if (bytes > 0) {
    for (int i = 0; i < iters; ++i) ShmemPutMemNbiWarp(dst + begin, src + begin, bytes, pe);
  }
  ShmemQuietThread();
}

// Values base + 1 .. base + iters travel PE 0 -> PE 1 -> PE 0 through the same symmetric word.
MORI_GLOBAL void PingPongKernel(uint64_t* flag, uint64_t base, int iters, int me) {
  const int peer = 1 - me;
  for (int i = 1; i <= iters; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (me == 0) {
      ShmemPutTypeImmNbiThread<uint64_t>(flag, v, peer);
      ShmemWaitUntil<uint64_t>(flag, CmpOp::EQ, v);
    } else {
      ShmemWaitUntil<uint64_t>(flag, CmpOp::EQ, v);
      ShmemPutTypeImmNbiThread<uint64_t>(flag, v, peer);
    }
  }
  ShmemQuietThread();
}

// The message of round i carries signal base + i; the partner answers once it has seen it.
// One block: a thread (kScopeThread), one warp (kScopeWarp) or the whole block (kScopeBlock) puts.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(1024)
    SignalPingPongKernel(int scope, uint8_t* buf, const uint8_t* src, size_t bytes, uint64_t* sig, uint64_t base,
                         int iters, int me) {
  const int peer = 1 - me;
  const bool leader = core::FlatThreadIdx() == 0;
  auto wait = [&](uint64_t v) {
    if (leader) ShmemSignalWaitUntil(sig, CmpOp::GE, v);
    if (scope != bench::kScopeThread) core::SyncThreads();
  };
  for (int i = 1; i <= iters; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (me == 1) wait(v);
    if (scope == bench::kScopeBlock) {
      ShmemPutMemNbiSignalBlock(buf, src, bytes, sig, v, SignalOp::Set, peer);
    } else if (scope == bench::kScopeWarp) {
      ShmemPutMemNbiSignalWarp(buf, src, bytes, sig, v, SignalOp::Set, peer);
    } else {
      ShmemPutMemNbiSignalThread(buf, src, bytes, sig, v, SignalOp::Set, peer);
    }
    if (me == 0) wait(v);
  }
  ShmemQuietThread();
}

class Bench {
 public:
  explicit Bench(const bench::Options& o) : opts_(o), me_(ShmemMyPe()) {}
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  // Returns the number of failed data checks on this PE.
  int Run() {
    if (opts_.putBw) PutBw(false);
    if (opts_.putBwWarp) PutBw(true);
    if (opts_.pLatency) PLatency();
    if (opts_.signalLatency) SignalLatency();
    if (me_ == 0 && (opts_.pLatency || opts_.signalLatency)) report_.PrintLatencyTable(opts_.signalThreads);
    if (me_ == 0 && !opts_.csv.empty() && !report_.WriteCsv(opts_.csv)) ++failures_;
    return failures_;
  }

 private:
  template <typename T>
  T* Alloc(size_t bytes, bool zero, size_t alignment = 0) {
    return bench::SymmetricAlloc<T>(bytes, zero, " (put_bw needs 2 x --max)", alignment);
  }

  // put_bw's target, read from its allocation's start: zeros for the offset, PE 0's pattern for `bytes`, zeros
  // for bench::kTargetTail bytes after.
  void CheckTarget(const std::string& what, const uint8_t* base, size_t bytes) {
    std::vector<uint8_t> got(bench::TargetCheckBytes(opts_, bytes));
    MORI_CHECK_GPU(core::GpuMemcpy(got.data(), base, got.size()));
    if (!bench::TargetIsRight("shmem_bench", me_, what, got, opts_, bytes)) ++failures_;
  }

  // Compares [0, bytes) of `p` with the pattern of `pe`.
  void Check(const char* what, const uint8_t* p, size_t bytes, const std::vector<uint8_t>& expect, int pe) {
    std::vector<uint8_t> got(bytes);
    MORI_CHECK_GPU(core::GpuMemcpy(got.data(), p, bytes));
    if (std::memcmp(got.data(), expect.data(), bytes) == 0) return;
    size_t at = bench::FirstMismatch(got, pe);
    std::fprintf(stderr, "shmem_bench: PE %d: %s: %zu-byte message from PE %d wrong at byte %zu (got %u, want %u)\n",
                 me_, what, bytes, pe, at, got[at], expect[at]);
    ++failures_;
  }

  void PutBw(bool warpScope) {
    const char* name = bench::PutBwBenchName(warpScope);
    const size_t max = opts_.maxBytes;
    // The target is zeroed once and checked with what lies around the message (the offset, a tail after it).
    uint8_t* srcBase = Alloc<uint8_t>(opts_.srcOffset + max, false, opts_.align);
    uint8_t* dstBase = Alloc<uint8_t>(opts_.dstOffset + max + bench::kTargetTail, true, opts_.align);
    uint8_t* src = srcBase + opts_.srcOffset;
    uint8_t* dst = dstBase + opts_.dstOffset;
    const std::vector<uint8_t> pattern = bench::Pattern(0, max);
    if (me_ == 0) MORI_CHECK_GPU(core::GpuMemcpy(src, pattern.data(), max));
    const int reps = bench::PutBwReps(opts_, kMachine);
    for (size_t size : bench::PutSizes(opts_)) {
      const int iters = bench::PutBwIters(opts_, kMachine, size);
      const int warmup = bench::WarmupIters(opts_, iters);
      const std::vector<size_t> places = bench::PutPlaces(opts_, size);
      for (unsigned blocks : opts_.blocks) {
        if (me_ == 1) MORI_CHECK_GPU(core::GpuMemsetAsync(dst, 0, bench::TargetSpan(opts_, size), timer_.Stream()));
        timer_.Barrier();
        if (me_ == 0) {
          // At each place: a warm-up, then the fastest of the timed runs.
          std::vector<double> each;
          const double gbps = bench::MedianOverPlaces(places, [&](size_t place) {
            auto launch = [&](int n) {
              core::LaunchKernel(warpScope ? PutBwWarpKernel : PutBwKernel, Dim3(blocks), Dim3(opts_.threads), 0,
                                 timer_.Stream(), dst + place, static_cast<const uint8_t*>(src + place), size, n, 1);
            };
            if (warmup > 0) timer_.TimeMs([&] { launch(warmup); });
            double ms = bench::FastestMs(reps, [&] { return timer_.TimeMs([&] { launch(iters); }); });
            return static_cast<double>(size) * iters / (ms * 1e-3) / 1e9;
          }, &each);
          report_.Add(name, size, blocks, iters, gbps, "GBps");
          bench::PrintPlaces(name, size, blocks, each);
        }
        timer_.Barrier();
        if (me_ == 1) CheckTarget(std::string(name) + " blocks=" + std::to_string(blocks), dstBase, size);
      }
    }
    if (me_ == 0) {
      report_.PrintPutBwTable(opts_, name,
                              std::string(warpScope ? "warp" : "block") + " scope, " + std::to_string(opts_.threads) +
                                  " threads per block, to PE 1 over " + TransportTypeName(ShmemTransportType(1)) +
                                  ", " + bench::RunsNote(opts_, reps) +
                                  bench::OffsetsNote(opts_) + "; " + bench::PlacementNote(src, dst));
    }
    timer_.Barrier();
    ShmemFree(dstBase);
    ShmemFree(srcBase);
  }

  // One ping-pong launch on both PEs after a barrier, carrying values seq + 1 .. seq + iters (then the new
  // seq: both PEs count alike, so a flag word never needs a reset). Returns PE 0's milliseconds.
  template <typename Launch>
  double PingPong(uint64_t& seq, int iters, Launch&& launch) {
    timer_.Barrier();
    double ms = timer_.TimeMs([&] { launch(seq, iters); });
    seq += static_cast<uint64_t>(iters);
    return me_ == 0 ? ms : 0;
  }

  void PLatency() {
    auto* flag = Alloc<uint64_t>(sizeof(uint64_t), true);
    const int iters = bench::LatencyIters(opts_, kMachine, sizeof(uint64_t));
    const int warmup = bench::WarmupIters(opts_, iters);
    auto launch = [&](uint64_t base, int n) {
      core::LaunchKernel(PingPongKernel, Dim3(1), Dim3(1), 0, timer_.Stream(), flag, base, n, me_);
    };
    uint64_t seq = 0;
    if (warmup > 0) PingPong(seq, warmup, launch);
    double ms = PingPong(seq, iters, launch);
    uint64_t last = 0;
    MORI_CHECK_GPU(core::GpuMemcpy(&last, flag, sizeof(last)));
    if (last != seq) {
      std::fprintf(stderr, "shmem_bench: PE %d: p_latency: flag holds %llu after the run, want %llu\n", me_,
                   static_cast<unsigned long long>(last), static_cast<unsigned long long>(seq));
      ++failures_;
    }
    if (me_ == 0) report_.Add(bench::kPLatency, sizeof(uint64_t), 1, iters, ms * 1e3 / iters / 2, "us");
    timer_.Barrier();
    ShmemFree(flag);
  }

  void SignalLatency() {
    const std::vector<size_t> sizes = bench::SignalSizes();
    const size_t max = *std::max_element(sizes.begin(), sizes.end());
    auto* buf = Alloc<uint8_t>(max, false);
    auto* src = Alloc<uint8_t>(max, false);
    auto* sig = Alloc<uint64_t>(sizeof(uint64_t), true);
    const std::vector<uint8_t> mine = bench::Pattern(me_, max);
    const std::vector<uint8_t> theirs = bench::Pattern(1 - me_, max);
    MORI_CHECK_GPU(core::GpuMemcpy(src, mine.data(), max));
    uint64_t seq = 0;
    for (size_t size : sizes) {
      const int iters = bench::LatencyIters(opts_, kMachine, size);
      const int warmup = bench::WarmupIters(opts_, iters);
      for (int scope : {bench::kScopeThread, bench::kScopeWarp, bench::kScopeBlock}) {
        MORI_CHECK_GPU(core::GpuMemsetAsync(buf, 0, size, timer_.Stream()));
        const unsigned threads = scope == bench::kScopeBlock  ? opts_.signalThreads
                                 : scope == bench::kScopeWarp ? MORI_WARP_SIZE
                                                              : 1;
        auto launch = [&](uint64_t base, int n) {
          core::LaunchKernel(SignalPingPongKernel, Dim3(1), Dim3(threads), 0, timer_.Stream(), scope, buf,
                             static_cast<const uint8_t*>(src), size, sig, base, n, me_);
        };
        if (warmup > 0) PingPong(seq, warmup, launch);
        double ms = PingPong(seq, iters, launch);
        const char* name = bench::SignalBenchName(scope);
        Check(name, buf, size, theirs, 1 - me_);
        if (me_ == 0) report_.Add(name, size, 1, iters, ms * 1e3 / iters / 2, "us");
      }
    }
    timer_.Barrier();
    ShmemFree(sig);
    ShmemFree(src);
    ShmemFree(buf);
  }

  bench::Options opts_;
  int me_;
  bench::StreamTimer timer_;
  bench::Report report_{"mori"};
  int failures_ = 0;
};

int Main(int argc, char** argv) {
  const bench::Options opts = bench::ParseOptions(argc, argv, kMachine);
  if (ShmemInit() != 0) {
    std::fprintf(stderr, "shmem_bench: ShmemInit failed (see the log line above)\n");
    return 1;
  }
  int failures = 0;
  try {
    MORI_CHECK(ShmemNPes() == 2, core::ErrorCode::InvalidUsage, "shmem_bench needs exactly 2 PEs, got %d", ShmemNPes());
    core::PreloadKernels(PutBwKernel, PutBwWarpKernel, PingPongKernel, SignalPingPongKernel);
    if (ShmemMyPe() == 0) {
      std::printf("shmem_bench: mori, %s backend, 2 PEs, PE 0 -> PE 1 over %s, heap %zu MiB usable per PE\n",
                  MORI_BACKEND_NAME, TransportTypeName(ShmemTransportType(1)), ShmemHeapBytes() >> 20);
      std::fflush(stdout);
    }
    Bench b(opts);
    failures = b.Run();
  } catch (const core::Error& e) {
    // Out at once, without the collective finalize: the other PE may wait in a barrier, and after a trapped
    // kernel the runtime need not come down cleanly. The launcher ends the job.
    std::fprintf(stderr, "shmem_bench: PE %d: %s\n", ShmemMyPe(), e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (ShmemFinalize() != 0) return 1;
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori::shmem

int main(int argc, char** argv) { return mori::shmem::Main(argc, argv); }
