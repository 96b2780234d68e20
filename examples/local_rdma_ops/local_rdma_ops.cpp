// local_rdma_ops: every RDMA operation posted from a GPU kernel (host threads on the HOST backend) between
// two endpoints of this machine, each verified: write, inline write, read, send/receive, fetch-add and
// compare-swap. Real mlx5 NIC when present, emulated NIC otherwise.
//
//   ./local_rdma_ops [bytes]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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
constexpr uint64_t kTimeoutNs = 60'000'000'000ull;

struct Queues {
  WorkQueueHandle wq;
  CompletionQueueHandle cq;
};

enum Op : int { kWrite, kWriteInline, kRead, kSend, kFetchAdd, kCompareSwap };

// Posts one operation with the ordered primitives and waits for its completion; returns the CQ's errors.
MORI_GLOBAL void PostOne(Queues* q, int op, RdmaMemoryRegion local, RdmaMemoryRegion remote, uint64_t bytes,
                         const void* inlineData, uint64_t v1, uint64_t v2, uint32_t* errors) {
  switch (op) {
    case kWrite:
      PostWriteOrdered<P>(q->wq, q->cq, local.addr, local.lkey, remote.addr, remote.rkey, bytes, true, kTimeoutNs);
      break;
    case kWriteInline:
      PostWriteInlineOrdered<P>(q->wq, q->cq, inlineData, remote.addr, remote.rkey, bytes, true, kTimeoutNs);
      break;
    case kRead:
      PostReadOrdered<P>(q->wq, q->cq, local.addr, local.lkey, remote.addr, remote.rkey, bytes, true, kTimeoutNs);
      break;
    case kSend:
      PostSendOrdered<P>(q->wq, q->cq, local.addr, local.lkey, bytes, true, kTimeoutNs);
      break;
    case kFetchAdd:
    case kCompareSwap:
      PostAtomicOrdered<P, uint64_t>(q->wq, q->cq, local.addr, local.lkey, remote.addr, remote.rkey, v1, v2,
                                     op == kFetchAdd ? AtomicOp::FetchAdd : AtomicOp::CompareSwap, true, kTimeoutNs);
      break;
  }
  *errors = QuietQueue<P>(q->wq, q->cq, kTimeoutNs);
}

// Waits for the receive completion on the other endpoint's CQ.
MORI_GLOBAL void WaitReceive(Queues* q, int* status, uint32_t* bytes) {
  CqeInfo info{};
  int r;
  core::SpinDeadline deadline(kTimeoutNs);
  while ((r = PollCq<P>(q->cq, q->wq, &info)) == kCqEmpty) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "qp %u: no receive completion", q->wq.qpn);
    core::SpinPause();
  }
  UpdateCqDbrRecord<P>(q->cq.dbrRecAddr, q->cq.consIdx);
  *status = r;
  *bytes = info.byteCount;
}

uint8_t Pattern(size_t i, int salt) { return static_cast<uint8_t>((i * 131 + salt * 17 + (i >> 9)) & 0xff); }

std::vector<uint8_t> Download(const core::GpuBuffer& b, size_t offset, size_t n) {
  std::vector<uint8_t> v(n);
  MORI_CHECK_GPU(core::GpuMemcpy(v.data(), b.DataAs<uint8_t>() + offset, n));
  return v;
}

bool Check(const char* name, bool ok, const char* detail) {
  std::printf("  %-14s %s%s%s\n", name, ok ? "verified" : "FAILED", ok ? "" : ": ", ok ? "" : detail);
  return ok;
}

