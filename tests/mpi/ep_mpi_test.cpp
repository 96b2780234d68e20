// MoE dispatch and combine (mori::ep) under `mpirun -np N` with each forced SHMEM transport. Every PE builds
// every PE's inputs from (rank, round, seed), so each one checks its dispatch result exactly against a host
// reference of the whole job (every token, weight, index, scale, source and count) and its combine output
// against (sum of the token's weights) * token with identity experts.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_buffer.hpp"
#include "mori/ep/dispatch_combine.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::ep {
namespace {

int Me() { return shmem::ShmemMyPe(); }
int N() { return shmem::ShmemNPes(); }

bool AllP2p() {
  for (int pe = 0; pe < N(); ++pe) {
    auto t = shmem::ShmemTransportType(pe);
    if (t != shmem::TransportType::P2P && t != shmem::TransportType::Self) return false;
  }
  return true;
}

float Bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float Half(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(static_cast<float>(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}
uint16_t ToHalf(float f) {  // exact for the values these tests use (multiples of 1/16 below 2^10)
  uint16_t sign = f < 0 ? 0x8000 : 0;
  f = std::fabs(f);
  if (f == 0) return sign;
  int e;
  float m = std::frexp(f, &e);  // f = m * 2^e, m in [0.5, 1)
  return sign | static_cast<uint16_t>(((e + 14) << 10) | (static_cast<int>(std::lround(m * 2048)) & 1023));
}
float Fp8(uint8_t b) {  // e4m3fn
  int e = (b >> 3) & 15, m = b & 7;
  float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(m | 8), e - 10);
  return (b & 0x80) ? -v : v;
}

enum class Routing { Uniform, Skewed, OnePe, DupPe, Mixed };

struct Inputs {
  int numTokens = 0;
  std::vector<uint8_t> tokens;   // [n, H] of dtype
  std::vector<int32_t> indices;  // [n, K]
  std::vector<float> weights;    // [n, K]
  std::vector<float> scales;     // [n, S]
};

struct Case {
  EpDispatchCombineConfig cfg;
  Routing routing;
  uint32_t seed;
  int zeroRank = -1;  // a rank that sends no tokens
};

int TokensOf(const Case& c, int rank, uint64_t round) {
  if (rank == c.zeroRank) return 0;
  if (c.routing == Routing::Mixed) {
    return static_cast<int>((c.seed * 7 + rank * 13 + round * 5) % (c.cfg.maxTokensPerRank + 1));
  }
  return c.cfg.maxTokensPerRank - rank % 2;  // the maximum on even ranks
}

Inputs MakeInputs(const Case& c, int rank, uint64_t round) {
  const auto& g = c.cfg;
  Inputs in;
  in.numTokens = TokensOf(c, rank, round);
  const int n = in.numTokens, H = g.hiddenDim, K = g.topk, S = g.scaleDim, E = g.numExpertsPerRank,
            W = g.worldSize;
  std::mt19937 rng(c.seed * 1000003u + rank * 7919u + static_cast<uint32_t>(round) * 104729u);
  const size_t eb = DataTypeBytes(g.dtype);
  in.tokens.resize(static_cast<size_t>(n) * H * eb);
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(t) * H + h;
      const float v = static_cast<float>(static_cast<int>((rank * 131 + t * 17 + h * 7 + round * 3) % 97) - 48) / 16;
      switch (g.dtype) {
        case DataType::Float32: std::memcpy(&in.tokens[i * 4], &v, 4); break;
        case DataType::BFloat16: {
          uint16_t b = ToBf16(v);
          std::memcpy(&in.tokens[i * 2], &b, 2);
          break;
        }
        case DataType::Float16: {
          uint16_t b = ToHalf(v);
          std::memcpy(&in.tokens[i * 2], &b, 2);
          break;
        }
        case DataType::Fp8E4M3: {
          uint8_t b = static_cast<uint8_t>(rng());
          if ((b & 0x7F) == 0x7F) b ^= 1;  // no NaN
          in.tokens[i] = b;
          break;
        }
      }
    }
  }
  in.indices.resize(static_cast<size_t>(n) * K);
  in.weights.resize(static_cast<size_t>(n) * K);
  for (int t = 0; t < n; ++t) {
    const int pe = static_cast<int>((t + round + rank) % W);
    for (int k = 0; k < K; ++k) {
      int e = 0;
      switch (c.routing) {
        case Routing::Uniform:
        case Routing::Mixed: e = static_cast<int>(rng() % (E * W)); break;
        case Routing::Skewed: e = k % (E * W); break;                 // every token to the same experts
        case Routing::OnePe: e = pe * E + k % E; break;               // all of a token's experts on one PE
        case Routing::DupPe: e = (k < 2 ? pe * E + k % E : static_cast<int>(rng() % (E * W))); break;
      }
      in.indices[static_cast<size_t>(t) * K + k] = e;
      in.weights[static_cast<size_t>(t) * K + k] = static_cast<float>((t + k) % 5 + 1) / 8;
    }
  }
  in.scales.resize(static_cast<size_t>(n) * S);
  for (size_t i = 0; i < in.scales.size(); ++i) in.scales[i] = static_cast<float>(rank * 1000 + i) + 0.5f;
  return in;
}

