// The emulated NIC's receive path as a peer NIC drives it over the wire (issue 16): the input is the byte stream a
// remote NIC sends on one connection, and a real SoftNic (engine thread, registered memory, a fresh QP per input)
// executes it. Two sides, chosen by the first byte:
//   responder: the harness connects to the NIC, says a correct hello (or the input's), and sends the input's
//     requests (writes, reads, atomics, sends) to a QP connected to a peer the harness plays;
//   requester: the QP posts a few WQEs to that peer, the NIC connects to the harness's listener, and the input's
//     packets answer the requests (acks, NAKs, read and atomic responses).
// The harness then closes its end (mid-packet, when the input ends there) and waits for the NIC to close.
// Properties besides no sanitizer report and no exception out of the NIC:
// - every response the NIC gives is the one an RC responder owes (a model of keys, access, bounds, alignment, PSN
//   order, receive buffers), in order, and none is missing unless the connection died; read responses carry the
//   bytes memory holds, atomic responses the old value;
// - registered memory changes only where an accepted request or a response to a posted WQE puts bytes, exactly
//   those bytes (buffers are exactly their registration's size, so ASan sees a stray byte; snapshots compare the
//   rest); memory without remote write access is never written by a peer;
// - every posted WQE completes (none hangs), with the status the responses call for: the first failure's own
//   syndrome, then flushes;
// - no descriptor or thread is left behind by an input; every wait is bounded (MORI_TIMEOUT_S=5).
// Field encoding (fuzz_util.hpp): QPNs are relative to the real ones (0: the harness's QP, or the peer's), PSNs to
// the start PSN, rkeys below kNicRegions name a registration, raddrs with a small top byte a buffer plus an offset;
// a hello's raddr and swapAdd are relative to the NIC's and the peer's nonce. By default every complete packet gets
// this wire's magic and version and a recomputed integrity check, so that mutations reach what follows the check.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <vector>

#include "emulated/wire.hpp"
#include "fuzz_os.hpp"
#include "fuzz_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/timeout.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/emulated.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"
#include "mori/rdma/rdma.hpp"
#include "socket.hpp"

namespace {

namespace em = mori::rdma::emulated;
namespace net = mori::core::net;
namespace mlx5 = mori::rdma::mlx5;
using mori::core::Deadline;
using mori::core::UniqueFd;
using mori::rdma::HostCompletion;
using mori::rdma::HostOp;
using mori::rdma::HostWorkRequest;
using mori::rdma::RdmaEndpoint;
using mori::rdma::RdmaEndpointHandle;
using namespace mori::fuzz;

using Bytes = std::vector<uint8_t>;
constexpr uint64_t kPeerNonce = 0x706565726e696321ull;  // the NIC the harness plays
constexpr uint32_t kPeerQpn = 0xabcd00;
constexpr uint32_t kWrapStartPsn = 0xfffffe;
constexpr uint32_t kPsnMask = 0xffffff;
constexpr double kWaitS = 4;  // below MORI_TIMEOUT_S: the NIC's ack timer never fires inside an input

// What a requester's WQE completes with when its response is a NAK of `wire`: RC requesters report only the
// responder's error classes (invalid request, remote access, remote operation, RNR retries exceeded); any other
// code is a bad response.
uint8_t NakStatus(uint8_t wire) {
  const bool remote = wire == mlx5::kSyndromeRemoteInvalReqErr || wire == mlx5::kSyndromeRemoteAccessErr ||
                      wire == mlx5::kSyndromeRemoteOpErr || wire == mlx5::kSyndromeRnrRetryExcErr;
  return remote ? wire : uint8_t{mlx5::kSyndromeBadRespErr};
}

struct BufferSpec {
  size_t bytes;
  uint32_t access;  // of its registration
};
constexpr BufferSpec kSpecs[kNicBuffers] = {
    {256, mori::rdma::kRdmaAccessAll},
    {128, mori::rdma::kRdmaAccessRemoteRead},
    {64, mori::rdma::kRdmaAccessRemoteWrite},
    {256, mori::rdma::kRdmaAccessLocalWrite},
    {64, 0},  // never registered
};

// Receive buffers of the responder side (in the local buffer) and the WQEs of the requester side.
struct RecvSpec {
  uint32_t offset, capacity;
};
constexpr RecvSpec kRecvs[] = {{0, 64}, {64, 128}};
struct WqeSpec {
  HostOp op;
  uint32_t offset;  // in the local buffer: a write's or send's source, a read's or atomic's destination
  uint32_t bytes;
  em::PacketType request, response;
};
constexpr WqeSpec kWqes[kNicWqes] = {
    {HostOp::Write, 192, 32, em::PacketType::WriteRequest, em::PacketType::Ack},
    {HostOp::Read, 0, 48, em::PacketType::ReadRequest, em::PacketType::ReadResponse},
    {HostOp::FetchAdd, 48, 8, em::PacketType::AtomicRequest, em::PacketType::AtomicResponse},
    {HostOp::CompareSwap, 56, 8, em::PacketType::AtomicRequest, em::PacketType::AtomicResponse},
    {HostOp::Send, 192, 16, em::PacketType::SendRequest, em::PacketType::Ack},
    {HostOp::Read, 64, 0, em::PacketType::ReadRequest, em::PacketType::ReadResponse},
    {HostOp::WriteInline, 0, 12, em::PacketType::WriteRequest, em::PacketType::Ack},
    {HostOp::Read, 72, 100, em::PacketType::ReadRequest, em::PacketType::ReadResponse},
};
const uint8_t kInlineBytes[12] = {'i', 'n', 'l', 'i', 'n', 'e', ' ', 'w', 'r', 'i', 't', 'e'};

uint8_t PatternByte(size_t buffer, size_t i) { return static_cast<uint8_t>(0x5b + 37 * buffer + 11 * i + (i >> 8)); }

// A packet of the input as it goes on the wire; `complete`: the input held all of it.
struct Packet {
  em::PacketHeader h{};
  Bytes bytes;  // header (possibly cut short) and payload as sent
  Bytes payload;
  bool complete = false;
};

// The memory the NIC may touch, and what the model says it must hold.
struct Memory {
  std::unique_ptr<uint8_t[]> bytes[kNicBuffers];
  uint32_t keys[kNicRegions] = {};
  Bytes shadow[kNicBuffers];
  std::vector<bool> free[kNicBuffers];  // bytes whose value the model cannot know (an unanswered request)

