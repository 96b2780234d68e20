// The proxy thread (pops one FIFO, hands each trigger to a handler, backs off when idle, fails loudly) and
// ProxyService, which executes port channel requests over the connections of its semaphores.
#include "mori/channels/proxy.hpp"

#include <sched.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#include "mori/channels/port_channel.hpp"
#include "mori/core/timeout.hpp"
#include "registered_memory_impl.hpp"
#include "service_thread.hpp"

namespace mori::core {

namespace {

using Clock = std::chrono::steady_clock;

// One poll's pause while the proxy spins: tells the core this is a spin loop (cheaper for its sibling).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How an empty (or not ready) FIFO is waited on. The GPU -> host -> GPU round trip costs 2.3-2.7 us on an
// H100/H200, so the first stretch of emptiness is polled flat out: the first kHotPolls polls without a pause
// or a clock read between them (each costs tens of nanoseconds, and the slot's arrival is seen that much
// later), then with a pause, reading the clock every kClockEvery polls. Then the core is offered to others
// between polls; after kNapAfter of emptiness the thread naps, so an idle proxy does not burn a core for good
// (a kernel pushing after a long pause then waits one nap longer).
class IdleBackoff {
 public:
  static constexpr auto kSpinFor = std::chrono::microseconds(50);
  static constexpr auto kNapAfter = std::chrono::microseconds(500);
  static constexpr auto kNap = std::chrono::microseconds(20);
  static constexpr uint32_t kHotPolls = 256;
  static constexpr uint32_t kClockEvery = 32;

  void Reset() {
    idle_ = false;
    spinning_ = true;
    polls_ = 0;
  }

  void Wait() {
    ++polls_;
    if (polls_ <= kHotPolls) return;
    if (polls_ % kClockEvery != 0 && spinning_) {
      CpuRelax();
      return;
    }
    Clock::time_point now = Clock::now();
    if (!idle_) {
      idle_ = true;
      since_ = now;
    }
    Clock::duration idleFor = now - since_;
    spinning_ = idleFor < kSpinFor;
    if (spinning_) {
      CpuRelax();
    } else if (idleFor < kNapAfter) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(kNap);
    }
  }

 private:
  bool idle_ = false;
  bool spinning_ = true;
  uint32_t polls_ = 0;
  Clock::time_point since_;
};

std::string TriggerText(const ProxyTrigger& t) {
  return StrFormat("{fst 0x%016llx, snd 0x%016llx}", static_cast<unsigned long long>(t.fst),
                   static_cast<unsigned long long>(t.snd));
}

}  // namespace

// ---- Proxy ----

struct Proxy::Thread {
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> ended{false};   // the thread left its loop (stopped or failed)
  std::atomic<bool> failed{false};  // sticky: the FIFO was marked failed, the proxy cannot start again
  std::exception_ptr error;         // written by the thread before `ended`; taken by StopProxy
};

Proxy::Proxy(uint32_t fifoSize, int device) : device_(device), thread_(std::make_unique<Thread>()) {
  int current = 0;
  MORI_CHECK_GPU(GpuGetDevice(&current));
  if (device_ < 0) device_ = current;
  int count = 0;
  MORI_CHECK_GPU(GpuGetDeviceCount(&count));
  MORI_CHECK(device_ < count, ErrorCode::InvalidUsage, "Proxy for GPU %d: this process sees %d GPUs", device_, count);
  // The FIFO's head lives on the GPU whose kernels push.
  if (device_ != current) MORI_CHECK_GPU(GpuSetDevice(device_));
  try {
    fifo_ = std::make_unique<Fifo>(fifoSize);
  } catch (...) {
    if (device_ != current) (void)GpuSetDevice(current);
    throw;
  }
  if (device_ != current) MORI_CHECK_GPU(GpuSetDevice(current));
}

Proxy::~Proxy() { StopProxyWithoutDraining(); }

void Proxy::StartProxy() {
  Thread& t = *thread_;
  MORI_CHECK(!t.thread.joinable(), ErrorCode::InvalidUsage, "StartProxy: the proxy for GPU %d already runs", device_);
  MORI_CHECK(!t.failed.load(), ErrorCode::InvalidUsage,
             "StartProxy: the proxy for GPU %d failed earlier and its FIFO's producers were told so; make a new one",
             device_);
  t.stop.store(false);
  t.ended.store(false);
  t.error = nullptr;
  t.thread = std::thread([this] { Run(); });
}

