// The TCP link's receiver against a peer that sends raw frames: the test accepts nothing and runs no second link,
// it connects to the link's listeners itself, says hello as a peer would, and puts frames of its own making on the
// channels. Cases found by fuzz_tcp_stream (docs/FUZZ.md).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mori/core/errors.hpp"
#include "tcp/tcp_link.hpp"
#include "tcp/tcp_registry.hpp"
#include "tcp/tcp_wire.hpp"

namespace mori::core::tcp {
namespace {

constexpr uint64_t kPeerNonce = 0x7465737470656572ull;

// A link of rank 0 whose channels this test holds the other ends of, as rank 1.
struct RawPeer {
  std::unique_ptr<TcpLink> link;
  std::vector<int> fds;

  explicit RawPeer(int channels) {
    TcpLinkOptions o;
    o.numChannels = channels;
    o.ifnames = {"lo"};
    TcpListener listener(o, 0);
    TcpHandle peer;
    peer.nonce = kPeerNonce;
    peer.rank = 1;
    peer.addresses = listener.Handle().addresses;  // never dialled: rank 0 accepts
    for (int c = 0; c < channels; ++c) {
      const net::SocketAddress& to = listener.Handle().addresses[static_cast<size_t>(c)];
      int fd = socket(to.Family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
      EXPECT_EQ(connect(fd, to.Sockaddr(), to.Length()), 0) << std::strerror(errno);  // the backlog takes it
      FrameHeader h = MakeFrame(FrameType::Hello);
      h.length = sizeof(HelloPayload);
      HelloPayload hello{};
      hello.nonce = listener.Handle().nonce;
      hello.senderNonce = kPeerNonce;
      hello.channel = static_cast<uint32_t>(c);
      hello.numChannels = static_cast<uint32_t>(channels);
      hello.rank = 1;
      Send(fd, &h, sizeof(h));
      Send(fd, &hello, sizeof(hello));
      fds.push_back(fd);
    }
    link = std::make_unique<TcpLink>(std::move(listener), EncodeHandle(peer), 1, Deadline::After(10));
  }
  ~RawPeer() {
    link.reset();
    for (int fd : fds) close(fd);
  }

  static void Send(int fd, const void* data, size_t bytes) {
    ASSERT_EQ(send(fd, data, bytes, MSG_NOSIGNAL), static_cast<ssize_t>(bytes)) << std::strerror(errno);
  }

  // Waits (at most `seconds`) for the link to fail; returns how long it took.
  double WaitFailed(double seconds) {
    const auto start = std::chrono::steady_clock::now();
    const auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    while (!link->Failed() && since() < seconds) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return since();
  }
};

// A word operation or read travels on channel 0 after every Write chunk of channel 0 issued before it, so the count
// it carries says exactly how many of channel 0's chunks came first. One that counts chunks channel 0 never carried
// is corrupt: it used to hold channel 0's receiver for MORI_TIMEOUT_S (waiting for chunks that could only come
// after it) and fail the link as a timeout; a count near 2^64 wrapped and was not waited for at all. Both fail the
// link at once now, naming the count, and write nothing.
TEST(TcpReceiver, AnOrderedFrameCountingWritesChannel0NeverCarriedFailsAtOnce) {
  for (int channels : {1, 2}) {
    for (uint64_t before : {uint64_t{5}, ~uint64_t{0}}) {
      SCOPED_TRACE("channels " + std::to_string(channels) + ", before " + std::to_string(before));
      std::vector<uint8_t> memory(64);
      for (size_t i = 0; i < memory.size(); ++i) memory[i] = static_cast<uint8_t>(0x40 + i);
      const std::vector<uint8_t> original = memory;
      const uint32_t key = RegisterTcpMemory(memory.data(), memory.size(), false);
      GrantTcpMemory(key, 1);
      {
        RawPeer peer(channels);
        FrameHeader h = MakeFrame(FrameType::Update);
        h.key = key;
        h.offset = 8;
        h.seq = 1;
        h.before = before;
        h.arg0 = 0x1111111111111111ull;
        RawPeer::Send(peer.fds[0], &h, sizeof(h));
        EXPECT_LT(peer.WaitFailed(10), 5.0) << "the receiver waited for chunks that cannot come";
        try {
          peer.link->Flush(0);
          ADD_FAILURE() << "the link did not fail";
        } catch (const Error& e) {
          EXPECT_EQ(e.Code(), ErrorCode::Protocol) << e.what();
          EXPECT_NE(std::string(e.what()).find("counts " + std::to_string(before) + " Write chunks"), std::string::npos)
              << e.what();
        }
      }
      DeregisterTcpMemory(key);
      EXPECT_EQ(memory, original);
    }
  }
}

}  // namespace
}  // namespace mori::core::tcp
