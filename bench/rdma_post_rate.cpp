// rdma_post_rate: how fast GPU threads (host threads on HOST) build WQEs and ring doorbells with the mlx5
// primitives, into one QP and into many, while the emulated NIC consumes them; and the emulated NIC's own
// throughput for small and large RDMA writes. A yardstick for later changes to posting, not a statement
// about real NICs (the emulated NIC runs on one host thread and a TCP wire).
//
//   ./rdma_post_rate [--quick]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/emulated.hpp"
#include "mori/rdma/rdma.hpp"

using namespace mori::rdma;
namespace core = mori::core;

namespace {

constexpr ProviderType P = ProviderType::MLX5;
constexpr uint64_t kTimeoutNs = 120'000'000'000ull;

struct Queues {
  WorkQueueHandle wq;
  CompletionQueueHandle cq;
};

// Each thread posts `perThread` WQEs to QP (block % qps): NOPs (op 0) or `bytes`-byte writes (op 1), each
// with its own reservation and doorbell; or the same warp-aggregated (ops 2 and 3: the lanes of a warp
// reserve with one atomic and ring one doorbell). The first thread of each block quiets its QP at the end.
MORI_GLOBAL void PostLoop(Queues* queues, uint32_t qps, int op, uint32_t perThread, RdmaMemoryRegion src,
                          RdmaMemoryRegion dst, uint64_t bytes, uint32_t* errors) {
  Queues& q = queues[core::BlockIdxX() % qps];
  for (uint32_t i = 0; i < perThread; ++i) {
    if (op == 0) {
      uint32_t slot = ReserveSendSlots<P>(q.wq, q.cq, 1, kTimeoutNs);
      uint64_t dbr = PostNop<P>(q.wq, slot, SignalNeeded(q.wq, slot, false), q.wq.qpn);
      RingDoorbellOrdered<P>(q.wq, slot, 1, dbr, kTimeoutNs);
    } else if (op >= 2) {
      GroupSlots g = ReserveSendSlotsForGroup<P>(q.wq, q.cq, core::ActiveLanes(), kTimeoutNs);
      bool signal = SignalNeeded(q.wq, g.slot, false);
      uint64_t dbr = op == 2 ? PostNop<P>(q.wq, g.slot, signal, q.wq.qpn)
                             : PostWrite<P>(q.wq, g.slot, signal, q.wq.qpn, src.addr, src.lkey, dst.addr, dst.rkey, bytes);
      RingDoorbellForGroup<P>(q.wq, g, dbr, kTimeoutNs);
    } else {
      PostWriteOrdered<P>(q.wq, q.cq, src.addr, src.lkey, dst.addr, dst.rkey, bytes, false, kTimeoutNs);
    }
  }
  core::SyncThreads();
  if (core::ThreadIdxX() == 0) {
    uint32_t e = QuietQueue<P>(q.wq, q.cq, kTimeoutNs);
    if (e != 0) core::AtomicFetchAdd(errors, e);
  }
}

struct Setup {
  std::unique_ptr<RdmaContext> context;
  RdmaDeviceContext* a = nullptr;
  RdmaDeviceContext* b = nullptr;
  core::GpuBuffer queues;  // device memory: only posting threads touch the handles, at device scope
  core::GpuBuffer errors;
  core::GpuBuffer src, dst;
  RdmaMemoryRegion srcMr{}, dstMr{};

