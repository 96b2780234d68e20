// The boundary of the C-style SHMEM host API (STYLE.md: one error regime): the body's exception becomes a log
// line naming the call and the cause, and a return code.
#pragma once

#include <exception>
#include <utility>

#include "mori/core/logging.hpp"

namespace mori::shmem::detail {

// 0 when `body` returns, -1 after logging "op: cause" when it throws.
template <typename F>
int Guarded(const char* op, F&& body) {
  try {
    std::forward<F>(body)();
    return 0;
  } catch (const std::exception& e) {
    MORI_LOG_ERROR(Shmem, "%s: %s", op, e.what());
    return -1;
  }
}

}  // namespace mori::shmem::detail
