// The capacity tiers behind the region: the index as the one lookup table over every
// device, spill on pressure, promote on hit, a full device, invalid slots, an owner's restart,
// a mover killed mid-move, and another node's blocks brought in through its service.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"
#include "child.h"
#include "tier/catalog.h"
#include "tier/tier_service.h"
#include "tier/tier_store.h"
#include "tier_test_util.h"
#include "tiering_test_util.h"

namespace cxlkv::tier {
namespace {

using cxlkv::testing::Child;
using cxlkv::testing::OpenCache;


TEST(TierSpec, ParsesDramAndSsdAndRefusesWhatItCannotRead) {
  auto d = ParseTierSpec("dram:8G");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind, TierKind::kMem);
  EXPECT_EQ(d->bytes, 8ull << 30);
  auto n = ParseTierSpec("dram:512M:numa=1");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->numa_node, 1);
  auto s = ParseTierSpec("ssd:/data/a:b/kv.tier:64G");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->path, "/data/a:b/kv.tier");
  EXPECT_EQ(s->bytes, 64ull << 30);
  for (const char* bad : {"dram", "dram:", "dram:zero", "ssd:64G", "ssd::64G", "tape:1G", "dram:1G:numa=x"}) {
    auto r = ParseTierSpec(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("expected dram:SIZE"), std::string::npos) << r.status().ToString();
  }
}

// Every block spilled to node DRAM and an SSD file (split by measured bandwidth), then looked up:
// each is brought back into the region by the owner's service and reads back identical.
void SpillAndPromoteEverything(uint64_t sim_seed) {
  cxlkv::testing::TempRegionPath path("tier-spill");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  auto o = OpenCache(path.path(), 0, sim_seed);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Dram(16 << 20), Ssd(dir.File("kv.tier"), 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok()) << service.status().ToString();
  Blocks b = PutChain(*o.cache, o.ns, 1, 40);

  auto spilled = (*store)->Spill(~0ull);
  ASSERT_TRUE(spilled.ok()) << spilled.status().ToString();
  EXPECT_EQ(*spilled, 40u);
  auto tiers = EntriesByTier(*o.pool);
  EXPECT_EQ(tiers[cache::kTierRegion], 0u);
  EXPECT_GT(tiers[cache::kTierMem], 0u) << "placement gave DRAM nothing";
  EXPECT_EQ(tiers[cache::kTierMem] + tiers[cache::kTierSsd], 40u);
  EXPECT_EQ(*o.cache->Exists(o.ns, b.keys), 40u);  // present in the pool, on some tier
  ExpectCheckClean(path.path());

  std::pair<size_t, size_t> brought_in;
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, b.keys, &brought_in), 40u);
  // The lookup says where its hits came from: exactly where the index had them.
  EXPECT_EQ(brought_in.first, tiers[cache::kTierMem]);
  EXPECT_EQ(brought_in.second, tiers[cache::kTierSsd]);
  EXPECT_EQ(EntriesByTier(*o.pool)[cache::kTierRegion], 40u);
  const nlohmann::json st = (*store)->Stats();
  EXPECT_EQ(st["spilled"], 40u);
  EXPECT_EQ(st["promoted"], 40u);
  for (const auto& d : st["devices"]) EXPECT_EQ(d["used_slots"], 0u) << d.dump();
  service->reset();
  ExpectCheckClean(path.path());
}

TEST(Tiering, SpilledBlocksReadBackIdenticalFromDramAndSsd) { SpillAndPromoteEverything(0); }

TEST(Tiering, SpillAndPromoteUnderTheNonCoherentSimulator) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({3, 17, 41, 59, 83, 97})) {
    SCOPED_TRACE(seed);
    SpillAndPromoteEverything(seed);
  }
}

