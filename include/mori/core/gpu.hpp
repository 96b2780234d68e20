// GPU runtime calls under one set of names for CUDA, HIP and HOST, so host code is written once.
// On HOST the "device" is the CPU: allocations are host memory, streams are in-order worker threads and
// kernels are groups of host threads (see kernel.hpp), with the asynchrony a GPU runtime has.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/device.hpp"
#include "mori/core/errors.hpp"

#if MORI_BACKEND_CUDA
#include <cuda_runtime.h>
#elif MORI_BACKEND_HIP
#include <hip/hip_runtime.h>
#endif

namespace mori::core {

#if MORI_BACKEND_CUDA

using GpuStatus = cudaError_t;
using GpuStream = cudaStream_t;
using GpuEvent = cudaEvent_t;
constexpr GpuStatus kGpuSuccess = cudaSuccess;
constexpr GpuStatus kGpuErrorNotReady = cudaErrorNotReady;
constexpr GpuStatus kGpuErrorNotSupported = cudaErrorNotSupported;
constexpr GpuStatus kGpuErrorInvalidValue = cudaErrorInvalidValue;

inline GpuStatus GpuGetDeviceCount(int* n) { return cudaGetDeviceCount(n); }
inline GpuStatus GpuSetDevice(int dev) { return cudaSetDevice(dev); }
inline GpuStatus GpuGetDevice(int* dev) { return cudaGetDevice(dev); }
inline GpuStatus GpuDeviceGetName(char* buf, int len, int dev) {
  cudaDeviceProp prop;
  GpuStatus s = cudaGetDeviceProperties(&prop, dev);
  if (s == cudaSuccess && len > 0) {
    int i = 0;
    for (; i < len - 1 && prop.name[i] != '\0'; ++i) buf[i] = prop.name[i];
    buf[i] = '\0';
  }
  return s;
}
inline GpuStatus GpuDeviceGetPciBusId(char* buf, int len, int dev) { return cudaDeviceGetPCIBusId(buf, len, dev); }
inline GpuStatus GpuDeviceCanAccessPeer(int* can, int dev, int peer) { return cudaDeviceCanAccessPeer(can, dev, peer); }
inline GpuStatus GpuDeviceEnablePeerAccess(int peer) {
  GpuStatus s = cudaDeviceEnablePeerAccess(peer, 0);
  if (s == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // the non-sticky error would otherwise surface at the next check
    return cudaSuccess;
  }
  return s;
}
// Whether GPU atomics on host memory are atomic with respect to the CPU's (PCIe AtomicOps or a coherent
// link). Without it, a word in mapped host memory may be read-modify-written by the GPU or by the host,
// never by both.
inline GpuStatus GpuDeviceHostNativeAtomics(int* supported, int dev) {
  return cudaDeviceGetAttribute(supported, cudaDevAttrHostNativeAtomicSupported, dev);
}
inline GpuStatus GpuMalloc(void** p, size_t n) { return cudaMalloc(p, n); }
inline GpuStatus GpuMallocUncached(void** p, size_t n) { return cudaMalloc(p, n); }
inline GpuStatus GpuFree(void* p) { return cudaFree(p); }
inline GpuStatus GpuHostAllocMapped(void** p, size_t n) {
  return cudaHostAlloc(p, n, cudaHostAllocMapped | cudaHostAllocPortable);
}
inline GpuStatus GpuFreeHost(void* p) { return cudaFreeHost(p); }
inline GpuStatus GpuHostRegisterMapped(void* p, size_t n) {
  return cudaHostRegister(p, n, cudaHostRegisterMapped | cudaHostRegisterPortable);
}
inline GpuStatus GpuHostUnregister(void* p) { return cudaHostUnregister(p); }
inline GpuStatus GpuHostGetDevicePointer(void** dev, void* host) { return cudaHostGetDevicePointer(dev, host, 0); }
inline GpuStatus GpuMemcpy(void* dst, const void* src, size_t n) { return cudaMemcpy(dst, src, n, cudaMemcpyDefault); }
inline GpuStatus GpuMemcpyAsync(void* dst, const void* src, size_t n, GpuStream s) {
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s);
}
inline GpuStatus GpuMemset(void* p, int v, size_t n) { return cudaMemset(p, v, n); }
inline GpuStatus GpuMemsetAsync(void* p, int v, size_t n, GpuStream s) { return cudaMemsetAsync(p, v, n, s); }
inline GpuStatus GpuStreamCreate(GpuStream* s) { return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking); }
inline GpuStatus GpuStreamDestroy(GpuStream s) { return cudaStreamDestroy(s); }
inline GpuStatus GpuStreamSynchronize(GpuStream s) { return cudaStreamSynchronize(s); }
inline GpuStatus GpuStreamQuery(GpuStream s) { return cudaStreamQuery(s); }
inline GpuStatus GpuDeviceSynchronize() { return cudaDeviceSynchronize(); }
inline GpuStatus GpuEventCreate(GpuEvent* e) { return cudaEventCreate(e); }
// An event only waited on, never timed: cheaper to record (a host thread waiting for an 8-byte copy with one:
// 6.4 us against 8.1 us with a timing event, H200, bench/experiments/copy_wait_cost.cu).
inline GpuStatus GpuEventCreateNoTiming(GpuEvent* e) { return cudaEventCreateWithFlags(e, cudaEventDisableTiming); }
inline GpuStatus GpuEventDestroy(GpuEvent e) { return cudaEventDestroy(e); }
inline GpuStatus GpuEventRecord(GpuEvent e, GpuStream s) { return cudaEventRecord(e, s); }
inline GpuStatus GpuEventSynchronize(GpuEvent e) { return cudaEventSynchronize(e); }
inline GpuStatus GpuEventQuery(GpuEvent e) { return cudaEventQuery(e); }
inline GpuStatus GpuEventElapsedTime(float* ms, GpuEvent a, GpuEvent b) { return cudaEventElapsedTime(ms, a, b); }
inline GpuStatus GpuGetLastError() { return cudaGetLastError(); }
inline const char* GpuGetErrorString(GpuStatus s) { return cudaGetErrorString(s); }
// The device address and size of global `name` in a module loaded by handle (a CUmodule from cuModuleLoad*,
// e.g. a cubin, fatbin or PTX the driver JIT-compiles). The driver's code as a runtime code (their numbers
// agree: 500 not found, 400 invalid handle). Defined in libmori_core.
GpuStatus GpuModuleGetGlobal(void** ptr, size_t* bytes, void* module, const char* name);
// Stores `value` in the 8-byte word `dst` (memory of the current GPU, or of a peer mapped here) in the order of
// stream `s`: after the stream's earlier work has completed and its writes are visible (the stream's memory
// barrier), by the GPU's front end rather than the copy engine (cuStreamWriteValue64). No host memory has to
// hold the value until it is written. kGpuErrorNotSupported, with nothing enqueued, where the current device
// cannot. Defined in libmori_core.
GpuStatus GpuStreamWriteValue64(uint64_t* dst, uint64_t value, GpuStream s);
// Whether GpuStreamWriteValue64 works on `device` (the driver has cuStreamWriteValue64 and the device reports
// CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS), asked of the driver once per device. False for a device
// that does not exist, and for ordinals from 64 up (not asked). Defined in libmori_core.
bool GpuCanStreamWriteValue64(int device);

