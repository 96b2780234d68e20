// mori._mori, the extension module under the Python package: the SHMEM host API with Python errors (a failed
// call raises mori.MoriError carrying the line mori logged for it) and symmetric memory handed out as DLPack
// capsules, which mori/shmem.py turns into torch tensors: the module links no torch, so one build serves any.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dlpack.hpp"
#include "mori/core/config.hpp"
#include "mori/core/format.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/logging.hpp"
#include "mori/ep/dispatch_combine.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace py = pybind11;

namespace mori::python {
namespace {

class MoriError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The GPU the runtime put the heap on (init chooses it): the device of every tensor on the heap.
int heapDevice = 0;

[[noreturn]] void RaiseLogged(const char* op) {
  std::string cause = core::LastError();
  throw MoriError(std::string(op) + ": " + (cause.empty() ? "failed (mori logged no cause)" : cause));
}

void RequireInit(const char* op) {
  if (!shmem::ShmemIsInitialized()) {
    throw MoriError(std::string(op) + ": called before mori.shmem.init() (or after mori.shmem.finalize())");
  }
}

// Runs one C-style SHMEM call with the GIL released (it may wait for every PE). The calling thread's last
// error is cleared first: a call that returns no code fails by logging an error line (LoggedError() after it).
template <typename F>
auto Unlocked(F&& call) {
  core::ClearLastError();
  py::gil_scoped_release unlocked;
  return call();
}

bool LoggedError() { return core::LastError()[0] != '\0'; }

void CheckCode(const char* op, int rc) {
  if (rc != 0) RaiseLogged(op);
}

void RecordHeapDevice() {
  int device = 0;
  if (core::GpuGetDevice(&device) == core::kGpuSuccess) heapDevice = device;
}

DLDevice HeapDlDevice() {
#if MORI_BACKEND_CUDA
  return {kDLCUDA, heapDevice};
#elif MORI_BACKEND_HIP
  return {kDLROCM, heapDevice};
#else
  return {kDLCPU, 0};
#endif
}

void Init() {
  CheckCode("mori.shmem.init", Unlocked([] { return shmem::ShmemInit(); }));
  RecordHeapDevice();
}

py::bytes GetUniqueId() {
  shmem::mori_shmem_uniqueid_t uid{};
  CheckCode("mori.shmem.init_from_process_group", Unlocked([&] { return shmem::ShmemGetUniqueId(&uid); }));
  return py::bytes(reinterpret_cast<const char*>(uid.internal), sizeof(uid.internal));
}

void InitWithUniqueId(int rank, int nRanks, const std::string& id) {
  const char* op = "mori.shmem.init_from_process_group";
  shmem::mori_shmem_uniqueid_t uid{};
  if (id.size() != sizeof(uid.internal)) {
    throw MoriError(core::StrFormat("%s: the unique id has %zu bytes, not %zu", op, id.size(), sizeof(uid.internal)));
  }
  std::copy(id.begin(), id.end(), uid.internal);
  shmem::mori_shmem_init_attr_t attr;
  CheckCode(op, Unlocked([&] { return shmem::ShmemSetAttrUniqueIdArgs(rank, nRanks, &uid, &attr); }));
  CheckCode(op, Unlocked([&] { return shmem::ShmemInitAttr(shmem::MORI_SHMEM_INIT_WITH_UNIQUEID, &attr); }));
  RecordHeapDevice();
}

void Finalize() {
  CheckCode("mori.shmem.finalize", Unlocked([] { return shmem::ShmemFinalize(); }));
}

int MyPe() {
  RequireInit("mori.shmem.my_pe");
  return shmem::ShmemMyPe();
}

int NPes() {
  RequireInit("mori.shmem.n_pes");
  return shmem::ShmemNPes();
}

void CheckPe(const char* op, int pe) {
  int n = shmem::ShmemNPes();
  if (pe < 0 || pe >= n) throw MoriError(core::StrFormat("%s: PE %d is not in [0, %d)", op, pe, n));
}

shmem::TransportType Transport(int pe) {
  const char* op = "mori.shmem.transport";
  RequireInit(op);
  CheckPe(op, pe);
  shmem::TransportType t = Unlocked([pe] { return shmem::ShmemTransportType(pe); });
  if (LoggedError()) RaiseLogged(op);
  return t;
}

size_t HeapBytes() {
  RequireInit("mori.shmem.heap_bytes");
  return shmem::ShmemHeapBytes();
}

// Collective. Zero-filled, so that a tensor never shows what an earlier one left.
uintptr_t Allocate(size_t bytes) {
  const char* op = "mori.shmem.tensor";
  RequireInit(op);
  if (bytes == 0) throw MoriError(core::StrFormat("%s: zero bytes requested", op));
  void* p = Unlocked([bytes] { return shmem::ShmemCalloc(1, bytes); });
  if (p == nullptr) RaiseLogged(op);
  return reinterpret_cast<uintptr_t>(p);
}

void Free(uintptr_t address) {
  const char* op = "mori.shmem.free_tensor";
  RequireInit(op);
  Unlocked([address] { shmem::ShmemFree(reinterpret_cast<void*>(address)); });
  if (LoggedError()) RaiseLogged(op);
}

void BarrierAll() {
  const char* op = "mori.shmem.barrier_all";
  RequireInit(op);
  Unlocked([] { shmem::ShmemBarrierAll(); });
  if (LoggedError()) RaiseLogged(op);
}

// Where `pe`'s copy of [address, address + bytes) is mapped in this process, or None where the transport to
// `pe` maps nothing. The range must lie on this PE's heap.
std::optional<uintptr_t> PeerAddress(uintptr_t address, size_t bytes, int pe) {
  const char* op = "mori.shmem.peer_tensor";
  RequireInit(op);
  CheckPe(op, pe);
  int me = shmem::ShmemMyPe();
  auto* first = reinterpret_cast<const void*>(address);
  auto* last = reinterpret_cast<const void*>(address + (bytes == 0 ? 0 : bytes - 1));
  if (shmem::ShmemPtr(first, me) == nullptr || shmem::ShmemPtr(last, me) == nullptr) {
    throw MoriError(
        core::StrFormat("%s: [%p, +%zu bytes) is not on this PE's symmetric heap (it starts at %p); "
                        "pass a tensor from mori.shmem.tensor() or a view of one",
                        op, first, bytes, shmem::ShmemHeapBase()));
  }
  void* peer = shmem::ShmemPtr(first, pe);
  if (peer == nullptr) return std::nullopt;
  return reinterpret_cast<uintptr_t>(peer);
}

// ---- calls ordered on a stream, teams, registration ----

// A stream handle from Python (torch's cuda_stream integer; 0: the default stream).
core::GpuStream StreamOf(uintptr_t handle) { return reinterpret_cast<core::GpuStream>(handle); }

// On HOST a "stream" is a worker thread, while torch's CPU tensors are read and written at once: the call
// returns when its work is done, so what follows in Python sees it. On GPUs the work stays queued on the stream.
void Settle(const char* op, uintptr_t stream) {
#if MORI_BACKEND_HOST
  core::GpuStatus s = Unlocked([stream] { return core::GpuStreamSynchronize(StreamOf(stream)); });
  if (s != core::kGpuSuccess) {
    throw MoriError(core::StrFormat("%s: the work on the stream failed: %s (the log above names the cause)", op,
                                    core::GpuGetErrorString(s)));
  }
#else
  (void)op;
  (void)stream;
#endif
}

void OnStream(const char* op, uintptr_t stream, const std::function<int()>& call) {
  RequireInit(op);
  CheckCode(op, Unlocked(call));
  Settle(op, stream);
}

void Put(uintptr_t dst, uintptr_t src, size_t bytes, int pe, uintptr_t stream) {
  OnStream("mori.shmem.put", stream, [=] {
    return shmem::ShmemPutMemOnStream(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, pe,
                                      StreamOf(stream));
  });
}

void Get(uintptr_t dst, uintptr_t src, size_t bytes, int pe, uintptr_t stream) {
  OnStream("mori.shmem.get", stream, [=] {
    return shmem::ShmemGetMemOnStream(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, pe,
                                      StreamOf(stream));
  });
}

void PutSignal(uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t sig, uint64_t value, shmem::SignalOp op, int pe,
               uintptr_t stream) {
  OnStream("mori.shmem.put_signal", stream, [=] {
    return shmem::ShmemPutMemSignalOnStream(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                            reinterpret_cast<uint64_t*>(sig), value, op, pe, StreamOf(stream));
  });
}

void SignalWaitUntil(uintptr_t sig, shmem::CmpOp cmp, uint64_t value, uintptr_t stream) {
  OnStream("mori.shmem.signal_wait_until", stream, [=] {
    return shmem::ShmemSignalWaitUntilOnStream(reinterpret_cast<uint64_t*>(sig), cmp, value, StreamOf(stream));
  });
}

void Quiet(uintptr_t stream) {
  OnStream("mori.shmem.quiet", stream, [=] { return shmem::ShmemQuietOnStream(StreamOf(stream)); });
}

void BarrierAllOnStream(uintptr_t stream) {
  OnStream("mori.shmem.barrier_all", stream, [=] { return shmem::ShmemBarrierAllOnStream(StreamOf(stream)); });
}

int TeamSplitStrided(int parent, int start, int stride, int size) {
  const char* op = "mori.shmem.team_split_strided";
  RequireInit(op);
  shmem::ShmemTeam out = shmem::kShmemTeamInvalid;
  CheckCode(op, Unlocked([&] {
              return shmem::ShmemTeamSplitStrided(static_cast<shmem::ShmemTeam>(parent), start, stride, size, &out);
            }));
  return static_cast<int>(out);
}

void TeamDestroy(int team) {
  const char* op = "mori.shmem.Team.destroy";
  RequireInit(op);
  Unlocked([team] { shmem::ShmemTeamDestroy(static_cast<shmem::ShmemTeam>(team)); });
  if (LoggedError()) RaiseLogged(op);
}

void TeamSync(int team, std::optional<uintptr_t> stream) {
  const char* op = "mori.shmem.Team.sync";
  if (!stream) {
    RequireInit(op);
    CheckCode(op, Unlocked([team] { return shmem::ShmemTeamSync(static_cast<shmem::ShmemTeam>(team)); }));
    return;
  }
  OnStream(op, *stream,
           [=] { return shmem::ShmemTeamSyncOnStream(static_cast<shmem::ShmemTeam>(team), StreamOf(*stream)); });
}

void RegisterBuffer(uintptr_t address, size_t bytes) {
  const char* op = "mori.shmem.register_buffer";
  RequireInit(op);
  CheckCode(op, Unlocked([=] { return shmem::ShmemBufferRegister(reinterpret_cast<void*>(address), bytes); }));
}

void UnregisterBuffer(uintptr_t address) {
  const char* op = "mori.shmem.unregister_buffer";
  RequireInit(op);
  CheckCode(op, Unlocked([=] { return shmem::ShmemBufferUnregister(reinterpret_cast<void*>(address)); }));
}

struct DlpackOwner {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

void DeleteDlpackOwner(DLManagedTensor* self) { delete static_cast<DlpackOwner*>(self->manager_ctx); }

// A consumer renames the capsule and calls the deleter itself; a capsule nobody consumed still owns the tensor.
void DestroyDlpackCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kDlpackCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kDlpackCapsuleName));
  managed->deleter(managed);
}

