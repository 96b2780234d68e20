// Kernel times as a profiler reports them: CUPTI's activity records give each kernel's start (its first block)
// and end (its last block) on the GPU's clock, without the launches and events around them. The EP benchmark
// uses them to report a call's kernels the way DeepEP's and MORI's kernel figures are measured (a profiler's
// kernel durations), beside its event-timed figure. CUDA only; CUPTI is loaded at run time (dlopen; the library
// named by MORI_CUPTI_LIB, else the usual places), so the benchmark builds and runs without it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#if MORI_BACKEND_CUDA
#include <cupti_activity.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#endif

namespace mori::bench {

struct KernelRecord {
  uint64_t start = 0, end = 0;  // ns, GPU clock
  std::string name;             // mangled
};

#if MORI_BACKEND_CUDA
class KernelSpans {
 public:
  // Loads CUPTI and records every kernel from now on; false, with the reason in *why, where it cannot.
  bool Start(std::string* why) {
    const char* named = std::getenv("MORI_CUPTI_LIB");
    const char* candidates[] = {named, "libcupti.so", "libcupti.so.13", "libcupti.so.12",
                                "/usr/local/cuda/lib64/libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"};
    for (const char* c : candidates) {
      if (c != nullptr && (lib_ = dlopen(c, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    }
    if (lib_ == nullptr) {
      *why = "no CUPTI library found (set MORI_CUPTI_LIB to libcupti.so's path)";
      return false;
    }
    if (!Find(&register_, "cuptiActivityRegisterCallbacks") || !Find(&enable_, "cuptiActivityEnable") ||
        !Find(&disable_, "cuptiActivityDisable") || !Find(&flush_, "cuptiActivityFlushAll") ||
        !Find(&next_, "cuptiActivityGetNextRecord")) {
      *why = "the CUPTI library lacks the activity API";
      return false;
    }
    Self() = this;
    if (register_(&Requested, &Completed) != CUPTI_SUCCESS ||
        enable_(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
      *why = "CUPTI refused to record kernels (another profiler attached?)";
      return false;
    }
    return true;
  }

  // The records of the kernels completed since the last call (the caller has synchronised their streams).
  std::vector<KernelRecord> Take() {
    flush_(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<KernelRecord> out;
    out.swap(records_);
    return out;
  }

  ~KernelSpans() {
    if (disable_ != nullptr && Self() == this) {
      disable_(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      flush_(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
      Self() = nullptr;
    }
  }

 private:
  static constexpr size_t kBufferBytes = 4u << 20;

  template <typename F>
  bool Find(F* f, const char* name) {
    *f = reinterpret_cast<F>(dlsym(lib_, name));
    return *f != nullptr;
  }

  static KernelSpans*& Self() {
    static KernelSpans* self = nullptr;
    return self;
  }

  static void CUPTIAPI Requested(uint8_t** buffer, size_t* size, size_t* maxRecords) {
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
    *size = *buffer != nullptr ? kBufferBytes : 0;
    *maxRecords = 0;
  }

  // Only the fields every version of the kernel record has at the same place (start, end, name) are read: the
  // CUPTI found at run time may be of another CUDA release than the header.
  static void CUPTIAPI Completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    KernelSpans* self = Self();
    if (self != nullptr) {
      std::lock_guard<std::mutex> lock(self->mutex_);
      CUpti_Activity* record = nullptr;
      while (self->next_(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        self->records_.push_back(KernelRecord{k->start, k->end, k->name != nullptr ? k->name : ""});
      }
    }
    std::free(buffer);
  }

  void* lib_ = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_ = nullptr;
  decltype(&cuptiActivityEnable) enable_ = nullptr;
  decltype(&cuptiActivityDisable) disable_ = nullptr;
  decltype(&cuptiActivityFlushAll) flush_ = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_ = nullptr;
  std::mutex mutex_;
  std::vector<KernelRecord> records_;
};
#endif

}  // namespace mori::bench
