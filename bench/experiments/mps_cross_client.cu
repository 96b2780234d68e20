// Under CUDA MPS: does a host-side operation in one process (pinning memory, allocating device memory, making
// a stream or an event) hold up a copy in another process, or in its own process, while a kernel spins until
// that copy lands? The proxy designs of mori (a host thread copying a signal word into device memory while the
// kernel waits for it) deadlock if it does, until the kernel's bounded wait gives up.
//   victim:    launches a kernel that spins on a device word (bounded by --spin-ms), waits --delay-ms, then
//              copies the word from pinned memory on a non-blocking stream; prints how long the copy took.
//              With --self OP, a second thread of the same process does OP while the kernel spins.
//   disturber: does OP every 50 ms for --seconds, printing the slowest.
//   stream:    a kernel spins until it has seen --trials x 1000 copies of a host thread, one at a time; prints the
//              slowest copy (run it beside processes that start and exit).
// OP: hostalloc (cudaHostAlloc 4 MiB + free), malloc (cudaMalloc 64 MiB + free), stream, event,
// hostregister (cudaHostRegister of 4 MiB of malloc'ed memory + unregister), mallocnofree (cudaMalloc only),
// free (cudaFree only), vmm (cuMemCreate, reserve, map, set access, unmap, release of 64 MiB).
// Not part of the build (docs/PERF.md):
//   nvcc -O2 -arch=sm_90 -o mps_cross_client bench/experiments/mps_cross_client.cu -lcuda -lpthread
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "check.cuh"

using Clock = std::chrono::steady_clock;
static double MsSince(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

__global__ void Spin(volatile uint64_t* word, long long cycles, int* gaveUp) {
  const long long start = clock64();
  while (*word == 0) {
    if (clock64() - start > cycles) {
      *gaveUp = 1;
      return;
    }
  }
}

__global__ void SpinUntil(volatile uint64_t* word, uint64_t target, long long cycles, int* gaveUp) {
  const long long start = clock64();
  while (*word < target) {
    if (clock64() - start > cycles) {
      *gaveUp = 1;
      return;
    }
  }
}

static double DoOp(const std::string& op) {
  auto t = Clock::now();
  if (op == "hostalloc") {
    void* p = nullptr;
    CHECK(cudaHostAlloc(&p, 4 << 20, cudaHostAllocMapped | cudaHostAllocPortable));
    CHECK(cudaFreeHost(p));
  } else if (op == "malloc") {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, 64 << 20));
    CHECK(cudaFree(p));
  } else if (op == "stream") {
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK(cudaStreamDestroy(s));
  } else if (op == "event") {
    cudaEvent_t e;
    CHECK(cudaEventCreate(&e));
    CHECK(cudaEventDestroy(e));
  } else if (op == "hostregister") {
    void* p = std::malloc(4 << 20);
    CHECK(cudaHostRegister(p, 4 << 20, cudaHostRegisterMapped | cudaHostRegisterPortable));
    CHECK(cudaHostUnregister(p));
    std::free(p);
  } else if (op == "mallocnofree") {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, 64 << 20));  // leaked on purpose: the allocation alone
  } else if (op == "free") {
    static void* pool[64];
    static int n = 0;
    if (n == 0) {
      for (auto& p : pool) CHECK(cudaMalloc(&p, 1 << 20));
      n = 64;
      t = Clock::now();
    }
    CHECK(cudaFree(pool[--n]));
  } else if (op == "vmm") {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    size_t bytes = ((64 << 20) + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    if (cuMemCreate(&h, bytes, &prop, 0) != CUDA_SUCCESS || cuMemAddressReserve(&va, bytes, 0, 0, 0) != CUDA_SUCCESS ||
        cuMemMap(va, bytes, 0, h, 0) != CUDA_SUCCESS) {
      std::fprintf(stderr, "vmm failed\n");
      std::exit(1);
    }
    CUmemAccessDesc acc = {};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cuMemSetAccess(va, bytes, &acc, 1);
    cuMemUnmap(va, bytes);
    cuMemAddressFree(va, bytes);
    cuMemRelease(h);
  } else if (op != "none") {
    std::fprintf(stderr, "unknown op %s\n", op.c_str());
    std::exit(2);
  }
  return MsSince(t);
}

