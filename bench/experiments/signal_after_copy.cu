// What a proxy thread's put-with-signal over the copy engine costs until a kernel sees it (the CudaIpc
// connection: the data by cudaMemcpyAsync, then the signal word in stream order), by how the signal is written
// and what carries the data:
//   staged copy   the signal's value stored in a host-pinned word, copied by cudaMemcpyAsync (mori up to
//                 2026-12-02)
//   write value   cuStreamWriteValue64, the stream's own store after a memory barrier (no copy engine)
//   data: none; 1 KiB or 8 B device to device (cudaMemcpyAsync, as the CudaIpc connection's Write); 1 KiB from
//   host-pinned memory; 1 KiB by cudaMemcpyBatchAsync, without and with cudaMemcpyFlagPreferOverlapWithCompute (the
//   hint to leave the SMs alone); 1 KiB by a copy kernel of one block launched on the same stream
// A block waits for the signal (one thread polls), checks that the data of that round arrived (a different
// pattern each round, one word per thread), and answers in a host-pinned word the host thread spins on: one
// round trip per iteration, host issue to host answer.
// Not part of the build:  nvcc -O2 -arch=sm_90 signal_after_copy.cu -o signal_after_copy
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.cuh"

namespace {

constexpr int kWords = 128;  // 1 KiB of data per round
constexpr int kSlots = 16;   // source patterns, one per round modulo kSlots

__host__ __device__ unsigned long long Pattern(int slot, int word) {
  return (static_cast<unsigned long long>(slot) + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<unsigned long long>(word);
}

__global__ void FillSources(unsigned long long* src) {
  for (int i = threadIdx.x; i < kSlots * kWords; i += blockDim.x) src[i] = Pattern(i / kWords, i % kWords);
}

__global__ void CopyKernel(unsigned long long* dst, const unsigned long long* src, int words) {
  for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

__device__ unsigned long long LoadAcquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Round i (from 1): thread 0 waits for the signal to reach i, then every thread of the block checks its words of
// the data (when there is data: one load each, so the check costs about one load's time), then thread 0 answers i.
__global__ void Responder(const unsigned long long* signal, const unsigned long long* data, int checkWords,
                          unsigned long long* answer, int iters, unsigned long long* errors, long long timeoutCycles) {
  __shared__ bool lost;
  if (threadIdx.x == 0) lost = false;
  for (unsigned long long i = 1; i <= static_cast<unsigned long long>(iters); ++i) {
    if (threadIdx.x == 0) {
      long long start = clock64();
      while (LoadAcquire(signal) < i) {
        if (clock64() - start > timeoutCycles) {
          atomicAdd(errors, 1000000ull);  // a lost signal: the host sees the count and stops
          lost = true;
          break;
        }
      }
    }
    __syncthreads();
    if (lost) return;
    for (int w = threadIdx.x; w < checkWords; w += blockDim.x) {
      if (data[w] != Pattern(static_cast<int>(i % kSlots), w)) atomicAdd(errors, 1ull);
    }
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(answer), "l"(i) : "memory");
  }
}

using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 5000;
  WriteValue64 writeValue = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", reinterpret_cast<void**>(&writeValue), 12000,
                                         cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess) {
    std::printf("no cuStreamWriteValue64\n");
    return 1;
  }
  int dev = 0, memOps = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&memOps, static_cast<cudaDeviceAttr>(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS),
                               dev));
  std::printf("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = %d\n", memOps);

  cudaStream_t copies, kernels;
  CHECK(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&kernels, cudaStreamNonBlocking));
  unsigned long long *src, *dst, *signal, *errors, *staging, *answer;
  CHECK(cudaMalloc(&src, kSlots * kWords * 8));
  CHECK(cudaMalloc(&dst, kWords * 8));
  CHECK(cudaMalloc(&signal, 8));
  CHECK(cudaMalloc(&errors, 8));
  CHECK(cudaHostAlloc(&staging, 64 * 8, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&answer, 8, cudaHostAllocMapped));
  unsigned long long* answerDev = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&answerDev), answer, 0));
  FillSources<<<1, 256>>>(src);
  CopyKernel<<<1, 128>>>(dst, src, kWords);  // loaded now: a first launch while Responder runs would wait for it
  CHECK(cudaDeviceSynchronize());

  unsigned long long* hostSrc = nullptr;
  CHECK(cudaHostAlloc(&hostSrc, kSlots * kWords * 8, cudaHostAllocDefault));
  for (int i = 0; i < kSlots * kWords; ++i) hostSrc[i] = Pattern(i / kWords, i % kWords);
  enum Data { kNone, kDeviceKiB, kDeviceWord, kHostKiB, kKernelKiB, kBatchKiB, kBatchOverlapKiB };
  struct Mode {
    const char* name;
    bool staged;
    Data data;
  };
  const Mode modes[] = {{"staged copy + 1 KiB d2d", true, kDeviceKiB},
                        {"write value + 1 KiB d2d", false, kDeviceKiB},
                        {"staged copy only", true, kNone},
                        {"write value only", false, kNone},
                        {"write value + 8 B d2d", false, kDeviceWord},
                        {"write value + 1 KiB h2d", false, kHostKiB},
                        {"write value + 1 KiB d2d batch", false, kBatchKiB},
                        {"write value + 1 KiB d2d batch, overlap", false, kBatchOverlapKiB},
                        {"write value + 1 KiB kernel", false, kKernelKiB}};
  for (int round = 0; round < 3; ++round) {
    for (const Mode& m : modes) {
      const int checkWords = m.data == kNone ? 0 : m.data == kDeviceWord ? 1 : kWords;
      CHECK(cudaMemset(signal, 0, 8));
      CHECK(cudaMemset(errors, 0, 8));
      CHECK(cudaMemset(dst, 0, kWords * 8));
      *answer = 0;
      CHECK(cudaDeviceSynchronize());
      Responder<<<1, kWords, 0, kernels>>>(signal, dst, checkWords, answerDev, iters, errors, 4'000'000'000ll);
      CHECK(cudaGetLastError());
      std::vector<double> us(iters);
      bool lost = false;
      for (int i = 1; i <= iters && !lost; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        const size_t from = static_cast<size_t>(i % kSlots) * kWords;
        if (m.data == kDeviceKiB || m.data == kDeviceWord) {
          CHECK(cudaMemcpyAsync(dst, src + from, checkWords * 8, cudaMemcpyDeviceToDevice, copies));
        } else if (m.data == kHostKiB) {
          CHECK(cudaMemcpyAsync(dst, hostSrc + from, kWords * 8, cudaMemcpyHostToDevice, copies));
        } else if (m.data == kBatchKiB || m.data == kBatchOverlapKiB) {
          void* dsts[1] = {dst};
          const void* srcs[1] = {src + from};
          size_t sizes[1] = {kWords * 8};
          cudaMemcpyAttributes attr{};
          attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          attr.flags = m.data == kBatchOverlapKiB ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
          size_t attrIdx = 0;
          CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &attrIdx, 1, copies));
        } else if (m.data == kKernelKiB) {
          CopyKernel<<<1, 128, 0, copies>>>(dst, src + from, kWords);
        }
        if (m.staged) {
          unsigned long long* word = staging + i % 64;  // reused only 64 rounds later, long after its copy ran
          *word = static_cast<unsigned long long>(i);
          CHECK(cudaMemcpyAsync(signal, word, 8, cudaMemcpyHostToDevice, copies));
        } else {
          CUresult r = writeValue(reinterpret_cast<CUstream>(copies), reinterpret_cast<CUdeviceptr>(signal),
                                  static_cast<cuuint64_t>(i), CU_STREAM_WRITE_VALUE_DEFAULT);
          if (r != CUDA_SUCCESS) {
            std::printf("cuStreamWriteValue64 failed: %d\n", static_cast<int>(r));
            return 1;
          }
        }
        while (*reinterpret_cast<volatile unsigned long long*>(answer) < static_cast<unsigned long long>(i)) {
          if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(5)) {
            lost = true;
            break;
          }
        }
        us[i - 1] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      }
      CHECK(cudaDeviceSynchronize());
      unsigned long long errs = 0;
      CHECK(cudaMemcpy(&errs, errors, 8, cudaMemcpyDeviceToHost));
      if (lost || errs != 0) {
        std::printf("round %d  %-38s FAILED: %s, %llu data errors\n", round, m.name,
                    lost ? "an answer never came" : "every answer came", errs);
        return 1;
      }
      std::sort(us.begin(), us.end());
      std::printf("round %d  %-38s median %6.2f us  p10 %6.2f  p90 %6.2f  p99 %6.2f\n", round, m.name, us[iters / 2],
                  us[iters / 10], us[iters * 9 / 10], us[iters * 99 / 100]);
    }
  }
  return 0;
}
