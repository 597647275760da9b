#include "pool/pool_internal.h"

#include <thread>

#include "region/region_internal.h"
#include "sync/layout.h"

namespace cxlkv {

namespace {

// Creation is single-process: the header and the stripe locks' bitmap bits are written before
// any node can join.
void WriteIndexHeader(Region& region, cache::IndexHeader h, uint32_t total_locks) {
  auto& impl = region.impl();
  auto& meta = impl.meta();
  const uint64_t base = impl.area(region::AreaKind::kIndex).offset;
  h.namespaces_offset += base;
  h.entries_offset += base;
  h.stamps_offset += base;
  h.counters_offset += base;
  h.pin_dirs_offset += base;
  h.pin_pages_offset += base;
  meta.WriteStruct(base, h);
  meta.Flush(base, sizeof h);
  const auto& locks = impl.area(region::AreaKind::kLockArray);
  sync::LockArrayLayout layout(locks.offset, impl.info().max_nodes, total_locks);
  for (uint32_t k = h.lock_base; k < total_locks; ++k) {
    uint64_t off = layout.bitmap_word(k);
    meta.Publish(off, meta.Load(off) | (uint64_t{1} << (k % 64)));
  }
}

}  // namespace

Status Pool::Create(const std::vector<std::string>& paths, const PoolCreateOptions& options) {
  if (paths.empty()) return InvalidArgument("a pool needs at least one region path");
  if (paths.size() > region::kMaxPoolRegions) return InvalidArgument("too many regions");
  if (options.max_locks <= sync::kReservedLocks || options.max_locks > 65536) {
    return InvalidArgument("max locks must be " + std::to_string(sync::kReservedLocks + 1) + "..65536");
  }
  if (options.max_roots < 1 || options.max_roots > (1u << 24)) return InvalidArgument("max roots must be 1..16M");
  if (options.max_nodes > 255) return InvalidArgument("a pool admits at most 255 nodes");
  RegionCreateOptions ro{options.size, options.max_nodes, options.numa_node, options.overwrite,
                         options.chunk_bytes};
  if (options.low_watermark_pct > options.high_watermark_pct || options.high_watermark_pct > 100) {
    return InvalidArgument("cache watermarks must satisfy low <= high <= 100 (percent of capacity)");
  }
  // The index's stripe locks sit above the user locks, marked allocated at creation.
  cache::IndexOptions io;
  io.entries = options.index_entries;
  io.stripes = options.index_stripes;
  io.capacity_bytes = options.cache_capacity;
  io.high_watermark_pct = options.high_watermark_pct;
  io.low_watermark_pct = options.low_watermark_pct;
  io.checksum = options.checksum;
  io.central = options.metadata == MetadataMode::kCentral;
  if (io.central && !options.index) return InvalidArgument("central metadata needs the prefix index (drop --no-index)");
  const cache::IndexHeader index = cache::PlanIndex(io, options.size * paths.size(), options.max_nodes,
                                                    options.max_locks);
  if (options.index && (index.stripes > 4096 || uint64_t{index.stripes} * index.slots_per_stripe > (1ull << 26))) {
    return InvalidArgument("index of " + std::to_string(uint64_t{index.stripes} * index.slots_per_stripe) +
                           " entries in " + std::to_string(index.stripes) + " stripes is too large (64 Mi entries, 4096 stripes at most)");
  }
  const uint32_t total_locks = options.max_locks + (options.index ? cache::IndexLocks(index) : 0);
  // An upper bound: the data area is smaller than the region by the metadata before it.
  const uint64_t chunks = options.size / (options.chunk_bytes ? options.chunk_bytes : 1);
  // One random pool id for all regions; each records its position (layout version 4).
  region::PoolIdentity identity = region::NewPoolIdentity(static_cast<uint32_t>(paths.size()));
  for (size_t i = 0; i < paths.size(); ++i) {
    identity.index = static_cast<uint32_t>(i);
    std::vector<region::AreaRequest> areas;
    if (i == 0) {
      areas.push_back({region::AreaKind::kLockArray,
                       sync::LockArrayLayout::Bytes(options.max_nodes, total_locks), total_locks});
    }
    areas.push_back({region::AreaKind::kChunkTable,
                     alloc::ChunkTableLayout::Bytes(chunks, options.max_nodes, i == 0), chunks});
    if (i == 0) {
      areas.push_back({region::AreaKind::kObjectStore, objstore::StoreBytes(options.max_roots),
                       options.max_roots});
      if (options.index) areas.push_back({region::AreaKind::kIndex, cache::IndexAreaBytes(index), 0});
    }
    auto r = region::CreateRegion(paths[i], ro, region::Platform::Default(), areas, &identity);
    if (!r.ok()) return r.status();
    if (i == 0 && options.index) WriteIndexHeader(**r, index, total_locks);
  }
  return Status::Ok();
}

namespace pool {

Result<std::vector<std::unique_ptr<Region>>> AttachAll(const std::vector<std::string>& paths,
                                                       const RegionAttachOptions& attach) {
  std::vector<std::unique_ptr<Region>> regions;
  for (const std::string& p : paths) {
    CXLKV_ASSIGN_OR_RETURN(auto r, Region::Attach(p, attach));
    const RegionInfo& info = r->info();
    const uint32_t position = static_cast<uint32_t>(regions.size());
    // Identity first: a foreign or misplaced region is named as such, not as a mismatch.
    if (!regions.empty() && info.pool_id != regions[0]->info().pool_id) {
      return InvalidArgument("region " + p + " belongs to another pool (pool id " + info.pool_id + ") than " +
                             regions[0]->info().path + " (pool id " + regions[0]->info().pool_id +
                             "): pass the regions of one pool, in the order 'cxlkv init --path' was given");
    }
    if (info.pool_index != position) {
      return InvalidArgument("region " + p + " is region " + std::to_string(info.pool_index) + " of its pool of " +
                             std::to_string(info.pool_regions) + " but was given as region " +
                             std::to_string(position) + ": pass the paths in the order 'cxlkv init --path' "
                             "was given");
    }
    if (info.pool_regions != paths.size()) {
      return InvalidArgument("region " + p + " belongs to a pool of " + std::to_string(info.pool_regions) +
                             " regions, but " + std::to_string(paths.size()) + " path" +
                             (paths.size() == 1 ? " was" : "s were") + " given: pass all of them, in order");
    }
    if (!regions.empty() && (info.max_nodes != regions[0]->info().max_nodes ||
                             info.chunk_bytes != regions[0]->info().chunk_bytes)) {
      return Corrupted("region " + p + " does not match the pool's first region (node count "
                       "or chunk size differ) although it has its pool id: re-create the pool");
    }
    // Each area checks its parameters before anything indexes with them.
    CXLKV_RETURN_IF_ERROR(alloc::ChunkTableLayout::Validate(r->impl(), info.max_nodes, position == 0));
    if (position == 0) {
      const auto* locks = r->impl().find_area(region::AreaKind::kLockArray);
      if (locks == nullptr) {
        return InvalidArgument("the first path must be the pool's first region (it holds the locks)");
      }
      CXLKV_RETURN_IF_ERROR(sync::ValidateLockArea(*locks, info.max_nodes, p));
      CXLKV_RETURN_IF_ERROR(objstore::ObjectStore::ValidateArea(*r));
      if (!r->impl().find_area(region::AreaKind::kObjectStore) ||
          !r->impl().find_area(region::AreaKind::kNodeTable)) {
        return InvalidArgument("region " + p + " lacks the object store: create the pool with 'cxlkv init'");
      }
    }
    regions.push_back(std::move(r));
  }
  if (regions.empty()) return InvalidArgument("a pool needs at least one region path");
  return regions;
}

Result<std::vector<std::unique_ptr<Region>>> AttachAll(const std::vector<std::string>& paths) {
  return AttachAll(paths, RegionAttachOptions{});
}

}  // namespace pool

namespace {
pool::CentralMetadataFactory central_factory = nullptr;
pool::CapacityPromoterFactory promoter_factory = nullptr;
}  // namespace

void pool::RegisterCentralMetadata(CentralMetadataFactory factory) { central_factory = factory; }
void pool::RegisterCapacityPromoter(CapacityPromoterFactory factory) { promoter_factory = factory; }

Result<std::unique_ptr<Pool>> Pool::Open(const std::vector<std::string>& paths,
                                         const PoolOpenOptions& options) {
  auto impl = std::make_unique<Impl>();
  RegionAttachOptions attach = options.attach;
  attach.prefault = attach.prefault || options.prefault;
  CXLKV_ASSIGN_OR_RETURN(impl->regions, pool::AttachAll(paths, attach));
  // A damaged or foreign index is refused before joining: nothing is written.
  auto layout = cache::ReadLayout(*impl->regions[0]);
  if (!layout.ok() && layout.status().code() != StatusCode::kNotFound) return layout.status();
  sync::NodeOptions no;
  no.node_id = options.node_id;
  no.lease = std::chrono::milliseconds(options.lease_ms);
  no.may_host_manager = options.may_host_manager;
  no.recovers = options.recovers;
  CXLKV_ASSIGN_OR_RETURN(impl->node, sync::Node::Join(*impl->regions[0], no));
  impl->roots = std::make_unique<objstore::ObjectStore>(*impl->regions[0], impl->node.get());
  std::vector<Region*> raw;
  for (auto& r : impl->regions) raw.push_back(r.get());
  impl->allocator = std::make_unique<alloc::Allocator>(raw, *impl->node);
  // Published objects are those named by roots: recovery keeps them.
  objstore::ObjectStore* roots = impl->roots.get();
  alloc::Allocator* allocator = impl->allocator.get();
  allocator->AddReachability([roots](std::vector<uint64_t>& out) {
    for (const auto& r : roots->List()) out.push_back(r.offset);
  });
  // The prefix index: every process that joins takes part in its recovery, so whichever
  // process manages the pool keeps READY payloads reachable and reclaims a dead writer's.
  if (layout.ok()) {
    impl->index = std::make_unique<cache::Index>(*impl->regions[0], *layout, *impl->node, *allocator);
    cache::Index* index = impl->index.get();
    allocator->AddReachability([index](std::vector<uint64_t>& out) { index->AppendReachable(out); });
    if (index->central()) {
      // The service is the index's one writer: it reclaims dead lives' entries and pins itself
      // (its sweep); a dead process of this node is reported to it.
      Impl* raw_impl = impl.get();
      impl->node->AddProcessRecoveryHandler([raw_impl](uint32_t slot, uint64_t inc) {
        std::lock_guard<std::mutex> g(raw_impl->central_mu);
        return raw_impl->central == nullptr || raw_impl->central->RecoverProcess(slot, inc);
      });
    } else {
      impl->cache = std::make_unique<KvCache>(*impl->index);
      impl->node->AddRecoveryHandler([index](uint32_t node, uint64_t inc) { index->Recover(node, inc); });
      impl->node->AddProcessRecoveryHandler([index](uint32_t slot, uint64_t inc) { return index->RecoverProcess(slot, inc); });
    }
    impl->node->AddPeriodicTask([index] { index->PublishCounters(); });
  }
  // After the index's handler: the index first drops a dead node's half-done entries, so the
  // allocator's reachability no longer counts their payloads and reclaims them.
  impl->node->AddRecoveryHandler([allocator](uint32_t node, uint64_t inc) { allocator->Recover(node, inc); });
  // Once a beat. (8 times a beat made a promote short of room wait a little less — 34–48 ms
  // against 40 in the demo's quick run — when a process killed mid-drain still leaked what it
  // had claimed; the node's next drainer now finishes such a claim, docs/protocol.md, "The
  // drain's claim". Writers that make room drain at once anyway: docs/tiers.md, "Room for a
  // promote".)
  impl->node->AddPeriodicTask([allocator] { allocator->DrainRemoteFrees(); });
  // Only now: a recovery queued meanwhile (this node may manage from its first beat) runs with
  // every handler, in order.
  impl->node->StartRecovery();
  auto pool = std::make_unique<Pool>(std::move(impl));
  if (pool->impl_->cache && promoter_factory != nullptr) {
    pool->impl_->promoter = promoter_factory(*pool);
    pool->impl_->cache->SetCapacityPromoter(pool->impl_->promoter.get());
    pool->impl_->index->SetRoomMaker(pool->impl_->promoter.get());
  }
  if (pool->impl_->index && pool->impl_->index->central()) {
    Impl& im = *pool->impl_;
    if (central_factory == nullptr) {
      im.central_error = NotSupported("this pool's metadata is central and this program was built without the "
                                      "metadata client (link cxlkv_meta); use cxlkv's tools or re-create the "
                                      "pool with --metadata decentralized");
    } else if (auto c = central_factory(*pool, options); c.ok()) {
      std::lock_guard<std::mutex> g(im.central_mu);
      im.central = std::move(*c);
      im.cache = std::make_unique<KvCache>(im.central->index());
    } else {
      return c.status();
    }
  }
  return pool;
}

Pool::Pool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Pool::~Pool() {
  // The service's client and standby first: they call into the node and the index.
  impl_->cache.reset();
  if (impl_->index) impl_->index->SetRoomMaker(nullptr);
  impl_->promoter.reset();  // its RPC clients use the node
  {
    std::lock_guard<std::mutex> g(impl_->central_mu);
    impl_->central.reset();
  }
  if (impl_->index) {
    impl_->index->AbandonOpenReservations();  // the slot goes free: no entry may name it after
    impl_->index->ReleaseProcessPins();       // ... and no pin page either
    impl_->index->PublishCounters();
  }
  if (impl_->node->LeavingLast()) {
    // The node's last process: the node leaves with nothing leased and no empty heap chunk.
    impl_->allocator->Trim();
    impl_->allocator->EndLease();
  } else {
    impl_->allocator->ReturnLease();
  }
  // Stop the node's threads (they call into the allocator and index) before those go.
  impl_->node.reset();
}

Result<KvCache*> Pool::Cache() {
  if (!impl_->cache && !impl_->central_error.ok()) return impl_->central_error;
  if (!impl_->cache) {
    return NotFound("this pool has no prefix index: re-create it with 'cxlkv init' (without --no-index)");
  }
  return impl_->cache.get();
}

MetadataMode Pool::metadata() const {
  return impl_->index && impl_->index->central() ? MetadataMode::kCentral : MetadataMode::kDecentralized;
}

const char* MetadataModeName(MetadataMode mode) {
  return mode == MetadataMode::kCentral ? "central" : "decentralized";
}

std::vector<std::span<uint8_t>> Pool::MappedRanges() {
  std::vector<std::span<uint8_t>> out;
  for (auto& r : impl_->regions) out.emplace_back(r->impl().base(), r->impl().size());
  return out;
}

Result<uint64_t> Pool::Alloc(uint64_t bytes) {
  CXLKV_ASSIGN_OR_RETURN(auto off, impl_->allocator->Alloc(bytes));
  return off.raw();
}
Status Pool::Free(uint64_t offset) { return impl_->allocator->Free(alloc::ObjectOffset(offset)); }
uint8_t* Pool::Ptr(uint64_t offset, uint64_t bytes) {
  return impl_->allocator->Ptr(alloc::ObjectOffset(offset), bytes);
}
Status Pool::Put(std::string_view name, uint64_t offset, uint64_t size) {
  return impl_->roots->Put(name, offset, size);
}
Result<PoolRoot> Pool::Get(std::string_view name) {
  CXLKV_ASSIGN_OR_RETURN(auto r, impl_->roots->Get(name));
  return PoolRoot{r.name, r.offset, r.size};
}
Status Pool::Destroy(std::string_view name) { return impl_->roots->Destroy(name); }
Result<uint32_t> Pool::AllocateLock() { return impl_->node->AllocateLock(); }
Status Pool::FreeLock(uint32_t lock) { return impl_->node->FreeLock(lock); }
Status Pool::Lock(uint32_t lock, uint32_t timeout_ms) {
  if (lock < sync::kReservedLocks) return InvalidArgument("lock " + std::to_string(lock) + " is internal");
  auto held = impl_->node->AcquireFor(lock, std::chrono::milliseconds(timeout_ms));
  return held.status();
}
void Pool::Unlock(uint32_t lock) { impl_->node->Release(lock); }

}  // namespace cxlkv