// A "dltensor" capsule describing heap memory at `address` (strides in elements; empty: row-major). The
// tensor made from it does not own the memory: free_tensor() gives it back, collectively.
py::object ToDlpack(uintptr_t address, std::vector<int64_t> shape, std::vector<int64_t> strides, int code, int bits) {
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  }
  if (strides.size() != shape.size()) {
    throw MoriError(core::StrFormat("dlpack: %zu strides for %zu dimensions", strides.size(), shape.size()));
  }
  auto owner = std::make_unique<DlpackOwner>();
  owner->shape = std::move(shape);
  owner->strides = std::move(strides);
  DLTensor& t = owner->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(address);
  t.device = HeapDlDevice();
  t.ndim = static_cast<int32_t>(owner->shape.size());
  t.dtype = {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  t.shape = owner->shape.data();
  t.strides = owner->strides.data();
  t.byte_offset = 0;
  owner->managed.manager_ctx = owner.get();
  owner->managed.deleter = DeleteDlpackOwner;
  PyObject* capsule = PyCapsule_New(&owner->managed, kDlpackCapsuleName, DestroyDlpackCapsule);
  if (capsule == nullptr) throw py::error_already_set();
  owner.release();
  return py::reinterpret_steal<py::object>(capsule);
}

// ---- mori.ep: one EpDispatchCombineHandle per object; mori/ep.py checks the tensors and wraps the results ----

