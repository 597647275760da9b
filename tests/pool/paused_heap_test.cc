// A heap operation or a remote-free drain of a process paused (SIGSTOP) past its lease: its
// node's life is recovered meanwhile and its chunks may be handed to another node, so the stores
// it was about to make must be refused when it resumes (SIGCONT), not land in what is someone
// else's by then. Real processes on one region, also under the non-coherent simulator.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

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

constexpr uint64_t kPausedHeapRegionBytes = 48 << 20;

// Node 1 (one process) allocates one object, then starts a second allocation and stops between
// choosing its slot and taking it. Node 0 recovers node 1's life (nothing published: the chunk is
// freed) and allocates objects of the same class, likely from that very chunk. Node 1 resumes:
// its allocation is refused (kLeaseExpired); it rejoins as a new life and allocates properly.
// Every object of node 0 stays allocated and `check` is clean.
// `bytes`/`exact`: the object, a rounded heap slot or an exact-size slot of a slab of several
// chunks (Fit::kExact, a KV block's).
Result<uint64_t> AllocObject(Pool& p, uint64_t bytes, bool exact) {
  if (!exact) return p.Alloc(bytes);
  auto off = p.impl().allocator->Alloc(bytes, alloc::Fit::kExact);
  if (!off.ok()) return off.status();
  return off->raw();
}

// `in_free`: the second operation is a free of an object taken before, paused between finding
// its bit and clearing it; when it resumes the free is refused and clears nothing.
void PausedHeapAllocation(uint64_t seed, uint64_t bytes = 4096, bool exact = false, bool in_free = false) {
  testing::TempRegionPath path("paused-heap");
  PoolCreateOptions co;
  co.size = kPausedHeapRegionBytes;
  co.max_nodes = 4;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  const std::vector<std::string> paths = {path.path()};
  Child victim = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 1, seed ? seed + 1 : 0);
    if (!p) return 1;
    auto first = AllocObject(*p, bytes, exact);
    if (!first.ok()) return 2;
    auto to_free = in_free ? AllocObject(*p, bytes, exact) : Result<uint64_t>(uint64_t{0});
    if (!to_free.ok()) return 3;
    bool stopped = false;
    auto pause = [&] {
      if (stopped) return;
      stopped = true;
      uint64_t go;
      if (Put(out, *first)) (void)Get(in, &go);  // the parent stops this process, then resumes it
    };
    if (in_free) {
      p->impl().allocator->TestHookBeforeHeapFree(pause);
      Status freed = p->Free(*to_free);
      CHILD_CHECK(stopped, "the free never reached its stores");
      CHILD_CHECK(!freed.ok(), "a free paused past the lease cleared slot 0x%llx of a recovered slab",
                  static_cast<unsigned long long>(*to_free));
      CHILD_CHECK(freed.code() == StatusCode::kLeaseExpired, "%s", freed.ToString().c_str());
    } else {
      p->impl().allocator->TestHookBeforeHeapStore(pause);
      auto second = AllocObject(*p, bytes, exact);
      CHILD_CHECK(stopped, "the allocation never reached its stores");
      CHILD_CHECK(!second.ok(), "an allocation paused past the lease took slot 0x%llx of a recovered chunk",
                  static_cast<unsigned long long>(second.ok() ? *second : 0));
      CHILD_CHECK(second.status().code() == StatusCode::kLeaseExpired, "%s", second.status().ToString().c_str());
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (p->impl().node->new_lives() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHILD_CHECK(p->impl().node->new_lives() >= 2, "no new life after the pause");
    auto third = AllocObject(*p, bytes, exact);
    CHILD_CHECK(third.ok(), "allocation in the new life: %s", third.status().ToString().c_str());
    CHILD_CHECK(p->Free(*third).ok(), "free in the new life");
    return 0;
  });
  auto survivor = OpenOrNull(paths, 0, seed);  // manages the pool, recovers node 1
  ASSERT_TRUE(survivor);
  uint64_t first = 0;
  ASSERT_TRUE(victim.Receive(&first)) << "node 1 never reached its allocation's stores";
  ::kill(victim.pid, SIGSTOP);
  SleepLeases(4);  // node 1 is silent past its lease: node 0 recovers its life
  std::vector<uint64_t> mine;
  for (int i = 0; i < 16; ++i) {
    auto off = AllocObject(*survivor, bytes, exact);
    ASSERT_TRUE(off.ok()) << off.status().ToString();
    mine.push_back(*off);
  }
  ::kill(victim.pid, SIGCONT);
  ASSERT_TRUE(victim.Send(1));
  EXPECT_EQ(victim.Wait(), 0) << "seed " << seed;
  for (uint64_t off : mine) EXPECT_TRUE(Allocated(paths, off)) << "node 0's object 0x" << std::hex << off << " was lost";
  // Node 1's first object was not published: recovery freed it, unless node 0 has since taken
  // the same slot of the same chunk (the hazard this test builds).
  if (std::find(mine.begin(), mine.end(), first) == mine.end()) {
    EXPECT_FALSE(Allocated(paths, first)) << "node 1's first life still holds its unpublished object";
  }
  for (uint64_t off : mine) ASSERT_TRUE(survivor->Free(off).ok());
  survivor->impl().allocator->Trim();
  survivor.reset();
  ExpectNoProblems(paths);
}

