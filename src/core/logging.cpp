#include "mori/core/logging.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"

namespace mori::core {

namespace {

struct LogSettings {
  std::atomic<int> level{static_cast<int>(LogLevel::Warn)};
  std::atomic<uint32_t> subsysMask{~0u};
  std::atomic<bool> loaded{false};
  std::atomic<int> rank{-1};
  std::mutex loadMutex;
};

// A fixed buffer, not a std::string: errors may be logged while the thread's destructors run.
thread_local char lastError[2048];

// Writes one line to stderr with SIGPIPE blocked in this thread. When stderr is a pipe whose reader is gone (mpirun
// killed, `prog 2>&1 | head` done), the write fails with EPIPE and the kernel raises SIGPIPE at the writing thread,
// whose default action ends the whole process: any mori thread logging then (a proxy, the emulated NIC, the
// bootstrap seeing peers vanish) killed the process with its kernels still running. Blocked, the signal stays
// pending and is taken back here, unless one was pending before this write; the application's own disposition of
// SIGPIPE and its own writes are untouched.
void WriteStderr(const char* text, size_t len) {
  const int savedErrno = errno;
  sigset_t pipeOnly;
  sigset_t previous;
  sigemptyset(&pipeOnly);
  sigaddset(&pipeOnly, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipeOnly, &previous);
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  const bool pendingBefore = sigismember(&pending, SIGPIPE) == 1;
  bool brokenPipe = false;
  while (len > 0) {
    ssize_t n = write(STDERR_FILENO, text, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      brokenPipe = n < 0 && errno == EPIPE;
      break;
    }
    text += n;
    len -= static_cast<size_t>(n);
  }
  if (brokenPipe && !pendingBefore) {
    const struct timespec now = {0, 0};
    while (sigtimedwait(&pipeOnly, nullptr, &now) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  errno = savedErrno;
}

void WriteStderrFormatted(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void WriteStderrFormatted(const char* fmt, ...) {
  char out[1024];
  va_list args;
  va_start(args, fmt);
  int n = std::vsnprintf(out, sizeof(out), fmt, args);
  va_end(args);
  if (n > 0) WriteStderr(out, static_cast<size_t>(n) < sizeof(out) ? static_cast<size_t>(n) : sizeof(out) - 1);
}

LogSettings& Settings() {
  static LogSettings* settings = new LogSettings();  // never destroyed: logging may run during exit
  return *settings;
}

constexpr struct {
  const char* name;
  LogSubsys subsys;
} kSubsysNames[] = {
    {"core", LogSubsys::Core},   {"bootstrap", LogSubsys::Bootstrap}, {"ipc", LogSubsys::Ipc},
    {"gpu", LogSubsys::Gpu},     {"rdma", LogSubsys::Rdma},           {"shmem", LogSubsys::Shmem},
    {"proxy", LogSubsys::Proxy}, {"net", LogSubsys::Net},
};

uint32_t ParseSubsysMask(const std::string& spec) {
  std::string s = spec;
  bool exclude = !s.empty() && s[0] == '^';
  if (exclude) s = s.substr(1);
  uint32_t mask = 0;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(start, comma - start);
    if (item == "all") {
      mask = ~0u;
    } else if (!item.empty()) {
      bool found = false;
      for (const auto& entry : kSubsysNames) {
        if (item == entry.name) {
          mask |= static_cast<uint32_t>(entry.subsys);
          found = true;
        }
      }
      if (!found) WriteStderrFormatted("[mori WARN] MORI_LOG_SUBSYS: unknown subsystem '%s' ignored\n", item.c_str());
    }
    start = comma + 1;
  }
  return exclude ? ~mask : mask;
}

void LoadSettings(LogSettings& st) {
  std::lock_guard<std::mutex> lock(st.loadMutex);
  int level = static_cast<int>(LogLevel::Warn);
  uint32_t mask = ~0u;
  try {
    std::string v = EnvGetChoice("MORI_LOG_LEVEL");
    const char* names[] = {"error", "warn", "info", "debug", "trace"};
    for (int i = 0; i < 5; ++i) {
      if (v == names[i]) level = i;
    }
    mask = ParseSubsysMask(EnvGetString("MORI_LOG_SUBSYS"));
  } catch (const Error& e) {
    WriteStderrFormatted("[mori WARN] %s; logging at the defaults\n", e.what());
  }
  st.level.store(level);
  st.subsysMask.store(mask);
  st.loaded.store(true, std::memory_order_release);
}

}  // namespace

const char* LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::Error: return "ERROR";
    case LogLevel::Warn: return "WARN";
    case LogLevel::Info: return "INFO";
    case LogLevel::Debug: return "DEBUG";
    case LogLevel::Trace: return "TRACE";
  }
  return "?";
}

const char* LogSubsysName(LogSubsys subsys) {
  for (const auto& entry : kSubsysNames) {
    if (entry.subsys == subsys) return entry.name;
  }
  return "?";
}

bool LogEnabled(LogLevel level, LogSubsys subsys) {
  LogSettings& st = Settings();
  if (!st.loaded.load(std::memory_order_acquire)) LoadSettings(st);
  if (static_cast<int>(level) > st.level.load(std::memory_order_relaxed)) return false;
  // Errors always print, whatever the subsystem filter says.
  return level == LogLevel::Error || (st.subsysMask.load(std::memory_order_relaxed) & static_cast<uint32_t>(subsys));
}

const char* LastError() { return lastError; }

void ClearLastError() { lastError[0] = '\0'; }

void ReloadLogSettings() { LoadSettings(Settings()); }

void SetLogRank(int rank) { Settings().rank.store(rank); }

void LogWrite(LogLevel level, LogSubsys subsys, const char* file, int line, const char* fmt, ...) {
  char host[64] = "?";
  gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = '\0';
  char* dot = std::strchr(host, '.');
  if (dot != nullptr) *dot = '\0';

  va_list args;
  va_start(args, fmt);
  char message[2048];
  std::vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);
  if (level == LogLevel::Error) std::snprintf(lastError, sizeof(lastError), "%s", message);

  int rank = Settings().rank.load();
  char rankText[16] = "-";
  if (rank >= 0) std::snprintf(rankText, sizeof(rankText), "%d", rank);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;

  // One formatted line, written with one call, so lines of concurrent threads do not interleave.
  char out[2400];
  int n;
  if (level >= LogLevel::Debug) {
    n = std::snprintf(out, sizeof(out), "[mori %s rank %s %s:%d %s] %s (%s:%d)\n", LogLevelName(level), rankText,
                      host, static_cast<int>(getpid()), LogSubsysName(subsys), message, base, line);
  } else {
    n = std::snprintf(out, sizeof(out), "[mori %s rank %s %s:%d %s] %s\n", LogLevelName(level), rankText, host,
                      static_cast<int>(getpid()), LogSubsysName(subsys), message);
  }
  if (n > 0) {
    WriteStderr(out, static_cast<size_t>(n) < sizeof(out) ? static_cast<size_t>(n) : sizeof(out) - 1);
  }
}

}  // namespace mori::core
