// shmem_matrix: every ordered pair of PEs, one pair at a time while the others wait: put bandwidth from PE i
// to PE j (block scope, `blocks` blocks put SIZE bytes `iters` times, then quiet) and single-value ping-pong
// latency between i and j (half a round trip). PE 0 prints both matrices and, with --csv, writes rows
// `metric,from,to,value,unit` (scripts/plot_matrix.py draws them). Every put is checked at its target.
//
//   mpirun -np N ./shmem_matrix [--size 64m] [--blocks 32] [--threads 1024] [--iters N] [--pp-iters N]
//                               [--csv FILE]
// HOST backend defaults: --size 1m --blocks 2 --threads 4 (every GPU thread is an OS thread there).
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

constexpr bool kHost = MORI_BACKEND_HOST != 0;

struct MatrixOptions {
  size_t size = kHost ? (size_t(1) << 20) : (size_t(64) << 20);
  unsigned blocks = kHost ? 2 : 32;
  unsigned threads = kHost ? 4 : 1024;
  int iters = kHost ? 4 : 20;
  int ppIters = kHost ? 200 : 2000;
  std::string csv;
};

[[noreturn]] void Usage(const std::string& what) {
  std::fprintf(stderr,
               "%s\nusage: mpirun -np N shmem_matrix [--size 64m] [--blocks 32] [--threads 1024] [--iters N] "
               "[--pp-iters N] [--csv FILE]\n",
               what.c_str());
  std::exit(2);
}

MatrixOptions Parse(int argc, char** argv) {
  MatrixOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) Usage(a + " needs a value");
    std::string v = argv[++i];
    if (a == "--size") {
      o.size = bench::ParseSize(v);
    } else if (a == "--blocks") {
      o.blocks = static_cast<unsigned>(bench::ParsePositive(v, "--blocks"));
    } else if (a == "--threads") {
      o.threads = static_cast<unsigned>(bench::ParsePositive(v, "--threads"));
    } else if (a == "--iters") {
      o.iters = static_cast<int>(bench::ParsePositive(v, "--iters"));
    } else if (a == "--pp-iters") {
      o.ppIters = static_cast<int>(bench::ParsePositive(v, "--pp-iters"));
    } else if (a == "--csv") {
      o.csv = v;
    } else {
      Usage("unknown option " + a);
    }
  }
  if (o.size == 0 || o.size % 16 != 0) Usage("--size must be a positive multiple of 16");
  return o;
}

// Block b puts its slice of [0, size) `iters` times; the slices cover [0, size) once.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(1024)
    PairPutKernel(uint8_t* dst, const uint8_t* src, size_t size, int iters, int pe) {
  const size_t blocks = core::FlatGridDim();
  const size_t slice = ((size + blocks - 1) / blocks + 15) / 16 * 16;
  const size_t begin = slice * core::FlatBlockIdx() < size ? slice * core::FlatBlockIdx() : size;
  const size_t bytes = size - begin < slice ? size - begin : slice;
  if (bytes > 0) {
    for (int i = 0; i < iters; ++i) ShmemPutMemNbiBlock(dst + begin, src + begin, bytes, pe);
  }
  ShmemQuietThread();
}

// Values base + 1 .. base + iters travel initiator -> partner -> initiator through one symmetric word.
MORI_GLOBAL void PairPingPongKernel(uint64_t* flag, uint64_t base, int iters, int initiator, int partner) {
  const int me = ShmemMyPe();
  const int peer = me == initiator ? partner : initiator;
  for (int i = 1; i <= iters; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (me == initiator) {
      ShmemPutTypeImmNbiThread<uint64_t>(flag, v, peer);
      ShmemWaitUntil<uint64_t>(flag, CmpOp::EQ, v);
    } else {
      ShmemWaitUntil<uint64_t>(flag, CmpOp::EQ, v);
      ShmemPutTypeImmNbiThread<uint64_t>(flag, v, peer);
    }
  }
  ShmemQuietThread();
}

// Stores one measurement (a double's bits) in PE 0's result table.
MORI_GLOBAL void ReportKernel(uint64_t* table, size_t index, uint64_t bits) {
  ShmemPutTypeImmNbiThread<uint64_t>(table + index, bits, 0);
  ShmemQuietThread();
}

