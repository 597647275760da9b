#include "engine/weights.h"

#include <cmath>
#include <new>
#include <random>

namespace cxlkv::engine {
namespace {

// Fills `out` with n values uniform in [-a, a). Uses only the raw 64-bit engine output (the
// std distributions are not specified bit-exactly across standard libraries).
void FillUniform(std::mt19937_64& rng, uint64_t n, float a, std::vector<float>* out) {
  out->resize(n);
  constexpr float kTwoPowMinus24 = 1.0f / 16777216.0f;
  for (uint64_t i = 0; i < n; ++i) {
    const float u = static_cast<float>(rng() >> 40) * kTwoPowMinus24;  // [0, 1), exact
    (*out)[i] = (2.0f * u - 1.0f) * a;
  }
}

// Half-width of a uniform distribution with variance `var`.
float UniformScale(double var) { return static_cast<float>(std::sqrt(3.0 * var)); }

}  // namespace

std::vector<Weights::Tensor> Weights::Tensors() {
  const ModelConfig& c = config_;
  const uint64_t h = c.hidden_size, q = uint64_t{c.num_heads} * c.head_dim,
                 kv = uint64_t{c.num_kv_heads} * c.head_dim, inter = c.intermediate_size;
  std::vector<Tensor> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, &embed_tokens_});
  for (uint32_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& l = layers_[i];
    t.push_back({p + "self_attn.q_proj.weight", {q, h}, &l.q_proj});
    t.push_back({p + "self_attn.k_proj.weight", {kv, h}, &l.k_proj});
    t.push_back({p + "self_attn.v_proj.weight", {kv, h}, &l.v_proj});
    t.push_back({p + "self_attn.o_proj.weight", {h, q}, &l.o_proj});
    t.push_back({p + "mlp.gate_proj.weight", {inter, h}, &l.gate_proj});
    t.push_back({p + "mlp.up_proj.weight", {inter, h}, &l.up_proj});
    t.push_back({p + "mlp.down_proj.weight", {h, inter}, &l.down_proj});
    t.push_back({p + "input_layernorm.weight", {h}, &l.input_layernorm});
    t.push_back({p + "post_attention_layernorm.weight", {h}, &l.post_attention_layernorm});
  }
  t.push_back({"model.norm.weight", {h}, &norm_});
  t.push_back({"lm_head.weight", {c.vocab_size, h}, &lm_head_});
  return t;
}

Result<Weights> Weights::Random(const ModelConfig& c) {
  CXLKV_RETURN_IF_ERROR(c.Validate());
  Weights w(c);
  std::mt19937_64 rng(c.seed);
  try {
    for (Tensor& t : w.Tensors()) {
      uint64_t n = 1;
      for (uint64_t d : t.shape) n *= d;
      if (t.shape.size() == 1) {  // a norm
        t.data->assign(n, 1.0f);
        continue;
      }
      const double in = static_cast<double>(t.shape[1]);
      double var = 1.0 / in;                      // keeps activations O(1)
      if (t.data == &w.embed_tokens_) var = 1.0;  // RMSNorm rescales anyway
      if (t.data == &w.lm_head_) var = 4.0 / in;  // logits spread ~2
      FillUniform(rng, n, UniformScale(var), t.data);
    }
  } catch (const std::bad_alloc&) {
    return NoSpace("out of memory allocating random weights for model '" + c.name + "'");
  }
  return w;
}

Status Weights::CheckShapes() const {
  for (const Tensor& t : Tensors()) {
    uint64_t n = 1;
    for (uint64_t d : t.shape) n *= d;
    if (t.data->size() != n) {
      return InvalidArgument("weight tensor " + t.name + " has " + std::to_string(t.data->size()) +
                             " elements, model config '" + config_.name + "' needs " +
                             std::to_string(n));
    }
  }
  return Status::Ok();
}

}  // namespace cxlkv::engine
