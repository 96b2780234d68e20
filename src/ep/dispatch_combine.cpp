// MoE dispatch and combine (include/mori/ep/dispatch_combine.hpp) on the public SHMEM device API.
//
// Slots: a token that source PE s sends to PE d gets slot j on d, its rank among s's tokens for d (in token
// order, so the received layout is deterministic). Every PE's symmetric receive buffer has W * M message slots,
// [s][j]; combine sends each PE's row back into the source's combine buffer at [d][j]. Signals are one word per
// (PE, direction) holding (round << 32) | count, Set by the sender after its data: rounds only grow, so no
// signal is ever reset and a stale one cannot pass for a new one. A count of kAborted says the sender found
// bad input and sent nothing; every PE then skips the rest of the round.
//
// LowLatency has kernels of its own (below). Kernels of one InterNode Dispatch, in stream order: Route (mask
// and slot numbering; validates expert ids), Send (packs the messages per destination in the local send
// buffer), Signal (one put-with-signal per destination for its whole batch), Receive (waits for every
// source's signal, prefix sums), Unpack (the flat result). IntraNode skips the receive buffer and the unpack
// pass: after Route, Notify writes this PE's counts into every PE's count table and waits for every PE's, so
// each sender knows where its rows start on each PE, and Send stores the rows straight into their final
// places in the peers' result arrays through ShmemPtr; Signal (a signal per destination) then says they are
// there, and the receiver only counts rows per local expert. The notify also orders the rounds: no PE writes
// into a PE's results before that PE has started its own next Dispatch (its earlier results live until then).
// Combine: Send rows (stores or staging), Signal (the same two ways), Wait, Reduce (the weighted sum per
// token).
#include "mori/ep/dispatch_combine.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mori/core/atomic.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/core/kernel.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/warp.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

namespace mori::ep {

size_t DataTypeBytes(DataType type) {
  switch (type) {
    case DataType::Float32: return 4;
    case DataType::BFloat16:
    case DataType::Float16: return 2;
    case DataType::Fp8E4M3: return 1;
  }
  return 0;
}

const char* DataTypeName(DataType type) {
  switch (type) {
    case DataType::Float32: return "float32";
    case DataType::BFloat16: return "bfloat16";
    case DataType::Float16: return "float16";
    case DataType::Fp8E4M3: return "fp8_e4m3";
  }
  return "unknown dtype";
}

const char* EpKernelTypeName(EpKernelType type) {
  switch (type) {
    case EpKernelType::IntraNode: return "IntraNode";
    case EpKernelType::InterNode: return "InterNode";
    case EpKernelType::LowLatency: return "LowLatency";
  }
  return "unknown kernel type";
}

namespace {

using core::Dim3;
using core::ErrorCode;
using shmem::CmpOp;
using shmem::SignalOp;

constexpr uint32_t kAborted = 0xFFFFFFFFu;
constexpr int kMaxWorld = 64;  // a token's destinations are a 64-bit mask
constexpr int kMaxTopk = 16;
// Threads per block at most (config.warpsPerBlock): every kernel here is compiled for it, so a launch never
// asks for more registers than an SM has.
constexpr int kMaxWarpsPerBlock = 16;
constexpr int kMaxThreads = kMaxWarpsPerBlock * MORI_WARP_SIZE;
constexpr int kStagedBlocks = 8;  // LowLatency: blocks whose warps put to PEs not reached by stores

constexpr size_t Align16(size_t n) { return (n + 15) & ~size_t(15); }

struct alignas(16) Word16 {
  uint64_t lo, hi;
};

// What the kernels found, in device memory; the host reads it in Status().
struct Control {
  int32_t error;      // ErrorKind
  int32_t token;      // the offending token and top-k slot, the bad value
  int32_t slot;
  int32_t value;
  int32_t abortedBy;  // 1 + a PE whose round was aborted (0: none); the block is zeroed before every round
  int32_t aborted;    // this PE skips the rest of the round
  int32_t staleFrom;  // 1 + a PE whose signal carried another round (0: none)
  uint32_t staleRound;
  // LowLatency: blocks of the send kernels that finished (the last one signals), rows received (or -1).
  uint32_t doneSend, doneCombine;
  int32_t rows;
};

enum ErrorKind : int32_t { kNoError = 0, kBadExpert = 1, kAbortedElsewhere = 2, kStaleSignal = 3 };

// Message layout in a slot: header (source position), token, scales, indices, weights; each part 16-aligned.
struct Layout {
  size_t tokenBytes, scaleOff, indexOff, weightOff, msgBytes, rowBytes, rowDataBytes;
};

// ---- conversions (bit-exact, the same on every backend) ----

MORI_HOST_DEVICE_INLINE float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
MORI_HOST_DEVICE_INLINE uint32_t FloatToBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MORI_HOST_DEVICE_INLINE float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }
MORI_HOST_DEVICE_INLINE uint16_t FloatToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu) != 0) return 0x7FC0;  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);                                                // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
MORI_HOST_DEVICE_INLINE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (man << 13));  // inf, NaN
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    // Subnormal: man * 2^-24.
    float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
}
MORI_HOST_DEVICE_INLINE uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return sign | (a > 0x7F800000u ? 0x7E00 : 0x7C00);  // NaN, inf
  if (a >= 0x477FF000u) return sign | 0x7C00;                               // rounds past 65504
  if (a < 0x38800000u) {                                                      // below 2^-14: subnormal
    const float v = BitsToFloat(a) * 16777216.0f;                             // in units of 2^-24
    uint32_t m = static_cast<uint32_t>(v);
    const float rest = v - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t r = a - 0x38000000u;  // rebias 127 -> 15 (the exponent moves down by 112 << 23)
  r += 0xFFFu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

template <DataType T>
struct Elem;
template <>
struct Elem<DataType::Float32> {
  using Storage = float;
  MORI_HOST_DEVICE_INLINE static float Load(const Storage* p, size_t i) { return p[i]; }
  MORI_HOST_DEVICE_INLINE static void Store(Storage* p, size_t i, float v) { p[i] = v; }
};
template <>
struct Elem<DataType::BFloat16> {
  using Storage = uint16_t;
  MORI_HOST_DEVICE_INLINE static float Load(const Storage* p, size_t i) { return Bf16ToFloat(p[i]); }
  MORI_HOST_DEVICE_INLINE static void Store(Storage* p, size_t i, float v) { p[i] = FloatToBf16(v); }
};
template <>
struct Elem<DataType::Float16> {
  using Storage = uint16_t;
  MORI_HOST_DEVICE_INLINE static float Load(const Storage* p, size_t i) { return HalfToFloat(p[i]); }
  MORI_HOST_DEVICE_INLINE static void Store(Storage* p, size_t i, float v) { p[i] = FloatToHalf(v); }
};

// ---- device helpers ----

// Threads `index` of `count` copy `bytes` from src to dst together: 16-byte words where both are 16-aligned,
// else bytes.
MORI_DEVICE_INLINE void StridedCopy(void* dst, const void* src, size_t bytes, unsigned index, unsigned count) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  size_t done = 0;
  if (((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) & 15) == 0) {
    const size_t words = bytes / 16;
    auto* dw = reinterpret_cast<Word16*>(d);
    auto* sw = reinterpret_cast<const Word16*>(s);
    // Four loads in flight per thread before their stores: a warp copying a 7 KB row alone is bound by the
    // latency of its loads, not by bandwidth.
    size_t i = index;
    for (; i + 3 * size_t(count) < words; i += 4 * size_t(count)) {
      const Word16 w0 = sw[i], w1 = sw[i + count], w2 = sw[i + 2 * size_t(count)], w3 = sw[i + 3 * size_t(count)];
      dw[i] = w0;
      dw[i + count] = w1;
      dw[i + 2 * size_t(count)] = w2;
      dw[i + 3 * size_t(count)] = w3;
    }
    for (; i < words; i += count) dw[i] = sw[i];
    done = words * 16;
  }
  for (size_t i = done + index; i < bytes; i += count) d[i] = s[i];
}

// One of the pieces that CopyParts moves as one.
struct Part {
  void* dst;
  const void* src;
  size_t bytes;
};

// Threads `index` of `count` copy the parts together, as if they were one run of 16-byte words: each thread
// loads kInFlight words (of whichever parts they fall in) before it stores any, so a warp moving a 7 KB token
// with its scales, ids and weights waits for memory once, not once per four words of every part. Parts not
// 16-byte aligned at both ends or not a whole number of words go by StridedCopy after the rest.
template <int N>
MORI_DEVICE_INLINE void CopyParts(const Part (&parts)[N], unsigned index, unsigned count) {
  constexpr int kInFlight = 8;
  size_t words[N];
  size_t total = 0;
  MORI_UNROLL
  for (int k = 0; k < N; ++k) {
    const bool whole = ((reinterpret_cast<uintptr_t>(parts[k].dst) | reinterpret_cast<uintptr_t>(parts[k].src) |
                         parts[k].bytes) & 15) == 0;
    words[k] = whole ? parts[k].bytes / 16 : 0;
    total += words[k];
  }
  // The part and word of virtual word v.
  auto locate = [&](size_t v, int* part) {
    int k = 0;
    MORI_UNROLL
    for (int j = 0; j + 1 < N; ++j) {
      if (k == j && v >= words[j]) {
        v -= words[j];
        k = j + 1;
      }
    }
    *part = k;
    return v;
  };
  for (size_t base = index; base < total; base += size_t(kInFlight) * count) {
    Word16 w[kInFlight];
    MORI_UNROLL
    for (int j = 0; j < kInFlight; ++j) {
      const size_t v = base + size_t(j) * count;
      if (v < total) {
        int k = 0;
        const size_t i = locate(v, &k);
        w[j] = static_cast<const Word16*>(parts[k].src)[i];
      }
    }
    MORI_UNROLL
    for (int j = 0; j < kInFlight; ++j) {
      const size_t v = base + size_t(j) * count;
      if (v < total) {
        int k = 0;
        const size_t i = locate(v, &k);
        static_cast<Word16*>(parts[k].dst)[i] = w[j];
      }
    }
  }
  MORI_UNROLL
  for (int k = 0; k < N; ++k) {
    if (words[k] == 0 && parts[k].bytes > 0) StridedCopy(parts[k].dst, parts[k].src, parts[k].bytes, index, count);
  }
}

// The block copies together.
MORI_DEVICE_INLINE void BlockCopy(void* dst, const void* src, size_t bytes) {
  StridedCopy(dst, src, bytes, core::FlatThreadIdx(), core::FlatBlockDim());
}

// Block-wide inclusive prefix sum of `flag`: returns this thread's inclusive count of set flags and the
// block's total in *total. A warp counts its flags with one ballot; `scan` (one int per warp of shared memory)
// holds each warp's count, and each thread adds the counts of the warps before its own. Two block barriers
// whatever the block's size (a Hillis-Steele scan over the threads took 2 log2(blockDim) + 2: 18 for 256
// threads, and on HOST, where a warp is one thread and a barrier a futex round, 8 for a block of 8). Every
// thread of the block calls it; `scan` may be rewritten once it returns.
MORI_DEVICE_INLINE int BlockScan(int32_t* scan, bool flag, int* total) {
  const int nt = static_cast<int>(core::FlatBlockDim());
  const int warp = static_cast<int>(core::WarpId()), warps = (nt + MORI_WARP_SIZE - 1) / MORI_WARP_SIZE;
  const int width = nt - warp * MORI_WARP_SIZE < MORI_WARP_SIZE ? nt - warp * MORI_WARP_SIZE : MORI_WARP_SIZE;
  const core::LaneMask lanes = width >= 64 ? ~core::LaneMask(0) : (core::LaneMask(1) << width) - 1;
  const core::LaneMask votes = core::Ballot(lanes, flag);
  if (core::LaneId() == 0) scan[warp] = static_cast<int32_t>(core::LaneCount(votes));
  core::SyncThreads();
  int before = 0, all = 0;
  for (int w = 0; w < warps; ++w) {
    const int c = scan[w];
    before += w < warp ? c : 0;
    all += c;
  }
  *total = all;
  core::SyncThreads();
  return before + static_cast<int>(core::LaneCount(votes & core::LanesBelow())) + (flag ? 1 : 0);
}