float TokenValue(const EpDispatchCombineConfig& g, const uint8_t* row, int h) {
  switch (g.dtype) {
    case DataType::Float32: {
      float v;
      std::memcpy(&v, row + h * 4, 4);
      return v;
    }
    case DataType::BFloat16: {
      uint16_t b;
      std::memcpy(&b, row + h * 2, 2);
      return Bf16(b);
    }
    case DataType::Float16: {
      uint16_t b;
      std::memcpy(&b, row + h * 2, 2);
      return Half(b);
    }
    case DataType::Fp8E4M3: return Fp8(row[h]);
  }
  return 0;
}

template <typename T>
core::GpuBuffer ToDevice(const std::vector<T>& v) {
  core::GpuBuffer b(std::max<size_t>(v.size() * sizeof(T), 16));
  if (!v.empty()) {
    EXPECT_EQ(core::GpuMemcpy(b.Data(), v.data(), v.size() * sizeof(T)), core::kGpuSuccess);
  }
  return b;
}

template <typename T>
std::vector<T> FromDevice(const void* p, size_t count) {
  std::vector<T> v(count);
  if (count > 0) {
    EXPECT_EQ(core::GpuMemcpy(v.data(), p, count * sizeof(T)), core::kGpuSuccess);
  }
  return v;
}

