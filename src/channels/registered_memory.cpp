// RegisteredMemory: accessors, the versioned wire format (registered_memory_impl.hpp describes it) and its
// validation, mapping a same-host peer's memory, and views carved from a registration.
#include "mori/channels/registered_memory.hpp"

#include <unistd.h>

#include <cstring>
#include <string>

#include "allocation_registry.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/host_topology.hpp"
#include "registered_memory_impl.hpp"
#include "tcp/tcp_registry.hpp"

namespace mori::core {

namespace {

const RegisteredMemory::Impl& Checked(const RegisteredMemory::Impl* impl) {
  MORI_CHECK(impl != nullptr, ErrorCode::InvalidUsage, "use of an empty RegisteredMemory (default-constructed)");
  return *impl;
}

class ByteWriter {
 public:
  template <typename T>
  void Put(const T& value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void PutAt(size_t offset, uint32_t value) { std::memcpy(bytes_.data() + offset, &value, sizeof(value)); }
  size_t Size() const { return bytes_.size(); }
  std::vector<uint8_t> Take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

// Reads fields in order; running past the end names the field and the lengths.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t bytes) : data_(data), bytes_(bytes) {}

  template <typename T>
  T Get(const char* what) {
    Need(sizeof(T), what);
    T value;
    std::memcpy(&value, data_ + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  void Need(size_t n, const char* what) const {
    MORI_CHECK(n <= bytes_ - offset_, ErrorCode::Protocol,
               "registered memory bytes truncated: %s needs %zu bytes at offset %zu of %zu", what, n, offset_, bytes_);
  }
  size_t Offset() const { return offset_; }
  size_t Left() const { return bytes_ - offset_; }

 private:
  const uint8_t* data_;
  size_t bytes_;
  size_t offset_ = 0;
};

uint64_t ThisPid() { return static_cast<uint64_t>(getpid()); }

bool ValidIpcKind(uint32_t kind) {
  return kind >= static_cast<uint32_t>(IpcMemoryKind::HostMemfd) &&
         kind <= static_cast<uint32_t>(IpcMemoryKind::HipLegacy);
}

size_t EntryPayloadBytes(Transport t) {
  if (t == Transport::CudaIpc) return sizeof(IpcMemoryHandle);
  if (IsRdmaTransport(t)) return kRdmaEntryBytes;
  return kTcpEntryBytes;
}

}  // namespace

void* RegisteredMemory::Data() const { return Checked(impl_.get()).data; }
void* RegisteredMemory::OriginalDataPtr() const { return Checked(impl_.get()).originalData; }
size_t RegisteredMemory::Size() const { return Checked(impl_.get()).size; }
int RegisteredMemory::Rank() const { return Checked(impl_.get()).ownerRank; }
TransportFlags RegisteredMemory::Transports() const { return Checked(impl_.get()).transports; }
bool RegisteredMemory::IsLocal() const { return Checked(impl_.get()).local; }
bool RegisteredMemory::IsDeviceMemory() const { return Checked(impl_.get()).deviceMemory; }

std::vector<uint8_t> RegisteredMemory::Serialize() const {
  const Impl& m = Checked(impl_.get());
  // Bytes for anyone: every rank that gets them may address the memory over TCP.
  if (m.local && m.hasTcp) tcp::GrantTcpMemory(m.tcpKey, tcp::kAnyTcpPeer);
  return SerializeRegisteredMemory(m);
}

std::vector<uint8_t> SerializeRegisteredMemory(const RegisteredMemory::Impl& m) {
  ByteWriter w;
  uint16_t count = 0;
  for (int i = 0; i < kNumTransports; ++i) count += m.transports.Has(static_cast<Transport>(i)) ? 1 : 0;
  w.Put(kRegisteredMemoryMagic);
  w.Put(kRegisteredMemoryVersion);
  w.Put(count);
  w.Put(uint32_t{0});  // total bytes, filled in below
  w.Put(static_cast<int32_t>(m.ownerRank));
  w.Put(m.ownerHostId);
  w.Put(m.ownerPid);
  w.Put(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(m.originalData)));
  w.Put(m.size);
  w.Put(m.transports.Bits());
  w.Put(static_cast<uint8_t>(m.deviceMemory ? 1 : 0));
  for (int i = 0; i < 3; ++i) w.Put(uint8_t{0});
  w.Put(m.ownerToken);
  for (int i = 0; i < kNumTransports; ++i) {
    auto t = static_cast<Transport>(i);
    if (!m.transports.Has(t)) continue;
    w.Put(static_cast<uint32_t>(t));
    w.Put(static_cast<uint32_t>(EntryPayloadBytes(t)));
    if (t == Transport::CudaIpc) {
      MORI_CHECK(m.hasIpc, ErrorCode::Internal, "memory %p names CudaIpc but holds no IPC handle", m.originalData);
      w.Put(m.ipcHandle);
    } else if (IsRdmaTransport(t)) {
      const RdmaRegistration& r = m.rdma[static_cast<size_t>(RdmaSlotOf(t))];
      MORI_CHECK(r.valid, ErrorCode::Internal, "memory %p names %s but holds no NIC registration", m.originalData,
                 TransportName(t));
      w.Put(r.addr);
      w.Put(r.lkey);
      w.Put(r.rkey);
      w.Put(r.backend);
      w.Put(uint32_t{0});
    } else {
      MORI_CHECK(m.hasTcp, ErrorCode::Internal, "memory %p names Tcp but holds no TCP key", m.originalData);
      w.Put(m.tcpKey);
    }
  }
  w.PutAt(8, static_cast<uint32_t>(w.Size()));
  return w.Take();
}

std::shared_ptr<RegisteredMemory::Impl> ParseRegisteredMemory(const std::vector<uint8_t>& bytes) {
  ByteReader r(bytes.data(), bytes.size());
  r.Need(kRegisteredMemoryHeaderBytes, "the header");
  auto magic = r.Get<uint32_t>("magic");
  MORI_CHECK(magic == kRegisteredMemoryMagic, ErrorCode::Protocol,
             "registered memory bytes with bad magic 0x%08x (expected 0x%08x): not a serialized RegisteredMemory",
             magic, kRegisteredMemoryMagic);
  auto version = r.Get<uint16_t>("version");
  MORI_CHECK(version == kRegisteredMemoryVersion, ErrorCode::Protocol,
             "registered memory bytes of version %u; this build reads version %u", version, kRegisteredMemoryVersion);
  auto count = r.Get<uint16_t>("entry count");
  auto total = r.Get<uint32_t>("total length");
  MORI_CHECK(total == bytes.size(), ErrorCode::Protocol,
             "registered memory bytes: the total length field says %u bytes, %zu came", total, bytes.size());
  MORI_CHECK(count <= kNumTransports - 1, ErrorCode::Protocol,
             "registered memory bytes: entry count %u exceeds the %d transports", count, kNumTransports - 1);

  auto m = std::make_shared<RegisteredMemory::Impl>();
  m->ownerRank = r.Get<int32_t>("owner rank");
  m->ownerHostId = r.Get<uint64_t>("owner host id");
  m->ownerPid = r.Get<uint64_t>("owner pid");
  m->originalData = reinterpret_cast<void*>(static_cast<uintptr_t>(r.Get<uint64_t>("original pointer")));
  m->size = r.Get<uint64_t>("size");
  auto bits = r.Get<uint32_t>("transport flags");
  auto device = r.Get<uint8_t>("device memory flag");
  // Zero fields and the entries' order are checked too: the format has one encoding per memory (Serialize of what
  // was parsed gives back the same bytes), so nothing can ride along in bytes that the checks skip.
  for (int i = 0; i < 3; ++i) {
    auto pad = r.Get<uint8_t>("padding");
    MORI_CHECK(pad == 0, ErrorCode::Protocol, "registered memory bytes: header padding byte %d is 0x%02x, not 0", i,
               pad);
  }
  m->ownerToken = r.Get<uint64_t>("owner process token");
  MORI_CHECK(m->ownerRank >= -1, ErrorCode::Protocol, "registered memory bytes: owner rank %d", m->ownerRank);
  MORI_CHECK(m->size > 0, ErrorCode::Protocol, "registered memory bytes: size 0 (rank %d, pointer %p)", m->ownerRank,
             m->originalData);
  MORI_CHECK(m->originalData != nullptr, ErrorCode::Protocol,
             "registered memory bytes: null original pointer (rank %d)", m->ownerRank);
  MORI_CHECK(device <= 1, ErrorCode::Protocol, "registered memory bytes: device memory flag %u is neither 0 nor 1",
             device);
  m->deviceMemory = device != 0;
  m->transports = TransportFlags::FromBits(bits);
  MORI_CHECK(m->transports.Bits() == bits && !m->transports.Empty(), ErrorCode::Protocol,
             "registered memory bytes: transport flags 0x%x name no transport or unknown ones", bits);

  TransportFlags seen;
  uint32_t lastType = 0;
  for (uint16_t e = 0; e < count; ++e) {
    auto type = r.Get<uint32_t>("entry type");
    auto length = r.Get<uint32_t>("entry length");
    MORI_CHECK(type > static_cast<uint32_t>(Transport::Unknown) && type < static_cast<uint32_t>(kNumTransports),
               ErrorCode::Protocol, "registered memory bytes: entry %u names unknown transport %u", e, type);
    auto t = static_cast<Transport>(type);
    MORI_CHECK(!seen.Has(t), ErrorCode::Protocol, "registered memory bytes: duplicate entry for %s", TransportName(t));
    MORI_CHECK(type > lastType, ErrorCode::Protocol,
               "registered memory bytes: the %s entry comes after the %s entry (entries go in transport order)",
               TransportName(t), TransportName(static_cast<Transport>(lastType)));
    lastType = type;
    seen |= t;
    MORI_CHECK(m->transports.Has(t), ErrorCode::Protocol,
               "registered memory bytes: entry for %s, which the transport flags (%s) do not name", TransportName(t),
               m->transports.ToString().c_str());
    MORI_CHECK(length == EntryPayloadBytes(t), ErrorCode::Protocol,
               "registered memory bytes: the %s entry length is %u, expected %zu", TransportName(t), length,
               EntryPayloadBytes(t));
    r.Need(length, TransportName(t));
    if (t == Transport::CudaIpc) {
      IpcMemoryHandle h = r.Get<IpcMemoryHandle>("IPC handle");
      MORI_CHECK(ValidIpcKind(h.kind), ErrorCode::Protocol, "registered memory bytes: IPC handle of unknown kind %u",
                 h.kind);
      MORI_CHECK(h.bytes == m->size && h.ownerPid == m->ownerPid, ErrorCode::Protocol,
                 "registered memory bytes: the IPC handle covers %llu bytes of pid %llu, the memory is %llu bytes of "
                 "pid %llu",
                 static_cast<unsigned long long>(h.bytes), static_cast<unsigned long long>(h.ownerPid),
                 static_cast<unsigned long long>(m->size), static_cast<unsigned long long>(m->ownerPid));
      m->hasIpc = true;
      m->ipcHandle = h;
    } else if (IsRdmaTransport(t)) {
      RdmaRegistration& reg = m->rdma[static_cast<size_t>(RdmaSlotOf(t))];
      reg.valid = true;
      reg.addr = r.Get<uint64_t>("NIC address");
      reg.lkey = r.Get<uint32_t>("lkey");
      reg.rkey = r.Get<uint32_t>("rkey");
      reg.backend = r.Get<uint32_t>("NIC backend");
      auto pad = r.Get<uint32_t>("padding");
      MORI_CHECK(pad == 0, ErrorCode::Protocol, "registered memory bytes: the %s entry's padding is 0x%x, not 0",
                 TransportName(t), pad);
      MORI_CHECK(reg.addr == reinterpret_cast<uintptr_t>(m->originalData), ErrorCode::Protocol,
                 "registered memory bytes: the %s entry's address 0x%llx is not the memory's pointer %p",
                 TransportName(t), static_cast<unsigned long long>(reg.addr), m->originalData);
      MORI_CHECK(reg.backend <= 2, ErrorCode::Protocol, "registered memory bytes: the %s entry names NIC backend %u",
                 TransportName(t), reg.backend);
    } else {
      m->tcpKey = r.Get<uint32_t>("TCP key");
      MORI_CHECK(m->tcpKey != 0, ErrorCode::Protocol, "registered memory bytes: TCP key 0");
      m->hasTcp = true;
    }
  }
  MORI_CHECK(r.Left() == 0, ErrorCode::Protocol, "registered memory bytes: %zu bytes left after the last entry",
             r.Left());
  MORI_CHECK(seen == m->transports, ErrorCode::Protocol,
             "registered memory bytes: the transport flags name %s, the entries only %s",
             m->transports.ToString().c_str(), seen.ToString().c_str());

  if (m->ownerHostId == HostIdentity() && m->ownerPid == ThisPid() && m->ownerToken == ProcessToken()) {
    m->data = m->originalData;
    m->local = true;
  }
  return m;
}

bool IpcKindNeedsFd(const IpcMemoryHandle& handle) {
  return handle.kind == static_cast<uint32_t>(IpcMemoryKind::HostMemfd) ||
         handle.kind == static_cast<uint32_t>(IpcMemoryKind::CudaVmm);
}

bool NeedsIpcMapping(const RegisteredMemory::Impl& m) {
  return m.hasIpc && !m.local && m.data == nullptr && m.ownerHostId == HostIdentity();
}

void MapRegisteredMemory(RegisteredMemory::Impl& m, UniqueFd fd) {
  std::shared_ptr<IpcMemoryMapping> mapping = IpcMemoryMapping::Import(m.ipcHandle, std::move(fd));
  m.data = mapping->Data();
  m.mapping = std::move(mapping);
}

RegisteredMemory RegisteredMemory::Deserialize(const std::vector<uint8_t>& data, UniqueFd fd) {
  std::shared_ptr<Impl> m = ParseRegisteredMemory(data);
  if (NeedsIpcMapping(*m)) {
    bool needsFd = IpcKindNeedsFd(m->ipcHandle);
    if (needsFd && fd.Valid()) {
      MapRegisteredMemory(*m, std::move(fd));
    } else if (!needsFd) {
      MapRegisteredMemory(*m, UniqueFd());
    }
  }
  return RegisteredMemory(std::move(m));
}

RegisteredMemory MakeRegisteredView(const RegisteredMemory& parent, uint64_t offset, uint64_t bytes) {
  const RegisteredMemory::Impl& p = Checked(parent.GetImpl());
  MORI_CHECK(p.local, ErrorCode::Internal, "a view can only be carved from memory registered in this process");
  MORI_CHECK(bytes > 0 && offset <= p.size && bytes <= p.size - offset, ErrorCode::Internal,
             "view [%llu, + %llu) of %llu-byte memory", static_cast<unsigned long long>(offset),
             static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(p.size));
  auto v = std::make_shared<RegisteredMemory::Impl>();
  v->data = static_cast<char*>(p.data) + offset;
  v->originalData = static_cast<char*>(p.originalData) + offset;
  v->size = bytes;
  v->ownerRank = p.ownerRank;
  v->ownerHostId = p.ownerHostId;
  v->ownerPid = p.ownerPid;
  v->ownerToken = p.ownerToken;
  v->local = true;
  v->deviceMemory = p.deviceMemory;
  v->transports = p.transports;
  if (p.hasIpc) {
    v->hasIpc = true;
    v->ipcHandle = p.ipcHandle;
    v->ipcHandle.offset += offset;
    v->ipcHandle.bytes = bytes;
  }
  for (int s = 0; s < kRdmaSlots; ++s) {
    v->rdma[static_cast<size_t>(s)] = p.rdma[static_cast<size_t>(s)];
    if (v->rdma[static_cast<size_t>(s)].valid) v->rdma[static_cast<size_t>(s)].addr += offset;
  }
  if (p.hasTcp) {
    v->tcpKey = tcp::RegisterTcpMemory(v->data, bytes, v->deviceMemory);
    v->hasTcp = true;
    uint32_t key = v->tcpKey;
    v->releasers.push_back([key] { tcp::DeregisterTcpMemory(key); });
    tcp::GrantTcpMemory(key, v->ownerRank);  // its owner, through a loopback connection
  }
  v->parent = parent;
  return RegisteredMemory(std::move(v));
}

bool IsDeviceMemoryPointer(const void* ptr) { return DeviceOfMemoryPointer(ptr) >= 0; }

int DeviceOfMemoryPointer(const void* ptr) {
#if MORI_BACKEND_HOST
  (void)ptr;
  return -1;
#else
  if (std::optional<alloc::Record> rec = alloc::Find(ptr)) {
    const bool device = rec->kind == alloc::AllocatorKind::CudaVmm || rec->kind == alloc::AllocatorKind::CudaMalloc ||
                        rec->kind == alloc::AllocatorKind::HipMalloc;
    return device ? rec->device : -1;
  }
#if MORI_BACKEND_CUDA
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();  // not memory the runtime knows: plain host memory
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
#else
  hipPointerAttribute_t attr;
  if (hipPointerGetAttributes(&attr, ptr) != hipSuccess) {
    (void)hipGetLastError();
    return -1;
  }
#if HIP_VERSION_MAJOR >= 6
  return attr.type == hipMemoryTypeDevice ? attr.device : -1;
#else
  return attr.memoryType == hipMemoryTypeDevice ? attr.device : -1;
#endif
#endif
#endif
}

}  // namespace mori::core
