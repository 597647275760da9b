// TierStore: spill, promote and adoption over the node's capacity devices (tier_store.h).
#include "tier/tier_store.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "pool/pool_internal.h"
#include "pool/status_doc.h"
#include "tier/dram_device.h"
#include "tier/placement.h"
#include "tier/probe.h"
#include "tier/ssd_device.h"
#include "util/units.h"

namespace cxlkv::tier {

namespace {

using Block = cache::Index::TierBlock;

// The store whose move this thread is making (it holds that store's move_mu_), or null.
thread_local TierStore* moving_store = nullptr;
// Marks this thread as moving blocks for `store` (TierStore::InsideMove) while it lives.
struct MoveScope {
  explicit MoveScope(TierStore* store) : previous(moving_store) { moving_store = store; }
  ~MoveScope() { moving_store = previous; }
  TierStore* previous;
};

uint16_t EntryTierOf(TierKind kind) { return kind == TierKind::kMem ? cache::kTierMem : cache::kTierSsd; }

Status BadSpec(std::string_view text, const std::string& why) {
  return InvalidArgument("tier '" + std::string(text) + "': " + why +
                         "; expected dram:SIZE[:numa=N] or ssd:PATH:SIZE (e.g. --tier dram:8G --tier ssd:/data/kv.tier:64G)");
}

}  // namespace

Result<TierSpec> ParseTierSpec(std::string_view text) {
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) return BadSpec(text, "no kind");
  const std::string_view kind = text.substr(0, colon);
  std::string_view rest = text.substr(colon + 1);
  TierSpec spec;
  if (kind == "dram" || kind == "mem") {
    spec.kind = TierKind::kMem;
    const size_t numa = rest.find(":numa=");
    if (numa != std::string_view::npos) {
      const std::string n(rest.substr(numa + 6));
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) return BadSpec(text, "bad NUMA node");
      spec.numa_node = std::stoi(n);
      rest = rest.substr(0, numa);
    }
    auto bytes = util::ParseByteSize(rest);
    if (!bytes.ok() || *bytes == 0) return BadSpec(text, "bad size '" + std::string(rest) + "'");
    spec.bytes = *bytes;
    return spec;
  }
  if (kind == "ssd") {
    spec.kind = TierKind::kSsd;
    const size_t last = rest.rfind(':');  // the path may itself hold ':'
    if (last == std::string_view::npos || last == 0) return BadSpec(text, "no path or no size");
    spec.path = std::string(rest.substr(0, last));
    auto bytes = util::ParseByteSize(rest.substr(last + 1));
    if (!bytes.ok()) return BadSpec(text, "bad size '" + std::string(rest.substr(last + 1)) + "'");
    spec.bytes = *bytes;
    return spec;
  }
  return BadSpec(text, "unknown kind '" + std::string(kind) + "'");
}

bool TierStore::InsideMove() { return moving_store != nullptr; }

uint64_t TierStore::MakeRoomInsideMove(uint64_t bytes) {
  TierStore* store = moving_store;
  if (store == nullptr) return 0;
  // This thread holds the store's move_mu_ (MoveScope is taken with it): spill directly.
  const uint64_t before = store->index_.UsedBytes();
  (void)store->SpillLocked(bytes);
  const uint64_t after = store->index_.UsedBytes();
  return before > after ? before - after : 0;
}

TierStore::TierStore(Pool& pool, cache::Index& index, const TierStoreOptions& options)
    : pool_(pool), index_(index), options_(options), node_(index.node_id()) {}

