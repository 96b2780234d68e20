// Random packet faults of the emulated NIC (MORI_EMULATED_NIC_FAULTS): the spec's parser and the per-NIC draw
// that decides, packet by packet, what befalls it. The NIC applies the decisions where it sends.
#pragma once

#include <cstdint>
#include <string>

#include "mori/rdma/emulated.hpp"

namespace mori::rdma::emulated {

// "seed=S,drop=P,corrupt=P,reorder=P,delay_us=MAX,ack_timeout_ms=T", any subset in any order; empty: no faults. Throws
// InvalidUsage naming `what` (the variable) and the bad field.
EmulatedNicFaults ParseFaultSpec(const std::string& text, const char* what);

// "drop=0.1,corrupt=0,reorder=0,delay_us=0": the spec as the log line shows it.
std::string FaultSpecString(const EmulatedNicFaults& faults);

// The seed of one NIC's draws: the spec's seed mixed with something of the process (its rank, else its id) and
// the NIC's index in the process, so that ranks started with one spec draw differently.
uint64_t NicFaultSeed(uint64_t specSeed, uint64_t processSalt, uint64_t nicIndex);

// Draws of one NIC (splitmix64: small, fast, and the same sequence on every platform for a seed). Not thread
// safe: the NIC calls it under its lock.
class FaultDraw {
 public:
  void Reset(const EmulatedNicFaults& faults, uint64_t seed) {
    faults_ = faults;
    state_ = seed;
  }
  const EmulatedNicFaults& Faults() const { return faults_; }
  bool Drop() { return Chance(faults_.drop); }
  bool Corrupt() { return Chance(faults_.corrupt); }
  bool Reorder() { return Chance(faults_.reorder); }
  uint32_t DelayUs() {
    return faults_.delayUsMax == 0 ? 0 : static_cast<uint32_t>(Below(uint64_t(faults_.delayUsMax) + 1));
  }
  uint64_t Below(uint64_t n) { return Next() % n; }  // n >= 1; the bias is below 2^-40 for the n used here

 private:
  bool Chance(double p) { return p > 0 && static_cast<double>(Next() >> 11) * 0x1.0p-53 < p; }
  uint64_t Next();

  EmulatedNicFaults faults_{};
  uint64_t state_ = 0;
};

}  // namespace mori::rdma::emulated
