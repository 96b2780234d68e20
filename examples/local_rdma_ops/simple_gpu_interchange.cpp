// simple_gpu_interchange: the essential steps of GPU-initiated RDMA. Two endpoints on one machine, a GPU
// kernel that fills a buffer, posts an RDMA write, rings the doorbell and polls the completion queue, then
// a kernel that verifies the bytes on the receiving side. Runs on a real mlx5 NIC (DirectVerbs) when one
// is present, and on the emulated NIC otherwise; it says which.
//
//   ./simple_gpu_interchange [bytes] [value]
#include <cstdio>
#include <cstdlib>

#include "mori/core/device_assert.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/rdma.hpp"

using namespace mori::rdma;
namespace core = mori::core;

namespace {

constexpr ProviderType P = ProviderType::MLX5;

struct SendSide {
  WorkQueueHandle wq;
  CompletionQueueHandle cq;
  int status;
  unsigned long long mismatches;  // 8-byte aligned: GPU atomics need natural alignment
};

MORI_GLOBAL void FillKernel(uint8_t* buf, size_t bytes, uint8_t value) {
  for (size_t i = core::GlobalThreadIdx(); i < bytes; i += core::GlobalThreadCount()) buf[i] = value;
}

MORI_GLOBAL void InterchangeKernel(SendSide* s, RdmaMemoryRegion send, RdmaMemoryRegion recv, size_t bytes, int* status) {
  uint64_t dbrVal = PostWrite<P>(s->wq, s->wq.qpn, send.addr, send.lkey, recv.addr, recv.rkey, bytes);
  UpdateSendDbrRecord<P>(s->wq.dbrRecAddr, s->wq.postIdx);
  RingDoorbell<P>(s->wq.dbrAddr, dbrVal);
  core::SpinDeadline deadline(60'000'000'000ull);
  int r;
  while ((r = PollCq<P>(s->cq.cqAddr, s->cq.cqeNum, &s->cq.consIdx)) == kCqEmpty) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "no completion for the RDMA write of qp %u", s->wq.qpn);
    core::SpinPause();
  }
  UpdateCqDbrRecord<P>(s->cq.dbrRecAddr, s->cq.consIdx);
  *status = r;
}

MORI_GLOBAL void VerifyKernel(const uint8_t* buf, size_t bytes, uint8_t value, unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (size_t i = core::GlobalThreadIdx(); i < bytes; i += core::GlobalThreadCount()) bad += buf[i] != value;
  if (bad) core::AtomicFetchAdd(mismatches, bad);
  core::SyncThreads();
  if (core::GlobalThreadIdx() == 0) {
    if (core::AtomicLoad(mismatches) == 0) {
      MORI_DEVICE_PRINTF("Success! All %llu bytes verified with value %u\n", static_cast<unsigned long long>(bytes),
                         static_cast<unsigned>(value));
    }
  }
}

