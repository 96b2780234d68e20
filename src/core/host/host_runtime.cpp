// The HOST backend's GPU runtime: the calls of gpu.hpp and the kernel launcher of kernel.hpp, with host
// memory as device memory, in-order worker threads as streams and groups of host threads as kernels.
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "mori/core/dma_copy.hpp"
#include "mori/core/env.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/logging.hpp"
#include "service_thread.hpp"

namespace mori::core {

namespace host {

// The barrier of one block's threads. One futex word holds the generation (times two) and a "broken" bit:
// arrivals count on an atomic, the last one bumps the generation and wakes the sleepers, and Break sets the
// bit, so any change of the word wakes a sleeper to look again. (A mutex and condition variable cost every
// waiter a second round through the mutex after the broadcast: an EP test of 8 PEs on two cores spent most of
// its time there.)
class BlockBarrier {
 public:
  explicit BlockBarrier(unsigned count) : count_(count) {}

  void Wait() {
    uint32_t word = word_.load(std::memory_order_acquire);
    if ((word & kBroken) != 0) throw KernelTrap{"another thread of the launch failed"};
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);  // no thread arrives again before the generation moves
      word_.fetch_add(kGeneration, std::memory_order_seq_cst);
      Wake();
      return;
    }
    const uint32_t generation = word & ~kBroken;
    while (true) {
      uint32_t now = word_.load(std::memory_order_acquire);
      if ((now & ~kBroken) != generation) return;
      if ((now & kBroken) != 0) throw KernelTrap{"another thread of the launch failed"};
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAIT_PRIVATE, now, nullptr, nullptr, 0);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // Releases every waiter (they trap): a thread of the block failed or never started.
  void Break() {
    word_.fetch_or(kBroken, std::memory_order_seq_cst);
    Wake();
  }

 private:
  static constexpr uint32_t kBroken = 1, kGeneration = 2;
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word is the atomic itself");

  // After a change of the word: a sleeper counted itself before the kernel compared the word, so a waker that
  // sees none has changed the word before any sleeper's comparison (which then fails: it does not sleep).
  void Wake() {
    if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  std::atomic<uint32_t> word_{0};
  std::atomic<unsigned> arrived_{0};
  std::atomic<unsigned> sleepers_{0};
  const unsigned count_;
};

ThreadContext& CurrentThread() {
  thread_local ThreadContext context;
  return context;
}

void BlockSync() {
  BlockBarrier* barrier = CurrentThread().barrier;
  if (barrier != nullptr) barrier->Wait();
}

void SpinPause() {
  const bool* aborted = CurrentThread().aborted;
  if (aborted != nullptr && __atomic_load_n(aborted, __ATOMIC_ACQUIRE)) {
    throw KernelTrap{"another thread of the launch failed"};
  }
  std::this_thread::yield();
}

}  // namespace host

// An in-order queue of work run by one worker thread, like a GPU stream.
struct HostStream {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::function<GpuStatus()>> queue;
  bool busy = false;
  bool stopping = false;
  GpuStatus error = kGpuSuccess;  // first failure since the last synchronisation
  std::thread worker;
  // Under the registry's mutex: device-wide synchronisations holding this stream, and whether it was
  // destroyed meanwhile (then the last of them deletes it).
  int pins = 0;
  bool destroyed = false;

  HostStream()
      : worker([this] {
          NameThisThread("stream");
          Run();
        }) {}

  ~HostStream() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    cv.notify_all();
    worker.join();
  }

  void Enqueue(std::function<GpuStatus()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      queue.push_back(std::move(task));
    }
    cv.notify_all();
  }

  // Waits until everything enqueued so far has run, or until `deadline` (kGpuErrorTimeout); returns (and
  // clears) the first failure.
  GpuStatus Synchronize(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex);
    if (!cv.wait_until(lock, deadline, [&] { return queue.empty() && !busy; })) return kGpuErrorTimeout;
    GpuStatus s = error;
    error = kGpuSuccess;
    return s;
  }

  GpuStatus Query() {
    std::lock_guard<std::mutex> lock(mutex);
    return (queue.empty() && !busy) ? kGpuSuccess : kGpuErrorNotReady;
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping, and drained
      auto task = std::move(queue.front());
      queue.pop_front();
      busy = true;
      lock.unlock();
      GpuStatus s = task();
      lock.lock();
      busy = false;
      if (s != kGpuSuccess && error == kGpuSuccess) error = s;
      cv.notify_all();
    }
  }
};