// Row i of the flat result comes from source *s, its slot *j there.
MORI_DEVICE_INLINE void SourceOf(const int32_t* offsets, int world, int i, int* s, int* j) {
  int src = 0;
  while (src + 1 < world && offsets[src + 1] <= i) ++src;
  *s = src;
  *j = i - offsets[src];
}

MORI_DEVICE_INLINE void RecordError(Control* ctl, int32_t kind, int32_t token, int32_t slot, int32_t value) {
  if (core::AtomicCompareExchange<core::MemoryOrder::AcqRel, core::Scope::Device>(&ctl->error, int32_t(kNoError),
                                                                                 kind) == kNoError) {
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&ctl->token, token);
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&ctl->slot, slot);
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&ctl->value, value);
  }
}

// What source's signal word v says about round `round`: the sender's count, or that the word is stale (another
// round, or a count above `maxCount` that no sender of this round can have), or that the sender aborted.
struct SignalVerdict {
  uint32_t count;  // 0 unless the word is good
  bool stale, aborted;
};

MORI_DEVICE_INLINE SignalVerdict JudgeSignal(uint64_t v, uint64_t round, int maxCount) {
  const auto count = static_cast<uint32_t>(v);
  if ((v >> 32) != (round & 0xFFFFFFFFu) || (count != kAborted && count > static_cast<uint32_t>(maxCount))) {
    return {0, true, false};
  }
  if (count == kAborted) return {0, false, true};
  return {count, false, false};
}

// Marks this PE's round aborted: `staleFrom` / `abortedBy` are 1 + the PE whose signal said so (0: none); the
// first cause recorded is kept (IntraNode learns of an abort in its notify, and every later signal of the round
// then says kAborted, whoever caused it), as is an error kind a kernel recorded already. One thread.
MORI_DEVICE_INLINE void RecordAbort(Control* ctl, int32_t staleFrom, int32_t abortedBy) {
  if (ctl->aborted == 0) {
    if (staleFrom != 0) ctl->staleFrom = staleFrom;
    if (abortedBy != 0) ctl->abortedBy = abortedBy;
  }
  ctl->aborted = 1;
  const int32_t error = core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::Device>(&ctl->error);
  if (error == kNoError) {
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(
        &ctl->error, int32_t(staleFrom != 0 ? kStaleSignal : kAbortedElsewhere));
  }
}

// Thread s of a block: waits for source s's signal of round `round` and returns its count (0 unless good). A
// stale or aborting source goes into state[0] / state[1] (block-shared, 1 + the PE); a stale word's round
// goes into the control block.
MORI_DEVICE_INLINE int32_t AwaitSource(uint64_t* sig, int s, uint64_t round, int maxCount, int32_t* state,
                                       Control* ctl) {
  const uint64_t v = shmem::ShmemSignalWaitUntil(sig + s, CmpOp::GE, round << 32);
  const SignalVerdict verdict = JudgeSignal(v, round, maxCount);
  if (verdict.stale) {
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&state[0], int32_t(s + 1));
    const uint32_t staleRound = static_cast<uint32_t>(v >> 32);
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&ctl->staleRound, staleRound);
  } else if (verdict.aborted) {
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&state[1], int32_t(s + 1));
  }
  return static_cast<int32_t>(verdict.count);
}

struct RouteArgs {
  const int32_t* indices;
  const float* weights;
  int numTokens, topk, expertsPerRank, world;
  uint64_t* masks;      // [M]: each token's destination PEs
  int32_t* slotOf;      // [M * W]
  float* weightSum;     // [M * W]
  int32_t* sendCount;   // [W]
  Control* ctl;
};

// Every thread takes tokens: validates their expert ids, sums their weights per destination PE and writes
// the mask of destinations. (The control block was zeroed on the stream before.)
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) RouteMaskKernel(RouteArgs a) {
  const int experts = a.expertsPerRank * a.world;
  for (int t = static_cast<int>(core::GlobalThreadIdx()); t < a.numTokens;
       t += static_cast<int>(core::GlobalThreadCount())) {
    uint64_t mask = 0;
    float* ws = a.weightSum + static_cast<size_t>(t) * a.world;
    for (int d = 0; d < a.world; ++d) ws[d] = 0.0f;
    for (int k = 0; k < a.topk; ++k) {
      const int e = a.indices[static_cast<size_t>(t) * a.topk + k];
      if (e < 0 || e >= experts) {
        RecordError(a.ctl, kBadExpert, t, k, e);
        continue;
      }
      const int d = e / a.expertsPerRank;
      mask |= uint64_t(1) << d;
      ws[d] += a.weights[static_cast<size_t>(t) * a.topk + k];
    }
    a.masks[t] = mask;
  }
}

// Block d numbers the slots of the tokens for PE d in token order: a block-wide prefix sum over each chunk of
// blockDim tokens (shared: blockDim ints). All destinations at once, one block each.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) RouteSlotKernel(RouteArgs a) {
  const int d = static_cast<int>(core::FlatBlockIdx());
  const int tid = static_cast<int>(core::FlatThreadIdx()), nt = static_cast<int>(core::FlatBlockDim());
  int32_t* scan = core::DynamicSharedMemory<int32_t>();
  int running = 0;
  for (int base = 0; base < a.numTokens; base += nt) {
    const int t = base + tid;
    const bool flag = t < a.numTokens && ((a.masks[t] >> d) & 1) != 0;
    int total = 0;
    const int incl = BlockScan(scan, flag, &total);
    if (t < a.numTokens) a.slotOf[static_cast<size_t>(t) * a.world + d] = flag ? running + incl - 1 : -1;
    running += total;
  }
  if (tid == 0) a.sendCount[d] = running;
}

// Where the four parts of one token go: its data, scales, top-k expert ids and weights.
struct TokenPlaces {
  void* token;
  void* scales;
  void* indices;
  void* weights;
};

// Token t's four parts from the caller's arrays to `to`, by `count` threads of which this is `index` (a block's
// or a warp's, as in StridedCopy).
MORI_DEVICE_INLINE void CopyTokenParts(const TokenPlaces& to, int t, const uint8_t* input, const int32_t* indices,
                                       const float* weights, const float* scales, size_t tokenBytes, int scaleDim,
                                       int topk, unsigned index, unsigned count) {
  const size_t sb = static_cast<size_t>(scaleDim) * sizeof(float), kb = static_cast<size_t>(topk) * sizeof(int32_t);
  const Part parts[4] = {{to.token, input + static_cast<size_t>(t) * tokenBytes, tokenBytes},
                         {to.scales, scaleDim > 0 ? scales + static_cast<size_t>(t) * scaleDim : nullptr, sb},
                         {to.indices, indices + static_cast<size_t>(t) * topk, kb},
                         {to.weights, weights + static_cast<size_t>(t) * topk, kb}};
  CopyParts(parts, index, count);
}

// Token t's parts into message msg after its header.
MORI_DEVICE_INLINE void PackMessage(uint8_t* msg, int t, const uint8_t* input, const int32_t* indices,
                                    const float* weights, const float* scales, const Layout& lay, int scaleDim,
                                    int topk, unsigned index, unsigned count) {
  CopyTokenParts({msg + 16, msg + lay.scaleOff, msg + lay.indexOff, msg + lay.weightOff}, t, input, indices, weights,
                 scales, lay.tokenBytes, scaleDim, topk, index, count);
}

struct DispatchArgs {
  const uint8_t* input;
  const int32_t* indices;
  const float* weights;
  const float* scales;
  int numTokens, topk, scaleDim, world, rank, maxTokens;
  Layout lay;
  const int32_t* slotOf;
  uint8_t* sendBuf;  // [W][M] messages, staged for the put-with-signal of each destination's batch
  const Control* ctl;
};

// InterNode: each block takes tokens and stages one message per destination PE of the token.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) DispatchSendKernel(DispatchArgs a) {
  if (a.ctl->error != kNoError) return;
  for (int t = static_cast<int>(core::FlatBlockIdx()); t < a.numTokens; t += static_cast<int>(core::FlatGridDim())) {
    for (int d = 0; d < a.world; ++d) {
      const int j = a.slotOf[static_cast<size_t>(t) * a.world + d];
      if (j < 0) continue;
      uint8_t* msg = a.sendBuf + (static_cast<size_t>(d) * a.maxTokens + j) * a.lay.msgBytes;
      if (core::FlatThreadIdx() == 0) *reinterpret_cast<int32_t*>(msg) = t;
      PackMessage(msg, t, a.input, a.indices, a.weights, a.scales, a.lay, a.scaleDim, a.topk, core::FlatThreadIdx(),
                  core::FlatBlockDim());
    }
  }
}

// IntraNode's result arrays on the symmetric heap, in one allocation carved the same way on every PE.
struct Rows {
  size_t tokens, weights, indices, scales, srcTokenPos, table, bytes;  // offsets in the allocation; its size
};

Rows CarveRows(size_t W, size_t M, const Layout& lay, int topk, int scaleDim) {
  Rows r{};
  const size_t n = W * M;
  r.tokens = 0;
  r.weights = Align16(r.tokens + n * lay.tokenBytes);
  r.indices = Align16(r.weights + n * topk * sizeof(float));
  r.scales = Align16(r.indices + n * topk * sizeof(int32_t));
  r.srcTokenPos = Align16(r.scales + n * scaleDim * sizeof(float));
  r.table = Align16(r.srcTokenPos + n * sizeof(int32_t));
  r.bytes = r.table + W * W * sizeof(uint64_t);
  return r;
}

struct NotifyArgs {
  uint64_t* table;           // symmetric [W * W]: entry s * W + d = round << 32 | rows s sends to d
  const int32_t* sendCount;  // [W]
  int32_t* sendOffset;       // [W]: this PE's first row on each PE
  uint64_t round;
  int world, rank, maxCount;
  Control* ctl;
};

// One block: this PE's row of counts into every PE's table (kAborted when its routing found bad input), then
// a wait for every PE's row of this round; a stale or aborting row aborts the round here as on every PE, since
// all see the same table. Shared: 2 ints.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) NotifyKernel(NotifyArgs a) {
  const int tid = static_cast<int>(core::FlatThreadIdx()), nt = static_cast<int>(core::FlatBlockDim());
  const int W = a.world;
  int32_t* state = core::DynamicSharedMemory<int32_t>();
  if (tid < 2) state[tid] = 0;
  const bool bad = a.ctl->error != kNoError;
  for (int e = tid; e < W * W; e += nt) {
    const int p = e / W, d = e % W;
    const uint32_t count = bad ? kAborted : static_cast<uint32_t>(a.sendCount[d]);
    auto* entry = static_cast<uint64_t*>(shmem::ShmemPtr(a.table + static_cast<size_t>(a.rank) * W + d, p));
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::System>(entry, (a.round << 32) | count);
  }
  core::SyncThreads();
  for (int e = tid; e < W * W; e += nt) {
    const uint64_t v = shmem::ShmemWaitUntil(a.table + e, CmpOp::GE, a.round << 32);
    const SignalVerdict verdict = JudgeSignal(v, a.round, a.maxCount);
    if (verdict.stale) {
      core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&state[0], int32_t(e / W + 1));
      core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&a.ctl->staleRound,
                                                                         static_cast<uint32_t>(v >> 32));
    } else if (verdict.aborted) {
      core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&state[1], int32_t(e / W + 1));
    }
  }
  core::SyncThreads();
  if (tid != 0) return;
  const bool aborted = bad || state[0] != 0 || state[1] != 0;
  if (aborted) RecordAbort(a.ctl, state[0], state[1]);
  auto count = [&](int s, int d) {
    return static_cast<int32_t>(static_cast<uint32_t>(
        core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::System>(a.table + s * W + d)));
  };
  // (What this PE receives is counted by ReceiveKernel from the data signals, as for the other kernel types.)
  for (int d = 0; d < W && !aborted; ++d) {
    int32_t before = 0;
    for (int s = 0; s < a.rank; ++s) before += count(s, d);
    a.sendOffset[d] = before;
  }
}

