// What the SHMEM examples share: launch sizes per backend, data that depends on PE and index, symmetric
// allocation that fails loudly, and a sum over all PEs so that every PE reaches the same verdict.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

namespace mori_example {

namespace core = mori::core;
namespace shmem = mori::shmem;

// On HOST every GPU thread is an OS thread: launches stay small there.
constexpr unsigned kThreadsPerBlock = MORI_BACKEND_HOST ? 8 : 256;
constexpr unsigned kMaxBlocks = MORI_BACKEND_HOST ? 4 : 32;

// A byte that depends on the PE that produced it, its index and a seed (which step or pair it belongs to).
MORI_HOST_DEVICE_INLINE uint8_t PatternByte(int pe, size_t index, uint32_t seed) {
  uint64_t x = (static_cast<uint64_t>(pe) + 1) * 0x9E3779B97F4A7C15ull ^ (index + 1) * 0xBF58476D1CE4E5B9ull ^
               (static_cast<uint64_t>(seed) + 1) * 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x * 0xD6E8FEB86659FD93ull >> 56);
}

inline std::vector<uint8_t> Pattern(size_t bytes, int pe, uint32_t seed) {
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = PatternByte(pe, i, seed);
  return out;
}

// Number of bytes in [data, data + bytes) that differ from the pattern of (pe, seed).
inline size_t CountMismatches(const uint8_t* data, size_t bytes, int pe, uint32_t seed) {
  size_t bad = 0;
  for (size_t i = 0; i < bytes; ++i) bad += data[i] != PatternByte(pe, i, seed);
  return bad;
}

inline std::vector<uint8_t> ToHost(const void* p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  MORI_CHECK_GPU(core::GpuMemcpy(out.data(), p, bytes));
  return out;
}

inline void FromHost(void* p, const std::vector<uint8_t>& data) {
  MORI_CHECK_GPU(core::GpuMemcpy(p, data.data(), data.size()));
}

// Collective, like ShmemMalloc; every PE throws together when the heap cannot hold it.
template <typename T>
T* SymmetricAlloc(size_t count, const char* what) {
  void* p = shmem::ShmemMalloc(count * sizeof(T));
  MORI_CHECK(p != nullptr, core::ErrorCode::InvalidUsage,
             "ShmemMalloc(%zu) for %s failed: the symmetric heap has %zu bytes (raise MORI_SHMEM_HEAP_SIZE)",
             count * sizeof(T), what, shmem::ShmemHeapBytes());
  return static_cast<T*>(p);
}

// Waits for the kernels launched so far; a launch or a kernel that failed becomes an exception.
inline void WaitKernels() {
  MORI_CHECK_GPU(core::GpuGetLastError());
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
}

template <typename T>
MORI_GLOBAL void AddToEveryPeKernel(T* sum, T value) {
  for (int pe = 0; pe < shmem::ShmemNPes(); ++pe) shmem::ShmemAtomicTypeAddThread<T>(sum, value, pe);
  shmem::ShmemQuietThread();
}

// Collective: the sum of `value` over all PEs, on every PE.
inline uint64_t SumOverPes(uint64_t value) {
  auto* sum = static_cast<uint64_t*>(shmem::ShmemCalloc(1, sizeof(uint64_t)));
  MORI_CHECK(sum != nullptr, core::ErrorCode::InvalidUsage, "ShmemCalloc of one word failed");
  core::LaunchKernel(AddToEveryPeKernel<uint64_t>, core::Dim3(1), core::Dim3(1), 0, nullptr, sum, value);
  WaitKernels();
  shmem::ShmemBarrierAll();
  uint64_t total = 0;
  MORI_CHECK_GPU(core::GpuMemcpy(&total, sum, sizeof(total)));
  shmem::ShmemFree(sum);
  return total;
}

// Starts the runtime from the launch environment (mpirun, MORI_* variables or torchrun).
inline void InitOrThrow() {
  MORI_CHECK(shmem::ShmemInit() == 0, core::ErrorCode::InvalidUsage, "ShmemInit failed (see the log line above)");
}

inline void FinalizeOrThrow() {
  MORI_CHECK(shmem::ShmemFinalize() == 0, core::ErrorCode::InvalidUsage, "ShmemFinalize failed");
}

// main() of every example: runs `run`, turning a mori error into its message and exit code 1.
inline int ExampleMain(const char* name, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const mori::core::Error& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace mori_example
