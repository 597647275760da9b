// Warm restart into a new region: an SSD tier's blocks outlive the shared
// region — a host reboot with the pool in /dev/shm, or a pool re-created with `cxlkv init` — and
// the node's next cxlkvd names them in the fresh index again from the device's catalog and
// namespace book. What cannot be proven (a damaged book, a key cached again meanwhile) is freed,
// never served; a restorer killed or paused past its lease leaves nothing half-named.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"
#include "child.h"
#include "tier/namespace_book.h"
#include "tier/tier_service.h"
#include "tier/tier_store.h"
#include "tier_test_util.h"
#include "tiering_test_util.h"

namespace cxlkv::tier {
namespace {

using cxlkv::testing::Child;
using cxlkv::testing::OpenCache;

constexpr size_t kBlocks = 24;
constexpr uint64_t kDoc = 21;

std::vector<BlockKey> ChainOf(KvCache& cache, const NamespaceHandle& ns) {
  return cache.ChainKeys(ns, cxlkv::testing::Tokens(kDoc, 16 * kBlocks, 0, 0));
}

// In a child (node 1): puts the chain into a pool with checksums, spills all of it to an SSD
// file, and ends — killed with -9 when `kill`, so nothing is closed cleanly.
void SpillEverythingThenEnd(const std::string& region, const std::string& file, bool kill) {
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(region, 64 << 20, 2048, /*checksum=*/true).ok());
  auto first = cxlkv::testing::RunForked(1, [&](int) {
    auto o = OpenCache(region, 1);
    CHILD_CHECK(o.cache, "open");
    auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
    CHILD_CHECK(store.ok(), "%s", store.status().ToString().c_str());
    PutChain(*o.cache, o.ns, kDoc, kBlocks);
    auto n = (*store)->Spill(~0ull);
    CHILD_CHECK(n.ok() && *n == kBlocks, "spilled %llu", static_cast<unsigned long long>(n.ok() ? *n : 0));
    if (kill) ::raise(SIGKILL);
    return 0;
  });
  ASSERT_EQ(first[0], kill ? 128 + SIGKILL : 0);
}

// The region is lost and created again, empty; another model registers first, so the chain's
// namespace lands in another slot of the new namespace table than it had.
void RecreateRegion(const std::string& region) {
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(region, 64 << 20, 2048, /*checksum=*/true).ok());
  auto other = cxlkv::testing::OpenOrNull({region}, 2);
  ASSERT_TRUE(other);
  auto cache = other->Cache();
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE((*cache)->Namespace(cxlkv::testing::TestNamespace("another-model")).ok());
}

// The node's next cxlkvd in the new region: names the blocks again, serves them, and every one
// reads back identical (the pool verifies its xxh3 on each read, computed at the promote).
void RestoreAndServe(const std::string& region, const std::string& file, uint64_t sim_seed) {
  auto o = OpenCache(region, 1, sim_seed);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_NE(o.ns.id, 0u) << "the namespace should have moved to another slot";
  EXPECT_EQ((*store)->Stats()["restored"], kBlocks);
  EXPECT_EQ((*store)->Stats()["restore_skipped"], 0u);
  EXPECT_EQ(EntriesByTier(*o.pool)[cache::kTierSsd], kBlocks);
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  std::pair<size_t, size_t> brought_in;
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, ChainOf(*o.cache, o.ns), &brought_in), kBlocks);
  EXPECT_EQ(brought_in.second, kBlocks);
  EXPECT_EQ((*store)->Stats()["devices"][0]["used_slots"], 0u);  // all promoted: every slot free
  service->reset();
  store->reset();
  o.pool.reset();
  ExpectCheckClean(region);
}

TEST(TierRestore, ACleanlyClosedSsdTierIsServedFromANewRegion) {
  cxlkv::testing::TempRegionPath path("tier-restore-clean");
  testing::ScratchDir dir;
  SpillEverythingThenEnd(path.path(), dir.File("kv.tier"), /*kill=*/false);
  RecreateRegion(path.path());
  RestoreAndServe(path.path(), dir.File("kv.tier"), 0);
}

TEST(TierRestore, AnSsdTierWhoseOwnerWasKilledIsServedFromANewRegion) {
  cxlkv::testing::TempRegionPath path("tier-restore-kill");
  testing::ScratchDir dir;
  SpillEverythingThenEnd(path.path(), dir.File("kv.tier"), /*kill=*/true);
  RecreateRegion(path.path());
  RestoreAndServe(path.path(), dir.File("kv.tier"), 0);
}

