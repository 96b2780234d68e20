// The TCP transport's setup and receiver, whole (issue 16): a real TcpLink accepts its channels from this harness
// (rank 0; the harness plays rank 1 with a correct hello per channel) or, with option kConnect, connects to
// listeners the harness plays (rank 1 to the harness's rank 0: the harness reads each real hello and answers with
// the input's reply or an acceptor's HelloAck). The harness then sends the fuzzer's frames on the channels and
// closes (a last frame cut short is a connection closed mid-frame). The link's receiver threads validate and apply
// them (writes into registered memory, word operations, reads answered, acknowledgements, a peer's Fail and Close)
// and its sender threads answer; the harness reads every answer back.
// Properties, beside "no crash": no byte of registered memory outside a range that a frame of the stream names
// changes (every buffer is exactly its registration's size, so ASan sees a stray byte, and the bytes are
// compared with their pattern), and a frame that the stream alone shows to be refused (header, sequence number,
// Write-chunk count, key, range, alignment) names none, nor does what follows it on its channel; memory not
// granted to the peer never changes; the link ends failed with mori's
// Error (never another exception, which the receiver reports as Internal) within a bound, and no registration,
// descriptor or thread is left behind; every answer is a well-formed frame, an Ack never names a frame that was
// not sent nor goes back, ReadData and AtomicResult answer only requests that were made, and a read of memory that
// no frame writes returns its pattern; a stranger's hello is refused unless it is exactly a valid one. A connecting
// link sends on each channel a hello that an acceptor takes, comes up exactly when every reply is one an acceptor
// sends (a HelloAck of this wire without payload, naming the channel and the link's nonce), and otherwise fails
// its setup within kSetupEndS of the reply with mori's Error naming the channel and the offending value (Protocol)
// or the connection's end (RemoteFailure, a reply cut short), never another exception, a hang or the deadline.
// Input: one byte of options, then (option kFuzzHello) the 96 bytes of a stranger's hello or, with kConnect, a
// 64-byte reply per channel (the input ending in one: it is cut short there), then frames, each a
// byte naming the channel (modulo the channel count), a 64-byte FrameHeader and as many payload bytes as its
// length says (or what is left). A key below kRegions names the harness's registration of that index (real keys
// are random); any other key goes as it is.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fuzz_os.hpp"
#include "fuzz_util.hpp"
#include "mori/core/copy_stream.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/unique_fd.hpp"
#include "socket.hpp"
#include "tcp/tcp_link.hpp"
#include "tcp/tcp_registry.hpp"
#include "tcp/tcp_wire.hpp"

namespace {

namespace tcp = mori::core::tcp;
using mori::core::Deadline;
using mori::core::ErrorCode;
using mori::fuzz::CountEntries;
using mori::fuzz::SettlesAt;

// The lower rank accepts: as rank 0 the link under test waits for the harness's channels, as rank 1 (kConnect) it
// connects to the harness's listeners.
constexpr int kOtherRank = 2;         // a third rank, which the harness never plays
constexpr uint64_t kChunkBytes = 64;  // the smallest chunk: reads and bounces go in pieces
constexpr uint64_t kReadBytes = 96;   // the link's own read (option kIssue): two requests
constexpr double kHarnessWaitS = 6;   // above every bound of the link (MORI_TIMEOUT_S = 1)
// A connecting link's setup ends this soon after the acceptor's last reply (or its close): far below the setup's
// deadline (kHarnessWaitS), so that a link waiting for that deadline is caught.
constexpr double kSetupEndS = 3;

using mori::fuzz::tcp_stream::kChannelBits;
using mori::fuzz::tcp_stream::kConnect;
using mori::fuzz::tcp_stream::kDeviceRead;
using mori::fuzz::tcp_stream::kFuzzHello;
using mori::fuzz::tcp_stream::kIssue;
using mori::fuzz::tcp_stream::kPeerNonce;
using mori::fuzz::tcp_stream::kRealNonce;
using mori::fuzz::tcp_stream::kReset;

struct RegionSpec {
  size_t bytes;
  bool device;
  bool toPeer;  // granted to the peer the harness plays, else to kOtherRank only
};
// 0: host memory of the peer; 1: (emulated) device memory of the peer, written through the bounce buffers;
// 2: memory granted to another rank only, which the peer must never reach.
constexpr RegionSpec kRegionSpecs[] = {{4096, false, true}, {256, true, true}, {64, false, false}};
constexpr uint32_t kRegions = sizeof(kRegionSpecs) / sizeof(kRegionSpecs[0]);

uint8_t Pattern(uint32_t region, size_t i) { return static_cast<uint8_t>(0x5a ^ (region * 67 + i * 13 + (i >> 8))); }

struct Frame {
  int channel;
  tcp::FrameHeader header;
  const uint8_t* payload;
  size_t payloadBytes;  // what the input has of it (less than header.length: cut short)
};

struct Region {
  std::unique_ptr<uint8_t[]> bytes;
  uint32_t key = 0;
  std::vector<bool> named;  // bytes a frame of the stream names: they may change
};

// One side of a channel as the harness holds it: what it sends, what the link answers.
struct PeerChannel {
  int fd = -1;
  bool broken = false;  // the link closed or reset it: nothing more goes out
  bool eof = false;
  std::vector<uint8_t> in;
};

class Peer {
 public:
  explicit Peer(std::vector<PeerChannel>& channels) : channels_(channels) {}

