#include "socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::core::net {

SocketAddress::SocketAddress() : len_(0) { std::memset(&storage_, 0, sizeof(storage_)); }

SocketAddress SocketAddress::FromSockaddr(const sockaddr* sa, socklen_t len) {
  SocketAddress a;
  MORI_CHECK(len <= static_cast<socklen_t>(sizeof(a.storage_)), ErrorCode::Internal, "sockaddr too long");
  std::memcpy(&a.storage_, sa, len);
  a.len_ = len;
  return a;
}

SocketAddress SocketAddress::FromWire(const WireAddress& w) {
  SocketAddress a;
  if (w.family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a.storage_);
    in->sin_family = AF_INET;
    in->sin_port = htons(w.port);
    std::memcpy(&in->sin_addr, w.addr, 4);
    a.len_ = sizeof(sockaddr_in);
  } else if (w.family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.storage_);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(w.port);
    std::memcpy(&in6->sin6_addr, w.addr, 16);
    in6->sin6_scope_id = w.scopeId;
    a.len_ = sizeof(sockaddr_in6);
  } else {
    MORI_THROW(ErrorCode::Protocol, "address with unknown family %u", static_cast<unsigned>(w.family));
  }
  return a;
}

WireAddress SocketAddress::ToWire() const {
  WireAddress w;
  std::memset(&w, 0, sizeof(w));
  w.family = static_cast<uint16_t>(Family());
  w.port = Port();
  if (Family() == AF_INET) {
    std::memcpy(w.addr, &reinterpret_cast<const sockaddr_in*>(&storage_)->sin_addr, 4);
  } else if (Family() == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&storage_);
    std::memcpy(w.addr, &in6->sin6_addr, 16);
    w.scopeId = in6->sin6_scope_id;
  }
  return w;
}

SocketAddress SocketAddress::Parse(const std::string& hostPort) {
  std::string host;
  std::string port;
  if (!hostPort.empty() && hostPort[0] == '[') {
    size_t close = hostPort.find(']');
    MORI_CHECK(close != std::string::npos && close + 1 < hostPort.size() && hostPort[close + 1] == ':',
               ErrorCode::InvalidUsage, "'%s' is not an address of the form [ipv6]:port", hostPort.c_str());
    host = hostPort.substr(1, close - 1);
    port = hostPort.substr(close + 2);
  } else {
    size_t colon = hostPort.rfind(':');
    MORI_CHECK(colon != std::string::npos && colon > 0, ErrorCode::InvalidUsage,
               "'%s' is not an address of the form host:port", hostPort.c_str());
    host = hostPort.substr(0, colon);
    port = hostPort.substr(colon + 1);
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  MORI_CHECK(!port.empty() && *end == '\0' && p >= 0 && p <= 65535, ErrorCode::InvalidUsage,
             "'%s' has no valid port (0-65535)", hostPort.c_str());

  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  MORI_CHECK(rc == 0 && result != nullptr, ErrorCode::InvalidUsage, "cannot resolve host '%s' of '%s': %s",
             host.c_str(), hostPort.c_str(), gai_strerror(rc));
  const addrinfo* pick = result;
  for (const addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET) {
      pick = ai;
      break;
    }
  }
  SocketAddress a = FromSockaddr(pick->ai_addr, pick->ai_addrlen);
  freeaddrinfo(result);
  a.SetPort(static_cast<uint16_t>(p));
  return a;
}

std::string SocketAddress::HostString() const {
  char buf[INET6_ADDRSTRLEN + 16] = "?";
  if (Family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage_)->sin_addr, buf, sizeof(buf));
  } else if (Family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage_)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

std::string SocketAddress::ToString() const {
  if (Family() == AF_INET6) return "[" + HostString() + "]:" + std::to_string(Port());
  return HostString() + ":" + std::to_string(Port());
}

uint16_t SocketAddress::Port() const {
  if (Family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage_)->sin_port);
  if (Family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage_)->sin6_port);
  return 0;
}

