// Index: the batched forms of reserve, commit and abort, and the lock-free peek. A request's
// blocks are the unit of work (DESIGN.md, "Hot paths are batched"): payloads are allocated
// before any stripe lock (the allocator lock sits below the stripe locks: an evictor frees
// under a stripe lock), then each stripe the batch touches is locked once, in ascending stripe
// order and one at a time (no two stripe locks are ever held together, so no lock cycle), and
// the entries claimed under it are flushed in one batch before its release (P1).
#include <xxhash.h>

#include <algorithm>
#include <unordered_map>

#include "cache/index.h"
#include "region/region_internal.h"

namespace cxlkv::cache {

namespace {

struct KeyHash {
  size_t operator()(const BlockKey& k) const { return k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull); }
};

}  // namespace

std::vector<Index::Probe> Index::FindMany(std::span<const BlockKey> keys) {
  std::vector<Probe> out(keys.size());
  std::vector<uint64_t> offs(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    offs[i] = layout_.entry(SlotAt(StripeOf(keys[i]), keys[i].hi % layout_.h.slots_per_stripe));
  }
  if (!CacheIsTable()) meta_.InvalidateEach(offs, sizeof(Entry));  // P2, one fence for the whole batch
  for (size_t i = 0; i < keys.size(); ++i) {
    Entry e = meta_.ReadStruct<Entry>(offs[i]);
    EntryState s = StateOf(e.state);
    if (s == kEmpty) continue;  // an EMPTY home ends the probe: absent
    if (s != kTombstone && e.key_lo == keys[i].lo && e.key_hi == keys[i].hi) {
      out[i].found = static_cast<int64_t>((offs[i] - layout_.h.entries_offset) / sizeof(Entry));
      out[i].entry = e;
      continue;
    }
    out[i] = Find(keys[i]);  // a collision: probe on
  }
  return out;
}

Status Index::CheckBlockBytes(const NamespaceHandle& ns, uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("a block cannot be empty");
  if (bytes > kMaxBlockBytes) {
    return InvalidArgument("block of " + std::to_string(bytes) + " bytes exceeds the 4 GiB limit of one block");
  }
  if (ns.block_bytes != 0 && bytes != ns.block_bytes) {
    return InvalidArgument("block of " + std::to_string(bytes) + " bytes does not match the namespace's KV "
                           "layout (" + std::to_string(ns.block_bytes) + " bytes per block)");
  }
  return Status::Ok();
}

void Index::PresentOutcome(const NamespaceHandle& ns, const Entry& e, KeyReservation& out) {
  if (e.ns != ns.id) {
    out.outcome = ReserveOutcome::kError;
    out.status = InvalidArgument("the key is taken by namespace " + std::to_string(e.ns) +
                                 ": keys are namespace-specific");
    return;
  }
  EntryState s = StateOf(e.state);
  if (s == kReady) {
    Add(kDuplicates, 1);
    out.outcome = ReserveOutcome::kAlreadyCached;
    out.status = AlreadyExists("block is already cached (READY)");
    return;
  }
  Add(kBusy, 1);
  out.outcome = ReserveOutcome::kBusy;
  if (s == kWriting) {
    out.writer_node = WriterNode(e.writer);
    out.writer_incarnation = WriterInc(e.writer);
    out.status = Busy("block is being written by node " + std::to_string(out.writer_node));
  } else {
    out.status = Busy("block is being evicted; retry");
  }
}

