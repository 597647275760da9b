// Index: the global lookup table's side of the capacity tiers (Unified KV pooling Table I; issue
// 14). An entry names where its block lives — the region (a pool offset) or a device of one node
// (tier, device, slot; the writer word names the owning cxlkvd process) — and moves between them
// only under its stripe lock, through EVICTING, so a reader never sees a half-moved entry:
//
//   EVICTING(g)  →  new tier and location written and flushed  →  READY(g + 1)
//
// The generation bump tells every reader that pinned or looked at the old place that the entry
// changed (docs/protocol.md, rule P4). A block on a capacity tier is never pinned: a lookup that
// reaches one stops there and has the owner bring it back into the region first (KvCache).
// Crash analysis (docs/tiers.md, "Moves and crashes"): a mover that dies leaves EVICTING, which
// the stripe's repair tombstones; a region payload still named is reclaimed if unreachable, a
// device slot is the owner's to reconcile.
#include <algorithm>
#include <atomic>
#include <map>

#include "cache/index.h"

namespace cxlkv::cache {

std::vector<Index::TierBlock> Index::SpillCandidates(uint64_t bytes, size_t max, uint64_t max_block_bytes) {
  std::vector<TierBlock> lru =
      LruReady([max_block_bytes](const Entry& e) { return e.tier == kTierRegion && e.bytes <= max_block_bytes; });
  size_t n = 0;
  uint64_t covered = 0;
  while (n < lru.size() && n < max && covered < bytes) covered += lru[n++].bytes;
  lru.resize(n);
  return lru;
}

std::vector<Index::TierBlock> Index::CapacityEntriesOf(uint32_t node, bool with_evicting) {
  // Pinned ones too: a capacity entry is never pinned by a lookup, and a stale pin must
  // not hide a slot from its owner.
  return LruReady([node](const Entry& e) { return IsCapacityTier(e.tier) && WriterNode(e.writer) == node; },
                  /*skip_pinned=*/false, with_evicting);
}

std::vector<Index::TierBlock> Index::FindCapacity(std::span<const BlockKey> keys) {
  std::vector<TierBlock> out;
  std::vector<Probe> found = FindMany(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    const Probe& p = found[i];
    if (p.found < 0) continue;
    if (StateOf(p.entry.state) != kReady || !IsCapacityTier(p.entry.tier)) continue;
    // A consistent copy: the state word before and after the fields (a move rewrites the fields
    // between two state changes, so an unchanged word means untouched fields). A copy torn across
    // a move would send a reader to a slot the entry no longer names.
    const uint64_t off = layout_.entry(static_cast<uint64_t>(p.found));
    const uint64_t before = FetchTableWord(off);
    std::atomic_thread_fence(std::memory_order_acquire);
    const Entry e = meta_.ReadStruct<Entry>(off);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (meta_.Load(off) != before || e.state != before || e.key_lo != keys[i].lo || e.key_hi != keys[i].hi) continue;
    if (StateOf(e.state) != kReady || !IsCapacityTier(e.tier)) continue;
    out.push_back({static_cast<uint64_t>(p.found), GenOf(e.state), keys[i], e.ns, e.tier, e.payload, e.bytes, e.writer,
                   e.stamp_us, e.checksum});
  }
  return out;
}

bool Index::HoldsStripeFenced(uint32_t stripe) {
  return (central_writer() ? central_fence_() : node_.CheckHeld(layout_.stripe_lock(stripe))).ok();
}

bool Index::MoveLocked(const TierMove& m) {
  const uint64_t off = layout_.entry(m.from.slot);
  if (FetchTableWord(off) != StateWord(m.from.gen, kReady)) return false;
  Entry e = ReadEntry(m.from.slot);
  if (e.key_lo != m.from.key.lo || e.key_hi != m.from.key.hi || e.tier != m.from.tier ||
      e.payload != m.from.location) {
    return false;
  }
  const uint32_t stripe = layout_.stripe_of(m.from.slot);
  if (!HoldsStripeFenced(stripe)) return false;  // P5: no write under a hold whose lease lapsed
  meta_.Publish(off, StateWord(m.from.gen, kEvicting));
  MaybeCrash(CrashPoint::kMoveAfterMark);
  MaybeCrash(CrashPoint::kMovePauseAfterMark);
  // EVICTING is flushed: a pinner whose pin we do not see now sees EVICTING and backs off.
  if (AnyPins(m.from.key.lo, m.from.key.hi)) {
    meta_.Publish(off, StateWord(m.from.gen, kReady));
    return false;
  }
  // The fence, right before the writes others rely on (as a commit's): a mover paused past its
  // lease no longer holds the stripe, and the entry stays EVICTING for the next holder's repair.
  if (!HoldsStripeFenced(stripe)) return false;
  if (e.tier == kTierRegion) {
    // Freed while the entry still names it (EVICTING is reachable for the allocator's
    // recovery, so it cannot free it too), as an eviction does.
    FreePayloadNow(e.payload);
    Add(kBytesReleased, e.bytes);
    Add(kSpills, 1);
    Add(kSpilledBytes, e.bytes);
  }
  if (m.to_tier == kTierRegion) {
    Add(kBytesClaimed, e.bytes);
    Add(kPromotes, 1);
    Add(kPromotedBytes, e.bytes);
    e.stamp_us = NowStamp();  // brought in for a reader: recently used
    if (m.set_checksum) e.checksum = m.checksum;
  }
  e.tier = m.to_tier;
  e.payload = m.to_location;
  e.writer = MyWriterWord();
  e.state = StateWord(m.from.gen, kEvicting);
  meta_.WriteStruct(off, e);
  meta_.Flush(off, sizeof(Entry));  // P1: the new place reaches memory before READY does
  MaybeCrash(CrashPoint::kMoveAfterFields);
  meta_.Publish(off, StateWord(m.from.gen + 1, kReady));
  return true;
}

void Index::MoveMany(std::span<TierMove> moves) {
  std::map<uint32_t, std::vector<TierMove*>> by_stripe;
  for (TierMove& m : moves) {
    m.moved = false;
    if (m.from.slot < layout_.entries()) by_stripe[layout_.stripe_of(m.from.slot)].push_back(&m);
  }
  bool any = false;
  for (auto& [stripe, list] : by_stripe) {
    if (!LockStripe(stripe).ok()) continue;  // not moved: the caller undoes its side
    for (TierMove* m : list) {
      m->moved = MoveLocked(*m);
      any |= m->moved;
    }
    UnlockStripe(stripe);
  }
  if (any) PublishCounters();
}

void Index::InsertCapacity(std::span<CapacityInsert> inserts) {
  std::map<uint32_t, std::vector<CapacityInsert*>> by_stripe;
  using Outcome = CapacityInsert::Outcome;
  for (CapacityInsert& c : inserts) {
    c.outcome = Outcome::kLocked;
    if (IsCapacityTier(c.tier) && c.ns < kMaxNamespaces && c.gen != 0) by_stripe[StripeOf(c.key)].push_back(&c);
  }
  bool any = false;
  for (auto& [stripe, list] : by_stripe) {
    if (!LockStripe(stripe).ok()) continue;
    for (CapacityInsert* c : list) {
      const Probe p = Find(c->key);
      c->outcome = Outcome::kTaken;  // present in some state, or no room: not inserted
      if (p.found >= 0 || p.free_slot < 0) continue;
      const uint64_t off = layout_.entry(static_cast<uint64_t>(p.free_slot));
      const uint64_t word = meta_.Load(off);
      // The entry takes the generation its device slot was sealed with, so the slot validates
      // as is; a generation must only grow, so a slot that has been further is passed over.
      if (GenOf(word) >= c->gen) continue;
      c->outcome = Outcome::kLocked;
      MaybeCrash(CrashPoint::kInsertPauseBeforeFence);
      if (!HoldsStripeFenced(stripe)) break;  // P5: paused past the lease, write nothing more
      Entry e{};
      e.state = word;  // still free (EMPTY or TOMBSTONE) while the fields go in
      e.key_lo = c->key.lo;
      e.key_hi = c->key.hi;
      e.payload = c->location;
      e.bytes = c->bytes;
      e.tier = c->tier;
      e.ns = static_cast<uint16_t>(c->ns);
      e.writer = MyWriterWord();
      e.checksum = 0;  // unknown: a promote computes it where the pool keeps checksums
      e.stamp_us = NowStamp();
      meta_.WriteStruct(off, e);
      meta_.Flush(off, sizeof(Entry));  // P1: the fields reach memory before READY does
      MaybeCrash(CrashPoint::kInsertAfterFields);  // killed here: still free, its fields ignored
      meta_.Publish(off, StateWord(c->gen, kReady));
      c->outcome = Outcome::kInserted;
      any = true;
    }
    UnlockStripe(stripe);
  }
  if (any) PublishCounters();
}

uint64_t Index::DropCapacity(std::span<const TierBlock> blocks, std::vector<bool>* dropped_out) {
  std::map<uint32_t, std::vector<size_t>> by_stripe;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const TierBlock& b = blocks[i];
    if (b.slot < layout_.entries() && IsCapacityTier(b.tier)) by_stripe[layout_.stripe_of(b.slot)].push_back(i);
  }
  if (dropped_out != nullptr) dropped_out->assign(blocks.size(), false);
  uint64_t dropped = 0;
  for (auto& [stripe, list] : by_stripe) {
    if (!LockStripe(stripe).ok()) continue;
    if (!HoldsStripeFenced(stripe)) {  // paused past the lease: drop nothing
      UnlockStripe(stripe);
      continue;
    }
    for (size_t i : list) {
      const TierBlock* b = &blocks[i];
      if (FetchTableWord(layout_.entry(b->slot)) != StateWord(b->gen, kReady)) continue;
      Entry e = ReadEntry(b->slot);
      if (e.tier != b->tier || e.payload != b->location) continue;
      TombstoneLocked(b->slot, b->gen);
      ++dropped;
      if (dropped_out != nullptr) (*dropped_out)[i] = true;
    }
    UnlockStripe(stripe);
  }
  if (dropped != 0) {
    Add(kTierDrops, dropped);
    PublishCounters();
  }
  return dropped;
}

uint64_t Index::SumCounter(Counter c) {
  uint64_t sum = 0;
  for (uint32_t node = 0; node < layout_.h.max_nodes; ++node) {
    meta_.Invalidate(layout_.counter(node, c), 8);
    sum += meta_.Load(layout_.counter(node, c));
  }
  return sum;
}

Result<uint64_t> Index::AllocateRegionPayload(uint64_t bytes) {
  CXLKV_ASSIGN_OR_RETURN(alloc::ObjectOffset off, AllocatePayload(bytes));
  return off.raw();
}

}  // namespace cxlkv::cache
