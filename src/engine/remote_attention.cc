#include "engine/remote_attention.h"

#include <cstring>

#include "pnm/geometry.h"

namespace cxlkv::engine {

Result<std::unique_ptr<RemoteDecodeAttention>> RemoteDecodeAttention::Create(const ModelConfig& c,
                                                                             uint32_t block_size,
                                                                             pnm::NearMemoryClient& client,
                                                                             const KeyNamespace& ns,
                                                                             const RemoteAttentionOptions& o,
                                                                             KvCache* cache) {
  const pnm::Geometry g{c.num_heads, c.num_kv_heads, c.head_dim, block_size, KvDtype::kFp32};
  Status valid = g.Validate();
  if (!valid.ok()) return InvalidArgument("remote attention cannot serve this model: " + valid.message());
  if (ns.layout.num_layers != c.num_layers || ns.layout.num_kv_heads != c.num_kv_heads ||
      ns.layout.head_size != c.head_dim || ns.layout.block_size != block_size || ns.layout.dtype != KvDtype::kFp32) {
    return InvalidArgument("remote attention: the namespace's layout is not this model's fp32 paged KV");
  }
  std::unique_ptr<RemoteDecodeAttention> a(new RemoteDecodeAttention(g, c.num_layers, client, ns, o));
  if (o.held_pages > 0) {
    if (o.budget_tokens == 0 || cache == nullptr) {
      return InvalidArgument("the remote hybrid needs a budget (the daemon selects) and the pool's cache (to recall from)");
    }
    CXLKV_ASSIGN_OR_RETURN(NamespaceHandle h, cache->Namespace(ns));
    a->cache_ = cache;
    a->handle_ = h;
    a->pool_geometry_ = g;  // how a recall reads a pool block: the namespace's block format
    a->pool_geometry_.head_major = ns.layout.block_format == kPoolBlockFormatHeadMajor;
  }
  return a;
}

RemoteDecodeAttention::~RemoteDecodeAttention() { Close(); }

Status RemoteDecodeAttention::Open(std::span<const BlockKey> keys) {
  Close();
  keys_.assign(keys.begin(), keys.end());
  if (keys_.empty()) return Status::Ok();
  if (cache_ != nullptr) {  // the hybrid recalls out of these blocks
    if (Status s = PinContext(); !s.ok()) {
      keys_.clear();
      return s;
    }
  }
  auto opened = client_.OpenContext(ns_, geometry_.num_heads, keys_);
  if (!opened.ok()) {
    ReleasePins();
    keys_.clear();
    return opened.status();
  }
  context_ = opened->context;
  open_ = true;
  return Status::Ok();
}

Status RemoteDecodeAttention::PinContext() {
  held_.clear();
  held_.resize(num_layers_);
  CXLKV_ASSIGN_OR_RETURN(pin_life_, client_.CurrentLife());
  CXLKV_ASSIGN_OR_RETURN(LookupResult hit, cache_->Lookup(*handle_, keys_));
  pins_ = std::move(hit.pins);
  if (hit.hit_blocks != keys_.size()) {
    const uint64_t missing = hit.hit_blocks;
    ReleasePins();
    return NotFound("remote hybrid: block " + std::to_string(missing) + " of the context is not in the pool");
  }
  for (size_t i = 0; i < pins_.size(); ++i) {
    cache_->InvalidateForRead(cache_->PayloadPtr(pins_[i]), pins_[i].bytes, i + 1 == pins_.size());
  }
  return Status::Ok();
}

void RemoteDecodeAttention::ReleasePins() {
  if (!pins_.empty()) {
    const auto life = client_.CurrentLife();
    if (life.ok() && *life == pin_life_) cache_->Release(pins_);  // else recovery took them
  }
  pins_.clear();
  held_.clear();
}

void RemoteDecodeAttention::Close() {
  if (open_) (void)client_.Close({&context_, 1});  // an expired context is closed already
  open_ = false;
  keys_.clear();
  ReleasePins();
}

Status RemoteDecodeAttention::Attend(uint32_t layer, const float* q, uint32_t pos, const PagedKvCache& cache,
                                     std::span<const uint32_t> block_table, float* out) {
  const pnm::Geometry& g = geometry_;
  if (layer >= num_layers_ || cache.num_layers() != num_layers_ || cache.block_size() != g.page_tokens ||
      cache.num_kv_heads() != g.num_kv_heads || cache.head_dim() != g.head_dim) {
    return InvalidArgument("remote attention: layer " + std::to_string(layer) + " or the cache is not this model's");
  }
  const uint64_t tokens = uint64_t{pos} + 1, remote_tokens = context_tokens();
  if (tokens <= remote_tokens) {
    return InvalidArgument("remote attention: position " + std::to_string(pos) + " lies inside the pool context of " +
                           std::to_string(remote_tokens) + " tokens");
  }
  const uint64_t pages = g.PagesFor(tokens);
  if (block_table.size() < pages) {
    return InvalidArgument("remote attention: a block table of " + std::to_string(block_table.size()) +
                           " blocks for position " + std::to_string(pos));
  }
  // The daemon's part: the context's pages (the hybrid's held ones attended here).
  remote_.Reset(g.num_heads, g.head_dim);
  if (open_) {
    CXLKV_RETURN_IF_ERROR(AttendContext(layer, q));
    if (cache_ != nullptr) CXLKV_RETURN_IF_ERROR(AttendHeld(layer, q));
  }
  // The engine's part: every position after the context, read in place from its cache.
  const uint64_t first_page = keys_.size();
  local_pages_.clear();
  for (uint64_t p = first_page; p < pages; ++p) {
    if (block_table[p] >= cache.num_blocks()) {
      return InvalidArgument("remote attention: block " + std::to_string(block_table[p]) + " is outside the cache");
    }
    local_pages_.push_back({cache.Key(layer, block_table[p], 0), cache.Value(layer, block_table[p], 0)});
  }
  const pnm::ContextView local_ctx{local_pages_, tokens - remote_tokens};
  CXLKV_RETURN_IF_ERROR(pnm::Attend(g, q, local_ctx, nullptr, 1.0f, &local_));
  stats_.engine_kv_bytes += (tokens - remote_tokens) * 2 * g.RowBytes();
  CXLKV_RETURN_IF_ERROR(pnm::MergeInto(remote_, &local_));
  std::memcpy(out, local_.out.data(), local_.out.size() * sizeof(float));
  stats_.layer_steps++;
  return Status::Ok();
}

Status RemoteDecodeAttention::AttendContext(uint32_t layer, const float* q) {
  const pnm::Geometry& g = geometry_;
  const bool hybrid = cache_ != nullptr;
  pnm::NearMemoryClient::Job job;
  job.context = context_;
  job.layer = layer;
  job.q = q;
  job.budget_tokens = options_.budget_tokens;
  job.sink_pages = options_.sink_pages;
  job.recent_pages = options_.recent_pages;
  job.scale = 1.0f;  // q is scaled already
  job.out = &remote_;
  if (hybrid) {
    if (!held_[layer]) held_[layer] = std::make_unique<HeldPages>(g, options_.held_pages, keys_.size());
    held_lists_.resize(g.num_kv_heads);
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) held_lists_[h] = held_[layer]->Held(h);
    job.held = held_lists_;
    job.hold_capacity = options_.held_pages;
    job.steps = &steps_;
  }
  auto run = [&] { return hybrid ? client_.AttendSplit({&job, 1}) : client_.Attend({&job, 1}); };
  const uint64_t link_before = client_.link_bytes();
  Status s = run();
  if (s.code() == StatusCode::kNotFound) {  // closed by its lease while this engine was paused
    (void)client_.Close({&context_, 1});  // gone at the daemon; the client forgets it too
    open_ = false;
    auto opened = client_.OpenContext(ns_, g.num_heads, keys_);  // the same blocks, still pinned here
    CXLKV_RETURN_IF_ERROR(opened.status());
    context_ = opened->context;
    open_ = true;
    ++reopened_;
    job.context = context_;
    s = run();
  }
  CXLKV_RETURN_IF_ERROR(s);
  stats_.context_pages += keys_.size() * g.num_kv_heads;
  uint64_t selected = job.pages_attended;
  if (hybrid) {
    selected = 0;
    for (const pnm::HeldStep& st : steps_) selected += st.selected;
  }
  stats_.selected_pages += selected;
  stats_.near_kv_bytes += uint64_t{job.pages_attended} * 2 * g.page_tokens * g.head_dim * sizeof(float);
  stats_.link_bytes += client_.link_bytes() - link_before;
  return Status::Ok();
}

