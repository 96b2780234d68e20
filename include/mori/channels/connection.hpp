// A connection to one peer over one transport, driven by a host thread (a proxy): one-sided writes into the
// peer's registered memory, 8-byte word updates ordered after them (semaphore tokens), reads and atomics
// (what the SHMEM Proxy transport needs), and a flush that returns once all of it is complete at the target.
// Made by Communicator::Connect. One thread drives a connection at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mori/channels/registered_memory.hpp"
#include "mori/channels/transport.hpp"

namespace mori::core {

struct EndpointConfig {
  Transport transport = Transport::Unknown;
  int device = -1;  // GPU whose memory the connection moves (-1: the current device)

  struct Ib {
    uint32_t maxCqSize = 1024;     // completion-queue depth
    uint32_t maxCqPollNum = 4;     // completions taken per poll
    uint32_t maxSendWr = 1024;     // send-queue depth (rounded up to a power of two)
    uint32_t maxWrPerSend = 64;    // a completion is requested at least every this many work requests
    uint32_t portId = 0;           // 0: the device's first active port
  } ib;

  struct Tcp {
    int numChannels = 0;           // sockets; 0: MORI_TCP_CHANNELS
    int windowChunks = 0;          // chunks in flight per channel; 0: MORI_TCP_WINDOW
    size_t chunkBytes = 0;         // 0: MORI_TCP_CHUNK_SIZE
    std::string ifnames;           // comma-separated interfaces to bind, round-robin; empty: MORI_SOCKET_IFNAME
  } tcp;
};

class Connection {
 public:
  virtual ~Connection();

  // Copies [src + srcOffset, + bytes) to [dst + dstOffset, + bytes) at the peer. Returns once issued; complete
  // at Flush. `dst` is the peer's memory (RecvMemory), `src` local; both registered for this transport.
  virtual void Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
                     uint64_t bytes) = 0;
  // Stores `newValue` in the local word *src and makes the peer's 8-byte word at dst + dstOffset equal to it,
  // after every Write issued before (a semaphore's signal).
  virtual void UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) = 0;
  // Reads the peer's [src + srcOffset, + bytes) into local [dst + dstOffset, + bytes); complete at Flush.
  virtual void Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
                    uint64_t bytes) = 0;
  // 8-byte atomics on the peer's word at dst + dstOffset (8-byte aligned), ordered after earlier Writes.
  // `result` (host memory, may be nullptr) receives the old value; it is valid after Flush.
  virtual void AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) = 0;
  virtual void AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                                 uint64_t* result) = 0;
  // Returns once everything issued before is complete at the target (and reads and atomic results have landed).
  // Throws when any of it failed (naming the transport, the peer and the cause) or after `timeoutUs`
  // (negative: MORI_TIMEOUT_S).
  virtual void Flush(int64_t timeoutUs = -1) = 0;

  virtual Transport GetTransport() const = 0;
  virtual Transport GetRemoteTransport() const = 0;
  int RemoteRank() const { return remoteRank_; }
  int Tag() const { return tag_; }
  // "Tcp to rank 1 (4 channels)" and the like, for messages.
  virtual std::string Describe() const;

 protected:
  Connection(int remoteRank, int tag) : remoteRank_(remoteRank), tag_(tag) {}

 private:
  int remoteRank_;
  int tag_;
};

}  // namespace mori::core
