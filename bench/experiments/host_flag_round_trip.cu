// The floor under every proxy round trip: a kernel thread stores a value in a host-pinned word, a host thread
// answers it in another, the kernel sees the answer. Measured by where the two words live (the NUMA node of
// their pages), where the host thread runs, how it stores the answer, and how many warps of the kernel poll the
// answer at once (one thread's loads of host memory are served one after another, docs/PERF.md 2026-11-29
// night; whether loads of several warps overlap is what the warps column asks). Not part of the build:
//   nvcc -O3 -arch=sm_90 -o host_flag_round_trip bench/experiments/host_flag_round_trip.cu -lpthread
//   ./host_flag_round_trip [iterations]
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "check.cuh"

namespace {

constexpr int kMaxWarps = 8;

__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t LoadRelaxedSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Warp 0's lane 0 stores i + 1 in ping and waits for pong == i + 1; lane 0 of every warp polls pong, warp w
// starting its polls w / warps of a load's time after warp 0 (stagger cycles each), and the first to see the
// answer tells the others through shared memory. times[i]: ping store to answer seen, ns.
__global__ void RoundTrip(uint64_t* ping, const uint64_t* pong, int warmup, int iters, int warps, long long stagger,
                          uint64_t* times, int* timedOut) {
  __shared__ volatile uint64_t posted;  // the value warp 0 stored last
  __shared__ volatile uint64_t seen;    // the highest answer any warp saw
  const int warp = threadIdx.x / 32;
  const bool lane0 = threadIdx.x % 32 == 0;
  if (threadIdx.x == 0) {
    posted = 0;
    seen = 0;
  }
  __syncthreads();
  if (!lane0 || warp >= warps) return;
  for (int i = 0; i < warmup + iters; ++i) {
    const uint64_t v = static_cast<uint64_t>(i) + 1;
    uint64_t start = 0;
    if (warp == 0) {
      start = Now();
      StoreRelaxedSys(ping, v);
      posted = v;
    } else {
      while (posted < v) {
      }
      const long long until = clock64() + stagger * warp;
      while (clock64() < until) {
      }
    }
    const uint64_t deadline = Now() + 2000000000ull;
    for (;;) {
      if (seen >= v) break;
      if (LoadRelaxedSys(pong) >= v) {
        seen = v;
        break;
      }
      if (Now() > deadline) {
        *timedOut = 1;
        return;
      }
    }
    if (warp == 0 && i >= warmup) times[i - warmup] = Now() - start;
  }
}

enum class Answer { Plain, NonTemporal, Flush };
const char* AnswerName(Answer a) {
  return a == Answer::Plain ? "store" : a == Answer::NonTemporal ? "movnti+sfence" : "store+clflush";
}

void Echo(volatile uint64_t* ping, uint64_t* pong, uint64_t last, Answer how, std::atomic<bool>* stop) {
  uint64_t seen = 0;
  while (seen < last && !stop->load(std::memory_order_relaxed)) {
    uint64_t v = *ping;
    if (v == seen) continue;
    seen = v;
    if (how == Answer::NonTemporal) {
      __builtin_ia32_movnti64(reinterpret_cast<long long*>(pong), static_cast<long long>(v));
      __builtin_ia32_sfence();
    } else {
      std::atomic_ref<uint64_t>(*pong).store(v, std::memory_order_release);
      if (how == Answer::Flush) __builtin_ia32_clflush(pong);
    }
  }
}

std::string ReadLine(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::vector<int> ParseCpuList(const std::string& text) {
  std::vector<int> cpus;
  size_t i = 0;
  while (i < text.size()) {
    size_t end = text.find(',', i);
    if (end == std::string::npos) end = text.size();
    std::string part = text.substr(i, end - i);
    size_t dash = part.find('-');
    int a = std::stoi(part), b = dash == std::string::npos ? a : std::stoi(part.substr(dash + 1));
    for (int c = a; c <= b; ++c) cpus.push_back(c);
    i = end + 1;
  }
  return cpus;
}

// Two words 128 bytes apart, on pages of `node` (-1: cudaHostAlloc's choice), registered with the GPU.
struct Flags {
  uint64_t* ping = nullptr;
  uint64_t* pong = nullptr;
  void* base = nullptr;
  bool hostAlloc = false;
  Flags(int node) {
    if (node < 0) {
      CHECK(cudaHostAlloc(&base, 4096, cudaHostAllocMapped));
      hostAlloc = true;
    } else {
      base = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      unsigned long mask[16] = {};
      mask[node / 64] = 1ul << (node % 64);
      if (syscall(SYS_mbind, base, 4096, 2 /* MPOL_BIND */, mask, 1024, 0) != 0) std::perror("mbind");
      std::memset(base, 0, 4096);
      CHECK(cudaHostRegister(base, 4096, cudaHostRegisterMapped));
    }
    std::memset(base, 0, 4096);
    ping = static_cast<uint64_t*>(base);
    pong = ping + 16;
  }
  ~Flags() {
    if (hostAlloc) {
      cudaFreeHost(base);
    } else {
      cudaHostUnregister(base);
      munmap(base, 4096);
    }
  }
  // The node the page really landed on (move_pages with no target: query).
  int Node() const {
    void* page = base;
    int status = -1;
    if (syscall(SYS_move_pages, 0, 1, &page, nullptr, &status, 0) != 0) return -2;
    return status;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 5000;
  const int warmup = 200;
  char bus[32] = {};
  CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), 0));
  std::string b = bus;
  for (char& c : b) c = static_cast<char>(std::tolower(c));
  if (b.size() > 12) b = b.substr(b.size() - 12);
  const std::string gpuNode = ReadLine("/sys/bus/pci/devices/" + b + "/numa_node");
  const std::string gpuCpus = ReadLine("/sys/bus/pci/devices/" + b + "/local_cpulist");
  std::vector<std::vector<int>> nodeCpus;
  for (int n = 0; n < 8; ++n) {
    std::string l = ReadLine("/sys/devices/system/node/node" + std::to_string(n) + "/cpulist");
    if (l.empty()) break;
    nodeCpus.push_back(ParseCpuList(l));
  }
  cpu_set_t allowed;
  sched_getaffinity(0, sizeof(allowed), &allowed);
  std::printf("GPU %s: NUMA node %s, local CPUs %s; %zu NUMA nodes; this process may use %d CPUs\n", bus,
              gpuNode.c_str(), gpuCpus.c_str(), nodeCpus.size(), CPU_COUNT(&allowed));
  for (size_t n = 0; n < nodeCpus.size(); ++n) {
    int usable = 0;
    for (int c : nodeCpus[n]) usable += CPU_ISSET(c, &allowed) ? 1 : 0;
    std::printf("  node %zu: %zu CPUs, %d of them usable\n", n, nodeCpus[n].size(), usable);
  }

