#include "alloc/allocator.h"

#include <algorithm>
#include <bit>
#include <unordered_set>

#include "region/coherence.h"

namespace cxlkv::alloc {
namespace {

uint32_t ClassFor(uint64_t bytes) {
  uint32_t c = 0;
  while (Allocator::ClassBytes(c) < bytes) ++c;
  return c;
}

}  // namespace

Allocator::Allocator(std::vector<Region*> regions, sync::Node& node, AllocatorOptions options)
    : regions_(std::move(regions)), node_(node), max_nodes_(regions_[0]->info().max_nodes) {
  for (Region* r : regions_) tables_.emplace_back(r->impl(), max_nodes_);
  lease_lines_ = (uint64_t{options.lease_chunks} + kLeaseLineChunks - 1) / kLeaseLineChunks;
  // A lease is whole 64-byte lines of owner words (P5): only where owner words are line-aligned.
  for (const auto& t : tables_) {
    if (t.valid() && t.owner(0) % 64 != 0) leasable_ = false;
  }
}

bool Allocator::Locate(ObjectOffset off, ChunkRef* c, uint64_t* within) const {
  if (off.is_null() || off.region_index() >= regions_.size()) return false;
  const ChunkTableLayout& t = tables_[off.region_index()];
  if (!t.valid() || off.byte_offset() < t.data_offset()) return false;
  uint64_t rel = off.byte_offset() - t.data_offset();
  c->region = off.region_index();
  c->chunk = rel / t.chunk_bytes();
  *within = rel % t.chunk_bytes();
  return c->chunk < t.chunks();
}

uint8_t* Allocator::Ptr(ObjectOffset off, uint64_t bytes) const {
  if (!Contains(off, bytes)) [[unlikely]] return nullptr;  // offsets may come from the region
  return regions_[off.region_index()]->impl().PayloadPtr(off.byte_offset(), bytes);
}

// ---- the allocator lock and the intent record -------------------------------------------

Status Allocator::LockAllocator() {
  auto held = node_.AcquireFor(sync::kAllocatorLock, node_.lease() * 4);
  if (!held.ok()) return held.status();
  lock_acquisitions_.fetch_add(1, std::memory_order_relaxed);
  Status redo = RedoIntentLocked();  // the previous holder may have died mid-update
  if (!redo.ok()) UnlockAllocator();
  return redo;
}

void Allocator::UnlockAllocator(std::span<const sync::Range> written) {
  node_.Release(sync::kAllocatorLock, written);
}

Status Allocator::RedoIntentLocked() {
  auto& m = meta(0);
  m.Invalidate(tables_[0].intent(), 64);
  auto intent = m.ReadStruct<Intent>(tables_[0].intent());
  if (!intent.valid) return Status::Ok();
  // Untrusted: a record naming chunks outside the table is refused, never applied.
  if (intent.region >= regions_.size() || !IntentValid(tables_[intent.region], intent)) {
    return Corrupted("the allocator intent record in region " + regions_[0]->info().path +
                     " is corrupt (region " + std::to_string(intent.region) + ", op " + std::to_string(intent.op) +
                     ", chunks " + std::to_string(intent.first) + " +" + std::to_string(intent.count) +
                     "): run 'cxlkv check'; re-create the pool with 'cxlkv init'");
  }
  const ChunkTableLayout& t = tables_[intent.region];
  meta(intent.region).Invalidate(t.owner(intent.first), intent.count * 8);
  ApplyIntent(meta(intent.region), t, intent);
  m.Publish(tables_[0].intent(), 0);
  return Status::Ok();
}

void Allocator::CommitLocked(uint32_t region, uint64_t op, uint64_t first, uint64_t count,
                             uint64_t owner) {
  // Write-ahead: the intent is complete and flushed before its valid word is published (P4),
  // applied, then retired by one word. A holder that dies anywhere here is redone by the next.
  auto& m = meta(0);
  Intent intent{0, op, region, first, count, owner, {0, 0}};
  m.WriteStruct(tables_[0].intent(), intent);
  m.Flush(tables_[0].intent(), sizeof intent);
  m.Publish(tables_[0].intent(), 1);
  ApplyIntent(meta(region), tables_[region], intent);
  m.Publish(tables_[0].intent(), 0);
}

bool Allocator::FindRunLocked(uint32_t r, uint64_t count, uint64_t* first) {
  const ChunkTableLayout& t = tables_[r];
  auto& m = meta(r);
  uint64_t run = 0;
  uint64_t word = 0;
  for (uint64_t c = 0; c < t.chunks(); ++c) {
    if (c % 64 == 0) {
      word = m.Fetch(t.bitmap_word(c));  // P2: another node may have changed it
      if (word == ~uint64_t{0} && c + 64 <= t.chunks()) {
        run = 0;
        c += 63;
        continue;
      }
    }
    if ((word >> (c % 64)) & 1) {
      run = 0;
      continue;
    }
    if (++run == count) {
      *first = c + 1 - count;
      return true;
    }
  }
  return false;
}

Result<Allocator::ChunkRef> Allocator::TakeRunLocked(uint64_t count, OwnerWord head) {
  uint32_t n = static_cast<uint32_t>(regions_.size());
  uint32_t start = next_region_.fetch_add(1) % n;  // round-robin: interleave across devices
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t r = (start + i) % n;
    uint64_t first;
    if (!tables_[r].valid() || !FindRunLocked(r, count, &first)) continue;
    CommitLocked(r, 1, first, count, head.Encode());
    return ChunkRef{r, first};
  }
  return NoSpace("the pool has no " + std::to_string(count) + " free contiguous chunk" +
                 (count > 1 ? "s" : "") + " of " + std::to_string(chunk_bytes() >> 10) +
                 " KiB; free objects or add a region");
}

