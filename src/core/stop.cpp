#include "mori/core/stop.hpp"

#include <errno.h>
#include <time.h>
#include <pthread.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mori/core/device_sync.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"
#include "service_thread.hpp"

namespace mori::core {
namespace {

constexpr int kStopSignals[] = {SIGTERM, SIGINT};

// The word itself (host address) and the address device code reads. Written once, before any handler or
// handle can see them; the handler only stores through hostWord.
uint32_t* hostWord = nullptr;
const uint32_t* deviceWord = nullptr;
std::once_flag wordOnce;
int device = -1;  // the GPU of the thread that made the word (ShmemInit's), which the drain waits for

// The word lives in a page of the program's own data, registered with the GPU (not allocated by it): it stays
// mapped while the process lives, so a signal that arrives while the GPU runtime tears down at exit stores into
// memory that is still there.
alignas(4096) uint32_t wordPage[4096 / sizeof(uint32_t)];
std::atomic<bool> wordMade{false};
int64_t drainMs = 2000;  // MORI_STOP_DRAIN_MS, read when the handlers are installed
std::terminate_handler previousTerminate = nullptr;
std::atomic<int64_t> firstSignalNs{0};  // CLOCK_MONOTONIC of the first signal (a repeat within 500 ms waits)

// The handler's hand-off to the watcher thread: the signal number, one byte.
int wakeRead = -1;
int wakeWrite = -1;
std::atomic<bool> requested{false};
std::mutex installMutex;
bool installTried = false;
std::vector<int> handledSignals;

void MakeWord() {
  if (GpuGetDevice(&device) != kGpuSuccess) device = -1;
  wordPage[0] = 0;
#if MORI_BACKEND_HOST
  hostWord = wordPage;
  deviceWord = wordPage;
#else
  void* dev = nullptr;
  if (GpuHostRegisterMapped(wordPage, sizeof(wordPage)) != kGpuSuccess ||
      GpuHostGetDevicePointer(&dev, wordPage) != kGpuSuccess) {
    (void)GpuGetLastError();
    MORI_LOG_WARN(Core, "no stop word (its page could not be registered with the GPU): SIGTERM and SIGINT end "
                        "this process without stopping its kernels first");
    return;
  }
  hostWord = wordPage;
  deviceWord = static_cast<const uint32_t*>(dev);
#endif
  wordMade.store(true, std::memory_order_release);
}

void SetWord(uint32_t value) {
  if (hostWord != nullptr) __atomic_store_n(hostWord, value, __ATOMIC_RELEASE);
}

const char* SignalName(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGKILL: return "SIGKILL";
    default: return "a signal";
  }
}

// Waits until the device has no work, for at most MORI_STOP_DRAIN_MS (on the device ShmemInit ran on).
bool DrainDevice(double* waitedMs) {
  const auto start = std::chrono::steady_clock::now();
  bool idle = true;
  try {
    if (device >= 0) (void)GpuSetDevice(device);
    (void)DeviceSynchronizeBy(Deadline::After(static_cast<double>(drainMs) / 1000.0), "a process asked to end");
  } catch (const Error&) {
    idle = false;
  }
  *waitedMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return idle;
}

[[noreturn]] void EndWith(int sig) {
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  sigset_t only;
  sigemptyset(&only);
  sigaddset(&only, sig);
  pthread_sigmask(SIG_UNBLOCK, &only, nullptr);
  // To this thread, where it is unblocked: delivered before raise returns, and its default action ends the
  // process (kill() to the process could pick another thread and return first).
  raise(sig);
  // Not reached for SIGTERM, SIGINT or SIGKILL with their default actions; a last resort otherwise.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  _exit(128 + sig);
}

// Async-signal-safe: a store, a write, and for a second signal the default action.
void OnStopSignal(int sig) {
  const int saved = errno;
  SetWord(1);
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  const int64_t nowNs = int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
  int64_t first = 0;
  const bool repeat = !firstSignalNs.compare_exchange_strong(first, nowNs);
  // A repeat ends the process at once (a second Ctrl-C), unless it comes within 500 ms of the first: a terminal's
  // SIGINT and mpirun's forwarded SIGTERM reach a rank together, and must not cut its drain short.
  if (wakeWrite < 0 || (repeat && nowNs - first > 500000000)) {
    signal(sig, SIG_DFL);
    raise(sig);
  } else if (!requested.exchange(true)) {
    const char c = static_cast<char>(sig);
    ssize_t w;
    do {
      w = write(wakeWrite, &c, 1);
    } while (w < 0 && errno == EINTR);
  }
  errno = saved;
}

// A child forked after the handlers were installed has no watcher thread and shares the parent's pipe: a
// signal to it must not wake the parent's watcher. It starts afresh: default actions, no pipe, no stop;
// InstallStopOnSignals (its own ShmemInit) installs again.
void ForgetInChild() {
  for (int sig : handledSignals) signal(sig, SIG_DFL);
  handledSignals.clear();
  if (wakeRead >= 0) close(wakeRead);
  if (wakeWrite >= 0) close(wakeWrite);
  wakeRead = wakeWrite = -1;
  installTried = false;
  requested.store(false);
  firstSignalNs.store(0);
  SetWord(0);  // the word's page is the program's own data: the child has its copy
}

// Registered with atexit: a thread that returns from main or calls exit() while a stop is under way (its
// kernel ended early, so it went on) waits here for the watcher to end the process with the signal, rather than
// ending it first with an exit code that hides the signal. Bounded: the drain's bound and two seconds more.
void HoldExitWhileStopping() {
  if (!requested.load(std::memory_order_acquire)) return;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(drainMs) + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// The same for an exception that nobody catches (on HOST a stopped launch fails, and a program that throws on
// a failed launch would otherwise abort): hold, then what was installed before.
[[noreturn]] void HoldTerminateWhileStopping() {
  HoldExitWhileStopping();
  if (previousTerminate != nullptr) previousTerminate();
  std::abort();
}

void Watch() {
  NameThisThread("stop");
  char c = 0;
  ssize_t r;
  do {
    r = read(wakeRead, &c, 1);
  } while (r < 0 && errno == EINTR);
  if (r != 1) {
    MORI_LOG_WARN(Core, "the stop watcher's pipe failed (%s): SIGTERM and SIGINT no longer stop device waits first",
                  r == 0 ? "closed" : strerror(errno));
    return;
  }
  const int sig = static_cast<int>(c);
  StopWaitsAndEnd(sig, (std::string("received ") + SignalName(sig)).c_str());
}

}  // namespace

const uint32_t* DeviceStopWord() {
  std::call_once(wordOnce, MakeWord);
  return deviceWord;
}

bool StopRequested() { return requested.load(std::memory_order_acquire); }

bool InstallStopOnSignals() {
  std::lock_guard<std::mutex> lock(installMutex);
  if (installTried) return !handledSignals.empty();
  installTried = true;
  if (!EnvGetBool("MORI_STOP_ON_SIGNAL")) return false;
  drainMs = EnvGetInt("MORI_STOP_DRAIN_MS");
  MORI_CHECK(drainMs >= 0, ErrorCode::InvalidUsage, "MORI_STOP_DRAIN_MS=%lld must not be negative",
             static_cast<long long>(drainMs));
  DeviceStopWord();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    MORI_LOG_WARN(Core, "no stop on SIGTERM/SIGINT: pipe failed (%s)", strerror(errno));
    return false;
  }
  wakeRead = fds[0];
  wakeWrite = fds[1];
  std::thread(Watch).detach();  // blocked in read() until a signal; must not hold the process at exit
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, ForgetInChild);
    std::atexit(HoldExitWhileStopping);
    previousTerminate = std::set_terminate(HoldTerminateWhileStopping);
  });
  std::string names;
  for (int sig : kStopSignals) {
    struct sigaction old{};
    if (sigaction(sig, nullptr, &old) != 0) continue;
    const bool dflt = (old.sa_flags & SA_SIGINFO) == 0 && old.sa_handler == SIG_DFL;
    if (!dflt) {
      MORI_LOG_DEBUG(Core, "%s keeps the application's handler: no stop of device waits on it", SignalName(sig));
      continue;
    }
    struct sigaction sa{};
    sa.sa_handler = OnStopSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(sig, &sa, nullptr) == 0) {
      names += names.empty() ? "" : ", ";
      names += SignalName(sig);
      handledSignals.push_back(sig);
    }
  }
  MORI_LOG_DEBUG(Core, "stops device waits before ending on: %s", names.empty() ? "(none)" : names.c_str());
  return !handledSignals.empty();
}

