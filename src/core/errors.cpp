#include "mori/core/errors.hpp"

namespace mori::core {

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidUsage: return "invalid usage";
    case ErrorCode::System: return "system error";
    case ErrorCode::Gpu: return "GPU error";
    case ErrorCode::Rdma: return "RDMA error";
    case ErrorCode::Timeout: return "timeout";
    case ErrorCode::RemoteFailure: return "remote failure";
    case ErrorCode::Protocol: return "protocol error";
    case ErrorCode::NotSupported: return "not supported";
    case ErrorCode::Internal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string("mori ") + ErrorCodeName(code) + ": " + message), code_(code) {}

SysError::SysError(int err, const std::string& message) : Error(ErrorCode::System, message), errno_(err) {}

GpuError::GpuError(int status, const std::string& message) : Error(ErrorCode::Gpu, message), status_(status) {}

RdmaError::RdmaError(int status, const std::string& message) : Error(ErrorCode::Rdma, message), status_(status) {}

}  // namespace mori::core