// ---- allocation ------------------------------------------------------------------------

Result<ObjectOffset> Allocator::Alloc(uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("cannot allocate 0 bytes");
  uint32_t me = node_.id();
  uint32_t inc = Inc20(node_.incarnation());
  if (bytes > kMaxHeapObject) {
    uint64_t count = (bytes + chunk_bytes() - 1) / chunk_bytes();
    uint64_t largest = 0;
    for (const auto& t : tables_) largest = std::max(largest, t.chunks());
    if (count > largest) {
      return InvalidArgument("object of " + std::to_string(bytes) + " bytes is larger than any "
                             "region's data area (" + std::to_string(largest * chunk_bytes()) + " bytes)");
    }
    if (count == 1 && LeaseAllowed()) {
      // From this node's lease: no global lock (one trip per refill of lease_chunks chunks).
      sync::LockRobust(&node_.local().header().heap_mu);
      ChunkRef c;
      Status st;
      for (int attempt = 0; attempt < 2; ++attempt) {
        if (TakeFromLeaseLocked(&c)) {
          pthread_mutex_unlock(&node_.local().header().heap_mu);
          return OffsetOf(c, 0);
        }
        st = RefillLeaseLocked(lease_lines_);
        if (!st.ok()) break;
      }
      pthread_mutex_unlock(&node_.local().header().heap_mu);
      // No whole free line left to lease: a single free chunk of the global pool will do.
      if (!st.ok() && st.code() != StatusCode::kNoSpace) return st;
    }
    CXLKV_RETURN_IF_ERROR(LockAllocator());
    auto run = TakeRunLocked(count, {ChunkKind::kLargeHead, me, inc, static_cast<uint32_t>(count)});
    UnlockAllocator();
    if (!run.ok()) return run.status();
    return OffsetOf(*run, 0);
  }
  uint32_t c = ClassFor(bytes);
  sync::LockRobust(&node_.local().header().heap_mu);
  auto out = AllocSlotLocked(c);
  pthread_mutex_unlock(&node_.local().header().heap_mu);
  return out;
}

bool Allocator::TrySlotIn(ChunkRef chunk, uint32_t c, ObjectOffset* out) {
  auto& m = meta(chunk.region);
  uint64_t base = ChunkBase(chunk);
  // The owner node is the only writer of its heap headers, so its own copy is current.
  auto h = m.ReadStruct<HeapHeader>(base);
  if (!HeapHeaderValid(h, chunk_bytes()) || h.class_bytes != ClassBytes(c) || h.used >= h.slots) return false;
  auto& cls = node_.local().header().heap[c];
  uint64_t words = (h.slots + 63) / 64;
  uint64_t start = cls.cursor.load() % words;
  for (uint64_t i = 0; i < words; ++i) {
    uint64_t wd = (start + i) % words;
    uint64_t off = base + 64 + wd * 8;
    uint64_t bits = m.Load(off);
    uint64_t valid = wd + 1 == words && h.slots % 64 ? (uint64_t{1} << (h.slots % 64)) - 1 : ~uint64_t{0};
    uint64_t free_bits = ~bits & valid;
    if (free_bits == 0) continue;
    uint64_t bit = std::countr_zero(free_bits);
    m.Store(off, bits | (uint64_t{1} << bit));
    m.Store(base + offsetof(HeapHeader, used), h.used + 1);
    m.Flush(off, 8);  // P1: recovery and `cxlkv check` on other nodes read these
    m.Flush(base, 64);
    cls.cursor.store(wd);
    *out = OffsetOf(chunk, h.first_slot + (wd * 64 + bit) * h.class_bytes);
    return true;
  }
  return false;
}

