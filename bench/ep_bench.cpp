// MoE dispatch and combine (mori::ep) under mpirun: time per call and bandwidth as DeepEP and MORI count it
// (bytes of the tokens this PE received, with their scales, over the time; combine: the bf16 rows it sent
// back), beside the ceiling of the machine: the same bytes moved by ShmemPutMemNbiBlock with no routing.
// Defaults are the DeepSeek-V3 shape (hidden 7168, top-8, 256 experts over the PEs, fp8 with 56 scales per
// token, bf16 combine, 4096 tokens per PE); on HOST a small shape.
//   mpirun -np 2 ./bench/ep_bench [--tokens N] [--hidden H] [--experts E] [--topk K] [--dtype fp8|bf16]
//                                 [--kernel intra|inter|ll|both|all, or a comma list] [--iters N] [--warmup N]
//                                 [--blocks N] [--warps N]
// LowLatency (ll) receives a row per (token, local expert): its "received" and bandwidth count those rows, as
// DeepEP counts its low-latency kernels; it is meant for decode batches (--tokens 128).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/ep/dispatch_combine.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"
#include "mori_bench_util.hpp"

namespace {

using namespace mori;

// The ceiling: each block puts its share of `bytes` to `pe`, then one thread per block quiets.
MORI_GLOBAL void CeilingKernel(uint8_t* dst, const uint8_t* src, size_t bytes, int pe) {
  const size_t chunk = (bytes + core::FlatGridDim() - 1) / core::FlatGridDim();
  const size_t at = core::FlatBlockIdx() * chunk;
  if (at < bytes) shmem::ShmemPutMemNbiBlock(dst + at, src + at, std::min(chunk, bytes - at), pe);
  if (core::FlatThreadIdx() == 0) shmem::ShmemQuietThread();
}

struct Args {
  int tokens = MORI_BACKEND_HOST ? 64 : 4096;
  int hidden = MORI_BACKEND_HOST ? 256 : 7168;
  int experts = 256, topk = 8, iters = MORI_BACKEND_HOST ? 5 : 20, warmup = 3, blocks = 0, warps = 0;
  std::string dtype = "fp8", kernel = "both";
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void Run(const Args& a, ep::EpKernelType kernel, bench::StreamTimer& timer) {
  const int me = shmem::ShmemMyPe(), n = shmem::ShmemNPes();
  ep::EpDispatchCombineConfig c;
  c.rank = me;
  c.worldSize = n;
  c.hiddenDim = a.hidden;
  c.maxTokensPerRank = a.tokens;
  c.numExpertsPerRank = std::max(1, a.experts / n);
  c.topk = a.topk;
  c.dtype = a.dtype == "fp8" ? ep::DataType::Fp8E4M3 : ep::DataType::BFloat16;
  c.scaleDim = a.dtype == "fp8" ? a.hidden / 128 : 0;
  c.kernel = kernel;
  c.blocks = a.blocks;
  c.warpsPerBlock = a.warps;
  ep::EpDispatchCombineHandle h(c);
  const size_t tokenBytes = static_cast<size_t>(a.hidden) * ep::DataTypeBytes(c.dtype);
  const size_t rowBytes = static_cast<size_t>(a.hidden) * ep::DataTypeBytes(h.CombineDataType());

  // Uniform routing: top-k distinct experts per token.
  std::mt19937 rng(1234 + me);
  const int experts = c.numExpertsPerRank * n;
  std::vector<int32_t> idx(static_cast<size_t>(a.tokens) * a.topk);
  std::vector<float> w(idx.size(), 1.0f / a.topk);
  for (int t = 0; t < a.tokens; ++t) {
    std::vector<int> pick;
    while (static_cast<int>(pick.size()) < std::min(a.topk, experts)) {
      int e = static_cast<int>(rng() % experts);
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    for (int k = 0; k < a.topk; ++k) idx[static_cast<size_t>(t) * a.topk + k] = pick[k % pick.size()];
  }
  core::GpuBuffer input(std::max<size_t>(a.tokens * tokenBytes, 16)), dIdx(idx.size() * 4), dW(w.size() * 4),
      scales(std::max<size_t>(static_cast<size_t>(a.tokens) * std::max(c.scaleDim, 1) * 4, 16)),
      expertOut(std::max<size_t>(static_cast<size_t>(n) * a.tokens * rowBytes *
                                     (kernel == ep::EpKernelType::LowLatency ? c.numExpertsPerRank : 1),
                                 16)),
      output(std::max<size_t>(a.tokens * rowBytes, 16));
  MORI_CHECK_GPU(core::GpuMemset(input.Data(), 0x3C, input.Bytes()));
  MORI_CHECK_GPU(core::GpuMemset(scales.Data(), 0, scales.Bytes()));
  MORI_CHECK_GPU(core::GpuMemset(expertOut.Data(), 0, expertOut.Bytes()));
  MORI_CHECK_GPU(core::GpuMemcpy(dIdx.Data(), idx.data(), idx.size() * 4));
  MORI_CHECK_GPU(core::GpuMemcpy(dW.Data(), w.data(), w.size() * 4));

  std::vector<double> tDispatch, tCombine;
  int received = 0;
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    timer.Barrier();
    ep::EpDispatchResult r{};
    double d = timer.TimeMs([&] {
      r = h.Dispatch(input.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(),
                     c.scaleDim > 0 ? scales.DataAs<float>() : nullptr, a.tokens, timer.Stream());
    });
    MORI_CHECK_GPU(core::GpuMemcpy(&received, r.totalRecv, sizeof(int)));
    timer.Barrier();
    double cb = timer.TimeMs([&] { h.Combine(expertOut.Data(), output.Data(), timer.Stream()); });
    std::string msg;
    MORI_CHECK(h.Status(timer.Stream(), &msg) == 0, core::ErrorCode::Internal, "%s", msg.c_str());
    if (i >= a.warmup) {
      tDispatch.push_back(d);
      tCombine.push_back(cb);
    }
  }
  const double dMs = Median(tDispatch), cMs = Median(tCombine);
  const double dBytes = static_cast<double>(received) * (tokenBytes + c.scaleDim * 4.0);
  const double cBytes = static_cast<double>(received) * rowBytes;

  // The ceiling: the dispatch's bytes from this PE to the next with no routing.
  const size_t ceilBytes = static_cast<size_t>(dBytes);
  // Symmetric: the same size on every PE (the most any PE can receive), of which this PE puts ceilBytes.
  const size_t most = static_cast<size_t>(n) * a.tokens * (tokenBytes + c.scaleDim * 4);
  auto* buf = bench::SymmetricAlloc<uint8_t>(2 * std::max<size_t>(most, 16), false, " (ep_bench ceiling)");
  std::vector<double> tCeil;
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    timer.Barrier();
    double t = timer.TimeMs([&] {
      core::LaunchKernel(CeilingKernel, core::Dim3(MORI_BACKEND_HOST ? 2 : 64), core::Dim3(MORI_BACKEND_HOST ? 8 : 512),
                         0, timer.Stream(), buf + most, static_cast<const uint8_t*>(buf), ceilBytes, (me + 1) % n);
    });
    if (i >= a.warmup) tCeil.push_back(t);
  }
  timer.Barrier();
  shmem::ShmemFree(buf);
  const double ceilMs = Median(tCeil);
  std::printf("PE %d %-9s blocks %d warps %d %s tokens %d hidden %d top-%d experts %d: received %d | dispatch %8.1f us %7.1f GB/s | "
              "combine %8.1f us %7.1f GB/s | ceiling (put, same bytes) %8.1f us %7.1f GB/s | dispatch/ceiling %.2f\n",
              me, ep::EpKernelTypeName(kernel), c.blocks, c.warpsPerBlock, a.dtype.c_str(), a.tokens, a.hidden, a.topk, experts, received,
              dMs * 1e3, dBytes / dMs / 1e6, cMs * 1e3, cBytes / cMs / 1e6, ceilMs * 1e3, dBytes / ceilMs / 1e6,
              ceilMs / dMs);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--tokens") a.tokens = std::atoi(v.c_str());
    else if (k == "--hidden") a.hidden = std::atoi(v.c_str());
    else if (k == "--experts") a.experts = std::atoi(v.c_str());
    else if (k == "--topk") a.topk = std::atoi(v.c_str());
    else if (k == "--iters") a.iters = std::atoi(v.c_str());
    else if (k == "--warmup") a.warmup = std::atoi(v.c_str());
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--blocks") a.blocks = std::atoi(v.c_str());
    else if (k == "--warps") a.warps = std::atoi(v.c_str());
    else if (k == "--kernel") a.kernel = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (shmem::ShmemInit() != 0) return 1;
  int rc = 0;
  try {
    bench::StreamTimer timer;
    bool allP2p = true;
    for (int pe = 0; pe < shmem::ShmemNPes(); ++pe) {
      auto t = shmem::ShmemTransportType(pe);
      allP2p = allP2p && (t == shmem::TransportType::P2P || t == shmem::TransportType::Self);
    }
    auto wants = [&](const char* name) {
      const std::string list = "," + a.kernel + ",";
      return list.find("," + std::string(name) + ",") != std::string::npos || list.find(",all,") != std::string::npos ||
             (std::string(name) != "ll" && list.find(",both,") != std::string::npos);
    };
    if (wants("intra") && allP2p) Run(a, ep::EpKernelType::IntraNode, timer);
    if (wants("inter")) Run(a, ep::EpKernelType::InterNode, timer);
    if (wants("ll")) Run(a, ep::EpKernelType::LowLatency, timer);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ep_bench on PE %d: %s\n", shmem::ShmemMyPe(), e.what());
    rc = 1;
  }
  shmem::ShmemFinalize();
  return rc;
}
