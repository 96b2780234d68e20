// shmem_ring_allgather: an all-gather around a ring of PEs with put-with-signal. Every PE starts with its own
// block in its slot of a symmetric buffer; in step s (0 .. N-2) it forwards the block that arrived in step
// s-1 (its own in step 0) to the same slot on its right-hand neighbour, with a signal that says "step s is
// here", and waits for that signal from its left-hand neighbour. Each kernel block moves its own slice of
// every block with its own signal word, so slices proceed independently. Every PE checks all N blocks and
// that nothing was written past them.
//
//   mpirun -np 4 ./shmem_ring_allgather [block bytes, default 1m] [add|set]
//   add: the signal counts arrivals (SignalOp::Add 1); set: it holds the step (SignalOp::Set s + 1).
//   MORI_SHMEM_TRANSPORT=p2p|rdma|proxy picks the transport between PEs (proxy: MORI_SHMEM_PROXY_CONN=tcp|rdma).
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "mori/core/env.hpp"
#include "shmem_example_util.hpp"

namespace mori_example {
namespace {

constexpr unsigned kBlocks = MORI_BACKEND_HOST ? 2 : 8;
constexpr uint32_t kSeed = 0x41;
constexpr uint8_t kGuard = 0xA5;
constexpr size_t kGuardBytes = 64;

MORI_GLOBAL void RingAllGatherKernel(uint8_t* data, size_t blockBytes, uint64_t* signals, int setStep) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int right = (me + 1) % n;
  // This kernel block's slice of every block, 16-byte multiples so the copies stay vectorised.
  size_t slice = (blockBytes + core::FlatGridDim() - 1) / core::FlatGridDim();
  slice = (slice + 15) / 16 * 16;
  size_t begin = core::FlatBlockIdx() * slice;
  if (begin > blockBytes) begin = blockBytes;
  size_t len = blockBytes - begin < slice ? blockBytes - begin : slice;
  uint64_t* signal = signals + core::FlatBlockIdx();
  for (int s = 0; s < n - 1; ++s) {
    uint8_t* p = data + static_cast<size_t>((me - s + n) % n) * blockBytes + begin;
    if (setStep) {
      shmem::ShmemPutMemNbiSignalBlock(p, p, len, signal, static_cast<uint64_t>(s) + 1, shmem::SignalOp::Set, right);
    } else {
      shmem::ShmemPutMemNbiSignalBlock(p, p, len, signal, 1, shmem::SignalOp::Add, right);
    }
    // Both forms reach s + 1 once step s arrived; with Set a faster left neighbour may already be further.
    if (core::FlatThreadIdx() == 0) shmem::ShmemSignalWaitUntil(signal, shmem::CmpOp::GE, static_cast<uint64_t>(s) + 1);
    core::SyncThreads();  // the slice that arrived is what every thread forwards next
  }
  if (core::FlatThreadIdx() == 0) shmem::ShmemQuietThread();
}

int Run(int argc, char** argv) {
  const size_t blockBytes = argc > 1 ? core::ParseSize(argv[1], "block bytes") : size_t(1) << 20;
  const std::string mode = argc > 2 ? argv[2] : "add";
  if (blockBytes == 0 || (mode != "add" && mode != "set")) {
    std::fprintf(stderr, "usage: shmem_ring_allgather [block bytes, > 0] [add|set]\n");
    return 2;
  }
  InitOrThrow();
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int left = (me + n - 1) % n;
  const size_t dataBytes = static_cast<size_t>(n) * blockBytes;

  auto* data = SymmetricAlloc<uint8_t>(dataBytes + kGuardBytes, "the blocks");
  auto* signals = static_cast<uint64_t*>(shmem::ShmemCalloc(kBlocks, sizeof(uint64_t)));
  MORI_CHECK(signals != nullptr, core::ErrorCode::InvalidUsage, "ShmemCalloc for the signals failed");
  std::vector<uint8_t> init(dataBytes + kGuardBytes, kGuard);
  std::vector<uint8_t> mine = Pattern(blockBytes, me, kSeed);
  std::copy(mine.begin(), mine.end(), init.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(me) * blockBytes));
  FromHost(data, init);
  core::GpuEvent start = nullptr, stop = nullptr;
  MORI_CHECK_GPU(core::GpuEventCreate(&start));
  MORI_CHECK_GPU(core::GpuEventCreate(&stop));
  shmem::ShmemBarrierAll();  // every PE's blocks are in place before anybody forwards into them

  MORI_CHECK_GPU(core::GpuEventRecord(start, nullptr));
  core::LaunchKernel(RingAllGatherKernel, core::Dim3(kBlocks), core::Dim3(kThreadsPerBlock), 0, nullptr, data,
                     blockBytes, signals, mode == "set" ? 1 : 0);
  MORI_CHECK_GPU(core::GpuEventRecord(stop, nullptr));
  WaitKernels();
  float ms = 0;
  MORI_CHECK_GPU(core::GpuEventElapsedTime(&ms, start, stop));
  shmem::ShmemBarrierAll();  // the last step's puts into the right-hand neighbour are complete

  std::vector<uint8_t> got = ToHost(data, dataBytes + kGuardBytes);
  size_t bad = 0;
  for (int pe = 0; pe < n; ++pe) {
    size_t wrong = CountMismatches(got.data() + static_cast<size_t>(pe) * blockBytes, blockBytes, pe, kSeed);
    if (wrong != 0) std::printf("PE %d: block of PE %d has %zu wrong bytes\n", me, pe, wrong);
    bad += wrong;
  }
  size_t guardBad = 0;
  for (size_t i = dataBytes; i < got.size(); ++i) guardBad += got[i] != kGuard;
  if (guardBad != 0) std::printf("PE %d: %zu bytes past the last block were overwritten\n", me, guardBad);
  bad += guardBad;
  std::printf("PE %d/%d: %d blocks of %zu B (from PE %d over %s, signal %s) in %.3f ms: %s\n", me, n, n, blockBytes,
              left, shmem::TransportTypeName(shmem::ShmemTransportType(left)), mode.c_str(), ms,
              bad == 0 ? "verified" : "CORRUPTED");
  std::fflush(stdout);

  uint64_t totalBad = SumOverPes(bad);
  if (me == 0) {
    std::printf("shmem_ring_allgather: %d PEs, %zu B per PE, signal %s, %.3f ms on PE 0 (%.2f GB/s gathered): %s\n", n,
                blockBytes, mode.c_str(), ms, ms > 0 ? static_cast<double>(dataBytes) / (ms * 1e6) : 0.0,
                totalBad == 0 ? "Success" : "FAILED");
  }
  MORI_CHECK_GPU(core::GpuEventDestroy(stop));
  MORI_CHECK_GPU(core::GpuEventDestroy(start));
  shmem::ShmemFree(signals);
  shmem::ShmemFree(data);
  FinalizeOrThrow();
  return totalBad == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori_example

int main(int argc, char** argv) {
  return mori_example::ExampleMain("shmem_ring_allgather", mori_example::Run, argc, argv);
}