int Run(size_t bytes) {
  RdmaBackendType backend = RdmaBackendFromEnvironment();
  RdmaContext context(backend);
  MORI_CHECK(!context.GetRdmaDeviceList().empty(), core::ErrorCode::NotSupported, "no %s device",
             RdmaBackendName(backend));
  auto ports = GetActiveDevicePortList(context.GetRdmaDeviceList());
  MORI_CHECK(!ports.empty(), core::ErrorCode::NotSupported, "no active port");
  std::printf("local_rdma_ops on %s (%s), %zu bytes\n", ports[0].first->Name().c_str(), RdmaBackendName(backend), bytes);
  RdmaDeviceContext* a = ports[0].first->CreateRdmaDeviceContext();
  RdmaDeviceContext* b = ports[0].first->CreateRdmaDeviceContext();
  RdmaEndpointConfig config;
  config.portId = ports[0].second;
  config.onGpu = true;
  RdmaEndpoint epA = a->CreateRdmaEndpoint(config);
  RdmaEndpoint epB = b->CreateRdmaEndpoint(config);
  a->ConnectEndpoint(epA.handle, epB.handle);
  b->ConnectEndpoint(epB.handle, epA.handle);
  core::GpuBuffer pinned(2 * sizeof(Queues) + 64, core::MemoryType::HostPinned);
  auto* qa = pinned.DataAs<Queues>();
  auto* qb = qa + 1;
  qa->wq = epA.wqHandle;
  qa->cq = epA.cqHandle;
  qb->wq = epB.wqHandle;
  qb->cq = epB.cqHandle;
  auto* errors = reinterpret_cast<uint32_t*>(qb + 1);
  auto* status = reinterpret_cast<int*>(errors + 1);
  auto* received = reinterpret_cast<uint32_t*>(status + 1);
  auto* inlineData = reinterpret_cast<uint8_t*>(received + 1);  // 28 bytes of room left in `pinned`

  core::GpuBuffer local(bytes + 64), remote(bytes + 64);
  std::vector<uint8_t> init(local.Bytes());
  for (size_t i = 0; i < init.size(); ++i) init[i] = Pattern(i, 1);
  MORI_CHECK_GPU(core::GpuMemcpy(local.Data(), init.data(), init.size()));
  MORI_CHECK_GPU(core::GpuMemset(remote.Data(), 0, remote.Bytes()));
  RdmaMemoryRegion localMr = a->RegisterRdmaMemoryRegion(local.Data(), local.Bytes());
  RdmaMemoryRegion remoteMr = b->RegisterRdmaMemoryRegion(remote.Data(), remote.Bytes());
  auto post = [&](int op, RdmaMemoryRegion l, RdmaMemoryRegion r, uint64_t n, uint64_t v1 = 0, uint64_t v2 = 0) {
    *errors = 12345;
    core::LaunchKernel(PostOne, core::Dim3(1), core::Dim3(1), 0, nullptr, qa, op, l, r, n,
                       static_cast<const void*>(inlineData), v1, v2, errors);
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
    return *errors == 0;
  };
  bool all = true;

  // Write.
  bool ok = post(kWrite, localMr, remoteMr, bytes);
  auto got = Download(remote, 0, bytes + 64);
  for (size_t i = 0; ok && i < bytes; ++i) ok = got[i] == Pattern(i, 1);
  for (size_t i = bytes; ok && i < bytes + 64; ++i) ok = got[i] == 0;
  all &= Check("write", ok, "the remote buffer does not hold exactly the bytes written");

  // Inline write: 20 bytes carried inside the WQE.
  for (int i = 0; i < 20; ++i) inlineData[i] = static_cast<uint8_t>(0xa0 + i);
  RdmaMemoryRegion tail = remoteMr;
  tail.addr += bytes + 8;
  ok = post(kWriteInline, localMr, tail, 20);
  got = Download(remote, bytes + 8, 20);
  ok = ok && std::memcmp(got.data(), inlineData, 20) == 0;
  all &= Check("write-inline", ok, "the 20 inline bytes did not arrive");

  // Read the remote buffer back into the second half of... a fresh local region.
  core::GpuBuffer readBack(bytes);
  MORI_CHECK_GPU(core::GpuMemset(readBack.Data(), 0xff, bytes));
  RdmaMemoryRegion readMr = a->RegisterRdmaMemoryRegion(readBack.Data(), bytes);
  ok = post(kRead, readMr, remoteMr, bytes);
  got = Download(readBack, 0, bytes);
  for (size_t i = 0; ok && i < bytes; ++i) ok = got[i] == Pattern(i, 1);
  all &= Check("read", ok, "the bytes read differ from the remote buffer");

  // Send into a receive buffer the other endpoint posted.
  core::GpuBuffer inbox(bytes);
  RdmaMemoryRegion inboxMr = b->RegisterRdmaMemoryRegion(inbox.Data(), bytes);
  b->HostPostRecv(epB, inboxMr.addr, inboxMr.lkey, bytes, 1);
  qb->wq.rqPostIdx = epB.wqHandle.rqPostIdx;
  ok = post(kSend, localMr, remoteMr, bytes);
  core::LaunchKernel(WaitReceive, core::Dim3(1), core::Dim3(1), 0, nullptr, qb, status, received);
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
  got = Download(inbox, 0, bytes);
  ok = ok && *status == mlx5::kCqeRespSend && *received == bytes;
  for (size_t i = 0; ok && i < bytes; ++i) ok = got[i] == Pattern(i, 1);
  all &= Check("send/receive", ok, "the receive completion or the received bytes are wrong");

  // Atomics on an 8-byte word of the remote buffer; the original value comes back into local.
  uint64_t word = 5000;
  MORI_CHECK_GPU(core::GpuMemcpy(remote.DataAs<uint8_t>() + 32, &word, 8));
  RdmaMemoryRegion counter = remoteMr;
  counter.addr += 32;
  ok = post(kFetchAdd, localMr, counter, 8, 37);
  uint64_t old = 0, now = 0;
  MORI_CHECK_GPU(core::GpuMemcpy(&old, local.Data(), 8));
  MORI_CHECK_GPU(core::GpuMemcpy(&now, remote.DataAs<uint8_t>() + 32, 8));
  all &= Check("fetch-add", ok && old == 5000 && now == 5037, "wrong original or sum");
  ok = post(kCompareSwap, localMr, counter, 8, 9, 5037);
  MORI_CHECK_GPU(core::GpuMemcpy(&old, local.Data(), 8));
  MORI_CHECK_GPU(core::GpuMemcpy(&now, remote.DataAs<uint8_t>() + 32, 8));
  all &= Check("compare-swap", ok && old == 5037 && now == 9, "wrong original or swapped value");

  std::printf("%s\n", all ? "All operations verified." : "SOME OPERATIONS FAILED");
  return all ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 0) : (1 << 20) + 3;
    if (bytes < 64) {
      std::fprintf(stderr, "usage: %s [bytes >= 64]\n", argv[0]);
      return 2;
    }
    return Run(bytes);
  } catch (const core::Error& e) {
    std::fprintf(stderr, "local_rdma_ops: %s\n", e.what());
    return 1;
  }
}
