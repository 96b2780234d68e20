// Frame and hello validation of the socket bootstrap, and the unique id encoding.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../common/test_util.hpp"
#include "bootstrap_wire.hpp"
#include "socket.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/timeout.hpp"
#include "mori/core/unique_fd.hpp"

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

TEST(BootstrapWire, AbortReasonsAreShownPrintableAndBounded) {
  const std::string hostile("\x1b[2J\r\nroot \\ says\0!", 19);
  EXPECT_EQ(PrintableReason(hostile, hostile.size()), "\\x1b[2J\\x0d\\x0aroot \\x5c says\\x00!");
  EXPECT_EQ(PrintableReason("cut", 10), "cut [7 more bytes not shown]");
  // Escaping 4096 bytes would take 16 KiB: the text stops at the bound and says how much is left out.
  const std::string bells(kMaxAbortReason, '\a');
  const std::string shown = PrintableReason(bells, bells.size());
  const std::string tail = " [" + std::to_string(kMaxAbortReason - kMaxAbortReason / 4) + " more bytes not shown]";
  ASSERT_GE(shown.size(), tail.size());
  EXPECT_EQ(shown.size(), kMaxAbortReason + tail.size());
  EXPECT_EQ(shown.substr(shown.size() - tail.size()), tail);
  for (char c : shown) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << static_cast<int>(c);
}

net::WireAddress Wire(const std::string& hostPort) { return net::SocketAddress::Parse(hostPort).ToWire(); }

TEST(BootstrapWire, TablesNameConcreteAddressesAndThisRank) {
  const net::WireAddress self = Wire("127.0.0.1:40001");
  const std::vector<net::WireAddress> good{Wire("127.0.0.1:40000"), self, Wire("[::1]:40002")};
  EXPECT_EQ(CheckTable(good, 3, 1, self), "");
  EXPECT_NE(CheckTable(good, 4, 1, self).find("3 entries for a world of 4"), std::string::npos);
  std::vector<net::WireAddress> t = good;
  t[0] = Wire("0.0.0.0:40000");
  EXPECT_NE(CheckTable(t, 3, 1, self).find("rank 0's entry is the unspecified address"), std::string::npos);
  t = good;
  t[2] = Wire("[::]:40002");
  EXPECT_NE(CheckTable(t, 3, 1, self).find("rank 2's entry is the unspecified address"), std::string::npos);
  t = good;
  t[2].port = 0;
  EXPECT_NE(CheckTable(t, 3, 1, self).find("rank 2's entry has port 0"), std::string::npos);
  t = good;
  t[0].family = 1;  // AF_UNIX
  EXPECT_NE(CheckTable(t, 3, 1, self).find("address family 1"), std::string::npos);
  t = good;
  t[0].addr[9] = 0x55;
  EXPECT_NE(CheckTable(t, 3, 1, self).find("bytes beyond its address"), std::string::npos);
  t = good;
  t[0].scopeId = 2;
  EXPECT_NE(CheckTable(t, 3, 1, self).find("bytes beyond its address"), std::string::npos);
  t = good;
  t[1] = Wire("127.0.0.1:40009");
  EXPECT_NE(CheckTable(t, 3, 1, self).find("this rank's entry is 127.0.0.1:40009, but it registered 127.0.0.1:40001"),
            std::string::npos);
}

// A root played by the test: rank `rank` of `nRanks` registers with it in a thread, and gets `reply(hello)` as
// the answer (then the end of the connection). Returns "" when Initialize succeeded, else its error's text.
std::string RegisterAgainst(int rank, int nRanks, const std::function<std::vector<uint8_t>(const HelloPayload&)>& reply,
                            ErrorCode* code = nullptr) {
  net::SocketAddress rootAddr = net::SocketAddress::Parse("127.0.0.1:0");
  UniqueFd listener = net::Listen(rootAddr);
  const UniqueId id = SocketBootstrap::UniqueIdFromAddress(rootAddr.ToString());
  std::string error;
  std::thread rankThread([&] {
    try {
      SocketBootstrap b(rank, nRanks);
      b.Initialize(id, 5);
    } catch (const Error& e) {
      error = e.what();
      if (code != nullptr) *code = e.Code();
    }
  });
  const Deadline deadline = Deadline::After(5);
  UniqueFd conn = net::AcceptOne(listener.Get(), deadline);
  EXPECT_TRUE(conn) << "the rank never registered";
  if (conn) {
    FrameHeader h;
    HelloPayload hello;
    net::RecvAll(conn.Get(), &h, sizeof(h), deadline, "the rank");
    net::RecvAll(conn.Get(), &hello, sizeof(hello), deadline, "the rank");
    const std::vector<uint8_t> bytes = reply(hello);
    net::SendAll(conn.Get(), bytes.data(), bytes.size(), deadline, "the rank");
    shutdown(conn.Get(), SHUT_WR);
  }
  rankThread.join();
  return error;
}

