// A second translation unit that includes the device API: its own copy of the device state must be
// uploaded by ShmemInit too (on CUDA and HIP each file has its own constant memory without -rdc).
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/shmem/shmem_device_api.hpp"

namespace mori::shmem::test {

namespace {
MORI_GLOBAL void SecondTuKernel(uint64_t* words) {
  words[0] = static_cast<uint64_t>(ShmemMyPe()) + 1000;
  words[1] = static_cast<uint64_t>(ShmemNPes());
  ShmemPutTypeImmNbiThread<uint64_t>(&words[2], 0xC0FFEEull, ShmemMyPe());
  ShmemQuietThread();
}
}  // namespace

// Runs a kernel of this file on `words` (3 symmetric uint64_t); returns the GPU status.
int LaunchFromSecondTranslationUnit(uint64_t* words) {
  core::LaunchKernel(SecondTuKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, words);
  core::GpuStatus launched = core::GpuGetLastError();
  if (launched != core::kGpuSuccess) return static_cast<int>(launched);
  return static_cast<int>(core::GpuDeviceSynchronize());
}

}  // namespace mori::shmem::test