  uintptr_t Base(size_t b) const { return reinterpret_cast<uintptr_t>(bytes[b].get()); }
  void Reset() {
    for (size_t b = 0; b < kNicBuffers; ++b) {
      shadow[b].resize(kSpecs[b].bytes);
      for (size_t i = 0; i < kSpecs[b].bytes; ++i) shadow[b][i] = bytes[b][i] = PatternByte(b, i);
      free[b].assign(kSpecs[b].bytes, false);
    }
  }
  // The registered buffer that [addr, addr + len) lies in with `access`, or -1: the responder's rule, stated apart.
  int Remote(uint32_t rkey, uint64_t addr, uint64_t len, uint32_t access) const {
    for (uint32_t b = 0; b < kNicRegions; ++b) {
      if (keys[b] != rkey || (kSpecs[b].access & access) != access) continue;
      const uint64_t base = Base(b), size = kSpecs[b].bytes;
      if (addr >= base && len <= size && addr - base <= size - len) return static_cast<int>(b);
      return -1;
    }
    return -1;
  }
  void Free(int b, uint64_t addr, uint64_t len) {
    for (uint64_t i = 0; i < len; ++i) free[b][addr - Base(b) + i] = true;
  }
  void Check(const char* side) const {
    for (size_t b = 0; b < kNicBuffers; ++b) {
      for (size_t i = 0; i < kSpecs[b].bytes; ++i) {
        MORI_FUZZ_ASSERT(free[b][i] || bytes[b][i] == shadow[b][i],
                         "%s: byte %zu of buffer %zu (access 0x%x) is 0x%02x, the model says 0x%02x", side, i, b,
                         kSpecs[b].access, bytes[b][i], shadow[b][i]);
      }
    }
  }
};

class Harness {
 public:
  Harness() : context_(mori::rdma::RdmaBackendType::Emulated) {
    auto ports = mori::rdma::GetActiveDevicePortList(context_.GetRdmaDeviceList());
    MORI_FUZZ_ASSERT(ports.size() == 1, "%zu emulated ports", ports.size());
    nic_ = ports[0].first->CreateRdmaDeviceContext();
    control_ = mori::rdma::GetEmulatedNicControl(nic_);
    control_->SetRnrTimeoutMilliseconds(0);  // a send without a receive buffer is NAKed at once
    control_->SetStallReportMilliseconds(600'000);
    for (size_t b = 0; b < kNicBuffers; ++b) {
      memory_.bytes[b].reset(new uint8_t[kSpecs[b].bytes]);  // exactly the registration: ASan sees a stray byte
      if (b < kNicRegions) {
        memory_.keys[b] =
            nic_->RegisterRdmaMemoryRegion(memory_.bytes[b].get(), kSpecs[b].bytes, kSpecs[b].access).rkey;
      }
    }
    // The harness's listener, at the NIC's own address (the address a QP connected to the harness's peer dials).
    RdmaEndpoint probe = nic_->CreateRdmaEndpoint(Config());
    nicAddr_ = WireOf(probe.handle, probe.handle.wirePort);
    nicNonce_ = probe.handle.wireNonce;
    peerHandle_ = probe.handle;
    nic_->DestroyRdmaEndpoint(probe.handle);
    net::SocketAddress at = nicAddr_;
    at.SetPort(0);
    listener_ = net::Listen(at);
    peerHandle_.wirePort = at.Port();
    peerHandle_.wireNonce = kPeerNonce;
    peerHandle_.qpn = kPeerQpn;
  }

  void Run(const uint8_t* data, size_t size) {
    FuzzInput in(data, size);
    opts_ = in.Take<uint8_t>();
    const uint8_t mask = in.Take<uint8_t>();
    startPsn_ = opts_ & kNicWrapPsn ? kWrapStartPsn : 0;
    memory_.Reset();
    const size_t fds = CountEntries("/proc/self/fd"), threads = CountEntries("/proc/self/task");

    ep_ = nic_->CreateRdmaEndpoint(Config());
    RdmaEndpointHandle local = ep_.handle;
    local.psn = startPsn_;
    RdmaEndpointHandle remote = peerHandle_;
    remote.psn = startPsn_;
    nic_->ConnectEndpoint(local, remote);
    std::vector<Packet> packets = TakePackets(in);
    if (opts_ & kNicRequester) {
      RunRequester(packets, mask == 0 ? 0xff : mask);
    } else {
      RunResponder(packets);
    }
    nic_->DestroyRdmaEndpoint(ep_.handle);

    MORI_FUZZ_ASSERT(SettlesAt("/proc/self/fd", fds), "%zu descriptors open before the input, %zu after", fds,
                     CountEntries("/proc/self/fd"));
    MORI_FUZZ_ASSERT(SettlesAt("/proc/self/task", threads), "%zu threads before the input, %zu after", threads,
                     CountEntries("/proc/self/task"));
  }

 private:
  static mori::rdma::RdmaEndpointConfig Config() {
    mori::rdma::RdmaEndpointConfig c;
    c.maxMsgsNum = kNicWqes;
    c.maxRecvNum = 2;
    c.maxCqeNum = 4;  // fewer than the WQEs: completions wait for room
    return c;
  }

  static net::SocketAddress WireOf(const RdmaEndpointHandle& h, uint16_t port) {
    return net::SocketAddress::FromWire(em::WireAddressOf(h.gid, port));
  }

  uint32_t Psn(uint32_t relative) const { return (relative & ~kPsnMask) | ((relative + startPsn_) & kPsnMask); }

  // The input's packets with their fields made concrete (see the head of the file).
  std::vector<Packet> TakePackets(FuzzInput& in) {
    std::vector<Packet> out;
    while (in.Left() > 0) {
      Packet p;
      if (in.Left() < sizeof(em::PacketHeader)) {  // a header cut short: the peer closes mid-header
        p.bytes.assign(in.Rest(), in.Rest() + in.Left());
        in.Take<em::PacketHeader>();
        out.push_back(std::move(p));
        break;
      }
      em::PacketHeader& h = p.h;
      h = in.Take<em::PacketHeader>();
      if (!(opts_ & kNicRawFraming)) {
        h.magic = em::kWireMagic;
        h.version = em::kWireVersion;
      }
      h.srcQpn += kPeerQpn;
      h.dstQpn += ep_.handle.qpn;
      h.psn = Psn(h.psn);
      if (em::IsHello(h.type)) {
        h.raddr += nicNonce_;
        h.swapAdd += kPeerNonce;
      } else {
        if (h.rkey < kNicRegions) h.rkey = memory_.keys[h.rkey];
        const uint64_t tag = h.raddr >> 56;
        if (tag < kNicBuffers) {
          h.raddr = memory_.Base(tag) + static_cast<uint64_t>(static_cast<int64_t>(static_cast<int32_t>(h.raddr)));
        }
      }
      const uint64_t want = em::PayloadBytes(h);
      const size_t n = static_cast<size_t>(std::min<uint64_t>(want, in.Left()));
      p.payload.assign(in.Rest(), in.Rest() + n);
      for (size_t i = 0; i < n; ++i) in.Take<uint8_t>();
      p.complete = n == want;
      if (p.complete && !(opts_ & kNicRawCheck)) h.icrc = em::PacketCheck(h, p.payload.data(), p.payload.size());
      p.bytes.resize(sizeof(h) + n);
      std::memcpy(p.bytes.data(), &h, sizeof(h));
      if (n > 0) std::memcpy(p.bytes.data() + sizeof(h), p.payload.data(), n);
      out.push_back(std::move(p));
    }
    return out;
  }

  // Sends `out` on `fd` while taking what comes back, closes the sending side, and reads until the NIC closes.
  static Bytes Exchange(int fd, const Bytes& out) {
    net::SetNonBlocking(fd, true);
    Bytes got;
    size_t sent = 0;
    bool shut = false;
    const Deadline deadline = Deadline::After(kWaitS);
    uint8_t buf[4096];
    while (true) {
      if (sent == out.size() && !shut) {
        shutdown(fd, SHUT_WR);
        shut = true;
      }
      MORI_FUZZ_ASSERT(!deadline.Expired(),
                       "the NIC did not close the connection within %.0f s (%zu of %zu bytes sent)", kWaitS, sent,
                       out.size());
      pollfd p{fd, static_cast<short>(POLLIN | (shut ? 0 : POLLOUT)), 0};
      if (poll(&p, 1, 10) <= 0) continue;
      if (!shut && (p.revents & POLLOUT)) {
        ssize_t n = send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
        if (n > 0) sent += static_cast<size_t>(n);
        if (n < 0 && errno != EAGAIN && errno != EINTR) sent = out.size();  // the NIC closed: nothing more goes
      }
      if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
        ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n > 0) {
          got.insert(got.end(), buf, buf + n);
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          return got;  // closed (or reset, after a refusal with our bytes unread)
        }
      }
    }
  }

