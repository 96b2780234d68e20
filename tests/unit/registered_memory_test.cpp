// RegisteredMemory's wire format: round trips for each transport and for all of them at once, and malformed
// bytes of every kind rejected with a Protocol error that names what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/host_topology.hpp"
#include "registered_memory_impl.hpp"

namespace mori::core {
namespace {

constexpr uint64_t kSize = 12345;
const uintptr_t kPointer = 0x7f0012345000ull;

// Memory of a peer process on this host (pid differs), registered for `transports`, with made-up keys.
std::shared_ptr<RegisteredMemory::Impl> MakeImpl(TransportFlags transports, uint64_t pid) {
  auto m = std::make_shared<RegisteredMemory::Impl>();
  m->originalData = reinterpret_cast<void*>(kPointer);
  m->size = kSize;
  m->ownerRank = 3;
  m->ownerHostId = HostIdentity();
  m->ownerPid = pid;
  // This process's token with its pid; another process's (any other value) with another pid.
  m->ownerToken = pid == static_cast<uint64_t>(getpid()) ? ProcessToken() : ProcessToken() ^ 0x5eed;
  m->deviceMemory = true;
  m->transports = transports;
  if (transports.Has(Transport::CudaIpc)) {
    m->hasIpc = true;
    m->ipcHandle.magic = 0x1234;
    m->ipcHandle.kind = static_cast<uint32_t>(IpcMemoryKind::HostMemfd);  // needs a descriptor: never mapped here
    m->ipcHandle.ownerRank = 3;
    m->ipcHandle.ownerPid = pid;
    m->ipcHandle.allocationBytes = 1 << 20;
    m->ipcHandle.offset = 4096;
    m->ipcHandle.bytes = kSize;
  }
  for (int i = 0; i < kNumTransports; ++i) {
    auto t = static_cast<Transport>(i);
    if (!transports.Has(t) || !IsRdmaTransport(t)) continue;
    RdmaRegistration& r = m->rdma[static_cast<size_t>(RdmaSlotOf(t))];
    r.valid = true;
    r.addr = kPointer;
    r.lkey = 0x100u + static_cast<uint32_t>(i);
    r.rkey = 0x200u + static_cast<uint32_t>(i);
    r.backend = 2;
  }
  if (transports.Has(Transport::Tcp)) {
    m->hasTcp = true;
    m->tcpKey = 77;
  }
  return m;
}

uint64_t OtherPid() { return static_cast<uint64_t>(getpid()) + 100000; }

std::vector<uint8_t> Bytes(TransportFlags transports) {
  return RegisteredMemory(MakeImpl(transports, OtherPid())).Serialize();
}

template <typename T>
void Poke(std::vector<uint8_t>& b, size_t offset, T value) {
  ASSERT_LE(offset + sizeof(T), b.size());
  std::memcpy(b.data() + offset, &value, sizeof(T));
}

void FixTotal(std::vector<uint8_t>& b) { Poke<uint32_t>(b, 8, static_cast<uint32_t>(b.size())); }

// The bytes are refused with a Protocol error whose message contains `needle`.
void ExpectRejected(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    RegisteredMemory::Deserialize(bytes);
    ADD_FAILURE() << "accepted malformed bytes (expected an error about \"" << needle << "\")";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::Protocol) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

void ExpectSame(const RegisteredMemory::Impl& a, const RegisteredMemory::Impl& b) {
  EXPECT_EQ(a.originalData, b.originalData);
  EXPECT_EQ(a.size, b.size);
  EXPECT_EQ(a.ownerRank, b.ownerRank);
  EXPECT_EQ(a.ownerHostId, b.ownerHostId);
  EXPECT_EQ(a.ownerPid, b.ownerPid);
  EXPECT_EQ(a.ownerToken, b.ownerToken);
  EXPECT_EQ(a.deviceMemory, b.deviceMemory);
  EXPECT_EQ(a.transports, b.transports);
  EXPECT_EQ(a.hasIpc, b.hasIpc);
  if (a.hasIpc) {
    EXPECT_EQ(std::memcmp(&a.ipcHandle, &b.ipcHandle, sizeof(a.ipcHandle)), 0);
  }
  for (size_t s = 0; s < a.rdma.size(); ++s) {
    EXPECT_EQ(a.rdma[s].valid, b.rdma[s].valid) << "slot " << s;
    EXPECT_EQ(a.rdma[s].addr, b.rdma[s].addr) << "slot " << s;
    EXPECT_EQ(a.rdma[s].lkey, b.rdma[s].lkey) << "slot " << s;
    EXPECT_EQ(a.rdma[s].rkey, b.rdma[s].rkey) << "slot " << s;
    EXPECT_EQ(a.rdma[s].backend, b.rdma[s].backend) << "slot " << s;
  }
  EXPECT_EQ(a.hasTcp, b.hasTcp);
  EXPECT_EQ(a.tcpKey, b.tcpKey);
}

TEST(RegisteredMemoryWire, RoundTripsForEachTransportAndAllTogether) {
  std::vector<TransportFlags> sets;
  for (int i = 1; i < kNumTransports; ++i) sets.emplace_back(static_cast<Transport>(i));
  sets.push_back(Transport::CudaIpc | Transport::IB0 | Transport::IB3 | Transport::IB7 | Transport::Tcp |
                 Transport::Emulated);
  for (TransportFlags set : sets) {
    SCOPED_TRACE(set.ToString());
    auto original = MakeImpl(set, OtherPid());
    std::vector<uint8_t> bytes = RegisteredMemory(original).Serialize();
    RegisteredMemory back = RegisteredMemory::Deserialize(bytes);
    ExpectSame(*original, *back.GetImpl());
    EXPECT_FALSE(back.IsLocal());
    EXPECT_EQ(back.Data(), nullptr) << "a peer's memory is not reachable here without a mapping";
    EXPECT_EQ(back.OriginalDataPtr(), reinterpret_cast<void*>(kPointer));
    EXPECT_EQ(back.Rank(), 3);
    EXPECT_EQ(back.Serialize(), bytes) << "serializing what was parsed gives the same bytes";
  }
}

TEST(RegisteredMemoryWire, OwnBytesComeBackLocal) {
  auto original = MakeImpl(Transport::Emulated | Transport::Tcp, static_cast<uint64_t>(getpid()));
  RegisteredMemory back = RegisteredMemory::Deserialize(RegisteredMemory(original).Serialize());
  EXPECT_TRUE(back.IsLocal());
  EXPECT_EQ(back.Data(), reinterpret_cast<void*>(kPointer));
}

// Local means this very process: the same host and pid with another process's token (a process of the same pid
// in another container sharing the host's network) is a peer, and so is this token under another pid (a
// forked child's memory).
TEST(RegisteredMemoryWire, SamePidInAnotherProcessIsNotLocal) {
  auto stranger = MakeImpl(Transport::Emulated | Transport::Tcp, static_cast<uint64_t>(getpid()));
  stranger->ownerToken = ProcessToken() + 1;
  RegisteredMemory back = RegisteredMemory::Deserialize(RegisteredMemory(stranger).Serialize());
  EXPECT_FALSE(back.IsLocal());
  EXPECT_EQ(back.Data(), nullptr);

  auto child = MakeImpl(Transport::Emulated | Transport::Tcp, OtherPid());
  child->ownerToken = ProcessToken();
  back = RegisteredMemory::Deserialize(RegisteredMemory(child).Serialize());
  EXPECT_FALSE(back.IsLocal());
  EXPECT_EQ(back.Data(), nullptr);
  EXPECT_NE(ProcessToken(), 0u);
  EXPECT_EQ(ProcessToken(), ProcessToken());
}

TEST(RegisteredMemoryWire, RealRegistrationRoundTrips) {
  auto bootstrap = std::make_shared<SocketBootstrap>(0, 1);
  bootstrap->Initialize("127.0.0.1:" + std::to_string(test::FreeTcpPort()), 30);
  Communicator comm(bootstrap);
  GpuBuffer buffer(10007);
  RegisteredMemory mem =
      comm.RegisterMemory(buffer.Data(), 10007, Transport::CudaIpc | Transport::Emulated | Transport::Tcp);
  std::vector<uint8_t> bytes = mem.Serialize();
  EXPECT_EQ(bytes.size(), kRegisteredMemoryHeaderBytes + 3 * kRegisteredMemoryEntryHeaderBytes +
                              sizeof(IpcMemoryHandle) + kRdmaEntryBytes + kTcpEntryBytes);
  RegisteredMemory back = RegisteredMemory::Deserialize(bytes);
  ExpectSame(*mem.GetImpl(), *back.GetImpl());
  EXPECT_TRUE(back.IsLocal());
  EXPECT_EQ(back.Data(), buffer.Data());
  EXPECT_EQ(back.Rank(), 0);
}

// Every entry's offset in the bytes of all transports: CudaIpc, IB0, IB3, Tcp, Emulated.
constexpr size_t kIpcEntry = kRegisteredMemoryHeaderBytes;
constexpr size_t kIb0Entry = kIpcEntry + 8 + 112;
constexpr size_t kIb3Entry = kIb0Entry + 8 + kRdmaEntryBytes;
constexpr size_t kTcpEntry = kIb3Entry + 8 + kRdmaEntryBytes;
constexpr size_t kEmulatedEntry = kTcpEntry + 8 + kTcpEntryBytes;
constexpr size_t kAllBytes = kEmulatedEntry + 8 + kRdmaEntryBytes;

std::vector<uint8_t> AllBytes() {
  return Bytes(Transport::CudaIpc | Transport::IB0 | Transport::IB3 | Transport::Tcp | Transport::Emulated);
}

TEST(RegisteredMemoryWire, LayoutIsAsDocumented) {
  std::vector<uint8_t> b = AllBytes();
  ASSERT_EQ(b.size(), kAllBytes);
  uint32_t type = 0;
  std::memcpy(&type, b.data() + kIb3Entry, 4);
  EXPECT_EQ(type, static_cast<uint32_t>(Transport::IB3));
  std::memcpy(&type, b.data() + kTcpEntry, 4);
  EXPECT_EQ(type, static_cast<uint32_t>(Transport::Tcp));
  std::memcpy(&type, b.data() + kEmulatedEntry, 4);
  EXPECT_EQ(type, static_cast<uint32_t>(Transport::Emulated));
}

TEST(RegisteredMemoryWire, BadMagicVersionAndLengths) {
  std::vector<uint8_t> b = AllBytes();
  b[0] ^= 0x5a;
  ExpectRejected(b, "bad magic");

  b = AllBytes();
  Poke<uint16_t>(b, 4, 3);
  ExpectRejected(b, "version 3");

  b = AllBytes();
  Poke<uint16_t>(b, 4, 1);  // before the process token
  ExpectRejected(b, "version 1");

  b = AllBytes();
  ExpectRejected(std::vector<uint8_t>(b.begin(), b.begin() + 30), "truncated");
  ExpectRejected({}, "truncated");

  b = AllBytes();
  b.resize(b.size() - 1);
  ExpectRejected(b, "total length");  // the length field no longer matches

  b = AllBytes();
  b.resize(b.size() - 3);
  FixTotal(b);
  ExpectRejected(b, "truncated");  // consistent total, but the last entry is cut short

  b = AllBytes();
  b.push_back(0);
  FixTotal(b);
  ExpectRejected(b, "left after the last entry");
}

TEST(RegisteredMemoryWire, EntryCountAgainstTransportBits) {
  std::vector<uint8_t> b = AllBytes();
  Poke<uint16_t>(b, 6, 4);  // five entries follow, five transports named
  b.resize(kEmulatedEntry);
  FixTotal(b);
  ExpectRejected(b, "the entries only");

  b = AllBytes();
  Poke<uint16_t>(b, 6, 6);
  ExpectRejected(b, "truncated");  // a sixth entry is announced but none follows

  b = AllBytes();
  Poke<uint16_t>(b, 6, 200);
  ExpectRejected(b, "exceeds");

  b = AllBytes();
  uint32_t bits = (Transport::CudaIpc | Transport::IB0 | Transport::IB3 | Transport::Tcp).Bits();
  Poke<uint32_t>(b, 48, bits);  // the Emulated entry is not named by the flags
  ExpectRejected(b, "do not name");

  b = AllBytes();
  Poke<uint32_t>(b, 48, 0);
  ExpectRejected(b, "name no transport");

  b = AllBytes();
  Poke<uint32_t>(b, 48, 1u << 13 | TransportFlags(Transport::Tcp).Bits());
  ExpectRejected(b, "unknown ones");

  b = AllBytes();
  Poke<uint32_t>(b, kIb3Entry, static_cast<uint32_t>(Transport::IB0));  // IB0 twice
  ExpectRejected(b, "duplicate entry for IB0");
}

TEST(RegisteredMemoryWire, PayloadSizesAndUnknownTransports) {
  std::vector<uint8_t> b = AllBytes();
  Poke<uint32_t>(b, kTcpEntry + 4, 8);
  ExpectRejected(b, "Tcp entry length is 8, expected 4");

  b = AllBytes();
  Poke<uint32_t>(b, kIpcEntry + 4, 111);
  ExpectRejected(b, "CudaIpc entry length is 111, expected 112");

  b = AllBytes();
  Poke<uint32_t>(b, kIb0Entry + 4, 16);
  ExpectRejected(b, "IB0 entry length is 16");

  b = AllBytes();
  Poke<uint32_t>(b, kTcpEntry, 12);
  ExpectRejected(b, "unknown transport 12");

  b = AllBytes();
  Poke<uint32_t>(b, kTcpEntry, 0);
  ExpectRejected(b, "unknown transport 0");
}

TEST(RegisteredMemoryWire, FieldValuesThatCannotBe) {
  std::vector<uint8_t> b = AllBytes();
  Poke<uint64_t>(b, 40, 0);
  ExpectRejected(b, "size 0");

  b = AllBytes();
  Poke<uint64_t>(b, 32, 0);
  ExpectRejected(b, "null original pointer");

  b = AllBytes();
  Poke<int32_t>(b, 12, -7);
  ExpectRejected(b, "owner rank -7");

  b = AllBytes();
  b[52] = 2;
  ExpectRejected(b, "device memory flag 2");

  b = AllBytes();
  Poke<uint32_t>(b, kIpcEntry + 8 + 4, 9);  // IpcMemoryHandle::kind
  ExpectRejected(b, "IPC handle of unknown kind 9");

  b = AllBytes();
  Poke<uint64_t>(b, kIpcEntry + 8 + 40, kSize + 1);  // IpcMemoryHandle::bytes
  ExpectRejected(b, "the IPC handle covers");

  b = AllBytes();
  Poke<uint64_t>(b, kIb3Entry + 8, kPointer + 8);
  ExpectRejected(b, "IB3 entry's address");

  b = AllBytes();
  Poke<uint32_t>(b, kEmulatedEntry + 8 + 16, 7);
  ExpectRejected(b, "NIC backend 7");

  b = AllBytes();
  Poke<uint32_t>(b, kTcpEntry + 8, 0);
  ExpectRejected(b, "TCP key 0");
}

// Found by fuzz_registered_memory: bytes that differ from Serialize's only in fields the parser skipped were
// accepted, so one memory had many encodings. Every accepted input now serializes back to itself.
TEST(RegisteredMemoryWire, OnlyTheCanonicalEncodingIsAccepted) {
  const std::vector<uint8_t> all = AllBytes();
  EXPECT_EQ(SerializeRegisteredMemory(*ParseRegisteredMemory(all)), all);

  std::vector<uint8_t> b = all;
  b[55] = 0x4e;  // the fuzzer's input: the last header padding byte set
  ExpectRejected(b, "header padding byte 2 is 0x4e");

  b = all;
  Poke<uint32_t>(b, kIb3Entry + 8 + 20, 0x5a5a);
  ExpectRejected(b, "the IB3 entry's padding is 0x5a5a");

  b = all;  // IB3's entry before IB0's: same transports, same fields, another order
  std::copy(all.begin() + kIb3Entry, all.begin() + kTcpEntry, b.begin() + kIb0Entry);
  std::copy(all.begin() + kIb0Entry, all.begin() + kIb3Entry, b.begin() + kIb3Entry);
  ExpectRejected(b, "the IB0 entry comes after the IB3 entry");
}

TEST(RegisteredMemoryWire, EmptyMemoryIsAnErrorNotACrash) {
  RegisteredMemory empty;
  EXPECT_FALSE(empty.Valid());
  EXPECT_THROW(empty.Serialize(), Error);
  EXPECT_THROW(empty.Size(), Error);
}

}  // namespace
}  // namespace mori::core
