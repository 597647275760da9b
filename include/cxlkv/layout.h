// Engine-side paged KV layouts (as serving engines store them) and cxlkv's pool-side block
// format (Beluga §6.1): what a gather-write reads and a scatter-read fills.
//
//   kFlashAttn   vLLM FlashAttention, one tensor per layer: [2, num_blocks, block_size, heads, head_size]
//   kFlashInfer  FlashInfer-style, one tensor per layer:   [num_blocks, 2, block_size, heads, head_size]
//   kMla         MLA latent, one tensor per layer:         [num_blocks, block_size, latent_dim]
//   kFlashInferHnd  FlashInfer's HND order, one per layer: [num_blocks, 2, heads, block_size, head_size]
//
// Layers are separate allocations in engines: one base pointer per layer. `num_kv_heads` is the
// heads of this tensor-parallel rank's slice (what its tensors hold).
//
// Pool block format 1 (versioned into the key namespace as KvLayoutSignature::block_format):
// layer-major, and within a layer K then V, each [block_size, heads, head_size] — so one layer
// of a block is contiguous (layer-wise loads read one range). MLA: per layer
// [block_size, latent_dim]. A piece = one (layer, part) slab, contiguous on both sides.
//
// Pool block format 2, what an HND engine (kFlashInferHnd) writes: the same, with each slab
// [heads, block_size, head_size] — a KV head's rows of a block contiguous, which is what
// near-memory sparse attention reads per head (docs/pnm.md). Pieces stay contiguous on both
// sides, so transfers copy them as they are. The format is in the namespace's signature: an NHD
// and an HND engine of one model never share a key, and a block is never read in the other order.
#ifndef CXLKV_LAYOUT_H_
#define CXLKV_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"

namespace cxlkv {

enum class EngineLayoutKind : uint32_t { kFlashAttn = 0, kFlashInfer = 1, kMla = 2, kFlashInferHnd = 3 };

struct EngineKvLayout {
  EngineLayoutKind kind = EngineLayoutKind::kFlashAttn;
  KvDtype dtype = KvDtype::kFp16;
  uint32_t num_blocks = 0;          // blocks in each layer's tensor
  uint32_t block_size = 16;         // tokens per block
  uint32_t num_kv_heads = 0;        // this rank's heads (not MLA)
  uint32_t head_size = 0;           // (not MLA)
  uint32_t latent_dim = 0;          // MLA only
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  uint32_t pp_stage = 0;
  std::vector<uint8_t*> layers;     // base pointer of each layer's tensor

  uint32_t num_layers() const { return static_cast<uint32_t>(layers.size()); }
  uint32_t parts() const { return kind == EngineLayoutKind::kMla ? 1 : 2; }
  // The pool block format this layout's pieces are in (2 for kFlashInferHnd, else 1).
  uint32_t PoolBlockFormat() const {
    return kind == EngineLayoutKind::kFlashInferHnd ? kPoolBlockFormatHeadMajor : kPoolBlockFormat;
  }
  // Bytes of one (layer, part) piece of one block.
  uint64_t PieceBytes() const;
  uint64_t PoolBlockBytes() const { return PieceBytes() * parts() * num_layers(); }
  // Bytes of one layer's tensor (all blocks).
  uint64_t LayerTensorBytes() const { return PieceBytes() * parts() * num_blocks; }

  // Where the piece (layer, part) of engine block `block` lives, and where it goes in a pool
  // block. REQUIRES: Validate() ok, block < num_blocks.
  uint8_t* EnginePiece(uint32_t layer, uint32_t part, uint32_t block) const;
  uint64_t PoolPieceOffset(uint32_t layer, uint32_t part) const {
    return (uint64_t{layer} * parts() + part) * PieceBytes();
  }

  // The signature that goes into the cache namespace. MLA's latent KV is identical on every
  // tensor-parallel rank: its signature is rank-independent, so one rank writes and all read.
  KvLayoutSignature Signature() const;

  // Errors: kInvalidArgument naming the field (no layers, a null layer pointer, zero sizes,
  // MLA without a latent dim, tp rank out of range).
  Status Validate() const;
};

}  // namespace cxlkv

#endif  // CXLKV_LAYOUT_H_
