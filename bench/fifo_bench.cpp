// fifo_bench: the proxy FIFO's costs. Round trip: one kernel thread pushes a trigger, the proxy pops it and
// answers through a host-pinned flag (or the kernel waits for the pop itself, as a port channel Flush does);
// per-iteration latency median/p99. Throughput: many kernel threads push while the proxy pops.
//
//   ./fifo_bench [--iters N] [--warmup N] [--per-pusher N] [--pushers 1,64,1024] [--fifo-size N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "mori/core/atomic.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/proxy.hpp"

namespace core = mori::core;

namespace {

enum RoundTrip : uint32_t { kAnswerFlag = 0, kWaitForPop = 1 };

// One thread: `warmup + iters` round trips; times[i] is iteration warmup + i in ns.
MORI_GLOBAL void RoundTripKernel(core::FifoDeviceHandle fifo, uint32_t mode, uint32_t warmup, uint32_t iters,
                                 uint64_t* answer, uint64_t* times, uint64_t timeoutNs) {
  for (uint32_t i = 0; i < warmup + iters; ++i) {
    uint64_t start = core::DeviceWallClockNs();
    uint64_t slot = fifo.Push(core::ProxyTrigger{uint64_t{i} + 1, 0});
    if (mode == kWaitForPop) {
      fifo.Sync(slot);
    } else {
      core::SpinDeadline deadline(timeoutNs);
      while (core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::System>(answer) != uint64_t{i} + 1) {
        MORI_DEVICE_ASSERT(!deadline.Expired(), "fifo_bench: waited %llu ns for the proxy's answer to trigger %u",
                           static_cast<unsigned long long>(timeoutNs), i + 1);
        core::SpinPause();
      }
    }
    uint64_t end = core::DeviceWallClockNs();
    if (i >= warmup) times[i - warmup] = end - start;
  }
}

// Every thread pushes `perThread` triggers and does not wait.
MORI_GLOBAL void FloodKernel(core::FifoDeviceHandle fifo, uint32_t perThread) {
  uint64_t tid = core::GlobalThreadIdx();
  for (uint32_t i = 0; i < perThread; ++i) fifo.Push(core::ProxyTrigger{tid << 32 | i, 0});
}

// Answers each trigger by storing its first word in a host-pinned flag.
class EchoProxy : public core::Proxy {
 public:
  EchoProxy(uint32_t fifoSize, uint64_t* answer) : Proxy(fifoSize), answer_(answer) {}
  ~EchoProxy() override { StopProxyWithoutDraining(); }

 protected:
  uint32_t HandleTrigger(const core::ProxyTrigger& t) override {
    core::AtomicStore<core::MemoryOrder::Release, core::Scope::System>(answer_, t.fst);
    return 1;
  }

 private:
  uint64_t* answer_;
};

struct Options {
  uint32_t iters = MORI_BACKEND_HOST ? 2000 : 20000;
  uint32_t warmup = 200;
  uint32_t perPusher = MORI_BACKEND_HOST ? 200 : 2000;
  uint32_t fifoSize = core::kDefaultFifoSize;
  std::vector<uint32_t> pushers =
      MORI_BACKEND_HOST ? std::vector<uint32_t>{1, 16, 64, 256} : std::vector<uint32_t>{1, 32, 256, 1024, 4096};
};

[[noreturn]] void Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--iters N] [--warmup N] [--per-pusher N] [--pushers a,b,c] [--fifo-size N]\n"
               "  round trip: N timed iterations after the warm-up; throughput: each of a,b,c pushers pushes\n"
               "  --per-pusher triggers\n",
               argv0);
  std::exit(2);
}