void SocketAddress::SetPort(uint16_t port) {
  if (Family() == AF_INET) reinterpret_cast<sockaddr_in*>(&storage_)->sin_port = htons(port);
  if (Family() == AF_INET6) reinterpret_cast<sockaddr_in6*>(&storage_)->sin6_port = htons(port);
}

bool SocketAddress::IsLoopback() const {
  if (Family() == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&storage_)->sin_addr.s_addr) >> 24) == 127;
  }
  if (Family() == AF_INET6) return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&storage_)->sin6_addr);
  return false;
}

bool SocketAddress::IsAny() const {
  if (Family() == AF_INET) return reinterpret_cast<const sockaddr_in*>(&storage_)->sin_addr.s_addr == INADDR_ANY;
  if (Family() == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(&storage_)->sin6_addr);
  }
  return true;
}

std::vector<InterfaceAddress> ListInterfaceAddresses() {
  ifaddrs* list = nullptr;
  MORI_CHECK_SYS(getifaddrs(&list));
  std::vector<InterfaceAddress> v4;
  std::vector<InterfaceAddress> v6;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || !(ifa->ifa_flags & IFF_UP)) continue;
    int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    InterfaceAddress entry{ifa->ifa_name, SocketAddress::FromSockaddr(ifa->ifa_addr, len),
                           (ifa->ifa_flags & IFF_LOOPBACK) != 0};
    (family == AF_INET ? v4 : v6).push_back(entry);
  }
  freeifaddrs(list);
  v4.insert(v4.end(), v6.begin(), v6.end());
  return v4;
}

SocketAddress InterfaceAddressOf(const std::string& ifname) {
  std::string names;
  for (const auto& entry : ListInterfaceAddresses()) {
    if (entry.name == ifname) return entry.address;
    if (names.find(entry.name) == std::string::npos) names += (names.empty() ? "" : ", ") + entry.name;
  }
  MORI_THROW(ErrorCode::InvalidUsage, "network interface '%s' has no address or is down (interfaces up: %s)",
             ifname.c_str(), names.c_str());
}

SocketAddress PickLocalAddress() {
  std::string ifnames = EnvGetString("MORI_SOCKET_IFNAME");
  if (!ifnames.empty()) return InterfaceAddressOf(ifnames.substr(0, ifnames.find(',')));
  auto all = ListInterfaceAddresses();
  for (const auto& entry : all) {
    if (entry.loopback) continue;
    // IPv6 link-local addresses need a scope to be reached; skip them when picking automatically.
    if (entry.address.Family() == AF_INET6 && entry.address.HostString().rfind("fe80", 0) == 0) continue;
    return entry.address;
  }
  for (const auto& entry : all) {
    if (entry.loopback) return entry.address;
  }
  MORI_THROW(ErrorCode::System, "no network interface is up, not even loopback");
}

Endpoint ParseEndpoint(const std::string& text) {
  Endpoint ep;
  std::string rest = text;
  // "ifname:ip:port": two or more colons outside brackets, the first part naming an interface.
  size_t first = text.find(':');
  if (first != std::string::npos && text[0] != '[') {
    size_t second = text.find(':', first + 1);
    if (second != std::string::npos && text.find(':', second + 1) == std::string::npos) {
      ep.ifname = text.substr(0, first);
      rest = text.substr(first + 1);
    } else if (second != std::string::npos) {
      // "ifname:[v6]:port" or a bare IPv6 without brackets: only the bracketed form is accepted.
      size_t bracket = text.find('[');
      MORI_CHECK(bracket == first + 1, ErrorCode::InvalidUsage,
                 "'%s': write IPv6 addresses in brackets, [addr]:port", text.c_str());
      ep.ifname = text.substr(0, first);
      rest = text.substr(first + 1);
    }
  }
  ep.address = SocketAddress::Parse(rest);
  return ep;
}

