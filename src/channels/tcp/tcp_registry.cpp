// The process-wide table of memory TCP peers may address (tcp_registry.hpp): key -> range, checked on every request.
#include "tcp/tcp_registry.hpp"

#include <map>
#include <mutex>

#include "mori/core/errors.hpp"

namespace mori::core::tcp {

namespace {

struct Entry {
  uint8_t* base;
  uint64_t bytes;
  bool deviceMemory;
};

struct Registry {
  std::mutex mutex;
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
  uint32_t key = r.nextKey++;
  if (r.nextKey == 0) r.nextKey = 1;  // 0 is never a key
  r.entries[key] = Entry{static_cast<uint8_t*>(ptr), bytes, deviceMemory};
  return key;
}

void DeregisterTcpMemory(uint32_t key) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.erase(key);
}

TcpTarget ResolveTcpMemory(uint32_t key, uint64_t offset, uint64_t bytes) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(key);
  MORI_CHECK(it != r.entries.end(), ErrorCode::Protocol, "TCP request for memory key %u, which is not registered here",
             key);
  const Entry& e = it->second;
  MORI_CHECK(bytes <= e.bytes && offset <= e.bytes - bytes, ErrorCode::Protocol,
             "TCP request for [%llu, + %llu) of memory key %u, which holds %llu bytes",
             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), key,
             static_cast<unsigned long long>(e.bytes));
  return TcpTarget{e.base + offset, e.deviceMemory};
}

}  // namespace mori::core::tcp
