// Allocator: reclaiming what an ended life of a node held.
#include "alloc/allocator.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <thread>
#include <unordered_set>

namespace cxlkv::alloc {

// ---- recovery of a dead node -----------------------------------------------------------

void Allocator::WaitForPushesInFlight(uint32_t dead, uint32_t inc) {
  if (!tables_[0].has_inboxes()) return;
  auto& m = meta(0);
  // Close every ring of that life first (flushed), then look for announced pushes: a pusher
  // announces, then looks at this word, so one of the two sees the other.
  // The closed word has its own line, written only by recoverers (under the allocator lock).
  // The line is still invalidated before the store: a copy this node read earlier may be
  // stale, and a store into a stale line is written back whole (P2).
  for (uint32_t f = 0; f < max_nodes_; ++f) {
    const uint64_t closed = tables_[0].inbox(dead, f) + kInboxClosedOffset;
    m.Invalidate(closed, 8);
    m.Publish(closed, ClosedWord(inc));
  }
  const auto deadline = sync::Clock::now() + node_.lease() * 2;
  for (uint32_t f = 0; f < max_nodes_; ++f) {
    const uint64_t ring = tables_[0].inbox(dead, f);
    for (;;) {
      const uint64_t word = m.Fetch(ring + kInboxPushingOffset);  // P2: node f writes it
      if (!PushingFor(word, inc) || node_.LifeOver(f, PushingPusherInc(word), 0xfffff)) break;
      if (sync::Clock::now() > deadline || node_.leaving()) {
        // A process of a live node stopped between deciding and publishing a push (paused or
        // killed alone): its push, if it ever lands, waits in the ring for the node's next life.
        std::fprintf(stderr, "cxlkv: allocator: node %u still announces a free into node %u's ring after two "
                     "leases; recovering node %u's life %u without it\n", f, dead, dead, inc);
        break;
      }
      std::this_thread::sleep_for(node_.lease() / 32);
    }
  }
}

void Allocator::WaitForDrainerOfAnotherLife(uint32_t dead, uint32_t inc) {
  if (!tables_[0].has_inboxes()) return;
  auto& m = meta(0);
  // The rings are closed for `inc` already (WaitForPushesInFlight published those words): a
  // drainer that announces from now on sees them and leaves the rings alone; one announced
  // before is waited for, so its head stores are all in before recovery reads a head.
  const uint64_t draining = tables_[0].inbox(dead, dead) + kInboxDrainingOffset;
  const auto deadline = sync::Clock::now() + node_.lease() * 2;
  for (;;) {
    const uint64_t word = m.Fetch(draining);  // P2: the owner's drainer writes it
    if ((word >> 63) == 0) return;
    const uint32_t life = static_cast<uint32_t>(word & 0xfffff);
    // The ended life's own drainer is fenced before it claims; a drainer whose life ended too
    // (or that was killed announced) stores nothing more.
    if (life == inc || node_.LifeOver(dead, life, 0xfffff)) return;
    if (sync::Clock::now() > deadline || node_.leaving()) {
      std::fprintf(stderr, "cxlkv: allocator: node %u's life %u still announces a drain after two leases; "
                   "recovering its life %u without waiting further\n", dead, life, inc);
      return;
    }
    std::this_thread::sleep_for(node_.lease() / 32);
  }
}

void Allocator::TestHookBeforeRecoveryLock(std::function<void()> hook) {
  std::lock_guard<std::mutex> g(test_hooks_mu_);
  test_before_recovery_lock_ = std::move(hook);
  test_hooked_.store(test_before_drain_ || test_after_drain_claim_ || test_before_drain_fence_ ||
                     test_before_recovery_lock_);
}

void Allocator::Recover(uint32_t dead, uint64_t incarnation) {
  if (dead >= max_nodes_) return;
  const uint32_t inc = Inc20(incarnation);
  // Pushes decided while the life still beat are published before its rings are consumed.
  WaitForPushesInFlight(dead, inc);
  if (test_hooked_.load()) {
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> g(test_hooks_mu_);
      hook = test_before_recovery_lock_;
    }
    if (hook) hook();
  }
  // A drain of the node's next life, if one is under way, finishes before the rings are read.
  WaitForDrainerOfAnotherLife(dead, inc);
  // The manager queues each dead life once: giving up here would leak what it held for good.
  // Keep trying (the lock can be slow to get under contention) until this node leaves.
  Status locked = LockAllocator();
  while (!locked.ok() && locked.code() != StatusCode::kCorrupted && !node_.leaving()) {
    std::this_thread::sleep_for(node_.lease() / 8);
    locked = LockAllocator();
  }
  if (!locked.ok()) return;  // leaving: the next manager recovers this life again

