// RDMA connections of the channel layer between forked processes over the Emulated transport (IB0 too, which
// is the emulated NIC where no real one exists): writes and reads of odd sizes at unaligned offsets with guard
// bytes, UpdateAndSync ordered after writes, atomics from both ranks on one word, loopback connections, a
// peer that dies, and wrong arguments.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/test_util.hpp"
#include "mori/core/bootstrap.hpp"
#include "mori/channels/communicator.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/timeout.hpp"
#include "mori/rdma/emulated.hpp"

namespace mori::core {
namespace {

using test::FillPattern;
using test::PatternByte;

EndpointConfig Config(Transport t) {
  EndpointConfig c;
  c.transport = t;
  return c;
}

using test::LoopbackRoot;

void SelectGpu(int rank) {
  int n = 0;
  MORI_CHECK_GPU(GpuGetDeviceCount(&n));
  MORI_CHECK(n > 0, ErrorCode::NotSupported, "no GPU");
  MORI_CHECK_GPU(GpuSetDevice(rank % n));
}

// A bootstrap and a communicator in one forked rank.
struct Rank {
  std::shared_ptr<SocketBootstrap> bootstrap;
  std::unique_ptr<Communicator> comm;
  Rank(int rank, int n, const std::string& root) {
    bootstrap = std::make_shared<SocketBootstrap>(rank, n);
    bootstrap->Initialize(root, 60);
    SelectGpu(rank);
    comm = std::make_unique<Communicator>(bootstrap);
  }
};

// Device memory whose bytes are the pattern of (owner, seed).
struct Patterned {
  GpuBuffer buffer;
  Patterned(size_t bytes, int owner, uint32_t seed) : buffer(bytes) {
    std::vector<uint8_t> host(bytes);
    FillPattern(host.data(), bytes, owner, seed);
    MORI_CHECK_GPU(GpuMemcpy(buffer.Data(), host.data(), bytes));
    MORI_CHECK_GPU(GpuDeviceSynchronize());  // landed before a NIC may write (pageable copies return early)
  }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> host(buffer.Bytes());
    MORI_CHECK_GPU(GpuMemcpy(host.data(), buffer.Data(), host.size()));
    return host;
  }
};

uint64_t ReadWord(const void* deviceWord) {
  uint64_t v = 0;
  MORI_CHECK_GPU(GpuMemcpy(&v, deviceWord, sizeof(v)));
  return v;
}

// Bounded wait for a device word to reach `value` (written by the peer's NIC). Every second, `conn` (when
// given) is flushed briefly, so that a failed work request of ours shows up as its error, not as a timeout.
void WaitWord(const void* deviceWord, uint64_t value, const char* what, Connection* conn = nullptr) {
  Deadline deadline = Deadline::After(60);
  auto nextCheck = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (ReadWord(deviceWord) < value) {
    MORI_CHECK(!deadline.Expired(), ErrorCode::Timeout, "waited 60 s for %s to reach %llu", what,
               static_cast<unsigned long long>(value));
    if (conn != nullptr && std::chrono::steady_clock::now() > nextCheck) {
      nextCheck += std::chrono::seconds(1);
      try {
        conn->Flush(1000);
      } catch (const TimeoutError&) {
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// The error `fn` throws, with its code and a piece of its message checked.
template <typename Fn>
void ExpectError(Fn&& fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error (expected " << ErrorCodeName(code) << " about \"" << needle << "\")";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

struct Piece {
  uint64_t srcOffset, dstOffset, bytes;
};
// Odd sizes at unaligned offsets, one of them larger than a chunk of the emulated NIC's wire.
const std::vector<Piece> kPieces = {{1, 3, 1}, {7, 101, 4095}, {5003, 9001, 65537}, {70001, 80011, 3}, {0, 90000, 17}};
constexpr size_t kSrcBytes = 100003;
constexpr size_t kDstBytes = 110011;

// What dst of `owner` holds after `writer`'s pieces landed in its guard pattern.
std::vector<uint8_t> ExpectedDst(int owner, int writer) {
  std::vector<uint8_t> want(kDstBytes);
  FillPattern(want.data(), kDstBytes, 100 + owner, 2);
  for (const Piece& p : kPieces) {
    for (uint64_t k = 0; k < p.bytes; ++k) want[p.dstOffset + k] = PatternByte(writer, p.srcOffset + k, 1);
  }
  return want;
}

void ExpectBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << ": first wrong byte at " << i << " (got " << int(got[i]) << ", want " << int(want[i])
                    << ")";
      return;
    }
  }
}

class RdmaConnectionMp : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    if (test::ProbeGpuCount() == 0) GTEST_SKIP() << "no GPU visible to the " MORI_BACKEND_NAME " backend";
  }
};

TEST_P(RdmaConnectionMp, WritesAndReadsOddPiecesAndSignalsAfterThem) {
  const Transport t = GetParam();
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    const int peer = 1 - rank;
    Patterned src(kSrcBytes, rank, 1), dst(kDstBytes, 100 + rank, 2), flag(8, 0, 0), readBack(kSrcBytes + 64, 50, 3);
    MORI_CHECK_GPU(GpuMemset(flag.buffer.Data(), 0, 8));
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    RegisteredMemory srcMem = r.comm->RegisterMemory(src.buffer.Data(), kSrcBytes, t);
    RegisteredMemory dstMem = r.comm->RegisterMemory(dst.buffer.Data(), kDstBytes, t);
    RegisteredMemory flagMem = r.comm->RegisterMemory(flag.buffer.Data(), 8, t);
    RegisteredMemory readMem = r.comm->RegisterMemory(readBack.buffer.Data(), readBack.buffer.Bytes(), t);
    r.comm->SendMemory(dstMem, peer, 1);
    r.comm->SendMemory(flagMem, peer, 2);
    r.comm->SendMemory(srcMem, peer, 3);
    auto conn = r.comm->Connect(Config(t), peer).get();
    RegisteredMemory peerDst = r.comm->RecvMemory(peer, 1).get();
    RegisteredMemory peerFlag = r.comm->RecvMemory(peer, 2).get();
    RegisteredMemory peerSrc = r.comm->RecvMemory(peer, 3).get();
    EXPECT_EQ(conn->GetTransport(), t);
    EXPECT_EQ(conn->RemoteRank(), peer);
    EXPECT_EQ(peerDst.Rank(), peer);
    EXPECT_EQ(peerDst.Size(), kDstBytes);

    uint64_t local = 0;
    for (const Piece& p : kPieces) conn->Write(peerDst, p.dstOffset, srcMem, p.srcOffset, p.bytes);
    conn->UpdateAndSync(peerFlag, 0, &local, 1);  // no flush in between: ordered after the writes anyway
    EXPECT_EQ(local, 1u);
    // The peer's signal says its writes have landed here.
    WaitWord(flag.buffer.Data(), 1, "the peer's signal", conn.get());
    ExpectBytes(dst.Read(), ExpectedDst(rank, peer), "dst after the peer's writes");

    // Reads of the peer's source at unaligned places, into the middle of a guarded buffer.
    conn->Read(readMem, 5, peerSrc, 33, 40000);
    conn->Read(readMem, 40005, peerSrc, kSrcBytes - 77, 77);
    conn->Flush();
    std::vector<uint8_t> want(readBack.buffer.Bytes());
    FillPattern(want.data(), want.size(), 50, 3);
    for (uint64_t k = 0; k < 40000; ++k) want[5 + k] = PatternByte(peer, 33 + k, 1);
    for (uint64_t k = 0; k < 77; ++k) want[40005 + k] = PatternByte(peer, kSrcBytes - 77 + k, 1);
    ExpectBytes(readBack.Read(), want, "what the reads brought");
    r.bootstrap->Barrier();  // nobody tears down while the peer still reads
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// Both ranks add to rank 0's counter at once: rank 0 through a loopback connection (so that its atomics are
// atomic with the NIC's), rank 1 through its connection to rank 0. Then both increment a second word by
// compare-and-swap loops.
TEST_P(RdmaConnectionMp, AtomicsFromBothRanksOnOneWordCountExactly) {
  const Transport t = GetParam();
  const std::string root = LoopbackRoot();
  constexpr int kAdds = 500;
  constexpr int kSwaps = 150;
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    GpuBuffer words(64);
    MORI_CHECK_GPU(GpuMemset(words.Data(), 0, 64));
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    RegisteredMemory wordsMem = r.comm->RegisterMemory(words.Data(), 64, t);
    if (rank == 0) r.comm->SendMemory(wordsMem, 1);
    std::shared_ptr<Connection> conn;
    RegisteredMemory target;
    if (rank == 0) {
      conn = r.comm->Connect(Config(t), 0).get();  // loopback
      r.comm->SendMemory(wordsMem, 0);
      target = r.comm->RecvMemory(0).get();
      EXPECT_TRUE(target.IsLocal());
    } else {
      conn = r.comm->Connect(Config(t), 0, 5).get();
      target = r.comm->RecvMemory(0).get();
    }
    std::shared_ptr<Connection> partner;  // rank 1's end needs one on rank 0, alive until rank 1 is done
    if (rank == 0) partner = r.comm->Connect(Config(t), 1, 5).get();
    r.bootstrap->Barrier();

    const uint64_t add = static_cast<uint64_t>(rank) + 1;
    std::vector<uint64_t> olds(kAdds, ~0ull);
    for (int i = 0; i < kAdds; ++i) conn->AtomicFetchAdd(target, 8, add, &olds[static_cast<size_t>(i)]);
    conn->Flush();
    for (int i = 1; i < kAdds; ++i) {
      if (olds[static_cast<size_t>(i)] <= olds[static_cast<size_t>(i - 1)]) {
        ADD_FAILURE() << "fetch-add " << i << " of rank " << rank << " saw " << olds[static_cast<size_t>(i)]
                      << " after " << olds[static_cast<size_t>(i - 1)];
        return 1;
      }
    }
    int swapped = 0, tries = 0;
    uint64_t seen = 0;
    while (swapped < kSwaps) {
      uint64_t old = ~0ull;
      conn->AtomicCompareSwap(target, 16, seen, seen + 1, &old);
      conn->Flush();
      if (old == seen) ++swapped;
      seen = old == seen ? seen + 1 : old;
      if (++tries > 1000000) {
        ADD_FAILURE() << "compare-and-swap never wins";
        return 1;
      }
    }
    r.bootstrap->Barrier();
    if (rank == 0) {
      EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 8), uint64_t{kAdds} * (1 + 2));
      EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 16), uint64_t{2 * kSwaps});
      EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 0), 0u) << "the word before was touched";
      EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 24), 0u) << "the word after was touched";
    }
    r.bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// One process alone: its own memory through the NIC, and a semaphore over the loopback connection.
