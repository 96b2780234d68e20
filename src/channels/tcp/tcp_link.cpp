// The data path of the TCP link. Per channel a sender thread (acknowledgements and replies first, then ordered
// frames while the window allows) and a receiver thread (validates each frame, writes, acknowledges). Write
// chunk g travels on channel g % N, so a receiver knows how many chunks of each channel precede an ordered
// word operation (which travel on channel 0) from the one count the operation carries.
#include "tcp/tcp_link.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "mori/core/atomic.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/logging.hpp"
#include "proxy_copy.hpp"
#include "service_thread.hpp"
#include "tcp/tcp_registry.hpp"
#include "tcp/tcp_setup.hpp"

namespace mori::core::tcp {

namespace {

constexpr int kWakeMs = 200;                      // socket timeouts: a blocked thread looks at the link this often
constexpr uint64_t kMaxBounceBytes = 4ull << 20;  // pinned staging for device memory, per channel and direction
constexpr double kGoodbyeSeconds = 1.0;           // bound on the Close / Fail frame of a closing link
constexpr int kMaxWindow = 4096;
// Read data a connection holds for its peer before it is on the wire. A read is acknowledged only once its data
// is sent, so a peer that keeps to its window makes this side hold at most window x chunk (checked here for
// this side's own options); a peer that does not is refused.
constexpr uint64_t kMaxHeldReadBytes = 256ull << 20;

// Word operations from every link of this process (loopback included) on one word take the same lock, so
// that those on device memory (a read-modify-write through the GPU runtime) are atomic with respect to each
// other however the memory was registered (views alias their parent). Host words use CPU atomics under it as
// well, which also keeps them atomic with this process's own CPU atomics.
std::mutex& WordLock(const void* word) {
  constexpr size_t kStripes = 64;
  static auto* locks = new std::mutex[kStripes];  // outlives static destructors of receivers still running
  return locks[(reinterpret_cast<uintptr_t>(word) >> 3) % kStripes];
}

// Thrown inside the channel threads when the link is closing or has already failed: nothing more to report.
struct Stopped {};

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

void ValidateOptions(const TcpLinkOptions& o) {
  MORI_CHECK(o.numChannels >= 1 && o.numChannels <= kMaxChannels, ErrorCode::InvalidUsage,
             "Tcp connections have 1 to %d channels, not %d (MORI_TCP_CHANNELS, EndpointConfig::tcp.numChannels)",
             kMaxChannels, o.numChannels);
  MORI_CHECK(o.windowChunks >= 1 && o.windowChunks <= kMaxWindow, ErrorCode::InvalidUsage,
             "a Tcp window of %d chunks is outside [1, %d] (MORI_TCP_WINDOW, EndpointConfig::tcp.windowChunks)",
             o.windowChunks, kMaxWindow);
  MORI_CHECK(o.chunkBytes >= kMinChunkBytes && o.chunkBytes <= kMaxChunkBytes, ErrorCode::InvalidUsage,
             "a Tcp chunk of %llu bytes is outside [%llu, %llu] (MORI_TCP_CHUNK_SIZE, EndpointConfig::tcp.chunkBytes)",
             static_cast<unsigned long long>(o.chunkBytes), static_cast<unsigned long long>(kMinChunkBytes),
             static_cast<unsigned long long>(kMaxChunkBytes));
  MORI_CHECK(static_cast<uint64_t>(o.windowChunks) * o.chunkBytes <= kMaxHeldReadBytes, ErrorCode::InvalidUsage,
             "a Tcp window of %d chunks of %llu bytes is more than the %llu bytes of read data a peer holds for a "
             "connection (MORI_TCP_WINDOW x MORI_TCP_CHUNK_SIZE)",
             o.windowChunks, static_cast<unsigned long long>(o.chunkBytes),
             static_cast<unsigned long long>(kMaxHeldReadBytes));
}

// A read this side answered whose data is not all on the wire yet (channel 0's acknowledgements stop short of
// it until then).
struct HeldRead {
  uint64_t seq = 0;
  uint64_t bytes = 0;
  std::atomic<uint64_t> framesLeft{0};
};

struct OutFrame {
  FrameHeader header{};
  const uint8_t* payload = nullptr;  // Write: the source memory; ReadData: inside `owned`
  bool payloadDevice = false;
  std::shared_ptr<const std::vector<uint8_t>> owned;
  std::shared_ptr<HeldRead> held;  // ReadData: the read it answers
  bool raw = false;  // tests: `owned` goes out as it is, no header
};

// The GPU side of one channel thread: the device set for this thread (the current device is per thread) and the
// process's copy stream (HostCopyStream), so that its copies never wait behind kernels (a kernel may be
// spinning until this very data arrives).
class GpuLane {
 public:
  // label: names the link and channel, ending in ": ", in warnings (called only then: the name settles after
  // setup).
  GpuLane(int device, std::function<std::string()> label) : device_(device), label_(std::move(label)) {}
  ~GpuLane() = default;
  GpuLane(const GpuLane&) = delete;
  GpuLane& operator=(const GpuLane&) = delete;

  // Before the first GPU call of the thread, pinned allocations included.
  void Ensure() {
    if (ready_) return;
    if (device_ >= 0) MORI_CHECK_GPU(GpuSetDevice(device_));
    stream_ = HostCopyStream(device_);
    ready_ = true;
  }

  // A copy held up for seconds says why it probably was (proxy_copy.hpp), when it fails or when it is done.
  void Copy(void* dst, const void* src, size_t bytes) {
    Ensure();
    double seconds = 0;
    GpuStatus s = TimedStreamCopy(dst, src, bytes, stream_, &seconds);
    // (The link's failure report puts the label in front of the error.)
    MORI_CHECK(s == kGpuSuccess, ErrorCode::Gpu, "copying %zu bytes between GPU and host memory failed: %s%s", bytes,
               GpuGetErrorString(s), SlowProxyCopyHint(seconds).c_str());
    if (seconds >= kSlowProxyCopyS)
      MORI_LOG_WARN(Net, "%scopying %zu bytes between GPU and host memory%s", label_().c_str(), bytes,
                    SlowProxyCopyHint(seconds).c_str());
  }

  // A pinned word for the read-modify-write of device words (pageable memory would make the copy synchronous
  // with more than this stream on some runtimes).
  uint64_t* Word() {
    Ensure();
    if (!word_) word_ = std::make_unique<GpuBuffer>(64, MemoryType::HostPinned);
    return word_->DataAs<uint64_t>();
  }

 private:
  int device_;
  std::function<std::string()> label_;
  bool ready_ = false;
  GpuStream stream_ = nullptr;
  std::unique_ptr<GpuBuffer> word_;
};

struct PendingRead {
  uint8_t* dst;
  bool device;
  uint64_t bytes;
  uint64_t received;
};

}  // namespace

struct LinkChannel {
  int index = 0;
  std::string ifname;
  UniqueFd fd;
  net::SocketAddress local;
  net::SocketAddress peer;
  std::string name;  // "channel 2 [eth1] (10.0.0.1:40000 -> 10.0.0.2:41000)"

  std::mutex mutex;  // the queues and the acknowledgement to send
  std::condition_variable cv;
  std::deque<OutFrame> ordered;  // Write, word operations, read requests: in issue order, windowed
  std::deque<OutFrame> replies;  // read data, atomic results: not windowed, sent first
  bool ackPending = false;
  uint64_t ackSeq = 0;
  std::atomic<uint64_t> issuedSeq{0};  // ordered frames queued (the last sequence number given)
  std::atomic<uint64_t> sentSeq{0};    // ordered frames put on the socket (or being put)
  std::atomic<uint64_t> doneSeq{0};    // ordered frames whose source memory the sender no longer reads
  std::atomic<uint64_t> ackedSeq{0};   // ordered frames the peer applied
  bool streamBroken = false;           // sender: a frame was cut short, nothing may follow it