// The threads that play a launch's GPU threads, kept for the next launch instead of ending with this one.
// Every thread of a launch must run at once (the threads of a block meet at barriers, blocks spin on each
// other's flags), so a launch takes one thread per GPU thread: idle ones first, new ones for the rest. Starting
// and ending them per launch was most of what the HOST tests cost: an EP test of 2 PEs started 48,000 threads
// per PE in 14 s, and the kernel spent its time zeroing their stacks and tearing them down (more so under the
// sanitizers, which track every thread). A thread idle for kIdleSeconds ends, and at most kMaxIdle stay.
// After fork() the child has none of the parent's threads, so it forgets them (leaking the records) and starts
// its own.
namespace {
class KernelThreads {
 public:
  // Runs work on a thread of its own, then offers the thread to the next launch, then runs done (so a launch
  // that waits for every done finds its threads idle again); throws std::system_error when no thread can start.
  static void Run(std::function<void()> work, std::function<void()> done) {
    Instance().Start(std::move(work), std::move(done));
  }

 private:
  static constexpr unsigned kMaxIdle = host::kMaxThreadsPerLaunch;
  static constexpr int kIdleSeconds = 10;

  struct Worker {
    std::condition_variable cv;
    std::function<void()> work, done;  // under the pool's mutex
  };

  static KernelThreads*& Pointer() {
    static KernelThreads* pool = nullptr;
    return pool;
  }

  static void ForgetParentThreads() { Pointer() = new KernelThreads(); }

  static KernelThreads& Instance() {
    static std::once_flag once;
    std::call_once(once, [] {
      Pointer() = new KernelThreads();
      pthread_atfork(nullptr, nullptr, ForgetParentThreads);
    });
    return *Pointer();
  }

  void Start(std::function<void()> work, std::function<void()> done) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!idle_.empty()) {
      Worker* w = idle_.back();
      idle_.pop_back();
      w->work = std::move(work);
      w->done = std::move(done);
      w->cv.notify_one();
      return;
    }
    lock.unlock();
    auto* w = new Worker();
    w->work = std::move(work);
    w->done = std::move(done);
    try {
      std::thread([this, w] { Loop(w); }).detach();
    } catch (...) {
      delete w;
      throw;
    }
  }

  void Loop(Worker* w) {
    NameThisThread("kernel");
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      std::function<void()> work = std::move(w->work), done = std::move(w->done);
      w->work = nullptr;
      w->done = nullptr;
      lock.unlock();
      work();
      work = nullptr;  // what it holds goes before the thread is offered again
      lock.lock();
      const bool keep = idle_.size() < kMaxIdle;
      if (keep) idle_.push_back(w);
      lock.unlock();
      done();
      done = nullptr;
      lock.lock();
      if (!keep) break;
      if (!w->cv.wait_for(lock, std::chrono::seconds(kIdleSeconds), [w] { return w->work != nullptr; })) {
        // Nobody took it (a launch takes a thread off the list and gives it its work under the same lock).
        idle_.erase(std::find(idle_.begin(), idle_.end(), w));
        break;
      }
    }
    lock.unlock();
    delete w;
  }

  std::mutex mutex_;
  std::vector<Worker*> idle_;
};
}  // namespace

struct HostEvent {
  std::mutex mutex;
  std::condition_variable cv;
  bool recorded = false;
  bool done = true;
  std::chrono::steady_clock::time_point when{};
};

namespace {

thread_local GpuStatus tlsLastError = kGpuSuccess;

// Registry of live streams and the lazily made default stream. After fork() the child has none of the
// parent's worker threads, so the child forgets them (leaking the objects) and makes its own on first use.
struct StreamRegistry {
  std::mutex mutex;
  std::set<HostStream*> streams;
  HostStream* defaultStream = nullptr;
};

StreamRegistry*& RegistryPointer() {
  static StreamRegistry* registry = nullptr;
  return registry;
}

void ForgetParentStreams() { RegistryPointer() = new StreamRegistry(); }

StreamRegistry& Registry() {
  static std::once_flag once;
  std::call_once(once, [] {
    RegistryPointer() = new StreamRegistry();
    pthread_atfork(nullptr, nullptr, ForgetParentStreams);
  });
  return *RegistryPointer();
}

HostStream* DefaultStream() {
  StreamRegistry& r = Registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.defaultStream == nullptr) {
    r.defaultStream = new HostStream();
    r.streams.insert(r.defaultStream);
  }
  return r.defaultStream;
}

