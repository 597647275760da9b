// The near-memory attention service (pnm_service.h).
#include "daemon/pnm_service.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "cxlkv/layout.h"
#include "pnm/digest.h"
#include "pnm/geometry.h"
#include "pnm/select.h"
#include "pnm/steady.h"
#include "pool/pool_internal.h"
#include "region/platform.h"
#include "sync/node.h"

namespace cxlkv::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMaxContextPages = uint64_t{1} << 26;  // 1G tokens at 16 a page

// The digests' own namespace: same model, a layout that sizes one page's digest exactly (per
// layer DigestBytesPerPage: one part × layers × 1 token × 1 head × that many 1-byte elements),
// and an extra key that says what it holds — the format's version — and of which KV namespace.
KeyNamespace DigestNamespace(const KeyNamespace& kv) {
  pnm::Geometry g;
  g.num_kv_heads = kv.layout.num_kv_heads;
  g.head_dim = kv.layout.head_size;
  KeyNamespace d;
  d.model_id = kv.model_id;
  d.layout = kv.layout;
  d.layout.dtype = KvDtype::kFp8;
  d.layout.block_size = 1;
  d.layout.kv_parts = 1;
  d.layout.num_kv_heads = 1;
  d.layout.head_size = static_cast<uint32_t>(pnm::DigestBytesPerPage(g));
  char extra[40];
  std::snprintf(extra, sizeof extra, "pnm-digest-2:%016llx",
                static_cast<unsigned long long>(XXH3_64bits(kv.extra_key.data(), kv.extra_key.size())));
  d.extra_key = extra;
  return d;
}

BlockKey DigestKeyOf(const NamespaceHandle& digest_ns, const BlockKey& kv_key) {
  uint8_t bytes[16];
  std::memcpy(bytes, &kv_key.lo, 8);
  std::memcpy(bytes + 8, &kv_key.hi, 8);
  return KvCache::KeyFromEngineHash(digest_ns, bytes);
}

}  // namespace

struct NearMemoryService::Context {
  uint64_t id = 0;
  uint32_t owner_node = 0;
  uint32_t owner_channel = 0;
  uint64_t owner_life = 0;  // the client node's incarnation, as the client sent it
  uint64_t pin_life = 0;    // this node's incarnation when its pins were taken
  NamespaceHandle ns;
  std::optional<NamespaceHandle> digest_ns;
  pnm::Geometry g;
  uint32_t layers = 0;
  uint64_t block_bytes = 0;
  uint64_t piece_bytes = 0;  // one (layer, K or V) slab of a block
  std::vector<BlockPin> pins;
  std::vector<std::vector<pnm::PageKv>> views;      // [layer][page]
  std::vector<std::vector<uint8_t>> digests;        // [layer][page × DigestBytesPerPage]
  std::vector<uint8_t> engine_of_page;  // the engine of the node holding each page's block
  Clock::time_point last_used;

  uint64_t pages() const { return pins.size(); }
};

