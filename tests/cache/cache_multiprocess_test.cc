// The prefix cache across real processes on one region: the TraCT prefill→decode handoff, a
// storm of overlapping chains with evictions (also under the non-coherent simulator), and
// kill -9 at every step of an insert and of an eviction.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>
#include <set>

#include <gtest/gtest.h>

#include "cache_test_util.h"
#include "child.h"

namespace cxlkv {
namespace {

using testing::FillForKey;
using testing::MatchesKey;
using testing::OpenOrNull;

using testing::OpenCache;
using testing::Opened;

std::vector<std::string> Problems(const std::string& path) {
  auto regions = pool::AttachAll({path});
  EXPECT_TRUE(regions.ok());
  return pool::Check(*regions, 3 * testing::kTestLeaseMs);
}

TEST(CacheProcesses, PrefillToDecodeHandoffOf64Blocks) {
  testing::TempRegionPath path("handoff");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 256 << 20).ok());
  const auto tokens = testing::Tokens(42, 16 * 64, 0, 0);
  constexpr uint64_t kBlock = 1 << 20;
  // Process A (node 0): reserve, write with random bytes, commit — the prefill side.
  auto a = testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 0);
    CHILD_CHECK(o.cache, "open");
    auto keys = o.cache->ChainKeys(o.ns, tokens);
    CHILD_CHECK(keys.size() == 64, "keys %zu", keys.size());
    std::vector<uint8_t> buf(kBlock);
    for (const auto& k : keys) {
      auto r = o.cache->Reserve(o.ns, k, kBlock);
      CHILD_CHECK(r.ok(), "%s", r.status().ToString().c_str());
      FillForKey(k, buf.data(), kBlock);
      CHILD_CHECK(o.cache->Write(*r, 0, buf.data(), kBlock).ok(), "write");
      CHILD_CHECK(o.cache->Commit(*r).ok(), "commit");
    }
    return 0;
  });
  ASSERT_EQ(a[0], 0);
  // Process B (node 1): the decode side, a different process and node.
  auto b = testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 1);
    CHILD_CHECK(o.cache, "open");
    auto keys = o.cache->ChainKeys(o.ns, tokens);
    auto hit = o.cache->Lookup(o.ns, keys);
    CHILD_CHECK(hit.ok() && hit->hit_blocks == 64, "hit %zu", hit.ok() ? hit->hit_blocks : 0);
    std::vector<uint8_t> out(kBlock);
    for (size_t i = 0; i < 64; ++i) {
      CHILD_CHECK(o.cache->Read(hit->pins[i], 0, out.data(), kBlock).ok(), "read");
      CHILD_CHECK(MatchesKey(keys[i], out.data(), kBlock), "block %zu differs", i);
    }
    o.cache->Release(hit->pins);
    return 0;
  });
  ASSERT_EQ(b[0], 0);
  auto problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << p;
}

// One storm worker: requests over a few recurring documents (shared prefixes) with unique
// tails; look up, verify every hit byte, insert the rest, sometimes evict. Block sizes are
// powers of two from the key, so allocated bytes equal entry bytes exactly.
struct StormOptions {
  int ops = 300;
  uint64_t sim_seed = 0;
  int crash_after = -1;  // op index from which to die (see crash_mode); a crasher
                         // runs up to 4 x ops until its step comes up
  int crash_mode = 0;    // 1: in reserve holding the lock, 2: mid-write, 3: after commit,
                         // 4: mid-eviction
  bool batch = false;    // insert a request's missing blocks with ReserveMany / CommitMany
  // Where no worker dies, nothing waits out a lease: the quiet one keeps a beat thread starved
  // on a loaded two-core sanitizer run from ending a live worker's life midway (its requests
  // are then refused, and the storm fails for a reason it does not test).
  uint32_t lease_ms = testing::kQuietLeaseMs;
};

uint64_t BlockBytesFor(const BlockKey& k) { return uint64_t{4096} << (k.lo % 5); }  // 4..64 KiB

