// Does a FIFO push's release fence overlap its claim? A push is: read tailSeen and fetch-add head (device
// memory, both in flight together), compare the claim with the room seen, fence, then one 16-byte store of
// the slot into host-pinned memory. fifo_bench's step costs (claim about 640 SM cycles, system fence about
// 1,030) add up to the push's time, so the two run one after the other. Variants, each in inline PTX:
//   claim-then-fence  the order mori uses: the compare (which waits for the claim) is issued before the fence
//   fence-on-claim    the fence issued while the claim is in flight; the compare reads the claim through a
//                     shared-memory load that the fence orders after it, so ptxas cannot hoist it
//   fence-first       the fence, then the claim
//   payload-only      no fence (the floor of the push)
// each at system scope and at device scope, after a 16-byte store to device memory (what a put's source
// write leaves in flight) or with nothing before. Two measures: the push alone in SM cycles (clock64), and a
// round trip through a host thread that polls the ring and answers in a pinned word (median ns). Not part
// of the build (mori's Push from the tree beside them, so the CUDA build's include folder is needed):
//   nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -Iinclude -Ibuild-cuda/include \
//     -o push_overlap bench/experiments/push_overlap.cu && ./push_overlap
//   cuobjdump -sass -fun Push push_overlap   (to see the order ptxas chose)
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "check.cuh"
#include "mori/channels/fifo_device.hpp"

enum Variant : int {
  kClaimThenFence,
  kFenceOnClaim,
  kFenceFirst,
  kPayloadOnly,
  kClaimThenRelease,  // fence.release instead of fence.acq_rel
  kReleaseOnClaim,
  kReleaseStore,  // st.release.v2 of the slot, no separate fence
  kMoriPush,      // mori's FifoDeviceHandle::Push of the tree (AfterWrites / AfterDeviceWrites)
  kMoriPayload,   // the same, PayloadOnly
  kVariants
};
const char* kVariantNames[kVariants] = {"claim-then-fence", "fence-on-claim", "fence-first", "payload-only",
                                        "claim-then-release", "release-on-claim", "release-store", "mori push",
                                        "mori payload-only"};

constexpr uint32_t kRing = 1024;

template <bool kReleaseOnly = false>
__device__ __forceinline__ void Fence(bool sys) {
  if (kReleaseOnly) {
    if (sys) {
      asm volatile("fence.release.sys;" ::: "memory");
    } else {
      asm volatile("fence.release.gpu;" ::: "memory");
    }
  } else if (sys) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  } else {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
}

__device__ __forceinline__ void StoreSlot(uint4* slot, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(a), "l"(b) : "memory");
}

