// Weights (safetensors in F32, F16 and BF16, and their errors) and ModelConfig JSON.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine_test_util.h"

namespace cxlkv::engine {
namespace {

using test_util::Allocate;
using test_util::BitwiseEqual;
using test_util::RandomTokens;
using test_util::ReadFile;
using test_util::TempDir;
using test_util::TestWeights;
using test_util::TinyConfig;
using test_util::WriteFile;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// (4) safetensors.

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
    EXPECT_TRUE(
        std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
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
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("model.layers.0.mlp.up_proj.weight"),
                                          HasSubstr("[48, 33]"), HasSubstr("[48, 32]")));

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
  EXPECT_THAT(r.status().message(),
              AllOf(HasSubstr(dir.File("typo.json")), HasSubstr("num_layer")));
}
}  // namespace
}  // namespace cxlkv::engine
