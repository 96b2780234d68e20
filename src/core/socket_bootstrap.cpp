// The TCP bootstrap. Rank 0 listens at the unique id's address; every other rank connects there,
// says hello with its own listening address and gets back the table of all addresses. After that each
// rank opens one outgoing connection per peer it sends to, lazily, and reads everything that arrives on
// its incoming connections into a stash keyed by (sender, kind, tag). Reads happen inside every blocking
// call, sends included, so two ranks sending large messages to each other never deadlock on full buffers.
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <tuple>

#include "bootstrap_wire.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "siphash.hpp"
#include "socket.hpp"

namespace mori::core {

namespace bootstrap_wire {

std::string CheckHeader(const FrameHeader& h) {
  if (h.magic != kFrameMagic) return StrFormat("bad magic 0x%08x (not a mori bootstrap peer)", h.magic);
  if (h.version != kVersion) {
    return StrFormat("protocol version %u, this build speaks %u", static_cast<unsigned>(h.version), kVersion);
  }
  if (h.type < static_cast<uint16_t>(FrameType::Hello) || h.type > static_cast<uint16_t>(FrameType::Collective)) {
    return StrFormat("unknown frame type %u", static_cast<unsigned>(h.type));
  }
  if (h.length > kMaxPayload) {
    return StrFormat("frame length %llu beyond the %llu-byte limit", static_cast<unsigned long long>(h.length),
                     static_cast<unsigned long long>(kMaxPayload));
  }
  if (h.type == static_cast<uint16_t>(FrameType::Hello) && h.length != sizeof(HelloPayload)) {
    return StrFormat("hello of %llu bytes, expected %zu", static_cast<unsigned long long>(h.length),
                     sizeof(HelloPayload));
  }
  return "";
}

std::string CheckHello(const HelloPayload& hello, uint64_t nonce, int nRanks) {
  if (hello.nonce != nonce) {
    // This job's nonce stays out of the text: with MORI_BOOTSTRAP_SECRET it is what admits a process.
    return StrFormat(
        "job nonce %016llx is not this job's (a process of another job, or a different "
        "MORI_BOOTSTRAP_SECRET?)",
        static_cast<unsigned long long>(hello.nonce));
  }
  if (hello.purpose != static_cast<uint32_t>(HelloPurpose::Register) &&
      hello.purpose != static_cast<uint32_t>(HelloPurpose::Data)) {
    return StrFormat("unknown hello purpose %u", hello.purpose);
  }
  if (hello.nRanks != nRanks) {
    return StrFormat("rank %d was started with world size %d, this rank with %d", hello.rank, hello.nRanks, nRanks);
  }
  if (hello.rank < 0 || hello.rank >= nRanks) {
    return StrFormat("rank %d is outside the world of %d ranks", hello.rank, nRanks);
  }
  return "";
}

uint64_t AddressNonce(const std::string& rootAddress, const std::string& secret) {
  if (secret.empty()) {
    // FNV-1a: every rank derives the same value from the same text, and so can anyone else.
    uint64_t nonce = 1469598103934665603ull;
    for (char c : rootAddress) nonce = (nonce ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    return nonce;
  }
  // Not FNV over secret and address: each FNV step can be undone, so one nonce seen on the wire would give the
  // state after the secret and with it the nonce of every other address. SipHash is keyed by 128 bits drawn
  // from the secret (under two fixed public keys), and hashes the address with a label of its use.
  const SipKey deriveLow{0x6d6f72692d736563ull, 0x7265742d6b657931ull};
  const SipKey deriveHigh{0x6d6f72692d736563ull, 0x7265742d6b657932ull};
  const SipKey key{SipHash24(deriveLow, secret.data(), secret.size()),
                   SipHash24(deriveHigh, secret.data(), secret.size())};
  const std::string message = "mori bootstrap job nonce v1 " + rootAddress;
  return SipHash24(key, message.data(), message.size());
}

std::string CheckTable(const std::vector<net::WireAddress>& table, int nRanks, int self,
                       const net::WireAddress& registered) {
  if (table.size() != static_cast<size_t>(nRanks)) {
    return StrFormat("%zu entries for a world of %d ranks", table.size(), nRanks);
  }
  for (size_t r = 0; r < table.size(); ++r) {
    const net::WireAddress& w = table[r];
    if (w.family != AF_INET && w.family != AF_INET6) {
      return StrFormat("rank %zu's entry has address family %u", r, static_cast<unsigned>(w.family));
    }
    const size_t addrBytes = w.family == AF_INET ? 4 : sizeof(w.addr);
    const auto zero = [](const uint8_t* p, size_t n) {
      return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
    };
    if (w.family == AF_INET && (!zero(w.addr + 4, sizeof(w.addr) - 4) || w.scopeId != 0)) {
      return StrFormat("rank %zu's IPv4 entry has bytes beyond its address", r);
    }
    if (zero(w.addr, addrBytes)) return StrFormat("rank %zu's entry is the unspecified address", r);
    if (w.port == 0) return StrFormat("rank %zu's entry has port 0", r);
  }
  if (std::memcmp(&table[static_cast<size_t>(self)], &registered, sizeof(registered)) != 0) {
    return StrFormat("this rank's entry is %s, but it registered %s",
                     net::SocketAddress::FromWire(table[static_cast<size_t>(self)]).ToString().c_str(),
                     net::SocketAddress::FromWire(registered).ToString().c_str());
  }
  return "";
}

std::string PrintableReason(const std::string& raw, uint64_t announced) {
  std::string shown;
  size_t used = 0;
  for (; used < raw.size(); ++used) {
    const auto c = static_cast<uint8_t>(raw[used]);
    const bool plain = c >= 0x20 && c < 0x7f && c != '\\';
    if (shown.size() + (plain ? 1 : 4) > kMaxAbortReason) break;
    if (plain) {
      shown += static_cast<char>(c);
    } else {
      shown += StrFormat("\\x%02x", c);
    }
  }
  if (used < announced) {
    shown += StrFormat(" [%llu more bytes not shown]", static_cast<unsigned long long>(announced - used));
  }
  return shown;
}

FrameHeader MakeHeader(FrameType type, int srcRank, int tag, uint64_t length) {
  FrameHeader h;
  h.magic = kFrameMagic;
  h.version = kVersion;
  h.type = static_cast<uint16_t>(type);
  h.srcRank = srcRank;
  h.tag = tag;
  h.length = length;
  return h;
}

const char* FrameTypeName(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::Hello: return "hello";
    case FrameType::Table: return "table";
    case FrameType::Abort: return "abort";
    case FrameType::Data: return "data";
    case FrameType::Collective: return "collective";
  }
  return "unknown";
}

}  // namespace bootstrap_wire

namespace {

using bootstrap_wire::FrameHeader;
using bootstrap_wire::FrameType;
using bootstrap_wire::HelloPayload;
using bootstrap_wire::HelloPurpose;
using bootstrap_wire::MakeHeader;
using bootstrap_wire::UniqueIdLayout;

// How long a peer's address may refuse connections before the peer is taken for dead. Every peer listened before
// its address went round and keeps its listener until it ends, and a full accept queue drops connection attempts
// instead of refusing them, so a refusal means the listener is gone; the grace covers nothing but scheduling. (It
// was 2 s: a survivor's sends to a PE killed during ShmemInit then added 2 s to each collective that met it, and
// one ran past MORI_TIMEOUT_S + 1.5 s in chaos.py --phase init.)
constexpr double kPeerRefusedGiveUpS = 0.25;

uint64_t RandomNonce() {
  uint64_t v = 0;
  while (v == 0) {
    if (getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) {
      MORI_THROW_SYS(errno, "getrandom for the bootstrap nonce");
    }
  }
  return v;
}

UniqueIdLayout DecodeId(const UniqueId& id) {
  UniqueIdLayout l;
  std::memcpy(&l, id.bytes, sizeof(l));
  MORI_CHECK(l.magic == bootstrap_wire::kUniqueIdMagic, ErrorCode::InvalidUsage,
             "the unique id is not a mori unique id (magic 0x%08x); was it copied whole to every rank?", l.magic);
  MORI_CHECK(l.version == bootstrap_wire::kVersion, ErrorCode::InvalidUsage,
             "the unique id has protocol version %u, this build speaks %u", static_cast<unsigned>(l.version),
             bootstrap_wire::kVersion);
  return l;
}

UniqueId EncodeId(uint64_t nonce, const net::SocketAddress& root) {
  UniqueIdLayout l;
  std::memset(&l, 0, sizeof(l));
  l.magic = bootstrap_wire::kUniqueIdMagic;
  l.version = bootstrap_wire::kVersion;
  l.nonce = nonce;
  l.root = root.ToWire();
  UniqueId id;
  std::memcpy(id.bytes, &l, sizeof(l));
  return id;
}

// Listeners opened by CreateUniqueId, waiting for Initialize on rank 0 of this process to adopt them.
std::mutex& PendingMutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::map<uint64_t, UniqueFd>& PendingListeners() {
  static std::map<uint64_t, UniqueFd>* m = new std::map<uint64_t, UniqueFd>();
  return *m;
}
std::deque<uint64_t>& PendingOrder() {  // nonces in creation order (some may be gone from the map already)
  static std::deque<uint64_t>* d = new std::deque<uint64_t>();
  return *d;
}

std::string RankName(int rank) { return StrFormat("rank %d", rank); }

// Whether `a` has the IP of `b` (ports differ: a peer's outgoing connections leave from ephemeral ports).
bool SameIp(const net::SocketAddress& a, const net::WireAddress& b) {
  net::WireAddress w = a.ToWire();
  if (w.family != b.family) return false;
  return std::memcmp(w.addr, b.addr, w.family == AF_INET ? 4 : sizeof(w.addr)) == 0;
}

}  // namespace

class SocketBootstrap::Impl {
 public:
  Impl(int rank, int nRanks) : rank_(rank), nRanks_(nRanks) {
    MORI_CHECK(nRanks > 0, ErrorCode::InvalidUsage, "SocketBootstrap: world size %d must be positive", nRanks);
    MORI_CHECK(rank >= 0 && rank < nRanks, ErrorCode::InvalidUsage,
               "SocketBootstrap: rank %d is outside the world of %d ranks", rank, nRanks);
  }

