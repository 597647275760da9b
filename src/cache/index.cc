// Index: layout, lookup/pin, reserve/commit/abort. Namespaces are in namespaces.cc, eviction
// and recovery in evict.cc.
#include "cache/index.h"

#include <signal.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "region/region_internal.h"
#include "sync/layout.h"

namespace cxlkv::cache {

const char* StateName(EntryState s) {
  switch (s) {
    case kEmpty: return "empty";
    case kWriting: return "writing";
    case kReady: return "ready";
    case kEvicting: return "evicting";
    case kTombstone: return "tombstone";
  }
  return "invalid";
}

const char* CounterName(Counter c) {
  static const char* const kNames[kCounterCount] = {
      "lookups", "lookup_blocks", "hit_blocks", "hit_tokens", "miss_blocks", "zero_hit_lookups",
      "inserts", "insert_bytes", "duplicates", "busy", "aborts", "evictions", "evicted_bytes",
      "reclaimed", "bytes_claimed", "bytes_released", "read_bytes", "write_bytes",
      "checksum_failures", "full_errors", "spills", "spilled_bytes", "promotes", "promoted_bytes",
      "capacity_hits", "capacity_misses", "tier_drops", "capacity_hits_ssd"};
  return c < kCounterCount ? kNames[c] : "invalid";
}

IndexHeader PlanIndex(const IndexOptions& o, uint64_t data_bytes, uint32_t max_nodes, uint32_t lock_base) {
  IndexHeader h{};
  h.magic = kIndexMagic;
  h.version = kIndexVersion;
  uint64_t entries = o.entries ? o.entries : std::clamp<uint64_t>(data_bytes / (16 << 10), 1024, 4u << 20);
  uint32_t stripes = o.stripes ? o.stripes : static_cast<uint32_t>(std::clamp<uint64_t>(entries / 64, 1, 32));
  h.stripes = stripes;
  h.slots_per_stripe = static_cast<uint32_t>((entries + stripes - 1) / stripes);
  h.max_nodes = max_nodes;
  h.lock_base = lock_base;
  h.flags = (o.checksum ? kFlagChecksum : 0) | (o.central ? kFlagCentral : 0);
  h.capacity_bytes = o.capacity_bytes;  // 0: every data chunk of the pool (known at open)
  h.high_watermark_pct = o.high_watermark_pct;
  h.low_watermark_pct = o.low_watermark_pct;
  h.epoch_us = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                         std::chrono::system_clock::now().time_since_epoch()).count());
  // Offsets relative to the area until init adds the area's offset.
  const uint64_t all = uint64_t{h.stripes} * h.slots_per_stripe;
  h.namespaces_offset = kIndexHeaderBytes;
  h.entries_offset = h.namespaces_offset + kMaxNamespaces * sizeof(NamespaceSlot);
  h.stamps_offset = h.entries_offset + all * sizeof(Entry);
  h.counters_offset = h.stamps_offset + uint64_t{max_nodes} * all * 8;
  h.pin_pages = PinPagesFor(all);
  IndexLayout l;
  l.h = h;
  // Whole lines from here: each node's directory and pages are its own lines (P5).
  h.pin_dirs_offset = (h.counters_offset + uint64_t{max_nodes} * kCounterRowBytes + 63) / 64 * 64;
  h.pin_pages_offset = h.pin_dirs_offset + uint64_t{max_nodes} * l.pin_dir_words() * 8;
  return h;
}

uint32_t PinPagesFor(uint64_t entries) {
  // Room for every entry pinned once by one node, within [kMinPinPages, kMaxPinPages].
  const uint64_t pages = std::clamp<uint64_t>((entries + kPinsPerPage - 1) / kPinsPerPage, kMinPinPages, kMaxPinPages);
  return static_cast<uint32_t>((pages + 63) / 64 * 64);
}

uint64_t IndexAreaBytes(const IndexHeader& h) {
  return h.pin_pages_offset + uint64_t{h.max_nodes} * h.pin_pages * kPinPageBytes;
}