struct DirectSendArgs {
  DispatchArgs in;           // the tokens and their slots (sendBuf unused)
  Rows rows;
  uint8_t* rowBase;          // symmetric: the result arrays (Rows)
  const int32_t* sendOffset;
};

// Each block takes tokens and stores each into its row on every destination PE of the token: the token, its
// scales, top-k ids and weights, and its source.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) DirectSendKernel(DirectSendArgs args) {
  const DispatchArgs& a = args.in;
  if (a.ctl->error != kNoError || a.ctl->aborted != 0) return;
  const unsigned tid = core::FlatThreadIdx(), nt = core::FlatBlockDim();
  const Rows& r = args.rows;
  for (int t = static_cast<int>(core::FlatBlockIdx()); t < a.numTokens; t += static_cast<int>(core::FlatGridDim())) {
    for (int d = 0; d < a.world; ++d) {
      const int j = a.slotOf[static_cast<size_t>(t) * a.world + d];
      if (j < 0) continue;
      const size_t row = static_cast<size_t>(args.sendOffset[d]) + j;
      auto* peer = static_cast<uint8_t*>(shmem::ShmemPtr(args.rowBase, d));
      const TokenPlaces to{peer + r.tokens + row * a.lay.tokenBytes, peer + r.scales + row * a.scaleDim * sizeof(float),
                           peer + r.indices + row * a.topk * sizeof(int32_t),
                           peer + r.weights + row * a.topk * sizeof(float)};
      CopyTokenParts(to, t, a.input, a.indices, a.weights, a.scales, a.lay.tokenBytes, a.scaleDim, a.topk, tid, nt);
      if (tid == 0) reinterpret_cast<int32_t*>(peer + r.srcTokenPos)[row] = a.rank * a.maxTokens + t;
    }
  }
}

// After ReceiveKernel: rows naming each local expert among their top-k, one thread per row.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads)
    ExpertCountKernel(const int32_t* indices, const int32_t* total, int topk, int rank, int expertsPerRank,
                      int32_t* expertCounts, const Control* ctl) {
  if (ctl->aborted != 0) return;
  const int rows = *total;
  for (int i = static_cast<int>(core::GlobalThreadIdx()); i < rows; i += static_cast<int>(core::GlobalThreadCount())) {
    for (int k = 0; k < topk; ++k) {
      const int e = indices[static_cast<size_t>(i) * topk + k];
      if (e / expertsPerRank == rank) {
        core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&expertCounts[e % expertsPerRank],
                                                                             int32_t(1));
      }
    }
  }
}

// Signals of one direction. IntraNode (direct): one block, thread d signals PE d after a system fence (the
// stores of the previous kernel are complete when it ends). InterNode: block d puts its batch of `count`
// messages from the staging buffer to PE d with the signal, then quiets (the staging buffer is rewritten by
// the next round). `counts` [W]: messages for each PE; `aborted`: signal kAborted instead.
struct SignalArgs {
  const int32_t* counts;
  uint8_t* remoteBase;    // symmetric: this PE's slots on the target, [rank][0]
  const uint8_t* staged;  // local staging (symmetric heap): PE d's batch at d * stride or startRows[d]
  size_t stride, itemBytes;
  uint64_t* sig;          // symmetric: the signal word for this PE on the target
  const int32_t* startRows;  // InterNode: PE d's batch starts at row startRows[d] of the staging; null: d * stride
  uint64_t round;
  int world;
  bool direct;
  const Control* ctl;
};

MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) SignalKernel(SignalArgs a) {
  const bool aborted = a.ctl->error != kNoError || a.ctl->aborted != 0;
  if (a.direct) {
    const int d = static_cast<int>(core::FlatThreadIdx());
    if (d < a.world) {
      const uint32_t count = aborted ? kAborted : static_cast<uint32_t>(a.counts[d]);
      shmem::ShmemQuietThread();
      shmem::ShmemSignalOpThread(a.sig, (a.round << 32) | count, SignalOp::Set, d);
    }
    return;
  }
  const int d = static_cast<int>(core::FlatBlockIdx());
  const uint32_t count = aborted ? kAborted : static_cast<uint32_t>(a.counts[d]);
  const uint64_t value = (a.round << 32) | count;
  if (count == 0 || count == kAborted) {
    if (core::FlatThreadIdx() == 0) shmem::ShmemSignalOpThread(a.sig, value, SignalOp::Set, d);
  } else {
    const size_t start = a.startRows != nullptr ? static_cast<size_t>(a.startRows[d]) * a.itemBytes
                                                : static_cast<size_t>(d) * a.stride;
    shmem::ShmemPutMemNbiSignalBlock(a.remoteBase, a.staged + start, count * a.itemBytes, a.sig, value,
                                     SignalOp::Set, d);
  }
  if (core::FlatThreadIdx() == 0) shmem::ShmemQuietThread();
}

// One block: thread s waits for source s's signal of this round (at most `maxCount` messages) and keeps its
// count; thread 0 then makes the offsets. `total` (may be null) gets the sum, or -1 when the round was
// aborted. Shared: 2 ints.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads)
    ReceiveKernel(uint64_t* sig, uint64_t round, int world, int maxCount, int32_t* counts, int32_t* offsets,
                  int32_t* total, int32_t* expertCounts, int experts, Control* ctl) {
  const int tid = static_cast<int>(core::FlatThreadIdx());
  int32_t* state = core::DynamicSharedMemory<int32_t>();
  if (tid < 2) state[tid] = 0;
  for (int e = tid; e < experts; e += static_cast<int>(core::FlatBlockDim())) expertCounts[e] = 0;
  core::SyncThreads();
  if (tid < world) counts[tid] = AwaitSource(sig, tid, round, maxCount, state, ctl);
  core::SyncThreads();
  if (tid == 0) {
    int32_t sum = 0;
    for (int s = 0; s < world; ++s) {
      offsets[s] = sum;
      sum += counts[s];
    }
    const bool aborted = ctl->error != kNoError || state[0] != 0 || state[1] != 0;
    if (aborted) RecordAbort(ctl, state[0], state[1]);
    if (total != nullptr) *total = aborted ? -1 : sum;
  }
}

// Message msg's token, scales, indices and weights into row `row` of the result, by `count` threads of which
// this is `index` (a block's or a warp's, as in StridedCopy).
MORI_DEVICE_INLINE void UnpackMessage(const EpDispatchResult& out, size_t row, const uint8_t* msg, const Layout& lay,
                                      int scaleDim, int topk, unsigned index, unsigned count) {
  const size_t sb = static_cast<size_t>(scaleDim) * sizeof(float), kb = static_cast<size_t>(topk) * sizeof(int32_t);
  const Part parts[4] = {{static_cast<uint8_t*>(out.tokens) + row * lay.tokenBytes, msg + 16, lay.tokenBytes},
                         {scaleDim > 0 ? out.scales + row * scaleDim : nullptr, msg + lay.scaleOff, sb},
                         {out.indices + row * topk, msg + lay.indexOff, kb},
                         {out.weights + row * topk, msg + lay.weightOff, kb}};
  CopyParts(parts, index, count);
}

struct UnpackArgs {
  const uint8_t* recvBuf;
  const int32_t* offsets;
  const int32_t* total;
  int world, rank, maxTokens, topk, scaleDim, expertsPerRank;
  Layout lay;
  EpDispatchResult out;  // where the rows, their sources and the per-expert counts go
  const Control* ctl;
};

MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) UnpackKernel(UnpackArgs a) {
  if (a.ctl->aborted != 0) return;
  const int total = *a.total;
  for (int i = static_cast<int>(core::FlatBlockIdx()); i < total; i += static_cast<int>(core::FlatGridDim())) {
    int s, j;
    SourceOf(a.offsets, a.world, i, &s, &j);
    const uint8_t* msg = a.recvBuf + (static_cast<size_t>(s) * a.maxTokens + j) * a.lay.msgBytes;
    UnpackMessage(a.out, static_cast<size_t>(i), msg, a.lay, a.scaleDim, a.topk, core::FlatThreadIdx(),
                  core::FlatBlockDim());
    if (core::FlatThreadIdx() == 0) {
      a.out.srcTokenPos[i] = s * a.maxTokens + *reinterpret_cast<const int32_t*>(msg);
      const auto* idx = reinterpret_cast<const int32_t*>(msg + a.lay.indexOff);
      for (int k = 0; k < a.topk; ++k) {
        if (idx[k] / a.expertsPerRank == a.rank) {
          core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(
              &a.out.expertCounts[idx[k] % a.expertsPerRank], int32_t(1));
        }
      }
    }
  }
}

struct CombineArgs {
  const uint8_t* expertOutput;
  const int32_t* offsets;
  const int32_t* recvCounts;
  const int32_t* total;
  int world, rank, maxTokens;
  Layout lay;
  uint8_t* combRecv;  // symmetric [W][M] rows
  uint8_t* combSend;  // local staging [W * M] rows (InterNode), in received order
  bool direct;
  const Control* ctl;
};

// Row i goes back to its source s, slot j: straight into s's combine buffer at [rank][j], or staged at i
// (rows of one source are then contiguous: offsets[s] + j).
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) CombineSendKernel(CombineArgs a) {
  if (a.ctl->aborted != 0) return;
  const int total = *a.total;
  for (int i = static_cast<int>(core::FlatBlockIdx()); i < total; i += static_cast<int>(core::FlatGridDim())) {
    uint8_t* dst;
    if (a.direct) {
      int s, j;
      SourceOf(a.offsets, a.world, i, &s, &j);
      dst = static_cast<uint8_t*>(shmem::ShmemPtr(
          a.combRecv + (static_cast<size_t>(a.rank) * a.maxTokens + j) * a.lay.rowBytes, s));
    } else {
      dst = a.combSend + static_cast<size_t>(i) * a.lay.rowBytes;
    }
    BlockCopy(dst, a.expertOutput + static_cast<size_t>(i) * a.lay.rowDataBytes, a.lay.rowDataBytes);
  }
}

struct ReduceArgs {
  const uint8_t* combRecv;
  const int32_t* slotOf;
  const float* weightSum;
  int numTokens, world, maxTokens, hidden;
  Layout lay;
  uint8_t* output;
  const Control* ctl;
};

// acc += w * the unit of `row` at element `first`: kVec elements in one 16-byte load, or one element.
template <DataType T>
MORI_DEVICE_INLINE void AddScaled(float* acc, const typename Elem<T>::Storage* row, size_t first, float w,
                                  bool vectors) {
  using S = typename Elem<T>::Storage;
  constexpr int kVec = 16 / sizeof(S);
  if (vectors) {
    const Word16 v = *reinterpret_cast<const Word16*>(row + first);
    S e[kVec];
    memcpy(e, &v, sizeof(v));
    for (int i = 0; i < kVec; ++i) acc[i] += w * Elem<T>::Load(e, i);
  } else {
    acc[0] += w * Elem<T>::Load(row, first);
  }
}

// Stores the unit at element `first` of out: one 16-byte store, or one element.
template <DataType T>
MORI_DEVICE_INLINE void StoreUnit(typename Elem<T>::Storage* out, size_t first, const float* acc, bool vectors) {
  using S = typename Elem<T>::Storage;
  constexpr int kVec = 16 / sizeof(S);
  if (vectors) {
    S e[kVec];
    for (int i = 0; i < kVec; ++i) Elem<T>::Store(e, i, acc[i]);
    Word16 v;
    memcpy(&v, e, sizeof(v));
    *reinterpret_cast<Word16*>(out + first) = v;
  } else {
    Elem<T>::Store(out, first, acc[0]);
  }
}

