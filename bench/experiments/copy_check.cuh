// What the copy experiments check their copies with: a salted word pattern for the source, and a count of the
// words where the destination differs from it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "check.cuh"

__global__ void Fill(uint32_t* p, size_t words, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint32_t>(i * 2654435761u) ^ salt;
  }
}

__global__ void Compare(const uint32_t* a, const uint32_t* b, size_t words, unsigned long long* bad) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    if (a[i] != b[i]) atomicAdd(bad, 1ull);
  }
}

// The words of [0, bytes) where `b` differs from `a`; `bad` is a device counter it resets.
inline unsigned long long Mismatches(const void* a, const void* b, size_t bytes, unsigned long long* bad) {
  CHECK(cudaMemset(bad, 0, sizeof(*bad)));
  Compare<<<264, 256>>>(static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), bytes / 4, bad);
  unsigned long long h = 0;
  CHECK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
  return h;
}
