// Why does NVSHMEM's warp put reach 1.86-1.89 TB/s at 1-2 MiB in some whole-job rounds (32 blocks of 1,024
// threads, each warp putting its 1-2 KiB slice again and again), above mori's 1.65-1.79? Its warp copy (SASS of
// nvshmem_bench) is one 16-byte load and one store per lane per pass, one vector in flight; mori's CopyVectors
// issues up to four loads before its stores. Here, in one process, the benchmark's shape without any put around
// it: the grid's warps (or blocks) copy their slices of `size` bytes `iters` times, by
//   mori     mori::core::CopyVectors<uint32_t> (the tree's copy)
//   simple   for (i = lane; i < count; i += 32) d[i] = s[i]  (NVSHMEM's shape)
//   nc       the simple loop with ld.global.nc loads
//   coop     mori::core::CopyCooperative (CopyVectors behind the alignment dispatch a put goes through)
//   +sync    the same after the group's barrier, as a put starts
//   +lookup  the same with the destination's base from a constant-memory peer table, as MappedBase does
// GB/s of `size * iters`, four rounds alternating, every copy checked word by word; or, with `repeat`, one copy
// timed eight times back to back (checked once after). Not part of the build:
//   nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -Iinclude -Ibuild-cuda/include \
//     -o warp_slice_copy bench/experiments/warp_slice_copy.cu && ./warp_slice_copy [blocks] [vary|even|odd|repeat]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "copy_check.cuh"
#include "mori/core/copy.hpp"

using mori::core::Vec16;

enum Variant : int { kMori, kSimple, kNc, kCoop, kCoopSync, kCoopLookup, kVariants };
const char* kNames[kVariants] = {"mori", "simple", "nc", "coop", "+sync", "+lookup"};

// A peer table in constant memory, as mori's mapped window: entry 1 is the destination.
__constant__ uintptr_t gWindow[8];
__constant__ uint32_t gWindowCount;

template <int V>
__device__ __forceinline__ void CopySlice(Vec16* d, const Vec16* s, uint32_t count, uint32_t rank, uint32_t n) {
  if (V == kMori) {
    mori::core::CopyVectors<uint32_t>(d, s, count, rank, n);
  } else if (V == kCoop) {
    mori::core::CopyCooperative(d, s, size_t(count) * 16, rank, n);
  } else if (V == kSimple) {
    for (uint32_t i = rank; i < count; i += n) d[i] = s[i];
  } else {
    for (uint32_t i = rank; i < count; i += n) d[i] = __ldg(&s[i]);
  }
}

// warpScope: every warp copies its own slice (lane of 32); else every block (thread of blockDim).
template <int V>
__global__ void __launch_bounds__(1024) Copy(Vec16* dst, const Vec16* src, size_t size, int iters, bool warpScope) {
  const uint32_t groups = warpScope ? gridDim.x * (blockDim.x / 32) : gridDim.x;
  const uint32_t group = warpScope ? blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  const uint32_t rank = warpScope ? threadIdx.x % 32 : threadIdx.x;
  const uint32_t n = warpScope ? 32 : blockDim.x;
  const size_t vecs = size / 16;
  const size_t per = vecs / groups;  // the sizes here divide evenly
  Vec16* d = dst + group * per;
  const Vec16* s = src + group * per;
  if constexpr (V == kCoopSync || V == kCoopLookup) {
    // What mori's put adds around the copy: the group barrier first; with +lookup, the peer's base from the
    // constant table (an index taken from a kernel argument, as the PE is), then base + offset.
    const int pe = iters >= 0 ? 1 : 0;
    for (int i = 0; i < iters; ++i) {
      if (warpScope) __syncwarp(); else __syncthreads();
      Vec16* to = d;
      if constexpr (V == kCoopLookup) {
        const uint32_t k = static_cast<uint32_t>(pe);
        const uintptr_t base = k < gWindowCount ? gWindow[k] : 0;
        if (base == 0) __trap();
        to = reinterpret_cast<Vec16*>(base) + group * per;
      }
      mori::core::CopyCooperative(to, s, per * 16, rank, n);
    }
  } else {
    for (int i = 0; i < iters; ++i) CopySlice<V>(d, s, static_cast<uint32_t>(per), rank, n);
  }
}

