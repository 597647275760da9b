#include "tier/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace cxlkv::tier {
namespace {

__extension__ typedef unsigned __int128 u128;

TEST(TierPlacement, PaperExampleFloorsAndGivesTheRemainderToTheFastest) {
  // p = {0.75, 0.25}: 10 items → floor 7 and 2, one left over → the faster device.
  auto c = PlacementCounts(std::vector<uint64_t>{3, 1}, 10);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<uint64_t>{8, 2}));
  auto runs = PlaceInLayerOrder(std::vector<uint64_t>{3, 1}, 10);
  ASSERT_TRUE(runs.ok());
  ASSERT_EQ(runs->size(), 2u);
  EXPECT_EQ((*runs)[0].device, 0u);
  EXPECT_EQ((*runs)[0].first, 0u);
  EXPECT_EQ((*runs)[0].count, 8u);
  EXPECT_EQ((*runs)[1].first, 8u);
  EXPECT_EQ((*runs)[1].count, 2u);
}

TEST(TierPlacement, EmptyOrAllZeroBandwidthIsAnError) {
  EXPECT_EQ(PlacementCounts(std::vector<uint64_t>{}, 5).status().code(), StatusCode::kInvalidArgument);
  auto z = PlacementCounts(std::vector<uint64_t>{0, 0, 0}, 5);
  EXPECT_EQ(z.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(z.status().message().find("non-zero bandwidth"), std::string::npos);
  EXPECT_FALSE(PlacementRatios(std::vector<uint64_t>{0}).ok());
}

TEST(TierPlacement, TiesGoToTheLowestIndex) {
  auto c = PlacementCounts(std::vector<uint64_t>{5, 5, 5}, 4);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<uint64_t>{2, 1, 1}));
}

// Algorithm 1's properties over many random device sets and batch sizes.
TEST(TierPlacement, PropertiesHoldOverRandomInputs) {
  std::mt19937_64 rng(20260614);
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t devices = 1 + rng() % 8;
    std::vector<uint64_t> b(devices);
    for (auto& x : b) {
      switch (rng() % 4) {
        case 0: x = 0; break;                                   // a dead device
        case 1: x = rng() % 10; break;                          // small, ties likely
        case 2: x = (rng() % 30 + 1) * 1000000000ull; break;    // GB/s-sized
        default: x = rng() >> (rng() % 64); break;              // anything, up to 2^64-1
      }
    }
    if (std::all_of(b.begin(), b.end(), [](uint64_t x) { return x == 0; })) b[rng() % devices] = 1 + rng() % 7;
    const uint64_t n = (trial % 10 == 0) ? rng() : rng() % 5000;
    auto c = PlacementCounts(b, n);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto again = PlacementCounts(b, n);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*c, *again) << "deterministic";
    // Counts sum to n.
    u128 sum = 0, total = 0;
    for (size_t i = 0; i < devices; ++i) sum += (*c)[i], total += b[i];
    ASSERT_EQ(static_cast<uint64_t>(sum), n);
    // Each is floor(p_i·n) or one more; zero bandwidth gets nothing.
    std::vector<bool> extra(devices);
    for (size_t i = 0; i < devices; ++i) {
      uint64_t fl = static_cast<uint64_t>(static_cast<u128>(b[i]) * n / total);
      ASSERT_TRUE((*c)[i] == fl || (*c)[i] == fl + 1) << "device " << i << " got " << (*c)[i] << ", floor " << fl;
      extra[i] = (*c)[i] == fl + 1;
      if (b[i] == 0) {
        ASSERT_EQ((*c)[i], 0u);
      }
    }
    // The remainder went to the largest p_i first (ties: lowest index): the devices given one
    // more are a prefix of the devices ordered by descending bandwidth.
    std::vector<size_t> order(devices);
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return b[x] > b[y]; });
    bool seen_without = false;
    for (size_t k : order) {
      if (!extra[k]) seen_without = true;
      ASSERT_FALSE(seen_without && extra[k]) << "a slower device got a remainder item before a faster one";
    }
    // Runs: contiguous, in device order, covering [0, n).
    auto runs = PlaceInLayerOrder(b, n);
    ASSERT_TRUE(runs.ok());
    uint64_t next = 0;
    for (const auto& r : *runs) {
      ASSERT_EQ(r.first, next);
      ASSERT_EQ(r.count, (*c)[r.device]);
      ASSERT_GT(r.count, 0u);
      next += r.count;
    }
    ASSERT_EQ(next, n);
  }
}

