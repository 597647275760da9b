// TierStore's moves: spill (region → devices) and promote (devices → region), and the room a
// reserve asks for (tier_store.h; docs/tiers.md, "Spill" and "Promote on hit").
#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include <xxhash.h>

#include "pool/pool_internal.h"
#include "tier/tier_store.h"

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

}  // namespace

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

// ---- spill ----

Result<std::vector<uint64_t>> TierStore::TakeSlots(Device& device, std::span<const uint64_t> payload_bytes) {
  auto slots = device.AllocateSlots(payload_bytes);
  if (slots.ok() || slots.status().code() != StatusCode::kNoSpace) return slots;
  // Full: drop this device's least recently used blocks (the paper's pool evicts per device too),
  // by the space these slots need: blocks of the sizes asked first (each frees exactly a slot
  // one of them takes), then any, until the free space covers what is asked. A free space in
  // pieces too small may still refuse: one more round drops a batch's worth more.
  std::map<uint64_t, uint64_t> sizes;  // payload bytes -> how many asked
  uint64_t asked = 0;
  for (uint64_t n : payload_bytes) {
    ++sizes[n];
    asked += device.GranulesFor(n) * device.granule_bytes();
  }
  for (int round = 0; round < 2; ++round) {
    const uint64_t free = device.free_bytes();
    // Short of space: what is missing; enough in all but in pieces too small: a whole batch's.
    uint64_t need = round == 0 && asked > free ? asked - free : asked;
    std::map<uint64_t, uint64_t> same = sizes;
    std::vector<Block> victims;
    std::vector<Block> others;
    for (const Block& b : index_.CapacityEntriesOf(node_)) {
      if (!Mine(b) || cache::LocationDevice(b.location) != device.index() || promoting_.contains(b.location)) continue;
      if (auto it = same.find(b.bytes); it != same.end() && it->second > 0 && need > 0) {
        --it->second;
        victims.push_back(b);
        const uint64_t freed = device.GranulesFor(b.bytes) * device.granule_bytes();
        need -= std::min(need, freed);
      } else {
        others.push_back(b);
      }
    }
    for (const Block& b : others) {  // still short: the oldest of other sizes
      if (need == 0) break;
      victims.push_back(b);
      need -= std::min(need, device.GranulesFor(b.bytes) * device.granule_bytes());
    }
    if (victims.empty()) break;
    // Only the slots of entries this drop removed are surely named by nothing: one an evictor
    // is just putting back to READY (EVICTING now) still names its slot; reconcile frees the
    // rest once their entries are gone.
    std::vector<bool> dropped;
    index_.DropCapacity(victims, &dropped);
    std::vector<uint64_t> freed;
    for (size_t i = 0; i < victims.size(); ++i) {
      if (dropped[i]) freed.push_back(cache::LocationSlot(victims[i].location));
    }
    FreeSlots(device.index(), freed);
    dropped_full_.fetch_add(freed.size(), std::memory_order_relaxed);
    slots = device.AllocateSlots(payload_bytes);
    if (slots.ok() || slots.status().code() != StatusCode::kNoSpace) return slots;
  }
  return slots;
}

