// Helpers shared by the reference engine's tests.
#ifndef CXLKV_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
#define CXLKV_TESTS_ENGINE_ENGINE_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/weights.h"

namespace cxlkv::engine::test_util {

// A small GQA model with non-default theta and eps, for exact checks.
inline ModelConfig TinyConfig() {
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

inline std::vector<int32_t> RandomTokens(uint32_t n, uint32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Random weights with non-trivial norm weights, so a forgotten norm weight shows.
inline Weights TestWeights(const ModelConfig& c) {
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

inline std::vector<uint32_t> Allocate(PagedKvCache& cache, uint32_t n) {
  Result<std::vector<uint32_t>> ids = cache.AllocateBlocks(n);
  EXPECT_TRUE(ids.ok()) << ids.status().ToString();
  return ids.ok() ? ids.value() : std::vector<uint32_t>(n, 0);
}

// The KV bytes of position `pos`, every layer, K then V.
inline std::vector<float> TokenKv(PagedKvCache& cache, const std::vector<uint32_t>& table,
                                  uint32_t pos) {
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

inline bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

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

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace cxlkv::engine::test_util

#endif  // CXLKV_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