  uint64_t recvSeq = 0;        // receiver: the last ordered frame applied
  uint64_t appliedWrites = 0;  // receiver writes it under Impl::appliedMutex_

  std::unique_ptr<GpuBuffer> sendBounce;
  std::unique_ptr<GpuBuffer> recvBounce;
  std::atomic<uint64_t> bytesSent{0};
  std::atomic<uint64_t> bytesReceived{0};
  std::thread sender;
  std::thread receiver;
  std::atomic<bool> senderEnded{false};
  std::atomic<bool> receiverEnded{false};
};

class TcpLink::Impl {
 public:
  Impl(const TcpLinkOptions& options, int rank, int peerRank, EstablishedChannels established);
  ~Impl();
  // Closes the channels (a Close frame each when the link is healthy) and joins the threads. `bounded`: waits
  // for them at most MORI_TIMEOUT_S (and the goodbyes' bound); returns false when a thread is still inside
  // then (stuck in a GPU copy): the threads are detached and this Impl must be left to them, not destroyed.
  bool Stop(bool bounded = true);

  void Write(uint32_t dstKey, uint64_t dstOffset, const void* src, bool srcDevice, uint64_t bytes);
  void WordOp(FrameType type, uint32_t key, uint64_t offset, uint64_t arg0, uint64_t arg1, uint64_t* result);
  void Read(void* dst, bool dstDevice, uint32_t srcKey, uint64_t srcOffset, uint64_t bytes);
  void Flush(int64_t timeoutUs);
  void InjectRaw(int channel, std::vector<uint8_t> bytes);

  TcpLinkOptions options_;
  int rank_;
  int peerRank_;
  int refused_;
  double timeoutS_;
  std::vector<std::unique_ptr<LinkChannel>> channels_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> loopback_{false};    // set right after setup, read when naming the link
  std::unique_ptr<TcpLink> servingEnd_;  // loopback: the end that applies what this one issues

 private:
  void Enqueue(LinkChannel& ch, OutFrame frame, bool ordered);
  void ThrowIfFailed();
  [[noreturn]] void RethrowLocked();
  bool AllDoneLocked() const;
  std::string OutstandingLocked() const;
  std::string Prefix(const LinkChannel* ch) const;
  void Fail(const LinkChannel* ch, ErrorCode code, const std::string& what, bool fromPeer, bool orderly = false);
  void WakeAll();

  void SenderLoop(LinkChannel& ch);
  void SendFrame(LinkChannel& ch, const OutFrame& f, GpuLane& gpu);
  void SendIov(LinkChannel& ch, iovec* iov, int count, bool abortable, const Deadline* frame = nullptr);
  void Goodbye(LinkChannel& ch);
  void FrameDone(LinkChannel& ch, uint64_t seq);
  void Prepared();  // this channel thread's GPU setup is over (done, failed, or skipped by a stop)
  void ThreadEnded(std::atomic<bool>& ended);

  void ReceiverLoop(LinkChannel& ch);
  void RecvExact(LinkChannel& ch, void* data, size_t bytes, bool idle, const Deadline* frame = nullptr);
  void ReceiveInto(LinkChannel& ch, uint8_t* dst, bool device, uint64_t bytes, GpuLane& gpu);
  void DrainLocked(std::unique_lock<std::mutex>& lock);
  void Dispatch(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu);
  TcpTarget Resolve(const FrameHeader& h, uint64_t bytes) const;
  void WaitForEarlierWrites(const FrameHeader& h);
  void ApplyWrite(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu);
  void ApplyWordOp(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu);
  void ApplyRead(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu);
  GpuBuffer& Bounce(std::unique_ptr<GpuBuffer>& bounce, GpuLane& gpu);
  void OnAck(LinkChannel& ch, const FrameHeader& h);
  void OnReadData(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu);
  void OnAtomicResult(const FrameHeader& h);
  void QueueAck(LinkChannel& ch, uint64_t seq);
  uint64_t Channel0AckLocked() const;
  void ReplySent(HeldRead& read);

  // Issuing side (the one driving thread).
  uint64_t writeChunks_ = 0;  // Write chunks issued: chunk g goes to channel g % N
  uint64_t nextId_ = 1;

  std::atomic<bool> stopping_{false};
  int running_ = 0;                // channel threads not yet ended (under stateMutex_)
  int prepared_ = 0;               // channel threads past their GPU setup (under stateMutex_)
  mutable std::mutex stateMutex_;  // failure, pending reads and atomics; Flush waits on stateCv_
  std::condition_variable stateCv_;
  ErrorCode failCode_ = ErrorCode::Internal;
  std::string failMessage_;
  bool failFromPeer_ = false;
  bool failOrderly_ = false;
  std::map<uint64_t, PendingRead> reads_;
  std::map<uint64_t, uint64_t*> atomics_;

  std::mutex appliedMutex_;  // LinkChannel::appliedWrites
  std::condition_variable appliedCv_;
  size_t replyCursor_ = 0;  // channel 0's receiver deals read data round-robin

