// The DLPack exchange structures (v0.8 layout, the version torch 1.13 and 2.x read from a "dltensor" capsule),
// written from the DLPack specification so that the module needs neither dlpack.h nor torch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::python {

enum DLDeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLROCM = 10,
};

struct DLDevice {
  DLDeviceType device_type;
  int32_t device_id;
};

enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
};

struct DLDataType {
  uint8_t code;    // a DLDataTypeCode
  uint8_t bits;    // per lane
  uint16_t lanes;  // 1 for scalars
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major (we always fill it)
  uint64_t byte_offset;
};

// The consumer takes ownership: it renames the capsule "used_dltensor" and calls deleter when done.
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

constexpr const char* kDlpackCapsuleName = "dltensor";

static_assert(sizeof(DLDevice) == 8 && sizeof(DLDataType) == 4, "DLPack scalar layouts");
static_assert(offsetof(DLTensor, device) == 8 && offsetof(DLTensor, ndim) == 16 && offsetof(DLTensor, dtype) == 20 &&
                  offsetof(DLTensor, shape) == 24 && offsetof(DLTensor, strides) == 32 &&
                  offsetof(DLTensor, byte_offset) == 40 && sizeof(DLTensor) == 48,
              "DLTensor layout");
static_assert(offsetof(DLManagedTensor, manager_ctx) == 48 && offsetof(DLManagedTensor, deleter) == 56 &&
                  sizeof(DLManagedTensor) == 64,
              "DLManagedTensor layout");

}  // namespace mori::python