  // Packets in `bytes`; a packet cut short at the end (its connection died while it went out) is left out.
  static std::vector<Packet> Parse(const Bytes& bytes, const char* what) {
    std::vector<Packet> out;
    size_t at = 0;
    while (bytes.size() - at >= sizeof(em::PacketHeader)) {
      Packet p;
      std::memcpy(&p.h, bytes.data() + at, sizeof(p.h));
      MORI_FUZZ_ASSERT(em::CheckPacketHeader(p.h).empty(), "the NIC sent a malformed %s: %s", what,
                       em::CheckPacketHeader(p.h).c_str());
      const uint64_t n = em::PayloadBytes(p.h);
      if (bytes.size() - at - sizeof(p.h) < n) break;
      p.payload.assign(bytes.begin() + static_cast<long>(at + sizeof(p.h)),
                       bytes.begin() + static_cast<long>(at + sizeof(p.h) + n));
      MORI_FUZZ_ASSERT(em::PacketCheckPasses(p.h, p.payload.data(), p.payload.size()),
                       "the NIC sent a %s that fails its integrity check", what);
      p.complete = true;
      out.push_back(std::move(p));
      at += sizeof(p.h) + n;
    }
    return out;
  }

  // ------------------------------------------------------------ responder: the input's requests

  struct Answer {
    em::PacketType type;
    uint8_t syndrome;
    Bytes data;        // a read response's
    uint64_t old = 0;  // an atomic response's
  };