template <int V>
float Time(Vec16* dst, const Vec16* src, size_t size, int blocks, int iters, bool warpScope, cudaEvent_t e0,
           cudaEvent_t e1) {
  Copy<V><<<blocks, 1024>>>(dst, src, size, 20, warpScope);  // warm-up
  CHECK(cudaEventRecord(e0));
  Copy<V><<<blocks, 1024>>>(dst, src, size, iters, warpScope);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  return ms;
}

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 32;
  // mode: the source's salt, "vary" (each run its own, 0x1234 + 7 round + variant) or "even" / "odd" (0x1234 /
  // 0x1235 for every run); or "repeat" (one copy timed eight times, nothing launched between).
  const std::string saltMode = argc > 2 ? argv[2] : "vary";
  if (blocks <= 0 || (size_t(512) << 10) % (size_t(blocks) * 32 * 16) != 0) {
    std::printf("warp_slice_copy: %d blocks of 32 warps do not split 512 KiB into whole vectors\n", blocks);
    return 2;
  }
  const size_t maxSize = size_t(16) << 20;
  Vec16 *src, *dst;
  unsigned long long* bad;
  CHECK(cudaMalloc(&src, maxSize));
  CHECK(cudaMalloc(&dst, maxSize));
  CHECK(cudaMalloc(&bad, sizeof(*bad)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const uintptr_t window[8] = {0, reinterpret_cast<uintptr_t>(dst), 0, 0, 0, 0, 0, 0};
  const uint32_t windowCount = 8;
  CHECK(cudaMemcpyToSymbol(gWindow, window, sizeof(window)));
  CHECK(cudaMemcpyToSymbol(gWindowCount, &windowCount, sizeof(windowCount)));
  std::printf("%d blocks of 1024 threads, %s; GB/s of size x iters\n", blocks, saltMode.c_str());
  if (saltMode == "repeat") {
    // The same copy timed eight times back to back, nothing launched between: does the rate alternate?
    for (bool warpScope : {true, false}) {
      for (size_t size : {size_t(1) << 20, size_t(2) << 20, size_t(4) << 20}) {
        const int iters = static_cast<int>((size_t(4) << 30) / size / 4);
        Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(src), size / 4, 0x1234u);
        std::printf("%-6s %8zuK mori, 8 runs:", warpScope ? "warp" : "block", size >> 10);
        for (int k = 0; k < 8; ++k) {
          CHECK(cudaEventRecord(e0));
          Copy<kMori><<<blocks, 1024>>>(dst, src, size, iters, warpScope);
          CHECK(cudaEventRecord(e1));
          CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK(cudaEventElapsedTime(&ms, e0, e1));
          std::printf(" %6.0f", static_cast<float>(size) * iters / (ms * 1e-3f) / 1e9f);
        }
        const unsigned long long h = Mismatches(src, dst, size, bad);
        if (h != 0) {
          std::printf("  MISMATCH: %llu words\n", h);
          return 1;
        }
        std::printf("\n");
      }
    }
    return 0;
  }
  std::printf("%-6s %9s %8s %8s %8s %8s %8s\n", "scope", "size", "variant", "round 1", "round 2", "round 3", "round 4");
  for (bool warpScope : {true, false}) {
    for (size_t size : {size_t(512) << 10, size_t(1) << 20, size_t(2) << 20, size_t(4) << 20, size_t(16) << 20}) {
      const int iters = static_cast<int>(std::max<size_t>(200, (size_t(4) << 30) / size / 4));
      float gbps[kVariants][4];
      for (int r = 0; r < 4; ++r) {
        for (int v = 0; v < kVariants; ++v) {
          const uint32_t salt = saltMode == "vary" ? 0x1234u + r * 7 + v : saltMode == "odd" ? 0x1235u : 0x1234u;
          Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(src), size / 4, salt);
          CHECK(cudaMemset(dst, 0, size));
          float ms = 0;
          switch (v) {
            case kMori: ms = Time<kMori>(dst, src, size, blocks, iters, warpScope, e0, e1); break;
            case kSimple: ms = Time<kSimple>(dst, src, size, blocks, iters, warpScope, e0, e1); break;
            case kNc: ms = Time<kNc>(dst, src, size, blocks, iters, warpScope, e0, e1); break;
            case kCoop: ms = Time<kCoop>(dst, src, size, blocks, iters, warpScope, e0, e1); break;
            case kCoopSync: ms = Time<kCoopSync>(dst, src, size, blocks, iters, warpScope, e0, e1); break;
            case kCoopLookup: ms = Time<kCoopLookup>(dst, src, size, blocks, iters, warpScope, e0, e1); break;
          }
          const unsigned long long h = Mismatches(src, dst, size, bad);
          if (h != 0) {
            std::printf("MISMATCH: %llu words, %s %zu %s\n", h, warpScope ? "warp" : "block", size, kNames[v]);
            return 1;
          }
          gbps[v][r] = static_cast<float>(size) * iters / (ms * 1e-3f) / 1e9f;
        }
      }
      for (int v = 0; v < kVariants; ++v) {
        std::printf("%-6s %8zuK %8s %8.0f %8.0f %8.0f %8.0f\n", warpScope ? "warp" : "block", size >> 10, kNames[v],
                    gbps[v][0], gbps[v][1], gbps[v][2], gbps[v][3]);
      }
    }
  }
  return 0;
}
