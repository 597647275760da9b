// Steady-token selection and the engine/near-memory hybrid: the resident set follows the budget
// set as Algorithm 1 says, steady selection recalls less than ArkVale-style replacement on a
// drifting query, and the engine's partial merged with the near-memory one is the attention
// over the whole budget set.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>

#include "pnm/steady.h"
#include "pnm_test_util.h"

namespace cxlkv::pnm {
namespace {

using testing::TestContext;

std::vector<uint32_t> RandomBudget(std::mt19937_64& rng, uint32_t pages, uint32_t n) {
  std::vector<uint32_t> all(pages);
  for (uint32_t p = 0; p < pages; ++p) all[p] = p;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

TEST(PnmSteady, AStepEvictsWhatLeftTheBudgetAndRecallsTheBestMissingIntoTheFreedSlots) {
  std::mt19937_64 rng(3);
  ResidentPages r(8, 100);
  for (int step = 0; step < 200; ++step) {
    const auto budget = RandomBudget(rng, 100, 12 + static_cast<uint32_t>(rng() % 8));
    const std::vector<uint32_t> before = r.Pages();
    auto s = r.SteadyStep(budget);
    ASSERT_TRUE(s.ok());
    const std::set<uint32_t> in_budget(budget.begin(), budget.end());
    // Evicted: exactly the residents that left the budget set.
    std::set<uint32_t> want_evicted;
    for (uint32_t p : before) {
      if (!in_budget.count(p)) want_evicted.insert(p);
    }
    EXPECT_EQ(std::set<uint32_t>(s->evicted.begin(), s->evicted.end()), want_evicted);
    // Recalled: the best budget pages not resident, as many as slots are open.
    const size_t open = 8 - (before.size() - want_evicted.size());
    std::vector<uint32_t> want_recalled;
    for (uint32_t p : budget) {
      if (want_recalled.size() == open) break;
      if (!std::binary_search(before.begin(), before.end(), p)) want_recalled.push_back(p);
    }
    EXPECT_EQ(s->recalled, want_recalled) << "step " << step;
    // Afterwards every resident is in the budget set, and the set is full or holds all of it.
    for (uint32_t p : r.Pages()) ASSERT_TRUE(in_budget.count(p));
    EXPECT_EQ(r.size(), std::min<size_t>(8, budget.size()));
  }
  // Bad input changes nothing.
  const auto before = r.Pages();
  EXPECT_EQ(r.SteadyStep(std::vector<uint32_t>{1, 2, 100}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.SteadyStep(std::vector<uint32_t>{4, 4}).status().message().find("twice"), std::string::npos);
  EXPECT_EQ(r.Pages(), before);
}

// A rewritten tail (a shorter sequence sharing the prefix, a step back) evicts exactly the
// residents at or past its first page; the next step refills the freed slots.
TEST(PnmSteady, EvictingFromAPageDropsExactlyTheResidentsAtOrPastIt) {
  ResidentPages r(4, 50);
  ASSERT_TRUE(r.SteadyStep(std::vector<uint32_t>{3, 40, 12, 30, 7}).ok());
  ASSERT_EQ(r.Pages(), (std::vector<uint32_t>{3, 12, 30, 40}));
  std::vector<uint32_t> evicted = r.EvictFrom(30);
  std::sort(evicted.begin(), evicted.end());
  EXPECT_EQ(evicted, (std::vector<uint32_t>{30, 40}));
  EXPECT_EQ(r.Pages(), (std::vector<uint32_t>{3, 12}));
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(r.EvictFrom(13).empty());
  auto s = r.SteadyStep(std::vector<uint32_t>{3, 12, 30, 7});
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->evicted.empty());
  EXPECT_EQ(s->recalled, (std::vector<uint32_t>{30, 7}));
}

TEST(PnmSteady, ArkValeHoldsTheWholeTopSetAfterEveryStep) {
  std::mt19937_64 rng(4);
  ResidentPages r(16, 200);
  for (int step = 0; step < 100; ++step) {
    const auto budget = RandomBudget(rng, 200, 16);
    const auto before = r.Pages();
    auto s = r.ArkValeStep(budget);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(r.Pages(), [&] { auto b = budget; std::sort(b.begin(), b.end()); return b; }());
    size_t missing = 0;
    for (uint32_t p : budget) missing += !std::binary_search(before.begin(), before.end(), p);
    EXPECT_EQ(s->recalled.size(), missing);
  }
}

// A decode trace whose query drifts slowly: each step's budget set is the top pages of a score
// that moves a little. Steady selection (engine capacity = half the budget) recalls fewer pages
// per step than ArkVale-style replacement holding the whole budget.
TEST(PnmSteady, SteadySelectionRecallsLessThanArkValeOnADriftingQuery) {
  std::mt19937_64 rng(5);
  const uint32_t pages = 4096, budget = 128;
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> base(pages), drift(pages);
  for (auto& b : base) b = n(rng);
  ResidentPages steady(budget / 2, pages), arkvale(budget, pages);
  uint64_t steady_recalls = 0, arkvale_recalls = 0;
  const int steps = 300;
  for (int step = 0; step < steps; ++step) {
    for (uint32_t p = 0; p < pages; ++p) drift[p] = 0.95 * drift[p] + 0.3 * n(rng);  // slow drift
    std::vector<uint32_t> order(pages);
    for (uint32_t p = 0; p < pages; ++p) order[p] = p;
    std::partial_sort(order.begin(), order.begin() + budget, order.end(),
                      [&](uint32_t a, uint32_t b) { return base[a] + drift[a] > base[b] + drift[b]; });
    order.resize(budget);
    auto s = steady.SteadyStep(order);
    auto a = arkvale.ArkValeStep(order);
    ASSERT_TRUE(s.ok() && a.ok());
    if (step > 0) {  // the first step fills both from empty
      steady_recalls += s->recalled.size();
      arkvale_recalls += a->recalled.size();
    }
  }
  std::printf("drifting query, %u pages, budget %u: recalls per step steady (capacity %u) %.2f, ArkVale (capacity %u) %.2f\n",
              pages, budget, budget / 2, static_cast<double>(steady_recalls) / (steps - 1), budget,
              static_cast<double>(arkvale_recalls) / (steps - 1));
  EXPECT_GT(arkvale_recalls, 0u);
  EXPECT_LT(steady_recalls, arkvale_recalls);
}

// The hybrid: per KV head the engine attends over its resident budget pages, the near-memory
// side over the others; merged, that is the attention over the whole selection.
TEST(PnmSteady, EnginePartMergedWithNearMemoryPartEqualsTheWholeSelection) {
  std::mt19937_64 rng(6);
  Geometry g = testing::MakeGeometry(8, 2, 64);
  TestContext c(g, 16 * 200 - 9);
  c.FillNormal(rng);
  const auto digests = c.Digests();
  std::vector<ResidentPages> residents;
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) residents.emplace_back(8, c.View().pages.size());
  for (int step = 0; step < 5; ++step) {
    const auto q = testing::RandomQuery(g, rng);
    SelectOptions o;
    o.budget_tokens = 16 * 20;
    Selection sel;
    ASSERT_TRUE(SelectPages(g, q.data(), digests.data(), c.tokens(), o, &sel).ok());
    if (step > 0) {  // the engine holds what the last step left it
      Selection engine, rest;
      SplitByResidence(sel, residents, &engine, &rest);
      uint64_t resident_pages = 0;
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        resident_pages += engine.Of(h).size();
        ASSERT_EQ(engine.Of(h).size() + rest.Of(h).size(), sel.Of(h).size());
      }
      Partial whole, mine, theirs, merged;
      ASSERT_TRUE(Attend(g, q.data(), c.View(), &sel, 0, &whole).ok());
      ASSERT_TRUE(Attend(g, q.data(), c.View(), &engine, 0, &mine).ok());
      ASSERT_TRUE(Attend(g, q.data(), c.View(), &rest, 0, &theirs).ok());
      ASSERT_TRUE(MergeInto(mine, &merged).ok());
      ASSERT_TRUE(MergeInto(theirs, &merged).ok());
      for (size_t i = 0; i < whole.out.size(); ++i) {
        ASSERT_NEAR(merged.out[i], whole.out[i], 1e-5f * (1 + std::fabs(whole.out[i])));
      }
      for (uint32_t h = 0; h < g.num_heads; ++h) ASSERT_NEAR(merged.lse[h], whole.lse[h], 1e-5f * (1 + std::fabs(whole.lse[h])));
      std::printf("step %d: %llu of %llu selected pages resident in the engine\n", step,
                  static_cast<unsigned long long>(resident_pages), static_cast<unsigned long long>(sel.TotalPages()));
    }
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) ASSERT_TRUE(residents[h].SteadyStep(sel.RankedOf(h)).ok());
  }
}

}  // namespace
}  // namespace cxlkv::pnm
