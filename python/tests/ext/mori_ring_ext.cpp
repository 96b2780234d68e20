// A PyTorch C++ extension (CUDA source on GPU backends) that calls mori's device API from its own kernels: it
// includes shmem_device_api.hpp and links libmori_shmem, so its copy of the device state registers itself when
// torch loads it (mori.shmem.module_init() checks that every module holds the state). test_extension.py builds
// it with torch.utils.cpp_extension.load.
#include <torch/extension.h>

#include <cstdint>

#include "mori/core/kernel.hpp"
#include "mori/shmem/shmem_device_api.hpp"
#if MORI_BACKEND_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using namespace mori;

// What the extension's kernels see of the runtime.
MORI_GLOBAL void QueryKernel(int32_t* out) {
  out[0] = shmem::ShmemMyPe();
  out[1] = shmem::ShmemNPes();
  out[2] = shmem::ShmemTeamNPes(shmem::kShmemTeamWorld);
  out[3] = shmem::ShmemTeamMyPe(shmem::kShmemTeamNode);
}

// All-gather: block b puts this PE's block into row `me` of PE (me + b) % n's `out` with a signal; the first
// thread of block 0 then waits until this PE's signal reaches `expected`.
MORI_GLOBAL void AllGatherKernel(float* out, const float* src, int64_t count, uint64_t* sig, uint64_t expected) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int b = static_cast<int>(core::FlatBlockIdx());
  shmem::ShmemPutMemNbiSignalBlock(out + static_cast<int64_t>(me) * count, src, static_cast<size_t>(count) * 4, sig,
                                   1, shmem::SignalOp::Add, (me + b) % n);
  if (b == 0 && core::FlatThreadIdx() == 0) shmem::ShmemSignalWaitUntil(sig, shmem::CmpOp::GE, expected);
}

core::GpuStream CurrentStream() {
#if MORI_BACKEND_CUDA
  return c10::cuda::getCurrentCUDAStream().stream();
#else
  return nullptr;
#endif
}

// Launch errors raise. On HOST the kernel's host threads finish before the call returns, as CPU tensors expect.
void Check(const char* what) {
  core::GpuStatus s = core::GpuGetLastError();
#if MORI_BACKEND_HOST
  if (s == core::kGpuSuccess) s = core::GpuDeviceSynchronize();
#endif
  TORCH_CHECK(s == core::kGpuSuccess, what, ": the kernel failed: ", core::GpuGetErrorString(s));
}

torch::Tensor Query(torch::Tensor out) {
  TORCH_CHECK(out.dtype() == torch::kInt32 && out.numel() >= 4 && out.is_contiguous(), "4 int32 elements");
  core::LaunchKernel(QueryKernel, core::Dim3(1), core::Dim3(1), 0, CurrentStream(), out.data_ptr<int32_t>());
  Check("query");
  return out;
}

void AllGather(torch::Tensor out, torch::Tensor src, torch::Tensor sig, int64_t expected) {
  TORCH_CHECK(out.dtype() == torch::kFloat32 && src.dtype() == torch::kFloat32 && sig.dtype() == torch::kInt64,
              "float32 out and src, int64 signal");
  const int n = shmem::ShmemNPes();
  TORCH_CHECK(out.is_contiguous() && src.is_contiguous() && out.numel() == n * src.numel(), "out is [n, count]");
  core::LaunchKernel(AllGatherKernel, core::Dim3(static_cast<unsigned>(n)), core::Dim3(32), 0, CurrentStream(),
                     out.data_ptr<float>(), src.data_ptr<float>(), src.numel(),
                     reinterpret_cast<uint64_t*>(sig.data_ptr<int64_t>()), static_cast<uint64_t>(expected));
  Check("all-gather");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("query", &Query, "ShmemMyPe, ShmemNPes, world and node team queries from the extension's kernel");
  m.def("all_gather", &AllGather, "all-gather with put-with-signal from the extension's kernel");
}
