// The C API (include/cxlkv/cxlkv.h): thin conversions onto the C++ pool and cache.
#include "cxlkv/cxlkv.h"

#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/kv_store.h"
#include "cxlkv/layout.h"
#include "cxlkv/pool.h"

struct cxlkv_pool {
  std::unique_ptr<cxlkv::Pool> pool;
  cxlkv::KvCache* cache = nullptr;
};

struct cxlkv_kv_store {
  std::unique_ptr<cxlkv::EngineKvStore> store;
};

namespace {

thread_local std::string last_error;

static_assert(CXLKV_INTERNAL == static_cast<int>(cxlkv::StatusCode::kInternal));
static_assert(CXLKV_LEASE_EXPIRED == static_cast<int>(cxlkv::StatusCode::kLeaseExpired));
static_assert(CXLKV_UNAVAILABLE == static_cast<int>(cxlkv::StatusCode::kUnavailable));
static_assert(CXLKV_RESERVE_ERROR == static_cast<int>(cxlkv::ReserveOutcome::kError));
static_assert(CXLKV_RESERVE_BUSY == static_cast<int>(cxlkv::ReserveOutcome::kBusy));
static_assert(3 == static_cast<int>(cxlkv::PeekState::kOther));

cxlkv_status Report(const cxlkv::Status& s) {
  last_error = s.ok() ? std::string() : s.ToString();
  return static_cast<cxlkv_status>(s.code());
}

std::vector<std::string> SplitPaths(const char* paths) {
  std::vector<std::string> out;
  std::stringstream in(paths ? paths : "");
  for (std::string p; std::getline(in, p, ',');) {
    if (!p.empty()) out.push_back(p);
  }
  return out;
}

cxlkv::NamespaceHandle Handle(const cxlkv_namespace* ns) {
  return cxlkv::NamespaceHandle{ns->id, ns->block_size, ns->block_bytes, {ns->seed.lo, ns->seed.hi}};
}
cxlkv::BlockKey Key(const cxlkv_key& k) { return {k.lo, k.hi}; }
cxlkv_key CKey(const cxlkv::BlockKey& k) { return {k.lo, k.hi}; }
cxlkv::BlockPin Pin(const cxlkv_pin& p) {
  return cxlkv::BlockPin{p.slot, p.generation, p.offset, p.bytes, p.tier, p.checksum, p.pin_word};
}
cxlkv_pin CPin(const cxlkv::BlockPin& p) {
  return {p.slot, p.tier, p.generation, p.offset, p.bytes, p.checksum, p.pin_word};
}
cxlkv::Reservation Res(const cxlkv_reservation* r) {
  return cxlkv::Reservation{r->slot, r->generation, r->offset, r->bytes, r->open != 0};
}
void CRes(const cxlkv::Reservation& r, cxlkv_reservation* out) {
  *out = {r.slot, r.open ? 1u : 0u, r.generation, r.offset, r.bytes};
}
std::vector<cxlkv::BlockKey> Keys(const cxlkv_key* keys, size_t n) {
  std::vector<cxlkv::BlockKey> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Key(keys[i]);
  return v;
}

// CommitMany or AbortMany over the caller's array: every reservation goes back closed.
cxlkv_status FinishMany(cxlkv::KvCache& cache, cxlkv::Status (cxlkv::KvCache::*op)(std::span<cxlkv::Reservation>),
                        cxlkv_reservation* rs, size_t n) {
  std::vector<cxlkv::Reservation> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Res(&rs[i]);
  cxlkv::Status s = (cache.*op)(v);
  for (size_t i = 0; i < n; ++i) CRes(v[i], &rs[i]);
  return Report(s);
}

// Commit or Abort: both close the reservation, which goes back to the caller's struct.
cxlkv_status Finish(cxlkv::KvCache& cache, cxlkv::Status (cxlkv::KvCache::*op)(cxlkv::Reservation&),
                    cxlkv_reservation* r) {
  auto res = Res(r);
  cxlkv::Status s = (cache.*op)(res);
  CRes(res, r);
  return Report(s);
}

#define CXLKV_C_REQUIRE(cond, what)                                               \
  do {                                                                            \
    if (!(cond)) return Report(cxlkv::InvalidArgument(std::string(what) + " is null")); \
  } while (0)

// The enum codes of a C engine layout, checked before they are cast to the C++ enums.
cxlkv::Status CheckLayoutCodes(const cxlkv_engine_layout& c) {
  if (c.kind > static_cast<uint32_t>(cxlkv::EngineLayoutKind::kFlashInferHnd) ||
      c.dtype > static_cast<uint32_t>(cxlkv::KvDtype::kFp32)) {
    return cxlkv::InvalidArgument("register KV buffers: layout kind " + std::to_string(c.kind) + " / dtype " +
                                  std::to_string(c.dtype) + " unknown (kind 0..3, dtype 0..3)");
  }
  return cxlkv::Status::Ok();
}

// The C struct's fields onto the C++ layout; `layers` null pointers when none are given.
cxlkv::EngineKvLayout EngineLayout(const cxlkv_engine_layout& c, void* const* layers, uint32_t num_layers) {
  cxlkv::EngineKvLayout l;
  l.kind = static_cast<cxlkv::EngineLayoutKind>(c.kind);
  l.dtype = static_cast<cxlkv::KvDtype>(c.dtype);
  l.num_blocks = c.num_blocks;
  l.block_size = c.block_size;
  l.num_kv_heads = c.num_kv_heads;
  l.head_size = c.head_size;
  l.latent_dim = c.latent_dim;
  l.tp_rank = c.tp_rank;
  l.tp_size = c.tp_size;
  l.pp_stage = c.pp_stage;
  l.layers.assign(num_layers, nullptr);
  for (uint32_t i = 0; layers && i < num_layers; ++i) l.layers[i] = static_cast<uint8_t*>(layers[i]);
  return l;
}

}  // namespace

