// Copies that a host thread makes for a kernel that may be waiting for them (the TCP link's writes and word
// operations into GPU memory, the emulated NIC's, the CudaIpc connection's): issued on a stream of their own
// and waited for, with the time taken watched. Two things hold such a copy up until the running kernels end
// (measured on an H200: docs/PERF.md), and when the kernel is the one waiting for the copy, both wait until
// the kernel's bounded wait gives up:
// - too few hardware work queues: CUDA maps a process's streams onto CUDA_DEVICE_MAX_CONNECTIONS queues (8
//   by default, fewer for an MPS client) in turn, and a copy whose stream shares a queue with work that waits
//   for a running kernel waits too. With 1 or 2 queues the EP suite over the proxy with TCP connections
//   stalled in every run, with 4, 8 or 16 in none; so mori sets 8 when it is loaded under MPS with the
//   variable unset (MORI_CUDA_MAX_CONNECTIONS), and warns at the first copy when fewer than 4 are asked for;
// - a cudaFree, cudaFreeHost or cudaHostUnregister of another thread of the process, which waits for the
//   running kernels to end and holds every copy of the process meanwhile.
// The error or warning of a slow copy names both instead of leaving only the kernel's timeout.
// Against the first, all of those copies go on one stream per device (HostCopyStream): a stream of their own
// per TCP channel, NIC and connection took 30 and more streams in a PE of an 8-PE job over the proxy with TCP
// connections, and with 8 hardware queues some of them always shared a queue with the kernels' streams
// (the EP suite stalled in 2 of 4 runs on an H200).
#pragma once

#include <cstddef>
#include <string>

#include "mori/core/copy_stream.hpp"
#include "mori/core/gpu.hpp"

namespace mori::core {

// A copy slower than this is reported (a warning when it completes, the hint in the error when it fails).
constexpr double kSlowProxyCopyS = 2.0;

// The sentence appended to a report of a copy that took `seconds` (empty below kSlowProxyCopyS).
std::string SlowProxyCopyHint(double seconds);

// The queue count below which a copy is warned about, and what mori sets under MPS by default.
constexpr int kMinCopyQueues = 4;
constexpr int kMpsConnections = 8;

// The value mori gives CUDA_DEVICE_MAX_CONNECTIONS at load: `current` is its value (null: unset), `wanted`
// MORI_CUDA_MAX_CONNECTIONS (null: kMpsConnections; 0 or not a positive number: none), `mps` whether an MPS
// control daemon runs. Empty: leave it as it is (set already, or no MPS: CUDA's own default is 8).
std::string CudaConnectionsToSet(const char* current, const char* wanted, bool mps);

// Whether an MPS control daemon listens in CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps).
bool MpsControlRunning();

// The warning for CUDA_DEVICE_MAX_CONNECTIONS=`current` (empty when it is unset or at least kMinCopyQueues).
std::string FewCopyQueuesWarning(const char* current);

// This thread's event for waiting on work of the current device: made once per thread and device, without timing,
// and recorded again by every wait (a new timing event per wait cost 2.4 us more per 8-byte copy on an H200,
// bench/experiments/copy_wait_cost.cu). Only for a wait that ends before the thread records it again.
GpuStatus ThreadWaitEvent(GpuEvent* event);

// cudaMemcpyAsync on `stream`, then a wait for that copy (an event recorded after it); returns the first
// failure's status. `seconds` receives the time this took. The first call of the process logs
// FewCopyQueuesWarning (and, at info level, a value mori set at load). Throws nothing.
GpuStatus TimedStreamCopy(void* dst, const void* src, size_t bytes, GpuStream stream, double* seconds);

}  // namespace mori::core
