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
// Layer-wise pipelining (Unified KV pooling §II-B): StartLoad begins moving a request's hit
// blocks as soon as it is queued and returns at once; the engine waits per layer
// (WaitLayer(l)), so compute of layer l overlaps the load of layer l+1. StartStore is the mirror:
// the engine reports each layer computed and the copy of that layer to the pool runs while it
// computes the next; Finish() commits. One background thread per CpuTransfer runs these in
// FIFO order (a prefetch queued behind a running load starts right after it).
//
// Thread-safety: calls on one CpuTransfer are serialized (it owns its workers): a synchronous
// call made while a layer-wise load is in flight waits for the layer being copied, not for the
// whole load. Handles may be used from any thread; the cache is shared.
#ifndef CXLKV_SRC_TRANSFER_TRANSFER_H_
#define CXLKV_SRC_TRANSFER_TRANSFER_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/layout.h"
#include "transfer/request.h"

namespace cxlkv::transfer {

struct TransferOptions {
  uint32_t threads = 1;               // workers, including the caller. Default 1.
  uint64_t small_piece_bytes = 4096;  // below: plain copy; at or above: non-temporal. Default 4 KiB.
};

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


class CpuTransfer;
struct LayerwiseState;  // shared by a handle and the background thread (layerwise.cc)

// A layer-wise load in flight: pool blocks → engine blocks, layer 0 first. Destroying it waits
// until the load has finished (it writes into the engine's memory).
class LayerLoad {
 public:
  ~LayerLoad();
  LayerLoad(const LayerLoad&) = delete;
  LayerLoad& operator=(const LayerLoad&) = delete;
  uint32_t num_layers() const;
  // Layers 0..n-1 are complete in the engine's cache (monotonic).
  uint32_t layers_ready() const;
  bool LayerReady(uint32_t layer) const { return layer < layers_ready(); }
  // Blocks until every byte of `layer` (all blocks of the request) is in the engine's cache.
  void WaitLayer(uint32_t layer) const;
  void Wait() const { WaitLayer(num_layers() - 1); }

 private:
  friend class CpuTransfer;
  explicit LayerLoad(std::shared_ptr<LayerwiseState> s) : state_(std::move(s)) {}
  std::shared_ptr<LayerwiseState> state_;
};

// A layer-wise store in flight: engine blocks → reserved pool blocks, a layer as soon as the
// engine reports it computed. Destroying it without Finish() aborts the reservations (nothing
// is published).
class LayerStore {
 public:
  ~LayerStore();
  LayerStore(const LayerStore&) = delete;
  LayerStore& operator=(const LayerStore&) = delete;
  uint32_t num_layers() const;
  // The engine has finished writing `layer` of every block of the request: copy it now.
  // Errors: kInvalidArgument (layer out of range or reported twice).
  Status LayerComputed(uint32_t layer);
  // Waits for every layer (all must have been reported) and commits the blocks; returns what
  // the call wrote. `before_commit`, when given, runs once every copy is done and may veto the
  // commit (its error is returned, the reservations aborted). Errors: kInvalidArgument (a layer
  // was never reported: nothing published, the reservations are aborted), the veto, the cache's
  // commit errors.
  Result<GatherResult> Finish(const std::function<Status()>& before_commit = {});

 private:
  friend class CpuTransfer;
  LayerStore(CpuTransfer& t, std::shared_ptr<LayerwiseState> s) : transfer_(t), state_(std::move(s)) {}
  CpuTransfer& transfer_;
  std::shared_ptr<LayerwiseState> state_;
  bool finished_ = false;
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

  // Starts loading pinned pool blocks `pins[i]` into engine blocks `block_ids[i]`, layer by
  // layer, and returns at once. The request is validated whole first, as ScatterRead.
  // `on_layer_ready(l)`, if set, runs on the background thread right after layer l is complete
  // (an engine records a stream event there). REQUIRES: the pins stay held and the engine's
  // tensors stay allocated until the load is waited for or destroyed.
  Result<std::unique_ptr<LayerLoad>> StartLoad(const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                                               std::span<const BlockPin> pins,
                                               std::function<void(uint32_t layer)> on_layer_ready = {});

  // The capacity-tier source: blocks `keys` that a lookup left on node DRAM or SSD
  // (CapacityPolicy::kLeave) → engine blocks `block_ids[i]`, without promoting them: their owners
  // read them into region staging and they are scattered from there (KvCache::ReadCapacity).
  // Loads the longest prefix it can; returns it. Errors (engine untouched): ScatterRead's
  // kInvalidArgument, kNotSupported (no tiers reachable).
  Result<CapacityRead> LoadFromCapacity(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                        std::span<const uint32_t> block_ids, std::span<const BlockKey> keys);

  // Reserves pool blocks for `keys` (all or nothing, as GatherWrite; blocks already cached are
  // skipped) and returns a store that copies engine blocks `block_ids[i]` one layer at a time.
  Result<std::unique_ptr<LayerStore>> StartStore(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                                 std::span<const uint32_t> block_ids, std::span<const BlockKey> keys);

  const TransferOptions& options() const { return options_; }

  struct Piece {
    uint8_t* dst;
    const uint8_t* src;
    uint64_t bytes;
  };

 private:
  friend class LayerStore;
  // Background thread: runs one (state, layer) step at a time, FIFO.
  void AsyncLoop();
  void Enqueue(std::shared_ptr<LayerwiseState> state, uint32_t layer);
  void RunLayer(LayerwiseState& state, uint32_t layer);

  // Copies every piece, split across the workers; `to_pool` picks the store flavour.
  void CopyAll(std::span<const Piece> pieces, bool to_pool);
  void CopyRange(std::span<const Piece> pieces, bool to_pool);
  void WorkerLoop(uint32_t index);

  KvCache& cache_;
  TransferOptions options_;
  std::mutex call_mu_;  // one copy (synchronous call or one layer of an async one) at a time
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

  std::mutex async_mu_;
  std::condition_variable async_cv_;
  std::deque<std::pair<std::shared_ptr<LayerwiseState>, uint32_t>> async_queue_;
  bool async_stop_ = false;
  std::thread async_thread_;  // started on the first layer-wise call
};

}  // namespace cxlkv::transfer

#endif  // CXLKV_SRC_TRANSFER_TRANSFER_H_