TEST(TierRestore, RestoringUnderTheNonCoherentSimulator) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({5, 29, 71})) {
    SCOPED_TRACE(seed);
    cxlkv::testing::TempRegionPath path("tier-restore-sim");
    testing::ScratchDir dir;
    SpillEverythingThenEnd(path.path(), dir.File("kv.tier"), /*kill=*/false);
    RecreateRegion(path.path());
    RestoreAndServe(path.path(), dir.File("kv.tier"), seed);
  }
}

// A key the new region cached before the daemon came back keeps its region copy; the device's
// copy is freed. The rest are named again.
TEST(TierRestore, ABlockCachedAgainMeanwhileIsFreedNotNamedTwice) {
  cxlkv::testing::TempRegionPath path("tier-restore-again");
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  SpillEverythingThenEnd(path.path(), file, false);
  RecreateRegion(path.path());
  auto o = OpenCache(path.path(), 1);
  ASSERT_TRUE(o.cache);
  const std::vector<BlockKey> keys = ChainOf(*o.cache, o.ns);
  std::vector<uint8_t> data(kBlock);
  for (size_t i = 0; i < 5; ++i) {
    cxlkv::testing::FillForKey(keys[i], data.data(), data.size());
    ASSERT_TRUE(o.cache->Put(o.ns, keys[i], data.data(), data.size()).ok());
  }
  auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->Stats()["restored"], kBlocks - 5);
  EXPECT_EQ((*store)->Stats()["restore_skipped"], 5u);
  EXPECT_EQ((*store)->Stats()["devices"][0]["used_slots"], kBlocks - 5);
  auto tiers = EntriesByTier(*o.pool);
  EXPECT_EQ(tiers[cache::kTierRegion], 5u);
  EXPECT_EQ(tiers[cache::kTierSsd], kBlocks - 5);
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, keys), kBlocks);
  service->reset();
  store->reset();
  o.pool.reset();
  ExpectCheckClean(path.path());
}

// A damaged namespace book: garbage, a description edited so that it no longer hashes to its
// fingerprint, or gone. Nothing is named, no namespace is registered from it, every slot is freed,
// and the chain simply misses.
void DamagedBookRestoresNothing(const std::function<void(const std::string&)>& damage) {
  cxlkv::testing::TempRegionPath path("tier-restore-book");
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  SpillEverythingThenEnd(path.path(), file, false);
  damage(NamespaceBook::PathOf(file));
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048, true).ok());
  {
    auto pool = cxlkv::testing::OpenOrNull({path.path()}, 1);
    ASSERT_TRUE(pool);
    auto store = TierStore::Open(*pool, Options({Ssd(file, 16 << 20)}));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ((*store)->Stats()["restored"], 0u);
    EXPECT_EQ((*store)->Stats()["restore_skipped"], kBlocks);
    EXPECT_EQ((*store)->Stats()["devices"][0]["used_slots"], 0u);
    auto cache = pool->Cache();
    ASSERT_TRUE(cache.ok());
    auto ns = (*cache)->Namespace(cxlkv::testing::TestNamespace());
    ASSERT_TRUE(ns.ok());
    EXPECT_EQ(ns->id, 0u) << "a namespace was registered from a damaged book";
    EXPECT_EQ(*(*cache)->Exists(*ns, ChainOf(**cache, *ns)), 0u);
  }
  ExpectCheckClean(path.path());
}

TEST(TierRestore, AGarbledNamespaceBookRestoresNothing) {
  DamagedBookRestoresNothing([](const std::string& book) { std::ofstream(book) << "{\"version\": 1, \"namesp"; });
}

TEST(TierRestore, ANamespaceDescriptionThatNoLongerHashesToItsFingerprintRestoresNothing) {
  DamagedBookRestoresNothing([](const std::string& book) {
    std::ifstream in(book);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = text.find("test-model");
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, 10, "best-model");
    std::ofstream(book) << text;
  });
}

TEST(TierRestore, AMissingNamespaceBookRestoresNothing) {
  DamagedBookRestoresNothing([](const std::string& book) { ASSERT_TRUE(std::filesystem::remove(book)); });
}

