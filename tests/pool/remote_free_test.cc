// Frees that cross a node's life: a remote free decided just before its owner leaves, and a
// payload an ended life still holds that nothing reaches any more. Real processes on one
// region, also under the non-coherent simulator.
#include <signal.h>

#include <atomic>
#include <chrono>

#include <thread>

#include <gtest/gtest.h>

#include "alloc_test_util.h"
#include "child.h"

namespace cxlkv {
namespace {

using testing::Allocated;
using testing::Child;
using testing::ExpectEverythingReturned;
using testing::ExpectNoProblems;
using testing::FreeChunks;
using testing::Get;
using testing::OpenOrNull;
using testing::Put;
using testing::SleepLeases;

constexpr uint64_t kRemoteFreeRegionBytes = 48 << 20;

std::vector<std::string> CreatePool(const std::string& path) {
  PoolCreateOptions co;
  co.size = kRemoteFreeRegionBytes;
  co.max_nodes = 4;
  EXPECT_TRUE(Pool::Create({path}, co).ok());
  return {path};
}

// Node 1 decides to free node 2's object through node 2's ring (node 2 surely beats), and
// stops right there; node 2 leaves cleanly; node 0 sees the leave at once and recovers node
// 2's life. The object is published under a root until the free returns (the consumer's
// order: free, then drop the name), so recovery keeps it unless it sees the free. Recovery
// must wait for the announced push and apply it: the object ends up freed, nothing leaks.
void PushDecidedAsTheOwnerLeaves(uint64_t sim_seed) {
  testing::TempRegionPath path("rf-leave");
  auto paths = CreatePool(path.path());
  const uint64_t total = FreeChunks(paths);
  Child owner = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 2, sim_seed ? sim_seed + 2 : 0);
    if (!p) return 1;
    auto off = p->Alloc(4096);
    if (!off.ok() || !p->Put("x", *off, 4096).ok() || !Put(out, *off)) return 2;
    uint64_t go;
    (void)Get(in, &go);  // leave when told
    return 0;
  });
  Child pusher = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 1, sim_seed ? sim_seed + 1 : 0);
    uint64_t off;
    if (!p || !Get(in, &off)) return 1;
    bool paused = false;
    p->impl().allocator->TestHookBeforePush([&] {
      uint64_t go;
      paused = Put(out, 1) && Get(in, &go);
    });
    Status freed = p->Free(off);
    CHILD_CHECK(paused, "the free never reached the push");
    CHILD_CHECK(freed.ok(), "free: %s", freed.ToString().c_str());
    CHILD_CHECK(p->Destroy("x").ok(), "destroy");
    return 0;
  });
  auto survivor = OpenOrNull(paths, 0, sim_seed);  // manages the pool, recovers node 2
  ASSERT_TRUE(survivor);
  uint64_t off, ack;
  ASSERT_TRUE(owner.Receive(&off));
  ASSERT_TRUE(pusher.Send(off));
  ASSERT_TRUE(pusher.Receive(&ack)) << "the pusher never decided to push";
  ASSERT_TRUE(owner.Send(1));
  EXPECT_EQ(owner.Wait(), 0);  // node 2 leaves, the push decided but not yet in its ring
  SleepLeases(1);                    // node 0 has seen the leave: its recovery of node 2 is under way
  ASSERT_TRUE(pusher.Send(1));
  EXPECT_EQ(pusher.Wait(), 0);
  ExpectEverythingReturned(survivor, paths, total);
  EXPECT_FALSE(Allocated(paths, off)) << "the free pushed as its owner left was never applied";
}

TEST(RemoteFree, APushDecidedAsTheOwnerLeavesIsApplied) { PushDecidedAsTheOwnerLeaves(0); }

