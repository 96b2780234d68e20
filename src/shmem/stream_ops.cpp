// Host calls ordered with the caller's work on a stream: each launches a small kernel of the device API on
// it (the barrier, the quiet, a team's sync, put, put-with-signal, get, a signal wait), after checking on the
// host what the host can check, so that bad input returns an error instead of trapping the kernel.
#include <algorithm>
#include <cstdint>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/logging.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"
#include "guarded.hpp"
#include "stream_ops.hpp"

namespace mori::shmem {
namespace {

using core::Dim3;
using core::ErrorCode;

#if MORI_BACKEND_HOST
constexpr unsigned kThreads = 64;  // host threads per block
#else
constexpr unsigned kThreads = 256;
#endif
constexpr unsigned kMaxBlocks = 32;
constexpr size_t kBytesPerBlock = size_t(1) << 20;

MORI_GLOBAL void BarrierKernel() { ShmemBarrierAllThread(); }
MORI_GLOBAL void QuietKernel() { ShmemQuietThread(); }
MORI_GLOBAL void TeamSyncKernel(ShmemTeam team) { ShmemTeamSyncThread(team); }
MORI_GLOBAL void SignalWaitKernel(uint64_t* sig, CmpOp cmp, uint64_t value) {
  (void)ShmemSignalWaitUntil(sig, cmp, value);
}

// Block b moves [b * chunk, min((b + 1) * chunk, bytes)): a non-blocking put, or (kGet) a get.
template <bool kGet>
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kThreads) TransferKernel(uint8_t* dest, const uint8_t* source, size_t bytes,
                                                              size_t chunk, int pe) {
  const size_t at = static_cast<size_t>(core::FlatBlockIdx()) * chunk;
  if (at >= bytes) return;
  if constexpr (kGet) {
    ShmemGetMemBlock(dest + at, source + at, std::min(chunk, bytes - at), pe);
  } else {
    ShmemPutMemNbiBlock(dest + at, source + at, std::min(chunk, bytes - at), pe);
  }
}

// One block: the signal must follow all of the data.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kThreads) PutSignalKernel(uint8_t* dest, const uint8_t* source, size_t bytes,
                                                               uint64_t* sig, uint64_t value, SignalOp op, int pe) {
  ShmemPutMemNbiSignalBlock(dest, source, bytes, sig, value, op, pe);
}

// The API boundary (guarded.hpp), for calls that need the runtime up.
template <typename F>
int Guarded(const char* op, F&& body) {
  return detail::Guarded(op, [&] {
    MORI_CHECK(ShmemIsInitialized(), ErrorCode::InvalidUsage, "%s called before ShmemInit() or after ShmemFinalize()",
               op);
    body();
  });
}

void CheckLaunched(const char* op) {
  core::GpuStatus s = core::GpuGetLastError();
  MORI_CHECK(s == core::kGpuSuccess, ErrorCode::Gpu, "%s: launching its kernel failed: %s", op,
             core::GpuGetErrorString(s));
}

void CheckPe(const char* op, int pe) {
  MORI_CHECK(pe >= 0 && pe < ShmemNPes(), ErrorCode::InvalidUsage, "%s on PE %d: target pe %d is not in [0, %d)", op,
             ShmemMyPe(), pe, ShmemNPes());
}

// [p, p + bytes) must be inside the user part of the symmetric heap.
void CheckSymmetric(const char* op, const char* what, const void* p, size_t bytes) {
  const auto base = reinterpret_cast<uintptr_t>(ShmemHeapBase()) + kShmemHeapUserOffset;
  const auto a = reinterpret_cast<uintptr_t>(p);
  const size_t room = ShmemHeapBytes();
  MORI_CHECK(a >= base && bytes <= room && a - base <= room - bytes, ErrorCode::InvalidUsage,
             "%s on PE %d: %s %p + %zu bytes is not inside the symmetric heap [%p, %p)", op, ShmemMyPe(), what, p,
             bytes, reinterpret_cast<void*>(base), reinterpret_cast<void*>(base + room));
}

// The local side of an operation with `pe`: over RDMA and the proxy it must be in the heap or registered.
void CheckLocal(const char* op, const char* what, const void* p, size_t bytes, int pe) {
  MORI_CHECK(detail::LocalReachable(p, bytes, pe), ErrorCode::InvalidUsage,
             "%s on PE %d (target pe %d, %s): %s %p (%zu bytes) is neither in the symmetric heap nor registered with "
             "ShmemBufferRegister, which the NIC or the proxy needs",
             op, ShmemMyPe(), pe, TransportTypeName(ShmemTransportType(pe)), what, p, bytes);
}

void CheckMember(const char* op, ShmemTeam team) {
  MORI_CHECK(ShmemTeamMyPe(team) >= 0, ErrorCode::InvalidUsage, "%s on PE %d: team %d is not a team this PE belongs to",
             op, ShmemMyPe(), static_cast<int>(team));
}

Dim3 BlocksFor(size_t bytes, size_t* chunk) {
  const size_t blocks = std::clamp<size_t>((bytes + kBytesPerBlock - 1) / kBytesPerBlock, 1, kMaxBlocks);
  *chunk = (bytes + blocks - 1) / blocks;
  *chunk = (*chunk + 15) / 16 * 16;  // 16-byte pieces keep the blocks' copies aligned
  return Dim3(static_cast<unsigned>(blocks));
}