// The restorer is killed with -9 after an entry's fields reached memory and before READY: the
// entry is still free, and the node's next process names every block (again).
TEST(TierRestore, ARestorerKilledMidInsertLeavesNothingHalfNamed) {
  cxlkv::testing::TempRegionPath path("tier-restore-killmid");
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  SpillEverythingThenEnd(path.path(), file, false);
  RecreateRegion(path.path());
  auto killed = cxlkv::testing::RunForked(1, [&](int) {
    auto pool = cxlkv::testing::OpenOrNull({path.path()}, 1);
    CHILD_CHECK(pool, "open");
    pool->impl().index->TestCrashAt(cache::Index::CrashPoint::kInsertAfterFields);
    (void)TierStore::Open(*pool, Options({Ssd(file, 16 << 20)}));
    return 3;
  });
  ASSERT_EQ(killed[0], 128 + SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * cxlkv::testing::kTestLeaseMs));
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(*cxlkv::testing::OpenOrNull({path.path()}, 3))) {
    EXPECT_NE(cache::StateOf(e.state), cache::kReady) << "a block was named before its fields were complete";
  }
  RestoreAndServe(path.path(), file, 0);
}

// The restorer is stopped (SIGSTOP) inside the insert, right before its fence, past its lease;
// resumed, its old life writes nothing. The node's next process names every block.
TEST(TierRestore, ARestorerPausedPastItsLeaseNamesNothingAfterItResumes) {
  cxlkv::testing::TempRegionPath path("tier-restore-pause");
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  SpillEverythingThenEnd(path.path(), file, false);
  RecreateRegion(path.path());
  Child survivor = StartSurvivor(path.path());  // node 0: recovers the lives this test ends
  Child restorer = Child::Fork([&](int, int out) {
    auto pool = cxlkv::testing::OpenOrNull({path.path()}, 1);
    if (!pool) return 101;
    (void)cxlkv::testing::Put(out, pool->impl().index->WriterOfThisProcess());
    pool->impl().index->TestCrashAt(cache::Index::CrashPoint::kInsertPauseBeforeFence);
    auto store = TierStore::Open(*pool, Options({Ssd(file, 16 << 20)}));
    // Leave without closing: what the resumed life named is the next process's to adopt.
    ::_exit(store.ok() ? 0 : 102);
  });
  uint64_t paused_life = 0;
  ASSERT_TRUE(restorer.Receive(&paused_life));
  int status = 0;
  ASSERT_EQ(::waitpid(restorer.pid, &status, WUNTRACED), restorer.pid);
  ASSERT_TRUE(WIFSTOPPED(status)) << "the restorer did not stop in the insert";
  std::this_thread::sleep_for(std::chrono::milliseconds(5 * cxlkv::testing::kTestLeaseMs));
  // The paused life is over: nothing it was about to name is in the index.
  {
    auto look = cxlkv::testing::OpenOrNull({path.path()}, 3);
    ASSERT_TRUE(look);
    for (const cache::Entry& e : cxlkv::testing::LiveEntries(*look)) {
      EXPECT_NE(e.tier, cache::kTierSsd) << "the paused restorer's old life named a block";
    }
  }
  ::kill(restorer.pid, SIGCONT);
  EXPECT_EQ(restorer.Wait(), 0);
  // Resumed, it may rejoin as a new life and name blocks under locks that life holds; the
  // paused life named none.
  {
    auto look = cxlkv::testing::OpenOrNull({path.path()}, 3);
    ASSERT_TRUE(look);
    for (const cache::Entry& e : cxlkv::testing::LiveEntries(*look)) {
      EXPECT_NE(e.writer, paused_life) << "a block was named by the life that was paused past its lease";
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * cxlkv::testing::kTestLeaseMs));
  // The next process adopts what the resumed life named and names the rest: all of them.
  auto o = OpenCache(path.path(), 1);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const nlohmann::json st = (*store)->Stats();
  EXPECT_EQ(st["restored"].get<uint64_t>() + st["adopted"].get<uint64_t>(), kBlocks) << st.dump();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, ChainOf(*o.cache, o.ns)), kBlocks);
  ASSERT_TRUE(survivor.Send(1));
  EXPECT_EQ(survivor.Wait(), 0);
  service->reset();
  store->reset();
  o.pool.reset();
  ExpectCheckClean(path.path());
}