TEST(TierPlacement, RatiosSumToOne) {
  auto p = PlacementRatios(std::vector<uint64_t>{12, 3, 0, 5});
  ASSERT_TRUE(p.ok());
  EXPECT_DOUBLE_EQ((*p)[0], 0.6);
  EXPECT_DOUBLE_EQ((*p)[2], 0.0);
  EXPECT_NEAR(std::accumulate(p->begin(), p->end(), 0.0), 1.0, 1e-12);
}

}  // namespace
}  // namespace cxlkv::tier

namespace cxlkv::tier {
namespace {

// Small batches (what a spill thread that keeps up produces): per-batch Algorithm 1 gives a batch
// of one to the fastest device every time; the cursor carries the shares across batches.
TEST(TierPlacementCursor, SmallBatchesStillSplitByBandwidth) {
  PlacementCursor cursor({10'000, 2'000});  // DRAM and SSD as probed here, 5:1
  for (int i = 0; i < 600; ++i) {
    auto runs = cursor.Next(1);
    ASSERT_TRUE(runs.ok());
    ASSERT_EQ(runs->size(), 1u);
  }
  EXPECT_EQ(cursor.placed()[0], 500u);
  EXPECT_EQ(cursor.placed()[1], 100u);
  auto once = PlaceInLayerOrder(std::vector<uint64_t>{10'000, 2'000}, 1);
  ASSERT_TRUE(once.ok());
  EXPECT_EQ((*once)[0].device, 0u) << "Algorithm 1 alone: every batch of one to the fastest";
}

TEST(TierPlacementCursor, EveryDeviceStaysWithinOneItemOfItsShareOverRandomBatches) {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t devices = 1 + rng() % 5;
    std::vector<uint64_t> bw(devices);
    for (auto& b : bw) b = rng() % 4 == 0 ? 0 : 1 + rng() % 100'000'000'000ull;
    if (std::all_of(bw.begin(), bw.end(), [](uint64_t b) { return b == 0; })) bw[0] = 1;
    long double total = 0;
    for (uint64_t b : bw) total += static_cast<long double>(b);
    PlacementCursor cursor(bw);
    uint64_t items = 0;
    for (int batch = 0; batch < 20; ++batch) {
      const uint64_t n = rng() % 9;
      auto runs = cursor.Next(n);
      ASSERT_TRUE(runs.ok());
      uint64_t next = 0, sum = 0;
      for (const PlacementRun& r : *runs) {
        EXPECT_EQ(r.first, next) << "runs are contiguous, in layer order";
        EXPECT_GT(bw[r.device], 0u) << "a zero-bandwidth device got items";
        next += r.count;
        sum += r.count;
      }
      EXPECT_EQ(sum, n);
      items += n;
      for (size_t i = 0; i < devices; ++i) {
        const long double share = static_cast<long double>(bw[i]) / total * static_cast<long double>(items);
        EXPECT_LT(std::abs(static_cast<long double>(cursor.placed()[i]) - share), 1.0L + 1e-9L)
            << "device " << i << " of " << devices << " after " << items << " items";
      }
    }
  }
}

TEST(TierPlacementCursor, NoBandwidthIsAnError) {
  PlacementCursor none({0, 0});
  EXPECT_EQ(none.Next(3).status().code(), StatusCode::kInvalidArgument);
  PlacementCursor empty({});
  EXPECT_EQ(empty.Next(1).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cxlkv::tier