int StormWorker(const std::string& path, uint32_t node, const StormOptions& so) {
  auto o = OpenCache(path, node, so.sim_seed, so.lease_ms);
  CHILD_CHECK(o.cache, "open node %u", node);
  std::mt19937_64 rng(node * 1000 + so.sim_seed);
  std::vector<uint8_t> buf(64 << 10);
  cache::Index& index = *o.pool->impl().index;
  // What an armed crasher met, printed if it never reached its step (timing decides how often
  // the step comes up: a stripe held by a dead worker refuses, a full hit inserts nothing).
  int armed_commits = 0, armed_refusals[3] = {0, 0, 0}, armed_full_hits = 0;
  // A crasher goes on past `ops` until its step comes up, within a bound.
  const int last_op = so.crash_mode != 0 ? so.ops * 4 : so.ops;
  for (int op = 0; op < last_op; ++op) {
    // Armed from crash_after on, until the step it targets comes up.
    const bool crash_now = so.crash_mode != 0 && op >= so.crash_after;
    uint64_t doc = rng() % 6;
    auto tokens = testing::Tokens(doc, 16 * (2 + rng() % 10), rng() % 4, 16 * (rng() % 4));
    auto keys = o.cache->ChainKeys(o.ns, tokens);
    auto hit = o.cache->Lookup(o.ns, keys);
    CHILD_CHECK(hit.ok(), "%s", hit.status().ToString().c_str());
    for (size_t i = 0; i < hit->hit_blocks; ++i) {
      const BlockPin& p = hit->pins[i];
      CHILD_CHECK(p.bytes == BlockBytesFor(keys[i]), "size");
      CHILD_CHECK(o.cache->Read(p, 0, buf.data(), p.bytes).ok(), "read");
      CHILD_CHECK(MatchesKey(keys[i], buf.data(), p.bytes), "node %u op %d: block %zu read wrong bytes", node, op, i);
    }
    if (so.batch && hit->hit_blocks < keys.size()) {
      // The request's missing blocks in batches of one size (sizes vary by key): reserve,
      // write, commit together. A kill -9 can land holding a stripe lock or mid-write.
      std::vector<BlockKey> rest(keys.begin() + static_cast<std::ptrdiff_t>(hit->hit_blocks), keys.end());
      for (uint64_t bytes = 4096; bytes <= (64 << 10); bytes *= 2) {
        std::vector<BlockKey> group;
        for (const auto& k : rest) {
          if (BlockBytesFor(k) == bytes) group.push_back(k);
        }
        if (group.empty()) continue;
        if (rng() % 4 == 0) group.push_back(group[0]);  // a repeat within the batch
        if (crash_now && so.crash_mode == 1) index.TestCrashAt(cache::Index::CrashPoint::kReserveHoldingLock);
        auto many = o.cache->ReserveMany(o.ns, group, bytes);
        CHILD_CHECK(many.ok(), "%s", many.status().ToString().c_str());
        std::vector<Reservation> rs;
        std::vector<BlockKey> rk;
        for (size_t g = 0; g < group.size(); ++g) {
          const auto& out = (*many)[g];
          if (out.outcome == ReserveOutcome::kReserved) {
            rs.push_back(out.reservation);
            rk.push_back(group[g]);
            continue;
          }
          auto c = out.status.code();
          CHILD_CHECK(c == StatusCode::kAlreadyExists || c == StatusCode::kBusy || c == StatusCode::kNoSpace,
                      "%s", out.status.ToString().c_str());
        }
        for (size_t g = 0; g < rs.size(); ++g) {
          FillForKey(rk[g], buf.data(), bytes);
          if (crash_now && so.crash_mode == 2) {
            CHILD_CHECK(o.cache->Write(rs[g], 0, buf.data(), bytes / 2).ok(), "write");
            ::raise(SIGKILL);
          }
          CHILD_CHECK(o.cache->Write(rs[g], 0, buf.data(), bytes).ok(), "write");
        }
        if (rng() % 8 == 0) {
          CHILD_CHECK(o.cache->AbortMany(rs).ok(), "abort many");
        } else {
          CHILD_CHECK(o.cache->CommitMany(rs).ok(), "commit many");
          if (crash_now) armed_commits += static_cast<int>(rs.size());
        }
        if (crash_now && so.crash_mode == 3 && !rs.empty()) ::raise(SIGKILL);
      }
    }
    for (size_t i = so.batch ? keys.size() : hit->hit_blocks; i < keys.size(); ++i) {
      const uint64_t bytes = BlockBytesFor(keys[i]);
      if (crash_now && so.crash_mode == 1) index.TestCrashAt(cache::Index::CrashPoint::kReserveHoldingLock);
      auto r = o.cache->Reserve(o.ns, keys[i], bytes);
      if (!r.ok()) {
        auto c = r.status().code();
        if (crash_now) ++armed_refusals[c == StatusCode::kAlreadyExists ? 0 : c == StatusCode::kBusy ? 1 : 2];
        CHILD_CHECK(c == StatusCode::kAlreadyExists || c == StatusCode::kBusy || c == StatusCode::kNoSpace,
                    "%s", r.status().ToString().c_str());
        break;  // someone else is writing it: the chain stops here for us
      }
      FillForKey(keys[i], buf.data(), bytes);
      if (crash_now && so.crash_mode == 2) {
        CHILD_CHECK(o.cache->Write(*r, 0, buf.data(), bytes / 2).ok(), "write");
        ::raise(SIGKILL);
      }
      CHILD_CHECK(o.cache->Write(*r, 0, buf.data(), bytes).ok(), "write");
      CHILD_CHECK(o.cache->Commit(*r).ok(), "commit");
      if (crash_now) ++armed_commits;
      if (crash_now && so.crash_mode == 3) ::raise(SIGKILL);
    }
    if (crash_now && so.crash_mode == 4) index.TestCrashAt(cache::Index::CrashPoint::kEvictAfterMark);
    if (crash_now && so.crash_mode == 4) {
      CHILD_CHECK(o.cache->EvictAll().ok(), "evict all");  // dies on the first READY entry
    }
    if (rng() % 8 == 0) {
      // Evict a random suffix of some chain (pinned blocks are skipped by the cache).
      size_t from = keys.empty() ? 0 : rng() % keys.size();
      auto ev = o.cache->Evict(o.ns, std::span<const BlockKey>(keys).subspan(from));
      CHILD_CHECK(ev.ok(), "%s", ev.status().ToString().c_str());
    }
    if (crash_now && hit->hit_blocks == keys.size()) ++armed_full_hits;
    o.cache->Release(hit->pins);
  }
  if (so.crash_mode != 0) {
    std::fprintf(stderr,
                 "node %u never reached crash step %d in %d ops; armed, it committed %d, was refused %d (exists) "
                 "%d (busy) %d (no space), hit whole requests %d times\n",
                 node, so.crash_mode, last_op, armed_commits, armed_refusals[0], armed_refusals[1],
                 armed_refusals[2], armed_full_hits);
  }
  return 0;
}


