#include "soft_nic.hpp"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "mori/core/atomic.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"
#include "service_thread.hpp"

namespace mori::rdma::emulated {

using namespace mlx5;
using core::AtomicLoad;
using core::AtomicStore;
using core::BeToHost16;
using core::BeToHost32;
using core::BeToHost64;
using core::HostToBe16;
using core::HostToBe32;
using core::MemoryOrder;
using core::Scope;

namespace {

// WQEs one QP may have on the wire at once: keeps buffers bounded, as a NIC's outstanding-request limit does.
constexpr size_t kMaxInFlightPerQp = 256;
constexpr uint32_t kMaxSendQueueDepth = 32768;  // 16-bit WQE counters must not alias
// The engine spins while there is work and for this long after; then it sleeps in poll() between looks.
constexpr auto kSpinAfterWork = std::chrono::milliseconds(50);
// How often the engine looks for requests whose response is overdue (it looks at every QP then).
constexpr auto kAckTimerTick = std::chrono::milliseconds(5);

uint32_t RoundUpPow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

uint32_t RandomU32() {
  uint32_t v = 0;
  if (getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) {
    v = static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  return v;
}

// The wire's nonce: never 0 (the value of handles that are not an emulated NIC's).
uint64_t RandomNonce() {
  uint64_t v = 0;
  while (v == 0) v = (uint64_t(RandomU32()) << 32) | RandomU32();
  return v;
}

// An accepted connection has this long to say its hello, and at most this many wait at once.
constexpr auto kHelloWait = std::chrono::seconds(5);
constexpr size_t kMaxUngreetedLinks = 64;

std::atomic<uint32_t>& NextQpn() {
  static std::atomic<uint32_t> next{0x100 + (RandomU32() & 0xfff) * 0x100};
  return next;
}

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

std::atomic<uint32_t>& NextNicIndex() {
  static std::atomic<uint32_t> next{0};
  return next;
}

// A packet held back by the reorder fault goes out after the next packet on its connection, or alone after this
// long when none follows (a held packet must not turn into a lost one).
constexpr auto kMaxHold = std::chrono::milliseconds(2);

// Header bytes that frame the stream (magic, version and type before atomicOp; length): on a real fabric the link
// layer delimits frames and checks them apart (VCRC, PHY coding), so the corrupt fault leaves them alone.
constexpr size_t kFramingHead = offsetof(PacketHeader, atomicOp);
constexpr size_t kLengthAt = offsetof(PacketHeader, length);
constexpr size_t kFramingBytes = kFramingHead + sizeof(uint64_t);
static_assert(kLengthAt + sizeof(uint64_t) == offsetof(PacketHeader, icrc), "length is followed by the check");

// The byte of a packet that the k-th non-framing byte is (k below the packet's size less kFramingBytes).
size_t NonFramingByte(size_t k) {
  k += kFramingHead;
  return k < kLengthAt ? k : k + sizeof(uint64_t);
}

// The completion a NAK gives its request: the responder's errors that RC reports to a requester (invalid request,
// access, operation, receiver not ready) as they came; any other code off the wire is a bad response, so a peer
// cannot make this side report a local error or a flush (which would not even stop the queue).
uint8_t NakSyndrome(uint8_t wire) {
  switch (wire) {
    case kSyndromeRemoteInvalReqErr:
    case kSyndromeRemoteAccessErr:
    case kSyndromeRemoteOpErr:
    case kSyndromeRnrRetryExcErr:
      return wire;
    default:
      return kSyndromeBadRespErr;
  }
}

}  // namespace

uint64_t PacketCheck(const PacketHeader& h, const void* payload, size_t bytes) {
  constexpr uint64_t kOddMultiplier = 0x9e3779b97f4a7c15ull;  // odd: multiplying by it is a bijection mod 2^64
  // For a fixed running value a step is a bijection of the word, and for a fixed word one of the running value.
  const auto step = [](uint64_t v, uint64_t word) {
    v = (v ^ word) * kOddMultiplier;
    return v ^ (v >> 29);  // high bits reach the low ones for the next step
  };
  PacketHeader zeroed = h;
  zeroed.icrc = 0;
  uint64_t v = 0x6d6f726931637263ull;
  const auto* head = reinterpret_cast<const uint8_t*>(&zeroed);
  for (size_t i = 0; i < sizeof(zeroed); i += 8) {
    uint64_t w;
    std::memcpy(&w, head + i, 8);
    v = step(v, w);
  }
  // The payload in four independent chains (words i, i+4, ...: four multiplies in flight instead of one), folded
  // into the header's chain at the end; a change of one word changes its chain's value, hence the result.
  const auto* p = static_cast<const uint8_t*>(payload);
  uint64_t lane[4] = {v, v + 1, v + 2, v + 3};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int k = 0; k < 4; ++k) lane[k] = step(lane[k], w[k]);
  }
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    lane[0] = step(lane[0], w);
  }
  if (i < bytes) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, bytes - i);
    lane[1] = step(lane[1], w ^ (uint64_t(bytes - i) << 59));  // the tail's length in the word: trailing zeros count
  }
  for (int k = 0; k < 4; ++k) v = step(v, lane[k]);
  return step(v, bytes);
}

std::string CheckPacketHeader(const PacketHeader& h) {
  if (h.magic != kWireMagic) return core::StrFormat("bad magic 0x%08x (not an emulated NIC)", h.magic);
  if (h.version != kWireVersion) return core::StrFormat("wire version %u, this NIC speaks %u", h.version, kWireVersion);
  if (!IsRequest(h.type) && !IsResponse(h.type) && !IsHello(h.type)) {
    return core::StrFormat("unknown packet type %u", h.type);
  }
  if (h.length > kMaxWirePayload) {
    return core::StrFormat("payload of %llu bytes beyond the %llu-byte limit", static_cast<unsigned long long>(h.length),
                           static_cast<unsigned long long>(kMaxWirePayload));
  }
  bool carriesPayload = h.type == static_cast<uint8_t>(PacketType::WriteRequest) ||
                        h.type == static_cast<uint8_t>(PacketType::SendRequest) ||
                        h.type == static_cast<uint8_t>(PacketType::ReadResponse);
  if (!carriesPayload && h.type != static_cast<uint8_t>(PacketType::ReadRequest) && h.length != 0) {
    return core::StrFormat("packet type %u with a %llu-byte payload", h.type, static_cast<unsigned long long>(h.length));
  }
  return "";
}

SoftNic::SoftNic(RdmaDevice* device) : RdmaDeviceContext(device) {
  nonce_ = RandomNonce();
  const int64_t delay = core::EnvGetInt("MORI_EMULATED_NIC_DELAY_US");
  MORI_CHECK(delay >= 0 && delay <= 60'000'000, core::ErrorCode::InvalidUsage,
             "MORI_EMULATED_NIC_DELAY_US=%lld is outside [0, 60000000]", static_cast<long long>(delay));
  delayUs_.store(static_cast<uint32_t>(delay));
  ackTimeoutMs_.store(static_cast<uint32_t>(core::TimeoutSeconds() * 1000));  // at most 30 days: fits
  nicIndex_ = NextNicIndex().fetch_add(1);
  const std::string faultSpec = core::EnvGetString("MORI_EMULATED_NIC_FAULTS");
  if (!faultSpec.empty()) SetFaults(ParseFaultSpec(faultSpec, "MORI_EMULATED_NIC_FAULTS"));
  listenAddr_ = net::PickLocalAddress();
  listenAddr_.SetPort(0);
  listener_ = net::Listen(listenAddr_);
  net::SetNonBlocking(listener_.Get(), true);
  lastWork_ = Clock::now();
  engine_ = std::thread([this] { Run(); });
  MORI_LOG_INFO(Rdma, "emulated NIC up, wire at %s", listenAddr_.ToString().c_str());
}

SoftNic::~SoftNic() {
  stop_.store(true);
  if (engine_.joinable()) engine_.join();
  // What the random faults did, for the run's record (tests/chaos/chaos.py sums these lines).
  if (faultDraw_.Faults().Any() || integrityDrops_.load() != 0 || outOfSequence_.load() != 0) {
    MORI_LOG_WARN(Rdma,
                  "emulated NIC at %s: faults injected: dropped %llu, corrupted %llu, reordered %llu, delayed "
                  "%llu; detected: integrity drops %llu, out of sequence %llu",
                  listenAddr_.ToString().c_str(), static_cast<unsigned long long>(faultsDropped_.load()),
                  static_cast<unsigned long long>(faultsCorrupted_.load()),
                  static_cast<unsigned long long>(faultsReordered_.load()),
                  static_cast<unsigned long long>(faultsDelayed_.load()),
                  static_cast<unsigned long long>(integrityDrops_.load()),
                  static_cast<unsigned long long>(outOfSequence_.load()));
  }
}

