// The C-style host API: every entry point catches at its boundary, logs the cause and returns a code (or
// nullptr), as STYLE.md asks of the SHMEM host API.
#include "mori/shmem/shmem_api.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mori/core/bootstrap.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/launch.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/stop.hpp"
#include "guarded.hpp"
#include "runtime.hpp"
#include "stream_ops.hpp"
#if MORI_HAS_MPI
#include "mori/core/mpi_bootstrap.hpp"
#endif

namespace mori::shmem {

namespace detail {

#if MORI_BACKEND_HOST
ShmemDeviceState hostState{};
#endif

namespace {
std::mutex& RegistryMutex() {
  static std::mutex m;
  return m;
}
std::vector<StateUploader>& Uploaders() {
  static std::vector<StateUploader> list;
  return list;
}
// The state as last published: what a module that registers late receives. On HOST it is the one copy
// device functions read.
ShmemDeviceState& Published() {
#if MORI_BACKEND_HOST
  return hostState;
#else
  static ShmemDeviceState state{};
  return state;
#endif
}
}  // namespace

namespace {
// Uploaders compiled against headers of another layout (RegisterStateUploader), with their signature (0: headers
// older than the signature). They are never called; while one is registered, uploads fail naming it.
struct RefusedUploader {
  StateUploader uploader;
  uint64_t signature;
};
std::vector<RefusedUploader>& Refused() {
  static std::vector<RefusedUploader> list;
  return list;
}

std::string RefusedMessage(const RefusedUploader& r) {
  char text[320];
  if (r.signature == 0) {
    std::snprintf(text, sizeof(text),
                  "device code compiled against mori headers older than the layout signature registered for the "
                  "SHMEM state: rebuild it against this runtime's headers (layout signature %016llx)",
                  static_cast<unsigned long long>(kShmemLayoutSignature));
  } else {
    std::snprintf(text, sizeof(text),
                  "device code compiled against other mori headers registered for the SHMEM state (its layout "
                  "signature %016llx, this runtime's %016llx): rebuild it against this runtime's headers",
                  static_cast<unsigned long long>(r.signature), static_cast<unsigned long long>(kShmemLayoutSignature));
  }
  return text;
}

// Throws for the first refused uploader still registered. Call with RegistryMutex held.
void CheckNoneRefused() {
  if (Refused().empty()) return;
  MORI_THROW(core::ErrorCode::InvalidUsage, "%s", RefusedMessage(Refused().front()).c_str());
}
}  // namespace

std::string RefusedUploaderError() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  return Refused().empty() ? std::string() : RefusedMessage(Refused().front());
}

bool RegisterStateUploader(StateUploader uploader, uint64_t layoutSignature) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  if (layoutSignature != kShmemLayoutSignature) {
    RefusedUploader r{uploader, layoutSignature};
    Refused().push_back(r);
    MORI_LOG_ERROR(Shmem, "%s", RefusedMessage(r).c_str());
    return false;
  }
  Uploaders().push_back(uploader);
  if (Published().magic == kShmemStateMagic) {
    int rc = uploader(&Published());
    if (rc != 0) MORI_LOG_ERROR(Shmem, "uploading the SHMEM state to a late-loaded module failed (error %d)", rc);
  }
  return true;
}

bool RegisterStateUploader(StateUploader uploader) { return RegisterStateUploader(uploader, 0); }

void UnregisterStateUploader(StateUploader uploader) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& list = Uploaders();
  list.erase(std::remove(list.begin(), list.end(), uploader), list.end());
  auto& refused = Refused();
  refused.erase(std::remove_if(refused.begin(), refused.end(),
                               [uploader](const RefusedUploader& r) { return r.uploader == uploader; }),
                refused.end());
}

// Modules loaded by handle (ShmemModuleInit(module)), in the order they were added.
std::vector<void*>& HandleModules() {
  static std::vector<void*> list;
  return list;
}