  std::mutex heldMutex_;  // the reads answered whose data is not all sent, in order; channel 0's last frame
  std::deque<std::shared_ptr<HeldRead>> held_;
  uint64_t heldBytes_ = 0;
  uint64_t applied0_ = 0;
};

// ---------------------------------------------------------------------------------------------------------
// Setup and teardown

TcpLink::Impl::Impl(const TcpLinkOptions& options, int rank, int peerRank, EstablishedChannels established)
    : options_(options), rank_(rank), peerRank_(peerRank), refused_(established.refused), timeoutS_(TimeoutSeconds()) {
  const timeval wake{0, kWakeMs * 1000};
  for (size_t i = 0; i < established.channels.size(); ++i) {
    auto ch = std::make_unique<LinkChannel>();
    EstablishedChannel& e = established.channels[i];
    ch->index = static_cast<int>(i);
    ch->ifname = e.ifname;
    ch->local = e.local;
    ch->peer = e.peer;
    ch->fd = std::move(e.fd);
    ch->name = StrFormat("channel %zu%s (%s -> %s)", i, e.ifname.empty() ? "" : (" [" + e.ifname + "]").c_str(),
                         e.local.ToString().c_str(), e.peer.ToString().c_str());
    MORI_CHECK_SYS(setsockopt(ch->fd.Get(), SOL_SOCKET, SO_RCVTIMEO, &wake, sizeof(wake)));
    MORI_CHECK_SYS(setsockopt(ch->fd.Get(), SOL_SOCKET, SO_SNDTIMEO, &wake, sizeof(wake)));
    net::DetectVanishedPeer(ch->fd.Get(), timeoutS_);  // an idle channel notices a partition too
    channels_.push_back(std::move(ch));
  }
  try {
    for (auto& ch : channels_) {
      LinkChannel* c = ch.get();
      {
        std::lock_guard<std::mutex> lock(stateMutex_);
        running_ += 2;
      }
      c->sender = std::thread([this, c] {
        BecomeServiceThread("tcp-tx", -1, -1);
        SenderLoop(*c);
      });
      c->receiver = std::thread([this, c] {
        BecomeServiceThread("tcp-rx", -1, -1);
        ReceiverLoop(*c);
      });
    }
    // The link is handed out only once every channel thread has made its GPU stream and pinned buffers: made
    // later, beside a kernel that already runs, they can wait for that kernel (pinning memory under CUDA MPS
    // does), and a kernel waiting for this link then never finishes.
    std::unique_lock<std::mutex> lock(stateMutex_);
    const int threads = 2 * static_cast<int>(channels_.size());
    // A failure (a setup that threw, a peer that failed the link at once) is reported by the calls that
    // follow, as any failure after setup.
    if (!stateCv_.wait_for(lock, std::chrono::duration<double>(timeoutS_), [&] { return prepared_ == threads; })) {
      throw TimeoutError(StrFormat("%s%d of %d channel threads made their GPU stream and buffers within %.0f s",
                                   Prefix(nullptr).c_str(), prepared_, threads, timeoutS_));
    }
  } catch (...) {
    Stop(false);  // the constructor cannot leave itself to its threads: waits for them whatever it takes
    throw;
  }
  MORI_LOG_INFO(Net, "Tcp link rank %d <-> rank %d: %zu channels, window %d, chunk %llu bytes", rank_, peerRank_,
                channels_.size(), options_.windowChunks, static_cast<unsigned long long>(options_.chunkBytes));
}

TcpLink::Impl::~Impl() { Stop(false); }

bool TcpLink::Impl::Stop(bool bounded) {
  stopping_ = true;
  WakeAll();
  // Senders first (each says goodbye on its socket), then the sockets shut, then the receivers.
  const Deadline deadline = bounded ? Deadline::After(timeoutS_ + 2 * kGoodbyeSeconds) : Deadline::Never();
  const auto ended = [&](bool receivers) {
    std::unique_lock<std::mutex> lock(stateMutex_);
    while (true) {
      bool all = true;
      for (auto& ch : channels_) all = all && ch->senderEnded && (!receivers || ch->receiverEnded);
      if (all) return true;
      if (deadline.Expired()) return false;
      stateCv_.wait_for(lock, std::chrono::milliseconds(kWakeMs));
    }
  };
  const bool sendersEnded = ended(false);
  for (auto& ch : channels_) shutdown(ch->fd.Get(), SHUT_RDWR);
  if (sendersEnded && ended(true)) {
    for (auto& ch : channels_) {
      if (ch->sender.joinable()) ch->sender.join();
      if (ch->receiver.joinable()) ch->receiver.join();
    }
    return true;
  }
  int stuck = 0;
  for (auto& ch : channels_) stuck += (ch->senderEnded ? 0 : 1) + (ch->receiverEnded ? 0 : 1);
  MORI_LOG_ERROR(Net,
                 "%s%d of %zu channel threads did not end within %.0f s of closing the link (stuck in a GPU copy?); "
                 "the link's memory and sockets are left to them",
                 Prefix(nullptr).c_str(), stuck, 2 * channels_.size(), deadline.TotalSeconds());
  for (auto& ch : channels_) {
    if (ch->sender.joinable()) ch->sender.detach();
    if (ch->receiver.joinable()) ch->receiver.detach();
  }
  return false;
}

void TcpLink::Impl::WakeAll() {
  { std::lock_guard<std::mutex> lock(stateMutex_); }
  stateCv_.notify_all();
  for (auto& ch : channels_) {
    { std::lock_guard<std::mutex> lock(ch->mutex); }
    ch->cv.notify_all();
  }
  { std::lock_guard<std::mutex> lock(appliedMutex_); }
  appliedCv_.notify_all();
}

std::string TcpLink::Impl::Prefix(const LinkChannel* ch) const {
  std::string p = loopback_ ? StrFormat("Tcp loopback connection of rank %d", rank_)
                            : StrFormat("Tcp connection of rank %d to rank %d", rank_, peerRank_);
  if (ch != nullptr) p += ", " + ch->name;
  return p + ": ";
}

void TcpLink::Impl::Fail(const LinkChannel* ch, ErrorCode code, const std::string& what, bool fromPeer, bool orderly) {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (failed_) return;
    failCode_ = code;
    failMessage_ = Prefix(ch) + what;
    failFromPeer_ = fromPeer;
    failOrderly_ = orderly;
    failed_ = true;
  }
  if (!stopping_) {
    if (orderly) {
      MORI_LOG_INFO(Net, "%s", failMessage_.c_str());
    } else {
      MORI_LOG_WARN(Net, "%s", failMessage_.c_str());
    }
  }
  WakeAll();
}

void TcpLink::Impl::RethrowLocked() { ThrowError(failCode_, failMessage_); }

void TcpLink::Impl::ThrowIfFailed() {
  if (!failed_) return;
  std::lock_guard<std::mutex> lock(stateMutex_);
  RethrowLocked();
}

// ---------------------------------------------------------------------------------------------------------
// Issuing (the driving thread)

void TcpLink::Impl::Enqueue(LinkChannel& ch, OutFrame frame, bool ordered) {
  {
    std::lock_guard<std::mutex> lock(ch.mutex);
    if (ordered) {
      frame.header.seq = ch.issuedSeq.load() + 1;
      ch.issuedSeq = frame.header.seq;
      ch.ordered.push_back(std::move(frame));
    } else {
      ch.replies.push_back(std::move(frame));
    }
  }
  ch.cv.notify_one();
}

void TcpLink::Impl::Write(uint32_t dstKey, uint64_t dstOffset, const void* src, bool srcDevice, uint64_t bytes) {
  ThrowIfFailed();
  if (bytes == 0) return;
  MORI_CHECK(src != nullptr, ErrorCode::InvalidUsage, "%sWrite of %llu bytes from a null source",
             Prefix(nullptr).c_str(), static_cast<unsigned long long>(bytes));
  const auto* s = static_cast<const uint8_t*>(src);
  const uint64_t n = channels_.size();
  for (uint64_t off = 0; off < bytes; off += options_.chunkBytes) {
    OutFrame f;
    f.header = MakeFrame(FrameType::Write);
    f.header.key = dstKey;
    f.header.length = static_cast<uint32_t>(std::min<uint64_t>(options_.chunkBytes, bytes - off));
    f.header.offset = dstOffset + off;
    f.header.before = writeChunks_;  // a Write carries its own chunk number, which the receiver checks
    f.payload = s + off;
    f.payloadDevice = srcDevice;
    Enqueue(*channels_[writeChunks_ % n], std::move(f), true);
    ++writeChunks_;
  }
}

void TcpLink::Impl::WordOp(FrameType type, uint32_t key, uint64_t offset, uint64_t arg0, uint64_t arg1,
                           uint64_t* result) {
  ThrowIfFailed();
  MORI_CHECK(offset % 8 == 0, ErrorCode::InvalidUsage, "%s%s at offset %llu of memory key %u: not 8-byte aligned",
             Prefix(nullptr).c_str(), FrameTypeName(static_cast<uint16_t>(type)),
             static_cast<unsigned long long>(offset), key);
  OutFrame f;
  f.header = MakeFrame(type);
  f.header.key = key;
  f.header.offset = offset;
  f.header.before = writeChunks_;
  f.header.arg0 = arg0;
  f.header.arg1 = arg1;
  if (type != FrameType::Update) {
    f.header.id = nextId_++;
    std::lock_guard<std::mutex> lock(stateMutex_);
    atomics_[f.header.id] = result;
  }
  Enqueue(*channels_[0], std::move(f), true);
}

void TcpLink::Impl::Read(void* dst, bool dstDevice, uint32_t srcKey, uint64_t srcOffset, uint64_t bytes) {
  ThrowIfFailed();
  if (bytes == 0) return;
  MORI_CHECK(dst != nullptr, ErrorCode::InvalidUsage, "%sRead of %llu bytes into a null destination",
             Prefix(nullptr).c_str(), static_cast<unsigned long long>(bytes));
  // A chunk per request: the peer holds a request's whole data until it is sent, and the window bounds how many
  // requests are unacknowledged.
  for (uint64_t off = 0; off < bytes; off += options_.chunkBytes) {
    const uint64_t piece = std::min<uint64_t>(options_.chunkBytes, bytes - off);
    OutFrame f;
    f.header = MakeFrame(FrameType::ReadRequest);
    f.header.key = srcKey;
    f.header.offset = srcOffset + off;
    f.header.before = writeChunks_;
    f.header.arg0 = piece;
    f.header.id = nextId_++;
    {
      std::lock_guard<std::mutex> lock(stateMutex_);
      reads_[f.header.id] = PendingRead{static_cast<uint8_t*>(dst) + off, dstDevice, piece, 0};
    }
    Enqueue(*channels_[0], std::move(f), true);
  }
}

