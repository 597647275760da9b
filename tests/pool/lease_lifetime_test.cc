// Chunk leases end with the lives that took them: a thousand short-lived processes of four
// nodes — each leases, publishes a block, frees its predecessor's, and leaves (some killed with
// SIGKILL instead) — and at the end no chunk is leased to a node that has no live process, the
// only chunks allocated are the blocks still published, and `check` is clean. No process of
// the test recovers other nodes (as with CLI commands beside a daemon that hosts the lock
// manager but was told not to recover): what a life leaves must be given back by the life
// itself, or taken over by the node's next life.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <string>
#include <vector>

#include "alloc_test_util.h"
#include "region/coherence.h"

namespace cxlkv {
namespace {

constexpr uint64_t kLivesRegionBytes = 128 << 20;
constexpr uint32_t kLivesNodes = 4;      // nodes 1..4 come and go; node 0 hosts the lock manager
constexpr uint32_t kLivesLanes = 8;  // two lanes per node: a node's processes overlap, or not
constexpr uint32_t kLivesLeaseMs = 2000;
constexpr uint32_t kKillEvery = 25;       // every 25th process of a lane is killed, not closed

// How many lanes fork how many processes each; sim_seed != 0: every process behind its own
// simulated non-coherent cache (seeded by the seed, the lane and the process).
struct LivesPlan {
  uint32_t lanes;
  uint32_t processes_per_lane;
  uint64_t sim_seed = 0;
  uint32_t kill_every = kKillEvery;
};

// Staggered over the lanes, so that kills of a node's two lanes rarely coincide. A lane's last
// process always leaves: a killed one's lease waits, rightly, for the node's next life or a
// recoverer, and this test has neither after it.
bool Killed(const LivesPlan& plan, uint32_t lane, uint32_t j) {
  return j + 1 < plan.processes_per_lane && (j + lane * 3) % plan.kill_every == plan.kill_every - 1;
}

std::string RootName(uint32_t lane, uint32_t j) { return "lane" + std::to_string(lane) + "-" + std::to_string(j); }

// The first and last words of block (lane, j): what the next process of the lane checks.
uint64_t Pattern(uint32_t lane, uint32_t j) { return (uint64_t{lane + 1} << 32) | (j + 1); }

std::unique_ptr<Pool> OpenAsClient(const std::vector<std::string>& paths, uint32_t node, uint64_t sim_seed = 0,
                                   uint32_t lease_ms = kLivesLeaseMs) {
  PoolOpenOptions o;
  o.node_id = node;
  o.attach.sim_seed = sim_seed;
  o.may_host_manager = node == 0;  // a manager killed with its client would stall every lock for a lease
  // Eight processes start and stop at once on two cores: a beat thread starved past a short
  // lease would end its node's life under the test's feet. A killed process's successor waits
  // out this lease only when no other process of its node runs.
  o.lease_ms = lease_ms;
  o.recovers = false;  // a short-lived client, like a CLI command: it recovers nobody
  auto p = Pool::Open(paths, o);
  if (!p.ok()) {
    std::fprintf(stderr, "open as node %u: %s\n", node, p.status().ToString().c_str());
    return nullptr;
  }
  return std::move(p).value();
}

// Process j of `lane`: a one-chunk block from the node's lease (a second one allocated and
// freed again), published as (lane, j); the lane's previous block read back and freed.
int OneLife(const std::vector<std::string>& paths, const LivesPlan& plan, uint32_t lane, uint32_t j) {
  auto p = OpenAsClient(paths, 1 + lane % kLivesNodes, plan.sim_seed ? plan.sim_seed * 10007 + lane * 1009 + j : 0);
  CHILD_CHECK(p != nullptr, "open");
  const uint64_t chunk = p->impl().allocator->chunk_bytes();
  auto block = p->Alloc(chunk);
  CHILD_CHECK(block.ok(), "lane %u process %u: alloc: %s", lane, j, block.status().ToString().c_str());
  auto scratch = p->Alloc(chunk);
  CHILD_CHECK(scratch.ok(), "lane %u process %u: alloc: %s", lane, j, scratch.status().ToString().c_str());
  const uint64_t pattern = Pattern(lane, j);
  uint8_t* dst = p->Ptr(*block, chunk);
  CHILD_CHECK(dst != nullptr, "ptr");
  std::memcpy(dst, &pattern, 8);
  std::memcpy(dst + chunk - 8, &pattern, 8);
  region::FlushLines(dst, 8);
  region::FlushLines(dst + chunk - 8, 8);
  CHILD_CHECK(p->Free(*scratch).ok(), "free of the scratch block");
  Status put = p->Put(RootName(lane, j), *block, chunk);
  CHILD_CHECK(put.ok(), "put: %s", put.ToString().c_str());
  if (j > 0) {
    auto prev = p->Get(RootName(lane, j - 1));
    CHILD_CHECK(prev.ok(), "lane %u process %u: the previous block is gone: %s", lane, j,
                prev.status().ToString().c_str());
    const uint8_t* src = p->Ptr(prev->offset, chunk);
    CHILD_CHECK(src != nullptr, "ptr of the previous block");
    region::InvalidateLines(src, 8);
    region::InvalidateLines(src + chunk - 8, 8);
    uint64_t first, last;
    std::memcpy(&first, src, 8);
    std::memcpy(&last, src + chunk - 8, 8);
    CHILD_CHECK(first == Pattern(lane, j - 1) && last == first, "lane %u process %u: the previous block reads wrong",
                lane, j);
    CHILD_CHECK(p->Destroy(RootName(lane, j - 1)).ok(), "destroy");
    Status freed = p->Free(prev->offset);  // held by an ended life of this node, or by this one
    CHILD_CHECK(freed.ok(), "lane %u process %u: free of the previous block: %s", lane, j, freed.ToString().c_str());
  }
  if (Killed(plan, lane, j)) ::raise(SIGKILL);  // leaves its lease behind
  return 0;
}

int RunLane(const std::vector<std::string>& paths, const LivesPlan& plan, uint32_t lane) {
  for (uint32_t j = 0; j < plan.processes_per_lane; ++j) {
    std::fflush(stderr);
    const pid_t child = ::fork();
    if (child == 0) ::_exit(OneLife(paths, plan, lane, j));
    int status = 0;
    if (::waitpid(child, &status, 0) != child) return 100;
    const bool killed = Killed(plan, lane, j);
    const bool as_planned = killed ? WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL
                                   : WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!as_planned) {
      std::fprintf(stderr, "lane %u: process %u ended with status %d\n", lane, j, status);
      return 101;
    }
  }
  return 0;
}

void RunLives(const LivesPlan& plan) {
  testing::TempRegionPath path("lease-lives");
  const std::vector<std::string> paths{path.path()};
  PoolCreateOptions co;
  co.size = kLivesRegionBytes;
  co.max_nodes = kLivesNodes + 1;
  ASSERT_TRUE(Pool::Create(paths, co).ok());
  const uint64_t total = testing::FreeChunks(paths);
  // The lanes fork their processes themselves; this process opens nothing until they are done
  // (and so has no threads when it forks: ThreadSanitizer refuses a fork after them). Node 0,
  // in a process of its own, hosts the lock manager throughout and allocates nothing.
  testing::Child manager = testing::Child::Fork([&paths](int in, int out) -> int {
    auto p = OpenAsClient(paths, 0);
    CHILD_CHECK(p != nullptr, "open as node 0");
    uint64_t done;
    CHILD_CHECK(testing::Put(out, 1) && testing::Get(in, &done), "pipe");
    return 0;
  });
  uint64_t ready;
  ASSERT_TRUE(manager.Receive(&ready));
  std::vector<pid_t> lanes;
  for (uint32_t lane = 0; lane < plan.lanes; ++lane) {
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(RunLane(paths, plan, lane));
    lanes.push_back(pid);
  }
  for (pid_t pid : lanes) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a lane failed: status " << status;
  }
  ASSERT_TRUE(manager.Send(1));
  EXPECT_EQ(manager.Wait(), 0);
  // No process of any node is left: nothing may be leased, and only the lanes' last blocks
  // (one chunk each) are allocated.
  auto regions = pool::AttachAll(paths);
  ASSERT_TRUE(regions.ok());
  const alloc::RegionUsage u = alloc::InspectChunks(*(*regions)[0], kLivesNodes + 1);
  EXPECT_EQ(u.leased, 0u) << "chunks still leased to nodes that have no process";
  EXPECT_EQ(total - u.free, uint64_t{plan.lanes}) << "chunks held beyond the published blocks";
  for (const auto& p : testing::CheckProblems(paths)) ADD_FAILURE() << p;
  regions->clear();
  auto p = OpenAsClient(paths, 0);
  ASSERT_TRUE(p);
  const uint64_t chunk = p->impl().allocator->chunk_bytes();
  for (uint32_t lane = 0; lane < plan.lanes; ++lane) {
    const uint32_t last_j = plan.processes_per_lane - 1;
    auto last = p->Get(RootName(lane, last_j));
    ASSERT_TRUE(last.ok()) << last.status().ToString();
    const uint8_t* src = p->Ptr(last->offset, chunk);
    ASSERT_NE(src, nullptr);
    uint64_t first;
    std::memcpy(&first, src, 8);
    EXPECT_EQ(first, Pattern(lane, last_j));
    ASSERT_TRUE(p->Destroy(RootName(lane, last_j)).ok());
    ASSERT_TRUE(p->Free(last->offset).ok());
  }
  p.reset();
  EXPECT_EQ(testing::FreeChunks(paths), total) << "chunks leaked";
  for (const auto& problem : testing::CheckProblems(paths)) ADD_FAILURE() << problem;
}