Result<IndexLayout> ReadLayout(Region& region) {
  const auto* area = region.impl().find_area(region::AreaKind::kIndex);
  if (area == nullptr) {
    return NotFound("this pool has no prefix index: re-create it with 'cxlkv init' (the index is "
                    "sized by --index-entries)");
  }
  auto& meta = region.impl().meta();
  meta.Invalidate(area->offset, sizeof(IndexHeader));
  IndexLayout l;
  l.area_offset = area->offset;
  l.h = meta.ReadStruct<IndexHeader>(area->offset);
  const std::string where = "region " + region.info().path + " area index";
  const std::string recreate = ": re-create the pool with 'cxlkv init' (its cached blocks are lost)";
  if (l.h.magic != kIndexMagic) {
    return Corrupted(where + ": the prefix index header has a bad magic: the region is damaged" + recreate);
  }
  if (l.h.version != kIndexVersion) {
    return VersionMismatch("prefix index version " + std::to_string(l.h.version) + ", this build reads " +
                           std::to_string(kIndexVersion) + ": re-create the pool or use a matching cxlkv");
  }
  // Every value below is used to index the region: check each against what init would have
  // planned (values read from the region are untrusted in every build).
  auto bad = [&](const std::string& field, uint64_t value, const std::string& expected) {
    return Corrupted(where + " is corrupt: prefix index header field " + field + " is " + std::to_string(value) +
                     ", expected " + expected + recreate);
  };
  const uint32_t region_nodes = region.info().max_nodes;
  if (l.h.max_nodes != region_nodes) {
    return bad("max_nodes", l.h.max_nodes, std::to_string(region_nodes) + " (the region's node count)");
  }
  if (l.h.stripes == 0 || l.h.stripes > 4096) return bad("stripes", l.h.stripes, "1..4096");
  if (l.h.slots_per_stripe == 0 || l.entries() > (uint64_t{1} << 26)) {
    return bad("slots_per_stripe", l.h.slots_per_stripe, "1.. with at most 64 Mi entries in all");
  }
  const auto* locks = region.impl().find_area(region::AreaKind::kLockArray);
  const uint64_t max_locks = locks != nullptr ? locks->param : 0;
  if (l.h.lock_base < sync::kReservedLocks || uint64_t{l.h.lock_base} + l.h.stripes + 1 > max_locks) {
    return bad("lock_base", l.h.lock_base,
               "stripe locks inside the lock array of " + std::to_string(max_locks) + " locks");
  }
  if (l.h.high_watermark_pct > 100 || l.h.low_watermark_pct > l.h.high_watermark_pct) {
    return bad("high_watermark_pct", l.h.high_watermark_pct, "low <= high <= 100");
  }
  const uint64_t all = l.entries();
  const uint64_t ns = area->offset + kIndexHeaderBytes;
  const uint64_t entries = ns + kMaxNamespaces * sizeof(NamespaceSlot);
  const uint64_t stamps = entries + all * sizeof(Entry);
  const uint64_t counters = stamps + uint64_t{l.h.max_nodes} * all * 8;
  const uint64_t pin_dirs = (counters + uint64_t{l.h.max_nodes} * kCounterRowBytes + 63) / 64 * 64;
  if (l.h.namespaces_offset != ns) return bad("namespaces_offset", l.h.namespaces_offset, std::to_string(ns));
  if (l.h.entries_offset != entries) return bad("entries_offset", l.h.entries_offset, std::to_string(entries));
  if (l.h.stamps_offset != stamps) return bad("stamps_offset", l.h.stamps_offset, std::to_string(stamps));
  if (l.h.counters_offset != counters) return bad("counters_offset", l.h.counters_offset, std::to_string(counters));
  if (l.h.pin_pages != PinPagesFor(all)) return bad("pin_pages", l.h.pin_pages, std::to_string(PinPagesFor(all)));
  if (l.h.pin_dirs_offset != pin_dirs) return bad("pin_dirs_offset", l.h.pin_dirs_offset, std::to_string(pin_dirs));
  const uint64_t pin_pages = pin_dirs + uint64_t{l.h.max_nodes} * l.pin_dir_words() * 8;
  if (l.h.pin_pages_offset != pin_pages) {
    return bad("pin_pages_offset", l.h.pin_pages_offset, std::to_string(pin_pages));
  }
  if (pin_pages + uint64_t{l.h.max_nodes} * l.h.pin_pages * kPinPageBytes > area->offset + area->size) {
    return bad("slots_per_stripe", l.h.slots_per_stripe,
               "an index that fits its area of " + std::to_string(area->size) + " bytes");
  }
  return l;
}