TEST(RemoteFree, APushDecidedAsTheOwnerLeavesIsAppliedUnderTheNonCoherentSimulator) {
  for (uint64_t seed : {11u, 101u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    PushDecidedAsTheOwnerLeaves(seed);
  }
}

// The freer (node 1, its only process) is killed with -9 right after announcing its push, and
// the owner (node 2) leaves. Recovery of node 2 sees the announcement, waits only until node 1's
// life is over (not for ever), then recovers node 2: the object, still named by its root, is
// kept in an orphan chunk; everything else node 2 held goes back. Nothing hangs, check is clean.
TEST(RemoteFree, AFreerKilledAfterAnnouncingDoesNotStallRecovery) {
  testing::TempRegionPath path("rf-killed");
  auto paths = CreatePool(path.path());
  const uint64_t total = FreeChunks(paths);
  Child owner = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 2);
    if (!p) return 1;
    auto off = p->Alloc(4096);
    auto spare = p->Alloc(uint64_t{3} << 20);  // unpublished: recovery must free it
    if (!off.ok() || !spare.ok() || !p->Put("x", *off, 4096).ok() || !Put(out, *off)) return 2;
    uint64_t go;
    (void)Get(in, &go);
    return 0;
  });
  Child freer = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 1);
    uint64_t off;
    if (!p || !Get(in, &off)) return 1;
    p->impl().allocator->TestHookBeforePush([&] {
      uint64_t go;
      if (Put(out, 1)) (void)Get(in, &go);
      ::raise(SIGKILL);  // announced, never published
    });
    (void)p->Free(off);
    return 3;
  });
  auto survivor = OpenOrNull(paths, 0);
  ASSERT_TRUE(survivor);
  uint64_t off, ack;
  ASSERT_TRUE(owner.Receive(&off));
  ASSERT_TRUE(freer.Send(off));
  ASSERT_TRUE(freer.Receive(&ack));
  ASSERT_TRUE(freer.Send(1));
  EXPECT_EQ(freer.Wait(), 128 + SIGKILL);
  ASSERT_TRUE(owner.Send(1));
  EXPECT_EQ(owner.Wait(), 0);
  const auto start = std::chrono::steady_clock::now();
  // Recovery of node 2 waits for node 1's life to end (a lease), not for the announcement.
  while (FreeChunks(paths) != total - 1 && std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
    SleepLeases(0.25);
  }
  EXPECT_EQ(FreeChunks(paths), total - 1) << "node 2 was not recovered: the 3 MiB object or the heap chunk is still held";
  EXPECT_TRUE(Allocated(paths, off)) << "a root still names it";
  survivor.reset();
  ExpectNoProblems(paths);
}