Result<std::unique_ptr<TierStore>> TierStore::Open(Pool& pool, const TierStoreOptions& options) {
  if (options.tiers.empty()) return InvalidArgument("no capacity tier given: name at least one (--tier)");
  if (options.slot_bytes < 8192 || options.slot_bytes % 4096 != 0) {
    return InvalidArgument("tier slot size " + std::to_string(options.slot_bytes) +
                           " must be a multiple of 4 KiB, at least 8 KiB");
  }
  if (options.spill_target_pct >= options.spill_start_pct || options.spill_start_pct > 100) {
    return InvalidArgument("spill watermarks: want target < start <= 100 (got " + std::to_string(options.spill_target_pct) +
                           " and " + std::to_string(options.spill_start_pct) + ")");
  }
  Pool::Impl& im = pool.impl();
  if (!im.index) return NotFound("this pool has no prefix index: capacity tiers extend it (re-create it with 'cxlkv init')");
  if (im.index->central()) {
    return NotSupported("capacity tiers need a decentralized pool for now (this one's metadata is central): "
                        "re-create it with 'cxlkv init --metadata decentralized'");
  }
  std::unique_ptr<TierStore> store(new TierStore(pool, *im.index, options));
  for (size_t i = 0; i < options.tiers.size(); ++i) {
    const TierSpec& spec = options.tiers[i];
    const std::string what = "tier " + std::to_string(i) + " (" + std::string(TierKindName(spec.kind)) + "): ";
    if (spec.kind == TierKind::kMem) {
      DramOptions o;
      o.index = static_cast<uint32_t>(i);
      o.capacity_bytes = spec.bytes;
      o.slot_bytes = options.slot_bytes;
      o.numa_node = spec.numa_node;
      auto dev = DramDevice::Create(o);
      if (!dev.ok()) return Status(dev.status().code(), what + dev.status().message());
      store->devices_.push_back(std::move(*dev));
    } else {
      SsdOptions o;
      o.path = spec.path;
      o.index = static_cast<uint32_t>(i);
      o.size_bytes = spec.bytes;
      o.slot_bytes = options.slot_bytes;
      auto dev = SsdDevice::Open(o);
      if (!dev.ok()) return Status(dev.status().code(), what + dev.status().message());
      store->devices_.push_back(std::move(*dev));
    }
  }
  // Adopt before the probe: the probe writes to free slots only, and the blocks an earlier
  // cxlkvd left on the SSD are not free.
  store->ReconcileLocked(/*adopt=*/true);
  for (auto& dev : store->devices_) {
    if (auto bw = ProbeBandwidth(*dev); !bw.ok()) {
      std::fprintf(stderr, "cxlkv: tier: probing %s: %s (placement treats it as the slowest)\n",
                   dev->Describe().c_str(), bw.status().ToString().c_str());
    }
    if (dev->bandwidth() == 0) dev->set_bandwidth(1);
  }
  std::vector<uint64_t> bandwidths;
  for (auto& dev : store->devices_) bandwidths.push_back(dev->bandwidth());
  store->placement_ = std::make_unique<PlacementCursor>(bandwidths);
  store->workers_.resize(store->devices_.size());
  for (size_t i = 0; i < store->workers_.size(); ++i) {
    store->workers_[i].thread = std::thread([s = store.get(), i] { s->WorkerLoop(i); });
  }
  store->PublishStatus();
  if (options.background) store->spill_thread_ = std::thread([s = store.get()] { s->SpillLoop(); });
  return store;
}

