// Whole bootstrap streams from other processes, read by a real SocketBootstrap rank over loopback TCP. The fuzzer
// plays the root (and, in the data phase, every other rank): a rank of a world of 2 to 5 runs Initialize in a
// thread of this process against the fuzzer's listener, whose reply is either the fuzzer's bytes as they are (a
// table, an abort, garbage) or a good table followed by data connections, each opened with a good hello, that
// carry the fuzzer's frames while the rank runs a script of Recv, RecvBytes, AllGather, Broadcast and Barrier.
// Properties beside "no crash": the rank ends with mori's Error (printable, bounded text) or succeeds, nothing
// else; an accepted table is one the root could have sent (world-size entries, each a concrete address with a
// port, this rank's own entry what it registered); whatever an operation delivers is exactly the payload of the
// frame that carried it, in the order sent, and a Recv whose frame came whole is never refused; no descriptor and
// no thread outlives an input. Input layout: bootstrap_stream in fuzz_util.hpp.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bootstrap_wire.hpp"
#include "fuzz_os.hpp"
#include "fuzz_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "socket.hpp"

namespace {

namespace bw = mori::core::bootstrap_wire;
namespace bs = mori::fuzz::bootstrap_stream;
namespace net = mori::core::net;
using mori::core::Deadline;
using mori::core::Error;
using mori::core::ErrorCode;
using mori::core::UniqueFd;
using mori::fuzz::CloseHard;
using mori::fuzz::CountEntries;
using mori::fuzz::SettlesAt;
using Bytes = std::vector<uint8_t>;

constexpr double kTimeoutS = 2;         // the rank's bound on every wait (also MORI_TIMEOUT_S)
constexpr size_t kMaxErrorText = 8192;  // a report longer than this is not bounded
constexpr int kSocketTimeoutMs = 2000;  // the fuzzer's own sends and receives

struct Setup {
  net::SocketAddress address = net::SocketAddress::Parse("127.0.0.1:0");
  UniqueFd listener;
  mori::core::UniqueId id{};
  uint64_t nonce = 0;

