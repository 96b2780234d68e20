// Helpers shared by mori's tests: data patterns that depend on rank and index, and a runner that starts
// N processes by fork() and reports, per rank, how each ended (with a bound on the whole run).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mori/core/device.hpp"

namespace mori::core::test {

// A byte that differs with rank, index and a per-test seed; never constant over a range.
MORI_HOST_DEVICE_INLINE uint8_t PatternByte(int rank, size_t index, uint32_t seed = 0) {
  uint64_t x = (static_cast<uint64_t>(rank) + 1) * 0x9E3779B97F4A7C15ull ^ (index + 1) * 0xBF58476D1CE4E5B9ull ^ seed;
  x ^= x >> 31;
  return static_cast<uint8_t>(x * 0x94D049BB133111EBull >> 56);
}

void FillPattern(void* data, size_t bytes, int rank, uint32_t seed = 0);

// Index of the first byte that differs from the pattern, or `bytes` when all match.
size_t FirstPatternMismatch(const void* data, size_t bytes, int rank, uint32_t seed = 0);

struct ProcessOutcome {
  int rank = -1;
  int exitCode = -1;  // when it exited
  int signal = 0;     // when a signal ended it
  bool timedOut = false;
  bool Ok() const { return exitCode == 0 && signal == 0 && !timedOut; }
  std::string Describe() const;
};

// fork(), once every other thread of this process sleeps (state S in /proc/self/task, twice in a row 1 ms apart;
// at most 2 s of waiting, then it forks anyway). AddressSanitizer of GCC 12 takes no allocator lock across
// fork(): a thread that is allocating at the moment of the fork (one still starting counts) leaves the child an
// allocator lock that nobody will release, and the child's first allocation of that size waits forever.
pid_t ForkWhenOtherThreadsSleep();

// Runs body(rank) in `n` forked processes. A child's result is its return value, or 1 if it left a gtest
// failure or threw. A run longer than `timeoutSeconds` kills every child left and marks it timed out.
std::vector<ProcessOutcome> RunProcesses(int n, const std::function<int(int rank)>& body, double timeoutSeconds = 120);

// The same, expecting every rank to succeed; adds a gtest failure per rank that did not.
void ExpectAllSucceed(const std::vector<ProcessOutcome>& outcomes);

// Ends this process at once with `code`, as a process that dies does: no atexit handlers, no flushing, no
// sanitizer finalization (ThreadSanitizer's _exit sleeps a second first, during which this process's
// threads, its emulated NIC among them, keep answering peers).
[[noreturn]] void DieAbruptly(int code);

// A plain 8-byte read of a word another thread or process may be writing with plain stores (recv(), a
// copy engine): tests use it to watch a transfer's progress, a race on purpose, so it is not instrumented.
uint64_t RacyLoad64(const void* word);

// A free TCP port on loopback (bound and released; good enough for tests).
int FreeTcpPort();

// A bootstrap root address on loopback at a free port ("127.0.0.1:PORT").
std::string LoopbackRoot();

// The descriptors of this process's listening sockets (any family), from /proc/self/fd.
std::vector<int> ListeningFds();

// This process's threads, from /proc/self/task: each one's id and name (comm); empty where there is no /proc.
std::vector<std::pair<pid_t, std::string>> Threads();
// Their names alone.
std::vector<std::string> ThreadNames();

// Number of GPUs, probed in a child process so that this process does not initialise the GPU runtime
// before it forks (a CUDA context does not survive fork()).
int ProbeGpuCount();

// Scoped setenv / unsetenv.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value);  // value nullptr: unset
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_;
  std::string old_;
};

}  // namespace mori::core::test
