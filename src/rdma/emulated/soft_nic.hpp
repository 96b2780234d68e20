// The emulated NIC: a device context whose "hardware" is an engine thread. It owns send, receive and
// completion queues in the exact mlx5 layouts (in host-pinned memory that GPU threads can reach), executes
// the WQEs a doorbell announced (its write carries the last WQE's control word, as on mlx5; the doorbell
// record bounds what may be read), in order per QP, and writes mlx5 CQEs. Peers are other emulated NICs,
// reached over a TCP wire. It checks keys, access and bounds like RC hardware and answers a violation with
// an error CQE carrying the mlx5 syndrome, moving the QP to the error state and flushing what follows.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../core/socket.hpp"
#include "../mlx5/mlx5_host_queue.hpp"
#include "faults.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/rdma/emulated.hpp"
#include "mori/rdma/rdma.hpp"
#include "nic_memory.hpp"
#include "wire.hpp"

namespace mori::rdma::emulated {

namespace net = core::net;
using core::UniqueFd;

class SoftNic : public RdmaDeviceContext, public EmulatedNicControl {
 public:
  explicit SoftNic(RdmaDevice* device);
  ~SoftNic() override;

  RdmaEndpoint CreateRdmaEndpoint(const RdmaEndpointConfig& config) override;
  void ConnectEndpoint(const RdmaEndpointHandle& local, const RdmaEndpointHandle& remote) override;
  void NameRemote(const RdmaEndpointHandle& local, const std::string& name) override;
  void DestroyRdmaEndpoint(const RdmaEndpointHandle& local) override;
  RdmaMemoryRegion RegisterRdmaMemoryRegion(void* ptr, size_t bytes, uint32_t access) override;
  void DeregisterRdmaMemoryRegion(void* ptr) override;
  void HostPost(RdmaEndpoint& ep, const HostWorkRequest& wr) override;
  void HostPostRecv(RdmaEndpoint& ep, uintptr_t laddr, uint32_t lkey, size_t bytes, uint64_t wrId) override;
  int HostPoll(RdmaEndpoint& ep, HostCompletion* out, int maxCompletions) override;

  void DropLink() override;
  void RestoreLink() override;
  void SetDelayMicroseconds(uint32_t us) override { delayUs_.store(us); }
  void CorruptNextRemoteKey() override { corruptNextRkey_.store(true); }
  void SetRnrTimeoutMilliseconds(uint32_t ms) override { rnrTimeoutMs_.store(ms); }
  void SetStallReportMilliseconds(uint32_t ms) override { stallReportMs_.store(ms); }
  void SetAckTimeoutMilliseconds(uint32_t ms) override { ackTimeoutMs_.store(ms); }
  void SetFaults(const EmulatedNicFaults& faults) override;
  EmulatedNicStats Stats() const override;

 private:
  using Clock = std::chrono::steady_clock;

  struct Region {
    uintptr_t addr;
    size_t length;
    uint32_t key;
    uint32_t access;
    bool device;
    int gpu;
  };

  struct Link;

  // A request read from a send queue, waiting for its response.
  struct InFlight {
    uint32_t slot;
    uint8_t opcode;
    bool signaled;
    uint32_t psn;
    bool done = false;
    uint8_t syndrome = 0;
    uint32_t byteCount = 0;
    uintptr_t laddr = 0;  // where a read's data or an atomic's original value lands
    uint32_t length = 0;
    uint32_t lkey = 0;    // of the region laddr lies in: looked up again when the response comes
    Clock::time_point sent{};  // when the request went to the link: its ack timer starts here
    uint64_t linkSeq = 0;      // packets released to the link up to this request's (Link::released)
  };

  // A request from a peer, executed in arrival order per QP.
  struct Request {
    PacketHeader header;
    std::vector<uint8_t> payload;
    Link* link;
    Clock::time_point arrived;
  };

