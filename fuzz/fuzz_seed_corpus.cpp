// Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/) from messages that mori's own encoders produce:
// unique ids from UniqueIdFromAddress, RegisteredMemory bytes from SerializeRegisteredMemory, TCP handles from
// EncodeHandle and frames from MakeFrame, emulated NIC headers from MakePacketHeader, SHMEM proxy requests from
// EncodeProxyHeader and ProxyPayload, TCP frame streams from MakeFrame with the fields TcpLink's sender sets.
// EncodeProxyHeader and ProxyPayload, emulated NIC packet streams from MakePacketHeader and PacketCheck.
// EncodeProxyHeader and ProxyPayload, bootstrap streams from bootstrap_wire::MakeHeader and SocketAddress::ToWire.
// Usage: fuzz_seed_corpus DIR (scripts/fuzz.sh does not run it; the corpora are kept in the tree).
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bootstrap_wire.hpp"
#include "emulated/wire.hpp"
#include "fuzz_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/channels/proxy_trigger.hpp"
#include "mori/core/ipc.hpp"
#include "mori/rdma/device_primitives.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"
#include "mori/shmem/shmem_proxy_request.hpp"
#include "registered_memory_impl.hpp"
#include "tcp/tcp_wire.hpp"

namespace {

using Bytes = std::vector<uint8_t>;
namespace bw = mori::core::bootstrap_wire;
namespace tcp = mori::core::tcp;
namespace em = mori::rdma::emulated;
using mori::core::Transport;
using mori::core::TransportFlags;

template <typename T>
void Append(Bytes& out, const T& value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

void Write(const std::string& dir, const std::string& target, const std::string& name, const Bytes& bytes) {
  const std::string path = dir + "/" + target + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::exit(1);
  }
}

// fuzz_bootstrap_id: id, frame header, hello, world size.
void BootstrapSeeds(const std::string& dir) {
  const char* roots[] = {"127.0.0.1:29500", "[::1]:29501"};
  const bw::FrameType types[] = {bw::FrameType::Hello, bw::FrameType::Table, bw::FrameType::Abort, bw::FrameType::Data,
                                 bw::FrameType::Collective};
  int n = 0;
  for (const char* root : roots) {
    mori::core::UniqueId id = mori::core::SocketBootstrap::UniqueIdFromAddress(root);
    bw::UniqueIdLayout layout;
    std::memcpy(&layout, id.bytes, sizeof(layout));
    for (bw::FrameType type : types) {
      bw::FrameHeader h{bw::kFrameMagic,
                        bw::kVersion,
                        static_cast<uint16_t>(type),
                        1,
                        7,
                        type == bw::FrameType::Hello ? sizeof(bw::HelloPayload) : 4096};
      bw::HelloPayload hello{};
      hello.nonce = layout.nonce;
      hello.rank = 1;
      hello.nRanks = 4;
      hello.purpose =
          static_cast<uint32_t>(type == bw::FrameType::Hello ? bw::HelloPurpose::Register : bw::HelloPurpose::Data);
      hello.listen = layout.root;
      Bytes b;
      Append(b, id);
      Append(b, h);
      Append(b, hello);
      Append(b, int32_t{4});
      Write(dir, "fuzz_bootstrap_id", "id_" + std::to_string(n++) + "_" + bw::FrameTypeName(h.type), b);
    }
  }
}

// fuzz_registered_memory: Serialize's bytes for one transport of each kind and for several at once.
void RegisteredMemorySeeds(const std::string& dir) {
  const TransportFlags sets[] = {Transport::CudaIpc,
                                 Transport::IB0,
                                 Transport::Tcp,
                                 Transport::Emulated,
                                 TransportFlags(Transport::CudaIpc) | Transport::IB3 | Transport::Tcp,
                                 TransportFlags(Transport::IB0) | Transport::IB1 | Transport::Emulated};
  int n = 0;
  for (TransportFlags set : sets) {
    mori::core::RegisteredMemory::Impl m;
    m.originalData = reinterpret_cast<void*>(uintptr_t{0x7f0012340000});
    m.size = 1 << 20;
    m.ownerRank = 2;
    m.ownerHostId = 0x686f73742d6f6e65ull;  // fixed, so that the seeds do not change between runs
    m.ownerPid = 4242;
    m.ownerToken = 0x5eed5eed5eedull;
    m.transports = set;
    if (set.Has(Transport::CudaIpc)) {
      m.hasIpc = true;
      m.ipcHandle.magic = 0x4d495043;
      m.ipcHandle.kind = static_cast<uint32_t>(mori::core::IpcMemoryKind::HostMemfd);
      m.ipcHandle.ownerRank = 2;
      m.ipcHandle.ownerPid = m.ownerPid;
      m.ipcHandle.allocationBytes = 4 << 20;
      m.ipcHandle.offset = 1 << 20;
      m.ipcHandle.bytes = m.size;
    }
    for (int i = 0; i < mori::core::kNumTransports; ++i) {
      auto t = static_cast<Transport>(i);
      if (!set.Has(t) || !mori::core::IsRdmaTransport(t)) continue;
      mori::core::RdmaRegistration& r = m.rdma[static_cast<size_t>(mori::core::RdmaSlotOf(t))];
      r.valid = true;
      r.addr = reinterpret_cast<uintptr_t>(m.originalData);
      r.lkey = 0x1100u + static_cast<uint32_t>(i);
      r.rkey = 0x2200u + static_cast<uint32_t>(i);
      r.backend = t == Transport::Emulated ? 2 : 1;
    }
    if (set.Has(Transport::Tcp)) {
      m.hasTcp = true;
      m.tcpKey = 41;
    }
    Write(dir, "fuzz_registered_memory", "memory_" + std::to_string(n++), mori::core::SerializeRegisteredMemory(m));
  }
}

// fuzz_tcp_wire: u16 handle length, handle, frames, hello.
void TcpSeeds(const std::string& dir) {
  for (int channels : {1, 4}) {
    tcp::TcpHandle handle;
    handle.nonce = 0x1234567890abcdefull;
    handle.rank = 1;
    for (int c = 0; c < channels; ++c) {
      handle.addresses.push_back(mori::core::net::SocketAddress::Parse(c % 2 == 0 ? "127.0.0.1:40001" : "[::1]:40002"));
    }
    Bytes encoded = tcp::EncodeHandle(handle);
    for (uint16_t type = 1; type <= tcp::kLastFrameType; ++type) {
      Bytes b;
      Append(b, static_cast<uint16_t>(encoded.size()));
      b.insert(b.end(), encoded.begin(), encoded.end());
      tcp::FrameHeader f = tcp::MakeFrame(static_cast<tcp::FrameType>(type));
      f.key = 3;
      f.seq = tcp::IsOrderedFrame(type) ? 5 : 0;
      f.length = type == 1 ? sizeof(tcp::HelloPayload) : (type == 3 || type == 9) ? 4096 : type == 11 ? 16 : 0;
      f.arg0 = type == 7 ? 4096 : 0;
      Append(b, f);
      tcp::HelloPayload hello{0x1234567890abcdefull + 1, handle.nonce, 0, static_cast<uint32_t>(channels), 1, 0};
      Append(b, hello);
      Write(dir, "fuzz_tcp_wire", "channels" + std::to_string(channels) + "_" + tcp::FrameTypeName(type), b);
    }
  }
}

// fuzz_emulated_wire: the receiver's nonce, a hello, then one packet of each type, each header followed by a u8
// payload length and the payload, each with its integrity check.
void EmulatedSeeds(const std::string& dir) {
  const uint64_t nonce = 0x0badc0ffee0ddf00ull;
  for (uint8_t type = 1; type <= static_cast<uint8_t>(em::PacketType::Hello); ++type) {
    Bytes b;
    Append(b, nonce);
    em::PacketHeader hello = em::MakePacketHeader(em::PacketType::Hello);
    hello.raddr = nonce;
    hello.swapAdd = 0x1122334455667788ull;
    hello.icrc = em::PacketCheck(hello, nullptr, 0);
    Append(b, hello);
    Append(b, uint8_t{0});
    em::PacketHeader h = em::MakePacketHeader(static_cast<em::PacketType>(type));
    h.srcQpn = 0x1100;
    h.dstQpn = 0x2200;
    h.psn = 9;
    h.rkey = 0x2203;
    h.raddr = 0x7f0012340000ull;
    h.length = (type == 1 || type == 2 || type == 4 || type == 6) ? 200 : 0;
    std::vector<uint8_t> payload(em::PayloadBytes(h));
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + type);
    h.icrc = em::PacketCheck(h, payload.data(), payload.size());
    Append(b, h);
    Append(b, static_cast<uint8_t>(payload.size()));
    for (uint8_t byte : payload) Append(b, byte);
    Write(dir, "fuzz_emulated_wire", "hello_then_type" + std::to_string(type), b);
  }
}