TEST_P(RdmaConnectionMp, LoopbackWritesReadsAtomicsAndSemaphore) {
  const Transport t = GetParam();
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(1, [&](int rank) {
    Rank r(rank, 1, root);
    Patterned src(kSrcBytes, 0, 1), dst(kDstBytes, 100, 2), readBack(kSrcBytes + 64, 50, 3);
    GpuBuffer words(32);
    MORI_CHECK_GPU(GpuMemset(words.Data(), 0, 32));
    MORI_CHECK_GPU(GpuDeviceSynchronize());
    RegisteredMemory srcMem = r.comm->RegisterMemory(src.buffer.Data(), kSrcBytes, t);
    RegisteredMemory dstMem = r.comm->RegisterMemory(dst.buffer.Data(), kDstBytes, t);
    RegisteredMemory readMem = r.comm->RegisterMemory(readBack.buffer.Data(), readBack.buffer.Bytes(), t);
    RegisteredMemory wordsMem = r.comm->RegisterMemory(words.Data(), 32, t);
    auto conn = r.comm->Connect(Config(t), 0).get();
    EXPECT_EQ(conn->RemoteRank(), 0);
    EXPECT_NE(conn->Describe().find("loopback"), std::string::npos) << conn->Describe();

    for (const Piece& p : kPieces) conn->Write(dstMem, p.dstOffset, srcMem, p.srcOffset, p.bytes);
    uint64_t local = 0;
    conn->UpdateAndSync(wordsMem, 24, &local, 42);
    conn->Read(readMem, 5, srcMem, 33, 40000);
    uint64_t old1 = ~0ull, old2 = ~0ull, old3 = ~0ull;
    conn->AtomicFetchAdd(wordsMem, 0, 5, &old1);
    conn->AtomicFetchAdd(wordsMem, 0, 7, &old2);
    conn->AtomicCompareSwap(wordsMem, 8, 0, 99, &old3);
    conn->Flush();
    ExpectBytes(dst.Read(), ExpectedDst(0, 0), "dst after loopback writes");
    std::vector<uint8_t> want(readBack.buffer.Bytes());
    FillPattern(want.data(), want.size(), 50, 3);
    for (uint64_t k = 0; k < 40000; ++k) want[5 + k] = PatternByte(0, 33 + k, 1);
    ExpectBytes(readBack.Read(), want, "what the loopback read brought");
    EXPECT_EQ(old1, 0u);
    EXPECT_EQ(old2, 5u);
    EXPECT_EQ(old3, 0u);
    EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 0), 12u);
    EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 8), 99u);
    EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 16), 0u);
    EXPECT_EQ(ReadWord(words.DataAs<uint8_t>() + 24), 42u);

    // A semaphore to self: its signals raise its own token.
    auto sem = r.comm->BuildSemaphore(conn, 0).get();
    EXPECT_FALSE(sem->Poll());
    sem->Signal();
    sem->Signal();
    conn->Flush();
    sem->Wait();
    EXPECT_TRUE(sem->Poll());
    EXPECT_FALSE(sem->Poll());
    ExpectError([&] { sem->Wait(20000); }, ErrorCode::Timeout, "signal #3 from rank 0");

    // Two more, taken in the other order: each keeps its own token.
    auto first = r.comm->BuildSemaphore(conn, 0, 7);
    auto second = r.comm->BuildSemaphore(conn, 0, 7);
    std::shared_ptr<Semaphore> b = second.get(), a = first.get();
    a->Signal();
    conn->Flush();
    EXPECT_FALSE(b->Poll()) << "a signal of one loopback semaphore raised another";
    EXPECT_TRUE(a->Poll());

    // Loopback reaches only this process's memory.
    ExpectError([&] { conn->Write(dstMem, kDstBytes - 2, srcMem, 0, 3); }, ErrorCode::InvalidUsage, "outside");
    ExpectError([&] { (void)r.comm->Connect(Config(Transport::CudaIpc), 0).get(); }, ErrorCode::InvalidUsage,
                "CudaIpc to itself");
    ExpectError([&] { (void)r.comm->RecvMemory(0, 9).get(); }, ErrorCode::InvalidUsage, "nothing was sent to self");
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_P(RdmaConnectionMp, WrongArgumentsAreClearErrors) {
  const Transport t = GetParam();
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    const int peer = 1 - rank;
    GpuBuffer a(4099), tcpOnly(256);
    RegisteredMemory aMem = r.comm->RegisterMemory(a.Data(), a.Bytes(), t);
    RegisteredMemory tcpMem = r.comm->RegisterMemory(tcpOnly.Data(), tcpOnly.Bytes(), Transport::Tcp);
    r.comm->SendMemory(aMem, peer);
    r.comm->SendMemory(tcpMem, peer);
    auto conn = r.comm->Connect(Config(t), peer).get();
    RegisteredMemory peerA = r.comm->RecvMemory(peer).get();
    RegisteredMemory peerTcp = r.comm->RecvMemory(peer).get();

    ExpectError([&] { conn->Write(peerA, 4096, aMem, 0, 4); }, ErrorCode::InvalidUsage,
                "outside the Write destination");
    ExpectError([&] { conn->Write(peerA, 0, aMem, 4000, 100); }, ErrorCode::InvalidUsage, "outside the Write source");
    ExpectError([&] { conn->Write(peerA, ~0ull - 1, aMem, 0, 4); }, ErrorCode::InvalidUsage, "outside");
    ExpectError([&] { conn->Read(aMem, 0, peerA, 4099, 1); }, ErrorCode::InvalidUsage, "outside the Read source");
    ExpectError([&] { conn->Write(peerA, 0, tcpMem, 0, 8); }, ErrorCode::InvalidUsage, "is not registered for");
    ExpectError([&] { conn->Write(peerTcp, 0, aMem, 0, 8); }, ErrorCode::InvalidUsage, "there is no key for it");
    ExpectError([&] { conn->Write(aMem, 0, aMem, 8, 8); }, ErrorCode::InvalidUsage, "not local memory");
    ExpectError([&] { conn->Write(peerA, 0, peerA, 8, 8); }, ErrorCode::InvalidUsage, "registered in this process");
    ExpectError([&] { conn->Write(RegisteredMemory(), 0, aMem, 0, 8); }, ErrorCode::InvalidUsage, "empty");
    ExpectError([&] { conn->AtomicFetchAdd(peerA, 4, 1, nullptr); }, ErrorCode::InvalidUsage, "not 8-byte aligned");
    ExpectError([&] { conn->AtomicCompareSwap(peerA, 4096, 0, 1, nullptr); }, ErrorCode::InvalidUsage, "outside");
    ExpectError([&] { conn->UpdateAndSync(peerA, 0, nullptr, 1); }, ErrorCode::InvalidUsage, "null");
    // Nothing wrong was posted: the connection still works.
    conn->Write(peerA, 1, aMem, 2, 1000);
    conn->Flush();
    r.bootstrap->Barrier();
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

TEST_P(RdmaConnectionMp, FlushFailsClearlyAfterThePeerDied) {
  const Transport t = GetParam();
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    const int peer = 1 - rank;
    GpuBuffer a(4096);
    RegisteredMemory aMem = r.comm->RegisterMemory(a.Data(), a.Bytes(), t);
    r.comm->SendMemory(aMem, peer);
    auto conn = r.comm->Connect(Config(t), peer).get();
    RegisteredMemory peerA = r.comm->RecvMemory(peer).get();
    conn->Write(peerA, 0, aMem, 0, 4096);
    conn->Flush();
    r.bootstrap->Barrier();
    if (rank == 1) test::DieAbruptly(0);  // gone without a word: its NIC goes with it
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    bool failed = false;
    for (int i = 0; i < 1000 && !failed; ++i) {
      try {
        conn->Write(peerA, 0, aMem, 0, 4096);
        conn->Flush();
      } catch (const Error& e) {
        failed = true;
        EXPECT_EQ(e.Code(), ErrorCode::Rdma) << e.what();
        EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("unusable"), std::string::npos) << e.what();
      }
    }
    EXPECT_TRUE(failed) << "writes to a dead peer kept succeeding";
    // The connection stays failed, and says so again at once.
    ExpectError([&] { conn->Flush(); }, ErrorCode::Rdma, "rank 1");
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

// A survivor that has nothing in flight to the dead peer (it waits on another PE, say) still learns at once that
// the peer's NIC went, and by name: the record a failing process lists at exit, so that it names the first death
// and not only the PE it was waiting on.
TEST_P(RdmaConnectionMp, APeerWhoseNicVanishesIsRecordedByNameWithNothingInFlight) {
  if (GetParam() != Transport::Emulated) GTEST_SKIP() << "the record is the emulated NIC's";
  const std::string root = LoopbackRoot();
  auto outcomes = test::RunProcesses(2, [&](int rank) {
    Rank r(rank, 2, root);
    const int peer = 1 - rank;
    GpuBuffer a(4096);
    RegisteredMemory aMem = r.comm->RegisterMemory(a.Data(), a.Bytes(), Transport::Emulated);
    r.comm->SendMemory(aMem, peer);
    auto conn = r.comm->Connect(Config(Transport::Emulated), peer).get();
    RegisteredMemory peerA = r.comm->RecvMemory(peer).get();
    conn->Write(peerA, 0, aMem, 0, 4096);  // both wire connections open
    conn->Flush();
    r.bootstrap->Barrier();
    EXPECT_TRUE(rdma::EmulatedNicPeerLosses().empty());
    if (rank == 1) test::DieAbruptly(0);
    const Deadline deadline = Deadline::After(10);
    std::vector<rdma::EmulatedPeerLoss> losses;
    while (losses.empty() && !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      losses = rdma::EmulatedNicPeerLosses();
    }
    EXPECT_EQ(losses.size(), 1u) << "the peer's death was not recorded within 10 s";
    if (!losses.empty()) {
      EXPECT_EQ(losses[0].name, "rank 1");
      EXPECT_NE(losses[0].reason.find("closed"), std::string::npos) << losses[0].reason;
      EXPECT_GE(losses[0].secondsAgo, 0.0);
      EXPECT_LT(losses[0].secondsAgo, 10.0);
    }
    return 0;
  });
  test::ExpectAllSucceed(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Transports, RdmaConnectionMp, ::testing::Values(Transport::Emulated, Transport::IB0),
                         [](const ::testing::TestParamInfo<Transport>& info) {
                           return std::string(TransportName(info.param));
                         });

}  // namespace
}  // namespace mori::core
