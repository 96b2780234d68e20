// The process-wide table of memory TCP peers may address (tcp_registry.hpp): key -> range, checked on every request.
#include "tcp/tcp_registry.hpp"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core::tcp {

namespace {

struct Entry {
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  bool deviceMemory = false;
  uint32_t holders = 0;  // resolved targets not yet released
  bool leaving = false;  // being deregistered: no new holders
  bool anyPeer = false;  // granted to every rank
  std::set<int> peers;   // else the ranks it was granted to
};

struct Registry {
  std::mutex mutex;
  std::condition_variable released;
  std::map<uint32_t, Entry> entries;
  std::mt19937 keys{std::random_device{}()};  // keys a peer cannot guess from the ones it was given
};

Registry& TheRegistry() {
  static Registry* r = new Registry();  // outlives static destructors of TCP receivers still running at exit
  return *r;
}

}  // namespace

uint32_t RegisterTcpMemory(void* ptr, size_t bytes, bool deviceMemory) {
  MORI_CHECK(ptr != nullptr && bytes > 0, ErrorCode::InvalidUsage, "TCP registration of %p + %zu bytes: empty range",
             ptr, bytes);
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  uint32_t key = 0;
  while (key == 0 || r.entries.count(key) != 0) key = static_cast<uint32_t>(r.keys());  // 0 is never a key
  Entry& e = r.entries[key];
  e.base = static_cast<uint8_t*>(ptr);
  e.bytes = bytes;
  e.deviceMemory = deviceMemory;
  return key;
}

void GrantTcpMemory(uint32_t key, int rank) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(key);
  MORI_CHECK(it != r.entries.end(), ErrorCode::Internal, "granting TCP memory key %u, which is not registered", key);
  if (rank == kAnyTcpPeer) {
    it->second.anyPeer = true;
  } else {
    it->second.peers.insert(rank);
  }
}

void DeregisterTcpMemory(uint32_t key) {
  Registry& r = TheRegistry();
  std::unique_lock<std::mutex> lock(r.mutex);
  auto it = r.entries.find(key);
  if (it == r.entries.end()) return;
  it->second.leaving = true;
  const Deadline deadline = Deadline::After(2 * TimeoutSeconds());
  while (it->second.holders > 0) {
    if (deadline.Expired()) {
      MORI_LOG_ERROR(Net,
                     "TCP memory key %u deregistered while %u receiver(s) still write or read it after %.0f s: "
                     "memory freed now may be touched",
                     key, it->second.holders, deadline.TotalSeconds());
      break;
    }
    r.released.wait_for(lock, std::chrono::milliseconds(100));
  }
  r.entries.erase(it);  // std::map: erasing others never moved this one
}

TcpTarget& TcpTarget::operator=(TcpTarget&& o) noexcept {
  if (this != &o) {
    Release();
    ptr_ = o.ptr_;
    deviceMemory_ = o.deviceMemory_;
    key_ = o.key_;
    o.key_ = 0;
  }
  return *this;
}

void TcpTarget::Release() {
  if (key_ == 0) return;
  Registry& r = TheRegistry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.entries.find(key_);
    if (it != r.entries.end() && it->second.holders > 0) --it->second.holders;
  }
  r.released.notify_all();
  key_ = 0;
}

TcpTarget ResolveTcpMemory(uint32_t key, uint64_t offset, uint64_t bytes, int requester) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(key);
  const bool granted =
      it != r.entries.end() && (it->second.anyPeer || it->second.peers.count(requester) != 0);
  MORI_CHECK(granted, ErrorCode::Protocol,
             "TCP request of rank %d for memory key %u, which is not registered here for rank %d", requester, key,
             requester);
  Entry& e = it->second;
  MORI_CHECK(!e.leaving, ErrorCode::Protocol, "TCP request for memory key %u, which is being deregistered here", key);
  MORI_CHECK(bytes <= e.bytes && offset <= e.bytes - bytes, ErrorCode::Protocol,
             "TCP request for [%llu, + %llu) of memory key %u, which holds %llu bytes",
             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), key,
             static_cast<unsigned long long>(e.bytes));
  ++e.holders;
  return TcpTarget(e.base + offset, e.deviceMemory, key);
}

}  // namespace mori::core::tcp
