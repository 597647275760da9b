// The reference engine: bitwise-identical KV and logits whatever the prefill start (the
// property prefix caching relies on), agreement with a naive straight-line implementation,
// greedy decoding, safetensors I/O, config parsing, the paged cache, and bad input.
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/attention.h"
#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace cxlkv::engine {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A small GQA model with non-default theta and eps, for exact checks.
ModelConfig TinyConfig() {
  ModelConfig c;
  c.name = "tiny-test";
  c.vocab_size = 97;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 48;
  c.rope_theta = 500.0f;
  c.rms_norm_eps = 1e-6f;
  c.max_position = 512;
  c.seed = 7;
  return c;
}

std::vector<int32_t> RandomTokens(uint32_t n, uint32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Random weights with non-trivial norm weights, so a forgotten norm weight shows.
Weights TestWeights(const ModelConfig& c) {
  Result<Weights> w = Weights::Random(c);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  std::mt19937_64 rng(c.seed + 100);
  auto perturb = [&](std::vector<float>& v) {
    for (auto& x : v) x = 0.5f + static_cast<float>(rng() % 1000) / 1000.0f;
  };
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    perturb(w->mutable_layer(l).input_layernorm);
    perturb(w->mutable_layer(l).post_attention_layernorm);
  }
  perturb(w->mutable_norm());
  return std::move(w).value();
}

std::vector<uint32_t> Allocate(PagedKvCache& cache, uint32_t n) {
  Result<std::vector<uint32_t>> ids = cache.AllocateBlocks(n);
  EXPECT_TRUE(ids.ok()) << ids.status().ToString();
  return ids.ok() ? ids.value() : std::vector<uint32_t>(n, 0);
}

// The KV bytes of position `pos`, every layer, K then V.
std::vector<float> TokenKv(PagedKvCache& cache, const std::vector<uint32_t>& table, uint32_t pos) {
  std::vector<float> out;
  const uint32_t bs = cache.block_size(), rf = cache.row_floats();
  for (uint32_t l = 0; l < cache.num_layers(); ++l) {
    const float* k = cache.Key(l, table[pos / bs], pos % bs);
    const float* v = cache.Value(l, table[pos / bs], pos % bs);
    out.insert(out.end(), k, k + rf);
    out.insert(out.end(), v, v + rf);
  }
  return out;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

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

TEST(EngineReference, PrefillAndDecodeMatchStraightLineImplementation) {
  const ModelConfig c = TinyConfig();
  Weights w = TestWeights(c);
  const Weights reference_weights = w;  // Model takes its copy apart
  const Model model(c, std::move(w));
  ASSERT_TRUE(model.status().ok()) << model.status().ToString();
  const uint32_t bs = 4, prompt = 13, steps = 5;
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

TEST(EngineReference, ExpKernelIsAccurate) {
  for (float x = -87.0f; x <= 0.0f; x += 0.013f) {
    const double want = std::exp(static_cast<double>(x));
    EXPECT_NEAR(internal::ExpNonPositiveForTest(x), want, want * 3e-7) << "x = " << x;
  }
  EXPECT_EQ(internal::ExpNonPositiveForTest(0.0f), 1.0f);
  EXPECT_EQ(internal::ExpNonPositiveForTest(5.0f), 1.0f);  // clamped
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
    logits = model.Decode(seq.back(), static_cast<uint32_t>(seq.size() - 1), step_cache, step_table);
  }
}

TEST(EngineGenerate, ArgmaxTakesTheLowestIndexOnTies) {
  EXPECT_EQ(Model::Argmax(std::vector<float>{1.0f, 3.0f, 3.0f, -1.0f}), 1);
  EXPECT_EQ(Model::Argmax(std::vector<float>{NAN, 0.5f, 0.25f}), 1);
  EXPECT_EQ(Model::Argmax(std::vector<float>{}), -1);
}

// ---------------------------------------------------------------------------------------------
// (4) safetensors.

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/cxlkv_engine_test_XXXXXX";
    const char* p = mkdtemp(tmpl);
    EXPECT_NE(p, nullptr);
    path_ = p != nullptr ? p : "/tmp";
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::string bytes;
};

