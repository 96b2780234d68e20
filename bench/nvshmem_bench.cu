// nvshmem_bench: shmem_bench's three measurements written against NVSHMEM, for a side-by-side run on the same
// machine: the same kernels call by call (nvshmemx_putmem_nbi_block, nvshmem_uint64_p + wait_until,
// nvshmem[x]_putmem_signal_nbi[_block] + nvshmem_signal_wait_until), the same options, the same output
// lines and CSV rows (impl=nvshmem). Built only on the CUDA backend when CMake finds NVSHMEM.
//
//   mpirun -np 2 -x LD_LIBRARY_PATH=$NVSHMEM/lib -x NVSHMEM_DISABLE_NVLS=1 -x NVSHMEM_REMOTE_TRANSPORT=none
//       ./nvshmem_bench [put_bw|p_latency|signal_latency|all] [shmem_bench's options]
//
// NVSHMEM starts from a unique id that rank 0 broadcasts over MPI (no MPI bootstrap plugin needed); each
// rank takes the GPU of its node-local rank first.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "shmem_bench_common.hpp"

namespace {

namespace bench = mori::bench;

constexpr bench::Machine kMachine{false};
constexpr int kMaxThreadsPerBlock = 1024;

[[noreturn]] void Fail(const std::string& what) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "nvshmem_bench: rank %d: %s\n", rank, what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void CheckCuda(cudaError_t e, const char* call, int line) {
  if (e != cudaSuccess)
    Fail(std::string(call) + " failed: " + cudaGetErrorString(e) + " (line " + std::to_string(line) + ")");
}

#define MORI_BENCH_CUDA(call) CheckCuda((call), #call, __LINE__)

// Block b puts its 16-byte aligned slice of [0, size) `iters` times (as shmem_bench's PutBwKernel).
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    PutBwKernel(uint8_t* dst, const uint8_t* src, size_t size, int iters, int pe) {
  size_t begin = 0, bytes = 0;
  bench::SliceOf(size, gridDim.x, blockIdx.x, &begin, &bytes);
  if (bytes > 0) {
    for (int i = 0; i < iters; ++i) nvshmemx_putmem_nbi_block(dst + begin, src + begin, bytes, pe);
  }
  nvshmem_quiet();
}

// Every warp puts its slice (as shmem_bench's PutBwWarpKernel).
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    PutBwWarpKernel(uint8_t* dst, const uint8_t* src, size_t size, int iters, int pe) {
  const size_t warpsPerBlock = (blockDim.x + 31) / 32;
  size_t begin = 0, bytes = 0;
  bench::SliceOf(size, gridDim.x * warpsPerBlock, blockIdx.x * warpsPerBlock + threadIdx.x / 32, &begin, &bytes);
  if (bytes > 0) {
    for (int i = 0; i < iters; ++i) nvshmemx_putmem_nbi_warp(dst + begin, src + begin, bytes, pe);
  }
  nvshmem_quiet();
}

__global__ void PingPongKernel(uint64_t* flag, uint64_t base, int iters, int me) {
  const int peer = 1 - me;
  for (int i = 1; i <= iters; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (me == 0) {
      nvshmem_uint64_p(flag, v, peer);
      nvshmem_uint64_wait_until(flag, NVSHMEM_CMP_EQ, v);
    } else {
      nvshmem_uint64_wait_until(flag, NVSHMEM_CMP_EQ, v);
      nvshmem_uint64_p(flag, v, peer);
    }
  }
  nvshmem_quiet();
}

__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    SignalPingPongKernel(int scope, uint8_t* buf, const uint8_t* src, size_t bytes, uint64_t* sig, uint64_t base,
                         int iters, int me) {
  const int peer = 1 - me;
  const bool leader = threadIdx.x == 0;
  for (int i = 1; i <= iters; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (me == 1) {
      if (leader) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, v);
      if (scope != bench::kScopeThread) __syncthreads();
    }
    if (scope == bench::kScopeBlock) {
      nvshmemx_putmem_signal_nbi_block(buf, src, bytes, sig, v, NVSHMEM_SIGNAL_SET, peer);
    } else if (scope == bench::kScopeWarp) {
      nvshmemx_putmem_signal_nbi_warp(buf, src, bytes, sig, v, NVSHMEM_SIGNAL_SET, peer);
    } else {
      nvshmem_putmem_signal_nbi(buf, src, bytes, sig, v, NVSHMEM_SIGNAL_SET, peer);
    }
    if (me == 0) {
      if (leader) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, v);
      if (scope != bench::kScopeThread) __syncthreads();
    }
  }
  nvshmem_quiet();
}

