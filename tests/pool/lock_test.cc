// The two-tier lock across real processes: exact counts, the simulator, kill -9 of a holder and
// of the lock manager's host.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "lock_test_util.h"
#include "sync/layout.h"

namespace cxlkv {
namespace {

using testing::Incrementer;
using testing::LockSetup;
using testing::OpenOrNull;
using testing::Prepare;
using testing::ReadCounter;

TEST(TwoTierLock, FourNodesCountExactly) {
  testing::TempRegionPath path("lock4");
  LockSetup s = Prepare(path.path(), 4);
  constexpr int kIters = 20000;
  auto codes = testing::RunForked(4, [&](int i) { return Incrementer(s, i, kIters, 0, false); });
  for (int c : codes) EXPECT_EQ(c, 0);
  EXPECT_EQ(ReadCounter(s), 4u * kIters);
}

TEST(TwoTierLock, TwoNodesOfTwoProcessesCountExactly) {
  testing::TempRegionPath path("lock2x2");
  LockSetup s = Prepare(path.path(), 2);
  constexpr int kIters = 20000;
  auto codes = testing::RunForked(4, [&](int i) { return Incrementer(s, i / 2, kIters, 0, false); });
  for (int c : codes) EXPECT_EQ(c, 0);
  EXPECT_EQ(ReadCounter(s), 4u * kIters);
}

TEST(TwoTierLock, ExactUnderTheSimulatorOverManySeeds) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({3, 17, 29, 41, 53})) {
    testing::TempRegionPath path("locksim");
    LockSetup s = Prepare(path.path(), 4);
    constexpr int kIters = 150;
    auto codes = testing::RunForked(4, [&](int i) { return Incrementer(s, i, kIters, seed * 100 + i, false); });
    for (int c : codes) EXPECT_EQ(c, 0) << "seed " << seed;
    EXPECT_EQ(ReadCounter(s), 4u * kIters) << "seed " << seed;
  }
}