EmulatedNicStats SoftNic::Stats() const {
  EmulatedNicStats s{};
  s.wqesExecuted = wqesExecuted_.load();
  s.bytesMoved = bytesMoved_.load();
  s.cqesWritten = cqesWritten_.load();
  s.requestsServed = requestsServed_.load();
  s.stallReports = stallReports_.load();
  s.doorbellFaults = doorbellFaults_.load();
  s.strangersRefused = strangersRefused_.load();
  s.faultsDropped = faultsDropped_.load();
  s.faultsCorrupted = faultsCorrupted_.load();
  s.faultsReordered = faultsReordered_.load();
  s.faultsDelayed = faultsDelayed_.load();
  s.integrityDrops = integrityDrops_.load();
  s.outOfSequence = outOfSequence_.load();
  return s;
}

// ---------------------------------------------------------------- setup

RdmaEndpoint SoftNic::CreateRdmaEndpoint(const RdmaEndpointConfig& config) {
  MORI_CHECK(config.maxMsgsNum >= 1 && config.maxMsgsNum <= kMaxSendQueueDepth, core::ErrorCode::InvalidUsage,
             "emulated NIC: send-queue depth %u outside [1, %u]", config.maxMsgsNum, kMaxSendQueueDepth);
  MORI_CHECK(config.maxRecvNum >= 1 && config.maxRecvNum <= kMaxSendQueueDepth, core::ErrorCode::InvalidUsage,
             "emulated NIC: receive-queue depth %u outside [1, %u]", config.maxRecvNum, kMaxSendQueueDepth);
  MORI_CHECK(config.maxCqeNum >= 1 && config.maxCqeNum <= (1u << 22), core::ErrorCode::InvalidUsage,
             "emulated NIC: CQ depth %u outside [1, 4M]", config.maxCqeNum);
  MORI_CHECK(config.portId == 1, core::ErrorCode::InvalidUsage, "emulated NIC: port %u does not exist (it has port 1)",
             config.portId);
  auto qp = std::make_unique<Qp>();
  qp->config = config;
  qp->sqDepth = RoundUpPow2(config.maxMsgsNum);
  qp->rqDepth = RoundUpPow2(config.maxRecvNum);
  qp->cqDepth = RoundUpPow2(config.maxCqeNum);
  qp->maxInline = std::min<uint32_t>(config.maxInlineData, kMaxInlineInOneBlock);
  // One host-pinned allocation, GPU-mapped: send queue, receive queue, doorbell records, doorbell, CQ.
  size_t sqBytes = size_t(qp->sqDepth) * kSendWqeBasicBlock;
  size_t rqOff = AlignUp(sqBytes, 64);
  size_t dbrOff = AlignUp(rqOff + size_t(qp->rqDepth) * kReceiveWqeBytes, 64);
  size_t uarOff = dbrOff + 64;
  size_t cqOff = uarOff + 64;
  size_t cqDbrOff = cqOff + size_t(qp->cqDepth) * kCqeBytes;
  size_t total = cqDbrOff + 64;
  qp->memory = core::GpuBuffer(total, core::MemoryType::HostPinned);
  auto* base = qp->memory.DataAs<uint8_t>();
  std::memset(base, 0, total);
  qp->sq = base;
  qp->rq = base + rqOff;
  qp->dbrec = reinterpret_cast<uint32_t*>(base + dbrOff);
  qp->uar = reinterpret_cast<uint64_t*>(base + uarOff);
  qp->cq = base + cqOff;
  qp->cqDbrec = reinterpret_cast<uint32_t*>(base + cqDbrOff);
  // Empty entries, as rdma-core's mlx5 provider initialises a CQ: invalid opcode, owner bit 0.
  for (uint32_t i = 0; i < qp->cqDepth; ++i) qp->cq[size_t(i) * kCqeBytes + offsetof(Cqe64, opOwn)] = kCqeInvalid << 4;
  qp->qpn = NextQpn().fetch_add(1) & 0xffffff;
  qp->state = Qp::State::Reset;

  RdmaEndpoint ep;
  ep.handle.psn = RandomU32() & 0xffffff;
  ep.handle.qpn = qp->qpn;
  ep.handle.portId = config.portId;
  ep.handle.lid = 0;
  ep.handle.wirePort = listenAddr_.Port();
  ep.handle.wireNonce = nonce_;
  net::WireAddress w = listenAddr_.ToWire();
  std::memset(ep.handle.gid, 0, sizeof(ep.handle.gid));
  if (w.family == AF_INET) {  // IPv4-mapped GID, as RoCE v2 writes an IPv4 address
    ep.handle.gid[10] = 0xff;
    ep.handle.gid[11] = 0xff;
    std::memcpy(ep.handle.gid + 12, w.addr, 4);
  } else {
    std::memcpy(ep.handle.gid, w.addr, 16);
  }
  ep.handle.mtu = 4096;
  ep.handle.provider = static_cast<uint32_t>(ProviderType::MLX5);
  ep.wqHandle.sqAddr = qp->sq;
  ep.wqHandle.sqWqeNum = qp->sqDepth;
  ep.wqHandle.dbrRecAddr = &qp->dbrec[kSendDbrIndex];
  ep.wqHandle.dbrAddr = qp->uar;
  ep.wqHandle.rqAddr = qp->rq;
  ep.wqHandle.rqWqeNum = qp->rqDepth;
  ep.wqHandle.rqDbrRecAddr = &qp->dbrec[kReceiveDbrIndex];
  ep.wqHandle.qpn = qp->qpn;
  ep.wqHandle.maxInlineData = qp->maxInline;
  ep.wqHandle.stop = core::DeviceStopWord();
  ep.cqHandle.cqAddr = qp->cq;
  ep.cqHandle.cqeNum = qp->cqDepth;
  ep.cqHandle.cqeSize = kCqeBytes;
  ep.cqHandle.dbrRecAddr = qp->cqDbrec;

  std::lock_guard<std::mutex> lock(mutex_);
  qps_[qp->qpn] = std::move(qp);
  return ep;
}

SoftNic::Qp& SoftNic::QpOf(const RdmaEndpointHandle& h, const char* what) {
  auto it = qps_.find(h.qpn);
  MORI_CHECK(it != qps_.end(), core::ErrorCode::InvalidUsage, "emulated NIC %s: QP %u is not one of this context's",
             what, h.qpn);
  return *it->second;
}

SoftNic::Qp* SoftNic::FindQp(uint32_t qpn) {
  auto it = qps_.find(qpn);
  return it == qps_.end() ? nullptr : it->second.get();
}

void SoftNic::ConnectEndpoint(const RdmaEndpointHandle& local, const RdmaEndpointHandle& remote) {
  MORI_CHECK(remote.provider == static_cast<uint32_t>(ProviderType::MLX5) && remote.wirePort != 0 &&
                 remote.wireNonce != 0,
             core::ErrorCode::InvalidUsage,
             "emulated NIC: the remote endpoint (QP %u) was not made by an emulated NIC (no wire port or nonce)",
             remote.qpn);
  const net::WireAddress w = WireAddressOf(remote.gid, remote.wirePort);
  std::lock_guard<std::mutex> lock(mutex_);
  Qp& qp = QpOf(local, "ConnectEndpoint");
  MORI_CHECK(!qp.connected, core::ErrorCode::InvalidUsage, "emulated NIC: QP %u is already connected", qp.qpn);
  qp.remoteAddr = net::SocketAddress::FromWire(w);
  qp.remoteQpn = remote.qpn;
  qp.remoteNonce = remote.wireNonce;
  qp.nextPsn = local.psn;
  qp.expectedPsn = remote.psn;
  qp.connected = true;
  qp.state = Qp::State::Ready;
  MORI_LOG_DEBUG(Rdma, "emulated QP %u connected to QP %u at %s", qp.qpn, remote.qpn, qp.remoteAddr.ToString().c_str());
}

void SoftNic::DestroyRdmaEndpoint(const RdmaEndpointHandle& local) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    qps_.erase(local.qpn);
  }
  hostQueues_.Forget(local.qpn);
}

RdmaMemoryRegion SoftNic::RegisterRdmaMemoryRegion(void* ptr, size_t bytes, uint32_t access) {
  MORI_CHECK(ptr != nullptr && bytes > 0, core::ErrorCode::InvalidUsage,
             "emulated NIC: cannot register %zu bytes at %p", bytes, ptr);
  MORI_CHECK((access & ~kRdmaAccessAll) == 0, core::ErrorCode::InvalidUsage,
             "emulated NIC: unknown access flags 0x%x", access);
  Region r{};
  r.addr = reinterpret_cast<uintptr_t>(ptr);
  r.length = bytes;
  r.access = access;
  r.device = NicMemory::IsDeviceMemory(ptr, &r.gpu);
  if (r.device) memory_.Prepare(r.gpu);
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [key, other] : regions_) {
    MORI_CHECK(other.addr != r.addr, core::ErrorCode::InvalidUsage,
               "emulated NIC: %p is already registered (key 0x%x)", ptr, key);
  }
  do {
    r.key = RandomU32();
  } while (r.key == 0 || regions_.count(r.key) != 0);
  regions_[r.key] = r;
  return RdmaMemoryRegion{r.addr, r.key, r.key, bytes};
}