Index::Index(Region& region, IndexLayout layout, sync::Node& node, alloc::Allocator& allocator)
    : region_(region), meta_(region.impl().meta()), layout_(layout), node_(node), allocator_(allocator),
      capacity_(layout.h.capacity_bytes ? std::min(layout.h.capacity_bytes, allocator.data_bytes())
                                        : allocator.data_bytes()) {
  InvalidateOwnPinRow();
}

void Index::PublishCounters() { meta_.Flush(layout_.counter(node_.id(), kLookups), kCounterRowBytes); }

uint64_t Index::NowStamp() const {
  auto now = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                       std::chrono::system_clock::now().time_since_epoch()).count());
  return now > layout_.h.epoch_us ? (now - layout_.h.epoch_us) & 0xffffffffffffull : 0;
}

Entry Index::ReadEntry(uint64_t slot) {
  uint64_t off = layout_.entry(slot);
  if (!CacheIsTable()) meta_.Invalidate(off, sizeof(Entry));  // P2: other nodes write entries
  return meta_.ReadStruct<Entry>(off);
}

Index::Probe Index::Find(const BlockKey& key) {
  Probe p;
  const uint64_t stripe = StripeOf(key);
  const uint32_t n = layout_.h.slots_per_stripe;
  const uint64_t home = key.hi % n;
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t slot = SlotAt(stripe, (home + i) % n);
    Entry e = ReadEntry(slot);
    EntryState s = StateOf(e.state);
    if (s == kEmpty) {
      if (p.free_slot < 0) p.free_slot = static_cast<int64_t>(slot);
      return p;  // an EMPTY slot ends every probe sequence
    }
    if (s == kTombstone) {
      if (p.free_slot < 0) p.free_slot = static_cast<int64_t>(slot);
      continue;
    }
    if (e.key_lo == key.lo && e.key_hi == key.hi) {
      p.found = static_cast<int64_t>(slot);
      p.entry = e;
      return p;
    }
  }
  return p;
}

// ---- lookup and pins ----

Result<LookupResult> Index::Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin) {
  return LookupImpl(ns, keys, pin, /*count=*/true);
}

