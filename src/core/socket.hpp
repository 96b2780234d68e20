// TCP socket helpers for the bootstrap and the TCP transport: addresses (IPv4 and IPv6), interface
// selection, listening, connecting with retries, and bounded whole-buffer send and receive.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "mori/core/timeout.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::core::net {

// An address in the fixed-size form that travels inside unique ids and bootstrap frames.
struct WireAddress {
  uint16_t family;  // AF_INET or AF_INET6
  uint16_t port;    // host byte order
  uint8_t addr[16]; // IPv4 in the first 4 bytes
  uint32_t scopeId; // IPv6 link-local scope
};
static_assert(sizeof(WireAddress) == 24, "WireAddress travels as bytes");

class SocketAddress {
 public:
  SocketAddress();
  static SocketAddress FromSockaddr(const sockaddr* sa, socklen_t len);
  static SocketAddress FromWire(const WireAddress& w);  // throws Protocol on an unknown family
  // "1.2.3.4:5", "[fe80::1%eth0]:5" or "host:5" (resolved, IPv4 preferred); throws InvalidUsage.
  static SocketAddress Parse(const std::string& hostPort);

  WireAddress ToWire() const;
  std::string ToString() const;  // "1.2.3.4:5" / "[::1]:5"
  std::string HostString() const;
  int Family() const { return storage_.ss_family; }
  uint16_t Port() const;
  void SetPort(uint16_t port);
  bool IsLoopback() const;
  bool IsAny() const;
  const sockaddr* Sockaddr() const { return reinterpret_cast<const sockaddr*>(&storage_); }
  socklen_t Length() const { return len_; }

 private:
  sockaddr_storage storage_;
  socklen_t len_;
};

struct InterfaceAddress {
  std::string name;
  SocketAddress address;  // port 0
  bool loopback;
};

// Addresses of the interfaces that are up, IPv4 first.
std::vector<InterfaceAddress> ListInterfaceAddresses();

// The address of the named interface (IPv4 preferred); throws InvalidUsage naming the interfaces present.
SocketAddress InterfaceAddressOf(const std::string& ifname);

// Where this host should be reached: the first interface of MORI_SOCKET_IFNAME, else the first
// non-loopback interface that is up, else loopback.
SocketAddress PickLocalAddress();

// A bootstrap endpoint as users write it: "ip:port", "[ipv6]:port", "host:port" or "ifname:ip:port".
struct Endpoint {
  std::string ifname;  // empty when not given
  SocketAddress address;
};
Endpoint ParseEndpoint(const std::string& text);

// The local address the kernel would use to reach `peer` (no packet is sent).
SocketAddress LocalAddressToward(const SocketAddress& peer);

SocketAddress LocalAddressOf(int fd);
SocketAddress PeerAddressOf(int fd);

// A listening TCP socket on `address` (port 0: any); `address` is updated with the port given.
UniqueFd Listen(SocketAddress& address, int backlog = 256);

struct ConnectOptions {
  // Bind the socket to this local address (its port: 0) before connecting, to pick the interface.
  std::optional<SocketAddress> from;
  // >= 0: the peer is known to have been listening already, so refusals for this long in a row mean its
  // listener is gone (the process exited): an Error(RemoteFailure) naming it, not a wait for the deadline.
  double refusedGiveUpS = -1;
};

// Connects to `peer`, retrying refused or unreachable attempts until `deadline`; `what` names the peer in
// the TimeoutError ("bootstrap root", "rank 3").
UniqueFd ConnectWithRetry(const SocketAddress& peer, const Deadline& deadline, const std::string& what,
                          const ConnectOptions& options = {});

// Accepts one connection, waiting at most until `deadline`; returns an invalid fd on timeout.
UniqueFd AcceptOne(int listenFd, const Deadline& deadline);

void SetNonBlocking(int fd, bool nonBlocking);
void SetNoDelay(int fd);
// Makes the kernel notice, within about `seconds`, a peer that vanished without a word (a partition, a host
// that lost power): TCP_USER_TIMEOUT bounds how long sent data may go unacknowledged, and keepalive probes
// an idle connection. The socket then fails with ETIMEDOUT. Nothing happens to a socket that is not TCP.
void DetectVanishedPeer(int fd, double seconds);

// Whole-buffer transfers on a socket, bounded by `deadline`. A closed connection raises RemoteFailure, a
// timeout TimeoutError, both naming `what`. While the socket is full SendAll waits in poll(), or, when
// `whileFull` is given, calls it with the milliseconds it may spend (a caller that must keep reading its
// own sockets meanwhile, so that two peers sending to each other never deadlock).
void SendAll(int fd, const void* data, size_t bytes, const Deadline& deadline, const std::string& what,
             const std::function<void(int ms)>& whileFull = nullptr);
void RecvAll(int fd, void* data, size_t bytes, const Deadline& deadline, const std::string& what);

// Room for the next bytes of a payload of `total` bytes (announced by a peer, so not trusted) of which `got`
// are in `buffer`: the buffer grows, doubling from 1 MiB, only once it is full, so an announcement of 2 GiB
// costs nothing until the bytes come. Returns how many bytes fit at buffer.data() + got.
size_t ReceiveRoom(std::vector<uint8_t>& buffer, size_t got, uint64_t total);

}  // namespace mori::core::net
