// The proxy FIFO and the proxy thread in one process: the trigger codec, lap parity, many producers against a
// slow consumer, multi-slot pushes, a handler that is not ready or throws, draining at StopProxy, bad input.
#include "mori/channels/fifo.hpp"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/port_channel.hpp"
#include "mori/channels/proxy.hpp"
#include "mori/channels/proxy_trigger.hpp"
#include "registered_memory_impl.hpp"
#include "service_thread.hpp"

namespace mori::core {
namespace {

// ---- the trigger codec ----

static_assert(offsetof(ProxyTrigger, fst) == 0 && offsetof(ProxyTrigger, snd) == 8, "fst, then snd");
static_assert(DecodePortRequest(EncodePortRequest(PortRequest{7, 1023, 511, 511, kMaxTriggerOffset, kMaxTriggerOffset,
                                                              kMaxTriggerSize}))
                      .semaphoreId == 1023,
              "the codec is usable in constant expressions");

TEST(ProxyTriggerTest, LayoutIsFixed) {
  EXPECT_EQ(kTriggerSrcMemoryIdShift, 32u);
  EXPECT_EQ(kTriggerDstMemoryIdShift, 41u);
  EXPECT_EQ(kTriggerTypeShift, 50u);
  EXPECT_EQ(kTriggerSemaphoreIdShift, 53u);
  EXPECT_EQ(kTriggerLapBitShift, 63u);
  EXPECT_EQ(kMaxProxyMemories, 512u);
  EXPECT_EQ(kMaxProxySemaphores, 1024u);
  EXPECT_EQ(kMaxTriggerSize, 0xFFFFFFFFull);
  // Lap 0 carries 1, so zeroed memory is empty; the parity flips every `size` slots.
  EXPECT_EQ(TriggerLapBit(0, 4), kTriggerLapBit);
  EXPECT_EQ(TriggerLapBit(3, 4), kTriggerLapBit);
  EXPECT_EQ(TriggerLapBit(4, 4), 0u);
  EXPECT_EQ(TriggerLapBit(7, 4), 0u);
  EXPECT_EQ(TriggerLapBit(8, 4), kTriggerLapBit);
  EXPECT_EQ(TriggerLapBit((uint64_t{1} << 40) + 1, 2), kTriggerLapBit);
  // Every FIFO size there may be, around every lap boundary of the first laps and of late ones (the slot
  // counter never wraps): the parity of slot / size, which the bit test replaced.
  for (uint32_t size = 2; size != 0 && size <= (1u << 24); size <<= 1) {
    for (uint64_t lap : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{3}, (uint64_t{1} << 40) / size + 1,
                         (uint64_t{1} << 62) / size - 1}) {
      for (uint64_t slot = lap * size - (lap > 0 ? 2 : 0); slot < (lap + 1) * size + 2; ++slot) {
        if (slot >= lap * size + 3 && slot + 3 < (lap + 1) * size) slot = (lap + 1) * size - 3;  // the edges only
        const uint64_t want = ((slot / size) % 2 == 0) ? kTriggerLapBit : 0u;
        ASSERT_EQ(TriggerLapBit(slot, size), want) << "slot " << slot << " in a FIFO of " << size << " slots";
      }
    }
  }
}

// Aliases: nvcc's host pass rewrites a member-pointer declarator with parentheses that -Wparentheses rejects.
using WideField = uint64_t PortRequest::*;
using NarrowField = uint32_t PortRequest::*;

struct Field {
  const char* name;
  uint64_t max;
  WideField wide;  // set for the 64-bit fields
  NarrowField narrow;
};

std::vector<Field> Fields() {
  return {{"size", kMaxTriggerSize, &PortRequest::size, nullptr},
          {"srcOffset", kMaxTriggerOffset, &PortRequest::srcOffset, nullptr},
          {"dstOffset", kMaxTriggerOffset, &PortRequest::dstOffset, nullptr},
          {"srcMemoryId", kMaxProxyMemories - 1, nullptr, &PortRequest::srcMemoryId},
          {"dstMemoryId", kMaxProxyMemories - 1, nullptr, &PortRequest::dstMemoryId},
          {"type", (1u << kTriggerTypeBits) - 1, nullptr, &PortRequest::type},
          {"semaphoreId", kMaxProxySemaphores - 1, nullptr, &PortRequest::semaphoreId}};
}

void Set(PortRequest& r, const Field& f, uint64_t v) {
  if (f.wide != nullptr) {
    r.*f.wide = v;
  } else {
    r.*f.narrow = static_cast<uint32_t>(v);
  }
}
uint64_t Get(const PortRequest& r, const Field& f) { return f.wide != nullptr ? r.*f.wide : r.*f.narrow; }

TEST(ProxyTriggerTest, EveryFieldRoundTripsAtItsExtremesWithoutBleeding) {
  std::vector<Field> fields = Fields();
  for (const Field& f : fields) {
    for (uint64_t v :
         {uint64_t{0}, uint64_t{1}, f.max, f.max / 2 + 1, f.max / 2, uint64_t{0x5555555555555555ull & f.max}}) {
      // Alone among zeros.
      PortRequest r{};
      Set(r, f, v);
      ProxyTrigger t = EncodePortRequest(r);
      EXPECT_EQ(t.snd & kTriggerLapBit, 0u) << f.name << " = " << v << " reached the lap bit";
      PortRequest d = DecodePortRequest(t);
      for (const Field& g : fields) {
        EXPECT_EQ(Get(d, g), &g == &f ? v : 0u) << f.name << " = " << v << " decoded into " << g.name;
      }
      // Among neighbours at their maximum.
      PortRequest full{};
      for (const Field& g : fields) Set(full, g, g.max);
      Set(full, f, v);
      t = EncodePortRequest(full);
      EXPECT_EQ(t.snd & kTriggerLapBit, 0u);
      d = DecodePortRequest(t);
      for (const Field& g : fields) {
        EXPECT_EQ(Get(d, g), &g == &f ? v : g.max) << f.name << " = " << v << " beside full fields: " << g.name;
      }
    }
  }
  // Every field at its maximum fills the 127 bits exactly.
  PortRequest full{};
  for (const Field& g : fields) Set(full, g, g.max);
  ProxyTrigger t = EncodePortRequest(full);
  EXPECT_EQ(t.fst, ~0ull);
  EXPECT_EQ(t.snd, ~kTriggerLapBit);
  // A value wider than its field is cut to the field, never spilling into the next one.
  PortRequest wide{};
  wide.size = kMaxTriggerSize + 2;
  wide.dstOffset = kMaxTriggerOffset + 1;
  wide.srcMemoryId = kMaxProxyMemories + 3;
  wide.semaphoreId = kMaxProxySemaphores;
  PortRequest d = DecodePortRequest(EncodePortRequest(wide));
  EXPECT_EQ(d.size, 1u);
  EXPECT_EQ(d.srcOffset, 0u);
  EXPECT_EQ(d.dstOffset, 0u);
  EXPECT_EQ(d.srcMemoryId, 3u);
  EXPECT_EQ(d.dstMemoryId, 0u);
  EXPECT_EQ(d.semaphoreId, 0u);
  EXPECT_EQ(EncodePortRequest(wide).snd & kTriggerLapBit, 0u);
}

// ---- the FIFO on its own (the host plays the producer: the ring is host memory) ----

TEST(FifoTest, BadSizesAreRefused) {
  for (uint32_t size : {0u, 1u, 3u, 6u, 1000u, 0x80000001u}) {
    try {
      Fifo fifo(size);
      ADD_FAILURE() << "a FIFO of " << size << " slots was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
      EXPECT_NE(std::string(e.what()).find("power of two"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(Fifo(8, -1.0), Error);
  Fifo two(2);
  EXPECT_EQ(two.Size(), 2u);
  EXPECT_EQ(two.Head(), 0u);
  EXPECT_EQ(two.Tail(), 0u);
  FifoDeviceHandle h = two.DeviceHandle();
  EXPECT_EQ(h.size, 2u);
  EXPECT_GT(h.timeoutNs, 0u);
  EXPECT_EQ(Fifo(4, 2.5).DeviceHandle().timeoutNs, 2'500'000'000ull);
}

ProxyTrigger Payload(uint64_t slot) { return ProxyTrigger{slot * 0x9E3779B97F4A7C15ull, slot ^ 0x2545F4914F6CDD1Dull}; }

// Writes `t` into `slot` as a producer would, with the lap bit of that slot (or, `staleLap`, of the lap before).
void HostWrite(const FifoDeviceHandle& h, uint64_t slot, ProxyTrigger t, bool staleLap = false) {
  ProxyTrigger* p = &h.triggers[slot & (h.size - 1)];
  uint64_t lap = TriggerLapBit(slot, h.size) ^ (staleLap ? kTriggerLapBit : 0);
  AtomicStore<MemoryOrder::Relaxed>(&p->fst, t.fst);
  AtomicStore<MemoryOrder::Release>(&p->snd, (t.snd & ~kTriggerLapBit) | lap);
}

TEST(FifoTest, LapParityOverThousandsOfLaps) {
  Fifo fifo(2);
  FifoDeviceHandle h = fifo.DeviceHandle();
  ProxyTrigger out{};
  EXPECT_FALSE(fifo.Poll(&out)) << "a new FIFO reads empty";
  EXPECT_FALSE(fifo.Poll(&out, 1));
  EXPECT_THROW(fifo.Poll(&out, 2), Error) << "a peek beyond the ring";
  EXPECT_THROW(fifo.Pop(0), Error);
  EXPECT_THROW(fifo.Pop(3), Error);
  uint64_t slot = 0;
  while (slot < 20000) {
    uint32_t n = slot % 3 == 0 ? 2 : 1;  // some requests of two slots
    for (uint32_t k = 0; k < n; ++k) {
      // The slot holds its previous lap's trigger (or zeros): not new; nor is a write with the old parity.
      ASSERT_FALSE(fifo.Poll(&out, k)) << "slot " << slot + k << " read stale";
      HostWrite(h, slot + k, Payload(slot + k), /*staleLap=*/true);
      ASSERT_FALSE(fifo.Poll(&out, k)) << "slot " << slot + k << " read with the previous lap's parity";
      HostWrite(h, slot + k, Payload(slot + k));
    }
    for (uint32_t k = 0; k < n; ++k) {
      ASSERT_TRUE(fifo.Poll(&out, k)) << "slot " << slot + k << " written but not seen";
      EXPECT_EQ(out.fst, Payload(slot + k).fst);
      EXPECT_EQ(out.snd, Payload(slot + k).snd & ~kTriggerLapBit) << "the copy has the lap bit cleared";
    }
    fifo.Pop(n);
    slot += n;
    ASSERT_EQ(fifo.Tail(), slot);
  }
}

TEST(FifoTest, FailureNamesAgreeWithErrorCodes) {
  for (uint32_t c = 0; c <= static_cast<uint32_t>(ErrorCode::Internal); ++c) {
    EXPECT_STREQ(FifoFailureName(c + 1), ErrorCodeName(static_cast<ErrorCode>(c))) << "code " << c;
  }
  EXPECT_STREQ(FifoFailureName(kFifoFailedUnknown), "unknown error");
}

// ---- the proxy thread with kernels as producers ----

// A trigger's check word: a function of its payload, so a torn or stale read shows.
MORI_HOST_DEVICE_INLINE uint64_t CheckWord(uint64_t fst) {
  return (fst * 0x9E3779B97F4A7C15ull ^ 0x1234567ull) & ~kTriggerLapBit;
}

// Every order of push takes turns in the producer kernels: a payload-only push writes its slot without a
// release fence and one after GPU-memory writes with a device-scope one (on CUDA); each must arrive as whole
// and in as good order as the default.
MORI_HOST_DEVICE_INLINE FifoOrder OrderOf(uint32_t seq) {
  return seq % 3 == 1 ? FifoOrder::PayloadOnly : seq % 3 == 2 ? FifoOrder::AfterDeviceWrites : FifoOrder::AfterWrites;
}

// Each thread pushes (thread, sequence) triggers; every `syncEvery`-th push waits until the proxy popped it.
MORI_GLOBAL void PushKernel(FifoDeviceHandle fifo, uint32_t perThread, uint32_t syncEvery) {
  uint64_t tid = GlobalThreadIdx();
  for (uint32_t seq = 0; seq < perThread; ++seq) {
    uint64_t fst = tid << 32 | seq;
    uint64_t slot = fifo.Push(ProxyTrigger{fst, CheckWord(fst)}, OrderOf(seq));
    if (syncEvery != 0 && (seq + 1) % syncEvery == 0) fifo.Sync(slot);
  }
}

// Requests of 1 to 4 slots: part k of request (thread, seq) of n parts carries thread << 32 | seq << 8 | k << 4 | n.
MORI_GLOBAL void MultiPushKernel(FifoDeviceHandle fifo, uint32_t perThread) {
  uint64_t tid = GlobalThreadIdx();
  ProxyTrigger items[4];
  for (uint32_t seq = 0; seq < perThread; ++seq) {
    uint32_t n = 1 + static_cast<uint32_t>((tid + seq) % 4);
    for (uint32_t k = 0; k < n; ++k) {
      uint64_t fst = tid << 32 | uint64_t{seq} << 8 | k << 4 | n;
      items[k] = ProxyTrigger{fst, CheckWord(fst)};
    }
    fifo.Push(items, n, OrderOf(seq));
  }
}

MORI_GLOBAL void PushOneKernel(FifoDeviceHandle fifo, ProxyTrigger trigger) { fifo.Push(trigger); }

// A proxy whose handler is a test's function; it records what it is given.
class TestProxy : public Proxy {
 public:
  using Handler = std::function<uint32_t(TestProxy&, const ProxyTrigger&)>;
  TestProxy(uint32_t fifoSize, Handler handler) : Proxy(fifoSize), handler_(std::move(handler)) {}
  ~TestProxy() override { StopProxyWithoutDraining(); }

  // Written on the proxy thread; read after StopProxy.
  std::vector<ProxyTrigger> handled;
  uint64_t calls = 0;
  uint64_t notReady = 0;
  std::atomic<uint64_t> idles{0};

  static uint32_t Record(TestProxy& p, const ProxyTrigger& t) {
    p.handled.push_back(t);
    return 1;
  }

 protected:
  uint32_t HandleTrigger(const ProxyTrigger& t) override {
    ++calls;
    return handler_(*this, t);
  }
  void OnIdle() override { idles.fetch_add(1, std::memory_order_relaxed); }

 private:
  Handler handler_;
};

constexpr unsigned kBlocks = 4;
constexpr unsigned kThreadsPerBlock = 16;  // 64 pushers
constexpr uint32_t kPushers = kBlocks * kThreadsPerBlock;

// Every pusher's triggers arrived once each, whole, in the order it pushed them.
void ExpectEveryPusherInOrder(const std::vector<ProxyTrigger>& got, uint32_t pushers, uint32_t perThread,
                              const std::function<uint32_t(uint64_t fst)>& seqOf) {
  std::vector<uint32_t> next(pushers, 0);
  for (size_t i = 0; i < got.size(); ++i) {
    const ProxyTrigger& t = got[i];
    uint32_t tid = static_cast<uint32_t>(t.fst >> 32);
    ASSERT_LT(tid, pushers) << "trigger " << i << " names no pusher: fst " << std::hex << t.fst;
    ASSERT_EQ(t.snd, CheckWord(t.fst)) << "trigger " << i << " is torn or stale";
    ASSERT_EQ(seqOf(t.fst), next[tid]) << "trigger " << i << " of pusher " << tid
                                       << " is out of order (lost, duplicated or reordered)";
    ++next[tid];
  }
  for (uint32_t tid = 0; tid < pushers; ++tid) EXPECT_EQ(next[tid], perThread) << "pusher " << tid;
  EXPECT_EQ(got.size(), size_t{pushers} * perThread);
}

uint32_t LowSeq(uint64_t fst) { return static_cast<uint32_t>(fst); }

void Synchronize() {
  ASSERT_EQ(GpuGetLastError(), kGpuSuccess);
  ASSERT_EQ(GpuDeviceSynchronize(), kGpuSuccess);
}

TEST(ProxyTest, ManyProducersAgainstASlowConsumer) {
  const uint32_t perThread = MORI_BACKEND_HOST ? 150 : 2000;
  TestProxy proxy(8, [](TestProxy& p, const ProxyTrigger& t) {
    if (p.handled.size() % 61 == 60) std::this_thread::sleep_for(std::chrono::microseconds(200));
    return TestProxy::Record(p, t);
  });
  PreloadKernels(PushKernel);
  proxy.StartProxy();
  EXPECT_TRUE(proxy.Running());
  LaunchKernel(PushKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, proxy.FifoHandle(), perThread, 16u);
  Synchronize();
  EXPECT_EQ(proxy.GetFifo().Head(), uint64_t{kPushers} * perThread);
  proxy.StopProxy();
  EXPECT_FALSE(proxy.Running());
  EXPECT_EQ(proxy.Handled(), uint64_t{kPushers} * perThread);
  ExpectEveryPusherInOrder(proxy.handled, kPushers, perThread, LowSeq);
  EXPECT_GT(proxy.idles.load(), 0u) << "OnIdle runs at least once, before the thread ends";
}

using test::ThreadNames;

// Waits (bounded, 5 s) until a thread of this process is named `name` or, with `present` false, none is.
bool WaitForThreadNamed(const std::string& name, bool present) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    std::vector<std::string> names = ThreadNames();
    bool found = std::find(names.begin(), names.end(), name) != names.end();
    if (found == present) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// top -H, ps -L, gdb and perf show the proxy's thread by its name and GPU, beside the application's threads.
TEST(ProxyTest, ItsThreadIsNamedAfterItsGpu) {
  if (ThreadNames().empty()) GTEST_SKIP() << "no /proc/self/task here";
  int device = 0;
  ASSERT_EQ(GpuGetDevice(&device), kGpuSuccess);
  const std::string name = "mori-proxy:" + std::to_string(device);
  ASSERT_TRUE(WaitForThreadNamed(name, false)) << "a thread named " << name << " before the proxy started";
  TestProxy proxy(8, TestProxy::Record);
  proxy.StartProxy();
  EXPECT_TRUE(WaitForThreadNamed(name, true)) << "no thread named " << name << " within 5 s of StartProxy";
  proxy.StopProxy();
  EXPECT_TRUE(WaitForThreadNamed(name, false)) << "the thread named " << name << " outlived StopProxy";
}

// The thread id of this process's thread named `name`, or 0.
pid_t ThreadNamed(const std::string& name) {
  for (auto& [tid, got] : test::Threads()) {
    if (got == name) return tid;
  }
  return 0;
}

// Started from a thread bound to one CPU (mpirun binds each of 2 or fewer ranks to a core), the proxy runs on
// other CPUs: the application's thread holds that one (spinning in cudaDeviceSynchronize, it left a proxy beside
// it about 1% of the CPU on an H200, and an atomics example through the proxy took 45 s instead of 3).
TEST(ProxyTest, ItsThreadLeavesACpuTheApplicationIsBoundTo) {
  cpu_set_t all;
  CPU_ZERO(&all);
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(all), &all), 0);
  if (CPU_COUNT(&all) < 2 || ThreadNames().empty()) GTEST_SKIP() << "one CPU allowed, or no /proc/self/task";
  int bound = 0;
  while (!CPU_ISSET(bound, &all)) ++bound;
  int device = 0;
  ASSERT_EQ(GpuGetDevice(&device), kGpuSuccess);
  const std::string name = "mori-proxy:" + std::to_string(device);
  cpu_set_t proxyCpus;
  CPU_ZERO(&proxyCpus);
  bool sawProxy = false;
  // From a thread of its own, so that this test's thread keeps its CPUs whatever happens.
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(bound, &one);
    ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);
    TestProxy proxy(8, TestProxy::Record);
    proxy.StartProxy();
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      pid_t tid = ThreadNamed(name);
      // The name is set before the placement: wait until the CPUs changed, or the deadline.
      if (tid != 0 && sched_getaffinity(tid, sizeof(proxyCpus), &proxyCpus) == 0 && !CPU_EQUAL(&proxyCpus, &one)) {
        sawProxy = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    proxy.StopProxy();
  }).join();
  ASSERT_TRUE(sawProxy) << "the proxy thread stayed on CPU " << bound << " alone, with the thread that started it";
  EXPECT_FALSE(CPU_ISSET(bound, &proxyCpus)) << "proxy on CPUs " << CpuListText(proxyCpus);
  EXPECT_GE(CPU_COUNT(&proxyCpus), 1);
}

// More pushers waiting than the ring and the window of tail readers hold: most wait on tailSeen in device
// memory (FifoDeviceHandle::kTailReadersWindow) and must still each get room, in slot order, with nothing lost.
// 4,096 GPU pushers through 4 slots move about 0.1 million triggers a second on an H200 (fifo_bench: 5.9
// million with 32 slots, 55 with 1,024), so each pushes 40 (400 took 123-138 s there, the longest test of the
// CUDA suite; each pusher still waits far from the front 40 times).
TEST(ProxyTest, PushersFarFromTheFrontOfAFullRingAllGetThrough) {
  const unsigned threads = MORI_BACKEND_HOST ? 64 : 256, blocks = MORI_BACKEND_HOST ? 4 : 16;
  const uint32_t pushers = threads * blocks, perThread = MORI_BACKEND_HOST ? 25 : 40;
  static_assert(FifoDeviceHandle::kTailReadersWindow + 4 < 256, "most pushers are beyond the readers' window");
  TestProxy proxy(4, [](TestProxy& p, const ProxyTrigger& t) {
    if (p.handled.size() % 97 == 96) std::this_thread::sleep_for(std::chrono::microseconds(100));
    return TestProxy::Record(p, t);
  });
  PreloadKernels(PushKernel);
  proxy.StartProxy();
  LaunchKernel(PushKernel, Dim3(blocks), Dim3(threads), 0, nullptr, proxy.FifoHandle(), perThread, 0u);
  Synchronize();
  proxy.StopProxy();
  EXPECT_EQ(proxy.Handled(), uint64_t{pushers} * perThread);
  ExpectEveryPusherInOrder(proxy.handled, pushers, perThread, LowSeq);
}

TEST(ProxyTest, AFifoOfTwoThroughThousandsOfLaps) {
  const uint32_t perThread = MORI_BACKEND_HOST ? 1500 : 5000;
  TestProxy proxy(2, TestProxy::Record);
  PreloadKernels(PushKernel);
  proxy.StartProxy();
  LaunchKernel(PushKernel, Dim3(2), Dim3(2), 0, nullptr, proxy.FifoHandle(), perThread, 0u);
  Synchronize();
  proxy.StopProxy();
  EXPECT_EQ(proxy.Handled(), 4ull * perThread);
  ExpectEveryPusherInOrder(proxy.handled, 4, perThread, LowSeq);
}

TEST(ProxyTest, MultiSlotPushesArriveContiguousAndInOrder) {
  const uint32_t perThread = MORI_BACKEND_HOST ? 60 : 500;
  TestProxy proxy(8, [](TestProxy& p, const ProxyTrigger& first) -> uint32_t {
    uint32_t n = first.fst & 0xF;
    MORI_CHECK(((first.fst >> 4) & 0xF) == 0 && n >= 1 && n <= 4, ErrorCode::Internal,
               "slot %llu does not start a request: fst 0x%llx", static_cast<unsigned long long>(p.Handled()),
               static_cast<unsigned long long>(first.fst));
    for (uint32_t k = 1; k < n; ++k) {
      ProxyTrigger part{};
      if (!p.GetFifo().Poll(&part, k)) {
        ++p.notReady;
        return 0;  // the rest of the request is being written
      }
      MORI_CHECK(part.fst == (first.fst | uint64_t{k} << 4) && part.snd == CheckWord(part.fst), ErrorCode::Internal,
                 "part %u of request fst 0x%llx is fst 0x%llx: a request was split or torn", k,
                 static_cast<unsigned long long>(first.fst), static_cast<unsigned long long>(part.fst));
    }
    p.handled.push_back(first);
    return n;
  });
  PreloadKernels(MultiPushKernel);
  proxy.StartProxy();
  LaunchKernel(MultiPushKernel, Dim3(kBlocks), Dim3(kThreadsPerBlock), 0, nullptr, proxy.FifoHandle(), perThread);
  Synchronize();
  uint64_t slots = proxy.GetFifo().Head();
  proxy.StopProxy();
  EXPECT_EQ(proxy.Handled(), slots);
  ExpectEveryPusherInOrder(proxy.handled, kPushers, perThread,
                           [](uint64_t fst) { return static_cast<uint32_t>(fst >> 8 & 0xFFFFFF); });
}

TEST(ProxyTest, AHandlerThatIsNotReadyIsCalledAgain) {
  TestProxy proxy(4, [](TestProxy& p, const ProxyTrigger& t) -> uint32_t {
    if (p.calls % 3 != 0) return 0;  // twice not ready, then handled
    return TestProxy::Record(p, t);
  });
  PreloadKernels(PushKernel);
  proxy.StartProxy();
  LaunchKernel(PushKernel, Dim3(1), Dim3(1), 0, nullptr, proxy.FifoHandle(), 50u, 0u);
  Synchronize();
  proxy.StopProxy();
  EXPECT_EQ(proxy.calls, 150u);
  ExpectEveryPusherInOrder(proxy.handled, 1, 50, LowSeq);
}

TEST(ProxyTest, StopProxyDrainsWhatWasPushedAndTheProxyRestarts) {
  TestProxy proxy(64, [](TestProxy& p, const ProxyTrigger& t) {
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    return TestProxy::Record(p, t);
  });
  PreloadKernels(PushKernel);
  proxy.StopProxy();  // not started: nothing to do
  for (uint32_t round = 1; round <= 2; ++round) {
    proxy.StartProxy();
    EXPECT_THROW(proxy.StartProxy(), Error) << "a second thread on one FIFO";
    // 64 triggers fit the ring, so the kernel ends long before the proxy has handled them.
    LaunchKernel(PushKernel, Dim3(2), Dim3(4), 0, nullptr, proxy.FifoHandle(), 8u, 0u);
    Synchronize();
    proxy.StopProxy();
    EXPECT_EQ(proxy.Handled(), 64u * round);
    EXPECT_EQ(proxy.handled.size(), 64u * round);
  }
  std::vector<ProxyTrigger> second(proxy.handled.begin() + 64, proxy.handled.end());
  proxy.handled.resize(64);
  ExpectEveryPusherInOrder(proxy.handled, 8, 8, LowSeq);
  ExpectEveryPusherInOrder(second, 8, 8, LowSeq);
}

// Waits (bounded) until the proxy thread has ended.
void WaitUntilStopped(const Proxy& proxy) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (proxy.Running() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(proxy.Running()) << "the proxy thread did not end after its handler threw";
}

TEST(ProxyTest, AHandlerThatThrowsFailsTheProxyAndStopProxyRethrows) {
  TestProxy proxy(16, [](TestProxy& p, const ProxyTrigger& t) -> uint32_t {
    if (LowSeq(t.fst) == 5) MORI_THROW(ErrorCode::Protocol, "test handler refuses trigger seq 5");
    return TestProxy::Record(p, t);
  });
  PreloadKernels(PushKernel);
  proxy.StartProxy();
  LaunchKernel(PushKernel, Dim3(1), Dim3(1), 0, nullptr, proxy.FifoHandle(), 10u, 0u);  // no wait: 10 fit
  Synchronize();
  WaitUntilStopped(proxy);
  EXPECT_EQ(proxy.Handled(), 5u) << "the failing trigger and those after it are not popped";
  EXPECT_EQ(AtomicLoad(proxy.FifoHandle().proxyFailed), 1 + static_cast<uint32_t>(ErrorCode::Protocol))
      << "the producers are told, with the kind of failure";
  try {
    proxy.StopProxy();
    ADD_FAILURE() << "StopProxy did not rethrow the handler's error";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::Protocol);
    EXPECT_NE(std::string(e.what()).find("refuses trigger seq 5"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(proxy.StopProxy()) << "the error is reported once";
  EXPECT_THROW(proxy.StartProxy(), Error) << "a failed proxy does not start again";
}

TEST(ProxyTest, StopProxyTimesOutNamingTheSlotsItWaitedFor) {
  test::ScopedEnv timeout("MORI_TIMEOUT_S", "1");
  TestProxy proxy(4, [](TestProxy&, const ProxyTrigger&) { return 0u; });  // never ready
  PreloadKernels(PushKernel);
  proxy.StartProxy();
  LaunchKernel(PushKernel, Dim3(1), Dim3(1), 0, nullptr, proxy.FifoHandle(), 2u, 0u);
  Synchronize();
  try {
    proxy.StopProxy();
    ADD_FAILURE() << "StopProxy returned with slots unhandled";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("slots [0, 2)"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(proxy.Running());
  EXPECT_EQ(AtomicLoad(proxy.FifoHandle().proxyFailed), 1 + static_cast<uint32_t>(ErrorCode::Timeout));
}

// On a GPU a trap ends the context (every later test of the process would fail), so these run on HOST.
class ProducerTrapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!MORI_BACKEND_HOST) GTEST_SKIP() << "device traps end the GPU context; the HOST backend tests them";
  }

  // Runs `launch` and returns what went to stderr; the launch must fail.
  static std::string RunFailing(const std::function<void()>& launch) {
    ::testing::internal::CaptureStderr();
    launch();
    GpuStatus launched = GpuGetLastError();
    GpuStatus synced = GpuDeviceSynchronize();
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(launched != kGpuSuccess || synced != kGpuSuccess) << "the kernel should have trapped";
    return err;
  }
};

TEST_F(ProducerTrapTest, ProducersWaitingOnAFailedProxyTrapNamingIt) {
  TestProxy proxy(4, [](TestProxy& p, const ProxyTrigger& t) -> uint32_t {
    if (t.fst == 3) MORI_THROW(ErrorCode::Internal, "test handler fails on thread 0's trigger 3");
    return TestProxy::Record(p, t);
  });
  proxy.StartProxy();
  // Every push waits until handled, so the pushers are in Push (ring full) or Sync when the proxy fails.
  std::string err =
      RunFailing([&] { LaunchKernel(PushKernel, Dim3(2), Dim3(4), 0, nullptr, proxy.FifoHandle(), 100u, 1u); });
  EXPECT_NE(err.find("the proxy serving this FIFO failed (internal error at the trigger in slot "), std::string::npos)
      << "the producers name the kind of failure and the trigger: " << err;
  EXPECT_NE(err.find("test handler fails"), std::string::npos) << "the proxy's log names the error: " << err;
  EXPECT_THROW(proxy.StopProxy(), Error);
}

TEST_F(ProducerTrapTest, ProducersWithoutAProxyTimeOutNamingIt) {
  // A full ring: the third push waits for room.
  Fifo full(2, 0.5);
  std::string err =
      RunFailing([&] { LaunchKernel(PushKernel, Dim3(1), Dim3(1), 0, nullptr, full.DeviceHandle(), 3u, 0u); });
  EXPECT_NE(err.find("for room for slot 2"), std::string::npos) << err;
  EXPECT_NE(err.find("is the proxy running?"), std::string::npos) << err;
  // A push that fits, then a wait for it to be handled. (A fresh FIFO: the first one's ring stays full, so a
  // push there would wait for room again.)
  Fifo fresh(2, 0.5);
  err = RunFailing([&] { LaunchKernel(PushKernel, Dim3(1), Dim3(1), 0, nullptr, fresh.DeviceHandle(), 1u, 1u); });
  EXPECT_NE(err.find("for the proxy to handle slot 0 (0 handled)"), std::string::npos) << err;
  EXPECT_NE(err.find("is the proxy running?"), std::string::npos) << err;
}

// ---- ProxyService without connections: its tables and the requests it refuses ----

RegisteredMemory FakeMemory(size_t bytes) {
  auto impl = std::make_shared<RegisteredMemory::Impl>();
  impl->size = bytes;
  impl->local = true;
  return RegisteredMemory(impl);
}

TEST(ProxyServiceTest, TablesAreDenseBoundedAndSafeToFillWhileRunning) {
  ProxyService service(16);
  EXPECT_THROW(service.AddSemaphore(nullptr), Error);
  EXPECT_THROW(service.AddMemory(RegisteredMemory()), Error);
  EXPECT_THROW(service.GetSemaphore(0), Error);
  EXPECT_THROW(service.GetMemory(0), Error);
  EXPECT_THROW(service.PortChannel(0, 0, 0), Error) << "no semaphore, no memory";
  service.StartProxy();
  // Four threads add at once: ids are dense and each names the memory it was given.
  std::vector<std::thread> adders;
  std::vector<std::vector<MemoryId>> ids(4);
  for (int a = 0; a < 4; ++a) {
    adders.emplace_back([&, a] {
      for (size_t i = 0; i < kMaxProxyMemories / 4; ++i)
        ids[a].push_back(service.AddMemory(FakeMemory(a * 1000 + i + 1)));
    });
  }
  for (auto& t : adders) t.join();
  std::vector<bool> seen(kMaxProxyMemories, false);
  for (int a = 0; a < 4; ++a) {
    for (size_t i = 0; i < ids[a].size(); ++i) {
      MemoryId id = ids[a][i];
      ASSERT_LT(id, kMaxProxyMemories);
      EXPECT_FALSE(seen[id]) << "id " << id << " given twice";
      seen[id] = true;
      EXPECT_EQ(service.GetMemory(id).Size(), a * 1000 + i + 1);
    }
  }
  try {
    service.AddMemory(FakeMemory(8));
    ADD_FAILURE() << "memory " << kMaxProxyMemories << " accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
  }
  EXPECT_THROW(service.PortChannel(0, 1, 2), Error) << "no semaphore 0";
  service.StopProxy();
  EXPECT_THROW(PortChannel().DeviceHandle(), Error);
}

// The fence each port channel request pushes with: a flush none, a put of at least a byte what its source needs
// (putOrder), everything else, a put or put-with-signal of no data included, the system scope; a putOrder that
// is no order the handle knows counts as the system scope.
TEST(PortChannelOrderTest, EachRequestFencesAsWhatItNamesNeeds) {
  const uint32_t putWithSignal = kTriggerData | kTriggerSignal;
  for (uint32_t given : {0u, 1u, 2u, 3u, 0xFFFFFFFFu}) {
    PortChannelDeviceHandle h{};
    h.putOrder = given;
    const bool device = given == static_cast<uint32_t>(FifoOrder::AfterDeviceWrites);
    const FifoOrder put = device ? FifoOrder::AfterDeviceWrites : FifoOrder::AfterWrites;
    SCOPED_TRACE("putOrder " + std::to_string(given));
    EXPECT_EQ(h.OrderOf(kTriggerFlush, 0), FifoOrder::PayloadOnly);
    EXPECT_EQ(h.OrderOf(kTriggerData, 1), put);
    EXPECT_EQ(h.OrderOf(kTriggerData, kMaxTriggerSize), put);
    EXPECT_EQ(h.OrderOf(putWithSignal, 4096), put);
    EXPECT_EQ(h.OrderOf(putWithSignal | kTriggerFlush, 8), put);
    EXPECT_EQ(h.OrderOf(kTriggerData, 0), FifoOrder::AfterWrites) << "a put of nothing";
    EXPECT_EQ(h.OrderOf(putWithSignal, 0), FifoOrder::AfterWrites) << "a signal with no data";
    EXPECT_EQ(h.OrderOf(putWithSignal | kTriggerFlush, 0), FifoOrder::AfterWrites);
    EXPECT_EQ(h.OrderOf(kTriggerSignal, 0), FifoOrder::AfterWrites);
    EXPECT_EQ(h.OrderOf(kTriggerSignal | kTriggerFlush, 0), FifoOrder::AfterWrites);
  }
  EXPECT_EQ(PortChannelDeviceHandle{}.OrderOf(kTriggerData, 1), FifoOrder::AfterWrites) << "value-initialized";
}

TEST(ProxyServiceTest, RequestsItCannotServeFailTheProxyNamingThem) {
  struct Case {
    PortRequest request;
    const char* expect;
  };
  for (const Case& c :
       {Case{PortRequest{0, 0, 0, 0, 0, 0, 0}, "type 0 (custom)"},
        Case{PortRequest{kTriggerSignal, 7, 0, 0, 0, 0, 0}, "names semaphore 7"},
        Case{PortRequest{kTriggerData | kTriggerFlush, 1023, 3, 4, 0, 0, 64}, "names semaphore 1023"}}) {
    ProxyService service(8);
    PreloadKernels(PushOneKernel);
    service.StartProxy();
    LaunchKernel(PushOneKernel, Dim3(1), Dim3(1), 0, nullptr, service.FifoHandle(), EncodePortRequest(c.request));
    Synchronize();
    WaitUntilStopped(service);
    try {
      service.StopProxy();
      ADD_FAILURE() << "a request the service cannot serve was accepted (expected: " << c.expect << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace mori::core