Result<std::unique_ptr<NearMemoryService>> NearMemoryService::Start(Pool& pool, const NearMemoryServiceOptions& options) {
  if (options.context_lease_ms < 100) return InvalidArgument("a pnm context lease under 100 ms cannot be kept by a client");
  if (options.max_contexts == 0) return InvalidArgument("pnm max_contexts must be at least 1");
  if (options.threads > 256) return InvalidArgument("pnm threads above 256");
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool.Cache());
  auto s = std::unique_ptr<NearMemoryService>(new NearMemoryService(pool, options));
  s->cache_ = cache;
  s->engines_ = NodeEngines::Create(pool.MappedRanges(), {options.threads, options.bind_numa, options.platform});
  s->life_ = pool.impl().node->incarnation();
  std::random_device rd;
  s->epoch_ = (uint64_t{rd()} << 32) & ~(uint64_t{1} << 63);
  if (s->epoch_ == 0) s->epoch_ = uint64_t{1} << 32;

  std::map<uint32_t, rpc::Handler> ops;
  NearMemoryService* svc = s.get();
  // Every request first checks this node's life (ForgetIfLifeChanged), then runs its handler.
  using Method = Result<size_t> (NearMemoryService::*)(const rpc::Request&, std::span<uint8_t>);
  auto handler = [svc](Method m, bool idempotent) {
    return rpc::Handler{[svc, m](const rpc::Request& r, std::span<uint8_t> out) {
                          svc->ForgetIfLifeChanged();
                          return (svc->*m)(r, out);
                        },
                        idempotent};
  };
  ops[pnm::kPnmOpen] = handler(&NearMemoryService::Open, false);
  ops[pnm::kPnmExtend] = handler(&NearMemoryService::Extend, false);
  ops[pnm::kPnmAttend] = handler(&NearMemoryService::Attend, true);
  ops[pnm::kPnmAttendSplit] = handler(&NearMemoryService::AttendSplit, true);
  ops[pnm::kPnmRenew] = handler(&NearMemoryService::Renew, true);
  ops[pnm::kPnmClose] = handler(&NearMemoryService::Close, true);
  rpc::RpcServerOptions so;
  so.geometry = pnm::PnmGeometry();
  so.hot_window = std::chrono::microseconds(500);  // a decoding client asks every few ms
  so.max_idle_sleep = std::chrono::microseconds(2000);
  so.tick_every = std::chrono::milliseconds(100);
  so.on_tick = [svc] { svc->Sweep(); };
  so.on_serving = [svc](const rpc::RpcServer&, bool serving) {
    if (serving) {
      svc->engines_->BindServingThread();  // it selects and leads the first engine's batches
    } else {
      svc->DropAll();
    }
  };
  CXLKV_ASSIGN_OR_RETURN(s->server_, rpc::RpcServer::Start(pool, pnm::PnmServiceName(pool.impl().node->id()),
                                                           std::move(ops), so));
  return s;
}

NearMemoryService::NearMemoryService(Pool& pool, const NearMemoryServiceOptions& options)
    : pool_(pool), options_(options) {}

NearMemoryService::~NearMemoryService() {
  server_.reset();  // no handler runs after this
  DropAll();
  engines_.reset();
}

NearMemoryServiceStats NearMemoryService::stats() const {
  NearMemoryServiceStats s;
  s.contexts_open = open_.load();
  s.contexts_opened = opened_.load();
  s.contexts_expired = expired_.load();
  s.pages_pinned = pages_pinned_.load();
  s.bytes_pinned = bytes_pinned_.load();
  s.attend_jobs = jobs_.load();
  s.attend_errors = job_errors_.load();
  s.pages_attended = pages_attended_.load();
  s.kv_bytes_read = kv_bytes_read_.load();
  s.link_bytes = link_bytes_.load();
  s.digests_found = digests_found_.load();
  s.digests_built = digests_built_.load();
  s.digests_stored = digests_stored_.load();
  s.engines = engines_->stats();
  s.numa_node = s.engines[0].numa_node;
  s.numa_note = s.engines[0].note;
  return s;
}

