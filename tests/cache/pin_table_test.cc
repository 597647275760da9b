// Pin tables (docs/protocol.md, "Pins"): a lookup pins its chain in consecutive words of its
// node's table before it probes; what it pins, what it gives back, what a full table does, and
// what a dead process of a live node leaves (nothing).
#include <signal.h>

#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cache_test_util.h"
#include "child.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::Child;
using testing::OpenCache;

uint64_t PinsOf(Pool& pool, uint32_t node) {
  auto stat = cache::Stat(*pool.impl().regions[0], std::vector<cache::NodeStatus>(8, cache::NodeStatus::kLive));
  const auto& row = stat["per_node"][std::to_string(node)];
  return row.is_null() ? 0 : row["pins"].get<uint64_t>();
}

Status PutChain(KvCache& cache, const NamespaceHandle& ns, std::span<const BlockKey> keys, uint64_t bytes) {
  std::vector<uint8_t> data(bytes);
  for (const BlockKey& k : keys) {
    testing::FillForKey(k, data.data(), bytes);
    CXLKV_RETURN_IF_ERROR(cache.Put(ns, k, data.data(), bytes));
  }
  return Status::Ok();
}

// A pool whose node 0 this process opens, with a chain of `blocks` blocks put in it.
struct ChainPool {
  ChainPool(const char* tag, uint32_t seed, size_t blocks, uint64_t bytes) : path(tag) {
    EXPECT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
    o = OpenCache(path.path(), 0);
    EXPECT_TRUE(o.cache);
    if (!o.cache) return;
    keys = o.cache->ChainKeys(o.ns, testing::Tokens(seed, 16 * blocks, 0, 0));
    EXPECT_EQ(keys.size(), blocks);
    EXPECT_TRUE(PutChain(*o.cache, o.ns, keys, bytes).ok());
  }
  // How many of `some` an eviction takes (only unpinned blocks go).
  uint64_t Evict(std::span<const BlockKey> some) {
    auto n = o.cache->Evict(o.ns, some);
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    return n.ok() ? *n : ~uint64_t{0};
  }
  testing::TempRegionPath path;
  testing::Opened o;
  std::vector<BlockKey> keys;
};

// Exactly the hit is pinned: the keys past the first miss are written before the probe and
// given back after it, so a block put there later is evictable; release leaves no pin.
TEST(PinTable, ExactlyTheHitStaysPinnedAndReleaseLeavesNone) {
  ChainPool f("pins-hit", 5, 100, 1024);
  ASSERT_TRUE(f.o.cache);
  // Only the first 70 are in the pool: the 30 after them were put, then evicted.
  ASSERT_EQ(f.Evict(std::span(f.keys).subspan(70)), 30u);
  auto hit = f.o.cache->Lookup(f.o.ns, f.keys);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  ASSERT_EQ(hit->hit_blocks, 70u);
  EXPECT_EQ(PinsOf(*f.o.pool, 0), 70u);
  // Past the hit: put now, and evictable at once (no word of the lookup holds it).
  ASSERT_TRUE(PutChain(*f.o.cache, f.o.ns, std::span(f.keys).subspan(70, 1), 1024).ok());
  EXPECT_EQ(f.Evict(std::span(f.keys).subspan(70, 1)), 1u) << "a key past the hit stayed pinned";
  // In the hit: none goes while pinned.
  EXPECT_EQ(f.Evict(std::span(f.keys).first(70)), 0u) << "a pinned block was evicted";
  for (size_t i = 0; i < 70; ++i) {
    std::vector<uint8_t> back(1024);
    ASSERT_TRUE(f.o.cache->Read(hit->pins[i], 0, back.data(), back.size()).ok());
    ASSERT_TRUE(testing::MatchesKey(f.keys[i], back.data(), back.size())) << i;
  }
  // Release in two parts, out of order: each pin goes exactly once.
  std::vector<BlockPin> last(hit->pins.begin() + 30, hit->pins.end());
  f.o.cache->Release(last);
  EXPECT_EQ(PinsOf(*f.o.pool, 0), 30u);
  f.o.cache->Release(std::span(hit->pins).first(30));
  EXPECT_EQ(PinsOf(*f.o.pool, 0), 0u);
  EXPECT_EQ(f.Evict(std::span(f.keys).first(70)), 70u);
}

// Two lookups of one chain hold two pins each; the block goes only when both are released.
TEST(PinTable, EveryLookupHoldsItsOwnPin) {
  ChainPool f("pins-twice", 6, 4, 2048);
  ASSERT_TRUE(f.o.cache);
  auto a = f.o.cache->Lookup(f.o.ns, f.keys);
  auto b = f.o.cache->Lookup(f.o.ns, f.keys);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(PinsOf(*f.o.pool, 0), 8u);
  f.o.cache->Release(a->pins);
  EXPECT_EQ(f.Evict(f.keys), 0u) << "released once, pinned twice: still pinned";
  f.o.cache->Release(b->pins);
  EXPECT_EQ(f.Evict(f.keys), 4u);
}

