// The RDMA layer's host side: find NICs, open them, create endpoints (a QP with its CQ) whose queues a GPU
// can drive itself, connect them, register memory. Three backends share these classes:
//   DirectVerbs  a real mlx5 NIC through rdma-core's mlx5dv; the GPU posts (IBGDA)
//   IBVerbs      any verbs NIC through libibverbs; the host posts (what a CPU proxy uses)
//   Emulated     a software NIC in this process that executes the mlx5 queues the GPU writes
// A backend that cannot run here has an empty device list and says why in a log line; Emulated always
// has a device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mori/rdma/queue_handles.hpp"

namespace mori::rdma {

enum class RdmaBackendType { DirectVerbs, IBVerbs, Emulated };
const char* RdmaBackendName(RdmaBackendType backend);
// The backend MORI_RDMA_BACKEND asks for: DirectVerbs or IBVerbs when a NIC exists, else Emulated ("auto").
RdmaBackendType RdmaBackendFromEnvironment();

// Memory-region access rights (the values of ibv_access_flags).
enum RdmaAccess : uint32_t {
  kRdmaAccessLocalWrite = 1,
  kRdmaAccessRemoteWrite = 2,
  kRdmaAccessRemoteRead = 4,
  kRdmaAccessRemoteAtomic = 8,
};
constexpr uint32_t kRdmaAccessAll =
    kRdmaAccessLocalWrite | kRdmaAccessRemoteWrite | kRdmaAccessRemoteRead | kRdmaAccessRemoteAtomic;

struct RdmaEndpointConfig {
  uint32_t portId = 1;
  int gidIdx = -1;             // -1: MORI_RDMA_GID_INDEX, else the first RoCE v2 GID
  uint32_t maxMsgsNum = 1024;  // send-queue depth (rounded up to a power of two)
  uint32_t maxRecvNum = 256;   // receive-queue depth (rounded up to a power of two)
  uint32_t maxCqeNum = 4096;   // completion-queue depth (rounded up to a power of two)
  uint32_t maxMsgSge = 1;
  uint32_t maxInlineData = 28;
  uint32_t alignment = 4096;
  bool onGpu = false;          // queues, doorbell record and doorbell made reachable from GPU threads
};

class RdmaDevice;
class RdmaDeviceContext;

// One QP and its CQ. `handle` goes to the peer; `wqHandle` / `cqHandle` are what posting code (a kernel, or
// a host thread) works on: copy them to memory the posting threads share.
struct RdmaEndpoint {
  RdmaEndpointHandle handle{};
  WorkQueueHandle wqHandle{};
  CompletionQueueHandle cqHandle{};
  ProviderType GetProviderType() const { return static_cast<ProviderType>(handle.provider); }
};

// A work request posted from the host (IBVerbs through ibv_post_send; Emulated through the mlx5 queues).
enum class HostOp : uint32_t { Write, WriteInline, Read, Send, FetchAdd, CompareSwap, Nop };
struct HostWorkRequest {
  HostOp op = HostOp::Write;
  uintptr_t laddr = 0;
  uint32_t lkey = 0;
  uintptr_t raddr = 0;
  uint32_t rkey = 0;
  size_t bytes = 0;
  uint64_t swapAdd = 0;  // FetchAdd addend, CompareSwap new value
  uint64_t compare = 0;  // CompareSwap expected value
  const void* inlineData = nullptr;
  uint64_t wrId = 0;
  bool signaled = true;
};
struct HostCompletion {
  uint64_t wrId;
  int status;  // 0, or the mlx5 syndrome (verbs status mapped to it) of an error completion
  bool isReceive;
  uint32_t bytes;
};

class RdmaDeviceContext {
 public:
  virtual ~RdmaDeviceContext() = default;

  virtual RdmaEndpoint CreateRdmaEndpoint(const RdmaEndpointConfig& config) = 0;
  // RESET -> INIT -> RTR -> RTS against the peer's handle.
  virtual void ConnectEndpoint(const RdmaEndpointHandle& local, const RdmaEndpointHandle& remote) = 0;
  virtual void DestroyRdmaEndpoint(const RdmaEndpointHandle& local) = 0;
  // What the peer of a connected endpoint is called in messages ("rank 3"); a backend may ignore it. The
  // emulated NIC uses it to say which peer it lost (EmulatedNicPeerLosses).
  virtual void NameRemote(const RdmaEndpointHandle& local, const std::string& name) {
    (void)local;
    (void)name;
  }

  virtual RdmaMemoryRegion RegisterRdmaMemoryRegion(void* ptr, size_t bytes, uint32_t access = kRdmaAccessAll) = 0;
  virtual void DeregisterRdmaMemoryRegion(void* ptr) = 0;

  // Posting and polling from a host thread (one thread per endpoint at a time).
  virtual void HostPost(RdmaEndpoint& ep, const HostWorkRequest& wr) = 0;
  virtual void HostPostRecv(RdmaEndpoint& ep, uintptr_t laddr, uint32_t lkey, size_t bytes, uint64_t wrId) = 0;
  virtual int HostPoll(RdmaEndpoint& ep, HostCompletion* out, int maxCompletions) = 0;

  RdmaDevice* GetRdmaDevice() const { return device_; }

 protected:
  explicit RdmaDeviceContext(RdmaDevice* device) : device_(device) {}

 private:
  RdmaDevice* device_;
};

class RdmaDevice {
 public:
  virtual ~RdmaDevice();

  const std::string& Name() const { return name_; }
  RdmaBackendType Backend() const { return backend_; }
  // Ports that are up.
  virtual std::vector<uint32_t> ActivePorts() const = 0;
  // The device keeps the context; it lives until the RdmaContext does.
  RdmaDeviceContext* CreateRdmaDeviceContext();

 protected:
  RdmaDevice(std::string name, RdmaBackendType backend) : name_(std::move(name)), backend_(backend) {}
  virtual std::unique_ptr<RdmaDeviceContext> NewContext() = 0;

 private:
  std::string name_;
  RdmaBackendType backend_;
  std::vector<std::unique_ptr<RdmaDeviceContext>> contexts_;
};

using RdmaDeviceList = std::vector<RdmaDevice*>;
using ActiveDevicePort = std::pair<RdmaDevice*, uint32_t>;
using ActiveDevicePortList = std::vector<ActiveDevicePort>;

ActiveDevicePortList GetActiveDevicePortList(const RdmaDeviceList& devices);

class RdmaContext {
 public:
  explicit RdmaContext(RdmaBackendType backend);
  ~RdmaContext();
  RdmaContext(const RdmaContext&) = delete;
  RdmaContext& operator=(const RdmaContext&) = delete;

  RdmaBackendType Backend() const { return backend_; }
  // Empty when this backend has no usable device here (the reason is logged).
  const RdmaDeviceList& GetRdmaDeviceList() const { return list_; }

 private:
  RdmaBackendType backend_;
  std::vector<std::unique_ptr<RdmaDevice>> devices_;
  RdmaDeviceList list_;
};

}  // namespace mori::rdma