Result<size_t> NearMemoryService::Open(const rpc::Request& req, std::span<uint8_t> out) {
  CXLKV_ASSIGN_OR_RETURN(pnm::OpenRequest r, pnm::DecodeOpen(req.payload));
  const KvLayoutSignature& l = r.ns.layout;
  if (l.kv_parts != 2 || (l.block_format != kPoolBlockFormat && l.block_format != kPoolBlockFormatHeadMajor)) {
    return InvalidArgument("near-memory attention reads pool block formats 1 and 2 with K and V parts; this "
                           "namespace has format " + std::to_string(l.block_format) + " with " +
                           std::to_string(l.kv_parts) + " part(s) (MLA is not supported)");
  }
  if (l.num_layers == 0 || l.num_kv_heads == 0 || l.num_layers > 4096) {
    return InvalidArgument("a context needs a namespace whose layout names 1..4096 layers and its KV heads");
  }
  if (r.num_heads == 0 || r.num_heads > pnm::kMaxQueryHeads || r.num_heads % l.num_kv_heads != 0) {
    return InvalidArgument(std::to_string(r.num_heads) + " query heads: need 1.." + std::to_string(pnm::kMaxQueryHeads) +
                           " and a multiple of the layout's " + std::to_string(l.num_kv_heads) + " KV heads");
  }
  pnm::Geometry g{r.num_heads, l.num_kv_heads, l.head_size, l.block_size, l.dtype};
  g.head_major = l.block_format == kPoolBlockFormatHeadMajor;
  CXLKV_RETURN_IF_ERROR(g.Validate());
  const auto& area = req.server->area();  // (server_ may not be assigned yet: Start is still returning)
  if (4 + pnm::AttendJobRequestBytes(size_t{g.num_heads} * g.head_dim) > area.request_capacity() ||
      pnm::AttendJobAnswerBytes(g.num_heads, g.head_dim) > area.response_capacity()) {
    return InvalidArgument("one query of " + std::to_string(g.num_heads) + " heads × " + std::to_string(g.head_dim) +
                           " does not fit this service's " + std::to_string(area.request_capacity()) + "-byte slots");
  }
  if (contexts_.size() >= options_.max_contexts) {
    return NoSpace(std::to_string(contexts_.size()) + " near-memory contexts are open on this node: close some, "
                   "or start cxlkvd with a larger --pnm-max-contexts");
  }
  CXLKV_ASSIGN_OR_RETURN(NamespaceHandle ns, cache_->Namespace(r.ns));
  if (ns.block_bytes != l.BlockBytes()) {
    return Corrupted("the pool's namespace for model '" + r.ns.model_id + "' has blocks of " +
                     std::to_string(ns.block_bytes) + " bytes, its layout says " + std::to_string(l.BlockBytes()));
  }
  // A life already over (its process was paused past the lease and has not beaten since) would
  // see its context closed at the next sweep: say so now instead.
  if (pool_.impl().node->LifeOver(req.node, r.client_life, 0xffffffffull)) {
    return LeaseExpired("node " + std::to_string(req.node) + "'s life " + std::to_string(r.client_life) +
                        " is over (paused or silent past its lease): open again once it beats as its new life");
  }
  auto c = std::make_unique<Context>();
  c->id = epoch_ | next_id_++;
  c->owner_node = req.node;
  c->owner_channel = req.channel;
  c->owner_life = r.client_life;
  c->pin_life = pool_.impl().node->incarnation();
  c->ns = ns;
  // Digests are shared through the pool when their namespace can be registered; a full
  // namespace table only means every opener builds its own.
  auto dns = cache_->Namespace(DigestNamespace(r.ns));
  if (dns.ok() && dns->block_bytes == pnm::DigestBytesPerPage(g) * l.num_layers) c->digest_ns = *dns;
  c->g = g;
  c->layers = l.num_layers;
  c->block_bytes = l.BlockBytes();
  c->piece_bytes = g.SlabBytes();
  c->views.resize(c->layers);
  c->digests.resize(c->layers);
  c->last_used = Clock::now();
  const pnm::OpenAnswer a{c->id, options_.context_lease_ms};
  contexts_.emplace(c->id, std::move(c));
  opened_.fetch_add(1);
  open_.store(contexts_.size());
  const auto bytes = pnm::EncodeOpenAnswer(a);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return bytes.size();
}

Result<NearMemoryService::Context*> NearMemoryService::Find(const rpc::Request& req, uint64_t id) {
  auto it = contexts_.find(id);
  if (it == contexts_.end()) {
    return NotFound("context " + std::to_string(id) + " is not open on this node: it was closed, idle past its " +
                    std::to_string(options_.context_lease_ms) + " ms lease, or cxlkvd restarted; open it again");
  }
  Context& c = *it->second;
  if (c.owner_node != req.node || c.owner_channel != req.channel) {
    return InvalidArgument("context " + std::to_string(id) + " belongs to another client (node " +
                           std::to_string(c.owner_node) + ", channel " + std::to_string(c.owner_channel) + ")");
  }
  c.last_used = Clock::now();
  return &c;
}

