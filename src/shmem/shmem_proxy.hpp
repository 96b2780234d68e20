// The host side of the SHMEM Proxy transport: a proxy thread that pops the requests of
// shmem_proxy_request.hpp and executes them over one channel connection per PE (itself included, over a
// loopback connection), so puts, gets, signals, atomics and quiet work without GPU-initiated networking.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "mori/channels/connection.hpp"
#include "mori/channels/proxy.hpp"
#include "mori/channels/registered_memory.hpp"
#include "mori/shmem/shmem_proxy_request.hpp"

namespace mori::shmem {

class ShmemProxy : public core::Proxy {
 public:
  // Words of the scratch memory (host-pinned, registered for the connections' transport): the result words
  // the device reads, then the staging ring of inline puts.
  static constexpr uint32_t kStagingSlots = 4096;  // 16 bytes each
  static size_t ScratchBytes();

  struct Setup {
    int rank = 0;
    int nPes = 0;
    uintptr_t heapBase = 0;
    uint64_t heapBytes = 0;
    core::RegisteredMemory heap;                                 // this PE's heap, local
    std::vector<core::RegisteredMemory> heaps;                   // [nPes] every PE's heap as this PE sees it
    std::vector<std::shared_ptr<core::Connection>> connections;  // [nPes] to each PE (to itself: loopback)
    core::RegisteredMemory scratch;                              // ScratchBytes() of host-pinned memory, local
  };

  ShmemProxy(Setup setup, int device);
  ~ShmemProxy() override;

  // Local buffers outside the heap the proxy may read (put sources) and write (get destinations).
  void AddRegion(void* base, core::RegisteredMemory memory);
  void RemoveRegion(void* base);

  // Completes everything issued on every connection (called with the thread stopped, or from it).
  void FlushAll();

 protected:
  uint32_t HandleTrigger(const core::ProxyTrigger& trigger) override;

 private:
  struct Local {
    core::RegisteredMemory memory;  // a copy: a region may be unregistered while the request runs
    uint64_t offset;
  };
  Local Resolve(uint64_t address, uint64_t bytes, const char* what, const char* op);
  void CheckRemote(int pe, uint64_t offset, uint64_t bytes, const char* op) const;
  uint64_t* Results() const;
  void Execute(const ProxyHeader& h, const core::ProxyTrigger* slots);
  uint64_t Atomic(int pe, uint64_t offset, ProxyAmo amo, uint32_t width, uint64_t value, uint64_t compare);
  uint64_t FetchAdd(int pe, uint64_t offset, uint64_t value);
  uint64_t CompareSwap(int pe, uint64_t offset, uint64_t compare, uint64_t swap);

  Setup s_;
  std::mutex regionsMutex_;
  std::map<uintptr_t, core::RegisteredMemory> regions_;  // by base address
  uint32_t stagingNext_ = 0;
  uint64_t signalWord_ = 0;  // UpdateAndSync's local word
  uint64_t handled_ = 0;
};

}  // namespace mori::shmem
