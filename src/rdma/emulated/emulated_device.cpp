// The Emulated backend's device: always present, one active port, a software NIC per device context.
#include "../backends.hpp"
#include "soft_nic.hpp"

namespace mori::rdma {

namespace {

class EmulatedDevice : public RdmaDevice {
 public:
  EmulatedDevice() : RdmaDevice("emu0", RdmaBackendType::Emulated) {}
  std::vector<uint32_t> ActivePorts() const override { return {1}; }

 protected:
  std::unique_ptr<RdmaDeviceContext> NewContext() override { return std::make_unique<emulated::SoftNic>(this); }
};

}  // namespace

std::vector<std::unique_ptr<RdmaDevice>> EnumerateEmulatedDevices() {
  std::vector<std::unique_ptr<RdmaDevice>> devices;
  devices.push_back(std::make_unique<EmulatedDevice>());
  return devices;
}

EmulatedNicControl* GetEmulatedNicControl(RdmaDeviceContext* context) {
  return dynamic_cast<EmulatedNicControl*>(context);
}

}  // namespace mori::rdma