TierStore::~TierStore() {
  {
    std::lock_guard<std::mutex> g(work_mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  spill_cv_.notify_all();
  if (spill_thread_.joinable()) spill_thread_.join();
  for (Worker& w : workers_) {
    if (w.thread.joinable()) w.thread.join();
  }
}

bool TierStore::Mine(const Block& b) const {
  if (cache::WriterNode(b.writer) != node_) return false;
  const uint32_t dev = cache::LocationDevice(b.location);
  if (dev >= devices_.size() || EntryTierOf(devices_[dev]->kind()) != b.tier) return false;
  if (cache::LocationSlot(b.location) >= devices_[dev]->slot_count()) return false;
  // A node-DRAM block lives in the memory of the process that wrote it: this one, or nobody.
  return b.tier == cache::kTierSsd || b.writer == index_.WriterOfThisProcess();
}

// ---- the device workers ----

void TierStore::RunOnDevices(std::vector<std::function<void()>>& jobs) {
  std::unique_lock<std::mutex> g(work_mu_);
  for (size_t i = 0; i < jobs.size() && i < workers_.size(); ++i) {
    if (!jobs[i]) continue;
    workers_[i].job = std::move(jobs[i]);
    ++pending_;
  }
  work_cv_.notify_all();
  done_cv_.wait(g, [&] { return pending_ == 0; });
}

void TierStore::WorkerLoop(size_t device) {
  std::unique_lock<std::mutex> g(work_mu_);
  for (;;) {
    work_cv_.wait(g, [&] { return stop_ || workers_[device].job; });
    if (stop_ && !workers_[device].job) return;
    std::function<void()> job = std::move(workers_[device].job);
    workers_[device].job = nullptr;
    g.unlock();
    job();
    g.lock();
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

// ---- spill ----

Result<std::vector<uint64_t>> TierStore::TakeSlots(Device& device, size_t n) {
  auto slots = device.AllocateSlots(n);
  if (slots.ok() || slots.status().code() != StatusCode::kNoSpace) return slots;
  // Full: drop this device's least recently used blocks (the paper's pool evicts per device too).
  const uint64_t need = n - std::min<uint64_t>(n, device.free_slots());
  std::vector<Block> victims;
  for (const Block& b : index_.CapacityEntriesOf(node_)) {
    if (victims.size() == need) break;
    if (Mine(b) && cache::LocationDevice(b.location) == device.index()) victims.push_back(b);
  }
  index_.DropCapacity(victims);
  // Dropped now, or gone before (another process evicted it): either way no entry names the
  // slot, and only this store moves entries onto its devices.
  std::vector<uint64_t> freed;
  for (const Block& b : victims) freed.push_back(cache::LocationSlot(b.location));
  (void)device.FreeSlots(freed);
  dropped_full_.fetch_add(victims.size(), std::memory_order_relaxed);
  return device.AllocateSlots(n);
}

std::vector<PlacementRun> TierStore::SpreadOverflow(std::vector<PlacementRun> runs) const {
  // A device's share beyond its free slots goes to devices with free slots, fastest first; only
  // when every device is full does a device drop its own LRU blocks (TakeSlots).
  std::vector<uint64_t> counts(devices_.size(), 0), room(devices_.size(), 0);
  uint64_t overflow = 0;
  for (const PlacementRun& r : runs) counts[r.device] += r.count;
  for (size_t d = 0; d < devices_.size(); ++d) {
    room[d] = devices_[d]->free_slots();
    if (counts[d] > room[d]) {
      overflow += counts[d] - room[d];
      counts[d] = room[d];
    }
  }
  if (overflow == 0) return runs;
  std::vector<size_t> order(devices_.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return devices_[a]->bandwidth() > devices_[b]->bandwidth(); });
  for (size_t d : order) {
    const uint64_t take = std::min(overflow, room[d] - counts[d]);
    counts[d] += take;
    overflow -= take;
  }
  // Still some: all full. They stay with the fastest device, which makes room.
  counts[order.front()] += overflow;
  std::vector<PlacementRun> out;
  uint64_t next = 0;
  for (size_t d = 0; d < counts.size(); ++d) {
    if (counts[d] == 0) continue;
    out.push_back({static_cast<uint32_t>(d), next, counts[d]});
    next += counts[d];
  }
  return out;
}

Result<uint64_t> TierStore::Spill(uint64_t bytes) {
  std::lock_guard<std::mutex> g(move_mu_);
  MoveScope scope(this);
  return SpillLocked(bytes);
}

Result<uint64_t> TierStore::SpillLocked(uint64_t bytes) {
  const uint64_t max_block = devices_.front()->payload_capacity();
  std::vector<Block> cands = index_.SpillCandidates(bytes, options_.spill_batch, max_block);
  if (cands.empty()) return uint64_t{0};
  // Algorithm 1's split, with each device's unspent share carried to the next batch (a spill
  // that keeps up moves a few blocks at a time: placement.h).
  CXLKV_ASSIGN_OR_RETURN(std::vector<PlacementRun> runs, placement_->Next(cands.size()));
  runs = SpreadOverflow(std::move(runs));

  // Per device: its items (slot, tag, the region bytes as one piece) and which block each is.
  struct Planned {
    size_t block;
    uint64_t slot;
  };
  std::vector<std::vector<Planned>> planned(devices_.size());
  std::vector<std::vector<std::span<const std::byte>>> pieces(cands.size());
  std::vector<std::vector<WriteItem>> items(devices_.size());
  for (const PlacementRun& run : runs) {
    Device& dev = *devices_[run.device];
    auto slots = TakeSlots(dev, run.count);
    if (!slots.ok()) {
      spill_failed_.fetch_add(run.count, std::memory_order_relaxed);
      continue;
    }
    for (uint64_t k = 0; k < run.count; ++k) {
      const size_t b = run.first + k;
      const Block& blk = cands[b];
      const uint8_t* src = index_.Payload(blk.location, blk.bytes);
      if (src == nullptr) {  // not a pool object any more (the entry changed): not moved
        (void)dev.FreeSlots(std::span<const uint64_t>(&(*slots)[k], 1));
        continue;
      }
      // P2: the block may have been written by another host: drop stale lines before reading.
      index_.InvalidateForRead(src, blk.bytes, /*fence=*/true);
      pieces[b] = {std::span<const std::byte>(reinterpret_cast<const std::byte*>(src), blk.bytes)};
      planned[run.device].push_back({b, (*slots)[k]});
      // The tag carries the generation the entry will have once moved (READY at gen + 1).
      items[run.device].push_back({(*slots)[k], SlotTag{blk.key, blk.ns, blk.gen + 1}, pieces[b]});
    }
  }
  std::vector<std::vector<Status>> written(devices_.size());
  std::vector<std::function<void()>> jobs(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) {
    if (items[d].empty()) continue;
    jobs[d] = [&, d] { written[d] = devices_[d]->Write(items[d]); };
  }
  RunOnDevices(jobs);

  std::vector<cache::Index::TierMove> moves;
  std::vector<std::pair<uint32_t, uint64_t>> move_slots;  // (device, slot) per move
  for (size_t d = 0; d < devices_.size(); ++d) {
    std::vector<uint64_t> failed;
    for (size_t k = 0; k < planned[d].size(); ++k) {
      const Planned& p = planned[d][k];
      if (k >= written[d].size() || !written[d][k].ok()) {
        failed.push_back(p.slot);
        continue;
      }
      moves.push_back({cands[p.block], EntryTierOf(devices_[d]->kind()), cache::TierLocation(static_cast<uint32_t>(d), p.slot)});
      move_slots.push_back({static_cast<uint32_t>(d), p.slot});
    }
    if (!failed.empty()) {
      spill_failed_.fetch_add(failed.size(), std::memory_order_relaxed);
      (void)devices_[d]->FreeSlots(failed);
    }
  }
  index_.MoveMany(moves);
  uint64_t moved = 0;
  for (size_t i = 0; i < moves.size(); ++i) {
    if (moves[i].moved) {
      ++moved;
    } else {  // pinned or changed meanwhile: the block stays in the region; the copy goes
      (void)devices_[move_slots[i].first]->FreeSlots(std::span<const uint64_t>(&move_slots[i].second, 1));
    }
  }
  spilled_.fetch_add(moved, std::memory_order_relaxed);
  return moved;
}

uint64_t TierStore::EffectiveCapacity() {
  // The budget is the data areas' bytes, but a region fills before that: heap-chunk headers, size
  // classes, leases and other objects (RPC areas) take their share. Evictions (a writer's
  // reserve dropping blocks for want of space) show where the region really fills: the
  // watermarks then apply to that level, and it creeps back towards the budget while no
  // eviction comes (space may have been freed for good).
  const uint64_t budget = index_.capacity_bytes();
  const uint64_t evictions = index_.SumCounter(cache::kEvictions);
  const uint64_t used = index_.UsedBytes();
  std::lock_guard<std::mutex> g(cap_mu_);
  if (effective_cap_ == 0) effective_cap_ = budget;
  if (evictions != seen_evictions_ && seen_evictions_ != ~0ull && used < effective_cap_) {
    effective_cap_ = std::max<uint64_t>(used, budget / 4);
  } else if (effective_cap_ < budget) {
    effective_cap_ = std::min(budget, effective_cap_ + budget / 1000);
  }
  seen_evictions_ = evictions;
  return effective_cap_;
}

Result<uint64_t> TierStore::SpillToWatermark() {
  const uint64_t cap = EffectiveCapacity();
  const uint64_t start = cap / 100 * options_.spill_start_pct;
  const uint64_t target = cap / 100 * options_.spill_target_pct;
  uint64_t total = 0;
  for (int round = 0; round < 64; ++round) {
    const uint64_t used = index_.UsedBytes();
    if (round == 0 ? used <= start : used <= target) break;
    CXLKV_ASSIGN_OR_RETURN(uint64_t moved, Spill(used - target));
    if (moved == 0) break;
    total += moved;
  }
  return total;
}

void TierStore::SpillLoop() {
  auto next_reconcile = std::chrono::steady_clock::now() + options_.reconcile_every;
  std::unique_lock<std::mutex> g(work_mu_);
  while (!stop_) {
    // Idle, this costs one read of each node's counter line per poll.
    spill_cv_.wait_for(g, options_.spill_poll, [&] { return stop_; });
    if (stop_) return;
    g.unlock();
    auto spilled = SpillToWatermark();
    if (!spilled.ok()) std::fprintf(stderr, "cxlkv: tier: spill: %s\n", spilled.status().ToString().c_str());
    if (std::chrono::steady_clock::now() >= next_reconcile) {
      Reconcile();
      PublishStatus();
      next_reconcile = std::chrono::steady_clock::now() + options_.reconcile_every;
    }
    g.lock();
  }
}

// ---- promote ----

PromoteResult TierStore::Promote(std::span<const BlockKey> keys) {
  PromoteResult out;
  std::lock_guard<std::mutex> g(move_mu_);
  MoveScope scope(this);  // its reserves of region space spill directly, not through the service
  std::vector<Block> found = index_.FindCapacity(keys);
  out.not_mine = keys.size() - found.size();
  std::vector<Block> blocks;
  uint64_t need = 0;
  for (const Block& b : found) {
    if (Mine(b)) {
      blocks.push_back(b);
      need += b.bytes;
    } else {
      ++out.not_mine;
    }
  }
  if (blocks.empty()) return out;
  // Room first, by spilling others (a reserve at the high watermark would drop them instead).
  const uint64_t cap = EffectiveCapacity();
  const uint64_t used = index_.UsedBytes();
  if (used + need > cap / 100 * options_.spill_start_pct) {
    (void)SpillLocked(used + need - std::min(used + need, cap / 100 * options_.spill_target_pct));
  }
  struct Pending {
    size_t block;
    uint64_t payload;
  };
  std::vector<std::vector<Pending>> pending(devices_.size());
  std::vector<std::vector<ReadItem>> items(devices_.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = blocks[i];
    auto payload = index_.AllocateRegionPayload(b.bytes);
    if (!payload.ok()) {
      out.missed += blocks.size() - i;  // the region is full of pinned blocks: the rest stay out
      break;
    }
    const uint32_t d = cache::LocationDevice(b.location);
    uint8_t* dst = index_.Payload(*payload, b.bytes);
    pending[d].push_back({i, *payload});
    ReadItem item;
    item.slot = cache::LocationSlot(b.location);
    item.expect = SlotTag{b.key, b.ns, b.gen};
    item.dst = std::span<std::byte>(reinterpret_cast<std::byte*>(dst), b.bytes);
    item.dst_shared = true;
    items[d].push_back(item);
  }
  std::vector<std::vector<Status>> read(devices_.size());
  std::vector<std::function<void()>> jobs(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) {
    if (!items[d].empty()) jobs[d] = [&, d] { read[d] = devices_[d]->Read(items[d]); };
  }
  RunOnDevices(jobs);  // retrieval grouped per device, in parallel: the devices finish together

  std::vector<cache::Index::TierMove> moves;
  std::vector<uint64_t> move_payload;
  std::vector<Block> invalid;
  for (size_t d = 0; d < devices_.size(); ++d) {
    for (size_t k = 0; k < pending[d].size(); ++k) {
      const Pending& p = pending[d][k];
      const Block& b = blocks[p.block];
      const bool ok = k < read[d].size() && read[d][k].ok() && items[d][k].payload_bytes == b.bytes;
      if (!ok) {
        index_.FreeRegionPayload(p.payload);
        ++out.missed;
        // Empty, corrupt, torn or reused: those bytes are gone; never served. An I/O error
        // leaves the entry for another try.
        if (k < read[d].size() && (read[d][k].ok() || IsMiss(read[d][k]))) invalid.push_back(b);
        continue;
      }
      moves.push_back({b, cache::kTierRegion, p.payload});
      move_payload.push_back(p.payload);
    }
  }
  index_.MoveMany(moves);
  for (size_t i = 0; i < moves.size(); ++i) {
    const uint64_t loc = moves[i].from.location;
    if (moves[i].moved) {
      ++out.promoted;
      (void)devices_[cache::LocationDevice(loc)]->FreeSlots(std::vector<uint64_t>{cache::LocationSlot(loc)});
    } else {
      index_.FreeRegionPayload(move_payload[i]);
      ++out.missed;
    }
  }
  if (!invalid.empty()) {
    index_.DropCapacity(invalid);
    for (const Block& b : invalid) {
      (void)devices_[cache::LocationDevice(b.location)]->FreeSlots(std::vector<uint64_t>{cache::LocationSlot(b.location)});
    }
    dropped_lost_.fetch_add(invalid.size(), std::memory_order_relaxed);
  }
  promoted_.fetch_add(out.promoted, std::memory_order_relaxed);
  promote_missed_.fetch_add(out.missed, std::memory_order_relaxed);
  return out;
}

// ---- adoption and reconciliation ----

uint64_t TierStore::Reconcile() {
  std::lock_guard<std::mutex> g(move_mu_);
  return ReconcileLocked(/*adopt=*/false);
}

uint64_t TierStore::ReconcileLocked(bool adopt) {
  std::vector<std::vector<bool>> named(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) named[d].assign(devices_[d]->slot_count(), false);
  std::vector<Block> lost;
  for (const Block& b : index_.CapacityEntriesOf(node_)) {
    const uint32_t d = cache::LocationDevice(b.location);
    const uint64_t slot = cache::LocationSlot(b.location);
    // Not on a device of this store (another configuration, an earlier process's DRAM), or a
    // slot named twice: nobody can serve it.
    if (!Mine(b) || named[d][slot]) {
      lost.push_back(b);
      continue;
    }
    named[d][slot] = true;
  }
  const uint64_t dropped = index_.DropCapacity(lost);
  dropped_lost_.fetch_add(dropped, std::memory_order_relaxed);
  for (size_t d = 0; d < devices_.size(); ++d) {
    Device& dev = *devices_[d];
    if (adopt) {
      adopted_.fetch_add(std::count(named[d].begin(), named[d].end(), true), std::memory_order_relaxed);
      (void)dev.ResetUsedSlots(named[d]);
      continue;
    }
    // Slots whose entry is gone (evicted by another process, or dropped by a full stripe).
    std::vector<uint64_t> orphans;
    for (uint64_t s = 0; s < dev.slot_count(); ++s) {
      if (!named[d][s] && dev.SlotAllocated(s)) orphans.push_back(s);
    }
    if (!orphans.empty()) {
      (void)dev.FreeSlots(orphans);
      freed_orphans_.fetch_add(orphans.size(), std::memory_order_relaxed);
    }
  }
  return dropped;
}

void TierStore::PublishStatus() {
  nlohmann::json doc = Stats();
  doc["node"] = node_;
  if (Status s = pool::PublishStatus(pool_, "tier-" + std::to_string(node_), doc); !s.ok()) {
    std::fprintf(stderr, "cxlkv: tier: publishing node %u's tier status for 'cxlkv stat': %s\n", node_,
                 s.ToString().c_str());
  }
}

nlohmann::json TierStore::Stats() const {
  nlohmann::json j;
  j["devices"] = nlohmann::json::array();
  for (const auto& d : devices_) {
    const DeviceStats s = d->stats();
    j["devices"].push_back({{"index", d->index()},
                            {"kind", std::string(TierKindName(d->kind()))},
                            {"describe", d->Describe()},
                            {"slot_bytes", d->slot_bytes()},
                            {"slots", d->slot_count()},
                            {"used_slots", d->slot_count() - d->free_slots()},
                            {"bandwidth_bytes_per_s", d->bandwidth()},
                            {"writes", s.writes},
                            {"reads", s.reads},
                            {"write_errors", s.write_errors},
                            {"read_errors", s.read_errors},
                            {"miss_empty", s.miss_empty},
                            {"miss_corrupt", s.miss_corrupt},
                            {"miss_stale", s.miss_stale}});
  }
  j["spilled"] = spilled_.load();
  j["spill_failed"] = spill_failed_.load();
  j["promoted"] = promoted_.load();
  j["promote_missed"] = promote_missed_.load();
  j["dropped_full"] = dropped_full_.load();
  j["dropped_lost"] = dropped_lost_.load();
  j["freed_orphan_slots"] = freed_orphans_.load();
  j["adopted"] = adopted_.load();
  j["spill_start_pct"] = options_.spill_start_pct;
  j["spill_target_pct"] = options_.spill_target_pct;
  return j;
}

}  // namespace cxlkv::tier
