// Reading the launch environment: mori's variables, torchrun's, mpirun's, and the errors for partial or
// inconsistent settings.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "../common/test_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/launch.hpp"

namespace mori::core {
namespace {

using test::ScopedEnv;

// Clears every launcher variable for the duration of a test.
struct CleanLaunchEnv {
  ScopedEnv a{"MORI_RANK", nullptr}, b{"MORI_WORLD_SIZE", nullptr}, c{"MORI_BOOTSTRAP_ADDR", nullptr},
      d{"RANK", nullptr}, e{"WORLD_SIZE", nullptr}, f{"MASTER_ADDR", nullptr}, g{"MASTER_PORT", nullptr},
      h{"OMPI_COMM_WORLD_RANK", nullptr}, i{"OMPI_COMM_WORLD_SIZE", nullptr}, j{"PMI_RANK", nullptr},
      k{"PMI_SIZE", nullptr};
};

void ExpectInvalid(const char* needle) {
  try {
    DetectLaunchEnvironment();
    ADD_FAILURE() << "no error; expected one mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LaunchEnv, NoLauncherIsAJobOfOne) {
  CleanLaunchEnv clean;
  LaunchEnvironment env = DetectLaunchEnvironment();
  EXPECT_EQ(env.launcher, Launcher::Single);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.worldSize, 1);
  auto bootstrap = CreateBootstrapFromEnvironment(5);
  EXPECT_EQ(bootstrap->GetNranks(), 1);
  bootstrap->Barrier();
}

TEST(LaunchEnv, MoriVariables) {
  CleanLaunchEnv clean;
  ScopedEnv r("MORI_RANK", "3"), w("MORI_WORLD_SIZE", "4"), a("MORI_BOOTSTRAP_ADDR", "10.0.0.1:9000");
  LaunchEnvironment env = DetectLaunchEnvironment();
  EXPECT_EQ(env.launcher, Launcher::Mori);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.worldSize, 4);
  EXPECT_EQ(env.rootAddress, "10.0.0.1:9000");
  EXPECT_NE(env.Describe().find("rank 3 of 4"), std::string::npos);
}

TEST(LaunchEnv, MoriVariablesMustBeComplete) {
  CleanLaunchEnv clean;
  {
    ScopedEnv r("MORI_RANK", "1");
    ExpectInvalid("MORI_WORLD_SIZE");
  }
  {
    ScopedEnv r("MORI_RANK", "1"), w("MORI_WORLD_SIZE", "2");
    ExpectInvalid("MORI_BOOTSTRAP_ADDR");
  }
  {
    ScopedEnv r("MORI_RANK", "2"), w("MORI_WORLD_SIZE", "2"), a("MORI_BOOTSTRAP_ADDR", "1.2.3.4:5");
    ExpectInvalid("outside");
  }
  {
    ScopedEnv r("MORI_RANK", "x"), w("MORI_WORLD_SIZE", "2"), a("MORI_BOOTSTRAP_ADDR", "1.2.3.4:5");
    ExpectInvalid("MORI_RANK='x'");
  }
}

TEST(LaunchEnv, TorchrunVariables) {
  CleanLaunchEnv clean;
  ScopedEnv r("RANK", "1"), w("WORLD_SIZE", "8"), a("MASTER_ADDR", "10.9.8.7"), p("MASTER_PORT", "29500");
  LaunchEnvironment env = DetectLaunchEnvironment();
  EXPECT_EQ(env.launcher, Launcher::Torchrun);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.worldSize, 8);
  EXPECT_EQ(env.rootAddress, "10.9.8.7:29501") << "torchrun's store holds MASTER_PORT itself";
  ScopedEnv v6("MASTER_ADDR", "fd00::5");
  EXPECT_EQ(DetectLaunchEnvironment().rootAddress, "[fd00::5]:29501");
  ScopedEnv explicitAddr("MORI_BOOTSTRAP_ADDR", "10.9.8.7:4000");
  EXPECT_EQ(DetectLaunchEnvironment().rootAddress, "10.9.8.7:4000");
}

TEST(LaunchEnv, TorchrunNeedsMaster) {
  CleanLaunchEnv clean;
  ScopedEnv r("RANK", "0"), w("WORLD_SIZE", "2");
  ExpectInvalid("MASTER_ADDR");
  ScopedEnv a("MASTER_ADDR", "10.0.0.1"), p("MASTER_PORT", "99999");
  ExpectInvalid("MASTER_PORT");
}