// Every READY entry's bytes match its key; allocated bytes equal the entries' bytes.
void VerifyQuiescentPool(const std::string& path, uint32_t node) {
  auto o = OpenCache(path, node);
  ASSERT_TRUE(o.cache);
  // Let this node's manager recover every node that left or died.
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * testing::kTestLeaseMs));
  uint64_t bytes = 0;
  std::vector<uint8_t> buf(64 << 10);
  for (const auto& e : testing::LiveEntries(*o.pool)) {
    ASSERT_EQ(cache::StateOf(e.state), cache::kReady) << "an in-flight entry outlived its writer";
    BlockKey k{e.key_lo, e.key_hi};
    auto hit = o.cache->Lookup(o.ns, {&k, 1});
    ASSERT_TRUE(hit.ok() && hit->hit_blocks == 1);
    ASSERT_TRUE(o.cache->Read(hit->pins[0], 0, buf.data(), e.bytes).ok());
    EXPECT_TRUE(MatchesKey(k, buf.data(), e.bytes)) << "READY block with wrong bytes";
    o.cache->Release(hit->pins);
    bytes += e.bytes;
  }
  o.pool->impl().allocator->Trim();
  // Objects named by roots (a central pool's RPC areas) are not cache blocks: whole chunks each.
  const uint64_t chunk = o.pool->impl().regions[0]->info().chunk_bytes;
  std::set<uint64_t> rooted;
  for (const auto& r : o.pool->impl().roots->List()) {
    bytes += (r.size + chunk - 1) / chunk * chunk;
    rooted.insert(region::Offset<void>(r.offset).byte_offset());
  }
  auto regions = pool::AttachAll({path});
  ASSERT_TRUE(regions.ok());
  const uint64_t allocated = alloc::InspectChunks(*(*regions)[0], 8).allocated_bytes;
  EXPECT_EQ(allocated, bytes) << "allocated space does not account for the cached blocks";
  if (allocated != bytes) {
    std::set<uint64_t> referenced;
    for (const auto& e : testing::LiveEntries(*o.pool)) referenced.insert(region::Offset<void>(e.payload).byte_offset());
    for (auto [off, owner] : testing::AllocatedObjects(*(*regions)[0])) {
      if (referenced.count(off) || rooted.count(off)) continue;
      auto w = alloc::OwnerWord::Decode(owner);
      ADD_FAILURE() << "unreferenced object at " << off << " in a chunk of kind " << static_cast<int>(w.kind)
                    << " owned by node " << w.node << " life " << w.incarnation;
    }
  }
}

TEST(CacheProcesses, StormOfOverlappingChainsReadsOnlyRightBytes) {
  testing::TempRegionPath path("storm");
  // Small on purpose: ~13 chunks of data, so LRU eviction runs constantly.
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  auto codes = testing::RunForked(4, [&](int i) { return StormWorker(path.path(), i, StormOptions{}); });
  for (int c : codes) EXPECT_EQ(c, 0);
  VerifyQuiescentPool(path.path(), 5);
  auto problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << p;
  auto regions = pool::AttachAll({path.path()});
  auto stat = cache::Stat(*(*regions)[0], {});
  EXPECT_GT(stat["totals"]["hit_blocks"].get<uint64_t>(), 0u);
  EXPECT_GT(stat["totals"]["evictions"].get<uint64_t>(), 0u);
}

