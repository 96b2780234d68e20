// The RDMA connection of the channel layer: a core::Connection whose work requests a host thread (the proxy)
// posts on one RC queue pair of a real NIC (IBVerbs) or of the emulated NIC, with flow control against the
// send-queue depth, selective signaling, and NIC atomics whose old values land in a registered slot ring.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mori/channels/connection.hpp"
#include "mori/core/timeout.hpp"
#include "mori/rdma/rdma.hpp"
#include "registered_memory_impl.hpp"

namespace mori::core {

// What the two sides of an RDMA connection tell each other (sent under the Connect exchange's bootstrap tag).
struct RdmaPeerInfo {
  uint32_t magic;
  uint32_t version;
  rdma::RdmaEndpointHandle handle;
  uint32_t backend;    // rdma::RdmaBackendType of the NIC behind the endpoint
  uint32_t transport;  // Transport the peer connected with (its IB index may differ from ours)
};

class RdmaConnection : public Connection {
 public:
  // Takes over `endpoint` (already connected to the peer's) on `nic`; destroys it when destroyed.
  // `alive` expires with the communicator that owns `nic`: the connection is unusable after that.
  // Loopback (remoteRank is this process's rank): `answerer` is the second endpoint of `nic`, the one
  // `endpoint` is connected to; it only answers (its NIC serves the requests) and goes with the connection.
  // The peer's memory is then this process's own registered memory.
  RdmaConnection(rdma::RdmaDeviceContext* nic, std::weak_ptr<int> alive, const rdma::RdmaEndpoint& endpoint,
                 const EndpointConfig& config, Transport remoteTransport, int remoteRank, int tag,
                 const rdma::RdmaEndpoint* answerer = nullptr);
  ~RdmaConnection() override;
  RdmaConnection(const RdmaConnection&) = delete;
  RdmaConnection& operator=(const RdmaConnection&) = delete;

  void Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
             uint64_t bytes) override;
  void UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) override;
  void Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
            uint64_t bytes) override;
  void AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) override;
  void AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                         uint64_t* result) override;
  void Flush(int64_t timeoutUs = -1) override;

  Transport GetTransport() const override { return transport_; }
  Transport GetRemoteTransport() const override { return remoteTransport_; }
  // "IB0 (emulated NIC) to rank 1, qp 4660" ("... to itself (loopback), qp 4660").
  std::string Describe() const override;

  rdma::RdmaDeviceContext* Nic() const { return nic_; }
  uint32_t Qpn() const { return endpoint_.handle.qpn; }
  // Work requests the NIC may still hold (posted, completion not yet seen).
  uint64_t Outstanding() const { return posted_ - retired_; }

 private:
  // What a posted work request was, kept until it retires: for error messages and atomic results.
  struct Pending {
    rdma::HostOp op = rdma::HostOp::Nop;
    uint64_t bytes = 0;
    uint64_t raddr = 0;
    uint64_t* result = nullptr;  // an atomic's caller-side destination of the old value
  };

  // (address, key) of [offset, + bytes) of `memory` as the post needs it; InvalidUsage naming what is wrong.
  const RdmaRegistration& LocalRegistration(const RegisteredMemory& memory, uint64_t offset, uint64_t bytes,
                                            const char* role) const;
  const RdmaRegistration& RemoteRegistration(const RegisteredMemory& memory, uint64_t offset, uint64_t bytes,
                                             const char* role) const;
  void PostAtomic(rdma::HostOp op, const RegisteredMemory& dst, uint64_t dstOffset, uint64_t swapAdd, uint64_t compare,
                  uint64_t* result);
  // Posts one work request (wrId and signaling chosen here), waiting for room in the send queue first.
  // A Write or Read of [laddr, + bytes) <-> [raddr, + bytes), in requests of at most the NIC's message size.
  void PostTransfer(rdma::HostOp op, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint64_t bytes);
  void Post(rdma::HostWorkRequest wr, const Pending& what, const Deadline& deadline);
  void WaitForRoom(const Deadline& deadline);
  // Takes the completions available now; false when there were none.
  bool PollOnce();
  void Retire(uint64_t upTo);
  void Fail(const rdma::HostCompletion& completion);
  // Throws the first error completion's RdmaError again, or InvalidUsage once the communicator is gone.
  void CheckUsable() const;
  uint64_t* Slot(uint64_t wrId) { return &slots_[(wrId - 1) % depth_]; }
  static void Backoff(uint64_t& idlePolls);

  rdma::RdmaDeviceContext* nic_;
  std::weak_ptr<int> alive_;
  rdma::RdmaEndpoint endpoint_;
  bool loopback_;
  rdma::RdmaEndpoint answerer_{};  // loopback only
  Transport transport_;
  Transport remoteTransport_;
  bool emulated_;
  std::string nicLabel_;  // "emulated NIC" or the device's name (kept: the device may go before this)
  int localSlot_;
  int remoteSlot_;
  uint32_t depth_;        // most work requests outstanding at once (EndpointConfig::ib.maxSendWr)
  uint32_t signalEvery_;  // a completion is requested at least every this many work requests
  uint32_t inlineLimit_;

  // Work requests are numbered from 1 in posting order (the wrId). RC completes them in order, so a
  // completion for id k retires every id <= k.
  uint64_t posted_ = 0;
  uint64_t retired_ = 0;
  uint64_t lastSignaled_ = 0;
  uint32_t sinceSignal_ = 0;
  std::vector<Pending> pending_;  // by (wrId - 1) % depth_
  std::vector<rdma::HostCompletion> completions_;

  // One registered 8-byte slot per outstanding work request: atomics' old values, UpdateAndSync staging when
  // the QP has no inline room. Slot of id k is reused by id k + depth_, which is posted only after k retired.
  std::unique_ptr<uint64_t[]> slots_;
  rdma::RdmaMemoryRegion slotsRegion_{};

  bool failed_ = false;
  int failStatus_ = 0;
  std::string failMessage_;
};

}  // namespace mori::core
