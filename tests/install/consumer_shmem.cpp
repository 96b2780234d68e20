// Links mori::shmem alone, as a SHMEM user does: a job of one PE, an allocation on the symmetric heap, the
// transport to itself. Its libraries reach mori::channels, mori::rdma and mori::core through their own run
// paths, which is what this program proves when started with a clean environment.
#include <cstdio>

#include "mori/core/config.hpp"
#include "mori/shmem/shmem_api.hpp"

int main() {
  using namespace mori::shmem;
  if (ShmemInit() != 0) return 1;
  if (ShmemMyPe() != 0 || ShmemNPes() != 1) return 2;
  void* p = ShmemMalloc(4096);
  if (p == nullptr || ShmemPtr(p, 0) != p) return 3;
  if (ShmemTransportType(0) != TransportType::Self) return 4;
  ShmemFree(p);
  if (ShmemFinalize() != 0) return 5;
  std::printf("shmem consumer of mori %s (%s backend): 1 PE, heap allocation, ok\n", MORI_VERSION_STRING,
              MORI_BACKEND_NAME);
  return 0;
}
