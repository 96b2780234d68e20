// Does a device assertion's cold printf make every system fence dearer? ptxas puts a `MEMBAR.ALL.CTA` before each
// system- or GPU-scope fence of a kernel that has a stack frame, and mori's kernels have one mostly because a
// MORI_DEVICE_ASSERT's printf arguments need a buffer in local memory on its (never taken) failure path. Variants
// of one loop (a 16-byte store to device memory, then `fence.acq_rel.sys`, timed with clock64), differing only in
// how the failure path of a check that never fails reports:
//   none              no check at all (the floor)
//   inline-printf     printf + trap inline, as MORI_DEVICE_ASSERT does today
//   noinline-printf   a __noinline__ function taking the arguments does the printf and the trap
//   noinline-variadic the same as a variadic template (what a macro with any arguments would call)
//   record            the arguments stored in a __device__ record and a trap, no printf
// Each kernel's frame is in `-Xptxas -v`; the MEMBARs in `cuobjdump -sass fence_stack | grep -E 'Function|MEMBAR'`.
// Not part of the build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -o fence_stack bench/experiments/fence_stack.cu && ./fence_stack
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.cuh"

enum Variant : int { kNone, kInlinePrintf, kNoinlinePrintf, kNoinlineVariadic, kRecord, kVariants };
const char* kNames[kVariants] = {"none", "inline-printf", "noinline-printf", "noinline-variadic", "record"};

__device__ __noinline__ void FailPrintf(const char* file, int line, unsigned long long a, unsigned long long b) {
  printf("[fence_stack] %s:%d: check failed: a %llu b %llu\n", file, line, a, b);
  __trap();
}

template <typename... A>
__device__ __noinline__ void FailVariadic(const char* fmt, A... args) {
  printf(fmt, args...);
  __trap();
}

struct FailRecord {
  const char* file;
  int line;
  unsigned long long a, b;
};
__device__ FailRecord gRecord;

__device__ __forceinline__ void FenceSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

template <int V>
__device__ __forceinline__ void Check(bool ok, unsigned long long a, unsigned long long b) {
  if (V == kInlinePrintf) {
    if (__builtin_expect(!ok, 0)) {
      printf("[fence_stack] %s:%d: check failed: a %llu b %llu\n", __FILE__, __LINE__, a, b);
      __trap();
    }
  } else if (V == kNoinlinePrintf) {
    if (__builtin_expect(!ok, 0)) FailPrintf(__FILE__, __LINE__, a, b);
  } else if (V == kNoinlineVariadic) {
    if (__builtin_expect(!ok, 0)) {
      FailVariadic("[fence_stack] %s:%d: check failed: a %llu b %llu\n", __FILE__, __LINE__, a, b);
    }
  } else if (V == kRecord) {
    if (__builtin_expect(!ok, 0)) {
      gRecord = FailRecord{__FILE__, __LINE__, a, b};
      __threadfence_system();
      __trap();
    }
  }
}

// One thread: iters x (store a vector to device memory, check, system fence); costs[i] in SM cycles.
template <int V>
__global__ void FenceLoop(uint4* data, unsigned long long limit, int iters, long long* costs) {
  for (int i = 0; i < iters; ++i) {
    const unsigned long long v = static_cast<unsigned long long>(i);
    long long t0 = clock64();
    data[i & 63] = make_uint4(i, i + 1, i + 2, i + 3);
    Check<V>(v < limit, v, limit);
    FenceSys();
    long long t1 = clock64();
    costs[i] = t1 - t0;
  }
}

template <int V>
void Run(uint4* data, long long* costs, int iters, std::vector<long long>& host) {
  FenceLoop<V><<<1, 1>>>(data, ~0ull, iters, costs);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(host.data(), costs, sizeof(long long) * iters, cudaMemcpyDeviceToHost));
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20000;
  uint4* data;
  long long* costs;
  CHECK(cudaMalloc(&data, 64 * sizeof(uint4)));
  CHECK(cudaMalloc(&costs, sizeof(long long) * iters));
  std::vector<long long> host(iters);
  std::printf("variant              median  p10     p90   (SM cycles per store + check + fence.acq_rel.sys)\n");
  for (int round = 0; round < 3; ++round) {
    for (int v = 0; v < kVariants; ++v) {
      switch (v) {
        case kNone: Run<kNone>(data, costs, iters, host); break;
        case kInlinePrintf: Run<kInlinePrintf>(data, costs, iters, host); break;
        case kNoinlinePrintf: Run<kNoinlinePrintf>(data, costs, iters, host); break;
        case kNoinlineVariadic: Run<kNoinlineVariadic>(data, costs, iters, host); break;
        case kRecord: Run<kRecord>(data, costs, iters, host); break;
      }
      std::vector<long long> s(host.begin() + iters / 10, host.end());
      std::sort(s.begin(), s.end());
      std::printf("%-18s %7lld %7lld %7lld\n", kNames[v], s[s.size() / 2], s[s.size() / 10], s[s.size() * 9 / 10]);
    }
  }
  return 0;
}
