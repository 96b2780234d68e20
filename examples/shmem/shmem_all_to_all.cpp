// shmem_all_to_all: every PE sends a distinct block to every PE, itself included. One kernel block per
// destination puts the block with ShmemPutMemNbiSignalBlock into the destination's receive slot for this
// PE and adds 1 to the destination's signal word for this PE; the same kernel block then waits for the
// signal of the PE whose block it expects. Two rounds with different data (the first warms up, the second is
// timed); after each, every PE checks all N blocks and that nothing was written past them.
//
//   mpirun -np 4 ./shmem_all_to_all [bytes per pair, default 1m]
//   MORI_SHMEM_TRANSPORT=p2p|rdma|proxy picks the transport between PEs (proxy: MORI_SHMEM_PROXY_CONN=tcp|rdma).
#include <cstdio>
#include <string>
#include <vector>

#include "mori/core/env.hpp"
#include "shmem_example_util.hpp"

namespace mori_example {
namespace {

constexpr int kRounds = 2;
constexpr uint8_t kGuard = 0xA5;
constexpr size_t kGuardBytes = 64;

// What `from` sends to `to` in `round`: distinct for every pair and round.
MORI_HOST_DEVICE_INLINE uint32_t PairSeed(int to, int round) {
  return static_cast<uint32_t>(round) * 65536u + static_cast<uint32_t>(to);
}

// Kernel block b sends to PE me + b and receives from PE me - b (whose block b sends here), so the PEs start
// on different destinations instead of all on PE 0.
MORI_GLOBAL void AllToAllKernel(const uint8_t* send, uint8_t* recv, size_t bytes, uint64_t* signals, int round) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const int b = static_cast<int>(core::FlatBlockIdx());
  const int to = (me + b) % n, from = (me - b + n) % n;
  shmem::ShmemPutMemNbiSignalBlock(recv + static_cast<size_t>(me) * bytes, send + static_cast<size_t>(to) * bytes,
                                   bytes, &signals[me], 1, shmem::SignalOp::Add, to);
  if (core::FlatThreadIdx() == 0) {
    shmem::ShmemSignalWaitUntil(&signals[from], shmem::CmpOp::GE, static_cast<uint64_t>(round));
    shmem::ShmemQuietThread();
  }
}

int Run(int argc, char** argv) {
  const size_t bytes = argc > 1 ? core::ParseSize(argv[1], "bytes per pair") : size_t(1) << 20;
  if (bytes == 0) {
    std::fprintf(stderr, "usage: shmem_all_to_all [bytes per pair, > 0]\n");
    return 2;
  }
  InitOrThrow();
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const size_t total = static_cast<size_t>(n) * bytes;
  auto* send = SymmetricAlloc<uint8_t>(total, "the send blocks");
  auto* recv = SymmetricAlloc<uint8_t>(total + kGuardBytes, "the receive blocks");
  auto* signals = static_cast<uint64_t*>(shmem::ShmemCalloc(static_cast<size_t>(n), sizeof(uint64_t)));
  MORI_CHECK(signals != nullptr, core::ErrorCode::InvalidUsage, "ShmemCalloc for the signals failed");
  core::GpuEvent start = nullptr, stop = nullptr;
  MORI_CHECK_GPU(core::GpuEventCreate(&start));
  MORI_CHECK_GPU(core::GpuEventCreate(&stop));

  uint64_t bad = 0;
  float ms = 0;
  for (int round = 1; round <= kRounds; ++round) {
    std::vector<uint8_t> out(total);
    for (int to = 0; to < n; ++to) {
      uint8_t* block = out.data() + static_cast<size_t>(to) * bytes;
      for (size_t i = 0; i < bytes; ++i) block[i] = PatternByte(me, i, PairSeed(to, round));
    }
    FromHost(send, out);
    FromHost(recv, std::vector<uint8_t>(total + kGuardBytes, kGuard));
    shmem::ShmemBarrierAll();  // nobody puts into a receive buffer that its owner is still resetting

    MORI_CHECK_GPU(core::GpuEventRecord(start, nullptr));
    core::LaunchKernel(AllToAllKernel, core::Dim3(static_cast<unsigned>(n)), core::Dim3(kThreadsPerBlock), 0, nullptr,
                       send, recv, bytes, signals, round);
    MORI_CHECK_GPU(core::GpuEventRecord(stop, nullptr));
    WaitKernels();
    MORI_CHECK_GPU(core::GpuEventElapsedTime(&ms, start, stop));
    shmem::ShmemBarrierAll();  // every PE's puts into this one are complete

    std::vector<uint8_t> got = ToHost(recv, total + kGuardBytes);
    for (int from = 0; from < n; ++from) {
      size_t wrong = CountMismatches(got.data() + static_cast<size_t>(from) * bytes, bytes, from, PairSeed(me, round));
      if (wrong != 0) std::printf("PE %d: round %d: block from PE %d has %zu wrong bytes\n", me, round, from, wrong);
      bad += wrong;
    }
    size_t guardBad = 0;
    for (size_t i = total; i < got.size(); ++i) guardBad += got[i] != kGuard;
    if (guardBad != 0) std::printf("PE %d: round %d: %zu bytes past the last block overwritten\n", me, round, guardBad);
    bad += guardBad;
    shmem::ShmemBarrierAll();  // everybody has checked before the next round resets and refills
  }

  std::string transports;
  for (int pe = 0; pe < n; ++pe) {
    transports += (pe ? "," : "") + std::string(shmem::TransportTypeName(shmem::ShmemTransportType(pe)));
  }
  std::printf("PE %d/%d: %d blocks of %zu B received (transports %s), %.3f ms: %s\n", me, n, n, bytes,
              transports.c_str(), ms, bad == 0 ? "verified" : "CORRUPTED");
  std::fflush(stdout);
  uint64_t totalBad = SumOverPes(bad);
  if (me == 0) {
    std::printf("shmem_all_to_all: %d PEs, %zu B per pair, %.3f ms on PE 0 (%.2f GB/s sent per PE): %s\n", n, bytes, ms,
                ms > 0 ? static_cast<double>(total) / (ms * 1e6) : 0.0, totalBad == 0 ? "Success" : "FAILED");
  }
  MORI_CHECK_GPU(core::GpuEventDestroy(stop));
  MORI_CHECK_GPU(core::GpuEventDestroy(start));
  shmem::ShmemFree(signals);
  shmem::ShmemFree(recv);
  shmem::ShmemFree(send);
  FinalizeOrThrow();
  return totalBad == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori_example

int main(int argc, char** argv) {
  return mori_example::ExampleMain("shmem_all_to_all", mori_example::Run, argc, argv);
}