  std::vector<uint64_t> roots;
  {
    std::lock_guard<std::mutex> lock(providers_mu_);
    for (auto& p : providers_) p(roots);
  }
  std::unordered_set<uint64_t> reachable(roots.begin(), roots.end());
  // Frees other nodes sent to the dead node: those objects are no longer wanted. We consume
  // its rings for it (it never will). A free of an object an older life of the node left (kept
  // by that life's recovery) is routed like any free once the lock is released.
  std::unordered_set<uint64_t> freed;
  std::vector<ObjectOffset> elsewhere;
  if (tables_[0].has_inboxes()) {
    auto& m = meta(0);
    for (uint32_t f = 0; f < max_nodes_; ++f) {
      const uint64_t ring = tables_[0].inbox(dead, f);
      const uint64_t tail = m.Fetch(ring);
      // However this ring ends (consumed, or corrupt and left for `cxlkv check`), the node's
      // next life may drain it again once this is published (after the head, P4).
      struct MarkRecovered {
        region::MetaAccess& m;
        uint64_t closed;
        uint32_t inc;
        ~MarkRecovered() {
          m.Invalidate(closed, 8);  // P2 before a store: another recoverer may have written it
          m.Publish(closed, RecoveredWord(inc));
        }
      } mark{m, ring + kInboxClosedOffset, inc};
      if (!RingSane(m.Fetch(ring + kInboxHeadOffset), tail)) continue;  // corrupted: left for `cxlkv check`
      uint64_t head = m.Fetch(ring + kInboxHeadOffset);
      for (; head < tail; ++head) {
        const ObjectOffset off(m.Fetch(ring + kInboxEntriesOffset + (head % kInboxEntries) * 8));
        ChunkRef chunk;
        uint64_t within;
        OwnerWord w;
        if (!Locate(off, &chunk, &within, &w)) continue;
        // The node may already run as a newer life (a quick rejoin), and a freer pushes for the
        // life it sees: from the first free of a newer life's object on, the rest of the ring
        // is that life's to drain. Consuming it here dropped those frees, and the objects
        // stayed allocated for that life. (A freer's pushes are in order, so an older life's
        // entries never follow a newer one's.)
        const bool newer_life = w.node == dead && w.incarnation != inc &&
                                (w.kind == ChunkKind::kHeap || w.kind == ChunkKind::kLeasedObject);
        if (newer_life) break;
        if (w.node == dead && w.incarnation == inc) {
          freed.insert(off.raw());
        } else if (w.node == dead && (w.kind == ChunkKind::kOrphanHeap || w.kind == ChunkKind::kLargeHead)) {
          // An earlier life's object that its recovery kept: such chunks are never allocated
          // from again, so the free still names that object. Anything else may have been
          // reallocated since the push (to someone live): dropped, never applied to it.
          elsewhere.push_back(off);
        }
      }
      m.Invalidate(ring + kInboxHeadOffset, 8);  // P2 before a store: the owner's drainer wrote the line
      m.Publish(ring + kInboxHeadOffset, head);
    }
  }
  auto published = [&](uint64_t raw) { return reachable.count(raw) && !freed.count(raw); };

  for (uint32_t r = 0; r < regions_.size(); ++r) {
    const ChunkTableLayout& t = tables_[r];
    auto& m = meta(r);
    for (uint64_t ch = 0; ch < t.chunks(); ++ch) {
      OwnerWord w = OwnerWord::Decode(m.Fetch(t.owner(ch)));
      if (w.node != dead || w.incarnation != inc) continue;
      ChunkRef ref{r, ch};
      if (w.kind == ChunkKind::kLargeHead) {
        if (!t.RunInRange(ch, w.detail)) continue;  // corrupted run length: left for `cxlkv check`
        // A published whole-chunk object stays (anyone may free it later); the rest goes.
        if (!published(OffsetOf(ref, 0).raw())) CommitLocked(r, IntentOp::kFree, ch, w.detail, 0);
        ch += w.detail - 1;
      } else if (w.kind == ChunkKind::kLeased || w.kind == ChunkKind::kLeasedObject) {
        // The dead life's lease ends whatever state its line is in (one intent for the line):
        // free chunks go back to the pool, objects become ordinary one-chunk objects, and those
        // nothing reaches are freed — this one here, the line's later ones as the scan meets them.
        EndLeaseLineLocked(r, ch / kLeaseLineChunks * kLeaseLineChunks,
                           OwnerWord{ChunkKind::kLeased, dead, w.incarnation, 0}.Encode());
        const OwnerWord now = OwnerWord::Decode(m.Fetch(t.owner(ch)));
        if (now.kind == ChunkKind::kLargeHead && !published(OffsetOf(ref, 0).raw())) {
          CommitLocked(r, IntentOp::kFree, ch, 1, 0);
        }
      } else if (w.kind == ChunkKind::kHeap) {
        const uint64_t run = SlabRun(m, t, ch);
        auto h = ReadSlabHeader(m, t, ch);
        // Formatted for this slab: a header line keeps the last slab's values until the next
        // owner formats it, so the owner word it records must be this one, and its length the run.
        const bool formatted = h.magic == kHeapMagic && h.owner == OwnerWord{ChunkKind::kHeap, w.node, w.incarnation, w.detail}.Encode() &&
                               h.slab_chunks == run;
        if (!formatted) {  // died before formatting it
          CommitLocked(r, IntentOp::kFree, ch, run, 0);
          ch += run - 1;
          continue;
        }
        if (!HeapHeaderValid(h, chunk_bytes())) continue;  // corrupted: left for `cxlkv check`
        uint64_t kept = 0;
        uint64_t words = (h.slots + 63) / 64;
        if (h.first_slot != 0) m.Invalidate(ChunkBase(ref), words * 8);
        for (uint64_t wd = 0; wd < words; ++wd) {
          const uint64_t at = SlotBitmapWord(t, ch, h, wd);
          uint64_t bits = m.Load(at), keep = 0;
          for (uint64_t b = bits; b != 0; b &= b - 1) {
            uint64_t slot = wd * 64 + std::countr_zero(b);
            if (slot < h.slots && published(OffsetOf(ref, h.first_slot + slot * h.class_bytes).raw())) {
              keep |= uint64_t{1} << (slot % 64);
            }
          }
          m.Store(at, keep);
          kept += std::popcount(keep);
        }
        if (h.first_slot != 0) m.Flush(ChunkBase(ref), words * 8);
        m.Store(t.header(ch) + offsetof(HeapHeader, used), kept);
        m.Flush(t.header(ch), 64);
        if (kept == 0) {
          CommitLocked(r, IntentOp::kFree, ch, run, 0);
        } else {
          // The head only: its tails keep naming it (and this life), which is how frees and
          // `check` find the orphan's slots.
          OwnerWord orphan{ChunkKind::kOrphanHeap, dead, w.incarnation, w.detail};
          CommitLocked(r, IntentOp::kSetWord, ch, 1, orphan.Encode());
        }
        ch += run - 1;
      }
    }
  }
  UnlockAllocator();
  for (ObjectOffset off : elsewhere) {
    if (Status st = Free(off); !st.ok()) {
      std::fprintf(stderr, "cxlkv: allocator: a free sent to node %u's life %u: %s\n", dead, inc, st.ToString().c_str());
    }
  }
}