// Every tensor of w under its HF name, as F32.
std::vector<RawTensor> F32Tensors(const Weights& w) {
  const ModelConfig& c = w.config();
  const uint64_t h = c.hidden_size, q = uint64_t{c.num_heads} * c.head_dim,
                 kv = uint64_t{c.num_kv_heads} * c.head_dim, in = c.intermediate_size;
  std::vector<RawTensor> out;
  auto add = [&](std::string name, std::vector<uint64_t> shape, const std::vector<float>& v) {
    out.push_back({std::move(name), "F32", std::move(shape),
                   std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4)});
  };
  add("model.embed_tokens.weight", {c.vocab_size, h}, w.embed_tokens());
  for (uint32_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const LayerWeights& l = w.layer(i);
    add(p + "self_attn.q_proj.weight", {q, h}, l.q_proj);
    add(p + "self_attn.k_proj.weight", {kv, h}, l.k_proj);
    add(p + "self_attn.v_proj.weight", {kv, h}, l.v_proj);
    add(p + "self_attn.o_proj.weight", {h, q}, l.o_proj);
    add(p + "mlp.gate_proj.weight", {in, h}, l.gate_proj);
    add(p + "mlp.up_proj.weight", {in, h}, l.up_proj);
    add(p + "mlp.down_proj.weight", {h, in}, l.down_proj);
    add(p + "input_layernorm.weight", {h}, l.input_layernorm);
    add(p + "post_attention_layernorm.weight", {h}, l.post_attention_layernorm);
  }
  add("model.norm.weight", {h}, w.norm());
  add("lm_head.weight", {c.vocab_size, h}, w.lm_head());
  return out;
}

std::string SafetensorsBytes(const std::vector<RawTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const RawTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  const std::string text = header.dump();
  const uint64_t len = text.size();
  return std::string(reinterpret_cast<const char*>(&len), 8) + text + data;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Round to nearest even. Test values are normal halfs (|x| in [2^-14, 65504]) or tiny.
uint16_t ToHalf(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const float a = std::abs(f);
  if (a < 6.103515625e-05f) {  // subnormal half: a multiple of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  uint32_t mant = b & 0x7fffff;
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}
float FromHalf(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return static_cast<float>((h & 0x8000) ? -v : v);
}
uint16_t ToBf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
float FromBf16(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// Converts the F32 tensors to `dtype`, storing what a correct reader must return in `expect`.
std::vector<RawTensor> Convert(std::vector<RawTensor> tensors, const std::string& dtype,
                               std::vector<std::vector<float>>* expect) {
  for (RawTensor& t : tensors) {
    std::vector<float> f(t.bytes.size() / 4);
    std::memcpy(f.data(), t.bytes.data(), t.bytes.size());
    std::string out(f.size() * 2, '\0');
    std::vector<float> back(f.size());
    for (size_t i = 0; i < f.size(); ++i) {
      const uint16_t v = dtype == "F16" ? ToHalf(f[i]) : ToBf16(f[i]);
      back[i] = dtype == "F16" ? FromHalf(v) : FromBf16(v);
      std::memcpy(&out[2 * i], &v, 2);
    }
    t.dtype = dtype;
    t.bytes = std::move(out);
    expect->push_back(std::move(back));
  }
  return tensors;
}

std::vector<float> PrefillLogits(const Model& m, const std::vector<int32_t>& tokens) {
  PagedKvCache cache(m.config(), 8, 16);
  Result<std::vector<float>> r = m.Prefill(tokens, 0, cache, Allocate(cache, 8));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r.value() : std::vector<float>{};
}

TEST(EngineSafetensors, SaveThenLoadGivesIdenticalWeightsAndOutputs) {
  const ModelConfig c = TinyConfig();
  const Weights w = TestWeights(c);
  TempDir dir;
  ASSERT_TRUE(w.SaveSafetensors(dir.File("m.safetensors")).ok());
  Result<Weights> loaded = Weights::LoadSafetensors(c, dir.File("m.safetensors"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const std::vector<RawTensor> a = F32Tensors(w), b = F32Tensors(*loaded);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].bytes, b[i].bytes) << a[i].name;

  const std::vector<int32_t> tokens = RandomTokens(40, c.vocab_size, 1);
  EXPECT_TRUE(BitwiseEqual(PrefillLogits(Model(c, w), tokens),
                           PrefillLogits(Model(c, std::move(loaded).value()), tokens)));
}

TEST(EngineSafetensors, LoadsHandWrittenF16AndBf16FilesWithATiedHead) {
  const ModelConfig c = TinyConfig();
  const Weights w = TestWeights(c);
  TempDir dir;
  for (const std::string dtype : {"F16", "BF16"}) {
    SCOPED_TRACE(dtype);
    std::vector<RawTensor> f32 = F32Tensors(w);
    f32.pop_back();  // no lm_head.weight: tied to the embedding
    std::vector<std::vector<float>> expect;
    const std::vector<RawTensor> converted = Convert(f32, dtype, &expect);
    WriteFile(dir.File(dtype), SafetensorsBytes(converted));
    Result<Weights> loaded = Weights::LoadSafetensors(c, dir.File(dtype));
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    const std::vector<RawTensor> got = F32Tensors(*loaded);
    ASSERT_EQ(got.size(), expect.size() + 1);
    for (size_t i = 0; i < expect.size(); ++i) {
      std::vector<float> g(got[i].bytes.size() / 4);
      std::memcpy(g.data(), got[i].bytes.data(), got[i].bytes.size());
      EXPECT_EQ(g, expect[i]) << got[i].name;
    }
    EXPECT_EQ(got.back().bytes, got.front().bytes) << "lm_head is not tied to the embedding";
    const std::vector<float> logits =
        PrefillLogits(Model(c, std::move(loaded).value()), RandomTokens(20, c.vocab_size, 2));
    ASSERT_EQ(logits.size(), c.vocab_size);
    EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
  }
}

TEST(EngineSafetensors, ErrorsNameTheFileAndTheTensor) {
  const ModelConfig c = TinyConfig();
  const Weights w = TestWeights(c);
  TempDir dir;
  const std::string good = dir.File("good"), bad = dir.File("bad");
  ASSERT_TRUE(w.SaveSafetensors(good).ok());
  const std::string bytes = ReadFile(good);

  Result<Weights> r = Weights::LoadSafetensors(c, dir.File("missing"));
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(dir.File("missing")));

  for (size_t cut : {size_t{5}, size_t{8 + 20}, bytes.size() - 100}) {
    WriteFile(bad, bytes.substr(0, cut));
    r = Weights::LoadSafetensors(c, bad);
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupted) << "cut at " << cut;
    EXPECT_THAT(r.status().message(), HasSubstr(bad));
  }
  EXPECT_THAT(r.status().message(), HasSubstr("beyond"));

  std::string not_json = bytes;
  not_json[8] = '#';
  WriteFile(bad, not_json);
  r = Weights::LoadSafetensors(c, bad);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupted);
  EXPECT_THAT(r.status().message(), HasSubstr("JSON"));

  std::vector<RawTensor> tensors = F32Tensors(w);
  RawTensor& up = tensors[6];  // model.layers.0.mlp.up_proj.weight
  ASSERT_EQ(up.name, "model.layers.0.mlp.up_proj.weight");
  up.shape = {c.intermediate_size, c.hidden_size + 1};
  up.bytes.append(c.intermediate_size * 4, '\0');
  WriteFile(bad, SafetensorsBytes(tensors));
  r = Weights::LoadSafetensors(c, bad);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              AllOf(HasSubstr("model.layers.0.mlp.up_proj.weight"), HasSubstr("[48, 33]"),
                    HasSubstr("[48, 32]")));

  tensors = F32Tensors(w);
  tensors[3].dtype = "F64";
  tensors[3].bytes += tensors[3].bytes;
  WriteFile(bad, SafetensorsBytes(tensors));
  r = Weights::LoadSafetensors(c, bad);
  EXPECT_EQ(r.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("F64"), HasSubstr(tensors[3].name)));

  tensors = F32Tensors(w);
  tensors.erase(tensors.end() - 2);  // model.norm.weight
  WriteFile(bad, SafetensorsBytes(tensors));
  r = Weights::LoadSafetensors(c, bad);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
}

