// What the decode-attention tests share (sparse_attention_test.cc, remote_attention_test.cc): a
// GQA model the pnm kernels take, a sequence prefilled in its own cache, decode steps through a
// DecodeAttention, and the logits' relative error.
#ifndef CXLKV_TESTS_ENGINE_DECODE_TEST_UTIL_H_
#define CXLKV_TESTS_ENGINE_DECODE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/decode_attention.h"
#include "engine/model.h"
#include "engine_test_util.h"

namespace cxlkv::engine::test_util {

// GQA 4:1 (8 query heads, 2 KV heads) with a head_dim the pnm kernels take (a multiple of 16).
inline ModelConfig GqaConfig(const std::string& name) {
  ModelConfig c = TinyConfig();
  c.name = name;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.hidden_size = 128;
  c.intermediate_size = 96;
  c.max_position = 2048;
  return c;
}

// `prompt` random tokens (seeded) prefilled into a cache of `blocks` blocks of its own.
struct PrefilledSequence {
  PrefilledSequence(const Model& m, uint32_t prompt, uint32_t blocks, uint32_t block_size, uint64_t seed)
      : cache(m.config(), blocks, block_size), prompt_tokens(prompt) {
    table = Allocate(cache, blocks);
    tokens = RandomTokens(prompt, m.config().vocab_size, seed);
    auto logits = m.Prefill(tokens, 0, cache, table);
    EXPECT_TRUE(logits.ok()) << logits.status().ToString();
    if (logits.ok()) first = Model::Argmax(*logits);
  }
  PagedKvCache cache;
  std::vector<uint32_t> table;
  std::vector<int32_t> tokens;
  int32_t first = 0;
  uint32_t prompt_tokens;
};

// Decodes `steps` tokens after the prompt, teacher-forced by `forced` (greedy when empty);
// returns every step's logits.
inline std::vector<std::vector<float>> DecodeSteps(const Model& m, PrefilledSequence& s, DecodeAttention* a,
                                                   uint32_t steps, const std::vector<int32_t>& forced = {}) {
  std::vector<std::vector<float>> out;
  int32_t token = s.first;
  for (uint32_t i = 0; i < steps; ++i) {
    auto logits = m.Decode(token, s.prompt_tokens + i, s.cache, s.table, a);
    EXPECT_TRUE(logits.ok()) << logits.status().ToString();
    if (!logits.ok()) return out;
    out.push_back(*logits);
    token = forced.empty() ? Model::Argmax(*logits) : forced[i];
  }
  return out;
}

inline double RelativeError(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace cxlkv::engine::test_util

#endif  // CXLKV_TESTS_ENGINE_DECODE_TEST_UTIL_H_
