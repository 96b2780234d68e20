// Kernels written once for every backend: thread and block indices, block barriers, dynamic shared memory
// and a launcher. On HOST a kernel is a grid of host threads started on a stream's worker thread, so a
// launch returns at once and the host goes on while the "GPU" runs, as it does with a real GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <sched.h>
#include <tuple>
#include <type_traits>
#include <utility>

#include "mori/core/device.hpp"
#include "mori/core/gpu.hpp"

namespace mori::core {

#if MORI_BACKEND_HOST

struct Dim3 {
  unsigned x, y, z;
  constexpr Dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

namespace host {

class BlockBarrier;

// What a host thread knows of its place in a launch. Outside any launch a host thread is thread 0 of a
// grid of one block of one thread, so device functions called from plain host code behave as one thread.
struct ThreadContext {
  Dim3 threadIdx{0, 0, 0};
  Dim3 blockIdx{0, 0, 0};
  Dim3 blockDim{1, 1, 1};
  Dim3 gridDim{1, 1, 1};
  BlockBarrier* barrier = nullptr;  // shared by the threads of one block
  void* sharedMemory = nullptr;     // the block's dynamic shared memory
  const bool* aborted = nullptr;    // set (atomically) once any thread of the launch has failed
};

ThreadContext& CurrentThread();
void BlockSync();

// Yields the core; inside a launch whose other thread has failed it ends this thread too, as a trap
// ends a whole kernel on a GPU (so no thread polls forever for a peer that is gone).
void SpinPause();

// The largest launch the HOST backend accepts: every "GPU thread" is an OS thread.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxThreadsPerLaunch = 4096;

// Enqueues `body` to run once in each thread of a grid x block launch on `stream`. An invalid
// configuration is reported by GpuGetLastError(); a thread that traps makes the next synchronisation of
// the stream return kGpuErrorLaunchFailure.
void Launch(Dim3 grid, Dim3 block, size_t sharedBytes, GpuStream stream, std::function<void()> body);

// Thrown by DeviceTrap() on HOST; the launcher catches it and fails the launch.
struct KernelTrap {
  const char* reason;
  bool stop = false;  // a thread leaving because the process is ending (core/stop.hpp), not a failure
};

}  // namespace host

#else

using Dim3 = dim3;

#endif

#if MORI_DEVICE_API_AVAILABLE

#if MORI_BACKEND_HOST
MORI_DEVICE_INLINE unsigned ThreadIdxX() { return host::CurrentThread().threadIdx.x; }
MORI_DEVICE_INLINE unsigned ThreadIdxY() { return host::CurrentThread().threadIdx.y; }
MORI_DEVICE_INLINE unsigned ThreadIdxZ() { return host::CurrentThread().threadIdx.z; }
MORI_DEVICE_INLINE unsigned BlockIdxX() { return host::CurrentThread().blockIdx.x; }
MORI_DEVICE_INLINE unsigned BlockIdxY() { return host::CurrentThread().blockIdx.y; }
MORI_DEVICE_INLINE unsigned BlockIdxZ() { return host::CurrentThread().blockIdx.z; }
MORI_DEVICE_INLINE unsigned BlockDimX() { return host::CurrentThread().blockDim.x; }
MORI_DEVICE_INLINE unsigned BlockDimY() { return host::CurrentThread().blockDim.y; }
MORI_DEVICE_INLINE unsigned BlockDimZ() { return host::CurrentThread().blockDim.z; }
MORI_DEVICE_INLINE unsigned GridDimX() { return host::CurrentThread().gridDim.x; }
MORI_DEVICE_INLINE unsigned GridDimY() { return host::CurrentThread().gridDim.y; }
MORI_DEVICE_INLINE unsigned GridDimZ() { return host::CurrentThread().gridDim.z; }
MORI_DEVICE_INLINE void SyncThreads() { host::BlockSync(); }
MORI_HOST_DEVICE_INLINE void SpinPause() { host::SpinPause(); }
template <typename T>
MORI_DEVICE_INLINE T* DynamicSharedMemory() {
  return static_cast<T*>(host::CurrentThread().sharedMemory);
}
#else
MORI_DEVICE_INLINE unsigned ThreadIdxX() { return threadIdx.x; }
MORI_DEVICE_INLINE unsigned ThreadIdxY() { return threadIdx.y; }
MORI_DEVICE_INLINE unsigned ThreadIdxZ() { return threadIdx.z; }
MORI_DEVICE_INLINE unsigned BlockIdxX() { return blockIdx.x; }
MORI_DEVICE_INLINE unsigned BlockIdxY() { return blockIdx.y; }
MORI_DEVICE_INLINE unsigned BlockIdxZ() { return blockIdx.z; }
MORI_DEVICE_INLINE unsigned BlockDimX() { return blockDim.x; }
MORI_DEVICE_INLINE unsigned BlockDimY() { return blockDim.y; }
MORI_DEVICE_INLINE unsigned BlockDimZ() { return blockDim.z; }
MORI_DEVICE_INLINE unsigned GridDimX() { return gridDim.x; }
MORI_DEVICE_INLINE unsigned GridDimY() { return gridDim.y; }
MORI_DEVICE_INLINE unsigned GridDimZ() { return gridDim.z; }
MORI_DEVICE_INLINE void SyncThreads() { __syncthreads(); }
// One iteration's pause inside a polling loop: GPUs poll flat out, the latency of one poll is the point;
// host threads of a GPU backend (using the device primitives) give their core away.
MORI_HOST_DEVICE_INLINE void SpinPause() {
#if !MORI_DEVICE_COMPILE
  sched_yield();
#endif
}
template <typename T>
MORI_DEVICE_INLINE T* DynamicSharedMemory() {
  extern __shared__ __align__(16) unsigned char moriDynamicShared[];
  return reinterpret_cast<T*>(moriDynamicShared);
}
#endif

// Linear thread index within the block and linear block index within the grid.
MORI_DEVICE_INLINE unsigned FlatThreadIdx() {
  return ThreadIdxX() + BlockDimX() * (ThreadIdxY() + BlockDimY() * ThreadIdxZ());
}
MORI_DEVICE_INLINE unsigned FlatBlockDim() { return BlockDimX() * BlockDimY() * BlockDimZ(); }
MORI_DEVICE_INLINE unsigned FlatBlockIdx() { return BlockIdxX() + GridDimX() * (BlockIdxY() + GridDimY() * BlockIdxZ()); }
MORI_DEVICE_INLINE unsigned FlatGridDim() { return GridDimX() * GridDimY() * GridDimZ(); }
MORI_DEVICE_INLINE unsigned GlobalThreadIdx() { return FlatBlockIdx() * FlatBlockDim() + FlatThreadIdx(); }
MORI_DEVICE_INLINE unsigned GlobalThreadCount() { return FlatGridDim() * FlatBlockDim(); }

// The block barrier that also counts the threads that reached it: a thread that left its kernel (CUDA `exit`)
// is not waited for and not counted. On HOST a thread that leaves fails the barrier for the others instead, so
// every thread that returns from it was counted: the block's size.
MORI_DEVICE_INLINE unsigned SyncThreadsCounting() {
#if MORI_BACKEND_HOST
  SyncThreads();
  return FlatBlockDim();
#else
  return static_cast<unsigned>(__syncthreads_count(1));
#endif
}
MORI_DEVICE_INLINE unsigned LaneId() { return FlatThreadIdx() % MORI_WARP_SIZE; }
MORI_DEVICE_INLINE unsigned WarpId() { return FlatThreadIdx() / MORI_WARP_SIZE; }
// Joins the threads of this warp (a no-op where a warp is one thread).
MORI_DEVICE_INLINE void WarpSync() {
#if MORI_BACKEND_CUDA
  __syncwarp();
#elif MORI_BACKEND_HIP
  __builtin_amdgcn_wave_barrier();
#endif
}

// A load of memory that no thread writes while kernels run (tables built at set-up): on CUDA through the
// read-only data cache, so a hot loop that re-reads it pays an L1 hit, not an L2 round trip, and the compiler
// may keep it across the loop's stores.
template <typename T>
MORI_DEVICE_INLINE T LoadReadOnly(const T* p) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  static_assert(sizeof(T) == 1 || sizeof(T) == 4 || sizeof(T) == 8, "LoadReadOnly takes 1-, 4- or 8-byte values");
  if constexpr (sizeof(T) == 8) {
    return static_cast<T>(__ldg(reinterpret_cast<const unsigned long long*>(p)));
  } else if constexpr (sizeof(T) == 4) {
    return static_cast<T>(__ldg(reinterpret_cast<const unsigned int*>(p)));
  } else {
    return static_cast<T>(__ldg(reinterpret_cast<const unsigned char*>(p)));
  }
#else
  return *p;
#endif
}

// Programmatic dependent launch (CUDA on sm_90 and later; elsewhere both do nothing). A kernel launched by
// LaunchKernelEarly may start while the kernel before it on the stream is still running: once every block of
// that kernel has called AllowDependentLaunch (or exited). Before it reads anything the kernel before it
// wrote, and before it ends, it calls WaitForPrerequisiteGrid, which returns once that kernel has completed
// and its writes are visible. What the early start saves is the launch latency between the two kernels
// (measured on two H100s: about 5 us between an EP send kernel's last store and its receive kernel's first
// instruction). The later kernel's blocks may then wait beside the earlier one's, so a kernel should allow
// dependents only once every block it still needs is running.
MORI_DEVICE_INLINE void AllowDependentLaunch() {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

MORI_DEVICE_INLINE void WaitForPrerequisiteGrid() {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches `kernel` (a MORI_GLOBAL function) on `stream`. Arguments are copied into the launch as
// <<<>>> copies them, so pointers and POD handles are what a kernel should take.
template <typename... Params, typename... Args>
void LaunchKernel(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t sharedBytes, GpuStream stream,
                  Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "LaunchKernel: wrong number of kernel arguments");
#if MORI_GPU_COMPILER
  kernel<<<grid, block, sharedBytes, stream>>>(std::forward<Args>(args)...);
#else
  host::Launch(grid, block, sharedBytes, stream,
               [kernel, params = std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)]() {
                 std::apply(kernel, params);
               });
#endif
}

// LaunchKernel, with the early start described at AllowDependentLaunch on CUDA (an attribute of the launch
// that devices before sm_90 ignore); on HIP and HOST a plain launch.
template <typename... Params, typename... Args>
void LaunchKernelEarly(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t sharedBytes, GpuStream stream,
                       Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "LaunchKernelEarly: wrong number of kernel arguments");
#if MORI_GPU_COMPILER && MORI_BACKEND_CUDA
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = sharedBytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  // A failure stays for GpuGetLastError, as one of <<<>>> does.
  (void)cudaLaunchKernelEx(&config, kernel, std::decay_t<Params>(std::forward<Args>(args))...);
#else
  LaunchKernel(kernel, grid, block, sharedBytes, stream, std::forward<Args>(args)...);
#endif
}

// Loads kernels' code now. CUDA loads modules lazily by default, at a kernel's first launch, and loading
// waits for the device to go idle: launching a kernel while another one spins waiting for host-side work
// (the emulated NIC, a proxy) would then deadlock. Load every kernel of such a program before the first
// waiting kernel is launched.
template <typename... Kernels>
void PreloadKernels(Kernels... kernels) {
#if MORI_GPU_COMPILER && MORI_BACKEND_CUDA
  cudaFuncAttributes attr;
  ((void)cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernels)), ...);
#elif MORI_GPU_COMPILER && MORI_BACKEND_HIP
  hipFuncAttributes attr;
  ((void)hipFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernels)), ...);
#else
  ((void)kernels, ...);
#endif
}

#endif  // MORI_DEVICE_API_AVAILABLE

}  // namespace mori::core
