// Which ranks share a host, so that they can share memory directly. A "host" is one kernel instance and
// one network namespace: processes in different namespaces are treated as different hosts, which is how
// the tests build several hosts on one machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"

namespace mori::core {

// Hash of the host name, the kernel boot id and the network namespace of this process.
uint64_t HostIdentity();
// The same facts in readable form, for logs and mori-info.
std::string HostIdentityText();
// 64 random bits drawn once per process (never 0): what says "made in this very process" where host facts and
// a pid do not (two containers sharing the host's network and boot id can each have a process of the same
// pid). A forked child keeps its parent's token, and its pid tells it apart.
uint64_t ProcessToken();

struct HostTopology {
  int rank = 0;
  int nRanks = 1;
  int localRank = 0;            // index of this rank among the ranks of its host
  int localSize = 1;
  int hostIndex = 0;            // hosts numbered in order of their lowest rank
  int numHosts = 1;
  std::vector<uint64_t> hostIds;  // per rank
  std::vector<int> localRanks;    // world ranks on this host, ascending

  bool SameHost(int peer) const { return hostIds.at(static_cast<size_t>(peer)) == hostIds.at(static_cast<size_t>(rank)); }
};

// Collective over the bootstrap.
HostTopology DiscoverHostTopology(Bootstrap& bootstrap);

}  // namespace mori::core