bool TcpLink::Impl::AllDoneLocked() const {
  for (const auto& ch : channels_) {
    uint64_t issued = ch->issuedSeq.load();
    if (ch->ackedSeq.load() != issued || ch->doneSeq.load() != issued) return false;
  }
  return reads_.empty() && atomics_.empty();
}

std::string TcpLink::Impl::OutstandingLocked() const {
  std::string s;
  for (const auto& ch : channels_) {
    uint64_t issued = ch->issuedSeq.load();
    uint64_t acked = ch->ackedSeq.load();
    if (issued == acked) continue;
    s +=
        StrFormat("%s%s: %llu of %llu frames unacknowledged (%llu on the socket)", s.empty() ? "" : "; ",
                  ch->name.c_str(), static_cast<unsigned long long>(issued - acked),
                  static_cast<unsigned long long>(issued), static_cast<unsigned long long>(ch->sentSeq.load() - acked));
  }
  if (!reads_.empty()) s += StrFormat("%s%zu reads unanswered", s.empty() ? "" : "; ", reads_.size());
  if (!atomics_.empty()) s += StrFormat("%s%zu atomics unanswered", s.empty() ? "" : "; ", atomics_.size());
  return s;
}

// A Flush that fails, by a failure of the link or by its own timeout (which fails the link: what is queued may
// never complete), throws only once no channel thread touches the caller's memory any more, so that it may be
// freed then.
void TcpLink::Impl::Flush(int64_t timeoutUs) {
  const Deadline deadline =
      timeoutUs < 0 ? Deadline::After(timeoutS_) : Deadline::After(static_cast<double>(timeoutUs) * 1e-6);
  std::unique_lock<std::mutex> lock(stateMutex_);
  while (true) {
    bool done = AllDoneLocked();
    // A peer that closed in order after everything was acknowledged leaves nothing incomplete.
    if (failed_ && !(done && failOrderly_)) {
      DrainLocked(lock);
      RethrowLocked();
    } else if (done) {
      return;
    }
    if (deadline.Expired()) {
      const std::string what =
          StrFormat("Flush waited %.3f s for the peer to acknowledge: %s; the link is failed and its queued work "
                    "dropped", deadline.TotalSeconds(), OutstandingLocked().c_str());
      lock.unlock();
      Fail(nullptr, ErrorCode::Timeout, what, false);
      lock.lock();
      continue;  // the failure (this one, or one that came first) is thrown once the threads are out
    }
    stateCv_.wait_for(lock, std::chrono::milliseconds(std::max(1, std::min(deadline.RemainingMs(), 100))));
  }
}

// Waits, after a failure, until no channel thread runs. They stop within a wake-up period of the failure, or
// after the GPU copy or socket call they are in, each bounded by MORI_TIMEOUT_S; so does this wait.
void TcpLink::Impl::DrainLocked(std::unique_lock<std::mutex>& lock) {
  const Deadline drain = Deadline::After(timeoutS_ + 2 * kWakeMs / 1000.0);
  while (running_ > 0 && !drain.Expired()) stateCv_.wait_for(lock, std::chrono::milliseconds(kWakeMs));
  if (running_ > 0) {
    MORI_LOG_ERROR(Net, "%s%d channel thread(s) still run %.0f s after the link failed: memory they may touch must "
                        "not be freed yet", Prefix(nullptr).c_str(), running_, drain.TotalSeconds());
  }
}

void TcpLink::Impl::InjectRaw(int channel, std::vector<uint8_t> bytes) {
  MORI_CHECK(channel >= 0 && channel < static_cast<int>(channels_.size()), ErrorCode::InvalidUsage, "no channel %d",
             channel);
  OutFrame f;
  f.raw = true;
  f.owned = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
  Enqueue(*channels_[static_cast<size_t>(channel)], std::move(f), false);
}

// ---------------------------------------------------------------------------------------------------------
// Sending (one thread per channel)

void TcpLink::Impl::SenderLoop(LinkChannel& ch) {
  GpuLane gpu(options_.device, [this, &ch] { return Prefix(&ch); });
  bool settled = false;
  const uint64_t window = static_cast<uint64_t>(options_.windowChunks);
  try {
    // With a GPU named, the stream and staging are made now rather than in the middle of a transfer.
    if (options_.device >= 0) Bounce(ch.sendBounce, gpu);
    Prepared();
    settled = true;
    while (true) {
      OutFrame f;
      {
        std::unique_lock<std::mutex> lock(ch.mutex);
        ch.cv.wait(lock, [&] {
          return stopping_ || failed_ || ch.ackPending || !ch.replies.empty() ||
                 (!ch.ordered.empty() && ch.ordered.front().header.seq - ch.ackedSeq.load() <= window);
        });
        if (stopping_ || failed_) break;
        if (ch.ackPending) {
          f.header = MakeFrame(FrameType::Ack);
          f.header.seq = ch.ackSeq;
          ch.ackPending = false;
        } else if (!ch.replies.empty()) {
          f = std::move(ch.replies.front());
          ch.replies.pop_front();
        } else {
          f = std::move(ch.ordered.front());
          ch.ordered.pop_front();
          ch.sentSeq = f.header.seq;  // before the bytes go: the acknowledgement may come back at once
        }
      }
      SendFrame(ch, f, gpu);
      if (IsOrderedFrame(f.header.type)) FrameDone(ch, f.header.seq);
      if (f.held) ReplySent(*f.held);
    }
  } catch (const Stopped&) {
  } catch (const Error& e) {
    Fail(&ch, e.Code(), MessageOf(e), false);
  } catch (const std::exception& e) {
    Fail(&ch, ErrorCode::Internal, e.what(), false);
  }
  Goodbye(ch);
  if (!settled) Prepared();  // its setup failed or it stopped first: the constructor need not wait
  ThreadEnded(ch.senderEnded);
}

void TcpLink::Impl::FrameDone(LinkChannel& ch, uint64_t seq) {
  ch.doneSeq = seq;
  // Flush waits for both the acknowledgement and this; when the acknowledgement came first, wake it now.
  if (ch.ackedSeq.load() >= seq) {
    { std::lock_guard<std::mutex> lock(stateMutex_); }
    stateCv_.notify_all();
  }
}

void TcpLink::Impl::Prepared() {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    ++prepared_;
  }
  stateCv_.notify_all();
}

void TcpLink::Impl::ThreadEnded(std::atomic<bool>& ended) {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    --running_;
    ended = true;
  }
  stateCv_.notify_all();
}

