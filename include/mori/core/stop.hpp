// Ending a process promptly when it is asked to (SIGTERM, SIGINT, its launcher gone) while its kernels wait
// for peers.
//
// A rank that `timeout`, a scheduler, mpirun or Ctrl-C ends usually sits in a kernel that waits for a peer (a
// signal, a barrier, a completion). Killed there, it leaves a running kernel for the driver to tear down, and
// under CUDA MPS for the MPS server, which refuses new clients meanwhile: the next job on that GPU failed.
// So a mori process, on such a request:
//   1. sets its stop word, which mori's bounded device waits (SHMEM waits, barriers, quiet, fetches, atomics;
//      RDMA queue and FIFO waits; semaphores; LL packet reads) read together with their clock. A waiting thread
//      then leaves its kernel without an error (CUDA `exit`; on HOST its thread ends and the launch fails; on
//      HIP not yet: the wait goes on until step 2's bound). On CUDA the thread leaves alone: lanes of its warp
//      that wait for it at a warp-level sync are left undefined (docs/GUIDE.md);
//   2. waits, bounded by MORI_STOP_DRAIN_MS, until the device is idle (a kernel that waits in a loop of its
//      own does not see the word: the bound ends the wait for it);
//   3. ends the process with the request's signal and its default action, so the exit status still says what
//      ended it.
// A thread that returns from main, calls exit() or throws an exception nobody catches meanwhile (its kernel
// ended early, so it went on) waits in an atexit or terminate handler for step 3, so that the exit status is the
// signal's, not the program's own.
// The handlers are installed by ShmemInit (InstallStopOnSignals), only for a signal whose action is still
// the default: an application's own handler (Python's SIGINT, say) is kept. A repeated signal more than 500 ms
// after the first ends the process at once. MORI_STOP_ON_SIGNAL=0 installs nothing.
#pragma once

#include <cstdint>

namespace mori::core {

// The process's stop word as device code reads it: host memory pinned and mapped into the GPU (GPU
// backends), a plain word on HOST. Made on the first call (on a GPU backend that needs the device's context
// current); nullptr if it could not be made, and then waits cannot be stopped (logged once).
const uint32_t* DeviceStopWord();

// Whether a stop was requested in this process.
bool StopRequested();

// Installs the SIGTERM and SIGINT handlers described above, once per process; later calls do nothing.
// Returns whether at least one handler is installed.
bool InstallStopOnSignals();

// Steps 1-3 above from an ordinary thread: sets the stop word, waits for the device (bounded), then ends the
// process with `signal` (SIGKILL when the launcher is gone). `why` ("received SIGTERM") opens the log line. Does not return.
[[noreturn]] void StopWaitsAndEnd(int signal, const char* why);

namespace detail {
// For tests: sets or clears the stop word as a handler would, without ending the process.
void SetStopWordForTesting(bool stop);
}  // namespace detail

}  // namespace mori::core
