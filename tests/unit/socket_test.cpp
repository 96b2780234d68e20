// Socket helpers: address and endpoint parsing, interface lookup, bounded transfers and their errors.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <thread>

#include "../common/test_util.hpp"
#include "mori/core/errors.hpp"
#include "socket.hpp"

namespace mori::core::net {
namespace {

TEST(SocketAddress, ParsesIpv4Ipv6AndHostNames) {
  auto a = SocketAddress::Parse("10.1.2.3:5000");
  EXPECT_EQ(a.Family(), AF_INET);
  EXPECT_EQ(a.Port(), 5000);
  EXPECT_EQ(a.ToString(), "10.1.2.3:5000");
  auto b = SocketAddress::Parse("[::1]:6000");
  EXPECT_EQ(b.Family(), AF_INET6);
  EXPECT_TRUE(b.IsLoopback());
  EXPECT_EQ(b.ToString(), "[::1]:6000");
  auto c = SocketAddress::Parse("localhost:7000");
  EXPECT_TRUE(c.IsLoopback());
  EXPECT_EQ(c.Port(), 7000);
}

TEST(SocketAddress, RejectsMalformedText) {
  for (const char* bad : {"10.1.2.3", "10.1.2.3:", "10.1.2.3:70000", "10.1.2.3:-1", ":80", "[::1:80", "[::1]80",
                          "no.such.host.invalid:80", "10.1.2.3:12ab"}) {
    EXPECT_THROW(SocketAddress::Parse(bad), Error) << bad;
  }
}

TEST(SocketAddress, WireRoundTrip) {
  for (const char* text : {"192.168.7.9:1234", "[fe80::1]:99", "[::1]:65535"}) {
    auto a = SocketAddress::Parse(text);
    auto b = SocketAddress::FromWire(a.ToWire());
    EXPECT_EQ(a.ToString(), b.ToString());
  }
  WireAddress junk{};
  junk.family = 77;
  EXPECT_THROW(SocketAddress::FromWire(junk), Error);
}

TEST(Endpoint, AcceptsInterfacePrefix) {
  auto e1 = ParseEndpoint("10.0.0.1:50505");
  EXPECT_TRUE(e1.ifname.empty());
  EXPECT_EQ(e1.address.ToString(), "10.0.0.1:50505");
  auto e2 = ParseEndpoint("eth0:10.0.0.1:50505");
  EXPECT_EQ(e2.ifname, "eth0");
  EXPECT_EQ(e2.address.ToString(), "10.0.0.1:50505");
  auto e3 = ParseEndpoint("[::1]:9");
  EXPECT_TRUE(e3.ifname.empty());
  auto e4 = ParseEndpoint("lo:[::1]:9");
  EXPECT_EQ(e4.ifname, "lo");
  EXPECT_THROW(ParseEndpoint("lo:::1:9"), Error);
}

TEST(Interfaces, LoopbackIsListedAndUnknownNamesAreErrors) {
  bool sawLoopback = false;
  for (const auto& i : ListInterfaceAddresses()) sawLoopback |= i.loopback;
  EXPECT_TRUE(sawLoopback);
  EXPECT_TRUE(InterfaceAddressOf("lo").IsLoopback());
  try {
    InterfaceAddressOf("nosuchif0");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nosuchif0"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("lo"), std::string::npos) << "the message lists the interfaces present";
  }
  test::ScopedEnv ifname("MORI_SOCKET_IFNAME", "lo,nosuchif0");
  EXPECT_TRUE(PickLocalAddress().IsLoopback());
}

TEST(Socket, ConnectSendReceiveAndTimeouts) {
  SocketAddress addr = SocketAddress::Parse("127.0.0.1:0");
  UniqueFd listener = Listen(addr);
  EXPECT_NE(addr.Port(), 0);
  std::vector<uint8_t> big(8 << 20);
  test::FillPattern(big.data(), big.size(), 3);
  std::thread peer([&] {
    UniqueFd c = ConnectWithRetry(addr, Deadline::After(10), "test peer");
    SendAll(c.Get(), big.data(), big.size(), Deadline::After(20), "test receiver");
  });
  UniqueFd s = AcceptOne(listener.Get(), Deadline::After(10));
  ASSERT_TRUE(s.Valid());
  std::vector<uint8_t> got(big.size());
  RecvAll(s.Get(), got.data(), got.size(), Deadline::After(20), "test sender");
  peer.join();
  EXPECT_EQ(test::FirstPatternMismatch(got.data(), got.size(), 3), got.size());

  // The sender is gone: reading more reports the closed connection, naming the peer.
  uint8_t extra;
  try {
    RecvAll(s.Get(), &extra, 1, Deadline::After(5), "rank 7");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::RemoteFailure);
    EXPECT_NE(std::string(e.what()).find("rank 7 closed the connection"), std::string::npos) << e.what();
  }
}

TEST(Socket, ReceiveFromASilentPeerTimesOut) {
  SocketAddress addr = SocketAddress::Parse("127.0.0.1:0");
  UniqueFd listener = Listen(addr);
  UniqueFd c = ConnectWithRetry(addr, Deadline::After(5), "listener");
  UniqueFd s = AcceptOne(listener.Get(), Deadline::After(5));
  uint8_t b;
  EXPECT_THROW(RecvAll(s.Get(), &b, 1, Deadline::After(0.2), "silent peer"), TimeoutError);
  EXPECT_FALSE(AcceptOne(listener.Get(), Deadline::After(0.1)).Valid());
}

TEST(Socket, ConnectingToNobodyTimesOutNamingThePeer) {
  SocketAddress addr = SocketAddress::Parse("127.0.0.1:" + std::to_string(test::FreeTcpPort()));
  try {
    ConnectWithRetry(addr, Deadline::After(0.3), "rank 0");
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 at 127.0.0.1:"), std::string::npos) << e.what();
  }
}

TEST(Socket, APeerWhoseListenerIsGoneIsNamedBeforeTheDeadline) {
  SocketAddress addr = SocketAddress::Parse("127.0.0.1:" + std::to_string(test::FreeTcpPort()));
  const auto start = std::chrono::steady_clock::now();
  try {
    ConnectWithRetry(addr, Deadline::After(30), "rank 3", {std::nullopt, 0.3});
    FAIL();
  } catch (const TimeoutError& e) {
    FAIL() << "waited for the whole deadline: " << e.what();
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::RemoteFailure);
    EXPECT_NE(std::string(e.what()).find("rank 3 at 127.0.0.1:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("refused every connection"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  // A listener that comes within the grace is reached.
  SocketAddress late = SocketAddress::Parse("127.0.0.1:" + std::to_string(test::FreeTcpPort()));
  std::thread listen([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    SocketAddress a = late;
    UniqueFd l = Listen(a);
    UniqueFd s = AcceptOne(l.Get(), Deadline::After(10));
    EXPECT_TRUE(s.Valid());
  });
  UniqueFd c = ConnectWithRetry(late, Deadline::After(10), "rank 4", {std::nullopt, 5});
  EXPECT_TRUE(c.Valid());
  listen.join();
}

}  // namespace
}  // namespace mori::core::net