template <typename F>
auto EpCall(const char* op, F&& call) {
  try {
    py::gil_scoped_release unlocked;  // construction, Status and destruction wait for every PE
    return call();
  } catch (const core::Error& e) {
    throw MoriError(std::string(op) + ": " + e.what());
  }
}

// Dispatch and combine only enqueue kernels on a GPU: they keep the GIL (letting it go and taking it back is two
// more switches per call on the path the EP benchmarks time). On HOST a launch runs the kernels' threads and may
// wait for peers, so there they let it go as EpCall does.
template <typename F>
auto EpLaunch(const char* op, F&& call) {
#if MORI_BACKEND_HOST
  return EpCall(op, std::forward<F>(call));
#else
  try {
    return call();
  } catch (const core::Error& e) {
    throw MoriError(std::string(op) + ": " + e.what());
  }
#endif
}

class EpHandle {
 public:
  EpHandle(int hiddenDim, int maxTokensPerRank, int numExpertsPerRank, int topk, int dtype, int scaleDim,
           int kernel, int blocks, int warpsPerBlock) {
    RequireInit("mori.ep.EpDispatchCombineOp");
    ep::EpDispatchCombineConfig c;
    c.rank = shmem::ShmemMyPe();
    c.worldSize = shmem::ShmemNPes();
    c.hiddenDim = hiddenDim;
    c.maxTokensPerRank = maxTokensPerRank;
    c.numExpertsPerRank = numExpertsPerRank;
    c.topk = topk;
    c.dtype = static_cast<ep::DataType>(dtype);
    c.scaleDim = scaleDim;
    c.kernel = static_cast<ep::EpKernelType>(kernel);
    c.blocks = blocks;
    c.warpsPerBlock = warpsPerBlock;
    handle_ = EpCall("mori.ep.EpDispatchCombineOp", [&] { return std::make_unique<ep::EpDispatchCombineHandle>(c); });
  }

