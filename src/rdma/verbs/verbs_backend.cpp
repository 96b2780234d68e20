// The DirectVerbs and IBVerbs backends: real NICs through rdma-core (loaded at run time, verbs_api.hpp).
// Both create RC QPs with libibverbs and connect them with ibv_modify_qp. DirectVerbs then reaches into the
// mlx5 provider (mlx5dv_init_obj) for the send queue, doorbell record, BlueFlame register and CQ buffer, and
// makes them visible to the GPU, which posts and polls with the mlx5 device primitives (IBGDA). IBVerbs
// leaves posting to the host: ibv_post_send / ibv_poll_cq.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>

#include "../backends.hpp"
#include "../mlx5/mlx5_host_queue.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"
#include "mori/core/unique_fd.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"
#include "verbs_api.hpp"
#if MORI_BACKEND_CUDA
#include "../../core/cuda/cuda_driver.hpp"
#endif

namespace mori::rdma {

namespace {

using verbs::VerbsApi;

// The device list stays alive while any device made from it does (ibv_open_device needs its entries).
struct DeviceListHolder {
  ibv_device** list = nullptr;
  ~DeviceListHolder() {
    if (list != nullptr) VerbsApi::Get().freeDeviceList(list);
  }
};

uint32_t MtuBytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 1024;
}

ibv_mtu MtuEnum(uint32_t bytes) {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  return IBV_MTU_256;
}

// Host memory the GPU must reach (queue buffers, doorbell records, the doorbell register).
class GpuVisibleRange {
 public:
  GpuVisibleRange(void* ptr, size_t bytes, bool ioMemory) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    base_ = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(ptr) & ~(page - 1));
    size_t span = (reinterpret_cast<uintptr_t>(ptr) + bytes - reinterpret_cast<uintptr_t>(base_) + page - 1) & ~(page - 1);
#if MORI_BACKEND_CUDA
    unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable | (ioMemory ? cudaHostRegisterIoMemory : 0);
    cudaError_t rc = cudaHostRegister(base_, span, flags);
    if (rc == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();
      registered_ = false;
    } else {
      MORI_CHECK_GPU(rc);
      registered_ = true;
    }
    void* dev = nullptr;
    MORI_CHECK_GPU(cudaHostGetDevicePointer(&dev, ptr, 0));
    device_ = dev;
#elif MORI_BACKEND_HIP
    unsigned flags = hipHostRegisterMapped | hipHostRegisterPortable | (ioMemory ? hipHostRegisterIoMemory : 0);
    hipError_t rc = hipHostRegister(base_, span, flags);
    if (rc == hipErrorHostMemoryAlreadyRegistered) {
      (void)hipGetLastError();
      registered_ = false;
    } else {
      MORI_CHECK_GPU(rc);
      registered_ = true;
    }
    void* dev = nullptr;
    MORI_CHECK_GPU(hipHostGetDevicePointer(&dev, ptr, 0));
    device_ = dev;
#else
    (void)span;
    (void)ioMemory;
    device_ = ptr;
#endif
  }
  ~GpuVisibleRange() {
#if MORI_BACKEND_GPU
    if (registered_) (void)core::GpuHostUnregister(base_);
#endif
  }
  void* DevicePointer() const { return device_; }

 private:
  void* base_ = nullptr;
  void* device_ = nullptr;
  [[maybe_unused]] bool registered_ = false;  // read on GPU backends only
};

class VerbsContext : public RdmaDeviceContext {
 public:
  VerbsContext(RdmaDevice* device, ibv_device* dev, bool direct) : RdmaDeviceContext(device), direct_(direct) {
    const VerbsApi& api = VerbsApi::Get();
    ctx_ = api.openDevice(dev);
    MORI_CHECK(ctx_ != nullptr, core::ErrorCode::Rdma, "ibv_open_device(%s) failed: %s", device->Name().c_str(),
               core::ErrnoString(errno).c_str());
    pd_ = api.allocPd(ctx_);
    if (pd_ == nullptr) {
      api.closeDevice(ctx_);
      MORI_THROW(core::ErrorCode::Rdma, "ibv_alloc_pd on %s failed: %s", device->Name().c_str(),
                 core::ErrnoString(errno).c_str());
    }
  }