// One dispatch + combine round of `c` on `h`, checked (a fatal failure returns early: HasFatalFailure()).
void RunRound(EpDispatchCombineHandle& h, const Case& c, uint64_t round) {
  const auto& g = c.cfg;
  const int W = N(), me = Me(), H = g.hiddenDim, K = g.topk, S = g.scaleDim, E = g.numExpertsPerRank,
            M = g.maxTokensPerRank;
  const size_t eb = DataTypeBytes(g.dtype), tokenBytes = H * eb;
  std::vector<Inputs> all;
  for (int r = 0; r < W; ++r) all.push_back(MakeInputs(c, r, round));
  const Inputs& mine = all[me];
  auto dTokens = ToDevice(mine.tokens);
  auto dIdx = ToDevice(mine.indices);
  auto dW = ToDevice(mine.weights);
  auto dS = ToDevice(mine.scales);
  // Odd rounds make the one-call Dispatch and Combine, even ones their two halves.
  const bool split = round % 2 == 0;
  EpDispatchResult res;
  if (split) {
    h.DispatchSend(dTokens.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(), S > 0 ? dS.DataAs<float>() : nullptr,
                   mine.numTokens, nullptr);
    res = h.DispatchRecv(nullptr);
  } else {
    res = h.Dispatch(dTokens.Data(), g.dtype, dIdx.DataAs<int32_t>(), dW.DataAs<float>(),
                     S > 0 ? dS.DataAs<float>() : nullptr, mine.numTokens, nullptr);
  }
  std::string msg;
  ASSERT_EQ(h.Status(nullptr, &msg), 0) << msg;

  // The reference: (row, source, position). Flat: the tokens with an expert here in (source, position)
  // order. LowLatency: per local expert e, the tokens naming it in that order, from row e * stride.
  const bool ll = g.kernel == EpKernelType::LowLatency;
  const int64_t stride = ll ? static_cast<int64_t>(W) * M : 0;
  ASSERT_EQ(res.expertStride, stride);
  struct Want {
    int64_t row;
    int s, t;
  };
  std::vector<Want> rows;
  std::vector<int32_t> wantExpert(E, 0);
  for (int s = 0; s < W; ++s) {
    for (int t = 0; t < all[s].numTokens; ++t) {
      bool here = false;
      for (int k = 0; k < K; ++k) {
        int e = all[s].indices[static_cast<size_t>(t) * K + k];
        if (e / E == me) {
          here = true;
          ++wantExpert[e % E];
        }
      }
      if (here && !ll) rows.push_back({static_cast<int64_t>(rows.size()), s, t});
    }
  }
  if (ll) {  // a row per (token, expert) however often the token names the expert
    for (int e = 0; e < E; ++e) {
      int64_t r = 0;
      for (int s = 0; s < W; ++s) {
        for (int t = 0; t < all[s].numTokens; ++t) {
          bool names = false;
          for (int k = 0; k < K; ++k) names |= all[s].indices[static_cast<size_t>(t) * K + k] == me * E + e;
          if (names) rows.push_back({e * stride + r++, s, t});
        }
      }
      wantExpert[e] = static_cast<int32_t>(r);
    }
  }
  const int total = FromDevice<int32_t>(res.totalRecv, 1)[0];
  ASSERT_EQ(total, static_cast<int>(rows.size())) << "round " << round;
  // Every row the result can have (the grouped layout has gaps between the experts' rows).
  const size_t span = ll ? static_cast<size_t>(E * stride) : static_cast<size_t>(total);
  auto tokens = FromDevice<uint8_t>(res.tokens, span * tokenBytes);
  auto idx = FromDevice<int32_t>(res.indices, span * K);
  auto wts = FromDevice<float>(res.weights, span * K);
  auto src = FromDevice<int32_t>(res.srcTokenPos, span);
  auto counts = FromDevice<int32_t>(res.expertCounts, E);
  std::vector<float> scl;
  if (S > 0) scl = FromDevice<float>(res.scales, span * S);
  size_t bad = 0;
  for (size_t n = 0; n < rows.size() && bad < 5; ++n) {
    const size_t i = static_cast<size_t>(rows[n].row);
    const int s = rows[n].s, t = rows[n].t;
    const Inputs& in = all[s];
    bad += src[i] != s * M + t;
    bad += std::memcmp(&tokens[i * tokenBytes], &in.tokens[t * tokenBytes], tokenBytes) != 0;
    bad += std::memcmp(&idx[i * K], &in.indices[static_cast<size_t>(t) * K], K * 4) != 0;
    bad += std::memcmp(&wts[i * K], &in.weights[static_cast<size_t>(t) * K], K * 4) != 0;
    if (S > 0) bad += std::memcmp(&scl[i * S], &in.scales[static_cast<size_t>(t) * S], S * 4) != 0;
    if (bad) ADD_FAILURE() << "round " << round << " PE " << me << " row " << i << ": want source " << s << " token " << t
                           << ", got source position " << src[i];
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(counts, wantExpert) << "rows per local expert, round " << round;

  // Identity experts: the received tokens in combine's dtype.
  const DataType ct = h.CombineDataType();
  const size_t cb = DataTypeBytes(ct);
  core::GpuBuffer expertOut(std::max<size_t>(span * H * cb, 16));
  if (ct == g.dtype) {
    if (span > 0) {
      ASSERT_EQ(core::GpuMemcpy(expertOut.Data(), res.tokens, span * tokenBytes), core::kGpuSuccess);
    }
  } else {
    std::vector<uint16_t> conv(span * H);
    for (const Want& w : rows) {
      const size_t i = static_cast<size_t>(w.row);
      for (int x = 0; x < H; ++x) conv[i * H + x] = ToBf16(TokenValue(g, &tokens[i * tokenBytes], x));
    }
    if (span > 0) {
      ASSERT_EQ(core::GpuMemcpy(expertOut.Data(), conv.data(), conv.size() * 2), core::kGpuSuccess);
    }
  }
  // The output with a guard row on each side.
  const size_t outRow = H * cb;
  const size_t outBytes = (mine.numTokens + 2) * outRow + 16;
  std::vector<uint8_t> guard(outBytes, 0x5A);
  auto dOut = ToDevice(guard);
  uint8_t* out = dOut.DataAs<uint8_t>() + ((outRow + 15) & ~size_t(15));
  const size_t lead = (outRow + 15) & ~size_t(15);
  if (split) {
    h.CombineSend(expertOut.Data(), nullptr);
    h.CombineRecv(out, nullptr);
  } else {
    h.Combine(expertOut.Data(), out, nullptr);
  }
  ASSERT_EQ(h.Status(nullptr, &msg), 0) << msg;
  auto got = FromDevice<uint8_t>(dOut.Data(), outBytes);
  const double tol = ct == DataType::Float32 ? 1e-5 : ct == DataType::Float16 ? 2e-3 : 1e-2;
  size_t wrong = 0;
  for (int t = 0; t < mine.numTokens; ++t) {
    float wsum = 0;
    for (int k = 0; k < K; ++k) wsum += mine.weights[static_cast<size_t>(t) * K + k];
    for (int x = 0; x < H; ++x) {
      float x0 = TokenValue(g, &mine.tokens[t * tokenBytes], x);
      if (ct != g.dtype) x0 = Bf16(ToBf16(x0));
      const float want = wsum * x0;
      const uint8_t* p = &got[lead + t * outRow + x * cb];
      float v;
      if (ct == DataType::Float32) {
        std::memcpy(&v, p, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, p, 2);
        v = ct == DataType::BFloat16 ? Bf16(b) : Half(b);
      }
      if (std::fabs(v - want) > tol * std::max(1.0f, std::fabs(want))) {
        if (wrong++ < 3) ADD_FAILURE() << "combine round " << round << " PE " << me << " token " << t << " elem " << x
                                       << ": " << v << ", want " << want;
      }
    }
  }
  EXPECT_EQ(wrong, 0u);
  for (size_t i = 0; i < lead; ++i) ASSERT_EQ(got[i], 0x5A) << "combine wrote before the output";
  for (size_t i = lead + mine.numTokens * outRow; i < outBytes; ++i) ASSERT_EQ(got[i], 0x5A) << "combine wrote past it";
}

EpDispatchCombineConfig Config(EpKernelType kernel, DataType dtype, int topk, int hidden = 72, int maxTokens = 24,
                               int experts = 3, int scaleDim = 0) {
  EpDispatchCombineConfig c;
  c.rank = Me();
  c.worldSize = N();
  c.hiddenDim = hidden;
  c.maxTokensPerRank = maxTokens;
  c.numExpertsPerRank = experts;
  c.topk = topk;
  c.dtype = dtype;
  c.scaleDim = scaleDim;
  c.kernel = kernel;
  return c;
}

std::vector<EpKernelType> Kernels() {
  std::vector<EpKernelType> k{EpKernelType::InterNode, EpKernelType::LowLatency};
  if (AllP2p()) k.push_back(EpKernelType::IntraNode);
  return k;
}

TEST(EpTest, EveryRoutingAndDtype) {
  struct Shape {
    DataType dtype;
    int topk, scaleDim, hidden;
  };
  const Shape shapes[] = {{DataType::Float32, 1, 0, 72}, {DataType::BFloat16, 8, 0, 100},
                          {DataType::Float16, 2, 0, 33}, {DataType::Fp8E4M3, 8, 4, 128}};
  const Routing routings[] = {Routing::Uniform, Routing::Skewed, Routing::OnePe, Routing::DupPe};
  for (EpKernelType kernel : Kernels()) {
    for (const Shape& s : shapes) {
      Case c{Config(kernel, s.dtype, s.topk, s.hidden, 24, 3, s.scaleDim), Routing::Uniform, 1};
      EpDispatchCombineHandle h(c.cfg);
      uint64_t round = 1;
      for (Routing r : routings) {
        c.routing = r;
        c.zeroRank = r == Routing::Skewed ? N() - 1 : -1;
        SCOPED_TRACE(std::string(EpKernelTypeName(kernel)) + " " + DataTypeName(s.dtype) + " topk " +
                     std::to_string(s.topk) + " routing " + std::to_string(static_cast<int>(r)));
        RunRound(h, c, round++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(EpTest, HundredRoundsWithChangingRoutings) {
  for (EpKernelType kernel : Kernels()) {
    Case c{Config(kernel, DataType::BFloat16, 4, 40, 16, 2), Routing::Mixed, 7};
    EpDispatchCombineHandle h(c.cfg);
    for (uint64_t round = 1; round <= 100; ++round) {
      c.seed = static_cast<uint32_t>(round * 31);
      SCOPED_TRACE(std::string(EpKernelTypeName(kernel)) + " round " + std::to_string(round));
      RunRound(h, c, round);
      if (HasFatalFailure()) return;
    }
  }
}

// More blocks than slots: the LowLatency receive gives each expert several blocks and the combine splits each
// message's hidden units over several blocks (one warp per block; on HOST one thread per block). The grids
// differ between PEs (a local launch choice): LowLatency's senders split a round's arrival count over their
// own grids.
TEST(EpTest, WideGridsSplitExpertsAndMessagesOverBlocks) {
  for (EpKernelType kernel : Kernels()) {
    for (DataType dtype : {DataType::BFloat16, DataType::Float32}) {
      Case c{Config(kernel, dtype, 3, 48, 4, 2), Routing::Mixed, 11};
      c.cfg.blocks = 2 * N() * c.cfg.maxTokensPerRank + 3 + 7 * Me();
      c.cfg.warpsPerBlock = 1;
      EpDispatchCombineHandle h(c.cfg);
      for (uint64_t round = 1; round <= 4; ++round) {
        c.seed = static_cast<uint32_t>(round * 17 + 5);
        c.routing = round % 2 == 0 ? Routing::Uniform : Routing::DupPe;
        SCOPED_TRACE(std::string(EpKernelTypeName(kernel)) + " round " + std::to_string(round));
        RunRound(h, c, round);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(EpTest, BadExpertAbortsTheRoundOnEveryPeAndTheNextRoundWorks) {
  for (EpKernelType kernel : Kernels()) {
    Case c{Config(kernel, DataType::Float32, 2, 16, 8, 2), Routing::Uniform, 3};
    EpDispatchCombineHandle h(c.cfg);
    Inputs in = MakeInputs(c, Me(), 1);
    if (Me() == N() - 1) in.indices[5] = 2 * N() + 40;  // token 2, top-k slot 1
    auto dTokens = ToDevice(in.tokens);
    auto dIdx = ToDevice(in.indices);
    auto dW = ToDevice(in.weights);
    EpDispatchResult res = h.Dispatch(dTokens.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(), nullptr,
                                      in.numTokens, nullptr);
    std::string msg;
    EXPECT_NE(h.Status(nullptr, &msg), 0);
    if (Me() == N() - 1) {
      EXPECT_NE(msg.find("token 2, top-k slot 1 names expert " + std::to_string(2 * N() + 40)), std::string::npos)
          << msg;
    } else {
      EXPECT_NE(msg.find("PE " + std::to_string(N() - 1) + " found bad input"), std::string::npos) << msg;
    }
    EXPECT_EQ(FromDevice<int32_t>(res.totalRecv, 1)[0], -1);
    std::vector<float> guard(in.numTokens * 16 + 4, -3.5f);
    auto dOut = ToDevice(guard);
    core::GpuBuffer expertOut(16 * 4 * 8 * N());
    h.Combine(expertOut.Data(), dOut.Data(), nullptr);
    EXPECT_NE(h.Status(nullptr, &msg), 0);
    EXPECT_EQ(FromDevice<float>(dOut.Data(), guard.size()), guard) << "an aborted round wrote the output";
    RunRound(h, c, 2);
  }
}

TEST(EpTest, HostCheckedBadInputThrowsBeforeAnythingRuns) {
  Case c{Config(EpKernelType::InterNode, DataType::BFloat16, 2, 16, 8, 2), Routing::Uniform, 5};
  EpDispatchCombineHandle h(c.cfg);
  Inputs in = MakeInputs(c, Me(), 1);
  auto dTokens = ToDevice(in.tokens);
  auto dIdx = ToDevice(in.indices);
  auto dW = ToDevice(in.weights);
  auto expectThrow = [](auto&& call, const char* words) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming: " << words;
    } catch (const core::Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expectThrow([&] { h.Dispatch(dTokens.Data(), dIdx.DataAs<int32_t>(), dW.DataAs<float>(), nullptr, 9, nullptr); },
              "9 tokens, the handle takes 0..8");
  expectThrow([&] { h.Dispatch(nullptr, dIdx.DataAs<int32_t>(), dW.DataAs<float>(), nullptr, 4, nullptr); },
              "must not be null");
  expectThrow([&] {
    h.Dispatch(dTokens.DataAs<uint8_t>() + 2, dIdx.DataAs<int32_t>(), dW.DataAs<float>(), nullptr, 4, nullptr);
  }, "16-byte aligned");
  expectThrow([&] {
    h.Dispatch(dTokens.Data(), DataType::Float16, dIdx.DataAs<int32_t>(), dW.DataAs<float>(), nullptr, 4, nullptr);
  }, "the tokens are float16, this handle was built for bfloat16");
  expectThrow([&] { h.Combine(dTokens.Data(), dTokens.Data(), nullptr); }, "Combine without a Dispatch");
  auto bad = c.cfg;
  bad.topk = 17;
  expectThrow([&] { EpDispatchCombineHandle x(bad); }, "topk 17 outside [1, 16]");
  bad = c.cfg;
  bad.kernel = static_cast<EpKernelType>(7);
  expectThrow([&] { EpDispatchCombineHandle x(bad); }, "kernel type 7 is not an EpKernelType");
  bad = c.cfg;
  bad.warpsPerBlock = 17;  // more threads than the kernels are compiled for
  expectThrow([&] { EpDispatchCombineHandle x(bad); }, "warpsPerBlock 17: at most 16");
  expectThrow([&] { h.DispatchRecv(nullptr); }, "DispatchRecv without a DispatchSend");
  expectThrow([&] { h.CombineRecv(dTokens.Data(), nullptr); }, "CombineRecv without a CombineSend");
  if (!AllP2p()) {
    bad = c.cfg;
    bad.kernel = EpKernelType::IntraNode;
    expectThrow([&] { EpDispatchCombineHandle x(bad); }, "use EpKernelType::InterNode");
  }
  // After all of that the handle still works.
  RunRound(h, c, 1);
}

// A config that differs between PEs is refused on every PE, naming the field and both values, before any
// buffer is allocated; a handle built right afterwards works (the heap stayed symmetric).
TEST(EpTest, ConfigsThatDifferBetweenPesAreRefusedOnEveryPe) {
  if (N() < 2) GTEST_SKIP() << "needs two PEs";
  Case c{Config(EpKernelType::InterNode, DataType::BFloat16, 2, 16, 8, 2), Routing::Uniform, 9};
  for (int field = 0; field < 3; ++field) {
    auto bad = c.cfg;
    const bool odd = Me() == N() - 1;  // the last PE differs
    const char* name = field == 0 ? "hiddenDim" : field == 1 ? "topk" : "dtype";
    if (field == 0 && odd) bad.hiddenDim = 32;
    if (field == 1 && odd) bad.topk = 3;
    if (field == 2 && odd) bad.dtype = DataType::Float16;
    try {
      EpDispatchCombineHandle x(bad);
      ADD_FAILURE() << "PE " << Me() << ": a handle was built although PE " << N() - 1 << "'s " << name << " differs";
    } catch (const core::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string(" with ") + name + " "), std::string::npos) << what;
      EXPECT_NE(what.find("every PE must pass the same config"), std::string::npos) << what;
      const std::string other = odd ? "PE 0 was built" : "PE " + std::to_string(N() - 1) + " was built";
      EXPECT_NE(what.find(other), std::string::npos) << what;
    }
  }
  EpDispatchCombineHandle h(c.cfg);
  RunRound(h, c, 1);
}

TEST(EpTest, HandlesComeAndGoWithoutLeakingTheHeap) {
  // Each handle takes about a third of the heap: a leak would fail by the fourth.
  const size_t heap = shmem::ShmemHeapBytes();
  const int hidden = 256, tokens = static_cast<int>(heap / 3 / (N() * (2 * (hidden * 4 + 64) + hidden * 4)));
  ASSERT_GT(tokens, 4);
  for (int i = 0; i < 12; ++i) {
    Case c{Config(EpKernelType::InterNode, DataType::Float32, 2, hidden, tokens, 2), Routing::Uniform,
           static_cast<uint32_t>(i)};
    EpDispatchCombineHandle h(c.cfg);
    if (i % 4 == 0) RunRound(h, c, 1);
  }
}

}  // namespace
}  // namespace mori::ep

namespace {
class ShmemEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { ASSERT_EQ(mori::shmem::ShmemInit(), 0); }
  void TearDown() override { EXPECT_EQ(mori::shmem::ShmemFinalize(), 0); }
};
[[maybe_unused]] ::testing::Environment* const kEnv = ::testing::AddGlobalTestEnvironment(new ShmemEnvironment);
}  // namespace
