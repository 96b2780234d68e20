// The SHMEM proxy thread: decodes the multi-slot requests kernels push and performs them on the connection
// to the target PE. Fetching requests leave their result in a host-pinned word before the slot is popped,
// so the device's wait for the pop is its wait for the result.
#include "shmem_proxy.hpp"

#include <cstring>
#include <string>
#include <utility>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"
#include "mori/shmem/shmem_device_state.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::shmem {

using core::ErrorCode;

namespace {

const char* OpName(ProxyOp op) {
  switch (op) {
    case ProxyOp::Put:
      return "put";
    case ProxyOp::Get:
      return "get";
    case ProxyOp::PutInline:
      return "single-value put";
    case ProxyOp::GetInline:
      return "single-value get";
    case ProxyOp::Signal:
      return "signal";
    case ProxyOp::PutSignal:
      return "put-with-signal";
    case ProxyOp::Atomic:
      return "atomic";
    case ProxyOp::Quiet:
      return "quiet";
    case ProxyOp::Fence:
      return "fence";
  }
  return "unknown request";
}

constexpr uint64_t kStagingOffset = kShmemFetchSlots * sizeof(uint64_t);

}  // namespace

size_t ShmemProxy::ScratchBytes() { return kStagingOffset + size_t{kStagingSlots} * 16; }

ShmemProxy::ShmemProxy(Setup setup, int device) : core::Proxy(core::kDefaultFifoSize, device), s_(std::move(setup)) {
  MORI_CHECK(static_cast<int>(s_.heaps.size()) == s_.nPes && static_cast<int>(s_.connections.size()) == s_.nPes &&
                 s_.scratch.Valid() && s_.scratch.Size() >= ScratchBytes(),
             ErrorCode::Internal, "PE %d: the SHMEM proxy was set up with %zu heaps and %zu connections for %d PEs",
             s_.rank, s_.heaps.size(), s_.connections.size(), s_.nPes);
}

ShmemProxy::~ShmemProxy() { StopProxyWithoutDraining(); }

void ShmemProxy::AddRegion(void* base, core::RegisteredMemory memory) {
  std::lock_guard<std::mutex> lock(regionsMutex_);
  regions_[reinterpret_cast<uintptr_t>(base)] = std::move(memory);
}

void ShmemProxy::RemoveRegion(void* base) {
  std::lock_guard<std::mutex> lock(regionsMutex_);
  regions_.erase(reinterpret_cast<uintptr_t>(base));
}

void ShmemProxy::FlushAll() {
  for (auto& c : s_.connections) c->Flush();
}

uint64_t* ShmemProxy::Results() const { return static_cast<uint64_t*>(s_.scratch.Data()); }

ShmemProxy::Local ShmemProxy::Resolve(uint64_t address, uint64_t bytes, const char* what, const char* op) {
  if (address >= s_.heapBase && bytes <= s_.heapBytes && address - s_.heapBase <= s_.heapBytes - bytes) {
    return Local{s_.heap, address - s_.heapBase};
  }
  std::lock_guard<std::mutex> lock(regionsMutex_);
  auto it = regions_.upper_bound(address);
  if (it != regions_.begin()) {
    --it;
    const core::RegisteredMemory& m = it->second;
    uint64_t off = address - it->first;
    if (bytes <= m.Size() && off <= m.Size() - bytes) return Local{m, off};
  }
  MORI_THROW(ErrorCode::InvalidUsage,
             "PE %d: SHMEM proxy %s: local %s 0x%llx (%llu bytes) is neither in the symmetric heap nor registered "
             "with ShmemBufferRegister",
             s_.rank, op, what, static_cast<unsigned long long>(address), static_cast<unsigned long long>(bytes));
}

void ShmemProxy::CheckRemote(int pe, uint64_t offset, uint64_t bytes, const char* op) const {
  MORI_CHECK(pe >= 0 && pe < s_.nPes, ErrorCode::Protocol, "PE %d: SHMEM proxy %s names pe %d (of %d)", s_.rank, op, pe,
             s_.nPes);
  MORI_CHECK(bytes <= s_.heapBytes && offset <= s_.heapBytes - bytes, ErrorCode::Protocol,
             "PE %d: SHMEM proxy %s to pe %d: heap offset %llu + %llu bytes is outside the heap (%llu bytes)", s_.rank,
             op, pe, static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes),
             static_cast<unsigned long long>(s_.heapBytes));
}

uint32_t ShmemProxy::HandleTrigger(const core::ProxyTrigger& trigger) {
  ProxyHeader h = DecodeProxyHeader(trigger);
  MORI_CHECK(h.slots >= 1 && h.slots <= kProxyMaxSlots, ErrorCode::Protocol,
             "PE %d: SHMEM proxy request %llu (op %u) says it takes %u slots (1 to %u)", s_.rank,
             static_cast<unsigned long long>(handled_), static_cast<unsigned>(h.op), h.slots, kProxyMaxSlots);
  core::ProxyTrigger slots[kProxyMaxSlots] = {};  // a request shorter than its op expects reads zeros
  slots[0] = trigger;
  for (uint32_t k = 1; k < h.slots; ++k) {
    if (!GetFifo().Poll(&slots[k], k)) return 0;  // the producer is still writing the rest
  }
  Execute(h, slots);
  ++handled_;
  return h.slots;
}

