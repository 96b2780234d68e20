#include "mori/core/env.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "mori/core/errors.hpp"

extern char** environ;

namespace mori::core {

namespace {

// Every MORI_* variable mori reads, in one place. Add new ones here, never read getenv("MORI_...") elsewhere.
// Never destroyed: threads that outlive main (a helper still waiting on a GPU at exit) may still read it.
const std::vector<EnvParamInfo>& kRegistry = *new std::vector<EnvParamInfo>{
    {"MORI_LOG_LEVEL", EnvType::Choice, "warn", "error|warn|info|debug|trace",
     "lowest severity of log lines printed to stderr"},
    {"MORI_LOG_SUBSYS", EnvType::String, "all", "",
     "subsystems that log: comma list of core,bootstrap,ipc,gpu,rdma,shmem,proxy,net or all; ^list excludes"},
    {"MORI_TIMEOUT_S", EnvType::Int, "120", "",
     "seconds (1 to 2592000, 30 days) any wait on another process, thread or device may take before it fails "
     "naming what it awaited"},
    {"MORI_BOOTSTRAP_JOIN_TIMEOUT_S", EnvType::Int, "", "",
     "seconds (1 to 2592000) the bootstrap's join may take: rank 0 waiting for every rank to register, a rank "
     "waiting for rank 0 and the address table. Ranks of a job can start far apart (a loaded node, a slow "
     "container) while MORI_TIMEOUT_S stays short to notice a dead peer soon. Unset: the bootstrap's own bound "
     "(MORI_TIMEOUT_S)"},
    {"MORI_BOOTSTRAP_MAX_PENDING", EnvType::Size, "2g", "",
     "bytes of bootstrap messages from other ranks that a rank holds before it receives them; a peer that sends "
     "more is dropped with an error naming it"},
    {"MORI_BOOTSTRAP_SECRET", EnvType::String, "", "",
     "a secret shared by every rank of a job started from a root address (MORI_BOOTSTRAP_ADDR or torchrun): the "
     "job's nonce is derived from it, so a process that can reach the root but lacks it cannot join; never sent. "
     "Unset: anyone who can reach the root's port can join (the root warns)",
     true},
    {"MORI_SOCKET_IFNAME", EnvType::String, "", "",
     "network interfaces for sockets, comma separated (eth1,eth2); the first serves the bootstrap"},
    {"MORI_BOOTSTRAP_ADDR", EnvType::String, "", "",
     "address of rank 0's bootstrap listener: ip:port, [ipv6]:port or interface:ip:port"},
    {"MORI_RANK", EnvType::Int, "", "", "this process's rank when launched without mpirun or torchrun"},
    {"MORI_WORLD_SIZE", EnvType::Int, "", "", "number of ranks when launched without mpirun or torchrun"},
    {"MORI_EXIT_WITH_LAUNCHER", EnvType::Choice, "auto", "auto|on|off",
     "end this process (SIGKILL) when the process that launched it is gone, so that a rank never outlives a killed "
     "job with its kernels spinning: auto does so under mpirun and torchrun, on for any launch, off never"},
    {"MORI_STOP_ON_SIGNAL", EnvType::Bool, "1", "",
     "on SIGTERM or SIGINT (when the application has no handler of its own) stop every mori device wait, wait for "
     "the device to go idle, then end with that signal: a killed job leaves no running kernel behind"},
    {"MORI_STOP_DRAIN_MS", EnvType::Int, "2000", "",
     "how long a process that was asked to end waits for its kernels to leave before it ends anyway"},
    {"MORI_RDMA_BACKEND", EnvType::Choice, "auto", "auto|directverbs|ibverbs|emulated",
     "which RDMA backend serves GPU-initiated transfers: auto picks DirectVerbs when an mlx5 NIC is present, "
     "else the emulated NIC"},
    {"MORI_RDMA_DEVICES", EnvType::String, "", "", "RDMA devices to use, comma separated (mlx5_0,mlx5_1); all when unset"},
    {"MORI_RDMA_GID_INDEX", EnvType::Int, "-1", "", "GID index for RoCE; -1 picks 3 on Ethernet ports, 0 on InfiniBand"},
    {"MORI_EMULATED_NIC_DELAY_US", EnvType::Int, "0", "",
     "a fault knob: every WQE an emulated NIC of this process executes waits this many microseconds first"},
    {"MORI_EMULATED_NIC_FAULTS", EnvType::String, "", "",
     "a fault knob: random faults on the packets every emulated NIC of this process sends, as "
     "seed=S,drop=P,corrupt=P,reorder=P,delay_us=MAX,ack_timeout_ms=T (P a probability per packet in [0, 1]; "
     "any subset; ack_timeout_ms replaces MORI_TIMEOUT_S as the NIC's ack timeout). Lost or "
     "corrupted packets fail their WQE after the ack timeout; never silently wrong data (docs/CHAOS.md)"},
    {"MORI_SHMEM_HEAP_SIZE", EnvType::Size, "1g", "", "bytes of symmetric heap per PE (k, m, g suffixes); the same on every PE"},
    {"MORI_SHMEM_TRANSPORT", EnvType::Choice, "auto", "auto|p2p|rdma|proxy",
     "forces one SHMEM transport for every pair of PEs (auto: P2P on the same host, else RDMA where the NIC lets "
     "the GPU post, else Proxy)"},
    {"MORI_EP_SHARED_GPU", EnvType::Choice, "auto", "auto|yes|no",
     "EP LowLatency: whether PEs share GPUs (auto: found from the PEs' PCI bus ids). Sharing, the receive waits in "
     "one block instead of every block, so that a PE on the same GPU keeps room for its kernels"},
    {"MORI_SHMEM_PROXY_CONN", EnvType::Choice, "auto", "auto|rdma|tcp",
     "connections of the SHMEM Proxy transport: rdma (IB0 on a real NIC, else the emulated NIC), tcp, or auto "
     "(IB0 when a real verbs NIC exists, else tcp)"},
    {"MORI_SHMEM_QPS_PER_PE", EnvType::Int, "1", "", "RDMA queue pairs per peer PE (threads spread over them by warp)"},
    {"MORI_SHMEM_QUEUE_DEPTH", EnvType::Int, "1024", "", "send-queue depth of each SHMEM RDMA queue pair (power of two)"},
    {"MORI_CUDA_IPC", EnvType::Choice, "auto", "auto|vmm|legacy",
     "how GPU memory is shared with same-host peers: auto (VMM file descriptors when the driver supports "
     "them, else legacy IPC handles), vmm, legacy"},
    {"MORI_CUDA_IPC_WORDS", EnvType::Choice, "auto", "auto|stream|copy",
     "how a CudaIpc connection writes a semaphore word after its copies (a port channel's signal): stream (the "
     "copy stream writes it, GpuStreamWriteValue64), copy (a copy-engine copy from a pinned staging word), or "
     "auto (stream where the device can, on CUDA and HOST; copy on HIP)"},
    {"MORI_CUDA_MAX_CONNECTIONS", EnvType::Int, "8", "",
     "CUDA_DEVICE_MAX_CONNECTIONS that mori sets when it is loaded under MPS with that variable unset (MPS "
     "clients otherwise get too few hardware work queues for the proxy's copies); 0 leaves it unset"},
    {"MORI_TCP_CHANNELS", EnvType::Int, "4", "",
     "sockets (channels) per Tcp connection, 1 to 64, bound round-robin to the interfaces of MORI_SOCKET_IFNAME"},
    {"MORI_TCP_CHUNK_SIZE", EnvType::Size, "512k", "",
     "bytes per chunk of a Tcp transfer (64 to 64m); chunks are dealt round-robin to the channels"},
    {"MORI_TCP_WINDOW", EnvType::Int, "16", "",
     "chunks in flight (sent, not yet acknowledged as written) per channel of a Tcp connection, 1 to 4096"},
};

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

const EnvParamInfo& Expect(const std::string& name, EnvType type) {
  const EnvParamInfo& info = EnvLookup(name);
  MORI_CHECK(info.type == type, ErrorCode::Internal, "environment variable %s is read with the wrong type",
             name.c_str());
  return info;
}

// The value to parse: the environment's, else the registered default; throws when neither exists.
std::string ValueOrDefault(const EnvParamInfo& info) {
  if (auto raw = EnvRaw(info.name)) return *raw;
  MORI_CHECK(info.defaultValue[0] != '\0', ErrorCode::InvalidUsage, "environment variable %s is not set",
             info.name);
  return info.defaultValue;
}

}  // namespace

const std::vector<EnvParamInfo>& EnvRegistry() { return kRegistry; }

const EnvParamInfo& EnvLookup(const std::string& name) {
  for (const auto& info : kRegistry) {
    if (name == info.name) return info;
  }
  MORI_THROW(ErrorCode::InvalidUsage, "%s is not a registered mori environment variable", name.c_str());
}

std::optional<std::string> EnvRaw(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  std::string s = Trim(v);
  if (s.empty()) return std::nullopt;
  return s;
}

bool EnvIsSet(const std::string& name) { return EnvRaw(name).has_value(); }

int64_t ParseInt(const std::string& text, const std::string& what) {
  std::string s = Trim(text);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  MORI_CHECK(!s.empty() && errno == 0 && end != nullptr && *end == '\0', ErrorCode::InvalidUsage,
             "%s='%s' is not an integer", what.c_str(), text.c_str());
  return v;
}

uint64_t ParseSize(const std::string& text, const std::string& what) {
  std::string s = Lower(Trim(text));
  MORI_CHECK(!s.empty() && std::isdigit(static_cast<unsigned char>(s[0])), ErrorCode::InvalidUsage,
             "%s='%s' is not a size (a number of bytes, optionally with a k, m, g or t suffix)", what.c_str(),
             text.c_str());
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  MORI_CHECK(errno == 0, ErrorCode::InvalidUsage, "%s='%s' is out of range", what.c_str(), text.c_str());
  std::string suffix = end;
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();  // "16mb", "1gb"
  if (suffix.size() == 2 && suffix[1] == 'i') suffix.pop_back();   // "16mi", "1gi"
  int shift = 0;
  if (suffix.empty()) {
    shift = 0;
  } else if (suffix == "k") {
    shift = 10;
  } else if (suffix == "m") {
    shift = 20;
  } else if (suffix == "g") {
    shift = 30;
  } else if (suffix == "t") {
    shift = 40;
  } else {
    MORI_THROW(ErrorCode::InvalidUsage, "%s='%s' has an unknown size suffix '%s' (use k, m, g or t)", what.c_str(),
               text.c_str(), end);
  }
  MORI_CHECK(shift == 0 || v <= (~0ull >> shift), ErrorCode::InvalidUsage, "%s='%s' is out of range", what.c_str(),
             text.c_str());
  return static_cast<uint64_t>(v) << shift;
}

std::string EnvGetString(const std::string& name) {
  const EnvParamInfo& info = Expect(name, EnvType::String);
  if (auto raw = EnvRaw(name)) return *raw;
  return info.defaultValue;
}

int64_t EnvGetInt(const std::string& name) { return ParseInt(ValueOrDefault(Expect(name, EnvType::Int)), name); }

uint64_t EnvGetSize(const std::string& name) { return ParseSize(ValueOrDefault(Expect(name, EnvType::Size)), name); }

bool EnvGetBool(const std::string& name) {
  std::string v = Lower(ValueOrDefault(Expect(name, EnvType::Bool)));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  MORI_THROW(ErrorCode::InvalidUsage, "%s='%s' is not a boolean (1/0, true/false, yes/no, on/off)", name.c_str(),
             v.c_str());
}

std::string EnvGetChoice(const std::string& name) {
  const EnvParamInfo& info = Expect(name, EnvType::Choice);
  std::string v = Lower(ValueOrDefault(info));
  std::string choices = info.choices;
  size_t start = 0;
  while (start <= choices.size()) {
    size_t bar = choices.find('|', start);
    if (bar == std::string::npos) bar = choices.size();
    if (choices.compare(start, bar - start, v) == 0 && bar - start == v.size()) return v;
    start = bar + 1;
  }
  MORI_THROW(ErrorCode::InvalidUsage, "%s='%s' is not one of %s", name.c_str(), v.c_str(), info.choices);
}

std::vector<std::string> UnknownMoriEnvVars() {
  std::vector<std::string> unknown;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry = *e;
    if (entry.rfind("MORI_", 0) != 0) continue;
    std::string name = entry.substr(0, entry.find('='));
    bool known = std::any_of(kRegistry.begin(), kRegistry.end(), [&](const EnvParamInfo& i) { return name == i.name; });
    if (!known) unknown.push_back(name);
  }
  std::sort(unknown.begin(), unknown.end());
  return unknown;
}

namespace {

double BoundedSeconds(const char* name) {
  int64_t s = EnvGetInt(name);
  // The bound keeps every deadline made from it (host clocks and the kernels' nanosecond counters) far from
  // overflow; a wait of 30 days is as good as none.
  MORI_CHECK(s > 0 && s <= kMaxTimeoutS, ErrorCode::InvalidUsage,
             "%s=%lld must be a number of seconds in [1, %lld] (30 days)", name, static_cast<long long>(s),
             static_cast<long long>(kMaxTimeoutS));
  return static_cast<double>(s);
}

}  // namespace

double TimeoutSeconds() { return BoundedSeconds("MORI_TIMEOUT_S"); }

double BootstrapJoinTimeoutSeconds(double fallback) {
  return EnvIsSet("MORI_BOOTSTRAP_JOIN_TIMEOUT_S") ? BoundedSeconds("MORI_BOOTSTRAP_JOIN_TIMEOUT_S") : fallback;
}

}  // namespace mori::core
