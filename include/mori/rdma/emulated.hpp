// The emulated NIC's controls and counters, for tests and benchmarks: fault knobs (drop the link, add
// delay, corrupt a key, random per-packet faults) and what it has executed. Reached from a device context of the
// Emulated backend.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mori/rdma/rdma.hpp"

namespace mori::rdma {

struct EmulatedNicStats {
  uint64_t wqesExecuted;    // send-queue WQEs the NIC has read and acted on (flushed ones included)
  uint64_t bytesMoved;      // payload bytes written into registered memory on either side
  uint64_t cqesWritten;
  uint64_t requestsServed;  // requests from peers executed as responder
  uint64_t stallReports;    // times a QP with work made no progress for the stall-report time (logged)
  uint64_t doorbellFaults;  // doorbell writes naming no WQE of the QP's send queue (ignored, logged)
  uint64_t strangersRefused;  // wire connections closed for a missing or wrong hello, and packets that named a
                              // QP not connected through their connection (dropped)
  // Random packet faults (EmulatedNicFaults) this NIC injected into packets it sent.
  uint64_t faultsDropped;
  uint64_t faultsCorrupted;
  uint64_t faultsReordered;
  uint64_t faultsDelayed;
  // What this NIC detected as a receiver.
  uint64_t integrityDrops;  // packets whose integrity check failed: dropped, never executed or accepted
  uint64_t outOfSequence;   // requests refused because their PSN was not the next one of their QP
};

// Random faults on the packets an emulated NIC sends, as a lossy fabric causes them; probabilities are per
// packet. A drop or a detected corruption loses the packet (its requester fails after the ack timeout with
// transport-retry-exceeded); a request overtaken by a later one of its QP is refused (an error completion), never
// applied out of order. Connection hellos are never faulted.
struct EmulatedNicFaults {
  uint64_t seed = 0;        // mixed with MORI_RANK (else the process id) and the NIC's index
  double drop = 0;          // the sender discards the packet
  double corrupt = 0;       // one bit of the packet flips after its integrity check was computed
  double reorder = 0;       // the packet is held back and sent after the next one on its connection
  uint32_t delayUsMax = 0;  // each packet waits a random time in [0, delayUsMax] microseconds (order kept)
  // Not a fault: the NIC's ack timeout (SetAckTimeoutMilliseconds) when not 0, so that a job can fail a lost
  // packet's WQE with its error completion well before MORI_TIMEOUT_S ends the waits above the NIC.
  uint32_t ackTimeoutMs = 0;
  bool Any() const { return drop > 0 || corrupt > 0 || reorder > 0 || delayUsMax > 0; }
};

class EmulatedNicControl {
 public:
  virtual ~EmulatedNicControl() = default;
  // Closes every wire connection now: WQEs in flight complete with transport-retry-exceeded errors and
  // their QPs go to the error state; new connections fail until RestoreLink().
  virtual void DropLink() = 0;
  virtual void RestoreLink() = 0;
  // Every WQE waits this long before the NIC executes it.
  virtual void SetDelayMicroseconds(uint32_t us) = 0;
  // The next RDMA WQE executed uses a wrong remote key (a remote access error follows).
  virtual void CorruptNextRemoteKey() = 0;
  // How long a send may wait for a receive buffer at the responder before it fails (RNR retries).
  virtual void SetRnrTimeoutMilliseconds(uint32_t ms) = 0;
  // A QP that has work but makes no progress for this long is logged (once per stall) with its state.
  virtual void SetStallReportMilliseconds(uint32_t ms) = 0;
  // How long a request sent to a peer may wait for its response (MORI_TIMEOUT_S by default) before it completes
  // with transport-retry-exceeded and its QP goes to the error state, as an RC QP's ack timeout and retries do.
  virtual void SetAckTimeoutMilliseconds(uint32_t ms) = 0;
  // Random packet faults from now on (MORI_EMULATED_NIC_FAULTS sets them when the NIC is created); all zero: none.
  virtual void SetFaults(const EmulatedNicFaults& faults) = 0;
  virtual EmulatedNicStats Stats() const = 0;
};

// A peer whose NIC closed its wire connections with an emulated NIC of this process (its process ended, or the
// link broke) while QPs here were connected to it, in the order the losses were seen.
struct EmulatedPeerLoss {
  std::string name;    // as NameRemote gave it ("rank 3"), else the peer NIC's address
  double secondsAgo;   // before the call
  std::string reason;  // what the NIC saw
};
std::vector<EmulatedPeerLoss> EmulatedNicPeerLosses();

// The controls of an Emulated device context; nullptr for contexts of other backends.
EmulatedNicControl* GetEmulatedNicControl(RdmaDeviceContext* context);

}  // namespace mori::rdma
