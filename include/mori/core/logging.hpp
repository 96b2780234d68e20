// Logging with a level (MORI_LOG_LEVEL) and subsystems (MORI_LOG_SUBSYS), each line tagged with rank,
// host and pid so that the interleaved output of many processes can be read.
#pragma once

#include <cstdint>

namespace mori::core {

enum class LogLevel { Error = 0, Warn = 1, Info = 2, Debug = 3, Trace = 4 };

enum class LogSubsys : uint32_t {
  Core = 1u << 0,
  Bootstrap = 1u << 1,
  Ipc = 1u << 2,
  Gpu = 1u << 3,
  Rdma = 1u << 4,
  Shmem = 1u << 5,
  Proxy = 1u << 6,
  Net = 1u << 7,
};

bool LogEnabled(LogLevel level, LogSubsys subsys);
void LogWrite(LogLevel level, LogSubsys subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

// The rank printed in every line from now on (set by whoever learns it: a bootstrap, ShmemInit).
void SetLogRank(int rank);

// The message of the last error-level line the calling thread logged since ClearLastError() (printed or
// not), "" if none. The C-style SHMEM API reports failure only as a code after logging the cause; this is how
// a caller such as the Python module hands that cause on. Valid until the thread's next error line.
const char* LastError();
void ClearLastError();

// Re-read MORI_LOG_LEVEL and MORI_LOG_SUBSYS (they are read once, at the first log call).
void ReloadLogSettings();

const char* LogLevelName(LogLevel level);
const char* LogSubsysName(LogSubsys subsys);

}  // namespace mori::core

#define MORI_LOG(level, subsys, ...)                                                                  \
  do {                                                                                                \
    if (::mori::core::LogEnabled(::mori::core::LogLevel::level, ::mori::core::LogSubsys::subsys)) {                     \
      ::mori::core::LogWrite(::mori::core::LogLevel::level, ::mori::core::LogSubsys::subsys, __FILE__, __LINE__, __VA_ARGS__); \
    }                                                                                                 \
  } while (0)

#define MORI_LOG_ERROR(subsys, ...) MORI_LOG(Error, subsys, __VA_ARGS__)
#define MORI_LOG_WARN(subsys, ...) MORI_LOG(Warn, subsys, __VA_ARGS__)
#define MORI_LOG_INFO(subsys, ...) MORI_LOG(Info, subsys, __VA_ARGS__)
#define MORI_LOG_DEBUG(subsys, ...) MORI_LOG(Debug, subsys, __VA_ARGS__)
#define MORI_LOG_TRACE(subsys, ...) MORI_LOG(Trace, subsys, __VA_ARGS__)
