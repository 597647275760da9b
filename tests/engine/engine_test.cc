// The reference engine's model: bitwise-identical KV and logits whatever the prefill start (the
// property prefix caching relies on), agreement with a naive straight-line implementation,
// greedy decoding, and bad requests.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/attention.h"
#include "engine/model.h"
#include "engine_test_util.h"

namespace cxlkv::engine {
namespace {

using test_util::Allocate;
using test_util::BitwiseEqual;
using test_util::RandomTokens;
using test_util::TestWeights;
using test_util::TinyConfig;
using test_util::TokenKv;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// (1) Prefix reuse is bitwise identical.

// Prefills `n` tokens from 0; then, for each k, prefills only the first k blocks into a cache
// of its own, copies that KV into a third cache with other physical block ids -- layer l only
// inside before_layer(l), as a connector would -- and prefills the rest from k * bs.
void CheckPrefixReuse(const ModelConfig& c, uint32_t bs, uint32_t n, std::vector<uint32_t> ks) {
  const Model model(c, TestWeights(c));
  ASSERT_TRUE(model.status().ok()) << model.status().ToString();
  const std::vector<int32_t> tokens = RandomTokens(n, c.vocab_size, 11);
  const uint32_t nblocks = (n + bs - 1) / bs;

  PagedKvCache full(c, nblocks, bs);
  const std::vector<uint32_t> full_table = Allocate(full, nblocks);
  Result<std::vector<float>> full_logits = model.Prefill(tokens, 0, full, full_table);
  ASSERT_TRUE(full_logits.ok()) << full_logits.status().ToString();

  for (uint32_t k : ks) {
    SCOPED_TRACE("prefix blocks " + std::to_string(k));
    PagedKvCache prefix(c, k, bs);
    const std::vector<uint32_t> prefix_table = Allocate(prefix, k);
    ASSERT_TRUE(model.Prefill(std::span(tokens).first(k * bs), 0, prefix, prefix_table).ok());
    for (uint32_t pos = 0; pos < k * bs; ++pos) {
      ASSERT_TRUE(BitwiseEqual(TokenKv(prefix, prefix_table, pos), TokenKv(full, full_table, pos)))
          << "a shorter prefill computed other KV bytes at position " << pos;
    }

    PagedKvCache reuse(c, nblocks + 3, bs);
    std::vector<uint32_t> ids = Allocate(reuse, nblocks + 3);
    std::reverse(ids.begin(), ids.end());
    const std::vector<uint32_t> table(ids.begin(), ids.begin() + nblocks);
    std::vector<uint32_t> hooked;
    auto load_layer = [&](uint32_t l) {
      hooked.push_back(l);
      const uint64_t bytes = uint64_t{bs} * reuse.row_floats() * sizeof(float);
      for (uint32_t b = 0; b < k; ++b) {
        std::memcpy(reuse.Key(l, table[b], 0), prefix.Key(l, prefix_table[b], 0), bytes);
        std::memcpy(reuse.Value(l, table[b], 0), prefix.Value(l, prefix_table[b], 0), bytes);
      }
    };
    Result<std::vector<float>> logits = model.Prefill(tokens, k * bs, reuse, table, load_layer);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    std::vector<uint32_t> want(c.num_layers);
    std::iota(want.begin(), want.end(), 0u);
    EXPECT_EQ(hooked, want);
    EXPECT_TRUE(BitwiseEqual(*logits, *full_logits)) << "logits differ from the prefill from 0";
    for (uint32_t pos = 0; pos < n; ++pos) {
      ASSERT_TRUE(BitwiseEqual(TokenKv(reuse, table, pos), TokenKv(full, full_table, pos)))
          << "KV bytes differ at position " << pos;
    }
  }
}

TEST(EnginePrefill, PrefixReuseIsBitwiseIdenticalDefaultConfig) {
  CheckPrefixReuse(ModelConfig{}, 16, 16 * 5 + 7, {1, 3, 5});
}

TEST(EnginePrefill, PrefixReuseIsBitwiseIdenticalTinyConfigSmallBlocks) {
  CheckPrefixReuse(TinyConfig(), 4, 4 * 9, {1, 4, 8});
}

// ---------------------------------------------------------------------------------------------
// (2) Agreement with a straight-line implementation: no paging, plain loops, double sums.

using Vec = std::vector<double>;

Vec MatVec(const std::vector<float>& w, uint32_t out, uint32_t in, const Vec& x) {
  Vec y(out, 0.0);
  for (uint32_t o = 0; o < out; ++o) {
    for (uint32_t i = 0; i < in; ++i) y[o] += static_cast<double>(w[uint64_t{o} * in + i]) * x[i];
  }
  return y;
}

Vec NaiveRmsNorm(const Vec& x, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

void NaiveRope(double* v, uint32_t hd, double pos, double theta) {
  for (uint32_t i = 0; i < hd / 2; ++i) {
    const double angle = pos * std::pow(theta, -2.0 * i / hd);
    const double a = v[i], b = v[i + hd / 2];
    v[i] = a * std::cos(angle) - b * std::sin(angle);
    v[i + hd / 2] = b * std::cos(angle) + a * std::sin(angle);
  }
}

// The logits of every position of `tokens`.
std::vector<Vec> NaiveLogits(const ModelConfig& c, const Weights& w,
                             const std::vector<int32_t>& tokens) {
  const uint32_t n = static_cast<uint32_t>(tokens.size()), h = c.hidden_size, hd = c.head_dim;
  const uint32_t nh = c.num_heads, nkv = c.num_kv_heads, inter = c.intermediate_size;
  std::vector<Vec> x(n);
  for (uint32_t t = 0; t < n; ++t) {
    x[t].assign(&w.embed_tokens()[uint64_t(tokens[t]) * h],
                &w.embed_tokens()[uint64_t(tokens[t]) * h] + h);
  }
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = w.layer(l);
    std::vector<Vec> q(n), k(n), v(n);
    for (uint32_t t = 0; t < n; ++t) {
      const Vec xn = NaiveRmsNorm(x[t], lw.input_layernorm, c.rms_norm_eps);
      q[t] = MatVec(lw.q_proj, nh * hd, h, xn);
      k[t] = MatVec(lw.k_proj, nkv * hd, h, xn);
      v[t] = MatVec(lw.v_proj, nkv * hd, h, xn);
      for (uint32_t hh = 0; hh < nh; ++hh) NaiveRope(&q[t][hh * hd], hd, t, c.rope_theta);
      for (uint32_t hh = 0; hh < nkv; ++hh) NaiveRope(&k[t][hh * hd], hd, t, c.rope_theta);
    }
    for (uint32_t t = 0; t < n; ++t) {
      Vec attn(nh * hd, 0.0);
      for (uint32_t hh = 0; hh < nh; ++hh) {
        const uint32_t g = hh / (nh / nkv);
        Vec s(t + 1);
        double mx = -1e300;
        for (uint32_t j = 0; j <= t; ++j) {
          s[j] = 0;
          for (uint32_t d = 0; d < hd; ++d) s[j] += q[t][hh * hd + d] * k[j][g * hd + d];
          s[j] /= std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (uint32_t j = 0; j <= t; ++j) {
          for (uint32_t d = 0; d < hd; ++d) attn[hh * hd + d] += s[j] / sum * v[j][g * hd + d];
        }
      }
      const Vec o = MatVec(lw.o_proj, h, nh * hd, attn);
      for (uint32_t i = 0; i < h; ++i) x[t][i] += o[i];
      const Vec xn = NaiveRmsNorm(x[t], lw.post_attention_layernorm, c.rms_norm_eps);
      const Vec gate = MatVec(lw.gate_proj, inter, h, xn), up = MatVec(lw.up_proj, inter, h, xn);
      Vec act(inter);
      for (uint32_t i = 0; i < inter; ++i) act[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      const Vec down = MatVec(lw.down_proj, h, inter, act);
      for (uint32_t i = 0; i < h; ++i) x[t][i] += down[i];
    }
  }
  std::vector<Vec> logits(n);
  for (uint32_t t = 0; t < n; ++t) {
    logits[t] = MatVec(w.lm_head(), c.vocab_size, h, NaiveRmsNorm(x[t], w.norm(), c.rms_norm_eps));
  }
  return logits;
}

void ExpectClose(const std::vector<float>& got, const Vec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1.0, worst = 0.0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst / scale, 1e-4) << what << ": largest difference " << worst;
  EXPECT_EQ(Model::Argmax(got), std::max_element(want.begin(), want.end()) - want.begin()) << what;
}

// Shapes that take every path of the attention kernel: GQA groups of 2, 3, 8 and 1 (MHA),
// head_dim a multiple of 8, with a tail, and below 8.
std::vector<ModelConfig> ReferenceConfigs() {
  std::vector<ModelConfig> out = {TinyConfig()};
  auto shape = [&](uint32_t heads, uint32_t kv_heads, uint32_t head_dim) {
    ModelConfig c = TinyConfig();
    c.num_heads = heads;
    c.num_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.hidden_size = heads * head_dim;
    c.name = "tiny-" + std::to_string(heads) + "x" + std::to_string(kv_heads) + "x" +
             std::to_string(head_dim);
    out.push_back(c);
  };
  shape(6, 2, 10);
  shape(8, 1, 12);
  shape(2, 2, 6);
  return out;
}

TEST(EngineReference, PrefillAndDecodeMatchStraightLineImplementation) {
  for (const ModelConfig& c : ReferenceConfigs()) {
    SCOPED_TRACE(c.name);
    Weights w = TestWeights(c);
    const Weights reference_weights = w;  // Model takes its copy apart
    const Model model(c, std::move(w));
    ASSERT_TRUE(model.status().ok()) << model.status().ToString();
    const uint32_t bs = 4, prompt = 21, steps = 5;
    const std::vector<int32_t> tokens = RandomTokens(prompt + steps, c.vocab_size, 3);
    const std::vector<Vec> want = NaiveLogits(c, reference_weights, tokens);

    for (uint32_t start : {0u, 8u}) {
      SCOPED_TRACE("prefill start " + std::to_string(start));
      PagedKvCache cache(c, 12, bs);
      std::vector<uint32_t> table = Allocate(cache, 12);
      std::shuffle(table.begin(), table.end(), std::mt19937_64(5));
      if (start > 0) {  // the prefix computed by an earlier request
        ASSERT_TRUE(model.Prefill(std::span(tokens).first(start), 0, cache, table).ok());
      }
      Result<std::vector<float>> logits =
          model.Prefill(std::span(tokens).first(prompt), start, cache, table);
      ASSERT_TRUE(logits.ok()) << logits.status().ToString();
      ExpectClose(*logits, want[prompt - 1], "prefill");
      for (uint32_t i = 0; i < steps; ++i) {
        Result<std::vector<float>> d = model.Decode(tokens[prompt + i], prompt + i, cache, table);
        ASSERT_TRUE(d.ok()) << d.status().ToString();
        ExpectClose(*d, want[prompt + i], "decode step " + std::to_string(i));
      }
    }
  }
}

TEST(EngineReference, ExpKernelIsAccurate) {
  for (float x = -87.0f; x <= 0.0f; x += 0.013f) {
    const double want = std::exp(static_cast<double>(x));
    EXPECT_NEAR(internal::ExpNonPositiveForTest(x), want, want * 3e-7) << "x = " << x;
  }
  EXPECT_EQ(internal::ExpNonPositiveForTest(0.0f), 1.0f);
  EXPECT_GT(internal::ExpNonPositiveForTest(-1000.0f), 0.0f);
}

// ---------------------------------------------------------------------------------------------
// (3) Greedy decoding.

TEST(EngineGenerate, IsDeterministicAndDecodeEqualsPrefillOfTheExtendedSequence) {
  const ModelConfig c = TinyConfig();
  const Model model(c, TestWeights(c));
  const uint32_t bs = 8, max_new = 12;
  const std::vector<int32_t> prompt = RandomTokens(21, c.vocab_size, 9);
  const uint32_t nblocks = (21 + max_new + bs - 1) / bs;

  PagedKvCache cache(c, nblocks, bs);
  const std::vector<uint32_t> table = Allocate(cache, nblocks);
  Result<std::vector<int32_t>> first = model.Generate(prompt, 0, max_new, cache, table);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->size(), max_new);
  // Again into a fresh cache, and into the same one reusing its first two blocks.
  PagedKvCache fresh(c, nblocks, bs);
  EXPECT_EQ(model.Generate(prompt, 0, max_new, fresh, Allocate(fresh, nblocks)).value(), *first);
  EXPECT_EQ(model.Generate(prompt, 2 * bs, max_new, cache, table).value(), *first);

  // Decode logits are bitwise those of prefilling the whole extended sequence.
  std::vector<int32_t> seq = prompt;
  PagedKvCache step_cache(c, nblocks, bs);
  const std::vector<uint32_t> step_table = Allocate(step_cache, nblocks);
  Result<std::vector<float>> logits = model.Prefill(seq, 0, step_cache, step_table);
  for (uint32_t i = 0; i < max_new; ++i) {
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    PagedKvCache whole(c, nblocks, bs);
    Result<std::vector<float>> want = model.Prefill(seq, 0, whole, Allocate(whole, nblocks));
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(Model::Argmax(*want), (*first)[i]) << "step " << i;
    EXPECT_TRUE(BitwiseEqual(*logits, *want)) << "step " << i;
    seq.push_back(Model::Argmax(*logits));
    logits =
        model.Decode(seq.back(), static_cast<uint32_t>(seq.size() - 1), step_cache, step_table);
  }
}

TEST(EngineGenerate, ArgmaxTakesTheLowestIndexOnTies) {
  EXPECT_EQ(Model::Argmax(std::vector<float>{1.0f, 3.0f, 3.0f, -1.0f}), 1);
  EXPECT_EQ(Model::Argmax(std::vector<float>{NAN, 0.5f, 0.25f}), 1);
  EXPECT_EQ(Model::Argmax(std::vector<float>{}), -1);
}

// ---------------------------------------------------------------------------------------------
// (7) Bad input is rejected whole.

TEST(EngineBadInput, PrefillAndDecodeRejectBadRequestsWithoutWriting) {
  const ModelConfig c = TinyConfig();
  const Model model(c, TestWeights(c));
  PagedKvCache cache(c, 4, 4);
  const std::vector<uint32_t> table = Allocate(cache, 4);
  std::vector<int32_t> tokens = RandomTokens(10, c.vocab_size, 4);
  auto expect_invalid = [&](Result<std::vector<float>> r, const std::string& what) {
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(r.status().message(), HasSubstr(what));
  };
  expect_invalid(model.Prefill(tokens, 3, cache, table), "multiple of the block size");
  expect_invalid(model.Prefill(tokens, 12, cache, table), "below the number of tokens");
  expect_invalid(model.Prefill({}, 0, cache, table), "below the number of tokens");
  expect_invalid(model.Prefill(tokens, 0, cache, std::span(table).first(2)), "block table");
  const std::vector<uint32_t> out_of_range = {0, 1, 7};
  expect_invalid(model.Prefill(tokens, 0, cache, out_of_range), "block 7");
  tokens[9] = static_cast<int32_t>(c.vocab_size);
  expect_invalid(model.Prefill(tokens, 0, cache, table), "vocabulary");
  tokens[9] = -1;
  expect_invalid(model.Prefill(tokens, 0, cache, table), "vocabulary");
  tokens[9] = 0;
  expect_invalid(model.Decode(1, 16, cache, table), "block table");
  expect_invalid(model.Decode(-5, 0, cache, table), "vocabulary");
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    for (uint32_t b = 0; b < 4; ++b) {
      for (uint32_t r = 0; r < 4; ++r) {
        ASSERT_EQ(cache.Key(l, b, r)[0], 0.0f) << "a rejected request wrote KV";
      }
    }
  }

  ModelConfig short_context = c;
  short_context.max_position = 8;
  const Model short_model(short_context, TestWeights(short_context));
  expect_invalid(short_model.Prefill(tokens, 0, cache, table), "max_position");

  ModelConfig other = c;
  other.num_layers = 3;
  PagedKvCache other_cache(other, 4, 4);
  expect_invalid(model.Prefill(tokens, 0, other_cache, Allocate(other_cache, 4)), "layers");

  const Model mismatched(c, TestWeights(other));
  EXPECT_FALSE(mismatched.status().ok());
  expect_invalid(mismatched.Prefill(tokens, 0, cache, table), "shape differs");

  // 10 tokens + 8 new need 17 positions (the last token is not fed back); the table has 16.
  Result<std::vector<int32_t>> g = model.Generate(tokens, 0, 8, cache, table);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(), HasSubstr("block table"));
  EXPECT_EQ(cache.Key(0, table[0], 0)[0], 0.0f) << "a rejected Generate prefilled";
  EXPECT_TRUE(model.Generate(tokens, 0, 7, cache, table).ok());
}

}  // namespace
}  // namespace cxlkv::engine
