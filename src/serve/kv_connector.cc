#include "serve/kv_connector.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "serve/channel.h"

namespace cxlkv::serve {

namespace {

uint32_t CeilDiv(uint64_t a, uint32_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Engine blocks borrowed for one request, returned on every path out.
class BlockLease {
 public:
  BlockLease(engine::PagedKvCache& cache, std::vector<uint32_t> ids) : cache_(cache), ids_(std::move(ids)) {}
  ~BlockLease() { cache_.FreeBlocks(ids_); }
  BlockLease(const BlockLease&) = delete;
  BlockLease& operator=(const BlockLease&) = delete;
  std::span<const uint32_t> ids() const { return ids_; }

 private:
  engine::PagedKvCache& cache_;
  std::vector<uint32_t> ids_;
};

Result<std::unique_ptr<BlockLease>> Lease(engine::PagedKvCache& cache, uint32_t blocks) {
  CXLKV_ASSIGN_OR_RETURN(auto ids, cache.AllocateBlocks(blocks));
  return std::make_unique<BlockLease>(cache, std::move(ids));
}

double MsSince(int64_t start_ns) { return static_cast<double>(NowNs() - start_ns) / 1e6; }

// How long a prefill waits for a block another worker is writing before computing it itself.
constexpr int64_t kInFlightWaitNs = 5'000'000'000;

}  // namespace

Result<KvMode> ParseKvMode(std::string_view name) {
  for (KvMode m : {KvMode::kRecompute, KvMode::kPrivate, KvMode::kTcp, KvMode::kPool}) {
    if (KvModeName(m) == name) return m;
  }
  return InvalidArgument("unknown KV mode '" + std::string(name) + "': use recompute, private, tcp or pool");
}

std::string_view KvModeName(KvMode mode) {
  switch (mode) {
    case KvMode::kRecompute: return "recompute";
    case KvMode::kPrivate: return "private";
    case KvMode::kTcp: return "tcp";
    case KvMode::kPool: return "pool";
  }
  return "?";
}

size_t PrivateBlockCache::LongestPrefix(std::span<const BlockKey> keys) {
  size_t n = 0;
  while (n < keys.size() && Get(keys[n]) != nullptr) ++n;
  return n;
}

const std::vector<uint8_t>* PrivateBlockCache::Get(const BlockKey& key) {
  auto it = map_.find(key);
  if (it == map_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return &it->second->second;
}

void PrivateBlockCache::Put(const BlockKey& key, std::vector<uint8_t> block) {
  if (map_.count(key) || block.size() > capacity_) return;
  bytes_ += block.size();
  lru_.emplace_front(key, std::move(block));
  map_[key] = lru_.begin();
  while (bytes_ > capacity_) {
    bytes_ -= lru_.back().second.size();
    map_.erase(lru_.back().first);
    lru_.pop_back();
  }
}

KvConnector::KvConnector(KvMode mode, const engine::Model& model, engine::PagedKvCache& engine_cache,
                         KvCache& pool_cache, NamespaceHandle ns, uint64_t run_id, uint64_t private_cache_bytes)
    : mode_(mode),
      model_(model),
      engine_cache_(engine_cache),
      layout_(engine_cache.Layout()),
      pool_(pool_cache),
      transfer_(pool_cache, {.threads = 1}),  // several workers share the host's cores
      ns_(ns),
      run_id_(run_id),
      private_(private_cache_bytes) {}

std::vector<BlockKey> KvConnector::HandoffKeys(uint64_t request_id, uint32_t first, uint32_t count) const {
  std::vector<BlockKey> keys;
  for (uint32_t i = first; i < first + count; ++i) {
    uint8_t salt[24];
    std::memcpy(salt, &run_id_, 8);
    std::memcpy(salt + 8, &request_id, 8);
    const uint64_t block = i;
    std::memcpy(salt + 16, &block, 8);
    keys.push_back(KvCache::KeyFromEngineHash(ns_, salt));
  }
  return keys;
}

void KvConnector::BlockToEngine(const uint8_t* block, uint32_t id) {
  for (uint32_t l = 0; l < layout_.num_layers(); ++l) {
    for (uint32_t p = 0; p < layout_.parts(); ++p) {
      std::memcpy(layout_.EnginePiece(l, p, id), block + layout_.PoolPieceOffset(l, p), layout_.PieceBytes());
    }
  }
}

void KvConnector::BlockFromEngine(uint32_t id, uint8_t* block) const {
  for (uint32_t l = 0; l < layout_.num_layers(); ++l) {
    for (uint32_t p = 0; p < layout_.parts(); ++p) {
      std::memcpy(block + layout_.PoolPieceOffset(l, p), layout_.EnginePiece(l, p, id), layout_.PieceBytes());
    }
  }
}

Status KvConnector::Publish(std::span<const uint32_t> ids, std::span<const BlockKey> keys, KvStats& stats) {
  if (ids.empty()) return Status::Ok();
  CXLKV_ASSIGN_OR_RETURN(auto g, transfer_.GatherWrite(ns_, layout_, ids, keys));
  stats.bytes_stored += g.written * layout_.PoolBlockBytes();
  return Status::Ok();
}

Status KvConnector::PublishOrSkip(std::span<const uint32_t> ids, std::span<const BlockKey> keys, KvStats& stats) {
  Status s = Publish(ids, keys, stats);
  if (s.code() != StatusCode::kNoSpace) return s;
  stats.blocks_not_stored += static_cast<uint32_t>(ids.size());  // the decode side recomputes them
  return Status::Ok();
}

Result<LookupResult> KvConnector::PoolLookup(std::span<const BlockKey> keys) {
  return pool_.Lookup(ns_, keys, stream_capacity_ ? KvCache::CapacityPolicy::kLeave : KvCache::CapacityPolicy::kPromote);
}

uint32_t KvConnector::LoadCapacityRun(const LookupResult& hit, std::span<const uint32_t> ids,
                                      std::span<const BlockKey> keys, KvStats& stats) {
  const size_t run = std::min({hit.capacity_run, ids.size(), keys.size()});
  if (!stream_capacity_ || run == 0) return 0;
  auto loaded = transfer_.LoadFromCapacity(ns_, layout_, ids.first(run), keys.first(run));
  if (!loaded.ok()) return 0;  // an unreachable tier is a miss: those blocks are computed
  stats.hit_from_mem += static_cast<uint32_t>(loaded->from_mem);
  stats.hit_from_ssd += static_cast<uint32_t>(loaded->from_ssd);
  return static_cast<uint32_t>(loaded->blocks);
}

Status KvConnector::TakeHit(PreparedPrefill& p, LookupResult hit, size_t reusable) {
  KvStats& st = p.stats_;
  const std::span<const uint32_t> ids = p.ids_;
  const std::span<const BlockKey> chain = std::span<const BlockKey>(p.chain_).first(reusable);
  for (;;) {
    if (hit.hit_blocks > 0) {  // region blocks: pinned, loaded layer by layer behind the compute
      auto load = transfer_.StartLoad(layout_, ids.subspan(st.hit_blocks, hit.hit_blocks), hit.pins);
      p.pins_.insert(p.pins_.end(), hit.pins.begin(), hit.pins.end());
      if (!load.ok()) return load.status();
      p.loads_.push_back(std::move(*load));
      st.hit_blocks += static_cast<uint32_t>(hit.hit_blocks);
      st.hit_from_mem += static_cast<uint32_t>(hit.from_mem);
      st.hit_from_ssd += static_cast<uint32_t>(hit.from_ssd);
    }
    const uint32_t streamed = LoadCapacityRun(hit, ids.subspan(st.hit_blocks), chain.subspan(st.hit_blocks), st);
    st.hit_blocks += streamed;
    // A streamed run ends at a block that is not on a capacity tier: the region may hold the
    // next ones again. Go on while there is progress.
    if (streamed == 0 || st.hit_blocks >= reusable) return Status::Ok();
    CXLKV_ASSIGN_OR_RETURN(hit, PoolLookup(chain.subspan(st.hit_blocks)));
  }
}

Result<LookupResult> KvConnector::LookupAwaitingInFlight(std::span<const BlockKey> keys, KvStats& stats) {
  const int64_t start = NowNs();
  auto backoff = std::chrono::microseconds(200);
  size_t from_mem = 0, from_ssd = 0;  // brought in from a tier by this or an earlier round
  for (;;) {
    CXLKV_ASSIGN_OR_RETURN(auto hit, PoolLookup(keys));
    if (hit.capacity_run > 0) return hit;  // the next block is present, on a capacity tier
    from_mem += hit.from_mem;
    from_ssd += hit.from_ssd;
    hit.from_mem = std::min(from_mem, hit.hit_blocks);
    hit.from_ssd = std::min(from_ssd, hit.hit_blocks - hit.from_mem);
    if (hit.hit_blocks == keys.size() || NowNs() - start > kInFlightWaitNs) return hit;
    // Is the first missing block being written by another worker right now (the same
    // document in flight there)? Loading it when it lands beats computing it twice. A lock-free
    // peek answers without touching the index; a writer whose life ended never lands it.
    auto peek = pool_.Peek(ns_, {&keys[hit.hit_blocks], 1});
    if (!peek.ok()) return hit;
    const KeyPeek& p = (*peek)[0];
    if (p.state == PeekState::kAbsent || (p.state == PeekState::kWriting && !p.writer_live)) return hit;
    pool_.Release(hit.pins);
    const int64_t slept = NowNs();
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(5000));
    stats.wait_ms += MsSince(slept);
  }
}

PreparedPrefill::~PreparedPrefill() {
  ReleasePins();
  engine_.FreeBlocks(ids_);
}

void PreparedPrefill::ReleasePins() {
  loads_.clear();  // waits: the loads read the pinned blocks
  pool_.Release(pins_);
  pins_.clear();
}

Result<std::unique_ptr<PreparedPrefill>> KvConnector::Prepare(uint64_t request_id, std::span<const int32_t> prompt,
                                                              bool await_in_flight) {
  const uint32_t bs = layout_.block_size, n = static_cast<uint32_t>(prompt.size());
  if (n == 0) return InvalidArgument("prefill: an empty prompt");
  std::unique_ptr<PreparedPrefill> p(new PreparedPrefill(pool_, engine_cache_));
  p->request_id_ = request_id;
  p->prompt_.assign(prompt.begin(), prompt.end());
  CXLKV_ASSIGN_OR_RETURN(p->ids_, engine_cache_.AllocateBlocks(CeilDiv(n, bs)));
  p->chain_ = KvCache::ChainKeys(ns_, prompt);
  KvStats& st = p->stats_;
  st.prompt_tokens = n;
  st.prompt_blocks = n / bs;
  // At least the last token is computed: its logits give the first output token.
  const auto reusable = std::span(p->chain_).first((n - 1) / bs);
  if (mode_ == KvMode::kPool) {
    LookupResult hit;
    if (await_in_flight) {
      CXLKV_ASSIGN_OR_RETURN(hit, LookupAwaitingInFlight(reusable, st));
    } else {
      CXLKV_ASSIGN_OR_RETURN(hit, PoolLookup(reusable));
    }
    CXLKV_RETURN_IF_ERROR(TakeHit(*p, std::move(hit), reusable.size()));
  } else if (mode_ != KvMode::kRecompute) {
    st.hit_blocks = static_cast<uint32_t>(private_.LongestPrefix(reusable));
    for (uint32_t i = 0; i < st.hit_blocks; ++i) BlockToEngine(private_.Get(p->chain_[i])->data(), p->ids_[i]);
  }
  return p;
}

Result<PrefillResult> KvConnector::Prefill(uint64_t request_id, std::span<const int32_t> prompt) {
  CXLKV_ASSIGN_OR_RETURN(auto prepared, Prepare(request_id, prompt, /*await_in_flight=*/true));
  return Prefill(*prepared);
}

Result<PrefillResult> KvConnector::Prefill(PreparedPrefill& p) {
  const uint32_t bs = layout_.block_size, n = static_cast<uint32_t>(p.prompt_.size());
  const std::span<const uint32_t> ids = p.ids_;
  const std::vector<BlockKey>& chain = p.chain_;
  const uint32_t blocks = static_cast<uint32_t>(ids.size()), full = n / bs, reusable = (n - 1) / bs;
  PrefillResult out;
  out.stats = p.stats_;
  KvStats& st = out.stats;

  // Top-up: what was published since a prefetch looked (the request before it may have
  // written this prompt's next blocks), loaded behind what is loading already.
  if (mode_ == KvMode::kPool && st.hit_blocks < reusable) {
    CXLKV_ASSIGN_OR_RETURN(auto more,
                           LookupAwaitingInFlight(std::span(chain).subspan(st.hit_blocks, reusable - st.hit_blocks), st));
    p.stats_ = st;  // TakeHit adds to the prepared request's stats
    CXLKV_RETURN_IF_ERROR(TakeHit(p, std::move(more), reusable));
    st = p.stats_;
  }
  st.bytes_loaded = uint64_t{st.hit_blocks} * layout_.PoolBlockBytes();

  // Step 4-5: compute the missing suffix; in pool mode its new full blocks stream to the pool
  // a layer at a time while the next layer computes.
  const uint32_t start = st.hit_blocks * bs;
  st.computed_tokens = n - start;
  std::unique_ptr<transfer::LayerStore> store;
  if (mode_ == KvMode::kPool && full > st.hit_blocks) {
    auto started = transfer_.StartStore(ns_, layout_, ids.subspan(st.hit_blocks, full - st.hit_blocks),
                                        std::span(chain).subspan(st.hit_blocks, full - st.hit_blocks));
    if (started.ok()) {
      store = std::move(*started);
    } else if (started.status().code() == StatusCode::kNoSpace) {
      // The pool has no room now (pinned and in-flight blocks fill it): serve the request
      // without caching its blocks rather than fail it. Later requests recompute them.
      st.blocks_not_stored += full - st.hit_blocks;
    } else {
      return started.status();
    }
  }
  Status hook_error;
  auto before_layer = [&](uint32_t l) {
    const int64_t t0 = NowNs();
    for (auto& load : p.loads_) load->WaitLayer(l);
    st.wait_ms += MsSince(t0);
    if (store && l > 0 && hook_error.ok()) hook_error = store->LayerComputed(l - 1);
  };
  auto logits = model_.Prefill(p.prompt_, start, engine_cache_, ids, before_layer);
  p.ReleasePins();
  if (!logits.ok()) return logits.status();
  if (store) {
    CXLKV_RETURN_IF_ERROR(hook_error);
    CXLKV_RETURN_IF_ERROR(store->LayerComputed(layout_.num_layers() - 1));
    CXLKV_ASSIGN_OR_RETURN(auto g, store->Finish());
    st.bytes_stored += g.written * layout_.PoolBlockBytes();
  }
  out.first_token = engine::Model::Argmax(*logits);

  // Step 6: remember new blocks (private modes) and hand the prompt's KV to the decode side.
  if (mode_ == KvMode::kPrivate || mode_ == KvMode::kTcp) {
    for (uint32_t i = st.hit_blocks; i < full; ++i) {
      std::vector<uint8_t> block(layout_.PoolBlockBytes());
      BlockFromEngine(ids[i], block.data());
      private_.Put(chain[i], std::move(block));
    }
  }
  switch (mode_) {
    case KvMode::kPool:
      // The full blocks are in the shared cache under their chain keys; only the partial tail
      // needs a one-use handoff block.
      if (n % bs != 0) CXLKV_RETURN_IF_ERROR(PublishOrSkip(ids.subspan(full, 1), HandoffKeys(p.request_id_, full, 1), st));
      break;
    case KvMode::kRecompute:
    case KvMode::kPrivate:
      CXLKV_RETURN_IF_ERROR(PublishOrSkip(ids, HandoffKeys(p.request_id_, 0, blocks), st));
      break;
    case KvMode::kTcp:
      out.tcp_payload.resize(uint64_t{blocks} * layout_.PoolBlockBytes());
      for (uint32_t i = 0; i < blocks; ++i) BlockFromEngine(ids[i], out.tcp_payload.data() + i * layout_.PoolBlockBytes());
      st.bytes_stored += out.tcp_payload.size();
      break;
  }
  return out;
}

Result<DecodeResult> KvConnector::Decode(uint64_t request_id, std::span<const int32_t> prompt, int32_t first_token,
                                         uint32_t max_new, const std::vector<uint8_t>* tcp_payload) {
  const uint32_t bs = layout_.block_size, n = static_cast<uint32_t>(prompt.size());
  if (n == 0 || max_new == 0) return InvalidArgument("decode: an empty prompt or no tokens to generate");
  DecodeResult out;
  KvStats& st = out.stats;
  st.prompt_tokens = n;
  st.prompt_blocks = n / bs;
  const uint32_t prompt_blocks = CeilDiv(n, bs);
  CXLKV_ASSIGN_OR_RETURN(auto lease, Lease(engine_cache_, CeilDiv(uint64_t{n} + max_new - 1, bs)));
  const auto ids = lease->ids();

  // Step 7-8: the prompt's KV from the handoff.
  uint32_t loaded = 0;  // blocks
  if (mode_ == KvMode::kTcp) {
    if (!tcp_payload || tcp_payload->size() != uint64_t{prompt_blocks} * layout_.PoolBlockBytes()) {
      return InvalidArgument("decode: the TCP handoff of request " + std::to_string(request_id) + " has " +
                             std::to_string(tcp_payload ? tcp_payload->size() : 0) + " bytes, expected " +
                             std::to_string(uint64_t{prompt_blocks} * layout_.PoolBlockBytes()));
    }
    for (uint32_t i = 0; i < prompt_blocks; ++i) BlockToEngine(tcp_payload->data() + i * layout_.PoolBlockBytes(), ids[i]);
    loaded = prompt_blocks;
  } else {
    std::vector<BlockKey> keys;
    std::vector<BlockKey> one_use;
    if (mode_ == KvMode::kPool) {
      keys = KvCache::ChainKeys(ns_, prompt);
      if (n % bs != 0) one_use = HandoffKeys(request_id, n / bs, 1);
    } else {
      one_use = HandoffKeys(request_id, 0, prompt_blocks);
    }
    // Remote attention: the daemon pins the prompt's full blocks and attends them where they
    // are; the engine loads only what follows (the partial block).
    uint32_t remote_blocks = 0;
    if (remote_attention_ && mode_ == KvMode::kPool) {
      if (!keys.empty() && remote_attention_->Open(keys).ok()) {
        remote_blocks = static_cast<uint32_t>(keys.size());
        st.attention_remote_tokens = uint64_t{remote_blocks} * bs;
      } else {
        (void)remote_attention_->Open({});  // attend the engine's cache alone
        st.attention_remote_fallbacks += !keys.empty();
      }
    }
    keys.insert(keys.end(), one_use.begin(), one_use.end());
    const std::span<const BlockKey> all(keys);
    loaded = remote_blocks;
    for (;;) {  // region blocks read, then a capacity run streamed; on while streaming progresses
      CXLKV_ASSIGN_OR_RETURN(auto hit, PoolLookup(all.subspan(loaded)));
      Status s = transfer_.ScatterRead(layout_, ids.subspan(loaded, hit.hit_blocks), hit.pins);
      pool_.Release(hit.pins);
      CXLKV_RETURN_IF_ERROR(s);
      loaded += static_cast<uint32_t>(hit.hit_blocks);
      const uint32_t streamed = LoadCapacityRun(hit, ids.subspan(loaded), all.subspan(loaded), st);
      loaded += streamed;
      if (streamed == 0 || loaded >= all.size()) break;
    }
    if (loaded < all.size() && remote_blocks > 0) {
      // The partial block is gone: recomputing it needs the prefix in the engine after all.
      CXLKV_ASSIGN_OR_RETURN(auto hit, PoolLookup(all.first(remote_blocks)));
      Status s = hit.hit_blocks == remote_blocks
                     ? transfer_.ScatterRead(layout_, ids.first(remote_blocks), hit.pins)
                     : Unavailable("decode: the prompt's blocks left the pool while the daemon held them");
      pool_.Release(hit.pins);
      CXLKV_RETURN_IF_ERROR(s);
      st.bytes_loaded += uint64_t{remote_blocks} * layout_.PoolBlockBytes();
    }
    if (!one_use.empty()) (void)pool_.Evict(ns_, one_use);  // read once; leaves room for the shared cache
    st.bytes_loaded += uint64_t{loaded - remote_blocks} * layout_.PoolBlockBytes();
  }
  st.hit_blocks = loaded;
  if (mode_ == KvMode::kTcp) st.bytes_loaded = uint64_t{loaded} * layout_.PoolBlockBytes();
  // Whatever the handoff lacked (evicted in between, or a prefill that died after publishing
  // part of it) is recomputed: the engine makes the same bytes.
  const uint32_t have = std::min(loaded * bs, n);
  if (have < n) {
    st.computed_tokens = n - have;
    CXLKV_ASSIGN_OR_RETURN(auto logits, model_.Prefill(prompt, have, engine_cache_, ids));
    if (engine::Model::Argmax(logits) != first_token) {
      return Internal("decode: recomputing request " + std::to_string(request_id) + "'s prompt gave first token " +
                      std::to_string(engine::Model::Argmax(logits)) + ", the prefill gave " +
                      std::to_string(first_token) + ": the engine is not deterministic");
    }
  }
  out.first_token_ns = NowNs();

  // Step 9-10: greedy generation.
  out.tokens.push_back(first_token);
  if (decode_attention_) {  // another sequence: digests from scratch
    decode_attention_->Reset();
    decode_attention_->ResetStats();
  }
  engine::DecodeAttention* attention = decode_attention_.get();
  if (remote_attention_ && mode_ == KvMode::kPool) {
    remote_attention_->ResetStats();
    attention = remote_attention_.get();
  }
  for (uint32_t i = 1; i < max_new; ++i) {
    auto logits = model_.Decode(out.tokens.back(), n + i - 1, engine_cache_, ids, attention);
    if (!logits.ok()) {
      if (remote_attention_) remote_attention_->Close();
      return logits.status();
    }
    out.tokens.push_back(engine::Model::Argmax(*logits));
  }
  const engine::SparseAttentionStats* stats = decode_attention_ ? &decode_attention_->stats() : nullptr;
  if (attention != nullptr && attention == remote_attention_.get()) {
    remote_attention_->Close();  // the daemon unpins the prompt
    stats = &remote_attention_->stats();
  }
  if (stats != nullptr) {
    const engine::SparseAttentionStats& a = *stats;
    out.stats.attention_layer_steps = a.layer_steps;
    out.stats.attention_selected_pages = a.selected_pages;
    out.stats.attention_context_pages = a.context_pages;
    out.stats.attention_link_bytes = a.link_bytes;
    out.stats.attention_kv_bytes = a.near_kv_bytes + a.engine_kv_bytes;
  }
  return out;
}

}  // namespace cxlkv::serve