// Byte k of the message PE `from` sends PE `to`.
uint8_t PairByte(int from, int to, size_t k) {
  return static_cast<uint8_t>((k * 131u + static_cast<size_t>(from) * 29u + static_cast<size_t>(to) * 7u + 3u) & 0xff);
}

class Matrix {
 public:
  explicit Matrix(const MatrixOptions& o) : o_(o), me_(ShmemMyPe()), n_(ShmemNPes()) {
    src_ = bench::SymmetricAlloc<uint8_t>(o.size, false);
    dst_ = bench::SymmetricAlloc<uint8_t>(o.size, false);
    flag_ = static_cast<uint64_t*>(ShmemCalloc(1, sizeof(uint64_t)));
    table_ = static_cast<uint64_t*>(ShmemCalloc(static_cast<size_t>(2 * n_ * n_), sizeof(uint64_t)));
    MORI_CHECK(flag_ != nullptr && table_ != nullptr, core::ErrorCode::InvalidUsage, "the heap is full");
  }
  ~Matrix() {
    ShmemFree(table_);
    ShmemFree(flag_);
    ShmemFree(dst_);
    ShmemFree(src_);
  }
  Matrix(const Matrix&) = delete;
  Matrix& operator=(const Matrix&) = delete;

  int Run() {
    for (int from = 0; from < n_; ++from) {
      for (int to = 0; to < n_; ++to) {
        if (from != to) Pair(from, to);
      }
    }
    timer_.Barrier();
    if (me_ != 0) return failures_;
    std::vector<uint64_t> bits(static_cast<size_t>(2 * n_ * n_));
    MORI_CHECK_GPU(core::GpuMemcpy(bits.data(), table_, bits.size() * sizeof(uint64_t)));
    std::vector<double> values(bits.size());
    std::memcpy(values.data(), bits.data(), bits.size() * sizeof(double));
    Print("put bandwidth, GB/s (row: from, column: to; " + std::to_string(o_.size >> 20) + " MiB, " +
              std::to_string(o_.blocks) + " blocks x " + std::to_string(o_.threads) + " threads)",
          values.data(), "%8.1f");
    Print("single-value put ping-pong, half round trip in us (row: initiator)", values.data() + n_ * n_, "%8.2f");
    if (!o_.csv.empty()) WriteCsv(values);
    return failures_;
  }

 private:
  void Report(size_t index, double value) {
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    core::LaunchKernel(ReportKernel, Dim3(1), Dim3(1), 0, timer_.Stream(), table_, index, bits);
    MORI_CHECK_GPU(core::GpuStreamSynchronize(timer_.Stream()));
  }

  void Pair(int from, int to) {
    const size_t cell = static_cast<size_t>(from * n_ + to);
    // Bandwidth: the source carries this pair's bytes, the target's buffer is cleared first.
    if (me_ == from) {
      std::vector<uint8_t> bytes(o_.size);
      for (size_t k = 0; k < o_.size; ++k) bytes[k] = PairByte(from, to, k);
      MORI_CHECK_GPU(core::GpuMemcpy(src_, bytes.data(), o_.size));
    }
    if (me_ == to) MORI_CHECK_GPU(core::GpuMemsetAsync(dst_, 0, o_.size, timer_.Stream()));
    timer_.Barrier();
    if (me_ == from) {
      auto launch = [&](int iters) {
        core::LaunchKernel(PairPutKernel, Dim3(o_.blocks), Dim3(o_.threads), 0, timer_.Stream(), dst_,
                           static_cast<const uint8_t*>(src_), o_.size, iters, to);
      };
      timer_.TimeMs([&] { launch(1); });
      double ms = timer_.TimeMs([&] { launch(o_.iters); });
      Report(cell, static_cast<double>(o_.size) * o_.iters / (ms * 1e-3) / 1e9);
    }
    timer_.Barrier();
    if (me_ == to) {
      std::vector<uint8_t> got(o_.size);
      MORI_CHECK_GPU(core::GpuMemcpy(got.data(), dst_, o_.size));
      for (size_t k = 0; k < o_.size; ++k) {
        if (got[k] != PairByte(from, to, k)) {
          std::fprintf(stderr, "shmem_matrix: PE %d: the put from PE %d is wrong at byte %zu (got %u, want %u)\n",
                       me_, from, k, got[k], PairByte(from, to, k));
          ++failures_;
          break;
        }
      }
    }
    // Latency: both PEs of the pair count the same values, so the flag never needs a reset.
    if (me_ == from || me_ == to) {
      auto launch = [&](int iters) {
        core::LaunchKernel(PairPingPongKernel, Dim3(1), Dim3(1), 0, timer_.Stream(), flag_, seq_, iters, from, to);
        seq_ += static_cast<uint64_t>(iters);
      };
      timer_.Barrier();
      timer_.TimeMs([&] { launch(o_.ppIters / 10 + 1); });
      double ms = timer_.TimeMs([&] { launch(o_.ppIters); });
      if (me_ == from) Report(static_cast<size_t>(n_ * n_) + cell, ms * 1e3 / o_.ppIters / 2);
    } else {
      seq_ += static_cast<uint64_t>(o_.ppIters / 10 + 1 + o_.ppIters);
      timer_.Barrier();
    }
    timer_.Barrier();
  }

