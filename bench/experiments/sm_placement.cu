// Does the SM placement of put_bw_warp's 32 blocks pick its rate? At 1-2 MiB (32 blocks of 1,024 threads, each
// warp copying its 1-2 KiB slice again and again) both mori and NVSHMEM land on one of two rates run by run,
// about 1,600-1,700 and 1,800-1,890 GB/s on an H200 (docs/PERF.md, 2026-12-03). The copy is bound by L1/TEX
// throughput; an SM pair of one TPC shares some of the path to L2, so 32 blocks on 16 TPCs may copy slower than on
// 32. Here the benchmark's copy (mori::core::CopyVectors per warp) records each block's %smid and its cycles,
// launch after launch:
//   plain    the copy launched `launches` times back to back; the first two launches' blocks are listed in index
//            order with their SM and cycles, which shows whether the blocks that share a TPC are the slow ones
//            and whether a block keeps its SM from launch to launch (each block copies its own part of the data)
//   shifted  before each copy, a short kernel of 1..7 blocks (a different count each time), which moves where
//            the next grid's blocks start
//   pages    (third argument `pages`) the same copy between 8 source and 8 target 2 MiB pages of one allocation,
//            every pair `launches` times in rounds, a round visiting the pairs in a new order: if the two rates
//            belong to where the buffers lie in physical memory (which a process cannot choose or see), each pair
//            keeps one rate round after round and the pairs differ; if not, the rates move within a pair
// Per launch: GB/s of size x iters, how many SMs and TPCs (smid / 2) the 32 blocks used, the most blocks on one
// TPC, and the spread of the blocks' cycles. The destination is checked word by word after every launch.
// Not part of the build:
//   nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -Iinclude -Ibuild-cuda/include \
//     -o sm_placement bench/experiments/sm_placement.cu && ./sm_placement [size_kib] [launches] [pages]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
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

struct Launcher {
  size_t size;
  int iters;
  unsigned* smids;
  long long* cycles;
  unsigned long long* bad;
  cudaEvent_t e0, e1;

  // One timed copy of `size` bytes `iters` times, checked; the blocks' SMs and cycles come back in id / cy.
  double Run(Vec16* dst, const Vec16* src, std::vector<unsigned>& id, std::vector<long long>& cy) {
    CHECK(cudaEventRecord(e0));
    WarpCopy<<<kBlocks, 1024>>>(dst, src, size, iters, smids, cycles);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    const unsigned long long h = Mismatches(src, dst, size, bad);
    if (h != 0) {
      std::printf("MISMATCH: %llu words\n", h);
      std::exit(1);
    }
    id.resize(kBlocks);
    cy.resize(kBlocks);
    CHECK(cudaMemcpy(id.data(), smids, kBlocks * sizeof(unsigned), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(cy.data(), cycles, kBlocks * sizeof(long long), cudaMemcpyDeviceToHost));
    return static_cast<double>(size) * iters / (ms * 1e-3) / 1e9;
  }
};

// Every pair of 8 source and 8 target pages, `rounds` times, each round in a new order.
void Pages(Launcher& l, int rounds) {
  constexpr size_t kPage = size_t(2) << 20;
  constexpr int kSide = 8;
  if (l.size > kPage) {
    std::printf("sm_placement pages: the size must fit in a 2 MiB page\n");
    std::exit(2);
  }
  char* pool;
  CHECK(cudaMalloc(&pool, 2 * kSide * kPage + kPage));
  // cudaMalloc aligns this large an allocation to 2 MiB; round up in case it does not.
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(pool) + kPage - 1) & ~(kPage - 1));
  auto src = [&](int i) { return reinterpret_cast<Vec16*>(base + i * kPage); };
  auto dst = [&](int j) { return reinterpret_cast<Vec16*>(base + (kSide + j) * kPage); };
  std::vector<std::vector<std::vector<double>>> rate(kSide, std::vector<std::vector<double>>(kSide));
  std::vector<int> order(kSide * kSide);
  for (int k = 0; k < kSide * kSide; ++k) order[k] = k;
  std::srand(12345);
  std::vector<unsigned> id;
  std::vector<long long> cy;
  Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(src(0)), l.size / 4, 0xffffu);
  l.Run(dst(0), src(0), id, cy);  // warm-up
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < kSide; ++i) Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(src(i)), l.size / 4, 0x1000u * r + i);
    for (int k = kSide * kSide - 1; k > 0; --k) std::swap(order[k], order[std::rand() % (k + 1)]);
    for (int k : order) rate[k / kSide][k % kSide].push_back(l.Run(dst(k % kSide), src(k / kSide), id, cy));
  }
  std::printf("GB/s of each source page (row) to each target page (column): lowest-highest of %d rounds\n", rounds);
  std::printf("        ");
  for (int j = 0; j < kSide; ++j) std::printf("      dst %d", j);
  std::printf("\n");
  double within = 0;
  std::vector<double> medians;
  for (int i = 0; i < kSide; ++i) {
    std::printf("src %d   ", i);
    for (int j = 0; j < kSide; ++j) {
      std::vector<double> v = rate[i][j];
      std::sort(v.begin(), v.end());
      within = std::max(within, v.back() - v.front());
      medians.push_back(v[v.size() / 2]);
      std::printf("  %4.0f-%4.0f", v.front(), v.back());
    }
    std::printf("\n");
  }
  std::sort(medians.begin(), medians.end());
  std::printf("pair medians %.0f-%.0f GB/s (quartiles %.0f / %.0f / %.0f); the widest spread within one pair %.0f GB/s\n",
              medians.front(), medians.back(), medians[medians.size() / 4], medians[medians.size() / 2],
              medians[3 * medians.size() / 4], within);
  CHECK(cudaFree(pool));
}

