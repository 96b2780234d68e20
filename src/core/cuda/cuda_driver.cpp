#include "cuda_driver.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"

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
    Load(driver.devicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    // Optional: without it GpuStreamWriteValue64 answers kGpuErrorNotSupported and its callers copy instead.
    try {
      Load(driver.streamWriteValue64, "cuStreamWriteValue64");
    } catch (const Error&) {
      driver.streamWriteValue64 = nullptr;
    }
  });
  return driver;
}

namespace {

// Refusals of a new context that pass by themselves: an MPS server answers "busy or unavailable" for a second or
// more while it reclaims the contexts of a client that was killed (measured on an H100: every 2-PE job started
// within 2.5 s of a killed one failed this way), and refuses clients while it starts or is full.
bool PassingContextRefusal(cudaError_t rc) {
  return rc == cudaErrorDevicesUnavailable || rc == cudaErrorMpsServerNotReady ||
         rc == cudaErrorMpsMaxClientsReached || rc == cudaErrorMpsMaxConnectionsReached;
}

bool PassingContextRefusal(CUresult rc) {
  return rc == CUDA_ERROR_DEVICE_UNAVAILABLE || rc == CUDA_ERROR_MPS_SERVER_NOT_READY ||
         rc == CUDA_ERROR_MPS_MAX_CLIENTS_REACHED || rc == CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED;
}

// Retries `attempt` (returning true when done, false on a passing refusal) with growing pauses until the
// deadline; `what` names the refusal for the log and the error.
template <typename Attempt>
void WaitOutRefusals(Attempt attempt, const char* what) {
  // Every recovery measured came within 0.3 s; a process whose refusal CUDA keeps never recovers, so waiting the
  // whole MORI_TIMEOUT_S for it only delays the error.
  constexpr double kRefusalWaitS = 5;
  const Deadline deadline = Deadline::After(std::min(kRefusalWaitS, Deadline::Default().TotalSeconds()));
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  MORI_LOG_WARN(Gpu,
                "the GPU refused a new context (%s); retrying for up to %.0f s: an MPS server refuses clients for "
                "a moment while it reclaims a killed one",
                what, deadline.TotalSeconds());
  auto pause = std::chrono::milliseconds(10);
  for (;;) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(200));
    if (attempt()) {
      MORI_LOG_WARN(Gpu, "the GPU took a new context after %.2f s of refusals", seconds());
      return;
    }
    if (deadline.Expired()) {
      MORI_THROW(ErrorCode::Gpu,
                 "the GPU refused a new context for %.1f s: %s. Under MPS, CUDA may keep refusing a process whose "
                 "first context was refused while the server reclaimed a killed client: start the job again. "
                 "Otherwise another process holds the GPU (compute mode exclusive, a stuck MPS client)",
                 seconds(), what);
    }
  }
}

// The first time: the primary context of the current device, retained through the driver, waiting out passing
// refusals there. The runtime remembers a failed context creation for the life of the process, so it must not
// see one; the driver's retain can be tried again. The retain is kept (the runtime shares that context).
void RetainPrimaryContextOnce() {
  static std::mutex mutex;
  static bool retained[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    (void)cudaGetLastError();
    return;  // cudaFree reports it
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (retained[device]) return;
  const Driver& d = Driver::Get();
  CUdevice dev;
  if (d.deviceGet(&dev, device) != CUDA_SUCCESS) return;
  CUcontext ctx = nullptr;
  CUresult rc = d.devicePrimaryCtxRetain(&ctx, dev);
  if (rc == CUDA_SUCCESS) {
    retained[device] = true;
    return;
  }
  if (!PassingContextRefusal(rc)) return;  // cudaFree reports it
  const char* text = nullptr;
  d.getErrorString(rc, &text);
  WaitOutRefusals(
      [&] {
        rc = d.devicePrimaryCtxRetain(&ctx, dev);
        if (rc == CUDA_SUCCESS) return true;
        if (!PassingContextRefusal(rc)) {
          MORI_THROW(ErrorCode::Gpu, "cuDevicePrimaryCtxRetain of device %d failed after refusals: error %d", device,
                     static_cast<int>(rc));
        }
        return false;
      },
      text != nullptr ? text : "device unavailable");
  retained[device] = true;
}

}  // namespace

void EnsureContext() {
  RetainPrimaryContextOnce();
  // cudaFree(nullptr) is the documented idiom that initialises the runtime and binds the context.
  cudaError_t rc = cudaFree(nullptr);
  if (rc == cudaSuccess) return;
  if (!PassingContextRefusal(rc)) MORI_CHECK_GPU(rc);
  (void)cudaGetLastError();
  WaitOutRefusals(
      [&] {
        rc = cudaFree(nullptr);
        if (rc == cudaSuccess) return true;
        if (!PassingContextRefusal(rc)) MORI_CHECK_GPU(rc);
        (void)cudaGetLastError();
        return false;
      },
      cudaGetErrorString(rc));
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

bool GpuCanStreamWriteValue64(int device) {
  // Asked once per device: a driver before CUDA 12 lacks the attribute (unsupported here).
  static std::array<std::atomic<int>, 64> known{};  // 0 not asked, 1 yes, 2 no
  if (device < 0 || device >= static_cast<int>(known.size())) return false;
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int can = 0;
    try {
      const cuda::Driver& d = cuda::Driver::Get();
      CUdevice dev;
      if (d.streamWriteValue64 == nullptr || d.deviceGet(&dev, device) != CUDA_SUCCESS ||
          d.deviceGetAttribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS) {
        can = 0;
      }
    } catch (const Error&) {
      can = 0;  // a driver without the entry points mori needs (logged where they are used)
    }
    state = can != 0 ? 1 : 2;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

GpuStatus GpuStreamWriteValue64(uint64_t* dst, uint64_t value, GpuStream s) {
  if (dst == nullptr || reinterpret_cast<uintptr_t>(dst) % sizeof(uint64_t) != 0) return cudaErrorInvalidValue;
  int device = 0;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc != cudaSuccess) return rc;
  if (!GpuCanStreamWriteValue64(device)) return cudaErrorNotSupported;
  CUresult r = cuda::Driver::Get().streamWriteValue64(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(dst),
                                                      value, CU_STREAM_WRITE_VALUE_DEFAULT);
  return static_cast<GpuStatus>(r);  // the driver's codes and the runtime's agree (801 not supported)
}

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
