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
    PoolOpenOptions o;
    o.node_id = 0;
    o.lease_ms = testing::kTestLeaseMs;
    o.attach.sim_seed = 700;
    o.attach.sim_quiet_cache = true;
    auto p = Pool::Open({s.path}, o);
    CHILD_CHECK(p.ok(), "open the manager's node: %s", p.status().ToString().c_str());
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

// The manager re-reads a node's request words when its doorbell names the lock now or named it
// at the last read. A node publishes its request before it sets the lock's bit, so the manager
// can read a new odd request while the bit is still clear (the node's previous release of the
// same lock just cleared it) and grant it; the node then sets the bit, holds, releases and clears
// it, all between two reads of its doorbell. A manager that tracked locks by the bitmap alone
// never re-read that request and took the lock for held forever: four writers stalled, each
// waiting for a lock nobody held, while the manager slept idle. Node 1's request and doorbell are
// written by hand here, to show the manager exactly the states it can read in that race.
TEST(TwoTierLock, AReleaseWhoseBitTheManagerNeverSawStillFreesTheLock) {
  testing::TempRegionPath path("lockunseen");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 3;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  auto manager = OpenOrNull({path.path()}, 0);  // the lowest live node: the manager
  auto hand = OpenOrNull({path.path()}, 1);     // live and beating; its lock words written below
  auto other = OpenOrNull({path.path()}, 2);
  ASSERT_TRUE(manager && hand && other);
  region::MetaAccess& meta = testing::Meta(*hand);
  const auto* area = hand->impl().regions[0]->impl().find_area(region::AreaKind::kLockArray);
  ASSERT_NE(area, nullptr);
  const sync::LockArrayLayout layout(area->offset, co.max_nodes, static_cast<uint32_t>(area->param));
  const uint32_t lock = sync::kReservedLocks + 7;  // no process takes it but through this test
  const uint32_t me = 1;
  const uint64_t inc = hand->impl().node->incarnation();
  auto request = [&](uint32_t seq) { meta.Publish(layout.request(lock, me), sync::MakeRequest(inc, seq)); };
  auto bit = [&](bool set) {  // as Node::RingDoorbell: node 1's own threads may ring meanwhile
    const uint64_t word = layout.wanted_word(me, lock);
    const uint64_t b = uint64_t{1} << (lock % 64);
    uint64_t cur = meta.Load(word);
    while (!meta.LocalCompareExchange(word, cur, set ? (cur | b) : (cur & ~b))) {
    }
    meta.Flush(word, 8);
  };
  auto ring = [&] {
    meta.LocalFetchAdd(layout.doorbell(me), 1);
    meta.Flush(layout.doorbell(me), 8);
  };
  auto granted = [&](uint32_t seq) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      if (meta.Fetch(layout.grant(lock, me)) == sync::MakeRequest(inc, seq)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  };
  // A plain acquire: request 1, bit, ring; the manager grants it.
  request(1);
  bit(true);
  ring();
  ASSERT_TRUE(granted(1));
  // The release and the next acquire as the manager may read them: the release's cleared bit
  // and rung sequence, and already the next odd request (the manager need never see the even
  // one in between). It grants request 3 with the bit clear.
  request(3);
  bit(false);
  ring();
  ASSERT_TRUE(granted(3));
  // Set-bit-and-ring, hold, release-and-clear-and-ring: the manager sees only the last ring.
  request(4);
  ring();
  // Request 3 is over: another node gets the lock.
  EXPECT_TRUE(other->Lock(lock, 10 * testing::kTestLeaseMs).ok()) << "the manager still takes lock "
      << lock << " for held by node 1's request 3";
  other->Unlock(lock);
}

// A request and its doorbell are flushed under one fence, so the doorbell line can reach memory
// before the request line: the manager then reads the new sequence (and bit) over the old
// request. It must read that request again until its parity agrees with its bit, without
// another ring. Node 1's words are written by hand, each line flushed apart, in the order that
// needs the re-read. The leases are long, so the manager's periodic resync (every lease / 8)
// cannot be what finds the request within the 2 s these steps allow.
TEST(TwoTierLock, ARequestThatLandsAfterItsDoorbellIsStillRead) {
  testing::TempRegionPath path("lockhalf");
  PoolCreateOptions co;
  co.size = 16 << 20;
  co.max_nodes = 3;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  constexpr uint32_t kLongLeaseMs = 40000;
  auto manager = OpenOrNull({path.path()}, 0, 0, kLongLeaseMs);
  auto hand = OpenOrNull({path.path()}, 1, 0, kLongLeaseMs);
  auto other = OpenOrNull({path.path()}, 2, 0, kLongLeaseMs);
  ASSERT_TRUE(manager && hand && other);
  region::MetaAccess& meta = testing::Meta(*hand);
  const auto* area = hand->impl().regions[0]->impl().find_area(region::AreaKind::kLockArray);
  ASSERT_NE(area, nullptr);
  const sync::LockArrayLayout layout(area->offset, co.max_nodes, static_cast<uint32_t>(area->param));
  const uint32_t lock = sync::kReservedLocks + 9;  // no process takes it but through this test
  const uint32_t me = 1;
  const uint64_t inc = hand->impl().node->incarnation();
  auto request = [&](uint32_t seq) { meta.Publish(layout.request(lock, me), sync::MakeRequest(inc, seq)); };
  auto bit_and_ring = [&](bool set) {  // the doorbell line alone, as it may land first
    const uint64_t word = layout.wanted_word(me, lock);
    const uint64_t b = uint64_t{1} << (lock % 64);
    uint64_t cur = meta.Load(word);
    while (!meta.LocalCompareExchange(word, cur, set ? (cur | b) : (cur & ~b))) {
    }
    meta.LocalFetchAdd(layout.doorbell(me), 1);
    const uint64_t lines[2] = {layout.doorbell(me), word};
    meta.FlushEach(lines, 8);
  };
  auto granted = [&](uint32_t seq) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (std::chrono::steady_clock::now() < deadline) {
      if (meta.Fetch(layout.grant(lock, me)) == sync::MakeRequest(inc, seq)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  };
  // A manager runs (its election waits for nothing the leases set): a plain lock is granted.
  ASSERT_TRUE(other->Lock(lock, 20000).ok());
  other->Unlock(lock);
  // An acquire whose bit and ring land first: the manager reads a set bit over request 0.
  bit_and_ring(true);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the manager read that
  request(1);  // the request line lands: no ring follows
  ASSERT_TRUE(granted(1)) << "the manager never read request 1 again after its doorbell";
  // A release whose cleared bit lands first: the manager reads a clear bit over request 1 (held).
  bit_and_ring(false);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  request(2);
  EXPECT_TRUE(other->Lock(lock, 2000).ok()) << "the manager still takes lock " << lock
      << " for held by node 1's request 1";
  other->Unlock(lock);
}

}  // namespace
}  // namespace cxlkv