int main(int argc, char** argv) {
  const size_t size = size_t(argc > 1 ? std::atoi(argv[1]) : 1024) << 10;
  const int launches = argc > 2 ? std::atoi(argv[2]) : 24;
  const bool pages = argc > 3 && std::string(argv[3]) == "pages";
  if (size == 0 || size % (size_t(kBlocks) * 32 * 16) != 0 || launches <= 0) {
    std::printf("sm_placement: the size must split into %d x 32 whole 16-byte slices, launches > 0\n", kBlocks);
    return 2;
  }
  Launcher l{size, 1000};
  unsigned* sink;
  CHECK(cudaMalloc(&l.smids, kBlocks * sizeof(unsigned)));
  CHECK(cudaMalloc(&l.cycles, kBlocks * sizeof(long long)));
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK(cudaMalloc(&l.bad, sizeof(*l.bad)));
  CHECK(cudaEventCreate(&l.e0));
  CHECK(cudaEventCreate(&l.e1));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("%zu KiB, %d blocks of 1,024 threads, %d calls per launch, %d SMs visible\n", size >> 10, kBlocks,
              l.iters, sms);
  if (pages) {
    Pages(l, launches);
    return 0;
  }
  Vec16 *src, *dst;
  CHECK(cudaMalloc(&src, size));
  CHECK(cudaMalloc(&dst, size));
  Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(src), size / 4, 0x1234u);
  WarpCopy<<<kBlocks, 1024>>>(dst, src, size, 20, l.smids, l.cycles);  // warm-up
  std::vector<unsigned> id;
  std::vector<long long> cy;
  for (const char* mode : {"plain", "shifted"}) {
    for (int n = 0; n < launches; ++n) {
      const int nudge = 1 + n % 7;
      if (mode[0] == 's') Nudge<<<nudge, 32>>>(sink);
      CHECK(cudaMemset(dst, 0, size));
      const double gbps = l.Run(dst, src, id, cy);
      std::map<unsigned, int> perSm, perTpc;
      for (unsigned s : id) {
        ++perSm[s];
        ++perTpc[s / 2];
      }
      int maxTpc = 0;
      for (auto& [t, c] : perTpc) maxTpc = std::max(maxTpc, c);
      std::vector<long long> sorted = cy;
      std::sort(sorted.begin(), sorted.end());
      std::vector<unsigned> ids = id;
      std::sort(ids.begin(), ids.end());
      std::printf(
          "%-7s %2d nudge %d: %6.0f GB/s, %2zu SMs, %2zu TPCs (at most %d blocks on one), block kcycles %lld / "
          "%lld / %lld, SMs",
          mode, n, mode[0] == 's' ? nudge : 0, gbps, perSm.size(), perTpc.size(), maxTpc, sorted.front() / 1000,
          sorted[kBlocks / 2] / 1000, sorted.back() / 1000);
      for (unsigned s : ids) std::printf(" %u", s);
      std::printf("\n");
      if (n < 2 && mode[0] == 'p') {
        std::printf("  blocks in index order (SM:kcycles, * where two blocks share the TPC):");
        for (int b = 0; b < kBlocks; ++b) std::printf(" %u:%lld%s", id[b], cy[b] / 1000, perTpc[id[b] / 2] > 1 ? "*" : "");
        std::printf("\n");
      }
    }
  }
  return 0;
}