void SoftNic::DeregisterRdmaMemoryRegion(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->second.addr == reinterpret_cast<uintptr_t>(ptr)) {
      regions_.erase(it);
      return;
    }
  }
  MORI_THROW(core::ErrorCode::InvalidUsage, "emulated NIC: %p is not a registered region", ptr);
}

const SoftNic::Region* SoftNic::FindRegion(uint32_t key) const {
  auto it = regions_.find(key);
  return it == regions_.end() ? nullptr : &it->second;
}

uint8_t SoftNic::CheckLocal(uint32_t lkey, uintptr_t addr, size_t bytes, bool write, const Region** region) const {
  *region = nullptr;
  if (bytes == 0) return 0;
  const Region* r = FindRegion(lkey);
  if (r == nullptr || addr < r->addr || bytes > r->length || addr - r->addr > r->length - bytes) {
    return kSyndromeLocalProtErr;
  }
  if (write && !(r->access & kRdmaAccessLocalWrite)) return kSyndromeLocalProtErr;
  *region = r;
  return 0;
}

uint8_t SoftNic::CheckRemote(uint32_t rkey, uintptr_t addr, size_t bytes, uint32_t access,
                             const Region** region) const {
  *region = nullptr;
  const Region* r = FindRegion(rkey);
  if (r == nullptr || (r->access & access) != access) return kSyndromeRemoteAccessErr;
  // Zero-length requests too: their address must lie in the region (one end of it at most).
  if (addr < r->addr || bytes > r->length || addr - r->addr > r->length - bytes) return kSyndromeRemoteAccessErr;
  *region = r;
  return 0;
}

// ---------------------------------------------------------------- fault knobs

void SoftNic::DropLink() {
  std::lock_guard<std::mutex> lock(mutex_);
  linkDropped_.store(true);
  for (auto& link : links_) {
    if (!link->dead) KillLink(*link, "the link was dropped (fault knob)");
  }
}

void SoftNic::RestoreLink() { linkDropped_.store(false); }

void SoftNic::SetFaults(const EmulatedNicFaults& faults) {
  // Ranks started with one spec must draw differently: the rank when the launch names it (a rerun of the job
  // then draws the same per NIC), else the process id.
  const bool ranked = core::EnvIsSet("MORI_RANK");
  const int64_t salt = ranked ? core::EnvGetInt("MORI_RANK") : static_cast<int64_t>(getpid());
  const uint64_t seed = NicFaultSeed(faults.seed, static_cast<uint64_t>(salt), nicIndex_);
  if (faults.ackTimeoutMs != 0) ackTimeoutMs_.store(faults.ackTimeoutMs);
  std::lock_guard<std::mutex> lock(mutex_);
  faultDraw_.Reset(faults, seed);
  if (faults.Any()) {
    // Once per NIC, at warn level so that it shows in every failing run's log: the seed names the draws (which
    // packet each draw meets still depends on timing).
    MORI_LOG_WARN(Rdma,
                  "emulated NIC at %s: random packet faults %s (seed %llu; this NIC draws from %llu: %s %lld, "
                  "NIC %u of the process)",
                  listenAddr_.ToString().c_str(), FaultSpecString(faults).c_str(),
                  static_cast<unsigned long long>(faults.seed), static_cast<unsigned long long>(seed),
                  ranked ? "MORI_RANK" : "pid", static_cast<long long>(salt), nicIndex_);
  }
}

// ---------------------------------------------------------------- engine

void SoftNic::Run() {
  core::BecomeServiceThread("nic", static_cast<int>(nicIndex_), -1);
  while (!stop_.load(std::memory_order_relaxed)) {
    bool work = false;
    Clock::time_point now = Clock::now();
    try {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [qpn, qp] : qps_) {
          bool moved = PumpSendQueue(*qp, now);
          moved |= PumpRequests(*qp, now);
          moved |= PumpCompletions(*qp);
          work |= moved;
          WatchProgress(*qp, moved, now);
        }
        work |= CheckAckTimers(now);
        work |= FlushStaged(now);
        CloseSilentStrangers(now);
        ReapLinks();
      }
      if (work) lastWork_ = now;
      bool idle = now - lastWork_ > kSpinAfterWork;
      if (PollLinks(idle ? 1 : 0)) lastWork_ = Clock::now();
      if (!idle) std::this_thread::yield();
    } catch (const std::exception& e) {
      // The engine never dies: an unexpected failure is logged and the loop goes on.
      MORI_LOG_ERROR(Rdma, "emulated NIC engine: %s", e.what());
    }
  }
}

// A QP with work that has not moved for the stall-report time (10 s unless a test sets it) is reported once,
// with everything that decides whether it can move: a stalled queue shows up in the log with its state
// instead of only as a device-side timeout.
void SoftNic::WatchProgress(Qp& qp, bool moved, Clock::time_point now) {
  // A QP that moved costs nothing more here: the rest is for one that did not.
  bool pending = false;
  uint32_t record = 0;
  if (!moved) {
    record = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(&qp.dbrec[kSendDbrIndex])) & 0xffffu;
    pending = !qp.inflight.empty() || !qp.pendingCqes.empty() || !qp.requests.empty() ||
              (qp.sqConsumed & 0xffffu) != record || (qp.sqConsumed & 0xffffu) != qp.rung;
  }
  if (!pending || qp.lastProgress == Clock::time_point{}) {  // (the last: first look at a new QP)
    qp.lastProgress = now;
    qp.stallReported = false;
    return;
  }
  if (qp.stallReported || now - qp.lastProgress < std::chrono::milliseconds(stallReportMs_.load())) return;
  qp.stallReported = true;
  stallReports_.fetch_add(1, std::memory_order_relaxed);
  const InFlight* front = qp.inflight.empty() ? nullptr : &qp.inflight.front();
  uint32_t consumed = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(qp.cqDbrec)) & kCqConsumerIndexMask;
  auto still = std::chrono::duration_cast<std::chrono::milliseconds>(now - qp.lastProgress).count();
  // WQEs in the record that no doorbell announced: software updated the record and did not ring.
  const bool unrung = ((record - (qp.sqConsumed & 0xffffu)) & 0xffffu) > ((qp.rung - qp.sqConsumed) & 0xffffu);
  MORI_LOG_WARN(Rdma,
                "emulated QP %u made no progress for %lld ms: state %d, blocked %d, send queue read to %u (doorbell "
                "rang to %u, doorbell record at %u%s), %zu in flight (front: slot %u psn %u done %d opcode %u), next "
                "psn %u, expected psn %u, %zu requests queued, %zu CQEs waiting (produced %u, consumed %u, depth %u), "
                "link %s",
                qp.qpn, static_cast<long long>(still), static_cast<int>(qp.state), qp.blocked ? 1 : 0,
                qp.sqConsumed & 0xffffu, qp.rung, record,
                unrung ? ": WQEs were announced in the record but no doorbell rang for them (a missing or stale "
                         "RingDoorbell?)"
                       : "",
                qp.inflight.size(),
                front ? front->slot : 0u, front ? front->psn : 0u, front ? (front->done ? 1 : 0) : -1,
                front ? static_cast<unsigned>(front->opcode) : 0u, qp.nextPsn, qp.expectedPsn, qp.requests.size(),
                qp.pendingCqes.size(), qp.cqProduced, consumed, qp.cqDepth,
                qp.link == nullptr ? "none" : qp.link->dead ? "dead" : "up");
}

// RC's ack timer: the oldest request of a QP still waiting for its response may wait the ack timeout, counted from
// the latest of its sending, the QP's last response (a peer answers a QP's requests in order) and the last bytes its
// connection took (a large payload still going: once the socket buffers are full, only a peer NIC that reads moves
// it). Then it fails with transport-retry-exceeded and what follows is flushed, as when the link breaks: a peer NIC
// that is stopped or stuck while its kernel keeps the connection up would otherwise hang the QP. The wire is TCP,
// so nothing is lost unless the random faults lose it (MORI_EMULATED_NIC_FAULTS); nothing is retransmitted: a lost
// packet fails its WQE here, as an RC NIC's exhausted retries do. Only a look at the wire that began after the
// deadline counts, so that an engine held up itself (its process stopped, its host overloaded) reads the responses
// waiting for it before it blames the peer.
bool SoftNic::CheckAckTimers(Clock::time_point now) {
  if (now < nextAckCheck_) return false;
  nextAckCheck_ = now + kAckTimerTick;
  const auto bound = std::chrono::milliseconds(ackTimeoutMs_.load(std::memory_order_relaxed));
  bool expired = false;
  for (auto& [qpn, qp] : qps_) {
    if (qp->state == Qp::State::Error) continue;
    auto oldest = std::find_if(qp->inflight.begin(), qp->inflight.end(), [](const InFlight& f) { return !f.done; });
    if (oldest == qp->inflight.end()) continue;
    Clock::time_point since = std::max(oldest->sent, qp->lastResponse);
    // Bytes the peer takes count only while the request itself may still be queued behind them: other QPs'
    // traffic on the connection must not keep a lost request's timer from running.
    if (qp->link != nullptr && qp->link->written < oldest->linkSeq) since = std::max(since, qp->link->txMoved);
    if (lastPollStart_ - since <= bound) continue;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count();
    MORI_LOG_WARN(Rdma,
                  "emulated QP %u: no response from QP %u at %s for %lld ms (slot %u, psn %u, opcode 0x%x; ack timeout "
                  "%lld ms): transport retry counter exceeded, the QP goes to the error state",
                  qp->qpn, qp->remoteQpn, qp->remoteAddr.ToString().c_str(), static_cast<long long>(waited),
                  oldest->slot, oldest->psn, oldest->opcode, static_cast<long long>(bound.count()));
    FailInFlight(*qp, kSyndromeTransportRetryExcErr);
    expired = true;
  }
  return expired;
}

