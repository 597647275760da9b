#include "engine/model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>

#include "engine/attention.h"

namespace cxlkv::engine {
namespace {

// Several engine processes share few cores: OpenBLAS runs on the calling thread only.
void PinOpenBlasToOneThread() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

// C[m, n] = A[m, k] W[n, k]^T, all row-major (W as HF nn.Linear stores it).
void Gemm(const float* a, uint32_t m, uint32_t k, const float* w, uint32_t n, float* c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, a, static_cast<int>(k), w, static_cast<int>(k), 0.0f, c,
              static_cast<int>(n));
}

void RmsNorm(const float* x, const float* w, uint32_t n, float eps, float* out) {
  double ss = 0.0;
  for (uint32_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (uint32_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// HF rotate-half RoPE on one head vector: pairs (k, k + half).
void Rope(float* v, const float* cos, const float* sin, uint32_t half) {
  for (uint32_t k = 0; k < half; ++k) {
    const float a = v[k], b = v[k + half];
    v[k] = a * cos[k] - b * sin[k];
    v[k + half] = b * cos[k] + a * sin[k];
  }
}

void AddInPlace(float* x, const float* y, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) x[i] += y[i];
}

std::vector<float> Concat(std::vector<float>&& a, std::vector<float>&& b,
                          std::vector<float>&& c = {}) {
  std::vector<float> out = std::move(a);
  out.insert(out.end(), b.begin(), b.end());
  out.insert(out.end(), c.begin(), c.end());
  b = {};
  c = {};
  return out;
}

}  // namespace

struct Model::Scratch {
  std::vector<float> xn, qkv, attn, tmp, gate_up, act;
  internal::AttentionScratch attention;
};

Model::Model(ModelConfig c, Weights w) : config_(std::move(c)) {
  PinOpenBlasToOneThread();
  status_ = config_.Validate();
  const ModelConfig& wc = w.config();
  if (status_.ok() &&
      (wc.vocab_size != config_.vocab_size || wc.hidden_size != config_.hidden_size ||
       wc.num_layers != config_.num_layers || wc.num_heads != config_.num_heads ||
       wc.num_kv_heads != config_.num_kv_heads || wc.head_dim != config_.head_dim ||
       wc.intermediate_size != config_.intermediate_size)) {
    status_ = InvalidArgument("weights were made for model config '" + wc.name +
                              "', whose shape differs from model config '" + config_.name + "'");
  }
  if (status_.ok()) status_ = w.CheckShapes();
  if (!status_.ok()) return;

  embed_ = std::move(w.mutable_embed_tokens());
  norm_ = std::move(w.mutable_norm());
  lm_head_ = std::move(w.mutable_lm_head());
  layers_.resize(config_.num_layers);
  for (uint32_t i = 0; i < config_.num_layers; ++i) {
    LayerWeights& src = w.mutable_layer(i);
    Layer& l = layers_[i];
    l.qkv = Concat(std::move(src.q_proj), std::move(src.k_proj), std::move(src.v_proj));
    l.o = std::move(src.o_proj);
    l.gate_up = Concat(std::move(src.gate_proj), std::move(src.up_proj));
    l.down = std::move(src.down_proj);
    l.input_norm = std::move(src.input_layernorm);
    l.post_norm = std::move(src.post_attention_layernorm);
  }
  const uint32_t half = config_.head_dim / 2;
  for (uint32_t k = 0; k < half; ++k) {
    inv_freq_.push_back(std::pow(static_cast<double>(config_.rope_theta),
                                 -2.0 * k / static_cast<double>(config_.head_dim)));
  }
}

Status Model::CheckRequest(std::span<const int32_t> tokens, uint64_t end, const PagedKvCache& cache,
                           std::span<const uint32_t> block_table) const {
  if (!status_.ok()) return status_;
  const ModelConfig& c = config_;
  if (cache.num_layers() != c.num_layers || cache.num_kv_heads() != c.num_kv_heads ||
      cache.head_dim() != c.head_dim) {
    return InvalidArgument("KV cache has " + std::to_string(cache.num_layers()) + " layers x " +
                           std::to_string(cache.num_kv_heads()) + " KV heads x head_dim " +
                           std::to_string(cache.head_dim()) + ", model '" + c.name + "' needs " +
                           std::to_string(c.num_layers) + " x " + std::to_string(c.num_kv_heads) +
                           " x " + std::to_string(c.head_dim));
  }
  if (cache.block_size() == 0) return InvalidArgument("KV cache block_size is 0");
  if (end > c.max_position) {
    return InvalidArgument("sequence of " + std::to_string(end) + " positions exceeds " +
                           "max_position " + std::to_string(c.max_position) + " of model '" +
                           c.name + "'");
  }
  const uint32_t bs = cache.block_size();
  const uint64_t needed = (end + bs - 1) / bs;
  if (block_table.size() < needed) {
    return InvalidArgument("block table has " + std::to_string(block_table.size()) + " blocks, " +
                           std::to_string(end) + " positions need " + std::to_string(needed) +
                           " blocks of " + std::to_string(bs));
  }
  for (uint64_t i = 0; i < needed; ++i) {
    if (block_table[i] >= cache.num_blocks()) {
      return InvalidArgument("block table entry " + std::to_string(i) + " is block " +
                             std::to_string(block_table[i]) + ", the cache has " +
                             std::to_string(cache.num_blocks()) + " blocks");
    }
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= c.vocab_size) {
      return InvalidArgument("token " + std::to_string(i) + " is " + std::to_string(tokens[i]) +
                             ", outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    }
  }
  return Status::Ok();
}

Result<std::vector<float>> Model::Prefill(
    std::span<const int32_t> tokens, uint32_t start, PagedKvCache& cache,
    std::span<const uint32_t> block_table,
    const std::function<void(uint32_t layer)>& before_layer) const {
  if (start >= tokens.size()) {
    return InvalidArgument("prefill start " + std::to_string(start) +
                           " must be below the number of tokens " + std::to_string(tokens.size()));
  }
  CXLKV_RETURN_IF_ERROR(CheckRequest(tokens, tokens.size(), cache, block_table));
  if (start % cache.block_size() != 0) {
    return InvalidArgument("prefill start " + std::to_string(start) +
                           " is not a multiple of the block size " +
                           std::to_string(cache.block_size()));
  }
  return Run(tokens.subspan(start), start, cache, block_table, before_layer, nullptr);
}

Result<std::vector<float>> Model::Decode(int32_t token, uint32_t pos, PagedKvCache& cache,
                                         std::span<const uint32_t> block_table,
                                         DecodeAttention* attention) const {
  CXLKV_RETURN_IF_ERROR(CheckRequest({&token, 1}, uint64_t{pos} + 1, cache, block_table));
  return Run({&token, 1}, pos, cache, block_table, {}, attention);
}

int32_t Model::Argmax(std::span<const float> logits) {
  int32_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

Result<std::vector<int32_t>> Model::Generate(std::span<const int32_t> tokens, uint32_t start,
                                             uint32_t max_new, PagedKvCache& cache,
                                             std::span<const uint32_t> block_table) const {
  const uint64_t end = tokens.size() + std::max<uint64_t>(max_new, 1) - 1;
  CXLKV_RETURN_IF_ERROR(CheckRequest(tokens, end, cache, block_table));
  CXLKV_ASSIGN_OR_RETURN(std::vector<float> logits, Prefill(tokens, start, cache, block_table));
  std::vector<int32_t> out;
  for (uint32_t i = 0; i < max_new; ++i) {
    out.push_back(Argmax(logits));
    if (i + 1 == max_new) break;
    const uint32_t pos = static_cast<uint32_t>(tokens.size() + i);
    CXLKV_ASSIGN_OR_RETURN(logits, Decode(out.back(), pos, cache, block_table));
  }
  return out;
}

Result<std::vector<float>> Model::Run(std::span<const int32_t> tokens, uint32_t first,
                                      PagedKvCache& cache, std::span<const uint32_t> block_table,
                                      const std::function<void(uint32_t)>& before_layer,
                                      DecodeAttention* attention) const {
  const ModelConfig& c = config_;
  const uint32_t bs = cache.block_size();
  const uint32_t h = c.hidden_size, half = c.head_dim / 2;
  const uint32_t base = first - first % bs;  // position of the first chunk's row 0
  const uint32_t end = first + static_cast<uint32_t>(tokens.size());
  const uint32_t chunks = (end - base + bs - 1) / bs;
  const uint64_t rows = uint64_t{chunks} * bs;

  // The residual stream of every chunk row; rows without a new token stay zero.
  std::vector<float> x(rows * h, 0.0f);
  std::vector<float> cos(rows * half), sin(rows * half);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint64_t r = first - base + i;
    std::memcpy(&x[r * h], &embed_[uint64_t(tokens[i]) * h], h * sizeof(float));
    const double pos = static_cast<double>(first + i);
    for (uint32_t k = 0; k < half; ++k) {
      cos[r * half + k] = static_cast<float>(std::cos(pos * inv_freq_[k]));
      sin[r * half + k] = static_cast<float>(std::sin(pos * inv_freq_[k]));
    }
  }

  Scratch s;
  const uint64_t nq = uint64_t{c.num_heads} * c.head_dim;
  const uint64_t nqkv = nq + 2 * uint64_t{c.num_kv_heads} * c.head_dim;
  s.xn.resize(uint64_t{bs} * h);
  s.qkv.resize(bs * nqkv);
  s.attn.resize(bs * nq);
  s.tmp.resize(uint64_t{bs} * h);
  s.gate_up.resize(uint64_t{bs} * 2 * c.intermediate_size);
  s.act.resize(uint64_t{bs} * c.intermediate_size);

  for (uint32_t l = 0; l < c.num_layers; ++l) {
    if (before_layer) before_layer(l);
    for (uint32_t ch = 0; ch < chunks; ++ch) {
      const uint32_t pos0 = base + ch * bs;
      const uint32_t row_begin = std::max(first, pos0) - pos0;
      const uint32_t row_end = std::min(end, pos0 + bs) - pos0;
      const uint64_t r0 = uint64_t{ch} * bs;
      CXLKV_RETURN_IF_ERROR(LayerChunk(l, &x[r0 * h], pos0, row_begin, row_end, &cos[r0 * half],
                                       &sin[r0 * half], cache, block_table, attention, s));
    }
  }

  const uint64_t last = end - 1 - base;
  RmsNorm(&x[last * h], norm_.data(), h, c.rms_norm_eps, s.xn.data());
  std::vector<float> logits(c.vocab_size);
  cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(c.vocab_size), static_cast<int>(h),
              1.0f, lm_head_.data(), static_cast<int>(h), s.xn.data(), 1, 0.0f, logits.data(), 1);
  return logits;
}

Status Model::LayerChunk(uint32_t layer, float* x, uint32_t pos0, uint32_t row_begin,
                         uint32_t row_end, const float* cos, const float* sin, PagedKvCache& cache,
                         std::span<const uint32_t> block_table, DecodeAttention* attention,
                         Scratch& s) const {
  const ModelConfig& c = config_;
  const Layer& w = layers_[layer];
  const uint32_t bs = cache.block_size();
  const uint32_t h = c.hidden_size, hd = c.head_dim, half = hd / 2, inter = c.intermediate_size;
  const uint32_t nq = c.num_heads * hd, nkv = c.num_kv_heads * hd, nqkv = nq + 2 * nkv;

  // Attention block. Every GEMM runs on all bs rows (see model.h's determinism contract).
  for (uint32_t r = 0; r < bs; ++r) {
    RmsNorm(x + uint64_t{r} * h, w.input_norm.data(), h, c.rms_norm_eps, &s.xn[uint64_t{r} * h]);
  }
  Gemm(s.xn.data(), bs, h, w.qkv.data(), nqkv, s.qkv.data());
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (uint32_t r = row_begin; r < row_end; ++r) {
    float* row = &s.qkv[uint64_t{r} * nqkv];
    const float* rc = cos + uint64_t{r} * half;
    const float* rs = sin + uint64_t{r} * half;
    for (uint32_t hh = 0; hh < c.num_heads; ++hh) Rope(row + hh * hd, rc, rs, half);
    for (uint32_t i = 0; i < nq; ++i) row[i] *= q_scale;
    for (uint32_t hh = 0; hh < c.num_kv_heads; ++hh) Rope(row + nq + hh * hd, rc, rs, half);
    const uint32_t pos = pos0 + r;
    const uint32_t block = block_table[pos / bs];
    std::memcpy(cache.Key(layer, block, pos % bs), row + nq, nkv * sizeof(float));
    std::memcpy(cache.Value(layer, block, pos % bs), row + nq + nkv, nkv * sizeof(float));
  }
  std::fill(s.attn.begin(), s.attn.end(), 0.0f);
  if (attention != nullptr && row_end == row_begin + 1) {
    CXLKV_RETURN_IF_ERROR(attention->Attend(layer, &s.qkv[uint64_t{row_begin} * nqkv], pos0 + row_begin, cache,
                                            block_table, &s.attn[uint64_t{row_begin} * nq]));
  } else {
    internal::KvView kv;
    kv.k_base = cache.Key(layer, 0, 0);
    kv.v_base = cache.Value(layer, 0, 0);
    kv.table = block_table.data();
    kv.block_size = bs;
    kv.row_floats = nkv;
    internal::Attend({c.num_heads, c.num_kv_heads, hd}, s.qkv.data(), nqkv, pos0, row_begin, row_end,
                     kv, s.attn.data(), s.attention);
  }
  Gemm(s.attn.data(), bs, nq, w.o.data(), h, s.tmp.data());
  AddInPlace(x, s.tmp.data(), uint64_t{bs} * h);

  // MLP block: down(silu(gate(x)) * up(x)).
  for (uint32_t r = 0; r < bs; ++r) {
    RmsNorm(x + uint64_t{r} * h, w.post_norm.data(), h, c.rms_norm_eps, &s.xn[uint64_t{r} * h]);
  }
  Gemm(s.xn.data(), bs, h, w.gate_up.data(), 2 * inter, s.gate_up.data());
  for (uint32_t r = 0; r < bs; ++r) {
    const float* gu = &s.gate_up[uint64_t{r} * 2 * inter];
    float* a = &s.act[uint64_t{r} * inter];
    for (uint32_t i = 0; i < inter; ++i) {
      const float g = gu[i];
      a[i] = g / (1.0f + std::exp(-g)) * gu[inter + i];
    }
  }
  Gemm(s.act.data(), bs, inter, w.down.data(), h, s.tmp.data());
  AddInPlace(x, s.tmp.data(), uint64_t{bs} * h);
  return Status::Ok();
}

}  // namespace cxlkv::engine
