// Leases and fencing with real processes: a lock holder and the lock manager are each paused
// (SIGSTOP) past the lease while others work, then resumed (SIGCONT): they are fenced, the node
// rejoins as a new life, no two holders ever overlap (exact counts), and `check` stays clean —
// on coherent hardware and under the non-coherent simulator. Also: heartbeats never wait on
// periodic work, a rejoin takes a new life, the node-local file goes with the node's last
// process, and election skips nodes that may not host the manager.
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "child.h"
#include "lock_test_util.h"
#include "sync/local_node.h"

namespace cxlkv {
namespace {

using testing::Child;
using testing::LockSetup;
using testing::OpenOrNull;
using testing::Prepare;
using testing::ReadCounter;
using namespace std::chrono_literals;

// Shared between the test and its children.
struct Board {
  std::atomic<int> stop;
  std::atomic<uint64_t> counted[4];
};

Board* NewBoard() {
  void* p = mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (p) Board();
}

// Increments under the lock until told to stop; records how many increments it made.
int IncrementUntilStopped(const LockSetup& s, uint32_t node, uint64_t sim_seed, Board* b, int slot) {
  auto p = OpenOrNull({s.path}, node, sim_seed);
  CHILD_CHECK(p != nullptr, "open");
  auto& n = *p->impl().node;
  uint64_t off = region::Offset<void>(s.counter).byte_offset();
  uint64_t mine = 0;
  while (!b->stop.load()) {
    auto held = n.AcquireFor(s.lock, 30s);
    if (!held.ok() && held.status().code() == StatusCode::kLeaseExpired) continue;
    CHILD_CHECK(held.ok(), "%s", held.status().ToString().c_str());
    uint64_t v = n.meta().Fetch(off);
    if (!n.CheckHeld(s.lock).ok()) {
      n.Release(s.lock);
      continue;
    }
    n.meta().Store(off, v + 1);
    sync::Range r{off, 8};
    n.Release(s.lock, {&r, 1});
    ++mine;
    b->counted[slot].store(mine);
  }
  return 0;
}

void ExpectCheckClean(const std::string& path) {
  auto regions = pool::AttachAll({path});
  ASSERT_TRUE(regions.ok());
  auto problems = pool::Check(*regions);
  EXPECT_TRUE(problems.empty()) << problems.front();
}

// The holder of the lock (node 2) is stopped while it holds, for several leases, while nodes 0
// and 1 count under the same lock; then it is resumed and tries to write under its old hold.
void PausedHolder(uint64_t seed) {
  testing::TempRegionPath path("pausedholder");
  LockSetup s = Prepare(path.path(), 3);
  Board* b = NewBoard();
  std::fflush(stdout);
  Child victim = Child::Fork([&](int in, int out) -> int {
    auto p = OpenOrNull({s.path}, 2, seed ? seed * 10 + 2 : 0);
    CHILD_CHECK(p != nullptr, "open");
    auto& n = *p->impl().node;
    auto held = n.AcquireFor(s.lock, 30s);
    CHILD_CHECK(held.ok(), "%s", held.status().ToString().c_str());
    uint64_t go;
    CHILD_CHECK(testing::Put(out, 1) && testing::Get(in, &go), "pipe");
    // Resumed: the hold belongs to a life that was declared dead. The fence must refuse it.
    Status st = n.CheckHeld(s.lock);
    if (st.ok()) {  // what an unfenced holder does: write under a hold that is no longer its
      uint64_t off = region::Offset<void>(s.counter).byte_offset();
      n.meta().Store(off, n.meta().Fetch(off) + 1);
      sync::Range r{off, 8};
      n.Release(s.lock, {&r, 1});
    }
    CHILD_CHECK(!st.ok(), "a paused holder was allowed to write under its old hold");
    CHILD_CHECK(st.code() == StatusCode::kLeaseExpired, "%s", st.ToString().c_str());
    n.Release(s.lock);
    // The node comes back as a new life and can take the lock again, properly.
    auto deadline = std::chrono::steady_clock::now() + 10s;
    while (n.new_lives() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
    CHILD_CHECK(n.new_lives() >= 2, "no new life after the pause");
    return 0;
  });
  uint64_t ready;
  ASSERT_TRUE(victim.Receive(&ready));
  ::kill(victim.pid, SIGSTOP);
  auto codes = testing::RunForked(3, [&](int i) {
    if (i == 2) {
      ::usleep(4 * testing::kTestLeaseMs * 1000);  // survivors take over the lock meanwhile
      ::kill(victim.pid, SIGCONT);
      if (!victim.Send(1)) return 1;
      ::usleep(2 * testing::kTestLeaseMs * 1000);  // the survivors keep counting while it resumes
      b->stop.store(1);
      return 0;
    }
    return IncrementUntilStopped(s, static_cast<uint32_t>(i), seed ? seed * 10 + i : 0, b, i);
  });
  EXPECT_EQ(victim.Wait(), 0) << "victim, seed " << seed;
  for (int code : codes) EXPECT_EQ(code, 0) << "seed " << seed;
  uint64_t counted = b->counted[0].load() + b->counted[1].load();
  EXPECT_GT(counted, 0u) << "the survivors never got the lock from the paused holder";
  EXPECT_EQ(ReadCounter(s), counted) << "seed " << seed;
  ExpectCheckClean(s.path);
  munmap(b, sizeof(Board));
}

TEST(Lease, APausedHolderIsFencedAndNeverHoldsBesideAnother) { PausedHolder(0); }
TEST(Lease, APausedHolderIsFencedUnderTheSimulator) {
  for (uint64_t seed : {5, 23}) PausedHolder(seed);
}

// The manager's host (node 0, the lowest) is stopped while nodes 1 and 2 count; node 1 takes
// management over; node 0 resumes, is fenced, rejoins as a new life and takes management back.
void PausedManager(uint64_t seed) {
  testing::TempRegionPath path("pausedmgr");
  LockSetup s = Prepare(path.path(), 3);
  Board* b = NewBoard();
  std::fflush(stdout);
  Child victim = Child::Fork([&](int in, int out) -> int {
    auto p = OpenOrNull({s.path}, 0, seed ? seed * 10 : 0);
    CHILD_CHECK(p != nullptr, "open");
    auto& n = *p->impl().node;
    auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!n.is_manager() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
    CHILD_CHECK(n.is_manager(), "node 0 never became manager");
    uint64_t go;
    CHILD_CHECK(testing::Put(out, 1) && testing::Get(in, &go), "pipe");
    deadline = std::chrono::steady_clock::now() + 10s;
    while (n.new_lives() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
    CHILD_CHECK(n.new_lives() >= 2, "no new life after the pause");
    return 0;
  });
  uint64_t ready;
  ASSERT_TRUE(victim.Receive(&ready));
  auto codes = testing::RunForked(3, [&](int i) {
    if (i == 2) {
      ::usleep(300 * 1000);  // counting under node 0's management
      ::kill(victim.pid, SIGSTOP);
      ::usleep(4 * testing::kTestLeaseMs * 1000);
      ::kill(victim.pid, SIGCONT);
      if (!victim.Send(1)) return 1;
      ::usleep(3 * testing::kTestLeaseMs * 1000);  // node 0 resumes, rejoins, manages again
      b->stop.store(1);
      return 0;
    }
    return IncrementUntilStopped(s, static_cast<uint32_t>(i + 1), seed ? seed * 10 + i + 1 : 0, b, i);
  });
  EXPECT_EQ(victim.Wait(), 0) << "victim, seed " << seed;
  for (int code : codes) EXPECT_EQ(code, 0) << "seed " << seed;
  uint64_t counted = b->counted[0].load() + b->counted[1].load();
  EXPECT_GT(counted, 0u);
  EXPECT_EQ(ReadCounter(s), counted) << "seed " << seed;
  ExpectCheckClean(s.path);
  munmap(b, sizeof(Board));
}

TEST(Lease, APausedManagerIsFencedAndManagementMovesAndReturns) { PausedManager(0); }
TEST(Lease, APausedManagerIsFencedUnderTheSimulator) {
  for (uint64_t seed : {5, 23}) PausedManager(seed);
}

TEST(Heartbeat, ABlockedPeriodicTaskDoesNotStopBeats) {
  testing::TempRegionPath path("blockeddrain");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 2;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  auto a = OpenOrNull({path.path()}, 0);
  auto b = OpenOrNull({path.path()}, 1);
  ASSERT_TRUE(a && b);
  std::atomic<bool> release{false};
  // A task that waits three leases (as a drain waiting on a lock held by a dead node would).
  a->impl().node->AddPeriodicTask([&] {
    auto until = std::chrono::steady_clock::now() + 3 * std::chrono::milliseconds(testing::kTestLeaseMs);
    while (!release.load() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  });
  uint64_t inc = a->impl().node->incarnation();
  auto until = std::chrono::steady_clock::now() + 3 * std::chrono::milliseconds(testing::kTestLeaseMs);
  int samples = 0;
  while (std::chrono::steady_clock::now() < until) {
    auto views = b->impl().node->Nodes();
    ASSERT_TRUE(views[0].live) << "node 0 was seen dead while only its periodic task was blocked";
    ++samples;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_GT(samples, 10);
  EXPECT_EQ(a->impl().node->incarnation(), inc) << "node 0 started a new life: its beats stopped";
  EXPECT_TRUE(a->impl().node->Fence("test").ok());
  release.store(true);
}

// A node that leaves while a periodic task of it is still at work (a last remote-free drain
// waiting on the allocator lock) keeps beating until that task has ended: it is never presumed
// dead on the way out — which would let a recoverer take its rings and heap under the task.
TEST(Heartbeat, ALeavingNodeBeatsUntilItsLastPeriodicTaskEnds) {
  testing::TempRegionPath path("leavingdrain");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 2;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  auto a = OpenOrNull({path.path()}, 0);
  auto b = OpenOrNull({path.path()}, 1);
  ASSERT_TRUE(a && b);
  std::atomic<bool> entered{false}, release{false}, blocked_once{false};
  a->impl().node->AddPeriodicTask([&] {
    if (blocked_once.exchange(true)) return;
    entered.store(true);
    auto until = std::chrono::steady_clock::now() + 4 * std::chrono::milliseconds(testing::kTestLeaseMs);
    while (!release.load() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  });
  while (!entered.load()) std::this_thread::sleep_for(1ms);
  std::thread closer([&] { a.reset(); });  // leaves while the task is blocked
  auto until = std::chrono::steady_clock::now() + 2 * std::chrono::milliseconds(testing::kTestLeaseMs);
  int samples = 0;
  bool always_live = true;
  while (std::chrono::steady_clock::now() < until) {
    always_live = always_live && b->impl().node->Nodes()[0].live;
    ++samples;
    std::this_thread::sleep_for(10ms);
  }
  release.store(true);
  closer.join();
  EXPECT_GT(samples, 10);
  EXPECT_TRUE(always_live) << "node 0 fell silent while leaving: its beats stopped before its tasks";
}

TEST(Heartbeat, ARejoinAlwaysTakesANewLife) {
  testing::TempRegionPath path("rejoin");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 2;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  uint64_t first;
  {
    auto a = OpenOrNull({path.path()}, 0);
    ASSERT_TRUE(a);
    first = a->impl().node->incarnation();
  }
  auto again = OpenOrNull({path.path()}, 0);  // within a lease of leaving
  ASSERT_TRUE(again);
  EXPECT_GT(again->impl().node->incarnation(), first);
}

TEST(Heartbeat, TheNodeLocalFileGoesWithTheNodesLastProcess) {
  testing::TempRegionPath path("localfile");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 2;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  std::string local;
  {
    auto a = OpenOrNull({path.path()}, 1);
    ASSERT_TRUE(a);
    local = sync::LocalNode::PathFor(a->impl().regions[0]->info().region_id, 1);
    EXPECT_TRUE(std::filesystem::exists(local));
    auto b = OpenOrNull({path.path()}, 1);  // a second "process" of the same node
    ASSERT_TRUE(b);
    b.reset();
    EXPECT_TRUE(std::filesystem::exists(local)) << "removed while a process of the node was attached";
  }
  EXPECT_FALSE(std::filesystem::exists(local)) << "the node's last process left its local file behind";
  // A file nobody holds (its processes were killed) is swept by the next joiner.
  std::string stale = "/dev/shm/cxlkv-node-0000000000000000feedfacecafebeef-7";
  { std::ofstream(stale) << "left by a kill -9"; }
  auto c = OpenOrNull({path.path()}, 0);
  ASSERT_TRUE(c);
  EXPECT_FALSE(std::filesystem::exists(stale));
}

// Forks a process that joins the pool as `node`, says so on `ready`, and waits to be killed.
pid_t JoinAndWait(const std::string& path, uint32_t node, int ready) {
  pid_t pid = ::fork();
  if (pid == 0) {
    auto p = OpenOrNull({path}, node);
    if (!p || ::write(ready, "r", 1) != 1) ::_exit(1);
    for (;;) ::pause();
  }
  return pid;
}

// kill -9 leaves the node-local file (nobody runs the destructor), but the kernel drops the
// killed process's flock: the next joiner sweeps the file when no process of the node is left,
// and never while one still is.
TEST(Heartbeat, AKilledNodesLocalFileIsSweptOnlyOnceNoProcessHoldsIt) {
  testing::TempRegionPath path("localkill");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 3;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  std::string region_id;
  {
    auto regions = pool::AttachAll({path.path()});
    ASSERT_TRUE(regions.ok());
    region_id = (*regions)[0]->info().region_id;
  }
  const std::string local = sync::LocalNode::PathFor(region_id, 1);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t first = JoinAndWait(path.path(), 1, ready[1]);
  pid_t second = JoinAndWait(path.path(), 1, ready[1]);  // a second process of node 1
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_TRUE(std::filesystem::exists(local));
  int status;
  ::kill(first, SIGKILL);
  ::waitpid(first, &status, 0);
  {
    auto joiner = OpenOrNull({path.path()}, 0);  // sweeps what nobody holds
    ASSERT_TRUE(joiner);
    EXPECT_TRUE(std::filesystem::exists(local)) << "swept while a process of node 1 still held it";
  }
  ::kill(second, SIGKILL);
  ::waitpid(second, &status, 0);
  // kill -9 cannot remove it; any joiner's sweep may from now on — another test's, in parallel,
  // as well as the one below — so its existence here is not asserted.
  {
    auto joiner = OpenOrNull({path.path()}, 2);
    ASSERT_TRUE(joiner);
    EXPECT_FALSE(std::filesystem::exists(local)) << "a file no process holds outlived the next joiner";
  }
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(Election, SkipsANodeThatMayNotHostTheManager) {
  testing::TempRegionPath path("nohost");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 3;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  PoolOpenOptions o;
  o.node_id = 0;  // the lowest: would be elected, but may not host
  o.lease_ms = testing::kTestLeaseMs;
  o.may_host_manager = false;
  auto client = Pool::Open({path.path()}, o);
  ASSERT_TRUE(client.ok());
  auto host = OpenOrNull({path.path()}, 2);
  ASSERT_TRUE(host);
  auto lock = (*client)->AllocateLock();  // needs a manager: node 2's
  ASSERT_TRUE(lock.ok()) << lock.status().ToString();
  EXPECT_TRUE((*client)->Lock(*lock, 5000).ok());
  (*client)->Unlock(*lock);
  EXPECT_TRUE(host->impl().node->is_manager());
  EXPECT_FALSE((*client)->impl().node->is_manager());
}

}  // namespace
}  // namespace cxlkv
