// The multi-channel TCP transport's bytes: handle encoding round trips and every malformed form refused; frame
// and hello validation; the options read from EndpointConfig and the MORI_TCP_* variables.
#include "tcp/tcp_wire.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/errors.hpp"
#include "tcp/tcp_link.hpp"
#include "tcp/tcp_registry.hpp"

namespace mori::core::tcp {
namespace {

// Runs `f`, expecting Error(code) whose message contains `part`.
template <typename F>
void ExpectError(F&& f, ErrorCode code, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "message: " << e.what();
  }
}

TcpHandle Sample(int count) {
  TcpHandle h;
  h.nonce = 0x1234567890abcdefull;
  h.rank = 3;
  for (int i = 0; i < count; ++i) {
    std::string text = (i % 2 == 0) ? "10.1.2." + std::to_string(i + 1) + ":" + std::to_string(40000 + i)
                                    : "[fd00::" + std::to_string(i) + "]:" + std::to_string(50000 + i);
    h.addresses.push_back(net::SocketAddress::Parse(text));
  }
  return h;
}

TEST(TcpWire, HandleRoundTrips) {
  for (int count : {1, 2, 7, kMaxChannels}) {
    TcpHandle h = Sample(count);
    std::vector<uint8_t> bytes = EncodeHandle(h);
    EXPECT_EQ(bytes.size(), sizeof(HandleHeader) + count * sizeof(net::WireAddress));
    TcpHandle back = DecodeHandle(bytes);
    EXPECT_EQ(back.nonce, h.nonce);
    EXPECT_EQ(back.rank, h.rank);
    ASSERT_EQ(back.addresses.size(), h.addresses.size());
    for (int i = 0; i < count; ++i) {
      EXPECT_EQ(back.addresses[i].ToString(), h.addresses[i].ToString()) << "channel " << i;
      EXPECT_EQ(back.addresses[i].Family(), h.addresses[i].Family());
    }
  }
}

TEST(TcpWire, EncodeRefusesImpossibleHandles) {
  ExpectError([] { EncodeHandle(Sample(0)); }, ErrorCode::InvalidUsage, "1 to 64");
  ExpectError([] { EncodeHandle(Sample(kMaxChannels + 1)); }, ErrorCode::InvalidUsage, "1 to 64");
}

TEST(TcpWire, EveryMalformedHandleIsRefused) {
  const std::vector<uint8_t> good = EncodeHandle(Sample(4));
  auto header = [&](std::vector<uint8_t> b, auto edit) {
    HandleHeader h;
    std::memcpy(&h, b.data(), sizeof(h));
    edit(h);
    std::memcpy(b.data(), &h, sizeof(h));
    return b;
  };
  auto refused = [](const std::vector<uint8_t>& b, const std::string& part) {
    ExpectError([&] { DecodeHandle(b); }, ErrorCode::Protocol, part);
  };

  refused({}, "shorter than its 24-byte header");
  refused(std::vector<uint8_t>(good.begin(), good.begin() + 10), "shorter than its 24-byte header");
  refused(header(good, [](HandleHeader& h) { h.magic = 0x20544547; }), "bad magic 0x20544547");
  refused(header(good, [](HandleHeader& h) { h.version = 7; }), "version 7");
  refused(header(good, [](HandleHeader& h) { h.count = 0; }), "0 channels, outside [1, 64]");
  refused(header(good, [](HandleHeader& h) { h.count = 65; }), "65 channels, outside [1, 64]");
  refused(header(good, [](HandleHeader& h) { h.count = 0xffff; }), "65535 channels");
  refused(header(good, [](HandleHeader& h) { h.nonce = 0; }), "zero connection nonce");
  refused(header(good, [](HandleHeader& h) { h.rank = -2; }), "rank -2");
  // Truncated: one byte short, and a whole entry short (the count says 4).
  refused(std::vector<uint8_t>(good.begin(), good.end() - 1), "truncated");
  refused(std::vector<uint8_t>(good.begin(), good.end() - sizeof(net::WireAddress)), "truncated");
  // Trailing bytes: one more byte, and a count smaller than the entries present.
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  refused(longer, "trailing bytes");
  refused(header(good, [](HandleHeader& h) { h.count = 3; }), "trailing bytes");
  // Entries: unknown family, port 0.
  std::vector<uint8_t> badFamily = good;
  net::WireAddress w;
  std::memcpy(&w, badFamily.data() + sizeof(HandleHeader) + 2 * sizeof(w), sizeof(w));
  w.family = 7;
  std::memcpy(badFamily.data() + sizeof(HandleHeader) + 2 * sizeof(w), &w, sizeof(w));
  refused(badFamily, "channel 2 has unknown address family 7");
  std::vector<uint8_t> noPort = good;
  std::memcpy(&w, noPort.data() + sizeof(HandleHeader), sizeof(w));
  w.port = 0;
  std::memcpy(noPort.data() + sizeof(HandleHeader), &w, sizeof(w));
  refused(noPort, "channel 0 has port 0");
  // Every strict prefix of a good handle is refused.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(DecodeHandle(std::vector<uint8_t>(good.begin(), good.begin() + n)), Error) << n << " bytes";
  }
}