void StopWaitsAndEnd(int sig, const char* why) {
  requested.store(true, std::memory_order_release);
  if (!wordMade.load(std::memory_order_acquire)) {
    // No kernel of mori's can be waiting (the runtime never made the word): making one now would create a
    // GPU context on a dying process.
    MORI_LOG_WARN(Core, "%s: no device waits to stop; ending with %s", why, SignalName(sig));
    std::fflush(stderr);
    EndWith(sig);
  }
  SetWord(1);
  double waitedMs = 0;
  const bool idle = DrainDevice(&waitedMs);
  if (idle) {
    // The context is left to the process's end: destroying it here freed memory that the process's other
    // threads (an emulated NIC, a proxy) still read, and they crashed (SIGSEGV on an H100, rdma and proxy).
    MORI_LOG_WARN(Core, "%s: device waits stopped, the device was idle after %.1f ms; ending with %s", why,
                  waitedMs, SignalName(sig));
  } else {
    MORI_LOG_WARN(Core, "%s: device waits stopped, but the device was still busy after %.0f ms (a kernel "
                  "waiting outside mori's waits?); ending with %s", why, waitedMs, SignalName(sig));
  }
  std::fflush(stderr);
  EndWith(sig);
}

namespace detail {
void SetStopWordForTesting(bool stop) {
  DeviceStopWord();
  SetWord(stop ? 1 : 0);
}
}  // namespace detail

}  // namespace mori::core