// A put (the symmetric side is dest, the local one source) or, kGet, a get (the other way round).
template <bool kGet>
int TransferOnStream(const char* op, void* dest, const void* source, size_t bytes, int pe, core::GpuStream stream) {
  return Guarded(op, [&] {
    const char* symmetricName = kGet ? "source" : "dest";
    const char* localName = kGet ? "dest" : "source";
    const void* local = kGet ? static_cast<const void*>(dest) : source;
    CheckPe(op, pe);
    CheckSymmetric(op, symmetricName, kGet ? source : dest, bytes);
    MORI_CHECK(bytes == 0 || local != nullptr, ErrorCode::InvalidUsage, "%s: null %s", op, localName);
    if (bytes == 0) return;
    CheckLocal(op, localName, local, bytes, pe);
    size_t chunk = 0;
    Dim3 grid = BlocksFor(bytes, &chunk);
    core::LaunchKernel(TransferKernel<kGet>, grid, Dim3(kThreads), 0, stream, static_cast<uint8_t*>(dest),
                       static_cast<const uint8_t*>(source), bytes, chunk, pe);
    CheckLaunched(op);
  });
}

}  // namespace

namespace detail {
void LaunchQuietAll(core::GpuStream stream) {
  core::LaunchKernel(QuietKernel, Dim3(1), Dim3(1), 0, stream);
  MORI_CHECK_GPU(core::GpuGetLastError());
}

void PreloadStreamKernels() {
  core::PreloadKernels(BarrierKernel, QuietKernel, TeamSyncKernel, SignalWaitKernel, TransferKernel<false>,
                       TransferKernel<true>, PutSignalKernel);
}
}  // namespace detail

int ShmemBarrierAllOnStream(core::GpuStream stream) {
  constexpr const char* op = "ShmemBarrierAllOnStream";
  return Guarded(op, [&] {
    core::LaunchKernel(BarrierKernel, Dim3(1), Dim3(1), 0, stream);
    CheckLaunched(op);
  });
}

int ShmemQuietOnStream(core::GpuStream stream) {
  constexpr const char* op = "ShmemQuietOnStream";
  return Guarded(op, [&] {
    core::LaunchKernel(QuietKernel, Dim3(1), Dim3(1), 0, stream);
    CheckLaunched(op);
  });
}

int ShmemTeamSyncOnStream(ShmemTeam team, core::GpuStream stream) {
  constexpr const char* op = "ShmemTeamSyncOnStream";
  return Guarded(op, [&] {
    CheckMember(op, team);
    core::LaunchKernel(TeamSyncKernel, Dim3(1), Dim3(1), 0, stream, team);
    CheckLaunched(op);
  });
}

int ShmemPutMemOnStream(void* dest, const void* source, size_t bytes, int pe, core::GpuStream stream) {
  return TransferOnStream<false>("ShmemPutMemOnStream", dest, source, bytes, pe, stream);
}

int ShmemGetMemOnStream(void* dest, const void* source, size_t bytes, int pe, core::GpuStream stream) {
  return TransferOnStream<true>("ShmemGetMemOnStream", dest, source, bytes, pe, stream);
}

int ShmemPutMemSignalOnStream(void* dest, const void* source, size_t bytes, uint64_t* sigAddr, uint64_t sigVal,
                              SignalOp sigOp, int pe, core::GpuStream stream) {
  constexpr const char* op = "ShmemPutMemSignalOnStream";
  return Guarded(op, [&] {
    CheckPe(op, pe);
    CheckSymmetric(op, "dest", dest, bytes);
    CheckSymmetric(op, "sigAddr", sigAddr, sizeof(uint64_t));
    MORI_CHECK(reinterpret_cast<uintptr_t>(sigAddr) % sizeof(uint64_t) == 0, ErrorCode::InvalidUsage,
               "%s: sigAddr %p is not 8-byte aligned", op, static_cast<void*>(sigAddr));
    MORI_CHECK(bytes == 0 || source != nullptr, ErrorCode::InvalidUsage, "%s: null source", op);
    MORI_CHECK(sigOp == SignalOp::Set || sigOp == SignalOp::Add, ErrorCode::InvalidUsage, "%s: unknown signal op %u",
               op, static_cast<unsigned>(sigOp));
    if (bytes > 0) CheckLocal(op, "source", source, bytes, pe);
    core::LaunchKernel(PutSignalKernel, Dim3(1), Dim3(kThreads), 0, stream, static_cast<uint8_t*>(dest),
                       static_cast<const uint8_t*>(source), bytes, sigAddr, sigVal, sigOp, pe);
    CheckLaunched(op);
  });
}

int ShmemSignalWaitUntilOnStream(uint64_t* sigAddr, CmpOp cmp, uint64_t value, core::GpuStream stream) {
  constexpr const char* op = "ShmemSignalWaitUntilOnStream";
  return Guarded(op, [&] {
    CheckSymmetric(op, "sigAddr", sigAddr, sizeof(uint64_t));
    MORI_CHECK(static_cast<uint32_t>(cmp) <= static_cast<uint32_t>(CmpOp::LE), ErrorCode::InvalidUsage,
               "%s: unknown comparison %u", op, static_cast<unsigned>(cmp));
    core::LaunchKernel(SignalWaitKernel, Dim3(1), Dim3(1), 0, stream, sigAddr, cmp, value);
    CheckLaunched(op);
  });
}

}  // namespace mori::shmem
