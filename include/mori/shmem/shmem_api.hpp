// The SHMEM host API: start the runtime (from mpirun, MORI_* / torchrun variables, an MPI communicator or
// a unique id), allocate on the symmetric heap (collective: same offsets on every PE), synchronise, and
// ask how a peer is reached. C-style: 0 means success; an error returns non-zero after a log line that
// names the cause.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/config.hpp"
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
