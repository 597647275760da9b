// RemoteDecodeAttention: the reference engine decoding with its prompt's KV left in the pool and
// attended next to the memory by a cxlkvd (PNM §3.2; docs/pnm.md, "Engines in cxlkvd").
//
//   auto nm = pnm::NearMemoryClient::Open(pool, node);
//   auto ra = RemoteDecodeAttention::Create(config, block_size, **nm, kv_namespace, {.budget_tokens = 2048});
//   (*ra)->Open(prompt_keys);                  // the prompt's full blocks, already in the pool
//   model.Decode(token, pos, cache, table, ra->get());
//
// Per layer and step, the query goes to the daemon, which attends over the context's pages
// (every page, or the top-K pages under the budget) and returns the output and log-sum-exp. The
// tokens after the context — the prompt's partial last block and everything decoded — are in
// the engine's own cache; the engine attends over them itself and merges the two partials by
// LSE (pnm::MergeInto), exactly. So the prompt's KV never has to be loaded into the engine: only
// queries, outputs and LSEs cross the link, whatever the context's length.
//
// The hybrid (PNM §3.3), with `held_pages`: the engine holds up to that many of the context's
// pages per (layer, KV head), chosen by steady-token selection (HeldPages), and tells the daemon
// which; the daemon attends the rest of its selection and answers per KV head with the held
// pages still selected and the best ones to recall into the room left
// (NearMemoryClient::AttendSplit). The engine attends its held selected pages from its copies,
// merges, then steps its held set: recalls are copies out of the pool blocks, counted, and they
// serve from the next step on.
//
// A context the daemon closed (its lease ran out while this engine was paused) is opened again
// once, transparently; any other error fails the decode step.
//
// Thread-safety: one per sequence's decode loop, like every DecodeAttention.
#ifndef CXLKV_ENGINE_REMOTE_ATTENTION_H_
#define CXLKV_ENGINE_REMOTE_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"
#include "engine/config.h"
#include "engine/decode_attention.h"
#include "engine/held_pages.h"
#include "engine/sparse_attention.h"
#include "pnm/attend.h"
#include "pnm/remote.h"

namespace cxlkv::engine {

struct RemoteAttentionOptions {
  uint32_t budget_tokens = 0;  // 0: every page of the context (dense at the daemon). Default 0.
  uint16_t sink_pages = 1;     // default 1
  uint16_t recent_pages = 1;   // default 1
  // The hybrid: context pages the engine holds per (layer, KV head); 0 (the default): none.
  // Needs a budget, and the cache to recall pages from.
  uint32_t held_pages = 0;
};

class RemoteDecodeAttention final : public DecodeAttention {
 public:
  // `ns` is the namespace the prompt's blocks are stored under (the engine's layout, fp32).
  // `cache` (the pool's, for the hybrid's recalls) may be null without held_pages.
  // Errors: kInvalidArgument when the model's heads cannot be attended by the pnm kernels
  // (head_dim a multiple of 16, at most 1024), or held_pages without a budget or a cache.
  static Result<std::unique_ptr<RemoteDecodeAttention>> Create(const ModelConfig& c, uint32_t block_size,
                                                               pnm::NearMemoryClient& client, const KeyNamespace& ns,
                                                               const RemoteAttentionOptions& o,
                                                               KvCache* cache = nullptr);
  ~RemoteDecodeAttention() override;

  // Starts a sequence whose first keys.size() blocks are those pool blocks: opens the context at
  // the daemon (closing the previous sequence's); the hybrid also pins them here, to recall
  // from. Errors: the open's (kNotFound: a block is not in the pool; kUnavailable: no daemon
  // answers).
  Status Open(std::span<const BlockKey> keys);
  // Closes the context (the next Attend attends the engine's cache alone).
  void Close();

  // DecodeAttention: positions [0, context tokens) at the daemon, the rest from `cache`.
  // Errors: kInvalidArgument for a layer or cache that does not match, a position inside the
  // context, or a block table too short; the daemon's errors.
  Status Attend(uint32_t layer, const float* q, uint32_t pos, const PagedKvCache& cache,
                std::span<const uint32_t> block_table, float* out) override;

  // Tokens of the open context (0 when none).
  uint64_t context_tokens() const { return keys_.size() * geometry_.page_tokens; }
  // layer_steps; context_pages and selected_pages of the daemon's part (per KV head);
  // near_kv_bytes the KV it read; engine_kv_bytes the engine's own part (its tokens after the
  // context, and the hybrid's held pages); link_bytes the query, output and lse bytes that
  // crossed (the hybrid's page lists and recalls too); recalled_pages and recalled_bytes.
  const SparseAttentionStats& stats() const { return stats_; }
  void ResetStats() { stats_ = {}; }
  uint64_t reopened() const { return reopened_; }
  // The hybrid: times its pins turned out to be an ended life's and were taken again.
  uint64_t repinned() const { return repinned_; }

 private:
  RemoteDecodeAttention(const pnm::Geometry& g, uint32_t layers, pnm::NearMemoryClient& client, const KeyNamespace& ns,
                        const RemoteAttentionOptions& o)
      : geometry_(g), num_layers_(layers), client_(client), ns_(ns), options_(o) {}
  // The daemon's part of a step into remote_ (the hybrid's held pages left out and attended
  // here); reopens a context its lease closed.
  Status AttendContext(uint32_t layer, const float* q);
  // The hybrid: the engine's held selected pages merged into remote_, then the held set stepped.
  Status AttendHeld(uint32_t layer, const float* q);
  // The hybrid: pins the context's blocks under this node's current life and invalidates this
  // host's copies of them once (P2: READY blocks never change after).
  Status PinContext();
  // Releases the pins if they are still this life's (a recovered life's pins are not its own
  // any more) and forgets the held copies.
  void ReleasePins();

  pnm::Geometry geometry_;  // the model's heads, fp32, page_tokens = block_size
  uint32_t num_layers_;
  pnm::NearMemoryClient& client_;
  KeyNamespace ns_;
  RemoteAttentionOptions options_;
  std::vector<BlockKey> keys_;
  uint64_t context_ = 0;
  bool open_ = false;
  std::vector<pnm::PageKv> local_pages_;
  pnm::Partial remote_, local_, held_part_;
  // The hybrid: the pool's cache and the namespace's handle, the context's blocks pinned (to
  // recall from), per layer the held pages, and a step's held lists and the daemon's steps.
  KvCache* cache_ = nullptr;
  std::optional<NamespaceHandle> handle_;
  pnm::Geometry pool_geometry_;  // geometry_ in the namespace's block format (a recall's source)
  std::vector<BlockPin> pins_;
  uint64_t pin_life_ = 0;  // the node life the pins were taken under
  std::vector<std::unique_ptr<HeldPages>> held_;
  std::vector<std::vector<uint32_t>> held_lists_, mine_;
  std::vector<pnm::HeldStep> steps_;  // the daemon's answer per KV head
  std::vector<uint32_t> step_pages_;  // one head's stayed pages, then its recalls
  SparseAttentionStats stats_;
  uint64_t reopened_ = 0;
  uint64_t repinned_ = 0;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_REMOTE_ATTENTION_H_
