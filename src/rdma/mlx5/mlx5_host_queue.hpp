// Posting to and polling mlx5 queues from a host thread, with the work-request ids verbs users expect.
// Used where the host drives mlx5-format queues itself: the emulated NIC, and DirectVerbs endpoints.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>

#include "mori/rdma/rdma.hpp"

namespace mori::rdma {

class Mlx5HostQueues {
 public:
  void Post(RdmaEndpoint& ep, const HostWorkRequest& wr);
  void PostRecv(RdmaEndpoint& ep, uintptr_t laddr, uint32_t lkey, size_t bytes, uint64_t wrId);
  int Poll(RdmaEndpoint& ep, HostCompletion* out, int maxCompletions);
  void Forget(uint32_t qpn);

 private:
  // (slot, wr id) in posting order: completions come in the same order, so the front is the oldest.
  struct Ids {
    std::deque<std::pair<uint32_t, uint64_t>> send;
    std::deque<std::pair<uint32_t, uint64_t>> recv;
  };
  std::mutex mutex_;
  std::map<uint32_t, Ids> ids_;  // by QP number
};

}  // namespace mori::rdma