  struct Qp {
    uint32_t qpn = 0;
    RdmaEndpointConfig config;
    core::GpuBuffer memory;  // every queue of the QP, host-pinned
    uint8_t* sq = nullptr;
    uint32_t sqDepth = 0;
    uint8_t* rq = nullptr;
    uint32_t rqDepth = 0;
    uint32_t* dbrec = nullptr;  // [0] receive head, [1] send head (big-endian)
    uint64_t* uar = nullptr;    // the doorbell register
    uint8_t* cq = nullptr;
    uint32_t cqDepth = 0;
    uint32_t* cqDbrec = nullptr;
    uint32_t maxInline = 0;

    enum class State { Reset, Ready, Error } state = State::Reset;
    bool connected = false;
    net::SocketAddress remoteAddr;
    uint64_t remoteNonce = 0;  // of the peer's NIC: its requests come on links that said it in their hello
    uint32_t remoteQpn = 0;
    Link* link = nullptr;  // outgoing connection to the peer's NIC
    uint32_t nextPsn = 0;      // requester: PSN of the next request sent
    uint32_t expectedPsn = 0;  // responder: PSN of the next request to execute

    uint32_t sqConsumed = 0;  // next send slot the NIC reads
    uint64_t bell = 0;        // the doorbell register's value last looked at
    uint32_t rung = 0;        // one past the last WQE a valid doorbell announced (16 bits)
    uint32_t rqConsumed = 0;
    uint32_t cqProduced = 0;
    Clock::time_point sqEligible{};  // the delay knob: when the next WQE may execute
    bool waitingDelay = false;
    std::deque<InFlight> inflight;
    Clock::time_point lastResponse{};  // a response restarts the ack timer of what is still outstanding
    bool blocked = false;     // a failed WQE is queued: read no further WQEs until it completes
    std::deque<Request> requests;
    bool cqOverrunWarned = false;
    std::deque<std::array<uint8_t, 64>> pendingCqes;  // CQEs waiting for room in the CQ
    Clock::time_point lastProgress{};  // when this QP last moved (or had nothing to do)
    bool stallReported = false;
  };

  struct Link {
    UniqueFd fd;
    net::SocketAddress peer;
    bool outgoing = false;
    bool greeted = false;     // an accepted link: its hello carried this NIC's nonce (opened ones: always)
    uint64_t peerNonce = 0;   // the nonce of the NIC at the other end
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
    bool dead = false;
    std::string deathReason;
    PacketHeader rxHeader{};
    size_t rxHeaderGot = 0;
    std::vector<uint8_t> rxPayload;
    size_t rxPayloadGot = 0;
    std::deque<std::vector<uint8_t>> tx;
    size_t txOffset = 0;
    // Random faults: packets waiting for their delay to pass (release times never decrease: order is kept), and
    // one packet held back to be sent after the next.
    std::deque<std::pair<std::chrono::steady_clock::time_point, std::vector<uint8_t>>> staged;
    std::chrono::steady_clock::time_point lastRelease{};
    std::vector<uint8_t> held;
    std::chrono::steady_clock::time_point heldSince{};
    std::chrono::steady_clock::time_point txMoved{};  // when the peer last took bytes (a large payload still going)
    // Packets queued to be sent and packets wholly handed to the socket, ever.
    uint64_t released = 0;
    uint64_t written = 0;
  };

  void Run();
  void WatchProgress(Qp& qp, bool moved, Clock::time_point now);
  bool CheckAckTimers(Clock::time_point now);
  uint32_t SendQueueEnd(Qp& qp);
  bool PumpSendQueue(Qp& qp, Clock::time_point now);
  bool PumpRequests(Qp& qp, Clock::time_point now);
  bool PumpCompletions(Qp& qp);
  bool PollLinks(int timeoutMs);
  void ReadLink(Link& link);
  void WriteLink(Link& link);
  void OnPacket(Link& link, PacketHeader& h, std::vector<uint8_t>& payload);
  bool Greet(Link& link, const PacketHeader& h);
  void Refuse(Link& link, const PacketHeader& request);
  void CloseSilentStrangers(Clock::time_point now);
  // `peerGone`: the peer's end closed or broke (its process ended?), recorded for EmulatedNicPeerLosses when QPs
  // here are connected to that NIC.
  void KillLink(Link& link, const std::string& reason, bool peerGone = false);
  void ReapLinks();