// Where the NIC may read the send queue to: through the last WQE a doorbell announced, as on mlx5 (the
// doorbell write carries that WQE's first 8 bytes), and never past the doorbell record, which software updates
// before it rings (a doorbell ahead of the record waits for it). A doorbell write that names no WQE of this
// queue (another QP's number, bytes that are not the WQE's control word, an index outside the queue) is
// ignored, counted and logged; WQEs that no valid doorbell announced are never read, and the stall watch names
// them.
uint32_t SoftNic::SendQueueEnd(Qp& qp) {
  const uint64_t bell = AtomicLoad<MemoryOrder::Acquire>(qp.uar);
  const uint32_t consumed = qp.sqConsumed & 0xffffu;
  const uint32_t record = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(&qp.dbrec[kSendDbrIndex])) & 0xffffu;
  const uint32_t recorded = (record - consumed) & 0xffffu;
  const auto end = [&] { return (consumed + std::min(recorded, (qp.rung - consumed) & 0xffffu)) & 0xffffu; };
  if (bell != qp.bell) {
    uint32_t word[2];
    std::memcpy(word, &bell, sizeof(word));  // the bytes as written: the control segment's first two words
    const uint32_t index = (BeToHost32(word[0]) >> 8) & 0xffffu;
    const uint32_t ahead = (index + 1 - consumed) & 0xffffu;  // WQEs it announces beyond what was read
    if (ahead <= qp.sqDepth && ahead > recorded) return end();  // rung before the record says so: wait for it
    qp.bell = bell;
    const uint8_t* wqe = qp.sq + size_t(index & (qp.sqDepth - 1)) * kSendWqeBasicBlock;
    if (ahead <= qp.sqDepth && (BeToHost32(word[1]) >> 8) == qp.qpn && std::memcmp(wqe, word, sizeof(word)) == 0) {
      qp.rung = (index + 1) & 0xffffu;
    } else {
      doorbellFaults_.fetch_add(1, std::memory_order_relaxed);
      MORI_LOG_WARN(Rdma,
                    "emulated QP %u: a doorbell write (0x%016llx: WQE index %u, QPN %u) names no WQE posted to this "
                    "send queue (read to %u, record at %u, depth %u); ignored",
                    qp.qpn, static_cast<unsigned long long>(bell), index, BeToHost32(word[1]) >> 8, consumed, record,
                    qp.sqDepth);
    }
  }
  return end();
}

bool SoftNic::PumpSendQueue(Qp& qp, Clock::time_point now) {
  const uint32_t pi = SendQueueEnd(qp);
  bool work = false;
  while ((qp.sqConsumed & 0xffffu) != pi) {
    if (qp.blocked || qp.inflight.size() >= kMaxInFlightPerQp) break;
    uint32_t delay = delayUs_.load(std::memory_order_relaxed);
    if (delay > 0) {
      if (!qp.waitingDelay) {
        qp.sqEligible = now + std::chrono::microseconds(delay);
        qp.waitingDelay = true;
      }
      if (now < qp.sqEligible) break;
      qp.waitingDelay = false;
    }
    StartWqe(qp, qp.sqConsumed, now);
    ++qp.sqConsumed;
    wqesExecuted_.fetch_add(1, std::memory_order_relaxed);
    work = true;
  }
  return work;
}

void SoftNic::FailWqe(Qp& qp, uint32_t slot, uint8_t opcode, bool signaled, uint8_t syndrome) {
  InFlight f{};
  f.slot = slot;
  f.opcode = opcode;
  f.signaled = signaled;
  f.done = true;
  f.syndrome = syndrome;
  qp.inflight.push_back(f);
  if (syndrome != kSyndromeWrFlushErr) qp.blocked = true;
}

bool SoftNic::StartWqe(Qp& qp, uint32_t slot, Clock::time_point now) {
  uint8_t wqe[kSendWqeBasicBlock];
  std::memcpy(wqe, qp.sq + size_t(slot & (qp.sqDepth - 1)) * kSendWqeBasicBlock, sizeof(wqe));
  uint32_t opmodIdxOpcode = BeToHost32(*reinterpret_cast<uint32_t*>(wqe));
  uint32_t qpnDs = BeToHost32(*reinterpret_cast<uint32_t*>(wqe + 4));
  uint8_t opcode = opmodIdxOpcode & 0xff;
  uint32_t index = (opmodIdxOpcode >> 8) & 0xffff;
  uint32_t ds = qpnDs & 0x3f;
  bool signaled = (wqe[offsetof(WqeCtrlSeg, fmCeSe)] & kCtrlCqUpdate) != 0;

  if (qp.state == Qp::State::Error) {
    FailWqe(qp, slot, opcode, signaled, kSyndromeWrFlushErr);
    return false;
  }
  // A WQE that does not describe itself consistently, or a QP that cannot send: local QP operation error.
  uint32_t minDs = opcode == kOpcodeNop ? 1
                   : opcode == kOpcodeSend ? kSendWqeDs
                   : (opcode == kOpcodeAtomicCompareSwap || opcode == kOpcodeAtomicFetchAdd) ? kAtomicWqeDs
                   : 3;
  bool known = opcode == kOpcodeNop || opcode == kOpcodeRdmaWrite || opcode == kOpcodeRdmaRead || opcode == kOpcodeSend ||
               opcode == kOpcodeAtomicCompareSwap || opcode == kOpcodeAtomicFetchAdd;
  if (!known || index != (slot & 0xffffu) || (qpnDs >> 8) != qp.qpn || ds < minDs || ds > 4 ||
      (opcode != kOpcodeNop && (!qp.connected || qp.state != Qp::State::Ready))) {
    MORI_LOG_DEBUG(Rdma, "QP %u slot %u: malformed WQE (opcode 0x%x, index %u, qpn %u, ds %u)", qp.qpn, slot, opcode,
                   index, qpnDs >> 8, ds);
    FailWqe(qp, slot, opcode, signaled, kSyndromeLocalQpOpErr);
    return false;
  }
  InFlight f{};
  f.slot = slot;
  f.opcode = opcode;
  f.signaled = signaled;
  if (opcode == kOpcodeNop) {
    f.done = true;
    qp.inflight.push_back(f);
    return true;
  }

  PacketHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.srcQpn = qp.qpn;
  h.dstQpn = qp.remoteQpn;
  const uint8_t* payload = nullptr;
  size_t payloadBytes = 0;
  const WqeRaddrSeg* raddr = reinterpret_cast<const WqeRaddrSeg*>(wqe + sizeof(WqeCtrlSeg));
  h.raddr = BeToHost64(raddr->raddr);
  h.rkey = BeToHost32(raddr->rkey);

  if (opcode == kOpcodeRdmaWrite) {
    const uint8_t* seg = wqe + sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg);
    uint32_t byteCount = BeToHost32(*reinterpret_cast<const uint32_t*>(seg));
    h.type = static_cast<uint8_t>(PacketType::WriteRequest);
    if (byteCount & kInlineSegFlag) {
      uint32_t len = byteCount & ~kInlineSegFlag;
      if (len > qp.maxInline || sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg) + sizeof(WqeInlineSeg) + len > ds * kSegmentBytes) {
        FailWqe(qp, slot, opcode, signaled, kSyndromeLocalLengthErr);
        return false;
      }
      payload = seg + sizeof(WqeInlineSeg);
      payloadBytes = len;
    } else {
      const WqeDataSeg* data = reinterpret_cast<const WqeDataSeg*>(seg);
      uint32_t lkey = BeToHost32(data->lkey);
      uintptr_t laddr = BeToHost64(data->addr);
      const Region* region = nullptr;
      uint8_t bad = byteCount > kMaxMessageBytes ? uint8_t{kSyndromeLocalLengthErr}
                                                 : CheckLocal(lkey, laddr, byteCount, false, &region);
      if (bad != 0) {
        FailWqe(qp, slot, opcode, signaled, bad);
        return false;
      }
      scratch_.resize(byteCount);
      if (byteCount > 0 && !ReadLocal(scratch_.data(), laddr, byteCount, *region)) {
        FailWqe(qp, slot, opcode, signaled, kSyndromeLocalAccessErr);
        return false;
      }
      payload = scratch_.data();
      payloadBytes = byteCount;
    }
  } else if (opcode == kOpcodeRdmaRead) {
    const WqeDataSeg* data = reinterpret_cast<const WqeDataSeg*>(wqe + sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg));
    f.length = BeToHost32(data->byteCount);
    f.laddr = BeToHost64(data->addr);
    const Region* local = nullptr;
    uint8_t bad = f.length > kMaxMessageBytes ? uint8_t{kSyndromeLocalLengthErr}
                                              : CheckLocal(BeToHost32(data->lkey), f.laddr, f.length, true, &local);
    if (bad != 0) {
      FailWqe(qp, slot, opcode, signaled, bad);
      return false;
    }
    f.lkey = BeToHost32(data->lkey);
    h.type = static_cast<uint8_t>(PacketType::ReadRequest);
    h.length = f.length;
  } else if (opcode == kOpcodeAtomicCompareSwap || opcode == kOpcodeAtomicFetchAdd) {
    const WqeAtomicSeg* atomic = reinterpret_cast<const WqeAtomicSeg*>(wqe + sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg));
    const WqeDataSeg* data = reinterpret_cast<const WqeDataSeg*>(wqe + sizeof(WqeCtrlSeg) + sizeof(WqeRaddrSeg) +
                                                                 sizeof(WqeAtomicSeg));
    f.length = BeToHost32(data->byteCount);
    f.laddr = BeToHost64(data->addr);
    if (f.length != 8) {
      FailWqe(qp, slot, opcode, signaled, kSyndromeLocalLengthErr);
      return false;
    }
    const Region* local = nullptr;
    uint8_t bad = CheckLocal(BeToHost32(data->lkey), f.laddr, 8, true, &local);
    if (bad != 0) {
      FailWqe(qp, slot, opcode, signaled, bad);
      return false;
    }
    f.lkey = BeToHost32(data->lkey);
    h.type = static_cast<uint8_t>(PacketType::AtomicRequest);
    h.atomicOp = static_cast<uint8_t>(opcode == kOpcodeAtomicCompareSwap ? AtomicOp::CompareSwap : AtomicOp::FetchAdd);
    h.swapAdd = BeToHost64(atomic->swapAdd);
    h.compare = BeToHost64(atomic->compare);
  } else {  // send
    const WqeDataSeg* data = reinterpret_cast<const WqeDataSeg*>(wqe + sizeof(WqeCtrlSeg));
    uint32_t len = BeToHost32(data->byteCount);
    uintptr_t laddr = BeToHost64(data->addr);
    const Region* region = nullptr;
    uint8_t bad = len > kMaxMessageBytes ? uint8_t{kSyndromeLocalLengthErr}
                                         : CheckLocal(BeToHost32(data->lkey), laddr, len, false, &region);
    if (bad != 0) {
      FailWqe(qp, slot, opcode, signaled, bad);
      return false;
    }
    scratch_.resize(len);
    if (len > 0 && !ReadLocal(scratch_.data(), laddr, len, *region)) {
      FailWqe(qp, slot, opcode, signaled, kSyndromeLocalAccessErr);
      return false;
    }
    payload = scratch_.data();
    payloadBytes = len;
    h.type = static_cast<uint8_t>(PacketType::SendRequest);
    h.raddr = 0;
    h.rkey = 0;
  }
  if (opcode != kOpcodeSend && corruptNextRkey_.exchange(false)) h.rkey ^= 0x5a5a5a5au;
  Link* link = OutgoingLink(qp);
  if (link == nullptr) {
    FailWqe(qp, slot, opcode, signaled, kSyndromeTransportRetryExcErr);
    return false;
  }
  h.psn = qp.nextPsn;
  qp.nextPsn = (qp.nextPsn + 1) & 0xffffff;
  f.psn = h.psn;
  f.sent = now;
  if (h.type != static_cast<uint8_t>(PacketType::ReadRequest)) h.length = payloadBytes;
  qp.inflight.push_back(f);
  Send(*link, h, payload, payloadBytes);
  qp.inflight.back().linkSeq = link->released;
  return true;
}