  // `publicNonce`: the nonce is the address's alone (no MORI_BOOTSTRAP_SECRET), so anyone can compute it.
  void Initialize(const UniqueId& id, const std::string& ifname, double timeoutSeconds, bool publicNonce) {
    std::lock_guard<std::mutex> lock(mutex_);
    MORI_CHECK(!initialized_, ErrorCode::InvalidUsage, "SocketBootstrap::Initialize called twice");
    timeout_ = timeoutSeconds > 0 ? timeoutSeconds : mori::core::TimeoutSeconds();
    joinTimeout_ = mori::core::BootstrapJoinTimeoutSeconds(timeout_);
    joinBoundFrom_ = EnvIsSet("MORI_BOOTSTRAP_JOIN_TIMEOUT_S") ? "MORI_BOOTSTRAP_JOIN_TIMEOUT_S"
                     : timeoutSeconds > 0                 ? "the bound given to Initialize"
                                                          : "MORI_TIMEOUT_S";
    UniqueIdLayout l = DecodeId(id);
    nonce_ = l.nonce;
    net::SocketAddress root = net::SocketAddress::FromWire(l.root);
    SetLogRank(rank_);
    if (publicNonce && rank_ == 0 && nRanks_ > 1) {
      MORI_LOG_WARN(Bootstrap,
                    "this job's bootstrap is unauthenticated: anyone who can reach %s can join it or disturb it; set "
                    "MORI_BOOTSTRAP_SECRET to one secret value on every rank to keep others out",
                    root.ToString().c_str());
    }
    outgoing_.resize(static_cast<size_t>(nRanks_));
    peerAddrs_.resize(static_cast<size_t>(nRanks_));
    dataConnected_.assign(static_cast<size_t>(nRanks_), false);
    if (rank_ == 0) {
      RegisterAsRoot(root);
    } else {
      try {
        RegisterWithRoot(root, ifname);
      } catch (const TimeoutError& e) {
        throw TimeoutError(StrFormat("rank %d: %s (the join's bound, from %s)", rank_, e.what(), joinBoundFrom_));
      }
    }
    initialized_ = true;
    MORI_LOG_INFO(Bootstrap, "bootstrap up: rank %d of %d, listening at %s, root %s", rank_, nRanks_,
                  listenAddr_.ToString().c_str(), root.ToString().c_str());
  }

