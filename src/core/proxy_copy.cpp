#include "proxy_copy.hpp"

#include <pthread.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "mori/core/device_scope.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/format.hpp"
#include "mori/core/logging.hpp"

namespace mori::core {

namespace {

// A positive decimal number, else 0.
long PositiveNumber(const char* text) {
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return *end == '\0' && v > 0 ? v : 0;
}

// Set at load (CUDA builds): the value mori gave CUDA_DEVICE_MAX_CONNECTIONS, empty when none.
std::string& SetAtLoad() {
  static std::string value;
  return value;
}

#if MORI_BACKEND_CUDA
// Before main and so, in every program that does not make CUDA calls from static constructors of its own,
// before the CUDA context that reads the variable (a context made earlier keeps its queues: docs/GUIDE.md).
__attribute__((constructor)) void RaiseCudaConnectionsAtLoad() {
  const std::string value = CudaConnectionsToSet(std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"),
                                                 std::getenv("MORI_CUDA_MAX_CONNECTIONS"), MpsControlRunning());
  if (!value.empty() && setenv("CUDA_DEVICE_MAX_CONNECTIONS", value.c_str(), 0) == 0) SetAtLoad() = value;
}
#endif

// The streams of HostCopyStream, by device. Never destroyed: copies may be made until the process ends, and
// the runtime ends the streams with the process.
struct CopyStreams {
  std::mutex mutex;
  std::map<int, GpuStream> byDevice;
};

CopyStreams& Streams() {
  static CopyStreams* streams = [] {
    // A forked child does not have its parent's streams (on HOST their worker threads stay in the parent);
    // the lock is held across the fork so that the child's copy of it is not left locked by another thread.
    pthread_atfork([] { Streams().mutex.lock(); }, [] { Streams().mutex.unlock(); },
                   [] {
                     Streams().byDevice.clear();
                     Streams().mutex.unlock();
                   });
    return new CopyStreams();
  }();
  return *streams;
}

}  // namespace

std::string CudaConnectionsToSet(const char* current, const char* wanted, bool mps) {
  if (current != nullptr || !mps) return {};
  const long n = wanted == nullptr ? kMpsConnections : PositiveNumber(wanted);
  return n > 0 ? std::to_string(n) : std::string();
}

bool MpsControlRunning() {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string control = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp/nvidia-mps") + "/control";
  struct stat st{};
  return stat(control.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

std::string FewCopyQueuesWarning(const char* current) {
  const long n = PositiveNumber(current);
  if (current == nullptr || (n >= kMinCopyQueues)) return {};
  return StrFormat(
      "CUDA_DEVICE_MAX_CONNECTIONS=%s: with fewer than %d hardware work queues, the copies a proxy makes between "
      "GPU and host memory share a queue with the application's streams and can wait behind a kernel that "
      "waits for them, until the kernel's bounded wait gives up (docs/GUIDE.md); set it to %d or more before "
      "the first CUDA call",
      current, kMinCopyQueues, kMpsConnections);
}

std::string SlowProxyCopyHint(double seconds) {
  if (seconds < kSlowProxyCopyS) return {};
  const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  return StrFormat(
      " (the copy took %.1f s: a copy waits for the running kernels, and a kernel waiting for it then waits until "
      "its bounded wait gives up, when its stream shares one of too few hardware work queues with a kernel's "
      "(CUDA_DEVICE_MAX_CONNECTIONS=%s, at least %d wanted) or when a cudaFree, cudaFreeHost or "
      "cudaHostUnregister runs in this process while a kernel runs: docs/GUIDE.md)",
      seconds, queues != nullptr ? queues : "unset", kMinCopyQueues);
}

GpuStream HostCopyStream(int device) {
  if (device < 0) MORI_CHECK_GPU(GpuGetDevice(&device));
  CopyStreams& streams = Streams();
  std::lock_guard<std::mutex> lock(streams.mutex);
  auto it = streams.byDevice.find(device);
  if (it != streams.byDevice.end()) return it->second;
  DeviceScope scope(device);
  GpuStream stream = nullptr;
  MORI_CHECK_GPU(GpuStreamCreate(&stream));
  streams.byDevice.emplace(device, stream);
  return stream;
}

GpuStatus ThreadWaitEvent(GpuEvent* event) {
  // Set once this thread's cache is destroyed (a plain bool outlives it): a wait after that, from a static
  // object's destructor at process exit, gets an event of its own that is never freed.
  thread_local bool cacheGone = false;
  struct Events {
    std::vector<std::pair<int, GpuEvent>> byDevice;
    ~Events() {
      cacheGone = true;
      // At thread exit; a runtime already gone answers an error, ignored.
      for (auto& entry : byDevice) (void)GpuEventDestroy(entry.second);
    }
  };
  if (cacheGone) return GpuEventCreateNoTiming(event);
  thread_local Events events;
  int device = 0;
  GpuStatus s = GpuGetDevice(&device);
  if (s != kGpuSuccess) return s;
  for (auto& [d, e] : events.byDevice) {
    if (d == device) {
      *event = e;
      return kGpuSuccess;
    }
  }
  GpuEvent e = nullptr;
  s = GpuEventCreateNoTiming(&e);
  if (s != kGpuSuccess) return s;
  events.byDevice.emplace_back(device, e);
  *event = e;
  return kGpuSuccess;
}

GpuStatus TimedStreamCopy(void* dst, const void* src, size_t bytes, GpuStream stream, double* seconds) {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!SetAtLoad().empty()) {
      MORI_LOG_INFO(Gpu, "CUDA_DEVICE_MAX_CONNECTIONS=%s set by mori at load (MPS, the variable unset; "
                    "MORI_CUDA_MAX_CONNECTIONS=0 leaves it unset)", SetAtLoad().c_str());
    }
    const std::string warning = FewCopyQueuesWarning(std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"));
    if (!warning.empty()) MORI_LOG_WARN(Gpu, "%s", warning.c_str());
  });
  const auto start = std::chrono::steady_clock::now();
  // The wait is for this copy (an event after it), not for the whole stream: other threads' copies on a
  // shared stream neither prolong it nor hand it their errors.
  GpuEvent done = nullptr;
  GpuStatus s = ThreadWaitEvent(&done);
  if (s == kGpuSuccess) s = GpuMemcpyAsync(dst, src, bytes, stream);
  if (s == kGpuSuccess) s = GpuEventRecord(done, stream);
  if (s == kGpuSuccess) s = GpuEventSynchronize(done);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

}  // namespace mori::core