// fuzz_emulated_nic: a byte of options, a byte choosing the requester side's WQEs, then packets in the harness's
// relative encoding (QPNs and PSNs relative to the real ones, rkeys and raddrs naming the harness's buffers).
void EmulatedNicSeeds(const std::string& dir) {
  namespace f = mori::fuzz;
  mkdir((dir + "/fuzz_emulated_nic").c_str(), 0755);
  using em::PacketType;
  auto packet = [](PacketType type, uint32_t psn, uint32_t rkey, uint64_t raddr, Bytes payload, uint64_t length = 0) {
    em::PacketHeader h = em::MakePacketHeader(type);
    h.psn = psn;
    h.rkey = rkey;
    h.raddr = raddr;
    h.length = type == PacketType::ReadRequest ? length : payload.size();
    h.icrc = em::PacketCheck(h, payload.data(), payload.size());
    Bytes b;
    Append(b, h);
    b.insert(b.end(), payload.begin(), payload.end());
    return b;
  };
  auto bytes = [](size_t n, uint8_t seed) {
    Bytes b(n);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 13 * i);
    return b;
  };
  auto atomic = [&](uint32_t psn, mori::rdma::AtomicOp op, uint64_t raddr, uint64_t swapAdd, uint64_t compare) {
    Bytes b = packet(PacketType::AtomicRequest, psn, f::kNicAll, raddr, {});
    em::PacketHeader h;
    std::memcpy(&h, b.data(), sizeof(h));
    h.atomicOp = static_cast<uint8_t>(op);
    h.swapAdd = swapAdd;
    h.compare = compare;
    h.icrc = em::PacketCheck(h, nullptr, 0);
    std::memcpy(b.data(), &h, sizeof(h));
    return b;
  };
  auto response = [&](PacketType type, uint32_t psn, uint8_t syndrome, Bytes payload, uint64_t value = 0) {
    Bytes b = packet(type, psn, 0, 0, payload);
    em::PacketHeader h;
    std::memcpy(&h, b.data(), sizeof(h));
    h.syndrome = syndrome;
    h.swapAdd = value;
    h.icrc = em::PacketCheck(h, payload.data(), payload.size());
    std::memcpy(b.data(), &h, sizeof(h));
    return b;
  };
  auto seed = [&](const std::string& name, uint8_t options, uint8_t wqes, std::vector<Bytes> packets) {
    Bytes b{options, wqes};
    for (const Bytes& p : packets) b.insert(b.end(), p.begin(), p.end());
    Write(dir, "fuzz_emulated_nic", name, b);
  };
  using mori::rdma::AtomicOp;
  const Bytes write = packet(PacketType::WriteRequest, 0, f::kNicAll, f::NicAddress(f::kNicAll, 16), bytes(64, 1));
  const Bytes read = packet(PacketType::ReadRequest, 0, f::kNicReadOnly, f::NicAddress(f::kNicReadOnly, 8), {}, 32);
  const Bytes send = packet(PacketType::SendRequest, 0, 0, 0, bytes(40, 2));
  seed("write", 0, 0, {write});
  seed("read", 0, 0, {read});
  seed("fetch_add", 0, 0, {atomic(0, AtomicOp::FetchAdd, f::NicAddress(f::kNicAll, 8), 5, 0)});
  seed("compare_swap", 0, 0, {atomic(0, AtomicOp::CompareSwap, f::NicAddress(f::kNicAll, 0), 77, 0x1122)});
  seed("send", 0, 0, {send});
  seed("every_request_in_sequence", 0, 0,
       {packet(PacketType::WriteRequest, 0, f::kNicWriteOnly, f::NicAddress(f::kNicWriteOnly, 0), bytes(64, 3)),
        packet(PacketType::ReadRequest, 1, f::kNicAll, f::NicAddress(f::kNicAll, 200), {}, 56),
        atomic(2, AtomicOp::FetchAdd, f::NicAddress(f::kNicAll, 248), 1, 0),
        atomic(3, AtomicOp::CompareSwap, f::NicAddress(f::kNicAll, 240), 9, 0),
        packet(PacketType::SendRequest, 4, 0, 0, bytes(64, 4)), packet(PacketType::SendRequest, 5, 0, 0, bytes(1, 5)),
        packet(PacketType::ReadRequest, 6, f::kNicAll, f::NicAddress(f::kNicAll, 256), {}, 0)});
  seed("write_then_read_back", 0, 0,
       {packet(PacketType::WriteRequest, 0, f::kNicAll, f::NicAddress(f::kNicAll, 32), bytes(16, 6)),
        packet(PacketType::ReadRequest, 1, f::kNicAll, f::NicAddress(f::kNicAll, 24), {}, 32)});
  seed("psn_out_of_order", 0, 0,
       {packet(PacketType::WriteRequest, 1, f::kNicAll, f::NicAddress(f::kNicAll, 0), bytes(8, 7)), write});
  seed("bad_key_then_good", 0, 0,
       {packet(PacketType::WriteRequest, 0, 0x77, f::NicAddress(f::kNicAll, 0), bytes(8, 8)), write});
  seed("write_to_read_only_and_local", 0, 0,
       {packet(PacketType::WriteRequest, 0, f::kNicReadOnly, f::NicAddress(f::kNicReadOnly, 0), bytes(8, 9)),
        packet(PacketType::WriteRequest, 0, f::kNicLocal, f::NicAddress(f::kNicLocal, 0), bytes(8, 9)), write});
  seed("write_past_the_end", 0, 0,
       {packet(PacketType::WriteRequest, 0, f::kNicAll, f::NicAddress(f::kNicAll, 250), bytes(8, 10)), write});
  seed("misaligned_atomic", 0, 0, {atomic(0, AtomicOp::FetchAdd, f::NicAddress(f::kNicAll, 4), 1, 0), write});
  seed("send_too_large", 0, 0, {packet(PacketType::SendRequest, 0, 0, 0, bytes(100, 11)), write});
  seed("send_without_receive", f::kNicNoReceives, 0, {send, write});
  seed("fuzzed_hello", f::kNicFuzzHello, 0, {packet(PacketType::Hello, 0, 0, 0, {}), write});
  seed("psn_wrap", f::kNicWrapPsn, 0,
       {packet(PacketType::WriteRequest, 0, f::kNicAll, f::NicAddress(f::kNicAll, 0), bytes(8, 12)),
        packet(PacketType::WriteRequest, 1, f::kNicAll, f::NicAddress(f::kNicAll, 8), bytes(8, 13)),
        packet(PacketType::WriteRequest, 2, f::kNicAll, f::NicAddress(f::kNicAll, 16), bytes(8, 14))});
  Bytes cut = packet(PacketType::WriteRequest, 1, f::kNicAll, f::NicAddress(f::kNicAll, 64), bytes(64, 15));
  cut.resize(sizeof(em::PacketHeader) + 10);
  seed("closed_mid_payload", 0, 0, {write, cut});
  seed("response_on_a_request_connection", 0, 0, {response(PacketType::Ack, 0, 0, {}), write});
  seed("check_as_written", f::kNicRawCheck, 0, {write, read});

  // Requester side: answers to the WQEs the harness posts (all eight unless the mask says otherwise).
  const std::vector<Bytes> answers = {
      response(PacketType::Ack, 0, 0, {}), response(PacketType::ReadResponse, 1, 0, bytes(48, 20)),
      response(PacketType::AtomicResponse, 2, 0, {}, 0x0102030405060708ull),
      response(PacketType::AtomicResponse, 3, 0, {}, 0x2222), response(PacketType::Ack, 4, 0, {}),
      response(PacketType::ReadResponse, 5, 0, {}), response(PacketType::Ack, 6, 0, {}),
      response(PacketType::ReadResponse, 7, 0, bytes(100, 21))};
  seed("answers", f::kNicRequester, 0, answers);
  seed("answers_psn_wrap", f::kNicRequester | f::kNicWrapPsn, 0, answers);
  seed("answers_reversed", f::kNicRequester, 0, std::vector<Bytes>(answers.rbegin(), answers.rend()));
  std::vector<Bytes> nakFirst = answers;
  nakFirst[0] = response(PacketType::Ack, 0, mori::rdma::mlx5::kSyndromeRemoteAccessErr, {});
  seed("answers_nak_first", f::kNicRequester, 0, nakFirst);
  seed("read_answered_short", f::kNicRequester, 1u << f::kNicRead, {response(PacketType::ReadResponse, 0, 0, bytes(20, 22))});
  seed("read_answered_with_ack", f::kNicRequester, 1u << f::kNicRead, {response(PacketType::Ack, 0, 0, {})});
  seed("no_answer", f::kNicRequester, 0, {});
  seed("request_on_a_requester_connection", f::kNicRequester, 0, {answers[0], write, answers[1]});
}

