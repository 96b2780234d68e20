// The MORI_* registry: defaults, typed parsing, clear errors for malformed values and unknown names.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "../common/test_util.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/timeout.hpp"

namespace mori::core {
namespace {

using test::ScopedEnv;

TEST(Env, DefaultsApplyWhenUnset) {
  ScopedEnv t("MORI_TIMEOUT_S", nullptr);
  ScopedEnv l("MORI_LOG_LEVEL", nullptr);
  EXPECT_EQ(EnvGetInt("MORI_TIMEOUT_S"), 120);
  EXPECT_DOUBLE_EQ(TimeoutSeconds(), 120.0);
  EXPECT_EQ(EnvGetChoice("MORI_LOG_LEVEL"), "warn");
  EXPECT_FALSE(EnvIsSet("MORI_TIMEOUT_S"));
}

TEST(Env, ValuesAreParsedAndTrimmed) {
  ScopedEnv t("MORI_TIMEOUT_S", " 7 ");
  ScopedEnv l("MORI_LOG_LEVEL", "DEBUG");
  ScopedEnv i("MORI_SOCKET_IFNAME", "eth1,eth2");
  EXPECT_EQ(EnvGetInt("MORI_TIMEOUT_S"), 7);
  EXPECT_EQ(EnvGetChoice("MORI_LOG_LEVEL"), "debug");
  EXPECT_EQ(EnvGetString("MORI_SOCKET_IFNAME"), "eth1,eth2");
}

TEST(Env, MalformedValuesNameTheVariable) {
  ScopedEnv t("MORI_TIMEOUT_S", "12abc");
  try {
    EnvGetInt("MORI_TIMEOUT_S");
    FAIL() << "no error for a malformed integer";
  } catch (const Error& e) {
    EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
    EXPECT_NE(std::string(e.what()).find("MORI_TIMEOUT_S='12abc'"), std::string::npos) << e.what();
  }
  ScopedEnv l("MORI_LOG_LEVEL", "verbose");
  try {
    EnvGetChoice("MORI_LOG_LEVEL");
    FAIL() << "no error for an unknown choice";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("error|warn|info|debug|trace"), std::string::npos) << e.what();
  }
}

TEST(Env, NonPositiveTimeoutIsRefused) {
  ScopedEnv t("MORI_TIMEOUT_S", "0");
  EXPECT_THROW(TimeoutSeconds(), Error);
}

// Values whose deadlines would overflow (nanosecond clocks) are refused with the bound named.
TEST(Env, TimeoutAboveThirtyDaysIsRefused) {
  {
    ScopedEnv t("MORI_TIMEOUT_S", "2592000");
    EXPECT_DOUBLE_EQ(TimeoutSeconds(), 2592000.0);
  }
  for (const char* big : {"2592001", "9223372036854775", "99999999999999"}) {
    ScopedEnv t("MORI_TIMEOUT_S", big);
    try {
      TimeoutSeconds();
      FAIL() << "no error for MORI_TIMEOUT_S=" << big;
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
      EXPECT_NE(std::string(e.what()).find("[1, 2592000]"), std::string::npos) << e.what();
    }
  }
}

// The join's bound: the caller's fallback when unset, else the variable, with the same range as MORI_TIMEOUT_S.
TEST(Env, BootstrapJoinTimeoutFallsBackAndIsChecked) {
  {
    ScopedEnv j("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", nullptr);
    EXPECT_DOUBLE_EQ(BootstrapJoinTimeoutSeconds(7.5), 7.5);
  }
  {
    ScopedEnv j("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", "600");
    EXPECT_DOUBLE_EQ(BootstrapJoinTimeoutSeconds(7.5), 600.0);
  }
  for (const char* bad : {"0", "-3", "2592001"}) {
    ScopedEnv j("MORI_BOOTSTRAP_JOIN_TIMEOUT_S", bad);
    try {
      BootstrapJoinTimeoutSeconds(7.5);
      FAIL() << "no error for MORI_BOOTSTRAP_JOIN_TIMEOUT_S=" << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.Code(), ErrorCode::InvalidUsage);
      EXPECT_NE(std::string(e.what()).find(std::string("MORI_BOOTSTRAP_JOIN_TIMEOUT_S=") + bad), std::string::npos)
          << e.what();
    }
  }
}

