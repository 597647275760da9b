// The prefix cache's API in one process: keys, publish/lookup/read, duplicates, aborts,
// eviction order, pins, checksums, and every refusal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cache_test_util.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::FillForKey;
using testing::MatchesKey;
using testing::OpenOrNull;

struct Fixture {
  explicit Fixture(const std::string& tag, uint64_t size = 64 << 20, uint32_t entries = 0, bool checksum = false)
      : path(tag) {
    Status s = testing::CreateCachePool(path.path(), size, entries, checksum);
    EXPECT_TRUE(s.ok()) << s.ToString();
    pool = OpenOrNull({path.path()}, 0);
    auto c = pool->Cache();
    EXPECT_TRUE(c.ok());
    cache = *c;
    auto n = cache->Namespace(testing::TestNamespace());
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    ns = *n;
  }
  Status PutFor(const BlockKey& k, uint64_t bytes) {
    std::vector<uint8_t> data(bytes);
    FillForKey(k, data.data(), bytes);
    return cache->Put(ns, k, data.data(), bytes);
  }
  testing::TempRegionPath path;
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  NamespaceHandle ns;
};

TEST(CacheKeys, ChainsShareExactlyTheCommonPrefix) {
  Fixture f("keys");
  auto a = testing::Tokens(1, 64, 10, 40);  // 6 full blocks (4 shared), 8 tokens left over
  auto b = testing::Tokens(1, 64, 11, 40);
  auto ka = f.cache->ChainKeys(f.ns, a);
  auto kb = f.cache->ChainKeys(f.ns, b);
  ASSERT_EQ(ka.size(), 6u);
  ASSERT_EQ(kb.size(), 6u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(ka[i], kb[i]) << i;
  for (int i = 4; i < 6; ++i) EXPECT_NE(ka[i], kb[i]) << i;
  EXPECT_EQ(f.cache->ChainKeys(f.ns, a), ka);  // deterministic
  // A change in block 0 changes every later key: a key names its whole prefix.
  auto c = a;
  c[3] ^= 1;
  auto kc = f.cache->ChainKeys(f.ns, c);
  for (int i = 0; i < 6; ++i) EXPECT_NE(ka[i], kc[i]) << i;
  // Another model, layout or extra key never shares a key.
  auto other_model = f.cache->Namespace(testing::TestNamespace("other-model"));
  KeyNamespace lora = testing::TestNamespace();
  lora.extra_key = "lora-7";
  auto with_lora = f.cache->Namespace(lora);
  KeyNamespace tp = testing::TestNamespace("tp-model");
  tp.layout.tp_size = 2;
  KeyNamespace tp1 = tp;
  tp1.layout.tp_rank = 1;
  auto r0 = f.cache->Namespace(tp);
  auto r1 = f.cache->Namespace(tp1);
  ASSERT_TRUE(other_model.ok() && with_lora.ok() && r0.ok() && r1.ok());
  EXPECT_NE(f.cache->ChainKeys(*other_model, a)[0], ka[0]);
  EXPECT_NE(f.cache->ChainKeys(*with_lora, a)[0], ka[0]);
  EXPECT_NE(f.cache->ChainKeys(*r0, a)[0], f.cache->ChainKeys(*r1, a)[0]);
  EXPECT_NE(r0->id, r1->id);
  // Registering again finds the same slot.
  auto again = f.cache->Namespace(testing::TestNamespace());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->id, f.ns.id);
}