// ---------------------------------------------------------------------------------------------
// (5) ModelConfig JSON.

TEST(EngineConfig, JsonRoundTripsAndMissingFieldsKeepDefaults) {
  const ModelConfig c = TinyConfig();
  Result<ModelConfig> back = ModelConfig::FromJson(c.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, c);
  back = ModelConfig::FromJson(nlohmann::json::object());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, ModelConfig{});
  back = ModelConfig::FromJson(nlohmann::json{{"num_layers", 2}});
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->num_layers, 2u);
  EXPECT_EQ(ModelConfig{}.KvBytesPerToken(), 4u * 2 * 2 * 32 * 4);

  TempDir dir;
  WriteFile(dir.File("c.json"), c.ToJson().dump(2));
  back = ModelConfig::Load(dir.File("c.json"));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, c);
}

TEST(EngineConfig, BadFieldsAreInvalidArgumentNamingTheField) {
  struct Case {
    nlohmann::json j;
    std::string field;
  };
  const std::vector<Case> cases = {
      {{{"hidden_size", "256"}}, "hidden_size"},
      {{{"num_layers", -1}}, "num_layers"},
      {{{"num_layers", 2.5}}, "num_layers"},
      {{{"rope_theta", "big"}}, "rope_theta"},
      {{{"rms_norm_eps", 0}}, "rms_norm_eps"},
      {{{"name", 3}}, "name"},
      {{{"hidden_sise", 256}}, "hidden_sise"},
      {{{"hidden_size", 200}}, "hidden_size"},
      {{{"num_kv_heads", 3}}, "num_kv_heads"},
      {{{"head_dim", 33}, {"hidden_size", 264}}, "head_dim"},
      {{{"vocab_size", 0}}, "vocab_size"},
      {{{"max_position", 5000000000}}, "max_position"},
      {nlohmann::json::array(), "object"},
  };
  for (const Case& k : cases) {
    Result<ModelConfig> r = ModelConfig::FromJson(k.j);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << k.j.dump();
    EXPECT_THAT(r.status().message(), HasSubstr(k.field)) << k.j.dump();
  }
}