  // What an RC responder owes `r`, with the model's state moved on (and its memory changed) as executing it would.
  Answer Model(const em::PacketHeader& r, const Bytes& payload, bool peerOk) {
    const Answer accessError{em::PacketType::Ack, mlx5::kSyndromeRemoteAccessErr, {}};
    if (!peerOk || r.dstQpn != ep_.handle.qpn || qpError_ || r.srcQpn != kPeerQpn || r.psn != expectedPsn_) {
      return accessError;
    }
    Answer a{em::PacketType::Ack, 0, {}};
    switch (static_cast<em::PacketType>(r.type)) {
      case em::PacketType::WriteRequest: {
        int b = memory_.Remote(r.rkey, r.raddr, payload.size(), mori::rdma::kRdmaAccessRemoteWrite);
        if (b < 0) return accessError;
        std::copy(payload.begin(), payload.end(),
                  memory_.shadow[b].begin() + static_cast<long>(r.raddr - memory_.Base(b)));
        break;
      }
      case em::PacketType::ReadRequest: {
        int b = memory_.Remote(r.rkey, r.raddr, r.length, mori::rdma::kRdmaAccessRemoteRead);
        if (b < 0) return accessError;
        a.type = em::PacketType::ReadResponse;
        auto from = memory_.shadow[b].begin() + static_cast<long>(r.raddr - memory_.Base(b));
        a.data.assign(from, from + static_cast<long>(r.length));
        break;
      }
      case em::PacketType::AtomicRequest: {
        const bool knownOp = r.atomicOp == static_cast<uint8_t>(mori::rdma::AtomicOp::FetchAdd) ||
                             r.atomicOp == static_cast<uint8_t>(mori::rdma::AtomicOp::CompareSwap);
        if (r.raddr % 8 != 0 || !knownOp) return {em::PacketType::Ack, mlx5::kSyndromeRemoteInvalReqErr, {}};
        int b = memory_.Remote(r.rkey, r.raddr, 8, mori::rdma::kRdmaAccessRemoteAtomic);
        if (b < 0) return accessError;
        uint8_t* word = memory_.shadow[b].data() + (r.raddr - memory_.Base(b));
        std::memcpy(&a.old, word, 8);
        uint64_t next = r.atomicOp == static_cast<uint8_t>(mori::rdma::AtomicOp::FetchAdd) ? a.old + r.swapAdd
                        : a.old == r.compare                                               ? r.swapAdd
                                                                                           : a.old;
        std::memcpy(word, &next, 8);
        a.type = em::PacketType::AtomicResponse;
        break;
      }
      case em::PacketType::SendRequest: {
        const size_t posted = opts_ & kNicNoReceives ? 0 : std::size(kRecvs);
        if (recvUsed_ == posted) return {em::PacketType::Ack, mlx5::kSyndromeRnrRetryExcErr, {}};
        const RecvSpec& buffer = kRecvs[recvUsed_++];
        if (payload.size() > buffer.capacity) {
          qpError_ = true;
          recvFailed_ = true;
          return {em::PacketType::Ack, mlx5::kSyndromeRemoteInvalReqErr, {}};
        }
        std::copy(payload.begin(), payload.end(), memory_.shadow[kNicLocal].begin() + buffer.offset);
        sendBytes_.push_back(static_cast<uint32_t>(payload.size()));
        break;
      }
      default:
        MORI_FUZZ_ASSERT(false, "modelled a packet of type %u", r.type);
    }
    expectedPsn_ = (expectedPsn_ + 1) & kPsnMask;
    return a;
  }