bool Index::ClaimLocked(const NamespaceHandle& ns, const BlockKey& key, uint64_t payload, uint64_t bytes,
                        KeyReservation& out, uint64_t* written) {
  const uint64_t stripe = StripeOf(key);
  Probe p = Find(key);
  if (p.found >= 0 && StateOf(p.entry.state) == kWriting && !WriterLive(p.entry.writer)) {
    // Its writer's life ended and recovery has not reached it (or skipped this stripe): the
    // entry is reclaimed here, as recovery would (its payload is the allocator's to reclaim).
    TombstoneLocked(static_cast<uint64_t>(p.found), GenOf(p.entry.state));
    Add(kBytesReleased, p.entry.bytes);
    Add(kReclaimed, 1);
    // Central mode: the payload is the service's (its life's recovery kept it: WRITING entries
    // reach their payloads there), not the dead writer's: free it here. The central writer's
    // "stripe lock" is a local mutex, so freeing under it blocks no one.
    if (central_writer()) FreePayload(p.entry.payload, p.entry.bytes);
    p = Find(key);
  }
  if (p.found < 0 && p.free_slot < 0) {
    // The stripe is full: make room by evicting its least recently used unpinned entry.
    std::vector<std::pair<uint64_t, uint64_t>> ready;  // (stamp, slot)
    for (uint32_t i = 0; i < layout_.h.slots_per_stripe; ++i) {
      Entry e = ReadEntry(SlotAt(stripe, i));
      if (StateOf(e.state) == kReady) ready.push_back({e.stamp_us, SlotAt(stripe, i)});
    }
    std::sort(ready.begin(), ready.end());
    for (auto [stamp, slot] : ready) {
      if (TryEvictLocked(slot, GenOf(FetchTableWord(layout_.entry(slot))))) break;
    }
    p = Find(key);
  }
  if (p.found >= 0) {
    PresentOutcome(ns, p.entry, out);
    return false;
  }
  if (p.free_slot < 0) {
    Add(kFullErrors, 1);
    out.outcome = ReserveOutcome::kError;
    out.status = NoSpace("index stripe " + std::to_string(stripe) + " is full of pinned or in-flight blocks (" +
                         std::to_string(layout_.h.slots_per_stripe) + " slots): release pins, or re-create the "
                         "pool with more --index-entries");
    return false;
  }
  const uint64_t slot = static_cast<uint64_t>(p.free_slot);
  const uint64_t off = layout_.entry(slot);
  const uint64_t gen = GenOf(meta_.Load(off)) + 1;
  Entry e{};
  e.state = StateWord(gen, kWriting);
  e.key_lo = key.lo;
  e.key_hi = key.hi;
  e.payload = payload;
  e.bytes = static_cast<uint32_t>(bytes);
  e.tier = 0;
  e.ns = static_cast<uint16_t>(ns.id);
  e.writer = MyWriterWord();
  reserved_any_.store(true, std::memory_order_relaxed);
  e.stamp_us = NowStamp();
  meta_.WriteStruct(off, e);  // flushed with the rest of the stripe's claims before the release
  Add(kBytesClaimed, bytes);
  out.outcome = ReserveOutcome::kReserved;
  out.status = Status::Ok();
  out.reservation = Reservation{static_cast<uint32_t>(slot), gen, payload, bytes, true};
  *written = off;
  return true;
}