std::vector<PlacementRun> TierStore::SpreadOverflow(std::vector<PlacementRun> runs, uint64_t mean_slot_bytes) const {
  // A device's share beyond its free space goes to devices with free space, fastest first; only
  // when every device is full does a device drop its own LRU blocks (TakeSlots). Room is counted
  // in blocks of the batch's mean slot.
  std::vector<uint64_t> counts(devices_.size(), 0), room(devices_.size(), 0);
  uint64_t overflow = 0;
  for (const PlacementRun& r : runs) counts[r.device] += r.count;
  for (size_t d = 0; d < devices_.size(); ++d) {
    room[d] = devices_[d]->free_bytes() / std::max<uint64_t>(1, mean_slot_bytes);
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
  uint64_t batch_bytes = 0;
  for (const Block& b : cands) batch_bytes += b.bytes + kSlotHeaderBytes;
  runs = SpreadOverflow(std::move(runs), batch_bytes / cands.size());

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
    std::vector<uint64_t> sizes(run.count);
    for (uint64_t k = 0; k < run.count; ++k) sizes[k] = cands[run.first + k].bytes;
    auto slots = TakeSlots(dev, sizes);
    if (!slots.ok()) {
      spill_failed_.fetch_add(run.count, std::memory_order_relaxed);
      continue;
    }
    for (uint64_t k = 0; k < run.count; ++k) {
      const size_t b = run.first + k;
      const Block& blk = cands[b];
      const uint8_t* src = index_.Payload(blk.location, blk.bytes);
      uint64_t fingerprint = 0;
      // Not a pool object any more (the entry changed), or a namespace slot that does not check
      // out: not moved.
      if (src == nullptr || !FingerprintLocked(blk.ns, &fingerprint)) {
        FreeSlots(run.device, std::span<const uint64_t>(&(*slots)[k], 1));
        continue;
      }
      // P2: the block may have been written by another host: drop stale lines before reading.
      index_.InvalidateForRead(src, blk.bytes, /*fence=*/true);
      pieces[b] = {std::span<const std::byte>(reinterpret_cast<const std::byte*>(src), blk.bytes)};
      planned[run.device].push_back({b, (*slots)[k]});
      // The tag carries the generation the entry will have once moved (READY at gen + 1).
      items[run.device].push_back({(*slots)[k], SlotTag{blk.key, fingerprint, blk.gen + 1}, pieces[b]});
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
    std::vector<size_t> ok;
    std::vector<CatalogEntry> records;
    for (size_t k = 0; k < planned[d].size(); ++k) {
      const Planned& p = planned[d][k];
      if (k >= written[d].size() || !written[d][k].ok()) {
        failed.push_back(p.slot);
        continue;
      }
      const Block& blk = cands[p.block];
      ok.push_back(k);
      records.push_back({p.slot, blk.key, fingerprints_.at(blk.ns), blk.gen + 1, blk.bytes,
                         static_cast<uint16_t>(devices_[d]->kind()), 0});
    }
    // Durable first (the log's fdatasync also flushes the drive's write cache), then named; the
    // namespaces before the blocks, so a new region can always register what the catalog names.
    Status s = RecordNamespacesLocked(static_cast<uint32_t>(d), records);
    if (s.ok()) s = RecordPuts(static_cast<uint32_t>(d), records);
    if (!s.ok()) {
      std::fprintf(stderr, "cxlkv: tier: %s: recording %zu spilled block(s): %s (they stay in the region)\n",
                   devices_[d]->Describe().c_str(), records.size(), s.ToString().c_str());
      for (size_t k : ok) failed.push_back(planned[d][k].slot);
      ok.clear();
    }
    for (size_t k : ok) {
      const Planned& p = planned[d][k];
      moves.push_back({cands[p.block], EntryTierOf(devices_[d]->kind()), cache::TierLocation(static_cast<uint32_t>(d), p.slot)});
      move_slots.push_back({static_cast<uint32_t>(d), p.slot});
    }
    if (!failed.empty()) {
      spill_failed_.fetch_add(failed.size(), std::memory_order_relaxed);
      FreeSlots(static_cast<uint32_t>(d), failed);
    }
  }
  index_.MoveMany(moves);
  uint64_t moved = 0;
  for (size_t i = 0; i < moves.size(); ++i) {
    if (moves[i].moved) {
      ++moved;
    } else {  // pinned or changed meanwhile: the block stays in the region; the copy goes
      FreeSlots(move_slots[i].first, std::span<const uint64_t>(&move_slots[i].second, 1));
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
  // The spills this promote may make for room (below, and in its reserves) must not drop the
  // blocks it is bringing in: their slots would be reused under the reads.
  promoting_.clear();
  for (const Block& b : blocks) promoting_.insert(b.location);
  struct ClearPromoting {
    std::set<uint64_t>& set;
    ~ClearPromoting() { set.clear(); }
  } clear_promoting{promoting_};
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
    // The room made by spilling other nodes' blocks is freed remotely: it becomes free space
    // once their owners drain their remote-free rings (8 times a beat). Poll for it, briefly.
    const auto give_up = std::chrono::steady_clock::now() + pool_.impl().node->lease() / 2;
    for (auto step = std::chrono::microseconds(500);
         !payload.ok() && payload.status().code() == StatusCode::kNoSpace && std::chrono::steady_clock::now() < give_up;
         step = std::min(step * 2, std::chrono::microseconds(8000))) {
      std::this_thread::sleep_for(step);
      payload = index_.AllocateRegionPayload(b.bytes);
    }
    if (!payload.ok()) {
      out.missed += blocks.size() - i;  // the region is full of pinned blocks: the rest stay out
      break;
    }
    const uint32_t d = cache::LocationDevice(b.location);
    uint64_t fingerprint = 0;
    if (!FingerprintLocked(b.ns, &fingerprint)) {  // its namespace slot does not check out
      index_.FreeRegionPayload(*payload);
      ++out.missed;
      continue;
    }
    uint8_t* dst = index_.Payload(*payload, b.bytes);
    pending[d].push_back({i, *payload});
    ReadItem item;
    item.slot = cache::LocationSlot(b.location);
    item.expect = SlotTag{b.key, fingerprint, b.gen};
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
      cache::Index::TierMove move{b, cache::kTierRegion, p.payload};
      if (index_.checksums() && b.checksum == 0) {
        // Named again after a warm restart (tier_restore.cc): the catalog does not keep the
        // pool's xxh3, so it is computed from the bytes just verified by their CRC-32C.
        move.set_checksum = true;
        move.checksum = XXH3_64bits(items[d][k].dst.data(), b.bytes);
      }
      moves.push_back(move);
      move_payload.push_back(p.payload);
    }
  }
  index_.MoveMany(moves);
  for (size_t i = 0; i < moves.size(); ++i) {
    const uint64_t loc = moves[i].from.location;
    if (moves[i].moved) {
      ++out.promoted;
      FreeSlots(cache::LocationDevice(loc), std::vector<uint64_t>{cache::LocationSlot(loc)});
    } else {
      index_.FreeRegionPayload(move_payload[i]);
      ++out.missed;
    }
  }
  DropInvalidLocked(invalid);
  promoted_.fetch_add(out.promoted, std::memory_order_relaxed);
  promote_missed_.fetch_add(out.missed, std::memory_order_relaxed);
  return out;
}

void TierStore::DropInvalidLocked(std::span<const Block> invalid) {
  if (invalid.empty()) return;
  // Only a slot whose entry this drop removed is surely named by nothing (the entry may have
  // moved since the lock-free look): the others are left to the entry, or to reconcile.
  std::vector<bool> dropped;
  index_.DropCapacity(invalid, &dropped);
  for (size_t i = 0; i < invalid.size(); ++i) {
    if (!dropped[i]) continue;
    FreeSlots(cache::LocationDevice(invalid[i].location), std::vector<uint64_t>{cache::LocationSlot(invalid[i].location)});
    dropped_lost_.fetch_add(1, std::memory_order_relaxed);
  }
}

std::vector<uint32_t> TierStore::ReadOut(std::span<const BlockKey> keys, std::span<const uint64_t> staging,
                                         uint64_t capacity) {
  std::vector<uint32_t> out(keys.size(), 0);
  if (staging.size() != keys.size()) return out;
  // Under the move lock: no spill, promote or drop frees a slot while it is being read.
  std::lock_guard<std::mutex> g(move_mu_);
  alloc::Allocator& allocator = *pool_.impl().allocator;
  std::vector<std::vector<size_t>> which(devices_.size());  // key index per item
  std::vector<std::vector<ReadItem>> items(devices_.size());
  std::vector<std::vector<Block>> blocks(devices_.size());
  size_t at_key = 0;
  for (const Block& b : index_.FindCapacity(keys)) {  // in key order
    while (at_key < keys.size() && !(keys[at_key] == b.key)) ++at_key;
    if (at_key == keys.size()) break;
    const size_t i = at_key++;
    if (!Mine(b) || b.bytes > capacity || !allocator.Contains(alloc::ObjectOffset(staging[i]), b.bytes)) continue;
    const uint32_t d = cache::LocationDevice(b.location);
    uint64_t fingerprint = 0;
    if (!FingerprintLocked(b.ns, &fingerprint)) continue;
    ReadItem item;
    item.slot = cache::LocationSlot(b.location);
    item.expect = SlotTag{b.key, fingerprint, b.gen};
    item.dst = std::span<std::byte>(reinterpret_cast<std::byte*>(index_.Payload(staging[i], b.bytes)), b.bytes);
    item.dst_shared = true;  // non-temporal stores: the reader, on another host, invalidates and reads
    which[d].push_back(i);
    items[d].push_back(item);
    blocks[d].push_back(b);
  }
  std::vector<std::vector<Status>> read(devices_.size());
  std::vector<std::function<void()>> jobs(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) {
    if (!items[d].empty()) jobs[d] = [&, d] { read[d] = devices_[d]->Read(items[d]); };
  }
  RunOnDevices(jobs);  // per device, in parallel
  std::vector<Block> invalid;
  uint64_t done = 0;
  for (size_t d = 0; d < devices_.size(); ++d) {
    for (size_t k = 0; k < items[d].size(); ++k) {
      const bool ok = k < read[d].size() && read[d][k].ok() && items[d][k].payload_bytes == blocks[d][k].bytes;
      if (ok) {
        out[which[d][k]] = items[d][k].payload_bytes;
        ++done;
      } else if (k < read[d].size() && (read[d][k].ok() || IsMiss(read[d][k]))) {
        invalid.push_back(blocks[d][k]);  // never served: its entry goes
      }
    }
  }
  DropInvalidLocked(invalid);
  read_out_.fetch_add(done, std::memory_order_relaxed);
  read_out_missed_.fetch_add(keys.size() - done, std::memory_order_relaxed);
  return out;
}


}  // namespace cxlkv::tier