  ep::EpDispatchCombineHandle& Get(const char* op) {
    if (!handle_) throw MoriError(std::string(op) + ": the op was closed");
    if (!shmem::ShmemIsInitialized()) throw MoriError(std::string(op) + ": called after mori.shmem.finalize()");
    return *handle_;
  }

  // (tokens, weights, indices, scales, total, srcTokenPos, expertCounts, expertStride) as addresses (0 for
  // no scales) and the stride.
  static std::vector<uintptr_t> Addresses(const ep::EpDispatchResult& r) {
    auto a = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
    return {a(r.tokens),      a(r.weights),      a(r.indices),
            a(r.scales),      a(r.totalRecv),    a(r.srcTokenPos),
            a(r.expertCounts), static_cast<uintptr_t>(r.expertStride)};
  }

  std::vector<uintptr_t> Dispatch(uintptr_t input, uintptr_t indices, uintptr_t weights, uintptr_t scales,
                                  int numTokens, uintptr_t stream) {
    DispatchSend(input, indices, weights, scales, numTokens, stream);
    return DispatchRecv(stream);
  }

  void DispatchSend(uintptr_t input, uintptr_t indices, uintptr_t weights, uintptr_t scales, int numTokens,
                    uintptr_t stream) {
    auto& h = Get("mori.ep.dispatch");
    EpLaunch("mori.ep.dispatch", [&] {
      h.DispatchSend(reinterpret_cast<const void*>(input), reinterpret_cast<const int32_t*>(indices),
                     reinterpret_cast<const float*>(weights), reinterpret_cast<const float*>(scales), numTokens,
                     reinterpret_cast<core::GpuStream>(stream));
    });
  }