  uint64_t* times = nullptr;
  int* timedOut = nullptr;
  CHECK(cudaMalloc(&times, sizeof(uint64_t) * iters));
  CHECK(cudaMallocManaged(&timedOut, sizeof(int)));
  // The host thread's CPU set: each node's usable CPUs, or anywhere (-1).
  std::vector<int> cpuChoices = {-1};
  for (size_t n = 0; n < nodeCpus.size(); ++n) cpuChoices.push_back(static_cast<int>(n));
  std::vector<int> memChoices = {-1};
  for (size_t n = 0; n < nodeCpus.size(); ++n) memChoices.push_back(static_cast<int>(n));

  auto run = [&](int mem, int cpu, Answer how, int warps, long long stagger) {
    Flags flags(mem);
    *timedOut = 0;
    std::atomic<bool> stop{false};
    const uint64_t last = static_cast<uint64_t>(warmup) + iters;
    std::thread echo([&] {
      if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c : nodeCpus[cpu]) {
          if (CPU_ISSET(c, &allowed)) CPU_SET(c, &set);
        }
        if (CPU_COUNT(&set) > 0) pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      }
      Echo(flags.ping, flags.pong, last, how, &stop);
    });
    RoundTrip<<<1, 32 * kMaxWarps>>>(flags.ping, flags.pong, warmup, iters, warps, stagger, times, timedOut);
    cudaError_t e = cudaDeviceSynchronize();
    stop.store(true);
    echo.join();
    CHECK(e);
    std::vector<uint64_t> t(iters);
    CHECK(cudaMemcpy(t.data(), times, sizeof(uint64_t) * iters, cudaMemcpyDeviceToHost));
    std::sort(t.begin(), t.end());
    std::printf("  %-12s %-4s %-14s %5d %7lld %8.3f %8.3f %8.3f%s\n",
                mem < 0 ? "hostalloc" : ("node " + std::to_string(mem)).c_str(), cpu < 0 ? "any" : std::to_string(cpu).c_str(),
                AnswerName(how), warps, stagger, t[iters / 2] / 1000.0, t[iters * 99 / 100] / 1000.0, t[0] / 1000.0,
                *timedOut ? "  (timed out)" : "");
    std::printf("     (pages on node %d)\n", flags.Node());
  };

  std::printf("%-14s %-4s %-14s %5s %7s %8s %8s %8s\n", "  flags on", "cpu", "answer", "warps", "stagger",
              "median", "p99", "min us");
  for (int mem : memChoices) {
    for (int cpu : cpuChoices) run(mem, cpu, Answer::Plain, 1, 0);
  }
  const int nearCpu = gpuNode.empty() || gpuNode == "-1" ? -1 : std::min<int>(std::stoi(gpuNode), cpuChoices.size() - 2);
  const int nearMem = nearCpu;
  for (Answer how : {Answer::NonTemporal, Answer::Flush}) run(nearMem, nearCpu, how, 1, 0);
  for (int warps : {2, 4, 8}) {
    for (long long stagger : {0ll, 2400ll / warps}) run(nearMem, nearCpu, Answer::Plain, warps, stagger);
  }
  return 0;
}