// Copies `state` into the module's kShmemModuleStateSymbol. The symbol is looked up on every upload (a
// handle whose module was unloaded without ShmemModuleFinalize fails the lookup instead of taking a write).
void UploadToHandle(void* module, const ShmemDeviceState& state) {
  void* symbol = nullptr;
  size_t bytes = 0;
  core::GpuStatus rc = core::GpuModuleGetGlobal(&symbol, &bytes, module, kShmemModuleStateSymbol);
  MORI_CHECK(rc == core::kGpuSuccess, core::ErrorCode::InvalidUsage,
             "module %p has no device state %s (%s): compile it with -DMORI_SHMEM_MODULE_BY_HANDLE before "
             "including shmem_device_api.hpp, and call ShmemModuleFinalize before unloading it",
             module, kShmemModuleStateSymbol, core::GpuGetErrorString(rc));
  MORI_CHECK(bytes == sizeof(ShmemDeviceState), core::ErrorCode::InvalidUsage,
             "module %p holds a %zu-byte %s, this runtime's is %zu bytes: the module was built against "
             "another version of mori's headers",
             module, bytes, kShmemModuleStateSymbol, sizeof(ShmemDeviceState));
  // The same size is not the same layout: the tables the state points to may have changed.
  void* layout = nullptr;
  size_t layoutBytes = 0;
  rc = core::GpuModuleGetGlobal(&layout, &layoutBytes, module, kShmemModuleLayoutSymbol);
  MORI_CHECK(rc == core::kGpuSuccess && layoutBytes == sizeof(uint64_t), core::ErrorCode::InvalidUsage,
             "module %p has no layout signature %s: it was built against mori headers older than this runtime's "
             "(layout signature %016llx); rebuild it against them",
             module, kShmemModuleLayoutSymbol, static_cast<unsigned long long>(kShmemLayoutSignature));
  uint64_t signature = 0;
  MORI_CHECK_GPU(core::GpuMemcpy(&signature, layout, sizeof(signature)));
  MORI_CHECK(signature == kShmemLayoutSignature, core::ErrorCode::InvalidUsage,
             "module %p was built against other mori headers (its layout signature %016llx, this runtime's "
             "%016llx): rebuild it against this runtime's headers",
             module, static_cast<unsigned long long>(signature),
             static_cast<unsigned long long>(kShmemLayoutSignature));
  MORI_CHECK_GPU(core::GpuMemcpy(symbol, &state, sizeof(state)));
}

// Uploads the published state to every registered module again; the first failure's code, else 0.
int ReuploadState() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  CheckNoneRefused();
  for (auto uploader : Uploaders()) {
    int rc = uploader(&Published());
    if (rc != 0) return rc;
  }
  return 0;
}

// Uploads the published state to `module` and remembers it (once).
void AddHandleModule(void* module) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  UploadToHandle(module, Published());
  auto& list = HandleModules();
  if (std::find(list.begin(), list.end(), module) == list.end()) list.push_back(module);
}

bool RemoveHandleModule(void* module) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& list = HandleModules();
  auto it = std::find(list.begin(), list.end(), module);
  if (it == list.end()) return false;
  list.erase(it);
  return true;
}

}  // namespace detail

void PublishDeviceState(const ShmemDeviceState& state) {
  std::lock_guard<std::mutex> lock(detail::RegistryMutex());
  // Only a runtime going up is refused: a finalize still clears the state everywhere it was uploaded.
  if (state.magic == kShmemStateMagic) detail::CheckNoneRefused();
  detail::Published() = state;
  for (auto uploader : detail::Uploaders()) {
    int rc = uploader(&state);
    MORI_CHECK(rc == 0, core::ErrorCode::Gpu, "uploading the SHMEM state to a kernel module failed (error %d)", rc);
  }
  // A module by handle that no longer takes the state (unloaded without ShmemModuleFinalize) is dropped with
  // a log line, so that init and finalize still finish.
  auto& modules = detail::HandleModules();
  for (auto it = modules.begin(); it != modules.end();) {
    try {
      detail::UploadToHandle(*it, state);
      ++it;
    } catch (const core::Error& e) {
      MORI_LOG_ERROR(Shmem, "dropping module %p: %s", *it, e.what());
      it = modules.erase(it);
    }
  }
}