void Proxy::Run() {
  Thread& t = *thread_;
  Fifo& fifo = *fifo_;
  ProxyTrigger trigger{};
  bool inHandler = false;
  BecomeServiceThread("proxy", device_, device_);
  try {
    MORI_CHECK_GPU(GpuSetDevice(device_));  // the current device is per host thread
    IdleBackoff backoff;
    while (!t.stop.load(std::memory_order_acquire)) {
      if (fifo.Poll(&trigger)) {
        inHandler = true;
        uint32_t used = HandleTrigger(trigger);
        inHandler = false;
        if (used > 0) {
          MORI_CHECK(used <= fifo.Size(), ErrorCode::Internal,
                     "the handler says the request used %u slots of a FIFO of %u", used, fifo.Size());
          fifo.Pop(used);
          backoff.Reset();
          continue;
        }
        backoff.Wait();  // the rest of the request is not written yet
        continue;
      }
      OnIdle();
      backoff.Wait();
    }
    OnIdle();
  } catch (...) {
    t.error = std::current_exception();
    std::string what = "unknown exception";
    std::optional<ErrorCode> code;
    try {
      throw;
    } catch (const Error& e) {
      what = e.what();
      code = e.Code();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      t.error = std::make_exception_ptr(
          Error(ErrorCode::Internal, StrFormat("proxy for GPU %d: a handler threw something that is not a "
                                               "std::exception",
                                               device_)));
    }
    if (inHandler) {
      MORI_LOG_ERROR(Proxy,
                     "proxy for GPU %d failed handling the trigger in slot %llu %s: %s; its FIFO's producers are "
                     "told to stop",
                     device_, static_cast<unsigned long long>(fifo.Tail()), TriggerText(trigger).c_str(), what.c_str());
    } else {
      MORI_LOG_ERROR(Proxy, "proxy for GPU %d failed (after %llu triggers): %s; its FIFO's producers are told to stop",
                     device_, static_cast<unsigned long long>(fifo.Tail()), what.c_str());
    }
    if (code) {
      fifo.MarkFailed(*code);
    } else {
      fifo.MarkFailed();
    }
    t.failed.store(true);
  }
  t.ended.store(true, std::memory_order_release);
}

