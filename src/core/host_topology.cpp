#include "mori/core/host_topology.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>

#include "mori/core/format.hpp"

namespace mori::core {

namespace {

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string NetNamespace() {
  char buf[128];
  ssize_t n = readlink("/proc/self/ns/net", buf, sizeof(buf) - 1);
  if (n <= 0) return "net:?";
  buf[n] = '\0';
  return buf;
}

std::string HostName() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

std::string HostIdentityText() {
  return StrFormat("host %s, boot %s, %s", HostName().c_str(),
                   ReadFirstLine("/proc/sys/kernel/random/boot_id").c_str(), NetNamespace().c_str());
}

uint64_t ProcessToken() {
  static const uint64_t token = [] {
    std::random_device source;  // the kernel's random source (getrandom) on Linux
    uint64_t t = 0;
    while (t == 0) t = (static_cast<uint64_t>(source()) << 32) ^ source();
    return t;
  }();
  return token;
}

uint64_t HostIdentity() {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : HostIdentityText()) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

HostTopology DiscoverHostTopology(Bootstrap& bootstrap) {
  HostTopology t;
  t.rank = bootstrap.GetRank();
  t.nRanks = bootstrap.GetNranks();
  t.hostIds = bootstrap.AllGatherValue(HostIdentity());
  std::vector<uint64_t> hostsInOrder;
  for (int r = 0; r < t.nRanks; ++r) {
    uint64_t id = t.hostIds[static_cast<size_t>(r)];
    if (std::find(hostsInOrder.begin(), hostsInOrder.end(), id) == hostsInOrder.end()) hostsInOrder.push_back(id);
    if (id == t.hostIds[static_cast<size_t>(t.rank)]) {
      if (r == t.rank) t.localRank = static_cast<int>(t.localRanks.size());
      t.localRanks.push_back(r);
    }
  }
  t.localSize = static_cast<int>(t.localRanks.size());
  t.numHosts = static_cast<int>(hostsInOrder.size());
  t.hostIndex = static_cast<int>(std::find(hostsInOrder.begin(), hostsInOrder.end(), t.hostIds[static_cast<size_t>(t.rank)]) -
                                 hostsInOrder.begin());
  return t;
}

}  // namespace mori::core