TEST(EngineConfig, LoadNamesThePath) {
  TempDir dir;
  Result<ModelConfig> r = ModelConfig::Load(dir.File("none.json"));
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(dir.File("none.json")));
  WriteFile(dir.File("bad.json"), "{\"num_layers\": ");
  r = ModelConfig::Load(dir.File("bad.json"));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr(dir.File("bad.json")));
  WriteFile(dir.File("typo.json"), "{\"num_layer\": 2}");
  r = ModelConfig::Load(dir.File("typo.json"));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr(dir.File("typo.json")), HasSubstr("num_layer")));
}

// ---------------------------------------------------------------------------------------------
// (6) PagedKvCache.

TEST(EngineKvCache, LayoutDescribesTheTensors) {
  const ModelConfig c = TinyConfig();
  PagedKvCache cache(c, 10, 16);
  const EngineKvLayout l = cache.Layout();
  EXPECT_TRUE(l.Validate().ok()) << l.Validate().ToString();
  EXPECT_EQ(l.kind, EngineLayoutKind::kFlashAttn);
  EXPECT_EQ(l.dtype, KvDtype::kFp32);
  EXPECT_EQ(l.num_blocks, 10u);
  EXPECT_EQ(l.block_size, 16u);
  EXPECT_EQ(l.num_kv_heads, c.num_kv_heads);
  EXPECT_EQ(l.head_size, c.head_dim);
  ASSERT_EQ(l.num_layers(), c.num_layers);
  EXPECT_EQ(l.LayerTensorBytes(), 2ull * 10 * 16 * c.num_kv_heads * c.head_dim * 4);
  const uint64_t row_bytes = uint64_t{c.num_kv_heads} * c.head_dim * 4;
  for (uint32_t layer = 0; layer < c.num_layers; ++layer) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(l.layers[layer]) % 64, 0u);
    for (uint32_t b : {0u, 3u, 9u}) {
      for (uint32_t r : {0u, 15u}) {
        EXPECT_EQ(reinterpret_cast<uint8_t*>(cache.Key(layer, b, r)),
                  l.EnginePiece(layer, 0, b) + r * row_bytes);
        EXPECT_EQ(reinterpret_cast<uint8_t*>(cache.Value(layer, b, r)),
                  l.EnginePiece(layer, 1, b) + r * row_bytes);
      }
    }
    EXPECT_EQ(reinterpret_cast<uint8_t*>(cache.Value(layer, 9, 15)) + row_bytes,
              l.layers[layer] + l.LayerTensorBytes());
  }
  EXPECT_EQ(cache.Key(0, 9, 15)[0], 0.0f);  // zero-initialised
}

TEST(EngineKvCache, ExhaustionTakesNothingAndFreedBlocksAreReused) {
  PagedKvCache cache(TinyConfig(), 10, 16);
  std::vector<uint32_t> a = Allocate(cache, 6);
  EXPECT_EQ(std::set<uint32_t>(a.begin(), a.end()).size(), 6u);
  EXPECT_EQ(cache.free_blocks(), 4u);
  Result<std::vector<uint32_t>> r = cache.AllocateBlocks(5);
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("4 free"), HasSubstr("5 requested")));
  EXPECT_EQ(cache.free_blocks(), 4u);
  std::vector<uint32_t> b = Allocate(cache, 4);
  EXPECT_EQ(cache.free_blocks(), 0u);
  std::set<uint32_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  EXPECT_EQ(all.size(), 10u);

  const std::vector<uint32_t> give_back = {a[1], a[4], b[0]};
  cache.FreeBlocks(give_back);
  cache.FreeBlocks(give_back);  // a double free is ignored
  EXPECT_EQ(cache.free_blocks(), 3u);
  std::vector<uint32_t> c = Allocate(cache, 3);
  EXPECT_EQ(std::set<uint32_t>(c.begin(), c.end()),
            std::set<uint32_t>(give_back.begin(), give_back.end()));
  EXPECT_EQ(cache.AllocateBlocks(1).status().code(), StatusCode::kNoSpace);
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
