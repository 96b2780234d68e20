// Bootstrap over an MPI communicator, for programs launched with mpirun that use MPI themselves.
// Available when mori was built with MPI (MORI_HAS_MPI in mori/core/config.hpp).
#pragma once

#include "mori/core/config.hpp"

#if MORI_HAS_MPI

#include <mpi.h>

#include <list>
#include <vector>

#include "mori/core/bootstrap.hpp"

namespace mori::core {

// Every operation is bounded by MORI_TIMEOUT_S (or `timeoutSeconds`): requests are polled, not waited on,
// so a rank that never arrives raises a TimeoutError naming it instead of hanging in MPI.
class MpiBootstrap : public Bootstrap {
 public:
  explicit MpiBootstrap(MPI_Comm comm, double timeoutSeconds = 0);
  ~MpiBootstrap() override;
  MpiBootstrap(const MpiBootstrap&) = delete;
  MpiBootstrap& operator=(const MpiBootstrap&) = delete;

  int GetRank() const override { return rank_; }
  int GetNranks() const override { return nRanks_; }
  void Send(const void* data, size_t bytes, int peer, int tag) override;
  void Recv(void* data, size_t bytes, int peer, int tag) override;
  void AllGather(void* allData, size_t bytesPerRank) override;
  void Barrier() override;
  void Broadcast(void* data, size_t bytes, int root) override;

 private:
  // A send whose receiver may not have posted its receive yet: the data is copied and the request
  // completes in the background, so Send never waits for the peer (as with the socket bootstrap).
  struct PendingSend {
    MPI_Request request;
    std::vector<uint8_t> data;
    int peer;
  };

  void Wait(MPI_Request* request, const char* what, int peer);
  void ProgressSends();

  std::list<PendingSend> pending_;

  MPI_Comm comm_ = MPI_COMM_NULL;  // a duplicate: our tags never meet the application's
  int rank_ = 0;
  int nRanks_ = 0;
  int tagUpperBound_ = 32767;
  double timeout_ = 0;
};

}  // namespace mori::core

#endif  // MORI_HAS_MPI
