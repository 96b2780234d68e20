// Starting a bootstrap from the launch environment: mpirun (Open MPI's OMPI_COMM_WORLD_*), mori's own
// MORI_RANK / MORI_WORLD_SIZE / MORI_BOOTSTRAP_ADDR, or torchrun's RANK / WORLD_SIZE / MASTER_ADDR /
// MASTER_PORT. A process started by none of them is a job of one.
#pragma once

#include <memory>
#include <string>

#include "mori/core/bootstrap.hpp"

namespace mori::core {

enum class Launcher { Single, Mori, Torchrun, Mpi };

struct LaunchEnvironment {
  Launcher launcher = Launcher::Single;
  int rank = 0;
  int worldSize = 1;
  std::string rootAddress;  // for the socket bootstrap: "ip:port" (or "ifname:ip:port"); empty under MPI
  std::string Describe() const;
};

const char* LauncherName(Launcher launcher);

// Reads the environment; inconsistent or partial settings raise InvalidUsage naming the variables.
// Precedence: MORI_* over torchrun's over mpirun's.
LaunchEnvironment DetectLaunchEnvironment();

// Ties this process's life to its launcher's (MORI_EXIT_WITH_LAUNCHER): when the process that started it
// (mpirun, torchrun's agent) is gone, this one stops its device waits and kills itself (SIGKILL) within about
// 100 ms plus the time its kernels take to leave (core/stop.hpp), with a log line naming the launcher's pid. A watcher thread compares the parent's pid every 100 ms: unlike PR_SET_PDEATHSIG it does not
// fire when the launcher's forking thread ends while the launcher lives. Idempotent; SHMEM's init and
// CreateBootstrapFromEnvironment call it.
void ExitWithLauncher(Launcher launcher);

// An initialised bootstrap for this process: MpiBootstrap over MPI_COMM_WORLD under mpirun when mori has
// MPI (initialising MPI if the program has not, and finalising it at exit), else a SocketBootstrap.
// Under torchrun the root listens at MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT).
std::shared_ptr<Bootstrap> CreateBootstrapFromEnvironment(double timeoutSeconds = 0);

}  // namespace mori::core
