#include "mori/core/mpi_bootstrap.hpp"

#include <climits>
#include <iterator>
#include <thread>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core {

namespace {

void CheckMpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  MORI_THROW(ErrorCode::RemoteFailure, "%s failed: %s", call, text);
}

int CheckedCount(size_t bytes, const char* op) {
  MORI_CHECK(bytes <= static_cast<size_t>(INT_MAX), ErrorCode::InvalidUsage,
             "MpiBootstrap %s: %zu bytes exceed MPI's int count", op, bytes);
  return static_cast<int>(bytes);
}

}  // namespace

MpiBootstrap::MpiBootstrap(MPI_Comm comm, double timeoutSeconds) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  MORI_CHECK(initialized, ErrorCode::InvalidUsage, "MpiBootstrap needs MPI_Init to have been called");
  timeout_ = timeoutSeconds > 0 ? timeoutSeconds : mori::core::TimeoutSeconds();
  CheckMpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &nRanks_);
  int* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
  if (found && ub != nullptr) tagUpperBound_ = *ub;
  SetLogRank(rank_);
}

MpiBootstrap::~MpiBootstrap() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Sends still in flight belong to receives the peers have yet to post; give them the usual bound.
  Deadline deadline = Deadline::After(timeout_);
  while (!pending_.empty() && !deadline.Expired()) {
    ProgressSends();
    std::this_thread::yield();
  }
  for (auto& p : pending_) {
    MORI_LOG_WARN(Bootstrap, "rank %d: a bootstrap message to rank %d was never received; cancelling it", rank_, p.peer);
    MPI_Cancel(&p.request);
    MPI_Request_free(&p.request);
  }
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiBootstrap::ProgressSends() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    int done = 0;
    CheckMpi(MPI_Test(&it->request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    it = done ? pending_.erase(it) : std::next(it);
  }
}

void MpiBootstrap::Wait(MPI_Request* request, const char* what, int peer) {
  Deadline deadline = Deadline::After(timeout_);
  int done = 0;
  MPI_Status status;
  while (true) {
    ProgressSends();
    CheckMpi(MPI_Test(request, &done, &status), "MPI_Test");
    if (done) return;
    if (deadline.Expired()) {
      if (peer >= 0) {
        throw TimeoutError(StrFormat("rank %d: MPI %s with rank %d did not complete within %.0f s", rank_, what, peer,
                                     timeout_));
      }
      throw TimeoutError(StrFormat("rank %d: MPI %s did not complete within %.0f s (a rank missing from the "
                                   "collective?)",
                                   rank_, what, timeout_));
    }
    std::this_thread::yield();
  }
}

void MpiBootstrap::Send(const void* data, size_t bytes, int peer, int tag) {
  MORI_CHECK(peer >= 0 && peer < nRanks_, ErrorCode::InvalidUsage, "MpiBootstrap Send: rank %d outside [0, %d)", peer,
             nRanks_);
  MORI_CHECK(tag >= 0 && tag <= tagUpperBound_, ErrorCode::InvalidUsage,
             "MpiBootstrap Send: tag %d outside [0, %d] (MPI_TAG_UB)", tag, tagUpperBound_);
  ProgressSends();
  const auto* p = static_cast<const uint8_t*>(data);
  pending_.push_back(PendingSend{MPI_REQUEST_NULL, std::vector<uint8_t>(p, p + bytes), peer});
  PendingSend& s = pending_.back();
  CheckMpi(MPI_Isend(s.data.data(), CheckedCount(bytes, "Send"), MPI_BYTE, peer, tag, comm_, &s.request),
           "MPI_Isend");
}

void MpiBootstrap::Recv(void* data, size_t bytes, int peer, int tag) {
  MORI_CHECK(peer >= 0 && peer < nRanks_, ErrorCode::InvalidUsage, "MpiBootstrap Recv: rank %d outside [0, %d)", peer,
             nRanks_);
  MORI_CHECK(tag >= 0 && tag <= tagUpperBound_, ErrorCode::InvalidUsage,
             "MpiBootstrap Recv: tag %d outside [0, %d] (MPI_TAG_UB)", tag, tagUpperBound_);
  // Probe first, so a size mismatch is reported as such instead of as MPI's truncation error.
  Deadline deadline = Deadline::After(timeout_);
  int flag = 0;
  MPI_Status status;
  while (true) {
    ProgressSends();
    CheckMpi(MPI_Iprobe(peer, tag, comm_, &flag, &status), "MPI_Iprobe");
    if (flag) break;
    if (deadline.Expired()) {
      throw TimeoutError(StrFormat("rank %d waited %.0f s for a message (tag %d) from rank %d, which never came",
                                   rank_, timeout_, tag, peer));
    }
    std::this_thread::yield();
  }
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  MORI_CHECK(static_cast<size_t>(count) == bytes, ErrorCode::InvalidUsage,
             "rank %d: rank %d sent %d bytes (tag %d) where %zu were expected", rank_, peer, count, tag, bytes);
  CheckMpi(MPI_Recv(data, count, MPI_BYTE, peer, tag, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
}

void MpiBootstrap::AllGather(void* allData, size_t bytesPerRank) {
  MPI_Request req;
  CheckMpi(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, allData, CheckedCount(bytesPerRank, "AllGather"), MPI_BYTE,
                          comm_, &req),
           "MPI_Iallgather");
  Wait(&req, "all-gather", -1);
}

void MpiBootstrap::Barrier() {
  MPI_Request req;
  CheckMpi(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
  Wait(&req, "barrier", -1);
}

void MpiBootstrap::Broadcast(void* data, size_t bytes, int root) {
  MORI_CHECK(root >= 0 && root < nRanks_, ErrorCode::InvalidUsage, "MpiBootstrap Broadcast: root %d outside [0, %d)",
             root, nRanks_);
  MPI_Request req;
  CheckMpi(MPI_Ibcast(data, CheckedCount(bytes, "Broadcast"), MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
  Wait(&req, "broadcast", -1);
}

}  // namespace mori::core
