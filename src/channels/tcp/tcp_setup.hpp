// Setting up the sockets of a TCP link: listening per channel, and matching connections to channels with a
// validated hello (connector side) or accepting and checking them (acceptor side).
#pragma once

#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/timeout.hpp"
#include "mori/core/unique_fd.hpp"
#include "socket.hpp"
#include "tcp/tcp_link.hpp"
#include "tcp/tcp_wire.hpp"

namespace mori::core::tcp {

struct TcpListener::State {
  TcpLinkOptions options;
  TcpHandle handle;                 // this side's nonce, rank and listening addresses
  std::vector<UniqueFd> listeners;  // one per channel
  std::vector<std::string> channelIfnames;
};

struct EstablishedChannel {
  UniqueFd fd;
  std::string ifname;
  net::SocketAddress local;
  net::SocketAddress peer;
};

struct EstablishedChannels {
  std::vector<EstablishedChannel> channels;
  int refused = 0;  // connections refused at the listeners
};

// An error's message without the "mori <kind>: " that Error puts in front, for wrapping it in another.
std::string MessageOf(const Error& e);
// Throws Error(code, message), as a TimeoutError when the code is Timeout.
[[noreturn]] void ThrowError(ErrorCode code, const std::string& message);

// Listens on every channel's address and makes the handle with a fresh nonce.
void OpenListeners(TcpListener::State& state, int rank);

// Whether this side accepts (the lower (rank, nonce) does) or connects.
bool IsAcceptor(const TcpHandle& mine, const TcpHandle& peer);

// Connects or accepts the channels; throws naming the channel and the peer on failure or timeout.
EstablishedChannels EstablishChannels(TcpListener::State& state, const TcpHandle& peer, const Deadline& deadline);

}  // namespace mori::core::tcp