// fuzz_fd_channel: a byte of options (1: one descriptor; 4: claim the fuzzing process's pid), then what FdChannel::Send
// of rank 1 puts on the wire, caught by a plain socket bound at rank 0's name.
void FdChannelSeeds(const std::string& dir) {
  int rank0 = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  int n = std::snprintf(addr.sun_path + 1, sizeof(addr.sun_path) - 1, "mori-ipc-%016llx-%d",
                        static_cast<unsigned long long>(mori::fuzz::kFdChannelJobId), 0);
  if (rank0 < 0 || bind(rank0, reinterpret_cast<sockaddr*>(&addr),
                        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n))) {
    std::perror("fuzz_fd_channel seeds: bind");
    std::exit(1);
  }
  mori::core::FdChannel rank1(mori::fuzz::kFdChannelJobId, 1, {getpid(), getpid()});
  const char payload[] = "an IpcMemoryHandle or a semaphore's words travel here";
  int seed = 0;
  for (size_t bytes : {size_t{0}, size_t{8}, sizeof(payload)}) {
    for (int fd : {-1, rank0}) {
      rank1.Send(0, 40 + bytes, fd, payload, bytes);
      Bytes b(1 + mori::core::FdChannel::kMaxPayload + 64);
      b[0] = (fd >= 0 ? 1 : 0) | 4;
      ssize_t got = recv(rank0, b.data() + 1, b.size() - 1, 0);  // a descriptor that came is closed by the kernel
      if (got < 0) {
        std::perror("fuzz_fd_channel seeds: recv");
        std::exit(1);
      }
      b.resize(1 + static_cast<size_t>(got));
      // The harness writes its own pid and uid there (bit 4 above): zero, the seed is the same on every run.
      std::memset(b.data() + 1 + mori::fuzz::kFdChannelPidOffset, 0,
                  mori::fuzz::kFdChannelUidOffset + sizeof(uint32_t) - mori::fuzz::kFdChannelPidOffset);
      Write(dir, "fuzz_fd_channel", "message_" + std::to_string(seed++) + (fd >= 0 ? "_fd" : ""), b);
    }
  }
  close(rank0);
}

}  // namespace

