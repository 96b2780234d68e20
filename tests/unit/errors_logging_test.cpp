// The error regime (codes, messages with location) and the logger (levels, subsystems, rank tag).
#include <gtest/gtest.h>

#include <cerrno>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <string>
#include <thread>

#include "../common/test_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"

namespace mori::core {
namespace {

TEST(Errors, ThrowCarriesCodeMessageAndLocation) {
  try {
    MORI_THROW(ErrorCode::InvalidUsage, "rank %d is outside [0, %d)", 9, 4);
    FAIL();
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
    EXPECT_NE(what.find("invalid usage"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 9 is outside [0, 4)"), std::string::npos) << what;
    EXPECT_NE(what.find("errors_logging_test.cpp:"), std::string::npos) << what;
  }
}

TEST(Errors, SysErrorKeepsErrnoAndNamesTheCall) {
  try {
    MORI_CHECK_SYS(open("/nonexistent/mori/file", O_RDONLY));
    FAIL();
  } catch (const SysError& e) {
    EXPECT_EQ(e.Errno(), ENOENT);
    EXPECT_EQ(e.Code(), ErrorCode::System);
    std::string what = e.what();
    EXPECT_NE(what.find("open(\"/nonexistent/mori/file\", O_RDONLY) failed"), std::string::npos) << what;
    EXPECT_NE(what.find("No such file"), std::string::npos) << what;
  }
}

TEST(Errors, GpuErrorNamesTheRuntimeCall) {
  try {
    MORI_CHECK_GPU(GpuSetDevice(-7));
    FAIL();
  } catch (const GpuError& e) {
    EXPECT_NE(e.Status(), 0);
    EXPECT_NE(std::string(e.what()).find("GpuSetDevice(-7) failed"), std::string::npos) << e.what();
  }
  (void)GpuGetLastError();
}

TEST(Errors, CheckPassesWhenTrue) {
  EXPECT_NO_THROW(MORI_CHECK(1 + 1 == 2, ErrorCode::Internal, "arithmetic"));
  EXPECT_THROW(MORI_CHECK(false, ErrorCode::Internal, "always"), Error);
}

TEST(Logging, LevelsAndSubsystemsFilter) {
  {
    test::ScopedEnv level("MORI_LOG_LEVEL", "info");
    test::ScopedEnv subsys("MORI_LOG_SUBSYS", "bootstrap,ipc");
    ReloadLogSettings();
    EXPECT_TRUE(LogEnabled(LogLevel::Info, LogSubsys::Bootstrap));
    EXPECT_TRUE(LogEnabled(LogLevel::Warn, LogSubsys::Ipc));
    EXPECT_FALSE(LogEnabled(LogLevel::Info, LogSubsys::Rdma));
    EXPECT_FALSE(LogEnabled(LogLevel::Debug, LogSubsys::Bootstrap));
    EXPECT_TRUE(LogEnabled(LogLevel::Error, LogSubsys::Rdma));  // errors ignore the subsystem filter
  }
  {
    test::ScopedEnv level("MORI_LOG_LEVEL", "trace");
    test::ScopedEnv subsys("MORI_LOG_SUBSYS", "^rdma");
    ReloadLogSettings();
    EXPECT_TRUE(LogEnabled(LogLevel::Trace, LogSubsys::Core));
    EXPECT_FALSE(LogEnabled(LogLevel::Warn, LogSubsys::Rdma));
  }
  ReloadLogSettings();
}

TEST(Logging, LinesCarryLevelRankAndSubsystem) {
  test::ScopedEnv level("MORI_LOG_LEVEL", "info");
  ReloadLogSettings();
  SetLogRank(5);
  testing::internal::CaptureStderr();
  MORI_LOG_INFO(Shmem, "heap of %d MiB", 64);
  std::string line = testing::internal::GetCapturedStderr();
  SetLogRank(-1);
  EXPECT_NE(line.find("[mori INFO rank 5 "), std::string::npos) << line;
  EXPECT_NE(line.find(" shmem] heap of 64 MiB\n"), std::string::npos) << line;
  ReloadLogSettings();
}

TEST(Logging, LastErrorIsTheCallingThreadsLastErrorLine) {
  ClearLastError();
  EXPECT_STREQ(LastError(), "");
  testing::internal::CaptureStderr();
  MORI_LOG_WARN(Shmem, "a warning is not an error");
  MORI_LOG_ERROR(Shmem, "first failure %d", 1);
  MORI_LOG_ERROR(Shmem, "ShmemFree(%p): not a heap block", static_cast<void*>(nullptr));
  std::string otherThreadSaw = "unset";
  std::thread other([&] {
    otherThreadSaw = LastError();
    MORI_LOG_ERROR(Rdma, "an error of another thread");
  });
  other.join();
  testing::internal::GetCapturedStderr();
  EXPECT_EQ(otherThreadSaw, "");
  EXPECT_NE(std::string(LastError()).find("ShmemFree("), std::string::npos) << LastError();
  EXPECT_NE(std::string(LastError()).find("not a heap block"), std::string::npos) << LastError();
  ClearLastError();
  EXPECT_STREQ(LastError(), "");
}

TEST(Logging, AMalformedLevelFallsBackWithAWarning) {
  test::ScopedEnv level("MORI_LOG_LEVEL", "loud");
  testing::internal::CaptureStderr();
  ReloadLogSettings();
  std::string out = testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find("MORI_LOG_LEVEL='loud'"), std::string::npos) << out;
  EXPECT_TRUE(LogEnabled(LogLevel::Warn, LogSubsys::Core));
  EXPECT_FALSE(LogEnabled(LogLevel::Info, LogSubsys::Core));
}

// Runs body in a child whose stderr is a pipe nobody reads any more; returns the child's wait status.
int StatusOfAChildWritingToABrokenStderr(void (*body)()) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  // The read end goes before the fork: closed only in the parent afterwards, a child that wrote first still found
  // a reader, and its write went into the pipe without a SIGPIPE (the ASan ctest of a29e020, on a loaded machine).
  close(fds[0]);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[1]);
    body();
    _exit(7);
  }
  close(fds[1]);
  int status = -1;
  waitpid(pid, &status, 0);
  return status;
}