int main(int argc, char** argv) {
  std::string role = argc > 1 ? argv[1] : "victim", op = "none";
  double spinMs = 3000, delayMs = 500, seconds = 10;
  int trials = 5;
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--spin-ms") && i + 1 < argc) spinMs = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--delay-ms") && i + 1 < argc) delayMs = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--trials") && i + 1 < argc) trials = std::atoi(argv[++i]);
    else if ((!std::strcmp(argv[i], "--self") || !std::strcmp(argv[i], "--op")) && i + 1 < argc) op = argv[++i];
  }
  CHECK(cudaFree(nullptr));
  if (role == "stream") {
    // A kernel spins until the word reaches `copies`; a host thread raises it one copy at a time and keeps the
    // slowest copy's time (the proxy's pattern). Run beside processes that start and exit (--seconds bounds it).
    const long copies = static_cast<long>(trials) * 1000;
    int clockKhz = 0;
    CHECK(cudaDeviceGetAttribute(&clockKhz, cudaDevAttrClockRate, 0));
    uint64_t* word = nullptr;
    int* gaveUp = nullptr;
    uint64_t* value = nullptr;
    CHECK(cudaMalloc(&word, 8));
    CHECK(cudaMalloc(&gaveUp, sizeof(int)));
    CHECK(cudaMemset(word, 0, 8));
    CHECK(cudaMemset(gaveUp, 0, sizeof(int)));
    CHECK(cudaHostAlloc(&value, 64, cudaHostAllocMapped | cudaHostAllocPortable));
    cudaStream_t app, proxy;
    CHECK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&proxy, cudaStreamNonBlocking));
    CHECK(cudaDeviceSynchronize());
    SpinUntil<<<1, 1, 0, app>>>(word, static_cast<uint64_t>(copies), static_cast<long long>(spinMs * clockKhz), gaveUp);
    CHECK(cudaGetLastError());
    double worst = 0;
    long slow = 0;
    for (long i = 1; i <= copies; ++i) {
      *value = static_cast<uint64_t>(i);
      auto c0 = Clock::now();
      CHECK(cudaMemcpyAsync(word, value, 8, cudaMemcpyHostToDevice, proxy));
      CHECK(cudaStreamSynchronize(proxy));
      double ms = MsSince(c0);
      worst = ms > worst ? ms : worst;
      slow += ms > 100;
    }
    CHECK(cudaStreamSynchronize(app));
    int g = 0;
    CHECK(cudaMemcpy(&g, gaveUp, sizeof(int), cudaMemcpyDeviceToHost));
    std::printf("stream: %ld copies while a kernel spins, slowest %.2f ms, %ld over 100 ms, kernel %s\n", copies,
                worst, slow, g ? "GAVE UP" : "saw every copy");
    return 0;
  }
  if (role == "disturber") {
    double worst = 0;
    int n = 0;
    auto t0 = Clock::now();
    while (MsSince(t0) < seconds * 1000) {
      double ms = DoOp(op);
      worst = ms > worst ? ms : worst;
      ++n;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::printf("disturber %s: %d operations, slowest %.1f ms\n", op.c_str(), n, worst);
    return 0;
  }
  int clockKhz = 0;
  CHECK(cudaDeviceGetAttribute(&clockKhz, cudaDevAttrClockRate, 0));
  uint64_t* word = nullptr;
  int* gaveUp = nullptr;
  uint64_t* one = nullptr;
  CHECK(cudaMalloc(&word, 8));
  CHECK(cudaMalloc(&gaveUp, sizeof(int)));
  CHECK(cudaHostAlloc(&one, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  *one = 1;
  cudaStream_t app, proxy;
  CHECK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&proxy, cudaStreamNonBlocking));
  for (int t = 0; t < trials; ++t) {
    CHECK(cudaMemset(word, 0, 8));
    CHECK(cudaMemset(gaveUp, 0, sizeof(int)));
    CHECK(cudaDeviceSynchronize());
    Spin<<<1, 1, 0, app>>>(word, static_cast<long long>(spinMs * clockKhz), gaveUp);
    CHECK(cudaGetLastError());
    std::atomic<double> opMs{-1};
    std::thread self;
    if (op != "none") self = std::thread([&] { opMs = DoOp(op); });
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long>(delayMs * 1000)));
    auto c0 = Clock::now();
    CHECK(cudaMemcpyAsync(word, one, 8, cudaMemcpyHostToDevice, proxy));
    CHECK(cudaStreamSynchronize(proxy));
    double copyMs = MsSince(c0);
    if (self.joinable()) self.join();
    CHECK(cudaStreamSynchronize(app));
    int hostGaveUp = 0;
    CHECK(cudaMemcpy(&hostGaveUp, gaveUp, sizeof(int), cudaMemcpyDeviceToHost));
    std::printf("victim trial %d: copy %.2f ms, kernel %s, own-thread %s %.1f ms\n", t, copyMs,
                hostGaveUp ? "GAVE UP (the copy waited for it)" : "released by the copy", op.c_str(),
                opMs.load());
    std::fflush(stdout);
  }
  return 0;
}
