// GpuBuffer allocation on the backend in use, export of ranges for IPC, and the validation of handles.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/ipc_memory.hpp"
#include "proxy_copy.hpp"

namespace mori::core {
namespace {

class GpuBufferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (GpuGetDeviceCount(&n) != kGpuSuccess || n == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }
};

void RoundTrip(GpuBuffer& buf, int seed) {
  std::vector<uint8_t> in(buf.Bytes()), out(buf.Bytes());
  test::FillPattern(in.data(), in.size(), seed);
  ASSERT_EQ(GpuMemcpy(buf.Data(), in.data(), in.size()), kGpuSuccess);
  ASSERT_EQ(GpuMemcpy(out.data(), buf.Data(), out.size()), kGpuSuccess);
  EXPECT_EQ(test::FirstPatternMismatch(out.data(), out.size(), seed), out.size());
}

TEST_F(GpuBufferTest, DeviceAndHostPinnedMemoryHoldData) {
  GpuBuffer dev(3 * 4096 + 17);
  EXPECT_EQ(dev.Type(), MemoryType::Device);
  EXPECT_EQ(dev.Bytes(), 3u * 4096 + 17);
  EXPECT_TRUE(dev.Shareable()) << dev.AllocatorName();
  RoundTrip(dev, 1);
  GpuBuffer pinned(5000, MemoryType::HostPinned);
  EXPECT_EQ(pinned.Type(), MemoryType::HostPinned);
  test::FillPattern(pinned.Data(), pinned.Bytes(), 2);  // host-addressable
  EXPECT_EQ(test::FirstPatternMismatch(pinned.Data(), pinned.Bytes(), 2), pinned.Bytes());
  RoundTrip(pinned, 3);
}

TEST_F(GpuBufferTest, MoveTransfersOwnership) {
  GpuBuffer a(1024);
  void* p = a.Data();
  GpuBuffer b(std::move(a));
  EXPECT_EQ(a.Data(), nullptr);
  EXPECT_EQ(b.Data(), p);
  GpuBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.Data(), p);
  EXPECT_EQ(c.Bytes(), 1024u);
  EXPECT_THROW(GpuBuffer(0), Error);
}

TEST_F(GpuBufferTest, ExportedRangeMapsAgainInThisProcess) {
  GpuBuffer buf(1 << 20);
  UniqueFd fd;
  char* inside = static_cast<char*>(buf.Data()) + 4096;
  IpcMemoryHandle h = ExportIpcMemory(inside, 8192, &fd);
  EXPECT_EQ(h.offset, 4096u);
  EXPECT_EQ(h.bytes, 8192u);
  EXPECT_GE(h.allocationBytes, buf.Bytes());
  auto kind = static_cast<IpcMemoryKind>(h.kind);
  if (kind != IpcMemoryKind::HostMemfd && kind != IpcMemoryKind::CudaVmm) {
    GTEST_SKIP() << IpcMemoryKindName(kind) << " handles cannot be opened by the process that made them";
  }
  ASSERT_TRUE(fd.Valid());
  auto mapping = IpcMemoryMapping::Import(h, std::move(fd));
  ASSERT_NE(mapping->Data(), static_cast<void*>(inside)) << "a second mapping, not the same address";
  std::vector<uint8_t> pattern(8192), back(8192);
  test::FillPattern(pattern.data(), pattern.size(), 11);
  ASSERT_EQ(GpuMemcpy(mapping->Data(), pattern.data(), pattern.size()), kGpuSuccess);  // write through the alias
  ASSERT_EQ(GpuMemcpy(back.data(), inside, back.size()), kGpuSuccess);                 // read through the original
  EXPECT_EQ(test::FirstPatternMismatch(back.data(), back.size(), 11), back.size());
}

