// AttendPool: a batch of requests spread over threads gives each request exactly what Attend
// gives it alone — whole requests per thread, or a long request's parts (attend.h) across the
// threads when requests are fewer than threads; a bad job gets its error and the others run.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <chrono>
#include <string>
#include <thread>
#include <memory>
#include <vector>
#include <random>

#include "pnm/attend_pool.h"
#include "pnm_test_util.h"

namespace cxlkv::pnm {
namespace {

using testing::TestContext;

TEST(PnmAttendPool, ABatchOverThreadsEqualsEachRequestAlone) {
  std::mt19937_64 rng(44);
  Geometry a = testing::MakeGeometry(16, 4, 64);
  Geometry b = a;
  b.num_kv_heads = 2;
  b.num_heads = 2;
  b.head_dim = 32;
  b.dtype = KvDtype::kBf16;
  // Long enough to be attended in parts (128 pages and more): the engine's fp32 token-major
  // pages, and head-major ones.
  Geometry c = testing::MakeGeometry(8, 2, 32, 4, KvDtype::kFp32);
  Geometry d = c;
  d.head_major = true;
  d.dtype = KvDtype::kFp16;
  std::vector<std::unique_ptr<TestContext>> contexts;
  std::vector<std::vector<float>> queries;
  std::vector<Selection> selections;
  const Geometry* shapes[] = {&c, &d, &a, &b, &c, &a};
  const uint64_t lengths[] = {4 * 600 + 3, 4 * 200, 100, 197, 4 * 130, 588};
  for (int r = 0; r < 6; ++r) {
    const Geometry& g = *shapes[r];
    contexts.push_back(std::make_unique<TestContext>(g, lengths[r]));
    contexts.back()->FillNormal(rng);
    queries.push_back(testing::RandomQuery(g, rng));
    const auto digests = contexts.back()->Digests();
    Selection sel;
    SelectOptions o;
    o.budget_tokens = lengths[r] / 4;
    ASSERT_TRUE(SelectPages(g, queries.back().data(), digests.data(), contexts.back()->tokens(), o, &sel).ok());
    selections.push_back(std::move(sel));
  }
  ASSERT_EQ(internal::AttendParts(contexts[0]->View()), 8u);
  ASSERT_EQ(internal::AttendParts(contexts[1]->View()), 3u);
  ASSERT_EQ(internal::AttendParts(contexts[2]->View()), 1u);
  for (uint32_t threads : {0u, 1u, 3u}) {
    AttendPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int round = 0; round < 20; ++round) {
      // Odd rounds: one or two requests, fewer than the threads, so the long ones go in parts.
      const size_t batch = round % 2 ? 1 + round % 3 / 2 : contexts.size();
      std::vector<Partial> outs(batch);
      std::vector<AttendJob> jobs(batch);
      for (size_t r = 0; r < batch; ++r) {
        jobs[r].g = &contexts[r]->geometry();
        jobs[r].q = queries[r].data();
        jobs[r].ctx = contexts[r]->View();
        jobs[r].selection = (r + round) % 3 == 0 ? nullptr : &selections[r];
        jobs[r].out = &outs[r];
      }
      ASSERT_TRUE(pool.Run(jobs).ok());
      for (size_t r = 0; r < batch; ++r) {
        Partial alone;
        ASSERT_TRUE(Attend(*jobs[r].g, jobs[r].q, jobs[r].ctx, jobs[r].selection, 0, &alone).ok());
        ASSERT_TRUE(jobs[r].status.ok());
        ASSERT_EQ(outs[r].out, alone.out) << "threads " << threads << " request " << r << " round " << round;
        ASSERT_EQ(outs[r].lse, alone.lse) << "threads " << threads << " request " << r << " round " << round;
      }
    }
  }
}

// Attended in parts, a long context is still the attention over all of it: against fp64.
TEST(PnmAttendPool, AContextAttendedInPartsEqualsDenseFp64) {
  std::mt19937_64 rng(45);
  const Geometry g = testing::MakeGeometry(8, 2, 32, 4, KvDtype::kFp16);
  TestContext c(g, 4 * 700 + 1);
  c.FillNormal(rng);
  ASSERT_EQ(internal::AttendParts(c.View()), 8u);
  const auto q = testing::RandomQuery(g, rng);
  const float scale = 1.0f / std::sqrt(32.0f);
  AttendPool pool(1);
  Partial out;
  AttendJob job;
  job.g = &g;
  job.q = q.data();
  job.ctx = c.View();
  job.out = &out;
  ASSERT_TRUE(pool.Run({&job, 1}).ok());
  const auto dense = testing::DenseFp64(c, q, scale);
  for (uint32_t h = 0; h < g.num_heads; ++h) {
    ASSERT_NEAR(out.lse[h], dense.lse[h], 1e-3 * (1 + std::fabs(dense.lse[h]))) << "head " << h;
    for (uint32_t d = 0; d < g.head_dim; ++d) {
      const double want = dense.out[uint64_t{h} * g.head_dim + d];
      ASSERT_NEAR(out.out[uint64_t{h} * g.head_dim + d], want, 1e-3 * (1 + std::fabs(want))) << "head " << h;
    }
  }
}

TEST(PnmAttendPool, ABadJobGetsItsErrorAndTheOthersRun) {
  std::mt19937_64 rng(45);
  Geometry g = testing::MakeGeometry(4, 2, 32);
  TestContext c(g, 50);
  c.FillNormal(rng);
  const auto q = testing::RandomQuery(g, rng);
  Selection wrong = Selection::All(5, 4);
  Partial good, bad, missing;
  std::vector<AttendJob> jobs(3);
  jobs[0] = {&g, q.data(), c.View(), &wrong, 0, &bad, {}};
  jobs[1] = {&g, q.data(), c.View(), nullptr, 0, &good, {}};
  jobs[2] = {&g, nullptr, c.View(), nullptr, 0, &missing, {}};
  AttendPool pool(1);
  Status s = pool.Run(jobs);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(jobs[0].status.message().find("5 KV heads"), std::string::npos) << jobs[0].status.message();
  EXPECT_TRUE(jobs[1].status.ok());
  EXPECT_EQ(jobs[2].status.code(), StatusCode::kInvalidArgument);
  Partial alone;
  ASSERT_TRUE(Attend(g, q.data(), c.View(), nullptr, 0, &alone).ok());
  EXPECT_EQ(good.out, alone.out);
  EXPECT_EQ(bad.num_heads, 0u) << "a refused job's output was touched";
}

}  // namespace
}  // namespace cxlkv::pnm

