// DeviceSynchronizeBy: GpuDeviceSynchronize on a helper thread, awaited with a deadline.
#include "mori/core/device_sync.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "mori/core/errors.hpp"
#include "mori/core/format.hpp"
#include "service_thread.hpp"

namespace mori::core {

namespace {

struct SyncRequest {
  int device = 0;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  GpuStatus status = kGpuSuccess;
};

// One thread per process that synchronises on request, in order. Never destroyed: a thread blocked in the
// driver cannot be joined at exit, and a forked child (which has no copy of the thread) makes its own.
class SyncWorker {
 public:
  static SyncWorker& OfThisProcess() {
    static std::mutex mutex;
    static SyncWorker* worker = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(mutex);
    if (worker == nullptr || owner != getpid()) {
      worker = new SyncWorker();
      owner = getpid();
    }
    return *worker;
  }

  void Submit(std::shared_ptr<SyncRequest> request) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(request));
    }
    cv_.notify_one();
  }

 private:
  SyncWorker() { std::thread([this] { Run(); }).detach(); }

  void Run() {
    NameThisThread("devsync");
    for (;;) {
      std::shared_ptr<SyncRequest> r;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        r = std::move(queue_.front());
        queue_.pop_front();
      }
      GpuStatus s = GpuSetDevice(r->device);  // the current device is per thread
      if (s == kGpuSuccess) s = GpuDeviceSynchronize();
      {
        std::lock_guard<std::mutex> lock(r->mutex);
        r->status = s;
        r->done = true;
      }
      r->cv.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<SyncRequest>> queue_;
};

}  // namespace

GpuStatus DeviceSynchronizeBy(const Deadline& deadline, const std::string& what) {
  auto request = std::make_shared<SyncRequest>();
  GpuStatus s = GpuGetDevice(&request->device);
  if (s != kGpuSuccess) return s;
  SyncWorker::OfThisProcess().Submit(request);
  std::unique_lock<std::mutex> lock(request->mutex);
  while (!request->done) {
    if (deadline.Expired()) {
      throw TimeoutError(StrFormat("%s: the GPU's kernels and copies had not finished after %.0f s (a kernel that "
                                   "waits without a bound of its own?)",
                                   what.c_str(), deadline.TotalSeconds()));
    }
    request->cv.wait_for(lock, std::chrono::milliseconds(std::max(1, std::min(deadline.RemainingMs(), 100))));
  }
  return request->status;
}

}  // namespace mori::core