// Node 2 has two processes. Node 1 frees node 2's objects through node 2's ring; node 2's first
// process drains them — claims them out of the ring, publishes the head — and is killed with -9
// before it applies any. Node 2 lives on in its second process, so no recovery will ever free
// them: its next drain must apply what the claim left, while node 2 still lives. Before the
// claim was recorded in the node-local file, those objects stayed allocated for the life.
// Returns false, having checked nothing, when the scene could not be set: node 2's first process
// never claimed the frees (under load node 2 may lapse and rejoin as a new life first; node 1
// then frees in place), or it applied all it claimed before the kill.
bool DrainerKilledAfterClaiming(uint64_t sim_seed) {
  constexpr uint64_t kObjects = 4;
  testing::TempRegionPath path("rf-drain");
  auto paths = CreatePool(path.path());
  const uint64_t total = FreeChunks(paths);
  Child drainer = Child::Fork([&](int, int out) {
    auto p = OpenOrNull(paths, 2, sim_seed ? sim_seed + 2 : 0);
    if (!p) return 1;
    p->impl().allocator->TestHookDrain(nullptr, [] { ::raise(SIGKILL); });  // claimed, none applied
    for (uint64_t i = 0; i < kObjects; ++i) {
      auto off = p->Alloc(4096);
      if (!off.ok() || !Put(out, *off)) return 2;
    }
    for (int i = 0; i < 3000; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return 3;  // no drain ever claimed the frees
  });
  Child next = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 2, sim_seed ? sim_seed + 3 : 0);
    if (!p) return 1;
    std::atomic<bool> released{false};
    // This process drains only once the first one is dead: the claim must be the dead one's.
    p->impl().allocator->TestHookDrain(
        [&] {
          while (!released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        },
        nullptr);
    uint64_t go;
    if (!Put(out, 1) || !Get(in, &go)) return 2;
    released.store(true);
    if (!Get(in, &go)) return 3;  // leave when told
    p->impl().allocator->TestHookDrain(nullptr, nullptr);
    return 0;
  });
  Child freer = testing::ForkFreer(paths, 1, sim_seed ? sim_seed + 1 : 0, kObjects);
  auto survivor = OpenOrNull(paths, 0, sim_seed);
  EXPECT_TRUE(survivor);
  // Whatever happens below, node 2's second process is let go and leaves: nothing stays blocked.
  auto release_next = [&] {
    (void)next.Send(1);
    (void)next.Send(2);
    return next.Wait();
  };
  std::vector<uint64_t> offs(kObjects);
  uint64_t ack = 0;
  bool set = survivor != nullptr;
  for (uint64_t& off : offs) set = set && drainer.Receive(&off);
  set = set && next.Receive(&ack);
  for (uint64_t off : offs) set = set && freer.Send(off);
  set = set && freer.Receive(&ack);
  EXPECT_TRUE(set) << "a child did not get through the set-up";
  EXPECT_EQ(freer.Wait(), 0);
  auto allocated = [&] {
    uint64_t n = 0;
    for (uint64_t off : offs) n += Allocated(paths, off) ? 1 : 0;
    return n;
  };
  if (!set || drainer.Wait() != 128 + SIGKILL || allocated() == 0) {
    release_next();
    return false;
  }
  EXPECT_TRUE(next.Send(1));  // node 2's next drain: it finds the claim
  const auto start = std::chrono::steady_clock::now();
  while (allocated() != 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) SleepLeases(0.25);
  EXPECT_EQ(allocated(), 0u) << "frees a killed drainer had claimed were never applied while its node lived";
  EXPECT_TRUE(next.Send(2));
  EXPECT_EQ(next.Wait(), 0);
  ExpectEverythingReturned(survivor, paths, total);
  return true;
}

// Up to three tries per seed for the scene; a machine too loaded to set it skips, never passes
// without checking.
void DrainerKilledAfterClaimingWithRetries(uint64_t sim_seed) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (DrainerKilledAfterClaiming(sim_seed)) return;
    if (::testing::Test::HasFailure()) return;
  }
  GTEST_SKIP() << "node 2's first process never held a claim to kill (its life lapsed under load each time)";
}

TEST(RemoteFree, ADrainerKilledAfterClaimingLeavesTheRestToTheNodesNextDrainer) { DrainerKilledAfterClaimingWithRetries(0); }