// A device with no free slot drops its own least recently used blocks to take new ones.
TEST(Tiering, AFullDeviceDropsItsLeastRecentlyUsedBlocks) {
  cxlkv::testing::TempRegionPath path("tier-full");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Dram(8 * kSlot)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  Blocks old_chain = PutChain(*o.cache, o.ns, 1, 6);
  ASSERT_EQ(*(*store)->Spill(~0ull), 6u);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the second chain is newer
  Blocks new_chain = PutChain(*o.cache, o.ns, 2, 6);
  ASSERT_EQ(*(*store)->Spill(~0ull), 6u);
  // 12 blocks through 8 slots: the 4 oldest of the first chain went.
  auto tiers = EntriesByTier(*o.pool);
  EXPECT_EQ(tiers[cache::kTierMem], 8u);
  EXPECT_EQ((*store)->Stats()["dropped_full"], 4u);
  EXPECT_EQ(*o.cache->Exists(o.ns, old_chain.keys), 0u);  // its head is gone: no prefix left
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, new_chain.keys), 6u);
  service->reset();
  ExpectCheckClean(path.path());
}

// The fast device fills first; its share then goes to the device with room, and nothing is
// dropped while any device has a free slot.
TEST(Tiering, AFullDevicesShareGoesWhereThereIsRoomBeforeAnythingIsDropped) {
  cxlkv::testing::TempRegionPath path("tier-overflow");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Dram(4 * kSlot), Ssd(dir.File("kv.tier"), 32 * kSlot)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  Blocks b = PutChain(*o.cache, o.ns, 7, 20);
  for (int round = 0; round < 5; ++round) ASSERT_TRUE((*store)->Spill(4 * kBlock).ok());
  auto tiers = EntriesByTier(*o.pool);
  EXPECT_EQ(tiers[cache::kTierMem], 4u);
  EXPECT_EQ(tiers[cache::kTierSsd], 16u);
  EXPECT_EQ((*store)->Stats()["dropped_full"], 0u);
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, b.keys), 20u);
  service->reset();
  ExpectCheckClean(path.path());
}

// A flipped byte in an SSD slot: that block is a counted miss, its entry dropped and its slot
// freed; the chain's hit ends there and the blocks before it read back identical.
// A device (block or character) keeps its restart catalog in a named directory; without one it
// is refused before it is opened, with the fix. /dev/null stands in for an NVMe generic device
// (a character device): opening it as one would fail with another message.
TEST(Tiering, ADeviceWithoutACatalogDirectoryIsRefusedBeforeItIsOpened) {
  cxlkv::testing::TempRegionPath path("tier-nocatalog");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto refused = TierStore::Open(*o.pool, Options({Ssd("/dev/null", 16 * kSlot)}));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("is a device"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("catalog=DIR"), std::string::npos) << refused.status().message();
}

TEST(Tiering, ACorruptSlotIsAMissAndItsEntryIsDropped) {
  cxlkv::testing::TempRegionPath path("tier-corrupt");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(dir.File("kv.tier"), 16 * kSlot)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  Blocks b = PutChain(*o.cache, o.ns, 3, 8);
  ASSERT_EQ(*(*store)->Spill(~0ull), 8u);
  // Block 5's slot: find it in the index, flip one payload byte on disk.
  uint64_t slot = ~0ull;
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(*o.pool)) {
    if (e.key_lo == b.keys[5].lo && e.key_hi == b.keys[5].hi) slot = cache::LocationSlot(e.payload);
  }
  ASSERT_NE(slot, ~0ull);
  int fd = ::open(dir.File("kv.tier").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const off_t at = static_cast<off_t>(slot * 4096 /* its first 4 KiB unit */ + kSlotHeaderBytes + 1000);
  uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
  byte ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
  ::close(fd);

  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, b.keys), 5u);
  const nlohmann::json st = (*store)->Stats();
  EXPECT_EQ(st["devices"][0]["miss_corrupt"], 1u);
  EXPECT_EQ(st["dropped_lost"], 1u);
  // The whole run was brought in: blocks 6 and 7 are in the region, behind the gap.
  EXPECT_EQ(st["promoted"], 7u);
  EXPECT_EQ(st["devices"][0]["used_slots"], 0u);
  EXPECT_EQ(*o.cache->Exists(o.ns, b.keys), 5u);
  EXPECT_EQ(*o.cache->Exists(o.ns, std::span<const BlockKey>(b.keys).subspan(6)), 2u);
  service->reset();
  ExpectCheckClean(path.path());
}

