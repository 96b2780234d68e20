// libibverbs and libmlx5 reached through a symbol table filled with dlopen/dlsym at first use, so mori
// loads and runs on machines without rdma-core (and tests can see why a backend is unavailable).
#pragma once

#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>

#include <string>

namespace mori::rdma::verbs {

struct VerbsApi {
  bool available = false;      // libibverbs loaded with every required symbol
  bool mlx5Available = false;  // libmlx5 loaded with mlx5dv_init_obj
  std::string whyNot;          // when not available

  ibv_device** (*getDeviceList)(int*) = nullptr;
  void (*freeDeviceList)(ibv_device**) = nullptr;
  const char* (*getDeviceName)(ibv_device*) = nullptr;
  ibv_context* (*openDevice)(ibv_device*) = nullptr;
  int (*closeDevice)(ibv_context*) = nullptr;
  int (*queryDevice)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*queryPort)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;
  int (*queryGid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*allocPd)(ibv_context*) = nullptr;
  int (*deallocPd)(ibv_pd*) = nullptr;
  ibv_mr* (*regMr)(ibv_pd*, void*, size_t, int) = nullptr;
  ibv_mr* (*regDmabufMr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;  // optional (rdma-core >= 34)
  int (*deregMr)(ibv_mr*) = nullptr;
  ibv_cq* (*createCq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroyCq)(ibv_cq*) = nullptr;
  ibv_qp* (*createQp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*modifyQp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*destroyQp)(ibv_qp*) = nullptr;
  int (*mlx5dvInitObj)(mlx5dv_obj*, uint64_t) = nullptr;
  bool (*mlx5dvIsSupported)(ibv_device*) = nullptr;

  static const VerbsApi& Get();
};

// The mlx5 syndrome that corresponds to a verbs completion status (so every backend reports errors alike).
uint8_t SyndromeOfStatus(ibv_wc_status status);

}  // namespace mori::rdma::verbs
