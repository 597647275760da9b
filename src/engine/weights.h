// Weights: the fp32 parameters of a Llama-architecture decoder.
//
// Matrices are row-major [out, in], as HF nn.Linear stores them, so y = x W^T. Norm weights
// are vectors [hidden_size]. A Weights value always matches the ModelConfig it was made for
// (config()); Model checks this.
//
// Sources: Random (deterministic from ModelConfig::seed, for tests and benchmarks) and HF
// safetensors files (F32, F16 or BF16 tensors, converted to fp32 on load).
//
// Thread-safety: a value; const methods may be called from any thread.
#ifndef CXLKV_ENGINE_WEIGHTS_H_
#define CXLKV_ENGINE_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "engine/config.h"

namespace cxlkv::engine {

// One decoder layer. Shapes (H = hidden_size, D = head_dim, I = intermediate_size):
struct LayerWeights {
  std::vector<float> q_proj;                    // [num_heads * D, H]
  std::vector<float> k_proj;                    // [num_kv_heads * D, H]
  std::vector<float> v_proj;                    // [num_kv_heads * D, H]
  std::vector<float> o_proj;                    // [H, num_heads * D]
  std::vector<float> gate_proj;                 // [I, H]
  std::vector<float> up_proj;                   // [I, H]
  std::vector<float> down_proj;                 // [H, I]
  std::vector<float> input_layernorm;           // [H]
  std::vector<float> post_attention_layernorm;  // [H]
};

class Weights {
 public:
  // Uniform weights with variance 1/in for every matrix (so activations stay O(1)), embedding
  // entries of variance 1, lm_head scaled so logits have a spread of a few units, norms 1.0.
  // Deterministic from c.seed: the same seed gives bitwise the same weights on every platform.
  // Errors: kInvalidArgument (c.Validate()), kNoSpace (the weights do not fit in memory).
  static Result<Weights> Random(const ModelConfig& c);

  // Reads an HF safetensors file (names model.embed_tokens.weight,
  // model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
  // model.layers.{i}.mlp.{gate,up,down}_proj.weight,
  // model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight;
  // without lm_head.weight the head is tied to the embedding). Tensors not named here are
  // ignored. Errors, each naming the path (and the tensor where one is at fault):
  // kNotFound (no file; a required tensor missing), kPermissionDenied, kIoError,
  // kCorrupted (truncated header, header not JSON or malformed, data offsets beyond the file
  // or not matching the shape), kInvalidArgument (shape differs from the config: expected vs.
  // found; c invalid), kNotSupported (a dtype other than F32, F16, BF16), kNoSpace.
  static Result<Weights> LoadSafetensors(const ModelConfig& c, const std::string& path);

  // Writes every tensor (lm_head.weight included) as F32. Errors: kPermissionDenied, kNotFound
  // (no such directory), kIoError, each naming the path.
  Status SaveSafetensors(const std::string& path) const;

  const ModelConfig& config() const { return config_; }
  const std::vector<float>& embed_tokens() const { return embed_tokens_; }  // [vocab, H]
  const LayerWeights& layer(uint32_t i) const { return layers_[i]; }  // REQUIRES: i < num_layers
  const std::vector<float>& norm() const { return norm_; }            // [H]
  const std::vector<float>& lm_head() const { return lm_head_; }      // [vocab, H]

  // Mutable access for tests and tools (e.g. to set non-trivial norm weights) and for Model,
  // which moves the tensors out. Keep the sizes: Model checks them.
  std::vector<float>& mutable_embed_tokens() { return embed_tokens_; }
  LayerWeights& mutable_layer(uint32_t i) { return layers_[i]; }
  std::vector<float>& mutable_norm() { return norm_; }
  std::vector<float>& mutable_lm_head() { return lm_head_; }

  // OK iff every tensor has the size config() requires.
  Status CheckShapes() const;

 private:
  // A tensor with its HF name and shape, pointing into this object.
  struct Tensor {
    std::string name;
    std::vector<uint64_t> shape;
    std::vector<float>* data;
  };

  explicit Weights(const ModelConfig& c) : config_(c), layers_(c.num_layers) {}
  // Every tensor in file order: embedding, layers (q, k, v, o, gate, up, down, norms), norm,
  // lm_head.
  std::vector<Tensor> Tensors();
  // For readers (SaveSafetensors, CheckShapes): the same table; callers must not write.
  std::vector<Tensor> Tensors() const { return const_cast<Weights*>(this)->Tensors(); }

  ModelConfig config_;
  std::vector<float> embed_tokens_;
  std::vector<LayerWeights> layers_;
  std::vector<float> norm_;
  std::vector<float> lm_head_;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_WEIGHTS_H_
