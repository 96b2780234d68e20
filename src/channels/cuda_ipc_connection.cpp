// The CudaIpc connection: the copy engine moves data between this GPU's memory and a same-host peer's memory
// mapped here, in order on the process's copy stream (HostCopyStream); the words of UpdateAndSync (semaphore
// signals) are written by that stream itself after them (GpuStreamWriteValue64), or copied from a pinned
// staging ring where the device cannot. On HOST the stream's worker thread plays the copy engine.
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "communicator_impl.hpp"
#include "mori/core/atomic.hpp"
#include "mori/channels/connection.hpp"
#include "mori/core/device_scope.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"
#include "proxy_copy.hpp"

namespace mori::core {

namespace {

// Host-pinned words that UpdateAndSync copies new values from. A word is reused only after the stream has
// drained (Flush, or a wait when the ring is used up), so no copy ever reads a word rewritten after it was
// issued.
constexpr int kStagingWords = 64;

int ResolveDevice(int requested) {
  int count = 0;
  MORI_CHECK_GPU(GpuGetDeviceCount(&count));
  int device = requested;
  if (device < 0) MORI_CHECK_GPU(GpuGetDevice(&device));
  MORI_CHECK(device < count, ErrorCode::InvalidUsage, "CudaIpc connection on device %d, but %d device(s) exist", device,
             count);
  return device;
}

// MORI_CUDA_IPC_WORDS: whether words go by GpuStreamWriteValue64 (a device that cannot still gets copies).
bool WordsByStream() {
  const std::string how = EnvGetChoice("MORI_CUDA_IPC_WORDS");
  if (how == "auto") return !MORI_BACKEND_HIP;
  return how == "stream";
}

class CudaIpcConnection final : public Connection {
 public:
  CudaIpcConnection(int rank, int remoteRank, int tag, int device)
      : Connection(remoteRank, tag), rank_(rank), device_(device) {
    DeviceScope scope(device_);
    stream_ = HostCopyStream(device_);
    staging_ = GpuBuffer(kStagingWords * sizeof(uint64_t), MemoryType::HostPinned);
    if (writeValues_ && !GpuCanStreamWriteValue64(device_)) {
      writeValues_ = false;
      MORI_LOG_INFO(Proxy, "%s: device %d cannot write words from a stream", Describe().c_str(), device_);
    }
  }

  ~CudaIpcConnection() override {
    // Copies still in flight read the staging ring: it may go only after them.
    try {
      DeviceScope scope(device_);
      WaitStream(Deadline::Default(), "the connection closed");
    } catch (const Error& e) {
      MORI_LOG_WARN(Proxy, "rank %d: %s", rank_, e.what());
    }
  }

  void Write(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
             uint64_t bytes) override {
    uint8_t* to = Resolve(dst, dstOffset, bytes, "Write destination", false);
    uint8_t* from = Resolve(src, srcOffset, bytes, "Write source", true);
    if (bytes == 0) return;
    DeviceScope scope(device_);
    MORI_CHECK_GPU(GpuMemcpyAsync(to, from, bytes, stream_));
  }

  void UpdateAndSync(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t* src, uint64_t newValue) override {
    MORI_CHECK(src != nullptr, ErrorCode::InvalidUsage, "%s: UpdateAndSync with a null source word",
               Describe().c_str());
    uint8_t* to = Resolve(dst, dstOffset, sizeof(uint64_t), "UpdateAndSync word", false);
    MORI_CHECK(reinterpret_cast<uintptr_t>(to) % sizeof(uint64_t) == 0, ErrorCode::InvalidUsage,
               "%s: UpdateAndSync word at offset %llu is not 8-byte aligned", Describe().c_str(),
               static_cast<unsigned long long>(dstOffset));
    *src = newValue;
    DeviceScope scope(device_);
    if (writeValues_) {
      // In stream order, after every Write issued before and once their data is visible, by the GPU itself.
      GpuStatus rc = GpuStreamWriteValue64(reinterpret_cast<uint64_t*>(to), newValue, stream_);
      if (rc == kGpuSuccess) return;
      throw GpuError(static_cast<int>(rc),
                     StrFormat("%s: writing the word at offset %llu failed: %s (MORI_CUDA_IPC_WORDS=copy sends words "
                               "as copies instead)",
                               Describe().c_str(), static_cast<unsigned long long>(dstOffset), GpuGetErrorString(rc)));
    }
    if (stagingInFlight_ == kStagingWords) {
      WaitStream(Deadline::Default(), "the staging ring wrapped");
      stagingInFlight_ = 0;
    }
    uint64_t* word = staging_.DataAs<uint64_t>() + nextStaging_;
    nextStaging_ = (nextStaging_ + 1) % kStagingWords;
    ++stagingInFlight_;
    *word = newValue;
    // In stream order, so after every Write issued before.
    MORI_CHECK_GPU(GpuMemcpyAsync(to, word, sizeof(uint64_t), stream_));
  }