  ~VerbsContext() override {
    const VerbsApi& api = VerbsApi::Get();
    for (auto& [addr, mr] : mrs_) api.deregMr(mr);
    for (auto& [qpn, ep] : endpoints_) {
      api.destroyQp(ep.qp);
      api.destroyCq(ep.cq);
    }
    api.deallocPd(pd_);
    api.closeDevice(ctx_);
  }

  RdmaEndpoint CreateRdmaEndpoint(const RdmaEndpointConfig& config) override {
    const VerbsApi& api = VerbsApi::Get();
    std::lock_guard<std::mutex> lock(mutex_);
    ibv_port_attr port{};
    MORI_CHECK(api.queryPort(ctx_, static_cast<uint8_t>(config.portId), &port) == 0, core::ErrorCode::Rdma,
               "ibv_query_port(%s, %u) failed", GetRdmaDevice()->Name().c_str(), config.portId);
    Endpoint ep;
    ep.cq = api.createCq(ctx_, static_cast<int>(config.maxCqeNum), nullptr, nullptr, 0);
    MORI_CHECK(ep.cq != nullptr, core::ErrorCode::Rdma, "ibv_create_cq(%u entries) failed: %s", config.maxCqeNum,
               core::ErrnoString(errno).c_str());
    ibv_qp_init_attr init{};
    init.send_cq = ep.cq;
    init.recv_cq = ep.cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = config.maxMsgsNum;
    init.cap.max_recv_wr = config.maxRecvNum;
    init.cap.max_send_sge = config.maxMsgSge;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = config.maxInlineData;
    ep.qp = api.createQp(pd_, &init);
    if (ep.qp == nullptr) {
      api.destroyCq(ep.cq);
      MORI_THROW(core::ErrorCode::Rdma, "ibv_create_qp (RC, %u send WRs) failed: %s", config.maxMsgsNum,
                 core::ErrnoString(errno).c_str());
    }
    ep.port = config.portId;
    ep.ethernet = port.link_layer == IBV_LINK_LAYER_ETHERNET;
    ep.gidIndex = config.gidIdx >= 0 ? config.gidIdx : static_cast<int>(core::EnvGetInt("MORI_RDMA_GID_INDEX"));
    if (ep.gidIndex < 0) ep.gidIndex = ep.ethernet ? 3 : 0;  // RoCE v2 IPv4 is commonly index 3; IB uses 0
    ep.mtu = MtuBytes(port.active_mtu);

    RdmaEndpoint out;
    out.handle.qpn = ep.qp->qp_num;
    out.handle.psn = std::random_device{}() & 0xffffff;
    out.handle.portId = config.portId;
    out.handle.lid = port.lid;
    out.handle.mtu = ep.mtu;
    out.handle.provider = static_cast<uint32_t>(direct_ ? ProviderType::MLX5 : ProviderType::IBVerbs);
    ibv_gid gid{};
    if (api.queryGid(ctx_, static_cast<uint8_t>(config.portId), ep.gidIndex, &gid) == 0) {
      std::memcpy(out.handle.gid, gid.raw, 16);
    }
    out.wqHandle.qpn = ep.qp->qp_num;
    out.wqHandle.maxInlineData = init.cap.max_inline_data;
    out.wqHandle.stop = core::DeviceStopWord();
    if (direct_) {
      // mori's inline WQEs are one basic block: the device primitives write at most this much inline.
      out.wqHandle.maxInlineData = std::min<uint32_t>(init.cap.max_inline_data, mlx5::kMaxInlineInOneBlock);
      FillMlx5Handles(ep, config, out);
    }
    endpoints_[ep.qp->qp_num] = std::move(ep);
    return out;
  }