uint32_t ParseCount(const char* text, const char* argv0) {
  char* end = nullptr;
  unsigned long v = std::strtoul(text, &end, 10);
  if (end == text || *end != '\0' || v == 0 || v > (1ul << 30)) Usage(argv0);
  return static_cast<uint32_t>(v);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) Usage(argv[0]);
    const char* v = argv[++i];
    if (a == "--iters") {
      o.iters = ParseCount(v, argv[0]);
    } else if (a == "--warmup") {
      o.warmup = ParseCount(v, argv[0]);
    } else if (a == "--per-pusher") {
      o.perPusher = ParseCount(v, argv[0]);
    } else if (a == "--fifo-size") {
      o.fifoSize = ParseCount(v, argv[0]);
    } else if (a == "--pushers") {
      o.pushers.clear();
      std::stringstream list(v);
      std::string item;
      while (std::getline(list, item, ',')) o.pushers.push_back(ParseCount(item.c_str(), argv[0]));
      if (o.pushers.empty()) Usage(argv[0]);
    } else {
      Usage(argv[0]);
    }
  }
  return o;
}

double Percentile(std::vector<uint64_t> v, double p) {
  std::sort(v.begin(), v.end());
  size_t k = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return static_cast<double>(v[k]) / 1000.0;
}

void Check() {
  MORI_CHECK_GPU(core::GpuGetLastError());
  MORI_CHECK_GPU(core::GpuDeviceSynchronize());
}

}  // namespace

int main(int argc, char** argv) {
  Options o = Parse(argc, argv);
  try {
    core::GpuBuffer answer(64, core::MemoryType::HostPinned);
    std::memset(answer.Data(), 0, answer.Bytes());
    core::GpuBuffer times(sizeof(uint64_t) * o.iters, core::MemoryType::HostPinned);
    const uint64_t timeoutNs = static_cast<uint64_t>(core::TimeoutSeconds() * 1e9);
    core::PreloadKernels(RoundTripKernel, FloodKernel);

    std::printf("FIFO round trip (%u slots, %u iterations after %u warm-up)\n", o.fifoSize, o.iters, o.warmup);
    std::printf("  %-34s %10s %10s %10s\n", "mode", "median us", "p99 us", "min us");
    for (uint32_t mode : {kAnswerFlag, kWaitForPop}) {
      EchoProxy proxy(o.fifoSize, answer.DataAs<uint64_t>());
      std::memset(answer.Data(), 0, answer.Bytes());
      proxy.StartProxy();
      core::LaunchKernel(RoundTripKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, proxy.FifoHandle(), mode, o.warmup,
                         o.iters, answer.DataAs<uint64_t>(), times.DataAs<uint64_t>(), timeoutNs);
      Check();
      proxy.StopProxy();
      std::vector<uint64_t> t(times.DataAs<uint64_t>(), times.DataAs<uint64_t>() + o.iters);
      std::printf("  %-34s %10.2f %10.2f %10.2f\n",
                  mode == kAnswerFlag ? "push -> pop -> pinned flag" : "push -> pop (kernel waits on tail)",
                  Percentile(t, 0.5), Percentile(t, 0.99), Percentile(t, 0.0));
    }

    std::printf("\nFIFO throughput (%u slots, %u triggers per pusher)\n", o.fifoSize, o.perPusher);
    std::printf("  %-10s %14s %12s %14s\n", "pushers", "triggers", "ms", "Mtriggers/s");
    for (uint32_t pushers : o.pushers) {
      uint32_t block = std::min<uint32_t>(pushers, MORI_BACKEND_HOST ? 256 : 1024);
      uint32_t blocks = (pushers + block - 1) / block;
      pushers = blocks * block;
      EchoProxy proxy(o.fifoSize, answer.DataAs<uint64_t>());
      proxy.StartProxy();
      auto start = std::chrono::steady_clock::now();
      core::LaunchKernel(FloodKernel, core::Dim3(blocks), core::Dim3(block), 0, nullptr, proxy.FifoHandle(),
                         o.perPusher);
      Check();
      proxy.StopProxy();  // drains: every trigger popped
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      uint64_t n = uint64_t{pushers} * o.perPusher;
      MORI_CHECK(proxy.Handled() == n, core::ErrorCode::Internal, "the proxy handled %llu of %llu triggers",
                 static_cast<unsigned long long>(proxy.Handled()), static_cast<unsigned long long>(n));
      std::printf("  %-10u %14llu %12.2f %14.3f\n", pushers, static_cast<unsigned long long>(n), s * 1e3,
                  static_cast<double>(n) / s / 1e6);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fifo_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