Result<size_t> NearMemoryService::Extend(const rpc::Request& req, std::span<uint8_t> out) {
  CXLKV_ASSIGN_OR_RETURN(pnm::ExtendRequest r, pnm::DecodeExtend(req.payload));
  CXLKV_ASSIGN_OR_RETURN(Context * c, Find(req, r.context));
  if (r.first_page != c->pages()) {
    return InvalidArgument("extend at page " + std::to_string(r.first_page) + " of a context of " +
                           std::to_string(c->pages()) + " pages: a repeated or out-of-order extend");
  }
  if (c->pages() + r.keys.size() > kMaxContextPages) {
    return InvalidArgument("a context holds at most " + std::to_string(kMaxContextPages) + " pages");
  }
  CXLKV_ASSIGN_OR_RETURN(LookupResult hit, cache_->Lookup(c->ns, r.keys));
  if (pool_.impl().node->incarnation() != c->pin_life) {
    // The node's life ended during the lookup: these pins are not the context's life's.
    if (pool_.impl().node->Fence("releasing pins").ok()) cache_->Release(hit.pins);
    return Unavailable("this daemon's node was paused past its lease while pinning: open the context again");
  }
  if (hit.hit_blocks < r.keys.size()) {
    cache_->Release(hit.pins);
    return NotFound("page " + std::to_string(r.first_page + hit.hit_blocks) +
                    " of the context is not in the pool (evicted, never stored, or still being written): "
                    "attend up to it, or store it first");
  }
  for (const BlockPin& p : hit.pins) {
    if (p.bytes != c->block_bytes) {
      cache_->Release(hit.pins);
      return Corrupted("a block of the context has " + std::to_string(p.bytes) + " bytes, its namespace " +
                       std::to_string(c->block_bytes));
    }
  }
  // Blocks are immutable once READY: one invalidation now (P2) serves every later read.
  for (size_t i = 0; i < hit.pins.size(); ++i) {
    cache_->InvalidateForRead(cache_->PayloadPtr(hit.pins[i]), hit.pins[i].bytes, i + 1 == hit.pins.size());
  }
  for (const BlockPin& p : hit.pins) {
    const uint8_t* base = cache_->PayloadPtr(p);
    for (uint32_t l = 0; l < c->layers; ++l) {
      c->views[l].push_back({base + (uint64_t{l} * 2) * c->piece_bytes, base + (uint64_t{l} * 2 + 1) * c->piece_bytes});
    }
  }
  for (const BlockPin& p : hit.pins) {
    c->engine_of_page.push_back(
        static_cast<uint8_t>(engines_->EngineOfRegion(region::Offset<void>(p.offset).region_index())));
  }
  const uint64_t first = c->pages();
  c->pins.insert(c->pins.end(), hit.pins.begin(), hit.pins.end());
  pages_pinned_.fetch_add(hit.pins.size());
  bytes_pinned_.fetch_add(hit.pins.size() * c->block_bytes);
  pnm::ExtendAnswer a;
  CXLKV_RETURN_IF_ERROR(LoadOrBuildDigests(*c, first, r.keys, &a));
  a.pages = c->pages();
  const auto bytes = pnm::EncodeExtendAnswer(a);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return bytes.size();
}