// Three models' namespaces of different block sizes — each its own exact-size class — filled
// past capacity from four processes at once, so eviction runs across the classes: every block
// a put acknowledged reads back identical or is absent, from any process, and at the end the
// allocator holds exactly the READY blocks.
constexpr uint64_t kModelBlockBytes[] = {20 << 10, 917'504, 2'359'296};

int ModelsWorker(const std::string& path, uint32_t node, int rounds) {
  auto o = OpenCache(path, node, 0, testing::kQuietLeaseMs);
  CHILD_CHECK(o.cache, "open node %u", node);
  std::vector<NamespaceHandle> ns;
  for (int m = 0; m < 3; ++m) {
    auto h = o.cache->Namespace(testing::TestNamespace("model-" + std::to_string(m)));
    CHILD_CHECK(h.ok(), "namespace: %s", h.status().ToString().c_str());
    ns.push_back(*h);
  }
  std::mt19937_64 rng(node * 7 + 1);
  std::vector<uint8_t> buf(kModelBlockBytes[2]);
  uint64_t acknowledged = 0, verified = 0;
  auto key_of = [](uint32_t n, int m, int i) { return BlockKey{(uint64_t{n} << 40) | (uint64_t(m) << 32) | uint64_t(i), 0x5eed + uint64_t(m)}; };
  auto check = [&](int m, const BlockKey& k) {
    auto hit = o.cache->Lookup(ns[m], {&k, 1});
    CHILD_CHECK(hit.ok(), "%s", hit.status().ToString().c_str());
    if (hit->hit_blocks == 1) {
      const BlockPin& p = hit->pins[0];
      CHILD_CHECK(p.bytes == kModelBlockBytes[m], "node %u: a block of model %d has %lu bytes", node, m, p.bytes);
      CHILD_CHECK(o.cache->Read(p, 0, buf.data(), p.bytes).ok(), "read");
      CHILD_CHECK(MatchesKey(k, buf.data(), p.bytes), "node %u: a block of model %d read wrong bytes", node, m);
      ++verified;
    }
    o.cache->Release(hit->pins);
    return 0;
  };
  for (int i = 0; i < rounds; ++i) {
    for (int m = 0; m < 3; ++m) {
      const BlockKey k = key_of(node, m, i);
      FillForKey(k, buf.data(), kModelBlockBytes[m]);
      Status put = o.cache->Put(ns[m], k, buf.data(), kModelBlockBytes[m]);
      CHILD_CHECK(put.ok() || put.code() == StatusCode::kBusy || put.code() == StatusCode::kNoSpace,
                  "node %u: put of model %d: %s", node, m, put.ToString().c_str());
      acknowledged += put.ok();
      // A block another process acknowledged a moment ago, and one of this process's own.
      if (check(m, key_of(rng() % 4, m, static_cast<int>(rng() % (i + 1)))) != 0) return 1;
      if (check(m, key_of(node, m, static_cast<int>(rng() % (i + 1)))) != 0) return 1;
    }
  }
  // Most puts were acknowledged: eviction made room across the classes. (The four processes put
  // 2.4 times the data area: without eviction at most 42% could be. A put may still be refused
  // when, under a sanitizer's load, every block it could evict is pinned or locked just then.)
  CHILD_CHECK(acknowledged >= uint64_t(rounds) * 3 * 3 / 4, "node %u: only %lu of %d puts acknowledged", node,
              acknowledged, rounds * 3);
  CHILD_CHECK(verified > 0, "node %u read nothing back", node);
  return 0;
}

TEST(CacheProcesses, ThreeModelsFillAndEvictAcrossTheirClassesFromFourProcesses) {
  testing::TempRegionPath path("models");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 128 << 20, 4096).ok());
  // Each process puts about its share of the data area, twice over.
  const int rounds = 24;
  auto codes = testing::RunForked(4, [&](int i) { return ModelsWorker(path.path(), i, rounds); });
  for (int c : codes) EXPECT_EQ(c, 0);
  auto regions = pool::AttachAll({path.path()});
  ASSERT_TRUE(regions.ok());
  auto stat = cache::Stat(*(*regions)[0], {});
  EXPECT_GT(stat["totals"]["evictions"].get<uint64_t>(), 0u);
  regions->clear();
  for (const auto& p : Problems(path.path())) ADD_FAILURE() << p;
}

TEST(CacheProcesses, StormUnderTheNonCoherentSimulator) {
  CXLKV_NOT_CENTRAL_UNDER_TSAN();
  for (uint64_t seed : cxlkv::testing::SimSeeds({11, 22, 33, 44, 55})) {
    testing::TempRegionPath path("storm-sim");
    ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
    StormOptions so;
    so.ops = 30;
    auto codes = testing::RunForked(4, [&](int i) {
      StormOptions mine = so;
      mine.sim_seed = seed * 10 + i;
      return StormWorker(path.path(), i, mine);
    });
    for (int c : codes) EXPECT_EQ(c, 0) << "seed " << seed;
    VerifyQuiescentPool(path.path(), 5);
    auto problems = Problems(path.path());
    for (const auto& p : problems) ADD_FAILURE() << "seed " << seed << ": " << p;
  }
}

TEST(CacheProcesses, BatchedStormReadsOnlyRightBytes) {
  testing::TempRegionPath path("storm-batch");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  auto codes = testing::RunForked(4, [&](int i) {
    StormOptions so;
    so.batch = true;
    return StormWorker(path.path(), i, so);
  });
  for (int c : codes) EXPECT_EQ(c, 0);
  VerifyQuiescentPool(path.path(), 5);
  auto problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << p;
}