TEST(Logging, ALineToAStderrNobodyReadsDoesNotKillTheProcess) {
  // What a rank of a killed mpirun meets: the reader of its stderr is gone. A log line (of any thread) must not
  // end the process by SIGPIPE; nor may the signal stay pending, to strike when the thread unblocks it.
  int status = StatusOfAChildWritingToABrokenStderr([] {
    MORI_LOG_ERROR(Core, "a line nobody reads, %d", 1);
    std::thread other([] { MORI_LOG_ERROR(Proxy, "a line of another thread nobody reads"); });
    other.join();
    MORI_LOG_WARN(Net, "and one more");
  });
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : -1);
  EXPECT_EQ(WEXITSTATUS(status), 7);
}

TEST(Logging, TheApplicationsOwnSigpipeIsUntouched) {
  // mori blocks SIGPIPE only around its own line: the application's write to the same pipe still raises it, and
  // a SIGPIPE that was pending before the line stays pending.
  int status = StatusOfAChildWritingToABrokenStderr([] {
    MORI_LOG_ERROR(Core, "a line nobody reads");
    const char text[] = "the application's own line\n";
    ssize_t ignored = write(STDERR_FILENO, text, sizeof(text) - 1);
    (void)ignored;
    _exit(8);
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child exited with " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  EXPECT_EQ(WTERMSIG(status), SIGPIPE);

  status = StatusOfAChildWritingToABrokenStderr([] {
    sigset_t pipeOnly;
    sigemptyset(&pipeOnly);
    sigaddset(&pipeOnly, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipeOnly, nullptr);
    raise(SIGPIPE);
    MORI_LOG_ERROR(Core, "a line nobody reads, with a SIGPIPE of the application pending");
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    _exit(sigismember(&pending, SIGPIPE) == 1 ? 9 : 10);
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 9) << "the application's pending SIGPIPE was taken";
}

}  // namespace
}  // namespace mori::core
