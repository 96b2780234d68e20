// bidir_port_channel: two ranks PutWithSignal to each other through port channels (a proxy thread on each side
// carries the puts over CudaIpc, an RDMA NIC or TCP), for sizes from 1 KiB up, timing each and verifying every
// byte that arrived and every byte that should not have changed.
//
//   ./bidir_port_channel [--transport T] [--max-bytes SIZE] [--iters N] [--put-fence auto|system]
//       one machine: forks two ranks (GPU 0 and 1, or GPU 0 twice with one GPU; two HOST PEs on HOST);
//       T is CudaIpc (default), IB0..IB7, Tcp or Emulated
//   ./bidir_port_channel <ip_port> <rank> <gpu_id> <transport> [--max-bytes SIZE] [--iters N]
//       one rank of a pair that may span two machines; <ip_port> is rank 0's bootstrap address, as ip:port or
//       interface:ip:port
//   --put-fence system: every put's push fences at system scope, as before the channel chose the device scope
//       for a source in its GPU's memory (auto, the default): for comparing the two

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/port_channel.hpp"
#include "mori/channels/proxy.hpp"
#include "two_ranks.hpp"

namespace core = mori::core;

namespace {

struct Options {
  core::Transport transport = core::Transport::CudaIpc;
  uint64_t maxBytes = MORI_BACKEND_HOST ? (uint64_t{1} << 20) : (uint64_t{128} << 20);
  int iters = 0;             // 0: by size
  bool systemFence = false;  // --put-fence system
};

// One thread: each iteration puts this rank's half and signals, then waits for the peer's; a flush at the end
// leaves nothing in flight.
MORI_GLOBAL void BidirPutKernel(core::PortChannelDeviceHandle channel, uint64_t offset, uint64_t bytes, int iters) {
  for (int i = 0; i < iters; ++i) {
    channel.PutWithSignal(offset, bytes);
    channel.Wait();
  }
  channel.Flush();
}

// A byte that depends on the rank that wrote it and on its offset.
uint8_t PatternAt(int rank, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(rank + 1) * 0xC2B2AE3D27D4EB4Full;
  return static_cast<uint8_t>(x >> 56 ^ x >> 23);
}
constexpr uint8_t kGuard = 0xA5;

// The buffer: [0, bytes) rank 0's half, [bytes, 2 bytes) rank 1's half (each rank's pattern, put into the
// peer's buffer at the same place), the rest guard bytes. Before the run the peer's half is guard bytes too.
std::vector<uint8_t> Expected(uint64_t bufferBytes, uint64_t bytes, int rank, bool afterRun) {
  std::vector<uint8_t> v(bufferBytes, kGuard);
  for (int half = 0; half < 2; ++half) {
    if (half != rank && !afterRun) continue;
    for (uint64_t i = 0; i < bytes; ++i) v[half * bytes + i] = PatternAt(half, half * bytes + i);
  }
  return v;
}

int ItersFor(uint64_t bytes, const Options& o) {
  if (o.iters > 0) return o.iters;
  if (MORI_BACKEND_HOST) return bytes >= (uint64_t{1} << 20) ? 5 : 20;
  return bytes >= (uint64_t{64} << 20) ? 20 : 200;
}

// One rank's whole run; true when every size verified on both ranks.
bool RunRank(int rank, const std::string& root, int gpu, const Options& o, bool sameMachine) {
  const int peer = 1 - rank;
  MORI_CHECK_GPU(core::GpuSetDevice(gpu));
  auto bootstrap = std::make_shared<core::SocketBootstrap>(rank, 2);
  bootstrap->Initialize(root);
  core::Communicator comm(bootstrap);

  const uint64_t bufferBytes = 2 * o.maxBytes + 64;  // guard bytes past the last size's halves
  core::GpuBuffer buffer(bufferBytes, core::MemoryType::Device);
  core::RegisteredMemory local = comm.RegisterMemory(buffer.Data(), bufferBytes, o.transport);
  comm.SendMemory(local, peer);
  auto remoteFuture = comm.RecvMemory(peer);
  core::EndpointConfig config;
  config.transport = o.transport;
  config.device = gpu;
  if (sameMachine) config.tcp.ifnames = "lo";
  std::shared_ptr<core::Connection> connection = comm.Connect(config, peer).get();
  auto semaphoreFuture = comm.BuildSemaphore(connection, peer);
  core::RegisteredMemory remote = remoteFuture.get();
  std::shared_ptr<core::Semaphore> semaphore = semaphoreFuture.get();

  core::ProxyService proxy(core::kDefaultFifoSize, gpu);
  core::SemaphoreId sem = proxy.AddSemaphore(semaphore);
  core::MemoryId remoteId = proxy.AddMemory(remote);
  core::MemoryId localId = proxy.AddMemory(local);
  core::PortChannel portChannel = proxy.PortChannel(sem, remoteId, localId);
  if (o.systemFence) {
    portChannel =
        core::PortChannel(sem, semaphore, proxy.FifoHandle(), remoteId, localId, core::FifoOrder::AfterWrites);
  }
  core::PortChannelDeviceHandle channel = portChannel.DeviceHandle();
  core::PreloadKernels(BidirPutKernel);
  proxy.StartProxy();
  // HIP and HOST fence every push at system scope.
  const bool deviceFence =
      MORI_BACKEND_CUDA && channel.OrderOf(core::kTriggerData, 1) == core::FifoOrder::AfterDeviceWrites;
  std::printf("GPU %d: Preparing for tests ... (rank %d, %s, puts fence at %s scope)\n", gpu, rank,
              core::TransportName(o.transport), deviceFence ? "device" : "system");
  std::fflush(stdout);

  bool ok = true;
  for (uint64_t bytes : mori_example::Sizes(o.maxBytes)) {
    if (!ok) break;
    std::vector<uint8_t> start = Expected(bufferBytes, bytes, rank, false);
    MORI_CHECK_GPU(core::GpuMemcpy(buffer.Data(), start.data(), bufferBytes));
    bootstrap->Barrier();  // the peer's buffer is prepared before anything lands in it

    const uint64_t offset = static_cast<uint64_t>(rank) * bytes;
    core::LaunchKernel(BidirPutKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, channel, offset, bytes, 1);
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
    bootstrap->Barrier();
    const int iters = ItersFor(bytes, o);
    auto t0 = std::chrono::steady_clock::now();
    core::LaunchKernel(BidirPutKernel, core::Dim3(1), core::Dim3(1), 0, nullptr, channel, offset, bytes, iters);
    MORI_CHECK_GPU(core::GpuGetLastError());
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
    bootstrap->Barrier();  // both sides' puts are complete (each waited for the other's last signal)

    std::vector<uint8_t> got(bufferBytes);
    MORI_CHECK_GPU(core::GpuMemcpy(got.data(), buffer.Data(), bufferBytes));
    std::vector<uint8_t> want = Expected(bufferBytes, bytes, rank, true);
    for (uint64_t i = 0; i < bufferBytes; ++i) {
      if (got[i] != want[i]) {
        std::fprintf(stderr, "GPU %d (rank %d): bytes %llu: offset %llu holds 0x%02x, expected 0x%02x\n", gpu, rank,
                     static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(i), got[i], want[i]);
        ok = false;
        break;
      }
    }
    if (rank == 0) {
      std::printf("GPU %d: [Bidir PutWithSignal] bytes %llu, elapsed %g ms/iter, BW %g GB/s\n", gpu,
                  static_cast<unsigned long long>(bytes), ms, static_cast<double>(bytes) / (ms * 1e6));
      std::fflush(stdout);
    }
    // Both go on only if both verified.
    std::vector<int> oks = bootstrap->AllGatherValue(ok ? 1 : 0);
    ok = oks[0] == 1 && oks[1] == 1;
  }
  proxy.StopProxy();
  bootstrap->Barrier();  // neither side unmaps memory the other's proxy may still be writing
  return ok;
}

[[noreturn]] void Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--transport CudaIpc|IB0..IB7|Tcp|Emulated] [--max-bytes SIZE] [--iters N] "
               "[--put-fence auto|system]\n"
               "       %s <ip_port> <rank> <gpu_id> <transport> [--max-bytes SIZE] [--iters N] "
               "[--put-fence auto|system]\n"
               "  ip_port: ip:port or interface:ip:port of rank 0's bootstrap; SIZE takes k, m, g suffixes\n",
               argv0, argv0);
  std::exit(2);
}