  void ConnectEndpoint(const RdmaEndpointHandle& local, const RdmaEndpointHandle& remote) override {
    const VerbsApi& api = VerbsApi::Get();
    std::lock_guard<std::mutex> lock(mutex_);
    Endpoint& ep = Find(local.qpn);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(ep.port);
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    Modify(ep, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");

    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = MtuEnum(std::min(ep.mtu, remote.mtu == 0 ? ep.mtu : remote.mtu));
    a.dest_qp_num = remote.qpn;
    a.rq_psn = remote.psn;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = static_cast<uint8_t>(ep.port);
    a.ah_attr.dlid = remote.lid;
    if (ep.ethernet) {
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid, 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(ep.gidIndex);
      a.ah_attr.grh.hop_limit = 255;
    }
    Modify(ep, a,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
               IBV_QP_MIN_RNR_TIMER,
           "RTR");

    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = local.psn;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 16;
    Modify(ep, a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
           "RTS");
    (void)api;
  }

  void DestroyRdmaEndpoint(const RdmaEndpointHandle& local) override {
    const VerbsApi& api = VerbsApi::Get();
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = endpoints_.find(local.qpn);
    if (it == endpoints_.end()) return;
    api.destroyQp(it->second.qp);
    api.destroyCq(it->second.cq);
    endpoints_.erase(it);
    hostQueues_.Forget(local.qpn);
  }

  RdmaMemoryRegion RegisterRdmaMemoryRegion(void* ptr, size_t bytes, uint32_t access) override {
    const VerbsApi& api = VerbsApi::Get();
    std::lock_guard<std::mutex> lock(mutex_);
    MORI_CHECK(mrs_.count(reinterpret_cast<uintptr_t>(ptr)) == 0, core::ErrorCode::InvalidUsage,
               "%p is already registered", ptr);
    ibv_mr* mr = nullptr;
#if MORI_BACKEND_CUDA
    // GPU memory: dma-buf first (needs no kernel module), peer memory (nvidia_peermem) otherwise.
    cudaPointerAttributes attr{};
    bool device = cudaPointerGetAttributes(&attr, ptr) == cudaSuccess && attr.type == cudaMemoryTypeDevice;
    (void)cudaGetLastError();
    int fd = -1;
    size_t offset = 0;
    if (device && api.regDmabufMr != nullptr && core::cuda::GetDmaBufFd(ptr, bytes, &fd, &offset)) {
      core::UniqueFd owned(fd);
      mr = api.regDmabufMr(pd_, offset, bytes, reinterpret_cast<uint64_t>(ptr), fd, static_cast<int>(access));
      if (mr == nullptr) {
        MORI_LOG_INFO(Rdma, "ibv_reg_dmabuf_mr failed (%s); trying peer-memory registration",
                      core::ErrnoString(errno).c_str());
      }
    }
#endif
    if (mr == nullptr) mr = api.regMr(pd_, ptr, bytes, static_cast<int>(access));
    MORI_CHECK(mr != nullptr, core::ErrorCode::Rdma,
               "registering %zu bytes at %p with %s failed: %s (GPU memory needs dma-buf support or nvidia_peermem)",
               bytes, ptr, GetRdmaDevice()->Name().c_str(), core::ErrnoString(errno).c_str());
    mrs_[reinterpret_cast<uintptr_t>(ptr)] = mr;
    return RdmaMemoryRegion{reinterpret_cast<uintptr_t>(ptr), mr->lkey, mr->rkey, bytes};
  }

  void DeregisterRdmaMemoryRegion(void* ptr) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = mrs_.find(reinterpret_cast<uintptr_t>(ptr));
    MORI_CHECK(it != mrs_.end(), core::ErrorCode::InvalidUsage, "%p is not a registered region", ptr);
    VerbsApi::Get().deregMr(it->second);
    mrs_.erase(it);
  }

