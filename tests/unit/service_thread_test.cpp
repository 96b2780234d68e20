// Where mori's service threads run (src/core/service_thread.hpp): inside the launcher's binding of the process,
// except beside a binding to one CPU, which the application's own thread holds.
#include "service_thread.hpp"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <string>
#include <thread>

#include "../common/test_util.hpp"

namespace mori::core {
namespace {

cpu_set_t CpusOfThisThread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(set), &set), 0);
  return set;
}

cpu_set_t OneCpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return set;
}

int FirstCpu(const cpu_set_t& set) {
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) return c;
  }
  return -1;
}

TEST(ServiceThread, CpuListsParseAndPrint) {
  cpu_set_t set;
  ASSERT_TRUE(ParseCpuList("0-3,8,10-11\n", &set));
  EXPECT_EQ(CPU_COUNT(&set), 7);
  EXPECT_EQ(CpuListText(set), "0-3,8,10-11");
  ASSERT_TRUE(ParseCpuList("5", &set));
  EXPECT_EQ(CpuListText(set), "5");
  for (const char* bad : {"", "x", "3-1", "1,,2", "0-", "99999"}) EXPECT_FALSE(ParseCpuList(bad, &set)) << bad;
  CPU_ZERO(&set);
  EXPECT_EQ(CpuListText(set), "none");
}

// A thread bound to one CPU (mpirun's default for 2 or fewer ranks) is moved to the others; one with several
// CPUs and no GPU to be near stays where it is.
TEST(ServiceThread, LeavesABindingToOneCpuAndKeepsAWiderOne) {
  const cpu_set_t all = CpusOfThisThread();
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "this process may use one CPU only (" << CpuListText(all) << ")";
  const int bound = FirstCpu(all);
  std::string whatOne, whatWide;
  cpu_set_t afterOne, afterWide;
  std::thread([&] {
    cpu_set_t one = OneCpu(bound);
    ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);
    whatOne = PlaceServiceThread("test", -1);
    afterOne = CpusOfThisThread();
  }).join();
  std::thread([&] {
    whatWide = PlaceServiceThread("test", -1);
    afterWide = CpusOfThisThread();
  }).join();
  EXPECT_FALSE(CPU_ISSET(bound, &afterOne)) << whatOne;
  EXPECT_GE(CPU_COUNT(&afterOne), 1) << whatOne;
  EXPECT_NE(whatOne.find("beside this process's binding to CPU " + std::to_string(bound) + " alone"), std::string::npos)
      << whatOne;
  EXPECT_TRUE(CPU_EQUAL(&afterWide, &all)) << whatWide << ": now " << CpuListText(afterWide);
}

TEST(ServiceThread, NamesAreCutToTheKernelsLimit) {
  std::string name;
  std::thread([&] {
    NameThisThread("a-role-whose-name-is-long", 12345);
    char got[64] = {};
    pthread_getname_np(pthread_self(), got, sizeof(got));
    name = got;
  }).join();
  EXPECT_EQ(name, std::string("mori-a-role-who"));
}

}  // namespace
}  // namespace mori::core
