// What the fuzz targets that run real sockets and threads share: counting a process's descriptors and threads
// (nothing may be left over from one input), and ending a TCP connection without leaving it in TIME_WAIT.
#pragma once

#include <dirent.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <thread>

#include "fuzz_util.hpp"
#include "mori/core/unique_fd.hpp"

namespace mori::fuzz {

// Entries of a /proc directory (/proc/self/fd, /proc/self/task), "." and ".." included.
inline size_t CountEntries(const char* dir) {
  DIR* d = opendir(dir);
  MORI_FUZZ_ASSERT(d != nullptr, "opendir %s", dir);
  size_t n = 0;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

// Whether `dir` comes back to `expected` entries within `seconds`: a thread is gone from /proc a moment after its
// join returns, and a loaded machine (the CI runs the targets beside other jobs) can stretch that moment.
inline bool SettlesAt(const char* dir, size_t expected, double seconds = 5.0) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    if (CountEntries(dir) == expected) return true;
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Closes with a reset. The side that sends the first FIN and then hears the other's keeps the pair in TIME_WAIT
// for a minute (tens of thousands of pairs after a few minutes of fuzzing), so a harness sends a FIN only where
// nothing else ends a stream; a peer that holds its end of the connection still reads every byte sent before the
// reset (a reset purges a connection a listener has not handed out yet, so not those).
inline void CloseHard(core::UniqueFd& fd) {
  if (!fd) return;
  linger l{1, 0};
  setsockopt(fd.Get(), SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  fd.Reset();
}

}  // namespace mori::fuzz
