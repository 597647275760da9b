// The host wake channel (src/sync/host_wake.h): a sleeper announced on it is woken by another
// process; a waker with nobody asleep makes no system call; the file goes with its last user
// and is swept when a kill -9 left it.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "sync/host_wake.h"

namespace cxlkv {
namespace {

using namespace std::chrono_literals;

std::string TestRegionId() { return "hostwaketest" + std::to_string(::getpid()); }

TEST(HostWake, ASleeperInAnotherProcessIsWokenNotTimedOut) {
  const std::string id = TestRegionId();
  auto wake = sync::HostWake::Open(id, 4);
  ASSERT_TRUE(wake.ok()) << wake.status().ToString();
  (*wake)->WakeManager();
  (*wake)->WakeGrant(2);
  EXPECT_EQ((*wake)->wakes_sent(), 0u) << "nobody sleeps: a wake-up must cost no system call";

  // The child sleeps on node 2's grant channel with a timeout far past the test's limit: it
  // returns only because it is woken. It tells us when it is armed.
  int armed[2];
  ASSERT_EQ(::pipe(armed), 0);
  pid_t child = ::fork();
  if (child == 0) {
    auto mine = sync::HostWake::Open(id, 4);
    if (!mine.ok()) ::_exit(1);
    uint32_t epoch = (*mine)->ArmGrant(2);
    if (::write(armed[1], "a", 1) != 1) ::_exit(1);
    (*mine)->WaitGrant(2, epoch, std::chrono::microseconds(std::chrono::seconds(3600)));
    (*mine)->DisarmGrant(2);
    ::_exit(0);
  }
  char c;
  ASSERT_EQ(::read(armed[0], &c, 1), 1);
  (*wake)->WakeGrant(1);  // another node's channel: not the child's
  EXPECT_EQ((*wake)->wakes_sent(), 0u);
  (*wake)->WakeGrant(2);
  EXPECT_EQ((*wake)->wakes_sent(), 1u);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ::close(armed[0]);
  ::close(armed[1]);

  // A wake-up sent before the sleep (after the arm) is not lost: the wait returns at once.
  uint32_t epoch = (*wake)->ArmManager();
  (*wake)->WakeManager();
  (*wake)->WaitManager(epoch, std::chrono::microseconds(std::chrono::seconds(3600)));
  (*wake)->DisarmManager();
  EXPECT_EQ((*wake)->wakes_sent(), 2u);
}

TEST(HostWake, TheFileGoesWithItsLastUserAndAKilledUsersIsSwept) {
  const std::string id = TestRegionId() + "b";
  const std::string path = sync::HostWake::PathFor(id);
  {
    auto a = sync::HostWake::Open(id, 2);
    ASSERT_TRUE(a.ok());
    {
      auto b = sync::HostWake::Open(id, 2);
      ASSERT_TRUE(b.ok());
    }
    EXPECT_TRUE(std::filesystem::exists(path)) << "removed while another user held it";
    auto other = sync::HostWake::Open(id, 3);
    EXPECT_EQ(other.status().code(), StatusCode::kCorrupted) << "a file for another node count must be refused";
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "the last user left its wake file behind";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  if (child == 0) {
    auto w = sync::HostWake::Open(id, 2);
    if (!w.ok() || ::write(ready[1], "r", 1) != 1) ::_exit(1);
    for (;;) ::pause();
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  sync::HostWake::SweepUnused("");
  EXPECT_TRUE(std::filesystem::exists(path)) << "swept while its user lives";
  ::kill(child, SIGKILL);
  int status;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(std::filesystem::exists(path));
  sync::HostWake::SweepUnused("");
  EXPECT_FALSE(std::filesystem::exists(path)) << "a killed user's file outlived the sweep";
  ::close(ready[0]);
  ::close(ready[1]);
}

}  // namespace
}  // namespace cxlkv
