// Near-memory sparse attention (PNM paper §3): the shape of the KV it reads.
//
// The attention runs where the KV lives and reads it in place, in cxlkv's pool block formats
// (include/cxlkv/layout.h): one page = one block of `page_tokens` tokens, and within one layer
// K then V, each slab of `dtype` either
//   token-major (format 1): [page_tokens][num_kv_heads][head_dim], or
//   head-major (format 2):  [num_kv_heads][page_tokens][head_dim].
// A context is a list of pages; its last page may be partial. The engine's own paged tensors
// (vLLM FlashAttention layout) have format 1's rows per block, so they are read the same way.
// Head-major pages give each KV head one contiguous run per page (4 KiB at fp16, head_dim 128,
// 16 tokens), which is what per-head sparse selections read: a token-major page spreads the
// same bytes over 16 pieces at a row's stride, which the hardware prefetchers do not follow.
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
  bool head_major = false;     // the slabs' order: format 2 when true, format 1 when false

  uint32_t group() const { return num_heads / num_kv_heads; }
  // fp32 is 4 bytes, fp16 and bf16 are 2 (fp8 is refused by Validate).
  uint32_t elem_bytes() const { return dtype == KvDtype::kFp32 ? 4 : 2; }
  // Bytes of one token's K (or V) row across the KV heads.
  uint64_t RowBytes() const { return uint64_t{num_kv_heads} * head_dim * elem_bytes(); }
  // Bytes of one page's K (or V) slab.
  uint64_t SlabBytes() const { return RowBytes() * page_tokens; }
  // Bytes of one KV head's row of one token.
  uint64_t HeadBytes() const { return uint64_t{head_dim} * elem_bytes(); }
  // K and V bytes of one KV head's page: what attention reads per page and head.
  uint64_t HeadPageKvBytes() const { return 2 * HeadBytes() * page_tokens; }
  // Within a slab: from one token's row of a head to the next token's, and where head h's row
  // of token 0 starts.
  uint64_t TokenStride() const { return head_major ? HeadBytes() : RowBytes(); }
  uint64_t HeadOffset(uint32_t h) const { return h * (head_major ? HeadBytes() * page_tokens : HeadBytes()); }
  // Pages that hold `tokens` tokens (the last one possibly partial).
  uint64_t PagesFor(uint64_t tokens) const { return (tokens + page_tokens - 1) / page_tokens; }

  // Errors: kInvalidArgument naming the field (zero sizes, heads not a multiple of KV heads, a
  // head_dim that is not a multiple of 16 or above 1024, fp8).
  Status Validate() const;
};

// One page of one layer: its K slab and V slab (each laid out as Geometry::head_major says).
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
