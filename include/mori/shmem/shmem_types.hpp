// Names shared by the SHMEM host and device APIs: transports, signal and comparison operators, the unique
// id and the init attributes. Includes nothing host-only.
#pragma once

#include <cstdint>
#include <type_traits>

namespace mori::shmem {

// How this PE reaches a peer. Self: the PE itself. P2P: loads and stores through the peer's heap mapped
// here. RDMA: GPU-initiated work requests (IBGDA) on a real or emulated NIC. Proxy: a host proxy thread.
enum class TransportType : uint32_t { Self = 0, P2P = 1, RDMA = 2, Proxy = 3 };

enum class SignalOp : uint32_t { Set = 0, Add = 1 };

enum class CmpOp : uint32_t { EQ = 0, NE = 1, GT = 2, GE = 3, LT = 4, LE = 5 };

// A team: a subset of the PEs with its own numbering 0..n-1 (world PEs in ascending order). The same
// handle on every member; world and node (the PEs of this host) exist from ShmemInit to ShmemFinalize,
// others come from ShmemTeamSplitStrided.
enum class ShmemTeam : int32_t { Invalid = -1, World = 0, Node = 1 };
constexpr ShmemTeam kShmemTeamInvalid = ShmemTeam::Invalid;
constexpr ShmemTeam kShmemTeamWorld = ShmemTeam::World;
constexpr ShmemTeam kShmemTeamNode = ShmemTeam::Node;

// Opaque bytes from ShmemGetUniqueId on one rank, handed to every rank by the program (its own broadcast).
struct mori_shmem_uniqueid_t {
  uint8_t internal[128];
};
static_assert(sizeof(mori_shmem_uniqueid_t) == 128 && std::is_trivially_copyable_v<mori_shmem_uniqueid_t>,
              "mori_shmem_uniqueid_t travels as bytes");

// What ShmemInitAttr needs: rank, size and unique id (MORI_SHMEM_INIT_WITH_UNIQUEID, filled by
// ShmemSetAttrUniqueIdArgs) or an MPI communicator (MORI_SHMEM_INIT_WITH_MPI_COMM: mpiComm points to an
// MPI_Comm).
struct mori_shmem_init_attr_t {
  int32_t rank = -1;
  int32_t nRanks = 0;
  mori_shmem_uniqueid_t uid{};
  void* mpiComm = nullptr;
};

constexpr unsigned MORI_SHMEM_INIT_WITH_UNIQUEID = 1u;
constexpr unsigned MORI_SHMEM_INIT_WITH_MPI_COMM = 2u;

}  // namespace mori::shmem
