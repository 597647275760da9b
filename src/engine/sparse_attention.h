// SparseDecodeAttention: the reference engine's decode attention done the PNM way:
// page digests of the engine's own paged KV, top-K page selection under a token budget, and
// attention over the selected pages read in place, returning output and log-sum-exp.
//
// Two modes:
//   kSparse  every selected page is attended next to the memory (pnm::Attend, on the caller's
//            thread and `threads` near-memory workers). Only q, out and lse cross the link.
//   kHybrid  PNM §3.3: the engine keeps up to `resident_pages` full pages per (layer, KV head) in
//            its own memory, chosen by steady-token selection (Algorithm 1: a page stays while
//            it stays in the budget set; only as many are recalled as were evicted). The engine
//            attends over the selected pages it holds, the near-memory side over the rest, and
//            the two partials merge exactly by log-sum-exp. Recalls are real copies, counted.
// Digests cover every position the first time Attend (or Prepare) sees the sequence — the bulk
// build after prefill — and then grow with each decoded token (a partial page's digest is
// widened, never rebuilt). Positions already digested are assumed unchanged (one sequence); a
// changed block table rebuilds from the first page that differs.
//
// Thread-safety: one per sequence; its decode loop calls it.
#ifndef CXLKV_ENGINE_SPARSE_ATTENTION_H_
#define CXLKV_ENGINE_SPARSE_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "engine/config.h"
#include "engine/decode_attention.h"
#include "engine/kv_cache.h"
#include "pnm/attend.h"
#include "pnm/attend_pool.h"
#include "pnm/select.h"
#include "pnm/steady.h"

namespace cxlkv::engine {

enum class AttentionMode { kDense, kSparse, kHybrid };

// "dense", "sparse", "hybrid". Errors: kInvalidArgument naming the accepted spellings.
Result<AttentionMode> ParseAttentionMode(const std::string& s);
const char* AttentionModeName(AttentionMode m);

struct SparseAttentionOptions {
  AttentionMode mode = AttentionMode::kSparse;  // kSparse or kHybrid
  pnm::SelectOptions select;                    // budget per KV head, sink and recent pages
  // kHybrid: full pages the engine holds per (layer, KV head); 0 means half the budget's pages.
  uint32_t resident_pages = 0;
  // Near-memory workers besides the caller's thread (pnm::AttendPool).
  uint32_t threads = 0;
  // Also attend over every page (untimed work) to measure how much of the dense softmax mass
  // the selection covered: exp(lse_selected - lse_all) per head (stats().mass_recall_*).
  bool audit = false;
};

// Totals since Create (or ResetStats), over layers and steps.
struct SparseAttentionStats {
  uint64_t layer_steps = 0;      // Attend calls
  uint64_t context_pages = 0;    // Σ pages of the context, per KV head
  uint64_t selected_pages = 0;   // Σ pages selected, per KV head
  uint64_t near_kv_bytes = 0;    // KV bytes read next to the memory
  uint64_t engine_kv_bytes = 0;  // KV bytes the engine read from its resident copies (hybrid)
  uint64_t recalled_bytes = 0;   // KV bytes copied into the engine (hybrid recalls)
  uint64_t recalled_pages = 0;   // per KV head
  uint64_t digest_bytes = 0;     // digest bytes scored
  uint64_t link_bytes = 0;       // crossing the link: q, out and lse per layer, plus recalls
  uint64_t digest_build_tokens = 0;
  double mass_recall_sum = 0;  // audit: Σ over (layer step, head) of the selection's mass
  double mass_recall_min = 1;
  uint64_t mass_recall_count = 0;
};

class SparseDecodeAttention final : public DecodeAttention {
 public:
  // Errors: kInvalidArgument when the mode is kDense, or the model's heads cannot be attended
  // by the pnm kernels (head_dim must be a multiple of 16 and at most 1024), or the budget is 0.
  static Result<std::unique_ptr<SparseDecodeAttention>> Create(const ModelConfig& c,
                                                               uint32_t block_size,
                                                               const SparseAttentionOptions& o);
  ~SparseDecodeAttention() override;

  // Builds (or completes) the digests of every layer for positions [0, tokens): the bulk build
  // after prefill, so that the first decode step does not pay for it. Errors as Attend's.
  Status Prepare(const PagedKvCache& cache, std::span<const uint32_t> block_table, uint64_t tokens);

  // DecodeAttention. Errors: kInvalidArgument for a layer or cache that does not match the
  // model this was created for, or a block table shorter than pos + 1 positions need.
  Status Attend(uint32_t layer, const float* q, uint32_t pos, const PagedKvCache& cache,
                std::span<const uint32_t> block_table, float* out) override;

  // Forgets the sequence (digests, resident pages): the next Attend starts another one.
  void Reset();

  const SparseAttentionStats& stats() const { return stats_; }
  void ResetStats() { stats_ = {}; }
  const SparseAttentionOptions& options() const { return options_; }

 private:
  struct Layer;
  SparseDecodeAttention(const ModelConfig& c, uint32_t block_size, const SparseAttentionOptions& o);

  // Page views and digests of `layer` brought up to `tokens` positions.
  Status CatchUp(uint32_t layer, const PagedKvCache& cache, std::span<const uint32_t> block_table,
                 uint64_t tokens);
  // kHybrid: drops the engine's resident copies of pages from `first_page` on (their KV changed).
  static void EvictResidentsFrom(Layer& L, uint64_t first_page);
  // kHybrid: recalls and evicts by steady selection, splits the selection, attends both parts
  // and merges them into near_.
  Status AttendHybrid(Layer& L, uint32_t layer, const float* q, const pnm::ContextView& ctx,
                      const PagedKvCache& cache);
  // Runs one Attend next to the memory (on the pool when there is one).
  Status AttendNear(const float* q, const pnm::ContextView& ctx, const pnm::Selection* selection,
                    pnm::Partial* out);

  pnm::Geometry geometry_;       // the model's heads, fp32, page_tokens = block_size
  SparseAttentionOptions options_;
  uint32_t num_layers_;
  std::vector<std::unique_ptr<Layer>> layers_;
  pnm::Selection selection_;
  pnm::Selection engine_part_, near_part_;
  pnm::Partial near_, engine_, all_;
  std::unique_ptr<pnm::AttendPool> pool_;
  SparseAttentionStats stats_;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_SPARSE_ATTENTION_H_
