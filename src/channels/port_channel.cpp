// A port channel's host object: which semaphore, FIFO and memories its device handle names.
#include "mori/channels/port_channel.hpp"

#include <utility>

#include "mori/core/errors.hpp"

namespace mori::core {

PortChannel::PortChannel(SemaphoreId semaphoreId, std::shared_ptr<Semaphore> semaphore, FifoDeviceHandle fifo,
                         MemoryId dst, MemoryId src)
    : PortChannel(semaphoreId, std::move(semaphore), fifo, dst, src, FifoOrder::AfterWrites) {}

PortChannel::PortChannel(SemaphoreId semaphoreId, std::shared_ptr<Semaphore> semaphore, FifoDeviceHandle fifo,
                         MemoryId dst, MemoryId src, FifoOrder putOrder)
    : semaphoreId_(semaphoreId),
      semaphore_(std::move(semaphore)),
      fifo_(fifo),
      dst_(dst),
      src_(src),
      putOrder_(putOrder) {
  MORI_CHECK(semaphore_ != nullptr, ErrorCode::InvalidUsage, "PortChannel on semaphore id %u: no semaphore (nullptr)",
             semaphoreId);
  MORI_CHECK(fifo_.triggers != nullptr, ErrorCode::InvalidUsage,
             "PortChannel on semaphore id %u: no FIFO (make port channels with ProxyService::PortChannel)",
             semaphoreId);
  MORI_CHECK(semaphoreId < kMaxProxySemaphores && dst < kMaxProxyMemories && src < kMaxProxyMemories,
             ErrorCode::InvalidUsage,
             "PortChannel: ids semaphore %u, dst %u, src %u do not fit a request (at most %u semaphores, %u memories)",
             semaphoreId, dst, src, kMaxProxySemaphores, kMaxProxyMemories);
  MORI_CHECK(putOrder == FifoOrder::AfterWrites || putOrder == FifoOrder::AfterDeviceWrites, ErrorCode::InvalidUsage,
             "PortChannel on semaphore id %u: a put's order must be AfterWrites or AfterDeviceWrites (%d: a put "
             "names data the proxy reads)",
             semaphoreId, static_cast<int>(putOrder));
}

PortChannelDeviceHandle PortChannel::DeviceHandle() const {
  MORI_CHECK(semaphore_ != nullptr, ErrorCode::InvalidUsage,
             "PortChannel::DeviceHandle of an empty channel (made by the default constructor)");
  PortChannelDeviceHandle h{};
  h.semaphoreId = semaphoreId_;
  h.dst = dst_;
  h.src = src_;
  h.putOrder = static_cast<uint32_t>(putOrder_);
  h.semaphore = semaphore_->DeviceHandle();
  h.fifo = fifo_;
  return h;
}

}  // namespace mori::core
