// MoE dispatch and combine (mori::ep) under mpirun: time per call and bandwidth as DeepEP and MORI count it
// (bytes of the tokens this PE received, with their scales, over the time; combine: the bf16 rows it sent
// back), beside the ceiling of the machine: the same bytes moved by ShmemPutMemNbiBlock with no routing.
// Defaults are the DeepSeek-V3 shape (hidden 7168, top-8, 256 experts over the PEs, fp8 with 56 scales per
// token, bf16 combine, 4096 tokens per PE); on HOST a small shape.
//   mpirun -np 2 ./bench/ep_bench [--tokens N] [--hidden H] [--experts E] [--topk K] [--dtype fp8|bf16]
//                                 [--kernel intra|inter|ll|both|all, or a comma list] [--iters N] [--warmup N]
//                                 [--blocks N] [--warps N] [--phases 1] [--kernel-time 1]
// --phases 1 adds, per kernel type: the host's time to queue a Dispatch; this machine's launch gaps (a kernel's
// end to the next one's first instruction, launched plainly and early); the GPU time of a Dispatch and of
// each Combine half with every launch queued behind a 200-us hold kernel (host launch costs out of them), and
// the host's time to queue each half. Against the plain figure they say how much of a call is launches.
// --kernel-time 1 (CUDA, with CUPTI loadable) adds each call's kernel time as a profiler reports it: from the first
// block of its first kernel to the last block of its last (bench/kernel_spans.hpp), no launch or event in it, the
// way DeepEP's and MORI's kernel figures are measured; median over the same iterations, each after a barrier.
// LowLatency (ll) receives a row per (token, local expert): its "received" and bandwidth count those rows, as
// DeepEP counts its low-latency kernels; it is meant for decode batches (--tokens 128).
#include <algorithm>
#include <chrono>
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
#include "kernel_spans.hpp"
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

// Keeps the stream busy for `ns` so that the launches queued behind it start back to back.
MORI_GLOBAL void HoldKernel(uint64_t ns, uint64_t* endOut) {
  const uint64_t end = core::DeviceWallClockNs() + ns;
  while (core::DeviceWallClockNs() < end) {
  }
  *endOut = core::DeviceWallClockNs();
}

MORI_GLOBAL void StampKernel(uint64_t* out) {
  core::WaitForPrerequisiteGrid();
  if (core::FlatBlockIdx() == 0 && core::FlatThreadIdx() == 0) *out = core::DeviceWallClockNs();
}