SoftNic::Link* SoftNic::OutgoingLink(Qp& qp) {
  if (qp.link != nullptr && !qp.link->dead) return qp.link;
  if (linkDropped_.load()) return nullptr;
  for (auto& link : links_) {
    if (link->outgoing && !link->dead && link->peerNonce == qp.remoteNonce &&
        link->peer.ToString() == qp.remoteAddr.ToString()) {
      qp.link = link.get();
      return qp.link;
    }
  }
  // The connection is started, not waited for: the engine holds its lock here, and every QP would stall
  // behind a slow connect. Packets queue on the link until it is up; a connect that fails kills the link,
  // which fails what was sent on it.
  try {
    auto link = std::make_unique<Link>();
    link->fd.Reset(socket(qp.remoteAddr.Family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    MORI_CHECK_SYS(link->fd.Get());
    if (connect(link->fd.Get(), qp.remoteAddr.Sockaddr(), qp.remoteAddr.Length()) < 0 && errno != EINPROGRESS) {
      MORI_THROW_SYS(errno, "cannot connect to the emulated NIC of QP %u at %s", qp.remoteQpn,
                     qp.remoteAddr.ToString().c_str());
    }
    net::SetNoDelay(link->fd.Get());
    net::DetectVanishedPeer(link->fd.Get(), core::TimeoutSeconds());
    link->peer = qp.remoteAddr;
    link->outgoing = true;
    link->greeted = true;
    link->peerNonce = qp.remoteNonce;
    qp.link = link.get();
    links_.push_back(std::move(link));
    PacketHeader hello = MakePacketHeader(PacketType::Hello);
    hello.raddr = qp.remoteNonce;
    hello.swapAdd = nonce_;
    Send(*qp.link, hello, nullptr, 0);
    return qp.link;
  } catch (const core::Error& e) {
    MORI_LOG_WARN(Rdma, "emulated QP %u: %s", qp.qpn, e.what());
    return nullptr;
  }
}

void SoftNic::Send(Link& link, const PacketHeader& h, const void* payload, size_t bytes) {
  PacketHeader checked = h;
  checked.icrc = PacketCheck(h, payload, bytes);
  std::vector<uint8_t> packet(sizeof(checked) + bytes);
  std::memcpy(packet.data(), &checked, sizeof(checked));
  if (bytes > 0) std::memcpy(packet.data() + sizeof(checked), payload, bytes);
  Transmit(link, std::move(packet), !IsHello(h.type));
}

// The random faults act here, on the packet as it leaves: a dropped one never reaches the peer, a corrupted one
// reaches it with a bit its integrity check does not match, a reordered one follows the next packet of the
// connection, a delayed one waits (after everything before it on the connection).
void SoftNic::Transmit(Link& link, std::vector<uint8_t> packet, bool faultable) {
  const Clock::time_point now = Clock::now();
  if (!faultable || !faultDraw_.Faults().Any()) {
    Release(link, std::move(packet), now);
    return;
  }
  if (faultDraw_.Drop()) {
    faultsDropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (faultDraw_.Corrupt()) {
    const size_t bit = faultDraw_.Below((packet.size() - kFramingBytes) * 8);
    packet[NonFramingByte(bit / 8)] ^= static_cast<uint8_t>(1u << (bit % 8));
    faultsCorrupted_.fetch_add(1, std::memory_order_relaxed);
  }
  if (link.held.empty() && faultDraw_.Reorder()) {
    link.held = std::move(packet);
    link.heldSince = now;
    return;
  }
  const uint32_t delay = faultDraw_.DelayUs();
  if (delay > 0) faultsDelayed_.fetch_add(1, std::memory_order_relaxed);
  const Clock::time_point when = now + std::chrono::microseconds(delay);
  Release(link, std::move(packet), when);
  if (!link.held.empty()) {
    faultsReordered_.fetch_add(1, std::memory_order_relaxed);
    Release(link, std::move(link.held), when);
    link.held.clear();
  }
}

// Queues a packet to be sent at `when` or after everything queued before it, whichever is later.
void SoftNic::Release(Link& link, std::vector<uint8_t> packet, Clock::time_point when) {
  if (link.dead) return;
  when = std::max(when, link.lastRelease);
  link.lastRelease = when;
  ++link.released;
  if (link.staged.empty() && when <= Clock::now()) {
    link.tx.push_back(std::move(packet));
    WriteLink(link);
    return;
  }
  link.staged.emplace_back(when, std::move(packet));
}

// Moves the packets whose delay has passed to their connection's send queue, and lets a held packet that nothing
// followed go alone.
bool SoftNic::FlushStaged(Clock::time_point now) {
  bool work = false;
  for (auto& link : links_) {
    if (link->dead) continue;
    if (!link->held.empty() && now - link->heldSince > kMaxHold) {
      std::vector<uint8_t> held = std::move(link->held);
      link->held.clear();
      Release(*link, std::move(held), now);
    }
    bool moved = false;
    while (!link->staged.empty() && link->staged.front().first <= now) {
      link->tx.push_back(std::move(link->staged.front().second));
      link->staged.pop_front();
      moved = true;
    }
    if (moved) WriteLink(*link);
    work |= moved || !link->staged.empty() || !link->held.empty();
  }
  return work;
}

void SoftNic::Respond(Link& link, const PacketHeader& request, PacketType type, uint8_t syndrome, const void* payload,
                      size_t bytes, uint64_t value) {
  // A refused request does not advance the expected sequence: what follows it is refused too.
  if (IsRequest(request.type) && syndrome == 0) {
    Qp* qp = FindQp(request.dstQpn);
    if (qp != nullptr && qp->expectedPsn == request.psn) qp->expectedPsn = (qp->expectedPsn + 1) & 0xffffff;
  }
  if (link.dead) return;
  PacketHeader h = MakePacketHeader(type);
  h.syndrome = syndrome;
  h.srcQpn = request.dstQpn;
  h.dstQpn = request.srcQpn;
  h.psn = request.psn;
  h.swapAdd = value;
  h.length = bytes;
  Send(link, h, payload, bytes);
}

void SoftNic::OnResponse(Qp& qp, const PacketHeader& h, std::vector<uint8_t>& payload) {
  for (InFlight& f : qp.inflight) {
    if (f.done || f.psn != h.psn || f.opcode == kOpcodeNop) continue;
    f.done = true;
    qp.lastResponse = Clock::now();
    if (h.syndrome != 0) {
      f.syndrome = NakSyndrome(h.syndrome);
      qp.blocked = true;  // send nothing more: the QP is about to enter the error state
      return;
    }
    const PacketType expected = f.opcode == kOpcodeRdmaRead ? PacketType::ReadResponse
                                : f.opcode == kOpcodeAtomicCompareSwap || f.opcode == kOpcodeAtomicFetchAdd
                                    ? PacketType::AtomicResponse
                                    : PacketType::Ack;
    if (h.type != static_cast<uint8_t>(expected) ||
        (expected == PacketType::ReadResponse && payload.size() != f.length)) {
      f.syndrome = kSyndromeBadRespErr;
      return;
    }
    if (expected == PacketType::Ack) return;
    // The destination must still be registered: software may have deregistered (and freed) it meanwhile.
    const Region* local = nullptr;
    if (CheckLocal(f.lkey, f.laddr, f.length, true, &local) != 0) {
      MORI_LOG_WARN(Rdma, "emulated QP %u: the destination of the %s in slot %u (%u bytes at 0x%llx) was deregistered "
                          "while it was in flight; nothing written",
                    qp.qpn, expected == PacketType::ReadResponse ? "read" : "atomic", f.slot, f.length,
                    static_cast<unsigned long long>(f.laddr));
      f.syndrome = kSyndromeLocalProtErr;
      return;
    }
    try {
      if (expected == PacketType::ReadResponse) {
        if (f.length > 0) memory_.Write(f.laddr, payload.data(), payload.size(), local->device, local->gpu);
        f.byteCount = f.length;
        bytesMoved_.fetch_add(payload.size(), std::memory_order_relaxed);
      } else {
        memory_.Write(f.laddr, &h.swapAdd, sizeof(h.swapAdd), local->device, local->gpu);
        f.byteCount = 8;
      }
    } catch (const core::Error& e) {
      MORI_LOG_ERROR(Rdma, "emulated QP %u: writing a response locally failed: %s", qp.qpn, e.what());
      f.syndrome = kSyndromeLocalProtErr;
    }
    return;
  }
  // A response to nothing we wait for (the QP failed meanwhile): dropped, as hardware drops stale packets.
}

void SoftNic::FailInFlight(Qp& qp, uint8_t syndrome) {
  bool failed = false;
  for (InFlight& f : qp.inflight) {
    if (!f.done) {
      f.done = true;
      f.syndrome = syndrome;
      failed = true;
    }
  }
  // Send nothing more until the failure reaches the front of the queue and moves the QP to error.
  if (failed && qp.state != Qp::State::Error) qp.blocked = true;
}

// ---------------------------------------------------------------- responder

bool SoftNic::PumpRequests(Qp& qp, Clock::time_point now) {
  bool work = false;
  while (!qp.requests.empty()) {
    Request& r = qp.requests.front();
    if (!r.link->dead) {
      if (!Execute(qp, r, now)) break;
      requestsServed_.fetch_add(1, std::memory_order_relaxed);
    }
    qp.requests.pop_front();
    work = true;
  }
  return work;
}

bool SoftNic::ReadLocal(void* dst, uintptr_t addr, size_t bytes, const Region& region) {
  try {
    memory_.Read(dst, addr, bytes, region.device, region.gpu);
    return true;
  } catch (const std::exception& e) {
    MORI_LOG_ERROR(Rdma, "%s", e.what());
    return false;
  }
}

bool SoftNic::Execute(Qp& qp, Request& r, Clock::time_point now) {
  // The responder's memory accesses can fail (a GPU context that died): that is a remote operation error
  // for the requester, never an exception out of the engine.
  try {
    return ExecuteUnchecked(qp, r, now);
  } catch (const std::exception& e) {
    MORI_LOG_ERROR(Rdma, "emulated QP %u: executing a request from QP %u failed: %s", qp.qpn, r.header.srcQpn, e.what());
    Respond(*r.link, r.header, PacketType::Ack, kSyndromeRemoteOpErr, nullptr, 0);
    return true;
  }
}

bool SoftNic::ExecuteUnchecked(Qp& qp, Request& r, Clock::time_point now) {
  const PacketHeader& h = r.header;
  Link& link = *r.link;
  if (qp.state != Qp::State::Ready || qp.remoteQpn != h.srcQpn || h.psn != qp.expectedPsn) {
    if (qp.state == Qp::State::Ready && qp.remoteQpn == h.srcQpn) {
      outOfSequence_.fetch_add(1, std::memory_order_relaxed);
    }
    // No live QP connected to that source, or out of sequence (a request after one this responder refused:
    // the requester has the error of the refused one and flushes everything after it).
    MORI_LOG_DEBUG(Rdma, "emulated QP %u: refused request psn %u from QP %u (expecting psn %u from QP %u)", qp.qpn,
                   h.psn, h.srcQpn, qp.expectedPsn, qp.remoteQpn);
    Refuse(link, h);
    return true;
  }
  bool done = ExecuteInSequence(qp, r, now);
  return done;
}

bool SoftNic::ExecuteInSequence(Qp& qp, Request& r, Clock::time_point now) {
  const PacketHeader& h = r.header;
  Link& link = *r.link;
  const Region* region = nullptr;
  switch (static_cast<PacketType>(h.type)) {
    case PacketType::WriteRequest: {
      uint8_t bad = CheckRemote(h.rkey, h.raddr, r.payload.size(), kRdmaAccessRemoteWrite, &region);
      if (bad == 0) {
        memory_.Write(h.raddr, r.payload.data(), r.payload.size(), region->device, region->gpu);
        bytesMoved_.fetch_add(r.payload.size(), std::memory_order_relaxed);
      }
      Respond(link, h, PacketType::Ack, bad, nullptr, 0);
      return true;
    }
    case PacketType::ReadRequest: {
      uint8_t bad = CheckRemote(h.rkey, h.raddr, h.length, kRdmaAccessRemoteRead, &region);
      if (bad != 0) {
        Respond(link, h, PacketType::Ack, bad, nullptr, 0);
        return true;
      }
      scratch_.resize(h.length);
      if (h.length > 0) memory_.Read(scratch_.data(), h.raddr, h.length, region->device, region->gpu);
      Respond(link, h, PacketType::ReadResponse, 0, scratch_.data(), h.length);
      return true;
    }
    case PacketType::AtomicRequest: {
      // An opcode other than RC's two atomics is an invalid request, as misalignment is: never run as one of them.
      const bool knownOp = h.atomicOp == static_cast<uint8_t>(AtomicOp::FetchAdd) ||
                           h.atomicOp == static_cast<uint8_t>(AtomicOp::CompareSwap);
      if (h.raddr % 8 != 0 || !knownOp) {
        Respond(link, h, PacketType::Ack, kSyndromeRemoteInvalReqErr, nullptr, 0);
        return true;
      }
      uint8_t bad = CheckRemote(h.rkey, h.raddr, 8, kRdmaAccessRemoteAtomic, &region);
      if (bad != 0) {
        Respond(link, h, PacketType::Ack, bad, nullptr, 0);
        return true;
      }
      uint64_t old = memory_.Atomic(h.raddr, static_cast<AtomicOp>(h.atomicOp), h.swapAdd, h.compare, region->device,
                                    region->gpu);
      Respond(link, h, PacketType::AtomicResponse, 0, nullptr, 0, old);
      return true;
    }
    case PacketType::SendRequest: {
      uint32_t head = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(&qp.dbrec[kReceiveDbrIndex])) & 0xffffu;
      if ((qp.rqConsumed & 0xffffu) == head) {
        // No receive buffer posted: receiver-not-ready, retried until the RNR budget runs out.
        if (now - r.arrived > std::chrono::milliseconds(rnrTimeoutMs_.load())) {
          Respond(link, h, PacketType::Ack, kSyndromeRnrRetryExcErr, nullptr, 0);
          return true;
        }
        return false;
      }
      uint32_t slot = qp.rqConsumed++;
      const WqeDataSeg* desc = reinterpret_cast<const WqeDataSeg*>(qp.rq + size_t(slot & (qp.rqDepth - 1)) * kReceiveWqeBytes);
      uint32_t capacity = BeToHost32(desc->byteCount);
      uintptr_t addr = BeToHost64(desc->addr);
      if (r.payload.size() > capacity) {
        PushCqe(qp, kCqeRespErr, slot, 0, kSyndromeLocalLengthErr, kOpcodeSend);
        EnterError(qp);
        Respond(link, h, PacketType::Ack, kSyndromeRemoteInvalReqErr, nullptr, 0);
        return true;
      }
      uint8_t bad = CheckLocal(BeToHost32(desc->lkey), addr, r.payload.size(), true, &region);
      if (bad != 0) {
        PushCqe(qp, kCqeRespErr, slot, 0, bad, kOpcodeSend);
        EnterError(qp);
        Respond(link, h, PacketType::Ack, kSyndromeRemoteOpErr, nullptr, 0);
        return true;
      }
      if (!r.payload.empty()) memory_.Write(addr, r.payload.data(), r.payload.size(), region->device, region->gpu);
      bytesMoved_.fetch_add(r.payload.size(), std::memory_order_relaxed);
      PushCqe(qp, kCqeRespSend, slot, static_cast<uint32_t>(r.payload.size()), 0, 0);
      Respond(link, h, PacketType::Ack, 0, nullptr, 0);
      return true;
    }
    default:
      return true;
  }
}

// ---------------------------------------------------------------- completions

void SoftNic::PushCqe(Qp& qp, uint8_t opcode, uint32_t wqeCounter, uint32_t byteCount, uint8_t syndrome,
                      uint8_t failedOpcode) {
  std::array<uint8_t, 64> cqe{};
  uint32_t beBytes = HostToBe32(byteCount);
  std::memcpy(cqe.data() + offsetof(Cqe64, byteCnt), &beBytes, 4);
  bool error = opcode == kCqeReqErr || opcode == kCqeRespErr;
  uint32_t qpnWord = HostToBe32(error ? (uint32_t(failedOpcode) << 24) | qp.qpn : qp.qpn);
  std::memcpy(cqe.data() + offsetof(Cqe64, sopDropQpn), &qpnWord, 4);
  if (error) cqe[offsetof(ErrCqe, syndrome)] = syndrome;
  uint16_t counter = HostToBe16(static_cast<uint16_t>(wqeCounter));
  std::memcpy(cqe.data() + offsetof(Cqe64, wqeCounter), &counter, 2);
  cqe[offsetof(Cqe64, opOwn)] = static_cast<uint8_t>(opcode << 4);  // the owner bit is set when written
  qp.pendingCqes.push_back(cqe);
}

void SoftNic::EnterError(Qp& qp) {
  if (qp.state == Qp::State::Error) return;
  qp.state = Qp::State::Error;
  qp.blocked = false;
  FailInFlight(qp, kSyndromeWrFlushErr);
  // Posted receive buffers are flushed too.
  uint32_t head = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(&qp.dbrec[kReceiveDbrIndex])) & 0xffffu;
  while ((qp.rqConsumed & 0xffffu) != head) PushCqe(qp, kCqeRespErr, qp.rqConsumed++, 0, kSyndromeWrFlushErr, kOpcodeSend);
  MORI_LOG_DEBUG(Rdma, "emulated QP %u entered the error state", qp.qpn);
}

bool SoftNic::PumpCompletions(Qp& qp) {
  bool work = false;
  while (!qp.inflight.empty() && qp.inflight.front().done) {
    InFlight f = qp.inflight.front();
    qp.inflight.pop_front();
    work = true;
    if (qp.state == Qp::State::Error) {
      // After the first error everything completes as flushed, signaled or not, whatever befell it.
      PushCqe(qp, kCqeReqErr, f.slot, 0, kSyndromeWrFlushErr, f.opcode);
    } else if (f.syndrome == 0) {
      if (f.signaled) PushCqe(qp, kCqeReq, f.slot, f.byteCount, 0, 0);
    } else {
      PushCqe(qp, kCqeReqErr, f.slot, 0, f.syndrome, f.opcode);  // errors complete even when unsignaled
      EnterError(qp);
    }
  }
  if (qp.state == Qp::State::Error) {
    uint32_t head = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(&qp.dbrec[kReceiveDbrIndex])) & 0xffffu;
    while ((qp.rqConsumed & 0xffffu) != head) {
      PushCqe(qp, kCqeRespErr, qp.rqConsumed++, 0, kSyndromeWrFlushErr, kOpcodeSend);
      work = true;
    }
  }
  // Write what the CQ has room for; the consumer index comes from the CQ's doorbell record.
  while (!qp.pendingCqes.empty()) {
    uint32_t consumed = BeToHost32(AtomicLoad<MemoryOrder::Acquire>(qp.cqDbrec)) & kCqConsumerIndexMask;
    if (((qp.cqProduced - consumed) & kCqConsumerIndexMask) >= qp.cqDepth) {
      if (!qp.cqOverrunWarned) {
        MORI_LOG_WARN(Rdma, "emulated QP %u: CQ full (%u entries not consumed); completions wait until software "
                            "consumes CQEs and updates the CQ doorbell record",
                      qp.qpn, qp.cqDepth);
        qp.cqOverrunWarned = true;
      }
      break;
    }
    std::array<uint8_t, 64>& cqe = qp.pendingCqes.front();
    uint8_t* dst = qp.cq + size_t(qp.cqProduced & (qp.cqDepth - 1)) * kCqeBytes;
    std::memcpy(dst, cqe.data(), offsetof(Cqe64, wqeCounter));
    uint32_t tail;
    std::memcpy(&tail, cqe.data() + offsetof(Cqe64, wqeCounter), 4);
    uint32_t owner = (qp.cqProduced & qp.cqDepth) ? 1u : 0u;
    tail |= owner << 24;  // op_own is the word's last byte
    // Release: the entry's body is written before the word with its owner bit, which hands it to software.
    AtomicStore<MemoryOrder::Release>(reinterpret_cast<uint32_t*>(dst + offsetof(Cqe64, wqeCounter)), tail);
    ++qp.cqProduced;
    qp.cqOverrunWarned = false;
    qp.pendingCqes.pop_front();
    cqesWritten_.fetch_add(1, std::memory_order_relaxed);
    work = true;
  }
  return work;
}

