// What a kernel launch costs the host: <<<>>> against cudaLaunchKernelEx with and without programmatic stream
// serialization (core::LaunchKernelEarly), an 8-byte and a 256-byte argument, one block and an EP-sized grid, on
// the legacy default stream (torch's) and on a created non-blocking stream. Each launch is timed three ways:
// right after the stream was synchronised behind a short busy kernel (a dispatch called on an idle GPU, as
// ep_bench and ep_bench.py time it), the same after the thread slept 1 ms, and back to back (warm, the queue
// not full). Median and p90 of host microseconds per launch.
// Not part of the build (docs/PERF.md):
//   nvcc -O2 -std=c++17 -arch=sm_90 -o launch_cost bench/experiments/launch_cost.cu && ./launch_cost
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "check.cuh"

struct Wide {
  uint64_t word[32];  // 256 bytes, about an EP kernel's argument struct
};

__global__ void Narrow(int* sink) {
  if (sink != nullptr && threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(sink, 1);
}

__global__ void WideArg(Wide w) {
  if (w.word[0] != 0 && threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(reinterpret_cast<int*>(w.word[0]), 1);
}

__global__ void Busy(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

enum class How { Chevrons, Ex, ExEarly };

template <typename Kernel, typename Arg>
void Launch(How how, Kernel kernel, Arg arg, dim3 grid, dim3 block, cudaStream_t stream) {
  if (how == How::Chevrons) {
    kernel<<<grid, block, 0, stream>>>(arg);
    return;
  }
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  // gridDim, blockDim, dynamic shared bytes, stream, attributes, how many of them
  cudaLaunchConfig_t config{grid, block, 0, stream, &early, how == How::ExEarly ? 1u : 0u};
  CHECK(cudaLaunchKernelEx(&config, kernel, arg));
}

double Us(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

void Report(const char* label, std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  std::printf("  %-34s median %6.2f  p90 %6.2f\n", label, v[v.size() / 2], v[v.size() * 9 / 10]);
}

template <typename Kernel, typename Arg>
void Case(const char* name, How how, Kernel kernel, Arg arg, dim3 grid, dim3 block, cudaStream_t stream) {
  constexpr int kReps = 300;
  std::vector<double> afterSync, afterSleep, warm;
  for (int i = 0; i < kReps + 10; ++i) {
    Busy<<<1, 1, 0, stream>>>(100000);  // ~50 us
    CHECK(cudaStreamSynchronize(stream));
    auto t0 = std::chrono::steady_clock::now();
    Launch(how, kernel, arg, grid, block, stream);
    auto t1 = std::chrono::steady_clock::now();
    if (i >= 10) afterSync.push_back(Us(t0, t1));
  }
  for (int i = 0; i < kReps / 3; ++i) {
    CHECK(cudaStreamSynchronize(stream));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto t0 = std::chrono::steady_clock::now();
    Launch(how, kernel, arg, grid, block, stream);
    auto t1 = std::chrono::steady_clock::now();
    afterSleep.push_back(Us(t0, t1));
  }
  CHECK(cudaStreamSynchronize(stream));
  for (int i = 0; i < kReps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    Launch(how, kernel, arg, grid, block, stream);
    auto t1 = std::chrono::steady_clock::now();
    warm.push_back(Us(t0, t1));
    if (i % 100 == 99) CHECK(cudaStreamSynchronize(stream));
  }
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGetLastError());
  std::printf("%s\n", name);
  Report("after a stream synchronisation", afterSync);
  Report("after the thread slept 1 ms", afterSleep);
  Report("back to back", warm);
}

int main() {
  int* sink = nullptr;
  CHECK(cudaMalloc(&sink, sizeof(int)));
  Wide w{};
  w.word[0] = reinterpret_cast<uint64_t>(sink);
  cudaStream_t created = nullptr;
  CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
  const dim3 one(1), warp(32), epGrid(264), epBlock(512);
  for (cudaStream_t stream : {static_cast<cudaStream_t>(nullptr), created}) {
    const char* s = stream == nullptr ? "legacy default stream" : "created non-blocking stream";
    std::printf("== %s (host us per launch)\n", s);
    Case("<<<>>>, 8-byte argument, 1 x 32", How::Chevrons, Narrow, sink, one, warp, stream);
    Case("<<<>>>, 256-byte argument, 1 x 32", How::Chevrons, WideArg, w, one, warp, stream);
    Case("<<<>>>, 256-byte argument, 264 x 512", How::Chevrons, WideArg, w, epGrid, epBlock, stream);
    Case("cudaLaunchKernelEx, 256 B, 264 x 512", How::Ex, WideArg, w, epGrid, epBlock, stream);
    Case("the same, programmatic serialization", How::ExEarly, WideArg, w, epGrid, epBlock, stream);
  }
  CHECK(cudaStreamDestroy(created));
  CHECK(cudaFree(sink));
  return 0;
}