void Proxy::StopProxy() {
  Thread& t = *thread_;
  if (!t.thread.joinable()) return;
  // Everything claimed before this call is handled before the thread stops. A slot claimed is written soon
  // after (the producer only waits for room, which this thread keeps making).
  uint64_t head = fifo_->Head();
  Deadline deadline = Deadline::Default();
  while (fifo_->Tail() < head && !t.ended.load(std::memory_order_acquire)) {
    if (deadline.Expired()) {
      uint64_t tail = fifo_->Tail();
      StopProxyWithoutDraining();
      fifo_->MarkFailed(ErrorCode::Timeout);
      t.failed.store(true);
      throw TimeoutError(StrFormat(
          "StopProxy: the proxy for GPU %d did not handle slots [%llu, %llu) pushed before the call within %.0f s "
          "(a producer claimed slots and never wrote them, or the handler keeps answering 'not ready' for the "
          "trigger in slot %llu)",
          device_, static_cast<unsigned long long>(tail), static_cast<unsigned long long>(head),
          deadline.TotalSeconds(), static_cast<unsigned long long>(tail)));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  t.stop.store(true, std::memory_order_release);
  t.thread.join();
  if (t.error) {
    std::exception_ptr error = t.error;
    t.error = nullptr;
    std::rethrow_exception(error);
  }
}

void Proxy::StopProxyWithoutDraining() {
  Thread& t = *thread_;
  if (!t.thread.joinable()) return;
  t.stop.store(true, std::memory_order_release);
  t.thread.join();
}

bool Proxy::Running() const { return thread_->thread.joinable() && !thread_->ended.load(std::memory_order_acquire); }

uint64_t Proxy::Handled() const { return fifo_->Tail(); }

// ---- ProxyService ----

// Append-only, read by the proxy thread without a lock: an entry is written before the count that covers it
// is published (release), and never changes after.
struct ProxyService::Tables {
  std::mutex addMutex;
  std::array<std::shared_ptr<Semaphore>, kMaxProxySemaphores> semaphores;
  std::array<RegisteredMemory, kMaxProxyMemories> memories;
  std::atomic<uint32_t> numSemaphores{0};
  std::atomic<uint32_t> numMemories{0};
};

ProxyService::ProxyService(uint32_t fifoSize, int device)
    : Proxy(fifoSize, device), tables_(std::make_unique<Tables>()) {}

ProxyService::~ProxyService() { StopProxyWithoutDraining(); }

SemaphoreId ProxyService::AddSemaphore(std::shared_ptr<Semaphore> semaphore) {
  MORI_CHECK(semaphore != nullptr, ErrorCode::InvalidUsage, "ProxyService::AddSemaphore: no semaphore (nullptr)");
  MORI_CHECK(semaphore->GetConnection() != nullptr, ErrorCode::InvalidUsage,
             "ProxyService::AddSemaphore: the semaphore with rank %d has no connection", semaphore->RemoteRank());
  Tables& t = *tables_;
  std::lock_guard<std::mutex> lock(t.addMutex);
  uint32_t id = t.numSemaphores.load(std::memory_order_relaxed);
  MORI_CHECK(id < kMaxProxySemaphores, ErrorCode::InvalidUsage,
             "ProxyService::AddSemaphore: already %u semaphores, the most a port channel request can name", id);
  t.semaphores[id] = std::move(semaphore);
  t.numSemaphores.store(id + 1, std::memory_order_release);
  return id;
}

MemoryId ProxyService::AddMemory(RegisteredMemory memory) {
  MORI_CHECK(memory.Valid(), ErrorCode::InvalidUsage, "ProxyService::AddMemory: an empty RegisteredMemory");
  Tables& t = *tables_;
  std::lock_guard<std::mutex> lock(t.addMutex);
  uint32_t id = t.numMemories.load(std::memory_order_relaxed);
  MORI_CHECK(id < kMaxProxyMemories, ErrorCode::InvalidUsage,
             "ProxyService::AddMemory: already %u memories, the most a port channel request can name", id);
  t.memories[id] = std::move(memory);
  t.numMemories.store(id + 1, std::memory_order_release);
  return id;
}

std::shared_ptr<Semaphore> ProxyService::GetSemaphore(SemaphoreId id) const {
  uint32_t n = tables_->numSemaphores.load(std::memory_order_acquire);
  MORI_CHECK(id < n, ErrorCode::InvalidUsage, "ProxyService: no semaphore %u (%u added)", id, n);
  return tables_->semaphores[id];
}

RegisteredMemory ProxyService::GetMemory(MemoryId id) const {
  uint32_t n = tables_->numMemories.load(std::memory_order_acquire);
  MORI_CHECK(id < n, ErrorCode::InvalidUsage, "ProxyService: no memory %u (%u added)", id, n);
  return tables_->memories[id];
}

mori::core::PortChannel ProxyService::PortChannel(SemaphoreId semaphore, MemoryId dst, MemoryId src) {
  uint32_t nMem = tables_->numMemories.load(std::memory_order_acquire);
  MORI_CHECK(dst < nMem && src < nMem, ErrorCode::InvalidUsage,
             "ProxyService::PortChannel: memory ids dst %u, src %u, but %u memories were added", dst, src, nMem);
  const RegisteredMemory& source = tables_->memories[src];
  const bool gpuSource =
      source.IsLocal() && source.IsDeviceMemory() && DeviceOfMemoryPointer(source.Data()) == Device();
  return mori::core::PortChannel(semaphore, GetSemaphore(semaphore), FifoHandle(), dst, src,
                                 gpuSource ? FifoOrder::AfterDeviceWrites : FifoOrder::AfterWrites);
}

uint32_t ProxyService::HandleTrigger(const ProxyTrigger& trigger) {
  PortRequest r = DecodePortRequest(trigger);
  if (r.type == 0) return HandleCustomTrigger(trigger);
  Tables& t = *tables_;
  uint32_t nSem = t.numSemaphores.load(std::memory_order_acquire);
  MORI_CHECK(r.semaphoreId < nSem, ErrorCode::InvalidUsage,
             "ProxyService: a port channel request (type %u) names semaphore %u, but %u were added", r.type,
             r.semaphoreId, nSem);
  Semaphore& semaphore = *t.semaphores[r.semaphoreId];
  Connection& connection = *semaphore.GetConnection();
  if ((r.type & kTriggerData) != 0 && r.size > 0) {
    uint32_t nMem = t.numMemories.load(std::memory_order_acquire);
    MORI_CHECK(r.dstMemoryId < nMem && r.srcMemoryId < nMem, ErrorCode::InvalidUsage,
               "ProxyService: a put on semaphore %u (%s) names memories dst %u, src %u, but %u were added",
               r.semaphoreId, connection.Describe().c_str(), r.dstMemoryId, r.srcMemoryId, nMem);
    const RegisteredMemory& dst = t.memories[r.dstMemoryId];
    const RegisteredMemory& src = t.memories[r.srcMemoryId];
    MORI_CHECK(r.dstOffset + r.size <= dst.Size() && r.srcOffset + r.size <= src.Size(), ErrorCode::InvalidUsage,
               "ProxyService: a put on semaphore %u (%s) of %llu bytes from offset %llu of memory %u (%zu bytes) to "
               "offset %llu of memory %u (%zu bytes) reaches beyond a memory",
               r.semaphoreId, connection.Describe().c_str(), static_cast<unsigned long long>(r.size),
               static_cast<unsigned long long>(r.srcOffset), r.srcMemoryId, src.Size(),
               static_cast<unsigned long long>(r.dstOffset), r.dstMemoryId, dst.Size());
    connection.Write(dst, r.dstOffset, src, r.srcOffset, r.size);
  }
  if ((r.type & kTriggerSignal) != 0) semaphore.Signal();
  if ((r.type & kTriggerFlush) != 0) connection.Flush();
  return 1;
}

uint32_t ProxyService::HandleCustomTrigger(const ProxyTrigger& trigger) {
  MORI_THROW(ErrorCode::InvalidUsage,
             "ProxyService: a request of type 0 (custom) %s, but this ProxyService handles no custom requests "
             "(a subclass overrides HandleCustomTrigger)",
             TriggerText(trigger).c_str());
}

}  // namespace mori::core