// Per token, each thread sums a 16-byte vector of elements over the PEs the token went to (4 fp32 or 8
// bf16/fp16 per load) when rows are whole vectors, else one element at a time.
template <DataType T>
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) ReduceKernel(ReduceArgs a) {
  if (a.ctl->aborted != 0) return;
  using E = Elem<T>;
  using S = typename E::Storage;
  constexpr int kVec = 16 / sizeof(S);
  const bool vectors = a.hidden % kVec == 0;
  const int units = vectors ? a.hidden / kVec : a.hidden;
  for (int t = static_cast<int>(core::FlatBlockIdx()); t < a.numTokens; t += static_cast<int>(core::FlatGridDim())) {
    auto* out = reinterpret_cast<S*>(a.output + static_cast<size_t>(t) * a.lay.rowDataBytes);
    const int32_t* slots = a.slotOf + static_cast<size_t>(t) * a.world;
    const float* ws = a.weightSum + static_cast<size_t>(t) * a.world;
    for (int u = static_cast<int>(core::FlatThreadIdx()); u < units; u += static_cast<int>(core::FlatBlockDim())) {
      float acc[kVec] = {};
      const size_t first = vectors ? static_cast<size_t>(u) * kVec : static_cast<size_t>(u);
      for (int d = 0; d < a.world; ++d) {
        const int j = slots[d];
        if (j < 0) continue;
        const auto* row = reinterpret_cast<const S*>(
            a.combRecv + (static_cast<size_t>(d) * a.maxTokens + j) * a.lay.rowBytes);
        AddScaled<T>(acc, row, first, ws[d], vectors);
      }
      StoreUnit<T>(out, first, acc, vectors);
    }
  }
}

// ---- LowLatency ----
//
// Source s's token t goes to slot [s][t] of every PE that holds one of its experts: the message header holds
// the position and the round's low 32 bits, so a receiver tells this round's messages from the stale ones in
// the slots of tokens that went elsewhere. The send kernels end with a count of finished blocks in the
// control block; the last block signals every PE (round << 32 | the sender's token count, or kAborted).

struct LlDispatchArgs {
  const uint8_t* input;
  const int32_t* indices;
  const float* weights;
  const float* scales;
  int numTokens, topk, scaleDim, world, rank, maxTokens, expertsPerRank;
  unsigned blocksPerPe;
  Layout lay;
  uint8_t* recvBuf;   // symmetric [W][M] messages
  uint8_t* sendBuf;   // symmetric [W][M] staging for PEs not reached by stores
  int32_t* slotOf;    // [M * W]: t where token t went to PE d, else -1 (the combine's reduce reads it)
  float* weightSum;   // [M * W]: 1 (LowLatency rows come back weighted)
  uint64_t* sig;      // symmetric: this PE's dispatch signal word
  uint64_t round;
  Control* ctl;
  Control* nextCtl;   // the next round's control block, zeroed here (the kernels of the last round are done)
};

// The destinations of token t (ids already validated).
MORI_DEVICE_INLINE uint64_t DestMask(const int32_t* indices, int t, int topk, int expertsPerRank) {
  uint64_t mask = 0;
  for (int k = 0; k < topk; ++k) mask |= uint64_t(1) << (indices[static_cast<size_t>(t) * topk + k] / expertsPerRank);
  return mask;
}

// Counts this block as finished (after its stores and puts are complete: `fenced` says which) and, in the
// last block of the grid, signals every PE. Shared: one int.
MORI_DEVICE_INLINE void FinishAndSignal(uint32_t* done, int32_t* lastFlag, uint64_t* sig, uint64_t round, int world,
                                        const int32_t* counts, int32_t count, bool aborted) {
  core::SyncThreads();
  if (core::FlatThreadIdx() == 0) {
    // Stores into peers (direct) are made visible before the count; quieted puts are complete already. The
    // release is cumulative: it covers the block's other threads through the barrier above.
    core::AtomicFence<core::MemoryOrder::Release, core::Scope::System>();
    const uint32_t old = core::AtomicFetchAdd<core::MemoryOrder::AcqRel, core::Scope::Device>(done, 1u);
    *lastFlag = old + 1 == core::FlatGridDim() ? 1 : 0;
  }
  core::SyncThreads();
  if (*lastFlag == 0) return;
  // Blocks may have fewer threads than there are PEs (one warp of 32 and 64 PEs; one thread per block on HOST).
  for (int d = static_cast<int>(core::FlatThreadIdx()); d < world; d += static_cast<int>(core::FlatBlockDim())) {
    const int32_t n = counts != nullptr ? core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::Device>(&counts[d])
                                        : count;
    const uint32_t c = aborted ? kAborted : static_cast<uint32_t>(n);
    shmem::ShmemSignalOpThread(sig, (round << 32) | c, SignalOp::Set, d);
  }
}

// Block (d, b) of W x blocksPerPe: validates every token (each block, so that all agree to send nothing if
// one id is bad), then its warps write the messages of the tokens for PE d whose position is theirs, into
// d's slots by stores or, for a PE reached over RDMA or the proxy, staged and put by the warp.
// Shared: 2 ints.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) LlDispatchSendKernel(LlDispatchArgs a) {
  const int tid = static_cast<int>(core::FlatThreadIdx()), nt = static_cast<int>(core::FlatBlockDim());
  const int d = static_cast<int>(core::FlatBlockIdx() / a.blocksPerPe);
  const int b = static_cast<int>(core::FlatBlockIdx() % a.blocksPerPe);
  int32_t* flags = core::DynamicSharedMemory<int32_t>();  // [0]: a bad id seen, [1]: last block
  core::WaitForPrerequisiteGrid();  // the caller's kernels that made the tokens
  core::AllowDependentLaunch();     // the receive kernel's blocks may start waiting once all of these run
  if (tid == 0) flags[0] = 0;
  if (tid == 0 && core::FlatBlockIdx() == 0) *a.nextCtl = Control{};
  core::SyncThreads();
  const int experts = a.expertsPerRank * a.world;
  for (int i = tid; i < a.numTokens * a.topk; i += nt) {
    const int e = a.indices[i];
    if (e < 0 || e >= experts) {
      RecordError(a.ctl, kBadExpert, i / a.topk, i % a.topk, e);
      core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&flags[0], int32_t(1));
    }
  }
  core::SyncThreads();
  const bool bad = core::AtomicLoad<core::MemoryOrder::Relaxed, core::Scope::Device>(&flags[0]) != 0;
  if (!bad) {
    if (b == 0) {  // the reduce's view of where each token went
      for (int t = tid; t < a.numTokens; t += nt) {
        const bool to = (DestMask(a.indices, t, a.topk, a.expertsPerRank) >> d) & 1;
        a.slotOf[static_cast<size_t>(t) * a.world + d] = to ? t : -1;
        a.weightSum[static_cast<size_t>(t) * a.world + d] = 1.0f;
      }
    }
    const size_t slotOff = static_cast<size_t>(a.rank) * a.maxTokens;  // this PE's slots on d, [rank][t]
    const bool direct = shmem::ShmemPtr(a.recvBuf, d) != nullptr;
    const int warps = nt / MORI_WARP_SIZE > 0 ? nt / MORI_WARP_SIZE : 1;
    // Puts go to the NIC or the proxy from the warps of at most kStagedBlocks blocks: every warp that puts
    // waits in a quiet, and thousands of warps polling the proxy's host memory at once starved its copies.
    const int perPe = static_cast<int>(a.blocksPerPe);
    const int active = direct || perPe < kStagedBlocks ? perPe : kStagedBlocks;
    // Consecutive tokens go to different blocks (token t to block t % active), so that a decode batch keeps
    // as many SMs storing as it has tokens rather than filling the warps of a few.
    const int gw = static_cast<int>(core::WarpId()) * active + b, allWarps = active * warps;
    bool put = false;
    for (int t = b < active ? gw : a.numTokens; t < a.numTokens; t += allWarps) {
      if (((DestMask(a.indices, t, a.topk, a.expertsPerRank) >> d) & 1) == 0) continue;
      uint8_t* remote = a.recvBuf + (slotOff + t) * a.lay.msgBytes;
      uint8_t* msg = direct ? static_cast<uint8_t*>(shmem::ShmemPtr(remote, d))
                            : a.sendBuf + (static_cast<size_t>(d) * a.maxTokens + t) * a.lay.msgBytes;
      if (core::LaneId() == 0) {
        reinterpret_cast<int32_t*>(msg)[0] = t;
        reinterpret_cast<uint32_t*>(msg)[1] = static_cast<uint32_t>(a.round);
      }
      PackMessage(msg, t, a.input, a.indices, a.weights, a.scales, a.lay, a.scaleDim, a.topk, core::LaneId(),
                  MORI_WARP_SIZE);
      if (!direct) {
        shmem::ShmemPutMemNbiWarp(remote, msg, a.lay.msgBytes, d);
        put = true;
      }
    }
    if (put && core::LaneId() == 0) shmem::ShmemQuietThread();  // the warp's puts are complete at d
  }
  FinishAndSignal(&a.ctl->doneSend, &flags[1], a.sig, a.round, a.world, nullptr, a.numTokens, bad);
}

struct LlRecvArgs {
  const uint8_t* recvBuf;
  uint64_t* sig;  // this PE's dispatch signal words, one per source; null: ReceiveKernel waited for them
  uint64_t round;
  int world, rank, maxTokens, topk, scaleDim, expertsPerRank;
  Layout lay;
  int32_t* counts;  // [W]: tokens each source had
  EpDispatchResult out;  // where the rows, their sources and the per-expert counts go
  int32_t* rowOf;  // [W * M * K]: the grouped row of (source, position, k) for local experts
  Control* ctl;
};