void ShmemProxy::Execute(const ProxyHeader& h, const core::ProxyTrigger* slots) {
  const char* op = OpName(h.op);
  const int pe = static_cast<int>(h.pe);
  auto field = [&](uint32_t k) { return slots[k].snd & kProxyFieldMask; };
  switch (h.op) {
    case ProxyOp::Put:
    case ProxyOp::Get: {
      uint64_t offset = field(1);
      CheckRemote(pe, offset, h.bytes, op);
      if (h.bytes == 0) return;
      core::Connection& c = *s_.connections[static_cast<size_t>(pe)];
      bool put = h.op == ProxyOp::Put;
      Local local = Resolve(slots[1].fst, h.bytes, put ? "source" : "destination", op);
      if (put) {
        c.Write(s_.heaps[static_cast<size_t>(pe)], offset, local.memory, local.offset, h.bytes);
      } else {
        c.Read(local.memory, local.offset, s_.heaps[static_cast<size_t>(pe)], offset, h.bytes);
      }
      if ((h.sub & kProxyFlagFlush) != 0) c.Flush();
      return;
    }
    case ProxyOp::PutInline: {
      uint64_t offset = field(1);
      MORI_CHECK(h.bytes <= kProxyInlineBytes, ErrorCode::Protocol,
                 "PE %d: SHMEM proxy single-value put of %llu bytes (at most %u)", s_.rank,
                 static_cast<unsigned long long>(h.bytes), kProxyInlineBytes);
      CheckRemote(pe, offset, h.bytes, op);
      if (h.bytes == 0) return;
      // The value is staged in a registered ring; before a slot is reused every earlier put from it is done.
      if (stagingNext_ == kStagingSlots) {
        FlushAll();
        stagingNext_ = 0;
      }
      uint64_t at = kStagingOffset + uint64_t{stagingNext_++} * 16;
      uint64_t words[2] = {slots[1].fst, slots[2].fst};
      std::memcpy(static_cast<uint8_t*>(s_.scratch.Data()) + at, words, h.bytes);
      s_.connections[static_cast<size_t>(pe)]->Write(s_.heaps[static_cast<size_t>(pe)], offset, s_.scratch, at,
                                                     h.bytes);
      return;
    }
    case ProxyOp::GetInline: {
      uint64_t offset = field(1);
      uint64_t idx = field(2);
      MORI_CHECK(h.bytes <= 8 && idx < kShmemFetchSlots, ErrorCode::Protocol,
                 "PE %d: SHMEM proxy single-value get of %llu bytes into result %llu", s_.rank,
                 static_cast<unsigned long long>(h.bytes), static_cast<unsigned long long>(idx));
      CheckRemote(pe, offset, h.bytes, op);
      Results()[idx] = 0;
      core::Connection& c = *s_.connections[static_cast<size_t>(pe)];
      if (h.bytes > 0) c.Read(s_.scratch, idx * sizeof(uint64_t), s_.heaps[static_cast<size_t>(pe)], offset, h.bytes);
      c.Flush();
      return;
    }
    case ProxyOp::Signal:
    case ProxyOp::PutSignal: {
      uint32_t sig = h.op == ProxyOp::Signal ? 1 : 2;
      uint64_t sigOffset = field(sig);
      CheckRemote(pe, sigOffset, sizeof(uint64_t), op);
      MORI_CHECK(sigOffset % 8 == 0, ErrorCode::Protocol,
                 "PE %d: SHMEM proxy %s to pe %d: signal offset %llu is not "
                 "8-byte aligned",
                 s_.rank, op, pe, static_cast<unsigned long long>(sigOffset));
      core::Connection& c = *s_.connections[static_cast<size_t>(pe)];
      const core::RegisteredMemory& heap = s_.heaps[static_cast<size_t>(pe)];
      if (h.op == ProxyOp::PutSignal && h.bytes > 0) {
        uint64_t offset = field(1);
        CheckRemote(pe, offset, h.bytes, op);
        Local local = Resolve(slots[1].fst, h.bytes, "source", op);
        c.Write(heap, offset, local.memory, local.offset, h.bytes);
      }
      // Both word operations are ordered after the connection's earlier writes: the signal follows its data.
      if (static_cast<SignalOp>(h.sub) == SignalOp::Set) {
        c.UpdateAndSync(heap, sigOffset, &signalWord_, slots[sig].fst);
      } else {
        c.AtomicFetchAdd(heap, sigOffset, slots[sig].fst, nullptr);
      }
      return;
    }
    case ProxyOp::Atomic: {
      uint64_t offset = field(1);
      uint64_t idx = field(2);
      MORI_CHECK((h.width == 4 || h.width == 8) && offset % h.width == 0 &&
                     (idx == kProxyNoResult || idx < kShmemFetchSlots) && h.sub <= static_cast<uint32_t>(ProxyAmo::Set),
                 ErrorCode::Protocol,
                 "PE %d: SHMEM proxy atomic %u of width %u at heap offset %llu (result %llu) is malformed", s_.rank,
                 h.sub, h.width, static_cast<unsigned long long>(offset), static_cast<unsigned long long>(idx));
      CheckRemote(pe, offset, h.width, op);
      uint64_t* result = idx == kProxyNoResult ? nullptr : &Results()[idx];
      uint64_t old = Atomic(pe, offset, static_cast<ProxyAmo>(h.sub), h.width, slots[1].fst, slots[2].fst);
      if (result != nullptr) *result = old;
      return;
    }
    case ProxyOp::Quiet:
      if (h.pe == kProxyAllPes) {
        FlushAll();
      } else {
        CheckRemote(pe, 0, 0, op);
        s_.connections[static_cast<size_t>(pe)]->Flush();
      }
      return;
    case ProxyOp::Fence:
      // RC queue pairs apply writes in order; TCP spreads them over channels, so only a flush orders them.
      for (auto& c : s_.connections) {
        if (c->GetTransport() == core::Transport::Tcp) c->Flush();
      }
      return;
  }
  MORI_THROW(ErrorCode::Protocol, "PE %d: SHMEM proxy request with unknown op %u (header 0x%016llx)", s_.rank,
             static_cast<unsigned>(h.op), static_cast<unsigned long long>(slots[0].fst));
}

