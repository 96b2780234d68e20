// Failing loudly from device code: one assert macro for host and device, a trap, a wall clock, and a
// bounded-spin helper so that no device-side wait can hang without saying who it was waiting for.
#pragma once

#include <cstdint>
#include <cstdio>

#include "mori/core/device.hpp"

#include <chrono>
#include <cstdlib>

#include "mori/core/kernel.hpp"

namespace mori::core {

#if MORI_DEVICE_API_AVAILABLE

// Ends the calling kernel with an error the host sees at its next synchronisation. In host code of a GPU
// backend (a host thread using the device primitives) it aborts the process: there is no kernel to end.
[[noreturn]] MORI_HOST_DEVICE_INLINE void DeviceTrap() {
#if MORI_DEVICE_COMPILE && MORI_BACKEND_CUDA
  __trap();
  __builtin_unreachable();
#elif MORI_DEVICE_COMPILE
  __builtin_trap();
#elif MORI_BACKEND_HOST
  throw host::KernelTrap{"device trap"};
#else
  std::abort();
#endif
}

// Nanoseconds of a clock that all threads of one device share (CUDA %globaltimer; the 100 MHz
// s_memrealtime counter of the gfx9 family; the host's steady clock in host code).
MORI_HOST_DEVICE_INLINE uint64_t DeviceWallClockNs() {
#if MORI_DEVICE_COMPILE && MORI_BACKEND_CUDA
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
#elif MORI_DEVICE_COMPILE
  return __builtin_amdgcn_s_memrealtime() * 10ull;
#else
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
#endif
}

// Leaves the kernel without an error because the process is ending (core/stop.hpp): the calling thread
// exits (CUDA `exit`: a CTA barrier stops waiting for it) or its host thread ends and the launch fails (HOST).
// On HIP it returns and the wait goes on (the process's drain bound ends it): `s_endpgm` inside these loops
// crashed HIP 5.2's AMDGPU backend ("failed to annotate CFG") in the SHMEM MPI suite. In host code of a GPU
// backend there is no kernel to leave: it returns, and the process ends around the waiting thread.
MORI_HOST_DEVICE_INLINE void LeaveKernelOnStop() {
#if MORI_DEVICE_COMPILE && MORI_BACKEND_CUDA
  asm volatile("exit;");
#elif MORI_BACKEND_HOST && !MORI_DEVICE_COMPILE
  throw host::KernelTrap{"stopped: the process was asked to end", true};
#endif
}

// Whether LeaveKernelOnStop leaves here: in CUDA device code and in HOST threads, not on HIP (above).
constexpr bool kLeavesOnStop =
    (MORI_DEVICE_COMPILE && MORI_BACKEND_CUDA) || (MORI_BACKEND_HOST && !MORI_DEVICE_COMPILE);

// What a bounded wait does once a stop is requested. Leave: the thread leaves the kernel from inside the wait,
// on its own. Report: the wait ends and says so (SpinDeadline::Stopped), for a thread that waits on behalf of
// a group of lanes or threads: they leave together after it hands them the news, where a leader gone alone
// would leave its siblings a shuffle from an exited lane (an undefined value) or a barrier it never reaches.
enum class OnStop : uint8_t { Leave, Report };

// A deadline for a device-side polling loop. The clock is read every kCheckEvery polls only, so a poll
// stays one load on the fast path. With the process's stop word (core::DeviceStopWord(), carried by the
// device state and the queue, FIFO and semaphore handles), the same check also reads the word and leaves
// the kernel once a stop was requested: a rank asked to end does not spin until MORI_TIMEOUT_S.
class SpinDeadline {
 public:
  static constexpr uint32_t kCheckEvery = 1024;

  MORI_HOST_DEVICE_INLINE explicit SpinDeadline(uint64_t timeoutNs, const uint32_t* stop = nullptr,
                                                OnStop onStop = OnStop::Leave)
      : end_(timeoutNs == 0 ? ~0ull : DeviceWallClockNs() + timeoutNs), stop_(stop), onStop_(onStop) {}

  // True once the deadline has passed; call once per poll. Once a stop was requested it does not return
  // (OnStop::Leave), or returns false from then on with Stopped() true (OnStop::Report, where the thread can
  // leave; on HIP a stop is never reported).
  MORI_HOST_DEVICE_INLINE bool Expired() {
#if !MORI_DEVICE_COMPILE
    // Host threads yield on every poll, so each poll is already slow: check the clock every time.
    ++polls_;
#else
    if (++polls_ % kCheckEvery != 0) return false;
#endif
    if (stop_ != nullptr && StopSet()) {
      if (onStop_ == OnStop::Leave) LeaveKernelOnStop();
      if (kLeavesOnStop) {
        stopped_ = true;
        return false;
      }
    }
    return DeviceWallClockNs() > end_;
  }

  // A stop was requested and this OnStop::Report wait should end: the caller leaves with its group.
  MORI_HOST_DEVICE_INLINE bool Stopped() const { return stopped_; }

 private:
  // The word lives in pinned host memory on GPUs (a volatile load goes there); host threads load it atomically.
  MORI_HOST_DEVICE_INLINE bool StopSet() const {
#if MORI_DEVICE_COMPILE
    return *static_cast<const volatile uint32_t*>(stop_) != 0;
#else
    return __atomic_load_n(stop_, __ATOMIC_RELAXED) != 0;
#endif
  }

  uint64_t end_;
  const uint32_t* stop_;
  uint32_t polls_ = 0;
  OnStop onStop_;
  bool stopped_ = false;
};

#endif  // MORI_DEVICE_API_AVAILABLE

}  // namespace mori::core

// printf from device code: the GPU's printf, stdout on HOST. Assert messages go to stderr on HOST.
#if MORI_BACKEND_HOST
#define MORI_DEVICE_PRINTF(...) (std::fprintf(stdout, __VA_ARGS__), std::fflush(stdout))
#define MORI_DEVICE_ERROR_PRINTF(...) (std::fprintf(stderr, __VA_ARGS__), std::fflush(stderr))
#else
#define MORI_DEVICE_PRINTF(...) printf(__VA_ARGS__)
#define MORI_DEVICE_ERROR_PRINTF(...) printf(__VA_ARGS__)
#endif

// Checks `cond` in device (or host) code; on failure prints the location, the condition and a printf-style
// message (say which rank, peer, address or queue), then traps. The check is one branch predicted not taken;
// the report sits on the cold side (its printf arguments go to the stack frame only when it fails).
#define MORI_DEVICE_ASSERT(cond, fmt, ...)                                                                         \
  do {                                                                                                             \
    if (MORI_UNLIKELY(!(cond))) {                                                                                  \
      MORI_DEVICE_ERROR_PRINTF("[mori device] %s:%d: check `%s` failed: " fmt "\n", __FILE__, __LINE__, #cond,     \
                               ##__VA_ARGS__);                                                                     \
      ::mori::core::DeviceTrap();                                                                                  \
    }                                                                                                              \
  } while (0)
