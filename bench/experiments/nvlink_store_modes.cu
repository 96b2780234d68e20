// How fast can one GPU write into its peer over NVLink, by the way the bytes are moved: 16-byte SM loads and
// stores (4 or 8 in flight per thread, plain or streaming hints), the Hopper bulk copy engine of each SM (TMA:
// cp.async.bulk from global to shared memory, then from shared memory to the peer's memory, one thread per
// block driving a ring of stages), and the copy engine (cudaMemcpyPeerAsync) for reference. Answers whether
// anything an SM can issue beats the ~365 GB/s that mori's and NVSHMEM's block puts reach (docs/PERF.md,
// 2026-11-26). Not part of the build; needs two GPUs with peer access:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o nvlink_store_modes bench/experiments/nvlink_store_modes.cu && ./nvlink_store_modes
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "check.cuh"

namespace {

template <int U, bool Streaming>
__device__ __forceinline__ void CopyVectors(uint4* d, const uint4* s, uint32_t count, uint32_t r, uint32_t n) {
  uint32_t i = r;
  for (; i + (U - 1) * n < count; i += U * n) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) v[k] = Streaming ? __ldcs(s + i + k * n) : s[i + k * n];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (Streaming) {
        __stcs(d + i + k * n, v[k]);
      } else {
        d[i + k * n] = v[k];
      }
    }
  }
  for (; i < count; i += n) d[i] = s[i];
}

