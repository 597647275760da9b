// Internal to the engine: causal grouped-query attention over a paged KV cache.
//
// Written as plain loops with fixed-width (kTile) inner loops so that gcc -O2 vectorizes them
// without -ffast-math: no loop reassociates a floating-point sum, every reduction runs in a
// fixed order that depends only on absolute key positions. Hence a query's output depends only
// on its own q, its position and the KV bytes of positions <= its position -- never on the
// other rows computed with it, on where a chunk starts, or on physical block ids.
#ifndef CXLKV_ENGINE_ATTENTION_H_
#define CXLKV_ENGINE_ATTENTION_H_

#include <cstdint>
#include <vector>

namespace cxlkv::engine::internal {

struct AttentionShape {
  uint32_t num_heads = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
};

// One layer's cached KV: the two halves of a [2, num_blocks, block_size, heads, head_dim]
// tensor and a sequence's block table.
struct KvView {
  const float* k_base = nullptr;
  const float* v_base = nullptr;
  const uint32_t* table = nullptr;  // covers every position read
  uint32_t block_size = 0;
  uint32_t row_floats = 0;  // num_kv_heads * head_dim

  uint64_t RowOffset(uint32_t pos) const {
    return (uint64_t{table[pos / block_size]} * block_size + pos % block_size) * row_floats;
  }
};

// Reused buffers; one per thread.
struct AttentionScratch {
  std::vector<float> scores;
  std::vector<float> key_tile;
  std::vector<float> inv_sum;
  std::vector<uint64_t> offsets;  // RowOffset of every key position
};

// For each row r in [row_begin, row_end) of a chunk whose row 0 is at absolute position pos0,
// and each head h: out[r][h] = softmax_p(q[r][h] . K[p][h / group]) V[p][h / group] over
// p in [0, pos0 + r]. Row r of q starts at q + r * q_stride and holds num_heads * head_dim
// floats, pre-scaled by 1/sqrt(head_dim); out is [rows][num_heads * head_dim]. Rows outside
// [row_begin, row_end) of `out` are not touched.
// REQUIRES: the KV of positions [0, pos0 + row_end) is in the cache.
void Attend(const AttentionShape& s, const float* q, uint64_t q_stride, uint32_t pos0,
            uint32_t row_begin, uint32_t row_end, const KvView& kv, float* out,
            AttentionScratch& scratch);

// exp(x) for x <= 0 (below -87 counts as -87); relative error below 3e-7. Exposed for tests.
float ExpNonPositiveForTest(float x);

}  // namespace cxlkv::engine::internal

#endif  // CXLKV_ENGINE_ATTENTION_H_