// Every block first waits for every source's signal (threads s < W, as ReceiveKernel does) and keeps the
// counts in shared memory; block 0 publishes them (the combine reads them) and records an aborted round. Then
// `per` blocks take each local expert (per = grid / experts, at least 1; experts strided over the grid when
// fewer blocks) and gather this round's messages naming it into its rows, in (source, position) order: each
// block's threads test a block's width of slots at a time, a block scan numbers the hits, and the block's
// warps copy its share (hit n goes to block n % per), a warp per hit. The wait is here rather than in a
// kernel of its own to save a kernel boundary (about 3 us on two H100s), and the kernel is launched early
// (core::LaunchKernelEarly): its blocks may start waiting while the send kernel ends (all of whose blocks run
// by then). Only where no other PE shares this GPU: blocks waiting on every SM would leave such a PE no room
// for its send kernel, so there (sig null) a one-block ReceiveKernel waits first and this kernel starts after
// it. Shared: 2 * blockDim + W + 2 ints.
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) LlDispatchRecvKernel(LlRecvArgs a) {
  const int tid = static_cast<int>(core::FlatThreadIdx()), nt = static_cast<int>(core::FlatBlockDim());
  int32_t* scan = core::DynamicSharedMemory<int32_t>();  // [nt]: BlockScan
  int32_t* hits = scan + nt;                             // [nt]: the slots of this pass's hits, in order
  int32_t* cnt = hits + nt;                              // [W]: tokens each source had this round
  int32_t* state = cnt + a.world;                        // [2]: a stale source, an aborting one (1 + PE)
  if (tid < 2) state[tid] = 0;
  core::SyncThreads();
  const bool wait = a.sig != nullptr;
  if (tid < a.world) cnt[tid] = wait ? AwaitSource(a.sig, tid, a.round, a.maxTokens, state, a.ctl) : a.counts[tid];
  core::SyncThreads();
  // The send kernel's bad ids are in the control block already; the signals read the same in every block.
  const bool aborted =
      wait ? a.ctl->error != kNoError || state[0] != 0 || state[1] != 0 : a.ctl->aborted != 0;
  if (core::FlatBlockIdx() == 0 && tid == 0 && aborted) {
    if (wait) RecordAbort(a.ctl, state[0], state[1]);
    core::AtomicStore<core::MemoryOrder::Relaxed, core::Scope::Device>(&a.ctl->rows, int32_t(-1));
  }
  if (wait && core::FlatBlockIdx() == 0 && tid < a.world) a.counts[tid] = cnt[tid];
  const size_t stride = static_cast<size_t>(a.world) * a.maxTokens;
  const int slots = a.world * a.maxTokens;
  const int warps = nt / MORI_WARP_SIZE > 0 ? nt / MORI_WARP_SIZE : 1;
  const int warp = static_cast<int>(core::WarpId()), lane = static_cast<int>(core::LaneId());
  const int grid = static_cast<int>(core::FlatGridDim());
  const int per = grid / a.expertsPerRank > 0 ? grid / a.expertsPerRank : 1;
  for (int item = static_cast<int>(core::FlatBlockIdx()); item < a.expertsPerRank * per; item += grid) {
    const int e = item / per, part = item % per;
    if (aborted) {
      if (tid == 0 && part == 0) a.out.expertCounts[e] = 0;
      continue;
    }
    const int g = a.rank * a.expertsPerRank + e;
    int running = 0;
    for (int base = 0; base < slots; base += nt) {
      const int q = base + tid;
      bool flag = false;
      if (q < slots && q % a.maxTokens < cnt[q / a.maxTokens]) {
        const uint8_t* msg = a.recvBuf + static_cast<size_t>(q) * a.lay.msgBytes;
        if (reinterpret_cast<const uint32_t*>(msg)[1] == static_cast<uint32_t>(a.round)) {
          const auto* idx = reinterpret_cast<const int32_t*>(msg + a.lay.indexOff);
          for (int k = 0; k < a.topk; ++k) flag |= idx[k] == g;
        }
      }
      int found = 0;
      const int incl = BlockScan(scan, flag, &found);
      if (flag) hits[incl - 1] = q;
      core::SyncThreads();
      // This block's hits: n = running + h with n % per == part. The warps split into as many groups as there
      // are hits (at most one group per warp), a group per hit: a decode batch has few rows per expert, and
      // two or more warps per row move it in one round of loads where one warp needs two.
      const int first = ((part - running) % per + per) % per;
      const int mine = found > first ? (found - first + per - 1) / per : 0;
      const int groups = mine < warps ? mine : warps;
      if (groups > 0) {
        const int group = warp % groups;
        const int members = warps / groups + (group < warps % groups ? 1 : 0);
        const unsigned index = static_cast<unsigned>(warp / groups * MORI_WARP_SIZE + lane);
        const unsigned count = static_cast<unsigned>(members * MORI_WARP_SIZE);
        for (int i = group; i < mine; i += groups) {
          const int h = first + i * per;
          const int slot = hits[h];
          const uint8_t* msg = a.recvBuf + static_cast<size_t>(slot) * a.lay.msgBytes;
          const size_t row = e * stride + running + h;
          UnpackMessage(a.out, row, msg, a.lay, a.scaleDim, a.topk, index, count);
          if (index == 0) {
            a.out.srcTokenPos[row] = slot;  // source * maxTokens + position
            const auto* idx = reinterpret_cast<const int32_t*>(msg + a.lay.indexOff);
            for (int k = 0; k < a.topk; ++k) {
              if (idx[k] == g) a.rowOf[static_cast<size_t>(slot) * a.topk + k] = static_cast<int32_t>(row);
            }
          }
        }
      }
      running += found;
      core::SyncThreads();  // hits and scan are rewritten by the next pass
    }
    if (tid == 0 && part == 0) {
      a.out.expertCounts[e] = running;
      core::AtomicFetchAdd<core::MemoryOrder::Relaxed, core::Scope::Device>(&a.ctl->rows, int32_t(running));
    }
  }
  core::WaitForPrerequisiteGrid();  // the send kernel (launched before it) has completed when this one does
}

struct LlCombineArgs {
  const uint8_t* expertOutput;  // [E * W * M] rows of rowDataBytes
  const uint8_t* recvBuf;
  const int32_t* counts;        // [W]: tokens each source had
  const int32_t* rowOf;
  int world, rank, maxTokens, topk, expertsPerRank, hidden;
  Layout lay;
  uint8_t* combRecv;  // symmetric [W][M] rows: PE d's weighted sum for token t at [d][t]
  uint8_t* combSend;  // symmetric [W][M] staging
  uint64_t* sig;      // symmetric: this PE's combine signal word
  uint64_t round;
  Control* ctl;
};

// A received message's weighted sum (fp32, 16-byte vectors when rows are whole vectors) of its local experts'
// output rows goes back into the source's slot [rank][t], by stores or staged and put. `parts` blocks share a
// message, each a range of the hidden units (parts = grid / slots, at least 1). Messages for PEs reached by
// stores: every block; staged ones: the first kStagedBlocks * warps blocks, as many put issuers as
// LlDispatchSendKernel has. Shared: 1 + 2 * kMaxTopk ints.
template <DataType T>
MORI_GLOBAL void MORI_LAUNCH_BOUNDS(kMaxThreads) LlCombineSendKernel(LlCombineArgs a) {
  using E = Elem<T>;
  using S = typename E::Storage;
  constexpr int kVec = 16 / sizeof(S);
  int32_t* flags = core::DynamicSharedMemory<int32_t>();
  int32_t* local = flags + 1;                               // [kMaxTopk]: rows of the message's local experts
  auto* weight = reinterpret_cast<float*>(local + kMaxTopk);  // [kMaxTopk]: their weights
  const bool aborted = a.ctl->aborted != 0;
  if (!aborted) {
    const bool vectors = a.hidden % kVec == 0;
    const int units = vectors ? a.hidden / kVec : a.hidden;
    const size_t unitBytes = vectors ? 16 : sizeof(S);
    const int tid = static_cast<int>(core::FlatThreadIdx()), nt = static_cast<int>(core::FlatBlockDim());
    const int warps = nt / MORI_WARP_SIZE > 0 ? nt / MORI_WARP_SIZE : 1;
    const int b = static_cast<int>(core::FlatBlockIdx()), grid = static_cast<int>(core::FlatGridDim());
    const int stagedBlocks = grid < kStagedBlocks * warps ? grid : kStagedBlocks * warps;
    const int slots = a.world * a.maxTokens;
    bool put = false;
    for (int pass = 0; pass < 2; ++pass) {
      const int blocks = pass == 0 ? grid : stagedBlocks;
      const int parts = blocks / slots > 0 ? blocks / slots : 1;
      for (int item = b < blocks ? b : slots * parts; item < slots * parts; item += blocks) {
        const int q = item / parts, part = item % parts;
        const int s = q / a.maxTokens, t = q % a.maxTokens;
        if (t >= a.counts[s]) continue;
        const bool direct = shmem::ShmemPtr(a.combRecv, s) != nullptr;
        if (direct != (pass == 0)) continue;
        const uint8_t* msg = a.recvBuf + static_cast<size_t>(q) * a.lay.msgBytes;
        if (reinterpret_cast<const uint32_t*>(msg)[1] != static_cast<uint32_t>(a.round)) continue;
        core::SyncThreads();  // the previous message's list is read
        if (tid == 0) {
          const auto* idx = reinterpret_cast<const int32_t*>(msg + a.lay.indexOff);
          const auto* wts = reinterpret_cast<const float*>(msg + a.lay.weightOff);
          int n = 0;
          for (int k = 0; k < a.topk; ++k) {
            if (idx[k] / a.expertsPerRank != a.rank) continue;
            local[n] = a.rowOf[static_cast<size_t>(q) * a.topk + k];
            weight[n++] = wts[k];
          }
          flags[0] = n;
        }
        core::SyncThreads();
        const int n = flags[0];
        const int begin = static_cast<int>(static_cast<int64_t>(units) * part / parts);
        const int end = static_cast<int>(static_cast<int64_t>(units) * (part + 1) / parts);
        uint8_t* remote = a.combRecv + (static_cast<size_t>(a.rank) * a.maxTokens + t) * a.lay.rowBytes;
        auto* out = reinterpret_cast<S*>(direct ? static_cast<uint8_t*>(shmem::ShmemPtr(remote, s))
                                                : a.combSend + static_cast<size_t>(q) * a.lay.rowBytes);
        for (int u = begin + tid; u < end; u += nt) {
          float acc[kVec] = {};
          const size_t first = vectors ? static_cast<size_t>(u) * kVec : static_cast<size_t>(u);
          for (int k = 0; k < n; ++k) {
            const uint8_t* row = a.expertOutput + static_cast<size_t>(local[k]) * a.lay.rowDataBytes;
            AddScaled<T>(acc, reinterpret_cast<const S*>(row), first, weight[k], vectors);
          }
          StoreUnit<T>(out, first, acc, vectors);
        }
        if (!direct && end > begin) {
          core::SyncThreads();  // the staged range is whole before the block puts it
          shmem::ShmemPutMemNbiBlock(remote + begin * unitBytes, reinterpret_cast<uint8_t*>(out) + begin * unitBytes,
                                     static_cast<size_t>(end - begin) * unitBytes, s);
          put = true;
        }
      }
    }
    core::SyncThreads();
    if (put && tid == 0) shmem::ShmemQuietThread();  // the block's puts are complete at their PEs
  }
  FinishAndSignal(&a.ctl->doneCombine, &flags[0], a.sig, a.round, a.world, a.counts, 0, aborted);
}