Result<std::vector<KeyReservation>> Index::ReserveMany(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                                       uint64_t bytes) {
  CXLKV_RETURN_IF_ERROR(CheckHandle(ns));
  CXLKV_RETURN_IF_ERROR(CheckBlockBytes(ns, bytes));
  std::vector<KeyReservation> out(keys.size());
  if (keys.empty()) return out;

  // 1. Repeats within the batch: only a key's first occurrence is reserved; a later one ends as
  //    a second Reserve of the same key would (busy, this node writing; or the first's outcome).
  std::vector<int64_t> first_of(keys.size(), -1);
  {
    std::unordered_map<BlockKey, size_t, KeyHash> seen;
    seen.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      auto [it, fresh] = seen.emplace(keys[i], i);
      if (!fresh) first_of[i] = static_cast<int64_t>(it->second);
    }
  }

  // 2. A lock-free look first: most duplicate inserts end here without allocating (a WRITING
  //    entry whose writer is gone is reclaimed under the lock below).
  std::vector<size_t> todo;
  todo.reserve(keys.size());
  {
    std::vector<BlockKey> uniq;
    std::vector<size_t> where;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (first_of[i] < 0) {
        uniq.push_back(keys[i]);
        where.push_back(i);
      }
    }
    std::vector<Probe> hints = FindMany(uniq);
    for (size_t u = 0; u < uniq.size(); ++u) {
      const Probe& h = hints[u];
      if (h.found >= 0 && !(StateOf(h.entry.state) == kWriting && !WriterLive(h.entry.writer))) {
        PresentOutcome(ns, h.entry, out[where[u]]);
      } else {
        todo.push_back(where[u]);
      }
    }
  }

  // 3. Payloads, before any stripe lock (lock order: stripe above allocator).
  std::vector<uint64_t> payload(keys.size(), 0);
  bool batched = false;
  if (!todo.empty()) {
    // Below the high watermark the whole batch is one AllocMany (one chunk-lease refill at
    // most); otherwise one at a time, evicting as needed.
    const uint64_t want = bytes * todo.size();
    const uint64_t high = PercentOf(capacity_, layout_.h.high_watermark_pct);
    if (want / todo.size() == bytes && UsedBytes() + want <= high) {
      auto many = allocator_.AllocMany(bytes, todo.size(), alloc::Fit::kExact);
      if (many.ok()) {
        for (size_t k = 0; k < todo.size(); ++k) payload[todo[k]] = (*many)[k].raw();
        batched = true;
      }
    }
  }
  if (!batched) {
    std::vector<size_t> placed;
    placed.reserve(todo.size());
    for (size_t i : todo) {
      auto a = AllocatePayload(bytes);
      if (!a.ok()) {
        out[i].outcome = ReserveOutcome::kError;
        out[i].status = a.status();
        continue;
      }
      payload[i] = a->raw();
      placed.push_back(i);
    }
    todo.swap(placed);
  }

  // 4. One stripe lock per stripe touched, ascending; claims flushed in one batch per stripe.
  std::stable_sort(todo.begin(), todo.end(),
                   [&](size_t a, size_t b) { return StripeOf(keys[a]) < StripeOf(keys[b]); });
  std::vector<uint64_t> unused;  // payloads to free after the locks
  std::vector<uint64_t> written;
  for (size_t g = 0; g < todo.size();) {
    const uint32_t stripe = static_cast<uint32_t>(StripeOf(keys[todo[g]]));
    size_t end = g;
    while (end < todo.size() && StripeOf(keys[todo[end]]) == stripe) ++end;
    if (Status s = LockStripe(stripe); !s.ok()) {
      for (size_t k = g; k < end; ++k) {
        out[todo[k]].outcome = ReserveOutcome::kError;
        out[todo[k]].status = s;
        unused.push_back(payload[todo[k]]);
      }
      g = end;
      continue;
    }
    written.clear();
    for (size_t k = g; k < end; ++k) {
      const size_t i = todo[k];
      uint64_t off = 0;
      if (ClaimLocked(ns, keys[i], payload[i], bytes, out[i], &off)) {
        written.push_back(off);
      } else {
        unused.push_back(payload[i]);
      }
    }
    if (!written.empty()) MaybeCrash(CrashPoint::kReserveHoldingLock);
    meta_.FlushEach(written, sizeof(Entry));  // P1: the claims reach memory before the release
    UnlockStripe(stripe);
    g = end;
  }
  for (uint64_t p : unused) FreePayload(p, bytes);

  // 5. Repeats take their first occurrence's outcome, as a second Reserve would have.
  for (size_t i = 0; i < keys.size(); ++i) {
    if (first_of[i] < 0) continue;
    const KeyReservation& first = out[static_cast<size_t>(first_of[i])];
    KeyReservation& o = out[i];
    if (first.outcome == ReserveOutcome::kReserved) {
      Add(kBusy, 1);
      o.outcome = ReserveOutcome::kBusy;
      o.writer_node = WriterNode(MyWriterWord());
      o.writer_incarnation = WriterInc(MyWriterWord());
      o.status = Busy("block is being written by node " + std::to_string(o.writer_node) +
                      " (repeated within the batch)");
    } else {
      o = first;
      if (o.outcome == ReserveOutcome::kAlreadyCached) Add(kDuplicates, 1);
      if (o.outcome == ReserveOutcome::kBusy) Add(kBusy, 1);
    }
  }
  return out;
}

