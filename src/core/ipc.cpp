#include "mori/core/ipc.hpp"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::core {

namespace {

constexpr uint32_t kIpcMagic = 0x49524f4dU;  // "MORI"
constexpr uint32_t kIpcVersion = 1;

struct IpcHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t jobId;
  int32_t srcRank;
  uint32_t payloadBytes;
  uint64_t tag;
};
static_assert(sizeof(IpcHeader) == 32, "IpcHeader travels as bytes");

sockaddr_un AbstractAddress(uint64_t jobId, int rank, socklen_t* len) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  // sun_path[0] == '\0' selects the abstract namespace: the name vanishes with the socket.
  int n = std::snprintf(addr.sun_path + 1, sizeof(addr.sun_path) - 1, "mori-ipc-%016llx-%d",
                        static_cast<unsigned long long>(jobId), rank);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return addr;
}

}  // namespace

class FdChannel::Impl {
 public:
  Impl(uint64_t jobId, int rank) : jobId_(jobId), rank_(rank) {
    fd_.Reset(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    MORI_CHECK_SYS(fd_.Get());
    socklen_t len;
    sockaddr_un addr = AbstractAddress(jobId_, rank_, &len);
    if (bind(fd_.Get(), reinterpret_cast<sockaddr*>(&addr), len) < 0) {
      MORI_THROW_SYS(errno, "rank %d cannot bind its IPC socket @%s", rank_, addr.sun_path + 1);
    }
  }

  void Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes, const Deadline& deadline) {
    MORI_CHECK(bytes <= kMaxPayload, ErrorCode::InvalidUsage, "FdChannel: payload of %zu bytes exceeds %zu", bytes,
               kMaxPayload);
    IpcHeader h{kIpcMagic, kIpcVersion, jobId_, rank_, static_cast<uint32_t>(bytes), tag};
    iovec iov[2] = {{&h, sizeof(h)}, {const_cast<void*>(payload), bytes}};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    std::memset(control, 0, sizeof(control));
    socklen_t len;
    sockaddr_un addr = AbstractAddress(jobId_, peer, &len);
    msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_name = &addr;
    msg.msg_namelen = len;
    msg.msg_iov = iov;
    msg.msg_iovlen = bytes > 0 ? 2 : 1;
    if (fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    int delayMs = 1;
    while (true) {
      if (sendmsg(fd_.Get(), &msg, MSG_NOSIGNAL) >= 0) return;
      int err = errno;
      // The peer has not bound its socket yet (ECONNREFUSED/ENOENT) or its queue is full (EAGAIN): retry.
      if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN && err != EWOULDBLOCK && err != EINTR) {
        MORI_THROW_SYS(err, "rank %d: sending a descriptor to rank %d", rank_, peer);
      }
      if (deadline.Expired()) {
        throw TimeoutError(StrFormat("rank %d could not hand a descriptor (tag %llu) to rank %d within %.0f s: %s "
                                     "(is rank %d on this host and alive?)",
                                     rank_, static_cast<unsigned long long>(tag), peer, deadline.TotalSeconds(),
                                     ErrnoString(err).c_str(), peer));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
      delayMs = std::min(delayMs * 2, 50);
    }
  }

  UniqueFd Recv(int peer, uint64_t tag, void* payload, size_t bytes, const Deadline& deadline) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (true) {
      for (auto it = stash_.begin(); it != stash_.end(); ++it) {
        if (it->src != peer || it->tag != tag) continue;
        MORI_CHECK(it->payload.size() == bytes, ErrorCode::InvalidUsage,
                   "rank %d: rank %d sent a %zu-byte descriptor message (tag %llu) where %zu bytes were expected",
                   rank_, peer, it->payload.size(), static_cast<unsigned long long>(tag), bytes);
        if (bytes > 0) std::memcpy(payload, it->payload.data(), bytes);
        UniqueFd fd = std::move(it->fd);
        stash_.erase(it);
        return fd;
      }
      if (deadline.Expired()) {
        throw TimeoutError(StrFormat("rank %d waited %.0f s for a descriptor (tag %llu) from rank %d, which never "
                                     "came",
                                     rank_, deadline.TotalSeconds(), static_cast<unsigned long long>(tag), peer));
      }
      pollfd pfd{fd_.Get(), POLLIN, 0};
      int n = poll(&pfd, 1, std::min(deadline.RemainingMs(), 100));
      if (n > 0) Drain();
    }
  }