Result<LookupResult> Index::LookupImpl(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin,
                                       bool count) {
  CXLKV_RETURN_IF_ERROR(CheckHandle(ns));
  LookupResult out;
  // 1. Pin first: the fingerprints of every key go into consecutive words of this node's pin
  //    table, published (clflush: P1) before any entry is read. An evictor publishes EVICTING
  //    and then reads the pin tables, so for each key either it sees our pin and backs off, or
  //    our read below sees EVICTING (or the slot's next life) and the hit ends there. Keys past
  //    the hit are unpinned at the end.
  std::vector<uint64_t> pin_words;
  const size_t asked = keys.size();
  const uint64_t owner = pin ? MyWriterWord() : 0;
  const uint32_t row = PinRow();
  if (pin && !keys.empty()) {
    std::vector<uint64_t> lines;
    pin_words = WritePinWords(row, owner, keys, &lines);
    if (pin_words.empty()) {
      return NoSpace("node " + std::to_string(row) + "'s pin table is full (" + std::to_string(layout_.h.pin_pages) +
                     " pages of " + std::to_string(kPinsPerPage) + " pins): release pins (a reader that never "
                     "releases holds them), or re-create the pool with more index entries");
    }
    keys = keys.first(pin_words.size());  // a full table pins a shorter prefix
    if (!test_skip_pin_flush_.load(std::memory_order_relaxed)) [[likely]] meta_.FlushEach(lines, 64);
  }
  // 2. Every key's home slot at once: one batch of invalidations, so the misses overlap.
  //    A key that is not at home (a collision) is probed one slot at a time.
  std::vector<uint64_t> offs(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    offs[i] = layout_.entry(SlotAt(StripeOf(keys[i]), keys[i].hi % layout_.h.slots_per_stripe));
  }
  if (!CacheIsTable()) meta_.InvalidateEach(offs, sizeof(Entry));
  out.pins.reserve(keys.size());
  Status bad = Status::Ok();
  for (size_t i = 0; i < keys.size(); ++i) {
    const BlockKey& key = keys[i];
    Entry e = meta_.ReadStruct<Entry>(offs[i]);
    uint64_t slot = (offs[i] - layout_.h.entries_offset) / sizeof(Entry);
    if (e.key_lo != key.lo || e.key_hi != key.hi || StateOf(e.state) == kEmpty ||
        StateOf(e.state) == kTombstone) {
      if (StateOf(e.state) == kEmpty) break;  // an EMPTY home ends the probe: a miss
      Probe p = Find(key);
      if (p.found < 0) break;
      slot = static_cast<uint64_t>(p.found);
      e = p.entry;
    }
    if (e.ns != ns.id) {
      bad = InvalidArgument("a key was made in namespace " + std::to_string(e.ns) + ", not " +
                            std::to_string(ns.id) + ": keys are namespace-specific; make them with "
                            "ChainKeys/KeyFromEngineHash of the namespace you look up in");
      break;
    }
    if (StateOf(e.state) != kReady) break;
    // A block on a capacity tier ends the pinned hit; the READY run from it on is reported so
    // KvCache can have the owners bring it in (docs/tiers.md, "Promote on hit").
    if (e.tier != kTierRegion || out.capacity_run != 0) {
      ++out.capacity_run;
      continue;
    }
    // Untrusted: a READY entry's payload is handed out as a pointer; it must lie in
    // a data area of this pool, or the region is damaged.
    if (e.bytes == 0 || !allocator_.Contains(alloc::ObjectOffset(e.payload), e.bytes)) [[unlikely]] {
      bad = Corrupted("index slot " + std::to_string(slot) + " names payload " + std::to_string(e.payload) +
                      " of " + std::to_string(e.bytes) + " bytes outside the pool's data areas: the "
                      "region is damaged; run 'cxlkv check'");
      break;
    }
    out.pins.push_back(BlockPin{static_cast<uint32_t>(slot), GenOf(e.state), e.payload, e.bytes, e.tier, e.checksum,
                                pin ? PinRef(pin_words[i], WriterInc(owner)) : 0});
  }
  if (!bad.ok()) out.pins.clear();
  // A pinner paused past its lease between its pin and its probe may have had its pages
  // recovered under it: what it pinned is not pinned. Checked after the probe, as a commit is.
  if (pin && !central_writer() && bad.ok()) {
    if (Status fenced = node_.Fence("a pinning lookup", WriterInc(owner)); !fenced.ok()) {
      bad = fenced;
      out.pins.clear();
    }
  }
  if (pin && !pin_words.empty()) {
    // 3. The words of keys past the pinned hit go back (a capacity run is not pinned: its
    //    owners bring it in, and LookupMore pins it then).
    const size_t kept = out.pins.size();
    if (kept < pin_words.size()) {
      std::vector<uint64_t> lines;
      ClearPinWords(row, owner, std::span<const uint64_t>(pin_words).subspan(kept), &lines);
      meta_.FlushEach(lines, 64);
    }
    if (central_writer() && kept != 0) RememberPins(owner, out.pins);
  }
  if (!bad.ok()) return bad;
  out.hit_blocks = out.pins.size();
  // A central writer answers for a client, which counts its lookup on its own node's row.
  if (pin && count && !central_writer()) CountLookup(ns, asked, out.hit_blocks);
  return out;
}

Result<LookupResult> Index::LookupMore(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                       size_t earlier_hits, size_t capacity_run) {
  CXLKV_ASSIGN_OR_RETURN(LookupResult more, LookupImpl(ns, keys, /*pin=*/true, /*count=*/false));
  if (!central_writer()) {
    // The first part counted these keys as missed: move the ones hit now to the hits.
    const uint64_t hit = more.hit_blocks;
    Add(kHitBlocks, hit);
    Add(kHitTokens, hit * ns.block_size);
    Add(kMissBlocks, uint64_t{0} - hit);  // counters are sums mod 2^64: this subtracts
    if (earlier_hits == 0 && hit != 0) Add(kZeroHitLookups, ~uint64_t{0});
    const uint64_t brought = std::min<uint64_t>(hit, capacity_run);
    Add(kCapacityHits, brought);
    Add(kCapacityMisses, capacity_run - brought);
  }
  return more;
}

