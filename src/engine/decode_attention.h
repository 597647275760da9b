// DecodeAttention: how a decode step attends, when it should not read every cached position.
//
// Model::Decode computes one token's q, K and V per layer, writes the K and V into the paged
// cache, then asks for the token's attention over positions [0, pos]. By default that is the
// engine's own dense attention (attention.h). A DecodeAttention replaces that one step: sparse
// top-K attention next to the memory, or the engine/near-memory hybrid (sparse_attention.h).
// Prefill always attends densely: its KV must be exact for prefix caching.
//
// Thread-safety: an implementation serves one sequence's decode loop at a time.
#ifndef CXLKV_ENGINE_DECODE_ATTENTION_H_
#define CXLKV_ENGINE_DECODE_ATTENTION_H_

#include <cstdint>
#include <span>

#include "cxlkv/status.h"
#include "engine/kv_cache.h"

namespace cxlkv::engine {

class DecodeAttention {
 public:
  virtual ~DecodeAttention() = default;

  // Writes out[num_heads * head_dim] = attention of q over positions [0, pos] of `layer` of
  // the sequence whose blocks block_table names. q is [num_heads][head_dim], already scaled by
  // 1/sqrt(head_dim) (logit = q · k). The KV of positions <= pos is in the cache.
  // An error fails the decode step (Model::Decode returns it; the KV of pos stays written).
  virtual Status Attend(uint32_t layer, const float* q, uint32_t pos, const PagedKvCache& cache,
                        std::span<const uint32_t> block_table, float* out) = 0;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_DECODE_ATTENTION_H_
