// Helpers of the tiering tests (tiering_test.cc, tier_stream_test.cc): a pool with a cache, key
// chains of 256 KiB blocks whose bytes follow from their keys, and read-back checks.
#ifndef CXLKV_TESTS_TIER_TIERING_TEST_UTIL_H_
#define CXLKV_TESTS_TIER_TIERING_TEST_UTIL_H_

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"
#include "child.h"
#include "pool/pool_internal.h"
#include "tier/tier_store.h"

namespace cxlkv::tier {

inline constexpr uint64_t kBlock = 256 << 10;
inline constexpr uint64_t kSlot = kBlock + 4096;

struct Blocks {
  std::vector<int32_t> tokens;
  std::vector<BlockKey> keys;
};

// `n` blocks of one chain, each holding the bytes FillForKey gives its key.
inline Blocks PutChain(KvCache& cache, const NamespaceHandle& ns, uint64_t doc, size_t n) {
  Blocks b;
  b.tokens = cxlkv::testing::Tokens(doc, 16 * n, 0, 0);
  b.keys = cache.ChainKeys(ns, b.tokens);
  std::vector<uint8_t> data(kBlock);
  for (const BlockKey& k : b.keys) {
    cxlkv::testing::FillForKey(k, data.data(), data.size());
    Status s = cache.Put(ns, k, data.data(), data.size());
    EXPECT_TRUE(s.ok() || s.code() == StatusCode::kAlreadyExists) << s.ToString();
  }
  return b;
}

// Looks the chain up (bringing in what sits on tiers), checks every hit block's bytes, releases.
// Returns the hit length.
// `brought_in`, if given: the hit's blocks brought in from node DRAM and from SSD.
inline size_t LookupAndVerify(KvCache& cache, const NamespaceHandle& ns, const std::vector<BlockKey>& keys,
                       std::pair<size_t, size_t>* brought_in = nullptr) {
  auto hit = cache.Lookup(ns, keys);
  EXPECT_TRUE(hit.ok()) << hit.status().ToString();
  if (!hit.ok()) return 0;
  if (brought_in) *brought_in = {hit->from_mem, hit->from_ssd};
  std::vector<uint8_t> back(kBlock);
  for (size_t i = 0; i < hit->pins.size(); ++i) {
    EXPECT_EQ(hit->pins[i].tier, 0u);
    EXPECT_TRUE(cache.Read(hit->pins[i], 0, back.data(), back.size()).ok());
    EXPECT_TRUE(cxlkv::testing::MatchesKey(keys[i], back.data(), back.size())) << "block " << i << " differs";
  }
  cache.Release(hit->pins);
  return hit->hit_blocks;
}

// Looks each key up on its own (bringing it in from a tier) and checks the bytes of each hit.
// Returns how many were hit.
inline size_t ReadBackEach(KvCache& cache, const NamespaceHandle& ns, const std::vector<BlockKey>& keys) {
  size_t hits = 0;
  std::vector<uint8_t> back(kBlock);
  for (const BlockKey& k : keys) {
    auto hit = cache.Lookup(ns, {&k, 1});
    EXPECT_TRUE(hit.ok()) << hit.status().ToString();
    if (!hit.ok() || hit->hit_blocks == 0) continue;
    EXPECT_TRUE(cache.Read(hit->pins[0], 0, back.data(), back.size()).ok());
    EXPECT_TRUE(cxlkv::testing::MatchesKey(k, back.data(), back.size()));
    cache.Release(hit->pins);
    ++hits;
  }
  return hits;
}

inline std::map<uint16_t, size_t> EntriesByTier(Pool& pool) {
  std::map<uint16_t, size_t> by;
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(pool)) ++by[e.tier];
  return by;
}

inline void ExpectCheckClean(const std::string& path) {
  auto regions = pool::AttachAll({path});
  ASSERT_TRUE(regions.ok());
  for (const auto& p : pool::Check(*regions)) ADD_FAILURE() << p;
}

// Node 0 on the region until the test sends it a word: it manages the pool and recovers the
// lives of the processes a test kills or pauses. Returns once it has joined.
inline cxlkv::testing::Child StartSurvivor(const std::string& region) {
  cxlkv::testing::Child survivor = cxlkv::testing::Child::Fork([region](int in, int out) {
    auto o = cxlkv::testing::OpenCache(region, 0);
    if (!o.cache || !cxlkv::testing::Put(out, 1)) return 1;
    uint64_t done;
    (void)cxlkv::testing::Get(in, &done);
    return 0;
  });
  uint64_t ready = 0;
  EXPECT_TRUE(survivor.Receive(&ready)) << "node 0 did not join";
  return survivor;
}

inline TierStoreOptions Options(const std::vector<TierSpec>& tiers) {
  TierStoreOptions o;
  o.tiers = tiers;
  o.slot_bytes = kSlot;
  o.background = false;
  return o;
}

inline TierSpec Dram(uint64_t bytes) { return TierSpec{TierKind::kMem, "", bytes, -1, ""}; }
inline TierSpec Ssd(const std::string& path, uint64_t bytes, const std::string& catalog_dir = "") {
  return TierSpec{TierKind::kSsd, path, bytes, -1, catalog_dir};
}

}  // namespace cxlkv::tier

#endif  // CXLKV_TESTS_TIER_TIERING_TEST_UTIL_H_
