// shmem_atomic_counter: remote atomics under contention. Every thread of every PE fetch-adds its own amount
// to a 64-bit counter on every PE, and draws tickets (on a GPU one thread per warp) from a 32-bit counter on
// PE 0 with fetch-inc. Each ticket is marked by swapping the drawer's id into PE 0's ticket array, so a
// ticket handed out twice shows as a swap that finds a mark already there. Afterwards every PE checks its 64-bit total exactly, and PE 0
// checks its ticket counter and that every ticket was drawn once, each thread holding exactly its share.
//
//   mpirun -np 4 ./shmem_atomic_counter [iterations]
//   MORI_SHMEM_TRANSPORT=p2p|rdma|proxy picks the transport between PEs (rdma: the NIC performs the
//   atomics; proxy: a host thread does, over MORI_SHMEM_PROXY_CONN=tcp|rdma).
#include <cstdio>
#include <vector>

#include "mori/core/env.hpp"
#include "shmem_example_util.hpp"

namespace mori_example {
namespace {

// 32-bit remote atomics other than fetch-add over RDMA are compare-swap loops that every contender retries:
// a modest number of threads keeps the run short.
constexpr unsigned kBlocks = MORI_BACKEND_HOST ? 2 : 4;
constexpr unsigned kThreads = MORI_BACKEND_HOST ? kThreadsPerBlock : 128;
constexpr int kDefaultIterations = MORI_BACKEND_HOST ? 8 : 4;
// Every thread adds to the 64-bit counters (a native atomic on every transport), but on a GPU only one thread
// per warp draws tickets: a 32-bit fetch-inc through a NIC is a compare-swap loop in which each success costs
// about one compare-swap per contender, and 2048 contenders on one word (4 PEs of 512 threads) made a thread
// lose for over a minute on the emulated NIC. 64 contenders still collide on every draw.
constexpr unsigned kTicketStride = MORI_BACKEND_HOST ? 1 : 32;
MORI_HOST_DEVICE_INLINE bool DrawsTickets(unsigned tid) { return tid % kTicketStride == 0; }

MORI_HOST_DEVICE_INLINE uint64_t CounterStart(int pe) { return (static_cast<uint64_t>(pe) + 1) << 40 | 0x5EED; }
MORI_HOST_DEVICE_INLINE uint32_t TicketStart(int pe) { return 1000u + 17u * static_cast<uint32_t>(pe); }
// What thread `tid` of `pe` adds each time: distinct per thread, so a lost or doubled add changes the total.
MORI_HOST_DEVICE_INLINE uint64_t Addend(int pe, unsigned tid) {
  return ((static_cast<uint64_t>(pe) + 1) << 20) + tid + 1;
}
// The mark a thread leaves on its tickets (never 0, the unmarked value).
MORI_HOST_DEVICE_INLINE uint32_t Mark(int pe, unsigned tid) { return (static_cast<uint32_t>(pe) << 16 | tid) + 1; }

struct Counters {
  uint64_t* counter;        // one per PE; everybody adds to all of them
  uint32_t* ticketCounter;  // PE 0's is drawn from
  uint32_t* marks;          // [ticket - TicketStart(0)], PE 0's
  uint32_t* errors;         // this PE's: duplicates, tickets out of range, old values out of range
};

MORI_GLOBAL void CounterKernel(Counters c, int iterations, uint64_t addedPerPe, uint32_t ticketCount) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const unsigned tid = core::GlobalThreadIdx();
  const uint64_t add = Addend(me, tid);
  uint32_t errors = 0;
  for (int it = 0; it < iterations; ++it) {
    for (int k = 0; k < n; ++k) {
      int pe = (me + k) % n;  // each PE starts with a different target: less contention on one word
      uint64_t old = shmem::ShmemAtomicTypeFetchAddThread<uint64_t>(c.counter, add, pe);
      errors += old < CounterStart(pe) || old - CounterStart(pe) >= addedPerPe;
    }
    if (!DrawsTickets(tid)) continue;
    uint32_t ticket = shmem::ShmemAtomicTypeFetchIncThread<uint32_t>(c.ticketCounter, 0);
    uint32_t index = ticket - TicketStart(0);
    if (index >= ticketCount) {
      ++errors;
      continue;
    }
    uint32_t was = shmem::ShmemAtomicTypeSwapThread<uint32_t>(&c.marks[index], Mark(me, tid), 0);
    errors += was != 0;
  }
  shmem::ShmemQuietThread();
  if (errors != 0) core::AtomicFetchAdd(c.errors, errors);
}

int Run(int argc, char** argv) {
  const int iterations = argc > 1 ? static_cast<int>(core::ParseInt(argv[1], "iterations")) : kDefaultIterations;
  if (iterations < 1) {
    std::fprintf(stderr, "usage: shmem_atomic_counter [iterations, >= 1]\n");
    return 2;
  }
  InitOrThrow();
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  const unsigned threads = kBlocks * kThreads;
  const uint32_t drawers = (threads + kTicketStride - 1) / kTicketStride;
  const uint32_t ticketCount = static_cast<uint32_t>(n) * drawers * static_cast<uint32_t>(iterations);
  uint64_t addedPerPe = 0;
  for (int pe = 0; pe < n; ++pe) {
    for (unsigned t = 0; t < threads; ++t) addedPerPe += Addend(pe, t) * static_cast<uint64_t>(iterations);
  }

  Counters c{SymmetricAlloc<uint64_t>(1, "the counter"), SymmetricAlloc<uint32_t>(1, "the ticket counter"),
             static_cast<uint32_t*>(shmem::ShmemCalloc(ticketCount, sizeof(uint32_t))),
             static_cast<uint32_t*>(shmem::ShmemCalloc(1, sizeof(uint32_t)))};
  MORI_CHECK(c.marks && c.errors, core::ErrorCode::InvalidUsage, "ShmemCalloc for the ticket marks failed");
  const uint64_t counterStart = CounterStart(me);
  const uint32_t ticketStart = TicketStart(me);
  MORI_CHECK_GPU(core::GpuMemcpy(c.counter, &counterStart, sizeof(counterStart)));
  MORI_CHECK_GPU(core::GpuMemcpy(c.ticketCounter, &ticketStart, sizeof(ticketStart)));
  shmem::ShmemBarrierAll();  // every counter holds its start value before anybody adds

  core::LaunchKernel(CounterKernel, core::Dim3(kBlocks), core::Dim3(kThreads), 0, nullptr, c, iterations, addedPerPe,
                     ticketCount);
  WaitKernels();
  shmem::ShmemBarrierAll();  // every PE's atomics are complete

  uint64_t counter = 0;
  uint32_t tickets = 0, deviceErrors = 0;
  MORI_CHECK_GPU(core::GpuMemcpy(&counter, c.counter, sizeof(counter)));
  MORI_CHECK_GPU(core::GpuMemcpy(&tickets, c.ticketCounter, sizeof(tickets)));
  MORI_CHECK_GPU(core::GpuMemcpy(&deviceErrors, c.errors, sizeof(deviceErrors)));
  uint64_t bad = deviceErrors;
  bool counterOk = counter == counterStart + addedPerPe;
  bad += !counterOk;
  // PE 0 hands out the tickets; elsewhere the ticket counter and the marks stay as they were.
  uint32_t wantTickets = me == 0 ? ticketStart + ticketCount : ticketStart;
  bad += tickets != wantTickets;
  std::vector<uint32_t> marks(ticketCount);
  MORI_CHECK_GPU(core::GpuMemcpy(marks.data(), c.marks, ticketCount * sizeof(uint32_t)));
  size_t badMarks = 0;
  if (me == 0) {
    std::vector<uint32_t> perThread(static_cast<size_t>(n) * threads, 0);
    for (uint32_t m : marks) {
      uint32_t pe = (m - 1) >> 16, tid = (m - 1) & 0xffff;
      if (m == 0 || pe >= static_cast<uint32_t>(n) || tid >= threads) {
        ++badMarks;
      } else {
        ++perThread[pe * threads + tid];
      }
    }
    for (size_t i = 0; i < perThread.size(); ++i) {
      const unsigned tid = static_cast<unsigned>(i % threads);
      badMarks += perThread[i] != (DrawsTickets(tid) ? static_cast<uint32_t>(iterations) : 0u);
    }
  } else {
    for (uint32_t m : marks) badMarks += m != 0;
  }
  bad += badMarks;

  std::printf("PE %d/%d: counter at %#llx, ticket counter at %u, %s (atomics to PE 0: %s): %s\n", me, n,
              static_cast<unsigned long long>(counter), tickets,
              me == 0 ? "ticket marks checked" : "no tickets drawn here",
              shmem::TransportTypeName(shmem::ShmemTransportType(0)), bad == 0 ? "verified" : "WRONG");
  if (bad != 0) {
    std::printf("PE %d: counter should be %#llx, ticket counter %u; %zu bad ticket marks, %u kernel errors\n", me,
                static_cast<unsigned long long>(counterStart + addedPerPe), wantTickets, badMarks, deviceErrors);
  }
  std::fflush(stdout);
  uint64_t totalBad = SumOverPes(bad);
  if (me == 0) {
    std::printf("shmem_atomic_counter: %d PEs, %u threads each, %d iterations, %u tickets: %s\n", n, threads,
                iterations, ticketCount, totalBad == 0 ? "Success" : "FAILED");
  }
  shmem::ShmemFree(c.errors);
  shmem::ShmemFree(c.marks);
  shmem::ShmemFree(c.ticketCounter);
  shmem::ShmemFree(c.counter);
  FinalizeOrThrow();
  return totalBad == 0 ? 0 : 1;
}

}  // namespace
}  // namespace mori_example

int main(int argc, char** argv) {
  return mori_example::ExampleMain("shmem_atomic_counter", mori_example::Run, argc, argv);
}