// One push of `value` in the given variant; returns the claimed slot. `zero` is a shared word holding 0.
template <int V, bool kSys>
__device__ __noinline__ uint64_t Push(uint4* ring, uint64_t* head, const uint64_t* tailSeen, const uint32_t* zero,
                                      uint64_t value) {
  if constexpr (V == kMoriPush || V == kMoriPayload) {
    mori::core::FifoDeviceHandle fifo{};
    fifo.triggers = reinterpret_cast<mori::core::ProxyTrigger*>(ring);
    fifo.head = head;
    fifo.tail = const_cast<uint64_t*>(tailSeen);
    fifo.tailSeen = const_cast<uint64_t*>(tailSeen);
    fifo.size = kRing;
    fifo.timeoutNs = 1000000000ull;
    const mori::core::FifoOrder order = V == kMoriPayload ? mori::core::FifoOrder::PayloadOnly
                                        : kSys            ? mori::core::FifoOrder::AfterWrites
                                                          : mori::core::FifoOrder::AfterDeviceWrites;
    return fifo.Push(mori::core::ProxyTrigger{value, value}, order);
  }
  uint64_t seen, first;
  if (V == kFenceFirst) Fence(kSys);
  asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(seen) : "l"(tailSeen) : "memory");
  asm volatile("atom.relaxed.gpu.add.u64 %0, [%1], 1;" : "=l"(first) : "l"(head) : "memory");
  if (V == kFenceOnClaim || V == kReleaseOnClaim) {
    Fence<V == kReleaseOnClaim>(kSys);
    uint32_t z;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(z) : "l"(zero) : "memory");
    first += z;
  }
  if (first + 1 > seen + kRing) {
    __trap();  // never here: tailSeen is set far ahead
  }
  if (V == kClaimThenFence) Fence(kSys);
  if (V == kClaimThenRelease) Fence<true>(kSys);
  if (V == kReleaseStore) {
    uint4* slot = ring + (first & (kRing - 1));
    if (kSys) {
      asm volatile("st.release.sys.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(value), "l"(value) : "memory");
    } else {
      asm volatile("st.release.gpu.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(value), "l"(value) : "memory");
    }
    return first;
  }
  StoreSlot(ring + (first & (kRing - 1)), value, value);
  return first;
}

// Step costs: iters pushes, each after (optionally) a 16-byte store to device memory, clock64 around the push.
template <int V, bool kSys>
__global__ void CyclesKernel(uint4* ring, uint64_t* head, const uint64_t* tailSeen, uint4* scratch, bool storeBefore,
                             uint32_t iters, uint64_t* cycles) {
  __shared__ uint32_t zero;
  zero = 0;
  __syncthreads();
  for (uint32_t i = 0; i < iters; ++i) {
    if (storeBefore) scratch[i & 255] = make_uint4(i, i + 1, i + 2, i + 3);
    long long t0 = clock64();
    uint64_t f = Push<V, kSys>(ring, head, tailSeen, &zero, (1ull << 62) | i);
    long long t1 = clock64();
    if (f == ~0ull) scratch[0].x = 0;
    cycles[i] = static_cast<uint64_t>(t1 - t0);
    // Let the slot store drain before the next round, so each push starts from the same state.
    for (long long t = clock64(); clock64() - t < 4000;) {
    }
  }
}

// Round trip: push value i, wait until the host thread answers i in *answer (pinned).
template <int V, bool kSys>
__global__ void RoundTripKernel(uint4* ring, uint64_t* head, const uint64_t* tailSeen, uint4* scratch, bool storeBefore,
                                uint32_t iters, const uint64_t* answer, uint64_t* times, uint64_t base) {
  __shared__ uint32_t zero;
  zero = 0;
  __syncthreads();
  for (uint32_t i = 0; i < iters; ++i) {
    const uint64_t value = base + i + 1;
    if (storeBefore) scratch[i & 255] = make_uint4(i, i + 1, i + 2, i + 3);
    uint64_t t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    Push<V, kSys>(ring, head, tailSeen, &zero, value);
    uint64_t a = 0, t1 = 0;
    for (uint64_t spins = 0;; ++spins) {
      asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(a) : "l"(answer) : "memory");
      if (a == value) break;
      if (spins > (1ull << 28)) __trap();
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    times[i] = t1 - t0;
  }
}

uint64_t Median(std::vector<uint64_t> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <int V, bool kSys>
void Measure(uint4* ring, uint64_t* head, uint64_t* tailSeen, uint4* scratch, uint64_t* answer, uint64_t* dTimes,
             uint64_t& base, bool storeBefore) {
  constexpr uint32_t kCycleIters = 2000, kTripIters = 5000;
  std::vector<uint64_t> h(kTripIters);
  CyclesKernel<V, kSys><<<1, 1>>>(ring, head, tailSeen, scratch, storeBefore, kCycleIters, dTimes);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(h.data(), dTimes, kCycleIters * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  std::vector<uint64_t> c(h.begin() + 100, h.begin() + kCycleIters);
  const uint64_t cycles = Median(c);

  // The host thread: reads slots in order, answers each slot's value.
  uint64_t headNow = 0;
  CHECK(cudaMemcpy(&headNow, head, sizeof(headNow), cudaMemcpyDeviceToHost));
  std::atomic<bool> go{true};
  volatile uint4* vring = ring;
  std::thread echo([&] {
    for (uint32_t i = 0; i < kTripIters; ++i) {
      const uint64_t want = base + i + 1;
      volatile uint64_t* slot = reinterpret_cast<volatile uint64_t*>(vring + ((headNow + i) & (kRing - 1)));
      while ((slot[1] & ~(1ull << 63)) != want) {
        if (!go.load(std::memory_order_relaxed)) return;
      }
      std::atomic_thread_fence(std::memory_order_seq_cst);
      *reinterpret_cast<volatile uint64_t*>(answer) = want;
    }
  });
  RoundTripKernel<V, kSys><<<1, 1>>>(ring, head, tailSeen, scratch, storeBefore, kTripIters, answer, dTimes, base);
  cudaError_t e = cudaDeviceSynchronize();
  go = false;
  echo.join();
  CHECK(e);
  base += kTripIters;
  CHECK(cudaMemcpy(h.data(), dTimes, kTripIters * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  std::vector<uint64_t> t(h.begin() + 200, h.end());
  std::sort(t.begin(), t.end());
  std::printf("%-17s %-6s %-13s push %5llu cycles   round trip median %5llu ns  p10 %5llu  p90 %5llu\n",
              kVariantNames[V], kSys ? "system" : "device", storeBefore ? "after store" : "nothing before",
              static_cast<unsigned long long>(cycles), static_cast<unsigned long long>(t[t.size() / 2]),
              static_cast<unsigned long long>(t[t.size() / 10]), static_cast<unsigned long long>(t[t.size() * 9 / 10]));
}

template <bool kSys>
void Round(uint4* ring, uint64_t* head, uint64_t* tailSeen, uint4* scratch, uint64_t* answer, uint64_t* dTimes,
           uint64_t& base, bool storeBefore) {
  Measure<kClaimThenFence, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
  Measure<kFenceOnClaim, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
  Measure<kFenceFirst, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
  Measure<kClaimThenRelease, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
  Measure<kReleaseOnClaim, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
  Measure<kReleaseStore, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
  Measure<kMoriPush, kSys>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
}

int main() {
  uint4* ring = nullptr;
  uint64_t* answer = nullptr;
  CHECK(cudaHostAlloc(&ring, kRing * sizeof(uint4), cudaHostAllocMapped));
  CHECK(cudaHostAlloc(&answer, sizeof(uint64_t), cudaHostAllocMapped));
  std::fill(reinterpret_cast<char*>(ring), reinterpret_cast<char*>(ring + kRing), 0);
  *answer = 0;
  uint64_t *head, *tailSeen, *dTimes;
  uint4* scratch;
  CHECK(cudaMalloc(&head, 8));
  CHECK(cudaMalloc(&tailSeen, 8));
  CHECK(cudaMalloc(&scratch, 256 * sizeof(uint4)));
  CHECK(cudaMalloc(&dTimes, 8 * 5000));
  CHECK(cudaMemset(head, 0, 8));
  const uint64_t far = 1ull << 60;
  CHECK(cudaMemcpy(tailSeen, &far, 8, cudaMemcpyHostToDevice));
  uint64_t base = 0;
  for (int round = 0; round < 2; ++round) {
    std::printf("-- round %d\n", round + 1);
    for (bool storeBefore : {true, false}) {
      Round<true>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
      Round<false>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
      Measure<kPayloadOnly, true>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
      Measure<kMoriPayload, true>(ring, head, tailSeen, scratch, answer, dTimes, base, storeBefore);
    }
  }
  std::printf("done\n");
  return 0;
}