// Sends the whole iovec, bounded by `frame` (the deadline of the frame it is part of) or else by one of its own:
// a bound on the transfer, not on silence, so a peer that reads a byte now and then cannot hold the caller's
// memory longer than MORI_TIMEOUT_S.
void TcpLink::Impl::SendIov(LinkChannel& ch, iovec* iov, int count, bool abortable, const Deadline* frame) {
  const Deadline own = Deadline::After(abortable ? timeoutS_ : kGoodbyeSeconds);
  const Deadline& deadline = frame != nullptr ? *frame : own;
  bool started = false;
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t n = sendmsg(ch.fd.Get(), &msg, MSG_NOSIGNAL);
    if (n > 0) {
      started = true;
      size_t left = static_cast<size_t>(n);
      while (count > 0 && left >= iov->iov_len) {
        left -= iov->iov_len;
        ++iov;
        --count;
      }
      if (count == 0) break;
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    } else {
      int err = n < 0 ? errno : EAGAIN;
      if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR) {
        ch.streamBroken = true;
        if (err == EPIPE || err == ECONNRESET) {
          throw Error(ErrorCode::RemoteFailure,
                      StrFormat("rank %d closed or reset the connection while data was being sent (process gone?)",
                                peerRank_));
        }
        throw SysError(err, StrFormat("sending to rank %d failed: %s", peerRank_, ErrnoString(err).c_str()));
      }
    }
    // More to send (the socket took part of it, or nothing within its timeout): checked after progress too, so a
    // peer that reads a little within every socket timeout cannot stretch the frame past its deadline.
    if (abortable && (stopping_ || failed_)) {
      ch.streamBroken = started;
      throw Stopped{};
    }
    if (deadline.Expired()) {
      ch.streamBroken = started;
      throw TimeoutError(StrFormat("sending a frame to rank %d took longer than %.0f s (is it alive and reading?)",
                                   peerRank_, deadline.TotalSeconds()));
    }
  }
}

void TcpLink::Impl::SendFrame(LinkChannel& ch, const OutFrame& f, GpuLane& gpu) {
  if (f.raw) {
    iovec iov{const_cast<uint8_t*>(f.owned->data()), f.owned->size()};
    SendIov(ch, &iov, 1, true);
    return;
  }
  FrameHeader h = f.header;
  const uint64_t length = h.length;
  if (f.payload == nullptr || !f.payloadDevice) {
    iovec iov[2] = {{&h, sizeof(h)}, {const_cast<uint8_t*>(f.payload), f.payload == nullptr ? 0 : length}};
    SendIov(ch, iov, f.payload == nullptr ? 1 : 2, true);
  } else {
    // Device memory goes through the channel's pinned bounce buffer, a piece at a time.
    auto* bounce = Bounce(ch.sendBounce, gpu).DataAs<uint8_t>();
    const Deadline frame = Deadline::After(timeoutS_);
    iovec head{&h, sizeof(h)};
    SendIov(ch, &head, 1, true, &frame);
    for (uint64_t off = 0; off < length;) {
      size_t piece = static_cast<size_t>(std::min<uint64_t>(ch.sendBounce->Bytes(), length - off));
      try {
        gpu.Copy(bounce, f.payload + off, piece);
      } catch (...) {
        ch.streamBroken = true;
        throw;
      }
      iovec iov{bounce, piece};
      SendIov(ch, &iov, 1, true, &frame);
      off += piece;
    }
  }
  if (h.type == static_cast<uint16_t>(FrameType::Write) || h.type == static_cast<uint16_t>(FrameType::ReadData)) {
    ch.bytesSent += length;
  }
}

void TcpLink::Impl::Goodbye(LinkChannel& ch) {
  bool sendFail = false;
  bool sendClose = false;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (failed_) {
      sendFail = !failFromPeer_;
      reason = failMessage_.substr(0, kMaxFailReasonBytes);
    } else {
      sendClose = stopping_;
    }
  }
  if (!ch.streamBroken && (sendFail || sendClose)) {
    FrameHeader h = MakeFrame(sendFail ? FrameType::Fail : FrameType::Close);
    h.length = sendFail ? static_cast<uint32_t>(reason.size()) : 0;
    iovec iov[2] = {{&h, sizeof(h)}, {reason.data(), reason.size()}};
    try {
      SendIov(ch, iov, sendFail ? 2 : 1, false);
    } catch (...) {
      // The peer is gone or not reading; it learns from the closed socket instead.
    }
  }
  // After a failure the receiver of this channel must stop too; after a Close it reads until the peer's.
  shutdown(ch.fd.Get(), failed_ ? SHUT_RDWR : SHUT_WR);
}

// ---------------------------------------------------------------------------------------------------------
// Receiving (one thread per channel)

void TcpLink::Impl::ReceiverLoop(LinkChannel& ch) {
  GpuLane gpu(options_.device, [this, &ch] { return Prefix(&ch); });
  bool settled = false;
  try {
    if (options_.device >= 0) {
      Bounce(ch.recvBounce, gpu);
      gpu.Word();
    }
    Prepared();
    settled = true;
    if (!options_.receive) {  // a peer that stops reading, for tests: parked until the link ends
      std::unique_lock<std::mutex> lock(stateMutex_);
      stateCv_.wait(lock, [&] { return stopping_ || failed_; });
      throw Stopped{};
    }
    while (true) {
      FrameHeader h;
      RecvExact(ch, &h, sizeof(h), true);
      Dispatch(ch, h, gpu);
    }
  } catch (const Stopped&) {
  } catch (const Error& e) {
    if (!stopping_) Fail(&ch, e.Code(), MessageOf(e), false);
  } catch (const std::exception& e) {
    if (!stopping_) Fail(&ch, ErrorCode::Internal, e.what(), false);
  }
  if (!settled) Prepared();  // its setup failed or it stopped first: the constructor need not wait
  ThreadEnded(ch.receiverEnded);
}

// Receives exactly `bytes`, bounded by `frame` (the deadline of the frame they belong to) or else by one of
// its own, started with the call or, for an `idle` wait (a header, which may be long in coming), with its first
// byte. The bound is on the transfer, not on silence: a peer that trickles a byte now and then cannot hold a
// target (and its deregistration) longer than MORI_TIMEOUT_S.
void TcpLink::Impl::RecvExact(LinkChannel& ch, void* data, size_t bytes, bool idle, const Deadline* frame) {
  auto* p = static_cast<uint8_t*>(data);
  size_t got = 0;
  Deadline own = Deadline::After(timeoutS_);
  const Deadline& deadline = frame != nullptr ? *frame : own;
  const auto tooSlow = [&] {
    return TimeoutError(StrFormat("rank %d sent %zu of %zu bytes of a frame in %.0f s (too slow, or gone)", peerRank_,
                                  got, bytes, deadline.TotalSeconds()));
  };
  while (got < bytes) {
    ssize_t n = recv(ch.fd.Get(), p + got, bytes - got, MSG_WAITALL);
    if (n > 0) {
      if (idle && got == 0 && frame == nullptr) own = Deadline::After(timeoutS_);
      got += static_cast<size_t>(n);
      // Checked after progress too: a byte within every socket timeout must not keep the transfer going.
      if (got < bytes && deadline.Expired()) throw tooSlow();
      continue;
    }
    if (n == 0) {
      if (stopping_ || failed_) throw Stopped{};
      if (idle && got == 0) {
        throw Error(ErrorCode::RemoteFailure, StrFormat("rank %d closed the connection (process gone?)", peerRank_));
      }
      throw Error(ErrorCode::RemoteFailure,
                  StrFormat("rank %d closed the connection in the middle of a frame (%zu of %zu bytes came; "
                            "process gone?)",
                            peerRank_, got, bytes));
    }
    int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) {
      if (stopping_ || failed_) throw Stopped{};
      if (idle && got == 0) continue;  // an idle connection may stay idle
      if (deadline.Expired()) throw tooSlow();
      continue;
    }
    if (stopping_ || failed_) throw Stopped{};
    if (err == ECONNRESET) {
      throw Error(ErrorCode::RemoteFailure, StrFormat("rank %d reset the connection (process gone?)", peerRank_));
    }
    throw SysError(err, StrFormat("receiving from rank %d failed: %s", peerRank_, ErrnoString(err).c_str()));
  }
}