  std::vector<uintptr_t> DispatchRecv(uintptr_t stream) {
    auto& h = Get("mori.ep.dispatch_recv");
    return Addresses(
        EpLaunch("mori.ep.dispatch_recv", [&] { return h.DispatchRecv(reinterpret_cast<core::GpuStream>(stream)); }));
  }

  void Combine(uintptr_t expertOutput, uintptr_t output, uintptr_t stream) {
    auto& h = Get("mori.ep.combine");
    EpLaunch("mori.ep.combine", [&] {
      h.Combine(reinterpret_cast<const void*>(expertOutput), reinterpret_cast<void*>(output),
                reinterpret_cast<core::GpuStream>(stream));
    });
  }

  void CombineSend(uintptr_t expertOutput, uintptr_t stream) {
    auto& h = Get("mori.ep.combine_send");
    EpLaunch("mori.ep.combine_send", [&] {
      h.CombineSend(reinterpret_cast<const void*>(expertOutput), reinterpret_cast<core::GpuStream>(stream));
    });
  }

  void CombineRecv(uintptr_t output, uintptr_t stream) {
    auto& h = Get("mori.ep.combine_recv");
    EpLaunch("mori.ep.combine_recv",
             [&] { h.CombineRecv(reinterpret_cast<void*>(output), reinterpret_cast<core::GpuStream>(stream)); });
  }

  py::tuple Status(uintptr_t stream) {
    auto& h = Get("mori.ep.status");
    std::string message;
    int rc = EpCall("mori.ep.status", [&] { return h.Status(reinterpret_cast<core::GpuStream>(stream), &message); });
    return py::make_tuple(rc, message);
  }

  int CombineDtype() { return static_cast<int>(Get("mori.ep.combine_dtype").CombineDataType()); }

  // Collective, like the construction.
  void Close() {
    if (handle_ && shmem::ShmemIsInitialized()) EpCall("mori.ep.close", [&] { handle_.reset(); });
    handle_.reset();
  }

 private:
  std::unique_ptr<ep::EpDispatchCombineHandle> handle_;
};

}  // namespace
}  // namespace mori::python

