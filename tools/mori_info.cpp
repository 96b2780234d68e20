// mori-info: what this machine offers and what mori would use: backend, GPUs and their peer access,
// RDMA devices, network interfaces, the launch environment, and every MORI_* variable with its value.
#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/config.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/host_topology.hpp"
#include "mori/core/launch.hpp"
#include "mori/rdma/rdma.hpp"
#include "socket.hpp"
#if MORI_BACKEND_CUDA
#include "cuda/cuda_driver.hpp"
#endif

namespace {

void Section(const char* title) { std::printf("\n%s\n", title); }

void PrintBuild() {
  std::printf("mori %s, backend %s, MPI %s\n", MORI_VERSION_STRING, MORI_BACKEND_NAME,
              MORI_HAS_MPI ? "yes" : "no");
  std::printf("host identity: %s\n", mori::core::HostIdentityText().c_str());
}

void PrintGpus() {
  Section("GPUs");
  int n = 0;
  mori::core::GpuStatus s = mori::core::GpuGetDeviceCount(&n);
  if (s != mori::core::kGpuSuccess || n == 0) {
    std::printf("  none visible (%s)\n", s == mori::core::kGpuSuccess ? "count is 0" : mori::core::GpuGetErrorString(s));
    return;
  }
  for (int d = 0; d < n; ++d) {
    char name[256] = "?";
    char bus[64] = "?";
    (void)mori::core::GpuDeviceGetName(name, sizeof(name), d);
    (void)mori::core::GpuDeviceGetPciBusId(bus, sizeof(bus), d);
    std::printf("  %d: %s [%s]", d, name, bus);
#if MORI_BACKEND_CUDA
    std::printf(", memory sharing: %s", mori::core::cuda::VmmFdSupported(d) ? "VMM file descriptors" : "legacy IPC handles");
#endif
    std::printf("\n");
  }
  if (n > 1) {
    std::printf("  peer access (row can map column):\n      ");
    for (int c = 0; c < n; ++c) std::printf("%4d", c);
    std::printf("\n");
    for (int r = 0; r < n; ++r) {
      std::printf("  %4d", r);
      for (int c = 0; c < n; ++c) {
        int can = 0;
        if (r != c) (void)mori::core::GpuDeviceCanAccessPeer(&can, r, c);
        std::printf("%4s", r == c ? "-" : (can ? "yes" : "no"));
      }
      std::printf("\n");
    }
  }
}

void PrintRdma() {
  Section("RDMA devices");
  DIR* dir = opendir("/sys/class/infiniband");
  int count = 0;
  if (dir != nullptr) {
    while (dirent* e = readdir(dir)) count += e->d_name[0] != '.';
    closedir(dir);
  }
  std::printf("  /sys/class/infiniband: %d device(s)\n", count);
  for (auto backend : {mori::rdma::RdmaBackendType::DirectVerbs, mori::rdma::RdmaBackendType::IBVerbs,
                       mori::rdma::RdmaBackendType::Emulated}) {
    try {
      mori::rdma::RdmaContext context(backend);
      auto ports = mori::rdma::GetActiveDevicePortList(context.GetRdmaDeviceList());
      std::printf("  %-12s %zu device(s)", mori::rdma::RdmaBackendName(backend), context.GetRdmaDeviceList().size());
      for (const auto& [device, port] : ports) std::printf(", %s port %u", device->Name().c_str(), port);
      std::printf("\n");
    } catch (const mori::core::Error& e) {
      std::printf("  %-12s error: %s\n", mori::rdma::RdmaBackendName(backend), e.what());
    }
  }
  try {
    std::printf("  GPU-initiated transfers would use: %s\n",
                mori::rdma::RdmaBackendName(mori::rdma::RdmaBackendFromEnvironment()));
  } catch (const mori::core::Error& e) {
    std::printf("  MORI_RDMA_BACKEND: %s\n", e.what());
  }
}

void PrintNetwork() {
  Section("Network interfaces (up)");
  try {
    for (const auto& i : mori::core::net::ListInterfaceAddresses()) {
      std::printf("  %-12s %s%s\n", i.name.c_str(), i.address.HostString().c_str(), i.loopback ? " (loopback)" : "");
    }
    std::printf("  bootstrap would listen on %s\n", mori::core::net::PickLocalAddress().HostString().c_str());
  } catch (const mori::core::Error& e) {
    std::printf("  error: %s\n", e.what());
  }
}

void PrintLaunch() {
  Section("Launch environment");
  try {
    std::printf("  %s\n", mori::core::DetectLaunchEnvironment().Describe().c_str());
  } catch (const mori::core::Error& e) {
    std::printf("  invalid: %s\n", e.what());
  }
}

void PrintEnv() {
  Section("Environment variables (MORI_*)");
  for (const auto& info : mori::core::EnvRegistry()) {
    auto raw = mori::core::EnvRaw(info.name);
    std::string value = raw ? *raw : std::string("(unset, default ") + (info.defaultValue[0] ? info.defaultValue : "none") + ")";
    if (raw && info.secret) value = "(set, not shown)";
    std::printf("  %-22s = %s\n      %s\n", info.name, value.c_str(), info.meaning);
  }
  for (const auto& name : mori::core::UnknownMoriEnvVars()) {
    std::printf("  %-22s : not a mori variable (typo?)\n", name.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: mori-info\nPrints the backend, GPUs, RDMA devices, network interfaces, launch environment\n"
                  "and every MORI_* environment variable with its value and meaning.\n");
      return 0;
    }
    std::fprintf(stderr, "mori-info: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  PrintBuild();
  PrintGpus();
  PrintRdma();
  PrintNetwork();
  PrintLaunch();
  PrintEnv();
  return 0;
}
