// PagedKvCache: the reference engine's KV memory, in vLLM's FlashAttention paged layout.
//
// One fp32 tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V),
// each a separate 64-byte-aligned, zero-initialised allocation: exactly what a cxlkv connector
// gathers from and scatters into (Layout()). Blocks are handed out by a free list; a sequence
// owns a block table (block_table[i] holds positions [i*block_size, (i+1)*block_size)).
//
// Thread-safety: none; one engine thread owns a cache. A connector may read or write blocks'
// bytes concurrently only for blocks the engine is not computing into at that time.
#ifndef CXLKV_ENGINE_KV_CACHE_H_
#define CXLKV_ENGINE_KV_CACHE_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include "cxlkv/layout.h"
#include "cxlkv/status.h"
#include "engine/config.h"

namespace cxlkv::engine {

class PagedKvCache {
 public:
  // Allocates num_blocks blocks of block_size tokens for every layer of c. If the memory cannot
  // be had, the cache holds 0 blocks (AllocateBlocks then says why).
  PagedKvCache(const ModelConfig& c, uint32_t num_blocks, uint32_t block_size = 16);
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;
  PagedKvCache(PagedKvCache&&) = default;
  PagedKvCache& operator=(PagedKvCache&&) = default;

  // kind kFlashAttn, dtype kFp32, the block geometry, and each layer's base pointer.
  EngineKvLayout Layout() const;

  // Takes n free blocks (lowest ids first on a fresh cache). Errors: kNoSpace when fewer than n
  // are free; nothing is taken then.
  Result<std::vector<uint32_t>> AllocateBlocks(uint32_t n);
  // Returns blocks to the free list. Ids out of range or already free are ignored.
  void FreeBlocks(std::span<const uint32_t> ids);

  uint32_t free_blocks() const { return static_cast<uint32_t>(free_.size()); }
  uint32_t num_blocks() const { return num_blocks_; }
  uint32_t block_size() const { return block_size_; }
  uint32_t num_layers() const { return static_cast<uint32_t>(layers_.size()); }
  uint32_t num_kv_heads() const { return num_kv_heads_; }
  uint32_t head_dim() const { return head_dim_; }
  // Floats of one token's K (or V) in one layer: num_kv_heads * head_dim.
  uint32_t row_floats() const { return num_kv_heads_ * head_dim_; }

  // The K (V) of token slot `row` of `block` in `layer`: row_floats() floats, heads major.
  // REQUIRES: layer < num_layers(), block < num_blocks(), row < block_size().
  float* Key(uint32_t layer, uint32_t block, uint32_t row) {
    return layers_[layer].get() + (uint64_t{block} * block_size_ + row) * row_floats();
  }
  float* Value(uint32_t layer, uint32_t block, uint32_t row) {
    return Key(layer, block, row) + uint64_t{num_blocks_} * block_size_ * row_floats();
  }
  const float* Key(uint32_t layer, uint32_t block, uint32_t row) const {
    return const_cast<PagedKvCache*>(this)->Key(layer, block, row);
  }
  const float* Value(uint32_t layer, uint32_t block, uint32_t row) const {
    return const_cast<PagedKvCache*>(this)->Value(layer, block, row);
  }

 private:
  struct FreeDeleter {
    void operator()(float* p) const { std::free(p); }
  };

  uint32_t num_blocks_ = 0;
  uint32_t block_size_ = 0;
  uint32_t num_kv_heads_ = 0;
  uint32_t head_dim_ = 0;
  uint64_t requested_bytes_ = 0;  // per layer, for the allocation-failure message
  std::vector<std::unique_ptr<float[], FreeDeleter>> layers_;
  std::vector<uint32_t> free_;  // a stack: back() is handed out next
  std::vector<bool> in_use_;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_KV_CACHE_H_
