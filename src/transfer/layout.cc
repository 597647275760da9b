#include "cxlkv/layout.h"

namespace cxlkv {

uint64_t EngineKvLayout::PieceBytes() const {
  const uint64_t per_token = kind == EngineLayoutKind::kMla ? uint64_t{latent_dim}
                                                            : uint64_t{num_kv_heads} * head_size;
  return uint64_t{block_size} * per_token * DtypeBytes(dtype);
}

uint8_t* EngineKvLayout::EnginePiece(uint32_t layer, uint32_t part, uint32_t block) const {
  const uint64_t slab = PieceBytes();
  uint64_t index = 0;
  switch (kind) {
    case EngineLayoutKind::kFlashAttn: index = uint64_t{part} * num_blocks + block; break;  // [2, nb, ...]
    case EngineLayoutKind::kFlashInfer:                                                    // [nb, 2, ...]
    case EngineLayoutKind::kFlashInferHnd: index = uint64_t{block} * 2 + part; break;
    case EngineLayoutKind::kMla: index = block; break;                                     // [nb, ...]
  }
  return layers[layer] + index * slab;
}

KvLayoutSignature EngineKvLayout::Signature() const {
  KvLayoutSignature s;
  s.dtype = dtype;
  s.num_layers = num_layers();
  s.block_size = block_size;
  s.pp_stage = pp_stage;
  s.kv_parts = parts();
  s.block_format = PoolBlockFormat();
  if (kind == EngineLayoutKind::kMla) {
    // One latent per token, the same on every rank: no rank in the signature.
    s.num_kv_heads = 1;
    s.head_size = latent_dim;
    s.tp_rank = 0;
    s.tp_size = 1;
  } else {
    s.num_kv_heads = num_kv_heads;
    s.head_size = head_size;
    s.tp_rank = tp_rank;
    s.tp_size = tp_size;
  }
  return s;
}

Status EngineKvLayout::Validate() const {
  if (static_cast<uint32_t>(kind) > static_cast<uint32_t>(EngineLayoutKind::kFlashInferHnd)) {
    return InvalidArgument("KV layout: unknown kind " + std::to_string(static_cast<uint32_t>(kind)));
  }
  if (layers.empty()) return InvalidArgument("KV layout has no layers");
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l] == nullptr) return InvalidArgument("KV layout: layer " + std::to_string(l) + " has a null base pointer");
  }
  if (num_blocks == 0 || block_size == 0) return InvalidArgument("KV layout: num_blocks and block_size must be > 0");
  if (DtypeBytes(dtype) == 0) return InvalidArgument("KV layout: unknown dtype");
  if (tp_size == 0 || tp_rank >= tp_size) {
    return InvalidArgument("KV layout: tensor-parallel rank " + std::to_string(tp_rank) + " is not below size " +
                           std::to_string(tp_size));
  }
  if (kind == EngineLayoutKind::kMla) {
    if (latent_dim == 0) return InvalidArgument("KV layout: MLA needs a latent dim");
  } else if (num_kv_heads == 0 || head_size == 0) {
    return InvalidArgument("KV layout: kv heads and head size must be > 0");
  }
  return Status::Ok();
}

}  // namespace cxlkv
