// Memory this process lets TCP peers write into and read from, by key. A TCP receiver checks every request
// against it (key known, range inside), so bytes from a socket never land outside registered memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::core::tcp {

// Registers [ptr, ptr + bytes) (device memory of this process's GPU when `deviceMemory`); returns its key (never
// 0). Thread-safe.
uint32_t RegisterTcpMemory(void* ptr, size_t bytes, bool deviceMemory);
void DeregisterTcpMemory(uint32_t key);

struct TcpTarget {
  uint8_t* ptr;       // start of the requested range
  bool deviceMemory;
};
// The range [offset, offset + bytes) of the memory registered under `key`; throws Error(Protocol) naming the
// key and range when the key is unknown or the range leaves the memory.
TcpTarget ResolveTcpMemory(uint32_t key, uint64_t offset, uint64_t bytes);

}  // namespace mori::core::tcp
