#include "service_thread.hpp"

#include <pthread.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <set>

#include "mori/core/config.hpp"
#include "mori/core/format.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"

namespace mori::core {

namespace {

// The sysfs name of a PCI bus id as the GPU runtime prints it ("0000:3B:00.0", or with an 8-digit domain):
// lower case, 4-digit domain.
std::string SysfsPciName(std::string busId) {
  for (char& c : busId) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  size_t colon = busId.find(':');
  if (colon != std::string::npos && colon > 4 && busId.find(':', colon + 1) != std::string::npos) {
    busId = busId.substr(colon - 4);
  }
  return busId;
}

void OnlineCpus(cpu_set_t* cpus) {
  std::ifstream file("/sys/devices/system/cpu/online");
  std::string list;
  if (file && std::getline(file, list) && ParseCpuList(list, cpus)) return;
  CPU_ZERO(cpus);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  for (long c = 0; c < n && c < CPU_SETSIZE; ++c) CPU_SET(static_cast<int>(c), cpus);
}

// Once per process and role: the placement outside the launcher's binding is worth one line at info level.
bool FirstTimeFor(const char* role) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  return seen.insert(role).second;
}

}  // namespace

std::string CpuListText(const cpu_set_t& set) {
  std::string out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    int last = cpu;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    if (!out.empty()) out += ',';
    out += std::to_string(cpu);
    if (last > cpu) out += '-' + std::to_string(last);
    cpu = last;
  }
  return out.empty() ? "none" : out;
}

bool ParseCpuList(const std::string& text, cpu_set_t* set) {
  CPU_ZERO(set);
  size_t i = 0;
  auto number = [&](long* value) {
    size_t start = i;
    long v = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) {
      v = v * 10 + (text[i] - '0');
      if (v >= CPU_SETSIZE) return false;
      ++i;
    }
    *value = v;
    return i > start;
  };
  bool any = false;
  while (i < text.size() && text[i] != '\n') {
    long first = 0, last = 0;
    if (!number(&first)) return false;
    last = first;
    if (i < text.size() && text[i] == '-') {
      ++i;
      if (!number(&last) || last < first) return false;
    }
    for (long c = first; c <= last; ++c) CPU_SET(static_cast<int>(c), set);
    any = true;
    if (i < text.size() && text[i] == ',') ++i;
  }
  return any;
}

bool CpusNearDevice(int device, cpu_set_t* cpus, std::string* why) {
  if (MORI_BACKEND_HOST || device < 0) {
    *why = "no GPU to be near";
    return false;
  }
  char busId[64] = {};
  if (GpuDeviceGetPciBusId(busId, sizeof(busId), device) != kGpuSuccess) {
    (void)GpuGetLastError();
    *why = StrFormat("the PCI bus id of GPU %d is unknown", device);
    return false;
  }
  std::string path = "/sys/bus/pci/devices/" + SysfsPciName(busId) + "/local_cpulist";
  std::ifstream file(path);
  std::string list;
  if (!file || !std::getline(file, list) || !ParseCpuList(list, cpus)) {
    *why = StrFormat("%s (GPU %d) is missing or unreadable", path.c_str(), device);
    return false;
  }
  return true;
}

std::string PlaceServiceThread(const char* role, int device) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  int err = pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed);
  if (err != 0) return "not placed: pthread_getaffinity_np failed: " + ErrnoString(err);
  cpu_set_t near;
  std::string why;
  const bool nearKnown = CpusNearDevice(device, &near, &why);
  if (!nearKnown) OnlineCpus(&near);
  const std::string nearText = nearKnown ? StrFormat("near GPU %d: %s", device, CpuListText(near).c_str())
                                         : StrFormat("%s; online: %s", why.c_str(), CpuListText(near).c_str());
  cpu_set_t chosen;
  std::string reason;
  if (CPU_COUNT(&allowed) == 1) {
    // The launcher bound the process to one CPU: the application's thread is there.
    auto others = [&](const cpu_set_t& from) {
      CPU_ZERO(&chosen);
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &from) && !CPU_ISSET(c, &allowed)) CPU_SET(c, &chosen);
      }
    };
    others(near);
    if (CPU_COUNT(&chosen) == 0 && nearKnown) {
      cpu_set_t online;
      OnlineCpus(&online);
      others(online);
    }
    if (CPU_COUNT(&chosen) == 0) {
      return StrFormat("left on CPU %s, the only one (%s)", CpuListText(allowed).c_str(), nearText.c_str());
    }
    reason = StrFormat("beside this process's binding to CPU %s alone", CpuListText(allowed).c_str());
  } else {
    CPU_AND(&chosen, &near, &allowed);
    if (CPU_COUNT(&chosen) == 0 || CPU_EQUAL(&chosen, &allowed)) {
      return StrFormat("left on CPUs %s (%s)", CpuListText(allowed).c_str(), nearText.c_str());
    }
    reason = StrFormat("of the process's CPUs %s", CpuListText(allowed).c_str());
  }
  err = pthread_setaffinity_np(pthread_self(), sizeof(chosen), &chosen);
  if (err != 0) {
    MORI_LOG_WARN(Core, "mori %s thread: pinning to CPUs %s (%s) failed: %s; it stays on CPUs %s", role,
                  CpuListText(chosen).c_str(), reason.c_str(), ErrnoString(err).c_str(), CpuListText(allowed).c_str());
    return "not placed: pthread_setaffinity_np failed: " + ErrnoString(err);
  }
  std::string done = StrFormat("on CPUs %s, %s (%s)", CpuListText(chosen).c_str(), reason.c_str(), nearText.c_str());
  if (CPU_COUNT(&allowed) == 1 && FirstTimeFor(role)) {
    MORI_LOG_INFO(Core,
                  "mori %s threads run %s: a thread of the application spinning on that CPU (in "
                  "cudaDeviceSynchronize, say) would leave them almost none of it (mpirun binds each rank to a "
                  "core when it starts 2 or fewer; --bind-to none, or several CPUs per rank, keeps them inside "
                  "the binding)",
                  role, done.c_str());
  } else {
    MORI_LOG_DEBUG(Core, "mori %s thread %s", role, done.c_str());
  }
  return done;
}

void NameThisThread(const char* role, int index) {
#if defined(__linux__)
  char name[40];
  if (index >= 0) {
    std::snprintf(name, sizeof(name), "mori-%.20s:%d", role, index);
  } else {
    std::snprintf(name, sizeof(name), "mori-%.20s", role);
  }
  name[15] = '\0';  // the kernel's limit; pthread_setname_np refuses a longer name
  (void)pthread_setname_np(pthread_self(), name);
#else
  (void)role;
  (void)index;
#endif
}

void BecomeServiceThread(const char* role, int index, int device) {
  NameThisThread(role, index);
  (void)PlaceServiceThread(role, device);
}

}  // namespace mori::core
