// Memory this process lets TCP peers write into and read from, by key. A TCP receiver checks every request
// against it (key known, range inside), so bytes from a socket never land outside registered memory, and
// holds the entry while it writes, so memory is never deregistered (and freed) under a write in flight.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::core::tcp {

// Registers [ptr, ptr + bytes) (device memory of this process's GPU when `deviceMemory`); returns its key: random,
// never 0, not one in use. No peer may address it until GrantTcpMemory names it. Thread-safe.
uint32_t RegisterTcpMemory(void* ptr, size_t bytes, bool deviceMemory);

// Lets rank `rank` (kAnyTcpPeer: every rank) write and read the memory under `key`: Communicator::SendMemory
// grants the rank it sends the memory to, RegisteredMemory::Serialize (bytes for anyone) every rank.
constexpr int kAnyTcpPeer = -1;
void GrantTcpMemory(uint32_t key, int rank);

// Removes the key. New requests for it are refused at once; the call returns when the requests that resolved
// it before are done with the memory (bounded: after twice MORI_TIMEOUT_S it logs an error naming the key and
// returns anyway; a receiver gives up on a stalled frame after MORI_TIMEOUT_S).
void DeregisterTcpMemory(uint32_t key);

// A resolved range, holding its registration until destroyed (or moved from).
class TcpTarget {
 public:
  TcpTarget() = default;
  TcpTarget(uint8_t* ptr, bool deviceMemory, uint32_t key) : ptr_(ptr), deviceMemory_(deviceMemory), key_(key) {}
  TcpTarget(TcpTarget&& o) noexcept : ptr_(o.ptr_), deviceMemory_(o.deviceMemory_), key_(o.key_) { o.key_ = 0; }
  TcpTarget& operator=(TcpTarget&& o) noexcept;
  TcpTarget(const TcpTarget&) = delete;
  TcpTarget& operator=(const TcpTarget&) = delete;
  ~TcpTarget() { Release(); }

  uint8_t* Ptr() const { return ptr_; }  // start of the requested range
  bool DeviceMemory() const { return deviceMemory_; }
  void Release();  // done with the memory before destruction

 private:
  uint8_t* ptr_ = nullptr;
  bool deviceMemory_ = false;
  uint32_t key_ = 0;  // 0: holds nothing
};

// The range [offset, offset + bytes) of the memory registered under `key`, for a request of rank `requester`;
// throws Error(Protocol) naming the key and range when the key is unknown or not granted to the requester (one
// answer for both: no oracle of the keys in use), being deregistered, or the range leaves the memory.
TcpTarget ResolveTcpMemory(uint32_t key, uint64_t offset, uint64_t bytes, int requester);

}  // namespace mori::core::tcp
