#include "mori/rdma/rdma.hpp"

#include "backends.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"

namespace mori::rdma {

const char* RdmaBackendName(RdmaBackendType backend) {
  switch (backend) {
    case RdmaBackendType::DirectVerbs: return "DirectVerbs";
    case RdmaBackendType::IBVerbs: return "IBVerbs";
    case RdmaBackendType::Emulated: return "Emulated";
  }
  return "?";
}

RdmaBackendType RdmaBackendFromEnvironment() {
  std::string choice = core::EnvGetChoice("MORI_RDMA_BACKEND");
  if (choice == "directverbs") return RdmaBackendType::DirectVerbs;
  if (choice == "ibverbs") return RdmaBackendType::IBVerbs;
  if (choice == "emulated") return RdmaBackendType::Emulated;
  // auto: a NIC the GPU can drive, else the emulated one.
  RdmaContext probe(RdmaBackendType::DirectVerbs);
  return probe.GetRdmaDeviceList().empty() ? RdmaBackendType::Emulated : RdmaBackendType::DirectVerbs;
}

RdmaDevice::~RdmaDevice() = default;

RdmaDeviceContext* RdmaDevice::CreateRdmaDeviceContext() {
  contexts_.push_back(NewContext());
  return contexts_.back().get();
}

ActiveDevicePortList GetActiveDevicePortList(const RdmaDeviceList& devices) {
  ActiveDevicePortList ports;
  for (RdmaDevice* d : devices) {
    for (uint32_t p : d->ActivePorts()) ports.emplace_back(d, p);
  }
  return ports;
}

RdmaContext::RdmaContext(RdmaBackendType backend) : backend_(backend) {
  switch (backend) {
    case RdmaBackendType::Emulated:
      devices_ = EnumerateEmulatedDevices();
      break;
    case RdmaBackendType::DirectVerbs:
      devices_ = EnumerateVerbsDevices(true);
      break;
    case RdmaBackendType::IBVerbs:
      devices_ = EnumerateVerbsDevices(false);
      break;
  }
  for (auto& d : devices_) list_.push_back(d.get());
  MORI_LOG_INFO(Rdma, "%s backend: %zu device(s)", RdmaBackendName(backend), list_.size());
}

RdmaContext::~RdmaContext() = default;

namespace mlx5 {

const char* SyndromeName(uint8_t syndrome) {
  switch (syndrome) {
    case kSyndromeLocalLengthErr: return "local length error";
    case kSyndromeLocalQpOpErr: return "local QP operation error";
    case kSyndromeLocalProtErr: return "local protection error";
    case kSyndromeWrFlushErr: return "work request flushed";
    case kSyndromeMwBindErr: return "memory window bind error";
    case kSyndromeBadRespErr: return "bad response";
    case kSyndromeLocalAccessErr: return "local access error";
    case kSyndromeRemoteInvalReqErr: return "remote invalid request";
    case kSyndromeRemoteAccessErr: return "remote access error";
    case kSyndromeRemoteOpErr: return "remote operation error";
    case kSyndromeTransportRetryExcErr: return "transport retries exceeded";
    case kSyndromeRnrRetryExcErr: return "receiver-not-ready retries exceeded";
    case kSyndromeRemoteAbortedErr: return "remote aborted";
  }
  return "unknown syndrome";
}

const char* OpcodeName(uint8_t opcode) {
  switch (opcode) {
    case kOpcodeNop: return "NOP";
    case kOpcodeRdmaWrite: return "RDMA_WRITE";
    case kOpcodeRdmaWriteImm: return "RDMA_WRITE_IMM";
    case kOpcodeSend: return "SEND";
    case kOpcodeSendImm: return "SEND_IMM";
    case kOpcodeRdmaRead: return "RDMA_READ";
    case kOpcodeAtomicCompareSwap: return "ATOMIC_CS";
    case kOpcodeAtomicFetchAdd: return "ATOMIC_FA";
    case kOpcodeAtomicMaskedCompareSwap: return "ATOMIC_MASKED_CS";
    case kOpcodeAtomicMaskedFetchAdd: return "ATOMIC_MASKED_FA";
  }
  return "unknown opcode";
}

}  // namespace mlx5

}  // namespace mori::rdma
