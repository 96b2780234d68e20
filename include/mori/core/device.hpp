// The one header that decides which backend is compiled and whether this pass compiles device code.
// Everything else in mori asks these macros; nothing tests __CUDA_ARCH__ or __HIP_DEVICE_COMPILE__ itself.
#pragma once

#include "mori/core/config.hpp"

#if MORI_BACKEND_CUDA + MORI_BACKEND_HIP + MORI_BACKEND_HOST != 1
#error "mori/core/config.hpp must select exactly one backend"
#endif

#define MORI_BACKEND_GPU (MORI_BACKEND_CUDA || MORI_BACKEND_HIP)

// 1 when this translation unit goes through the GPU compiler of the backend (nvcc or hipcc), so that
// __device__ and <<<>>> exist. On HOST there is no GPU compiler and every device function is plain C++.
#if (MORI_BACKEND_CUDA && defined(__CUDACC__)) || (MORI_BACKEND_HIP && defined(__HIPCC__))
#define MORI_GPU_COMPILER 1
#else
#define MORI_GPU_COMPILER 0
#endif

// 1 in the device pass of a GPU compiler (the code that runs on the GPU), 0 in host passes and on HOST.
#if MORI_GPU_COMPILER && (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
#define MORI_DEVICE_COMPILE 1
#else
#define MORI_DEVICE_COMPILE 0
#endif

// Device functions can be called from this translation unit: any TU on HOST, GPU-compiler TUs otherwise.
#define MORI_DEVICE_API_AVAILABLE (MORI_GPU_COMPILER || MORI_BACKEND_HOST)

#if MORI_BACKEND_HIP && MORI_GPU_COMPILER
#include <hip/hip_runtime.h>  // __device__, __forceinline__ and friends are macros of the HIP headers
#endif

#if MORI_GPU_COMPILER
#define MORI_DEVICE __device__
#define MORI_HOST_DEVICE __host__ __device__
#define MORI_GLOBAL __global__
#define MORI_DEVICE_INLINE __device__ __forceinline__
#define MORI_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define MORI_DEVICE
#define MORI_HOST_DEVICE
#define MORI_GLOBAL
#define MORI_DEVICE_INLINE inline
#define MORI_HOST_DEVICE_INLINE inline
#endif

// A device function kept out of line: the cold paths of the device API (failure reports, the RDMA and Proxy
// transports) are called, not inlined, so a kernel that only uses P2P keeps few registers and no stack frame
// on its hot path. Header-defined like every device function (inline linkage, no -rdc needed).
#if MORI_GPU_COMPILER
#define MORI_DEVICE_NOINLINE __device__ __noinline__ inline
#else
#define MORI_DEVICE_NOINLINE inline __attribute__((noinline))
#endif

// Unrolls the loop that follows, for the GPU compilers (a host compiler would warn of an unknown pragma).
#if MORI_GPU_COMPILER
#define MORI_UNROLL _Pragma("unroll")
#else
#define MORI_UNROLL
#endif

// Branch hints for the checks on hot paths: the failing side is laid out of the way.
#define MORI_LIKELY(...) __builtin_expect(!!(__VA_ARGS__), 1)
#define MORI_UNLIKELY(...) __builtin_expect(!!(__VA_ARGS__), 0)

// The most threads per block a kernel is ever launched with, so the compiler fits its registers to it. On
// NVIDIA GPUs a kernel that calls the SHMEM device API uses more than 64 registers per thread unless told:
// launches beyond 512 threads per block then fail with "too many resources requested for launch".
//   MORI_GLOBAL void MORI_LAUNCH_BOUNDS(1024) MyKernel(...)
// One resident block per SM is asked for, which lets the compiler use every register that block size
// allows: with the bound alone, ptxas may aim for two blocks per SM and cap a kernel that makes calls at 32
// registers, spilling its loop state to local memory (measured on shmem_bench's put loop: 84 bytes of
// spills, every iteration reloading them).
#if MORI_GPU_COMPILER
#define MORI_LAUNCH_BOUNDS(maxThreadsPerBlock) __launch_bounds__(maxThreadsPerBlock, 1)
#else
#define MORI_LAUNCH_BOUNDS(maxThreadsPerBlock)
#endif

// Threads that execute in lockstep: a CUDA warp, an AMD wavefront (64 on the gfx9 family we build for),
// and on HOST a single host thread.
#if MORI_BACKEND_CUDA
#define MORI_WARP_SIZE 32
#elif MORI_BACKEND_HIP
#define MORI_WARP_SIZE 64
#else
#define MORI_WARP_SIZE 1
#endif

#define MORI_STRINGIFY_IMPL(x) #x
#define MORI_STRINGIFY(x) MORI_STRINGIFY_IMPL(x)
