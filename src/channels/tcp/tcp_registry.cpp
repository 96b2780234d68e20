// The process-wide table of memory TCP peers may address (tcp_registry.hpp): key -> range, checked on every request.
#include "tcp/tcp_registry.hpp"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core::tcp {

namespace {

struct Entry {
  uint8_t* base;
  uint64_t bytes;
  bool deviceMemory;
  uint32_t holders = 0;  // resolved targets not yet released
  bool leaving = false;  // being deregistered: no new holders
};

struct Registry {
  std::mutex mutex;
  std::condition_variable released;
  std::map<uint32_t, Entry> entries;
  uint32_t nextKey = 1;
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
  uint32_t key = r.nextKey;
  while (key == 0 || r.entries.count(key) != 0) ++key;  // 0 is never a key; a wrapped counter skips live ones
  r.nextKey = key + 1;
  r.entries[key] = Entry{static_cast<uint8_t*>(ptr), bytes, deviceMemory};
  return key;
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

TcpTarget ResolveTcpMemory(uint32_t key, uint64_t offset, uint64_t bytes) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(key);
  MORI_CHECK(it != r.entries.end(), ErrorCode::Protocol, "TCP request for memory key %u, which is not registered here",
             key);
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
