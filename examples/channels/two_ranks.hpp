// What the channel examples share: their default run forks the two ranks on this machine (the GPU runtime
// starts in the children only: a GPU context does not survive fork) and waits for both, bounded; and the
// message sizes they measure.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "mori/core/errors.hpp"

namespace mori_example {

// 1 KiB, 1 MiB and `maxBytes`, those not above it.
inline std::vector<uint64_t> Sizes(uint64_t maxBytes) {
  std::vector<uint64_t> sizes;
  for (uint64_t s : {uint64_t{1} << 10, uint64_t{1} << 20, maxBytes}) {
    if (s <= maxBytes && (sizes.empty() || s > sizes.back())) sizes.push_back(s);
  }
  return sizes;
}

// A loopback port free now (bound, read back, released for rank 0's bootstrap to take).
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  MORI_CHECK_SYS(fd);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                     getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  MORI_CHECK(bound, mori::core::ErrorCode::System, "no free loopback port for the bootstrap");
  return ntohs(addr.sin_port);
}

// Forks ranks 0 and 1; each runs `rank(r)` and exits with what it returns (an exception is printed and exits
// 1). Waits for both, killing what is left after `limitS` seconds. Returns 0 when both exited 0.
inline int RunTwoRanksForked(const std::function<int(int rank)>& rank, int limitS) {
  pid_t pids[2] = {-1, -1};
  for (int r = 0; r < 2; ++r) {
    const pid_t pid = fork();
    MORI_CHECK_SYS(pid);
    if (pid == 0) {
      int code = 1;
      try {
        code = rank(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[r] = pid;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(limitS);
  int failed = 0;
  for (int r = 0; r < 2; ++r) {
    int status = 0;
    while (waitpid(pids[r], &status, WNOHANG) != pids[r]) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "rank %d did not finish within %d s; stopping it\n", r, limitS);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "rank %d failed (%s %d)\n", r, WIFEXITED(status) ? "exit code" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace mori_example
