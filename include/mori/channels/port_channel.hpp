// A port channel: puts and signals that a kernel asks a proxy (ProxyService) to carry out over a connection
// (copy engine, RDMA NIC, TCP). Made by ProxyService::PortChannel; its DeviceHandle goes into kernels.
#pragma once

#include <memory>

#include "mori/channels/port_channel_device.hpp"
#include "mori/channels/semaphore.hpp"

namespace mori::core {

class PortChannel {
 public:
  PortChannel() = default;
  // Puts fence with FifoOrder::AfterWrites.
  PortChannel(SemaphoreId semaphoreId, std::shared_ptr<Semaphore> semaphore, FifoDeviceHandle fifo, MemoryId dst,
              MemoryId src);
  // Puts fence with `putOrder` (PortChannelDeviceHandle::putOrder says when AfterDeviceWrites is enough).
  PortChannel(SemaphoreId semaphoreId, std::shared_ptr<Semaphore> semaphore, FifoDeviceHandle fifo, MemoryId dst,
              MemoryId src, FifoOrder putOrder);

  PortChannelDeviceHandle DeviceHandle() const;
  SemaphoreId GetSemaphoreId() const { return semaphoreId_; }
  const std::shared_ptr<Semaphore>& GetSemaphore() const { return semaphore_; }
  FifoOrder PutOrder() const { return putOrder_; }

 private:
  SemaphoreId semaphoreId_ = 0;
  std::shared_ptr<Semaphore> semaphore_;
  FifoDeviceHandle fifo_{};
  MemoryId dst_ = 0;
  MemoryId src_ = 0;
  FifoOrder putOrder_ = FifoOrder::AfterWrites;
};

}  // namespace mori::core
