// ModelConfig: the shape of a Llama-architecture decoder for the reference engine.
//
// A config is a plain value. FromJson/Load parse the edge format (a flat JSON object whose keys
// are the field names below); every other caller works with the typed struct. Missing keys keep
// the defaults written here; unknown keys, wrong types and invalid values are kInvalidArgument
// naming the field, so a typo in a config file never silently falls back to a default.
//
// Thread-safety: a value; distinct objects may be used from any thread.
#ifndef CXLKV_ENGINE_CONFIG_H_
#define CXLKV_ENGINE_CONFIG_H_

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "cxlkv/status.h"

namespace cxlkv::engine {

struct ModelConfig {
  std::string name = "tiny-llama";  // free-form model id (goes into cache namespaces)
  uint32_t vocab_size = 4096;
  uint32_t hidden_size = 256;  // must equal num_heads * head_dim
  uint32_t num_layers = 4;
  uint32_t num_heads = 8;            // query heads
  uint32_t num_kv_heads = 2;         // must divide num_heads (grouped-query attention)
  uint32_t head_dim = 32;            // must be even (RoPE rotates halves)
  uint32_t intermediate_size = 768;  // SwiGLU MLP width
  float rope_theta = 10000.0f;
  float rms_norm_eps = 1e-5f;
  uint32_t max_position = 32768;  // longest sequence Prefill/Decode accept
  uint64_t seed = 1;              // seed of Weights::Random

  // Missing fields keep defaults. Errors: kInvalidArgument naming the field (not an object,
  // wrong type, unknown key, a value Validate() rejects).
  static Result<ModelConfig> FromJson(const nlohmann::json& j);
  // Reads a JSON file. Errors: kNotFound (no such file), kIoError, kInvalidArgument (not JSON,
  // or FromJson's errors), each message naming the path.
  static Result<ModelConfig> Load(const std::string& path);
  // Every field; FromJson(ToJson()) reproduces the config.
  nlohmann::json ToJson() const;

  // kInvalidArgument naming the field: zero sizes, hidden_size != num_heads * head_dim,
  // num_heads % num_kv_heads != 0, odd head_dim, non-positive or non-finite rope_theta or
  // rms_norm_eps, an empty name.
  Status Validate() const;

  // Bytes of KV one token occupies across all layers, fp32:
  // num_layers * 2 * num_kv_heads * head_dim * sizeof(float).
  uint64_t KvBytesPerToken() const;

  bool operator==(const ModelConfig&) const = default;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_CONFIG_H_
