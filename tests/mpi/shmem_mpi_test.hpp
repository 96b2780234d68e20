// Helpers of the SHMEM MPI suite, shared by its translation units (split so that the HIP build, whose device
// compilation of the one file took 305 s, the atomics 190 s of it, compiles them side by side).
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <dirent.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/logging.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

#if MORI_BACKEND_CUDA
#include <cuda.h>  // modules loaded by handle
#endif

namespace mori::shmem::mpi_test {

using core::Dim3;
using core::test::PatternByte;

constexpr uint8_t kGuard = 0xA5;
constexpr unsigned kBlocks = 2;
constexpr unsigned kThreads = 4;  // per block; on GPUs the warp and block variants use 64 threads per block

inline unsigned ThreadsPerBlock() { return MORI_BACKEND_HOST ? kThreads : 64; }

#define MORI_CHECK_KERNEL()                             \
  do {                                                  \
    ASSERT_EQ(core::GpuGetLastError(), core::kGpuSuccess); \
    ASSERT_EQ(core::GpuDeviceSynchronize(), core::kGpuSuccess); \
  } while (0)

inline int Me() { return ShmemMyPe(); }
inline int N() { return ShmemNPes(); }

inline std::vector<uint8_t> ToHost(const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(core::GpuMemcpy(out.data(), p, bytes), core::kGpuSuccess);
  return out;
}

inline void FromHost(void* p, const std::vector<uint8_t>& data) {
  ASSERT_EQ(core::GpuMemcpy(p, data.data(), data.size()), core::kGpuSuccess);
}

// Symmetric buffer of `bytes` filled with the guard byte.
inline uint8_t* GuardedBuffer(size_t bytes) {
  auto* p = static_cast<uint8_t*>(ShmemMalloc(bytes));
  EXPECT_NE(p, nullptr);
  if (p != nullptr) FromHost(p, std::vector<uint8_t>(bytes, kGuard));
  ShmemBarrierAll();
  return p;
}

// Checks [0, bytes) of `got`: [begin, end) holds PatternByte(rank, i - begin, seed), the rest is the guard.
inline void ExpectRegion(const std::vector<uint8_t>& got, size_t begin, size_t end, int rank, uint32_t seed,
                  const char* what) {
  size_t bad = 0, first = SIZE_MAX;
  for (size_t i = 0; i < got.size(); ++i) {
    uint8_t want = i >= begin && i < end ? PatternByte(rank, i - begin, seed) : kGuard;
    if (got[i] != want) {
      ++bad;
      if (first == SIZE_MAX) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " wrong bytes on PE " << Me() << ", first at " << first
                     << " (data from PE " << rank << " expected in [" << begin << ", " << end << "))";
}

}  // namespace mori::shmem::mpi_test
