// Pieces shared by the fuzz targets of the proxies (fuzz_shmem_proxy, fuzz_port_channel): buffers registered at
// exactly their size, and a connection that performs each operation a proxy asks for on the memory it is handed
// after checking that the memory holds it (a finding otherwise), so that no proxy request reaches a byte outside
// a registered range unnoticed.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "fuzz_util.hpp"
#include "mori/channels/connection.hpp"
#include "mori/channels/registered_memory.hpp"
#include "registered_memory_impl.hpp"

namespace mori::fuzz {

using core::RegisteredMemory;

// A buffer and a local registration of exactly its size.
struct Buffer {
  std::unique_ptr<uint8_t[]> bytes;
  RegisteredMemory memory;
  explicit Buffer(uint64_t size) : bytes(new uint8_t[size]()) {
    auto impl = std::make_shared<RegisteredMemory::Impl>();
    impl->data = bytes.get();
    impl->originalData = bytes.get();
    impl->size = size;
    impl->local = true;
    memory = RegisteredMemory(impl);
  }
};

// [offset, offset + bytes) inside `m`, without overflow.
inline bool Inside(const RegisteredMemory& m, uint64_t offset, uint64_t bytes) {
  return m.Valid() && bytes <= m.Size() && offset <= m.Size() - bytes;
}

inline uint8_t* At(const RegisteredMemory& m, uint64_t offset) { return static_cast<uint8_t*>(m.Data()) + offset; }

// Performs what the proxy asks on the memory it names, after checking that the memory holds it.
class CheckingConnection : public core::Connection {
 public:
  explicit CheckingConnection(int peer) : Connection(peer, 0) {}

  void Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
             uint64_t bytes) override {
    MORI_FUZZ_ASSERT(Inside(dst, dstOffset, bytes) && Inside(src, srcOffset, bytes),
                     "write of %llu bytes from offset %llu of %zu to offset %llu of %zu", ULL(bytes), ULL(srcOffset),
                     src.Size(), ULL(dstOffset), dst.Size());
    std::memmove(At(dst, dstOffset), At(src, srcOffset), bytes);
  }
  void Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
            uint64_t bytes) override {
    MORI_FUZZ_ASSERT(Inside(dst, dstOffset, bytes) && Inside(src, srcOffset, bytes),
                     "read of %llu bytes from offset %llu of %zu to offset %llu of %zu", ULL(bytes), ULL(srcOffset),
                     src.Size(), ULL(dstOffset), dst.Size());
    std::memmove(At(dst, dstOffset), At(src, srcOffset), bytes);
  }
  void UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) override {
    MORI_FUZZ_ASSERT(Inside(dst, dstOffset, 8) && dstOffset % 8 == 0, "signal word at offset %llu of %zu",
                     ULL(dstOffset), dst.Size());
    *src = newValue;
    std::memcpy(At(dst, dstOffset), src, 8);
  }
  void AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) override {
    uint64_t old = Word(dst, dstOffset, "fetch-add");
    uint64_t next = old + value;
    std::memcpy(At(dst, dstOffset), &next, 8);
    if (result != nullptr) *result = old;
  }
  void AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                         uint64_t* result) override {
    uint64_t old = Word(dst, dstOffset, "compare-swap");
    if (old == compare) std::memcpy(At(dst, dstOffset), &swap, 8);
    if (result != nullptr) *result = old;
  }
  void Flush(int64_t) override { flushes_.fetch_add(1, std::memory_order_relaxed); }
  core::Transport GetTransport() const override { return core::Transport::Tcp; }
  core::Transport GetRemoteTransport() const override { return core::Transport::Tcp; }

  // Flushes asked of this connection so far.
  uint64_t Flushes() const { return flushes_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> flushes_{0};
  static unsigned long long ULL(uint64_t v) { return static_cast<unsigned long long>(v); }
  static uint64_t Word(const RegisteredMemory& dst, uint64_t offset, const char* what) {
    MORI_FUZZ_ASSERT(Inside(dst, offset, 8) && offset % 8 == 0, "%s at offset %llu of %zu", what, ULL(offset),
                     dst.Size());
    uint64_t v;
    std::memcpy(&v, At(dst, offset), 8);
    return v;
  }
};

}  // namespace mori::fuzz
