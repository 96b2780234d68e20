// perf_memory_channel: two ranks on one host put into each other's GPU memory through memory channels (the
// threads of each block copy straight across, then signal and wait on the block's own channel), for 1 KiB,
// 1 MiB and 128 MiB, timing each and verifying every byte that arrived and every byte that should not change.
//
//   ./perf_memory_channel [--max-bytes SIZE] [--iters N] [--blocks N]
//       forks two ranks (GPU 0 and 1, or GPU 0 twice with one GPU; two HOST PEs on HOST, where the sizes stop
//       at --max-bytes, 1 MiB by default)
//   ./perf_memory_channel <ip_port> <rank> <gpu_id> [--max-bytes SIZE] [--iters N] [--blocks N]
//       one rank of the pair, started by hand; <ip_port> (ip:port or interface:ip:port) is rank 0's bootstrap
//       address. Both ranks must share a host: memory channels map the peer's memory (CudaIpc).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/channels/memory_channel.hpp"
#include "two_ranks.hpp"

namespace core = mori::core;

namespace {

// HOST "GPU threads" are OS threads on a few cores: a handful of them is all that helps there.
constexpr unsigned kMaxBlocks = MORI_BACKEND_HOST ? 4 : 128;
constexpr unsigned kSmallBytes = 64 << 10;  // up to this, one block: latency, not bandwidth

struct Options {
  uint64_t maxBytes = MORI_BACKEND_HOST ? (uint64_t{1} << 20) : (uint64_t{128} << 20);
  int iters = 0;        // 0: by size
  unsigned blocks = 0;  // 0: by size
};

// Block b copies its 16-byte-aligned share of [offset, + bytes) into the peer, then signals the peer's block b
// and waits for it: one iteration is a put each way and a handshake per block.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(1024)
    BidirPutKernel(const core::MemoryChannelDeviceHandle* channels, uint64_t offset, uint64_t bytes, int iters) {
  core::MemoryChannelDeviceHandle ch = channels[core::BlockIdxX()];
  const uint64_t share = (bytes + core::GridDimX() - 1) / core::GridDimX();
  const uint64_t per = (share + 15) / 16 * 16;
  const uint64_t first = per * core::BlockIdxX();
  const uint64_t begin = first < bytes ? first : bytes;
  const uint64_t end = bytes - begin < per ? bytes : begin + per;
  const unsigned t = core::ThreadIdxX();
  for (int i = 0; i < iters; ++i) {
    ch.Put(offset + begin, end - begin, t, core::BlockDimX());
    core::SyncThreads();  // the block's stores precede its signal
    if (t == 0) {
      ch.Signal();
      ch.Wait();
    }
    core::SyncThreads();
  }
}

// Bytes of an 8-byte word that depends on the owner (0, 1; 2 and 3 mark guard bytes) and the word's place.
uint64_t PatternWord(int owner, uint64_t word) {
  uint64_t x = (word + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(owner + 1) * 0xC2B2AE3D27D4EB4Full;
  x ^= x >> 29;
  return x * 0xBF58476D1CE4E5B9ull;
}

void FillRange(std::vector<uint8_t>& v, uint64_t begin, uint64_t end, int owner) {
  for (uint64_t w = begin / 8; w * 8 < end; ++w) {
    const uint64_t x = PatternWord(owner, w);
    for (uint64_t k = 0; k < 8; ++k) {
      const uint64_t i = w * 8 + k;
      if (i >= begin && i < end) v[i] = static_cast<uint8_t>(x >> (8 * k));
    }
  }
}

// The buffer at a size: rank r's data at [r * bytes, (r + 1) * bytes) (put at the same place in the peer),
// guard bytes elsewhere; before the run the peer's half is guard bytes too.
std::vector<uint8_t> Expected(uint64_t bufferBytes, uint64_t bytes, int rank, bool afterRun) {
  std::vector<uint8_t> v(bufferBytes);
  FillRange(v, 0, bufferBytes, 2 + rank);
  for (int half = 0; half < 2; ++half) {
    if (half == rank || afterRun) FillRange(v, half * bytes, (half + 1) * bytes, half);
  }
  return v;
}

int ItersFor(uint64_t bytes, const Options& o) {
  if (o.iters > 0) return o.iters;
  if (MORI_BACKEND_HOST) return bytes >= (uint64_t{1} << 20) ? 10 : 100;
  return bytes >= (uint64_t{64} << 20) ? 50 : 1000;
}

unsigned BlocksFor(uint64_t bytes, const Options& o) {
  if (o.blocks > 0) return o.blocks;
  if (bytes <= kSmallBytes) return 1;
  return static_cast<unsigned>(std::min<uint64_t>(kMaxBlocks, bytes / kSmallBytes));
}

unsigned ThreadsFor(uint64_t bytes) {
  if (MORI_BACKEND_HOST) return bytes <= kSmallBytes ? 1 : 2;
  return bytes <= kSmallBytes ? 256 : 1024;
}

// One rank's whole run; true when every size verified on both ranks.
bool RunRank(int rank, const std::string& root, int gpu, const Options& o) {
  const int peer = 1 - rank;
  MORI_CHECK_GPU(core::GpuSetDevice(gpu));
  auto bootstrap = std::make_shared<core::SocketBootstrap>(rank, 2);
  bootstrap->Initialize(root);
  core::Communicator comm(bootstrap);
  MORI_CHECK(comm.SameHost(peer), core::ErrorCode::InvalidUsage,
             "rank %d: rank %d runs on another host; memory channels need both ranks on one host (CudaIpc)", rank,
             peer);

  const uint64_t bufferBytes = 2 * o.maxBytes + 64;  // guard bytes past the largest size's halves
  core::GpuBuffer buffer(bufferBytes, core::MemoryType::Device);
  core::RegisteredMemory local = comm.RegisterMemory(buffer.Data(), bufferBytes, core::Transport::CudaIpc);
  comm.SendMemory(local, peer);
  core::RegisteredMemory remote = comm.RecvMemory(peer).get();
  core::EndpointConfig config;
  config.transport = core::Transport::CudaIpc;
  config.device = gpu;
  std::shared_ptr<core::Connection> connection = comm.Connect(config, peer).get();

  // A channel (its own semaphore) per block, so that blocks hand off to their peers independently.
  const unsigned numChannels = std::max(kMaxBlocks, o.blocks);
  std::vector<core::MemoryChannel> channels;
  std::vector<core::MemoryChannelDeviceHandle> handles;
  for (unsigned i = 0; i < numChannels; ++i) {
    channels.emplace_back(comm.BuildSemaphore(connection, peer, static_cast<int>(i)).get(), remote, local);
    handles.push_back(channels.back().DeviceHandle());
  }
  core::GpuBuffer handleBuffer(handles.size() * sizeof(handles[0]), core::MemoryType::Device);
  MORI_CHECK_GPU(core::GpuMemcpy(handleBuffer.Data(), handles.data(), handleBuffer.Bytes()));
  const auto* deviceHandles = handleBuffer.DataAs<core::MemoryChannelDeviceHandle>();

  core::GpuStream stream;
  MORI_CHECK_GPU(core::GpuStreamCreate(&stream));
  core::GpuEvent start, stop;
  MORI_CHECK_GPU(core::GpuEventCreate(&start));
  MORI_CHECK_GPU(core::GpuEventCreate(&stop));
  core::PreloadKernels(BidirPutKernel);
  std::printf("GPU %d: Preparing for memory channel tests ... (rank %d, %u channels)\n", gpu, rank, numChannels);
  std::fflush(stdout);

  bool ok = true;
  for (uint64_t bytes : mori_example::Sizes(o.maxBytes)) {
    if (!ok) break;
    const std::vector<uint8_t> before = Expected(bufferBytes, bytes, rank, false);
    MORI_CHECK_GPU(core::GpuMemcpy(buffer.Data(), before.data(), bufferBytes));
    bootstrap->Barrier();  // the peer's buffer is prepared before anything lands in it

    const uint64_t offset = static_cast<uint64_t>(rank) * bytes;
    const unsigned blocks = BlocksFor(bytes, o), threads = ThreadsFor(bytes);
    MORI_CHECK(blocks <= numChannels, core::ErrorCode::InvalidUsage, "%u blocks but %u channels", blocks, numChannels);
    core::LaunchKernel(BidirPutKernel, core::Dim3(blocks), core::Dim3(threads), 0, stream, deviceHandles, offset, bytes,
                       1);  // warm-up
    MORI_CHECK_GPU(core::GpuStreamSynchronize(stream));
    bootstrap->Barrier();
    const int iters = ItersFor(bytes, o);
    MORI_CHECK_GPU(core::GpuEventRecord(start, stream));
    core::LaunchKernel(BidirPutKernel, core::Dim3(blocks), core::Dim3(threads), 0, stream, deviceHandles, offset, bytes,
                       iters);
    MORI_CHECK_GPU(core::GpuGetLastError());
    MORI_CHECK_GPU(core::GpuEventRecord(stop, stream));
    MORI_CHECK_GPU(core::GpuStreamSynchronize(stream));
    float totalMs = 0;
    MORI_CHECK_GPU(core::GpuEventElapsedTime(&totalMs, start, stop));
    const double ms = static_cast<double>(totalMs) / iters;
    bootstrap->Barrier();  // both sides' puts are complete (each block waited for its peer's last signal)

    std::vector<uint8_t> got(bufferBytes);
    MORI_CHECK_GPU(core::GpuMemcpy(got.data(), buffer.Data(), bufferBytes));
    const std::vector<uint8_t> want = Expected(bufferBytes, bytes, rank, true);
    if (std::memcmp(got.data(), want.data(), bufferBytes) != 0) {
      uint64_t i = 0;
      while (got[i] == want[i]) ++i;
      std::fprintf(stderr, "GPU %d (rank %d): bytes %llu: offset %llu holds 0x%02x, expected 0x%02x\n", gpu, rank,
                   static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(i), got[i], want[i]);
      ok = false;
    }
    if (rank == 0) {
      std::printf("GPU %d: [MemoryChannel Put] bytes %llu, elapsed %g ms/iter, BW %g GB/s (%u x %u threads)\n", gpu,
                  static_cast<unsigned long long>(bytes), ms, static_cast<double>(bytes) / (ms * 1e6), blocks, threads);
      std::fflush(stdout);
    }
    const std::vector<int> oks = bootstrap->AllGatherValue(ok ? 1 : 0);
    ok = oks[0] == 1 && oks[1] == 1;
  }
  MORI_CHECK_GPU(core::GpuEventDestroy(start));
  MORI_CHECK_GPU(core::GpuEventDestroy(stop));
  MORI_CHECK_GPU(core::GpuStreamDestroy(stream));
  bootstrap->Barrier();  // neither side unmaps memory the other's kernels may still write
  return ok;
}

[[noreturn]] void Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--max-bytes SIZE] [--iters N] [--blocks N]\n"
               "       %s <ip_port> <rank> <gpu_id> [--max-bytes SIZE] [--iters N] [--blocks N]\n"
               "  ip_port: ip:port or interface:ip:port of rank 0's bootstrap (same host); SIZE takes k, m, g\n",
               argv0, argv0);
  std::exit(2);
}

