#include "cuda_driver.hpp"

#include <cuda_runtime.h>

#include <mutex>

#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"

namespace mori::core::cuda {

namespace {

template <typename Fn>
void Load(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  // 12000: the ABI version of these entry points we compile against (all exist since CUDA 11-12).
  cudaError_t rc = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status);
  if (rc != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    MORI_THROW(ErrorCode::NotSupported, "the CUDA driver has no entry point %s (%s)", symbol, cudaGetErrorString(rc));
  }
  fn = reinterpret_cast<Fn>(p);
}

}  // namespace

const Driver& Driver::Get() {
  static Driver driver;
  static std::once_flag once;
  std::call_once(once, [] {
    Load(driver.getErrorString, "cuGetErrorString");
    Load(driver.deviceGet, "cuDeviceGet");
    Load(driver.deviceGetAttribute, "cuDeviceGetAttribute");
    Load(driver.memCreate, "cuMemCreate");
    Load(driver.memRelease, "cuMemRelease");
    Load(driver.memAddressReserve, "cuMemAddressReserve");
    Load(driver.memAddressFree, "cuMemAddressFree");
    Load(driver.memMap, "cuMemMap");
    Load(driver.memUnmap, "cuMemUnmap");
    Load(driver.memSetAccess, "cuMemSetAccess");
    Load(driver.memGetAllocationGranularity, "cuMemGetAllocationGranularity");
    Load(driver.memExportToShareableHandle, "cuMemExportToShareableHandle");
    Load(driver.memImportFromShareableHandle, "cuMemImportFromShareableHandle");
    Load(driver.memRetainAllocationHandle, "cuMemRetainAllocationHandle");
    Load(driver.memGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
    Load(driver.memGetAddressRange, "cuMemGetAddressRange");
    Load(driver.moduleGetGlobal, "cuModuleGetGlobal");
  });
  return driver;
}

void EnsureContext() {
  // cudaFree(nullptr) is the documented idiom that initialises the runtime and binds the context.
  MORI_CHECK_GPU(cudaFree(nullptr));
}

bool GetDmaBufFd(const void* ptr, size_t bytes, int* fd, size_t* offset) {
  static decltype(&::cuMemGetHandleForAddressRange) getHandle = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<decltype(&::cuMemGetHandleForAddressRange)>(nullptr);
    }
    return reinterpret_cast<decltype(&::cuMemGetHandleForAddressRange)>(p);
  }();
  if (getHandle == nullptr) return false;
  const uintptr_t page = 4096;
  uintptr_t start = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes + page - 1) & ~(page - 1);
  EnsureContext();
  if (getHandle(fd, static_cast<CUdeviceptr>(start), end - start, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) !=
      CUDA_SUCCESS) {
    return false;
  }
  *offset = reinterpret_cast<uintptr_t>(ptr) - start;
  return true;
}

bool VmmFdSupported(int device) {
  try {
    const Driver& d = Driver::Get();
    CUdevice dev;
    if (d.deviceGet(&dev, device) != CUDA_SUCCESS) return false;
    int vmm = 0;
    int fd = 0;
    d.deviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    d.deviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    return vmm != 0 && fd != 0;
  } catch (const Error& e) {
    MORI_LOG_INFO(Gpu, "CUDA VMM unavailable: %s", e.what());
    return false;
  }
}

}  // namespace mori::core::cuda

namespace mori::core {

GpuStatus GpuModuleGetGlobal(void** ptr, size_t* bytes, void* module, const char* name) {
  if (ptr == nullptr || bytes == nullptr || module == nullptr || name == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  *bytes = 0;
  CUdeviceptr dptr = 0;
  CUresult rc = cuda::Driver::Get().moduleGetGlobal(&dptr, bytes, static_cast<CUmodule>(module), name);
  if (rc != CUDA_SUCCESS) return static_cast<GpuStatus>(rc);
  *ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(dptr));
  return cudaSuccess;
}

}  // namespace mori::core