// The owner's process ends; its next process adopts the SSD blocks (they read back identical)
// and the node-DRAM blocks, whose bytes died with the first process, are gone from the index.
TEST(Tiering, ANewOwnerProcessAdoptsSsdBlocksAndDropsTheDeadOnesDram) {
  cxlkv::testing::TempRegionPath path("tier-adopt");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  auto first = cxlkv::testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 1);
    CHILD_CHECK(o.cache, "open");
    auto store = TierStore::Open(*o.pool, Options({Dram(16 << 20), Ssd(file, 16 << 20)}));
    CHILD_CHECK(store.ok(), "%s", store.status().ToString().c_str());
    PutChain(*o.cache, o.ns, 4, 30);
    auto n = (*store)->Spill(~0ull);
    CHILD_CHECK(n.ok() && *n == 30, "spilled %llu", static_cast<unsigned long long>(n.ok() ? *n : 0));
    return 0;
  });
  ASSERT_EQ(first[0], 0);
  auto o = OpenCache(path.path(), 1);
  ASSERT_TRUE(o.cache);
  auto keys = o.cache->ChainKeys(o.ns, cxlkv::testing::Tokens(4, 16 * 30, 0, 0));
  auto store = TierStore::Open(*o.pool, Options({Dram(16 << 20), Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  auto tiers = EntriesByTier(*o.pool);
  EXPECT_EQ(tiers[cache::kTierMem], 0u) << "DRAM blocks of a dead process stayed indexed";
  ASSERT_GT(tiers[cache::kTierSsd], 0u);
  EXPECT_EQ((*store)->Stats()["adopted"], tiers[cache::kTierSsd]);
  // Every SSD block reads back identical (a lookup per block: the DRAM ones left gaps).
  const size_t read = ReadBackEach(*o.cache, o.ns, keys);
  EXPECT_EQ(read, tiers[cache::kTierSsd]);
  service->reset();
  ExpectCheckClean(path.path());
}

// A mover killed after it marked an entry EVICTING, or after it wrote the new place but before
// READY: the stripe's repair drops the half-moved entry, nothing else changes, every other
// block still reads back identical, and `cxlkv check` is clean.
void KilledMidMove(cache::Index::CrashPoint point, bool promote) {
  cxlkv::testing::TempRegionPath path("tier-kill");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  Child survivor = StartSurvivor(path.path());  // node 0: recovers the lives this test ends
  auto mover = cxlkv::testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 1);
    CHILD_CHECK(o.cache, "open");
    auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
    CHILD_CHECK(store.ok(), "%s", store.status().ToString().c_str());
    Blocks b = PutChain(*o.cache, o.ns, 5, 8);
    if (promote) {
      CHILD_CHECK(*(*store)->Spill(~0ull) == 8, "spill");
      o.pool->impl().index->TestCrashAt(point);
      (void)(*store)->Promote(b.keys);
    } else {
      o.pool->impl().index->TestCrashAt(point);
      (void)(*store)->Spill(~0ull);
    }
    return 3;
  });
  ASSERT_EQ(mover[0], 128 + SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * cxlkv::testing::kTestLeaseMs));
  auto o = OpenCache(path.path(), 1);  // node 1's next life: the new owner
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(*o.pool)) {
    EXPECT_EQ(cache::StateOf(e.state), cache::kReady) << "a half-moved entry stayed";
  }
  auto keys = o.cache->ChainKeys(o.ns, cxlkv::testing::Tokens(5, 16 * 8, 0, 0));
  const size_t present = ReadBackEach(*o.cache, o.ns, keys);
  // Only the block cut mid-move may go. A spill's copy was durable in the catalog before the
  // move began, so the restart may name it again (tier_restore.cc): then all 8 read back.
  EXPECT_GE(present, 7u) << "a block other than the one cut mid-move went";
  ASSERT_TRUE(survivor.Send(1));
  EXPECT_EQ(survivor.Wait(), 0);
  service->reset();
  store->reset();
  o.pool.reset();
  ExpectCheckClean(path.path());
}