class Bench {
 public:
  explicit Bench(const bench::Options& o) : opts_(o), me_(nvshmem_my_pe()) {
    MORI_BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MORI_BENCH_CUDA(cudaEventCreate(&start_));
    MORI_BENCH_CUDA(cudaEventCreate(&stop_));
  }
  ~Bench() {
    cudaEventDestroy(stop_);
    cudaEventDestroy(start_);
    cudaStreamDestroy(stream_);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

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
  void Barrier() {
    MORI_BENCH_CUDA(cudaStreamSynchronize(stream_));
    nvshmem_barrier_all();
  }

  template <typename Launch>
  double TimeMs(Launch&& launch) {
    MORI_BENCH_CUDA(cudaEventRecord(start_, stream_));
    launch();
    MORI_BENCH_CUDA(cudaGetLastError());
    MORI_BENCH_CUDA(cudaEventRecord(stop_, stream_));
    MORI_BENCH_CUDA(cudaEventSynchronize(stop_));
    MORI_BENCH_CUDA(cudaStreamSynchronize(stream_));
    float ms = 0;
    MORI_BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

  template <typename T>
  T* Alloc(size_t bytes, bool zero, size_t alignment = 0) {
    void* p = alignment != 0 ? nvshmem_align(alignment, bytes) : nvshmem_malloc(bytes);
    if (p == nullptr) {
      Fail(std::string(alignment != 0 ? "nvshmem_align(" + std::to_string(alignment) + ", " : "nvshmem_malloc(") +
           std::to_string(bytes) + ") failed: raise NVSHMEM_SYMMETRIC_SIZE (put_bw needs 2 x --max and a little)");
    }
    if (zero) MORI_BENCH_CUDA(cudaMemset(p, 0, bytes));
    return static_cast<T*>(p);
  }

  // put_bw's target, read from its allocation's start: zeros for the offset, PE 0's pattern for `bytes`, zeros
  // for bench::kTargetTail bytes after.
  void CheckTarget(const std::string& what, const uint8_t* base, size_t bytes) {
    std::vector<uint8_t> got(bench::TargetCheckBytes(opts_, bytes));
    MORI_BENCH_CUDA(cudaMemcpy(got.data(), base, got.size(), cudaMemcpyDeviceToHost));
    if (!bench::TargetIsRight("nvshmem_bench", me_, what, got, opts_, bytes)) ++failures_;
  }

  void Check(const std::string& what, const uint8_t* p, size_t bytes, const std::vector<uint8_t>& expect, int pe) {
    std::vector<uint8_t> got(bytes);
    MORI_BENCH_CUDA(cudaMemcpy(got.data(), p, bytes, cudaMemcpyDeviceToHost));
    if (std::memcmp(got.data(), expect.data(), bytes) == 0) return;
    size_t at = bench::FirstMismatch(got, pe);
    std::fprintf(stderr, "nvshmem_bench: PE %d: %s: %zu-byte message from PE %d wrong at byte %zu (got %u, want %u)\n",
                 me_, what.c_str(), bytes, pe, at, got[at], expect[at]);
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
    if (me_ == 0) MORI_BENCH_CUDA(cudaMemcpy(src, pattern.data(), max, cudaMemcpyHostToDevice));
    const int reps = bench::PutBwReps(opts_, kMachine);
    for (size_t size : bench::PutSizes(opts_)) {
      const int iters = bench::PutBwIters(opts_, kMachine, size);
      const int warmup = bench::WarmupIters(opts_, iters);
      const std::vector<size_t> places = bench::PutPlaces(opts_, size);
      for (unsigned blocks : opts_.blocks) {
        if (me_ == 1) MORI_BENCH_CUDA(cudaMemsetAsync(dst, 0, bench::TargetSpan(opts_, size), stream_));
        Barrier();
        if (me_ == 0) {
          // At each place: a warm-up, then the fastest of the timed runs.
          std::vector<double> each;
          const double gbps = bench::MedianOverPlaces(places, [&](size_t place) {
            auto launch = [&](int n) {
              (warpScope ? PutBwWarpKernel : PutBwKernel)<<<blocks, opts_.threads, 0, stream_>>>(dst + place,
                                                                                                 src + place, size, n, 1);
            };
            if (warmup > 0) TimeMs([&] { launch(warmup); });
            double ms = bench::FastestMs(reps, [&] { return TimeMs([&] { launch(iters); }); });
            return static_cast<double>(size) * iters / (ms * 1e-3) / 1e9;
          }, &each);
          report_.Add(name, size, blocks, iters, gbps, "GBps");
          bench::PrintPlaces(name, size, blocks, each);
        }
        Barrier();
        if (me_ == 1) CheckTarget(std::string(name) + " blocks=" + std::to_string(blocks), dstBase, size);
      }
    }
    if (me_ == 0) {
      report_.PrintPutBwTable(opts_, name,
                              std::string(warpScope ? "warp" : "block") + " scope, " + std::to_string(opts_.threads) +
                                  " threads per block, to PE 1 " +
                                  (nvshmem_ptr(dst, 1) != nullptr ? "over P2P" : "not load/store mapped") +
                                  ", " + bench::RunsNote(opts_, reps) +
                                  bench::OffsetsNote(opts_) + "; " + bench::PlacementNote(src, dst));
    }
    Barrier();
    nvshmem_free(dstBase);
    nvshmem_free(srcBase);
  }

  template <typename Launch>
  double PingPong(uint64_t& seq, int iters, Launch&& launch) {
    Barrier();
    double ms = TimeMs([&] { launch(seq, iters); });
    seq += static_cast<uint64_t>(iters);
    return me_ == 0 ? ms : 0;
  }

  void PLatency() {
    auto* flag = Alloc<uint64_t>(sizeof(uint64_t), true);
    const int iters = bench::LatencyIters(opts_, kMachine, sizeof(uint64_t));
    const int warmup = bench::WarmupIters(opts_, iters);
    auto launch = [&](uint64_t base, int n) { PingPongKernel<<<1, 1, 0, stream_>>>(flag, base, n, me_); };
    uint64_t seq = 0;
    if (warmup > 0) PingPong(seq, warmup, launch);
    double ms = PingPong(seq, iters, launch);
    uint64_t last = 0;
    MORI_BENCH_CUDA(cudaMemcpy(&last, flag, sizeof(last), cudaMemcpyDeviceToHost));
    if (last != seq) {
      std::fprintf(stderr, "nvshmem_bench: PE %d: p_latency: flag holds %llu after the run, want %llu\n", me_,
                   static_cast<unsigned long long>(last), static_cast<unsigned long long>(seq));
      ++failures_;
    }
    if (me_ == 0) report_.Add(bench::kPLatency, sizeof(uint64_t), 1, iters, ms * 1e3 / iters / 2, "us");
    Barrier();
    nvshmem_free(flag);
  }

  void SignalLatency() {
    const std::vector<size_t> sizes = bench::SignalSizes();
    const size_t max = *std::max_element(sizes.begin(), sizes.end());
    auto* buf = Alloc<uint8_t>(max, false);
    auto* src = Alloc<uint8_t>(max, false);
    auto* sig = Alloc<uint64_t>(sizeof(uint64_t), true);
    const std::vector<uint8_t> mine = bench::Pattern(me_, max);
    const std::vector<uint8_t> theirs = bench::Pattern(1 - me_, max);
    MORI_BENCH_CUDA(cudaMemcpy(src, mine.data(), max, cudaMemcpyHostToDevice));
    uint64_t seq = 0;
    for (size_t size : sizes) {
      const int iters = bench::LatencyIters(opts_, kMachine, size);
      const int warmup = bench::WarmupIters(opts_, iters);
      for (int scope : {bench::kScopeThread, bench::kScopeWarp, bench::kScopeBlock}) {
        MORI_BENCH_CUDA(cudaMemsetAsync(buf, 0, size, stream_));
        const unsigned threads = scope == bench::kScopeBlock  ? opts_.signalThreads
                                 : scope == bench::kScopeWarp ? 32
                                                              : 1;
        auto launch = [&](uint64_t base, int n) {
          SignalPingPongKernel<<<1, threads, 0, stream_>>>(scope, buf, src, size, sig, base, n, me_);
        };
        if (warmup > 0) PingPong(seq, warmup, launch);
        double ms = PingPong(seq, iters, launch);
        const char* name = bench::SignalBenchName(scope);
        Check(name, buf, size, theirs, 1 - me_);
        if (me_ == 0) report_.Add(name, size, 1, iters, ms * 1e3 / iters / 2, "us");
      }
    }
    Barrier();
    nvshmem_free(sig);
    nvshmem_free(src);
    nvshmem_free(buf);
  }

  bench::Options opts_;
  int me_;
  cudaStream_t stream_{};
  cudaEvent_t start_{}, stop_{};
  bench::Report report_{"nvshmem"};
  int failures_ = 0;
};

void InitNvshmem() {
  int rank = 0, nranks = 0, localRank = 0, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &localRank);
  MPI_Comm_free(&node);
  MORI_BENCH_CUDA(cudaGetDeviceCount(&devices));
  if (devices == 0) Fail("no GPU visible");
  MORI_BENCH_CUDA(cudaSetDevice(localRank % devices));  // NVSHMEM takes the current device at init

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (rank == 0 && nvshmemx_get_uniqueid(&id) != 0) Fail("nvshmemx_get_uniqueid failed");
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) != 0) Fail("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) Fail("nvshmemx_init_attr failed");
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opts = bench::ParseOptions(argc, argv, kMachine);
  if (opts.threads > kMaxThreadsPerBlock || opts.signalThreads > kMaxThreadsPerBlock) {
    bench::UsageError("--threads and --signal-threads take at most " + std::to_string(kMaxThreadsPerBlock));
  }
  MPI_Init(&argc, &argv);
  InitNvshmem();
  if (nvshmem_n_pes() != 2) Fail("nvshmem_bench needs exactly 2 PEs, got " + std::to_string(nvshmem_n_pes()));
  if (nvshmem_my_pe() == 0) {
    std::printf("nvshmem_bench: NVSHMEM %d.%d.%d (headers), 2 PEs, PE 0 -> PE 1\n", NVSHMEM_VENDOR_MAJOR_VERSION,
                NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION);
    std::fflush(stdout);
  }
  int failures = 0;
  {
    Bench b(opts);
    failures = b.Run();
  }
  nvshmem_finalize();
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
