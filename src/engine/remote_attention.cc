#include "engine/remote_attention.h"

#include <cstring>

#include "pnm/geometry.h"

namespace cxlkv::engine {

Result<std::unique_ptr<RemoteDecodeAttention>> RemoteDecodeAttention::Create(const ModelConfig& c,
                                                                             uint32_t block_size,
                                                                             pnm::NearMemoryClient& client,
                                                                             const KeyNamespace& ns,
                                                                             const RemoteAttentionOptions& o) {
  const pnm::Geometry g{c.num_heads, c.num_kv_heads, c.head_dim, block_size, KvDtype::kFp32};
  Status valid = g.Validate();
  if (!valid.ok()) return InvalidArgument("remote attention cannot serve this model: " + valid.message());
  if (ns.layout.num_layers != c.num_layers || ns.layout.num_kv_heads != c.num_kv_heads ||
      ns.layout.head_size != c.head_dim || ns.layout.block_size != block_size || ns.layout.dtype != KvDtype::kFp32) {
    return InvalidArgument("remote attention: the namespace's layout is not this model's fp32 paged KV");
  }
  return std::unique_ptr<RemoteDecodeAttention>(new RemoteDecodeAttention(g, c.num_layers, client, ns, o));
}

RemoteDecodeAttention::~RemoteDecodeAttention() { Close(); }

Status RemoteDecodeAttention::Open(std::span<const BlockKey> keys) {
  Close();
  keys_.assign(keys.begin(), keys.end());
  if (keys_.empty()) return Status::Ok();
  auto opened = client_.OpenContext(ns_, geometry_.num_heads, keys_);
  if (!opened.ok()) {
    keys_.clear();
    return opened.status();
  }
  context_ = opened->context;
  open_ = true;
  return Status::Ok();
}

void RemoteDecodeAttention::Close() {
  if (open_) (void)client_.Close({&context_, 1});  // an expired context is closed already
  open_ = false;
  keys_.clear();
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
  // The daemon's part: the context's pages.
  remote_.Reset(g.num_heads, g.head_dim);
  if (open_) {
    pnm::NearMemoryClient::Job job;
    job.context = context_;
    job.layer = layer;
    job.q = q;
    job.budget_tokens = options_.budget_tokens;
    job.sink_pages = options_.sink_pages;
    job.recent_pages = options_.recent_pages;
    job.scale = 1.0f;  // q is scaled already
    job.out = &remote_;
    const uint64_t link_before = client_.link_bytes();
    Status s = client_.Attend({&job, 1});
    if (s.code() == StatusCode::kNotFound) {  // closed by its lease while this engine was paused
      const std::vector<BlockKey> keys = keys_;
      (void)client_.Close({&context_, 1});  // gone at the daemon; the client forgets it too
      open_ = false;
      CXLKV_RETURN_IF_ERROR(Open(keys));
      ++reopened_;
      job.context = context_;
      s = client_.Attend({&job, 1});
    }
    CXLKV_RETURN_IF_ERROR(s);
    stats_.context_pages += keys_.size() * g.num_kv_heads;
    stats_.selected_pages += job.pages_attended;
    stats_.near_kv_bytes += uint64_t{job.pages_attended} * 2 * g.page_tokens * g.head_dim * sizeof(float);
    stats_.link_bytes += client_.link_bytes() - link_before;
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

}  // namespace cxlkv::engine
