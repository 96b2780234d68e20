// Bytes the socket bootstrap puts on the wire: the unique id, frame headers and hello payloads.
// Every field is fixed-size and little-endian (mori runs on little-endian hosts only; atomic.hpp checks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "socket.hpp"

namespace mori::core::bootstrap_wire {

constexpr uint32_t kFrameMagic = 0x42524f4dU;  // "MORB" in memory order
constexpr uint32_t kUniqueIdMagic = 0x55524f4dU;  // "MORU"
constexpr uint16_t kVersion = 1;
// Setup messages are small; a length beyond this is corruption or a foreign speaker, not a real frame.
constexpr uint64_t kMaxPayload = 1ull << 31;

enum class FrameType : uint16_t {
  Hello = 1,       // first frame on every connection: who is speaking and why
  Table = 2,       // root -> rank: every rank's listening address
  Abort = 3,       // root -> rank: registration failed (tag kAbortJob) or the hello was refused, payload says why
  Data = 4,        // Send/Recv, tag is the user's
  Collective = 5,  // collective step, tag is the collective's sequence number
};

// Tags of an Abort frame: the job cannot start, or only this registration was refused (the root goes on waiting
// for the rank, since a stranger's hello must not end a job).
constexpr int32_t kAbortJob = 0;
constexpr int32_t kAbortHelloRefused = 1;

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  int32_t srcRank;
  int32_t tag;
  uint64_t length;  // payload bytes that follow
};
static_assert(sizeof(FrameHeader) == 24, "FrameHeader is 24 bytes on the wire");

enum class HelloPurpose : uint32_t {
  Register = 1,  // rank -> root during Initialize
  Data = 2,      // rank -> rank, carries Data and Collective frames afterwards
};

struct HelloPayload {
  uint64_t nonce;  // the job's, from the unique id: a different job's process (or a stranger) is refused
  int32_t rank;
  int32_t nRanks;
  uint32_t purpose;
  uint32_t reserved;
  net::WireAddress listen;  // where this rank accepts peer connections
};
static_assert(sizeof(HelloPayload) == 48, "HelloPayload is 48 bytes on the wire");

struct UniqueIdLayout {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved;
  uint64_t nonce;
  net::WireAddress root;
  uint8_t pad[128 - 16 - sizeof(net::WireAddress)];
};
static_assert(sizeof(UniqueIdLayout) == 128, "the unique id layout fills 128 bytes");

// The header of a frame this build sends.
FrameHeader MakeHeader(FrameType type, int srcRank, int tag, uint64_t length);

// Empty when `h` is a well-formed header of this protocol version, else the reason it is not.
std::string CheckHeader(const FrameHeader& h);

// Empty when `hello` belongs to this job (nonce) and fits its size, else the reason.
std::string CheckHello(const HelloPayload& hello, uint64_t nonce, int nRanks);

const char* FrameTypeName(uint16_t type);

// Empty when `table`, received from the root, could be the table it sends: an entry per rank, each a concrete
// address (IPv4 or IPv6, not the unspecified one) with a port, in the form ToWire writes (an IPv4 entry's other
// address bytes and scope zero), and this rank's entry the address it registered; else the reason.
std::string CheckTable(const std::vector<net::WireAddress>& table, int nRanks, int self,
                       const net::WireAddress& registered);

// An abort's reason is read up to this many bytes, and shown in at most this many characters.
constexpr size_t kMaxAbortReason = 4096;

// The reason text of an abort (`raw`, the first bytes of `announced`) as an error message may carry it: printable
// ASCII stays, any other byte and the backslash become \xNN (a peer's bytes must not drive the terminal that
// shows the error), cut at kMaxAbortReason characters and saying how many bytes are left out.
std::string PrintableReason(const std::string& raw, uint64_t announced);

// The nonce of a job whose ranks all know only the root's address ("ip:port" as SocketAddress::ToString writes
// it). Without a secret anyone who knows the address can compute it. With one it is a keyed hash of the address
// that nobody without the secret can compute, even from other jobs' nonces; the secret itself never travels.
uint64_t AddressNonce(const std::string& rootAddress, const std::string& secret);

}  // namespace mori::core::bootstrap_wire
