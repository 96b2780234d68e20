// dist_rdma_ops: GPU-initiated RDMA between two processes (mpirun -np 2). Endpoint handles and memory keys
// travel through the bootstrap; rank 0's kernel performs the operation, rank 1 verifies what arrived.
//   write   rank 0 writes its pattern into rank 1's buffer; rank 1 checks every byte
//   read    rank 0 reads rank 1's pattern; rank 1 checks the copy rank 0 writes back into it
//   atomic  every thread of rank 0's kernel fetch-adds rank 1's counter; rank 1 checks the sum
//
//   mpirun -np 2 ./dist_rdma_ops write|read|atomic [bytes]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/launch.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/rdma.hpp"

using namespace mori::rdma;
namespace core = mori::core;

namespace {

constexpr ProviderType P = ProviderType::MLX5;
constexpr uint64_t kTimeoutNs = 60'000'000'000ull;
constexpr unsigned kBlocks = 4, kThreads = 32;

struct Queues {
  WorkQueueHandle wq;
  CompletionQueueHandle cq;
};
struct PeerInfo {
  RdmaEndpointHandle handle;
  RdmaMemoryRegion region;
};

MORI_HOST_DEVICE_INLINE uint8_t Pattern(size_t i, int rank) { return static_cast<uint8_t>((i * 7 + rank * 91 + (i >> 11)) & 0xff); }

MORI_GLOBAL void FillKernel(uint8_t* buf, size_t bytes, int rank) {
  for (size_t i = core::GlobalThreadIdx(); i < bytes; i += core::GlobalThreadCount()) buf[i] = Pattern(i, rank);
}

// Every block moves its slice; for "read", each slice read back is then written into the peer's second half.
MORI_GLOBAL void Transfer(Queues* q, int op, RdmaMemoryRegion local, RdmaMemoryRegion remote, uint64_t bytes,
                          uint32_t* errors) {
  uint64_t slice = (bytes + core::GridDimX() - 1) / core::GridDimX();
  uint64_t off = slice * core::BlockIdxX();
  uint64_t n = off >= bytes ? 0 : (bytes - off < slice ? bytes - off : slice);
  if (op == 2) {  // atomic: every thread adds its global index + 1
    PostAtomicOrdered<P, uint64_t>(q->wq, q->cq, local.addr + uint64_t(core::GlobalThreadIdx()) * 8, local.lkey,
                                   remote.addr, remote.rkey, core::GlobalThreadIdx() + 1, 0, AtomicOp::FetchAdd, false,
                                   kTimeoutNs);
  } else if (core::ThreadIdxX() == 0 && n > 0) {
    if (op == 0) {
      PostWriteOrdered<P>(q->wq, q->cq, local.addr + off, local.lkey, remote.addr + off, remote.rkey, n, false, kTimeoutNs);
    } else {
      PostReadOrdered<P>(q->wq, q->cq, local.addr + off, local.lkey, remote.addr + off, remote.rkey, n, false, kTimeoutNs);
      // The read must have landed before its bytes are sent on.
      uint32_t e = QuietQueue<P>(q->wq, q->cq, kTimeoutNs);
      if (e != 0) core::AtomicFetchAdd(errors, e);
      PostWriteOrdered<P>(q->wq, q->cq, local.addr + off, local.lkey, remote.addr + bytes + off, remote.rkey, n, false,
                          kTimeoutNs);
    }
  }
  core::SyncThreads();
  if (core::ThreadIdxX() == 0) {
    uint32_t e = QuietQueue<P>(q->wq, q->cq, kTimeoutNs);
    if (e != 0) core::AtomicFetchAdd(errors, e);
  }
}

int Run(const std::string& opName, size_t bytes) {
  int op = opName == "write" ? 0 : opName == "read" ? 1 : opName == "atomic" ? 2 : -1;
  MORI_CHECK(op >= 0, core::ErrorCode::InvalidUsage, "unknown operation '%s' (write, read or atomic)", opName.c_str());
  auto bootstrap = core::CreateBootstrapFromEnvironment();
  const int rank = bootstrap->GetRank();
  MORI_CHECK(bootstrap->GetNranks() == 2, core::ErrorCode::InvalidUsage, "run with exactly 2 processes, not %d",
             bootstrap->GetNranks());
  int gpus = 0;
  MORI_CHECK_GPU(core::GpuGetDeviceCount(&gpus));
  MORI_CHECK_GPU(core::GpuSetDevice(rank % gpus));

  RdmaBackendType backend = RdmaBackendFromEnvironment();
  RdmaContext context(backend);
  auto ports = GetActiveDevicePortList(context.GetRdmaDeviceList());
  MORI_CHECK(!ports.empty(), core::ErrorCode::NotSupported, "no active %s port", RdmaBackendName(backend));
  RdmaDeviceContext* nic = ports[0].first->CreateRdmaDeviceContext();
  RdmaEndpointConfig config;
  config.portId = ports[0].second;
  config.onGpu = true;
  RdmaEndpoint ep = nic->CreateRdmaEndpoint(config);

  // Buffer: rank 1 holds its pattern in [0, bytes) and receives into [bytes, 2 bytes) (read) or [0, bytes).
  const size_t counterOffset = (2 * bytes + 7) / 8 * 8;  // RDMA atomics need an 8-byte aligned word
  core::GpuBuffer buf(counterOffset + 8);
  MORI_CHECK_GPU(core::GpuMemset(buf.Data(), 0, buf.Bytes()));
  core::LaunchKernel(FillKernel, core::Dim3(8), core::Dim3(128), 0, nullptr, buf.DataAs<uint8_t>(),
                     rank == 0 || op == 1 ? bytes : 0, rank);
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  PeerInfo mine{ep.handle, nic->RegisterRdmaMemoryRegion(buf.Data(), buf.Bytes())}, peer{};
  bootstrap->Send(&mine, sizeof(mine), 1 - rank, 0);
  bootstrap->Recv(&peer, sizeof(peer), 1 - rank, 0);
  nic->ConnectEndpoint(ep.handle, peer.handle);
  bootstrap->Barrier();

  if (rank == 0) {
    core::GpuBuffer pinned(sizeof(Queues) + 4, core::MemoryType::HostPinned);
    auto* q = pinned.DataAs<Queues>();
    q->wq = ep.wqHandle;
    q->cq = ep.cqHandle;
    auto* errors = reinterpret_cast<uint32_t*>(q + 1);
    *errors = 0;
    RdmaMemoryRegion remote = peer.region;
    if (op == 2) remote.addr += counterOffset;
    core::LaunchKernel(Transfer, core::Dim3(kBlocks), core::Dim3(kThreads), 0, nullptr, q, op, mine.region, remote,
                       static_cast<uint64_t>(bytes), errors);
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
    MORI_CHECK(*errors == 0, core::ErrorCode::Rdma, "%u error completions", *errors);
  }
  bootstrap->Barrier();  // rank 0's quiet returned: everything is at rank 1

  int bad = 0;
  if (rank == 1) {
    std::vector<uint8_t> got(buf.Bytes());
    MORI_CHECK_GPU(core::GpuMemcpy(got.data(), buf.Data(), got.size()));
    if (op == 0) {
      for (size_t i = 0; i < bytes; ++i) bad += got[i] != Pattern(i, 0);
    } else if (op == 1) {
      for (size_t i = 0; i < bytes; ++i) bad += got[bytes + i] != Pattern(i, 1);
    } else {
      uint64_t counter;
      std::memcpy(&counter, got.data() + counterOffset, 8);
      uint64_t n = uint64_t(kBlocks) * kThreads;
      bad = counter != n * (n + 1) / 2;
    }
    std::printf("dist_rdma_ops %s over %s: %zu bytes, rank 1 found %d mismatch(es): %s\n", opName.c_str(),
                RdmaBackendName(backend), bytes, bad, bad == 0 ? "Success" : "FAILED");
  }
  bootstrap->Broadcast(&bad, sizeof(bad), 1);
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: mpirun -np 2 %s write|read|atomic [bytes]\n", argv[0]);
    return 2;
  }
  try {
    size_t bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 0) : (4 << 20) + 5;
    return Run(argv[1], bytes == 0 ? 1 : bytes);
  } catch (const core::Error& e) {
    std::fprintf(stderr, "dist_rdma_ops: %s\n", e.what());
    return 1;
  }
}