HostStream* Resolve(GpuStream s) { return s == nullptr ? DefaultStream() : s; }

GpuStatus Fail(GpuStatus s) {
  tlsLastError = s;
  return s;
}

// How long a synchronisation waits. Kernels bound each of their own waits by MORI_TIMEOUT_S, so work still
// running after twice that and 10 s more is a kernel that never ends, and the caller gets kGpuErrorTimeout
// instead of waiting with it forever.
double SyncBoundSeconds() {
  double s = 120;
  try {
    s = TimeoutSeconds();
  } catch (const std::exception&) {  // a malformed MORI_TIMEOUT_S is reported where it is used
  }
  return 2 * s + 10;
}

std::chrono::steady_clock::time_point SyncDeadline() {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(SyncBoundSeconds()));
}

GpuStatus TimedOut(const char* what) {
  MORI_LOG_ERROR(Gpu, "%s: the HOST work it waits for has not finished after %.0f s (a kernel that never ends?)", what,
                 SyncBoundSeconds());
  return Fail(kGpuErrorTimeout);
}

GpuStatus SynchronizeDefault(const char* what) {
  GpuStatus st = DefaultStream()->Synchronize(SyncDeadline());
  return st == kGpuErrorTimeout ? TimedOut(what) : st;
}

}  // namespace

namespace host {

void Launch(Dim3 grid, Dim3 block, size_t sharedBytes, GpuStream stream, std::function<void()> body) {
  uint64_t perBlock = uint64_t(block.x) * block.y * block.z;
  uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  if (perBlock == 0 || blocks == 0 || perBlock > kMaxThreadsPerBlock || perBlock * blocks > kMaxThreadsPerLaunch) {
    MORI_LOG_ERROR(Gpu,
                   "HOST kernel launch of %llu blocks x %llu threads rejected: the HOST backend runs at most %u "
                   "threads per block and %u per launch",
                   static_cast<unsigned long long>(blocks), static_cast<unsigned long long>(perBlock),
                   kMaxThreadsPerBlock, kMaxThreadsPerLaunch);
    Fail(kGpuErrorInvalidConfiguration);
    return;
  }
  Resolve(stream)->Enqueue([grid, block, sharedBytes, blocks, perBlock, body = std::move(body)]() -> GpuStatus {
    std::vector<std::unique_ptr<BlockBarrier>> barriers;
    std::vector<std::vector<uint64_t>> shared(blocks);
    // The launch's threads count down here as they finish; it waits for every one it started.
    struct Finished {
      std::mutex mutex;
      std::condition_variable cv;
      uint64_t running = 0;
    };
    auto finished = std::make_shared<Finished>();
    bool aborted = false;  // read and written with __atomic builtins
    bool stopped = false;  // a thread left on a stop (the process is ending): one quiet line, not one per thread
    auto abortLaunch = [&] {
      __atomic_store_n(&aborted, true, __ATOMIC_RELEASE);
      for (auto& barrier : barriers) barrier->Break();
    };
    for (uint64_t b = 0; b < blocks; ++b) {
      barriers.push_back(std::make_unique<BlockBarrier>(static_cast<unsigned>(perBlock)));
      shared[b].assign((sharedBytes + 7) / 8, 0);
    }
    try {
      for (uint64_t b = 0; b < blocks; ++b) {
        for (uint64_t t = 0; t < perBlock; ++t) {
          ThreadContext ctx;
          ctx.blockIdx = Dim3(unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / grid.x / grid.y));
          ctx.threadIdx =
              Dim3(unsigned(t % block.x), unsigned(t / block.x % block.y), unsigned(t / block.x / block.y));
          ctx.blockDim = block;
          ctx.gridDim = grid;
          ctx.barrier = barriers[b].get();
          ctx.sharedMemory = shared[b].empty() ? nullptr : shared[b].data();
          ctx.aborted = &aborted;
          {
            std::lock_guard<std::mutex> lock(finished->mutex);
            ++finished->running;
          }
          auto thread = [ctx, &body, &abortLaunch, &stopped] {
            CurrentThread() = ctx;
            const char* what = nullptr;
            std::string detail;
            try {
              body();
            } catch (const KernelTrap& trap) {
              what = trap.reason;
              if (trap.stop) __atomic_store_n(&stopped, true, __ATOMIC_RELEASE);
            } catch (const std::exception& e) {
              what = "exception:";
              detail = e.what();
            } catch (...) {
              what = "unknown exception";
            }
            if (what != nullptr) {
              if (!__atomic_load_n(&stopped, __ATOMIC_ACQUIRE)) {
                MORI_LOG_ERROR(Gpu, "HOST kernel thread (block %u, thread %u) ended: %s %s", ctx.blockIdx.x,
                               ctx.threadIdx.x, what, detail.c_str());
              }
              abortLaunch();
            }
            CurrentThread() = ThreadContext();
            tlsLastError = kGpuSuccess;  // the thread plays another launch's thread next
          };
          try {
            KernelThreads::Run(thread, [finished] {
              std::lock_guard<std::mutex> lock(finished->mutex);
              if (--finished->running == 0) finished->cv.notify_all();
            });
          } catch (...) {
            std::lock_guard<std::mutex> lock(finished->mutex);
            --finished->running;
            throw;
          }
        }
      }
    } catch (const std::system_error& e) {
      MORI_LOG_ERROR(Gpu, "HOST kernel launch could not start its threads: %s", e.what());
      abortLaunch();  // threads already started leave their barriers and polling loops
    }
    {
      std::unique_lock<std::mutex> lock(finished->mutex);
      finished->cv.wait(lock, [&] { return finished->running == 0; });
    }
    if (__atomic_load_n(&stopped, __ATOMIC_ACQUIRE)) {
      MORI_LOG_WARN(Gpu, "HOST kernel stopped: the process was asked to end (its launch reports a failure)");
    }
    return __atomic_load_n(&aborted, __ATOMIC_ACQUIRE) ? kGpuErrorLaunchFailure : kGpuSuccess;
  });
}

}  // namespace host