  void HostPost(RdmaEndpoint& rep, const HostWorkRequest& wr) override {
    if (direct_) {
      hostQueues_.Post(rep, wr);
      return;
    }
    Endpoint& ep = LockedFind(rep.handle.qpn);
    ibv_sge sge{};
    sge.addr = wr.op == HostOp::WriteInline ? reinterpret_cast<uintptr_t>(wr.inlineData) : wr.laddr;
    sge.length = static_cast<uint32_t>(wr.op == HostOp::FetchAdd || wr.op == HostOp::CompareSwap ? 8 : wr.bytes);
    sge.lkey = wr.lkey;
    ibv_send_wr w{};
    w.wr_id = wr.wrId;
    w.sg_list = wr.op == HostOp::Nop ? nullptr : &sge;
    w.num_sge = wr.op == HostOp::Nop ? 0 : 1;
    w.send_flags = wr.signaled ? IBV_SEND_SIGNALED : 0;
    switch (wr.op) {
      case HostOp::Write:
      case HostOp::WriteInline:
        w.opcode = IBV_WR_RDMA_WRITE;
        if (wr.op == HostOp::WriteInline) w.send_flags |= IBV_SEND_INLINE;
        w.wr.rdma.remote_addr = wr.raddr;
        w.wr.rdma.rkey = wr.rkey;
        break;
      case HostOp::Read:
        w.opcode = IBV_WR_RDMA_READ;
        w.wr.rdma.remote_addr = wr.raddr;
        w.wr.rdma.rkey = wr.rkey;
        break;
      case HostOp::Send:
        w.opcode = IBV_WR_SEND;
        break;
      case HostOp::FetchAdd:
      case HostOp::CompareSwap:
        w.opcode = wr.op == HostOp::FetchAdd ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_ATOMIC_CMP_AND_SWP;
        w.wr.atomic.remote_addr = wr.raddr;
        w.wr.atomic.rkey = wr.rkey;
        w.wr.atomic.compare_add = wr.op == HostOp::FetchAdd ? wr.swapAdd : wr.compare;
        w.wr.atomic.swap = wr.swapAdd;
        break;
      case HostOp::Nop:
        w.opcode = IBV_WR_RDMA_WRITE;  // a zero-length write stands in for a NOP
        break;
    }
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(ep.qp, &w, &bad);
    MORI_CHECK(rc == 0, core::ErrorCode::Rdma, "ibv_post_send on QP %u failed: %s", ep.qp->qp_num,
               core::ErrnoString(rc).c_str());
  }

  void HostPostRecv(RdmaEndpoint& rep, uintptr_t laddr, uint32_t lkey, size_t bytes, uint64_t wrId) override {
    if (direct_) {
      hostQueues_.PostRecv(rep, laddr, lkey, bytes, wrId);
      return;
    }
    Endpoint& ep = LockedFind(rep.handle.qpn);
    ibv_sge sge{laddr, static_cast<uint32_t>(bytes), lkey};
    ibv_recv_wr w{};
    w.wr_id = wrId;
    w.sg_list = &sge;
    w.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    int rc = ibv_post_recv(ep.qp, &w, &bad);
    MORI_CHECK(rc == 0, core::ErrorCode::Rdma, "ibv_post_recv on QP %u failed: %s", ep.qp->qp_num,
               core::ErrnoString(rc).c_str());
  }

  int HostPoll(RdmaEndpoint& rep, HostCompletion* out, int maxCompletions) override {
    if (direct_) return hostQueues_.Poll(rep, out, maxCompletions);
    Endpoint& ep = LockedFind(rep.handle.qpn);
    std::vector<ibv_wc> wcs(static_cast<size_t>(maxCompletions));
    int n = ibv_poll_cq(ep.cq, maxCompletions, wcs.data());
    MORI_CHECK(n >= 0, core::ErrorCode::Rdma, "ibv_poll_cq on QP %u failed", ep.qp->qp_num);
    for (int i = 0; i < n; ++i) {
      out[i].wrId = wcs[i].wr_id;
      out[i].status = verbs::SyndromeOfStatus(wcs[i].status);
      out[i].isReceive = (wcs[i].opcode & IBV_WC_RECV) != 0;
      out[i].bytes = wcs[i].byte_len;
    }
    return n;
  }

 private:
  struct Endpoint {
    ibv_qp* qp = nullptr;
    ibv_cq* cq = nullptr;
    uint32_t port = 1;
    bool ethernet = false;
    int gidIndex = 0;
    uint32_t mtu = 1024;
    std::vector<std::unique_ptr<GpuVisibleRange>> gpuRanges;
  };

