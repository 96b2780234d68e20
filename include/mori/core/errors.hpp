// mori's one error regime on the host: typed exceptions carrying a code, raised through MORI_CHECK_* macros
// that add file:line and the failing call. The C-style SHMEM API catches them at its boundary.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

#include "mori/core/format.hpp"

namespace mori::core {

enum class ErrorCode {
  InvalidUsage,   // the caller passed something wrong (bad rank, size, pointer, option)
  System,         // an operating-system call failed (errno)
  Gpu,            // the GPU runtime or driver failed
  Rdma,           // the RDMA stack or NIC failed
  Timeout,        // a bounded wait ran out; the message names what was awaited
  RemoteFailure,  // a peer died, closed its connection or reported an error
  Protocol,       // malformed, truncated or foreign bytes arrived
  NotSupported,   // this machine or build lacks the capability
  Internal,       // an invariant of mori itself broke
};

const char* ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode Code() const { return code_; }

 private:
  ErrorCode code_;
};

// An operating-system call failed; Errno() is the errno it left.
class SysError : public Error {
 public:
  SysError(int err, const std::string& message);
  int Errno() const { return errno_; }

 private:
  int errno_;
};

// The GPU runtime returned Status() (cudaError_t / hipError_t / the HOST runtime's code).
class GpuError : public Error {
 public:
  GpuError(int status, const std::string& message);
  int Status() const { return status_; }

 private:
  int status_;
};

// The RDMA stack failed; Status() is the errno-style value the verbs call returned, or a CQE syndrome.
class RdmaError : public Error {
 public:
  RdmaError(int status, const std::string& message);
  int Status() const { return status_; }

 private:
  int status_;
};

class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& message) : Error(ErrorCode::Timeout, message) {}
};

}  // namespace mori::core

#define MORI_SOURCE_LOCATION __FILE__ ":" MORI_ERRORS_STR(__LINE__)
#define MORI_ERRORS_STR_IMPL(x) #x
#define MORI_ERRORS_STR(x) MORI_ERRORS_STR_IMPL(x)

// Throws mori::core::Error(code) with a printf-style message and the source location.
#define MORI_THROW(code, ...) \
  throw ::mori::core::Error((code), ::mori::core::StrFormat(__VA_ARGS__) + " (" MORI_SOURCE_LOCATION ")")

#define MORI_CHECK(cond, code, ...) \
  do {                              \
    if (!(cond)) {                  \
      MORI_THROW(code, __VA_ARGS__); \
    }                               \
  } while (0)

// For calls that return -1 and set errno (or return a negative errno when `negErrno`).
#define MORI_CHECK_SYS(call)                                                                                \
  do {                                                                                                      \
    if ((call) < 0) {                                                                                       \
      int moriErr_ = errno;                                                                                 \
      throw ::mori::core::SysError(moriErr_, ::mori::core::StrFormat("%s failed: %s", #call, ::mori::core::ErrnoString(moriErr_).c_str()) + \
                                           " (" MORI_SOURCE_LOCATION ")");                                  \
    }                                                                                                       \
  } while (0)

// Throws a SysError for errno `err` with a printf-style description of what was being done.
#define MORI_THROW_SYS(err, ...)                                                                              \
  throw ::mori::core::SysError((err), ::mori::core::StrFormat(__VA_ARGS__) + ": " + ::mori::core::ErrnoString(err) + " (" \
                                    MORI_SOURCE_LOCATION ")")