// Block b copies its slice `iters` times, a barrier between rounds (as a block put in a loop does).
template <int U, bool Streaming>
__global__ void __launch_bounds__(1024) SmCopy(uint8_t* dst, const uint8_t* src, size_t perBlock, int iters) {
  uint4* d = reinterpret_cast<uint4*>(dst + blockIdx.x * perBlock);
  const uint4* s = reinterpret_cast<const uint4*>(src + blockIdx.x * perBlock);
  for (int it = 0; it < iters; ++it) {
    __syncthreads();
    CopyVectors<U, Streaming>(d, s, static_cast<uint32_t>(perBlock / 16), threadIdx.x, blockDim.x);
  }
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread per block moves its slice in chunks of `chunk` bytes through `stages` buffers of shared memory:
// a bulk load into a stage (completion counted on the stage's mbarrier), then a bulk store from it to the peer;
// a stage is refilled once the store before it has read its buffer.
__global__ void TmaCopy(uint8_t* dst, const uint8_t* src, size_t perBlock, int iters, uint32_t chunk, int stages) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[8];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddress(&bars[s])) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const size_t per = perBlock / chunk;
  const size_t total = per * static_cast<size_t>(iters);
  uint8_t* d = dst + blockIdx.x * perBlock;
  const uint8_t* s = src + blockIdx.x * perBlock;
  auto load = [&](size_t c) {
    const int st = static_cast<int>(c % stages);
    const uint32_t bar = SharedAddress(&bars[st]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     SharedAddress(smem + static_cast<size_t>(st) * chunk)),
                 "l"(s + (c % per) * chunk), "r"(chunk), "r"(bar)
                 : "memory");
  };
  for (size_t c = 0; c < total && c < static_cast<size_t>(stages); ++c) load(c);
  for (size_t c = 0; c < total; ++c) {
    const int st = static_cast<int>(c % stages);
    const uint32_t phase = static_cast<uint32_t>((c / stages) & 1);
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(SharedAddress(&bars[st])), "r"(phase)
          : "memory");
    }
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + (c % per) * chunk),
                 "r"(SharedAddress(smem + static_cast<size_t>(st) * chunk)), "r"(chunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (c >= 1 && c - 1 + stages < total) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // the store from stage c - 1 read it
      load(c - 1 + stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
  template <typename F>
  double Ms(F&& f) {
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

int Iters(size_t bytes) {
  size_t it = (2048ull << 20) / bytes;  // about 2 GiB per measurement
  return static_cast<int>(it < 3 ? 3 : it);
}

void Report(const char* mode, int blocks, int threads, size_t bytes, double ms, int iters) {
  std::printf("%-22s blocks %3d threads %4d %4zu MiB: %7.1f GB/s\n", mode, blocks, threads, bytes >> 20,
              static_cast<double>(bytes) * iters / (ms * 1e-3) / 1e9);
}

bool Same(const uint8_t* dDst, const std::vector<uint8_t>& want, size_t bytes) {
  std::vector<uint8_t> got(bytes);
  CHECK(cudaMemcpy(got.data(), dDst, bytes, cudaMemcpyDefault));
  return std::memcmp(got.data(), want.data(), bytes) == 0;
}

}  // namespace

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("needs two GPUs (found %d)\n", n);
    return 0;
  }
  int ok = 0;
  CHECK(cudaDeviceCanAccessPeer(&ok, 0, 1));
  if (!ok) {
    std::printf("GPU 0 cannot access GPU 1\n");
    return 0;
  }
  const size_t maxBytes = 256ull << 20;
  uint8_t *src = nullptr, *dst = nullptr;
  CHECK(cudaSetDevice(1));
  CHECK(cudaMalloc(&dst, maxBytes));
  CHECK(cudaSetDevice(0));
  CHECK(cudaDeviceEnablePeerAccess(1, 0));
  CHECK(cudaMalloc(&src, maxBytes));
  std::vector<uint8_t> pattern(maxBytes);
  for (size_t i = 0; i < maxBytes; ++i) pattern[i] = static_cast<uint8_t>(i * 7 + (i >> 12));
  CHECK(cudaMemcpy(src, pattern.data(), maxBytes, cudaMemcpyHostToDevice));
  Timer t;
  const uint32_t chunk = 32 << 10;
  const int stages = 4;
  CHECK(cudaFuncSetAttribute(TmaCopy, cudaFuncAttributeMaxDynamicSharedMemorySize, chunk * stages));
  for (size_t bytes : {16ull << 20, 64ull << 20, 256ull << 20}) {
    const int iters = Iters(bytes);
    double ms = t.Ms([&] { CHECK(cudaMemcpyPeerAsync(dst, 1, src, 0, bytes)); });
    ms = t.Ms([&] {
      for (int i = 0; i < iters; ++i) CHECK(cudaMemcpyPeerAsync(dst, 1, src, 0, bytes));
    });
    Report("copy engine", 0, 0, bytes, ms, iters);
    for (int blocks : {32, 64, 132, 264}) {
      const size_t per = bytes / blocks / 16 * 16;
      if (per == 0) continue;
      auto run = [&](const char* name, auto kernel, int threads) {
        CHECK(cudaMemset(dst, 0, bytes));
        kernel<<<blocks, threads>>>(dst, src, per, 1);
        CHECK(cudaDeviceSynchronize());
        const bool right = Same(dst, pattern, per * blocks);
        double m = t.Ms([&] { kernel<<<blocks, threads>>>(dst, src, per, iters); });
        Report(name, blocks, threads, per * blocks, m, iters);
        if (!right) std::printf("  WRONG DATA (%s)\n", name);
      };
      run("sm 16B x4", SmCopy<4, false>, 1024);
      run("sm 16B x8", SmCopy<8, false>, 1024);
      run("sm 16B x4 streaming", SmCopy<4, true>, 1024);
      run("sm 16B x4, 512 thr", SmCopy<4, false>, 512);
      if (per % chunk == 0 && blocks <= 132) {
        CHECK(cudaMemset(dst, 0, bytes));
        TmaCopy<<<blocks, 32, chunk * stages>>>(dst, src, per, 1, chunk, stages);
        CHECK(cudaDeviceSynchronize());
        const bool right = Same(dst, pattern, per * blocks);
        double m = t.Ms([&] { TmaCopy<<<blocks, 32, chunk * stages>>>(dst, src, per, iters, chunk, stages); });
        Report("tma 32 KiB x4 stages", blocks, 1, per * blocks, m, iters);
        if (!right) std::printf("  WRONG DATA (tma)\n");
      }
    }
  }
  return 0;
}
