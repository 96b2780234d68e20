#include "mori/core/ipc.hpp"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::core {

namespace {

constexpr uint32_t kIpcMagic = 0x49524f4dU;  // "MORI"
constexpr uint32_t kIpcVersion = 2;

struct IpcHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t jobId;
  int32_t srcRank;
  uint32_t payloadBytes;
  uint64_t tag;
  // What the sender believes it is. The kernel's word (SCM_CREDENTIALS) decides; a claim that differs from
  // it tells the receiver the two see pids through different namespaces, which its refusal then says.
  int32_t srcPid;
  uint32_t srcUid;
};
static_assert(sizeof(IpcHeader) == 40, "IpcHeader travels as bytes");

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
    // Before bind, so that no datagram can reach the socket without the kernel's word on its sender.
    int on = 1;
    MORI_CHECK_SYS(setsockopt(fd_.Get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)));
    socklen_t len;
    sockaddr_un addr = AbstractAddress(jobId_, rank_, &len);
    if (bind(fd_.Get(), reinterpret_cast<sockaddr*>(&addr), len) < 0) {
      MORI_THROW_SYS(errno, "rank %d cannot bind its IPC socket @%s", rank_, addr.sun_path + 1);
    }
  }

  void SetRankPids(std::vector<pid_t> rankPids) {
    MORI_CHECK(rank_ >= 0 && static_cast<size_t>(rank_) < rankPids.size() && rankPids[rank_] == getpid(),
               ErrorCode::InvalidUsage, "FdChannel of rank %d: %zu rank pids given, and rank %d's must be %d", rank_,
               rankPids.size(), rank_, static_cast<int>(getpid()));
    rankPids_ = std::move(rankPids);
    lastRefusal_.assign(rankPids_.size(), std::string());
  }

  void Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes, const Deadline& deadline) {
    MORI_CHECK(bytes <= kMaxPayload, ErrorCode::InvalidUsage, "FdChannel: payload of %zu bytes exceeds %zu", bytes,
               kMaxPayload);
    IpcHeader h{kIpcMagic, kIpcVersion, jobId_, rank_, static_cast<uint32_t>(bytes), tag,
                static_cast<int32_t>(getpid()), static_cast<uint32_t>(getuid())};
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

  UniqueFd Recv(int peer, uint64_t tag, void* payload, size_t bytes, const Deadline& deadline, IpcSender* sender) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (true) {
      for (auto it = stash_.begin(); it != stash_.end(); ++it) {
        if (it->sender.rank != peer || it->tag != tag) continue;
        MORI_CHECK(it->payload.size() == bytes, ErrorCode::InvalidUsage,
                   "rank %d: rank %d sent a %zu-byte descriptor message (tag %llu) where %zu bytes were expected",
                   rank_, peer, it->payload.size(), static_cast<unsigned long long>(tag), bytes);
        if (bytes > 0) std::memcpy(payload, it->payload.data(), bytes);
        if (sender != nullptr) *sender = it->sender;
        UniqueFd fd = std::move(it->fd);
        stash_.erase(it);
        return fd;
      }
      if (deadline.Expired()) {
        std::string refused;
        if (peer >= 0 && static_cast<size_t>(peer) < lastRefusal_.size() && !lastRefusal_[peer].empty()) {
          refused = "; a message that claimed to come from it was refused: " + lastRefusal_[peer];
        }
        throw TimeoutError(StrFormat("rank %d waited %.0f s for a descriptor (tag %llu) from rank %d, which never "
                                     "came%s",
                                     rank_, deadline.TotalSeconds(), static_cast<unsigned long long>(tag), peer,
                                     refused.c_str()));
      }
      pollfd pfd{fd_.Get(), POLLIN, 0};
      int n = poll(&pfd, 1, std::min(deadline.RemainingMs(), 100));
      if (n > 0) Drain();
    }
  }

  uint64_t JobId() const { return jobId_; }
  int Rank() const { return rank_; }
  pid_t RankPid(int rank) const {
    MORI_CHECK(rank >= 0 && static_cast<size_t>(rank) < rankPids_.size(), ErrorCode::InvalidUsage,
               "FdChannel: rank %d outside the job's %zu ranks", rank, rankPids_.size());
    return rankPids_[rank];
  }

 private:
  struct Message {
    IpcSender sender;
    uint64_t tag;
    std::vector<uint8_t> payload;
    UniqueFd fd;
  };

  // Why a datagram is not a well-formed message of this job; empty when it is.
  std::string MalformedReason(const IpcHeader& h, size_t n, size_t fdCount, int flags) const {
    if (n < sizeof(h)) return StrFormat("a %zu-byte datagram, shorter than a header", n);
    if (h.magic != kIpcMagic || h.version != kIpcVersion) {
      return StrFormat("bad magic 0x%08x or version %u", h.magic, h.version);
    }
    if (h.jobId != jobId_) return "another job's message";
    if (h.payloadBytes != n - sizeof(h)) {
      return StrFormat("payload length %u but %zu bytes came", h.payloadBytes, n - sizeof(h));
    }
    if (fdCount > 1 || (flags & (MSG_TRUNC | MSG_CTRUNC))) return "truncated message or more than one descriptor";
    return "";
  }

  // Why the kernel's word on the sender does not make it the rank the message names; empty when it does.
  std::string RefusalReason(const IpcHeader& h, const ucred* cred) const {
    if (cred == nullptr) return "no sender credentials came with it";
    if (cred->uid != getuid()) {
      return StrFormat("the sender runs as uid %u, this job as uid %u", static_cast<unsigned>(cred->uid),
                       static_cast<unsigned>(getuid()));
    }
    if (h.srcPid != cred->pid || h.srcUid != cred->uid) {
      return StrFormat("it claims pid %d uid %u, the kernel reports pid %d uid %u (ranks of one host must share a "
                       "pid namespace)",
                       h.srcPid, h.srcUid, static_cast<int>(cred->pid), static_cast<unsigned>(cred->uid));
    }
    if (h.srcRank < 0 || static_cast<size_t>(h.srcRank) >= rankPids_.size()) {
      return StrFormat("it names rank %d, outside the job's %zu ranks", h.srcRank, rankPids_.size());
    }
    if (cred->pid != rankPids_[h.srcRank]) {
      return StrFormat("it claims to be rank %d, whose pid is %d", h.srcRank, static_cast<int>(rankPids_[h.srcRank]));
    }
    return "";
  }

  void Drain() {
    while (true) {
      IpcHeader h{};
      std::vector<uint8_t> payload(kMaxPayload);
      iovec iov[2] = {{&h, sizeof(h)}, {payload.data(), payload.size()}};
      // Room for the credentials and a few descriptors. More descriptors than fit set MSG_CTRUNC (a malformed
      // message), and the kernel closes those it could not pass on.
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred)) + CMSG_SPACE(sizeof(int) * 4)];
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
      // Take ownership of every descriptor that came, whatever else is wrong with the message: a message
      // dropped below closes them as it goes.
      std::vector<UniqueFd> fds;
      ucred cred{};
      bool haveCred = false;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET) continue;
        if (c->cmsg_type == SCM_RIGHTS) {
          size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t i = 0; i < count; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            fds.emplace_back(fd);
          }
        } else if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len >= CMSG_LEN(sizeof(ucred))) {
          std::memcpy(&cred, CMSG_DATA(c), sizeof(cred));
          haveCred = true;
        }
      }
      const std::string from = haveCred ? StrFormat("pid %d (uid %u)", static_cast<int>(cred.pid),
                                                    static_cast<unsigned>(cred.uid))
                                        : std::string("an unknown sender");
      const char* closed = fds.empty() ? "" : "; the descriptor that came with it is closed";
      std::string bad = MalformedReason(h, static_cast<size_t>(n), fds.size(), msg.msg_flags);
      if (!bad.empty()) {
        MORI_LOG_WARN(Ipc, "rank %d dropped a malformed IPC message from %s: %s%s", rank_, from.c_str(), bad.c_str(),
                      closed);
        continue;
      }
      std::string refused = RefusalReason(h, haveCred ? &cred : nullptr);
      if (!refused.empty()) {
        MORI_LOG_WARN(Ipc, "rank %d refused an IPC message (tag %llu) from %s: %s%s", rank_,
                      static_cast<unsigned long long>(h.tag), from.c_str(), refused.c_str(), closed);
        if (h.srcRank >= 0 && static_cast<size_t>(h.srcRank) < lastRefusal_.size()) {
          lastRefusal_[h.srcRank] = "from " + from + ": " + refused;
        }
        continue;
      }
      payload.resize(h.payloadBytes);
      stash_.push_back(Message{IpcSender{h.srcRank, cred.pid, cred.uid}, h.tag, std::move(payload),
                               fds.empty() ? UniqueFd() : std::move(fds[0])});
    }
  }

  std::mutex mutex_;
  UniqueFd fd_;
  uint64_t jobId_;
  int rank_;
  std::vector<pid_t> rankPids_;          // fixed once constructed
  std::vector<std::string> lastRefusal_;  // per rank the refused message claimed, for Recv's timeout
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
    : impl_(std::make_unique<Impl>(AgreeJobId(bootstrap), bootstrap.GetRank())) {
  // Every rank has bound its name before it joins this all-gather, so once it returns no stranger can bind
  // one of them first and receive what is sent to that rank.
  impl_->SetRankPids(bootstrap.AllGatherValue<pid_t>(getpid()));
}

