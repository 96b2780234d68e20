// Helpers shared by the fuzz targets: taking fixed-size wire structs from the fuzzer's bytes, and the check that
// turns a broken property into a finding (abort, so libFuzzer keeps the input).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace mori::fuzz {

// The job id of fuzz_fd_channel's ranks: fixed, so that the seed corpus's messages are that job's.
constexpr uint64_t kFdChannelJobId = 0x66757a7a6a6f6221ull;
// Where FdChannel's header (ipc.cpp) holds the sender's pid and uid: fuzz_fd_channel writes its own there when the
// input's first byte asks, and the seed writer leaves them zero, so that the seeds are the same on every run.
constexpr size_t kFdChannelPidOffset = 32;
constexpr size_t kFdChannelUidOffset = 36;

// fuzz_tcp_stream's peer nonce (fixed, so that a seed's hello can carry it) and the option bits of its first byte.
namespace tcp_stream {
constexpr uint64_t kPeerNonce = 0x7a7a756670656572ull;
constexpr uint8_t kChannelBits = 3;  // 1 to 4 channels
constexpr uint8_t kIssue = 1 << 2;   // the link issues a read (ids 1, 2), a fetch-add (3), a compare-swap (4)
// Accepting link: a stranger connects to channel 0's listener first with the input's hello. Connecting link
// (kConnect): the acceptor's replies to the link's hellos are the input's, one 64-byte header per channel.
constexpr uint8_t kFuzzHello = 1 << 3;
// The stranger's hello carries the listener's (random) nonce; with kConnect, each reply's arg0 is XORed with the
// link's (random) nonce, so that 0 there is the nonce a real acceptor sends back.
constexpr uint8_t kRealNonce = 1 << 4;
constexpr uint8_t kDeviceRead = 1 << 5;  // the link's read lands in (emulated) device memory
// The peer ends with a reset (SO_LINGER 0), not an orderly close; with kConnect, so does a reply cut short.
constexpr uint8_t kReset = 1 << 6;
constexpr uint8_t kConnect = 1 << 7;  // the link under test connects (rank 1) to the harness's listeners (rank 0)
}  // namespace tcp_stream

// fuzz_emulated_nic's input encoding, shared with the seed writer. The first byte holds these options, the second
// chooses the WQEs a requester-side input posts (bit i: kNicWqe i; 0: all of them); packets follow.
constexpr uint8_t kNicRequester = 1;    // answer the NIC's requests (else: send it requests)
constexpr uint8_t kNicFuzzHello = 2;    // the first packet is the connection's hello (else the harness says one)
constexpr uint8_t kNicRawCheck = 4;     // integrity checks as the input wrote them (else recomputed)
constexpr uint8_t kNicRawFraming = 8;   // magic and version as the input wrote them (else this wire's)
constexpr uint8_t kNicWrapPsn = 16;     // PSNs start two before the 24-bit wrap (else at 0)
constexpr uint8_t kNicNoReceives = 32;  // no receive buffers posted (sends meet receiver-not-ready)
// Buffers of the harness: a packet's rkey below kNicRegions names that buffer's registration, and an raddr whose top
// byte is below kNicBuffers is that buffer's base plus the signed 32-bit offset in its low word.
enum NicBuffer : uint8_t { kNicAll, kNicReadOnly, kNicWriteOnly, kNicLocal, kNicUnregistered, kNicBuffers };
constexpr uint32_t kNicRegions = kNicUnregistered;
constexpr uint64_t NicAddress(NicBuffer b, int32_t offset) {
  return (uint64_t{b} << 56) | static_cast<uint32_t>(offset);
}
// The WQEs a requester-side input may post, in this order; their PSNs follow each other from the start PSN.
enum NicWqe : uint8_t { kNicWrite, kNicRead, kNicFetchAdd, kNicCompareSwap, kNicSend, kNicReadEmpty, kNicWriteInline,
                        kNicReadLong, kNicWqes };

// fuzz_bootstrap_stream's input (its seeds are written by fuzz_seed_corpus): an options byte, then in the data
// phase an op count, the ops and the records that go to the peers' connections.
namespace bootstrap_stream {
constexpr uint8_t kWorldMask = 0x03;  // world size 2 + (options & 3)
constexpr int kRankShift = 2;         // the real rank: 1 + ((options >> 2) & 7) % (world - 1)
constexpr uint8_t kDataPhase = 0x20;  // 0: the rest is the root's reply; 1: a good table, then records
// Reply phase: the table's entry of the real rank is overwritten with the address it registered (an ephemeral
// port, which no stored input can know), where the reply is long enough to hold it.
constexpr uint8_t kPatchOwnEntry = 0x40;
// Data phase: the peers' connections end with a FIN, not with a malformed header (see EndStream).
constexpr uint8_t kEndWithFin = 0x80;
constexpr int kMaxOps = 4;  // op count: its byte % (kMaxOps + 1)
enum class OpKind : uint8_t { Recv, RecvBytes, AllGather, Broadcast, Barrier, kCount };
struct OpSpec {
  uint8_t kind;    // OpKind, modulo kCount
  uint8_t peer;    // index among the other ranks (Recv, RecvBytes), or the broadcast root's rank modulo the world
  uint16_t bytes;  // Recv and Broadcast: & 0xfff; AllGather: & 0xff per rank
  int32_t tag;     // Recv and RecvBytes: & 0xf
};
static_assert(sizeof(OpSpec) == 8, "OpSpec is 8 input bytes");
struct RecordHeader {
  uint8_t peer;       // index among the other ranks, modulo their count
  uint8_t length[2];  // little-endian byte count that follows (cut at the input's end)
};
static_assert(sizeof(RecordHeader) == 3, "RecordHeader is 3 input bytes");
}  // namespace bootstrap_stream

// Reads the input front to back; what runs past the end reads as zero bytes, so every input is usable.
class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  template <typename T>
  T Take() {
    static_assert(std::is_trivially_copyable_v<T>, "only wire structs are taken from the input");
    T value;
    std::memset(&value, 0, sizeof(value));
    size_t n = sizeof(T) < Left() ? sizeof(T) : Left();
    if (n > 0) std::memcpy(&value, data_ + offset_, n);
    offset_ += n;
    return value;
  }
  void Skip(size_t n) { offset_ += n < Left() ? n : Left(); }
  size_t Left() const { return size_ - offset_; }
  const uint8_t* Rest() const { return data_ + offset_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t offset_ = 0;
};

}  // namespace mori::fuzz

// A property of the parser that must hold for every input: print it and abort.
#define MORI_FUZZ_ASSERT(cond, ...)                                                           \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz property failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                      \
      std::fprintf(stderr, "\n");                                                             \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)
