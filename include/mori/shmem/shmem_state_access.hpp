// How device code finds the SHMEM state. On CUDA and HIP every translation unit that includes this header
// holds its own copy in constant memory (so no -rdc is needed) and registers an uploader with the runtime
// at static initialisation; ShmemInit and ShmemFinalize call every registered uploader. On HOST one state
// in the library serves all. Also the query functions that both host and device code call.
#pragma once

#include "mori/core/device.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/shmem/shmem_device_state.hpp"
#include "mori/shmem/shmem_layout.hpp"
#include "mori/shmem/shmem_types.hpp"

#if MORI_BACKEND_CUDA && MORI_GPU_COMPILER
#include <cuda_runtime.h>
#elif MORI_BACKEND_HIP && MORI_GPU_COMPILER
#include <hip/hip_runtime.h>
#endif

namespace mori::shmem {
namespace detail {

// Host side of the library (libmori_shmem).
using StateUploader = int (*)(const ShmemDeviceState* state);
// Remembers `uploader` and, if the runtime is already initialised, calls it at once. `layoutSignature` is the
// kShmemLayoutSignature of the headers the uploader's code was compiled against: one that differs from the
// runtime's is refused (logged, never called) and makes ShmemInit and ShmemModuleInit fail, naming both.
bool RegisterStateUploader(StateUploader uploader, uint64_t layoutSignature);
// The form of headers older than the layout signature: refused in the same way, as its layout cannot be checked.
bool RegisterStateUploader(StateUploader uploader);
// Forgets `uploader` (a module being unloaded: its static destructors call it).
void UnregisterStateUploader(StateUploader uploader);
int HostMyPe();
int HostNPes();
void* HostPtr(const void* dest, int pe);
int HostTeamMyPe(ShmemTeam team);
int HostTeamNPes(ShmemTeam team);
int HostTeamTranslatePe(ShmemTeam from, int pe, ShmemTeam to);

#if MORI_BACKEND_HOST
extern ShmemDeviceState hostState;
MORI_HOST_DEVICE_INLINE const ShmemDeviceState& State() { return hostState; }
#elif MORI_GPU_COMPILER && defined(MORI_SHMEM_MODULE_BY_HANDLE)
// A module the application loads by handle (cuModuleLoad / hipModuleLoad of a cubin, fatbin or PTX, compiled
// with -DMORI_SHMEM_MODULE_BY_HANDLE): no host code of it runs, so it cannot register itself. Its state has a
// fixed unmangled name that ShmemModuleInit(module) finds with the driver (kShmemModuleStateSymbol), and the
// runtime uploads to it until ShmemModuleFinalize(module).
extern "C" {
__constant__ ShmemDeviceState mori_shmem_module_state;
// The signature of the headers the module was compiled against, which ShmemModuleInit(module) reads and compares
// with the runtime's before the first upload (kShmemModuleLayoutSymbol).
__constant__ uint64_t mori_shmem_module_layout = kShmemLayoutSignature;
}
MORI_DEVICE_INLINE const ShmemDeviceState& State() { return mori_shmem_module_state; }
#elif MORI_GPU_COMPILER
namespace {
__constant__ ShmemDeviceState tuState;

int UploadTuState(const ShmemDeviceState* state) {
#if MORI_BACKEND_CUDA
  return static_cast<int>(cudaMemcpyToSymbol(tuState, state, sizeof(ShmemDeviceState)));
#else
  return static_cast<int>(hipMemcpyToSymbol(HIP_SYMBOL(tuState), state, sizeof(ShmemDeviceState)));
#endif
}

// Registered while the module is loaded: a shared library that is unloaded takes its uploader with it.
struct TuStateRegistration {
  TuStateRegistration() { RegisterStateUploader(&UploadTuState, kShmemLayoutSignature); }
  ~TuStateRegistration() { UnregisterStateUploader(&UploadTuState); }
};
[[maybe_unused]] const TuStateRegistration tuStateRegistration;
}  // namespace

MORI_DEVICE_INLINE const ShmemDeviceState& State() { return tuState; }
#endif


// Team lookups on a ShmemTeamState: the device state's table in kernels, the runtime's host copy on the host.
// The team in `team`'s slot when the runtime is up and the slot holds one, else nullptr.
MORI_HOST_DEVICE_INLINE const ShmemTeamState* TeamAt(const ShmemDeviceState& s, ShmemTeam team) {
  const auto id = static_cast<uint32_t>(team);  // Invalid (-1) wraps past the table
  if (s.magic != kShmemStateMagic || s.teams == nullptr || id >= kShmemMaxTeams || s.teams[id].size <= 0) {
    return nullptr;
  }
  return &s.teams[id];
}

// World PE of member `index` (in [0, size)).
MORI_HOST_DEVICE_INLINE int TeamWorldPe(const ShmemTeamState& t, int index) {
  return t.stride > 0 ? t.start + index * t.stride : t.members[index];
}

// Member number of world PE `pe`, -1 when it is not a member.
MORI_HOST_DEVICE_INLINE int TeamIndexOf(const ShmemTeamState& t, int pe) {
  if (t.stride > 0) {
    const int off = pe - t.start;
    if (off < 0 || off % t.stride != 0 || off / t.stride >= t.size) return -1;
    return off / t.stride;
  }
  int lo = 0, hi = t.size - 1;  // members ascend
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    const int m = t.members[mid];
    if (m == pe) return mid;
    if (m < pe) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

// The number in `to` of member `pe` of `from` (both may be nullptr: no team), -1 when there is none.
MORI_HOST_DEVICE_INLINE int TeamTranslate(const ShmemTeamState* from, int pe, const ShmemTeamState* to) {
  if (from == nullptr || to == nullptr || pe < 0 || pe >= from->size) return -1;
  return TeamIndexOf(*to, TeamWorldPe(*from, pe));
}
}  // namespace detail

// This PE's number and the number of PEs (host and device). -1 and 0 before ShmemInit.
#if MORI_DEVICE_API_AVAILABLE
MORI_HOST_DEVICE_INLINE int ShmemMyPe() {
#if MORI_DEVICE_COMPILE
  return detail::State().rank;
#else
  return detail::HostMyPe();
#endif
}

MORI_HOST_DEVICE_INLINE int ShmemNPes() {
#if MORI_DEVICE_COMPILE
  return detail::State().nPes;
#else
  return detail::HostNPes();
#endif
}

// The address through which this thread can load and store `dest` (a symmetric address) on `pe`: the
// peer's heap mapped here (Self, P2P), else nullptr (RDMA, Proxy, or not a heap address).
MORI_HOST_DEVICE_INLINE void* ShmemPtr(const void* dest, int pe) {
#if MORI_DEVICE_COMPILE
  const ShmemDeviceState& s = detail::State();
  uintptr_t a = reinterpret_cast<uintptr_t>(dest);
  if (s.magic != kShmemStateMagic || pe < 0 || pe >= s.nPes || a < s.heapBase || a - s.heapBase >= s.heapBytes) {
    return nullptr;
  }
  uintptr_t peer = s.peerBases[pe];
  return peer == 0 ? nullptr : reinterpret_cast<void*>(peer + (a - s.heapBase));
#else
  return detail::HostPtr(dest, pe);
#endif
}

// This PE's number in `team`, the team's size, and the number in `to` of member `pe` of `from` (host and
// device). -1 for a team this PE is not in (MyPe), an invalid or destroyed team (all three), or a PE that is
// not a member (TranslatePe).
MORI_HOST_DEVICE_INLINE int ShmemTeamMyPe(ShmemTeam team) {
#if MORI_DEVICE_COMPILE
  const ShmemTeamState* t = detail::TeamAt(detail::State(), team);
  return t == nullptr ? -1 : t->myIndex;
#else
  return detail::HostTeamMyPe(team);
#endif
}

MORI_HOST_DEVICE_INLINE int ShmemTeamNPes(ShmemTeam team) {
#if MORI_DEVICE_COMPILE
  const ShmemTeamState* t = detail::TeamAt(detail::State(), team);
  return t == nullptr ? -1 : t->size;
#else
  return detail::HostTeamNPes(team);
#endif
}

MORI_HOST_DEVICE_INLINE int ShmemTeamTranslatePe(ShmemTeam from, int pe, ShmemTeam to) {
#if MORI_DEVICE_COMPILE
  const ShmemDeviceState& s = detail::State();
  return detail::TeamTranslate(detail::TeamAt(s, from), pe, detail::TeamAt(s, to));
#else
  return detail::HostTeamTranslatePe(from, pe, to);
#endif
}
#else
inline int ShmemTeamMyPe(ShmemTeam team) { return detail::HostTeamMyPe(team); }
inline int ShmemTeamNPes(ShmemTeam team) { return detail::HostTeamNPes(team); }
inline int ShmemTeamTranslatePe(ShmemTeam from, int pe, ShmemTeam to) {
  return detail::HostTeamTranslatePe(from, pe, to);
}
inline int ShmemMyPe() { return detail::HostMyPe(); }
inline int ShmemNPes() { return detail::HostNPes(); }
inline void* ShmemPtr(const void* dest, int pe) { return detail::HostPtr(dest, pe); }
#endif

}  // namespace mori::shmem