Status NearMemoryService::LoadOrBuildDigests(Context& c, uint64_t first_page, std::span<const BlockKey> keys,
                                             pnm::ExtendAnswer* a) {
  const pnm::Geometry& g = c.g;
  const uint64_t elems = pnm::DigestBytesPerPage(g);
  const uint64_t digest_bytes = elems * c.layers;
  for (auto& d : c.digests) d.resize((first_page + keys.size()) * elems);
  size_t found = 0;
  std::vector<BlockKey> dkeys;
  if (c.digest_ns) {
    dkeys.reserve(keys.size());
    for (const BlockKey& k : keys) dkeys.push_back(DigestKeyOf(*c.digest_ns, k));
    auto hit = cache_->Lookup(*c.digest_ns, dkeys);
    if (hit.ok()) {
      for (const BlockPin& p : hit->pins) {
        if (p.bytes != digest_bytes) break;  // not ours to trust: build from here on
        const uint8_t* src = cache_->PayloadPtr(p);
        cache_->InvalidateForRead(src, p.bytes);
        bool well_formed = true;
        for (uint32_t l = 0; l < c.layers && well_formed; ++l) {
          uint8_t* d = c.digests[l].data() + (first_page + found) * elems;
          std::memcpy(d, src + l * elems, elems);  // copied first: checked bytes are the ones used
          well_formed = pnm::DigestPageWellFormed(g, d);
        }
        if (!well_formed) break;
        ++found;
      }
      cache_->Release(hit->pins);
    }
  }
  for (uint64_t i = found; i < keys.size(); ++i) {
    const uint64_t page = first_page + i;
    for (uint32_t l = 0; l < c.layers; ++l) {
      uint8_t* d = c.digests[l].data() + page * elems;
      pnm::ClearPageDigest(g, d);
      pnm::ExtendPageDigest(g, c.views[l][page], 0, g.page_tokens, d);
    }
  }
  a->digests_found = found;
  a->digests_built = keys.size() - found;
  // Store what was built for the next reader. Best effort: a full pool, a racing writer or a
  // digest already there leave this context's own copy in use.
  if (c.digest_ns && found < keys.size()) {
    auto reserved = cache_->ReserveMany(*c.digest_ns, std::span<const BlockKey>(dkeys).subspan(found), digest_bytes);
    if (reserved.ok()) {
      std::vector<Reservation> open;
      std::vector<uint8_t> block(digest_bytes);
      for (size_t j = 0; j < reserved->size(); ++j) {
        KeyReservation& kr = (*reserved)[j];
        if (kr.outcome != ReserveOutcome::kReserved) continue;
        const uint64_t page = first_page + found + j;
        for (uint32_t l = 0; l < c.layers; ++l) {
          std::memcpy(block.data() + l * elems, c.digests[l].data() + page * elems,
                      elems);
        }
        if (cache_->Write(kr.reservation, 0, block.data(), block.size()).ok()) {
          open.push_back(kr.reservation);
        } else {
          (void)cache_->Abort(kr.reservation);
        }
      }
      if (cache_->CommitMany(open).ok()) a->digests_stored = open.size();
    }
  }
  digests_found_.fetch_add(a->digests_found);
  digests_built_.fetch_add(a->digests_built);
  digests_stored_.fetch_add(a->digests_stored);
  return Status::Ok();
}

Status NearMemoryService::CheckHeld(const Context& c, const pnm::AttendJobRequest& j) {
  if (j.budget_tokens == 0) return InvalidArgument("a split attend needs a budget: 0 (every page) leaves nothing to split");
  if (j.held.size() != c.g.num_kv_heads) {
    return InvalidArgument("a split attend with " + std::to_string(j.held.size()) + " held-page lists for " +
                           std::to_string(c.g.num_kv_heads) + " KV heads");
  }
  for (size_t h = 0; h < j.held.size(); ++h) {
    for (uint32_t p : j.held[h]) {
      if (p >= c.pages()) {
        return InvalidArgument("KV head " + std::to_string(h) + " holds page " + std::to_string(p) +
                               " of a context of " + std::to_string(c.pages()) + " pages");
      }
    }
  }
  return Status::Ok();
}

Result<size_t> NearMemoryService::Attend(const rpc::Request& req, std::span<uint8_t> out) {
  CXLKV_ASSIGN_OR_RETURN(std::vector<pnm::AttendJobRequest> jobs, pnm::DecodeAttend(req.payload));
  return RunAttend(req, jobs, false, out);
}

Result<size_t> NearMemoryService::AttendSplit(const rpc::Request& req, std::span<uint8_t> out) {
  CXLKV_ASSIGN_OR_RETURN(std::vector<pnm::AttendJobRequest> jobs, pnm::DecodeAttendSplit(req.payload));
  return RunAttend(req, jobs, true, out);
}