// fuzz_shmem_proxy: one file per request kind (each as the device API encodes it, then a quiet of every PE), and
// one with all of them in a row. Local addresses use the harness's tags: 01 = the heap's base, 10 = the region's.
void ShmemProxySeeds(const std::string& dir) {
  namespace sh = mori::shmem;
  const uint64_t heap = uint64_t{1} << 62, region = uint64_t{2} << 62;
  auto header = [](sh::ProxyOp op, uint32_t slots, uint32_t sub, uint32_t width, uint32_t pe, uint64_t bytes) {
    return sh::EncodeProxyHeader(sh::ProxyHeader{op, slots, sub, width, pe, bytes});
  };
  using Req = std::vector<mori::core::ProxyTrigger>;
  const std::vector<std::pair<std::string, Req>> kinds = {
      {"put", {header(sh::ProxyOp::Put, 2, 0, 0, 1, 256), sh::ProxyPayload(heap + 64, 1024)}},
      {"put_flush_from_region", {header(sh::ProxyOp::Put, 2, sh::kProxyFlagFlush, 0, 2, 100),
                                 sh::ProxyPayload(region + 8, 3900)}},
      {"get_into_region", {header(sh::ProxyOp::Get, 2, 0, 0, 2, 512), sh::ProxyPayload(region, 0)}},
      {"put_inline", {header(sh::ProxyOp::PutInline, 3, 0, 0, 1, 12), sh::ProxyPayload(0x0102030405060708ull, 40),
                      sh::ProxyPayload(0x11121314ull, 0)}},
      {"get_inline", {header(sh::ProxyOp::GetInline, 3, 0, 0, 1, 8), sh::ProxyPayload(0, 16),
                      sh::ProxyPayload(0, 7)}},
      {"signal_set", {header(sh::ProxyOp::Signal, 2, 0, 0, 1, 0), sh::ProxyPayload(42, 4088)}},
      {"signal_add", {header(sh::ProxyOp::Signal, 2, 1, 0, 0, 0), sh::ProxyPayload(3, 8)}},
      {"put_signal", {header(sh::ProxyOp::PutSignal, 3, 0, 0, 1, 64), sh::ProxyPayload(heap + 128, 256),
                      sh::ProxyPayload(7, 2048)}},
      {"quiet_one", {header(sh::ProxyOp::Quiet, 1, 0, 0, 2, 0)}},
      {"fence", {header(sh::ProxyOp::Fence, 1, 0, 0, 0, 0)}},
  };
  Bytes all;
  for (const auto& [name, req] : kinds) {
    Bytes b;
    for (const auto& t : req) Append(b, t);
    Append(b, header(sh::ProxyOp::Quiet, 1, 0, 0, sh::kProxyAllPes, 0));
    Write(dir, "fuzz_shmem_proxy", name, b);
    all.insert(all.end(), b.begin(), b.end());
  }
  for (uint32_t amo = 0; amo <= static_cast<uint32_t>(sh::ProxyAmo::Set); ++amo) {
    for (uint32_t width : {4u, 8u}) {
      Bytes b;
      Append(b, header(sh::ProxyOp::Atomic, 3, amo, width, 1, 0));
      Append(b, sh::ProxyPayload(5, width == 4 ? 12 : 16));
      Append(b, sh::ProxyPayload(0, amo == 1 ? sh::kProxyNoResult : 3));
      Write(dir, "fuzz_shmem_proxy", "atomic" + std::to_string(amo) + "_w" + std::to_string(width), b);
      all.insert(all.end(), b.begin(), b.end());
    }
  }
  Write(dir, "fuzz_shmem_proxy", "all_kinds", all);
}