  // What a request that got no answer (the connection died first) may have changed.
  void FreeTarget(const em::PacketHeader& r, const Bytes& payload) {
    int b = -1;
    uint64_t len = 0;
    if (r.type == static_cast<uint8_t>(em::PacketType::WriteRequest)) {
      len = payload.size();
      b = memory_.Remote(r.rkey, r.raddr, len, mori::rdma::kRdmaAccessRemoteWrite);
    } else if (r.type == static_cast<uint8_t>(em::PacketType::AtomicRequest)) {
      len = 8;
      b = memory_.Remote(r.rkey, r.raddr, len, mori::rdma::kRdmaAccessRemoteAtomic);
    } else if (r.type == static_cast<uint8_t>(em::PacketType::SendRequest)) {
      for (const RecvSpec& buffer : kRecvs)
        memory_.Free(kNicLocal, memory_.Base(kNicLocal) + buffer.offset, buffer.capacity);
      return;
    }
    if (b >= 0) memory_.Free(b, r.raddr, len);
  }

  void RunResponder(const std::vector<Packet>& packets) {
    expectedPsn_ = startPsn_;
    qpError_ = recvFailed_ = false;
    recvUsed_ = 0;
    sendBytes_.clear();
    const size_t posted = opts_ & kNicNoReceives ? 0 : std::size(kRecvs);
    for (size_t i = 0; i < posted; ++i) {
      nic_->HostPostRecv(ep_, memory_.Base(kNicLocal) + kRecvs[i].offset, memory_.keys[kNicLocal], kRecvs[i].capacity,
                         100 + i);
    }
    // Which requests the NIC takes: those before anything that ends the connection, whose check passes.
    Bytes out;
    size_t first = 0;
    bool peerOk = true, alive = true;
    if (opts_ & kNicFuzzHello) {
      const Packet* hello = packets.empty() ? nullptr : &packets[0];
      alive = hello != nullptr && hello->complete && em::CheckPacketHeader(hello->h).empty() &&
              em::HelloAdmits(hello->h, nicNonce_) && em::PacketCheckPasses(hello->h, nullptr, 0);
      peerOk = alive && hello->h.swapAdd == kPeerNonce;
      first = 1;
      if (hello != nullptr) out = hello->bytes;
    } else {
      em::PacketHeader hello = em::MakePacketHeader(em::PacketType::Hello);
      hello.raddr = nicNonce_;
      hello.swapAdd = kPeerNonce;
      hello.icrc = em::PacketCheck(hello, nullptr, 0);
      out.resize(sizeof(hello));
      std::memcpy(out.data(), &hello, sizeof(hello));
    }
    std::vector<const Packet*> taken;
    bool cut = !alive;  // the NIC ends the connection before the input does
    for (size_t i = first; i < packets.size(); ++i) {
      const Packet& p = packets[i];
      out.insert(out.end(), p.bytes.begin(), p.bytes.end());
      if (cut || !p.complete) continue;
      if (!em::CheckPacketHeader(p.h).empty() || em::IsHello(p.h.type)) {
        cut = true;
        continue;
      }
      if (em::IsRequest(p.h.type) && em::PacketCheckPasses(p.h, p.payload.data(), p.payload.size()))
        taken.push_back(&p);
    }

    UniqueFd fd = net::ConnectWithRetry(nicAddr_, Deadline::After(kWaitS), "the emulated NIC");
    std::vector<Packet> answers = Parse(Exchange(fd.Get(), out), "response");
    fd.Reset();

    MORI_FUZZ_ASSERT(answers.size() <= taken.size(), "%zu responses to %zu requests", answers.size(), taken.size());
    bool rnrWait = false;  // a send waiting for a receive buffer may see its connection die first
    for (size_t i = 0; i < taken.size(); ++i) {
      const em::PacketHeader& r = taken[i]->h;
      const bool wasRnr = !qpError_ && recvUsed_ == (opts_ & kNicNoReceives ? 0 : std::size(kRecvs));
      Answer want = Model(r, taken[i]->payload, peerOk);
      rnrWait |= wasRnr && want.syndrome == mlx5::kSyndromeRnrRetryExcErr;
      if (i >= answers.size()) {
        FreeTarget(r, taken[i]->payload);
        continue;
      }
      const em::PacketHeader& got = answers[i].h;
      MORI_FUZZ_ASSERT(got.psn == r.psn && got.srcQpn == r.dstQpn && got.dstQpn == r.srcQpn,
                       "response %zu (psn %u, QP %u to %u) does not answer request psn %u from QP %u to %u", i, got.psn,
                       got.srcQpn, got.dstQpn, r.psn, r.srcQpn, r.dstQpn);
      MORI_FUZZ_ASSERT(got.type == static_cast<uint8_t>(want.type) && got.syndrome == want.syndrome,
                       "request %zu (type %u, psn %u, rkey 0x%x, raddr 0x%llx, length %llu, atomic op %u) got type %u "
                       "syndrome 0x%x; an RC responder owes type %u syndrome 0x%x",
                       i, r.type, r.psn, r.rkey, static_cast<unsigned long long>(r.raddr),
                       static_cast<unsigned long long>(r.length), r.atomicOp, got.type, got.syndrome,
                       static_cast<unsigned>(want.type), want.syndrome);
      MORI_FUZZ_ASSERT(answers[i].payload == want.data, "read response %zu carries other bytes than memory held", i);
      MORI_FUZZ_ASSERT(want.type != em::PacketType::AtomicResponse || got.swapAdd == want.old,
                       "atomic response %zu says the old value was 0x%llx, memory held 0x%llx", i,
                       static_cast<unsigned long long>(got.swapAdd), static_cast<unsigned long long>(want.old));
    }
    // A connection that nothing ended took every request to its end: each has its answer.
    MORI_FUZZ_ASSERT(cut || rnrWait || answers.size() == taken.size(),
                     "%zu responses to %zu requests on a connection "
                     "that only its peer closed",
                     answers.size(), taken.size());
    memory_.Check("responder");
    CheckReceives(answers.size() == taken.size());
  }