void TcpLink::Impl::ReceiveInto(LinkChannel& ch, uint8_t* dst, bool device, uint64_t bytes, GpuLane& gpu) {
  const Deadline frame = Deadline::After(timeoutS_);  // one bound for the whole payload, however it is cut
  if (!device) {
    RecvExact(ch, dst, bytes, false, &frame);
  } else {
    auto* bounce = Bounce(ch.recvBounce, gpu).DataAs<uint8_t>();
    for (uint64_t off = 0; off < bytes;) {
      size_t piece = static_cast<size_t>(std::min<uint64_t>(ch.recvBounce->Bytes(), bytes - off));
      RecvExact(ch, bounce, piece, false, &frame);
      gpu.Copy(dst + off, bounce, piece);
      off += piece;
    }
  }
  ch.bytesReceived += bytes;
}

TcpTarget TcpLink::Impl::Resolve(const FrameHeader& h, uint64_t bytes) const {
  try {
    return ResolveTcpMemory(h.key, h.offset, bytes, peerRank_);
  } catch (const Error& e) {
    throw Error(e.Code(), StrFormat("%s frame from rank %d refused, nothing written: %s", FrameTypeName(h.type),
                                    peerRank_, MessageOf(e).c_str()));
  }
}

void TcpLink::Impl::Dispatch(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu) {
  std::string bad = CheckFrame(h);
  MORI_CHECK(bad.empty(), ErrorCode::Protocol, "malformed frame from rank %d, nothing written: %s", peerRank_,
             bad.c_str());
  if (IsOrderedFrame(h.type)) {
    // Word operations and reads are ordered against the Write chunks of every channel from channel 0 only.
    MORI_CHECK(h.type == static_cast<uint16_t>(FrameType::Write) || ch.index == 0, ErrorCode::Protocol,
               "%s frame from rank %d on channel %d (they travel on channel 0); nothing written", FrameTypeName(h.type),
               peerRank_, ch.index);
    MORI_CHECK(h.seq == ch.recvSeq + 1, ErrorCode::Protocol,
               "%s frame from rank %d with sequence number %llu, expected %llu; nothing written", FrameTypeName(h.type),
               peerRank_, static_cast<unsigned long long>(h.seq), static_cast<unsigned long long>(ch.recvSeq + 1));
  }
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::Write:
      ApplyWrite(ch, h, gpu);
      break;
    case FrameType::Update:
    case FrameType::FetchAdd:
    case FrameType::CompareSwap:
      ApplyWordOp(ch, h, gpu);
      break;
    case FrameType::ReadRequest:
      ApplyRead(ch, h, gpu);
      break;
    case FrameType::Ack:
      OnAck(ch, h);
      return;
    case FrameType::ReadData:
      OnReadData(ch, h, gpu);
      return;
    case FrameType::AtomicResult:
      OnAtomicResult(h);
      return;
    case FrameType::Fail: {
      std::string reason(h.length, '\0');
      RecvExact(ch, reason.data(), reason.size(), false);
      Fail(&ch, ErrorCode::RemoteFailure, StrFormat("rank %d failed the connection: %s", peerRank_, reason.c_str()),
           true);
      throw Stopped{};
    }
    case FrameType::Close:
      Fail(&ch, ErrorCode::RemoteFailure, StrFormat("rank %d closed the connection", peerRank_), true, true);
      throw Stopped{};
    case FrameType::Hello:
    case FrameType::HelloAck:
      MORI_THROW(ErrorCode::Protocol, "%s frame from rank %d after setup", FrameTypeName(h.type), peerRank_);
  }
  ch.recvSeq = h.seq;
  if (ch.index != 0) {
    QueueAck(ch, h.seq);
    return;
  }
  uint64_t ack;
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    applied0_ = h.seq;
    ack = Channel0AckLocked();
  }
  QueueAck(ch, ack);
}

// Channel 0 acknowledges its frames up to the first read whose data is not all sent.
uint64_t TcpLink::Impl::Channel0AckLocked() const {
  return held_.empty() ? applied0_ : std::min(applied0_, held_.front()->seq - 1);
}

void TcpLink::Impl::ReplySent(HeldRead& read) {
  if (read.framesLeft.fetch_sub(1) != 1) return;
  uint64_t ack;
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    while (!held_.empty() && held_.front()->framesLeft.load() == 0) {
      heldBytes_ -= held_.front()->bytes;
      held_.pop_front();
    }
    ack = Channel0AckLocked();
  }
  QueueAck(*channels_[0], ack);
}

void TcpLink::Impl::QueueAck(LinkChannel& ch, uint64_t seq) {
  {
    std::lock_guard<std::mutex> lock(ch.mutex);
    ch.ackSeq = std::max(ch.ackSeq, seq);  // channel 0's receiver and senders both acknowledge: never backwards
    ch.ackPending = true;
  }
  ch.cv.notify_one();
}

void TcpLink::Impl::ApplyWrite(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu) {
  const uint64_t n = channels_.size();
  const uint64_t expected = static_cast<uint64_t>(ch.index) + n * ch.appliedWrites;
  MORI_CHECK(h.before == expected, ErrorCode::Protocol,
             "Write frame from rank %d carries chunk %llu where chunk %llu was due on this channel; nothing written",
             peerRank_, static_cast<unsigned long long>(h.before), static_cast<unsigned long long>(expected));
  TcpTarget t = Resolve(h, h.length);
  if (options_.beforeApplyForTest) options_.beforeApplyForTest();
  ReceiveInto(ch, t.Ptr(), t.DeviceMemory(), h.length, gpu);
  t.Release();
  {
    std::lock_guard<std::mutex> lock(appliedMutex_);
    ++ch.appliedWrites;
  }
  appliedCv_.notify_all();
}

void TcpLink::Impl::WaitForEarlierWrites(const FrameHeader& h) {
  const uint64_t n = channels_.size();
  // Write chunks g < before with g % n == c (rounding `before` up would overflow for a corrupt count).
  const auto chunksBefore = [&](uint64_t c) { return h.before / n + (c < h.before % n ? 1 : 0); };
  const Deadline deadline = Deadline::After(timeoutS_);
  std::unique_lock<std::mutex> lock(appliedMutex_);
  // This frame came on channel 0 after every chunk of channel 0 issued before it and before any issued after it,
  // so channel 0's count is exact now: another is a corrupt frame, which waiting would only turn into a timeout.
  MORI_CHECK(channels_[0]->appliedWrites == chunksBefore(0), ErrorCode::Protocol,
             "%s frame from rank %d counts %llu Write chunks before it, %llu of them on channel 0, where %llu came; "
             "nothing written",
             FrameTypeName(h.type), peerRank_, static_cast<unsigned long long>(h.before),
             static_cast<unsigned long long>(chunksBefore(0)),
             static_cast<unsigned long long>(channels_[0]->appliedWrites));
  while (true) {
    int lagging = -1;
    uint64_t need = 0;
    for (uint64_t c = 1; c < n; ++c) {
      need = chunksBefore(c);
      if (channels_[c]->appliedWrites < need) {
        lagging = static_cast<int>(c);
        break;
      }
    }
    if (lagging < 0) return;
    if (stopping_ || failed_) throw Stopped{};
    if (deadline.Expired()) {
      throw TimeoutError(
          StrFormat("a %s from rank %d waited %.0f s for the Write chunks sent before it on channel "
                    "%d (%llu of %llu arrived)",
                    FrameTypeName(h.type), peerRank_, deadline.TotalSeconds(), lagging,
                    static_cast<unsigned long long>(channels_[static_cast<size_t>(lagging)]->appliedWrites),
                    static_cast<unsigned long long>(need)));
    }
    appliedCv_.wait_for(lock, std::chrono::milliseconds(100));
  }
}