  uint64_t JobId() const { return jobId_; }
  int Rank() const { return rank_; }

 private:
  struct Message {
    int src;
    uint64_t tag;
    std::vector<uint8_t> payload;
    UniqueFd fd;
  };

  void Drain() {
    while (true) {
      IpcHeader h;
      std::vector<uint8_t> payload(kMaxPayload);
      iovec iov[2] = {{&h, sizeof(h)}, {payload.data(), payload.size()}};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
      msghdr msg;
      std::memset(&msg, 0, sizeof(msg));
      msg.msg_iov = iov;
      msg.msg_iovlen = 2;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      ssize_t n = recvmsg(fd_.Get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) {
        if (errno == EINTR) continue;
        return;
      }
      // Take ownership of every descriptor that came, whatever else is wrong with the message.
      std::vector<UniqueFd> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.emplace_back(fd);
        }
      }
      std::string bad;
      if (static_cast<size_t>(n) < sizeof(h)) {
        bad = StrFormat("a %zd-byte datagram, shorter than a header", n);
      } else if (h.magic != kIpcMagic || h.version != kIpcVersion) {
        bad = StrFormat("bad magic 0x%08x or version %u", h.magic, h.version);
      } else if (h.jobId != jobId_) {
        bad = "another job's message";
      } else if (h.payloadBytes != static_cast<size_t>(n) - sizeof(h)) {
        bad = StrFormat("payload length %u but %zu bytes came", h.payloadBytes, static_cast<size_t>(n) - sizeof(h));
      } else if (fds.size() > 1 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        bad = "truncated message or more than one descriptor";
      }
      if (!bad.empty()) {
        MORI_LOG_WARN(Ipc, "rank %d dropped a malformed IPC message: %s", rank_, bad.c_str());
        continue;
      }
      payload.resize(h.payloadBytes);
      stash_.push_back(Message{h.srcRank, h.tag, std::move(payload), fds.empty() ? UniqueFd() : std::move(fds[0])});
    }
  }

  std::mutex mutex_;
  UniqueFd fd_;
  uint64_t jobId_;
  int rank_;
  std::vector<Message> stash_;
};

namespace {

uint64_t AgreeJobId(Bootstrap& bootstrap) {
  uint64_t id = 0;
  if (bootstrap.GetRank() == 0) {
    while (id == 0) {
      if (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) MORI_THROW_SYS(errno, "getrandom");
    }
  }
  bootstrap.Broadcast(&id, sizeof(id), 0);
  return id;
}

}  // namespace

FdChannel::FdChannel(Bootstrap& bootstrap)
    : impl_(std::make_unique<Impl>(AgreeJobId(bootstrap), bootstrap.GetRank())) {}

FdChannel::FdChannel(uint64_t jobId, int rank) : impl_(std::make_unique<Impl>(jobId, rank)) {}

FdChannel::~FdChannel() = default;

void FdChannel::Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes, const Deadline& deadline) {
  impl_->Send(peer, tag, fd, payload, bytes, deadline);
}

void FdChannel::Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes) {
  impl_->Send(peer, tag, fd, payload, bytes, Deadline::Default());
}

UniqueFd FdChannel::Recv(int peer, uint64_t tag, void* payload, size_t bytes, const Deadline& deadline) {
  return impl_->Recv(peer, tag, payload, bytes, deadline);
}

UniqueFd FdChannel::Recv(int peer, uint64_t tag, void* payload, size_t bytes) {
  return impl_->Recv(peer, tag, payload, bytes, Deadline::Default());
}

uint64_t FdChannel::JobId() const { return impl_->JobId(); }
int FdChannel::Rank() const { return impl_->Rank(); }

}  // namespace mori::core