Status RemoteDecodeAttention::AttendHeld(uint32_t layer, const float* q) {
  const pnm::Geometry& g = geometry_;
  if (pins_.size() != keys_.size()) {
    // Pinning again failed after a pause (a block left the pool): no recall reads through a pin
    // it does not hold. This layer's held set is still empty, as the daemon was told.
    CXLKV_RETURN_IF_ERROR(PinContext());
    held_[layer] = std::make_unique<HeldPages>(g, options_.held_pages, keys_.size());
  }
  HeldPages& held = *held_[layer];
  // The selected pages the engine held when it asked: the daemon left them out.
  mine_.resize(g.num_kv_heads);
  uint64_t mine_pages = 0;
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    mine_[h] = steps_[h].stayed;
    mine_pages += mine_[h].size();
  }
  const pnm::Selection part = pnm::Selection::PerHead(mine_);
  CXLKV_RETURN_IF_ERROR(held.Attend(q, part, &held_part_));
  CXLKV_RETURN_IF_ERROR(pnm::MergeInto(held_part_, &remote_));
  stats_.engine_kv_bytes += mine_pages * held.PageBytes();
  // Then the held set steps; what it recalls serves from the next step. A page's
  // rows for KV head h: its pool block's slab of this layer, in the namespace's order.
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    auto rows_of = [&](uint32_t p) {
      const pnm::Geometry& b = pool_geometry_;
      const uint8_t* base = cache_->PayloadPtr(pins_[p]);
      const auto* k = reinterpret_cast<const float*>(base + (uint64_t{layer} * 2) * b.SlabBytes() + b.HeadOffset(h));
      const auto* v = reinterpret_cast<const float*>(base + (uint64_t{layer} * 2 + 1) * b.SlabBytes() + b.HeadOffset(h));
      return HeldPages::Rows{k, v, b.TokenStride() / sizeof(float)};
    };
    // Steady selection on what the daemon sent: the budget set as this step sees it is the held
    // pages that stayed and the recalls, which fill exactly the room the others left.
    step_pages_ = steps_[h].stayed;
    step_pages_.insert(step_pages_.end(), steps_[h].recall.begin(), steps_[h].recall.end());
    CXLKV_ASSIGN_OR_RETURN(pnm::ResidentStep step, held.Step(h, step_pages_, rows_of));
    stats_.recalled_pages += step.recalled.size();
    stats_.recalled_bytes += step.recalled.size() * held.PageBytes();
    stats_.link_bytes += step.recalled.size() * held.PageBytes();
  }
  // The copies are only as good as the pins they were read through. Still this life: the node
  // was never declared dead since the pins were taken, so they held. Another life: it was
  // (paused past its lease), the pins were recovered and the blocks may hold other bytes now;
  // this step's output used only copies checked before, so it stands, but every copy is
  // dropped and the blocks are pinned again under the new life.
  const auto life = client_.CurrentLife();
  if (!life.ok() || *life != pin_life_) {
    pins_.clear();  // not this life's to release
    ++repinned_;
    return PinContext();
  }
  return Status::Ok();
}

}  // namespace cxlkv::engine
