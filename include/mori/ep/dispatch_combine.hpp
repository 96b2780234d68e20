// Expert-parallel MoE dispatch and combine on the SHMEM API (API.md section 6). Each PE sends every token to
// the PEs that hold its top-k experts (once per PE, however many of its experts live there), the experts run,
// and combine brings each PE's result back and sums it, weighted, where the token came from. Written on the
// public SHMEM device API only, so it runs on every transport (P2P, RDMA, Proxy) and backend (CUDA, HIP, HOST).
//
// Received layout (what Dispatch returns): flat, one row per (source PE, token) that reached this PE, ordered
// by source PE and, within a source, by the token's position there. Row i holds the token, its top-k expert
// ids and weights (all k of them, as the source gave them; ids of experts elsewhere included) and its scales;
// srcTokenPos[i] = source PE * maxTokensPerRank + position. Flat rather than grouped per local expert because
// a token for two local experts travels and is stored once (half the bytes at top-8 over 8 experts per PE),
// and a grouped GEMM needs a permutation anyway; expertCounts gives the rows per local expert to build it.
//
// LowLatency kernel (decode batches): every token travels once per destination PE into a fixed slot, its
// position at the source, so sending needs no slot numbering and runs in one kernel that also signals. The
// received rows are grouped per local expert (the layout a masked grouped GEMM takes): rows of local expert
// e are [e * expertStride, e * expertStride + expertCounts[e]), expertStride = worldSize * maxTokensPerRank,
// in (source PE, position) order; a token for two local experts is stored in both groups. totalRecv is the
// sum of expertCounts. Combine takes one output row per received row in that layout, weights each with the
// token's weight for that expert on the expert's PE, sums them there and sends one row per token back:
// output[t] = sum over k of weight[t][k] * the output row of (expert indices[t][k], t).
//
// Phases: DispatchSend / DispatchRecv and CombineSend / CombineRecv split each call in two (for every kernel
// type), so that work on the stream can run between the send of this PE and the wait for the others'.
//
// Round protocol: Dispatch and Combine alternate on one handle (Dispatch, Combine, Dispatch, ...) and every PE
// makes the same calls in the same order on one stream each. Results of a Dispatch live in the handle until
// the next Dispatch. Errors a kernel finds (an expert id out of range) make every PE skip that round without
// writing to any peer; Status() says what happened and where.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mori/core/gpu.hpp"

namespace mori::ep {

using core::GpuStream;

enum class DataType : int { Float32 = 0, BFloat16 = 1, Float16 = 2, Fp8E4M3 = 3 };
enum class EpKernelType : int { IntraNode = 0, InterNode = 1, LowLatency = 2 };

// Bytes of one element.
size_t DataTypeBytes(DataType type);
const char* DataTypeName(DataType type);
const char* EpKernelTypeName(EpKernelType type);

struct EpDispatchCombineConfig {
  int rank = 0, worldSize = 1;   // this PE and the number of PEs (ShmemMyPe / ShmemNPes)
  int hiddenDim = 0;             // elements per token
  int maxTokensPerRank = 0;      // tokens one rank may send in one dispatch
  int numExpertsPerRank = 0;     // experts live on PEs: expert e is on PE e / numExpertsPerRank
  int topk = 1;                  // experts per token (1..16)
  DataType dtype = DataType::BFloat16;  // of the dispatched tokens
  int scaleDim = 0;              // per-token scales travelling with fp8 tokens (e.g. hiddenDim/128), 0: none
  EpKernelType kernel = EpKernelType::IntraNode;  // IntraNode (P2P), InterNode (RDMA/Proxy), LowLatency
  int blocks = 0, warpsPerBlock = 0;              // 0: chosen by mori; warpsPerBlock at most 16
};

struct EpDispatchResult {
  void* tokens;          // [worldSize * maxTokensPerRank, hiddenDim] of dtype; rows [0, *totalRecv) valid
  float* weights;        // [.., topk]
  int32_t* indices;      // [.., topk] expert ids
  float* scales;         // [.., scaleDim], null when scaleDim is 0
  int32_t* totalRecv;    // device: rows received (-1 when the round was aborted)
  int32_t* srcTokenPos;  // device: [..] source PE * maxTokensPerRank + position there
  int32_t* expertCounts; // device: [numExpertsPerRank] rows whose top-k names local expert e (added)
  // LowLatency: rows of local expert e start at row e * expertStride; 0: the flat layout (added)
  int64_t expertStride = 0;
};

class EpDispatchCombineHandle {  // collective construction and destruction; buffers on the symmetric heap
 public:
  // Every PE passes the same config but for rank, blocks and warpsPerBlock; one that differs is refused on
  // every PE (mori::Error naming the field, the PE and both values) before any buffer is allocated.
  explicit EpDispatchCombineHandle(const EpDispatchCombineConfig& config);
  ~EpDispatchCombineHandle();
  EpDispatchCombineHandle(const EpDispatchCombineHandle&) = delete;
  EpDispatchCombineHandle& operator=(const EpDispatchCombineHandle&) = delete;

  // input [numTokens, hiddenDim] of the handle's dtype, indices [numTokens, topk] int32 expert ids, weights
  // [numTokens, topk], scales [numTokens, scaleDim] or null (scaleDim 0). All 16-byte aligned device
  // memory (host memory on HOST); weights and indices are read by this call's kernels only.
  EpDispatchResult Dispatch(const void* input, const int32_t* indices, const float* weights, const float* scales,
                            int numTokens, GpuStream stream);
  // The same, checking that the caller's tokens are of `dtype` (a dtype the handle was not built for throws).
  EpDispatchResult Dispatch(const void* input, DataType dtype, const int32_t* indices, const float* weights,
                            const float* scales, int numTokens, GpuStream stream);

  // expertOutput: [totalRecv, hiddenDim] of CombineDataType() in the order Dispatch returned, one row per
  // received token (the PE's result for it); output [numTokens, hiddenDim] of CombineDataType(): for each
  // token, the sum over the PEs it went to of (the sum of its weights for that PE's experts) * that PE's row.
  // With identity experts that is (sum of the token's weights) * token. LowLatency: expertOutput is
  // [numExpertsPerRank * expertStride, hiddenDim], one row per received row of the grouped layout, and the
  // output sums every (token, expert) row with its own weight (see above).
  void Combine(const void* expertOutput, void* output, GpuStream stream);

  // The two halves of Dispatch and Combine (added). DispatchSend returns once this PE's tokens are on their
  // way (queued on `stream`); DispatchRecv queues the wait for every PE's tokens and the result. CombineSend
  // sends this PE's expert outputs back; CombineRecv waits for the others' and writes `output`. The calls
  // alternate in this order; Dispatch and Combine are the two halves back to back.
  void DispatchSend(const void* input, const int32_t* indices, const float* weights, const float* scales,
                    int numTokens, GpuStream stream);
  EpDispatchResult DispatchRecv(GpuStream stream);
  void CombineSend(const void* expertOutput, GpuStream stream);
  void CombineRecv(void* output, GpuStream stream);

  // The dtype combine reads and writes: the dispatch dtype, BFloat16 for fp8 dispatch.
  DataType CombineDataType() const;
  const EpDispatchCombineConfig& Config() const { return config_; }

  // Waits for `stream` and reports what the kernels of the last call found: 0, or non-zero with the message
  // (an expert id out of range here, a round another PE aborted) in *message when given.
  int Status(GpuStream stream, std::string* message = nullptr);

  struct Impl;

 private:
  EpDispatchCombineConfig config_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mori::ep