#if defined(CXLKV_ASAN) || defined(CXLKV_TSAN)
constexpr uint32_t kProcessesPerLane = 25;  // 200 in all: sanitized joins take far longer
#else
constexpr uint32_t kProcessesPerLane = 125;  // 1,000 in all
#endif

TEST(ChunkLease, ShortLivedProcessesLeaveNoLeaseBehind) { RunLives({kLivesLanes, kProcessesPerLane}); }

// Two lanes (nodes 1 and 2), every fourth process killed, each process behind its own simulated
// non-coherent cache, whose unflushed stores die with a killed process: the next life adopts or
// ends what a killed one leased only from what reached memory, and `check` must stay clean.
TEST(ChunkLease, ShortLivedProcessesUnderTheNonCoherentSimulator) {
  for (uint64_t seed : {11u, 23u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    RunLives({.lanes = 2, .processes_per_lane = 8, .sim_seed = seed, .kill_every = 4});
  }
}

// Node 1's only process leases a line, publishes one block from it and is stopped (SIGSTOP)
// past its lease. A new process of node 1 runs a new life: its first refill ends the paused
// life's lease (the block stays, the 7 free chunks go back) and it takes every free chunk of the
// pool, each written with its own offset. The paused process resumes (SIGCONT) inside the new
// life: its next allocation finds no chunk (its old lease words are gone) and stores nothing;
// every block of the new life still reads back its own bytes, the published block stays, and
// `check` is clean with everything returned.
void PausedLessee(uint64_t sim_seed) {
  testing::TempRegionPath path("lease-paused");
  const std::vector<std::string> paths{path.path()};
  PoolCreateOptions co;
  co.size = 48 << 20;
  co.max_nodes = 2;
  ASSERT_TRUE(Pool::Create(paths, co).ok());
  const uint64_t total = testing::FreeChunks(paths);
  const uint32_t lease = testing::kTestLeaseMs;
  std::fflush(stderr);
  testing::Child manager = testing::Child::Fork([&](int in, int out) -> int {
    auto p = OpenAsClient(paths, 0, 0, lease);
    CHILD_CHECK(p != nullptr, "open as node 0");
    uint64_t done;
    CHILD_CHECK(testing::Put(out, 1) && testing::Get(in, &done), "pipe");
    return 0;
  });
  uint64_t ready;
  ASSERT_TRUE(manager.Receive(&ready));
  testing::Child victim = testing::Child::Fork([&](int in, int out) -> int {
    auto p = OpenAsClient(paths, 1, sim_seed ? sim_seed * 10 + 1 : 0, lease);
    CHILD_CHECK(p != nullptr, "open as node 1");
    const uint64_t chunk = p->impl().allocator->chunk_bytes();
    auto kept = p->Alloc(chunk);
    CHILD_CHECK(kept.ok(), "alloc: %s", kept.status().ToString().c_str());
    uint8_t* dst = p->Ptr(*kept, chunk);
    std::memcpy(dst, &*kept, 8);
    region::FlushLines(dst, 8);
    CHILD_CHECK(p->Put("kept", *kept, chunk).ok(), "put");
    uint64_t go;
    CHILD_CHECK(testing::Put(out, 1) && testing::Get(in, &go), "pipe");
    // Resumed, inside the node's new life, with the new life holding every free chunk.
    auto late = p->Alloc(chunk);
    CHILD_CHECK(!late.ok() && (late.status().code() == StatusCode::kNoSpace ||
                               late.status().code() == StatusCode::kLeaseExpired),
                "a paused lessee allocated on resuming: %s",
                late.ok() ? "a chunk of a full pool" : late.status().ToString().c_str());
    CHILD_CHECK(testing::Put(out, 2) && testing::Get(in, &go), "pipe");
    return 0;
  });
  ASSERT_TRUE(victim.Receive(&ready));
  ::kill(victim.pid, SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * lease));
  testing::Child successor = testing::Child::Fork([&](int in, int out) -> int {
    auto p = OpenAsClient(paths, 1, sim_seed ? sim_seed * 10 + 2 : 0, lease);
    CHILD_CHECK(p != nullptr, "open as node 1 again");
    const uint64_t chunk = p->impl().allocator->chunk_bytes();
    std::vector<uint64_t> mine;
    for (;;) {
      auto off = p->Alloc(chunk);
      if (!off.ok()) {
        CHILD_CHECK(off.status().code() == StatusCode::kNoSpace, "%s", off.status().ToString().c_str());
        break;
      }
      uint8_t* dst = p->Ptr(*off, chunk);
      std::memcpy(dst, &*off, 8);
      std::memcpy(dst + chunk - 8, &*off, 8);
      region::FlushLines(dst, 8);
      region::FlushLines(dst + chunk - 8, 8);
      mine.push_back(*off);
    }
    uint64_t go;
    CHILD_CHECK(testing::Put(out, mine.size()) && testing::Get(in, &go), "pipe");
    for (uint64_t off : mine) {
      const uint8_t* src = p->Ptr(off, chunk);
      region::InvalidateLines(src, 8);
      region::InvalidateLines(src + chunk - 8, 8);
      uint64_t first, last;
      std::memcpy(&first, src, 8);
      std::memcpy(&last, src + chunk - 8, 8);
      CHILD_CHECK(first == off && last == off, "a block of the new life was overwritten");
      CHILD_CHECK(p->Free(off).ok(), "free");
    }
    return 0;
  });
  uint64_t taken = 0;
  ASSERT_TRUE(successor.Receive(&taken));
  EXPECT_EQ(taken, total - 1) << "the new life should hold every chunk but the published block";
  ::kill(victim.pid, SIGCONT);
  ASSERT_TRUE(victim.Send(1));
  uint64_t tried;
  EXPECT_TRUE(victim.Receive(&tried));
  ASSERT_TRUE(successor.Send(1));
  EXPECT_EQ(successor.Wait(), 0);
  ASSERT_TRUE(victim.Send(1));
  EXPECT_EQ(victim.Wait(), 0);
  ASSERT_TRUE(manager.Send(1));
  EXPECT_EQ(manager.Wait(), 0);
  auto regions = pool::AttachAll(paths);
  ASSERT_TRUE(regions.ok());
  EXPECT_EQ(alloc::InspectChunks(*(*regions)[0], 2).leased, 0u);
  EXPECT_EQ(testing::FreeChunks(paths), total - 1) << "only the published block stays";
  for (const auto& problem : testing::CheckProblems(paths)) ADD_FAILURE() << problem;
  regions->clear();
  auto p = OpenAsClient(paths, 0);
  ASSERT_TRUE(p);
  auto kept = p->Get("kept");
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  uint64_t first;
  std::memcpy(&first, p->Ptr(kept->offset, 8), 8);
  EXPECT_EQ(first, kept->offset);
  ASSERT_TRUE(p->Destroy("kept").ok());
  ASSERT_TRUE(p->Free(kept->offset).ok());
  p.reset();
  EXPECT_EQ(testing::FreeChunks(paths), total);
}

TEST(ChunkLease, ALesseePausedPastItsLeaseLeavesItsLeaseToTheNextLife) { PausedLessee(0); }

TEST(ChunkLease, ALesseePausedPastItsLeaseUnderTheNonCoherentSimulator) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({5, 17, 29})) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    PausedLessee(seed);
  }
}

}  // namespace
}  // namespace cxlkv
