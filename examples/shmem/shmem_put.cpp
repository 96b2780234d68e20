// shmem_put: non-blocking puts at each scope. Every PE's kernel puts a pattern into its right-hand
// neighbour's symmetric buffer, each unit (a thread, a warp or a block) its own slice, then quiets; after a
// barrier every PE checks each byte from its left-hand neighbour and that the guard bytes on both sides of
// the target are untouched.
//
//   mpirun -np 4 ./shmem_put [thread|warp|block|all] [bytes per unit]
//   MORI_SHMEM_TRANSPORT=p2p|rdma|proxy picks the transport between PEs (proxy: MORI_SHMEM_PROXY_CONN=tcp|rdma).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/env.hpp"
#include "shmem_example_util.hpp"

namespace mori_example {
namespace {

enum class PutScope : int { Thread = 0, Warp = 1, Block = 2 };
const char* const kScopeNames[] = {"thread", "warp", "block"};

constexpr uint8_t kGuard = 0xA5;
constexpr size_t kGuardBytes = 67;  // also puts the target off 16-byte alignment
constexpr unsigned kBlocks = MORI_BACKEND_HOST ? 4 : 8;

MORI_GLOBAL void PutKernel(int scope, uint8_t* dst, const uint8_t* src, size_t chunk, int pe) {
  auto s = static_cast<PutScope>(scope);
  size_t unit = s == PutScope::Block  ? core::FlatBlockIdx()
                : s == PutScope::Warp ? core::GlobalThreadIdx() / MORI_WARP_SIZE
                                      : core::GlobalThreadIdx();
  uint8_t* d = dst + unit * chunk;
  const uint8_t* from = src + unit * chunk;
  switch (s) {
    case PutScope::Thread:
      shmem::ShmemPutMemNbiThread(d, from, chunk, pe);
      break;
    case PutScope::Warp:
      shmem::ShmemPutMemNbiWarp(d, from, chunk, pe);
      break;
    case PutScope::Block:
      shmem::ShmemPutMemNbiBlock(d, from, chunk, pe);
      break;
  }
  shmem::ShmemQuietThread();
}

// Puts at one scope; returns the number of wrong bytes in this PE's target (guards included).
size_t RunScope(PutScope scope, size_t chunk) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  const unsigned units = scope == PutScope::Block  ? kBlocks
                         : scope == PutScope::Warp ? kBlocks * kThreadsPerBlock / MORI_WARP_SIZE
                                                   : kBlocks * kThreadsPerBlock;
  const size_t payload = units * chunk;
  const size_t bytes = kGuardBytes + payload + kGuardBytes;
  const auto seed = static_cast<uint32_t>(scope);

  uint8_t* src = SymmetricAlloc<uint8_t>(payload, "the source");
  uint8_t* dst = SymmetricAlloc<uint8_t>(bytes, "the target");
  FromHost(src, Pattern(payload, me, seed));
  FromHost(dst, std::vector<uint8_t>(bytes, kGuard));
  shmem::ShmemBarrierAll();  // no neighbour puts into a target that is still being filled with guards

  core::LaunchKernel(PutKernel, core::Dim3(kBlocks), core::Dim3(kThreadsPerBlock), 0, nullptr, static_cast<int>(scope),
                     dst + kGuardBytes, src, chunk, right);
  WaitKernels();
  shmem::ShmemBarrierAll();  // every PE's puts are complete

  std::vector<uint8_t> got = ToHost(dst, bytes);
  size_t bad = CountMismatches(got.data() + kGuardBytes, payload, left, seed);
  size_t guardBad = 0;
  for (size_t i = 0; i < kGuardBytes; ++i) guardBad += (got[i] != kGuard) + (got[bytes - 1 - i] != kGuard);
  if (bad + guardBad != 0) {
    std::printf("PE %d: %s put from PE %d: %zu wrong payload bytes, %zu guard bytes overwritten\n", me,
                kScopeNames[seed], left, bad, guardBad);
  }
  shmem::ShmemFree(dst);
  shmem::ShmemFree(src);
  return bad + guardBad;
}

int Run(int argc, char** argv) {
  std::string which = argc > 1 ? argv[1] : "all";
  size_t chunk = argc > 2 ? core::ParseSize(argv[2], "bytes per unit") : 8191;
  std::vector<PutScope> scopes;
  std::string label;  // "thread+warp+block"
  for (int s = 0; s < 3; ++s) {
    if (which == "all" || which == kScopeNames[s]) {
      scopes.push_back(static_cast<PutScope>(s));
      label += (label.empty() ? "" : "+") + std::string(kScopeNames[s]);
    }
  }
  if (scopes.empty() || chunk == 0) {
    std::fprintf(stderr, "usage: shmem_put [thread|warp|block|all] [bytes per unit, > 0]\n");
    return 2;
  }

  InitOrThrow();
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int left = (me + n - 1) % n;
  size_t bad = 0;
  for (PutScope scope : scopes) bad += RunScope(scope, chunk);
  std::printf("PE %d/%d: %s puts of %zu B per unit from PE %d (%s): %s\n", me, n, label.c_str(), chunk, left,
              shmem::TransportTypeName(shmem::ShmemTransportType(left)), bad == 0 ? "verified" : "CORRUPTED");
  std::fflush(stdout);
  uint64_t total = SumOverPes(bad);
  if (me == 0) {
    std::printf("shmem_put: %d PEs, %s puts, %zu B per unit: %s\n", n, label.c_str(), chunk,
                total == 0 ? "Success" : "FAILED");
  }
  FinalizeOrThrow();
  return total == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori_example

int main(int argc, char** argv) {
  return mori_example::ExampleMain("shmem_put", mori_example::Run, argc, argv);
}