// Port channel requests as PortChannel's device code encodes them, against fuzz_port_channel's service (memories
// of 8, 64, 1000, 4096 and 257 bytes; semaphores 0..3): each kind of request, one reaching exactly the end of a
// memory, and a mixed sequence.
void PortChannelSeeds(const std::string& dir) {
  namespace core = mori::core;
  auto req = [](uint32_t type, uint32_t sem, uint32_t dst, uint32_t src, uint64_t dstOff, uint64_t srcOff,
                uint64_t size) {
    return core::EncodePortRequest(core::PortRequest{type, sem, dst, src, dstOff, srcOff, size});
  };
  const uint32_t data = core::kTriggerData, signal = core::kTriggerSignal, flush = core::kTriggerFlush;
  const std::vector<std::pair<std::string, std::vector<core::ProxyTrigger>>> kinds = {
      {"put", {req(data, 0, 3, 2, 128, 8, 512)}},
      {"put_signal", {req(data | signal, 2, 1, 3, 0, 4000, 64)}},
      {"put_signal_flush", {req(data | signal | flush, 1, 2, 4, 743, 0, 257)}},
      {"signal", {req(signal, 3, 0, 0, 0, 0, 0)}},
      {"flush", {req(flush, 0, 0, 0, 0, 0, 0)}},
      {"put_to_the_end", {req(data, 1, 0, 1, 0, 56, 8), req(data, 0, 3, 3, 4032, 0, 64)}},
      {"put_within_one_memory", {req(data | signal, 0, 3, 3, 100, 90, 1000)}},
      {"empty_put_then_signal", {req(data | signal, 2, 4, 4, 257, 257, 0)}},
  };
  Bytes all;
  for (const auto& [name, triggers] : kinds) {
    Bytes b;
    for (const auto& t : triggers) Append(b, t);
    Write(dir, "fuzz_port_channel", name, b);
    all.insert(all.end(), b.begin(), b.end());
  }
  Write(dir, "fuzz_port_channel", "all_kinds", all);
}

// fuzz_tcp_stream: an options byte, then frames, each a channel byte, a header from MakeFrame with the fields the
// link's sender sets (sequence numbers per channel, Write chunk g on channel g % N, word operations and reads on
// channel 0 carrying the Write chunks before them) and its payload. Keys 0 to 2 name the harness's registrations.
class TcpStream {
 public:
  TcpStream(uint8_t options, int channels) : channels_(channels), seq_(static_cast<size_t>(channels), 0) {
    bytes_.push_back(static_cast<uint8_t>(options | (channels - 1)));
  }

  // A Write of `length` bytes at key/offset, cut into `chunk`-byte chunks dealt round-robin.
  TcpStream& Write(uint32_t key, uint64_t offset, uint32_t length, uint32_t chunk = 4096) {
    for (uint32_t off = 0; off < length; off += chunk) {
      tcp::FrameHeader h = tcp::MakeFrame(tcp::FrameType::Write);
      h.key = key;
      h.offset = offset + off;
      h.length = std::min(chunk, length - off);
      h.before = writeChunks_;
      const int c = static_cast<int>(writeChunks_++ % static_cast<uint64_t>(channels_));
      Bytes payload(h.length);
      for (uint32_t i = 0; i < h.length; ++i) payload[i] = static_cast<uint8_t>(0xa0 + (off + i) * 7);
      Ordered(c, h, payload);
    }
    return *this;
  }
  // Update, FetchAdd, CompareSwap or ReadRequest (arg0: the bytes to read) on channel 0.
  TcpStream& Op(tcp::FrameType type, uint32_t key, uint64_t offset, uint64_t arg0, uint64_t arg1 = 0) {
    tcp::FrameHeader h = tcp::MakeFrame(type);
    h.key = key;
    h.offset = offset;
    h.before = writeChunks_;
    h.arg0 = arg0;
    h.arg1 = arg1;
    if (type != tcp::FrameType::Update) h.id = nextId_++;
    Ordered(0, h, {});
    return *this;
  }
  // A frame that is not ordered (answers, Fail, Close, or one out of place), as it is.
  TcpStream& Frame(int channel, tcp::FrameHeader h, const Bytes& payload = {}) {
    h.length = static_cast<uint32_t>(payload.size());
    bytes_.push_back(static_cast<uint8_t>(channel));
    Append(bytes_, h);
    bytes_.insert(bytes_.end(), payload.begin(), payload.end());
    return *this;
  }
  // Drops the last `n` bytes: the connection closes in the middle of a frame.
  TcpStream& Cut(size_t n) {
    bytes_.resize(bytes_.size() - n);
    return *this;
  }
  const Bytes& Stream() const { return bytes_; }