TEST(CacheProcesses, BatchedStormUnderTheNonCoherentSimulator) {
  CXLKV_NOT_CENTRAL_UNDER_TSAN();
  for (uint64_t seed : cxlkv::testing::SimSeeds({12, 23, 34, 45, 56})) {
    testing::TempRegionPath path("storm-batch-sim");
    ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
    auto codes = testing::RunForked(4, [&](int i) {
      StormOptions so;
      so.ops = 30;
      so.batch = true;
      so.sim_seed = seed * 10 + i;
      return StormWorker(path.path(), i, so);
    });
    for (int c : codes) EXPECT_EQ(c, 0) << "seed " << seed;
    VerifyQuiescentPool(path.path(), 5);
    auto problems = Problems(path.path());
    for (const auto& p : problems) ADD_FAILURE() << "seed " << seed << ": " << p;
  }
}

// Four workers die by kill -9 each at a different step (in reserve holding the stripe lock,
// mid-write, after commit, mid-eviction) while a fifth storms through; a survivor node recovers
// them. With `sim_seed`, every process sits behind its own simulated non-coherent cache.
// `batch`: the workers insert with ReserveMany / CommitMany (a kill lands holding a stripe lock
// for several keys, or between a batch's writes).
void KillAtEveryStepAndRecover(uint64_t sim_seed, int ops, int first_crash, int crash_stride, bool batch = false) {
  CXLKV_DECENTRALIZED_ONLY("the workers kill themselves at the index's crash points, which central mode runs in the service");
  testing::TempRegionPath path("storm-kill");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  // Node 0 lives throughout: it manages the pool and runs recovery of the dead. It is a child
  // too: this process forks the workers, and no threads may cross a fork (ThreadSanitizer
  // refuses, and a mutex held by a thread that is not copied would stay held).
  int ready[2], done[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(done), 0);
  std::fflush(stdout);
  pid_t survivor = ::fork();
  if (survivor == 0) {
    auto o = OpenCache(path.path(), 0, sim_seed);
    char c = o.cache ? 'r' : 'x';
    if (::write(ready[1], &c, 1) != 1 || c != 'r') ::_exit(1);
    ::_exit(::read(done[0], &c, 1) == 1 ? 0 : 1);  // leaves (marked left) when told
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'r');
  // Workers 0..3 (nodes 1..4) each die at a different step; worker 4 storms through it all.
  auto codes = testing::RunForked(5, [&](int i) {
    StormOptions so;
    so.ops = ops;
    so.batch = batch;
    so.lease_ms = testing::kTestLeaseMs;  // the survivors wait out the dead workers' leases
    so.sim_seed = sim_seed ? sim_seed * 10 + static_cast<uint64_t>(i) + 1 : 0;
    if (i < 4) {
      so.crash_after = first_crash + crash_stride * i;
      so.crash_mode = i + 1;
    }
    int rc = StormWorker(path.path(), static_cast<uint32_t>(i) + 1, so);
    return i < 4 && rc == 0 ? 3 : rc;  // a crasher that did not crash failed its job
  });
  for (int i = 0; i < 4; ++i) EXPECT_EQ(codes[i], 128 + SIGKILL) << "worker " << i << " was to die";
  EXPECT_EQ(codes[4], 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * testing::kTestLeaseMs));
  // The survivor's manager has reclaimed the dead nodes: check passes with the survivor live.
  auto problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << p;
  ASSERT_EQ(::write(done[1], "d", 1), 1);
  int status = 0;
  ::waitpid(survivor, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the survivor node failed";
  for (int fd : {ready[0], ready[1], done[0], done[1]}) ::close(fd);
  VerifyQuiescentPool(path.path(), 7);
  problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << p;
}

TEST(CacheProcesses, KillNineAtEveryStepIsRecovered) { KillAtEveryStepAndRecover(0, 200, 20, 10); }

TEST(CacheProcesses, BatchedKillNineAtEveryStepIsRecovered) {
  KillAtEveryStepAndRecover(0, 200, 20, 10, /*batch=*/true);
}

// Under the simulator: once (a ThreadSanitizer run, seed 3) it left a payload of the worker
// that leaves cleanly in an orphan chunk, referenced by nothing — an eviction cut short whose
// payload's owner was recovered first (cache_recovery_test.cc shows that order alone).
TEST(CacheProcesses, KillNineAtEveryStepUnderTheNonCoherentSimulator) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({3, 17, 29})) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    KillAtEveryStepAndRecover(seed, 40, 5, 6);
  }
}

