#include "verbs_api.hpp"

#include <dlfcn.h>

#include <mutex>

#include "mori/core/format.hpp"
#include "mori/core/logging.hpp"
#include "mori/rdma/mlx5/mlx5_prm.hpp"

namespace mori::rdma::verbs {

namespace {

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn& fn, std::string* missing) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (fn == nullptr && missing != nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return fn != nullptr;
}

void Load(VerbsApi& api) {
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    api.whyNot = core::StrFormat("libibverbs.so.1 cannot be loaded (%s): rdma-core is not installed", dlerror());
    return;
  }
  std::string missing;
  Resolve(lib, "ibv_get_device_list", api.getDeviceList, &missing);
  Resolve(lib, "ibv_free_device_list", api.freeDeviceList, &missing);
  Resolve(lib, "ibv_get_device_name", api.getDeviceName, &missing);
  Resolve(lib, "ibv_open_device", api.openDevice, &missing);
  Resolve(lib, "ibv_close_device", api.closeDevice, &missing);
  Resolve(lib, "ibv_query_device", api.queryDevice, &missing);
  Resolve(lib, "ibv_query_port", api.queryPort, &missing);
  Resolve(lib, "ibv_query_gid", api.queryGid, &missing);
  Resolve(lib, "ibv_alloc_pd", api.allocPd, &missing);
  Resolve(lib, "ibv_dealloc_pd", api.deallocPd, &missing);
  Resolve(lib, "ibv_reg_mr", api.regMr, &missing);
  Resolve(lib, "ibv_dereg_mr", api.deregMr, &missing);
  Resolve(lib, "ibv_create_cq", api.createCq, &missing);
  Resolve(lib, "ibv_destroy_cq", api.destroyCq, &missing);
  Resolve(lib, "ibv_create_qp", api.createQp, &missing);
  Resolve(lib, "ibv_modify_qp", api.modifyQp, &missing);
  Resolve(lib, "ibv_destroy_qp", api.destroyQp, &missing);
  Resolve(lib, "ibv_reg_dmabuf_mr", api.regDmabufMr, nullptr);
  if (!missing.empty()) {
    api.whyNot = "libibverbs.so.1 lacks " + missing;
    return;
  }
  api.available = true;
  void* mlx5 = dlopen("libmlx5.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (mlx5 != nullptr && Resolve(mlx5, "mlx5dv_init_obj", api.mlx5dvInitObj, nullptr)) {
    Resolve(mlx5, "mlx5dv_is_supported", api.mlx5dvIsSupported, nullptr);
    api.mlx5Available = true;
  }
}

}  // namespace

const VerbsApi& VerbsApi::Get() {
  static VerbsApi api;
  static std::once_flag once;
  std::call_once(once, [] { Load(api); });
  return api;
}

uint8_t SyndromeOfStatus(ibv_wc_status status) {
  using namespace mlx5;
  switch (status) {
    case IBV_WC_SUCCESS: return 0;
    case IBV_WC_LOC_LEN_ERR: return kSyndromeLocalLengthErr;
    case IBV_WC_LOC_QP_OP_ERR: return kSyndromeLocalQpOpErr;
    case IBV_WC_LOC_PROT_ERR: return kSyndromeLocalProtErr;
    case IBV_WC_WR_FLUSH_ERR: return kSyndromeWrFlushErr;
    case IBV_WC_MW_BIND_ERR: return kSyndromeMwBindErr;
    case IBV_WC_BAD_RESP_ERR: return kSyndromeBadRespErr;
    case IBV_WC_LOC_ACCESS_ERR: return kSyndromeLocalAccessErr;
    case IBV_WC_REM_INV_REQ_ERR: return kSyndromeRemoteInvalReqErr;
    case IBV_WC_REM_ACCESS_ERR: return kSyndromeRemoteAccessErr;
    case IBV_WC_REM_OP_ERR: return kSyndromeRemoteOpErr;
    case IBV_WC_RETRY_EXC_ERR: return kSyndromeTransportRetryExcErr;
    case IBV_WC_RNR_RETRY_EXC_ERR: return kSyndromeRnrRetryExcErr;
    case IBV_WC_REM_ABORT_ERR: return kSyndromeRemoteAbortedErr;
    default: return kSyndromeRemoteOpErr;
  }
}

}  // namespace mori::rdma::verbs
