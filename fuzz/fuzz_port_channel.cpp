// Port channel requests as a ProxyService reads them (issue 16): the input is a sequence of 16-byte triggers,
// pushed into a real ProxyService's FIFO the way a kernel's PortChannel pushes them; the service's thread pops
// and executes them over semaphores whose connections check every operation against the registered memory it
// names, with every memory exactly as large as its registration, so ASan sees any stray byte.
// Properties:
//   - no operation reaches outside a registered range (the connection checks, ASan watches);
//   - the service does what the request layout in proxy_trigger.hpp documents and nothing else: afterwards every
//     memory and every peer's token equal a model that applies the same requests in order by those rules,
//     stopping at the first one the service must refuse;
//   - the service fails exactly when the model refuses a request, on that request, and with mori's InvalidUsage;
//   - every flush a request asks for reaches its semaphore's connection, and no other.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "checking_connection.hpp"
#include "fuzz_util.hpp"
#include "mori/channels/proxy.hpp"
#include "mori/channels/proxy_trigger.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/kernel.hpp"
#include "semaphore_impl.hpp"

namespace {

using mori::core::DecodePortRequest;
using mori::core::PortRequest;
using mori::core::ProxyService;
using mori::core::ProxyTrigger;
using mori::core::Semaphore;
using mori::fuzz::Buffer;
using mori::fuzz::CheckingConnection;

// Sizes of the memories added to the service (ids 0..4): a word, odd sizes, a page.
constexpr uint64_t kMemoryBytes[] = {8, 64, 1000, 4096, 257};
constexpr size_t kMemories = sizeof(kMemoryBytes) / sizeof(kMemoryBytes[0]);
// The peers of the semaphores (ids 0..3): two to rank 1, so that a signal must raise the token of the semaphore
// it names and not another one to the same peer.
constexpr int kSemaphorePeers[] = {1, 2, 1, 3};
constexpr size_t kSemaphores = sizeof(kSemaphorePeers) / sizeof(kSemaphorePeers[0]);
constexpr size_t kMaxRequests = 64;  // the FIFO (kDefaultFifoSize) never fills

uint8_t Pattern(size_t memory, uint64_t i) { return static_cast<uint8_t>(memory * 37 + i * 11 + (i >> 8) + 1); }

// What the service must leave behind: the memories, and per semaphore its peer's token and the flushes of its
// connection.
struct State {
  std::vector<std::vector<uint8_t>> memories;
  std::vector<uint64_t> tokens;
  std::vector<uint64_t> flushes;
};

// Applies `requests` by the documented rules; returns the index of the first one the service must refuse, or
// requests.size().
size_t Model(const std::vector<ProxyTrigger>& requests, State& s) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const PortRequest r = DecodePortRequest(requests[i]);
    if (r.type == 0 || r.semaphoreId >= kSemaphores) return i;
    if ((r.type & mori::core::kTriggerData) != 0 && r.size > 0) {
      if (r.dstMemoryId >= kMemories || r.srcMemoryId >= kMemories) return i;
      std::vector<uint8_t>& dst = s.memories[r.dstMemoryId];
      const std::vector<uint8_t>& src = s.memories[r.srcMemoryId];
      if (r.dstOffset + r.size > dst.size() || r.srcOffset + r.size > src.size()) return i;
      std::memmove(dst.data() + r.dstOffset, src.data() + r.srcOffset, r.size);
    }
    if ((r.type & mori::core::kTriggerSignal) != 0) ++s.tokens[r.semaphoreId];
    if ((r.type & mori::core::kTriggerFlush) != 0) ++s.flushes[r.semaphoreId];
  }
  return requests.size();
}

class Harness {
 public:
  Harness() {
    for (uint64_t bytes : kMemoryBytes) memories_.emplace_back(std::make_unique<Buffer>(bytes));
    for (size_t k = 0; k < kSemaphores; ++k) tokens_.emplace_back(std::make_unique<Buffer>(sizeof(uint64_t)));
  }

