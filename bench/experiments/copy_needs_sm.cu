// Does a small copy between device memory and host memory need a free SM? A kernel fills every SM with
// spinning blocks (more blocks than fit, bounded by --spin-ms) that wait for a device word; a host thread then
// writes the word with one kind of copy. A copy that completes at once ran on a copy engine; one that takes
// about the spin bound waited for SMs (the spinners gave up). Run alone and under MPS (docs/PERF.md):
//   nvcc -O2 -arch=sm_90 -o copy_needs_sm bench/experiments/copy_needs_sm.cu -lcuda && ./copy_needs_sm
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "check.cuh"

using Clock = std::chrono::steady_clock;

__global__ void Spin(volatile uint64_t* word, long long cycles, int* gaveUp) {
  const long long start = clock64();
  while (*word == 0) {
    if (clock64() - start > cycles) {
      if (threadIdx.x == 0) atomicAdd(gaveUp, 1);
      return;
    }
  }
}

int main(int argc, char** argv) {
  double spinMs = 2000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--spin-ms") && i + 1 < argc) spinMs = std::atof(argv[++i]);
  }
  int clockKhz = 0, sms = 0;
  CHECK(cudaDeviceGetAttribute(&clockKhz, cudaDevAttrClockRate, 0));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint64_t *word = nullptr, *pinned = nullptr, *pinnedPlain = nullptr;
  int* gaveUp = nullptr;
  CHECK(cudaMalloc(&word, 8));
  CHECK(cudaMalloc(&gaveUp, sizeof(int)));
  CHECK(cudaHostAlloc(&pinned, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  CHECK(cudaHostAlloc(&pinnedPlain, 64, cudaHostAllocDefault));
  static uint64_t pageable[8];
  cudaStream_t app, proxy;
  CHECK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&proxy, cudaStreamNonBlocking));
  const char* names[] = {"H2D pinned mapped, cudaMemcpyDefault", "H2D pinned mapped, HostToDevice",
                         "H2D pinned (default flags), Default", "H2D pageable, Default", "D2H then H2D pinned (RMW)",
                         "cuMemcpyHtoDAsync pinned", "cudaMemsetAsync 8 bytes"};
  for (int kind = 0; kind < 7; ++kind) {
    CHECK(cudaMemset(word, 0, 8));
    CHECK(cudaMemset(gaveUp, 0, sizeof(int)));
    CHECK(cudaDeviceSynchronize());
    *pinned = 1;
    *pinnedPlain = 1;
    pageable[0] = 1;
    Spin<<<sms * 4, 1024, 0, app>>>(word, static_cast<long long>(spinMs * clockKhz), gaveUp);
    CHECK(cudaGetLastError());
    auto t0 = Clock::now();
    while (std::chrono::duration<double, std::milli>(Clock::now() - t0).count() < 20) {
    }
    auto c0 = Clock::now();
    switch (kind) {
      case 0: CHECK(cudaMemcpyAsync(word, pinned, 8, cudaMemcpyDefault, proxy)); break;
      case 1: CHECK(cudaMemcpyAsync(word, pinned, 8, cudaMemcpyHostToDevice, proxy)); break;
      case 2: CHECK(cudaMemcpyAsync(word, pinnedPlain, 8, cudaMemcpyDefault, proxy)); break;
      case 3: CHECK(cudaMemcpyAsync(word, pageable, 8, cudaMemcpyDefault, proxy)); break;
      case 4:
        CHECK(cudaMemcpyAsync(pinned + 1, word, 8, cudaMemcpyDefault, proxy));
        CHECK(cudaStreamSynchronize(proxy));
        CHECK(cudaMemcpyAsync(word, pinned, 8, cudaMemcpyDefault, proxy));
        break;
      case 5:
        if (cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(word), pinned, 8, proxy) != CUDA_SUCCESS) std::exit(1);
        break;
      case 6: CHECK(cudaMemsetAsync(word, 1, 8, proxy)); break;
    }
    CHECK(cudaStreamSynchronize(proxy));
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - c0).count();
    CHECK(cudaStreamSynchronize(app));
    int g = 0;
    CHECK(cudaMemcpy(&g, gaveUp, sizeof(int), cudaMemcpyDeviceToHost));
    std::printf("%-40s: %9.2f ms, %d of %d blocks gave up (%s)\n", names[kind], ms, g, sms * 4,
                ms > spinMs / 2 ? "WAITED FOR SMs" : "copy engine");
    std::fflush(stdout);
  }
  return 0;
}
