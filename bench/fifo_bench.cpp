// fifo_bench: the proxy FIFO's costs. Round trip: one kernel thread pushes a trigger, the proxy pops it and
// answers through a host-pinned flag (or the kernel waits for the pop itself, as a port channel Flush does);
// per-iteration latency median/p99, beside the floor of the same machine: a kernel thread and a host thread
// bouncing a value through two host-pinned flags with no FIFO at all. Throughput: many kernel threads push
// while the proxy pops.
//
//   ./fifo_bench [--iters N] [--warmup N] [--per-pusher N] [--pushers 1,64,1024] [--fifo-size N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mori/core/atomic.hpp"
#include "mori/core/device_assert.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/proxy.hpp"

namespace core = mori::core;

namespace {

enum RoundTrip : uint32_t { kAnswerFlag = 0, kWaitForPop = 1 };

// The round trips measured: how the kernel learns the request was handled, and what the push orders.
struct RoundTripMode {
  RoundTrip wait;
  core::FifoOrder order;
  const char* name;
};
constexpr RoundTripMode kRoundTrips[] = {
    {kAnswerFlag, core::FifoOrder::AfterWrites, "push -> pop -> pinned flag"},
    {kAnswerFlag, core::FifoOrder::AfterDeviceWrites, "the same, after GPU-memory writes"},
    {kAnswerFlag, core::FifoOrder::PayloadOnly, "the same, payload-only push"},
    {kWaitForPop, core::FifoOrder::AfterWrites, "push -> pop (kernel waits on tail)"},
};

// Waits (bounded) until the host answers `value` in `answer`.
template <core::MemoryOrder O>
MORI_DEVICE_INLINE void WaitForAnswer(const uint64_t* answer, uint64_t value, uint64_t timeoutNs) {
  core::SpinDeadline deadline(timeoutNs);
  while (core::AtomicLoad<O, core::Scope::System>(answer) != value) {
    MORI_DEVICE_ASSERT(!deadline.Expired(), "fifo_bench: waited %llu ns for the host's answer %llu",
                       static_cast<unsigned long long>(timeoutNs), static_cast<unsigned long long>(value));
    core::SpinPause();
  }
}

// One thread: `warmup + iters` round trips; times[i] is iteration warmup + i in ns, pushTimes[i] the part
// spent in the push itself. Both arrays are in device memory: a store to host memory would still be in flight
// at the next push, whose release fence then waits for it (the bench kept its timings in host-pinned memory
// until 2026-11-26, which added its own PCIe writes to every push it timed).
MORI_GLOBAL void RoundTripKernel(core::FifoDeviceHandle fifo, uint32_t mode, core::FifoOrder order, uint32_t warmup,
                                 uint32_t iters, uint64_t* answer, uint64_t* times, uint64_t* pushTimes,
                                 uint64_t timeoutNs) {
  for (uint32_t i = 0; i < warmup + iters; ++i) {
    uint64_t start = core::DeviceWallClockNs();
    uint64_t slot = fifo.Push(core::ProxyTrigger{uint64_t{i} + 1, 0}, order);
    uint64_t pushed = core::DeviceWallClockNs();
    if (mode == kWaitForPop) {
      fifo.Sync(slot);
    } else {
      WaitForAnswer<core::MemoryOrder::Acquire>(answer, uint64_t{i} + 1, timeoutNs);
    }
    uint64_t end = core::DeviceWallClockNs();
    if (i >= warmup) {
      times[i - warmup] = end - start;
      pushTimes[i - warmup] = pushed - start;
    }
  }
}

// The floor: stores i + 1 in `ping` (host-pinned) and waits until the host thread answers it in `pong`.
MORI_GLOBAL void FlagRoundTripKernel(uint64_t* ping, const uint64_t* pong, uint32_t warmup, uint32_t iters,
                                     uint64_t* times, uint64_t timeoutNs) {
  for (uint32_t i = 0; i < warmup + iters; ++i) {
    uint64_t start = core::DeviceWallClockNs();
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::System>(ping, uint64_t{i} + 1);
    WaitForAnswer<core::MemoryOrder::Relaxed>(pong, uint64_t{i} + 1, timeoutNs);
    uint64_t end = core::DeviceWallClockNs();
    if (i >= warmup) times[i - warmup] = end - start;
  }
}

#if MORI_GPU_COMPILER
// What one push is made of, in SM cycles (clock64), each step timed alone `iters` times: costs[step * iters + i].
constexpr int kPushSteps = 9;
constexpr const char* kPushStepNames[kPushSteps] = {
    "fetch-add, device scope",         "acquire load, device scope",    "release fence, system scope",
    "release fence, device scope",     "fence + 16-byte store, pinned", "16-byte relaxed store, pinned",
    "push (after writes: the default)", "push (payload only)",      "push (after GPU-memory writes)"};
MORI_GLOBAL void PushCostsKernel(core::FifoDeviceHandle fifo, uint64_t* word, core::ProxyTrigger* pinned, uint32_t iters,
                                uint64_t* costs) {
  for (uint32_t i = 0; i < iters; ++i) {
    long long t[kPushSteps + 1];
    t[0] = clock64();
    uint64_t v = core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(word, uint64_t{1});
    if (v == ~0ull) word[1] = 0;  // uses the value, so the clock is read after it arrived
    t[1] = clock64();
    uint64_t w = core::AtomicLoad<core::MemoryOrder::Acquire, core::Scope::Device>(word + 16);
    if (w == ~0ull) word[1] = 0;
    t[2] = clock64();
    core::AtomicFence<core::MemoryOrder::AcqRel, core::Scope::System>();
    t[3] = clock64();
    core::AtomicFence<core::MemoryOrder::AcqRel, core::Scope::Device>();
    t[4] = clock64();
    core::AtomicFence<core::MemoryOrder::Release, core::Scope::System>();
    core::FifoDeviceHandle::StoreSlot(pinned, v, w);
    t[5] = clock64();
    core::FifoDeviceHandle::StoreSlot(pinned + 1, v, w);
    t[6] = clock64();
    fifo.Push(core::ProxyTrigger{3 * uint64_t{i} + 1, 0});
    t[7] = clock64();
    fifo.Push(core::ProxyTrigger{3 * uint64_t{i} + 2, 0}, core::FifoOrder::PayloadOnly);
    t[8] = clock64();
    fifo.Push(core::ProxyTrigger{3 * uint64_t{i} + 3, 0}, core::FifoOrder::AfterDeviceWrites);
    t[9] = clock64();
    for (int k = 0; k < kPushSteps; ++k) costs[k * iters + i] = static_cast<uint64_t>(t[k + 1] - t[k]);
  }
}
#endif

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
    core::GpuBuffer times(sizeof(uint64_t) * o.iters);
    core::GpuBuffer pushTimes(sizeof(uint64_t) * o.iters);
    // The kernels' timings, copied from device memory once each kernel is done.
    auto copied = [&o](const core::GpuBuffer& b) {
      std::vector<uint64_t> v(o.iters);
      MORI_CHECK_GPU(core::GpuMemcpy(v.data(), b.Data(), sizeof(uint64_t) * o.iters));
      return v;
    };
    const uint64_t timeoutNs = static_cast<uint64_t>(core::TimeoutSeconds() * 1e9);
    core::PreloadKernels(RoundTripKernel, FlagRoundTripKernel, FloodKernel);