TEST(RemoteFree, ADrainerKilledAfterClaimingLeavesTheRestUnderTheNonCoherentSimulator) {
  for (uint64_t seed : {17u, 211u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    DrainerKilledAfterClaimingWithRetries(seed);
    if (::testing::Test::IsSkipped()) return;
  }
}

// Node 2's first life leaves; node 0's recovery of it is held right before it takes the
// allocator lock (its rings closed for that life by then). Meanwhile node 2 rejoins as its next
// life, allocates an object, and node 1 frees it through node 2's ring (node 2 surely beats
// again). Two scenes:
// - `hold_drains`: node 2's drains wait until the recovery has run. The recovery must stop at
//   the next life's entry, which node 2's own drain then applies. Consuming the whole ring
//   would leave the next life's object allocated for that life.
// - not: node 2's next life drains all along. While the recovery is held, its drainer must
//   leave the closed ring alone — the free waits in the ring — and apply it once the recovery
//   has marked the ring recovered. Without the drain word and the recovered mark the two
//   consume one ring unordered: a late head store by either can move the head back over
//   entries the other applied, and a later drain applies them again.
void NextLifeFreeDuringRecovery(uint64_t sim_seed, bool hold_drains) {
  testing::TempRegionPath path("rf-next-life");
  auto paths = CreatePool(path.path());
  const uint64_t total = FreeChunks(paths);
  Child first = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 2, sim_seed ? sim_seed + 2 : 0);
    uint64_t go;
    if (!p || !Put(out, 1) || !Get(in, &go)) return 1;
    return 0;  // leaves cleanly: the life ends at once
  });
  Child next = Child::Fork([&](int in, int out) {
    uint64_t go;
    if (!Get(in, &go)) return 1;  // joins once the first life has left
    auto p = OpenOrNull(paths, 2, sim_seed ? sim_seed + 3 : 0);
    if (!p) return 2;
    std::atomic<bool> drains{!hold_drains};
    if (hold_drains) {
      p->impl().allocator->TestHookDrain(
          [&] {
            while (!drains.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          },
          nullptr);
    }
    auto off = p->Alloc(4096);
    if (!off.ok() || !Put(out, *off) || !Get(in, &go)) return 3;
    drains.store(true);
    if (!Get(in, &go)) return 4;  // leave when told
    p->impl().allocator->TestHookDrain(nullptr, nullptr);
    return 0;
  });
  Child freer = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 1, sim_seed ? sim_seed + 1 : 0);
    uint64_t off, go;
    if (!p || !Put(out, 1) || !Get(in, &off)) return 1;
    Status s = p->Free(off);
    CHILD_CHECK(s.ok(), "free: %s", s.ToString().c_str());
    if (!Put(out, 1) || !Get(in, &go)) return 2;
    return 0;
  });
  auto survivor = OpenOrNull(paths, 0, sim_seed);  // manages the pool, recovers node 2's first life
  ASSERT_TRUE(survivor);
  std::atomic<bool> held{false}, recover{false};
  survivor->impl().allocator->TestHookBeforeRecoveryLock([&] {
    held.store(true);
    while (!recover.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  uint64_t ack;
  ASSERT_TRUE(first.Receive(&ack));
  ASSERT_TRUE(freer.Receive(&ack));
  SleepLeases(1);  // node 0 manages by now (the lowest live node)
  ASSERT_TRUE(first.Send(1));
  EXPECT_EQ(first.Wait(), 0);
  const auto start = std::chrono::steady_clock::now();
  while (!held.load() && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) SleepLeases(0.1);
  ASSERT_TRUE(held.load()) << "node 0 never began to recover node 2's first life";
  ASSERT_TRUE(next.Send(1));
  uint64_t off;
  ASSERT_TRUE(next.Receive(&off));
  ASSERT_TRUE(freer.Send(off));
  ASSERT_TRUE(freer.Receive(&ack));  // the free is in node 2's ring, for its next life
  if (hold_drains) {
    recover.store(true);
    SleepLeases(1);  // the recovery consumes node 2's rings
    ASSERT_TRUE(next.Send(1));  // node 2's drains go
  } else {
    SleepLeases(2);  // node 2's next life drains several times meanwhile
    EXPECT_TRUE(Allocated(paths, off)) << "node 2's next life drained a ring its last life's recovery had closed";
    recover.store(true);
    ASSERT_TRUE(next.Send(1));
  }
  const auto drained = std::chrono::steady_clock::now();
  while (Allocated(paths, off) && std::chrono::steady_clock::now() - drained < std::chrono::seconds(10)) SleepLeases(0.25);
  EXPECT_FALSE(Allocated(paths, off)) << "the free of node 2's next life's object was never applied after the "
                                         "recovery of its first life";
  ASSERT_TRUE(next.Send(1));
  EXPECT_EQ(next.Wait(), 0);
  ASSERT_TRUE(freer.Send(1));
  EXPECT_EQ(freer.Wait(), 0);
  survivor->impl().allocator->TestHookBeforeRecoveryLock(nullptr);
  ExpectEverythingReturned(survivor, paths, total);
}

TEST(RemoteFree, TheRecoveryOfAnEndedLifeLeavesTheNextLifesFreesInTheRing) { NextLifeFreeDuringRecovery(0, true); }

TEST(RemoteFree, TheRecoveryOfAnEndedLifeLeavesTheNextLifesFreesUnderTheNonCoherentSimulator) {
  for (uint64_t seed : {29u, 307u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    NextLifeFreeDuringRecovery(seed, true);
  }
}

TEST(RemoteFree, ARecoveryAndTheNextLifesDrainNeverConsumeOneRingAtOnce) { NextLifeFreeDuringRecovery(0, false); }

TEST(RemoteFree, ARecoveryAndTheNextLifesDrainTakeTurnsUnderTheNonCoherentSimulator) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({13, 101, 457, 823})) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    NextLifeFreeDuringRecovery(seed, false);
  }
}

