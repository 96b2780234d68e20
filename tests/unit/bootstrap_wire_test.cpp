// Frame and hello validation of the socket bootstrap, and the unique id encoding.
#include <gtest/gtest.h>

#include <cstring>

#include "bootstrap_wire.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"

namespace mori::core::bootstrap_wire {
namespace {

FrameHeader Good() {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kVersion;
  h.type = static_cast<uint16_t>(FrameType::Data);
  h.srcRank = 1;
  h.tag = 3;
  h.length = 100;
  return h;
}

TEST(BootstrapWire, AcceptsAWellFormedHeader) { EXPECT_EQ(CheckHeader(Good()), ""); }

TEST(BootstrapWire, RejectsForeignOrCorruptHeaders) {
  FrameHeader h = Good();
  h.magic = 0x20544547;  // "GET " of an HTTP client
  EXPECT_NE(CheckHeader(h).find("bad magic"), std::string::npos);
  h = Good();
  h.version = 99;
  EXPECT_NE(CheckHeader(h).find("version 99"), std::string::npos);
  h = Good();
  h.type = 0;
  EXPECT_NE(CheckHeader(h).find("unknown frame type"), std::string::npos);
  h.type = 77;
  EXPECT_NE(CheckHeader(h).find("unknown frame type"), std::string::npos);
  h = Good();
  h.length = kMaxPayload + 1;
  EXPECT_NE(CheckHeader(h).find("beyond"), std::string::npos);
  h = Good();
  h.type = static_cast<uint16_t>(FrameType::Hello);
  h.length = 12;
  EXPECT_NE(CheckHeader(h).find("hello of 12 bytes"), std::string::npos);
}

TEST(BootstrapWire, HelloChecksJobAndWorld) {
  HelloPayload hello{};
  hello.nonce = 42;
  hello.rank = 2;
  hello.nRanks = 4;
  hello.purpose = static_cast<uint32_t>(HelloPurpose::Data);
  EXPECT_EQ(CheckHello(hello, 42, 4), "");
  EXPECT_NE(CheckHello(hello, 43, 4).find("another job"), std::string::npos);
  EXPECT_NE(CheckHello(hello, 42, 8).find("world size 4"), std::string::npos);
  hello.rank = 4;
  EXPECT_NE(CheckHello(hello, 42, 4).find("outside the world"), std::string::npos);
  hello.rank = 1;
  hello.purpose = 9;
  EXPECT_NE(CheckHello(hello, 42, 4).find("purpose"), std::string::npos);
}

TEST(UniqueIdTest, CarriesTheRootAddress) {
  UniqueId id = SocketBootstrap::UniqueIdFromAddress("10.2.3.4:5678");
  EXPECT_EQ(SocketBootstrap::UniqueIdAddress(id), "10.2.3.4:5678");
  // Both ranks derive the same id from the same text, so the nonce agrees without communication.
  UniqueId again = SocketBootstrap::UniqueIdFromAddress("10.2.3.4:5678");
  EXPECT_EQ(std::memcmp(id.bytes, again.bytes, sizeof(id.bytes)), 0);
  EXPECT_THROW(SocketBootstrap::UniqueIdFromAddress("0.0.0.0:5678"), Error);
  EXPECT_THROW(SocketBootstrap::UniqueIdFromAddress("10.2.3.4:0"), Error);
}

TEST(UniqueIdTest, GarbageIdsAreRefused) {
  UniqueId junk;
  std::memset(junk.bytes, 0xab, sizeof(junk.bytes));
  EXPECT_THROW(SocketBootstrap::UniqueIdAddress(junk), Error);
  SocketBootstrap bootstrap(0, 2);
  try {
    bootstrap.Initialize(junk, 1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
    EXPECT_NE(std::string(e.what()).find("not a mori unique id"), std::string::npos) << e.what();
  }
}

TEST(UniqueIdTest, CreatedIdsListenAtOnce) {
  UniqueId id = SocketBootstrap::CreateUniqueId();
  std::string addr = SocketBootstrap::UniqueIdAddress(id);
  EXPECT_EQ(addr.find(":0"), std::string::npos) << addr;  // a real port was given
  SocketBootstrap single(0, 1);
  single.Initialize(id, 5);  // adopts the listener; a job of one completes at once
  EXPECT_EQ(single.GetNranks(), 1);
  int v = 5;
  single.Broadcast(&v, sizeof(v), 0);
  single.Barrier();
  auto all = single.AllGatherValue(77);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0], 77);
  single.Send(&v, sizeof(v), 0, 1);
  int w = 0;
  single.Recv(&w, sizeof(w), 0, 1);
  EXPECT_EQ(w, 5);
}

TEST(UniqueIdTest, RankAndSizeAreValidated) {
  EXPECT_THROW(SocketBootstrap(2, 2), Error);
  EXPECT_THROW(SocketBootstrap(-1, 2), Error);
  EXPECT_THROW(SocketBootstrap(0, 0), Error);
  SocketBootstrap b(0, 1);
  EXPECT_THROW(b.Barrier(), Error);  // before Initialize
}

}  // namespace
}  // namespace mori::core::bootstrap_wire