// ---------------------------------------------------------------- wire

bool SoftNic::PollLinks(int timeoutMs) {
  std::vector<pollfd> fds;
  std::vector<Link*> who;
  lastPollStart_ = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fds.push_back({listener_.Get(), POLLIN, 0});
    for (auto& link : links_) {
      if (link->dead) continue;
      fds.push_back({link->fd.Get(), static_cast<short>(POLLIN | (link->tx.empty() ? 0 : POLLOUT)), 0});
      who.push_back(link.get());
    }
  }
  int n = poll(fds.data(), fds.size(), timeoutMs);
  if (n <= 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  if (fds[0].revents & POLLIN) {
    while (true) {
      int fd = accept4(listener_.Get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      size_t ungreeted = 0;
      for (const auto& l : links_) ungreeted += !l->dead && !l->greeted;
      if (ungreeted >= kMaxUngreetedLinks) strangersRefused_.fetch_add(1, std::memory_order_relaxed);
      if (linkDropped_.load() || ungreeted >= kMaxUngreetedLinks) {
        close(fd);
        continue;
      }
      auto link = std::make_unique<Link>();
      link->fd.Reset(fd);
      link->peer = net::PeerAddressOf(fd);
      net::SetNoDelay(fd);
      net::DetectVanishedPeer(fd, core::TimeoutSeconds());
      links_.push_back(std::move(link));
    }
  }
  for (size_t i = 0; i < who.size(); ++i) {
    Link& link = *who[i];
    if (link.dead) continue;
    short ev = fds[i + 1].revents;
    if (ev & POLLOUT) WriteLink(link);
    if (ev & (POLLIN | POLLHUP | POLLERR)) ReadLink(link);
  }
  return true;
}

void SoftNic::WriteLink(Link& link) {
  while (!link.dead && !link.tx.empty()) {
    std::vector<uint8_t>& packet = link.tx.front();
    ssize_t n = send(link.fd.Get(), packet.data() + link.txOffset, packet.size() - link.txOffset,
                     MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      KillLink(link, "the wire connection broke (" + core::ErrnoString(errno) + ")", true);
      return;
    }
    link.txOffset += static_cast<size_t>(n);
    if (n > 0) link.txMoved = Clock::now();
    if (link.txOffset == packet.size()) {
      link.tx.pop_front();
      link.txOffset = 0;
      ++link.written;
    }
  }
}

void SoftNic::ReadLink(Link& link) {
  while (!link.dead) {
    uint8_t* dst;
    size_t want;
    if (link.rxHeaderGot < sizeof(PacketHeader)) {
      dst = reinterpret_cast<uint8_t*>(&link.rxHeader) + link.rxHeaderGot;
      want = sizeof(PacketHeader) - link.rxHeaderGot;
    } else {
      // The payload is received into memory that grows with what came: a header that announces 2 GiB costs
      // nothing until the bytes are there.
      want = net::ReceiveRoom(link.rxPayload, link.rxPayloadGot, PayloadBytes(link.rxHeader));
      dst = link.rxPayload.data() + link.rxPayloadGot;
    }
    ssize_t n = want == 0 ? 0 : recv(link.fd.Get(), dst, want, MSG_DONTWAIT);
    if (want > 0 && n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR) continue;
      KillLink(link, "the wire connection broke (" + core::ErrnoString(errno) + ")", true);
      return;
    }
    if (want > 0 && n == 0) {
      KillLink(link, "the peer NIC closed the wire connection (its process exited?)", true);
      return;
    }
    if (link.rxHeaderGot < sizeof(PacketHeader)) {
      link.rxHeaderGot += static_cast<size_t>(n);
      if (link.rxHeaderGot < sizeof(PacketHeader)) continue;
      std::string bad = CheckPacketHeader(link.rxHeader);
      if (!bad.empty()) {
        KillLink(link, "malformed bytes on the wire: " + bad);
        return;
      }
      if (!link.greeted || IsHello(link.rxHeader.type)) {  // nothing is taken from a stranger, not even a payload
        if (!Greet(link, link.rxHeader)) return;
        link.rxHeaderGot = 0;
        continue;
      }
      link.rxPayload.clear();
      link.rxPayloadGot = 0;
    } else {
      link.rxPayloadGot += static_cast<size_t>(n);
    }
    if (link.rxPayloadGot < PayloadBytes(link.rxHeader)) continue;
    PacketHeader h = link.rxHeader;
    std::vector<uint8_t> payload = std::move(link.rxPayload);
    link.rxHeaderGot = 0;
    link.rxPayloadGot = 0;
    link.rxPayload.clear();
    if (!PacketCheckPasses(h, payload.data(), payload.size())) {
      // As a NIC drops a packet whose ICRC fails: nothing of it is believed, not even which QP it names; its
      // requester's ack timer notices the loss.
      integrityDrops_.fetch_add(1, std::memory_order_relaxed);
      MORI_LOG_DEBUG(Rdma, "emulated NIC: dropped a packet from %s whose integrity check failed (type %u, %zu bytes)",
                     link.peer.ToString().c_str(), h.type, payload.size());
      continue;
    }
    OnPacket(link, h, payload);
  }
}