std::vector<uint8_t> Frame(FrameType type, int tag, const void* payload, size_t bytes) {
  const FrameHeader h = MakeHeader(type, 0, tag, bytes);
  std::vector<uint8_t> b(sizeof(h) + bytes);
  std::memcpy(b.data(), &h, sizeof(h));
  if (bytes > 0) std::memcpy(b.data() + sizeof(h), payload, bytes);
  return b;
}

// fuzz_bootstrap_stream's first finding: the root's abort reason went into the rank's error text byte for byte,
// terminal escapes and line breaks included.
TEST(BootstrapRegistration, TheRootsAbortReasonIsReportedEscaped) {
  const std::string reason("\x1b]0;owned\x07\r\nrank 3 never came\0", 30);
  ErrorCode code = ErrorCode::Internal;
  const std::string error = RegisterAgainst(
      1, 4, [&](const HelloPayload&) { return Frame(FrameType::Abort, kAbortJob, reason.data(), reason.size()); },
      &code);
  EXPECT_EQ(code, ErrorCode::RemoteFailure);
  EXPECT_NE(error.find("the bootstrap root refused the job: \\x1b]0;owned\\x07\\x0d\\x0arank 3 never came\\x00"),
            std::string::npos)
      << error;
  for (char c : error) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << static_cast<int>(c) << " in: " << error;
}

