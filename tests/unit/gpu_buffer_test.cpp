// GpuBuffer allocation on the backend in use, export of ranges for IPC, and the validation of handles.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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