void CheckLaunch(const char* what) {
  core::GpuStatus rc = core::GpuGetLastError();
  MORI_CHECK(rc == core::kGpuSuccess, ErrorCode::Gpu, "launching the %s kernel failed: %s", what,
             core::GpuGetErrorString(rc));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

struct EpDispatchCombineHandle::Impl {
  int world = 0;
  Layout lay{};
  DataType combineType = DataType::BFloat16;
  unsigned blocks = 0, threads = 0, routeThreads = 0;
  unsigned sms = 1;  // multiprocessors of the device (HOST: the blocks)
  unsigned gatherThreads = 0;  // LowLatency's receive kernel
  unsigned gatherPerSm = 4;    // and its blocks per multiprocessor
  // LowLatency: the receive kernel's blocks wait for the signals themselves (no PE shares this GPU), or a
  // one-block ReceiveKernel waits before it (a PE on the same GPU needs room for its own kernels meanwhile).
  bool waitInGather = true;
  // Symmetric.
  uint8_t* recvBuf = nullptr;
  uint8_t* sendBuf = nullptr;
  uint8_t* combRecv = nullptr;
  uint64_t* sigs = nullptr;  // [2W]: dispatch, combine
  uint8_t* rowBase = nullptr;  // IntraNode: the result arrays and the count table (Rows), written by the senders
  Rows rows{};
  // Local.
  uint8_t* combSend = nullptr;  // InterNode: rows staged for the NIC or proxy, which read only the heap
  // Local.
  core::GpuBuffer masks, slotOf, weightSum, counts, tokens, weights, indices, scales, srcTokenPos, expertCounts, ctl;
  core::GpuBuffer rowOf;  // LowLatency: [W * M * K] grouped row of each received (source, position, k)
  uint64_t round = 0;
  int numTokens = 0;
  // Where the round is: the calls go DispatchSend, DispatchRecv, CombineSend, CombineRecv, DispatchSend...
  enum class Phase { Idle, DispatchSent, Dispatched, CombineSent } phase = Phase::Idle;

  int32_t* Counts(int which) const { return counts.DataAs<int32_t>() + which * world; }
  // counts: [0] send, [1] receive, [2] offsets, [3] [4] scratch of the combine wait, [5] IntraNode: this PE's
  // first row on each PE; then the total
  int32_t* Total() const { return counts.DataAs<int32_t>() + 6 * world; }
  // Two control blocks, used by alternate rounds: LowLatency's send kernel zeroes the next round's, so its
  // Dispatch needs no memset (a separate stream operation that cost about 7 us before the send on two H100s).
  Control* Ctl() const { return ctl.DataAs<Control>() + (round & 1); }
  Control* NextCtl() const { return ctl.DataAs<Control>() + ((round + 1) & 1); }
};

namespace {

void ValidateConfig(const EpDispatchCombineConfig& c) {
  MORI_CHECK(shmem::ShmemIsInitialized(), ErrorCode::InvalidUsage,
             "EpDispatchCombineHandle needs the SHMEM runtime: call ShmemInit() first");
  MORI_CHECK(c.worldSize == shmem::ShmemNPes() && c.rank == shmem::ShmemMyPe(), ErrorCode::InvalidUsage,
             "config says rank %d of %d, the SHMEM runtime says PE %d of %d", c.rank, c.worldSize,
             shmem::ShmemMyPe(), shmem::ShmemNPes());
  MORI_CHECK(c.worldSize <= kMaxWorld, ErrorCode::NotSupported, "worldSize %d: at most %d PEs", c.worldSize,
             kMaxWorld);
  MORI_CHECK(c.hiddenDim > 0 && c.maxTokensPerRank > 0 && c.numExpertsPerRank > 0, ErrorCode::InvalidUsage,
             "hiddenDim %d, maxTokensPerRank %d and numExpertsPerRank %d must be positive", c.hiddenDim,
             c.maxTokensPerRank, c.numExpertsPerRank);
  MORI_CHECK(c.topk >= 1 && c.topk <= kMaxTopk, ErrorCode::InvalidUsage, "topk %d outside [1, %d]", c.topk,
             kMaxTopk);
  MORI_CHECK(c.scaleDim >= 0, ErrorCode::InvalidUsage, "scaleDim %d is negative", c.scaleDim);
  MORI_CHECK(DataTypeBytes(c.dtype) != 0, ErrorCode::InvalidUsage, "dtype %d is not a DataType",
             static_cast<int>(c.dtype));
  MORI_CHECK(c.blocks >= 0 && c.warpsPerBlock >= 0, ErrorCode::InvalidUsage,
             "blocks %d and warpsPerBlock %d must not be negative", c.blocks, c.warpsPerBlock);
  MORI_CHECK(c.warpsPerBlock <= kMaxWarpsPerBlock, ErrorCode::InvalidUsage, "warpsPerBlock %d: at most %d",
             c.warpsPerBlock, kMaxWarpsPerBlock);
  MORI_CHECK(c.kernel == EpKernelType::IntraNode || c.kernel == EpKernelType::InterNode ||
                 c.kernel == EpKernelType::LowLatency,
             ErrorCode::InvalidUsage, "kernel type %d is not an EpKernelType", static_cast<int>(c.kernel));
  MORI_CHECK(static_cast<size_t>(c.maxTokensPerRank) * c.worldSize < (size_t(1) << 31), ErrorCode::InvalidUsage,
             "maxTokensPerRank %d x worldSize %d rows do not fit in int32", c.maxTokensPerRank, c.worldSize);
}

// The handle's buffers are symmetric and every PE's kernels assume the others' layouts: a config that differs
// between PEs would make the heap asymmetric and the messages misread. Collective: each PE puts the fields
// that must agree into its row of a symmetric table on every PE, and every PE compares all rows with its own,
// so all of them throw, naming the same first difference. (blocks and warpsPerBlock are local launch choices.)
// This PE's GPU as a number that other processes on the same host compute alike: a hash of the host name and
// the device's PCI bus id (0 on HOST, or when either is unknown).
int64_t GpuIdentity() {
#if MORI_BACKEND_HOST
  return 0;
#else
  int device = 0;
  char bus[64] = {};
  char host[256] = {};
  if (core::GpuGetDevice(&device) != core::kGpuSuccess ||
      core::GpuDeviceGetPciBusId(bus, sizeof(bus), device) != core::kGpuSuccess ||
      gethostname(host, sizeof(host) - 1) != 0) {
    return 0;
  }
  const uint64_t h = std::hash<std::string>{}(std::string(host) + "/" + bus);
  return static_cast<int64_t>(h == 0 ? 1 : h);
#endif
}

// Also returns whether another PE runs on this PE's GPU (the same host and PCI bus id; never on HOST).
bool CheckConfigAgreesEverywhere(const EpDispatchCombineConfig& c) {
  struct Field {
    const char* name;
    int64_t value;
  };
  const Field mine[] = {{"hiddenDim", c.hiddenDim},
                        {"maxTokensPerRank", c.maxTokensPerRank},
                        {"numExpertsPerRank", c.numExpertsPerRank},
                        {"topk", c.topk},
                        {"dtype", static_cast<int64_t>(c.dtype)},
                        {"scaleDim", c.scaleDim},
                        {"kernel", static_cast<int64_t>(c.kernel)},
                        {"gpu", GpuIdentity()}};  // not compared: the PEs that share a GPU
  constexpr size_t kFields = sizeof(mine) / sizeof(mine[0]);
  constexpr size_t kCompared = kFields - 1;
  const size_t W = static_cast<size_t>(c.worldSize);
  auto* table = static_cast<int64_t*>(shmem::ShmemCalloc(W * kFields, sizeof(int64_t)));
  MORI_CHECK(table != nullptr, ErrorCode::InvalidUsage,
             "EpDispatchCombineHandle: no symmetric heap for comparing the PEs' configs (the heap is full, or the "
             "allocation failed: ShmemCalloc's error is logged above)");
  std::vector<int64_t> all(W * kFields);
  try {
    int64_t* row = table + static_cast<size_t>(c.rank) * kFields;
    for (size_t f = 0; f < kFields; ++f) all[f] = mine[f].value;
    MORI_CHECK_GPU(core::GpuMemcpy(row, all.data(), kFields * sizeof(int64_t)));
    MORI_CHECK_GPU(core::GpuDeviceSynchronize());
    // The source is the row itself: heap memory, which every transport can read.
    for (int pe = 0; pe < c.worldSize; ++pe) {
      if (pe == c.rank) continue;
      MORI_CHECK(shmem::ShmemPutMemOnStream(row, row, kFields * sizeof(int64_t), pe, nullptr) == 0, ErrorCode::Internal,
                 "EpDispatchCombineHandle: sending this PE's config to PE %d failed", pe);
    }
    MORI_CHECK(shmem::ShmemQuietOnStream(nullptr) == 0, ErrorCode::Internal,
               "EpDispatchCombineHandle: completing the config puts failed");
  } catch (...) {
    shmem::ShmemBarrierAll();
    shmem::ShmemFree(table);
    throw;
  }
  shmem::ShmemBarrierAll();
  const core::GpuStatus copied = core::GpuMemcpy(all.data(), table, all.size() * sizeof(int64_t));
  shmem::ShmemFree(table);  // collective, on every PE whatever it finds
  MORI_CHECK_GPU(copied);
  bool shares = false;
  for (size_t pe = 0; pe < W; ++pe) {
    const int64_t gpu = all[pe * kFields + kCompared];
    shares = shares || (pe != static_cast<size_t>(c.rank) && gpu != 0 && gpu == mine[kCompared].value);
    for (size_t f = 0; f < kCompared; ++f) {
      const int64_t theirs = all[pe * kFields + f];
      MORI_CHECK(theirs == mine[f].value, ErrorCode::InvalidUsage,
                 "EpDispatchCombineHandle: PE %zu was built with %s %lld and PE %d with %lld; every PE must pass the "
                 "same config (but rank, blocks and warpsPerBlock)",
                 pe, mine[f].name, static_cast<long long>(theirs), c.rank, static_cast<long long>(mine[f].value));
    }
  }
  return shares;
}

}  // namespace

EpDispatchCombineHandle::EpDispatchCombineHandle(const EpDispatchCombineConfig& config)
    : config_(config), impl_(std::make_unique<Impl>()) {
  ValidateConfig(config);
  const bool sharesGpu = CheckConfigAgreesEverywhere(config);
  Impl& m = *impl_;
  const std::string shared = core::EnvGetChoice("MORI_EP_SHARED_GPU");
  m.waitInGather = shared == "auto" ? !sharesGpu : shared == "no";
  m.world = config.worldSize;
  const size_t W = config.worldSize, M = config.maxTokensPerRank, H = config.hiddenDim, K = config.topk,
               S = config.scaleDim;
  m.combineType = config.dtype == DataType::Fp8E4M3 ? DataType::BFloat16 : config.dtype;
  Layout& l = m.lay;
  l.tokenBytes = H * DataTypeBytes(config.dtype);
  l.scaleOff = 16 + Align16(l.tokenBytes);
  l.indexOff = l.scaleOff + Align16(S * sizeof(float));
  l.weightOff = l.indexOff + Align16(K * sizeof(int32_t));
  l.msgBytes = l.weightOff + Align16(K * sizeof(float));
  l.rowDataBytes = H * DataTypeBytes(m.combineType);
  l.rowBytes = Align16(l.rowDataBytes);

  if (config.kernel == EpKernelType::IntraNode) {
    for (int pe = 0; pe < config.worldSize; ++pe) {
      MORI_CHECK(shmem::ShmemPtr(shmem::ShmemHeapBase(), pe) != nullptr || pe == config.rank,
                 ErrorCode::NotSupported,
                 "IntraNode stores straight into every PE's buffers, but PE %d is reached over %s, not P2P: use "
                 "EpKernelType::InterNode",
                 pe, shmem::TransportTypeName(shmem::ShmemTransportType(pe)));
    }
  }
#if MORI_BACKEND_HOST
  m.blocks = config.blocks > 0 ? config.blocks : 2;
  m.threads = config.warpsPerBlock > 0 ? config.warpsPerBlock * MORI_WARP_SIZE : 8;
  m.sms = m.blocks;
  // Each LowLatency gather block scans every slot, each pass a few block barriers of host threads: two blocks
  // per "SM", not four (four spent most of the EP suite's time there), still more than one per expert.
  m.gatherPerSm = 2;
#else
  // Four blocks of 256 threads per SM: on an H200 (2 PEs under MPS, DeepSeek-V3 shape) 64 blocks gave 774 us
  // per dispatch, 132 x 256 462 us, 528 x 256 299 us.
  int device = 0, sms = 0;
  MORI_CHECK_GPU(core::GpuGetDevice(&device));
#if MORI_BACKEND_CUDA
  MORI_CHECK_GPU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
#else
  MORI_CHECK_GPU(hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, device));
#endif
  m.sms = static_cast<unsigned>(std::max(sms, 1));
  m.blocks = config.blocks > 0 ? config.blocks : static_cast<unsigned>(std::max(4 * sms, 64));
  m.threads = config.warpsPerBlock > 0 ? config.warpsPerBlock * MORI_WARP_SIZE : 256;
  if (config.kernel == EpKernelType::LowLatency) {
    // A decode batch has few tokens: a block of 512 threads per SM sends them with the least wait for its
    // grid (two H100s over NVLink, 128 tokens of the DeepSeek-V3 shape: 132 x 512 dispatched in 31.6-35.4 us
    // against 41.3-44.1 us with 528 x 256; 66, 264 and 528 blocks of 256 or 512 threads were all slower).
    if (config.blocks == 0) m.blocks = m.sms;
    if (config.warpsPerBlock == 0) m.threads = std::min<unsigned>(512, kMaxThreads);
  }
#endif
  m.routeThreads = std::max<unsigned>(m.threads, static_cast<unsigned>(W));
  // LowLatency's receive kernel: blocks of at most 256 threads.
  m.gatherThreads = std::max<unsigned>(std::min<unsigned>(m.threads, 256), static_cast<unsigned>(W));

  // Symmetric buffers: every PE allocates the same sizes in the same order (the constructor is collective).
  auto alloc = [&](size_t bytes, const char* what) {
    void* p = shmem::ShmemMalloc(bytes);
    MORI_CHECK(p != nullptr, ErrorCode::InvalidUsage,
               "EpDispatchCombineHandle: no symmetric heap for %zu bytes (the %s): they do not fit in the %zu bytes of "
               "the heap (set MORI_SHMEM_HEAP_SIZE), or the allocation failed (ShmemMalloc's error is logged above)",
               bytes, what, shmem::ShmemHeapBytes());
    return static_cast<uint8_t*>(p);
  };
  // LowLatency stages for the PEs it does not reach by stores, whichever they are on each PE: every PE
  // allocates the staging (the heap stays symmetric).
  const bool ll = config.kernel == EpKernelType::LowLatency;
  const bool staged = config.kernel == EpKernelType::InterNode || ll;
  const bool direct = config.kernel == EpKernelType::IntraNode;
  try {
    if (direct) {
      m.rows = CarveRows(W, M, l, config.topk, config.scaleDim);
      m.rowBase = alloc(m.rows.bytes, "dispatch result rows");
      // The count table tells rounds apart by their number: entries another handle left must not pass.
      MORI_CHECK_GPU(core::GpuMemset(m.rowBase + m.rows.table, 0, W * W * sizeof(uint64_t)));
    } else {
      m.recvBuf = alloc(W * M * l.msgBytes, "dispatch receive buffer");
    }
    if (staged) m.sendBuf = alloc(W * M * l.msgBytes, "dispatch send buffer");
    m.combRecv = alloc(W * M * l.rowBytes, "combine receive buffer");
    if (staged) m.combSend = alloc(W * M * l.rowBytes, "combine send buffer");
    m.sigs = reinterpret_cast<uint64_t*>(shmem::ShmemCalloc(2 * W, sizeof(uint64_t)));
    MORI_CHECK(m.sigs != nullptr, ErrorCode::InvalidUsage,
               "EpDispatchCombineHandle: no symmetric heap for the signals (the heap is full, or the allocation "
               "failed: ShmemCalloc's error is logged above)");
  } catch (...) {
    for (void* p : {static_cast<void*>(m.sigs), static_cast<void*>(m.combSend), static_cast<void*>(m.combRecv),
                    static_cast<void*>(m.sendBuf), static_cast<void*>(m.recvBuf), static_cast<void*>(m.rowBase)}) {
      if (p != nullptr) shmem::ShmemFree(p);
    }
    throw;
  }
  // LowLatency tells this round's messages by the round in their headers: slots that held another handle's
  // messages (the heap is reused) must not pass for this one's.
  if (ll) MORI_CHECK_GPU(core::GpuMemset(m.recvBuf, 0, W * M * l.msgBytes));
  m.masks = core::GpuBuffer(M * sizeof(uint64_t));
  m.slotOf = core::GpuBuffer(M * W * sizeof(int32_t));
  m.weightSum = core::GpuBuffer(M * W * sizeof(float));
  m.counts = core::GpuBuffer((6 * W + 1) * sizeof(int32_t));
  // Result rows: W * M flat, or numExpertsPerRank groups of W * M (LowLatency).
  const size_t rows = W * M * (ll ? static_cast<size_t>(config.numExpertsPerRank) : 1);
  if (!direct) {  // IntraNode's live on the heap (rowBase)
    m.tokens = core::GpuBuffer(std::max<size_t>(rows * l.tokenBytes, 16));
    m.weights = core::GpuBuffer(rows * K * sizeof(float));
    m.indices = core::GpuBuffer(rows * K * sizeof(int32_t));
    if (S > 0) m.scales = core::GpuBuffer(rows * S * sizeof(float));
    m.srcTokenPos = core::GpuBuffer(rows * sizeof(int32_t));
  }
  if (ll) m.rowOf = core::GpuBuffer(W * M * K * sizeof(int32_t));
  m.expertCounts = core::GpuBuffer(config.numExpertsPerRank * sizeof(int32_t));
  m.ctl = core::GpuBuffer(2 * sizeof(Control));
  MORI_CHECK_GPU(core::GpuMemset(m.ctl.Data(), 0, 2 * sizeof(Control)));
  MORI_CHECK_GPU(core::GpuMemset(m.counts.Data(), 0, m.counts.Bytes()));
  core::PreloadKernels(RouteMaskKernel, RouteSlotKernel, DispatchSendKernel, SignalKernel, ReceiveKernel,
                       UnpackKernel, CombineSendKernel, ReduceKernel<DataType::Float32>,
                       ReduceKernel<DataType::BFloat16>, ReduceKernel<DataType::Float16>, NotifyKernel,
                       DirectSendKernel, ExpertCountKernel, LlDispatchSendKernel,
                       LlDispatchRecvKernel, LlCombineSendKernel<DataType::Float32>,
                       LlCombineSendKernel<DataType::BFloat16>, LlCombineSendKernel<DataType::Float16>);
  shmem::ShmemBarrierAll();
}

