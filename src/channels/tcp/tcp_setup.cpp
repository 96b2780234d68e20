// Listening, connecting and accepting the channels of a TCP link, with the hello that binds each accepted
// socket to its channel and to this connection (nonces learned through the bootstrap).
#include "tcp/tcp_setup.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <random>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::core::tcp {

namespace {

uint64_t MakeNonce() {
  std::random_device rd;
  uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  x ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
  x ^= static_cast<uint64_t>(getpid()) << 17;
  return x == 0 ? 1 : x;
}

// Reads and checks the hello on a socket accepted by channel `channel`'s listener; empty when it is the
// peer's, else why the connection is refused.
std::string ReadHello(int fd, int channel, const TcpHandle& mine, const TcpHandle& peer, int numChannels,
                      const Deadline& deadline) {
  const std::string what = "a connection to Tcp channel " + std::to_string(channel) + "'s listener";
  try {
    FrameHeader h;
    net::RecvAll(fd, &h, sizeof(h), deadline, what);
    std::string bad = CheckFrame(h);
    if (!bad.empty()) return "malformed hello: " + bad;
    if (h.type != static_cast<uint16_t>(FrameType::Hello)) {
      return StrFormat("a %s frame where a Hello was due", FrameTypeName(h.type));
    }
    HelloPayload hello;
    net::RecvAll(fd, &hello, sizeof(hello), deadline, what);
    bad = CheckHello(hello, mine.nonce, peer.nonce, numChannels);
    if (!bad.empty()) return bad;
    if (static_cast<int>(hello.channel) != channel) {
      return StrFormat("hello for channel %u at channel %d's listener", hello.channel, channel);
    }
    if (hello.rank != peer.rank) return StrFormat("hello from rank %d, expected rank %d", hello.rank, peer.rank);
  } catch (const Error& e) {
    return MessageOf(e);
  }
  return "";
}

EstablishedChannels Accept(TcpListener::State& s, const TcpHandle& peer, const Deadline& deadline) {
  const int n = s.options.numChannels;
  EstablishedChannels out;
  out.channels.resize(static_cast<size_t>(n));
  int matched = 0;
  while (matched < n) {
    std::vector<pollfd> pfds;
    std::vector<int> index;
    for (int i = 0; i < n; ++i) {
      if (out.channels[static_cast<size_t>(i)].fd.Valid()) continue;
      pfds.push_back(pollfd{s.listeners[static_cast<size_t>(i)].Get(), POLLIN, 0});
      index.push_back(i);
    }
    int r = poll(pfds.data(), pfds.size(), std::min(deadline.RemainingMs(), 1000));
    if (r < 0 && errno == EINTR) continue;
    MORI_CHECK_SYS(r);
    if (r == 0) {
      if (deadline.Expired()) {
        std::string missing;
        for (int i : index) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
        throw TimeoutError(
            StrFormat("rank %d waited %.0f s for rank %d to connect its Tcp channels: %d of %d came "
                      "(missing: %s; %d stray connections refused)",
                      s.handle.rank, deadline.TotalSeconds(), peer.rank, matched, n, missing.c_str(), out.refused));
      }
      continue;
    }
    for (size_t k = 0; k < pfds.size(); ++k) {
      if ((pfds[k].revents & POLLIN) == 0) continue;
      const int i = index[k];
      int fd = accept4(pfds[k].fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0 && (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)) continue;
      MORI_CHECK_SYS(fd);
      UniqueFd conn(fd);
      net::SetNoDelay(conn.Get());
      // A stray connection that sends nothing may hold up the others only briefly.
      Deadline helloDeadline = Deadline::After(std::max(0.0, std::min(deadline.RemainingSeconds(), 5.0)));
      std::string why = ReadHello(conn.Get(), i, s.handle, peer, n, helloDeadline);
      net::SocketAddress from = net::PeerAddressOf(conn.Get());
      if (!why.empty()) {
        MORI_LOG_WARN(Net, "rank %d refused a connection from %s to Tcp channel %d's listener (peer rank %d): %s",
                      s.handle.rank, from.ToString().c_str(), i, peer.rank, why.c_str());
        ++out.refused;
        continue;
      }
      FrameHeader ack = MakeFrame(FrameType::HelloAck);
      ack.key = static_cast<uint32_t>(i);
      ack.arg0 = peer.nonce;
      net::SendAll(conn.Get(), &ack, sizeof(ack), deadline, StrFormat("rank %d (Tcp channel %d)", peer.rank, i));
      EstablishedChannel& ch = out.channels[static_cast<size_t>(i)];
      ch.local = net::LocalAddressOf(conn.Get());
      ch.peer = from;
      ch.ifname = s.channelIfnames[static_cast<size_t>(i)];
      ch.fd = std::move(conn);
      ++matched;
    }
  }
  return out;
}

EstablishedChannels ConnectAll(TcpListener::State& s, const TcpHandle& peer, const Deadline& deadline) {
  const int n = s.options.numChannels;
  EstablishedChannels out;
  for (int i = 0; i < n; ++i) {
    const std::string what = StrFormat("rank %d's Tcp channel %d", peer.rank, i);
    const std::string& ifname = s.channelIfnames[static_cast<size_t>(i)];
    std::optional<net::SocketAddress> local;
    if (!ifname.empty()) {
      local = net::InterfaceAddressOf(ifname);
      local->SetPort(0);
    }
    UniqueFd fd = net::ConnectWithRetry(peer.addresses[static_cast<size_t>(i)], deadline, what, {local});

    FrameHeader h = MakeFrame(FrameType::Hello);
    h.length = sizeof(HelloPayload);
    HelloPayload hello{};
    hello.nonce = peer.nonce;
    hello.senderNonce = s.handle.nonce;
    hello.channel = static_cast<uint32_t>(i);
    hello.numChannels = static_cast<uint32_t>(n);
    hello.rank = s.handle.rank;
    uint8_t buf[sizeof(h) + sizeof(hello)];
    std::memcpy(buf, &h, sizeof(h));
    std::memcpy(buf + sizeof(h), &hello, sizeof(hello));
    net::SendAll(fd.Get(), buf, sizeof(buf), deadline, what);

    FrameHeader ack;
    try {
      net::RecvAll(fd.Get(), &ack, sizeof(ack), deadline, what);
    } catch (const Error& e) {
      ThrowError(e.Code(), StrFormat("rank %d: %s did not accept the channel (%s)", s.handle.rank, what.c_str(),
                                     MessageOf(e).c_str()));
    }
    std::string bad = CheckFrame(ack);
    if (bad.empty() && ack.type != static_cast<uint16_t>(FrameType::HelloAck)) {
      bad = StrFormat("a %s frame where a HelloAck was due", FrameTypeName(ack.type));
    }
    if (bad.empty() && (ack.key != static_cast<uint32_t>(i) || ack.arg0 != s.handle.nonce)) {
      bad = StrFormat("HelloAck for channel %u of connection %016llx, expected channel %d of %016llx", ack.key,
                      static_cast<unsigned long long>(ack.arg0), i, static_cast<unsigned long long>(s.handle.nonce));
    }
    MORI_CHECK(bad.empty(), ErrorCode::Protocol, "rank %d: %s answered the hello with %s", s.handle.rank, what.c_str(),
               bad.c_str());
    EstablishedChannel ch;
    ch.local = net::LocalAddressOf(fd.Get());
    ch.peer = net::PeerAddressOf(fd.Get());
    ch.ifname = ifname;
    ch.fd = std::move(fd);
    out.channels.push_back(std::move(ch));
  }
  return out;
}

}  // namespace

