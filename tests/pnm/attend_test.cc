// Attention over selected pages: with every page selected it equals dense attention in fp64;
// partials over any split of the pages merge exactly, in any order, empty pieces and extreme
// logits included; bad input is refused and changes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "pnm_test_util.h"

namespace cxlkv::pnm {
namespace {

using testing::TestContext;

// |got - want| within rel of the largest |want| of the head (outputs near zero have no
// meaningful relative error of their own).
void ExpectClose(const Partial& got, const testing::DenseResult& want, double rel, const std::string& what) {
  ASSERT_EQ(got.out.size(), want.out.size());
  const uint32_t dim = got.head_dim;
  for (uint32_t h = 0; h < got.num_heads; ++h) {
    double scale = 1e-30;
    for (uint32_t d = 0; d < dim; ++d) scale = std::max(scale, std::fabs(want.out[h * dim + d]));
    for (uint32_t d = 0; d < dim; ++d) {
      ASSERT_NEAR(got.out[h * dim + d], want.out[h * dim + d], rel * scale) << what << " head " << h << " dim " << d;
    }
    ASSERT_NEAR(got.lse[h], want.lse[h], rel * std::max(1.0, std::fabs(want.lse[h]))) << what << " head " << h;
  }
}

// Random shapes, GQA ratios, dtypes, page sizes and lengths (partial last pages included).
TEST(PnmAttend, EveryPageSelectedEqualsDenseAttentionInFp64) {
  std::mt19937_64 rng(2026);
  const KvDtype dtypes[] = {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp32};
  for (int trial = 0; trial < 24; ++trial) {
    Geometry g;
    g.num_kv_heads = 1 + static_cast<uint32_t>(rng() % 3);
    const uint32_t group = uint32_t{1} << (rng() % 4);  // 1, 2, 4, 8
    g.num_heads = g.num_kv_heads * group;
    g.head_dim = 16u << (rng() % 4);  // 16 .. 128
    g.page_tokens = std::vector<uint32_t>{1, 8, 16, 32}[rng() % 4];
    g.dtype = dtypes[trial % 3];
    g.head_major = (trial / 3) % 2 == 1;  // both block formats for every dtype
    const uint64_t tokens = 1 + rng() % 700;
    const std::string what = "trial " + std::to_string(trial) + " kv " + std::to_string(g.num_kv_heads) + " group " +
                             std::to_string(group) + " dim " + std::to_string(g.head_dim) + " page " +
                             std::to_string(g.page_tokens) + " tokens " + std::to_string(tokens) +
                             (g.head_major ? " head-major" : " token-major");
    TestContext c(g, tokens);
    c.FillNormal(rng);
    const auto q = testing::RandomQuery(g, rng, 2.0f);
    const auto want = testing::DenseFp64(c, q, 1.0 / std::sqrt(static_cast<double>(g.head_dim)));
    Partial got;
    ASSERT_TRUE(Attend(g, q.data(), c.View(), nullptr, 0, &got).ok()) << what;
    ExpectClose(got, want, 1e-3, what);
    // A budget that covers the context selects every page: the same output.
    const auto digests = c.Digests();
    Selection sel;
    SelectOptions o;
    o.budget_tokens = static_cast<uint32_t>(tokens + g.page_tokens);
    ASSERT_TRUE(SelectPages(g, q.data(), digests.data(), tokens, o, &sel).ok());
    ASSERT_EQ(sel.TotalPages(), g.PagesFor(tokens));
    Partial selected;
    ASSERT_TRUE(Attend(g, q.data(), c.View(), &sel, 0, &selected).ok());
    EXPECT_EQ(selected.out, got.out) << what;
    EXPECT_EQ(selected.lse, got.lse) << what;
  }
}

// Heads with different page lists (a real selection) take the head-by-head path with prefetch;
// each head's output equals attending to its list alone through the page-by-page path, bit for
// bit, and lies within fp32 rounding of fp64 attention over exactly those pages.
TEST(PnmAttend, PerHeadSelectionsEqualEachHeadsOwnPagesAttendedAlone) {
  for (bool head_major : {false, true}) {
  SCOPED_TRACE(head_major ? "head-major" : "token-major");
  std::mt19937_64 rng(31);
  Geometry g = testing::MakeGeometry(8, 4, 64, 16);
  g.head_major = head_major;
  TestContext c(g, 16 * 64 - 3);
  c.FillNormal(rng);
  const auto q = testing::RandomQuery(g, rng, 2.0f);
  const auto digests = c.Digests();
  SelectOptions o;
  o.budget_tokens = 16 * 8;
  Selection sel;
  ASSERT_TRUE(SelectPages(g, q.data(), digests.data(), c.tokens(), o, &sel).ok());
  ASSERT_FALSE(sel.SameForAllHeads()) << "random heads chose the same pages: the test would not take the per-head path";
  Partial got;
  ASSERT_TRUE(Attend(g, q.data(), c.View(), &sel, 0, &got).ok());
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    auto mine = sel.Of(h);
    Selection alone = Selection::SamePagesForAllHeads(g.num_kv_heads, std::vector<uint32_t>(mine.begin(), mine.end()));
    Partial want;
    ASSERT_TRUE(Attend(g, q.data(), c.View(), &alone, 0, &want).ok());
    for (uint32_t head = h * g.group(); head < (h + 1) * g.group(); ++head) {
      ASSERT_EQ(got.lse[head], want.lse[head]) << "head " << head;
      for (uint32_t d = 0; d < g.head_dim; ++d) {
        ASSERT_EQ(got.out[head * g.head_dim + d], want.out[head * g.head_dim + d]) << "head " << head;
      }
      // fp64 over the same tokens: the dense softmax restricted to them, renormalized.
      const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
      double m = -INFINITY;
      std::vector<std::pair<uint64_t, double>> logits;
      for (uint32_t p : mine) {
        for (uint64_t t = uint64_t{p} * g.page_tokens; t < std::min(c.tokens(), uint64_t{p + 1} * g.page_tokens); ++t) {
          double l = 0;
          for (uint32_t d = 0; d < g.head_dim; ++d) l += double{q[head * g.head_dim + d]} * c.Key(t, h, d);
          logits.push_back({t, l * scale});
          m = std::max(m, l * scale);
        }
      }
      double sum = 0;
      std::vector<double> out(g.head_dim, 0.0);
      for (auto& [t, l] : logits) {
        const double w = std::exp(l - m);
        sum += w;
        for (uint32_t d = 0; d < g.head_dim; ++d) out[d] += w * c.Value(t, h, d);
      }
      EXPECT_NEAR(got.lse[head], m + std::log(sum), 1e-4 * std::max(1.0, std::fabs(m)));
      for (uint32_t d = 0; d < g.head_dim; ++d) EXPECT_NEAR(got.out[head * g.head_dim + d], out[d] / sum, 1e-4);
    }
  }
  }
}

// The same KV in pool block format 2 (head-major) as in format 1 (token-major): the digests are
// the same bytes, and dense attention, the selection and attention over it are bit for bit the
// same, on every dtype, with a partial last page; the pages differ only in where rows sit.
TEST(PnmAttend, HeadMajorPagesGiveTokenMajorsResultsBitForBit) {
  for (KvDtype dtype : {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp32}) {
    SCOPED_TRACE(static_cast<int>(dtype));
    Geometry token = testing::MakeGeometry(12, 3, 64, 16, dtype), head = token;
    head.head_major = true;
    const uint64_t tokens = 16 * 40 - 5;
    TestContext a(token, tokens), b(head, tokens);
    std::mt19937_64 rng(77);
    std::normal_distribution<float> n(0.0f, 1.5f);
    for (uint64_t t = 0; t < tokens; ++t) {
      for (uint32_t h = 0; h < token.num_kv_heads; ++h) {
        for (uint32_t d = 0; d < token.head_dim; ++d) {
          const float k = n(rng), v = n(rng);
          a.SetKey(t, h, d, k);
          b.SetKey(t, h, d, k);
          a.SetValue(t, h, d, v);
          b.SetValue(t, h, d, v);
        }
      }
    }
    const auto da = a.Digests(), db = b.Digests();
    ASSERT_FALSE(da.empty());
    ASSERT_EQ(da, db);
    const auto q = testing::RandomQuery(token, rng, 2.0f);
    Partial dense_a, dense_b;
    ASSERT_TRUE(Attend(token, q.data(), a.View(), nullptr, 0, &dense_a).ok());
    ASSERT_TRUE(Attend(head, q.data(), b.View(), nullptr, 0, &dense_b).ok());
    EXPECT_EQ(dense_a.out, dense_b.out);
    EXPECT_EQ(dense_a.lse, dense_b.lse);
    SelectOptions o;
    o.budget_tokens = 16 * 6;
    Selection sa, sb;
    ASSERT_TRUE(SelectPages(token, q.data(), da.data(), tokens, o, &sa).ok());
    ASSERT_TRUE(SelectPages(head, q.data(), db.data(), tokens, o, &sb).ok());
    for (uint32_t h = 0; h < token.num_kv_heads; ++h) {
      ASSERT_TRUE(std::ranges::equal(sa.Of(h), sb.Of(h))) << "KV head " << h;
    }
    Partial sparse_a, sparse_b;
    ASSERT_TRUE(Attend(token, q.data(), a.View(), &sa, 0, &sparse_a).ok());
    ASSERT_TRUE(Attend(head, q.data(), b.View(), &sb, 0, &sparse_b).ok());
    EXPECT_EQ(sparse_a.out, sparse_b.out);
    EXPECT_EQ(sparse_a.lse, sparse_b.lse);
    EXPECT_NE(sparse_a.out, dense_a.out);  // the selection left pages out: a different output
  }
}

// Split the pages into 1..64 random pieces (some empty), attend each piece, merge the partials
// in a random order: the union's attention, within fp32 rounding.
TEST(PnmAttend, PartialsOfAnySplitMergeExactlyInAnyOrder) {
  std::mt19937_64 rng(99);
  Geometry g = testing::MakeGeometry(8, 2, 32, 4, KvDtype::kFp16);
  TestContext c(g, 4 * 80 - 1);
  c.FillNormal(rng);
  for (float logit_scale : {1.0f, 60.0f}) {  // 60: logits in the hundreds, e^x far past fp32
    const auto q = testing::RandomQuery(g, rng, 1.0f);
    Partial whole;
    ASSERT_TRUE(Attend(g, q.data(), c.View(), nullptr, logit_scale, &whole).ok());
    const auto dense = testing::DenseFp64(c, q, logit_scale);
    ExpectClose(whole, dense, 1e-3, "whole");
    for (int trial = 0; trial < 40; ++trial) {
      const uint32_t pieces = 1 + static_cast<uint32_t>(rng() % 64);
      std::vector<std::vector<uint32_t>> split(pieces);
      for (uint32_t p = 0; p < c.View().pages.size(); ++p) split[rng() % pieces].push_back(p);
      std::shuffle(split.begin(), split.end(), rng);
      Partial merged;
      for (const auto& piece : split) {
        Partial part;
        Selection sel = Selection::SamePagesForAllHeads(g.num_kv_heads, piece);
        ASSERT_TRUE(Attend(g, q.data(), c.View(), &sel, logit_scale, &part).ok());
        if (piece.empty()) {
          for (float s : part.lse) ASSERT_EQ(s, -INFINITY);
          for (float v : part.out) ASSERT_EQ(v, 0.0f);
        }
        ASSERT_TRUE(MergeInto(part, &merged).ok());
      }
      for (uint32_t i = 0; i < whole.out.size(); ++i) {
        ASSERT_NEAR(merged.out[i], whole.out[i], 2e-5f * (1 + std::fabs(whole.out[i]))) << pieces << " pieces";
      }
      for (uint32_t h = 0; h < g.num_heads; ++h) {
        ASSERT_NEAR(merged.lse[h], whole.lse[h], 2e-5f * (1 + std::fabs(whole.lse[h]))) << pieces << " pieces";
      }
    }
  }
}

TEST(PnmAttend, MergingEmptyPartialsAndExtremeLogSumExpsStaysFinite) {
  Partial a, b, empty;
  a.Reset(1, 16);
  b.Reset(1, 16);
  empty.Reset(1, 16);
  for (uint32_t d = 0; d < 16; ++d) {
    a.out[d] = 1.0f;
    b.out[d] = -1.0f;
  }
  a.lse[0] = 1000.0f;  // e^1000 overflows fp32: the merge must work with differences only
  b.lse[0] = 1000.0f;
  Partial acc;
  ASSERT_TRUE(MergeInto(empty, &acc).ok());
  ASSERT_TRUE(MergeInto(a, &acc).ok());
  ASSERT_TRUE(MergeInto(empty, &acc).ok());
  ASSERT_TRUE(MergeInto(b, &acc).ok());
  for (float v : acc.out) EXPECT_NEAR(v, 0.0f, 1e-6f);
  EXPECT_NEAR(acc.lse[0], 1000.0f + std::log(2.0f), 1e-3f);
  b.lse[0] = -1000.0f;  // negligible next to a
  acc = Partial{};
  ASSERT_TRUE(MergeInto(b, &acc).ok());
  ASSERT_TRUE(MergeInto(a, &acc).ok());
  for (float v : acc.out) EXPECT_EQ(v, 1.0f);
  EXPECT_EQ(acc.lse[0], 1000.0f);
  Partial other;
  other.Reset(2, 16);
  Status s = MergeInto(other, &acc);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(acc.lse[0], 1000.0f) << "a refused merge changed the accumulator";
}

TEST(PnmAttend, BadInputIsRefusedAndLeavesTheOutputAlone) {
  Geometry g = testing::MakeGeometry(4, 2, 16, 8);
  TestContext c(g, 20);
  std::vector<float> q(4 * 16, 1.0f);
  Partial out;
  out.Reset(4, 16);
  out.lse[0] = 42.0f;
  Selection wrong_heads = Selection::All(3, 3);
  Status s = Attend(g, q.data(), c.View(), &wrong_heads, 0, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("3 KV heads"), std::string::npos) << s.message();
  Selection past = Selection::SamePagesForAllHeads(2, {0, 5});
  s = Attend(g, q.data(), c.View(), &past, 0, &out);
  EXPECT_NE(s.message().find("page 5 is past"), std::string::npos) << s.message();
  std::vector<PageKv> pages(c.View().pages.begin(), c.View().pages.end());
  pages[1].v = nullptr;
  s = Attend(g, q.data(), ContextView{pages, 20}, nullptr, 0, &out);
  EXPECT_NE(s.message().find("null"), std::string::npos) << s.message();
  EXPECT_EQ(out.lse[0], 42.0f);
}

}  // namespace
}  // namespace cxlkv::pnm