TEST(Cache, PutLookupReadReleaseRoundTrip) {
  Fixture f("roundtrip");
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(2, 16 * 8, 0, 0));
  ASSERT_EQ(keys.size(), 8u);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(f.PutFor(keys[i], 4096 * (i + 1)).ok());
  auto hit = f.cache->Lookup(f.ns, keys);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  ASSERT_EQ(hit->hit_blocks, 5u);  // the longest READY prefix
  for (int i = 0; i < 5; ++i) {
    const BlockPin& p = hit->pins[i];
    EXPECT_EQ(p.bytes, 4096u * (i + 1));
    std::vector<uint8_t> out(p.bytes);
    ASSERT_TRUE(f.cache->Read(p, 0, out.data(), p.bytes).ok());
    EXPECT_TRUE(MatchesKey(keys[i], out.data(), p.bytes)) << i;
  }
  // A hole stops the prefix even when later blocks are cached.
  ASSERT_TRUE(f.PutFor(keys[6], 4096).ok());
  auto exists = f.cache->Exists(f.ns, keys);
  ASSERT_TRUE(exists.ok());
  EXPECT_EQ(*exists, 5u);
  f.cache->Release(hit->pins);
  auto& index = *f.pool->impl().index;
  auto stat = cache::Stat(*f.pool->impl().regions[0], {cache::NodeStatus::kLive});
  EXPECT_EQ(stat["per_node"]["0"]["pins"].get<uint64_t>(), 0u);
  EXPECT_EQ(stat["totals"]["lookups"].get<uint64_t>(), 1u);  // Exists is not a lookup
  EXPECT_EQ(stat["totals"]["hit_blocks"].get<uint64_t>(), 5u);
  EXPECT_EQ(stat["totals"]["hit_tokens"].get<uint64_t>(), 80u);
  EXPECT_EQ(stat["totals"]["lookup_blocks"].get<uint64_t>(), 8u);
  EXPECT_EQ(stat["states"]["ready"].get<uint64_t>(), 6u);
  (void)index;
}