// An accepted connection's first packet must be a hello that names this NIC's nonce; a second hello, or a hello
// on a connection this NIC opened, is as wrong. Returns whether the link goes on.
bool SoftNic::Greet(Link& link, const PacketHeader& h) {
  if (!link.greeted && HelloAdmits(h, nonce_) && PacketCheckPasses(h, nullptr, 0)) {
    link.greeted = true;
    link.peerNonce = h.swapAdd;
    return true;
  }
  strangersRefused_.fetch_add(1, std::memory_order_relaxed);
  const char* why = link.greeted ? "a second hello"
                    : IsHello(h.type) && !HelloAdmits(h, nonce_)
                        ? "its hello named another NIC's nonce (a peer of another job?)"
                    : IsHello(h.type) ? "its hello failed the integrity check"
                                      : "its first packet was not a hello (a stranger on the wire?)";
  MORI_LOG_WARN(Rdma, "emulated NIC: refused the wire connection from %s: %s", link.peer.ToString().c_str(), why);
  KillLink(link, std::string("refused: ") + why);
  return false;
}

// Every request this NIC will not run gets one answer, whatever the reason (no such QP, a QP connected to another
// NIC or QP or not ready, a PSN out of sequence, a key, range or access that does not fit): a NAK with the remote
// access error, so that a prober learns nothing about which check failed.
void SoftNic::Refuse(Link& link, const PacketHeader& request) {
  Respond(link, request, PacketType::Ack, kSyndromeRemoteAccessErr, nullptr, 0);
}

