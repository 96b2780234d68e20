// What mori's SHMEM benchmark programs share beyond shmem_bench_common.hpp (which the NVSHMEM program
// includes too, so it holds nothing of mori's): a stream whose enqueued work is timed with GPU events, and
// symmetric allocation that names the heap size when it fails.
#pragma once

#include <cstddef>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::bench {

class StreamTimer {
 public:
  StreamTimer() {
    MORI_CHECK_GPU(core::GpuStreamCreate(&stream_));
    MORI_CHECK_GPU(core::GpuEventCreate(&start_));
    MORI_CHECK_GPU(core::GpuEventCreate(&stop_));
  }
  ~StreamTimer() {
    (void)core::GpuEventDestroy(stop_);
    (void)core::GpuEventDestroy(start_);
    (void)core::GpuStreamDestroy(stream_);
  }
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;

  core::GpuStream Stream() const { return stream_; }

  // The GPU work of this PE is done and every PE got here.
  void Barrier() {
    MORI_CHECK_GPU(core::GpuStreamSynchronize(stream_));
    shmem::ShmemBarrierAll();
  }

  // Milliseconds between events recorded around what `launch` enqueues on the stream.
  template <typename Launch>
  double TimeMs(Launch&& launch) {
    MORI_CHECK_GPU(core::GpuEventRecord(start_, stream_));
    launch();
    MORI_CHECK_GPU(core::GpuGetLastError());
    MORI_CHECK_GPU(core::GpuEventRecord(stop_, stream_));
    MORI_CHECK_GPU(core::GpuEventSynchronize(stop_));
    MORI_CHECK_GPU(core::GpuStreamSynchronize(stream_));  // a kernel that trapped fails here, before it is reported
    float ms = 0;
    MORI_CHECK_GPU(core::GpuEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  core::GpuStream stream_{};
  core::GpuEvent start_{}, stop_{};
};

// `bytes` of the symmetric heap (zeroed when asked); a heap too small is an error naming its size and `hint`.
// `alignment` 0 takes ShmemMalloc's own.
template <typename T>
T* SymmetricAlloc(size_t bytes, bool zero, const char* hint = "", size_t alignment = 0) {
  void* p = alignment != 0 ? shmem::ShmemMallocAlign(alignment, bytes)
            : zero         ? shmem::ShmemCalloc(1, bytes)
                           : shmem::ShmemMalloc(bytes);
  if (p != nullptr && alignment != 0 && zero) MORI_CHECK_GPU(core::GpuMemset(p, 0, bytes));
  MORI_CHECK(p != nullptr, core::ErrorCode::InvalidUsage,
             "the symmetric heap (%zu bytes) cannot hold %zu more bytes: raise MORI_SHMEM_HEAP_SIZE%s",
             shmem::ShmemHeapBytes(), bytes, hint);
  return static_cast<T*>(p);
}

}  // namespace mori::bench
