// The emulated NIC's controls and counters, for tests and benchmarks: fault knobs (drop the link, add
// delay, corrupt a key) and what it has executed. Reached from a device context of the Emulated backend.
#pragma once

#include <cstdint>

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
  virtual EmulatedNicStats Stats() const = 0;
};

// The controls of an Emulated device context; nullptr for contexts of other backends.
EmulatedNicControl* GetEmulatedNicControl(RdmaDeviceContext* context);

}  // namespace mori::rdma