  // Receive completions: one per send the model delivered (its length), and flushes after a receive failed.
  void CheckReceives(bool everyAnswer) {
    size_t want = sendBytes_.size();
    const size_t posted = opts_ & kNicNoReceives ? 0 : std::size(kRecvs);
    if (recvFailed_) want = posted;
    if (!everyAnswer) want = 0;  // the model does not know how far the NIC got: take what comes
    std::vector<HostCompletion> got;
    const Deadline deadline = Deadline::After(kWaitS);
    while (got.size() < want) {
      MORI_FUZZ_ASSERT(!deadline.Expired(), "%zu of %zu receive completions came", got.size(), want);
      HostCompletion c[4];
      int n = nic_->HostPoll(ep_, c, 4);
      got.insert(got.end(), c, c + n);
    }
    for (size_t i = 0; i < got.size(); ++i) {
      MORI_FUZZ_ASSERT(got[i].isReceive && got[i].wrId == 100 + i, "completion %zu: receive %d, id %llu", i,
                       got[i].isReceive, static_cast<unsigned long long>(got[i].wrId));
      if (i < sendBytes_.size()) {
        MORI_FUZZ_ASSERT(got[i].status == 0 && got[i].bytes == sendBytes_[i],
                         "receive %zu: status 0x%x, %u bytes; "
                         "the send delivered %u",
                         i, got[i].status, got[i].bytes, sendBytes_[i]);
      } else if (everyAnswer) {
        MORI_FUZZ_ASSERT(
            got[i].status == (i == sendBytes_.size() ? mlx5::kSyndromeLocalLengthErr : mlx5::kSyndromeWrFlushErr),
            "receive %zu after the failed one: status 0x%x", i, got[i].status);
      }
    }
  }