  // Sends all of `bytes` on channel `c` (unless the link closes it), reading every channel meanwhile so that two
  // full directions never block each other.
  void Send(int c, const uint8_t* bytes, size_t n, const Deadline& deadline) {
    PeerChannel& ch = channels_[static_cast<size_t>(c)];
    size_t sent = 0;
    while (sent < n && !ch.broken) {
      ssize_t k = send(ch.fd, bytes + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        sent += static_cast<size_t>(k);
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        MORI_FUZZ_ASSERT(!deadline.Expired(), "the link neither read channel %d nor closed it in %.0f s", c,
                         deadline.TotalSeconds());
        Wait(c, 10);
      } else {
        ch.broken = true;
      }
    }
  }

  // Reads until every channel is at its end (the link closes each one once it failed).
  void ReadToEnd(const Deadline& deadline) {
    while (true) {
      Drain();
      bool all = true;
      for (const PeerChannel& ch : channels_) all = all && ch.eof;
      if (all) return;
      MORI_FUZZ_ASSERT(!deadline.Expired(), "the link did not close its channels within %.0f s of the peer's close",
                       deadline.TotalSeconds());
      Wait(-1, 50);
    }
  }

 private:
  void Wait(int writer, int ms) {
    std::vector<pollfd> p;
    for (size_t i = 0; i < channels_.size(); ++i) {
      short events = channels_[i].eof ? 0 : POLLIN;
      if (static_cast<int>(i) == writer) events |= POLLOUT;
      p.push_back(pollfd{channels_[i].fd, events, 0});
    }
    (void)poll(p.data(), p.size(), ms);
    Drain();
  }