GpuStatus GpuGetDeviceCount(int* n) {
  if (n == nullptr) return Fail(kGpuErrorInvalidValue);
  *n = 1;
  return kGpuSuccess;
}

GpuStatus GpuSetDevice(int dev) { return dev == 0 ? kGpuSuccess : Fail(kGpuErrorInvalidDevice); }

GpuStatus GpuGetDevice(int* dev) {
  if (dev == nullptr) return Fail(kGpuErrorInvalidValue);
  *dev = 0;
  return kGpuSuccess;
}

GpuStatus GpuDeviceGetName(char* buf, int len, int dev) {
  if (dev != 0) return Fail(kGpuErrorInvalidDevice);
  if (buf == nullptr || len <= 0) return Fail(kGpuErrorInvalidValue);
  std::snprintf(buf, static_cast<size_t>(len), "host CPU (%u hardware threads)", std::thread::hardware_concurrency());
  return kGpuSuccess;
}

GpuStatus GpuDeviceGetPciBusId(char* buf, int len, int dev) {
  if (dev != 0) return Fail(kGpuErrorInvalidDevice);
  if (buf == nullptr || len <= 0) return Fail(kGpuErrorInvalidValue);
  std::snprintf(buf, static_cast<size_t>(len), "host");
  return kGpuSuccess;
}

GpuStatus GpuDeviceCanAccessPeer(int* can, int dev, int peer) {
  if (can == nullptr) return Fail(kGpuErrorInvalidValue);
  if (dev != 0 || peer != 0) return Fail(kGpuErrorInvalidDevice);
  *can = 1;
  return kGpuSuccess;
}

GpuStatus GpuDeviceEnablePeerAccess(int peer) { return peer == 0 ? kGpuSuccess : Fail(kGpuErrorInvalidDevice); }

GpuStatus GpuDeviceHostNativeAtomics(int* supported, int dev) {
  if (supported == nullptr) return Fail(kGpuErrorInvalidValue);
  if (dev != 0) return Fail(kGpuErrorInvalidDevice);
  *supported = 1;  // one coherence domain
  return kGpuSuccess;
}

GpuStatus GpuMalloc(void** p, size_t n) {
  if (p == nullptr) return Fail(kGpuErrorInvalidValue);
  // 256-byte alignment, as cudaMalloc gives, rounded so aligned_alloc accepts the size.
  size_t rounded = (n + 255) / 256 * 256;
  *p = std::aligned_alloc(256, rounded == 0 ? 256 : rounded);
  return *p == nullptr ? Fail(kGpuErrorMemoryAllocation) : kGpuSuccess;
}