std::unordered_set<uint64_t> Allocator::PendingRemoteFreesLocked() {
  std::unordered_set<uint64_t> pending;
  if (!tables_[0].has_inboxes()) return pending;
  auto& m = meta(0);
  for (uint32_t o = 0; o < max_nodes_; ++o) {
    for (uint32_t f = 0; f < max_nodes_; ++f) {
      const uint64_t ring = tables_[0].inbox(o, f);
      const uint64_t tail = m.Fetch(ring), head = m.Fetch(ring + kInboxHeadOffset);
      if (head == tail || !RingSane(head, tail)) continue;
      for (uint64_t i = head; i < tail; ++i) pending.insert(m.Fetch(ring + kInboxEntriesOffset + (i % kInboxEntries) * 8));
    }
  }
  return pending;
}

bool Allocator::HeldByEndedLife(ObjectOffset off) {
  ChunkRef chunk;
  uint64_t within;
  OwnerWord w;
  if (!Locate(off, &chunk, &within, &w)) return false;
  switch (w.kind) {
    case ChunkKind::kOrphanHeap: return true;
    case ChunkKind::kHeap:
    case ChunkKind::kLargeHead:
    case ChunkKind::kLeasedObject: return node_.LifeOver(w.node, w.incarnation, 0xfffff);
    default: return false;
  }
}

Result<bool> Allocator::ReclaimIfUnreachable(ObjectOffset off) {
  ChunkRef chunk;
  uint64_t within;
  OwnerWord unlocked;  // read again under the lock below
  if (!Locate(off, &chunk, &within, &unlocked)) return false;
  CXLKV_RETURN_IF_ERROR(LockAllocator());
  const ChunkTableLayout& t = tables_[chunk.region];
  const uint64_t word = meta(chunk.region).Fetch(t.owner(chunk.chunk));
  const OwnerWord w = OwnerWord::Decode(word);
  // Only what an ended life holds: no one allocates from it any more, so an allocated object
  // at `off` that nothing reaches is garbage whatever happened to the object once there.
  const bool ended_large = w.kind == ChunkKind::kLargeHead && within == 0 && t.RunInRange(chunk.chunk, w.detail) &&
                           node_.LifeOver(w.node, w.incarnation, 0xfffff);
  if (w.kind != ChunkKind::kOrphanHeap && !ended_large) {
    UnlockAllocator();
    return false;
  }
  std::vector<uint64_t> roots;
  {
    std::lock_guard<std::mutex> lock(providers_mu_);
    for (auto& p : providers_) p(roots);
  }
  const bool reachable = std::find(roots.begin(), roots.end(), off.raw()) != roots.end() ||
                         PendingRemoteFreesLocked().count(off.raw()) != 0;
  bool freed = false;
  if (!reachable) {
    if (ended_large) {
      CommitLocked(chunk.region, IntentOp::kFree, chunk.chunk, w.detail, 0);
      freed = true;
    } else {
      freed = FreeSlot(chunk, within, /*orphan=*/true).ok();  // not allocated: freed already
    }
  }
  UnlockAllocator();
  return freed;
}

}  // namespace cxlkv::alloc