  int Rank() const { return rank_; }
  int Nranks() const { return nRanks_; }
  double Timeout() const { return timeout_; }

  void Send(const void* data, size_t bytes, int peer, int tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    CheckReady("Send");
    CheckPeer(peer, "Send");
    MORI_CHECK(tag >= 0, ErrorCode::InvalidUsage, "bootstrap Send: tag %d must be >= 0", tag);
    SendFrame(FrameType::Data, peer, tag, data, bytes, Deadline::After(timeout_));
  }

  void Recv(void* data, size_t bytes, int peer, int tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    CheckReady("Recv");
    CheckPeer(peer, "Recv");
    MORI_CHECK(tag >= 0, ErrorCode::InvalidUsage, "bootstrap Recv: tag %d must be >= 0", tag);
    RecvFrame(FrameType::Data, peer, tag, data, bytes, Deadline::After(timeout_));
  }

  // Ring: in step s every rank passes on the slot it received in step s-1.
  void AllGather(void* allData, size_t bytesPerRank) {
    std::lock_guard<std::mutex> lock(mutex_);
    CheckReady("AllGather");
    int seq = collSeq_++;
    if (nRanks_ == 1) return;
    auto* base = static_cast<uint8_t*>(allData);
    int next = (rank_ + 1) % nRanks_;
    int prev = (rank_ + nRanks_ - 1) % nRanks_;
    Deadline deadline = Deadline::After(timeout_);
    for (int step = 0; step < nRanks_ - 1; ++step) {
      int sendSlot = (rank_ - step + nRanks_) % nRanks_;
      int recvSlot = (rank_ - step - 1 + 2 * nRanks_) % nRanks_;
      SendFrame(FrameType::Collective, next, seq, base + static_cast<size_t>(sendSlot) * bytesPerRank, bytesPerRank,
                deadline);
      RecvFrame(FrameType::Collective, prev, seq, base + static_cast<size_t>(recvSlot) * bytesPerRank, bytesPerRank,
                deadline);
    }
  }

  // Dissemination barrier: ceil(log2 n) rounds, in round k send to rank+2^k and hear from rank-2^k.
  void Barrier() {
    std::lock_guard<std::mutex> lock(mutex_);
    CheckReady("Barrier");
    int seq = collSeq_++;
    Deadline deadline = Deadline::After(timeout_);
    for (int dist = 1; dist < nRanks_; dist <<= 1) {
      uint8_t token = 1;
      SendFrame(FrameType::Collective, (rank_ + dist) % nRanks_, seq, &token, 1, deadline);
      RecvFrame(FrameType::Collective, (rank_ - dist + nRanks_) % nRanks_, seq, &token, 1, deadline);
    }
  }

  // Binomial tree rooted at `root`.
  void Broadcast(void* data, size_t bytes, int root) {
    std::lock_guard<std::mutex> lock(mutex_);
    CheckReady("Broadcast");
    CheckPeer(root, "Broadcast root");
    int seq = collSeq_++;
    Deadline deadline = Deadline::After(timeout_);
    int vrank = (rank_ - root + nRanks_) % nRanks_;
    int mask = 1;
    while (mask < nRanks_) {
      if (vrank & mask) {
        RecvFrame(FrameType::Collective, (vrank - mask + root) % nRanks_, seq, data, bytes, deadline);
        break;
      }
      mask <<= 1;
    }
    mask >>= 1;
    while (mask > 0) {
      if (vrank + mask < nRanks_) {
        SendFrame(FrameType::Collective, (vrank + mask + root) % nRanks_, seq, data, bytes, deadline);
      }
      mask >>= 1;
    }
  }

 private:
  struct Incoming {
    UniqueFd fd;
    net::SocketAddress from;
    int srcRank = -1;       // known after its hello
    bool registration = false;  // a rank's registration with the root
    bool counted = false;       // the root has counted this registration
    FrameHeader header{};
    size_t headerGot = 0;
    std::vector<uint8_t> payload;  // grows as the payload arrives, never ahead of it by more than a piece
    size_t payloadGot = 0;
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();  // accepted at
  };
  using StashKey = std::tuple<int, uint16_t, int>;  // (source rank, frame type, tag)

  void CheckReady(const char* op) const {
    MORI_CHECK(initialized_, ErrorCode::InvalidUsage, "bootstrap %s before Initialize", op);
  }

  void CheckPeer(int peer, const char* op) const {
    MORI_CHECK(peer >= 0 && peer < nRanks_, ErrorCode::InvalidUsage, "bootstrap %s: rank %d is outside the world of %d",
               op, peer, nRanks_);
  }

