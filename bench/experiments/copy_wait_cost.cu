// What one small copy costs a proxy thread that waits for it (TimedStreamCopy: the TCP link's writes into GPU
// memory, the emulated NIC's, a FIFO head read): an 8-byte copy from pinned host memory into device memory on a
// non-blocking stream, waited for with an event. Ways of getting the event, each timed over many copies:
//   create+destroy   a new event per copy (cudaEventCreate, timing on), as mori did up to 2026-12-02
//   cached           one event made once and recorded again each time
//   cached, no time  the same with cudaEventDisableTiming
//   stream sync      no event: cudaStreamSynchronize (waits for other threads' copies on a shared stream too)
// Not part of the build:  nvcc -O2 -arch=sm_90 copy_wait_cost.cu -o copy_wait_cost
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.cuh"

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 5000;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned long long *host = nullptr, *dev = nullptr;
  CHECK(cudaHostAlloc(&host, 64, cudaHostAllocDefault));
  CHECK(cudaMalloc(&dev, 64));
  cudaEvent_t cached, cachedNoTiming;
  CHECK(cudaEventCreate(&cached));
  CHECK(cudaEventCreateWithFlags(&cachedNoTiming, cudaEventDisableTiming));
  const char* names[] = {"create+destroy", "cached", "cached, no timing", "stream sync"};
  for (int round = 0; round < 3; ++round) {
    for (int mode = 0; mode < 4; ++mode) {
      std::vector<double> us(iters);
      for (int i = 0; i < iters; ++i) {
        *host = static_cast<unsigned long long>(i);
        auto t0 = std::chrono::steady_clock::now();
        cudaEvent_t e = mode == 1 ? cached : cachedNoTiming;
        if (mode == 0) CHECK(cudaEventCreate(&e));
        CHECK(cudaMemcpyAsync(dev, host, 8, cudaMemcpyHostToDevice, stream));
        if (mode == 3) {
          CHECK(cudaStreamSynchronize(stream));
        } else {
          CHECK(cudaEventRecord(e, stream));
          CHECK(cudaEventSynchronize(e));
        }
        if (mode == 0) CHECK(cudaEventDestroy(e));
        us[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      }
      std::sort(us.begin(), us.end());
      std::printf("round %d  %-18s median %6.2f us  p10 %6.2f  p90 %6.2f  p99 %6.2f\n", round, names[mode],
                  us[iters / 2], us[iters / 10], us[iters * 9 / 10], us[iters * 99 / 100]);
    }
  }
  return 0;
}