struct Args {
  int tokens = MORI_BACKEND_HOST ? 64 : 4096;
  int hidden = MORI_BACKEND_HOST ? 256 : 7168;
  int experts = 256, topk = 8, iters = MORI_BACKEND_HOST ? 5 : 20, warmup = 3, blocks = 0, warps = 0, phases = 0;
  int kernelTime = 0;
  std::string dtype = "fp8", kernel = "both";
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Launch gaps on this machine: a hold kernel's end to the next kernel's first instruction.
void Gaps(bench::StreamTimer& timer) {
  core::GpuBuffer t(32);
  const core::GpuStream s = timer.Stream();
  for (int mode = 0; mode < 4; ++mode) {
    std::vector<double> gap;
    for (int i = 0; i < 20; ++i) {
      MORI_CHECK_GPU(core::GpuStreamSynchronize(s));
      core::LaunchKernel(HoldKernel, core::Dim3(1), core::Dim3(1), 0, s, uint64_t(100000), t.DataAs<uint64_t>());
      const core::Dim3 grid(mode % 2 == 0 ? 1 : 132), block(mode % 2 == 0 ? 32 : 512);
      if (mode < 2) core::LaunchKernel(StampKernel, grid, block, 0, s, t.DataAs<uint64_t>() + 1);
      else core::LaunchKernelEarly(StampKernel, grid, block, 0, s, t.DataAs<uint64_t>() + 1);
      MORI_CHECK_GPU(core::GpuStreamSynchronize(s));
      uint64_t v[2];
      MORI_CHECK_GPU(core::GpuMemcpy(v, t.Data(), 16));
      gap.push_back((double(v[1]) - double(v[0])) / 1e3);
    }
    std::printf("PE %d launch gap (%s, %s): %.2f us\n", shmem::ShmemMyPe(), mode % 2 == 0 ? "1x32" : "132x512",
                mode < 2 ? "plain" : "early", Median(gap));
  }
}

// The halves of each call, GPU time behind a hold kernel and host time to queue them (see --phases).
void Phases(const Args& a, ep::EpDispatchCombineHandle& h, ep::EpKernelType kernel, bench::StreamTimer& timer,
            const core::GpuBuffer& input, const core::GpuBuffer& dIdx, const core::GpuBuffer& dW,
            const core::GpuBuffer& scales, const core::GpuBuffer& expertOut, core::GpuBuffer& output, bool scaled) {
  const core::GpuStream s = timer.Stream();
  // GPU: the whole dispatch (its halves have no event between them: the receive kernel may start early after
  // the send kernel, and an event would stop it), then each combine half. Host: each of the four halves.
  core::GpuEvent ev[5];  // dispatch 0 .. 1; combine: 2 send 3 recv 4
  for (auto& e : ev) MORI_CHECK_GPU(core::GpuEventCreate(&e));
  std::vector<double> gpu[3], host[4];
  using Clock = std::chrono::steady_clock;
  core::GpuBuffer holdEnd(16);
  auto hold = [&] {
    if (!MORI_BACKEND_HOST) {
      core::LaunchKernel(HoldKernel, core::Dim3(1), core::Dim3(1), 0, s, uint64_t(200000), holdEnd.DataAs<uint64_t>());
    }
  };
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    Clock::time_point t[6];  // dispatch: 0 send 1 recv 2; combine: 3 send 4 recv 5
    timer.Barrier();
    hold();
    MORI_CHECK_GPU(core::GpuEventRecord(ev[0], s));
    t[0] = Clock::now();
    h.DispatchSend(input.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(), scaled ? scales.DataAs<float>() : nullptr,
                   a.tokens, s);
    t[1] = Clock::now();
    (void)h.DispatchRecv(s);
    t[2] = Clock::now();
    MORI_CHECK_GPU(core::GpuEventRecord(ev[1], s));
    MORI_CHECK_GPU(core::GpuStreamSynchronize(s));
    timer.Barrier();  // combine after a barrier of its own, as the plain figure times it
    hold();
    MORI_CHECK_GPU(core::GpuEventRecord(ev[2], s));
    t[3] = Clock::now();
    h.CombineSend(expertOut.Data(), s);
    t[4] = Clock::now();
    MORI_CHECK_GPU(core::GpuEventRecord(ev[3], s));
    h.CombineRecv(output.Data(), s);
    t[5] = Clock::now();
    MORI_CHECK_GPU(core::GpuEventRecord(ev[4], s));
    MORI_CHECK_GPU(core::GpuStreamSynchronize(s));
    if (i < a.warmup) continue;
    const int from[3] = {0, 2, 3};
    for (int k = 0; k < 3; ++k) {
      float ms = 0;
      MORI_CHECK_GPU(core::GpuEventElapsedTime(&ms, ev[from[k]], ev[from[k] + 1]));
      gpu[k].push_back(ms * 1e3);
    }
    const int half[4] = {0, 1, 3, 4};
    for (int k = 0; k < 4; ++k) {
      host[k].push_back(std::chrono::duration<double, std::micro>(t[half[k] + 1] - t[half[k]]).count());
    }
  }
  for (auto& e : ev) (void)core::GpuEventDestroy(e);
  std::printf("PE %d %-9s phases, GPU us behind a hold (host us to queue): dispatch %.1f (send %.1f, recv %.1f); "
              "combine send %.1f (%.1f), recv %.1f (%.1f)\n",
              shmem::ShmemMyPe(), ep::EpKernelTypeName(kernel), Median(gpu[0]), Median(host[0]), Median(host[1]),
              Median(gpu[1]), Median(host[2]), Median(gpu[2]), Median(host[3]));
}
#if MORI_BACKEND_CUDA
// Marks the start of a timed call among CUPTI's kernel records (see KernelTimes).
MORI_GLOBAL void EpBenchMarkKernel() {}
#endif