void ParseFlags(int argc, char** argv, int first, Options* o) {
  for (int i = first; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage(argv[0]);
    const std::string value = argv[++i];
    if (flag == "--max-bytes") {
      o->maxBytes = core::ParseSize(value, "--max-bytes");
      if (o->maxBytes < 1024) {
        std::fprintf(stderr, "--max-bytes must be at least 1k\n");
        Usage(argv[0]);
      }
    } else if (flag == "--iters") {
      o->iters = std::atoi(value.c_str());
      if (o->iters <= 0) Usage(argv[0]);
    } else if (flag == "--blocks") {
      const int blocks = std::atoi(value.c_str());
      if (blocks <= 0 || blocks > 1024) Usage(argv[0]);
      o->blocks = static_cast<unsigned>(blocks);
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
        MORI_CHECK(gpus > 0, core::ErrorCode::InvalidUsage, "no GPU visible");
        return RunRank(rank, root, rank % gpus, o) ? 0 : 1;
      },
      static_cast<int>(core::TimeoutSeconds()) * 3);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    if (argc == 1 || std::strncmp(argv[1], "--", 2) == 0) {
      ParseFlags(argc, argv, 1, &o);
      const int code = RunForked(o);
      if (code == 0) std::printf("Succeed!\n");
      return code;
    }
    if (argc < 4) Usage(argv[0]);
    const int rank = std::atoi(argv[2]);
    const int gpu = std::atoi(argv[3]);
    if (rank < 0 || rank > 1 || gpu < 0) Usage(argv[0]);
    ParseFlags(argc, argv, 4, &o);
    const bool ok = RunRank(rank, argv[1], gpu, o);
    if (ok && rank == 0) std::printf("Succeed!\n");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "perf_memory_channel: %s\n", e.what());
    return 1;
  }
}
