// The registry of every MORI_* environment variable: name, type, default and meaning, declared once in
// src/core/env.cpp and listed by mori-info. Reading an unregistered name is an error, so a typo in the
// code cannot silently read nothing; a typo in the environment shows up in mori-info and in a warning.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mori::core {

enum class EnvType { String, Int, Size, Bool, Choice };

struct EnvParamInfo {
  const char* name;
  EnvType type;
  const char* defaultValue;  // as it would be written in the environment; "" for none
  const char* choices;       // Choice only: '|'-separated lower-case values
  const char* meaning;
  bool secret = false;  // a credential: tools say whether it is set, never what it is
};

const std::vector<EnvParamInfo>& EnvRegistry();
const EnvParamInfo& EnvLookup(const std::string& name);  // throws InvalidUsage for an unregistered name

// The raw value when set (and non-empty), else nothing.
std::optional<std::string> EnvRaw(const std::string& name);
bool EnvIsSet(const std::string& name);

// Typed reads: the environment's value, else the registered default. A malformed value throws an Error
// (InvalidUsage) that names the variable, the value and what was expected.
std::string EnvGetString(const std::string& name);
int64_t EnvGetInt(const std::string& name);
uint64_t EnvGetSize(const std::string& name);  // bytes; k, m, g, t suffixes (powers of 1024)
bool EnvGetBool(const std::string& name);      // 1/0, true/false, yes/no, on/off
std::string EnvGetChoice(const std::string& name);  // lower-cased, one of the registered choices

// Parsers shared with command-line tools; they throw InvalidUsage naming `what`.
uint64_t ParseSize(const std::string& text, const std::string& what);
int64_t ParseInt(const std::string& text, const std::string& what);

// MORI_* names set in the environment that the registry does not know (likely typos).
std::vector<std::string> UnknownMoriEnvVars();

// The bound on every wait that could hang (MORI_TIMEOUT_S), in seconds: 1 to kMaxTimeoutS, else InvalidUsage.
constexpr int64_t kMaxTimeoutS = 30LL * 24 * 3600;
double TimeoutSeconds();
// The bound on a bootstrap's join (MORI_BOOTSTRAP_JOIN_TIMEOUT_S, same range), or `fallback` when it is unset.
double BootstrapJoinTimeoutSeconds(double fallback);

}  // namespace mori::core