bool Allocator::FindPartialChunk(uint32_t c, ChunkRef* out) {
  uint64_t want = OwnerWord{ChunkKind::kHeap, node_.id(), Inc20(node_.incarnation()), c}.Encode();
  for (uint32_t r = 0; r < regions_.size(); ++r) {
    const ChunkTableLayout& t = tables_[r];
    for (uint64_t ch = 0; ch < t.chunks(); ++ch) {
      if (meta(r).Load(t.owner(ch)) != want) continue;
      auto h = meta(r).ReadStruct<HeapHeader>(ChunkBase({r, ch}));
      if (HeapHeaderValid(h, chunk_bytes()) && h.class_bytes == ClassBytes(c) && h.used < h.slots) {
        *out = ChunkRef{r, ch};
        return true;
      }
    }
  }
  return false;
}

Result<ObjectOffset> Allocator::AllocSlotLocked(uint32_t c) {
  auto& cls = node_.local().header().heap[c];
  ObjectOffset out;
  for (int attempt = 0; attempt < 3; ++attempt) {
    uint64_t cur = cls.current_chunk.load();
    if (cur != 0) {
      ChunkRef ref{static_cast<uint32_t>((cur - 1) >> 40), (cur - 1) & ((uint64_t{1} << 40) - 1)};
      OwnerWord w = OwnerWord::Decode(meta(ref.region).Load(tables_[ref.region].owner(ref.chunk)));
      bool mine = w.kind == ChunkKind::kHeap && w.node == node_.id() &&
                  w.incarnation == Inc20(node_.incarnation()) && w.detail == c;
      if (mine && TrySlotIn(ref, c, &out)) return out;
    }
    ChunkRef next;
    if (FindPartialChunk(c, &next)) {
      cls.current_chunk.store(((uint64_t{next.region} << 40) | next.chunk) + 1);
      continue;
    }
    // A fresh chunk: owned under the allocator lock, then formatted by us (its only writer).
    OwnerWord word{ChunkKind::kHeap, node_.id(), Inc20(node_.incarnation()), c};
    CXLKV_RETURN_IF_ERROR(LockAllocator());
    auto run = TakeRunLocked(1, word);
    UnlockAllocator();
    if (!run.ok()) return run.status();
    HeapGeometry g = GeometryFor(chunk_bytes(), ClassBytes(c));
    uint64_t base = ChunkBase(*run);
    auto& m = meta(run->region);
    std::vector<uint8_t> zeros(g.bitmap_bytes, 0);
    m.Write(base + 64, zeros.data(), zeros.size());
    m.Flush(base + 64, zeros.size());
    HeapHeader h{kHeapMagic, ClassBytes(c), g.slots, 0, word.Encode(), g.first_slot, {0, 0}};
    m.WriteStruct(base, h);
    m.Flush(base, 64);  // header after bitmap: a header with a magic always has a clean bitmap
    cls.current_chunk.store(((uint64_t{run->region} << 40) | run->chunk) + 1);
    cls.cursor.store(0);
  }
  return Internal("heap could not place an object of class " + std::to_string(ClassBytes(c)));
}

// ---- chunk leases ----------------------------------------------------------------------

uint64_t Allocator::LeaseWord() const {
  return OwnerWord{ChunkKind::kLeased, node_.id(), Inc20(node_.incarnation()), 0}.Encode();
}

void Allocator::NoteLeaseLine(uint32_t region, uint64_t first) {
  for (const ChunkRef& l : lease_hint_) {
    if (l.region == region && l.chunk == first) return;
  }
  lease_hint_.push_back(ChunkRef{region, first});
}