  void Drain() {
    uint8_t buf[16384];
    for (PeerChannel& ch : channels_) {
      while (!ch.eof) {
        ssize_t k = recv(ch.fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (k > 0) {
          ch.in.insert(ch.in.end(), buf, buf + k);
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
          break;
        } else {
          ch.eof = true;  // closed or reset
        }
      }
    }
  }

  std::vector<PeerChannel>& channels_;
};

int Connect(const mori::core::net::SocketAddress& to) {
  int fd = socket(to.Family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  MORI_FUZZ_ASSERT(fd >= 0, "socket: %s", std::strerror(errno));
  // The listener's backlog takes it before the link accepts: no thread needed on this side.
  int err = connect(fd, to.Sockaddr(), to.Length()) == 0 ? 0 : errno;
  if (err == EINTR) {  // libFuzzer's timer signal: the connection goes on being made
    pollfd p{fd, POLLOUT, 0};
    while (poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
    socklen_t len = sizeof(err);
    (void)getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  MORI_FUZZ_ASSERT(err == 0, "connect to %s: %s", to.ToString().c_str(), std::strerror(err));
  return fd;
}

void SendHello(int fd, const tcp::FrameHeader& h, const tcp::HelloPayload& hello) {
  uint8_t buf[sizeof(h) + sizeof(hello)];
  std::memcpy(buf, &h, sizeof(h));
  std::memcpy(buf + sizeof(h), &hello, sizeof(hello));
  ssize_t n;
  while ((n = send(fd, buf, sizeof(buf), MSG_NOSIGNAL)) < 0 && errno == EINTR) {
  }
  MORI_FUZZ_ASSERT(n == static_cast<ssize_t>(sizeof(buf)), "hello: %s", std::strerror(errno));
}

// What a stranger connection got back: 1 a HelloAck for channel 0 (accepted), 0 the connection closed (refused).
int StrangerOutcome(int fd) {
  tcp::FrameHeader ack;
  size_t got = 0;
  const Deadline deadline = Deadline::After(kHarnessWaitS);
  while (got < sizeof(ack)) {
    pollfd p{fd, POLLIN, 0};
    (void)poll(&p, 1, 50);
    ssize_t k = recv(fd, reinterpret_cast<uint8_t*>(&ack) + got, sizeof(ack) - got, MSG_DONTWAIT);
    if (k > 0) {
      got += static_cast<size_t>(k);
    } else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      MORI_FUZZ_ASSERT(got == 0, "the listener sent %zu bytes to a stranger, then closed", got);
      return 0;
    }
    MORI_FUZZ_ASSERT(!deadline.Expired(), "a stranger's connection neither answered nor closed");
  }
  MORI_FUZZ_ASSERT(tcp::CheckFrame(ack).empty() && ack.type == static_cast<uint16_t>(tcp::FrameType::HelloAck) &&
                       ack.key == 0 && ack.arg0 == kPeerNonce,
                   "a stranger got a frame of type %u that is no HelloAck for channel 0", ack.type);
  return 1;
}

// fuzz_os.hpp's CloseHard for a descriptor the harness holds bare.
void CloseWithReset(int fd) {
  mori::core::UniqueFd owned(fd);
  mori::fuzz::CloseHard(owned);
}

void RecvExactly(int fd, void* data, size_t bytes, const Deadline& deadline, const char* what) {
  auto* p = static_cast<uint8_t*>(data);
  size_t got = 0;
  while (got < bytes) {
    pollfd pfd{fd, POLLIN, 0};
    (void)poll(&pfd, 1, 50);
    ssize_t k = recv(fd, p + got, bytes - got, MSG_DONTWAIT);
    if (k > 0) {
      got += static_cast<size_t>(k);
      continue;
    }
    MORI_FUZZ_ASSERT(k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR),
                     "%s ended after %zu of %zu bytes", what, got, bytes);
    MORI_FUZZ_ASSERT(!deadline.Expired(), "%s: %zu of %zu bytes in %.0f s", what, got, bytes, deadline.TotalSeconds());
  }
}

// The connection a connecting link makes to listener `listenFd`, or -1 when its setup ended without one.
int AcceptChannel(int listenFd, const std::atomic<bool>& setupDone, const Deadline& deadline, int channel) {
  while (true) {
    pollfd p{listenFd, POLLIN, 0};
    (void)poll(&p, 1, 5);
    if (p.revents & POLLIN) {
      int fd = accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) return fd;
      MORI_FUZZ_ASSERT(errno == EAGAIN || errno == EINTR || errno == ECONNABORTED, "accept: %s", std::strerror(errno));
    }
    if (setupDone) return -1;
    MORI_FUZZ_ASSERT(!deadline.Expired(), "the link neither connected channel %d nor ended its setup in %.0f s",
                     channel, deadline.TotalSeconds());
  }
}

// What an acceptor answers to the hello of channel `channel` (tcp_setup.cpp's Accept).
tcp::FrameHeader RealReply(int channel, uint64_t connectorNonce) {
  tcp::FrameHeader ack = tcp::MakeFrame(tcp::FrameType::HelloAck);
  ack.key = static_cast<uint32_t>(channel);
  ack.arg0 = connectorNonce;
  return ack;
}

// Why no acceptor would answer channel `channel`'s hello with `h`, as words that the connecting link's error must
// contain (the offending value); empty when one would. Only the fields the connector relies on are looked at: a
// frame of this wire (magic, version), a HelloAck without payload, for this channel of this connection.
std::string ReplyFault(const tcp::FrameHeader& h, int channel, uint64_t connectorNonce) {
  using mori::core::StrFormat;
  if (h.magic != tcp::kFrameMagic) return StrFormat("0x%08x", h.magic);
  if (h.version != tcp::kWireVersion) return StrFormat("version %u", static_cast<unsigned>(h.version));
  if (h.type < static_cast<uint16_t>(tcp::FrameType::Hello) || h.type > tcp::kLastFrameType) {
    return StrFormat("unknown frame type %u", static_cast<unsigned>(h.type));
  }
  if (h.type != static_cast<uint16_t>(tcp::FrameType::HelloAck)) return StrFormat(" %s ", tcp::FrameTypeName(h.type));
  if (h.length != 0) return StrFormat("carries %u payload bytes", h.length);
  if (h.key != static_cast<uint32_t>(channel)) return StrFormat("HelloAck for channel %u ", h.key);
  if (h.arg0 != connectorNonce) {
    return StrFormat("of connection %016llx", static_cast<unsigned long long>(h.arg0));
  }
  return "";
}

// The requests of the stream, by id, as the answers are checked against them.
struct ReadAsked {
  int region;  // -1: none of the harness's
  uint64_t offset;
  uint64_t bytes;
  int count;  // requests that carried the id
};

class Harness {
 public:
  void Run(const uint8_t* data, size_t size) {
    mori::fuzz::FuzzInput in(data, size);
    const uint8_t options = in.Take<uint8_t>();
    const int numChannels = 1 + (options & kChannelBits);
    const bool issue = (options & kIssue) != 0;
    const bool connect = (options & kConnect) != 0;
    linkRank_ = connect ? 1 : 0;
    peerRank_ = connect ? 0 : 1;
    std::vector<uint8_t> strangerHello;
    std::vector<std::vector<uint8_t>> replies;  // connect: the acceptor's reply per channel (short: cut there)
    if ((options & kFuzzHello) && !connect) {
      for (size_t i = 0; i < sizeof(tcp::FrameHeader) + sizeof(tcp::HelloPayload); ++i)
        strangerHello.push_back(in.Take<uint8_t>());
    }
    if ((options & kFuzzHello) && connect) {
      for (int c = 0; c < numChannels; ++c) {
        const size_t n = std::min(sizeof(tcp::FrameHeader), in.Left());
        replies.emplace_back(in.Rest(), in.Rest() + n);
        in.Skip(n);
      }
    }

    const size_t fdsBefore = CountEntries("/proc/self/fd");
    const size_t threadsBefore = CountEntries("/proc/self/task");
    std::vector<Region> regions(kRegions);
    for (uint32_t r = 0; r < kRegions; ++r) {
      const RegionSpec& s = kRegionSpecs[r];
      regions[r].bytes.reset(new uint8_t[s.bytes]);
      MORI_FUZZ_ASSERT(reinterpret_cast<uintptr_t>(regions[r].bytes.get()) % 8 == 0, "region %u unaligned", r);
      for (size_t i = 0; i < s.bytes; ++i) regions[r].bytes[i] = Pattern(r, i);
      regions[r].named.assign(s.bytes, false);
      regions[r].key = tcp::RegisterTcpMemory(regions[r].bytes.get(), s.bytes, s.device);
      tcp::GrantTcpMemory(regions[r].key, s.toPeer ? peerRank_ : kOtherRank);
    }
    const auto regionOf = [&](uint32_t key) {
      for (uint32_t r = 0; r < kRegions; ++r) {
        if (regions[r].key == key && kRegionSpecs[r].toPeer) return static_cast<int>(r);
      }
      return -1;
    };

    // The stream, with the harness's keys in place; and what each frame may touch.
    std::vector<Frame> frames;
    while (in.Left() > 0) {
      Frame f{};
      f.channel = in.Take<uint8_t>() % numChannels;
      f.header = in.Take<tcp::FrameHeader>();
      if (f.header.key < kRegions) f.header.key = regions[f.header.key].key;
      f.payload = in.Rest();
      f.payloadBytes = std::min<size_t>(f.header.length, in.Left());
      for (size_t i = 0; i < f.payloadBytes; ++i) in.Take<uint8_t>();
      frames.push_back(f);
    }
    std::map<uint64_t, ReadAsked> reads;
    std::map<uint64_t, int> atomics;
    std::vector<uint64_t> orderedSent(static_cast<size_t>(numChannels), 0);
    for (const Frame& f : frames) {
      const tcp::FrameHeader& h = f.header;
      const auto type = static_cast<tcp::FrameType>(h.type);
      if (tcp::IsOrderedFrame(h.type)) ++orderedSent[static_cast<size_t>(f.channel)];
      if (type == tcp::FrameType::ReadRequest) {
        ReadAsked& a = reads[h.id];
        a.region = regionOf(h.key);
        a.offset = h.offset;
        a.bytes = std::max(a.bytes, h.arg0);
        ++a.count;
      }
      if (type == tcp::FrameType::FetchAdd || type == tcp::FrameType::CompareSwap) ++atomics[h.id];
    }
    NameWhatMayChange(frames, numChannels, regions, regionOf);
    tcp::TcpLinkOptions o;
    o.numChannels = numChannels;
    o.windowChunks = 4;
    o.chunkBytes = kChunkBytes;
    o.ifnames = {"lo"};
    tcp::TcpListener listener(o, linkRank_);
    std::vector<PeerChannel> channels(static_cast<size_t>(numChannels));
    std::unique_ptr<tcp::TcpLink> link;
    int stranger = -1;
    bool strangerTookChannel0 = false;
    if (connect) {
      link = ConnectLink(std::move(listener), numChannels, replies, options, channels);
      if (!link) {  // refused, as it had to be; nothing of the stream was sent
        for (PeerChannel& ch : channels) {
          if (ch.fd >= 0) CloseWithReset(ch.fd);  // no TIME_WAIT pair left behind
        }
        DeregisterAndCheck(regions);
        CheckNothingLeft(fdsBefore, threadsBefore);
        return;
      }
    } else {
      const tcp::TcpHandle mine = listener.Handle();
      tcp::TcpHandle peer;
      peer.nonce = kPeerNonce;
      peer.rank = peerRank_;
      peer.addresses = mine.addresses;  // never dialled: the harness connects

      bool strangerValid = false;
      if (!strangerHello.empty()) {
        tcp::FrameHeader h;
        tcp::HelloPayload hello;
        std::memcpy(&h, strangerHello.data(), sizeof(h));
        std::memcpy(&hello, strangerHello.data() + sizeof(h), sizeof(hello));
        if (options & kRealNonce) hello.nonce = mine.nonce;
        strangerValid = tcp::CheckFrame(h).empty() && h.type == static_cast<uint16_t>(tcp::FrameType::Hello) &&
                        tcp::CheckHello(hello, mine.nonce, kPeerNonce, numChannels).empty() && hello.channel == 0 &&
                        hello.rank == peerRank_;
        stranger = Connect(mine.addresses[0]);
        SendHello(stranger, h, hello);
      }
      for (int c = 0; c < numChannels; ++c) {
        tcp::FrameHeader h = tcp::MakeFrame(tcp::FrameType::Hello);
        h.length = sizeof(tcp::HelloPayload);
        tcp::HelloPayload hello{};
        hello.nonce = mine.nonce;
        hello.senderNonce = kPeerNonce;
        hello.channel = static_cast<uint32_t>(c);
        hello.numChannels = static_cast<uint32_t>(numChannels);
        hello.rank = peerRank_;
        channels[static_cast<size_t>(c)].fd = Connect(mine.addresses[static_cast<size_t>(c)]);
        SendHello(channels[static_cast<size_t>(c)].fd, h, hello);
      }

      try {
        link = std::make_unique<tcp::TcpLink>(std::move(listener), tcp::EncodeHandle(peer), peerRank_,
                                              Deadline::After(kHarnessWaitS));
      } catch (const mori::core::Error& e) {
        MORI_FUZZ_ASSERT(false, "the link did not come up with the harness's channels: %s", e.what());
      }
      if (stranger >= 0) {
        strangerTookChannel0 = StrangerOutcome(stranger) == 1;
        MORI_FUZZ_ASSERT(strangerTookChannel0 == strangerValid, "a stranger's hello was %s",
                         strangerValid ? "refused though valid" : "accepted though not valid");
        if (strangerTookChannel0) {
          close(channels[0].fd);  // left in the closed listener's queue
          channels[0].fd = stranger;
          stranger = -1;
        }
      }
    }
    MORI_FUZZ_ASSERT(link->RefusedConnections() == (stranger >= 0 ? 1 : 0), "%d connections refused",
                     link->RefusedConnections());

    std::unique_ptr<uint8_t[]> readInto(new uint8_t[kReadBytes]());
    uint64_t fetched = 0, swapped = 0;
    if (issue) {
      link->Read(readInto.get(), (options & kDeviceRead) != 0, 7, 0, kReadBytes);
      link->FetchAdd(7, 8, 5, &fetched);
      link->CompareSwap(7, 16, 1, 2, &swapped);
    }

    Peer p(channels);
    const Deadline deadline = Deadline::After(kHarnessWaitS);
    for (const Frame& f : frames) {
      p.Send(f.channel, reinterpret_cast<const uint8_t*>(&f.header), sizeof(f.header), deadline);
      p.Send(f.channel, f.payload, f.payloadBytes, deadline);
    }
    if (options & kReset) {
      for (PeerChannel& ch : channels) {
        const linger hard{1, 0};
        (void)setsockopt(ch.fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
        close(ch.fd);
        ch.fd = -1;
        ch.eof = true;
      }
      while (!link->Failed()) {
        MORI_FUZZ_ASSERT(!deadline.Expired(), "the link did not notice the peer's reset");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      for (PeerChannel& ch : channels) (void)shutdown(ch.fd, SHUT_WR);
      p.ReadToEnd(deadline);
    }
    MORI_FUZZ_ASSERT(link->Failed(), "the link closed its channels without failing");
    try {
      link->Flush(static_cast<int64_t>(kHarnessWaitS * 1e6));
    } catch (const mori::core::Error& e) {
      // Expected: the peer is gone (or was refused). An exception other than mori's is reported as Internal.
      MORI_FUZZ_ASSERT(e.Code() != ErrorCode::Internal, "the link failed with %s", e.what());
    } catch (const std::exception& e) {
      MORI_FUZZ_ASSERT(false, "Flush threw a non-mori exception: %s", e.what());
    }
    link.reset();

    DeregisterAndCheck(regions);
    for (size_t c = 0; c < channels.size(); ++c) {
      // A connecting link's channels begin with its hellos, which the harness read during the setup.
      CheckAnswers(static_cast<int>(c), channels[c].in, !connect && !(c == 0 && strangerTookChannel0), issue, reads,
                   atomics, orderedSent[c], regions);
    }
    for (PeerChannel& ch : channels) {
      if (ch.fd >= 0) close(ch.fd);
    }
    if (stranger >= 0) close(stranger);
    CheckNothingLeft(fdsBefore, threadsBefore);
  }

 private:
  // Waits until no receiver holds a region any more, then checks that no byte a frame does not name changed.
  static void DeregisterAndCheck(std::vector<Region>& regions) {
    for (uint32_t r = 0; r < kRegions; ++r) {
      const auto start = std::chrono::steady_clock::now();
      tcp::DeregisterTcpMemory(regions[r].key);  // waits while a receiver still holds the memory
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      MORI_FUZZ_ASSERT(s < 5.0, "region %u's registration was still held %.1f s after the link was gone", r, s);
      for (size_t i = 0; i < kRegionSpecs[r].bytes; ++i) {
        MORI_FUZZ_ASSERT(regions[r].named[i] || regions[r].bytes[i] == Pattern(r, i),
                         "byte %zu of region %u (%zu bytes) changed, and no frame names it", i, r,
                         kRegionSpecs[r].bytes);
      }
    }
  }

  static void CheckNothingLeft(size_t fdsBefore, size_t threadsBefore) {
    MORI_FUZZ_ASSERT(SettlesAt("/proc/self/fd", fdsBefore), "%zu descriptors open before the input, %zu after",
                     fdsBefore, CountEntries("/proc/self/fd"));
    MORI_FUZZ_ASSERT(SettlesAt("/proc/self/task", threadsBefore), "%zu threads before the input, %zu after",
                     threadsBefore, CountEntries("/proc/self/task"));
  }

  // kConnect: the harness plays the accepting rank 0 on listeners of its own. Channel by channel it takes the
  // link's connection, checks the hello on it and answers with the input's reply (or an acceptor's HelloAck), cut
  // short where the input ends in it, and stops at the first reply that no acceptor would send. Returns the link
  // when its setup succeeded, which it must exactly when every reply was an acceptor's; else checks that the setup
  // failed soon after that reply with mori's Error naming the channel and the cause, and returns null.
  std::unique_ptr<tcp::TcpLink> ConnectLink(tcp::TcpListener listener, int numChannels,
                                            const std::vector<std::vector<uint8_t>>& replies, uint8_t options,
                                            std::vector<PeerChannel>& channels) const {
    namespace net = mori::core::net;
    using mori::core::StrFormat;
    const uint64_t linkNonce = listener.Handle().nonce;
    tcp::TcpHandle acceptor;
    acceptor.nonce = kPeerNonce;
    acceptor.rank = peerRank_;
    std::vector<mori::core::UniqueFd> listeners;
    for (int c = 0; c < numChannels; ++c) {
      net::SocketAddress a = net::InterfaceAddressOf("lo");
      a.SetPort(0);
      listeners.push_back(net::Listen(a, 4));
      acceptor.addresses.push_back(a);
    }
    const std::vector<uint8_t> acceptorHandle = tcp::EncodeHandle(acceptor);

    struct Setup {
      std::atomic<bool> done{false};
      std::unique_ptr<tcp::TcpLink> link;
      bool moriError = false;
      ErrorCode code = ErrorCode::Internal;
      std::string what;
    } setup;
    std::thread connector([&] {
      try {
        setup.link = std::make_unique<tcp::TcpLink>(std::move(listener), acceptorHandle, peerRank_,
                                                    Deadline::After(kHarnessWaitS));
      } catch (const mori::core::Error& e) {
        setup.moriError = true;
        setup.code = e.Code();
        setup.what = e.what();
      } catch (const std::exception& e) {
        setup.what = e.what();
      }
      setup.done = true;
    });

    const Deadline deadline = Deadline::After(kHarnessWaitS);
    auto lastReply = std::chrono::steady_clock::now();
    int refusedAt = -1;  // the channel whose reply no acceptor would send
    bool cut = false;    // that reply was cut short
    std::string cause;   // else what is wrong with it
    int connected = 0;
    for (int c = 0; c < numChannels && refusedAt < 0; ++c) {
      const int fd = AcceptChannel(listeners[static_cast<size_t>(c)].Get(), setup.done, deadline, c);
      if (fd < 0) break;
      ++connected;
      channels[static_cast<size_t>(c)].fd = fd;
      CheckConnectorHello(fd, c, numChannels, linkNonce, deadline);

      std::vector<uint8_t> reply(sizeof(tcp::FrameHeader));
      if (replies.empty()) {
        const tcp::FrameHeader real = RealReply(c, linkNonce);
        std::memcpy(reply.data(), &real, sizeof(real));
      } else {
        reply = replies[static_cast<size_t>(c)];
        constexpr size_t kArg0 = offsetof(tcp::FrameHeader, arg0);
        for (size_t i = kArg0; (options & kRealNonce) && i < std::min(kArg0 + 8, reply.size()); ++i) {
          reply[i] ^= static_cast<uint8_t>(linkNonce >> (8 * (i - kArg0)));
        }
      }
      size_t sent = 0;
      while (sent < reply.size()) {  // 64 bytes at most: the socket takes them at once
        ssize_t k = send(fd, reply.data() + sent, reply.size() - sent, MSG_NOSIGNAL);
        MORI_FUZZ_ASSERT(k > 0 || errno == EINTR, "reply on channel %d: %s", c, std::strerror(errno));
        if (k > 0) sent += static_cast<size_t>(k);
      }
      if (reply.size() < sizeof(tcp::FrameHeader)) {
        refusedAt = c;
        cut = true;
        if (options & kReset) {
          CloseWithReset(fd);
          channels[static_cast<size_t>(c)].fd = -1;
        } else {
          (void)shutdown(fd, SHUT_WR);
        }
      } else {
        tcp::FrameHeader h;
        std::memcpy(&h, reply.data(), sizeof(h));
        cause = ReplyFault(h, c, linkNonce);
        if (!cause.empty()) refusedAt = c;
      }
      lastReply = std::chrono::steady_clock::now();
    }
    while (!setup.done) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - lastReply).count();
      MORI_FUZZ_ASSERT(s < kSetupEndS, "the link's setup went on %.1f s after channel %d's %s", s, connected - 1,
                       refusedAt < 0 ? "reply"
                       : cut         ? "reply cut short"
                                     : "malformed reply");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    connector.join();

    if (refusedAt < 0) {
      MORI_FUZZ_ASSERT(setup.link != nullptr,
                       "the link's setup failed with %d of %d channels answered as an "
                       "acceptor answers: %s",
                       connected, numChannels, setup.what.c_str());
      return std::move(setup.link);
    }
    MORI_FUZZ_ASSERT(setup.link == nullptr, "the link came up though channel %d's reply %s", refusedAt,
                     cut ? "was cut short" : ("was no acceptor's: " + cause).c_str());
    MORI_FUZZ_ASSERT(setup.moriError, "the setup failed with an exception that is not mori's: %s", setup.what.c_str());
    const std::string channel = StrFormat("rank %d's Tcp channel %d", peerRank_, refusedAt);
    const auto says = [&](const std::string& words) { return setup.what.find(words) != std::string::npos; };
    if (cut) {
      MORI_FUZZ_ASSERT(setup.code == ErrorCode::RemoteFailure && says(channel + " did not accept the channel"),
                       "channel %d's reply, cut short, ended the setup with: %s", refusedAt, setup.what.c_str());
    } else {
      MORI_FUZZ_ASSERT(setup.code == ErrorCode::Protocol && says(channel + " answered the hello with") && says(cause),
                       "channel %d's reply (no acceptor's: \"%s\") ended the setup with: %s", refusedAt, cause.c_str(),
                       setup.what.c_str());
    }
    return nullptr;
  }

  // The hello a connecting link sends on channel `channel`: one an acceptor takes (tcp_setup.cpp's ReadHello).
  void CheckConnectorHello(int fd, int channel, int numChannels, uint64_t linkNonce, const Deadline& deadline) const {
    tcp::FrameHeader h;
    tcp::HelloPayload hello;
    RecvExactly(fd, &h, sizeof(h), deadline, "the link's hello");
    RecvExactly(fd, &hello, sizeof(hello), deadline, "the link's hello");
    MORI_FUZZ_ASSERT(h.magic == tcp::kFrameMagic && h.version == tcp::kWireVersion &&
                         h.type == static_cast<uint16_t>(tcp::FrameType::Hello) && h.length == sizeof(hello),
                     "channel %d began with a %s frame of %u bytes, not a hello", channel, tcp::FrameTypeName(h.type),
                     h.length);
    MORI_FUZZ_ASSERT(hello.nonce == kPeerNonce && hello.senderNonce == linkNonce &&
                         hello.channel == static_cast<uint32_t>(channel) &&
                         hello.numChannels == static_cast<uint32_t>(numChannels) && hello.rank == linkRank_,
                     "channel %d's hello names connection %016llx from %016llx, channel %u of %u, rank %d", channel,
                     static_cast<unsigned long long>(hello.nonce), static_cast<unsigned long long>(hello.senderNonce),
                     hello.channel, hello.numChannels, hello.rank);
  }

  // Marks the bytes that the frames the link may apply name. A channel's receiver stops at the first frame it
  // refuses, so what follows that frame on its channel names nothing; only refusals that the stream alone decides
  // are followed here (a frame that is refused for a reason of timing or of the link's own requests only leaves
  // more bytes named than need be).
  template <typename RegionOf>
  static void NameWhatMayChange(const std::vector<Frame>& frames, int numChannels, std::vector<Region>& regions,
                                const RegionOf& regionOf) {
    struct Walk {
      bool stopped = false;
      uint64_t seq = 0;     // ordered frames applied
      uint64_t writes = 0;  // Write chunks applied
    };
    const auto n = static_cast<uint64_t>(numChannels);
    std::vector<Walk> walks(n);
    for (const Frame& f : frames) {
      Walk& w = walks[static_cast<size_t>(f.channel)];
      if (w.stopped) continue;
      const tcp::FrameHeader& h = f.header;
      const auto type = static_cast<tcp::FrameType>(h.type);
      if (!tcp::CheckFrame(h).empty() || type == tcp::FrameType::Hello || type == tcp::FrameType::HelloAck ||
          type == tcp::FrameType::Fail || type == tcp::FrameType::Close) {
        w.stopped = true;
        continue;
      }
      if (!tcp::IsOrderedFrame(h.type)) continue;
      const uint64_t bytes = type == tcp::FrameType::Write         ? h.length
                             : type == tcp::FrameType::ReadRequest ? h.arg0
                                                                   : 8;
      const int r = regionOf(h.key);
      const uint64_t size = r >= 0 ? kRegionSpecs[r].bytes : 0;
      bool applies = h.seq == w.seq + 1 && r >= 0 && bytes <= size && h.offset <= size - bytes;
      if (type == tcp::FrameType::Write) {
        applies = applies && h.before == static_cast<uint64_t>(f.channel) + n * w.writes;
      } else {
        // On channel 0 only, counting exactly the Write chunks channel 0 carried before it.
        applies = applies && f.channel == 0 && walks[0].writes == h.before / n + (h.before % n > 0 ? 1 : 0);
        if (type != tcp::FrameType::ReadRequest) applies = applies && h.offset % 8 == 0;
      }
      if (!applies) {
        w.stopped = true;
        continue;
      }
      if (type != tcp::FrameType::ReadRequest) {
        auto& named = regions[static_cast<size_t>(r)].named;
        std::fill(named.begin() + static_cast<ptrdiff_t>(h.offset),
                  named.begin() + static_cast<ptrdiff_t>(h.offset + bytes), true);
      }
      ++w.seq;
      if (type == tcp::FrameType::Write) ++w.writes;
      if (type == tcp::FrameType::Write && f.payloadBytes < h.length) w.stopped = true;  // the connection ends in it
    }
  }

  // What the link sent on channel `c`: whole well-formed frames, each one an answer to something asked.
  static void CheckAnswers(int c, const std::vector<uint8_t>& bytes, bool helloAckFirst, bool issued,
                           const std::map<uint64_t, ReadAsked>& reads, const std::map<uint64_t, int>& atomics,
                           uint64_t orderedSent, const std::vector<Region>& regions) {
    size_t at = 0;
    uint64_t lastAck = 0;
    bool first = true;
    while (bytes.size() - at >= sizeof(tcp::FrameHeader)) {
      tcp::FrameHeader h;
      std::memcpy(&h, bytes.data() + at, sizeof(h));
      at += sizeof(h);
      const std::string bad = tcp::CheckFrame(h);
      MORI_FUZZ_ASSERT(bad.empty(), "the link sent a malformed frame on channel %d: %s", c, bad.c_str());
      // The last frame may be cut short: a link that fails stops sending in the middle of a frame.
      const uint8_t* payload = bytes.data() + at;
      at += std::min<size_t>(h.length, bytes.size() - at);
      const auto type = static_cast<tcp::FrameType>(h.type);
      if (first && helloAckFirst) {
        MORI_FUZZ_ASSERT(type == tcp::FrameType::HelloAck && h.key == static_cast<uint32_t>(c) && h.arg0 == kPeerNonce,
                         "channel %d began with a %s frame, not its HelloAck", c, tcp::FrameTypeName(h.type));
        first = false;
        continue;
      }
      first = false;
      switch (type) {
        case tcp::FrameType::Ack:
          MORI_FUZZ_ASSERT(h.seq >= lastAck && h.seq <= orderedSent,
                           "Ack of frame %llu on channel %d after an Ack of %llu; %llu ordered frames were sent",
                           static_cast<unsigned long long>(h.seq), c, static_cast<unsigned long long>(lastAck),
                           static_cast<unsigned long long>(orderedSent));
          lastAck = h.seq;
          break;
        case tcp::FrameType::ReadData: {
          auto it = reads.find(h.id);
          MORI_FUZZ_ASSERT(it != reads.end(), "ReadData for read %llu, which was never asked",
                           static_cast<unsigned long long>(h.id));
          const ReadAsked& a = it->second;
          MORI_FUZZ_ASSERT(h.offset <= a.bytes && h.length <= a.bytes - h.offset,
                           "ReadData [%llu, + %u) for a read of %llu bytes", static_cast<unsigned long long>(h.offset),
                           h.length, static_cast<unsigned long long>(a.bytes));
          if (a.count == 1 && a.region >= 0 && a.offset <= kRegionSpecs[a.region].bytes &&
              a.bytes <= kRegionSpecs[a.region].bytes - a.offset) {
            const Region& r = regions[static_cast<size_t>(a.region)];
            bool written = false;
            for (uint64_t i = 0; i < a.bytes; ++i) written = written || r.named[a.offset + i];
            for (uint32_t i = 0; !written && i < h.length; ++i) {
              const uint64_t where = a.offset + h.offset + i;
              MORI_FUZZ_ASSERT(payload[i] == Pattern(static_cast<uint32_t>(a.region), where),
                               "read %llu returned 0x%02x for byte %llu of region %d, which holds 0x%02x",
                               static_cast<unsigned long long>(h.id), payload[i],
                               static_cast<unsigned long long>(where), a.region,
                               Pattern(static_cast<uint32_t>(a.region), where));
            }
          }
          break;
        }
        case tcp::FrameType::AtomicResult:
          MORI_FUZZ_ASSERT(atomics.count(h.id) != 0, "AtomicResult for atomic %llu, which was never asked",
                           static_cast<unsigned long long>(h.id));
          break;
        case tcp::FrameType::Fail:
        case tcp::FrameType::Close:
          break;
        case tcp::FrameType::ReadRequest:
        case tcp::FrameType::FetchAdd:
        case tcp::FrameType::CompareSwap:
          MORI_FUZZ_ASSERT(issued && c == 0, "the link sent a %s on channel %d, which it was not asked to",
                           tcp::FrameTypeName(h.type), c);
          break;
        default:
          MORI_FUZZ_ASSERT(false, "the link sent a %s frame on channel %d", tcp::FrameTypeName(h.type), c);
      }
    }
  }

  int linkRank_ = 0;
  int peerRank_ = 1;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MORI_TIMEOUT_S", "1", 1);      // every wait of the link is bounded, and short
  setenv("MORI_LOG_LEVEL", "error", 1);  // every refused frame fails the link with a warning
  // The HOST runtime's default stream and the process's copy stream (which the link's bounce buffers use for
  // device memory) are threads made on first use and kept: made now, they are not counted as a leak.
  MORI_FUZZ_ASSERT(mori::core::GpuDeviceSynchronize() == mori::core::kGpuSuccess, "GpuDeviceSynchronize");
  MORI_FUZZ_ASSERT(mori::core::HostCopyStream() != nullptr, "HostCopyStream");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Harness().Run(data, size);
  return 0;
}
