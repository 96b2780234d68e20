#include "mori/core/gpu_buffer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <utility>

#include "allocation_registry.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/unique_fd.hpp"
#include "mori/core/logging.hpp"
#if MORI_BACKEND_CUDA
#include "cuda/cuda_driver.hpp"
#endif

namespace mori::core {

namespace alloc {

namespace {

std::mutex& RegistryMutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::map<uintptr_t, Record>& Registry() {
  static std::map<uintptr_t, Record>* r = new std::map<uintptr_t, Record>();
  return *r;
}

}  // namespace

const char* AllocatorName(AllocatorKind kind) {
  switch (kind) {
    case AllocatorKind::None: return "none";
    case AllocatorKind::HostMemfd: return "memfd";
    case AllocatorKind::CudaVmm: return "CUDA VMM";
    case AllocatorKind::CudaMalloc: return "cudaMalloc";
    case AllocatorKind::CudaHostAlloc: return "cudaHostAlloc";
    case AllocatorKind::HipMalloc: return "hipMalloc";
    case AllocatorKind::HipHostMalloc: return "hipHostMalloc";
  }
  return "?";
}

void Register(const Record& record) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[record.base] = record;
}

void Unregister(uintptr_t base) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(base);
  if (it == Registry().end()) return;
  if (it->second.fd >= 0) close(it->second.fd);
  Registry().erase(it);
}

std::optional<Record> Find(const void* ptr) {
  auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().upper_bound(p);
  if (it == Registry().begin()) return std::nullopt;
  --it;
  if (p >= it->second.base + it->second.bytes) return std::nullopt;
  return it->second;
}

}  // namespace alloc