  // Requester side.
  bool StartWqe(Qp& qp, uint32_t slot, Clock::time_point now);
  void FailWqe(Qp& qp, uint32_t slot, uint8_t opcode, bool signaled, uint8_t syndrome);
  void OnResponse(Qp& qp, const PacketHeader& h, std::vector<uint8_t>& payload);
  void FailInFlight(Qp& qp, uint8_t syndrome);
  Link* OutgoingLink(Qp& qp);
  void Send(Link& link, const PacketHeader& h, const void* payload, size_t bytes);
  void Transmit(Link& link, std::vector<uint8_t> packet, bool faultable);
  void Release(Link& link, std::vector<uint8_t> packet, Clock::time_point when);
  bool FlushStaged(Clock::time_point now);
  void Respond(Link& link, const PacketHeader& request, PacketType type, uint8_t syndrome, const void* payload,
               size_t bytes, uint64_t value = 0);

  // Responder side. Returns false when the request must wait (a send with no receive buffer yet).
  bool Execute(Qp& qp, Request& r, Clock::time_point now);
  bool ExecuteUnchecked(Qp& qp, Request& r, Clock::time_point now);
  bool ExecuteInSequence(Qp& qp, Request& r, Clock::time_point now);
  bool ReadLocal(void* dst, uintptr_t addr, size_t bytes, const Region& region);

  // Completions.
  void PushCqe(Qp& qp, uint8_t opcode, uint32_t wqeCounter, uint32_t byteCount, uint8_t syndrome, uint8_t failedOpcode);
  void EnterError(Qp& qp);

  const Region* FindRegion(uint32_t key) const;
  uint8_t CheckLocal(uint32_t lkey, uintptr_t addr, size_t bytes, bool write, const Region** region) const;
  uint8_t CheckRemote(uint32_t rkey, uintptr_t addr, size_t bytes, uint32_t access, const Region** region) const;
  Qp* FindQp(uint32_t qpn);
  Qp& QpOf(const RdmaEndpointHandle& h, const char* what);

  mutable std::mutex mutex_;
  std::map<uint64_t, std::string> remoteNames_;  // peer NIC nonce -> what NameRemote called its QPs' peer
  std::map<uint32_t, std::unique_ptr<Qp>> qps_;
  std::map<uint32_t, Region> regions_;  // by key
  std::list<std::unique_ptr<Link>> links_;
  UniqueFd listener_;
  net::SocketAddress listenAddr_;
  uint64_t nonce_ = 0;  // asked of every connection in its hello
  NicMemory memory_;
  Mlx5HostQueues hostQueues_;
  std::vector<uint8_t> scratch_;

  std::atomic<bool> stop_{false};
  std::atomic<bool> linkDropped_{false};
  std::atomic<uint32_t> delayUs_{0};
  std::atomic<bool> corruptNextRkey_{false};
  std::atomic<uint32_t> rnrTimeoutMs_{5000};
  std::atomic<uint32_t> stallReportMs_{10000};
  std::atomic<uint32_t> ackTimeoutMs_{0};  // MORI_TIMEOUT_S unless a test sets it
  FaultDraw faultDraw_;                    // under mutex_
  uint32_t nicIndex_ = 0;                  // this NIC's creation index in the process
  Clock::time_point nextAckCheck_{};
  Clock::time_point lastPollStart_{};  // when the engine's last look at the wire began (engine thread only)
  std::atomic<uint64_t> stallReports_{0}, doorbellFaults_{0}, strangersRefused_{0};
  std::atomic<uint64_t> faultsDropped_{0}, faultsCorrupted_{0}, faultsReordered_{0}, faultsDelayed_{0};
  std::atomic<uint64_t> integrityDrops_{0}, outOfSequence_{0};
  std::atomic<uint64_t> wqesExecuted_{0}, bytesMoved_{0}, cqesWritten_{0}, requestsServed_{0};
  Clock::time_point lastWork_;
  std::thread engine_;
};

}  // namespace mori::rdma::emulated