TEST(Env, DeadlinesOfHugeOrInvalidSpansDoNotOverflow) {
  for (double s : {1e12, 1e300, std::numeric_limits<double>::infinity(), std::nan("")}) {
    const Deadline d = Deadline::After(s);
    EXPECT_FALSE(d.Expired()) << s;
    EXPECT_GT(d.RemainingSeconds(), 1e8) << s;
  }
  const Deadline past = Deadline::After(-5);
  EXPECT_TRUE(past.Expired() || past.RemainingSeconds() < 0.01);
  const Deadline soon = Deadline::After(3600);
  EXPECT_FALSE(soon.Expired());
  EXPECT_NEAR(soon.RemainingSeconds(), 3600, 5);
}

TEST(Env, UnregisteredNamesAreErrors) {
  EXPECT_THROW(EnvGetInt("MORI_NO_SUCH_THING"), Error);
  EXPECT_THROW(EnvLookup("MORI_TIMEOUT"), Error);
  EXPECT_THROW(EnvGetString("MORI_TIMEOUT_S"), Error);  // registered, but as an integer
}

TEST(Env, UnknownMoriVariablesAreListed) {
  ScopedEnv typo("MORI_TIMEOUT_SEC", "5");
  auto unknown = UnknownMoriEnvVars();
  EXPECT_NE(std::find(unknown.begin(), unknown.end(), "MORI_TIMEOUT_SEC"), unknown.end());
  for (const auto& name : unknown) EXPECT_NE(name, "MORI_TIMEOUT_S");
}

TEST(Env, EveryRegisteredVariableHasAMeaningAndAValidDefault) {
  for (const auto& info : EnvRegistry()) {
    EXPECT_EQ(std::string(info.name).rfind("MORI_", 0), 0u) << info.name;
    EXPECT_GT(std::string(info.meaning).size(), 10u) << info.name;
    if (info.type == EnvType::Choice) {
      std::string choices = std::string("|") + info.choices + "|";
      EXPECT_NE(choices.find(std::string("|") + info.defaultValue + "|"), std::string::npos) << info.name;
    }
    if (info.type == EnvType::Int && info.defaultValue[0] != '\0') {
      EXPECT_NO_THROW(ParseInt(info.defaultValue, info.name));
    }
  }
}

// The bootstrap secret is a credential: registered (so no typo warning names it), read as given, and marked so
// that mori-info prints only whether it is set (the test mori_info_hides_secrets runs mori-info with one).
TEST(Env, TheBootstrapSecretIsRegisteredAsASecret) {
  const EnvParamInfo& info = EnvLookup("MORI_BOOTSTRAP_SECRET");
  EXPECT_TRUE(info.secret);
  EXPECT_EQ(info.type, EnvType::String);
  EXPECT_STREQ(info.defaultValue, "");
  ScopedEnv s("MORI_BOOTSTRAP_SECRET", "k3y-of-the-job");
  EXPECT_EQ(EnvGetString("MORI_BOOTSTRAP_SECRET"), "k3y-of-the-job");
  for (const auto& name : UnknownMoriEnvVars()) EXPECT_NE(name, "MORI_BOOTSTRAP_SECRET");
  for (const auto& other : EnvRegistry()) {
    if (std::string(other.name) != "MORI_BOOTSTRAP_SECRET") {
      EXPECT_FALSE(other.secret) << other.name;
    }
  }
}

TEST(Env, SizesTakeBinarySuffixes) {
  EXPECT_EQ(ParseSize("4096", "x"), 4096u);
  EXPECT_EQ(ParseSize("16k", "x"), 16u << 10);
  EXPECT_EQ(ParseSize("16K", "x"), 16u << 10);
  EXPECT_EQ(ParseSize("3m", "x"), 3ull << 20);
  EXPECT_EQ(ParseSize("2g", "x"), 2ull << 30);
  EXPECT_EQ(ParseSize("2GiB", "x"), 2ull << 30);
  EXPECT_EQ(ParseSize("1t", "x"), 1ull << 40);
  EXPECT_THROW(ParseSize("", "x"), Error);
  EXPECT_THROW(ParseSize("-1", "x"), Error);
  EXPECT_THROW(ParseSize("12q", "x"), Error);
  EXPECT_THROW(ParseSize("99999999999999999999", "x"), Error);
  EXPECT_THROW(ParseSize("20000000000t", "x"), Error);  // overflows 64 bits after the shift
}

}  // namespace
}  // namespace mori::core
