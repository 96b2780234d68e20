// The Tcp connection of the channel layer: core::Connection over a multi-channel TCP link (tcp/tcp_link.hpp).
// The peer's memory is addressed by the TCP key it registered (RegisteredMemory::Impl::tcpKey).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mori/channels/connection.hpp"
#include "tcp/tcp_link.hpp"

namespace mori::core {

class TcpConnection : public Connection {
 public:
  TcpConnection(std::unique_ptr<tcp::TcpLink> link, int remoteRank, int tag);
  ~TcpConnection() override;

  void Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
             uint64_t bytes) override;
  void UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) override;
  void Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
            uint64_t bytes) override;
  void AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) override;
  void AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                         uint64_t* result) override;
  void Flush(int64_t timeoutUs = -1) override;

  Transport GetTransport() const override { return Transport::Tcp; }
  Transport GetRemoteTransport() const override { return Transport::Tcp; }
  std::string Describe() const override;

  tcp::TcpLink& Link() { return *link_; }

 private:
  // The peer's key for [offset, + bytes) of `memory`; throws InvalidUsage naming what is wrong.
  uint32_t PeerKey(const RegisteredMemory& memory, uint64_t offset, uint64_t bytes, const char* role) const;
  // This process's pointer to [offset, + bytes) of `memory`.
  uint8_t* LocalRange(const RegisteredMemory& memory, uint64_t offset, uint64_t bytes, const char* role) const;

  std::unique_ptr<tcp::TcpLink> link_;
};

}  // namespace mori::core