void Index::CountStreamedHits(const NamespaceHandle& ns, uint64_t n) {
  if (central_writer() || n == 0) return;
  Add(kHitBlocks, n);
  Add(kHitTokens, n * ns.block_size);
  Add(kMissBlocks, uint64_t{0} - n);  // sums mod 2^64: this subtracts
  Add(kCapacityHits, n);
}

void Index::CountLookup(const NamespaceHandle& ns, size_t asked, size_t hit) {
  Add(kLookups, 1);
  Add(kLookupBlocks, asked);
  Add(kHitBlocks, hit);
  Add(kHitTokens, hit * ns.block_size);
  Add(kMissBlocks, asked - hit);
  if (hit == 0) Add(kZeroHitLookups, 1);
}

void Index::Release(std::span<const BlockPin> pins) { ReleasePins(pins); }

// ---- insert ----

Status Index::LockStripe(uint32_t stripe) {
  if (central_writer()) {
    // The metadata service is the index's one writer: no other process writes an entry, so a
    // local mutex orders this process's operations (the service's lock fences the process).
    central_mu_.lock();
    return Status::Ok();
  }
  CXLKV_ASSIGN_OR_RETURN(auto held, node_.AcquireFor(layout_.stripe_lock(stripe), node_.lease() * 4));
  stripe_locks_taken_.fetch_add(1, std::memory_order_relaxed);
  if (held.holder_died) RepairStripeLocked(stripe, nullptr);
  return Status::Ok();
}

void Index::UnlockStripe(uint32_t stripe, std::span<const sync::Range> written) {
  if (central_writer()) {
    for (const sync::Range& r : written) meta_.Flush(r.offset, r.bytes);  // P1, as a release would
    central_mu_.unlock();
    return;
  }
  node_.Release(layout_.stripe_lock(stripe), written);
}

Result<Reservation> Index::Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes) {
  CXLKV_ASSIGN_OR_RETURN(auto many, ReserveMany(ns, {&key, 1}, bytes));
  if (many[0].outcome == ReserveOutcome::kReserved) return many[0].reservation;
  return many[0].status;
}

Status Index::Commit(Reservation& r) {
  if (!r.open) return InvalidArgument("reservation is not open (committed or aborted already)");
  return CommitMany({&r, 1});
}

Status Index::Abort(Reservation& r) {
  if (!r.open) return InvalidArgument("reservation is not open (committed or aborted already)");
  return AbortMany({&r, 1});
}

bool Index::WriterLive(uint64_t writer) {
  const std::optional<sync::NodeView> v = node_.ViewOf(WriterNode(writer));
  if (!v) return false;
  if (v->incarnation == 0) return true;  // not observed yet: assume live (never reclaim early)
  if (WriterInc(v->incarnation) != WriterInc(writer)) return false;  // restarted: that life ended
  return v->live;
}

