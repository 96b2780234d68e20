// What a Semaphore holds, shared by semaphore.cpp (which builds it through the communicator) and the fuzz target
// of the port channel proxy (which builds one over a connection of its own).
#pragma once

#include <cstdint>
#include <memory>
#include <thread>

#include "mori/channels/connection.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/channels/semaphore.hpp"
#include "mori/core/atomic.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/format.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core {

class SemaphorePool;  // semaphore.cpp

struct Semaphore::Impl {
  std::shared_ptr<SemaphorePool> pool;  // keeps the token memory alive
  std::shared_ptr<Connection> connection;
  int rank = -1;
  int remoteRank = -1;
  uint64_t* words = nullptr;
  RegisteredMemory localInbound;
  RegisteredMemory remoteInbound;
  // Host-side counts (Signal; Poll and Wait).
  uint64_t hostOutbound = 0;
  uint64_t hostExpected = 0;
  // Reads of a device-memory token from the host: on the process's copy stream (HostCopyStream), so a kernel
  // that spins on another stream never holds them up, each waited for by an event of its own, and a pinned
  // word to land in.
  bool deviceTokens = false;
  GpuStream stream{};
  GpuEvent read{};
  GpuBuffer landing;

  ~Impl() {
    if (deviceTokens && read != nullptr) (void)GpuEventDestroy(read);
  }

  // The copy of a device-memory token has a bound of its own (MORI_TIMEOUT_S): a caller's short wait
  // (Wait(0)) must end as "no signal", not as a copy that could not finish in no time.
  uint64_t LoadInbound() {
    if (!deviceTokens) return AtomicLoad<MemoryOrder::Acquire, Scope::System>(words);
    const Deadline deadline = Deadline::Default();
    uint64_t* out = landing.DataAs<uint64_t>();
    MORI_CHECK_GPU(GpuMemcpyAsync(out, words, sizeof(uint64_t), stream));
    MORI_CHECK_GPU(GpuEventRecord(read, stream));
    for (;;) {
      GpuStatus s = GpuEventQuery(read);
      if (s == kGpuSuccess) break;
      if (s != kGpuErrorNotReady) {
        throw GpuError(s, StrFormat("rank %d: reading the token of the semaphore with rank %d failed: %s", rank,
                                    remoteRank, GpuGetErrorString(s)));
      }
      if (deadline.Expired()) {
        throw TimeoutError(
            StrFormat("rank %d: reading the token of the semaphore with rank %d did not finish in %.0f s", rank,
                      remoteRank, deadline.TotalSeconds()));
      }
      std::this_thread::yield();
    }
    return AtomicLoad<MemoryOrder::Acquire, Scope::System>(out);
  }
};

}  // namespace mori::core