// fuzz_bootstrap_stream's second finding: a table whose entries were not addresses a rank can be reached at (the
// unspecified address, port 0) or whose entry for this rank was not what it registered was taken.
TEST(BootstrapRegistration, ATableThatCannotBeTheRootsIsRefused) {
  const auto table = [](const HelloPayload& hello, const net::WireAddress& other) {
    std::vector<net::WireAddress> t{other, hello.listen};
    return Frame(FrameType::Table, 0, t.data(), t.size() * sizeof(net::WireAddress));
  };
  const std::pair<net::WireAddress, const char*> bad[] = {{Wire("0.0.0.0:29500"), "unspecified address"},
                                                          {Wire("127.0.0.1:0"), "port 0"}};
  for (const auto& entry : bad) {
    // Named, not a structured binding: C++17 lambdas cannot capture those (hipcc refuses).
    const net::WireAddress& other = entry.first;
    const char* why = entry.second;
    ErrorCode code = ErrorCode::Internal;
    const std::string error = RegisterAgainst(
        1, 2, [&](const HelloPayload& h) { return table(h, other); }, &code);
    EXPECT_EQ(code, ErrorCode::Protocol) << error;
    EXPECT_NE(error.find("sent an address table that is not the root's: rank 0's entry"), std::string::npos) << error;
    EXPECT_NE(error.find(why), std::string::npos) << error;
  }
  ErrorCode code = ErrorCode::Internal;
  std::string error = RegisterAgainst(
      1, 2,
      [&](const HelloPayload& h) {
        HelloPayload moved = h;
        moved.listen.port = static_cast<uint16_t>(h.listen.port + 1);
        return table(moved, Wire("127.0.0.1:29500"));
      },
      &code);
  EXPECT_EQ(code, ErrorCode::Protocol) << error;
  EXPECT_NE(error.find("this rank's entry is"), std::string::npos) << error;
  // The table the root sends is taken.
  EXPECT_EQ(RegisterAgainst(1, 2, [&](const HelloPayload& h) { return table(h, Wire("127.0.0.1:29500")); }), "");
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

uint64_t NonceOf(const UniqueId& id) {
  UniqueIdLayout l;
  std::memcpy(&l, id.bytes, sizeof(l));
  return l.nonce;
}

// The address alone gives the FNV-1a nonce anyone can compute (what jobs without a secret have always used).
TEST(UniqueIdTest, WithoutASecretTheNonceIsFnvOfTheAddress) {
  test::ScopedEnv unset("MORI_BOOTSTRAP_SECRET", nullptr);
  uint64_t fnv = 1469598103934665603ull;
  for (char c : std::string("10.2.3.4:5678")) fnv = (fnv ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  EXPECT_EQ(AddressNonce("10.2.3.4:5678", ""), fnv);
  EXPECT_EQ(NonceOf(SocketBootstrap::UniqueIdFromAddress("10.2.3.4:5678")), fnv);
}

// With MORI_BOOTSTRAP_SECRET the nonce depends on the secret and the address, agrees between ranks that share
// both, and the id carries neither the secret nor the address's public nonce.
TEST(UniqueIdTest, ASecretKeysTheNonce) {
  const std::string addr = "10.2.3.4:5678";
  const std::string secret = "correct-horse-battery-staple";
  uint64_t keyed = AddressNonce(addr, secret);
  EXPECT_NE(keyed, AddressNonce(addr, ""));
  EXPECT_EQ(keyed, AddressNonce(addr, secret));
  EXPECT_NE(keyed, AddressNonce(addr, secret + "!"));
  EXPECT_NE(keyed, AddressNonce(addr, "correct-horse-battery-stapl"));
  EXPECT_NE(keyed, AddressNonce("10.2.3.4:5679", secret));
  EXPECT_NE(keyed, AddressNonce(secret, addr));  // the two inputs are not interchangeable

  test::ScopedEnv set("MORI_BOOTSTRAP_SECRET", secret.c_str());
  UniqueId id = SocketBootstrap::UniqueIdFromAddress(addr);
  EXPECT_EQ(NonceOf(id), keyed);
  EXPECT_EQ(SocketBootstrap::UniqueIdAddress(id), addr);
  std::string bytes(reinterpret_cast<const char*>(id.bytes), sizeof(id.bytes));
  EXPECT_EQ(bytes.find("correct-horse"), std::string::npos);
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

// The port of an id's listener.
uint16_t PortOf(const UniqueId& id) { return net::SocketAddress::Parse(SocketBootstrap::UniqueIdAddress(id)).Port(); }

// The ports this process holds listening sockets at. Asked of the process's own descriptors, not by connecting:
// under `ctest -j` another test may bind a port the moment ours is closed, and a connect to it would then succeed.
std::set<uint16_t> ListeningPorts() {
  std::set<uint16_t> ports;
  for (int fd : test::ListeningFds()) ports.insert(net::LocalAddressOf(fd).Port());
  return ports;
}

bool Listening(const UniqueId& id) { return ListeningPorts().count(PortOf(id)) != 0; }

// Ids that no Initialize takes do not keep listeners without bound: past kMaxUnusedUniqueIds the oldest is
// closed, and ReleaseUniqueId closes one at once. Before, each kept a listening socket for the process's life.
// The kernel may give a new id the port of one closed a moment before, so listeners are counted by port (one
// socket per port) and a closed id whose port a newer id took is not asked about.
TEST(UniqueIdTest, UnusedIdsKeepBoundedListeners) {
  const size_t n = SocketBootstrap::kMaxUnusedUniqueIds + 6;
  std::vector<UniqueId> ids;
  for (size_t i = 0; i < n; ++i) ids.push_back(SocketBootstrap::CreateUniqueId());
  std::set<uint16_t> idPorts;
  for (const UniqueId& id : ids) idPorts.insert(PortOf(id));
  const std::set<uint16_t> listening = ListeningPorts();
  size_t open = 0;
  for (uint16_t port : idPorts) open += listening.count(port);
  EXPECT_EQ(open, SocketBootstrap::kMaxUnusedUniqueIds);
  // The newest kMaxUnusedUniqueIds ids listen, each at its own port.
  for (size_t i = n - SocketBootstrap::kMaxUnusedUniqueIds; i < n; ++i) {
    EXPECT_TRUE(listening.count(PortOf(ids[i])) != 0) << "id " << i << " of " << n << " does not listen";
  }
  // The oldest ones were closed, unless a newer id holds their port now.
  for (size_t i = 0; i < n - SocketBootstrap::kMaxUnusedUniqueIds; ++i) {
    bool reused = false;
    for (size_t j = i + 1; j < n; ++j) reused = reused || PortOf(ids[j]) == PortOf(ids[i]);
    if (!reused) {
      EXPECT_EQ(listening.count(PortOf(ids[i])), 0u) << "the closed id " << i << " still listens";
    }
  }
  SocketBootstrap::ReleaseUniqueId(ids.back());
  EXPECT_FALSE(Listening(ids.back())) << "a released id still listens";
  for (const UniqueId& id : ids) SocketBootstrap::ReleaseUniqueId(id);
  // An id that is used still works after all this.
  UniqueId used = SocketBootstrap::CreateUniqueId();
  SocketBootstrap single(0, 1);
  single.Initialize(used, 5);
  EXPECT_EQ(single.AllGatherValue(5)[0], 5);
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

namespace mori::core {
namespace {

// A bootstrap whose peer "sends" scripted bytes: what RecvBytes does with a hostile length prefix.
class ScriptedBootstrap : public Bootstrap {
 public:
  explicit ScriptedBootstrap(std::vector<std::vector<uint8_t>> script) : script_(std::move(script)) {}
  int GetRank() const override { return 0; }
  int GetNranks() const override { return 2; }
  void Send(const void* data, size_t bytes, int, int) override {
    const auto* p = static_cast<const uint8_t*>(data);
    sent_.push_back(bytes > 0 ? std::vector<uint8_t>(p, p + bytes) : std::vector<uint8_t>());
  }
  void Recv(void* data, size_t bytes, int, int) override {
    ASSERT_LT(next_, script_.size()) << "a receive the script did not expect";
    ASSERT_EQ(script_[next_].size(), bytes) << "receive " << next_;
    if (bytes > 0) std::memcpy(data, script_[next_].data(), bytes);  // an empty message has no buffer
    ++next_;
  }
  void AllGather(void*, size_t) override {}
  void Barrier() override {}
  void Broadcast(void*, size_t, int) override {}
  size_t received() const { return next_; }
  const std::vector<std::vector<uint8_t>>& sent() const { return sent_; }

 private:
  std::vector<std::vector<uint8_t>> script_;
  size_t next_ = 0;
  std::vector<std::vector<uint8_t>> sent_;
};

std::vector<uint8_t> Length(uint64_t n) {
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), &n, 8);
  return b;
}

TEST(BootstrapBytes, AnnouncedLengthsAboveTheBoundAreRefusedBeforeAllocating) {
  for (uint64_t n : {Bootstrap::kMaxBytesMessage + 1, uint64_t(1) << 40, ~uint64_t(0)}) {
    ScriptedBootstrap b({Length(n)});
    try {
      b.RecvBytes(1, 7);
      FAIL() << "a " << n << "-byte announcement was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::Protocol);
      EXPECT_NE(std::string(e.what()).find("rank 1 announced a " + std::to_string(n) + "-byte message"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(b.received(), 1u) << "nothing is read after the refused length";
  }
}

TEST(BootstrapBytes, MessagesUpToTheBoundRoundTrip) {
  std::vector<uint8_t> payload(1000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + 3);
  ScriptedBootstrap b({Length(payload.size()), payload, Length(0), {}});
  EXPECT_EQ(b.RecvBytes(1, 7), payload);
  EXPECT_TRUE(b.RecvBytes(1, 7).empty());
  b.SendBytes(payload, 1, 7);
  ASSERT_EQ(b.sent().size(), 2u);
  EXPECT_EQ(b.sent()[0], Length(payload.size()));
  EXPECT_EQ(b.sent()[1], payload);
  EXPECT_THROW(b.SendBytes(std::vector<uint8_t>(Bootstrap::kMaxBytesMessage + 1), 1, 7), Error);
}

}  // namespace
}  // namespace mori::core