GpuStatus GpuMallocUncached(void** p, size_t n) { return GpuMalloc(p, n); }

GpuStatus GpuFree(void* p) {
  std::free(p);
  return kGpuSuccess;
}

GpuStatus GpuHostAllocMapped(void** p, size_t n) { return GpuMalloc(p, n); }

GpuStatus GpuFreeHost(void* p) { return GpuFree(p); }

GpuStatus GpuHostRegisterMapped(void* p, size_t n) {
  return (p == nullptr || n == 0) ? Fail(kGpuErrorInvalidValue) : kGpuSuccess;
}

GpuStatus GpuHostUnregister(void* p) { return p == nullptr ? Fail(kGpuErrorInvalidValue) : kGpuSuccess; }

GpuStatus GpuHostGetDevicePointer(void** dev, void* hostPtr) {
  if (dev == nullptr || hostPtr == nullptr) return Fail(kGpuErrorInvalidValue);
  *dev = hostPtr;
  return kGpuSuccess;
}

GpuStatus GpuMemcpyAsync(void* dst, const void* src, size_t n, GpuStream s) {
  if (n > 0 && (dst == nullptr || src == nullptr)) return Fail(kGpuErrorInvalidValue);
  Resolve(s)->Enqueue([dst, src, n] {
    DmaCopy(dst, src, n);
    return kGpuSuccess;
  });
  return kGpuSuccess;
}

GpuStatus GpuStreamWriteValue64(uint64_t* dst, uint64_t value, GpuStream s) {
  if (dst == nullptr || reinterpret_cast<uintptr_t>(dst) % sizeof(uint64_t) != 0) return Fail(kGpuErrorInvalidValue);
  Resolve(s)->Enqueue([dst, value] {
    __atomic_store_n(dst, value, __ATOMIC_RELEASE);
    return kGpuSuccess;
  });
  return kGpuSuccess;
}

bool GpuCanStreamWriteValue64(int device) {
  int count = 0;
  return GpuGetDeviceCount(&count) == kGpuSuccess && device >= 0 && device < count;
}

// Synchronous copies and sets are ordered after the default stream's earlier work, as on a GPU.
GpuStatus GpuMemcpy(void* dst, const void* src, size_t n) {
  GpuStatus s = GpuMemcpyAsync(dst, src, n, nullptr);
  return s != kGpuSuccess ? s : SynchronizeDefault("GpuMemcpy");
}

GpuStatus GpuMemsetAsync(void* p, int v, size_t n, GpuStream s) {
  if (n > 0 && p == nullptr) return Fail(kGpuErrorInvalidValue);
  Resolve(s)->Enqueue([p, v, n] {
    std::memset(p, v, n);
    return kGpuSuccess;
  });
  return kGpuSuccess;
}

GpuStatus GpuMemset(void* p, int v, size_t n) {
  GpuStatus s = GpuMemsetAsync(p, v, n, nullptr);
  return s != kGpuSuccess ? s : SynchronizeDefault("GpuMemset");
}

GpuStatus GpuStreamCreate(GpuStream* s) {
  if (s == nullptr) return Fail(kGpuErrorInvalidValue);
  *s = new HostStream();
  StreamRegistry& r = Registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.streams.insert(*s);
  return kGpuSuccess;
}

GpuStatus GpuStreamDestroy(GpuStream s) {
  if (s == nullptr) return Fail(kGpuErrorInvalidValue);
  {
    StreamRegistry& r = Registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (s == r.defaultStream || r.streams.erase(s) == 0) return Fail(kGpuErrorInvalidValue);
  }
  if (s->Synchronize(SyncDeadline()) == kGpuErrorTimeout) {
    // Its worker still runs a kernel: the stream is left to it (forgotten, not deleted).
    return TimedOut("GpuStreamDestroy");
  }
  {
    // A GpuDeviceSynchronize on another thread may still hold it: the last holder deletes it then.
    StreamRegistry& r = Registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (s->pins > 0) {
      s->destroyed = true;
      return kGpuSuccess;
    }
  }
  delete s;
  return kGpuSuccess;
}

GpuStatus GpuStreamSynchronize(GpuStream s) {
  GpuStatus st = Resolve(s)->Synchronize(SyncDeadline());
  return st == kGpuErrorTimeout ? TimedOut("GpuStreamSynchronize") : st;
}