  void Print(const std::string& title, const double* v, const char* fmt) const {
    std::printf("\n%s\n%6s", title.c_str(), "");
    for (int j = 0; j < n_; ++j) std::printf("%8s", ("PE" + std::to_string(j)).c_str());
    std::printf("\n");
    for (int i = 0; i < n_; ++i) {
      std::printf("%6s", ("PE" + std::to_string(i)).c_str());
      for (int j = 0; j < n_; ++j) {
        if (i == j) {
          std::printf("%8s", "-");
        } else {
          std::printf(fmt, v[i * n_ + j]);
        }
      }
      std::printf("\n");
    }
    std::fflush(stdout);
  }

  void WriteCsv(const std::vector<double>& v) {
    FILE* f = std::fopen(o_.csv.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "shmem_matrix: cannot write %s\n", o_.csv.c_str());
      ++failures_;
      return;
    }
    std::fprintf(f, "metric,from,to,value,unit\n");
    for (int i = 0; i < n_; ++i) {
      for (int j = 0; j < n_; ++j) {
        if (i == j) continue;
        std::fprintf(f, "put_bw,%d,%d,%.3f,GBps\n", i, j, v[static_cast<size_t>(i * n_ + j)]);
        std::fprintf(f, "p_latency,%d,%d,%.3f,us\n", i, j, v[static_cast<size_t>(n_ * n_ + i * n_ + j)]);
      }
    }
    std::fclose(f);
  }

  MatrixOptions o_;
  int me_;
  int n_;
  bench::StreamTimer timer_;
  uint8_t* src_ = nullptr;
  uint8_t* dst_ = nullptr;
  uint64_t* flag_ = nullptr;
  uint64_t* table_ = nullptr;
  uint64_t seq_ = 0;
  int failures_ = 0;
};

int Main(int argc, char** argv) {
  const MatrixOptions opts = Parse(argc, argv);
  if (ShmemInit() != 0) {
    std::fprintf(stderr, "shmem_matrix: ShmemInit failed (see the log line above)\n");
    return 1;
  }
  int failures = 0;
  try {
    MORI_CHECK(ShmemNPes() >= 2, core::ErrorCode::InvalidUsage, "shmem_matrix needs at least 2 PEs, got %d",
               ShmemNPes());
    core::PreloadKernels(PairPutKernel, PairPingPongKernel, ReportKernel);
    if (ShmemMyPe() == 0) {
      std::string transports;
      for (int pe = 0; pe < ShmemNPes(); ++pe) {
        transports += (pe ? " " : "") + std::string(TransportTypeName(ShmemTransportType(pe)));
      }
      std::printf("shmem_matrix: mori, %s backend, %d PEs, transports from PE 0 [%s]\n", MORI_BACKEND_NAME,
                  ShmemNPes(), transports.c_str());
      std::fflush(stdout);
    }
    Matrix m(opts);
    failures = m.Run();
  } catch (const core::Error& e) {
    std::fprintf(stderr, "shmem_matrix: PE %d: %s\n", ShmemMyPe(), e.what());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (ShmemFinalize() != 0) return 1;
  if (failures != 0) std::fprintf(stderr, "shmem_matrix: PE %d: %d wrong puts\n", ShmemMyPe(), failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori::shmem

int main(int argc, char** argv) { return mori::shmem::Main(argc, argv); }