namespace {

std::mutex& RuntimeMutex() {
  static std::mutex m;
  return m;
}
std::unique_ptr<Runtime>& TheRuntime() {
  static std::unique_ptr<Runtime> runtime;
  return runtime;
}

Runtime& Current(const char* op) {
  auto& rt = TheRuntime();
  MORI_CHECK(rt != nullptr, core::ErrorCode::InvalidUsage, "%s called before ShmemInit() (or after ShmemFinalize())",
             op);
  return *rt;
}

using detail::Guarded;

int Start(const char* op, std::shared_ptr<core::Bootstrap> bootstrap) {
  std::lock_guard<std::mutex> lock(RuntimeMutex());
  auto& rt = TheRuntime();
  MORI_CHECK(rt == nullptr, core::ErrorCode::InvalidUsage, "%s: the runtime is already initialised", op);
  // Started from a unique id or an MPI communicator, a rank of mpirun or torchrun still ends with its launcher.
  core::Launcher launcher = core::Launcher::Single;
  try {
    launcher = core::DetectLaunchEnvironment().launcher;
  } catch (const core::Error&) {
    // A partial launch environment matters only to the environment bootstrap, which reports it itself.
  }
  core::ExitWithLauncher(launcher);
  rt = std::make_unique<Runtime>(std::move(bootstrap));
  // After the runtime: the stop word lives in pinned memory of the device's context.
  core::InstallStopOnSignals();
  detail::PreloadStreamKernels();
  return 0;
}

}  // namespace

namespace detail {
int HostMyPe() {
  auto& rt = TheRuntime();
  return rt ? rt->Rank() : -1;
}
int HostNPes() {
  auto& rt = TheRuntime();
  return rt ? rt->NPes() : 0;
}
void* HostPtr(const void* dest, int pe) {
  auto& rt = TheRuntime();
  return rt ? rt->PeerPointer(dest, pe) : nullptr;
}
bool LocalReachable(const void* p, size_t bytes, int pe) {
  auto& rt = TheRuntime();
  return rt != nullptr && rt->LocalReachable(p, bytes, pe);
}
int HostTeamMyPe(ShmemTeam team) {
  auto& rt = TheRuntime();
  return rt ? rt->TeamMyPe(team) : -1;
}
int HostTeamNPes(ShmemTeam team) {
  auto& rt = TheRuntime();
  return rt ? rt->TeamNPes(team) : -1;
}
int HostTeamTranslatePe(ShmemTeam from, int pe, ShmemTeam to) {
  auto& rt = TheRuntime();
  return rt ? rt->TeamTranslatePe(from, pe, to) : -1;
}
}  // namespace detail

int ShmemInit() {
  return Guarded("ShmemInit", [] { Start("ShmemInit", core::CreateBootstrapFromEnvironment()); });
}

#if MORI_HAS_MPI
int ShmemMpiInit(MPI_Comm comm) {
  return Guarded("ShmemMpiInit", [comm] { Start("ShmemMpiInit", std::make_shared<core::MpiBootstrap>(comm)); });
}
#endif

int ShmemGetUniqueId(mori_shmem_uniqueid_t* uid) {
  return Guarded("ShmemGetUniqueId", [uid] {
    MORI_CHECK(uid != nullptr, core::ErrorCode::InvalidUsage, "uid is null");
    core::UniqueId id = core::SocketBootstrap::CreateUniqueId();
    static_assert(sizeof(id.bytes) == sizeof(uid->internal), "unique id sizes differ");
    std::memcpy(uid->internal, id.bytes, sizeof(id.bytes));
  });
}