core::Transport TransportArg(const std::string& text, const char* argv0) {
  std::optional<core::Transport> t = core::ParseTransport(text);
  if (!t) {
    std::fprintf(stderr, "unknown transport '%s'\n", text.c_str());
    Usage(argv0);
  }
  return *t;
}

// Flags from argv[first] on.
void ParseFlags(int argc, char** argv, int first, Options* o, bool transportAllowed) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) Usage(argv[0]);
    std::string v = argv[++i];
    if (a == "--transport" && transportAllowed) {
      o->transport = TransportArg(v, argv[0]);
    } else if (a == "--max-bytes") {
      o->maxBytes = core::ParseSize(v, "--max-bytes");
      if (o->maxBytes < 1024) {
        std::fprintf(stderr, "--max-bytes must be at least 1k\n");
        Usage(argv[0]);
      }
    } else if (a == "--iters") {
      o->iters = std::atoi(v.c_str());
      if (o->iters <= 0) Usage(argv[0]);
    } else if (a == "--put-fence" && (v == "auto" || v == "system")) {
      o->systemFence = v == "system";
    } else {
      Usage(argv[0]);
    }
  }
}

// Forks the two ranks and waits for them, bounded (each wait inside a rank is bounded by MORI_TIMEOUT_S).
int RunForked(const Options& o) {
  const std::string root = "127.0.0.1:" + std::to_string(mori_example::FreeLoopbackPort());
  return mori_example::RunTwoRanksForked(
      [&](int rank) {
        int gpus = 0;
        MORI_CHECK_GPU(core::GpuGetDeviceCount(&gpus));
        return RunRank(rank, root, rank % gpus, o, true) ? 0 : 1;
      },
      static_cast<int>(core::TimeoutSeconds()) * 3);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    if (argc == 1 || std::strncmp(argv[1], "--", 2) == 0) {
      ParseFlags(argc, argv, 1, &o, true);
      int code = RunForked(o);
      if (code == 0) std::printf("Succeed!\n");
      return code;
    }
    if (argc < 5) Usage(argv[0]);
    int rank = std::atoi(argv[2]);
    int gpu = std::atoi(argv[3]);
    if (rank < 0 || rank > 1 || gpu < 0) Usage(argv[0]);
    o.transport = TransportArg(argv[4], argv[0]);
    ParseFlags(argc, argv, 5, &o, false);
    bool ok = RunRank(rank, argv[1], gpu, o, false);
    if (ok && rank == 0) std::printf("Succeed!\n");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bidir_port_channel: %s\n", e.what());
    return 1;
  }
}
