// A memory channel: kernels copy straight into the peer's memory (mapped here through CudaIpc) and signal it
// through a semaphore. Made from a semaphore over a CudaIpc connection, the peer's memory (RecvMemory) and
// this side's; packets the peer sends land in `packetBuffer` (default: this side's memory).
#pragma once

#include <cstddef>
#include <memory>

#include "mori/channels/memory_channel_device.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/channels/semaphore.hpp"

namespace mori::core {

class MemoryChannel {
 public:
  MemoryChannel() = default;
  // Throws InvalidUsage when the semaphore's connection is not CudaIpc, `dst` is not mapped here or `src` is
  // not local memory.
  MemoryChannel(std::shared_ptr<Semaphore> semaphore, RegisteredMemory dst, RegisteredMemory src,
                void* packetBuffer = nullptr, size_t packetBufferBytes = 0);

  MemoryChannelDeviceHandle DeviceHandle() const;
  const std::shared_ptr<Semaphore>& GetSemaphore() const { return semaphore_; }

 private:
  std::shared_ptr<Semaphore> semaphore_;
  RegisteredMemory dst_;
  RegisteredMemory src_;
  MemoryChannelDeviceHandle handle_{};
};

}  // namespace mori::core