namespace cxlkv::pnm {
namespace {

// ForEach (the per-request work before attention, such as selection): every index exactly once,
// batch after batch, with Run batches in between; workers start through the start hook.
TEST(PnmAttendPool, ForEachCallsEveryIndexOnceAcrossTheThreads) {
  std::atomic<int> started{0};
  AttendPool pool(3, [&] { started.fetch_add(1); });
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
    std::vector<std::atomic<int>> calls(n);
    pool.ForEach(n, [&](size_t i) { calls[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(calls[i].load(), 1) << "index " << i << " of " << n;
    ASSERT_TRUE(pool.Run({}).ok());
  }
  // Each worker ran the hook once when it started (threads may start after the batches ran).
  for (int i = 0; i < 500 && started.load() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(started.load(), 3);
}

void ExpectSameSelection(const Selection& got, const Selection& want, const std::string& what) {
  ASSERT_EQ(got.num_kv_heads(), want.num_kv_heads()) << what;
  for (uint32_t h = 0; h < want.num_kv_heads(); ++h) {
    const auto gp = got.Of(h), wp = want.Of(h), gr = got.RankedOf(h), wr = want.RankedOf(h);
    ASSERT_EQ(std::vector<uint32_t>(gp.begin(), gp.end()), std::vector<uint32_t>(wp.begin(), wp.end()))
        << what << ", KV head " << h;
    ASSERT_EQ(std::vector<uint32_t>(gr.begin(), gr.end()), std::vector<uint32_t>(wr.begin(), wr.end()))
        << what << ", KV head " << h << " (ranks)";
  }
}

// Select: a lone long request's KV heads shared out over the threads and joined, or whole
// requests per thread, give each request exactly SelectPages' pages and ranks, for shapes and
// GQA ratios at random, with 0, 1 and 3 workers; a budget covering the context selects every
// page; a bad job gets its error and the others still run.
TEST(PnmAttendPool, SelectionOverThreadsEqualsSelectPages) {
  std::mt19937_64 rng(4242);
  AttendPool pools[] = {AttendPool(0), AttendPool(1), AttendPool(3)};
  for (int trial = 0; trial < 6; ++trial) {
    const uint32_t kv_heads = 2 + static_cast<uint32_t>(rng() % 5);  // 2..6: shares of uneven sizes too
    const uint32_t group = 1 + static_cast<uint32_t>(rng() % 4);
    Geometry g = testing::MakeGeometry(kv_heads * group, kv_heads, 32, 16);
    const uint64_t tokens = 16 * (2048 + rng() % 1024) - rng() % 16;  // enough pages to share; a partial last one
    TestContext c(g, tokens);
    c.FillNormal(rng);
    const auto digests = c.Digests();
    ASSERT_FALSE(digests.empty());
    std::vector<std::vector<float>> q(2);
    for (auto& x : q) x = testing::RandomQuery(g, rng);
    for (uint32_t budget : {256u, 4096u, static_cast<uint32_t>(tokens + 16)}) {
      const SelectOptions o{budget, 1 + static_cast<uint32_t>(rng() % 2), 1};
      Selection want[2];
      for (int i = 0; i < 2; ++i) ASSERT_TRUE(SelectPages(g, q[i].data(), digests.data(), tokens, o, &want[i]).ok());
      for (AttendPool& pool : pools) {
        const std::string what = "trial " + std::to_string(trial) + ", " + std::to_string(kv_heads) + " KV heads, budget " +
                                 std::to_string(budget) + ", " + std::to_string(pool.threads()) + " workers";
        for (size_t n : {size_t{1}, size_t{2}}) {  // one request (shared out) and two
          Selection got[2];
          std::vector<SelectJob> jobs(n);
          for (size_t i = 0; i < n; ++i) jobs[i] = {&g, q[i].data(), digests.data(), tokens, o, &got[i], {}};
          ASSERT_TRUE(pool.Select(jobs).ok()) << what;
          for (size_t i = 0; i < n; ++i) ASSERT_NO_FATAL_FAILURE(ExpectSameSelection(got[i], want[i], what));
        }
      }
    }
    // A bad job beside a good one: its own error, and the good one's selection.
    Selection got, unused;
    std::vector<SelectJob> jobs(2);
    jobs[0] = {&g, q[0].data(), nullptr, tokens, {}, &unused, {}};
    jobs[1] = {&g, q[1].data(), digests.data(), tokens, {}, &got, {}};
    EXPECT_EQ(pools[2].Select(jobs).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(jobs[0].status.code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(jobs[1].status.ok());
    Selection want;
    ASSERT_TRUE(SelectPages(g, q[1].data(), digests.data(), tokens, {}, &want).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectSameSelection(got, want, "beside a bad job"));
  }
}

}  // namespace
}  // namespace cxlkv::pnm