TEST(LaunchEnv, MoriVariablesWinOverTorchrunAndMpirun) {
  CleanLaunchEnv clean;
  ScopedEnv r("RANK", "1"), w("WORLD_SIZE", "2"), o("OMPI_COMM_WORLD_RANK", "1"), s("OMPI_COMM_WORLD_SIZE", "2"),
      a("MASTER_ADDR", "10.0.0.1"), p("MASTER_PORT", "29500");
  EXPECT_EQ(DetectLaunchEnvironment().launcher, Launcher::Torchrun);
  ScopedEnv mr("MORI_RANK", "0"), mw("MORI_WORLD_SIZE", "1");
  EXPECT_EQ(DetectLaunchEnvironment().launcher, Launcher::Mori);
}

TEST(LaunchEnv, MpirunVariables) {
  CleanLaunchEnv clean;
  ScopedEnv o("OMPI_COMM_WORLD_RANK", "2"), s("OMPI_COMM_WORLD_SIZE", "4");
  LaunchEnvironment env = DetectLaunchEnvironment();
  EXPECT_EQ(env.launcher, Launcher::Mpi);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.worldSize, 4);
  EXPECT_TRUE(env.rootAddress.empty()) << "MPI itself is the bootstrap";
  ScopedEnv bad("OMPI_COMM_WORLD_RANK", "4");
  ExpectInvalid("OMPI_COMM_WORLD_RANK=4");
}

// A rank started by mpirun whose launcher is killed is gone within a second (MORI_EXIT_WITH_LAUNCHER=auto), and
// stays with off. Three generations: this test (adopting orphans as a child subreaper, so it can wait for the
// rank), a stand-in launcher, and the rank with mpirun's variables. In the second case the rank's stderr is a
// pipe only the launcher reads, as under mpirun: the rank must still end by its own SIGKILL after stopping its
// waits, not by the SIGPIPE of its log line about the launcher (which ended ranks with their kernels running).
TEST(LaunchEnv, ARankEndsWithItsLauncher) {
  CleanLaunchEnv clean;
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  struct Case {
    const char* mode;
    bool stderrToLauncher;
  };
  for (const Case& c : {Case{"auto", false}, Case{"auto", true}, Case{"off", false}}) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t launcher = fork();
    ASSERT_GE(launcher, 0);
    if (launcher == 0) {
      int output[2] = {-1, -1};
      if (c.stderrToLauncher && pipe(output) != 0) _exit(4);
      const pid_t rank = fork();
      if (rank == 0) {
        if (c.stderrToLauncher) {
          dup2(output[1], STDERR_FILENO);
          close(output[0]);
          close(output[1]);
        }
        setenv("OMPI_COMM_WORLD_RANK", "0", 1);
        setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
        setenv("MORI_EXIT_WITH_LAUNCHER", c.mode, 1);
        ExitWithLauncher(DetectLaunchEnvironment().launcher);
        const pid_t me = getpid();
        if (write(fds[1], &me, sizeof(me)) != sizeof(me)) _exit(3);
        sleep(20);  // the launcher's death ends it long before, unless off
        _exit(0);
      }
      if (c.stderrToLauncher) close(output[1]);  // the read end stays open, unread, until the launcher dies
      pause();
      _exit(0);
    }
    close(fds[1]);
    pid_t rank = 0;
    ASSERT_EQ(read(fds[0], &rank, sizeof(rank)), static_cast<ssize_t>(sizeof(rank)));
    close(fds[0]);
    ASSERT_EQ(kill(launcher, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
    // The rank is this process's child now; it should end (auto) or not (off) within 1.5 s.
    const auto start = std::chrono::steady_clock::now();
    pid_t ended = 0;
    while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(1500)) {
      ended = waitpid(rank, &status, WNOHANG);
      if (ended != 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (std::string(c.mode) == "auto") {
      EXPECT_EQ(ended, rank) << "the rank outlived its launcher by 1.5 s";
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "status " << status << (WIFSIGNALED(status) ? std::string(", signal ") + strsignal(WTERMSIG(status)) : "")
          << (c.stderrToLauncher ? " (stderr a pipe to the dead launcher)" : "");
    } else {
      EXPECT_EQ(ended, 0) << "MORI_EXIT_WITH_LAUNCHER=off: the rank ended with its launcher (status " << status << ")";
    }
    if (ended == 0) {
      kill(rank, SIGKILL);
      waitpid(rank, &status, 0);
    }
  }
  EXPECT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 0), 0);
}

}  // namespace
}  // namespace mori::core