  Endpoint& Find(uint32_t qpn) {
    auto it = endpoints_.find(qpn);
    MORI_CHECK(it != endpoints_.end(), core::ErrorCode::InvalidUsage, "QP %u is not one of this context's", qpn);
    return it->second;
  }
  Endpoint& LockedFind(uint32_t qpn) {
    std::lock_guard<std::mutex> lock(mutex_);
    return Find(qpn);
  }

  void Modify(Endpoint& ep, ibv_qp_attr& a, int mask, const char* state) {
    int rc = VerbsApi::Get().modifyQp(ep.qp, &a, mask);
    MORI_CHECK(rc == 0, core::ErrorCode::Rdma, "moving QP %u to %s failed: %s", ep.qp->qp_num, state,
               core::ErrnoString(rc).c_str());
  }

  // The mlx5 queues behind the verbs QP, as the device primitives address them.
  void FillMlx5Handles(Endpoint& ep, const RdmaEndpointConfig& config, RdmaEndpoint& out) {
    mlx5dv_qp dvQp{};
    mlx5dv_cq dvCq{};
    mlx5dv_obj obj{};
    obj.qp.in = ep.qp;
    obj.qp.out = &dvQp;
    obj.cq.in = ep.cq;
    obj.cq.out = &dvCq;
    int rc = VerbsApi::Get().mlx5dvInitObj(&obj, MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ);
    MORI_CHECK(rc == 0, core::ErrorCode::Rdma, "mlx5dv_init_obj on QP %u failed: %s", ep.qp->qp_num,
               core::ErrnoString(rc).c_str());
    MORI_CHECK(dvQp.sq.stride == mlx5::kSendWqeBasicBlock && dvCq.cqe_size == mlx5::kCqeBytes, core::ErrorCode::Rdma,
               "QP %u has %u-byte send WQEs and %u-byte CQEs; mori's primitives need 64 and 64", ep.qp->qp_num,
               dvQp.sq.stride, dvCq.cqe_size);
    void* sq = dvQp.sq.buf;
    void* rq = dvQp.rq.buf;
    void* dbrec = dvQp.dbrec;
    void* bf = dvQp.bf.reg;
    void* cq = dvCq.buf;
    void* cqDbrec = dvCq.dbrec;
    if (config.onGpu) {
      auto visible = [&](void* p, size_t bytes, bool io) {
        ep.gpuRanges.push_back(std::make_unique<GpuVisibleRange>(p, bytes, io));
        return ep.gpuRanges.back()->DevicePointer();
      };
      sq = visible(sq, size_t(dvQp.sq.wqe_cnt) * dvQp.sq.stride, false);
      if (dvQp.rq.wqe_cnt > 0) rq = visible(rq, size_t(dvQp.rq.wqe_cnt) * dvQp.rq.stride, false);
      dbrec = visible(dbrec, 8, false);
      bf = visible(bf, dvQp.bf.size == 0 ? 8 : dvQp.bf.size, true);  // the UAR page is device I/O memory
      cq = visible(cq, size_t(dvCq.cqe_cnt) * dvCq.cqe_size, false);
      cqDbrec = visible(cqDbrec, 8, false);
    }
    out.wqHandle.sqAddr = sq;
    out.wqHandle.sqWqeNum = dvQp.sq.wqe_cnt;
    out.wqHandle.dbrRecAddr = static_cast<uint32_t*>(dbrec) + mlx5::kSendDbrIndex;
    out.wqHandle.dbrAddr = bf;
    out.wqHandle.rqAddr = rq;
    out.wqHandle.rqWqeNum = dvQp.rq.wqe_cnt;
    out.wqHandle.rqDbrRecAddr = static_cast<uint32_t*>(dbrec) + mlx5::kReceiveDbrIndex;
    out.cqHandle.cqAddr = cq;
    out.cqHandle.cqeNum = dvCq.cqe_cnt;
    out.cqHandle.cqeSize = dvCq.cqe_size;
    out.cqHandle.dbrRecAddr = cqDbrec;
  }

