// shmem_put_signal_pingpong: latency of put-with-signal. PE 0 and PE 1 bounce a message back and forth:
// each message carries data for its iteration and sets the receiver's signal word to the iteration number
// (ShmemPutMemNbiSignalThread, SignalOp::Set). The receiver waits for that value, answers (PE 1) or sends
// the next message (PE 0), and then its whole block checks every byte of what arrived while the answer is
// in flight. PE 0 reports the average half round trip per message size. Further PEs only join barriers.
//
//   mpirun -np 2 ./shmem_put_signal_pingpong [iterations]
//   MORI_SHMEM_TRANSPORT=p2p|rdma|proxy picks the transport between PEs (proxy: MORI_SHMEM_PROXY_CONN=tcp|rdma).
#include <cstdio>
#include <vector>

#include "mori/core/env.hpp"
#include "shmem_example_util.hpp"

namespace mori_example {
namespace {

constexpr int kWarmup = MORI_BACKEND_HOST ? 2 : 20;
constexpr int kDefaultIterations = MORI_BACKEND_HOST ? 20 : 200;
constexpr size_t kSizes[] = {8, 4096, 65536};

// Message `it` comes from outbox slot it - 1 (all prefilled: nothing rewrites a source the NIC may still
// read) and lands in inbox slot it % 2. The next message into that slot (it + 2) answers a message that the
// receiver sends only after it has checked message it.
MORI_GLOBAL void PingPongKernel(uint8_t* inbox, const uint8_t* outbox, size_t bytes, uint64_t* sig, int total,
                                int warmup, uint32_t* mismatches, uint64_t* elapsedNs) {
  const int me = shmem::ShmemMyPe();
  const int peer = 1 - me;
  const bool leader = core::FlatThreadIdx() == 0;
  auto send = [&](int it) {
    shmem::ShmemPutMemNbiSignalThread(inbox + (it % 2) * bytes, outbox + static_cast<size_t>(it - 1) * bytes, bytes,
                                      sig, static_cast<uint64_t>(it), shmem::SignalOp::Set, peer);
  };
  uint64_t start = 0;
  if (leader && me == 0) send(1);
  for (int it = 1; it <= total; ++it) {
    if (leader) {
      shmem::ShmemSignalWaitUntil(sig, shmem::CmpOp::EQ, static_cast<uint64_t>(it));
      if (me == 0 && it == warmup) start = core::DeviceWallClockNs();
      if (me == 1) send(it);
      if (me == 0 && it < total) send(it + 1);
      if (me == 0 && it == total) *elapsedNs = core::DeviceWallClockNs() - start;
    }
    core::SyncThreads();  // the leader saw the signal: the data before it is here
    // Volatile: a peer or a NIC wrote it behind this GPU's caches.
    const volatile uint8_t* got = inbox + (it % 2) * bytes;
    uint32_t bad = 0;
    for (size_t i = core::FlatThreadIdx(); i < bytes; i += core::FlatBlockDim()) {
      bad += got[i] != PatternByte(peer, i, static_cast<uint32_t>(it));
    }
    if (bad != 0) core::AtomicFetchAdd(mismatches, bad);
    core::SyncThreads();  // the slot is checked before the leader's next send can bring an answer into it
  }
  if (leader) shmem::ShmemQuietThread();
}

int Run(int argc, char** argv) {
  const int iterations = argc > 1 ? static_cast<int>(core::ParseInt(argv[1], "iterations")) : kDefaultIterations;
  if (iterations < 1) {
    std::fprintf(stderr, "usage: shmem_put_signal_pingpong [iterations, >= 1]\n");
    return 2;
  }
  InitOrThrow();
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  if (n < 2) {
    std::fprintf(stderr, "shmem_put_signal_pingpong: needs at least 2 PEs (run it under mpirun -np 2), got %d\n", n);
    FinalizeOrThrow();
    return 1;
  }
  const int total = kWarmup + iterations;
  const bool playing = me < 2;
  uint64_t bad = 0;
  std::vector<double> halfRoundTripUs;
  for (size_t bytes : kSizes) {
    auto* inbox = SymmetricAlloc<uint8_t>(2 * bytes, "the inbox");
    auto* outbox = SymmetricAlloc<uint8_t>(static_cast<size_t>(total) * bytes, "the outbox");
    auto* sig = static_cast<uint64_t*>(shmem::ShmemCalloc(1, sizeof(uint64_t)));
    auto* mismatches = static_cast<uint32_t*>(shmem::ShmemCalloc(1, sizeof(uint32_t)));
    auto* elapsed = static_cast<uint64_t*>(shmem::ShmemCalloc(1, sizeof(uint64_t)));
    MORI_CHECK(sig && mismatches && elapsed, core::ErrorCode::InvalidUsage, "ShmemCalloc failed");
    std::vector<uint8_t> messages(static_cast<size_t>(total) * bytes);
    for (int it = 1; it <= total; ++it) {
      for (size_t i = 0; i < bytes; ++i) {
        messages[static_cast<size_t>(it - 1) * bytes + i] = PatternByte(me, i, static_cast<uint32_t>(it));
      }
    }
    FromHost(outbox, messages);
    shmem::ShmemBarrierAll();

    if (playing) {
      core::LaunchKernel(PingPongKernel, core::Dim3(1), core::Dim3(kThreadsPerBlock), 0, nullptr, inbox, outbox, bytes,
                         sig, total, kWarmup, mismatches, elapsed);
      WaitKernels();
      uint32_t wrong = 0;
      uint64_t ns = 0;
      MORI_CHECK_GPU(core::GpuMemcpy(&wrong, mismatches, sizeof(wrong)));
      MORI_CHECK_GPU(core::GpuMemcpy(&ns, elapsed, sizeof(ns)));
      bad += wrong;
      halfRoundTripUs.push_back(static_cast<double>(ns) / 1e3 / (2.0 * iterations));
      if (wrong != 0) std::printf("PE %d: %zu B messages from PE %d: %u wrong bytes\n", me, bytes, 1 - me, wrong);
    }
    shmem::ShmemBarrierAll();
    shmem::ShmemFree(elapsed);
    shmem::ShmemFree(mismatches);
    shmem::ShmemFree(sig);
    shmem::ShmemFree(outbox);
    shmem::ShmemFree(inbox);
  }
  if (playing) {
    std::printf("PE %d/%d: %d messages of each size from PE %d (%s): %s\n", me, n, total, 1 - me,
                shmem::TransportTypeName(shmem::ShmemTransportType(1 - me)), bad == 0 ? "verified" : "CORRUPTED");
  } else {
    std::printf("PE %d/%d: idle (only PEs 0 and 1 play), joined every barrier\n", me, n);
  }
  std::fflush(stdout);

  uint64_t totalBad = SumOverPes(bad);
  if (me == 0) {
    for (size_t k = 0; k < halfRoundTripUs.size(); ++k) {
      std::printf("  %6zu B: %9.2f us half round trip (average of %d)\n", kSizes[k], halfRoundTripUs[k], iterations);
    }
    std::printf("shmem_put_signal_pingpong: %d PEs, %d iterations per size: %s\n", n, iterations,
                totalBad == 0 ? "Success" : "FAILED");
  }
  FinalizeOrThrow();
  return totalBad == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori_example

int main(int argc, char** argv) {
  return mori_example::ExampleMain("shmem_put_signal_pingpong", mori_example::Run, argc, argv);
}