// A node's table holds pin_pages × 63 pins. A lookup that finds it nearly full pins a shorter
// prefix; one that finds it full is refused by name; released pins make room again.
TEST(PinTable, AFullTablePinsAShorterPrefixThenRefusesByName) {
  ChainPool f("pins-full", 7, 100, 512);
  ASSERT_TRUE(f.o.cache);
  auto& o = f.o;
  const auto& keys = f.keys;
  const uint64_t capacity = uint64_t{cache::PinPagesFor(1024)} * cache::kPinsPerPage;
  ASSERT_EQ(capacity, 64u * 63u);
  std::vector<LookupResult> held;
  for (uint64_t i = 0; i < capacity / 100; ++i) {
    auto hit = o.cache->Lookup(o.ns, keys);
    ASSERT_TRUE(hit.ok()) << i << ": " << hit.status().ToString();
    ASSERT_EQ(hit->hit_blocks, 100u) << i;
    held.push_back(std::move(*hit));
  }
  auto shorter = o.cache->Lookup(o.ns, keys);
  ASSERT_TRUE(shorter.ok()) << shorter.status().ToString();
  EXPECT_EQ(shorter->hit_blocks, capacity % 100) << "the rest of the table, and no more";
  {
    // Counted as asked: the keys the table had no room for count as missed, not as unasked.
    auto stat = cache::Stat(*o.pool->impl().regions[0], std::vector<cache::NodeStatus>(8, cache::NodeStatus::kLive));
    const uint64_t lookups = held.size() + 1;
    EXPECT_EQ(stat["totals"]["lookup_blocks"].get<uint64_t>(), 100 * lookups);
    EXPECT_EQ(stat["totals"]["miss_blocks"].get<uint64_t>(), 100 - capacity % 100);
  }
  auto refused = o.cache->Lookup(o.ns, keys);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(refused.status().message(), HasSubstr("pin table is full"));
  EXPECT_THAT(refused.status().message(), HasSubstr("release pins"));
  // Exists pins nothing, so it still answers.
  auto exists = o.cache->Exists(o.ns, keys);
  ASSERT_TRUE(exists.ok());
  EXPECT_EQ(*exists, 100u);
  o.cache->Release(shorter->pins);
  for (auto& h : held) o.cache->Release(h.pins);
  EXPECT_EQ(PinsOf(*o.pool, 0), 0u);
  auto again = o.cache->Lookup(o.ns, keys);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->hit_blocks, 100u);
  o.cache->Release(again->pins);
}

// A process of a live node killed (-9) while it holds pins leaves none: the node's surviving
// process reclaims its slot, pin pages included, and another node can evict the blocks.
TEST(PinTable, ADeadProcessOfALiveNodeLeavesNoPins) {
  CXLKV_DECENTRALIZED_ONLY("a central service holds the pins of its clients; the service's reclaim is tested in meta");
  testing::TempRegionPath path("pins-dead");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  const auto tokens = testing::Tokens(8, 16 * 40, 0, 0);
  Child keeper = Child::Fork([&](int in, int out) {  // node 1's survivor
    auto o = OpenCache(path.path(), 1);
    if (!o.cache || !testing::Put(out, 1)) return 1;
    uint64_t done;
    (void)testing::Get(in, &done);
    return 0;
  });
  Child pinner = Child::Fork([&](int in, int out) {  // a second process of node 1
    uint64_t go;
    if (!testing::Get(in, &go)) return 1;  // the chain is in the pool
    auto p = OpenCache(path.path(), 1);
    if (!p.cache) return 2;
    auto hit = p.cache->Lookup(p.ns, p.cache->ChainKeys(p.ns, tokens));
    if (!hit.ok() || hit->hit_blocks != 40) return 3;
    (void)testing::Put(out, 1);
    for (;;) ::pause();  // holds the pins until killed
  });
  uint64_t ready;
  ASSERT_TRUE(keeper.Receive(&ready));
  auto o = OpenCache(path.path(), 0);  // threads only after every fork
  ASSERT_TRUE(o.cache);
  auto keys = o.cache->ChainKeys(o.ns, tokens);
  ASSERT_TRUE(PutChain(*o.cache, o.ns, keys, 1024).ok());
  ASSERT_TRUE(pinner.Send(1));
  ASSERT_TRUE(pinner.Receive(&ready));
  EXPECT_EQ(PinsOf(*o.pool, 1), 40u);
  auto evicted = o.cache->Evict(o.ns, keys);
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 0u) << "another node's pins did not hold";
  ::kill(pinner.pid, SIGKILL);
  EXPECT_EQ(pinner.Wait(), 128 + SIGKILL);
  uint64_t pins = 40;
  for (int i = 0; i < 40 && pins != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(testing::kTestLeaseMs / 2));
    pins = PinsOf(*o.pool, 1);
  }
  EXPECT_EQ(pins, 0u) << "the dead process's pins outlived it";
  evicted = o.cache->Evict(o.ns, keys);
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 40u);
  ASSERT_TRUE(keeper.Send(1));
  EXPECT_EQ(keeper.Wait(), 0);
  o.pool.reset();
  auto regions = pool::AttachAll({path.path()});
  ASSERT_TRUE(regions.ok());
  for (const auto& p : pool::Check(*regions)) ADD_FAILURE() << p;
}

