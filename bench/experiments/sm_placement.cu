// Does the SM placement of put_bw_warp's 32 blocks pick its rate? At 1-2 MiB (32 blocks of 1,024 threads, each
// warp copying its 1-2 KiB slice again and again) both mori and NVSHMEM land on one of two rates run by run,
// about 1,600-1,700 and 1,800-1,890 GB/s on an H200 (docs/PERF.md, 2026-12-03). The copy is bound by L1/TEX
// throughput; an SM pair of one TPC shares some of the path to L2, so 32 blocks on 16 TPCs may copy slower than on
// 32. Here the benchmark's copy (mori::core::CopyVectors per warp) records each block's %smid and its cycles,
// launch after launch:
//   plain    the copy launched `launches` times back to back
//   shifted  before each copy, a short kernel of 1..7 blocks (a different count each time), which moves where
//            the next grid's blocks start
// Per launch: GB/s of size x iters, how many SMs and TPCs (smid / 2) the 32 blocks used, the most blocks on one
// TPC, and the spread of the blocks' cycles. The destination is checked word by word after every launch.
// Not part of the build:
//   nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -Iinclude -Ibuild-cuda/include \
//     -o sm_placement bench/experiments/sm_placement.cu && ./sm_placement [size_kib] [launches]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "copy_check.cuh"
#include "mori/core/copy.hpp"

using mori::core::Vec16;

constexpr int kBlocks = 32;

__global__ void __launch_bounds__(1024)
    WarpCopy(Vec16* dst, const Vec16* src, size_t size, int iters, unsigned* smids, long long* cycles) {
  const uint32_t groups = gridDim.x * (blockDim.x / 32);
  const uint32_t group = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const size_t per = size / 16 / groups;  // the sizes here divide evenly
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
    mori::core::CopyVectors<uint32_t>(dst + group * per, src + group * per, static_cast<uint32_t>(per),
                                      threadIdx.x % 32, 32);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    smids[blockIdx.x] = id;
    cycles[blockIdx.x] = clock64() - t0;
  }
}

// A short kernel of a few blocks between copies.
__global__ void Nudge(unsigned* sink) {
  if (threadIdx.x == 0) atomicAdd(sink, 1u);
}

int main(int argc, char** argv) {
  const size_t size = size_t(argc > 1 ? std::atoi(argv[1]) : 1024) << 10;
  const int launches = argc > 2 ? std::atoi(argv[2]) : 24;
  if (size == 0 || size % (size_t(kBlocks) * 32 * 16) != 0 || launches <= 0) {
    std::printf("sm_placement: the size must split into %d x 32 whole 16-byte slices, launches > 0\n", kBlocks);
    return 2;
  }
  const int iters = 1000;
  Vec16 *src, *dst;
  unsigned *smids, *sink;
  long long* cycles;
  unsigned long long* bad;
  CHECK(cudaMalloc(&src, size));
  CHECK(cudaMalloc(&dst, size));
  CHECK(cudaMalloc(&smids, kBlocks * sizeof(unsigned)));
  CHECK(cudaMalloc(&cycles, kBlocks * sizeof(long long)));
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK(cudaMalloc(&bad, sizeof(*bad)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("%zu KiB, %d blocks of 1,024 threads, %d calls per launch, %d SMs visible\n", size >> 10, kBlocks, iters,
              sms);
  Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(src), size / 4, 0x1234u);
  WarpCopy<<<kBlocks, 1024>>>(dst, src, size, 20, smids, cycles);  // warm-up
  for (const char* mode : {"plain", "shifted"}) {
    for (int l = 0; l < launches; ++l) {
      const int nudge = 1 + l % 7;
      if (mode[0] == 's') Nudge<<<nudge, 32>>>(sink);
      CHECK(cudaMemset(dst, 0, size));
      CHECK(cudaEventRecord(e0));
      WarpCopy<<<kBlocks, 1024>>>(dst, src, size, iters, smids, cycles);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      const unsigned long long h = Mismatches(src, dst, size, bad);
      if (h != 0) {
        std::printf("MISMATCH: %llu words after launch %d (%s)\n", h, l, mode);
        return 1;
      }
      std::vector<unsigned> id(kBlocks);
      std::vector<long long> cy(kBlocks);
      CHECK(cudaMemcpy(id.data(), smids, kBlocks * sizeof(unsigned), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(cy.data(), cycles, kBlocks * sizeof(long long), cudaMemcpyDeviceToHost));
      std::map<unsigned, int> perSm, perTpc;
      for (unsigned s : id) {
        ++perSm[s];
        ++perTpc[s / 2];
      }
      int maxTpc = 0;
      for (auto& [t, n] : perTpc) maxTpc = std::max(maxTpc, n);
      std::vector<long long> sorted = cy;
      std::sort(sorted.begin(), sorted.end());
      std::vector<unsigned> ids = id;
      std::sort(ids.begin(), ids.end());
      std::printf(
          "%-7s %2d nudge %d: %6.0f GB/s, %2zu SMs, %2zu TPCs (at most %d blocks on one), block kcycles %lld / "
          "%lld / %lld, SMs",
          mode, l, mode[0] == 's' ? nudge : 0, static_cast<double>(size) * iters / (ms * 1e-3) / 1e9, perSm.size(),
          perTpc.size(), maxTpc, sorted.front() / 1000, sorted[kBlocks / 2] / 1000, sorted.back() / 1000);
      for (unsigned s : ids) std::printf(" %u", s);
      std::printf("\n");
    }
  }
  return 0;
}
