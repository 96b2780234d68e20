// The host side of a proxy FIFO: the ring of triggers in host-pinned memory, the claim counter in device
// memory and the popped counter the producers read. One host thread consumes.
#pragma once

#include <cstdint>
#include <memory>

#include "mori/core/errors.hpp"
#include "mori/channels/fifo_device.hpp"
#include "mori/channels/proxy_trigger.hpp"

namespace mori::core {

constexpr uint32_t kDefaultFifoSize = 512;

class Fifo {
 public:
  // `size`: a power of two, at least 2. `timeoutSeconds` bounds the producers' waits (0: MORI_TIMEOUT_S).
  explicit Fifo(uint32_t size = kDefaultFifoSize, double timeoutSeconds = 0);
  ~Fifo();
  Fifo(const Fifo&) = delete;
  Fifo& operator=(const Fifo&) = delete;

  // The trigger in slot Tail() + k, once its producer has written it whole (lap bit cleared in the copy).
  bool Poll(ProxyTrigger* out, uint32_t k = 0) const;
  // Hands the `n` oldest slots back to the producers (publishes the new tail).
  void Pop(uint32_t n = 1);
  uint64_t Tail() const;
  // Slots claimed by producers so far (read from device memory).
  uint64_t Head() const;
  uint32_t Size() const;
  // Tells waiting producers that the consumer is gone for good (they trap naming it instead of timing out).
  void MarkFailed();
  // The same, naming the kind of failure in the producers' message.
  void MarkFailed(ErrorCode cause);

  FifoDeviceHandle DeviceHandle() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core