EpDispatchCombineHandle::~EpDispatchCombineHandle() {
  if (!impl_ || !shmem::ShmemIsInitialized()) return;
  Impl& m = *impl_;
  (void)core::GpuDeviceSynchronize();
  shmem::ShmemBarrierAll();  // no peer writes into these buffers any more
  shmem::ShmemFree(m.sigs);
  if (m.combSend != nullptr) shmem::ShmemFree(m.combSend);
  shmem::ShmemFree(m.combRecv);
  if (m.sendBuf != nullptr) shmem::ShmemFree(m.sendBuf);
  if (m.recvBuf != nullptr) shmem::ShmemFree(m.recvBuf);
  if (m.rowBase != nullptr) shmem::ShmemFree(m.rowBase);
}

DataType EpDispatchCombineHandle::CombineDataType() const { return impl_->combineType; }

EpDispatchResult EpDispatchCombineHandle::Dispatch(const void* input, DataType dtype, const int32_t* indices,
                                                   const float* weights, const float* scales, int numTokens,
                                                   GpuStream stream) {
  MORI_CHECK(dtype == config_.dtype, ErrorCode::InvalidUsage,
             "Dispatch: the tokens are %s, this handle was built for %s", DataTypeName(dtype),
             DataTypeName(config_.dtype));
  return Dispatch(input, indices, weights, scales, numTokens, stream);
}

EpDispatchResult EpDispatchCombineHandle::Dispatch(const void* input, const int32_t* indices, const float* weights,
                                                   const float* scales, int numTokens, GpuStream stream) {
  DispatchSend(input, indices, weights, scales, numTokens, stream);
  return DispatchRecv(stream);
}

void EpDispatchCombineHandle::DispatchSend(const void* input, const int32_t* indices, const float* weights,
                                           const float* scales, int numTokens, GpuStream stream) {
  Impl& m = *impl_;
  const EpDispatchCombineConfig& c = config_;
  MORI_CHECK(shmem::ShmemIsInitialized(), ErrorCode::InvalidUsage, "Dispatch after ShmemFinalize()");
  MORI_CHECK(m.phase == Impl::Phase::Idle, ErrorCode::InvalidUsage,
             "Dispatch before the Combine of the previous round: peers may still read this round's buffers");
  MORI_CHECK(numTokens >= 0 && numTokens <= c.maxTokensPerRank, ErrorCode::InvalidUsage,
             "Dispatch: %d tokens, the handle takes 0..%d (maxTokensPerRank)", numTokens, c.maxTokensPerRank);
  if (numTokens > 0) {
    MORI_CHECK(input != nullptr && indices != nullptr && weights != nullptr, ErrorCode::InvalidUsage,
               "Dispatch: input %p, indices %p and weights %p must not be null", input,
               static_cast<const void*>(indices), static_cast<const void*>(weights));
    MORI_CHECK(Aligned16(input) && Aligned16(indices) && Aligned16(weights), ErrorCode::InvalidUsage,
               "Dispatch: input %p, indices %p and weights %p must be 16-byte aligned", input,
               static_cast<const void*>(indices), static_cast<const void*>(weights));
    MORI_CHECK(c.scaleDim == 0 || (scales != nullptr && Aligned16(scales)), ErrorCode::InvalidUsage,
               "Dispatch: the handle carries %d scales per token but scales is %p (null or not 16-byte aligned)",
               c.scaleDim, static_cast<const void*>(scales));
  }
  ++m.round;
  m.numTokens = numTokens;
  const int W = c.worldSize;
  m.phase = Impl::Phase::DispatchSent;

  if (c.kernel == EpKernelType::LowLatency) {
    const unsigned perPe = std::max(1u, m.blocks / static_cast<unsigned>(W));
    LlDispatchArgs la{static_cast<const uint8_t*>(input), indices, weights, scales, numTokens, c.topk, c.scaleDim, W,
                      c.rank, c.maxTokensPerRank, c.numExpertsPerRank, perPe, m.lay, m.recvBuf, m.sendBuf,
                      m.slotOf.DataAs<int32_t>(), m.weightSum.DataAs<float>(), m.sigs + c.rank, m.round, m.Ctl(),
                      m.NextCtl()};
    core::LaunchKernelEarly(LlDispatchSendKernel, Dim3(perPe * W), Dim3(m.threads), 2 * sizeof(int32_t), stream, la);
    CheckLaunch("low-latency dispatch send");
    return;
  }
  // The other kernel types zero this round's control block on the stream (LowLatency's send kernel zeroed it
  // a round ahead).
  MORI_CHECK_GPU(core::GpuMemsetAsync(m.Ctl(), 0, sizeof(Control), stream));
  const bool direct = c.kernel == EpKernelType::IntraNode;
  RouteArgs ra{indices, weights, numTokens, c.topk, c.numExpertsPerRank, W, m.masks.DataAs<uint64_t>(),
               m.slotOf.DataAs<int32_t>(), m.weightSum.DataAs<float>(), m.Counts(0), m.Ctl()};
  if (numTokens > 0) {
    core::LaunchKernel(RouteMaskKernel, Dim3(m.blocks), Dim3(m.threads), 0, stream, ra);
    CheckLaunch("dispatch route (masks)");
  }
  core::LaunchKernel(RouteSlotKernel, Dim3(W), Dim3(m.threads), m.threads * sizeof(int32_t), stream, ra);
  CheckLaunch("dispatch route (slots)");

  if (direct) {
    NotifyArgs na{reinterpret_cast<uint64_t*>(m.rowBase + m.rows.table), m.Counts(0), m.Counts(5), m.round, W,
                  c.rank, c.maxTokensPerRank, m.Ctl()};
    core::LaunchKernel(NotifyKernel, Dim3(1), Dim3(m.routeThreads), 2 * sizeof(int32_t), stream, na);
    CheckLaunch("dispatch notify");
    DirectSendArgs da{{static_cast<const uint8_t*>(input), indices, weights, scales, numTokens, c.topk, c.scaleDim, W,
                       c.rank, c.maxTokensPerRank, m.lay, m.slotOf.DataAs<int32_t>(), nullptr, m.Ctl()},
                      m.rows, m.rowBase, m.Counts(5)};
    if (numTokens > 0) {
      core::LaunchKernel(DirectSendKernel, Dim3(m.blocks), Dim3(m.threads), 0, stream, da);
      CheckLaunch("dispatch send");
    }
  } else {
    DispatchArgs da{static_cast<const uint8_t*>(input), indices, weights, scales, numTokens, c.topk, c.scaleDim, W,
                    c.rank, c.maxTokensPerRank, m.lay, m.slotOf.DataAs<int32_t>(), m.sendBuf, m.Ctl()};
    if (numTokens > 0) {
      core::LaunchKernel(DispatchSendKernel, Dim3(m.blocks), Dim3(m.threads), 0, stream, da);
      CheckLaunch("dispatch send");
    }
  }
  const size_t slotsPerPe = static_cast<size_t>(c.maxTokensPerRank) * m.lay.msgBytes;
  // IntraNode's rows are in place already: its signals carry only the counts.
  SignalArgs sa{m.Counts(0), direct ? nullptr : m.recvBuf + c.rank * slotsPerPe, m.sendBuf, slotsPerPe,
                m.lay.msgBytes, m.sigs + c.rank, nullptr, m.round, W, direct, m.Ctl()};
  core::LaunchKernel(SignalKernel, Dim3(direct ? 1 : W), Dim3(direct ? std::max<unsigned>(W, 1) : m.threads), 0,
                     stream, sa);
  CheckLaunch("dispatch signal");
}