  // ------------------------------------------------------------ requester: the input answers the NIC's requests

  void RunRequester(const std::vector<Packet>& packets, uint8_t mask) {
    std::vector<const WqeSpec*> wqes;
    for (size_t k = 0; k < kNicWqes; ++k) {
      if (!(mask & (1u << k))) continue;
      const WqeSpec& s = kWqes[k];
      wqes.push_back(&s);
      HostWorkRequest wr;
      wr.op = s.op;
      wr.laddr = memory_.Base(kNicLocal) + s.offset;
      wr.lkey = memory_.keys[kNicLocal];
      wr.raddr = 0x10000 + 0x100 * k;  // the peer's memory: the harness plays it
      wr.rkey = 0x99;
      wr.bytes = s.bytes;
      wr.swapAdd = 0x1111 * (k + 1);
      wr.compare = 0x2222;
      wr.inlineData = kInlineBytes;
      wr.wrId = k;
      nic_->HostPost(ep_, wr);
    }
    UniqueFd fd = net::AcceptOne(listener_.Get(), Deadline::After(kWaitS));
    MORI_FUZZ_ASSERT(fd, "the NIC did not connect to its QP's peer");
    CheckRequests(fd.Get(), wqes);

    // The outcome of each WQE from the first response that matches it; the connection ends at anything else that a
    // requester's connection must not carry.
    std::vector<const Packet*> matched(wqes.size(), nullptr);
    Bytes out;
    bool cut = false;
    for (const Packet& p : packets) {
      out.insert(out.end(), p.bytes.begin(), p.bytes.end());
      if (cut || !p.complete) continue;
      if (!em::CheckPacketHeader(p.h).empty() || em::IsHello(p.h.type) || em::IsRequest(p.h.type)) {
        cut = true;
        continue;
      }
      if (!em::PacketCheckPasses(p.h, p.payload.data(), p.payload.size()) || p.h.dstQpn != ep_.handle.qpn ||
          p.h.srcQpn != kPeerQpn) {
        continue;
      }
      for (size_t i = 0; i < wqes.size(); ++i) {
        if (matched[i] == nullptr && p.h.psn == ((startPsn_ + i) & kPsnMask)) {
          matched[i] = &p;
          break;
        }
      }
    }
    Bytes back = Exchange(fd.Get(), out);
    MORI_FUZZ_ASSERT(back.empty(), "the NIC sent %zu more bytes after its requests", back.size());
    fd.Reset();

    // Every WQE completes: those before the first failure as their responses say, that one with its syndrome (no
    // response at all: the retries ran out when the connection closed), the rest flushed.
    std::vector<HostCompletion> got;
    const Deadline deadline = Deadline::After(kWaitS);
    while (got.size() < wqes.size()) {
      MORI_FUZZ_ASSERT(!deadline.Expired(), "%zu of %zu WQEs completed", got.size(), wqes.size());
      HostCompletion c[4];
      int n = nic_->HostPoll(ep_, c, 4);
      got.insert(got.end(), c, c + n);
    }
    bool failed = false;
    for (size_t i = 0; i < wqes.size(); ++i) {
      const WqeSpec& s = *wqes[i];
      const Packet* r = matched[i];
      uint8_t status = mlx5::kSyndromeTransportRetryExcErr;
      if (r != nullptr) {
        status = r->h.syndrome != 0 ? NakStatus(r->h.syndrome)
                 : r->h.type != static_cast<uint8_t>(s.response) ||
                         (s.response == em::PacketType::ReadResponse && r->payload.size() != s.bytes)
                     ? uint8_t{mlx5::kSyndromeBadRespErr}
                     : uint8_t{0};
      }
      const uint8_t want = failed ? uint8_t{mlx5::kSyndromeWrFlushErr} : status;
      MORI_FUZZ_ASSERT(!got[i].isReceive && got[i].wrId == static_cast<uint64_t>(&s - kWqes),
                       "completion %zu: receive %d, id %llu", i, got[i].isReceive,
                       static_cast<unsigned long long>(got[i].wrId));
      MORI_FUZZ_ASSERT(got[i].status == want, "WQE %zu (op %u) completed with 0x%x; its response calls for 0x%x", i,
                       static_cast<unsigned>(s.op), got[i].status, want);
      // What a response writes locally: a read's data, an atomic's old value.
      if (status == 0 && (s.response == em::PacketType::ReadResponse || s.response == em::PacketType::AtomicResponse)) {
        Bytes data = r->payload;
        if (s.response == em::PacketType::AtomicResponse) {
          data.resize(8);
          std::memcpy(data.data(), &r->h.swapAdd, 8);
        }
        uint8_t* at = memory_.bytes[kNicLocal].get() + s.offset;
        // After the first failure a response may or may not have landed (the flush races it), but only whole.
        if (failed && std::memcmp(at, memory_.shadow[kNicLocal].data() + s.offset, s.bytes) == 0) continue;
        std::copy(data.begin(), data.end(), memory_.shadow[kNicLocal].begin() + s.offset);
      }
      failed |= status != 0;
    }
    memory_.Check("requester");
  }