namespace {

using alloc::AllocatorKind;

#if MORI_BACKEND_HOST
// Shared memory with a file descriptor, so that another process can map the same pages.
void* AllocateMemfd(size_t bytes, size_t* allocationBytes, int* fdOut) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t rounded = (bytes + page - 1) / page * page;
  UniqueFd fd(memfd_create("mori-gpubuffer", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  MORI_CHECK_SYS(fd.Get());
  if (ftruncate(fd.Get(), static_cast<off_t>(rounded)) < 0) {
    MORI_THROW_SYS(errno, "sizing a %zu-byte memfd", rounded);
  }
  // Same-host peers map this descriptor: from here on its size cannot change (IpcMemoryMapping::Import
  // refuses a memfd without these seals).
  if (fcntl(fd.Get(), F_ADD_SEALS, alloc::kMemfdSeals) < 0) MORI_THROW_SYS(errno, "sealing a %zu-byte memfd", rounded);
  void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd.Get(), 0);
  if (p == MAP_FAILED) MORI_THROW_SYS(errno, "mapping a %zu-byte memfd", rounded);
  *allocationBytes = rounded;
  *fdOut = fd.Release();
  return p;
}
#endif

#if MORI_BACKEND_CUDA
bool UseCudaVmm(int device) {
  std::string mode = EnvGetChoice("MORI_CUDA_IPC");
  if (mode == "legacy") return false;
  bool supported = cuda::VmmFdSupported(device);
  MORI_CHECK(supported || mode != "vmm", ErrorCode::NotSupported,
             "MORI_CUDA_IPC=vmm but device %d cannot export VMM allocations as file descriptors", device);
  return supported;
}

void* AllocateCudaVmm(size_t bytes, int device, size_t* allocationBytes) {
  cuda::EnsureContext();
  const cuda::Driver& d = cuda::Driver::Get();
  CUdevice dev;
  MORI_CHECK_CU(d.deviceGet(&dev, device));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  int rdmaCapable = 0;
  d.deviceGetAttribute(&rdmaCapable, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  prop.allocFlags.gpuDirectRDMACapable = rdmaCapable ? 1 : 0;  // so a NIC can register it later
  size_t granularity = 0;
  MORI_CHECK_CU(d.memGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  size_t rounded = (bytes + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle;
  MORI_CHECK_CU(d.memCreate(&handle, rounded, &prop, 0));
  CUdeviceptr va = 0;
  try {
    MORI_CHECK_CU(d.memAddressReserve(&va, rounded, granularity, 0, 0));
    MORI_CHECK_CU(d.memMap(va, rounded, 0, handle, 0));
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    MORI_CHECK_CU(d.memSetAccess(va, rounded, &access, 1));
  } catch (...) {
    if (va != 0) {
      d.memUnmap(va, rounded);
      d.memAddressFree(va, rounded);
    }
    d.memRelease(handle);
    throw;
  }
  // The mapping holds the physical memory from here on; it is freed when the range is unmapped.
  MORI_CHECK_CU(d.memRelease(handle));
  *allocationBytes = rounded;
  return reinterpret_cast<void*>(va);
}
#endif

}  // namespace

GpuBuffer::GpuBuffer(size_t bytes, MemoryType type) : bytes_(bytes), type_(type) {
  MORI_CHECK(bytes > 0, ErrorCode::InvalidUsage, "GpuBuffer of 0 bytes");
  int device = 0;
  MORI_CHECK_GPU(GpuGetDevice(&device));
  int fd = -1;
  AllocatorKind kind = AllocatorKind::None;
#if MORI_BACKEND_HOST
  data_ = AllocateMemfd(bytes, &allocationBytes_, &fd);
  kind = AllocatorKind::HostMemfd;
#elif MORI_BACKEND_CUDA
  if (type == MemoryType::Device && UseCudaVmm(device)) {
    data_ = AllocateCudaVmm(bytes, device, &allocationBytes_);
    kind = AllocatorKind::CudaVmm;
  } else if (type == MemoryType::Device) {
    MORI_CHECK_GPU(GpuMalloc(&data_, bytes));
    allocationBytes_ = bytes;
    kind = AllocatorKind::CudaMalloc;
  } else {
    MORI_CHECK_GPU(GpuHostAllocMapped(&data_, bytes));
    allocationBytes_ = bytes;
    kind = AllocatorKind::CudaHostAlloc;
  }
#else
  if (type == MemoryType::Device) {
    MORI_CHECK_GPU(GpuMalloc(&data_, bytes));
    kind = AllocatorKind::HipMalloc;
  } else {
    MORI_CHECK_GPU(GpuHostAllocMapped(&data_, bytes));
    kind = AllocatorKind::HipHostMalloc;
  }
  allocationBytes_ = bytes;
#endif
  allocator_ = static_cast<int>(kind);
  alloc::Register({reinterpret_cast<uintptr_t>(data_), allocationBytes_, kind, fd, device});
  MORI_LOG_DEBUG(Gpu, "GpuBuffer %p: %zu bytes of %s memory from %s", data_, bytes,
                 type == MemoryType::Device ? "device" : "host-pinned", AllocatorName());
}

GpuBuffer::~GpuBuffer() { Release(); }

GpuBuffer::GpuBuffer(GpuBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      allocationBytes_(std::exchange(other.allocationBytes_, 0)),
      type_(other.type_),
      allocator_(std::exchange(other.allocator_, 0)) {}

GpuBuffer& GpuBuffer::operator=(GpuBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    allocationBytes_ = std::exchange(other.allocationBytes_, 0);
    type_ = other.type_;
    allocator_ = std::exchange(other.allocator_, 0);
  }
  return *this;
}

bool GpuBuffer::Shareable() const {
  auto kind = static_cast<AllocatorKind>(allocator_);
  return kind == AllocatorKind::HostMemfd || kind == AllocatorKind::CudaVmm || kind == AllocatorKind::CudaMalloc ||
         kind == AllocatorKind::HipMalloc;
}

const char* GpuBuffer::AllocatorName() const { return alloc::AllocatorName(static_cast<AllocatorKind>(allocator_)); }

void GpuBuffer::Release() noexcept {
  if (data_ == nullptr) return;
  alloc::Unregister(reinterpret_cast<uintptr_t>(data_));
  switch (static_cast<AllocatorKind>(allocator_)) {
#if MORI_BACKEND_HOST
    case AllocatorKind::HostMemfd:
      munmap(data_, allocationBytes_);
      break;
#elif MORI_BACKEND_CUDA
    case AllocatorKind::CudaVmm: {
      const cuda::Driver& d = cuda::Driver::Get();
      auto va = reinterpret_cast<CUdeviceptr>(data_);
      d.memUnmap(va, allocationBytes_);
      d.memAddressFree(va, allocationBytes_);
      break;
    }
    case AllocatorKind::CudaMalloc:
      (void)GpuFree(data_);
      break;
    case AllocatorKind::CudaHostAlloc:
      (void)GpuFreeHost(data_);
      break;
#else
    case AllocatorKind::HipMalloc:
      (void)GpuFree(data_);
      break;
    case AllocatorKind::HipHostMalloc:
      (void)GpuFreeHost(data_);
      break;
#endif
    default:
      break;
  }
  data_ = nullptr;
}

}  // namespace mori::core
