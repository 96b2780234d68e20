// A kernel module the test loads by handle (ShmemTest.ModulesLoadedByHandle): compiled on its own into a cubin
// and into PTX that the driver JIT-compiles at load, as a JIT kernel would be, and once more without
// MORI_SHMEM_MODULE_BY_HANDLE (a module ShmemModuleInit(module) must refuse). No host code of it ever runs.
#include <cstddef>
#include <cstdint>

#include "../common/test_util.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using mori::core::test::PatternByte;
using namespace mori::shmem;

// out[0..2]: this PE, the number of PEs and the world team's size as the module sees them; out[3]: bytes
// from the left neighbour that differ from its pattern of `round`. Each PE puts its `bytes` of src into its
// right neighbour's buf with the signal set to `round`, waits for its own, and checks what arrived.
extern "C" __global__ void mori_handle_ring(uint8_t* buf, const uint8_t* src, size_t bytes, uint64_t* sig,
                                            uint64_t round, uint32_t* out) {
  const int me = ShmemMyPe(), n = ShmemNPes();
  if (threadIdx.x == 0) {
    out[0] = static_cast<uint32_t>(me);
    out[1] = static_cast<uint32_t>(n);
    out[2] = static_cast<uint32_t>(ShmemTeamNPes(kShmemTeamWorld));
  }
  if (n <= 0) return;  // the runtime is down: the state says so, and nothing is sent
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  ShmemPutMemNbiSignalBlock(buf, src, bytes, sig, round, SignalOp::Set, right);
  if (threadIdx.x == 0) {
    ShmemSignalWaitUntil(sig, CmpOp::EQ, round);
    const volatile uint8_t* seen = buf;  // a NIC may have written it behind this thread's caches
    uint32_t bad = 0;
    for (size_t i = 0; i < bytes; ++i) bad += seen[i] != PatternByte(left, i, static_cast<uint32_t>(round));
    out[3] = bad;
    ShmemQuietThread();
  }
  __syncthreads();
  ShmemBarrierAllBlock();
}
