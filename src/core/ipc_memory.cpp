#include "mori/core/ipc_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "allocation_registry.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#if MORI_BACKEND_CUDA
#include "cuda/cuda_driver.hpp"
#endif

namespace mori::core {

namespace {

constexpr uint32_t kHandleMagic = 0x4d504d49U;  // "IMPM"

IpcMemoryHandle NewHandle(IpcMemoryKind kind, int device, uint64_t allocationBytes, uint64_t offset, uint64_t bytes) {
  IpcMemoryHandle h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kHandleMagic;
  h.kind = static_cast<uint32_t>(kind);
  h.ownerRank = -1;
  h.ownerDevice = device;
  h.ownerPid = static_cast<uint64_t>(getpid());
  h.allocationBytes = allocationBytes;
  h.offset = offset;
  h.bytes = bytes;
  return h;
}

#if MORI_BACKEND_GPU
// A legacy IPC handle opens, at `opened`, the allocation it was made for: [offset, offset + bytes) from
// there must lie inside what the runtime reports for the allocation that holds `opened`.
void CheckLegacyRange(const IpcMemoryHandle& h, uintptr_t opened, uintptr_t realBase, size_t realBytes) {
  bool inside = opened >= realBase && opened - realBase < realBytes;
  uint64_t room = inside ? realBytes - (opened - realBase) : 0;
  MORI_CHECK(inside && h.offset <= room && h.bytes <= room - h.offset, ErrorCode::Protocol,
             "%s of rank %d (pid %llu) claims [%llu, +%llu) of a %llu-byte allocation, but what it opened at %p lies "
             "in an allocation of %zu bytes at %p",
             IpcMemoryKindName(static_cast<IpcMemoryKind>(h.kind)), h.ownerRank,
             static_cast<unsigned long long>(h.ownerPid), static_cast<unsigned long long>(h.offset),
             static_cast<unsigned long long>(h.bytes), static_cast<unsigned long long>(h.allocationBytes),
             reinterpret_cast<void*>(opened), realBytes, reinterpret_cast<void*>(realBase));
}
#endif

bool KindCarriesFd(uint32_t kind) {
  return kind == static_cast<uint32_t>(IpcMemoryKind::HostMemfd) || kind == static_cast<uint32_t>(IpcMemoryKind::CudaVmm);
}

}  // namespace

const char* IpcMemoryKindName(IpcMemoryKind kind) {
  switch (kind) {
    case IpcMemoryKind::HostMemfd: return "memfd";
    case IpcMemoryKind::CudaVmm: return "CUDA VMM fd";
    case IpcMemoryKind::CudaLegacy: return "CUDA IPC handle";
    case IpcMemoryKind::HipLegacy: return "HIP IPC handle";
  }
  return "unknown";
}

IpcMemoryHandle ExportIpcMemory(const void* ptr, size_t bytes, UniqueFd* fd) {
  MORI_CHECK(ptr != nullptr && bytes > 0 && fd != nullptr, ErrorCode::InvalidUsage,
             "ExportIpcMemory(%p, %zu): null pointer or empty range", ptr, bytes);
  auto p = reinterpret_cast<uintptr_t>(ptr);
  std::optional<alloc::Record> rec = alloc::Find(ptr);
  fd->Reset();
#if MORI_BACKEND_HOST
  MORI_CHECK(rec && rec->kind == alloc::AllocatorKind::HostMemfd, ErrorCode::InvalidUsage,
             "ExportIpcMemory: %p is not inside a GpuBuffer (only memfd-backed memory can be shared on HOST)", ptr);
  MORI_CHECK(p + bytes <= rec->base + rec->bytes, ErrorCode::InvalidUsage,
             "ExportIpcMemory: [%p, +%zu) runs past the end of its buffer (%zu bytes at %p)", ptr, bytes, rec->bytes,
             reinterpret_cast<void*>(rec->base));
  int dup = fcntl(rec->fd, F_DUPFD_CLOEXEC, 0);
  MORI_CHECK_SYS(dup);
  fd->Reset(dup);
  return NewHandle(IpcMemoryKind::HostMemfd, 0, rec->bytes, p - rec->base, bytes);
#elif MORI_BACKEND_CUDA
  cuda::EnsureContext();
  const cuda::Driver& d = cuda::Driver::Get();
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult rc = d.memGetAddressRange(&base, &size, static_cast<CUdeviceptr>(p));
  MORI_CHECK(rc == CUDA_SUCCESS, ErrorCode::InvalidUsage, "ExportIpcMemory: %p is not CUDA device memory", ptr);
  MORI_CHECK(p + bytes <= base + size, ErrorCode::InvalidUsage,
             "ExportIpcMemory: [%p, +%zu) runs past the end of its allocation (%zu bytes at %p)", ptr, bytes, size,
             reinterpret_cast<void*>(base));
  int device = rec ? rec->device : 0;
  if (!rec) MORI_CHECK_GPU(GpuGetDevice(&device));
  CUmemGenericAllocationHandle handle;
  if (d.memRetainAllocationHandle(&handle, reinterpret_cast<void*>(base)) == CUDA_SUCCESS) {
    int exported = -1;
    CUresult erc = d.memExportToShareableHandle(&exported, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    d.memRelease(handle);
    MORI_CHECK_CU(erc);
    fd->Reset(exported);
    return NewHandle(IpcMemoryKind::CudaVmm, device, size, p - base, bytes);
  }
  IpcMemoryHandle h = NewHandle(IpcMemoryKind::CudaLegacy, device, size, p - base, bytes);
  cudaIpcMemHandle_t legacy;
  static_assert(sizeof(legacy) <= sizeof(h.legacyHandle), "cudaIpcMemHandle_t fits the handle");
  MORI_CHECK_GPU(cudaIpcGetMemHandle(&legacy, reinterpret_cast<void*>(base)));
  std::memcpy(h.legacyHandle, &legacy, sizeof(legacy));
  return h;
#else
  void* base = nullptr;
  size_t size = 0;
  MORI_CHECK(hipMemGetAddressRange(reinterpret_cast<hipDeviceptr_t*>(&base), &size, const_cast<void*>(ptr)) ==
                 hipSuccess,
             ErrorCode::InvalidUsage, "ExportIpcMemory: %p is not HIP device memory", ptr);
  auto b = reinterpret_cast<uintptr_t>(base);
  MORI_CHECK(p + bytes <= b + size, ErrorCode::InvalidUsage,
             "ExportIpcMemory: [%p, +%zu) runs past the end of its allocation (%zu bytes at %p)", ptr, bytes, size, base);
  int device = 0;
  MORI_CHECK_GPU(GpuGetDevice(&device));
  IpcMemoryHandle h = NewHandle(IpcMemoryKind::HipLegacy, device, size, p - b, bytes);
  hipIpcMemHandle_t legacy;
  static_assert(sizeof(legacy) <= sizeof(h.legacyHandle), "hipIpcMemHandle_t fits the handle");
  MORI_CHECK_GPU(hipIpcGetMemHandle(&legacy, base));
  std::memcpy(h.legacyHandle, &legacy, sizeof(legacy));
  (void)rec;
  return h;
#endif
}

std::unique_ptr<IpcMemoryMapping> IpcMemoryMapping::Import(const IpcMemoryHandle& h, UniqueFd fd) {
  MORI_CHECK(h.magic == kHandleMagic, ErrorCode::Protocol, "IPC memory handle with bad magic 0x%08x", h.magic);
  MORI_CHECK(h.bytes > 0 && h.offset <= h.allocationBytes && h.bytes <= h.allocationBytes - h.offset,
             ErrorCode::Protocol, "IPC memory handle range [%llu, +%llu) outside its %llu-byte allocation",
             static_cast<unsigned long long>(h.offset), static_cast<unsigned long long>(h.bytes),
             static_cast<unsigned long long>(h.allocationBytes));
  MORI_CHECK(KindCarriesFd(h.kind) == fd.Valid(), ErrorCode::Protocol,
             "IPC memory handle of kind %u from rank %d %s a file descriptor", h.kind, h.ownerRank,
             fd.Valid() ? "came with" : "came without");
  std::unique_ptr<IpcMemoryMapping> m(new IpcMemoryMapping());
  m->handle_ = h;
  switch (static_cast<IpcMemoryKind>(h.kind)) {
#if MORI_BACKEND_HOST
    case IpcMemoryKind::HostMemfd: {
      // Seals before size: once the size is sealed, what fstat reports holds for as long as the mapping.
      int seals = fcntl(fd.Get(), F_GET_SEALS);
      if (seals < 0) {
        int err = errno;
        MORI_THROW(ErrorCode::Protocol, "the descriptor from rank %d (pid %llu) is not a sealable memfd: %s",
                   h.ownerRank, static_cast<unsigned long long>(h.ownerPid), ErrnoString(err).c_str());
      }
      MORI_CHECK((seals & alloc::kMemfdSeals) == alloc::kMemfdSeals, ErrorCode::Protocol,
                 "memfd from rank %d (pid %llu) is not sealed against resizing (seals 0x%x, 0x%x needed): its "
                 "owner could shrink it under this mapping",
                 h.ownerRank, static_cast<unsigned long long>(h.ownerPid), static_cast<unsigned>(seals),
                 static_cast<unsigned>(alloc::kMemfdSeals));
      struct stat st;
      MORI_CHECK_SYS(fstat(fd.Get(), &st));
      MORI_CHECK(static_cast<uint64_t>(st.st_size) >= h.allocationBytes, ErrorCode::Protocol,
                 "memfd from rank %d holds %lld bytes, the handle claims %llu", h.ownerRank,
                 static_cast<long long>(st.st_size), static_cast<unsigned long long>(h.allocationBytes));
      void* base = mmap(nullptr, h.allocationBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.Get(), 0);
      if (base == MAP_FAILED) MORI_THROW_SYS(errno, "mapping rank %d's memfd", h.ownerRank);
      m->base_ = base;
      break;
    }
#elif MORI_BACKEND_CUDA
    case IpcMemoryKind::CudaVmm: {
      cuda::EnsureContext();
      const cuda::Driver& d = cuda::Driver::Get();
      int device = 0;
      MORI_CHECK_GPU(GpuGetDevice(&device));
      CUmemGenericAllocationHandle handle;
      MORI_CHECK_CU(d.memImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd.Get())),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      CUmemAllocationProp prop = {};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = h.ownerDevice;
      size_t granularity = 0;
      CUdeviceptr va = 0;
      try {
        MORI_CHECK_CU(d.memGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        MORI_CHECK_CU(d.memAddressReserve(&va, h.allocationBytes, granularity, 0, 0));
        MORI_CHECK_CU(d.memMap(va, h.allocationBytes, 0, handle, 0));
        CUmemAccessDesc access = {};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        MORI_CHECK_CU(d.memSetAccess(va, h.allocationBytes, &access, 1));
      } catch (...) {
        if (va != 0) {
          d.memUnmap(va, h.allocationBytes);
          d.memAddressFree(va, h.allocationBytes);
        }
        d.memRelease(handle);
        throw;
      }
      d.memRelease(handle);
      m->base_ = reinterpret_cast<void*>(va);
      break;
    }
    case IpcMemoryKind::CudaLegacy: {
      cudaIpcMemHandle_t legacy;
      std::memcpy(&legacy, h.legacyHandle, sizeof(legacy));
      MORI_CHECK_GPU(cudaIpcOpenMemHandle(&m->base_, legacy, cudaIpcMemLazyEnablePeerAccess));
      // The handle's sizes are only the sender's word; the driver knows the allocation that was opened (m
      // closes it again if this throws).
      CUdeviceptr realBase = 0;
      size_t realBytes = 0;
      MORI_CHECK_CU(cuda::Driver::Get().memGetAddressRange(&realBase, &realBytes,
                                                           reinterpret_cast<CUdeviceptr>(m->base_)));
      CheckLegacyRange(h, reinterpret_cast<uintptr_t>(m->base_), realBase, realBytes);
      break;
    }
#else
    case IpcMemoryKind::HipLegacy: {
      hipIpcMemHandle_t legacy;
      std::memcpy(&legacy, h.legacyHandle, sizeof(legacy));
      MORI_CHECK_GPU(hipIpcOpenMemHandle(&m->base_, legacy, hipIpcMemLazyEnablePeerAccess));
      // The handle's sizes are only the sender's word; the runtime knows the allocation that was opened (m
      // closes it again if this throws).
      hipDeviceptr_t realBase = nullptr;
      size_t realBytes = 0;
      MORI_CHECK_GPU(hipMemGetAddressRange(&realBase, &realBytes, static_cast<hipDeviceptr_t>(m->base_)));
      CheckLegacyRange(h, reinterpret_cast<uintptr_t>(m->base_), reinterpret_cast<uintptr_t>(realBase), realBytes);
      break;
    }
#endif
    default:
      MORI_THROW(ErrorCode::Protocol, "IPC memory handle of kind %u (%s) cannot be mapped by the %s backend", h.kind,
                 IpcMemoryKindName(static_cast<IpcMemoryKind>(h.kind)), MORI_BACKEND_NAME);
  }
  m->data_ = static_cast<char*>(m->base_) + h.offset;
  MORI_LOG_DEBUG(Ipc, "mapped %llu bytes of rank %d (%s) at %p", static_cast<unsigned long long>(h.bytes), h.ownerRank,
                 IpcMemoryKindName(static_cast<IpcMemoryKind>(h.kind)), m->data_);
  return m;
}

IpcMemoryMapping::~IpcMemoryMapping() {
  if (base_ == nullptr) return;
  switch (static_cast<IpcMemoryKind>(handle_.kind)) {
#if MORI_BACKEND_HOST
    case IpcMemoryKind::HostMemfd:
      munmap(base_, handle_.allocationBytes);
      break;
#elif MORI_BACKEND_CUDA
    case IpcMemoryKind::CudaVmm: {
      const cuda::Driver& d = cuda::Driver::Get();
      auto va = reinterpret_cast<CUdeviceptr>(base_);
      d.memUnmap(va, handle_.allocationBytes);
      d.memAddressFree(va, handle_.allocationBytes);
      break;
    }
    case IpcMemoryKind::CudaLegacy:
      (void)cudaIpcCloseMemHandle(base_);
      break;
#else
    case IpcMemoryKind::HipLegacy:
      (void)hipIpcCloseMemHandle(base_);
      break;
#endif
    default:
      break;
  }
}

std::vector<std::shared_ptr<IpcMemoryMapping>> ExchangeIpcMemory(Bootstrap& bootstrap, const HostTopology& topology,
                                                                 FdChannel& channel, const void* ptr, size_t bytes,
                                                                 uint64_t tag) {
  std::vector<std::shared_ptr<IpcMemoryMapping>> mapped(static_cast<size_t>(bootstrap.GetNranks()));
  if (topology.localSize == 1) return mapped;
  UniqueFd fd;
  IpcMemoryHandle mine = ExportIpcMemory(ptr, bytes, &fd);
  mine.ownerRank = bootstrap.GetRank();
  // Datagrams queue at the receiver, so every rank can send to all before it receives from any.
  for (int peer : topology.localRanks) {
    if (peer != topology.rank) channel.Send(peer, tag, fd.Get(), &mine, sizeof(mine));
  }
  for (int peer : topology.localRanks) {
    if (peer == topology.rank) continue;
    IpcMemoryHandle theirs;
    IpcSender sender;
    UniqueFd theirFd = channel.Recv(peer, tag, &theirs, sizeof(theirs), Deadline::Default(), &sender);
    // The channel took the message only from the process of rank `peer` (its kernel-reported pid); the handle
    // must name that same process as the memory's owner.
    MORI_CHECK(theirs.ownerRank == sender.rank && theirs.ownerPid == static_cast<uint64_t>(sender.pid),
               ErrorCode::Protocol,
               "rank %d's memory handle names rank %d (pid %llu) as its owner, but it came from pid %d (uid %u)", peer,
               theirs.ownerRank, static_cast<unsigned long long>(theirs.ownerPid), static_cast<int>(sender.pid),
               static_cast<unsigned>(sender.uid));
    mapped[static_cast<size_t>(peer)] = IpcMemoryMapping::Import(theirs, std::move(theirFd));
  }
  return mapped;
}

}  // namespace mori::core