#elif MORI_BACKEND_HIP

using GpuStatus = hipError_t;
using GpuStream = hipStream_t;
using GpuEvent = hipEvent_t;
constexpr GpuStatus kGpuSuccess = hipSuccess;
constexpr GpuStatus kGpuErrorNotReady = hipErrorNotReady;
constexpr GpuStatus kGpuErrorNotSupported = hipErrorNotSupported;
constexpr GpuStatus kGpuErrorInvalidValue = hipErrorInvalidValue;

inline GpuStatus GpuGetDeviceCount(int* n) { return hipGetDeviceCount(n); }
inline GpuStatus GpuSetDevice(int dev) { return hipSetDevice(dev); }
inline GpuStatus GpuGetDevice(int* dev) { return hipGetDevice(dev); }
inline GpuStatus GpuDeviceGetName(char* buf, int len, int dev) {
  hipDeviceProp_t prop;
  GpuStatus s = hipGetDeviceProperties(&prop, dev);
  if (s == hipSuccess && len > 0) {
    int i = 0;
    for (; i < len - 1 && prop.name[i] != '\0'; ++i) buf[i] = prop.name[i];
    buf[i] = '\0';
  }
  return s;
}
inline GpuStatus GpuDeviceGetPciBusId(char* buf, int len, int dev) { return hipDeviceGetPCIBusId(buf, len, dev); }
inline GpuStatus GpuDeviceCanAccessPeer(int* can, int dev, int peer) { return hipDeviceCanAccessPeer(can, dev, peer); }
inline GpuStatus GpuDeviceEnablePeerAccess(int peer) {
  GpuStatus s = hipDeviceEnablePeerAccess(peer, 0);
  if (s == hipErrorPeerAccessAlreadyEnabled) {
    (void)hipGetLastError();
    return hipSuccess;
  }
  return s;
}
inline GpuStatus GpuDeviceHostNativeAtomics(int* supported, int dev) {
  return hipDeviceGetAttribute(supported, hipDeviceAttributeHostNativeAtomicSupported, dev);
}
inline GpuStatus GpuMalloc(void** p, size_t n) { return hipMalloc(p, n); }
// Flags and counters that other agents poll must bypass the GPU's non-coherent caches on AMD (HIP before
// 5.3 has no uncached flag; fine-grained memory is coherent across agents there).
#ifdef hipDeviceMallocUncached
constexpr unsigned kHipMallocUncachedFlag = hipDeviceMallocUncached;
#else
constexpr unsigned kHipMallocUncachedFlag = hipDeviceMallocFinegrained;
#endif
inline GpuStatus GpuMallocUncached(void** p, size_t n) { return hipExtMallocWithFlags(p, n, kHipMallocUncachedFlag); }
inline GpuStatus GpuFree(void* p) { return hipFree(p); }
inline GpuStatus GpuHostAllocMapped(void** p, size_t n) {
  return hipHostMalloc(p, n, hipHostMallocMapped | hipHostMallocPortable | hipHostMallocCoherent);
}
inline GpuStatus GpuFreeHost(void* p) { return hipHostFree(p); }
inline GpuStatus GpuHostRegisterMapped(void* p, size_t n) {
  return hipHostRegister(p, n, hipHostRegisterMapped | hipHostRegisterPortable);
}
inline GpuStatus GpuHostUnregister(void* p) { return hipHostUnregister(p); }
inline GpuStatus GpuHostGetDevicePointer(void** dev, void* host) { return hipHostGetDevicePointer(dev, host, 0); }
inline GpuStatus GpuMemcpy(void* dst, const void* src, size_t n) { return hipMemcpy(dst, src, n, hipMemcpyDefault); }
inline GpuStatus GpuMemcpyAsync(void* dst, const void* src, size_t n, GpuStream s) {
  return hipMemcpyAsync(dst, src, n, hipMemcpyDefault, s);
}
inline GpuStatus GpuMemset(void* p, int v, size_t n) { return hipMemset(p, v, n); }
inline GpuStatus GpuMemsetAsync(void* p, int v, size_t n, GpuStream s) { return hipMemsetAsync(p, v, n, s); }
inline GpuStatus GpuStreamCreate(GpuStream* s) { return hipStreamCreateWithFlags(s, hipStreamNonBlocking); }
inline GpuStatus GpuStreamDestroy(GpuStream s) { return hipStreamDestroy(s); }
inline GpuStatus GpuStreamSynchronize(GpuStream s) { return hipStreamSynchronize(s); }
inline GpuStatus GpuStreamQuery(GpuStream s) { return hipStreamQuery(s); }
inline GpuStatus GpuDeviceSynchronize() { return hipDeviceSynchronize(); }
inline GpuStatus GpuEventCreate(GpuEvent* e) { return hipEventCreate(e); }
inline GpuStatus GpuEventCreateNoTiming(GpuEvent* e) { return hipEventCreateWithFlags(e, hipEventDisableTiming); }
inline GpuStatus GpuEventDestroy(GpuEvent e) { return hipEventDestroy(e); }
inline GpuStatus GpuEventRecord(GpuEvent e, GpuStream s) { return hipEventRecord(e, s); }
inline GpuStatus GpuEventSynchronize(GpuEvent e) { return hipEventSynchronize(e); }
inline GpuStatus GpuEventQuery(GpuEvent e) { return hipEventQuery(e); }
inline GpuStatus GpuEventElapsedTime(float* ms, GpuEvent a, GpuEvent b) { return hipEventElapsedTime(ms, a, b); }
inline GpuStatus GpuGetLastError() { return hipGetLastError(); }
inline const char* GpuGetErrorString(GpuStatus s) { return hipGetErrorString(s); }
// As on CUDA, for a hipModule_t from hipModuleLoad*.
inline GpuStatus GpuModuleGetGlobal(void** ptr, size_t* bytes, void* module, const char* name) {
  return hipModuleGetGlobal(reinterpret_cast<hipDeviceptr_t*>(ptr), bytes, static_cast<hipModule_t>(module), name);
}
// As on CUDA, from hipDeviceAttributeCanUseStreamWaitValue (HIP documents it for its stream waits; it gates
// the stream memory operations, writes included).
inline bool GpuCanStreamWriteValue64(int device) {
  int can = 0;
  return hipDeviceGetAttribute(&can, hipDeviceAttributeCanUseStreamWaitValue, device) == hipSuccess && can != 0;
}
// As on CUDA, by hipStreamWriteValue64. mori's CudaIpc connection does not use it on HIP (its ordering after
// the stream's copies is unmeasured here: no AMD GPU), and keeps its staged copies there.
inline GpuStatus GpuStreamWriteValue64(uint64_t* dst, uint64_t value, GpuStream s) {
  if (dst == nullptr || reinterpret_cast<uintptr_t>(dst) % sizeof(uint64_t) != 0) return hipErrorInvalidValue;
  int device = 0;
  hipError_t rc = hipGetDevice(&device);
  if (rc != hipSuccess) return rc;
  if (!GpuCanStreamWriteValue64(device)) return hipErrorNotSupported;
  return hipStreamWriteValue64(s, dst, value, 0);
}