Result<size_t> NearMemoryService::RunAttend(const rpc::Request& req, std::vector<pnm::AttendJobRequest>& jobs,
                                            bool split, std::span<uint8_t> out) {
  const size_t n = jobs.size();
  std::vector<Context*> ctx(n, nullptr);
  std::vector<Status> status(n);
  std::vector<pnm::Selection> selections(n);
  std::vector<pnm::Partial> partials(n);
  size_t answer_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const pnm::AttendJobRequest& j = jobs[i];
    auto c = Find(req, j.context);
    if (!c.ok()) {
      status[i] = c.status();
    } else if (j.layer >= (*c)->layers) {
      status[i] = InvalidArgument("layer " + std::to_string(j.layer) + " of a context of " +
                                  std::to_string((*c)->layers) + " layers");
    } else if (j.q.size() != size_t{(*c)->g.num_heads} * (*c)->g.head_dim) {
      status[i] = InvalidArgument("a query of " + std::to_string(j.q.size()) + " floats, the context's heads need " +
                                  std::to_string(size_t{(*c)->g.num_heads} * (*c)->g.head_dim));
    } else if ((*c)->pages() == 0) {
      status[i] = InvalidArgument("context " + std::to_string(j.context) + " has no pages yet: extend it first");
    } else if (split) {
      status[i] = CheckHeld(**c, j);
      if (status[i].ok()) ctx[i] = *c;
    } else {
      ctx[i] = *c;
    }
    answer_bytes += ctx[i] != nullptr ? pnm::AttendJobAnswerBytes(ctx[i]->g.num_heads, ctx[i]->g.head_dim)
                                      : 10 + pnm::kMaxJobMessage;
    if (split && ctx[i] != nullptr) {
      answer_bytes += pnm::SplitAnswerBytesBound(j, ctx[i]->g.num_kv_heads, ctx[i]->pages(), ctx[i]->g.page_tokens);
    }
  }
  if (answer_bytes > out.size()) {
    return InvalidArgument("the answer to " + std::to_string(n) + " jobs needs " + std::to_string(answer_bytes) +
                           " bytes, a response slot holds " + std::to_string(out.size()) + ": send fewer per request");
  }
  // Selection, then attention, each spread over the engines (data parallelism, §3.2; a lone
  // long request's KV heads and pages are shared out among them).
  std::vector<pnm::SelectJob> select;
  std::vector<size_t> select_of;
  for (size_t i = 0; i < n; ++i) {
    if (ctx[i] == nullptr || jobs[i].budget_tokens == 0) continue;
    const Context& c = *ctx[i];
    select.push_back({&c.g, jobs[i].q.data(), c.digests[jobs[i].layer].data(), c.pages() * c.g.page_tokens,
                      pnm::SelectOptions{jobs[i].budget_tokens, jobs[i].sink_pages, jobs[i].recent_pages},
                      &selections[i], {}});
    select_of.push_back(i);
  }
  (void)engines_->first().Select(select);  // per-job statuses
  for (size_t k = 0; k < select.size(); ++k) status[select_of[k]] = select[k].status;
  // Split: the engine attends the selected pages it holds; this side the rest.
  std::vector<pnm::Selection> near(split ? n : 0);
  for (size_t i = 0; split && i < n; ++i) {
    if (ctx[i] != nullptr && status[i].ok()) near[i] = pnm::SelectionNotHeld(selections[i], jobs[i].held, ctx[i]->pages());
  }
  std::vector<pnm::AttendJob> work;
  std::vector<std::span<const uint8_t>> work_engines;  // per item, the engine of each page
  std::vector<size_t> of_job;
  for (size_t i = 0; i < n; ++i) {
    if (ctx[i] == nullptr || !status[i].ok()) continue;
    const Context& c = *ctx[i];
    pnm::AttendJob w;
    w.g = &c.g;
    w.q = jobs[i].q.data();
    w.ctx = pnm::ContextView{c.views[jobs[i].layer], c.pages() * c.g.page_tokens};
    w.selection = split ? &near[i] : jobs[i].budget_tokens == 0 ? nullptr : &selections[i];
    w.scale = jobs[i].scale;
    w.out = &partials[i];
    work.push_back(w);
    work_engines.push_back(c.engine_of_page);
    of_job.push_back(i);
  }
  engines_->Attend(work, work_engines);  // per-job statuses
  for (size_t k = 0; k < work.size(); ++k) status[of_job[k]] = work[k].status;
  meta::WireWriter w(out);
  for (size_t i = 0; i < n; ++i) {
    jobs_.fetch_add(1);
    if (!status[i].ok()) {
      job_errors_.fetch_add(1);
      pnm::PutJobError(w, status[i]);
      continue;
    }
    const Context& c = *ctx[i];
    const uint64_t pages = pnm::PageHeadsAttended(
        c.g, c.pages(), split ? &near[i] : jobs[i].budget_tokens == 0 ? nullptr : &selections[i]);
    pages_attended_.fetch_add(pages);
    kv_bytes_read_.fetch_add(pages * c.g.HeadPageKvBytes());
    link_bytes_.fetch_add(jobs[i].q.size() * sizeof(float) + partials[i].out.size() * sizeof(float) +
                          partials[i].lse.size() * sizeof(float));
    const uint32_t attended = static_cast<uint32_t>(std::min<uint64_t>(pages, UINT32_MAX));
    if (split) {
      std::vector<pnm::SplitHeadAnswer> heads;
      for (uint32_t h = 0; h < c.g.num_kv_heads; ++h) {
        heads.push_back(pnm::SplitHeadOf(selections[i].RankedOf(h), jobs[i].held[h], jobs[i].hold_capacity));
      }
      const size_t before = w.size();
      pnm::PutSplitJobOk(w, attended, partials[i], heads);
      // The held lists in and the steps out (the partial is counted above).
      link_bytes_.fetch_add(pnm::HeldListsBytes(jobs[i].held) + (w.size() - before) -
                            pnm::AttendJobAnswerBytes(c.g.num_heads, c.g.head_dim));
    } else {
      pnm::PutJobOk(w, attended, partials[i]);
    }
  }
  if (w.overflow()) return Internal("pnm attend answer overflowed its checked size");
  return w.size();
}

