// The host side of a proxy FIFO: the host-pinned ring, the device-side claim counter (head), and the
// host-pinned popped counter (tail) and failure flag that the producers read.
#include "mori/channels/fifo.hpp"

#include <cstring>

#include "mori/core/atomic.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"

#include "device_zero.hpp"

namespace mori::core {

namespace {

// tail and proxyFailed live in one host-pinned buffer, on separate cache lines: the host stores the tail on
// every pop, and producers poll both.
constexpr size_t kTailOffset = 0;
constexpr size_t kFailedOffset = 64;
constexpr size_t kControlBytes = 128;
// head and tailSeen in one device allocation, on separate 128-byte lines: every push adds to the head, and
// reads tailSeen.
constexpr size_t kTailSeenOffset = 128;
constexpr size_t kCountersBytes = 256;

bool IsPowerOfTwo(uint32_t x) { return x != 0 && (x & (x - 1)) == 0; }

}  // namespace

struct Fifo::Impl {
  uint32_t size = 0;
  uint64_t timeoutNs = 0;
  int device = 0;
  GpuBuffer ring;              // [size] triggers, host-pinned
  GpuBuffer control;           // tail, proxyFailed; host-pinned
  uint64_t* head = nullptr;    // device memory (GpuMalloc)
  GpuStream stream = nullptr;  // reads of the head on GPU backends: the process's copy stream, so a kernel
                               // spinning on another stream does not hold them up

  ProxyTrigger* Triggers() const { return ring.DataAs<ProxyTrigger>(); }
  uint64_t* Tail() const { return reinterpret_cast<uint64_t*>(control.DataAs<uint8_t>() + kTailOffset); }
  uint32_t* Failed() const { return reinterpret_cast<uint32_t*>(control.DataAs<uint8_t>() + kFailedOffset); }
};

Fifo::Fifo(uint32_t size, double timeoutSeconds) : impl_(std::make_unique<Impl>()) {
  MORI_CHECK(size >= 2 && IsPowerOfTwo(size), ErrorCode::InvalidUsage,
             "proxy FIFO of %u slots: the size must be a power of two, at least 2", size);
  MORI_CHECK(size <= (1u << 24), ErrorCode::InvalidUsage,
             "proxy FIFO of %u slots: more than %u slots (%u MiB of pinned memory) is not a sensible FIFO", size,
             1u << 24, (1u << 24) * 16u >> 20);
  MORI_CHECK(timeoutSeconds >= 0, ErrorCode::InvalidUsage, "proxy FIFO timeout of %g s is negative", timeoutSeconds);
  Impl& m = *impl_;
  m.size = size;
  double seconds = timeoutSeconds > 0 ? timeoutSeconds : TimeoutSeconds();
  m.timeoutNs = static_cast<uint64_t>(seconds * 1e9);
  MORI_CHECK_GPU(GpuGetDevice(&m.device));

  m.ring = GpuBuffer(sizeof(ProxyTrigger) * size, MemoryType::HostPinned);
  std::memset(m.ring.Data(), 0, m.ring.Bytes());  // zero reads as empty in lap 0 (TriggerLapBit)
  m.control = GpuBuffer(kControlBytes, MemoryType::HostPinned);
  std::memset(m.control.Data(), 0, m.control.Bytes());

  void* head = nullptr;
  MORI_CHECK_GPU(GpuMalloc(&head, kCountersBytes));
  m.head = static_cast<uint64_t*>(head);
  try {
    ZeroDeviceMemory(m.head, kCountersBytes);
#if MORI_BACKEND_GPU
    m.stream = HostCopyStream(m.device);
#endif
  } catch (...) {
    (void)GpuFree(m.head);
    throw;
  }
  MORI_LOG_DEBUG(Proxy, "FIFO of %u slots on GPU %d: ring %p, head %p, tail %p, timeout %g s", size, m.device,
                 m.ring.Data(), static_cast<void*>(m.head), static_cast<void*>(m.Tail()), seconds);
}

Fifo::~Fifo() {
  if (impl_ == nullptr) return;
  (void)GpuFree(impl_->head);
}

bool Fifo::Poll(ProxyTrigger* out, uint32_t k) const {
  const Impl& m = *impl_;
  MORI_CHECK(k < m.size, ErrorCode::InvalidUsage,
             "Fifo::Poll of slot tail + %u in a FIFO of %u slots (a request spans at most the whole ring)", k, m.size);
  uint64_t slot = AtomicLoad<MemoryOrder::Relaxed>(m.Tail()) + k;  // only this (the consumer) thread writes it
  const ProxyTrigger* p = &m.Triggers()[slot & (m.size - 1)];
  // The acquire pairs with the producer's release store of `snd`: a matching lap bit means `fst` is written.
  uint64_t snd = AtomicLoad<MemoryOrder::Acquire>(&p->snd);
  if ((snd & kTriggerLapBit) != TriggerLapBit(slot, m.size)) return false;
  out->fst = AtomicLoad<MemoryOrder::Relaxed>(&p->fst);
  out->snd = snd & ~kTriggerLapBit;
  return true;
}

void Fifo::Pop(uint32_t n) {
  Impl& m = *impl_;
  MORI_CHECK(n >= 1 && n <= m.size, ErrorCode::InvalidUsage, "Fifo::Pop of %u slots in a FIFO of %u slots", n, m.size);
  uint64_t tail = AtomicLoad<MemoryOrder::Relaxed>(m.Tail()) + n;
  // Release: this thread's reads of the popped slots happen before a producer may overwrite them.
  AtomicStore<MemoryOrder::Release>(m.Tail(), tail);
}

uint64_t Fifo::Tail() const { return AtomicLoad<MemoryOrder::Acquire>(impl_->Tail()); }

uint64_t Fifo::Head() const {
  const Impl& m = *impl_;
#if MORI_BACKEND_GPU
  int current = 0;
  MORI_CHECK_GPU(GpuGetDevice(&current));
  if (current != m.device) MORI_CHECK_GPU(GpuSetDevice(m.device));
  uint64_t head = 0;
  double seconds = 0;
  GpuStatus sync = TimedStreamCopy(&head, m.head, sizeof(head), m.stream, &seconds);
  if (current != m.device) (void)GpuSetDevice(current);
  MORI_CHECK_GPU(sync);
  return head;
#else
  return AtomicLoad<MemoryOrder::Acquire>(m.head);
#endif
}

uint32_t Fifo::Size() const { return impl_->size; }

static_assert(static_cast<uint32_t>(ErrorCode::InvalidUsage) == 0 && static_cast<uint32_t>(ErrorCode::Internal) == 8,
              "FifoFailureName (fifo_device.hpp) names the ErrorCode values in this order");

void Fifo::MarkFailed() { AtomicStore<MemoryOrder::Release>(impl_->Failed(), kFifoFailedUnknown); }

void Fifo::MarkFailed(ErrorCode cause) {
  AtomicStore<MemoryOrder::Release>(impl_->Failed(), static_cast<uint32_t>(cause) + 1);
}

FifoDeviceHandle Fifo::DeviceHandle() const {
  const Impl& m = *impl_;
  FifoDeviceHandle h{};
  h.triggers = m.Triggers();
  h.head = m.head;
  h.tailSeen = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(m.head) + kTailSeenOffset);
  h.tail = m.Tail();
  h.proxyFailed = m.Failed();
  h.size = m.size;
  h.timeoutNs = m.timeoutNs;
  h.stop = DeviceStopWord();
  return h;
}

}  // namespace mori::core