  Setup(uint32_t qps, size_t maxBytes) {
    context = std::make_unique<RdmaContext>(RdmaBackendType::Emulated);
    a = context->GetRdmaDeviceList()[0]->CreateRdmaDeviceContext();
    b = context->GetRdmaDeviceList()[0]->CreateRdmaDeviceContext();
    std::vector<Queues> handles(qps);
    errors = core::GpuBuffer(4, core::MemoryType::HostPinned);
    RdmaEndpointConfig config;
    config.maxMsgsNum = 1024;
    config.maxCqeNum = 2048;
    for (uint32_t i = 0; i < qps; ++i) {
      RdmaEndpoint ea = a->CreateRdmaEndpoint(config);
      RdmaEndpoint eb = b->CreateRdmaEndpoint(config);
      a->ConnectEndpoint(ea.handle, eb.handle);
      b->ConnectEndpoint(eb.handle, ea.handle);
      handles[i] = Queues{ea.wqHandle, ea.cqHandle};
    }
    queues = core::GpuBuffer(sizeof(Queues) * qps);
    MORI_CHECK_GPU(core::GpuMemcpy(queues.Data(), handles.data(), queues.Bytes()));
    src = core::GpuBuffer(maxBytes);
    dst = core::GpuBuffer(maxBytes);
    srcMr = a->RegisterRdmaMemoryRegion(src.Data(), maxBytes);
    dstMr = b->RegisterRdmaMemoryRegion(dst.Data(), maxBytes);
  }
  uint32_t* Errors() { return errors.DataAs<uint32_t>(); }
};

struct Row {
  std::string what;
  uint32_t qps, blocks, threads;
  double seconds;
  uint64_t wqes;
  uint64_t bytes;
};

Row Measure(const std::string& what, uint32_t qps, uint32_t blocks, uint32_t threads, int op, uint32_t perThread,
            uint64_t bytes) {
  Setup s(qps, bytes == 0 ? 64 : bytes);
  uint32_t* errors = s.Errors();
  *errors = 0;
  core::PreloadKernels(PostLoop);
  auto run = [&](uint32_t count) {
    core::LaunchKernel(PostLoop, core::Dim3(blocks), core::Dim3(threads), 0, nullptr, s.queues.DataAs<Queues>(), qps,
                       op, count, s.srcMr, s.dstMr, bytes, errors);
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  };
  run(std::max(1u, perThread / 10));  // warm-up: links connected, threads started
  auto t0 = std::chrono::steady_clock::now();
  run(perThread);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MORI_CHECK(*errors == 0, core::ErrorCode::Rdma, "%u error completions during '%s'", *errors, what.c_str());
  uint64_t wqes = uint64_t(blocks) * threads * perThread;
  return Row{what, qps, blocks, threads, seconds, wqes, wqes * bytes};
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  try {
#if MORI_BACKEND_HOST
    const uint32_t manyBlocks = 4, manyThreads = 8;
#else
    const uint32_t manyBlocks = 16, manyThreads = 64;
#endif
    const uint32_t n = quick ? 200 : 2000;
    std::vector<Row> rows;
    rows.push_back(Measure("NOP, 1 thread", 1, 1, 1, 0, n * 20, 0));
    rows.push_back(Measure("NOP, many threads", 1, manyBlocks, manyThreads, 0, n / 4, 0));
    rows.push_back(Measure("NOP, many threads, warp-agg", 1, manyBlocks, manyThreads, 2, n / 4, 0));
    rows.push_back(Measure("NOP, QP per block", manyBlocks, manyBlocks, manyThreads, 0, n / 4, 0));
    rows.push_back(Measure("NOP, QP per block, warp-agg", manyBlocks, manyBlocks, manyThreads, 2, n / 4, 0));
    rows.push_back(Measure("8 B write, 1 thread", 1, 1, 1, 1, n * 5, 8));
    rows.push_back(Measure("8 B write, QP per block", manyBlocks, manyBlocks, manyThreads, 1, n / 16, 8));
    rows.push_back(Measure("8 B write, QP/block, warp-agg", manyBlocks, manyBlocks, manyThreads, 3, n / 16, 8));
    rows.push_back(Measure("64 KiB write, 1 thread", 1, 1, 1, 1, quick ? 50 : 500, 64 << 10));
    rows.push_back(Measure("1 MiB write, 1 thread", 1, 1, 1, 1, quick ? 10 : 100, 1 << 20));
    std::printf("rdma_post_rate (%s backend, emulated NIC consuming)\n", MORI_BACKEND_NAME);
    std::printf("%-30s %5s %7s %8s %10s %12s %10s\n", "case", "QPs", "blocks", "threads", "WQEs", "WQE/s", "GB/s");
    for (const Row& r : rows) {
      std::printf("%-30s %5u %7u %8u %10llu %12.0f %10.3f\n", r.what.c_str(), r.qps, r.blocks, r.threads,
                  static_cast<unsigned long long>(r.wqes), r.wqes / r.seconds, r.bytes / r.seconds / 1e9);
    }
    return 0;
  } catch (const core::Error& e) {
    std::fprintf(stderr, "rdma_post_rate: %s\n", e.what());
    return 1;
  }
}
