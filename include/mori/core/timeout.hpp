// Deadlines for bounded waits on the host. Every wait that depends on another process, thread or device
// takes one; the default comes from MORI_TIMEOUT_S.
#pragma once

#include <chrono>

namespace mori::core {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline After(double seconds);
  static Deadline Default();  // MORI_TIMEOUT_S from now
  static Deadline Never();

  bool Expired() const { return Clock::now() >= end_; }
  // Milliseconds left, clamped to [0, INT_MAX], in the form poll() takes.
  int RemainingMs() const;
  double RemainingSeconds() const;
  // Seconds this deadline allows in all, for messages ("timed out after 30 s").
  double TotalSeconds() const { return total_; }

 private:
  Deadline(Clock::time_point end, double total) : end_(end), total_(total) {}
  Clock::time_point end_;
  double total_;
};

}  // namespace mori::core
