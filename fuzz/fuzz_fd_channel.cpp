// FdChannel's datagrams, as any process of the host can send them to a rank's abstract socket: the fuzzer's bytes
// go out as one datagram (with none, one or two descriptors), then the real receive path takes them. Anything
// but a clean refusal or a delivered message is a finding, and so is a descriptor left open afterwards (every
// descriptor that comes with a dropped message must be closed, and a delivered one is closed here).
// Input: one byte of options (bits 0-1: descriptors to attach; bit 2: the header claims this process's pid and uid,
// as a rank of the job would, so that well-formed messages get past the sender check), then the datagram.
#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fuzz_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/ipc.hpp"
#include "mori/core/timeout.hpp"

namespace {

using mori::core::FdChannel;

constexpr uint64_t kJobId = mori::fuzz::kFdChannelJobId;
constexpr uint64_t kSentinelTag = ~0ull;  // rank 1's empty message that ends each round
// Offsets in FdChannel's 40-byte header (ipc.cpp): u32 magic, u32 version, u64 job, i32 rank, u32 payload
// bytes, u64 tag, i32 pid, u32 uid.
constexpr size_t kHeaderBytes = 40;
constexpr size_t kRankOffset = 16;
constexpr size_t kPayloadBytesOffset = 20;
constexpr size_t kTagOffset = 24;
using mori::fuzz::kFdChannelPidOffset;
using mori::fuzz::kFdChannelUidOffset;

struct Setup {
  FdChannel receiver{kJobId, 0, {getpid(), getpid()}};
  FdChannel rank1{kJobId, 1, {getpid(), getpid()}};
  int sender = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);  // unbound: a stranger's socket
  int devNull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  sockaddr_un addr{};
  socklen_t addrLen = 0;

  Setup() {
    MORI_FUZZ_ASSERT(sender >= 0 && devNull >= 0, "socket or /dev/null");
    addr.sun_family = AF_UNIX;
    // Rank 0's abstract name, as FdChannel binds it.
    int n = std::snprintf(addr.sun_path + 1, sizeof(addr.sun_path) - 1, "mori-ipc-%016llx-%d",
                          static_cast<unsigned long long>(kJobId), 0);
    addrLen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  }
};

Setup& TheSetup() {
  static Setup* s = new Setup();
  return *s;
}

size_t OpenDescriptors() {
  DIR* d = opendir("/proc/self/fd");
  MORI_FUZZ_ASSERT(d != nullptr, "opendir /proc/self/fd");
  size_t n = 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

void SendDatagram(Setup& s, std::vector<uint8_t>& datagram, int descriptors) {
  iovec iov{datagram.data(), datagram.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  std::memset(control, 0, sizeof(control));
  int fds[2] = {-1, -1};
  msghdr msg{};
  msg.msg_name = &s.addr;
  msg.msg_namelen = s.addrLen;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (descriptors > 0) {
    for (int i = 0; i < descriptors; ++i) fds[i] = dup(s.devNull);
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(descriptors * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(descriptors * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, descriptors * sizeof(int));
  }
  ssize_t n = sendmsg(s.sender, &msg, MSG_NOSIGNAL);
  MORI_FUZZ_ASSERT(n == static_cast<ssize_t>(datagram.size()), "sendmsg of %zu bytes: %s", datagram.size(),
                   std::strerror(errno));
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MORI_LOG_LEVEL", "error", 1);  // every refused datagram would log a warning
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Setup& s = TheSetup();
  const size_t before = OpenDescriptors();
  const int descriptors = data[0] & 3 ? (data[0] & 3) == 3 ? 2 : 1 : 0;
  std::vector<uint8_t> datagram(data + 1, data + size);
  if (datagram.size() > FdChannel::kMaxPayload + kHeaderBytes) datagram.resize(FdChannel::kMaxPayload + kHeaderBytes);
  uint64_t tag = 0;
  if (datagram.size() >= kHeaderBytes) {
    std::memcpy(&tag, datagram.data() + kTagOffset, sizeof(tag));
    if (tag == kSentinelTag) {  // the sentinel's tag is reserved
      tag ^= 1;
      std::memcpy(datagram.data() + kTagOffset, &tag, sizeof(tag));
    }
    if (data[0] & 4) {
      const int32_t pid = getpid();
      const uint32_t uid = getuid();
      std::memcpy(datagram.data() + kFdChannelPidOffset, &pid, sizeof(pid));
      std::memcpy(datagram.data() + kFdChannelUidOffset, &uid, sizeof(uid));
    }
  }
  SendDatagram(s, datagram, descriptors);
  s.rank1.Send(0, kSentinelTag, -1, nullptr, 0);

  // The sentinel comes after the fuzzer's datagram, so once it is received the datagram has been taken too.
  try {
    s.receiver.Recv(1, kSentinelTag, nullptr, 0, mori::core::Deadline::After(10));
  } catch (const mori::core::Error& e) {
    MORI_FUZZ_ASSERT(false, "the sentinel after the datagram was not received: %s", e.what());
  }
  // A datagram that was accepted waits in the stash: take it (and close its descriptor) so that nothing piles up.
  if (datagram.size() >= kHeaderBytes) {
    int32_t rank;
    uint32_t payloadBytes;
    std::memcpy(&rank, datagram.data() + kRankOffset, sizeof(rank));
    std::memcpy(&payloadBytes, datagram.data() + kPayloadBytesOffset, sizeof(payloadBytes));
    if ((rank == 0 || rank == 1) && payloadBytes <= FdChannel::kMaxPayload) {
      std::vector<uint8_t> payload(payloadBytes);
      try {
        s.receiver.Recv(rank, tag, payload.data(), payload.size(), mori::core::Deadline::After(0));
        MORI_FUZZ_ASSERT(payloadBytes == datagram.size() - kHeaderBytes, "delivered a payload of %u bytes from %zu",
                         payloadBytes, datagram.size() - kHeaderBytes);
        MORI_FUZZ_ASSERT(std::equal(payload.begin(), payload.end(), datagram.begin() + kHeaderBytes),
                         "delivered other bytes than were sent");
      } catch (const mori::core::Error&) {
        // Not delivered (refused or malformed): the expected outcome for almost every input.
      }
    }
  }
  const size_t after = OpenDescriptors();
  MORI_FUZZ_ASSERT(after == before, "%zu descriptors open before the datagram, %zu after", before, after);
  return 0;
}