#else  // MORI_BACKEND_HOST

enum GpuStatus : int {
  kGpuSuccess = 0,
  kGpuErrorInvalidValue = 1,
  kGpuErrorMemoryAllocation = 2,
  kGpuErrorInvalidDevice = 3,
  kGpuErrorNotReady = 4,
  kGpuErrorLaunchFailure = 5,  // a kernel thread trapped (device assert, bounded wait ran out)
  kGpuErrorInvalidConfiguration = 6,
  kGpuErrorNotSupported = 7,
  kGpuErrorTimeout = 8,  // a stream, event or device synchronisation outlived its bound (a kernel that never ends)
};

struct HostStream;
struct HostEvent;
using GpuStream = HostStream*;  // nullptr is the default stream, as on a GPU
using GpuEvent = HostEvent*;

GpuStatus GpuGetDeviceCount(int* n);
GpuStatus GpuSetDevice(int dev);
GpuStatus GpuGetDevice(int* dev);
GpuStatus GpuDeviceGetName(char* buf, int len, int dev);
GpuStatus GpuDeviceGetPciBusId(char* buf, int len, int dev);
GpuStatus GpuDeviceCanAccessPeer(int* can, int dev, int peer);
GpuStatus GpuDeviceEnablePeerAccess(int peer);
GpuStatus GpuDeviceHostNativeAtomics(int* supported, int dev);
GpuStatus GpuMalloc(void** p, size_t n);
GpuStatus GpuMallocUncached(void** p, size_t n);
GpuStatus GpuFree(void* p);
GpuStatus GpuHostAllocMapped(void** p, size_t n);
GpuStatus GpuFreeHost(void* p);
GpuStatus GpuHostRegisterMapped(void* p, size_t n);
GpuStatus GpuHostUnregister(void* p);
GpuStatus GpuHostGetDevicePointer(void** dev, void* host);
GpuStatus GpuMemcpy(void* dst, const void* src, size_t n);
GpuStatus GpuMemcpyAsync(void* dst, const void* src, size_t n, GpuStream s);
GpuStatus GpuMemset(void* p, int v, size_t n);
GpuStatus GpuMemsetAsync(void* p, int v, size_t n, GpuStream s);
GpuStatus GpuStreamCreate(GpuStream* s);
GpuStatus GpuStreamDestroy(GpuStream s);
GpuStatus GpuStreamSynchronize(GpuStream s);
GpuStatus GpuStreamQuery(GpuStream s);
GpuStatus GpuDeviceSynchronize();
GpuStatus GpuEventCreate(GpuEvent* e);
inline GpuStatus GpuEventCreateNoTiming(GpuEvent* e) { return GpuEventCreate(e); }
GpuStatus GpuEventDestroy(GpuEvent e);
GpuStatus GpuEventRecord(GpuEvent e, GpuStream s);
GpuStatus GpuEventSynchronize(GpuEvent e);
// kGpuSuccess when the work recorded before it is done (or it was never recorded), else kGpuErrorNotReady.
GpuStatus GpuEventQuery(GpuEvent e);
GpuStatus GpuEventElapsedTime(float* ms, GpuEvent a, GpuEvent b);
GpuStatus GpuGetLastError();
const char* GpuGetErrorString(GpuStatus s);
// HOST loads no GPU modules: always kGpuErrorNotSupported.
GpuStatus GpuModuleGetGlobal(void** ptr, size_t* bytes, void* module, const char* name);
// As on CUDA: the stream's worker stores the word (a release store) after the stream's earlier work.
GpuStatus GpuStreamWriteValue64(uint64_t* dst, uint64_t value, GpuStream s);
// True for every device that exists.
bool GpuCanStreamWriteValue64(int device);

#endif

}  // namespace mori::core

// Throws mori::core::GpuError naming the call and the runtime's message when a runtime call fails.
#define MORI_CHECK_GPU(call)                                                                                  \
  do {                                                                                                        \
    ::mori::core::GpuStatus moriGpuStatus_ = (call);                                                                \
    if (moriGpuStatus_ != ::mori::core::kGpuSuccess) {                                                              \
      throw ::mori::core::GpuError(static_cast<int>(moriGpuStatus_),                                                \
                             ::mori::core::StrFormat("%s failed: %s", #call, ::mori::core::GpuGetErrorString(moriGpuStatus_)) + \
                                 " (" MORI_SOURCE_LOCATION ")");                                              \
    }                                                                                                         \
  } while (0)
