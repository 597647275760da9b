#include "transfer/request.h"

namespace cxlkv::transfer {

Status ValidateGather(const char* what, const NamespaceHandle& ns, const EngineKvLayout& layout,
                      std::span<const uint32_t> block_ids, std::span<const BlockKey> keys) {
  CXLKV_RETURN_IF_ERROR(layout.Validate());
  if (block_ids.size() != keys.size()) {
    return InvalidArgument(std::string(what) + ": " + std::to_string(block_ids.size()) + " block ids for " +
                           std::to_string(keys.size()) + " keys");
  }
  const uint64_t block_bytes = layout.PoolBlockBytes();
  if (ns.block_bytes != block_bytes) {
    return InvalidArgument(std::string(what) + ": the namespace's KV layout (" + std::to_string(ns.block_bytes) +
                           " bytes per block) is not this engine layout's (" + std::to_string(block_bytes) +
                           "): register the namespace with EngineKvLayout::Signature()");
  }
  for (uint32_t id : block_ids) {
    if (id >= layout.num_blocks) {
      return InvalidArgument(std::string(what) + ": block id " + std::to_string(id) +
                             " is out of range (the engine has " + std::to_string(layout.num_blocks) + " blocks)");
    }
  }
  return Status::Ok();
}

Status ReserveAll(KvCache& cache, const NamespaceHandle& ns, uint64_t block_bytes, std::span<const uint32_t> block_ids,
                  std::span<const BlockKey> keys, std::vector<Reservation>& reserved, std::vector<uint32_t>& reserved_ids,
                  GatherResult& out) {
  // One batch: payloads allocated up front, one stripe lock per stripe touched.
  CXLKV_ASSIGN_OR_RETURN(auto many, cache.ReserveMany(ns, keys, block_bytes));
  reserved.reserve(keys.size());
  reserved_ids.reserve(keys.size());
  Status error;
  size_t skipped = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    switch (many[i].outcome) {
      case ReserveOutcome::kReserved:
        reserved.push_back(many[i].reservation);
        reserved_ids.push_back(block_ids[i]);
        break;
      case ReserveOutcome::kAlreadyCached:
      case ReserveOutcome::kBusy: ++skipped; break;
      case ReserveOutcome::kError:
        if (error.ok()) error = many[i].status;
        break;
    }
  }
  if (!error.ok()) {
    (void)cache.AbortMany(reserved);
    reserved.clear();
    reserved_ids.clear();
    return error;
  }
  out.already_cached += skipped;
  return Status::Ok();
}

Result<GatherResult> CommitAll(KvCache& cache, std::span<Reservation> reserved, GatherResult out) {
  // Every block is committed even if one fails (a reservation reclaimed because this node was
  // presumed dead): none is left WRITING behind the error.
  CXLKV_RETURN_IF_ERROR(cache.CommitMany(reserved));
  out.written += reserved.size();
  return out;
}

Status ValidateScatter(const char* what, const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                       std::span<const BlockPin> pins) {
  CXLKV_RETURN_IF_ERROR(layout.Validate());
  if (block_ids.size() != pins.size()) {
    return InvalidArgument(std::string(what) + ": " + std::to_string(block_ids.size()) + " block ids for " +
                           std::to_string(pins.size()) + " pinned blocks");
  }
  const uint64_t block_bytes = layout.PoolBlockBytes();
  std::vector<bool> seen(layout.num_blocks, false);
  for (size_t i = 0; i < block_ids.size(); ++i) {
    uint32_t id = block_ids[i];
    if (id >= layout.num_blocks) {
      return InvalidArgument(std::string(what) + ": block id " + std::to_string(id) +
                             " is out of range (the engine has " + std::to_string(layout.num_blocks) + " blocks)");
    }
    if (seen[id]) {
      return InvalidArgument(std::string(what) + ": block id " + std::to_string(id) +
                             " appears twice: the destinations would overlap");
    }
    seen[id] = true;
    if (pins[i].bytes != block_bytes) {
      return InvalidArgument(std::string(what) + ": pool block " + std::to_string(i) + " holds " +
                             std::to_string(pins[i].bytes) + " bytes, the engine layout's block " +
                             std::to_string(block_bytes) + ": layout signature mismatch");
    }
  }
  return Status::Ok();
}

}  // namespace cxlkv::transfer
