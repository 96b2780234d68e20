// multi_channel_tcp: one Tcp connection of N channels (sockets) moves a buffer between two processes, chunks
// dealt round-robin over the channels; the receiver checks every byte and the sender prints the rate.
//
//   ./multi_channel_tcp [channels] [--bytes 64m] [--bench]     two processes forked on this machine (loopback)
//   ./multi_channel_tcp --netns [channels] [--bytes 64m]       the two in network namespaces joined by two veth
//                                                               pairs, channels bound to them round-robin (root;
//                                                               exits 77 when namespaces cannot be made here)
//   ./multi_channel_tcp <ip:port> <rank> [channels] [--bytes 64m] [--bench]   one rank of two, across hosts
// --bench: GB/s for 1, 2 and 4 channels. MORI_SOCKET_IFNAME names the interfaces to bind (round-robin).
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/channels/connection.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "two_ranks.hpp"

namespace mc = mori::core;

namespace {

constexpr int kSkip = 77;

struct Options {
  int channels = 4;
  size_t bytes = size_t(64) << 20;
  bool bench = false;
  bool netns = false;
  std::string root;  // ip:port: one rank of two, launched by hand
  int rank = -1;
  std::string ifnames;  // netns mode: this side's interfaces
};

uint8_t PatternByte(size_t i, uint32_t round) {
  return static_cast<uint8_t>((i * 7 + (i >> 10) * 13 + round * 101) & 0xff);
}

std::vector<uint8_t> Pattern(size_t bytes, uint32_t round) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = PatternByte(i, round);
  return v;
}