int ShmemSetAttrUniqueIdArgs(int rank, int nRanks, mori_shmem_uniqueid_t* uid, mori_shmem_init_attr_t* attr) {
  return Guarded("ShmemSetAttrUniqueIdArgs", [=] {
    MORI_CHECK(uid != nullptr && attr != nullptr, core::ErrorCode::InvalidUsage, "uid or attr is null");
    MORI_CHECK(nRanks > 0 && rank >= 0 && rank < nRanks, core::ErrorCode::InvalidUsage,
               "rank %d is not in [0, %d)", rank, nRanks);
    attr->rank = rank;
    attr->nRanks = nRanks;
    attr->uid = *uid;
  });
}

int ShmemInitAttr(unsigned flags, mori_shmem_init_attr_t* attr) {
  return Guarded("ShmemInitAttr", [=] {
    MORI_CHECK(attr != nullptr, core::ErrorCode::InvalidUsage, "attr is null");
    if (flags == MORI_SHMEM_INIT_WITH_UNIQUEID) {
      MORI_CHECK(attr->nRanks > 0 && attr->rank >= 0 && attr->rank < attr->nRanks, core::ErrorCode::InvalidUsage,
                 "attr: rank %d is not in [0, %d) (ShmemSetAttrUniqueIdArgs fills it)", attr->rank, attr->nRanks);
      auto bootstrap = std::make_shared<core::SocketBootstrap>(attr->rank, attr->nRanks);
      core::UniqueId id{};
      std::memcpy(id.bytes, attr->uid.internal, sizeof(id.bytes));
      bootstrap->Initialize(id);
      Start("ShmemInitAttr", bootstrap);
    } else if (flags == MORI_SHMEM_INIT_WITH_MPI_COMM) {
#if MORI_HAS_MPI
      MORI_CHECK(attr->mpiComm != nullptr, core::ErrorCode::InvalidUsage, "attr->mpiComm is null");
      Start("ShmemInitAttr", std::make_shared<core::MpiBootstrap>(*static_cast<MPI_Comm*>(attr->mpiComm)));
#else
      MORI_THROW(core::ErrorCode::NotSupported, "MORI_SHMEM_INIT_WITH_MPI_COMM: this mori was built without MPI");
#endif
    } else {
      MORI_THROW(core::ErrorCode::InvalidUsage, "unknown init flags 0x%x", flags);
    }
  });
}

int ShmemFinalize() {
  return Guarded("ShmemFinalize", [] {
    std::lock_guard<std::mutex> lock(RuntimeMutex());
    auto& rt = TheRuntime();
    MORI_CHECK(rt != nullptr, core::ErrorCode::InvalidUsage, "ShmemFinalize without ShmemInit");
    std::unique_ptr<Runtime> taken = std::move(rt);
    try {
      taken->Finalize();
    } catch (...) {
      if (taken->KernelsMayStillRun()) {
        // Its kernels may still write into the heap and read the state: both stay, for the process's lifetime.
        MORI_LOG_ERROR(Shmem, "ShmemFinalize: kernels of this PE still run; its heap and state are left in place");
        static auto* kept = new std::vector<std::unique_ptr<Runtime>>();  // never destroyed: reachable, not freed
        kept->push_back(std::move(taken));
      }
      throw;
    }
  });
}

bool ShmemIsInitialized() { return TheRuntime() != nullptr; }

void* ShmemMallocAlign(size_t alignment, size_t bytes) {
  void* out = nullptr;
  Guarded("ShmemMallocAlign", [&] { out = Current("ShmemMalloc").Allocate(bytes, alignment, false); });
  return out;
}

void* ShmemMalloc(size_t bytes) { return ShmemMallocAlign(256, bytes); }

