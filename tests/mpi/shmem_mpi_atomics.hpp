// The atomics tests of the SHMEM MPI suite: every atomic of one width from every thread to every PE at once.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "shmem_mpi_test.hpp"

namespace mori::shmem::mpi_test {

template <typename T>
MORI_GLOBAL void AtomicKernel(T* counters, T* tickets, int iters, uint32_t* errors) {
  int n = ShmemNPes();
  for (int i = 0; i < iters; ++i) {
    for (int pe = 0; pe < n; ++pe) {
      // counters[0]: fetch-add 3; [2]: add 5; [4]: compare-swap increments; [6]: fetch-inc.
      ShmemAtomicTypeFetchAddThread<T>(&counters[0], T(3), pe);
      ShmemAtomicTypeAddThread<T>(&counters[2], T(5), pe);
      T seen = ShmemAtomicTypeFetchThread<T>(&counters[4], pe);
      for (;;) {
        T old = ShmemAtomicTypeCompareSwapThread<T>(&counters[4], seen, T(seen + 1), pe);
        if (old == seen) break;
        seen = old;
      }
      T ticket = ShmemAtomicTypeFetchIncThread<T>(&counters[6], pe);
      // Every ticket (they start at 60) is handed out once: mark it.
      T was = ShmemAtomicTypeSwapThread<T>(&tickets[static_cast<size_t>(ticket) - 60], T(1), pe);
      if (was != T(0)) core::AtomicFetchAdd(errors, 1u);
    }
  }
  ShmemQuietThread();
}

// Threads per block and iterations of the atomics tests; MORI_TEST_ATOMICS="threads,iters" overrides them (to
// measure how the time scales with contention).
// On a GPU whose atomics go through a NIC or the proxy (any PE reached over RDMA or Proxy), every atomic is a
// round trip through the emulated NIC or a proxy connection, which executes an atomic on GPU memory with
// synchronous copies (tens of microseconds), and the compare-swap increments retry once per competing thread:
// the work grows with the square of the threads. Measured on an H100 (2 PEs under MPS, rdma, 5 iterations):
// 4 / 8 / 16 / 32 threads per block took 2 / 3 / 4 / 8 s (uint64) and 3 / 5 / 7 / 14 s (int32); 32 threads and
// 50 iterations did not finish in 150 s; through the proxy over the emulated NIC (one request at a time),
// 8 threads and 10 iterations of the four tests took 263 s. There the test keeps every kind of contention
// (lanes of a warp, two blocks, every PE on one word) at 4 threads per block and 5 iterations.
inline bool AtomicsThroughNicOrProxy() {
  for (int pe = 0; pe < N(); ++pe) {
    TransportType t = ShmemTransportType(pe);
    if (t == TransportType::RDMA || t == TransportType::Proxy) return true;
  }
  return false;
}

inline std::pair<unsigned, int> AtomicsShape() {
  unsigned tpb = MORI_BACKEND_HOST ? 3 : AtomicsThroughNicOrProxy() ? 4 : 32;
  int iters = MORI_BACKEND_HOST ? 20 : AtomicsThroughNicOrProxy() ? 5 : 50;
  if (const char* v = std::getenv("MORI_TEST_ATOMICS")) {
    unsigned t = 0;
    int i = 0;
    if (std::sscanf(v, "%u,%d", &t, &i) == 2 && t > 0 && i > 0) {
      tpb = t;
      iters = i;
    }
  }
  return {tpb, iters};
}

template <typename T>
void RunAtomics() {
  const auto [tpb, iters] = AtomicsShape();
  const size_t total = static_cast<size_t>(N()) * kBlocks * tpb * static_cast<size_t>(iters);
  T* counters = static_cast<T*>(ShmemMalloc(8 * sizeof(T)));
  T* tickets = static_cast<T*>(ShmemCalloc(total, sizeof(T)));
  auto* errors = static_cast<uint32_t*>(ShmemCalloc(1, 4));
  ASSERT_TRUE(counters && tickets && errors);
  std::vector<T> init(8);
  for (int k = 0; k < 8; ++k) init[k] = (k & 1) ? T(0x5A5A5A5A) : T(10 * k);  // odd slots: untouched neighbours
  ASSERT_EQ(core::GpuMemcpy(counters, init.data(), 8 * sizeof(T)), core::kGpuSuccess);
  ShmemBarrierAll();
  core::LaunchKernel(AtomicKernel<T>, Dim3(kBlocks), Dim3(tpb), 0, nullptr, counters, tickets, iters, errors);
  MORI_CHECK_KERNEL();
  ShmemBarrierAll();
  std::vector<T> got(8);
  ASSERT_EQ(core::GpuMemcpy(got.data(), counters, 8 * sizeof(T)), core::kGpuSuccess);
  EXPECT_EQ(got[0], T(0 + 3 * total));
  EXPECT_EQ(got[2], T(20 + 5 * total));
  EXPECT_EQ(got[4], T(40 + total));
  EXPECT_EQ(got[6], T(60 + total));
  for (int k = 1; k < 8; k += 2) EXPECT_EQ(got[k], T(0x5A5A5A5A)) << "neighbour word " << k << " was touched";
  uint32_t errs = 0;
  ASSERT_EQ(core::GpuMemcpy(&errs, errors, 4), core::kGpuSuccess);
  EXPECT_EQ(errs, 0u) << "tickets handed out twice";
  // Tickets 60 .. 60 + total - 1 were handed out here, each marked once.
  std::vector<T> marks(total);
  ASSERT_EQ(core::GpuMemcpy(marks.data(), tickets, total * sizeof(T)), core::kGpuSuccess);
  size_t marked = 0;
  for (T m : marks) marked += m == T(1);
  EXPECT_EQ(marked, total);
  ShmemBarrierAll();
  ShmemFree(errors);
  ShmemFree(tickets);
  ShmemFree(counters);
}

}  // namespace mori::shmem::mpi_test