TEST_F(GpuBufferTest, ExportRefusesMemoryThatIsNotShareable) {
  int onStack = 0;
  UniqueFd fd;
  EXPECT_THROW(ExportIpcMemory(&onStack, sizeof(onStack), &fd), Error);
  GpuBuffer buf(4096);
  try {
    ExportIpcMemory(static_cast<char*>(buf.Data()) + 100, buf.Bytes() * 1024, &fd);
    FAIL() << "a range past the allocation was exported";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
    EXPECT_NE(std::string(e.what()).find("runs past the end"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ExportIpcMemory(nullptr, 10, &fd), Error);
  EXPECT_THROW(ExportIpcMemory(buf.Data(), 0, &fd), Error);
}

TEST_F(GpuBufferTest, MalformedHandlesAreRefusedWithoutMapping) {
  GpuBuffer buf(1 << 16);
  UniqueFd fd;
  IpcMemoryHandle good = ExportIpcMemory(buf.Data(), buf.Bytes(), &fd);
  bool needsFd = fd.Valid();
  auto expectProtocolError = [&](IpcMemoryHandle h, bool withFd, const char* what) {
    UniqueFd f;
    if (withFd && needsFd) f.Reset(dup(fd.Get()));
    try {
      IpcMemoryMapping::Import(h, std::move(f));
      ADD_FAILURE() << what << ": imported";
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::Protocol) << what << ": " << e.what();
    }
  };
  IpcMemoryHandle h = good;
  h.magic ^= 1;
  expectProtocolError(h, true, "bad magic");
  h = good;
  h.offset = h.allocationBytes;
  expectProtocolError(h, true, "offset at the end");
  h = good;
  h.bytes = h.allocationBytes + 1;
  expectProtocolError(h, true, "bytes beyond the allocation");
  h = good;
  h.kind = 99;
  expectProtocolError(h, needsFd, "unknown kind");
  if (needsFd) expectProtocolError(good, false, "descriptor missing");
}

// Import of `fd` under `h`, expected to fail with a Protocol error whose message holds `cause`.
void ExpectImportRefused(const IpcMemoryHandle& h, UniqueFd fd, const std::string& cause, const char* what) {
  try {
    IpcMemoryMapping::Import(h, std::move(fd));
    ADD_FAILURE() << what << ": imported";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::Protocol) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(cause), std::string::npos) << what << ": " << e.what();
  }
}

