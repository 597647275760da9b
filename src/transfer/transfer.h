// Batched KV transfer between an engine's paged cache and pool blocks (Beluga §5.2, §6.1): one
// call moves a whole request's blocks.
//
//   transfer::CpuTransfer t(cache, {.threads = 2});
//   t.GatherWrite(ns, engine_layout, block_ids, keys);   // engine pieces → pool blocks, committed
//   auto hit = cache.Lookup(ns, keys);
//   t.ScatterRead(engine_layout, block_ids, hit->pins);  // pool blocks → engine pieces
//
// Every request is validated whole before a byte moves: an invalid one fails with nothing
// written into the engine's cache and nothing published in the pool. Pieces below
// `small_piece_bytes` (Beluga O4: 4 KiB) are copied with plain loads/stores, larger ones with
// non-temporal stores; the pieces are split across the worker threads; nothing is allocated
// per piece.
//
// Thread-safety: one call at a time per CpuTransfer (it owns its workers); the cache is shared.
#ifndef CXLKV_SRC_TRANSFER_TRANSFER_H_
#define CXLKV_SRC_TRANSFER_TRANSFER_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/layout.h"

namespace cxlkv::transfer {

struct TransferOptions {
  uint32_t threads = 1;               // workers, including the caller. Default 1.
  uint64_t small_piece_bytes = 4096;  // below: plain copy; at or above: non-temporal. Default 4 KiB.
};

// What a gather-write did, block by block.
// A sparse (token-granular) read, Beluga §7.3 Exp #10: for every layer and KV head, which
// tokens of the request to fetch. Token t lives in pool block t / block_size, row t % block_size.
struct SparseSelection {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  // tokens[layer * num_kv_heads + head]: token indices into the request (any order, no limit
  // but the destination's capacity).
  std::vector<std::vector<uint32_t>> tokens;
};

// Where a sparse read lands: per layer a K and a V buffer, each [num_kv_heads][capacity][head_size]
// (selected token i of head h at row i of head h's slab).
struct SparseDestination {
  std::vector<uint8_t*> k;  // per layer
  std::vector<uint8_t*> v;  // per layer
  uint32_t capacity = 0;    // rows per head
};

struct GatherResult {
  uint64_t written = 0;         // blocks reserved, copied and committed by this call
  uint64_t already_cached = 0;  // READY already (or being written elsewhere): skipped
};

class CpuTransfer {
 public:
  CpuTransfer(KvCache& cache, TransferOptions options = {});
  ~CpuTransfer();
  CpuTransfer(const CpuTransfer&) = delete;
  CpuTransfer& operator=(const CpuTransfer&) = delete;

  // Engine blocks `block_ids[i]` → pool blocks under `keys[i]`, each committed when complete.
  // Errors (nothing published): kInvalidArgument (layout, block id out of range, sizes differ,
  // the namespace's layout is not this one), and the cache's reserve errors (kNoSpace...): on a
  // failure mid-request the blocks this call reserved are aborted.
  Result<GatherResult> GatherWrite(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                   std::span<const uint32_t> block_ids, std::span<const BlockKey> keys);

  // Pinned pool blocks `pins[i]` → engine blocks `block_ids[i]`. Errors (engine untouched):
  // kInvalidArgument (layout, block id out of range, a block id twice — overlapping
  // destinations —, a pin of another size than the layout's block).
  Status ScatterRead(const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                     std::span<const BlockPin> pins);

  // Copies the selected tokens' K and V of pinned pool blocks (the request's blocks in order,
  // shaped by `layout`, not MLA) into `dst`, one piece per (layer, head, token, K/V).
  // Errors (destination untouched): kInvalidArgument (shapes differ, a token beyond the
  // request, more tokens than the capacity, a null buffer, a pin of another size).
  Status SparseRead(const EngineKvLayout& layout, std::span<const BlockPin> pins, const SparseSelection& selection,
                    const SparseDestination& dst);

  const TransferOptions& options() const { return options_; }

 private:
  struct Piece {
    uint8_t* dst;
    const uint8_t* src;
    uint64_t bytes;
  };
  // Copies every piece, split across the workers; `to_pool` picks the store flavour.
  void CopyAll(std::span<const Piece> pieces, bool to_pool);
  void CopyRange(std::span<const Piece> pieces, bool to_pool);
  void WorkerLoop(uint32_t index);

  KvCache& cache_;
  TransferOptions options_;
  std::vector<Piece> pieces_;     // reused across calls: no per-piece allocation once warm
  std::vector<uint64_t> prefix_;  // the caller's byte prefix sums for splitting

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::span<const Piece> job_;
  bool job_to_pool_ = false;
  uint64_t job_generation_ = 0;
  uint32_t pending_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace cxlkv::transfer

#endif  // CXLKV_SRC_TRANSFER_TRANSFER_H_
