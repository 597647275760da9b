// The reference engine decoding with near-memory sparse and hybrid attention:
// a budget that covers the context reproduces dense decoding; the hybrid's engine/near-memory
// split merges into exactly the sparse result; digests grown token by token equal a bulk build;
// a new sequence in the same instance starts clean; bad input is refused with a reason.
#include "engine/sparse_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "engine/model.h"
#include "decode_test_util.h"
#include "engine_test_util.h"

namespace cxlkv::engine {
namespace {

using test_util::Allocate;
using test_util::RandomTokens;
using test_util::TestWeights;

// GQA 4:1 with a head_dim the pnm kernels take (a multiple of 16).
ModelConfig SparseConfig() { return test_util::GqaConfig("tiny-sparse"); }

constexpr uint32_t kBlock = 16;
constexpr uint32_t kPrompt = 700;  // 44 pages, the last one partial
constexpr uint32_t kSteps = 12;

// A sequence of kPrompt tokens prefilled in its own cache, and kSteps decode steps.
struct Sequence : test_util::PrefilledSequence {
  explicit Sequence(const Model& m) : PrefilledSequence(m, kPrompt, 64, kBlock, 11) {}
};

std::vector<std::vector<float>> DecodeSteps(const Model& m, Sequence& s, DecodeAttention* a,
                                            const std::vector<int32_t>& forced = {}) {
  return test_util::DecodeSteps(m, s, a, kSteps, forced);
}

using test_util::RelativeError;

std::unique_ptr<SparseDecodeAttention> Make(const Model& m, AttentionMode mode, uint32_t budget,
                                            uint32_t resident = 0, uint32_t threads = 0,
                                            bool audit = false) {
  SparseAttentionOptions o;
  o.mode = mode;
  o.select.budget_tokens = budget;
  o.resident_pages = resident;
  o.threads = threads;
  o.audit = audit;
  auto a = SparseDecodeAttention::Create(m.config(), kBlock, o);
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  return a.ok() ? std::move(a).value() : nullptr;
}

class SparseDecode : public ::testing::Test {
 protected:
  SparseDecode() : model(SparseConfig(), TestWeights(SparseConfig())) {}
  Model model;
};

TEST_F(SparseDecode, BudgetCoveringTheContextEqualsDenseDecoding) {
  Sequence dense_seq(model);
  const auto dense = DecodeSteps(model, dense_seq, nullptr);
  std::vector<int32_t> forced;
  for (const auto& l : dense) forced.push_back(Model::Argmax(l));
  for (AttentionMode mode : {AttentionMode::kSparse, AttentionMode::kHybrid}) {
    Sequence s(model);
    auto a = Make(model, mode, /*budget=*/4096, /*resident=*/8, 0, /*audit=*/true);
    ASSERT_NE(a, nullptr);
    const auto got = DecodeSteps(model, s, a.get(), forced);
    ASSERT_EQ(got.size(), dense.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(RelativeError(got[i], dense[i]), 1e-4) << AttentionModeName(mode) << " step " << i;
      EXPECT_EQ(Model::Argmax(got[i]), forced[i]) << AttentionModeName(mode) << " step " << i;
    }
    const SparseAttentionStats& st = a->stats();
    EXPECT_EQ(st.layer_steps, uint64_t{kSteps} * model.config().num_layers);
    EXPECT_EQ(st.selected_pages, st.context_pages);
    ASSERT_GT(st.mass_recall_count, 0u);
    EXPECT_NEAR(st.mass_recall_min, 1.0, 1e-4);
  }
}

TEST_F(SparseDecode, HybridMergesIntoTheSparseResultAndCountsItsRecalls) {
  Sequence a_seq(model), b_seq(model);
  auto sparse = Make(model, AttentionMode::kSparse, /*budget=*/128);
  auto hybrid = Make(model, AttentionMode::kHybrid, /*budget=*/128, /*resident=*/3);
  ASSERT_NE(sparse, nullptr);
  ASSERT_NE(hybrid, nullptr);
  const auto s = DecodeSteps(model, a_seq, sparse.get());
  std::vector<int32_t> forced;
  for (const auto& l : s) forced.push_back(Model::Argmax(l));
  const auto h = DecodeSteps(model, b_seq, hybrid.get(), forced);
  ASSERT_EQ(h.size(), s.size());
  // Same pages selected, attended in two parts and merged: equal up to fp32 rounding.
  for (size_t i = 0; i < h.size(); ++i) EXPECT_LT(RelativeError(h[i], s[i]), 1e-4) << "step " << i;
  const SparseAttentionStats& st = hybrid->stats();
  EXPECT_GT(st.recalled_pages, 0u);
  EXPECT_GT(st.engine_kv_bytes, 0u);
  EXPECT_EQ(st.recalled_bytes, st.recalled_pages * 2 * kBlock * 16 * sizeof(float));
  const uint64_t qol = (2 * 8 * 16 + 8) * sizeof(float);  // q, out, lse per layer step
  EXPECT_EQ(st.link_bytes, st.layer_steps * qol + st.recalled_bytes);
  // What the engine read plus what was read next to the memory is the selection, page for page.
  EXPECT_EQ(st.engine_kv_bytes + st.near_kv_bytes,
            st.selected_pages * 2 * kBlock * 16 * sizeof(float));
  // At most `resident` pages per (layer, KV head) were ever held, so recalls only replace.
  EXPECT_EQ(sparse->stats().selected_pages, st.selected_pages);
  EXPECT_EQ(sparse->stats().recalled_pages, 0u);
}

TEST_F(SparseDecode, SmallBudgetAttendsFewerPagesAndReportsItsMass) {
  Sequence s(model);
  auto a = Make(model, AttentionMode::kSparse, /*budget=*/64, 0, 0, /*audit=*/true);
  ASSERT_NE(a, nullptr);
  DecodeSteps(model, s, a.get());
  const SparseAttentionStats& st = a->stats();
  // 64 tokens = 4 pages per KV head, of 44-45.
  EXPECT_EQ(st.selected_pages, st.layer_steps * 2 * 4);
  ASSERT_GT(st.mass_recall_count, 0u);
  EXPECT_GT(st.mass_recall_min, 0.0);
  EXPECT_LT(st.mass_recall_min, 1.0);
  EXPECT_LE(st.mass_recall_sum, double(st.mass_recall_count));
}

TEST_F(SparseDecode, DigestsGrownStepByStepEqualABulkBuild) {
  Sequence s(model);
  auto grown = Make(model, AttentionMode::kSparse, 96);
  ASSERT_NE(grown, nullptr);
  const auto steps = DecodeSteps(model, s, grown.get());
  ASSERT_EQ(steps.size(), kSteps);
  // A fresh instance sees the whole sequence at once on the next step; a copy of the cache keeps
  // both on the same bytes.
  const uint32_t pos = kPrompt + kSteps;
  const int32_t token = Model::Argmax(steps.back());
  Sequence copy(model);
  for (uint32_t l = 0; l < model.config().num_layers; ++l) {
    for (uint32_t b = 0; b < 64; ++b) {
      std::memcpy(copy.cache.Key(l, copy.table[b], 0), s.cache.Key(l, s.table[b], 0),
                  sizeof(float) * kBlock * s.cache.row_floats());
      std::memcpy(copy.cache.Value(l, copy.table[b], 0), s.cache.Value(l, s.table[b], 0),
                  sizeof(float) * kBlock * s.cache.row_floats());
    }
  }
  auto fresh = Make(model, AttentionMode::kSparse, 96);
  ASSERT_NE(fresh, nullptr);
  ASSERT_TRUE(fresh->Prepare(copy.cache, copy.table, pos).ok());
  auto a = model.Decode(token, pos, s.cache, s.table, grown.get());
  auto b = model.Decode(token, pos, copy.cache, copy.table, fresh.get());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(test_util::BitwiseEqual(*a, *b));
}

TEST_F(SparseDecode, AnotherSequenceInTheSameInstanceStartsClean) {
  // Two sequences in one cache, different blocks; one instance used on A then on B must give
  // B's result of a fresh instance, bit for bit.
  PagedKvCache cache(model.config(), 128, kBlock);
  const auto ta = Allocate(cache, 64), tb = Allocate(cache, 64);
  const auto tok_a = RandomTokens(kPrompt, model.config().vocab_size, 1);
  const auto tok_b = RandomTokens(kPrompt - 100, model.config().vocab_size, 2);
  ASSERT_TRUE(model.Prefill(tok_a, 0, cache, ta).ok());
  auto lb = model.Prefill(tok_b, 0, cache, tb);
  ASSERT_TRUE(lb.ok());
  for (AttentionMode mode : {AttentionMode::kSparse, AttentionMode::kHybrid}) {
    auto reused = Make(model, mode, 80, 2);
    auto fresh = Make(model, mode, 80, 2);
    ASSERT_TRUE(model.Decode(5, kPrompt, cache, ta, reused.get()).ok());
    const int32_t t = Model::Argmax(*lb);
    const uint32_t pos = kPrompt - 100;
    auto x = model.Decode(t, pos, cache, tb, reused.get());
    auto y = model.Decode(t, pos, cache, tb, fresh.get());
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_TRUE(test_util::BitwiseEqual(*x, *y)) << AttentionModeName(mode);
  }
}

TEST_F(SparseDecode, AShorterSequenceSharingAPrefixThenGrowingMatchesAFreshInstance) {
  // B is A's first 200 tokens (its first 15 blocks are A's: a cached prefix) and then grows
  // into blocks of its own. An instance that saw A must not keep A's views past B's end when B
  // grows into them.
  PagedKvCache cache(model.config(), 128, kBlock);
  const auto ta = Allocate(cache, 64), own = Allocate(cache, 64);
  const auto tok_a = RandomTokens(kPrompt, model.config().vocab_size, 1);
  std::vector<uint32_t> tb(ta.begin(), ta.begin() + 15);
  tb.insert(tb.end(), own.begin(), own.begin() + 49);
  for (AttentionMode mode : {AttentionMode::kSparse, AttentionMode::kHybrid}) {
    ASSERT_TRUE(model.Prefill(tok_a, 0, cache, ta).ok());
    auto reused = Make(model, mode, 64, 2);
    auto fresh = Make(model, mode, 64, 2);
    ASSERT_TRUE(model.Decode(5, kPrompt, cache, ta, reused.get()).ok());
    int32_t t = tok_a[200];
    for (uint32_t pos = 200; pos < 280; ++pos) {  // past position 240: B's own blocks
      auto x = model.Decode(t, pos, cache, tb, reused.get());
      auto y = model.Decode(t, pos, cache, tb, fresh.get());
      ASSERT_TRUE(x.ok() && y.ok());
      ASSERT_TRUE(test_util::BitwiseEqual(*x, *y)) << AttentionModeName(mode) << " pos " << pos;
      t = Model::Argmax(*x);
    }
  }
}

TEST_F(SparseDecode, NearMemoryThreadsGiveTheSameBits) {
  Sequence a_seq(model), b_seq(model);
  auto alone = Make(model, AttentionMode::kSparse, 128, 0, /*threads=*/0);
  auto pooled = Make(model, AttentionMode::kSparse, 128, 0, /*threads=*/2);
  const auto a = DecodeSteps(model, a_seq, alone.get());
  const auto b = DecodeSteps(model, b_seq, pooled.get());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(test_util::BitwiseEqual(a[i], b[i])) << "step " << i;
}

TEST_F(SparseDecode, RefusesWhatItCannotServe) {
  SparseAttentionOptions o;
  o.mode = AttentionMode::kDense;
  EXPECT_EQ(SparseDecodeAttention::Create(model.config(), kBlock, o).status().code(),
            StatusCode::kInvalidArgument);
  o.mode = AttentionMode::kSparse;
  o.select.budget_tokens = 0;
  EXPECT_EQ(SparseDecodeAttention::Create(model.config(), kBlock, o).status().code(),
            StatusCode::kInvalidArgument);
  o.select.budget_tokens = 64;
  auto small = SparseDecodeAttention::Create(test_util::TinyConfig(), kBlock, o);  // head_dim 8
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("head_dim"), std::string::npos)
      << small.status().ToString();
  EXPECT_EQ(ParseAttentionMode("sparse").value(), AttentionMode::kSparse);
  EXPECT_FALSE(ParseAttentionMode("fast").ok());

  auto a = Make(model, AttentionMode::kSparse, 64);
  Sequence s(model);
  std::vector<float> q(8 * 16, 0.1f), out(8 * 16);
  EXPECT_EQ(a->Attend(99, q.data(), 10, s.cache, s.table, out.data()).code(),
            StatusCode::kInvalidArgument);
  PagedKvCache other(test_util::TinyConfig(), 8, kBlock);
  EXPECT_EQ(a->Attend(0, q.data(), 10, other, s.table, out.data()).code(),
            StatusCode::kInvalidArgument);
  std::vector<uint32_t> short_table(2, 0);
  EXPECT_EQ(a->Attend(0, q.data(), 100, s.cache, short_table, out.data()).code(),
            StatusCode::kInvalidArgument);
  std::vector<uint32_t> bad_table(64, 9999);
  EXPECT_EQ(a->Attend(0, q.data(), 10, s.cache, bad_table, out.data()).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cxlkv::engine
