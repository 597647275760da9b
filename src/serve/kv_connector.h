// The KV connector between the reference engine and where KV lives, following TraCT §3.2's
// steps. One connector per worker process; its mode is the configuration under test:
//
//   kRecompute  no KV reuse: every prompt is computed whole (baseline a)
//   kPrivate    a private per-worker DRAM cache of blocks, as a single-node offload cache does:
//               no sharing across workers (baseline b)
//   kTcp        kPrivate's reuse, and the prefill→decode handoff over TCP with host staging,
//               the network path of NIXL/UCX-style stacks (baseline c)
//   kPool       cxlkv: the shared prefix cache in the pool, and the handoff through it (d)
//
// Prefill: key chain, lookup, layer-wise load of the hit prefix overlapped with the compute of
// the rest (StartLoad + the engine's per-layer hook), layer-wise store of the new full blocks
// (StartStore), then the handoff of the prompt's KV to a decode worker. Decode: the prompt's
// KV from the handoff (recomputing only what is missing), then greedy generation. Pins are
// released when done; one-use handoff blocks are evicted by the decode side.
//
// Thread-safety: one request at a time per connector.
#ifndef CXLKV_SRC_SERVE_KV_CONNECTOR_H_
#define CXLKV_SRC_SERVE_KV_CONNECTOR_H_

#include <list>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "cxlkv/cache.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/remote_attention.h"
#include "engine/sparse_attention.h"
#include "pnm/remote.h"
#include "transfer/transfer.h"

namespace cxlkv::serve {

enum class KvMode { kRecompute, kPrivate, kTcp, kPool };

Result<KvMode> ParseKvMode(std::string_view name);  // "recompute" | "private" | "tcp" | "pool"
std::string_view KvModeName(KvMode mode);

// What one request cost, for the router's report.
struct KvStats {
  uint32_t prompt_tokens = 0;
  uint32_t prompt_blocks = 0;     // full blocks of the prompt
  uint32_t hit_blocks = 0;        // prefill: reused from a cache; decode: loaded from the handoff
  uint32_t hit_from_mem = 0;      // of hit_blocks: brought in from a node-DRAM tier (pool mode)
  uint32_t hit_from_ssd = 0;      // of hit_blocks: brought in from an SSD tier (pool mode)
  uint32_t computed_tokens = 0;   // tokens run through the model's prefill
  uint64_t bytes_loaded = 0;      // into the engine's cache from a cache or handoff
  uint64_t bytes_stored = 0;      // out of the engine's cache into a cache or handoff
  double wait_ms = 0;             // prefill: waiting for blocks in flight elsewhere and for loaded layers
  uint32_t blocks_not_stored = 0; // the pool had no room (pinned and in-flight blocks filled it):
                                  // served without caching them; a missing handoff block is
                                  // recomputed by the decode side
  // Decode with sparse or hybrid attention (engine::SparseAttentionStats, summed over layers and
  // steps): pages attended and in context, per KV head; bytes that crossed to the engine (q,
  // out, lse, recalls); KV bytes the attention read.
  uint64_t attention_layer_steps = 0;
  uint64_t attention_selected_pages = 0;
  uint64_t attention_context_pages = 0;
  uint64_t attention_link_bytes = 0;
  uint64_t attention_kv_bytes = 0;
  // Remote attention (pool mode): prompt tokens attended at the router node's cxlkvd instead of
  // being loaded into the engine, and decodes that fell back to loading them (the daemon could
  // not open the context: a block missing, no daemon).
  uint64_t attention_remote_tokens = 0;
  uint32_t attention_remote_fallbacks = 0;
};

// A private per-worker DRAM cache of pool-format blocks, LRU, bounded in bytes.
class PrivateBlockCache {
 public:
  explicit PrivateBlockCache(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  // The longest prefix of `keys` present (each touched).
  size_t LongestPrefix(std::span<const BlockKey> keys);
  const std::vector<uint8_t>* Get(const BlockKey& key);
  void Put(const BlockKey& key, std::vector<uint8_t> block);
  uint64_t bytes() const { return bytes_; }

 private:
  struct KeyHash {
    size_t operator()(const BlockKey& k) const { return k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull); }
  };
  using Lru = std::list<std::pair<BlockKey, std::vector<uint8_t>>>;
  uint64_t capacity_;
  uint64_t bytes_ = 0;
  Lru lru_;  // most recent first
  std::unordered_map<BlockKey, Lru::iterator, KeyHash> map_;
};

// A prefill whose lookup and prefix load have started, as soon as it was queued (TraCT steps
// 1-3 run ahead, overlapping the compute of the request before it). Destroying it waits for its
// loads, releases its pins and gives back its engine blocks.
class PreparedPrefill {
 public:
  ~PreparedPrefill();
  PreparedPrefill(const PreparedPrefill&) = delete;
  PreparedPrefill& operator=(const PreparedPrefill&) = delete;
  uint64_t request_id() const { return request_id_; }
  uint32_t hit_blocks() const { return stats_.hit_blocks; }

 private:
  friend class KvConnector;
  PreparedPrefill(KvCache& pool, engine::PagedKvCache& engine) : pool_(pool), engine_(engine) {}
  void ReleasePins();