extern "C" {

const char* cxlkv_last_error(void) { return last_error.c_str(); }

cxlkv_status cxlkv_pool_create(const char* paths, uint64_t size_bytes, uint32_t max_nodes, int overwrite) {
  cxlkv::PoolCreateOptions o;
  o.size = size_bytes;
  o.max_nodes = max_nodes ? max_nodes : 16;
  o.overwrite = overwrite != 0;
  return Report(cxlkv::Pool::Create(SplitPaths(paths), o));
}

cxlkv_status cxlkv_pool_open(const char* paths, uint32_t node_id, uint32_t lease_ms, cxlkv_pool** out) {
  CXLKV_C_REQUIRE(out, "out");
  *out = nullptr;
  cxlkv::PoolOpenOptions o;
  o.node_id = node_id;
  if (lease_ms) o.lease_ms = lease_ms;
  auto pool = cxlkv::Pool::Open(SplitPaths(paths), o);
  if (!pool.ok()) return Report(pool.status());
  auto cache = (*pool)->Cache();
  if (!cache.ok()) return Report(cache.status());
  auto handle = std::make_unique<cxlkv_pool>();
  handle->pool = std::move(pool).value();
  handle->cache = *cache;
  *out = handle.release();
  return Report(cxlkv::Status::Ok());
}

void cxlkv_pool_close(cxlkv_pool* pool) { delete pool; }

cxlkv_layout cxlkv_layout_default(void) {
  cxlkv::KvLayoutSignature l;
  return {static_cast<uint32_t>(l.dtype), l.num_layers, l.num_kv_heads, l.head_size, l.block_size,
          l.tp_rank, l.tp_size, l.pp_stage, l.kv_parts, l.block_format};
}

cxlkv_status cxlkv_namespace_register(cxlkv_pool* pool, const char* model_id, const cxlkv_layout* layout,
                                      const char* extra_key, cxlkv_namespace* out) {
  CXLKV_C_REQUIRE(pool && model_id && layout && out, "pool, model id, layout or out");
  cxlkv::KeyNamespace ns;
  ns.model_id = model_id;
  ns.extra_key = extra_key ? extra_key : "";
  ns.layout = {static_cast<cxlkv::KvDtype>(layout->dtype), layout->num_layers, layout->num_kv_heads,
               layout->head_size, layout->block_size, layout->tp_rank, layout->tp_size, layout->pp_stage,
               layout->kv_parts, layout->block_format};
  auto h = pool->cache->Namespace(ns);
  if (!h.ok()) return Report(h.status());
  *out = {h->id, h->block_size, h->block_bytes, CKey(h->seed)};
  return Report(cxlkv::Status::Ok());
}

size_t cxlkv_chain_keys(const cxlkv_namespace* ns, const int32_t* tokens, size_t n_tokens, cxlkv_key* out,
                        size_t max_keys) {
  if (!ns || (!tokens && n_tokens) || (!out && max_keys)) return 0;
  auto keys = cxlkv::KvCache::ChainKeys(Handle(ns), {tokens, n_tokens});
  size_t n = std::min(keys.size(), max_keys);
  for (size_t i = 0; i < n; ++i) out[i] = CKey(keys[i]);
  return n;
}

cxlkv_key cxlkv_key_from_engine_hash(const cxlkv_namespace* ns, const void* hash, size_t hash_bytes) {
  if (!ns || (!hash && hash_bytes)) return {0, 0};
  return CKey(cxlkv::KvCache::KeyFromEngineHash(Handle(ns), {static_cast<const uint8_t*>(hash), hash_bytes}));
}

cxlkv_status cxlkv_lookup(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                          cxlkv_pin* pins, size_t* hits) {
  CXLKV_C_REQUIRE(pool && ns && (keys || !n) && (pins || !n) && hits, "pool, namespace, keys, pins or hits");
  auto k = Keys(keys, n);
  auto r = pool->cache->Lookup(Handle(ns), k);
  if (!r.ok()) return Report(r.status());
  for (size_t i = 0; i < r->hit_blocks; ++i) pins[i] = CPin(r->pins[i]);
  *hits = r->hit_blocks;
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_exists(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                          size_t* hits) {
  CXLKV_C_REQUIRE(pool && ns && (keys || !n) && hits, "pool, namespace, keys or hits");
  auto r = pool->cache->Exists(Handle(ns), Keys(keys, n));
  if (!r.ok()) return Report(r.status());
  *hits = *r;
  return Report(cxlkv::Status::Ok());
}

void cxlkv_release(cxlkv_pool* pool, const cxlkv_pin* pins, size_t n) {
  if (!pool || !pins) return;
  std::vector<cxlkv::BlockPin> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Pin(pins[i]);
  pool->cache->Release(v);
}

cxlkv_status cxlkv_reserve(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* key, uint64_t bytes,
                           cxlkv_reservation* out) {
  CXLKV_C_REQUIRE(pool && ns && key && out, "pool, namespace, key or out");
  auto r = pool->cache->Reserve(Handle(ns), Key(*key), bytes);
  if (!r.ok()) return Report(r.status());
  CRes(*r, out);
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_write(cxlkv_pool* pool, cxlkv_reservation* r, uint64_t at, const void* src, uint64_t bytes) {
  CXLKV_C_REQUIRE(pool && r && (src || !bytes), "pool, reservation or source");
  auto res = Res(r);
  return Report(pool->cache->Write(res, at, src, bytes));
}

cxlkv_status cxlkv_commit(cxlkv_pool* pool, cxlkv_reservation* r) {
  CXLKV_C_REQUIRE(pool && r, "pool or reservation");
  return Finish(*pool->cache, &cxlkv::KvCache::Commit, r);
}

cxlkv_status cxlkv_abort(cxlkv_pool* pool, cxlkv_reservation* r) {
  CXLKV_C_REQUIRE(pool && r, "pool or reservation");
  return Finish(*pool->cache, &cxlkv::KvCache::Abort, r);
}

cxlkv_status cxlkv_put(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* key, const void* data,
                       uint64_t bytes) {
  CXLKV_C_REQUIRE(pool && ns && key && (data || !bytes), "pool, namespace, key or data");
  return Report(pool->cache->Put(Handle(ns), Key(*key), data, bytes));
}

cxlkv_status cxlkv_read(cxlkv_pool* pool, const cxlkv_pin* pin, uint64_t at, void* dst, uint64_t bytes) {
  CXLKV_C_REQUIRE(pool && pin && (dst || !bytes), "pool, pin or destination");
  return Report(pool->cache->Read(Pin(*pin), at, dst, bytes));
}

cxlkv_status cxlkv_reserve_many(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                                uint64_t bytes, cxlkv_key_reservation* out) {
  CXLKV_C_REQUIRE(pool && ns && (keys || !n) && (out || !n), "pool, namespace, keys or out");
  auto r = pool->cache->ReserveMany(Handle(ns), Keys(keys, n), bytes);
  if (!r.ok()) return Report(r.status());
  for (size_t i = 0; i < n; ++i) {
    const cxlkv::KeyReservation& k = (*r)[i];
    out[i].outcome = static_cast<uint32_t>(k.outcome);
    out[i].status = static_cast<uint32_t>(k.status.code());
    out[i].writer_node = k.writer_node;
    out[i].writer_incarnation = k.writer_incarnation;
    CRes(k.reservation, &out[i].reservation);
  }
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_commit_many(cxlkv_pool* pool, cxlkv_reservation* rs, size_t n) {
  CXLKV_C_REQUIRE(pool && (rs || !n), "pool or reservations");
  return FinishMany(*pool->cache, &cxlkv::KvCache::CommitMany, rs, n);
}

cxlkv_status cxlkv_abort_many(cxlkv_pool* pool, cxlkv_reservation* rs, size_t n) {
  CXLKV_C_REQUIRE(pool && (rs || !n), "pool or reservations");
  return FinishMany(*pool->cache, &cxlkv::KvCache::AbortMany, rs, n);
}

cxlkv_status cxlkv_peek(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                        cxlkv_key_peek* out) {
  CXLKV_C_REQUIRE(pool && ns && (keys || !n) && (out || !n), "pool, namespace, keys or out");
  auto r = pool->cache->Peek(Handle(ns), Keys(keys, n));
  if (!r.ok()) return Report(r.status());
  for (size_t i = 0; i < n; ++i) {
    const cxlkv::KeyPeek& p = (*r)[i];
    out[i] = {static_cast<uint32_t>(p.state), p.writer_node, p.writer_incarnation, p.writer_live ? 1u : 0u, 0};
  }
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_evict(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                         uint64_t* evicted) {
  CXLKV_C_REQUIRE(pool && ns && (keys || !n), "pool, namespace or keys");
  auto r = pool->cache->Evict(Handle(ns), Keys(keys, n));
  if (!r.ok()) return Report(r.status());
  if (evicted) *evicted = *r;
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_evict_all(cxlkv_pool* pool, uint64_t* evicted) {
  CXLKV_C_REQUIRE(pool, "pool");
  auto r = pool->cache->EvictAll();
  if (!r.ok()) return Report(r.status());
  if (evicted) *evicted = *r;
  return Report(cxlkv::Status::Ok());
}

cxlkv_layout cxlkv_engine_layout_signature(const cxlkv_engine_layout* layout, uint32_t num_layers) {
  if (!layout) return cxlkv_layout_default();
  cxlkv::KvLayoutSignature l = EngineLayout(*layout, nullptr, num_layers).Signature();
  return {static_cast<uint32_t>(l.dtype), l.num_layers, l.num_kv_heads, l.head_size, l.block_size,
          l.tp_rank, l.tp_size, l.pp_stage, l.kv_parts, l.block_format};
}

cxlkv_status cxlkv_kv_store_register(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_engine_layout* layout,
                                     void* const* layers, uint32_t num_layers, uint32_t copy_threads,
                                     cxlkv_kv_store** out) {
  CXLKV_C_REQUIRE(pool && ns && layout && layers && out, "pool, namespace, layout, layers or out");
  if (cxlkv::Status s = CheckLayoutCodes(*layout); !s.ok()) return Report(s);
  auto r = cxlkv::EngineKvStore::Register(*pool->cache, Handle(ns), EngineLayout(*layout, layers, num_layers),
                                          copy_threads ? copy_threads : 1);
  if (!r.ok()) return Report(r.status());
  *out = new cxlkv_kv_store{std::move(*r)};
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_kv_store_register_device(cxlkv_pool* pool, const cxlkv_namespace* ns,
                                            const cxlkv_engine_layout* layout, void* const* layers,
                                            uint32_t num_layers, int cuda_device, cxlkv_kv_store** out) {
  CXLKV_C_REQUIRE(pool && ns && layout && layers && out, "pool, namespace, layout, layers or out");
  if (cxlkv::Status s = CheckLayoutCodes(*layout); !s.ok()) return Report(s);
  auto r = cxlkv::EngineKvStore::RegisterDevice(*pool->pool, Handle(ns), EngineLayout(*layout, layers, num_layers),
                                                cuda_device);
  if (!r.ok()) return Report(r.status());
  *out = new cxlkv_kv_store{std::move(*r)};
  return Report(cxlkv::Status::Ok());
}

void cxlkv_kv_store_close(cxlkv_kv_store* store) { delete store; }

cxlkv_status cxlkv_exists_prefix(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                                 size_t* prefix) {
  return cxlkv_exists(pool, ns, keys, n, prefix);
}

cxlkv_status cxlkv_put_many(cxlkv_kv_store* store, const cxlkv_key* keys, const uint32_t* block_ids, size_t n,
                            uint64_t* written, uint64_t* skipped) {
  CXLKV_C_REQUIRE(store && (keys || !n) && (block_ids || !n), "store, keys or block ids");
  auto r = store->store->PutMany(Keys(keys, n), std::span<const uint32_t>(block_ids, n));
  if (!r.ok()) return Report(r.status());
  if (written) *written = r->written;
  if (skipped) *skipped = r->skipped;
  return Report(cxlkv::Status::Ok());
}

cxlkv_status cxlkv_get_many_into(cxlkv_kv_store* store, const cxlkv_key* keys, const uint32_t* block_ids, size_t n,
                                 size_t* loaded) {
  CXLKV_C_REQUIRE(store && (keys || !n) && (block_ids || !n) && loaded, "store, keys, block ids or loaded");
  auto r = store->store->GetManyInto(Keys(keys, n), std::span<const uint32_t>(block_ids, n));
  if (!r.ok()) return Report(r.status());
  *loaded = *r;
  return Report(cxlkv::Status::Ok());
}

}  // extern "C"