// Random write-backs would carry an unflushed request or grant to memory sooner or later, and
// the periodic resync would find it: the lock would still progress without the flushes that make
// it progress. With a cache that writes nothing back on its own, every grant needs the request's
// flush, the manager's invalidates and the grant's flush and fetch (the flush audit's check of
// those sites).
TEST(TwoTierLock, ProgressesUnderTheSimulatorOnlyThroughItsOwnFlushes) {
  testing::TempRegionPath path("lockquiet");
  LockSetup s = Prepare(path.path(), 4);
  constexpr int kIters = 40;
  constexpr uint64_t kTotal = 3 * kIters;
  // Node 0, the lowest, is the manager throughout and takes no lock itself: a manager grants its
  // own node's requests out of its own cache, and one that left would hand the role on to a
  // writer, which would then need no flush either.
  auto* writers_done = static_cast<std::atomic<int>*>(
      mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(writers_done, MAP_FAILED);
  writers_done->store(0);
  auto codes = testing::RunForked(4, [&](int i) {
    if (i > 0) {
      const int rc = Incrementer(s, i, kIters, 7 * 100 + i, false, /*quiet_cache=*/true, std::chrono::seconds(5));
      writers_done->fetch_add(1);
      return rc;
    }
    auto p = OpenOrNull({s.path}, 0, 700, testing::kTestLeaseMs, /*sim_quiet_cache=*/true);
    CHILD_CHECK(p != nullptr, "open the manager's node");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (writers_done->load() < 3 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return 0;
  });
  munmap(writers_done, sizeof(std::atomic<int>));
  for (int c : codes) EXPECT_EQ(c, 0);
  EXPECT_EQ(ReadCounter(s), kTotal);
}

TEST(TwoTierLock, SimulatorCatchesAReleaseWithoutItsFlush) {
  int lost_in = 0;
  for (uint64_t seed : {3, 17, 29}) {
    testing::TempRegionPath path("locksimbad");
    LockSetup s = Prepare(path.path(), 4);
    constexpr int kIters = 150;
    auto codes = testing::RunForked(4, [&](int i) { return Incrementer(s, i, kIters, seed * 100 + i, true); });
    for (int c : codes) EXPECT_EQ(c, 0);
    if (ReadCounter(s) != 4u * kIters) ++lost_in;
  }
  EXPECT_GT(lost_in, 0) << "dropping the release flush must lose increments under the simulator";
}

// A child that acquires the lock and then hangs holding it.
int HoldForever(const LockSetup& s, uint32_t node, int ready_fd) {
  auto p = OpenOrNull({s.path}, node);
  CHILD_CHECK(p != nullptr, "open");
  auto held = p->impl().node->AcquireFor(s.lock, std::chrono::seconds(30));
  CHILD_CHECK(held.ok(), "%s", held.status().ToString().c_str());
  char c = 'x';
  CHILD_CHECK(::write(ready_fd, &c, 1) == 1, "pipe");
  for (;;) ::pause();
}

void KillScenario(bool kill_manager) {
  testing::TempRegionPath path(kill_manager ? "killmgr" : "killholder");
  LockSetup s = Prepare(path.path(), 3);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::fflush(stdout);
  // Node 0 hosts the manager (lowest live id). Victim: node 0 itself, or node 2 holding the lock.
  uint32_t victim_node = kill_manager ? 0 : 2;
  pid_t victim = ::fork();
  if (victim == 0) {
    if (kill_manager) {
      auto p = OpenOrNull({s.path}, 0);
      char c = 'x';
      if (!p || ::write(fds[1], &c, 1) != 1) ::_exit(1);
      for (;;) ::pause();
    }
    ::_exit(HoldForever(s, victim_node, fds[1]));
  }
  char c;
  ASSERT_EQ(::read(fds[0], &c, 1), 1);
  constexpr int kIters = 200;
  std::vector<uint32_t> survivors = kill_manager ? std::vector<uint32_t>{1, 2} : std::vector<uint32_t>{0, 1};
  // Survivors start, then the victim dies under them.
  auto codes = testing::RunForked(3, [&](int i) {
    if (i == 2) {
      ::usleep(200 * 1000);
      ::kill(victim, SIGKILL);
      return 0;
    }
    return Incrementer(s, survivors[i], kIters, 0, false);
  });
  int status;
  ::waitpid(victim, &status, 0);
  for (int code : codes) EXPECT_EQ(code, 0);
  // The victim never increments: the count is the survivors' alone.
  uint64_t count = ReadCounter(s);
  EXPECT_EQ(count, 2u * kIters);
  auto regions = pool::AttachAll({s.path});
  ASSERT_TRUE(regions.ok());
  auto problems = pool::Check(*regions);
  EXPECT_TRUE(problems.empty()) << problems.front();
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(TwoTierLock, KillNineOfTheHolderLetsOthersProceed) { KillScenario(false); }
TEST(TwoTierLock, KillNineOfTheManagersHostHandsManagementOver) { KillScenario(true); }

TEST(TwoTierLock, TimeoutWithdrawsTheRequestAndLocksCanBeFreed) {
  testing::TempRegionPath path("locktimeout");
  LockSetup s = Prepare(path.path(), 2);
  auto p = OpenOrNull({s.path}, 0);
  ASSERT_TRUE(p);
  ASSERT_TRUE(p->Lock(s.lock, 5000).ok());
  // The same node cannot re-enter from another thread: the local tier times out.
  std::thread t([&] { EXPECT_EQ(p->Lock(s.lock, 100).code(), StatusCode::kTimeout); });
  t.join();
  p->Unlock(s.lock);
  EXPECT_TRUE(p->Lock(s.lock, 5000).ok());
  p->Unlock(s.lock);
  EXPECT_TRUE(p->FreeLock(s.lock).ok());
  EXPECT_EQ(p->FreeLock(s.lock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p->Lock(1, 10).code(), StatusCode::kInvalidArgument);  // internal
}

// Three live nodes on a fresh pool: node 0, the lowest, hosts the manager; node 1's lock words
// are written by hand (HandWrittenLock) to show the manager exact states; node 2 takes the lock
// the ordinary way.
struct ThreeNodes {
  testing::TempRegionPath path;
  std::unique_ptr<Pool> manager, hand, other;

  ThreeNodes(const char* name, uint32_t lease_ms) : path(name) {
    PoolCreateOptions co;
    co.size = 16 << 20;
    co.max_nodes = 3;
    if (!Pool::Create({path.path()}, co).ok()) return;
    manager = OpenOrNull({path.path()}, 0, 0, lease_ms);
    hand = OpenOrNull({path.path()}, 1, 0, lease_ms);
    other = OpenOrNull({path.path()}, 2, 0, lease_ms);
  }
  bool ok() const { return manager && hand && other; }
};

// Node 1's request, wanted bit and doorbell for one lock, each line flushed on its own, so a
// test chooses the order in which they reach memory.
class HandWrittenLock {
 public:
  HandWrittenLock(Pool& hand, uint32_t lock)
      : meta_(testing::Meta(hand)),
        layout_(LayoutOf(hand)),
        lock_(lock),
        inc_(hand.impl().node->incarnation()) {}

  void Request(uint32_t seq) { meta_.Publish(layout_.request(lock_, kMe), sync::MakeRequest(inc_, seq)); }
  // As Node::PublishRequest: node 1's own threads may ring meanwhile.
  void Bit(bool set) {
    const uint64_t word = layout_.wanted_word(kMe, lock_);
    const uint64_t b = uint64_t{1} << (lock_ % 64);
    uint64_t cur = meta_.Load(word);
    while (!meta_.LocalCompareExchange(word, cur, set ? (cur | b) : (cur & ~b))) {
    }
    meta_.Flush(word, 8);
  }
  void Ring() {
    meta_.LocalFetchAdd(layout_.doorbell(kMe), 1);
    meta_.Flush(layout_.doorbell(kMe), 8);
  }
  bool Granted(uint32_t seq, std::chrono::seconds within) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (std::chrono::steady_clock::now() < deadline) {
      if (meta_.Fetch(layout_.grant(lock_, kMe)) == sync::MakeRequest(inc_, seq)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

 private:
  static constexpr uint32_t kMe = 1;
  static sync::LockArrayLayout LayoutOf(Pool& p) {
    const auto* area = p.impl().regions[0]->impl().find_area(region::AreaKind::kLockArray);
    EXPECT_NE(area, nullptr);
    return sync::LockArrayLayout(area != nullptr ? area->offset : 0, 3,
                                 area != nullptr ? static_cast<uint32_t>(area->param) : 0);
  }
  region::MetaAccess& meta_;
  sync::LockArrayLayout layout_;
  uint32_t lock_;
  uint64_t inc_;
};

// The manager re-reads a node's request words when its doorbell names the lock now or named it
// at the last read. A node publishes its request before it sets the lock's bit, so the manager
// can read a new odd request while the bit is still clear (the node's previous release of the
// same lock just cleared it) and grant it; the node then sets the bit, holds, releases and clears
// it, all between two reads of its doorbell. A manager that tracked locks by the bitmap alone
// never re-read that request and took the lock for held forever: four writers stalled, each
// waiting for a lock nobody held, while the manager slept idle. Node 1's request and doorbell are
// written by hand here, to show the manager exactly the states it can read in that race.
TEST(TwoTierLock, AReleaseWhoseBitTheManagerNeverSawStillFreesTheLock) {
  ThreeNodes nodes("lockunseen", testing::kTestLeaseMs);
  ASSERT_TRUE(nodes.ok());
  const uint32_t lock = sync::kReservedLocks + 7;  // no process takes it but through this test
  HandWrittenLock node1(*nodes.hand, lock);
  constexpr std::chrono::seconds kWithin{20};
  // A plain acquire: request 1, bit, ring; the manager grants it.
  node1.Request(1);
  node1.Bit(true);
  node1.Ring();
  ASSERT_TRUE(node1.Granted(1, kWithin));
  // The release and the next acquire as the manager may read them: the release's cleared bit
  // and rung sequence, and already the next odd request (the manager need never see the even
  // one in between). It grants request 3 with the bit clear.
  node1.Request(3);
  node1.Bit(false);
  node1.Ring();
  ASSERT_TRUE(node1.Granted(3, kWithin));
  // Set-bit-and-ring, hold, release-and-clear-and-ring: the manager sees only the last ring.
  node1.Request(4);
  node1.Ring();
  // Request 3 is over: another node gets the lock.
  EXPECT_TRUE(nodes.other->Lock(lock, 10 * testing::kTestLeaseMs).ok()) << "the manager still takes lock "
      << lock << " for held by node 1's request 3";
  nodes.other->Unlock(lock);
}

// A request and its doorbell are flushed under one fence, so the doorbell line can reach memory
// before the request line: the manager then reads the new sequence (and bit) over the old
// request. It must read that request again until its parity agrees with its bit, without
// another ring. Node 1's words are written by hand, each line flushed apart, in the order that
// needs the re-read. The leases are long, so the manager's periodic resync (every lease / 8)
// cannot be what finds the request within the 2 s these steps allow.
TEST(TwoTierLock, ARequestThatLandsAfterItsDoorbellIsStillRead) {
  ThreeNodes nodes("lockhalf", 40000);
  ASSERT_TRUE(nodes.ok());
  const uint32_t lock = sync::kReservedLocks + 9;  // no process takes it but through this test
  HandWrittenLock node1(*nodes.hand, lock);
  constexpr std::chrono::seconds kWithin{2};
  // A manager runs (its election waits for nothing the leases set): a plain lock is granted.
  ASSERT_TRUE(nodes.other->Lock(lock, 20000).ok());
  nodes.other->Unlock(lock);
  // An acquire whose bit and ring land first: the manager reads a set bit over request 0.
  node1.Bit(true);
  node1.Ring();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the manager read that
  node1.Request(1);  // the request line lands: no ring follows
  ASSERT_TRUE(node1.Granted(1, kWithin)) << "the manager never read request 1 again after its doorbell";
  // A release whose cleared bit lands first: the manager reads a clear bit over request 1 (held).
  node1.Bit(false);
  node1.Ring();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  node1.Request(2);
  EXPECT_TRUE(nodes.other->Lock(lock, 2000).ok()) << "the manager still takes lock " << lock
      << " for held by node 1's request 1";
  nodes.other->Unlock(lock);
}

}  // namespace
}  // namespace cxlkv