  void Read(const RegisteredMemory& dst, uint64_t dstOffset, const RegisteredMemory& src, uint64_t srcOffset,
            uint64_t bytes) override {
    uint8_t* to = Resolve(dst, dstOffset, bytes, "Read destination", true);
    uint8_t* from = Resolve(src, srcOffset, bytes, "Read source", false);
    if (bytes == 0) return;
    DeviceScope scope(device_);
    MORI_CHECK_GPU(GpuMemcpyAsync(to, from, bytes, stream_));
  }

  void AtomicFetchAdd(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t value, uint64_t* result) override {
    uint64_t* word = AtomicWord(dst, dstOffset);
    uint64_t old = core::AtomicFetchAdd<MemoryOrder::AcqRel, Scope::System>(word, value);
    if (result != nullptr) *result = old;
  }

  void AtomicCompareSwap(const RegisteredMemory& dst, uint64_t dstOffset, uint64_t compare, uint64_t swap,
                         uint64_t* result) override {
    uint64_t* word = AtomicWord(dst, dstOffset);
    uint64_t old = core::AtomicCompareExchange<MemoryOrder::AcqRel, Scope::System>(word, compare, swap);
    if (result != nullptr) *result = old;
  }

  void Flush(int64_t timeoutUs) override {
    Deadline deadline = timeoutUs < 0 ? Deadline::Default() : Deadline::After(static_cast<double>(timeoutUs) / 1e6);
    DeviceScope scope(device_);
    WaitStream(deadline, "Flush");
    stagingInFlight_ = 0;
  }

  Transport GetTransport() const override { return Transport::CudaIpc; }
  // Connect's handshake refuses any other transport on the peer's side.
  Transport GetRemoteTransport() const override { return Transport::CudaIpc; }
  std::string Describe() const override {
    return StrFormat("CudaIpc to rank %d (rank %d, device %d, tag %d, words %s)", RemoteRank(), rank_, device_, Tag(),
                     writeValues_ ? "written by the stream" : "copied from staging");
  }

 private:
  // Checks one side of a transfer: memory reachable here (local when `mustBeLocal`) and the range inside it.
  uint8_t* Resolve(const RegisteredMemory& m, uint64_t offset, uint64_t bytes, const char* role, bool mustBeLocal) {
    MORI_CHECK(m.Valid(), ErrorCode::InvalidUsage, "%s: the %s is an empty RegisteredMemory", Describe().c_str(), role);
    MORI_CHECK(!mustBeLocal || m.IsLocal(), ErrorCode::InvalidUsage,
               "%s: the %s must be memory registered in this process, not rank %d's memory at %p", Describe().c_str(),
               role, m.Rank(), m.OriginalDataPtr());
    MORI_CHECK(m.Data() != nullptr, ErrorCode::InvalidUsage,
               "%s: the %s (rank %d's memory at %p, %zu bytes) is not mapped here: it needs CudaIpc among its "
               "transports and to come from a same-host rank",
               Describe().c_str(), role, m.Rank(), m.OriginalDataPtr(), m.Size());
    MORI_CHECK(bytes <= m.Size() && offset <= m.Size() - bytes, ErrorCode::InvalidUsage,
               "%s: the %s range [%llu, + %llu) leaves rank %d's %zu-byte memory at %p", Describe().c_str(), role,
               static_cast<unsigned long long>(offset), static_cast<unsigned long long>(bytes), m.Rank(), m.Size(),
               m.OriginalDataPtr());
    return static_cast<uint8_t*>(m.Data()) + offset;
  }

