#include "engine/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace cxlkv::engine {

PagedKvCache::PagedKvCache(const ModelConfig& c, uint32_t num_blocks, uint32_t block_size)
    : block_size_(block_size), num_kv_heads_(c.num_kv_heads), head_dim_(c.head_dim) {
  constexpr uint64_t kAlign = 64;
  requested_bytes_ = 2 * uint64_t{num_blocks} * block_size * row_floats() * sizeof(float);
  const uint64_t bytes = (requested_bytes_ + kAlign - 1) / kAlign * kAlign;
  if (bytes == 0) return;  // an empty cache: nothing to allocate
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    float* p = static_cast<float*>(std::aligned_alloc(kAlign, bytes));
    if (p == nullptr) {
      layers_.clear();
      return;
    }
    std::memset(p, 0, bytes);
    layers_.emplace_back(p);
  }
  num_blocks_ = num_blocks;
  in_use_.assign(num_blocks, false);
  free_.reserve(num_blocks);
  for (uint32_t b = num_blocks; b-- > 0;) free_.push_back(b);
}

EngineKvLayout PagedKvCache::Layout() const {
  EngineKvLayout l;
  l.kind = EngineLayoutKind::kFlashAttn;
  l.dtype = KvDtype::kFp32;
  l.num_blocks = num_blocks_;
  l.block_size = block_size_;
  l.num_kv_heads = num_kv_heads_;
  l.head_size = head_dim_;
  for (const auto& p : layers_) l.layers.push_back(reinterpret_cast<uint8_t*>(p.get()));
  return l;
}

Result<std::vector<uint32_t>> PagedKvCache::AllocateBlocks(uint32_t n) {
  if (n > free_.size()) {
    std::string m = "KV cache has " + std::to_string(free_.size()) + " free blocks of " +
                    std::to_string(num_blocks_) + ", " + std::to_string(n) + " requested";
    if (num_blocks_ == 0 && requested_bytes_ > 0) {
      m += " (allocating " + std::to_string(requested_bytes_) + " bytes per layer failed)";
    }
    return NoSpace(m + ": free blocks or create a larger cache");
  }
  std::vector<uint32_t> ids(free_.end() - n, free_.end());
  std::reverse(ids.begin(), ids.end());
  free_.resize(free_.size() - n);
  for (uint32_t id : ids) in_use_[id] = true;
  return ids;
}

void PagedKvCache::FreeBlocks(std::span<const uint32_t> ids) {
  for (uint32_t id : ids) {
    if (id >= num_blocks_ || !in_use_[id]) continue;
    in_use_[id] = false;
    free_.push_back(id);
  }
}

}  // namespace cxlkv::engine