// The simulator must catch a protocol that forgets one flush: a reader pins a block without
// publishing the pin; an evictor on another (simulated) host cannot see it and evicts a
// pinned block. With the flush, the evictor sees the pin and evicts nothing.
TEST(CacheProcesses, SimulatorCatchesAPinThatIsNotFlushed) {
  CXLKV_DECENTRALIZED_ONLY("the pin flush it drops is the pinner's, which central mode does in the service");
  for (bool skip_flush : {false, true}) {
    testing::TempRegionPath path("sim-pin");
    ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20).ok());
    const auto tokens = testing::Tokens(77, 16, 0, 0);
    auto put = testing::RunForked(1, [&](int) {
      auto o = OpenCache(path.path(), 2);
      CHILD_CHECK(o.cache, "open");
      auto k = o.cache->ChainKeys(o.ns, tokens)[0];
      std::vector<uint8_t> data(4096);
      FillForKey(k, data.data(), data.size());
      CHILD_CHECK(o.cache->Put(o.ns, k, data.data(), data.size()).ok(), "put");
      return 0;
    });
    ASSERT_EQ(put[0], 0);
    int pinned[2], evicted[2];
    ASSERT_EQ(::pipe(pinned), 0);
    ASSERT_EQ(::pipe(evicted), 0);
    // The evictor (node 0) joins first and manages the pool; then the reader (node 1) joins,
    // so the reader never runs the manager's scans, which would churn its simulated cache.
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    pid_t evictor = ::fork();
    if (evictor == 0) {
      auto o = OpenCache(path.path(), 0, /*sim_seed=*/6);
      if (!o.cache) ::_exit(20);
      char c = 1;
      if (::write(ready[1], &c, 1) != 1 || ::read(pinned[0], &c, 1) != 1) ::_exit(21);
      auto n = o.cache->EvictAll();
      if (::write(evicted[1], &c, 1) != 1) ::_exit(22);
      ::_exit(n.ok() ? static_cast<int>(*n) : 23);
    }
    char go;
    ASSERT_EQ(::read(ready[0], &go, 1), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(testing::kTestLeaseMs));  // node 0 manages by now
    pid_t reader = ::fork();
    if (reader == 0) {
      auto o = OpenCache(path.path(), 1, /*sim_seed=*/5);
      if (!o.cache) ::_exit(10);
      o.pool->impl().index->TestSkipPinFlush(skip_flush);
      // No lucky random write-back of the dirty pin line: the outcome is the protocol's alone.
      o.pool->impl().regions[0]->impl().meta().simulator()->SetChaos(false);
      auto k = o.cache->ChainKeys(o.ns, tokens)[0];
      auto hit = o.cache->Lookup(o.ns, {&k, 1});
      if (!hit.ok() || hit->hit_blocks != 1) ::_exit(11);
      char c = 1;
      if (::write(pinned[1], &c, 1) != 1 || ::read(evicted[0], &c, 1) != 1) ::_exit(12);
      o.cache->Release(hit->pins);
      ::_exit(0);
    }
    int rs, es;
    ::waitpid(reader, &rs, 0);
    ::waitpid(evictor, &es, 0);
    for (int fd : {pinned[0], pinned[1], evicted[0], evicted[1], ready[0], ready[1]}) ::close(fd);
    ASSERT_TRUE(WIFEXITED(rs) && WEXITSTATUS(rs) == 0) << "reader";
    ASSERT_TRUE(WIFEXITED(es)) << "evictor";
    EXPECT_EQ(WEXITSTATUS(es), skip_flush ? 1 : 0)
        << (skip_flush ? "the simulator did not expose the missing pin flush"
                       : "a pinned block was evicted with the protocol intact");
  }
}

// The evictor's side of the pin protocol (P2): it reads every node's pin table once (evicting
// another block), so its simulated cache holds the reader's table with no pin in it; the reader
// then pins and the evictor tries to evict that block. Only the invalidates before its second
// read show it the pin: of the directory when the reader had no page yet (`warm_page` false),
// of the page when it had one, listed and emptied by a release (true). The reader joins first
// and manages the pool, so the evictor runs no manager scans, which would churn its cache and
// drop the stale lines by luck.
void EvictorRereadsPinTable(bool warm_page) {
  testing::TempRegionPath path("sim-stale-pins");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20).ok());
  const auto tokens = testing::Tokens(78, 32, 0, 0);
  auto put = testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 2);
    CHILD_CHECK(o.cache, "open");
    for (const BlockKey& k : o.cache->ChainKeys(o.ns, tokens)) {
      std::vector<uint8_t> data(4096);
      FillForKey(k, data.data(), data.size());
      CHILD_CHECK(o.cache->Put(o.ns, k, data.data(), data.size()).ok(), "put");
    }
    return 0;
  });
  ASSERT_EQ(put[0], 0);
  testing::Child reader = testing::Child::Fork([&](int in, int out) {
    auto o = OpenCache(path.path(), 1, /*sim_seed=*/7);
    if (!o.cache) return 10;
    // A pin taken and given back leaves its page this process's open page, listed in the
    // directory with no pin in it: the evictor's first read caches it empty.
    if (warm_page) {
      auto warm = o.cache->ChainKeys(o.ns, tokens)[1];
      auto first = o.cache->Lookup(o.ns, {&warm, 1});
      if (!first.ok() || first->hit_blocks != 1) return 14;
      o.cache->Release(first->pins);
    }
    if (!testing::Put(out, 1)) return 15;
    uint64_t cmd;
    if (!testing::Get(in, &cmd)) return 11;
    auto k = o.cache->ChainKeys(o.ns, tokens)[0];
    auto hit = o.cache->Lookup(o.ns, {&k, 1});
    if (!hit.ok() || hit->hit_blocks != 1) return 12;
    if (!testing::Put(out, 1) || !testing::Get(in, &cmd)) return 13;
    o.cache->Release(hit->pins);
    return 0;
  });
  uint64_t reply;
  ASSERT_TRUE(reader.Receive(&reply));
  std::this_thread::sleep_for(std::chrono::milliseconds(testing::kTestLeaseMs));  // node 1 manages by now
  testing::Child evictor = testing::Child::Fork([&](int in, int out) {
    auto o = OpenCache(path.path(), 3, /*sim_seed=*/8);
    if (!o.cache) return 20;
    o.pool->impl().regions[0]->impl().meta().simulator()->SetChaos(false);
    auto other = o.cache->ChainKeys(o.ns, tokens)[1];
    auto first = o.cache->Evict(o.ns, {&other, 1});  // reads every node's pin table: cached now
    if (!first.ok() || *first != 1) return 21;
    uint64_t cmd;
    if (!testing::Put(out, 1) || !testing::Get(in, &cmd)) return 22;
    // The pinned key alone: a whole sweep would fill the cache past its capacity with entry
    // lines and drop the stale table by chance.
    auto pinned = o.cache->ChainKeys(o.ns, tokens)[0];
    auto n = o.cache->Evict(o.ns, {&pinned, 1});
    (void)testing::Put(out, n.ok() ? *n : 99);
    (void)testing::Get(in, &cmd);
    return 0;
  });
  ASSERT_TRUE(evictor.Receive(&reply));
  ASSERT_TRUE(reader.Send(1));  // pin
  ASSERT_TRUE(reader.Receive(&reply));
  ASSERT_TRUE(evictor.Send(1));  // evict the pinned block
  uint64_t evicted = 99;
  ASSERT_TRUE(evictor.Receive(&evicted));
  EXPECT_EQ(evicted, 0u) << "the evictor read its stale copy of the reader's pin table and evicted a pinned block";
  ASSERT_TRUE(reader.Send(1));
  ASSERT_TRUE(evictor.Send(1));
  EXPECT_EQ(reader.Wait(), 0);
  EXPECT_EQ(evictor.Wait(), 0);
}