// A memfd of `bytes` holding rank 2's pattern, with `seals` added (0: none; -1: sealing not allowed at all).
UniqueFd PatternMemfd(size_t bytes, int seals) {
  UniqueFd fd(memfd_create("mori-test", MFD_CLOEXEC | (seals >= 0 ? MFD_ALLOW_SEALING : 0)));
  EXPECT_TRUE(fd.Valid());
  EXPECT_EQ(ftruncate(fd.Get(), static_cast<off_t>(bytes)), 0);
  std::vector<uint8_t> pattern(bytes);
  test::FillPattern(pattern.data(), bytes, 2);
  EXPECT_EQ(pwrite(fd.Get(), pattern.data(), bytes, 0), static_cast<ssize_t>(bytes));
  if (seals > 0) {
    EXPECT_EQ(fcntl(fd.Get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

// A peer that shrank a shared memfd would make every process that maps it die of SIGBUS at its next access past
// the new end. A GpuBuffer's memfd is sealed against that, and Import refuses a memfd whose size is not sealed
// or that is smaller than the handle claims.
TEST_F(GpuBufferTest, SharedMemfdSizeIsSealedAndImportChecksIt) {
  GpuBuffer buf(3 * 4096);
  UniqueFd fd;
  const IpcMemoryHandle good = ExportIpcMemory(buf.Data(), buf.Bytes(), &fd);
  if (good.kind != static_cast<uint32_t>(IpcMemoryKind::HostMemfd)) {
    GTEST_SKIP() << "exports " << IpcMemoryKindName(static_cast<IpcMemoryKind>(good.kind)) << ", not a memfd";
  }
  ASSERT_TRUE(fd.Valid());
  const size_t bytes = good.allocationBytes;
  test::FillPattern(buf.Data(), bytes, 1);

  constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  EXPECT_EQ(fcntl(fd.Get(), F_GET_SEALS) & kSizeSeals, kSizeSeals);
  errno = 0;
  EXPECT_EQ(ftruncate(fd.Get(), 4096), -1) << "a holder of the descriptor shrank it";
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(ftruncate(fd.Get(), static_cast<off_t>(bytes * 2)), -1) << "a holder of the descriptor grew it";
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(fcntl(fd.Get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1) << "a holder of the descriptor added a seal";
  EXPECT_EQ(errno, EPERM);
  struct stat st;
  ASSERT_EQ(fstat(fd.Get(), &st), 0);
  if (static_cast<size_t>(st.st_size) != bytes) {
    ASSERT_EQ(ftruncate(fd.Get(), static_cast<off_t>(bytes)), 0);  // whole again, so that the checks below can run
  }
  {
    auto mapping = IpcMemoryMapping::Import(good, UniqueFd(dup(fd.Get())));
    EXPECT_EQ(test::FirstPatternMismatch(mapping->Data(), bytes, 1), bytes) << "the import sees every byte";
  }

  // Descriptors of the right size, not sealed: refused, though the memory behind them is fine.
  // (Linux seals a memfd made without MFD_ALLOW_SEALING with F_SEAL_SEAL alone: never against resizing.)
  ExpectImportRefused(good, PatternMemfd(bytes, -1), "is not sealed against resizing (seals 0x1,",
                      "memfd without MFD_ALLOW_SEALING");
  ExpectImportRefused(good, PatternMemfd(bytes, 0), "is not sealed against resizing (seals 0x0",
                      "memfd with no seals");
  ExpectImportRefused(good, PatternMemfd(bytes, F_SEAL_SHRINK | F_SEAL_GROW), "is not sealed against resizing",
                      "memfd whose seals can still change");
  int pipeFds[2];
  ASSERT_EQ(pipe(pipeFds), 0);
  close(pipeFds[1]);
  ExpectImportRefused(good, UniqueFd(pipeFds[0]), "is not a sealable memfd", "a pipe");
  // Sealed, but smaller than the handle says: mapping it whole would SIGBUS past its end.
  ExpectImportRefused(good, PatternMemfd(4096, kSizeSeals),
                      "holds 4096 bytes, the handle claims " + std::to_string(good.allocationBytes),
                      "sealed memfd smaller than claimed");
  // The same sealed memfd of the right size maps, and shows its own contents.
  auto mapping = IpcMemoryMapping::Import(good, PatternMemfd(bytes, kSizeSeals));
  EXPECT_EQ(test::FirstPatternMismatch(mapping->Data(), bytes, 2), bytes);
}

// The copy that proxies make for waiting kernels: it copies, times itself, and a slow one names the cause.
TEST_F(GpuBufferTest, TimedStreamCopyCopiesAndSlowOnesNameTheCause) {
  GpuBuffer device(4096, MemoryType::Device);
  std::vector<uint8_t> pattern(4096), back(4096, 0);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 7 + 3);
  GpuStream stream{};
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  double up = -1, down = -1;
  EXPECT_EQ(TimedStreamCopy(device.Data(), pattern.data(), 4000, stream, &up), kGpuSuccess);
  EXPECT_EQ(TimedStreamCopy(back.data(), device.Data(), 4000, stream, &down), kGpuSuccess);
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.begin() + 4000, back.begin()));
  EXPECT_TRUE(std::all_of(back.begin() + 4000, back.end(), [](uint8_t b) { return b == 0; }));  // nothing past it
  EXPECT_GE(up, 0.0);
  EXPECT_GE(down, 0.0);
  EXPECT_EQ(SlowProxyCopyHint(kSlowProxyCopyS / 2), "");
  const std::string hint = SlowProxyCopyHint(12.25);
  EXPECT_NE(hint.find("took 12.2 s"), std::string::npos) << hint;
  EXPECT_NE(hint.find("cudaFree"), std::string::npos) << hint;
  EXPECT_NE(hint.find("CUDA_DEVICE_MAX_CONNECTIONS="), std::string::npos) << hint;
}

// Waits for copies reuse one event per thread and device, made without timing: many copies in a row each wait
// for their own data (a different pattern each time, read back at once), and another thread has its own event.
TEST_F(GpuBufferTest, CopiesWaitOnOneEventPerThreadAndEachSeesItsOwnData) {
  GpuEvent first = nullptr, again = nullptr, other = nullptr;
  ASSERT_EQ(ThreadWaitEvent(&first), kGpuSuccess);
  ASSERT_EQ(ThreadWaitEvent(&again), kGpuSuccess);
  EXPECT_EQ(first, again);
  std::thread([&] { EXPECT_EQ(ThreadWaitEvent(&other), kGpuSuccess); }).join();
  EXPECT_NE(other, nullptr);
  EXPECT_NE(other, first);
  GpuBuffer device(1024, MemoryType::Device);
  GpuStream stream{};
  ASSERT_EQ(GpuStreamCreate(&stream), kGpuSuccess);
  std::vector<uint8_t> up(1024), back(1024);
  double seconds = 0;
  for (int round = 0; round < 50; ++round) {
    for (size_t i = 0; i < up.size(); ++i) up[i] = static_cast<uint8_t>(i * 13 + round * 7 + 1);
    ASSERT_EQ(TimedStreamCopy(device.Data(), up.data(), up.size(), stream, &seconds), kGpuSuccess);
    ASSERT_EQ(TimedStreamCopy(back.data(), device.Data(), back.size(), stream, &seconds), kGpuSuccess);
    ASSERT_EQ(back, up) << "round " << round;
  }
  EXPECT_EQ(GpuStreamDestroy(stream), kGpuSuccess);
}

// What mori sets CUDA_DEVICE_MAX_CONNECTIONS to at load, and when it warns about it.
TEST(CopyQueues, SetOnlyUnderMpsWhenUnsetAndWarnBelowFour) {
  EXPECT_EQ(CudaConnectionsToSet(nullptr, nullptr, true), std::to_string(kMpsConnections));
  EXPECT_EQ(CudaConnectionsToSet(nullptr, "12", true), "12");
  EXPECT_EQ(CudaConnectionsToSet(nullptr, "0", true), "");      // opted out
  EXPECT_EQ(CudaConnectionsToSet(nullptr, "many", true), "");   // not a number: leave CUDA's default
  EXPECT_EQ(CudaConnectionsToSet(nullptr, "-3", true), "");
  EXPECT_EQ(CudaConnectionsToSet("1", nullptr, true), "");       // the user's value stays, even a low one
  EXPECT_EQ(CudaConnectionsToSet(nullptr, nullptr, false), "");  // no MPS: CUDA's default is 8 already
  EXPECT_EQ(FewCopyQueuesWarning(nullptr), "");
  EXPECT_EQ(FewCopyQueuesWarning("4"), "");
  EXPECT_EQ(FewCopyQueuesWarning("32"), "");
  for (const char* low : {"1", "3", "0", "x"}) {
    const std::string w = FewCopyQueuesWarning(low);
    EXPECT_NE(w.find(std::string("CUDA_DEVICE_MAX_CONNECTIONS=") + low + ":"), std::string::npos) << w;
    EXPECT_NE(w.find("GUIDE"), std::string::npos) << w;
  }
}

// The MPS control daemon is found by its socket in CUDA_MPS_PIPE_DIRECTORY, and nothing else passes for it.
TEST(CopyQueues, MpsDaemonFoundByItsControlSocket) {
  const char* saved = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string keep = saved != nullptr ? saved : "";
  char tmpl[] = "/tmp/mori-mps-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl, control = dir + "/control";
  setenv("CUDA_MPS_PIPE_DIRECTORY", dir.c_str(), 1);
  EXPECT_FALSE(MpsControlRunning());  // empty folder
  FILE* f = std::fopen(control.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_FALSE(MpsControlRunning());  // a plain file is not the daemon
  std::remove(control.c_str());
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", control.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_TRUE(MpsControlRunning());
  close(fd);
  std::remove(control.c_str());
  rmdir(dir.c_str());
  if (saved != nullptr) setenv("CUDA_MPS_PIPE_DIRECTORY", keep.c_str(), 1); else unsetenv("CUDA_MPS_PIPE_DIRECTORY");
}

}  // namespace
}  // namespace mori::core