TEST(Cache, DuplicateAndRacingInsertsAreRefusedClearly) {
  Fixture f("dup");
  BlockKey k = f.cache->ChainKeys(f.ns, testing::Tokens(3, 16, 0, 0))[0];
  auto r = f.cache->Reserve(f.ns, k, 8192);
  ASSERT_TRUE(r.ok());
  auto again = f.cache->Reserve(f.ns, k, 8192);
  EXPECT_EQ(again.status().code(), StatusCode::kBusy);
  EXPECT_THAT(again.status().message(), HasSubstr("being written by node 0"));
  auto none = f.cache->Lookup(f.ns, {&k, 1});  // WRITING is invisible
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->hit_blocks, 0u);
  std::vector<uint8_t> data(8192);
  FillForKey(k, data.data(), data.size());
  ASSERT_TRUE(f.cache->Write(*r, 0, data.data(), 4096).ok());
  ASSERT_TRUE(f.cache->Write(*r, 4096, data.data() + 4096, 4096).ok());
  EXPECT_EQ(f.cache->Write(*r, 4096, data.data(), 8192).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(f.cache->Commit(*r).ok());
  EXPECT_EQ(f.cache->Commit(*r).code(), StatusCode::kInvalidArgument);  // once only
  EXPECT_EQ(f.cache->Reserve(f.ns, k, 8192).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(f.PutFor(k, 8192).code(), StatusCode::kAlreadyExists);
}

TEST(Cache, AbortFreesTheSpaceAndTheSlot) {
  Fixture f("abort");
  auto regions = pool::AttachAll({f.path.path()});
  ASSERT_TRUE(regions.ok());
  auto allocated = [&] { return alloc::InspectChunks(*(*regions)[0], 8).allocated_bytes; };
  uint64_t before = allocated();
  BlockKey k = f.cache->ChainKeys(f.ns, testing::Tokens(4, 16, 0, 0))[0];
  auto r = f.cache->Reserve(f.ns, k, 4 << 20);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(allocated(), before + (4 << 20));
  ASSERT_TRUE(f.cache->Abort(*r).ok());
  EXPECT_EQ(allocated(), before);
  EXPECT_TRUE(f.PutFor(k, 4096).ok());  // the key is free again
  EXPECT_TRUE(testing::LiveEntries(*f.pool).size() == 1);
}

TEST(Cache, EvictsLeastRecentlyUsedAndNeverAPinnedBlock) {
  // 64 MiB region: about 29 chunks of 2 MiB for data; blocks of 2 MiB.
  Fixture f("lru");
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(5, 16 * 64, 0, 0));
  const uint64_t cap = f.pool->impl().index->capacity();
  const uint64_t n = cap / (2 << 20);
  ASSERT_GT(n, 10u);
  ASSERT_LT(n, keys.size());
  // Fill to the high watermark, one block at a time, with distinct access times.
  size_t filled = 0;
  for (; filled < n * 9 / 10; ++filled) ASSERT_TRUE(f.PutFor(keys[filled], 2 << 20).ok()) << filled;
  // Touch block 0 (pin + release: a recent access); pin block 1 and keep it pinned.
  auto hit0 = f.cache->Lookup(f.ns, {&keys[0], 1});
  ASSERT_EQ(hit0->hit_blocks, 1u);
  f.cache->Release(hit0->pins);
  auto pinned = f.cache->Lookup(f.ns, {&keys[0], 2});
  ASSERT_EQ(pinned->hit_blocks, 2u);
  f.cache->Release({&pinned->pins[0], 1});
  // Overflow: eviction runs down to the low watermark, oldest first.
  for (size_t i = filled; i < filled + 6; ++i) ASSERT_TRUE(f.PutFor(keys[i], 2 << 20).ok()) << i;
  auto present = [&](size_t i) { return *f.cache->Exists(f.ns, {&keys[i], 1}) == 1; };
  EXPECT_TRUE(present(0)) << "recently used block evicted";
  EXPECT_TRUE(present(1)) << "pinned block evicted";
  EXPECT_FALSE(present(2)) << "oldest unpinned block kept";
  EXPECT_TRUE(present(filled + 5)) << "newest block evicted";
  // Explicit eviction spares the pinned block too.
  EXPECT_EQ(*f.cache->Evict(f.ns, {&keys[1], 1}), 0u);
  auto all = f.cache->EvictAll();
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(present(1));
  std::vector<uint8_t> out(2 << 20);
  ASSERT_TRUE(f.cache->Read(pinned->pins[1], 0, out.data(), out.size()).ok());
  EXPECT_TRUE(MatchesKey(keys[1], out.data(), out.size()));
  f.cache->Release({&pinned->pins[1], 1});
  EXPECT_EQ(*f.cache->EvictAll(), 1u);
  auto stat = cache::Stat(*f.pool->impl().regions[0], {cache::NodeStatus::kLive});
  EXPECT_EQ(stat["states"]["ready"].get<uint64_t>(), 0u);
  EXPECT_GE(stat["totals"]["evictions"].get<uint64_t>(), 3u);
}

TEST(Cache, FullPoolOfPinnedBlocksFailsFastWithPoolFull) {
  Fixture f("full");
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(6, 16 * 64, 0, 0));
  size_t stored = 0;
  std::vector<BlockPin> pins;
  for (; stored < keys.size(); ++stored) {
    Status s = f.PutFor(keys[stored], 2 << 20);
    if (s.code() == StatusCode::kNoSpace) break;
    ASSERT_TRUE(s.ok()) << s.ToString();
    auto hit = f.cache->Lookup(f.ns, {&keys[stored], 1});  // pin everything we store
    ASSERT_EQ(hit->hit_blocks, 1u);
    pins.push_back(hit->pins[0]);
  }
  ASSERT_LT(stored, keys.size());
  Status s = f.PutFor(keys[stored], 2 << 20);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_THAT(s.message(), HasSubstr("pool full"));
  // Nothing pinned was touched.
  std::vector<uint8_t> out(2 << 20);
  for (size_t i = 0; i < pins.size(); ++i) {
    ASSERT_TRUE(f.cache->Read(pins[i], 0, out.data(), out.size()).ok());
    ASSERT_TRUE(MatchesKey(keys[i], out.data(), out.size())) << i;
  }
  f.cache->Release(pins);
  EXPECT_TRUE(f.PutFor(keys[stored], 2 << 20).ok());  // now eviction makes room
}

