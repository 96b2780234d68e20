#include "mori/core/format.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace mori::core {

std::string StrFormat(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out;
  if (n > 0) {
    out.resize(static_cast<size_t>(n));
    std::vsnprintf(out.data(), out.size() + 1, fmt, args);
  }
  va_end(args);
  return out;
}

std::string ErrnoString(int err) {
  char buf[256];
  // The GNU strerror_r may return a static string instead of filling buf; both forms are handled.
  auto result = strerror_r(err, buf, sizeof(buf));
  if constexpr (std::is_same_v<decltype(result), char*>) {
    return StrFormat("%s (errno %d)", result, err);
  } else {
    return StrFormat("%s (errno %d)", result == 0 ? buf : "unknown error", err);
  }
}

}  // namespace mori::core