  void RegisterAsRoot(const net::SocketAddress& root) {
    {
      std::lock_guard<std::mutex> lock(PendingMutex());
      auto it = PendingListeners().find(nonce_);
      if (it != PendingListeners().end()) {
        listener_ = std::move(it->second);
        PendingListeners().erase(it);
      }
    }
    listenAddr_ = root;
    peerAddrs_[0] = listenAddr_.ToWire();
    if (nRanks_ == 1) return;  // a job of one talks only to itself: no socket
    if (!listener_) listener_ = net::Listen(listenAddr_);
    net::SetNonBlocking(listener_.Get(), true);

    Deadline deadline = Deadline::After(joinTimeout_);
    std::vector<bool> seen(static_cast<size_t>(nRanks_), false);
    seen[0] = true;
    int count = 1;
    while (true) {
      for (auto& in : incoming_) {
        if (!in.registration || in.counted) continue;
        in.counted = true;
        if (seen[static_cast<size_t>(in.srcRank)]) {
          AbortRegistration(StrFormat("two processes registered as rank %d (the second from %s)", in.srcRank,
                                      in.from.ToString().c_str()));
        }
        seen[static_cast<size_t>(in.srcRank)] = true;
        ++count;
      }
      if (!registrationError_.empty()) AbortRegistration(registrationError_);
      if (count == nRanks_) break;
      if (deadline.Expired()) {
        std::string missing;
        for (int r = 1; r < nRanks_; ++r) {
          if (!seen[static_cast<size_t>(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        std::string reason = StrFormat(
            "bootstrap root (rank 0 at %s) waited %.0f s (the join's bound, from %s); rank(s) %s of %d never "
            "registered (not started, crashed, or given another root address?)",
            listenAddr_.ToString().c_str(), joinTimeout_, joinBoundFrom_, missing.c_str(), nRanks_);
        if (!refusedRegistrations_.empty()) {
          reason += StrFormat(
              "; refused meanwhile, for a job nonce not this job's (ranks given different "
              "MORI_BOOTSTRAP_SECRET values, or processes of another job): %s",
              refusedRegistrations_.c_str());
        }
        TellRegisteredRanks(reason);
        throw TimeoutError(reason);
      }
      Progress(std::min(deadline.RemainingMs(), 100));
    }
    // Every registration reply carries the whole table; the registration connections end here.
    FrameHeader h = MakeHeader(FrameType::Table, 0, 0, peerAddrs_.size() * sizeof(net::WireAddress));
    for (auto& in : incoming_) {
      if (!in.registration) continue;
      net::SetNonBlocking(in.fd.Get(), false);
      net::SendAll(in.fd.Get(), &h, sizeof(h), deadline, RankName(in.srcRank));
      net::SendAll(in.fd.Get(), peerAddrs_.data(), h.length, deadline, RankName(in.srcRank));
    }
    incoming_.remove_if([](const Incoming& in) { return in.registration; });
  }

  // Tells every registered rank why the job cannot start, then fails here too.
  [[noreturn]] void AbortRegistration(const std::string& reason) {
    TellRegisteredRanks(reason);
    MORI_THROW(ErrorCode::InvalidUsage, "bootstrap registration failed: %s", reason.c_str());
  }

  void TellRegisteredRanks(const std::string& reason) {
    Deadline deadline = Deadline::After(std::min(timeout_, 5.0));
    for (auto& in : incoming_) {
      if (!in.registration || !in.fd) continue;
      FrameHeader h = MakeHeader(FrameType::Abort, 0, bootstrap_wire::kAbortJob, reason.size());
      try {
        net::SetNonBlocking(in.fd.Get(), false);
        net::SendAll(in.fd.Get(), &h, sizeof(h), deadline, "a registering rank");
        net::SendAll(in.fd.Get(), reason.data(), reason.size(), deadline, "a registering rank");
      } catch (const Error&) {
        // The rank is gone already; the others still hear the reason.
      }
    }
  }

  // Answers a registration whose job nonce is not this job's, without waiting on the peer (a stranger must not
  // stall the root), and closes it. The job goes on: the real rank may still come.
  void RefuseRegistration(Incoming& in, const HelloPayload& hello, const std::string& why) {
    static const std::string kReason =
        "its job nonce is not the root's: the ranks were given different MORI_BOOTSTRAP_SECRET values (or it is set "
        "on some of them only), or this process belongs to another job";
    FrameHeader h = MakeHeader(FrameType::Abort, 0, bootstrap_wire::kAbortHelloRefused, kReason.size());
    std::vector<uint8_t> reply(sizeof(h) + kReason.size());
    std::memcpy(reply.data(), &h, sizeof(h));
    std::memcpy(reply.data() + sizeof(h), kReason.data(), kReason.size());
    (void)send(in.fd.Get(), reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);  // best effort
    if (rank_ == 0 && !initialized_) {
      ++refusedCount_;
      if (refusedCount_ <= kRefusalsNamed) {
        refusedRegistrations_ += StrFormat("%sa registration as rank %d from %s", refusedCount_ > 1 ? ", " : "",
                                           hello.rank, in.from.ToString().c_str());
      } else if (refusedCount_ == kRefusalsNamed + 1) {
        refusedRegistrations_ += " and more";
      }
    }
    DropConnection(in, "refused: " + why);
  }

  void RegisterWithRoot(const net::SocketAddress& root, const std::string& ifname) {
    Deadline deadline = Deadline::After(joinTimeout_);
    net::SocketAddress local = ifname.empty() ? net::LocalAddressToward(root) : net::InterfaceAddressOf(ifname);
    local.SetPort(0);
    listenAddr_ = local;
    listener_ = net::Listen(listenAddr_);
    net::SetNonBlocking(listener_.Get(), true);

    UniqueFd conn = net::ConnectWithRetry(root, deadline, "the bootstrap root (rank 0)");
    HelloPayload hello = MakeHello(HelloPurpose::Register);
    FrameHeader h = MakeHeader(FrameType::Hello, rank_, 0, sizeof(hello));
    std::string rootName = "the bootstrap root (rank 0) at " + root.ToString();
    net::SendAll(conn.Get(), &h, sizeof(h), deadline, rootName);
    net::SendAll(conn.Get(), &hello, sizeof(hello), deadline, rootName);

    FrameHeader reply;
    net::RecvAll(conn.Get(), &reply, sizeof(reply), deadline, rootName);
    std::string bad = bootstrap_wire::CheckHeader(reply);
    MORI_CHECK(bad.empty(), ErrorCode::Protocol, "rank %d: malformed reply from %s: %s", rank_, rootName.c_str(),
               bad.c_str());
    if (reply.type == static_cast<uint16_t>(FrameType::Abort)) {
      std::string raw(std::min<uint64_t>(reply.length, bootstrap_wire::kMaxAbortReason), '\0');
      net::RecvAll(conn.Get(), raw.data(), raw.size(), deadline, rootName);
      const std::string reason = bootstrap_wire::PrintableReason(raw, reply.length);
      if (reply.tag == bootstrap_wire::kAbortHelloRefused) {
        throw Error(ErrorCode::RemoteFailure, StrFormat("rank %d: %s refused this rank's hello and closed the "
                                                        "connection: %s",
                                                        rank_, rootName.c_str(), reason.c_str()));
      }
      throw Error(ErrorCode::RemoteFailure, StrFormat("rank %d: the bootstrap root refused the job: %s", rank_,
                                                      reason.c_str()));
    }
    MORI_CHECK(reply.type == static_cast<uint16_t>(FrameType::Table) &&
                   reply.length == static_cast<uint64_t>(nRanks_) * sizeof(net::WireAddress),
               ErrorCode::Protocol, "rank %d: %s answered with a %s frame of %llu bytes, expected the address table",
               rank_, rootName.c_str(), bootstrap_wire::FrameTypeName(reply.type),
               static_cast<unsigned long long>(reply.length));
    net::RecvAll(conn.Get(), peerAddrs_.data(), reply.length, deadline, rootName);
    bad = bootstrap_wire::CheckTable(peerAddrs_, nRanks_, rank_, listenAddr_.ToWire());
    MORI_CHECK(bad.empty(), ErrorCode::Protocol, "rank %d: %s sent an address table that is not the root's: %s",
               rank_, rootName.c_str(), bad.c_str());
  }

  HelloPayload MakeHello(HelloPurpose purpose) const {
    HelloPayload hello;
    std::memset(&hello, 0, sizeof(hello));
    hello.nonce = nonce_;
    hello.rank = rank_;
    hello.nRanks = nRanks_;
    hello.purpose = static_cast<uint32_t>(purpose);
    hello.listen = listenAddr_.ToWire();
    return hello;
  }

  int OutgoingFd(int peer, const Deadline& deadline) {
    UniqueFd& fd = outgoing_[static_cast<size_t>(peer)];
    if (fd) return fd.Get();
    net::SocketAddress addr = net::SocketAddress::FromWire(peerAddrs_[static_cast<size_t>(peer)]);
    // Every rank listened before the addresses went round: a refusal that lasts means the peer is gone. The
    // connection leaves from the IP this rank announced, which the peer checks against the table.
    net::SocketAddress from = listenAddr_;
    from.SetPort(0);
    try {
      fd = net::ConnectWithRetry(addr, deadline, RankName(peer), {from, kPeerRefusedGiveUpS});
    } catch (const Error& e) {
      // Whatever failed here fails every later send to this peer at once instead of after another wait.
      if (e.Code() == ErrorCode::RemoteFailure) deadPeers_.emplace(peer, "refuses connections (its process exited?)");
      throw;
    }
    HelloPayload hello = MakeHello(HelloPurpose::Data);
    FrameHeader h = MakeHeader(FrameType::Hello, rank_, 0, sizeof(hello));
    net::SetNonBlocking(fd.Get(), true);
    WriteProgressing(fd.Get(), &h, sizeof(h), peer, deadline);
    WriteProgressing(fd.Get(), &hello, sizeof(hello), peer, deadline);
    return fd.Get();
  }

  void SendFrame(FrameType type, int peer, int tag, const void* data, size_t bytes, const Deadline& deadline) {
    if (peer == rank_) {
      const auto* p = static_cast<const uint8_t*>(data);
      stash_[StashKey(rank_, static_cast<uint16_t>(type), tag)].emplace_back(p, p + bytes);
      return;
    }
    auto dead = deadPeers_.find(peer);
    if (dead != deadPeers_.end()) {
      throw Error(ErrorCode::RemoteFailure, StrFormat("rank %d cannot send to rank %d: %s", rank_, peer,
                                                      dead->second.c_str()));
    }
    int fd = OutgoingFd(peer, deadline);
    FrameHeader h = MakeHeader(type, rank_, tag, bytes);
    WriteProgressing(fd, &h, sizeof(h), peer, deadline);
    WriteProgressing(fd, data, bytes, peer, deadline);
  }

  // Writes all bytes to `fd`, reading incoming frames whenever the socket is full.
  void WriteProgressing(int fd, const void* data, size_t bytes, int peer, const Deadline& deadline) {
    try {
      net::SendAll(fd, data, bytes, deadline, RankName(peer), [&](int ms) { Progress(ms, fd); });
    } catch (const Error&) {
      outgoing_[static_cast<size_t>(peer)].Reset();  // a broken stream is not used again
      throw;
    }
  }

  void RecvFrame(FrameType type, int peer, int tag, void* data, size_t bytes, const Deadline& deadline) {
    StashKey key(peer, static_cast<uint16_t>(type), tag);
    while (true) {
      auto it = stash_.find(key);
      if (it != stash_.end() && !it->second.empty()) {
        std::vector<uint8_t> msg = std::move(it->second.front());
        it->second.pop_front();
        if (peer != rank_) pendingBytes_ -= msg.size();
        if (it->second.empty()) stash_.erase(it);
        if (msg.size() != bytes) {
          throw Error(ErrorCode::InvalidUsage,
                      StrFormat("rank %d: rank %d sent %zu bytes (%s, tag %d) where %zu were expected", rank_, peer,
                                msg.size(), bootstrap_wire::FrameTypeName(static_cast<uint16_t>(type)), tag, bytes));
        }
        if (bytes > 0) std::memcpy(data, msg.data(), bytes);
        return;
      }
      auto dead = deadPeers_.find(peer);
      if (dead != deadPeers_.end()) {
        throw Error(ErrorCode::RemoteFailure,
                    StrFormat("rank %d waited for a %s message (tag %d) from rank %d, but rank %d %s", rank_,
                              bootstrap_wire::FrameTypeName(static_cast<uint16_t>(type)), tag, peer, peer,
                              dead->second.c_str()));
      }
      if (deadline.Expired()) {
        throw TimeoutError(StrFormat("rank %d waited %.0f s for a %s message (tag %d) from rank %d, which never came "
                                     "(rank %d hung, died or is in another call?)",
                                     rank_, deadline.TotalSeconds(),
                                     bootstrap_wire::FrameTypeName(static_cast<uint16_t>(type)), tag, peer, peer));
      }
      Progress(std::min(deadline.RemainingMs(), 100));
    }
  }

  // Waits up to `ms` for activity and absorbs it: new connections, frames, closed peers. Returns early
  // when `writeFd` (if given) becomes writable.
  void Progress(int ms, int writeFd = -1) {
    std::vector<pollfd> fds;
    fds.push_back({listener_.Get(), POLLIN, 0});
    std::vector<Incoming*> order;
    for (auto& in : incoming_) {
      fds.push_back({in.fd.Get(), POLLIN, 0});
      order.push_back(&in);
    }
    if (writeFd >= 0) fds.push_back({writeFd, POLLOUT, 0});
    int n = poll(fds.data(), fds.size(), std::max(ms, 0));
    if (n < 0 && errno == EINTR) return;
    MORI_CHECK_SYS(n);
    if (n > 0) {
      if (fds[0].revents & POLLIN) AcceptAll();
      for (size_t i = 0; i < order.size(); ++i) {
        if (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) ReadFrom(*order[i]);
      }
    }
    DropSilentStrangers();
    incoming_.remove_if([](const Incoming& in) { return !in.fd; });
  }

  // A connection that has not said who it is (no complete hello) within kHelloWaitS of being accepted (or the
  // bootstrap's timeout, if shorter) is closed: a rank sends its hello as soon as it connects.
  static constexpr double kHelloWaitS = 5;
  void DropSilentStrangers() {
    const auto now = std::chrono::steady_clock::now();
    const double bound = std::min(timeout_, kHelloWaitS);
    for (Incoming& in : incoming_) {
      if (!in.fd || in.srcRank >= 0 || in.registration) continue;
      const double idle = std::chrono::duration<double>(now - in.since).count();
      if (idle >= bound) DropConnection(in, StrFormat("sent no hello within %.0f s", bound));
    }
  }

  void AcceptAll() {
    while (true) {
      int fd = accept4(listener_.Get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // EAGAIN: nothing more to accept now
      }
      Incoming in;
      in.fd.Reset(fd);
      in.from = net::PeerAddressOf(fd);
      incoming_.push_back(std::move(in));
    }
  }

  // Drops a connection that spoke garbage: a stranger's is logged and forgotten, a known peer's marks the
  // peer failed so that whoever waits for it hears why.
  void DropConnection(Incoming& in, const std::string& reason) {
    if (in.srcRank < 0 || in.registration) {
      MORI_LOG_WARN(Bootstrap, "rank %d dropped a bootstrap connection from %s: %s", rank_, in.from.ToString().c_str(),
                    reason.c_str());
      if (in.registration && in.srcRank >= 0) registrationError_ = StrFormat("rank %d: %s", in.srcRank, reason.c_str());
    } else {
      MORI_LOG_WARN(Bootstrap, "rank %d: connection from rank %d failed: %s", rank_, in.srcRank, reason.c_str());
      deadPeers_.emplace(in.srcRank, reason);
    }
    in.fd.Reset();
  }

  void ReadFrom(Incoming& in) {
    while (in.fd) {
      uint8_t* dst;
      size_t want;
      if (in.headerGot < sizeof(FrameHeader)) {
        dst = reinterpret_cast<uint8_t*>(&in.header) + in.headerGot;
        want = sizeof(FrameHeader) - in.headerGot;
      } else {
        want = net::ReceiveRoom(in.payload, in.payloadGot, in.header.length);
        dst = in.payload.data() + in.payloadGot;
      }
      ssize_t n = want == 0 ? 0 : recv(in.fd.Get(), dst, want, MSG_DONTWAIT);
      if (want > 0 && n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        DropConnection(in, StrFormat("reset the connection (%s)", ErrnoString(errno).c_str()));
        return;
      }
      if (want > 0 && n == 0) {
        bool midFrame = in.headerGot > 0;
        DropConnection(in, midFrame ? StrFormat("closed its connection in the middle of a frame (%zu of %zu header "
                                                "bytes, %zu of %zu payload bytes: truncated)",
                                                in.headerGot, sizeof(FrameHeader), in.payloadGot,
                                                in.headerGot < sizeof(FrameHeader)
                                                    ? size_t{0}
                                                    : static_cast<size_t>(in.header.length))
                                    : std::string("closed its bootstrap connection (process exited?)"));
        return;
      }
      if (in.headerGot < sizeof(FrameHeader)) {
        in.headerGot += static_cast<size_t>(n);
        if (in.headerGot < sizeof(FrameHeader)) continue;
        std::string bad = bootstrap_wire::CheckHeader(in.header);
        if (bad.empty() && in.srcRank < 0 && in.header.type != static_cast<uint16_t>(FrameType::Hello)) {
          bad = StrFormat("first frame is a %s frame, not a hello", bootstrap_wire::FrameTypeName(in.header.type));
        }
        if (bad.empty() && in.srcRank >= 0 && in.header.srcRank != in.srcRank) {
          bad = StrFormat("frame claims to come from rank %d", in.header.srcRank);
        }
        if (bad.empty() && in.srcRank >= 0 && in.header.type != static_cast<uint16_t>(FrameType::Data) &&
            in.header.type != static_cast<uint16_t>(FrameType::Collective)) {
          bad = StrFormat("unexpected %s frame on a data connection", bootstrap_wire::FrameTypeName(in.header.type));
        }
        if (!bad.empty()) {
          DropConnection(in, "sent malformed bytes: " + bad);
          return;
        }
        in.payload.clear();
        in.payloadGot = 0;
      } else {
        in.payloadGot += static_cast<size_t>(n);
      }
      if (in.payloadGot < in.header.length) continue;
      FrameComplete(in);
      in.headerGot = 0;
      in.payloadGot = 0;
      in.payload.clear();
    }
  }

  // Why a data connection claiming `rank` is not taken, or "" when it is. A rank opens one connection to each
  // peer, after the table went round, from the IP the table gives it: anything else is not that rank, and is
  // refused before it can put frames in the stash or, by closing, mark the rank dead.
  std::string RefuseDataHello(const Incoming& in, int rank) const {
    if (!initialized_) return StrFormat("a data connection claiming rank %d before the address table went round", rank);
    if (rank == rank_) return StrFormat("a data connection claiming to be this rank (%d)", rank);
    const net::WireAddress& entry = peerAddrs_[static_cast<size_t>(rank)];
    if (!SameIp(in.from, entry)) {
      return StrFormat("a data connection claiming rank %d comes from %s, but rank %d is at %s", rank,
                       in.from.HostString().c_str(), rank, net::SocketAddress::FromWire(entry).ToString().c_str());
    }
    if (dataConnected_[static_cast<size_t>(rank)]) {
      return StrFormat("a second data connection claiming rank %d (its first stays; a rank opens one per peer)", rank);
    }
    return "";
  }

  void FrameComplete(Incoming& in) {
    if (in.header.type == static_cast<uint16_t>(FrameType::Hello)) {
      HelloPayload hello;
      std::memcpy(&hello, in.payload.data(), sizeof(hello));
      std::string bad = bootstrap_wire::CheckHello(hello, nonce_, nRanks_);
      if (!bad.empty()) {
        if (hello.nonce == nonce_ && rank_ == 0 && !initialized_ &&
            hello.purpose == static_cast<uint32_t>(HelloPurpose::Register)) {
          // Same job, wrong setup: fatal for the job. Keep the connection so that this rank hears why.
          registrationError_ = bad;
          in.registration = true;
          in.counted = true;
          in.headerGot = 0;
          return;
        }
        if (hello.nonce != nonce_ && hello.purpose == static_cast<uint32_t>(HelloPurpose::Register)) {
          RefuseRegistration(in, hello, bad);
          return;
        }
        DropConnection(in, "refused: " + bad);
        return;
      }
      if (hello.purpose == static_cast<uint32_t>(HelloPurpose::Register)) {
        if (rank_ != 0 || initialized_) {
          DropConnection(in, "registration sent to a rank that is not a registering root");
          return;
        }
        in.registration = true;
        peerAddrs_[static_cast<size_t>(hello.rank)] = hello.listen;
      } else {
        std::string refused = RefuseDataHello(in, hello.rank);
        if (!refused.empty()) {
          DropConnection(in, "refused: " + refused);
          return;
        }
        dataConnected_[static_cast<size_t>(hello.rank)] = true;
      }
      in.srcRank = hello.rank;
      in.headerGot = 0;
      return;
    }
    if (pendingBytes_ + in.payload.size() > maxPending_) {
      DropConnection(in, StrFormat("sent %zu more bytes while %zu sent to this rank were not received yet (at most "
                                   "%zu wait: MORI_BOOTSTRAP_MAX_PENDING)",
                                   in.payload.size(), pendingBytes_, maxPending_));
      return;
    }
    pendingBytes_ += in.payload.size();
    stash_[StashKey(in.srcRank, in.header.type, in.header.tag)].push_back(std::move(in.payload));
  }

  std::mutex mutex_;
  int rank_;
  int nRanks_;
  double timeout_ = 0;
  double joinTimeout_ = 0;  // registering with the root and waiting for the address table
  const char* joinBoundFrom_ = "";  // where joinTimeout_ came from, for the join's timeout errors
  bool initialized_ = false;
  uint64_t nonce_ = 0;
  int collSeq_ = 0;
  UniqueFd listener_;
  net::SocketAddress listenAddr_;
  std::vector<net::WireAddress> peerAddrs_;
  std::vector<UniqueFd> outgoing_;
  std::list<Incoming> incoming_;
  std::map<StashKey, std::deque<std::vector<uint8_t>>> stash_;
  size_t pendingBytes_ = 0;  // in the stash from other ranks
  size_t maxPending_ = static_cast<size_t>(EnvGetSize("MORI_BOOTSTRAP_MAX_PENDING"));
  std::vector<bool> dataConnected_;  // a data connection of the rank was taken (live or closed since)
  std::map<int, std::string> deadPeers_;
  std::string registrationError_;
  // Registrations refused for their nonce while the root waited: named when the wait fails.
  static constexpr int kRefusalsNamed = 4;
  int refusedCount_ = 0;
  std::string refusedRegistrations_;
};

SocketBootstrap::SocketBootstrap(int rank, int nRanks) : impl_(std::make_unique<Impl>(rank, nRanks)) {}

SocketBootstrap::~SocketBootstrap() = default;

UniqueId SocketBootstrap::CreateUniqueId() {
  net::SocketAddress addr = net::PickLocalAddress();
  addr.SetPort(0);
  UniqueFd listener = net::Listen(addr);
  uint64_t nonce = RandomNonce();
  {
    std::lock_guard<std::mutex> lock(PendingMutex());
    auto& pending = PendingListeners();
    auto& order = PendingOrder();
    while (pending.size() >= kMaxUnusedUniqueIds && !order.empty()) {
      auto oldest = pending.find(order.front());
      order.pop_front();
      if (oldest == pending.end()) continue;
      MORI_LOG_WARN(Bootstrap, "%zu unique ids of this process were never used by an Initialize: the oldest one's "
                               "listener is closed (ReleaseUniqueId closes ids that will not be used)",
                    pending.size());
      pending.erase(oldest);
    }
    while (!order.empty() && pending.count(order.front()) == 0) order.pop_front();  // adopted or released
    pending[nonce] = std::move(listener);
    order.push_back(nonce);
  }
  MORI_LOG_DEBUG(Bootstrap, "unique id created: root listens at %s", addr.ToString().c_str());
  return EncodeId(nonce, addr);
}

void SocketBootstrap::ReleaseUniqueId(const UniqueId& id) {
  const uint64_t nonce = DecodeId(id).nonce;
  std::lock_guard<std::mutex> lock(PendingMutex());
  PendingListeners().erase(nonce);
}

UniqueId SocketBootstrap::UniqueIdFromAddress(const std::string& rootAddress) {
  net::Endpoint ep = net::ParseEndpoint(rootAddress);
  MORI_CHECK(!ep.address.IsAny() && ep.address.Port() != 0, ErrorCode::InvalidUsage,
             "bootstrap root address '%s' needs a concrete address and a non-zero port", rootAddress.c_str());
  // Every rank derives the id from the same string, so the nonce is derived from it too.
  return EncodeId(bootstrap_wire::AddressNonce(ep.address.ToString(), EnvGetString("MORI_BOOTSTRAP_SECRET")),
                  ep.address);
}

std::string SocketBootstrap::UniqueIdAddress(const UniqueId& id) {
  return net::SocketAddress::FromWire(DecodeId(id).root).ToString();
}

void SocketBootstrap::Initialize(const UniqueId& id, double timeoutSeconds) {
  impl_->Initialize(id, "", timeoutSeconds, false);
}

void SocketBootstrap::Initialize(const std::string& rootAddress, double timeoutSeconds) {
  net::Endpoint ep = net::ParseEndpoint(rootAddress);
  impl_->Initialize(UniqueIdFromAddress(rootAddress), ep.ifname, timeoutSeconds, !EnvIsSet("MORI_BOOTSTRAP_SECRET"));
}

int SocketBootstrap::GetRank() const { return impl_->Rank(); }
int SocketBootstrap::GetNranks() const { return impl_->Nranks(); }
double SocketBootstrap::TimeoutSeconds() const { return impl_->Timeout(); }
void SocketBootstrap::Send(const void* data, size_t bytes, int peer, int tag) { impl_->Send(data, bytes, peer, tag); }
void SocketBootstrap::Recv(void* data, size_t bytes, int peer, int tag) { impl_->Recv(data, bytes, peer, tag); }
void SocketBootstrap::AllGather(void* allData, size_t bytesPerRank) { impl_->AllGather(allData, bytesPerRank); }
void SocketBootstrap::Barrier() { impl_->Barrier(); }
void SocketBootstrap::Broadcast(void* data, size_t bytes, int root) { impl_->Broadcast(data, bytes, root); }

void Bootstrap::SendBytes(const std::vector<uint8_t>& data, int peer, int tag) {
  uint64_t n = data.size();
  MORI_CHECK(n <= kMaxBytesMessage, ErrorCode::InvalidUsage,
             "rank %d: SendBytes of %llu bytes to rank %d (tag %d): at most %llu bytes go in one message", GetRank(),
             static_cast<unsigned long long>(n), peer, tag, static_cast<unsigned long long>(kMaxBytesMessage));
  Send(&n, sizeof(n), peer, tag);
  Send(data.data(), data.size(), peer, tag);
}

std::vector<uint8_t> Bootstrap::RecvBytes(int peer, int tag) {
  uint64_t n = 0;
  Recv(&n, sizeof(n), peer, tag);
  MORI_CHECK(n <= kMaxBytesMessage, ErrorCode::Protocol,
             "rank %d: rank %d announced a %llu-byte message (tag %d); at most %llu bytes come in one: refused before "
             "allocating it",
             GetRank(), peer, static_cast<unsigned long long>(n), tag,
             static_cast<unsigned long long>(kMaxBytesMessage));
  std::vector<uint8_t> data(n);
  Recv(data.data(), data.size(), peer, tag);
  return data;
}

}  // namespace mori::core
