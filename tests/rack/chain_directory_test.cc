// The home rack's directory (rack/chain_directory.h): longest prefixes per holder, evictions,
// lives, departures, ring changes, its bound, and announced values it must not trust.
#include <gtest/gtest.h>

#include "rack/chain_directory.h"

namespace cxlkv::rack {
namespace {

// A chain of `n` keys whose first key is `seed`'s; `diverge_at` onwards the keys differ.
std::vector<BlockKey> Chain(uint64_t seed, uint32_t n, uint32_t diverge_at = UINT32_MAX) {
  std::vector<BlockKey> keys;
  for (uint32_t i = 0; i < n; ++i) keys.push_back({seed * 1000 + i, i >= diverge_at ? 0xdead : uint64_t{7}});
  return keys;
}

LinkAnnounce Publish(int64_t life, const std::vector<BlockKey>& keys, uint32_t from = 0) {
  LinkAnnounce a{life, {}};
  for (uint32_t i = from; i < keys.size(); ++i) a.blocks.push_back({AnnounceOp::kPublished, keys[0], i, keys[i]});
  return a;
}

LinkAnnounce Evict(int64_t life, const std::vector<BlockKey>& keys, uint32_t index) {
  return {life, {{AnnounceOp::kEvicted, keys[0], index, keys[index]}}};
}

TEST(ChainDirectory, LookupNamesEachHoldersLongestPrefixLongestFirst) {
  ChainDirectory d;
  const auto chain = Chain(1, 8);
  d.Apply("rack-a", Publish(1, chain));
  d.Apply("rack-b", Publish(3, std::vector<BlockKey>(chain.begin(), chain.begin() + 5)));
  auto all = d.Lookup(chain);
  ASSERT_EQ(all.holders.size(), 2u);
  EXPECT_EQ(all.holders[0], (ChainHolder{"rack-a", 1, 8}));
  EXPECT_EQ(all.holders[1], (ChainHolder{"rack-b", 3, 5}));
  // An asker whose prompt diverges after 3 blocks: both hold 3, ties by name.
  auto diverged = d.Lookup(Chain(1, 8, 3));
  ASSERT_EQ(diverged.holders.size(), 2u);
  EXPECT_EQ(diverged.holders[0], (ChainHolder{"rack-a", 1, 3}));
  EXPECT_EQ(diverged.holders[1], (ChainHolder{"rack-b", 3, 3}));
  EXPECT_TRUE(d.Lookup(Chain(2, 4)).holders.empty()) << "a chain nobody announced";
  EXPECT_TRUE(d.Lookup({}).holders.empty());
  // An eviction in the middle ends that holder's prefix there; an eviction of a key it never
  // held changes nothing.
  d.Apply("rack-a", Evict(1, chain, 4));
  d.Apply("rack-b", Evict(3, Chain(9, 8), 2));
  all = d.Lookup(chain);
  ASSERT_EQ(all.holders.size(), 2u);
  EXPECT_EQ(all.holders[0], (ChainHolder{"rack-b", 3, 5}));
  EXPECT_EQ(all.holders[1], (ChainHolder{"rack-a", 1, 4}));
  EXPECT_EQ(d.stats().blocks, 7u + 5u);
  EXPECT_EQ(d.stats().chains, 1u);
  // Evicting the first block of a holder ends its prefix at once.
  d.Apply("rack-b", Evict(3, chain, 0));
  all = d.Lookup(chain);
  ASSERT_EQ(all.holders.size(), 1u);
  EXPECT_EQ(all.holders[0].rack, "rack-a");
}

TEST(ChainDirectory, ANewLifeForgetsTheOldAndAnOldLifeIsRefused) {
  ChainDirectory d;
  const auto one = Chain(1, 4), two = Chain(2, 4);
  d.Apply("rack-a", Publish(2, one));
  d.Apply("rack-a", Publish(1, two));  // a batch delayed from the life before
  EXPECT_TRUE(d.Lookup(two).holders.empty());
  EXPECT_EQ(d.stats().stale_batches, 1u);
  d.Apply("rack-a", Publish(3, two));  // life 3 re-announces only `two`
  EXPECT_TRUE(d.Lookup(one).holders.empty()) << "life 2's blocks outlived it";
  ASSERT_EQ(d.Lookup(two).holders.size(), 1u);
  EXPECT_EQ(d.Lookup(two).holders[0].life, 3);
  EXPECT_EQ(d.stats().blocks, 4u);
}

TEST(ChainDirectory, ALeaverIsForgottenAndALateBatchOfItsLifeRefused) {
  ChainDirectory d;
  const auto chain = Chain(1, 6);
  d.Apply("rack-a", Publish(1, chain));
  d.Apply("rack-b", Publish(1, chain));
  d.Forget("rack-a");
  ASSERT_EQ(d.Lookup(chain).holders.size(), 1u);
  EXPECT_EQ(d.Lookup(chain).holders[0].rack, "rack-b");
  d.Apply("rack-a", Publish(1, Chain(5, 2)));  // still in flight when it left
  EXPECT_TRUE(d.Lookup(Chain(5, 2)).holders.empty());
  d.Apply("rack-a", Publish(2, Chain(5, 2)));  // its next life is welcome
  EXPECT_EQ(d.Lookup(Chain(5, 2)).holders.size(), 1u);
  d.Forget("rack-b");
  d.Forget("rack-a");
  EXPECT_EQ(d.stats().chains, 0u);
  EXPECT_EQ(d.stats().blocks, 0u);
}

TEST(ChainDirectory, RetainDropsChainsTheRingMovedAway) {
  ChainDirectory d;
  for (uint64_t c = 1; c <= 10; ++c) d.Apply("rack-a", Publish(1, Chain(c, 3)));
  const size_t dropped = d.Retain([](const BlockKey& chain) { return (chain.lo / 1000) % 2 == 0; });
  EXPECT_EQ(dropped, 5u);
  EXPECT_EQ(d.stats().chains, 5u);
  EXPECT_EQ(d.stats().blocks, 15u);
  EXPECT_TRUE(d.Lookup(Chain(3, 3)).holders.empty());
  EXPECT_EQ(d.Lookup(Chain(4, 3)).holders.size(), 1u);
}

TEST(ChainDirectory, PastItsBoundTheLeastRecentlyAnnouncedChainsGoFirst) {
  ChainDirectory d(100);
  for (uint64_t c = 1; c <= 30; ++c) d.Apply("rack-a", Publish(1, Chain(c, 10)));
  EXPECT_LE(d.stats().blocks, 100u);
  EXPECT_EQ(d.stats().chains, 10u);
  EXPECT_EQ(d.stats().dropped_for_space, 20u);
  EXPECT_TRUE(d.Lookup(Chain(20, 10)).holders.empty());
  EXPECT_EQ(d.Lookup(Chain(21, 10)).holders.size(), 1u);
  // Announcing to an old chain makes it recent: the next overflow takes another.
  d.Apply("rack-b", Publish(1, Chain(21, 1)));
  d.Apply("rack-a", Publish(1, Chain(31, 10)));
  EXPECT_EQ(d.Lookup(Chain(21, 10)).holders.size(), 2u);
  EXPECT_TRUE(d.Lookup(Chain(22, 10)).holders.empty());
}

TEST(ChainDirectory, AnnouncedValuesItCannotTrustAreLeftOutAndCounted) {
  ChainDirectory d;
  const auto chain = Chain(1, 3);
  LinkAnnounce bad{1, {}};
  bad.blocks.push_back({AnnounceOp::kPublished, chain[0], 0, BlockKey{99, 99}});  // first key not the chain's
  bad.blocks.push_back({AnnounceOp::kPublished, chain[0], ChainDirectory::kMaxChainBlocks, chain[1]});  // index too far
  d.Apply("rack-a", bad);
  EXPECT_EQ(d.stats().malformed, 2u);
  EXPECT_EQ(d.stats().blocks, 0u);
  EXPECT_TRUE(d.Lookup(chain).holders.empty());
  // A block announced past a gap counts, but a prefix stops at the gap.
  d.Apply("rack-a", Publish(1, chain, 1));
  EXPECT_TRUE(d.Lookup(chain).holders.empty()) << "a holder without the first block holds no prefix";
  d.Apply("rack-a", Publish(1, {chain[0]}));
  ASSERT_EQ(d.Lookup(chain).holders.size(), 1u);
  EXPECT_EQ(d.Lookup(chain).holders[0].blocks, 3u);
}

}  // namespace
}  // namespace cxlkv::rack