// Commit takes the stripe lock of each stripe touched (one per stripe, ascending, one at a
// time) and passes the fence under it: a writer paused past its lease between Reserve and
// Commit may have been declared dead, its WRITING entry reclaimed and the slot reserved again
// by another node. Under the lock, with the hold fenced, the check "still WRITING, same
// generation, written by this life" and the READY store cannot be separated by a reclaim.
Status Index::CommitMany(std::span<Reservation> rs) {
  Status first_error;
  auto fail = [&](Status s) {
    if (first_error.ok()) first_error = std::move(s);
  };
  std::vector<Reservation*> live;
  live.reserve(rs.size());
  for (Reservation& r : rs) {
    if (!r.open) {
      fail(InvalidArgument("reservation is not open (committed or aborted already)"));
      continue;
    }
    live.push_back(&r);
  }
  // Checksums before any lock: the payload is this writer's own (non-temporal stores, P3).
  std::vector<uint64_t> sums(live.size(), 0);
  if (checksums()) {
    for (size_t i = 0; i < live.size(); ++i) {
      const uint8_t* p = Payload(live[i]->offset, live[i]->bytes);
      if (meta_.mode() == CoherenceMode::kSoftware) region::InvalidateLinesOpt(p, live[i]->bytes);
      sums[i] = XXH3_64bits(p, live[i]->bytes);
    }
  }
  std::vector<size_t> order(live.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const uint32_t per_stripe = layout_.h.slots_per_stripe;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return live[a]->slot / per_stripe < live[b]->slot / per_stripe; });
  uint64_t committed = 0, bytes = 0;
  std::vector<uint64_t> offs;
  std::vector<size_t> mine;
  for (size_t g = 0; g < order.size();) {
    const uint32_t stripe = live[order[g]]->slot / per_stripe;
    size_t end = g;
    while (end < order.size() && live[order[end]]->slot / per_stripe == stripe) ++end;
    Status locked = LockStripe(stripe);
    const bool held = locked.ok();
    if (held) {  // the fence, under the lock: the stripe lock's hold, or the service's
      locked = central_writer() ? central_fence_() : node_.CheckHeld(layout_.stripe_lock(stripe));
    }
    if (!locked.ok()) {
      // Not granted: the entries stay WRITING (retry or abort). Fenced: this life is over and
      // its recovery drops them; the reservations are closed.
      if (locked.code() == StatusCode::kLeaseExpired) {
        for (size_t k = g; k < end; ++k) live[order[k]]->open = false;
      }
      fail(locked);
      if (held) UnlockStripe(stripe);
      g = end;
      continue;
    }
    // The life that holds the lock, checked just now: only its own reservations commit (taken
    // before the lock, a paused writer's old life would still match its old entries).
    const uint64_t writer = MyWriterWord();
    offs.clear();
    mine.clear();
    for (size_t k = g; k < end; ++k) offs.push_back(layout_.entry(live[order[k]]->slot));
    if (!CacheIsTable()) meta_.InvalidateEach(offs, sizeof(Entry));  // P2: a reclaim on another node rewrote it
    for (size_t k = g; k < end; ++k) {
      Reservation& r = *live[order[k]];
      const uint64_t off = offs[k - g];
      const uint64_t entry_writer = meta_.Load(off + offsetof(Entry, writer));
      if (meta_.Load(off) != StateWord(r.generation, kWriting)) {
        r.open = false;
        fail(NotFound("reservation was reclaimed: this node was presumed dead (its lease expired)"));
        continue;
      }
      if (entry_writer != writer && WriterInc(entry_writer) == WriterInc(writer)) {
        r.open = false;
        fail(InvalidArgument("commit refused: the block was reserved by another process of node " +
                             std::to_string(WriterNode(writer)) + " (slot " + std::to_string(WriterSlot(entry_writer)) +
                             "); a reservation commits in the process that made it"));
        continue;
      }
      if (entry_writer != writer) {  // reserved by an earlier life of this node: that life is over
        r.open = false;
        fail(LeaseExpired("commit refused: the block was reserved by node " + std::to_string(WriterNode(writer)) +
                          "'s life " + std::to_string(WriterInc(entry_writer)) + ", which ended (paused or "
                          "silent past its lease); its recovery drops the block: reserve it again"));
        continue;
      }
      meta_.Store(off + offsetof(Entry, checksum), sums[order[k]]);
      meta_.Store(off + offsetof(Entry, stamp_us), NowStamp());
      mine.push_back(k - g);
    }
    // Fields first, flushed; then each state word READY, flushed (P4).
    std::vector<uint64_t> done;
    for (size_t m : mine) done.push_back(offs[m]);
    meta_.FlushEach(done, sizeof(Entry));
    for (size_t m : mine) {
      Reservation& r = *live[order[g + m]];
      meta_.Store(offs[m], StateWord(r.generation, kReady));
      r.open = false;
      ++committed;
      bytes += r.bytes;
    }
    meta_.FlushEach(done, 8);
    UnlockStripe(stripe);
    g = end;
  }
  if (committed != 0) {
    Add(kInserts, committed);
    Add(kInsertBytes, bytes);
  }
  return first_error;
}

