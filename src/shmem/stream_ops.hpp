// The library's own kernels (stream_ops.cpp): the host calls that are ordered on a stream.
#pragma once

#include <cstddef>

#include "mori/core/gpu.hpp"

namespace mori::shmem::detail {

// Loads the kernels of stream_ops.cpp (ShmemInit calls it): CUDA would otherwise load them at their first
// launch, which waits for the device to go idle, and a kernel waiting for that launch's work never does.
void PreloadStreamKernels();
// Launches a one-thread kernel on `stream` that quiets every PE: what earlier kernels posted and left
// unquieted (RDMA work requests, proxy requests) completes before the kernel ends.
void LaunchQuietAll(core::GpuStream stream);

// Whether this PE's kernels may use [p, p + bytes) as the local side of an operation with `pe` (shmem_api.cpp;
// false before ShmemInit).
bool LocalReachable(const void* p, size_t bytes, int pe);

}  // namespace mori::shmem::detail