  // The NIC's hello and one request per WQE, as the WQEs say.
  void CheckRequests(int fd, const std::vector<const WqeSpec*>& wqes) {
    const Deadline deadline = Deadline::After(kWaitS);
    em::PacketHeader hello{};
    net::RecvAll(fd, &hello, sizeof(hello), deadline, "the emulated NIC");
    MORI_FUZZ_ASSERT(
        em::HelloAdmits(hello, kPeerNonce) && hello.swapAdd == nicNonce_ && em::PacketCheckPasses(hello, nullptr, 0),
        "the NIC's hello (type %u) names other nonces or fails its check", hello.type);
    for (size_t i = 0; i < wqes.size(); ++i) {
      const WqeSpec& s = *wqes[i];
      em::PacketHeader h{};
      net::RecvAll(fd, &h, sizeof(h), deadline, "the emulated NIC");
      MORI_FUZZ_ASSERT(em::CheckPacketHeader(h).empty() && h.type == static_cast<uint8_t>(s.request) &&
                           h.psn == ((startPsn_ + i) & kPsnMask) && h.srcQpn == ep_.handle.qpn && h.dstQpn == kPeerQpn,
                       "request %zu: type %u psn %u QP %u to %u", i, h.type, h.psn, h.srcQpn, h.dstQpn);
      Bytes payload(em::PayloadBytes(h));
      if (!payload.empty()) net::RecvAll(fd, payload.data(), payload.size(), deadline, "the emulated NIC");
      MORI_FUZZ_ASSERT(em::PacketCheckPasses(h, payload.data(), payload.size()), "request %zu fails its check", i);
      const uint8_t* source = s.op == HostOp::WriteInline ? kInlineBytes : memory_.bytes[kNicLocal].get() + s.offset;
      const bool carries = s.request == em::PacketType::WriteRequest || s.request == em::PacketType::SendRequest;
      MORI_FUZZ_ASSERT(carries ? payload.size() == s.bytes && std::memcmp(payload.data(), source, s.bytes) == 0
                               : h.length == (s.request == em::PacketType::ReadRequest ? s.bytes : 0),
                       "request %zu carries %zu bytes (length %llu) for a WQE of %u", i, payload.size(),
                       static_cast<unsigned long long>(h.length), s.bytes);
    }
  }

  mori::rdma::RdmaContext context_;
  mori::rdma::RdmaDeviceContext* nic_ = nullptr;
  mori::rdma::EmulatedNicControl* control_ = nullptr;
  Memory memory_;
  net::SocketAddress nicAddr_;
  uint64_t nicNonce_ = 0;
  RdmaEndpointHandle peerHandle_{};
  UniqueFd listener_;

  // Per input.
  uint8_t opts_ = 0;
  uint32_t startPsn_ = 0;
  RdmaEndpoint ep_{};
  uint32_t expectedPsn_ = 0;
  bool qpError_ = false, recvFailed_ = false;
  size_t recvUsed_ = 0;
  std::vector<uint32_t> sendBytes_;  // of the sends delivered, in order
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MORI_TIMEOUT_S", "5", 1);      // the NIC's ack timer and every wait of the library: bounded and short
  setenv("MORI_LOG_LEVEL", "error", 1);  // refused connections and requests would log warnings
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness* harness = new Harness();  // the NIC, its engine thread and the registrations live across inputs
  try {
    harness->Run(data, size);
  } catch (const mori::core::Error& e) {
    MORI_FUZZ_ASSERT(false, "mori::core::Error out of the harness: %s", e.what());
  }
  return 0;
}