TEST(PausedHeap, AnAllocationPausedPastTheLeaseIsRefusedAndTakesNoSlotOfARecoveredChunk) { PausedHeapAllocation(0); }

TEST(PausedHeap, AnAllocationPausedPastTheLeaseIsRefusedUnderTheNonCoherentSimulator) {
  for (uint64_t seed : {7u, 131u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    PausedHeapAllocation(seed);
  }
}

// The same with a 0.875 MiB block's exact-size slot, in slabs of four chunks.
TEST(PausedHeap, AnExactSizeAllocationPausedPastTheLeaseIsRefusedAndTakesNoSlotOfARecoveredSlab) {
  PausedHeapAllocation(0, 917'504, /*exact=*/true);
}

TEST(PausedHeap, AnExactSizeAllocationPausedPastTheLeaseIsRefusedUnderTheNonCoherentSimulator) {
  PausedHeapAllocation(29, 917'504, /*exact=*/true);
}

// A free of an exact-size slot paused past the lease: the recovery frees the slab, node 0 takes
// its chunks, and the resumed free clears nothing in them.
TEST(PausedHeap, AnExactSizeFreePausedPastTheLeaseIsRefusedAndClearsNothingOfARecoveredSlab) {
  PausedHeapAllocation(0, 917'504, /*exact=*/true, /*in_free=*/true);
}

TEST(PausedHeap, AnExactSizeFreePausedPastTheLeaseIsRefusedUnderTheNonCoherentSimulator) {
  PausedHeapAllocation(41, 917'504, /*exact=*/true, /*in_free=*/true);
}

// Node 1 frees node 2's objects through node 2's ring. Node 2 (one process) starts draining them:
// it announces the drain, reads the ring's head and tail, and is stopped (SIGSTOP) before its
// fence. Past its lease node 0 recovers node 2's life — the announcement is that very life's, so
// the recovery does not wait for it — consumes the ring, and allocates objects of the same class,
// likely in the very slots. Node 2 resumes (SIGCONT) holding the ring's old head and tail: its
// claim must free nothing (applied, it would free node 0's objects a second time), and the node
// rejoins as a new life. Every object of node 0 stays allocated, everything comes back, and
// `check` is clean. Three checks each refuse the stale claim: the drain's fence, the owner word's
// life in ApplyRemoteFree, the heap free's own fence; with all three removed this test fails.
void PausedAnnouncedDrain(uint64_t seed) {
  constexpr uint64_t kObjects = 8;
  testing::TempRegionPath path("paused-drain");
  PoolCreateOptions co;
  co.size = kPausedHeapRegionBytes;
  co.max_nodes = 4;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  const std::vector<std::string> paths = {path.path()};
  const uint64_t total = FreeChunks(paths);
  Child drainer = Child::Fork([&](int in, int out) {
    auto p = OpenOrNull(paths, 2, seed ? seed + 2 : 0);
    if (!p) return 1;
    std::atomic<bool> released{false}, resumed{false};
    std::atomic<int> announced{0};
    p->impl().allocator->TestHookDrain(
        [&] {  // drains wait until node 1's frees are all in the ring
          while (!released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        },
        nullptr,
        [&] {
          if (announced.fetch_add(1) != 0) return;
          uint64_t go;
          if (Put(out, 2)) (void)Get(in, &go);  // the parent stops this process, then resumes it
          resumed.store(true);
        });
    for (uint64_t i = 0; i < kObjects; ++i) {
      auto off = p->Alloc(4096);
      if (!off.ok() || !Put(out, *off)) return 2;
    }
    uint64_t go;
    if (!Get(in, &go)) return 3;
    released.store(true);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!resumed.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHILD_CHECK(resumed.load(), "the drain never resumed");
    deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (p->impl().node->new_lives() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHILD_CHECK(p->impl().node->new_lives() >= 2, "no new life after the pause");
    p->impl().allocator->TestHookDrain(nullptr, nullptr, nullptr);
    return 0;
  });
  Child freer = testing::ForkFreer(paths, 1, seed ? seed + 1 : 0, kObjects);
  auto survivor = OpenOrNull(paths, 0, seed);  // manages the pool, recovers node 2
  ASSERT_TRUE(survivor);
  std::vector<uint64_t> offs(kObjects);
  for (uint64_t& off : offs) ASSERT_TRUE(drainer.Receive(&off));
  for (uint64_t off : offs) ASSERT_TRUE(freer.Send(off));
  uint64_t ack = 0;
  ASSERT_TRUE(freer.Receive(&ack));
  EXPECT_EQ(freer.Wait(), 0);
  ASSERT_TRUE(drainer.Send(1));  // node 2 may drain now
  ASSERT_TRUE(drainer.Receive(&ack)) << "node 2 never started draining the frees";
  ::kill(drainer.pid, SIGSTOP);
  auto allocated = [&] {
    uint64_t n = 0;
    for (uint64_t off : offs) n += Allocated(paths, off) ? 1 : 0;
    return n;
  };
  // Node 2 is silent past its lease: node 0 recovers its life, frees and heap alike.
  const auto start = std::chrono::steady_clock::now();
  while (allocated() != 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) SleepLeases(0.25);
  EXPECT_EQ(allocated(), 0u) << "node 2's life was not recovered while it was stopped";
  std::vector<uint64_t> mine;
  for (int i = 0; i < 16; ++i) {
    auto off = survivor->Alloc(4096);
    ASSERT_TRUE(off.ok()) << off.status().ToString();
    mine.push_back(*off);
  }
  ::kill(drainer.pid, SIGCONT);
  ASSERT_TRUE(drainer.Send(1));
  EXPECT_EQ(drainer.Wait(), 0) << "seed " << seed;
  for (uint64_t off : mine) {
    EXPECT_TRUE(Allocated(paths, off)) << "node 0's object 0x" << std::hex << off << " was freed by a stale drain";
  }
  for (uint64_t off : mine) ASSERT_TRUE(survivor->Free(off).ok());
  ExpectEverythingReturned(survivor, paths, total);
}

TEST(PausedDrain, ADrainPausedPastTheLeaseBeforeItsFenceFreesNothingOnResuming) { PausedAnnouncedDrain(0); }

TEST(PausedDrain, ADrainPausedPastTheLeaseFreesNothingUnderTheNonCoherentSimulator) {
  for (uint64_t seed : {19u, 173u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    PausedAnnouncedDrain(seed);
  }
}

}  // namespace
}  // namespace cxlkv
