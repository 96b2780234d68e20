// Per-SM copy ceiling: block-wide 16-byte copies within one GPU, by loads in flight per thread, load kind and
// threads per block (docs/PERF.md, second session of 2026-11-25). Not part of the build:
//   nvcc -O3 -arch=sm_90 -o copy_ceiling bench/experiments/copy_ceiling.cu && ./copy_ceiling
#include <cstdio>
#include <cuda_runtime.h>
#include <cstdint>
template <int U, bool NC>
__device__ __forceinline__ void Copy(uint4* d, const uint4* s, uint32_t count, uint32_t r, uint32_t n) {
  uint32_t i = r;
  for (; i + (U - 1) * n < count; i += U * n) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (NC) v[k] = __ldg(s + i + k * n); else v[k] = s[i + k * n];
    }
#pragma unroll
    for (int k = 0; k < U; ++k) d[i + k * n] = v[k];
  }
  for (; i < count; i += n) d[i] = s[i];
}
template <int U, bool NC>
__global__ void __launch_bounds__(1024, 1) K(uint8_t* dst, const uint8_t* src, size_t perBlock, int iters) {
  uint4* d = reinterpret_cast<uint4*>(dst + blockIdx.x * perBlock);
  const uint4* s = reinterpret_cast<const uint4*>(src + blockIdx.x * perBlock);
  for (int it = 0; it < iters; ++it) {
    __syncthreads();
    Copy<U, NC>(d, s, perBlock / 16, threadIdx.x, blockDim.x);
  }
}
template <int U, bool NC>
void Run(const char* name, uint8_t* d, uint8_t* s, int blocks, int threads, size_t perBlock) {
  int iters = int((64ull << 20) / perBlock); if (iters < 20) iters = 20;
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  K<U, NC><<<blocks, threads>>>(d, s, perBlock, 2);
  cudaEventRecord(a);
  K<U, NC><<<blocks, threads>>>(d, s, perBlock, iters);
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  double gbs = double(perBlock) * blocks * iters / (ms * 1e-3) / 1e9;
  printf("%-10s blocks %3d threads %4d perBlock %7zu KiB: %8.1f GB/s (%.1f per SM)\n", name, blocks, threads, perBlock >> 10, gbs, gbs / blocks);
}
int main() {
  uint8_t *d, *s; size_t cap = 256ull << 20;
  cudaMalloc(&d, cap); cudaMalloc(&s, cap); cudaMemset(s, 1, cap);
  for (int blocks : {1, 32}) for (size_t pb : {size_t(16) << 10, size_t(64) << 10, size_t(256) << 10, size_t(1) << 20}) {
    Run<1, false>("u1", d, s, blocks, 1024, pb);
    Run<2, false>("u2", d, s, blocks, 1024, pb);
    Run<4, false>("u4", d, s, blocks, 1024, pb);
    Run<8, false>("u8", d, s, blocks, 1024, pb);
    Run<4, true>("u4nc", d, s, blocks, 1024, pb);
    Run<8, true>("u8nc", d, s, blocks, 1024, pb);
    Run<4, false>("u4_512t", d, s, blocks, 512, pb);
    Run<8, false>("u8_512t", d, s, blocks, 512, pb);
  }
  cudaError_t e = cudaDeviceSynchronize(); printf("done: %s\n", cudaGetErrorString(e));
  return 0;
}