  KvCache& pool_;
  engine::PagedKvCache& engine_;
  uint64_t request_id_ = 0;
  std::vector<int32_t> prompt_;
  std::vector<uint32_t> ids_;      // the prompt's engine blocks
  std::vector<BlockKey> chain_;
  std::vector<BlockPin> pins_;     // every block being loaded
  std::vector<std::unique_ptr<transfer::LayerLoad>> loads_;
  KvStats stats_;
};

struct PrefillResult {
  int32_t first_token = -1;
  KvStats stats;
  std::vector<uint8_t> tcp_payload;  // kTcp: the prompt's blocks in pool format, for the decode side
};

struct DecodeResult {
  std::vector<int32_t> tokens;  // max_new greedy tokens, the first from the prefill
  int64_t first_token_ns = 0;   // when the prompt's KV was in place and the first token out
  KvStats stats;
};

class KvConnector {
 public:
  // `run_id` keeps one run's one-use handoff keys apart from another's on the same pool.
  KvConnector(KvMode mode, const engine::Model& model, engine::PagedKvCache& engine_cache, KvCache& pool_cache,
              NamespaceHandle ns, uint64_t run_id, uint64_t private_cache_bytes);

  Result<PrefillResult> Prefill(uint64_t request_id, std::span<const int32_t> prompt);
  // Steps 1-3 only: engine blocks, key chain, lookup, and the start of the layer-wise load of
  // the hit prefix (returns once it is queued). `await_in_flight`: wait for a block another
  // worker is writing (a prefetch does not: it must not hold up the request before it).
  // Errors: kNoSpace (the engine's cache is full), the pool's lookup errors.
  Result<std::unique_ptr<PreparedPrefill>> Prepare(uint64_t request_id, std::span<const int32_t> prompt,
                                                   bool await_in_flight);
  // The rest of a prepared prefill: a top-up lookup of what was published since it was
  // prepared, the compute of the missing suffix, the store and the handoff.
  Result<PrefillResult> Prefill(PreparedPrefill& prepared);
  // `tcp_payload`: kTcp's blocks as received (else ignored). Errors: kInternal when a
  // recomputed first token differs from the prefill's (the engine lost determinism).
  Result<DecodeResult> Decode(uint64_t request_id, std::span<const int32_t> prompt, int32_t first_token,
                              uint32_t max_new, const std::vector<uint8_t>* tcp_payload);

  KvMode mode() const { return mode_; }
  // Pool mode, prefix hits on capacity tiers: promote them into the region and load from there
  // (false, the default), or read them straight into the engine's blocks, leaving them where
  // they are (true: transfer::CpuTransfer::LoadFromCapacity).
  void SetStreamCapacity(bool stream) { stream_capacity_ = stream; }
  // Decode with this attention (sparse or hybrid; reset for each request) instead of dense.
  void SetDecodeAttention(std::unique_ptr<engine::SparseDecodeAttention> a) { decode_attention_ = std::move(a); }
  // Pool mode: decode with the prompt's full blocks left in the pool and attended next to the
  // memory by `client`'s daemon (engine/remote_attention.h); only the prompt's partial block is
  // loaded. Falls back to loading every block when the daemon cannot open the context.
  void SetRemoteAttention(std::unique_ptr<pnm::NearMemoryClient> client,
                          std::unique_ptr<engine::RemoteDecodeAttention> a) {
    remote_client_ = std::move(client);
    remote_attention_ = std::move(a);
  }
  uint64_t BlockBytes() const { return layout_.PoolBlockBytes(); }

 private:
  // The pool's lookup under this connector's capacity policy.
  Result<LookupResult> PoolLookup(std::span<const BlockKey> keys);
  // Streams the capacity run after `hit` (stream_capacity_) into engine blocks `ids` (those of
  // the run's keys); adds what it loaded to the stats. Returns the blocks loaded.
  uint32_t LoadCapacityRun(const LookupResult& hit, std::span<const uint32_t> ids, std::span<const BlockKey> keys,
                           KvStats& stats);
  // Adds a lookup's hit (its keys start at the prepared request's hit_blocks) to the prepared
  // request: loads its pinned blocks, streams a capacity run after them, and looks on while
  // streaming makes progress. `reusable`: the prompt's blocks that may hit.
  Status TakeHit(PreparedPrefill& p, LookupResult hit, size_t reusable);
  // Lookup of the prompt's reusable blocks that, where the first missing block is being
  // written by another worker, waits (bounded) for it to land; the wait goes to stats.wait_ms.
  Result<LookupResult> LookupAwaitingInFlight(std::span<const BlockKey> keys, KvStats& stats);
  // One-use keys of a request's handoff blocks (not shared: salted with the run and request).
  std::vector<BlockKey> HandoffKeys(uint64_t request_id, uint32_t first, uint32_t count) const;
  // Pool-format block bytes ↔ engine block `id`.
  void BlockToEngine(const uint8_t* block, uint32_t id);
  void BlockFromEngine(uint32_t id, uint8_t* block) const;
  // Writes engine blocks `ids` under `keys` (skipping those already there); adds the bytes.
  Status Publish(std::span<const uint32_t> ids, std::span<const BlockKey> keys, KvStats& stats);
  // Publish, where a full pool (kNoSpace) only counts the blocks in blocks_not_stored.
  Status PublishOrSkip(std::span<const uint32_t> ids, std::span<const BlockKey> keys, KvStats& stats);

  KvMode mode_;
  const engine::Model& model_;
  engine::PagedKvCache& engine_cache_;
  EngineKvLayout layout_;
  KvCache& pool_;
  transfer::CpuTransfer transfer_;
  NamespaceHandle ns_;
  uint64_t run_id_;
  PrivateBlockCache private_;
  bool stream_capacity_ = false;
  std::unique_ptr<engine::SparseDecodeAttention> decode_attention_;  // null: dense
  std::unique_ptr<pnm::NearMemoryClient> remote_client_;             // before the attention using it
  std::unique_ptr<engine::RemoteDecodeAttention> remote_attention_;  // null: none
};

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_KV_CONNECTOR_H_
