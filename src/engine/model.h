// Model: the reference engine, a Llama-architecture decoder (RMSNorm, RoPE in HF's
// rotate-half convention, grouped-query attention, SwiGLU MLP, final norm, lm_head) in fp32
// on OpenBLAS, with greedy decoding and a paged KV cache.
//
// Determinism contract (what prefix caching relies on): every token is computed in a chunk
// of block_size rows aligned to absolute positions, and every GEMM always runs on a full chunk
// (rows without a new token are zero padding), so the projections of a row never depend on the
// other rows; attention reads KV in a fixed order of absolute positions. Hence the KV bytes and
// logits of a token depend only on the tokens up to it and the cache's block_size:
//   * Prefill from any block-aligned start, over a prefix whose KV came from another run (or
//     another process, through a pool), gives bitwise the same KV and logits as from 0;
//   * Decode(token, pos) gives bitwise the same KV and logits as Prefill of the sequence that
//     ends with that token.
// (On one machine and OpenBLAS build: OpenBLAS picks its kernels by CPU.)
//
// Thread-safety: const methods may run concurrently on distinct caches. OpenBLAS is pinned to
// one thread per call (several engine processes share few cores).
#ifndef CXLKV_ENGINE_MODEL_H_
#define CXLKV_ENGINE_MODEL_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "cxlkv/status.h"
#include "engine/config.h"
#include "engine/decode_attention.h"
#include "engine/kv_cache.h"
#include "engine/weights.h"

namespace cxlkv::engine {

class Model {
 public:
  // If w was not made for c (sizes differ) or c is invalid, every call returns that error.
  Model(ModelConfig c, Weights w);

  const ModelConfig& config() const { return config_; }
  // OK, or why this model cannot run.
  const Status& status() const { return status_; }

  // Computes the KV of tokens[start, tokens.size()) into `cache` (block_table[i] holds positions
  // [i*bs, (i+1)*bs)) and returns the logits (vocab_size floats) of the last token.
  // REQUIRES: the KV of positions < start is in the cache.
  // Processing is layer-major: all new tokens through layer 0, then layer 1, ...
  // before_layer(l), if set, is called once per layer, in order, before layer l reads any
  // cached KV (also when start == 0): a connector waits there until layer l of a loaded prefix
  // has arrived, so the load of layer l+1 overlaps the compute of layer l.
  // Errors (kInvalidArgument, nothing written): start % block_size != 0, start >= tokens.size(),
  // tokens.size() > max_position, block_table too short or holding an id >= num_blocks, a token
  // outside [0, vocab_size), a cache shaped for another model.
  Result<std::vector<float>> Prefill(
      std::span<const int32_t> tokens, uint32_t start, PagedKvCache& cache,
      std::span<const uint32_t> block_table,
      const std::function<void(uint32_t layer)>& before_layer = {}) const;

  // One decode step: `token` at position `pos` (the KV of positions < pos is in the cache);
  // writes its KV and returns its logits. Errors as Prefill's (pos + 1 positions covered).
  // `attention`, if set, computes each layer's attention of the token (sparse or hybrid,
  // decode_attention.h) instead of the dense default; its error is the step's.
  Result<std::vector<float>> Decode(int32_t token, uint32_t pos, PagedKvCache& cache,
                                    std::span<const uint32_t> block_table,
                                    DecodeAttention* attention = nullptr) const;

  // The index of the largest logit, the lowest on ties; NaNs are skipped. -1 when empty or all NaN.
  static int32_t Argmax(std::span<const float> logits);

  // Prefill(tokens, start), then max_new greedy tokens (the first from the prefill logits, each
  // next one from Decode of the previous). Allocates nothing: block_table must cover
  // tokens.size() + max_new - 1 positions. Errors: as Prefill's, checked before any work.
  Result<std::vector<int32_t>> Generate(std::span<const int32_t> tokens, uint32_t start,
                                        uint32_t max_new, PagedKvCache& cache,
                                        std::span<const uint32_t> block_table) const;

 private:
  // Model-ready layer weights: Q, K and V stacked into one [(nh + 2 nkv) * D, H] matrix, gate
  // and up into one [2 I, H].
  struct Layer {
    std::vector<float> qkv;
    std::vector<float> o;
    std::vector<float> gate_up;
    std::vector<float> down;
    std::vector<float> input_norm;
    std::vector<float> post_norm;
  };
  struct Scratch;

  // The errors of a request that covers positions [0, end) and feeds `tokens`.
  Status CheckRequest(std::span<const int32_t> tokens, uint64_t end, const PagedKvCache& cache,
                      std::span<const uint32_t> block_table) const;
  // Runs new tokens at positions [first, first + tokens.size()) and returns the logits of the
  // last one.
  // `attention` (decode only: one new token) replaces the dense attention of that token.
  Result<std::vector<float>> Run(std::span<const int32_t> tokens, uint32_t first, PagedKvCache& cache,
                                 std::span<const uint32_t> block_table,
                                 const std::function<void(uint32_t)>& before_layer,
                                 DecodeAttention* attention) const;
  // One layer over one chunk of block_size rows; rows [row_begin, row_end) hold new tokens.
  Status LayerChunk(uint32_t layer, float* x, uint32_t pos0, uint32_t row_begin, uint32_t row_end,
                    const float* cos, const float* sin, PagedKvCache& cache,
                    std::span<const uint32_t> block_table, DecodeAttention* attention,
                    Scratch& s) const;

  ModelConfig config_;
  Status status_;
  std::vector<float> embed_;
  std::vector<Layer> layers_;
  std::vector<float> norm_;
  std::vector<float> lm_head_;
  std::vector<double> inv_freq_;  // RoPE: theta^(-2i/D), i < D/2
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_MODEL_H_
