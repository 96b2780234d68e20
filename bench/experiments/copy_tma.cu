// Can the tensor memory accelerator (TMA) copy more per SM than 16-byte loads and stores? From 2 MiB up both
// mori's and NVSHMEM's block puts sit at 48-55 GB/s per SM (copy_ceiling.cu), however many loads a thread has
// in flight. Here each block copies its share through shared memory with 1-D bulk copies
// (cp.async.bulk global -> shared, completion on an mbarrier, then shared -> global in bulk groups): W
// pipelines per block (one lane of a warp issues each), S stages of C bytes each. Beside it, the same shares by
// 16-byte loads and stores (1,024 threads, 4 loads in flight), a read-only pass and a write-only pass, so the
// per-SM read and write limits show whether a copy is bound by their sum. Every copy is checked word by word.
// Not part of the build:
//   nvcc -O3 -arch=sm_90 -o copy_tma bench/experiments/copy_tma.cu && ./copy_tma
#include <cstdint>
#include <cstdio>
#include <vector>

#include "copy_check.cuh"

__device__ __forceinline__ uint32_t Smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

// Each block copies bytes [b * perBlock, (b + 1) * perBlock), `iters` times; pipeline w of W takes chunks
// w, w + W, ... of C bytes.
template <int W, int S, int C>
__global__ void __launch_bounds__(W * 32, 1) TmaCopy(uint8_t* dst, const uint8_t* src, size_t perBlock, int iters) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[W * S];
  const int w = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane != 0) return;
  uint8_t* stage0 = smem + size_t(w) * S * C;
  const uint32_t bar0 = Smem(&bars[w * S]);
  for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

  const size_t chunksPerBlock = perBlock / C;
  const size_t mine = (chunksPerBlock + W - 1 - w) / W;  // chunks w, w + W, ...
  const size_t total = mine * size_t(iters);
  const uint8_t* s = src + blockIdx.x * perBlock;
  uint8_t* d = dst + blockIdx.x * perBlock;
  auto offsetOf = [&](size_t j) { return ((j % mine) * W + w) * size_t(C); };
  auto load = [&](size_t j) {
    const uint32_t st = Smem(stage0 + (j % S) * C);
    const uint32_t bar = bar0 + 8 * uint32_t(j % S);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(C) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(st),
                 "l"(s + offsetOf(j)), "r"(C), "r"(bar)
                 : "memory");
  };
  for (size_t j = 0; j < total && j < S; ++j) load(j);
  for (size_t j = 0; j < total; ++j) {
    MbarWait(bar0 + 8 * uint32_t(j % S), uint32_t((j / S) & 1));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + offsetOf(j)),
                 "r"(Smem(stage0 + (j % S) * C)), "r"(C)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j >= 1 && j - 1 + S < total) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // the store of chunk j - 1 has read its stage
      load(j - 1 + S);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// 16-byte loads and stores, 4 in flight per thread (copy_ceiling.cu's u4).
__global__ void __launch_bounds__(1024, 1) LsuCopy(uint8_t* dst, const uint8_t* src, size_t perBlock, int iters) {
  uint4* d = reinterpret_cast<uint4*>(dst + blockIdx.x * perBlock);
  const uint4* s = reinterpret_cast<const uint4*>(src + blockIdx.x * perBlock);
  const uint32_t count = perBlock / 16, n = blockDim.x;
  for (int it = 0; it < iters; ++it) {
    uint32_t i = threadIdx.x;
    for (; i + 3 * n < count; i += 4 * n) {
      uint4 v0 = s[i], v1 = s[i + n], v2 = s[i + 2 * n], v3 = s[i + 3 * n];
      d[i] = v0;
      d[i + n] = v1;
      d[i + 2 * n] = v2;
      d[i + 3 * n] = v3;
    }
    for (; i < count; i += n) d[i] = s[i];
  }
}

__global__ void __launch_bounds__(1024, 1) LsuRead(uint8_t* sink, const uint8_t* src, size_t perBlock, int iters) {
  const uint4* s = reinterpret_cast<const uint4*>(src + blockIdx.x * perBlock);
  const uint32_t count = perBlock / 16, n = blockDim.x;
  uint32_t acc = 0;
  for (int it = 0; it < iters; ++it) {
    for (uint32_t i = threadIdx.x; i + 3 * n < count; i += 4 * n) {
      uint4 v0 = s[i], v1 = s[i + n], v2 = s[i + 2 * n], v3 = s[i + 3 * n];
      acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
    }
  }
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = 1;
}

