// DeviceScope: makes a GPU current for the calls of one scope on the calling thread and gives the thread's
// previous device back after. Host code that works on a given GPU from a thread it does not own (a proxy, the
// emulated NIC's engine, a connection's method) uses it, since a stream or a copy must be used with its own
// device current. On HOST there is one device, 0.
#pragma once

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"

namespace mori::core {

class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    MORI_CHECK_GPU(GpuGetDevice(&previous_));
    if (previous_ != device_) MORI_CHECK_GPU(GpuSetDevice(device_));
  }
  ~DeviceScope() {
    if (previous_ != device_) (void)GpuSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  int device_ = 0;
};

}  // namespace mori::core