TEST(NamespaceBook, RecordsOncePersistsAndForgetsWhatNoBlockUses) {
  testing::ScratchDir dir;
  const std::string base = dir.File("kv.tier");
  KeyNamespace a = cxlkv::testing::TestNamespace("model-a");
  a.extra_key = "lora-7";
  a.layout.num_layers = 2;
  a.layout.num_kv_heads = 4;
  a.layout.head_size = 64;
  a.layout.dtype = KvDtype::kBf16;
  const KeyNamespace b = cxlkv::testing::TestNamespace("model-b");
  const uint64_t fa = NamespaceFingerprint(cache::Index::SeedFor(a));
  const uint64_t fb = NamespaceFingerprint(cache::Index::SeedFor(b));
  {
    auto book = NamespaceBook::Open(base);
    ASSERT_TRUE(book.ok());
    EXPECT_EQ((*book)->size(), 0u);
    EXPECT_TRUE((*book)->message().empty());
    ASSERT_TRUE((*book)->Record(fa, a).ok());
    ASSERT_TRUE((*book)->Record(fa, a).ok());
    ASSERT_TRUE((*book)->Record(fb, b).ok());
    EXPECT_EQ((*book)->size(), 2u);
  }
  auto book = NamespaceBook::Open(base);
  ASSERT_TRUE(book.ok());
  EXPECT_TRUE((*book)->message().empty()) << (*book)->message();
  KeyNamespace back;
  ASSERT_TRUE((*book)->Find(fa, &back));
  EXPECT_EQ(cache::Index::SeedFor(back), cache::Index::SeedFor(a)) << "the description did not survive whole";
  EXPECT_EQ(back.extra_key, "lora-7");
  EXPECT_EQ(back.layout.dtype, KvDtype::kBf16);
  ASSERT_TRUE((*book)->Retain({fb}).ok());
  auto again = NamespaceBook::Open(base);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->size(), 1u);
  EXPECT_FALSE((*again)->Find(fa, &back));
  EXPECT_TRUE((*again)->Find(fb, &back));
}

TEST(NamespaceBook, MalformedEntriesAreDroppedByNameAndAnUnwritableBookFailsTheRecord) {
  testing::ScratchDir dir;
  const std::string base = dir.File("kv.tier");
  std::ofstream(NamespaceBook::PathOf(base))
      << R"({"version": 1, "namespaces": [{"fingerprint": "zz"}, 7,)"
         R"( {"fingerprint": "0000000000000001", "model_id": "m", "extra_key": "",)"
         R"(  "layout": {"dtype": 9, "num_layers": 0, "num_kv_heads": 0, "head_size": 0, "block_size": 16,)"
         R"(  "tp_rank": 0, "tp_size": 1, "pp_stage": 0, "kv_parts": 2, "block_format": 1}}]})";
  auto book = NamespaceBook::Open(base);
  ASSERT_TRUE(book.ok());
  EXPECT_EQ((*book)->size(), 0u);
  EXPECT_NE((*book)->message().find("3 malformed entries ignored"), std::string::npos) << (*book)->message();
  // A document of the wrong shape or types anywhere is an empty book, never an exception.
  for (const char* bad : {R"({"version": "1", "namespaces": []})", R"({"version": 1, "namespaces": {}})", "[1, 2]",
                          R"({"version": 1, "namespaces": [{"fingerprint": 7, "model_id": [], "layout": 3}]})"}) {
    std::ofstream(NamespaceBook::PathOf(base + "-shape")) << bad;
    auto shaped = NamespaceBook::Open(base + "-shape");
    ASSERT_TRUE(shaped.ok()) << bad;
    EXPECT_EQ((*shaped)->size(), 0u) << bad;
    EXPECT_FALSE((*shaped)->message().empty()) << bad;
  }
  // The book's scratch name taken by a directory: the rewrite cannot create it (as root too).
  std::filesystem::create_directory(NamespaceBook::PathOf(base) + ".tmp");
  const KeyNamespace a = cxlkv::testing::TestNamespace("model-a");
  Status s = (*book)->Record(NamespaceFingerprint(cache::Index::SeedFor(a)), a);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.ToString();
  EXPECT_NE(s.message().find("cannot create"), std::string::npos) << s.ToString();
  KeyNamespace back;
  EXPECT_FALSE((*book)->Find(NamespaceFingerprint(cache::Index::SeedFor(a)), &back));
}

}  // namespace
}  // namespace cxlkv::tier