 private:
  void Ordered(int c, tcp::FrameHeader h, const Bytes& payload) {
    h.seq = ++seq_[static_cast<size_t>(c)];
    Frame(c, h, payload);
  }

  int channels_;
  std::vector<uint64_t> seq_;
  uint64_t writeChunks_ = 0;
  uint64_t nextId_ = 1;
  Bytes bytes_;
};

void TcpStreamSeeds(const std::string& dir) {
  namespace ts = mori::fuzz::tcp_stream;
  using tcp::FrameType;
  const auto frame = [](FrameType type, uint64_t id = 0, uint64_t seqOrOffset = 0, uint64_t arg0 = 0) {
    tcp::FrameHeader h = tcp::MakeFrame(type);
    h.id = id;
    if (type == FrameType::Ack) h.seq = seqOrOffset;
    if (type == FrameType::ReadData) h.offset = seqOrOffset;
    h.arg0 = arg0;
    return h;
  };
  const auto text = [](const char* s) { return Bytes(s, s + std::strlen(s)); };
  const auto put = [&](const std::string& name, const TcpStream& s) {
    Write(dir, "fuzz_tcp_stream", name, s.Stream());
  };

  // One of each frame type the peer sends after setup.
  put("write", TcpStream(0, 1).Write(0, 128, 200));
  put("write_device", TcpStream(0, 1).Write(1, 16, 100));
  put("update", TcpStream(0, 1).Op(FrameType::Update, 0, 64, 0x1122334455667788ull));
  put("fetch_add", TcpStream(0, 1).Op(FrameType::FetchAdd, 0, 72, 5));
  put("compare_swap", TcpStream(0, 1).Op(FrameType::CompareSwap, 1, 8, 0, 9));
  put("read_request", TcpStream(0, 1).Op(FrameType::ReadRequest, 0, 256, 300));
  // The link issued a 96-byte read (requests 1 and 2 of 64 and 32 bytes), a fetch-add (3), a compare-swap (4).
  put("ack", TcpStream(ts::kIssue, 1).Frame(0, frame(FrameType::Ack, 0, 4)));
  put("read_data", TcpStream(ts::kIssue, 1)
                       .Frame(0, frame(FrameType::ReadData, 1, 0), Bytes(64, 0x31))
                       .Frame(0, frame(FrameType::ReadData, 2, 0), Bytes(32, 0x32)));
  put("read_data_device",
      TcpStream(ts::kIssue | ts::kDeviceRead, 1).Frame(0, frame(FrameType::ReadData, 1, 0), Bytes(64, 0x33)));
  put("atomic_result", TcpStream(ts::kIssue, 1)
                           .Frame(0, frame(FrameType::AtomicResult, 3, 0, 41))
                           .Frame(0, frame(FrameType::AtomicResult, 4, 0, 1)));
  put("fail", TcpStream(0, 1).Frame(0, frame(FrameType::Fail), text("rank 1 gave up")));
  put("close", TcpStream(0, 1).Frame(0, frame(FrameType::Close)));
  put("hello_after_setup", TcpStream(0, 1).Frame(0, frame(FrameType::Hello), Bytes(sizeof(tcp::HelloPayload))));
  put("hello_ack_after_setup", TcpStream(0, 1).Frame(0, frame(FrameType::HelloAck)));

  // Sequences: writes over four channels, then word operations and a read ordered after them, then a Close.
  put("four_channels", TcpStream(0, 4)
                           .Write(0, 0, 1000, 128)
                           .Op(FrameType::Update, 0, 1000 / 8 * 8 + 8, 7)
                           .Op(FrameType::ReadRequest, 0, 0, 1024)
                           .Op(FrameType::FetchAdd, 1, 0, 3)
                           .Write(1, 64, 192, 64)
                           .Op(FrameType::CompareSwap, 1, 0, 3, 4)
                           .Frame(0, frame(FrameType::Close)));
  // Answers to everything the link issued, spread over two channels, among writes.
  put("answers_two_channels", TcpStream(ts::kIssue, 2)
                                  .Write(0, 512, 300, 100)
                                  .Frame(1, frame(FrameType::ReadData, 1, 0), Bytes(64, 0x41))
                                  .Frame(0, frame(FrameType::ReadData, 2, 0), Bytes(32, 0x42))
                                  .Frame(0, frame(FrameType::AtomicResult, 3, 0, 0))
                                  .Frame(0, frame(FrameType::AtomicResult, 4, 0, 1))
                                  .Frame(0, frame(FrameType::Ack, 0, 4))
                                  .Op(FrameType::Update, 0, 8, 1));
  // The connection closes in the middle of a Write's payload, and in the middle of a header.
  put("cut_payload", TcpStream(0, 1).Write(0, 0, 64).Write(0, 64, 200).Cut(50));
  put("cut_header", TcpStream(0, 2).Write(0, 0, 64).Op(FrameType::Update, 0, 0, 1).Cut(20));
  // The peer resets the connections after a write and a read.
  put("reset", TcpStream(ts::kReset, 2).Write(1, 0, 256, 64).Op(FrameType::ReadRequest, 1, 0, 256));
  // A stranger's valid hello reaches channel 0's listener first (with the listener's nonce put in): it takes the
  // channel, and the stream follows on it.
  for (bool realNonce : {false, true}) {
    TcpStream s(static_cast<uint8_t>(ts::kFuzzHello | (realNonce ? ts::kRealNonce : 0)), 1);
    tcp::FrameHeader h = tcp::MakeFrame(FrameType::Hello);
    h.length = sizeof(tcp::HelloPayload);
    tcp::HelloPayload hello{0, ts::kPeerNonce, 0, 1, 1, 0};
    Bytes b(s.Stream());
    Append(b, h);
    Append(b, hello);
    TcpStream rest(0, 1);
    rest.Write(0, 8, 16).Op(FrameType::FetchAdd, 0, 0, 1);
    b.insert(b.end(), rest.Stream().begin() + 1, rest.Stream().end());
    Write(dir, "fuzz_tcp_stream", realNonce ? "stranger_hello_valid" : "stranger_hello_foreign", b);
  }

  // The link connects (kConnect). Without kFuzzHello the harness answers as an acceptor does; with it the replies
  // are these: the acceptor's HelloAck per channel (tcp_setup.cpp's Accept: key the channel, arg0 the connector's
  // nonce, which the harness XORs in with kRealNonce, so 0 here), whole or cut, or something else where it is due.
  const auto reply = [](int channel, uint64_t nonce = 0) {
    tcp::FrameHeader ack = tcp::MakeFrame(FrameType::HelloAck);
    ack.key = static_cast<uint32_t>(channel);
    ack.arg0 = nonce;
    return ack;
  };
  const auto connect = [&](const std::string& name, uint8_t options, int channels,
                           const std::vector<tcp::FrameHeader>& replies, const TcpStream& rest, size_t cut = 0) {
    Bytes b(1, static_cast<uint8_t>(ts::kConnect | options | (channels - 1)));
    for (const tcp::FrameHeader& h : replies) Append(b, h);
    b.resize(b.size() - cut);
    b.insert(b.end(), rest.Stream().begin() + 1, rest.Stream().end());
    Write(dir, "fuzz_tcp_stream", "connect_" + name, b);
  };
  const uint8_t replied = ts::kFuzzHello | ts::kRealNonce;
  connect("accepted", 0, 2, {}, TcpStream(0, 2).Write(0, 0, 300, 64).Op(FrameType::FetchAdd, 0, 512, 2));
  connect("accepted_issue", ts::kIssue, 1, {},
          TcpStream(0, 1)
              .Frame(0, frame(FrameType::ReadData, 1, 0), Bytes(64, 0x51))
              .Frame(0, frame(FrameType::AtomicResult, 3, 0, 8))
              .Frame(0, frame(FrameType::Ack, 0, 4)));
  connect("replies", replied, 1, {reply(0)}, TcpStream(0, 1).Write(0, 64, 128).Op(FrameType::Update, 1, 8, 3));
  connect("replies_four_channels", replied, 4, {reply(0), reply(1), reply(2), reply(3)},
          TcpStream(0, 4).Write(0, 0, 512, 64).Frame(0, frame(FrameType::Close)));
  connect("reply_foreign_nonce", ts::kFuzzHello, 1, {reply(0, ts::kPeerNonce)}, TcpStream(0, 1));
  connect("reply_other_channel", replied, 2, {reply(0), reply(0)}, TcpStream(0, 2));
  connect("reply_with_payload", replied, 1, {[&] {
            tcp::FrameHeader h = reply(0);
            h.length = 8;
            return h;
          }()},
          TcpStream(0, 1));
  connect("reply_hello", replied, 1, {[] {
            tcp::FrameHeader h = tcp::MakeFrame(FrameType::Hello);
            h.length = sizeof(tcp::HelloPayload);
            return h;
          }()},
          TcpStream(0, 1));
  connect("reply_write", replied, 1, {frame(FrameType::Write)}, TcpStream(0, 1));
  connect("reply_cut", replied, 2, {reply(0), reply(1)}, TcpStream(0, 2), 40);
  connect("reply_cut_reset", replied | ts::kReset, 1, {reply(0)}, TcpStream(0, 1), 10);
}