TEST(Tiering, ASpillKilledAfterMarkingLeavesNoHalfMovedEntry) {
  KilledMidMove(cache::Index::CrashPoint::kMoveAfterMark, false);
}
TEST(Tiering, ASpillKilledAfterWritingThePlaceLeavesNoHalfMovedEntry) {
  KilledMidMove(cache::Index::CrashPoint::kMoveAfterFields, false);
}
TEST(Tiering, APromoteKilledAfterWritingThePlaceLeavesNoHalfMovedEntry) {
  KilledMidMove(cache::Index::CrashPoint::kMoveAfterFields, true);
}

// A mover stopped (SIGSTOP) after marking an entry EVICTING, past its lease: the survivor
// recovers its node's life and repairs the stripe. Resumed (SIGCONT), the mover fails its fence
// and writes nothing more: no block is moved by a life that ended, the entry cut mid-move is the
// only one gone, every other block reads back identical and the pool checks clean.
TEST(Tiering, AMoverPausedPastItsLeaseMovesNothingAfterItResumes) {
  cxlkv::testing::TempRegionPath path("tier-pause");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  Child survivor = StartSurvivor(path.path());  // node 0: recovers the lives this test ends
  uint64_t ready;
  Child mover = Child::Fork([&](int, int out) {
    auto o = OpenCache(path.path(), 1);
    if (!o.cache) return 101;
    auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
    if (!store.ok()) return 102;
    PutChain(*o.cache, o.ns, 9, 8);
    (void)cxlkv::testing::Put(out, 1);
    o.pool->impl().index->TestCrashAt(cache::Index::CrashPoint::kMovePauseAfterMark);
    auto moved = (*store)->Spill(~0ull);
    return moved.ok() ? static_cast<int>(*moved) : 100;  // moves made after the pause
  });
  ASSERT_TRUE(mover.Receive(&ready));
  int status = 0;
  ASSERT_EQ(::waitpid(mover.pid, &status, WUNTRACED), mover.pid);
  ASSERT_TRUE(WIFSTOPPED(status)) << "the mover did not stop at the move";
  std::this_thread::sleep_for(std::chrono::milliseconds(5 * cxlkv::testing::kTestLeaseMs));
  ::kill(mover.pid, SIGCONT);
  // The paused move is fenced; the process rejoins as a new life, whose moves of the other
  // stripes (under locks it then holds) are legitimate.
  EXPECT_LE(mover.Wait(), 7) << "the move paused past the lease went through";
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * cxlkv::testing::kTestLeaseMs));
  auto o = OpenCache(path.path(), 1);  // the owner's next process serves what reached the SSD
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(*o.pool)) {
    EXPECT_EQ(cache::StateOf(e.state), cache::kReady) << "a half-moved entry stayed";
  }
  auto keys = o.cache->ChainKeys(o.ns, cxlkv::testing::Tokens(9, 16 * 8, 0, 0));
  const size_t present = ReadBackEach(*o.cache, o.ns, keys);
  EXPECT_EQ(present, 7u) << "exactly the block cut mid-move may go";
  ASSERT_TRUE(survivor.Send(1));
  EXPECT_EQ(survivor.Wait(), 0);
  service->reset();
  store->reset();
  o.pool.reset();
  ExpectCheckClean(path.path());
}

// The catalog is what proves an SSD slot current: with its files gone (a lost disk's metadata,
// an operator's mistake), the next owner cannot vouch for any slot, drops every SSD entry, and
// serves nothing it cannot prove — `cxlkv check` stays clean.
TEST(Tiering, SsdBlocksTheCatalogCannotVouchForAreDroppedAtAdoption) {
  cxlkv::testing::TempRegionPath path("tier-unproven");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  auto first = cxlkv::testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 1);
    CHILD_CHECK(o.cache, "open");
    auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
    CHILD_CHECK(store.ok(), "%s", store.status().ToString().c_str());
    PutChain(*o.cache, o.ns, 8, 10);
    auto n = (*store)->Spill(~0ull);
    CHILD_CHECK(n.ok() && *n == 10, "spill");
    return 0;
  });
  ASSERT_EQ(first[0], 0);
  std::filesystem::remove(Catalog::LogPath(file));
  std::filesystem::remove(Catalog::CheckpointPath(file, 0));
  std::filesystem::remove(Catalog::CheckpointPath(file, 1));
  auto o = OpenCache(path.path(), 1);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(file, 16 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->Stats()["dropped_unproven"], 10u);
  EXPECT_EQ(EntriesByTier(*o.pool)[cache::kTierSsd], 0u);
  auto keys = o.cache->ChainKeys(o.ns, cxlkv::testing::Tokens(8, 16 * 10, 0, 0));
  EXPECT_EQ(*o.cache->Exists(o.ns, keys), 0u);
  EXPECT_EQ((*store)->Stats()["devices"][0]["used_slots"], 0u);
  ExpectCheckClean(path.path());
}