bool Allocator::TakeFromLeaseLocked(ChunkRef* out) {
  const uint64_t free_word = LeaseWord();
  const uint64_t object = OwnerWord{ChunkKind::kLeasedObject, node_.id(), Inc20(node_.incarnation()), 1}.Encode();
  for (size_t i = 0; i < lease_hint_.size();) {
    const ChunkRef line = lease_hint_[i];
    const ChunkTableLayout& t = tables_[line.region];
    auto& m = meta(line.region);
    // P2: another process of this node (behind its own cache in the simulator) may have
    // written this line last. No other node writes it while it is leased.
    m.Invalidate(t.owner(line.chunk), kLeaseLineChunks * 8);
    for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
      const uint64_t off = t.owner(line.chunk + k);
      if (m.Load(off) != free_word) continue;
      m.Store(off, object);
      m.Flush(off, 8);  // P1: frees, recovery and `check` on other nodes read it
      *out = ChunkRef{line.region, line.chunk + k};
      return true;
    }
    lease_hint_.erase(lease_hint_.begin() + static_cast<std::ptrdiff_t>(i));  // used up
  }
  return false;
}

void Allocator::ScanLeaseLocked() {
  const uint64_t free_word = LeaseWord();
  for (uint32_t r = 0; r < regions_.size(); ++r) {
    const ChunkTableLayout& t = tables_[r];
    if (!t.valid()) continue;
    auto& m = meta(r);
    const uint64_t lines = t.chunks() / kLeaseLineChunks;
    for (uint64_t l = 0; l < lines; ++l) {
      const uint64_t first = l * kLeaseLineChunks;
      m.Invalidate(t.owner(first), kLeaseLineChunks * 8);
      for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
        if (m.Load(t.owner(first + k)) == free_word) {
          NoteLeaseLine(r, first);
          break;
        }
      }
    }
  }
}

Status Allocator::RefillLeaseLocked(uint64_t lines) {
  if (!lease_scanned_) {
    // Once per process: lines of this node's lease that exited processes of the node left.
    lease_scanned_ = true;
    ScanLeaseLocked();
    if (!lease_hint_.empty()) return Status::Ok();
  }
  CXLKV_RETURN_IF_ERROR(LockAllocator());
  const uint64_t word = LeaseWord();
  uint64_t taken = 0;
  const uint32_t n = static_cast<uint32_t>(regions_.size());
  const uint32_t start = next_region_.fetch_add(1) % n;  // interleave leases across devices
  for (uint32_t i = 0; i < n && taken < lines; ++i) {
    const uint32_t r = (start + i) % n;
    const ChunkTableLayout& t = tables_[r];
    if (!t.valid()) continue;
    uint64_t bits = 0;
    for (uint64_t first = 0; first + kLeaseLineChunks <= t.chunks() && taken < lines; first += kLeaseLineChunks) {
      if (first % 64 == 0) bits = meta(r).Fetch(t.bitmap_word(first));  // P2: others allocate
      if ((bits >> (first % 64)) & 0xff) continue;  // a line with any chunk in use is not leasable
      // One intent per line: every word kLeased with our life, the bits set (P4 via the intent).
      CommitLocked(r, 4, first, kLeaseLineChunks, word);
      bits |= uint64_t{0xff} << (first % 64);
      NoteLeaseLine(r, first);
      ++taken;
    }
  }
  UnlockAllocator();
  if (taken == 0) return NoSpace("no wholly free line of " + std::to_string(kLeaseLineChunks) + " chunks to lease");
  return Status::Ok();
}

bool Allocator::ReturnLineIfFreeLocked(ChunkRef line, uint64_t free_word) {
  const ChunkTableLayout& t = tables_[line.region];
  auto& m = meta(line.region);
  m.Invalidate(t.owner(line.chunk), kLeaseLineChunks * 8);
  for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
    if (m.Load(t.owner(line.chunk + k)) != free_word) return false;
  }
  if (!LockAllocator().ok()) return false;
  // We hold heap_mu: no process of this node writes the line meanwhile, and no other node
  // writes a leased line. The lock holder is now its writer (the intent frees all 8).
  CommitLocked(line.region, 2, line.chunk, kLeaseLineChunks, 0);
  UnlockAllocator();
  return true;
}

