#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "mori/core/config.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/launch.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"
#include "service_thread.hpp"
#if MORI_HAS_MPI
#include "mori/core/mpi_bootstrap.hpp"
#endif

namespace mori::core {

namespace {

// Launcher variables that are not mori's own (so not in the MORI_* registry).
std::string Foreign(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

int ForeignInt(const char* name) { return static_cast<int>(ParseInt(Foreign(name), name)); }

void CheckRankInWorld(int rank, int world, const char* rankVar, const char* worldVar) {
  MORI_CHECK(world > 0, ErrorCode::InvalidUsage, "%s=%d must be positive", worldVar, world);
  MORI_CHECK(rank >= 0 && rank < world, ErrorCode::InvalidUsage, "%s=%d is outside [0, %s=%d)", rankVar, rank, worldVar,
             world);
}

#if MORI_HAS_MPI
void FinalizeMpiAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}
#endif

}  // namespace

const char* LauncherName(Launcher launcher) {
  switch (launcher) {
    case Launcher::Single: return "single process";
    case Launcher::Mori: return "MORI_* variables";
    case Launcher::Torchrun: return "torchrun";
    case Launcher::Mpi: return "mpirun";
  }
  return "?";
}

std::string LaunchEnvironment::Describe() const {
  std::string s = StrFormat("%s: rank %d of %d", LauncherName(launcher), rank, worldSize);
  if (!rootAddress.empty()) s += ", root " + rootAddress;
  return s;
}

LaunchEnvironment DetectLaunchEnvironment() {
  LaunchEnvironment env;
  bool moriRank = EnvIsSet("MORI_RANK");
  bool moriWorld = EnvIsSet("MORI_WORLD_SIZE");
  if (moriRank || moriWorld) {
    MORI_CHECK(moriRank && moriWorld, ErrorCode::InvalidUsage, "%s is set but %s is not: set both (and %s)",
               moriRank ? "MORI_RANK" : "MORI_WORLD_SIZE", moriRank ? "MORI_WORLD_SIZE" : "MORI_RANK",
               "MORI_BOOTSTRAP_ADDR");
    env.launcher = Launcher::Mori;
    env.rank = static_cast<int>(EnvGetInt("MORI_RANK"));
    env.worldSize = static_cast<int>(EnvGetInt("MORI_WORLD_SIZE"));
    CheckRankInWorld(env.rank, env.worldSize, "MORI_RANK", "MORI_WORLD_SIZE");
    env.rootAddress = EnvGetString("MORI_BOOTSTRAP_ADDR");
    MORI_CHECK(env.worldSize == 1 || !env.rootAddress.empty(), ErrorCode::InvalidUsage,
               "MORI_RANK and MORI_WORLD_SIZE are set but MORI_BOOTSTRAP_ADDR (rank 0's ip:port) is not");
    return env;
  }
  if (!Foreign("RANK").empty() && !Foreign("WORLD_SIZE").empty()) {
    env.launcher = Launcher::Torchrun;
    env.rank = ForeignInt("RANK");
    env.worldSize = ForeignInt("WORLD_SIZE");
    CheckRankInWorld(env.rank, env.worldSize, "RANK", "WORLD_SIZE");
    if (EnvIsSet("MORI_BOOTSTRAP_ADDR")) {
      env.rootAddress = EnvGetString("MORI_BOOTSTRAP_ADDR");
    } else if (env.worldSize > 1) {
      std::string addr = Foreign("MASTER_ADDR");
      std::string port = Foreign("MASTER_PORT");
      MORI_CHECK(!addr.empty() && !port.empty(), ErrorCode::InvalidUsage,
                 "RANK and WORLD_SIZE are set (torchrun) but MASTER_ADDR or MASTER_PORT is not; set them or "
                 "MORI_BOOTSTRAP_ADDR");
      int p = static_cast<int>(ParseInt(port, "MASTER_PORT"));
      MORI_CHECK(p > 0 && p < 65535, ErrorCode::InvalidUsage, "MASTER_PORT=%d is not a usable port", p);
      bool v6 = addr.find(':') != std::string::npos && addr[0] != '[';
      env.rootAddress = (v6 ? "[" + addr + "]" : addr) + ":" + std::to_string(p + 1);
    }
    return env;
  }
  const char* mpiRankVars[][2] = {{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, {"PMI_RANK", "PMI_SIZE"}};
  for (const auto& vars : mpiRankVars) {
    if (Foreign(vars[0]).empty() || Foreign(vars[1]).empty()) continue;
    env.launcher = Launcher::Mpi;
    env.rank = ForeignInt(vars[0]);
    env.worldSize = ForeignInt(vars[1]);
    CheckRankInWorld(env.rank, env.worldSize, vars[0], vars[1]);
    env.rootAddress = EnvGetString("MORI_BOOTSTRAP_ADDR");
    return env;
  }
  return env;
}

void ExitWithLauncher(Launcher launcher) {
  const std::string mode = EnvGetChoice("MORI_EXIT_WITH_LAUNCHER");
  const bool want = mode == "on" || (mode == "auto" && (launcher == Launcher::Mpi || launcher == Launcher::Torchrun));
  if (!want) return;
  static std::once_flag once;
  std::call_once(once, [launcher] {
    const pid_t launcherPid = getppid();
    // Detached: it only sleeps and reads a pid, and must not hold the process at exit.
    std::thread([launcherPid, launcher] {
      NameThisThread("launcher");
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (getppid() == launcherPid) continue;
        // The launcher held the read ends of this process's stdout and stderr (mpirun forwards them): a write
        // there now raises SIGPIPE, whose default action ended the process with its kernels still running instead
        // of stopped (under MPS the server then refused the next job's clients). mori's log lines block it
        // (logging.cpp); the application's own writes while the process ends (stdout, say) are kept from it here.
        signal(SIGPIPE, SIG_IGN);
        MORI_LOG_ERROR(Core,
                       "the launcher of this process (%s, pid %d) is gone: exiting so that no rank of a killed job "
                       "keeps running (MORI_EXIT_WITH_LAUNCHER=off keeps it)",
                       LauncherName(launcher), static_cast<int>(launcherPid));
        StopWaitsAndEnd(SIGKILL, "launcher gone");
      }
    }).detach();
    MORI_LOG_DEBUG(Core, "exits with its launcher (%s, pid %d)", LauncherName(launcher), static_cast<int>(launcherPid));
  });
}

std::shared_ptr<Bootstrap> CreateBootstrapFromEnvironment(double timeoutSeconds) {
  LaunchEnvironment env = DetectLaunchEnvironment();
  MORI_LOG_INFO(Bootstrap, "launch environment: %s", env.Describe().c_str());
  ExitWithLauncher(env.launcher);
  for (const auto& name : UnknownMoriEnvVars()) {
    MORI_LOG_WARN(Core, "%s is set but is not a mori variable (a typo? mori-info lists them all)", name.c_str());
  }
  if (env.launcher == Launcher::Mpi && env.rootAddress.empty()) {
#if MORI_HAS_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      MORI_CHECK(rc == MPI_SUCCESS, ErrorCode::System, "MPI_Init_thread failed (%d)", rc);
      std::atexit(FinalizeMpiAtExit);
    }
    return std::make_shared<MpiBootstrap>(MPI_COMM_WORLD, timeoutSeconds);
#else
    MORI_THROW(ErrorCode::NotSupported,
               "started by mpirun (rank %d of %d) but this mori was built without MPI; rebuild with MPI "
               "(libopenmpi-dev) or set MORI_BOOTSTRAP_ADDR to rank 0's ip:port",
               env.rank, env.worldSize);
#endif
  }
  auto bootstrap = std::make_shared<SocketBootstrap>(env.rank, env.worldSize);
  if (env.worldSize == 1 && env.rootAddress.empty()) {
    bootstrap->Initialize(SocketBootstrap::UniqueIdFromAddress("127.0.0.1:1"), timeoutSeconds);
  } else {
    bootstrap->Initialize(env.rootAddress, timeoutSeconds);
  }
  return bootstrap;
}

}  // namespace mori::core
