// Kernel modules that ShmemModuleInit(module) must refuse for their layout (ShmemTest.ModulesLoadedByHandle),
// compiled on their own into cubins (CUDA) or code objects (HIP). Each holds the device state under its
// by-handle name, of the right size, but was "built against other headers": with MORI_TEST_STALE_LAYOUT its
// layout signature differs from the runtime's; without it there is none, as in a module built against headers
// older than the signature. No code of it ever runs.
#include <cstdint>

#include "mori/shmem/shmem_layout.hpp"

extern "C" {
__constant__ mori::shmem::ShmemDeviceState mori_shmem_module_state;
#ifdef MORI_TEST_STALE_LAYOUT
__constant__ uint64_t mori_shmem_module_layout = mori::shmem::kShmemLayoutSignature ^ 0x5a5a;
#endif
}