int Run(size_t bytes, uint8_t value) {
  std::printf("=== Simple GPU Data Interchange Example ===\nTransferring %zu bytes with value %u\n\n", bytes, value);

  std::printf("Step 1: Initializing RDMA context...\n");
  RdmaBackendType backend = RdmaBackendFromEnvironment();
  RdmaContext rdmaContext(backend);
  std::printf("  Backend: %s%s\n", RdmaBackendName(backend),
              backend == RdmaBackendType::Emulated ? " (no mlx5 NIC here: the emulated NIC executes the same WQEs)" : "");
  const RdmaDeviceList& rdmaDevices = rdmaContext.GetRdmaDeviceList();
  std::printf("  Found %zu RDMA device(s)\n", rdmaDevices.size());
  MORI_CHECK(!rdmaDevices.empty(), core::ErrorCode::NotSupported, "no RDMA device for backend %s",
             RdmaBackendName(backend));

  std::printf("Step 2: Getting RDMA devices...\n");
  ActiveDevicePortList activeDevicePortList = GetActiveDevicePortList(rdmaDevices);
  std::printf("  Found %zu active device port(s)\n", activeDevicePortList.size());
  MORI_CHECK(!activeDevicePortList.empty(), core::ErrorCode::NotSupported, "no active port");
  RdmaDevice* device = activeDevicePortList[0].first;

  std::printf("Step 3: Creating device contexts...\n");
  RdmaDeviceContext* deviceContextSend = device->CreateRdmaDeviceContext();
  RdmaDeviceContext* deviceContextRecv = device->CreateRdmaDeviceContext();
  std::printf("  Device contexts created\n");

  std::printf("Step 4: Creating RDMA endpoints...\n");
  RdmaEndpointConfig config;
  config.portId = activeDevicePortList[0].second;
  config.onGpu = true;
  RdmaEndpoint epSend = deviceContextSend->CreateRdmaEndpoint(config);
  RdmaEndpoint epRecv = deviceContextRecv->CreateRdmaEndpoint(config);
  std::printf("  Endpoints created (QPN: send=%u, recv=%u)\n", epSend.handle.qpn, epRecv.handle.qpn);

  std::printf("Step 5: Connecting endpoints...\n");
  deviceContextSend->ConnectEndpoint(epSend.handle, epRecv.handle);
  deviceContextRecv->ConnectEndpoint(epRecv.handle, epSend.handle);
  std::printf("  Endpoints connected\n");

  std::printf("Step 6: Allocating and registering GPU buffers...\n");
  core::GpuBuffer sendBuf(bytes), recvBuf(bytes);
  MORI_CHECK_GPU(core::GpuMemset(recvBuf.Data(), 0, bytes));
  RdmaMemoryRegion mrSend = deviceContextSend->RegisterRdmaMemoryRegion(sendBuf.Data(), bytes);
  RdmaMemoryRegion mrRecv = deviceContextRecv->RegisterRdmaMemoryRegion(recvBuf.Data(), bytes);
  // The send side's queue handles go where the kernel can update them.
  core::GpuBuffer handles(sizeof(SendSide), core::MemoryType::HostPinned);
  auto* side = handles.DataAs<SendSide>();
  side->wq = epSend.wqHandle;
  side->cq = epSend.cqHandle;
  int* status = &side->status;
  unsigned long long* mismatches = &side->mismatches;
  *status = -999;
  *mismatches = 0;
  std::printf("  Buffers allocated and registered\n");

  std::printf("Step 7: Launching GPU kernel for data interchange...\n");
  std::fflush(stdout);
  // The interchange kernel waits for the NIC; the verify kernel queued behind it must not be loaded then.
  core::PreloadKernels(FillKernel, InterchangeKernel, VerifyKernel);
  core::LaunchKernel(FillKernel, core::Dim3(8), core::Dim3(128), 0, nullptr, sendBuf.DataAs<uint8_t>(), bytes, value);
  core::LaunchKernel(InterchangeKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, side, mrSend, mrRecv, bytes, status);
  core::LaunchKernel(VerifyKernel, core::Dim3(1), core::Dim3(64), 0, nullptr, recvBuf.DataAs<uint8_t>(), bytes, value,
                     mismatches);
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  MORI_CHECK(*status == 0, core::ErrorCode::Rdma, "the RDMA write completed with status %d (%s)", *status,
             IsCqError(*status) ? mlx5::SyndromeName(CqErrorSyndrome(*status)) : "not a send completion");
  MORI_CHECK(*mismatches == 0, core::ErrorCode::Internal, "%llu of %zu bytes differ on the receiving side", *mismatches,
             bytes);
  std::printf("  Kernel execution completed\n");

  std::printf("Step 8: Cleaning up resources...\n");
  deviceContextSend->DeregisterRdmaMemoryRegion(sendBuf.Data());
  deviceContextRecv->DeregisterRdmaMemoryRegion(recvBuf.Data());
  deviceContextSend->DestroyRdmaEndpoint(epSend.handle);
  deviceContextRecv->DestroyRdmaEndpoint(epRecv.handle);
  std::printf("  Resources cleaned up\n\n=== Example completed successfully! ===\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 0) : 1024;
    unsigned value = argc > 2 ? static_cast<unsigned>(std::strtoul(argv[2], nullptr, 0)) : 42;
    if (bytes == 0 || value > 255) {
      std::fprintf(stderr, "usage: %s [bytes > 0] [value 0-255]\n", argv[0]);
      return 2;
    }
    return Run(bytes, static_cast<uint8_t>(value));
  } catch (const core::Error& e) {
    std::fprintf(stderr, "simple_gpu_interchange: %s\n", e.what());
    return 1;
  }
}