  // The copy engine has no atomics. Where both sides are host memory (HOST) the CPU does them, after every
  // copy issued before has landed.
  uint64_t* AtomicWord(const RegisteredMemory& dst, uint64_t dstOffset) {
#if MORI_BACKEND_HOST
    uint8_t* word = Resolve(dst, dstOffset, sizeof(uint64_t), "atomic target", false);
    MORI_CHECK(reinterpret_cast<uintptr_t>(word) % sizeof(uint64_t) == 0, ErrorCode::InvalidUsage,
               "%s: atomic target at offset %llu is not 8-byte aligned", Describe().c_str(),
               static_cast<unsigned long long>(dstOffset));
    DeviceScope scope(device_);
    WaitStream(Deadline::Default(), "an atomic");
    stagingInFlight_ = 0;
    return reinterpret_cast<uint64_t*>(word);
#else
    (void)dst;
    (void)dstOffset;
    MORI_THROW(ErrorCode::NotSupported, "%s: the copy engine has no atomics; use an IB, Emulated or Tcp connection",
               Describe().c_str());
#endif
  }

  // Waits for the copies this connection issued so far (an event after them: the stream is the process's,
  // HostCopyStream, and other threads' later copies are not waited for).
  void WaitStream(const Deadline& deadline, const char* why) {
    GpuEvent issued = nullptr;
    MORI_CHECK_GPU(ThreadWaitEvent(&issued));  // the caller set device_ current
    MORI_CHECK_GPU(GpuEventRecord(issued, stream_));
    while (true) {
      GpuStatus s = GpuEventQuery(issued);
      if (s == kGpuSuccess) return;
      if (s != kGpuErrorNotReady) {
        throw GpuError(static_cast<int>(s), StrFormat("%s: a copy failed (waiting for %s): %s", Describe().c_str(), why,
                                                      GpuGetErrorString(s)));
      }
      if (deadline.Expired()) {
        throw TimeoutError(StrFormat("%s: the copies issued before %s did not complete within %.3f s%s",
                                     Describe().c_str(), why, deadline.TotalSeconds(),
                                     SlowProxyCopyHint(deadline.TotalSeconds()).c_str()));
      }
      std::this_thread::yield();
    }
  }

  int rank_;
  int device_;
  GpuStream stream_{};
  GpuBuffer staging_;
  int nextStaging_ = 0;
  int stagingInFlight_ = 0;  // staging words handed to copies since the stream last drained
  // Words go by GpuStreamWriteValue64 rather than a copy from the staging ring: after a copy, a second copy-engine
  // operation took 0.2-0.8 us longer on an H200, 1.7-2.0 us under MPS (bench/experiments/signal_after_copy.cu,
  // docs/PERF.md). MORI_CUDA_IPC_WORDS chooses; auto keeps HIP on the copies (how hipStreamWriteValue64 orders
  // after a stream's copies is unmeasured here). Decided once, when the connection is made: a device that cannot
  // (GpuCanStreamWriteValue64) gets the copies.
  bool writeValues_ = WordsByStream();
};

}  // namespace

std::shared_future<std::shared_ptr<Connection>> ConnectCudaIpc(Communicator::Impl& comm, const EndpointConfig& config,
                                                               int remoteRank, int tag, int /*bootstrapTag*/) {
  // Nothing to exchange: Connect's hello already paired the transports, and the peer's memory arrives mapped.
  std::shared_ptr<Connection> connection =
      std::make_shared<CudaIpcConnection>(comm.Rank(), remoteRank, tag, ResolveDevice(config.device));
  std::promise<std::shared_ptr<Connection>> ready;
  ready.set_value(std::move(connection));
  return ready.get_future().share();
}

}  // namespace mori::core
