// Index: eviction (LRU over every node's access stamps), tombstones, repair and recovery.
#include <algorithm>
#include <cstdio>
#include <map>
#include <thread>

#include "cache/index.h"

namespace cxlkv::cache {

namespace {
// Entries and access stamps are scanned in batches: one invalidate + read per batch.
constexpr uint64_t kScanBatch = 1024;
}  // namespace

template <typename Fn>
void Index::ScanEntries(Fn fn) {
  const uint64_t entries = layout_.entries();
  std::vector<Entry> batch(kScanBatch);
  for (uint64_t first = 0; first < entries; first += kScanBatch) {
    uint64_t n = std::min(kScanBatch, entries - first);
    if (!CacheIsTable()) meta_.Invalidate(layout_.entry(first), n * sizeof(Entry));
    meta_.Read(layout_.entry(first), batch.data(), n * sizeof(Entry));
    for (uint64_t i = 0; i < n; ++i) fn(first + i, batch[i]);
  }
}

template <typename Fn>
void Index::ScanStampRow(uint32_t node, Fn fn) {
  const uint64_t entries = layout_.entries();
  std::vector<uint64_t> stamps(kScanBatch);
  for (uint64_t first = 0; first < entries; first += kScanBatch) {
    uint64_t n = std::min(kScanBatch, entries - first);
    if (!CacheIsTable()) meta_.Invalidate(layout_.stamp(node, first), n * 8);
    meta_.Read(layout_.stamp(node, first), stamps.data(), n * 8);
    for (uint64_t i = 0; i < n; ++i) fn(first + i, stamps[i]);
  }
}

void Index::TombstoneLocked(uint64_t slot, uint64_t gen) {
  meta_.Publish(layout_.entry(slot), StateWord(gen, kTombstone));
  // A run of tombstones that ends at an EMPTY slot is on no live entry's probe path (every
  // path from a home slot to its entry crosses no EMPTY): turn it back to EMPTY.
  const uint32_t n = layout_.h.slots_per_stripe;
  const uint64_t stripe = slot / n;
  uint64_t i = slot % n;
  if (StateOf(FetchTableWord(layout_.entry(SlotAt(stripe, (i + 1) % n)))) != kEmpty) return;
  for (uint32_t k = 0; k < n; ++k) {
    uint64_t s = SlotAt(stripe, i);
    uint64_t w = FetchTableWord(layout_.entry(s));
    if (StateOf(w) != kTombstone) break;
    meta_.Publish(layout_.entry(s), StateWord(GenOf(w), kEmpty));  // keeps the generation
    i = (i + n - 1) % n;
  }
}

bool Index::TryEvictLocked(uint64_t slot, uint64_t gen) {
  const std::pair<uint64_t, uint64_t> one[] = {{slot, gen}};
  uint64_t evicted = 0;
  TryEvictManyLocked(one, &evicted);
  return evicted == 1;
}

uint64_t Index::TryEvictManyLocked(std::span<const std::pair<uint64_t, uint64_t>> slot_gens, uint64_t* evicted) {
  // Mark all, then read the pin tables once. EVICTING is flushed before the read: a pinner whose
  // pin we do not see then sees EVICTING and backs off (docs/protocol.md, "Pins").
  struct Marked {
    uint64_t slot, gen;
    Entry e;
  };
  std::vector<Marked> marked;
  marked.reserve(slot_gens.size());
  for (auto [slot, gen] : slot_gens) {
    const Entry e = ReadEntry(slot);
    if (e.state != StateWord(gen, kReady)) continue;
    meta_.Publish(layout_.entry(slot), StateWord(gen, kEvicting));
    marked.push_back({slot, gen, e});
  }
  if (marked.empty()) return 0;
  MaybeCrash(CrashPoint::kEvictAfterMark);
  const std::vector<uint64_t> pinned = PinnedFingerprints();
  uint64_t freed = 0;
  for (const Marked& m : marked) {
    if (Pinned(pinned, m.e.key_lo, m.e.key_hi)) {
      meta_.Publish(layout_.entry(m.slot), StateWord(m.gen, kReady));
      continue;
    }
    freed += FinishEvictLocked(m.slot, m.gen, m.e);
    if (evicted != nullptr) ++*evicted;
  }
  return freed;
}

uint64_t Index::FinishEvictLocked(uint64_t slot, uint64_t gen, const Entry& e) {
  if (e.tier != kTierRegion) {
    // A capacity entry holds no region space: it goes, and its device slot is the owner's to
    // reclaim (the owner's cxlkvd reconciles its slots with the entries that name them).
    TombstoneLocked(slot, gen);
    Add(kEvictions, 1);
    Add(kTierDrops, 1);
    return 0;
  }
  // Free while the entry still names the payload (EVICTING counts as reachable for the
  // allocator's recovery, so that recovery cannot free it too), then tombstone. A crash in
  // between leaves EVICTING, which repair tombstones without freeing again. In central mode too:
  // the allocator frees an ended life's object in place, under the lock its recovery holds.
  FreePayloadNow(e.payload);
  TombstoneLocked(slot, gen);
  Add(kEvictions, 1);
  Add(kEvictedBytes, e.bytes);
  Add(kBytesReleased, e.bytes);
  return e.bytes;
}

uint64_t Index::RepairStripeLocked(uint32_t stripe, const DeadWriter* dead, std::vector<uint64_t>* dead_payloads) {
  uint64_t repaired = 0;
  for (uint32_t i = 0; i < layout_.h.slots_per_stripe; ++i) {
    const uint64_t slot = SlotAt(stripe, i);
    Entry e = ReadEntry(slot);
    EntryState s = StateOf(e.state);
    bool leftover_eviction = s == kEvicting;  // only a dead lock holder leaves one
    bool dead_writer = s == kWriting && dead != nullptr && dead->Matches(e.writer);
    // A block in a dead process's node-DRAM tier died with it; one on its SSD tier lives on
    // (the node's next cxlkvd adopts it, docs/tiers.md).
    bool dead_dram = s == kReady && e.tier == kTierMem && dead != nullptr && dead->Matches(e.writer);
    if (dead_dram) {
      TombstoneLocked(slot, GenOf(e.state));
      Add(kTierDrops, 1);
      ++repaired;
      continue;
    }
    if (!leftover_eviction && !dead_writer) continue;
    if (leftover_eviction && e.tier != kTierRegion) {
      // A move cut short after it wrote the capacity location: the region payload, if it had
      // one, was freed before; the device slot is the owner's to reconcile.
      TombstoneLocked(slot, GenOf(e.state));
      ++repaired;
      continue;
    }
    // The dead writer's payload is unreachable: the allocator's recovery of its life frees it,
    // or, for one dead process of a live node, the caller.
    TombstoneLocked(slot, GenOf(e.state));
    if (dead_writer && dead_payloads != nullptr) dead_payloads->push_back(e.payload);
    Add(kBytesReleased, e.bytes);
    ++repaired;
    // A leftover eviction may or may not have freed its payload. While the payload's owner
    // lives, the owner's recovery frees it if it is still allocated (the entry is gone now).
    // If that recovery ran first, it kept the payload, which the entry still reached, in an
    // orphan chunk: only the allocator can tell whether it is garbage now, and free it.
    if (leftover_eviction) {
      auto reclaimed = allocator_.ReclaimIfUnreachable(alloc::ObjectOffset(e.payload));
      if (!reclaimed.ok()) {
        std::fprintf(stderr, "cxlkv: cache: the payload %#llx of an eviction cut short: %s\n",
                     static_cast<unsigned long long>(e.payload), reclaimed.status().ToString().c_str());
      }
    }
  }
  if (repaired) Add(kReclaimed, repaired);
  return repaired;
}

std::vector<Index::TierBlock> Index::LruReady(const std::function<bool(const Entry&)>& want, bool skip_pinned,
                                              bool with_evicting) {
  std::vector<TierBlock> cands;
  std::vector<uint64_t> slot_to_cand(layout_.entries(), UINT64_MAX);
  ScanEntries([&](uint64_t slot, const Entry& e) {
    const EntryState st = StateOf(e.state);
    if ((st != kReady && !(with_evicting && st == kEvicting)) || !want(e)) return;
    slot_to_cand[slot] = cands.size();
    cands.push_back({slot, GenOf(e.state), BlockKey{e.key_lo, e.key_hi}, e.ns, e.tier, e.payload, e.bytes, e.writer,
                     e.stamp_us, e.checksum});
  });
  if (cands.empty()) return cands;
  // Last access = the latest stamp any node left (release time), or the commit's.
  for (uint32_t node = 0; node < layout_.h.max_nodes; ++node) {
    ScanStampRow(node, [&](uint64_t slot, uint64_t stamp) {
      if (stamp == 0 || slot_to_cand[slot] == UINT64_MAX) return;
      TierBlock& c = cands[slot_to_cand[slot]];
      c.stamp = std::max(c.stamp, stamp);
    });
  }
  // Pinned ones are left out of the choice; the evictor checks again after marking.
  const std::vector<uint64_t> pinned = skip_pinned ? PinnedFingerprints() : std::vector<uint64_t>{};
  std::vector<TierBlock> out;
  out.reserve(cands.size());
  for (const TierBlock& c : cands) {
    if (!skip_pinned || !Pinned(pinned, c.key.lo, c.key.hi)) out.push_back(c);
  }
  std::stable_sort(out.begin(), out.end(), [](const TierBlock& a, const TierBlock& b) { return a.stamp < b.stamp; });
  return out;
}

uint64_t Index::EvictLru(uint64_t target, uint64_t only_bytes, bool only_mine) {
  if (target == 0) return 0;
  // Region entries only: a capacity entry frees no region space.
  const uint32_t me = node_.id();
  std::vector<TierBlock> cands = LruReady([only_bytes, only_mine, me](const Entry& e) {
    return e.tier == kTierRegion && (only_bytes == 0 || e.bytes == only_bytes) &&
           (!only_mine || WriterNode(e.writer) == me);
  });
  // The oldest entries that cover the target, grouped by stripe: one lock per stripe.
  std::map<uint32_t, std::vector<const TierBlock*>> by_stripe;
  uint64_t planned = 0;
  for (const TierBlock& c : cands) {
    if (planned >= target) break;
    by_stripe[layout_.stripe_of(c.slot)].push_back(&c);
    planned += c.bytes;
  }
  uint64_t freed = 0;
  for (auto& [stripe, list] : by_stripe) {
    if (!LockStripe(stripe).ok()) continue;
    std::vector<std::pair<uint64_t, uint64_t>> victims;
    victims.reserve(list.size());
    for (const TierBlock* c : list) victims.push_back({c->slot, c->gen});
    freed += TryEvictManyLocked(victims);
    UnlockStripe(stripe);
  }
  return freed;
}

Result<uint64_t> Index::EvictKeys(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  CXLKV_RETURN_IF_ERROR(CheckHandle(ns));
  uint64_t evicted = 0;
  for (const BlockKey& key : keys) {
    const uint32_t stripe = static_cast<uint32_t>(StripeOf(key));
    CXLKV_RETURN_IF_ERROR(LockStripe(stripe));
    Probe p = Find(key);
    if (p.found >= 0 && p.entry.ns == ns.id && TryEvictLocked(static_cast<uint64_t>(p.found), GenOf(p.entry.state))) {
      ++evicted;
    }
    UnlockStripe(stripe);
  }
  return evicted;
}

Result<uint64_t> Index::EvictAll() { return EvictReady(nullptr); }

Result<uint64_t> Index::EvictNamespace(const NamespaceHandle& ns) {
  CXLKV_RETURN_IF_ERROR(CheckHandle(ns));
  return EvictReady(&ns);
}

Result<uint64_t> Index::EvictReady(const NamespaceHandle* only) {
  uint64_t evicted = 0;
  for (uint32_t stripe = 0; stripe < layout_.h.stripes; ++stripe) {
    CXLKV_RETURN_IF_ERROR(LockStripe(stripe));
    std::vector<std::pair<uint64_t, uint64_t>> victims;
    for (uint32_t i = 0; i < layout_.h.slots_per_stripe; ++i) {
      const uint64_t slot = SlotAt(stripe, i);
      if (only == nullptr) {  // the state word alone: one line a slot
        const uint64_t w = FetchTableWord(layout_.entry(slot));
        if (StateOf(w) == kReady) victims.push_back({slot, GenOf(w)});
        continue;
      }
      const Entry e = ReadEntry(slot);  // under the stripe lock: the namespace word is stable
      if (StateOf(e.state) == kReady && e.ns == only->id) victims.push_back({slot, GenOf(e.state)});
    }
    TryEvictManyLocked(victims, &evicted);
    UnlockStripe(stripe);
  }
  return evicted;
}

uint64_t Index::UsedBytes() {
  uint64_t claimed = 0, released = 0;
  const bool central = CacheIsTable();
  for (uint32_t node = 0; node < layout_.h.max_nodes; ++node) {
    if (central && node != node_.id()) continue;  // other rows: the sums RefreshOtherRows took
    meta_.Invalidate(layout_.counter(node, kLookups), kCounterRowBytes);
    claimed += meta_.Load(layout_.counter(node, kBytesClaimed));
    released += meta_.Load(layout_.counter(node, kBytesReleased));
  }
  if (central) {
    claimed += others_claimed_.load(std::memory_order_relaxed);
    released += others_released_.load(std::memory_order_relaxed);
  }
  return claimed > released ? claimed - released : 0;
}

void Index::RefreshOtherRows() {
  uint64_t claimed = 0, released = 0;
  for (uint32_t node = 0; node < layout_.h.max_nodes; ++node) {
    if (node == node_.id()) continue;
    meta_.Invalidate(layout_.counter(node, kLookups), kCounterRowBytes);
    claimed += meta_.Load(layout_.counter(node, kBytesClaimed));
    released += meta_.Load(layout_.counter(node, kBytesReleased));
  }
  others_claimed_.store(claimed, std::memory_order_relaxed);
  others_released_.store(released, std::memory_order_relaxed);
}

void Index::Recover(uint32_t node, uint64_t inc) {
  const DeadWriter dead{node, inc};
  std::vector<uint32_t> unrepaired(layout_.h.stripes);
  for (uint32_t stripe = 0; stripe < layout_.h.stripes; ++stripe) unrepaired[stripe] = stripe;
  // A stripe whose lock is not granted (each try waits up to four leases) is tried again a few
  // rounds later; after that a Reserve that meets the dead writer's entry still reclaims it on
  // the spot, and an EVICTING leftover is repaired by the next taker of the lock.
  for (int round = 0; !unrepaired.empty() && round < 4; ++round) {
    if (round > 0) std::this_thread::sleep_for(node_.lease());
    std::vector<uint32_t> missed;
    for (uint32_t stripe : unrepaired) {
      if (node_.leaving()) return;  // the next manager recovers the node again (idempotent)
      if (!LockStripe(stripe).ok()) {
        missed.push_back(stripe);
        continue;
      }
      RepairStripeLocked(stripe, &dead);
      UnlockStripe(stripe);
    }
    unrepaired.swap(missed);
  }
  if (!unrepaired.empty()) {
    std::fprintf(stderr, "cxlkv: cache: recovering node %u's life %llu: %zu stripe(s) stayed locked; their entries "
                 "of that life are reclaimed when met\n", node, static_cast<unsigned long long>(inc), unrepaired.size());
  }
  // The dead life's pins: it writes its pages no more; recovery takes them over (P5). Only
  // that life's: a next life of the node may pin in the row already.
  DropPinPages(node, &dead);
  PublishCounters();
}

void Index::AppendReachable(std::vector<uint64_t>& out) {
  // Central mode: a payload belongs to the service's node, not to its writer, and a WRITING
  // entry's writer may live on when the service's node dies: the entry keeps the payload until
  // the next service reclaims or commits it. Decentralized: the writer owns it, and the
  // writer's recovery drops its WRITING entries before the allocator's runs.
  const bool writing_counts = central();
  ScanEntries([&](uint64_t, const Entry& e) {
    EntryState s = StateOf(e.state);
    if (e.tier != kTierRegion) return;  // a device location, not a pool object
    if (s == kReady || s == kEvicting || (writing_counts && s == kWriting)) out.push_back(e.payload);
  });
}

bool Index::RecoverProcess(uint32_t slot, uint64_t inc, bool stop_at_first_miss) {
  const DeadWriter dead{node_.id(), inc, slot};
  std::vector<uint64_t> payloads;
  bool complete = true;
  for (uint32_t stripe = 0; stripe < layout_.h.stripes; ++stripe) {
    // Taking the stripe also repairs it when the dead process held its lock (EOWNERDEAD).
    if (!LockStripe(stripe).ok()) {
      complete = false;
      if (stop_at_first_miss) break;
      continue;
    }
    RepairStripeLocked(stripe, &dead, &payloads);
    UnlockStripe(stripe);
  }
  // Its pins: the process holds them no more.
  DropPinPages(node_.id(), &dead);
  // The payloads are this node's own objects: no one else frees them while the node lives.
  for (uint64_t p : payloads) FreePayload(p, 0);
  if (!payloads.empty()) PublishCounters();
  return complete;
}

void Index::AbandonOpenReservations() {
  if (!reserved_any_.load()) return;
  // At close, a lock that is not granted (no manager any more) must not hold the exit for four
  // leases per stripe: give up and leave the slot to another process of the node, which drops
  // the rest as for a dead process (or the node's life recovery, when this is its last).
  if (!RecoverProcess(node_.process_slot(), node_.incarnation(), /*stop_at_first_miss=*/true)) {
    node_.LeaveProcessSlotForRecovery();
    std::fprintf(stderr, "cxlkv: cache: closing with reservations open: a stripe lock was not granted; "
                 "node %u's other processes (or its life's recovery) drop them\n", node_.id());
  }
}

// ---- central mode: the metadata service as the index's one writer ----

void Index::BecomeCentralWriter(std::function<Status()> fence) {
  std::lock_guard<std::mutex> g(central_mu_);  // no operation in flight while the role changes
  if (fence && !central_writer()) {
    // The lines this process cached before the role (as a client, or in an earlier role) may
    // predate the last writer's: drop them all once, then the cache is the table (CacheIsTable).
    meta_.Invalidate(layout_.entry(0), layout_.entries() * sizeof(Entry));
    meta_.Invalidate(layout_.stamp(0, 0), uint64_t{layout_.h.max_nodes} * layout_.entries() * 8);
    meta_.Invalidate(layout_.pin_dir(0), IndexAreaBytes(layout_.h) - layout_.pin_dir(0));
    RefreshOtherRows();
  }
  central_fence_ = std::move(fence);
  pinned_life_.assign(layout_.h.max_nodes, kUnknownLife);
  central_writer_.store(static_cast<bool>(central_fence_), std::memory_order_release);
}

Status Index::ActFor(uint32_t node, uint64_t writer) {
  if (!central_writer()) return Unavailable("this process no longer serves the pool's metadata: retry");
  if (node >= layout_.h.max_nodes || WriterNode(writer) != node) {
    return InvalidArgument("request names node " + std::to_string(WriterNode(writer)) + " on a channel of node " +
                           std::to_string(node) + " (of " + std::to_string(layout_.h.max_nodes) + ")");
  }
  if (!WriterLive(writer)) {
    return LeaseExpired("node " + std::to_string(node) + "'s life " + std::to_string(WriterInc(writer)) +
                        " is over (paused or silent past its lease): its requests are refused; reopen the pool");
  }
  actor_node_ = node;
  actor_writer_ = writer;
  uint64_t& owner = pinned_life_[node];
  if (owner != WriterInc(writer)) {
    // The node's row holds the pins of a life that ended (or, after a takeover, of a life this
    // service has not seen yet: the sweep settles that one first, so this is a new life).
    if (owner != kUnknownLife) DropPinRow(node);
    owner = WriterInc(writer);
  }
  return Status::Ok();
}

uint64_t Index::ReclaimWriter(uint32_t node, uint64_t inc, int64_t slot) {
  if (!central_writer() || node >= layout_.h.max_nodes) return 0;
  const DeadWriter dead{node, inc, slot};
  std::vector<uint64_t> payloads;
  uint64_t n = 0;
  for (uint32_t stripe = 0; stripe < layout_.h.stripes; ++stripe) {
    (void)LockStripe(stripe);  // a central writer's lock is local: always granted
    n += RepairStripeLocked(stripe, &dead, &payloads);
    UnlockStripe(stripe);
  }
  DropPinPages(node, &dead);
  for (uint64_t p : payloads) FreePayload(p, 0);
  if (n != 0) PublishCounters();
  return n;
}

uint64_t Index::SweepCentral(bool repair_all) {
  if (!central_writer()) return 0;
  RefreshOtherRows();
  // 1. WRITING entries whose writer's life is over: found without the lock, re-checked under it.
  struct Stale {
    uint64_t slot, state;
  };
  std::vector<Stale> stale;
  ScanEntries([&](uint64_t slot, const Entry& e) {
    if (StateOf(e.state) == kWriting && !WriterLive(e.writer)) stale.push_back({slot, e.state});
  });
  std::vector<uint64_t> payloads;
  for (const Stale& st : stale) {
    const uint32_t stripe = layout_.stripe_of(st.slot);
    (void)LockStripe(stripe);
    Entry e = ReadEntry(st.slot);
    if (e.state == st.state) {
      TombstoneLocked(st.slot, GenOf(e.state));
      payloads.push_back(e.payload);
      Add(kBytesReleased, e.bytes);
      Add(kReclaimed, 1);
    }
    UnlockStripe(stripe);
  }
  for (uint64_t p : payloads) FreePayload(p, 0);
  // 2. A takeover: evictions the predecessor left half done (EVICTING) are finished.
  if (repair_all) {
    for (uint32_t stripe = 0; stripe < layout_.h.stripes; ++stripe) {
      (void)LockStripe(stripe);
      RepairStripeLocked(stripe, nullptr);
      UnlockStripe(stripe);
    }
  }
  // 3. Pin rows: a node whose life ended pins nothing any more.
  for (const sync::NodeView& v : node_.Nodes()) {
    if (v.id >= pinned_life_.size()) continue;
    uint64_t& owner = pinned_life_[v.id];
    const bool live = v.incarnation == 0 || v.live;  // not observed yet: never drop early
    if (owner == kUnknownLife) {
      if (!live) DropPinRow(v.id);
      owner = live ? WriterInc(v.incarnation) : 0;
    } else if (owner != 0 && (!live || WriterInc(v.incarnation) != owner)) {
      DropPinRow(v.id);
      owner = 0;
    }
  }
  if (!payloads.empty()) PublishCounters();
  return payloads.size();
}

}  // namespace cxlkv::cache