// A pinner paused (SIGSTOP) past its lease: its node is declared dead and recovery gives its
// pin pages back, so its blocks can go. Resumed, it runs as a new life: its new pins hold, and
// releasing the pins of its old life touches none of them.
TEST(PinTable, APinnerPausedPastItsLeaseLosesItsPinsAndItsOldReleaseTouchesNothing) {
  CXLKV_DECENTRALIZED_ONLY("a paused client's requests are refused by the service (meta tests)");
  testing::TempRegionPath path("pins-paused");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  const auto tokens = testing::Tokens(9, 16 * 40, 0, 0);
  Child pinner = Child::Fork([&](int in, int out) {  // node 1, alone
    uint64_t cmd;
    if (!testing::Get(in, &cmd)) return 1;
    auto p = OpenCache(path.path(), 1);
    if (!p.cache) return 2;
    auto keys = p.cache->ChainKeys(p.ns, tokens);
    auto old = p.cache->Lookup(p.ns, keys);
    if (!old.ok() || old->hit_blocks != 40) return 3;
    (void)testing::Put(out, 1);
    if (!testing::Get(in, &cmd)) return 4;  // resumed
    Result<LookupResult> fresh = Busy("not yet");
    for (int i = 0; i < 200; ++i) {  // until the heartbeat has rejoined as a new life
      fresh = p.cache->Lookup(p.ns, keys);
      if (fresh.ok()) break;
      if (fresh.status().code() != StatusCode::kLeaseExpired) return 5;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!fresh.ok()) return 6;
    p.cache->Release(old->pins);  // the old life's: must touch nothing
    (void)testing::Put(out, fresh->hit_blocks);
    if (!testing::Get(in, &cmd)) return 7;
    p.cache->Release(fresh->pins);
    (void)testing::Put(out, 1);
    (void)testing::Get(in, &cmd);
    return 0;
  });
  auto o = OpenCache(path.path(), 0);  // node 0 manages and recovers node 1
  ASSERT_TRUE(o.cache);
  auto keys = o.cache->ChainKeys(o.ns, tokens);
  ASSERT_TRUE(PutChain(*o.cache, o.ns, keys, 1024).ok());
  uint64_t reply;
  ASSERT_TRUE(pinner.Send(1));
  ASSERT_TRUE(pinner.Receive(&reply));
  EXPECT_EQ(PinsOf(*o.pool, 1), 40u);
  ::kill(pinner.pid, SIGSTOP);
  uint64_t pins = 40;
  for (int i = 0; i < 60 && pins != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(testing::kTestLeaseMs / 2));
    pins = PinsOf(*o.pool, 1);
  }
  EXPECT_EQ(pins, 0u) << "the paused life's pins outlived its lease";
  auto evicted = o.cache->Evict(o.ns, std::span(keys).subspan(30));
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 10u);
  ::kill(pinner.pid, SIGCONT);
  ASSERT_TRUE(pinner.Send(1));
  ASSERT_TRUE(pinner.Receive(&reply));
  EXPECT_EQ(reply, 30u);
  EXPECT_EQ(PinsOf(*o.pool, 1), 30u) << "releasing the old life's pins took the new life's";
  evicted = o.cache->Evict(o.ns, std::span(keys).first(30));
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 0u) << "the new life's pins did not hold";
  ASSERT_TRUE(pinner.Send(1));
  ASSERT_TRUE(pinner.Receive(&reply));
  evicted = o.cache->Evict(o.ns, std::span(keys).first(30));
  ASSERT_TRUE(evicted.ok());
  EXPECT_EQ(*evicted, 30u);
  ASSERT_TRUE(pinner.Send(1));
  EXPECT_EQ(pinner.Wait(), 0);
  o.pool.reset();
  auto regions = pool::AttachAll({path.path()});
  ASSERT_TRUE(regions.ok());
  for (const auto& p : pool::Check(*regions)) ADD_FAILURE() << p;
}

}  // namespace
}  // namespace cxlkv