    std::printf("FIFO round trip (%u slots, %u iterations after %u warm-up)\n", o.fifoSize, o.iters, o.warmup);
    std::printf("  %-34s %10s %10s %10s\n", "mode", "median us", "p99 us", "min us");
    {
      // The floor: no FIFO, no proxy; a host thread echoes ping into pong.
      core::GpuBuffer flags(128, core::MemoryType::HostPinned);
      std::memset(flags.Data(), 0, flags.Bytes());
      uint64_t* ping = flags.DataAs<uint64_t>();
      uint64_t* pong = ping + 8;  // another cache line
      const uint64_t last = uint64_t{o.warmup} + o.iters;
      std::thread echo([&] {
        uint64_t seen = 0;
        auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(core::TimeoutSeconds());
        while (seen < last && std::chrono::steady_clock::now() < deadline) {
          uint64_t v = core::AtomicLoad<core::MemoryOrder::Acquire>(ping);
          if (v != seen) {
            core::AtomicStore<core::MemoryOrder::Release>(pong, v);
            seen = v;
          }
        }
      });
      core::LaunchKernel(FlagRoundTripKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, ping,
                         static_cast<const uint64_t*>(pong), o.warmup, o.iters, times.DataAs<uint64_t>(), timeoutNs);
      Check();
      echo.join();
      std::vector<uint64_t> t = copied(times);
      std::printf("  %-34s %10.2f %10.2f %10.2f\n", "pinned flag -> host -> flag (floor)", Percentile(t, 0.5),
                  Percentile(t, 0.99), Percentile(t, 0.0));
    }
    for (const RoundTripMode& mode : kRoundTrips) {
      EchoProxy proxy(o.fifoSize, answer.DataAs<uint64_t>());
      std::memset(answer.Data(), 0, answer.Bytes());
      proxy.StartProxy();
      core::LaunchKernel(RoundTripKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, proxy.FifoHandle(), mode.wait, mode.order, o.warmup,
                         o.iters, answer.DataAs<uint64_t>(), times.DataAs<uint64_t>(), pushTimes.DataAs<uint64_t>(),
                         timeoutNs);
      Check();
      proxy.StopProxy();
      std::vector<uint64_t> t = copied(times);
      std::printf("  %-34s %10.2f %10.2f %10.2f\n", mode.name, Percentile(t, 0.5), Percentile(t, 0.99),
                  Percentile(t, 0.0));
      std::vector<uint64_t> p = copied(pushTimes);
      std::printf("  %-34s %10.2f %10.2f %10.2f\n", "  of which the push itself", Percentile(p, 0.5), Percentile(p, 0.99),
                  Percentile(p, 0.0));
    }

#if MORI_GPU_COMPILER
    {
      EchoProxy proxy(o.fifoSize, answer.DataAs<uint64_t>());
      proxy.StartProxy();
      const uint32_t n = std::min<uint32_t>(o.iters, 1000);
      core::GpuBuffer costs(sizeof(uint64_t) * n * kPushSteps);  // device memory, as the round trips' timings
      uint64_t* word = nullptr;
      MORI_CHECK_GPU(core::GpuMalloc(reinterpret_cast<void**>(&word), 256));
      MORI_CHECK_GPU(core::GpuMemset(word, 0, 256));
      core::GpuBuffer scratch(64, core::MemoryType::HostPinned);  // the store's target, like a FIFO slot
      core::LaunchKernel(PushCostsKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, proxy.FifoHandle(), word,
                         scratch.DataAs<core::ProxyTrigger>(), n, costs.DataAs<uint64_t>());
      Check();
      proxy.StopProxy();
      MORI_CHECK_GPU(core::GpuFree(word));
      std::printf("\nOne push, step by step (SM cycles, %u times each)\n  %-34s %10s %10s\n", n, "step", "median",
                  "p99");
      std::vector<uint64_t> all(static_cast<size_t>(n) * kPushSteps);
      MORI_CHECK_GPU(core::GpuMemcpy(all.data(), costs.Data(), costs.Bytes()));
      for (int k = 0; k < kPushSteps; ++k) {
        std::vector<uint64_t> c(all.begin() + k * n, all.begin() + (k + 1) * n);
        std::sort(c.begin(), c.end());
        std::printf("  %-34s %10llu %10llu\n", kPushStepNames[k], static_cast<unsigned long long>(c[n / 2]),
                    static_cast<unsigned long long>(c[n * 99 / 100]));
      }
    }
#endif

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
