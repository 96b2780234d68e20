// The host side of a memory channel: checks that the pieces fit together (a CudaIpc semaphore, the peer's
// memory mapped here, local memory to copy from) and fills the device handle that kernels copy through.
#include "mori/channels/memory_channel.hpp"

#include "mori/core/errors.hpp"

namespace mori::core {

MemoryChannel::MemoryChannel(std::shared_ptr<Semaphore> semaphore, RegisteredMemory dst, RegisteredMemory src,
                             void* packetBuffer, size_t packetBufferBytes)
    : semaphore_(std::move(semaphore)), dst_(std::move(dst)), src_(std::move(src)) {
  MORI_CHECK(semaphore_ != nullptr, ErrorCode::InvalidUsage, "memory channel: the semaphore is null");
  const int peer = semaphore_->RemoteRank();
  const std::shared_ptr<Connection>& connection = semaphore_->GetConnection();
  MORI_CHECK(connection != nullptr, ErrorCode::InvalidUsage,
             "memory channel to rank %d: the semaphore has no connection", peer);
  MORI_CHECK(connection->GetTransport() == Transport::CudaIpc, ErrorCode::InvalidUsage,
             "memory channel to rank %d: the semaphore's connection is %s; kernels reach the peer's memory and "
             "token only over CudaIpc (use a port channel for other transports)",
             peer, connection->Describe().c_str());

  MORI_CHECK(dst_.Valid(), ErrorCode::InvalidUsage, "memory channel to rank %d: the destination memory is empty", peer);
  MORI_CHECK(dst_.Data() != nullptr, ErrorCode::InvalidUsage,
             "memory channel to rank %d: the destination (%zu bytes of rank %d, transports %s) is not mapped in this "
             "process; it must be CudaIpc memory of a peer on this host",
             peer, dst_.Size(), dst_.Rank(), dst_.Transports().ToString().c_str());
  // The signals go to the semaphore's peer, so the data they announce must be that peer's.
  MORI_CHECK(dst_.IsLocal() || dst_.Rank() < 0 || dst_.Rank() == peer, ErrorCode::InvalidUsage,
             "memory channel to rank %d: the destination memory belongs to rank %d, not to the semaphore's peer", peer,
             dst_.Rank());

  MORI_CHECK(src_.Valid(), ErrorCode::InvalidUsage, "memory channel to rank %d: the source memory is empty", peer);
  MORI_CHECK(src_.IsLocal(), ErrorCode::InvalidUsage,
             "memory channel to rank %d: the source (%zu bytes of rank %d) is not memory registered in this process",
             peer, src_.Size(), src_.Rank());

  MORI_CHECK((packetBuffer == nullptr) == (packetBufferBytes == 0), ErrorCode::InvalidUsage,
             "memory channel to rank %d: packet buffer %p with %zu bytes (give both or neither)", peer, packetBuffer,
             packetBufferBytes);
  if (packetBuffer == nullptr) {
    packetBuffer = src_.Data();
    packetBufferBytes = src_.Size();
  }

  handle_.semaphore = semaphore_->DeviceHandle();
  MORI_CHECK(handle_.semaphore.remoteInboundToken != nullptr, ErrorCode::InvalidUsage,
             "memory channel to rank %d: the semaphore's peer token is not mapped here (%s)", peer,
             connection->Describe().c_str());
  handle_.dst = dst_.Data();
  handle_.src = src_.Data();
  handle_.packetBuffer = packetBuffer;
  handle_.dstBytes = dst_.Size();
  handle_.srcBytes = src_.Size();
  handle_.packetBufferBytes = packetBufferBytes;
}

MemoryChannelDeviceHandle MemoryChannel::DeviceHandle() const { return handle_; }

}  // namespace mori::core