// One transfer of `bytes` from rank 0 to rank 1 over `channels` channels, `rounds` times after one warm-up;
// rank 1 checks the last round's bytes. Returns rank 0's GB/s (0 on rank 1).
double Transfer(mc::Communicator& comm, const Options& o, int channels, int rounds, int tag) {
  const int rank = comm.Rank();
  const int peer = 1 - rank;
  auto& bootstrap = *comm.GetBootstrap();
  mc::GpuBuffer buffer(o.bytes, mc::MemoryType::Device);
  std::vector<uint8_t> host = Pattern(o.bytes, rank == 0 ? static_cast<uint32_t>(tag) : 0xffu);
  MORI_CHECK_GPU(mc::GpuMemcpy(buffer.Data(), host.data(), o.bytes));
  mc::RegisteredMemory mine = comm.RegisterMemory(buffer.Data(), o.bytes, mc::Transport::Tcp);
  comm.SendMemory(mine, peer, tag);
  mc::RegisteredMemory theirs = comm.RecvMemory(peer, tag).get();

  mc::EndpointConfig config;
  config.transport = mc::Transport::Tcp;
  config.tcp.numChannels = channels;
  config.tcp.ifnames = o.ifnames;
  std::shared_ptr<mc::Connection> conn = comm.Connect(config, peer, tag).get();

  double seconds = 0;
  for (int r = 0; r <= rounds; ++r) {
    bootstrap.Barrier();
    if (rank == 0) {
      auto start = std::chrono::steady_clock::now();
      conn->Write(theirs, 0, mine, 0, o.bytes);
      conn->Flush();
      if (r > 0) seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  bootstrap.Barrier();  // rank 0's last Flush returned: every byte is written
  if (rank == 1) {
    MORI_CHECK_GPU(mc::GpuMemcpy(host.data(), buffer.Data(), o.bytes));
    for (size_t i = 0; i < o.bytes; ++i) {
      MORI_CHECK(host[i] == PatternByte(i, static_cast<uint32_t>(tag)), mc::ErrorCode::Internal,
                 "rank 1: byte %zu of %zu is %u, expected %u (%d channels)", i, o.bytes, host[i],
                 PatternByte(i, static_cast<uint32_t>(tag)), channels);
    }
  }
  bootstrap.Barrier();
  return rank == 0 ? static_cast<double>(o.bytes) * rounds / seconds / 1e9 : 0.0;
}

int RunRank(const Options& o, int rank, const std::string& root) {
  try {
    int gpus = 0;
    MORI_CHECK_GPU(mc::GpuGetDeviceCount(&gpus));
    MORI_CHECK(gpus > 0, mc::ErrorCode::NotSupported, "no GPU visible");
    MORI_CHECK_GPU(mc::GpuSetDevice(rank % gpus));
    auto bootstrap = std::make_shared<mc::SocketBootstrap>(rank, 2);
    bootstrap->Initialize(root, 60);
    mc::Communicator comm(bootstrap);
    const std::vector<int> counts = o.bench ? std::vector<int>{1, 2, 4} : std::vector<int>{o.channels};
    for (int channels : counts) {
      double gbps = Transfer(comm, o, channels, o.bench ? 5 : 1, channels);
      if (rank == 0) {
        std::printf("Tcp %d channel%s: %zu bytes rank 0 -> rank 1, BW %.2f GB/s, verified\n", channels,
                    channels == 1 ? "" : "s", o.bytes, gbps);
        std::fflush(stdout);
      }
    }
    if (rank == 0) std::printf("Succeed!\n");
    std::fflush(stdout);  // a forked rank ends in _exit
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}

// Forks the two ranks (`setup(rank, options)` runs first in each child) and waits for both, bounded.
template <typename F>
int ForkPair(const Options& o, const std::string& root, F&& setup) {
  return mori_example::RunTwoRanksForked(
      [&](int rank) {
        Options mine = o;
        return setup(rank, mine) ? RunRank(mine, rank, root) : 1;
      },
      static_cast<int>(mc::TimeoutSeconds()) + 120);
}

int Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

// Two namespaces joined by two veth pairs (10.<t>.0.0/24 and 10.<t>.1.0/24); each rank binds its channels to
// its two interfaces round-robin.
int RunInNamespaces(const Options& o) {
  if (geteuid() != 0) {
    std::printf("SKIP: network namespaces need root\n");
    return kSkip;
  }
  if (Sh("command -v ip") != 0) {
    std::printf("SKIP: the ip command (iproute2) is not installed\n");
    return kSkip;
  }
  const std::string id = std::to_string(getpid() % 100000);
  const std::string ns[2] = {"mori_xa" + id, "mori_xb" + id};
  const int t = static_cast<int>(getpid() % 200) + 30;
  if (Sh("ip netns add " + ns[0]) != 0) {
    std::printf("SKIP: creating a network namespace is not permitted here\n");
    return kSkip;
  }
  std::string ifs[2];
  bool ok = Sh("ip netns add " + ns[1]) == 0;
  for (int pair = 0; pair < 2 && ok; ++pair) {
    const std::string net = "10." + std::to_string(t) + "." + std::to_string(pair) + ".";
    const std::string v[2] = {"mxa" + std::to_string(pair) + "_" + id, "mxb" + std::to_string(pair) + "_" + id};
    ok = Sh("ip link add " + v[0] + " type veth peer name " + v[1]) == 0;
    for (int side = 0; side < 2 && ok; ++side) {
      ok = Sh("ip link set " + v[side] + " netns " + ns[side]) == 0 &&
           Sh("ip -n " + ns[side] + " addr add " + net + std::to_string(side + 1) + "/24 dev " + v[side]) == 0 &&
           Sh("ip -n " + ns[side] + " link set " + v[side] + " up") == 0 &&
           Sh("ip -n " + ns[side] + " link set lo up") == 0;
      ifs[side] += (pair == 0 ? "" : ",") + v[side];
    }
  }
  int rc = kSkip;
  if (!ok) {
    std::printf("SKIP: could not build veth links between namespaces here\n");
  } else {
    const std::string root = "10." + std::to_string(t) + ".0.1:" + std::to_string(29000 + getpid() % 1000);
    std::printf("namespaces %s (%s) and %s (%s)\n", ns[0].c_str(), ifs[0].c_str(), ns[1].c_str(), ifs[1].c_str());
    std::fflush(stdout);
    rc = ForkPair(o, root, [&](int rank, Options& mine) {
      int fd = open(("/var/run/netns/" + ns[rank]).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
        std::perror("entering the network namespace");
        return false;
      }
      close(fd);
      mine.ifnames = ifs[rank];
      return true;
    });
  }
  Sh("ip netns del " + ns[0]);
  Sh("ip netns del " + ns[1]);
  return rc;
}

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [channels] [--bytes N] [--bench]\n"
               "       %s --netns [channels] [--bytes N]\n"
               "       %s <ip:port> <rank> [channels] [--bytes N] [--bench]\n",
               argv0, argv0, argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--bench") {
        o.bench = true;
      } else if (a == "--netns") {
        o.netns = true;
      } else if (a == "--bytes" && i + 1 < argc) {
        o.bytes = mc::ParseSize(argv[++i], "--bytes");
      } else if (a == "-h" || a == "--help" || a.rfind("--", 0) == 0) {
        return Usage(argv[0]);
      } else {
        positional.push_back(a);
      }
    }
    size_t next = 0;
    if (!positional.empty() && positional[0].find(':') != std::string::npos) {
      if (positional.size() < 2) return Usage(argv[0]);
      o.root = positional[0];
      o.rank = std::atoi(positional[1].c_str());
      next = 2;
    }
    if (next < positional.size()) o.channels = std::atoi(positional[next++].c_str());
    if (next < positional.size() || o.channels < 1 || o.bytes == 0 || (o.rank != -1 && o.rank != 0 && o.rank != 1)) {
      return Usage(argv[0]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return Usage(argv[0]);
  }
  if (!o.root.empty()) return RunRank(o, o.rank, o.root);
  if (o.netns) return RunInNamespaces(o);
  // No GPU call before fork: a GPU context does not survive it.
  try {
    return ForkPair(o, "127.0.0.1:" + std::to_string(mori_example::FreeLoopbackPort()),
                    [](int, Options&) { return true; });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
