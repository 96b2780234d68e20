// The SHMEM host API: start the runtime (from mpirun, MORI_* / torchrun variables, an MPI communicator or
// a unique id), allocate on the symmetric heap (collective: same offsets on every PE), synchronise, and
// ask how a peer is reached. C-style: 0 means success; an error returns non-zero after a log line that
// names the cause.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/config.hpp"
#include "mori/core/gpu.hpp"
#include "mori/shmem/shmem_state_access.hpp"
#include "mori/shmem/shmem_types.hpp"

#if MORI_HAS_MPI
#include <mpi.h>
#endif

namespace mori::shmem {

int ShmemInit();
#if MORI_HAS_MPI
int ShmemMpiInit(MPI_Comm comm);
#endif
// Fills *uid with a fresh id whose root (the caller, which must be rank 0 of the job) listens for the others.
int ShmemGetUniqueId(mori_shmem_uniqueid_t* uid);
int ShmemSetAttrUniqueIdArgs(int rank, int nRanks, mori_shmem_uniqueid_t* uid, mori_shmem_init_attr_t* attr);
int ShmemInitAttr(unsigned flags, mori_shmem_init_attr_t* attr);
// Collective: waits for every PE, then releases the heap, the mappings, the NIC queues and the bootstrap.
int ShmemFinalize();
bool ShmemIsInitialized();

// Collective; every PE must ask for the same size in the same order. nullptr (on every PE) when the heap
// cannot hold it; sizes that differ between PEs are an error on every PE.
void* ShmemMalloc(size_t bytes);
void* ShmemMallocAlign(size_t alignment, size_t bytes);
void* ShmemCalloc(size_t count, size_t bytes);
void ShmemFree(void* ptr);

// Waits until every PE has arrived (the GPU work queued so far on this PE finished first).
void ShmemBarrierAll();
// The same barrier, saying whether it completed: 0, or non-zero when it failed (a peer died, a wait ran out: the
// log names the cause). After a failure the job cannot go on; ShmemBarrierAll fails the same way, unseen by its
// caller.
int ShmemBarrierAllChecked();

// Ordered with the caller's work on `stream` (a kernel of one thread on it), without blocking the host:
// the barrier (quiet, then wait for every PE's arrival) and the quiet (every put, get and atomic issued
// from this PE's kernels before it is complete). Errors inside the kernel trap it, naming the cause;
// launch failures return non-zero.
int ShmemBarrierAllOnStream(core::GpuStream stream);
int ShmemQuietOnStream(core::GpuStream stream);

// Teams (the queries ShmemTeamMyPe, ShmemTeamNPes, ShmemTeamTranslatePe are in shmem_state_access.hpp, for
// host and device). Collective over `parent`: every member calls it with the same arguments; the members
// numbered start, start + stride, ... (size of them) of the parent form the new team, the same handle on
// each of them, and the other members of the parent get kShmemTeamInvalid in *out. Returns 0 on success.
// Arguments that differ between PEs, fall outside the parent, or a PE with all kShmemMaxTeams slots in use:
// non-zero on every member, and *out = kShmemTeamInvalid.
int ShmemTeamSplitStrided(ShmemTeam parent, int start, int stride, int size, ShmemTeam* out);
// Local: the handle is invalid from now on (world and node cannot be destroyed). Call it only after the
// team's last sync, on every member.
void ShmemTeamDestroy(ShmemTeam team);
// Waits until every member has called it (this PE's GPU work queued so far finished first). 0 on success.
int ShmemTeamSync(ShmemTeam team);
// The device team sync in a kernel of one thread on `stream`.
int ShmemTeamSyncOnStream(ShmemTeam team, core::GpuStream stream);

// Put, put-with-signal, get and signal wait from the host, ordered with the work on `stream` (a small
// kernel on it; the host does not wait). dest/sigAddr are symmetric addresses, source any memory this PE's
// kernels can read; the put is complete at its target when a later ShmemQuietOnStream on the stream is.
int ShmemPutMemOnStream(void* dest, const void* source, size_t bytes, int pe, core::GpuStream stream);
int ShmemPutMemSignalOnStream(void* dest, const void* source, size_t bytes, uint64_t* sigAddr, uint64_t sigVal,
                              SignalOp op, int pe, core::GpuStream stream);
int ShmemGetMemOnStream(void* dest, const void* source, size_t bytes, int pe, core::GpuStream stream);
int ShmemSignalWaitUntilOnStream(uint64_t* sigAddr, CmpOp cmp, uint64_t value, core::GpuStream stream);

// A separately compiled module (a shared library such as a PyTorch extension, or a program's other
// translation units) that includes shmem_device_api.hpp registers its copy of the device state when it is
// loaded, and ShmemInit and ShmemFinalize update it; a module loaded after ShmemInit gets the state at once.
// ShmemModuleInit() checks that the runtime is up and that every registered module holds the current state
// (0 when so): call it once after loading a module, before its first kernel. A module compiled against mori
// headers of another layout (kShmemLayoutSignature, shmem_layout.hpp) is refused when it registers and takes
// no upload; while it is loaded, ShmemInit and ShmemModuleInit() fail, naming both signatures.
//
// A module loaded by handle (a CUmodule from cuModuleLoad/cuModuleLoadData of a cubin, fatbin or PTX the
// driver JIT-compiles, a CUlibrary's module from cuLibraryGetModule, a hipModule_t) runs no host code, so it
// cannot register itself: compile it with -DMORI_SHMEM_MODULE_BY_HANDLE (its state then has the fixed name
// kShmemModuleStateSymbol) and call ShmemModuleInit(module) after ShmemInit, before its first kernel. The
// runtime uploads the state now and again at every ShmemInit and ShmemFinalize until
// ShmemModuleFinalize(module), which must come before the module is unloaded. Calling ShmemModuleInit again
// for the same module only uploads. Errors: the runtime is not up, the module has no such state (compiled
// without the macro), one of another size or another layout signature (kShmemModuleLayoutSymbol, compiled
// against other mori headers, or none: headers older than the signature), the HOST backend (no GPU modules).
int ShmemModuleInit(void* module = nullptr);
// Forgets a module loaded by handle (0), or an error when it was not initialised with ShmemModuleInit.
int ShmemModuleFinalize(void* module);

// Per-peer transport (Self for the calling PE).
TransportType ShmemTransportType(int pe);
const char* TransportTypeName(TransportType type);

// Registers a local buffer outside the heap with the NIC and the proxy's connections, so RDMA and Proxy puts
// may read from it and gets may land in it (the heap itself needs nothing). Not collective. 0 on success.
// Unregister only after a quiet that covers every operation using the buffer.
int ShmemBufferRegister(void* ptr, size_t bytes);
int ShmemBufferUnregister(void* ptr);

// Bytes of the symmetric heap available to ShmemMalloc, and the heap's base on this PE.
size_t ShmemHeapBytes();
void* ShmemHeapBase();

}  // namespace mori::shmem
