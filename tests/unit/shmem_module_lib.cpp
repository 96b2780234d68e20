// A separately built module (a shared library, as a PyTorch extension is) that includes the device API and is
// loaded with dlopen after ShmemInit: its own copy of the device state must reach its kernels.
#include <cstdint>

#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/shmem/shmem_device_api.hpp"

namespace {
MORI_GLOBAL void ModuleKernel(uint64_t* words) {
  words[0] = static_cast<uint64_t>(mori::shmem::ShmemMyPe()) + 7000;
  words[1] = static_cast<uint64_t>(mori::shmem::ShmemTeamNPes(mori::shmem::kShmemTeamWorld));
  mori::shmem::ShmemPutTypeImmNbiThread<uint64_t>(&words[2], 0xD15C0ull, mori::shmem::ShmemMyPe());
  mori::shmem::ShmemQuietThread();
}
}  // namespace

// Runs the module's kernel on `words` (3 symmetric uint64_t); returns the GPU status.
extern "C" __attribute__((visibility("default"))) int MoriTestModuleRun(uint64_t* words) {
  mori::core::LaunchKernel(ModuleKernel, mori::core::Dim3(1), mori::core::Dim3(1), 0, nullptr, words);
  mori::core::GpuStatus launched = mori::core::GpuGetLastError();
  if (launched != mori::core::kGpuSuccess) return static_cast<int>(launched);
  return static_cast<int>(mori::core::GpuDeviceSynchronize());
}
