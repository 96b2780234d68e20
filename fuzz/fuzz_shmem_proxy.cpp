// The SHMEM proxy's request path as its thread reads it (issue 16): the input is a sequence of requests, each
// a header slot and the slots it says it takes (1 to 3; else one), pushed into a real ShmemProxy's FIFO the way
// a kernel pushes them (one Push per request); the proxy thread pops and executes them. Its connections are
// fakes that perform each operation on the memory they are handed and first check that it lies inside that
// registered memory, and every buffer is exactly as large as its registration, so ASan sees any stray byte.
// Properties: no operation touches memory outside a registered range; a request the proxy refuses fails it with
// mori's Error (the proxy's failure, rethrown by StopProxy), never another exception or a crash.
// Local addresses (a put's source, a get's destination) are real pointers of this process on the wire; so that
// the fuzzer reaches the heap and the registered region, a value whose top two bits are 01 or 10 is taken as a
// signed 32-bit offset from the heap's or the region's base, any other value as it is.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "checking_connection.hpp"
#include "fuzz_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/kernel.hpp"
#include "shmem_proxy.hpp"

namespace {

using mori::core::ProxyTrigger;
using mori::fuzz::Buffer;
using mori::fuzz::CheckingConnection;
using mori::shmem::ProxyHeader;
using mori::shmem::ShmemProxy;

constexpr int kPes = 3;
constexpr uint64_t kHeapBytes = 4096;
constexpr uint64_t kRegionBytes = 512;
constexpr size_t kMaxRequests = 48;  // at most 144 slots: the FIFO (512) never fills

// Exposes the FIFO's producer side to the harness (ShmemProxy's own interface is the protected handler).
class Harness {
 public:
  Harness() : scratch_(ShmemProxy::ScratchBytes()), region_(kRegionBytes) {
    for (int pe = 0; pe < kPes; ++pe) heaps_.emplace_back(std::make_unique<Buffer>(kHeapBytes));
  }

  // Runs one proxy over `requests` (slots grouped per request); returns normally whether or not it refused one.
  void Run(const std::vector<std::vector<ProxyTrigger>>& requests) {
    ShmemProxy::Setup setup;
    setup.rank = 0;
    setup.nPes = kPes;
    setup.heapBase = reinterpret_cast<uintptr_t>(heaps_[0]->bytes.get());
    setup.heapBytes = kHeapBytes;
    setup.heap = heaps_[0]->memory;
    for (int pe = 0; pe < kPes; ++pe) {
      setup.heaps.push_back(heaps_[static_cast<size_t>(pe)]->memory);
      setup.connections.push_back(std::make_shared<CheckingConnection>(pe));
    }
    setup.scratch = scratch_.memory;
    ShmemProxy proxy(std::move(setup), -1);
    proxy.AddRegion(region_.bytes.get(), region_.memory);
    proxy.StartProxy();
    mori::core::FifoDeviceHandle fifo = proxy.FifoHandle();
    try {
      for (const auto& r : requests) fifo.Push(r.data(), static_cast<uint32_t>(r.size()));
    } catch (const mori::core::host::KernelTrap&) {
      // The proxy failed on an earlier request: a producer's wait for room says so (as a kernel would trap).
    }
    try {
      proxy.StopProxy();
    } catch (const mori::core::Error&) {
      // A refused request: the expected answer to malformed bytes.
    }
  }

  uint64_t Translate(uint64_t value) const {
    const uint64_t tag = value >> 62;
    const auto offset = static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(value)));
    if (tag == 1) return reinterpret_cast<uintptr_t>(heaps_[0]->bytes.get()) + static_cast<uint64_t>(offset);
    if (tag == 2) return reinterpret_cast<uintptr_t>(region_.bytes.get()) + static_cast<uint64_t>(offset);
    return value;
  }

 private:
  std::vector<std::unique_ptr<Buffer>> heaps_;
  Buffer scratch_;
  Buffer region_;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MORI_TIMEOUT_S", "2", 1);  // every wait of the proxy and the FIFO is bounded, and short
  setenv("MORI_LOG_LEVEL", "error", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness harness;
  mori::fuzz::FuzzInput in(data, size);
  std::vector<std::vector<ProxyTrigger>> requests;
  while (in.Left() > 0 && requests.size() < kMaxRequests) {
    ProxyTrigger header = in.Take<ProxyTrigger>();
    header.snd &= mori::shmem::kProxyFieldMask;  // the lap bit is the FIFO's, not the producer's
    const ProxyHeader h = mori::shmem::DecodeProxyHeader(header);
    const uint32_t slots = h.slots >= 1 && h.slots <= mori::shmem::kProxyMaxSlots ? h.slots : 1;
    std::vector<ProxyTrigger> r{header};
    for (uint32_t k = 1; k < slots; ++k) {
      ProxyTrigger t = in.Take<ProxyTrigger>();
      t.snd &= mori::shmem::kProxyFieldMask;
      if (k == 1) t.fst = harness.Translate(t.fst);
      r.push_back(t);
    }
    requests.push_back(std::move(r));
  }
  if (!requests.empty()) harness.Run(requests);
  return 0;
}
