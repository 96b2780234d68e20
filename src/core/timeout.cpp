#include "mori/core/timeout.hpp"

#include <climits>

#include "mori/core/env.hpp"

namespace mori::core {

Deadline Deadline::After(double seconds) {
  // Beyond about 30 years (or not a number) the span would overflow the clock's nanoseconds: no end then.
  if (!(seconds < 1e9)) return Never();
  auto span = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds < 0 ? 0 : seconds));
  return Deadline(Clock::now() + span, seconds);
}

Deadline Deadline::Default() { return After(TimeoutSeconds()); }

Deadline Deadline::Never() { return Deadline(Clock::time_point::max(), 1e18); }

int Deadline::RemainingMs() const {
  if (end_ == Clock::time_point::max()) return INT_MAX;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

double Deadline::RemainingSeconds() const {
  if (end_ == Clock::time_point::max()) return 1e18;
  double left = std::chrono::duration<double>(end_ - Clock::now()).count();
  return left < 0 ? 0 : left;
}

}  // namespace mori::core