TEST(Cache, BadInputGetsAClearErrorAndChangesNothing) {
  Fixture f("bad", 32 << 20);
  BlockKey k = f.cache->ChainKeys(f.ns, testing::Tokens(7, 16, 0, 0))[0];
  // Missing key: a miss, not an error.
  auto miss = f.cache->Lookup(f.ns, {&k, 1});
  ASSERT_TRUE(miss.ok());
  EXPECT_EQ(miss->hit_blocks, 0u);
  // Larger than the pool.
  auto huge = f.cache->Reserve(f.ns, k, uint64_t{1} << 30);
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("larger than the cache's capacity"));
  EXPECT_EQ(f.cache->Reserve(f.ns, k, 0).status().code(), StatusCode::kInvalidArgument);
  // A layout that fixes the block size refuses other sizes.
  KeyNamespace fixed = testing::TestNamespace("fixed");
  fixed.layout.num_layers = 2;
  fixed.layout.num_kv_heads = 2;
  fixed.layout.head_size = 64;
  auto fns = f.cache->Namespace(fixed);
  ASSERT_TRUE(fns.ok());
  EXPECT_EQ(fns->block_bytes, 2u * 2 * 16 * 2 * 64 * 2);
  auto wrong = f.cache->Reserve(*fns, k, 4096);
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("does not match the namespace's KV layout"));
  // Same model and rank, another layout: refused.
  KeyNamespace other = fixed;
  other.layout.dtype = KvDtype::kFp8;
  auto mismatch = f.cache->Namespace(other);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kVersionMismatch);
  EXPECT_THAT(mismatch.status().message(), HasSubstr("registered in this pool with KV layout"));
  // A key of one namespace used in another.
  ASSERT_TRUE(f.PutFor(k, 4096).ok());
  auto cross = f.cache->Lookup(*fns, {&k, 1});
  EXPECT_EQ(cross.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(cross.status().message(), HasSubstr("namespace-specific"));
  // A handle that was never registered.
  NamespaceHandle forged = f.ns;
  forged.seed.lo ^= 1;
  EXPECT_EQ(f.cache->Lookup(forged, {&k, 1}).status().code(), StatusCode::kInvalidArgument);
  forged.id = 999;
  EXPECT_EQ(f.cache->Reserve(forged, k, 64).status().code(), StatusCode::kInvalidArgument);
  // Invalid namespaces.
  EXPECT_EQ(f.cache->Namespace(testing::TestNamespace("")).status().code(), StatusCode::kInvalidArgument);
  KeyNamespace bad_tp = testing::TestNamespace("m");
  bad_tp.layout.tp_rank = 2;
  bad_tp.layout.tp_size = 2;
  EXPECT_EQ(f.cache->Namespace(bad_tp).status().code(), StatusCode::kInvalidArgument);
  // Reads past a block.
  auto hit = f.cache->Lookup(f.ns, {&k, 1});
  ASSERT_EQ(hit->hit_blocks, 1u);
  std::vector<uint8_t> out(8192);
  EXPECT_EQ(f.cache->Read(hit->pins[0], 4000, out.data(), 200).code(), StatusCode::kInvalidArgument);
  f.cache->Release(hit->pins);
  // The published block is intact after all of that.
  auto again = f.cache->Lookup(f.ns, {&k, 1});
  ASSERT_EQ(again->hit_blocks, 1u);
  ASSERT_TRUE(f.cache->Read(again->pins[0], 0, out.data(), 4096).ok());
  EXPECT_TRUE(MatchesKey(k, out.data(), 4096));
  f.cache->Release(again->pins);
  auto regions = pool::AttachAll({f.path.path()});
  auto problems = pool::Check(*regions, 0);
  for (const auto& p : problems) ADD_FAILURE() << p;
}