Result<alloc::ObjectOffset> Index::AllocatePayload(uint64_t bytes) {
  const uint64_t cap = capacity_;
  const uint64_t high = PercentOf(cap, layout_.h.high_watermark_pct);
  const uint64_t low = PercentOf(cap, layout_.h.low_watermark_pct);
  if (bytes > cap) {
    return InvalidArgument("block of " + std::to_string(bytes) + " bytes is larger than the cache's capacity (" +
                           std::to_string(cap) + " bytes)");
  }
  uint64_t used = UsedBytes();
  if (used + bytes > high) MakeRoom(used + bytes - std::min(low, used + bytes));
  int idle_rounds = 0;
  for (int attempt = 0; attempt < 8; ++attempt) {
    // The budget binds only when one was set below the pool's size; otherwise the allocator
    // is the judge (counters can drift by a block after a crash mid-eviction).
    bool allocator_full = false;
    if (layout_.h.capacity_bytes == 0 || UsedBytes() + bytes <= cap) {
      auto r = allocator_.Alloc(bytes, alloc::Fit::kExact);  // a block: its namespace's size repeats
      if (r.ok() || r.status().code() != StatusCode::kNoSpace) return r;
      allocator_full = true;
    }
    // Room by the space this put can use. Frees other nodes made of this node's slots first:
    // they wait in its ring until its next beat. Then the least recently used block of its own
    // size (another size frees nothing usable until one of its slabs empties whole). When that
    // slot was another node's — its free goes to that node's ring, usable after its next beat —
    // the oldest of its size that this node wrote: that slot is in one of its own slabs, free the
    // moment it is evicted. Then the plain LRU: a watermark's worth, at least this block,
    // doubling each round, so the oldest slab of another size empties.
    if (allocator_full && attempt == 0) {
      allocator_.DrainRemoteFrees();
      auto r = allocator_.Alloc(bytes, alloc::Fit::kExact);
      if (r.ok() || r.status().code() != StatusCode::kNoSpace) return r;
    }
    // Several small blocks at once (up to 1/64 of the pool): each eviction round scans the
    // index, and a pool full of small blocks would otherwise scan it once per put.
    const uint64_t batch = std::max(bytes, std::min(bytes * 16, cap / 64));
    uint64_t same = 0;
    if (allocator_full && attempt < 2) same = MakeRoom(batch, bytes, /*only_mine=*/attempt == 1 && !central());
    if (same == 0 && MakeRoom(std::max(bytes << std::min(attempt, 6), high - std::min(high, low))) == 0) {
      // Nothing evicted: every candidate was pinned, or its stripe held by another process just
      // then (readers release within moments). Twice more, a moment apart, before the pool is
      // called full.
      if (++idle_rounds > 2) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1 << idle_rounds));
    }
  }
  Add(kFullErrors, 1);
  return NoSpace("pool full: no room for a block of " + std::to_string(bytes) + " bytes and nothing "
                 "evictable (" + std::to_string(UsedBytes()) + " bytes in pinned or in-flight blocks); "
                 "release pins or grow the pool");
}

uint64_t Index::MakeRoom(uint64_t bytes, uint64_t only_bytes, bool only_mine) {
  // With capacity tiers, room is made by spilling (the node's cxlkvd moves the LRU blocks to its
  // devices); only what that cannot free is dropped.
  CapacityPromoter* tiers = room_maker_.load(std::memory_order_acquire);
  if (tiers != nullptr) {
    const uint64_t spilled = tiers->MakeRoom(bytes);
    if (spilled != 0) {
      // The spiller (another node's process) freed this node's payloads remotely: apply those
      // frees now, or the space waits for this node's next beat.
      allocator_.DrainRemoteFrees();
      return spilled;
    }
  }
  return EvictLru(bytes, only_bytes, only_mine);
}

void Index::MaybeCrash(CrashPoint p) {
  if (crash_at_.load(std::memory_order_relaxed) == p) [[unlikely]] {
    if (p == CrashPoint::kMovePauseAfterMark || p == CrashPoint::kInsertPauseBeforeFence) {  // once: until SIGCONT
      crash_at_.store(CrashPoint::kNone);
      ::raise(SIGSTOP);
      return;
    }
    ::raise(SIGKILL);
  }
}

void Index::FreePayload(uint64_t payload, uint64_t) {
  if (central() && allocator_.HeldByEndedLife(alloc::ObjectOffset(payload))) {
    // Central mode, called once the entry is gone: a payload belongs to the life of the service
    // that reserved it. When that life ended, its allocator recovery settles the object: it is
    // unreachable now, and ReclaimIfUnreachable frees it unless that recovery has run or will (a
    // plain Free racing the recovery would free it twice).
    auto r = allocator_.ReclaimIfUnreachable(alloc::ObjectOffset(payload));
    if (!r.ok()) {
      std::fprintf(stderr, "cxlkv: cache: reclaiming payload %#llx of an ended service life: %s\n",
                   static_cast<unsigned long long>(payload), r.status().ToString().c_str());
    }
    return;
  }
  FreePayloadNow(payload);
}

void Index::FreePayloadNow(uint64_t payload) {
  for (int attempt = 0;; ++attempt) {
    Status s = allocator_.Free(alloc::ObjectOffset(payload));
    if (s.ok() || s.code() != StatusCode::kBusy || attempt == 100) {
      if (!s.ok()) std::fprintf(stderr, "cxlkv: cache: freeing payload %#llx: %s\n",
                                static_cast<unsigned long long>(payload), s.ToString().c_str());
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // owner's ring full: it drains each beat
  }
}

}  // namespace cxlkv::cache