  Setup() {
    listener = net::Listen(address);
    net::SetNonBlocking(listener.Get(), true);
    id = mori::core::SocketBootstrap::UniqueIdFromAddress(address.ToString());
    nonce = bw::AddressNonce(address.ToString(), "");
  }
};

Setup& TheSetup() {
  static Setup* s = new Setup();
  return *s;
}

void SetSocketTimeouts(int fd) {
  timeval tv{kSocketTimeoutMs / 1000, (kSocketTimeoutMs % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

// Best effort: the rank may have dropped the connection already, which is one of the outcomes under test.
void SendBestEffort(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// 0 or the errno of the connection attempt; a signal (libFuzzer's timers) does not end the attempt.
int Connect(int fd, const net::SocketAddress& to) {
  if (connect(fd, to.Sockaddr(), to.Length()) == 0) return 0;
  if (errno != EINTR && errno != EINPROGRESS) return errno;
  pollfd p{fd, POLLOUT, 0};
  while (poll(&p, 1, kSocketTimeoutMs) < 0 && errno == EINTR) {
  }
  int err = ETIMEDOUT;
  socklen_t len = sizeof(err);
  if (p.revents != 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  return err;
}

// What the rank did, filled by its thread.
struct OpResult {
  bool ok = false;
  Bytes delivered;  // the caller's buffer afterwards
  Bytes before;     // the caller's buffer before (AllGather, Broadcast)
};
struct Outcome {
  bool initialized = false;
  std::vector<OpResult> ops;  // one per op run; the last one failed if `failed` is set after Initialize
  bool failed = false;
  ErrorCode code = ErrorCode::Internal;
  std::string error;
  std::string foreign;  // an exception that is not mori's Error
  // Progress the fuzzer waits on before it ends the peers' connections.
  std::mutex mutex;
  std::condition_variable changed;
  int opsDone = 0;
  bool finished = false;

  void Progressed(bool end) {
    std::lock_guard<std::mutex> lock(mutex);
    if (end) {
      finished = true;
    } else {
      ++opsDone;
    }
    changed.notify_all();
  }
};

struct Op {
  bs::OpKind kind;
  int peer;
  size_t bytes;
  int tag;
};

Bytes Pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed * 31 + i * 7 + 1);
  return b;
}

void RunRank(int rank, int nRanks, const std::vector<Op>& ops, Outcome& out) {
  try {
    mori::core::SocketBootstrap b(rank, nRanks);
    b.Initialize(TheSetup().id, kTimeoutS);
    out.initialized = true;
    for (const Op& op : ops) {
      out.ops.emplace_back();
      OpResult& r = out.ops.back();
      switch (op.kind) {
        case bs::OpKind::Recv:
          r.delivered = Pattern(op.bytes, 1);  // exactly the size asked for: ASan sees a byte more
          b.Recv(r.delivered.data(), r.delivered.size(), op.peer, op.tag);
          break;
        case bs::OpKind::RecvBytes:
          r.delivered = b.RecvBytes(op.peer, op.tag);
          break;
        case bs::OpKind::AllGather:
          r.before = Pattern(op.bytes * static_cast<size_t>(nRanks), 2);
          r.delivered = r.before;
          b.AllGather(r.delivered.data(), op.bytes);
          break;
        case bs::OpKind::Broadcast:
          r.before = Pattern(op.bytes, 3);
          r.delivered = r.before;
          b.Broadcast(r.delivered.data(), r.delivered.size(), op.peer);
          break;
        case bs::OpKind::Barrier:
        case bs::OpKind::kCount:
          b.Barrier();
          break;
      }
      r.ok = true;
      out.Progressed(false);
    }
  } catch (const Error& e) {
    out.failed = true;
    out.code = e.Code();
    out.error = e.what();
  } catch (const std::exception& e) {
    out.foreign = e.what();
  } catch (...) {
    out.foreign = "an exception of no standard type";
  }
  out.Progressed(true);
}

// The frames each peer's connection carried, as the protocol defines them (written here from the wire format,
// not with the receiver's code): a frame that is malformed, claims another sender or is not Data or Collective
// ends the connection (and the receiver takes the peer for dead), a frame cut short ends what arrives.
class Model {
 public:
  void Feed(int peer, const Bytes& stream) {
    size_t at = 0;
    while (stream.size() - at >= sizeof(bw::FrameHeader)) {
      bw::FrameHeader h;
      std::memcpy(&h, stream.data() + at, sizeof(h));
      at += sizeof(h);
      const bool known = h.type == static_cast<uint16_t>(bw::FrameType::Data) ||
                         h.type == static_cast<uint16_t>(bw::FrameType::Collective);
      if (h.magic != bw::kFrameMagic || h.version != bw::kVersion || !known || h.srcRank != peer ||
          h.length > bw::kMaxPayload) {
        dropped_.push_back(peer);
        return;
      }
      if (h.length > stream.size() - at) {
        cutInPayload_.push_back(peer);
        return;
      }
      queues_[{peer, h.type, h.tag}].emplace_back(stream.begin() + static_cast<long>(at),
                                                  stream.begin() + static_cast<long>(at + h.length));
      at += h.length;
    }
  }
  // The next frame of the key, taken; false when the stream holds no more.
  bool Take(int peer, bw::FrameType type, int tag, Bytes& frame) {
    auto& q = queues_[{peer, static_cast<uint16_t>(type), tag}];
    if (q.empty()) return false;
    frame = std::move(q.front());
    q.pop_front();
    return true;
  }
  bool TakeSized(int peer, bw::FrameType type, int tag, size_t bytes) {
    Bytes frame;
    return Take(peer, type, tag, frame) && frame.size() == bytes;
  }
  // The receiver drops this peer's connection once it reads that far, whenever that is: a send to the peer may
  // or may not fail.
  bool Dropped(int peer) const { return std::find(dropped_.begin(), dropped_.end(), peer) != dropped_.end(); }
  // The stream ends inside a frame's payload: the receiver waits for the rest.
  bool CutInPayload(int peer) const {
    return std::find(cutInPayload_.begin(), cutInPayload_.end(), peer) != cutInPayload_.end();
  }

 private:
  std::map<std::tuple<int, uint16_t, int>, std::deque<Bytes>> queues_;
  std::vector<int> dropped_;
  std::vector<int> cutInPayload_;
};

// Ends a peer's stream so that the rank takes the peer for gone at once: 24 bytes of 0xff, which make or complete a
// header the rank drops the connection for (magic, or a length beyond kMaxPayload), then the rank closes first;
// a FIN where the stream ends inside a payload (the 0xff bytes would be payload) or the input asks for one.
void EndStream(int fd, bool fin) {
  if (!fin) {
    const Bytes poison(sizeof(bw::FrameHeader), 0xff);
    SendBestEffort(fd, poison.data(), poison.size());
  } else {
    shutdown(fd, SHUT_WR);
  }
}

// How many ops of the script the streams let complete whatever the timing: each receive has its frame, of the
// size asked, and no send goes to a peer whose connection the receiver drops.
size_t CompletableOps(Model model, const std::vector<Op>& ops, int rank, int nRanks) {
  int seq = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    bool ok = true;
    switch (op.kind) {
      case bs::OpKind::Recv:
        ok = model.TakeSized(op.peer, bw::FrameType::Data, op.tag, op.bytes);
        break;
      case bs::OpKind::RecvBytes: {
        Bytes frame;
        uint64_t n = 0;
        ok = model.Take(op.peer, bw::FrameType::Data, op.tag, frame) && frame.size() == sizeof(n);
        if (ok) std::memcpy(&n, frame.data(), sizeof(n));
        ok = ok && n <= mori::core::Bootstrap::kMaxBytesMessage &&
             model.TakeSized(op.peer, bw::FrameType::Data, op.tag, n);
        break;
      }
      case bs::OpKind::AllGather:
        for (int step = 0; ok && step < nRanks - 1; ++step) {
          ok = !model.Dropped((rank + 1) % nRanks) &&
               model.TakeSized((rank + nRanks - 1) % nRanks, bw::FrameType::Collective, seq, op.bytes);
        }
        ++seq;
        break;
      case bs::OpKind::Broadcast: {
        const int vrank = (rank - op.peer + nRanks) % nRanks;
        int mask = 1;
        for (; mask < nRanks; mask <<= 1) {
          if (vrank & mask) {
            ok = model.TakeSized((vrank - mask + op.peer) % nRanks, bw::FrameType::Collective, seq, op.bytes);
            break;
          }
        }
        for (mask >>= 1; ok && mask > 0; mask >>= 1) {
          if (vrank + mask < nRanks) ok = !model.Dropped((vrank + mask + op.peer) % nRanks);
        }
        ++seq;
        break;
      }
      case bs::OpKind::Barrier:
      case bs::OpKind::kCount:
        for (int dist = 1; ok && dist < nRanks; dist <<= 1) {
          ok = !model.Dropped((rank + dist) % nRanks) &&
               model.TakeSized((rank - dist + nRanks) % nRanks, bw::FrameType::Collective, seq, 1);
        }
        ++seq;
        break;
    }
    if (!ok) return i;
  }
  return ops.size();
}

bool Printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

std::string Shown(const std::string& s) { return s.substr(0, 300); }

// An accepted table must be one the root could have sent (checked from the bytes the fuzzer sent).
void CheckAcceptedTable(const Bytes& reply, int rank, int nRanks, const net::WireAddress& registered) {
  MORI_FUZZ_ASSERT(reply.size() >= sizeof(bw::FrameHeader), "a table accepted from %zu bytes", reply.size());
  bw::FrameHeader h;
  std::memcpy(&h, reply.data(), sizeof(h));
  const uint64_t want = static_cast<uint64_t>(nRanks) * sizeof(net::WireAddress);
  MORI_FUZZ_ASSERT(
      h.magic == bw::kFrameMagic && h.version == bw::kVersion && h.type == static_cast<uint16_t>(bw::FrameType::Table),
      "accepted a reply of type %u", static_cast<unsigned>(h.type));
  MORI_FUZZ_ASSERT(h.length == want && reply.size() - sizeof(h) >= want, "accepted a table of %llu bytes (%zu sent)",
                   static_cast<unsigned long long>(h.length), reply.size() - sizeof(h));
  for (int r = 0; r < nRanks; ++r) {
    net::WireAddress w;
    std::memcpy(&w, reply.data() + sizeof(h) + static_cast<size_t>(r) * sizeof(w), sizeof(w));
    MORI_FUZZ_ASSERT(w.family == AF_INET || w.family == AF_INET6, "entry %d: family %u", r, w.family);
    MORI_FUZZ_ASSERT(w.port != 0, "entry %d: port 0", r);
    const size_t addrBytes = w.family == AF_INET ? 4 : 16;
    const bool unspecified = std::all_of(w.addr, w.addr + addrBytes, [](uint8_t b) { return b == 0; });
    MORI_FUZZ_ASSERT(!unspecified, "entry %d: the unspecified address", r);
    if (w.family == AF_INET) {
      const bool clean = std::all_of(w.addr + 4, w.addr + 16, [](uint8_t b) { return b == 0; }) && w.scopeId == 0;
      MORI_FUZZ_ASSERT(clean, "entry %d: an IPv4 address with bytes beyond its 4", r);
    }
    if (r == rank) {
      MORI_FUZZ_ASSERT(std::memcmp(&w, &registered, sizeof(w)) == 0, "this rank's entry is not what it registered");
    }
  }
}

// Whether a completed op delivered what the model says the frames carried; takes those frames.
void CheckDelivered(Model& model, const Op& op, const OpResult& r, int rank, int nRanks, int seq) {
  Bytes frame;
  switch (op.kind) {
    case bs::OpKind::Recv:
      MORI_FUZZ_ASSERT(model.Take(op.peer, bw::FrameType::Data, op.tag, frame),
                       "Recv from rank %d tag %d returned with no frame sent", op.peer, op.tag);
      MORI_FUZZ_ASSERT(frame == r.delivered, "Recv delivered %zu bytes other than the frame's %zu", r.delivered.size(),
                       frame.size());
      break;
    case bs::OpKind::RecvBytes: {
      MORI_FUZZ_ASSERT(model.Take(op.peer, bw::FrameType::Data, op.tag, frame) && frame.size() == sizeof(uint64_t),
                       "RecvBytes returned without a length frame");
      uint64_t n;
      std::memcpy(&n, frame.data(), sizeof(n));
      MORI_FUZZ_ASSERT(n <= mori::core::Bootstrap::kMaxBytesMessage, "RecvBytes accepted a length of %llu",
                       static_cast<unsigned long long>(n));
      MORI_FUZZ_ASSERT(model.Take(op.peer, bw::FrameType::Data, op.tag, frame) && frame == r.delivered,
                       "RecvBytes delivered %zu bytes no frame carried", r.delivered.size());
      break;
    }
    case bs::OpKind::AllGather: {
      const int prev = (rank + nRanks - 1) % nRanks;
      Bytes expect = r.before;
      for (int step = 0; step < nRanks - 1; ++step) {
        MORI_FUZZ_ASSERT(model.Take(prev, bw::FrameType::Collective, seq, frame) && frame.size() == op.bytes,
                         "AllGather step %d returned without rank %d's frame of %zu bytes", step, prev, op.bytes);
        const int slot = (rank - step - 1 + 2 * nRanks) % nRanks;
        std::copy(frame.begin(), frame.end(), expect.begin() + static_cast<long>(slot * op.bytes));
      }
      MORI_FUZZ_ASSERT(expect == r.delivered, "AllGather's slots are not the frames (or this rank's slot changed)");
      break;
    }
    case bs::OpKind::Broadcast: {
      const int vrank = (rank - op.peer + nRanks) % nRanks;
      Bytes expect = r.before;
      for (int mask = 1; mask < nRanks; mask <<= 1) {
        if (vrank & mask) {
          const int parent = (vrank - mask + op.peer) % nRanks;
          MORI_FUZZ_ASSERT(model.Take(parent, bw::FrameType::Collective, seq, frame) && frame.size() == op.bytes,
                           "Broadcast returned without rank %d's frame", parent);
          expect = frame;
          break;
        }
      }
      MORI_FUZZ_ASSERT(expect == r.delivered, "Broadcast delivered bytes other than the frame's");
      break;
    }
    case bs::OpKind::Barrier:
    case bs::OpKind::kCount:
      for (int dist = 1; dist < nRanks; dist <<= 1) {
        const int from = (rank - dist + nRanks) % nRanks;
        MORI_FUZZ_ASSERT(model.Take(from, bw::FrameType::Collective, seq, frame) && frame.size() == 1,
                         "Barrier passed without rank %d's token", from);
      }
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MORI_LOG_LEVEL", "error", 1);  // every dropped connection would log a warning
  setenv("MORI_TIMEOUT_S", "2", 1);
  unsetenv("MORI_BOOTSTRAP_SECRET");  // the nonce is the address's, as computed in Setup
  TheSetup();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Setup& s = TheSetup();
  const size_t fdsBefore = CountEntries("/proc/self/fd");
  const size_t threadsBefore = CountEntries("/proc/self/task");

  mori::fuzz::FuzzInput in(data, size);
  const auto options = in.Take<uint8_t>();
  const int nRanks = 2 + (options & bs::kWorldMask);
  const int rank = 1 + ((options >> bs::kRankShift) & 7) % (nRanks - 1);
  const bool dataPhase = (options & bs::kDataPhase) != 0;
  std::vector<int> others;
  for (int r = 0; r < nRanks; ++r) {
    if (r != rank) others.push_back(r);
  }

  std::vector<Op> ops;
  std::vector<Bytes> streams(static_cast<size_t>(nRanks));  // what each peer's data connection carries
  std::vector<std::pair<int, Bytes>> records;
  Bytes reply;
  if (dataPhase) {
    const int nOps = in.Take<uint8_t>() % (bs::kMaxOps + 1);
    for (int i = 0; i < nOps; ++i) {
      auto spec = in.Take<bs::OpSpec>();
      Op op{static_cast<bs::OpKind>(spec.kind % static_cast<uint8_t>(bs::OpKind::kCount)), 0, 0, spec.tag & 0xf};
      op.peer = others[spec.peer % others.size()];
      op.bytes = spec.bytes & 0xfff;
      if (op.kind == bs::OpKind::AllGather) op.bytes = spec.bytes & 0xff;
      if (op.kind == bs::OpKind::Broadcast) op.peer = spec.peer % nRanks;
      ops.push_back(op);
    }
    while (in.Left() > 0) {
      auto rh = in.Take<bs::RecordHeader>();
      const size_t n = std::min<size_t>(rh.length[0] | (rh.length[1] << 8), in.Left());
      const int peer = others[rh.peer % others.size()];
      records.emplace_back(peer, Bytes(in.Rest(), in.Rest() + n));
      in.Skip(n);
      auto& stream = streams[static_cast<size_t>(peer)];
      stream.insert(stream.end(), records.back().second.begin(), records.back().second.end());
    }
  } else {
    reply.assign(in.Rest(), in.Rest() + in.Left());
  }

  Model model;
  for (int peer : others) model.Feed(peer, streams[static_cast<size_t>(peer)]);

  Outcome out;
  std::thread rankThread(RunRank, rank, nRanks, std::cref(ops), std::ref(out));

  // The rank registers: take its hello as the root does.
  const Deadline deadline = Deadline::After(5);
  UniqueFd reg = net::AcceptOne(s.listener.Get(), deadline);
  MORI_FUZZ_ASSERT(reg, "the rank never connected to the root");
  SetSocketTimeouts(reg.Get());
  bw::FrameHeader h;
  bw::HelloPayload hello;
  net::RecvAll(reg.Get(), &h, sizeof(h), deadline, "the rank");
  net::RecvAll(reg.Get(), &hello, sizeof(hello), deadline, "the rank");
  MORI_FUZZ_ASSERT(bw::CheckHeader(h).empty() && h.type == static_cast<uint16_t>(bw::FrameType::Hello) &&
                       bw::CheckHello(hello, s.nonce, nRanks).empty() && hello.rank == rank,
                   "the rank's registration is not a good hello");

  std::vector<UniqueFd> conns;
  if (!dataPhase) {
    const size_t own = sizeof(bw::FrameHeader) + static_cast<size_t>(rank) * sizeof(net::WireAddress);
    if ((options & bs::kPatchOwnEntry) && reply.size() >= own + sizeof(net::WireAddress)) {
      std::memcpy(reply.data() + own, &hello.listen, sizeof(hello.listen));
    }
    SendBestEffort(reg.Get(), reply.data(), reply.size());
    CloseHard(reg);
  } else {
    // A table the root would send: this rank's own address, every other rank at the fuzzer's listener.
    std::vector<net::WireAddress> table(static_cast<size_t>(nRanks), s.address.ToWire());
    table[static_cast<size_t>(rank)] = hello.listen;
    bw::FrameHeader th = bw::MakeHeader(bw::FrameType::Table, 0, 0, table.size() * sizeof(net::WireAddress));
    SendBestEffort(reg.Get(), &th, sizeof(th));
    SendBestEffort(reg.Get(), table.data(), th.length);
    CloseHard(reg);
    // One data connection per other rank, each with that rank's good hello, so that every wait ends: on the
    // frame, or on the connection's end once the fuzzer closes it.
    const net::SocketAddress rankAddr = net::SocketAddress::FromWire(hello.listen);
    conns.resize(static_cast<size_t>(nRanks));
    for (int peer : others) {
      UniqueFd& c = conns[static_cast<size_t>(peer)];
      c.Reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      MORI_FUZZ_ASSERT(c, "socket: %s", std::strerror(errno));
      const int err = Connect(c.Get(), rankAddr);
      if (err != 0) {
        // Refused (or reset, when the listener closed with it queued) only once the rank has closed its listener:
        // its script is over (empty, or an op failed), so nothing it still waits for comes on this connection.
        MORI_FUZZ_ASSERT(err == ECONNREFUSED || err == ECONNRESET, "connect to the rank's listener: %s",
                         std::strerror(err));
        c.Reset();
        continue;
      }
      SetSocketTimeouts(c.Get());
      bw::HelloPayload dh{};
      dh.nonce = s.nonce;
      dh.rank = peer;
      dh.nRanks = nRanks;
      dh.purpose = static_cast<uint32_t>(bw::HelloPurpose::Data);
      dh.listen = s.address.ToWire();
      bw::FrameHeader hh = bw::MakeHeader(bw::FrameType::Hello, peer, 0, sizeof(dh));
      SendBestEffort(c.Get(), &hh, sizeof(hh));
      SendBestEffort(c.Get(), &dh, sizeof(dh));
    }
    for (const auto& [peer, bytes] : records) {
      const UniqueFd& c = conns[static_cast<size_t>(peer)];
      if (c) SendBestEffort(c.Get(), bytes.data(), bytes.size());
    }
    // The peers' connections stay open while the rank runs the ops that the streams let complete (ending one
    // would make a send to that peer fail), then end, so that a wait for a frame that never comes ends at once.
    // The descriptors stay open until the rank is done: it closes first.
    const size_t completable = CompletableOps(model, ops, rank, nRanks);
    {
      std::unique_lock<std::mutex> lock(out.mutex);
      out.changed.wait_for(lock, std::chrono::duration<double>(kTimeoutS + 1),
                           [&] { return out.finished || static_cast<size_t>(out.opsDone) >= completable; });
    }
    for (int peer : others) {
      const UniqueFd& c = conns[static_cast<size_t>(peer)];
      if (c) EndStream(c.Get(), (options & bs::kEndWithFin) || model.CutInPayload(peer));
    }
  }
  rankThread.join();

  MORI_FUZZ_ASSERT(out.foreign.empty(), "an exception other than mori's Error: %s", Shown(out.foreign).c_str());
  if (out.failed) {
    MORI_FUZZ_ASSERT(!out.error.empty() && out.error.size() <= kMaxErrorText, "an error report of %zu bytes",
                     out.error.size());
    MORI_FUZZ_ASSERT(Printable(out.error), "an error report with unprintable bytes: %s", Shown(out.error).c_str());
  }
  if (!dataPhase) {
    if (out.initialized) CheckAcceptedTable(reply, rank, nRanks, hello.listen);
  } else {
    MORI_FUZZ_ASSERT(out.initialized, "a good table was refused: %s", Shown(out.error).c_str());
    const size_t completable = CompletableOps(model, ops, rank, nRanks);
    for (size_t i = 0; i < completable; ++i) {
      MORI_FUZZ_ASSERT(i < out.ops.size() && out.ops[i].ok, "op %zu of %zu failed though its frames all came: %s", i,
                       completable, Shown(out.error).c_str());
    }
    int seq = 0;
    for (size_t i = 0; i < out.ops.size(); ++i) {
      const Op& op = ops[i];
      const OpResult& r = out.ops[i];
      if (r.ok) {
        CheckDelivered(model, op, r, rank, nRanks, seq);
      } else if (op.kind == bs::OpKind::Recv) {
        // A Recv fails only for a frame of another size (taken), or when the peer's stream holds no such frame.
        Bytes frame;
        const bool had = model.Take(op.peer, bw::FrameType::Data, op.tag, frame);
        MORI_FUZZ_ASSERT(!had || frame.size() != op.bytes, "Recv refused a whole frame of the size asked: %s",
                         Shown(out.error).c_str());
      }
      if (op.kind == bs::OpKind::AllGather || op.kind == bs::OpKind::Broadcast || op.kind == bs::OpKind::Barrier) {
        ++seq;
      }
    }
  }

  // The rank's own connections to "other ranks" land on the fuzzer's listener: take them, so none is left over.
  while (true) {
    UniqueFd extra(accept4(s.listener.Get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!extra) break;
    CloseHard(extra);
  }
  for (UniqueFd& c : conns) CloseHard(c);
  MORI_FUZZ_ASSERT(SettlesAt("/proc/self/fd", fdsBefore), "%zu descriptors open before the input, %zu after",
                   fdsBefore, CountEntries("/proc/self/fd"));
  MORI_FUZZ_ASSERT(SettlesAt("/proc/self/task", threadsBefore), "%zu threads before the input, %zu after",
                   threadsBefore, CountEntries("/proc/self/task"));
  return 0;
}