GpuStatus GpuStreamQuery(GpuStream s) { return Resolve(s)->Query(); }

GpuStatus GpuDeviceSynchronize() {
  std::vector<HostStream*> all;
  DefaultStream();
  {
    StreamRegistry& r = Registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    all.assign(r.streams.begin(), r.streams.end());
    for (HostStream* s : all) ++s->pins;
  }
  GpuStatus first = kGpuSuccess;
  const auto deadline = SyncDeadline();  // one bound for all the streams
  for (HostStream* s : all) {
    GpuStatus st = s->Synchronize(deadline);
    if (first == kGpuSuccess) first = st;
    bool last = false;
    {
      StreamRegistry& r = Registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      last = --s->pins == 0 && s->destroyed;
    }
    if (last) delete s;
  }
  return first == kGpuErrorTimeout ? TimedOut("GpuDeviceSynchronize") : first;
}

GpuStatus GpuEventCreate(GpuEvent* e) {
  if (e == nullptr) return Fail(kGpuErrorInvalidValue);
  *e = new HostEvent();
  return kGpuSuccess;
}

GpuStatus GpuEventDestroy(GpuEvent e) {
  if (e == nullptr) return Fail(kGpuErrorInvalidValue);
  // Not deleted while a stream may still record it.
  if (GpuEventSynchronize(e) == kGpuErrorTimeout) return kGpuErrorTimeout;
  delete e;
  return kGpuSuccess;
}

GpuStatus GpuEventRecord(GpuEvent e, GpuStream s) {
  if (e == nullptr) return Fail(kGpuErrorInvalidValue);
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    e->recorded = true;
    e->done = false;
  }
  Resolve(s)->Enqueue([e] {
    std::lock_guard<std::mutex> lock(e->mutex);
    e->when = std::chrono::steady_clock::now();
    e->done = true;
    e->cv.notify_all();
    return kGpuSuccess;
  });
  return kGpuSuccess;
}

GpuStatus GpuEventSynchronize(GpuEvent e) {
  if (e == nullptr) return Fail(kGpuErrorInvalidValue);
  std::unique_lock<std::mutex> lock(e->mutex);
  if (!e->cv.wait_until(lock, SyncDeadline(), [&] { return e->done; })) {
    lock.unlock();
    return TimedOut("GpuEventSynchronize");
  }
  return kGpuSuccess;
}

GpuStatus GpuEventQuery(GpuEvent e) {
  if (e == nullptr) return Fail(kGpuErrorInvalidValue);
  std::lock_guard<std::mutex> lock(e->mutex);
  return e->done ? kGpuSuccess : kGpuErrorNotReady;
}

GpuStatus GpuEventElapsedTime(float* ms, GpuEvent a, GpuEvent b) {
  if (ms == nullptr || a == nullptr || b == nullptr) return Fail(kGpuErrorInvalidValue);
  std::scoped_lock lock(a->mutex, b->mutex);
  if (!a->recorded || !b->recorded) return Fail(kGpuErrorInvalidValue);
  if (!a->done || !b->done) return Fail(kGpuErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return kGpuSuccess;
}

GpuStatus GpuGetLastError() {
  GpuStatus s = tlsLastError;
  tlsLastError = kGpuSuccess;
  return s;
}

GpuStatus GpuModuleGetGlobal(void** ptr, size_t* bytes, void*, const char*) {
  if (ptr != nullptr) *ptr = nullptr;
  if (bytes != nullptr) *bytes = 0;
  return Fail(kGpuErrorNotSupported);
}

const char* GpuGetErrorString(GpuStatus s) {
  switch (s) {
    case kGpuSuccess: return "no error";
    case kGpuErrorInvalidValue: return "invalid argument";
    case kGpuErrorMemoryAllocation: return "out of memory";
    case kGpuErrorInvalidDevice: return "invalid device ordinal (the HOST backend has device 0 only)";
    case kGpuErrorNotReady: return "device not ready";
    case kGpuErrorLaunchFailure: return "kernel failed: a HOST kernel thread trapped (see the log above)";
    case kGpuErrorInvalidConfiguration: return "invalid launch configuration";
    case kGpuErrorNotSupported: return "operation not supported";
    case kGpuErrorTimeout:
      return "timed out: a HOST kernel ran longer than twice MORI_TIMEOUT_S and 10 s (see the log above)";
  }
  return "unknown error";
}

}  // namespace mori::core