// The owner is killed (SIGKILL) at a random moment while it writes, spills and promotes; its next
// process adopts what survived. Every block the index still names reads back identical, nothing
// else is served, and the pool checks clean — over several random kill points.
TEST(Tiering, KillNineAtRandomPointsOfSpillAndPromoteThenRestart) {
  cxlkv::testing::TempRegionPath path("tier-kill9");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  Child survivor = StartSurvivor(path.path());  // node 0: recovers the lives this test ends
  uint64_t ready;
  std::mt19937_64 rng(14);
  std::vector<BlockKey> all;
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(round);
    const uint64_t doc = 100 + round;
    Child owner = Child::Fork([&](int, int out) {
      auto o = OpenCache(path.path(), 1);
      if (!o.cache) return 1;
      TierStoreOptions opts = Options({Dram(8 << 20), Ssd(file, 24 << 20)});
      opts.background = true;
      opts.spill_poll = std::chrono::milliseconds(1);
      auto store = TierStore::Open(*o.pool, opts);
      if (!store.ok()) return 2;
      auto service = StartTierService(*o.pool, **store);
      if (!service.ok()) return 3;
      (void)cxlkv::testing::Put(out, 1);
      for (uint64_t d = doc;; d += 10) {  // write, and read back older chains (promotes)
        Blocks b = PutChain(*o.cache, o.ns, d, 8);
        (void)LookupAndVerify(*o.cache, o.ns, b.keys);
        (void)(*store)->Spill(2 * kBlock);
      }
    });
    ASSERT_TRUE(owner.Receive(&ready));
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 400));
    ::kill(owner.pid, SIGKILL);
    EXPECT_EQ(owner.Wait(), 128 + SIGKILL);
    // Node 1's life ends with its only process: node 0 recovers it (its heap chunks included),
    // and the next owner is node 1's next life, as a restarted cxlkvd would be.
    std::this_thread::sleep_for(std::chrono::milliseconds(3 * cxlkv::testing::kTestLeaseMs));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * cxlkv::testing::kTestLeaseMs));
  auto o = OpenCache(path.path(), 1);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Dram(8 << 20), Ssd(file, 24 << 20)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  size_t named = 0, read = 0, stayed = 0;
  std::vector<uint8_t> back(kBlock);
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(*o.pool)) {
    EXPECT_EQ(cache::StateOf(e.state), cache::kReady);
    EXPECT_NE(e.tier, cache::kTierMem) << "a dead process's DRAM block is still named";
    ++named;
    const BlockKey k{e.key_lo, e.key_hi};
    auto hit = o.cache->Lookup(o.ns, {&k, 1});
    ASSERT_TRUE(hit.ok());
    if (hit->hit_blocks == 0) {
      // Reading the others brings them in, which spills, which may fill a device and drop its
      // LRU blocks: a block not hit is then gone from the index — or still on its tier when the
      // region had no room to bring it in (a counted promote miss), never named and unreadable.
      if (*o.cache->Exists(o.ns, {&k, 1}) != 0) ++stayed;
      continue;
    }
    ASSERT_TRUE(o.cache->Read(hit->pins[0], 0, back.data(), back.size()).ok());
    EXPECT_TRUE(cxlkv::testing::MatchesKey(k, back.data(), back.size()));
    o.cache->Release(hit->pins);
    ++read;
  }
  EXPECT_GT(named, 0u);
  EXPECT_GT(read, named / 2);
  // No read ever met an invalid slot, and the catalog vouched for every SSD slot the index named.
  const nlohmann::json st = (*store)->Stats();
  EXPECT_EQ(st["dropped_lost"], 0u) << st.dump();
  EXPECT_LE(stayed, st["promote_missed"].get<uint64_t>()) << st.dump();
  EXPECT_EQ(st["dropped_unproven"], 0u) << st.dump();
  for (const auto& d : st["devices"]) {
    EXPECT_EQ(d["miss_empty"].get<uint64_t>() + d["miss_corrupt"].get<uint64_t>() + d["miss_stale"].get<uint64_t>(), 0u)
        << d.dump();
  }
  ASSERT_TRUE(survivor.Send(1));
  EXPECT_EQ(survivor.Wait(), 0);
  service->reset();
  store->reset();
  o.pool.reset();
  ExpectCheckClean(path.path());
}