  void Run(const std::vector<ProxyTrigger>& requests) {
    State expected;
    for (size_t m = 0; m < kMemories; ++m) {
      uint8_t* bytes = memories_[m]->bytes.get();
      for (uint64_t i = 0; i < kMemoryBytes[m]; ++i) bytes[i] = Pattern(m, i);
      expected.memories.emplace_back(bytes, bytes + kMemoryBytes[m]);
    }
    for (auto& t : tokens_) std::memset(t->bytes.get(), 0, sizeof(uint64_t));
    expected.tokens.assign(kSemaphores, 0);
    expected.flushes.assign(kSemaphores, 0);
    const size_t refused = Model(requests, expected);

    ProxyService service;
    std::vector<std::shared_ptr<CheckingConnection>> connections;
    for (size_t k = 0; k < kSemaphores; ++k) {
      connections.push_back(std::make_shared<CheckingConnection>(kSemaphorePeers[k]));
      service.AddSemaphore(MakeSemaphore(k, connections.back()));
    }
    for (auto& m : memories_) service.AddMemory(m->memory);
    service.StartProxy();
    mori::core::FifoDeviceHandle fifo = service.FifoHandle();
    try {
      for (const ProxyTrigger& t : requests) fifo.Push(&t, 1);
    } catch (const mori::core::host::KernelTrap&) {
      // The service failed on an earlier request: a producer's wait for room says so (as a kernel would trap).
    }
    bool failed = false;
    try {
      service.StopProxy();
    } catch (const mori::core::Error& e) {
      failed = true;
      MORI_FUZZ_ASSERT(e.Code() == mori::core::ErrorCode::InvalidUsage, "the service failed with %s", e.what());
      MORI_FUZZ_ASSERT(refused < requests.size(), "the service refused a request the rules allow: %s", e.what());
    }
    MORI_FUZZ_ASSERT(failed || refused == requests.size(), "the service accepted request %zu, which the rules refuse",
                     refused);
    // The request it failed on is the one the rules refuse (the FIFO's tail stops in front of it).
    MORI_FUZZ_ASSERT(service.Handled() == refused, "the service handled %llu requests, the rules allow %zu",
                     static_cast<unsigned long long>(service.Handled()), refused);

    for (size_t m = 0; m < kMemories; ++m) {
      const uint8_t* bytes = memories_[m]->bytes.get();
      for (uint64_t i = 0; i < kMemoryBytes[m]; ++i) {
        MORI_FUZZ_ASSERT(bytes[i] == expected.memories[m][i], "memory %zu byte %llu is 0x%02x, the model says 0x%02x",
                         m, static_cast<unsigned long long>(i), bytes[i], expected.memories[m][i]);
      }
    }
    for (size_t k = 0; k < kSemaphores; ++k) {
      uint64_t token;
      std::memcpy(&token, tokens_[k]->bytes.get(), sizeof(token));
      MORI_FUZZ_ASSERT(token == expected.tokens[k], "semaphore %zu's peer token is %llu, the model says %llu", k,
                       static_cast<unsigned long long>(token), static_cast<unsigned long long>(expected.tokens[k]));
      MORI_FUZZ_ASSERT(connections[k]->Flushes() == expected.flushes[k],
                       "semaphore %zu's connection was flushed %llu times, the model says %llu", k,
                       static_cast<unsigned long long>(connections[k]->Flushes()),
                       static_cast<unsigned long long>(expected.flushes[k]));
    }
  }

 private:
  // A semaphore over `connection` whose peer's inbound token is tokens_[k] (8 bytes, registered).
  std::shared_ptr<Semaphore> MakeSemaphore(size_t k, std::shared_ptr<CheckingConnection> connection) {
    auto impl = std::make_unique<Semaphore::Impl>();
    impl->connection = std::move(connection);
    impl->rank = 0;
    impl->remoteRank = kSemaphorePeers[k];
    impl->words = words_[k];
    impl->remoteInbound = tokens_[k]->memory;
    return std::make_shared<Semaphore>(std::move(impl));
  }

  std::vector<std::unique_ptr<Buffer>> memories_;
  std::vector<std::unique_ptr<Buffer>> tokens_;
  uint64_t words_[kSemaphores][4] = {};  // the local token words, which the proxy never touches
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MORI_TIMEOUT_S", "2", 1);  // every wait of the service and the FIFO is bounded, and short
  setenv("MORI_LOG_LEVEL", "error", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness harness;
  mori::fuzz::FuzzInput in(data, size);
  std::vector<ProxyTrigger> requests;
  while (in.Left() > 0 && requests.size() < kMaxRequests) {
    ProxyTrigger t = in.Take<ProxyTrigger>();
    t.snd &= ~mori::core::kTriggerLapBit;  // the lap bit is the FIFO's, not the producer's
    requests.push_back(t);
  }
  if (!requests.empty()) harness.Run(requests);
  return 0;
}