FrameHeader Good(FrameType type) {
  FrameHeader h = MakeFrame(type);
  switch (type) {
    case FrameType::Hello:
      h.length = sizeof(HelloPayload);
      break;
    case FrameType::Write:
    case FrameType::ReadData:
      h.length = 1000;
      break;
    case FrameType::Fail:
      h.length = 20;
      break;
    case FrameType::ReadRequest:
      h.arg0 = 4096;
      break;
    default:
      break;
  }
  if (IsOrderedFrame(h.type)) h.seq = 5;
  return h;
}

TEST(TcpWire, FramesOfEveryTypeAreAccepted) {
  for (uint16_t t = 1; t <= kLastFrameType; ++t) {
    FrameHeader h = Good(static_cast<FrameType>(t));
    EXPECT_EQ(CheckFrame(h), "") << FrameTypeName(t);
    EXPECT_STRNE(FrameTypeName(t), "unknown");
  }
  FrameHeader h = Good(FrameType::Write);
  h.length = static_cast<uint32_t>(kMaxChunkBytes);
  EXPECT_EQ(CheckFrame(h), "");
  h.length = 1;
  EXPECT_EQ(CheckFrame(h), "");
  EXPECT_TRUE(IsOrderedFrame(static_cast<uint16_t>(FrameType::Update)));
  EXPECT_FALSE(IsOrderedFrame(static_cast<uint16_t>(FrameType::Ack)));
  EXPECT_FALSE(IsOrderedFrame(static_cast<uint16_t>(FrameType::ReadData)));
}