void SoftNic::CloseSilentStrangers(Clock::time_point now) {
  for (auto& link : links_) {
    if (!link->dead && !link->greeted && now - link->since > kHelloWait) {
      strangersRefused_.fetch_add(1, std::memory_order_relaxed);
      MORI_LOG_WARN(Rdma, "emulated NIC: closed the wire connection from %s: no hello within %lld s",
                    link->peer.ToString().c_str(),
                    static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(kHelloWait).count()));
      KillLink(*link, "no hello");
    }
  }
}

void SoftNic::OnPacket(Link& link, PacketHeader& h, std::vector<uint8_t>& payload) {
  Qp* qp = FindQp(h.dstQpn);
  if (IsRequest(h.type)) {
    if (link.outgoing) {  // requests come only on connections peers opened
      strangersRefused_.fetch_add(1, std::memory_order_relaxed);
      KillLink(link, "a request came on a connection this NIC opened");
      return;
    }
    if (qp == nullptr || qp->remoteNonce != link.peerNonce) {
      Refuse(link, h);
      return;
    }
    qp->requests.push_back(Request{h, std::move(payload), &link, Clock::now()});
    PumpRequests(*qp, Clock::now());
    return;
  }
  // A response counts only on the connection its QP's requests went out on, from the QP they went to.
  if (qp == nullptr || qp->link != &link || h.srcQpn != qp->remoteQpn) {
    strangersRefused_.fetch_add(1, std::memory_order_relaxed);
    MORI_LOG_DEBUG(Rdma, "emulated NIC: dropped a response for QP %u from QP %u on a connection it did not ask on",
                   h.dstQpn, h.srcQpn);
    return;
  }
  OnResponse(*qp, h, payload);
}

// Peers lost by any emulated NIC of this process, first first; one record per name.
struct PeerLossLog {
  std::mutex mutex;
  std::vector<std::pair<std::chrono::steady_clock::time_point, EmulatedPeerLoss>> losses;
};

PeerLossLog& PeerLosses() {
  static PeerLossLog* log = new PeerLossLog;  // never destroyed: NIC threads may record while statics go
  return *log;
}

void SoftNic::NameRemote(const RdmaEndpointHandle& local, const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  Qp& qp = QpOf(local, "NameRemote");
  if (qp.remoteNonce != 0) remoteNames_[qp.remoteNonce] = name;
}

void SoftNic::KillLink(Link& link, const std::string& reason, bool peerGone) {
  if (link.dead) return;
  if (peerGone && link.peerNonce != 0) {
    auto named = remoteNames_.find(link.peerNonce);
    if (named != remoteNames_.end()) {
      PeerLossLog& log = PeerLosses();
      std::lock_guard<std::mutex> lock(log.mutex);
      bool known = false;
      for (const auto& entry : log.losses) known |= entry.second.name == named->second;
      if (!known) log.losses.push_back({Clock::now(), EmulatedPeerLoss{named->second, 0, reason}});
    }
  }
  link.dead = true;
  link.deathReason = reason;
  link.fd.Reset();
  link.tx.clear();
  link.staged.clear();
  link.held.clear();
  for (auto& [qpn, qp] : qps_) {
    if (qp->link == &link) {
      // Nothing more will come back for what is in flight: the requester's retries are exhausted.
      FailInFlight(*qp, kSyndromeTransportRetryExcErr);
      qp->link = nullptr;
    }
  }
  // Requests that came on this link stay queued (one may be executing right now) and are dropped when
  // their turn comes or when the link is reaped.
  MORI_LOG_INFO(Rdma, "emulated NIC: wire connection with %s closed: %s", link.peer.ToString().c_str(), reason.c_str());
}

void SoftNic::ReapLinks() {
  bool anyDead = false;
  for (const auto& l : links_) anyDead |= l->dead;
  if (!anyDead) return;
  for (auto& [qpn, qp] : qps_) {
    std::deque<Request> keep;
    for (auto& r : qp->requests) {
      if (!r.link->dead) keep.push_back(std::move(r));
    }
    qp->requests.swap(keep);
  }
  links_.remove_if([](const std::unique_ptr<Link>& l) { return l->dead; });
}

// ---------------------------------------------------------------- host posting

void SoftNic::HostPost(RdmaEndpoint& ep, const HostWorkRequest& wr) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    QpOf(ep.handle, "HostPost");
  }
  hostQueues_.Post(ep, wr);
}

void SoftNic::HostPostRecv(RdmaEndpoint& ep, uintptr_t laddr, uint32_t lkey, size_t bytes, uint64_t wrId) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    QpOf(ep.handle, "HostPostRecv");
  }
  hostQueues_.PostRecv(ep, laddr, lkey, bytes, wrId);
}

int SoftNic::HostPoll(RdmaEndpoint& ep, HostCompletion* out, int maxCompletions) {
  return hostQueues_.Poll(ep, out, maxCompletions);
}

}  // namespace mori::rdma::emulated

namespace mori::rdma {

std::vector<EmulatedPeerLoss> EmulatedNicPeerLosses() {
  emulated::PeerLossLog& log = emulated::PeerLosses();
  std::lock_guard<std::mutex> lock(log.mutex);
  const auto now = std::chrono::steady_clock::now();
  std::vector<EmulatedPeerLoss> out;
  for (const auto& [when, loss] : log.losses) {
    out.push_back(loss);
    out.back().secondsAgo = std::chrono::duration<double>(now - when).count();
  }
  return out;
}

}  // namespace mori::rdma
