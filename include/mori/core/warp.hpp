// Lane-level collectives over the threads of one warp that are executing the same call together: which
// lanes are there, which of them share a key, and handing a value from one lane to the others. A lane set is
// a 64-bit mask on every backend (an AMD wavefront has 64 lanes; on HOST a warp is one thread).
#pragma once

#include <cstdint>

#include "mori/core/device.hpp"
#include "mori/core/kernel.hpp"

#if MORI_DEVICE_API_AVAILABLE

namespace mori::core {

using LaneMask = uint64_t;

// The lanes of this warp executing this call with the caller (the caller among them).
MORI_DEVICE_INLINE LaneMask ActiveLanes() {
#if MORI_BACKEND_CUDA
  return __activemask();
#elif MORI_BACKEND_HIP
  return __ballot(1);
#else
  return 1;
#endif
}

MORI_DEVICE_INLINE unsigned LaneCount(LaneMask lanes) {
#if MORI_GPU_COMPILER
  return static_cast<unsigned>(__popcll(lanes));
#else
  return static_cast<unsigned>(__builtin_popcountll(lanes));
#endif
}

// Lowest and highest lane of a non-empty set.
MORI_DEVICE_INLINE unsigned LowestLane(LaneMask lanes) {
#if MORI_GPU_COMPILER
  return static_cast<unsigned>(__ffsll(static_cast<long long>(lanes)) - 1);
#else
  return static_cast<unsigned>(__builtin_ctzll(lanes));
#endif
}
MORI_DEVICE_INLINE unsigned HighestLane(LaneMask lanes) {
#if MORI_GPU_COMPILER
  return 63u - static_cast<unsigned>(__clzll(static_cast<long long>(lanes)));
#else
  return 63u - static_cast<unsigned>(__builtin_clzll(lanes));
#endif
}

// The lanes below the caller's.
MORI_DEVICE_INLINE LaneMask LanesBelow() {
  return (LaneMask(1) << LaneId()) - 1;
}

// The lanes of `lanes` (which every one of them passes, the caller included) whose `key` equals the
// caller's.
MORI_DEVICE_INLINE LaneMask MatchAny(LaneMask lanes, uint64_t key) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return __match_any_sync(static_cast<unsigned>(lanes), static_cast<unsigned long long>(key));
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  // No match instruction: one round per distinct key, led by the lowest lane not yet matched. The rounds
  // depend only on values every lane sees alike, so the lanes stay together through the loop.
  LaneMask left = lanes, mine = 0;
  while (left != 0) {
    unsigned long long leaderKey = __shfl(static_cast<unsigned long long>(key), static_cast<int>(LowestLane(left)));
    LaneMask same = static_cast<LaneMask>(__ballot(leaderKey == key)) & left;
    if (leaderKey == key) mine = same;
    left &= ~same;
  }
  return mine;
#else
  (void)key;
  return lanes & (LaneMask(1) << LaneId());
#endif
}

// `value` of lane `src` (a member of `lanes`, which every one of them passes).
template <typename T>
MORI_DEVICE_INLINE T ShuffleFrom(LaneMask lanes, T value, unsigned src) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "lanes exchange 4- or 8-byte values");
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return __shfl_sync(static_cast<unsigned>(lanes), value, static_cast<int>(src));
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  (void)lanes;
  return __shfl(value, static_cast<int>(src));
#else
  (void)lanes;
  (void)src;
  return value;
#endif
}

// The lanes of `lanes` (each one of them passes) whose `predicate` is true.
MORI_DEVICE_INLINE LaneMask Ballot(LaneMask lanes, bool predicate) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return __ballot_sync(static_cast<unsigned>(lanes), predicate);
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return static_cast<LaneMask>(__ballot(predicate)) & lanes;
#else
  return predicate ? (lanes & (LaneMask(1) << LaneId())) : 0;
#endif
}

// The lanes of this warp that are still running, as a vote of all of them: a lane that left its kernel (CUDA
// `exit`) takes no part and its bit is clear. Every running lane of the warp calls it; it orders no memory.
MORI_DEVICE_INLINE LaneMask RunningLanes() {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  return __ballot_sync(0xffffffffu, 1);
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  return static_cast<LaneMask>(__ballot(1));
#else
  return 1;
#endif
}

// Joins the lanes of `lanes` (each one of them passes): what each wrote before is visible to the others
// after.
MORI_DEVICE_INLINE void SyncLanes(LaneMask lanes) {
#if MORI_BACKEND_CUDA && MORI_DEVICE_COMPILE
  __syncwarp(static_cast<unsigned>(lanes));
#elif MORI_BACKEND_HIP && MORI_DEVICE_COMPILE
  (void)lanes;
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
  (void)lanes;
#endif
}

}  // namespace mori::core

#endif  // MORI_DEVICE_API_AVAILABLE