Status Allocator::FreeLeasedLocked(ChunkRef chunk, OwnerWord w) {
  const ChunkTableLayout& t = tables_[chunk.region];
  auto& m = meta(chunk.region);
  const uint64_t off = t.owner(chunk.chunk);
  m.Invalidate(t.owner(chunk.chunk / kLeaseLineChunks * kLeaseLineChunks), kLeaseLineChunks * 8);
  if (m.Load(off) != w.Encode()) return InvalidArgument("whole-chunk object is not allocated (double free?)");
  const uint64_t free_word = LeaseWord();
  m.Store(off, free_word);
  m.Flush(off, 8);  // P1: back in the lease
  const ChunkRef line{chunk.region, chunk.chunk / kLeaseLineChunks * kLeaseLineChunks};
  // Keep about one refill's worth of lines; a line wholly free beyond that goes back to the
  // global pool (whole lines only: a line is leased whole or not at all, P5).
  uint64_t others = 0;
  for (const ChunkRef& l : lease_hint_) others += !(l.region == line.region && l.chunk == line.chunk);
  if (others >= lease_lines_ && ReturnLineIfFreeLocked(line, free_word)) {
    for (size_t i = 0; i < lease_hint_.size(); ++i) {
      if (lease_hint_[i].region == line.region && lease_hint_[i].chunk == line.chunk) {
        lease_hint_.erase(lease_hint_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    return Status::Ok();
  }
  NoteLeaseLine(line.region, line.chunk);
  return Status::Ok();
}

Result<std::vector<ObjectOffset>> Allocator::AllocMany(uint64_t bytes, size_t n) {
  std::vector<ObjectOffset> out;
  out.reserve(n);
  auto undo = [&](Status s) -> Status {
    for (ObjectOffset o : out) (void)Free(o);
    return s;
  };
  const uint64_t count = bytes > kMaxHeapObject ? (bytes + chunk_bytes() - 1) / chunk_bytes() : 0;
  if (count == 1 && LeaseAllowed() && n > 0) {
    // One refill sized for the whole batch, then every object from the lease.
    sync::LockRobust(&node_.local().header().heap_mu);
    ChunkRef c;
    bool refilled = false;
    while (out.size() < n) {
      if (TakeFromLeaseLocked(&c)) {
        out.push_back(OffsetOf(c, 0));
        continue;
      }
      if (refilled) break;
      refilled = true;
      const uint64_t want = (n - out.size() + kLeaseLineChunks - 1) / kLeaseLineChunks;
      if (!RefillLeaseLocked(std::max(want, lease_lines_)).ok()) break;
    }
    pthread_mutex_unlock(&node_.local().header().heap_mu);
  }
  while (out.size() < n) {
    auto a = Alloc(bytes);
    if (!a.ok()) return undo(a.status());
    out.push_back(*a);
  }
  return out;
}

// ---- frees -----------------------------------------------------------------------------

Status Allocator::FreeSlot(ChunkRef chunk, uint64_t within, bool orphan) {
  auto& m = meta(chunk.region);
  uint64_t base = ChunkBase(chunk);
  if (orphan) m.Invalidate(base, 64);
  auto h = m.ReadStruct<HeapHeader>(base);
  if (h.magic == kHeapMagic && !HeapHeaderValid(h, chunk_bytes())) {
    return Corrupted("heap chunk " + std::to_string(chunk.chunk) + " of region " + std::to_string(chunk.region) +
                     " has a corrupt header (class " + std::to_string(h.class_bytes) + " bytes, " +
                     std::to_string(h.slots) + " slots): run 'cxlkv check'");
  }
  if (h.magic != kHeapMagic || within < h.first_slot || (within - h.first_slot) % h.class_bytes != 0 ||
      (within - h.first_slot) / h.class_bytes >= h.slots) {
    return InvalidArgument("offset is not the start of an object (corrupted or foreign offset)");
  }
  uint64_t slot = (within - h.first_slot) / h.class_bytes;
  uint64_t off = base + 64 + (slot / 64) * 8;
  if (orphan) m.Invalidate(off, 8);
  uint64_t bits = m.Load(off);
  uint64_t bit = uint64_t{1} << (slot % 64);
  if (!(bits & bit)) return InvalidArgument("object is not allocated (double free?)");
  m.Store(off, bits & ~bit);
  m.Store(base + offsetof(HeapHeader, used), h.used - 1);
  m.Flush(off, 8);
  m.Flush(base, 64);
  if (h.used - 1 == 0) {
    uint32_t c = ClassFor(h.class_bytes);
    uint64_t id = ((uint64_t{chunk.region} << 40) | chunk.chunk) + 1;
    if (!orphan && node_.local().header().heap[c].current_chunk.load() == id) return Status::Ok();
    if (!orphan) CXLKV_RETURN_IF_ERROR(LockAllocator());
    CommitLocked(chunk.region, 2, chunk.chunk, 1, 0);
    if (!orphan) UnlockAllocator();
  }
  return Status::Ok();
}

Status Allocator::Free(ObjectOffset off) {
  ChunkRef chunk;
  uint64_t within;
  if (!Locate(off, &chunk, &within)) {
    return InvalidArgument("offset 0x" + std::to_string(off.raw()) + " is not inside this pool's data area");
  }
  const ChunkTableLayout& t = tables_[chunk.region];
  OwnerWord w = OwnerWord::Decode(meta(chunk.region).Fetch(t.owner(chunk.chunk)));
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
      CommitLocked(chunk.region, 2, chunk.chunk, w.detail, 0);
      UnlockAllocator();
      return Status::Ok();
    }
    case ChunkKind::kHeap: {
      if (w.node == node_.id() && w.incarnation == Inc20(node_.incarnation())) {
        sync::LockRobust(&node_.local().header().heap_mu);
        Status s = FreeSlot(chunk, within, /*orphan=*/false);
        pthread_mutex_unlock(&node_.local().header().heap_mu);
        return s;
      }
      // The owner drains its ring every beat, and recovery drains it when the owner's life
      // ends. Push only while the owner surely beats (recovery is then at least half a lease
      // away); once its life is over, free in place under the allocator lock, which that
      // life's recovery also holds; in between, wait — never touch a live owner's heap.
      for (auto deadline = sync::Clock::now() + node_.lease() * 2;;) {
        if (node_.SurelyLive(w.node, w.incarnation, 0xfffff)) return PushRemoteFree(w.node, off);
        if (node_.LifeOver(w.node, w.incarnation, 0xfffff)) break;
        if (sync::Clock::now() > deadline || node_.leaving()) {
          return Busy("node " + std::to_string(w.node) + " is neither beating nor declared dead; retry the free");
        }
        std::this_thread::sleep_for(node_.lease() / 8);
      }
      CXLKV_RETURN_IF_ERROR(LockAllocator());
      if (meta(chunk.region).Fetch(t.owner(chunk.chunk)) == w.Encode()) {
        Status s = FreeSlot(chunk, within, /*orphan=*/true);
        UnlockAllocator();
        return s;
      }
      UnlockAllocator();
      return Free(off);  // recovery changed the chunk meanwhile (orphaned it): route again
    }
    case ChunkKind::kLeasedObject: {
      if (within != 0) return InvalidArgument("offset points inside a whole-chunk object, not at its start");
      if (w.node == node_.id() && w.incarnation == Inc20(node_.incarnation())) {
        sync::LockRobust(&node_.local().header().heap_mu);
        Status s = FreeLeasedLocked(chunk, w);
        pthread_mutex_unlock(&node_.local().header().heap_mu);
        return s;
      }
      // The lessee is the only writer of its leased line: as for heap objects, a live owner
      // gets the free through its ring; an ended life's object is freed under the lock (its
      // recovery holds the same lock).
      for (auto deadline = sync::Clock::now() + node_.lease() * 2;;) {
        if (node_.SurelyLive(w.node, w.incarnation, 0xfffff)) return PushRemoteFree(w.node, off);
        if (node_.LifeOver(w.node, w.incarnation, 0xfffff)) break;
        if (sync::Clock::now() > deadline || node_.leaving()) {
          return Busy("node " + std::to_string(w.node) + " is neither beating nor declared dead; retry the free");
        }
        std::this_thread::sleep_for(node_.lease() / 8);
      }
      CXLKV_RETURN_IF_ERROR(LockAllocator());
      if (meta(chunk.region).Fetch(t.owner(chunk.chunk)) == w.Encode()) {
        // A line is leased whole or not at all (P5): the chunk goes back to the ended life's
        // lease, and the line to the pool once every chunk of it is free in that lease.
        const uint64_t dead_free = OwnerWord{ChunkKind::kLeased, w.node, w.incarnation, 0}.Encode();
        const uint64_t first = chunk.chunk / kLeaseLineChunks * kLeaseLineChunks;
        auto& m = meta(chunk.region);
        m.Invalidate(t.owner(first), kLeaseLineChunks * 8);
        bool line_free = first + kLeaseLineChunks <= t.chunks();
        for (uint64_t k = first; line_free && k < first + kLeaseLineChunks; ++k) {
          line_free = k == chunk.chunk || m.Load(t.owner(k)) == dead_free;
        }
        if (line_free) {
          CommitLocked(chunk.region, 2, first, kLeaseLineChunks, 0);
        } else {
          CommitLocked(chunk.region, 3, chunk.chunk, 1, dead_free);
        }
        UnlockAllocator();
        return Status::Ok();
      }
      UnlockAllocator();
      return Free(off);  // recovery changed it meanwhile (kept it as a large object): route again
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

Status Allocator::PushRemoteFree(uint32_t owner, ObjectOffset off) {
  if (owner >= max_nodes_ || !tables_[0].has_inboxes()) return Internal("no remote-free ring");
  auto& m = meta(0);
  uint64_t ring = tables_[0].inbox(owner, node_.id());
  auto& mu = node_.local().header().inbox_mu;
  sync::LockRobust(&mu);  // one producer per ring: the processes of this node take turns
  uint64_t tail = m.Load(ring);
  auto deadline = sync::Clock::now() + node_.lease() * 2;
  while (tail - m.Fetch(ring + 64) >= kInboxEntries) {  // P2: the owner advances the head
    if (sync::Clock::now() > deadline) {
      pthread_mutex_unlock(&mu);
      return Busy("node " + std::to_string(owner) + " has not drained its remote frees for two "
                  "leases; the object stays allocated; retry later");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  uint64_t entry = ring + 128 + (tail % kInboxEntries) * 8;
  m.Store(entry, off.raw());
  m.Flush(entry, 8);            // payload of the message first (P4)...
  m.Publish(ring, tail + 1);    // ...then the tail that makes it visible
  pthread_mutex_unlock(&mu);
  return Status::Ok();
}

void Allocator::DrainRemoteFrees() {
  if (!tables_[0].has_inboxes()) return;
  auto& m = meta(0);
  for (uint32_t f = 0; f < max_nodes_; ++f) {
    uint64_t ring = tables_[0].inbox(node_.id(), f);
    uint64_t tail = m.Fetch(ring);
    uint64_t head = m.Fetch(ring + 64);
    if (head == tail) continue;
    if (!RingSane(head, tail)) continue;  // corrupted: left for `cxlkv check` (never looped over)
    for (; head < tail; ++head) {
      ObjectOffset off(m.Fetch(ring + 128 + (head % kInboxEntries) * 8));
      ChunkRef chunk;
      uint64_t within;
      if (!Locate(off, &chunk, &within)) continue;
      OwnerWord w = OwnerWord::Decode(meta(chunk.region).Fetch(tables_[chunk.region].owner(chunk.chunk)));
      const bool node_owned = w.kind == ChunkKind::kHeap || w.kind == ChunkKind::kLeasedObject;
      bool mine = node_owned && w.node == node_.id() && w.incarnation == Inc20(node_.incarnation());
      // Not ours any more (an old life's chunk, since recovered): route it like any free.
      if (!mine) {
        if (!node_owned || w.node != node_.id()) (void)Free(off);
        continue;
      }
      sync::LockRobust(&node_.local().header().heap_mu);
      if (w.kind == ChunkKind::kHeap) {
        (void)FreeSlot(chunk, within, false);
      } else if (within == 0) {
        (void)FreeLeasedLocked(chunk, w);
      }
      pthread_mutex_unlock(&node_.local().header().heap_mu);
    }
    m.Publish(ring + 64, head);
  }
}

void Allocator::Trim() {
  DrainRemoteFrees();
  sync::LockRobust(&node_.local().header().heap_mu);
  for (uint32_t c = 0; c < kSizeClasses; ++c) {
    auto& cls = node_.local().header().heap[c];
    uint64_t cur = cls.current_chunk.load();
    if (cur == 0) continue;
    ChunkRef ref{static_cast<uint32_t>((cur - 1) >> 40), (cur - 1) & ((uint64_t{1} << 40) - 1)};
    auto& m = meta(ref.region);
    uint64_t word = m.Load(tables_[ref.region].owner(ref.chunk));
    OwnerWord w = OwnerWord::Decode(word);
    auto h = m.ReadStruct<HeapHeader>(ChunkBase(ref));
    cls.current_chunk.store(0);
    if (w.kind == ChunkKind::kHeap && w.node == node_.id() && h.used == 0) {
      if (LockAllocator().ok()) {
        if (meta(ref.region).Fetch(tables_[ref.region].owner(ref.chunk)) == word) {
          CommitLocked(ref.region, 2, ref.chunk, 1, 0);
        }
        UnlockAllocator();
      }
    }
  }
  // Wholly free lines of this node's lease go back to the pool (the scan finds the lines other
  // processes of this node left too).
  if (LeaseAllowed()) {
    ScanLeaseLocked();
    ReturnFreeLeaseLinesLocked();
  }
  pthread_mutex_unlock(&node_.local().header().heap_mu);
}

void Allocator::ReturnFreeLeaseLinesLocked() {
  const uint64_t free_word = LeaseWord();
  for (size_t i = 0; i < lease_hint_.size();) {
    if (ReturnLineIfFreeLocked(lease_hint_[i], free_word)) {
      lease_hint_.erase(lease_hint_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

void Allocator::ReturnLease() {
  sync::LockRobust(&node_.local().header().heap_mu);
  if (!lease_hint_.empty()) ReturnFreeLeaseLinesLocked();
  pthread_mutex_unlock(&node_.local().header().heap_mu);
}

void Allocator::AddReachability(std::function<void(std::vector<uint64_t>&)> provider) {
  std::lock_guard<std::mutex> lock(providers_mu_);
  providers_.push_back(std::move(provider));
}

// ---- recovery of a dead node -----------------------------------------------------------

void Allocator::Recover(uint32_t dead, uint64_t incarnation) {
  if (dead >= max_nodes_) return;
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
  // Frees other nodes sent to the dead node: those objects are no longer wanted.
  std::unordered_set<uint64_t> freed;
  if (tables_[0].has_inboxes()) {
    auto& m = meta(0);
    for (uint32_t f = 0; f < max_nodes_; ++f) {
      uint64_t ring = tables_[0].inbox(dead, f);
      uint64_t tail = m.Fetch(ring);
      if (!RingSane(m.Fetch(ring + 64), tail)) continue;  // corrupted: left for `cxlkv check`
      for (uint64_t head = m.Fetch(ring + 64); head < tail; ++head) {
        freed.insert(m.Fetch(ring + 128 + (head % kInboxEntries) * 8));
      }
      m.Publish(ring + 64, tail);  // we consume for the dead owner
    }
  }
  auto published = [&](uint64_t raw) { return reachable.count(raw) && !freed.count(raw); };

  const uint32_t inc = Inc20(incarnation);
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
        if (!published(OffsetOf(ref, 0).raw())) CommitLocked(r, 2, ch, w.detail, 0);
        ch += w.detail - 1;
      } else if (w.kind == ChunkKind::kLeased) {
        CommitLocked(r, 2, ch, 1, 0);  // the dead life's lease: free again
      } else if (w.kind == ChunkKind::kLeasedObject) {
        // Published: kept as an ordinary one-chunk object (anyone frees it under the lock).
        if (published(OffsetOf(ref, 0).raw())) {
          CommitLocked(r, 3, ch, 1, OwnerWord{ChunkKind::kLargeHead, dead, w.incarnation, 1}.Encode());
        } else {
          CommitLocked(r, 2, ch, 1, 0);
        }
      } else if (w.kind == ChunkKind::kHeap) {
        uint64_t base = ChunkBase(ref);
        m.Invalidate(base, 64);
        auto h = m.ReadStruct<HeapHeader>(base);
        if (h.magic != kHeapMagic) {  // died before formatting it
          CommitLocked(r, 2, ch, 1, 0);
          continue;
        }
        if (!HeapHeaderValid(h, chunk_bytes())) continue;  // corrupted: left for `cxlkv check`
        uint64_t kept = 0;
        uint64_t words = (h.slots + 63) / 64;
        m.Invalidate(base + 64, words * 8);
        for (uint64_t wd = 0; wd < words; ++wd) {
          uint64_t bits = m.Load(base + 64 + wd * 8), keep = 0;
          for (uint64_t b = bits; b != 0; b &= b - 1) {
            uint64_t slot = wd * 64 + std::countr_zero(b);
            if (published(OffsetOf(ref, h.first_slot + slot * h.class_bytes).raw())) {
              keep |= uint64_t{1} << (slot % 64);
            }
          }
          m.Store(base + 64 + wd * 8, keep);
          kept += std::popcount(keep);
        }
        m.Flush(base + 64, words * 8);
        m.Store(base + offsetof(HeapHeader, used), kept);
        m.Flush(base, 64);
        if (kept == 0) {
          CommitLocked(r, 2, ch, 1, 0);
        } else {
          OwnerWord orphan{ChunkKind::kOrphanHeap, dead, w.incarnation, w.detail};
          CommitLocked(r, 3, ch, 1, orphan.Encode());
        }
      }
    }
  }
  UnlockAllocator();
}

}  // namespace cxlkv::alloc