uint64_t ShmemProxy::FetchAdd(int pe, uint64_t offset, uint64_t value) {
  uint64_t old = 0;
  core::Connection& c = *s_.connections[static_cast<size_t>(pe)];
  c.AtomicFetchAdd(s_.heaps[static_cast<size_t>(pe)], offset, value, &old);
  c.Flush();
  return old;
}

uint64_t ShmemProxy::CompareSwap(int pe, uint64_t offset, uint64_t compare, uint64_t swap) {
  uint64_t old = 0;
  core::Connection& c = *s_.connections[static_cast<size_t>(pe)];
  c.AtomicCompareSwap(s_.heaps[static_cast<size_t>(pe)], offset, compare, swap, &old);
  c.Flush();
  return old;
}

// 8-byte fetch-add (and add) and compare-swap are the connection's own; everything else, and every 4-byte
// operation, is a compare-swap loop on the aligned 8-byte word that holds the value. Returns the old value.
uint64_t ShmemProxy::Atomic(int pe, uint64_t offset, ProxyAmo amo, uint32_t width, uint64_t value, uint64_t compare) {
  core::Connection& c = *s_.connections[static_cast<size_t>(pe)];
  const core::RegisteredMemory& heap = s_.heaps[static_cast<size_t>(pe)];
  if (width == 8 && amo == ProxyAmo::Add) {
    c.AtomicFetchAdd(heap, offset, value, nullptr);  // completes at quiet
    return 0;
  }
  if (width == 8 && (amo == ProxyAmo::FetchAdd || amo == ProxyAmo::Fetch)) {
    return FetchAdd(pe, offset, amo == ProxyAmo::Fetch ? 0 : value);
  }
  if (width == 8 && amo == ProxyAmo::CompareSwap) return CompareSwap(pe, offset, compare, value);

  uint64_t wordOffset = offset & ~uint64_t{7};
  unsigned shift = static_cast<unsigned>(offset - wordOffset) * 8;  // little-endian: the value's bit position
  uint64_t valueMask = width == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
  uint64_t mask = valueMask << shift;
  uint64_t word = FetchAdd(pe, wordOffset, 0);
  core::Deadline deadline = core::Deadline::Default();
  for (;;) {
    uint64_t old = (word & mask) >> shift;
    uint64_t next = old;
    switch (amo) {
      case ProxyAmo::FetchAdd:
      case ProxyAmo::Add:
        next = (old + value) & valueMask;
        break;
      case ProxyAmo::CompareSwap:
        if (old != (compare & valueMask)) return old;
        next = value & valueMask;
        break;
      case ProxyAmo::Swap:
      case ProxyAmo::Set:
        next = value & valueMask;
        break;
      case ProxyAmo::Fetch:
        return old;
    }
    uint64_t desired = (word & ~mask) | (next << shift);
    uint64_t seen = CompareSwap(pe, wordOffset, word, desired);
    if (seen == word) return old;
    word = seen;
    MORI_CHECK(!deadline.Expired(), ErrorCode::Timeout,
               "PE %d: SHMEM proxy atomic on pe %d at heap offset %llu kept losing its compare-swap for %.0f s",
               s_.rank, pe, static_cast<unsigned long long>(offset), deadline.TotalSeconds());
  }
}

}  // namespace mori::shmem
