// printf-style formatting into std::string, shared by errors and logging.
#pragma once

#include <string>

namespace mori::core {

std::string StrFormat(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// strerror_r in a form that is the same on glibc and musl.
std::string ErrnoString(int err);

}  // namespace mori::core