TEST(TcpWire, MalformedFramesAreRefusedWithTheReason) {
  auto bad = [](FrameHeader h, const std::string& part) {
    std::string why = CheckFrame(h);
    EXPECT_NE(why.find(part), std::string::npos) << "got '" << why << "', expected '" << part << "'";
  };
  FrameHeader h = Good(FrameType::Write);
  h.magic = 0x20544547;
  bad(h, "bad magic 0x20544547");
  h = Good(FrameType::Write);
  h.version = 2;
  bad(h, "version 2");
  h.version = kWireVersion;
  h.type = 0;
  bad(h, "unknown frame type 0");
  h.type = kLastFrameType + 1;
  bad(h, "unknown frame type 13");
  h = Good(FrameType::Write);
  h.length = 0;
  bad(h, "Write frame of 0 bytes");
  h.length = static_cast<uint32_t>(kMaxChunkBytes + 1);
  bad(h, "outside [1, 67108864]");
  h = Good(FrameType::ReadData);
  h.length = 0;
  bad(h, "ReadData frame of 0 bytes");
  h = Good(FrameType::ReadRequest);
  h.arg0 = kMaxChunkBytes + 1;
  bad(h, "beyond a chunk");
  h = Good(FrameType::Hello);
  h.length = 31;
  bad(h, "Hello frame of 31 bytes");
  h = Good(FrameType::Fail);
  h.length = kMaxFailReasonBytes + 1;
  bad(h, "beyond the 4096-byte limit");
  h = Good(FrameType::Ack);
  h.length = 8;
  bad(h, "Ack frame carries 8 payload bytes");
  h = Good(FrameType::Update);
  h.length = 8;
  bad(h, "Update frame carries 8 payload bytes");
  h = Good(FrameType::ReadRequest);
  h.arg0 = 0;
  bad(h, "ReadRequest of 0 bytes");
  h = Good(FrameType::ReadRequest);
  h.length = 4;
  bad(h, "ReadRequest frame carries 4 payload bytes");
  h = Good(FrameType::FetchAdd);
  h.seq = 0;
  bad(h, "sequence number 0");
  // Bytes of another protocol read as a header.
  const char http[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n.....................................";
  std::memcpy(&h, http, sizeof(h));
  bad(h, "bad magic");
}

TEST(TcpWire, HelloNamesWhatIsWrong) {
  HelloPayload hello{};
  hello.nonce = 11;
  hello.senderNonce = 22;
  hello.channel = 3;
  hello.numChannels = 4;
  hello.rank = 1;
  EXPECT_EQ(CheckHello(hello, 11, 22, 4), "");
  EXPECT_NE(CheckHello(hello, 12, 22, 4).find("stray or foreign"), std::string::npos);
  EXPECT_NE(CheckHello(hello, 11, 23, 4).find("peer's handle names"), std::string::npos);
  EXPECT_NE(CheckHello(hello, 11, 22, 8).find("hello for 4 channels, this side has 8"), std::string::npos);
  hello.channel = 4;
  EXPECT_NE(CheckHello(hello, 11, 22, 4).find("channel 4 of 4"), std::string::npos);
}

TEST(TcpOptions, DefaultsComeFromTheEnvironmentAndConfigOverrides) {
  test::ScopedEnv c("MORI_TCP_CHANNELS", nullptr);
  test::ScopedEnv w("MORI_TCP_WINDOW", nullptr);
  test::ScopedEnv s("MORI_TCP_CHUNK_SIZE", nullptr);
  test::ScopedEnv i("MORI_SOCKET_IFNAME", nullptr);
  EndpointConfig::Tcp tcp;
  TcpLinkOptions o = TcpLinkOptions::Resolve(tcp);
  EXPECT_EQ(o.numChannels, 4);
  EXPECT_EQ(o.windowChunks, 16);
  EXPECT_EQ(o.chunkBytes, 512u << 10);
  EXPECT_TRUE(o.ifnames.empty());
  {
    test::ScopedEnv c2("MORI_TCP_CHANNELS", "8");
    test::ScopedEnv w2("MORI_TCP_WINDOW", "1");
    test::ScopedEnv s2("MORI_TCP_CHUNK_SIZE", "1m");
    test::ScopedEnv i2("MORI_SOCKET_IFNAME", "eth1, eth2,,eth3");
    o = TcpLinkOptions::Resolve(tcp, 2);
    EXPECT_EQ(o.numChannels, 8);
    EXPECT_EQ(o.windowChunks, 1);
    EXPECT_EQ(o.chunkBytes, 1u << 20);
    EXPECT_EQ(o.ifnames, (std::vector<std::string>{"eth1", "eth2", "eth3"}));
    EXPECT_EQ(o.device, 2);
    tcp.numChannels = 2;
    tcp.windowChunks = 3;
    tcp.chunkBytes = 1000;
    tcp.ifnames = "lo";
    o = TcpLinkOptions::Resolve(tcp);
    EXPECT_EQ(o.numChannels, 2);
    EXPECT_EQ(o.windowChunks, 3);
    EXPECT_EQ(o.chunkBytes, 1000u);
    EXPECT_EQ(o.ifnames, std::vector<std::string>{"lo"});
  }
}

TEST(TcpOptions, OutOfRangeValuesAreRefused) {
  EndpointConfig::Tcp tcp;
  tcp.numChannels = 65;
  ExpectError([&] { TcpLinkOptions::Resolve(tcp); }, ErrorCode::InvalidUsage, "1 to 64 channels, not 65");
  tcp.numChannels = -1;
  ExpectError([&] { TcpLinkOptions::Resolve(tcp); }, ErrorCode::InvalidUsage, "not -1");
  tcp = {};
  tcp.windowChunks = 5000;
  ExpectError([&] { TcpLinkOptions::Resolve(tcp); }, ErrorCode::InvalidUsage, "window of 5000");
  tcp = {};
  tcp.chunkBytes = 10;
  ExpectError([&] { TcpLinkOptions::Resolve(tcp); }, ErrorCode::InvalidUsage, "chunk of 10 bytes");
  tcp.chunkBytes = kMaxChunkBytes + 1;
  ExpectError([&] { TcpLinkOptions::Resolve(tcp); }, ErrorCode::InvalidUsage, "MORI_TCP_CHUNK_SIZE");
  tcp = {};
  tcp.windowChunks = 5;  // 5 x 64 MiB: more read data than a peer holds for a connection
  tcp.chunkBytes = kMaxChunkBytes;
  ExpectError([&] { TcpLinkOptions::Resolve(tcp); }, ErrorCode::InvalidUsage, "MORI_TCP_WINDOW x MORI_TCP_CHUNK_SIZE");
  tcp.windowChunks = 4;
  EXPECT_EQ(TcpLinkOptions::Resolve(tcp).windowChunks, 4);
  test::ScopedEnv c("MORI_TCP_CHANNELS", "0");
  ExpectError([] { TcpLinkOptions::Resolve(EndpointConfig::Tcp{}); }, ErrorCode::InvalidUsage, "not 0");
}

TEST(TcpListener, ListensOnEveryChannelAndHandsOutAValidHandle) {
  TcpLinkOptions o;
  o.numChannels = 3;
  o.ifnames = {"lo"};
  TcpListener listener(o, 5);
  TcpHandle h = DecodeHandle(listener.HandleBytes());
  EXPECT_EQ(h.rank, 5);
  EXPECT_NE(h.nonce, 0u);
  ASSERT_EQ(h.addresses.size(), 3u);
  for (const auto& a : h.addresses) {
    EXPECT_TRUE(a.IsLoopback()) << a.ToString();
    EXPECT_NE(a.Port(), 0);
  }
  EXPECT_NE(h.addresses[0].Port(), h.addresses[1].Port());
  o.ifnames = {"no_such_if0"};
  ExpectError([&] { TcpListener bad(o, 0); }, ErrorCode::InvalidUsage, "no_such_if0");
}

// A receiver holds a registration while it writes: deregistration waits for it, and what asks for the key
// meanwhile or after is refused naming it.
TEST(TcpRegistry, DeregisterWaitsForTargetsInUseAndRefusesNewOnes) {
  std::vector<uint8_t> memory(256);
  const uint32_t key = RegisterTcpMemory(memory.data(), memory.size(), false);
  ASSERT_NE(key, 0u);
  GrantTcpMemory(key, 1);
  TcpTarget held = ResolveTcpMemory(key, 16, 32, 1);
  EXPECT_EQ(held.Ptr(), memory.data() + 16);
  EXPECT_FALSE(held.DeviceMemory());
  auto refused = [&](uint64_t offset, uint64_t bytes, const char* why) {
    try {
      (void)ResolveTcpMemory(key, offset, bytes, 1);
      ADD_FAILURE() << "resolved key " << key << " [" << offset << ", +" << bytes << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::Protocol);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("key " + std::to_string(key)), std::string::npos) << e.what();
    }
  };
  refused(250, 7, "holds 256 bytes");
  std::atomic<bool> done{false};
  std::thread deregister([&] {
    DeregisterTcpMemory(key);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(done.load()) << "deregistered while a target was held";
  refused(0, 8, "being deregistered");
  // The holder finishes writing, then lets go.
  std::memset(held.Ptr(), 0x5c, 32);
  TcpTarget moved = std::move(held);
  held.Release();  // a moved-from target holds nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(done.load()) << "the moved-to target no longer held the registration";
  moved.Release();
  deregister.join();
  EXPECT_TRUE(done.load());
  refused(0, 8, "not registered");
  EXPECT_EQ(memory[15], 0u);
  EXPECT_EQ(memory[16], 0x5c);
  EXPECT_EQ(memory[48], 0u);
  DeregisterTcpMemory(key);  // again: nothing to do
}

// Keys are random, and memory answers only the ranks it was given to, with the same refusal as a key that is
// not registered at all (no oracle of the keys in use).
TEST(TcpRegistry, KeysAreRandomAndScopedToTheRanksGranted) {
  std::vector<uint8_t> a(64), b(64);
  std::vector<uint32_t> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(RegisterTcpMemory(a.data(), a.size(), false));
  int consecutive = 0;
  for (size_t i = 1; i < keys.size(); ++i) consecutive += keys[i] == keys[i - 1] + 1;
  EXPECT_LT(consecutive, 2) << "keys look sequential";
  for (uint32_t k : keys) EXPECT_NE(k, 0u);

  const uint32_t key = RegisterTcpMemory(b.data(), b.size(), false);
  auto refusal = [&](uint32_t k, int rank) -> std::string {
    try {
      (void)ResolveTcpMemory(k, 0, 8, rank);
      return "resolved";
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::Protocol);
      return e.what();
    }
  };
  EXPECT_NE(refusal(key, 2).find("not registered here for rank 2"), std::string::npos);  // nobody granted yet
  GrantTcpMemory(key, 3);
  EXPECT_EQ(refusal(key, 3), "resolved");
  const std::string notGranted = refusal(key, 2), unknown = refusal(key ^ 0x80000000u, 2);
  EXPECT_NE(notGranted.find("not registered here for rank 2"), std::string::npos) << notGranted;
  EXPECT_NE(unknown.find("not registered here for rank 2"), std::string::npos) << unknown;
  GrantTcpMemory(key, kAnyTcpPeer);
  EXPECT_EQ(refusal(key, 2), "resolved");
  EXPECT_EQ(refusal(key, 7), "resolved");
  for (uint32_t k : keys) DeregisterTcpMemory(k);
  DeregisterTcpMemory(key);
}

}  // namespace
}  // namespace mori::core::tcp
