// False dependencies between streams: does a copy on a proxy thread's non-blocking stream wait for a kernel
// that spins until that copy lands, when the application recorded an event (or queued work) behind the
// kernel? The application launches a kernel on its stream that spins on a device word (bounded: it gives up
// after `--spin-ms`), records an event behind it on the same stream, and the "proxy" writes the word with
// cudaMemcpyAsync from pinned memory on one of its streams, then synchronizes that stream. A copy that took
// about the spin bound waited for the kernel. Each proxy stream is tried once, by stream kind and priority.
// Not part of the build (docs/PERF.md):
//   nvcc -O2 -arch=sm_90 -o false_dependency bench/experiments/false_dependency.cu && ./false_dependency
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.cuh"

__global__ void Spin(volatile uint64_t* word, long long cycles, int* gaveUp) {
  const long long start = clock64();
  while (*word == 0) {
    if (clock64() - start > cycles) {
      *gaveUp = 1;
      return;
    }
  }
}

struct Result {
  int blocked = 0;
  int gaveUp = 0;
  double worstMs = 0;
};

// appStream: nullptr = the legacy default stream. behind: 0 = nothing behind the kernel, 1 = an event record,
// 2 = a device-to-host copy on the same stream.
Result Trial(cudaStream_t appStream, int behind, const std::vector<cudaStream_t>& proxy, long long cycles,
             double spinMs) {
  uint64_t* word = nullptr;
  int* gaveUp = nullptr;
  uint64_t* one = nullptr;
  int hostGaveUp = 0;
  CHECK(cudaMalloc(&word, 8));
  CHECK(cudaMalloc(&gaveUp, sizeof(int)));
  CHECK(cudaHostAlloc(&one, 64, cudaHostAllocDefault));
  *one = 1;
  int* readBack = nullptr;
  CHECK(cudaHostAlloc(&readBack, 64, cudaHostAllocDefault));
  cudaEvent_t ev;
  CHECK(cudaEventCreate(&ev));
  Result r;
  for (cudaStream_t s : proxy) {
    CHECK(cudaMemset(word, 0, 8));
    CHECK(cudaMemset(gaveUp, 0, sizeof(int)));
    CHECK(cudaDeviceSynchronize());
    Spin<<<1, 1, 0, appStream>>>(word, cycles, gaveUp);
    CHECK(cudaGetLastError());
    if (behind == 1) CHECK(cudaEventRecord(ev, appStream));
    if (behind == 2) CHECK(cudaMemcpyAsync(readBack, gaveUp, sizeof(int), cudaMemcpyDeviceToHost, appStream));
    // Give the kernel time to start spinning.
    auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < 2) {
    }
    auto c0 = std::chrono::steady_clock::now();
    CHECK(cudaMemcpyAsync(word, one, 8, cudaMemcpyHostToDevice, s));
    CHECK(cudaStreamSynchronize(s));
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c0).count();
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(&hostGaveUp, gaveUp, sizeof(int), cudaMemcpyDeviceToHost));
    if (ms > spinMs / 2) ++r.blocked;
    r.gaveUp += hostGaveUp;
    if (ms > r.worstMs) r.worstMs = ms;
  }
  CHECK(cudaEventDestroy(ev));
  CHECK(cudaFreeHost(readBack));
  CHECK(cudaFreeHost(one));
  CHECK(cudaFree(gaveUp));
  CHECK(cudaFree(word));
  return r;
}

int main(int argc, char** argv) {
  int nStreams = 24;
  double spinMs = 300;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--streams") && i + 1 < argc) nStreams = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--spin-ms") && i + 1 < argc) spinMs = std::atof(argv[++i]);
  }
  int clockKhz = 0, least = 0, greatest = 0;
  CHECK(cudaDeviceGetAttribute(&clockKhz, cudaDevAttrClockRate, 0));
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const long long cycles = static_cast<long long>(spinMs * clockKhz);
  const char* conns = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const char* mps = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  std::printf("false_dependency: %d proxy streams per case, spin bound %.0f ms, priorities %d..%d, "
              "CUDA_DEVICE_MAX_CONNECTIONS=%s, MPS pipe %s\n",
              nStreams, spinMs, least, greatest, conns ? conns : "(unset)", mps ? mps : "(none)");
  cudaStream_t appBlocking = nullptr, appNonBlocking = nullptr;
  CHECK(cudaStreamCreate(&appBlocking));
  CHECK(cudaStreamCreateWithFlags(&appNonBlocking, cudaStreamNonBlocking));
  struct Kind {
    const char* name;
    unsigned flags;
    int priority;
  } kinds[] = {{"non-blocking, default priority", cudaStreamNonBlocking, least},
               {"non-blocking, greatest priority", cudaStreamNonBlocking, greatest}};
  struct App {
    const char* name;
    cudaStream_t stream;
    int behind;
  } apps[] = {{"legacy stream, nothing behind", nullptr, 0},  {"legacy stream, event behind", nullptr, 1},
              {"legacy stream, D2H copy behind", nullptr, 2}, {"own stream, event behind", appBlocking, 1},
              {"own stream, D2H copy behind", appBlocking, 2}, {"non-blocking stream, event behind", appNonBlocking, 1}};
  for (const Kind& k : kinds) {
    std::vector<cudaStream_t> proxy(nStreams);
    for (auto& s : proxy) CHECK(cudaStreamCreateWithPriority(&s, k.flags, k.priority));
    for (const App& a : apps) {
      Result r = Trial(a.stream, a.behind, proxy, cycles, spinMs);
      std::printf("proxy %-32s app %-34s: %2d of %d copies waited for the kernel (kernel gave up %d times), "
                  "worst %.1f ms\n",
                  k.name, a.name, r.blocked, nStreams, r.gaveUp, r.worstMs);
      std::fflush(stdout);
    }
    for (auto& s : proxy) CHECK(cudaStreamDestroy(s));
  }
  return 0;
}