// fuzz_bootstrap_stream: an options byte, then either the root's reply to a registration (tables with the real
// rank's entry patched in by the target, the root's two kinds of abort) or, in the data phase, a script of ops and
// the frames the other ranks send, as records (a frame may be split over records, records of peers interleave).
namespace bootstrap_stream_seeds {

namespace bs = mori::fuzz::bootstrap_stream;
using mori::core::net::SocketAddress;
using mori::core::net::WireAddress;

Bytes Frame(bw::FrameType type, int srcRank, int tag, const Bytes& payload) {
  Bytes b;
  Append(b, bw::MakeHeader(type, srcRank, tag, payload.size()));
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

Bytes Payload(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 3);
  return b;
}

// World size and the real rank (1 + choice % (world - 1)) as the options byte holds them.
uint8_t Options(int world, int rankChoice, uint8_t flags) {
  return static_cast<uint8_t>((world - 2) | (rankChoice << bs::kRankShift) | flags);
}

Bytes Table(int world, const char* host) {
  std::vector<WireAddress> table;
  for (int r = 0; r < world; ++r) {
    table.push_back(SocketAddress::Parse(std::string(host) + ":" + std::to_string(29500 + r)).ToWire());
  }
  Bytes b;
  Append(b, bw::MakeHeader(bw::FrameType::Table, 0, 0, table.size() * sizeof(WireAddress)));
  for (const WireAddress& w : table) Append(b, w);
  return b;
}

void AppendOp(Bytes& b, bs::OpKind kind, uint8_t peer, uint16_t bytes, int32_t tag) {
  Append(b, bs::OpSpec{static_cast<uint8_t>(kind), peer, bytes, tag});
}

void AppendRecord(Bytes& b, uint8_t peerIndex, const Bytes& bytes) {
  Append(b, bs::RecordHeader{peerIndex, {static_cast<uint8_t>(bytes.size()), static_cast<uint8_t>(bytes.size() >> 8)}});
  b.insert(b.end(), bytes.begin(), bytes.end());
}

void Seeds(const std::string& dir) {
  const std::string target = "fuzz_bootstrap_stream";
  for (int world : {2, 4, 5}) {
    Bytes b{Options(world, 0, bs::kPatchOwnEntry)};
    Bytes t = Table(world, "127.0.0.1");
    b.insert(b.end(), t.begin(), t.end());
    Write(dir, target, "table_ipv4_world" + std::to_string(world), b);
  }
  Bytes v6{Options(3, 1, bs::kPatchOwnEntry)};
  Bytes t6 = Table(3, "[::1]");
  v6.insert(v6.end(), t6.begin(), t6.end());
  Write(dir, target, "table_ipv6_world3", v6);

  // The reasons the root sends (socket_bootstrap.cpp's texts).
  const std::string job =
      "bootstrap root (rank 0 at 127.0.0.1:29500) waited 2 s; rank(s) 3 of 4 never registered (not started, "
      "crashed, or given another root address?)";
  const std::string refused =
      "its job nonce is not the root's: the ranks were given different MORI_BOOTSTRAP_SECRET values (or it is set "
      "on some of them only), or this process belongs to another job";
  for (auto [tag, reason, name] : {std::make_tuple(bw::kAbortJob, job, "abort_job"),
                                   std::make_tuple(bw::kAbortHelloRefused, refused, "abort_hello_refused")}) {
    Bytes b{Options(4, 1, 0)};
    Bytes f = Frame(bw::FrameType::Abort, 0, tag, Bytes(reason.begin(), reason.end()));
    b.insert(b.end(), f.begin(), f.end());
    Write(dir, target, name, b);
  }

  // Data phase. World 2, rank 1: the one other rank is 0 (peer index 0).
  {
    Bytes b{Options(2, 0, bs::kDataPhase), 1};
    AppendOp(b, bs::OpKind::Recv, 0, 16, 3);
    AppendRecord(b, 0, Frame(bw::FrameType::Data, 0, 3, Payload(16, 0x40)));
    Write(dir, target, "data_recv", b);
  }
  {
    Bytes b{Options(2, 0, bs::kDataPhase), 1};
    AppendOp(b, bs::OpKind::RecvBytes, 0, 0, 5);
    Bytes length;
    Append(length, uint64_t{10});
    AppendRecord(b, 0, Frame(bw::FrameType::Data, 0, 5, length));
    AppendRecord(b, 0, Frame(bw::FrameType::Data, 0, 5, Payload(10, 0x50)));
    Write(dir, target, "data_recv_bytes", b);
  }
  {
    Bytes b{Options(2, 0, bs::kDataPhase), 1};
    AppendOp(b, bs::OpKind::Broadcast, 0, 24, 0);
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 0, Payload(24, 0x60)));
    Write(dir, target, "collective_broadcast", b);
  }
  // World 3, rank 1: peers 0 and 2 (indices 0 and 1); the ring's previous rank is 0.
  {
    Bytes b{Options(3, 0, bs::kDataPhase), 1};
    AppendOp(b, bs::OpKind::AllGather, 0, 8, 0);
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 0, Payload(8, 0x70)));
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 0, Payload(8, 0x78)));
    Write(dir, target, "collective_allgather", b);
  }
  // World 4, rank 1: the barrier hears from ranks 0 and 3 (indices 0 and 2).
  {
    Bytes b{Options(4, 0, bs::kDataPhase), 1};
    AppendOp(b, bs::OpKind::Barrier, 0, 0, 0);
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 0, Bytes{1}));
    AppendRecord(b, 2, Frame(bw::FrameType::Collective, 3, 0, Bytes{1}));
    Write(dir, target, "collective_barrier", b);
  }
  // A sequence, world 3, rank 1: Recv from 2, AllGather (seq 0), Broadcast from 2 (seq 1), Barrier (seq 2, tokens from
  // 0 and 2); frames of the two peers interleaved, one split over two records.
  {
    Bytes b{Options(3, 0, bs::kDataPhase), 4};
    AppendOp(b, bs::OpKind::Recv, 1, 12, 9);
    AppendOp(b, bs::OpKind::AllGather, 0, 4, 0);
    AppendOp(b, bs::OpKind::Broadcast, 2, 32, 0);
    AppendOp(b, bs::OpKind::Barrier, 0, 0, 0);
    Bytes recv = Frame(bw::FrameType::Data, 2, 9, Payload(12, 0x11));
    AppendRecord(b, 1, Bytes(recv.begin(), recv.begin() + 10));
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 0, Payload(4, 0x22)));
    AppendRecord(b, 1, Bytes(recv.begin() + 10, recv.end()));
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 0, Payload(4, 0x33)));
    AppendRecord(b, 1, Frame(bw::FrameType::Collective, 2, 1, Payload(32, 0x44)));
    AppendRecord(b, 0, Frame(bw::FrameType::Collective, 0, 2, Bytes{1}));
    AppendRecord(b, 1, Frame(bw::FrameType::Collective, 2, 2, Bytes{1}));
    Write(dir, target, "sequence_world3", b);
  }
}

}  // namespace bootstrap_stream_seeds

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (with a directory per target)\n", argv[0]);
    return 2;
  }
  BootstrapSeeds(argv[1]);
  bootstrap_stream_seeds::Seeds(argv[1]);
  RegisteredMemorySeeds(argv[1]);
  TcpSeeds(argv[1]);
  EmulatedSeeds(argv[1]);
  FdChannelSeeds(argv[1]);
  ShmemProxySeeds(argv[1]);
  PortChannelSeeds(argv[1]);
  TcpStreamSeeds(argv[1]);
  EmulatedNicSeeds(argv[1]);
  return 0;
}