SocketAddress LocalAddressToward(const SocketAddress& peer) {
  UniqueFd fd(socket(peer.Family(), SOCK_DGRAM | SOCK_CLOEXEC, 0));
  MORI_CHECK_SYS(fd.Get());
  if (connect(fd.Get(), peer.Sockaddr(), peer.Length()) < 0) {
    MORI_THROW_SYS(errno, "no route to %s", peer.ToString().c_str());
  }
  SocketAddress local = LocalAddressOf(fd.Get());
  local.SetPort(0);
  return local;
}

SocketAddress LocalAddressOf(int fd) {
  sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  MORI_CHECK_SYS(getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len));
  return SocketAddress::FromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
}

SocketAddress PeerAddressOf(int fd) {
  sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) < 0) return SocketAddress();
  return SocketAddress::FromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
}

UniqueFd Listen(SocketAddress& address, int backlog) {
  UniqueFd fd(socket(address.Family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  MORI_CHECK_SYS(fd.Get());
  int one = 1;
  MORI_CHECK_SYS(setsockopt(fd.Get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)));
  if (bind(fd.Get(), address.Sockaddr(), address.Length()) < 0) {
    MORI_THROW_SYS(errno, "cannot listen on %s", address.ToString().c_str());
  }
  MORI_CHECK_SYS(listen(fd.Get(), backlog));
  address = LocalAddressOf(fd.Get());
  return fd;
}

UniqueFd ConnectWithRetry(const SocketAddress& peer, const Deadline& deadline, const std::string& what,
                          const ConnectOptions& options) {
  const std::optional<SocketAddress>& from = options.from;
  MORI_CHECK(!from || from->Family() == peer.Family(), ErrorCode::InvalidUsage,
             "cannot reach %s at %s from %s: the address families differ", what.c_str(), peer.ToString().c_str(),
             from->HostString().c_str());
  const double refusedGiveUpS = options.refusedGiveUpS;
  int delayMs = 1;
  int lastErr = 0;
  bool refusing = false;  // every attempt since `refusedGiveUp` was set was refused
  Deadline refusedGiveUp = Deadline::After(0);
  while (true) {
    UniqueFd fd(socket(peer.Family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    MORI_CHECK_SYS(fd.Get());
    if (from && bind(fd.Get(), from->Sockaddr(), from->Length()) < 0) {
      MORI_THROW_SYS(errno, "cannot bind the socket for %s to %s", what.c_str(), from->ToString().c_str());
    }
    int rc = connect(fd.Get(), peer.Sockaddr(), peer.Length());
    if (rc < 0 && errno == EINPROGRESS) {
      pollfd pfd{fd.Get(), POLLOUT, 0};
      int n = poll(&pfd, 1, std::max(1, std::min(deadline.RemainingMs(), 1000)));
      if (n > 0) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(fd.Get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        rc = -1;
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      SetNonBlocking(fd.Get(), false);
      SetNoDelay(fd.Get());
      return fd;
    }
    lastErr = errno;
    bool retryable = lastErr == ECONNREFUSED || lastErr == ETIMEDOUT || lastErr == ENETUNREACH ||
                     lastErr == EHOSTUNREACH || lastErr == ECONNRESET || lastErr == EAGAIN || lastErr == EINTR;
    if (!retryable) MORI_THROW_SYS(lastErr, "cannot connect to %s at %s", what.c_str(), peer.ToString().c_str());
    if (refusedGiveUpS >= 0 && lastErr == ECONNREFUSED) {
      if (!refusing) refusedGiveUp = Deadline::After(refusedGiveUpS);
      refusing = true;
      if (refusedGiveUp.Expired()) {
        throw Error(ErrorCode::RemoteFailure,
                    StrFormat("%s at %s refused every connection for %.1f s though it was listening before: its "
                              "process exited?",
                              what.c_str(), peer.ToString().c_str(), refusedGiveUpS));
      }
    } else {
      refusing = false;
    }
    if (deadline.Expired()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(delayMs, std::max(1, deadline.RemainingMs()))));
    delayMs = std::min(delayMs * 2, 100);
  }
  throw TimeoutError(StrFormat("could not connect to %s at %s within %.0f s (last error: %s)", what.c_str(),
                               peer.ToString().c_str(), deadline.TotalSeconds(), ErrnoString(lastErr).c_str()));
}

UniqueFd AcceptOne(int listenFd, const Deadline& deadline) {
  while (true) {
    pollfd pfd{listenFd, POLLIN, 0};
    int n = poll(&pfd, 1, deadline.RemainingMs());
    if (n < 0 && errno == EINTR) continue;
    MORI_CHECK_SYS(n);
    if (n == 0) return UniqueFd();
    int fd = accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0 && (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)) continue;
    MORI_CHECK_SYS(fd);
    SetNoDelay(fd);
    return UniqueFd(fd);
  }
}

void SetNonBlocking(int fd, bool nonBlocking) {
  int flags = fcntl(fd, F_GETFL, 0);
  MORI_CHECK_SYS(flags);
  flags = nonBlocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  MORI_CHECK_SYS(fcntl(fd, F_SETFL, flags));
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // not a TCP socket: nothing to do
}

void DetectVanishedPeer(int fd, double seconds) {
  // Probes start after half the time without traffic; three unanswered ones, spread over the other half, end it.
  const int idle = std::max(1, static_cast<int>(seconds / 2));
  const int interval = std::max(1, static_cast<int>(seconds / 6));
  const int probes = 3;
  const unsigned userTimeoutMs = static_cast<unsigned>(std::min(seconds * 1000.0, 4.0e9));
  int one = 1;
  // Each may fail on a socket that is not TCP (a test's socketpair): then nothing changes, which is right.
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeoutMs, sizeof(userTimeoutMs));
}

size_t ReceiveRoom(std::vector<uint8_t>& buffer, size_t got, uint64_t total) {
  constexpr size_t kFirstPiece = size_t(1) << 20;
  if (got == buffer.size() && got < total) {
    buffer.resize(static_cast<size_t>(std::min<uint64_t>(total, got + std::max(kFirstPiece, got))));
  }
  return buffer.size() - got;
}

void SendAll(int fd, const void* data, size_t bytes, const Deadline& deadline, const std::string& what,
             const std::function<void(int ms)>& whileFull) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (deadline.Expired()) {
        throw TimeoutError(StrFormat("sending to %s did not finish within %.0f s (%zu bytes left; is it alive and "
                                     "reading?)",
                                     what.c_str(), deadline.TotalSeconds(), bytes));
      }
      if (whileFull) {
        whileFull(std::min(deadline.RemainingMs(), 100));
      } else {
        pollfd pfd{fd, POLLOUT, 0};
        poll(&pfd, 1, std::min(deadline.RemainingMs(), 1000));
      }
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      throw Error(ErrorCode::RemoteFailure, StrFormat("%s closed the connection (process gone?) while %zu bytes "
                                                      "were still to be sent",
                                                      what.c_str(), bytes));
    }
    MORI_THROW_SYS(errno, "send to %s", what.c_str());
  }
}

void RecvAll(int fd, void* data, size_t bytes, const Deadline& deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  size_t total = bytes;
  while (bytes > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int r = poll(&pfd, 1, std::min(deadline.RemainingMs(), 1000));
    if (r < 0 && errno == EINTR) continue;
    MORI_CHECK_SYS(r);
    if (r == 0) {
      if (deadline.Expired()) {
        throw TimeoutError(StrFormat("waited %.0f s for %s to send %zu bytes (got %zu)", deadline.TotalSeconds(),
                                     what.c_str(), total, total - bytes));
      }
      continue;
    }
    ssize_t n = recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
    } else if (n == 0) {
      throw Error(ErrorCode::RemoteFailure, StrFormat("%s closed the connection (process gone?) after %zu of %zu "
                                                      "bytes",
                                                      what.c_str(), total - bytes, total));
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      if (errno == ECONNRESET) {
        throw Error(ErrorCode::RemoteFailure, StrFormat("%s reset the connection (process gone?)", what.c_str()));
      }
      MORI_THROW_SYS(errno, "recv from %s", what.c_str());
    }
  }
}

}  // namespace mori::core::net