void TcpLink::Impl::ApplyWordOp(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu) {
  WaitForEarlierWrites(h);  // first: the registration is held only while the word is touched
  TcpTarget t = Resolve(h, sizeof(uint64_t));
  MORI_CHECK(reinterpret_cast<uintptr_t>(t.Ptr()) % 8 == 0, ErrorCode::Protocol,
             "%s frame from rank %d for offset %llu of memory key %u: not 8-byte aligned; nothing written",
             FrameTypeName(h.type), peerRank_, static_cast<unsigned long long>(h.offset), h.key);
  auto* word = reinterpret_cast<uint64_t*>(t.Ptr());
  const auto type = static_cast<FrameType>(h.type);
  uint64_t old = 0;
  uint64_t* staging = t.DeviceMemory() ? gpu.Word() : nullptr;  // before the lock: may allocate
  {
    std::lock_guard<std::mutex> lock(WordLock(word));
    if (!t.DeviceMemory()) {
      if (type == FrameType::Update) {
        AtomicStore<MemoryOrder::Release>(word, h.arg0);
      } else if (type == FrameType::FetchAdd) {
        old = AtomicFetchAdd(word, h.arg0);
      } else {
        old = AtomicCompareExchange(word, h.arg0, h.arg1);
      }
    } else {
      if (type != FrameType::Update) {
        gpu.Copy(staging, word, sizeof(old));
        old = *staging;
      }
      *staging = type == FrameType::Update     ? h.arg0
                 : type == FrameType::FetchAdd ? old + h.arg0
                                               : (old == h.arg0 ? h.arg1 : old);
      gpu.Copy(word, staging, sizeof(uint64_t));
    }
  }
  t.Release();
  if (type != FrameType::Update) {
    OutFrame r;
    r.header = MakeFrame(FrameType::AtomicResult);
    r.header.id = h.id;
    r.header.arg0 = old;
    Enqueue(ch, std::move(r), false);
  }
}

GpuBuffer& TcpLink::Impl::Bounce(std::unique_ptr<GpuBuffer>& bounce, GpuLane& gpu) {
  gpu.Ensure();  // pinned allocations need the thread's device set
  if (!bounce)
    bounce = std::make_unique<GpuBuffer>(std::min(kMaxBounceBytes, options_.chunkBytes), MemoryType::HostPinned);
  return *bounce;
}

void TcpLink::Impl::ApplyRead(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu) {
  const uint64_t bytes = h.arg0;
  WaitForEarlierWrites(h);
  auto held = std::make_shared<HeldRead>();
  held->seq = h.seq;
  held->bytes = bytes;
  held->framesLeft = (bytes + options_.chunkBytes - 1) / options_.chunkBytes;
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    MORI_CHECK(heldBytes_ + bytes <= kMaxHeldReadBytes, ErrorCode::Protocol,
               "ReadRequest from rank %d for %llu bytes while %llu bytes it asked for are not sent yet: more than the "
               "%llu a connection holds (the peer does not keep to its window); nothing read",
               peerRank_, static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(heldBytes_),
               static_cast<unsigned long long>(kMaxHeldReadBytes));
    heldBytes_ += bytes;
    held_.push_back(held);
  }
  TcpTarget t = Resolve(h, bytes);
  // Copied now, at the request's place in the order, not when the replies go out.
  auto data = std::make_shared<std::vector<uint8_t>>(bytes);
  if (t.DeviceMemory()) {
    GpuBuffer& bounce = Bounce(ch.recvBounce, gpu);
    for (uint64_t off = 0; off < bytes;) {
      size_t piece = static_cast<size_t>(std::min<uint64_t>(bounce.Bytes(), bytes - off));
      gpu.Copy(bounce.Data(), t.Ptr() + off, piece);
      std::memcpy(data->data() + off, bounce.Data(), piece);
      off += piece;
    }
  } else {
    std::memcpy(data->data(), t.Ptr(), bytes);
  }
  t.Release();
  for (uint64_t off = 0; off < bytes; off += options_.chunkBytes) {
    OutFrame r;
    r.header = MakeFrame(FrameType::ReadData);
    r.header.id = h.id;
    r.header.offset = off;
    r.header.length = static_cast<uint32_t>(std::min<uint64_t>(options_.chunkBytes, bytes - off));
    r.payload = data->data() + off;
    r.owned = data;
    r.held = held;
    Enqueue(*channels_[replyCursor_++ % channels_.size()], std::move(r), false);
  }
}

void TcpLink::Impl::OnAck(LinkChannel& ch, const FrameHeader& h) {
  const uint64_t sent = ch.sentSeq.load();
  const uint64_t acked = ch.ackedSeq.load();
  MORI_CHECK(h.seq >= acked && h.seq <= sent, ErrorCode::Protocol,
             "Ack from rank %d for frame %llu; %llu frames were sent on this channel and %llu acknowledged", peerRank_,
             static_cast<unsigned long long>(h.seq), static_cast<unsigned long long>(sent),
             static_cast<unsigned long long>(acked));
  ch.ackedSeq = h.seq;
  { std::lock_guard<std::mutex> lock(ch.mutex); }
  ch.cv.notify_one();
  { std::lock_guard<std::mutex> lock(stateMutex_); }
  stateCv_.notify_all();
}

void TcpLink::Impl::OnReadData(LinkChannel& ch, const FrameHeader& h, GpuLane& gpu) {
  PendingRead r;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    auto it = reads_.find(h.id);
    MORI_CHECK(it != reads_.end(), ErrorCode::Protocol,
               "ReadData frame from rank %d for read %llu, which is not pending here; nothing written", peerRank_,
               static_cast<unsigned long long>(h.id));
    r = it->second;
  }
  MORI_CHECK(h.offset <= r.bytes && h.length <= r.bytes - h.offset, ErrorCode::Protocol,
             "ReadData frame from rank %d for [%llu, + %u) of read %llu, which has %llu bytes; nothing written",
             peerRank_, static_cast<unsigned long long>(h.offset), h.length, static_cast<unsigned long long>(h.id),
             static_cast<unsigned long long>(r.bytes));
  ReceiveInto(ch, r.dst + h.offset, r.device, h.length, gpu);
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    auto it = reads_.find(h.id);
    MORI_CHECK(it != reads_.end() && it->second.received + h.length <= it->second.bytes, ErrorCode::Protocol,
               "rank %d answered read %llu with more bytes than it asked for", peerRank_,
               static_cast<unsigned long long>(h.id));
    it->second.received += h.length;
    if (it->second.received == it->second.bytes) reads_.erase(it);
  }
  stateCv_.notify_all();
}

void TcpLink::Impl::OnAtomicResult(const FrameHeader& h) {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    auto it = atomics_.find(h.id);
    MORI_CHECK(it != atomics_.end(), ErrorCode::Protocol,
               "AtomicResult frame from rank %d for atomic %llu, which is not pending here", peerRank_,
               static_cast<unsigned long long>(h.id));
    if (it->second != nullptr) *it->second = h.arg0;
    atomics_.erase(it);
  }
  stateCv_.notify_all();
}

// ---------------------------------------------------------------------------------------------------------
// Public face

TcpLinkOptions TcpLinkOptions::Resolve(const EndpointConfig::Tcp& tcp, int device) {
  TcpLinkOptions o;
  o.numChannels = tcp.numChannels != 0 ? tcp.numChannels : static_cast<int>(EnvGetInt("MORI_TCP_CHANNELS"));
  o.windowChunks = tcp.windowChunks != 0 ? tcp.windowChunks : static_cast<int>(EnvGetInt("MORI_TCP_WINDOW"));
  o.chunkBytes = tcp.chunkBytes != 0 ? tcp.chunkBytes : EnvGetSize("MORI_TCP_CHUNK_SIZE");
  o.ifnames = SplitList(tcp.ifnames.empty() ? EnvGetString("MORI_SOCKET_IFNAME") : tcp.ifnames);
  o.device = device;
  ValidateOptions(o);
  return o;
}

TcpListener::TcpListener(const TcpLinkOptions& options, int rank) : state_(std::make_unique<State>()) {
  ValidateOptions(options);
  state_->options = options;
  OpenListeners(*state_, rank);
}
TcpListener::TcpListener(TcpListener&&) noexcept = default;
TcpListener& TcpListener::operator=(TcpListener&&) noexcept = default;
TcpListener::~TcpListener() = default;