FdChannel::FdChannel(uint64_t jobId, int rank, std::vector<pid_t> rankPids)
    : impl_(std::make_unique<Impl>(jobId, rank)) {
  impl_->SetRankPids(std::move(rankPids));
}

FdChannel::~FdChannel() = default;

void FdChannel::Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes, const Deadline& deadline) {
  impl_->Send(peer, tag, fd, payload, bytes, deadline);
}

void FdChannel::Send(int peer, uint64_t tag, int fd, const void* payload, size_t bytes) {
  impl_->Send(peer, tag, fd, payload, bytes, Deadline::Default());
}

UniqueFd FdChannel::Recv(int peer, uint64_t tag, void* payload, size_t bytes, const Deadline& deadline,
                         IpcSender* sender) {
  return impl_->Recv(peer, tag, payload, bytes, deadline, sender);
}

UniqueFd FdChannel::Recv(int peer, uint64_t tag, void* payload, size_t bytes) {
  return impl_->Recv(peer, tag, payload, bytes, Deadline::Default(), nullptr);
}

uint64_t FdChannel::JobId() const { return impl_->JobId(); }
int FdChannel::Rank() const { return impl_->Rank(); }
pid_t FdChannel::RankPid(int rank) const { return impl_->RankPid(rank); }

}  // namespace mori::core