TEST(CacheProcesses, SimulatorEvictorRereadsAPinTableItReadBefore) {
  CXLKV_DECENTRALIZED_ONLY("a central service's cache is the table: it reads no other writer's lines");
  for (bool warm_page : {false, true}) {
    SCOPED_TRACE(warm_page ? "the reader's page was listed before" : "the reader had no page before");
    EvictorRereadsPinTable(warm_page);
  }
}

}  // namespace
}  // namespace cxlkv

namespace cxlkv {
namespace {

// A writer stopped (SIGSTOP) between Reserve and Commit for several leases: it is declared dead,
// its WRITING entry is reclaimed and another node reserves, writes and commits the same key.
// Resumed, the paused writer's Commit must publish nothing: the block stays the second writer's.
void PausedWriter(uint64_t seed) {
  testing::TempRegionPath path("pausedwriter");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  const BlockKey key{0x1234, 0x5678};
  constexpr uint64_t kBytes = 64 << 10;
  int ready[2], go[2], written[2], leave[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  ASSERT_EQ(::pipe(written), 0);
  ASSERT_EQ(::pipe(leave), 0);
  std::fflush(stdout);
  pid_t victim = ::fork();
  if (victim == 0) {
    auto body = [&]() -> int {
      auto o = OpenCache(path.path(), 1, seed ? seed * 10 + 1 : 0);
      CHILD_CHECK(o.cache != nullptr, "open");
      auto r = o.cache->Reserve(o.ns, key, kBytes);
      CHILD_CHECK(r.ok(), "%s", r.status().ToString().c_str());
      std::vector<uint8_t> mine(kBytes, 0xAA);  // not the key's pattern
      CHILD_CHECK(o.cache->Write(*r, 0, mine.data(), kBytes).ok(), "write");
      char c = 'r';
      CHILD_CHECK(::write(ready[1], &c, 1) == 1, "pipe");
      CHILD_CHECK(::read(go[0], &c, 1) == 1, "pipe");
      Status s = o.cache->Commit(*r);
      CHILD_CHECK(!s.ok(), "a writer paused past its lease committed its block");
      CHILD_CHECK(s.code() == StatusCode::kLeaseExpired || s.code() == StatusCode::kNotFound, "%s",
                  s.ToString().c_str());
      return 0;
    };
    ::_exit(body());
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::kill(victim, SIGSTOP);
  // Node 2 takes the key over once node 1 is declared dead (it also manages and recovers).
  pid_t second = ::fork();
  if (second == 0) {
    auto body = [&]() -> int {
      auto o = OpenCache(path.path(), 2, seed ? seed * 10 + 2 : 0);
      CHILD_CHECK(o.cache != nullptr, "open");
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      Result<Reservation> r = Busy("not yet");
      while (std::chrono::steady_clock::now() < deadline) {
        r = o.cache->Reserve(o.ns, key, kBytes);
        if (r.ok() || r.status().code() != StatusCode::kBusy) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      CHILD_CHECK(r.ok(), "the paused writer's entry was never reclaimed: %s", r.status().ToString().c_str());
      std::vector<uint8_t> theirs(kBytes);
      FillForKey(key, theirs.data(), kBytes);
      CHILD_CHECK(o.cache->Write(*r, 0, theirs.data(), kBytes).ok(), "write");
      CHILD_CHECK(o.cache->Commit(*r).ok(), "commit");
      char w = 'w';
      CHILD_CHECK(::write(written[1], &w, 1) == 1, "pipe");
      CHILD_CHECK(::read(leave[0], &w, 1) == 1, "pipe");  // stay (managing) until the victim is done
      return 0;
    };
    ::_exit(body());
  }
  ::close(written[1]);  // a second writer that fails closes the pipe: the read ends, no hang
  written[1] = -1;
  const bool second_wrote = ::read(written[0], &c, 1) == 1;
  ::kill(victim, SIGCONT);
  EXPECT_TRUE(second_wrote) << "the second writer never took the key over, seed " << seed;
  ASSERT_EQ(::write(go[1], "g", 1), 1);  // the victim commits (and must be refused)
  int status = 0;
  ::waitpid(victim, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "victim, seed " << seed;
  ASSERT_EQ(::write(leave[1], "l", 1), 1);  // the second node may leave
  ::waitpid(second, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "second writer, seed " << seed;
  for (int fd : {ready[0], ready[1], go[0], go[1], written[0], leave[0], leave[1]}) ::close(fd);
  // What is published is the second writer's block, whole.
  pid_t reader = ::fork();
  if (reader == 0) {
    auto body = [&]() -> int {
      auto o = OpenCache(path.path(), 3);
      CHILD_CHECK(o.cache != nullptr, "open");
      auto hit = o.cache->Lookup(o.ns, {&key, 1});
      CHILD_CHECK(hit.ok() && hit->hit_blocks == 1, "the block is not READY");
      std::vector<uint8_t> got(kBytes);
      CHILD_CHECK(o.cache->Read(hit->pins[0], 0, got.data(), kBytes).ok(), "read");
      o.cache->Release(hit->pins);
      CHILD_CHECK(MatchesKey(key, got.data(), kBytes), "the published block is not the second writer's");
      return 0;
    };
    ::_exit(body());
  }
  ::waitpid(reader, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "reader, seed " << seed;
  auto problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << "seed " << seed << ": " << p;
}

// The same writer, alone: nobody reclaims its entry while it is stopped, so the entry is still
// WRITING with its old life's writer word when it resumes. A lock-free "still WRITING? then
// READY" would publish it; the fenced commit refuses, and the old life's recovery drops it.
TEST(CacheLease, AWriterPausedAloneCommitsNothingAfterItsLease) {
  testing::TempRegionPath path("pausedalone");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  const BlockKey key{0x4321, 0x8765};
  constexpr uint64_t kBytes = 64 << 10;
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  std::fflush(stdout);
  pid_t victim = ::fork();
  if (victim == 0) {
    auto body = [&]() -> int {
      auto o = OpenCache(path.path(), 1);
      CHILD_CHECK(o.cache != nullptr, "open");
      auto r = o.cache->Reserve(o.ns, key, kBytes);
      CHILD_CHECK(r.ok(), "%s", r.status().ToString().c_str());
      std::vector<uint8_t> bytes(kBytes);
      FillForKey(key, bytes.data(), kBytes);
      CHILD_CHECK(o.cache->Write(*r, 0, bytes.data(), kBytes).ok(), "write");
      char c = 'r';
      CHILD_CHECK(::write(ready[1], &c, 1) == 1, "pipe");
      CHILD_CHECK(::read(go[0], &c, 1) == 1, "pipe");
      const uint64_t life_before = o.pool->impl().node->incarnation();
      Status s = o.cache->Commit(*r);
      CHILD_CHECK(s.code() == StatusCode::kLeaseExpired, "commit after the lease: %s (life %llu then %llu)",
                  s.ToString().c_str(), (unsigned long long)life_before,
                  (unsigned long long)o.pool->impl().node->incarnation());
      // The node's new life recovers the old one: the entry goes, nothing stays WRITING.
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      for (;;) {
        auto peek = o.cache->Peek(o.ns, {&key, 1});
        CHILD_CHECK(peek.ok(), "peek: %s", peek.status().ToString().c_str());
        if ((*peek)[0].state != PeekState::kWriting) break;
        CHILD_CHECK(std::chrono::steady_clock::now() < deadline, "the old life's entry was never recovered");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      return 0;
    };
    ::_exit(body());
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::kill(victim, SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * testing::kTestLeaseMs));
  ::kill(victim, SIGCONT);
  ASSERT_EQ(::write(go[1], "g", 1), 1);
  int status = 0;
  ::waitpid(victim, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
  auto problems = Problems(path.path());
  for (const auto& p : problems) ADD_FAILURE() << p;
}

TEST(CacheLease, AWriterPausedBetweenReserveAndCommitPublishesNothing) { PausedWriter(0); }
TEST(CacheLease, AWriterPausedBetweenReserveAndCommitUnderTheSimulator) {
  for (uint64_t seed : {7, 31}) PausedWriter(seed);
}

}  // namespace
}  // namespace cxlkv