Status Index::AbortMany(std::span<Reservation> rs) {
  Status first_error;
  auto fail = [&](Status s) {
    if (first_error.ok()) first_error = std::move(s);
  };
  std::vector<Reservation*> open;
  open.reserve(rs.size());
  for (Reservation& r : rs) {
    if (!r.open) {
      fail(InvalidArgument("reservation is not open (committed or aborted already)"));
      continue;
    }
    r.open = false;
    open.push_back(&r);
  }
  std::stable_sort(open.begin(), open.end(), [&](const Reservation* a, const Reservation* b) {
    return layout_.stripe_of(a->slot) < layout_.stripe_of(b->slot);
  });
  std::vector<uint64_t> to_free;
  for (size_t g = 0; g < open.size();) {
    const uint32_t stripe = layout_.stripe_of(open[g]->slot);
    size_t end = g;
    while (end < open.size() && layout_.stripe_of(open[end]->slot) == stripe) ++end;
    if (Status s = LockStripe(stripe); !s.ok()) {
      fail(s);
      g = end;
      continue;
    }
    for (size_t k = g; k < end; ++k) {
      Reservation& r = *open[k];
      if (FetchTableWord(layout_.entry(r.slot)) != StateWord(r.generation, kWriting)) {
        fail(NotFound("reservation was reclaimed: this node was presumed dead (its lease expired)"));
        continue;
      }
      TombstoneLocked(r.slot, r.generation);
      Add(kBytesReleased, r.bytes);
      Add(kAborts, 1);
      to_free.push_back(r.offset);
    }
    UnlockStripe(stripe);
    g = end;
  }
  for (uint64_t p : to_free) FreePayload(p, 0);
  return first_error;
}

Result<std::vector<KeyPeek>> Index::Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  CXLKV_RETURN_IF_ERROR(CheckHandle(ns));
  std::vector<Probe> probes = FindMany(keys);
  std::vector<KeyPeek> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const Probe& p = probes[i];
    if (p.found < 0) continue;  // kAbsent
    if (p.entry.ns != ns.id) {
      return InvalidArgument("a key was made in namespace " + std::to_string(p.entry.ns) + ", not " +
                             std::to_string(ns.id) + ": keys are namespace-specific");
    }
    switch (StateOf(p.entry.state)) {
      case kReady: out[i].state = PeekState::kReady; break;
      case kWriting:
        out[i].state = PeekState::kWriting;
        out[i].writer_node = WriterNode(p.entry.writer);
        out[i].writer_incarnation = WriterInc(p.entry.writer);
        out[i].writer_live = WriterLive(p.entry.writer);
        break;
      case kEvicting: out[i].state = PeekState::kOther; break;
      default: break;
    }
  }
  return out;
}

}  // namespace cxlkv::cache