  bool direct_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  std::mutex mutex_;
  std::map<uint32_t, Endpoint> endpoints_;
  std::map<uintptr_t, ibv_mr*> mrs_;
  Mlx5HostQueues hostQueues_;
};

class VerbsDevice : public RdmaDevice {
 public:
  VerbsDevice(std::shared_ptr<DeviceListHolder> list, ibv_device* dev, std::string name, bool direct,
              std::vector<uint32_t> ports)
      : RdmaDevice(std::move(name), direct ? RdmaBackendType::DirectVerbs : RdmaBackendType::IBVerbs),
        list_(std::move(list)),
        dev_(dev),
        direct_(direct),
        ports_(std::move(ports)) {}
  std::vector<uint32_t> ActivePorts() const override { return ports_; }

 protected:
  std::unique_ptr<RdmaDeviceContext> NewContext() override {
    return std::make_unique<VerbsContext>(this, dev_, direct_);
  }

 private:
  std::shared_ptr<DeviceListHolder> list_;
  ibv_device* dev_;
  bool direct_;
  std::vector<uint32_t> ports_;
};

// MORI_RDMA_DEVICES: "mlx5_0,mlx5_1" keeps those devices (all when unset).
bool Wanted(const std::string& name) {
  std::string filter = core::EnvGetString("MORI_RDMA_DEVICES");
  if (filter.empty()) return true;
  std::stringstream ss(filter);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.substr(0, item.find(':')) == name) return true;
  }
  return false;
}

}  // namespace

std::vector<std::unique_ptr<RdmaDevice>> EnumerateVerbsDevices(bool direct) {
  std::vector<std::unique_ptr<RdmaDevice>> devices;
  const char* backend = direct ? "DirectVerbs" : "IBVerbs";
  const VerbsApi& api = VerbsApi::Get();
  if (!api.available) {
    MORI_LOG_INFO(Rdma, "%s: no devices: %s", backend, api.whyNot.c_str());
    return devices;
  }
  if (direct && !api.mlx5Available) {
    MORI_LOG_INFO(Rdma, "DirectVerbs: no devices: libmlx5.so.1 (rdma-core's mlx5 provider) cannot be loaded");
    return devices;
  }
  auto holder = std::make_shared<DeviceListHolder>();
  int n = 0;
  holder->list = api.getDeviceList(&n);
  if (holder->list == nullptr || n == 0) {
    MORI_LOG_INFO(Rdma, "%s: no devices: rdma-core sees no RDMA device on this machine", backend);
    return devices;
  }
  for (int i = 0; i < n; ++i) {
    ibv_device* dev = holder->list[i];
    std::string name = api.getDeviceName(dev);
    if (!Wanted(name)) continue;
    bool isMlx5 = api.mlx5dvIsSupported != nullptr ? api.mlx5dvIsSupported(dev) : name.rfind("mlx5", 0) == 0;
    if (direct && !isMlx5) {
      MORI_LOG_INFO(Rdma, "DirectVerbs: %s is not an mlx5 device; skipped", name.c_str());
      continue;
    }
    ibv_context* ctx = api.openDevice(dev);
    if (ctx == nullptr) {
      MORI_LOG_WARN(Rdma, "%s: cannot open %s: %s", backend, name.c_str(), core::ErrnoString(errno).c_str());
      continue;
    }
    ibv_device_attr attr{};
    std::vector<uint32_t> ports;
    if (api.queryDevice(ctx, &attr) == 0) {
      for (uint32_t p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr port{};
        if (api.queryPort(ctx, static_cast<uint8_t>(p), &port) == 0 && port.state == IBV_PORT_ACTIVE) ports.push_back(p);
      }
    }
    api.closeDevice(ctx);
    devices.push_back(std::make_unique<VerbsDevice>(holder, dev, name, direct, ports));
  }
  if (devices.empty()) MORI_LOG_INFO(Rdma, "%s: no usable device among the %d rdma-core lists", backend, n);
  return devices;
}

}  // namespace mori::rdma
