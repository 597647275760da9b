// Allocator: frees — in place by the owner, through the owner's remote-free ring from other
// nodes, under the allocator lock for whole-chunk objects and for chunks of ended lives.
#include "alloc/allocator.h"

namespace cxlkv::alloc {

// ---- frees -----------------------------------------------------------------------------

Status Allocator::FreeSlot(ChunkRef chunk, uint64_t within, bool orphan, uint32_t life20) {
  auto& m = meta(chunk.region);
  const ChunkTableLayout& t = tables_[chunk.region];
  const uint64_t line = t.header(chunk.chunk);
  if (orphan) m.Invalidate(line, 64);
  auto h = m.ReadStruct<HeapHeader>(line);
  if (h.magic == kHeapMagic && !HeapHeaderValid(h, chunk_bytes())) {
    return Corrupted("heap slab at chunk " + std::to_string(chunk.chunk) + " of region " + std::to_string(chunk.region) +
                     " has a corrupt header (class " + std::to_string(h.class_bytes) + " bytes, " +
                     std::to_string(h.slab_chunks) + " chunks, " + std::to_string(h.slots) +
                     " slots): run 'cxlkv check'");
  }
  if (h.magic != kHeapMagic || within < h.first_slot || (within - h.first_slot) % h.class_bytes != 0 ||
      (within - h.first_slot) / h.class_bytes >= h.slots) {
    return InvalidArgument("offset is not the start of an object (corrupted or foreign offset)");
  }
  uint64_t slot = (within - h.first_slot) / h.class_bytes;
  uint64_t off = SlotBitmapWord(t, chunk.chunk, h, slot / 64);
  if (orphan) m.Invalidate(off, 8);
  uint64_t bits = m.Load(off);
  uint64_t bit = uint64_t{1} << (slot % 64);
  if (!(bits & bit)) return InvalidArgument("object is not allocated (double free?)");
  if (!orphan && test_before_heap_free_) test_before_heap_free_();
  if (!orphan) CXLKV_RETURN_IF_ERROR(FenceOwnStore("heap free", life20));  // orphans: under the allocator lock
  m.Store(off, bits & ~bit);
  m.Store(line + offsetof(HeapHeader, used), h.used - 1);
  if (h.first_slot != 0) m.Flush(off, 8);  // an inline bitmap word is flushed with its header line
  m.Flush(line, 64);
  if (h.used - 1 == 0) {
    // An empty slab goes back to the pool, unless it is the node's current one for its size.
    uint64_t id = ((uint64_t{chunk.region} << 40) | chunk.chunk) + 1;
    if (!orphan && CurrentEntryFor(h.class_bytes, id) != nullptr) return Status::Ok();
    if (!orphan) CXLKV_RETURN_IF_ERROR(LockAllocator());
    FreeSlabLocked(chunk);
    if (!orphan) UnlockAllocator();
  }
  return Status::Ok();
}

Status Allocator::Free(ObjectOffset off, int reroutes) {
  ChunkRef chunk;
  uint64_t within;
  OwnerWord w;
  if (!Locate(off, &chunk, &within, &w)) {
    return InvalidArgument("offset 0x" + std::to_string(off.raw()) + " is not inside this pool's data area");
  }
  const ChunkTableLayout& t = tables_[chunk.region];
  switch (w.kind) {
    case ChunkKind::kLargeHead: {
      if (within != 0) return InvalidArgument("offset points inside a large object, not at its start");
      if (!t.RunInRange(chunk.chunk, w.detail)) {
        return Corrupted("chunk " + std::to_string(chunk.chunk) + " of region " + std::to_string(chunk.region) +
                         " heads a run of " + std::to_string(w.detail) + " chunks past the table's " +
                         std::to_string(t.chunks()) + ": run 'cxlkv check'");
      }
      CXLKV_RETURN_IF_ERROR(LockAllocator());
      // Re-read under the lock: another node may have freed it meanwhile.
      uint64_t again = meta(chunk.region).Fetch(t.owner(chunk.chunk));
      if (again != w.Encode()) {
        UnlockAllocator();
        return InvalidArgument("large object is not allocated (double free?)");
      }
      CommitLocked(chunk.region, IntentOp::kFree, chunk.chunk, w.detail, 0);
      UnlockAllocator();
      return Status::Ok();
    }
    case ChunkKind::kHeap:
    case ChunkKind::kLeasedObject: {
      const bool leased = w.kind == ChunkKind::kLeasedObject;
      if (leased && within != 0) return InvalidArgument("offset points inside a whole-chunk object, not at its start");
      if (w.node == node_.id() && w.incarnation == Inc20(node_.incarnation())) {
        sync::LockRobust(&node_.local().header().heap_mu);
        Status s = leased ? FreeLeasedLocked(chunk, w) : FreeSlot(chunk, within, /*orphan=*/false, w.incarnation);
        pthread_mutex_unlock(&node_.local().header().heap_mu);
        return s;
      }
      // The owner is the only writer of its heap chunk or leased line: while its life goes on
      // the free goes through its ring; once over, in place under the allocator lock.
      CXLKV_ASSIGN_OR_RETURN(bool pushed, PushWhileOwnerLives(w, off));
      if (pushed) return Status::Ok();
      CXLKV_RETURN_IF_ERROR(LockAllocator());
      Status s = Status::Ok();
      if (meta(chunk.region).Fetch(t.owner(chunk.chunk)) != w.Encode()) {
        // Recovery changed the chunk meanwhile: orphaned the heap chunk, or kept the leased
        // object as an ordinary one-chunk object. Route again (at most once more: recovery
        // never turns a chunk back into a live life's).
        UnlockAllocator();
        return ++reroutes > 1 ? Internal("the owner word of chunk " + std::to_string(chunk.chunk) +
                                         " kept changing during a free; retry") : Free(off, reroutes);
      }
      if (leased) {
        FreeEndedLifeLeasedLocked(chunk, w);
      } else {
        s = FreeSlot(chunk, within, /*orphan=*/true);
      }
      UnlockAllocator();
      return s;
    }
    case ChunkKind::kOrphanHeap: {
      CXLKV_RETURN_IF_ERROR(LockAllocator());
      Status s = FreeSlot(chunk, within, /*orphan=*/true);
      UnlockAllocator();
      return s;
    }
    default:
      return InvalidArgument("offset is not in an allocated chunk (double free?)");
  }
}

void Allocator::FreeEndedLifeLeasedLocked(ChunkRef chunk, OwnerWord w) {
  // The ended life's lease ends with its first free in place (one intent for the line, P5):
  // its free chunks go back to the pool, its objects stay as one-chunk objects of that life
  // (its recovery frees those nothing reaches), and this one is freed.
  const uint64_t first = chunk.chunk / kLeaseLineChunks * kLeaseLineChunks;
  EndLeaseLineLocked(chunk.region, first, OwnerWord{ChunkKind::kLeased, w.node, w.incarnation, 0}.Encode());
  CommitLocked(chunk.region, IntentOp::kFree, chunk.chunk, 1, 0);
}

Result<bool> Allocator::PushWhileOwnerLives(OwnerWord w, ObjectOffset off) {
  // Neither beating nor declared dead yet (silent for less than a lease): wait — never touch
  // a heap whose owner may still write it.
  for (auto deadline = sync::Clock::now() + node_.lease() * 2;;) {
    if (node_.LifeOver(w.node, w.incarnation, 0xfffff) || RingClosed(w)) return false;
    CXLKV_ASSIGN_OR_RETURN(bool pushed, PushRemoteFree(w, off));
    if (pushed) return true;
    if (sync::Clock::now() > deadline || node_.leaving()) {
      return Busy("node " + std::to_string(w.node) + " is neither beating nor declared dead; retry the free");
    }
    std::this_thread::sleep_for(node_.lease() / 8);
  }
}

bool Allocator::RingClosed(OwnerWord owner) {
  if (owner.node >= max_nodes_ || !tables_[0].has_inboxes()) return false;
  const uint64_t ring = tables_[0].inbox(owner.node, node_.id());
  return ClosedFor(meta(0).Fetch(ring + kInboxClosedOffset), owner.incarnation);
}

Result<bool> Allocator::PushRemoteFree(OwnerWord owner, ObjectOffset off) {
  if (owner.node >= max_nodes_ || !tables_[0].has_inboxes()) return Internal("no remote-free ring");
  auto& m = meta(0);
  const uint64_t ring = tables_[0].inbox(owner.node, node_.id());
  auto& mu = node_.local().header().inbox_mu;
  sync::LockRobust(&mu);  // one producer per ring: the processes of this node take turns
  const uint64_t tail = m.Load(ring);
  auto deadline = sync::Clock::now() + node_.lease() * 2;
  while (tail - m.Fetch(ring + kInboxHeadOffset) >= kInboxEntries) {  // P2: the consumer advances the head
    if (node_.LifeOver(owner.node, owner.incarnation, 0xfffff)) {
      pthread_mutex_unlock(&mu);
      return false;  // no one drains it for that life any more: the caller frees in place
    }
    if (sync::Clock::now() > deadline) {
      pthread_mutex_unlock(&mu);
      return Busy("node " + std::to_string(owner.node) + " has not drained its remote frees for two "
                  "leases; the object stays allocated; retry later");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Announce the push before deciding it (a Dekker pair with recovery): the owner's recovery
  // reads this word after it saw the life end, and waits while it names that life. So either
  // the liveness check below sees the life over, or recovery sees the push in flight and
  // consumes the ring only after it is published. Without it, a push decided just before a
  // clean leave lands after recovery consumed the ring, and the object is never freed.
  m.Publish(ring + kInboxPushingOffset, PushingWord(owner.incarnation, Inc20(node_.incarnation())));
  // P2: the recoverer writes the closed word. Closed for this life: its recovery has begun and
  // may have consumed the ring already, whatever this process's view of the owner says.
  const bool closed = ClosedFor(m.Fetch(ring + kInboxClosedOffset), owner.incarnation);
  if (closed || !node_.SurelyLive(owner.node, owner.incarnation, 0xfffff)) {
    m.Publish(ring + kInboxPushingOffset, 0);
    pthread_mutex_unlock(&mu);
    return false;
  }
  if (test_before_push_) [[unlikely]] test_before_push_();
  const uint64_t entry = ring + kInboxEntriesOffset + (tail % kInboxEntries) * 8;
  m.Store(entry, off.raw());
  m.Flush(entry, 8);  // payload of the message first (P4)...
  // ...then the tail that makes it visible, and the announcement retired, in one line.
  m.Store(ring, tail + 1);
  m.Store(ring + kInboxPushingOffset, 0);
  m.Flush(ring, 16);
  pthread_mutex_unlock(&mu);
  return true;
}

void Allocator::TestHookDrain(std::function<void()> before, std::function<void()> after_claim,
                              std::function<void()> before_fence) {
  std::lock_guard<std::mutex> g(test_hooks_mu_);
  test_before_drain_ = std::move(before);
  test_after_drain_claim_ = std::move(after_claim);
  test_before_drain_fence_ = std::move(before_fence);
  test_hooked_.store(test_before_drain_ || test_after_drain_claim_ || test_before_drain_fence_ ||
                     test_before_recovery_lock_);
}

void Allocator::DrainRemoteFrees() {
  if (!tables_[0].has_inboxes()) return;
  auto hook = [&](std::function<void()> Allocator::*which) {
    if (!test_hooked_.load()) return;
    std::function<void()> f;
    {
      std::lock_guard<std::mutex> g(test_hooks_mu_);
      f = this->*which;
    }
    if (f) f();
  };
  hook(&Allocator::test_before_drain_);
  // Every process of the node drains (each beat, and a reserve that made room): two at once
  // would both apply entries between the same head and tail — a second free of a slot that may
  // have been allocated again in between. One at a time; a busy drainer does the work.
  pthread_mutex_t* drain_mu = &node_.local().header().drain_mu;
  if (sync::TryLockRobust(drain_mu) < 0) return;
  struct Unlock {
    pthread_mutex_t* mu;
    ~Unlock() { pthread_mutex_unlock(mu); }
  } unlock{drain_mu};
  // What a drainer killed between claiming and applying left (it may have died holding
  // drain_mu, or have been the last to hold it cleanly; the claim says which entries remain).
  FinishDrainClaim();
  auto& m = meta(0);
  sync::LocalDrainClaim& claim = node_.local().header().drain_claim;
  static_assert(kInboxEntries <= sync::kLocalDrainClaimEntries);
  // Announced before any ring's closed word is read (the Dekker pair with recovery, see
  // kInboxDrainingOffset); withdrawn when the pass ends, however it ends.
  const uint32_t life = Inc20(node_.incarnation());
  const uint64_t draining = tables_[0].inbox(node_.id(), node_.id()) + kInboxDrainingOffset;
  m.Publish(draining, DrainingWord(life));
  struct Withdraw {
    region::MetaAccess& m;
    uint64_t word;
    ~Withdraw() { m.Publish(word, 0); }
  } withdraw{m, draining};
  for (uint32_t f = 0; f < max_nodes_; ++f) {
    uint64_t ring = tables_[0].inbox(node_.id(), f);
    // An earlier life's recovery consumes this ring now (or will, having closed it): left to it
    // until it marks the ring recovered.
    if (OtherLifesRecoveryUnderWay(m.Fetch(ring + kInboxClosedOffset), life)) continue;
    uint64_t tail = m.Fetch(ring);
    uint64_t head = m.Fetch(ring + kInboxHeadOffset);
    if (head == tail) continue;
    if (!RingSane(head, tail)) continue;  // corrupted: left for `cxlkv check` (never looped over)
    // Claimed before applied: the entries are copied out into the node's claim, the head
    // published, and only then are the frees applied, each marked started first. Applying first
    // and publishing after could apply them twice — a free of a slot allocated again meanwhile,
    // a live block's payload lost. A drainer killed in between leaves the rest in the claim for
    // the node's next drainer (FinishDrainClaim); at most the entry it was applying is lost.
    // Fenced: a node silent past its lease may have been presumed dead, its rings and heap
    // taken over by a recoverer; it leaves them alone (they are the recoverer's now).
    hook(&Allocator::test_before_drain_fence_);
    if (!node_.Fence("remote-free drain").ok()) return;
    claim.count = 0;  // not valid while it is written
    claim.incarnation = node_.incarnation();
    claim.freer = f;
    claim.tail = tail;
    claim.next = 0;
    uint32_t n = 0;
    for (uint64_t at = head; at < tail; ++at) claim.offsets[n++] = m.Fetch(ring + kInboxEntriesOffset + (at % kInboxEntries) * 8);
    std::atomic_thread_fence(std::memory_order_release);
    claim.count = n;
    m.Invalidate(ring + kInboxHeadOffset, 8);  // P2 before a store: a recoverer may have written the line
    m.Publish(ring + kInboxHeadOffset, tail);
    hook(&Allocator::test_after_drain_claim_);
    ApplyDrainClaim();
  }
}

void Allocator::FinishDrainClaim() {
  sync::LocalDrainClaim& claim = node_.local().header().drain_claim;
  if (claim.count == 0) return;
  // Values of node-local memory a dead process wrote: checked before use like any other.
  const bool sane = claim.count <= kInboxEntries && claim.next <= claim.count && claim.freer < max_nodes_;
  // Only this life's claim, and only once its head was published: a head still short of `tail`
  // means the entries are still in the ring (the drainer died before publishing) and the
  // drain below takes them. An earlier life's claim belongs to that life's recovery.
  if (sane && claim.incarnation == node_.incarnation() && node_.Fence("remote-free drain").ok() &&
      meta(0).Fetch(tables_[0].inbox(node_.id(), claim.freer) + kInboxHeadOffset) == claim.tail) {
    ApplyDrainClaim();
  }
  claim.count = 0;
}

void Allocator::ApplyDrainClaim() {
  sync::LocalDrainClaim& claim = node_.local().header().drain_claim;
  while (claim.next < claim.count) {
    const uint64_t raw = claim.offsets[claim.next];
    ++claim.next;  // started: never applied twice, at most this one lost to a kill
    std::atomic_thread_fence(std::memory_order_seq_cst);
    ApplyRemoteFree(ObjectOffset(raw));
  }
  claim.count = 0;
}

void Allocator::ApplyRemoteFree(ObjectOffset off) {
  ChunkRef chunk;
  uint64_t within;
  OwnerWord w;
  if (!Locate(off, &chunk, &within, &w)) return;
  const uint64_t owner = tables_[chunk.region].owner(chunk.chunk);
  const bool node_owned = w.kind == ChunkKind::kHeap || w.kind == ChunkKind::kLeasedObject;
  const bool mine = node_owned && w.node == node_.id() && w.incarnation == Inc20(node_.incarnation());
  if (!mine) {
    // Pushed for an earlier life of this node. If that life's recovery kept the object (an
    // orphan slot, a whole-chunk object: never allocated from again), the free still names
    // it: route it like any free. Otherwise the chunk may be someone else's by now: drop it.
    // A leased object of this very life whose lease ended (EndLease) is such an object too.
    const bool kept = w.node == node_.id() && (w.kind == ChunkKind::kOrphanHeap || w.kind == ChunkKind::kLargeHead);
    if (kept) (void)Free(off);
    return;
  }
  sync::LockRobust(&node_.local().header().heap_mu);
  // Looked at again under the heap lock: a recovery that presumed this life over may have
  // orphaned the chunk since; the object is then freed in place as any orphan's (Free routes
  // it). Any other change means it is not ours to free.
  if (const uint64_t again = meta(chunk.region).Fetch(owner); again != w.Encode()) {
    pthread_mutex_unlock(&node_.local().header().heap_mu);
    const OwnerWord now = OwnerWord::Decode(again);
    if (now.node == node_.id() && (now.kind == ChunkKind::kOrphanHeap || now.kind == ChunkKind::kLargeHead)) {
      (void)Free(off);
    }
    return;
  }
  if (w.kind == ChunkKind::kHeap) {
    (void)FreeSlot(chunk, within, false, w.incarnation);
  } else if (within == 0) {
    (void)FreeLeasedLocked(chunk, w);
  }
  pthread_mutex_unlock(&node_.local().header().heap_mu);
}

}  // namespace cxlkv::alloc
