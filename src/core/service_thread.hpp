// mori's own host threads (a proxy, an emulated NIC's engine, the TCP link's channel threads): what they are
// called, and on which CPUs they run.
#pragma once

#include <sched.h>

#include <string>

namespace mori::core {

// Names the calling thread "mori-<role>" or "mori-<role>:<index>" (index < 0: none), as top -H, ps -L, gdb,
// perf and /proc/<pid>/task/*/comm show it. A rank runs several threads of mori's beside the application's
// and CUDA's; one that waits or starves is found by its name (15 characters at most on Linux; longer is cut).
void NameThisThread(const char* role, int index = -1);

// NameThisThread, then PlaceServiceThread: the start of every thread the application's kernels wait for.
void BecomeServiceThread(const char* role, int index, int device);

// Places the calling thread, a mori service thread that the application's kernels wait for, on CPUs:
// - on the CPUs near `device` (its PCI device's local_cpulist; device < 0 or unknown: every online CPU) that
//   the thread may use (the affinity it inherited from the thread that made it, usually the launcher's
//   binding of the process);
// - but when that binding is a single CPU (mpirun binds each rank to one core when it starts 2 or fewer),
//   on the other CPUs near the device (none: the other online CPUs): the application's own thread runs on
//   that CPU, and one that spins in cudaDeviceSynchronize left a service thread beside it about 1% of the CPU
//   (an H200 under MPS: an atomics example through the proxy took 45 s at 2 ranks, 3 s at 3 ranks, which
//   mpirun binds to a socket).
// Failing to pin (a cpuset that forbids the CPUs) leaves the thread where it is, with a warning. Returns what
// was done, for the log and tests.
std::string PlaceServiceThread(const char* role, int device);

// The CPUs near `device` (its local_cpulist) into *cpus; false (with *why) when unknown.
bool CpusNearDevice(int device, cpu_set_t* cpus, std::string* why);
// "0-3,8,10-11", or "none".
std::string CpuListText(const cpu_set_t& set);
// Parses a sysfs CPU list ("0-31,64-95"); false when it is malformed or names a CPU beyond CPU_SETSIZE.
bool ParseCpuList(const std::string& text, cpu_set_t* set);

}  // namespace mori::core
