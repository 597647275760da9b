#include "engine/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "pnm/digest.h"
#include "engine/held_pages.h"
#include "pnm/geometry.h"
#include "util/huge_page_allocator.h"

namespace cxlkv::engine {

namespace {

// Σ over KV heads of the pages a selection names (heads may share one list).
uint64_t PagesOverHeads(const pnm::Selection& s) {
  uint64_t n = 0;
  for (uint32_t h = 0; h < s.num_kv_heads(); ++h) n += s.Of(h).size();
  return n;
}
}  // namespace

Result<AttentionMode> ParseAttentionMode(const std::string& s) {
  if (s == "dense") return AttentionMode::kDense;
  if (s == "sparse") return AttentionMode::kSparse;
  if (s == "hybrid") return AttentionMode::kHybrid;
  return InvalidArgument("attention mode '" + s + "' is not one of dense, sparse, hybrid");
}

const char* AttentionModeName(AttentionMode m) {
  switch (m) {
    case AttentionMode::kDense:
      return "dense";
    case AttentionMode::kSparse:
      return "sparse";
    case AttentionMode::kHybrid:
      return "hybrid";
  }
  return "?";
}

// One layer's view of the sequence: page pointers into the engine's cache, digests, and (hybrid)
// the engine's resident copies per KV head.
struct SparseDecodeAttention::Layer {
  std::vector<uint32_t> blocks;  // the block id behind each viewed page
  std::vector<pnm::PageKv> pages;
  util::HugePageBytes digests;    // pages × DigestBytesPerPage (scanned every step: huge pages)
  uint64_t digested = 0;          // positions whose keys the digests cover
  std::unique_ptr<HeldPages> held;  // kHybrid: the engine's copies, made at the first step
  std::vector<uint32_t> ranked;      // scratch: a head's full budget pages, best first
};

SparseDecodeAttention::SparseDecodeAttention(const ModelConfig& c, uint32_t block_size,
                                             const SparseAttentionOptions& o)
    : options_(o), num_layers_(c.num_layers) {
  geometry_.num_heads = c.num_heads;
  geometry_.num_kv_heads = c.num_kv_heads;
  geometry_.head_dim = c.head_dim;
  geometry_.page_tokens = block_size;
  geometry_.dtype = KvDtype::kFp32;
  for (uint32_t l = 0; l < num_layers_; ++l) layers_.push_back(std::make_unique<Layer>());
  if (o.threads > 0) pool_ = std::make_unique<pnm::AttendPool>(o.threads);
}

SparseDecodeAttention::~SparseDecodeAttention() = default;

Result<std::unique_ptr<SparseDecodeAttention>> SparseDecodeAttention::Create(
    const ModelConfig& c, uint32_t block_size, const SparseAttentionOptions& o) {
  CXLKV_RETURN_IF_ERROR(c.Validate());
  if (o.mode == AttentionMode::kDense) {
    return InvalidArgument(
        "SparseDecodeAttention serves the sparse and hybrid modes; dense attention is the "
        "engine's default (pass no DecodeAttention)");
  }
  if (o.select.budget_tokens == 0) return InvalidArgument("sparse attention budget is 0 tokens");
  if (block_size == 0) return InvalidArgument("sparse attention needs a block size above 0");
  std::unique_ptr<SparseDecodeAttention> a(new SparseDecodeAttention(c, block_size, o));
  if (Status s = a->geometry_.Validate(); !s.ok()) {
    return InvalidArgument("model '" + c.name +
                           "' cannot use near-memory attention: " + s.message());
  }
  return a;
}

void SparseDecodeAttention::Reset() {
  for (auto& l : layers_) l = std::make_unique<Layer>();
}

Status SparseDecodeAttention::Prepare(const PagedKvCache& cache,
                                      std::span<const uint32_t> block_table, uint64_t tokens) {
  for (uint32_t l = 0; l < num_layers_; ++l)
    CXLKV_RETURN_IF_ERROR(CatchUp(l, cache, block_table, tokens));
  return Status::Ok();
}

void SparseDecodeAttention::EvictResidentsFrom(Layer& L, uint64_t first_page) {
  if (L.held) L.held->DropFrom(first_page);
}

Status SparseDecodeAttention::CatchUp(uint32_t layer, const PagedKvCache& cache,
                                      std::span<const uint32_t> block_table, uint64_t tokens) {
  const pnm::Geometry& g = geometry_;
  if (layer >= num_layers_) {
    return InvalidArgument("layer " + std::to_string(layer) + " of a model with " +
                           std::to_string(num_layers_));
  }
  if (cache.num_layers() != num_layers_ || cache.num_kv_heads() != g.num_kv_heads ||
      cache.head_dim() != g.head_dim || cache.block_size() != g.page_tokens) {
    return InvalidArgument(
        "KV cache shape differs from the model this sparse attention was made for");
  }
  const uint32_t bs = g.page_tokens;
  const uint64_t pages = g.PagesFor(tokens);
  if (tokens == 0 || block_table.size() < pages) {
    return InvalidArgument("block table of " + std::to_string(block_table.size()) +
                           " blocks cannot hold " + std::to_string(tokens) + " positions");
  }
  Layer& L = *layers_[layer];
  // A block table that changed under viewed pages is another sequence from there on. Views past
  // the context (it got shorter) are compared once the context grows over them again.
  uint64_t same = 0;
  const uint64_t viewed = std::min<uint64_t>(L.blocks.size(), pages);
  while (same < viewed && L.blocks[same] == block_table[same]) ++same;
  if (same < viewed) {  // keep the views, digests and resident copies before page `same`
    L.blocks.resize(same);
    L.pages.resize(same);
    L.digested = std::min(L.digested, same * bs);
    EvictResidentsFrom(L, same);
  }
  for (uint64_t i = L.blocks.size(); i < pages; ++i) {
    if (block_table[i] >= cache.num_blocks()) {
      return InvalidArgument("block table entry " + std::to_string(i) + " is block " +
                             std::to_string(block_table[i]) + ", the cache has " +
                             std::to_string(cache.num_blocks()));
    }
    L.blocks.push_back(block_table[i]);
    L.pages.push_back({cache.Key(layer, block_table[i], 0), cache.Value(layer, block_table[i], 0)});
  }
  // The decode step just wrote position tokens - 1: a rewrite of digested positions (the
  // caller stepped back) re-digests that page from its start, since digests only widen.
  // Resident copies of that page and later ones are stale the same way.
  if (L.digested >= tokens) {
    L.digested = (tokens - 1) / bs * bs;
    EvictResidentsFrom(L, (tokens - 1) / bs);
  }
  const uint64_t elems = pnm::DigestBytesPerPage(g);
  L.digests.resize(std::max<uint64_t>(L.digests.size(), pages * elems));
  for (uint64_t t = L.digested; t < tokens;) {
    const uint64_t p = t / bs;
    const uint32_t from = static_cast<uint32_t>(t % bs);
    const uint32_t to = static_cast<uint32_t>(std::min<uint64_t>(bs, tokens - p * bs));
    if (from == 0) pnm::ClearPageDigest(g, &L.digests[p * elems]);
    pnm::ExtendPageDigest(g, L.pages[p], from, to, &L.digests[p * elems]);
    stats_.digest_build_tokens += to - from;
    t = p * bs + to;
  }
  L.digested = tokens;
  return Status::Ok();
}

Status SparseDecodeAttention::AttendNear(const float* q, const pnm::ContextView& ctx,
                                         const pnm::Selection* selection, pnm::Partial* out) {
  if (!pool_) return pnm::Attend(geometry_, q, ctx, selection, 1.0f, out);
  pnm::AttendJob job;
  job.g = &geometry_;
  job.q = q;
  job.ctx = ctx;
  job.selection = selection;
  job.scale = 1.0f;
  job.out = out;
  return pool_->Run({&job, 1});
}

Status SparseDecodeAttention::Attend(uint32_t layer, const float* q, uint32_t pos,
                                     const PagedKvCache& cache,
                                     std::span<const uint32_t> block_table, float* out) {
  const pnm::Geometry& g = geometry_;
  const uint64_t tokens = uint64_t{pos} + 1;
  CXLKV_RETURN_IF_ERROR(CatchUp(layer, cache, block_table, tokens));
  Layer& L = *layers_[layer];
  const uint64_t pages = g.PagesFor(tokens);
  const pnm::ContextView ctx{std::span<const pnm::PageKv>(L.pages.data(), pages), tokens};
  if (pool_) {  // a long context's KV heads are selected on the near-memory threads together
    pnm::SelectJob job{&g, q, L.digests.data(), tokens, options_.select, &selection_, {}};
    CXLKV_RETURN_IF_ERROR(pool_->Select({&job, 1}));
  } else {
    CXLKV_RETURN_IF_ERROR(pnm::SelectPages(g, q, L.digests.data(), tokens, options_.select, &selection_));
  }
  const uint64_t page_bytes =
      2ull * g.page_tokens * g.head_dim * sizeof(float);  // one KV head's K and V
  stats_.layer_steps++;
  stats_.context_pages += pages * g.num_kv_heads;
  stats_.selected_pages += PagesOverHeads(selection_);
  stats_.digest_bytes += pages * pnm::DigestBytesPerPage(g);
  if (options_.mode == AttentionMode::kHybrid) {
    CXLKV_RETURN_IF_ERROR(AttendHybrid(L, layer, q, ctx, cache));
  } else {
    CXLKV_RETURN_IF_ERROR(AttendNear(q, ctx, &selection_, &near_));
    stats_.near_kv_bytes += PagesOverHeads(selection_) * page_bytes;
  }
  const uint64_t q_floats = uint64_t{g.num_heads} * g.head_dim;
  std::memcpy(out, near_.out.data(), q_floats * sizeof(float));
  stats_.link_bytes += (2 * q_floats + g.num_heads) * sizeof(float);  // q in; out and lse back

  if (options_.audit) {
    CXLKV_RETURN_IF_ERROR(pnm::Attend(g, q, ctx, nullptr, 1.0f, &all_));
    for (uint32_t h = 0; h < g.num_heads; ++h) {
      if (!std::isfinite(all_.lse[h])) continue;
      const double mass = std::exp(static_cast<double>(near_.lse[h]) - all_.lse[h]);
      stats_.mass_recall_sum += mass;
      stats_.mass_recall_min = std::min(stats_.mass_recall_min, mass);
      stats_.mass_recall_count++;
    }
  }
  return Status::Ok();
}

Status SparseDecodeAttention::AttendHybrid(Layer& L, uint32_t layer, const float* q,
                                           const pnm::ContextView& ctx, const PagedKvCache& cache) {
  const pnm::Geometry& g = geometry_;
  const uint32_t bs = g.page_tokens, hd = g.head_dim, kvh = g.num_kv_heads;
  const uint64_t pages = ctx.pages.size();
  const uint64_t full_pages =
      ctx.tokens / bs;  // a partial page is still being written: never resident
  if (!L.held) {
    const uint32_t budget_pages = std::max<uint32_t>(1, options_.select.budget_tokens / bs);
    const uint32_t capacity =
        options_.resident_pages ? options_.resident_pages : std::max<uint32_t>(1, budget_pages / 2);
    L.held = std::make_unique<HeldPages>(g, capacity, pages);
  }
  L.held->GrowTo(pages);
  for (uint32_t h = 0; h < kvh; ++h) {
    L.ranked.clear();
    for (uint32_t p : selection_.RankedOf(h)) {
      if (p < full_pages) L.ranked.push_back(p);
    }
    // The head's rows in the engine's cache: row t of block b at Key(layer, b, t) + h·head_dim.
    auto rows_of = [&](uint32_t p) {
      return HeldPages::Rows{cache.Key(layer, L.blocks[p], 0) + uint64_t{h} * hd,
                             cache.Value(layer, L.blocks[p], 0) + uint64_t{h} * hd, uint64_t{kvh} * hd};
    };
    CXLKV_ASSIGN_OR_RETURN(pnm::ResidentStep step, L.held->Step(h, L.ranked, rows_of));
    stats_.recalled_pages += step.recalled.size();
    stats_.recalled_bytes += step.recalled.size() * L.held->PageBytes();
    stats_.link_bytes += step.recalled.size() * L.held->PageBytes();
  }
  pnm::SplitByResidence(selection_, L.held->residents(), &engine_part_, &near_part_);
  CXLKV_RETURN_IF_ERROR(AttendNear(q, ctx, &near_part_, &near_));
  const uint64_t page_bytes = L.held->PageBytes();
  stats_.near_kv_bytes += PagesOverHeads(near_part_) * page_bytes;

  // The engine's part, over its copies.
  CXLKV_RETURN_IF_ERROR(L.held->Attend(q, engine_part_, &engine_));
  stats_.engine_kv_bytes += PagesOverHeads(engine_part_) * page_bytes;
  return pnm::MergeInto(engine_, &near_);
}

}  // namespace cxlkv::engine
