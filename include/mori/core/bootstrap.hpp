// Bootstrap: how the processes of a job find each other and exchange the small messages of setup
// (addresses, memory handles, keys). Used at initialisation only, never on a data path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mori::core {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;

  virtual int GetRank() const = 0;
  virtual int GetNranks() const = 0;

  // Point to point, matched by (peer, tag); messages of one (peer, tag) arrive in the order sent. `bytes`
  // must equal the size sent: a mismatch is an error naming both sizes. Tags are >= 0.
  virtual void Send(const void* data, size_t bytes, int peer, int tag) = 0;
  virtual void Recv(void* data, size_t bytes, int peer, int tag) = 0;

  // Collectives; every rank calls them in the same order. `allData` holds GetNranks() slots of
  // `bytesPerRank`, this rank's slot filled on entry and every slot filled on return.
  virtual void AllGather(void* allData, size_t bytesPerRank) = 0;
  virtual void Barrier() = 0;
  virtual void Broadcast(void* data, size_t bytes, int root) = 0;

  // Typed helpers.
  template <typename T>
  std::vector<T> AllGatherValue(const T& mine) {
    std::vector<T> all(static_cast<size_t>(GetNranks()));
    all[static_cast<size_t>(GetRank())] = mine;
    AllGather(all.data(), sizeof(T));
    return all;
  }
  // Length-prefixed bytes of at most kMaxBytesMessage (descriptors, handles): a larger announced length is an
  // error naming the peer and the length, raised before anything is allocated for it.
  static constexpr uint64_t kMaxBytesMessage = 1ull << 20;
  void SendBytes(const std::vector<uint8_t>& data, int peer, int tag);
  std::vector<uint8_t> RecvBytes(int peer, int tag);
};

// 128 opaque bytes that carry the root's address and a job nonce; made on one process by
// SocketBootstrap::CreateUniqueId() and handed to every rank by any means (MPI, a file, torch).
struct UniqueId {
  uint8_t bytes[128];
};
static_assert(sizeof(UniqueId) == 128, "UniqueId is 128 bytes on the wire");

// TCP bootstrap: rank 0 listens at the address in the unique id, every rank registers there, learns
// the others' addresses and then talks to each peer directly. Works across hosts; framed messages with
// magic, version and length; a peer that dies or never comes raises an error that names it, within
// MORI_TIMEOUT_S (or the timeout given to Initialize).
class SocketBootstrap : public Bootstrap {
 public:
  SocketBootstrap(int rank, int nRanks);
  ~SocketBootstrap() override;

  // Picks the address (MORI_SOCKET_IFNAME, else the first non-loopback interface) and starts listening
  // there, so the id is valid at once. The listener is adopted by Initialize on rank 0 of this process. A
  // process keeps at most kMaxUnusedUniqueIds listeners of ids no Initialize took: creating one more closes the
  // oldest (with a warning); ReleaseUniqueId closes one that will not be used.
  static UniqueId CreateUniqueId();
  static constexpr size_t kMaxUnusedUniqueIds = 64;
  static void ReleaseUniqueId(const UniqueId& id);
  // A unique id for a root address chosen by the caller: "ip:port", "[ipv6]:port" or "ifname:ip:port". Its
  // nonce comes from the address, keyed with MORI_BOOTSTRAP_SECRET when that is set (else anyone can compute it).
  static UniqueId UniqueIdFromAddress(const std::string& rootAddress);
  // The root address an id carries, as "ip:port".
  static std::string UniqueIdAddress(const UniqueId& id);

  void Initialize(const UniqueId& id, double timeoutSeconds = 0);  // 0: MORI_TIMEOUT_S
  // Root at `rootAddress` (as in UniqueIdFromAddress); every rank gives the same string (and the same
  // MORI_BOOTSTRAP_SECRET; without one, rank 0 warns that anyone who reaches the address can join).
  void Initialize(const std::string& rootAddress, double timeoutSeconds = 0);

  int GetRank() const override;
  int GetNranks() const override;
  void Send(const void* data, size_t bytes, int peer, int tag) override;
  void Recv(void* data, size_t bytes, int peer, int tag) override;
  void AllGather(void* allData, size_t bytesPerRank) override;
  void Barrier() override;
  void Broadcast(void* data, size_t bytes, int root) override;

  // The bound on each wait of this bootstrap, in seconds.
  double TimeoutSeconds() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::core