void* ShmemCalloc(size_t count, size_t bytes) {
  void* out = nullptr;
  Guarded("ShmemCalloc", [&] {
    MORI_CHECK(bytes == 0 || count <= SIZE_MAX / bytes, core::ErrorCode::InvalidUsage,
               "ShmemCalloc(%zu, %zu) overflows", count, bytes);
    out = Current("ShmemCalloc").Allocate(count * bytes, 256, true);
  });
  return out;
}

void ShmemFree(void* ptr) { Guarded("ShmemFree", [ptr] { Current("ShmemFree").Free(ptr); }); }

void ShmemBarrierAll() { (void)ShmemBarrierAllChecked(); }

int ShmemBarrierAllChecked() {
  return Guarded("ShmemBarrierAll", [] { Current("ShmemBarrierAll").Barrier(); });
}

TransportType ShmemTransportType(int pe) {
  TransportType t = TransportType::Self;
  Guarded("ShmemTransportType", [&] { t = Current("ShmemTransportType").Transport(pe); });
  return t;
}

const char* TransportTypeName(TransportType type) {
  switch (type) {
    case TransportType::Self: return "Self";
    case TransportType::P2P: return "P2P";
    case TransportType::RDMA: return "RDMA";
    case TransportType::Proxy: return "Proxy";
  }
  return "?";
}

int ShmemBufferRegister(void* ptr, size_t bytes) {
  return Guarded("ShmemBufferRegister", [=] { Current("ShmemBufferRegister").RegisterBuffer(ptr, bytes); });
}

int ShmemBufferUnregister(void* ptr) {
  return Guarded("ShmemBufferUnregister", [=] { Current("ShmemBufferUnregister").UnregisterBuffer(ptr); });
}

int ShmemTeamSplitStrided(ShmemTeam parent, int start, int stride, int size, ShmemTeam* out) {
  if (out != nullptr) *out = kShmemTeamInvalid;
  return Guarded("ShmemTeamSplitStrided", [&] {
    MORI_CHECK(out != nullptr, core::ErrorCode::InvalidUsage, "out is null");
    *out = Current("ShmemTeamSplitStrided").SplitStrided(parent, start, stride, size);
  });
}

void ShmemTeamDestroy(ShmemTeam team) {
  Guarded("ShmemTeamDestroy", [team] { Current("ShmemTeamDestroy").DestroyTeam(team); });
}

int ShmemTeamSync(ShmemTeam team) {
  return Guarded("ShmemTeamSync", [team] { Current("ShmemTeamSync").TeamSync(team); });
}

int ShmemModuleInit(void* module) {
  return Guarded("ShmemModuleInit", [module] {
    (void)Current("ShmemModuleInit");
    if (module != nullptr) {
      MORI_CHECK(!MORI_BACKEND_HOST, core::ErrorCode::NotSupported,
                 "ShmemModuleInit(%p): the HOST backend loads no GPU modules (its kernels all share one state)",
                 module);
      detail::AddHandleModule(module);
      return;
    }
    int rc = detail::ReuploadState();
    MORI_CHECK(rc == 0, core::ErrorCode::Gpu, "uploading the SHMEM state to a module failed (GPU error %d)", rc);
  });
}

int ShmemModuleFinalize(void* module) {
  return Guarded("ShmemModuleFinalize", [module] {
    MORI_CHECK(module != nullptr, core::ErrorCode::InvalidUsage, "module is null");
    MORI_CHECK(detail::RemoveHandleModule(module), core::ErrorCode::InvalidUsage,
               "module %p was not initialised with ShmemModuleInit(module) (or was finalized already)", module);
  });
}

size_t ShmemHeapBytes() {
  auto& rt = TheRuntime();
  return rt ? rt->HeapBytes() - kShmemHeapUserOffset : 0;
}

void* ShmemHeapBase() {
  auto& rt = TheRuntime();
  return rt ? rt->HeapBase() : nullptr;
}

}  // namespace mori::shmem