PYBIND11_MODULE(_mori, m) {
  using namespace mori::python;
  namespace shmem = mori::shmem;
  m.doc() = "mori's SHMEM host API (internal: use mori.shmem)";
  m.attr("__version__") = MORI_VERSION_STRING;
  m.attr("backend") = MORI_BACKEND_NAME;
  m.attr("unique_id_bytes") = sizeof(shmem::mori_shmem_uniqueid_t);
  py::register_exception<MoriError>(m, "MoriError", PyExc_RuntimeError);

  py::enum_<shmem::TransportType>(m, "Transport", "How this PE reaches a peer")
      .value("Self", shmem::TransportType::Self)
      .value("P2P", shmem::TransportType::P2P)
      .value("RDMA", shmem::TransportType::RDMA)
      .value("Proxy", shmem::TransportType::Proxy);

  m.def("init", &Init);
  m.def("get_unique_id", &GetUniqueId);
  m.def("init_with_unique_id", &InitWithUniqueId, py::arg("rank"), py::arg("n_ranks"), py::arg("unique_id"));
  m.def("finalize", &Finalize);
  m.def("is_initialized", [] { return shmem::ShmemIsInitialized(); });
  m.def("require_init", [](const std::string& op) { RequireInit(op.c_str()); });
  m.def("my_pe", &MyPe);
  m.def("n_pes", &NPes);
  m.def("transport", &Transport, py::arg("pe"));
  m.def("heap_bytes", &HeapBytes);
  m.def("allocate", &Allocate, py::arg("bytes"));
  m.def("free", &Free, py::arg("address"));
  m.def("barrier_all", &BarrierAll);
  m.def("peer_address", &PeerAddress, py::arg("address"), py::arg("bytes"), py::arg("pe"));
  py::enum_<shmem::SignalOp>(m, "SignalOp", "What a signal does to its word")
      .value("Set", shmem::SignalOp::Set)
      .value("Add", shmem::SignalOp::Add);
  py::enum_<shmem::CmpOp>(m, "CmpOp", "How a wait compares its word with the value")
      .value("EQ", shmem::CmpOp::EQ)
      .value("NE", shmem::CmpOp::NE)
      .value("GT", shmem::CmpOp::GT)
      .value("GE", shmem::CmpOp::GE)
      .value("LT", shmem::CmpOp::LT)
      .value("LE", shmem::CmpOp::LE);
  m.attr("team_world") = static_cast<int>(shmem::kShmemTeamWorld);
  m.attr("team_node") = static_cast<int>(shmem::kShmemTeamNode);
  m.attr("team_invalid") = static_cast<int>(shmem::kShmemTeamInvalid);
  m.def("put", &Put, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("pe"), py::arg("stream"));
  m.def("get", &Get, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("pe"), py::arg("stream"));
  m.def("put_signal", &PutSignal, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("sig"), py::arg("value"),
        py::arg("op"), py::arg("pe"), py::arg("stream"));
  m.def("signal_wait_until", &SignalWaitUntil, py::arg("sig"), py::arg("cmp"), py::arg("value"), py::arg("stream"));
  m.def("quiet", &Quiet, py::arg("stream"));
  m.def("barrier_all_on_stream", &BarrierAllOnStream, py::arg("stream"));
  m.def("team_split_strided", &TeamSplitStrided, py::arg("parent"), py::arg("start"), py::arg("stride"),
        py::arg("size"));
  m.def("team_destroy", &TeamDestroy, py::arg("team"));
  m.def("team_my_pe", [](int team) { return shmem::ShmemTeamMyPe(static_cast<shmem::ShmemTeam>(team)); });
  m.def("team_n_pes", [](int team) { return shmem::ShmemTeamNPes(static_cast<shmem::ShmemTeam>(team)); });
  m.def("team_translate_pe", [](int from, int pe, int to) {
    return shmem::ShmemTeamTranslatePe(static_cast<shmem::ShmemTeam>(from), pe, static_cast<shmem::ShmemTeam>(to));
  });
  m.def("team_sync", &TeamSync, py::arg("team"), py::arg("stream") = py::none());
  m.def("module_init", [](uintptr_t handle) {
    RequireInit("mori.shmem.module_init");
    void* module = reinterpret_cast<void*>(handle);
    CheckCode("mori.shmem.module_init", Unlocked([module] { return shmem::ShmemModuleInit(module); }));
  }, py::arg("handle") = 0);
  m.def("module_finalize", [](uintptr_t handle) {
    void* module = reinterpret_cast<void*>(handle);
    CheckCode("mori.shmem.module_finalize", Unlocked([module] { return shmem::ShmemModuleFinalize(module); }));
  }, py::arg("handle"));
  m.def("register_buffer", &RegisterBuffer, py::arg("address"), py::arg("bytes"));
  m.def("unregister_buffer", &UnregisterBuffer, py::arg("address"));
  py::class_<EpHandle>(m, "EpHandle")
      .def(py::init<int, int, int, int, int, int, int, int, int>(), py::arg("hidden_dim"),
           py::arg("max_tokens_per_rank"), py::arg("num_experts_per_rank"), py::arg("topk"), py::arg("dtype"),
           py::arg("scale_dim"), py::arg("kernel"), py::arg("blocks"), py::arg("warps_per_block"))
      .def("dispatch", &EpHandle::Dispatch)
      .def("combine", &EpHandle::Combine)
      .def("dispatch_send", &EpHandle::DispatchSend)
      .def("dispatch_recv", &EpHandle::DispatchRecv)
      .def("combine_send", &EpHandle::CombineSend)
      .def("combine_recv", &EpHandle::CombineRecv)
      .def("status", &EpHandle::Status)
      .def("combine_dtype", &EpHandle::CombineDtype)
      .def("close", &EpHandle::Close);
  m.def("to_dlpack", &ToDlpack, py::arg("address"), py::arg("shape"), py::arg("strides"), py::arg("code"),
        py::arg("bits"));
}