Result<size_t> NearMemoryService::Renew(const rpc::Request& req, std::span<uint8_t> out) {
  CXLKV_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, pnm::DecodeContexts(req.payload));
  uint32_t renewed = 0;
  for (uint64_t id : ids) renewed += Find(req, id).ok();
  std::memcpy(out.data(), &renewed, 4);
  return size_t{4};
}

Result<size_t> NearMemoryService::Close(const rpc::Request& req, std::span<uint8_t>) {
  CXLKV_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, pnm::DecodeContexts(req.payload));
  Status first;
  for (uint64_t id : ids) {
    auto c = Find(req, id);
    if (!c.ok()) {
      if (first.ok()) first = c.status();
      continue;
    }
    Drop(contexts_.find(id));
  }
  CXLKV_RETURN_IF_ERROR(first);
  return size_t{0};
}

void NearMemoryService::Drop(std::map<uint64_t, std::unique_ptr<Context>>::iterator it) {
  Context& c = *it->second;
  // Pins of a life whose lease lapsed are recovery's to drop (recovery of that life gives back
  // its pin pages): releasing them now could take away pins this node's next life took since.
  if (pool_.impl().node->Fence("releasing a near-memory context's pins", c.pin_life).ok()) cache_->Release(c.pins);
  pages_pinned_.fetch_sub(c.pins.size());
  bytes_pinned_.fetch_sub(c.pins.size() * c.block_bytes);
  contexts_.erase(it);
  open_.store(contexts_.size());
}

void NearMemoryService::ForgetIfLifeChanged() {
  const uint64_t life = pool_.impl().node->incarnation();
  if (life == life_) return;
  // This node was declared dead (paused past its lease) and rejoined: recovery dropped every pin
  // of the old life, so the contexts name memory that is no longer held for them. Forgotten,
  // not released; their clients get kNotFound and open them again.
  pages_pinned_.store(0);
  bytes_pinned_.store(0);
  expired_.fetch_add(contexts_.size());
  contexts_.clear();
  open_.store(0);
  life_ = life;
}

void NearMemoryService::DropAll() {
  while (!contexts_.empty()) Drop(contexts_.begin());
}

void NearMemoryService::Sweep() {
  ForgetIfLifeChanged();
  if (contexts_.empty()) return;
  const auto now = Clock::now();
  const auto lease = std::chrono::milliseconds(options_.context_lease_ms);
  sync::Node& node = *pool_.impl().node;
  std::map<std::pair<uint32_t, uint64_t>, bool> over;  // one line read per client life, not per context
  for (auto it = contexts_.begin(); it != contexts_.end();) {
    const Context& c = *it->second;
    // Its line read now: restarted, left, or silent a whole lease in this daemon's view (what
    // recovery assumes). A life this daemon has not observed yet is not over.
    const auto life = std::make_pair(c.owner_node, c.owner_life);
    auto known = over.find(life);
    if (known == over.end()) known = over.emplace(life, node.LifeOver(c.owner_node, c.owner_life, 0xffffffffull)).first;
    const bool owner_gone = known->second;
    if (now - c.last_used > lease || owner_gone) {
      auto next = std::next(it);
      Drop(it);
      expired_.fetch_add(1);
      it = next;
    } else {
      ++it;
    }
  }
}

}  // namespace cxlkv::daemon