std::string MessageOf(const Error& e) {
  std::string text = e.what();
  std::string prefix = std::string("mori ") + ErrorCodeName(e.Code()) + ": ";
  return text.rfind(prefix, 0) == 0 ? text.substr(prefix.size()) : text;
}

void ThrowError(ErrorCode code, const std::string& message) {
  if (code == ErrorCode::Timeout) throw TimeoutError(message);
  throw Error(code, message);
}

void OpenListeners(TcpListener::State& s, int rank) {
  const int n = s.options.numChannels;
  std::optional<net::SocketAddress> picked;
  for (int i = 0; i < n; ++i) {
    std::string ifname =
        s.options.ifnames.empty() ? "" : s.options.ifnames[static_cast<size_t>(i) % s.options.ifnames.size()];
    net::SocketAddress addr;
    if (ifname.empty()) {
      if (!picked) picked = net::PickLocalAddress();
      addr = *picked;
    } else {
      addr = net::InterfaceAddressOf(ifname);
    }
    addr.SetPort(0);
    s.listeners.push_back(net::Listen(addr, 16));
    s.handle.addresses.push_back(addr);
    s.channelIfnames.push_back(ifname);
  }
  s.handle.nonce = MakeNonce();
  s.handle.rank = rank;
}

bool IsAcceptor(const TcpHandle& mine, const TcpHandle& peer) {
  if (mine.rank != peer.rank) return mine.rank < peer.rank;
  return mine.nonce < peer.nonce;
}

EstablishedChannels EstablishChannels(TcpListener::State& s, const TcpHandle& peer, const Deadline& deadline) {
  MORI_CHECK(static_cast<int>(peer.addresses.size()) == s.options.numChannels, ErrorCode::InvalidUsage,
             "rank %d asks for %d Tcp channels, rank %d for %zu: both ends of a Tcp connection must use the same "
             "number (MORI_TCP_CHANNELS or EndpointConfig::tcp.numChannels)",
             s.handle.rank, s.options.numChannels, peer.rank, peer.addresses.size());
  MORI_CHECK(peer.nonce != s.handle.nonce, ErrorCode::Protocol,
             "rank %d received its own Tcp handle back (nonce %016llx) instead of rank %d's", s.handle.rank,
             static_cast<unsigned long long>(peer.nonce), peer.rank);
  return IsAcceptor(s.handle, peer) ? Accept(s, peer, deadline) : ConnectAll(s, peer, deadline);
}

}  // namespace mori::core::tcp