// After its owner left, a published object sits in an orphan heap chunk (or stays a whole-
// chunk object of the ended life). Once nothing reaches it, ReclaimIfUnreachable frees it —
// and refuses everything else: a reachable object, a live node's object, a freed one.
TEST(Allocator, ReclaimIfUnreachableFreesOnlyWhatAnEndedLifeHoldsAndNothingReaches) {
  testing::TempRegionPath path("rf-reclaim");
  auto paths = CreatePool(path.path());
  const uint64_t total = FreeChunks(paths);
  Child owner = Child::Fork([&](int, int out) {
    auto p = OpenOrNull(paths, 2);
    if (!p) return 1;
    const char* names[] = {"x", "y", "z"};
    const uint64_t sizes[] = {4096, uint64_t{3} << 20, 4096};
    for (int i = 0; i < 3; ++i) {
      auto off = p->Alloc(sizes[i]);
      if (!off.ok() || !p->Put(names[i], *off, sizes[i]).ok() || !Put(out, *off)) return 2;
    }
    return 0;  // leaves: its life ends with three published objects
  });
  uint64_t x, y, z;
  ASSERT_TRUE(owner.Receive(&x) && owner.Receive(&y) && owner.Receive(&z));
  ASSERT_EQ(owner.Wait(), 0);
  auto p = OpenOrNull(paths, 0);
  ASSERT_TRUE(p);
  SleepLeases(2);  // node 0 recovered node 2: all three were reachable, all three kept
  auto& a = *p->impl().allocator;
  for (uint64_t off : {x, y, z}) ASSERT_TRUE(Allocated(paths, off));

  auto reclaim = [&](uint64_t off) {
    auto r = a.ReclaimIfUnreachable(alloc::ObjectOffset(off));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() && *r;
  };
  EXPECT_FALSE(reclaim(x)) << "a root still names it";
  EXPECT_TRUE(Allocated(paths, x));
  ASSERT_TRUE(p->Destroy("x").ok());
  EXPECT_TRUE(reclaim(x));
  EXPECT_FALSE(Allocated(paths, x));
  EXPECT_FALSE(reclaim(x)) << "freed already";
  ASSERT_TRUE(p->Destroy("y").ok());
  EXPECT_TRUE(reclaim(y)) << "a whole-chunk object of an ended life";
  EXPECT_FALSE(Allocated(paths, y));
  // A live life's object is never touched, reachable or not: its owner may be writing it.
  auto mine = p->Alloc(4096);
  ASSERT_TRUE(mine.ok());
  EXPECT_FALSE(reclaim(*mine));
  EXPECT_TRUE(Allocated(paths, *mine));
  ASSERT_TRUE(p->Free(*mine).ok());
  // The last object of the orphan chunk: the chunk goes back to the pool with it.
  ASSERT_TRUE(p->Destroy("z").ok());
  EXPECT_TRUE(reclaim(z));
  a.Trim();
  p.reset();
  EXPECT_EQ(FreeChunks(paths), total) << "chunks leaked";
  ExpectNoProblems(paths);
}

}  // namespace
}  // namespace cxlkv