void TcpListener::Close() {
  if (state_) state_->listeners.clear();
}

const TcpHandle& TcpListener::Handle() const { return state_->handle; }
std::vector<uint8_t> TcpListener::HandleBytes() const { return EncodeHandle(state_->handle); }

TcpLink::TcpLink(TcpListener listener, const std::vector<uint8_t>& peerHandle, int peerRank, const Deadline& deadline) {
  TcpListener::State& s = listener.GetState();
  TcpHandle peer;
  try {
    peer = DecodeHandle(peerHandle);
  } catch (const Error& e) {
    ThrowError(e.Code(),
               StrFormat("rank %d, Tcp connection to rank %d: %s", s.handle.rank, peerRank, MessageOf(e).c_str()));
  }
  MORI_CHECK(peerRank < 0 || peer.rank == peerRank, ErrorCode::Protocol,
             "rank %d, Tcp connection to rank %d: the handle received says it comes from rank %d", s.handle.rank,
             peerRank, peer.rank);
  EstablishedChannels established = EstablishChannels(s, peer, deadline);
  impl_ = std::make_unique<Impl>(s.options, s.handle.rank, peer.rank, std::move(established));
}

std::unique_ptr<TcpLink> TcpLink::Connect(Bootstrap& bootstrap, int peerRank, int tag, const TcpLinkOptions& options) {
  TcpListener listener(options, bootstrap.GetRank());
  SendHandle(bootstrap, listener, peerRank, tag);
  std::vector<uint8_t> peerHandle = RecvHandle(bootstrap, peerRank, tag);
  return std::make_unique<TcpLink>(std::move(listener), peerHandle, peerRank, Deadline::After(TimeoutSeconds()));
}

std::unique_ptr<TcpLink> TcpLink::Loopback(const TcpLinkOptions& options, int rank) {
  TcpListener issuing(options, rank);
  TcpListener serving(options, rank);
  const std::vector<uint8_t> issuingHandle = issuing.HandleBytes();
  const std::vector<uint8_t> servingHandle = serving.HandleBytes();
  std::vector<int> servingListeners;
  for (const UniqueFd& fd : serving.GetState().listeners) servingListeners.push_back(fd.Get());
  const Deadline deadline = Deadline::After(TimeoutSeconds());
  // One end accepts while the other connects: the serving end is set up on a thread of its own.
  std::unique_ptr<TcpLink> server;
  std::exception_ptr serverError;
  std::thread serverThread([&] {
    try {
      server = std::make_unique<TcpLink>(std::move(serving), issuingHandle, rank, deadline);
    } catch (...) {
      serverError = std::current_exception();
    }
  });
  std::unique_ptr<TcpLink> link;
  try {
    link = std::make_unique<TcpLink>(std::move(issuing), servingHandle, rank, deadline);
  } catch (...) {
    // Wakes the serving end if it is still waiting at its listeners (it owns them until it returns).
    for (int fd : servingListeners) shutdown(fd, SHUT_RDWR);
    serverThread.join();
    throw;
  }
  serverThread.join();
  if (serverError) std::rethrow_exception(serverError);
  link->impl_->loopback_ = true;
  server->impl_->loopback_ = true;
  link->impl_->servingEnd_ = std::move(server);
  return link;
}

void TcpLink::SendHandle(Bootstrap& bootstrap, const TcpListener& listener, int peerRank, int tag) {
  bootstrap.SendBytes(listener.HandleBytes(), peerRank, tag);
}

std::vector<uint8_t> TcpLink::RecvHandle(Bootstrap& bootstrap, int peerRank, int tag) {
  // The length-prefixed form of Bootstrap::SendBytes, with the length checked before anything is allocated.
  uint64_t n = 0;
  bootstrap.Recv(&n, sizeof(n), peerRank, tag);
  constexpr uint64_t kMaxHandleBytes = sizeof(HandleHeader) + kMaxChannels * sizeof(net::WireAddress);
  MORI_CHECK(n >= sizeof(HandleHeader) && n <= kMaxHandleBytes, ErrorCode::Protocol,
             "rank %d, Tcp connection to rank %d: malformed TCP handle of %llu bytes (a handle has %zu to %llu)",
             bootstrap.GetRank(), peerRank, static_cast<unsigned long long>(n), sizeof(HandleHeader),
             static_cast<unsigned long long>(kMaxHandleBytes));
  std::vector<uint8_t> bytes(n);
  bootstrap.Recv(bytes.data(), bytes.size(), peerRank, tag);
  return bytes;
}

TcpLink::~TcpLink() {
  if (impl_ && !impl_->Stop()) {
    // Threads are still inside it: the Impl stays theirs, kept (never destroyed) where it stays reachable.
    static std::mutex mutex;
    static auto* kept = new std::vector<std::unique_ptr<Impl>>();
    std::lock_guard<std::mutex> lock(mutex);
    kept->push_back(std::move(impl_));
  }
}

void TcpLink::Write(uint32_t dstKey, uint64_t dstOffset, const void* src, bool srcDevice, uint64_t bytes) {
  impl_->Write(dstKey, dstOffset, src, srcDevice, bytes);
}
void TcpLink::UpdateWord(uint32_t dstKey, uint64_t dstOffset, uint64_t value) {
  impl_->WordOp(FrameType::Update, dstKey, dstOffset, value, 0, nullptr);
}
void TcpLink::Read(void* dst, bool dstDevice, uint32_t srcKey, uint64_t srcOffset, uint64_t bytes) {
  impl_->Read(dst, dstDevice, srcKey, srcOffset, bytes);
}
void TcpLink::FetchAdd(uint32_t dstKey, uint64_t dstOffset, uint64_t value, uint64_t* result) {
  impl_->WordOp(FrameType::FetchAdd, dstKey, dstOffset, value, 0, result);
}
void TcpLink::CompareSwap(uint32_t dstKey, uint64_t dstOffset, uint64_t compare, uint64_t swap, uint64_t* result) {
  impl_->WordOp(FrameType::CompareSwap, dstKey, dstOffset, compare, swap, result);
}
void TcpLink::Flush(int64_t timeoutUs) { impl_->Flush(timeoutUs); }

int TcpLink::NumChannels() const { return static_cast<int>(impl_->channels_.size()); }
const TcpLinkOptions& TcpLink::Options() const { return impl_->options_; }
int TcpLink::PeerRank() const { return impl_->peerRank_; }
bool TcpLink::IsLoopback() const { return impl_->loopback_; }
bool TcpLink::Failed() const { return impl_->failed_; }
int TcpLink::RefusedConnections() const { return impl_->refused_; }

std::vector<TcpChannelInfo> TcpLink::Channels() const {
  std::vector<TcpChannelInfo> out;
  for (const auto& ch : impl_->channels_) {
    TcpChannelInfo info;
    info.index = ch->index;
    info.ifname = ch->ifname;
    info.local = ch->local;
    info.peer = ch->peer;
    info.bytesSent = ch->bytesSent.load();
    info.bytesReceived = ch->bytesReceived.load();
    out.push_back(info);
  }
  return out;
}

std::string TcpLink::Describe() const {
  if (impl_->loopback_)
    return StrFormat("Tcp loopback of rank %d (%zu channels)", impl_->rank_, impl_->channels_.size());
  return StrFormat("Tcp rank %d <-> rank %d (%zu channels)", impl_->rank_, impl_->peerRank_, impl_->channels_.size());
}

void TcpLink::InjectRawBytesForTest(int channel, std::vector<uint8_t> bytes) {
  impl_->InjectRaw(channel, std::move(bytes));
}

}  // namespace mori::core::tcp
