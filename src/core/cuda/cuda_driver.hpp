// CUDA driver API entry points, fetched at run time through cudaGetDriverEntryPointByVersion so that mori
// links only the CUDA runtime (and loads on machines whose driver lacks newer calls).
#pragma once

#include <cuda.h>

#include "mori/core/errors.hpp"

namespace mori::core::cuda {

struct Driver {
  decltype(&::cuGetErrorString) getErrorString = nullptr;
  decltype(&::cuDeviceGet) deviceGet = nullptr;
  decltype(&::cuDeviceGetAttribute) deviceGetAttribute = nullptr;
  decltype(&::cuMemCreate) memCreate = nullptr;
  decltype(&::cuMemRelease) memRelease = nullptr;
  decltype(&::cuMemAddressReserve) memAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) memAddressFree = nullptr;
  decltype(&::cuMemMap) memMap = nullptr;
  decltype(&::cuMemUnmap) memUnmap = nullptr;
  decltype(&::cuMemSetAccess) memSetAccess = nullptr;
  decltype(&::cuMemGetAllocationGranularity) memGetAllocationGranularity = nullptr;
  decltype(&::cuMemExportToShareableHandle) memExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) memImportFromShareableHandle = nullptr;
  decltype(&::cuMemRetainAllocationHandle) memRetainAllocationHandle = nullptr;
  decltype(&::cuMemGetAllocationPropertiesFromHandle) memGetAllocationPropertiesFromHandle = nullptr;
  decltype(&::cuMemGetAddressRange) memGetAddressRange = nullptr;
  decltype(&::cuModuleGetGlobal) moduleGetGlobal = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) devicePrimaryCtxRetain = nullptr;
  decltype(&::cuStreamWriteValue64) streamWriteValue64 = nullptr;  // optional: null where the driver lacks it

  // Loaded once; throws NotSupported naming the entry point the driver does not have (an optional one is left null).
  static const Driver& Get();
};

// Makes the CUDA runtime's primary context of the current device current on this thread: driver calls
// (address queries, imports) fail without one, and a thread that only allocated may not have it yet.
void EnsureContext();

// A dma-buf file descriptor for [ptr, ptr + bytes) of GPU memory, so a NIC can register it
// (ibv_reg_dmabuf_mr). The range is widened to host pages; *offset is ptr's offset in it. False when the
// driver or the memory cannot do it (the caller falls back to peer-memory registration).
bool GetDmaBufFd(const void* ptr, size_t bytes, int* fd, size_t* offset);

// Can the current device export VMM allocations as POSIX file descriptors?
bool VmmFdSupported(int device);

}  // namespace mori::core::cuda

#define MORI_CHECK_CU(call)                                                                              \
  do {                                                                                                   \
    CUresult moriCuStatus_ = (call);                                                                     \
    if (moriCuStatus_ != CUDA_SUCCESS) {                                                                 \
      const char* moriCuText_ = "unknown";                                                               \
      ::mori::core::cuda::Driver::Get().getErrorString(moriCuStatus_, &moriCuText_);                           \
      throw ::mori::core::GpuError(static_cast<int>(moriCuStatus_),                                            \
                             ::mori::core::StrFormat("%s failed: %s", #call, moriCuText_) + " (" MORI_SOURCE_LOCATION ")"); \
    }                                                                                                    \
  } while (0)