TEST(Cache, PoolWithoutIndexSaysHowToGetOne) {
  testing::TempRegionPath path("noindex");
  PoolCreateOptions co;
  co.size = 32 << 20;
  co.index = false;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  auto p = OpenOrNull({path.path()}, 0);
  auto c = p->Cache();
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("cxlkv init"));
}

TEST(Cache, DamagedOrForeignIndexIsRefusedBeforeJoining) {
  testing::TempRegionPath path("damaged");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20).ok());
  uint64_t header;
  {
    auto region = Region::Attach(path.path());
    ASSERT_TRUE(region.ok());
    header = (*region)->impl().area(region::AreaKind::kIndex).offset;
    auto& meta = (*region)->impl().meta();
    meta.Publish(header, 0x1234);  // the index's magic
  }
  auto p = Pool::Open({path.path()}, PoolOpenOptions{});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kCorrupted);
  EXPECT_THAT(p.status().message(), HasSubstr("prefix index header"));
  {
    auto region = Region::Attach(path.path());
    auto& meta = (*region)->impl().meta();
    meta.Publish(header, cache::kIndexMagic);
    meta.Publish(header + 8, uint64_t{cache::kIndexVersion + 1} | (meta.Load(header + 8) & ~0xffffffffull));
  }
  p = Pool::Open({path.path()}, PoolOpenOptions{});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kVersionMismatch);
  auto regions = pool::AttachAll({path.path()});
  auto problems = pool::Check(*regions, 0);
  EXPECT_FALSE(problems.empty()) << "check must report the damaged index";
}

TEST(Cache, ChecksumCatchesDamagedPayload) {
  Fixture f("checksum", 32 << 20, 0, /*checksum=*/true);
  BlockKey k = f.cache->ChainKeys(f.ns, testing::Tokens(8, 16, 0, 0))[0];
  ASSERT_TRUE(f.PutFor(k, 65536).ok());
  auto hit = f.cache->Lookup(f.ns, {&k, 1});
  ASSERT_EQ(hit->hit_blocks, 1u);
  EXPECT_NE(hit->pins[0].checksum, 0u);
  std::vector<uint8_t> out(65536);
  ASSERT_TRUE(f.cache->Read(hit->pins[0], 0, out.data(), out.size()).ok());
  f.pool->Ptr(hit->pins[0].offset, 65536)[1234] ^= 0x40;  // a flipped bit in the device
  Status s = f.cache->Read(hit->pins[0], 0, out.data(), out.size());
  EXPECT_EQ(s.code(), StatusCode::kCorrupted);
  EXPECT_THAT(s.message(), HasSubstr("checksum"));
  f.cache->Release(hit->pins);
}

TEST(Cache, StripeFullOfPinsRefusesInsteadOfBlocking) {
  // 64 slots in one stripe: pin them all, then one more insert must fail fast.
  Fixture f("stripe", 32 << 20, 64);
  ASSERT_EQ(f.pool->impl().index->layout().h.stripes, 1u);
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(9, 16 * 65, 0, 0));
  std::vector<BlockPin> pins;
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(f.PutFor(keys[i], 64).ok()) << i;
    auto hit = f.cache->Lookup(f.ns, {&keys[i], 1});
    ASSERT_EQ(hit->hit_blocks, 1u);
    pins.push_back(hit->pins[0]);
  }
  Status s = f.PutFor(keys[64], 64);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_THAT(s.message(), HasSubstr("--index-entries"));
  f.cache->Release({&pins[10], 1});
  EXPECT_TRUE(f.PutFor(keys[64], 64).ok());  // the unpinned one made room
  EXPECT_EQ(*f.cache->Exists(f.ns, {&keys[10], 1}), 0u);
  f.cache->Release(pins);
}

}  // namespace
}  // namespace cxlkv
