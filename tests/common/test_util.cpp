#include "test_util.hpp"

#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include "mori/core/gpu.hpp"

namespace mori::core::test {

void FillPattern(void* data, size_t bytes, int rank, uint32_t seed) {
  auto* p = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) p[i] = PatternByte(rank, i, seed);
}

size_t FirstPatternMismatch(const void* data, size_t bytes, int rank, uint32_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != PatternByte(rank, i, seed)) return i;
  }
  return bytes;
}

std::string ProcessOutcome::Describe() const {
  char buf[128];
  if (timedOut) {
    std::snprintf(buf, sizeof(buf), "rank %d timed out and was killed", rank);
  } else if (signal != 0) {
    std::snprintf(buf, sizeof(buf), "rank %d was killed by signal %d (%s)", rank, signal, strsignal(signal));
  } else {
    std::snprintf(buf, sizeof(buf), "rank %d exited with code %d", rank, exitCode);
  }
  return buf;
}

namespace {

// Whether every thread of this process but the caller is asleep (state S), from /proc/self/task/*/stat.
bool OtherThreadsSleep() {
  const long self = syscall(SYS_gettid);
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return true;  // nothing to learn: fork as before
  bool asleep = true;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || tid == self) continue;
    std::ifstream stat(std::string("/proc/self/task/") + entry->d_name + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');  // the state follows the name, which may hold anything
    if (paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] != 'S') {
      asleep = false;
      break;
    }
  }
  closedir(dir);
  return asleep;
}

}  // namespace

pid_t ForkWhenOtherThreadsSleep() {
  const auto giveUp = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (int quiet = 0; quiet < 2 && std::chrono::steady_clock::now() < giveUp;) {
    quiet = OtherThreadsSleep() ? quiet + 1 : 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::fflush(stdout);
  std::fflush(stderr);
  return fork();
}

std::vector<ProcessOutcome> RunProcesses(int n, const std::function<int(int rank)>& body, double timeoutSeconds) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(static_cast<size_t>(n), -1);
  std::vector<ProcessOutcome> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    out[static_cast<size_t>(r)].rank = r;
    pid_t pid = ForkWhenOtherThreadsSleep();
    if (pid == 0) {
      int code = 1;
      try {
        code = body(r);
        if (::testing::Test::HasFailure()) code = code == 0 ? 1 : code;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] uncaught exception: %s\n", r, e.what());
        code = 3;
      } catch (...) {
        std::fprintf(stderr, "[rank %d] uncaught exception\n", r);
        code = 3;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[static_cast<size_t>(r)] = pid;
  }
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeoutSeconds);
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      pid_t pid = pids[static_cast<size_t>(r)];
      if (pid <= 0) continue;
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        auto& o = out[static_cast<size_t>(r)];
        if (WIFEXITED(status)) o.exitCode = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) o.signal = WTERMSIG(status);
        pids[static_cast<size_t>(r)] = -1;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > end) {
      for (int r = 0; r < n; ++r) {
        pid_t pid = pids[static_cast<size_t>(r)];
        if (pid <= 0) continue;
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        out[static_cast<size_t>(r)].timedOut = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return out;
}

void ExpectAllSucceed(const std::vector<ProcessOutcome>& outcomes) {
  for (const auto& o : outcomes) EXPECT_TRUE(o.Ok()) << o.Describe();
}

void DieAbruptly(int code) {
  syscall(SYS_exit_group, code);
  __builtin_unreachable();
}

__attribute__((no_sanitize("thread"))) uint64_t RacyLoad64(const void* word) {
  return *static_cast<const volatile uint64_t*>(word);
}

namespace {

// Binds a loopback TCP socket to `port` (0: any) and returns the port it got, or -1.
int BindLoopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int got = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) got = ntohs(addr.sin_port);
  }
  close(fd);
  return got;
}

}  // namespace

// A free port below the kernel's ephemeral range when there is room: a port from that range can be taken by
// any process's outgoing connection between this check and the root's listen (seen with the 4- and 8-PE
// suites running at once: "Address already in use"), one below it only by another listener.
int FreeTcpPort() {
  int ephemeralLow = 32768;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> ephemeralLow;
  if (ephemeralLow > 12000) {
    std::mt19937 pick(static_cast<uint32_t>(getpid()) * 2654435761u ^
                      static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::uniform_int_distribution<int> port(10000, ephemeralLow - 1);
    for (int tries = 0; tries < 200; ++tries) {
      int got = BindLoopback(port(pick));
      if (got > 0) return got;
    }
  }
  return BindLoopback(0);
}

std::string LoopbackRoot() { return "127.0.0.1:" + std::to_string(FreeTcpPort()); }

std::vector<int> ListeningFds() {
  std::vector<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    if (fd == dirfd(dir)) continue;
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening != 0) fds.push_back(fd);
  }
  closedir(dir);
  return fds;
}

std::vector<std::pair<pid_t, std::string>> Threads() {
  std::vector<std::pair<pid_t, std::string>> threads;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return threads;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    if (std::getline(comm, name)) threads.emplace_back(static_cast<pid_t>(std::atoi(e->d_name)), name);
  }
  closedir(dir);
  return threads;
}

std::vector<std::string> ThreadNames() {
  std::vector<std::string> names;
  for (auto& [tid, name] : Threads()) names.push_back(name);
  return names;
}

int ProbeGpuCount() {
  auto outcome = RunProcesses(
      1,
      [](int) {
        int n = 0;
        if (GpuGetDeviceCount(&n) != kGpuSuccess) n = 0;
        return n;
      },
      60);
  return outcome[0].signal == 0 && !outcome[0].timedOut ? outcome[0].exitCode : 0;
}

ScopedEnv::ScopedEnv(const char* name, const char* value) : name_(name) {
  const char* old = std::getenv(name);
  had_ = old != nullptr;
  if (had_) old_ = old;
  if (value != nullptr) {
    setenv(name, value, 1);
  } else {
    unsetenv(name);
  }
}

ScopedEnv::~ScopedEnv() {
  if (had_) {
    setenv(name_.c_str(), old_.c_str(), 1);
  } else {
    unsetenv(name_.c_str());
  }
}

}  // namespace mori::core::test
