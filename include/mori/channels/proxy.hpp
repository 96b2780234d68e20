// Proxies: a host thread that pops one FIFO and executes what kernels asked for. `Proxy` is the thread and
// the FIFO, with the request handler left to subclasses (custom request types); `ProxyService` executes port
// channel requests (data, signal, flush) over the connections of the semaphores added to it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "mori/channels/fifo.hpp"
#include "mori/channels/proxy_trigger.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/channels/semaphore.hpp"

namespace mori::core {

class PortChannel;

class Proxy {
 public:
  // `device`: the GPU whose kernels push (the thread is pinned to the CPUs near it); -1: the current device.
  explicit Proxy(uint32_t fifoSize = kDefaultFifoSize, int device = -1);
  virtual ~Proxy();  // stops the thread (without draining) if it still runs
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  void StartProxy();
  // Handles every trigger pushed before the call (bounded by MORI_TIMEOUT_S), then stops the thread. Throws
  // the handler's error if the thread failed (the FIFO's producers were told and trap).
  void StopProxy();
  bool Running() const;

  Fifo& GetFifo() { return *fifo_; }
  FifoDeviceHandle FifoHandle() const { return fifo_->DeviceHandle(); }
  // The GPU whose kernels push.
  int Device() const { return device_; }
  // Triggers handled so far (slots popped).
  uint64_t Handled() const;

 protected:
  // Called on the proxy thread for the trigger at the FIFO's tail (its lap bit cleared). Returns how many
  // slots the request used (the tail advances by that many), or 0 when it needs slots that are not written
  // yet (it is called again). Throwing fails the proxy: the error is logged and StopProxy rethrows it.
  virtual uint32_t HandleTrigger(const ProxyTrigger& trigger) = 0;
  // Called on the proxy thread when the FIFO was found empty, and once before the thread ends.
  virtual void OnIdle() {}
  // Stops the thread at once, handling nothing more. A subclass whose handler uses its own members calls it
  // first thing in its destructor (the thread must not run a handler whose object is half destroyed).
  void StopProxyWithoutDraining();

 private:
  void Run();

  std::unique_ptr<Fifo> fifo_;
  int device_;
  struct Thread;
  std::unique_ptr<Thread> thread_;
};

// Executes port channel requests: Data -> Connection::Write, Signal -> Semaphore::Signal, Flush ->
// Connection::Flush (the device's Flush returns once the proxy popped it). Semaphores and memories may be
// added while the proxy runs; ids are dense from 0.
class ProxyService : public Proxy {
 public:
  explicit ProxyService(uint32_t fifoSize = kDefaultFifoSize, int device = -1);
  ~ProxyService() override;

  SemaphoreId AddSemaphore(std::shared_ptr<Semaphore> semaphore);
  MemoryId AddMemory(RegisteredMemory memory);
  std::shared_ptr<Semaphore> GetSemaphore(SemaphoreId id) const;
  RegisteredMemory GetMemory(MemoryId id) const;

  // A channel whose Put copies from memory `src` (local) to `dst` (the peer's) over the semaphore's connection.
  // Where `src` is device memory of this proxy's GPU, its puts fence at device scope (PortChannelDeviceHandle::
  // putOrder), which requires the threads that push them to run on this GPU (as the FIFO's producers do): a
  // thread on another GPU that stores into `src` over the peer link and then puts it needs the system scope,
  // a PortChannel made with FifoOrder::AfterWrites.
  mori::core::PortChannel PortChannel(SemaphoreId semaphore, MemoryId dst, MemoryId src);

 protected:
  uint32_t HandleTrigger(const ProxyTrigger& trigger) override;
  // A request of type 0. The default throws InvalidUsage naming the trigger.
  virtual uint32_t HandleCustomTrigger(const ProxyTrigger& trigger);

 private:
  struct Tables;
  std::unique_ptr<Tables> tables_;
};

}  // namespace mori::core
