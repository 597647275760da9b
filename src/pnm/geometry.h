// Near-memory sparse attention (PNM paper §3, issue 15): the shape of the KV it reads.
//
// The attention runs where the KV lives and reads it in place, in cxlkv's pool block format 1
// (include/cxlkv/layout.h): one page = one block of `page_tokens` tokens, and within one layer
// K then V, each [page_tokens rows][num_kv_heads][head_dim] of `dtype`. A context is a list of
// pages; its last page may be partial. The engine's own paged tensors (vLLM FlashAttention
// layout) have the same row layout per block, so they are read the same way.
//
// Thread-safety: plain values; the memory a PageKv names must not change while it is read.
#ifndef CXLKV_SRC_PNM_GEOMETRY_H_
#define CXLKV_SRC_PNM_GEOMETRY_H_

#include <cstdint>
#include <span>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"

namespace cxlkv::pnm {

struct Geometry {
  uint32_t num_heads = 0;      // query heads
  uint32_t num_kv_heads = 0;   // KV heads; num_heads is a multiple (grouped-query attention)
  uint32_t head_dim = 0;       // elements per head
  uint32_t page_tokens = 16;   // tokens per page (= the pool block's block_size)
  KvDtype dtype = KvDtype::kFp16;  // fp16, bf16 or fp32 (fp8 is refused)

  uint32_t group() const { return num_heads / num_kv_heads; }
  // fp32 is 4 bytes, fp16 and bf16 are 2 (fp8 is refused by Validate).
  uint32_t elem_bytes() const { return dtype == KvDtype::kFp32 ? 4 : 2; }
  // Bytes of one token's K (or V) row across the KV heads.
  uint64_t RowBytes() const { return uint64_t{num_kv_heads} * head_dim * elem_bytes(); }
  // Bytes of one page's K (or V) slab.
  uint64_t SlabBytes() const { return RowBytes() * page_tokens; }
  // Pages that hold `tokens` tokens (the last one possibly partial).
  uint64_t PagesFor(uint64_t tokens) const { return (tokens + page_tokens - 1) / page_tokens; }

  // Errors: kInvalidArgument naming the field (zero sizes, heads not a multiple of KV heads, a
  // head_dim that is not a multiple of 16 or above 1024, fp8).
  Status Validate() const;
};

// One page of one layer: its K slab and V slab (each [page_tokens][num_kv_heads][head_dim]).
struct PageKv {
  const void* k = nullptr;
  const void* v = nullptr;
};

// A sequence's KV in one layer: pages in token order, `tokens` valid tokens (the last page holds
// tokens - (pages - 1) * page_tokens of them).
struct ContextView {
  std::span<const PageKv> pages;
  uint64_t tokens = 0;

  // Valid tokens of page p. REQUIRES: p < pages.size().
  uint32_t TokensOf(uint64_t p, uint32_t page_tokens) const {
    const uint64_t before = p * page_tokens;
    return static_cast<uint32_t>(tokens - before < page_tokens ? tokens - before : page_tokens);
  }
  // Errors: kInvalidArgument when tokens and pages disagree or a page pointer is null.
  Status Validate(const Geometry& g) const;
};

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_GEOMETRY_H_