__global__ void __launch_bounds__(1024, 1) LsuWrite(uint8_t* dst, const uint8_t*, size_t perBlock, int iters) {
  uint4* d = reinterpret_cast<uint4*>(dst + blockIdx.x * perBlock);
  const uint32_t count = perBlock / 16, n = blockDim.x;
  for (int it = 0; it < iters; ++it) {
    for (uint32_t i = threadIdx.x; i < count; i += n) d[i] = make_uint4(i, it, i, it);
  }
}

using Kernel = void (*)(uint8_t*, const uint8_t*, size_t, int);

unsigned long long* gBad;

// Times `iters` passes of `k`; checks the copy (when `check`) against the source.
void Run(const char* name, Kernel k, int threads, size_t smemBytes, uint8_t* d, uint8_t* s, int blocks, size_t total,
         bool check) {
  const size_t perBlock = total / blocks;
  int iters = int((256ull << 20) / total);
  if (iters < 8) iters = 8;
  if (smemBytes > 0) CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smemBytes)));
  Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(d), total / 4, 0x5a5a5a5au);
  k<<<blocks, threads, smemBytes>>>(d, s, perBlock, 1);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  unsigned long long bad = 0;
  if (check) bad = Mismatches(d, s, total, gBad);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 3; ++rep) {
    CHECK(cudaEventRecord(a));
    k<<<blocks, threads, smemBytes>>>(d, s, perBlock, iters);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = ms < best ? ms : best;
  }
  CHECK(cudaGetLastError());
  const double gbs = double(total) * iters / (best * 1e-3) / 1e9;
  std::printf("%-22s total %6zu KiB blocks %3d: %8.1f GB/s  %6.1f per SM%s\n", name, total >> 10, blocks, gbs,
              gbs / blocks, check ? (bad == 0 ? "  (copy checked)" : "  COPY WRONG") : "");
  if (check && bad != 0) std::printf("  %llu words differ\n", bad);
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
}

template <int W, int S, int C>
void Tma(uint8_t* d, uint8_t* s, int blocks, size_t total) {
  char name[64];
  std::snprintf(name, sizeof(name), "tma W%d S%d C%dK", W, S, C >> 10);
  if (total / blocks < size_t(C) * W || (total / blocks) % C != 0) return;
  Run(name, TmaCopy<W, S, C>, W * 32, size_t(W) * S * C, d, s, blocks, total, true);
}

int main() {
  const size_t cap = 64ull << 20;
  uint8_t *d, *s;
  CHECK(cudaMalloc(&d, cap));
  CHECK(cudaMalloc(&s, cap));
  CHECK(cudaMalloc(&gBad, sizeof(*gBad)));
  Fill<<<264, 256>>>(reinterpret_cast<uint32_t*>(s), cap / 4, 0x1234567u);
  CHECK(cudaDeviceSynchronize());
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("SMs: %d\n", sms);
  for (size_t total : {size_t(2) << 20, size_t(8) << 20, size_t(32) << 20}) {
    // Block counts that divide every size into 16-byte-aligned shares (132 SMs would not).
    for (int blocks : {1, 8, 32, sms >= 128 ? 128 : 64}) {
      Run("lsu copy 1024t u4", LsuCopy, 1024, 0, d, s, blocks, total, true);
      Run("lsu read only", LsuRead, 1024, 0, d, s, blocks, total, false);
      Run("lsu write only", LsuWrite, 1024, 0, d, s, blocks, total, false);
      Tma<1, 4, 16384>(d, s, blocks, total);
      Tma<1, 8, 16384>(d, s, blocks, total);
      Tma<2, 4, 16384>(d, s, blocks, total);
      Tma<4, 4, 8192>(d, s, blocks, total);
      Tma<8, 4, 4096>(d, s, blocks, total);
      Tma<4, 2, 16384>(d, s, blocks, total);
    }
  }
  CHECK(cudaDeviceSynchronize());
  std::printf("done\n");
  return 0;
}