// Node 1 owns the tiers and serves them; node 0 (another process) looks the chain up and reads
// every block, brought into the region by node 1's service: the shared memory is the transport.
TEST(Tiering, AnotherNodesBlocksAreBroughtInThroughItsService) {
  cxlkv::testing::TempRegionPath path("tier-remote");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  Child owner = Child::Fork([&](int in, int out) {
    auto o = OpenCache(path.path(), 1);
    if (!o.cache) return 1;
    auto store = TierStore::Open(*o.pool, Options({Dram(8 << 20), Ssd(file, 16 << 20)}));
    if (!store.ok()) return 2;
    auto service = StartTierService(*o.pool, **store);
    if (!service.ok()) return 3;
    PutChain(*o.cache, o.ns, 6, 24);
    auto n = (*store)->Spill(~0ull);
    if (!n.ok() || *n != 24) return 4;
    (void)cxlkv::testing::Put(out, 1);
    uint64_t done;
    (void)cxlkv::testing::Get(in, &done);
    const nlohmann::json st = (*store)->Stats();
    return st["promoted"] == 24u ? 0 : 5;
  });
  uint64_t ready = 0;
  ASSERT_TRUE(owner.Receive(&ready));
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto keys = o.cache->ChainKeys(o.ns, cxlkv::testing::Tokens(6, 16 * 24, 0, 0));
  EXPECT_EQ(EntriesByTier(*o.pool)[cache::kTierRegion], 0u);
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, keys), 24u);
  ASSERT_TRUE(owner.Send(1));
  EXPECT_EQ(owner.Wait(), 0);
}

// The spill thread keeps the region under its watermark while a writer puts twice the region's
// capacity; every block still indexed reads back identical, and most were kept (spilled, not
// dropped).
TEST(Tiering, TheSpillThreadMakesRoomAheadOfWriters) {
  cxlkv::testing::TempRegionPath path("tier-thread");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 32 << 20, 2048).ok());
  testing::ScratchDir dir;
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  TierStoreOptions opts = Options({Dram(32 << 20), Ssd(dir.File("kv.tier"), 32 << 20)});
  opts.background = true;
  opts.spill_poll = std::chrono::milliseconds(1);
  auto store = TierStore::Open(*o.pool, opts);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  std::vector<BlockKey> all;
  for (uint64_t doc = 10; doc < 26; ++doc) {
    Blocks b = PutChain(*o.cache, o.ns, doc, 16);  // 16 × 256 KiB = 4 MiB a chain, 64 MiB in all
    all.insert(all.end(), b.keys.begin(), b.keys.end());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GT((*store)->Stats()["spilled"].get<uint64_t>(), 100u);
  const size_t present = ReadBackEach(*o.cache, o.ns, all);
  EXPECT_GT(present, all.size() / 2) << "most blocks should have been spilled, not dropped";
  service->reset();
  store->reset();
  ExpectCheckClean(path.path());
}

TEST(Tiering, AMissingDevicePathFailsAtOpenWithWhatToDo) {
  cxlkv::testing::TempRegionPath path("tier-badpath");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd("/nonexistent-dir/kv.tier", 16 << 20)}));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kNotFound);
  EXPECT_NE(store.status().message().find("tier 0 (ssd)"), std::string::npos) << store.status().ToString();
  EXPECT_NE(store.status().message().find("create the directory"), std::string::npos) << store.status().ToString();
  auto none = TierStore::Open(*o.pool, Options({}));
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
}

