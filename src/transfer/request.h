// What every transfer path (CPU, CUDA, layer-wise) does with a request before and after moving
// bytes: validate it whole, reserve its pool blocks all-or-nothing, commit them all.
#ifndef CXLKV_SRC_TRANSFER_REQUEST_H_
#define CXLKV_SRC_TRANSFER_REQUEST_H_

#include <span>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/layout.h"

namespace cxlkv::transfer {

// What a gather-write did, block by block.
struct GatherResult {
  uint64_t written = 0;         // blocks reserved, copied and committed by this call
  uint64_t already_cached = 0;  // READY already (or being written elsewhere): skipped
};

// Errors (kInvalidArgument, `what` first): the layout, sizes that differ, a block id out of
// range, a namespace registered with another layout.
Status ValidateGather(const char* what, const NamespaceHandle& ns, const EngineKvLayout& layout,
                      std::span<const uint32_t> block_ids, std::span<const BlockKey> keys);
// Errors (kInvalidArgument): the layout, sizes that differ, a block id out of range or twice
// (overlapping destinations), a pin of another size than the layout's block.
Status ValidateScatter(const char* what, const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                       std::span<const BlockPin> pins);
// Reserves a pool block per key; READY or in-flight ones (kAlreadyExists/kBusy) are counted in
// `out.already_cached` and skipped. On another error every reservation made is aborted.
Status ReserveAll(KvCache& cache, const NamespaceHandle& ns, uint64_t block_bytes, std::span<const uint32_t> block_ids,
                  std::span<const BlockKey> keys, std::vector<Reservation>& reserved, std::vector<uint32_t>& reserved_ids,
                  GatherResult& out);
// Commits every reservation even if one fails (a reservation reclaimed because this node was
// presumed dead): none is left WRITING behind the error. Returns the first error.
Result<GatherResult> CommitAll(KvCache& cache, std::span<Reservation> reserved, GatherResult out);

}  // namespace cxlkv::transfer

#endif  // CXLKV_SRC_TRANSFER_REQUEST_H_