// Each call's kernel time from CUPTI's records (see --kernel-time). A marker kernel goes on the stream before
// each call; the records are taken once at the end (a flush takes the host hundreds of microseconds and a new
// record buffer, which would skew the PEs if done between calls), and the mori::ep kernels after each marker are
// that call's.
void KernelTimes(const Args& a, ep::EpDispatchCombineHandle& h, ep::EpKernelType kernel, bench::StreamTimer& timer,
                 const core::GpuBuffer& input, const core::GpuBuffer& dIdx, const core::GpuBuffer& dW,
                 const core::GpuBuffer& scales, const core::GpuBuffer& expertOut, core::GpuBuffer& output, bool scaled) {
  const int me = shmem::ShmemMyPe();
#if MORI_BACKEND_CUDA
  bench::KernelSpans spans;
  std::string why;
  if (!spans.Start(&why)) {
    std::printf("PE %d %-9s kernel time: not measured, %s\n", me, ep::EpKernelTypeName(kernel), why.c_str());
    return;
  }
  const core::GpuStream s = timer.Stream();
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    timer.Barrier();
    core::LaunchKernel(EpBenchMarkKernel, core::Dim3(1), core::Dim3(1), 0, s);
    (void)h.Dispatch(input.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(), scaled ? scales.DataAs<float>() : nullptr,
                     a.tokens, s);
    timer.Barrier();
    core::LaunchKernel(EpBenchMarkKernel, core::Dim3(1), core::Dim3(1), 0, s);
    h.Combine(expertOut.Data(), output.Data(), s);
    std::string msg;
    MORI_CHECK(h.Status(s, &msg) == 0, core::ErrorCode::Internal, "%s", msg.c_str());
  }
  MORI_CHECK_GPU(core::GpuStreamSynchronize(s));
  std::vector<bench::KernelRecord> records = spans.Take();
  std::sort(records.begin(), records.end(),
            [](const bench::KernelRecord& x, const bench::KernelRecord& y) { return x.start < y.start; });
  std::vector<double> calls;  // dispatch, combine, dispatch, ...
  uint64_t first = 0, last = 0;
  auto close = [&] {
    if (last > first) calls.push_back(static_cast<double>(last - first) / 1e3);
    first = last = 0;
  };
  for (const bench::KernelRecord& r : records) {
    if (r.name.find("EpBenchMark") != std::string::npos) {
      close();
    } else if (r.name.rfind("_ZN4mori2ep", 0) == 0) {  // mangled names in mori::ep
      first = first == 0 || r.start < first ? r.start : first;
      last = r.end > last ? r.end : last;
    }
  }
  close();
  if (calls.size() != 2 * static_cast<size_t>(a.warmup + a.iters)) {
    std::printf("PE %d %-9s kernel time: not measured, %zu calls in CUPTI's records, %d made\n", me,
                ep::EpKernelTypeName(kernel), calls.size(), 2 * (a.warmup + a.iters));
    return;
  }
  std::vector<double> d, c;
  for (size_t k = 2 * static_cast<size_t>(a.warmup); k < calls.size(); k += 2) {
    d.push_back(calls[k]);
    c.push_back(calls[k + 1]);
  }
  std::printf("PE %d %-9s kernel time (CUPTI: first block to last of a call's kernels): dispatch %.1f us, combine "
              "%.1f us\n",
              me, ep::EpKernelTypeName(kernel), Median(d), Median(c));
#else
  (void)a, (void)h, (void)timer, (void)input, (void)dIdx, (void)dW, (void)scales, (void)expertOut, (void)output,
      (void)scaled;
  std::printf("PE %d %-9s kernel time: not measured, it needs the CUDA backend (CUPTI)\n", me,
              ep::EpKernelTypeName(kernel));
#endif
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

  std::vector<double> tDispatch, tCombine, hostUs;
  int received = 0;
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    timer.Barrier();
    ep::EpDispatchResult r{};
    const auto h0 = std::chrono::steady_clock::now();
    double d = timer.TimeMs([&] {
      r = h.Dispatch(input.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(),
                     c.scaleDim > 0 ? scales.DataAs<float>() : nullptr, a.tokens, timer.Stream());
      hostUs.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count());
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
  if (a.phases != 0) std::printf("PE %d host us to queue a Dispatch: %.1f\n", me, Median(hostUs));
  if (a.phases != 0 && !MORI_BACKEND_HOST) Gaps(timer);
  if (a.phases != 0) Phases(a, h, kernel, timer, input, dIdx, dW, scales, expertOut, output, c.scaleDim > 0);
  if (a.kernelTime != 0) KernelTimes(a, h, kernel, timer, input, dIdx, dW, scales, expertOut, output, c.scaleDim > 0);
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
    else if (k == "--phases") a.phases = std::atoi(v.c_str());
    else if (k == "--kernel-time") a.kernelTime = std::atoi(v.c_str());
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