EpDispatchResult EpDispatchCombineHandle::DispatchRecv(GpuStream stream) {
  Impl& m = *impl_;
  const EpDispatchCombineConfig& c = config_;
  MORI_CHECK(shmem::ShmemIsInitialized(), ErrorCode::InvalidUsage, "DispatchRecv after ShmemFinalize()");
  MORI_CHECK(m.phase == Impl::Phase::DispatchSent, ErrorCode::InvalidUsage,
             "DispatchRecv without a DispatchSend before it");
  m.phase = Impl::Phase::Dispatched;
  const int W = c.worldSize;
  const bool direct = c.kernel == EpKernelType::IntraNode;
  EpDispatchResult r{};
  if (direct) {
    r = EpDispatchResult{m.rowBase + m.rows.tokens,
                         reinterpret_cast<float*>(m.rowBase + m.rows.weights),
                         reinterpret_cast<int32_t*>(m.rowBase + m.rows.indices),
                         c.scaleDim > 0 ? reinterpret_cast<float*>(m.rowBase + m.rows.scales) : nullptr,
                         m.Total(),
                         reinterpret_cast<int32_t*>(m.rowBase + m.rows.srcTokenPos),
                         m.expertCounts.DataAs<int32_t>()};
  } else {
    r = EpDispatchResult{m.tokens.Data(),
                         m.weights.DataAs<float>(),
                         m.indices.DataAs<int32_t>(),
                         c.scaleDim > 0 ? m.scales.DataAs<float>() : nullptr,
                         m.Total(),
                         m.srcTokenPos.DataAs<int32_t>(),
                         m.expertCounts.DataAs<int32_t>()};
  }
  if (c.kernel == EpKernelType::LowLatency) {
    const bool wait = m.waitInGather;
    if (!wait) {  // one block waits for every source's signal and leaves the counts
      core::LaunchKernel(ReceiveKernel, Dim3(1), Dim3(m.routeThreads), 2 * sizeof(int32_t), stream, m.sigs, m.round,
                         W, c.maxTokensPerRank, m.Counts(1), m.Counts(2), static_cast<int32_t*>(nullptr),
                         static_cast<int32_t*>(nullptr), 0, m.Ctl());
      CheckLaunch("dispatch receive");
    }
    LlRecvArgs la{m.recvBuf, wait ? m.sigs : nullptr, m.round, W, c.rank, c.maxTokensPerRank, c.topk, c.scaleDim,
                  c.numExpertsPerRank, m.lay, m.Counts(1), r, m.rowOf.DataAs<int32_t>(), m.Ctl()};
    // On GPUs four blocks of 256 threads per SM (m.gatherPerSm), as many per local expert as the grid holds
    // whole (two H100s, 128 tokens: with a warp per row the copies took 8.4 us over 512 blocks against 11-14 us
    // over 128; with the present copies the two grids dispatched within run-to-run spread, 34.9-35.8 against
    // 34.8-38.3 us). Its blocks wait only where no other PE shares this GPU.
    const unsigned E = static_cast<unsigned>(c.numExpertsPerRank);
    const unsigned most = std::max(1u, m.gatherPerSm * m.sms);
    const unsigned blocks = most >= E ? most / E * E : most;
    const unsigned threads = m.gatherThreads;
    const size_t shared = (2 * threads + W + 2) * sizeof(int32_t);
    if (wait) {
      core::LaunchKernelEarly(LlDispatchRecvKernel, Dim3(blocks), Dim3(threads), shared, stream, la);
    } else {
      core::LaunchKernel(LlDispatchRecvKernel, Dim3(blocks), Dim3(threads), shared, stream, la);
    }
    CheckLaunch("low-latency dispatch receive");
    r.totalRecv = &m.Ctl()->rows;
    r.expertStride = static_cast<int64_t>(W) * c.maxTokensPerRank;
    return r;
  }
  // One block waits for every source's signal.
  core::LaunchKernel(ReceiveKernel, Dim3(1), Dim3(m.routeThreads), 2 * sizeof(int32_t), stream, m.sigs, m.round, W,
                     c.maxTokensPerRank, m.Counts(1), m.Counts(2), m.Total(), m.expertCounts.DataAs<int32_t>(),
                     c.numExpertsPerRank, m.Ctl());
  CheckLaunch("dispatch receive");
  if (direct) {  // the rows are in place: count them per local expert
    core::LaunchKernel(ExpertCountKernel, Dim3(m.blocks), Dim3(m.threads), 0, stream, r.indices, m.Total(), c.topk,
                       c.rank, c.numExpertsPerRank, r.expertCounts, m.Ctl());
    CheckLaunch("dispatch expert counts");
    return r;
  }
  UnpackArgs ua{m.recvBuf, m.Counts(2), m.Total(), W, c.rank, c.maxTokensPerRank, c.topk, c.scaleDim,
                c.numExpertsPerRank, m.lay, r, m.Ctl()};
  core::LaunchKernel(UnpackKernel, Dim3(m.blocks), Dim3(m.threads), 0, stream, ua);
  CheckLaunch("dispatch unpack");
  return r;
}

void EpDispatchCombineHandle::Combine(const void* expertOutput, void* output, GpuStream stream) {
  // Both pointers are checked before anything is queued.
  MORI_CHECK(impl_->numTokens == 0 || (output != nullptr && Aligned16(output)), ErrorCode::InvalidUsage,
             "Combine: output %p is null or not 16-byte aligned", output);
  CombineSend(expertOutput, stream);
  CombineRecv(output, stream);
}

void EpDispatchCombineHandle::CombineSend(const void* expertOutput, GpuStream stream) {
  Impl& m = *impl_;
  const EpDispatchCombineConfig& c = config_;
  MORI_CHECK(shmem::ShmemIsInitialized(), ErrorCode::InvalidUsage, "Combine after ShmemFinalize()");
  MORI_CHECK(m.phase == Impl::Phase::Dispatched, ErrorCode::InvalidUsage, "Combine without a Dispatch before it");
  MORI_CHECK(expertOutput != nullptr && Aligned16(expertOutput), ErrorCode::InvalidUsage,
             "Combine: expertOutput %p is null or not 16-byte aligned", expertOutput);
  m.phase = Impl::Phase::CombineSent;
  const int W = c.worldSize;
  if (c.kernel == EpKernelType::LowLatency) {
    LlCombineArgs la{static_cast<const uint8_t*>(expertOutput), m.recvBuf, m.Counts(1), m.rowOf.DataAs<int32_t>(), W,
                     c.rank, c.maxTokensPerRank, c.topk, c.numExpertsPerRank, c.hiddenDim, m.lay, m.combRecv,
                     m.combSend, m.sigs + W + c.rank, m.round, m.Ctl()};
    auto send = m.combineType == DataType::Float32    ? LlCombineSendKernel<DataType::Float32>
                : m.combineType == DataType::BFloat16 ? LlCombineSendKernel<DataType::BFloat16>
                                                      : LlCombineSendKernel<DataType::Float16>;
    core::LaunchKernel(send, Dim3(m.blocks), Dim3(m.threads), (1 + 2 * kMaxTopk) * sizeof(int32_t), stream, la);
    CheckLaunch("low-latency combine send");
    return;
  }
  const bool direct = c.kernel == EpKernelType::IntraNode;
  CombineArgs ca{static_cast<const uint8_t*>(expertOutput), m.Counts(2), m.Counts(1), m.Total(), W, c.rank,
                 c.maxTokensPerRank, m.lay, m.combRecv, m.combSend, direct,
                 m.Ctl()};
  core::LaunchKernel(CombineSendKernel, Dim3(m.blocks), Dim3(m.threads), 0, stream, ca);
  CheckLaunch("combine send");
  const size_t rowsPerPe = static_cast<size_t>(c.maxTokensPerRank) * m.lay.rowBytes;
  // Combine's rows for source s start at row offsets[s] of the staging (the received order).
  SignalArgs sa{m.Counts(1), m.combRecv + c.rank * rowsPerPe, m.combSend, rowsPerPe, m.lay.rowBytes,
                m.sigs + W + c.rank, m.Counts(2), m.round, W, direct, m.Ctl()};
  core::LaunchKernel(SignalKernel, Dim3(direct ? 1 : W), Dim3(direct ? std::max<unsigned>(W, 1) : m.threads), 0,
                     stream, sa);
  CheckLaunch("combine signal");
}

void EpDispatchCombineHandle::CombineRecv(void* output, GpuStream stream) {
  Impl& m = *impl_;
  const EpDispatchCombineConfig& c = config_;
  MORI_CHECK(shmem::ShmemIsInitialized(), ErrorCode::InvalidUsage, "CombineRecv after ShmemFinalize()");
  MORI_CHECK(m.phase == Impl::Phase::CombineSent, ErrorCode::InvalidUsage,
             "CombineRecv without a CombineSend before it");
  MORI_CHECK(m.numTokens == 0 || (output != nullptr && Aligned16(output)), ErrorCode::InvalidUsage,
             "Combine: output %p is null or not 16-byte aligned", output);
  m.phase = Impl::Phase::Idle;
  const int W = c.worldSize;
  // Waits for every PE's rows; its counts and offsets go to scratch so that the dispatch result stays intact.
  core::LaunchKernel(ReceiveKernel, Dim3(1), Dim3(m.routeThreads), 2 * sizeof(int32_t), stream, m.sigs + W, m.round,
                     W, c.maxTokensPerRank, m.Counts(3),
                     m.Counts(4), static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), 0, m.Ctl());
  CheckLaunch("combine wait");
  ReduceArgs ra{m.combRecv, m.slotOf.DataAs<int32_t>(), m.weightSum.DataAs<float>(), m.numTokens, W,
                c.maxTokensPerRank, c.hiddenDim, m.lay, static_cast<uint8_t*>(output), m.Ctl()};
  auto reduce = m.combineType == DataType::Float32    ? ReduceKernel<DataType::Float32>
                : m.combineType == DataType::BFloat16 ? ReduceKernel<DataType::BFloat16>
                                                      : ReduceKernel<DataType::Float16>;
  core::LaunchKernel(reduce, Dim3(m.blocks), Dim3(m.threads), 0, stream, ra);
  CheckLaunch("combine reduce");
}

int EpDispatchCombineHandle::Status(GpuStream stream, std::string* message) {
  MORI_CHECK_GPU(core::GpuStreamSynchronize(stream));
  Control c{};
  MORI_CHECK_GPU(core::GpuMemcpy(&c, impl_->Ctl(), sizeof(c)));
  std::string text;
  switch (c.error) {
    case kNoError: break;
    case kBadExpert:
      text = core::StrFormat("PE %d: token %d, top-k slot %d names expert %d, outside [0, %d): the round was "
                             "skipped on every PE",
                             config_.rank, c.token, c.slot, c.value, config_.numExpertsPerRank * config_.worldSize);
      break;
    case kAbortedElsewhere:
      text = core::StrFormat("PE %d: PE %d found bad input and aborted the round; nothing was sent", config_.rank,
                             c.abortedBy - 1);
      break;
    case kStaleSignal:
      text = core::StrFormat("PE %d: the signal from PE %d carried round %u, this PE is in round %llu (the PEs "
                             "did not make the same Dispatch and Combine calls)",
                             config_.rank, c.staleFrom - 1, c.staleRound, static_cast<unsigned long long>(impl_->round));
      break;
    default: text = core::StrFormat("PE %d: unknown error %d", config_.rank, c.error);
  }
  if (message != nullptr) *message = text;
  return c.error;
}

}  // namespace mori::ep