// Reads every key of `keys` that is cached (bringing it in from the tier) and checks its bytes;
// returns how many were. `bytes` is the namespace's block size.
size_t ReadBackSized(KvCache& cache, const NamespaceHandle& ns, const std::vector<BlockKey>& keys, uint64_t bytes) {
  size_t hits = 0;
  std::vector<uint8_t> back(bytes);
  for (const BlockKey& k : keys) {
    auto hit = cache.Lookup(ns, {&k, 1});
    EXPECT_TRUE(hit.ok()) << hit.status().ToString();
    if (!hit.ok() || hit->hit_blocks == 0) continue;
    EXPECT_EQ(hit->pins[0].bytes, bytes);
    EXPECT_TRUE(cache.Read(hit->pins[0], 0, back.data(), back.size()).ok());
    EXPECT_TRUE(cxlkv::testing::MatchesKey(k, back.data(), back.size())) << "a block of " << bytes << " bytes differs";
    cache.Release(hit->pins);
    ++hits;
  }
  return hits;
}

// Three models' block sizes spilled to one SSD tier past its size: each takes a slot of its own
// size, so the tier holds far more than its count of largest slots, every block cached reads
// back identical, and a store opened again on the file serves them from its catalog.
TEST(Tiering, ThreeBlockSizesShareAnSsdTierEachInASlotOfItsSize) {
  cxlkv::testing::TempRegionPath path("tier-sizes");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  const uint64_t sizes[] = {20 << 10, 100'000, kBlock};
  std::vector<NamespaceHandle> ns;
  for (int m = 0; m < 3; ++m) {
    auto h = o.cache->Namespace(cxlkv::testing::TestNamespace("size-" + std::to_string(m)));
    ASSERT_TRUE(h.ok());
    ns.push_back(*h);
  }
  const uint64_t tier_bytes = 8 * kSlot;  // 8 largest slots
  std::vector<std::vector<BlockKey>> keys(3);
  {
    auto store = TierStore::Open(*o.pool, Options({Ssd(dir.File("kv.tier"), tier_bytes)}));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto service = StartTierService(*o.pool, **store);
    ASSERT_TRUE(service.ok());
    std::vector<uint8_t> data(kBlock);
    for (uint64_t i = 0; i < 24; ++i) {
      for (int m = 0; m < 3; ++m) {
        const BlockKey k{0x5123000 + i, 0x77 + uint64_t(m)};
        cxlkv::testing::FillForKey(k, data.data(), sizes[m]);
        ASSERT_TRUE(o.cache->Put(ns[m], k, data.data(), sizes[m]).ok());
        keys[m].push_back(k);
      }
      ASSERT_TRUE((*store)->Spill(~0ull).ok());  // everything to the tier, the oldest dropped from it
    }
    const nlohmann::json dev = (*store)->Stats()["devices"][0];
    EXPECT_GT(dev["used_slots"].get<uint64_t>(), 8u) << dev.dump();
    EXPECT_GE(dev["used_bytes"].get<double>(), 0.9 * dev["capacity_bytes"].get<double>()) << dev.dump();
    for (int m = 0; m < 3; ++m) EXPECT_GT(ReadBackSized(*o.cache, ns[m], keys[m], sizes[m]), 0u) << "size " << m;
    ASSERT_TRUE((*store)->Spill(~0ull).ok());  // back to the tier before the restart
    service->reset();
  }
  auto store = TierStore::Open(*o.pool, Options({Ssd(dir.File("kv.tier"), tier_bytes)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  size_t served = 0;
  for (int m = 0; m < 3; ++m) served += ReadBackSized(*o.cache, ns[m], keys[m], sizes[m]);
  EXPECT_GT(served, 8u) << "a store opened again serves what its catalog names";
  service->reset();
  ExpectCheckClean(path.path());
}

}  // namespace
}  // namespace cxlkv::tier
