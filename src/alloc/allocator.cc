#include "alloc/allocator.h"

#include <algorithm>

#include "region/coherence.h"

namespace cxlkv::alloc {

Allocator::Allocator(std::vector<Region*> regions, sync::Node& node, AllocatorOptions options)
    : regions_(std::move(regions)), node_(node), max_nodes_(regions_[0]->info().max_nodes) {
  for (Region* r : regions_) tables_.emplace_back(r->impl(), max_nodes_);
  lease_lines_ = (uint64_t{options.lease_chunks} + kLeaseLineChunks - 1) / kLeaseLineChunks;
  // A lease is whole 64-byte lines of owner words (P5): only where owner words are line-aligned.
  uint64_t smallest = ~uint64_t{0};
  for (const auto& t : tables_) {
    if (t.valid() && t.owner(0) % 64 != 0) leasable_ = false;
    if (t.valid()) smallest = std::min(smallest, t.chunks());
  }
  // A node's partly used slab is space only that node fills: in a small pool, short slabs.
  if (smallest != ~uint64_t{0}) max_slab_chunks_ = static_cast<uint32_t>(std::clamp<uint64_t>(smallest / 4, 1, kMaxSlabChunks));
}

uint64_t Allocator::SlotBytesFor(uint64_t bytes, Fit fit) const {
  if (fit == Fit::kRounded) return bytes <= kMaxHeapObject ? ClassBytes(ClassFor(bytes)) : 0;
  // A namespace's blocks repeat one size: its answer is remembered (an entry is one word, so a
  // racing reader sees a whole one or none), not planned again on every allocation.
  std::atomic<uint64_t>& memo = fit_memo_[(bytes / 64) % fit_memo_.size()];
  const uint64_t seen = memo.load(std::memory_order_relaxed);
  if (bytes < (uint64_t{1} << 32) && (seen & 1) && (seen >> 32) == bytes) return ((seen >> 1) & 0x7fffffff) * 64;
  const uint64_t slot = ExactSlotBytes(bytes);
  if (bytes < (uint64_t{1} << 32) && slot / 64 < (uint64_t{1} << 31)) {
    memo.store((bytes << 32) | (slot / 64) << 1 | 1, std::memory_order_relaxed);
  }
  return slot;
}

uint64_t Allocator::ExactSlotBytes(uint64_t bytes) const {
  const uint64_t slot = (bytes + 63) / 64 * 64;
  const uint64_t c = chunk_bytes();
  if (slot % c == 0) return 0;  // whole chunks fit it exactly
  const uint32_t k = SlabChunksFor(c, slot, max_slab_chunks_);
  if (k == 0) return 0;  // larger than any slab this pool makes
  // Whole chunks hold it better (a slab header line is free, but slot counts round down).
  const uint64_t run = (slot + c - 1) / c;
  if (static_cast<double>(bytes) / static_cast<double>(run * c) >= SlabFill(c, slot, k)) return 0;
  return slot;
}

bool Allocator::Locate(ObjectOffset off, ChunkRef* c, uint64_t* within, OwnerWord* word) const {
  if (off.is_null() || off.region_index() >= regions_.size()) return false;
  const ChunkTableLayout& t = tables_[off.region_index()];
  if (!t.valid() || off.byte_offset() < t.data_offset()) return false;
  uint64_t rel = off.byte_offset() - t.data_offset();
  c->region = off.region_index();
  c->chunk = rel / t.chunk_bytes();
  *within = rel % t.chunk_bytes();
  if (c->chunk >= t.chunks()) return false;
  // Inside a slab's tail chunk: the slab is indexed from its head (the head's word, read by the
  // caller, says whether it is one: a tail's distance is read from the region, bounded here).
  *word = OwnerWord::Decode(meta(c->region).Fetch(t.owner(c->chunk)));
  // A tail that is not part of its head's run stays a tail (callers refuse it): a corrupted
  // distance never sends a free into another slab.
  if (const uint64_t head = SlabHeadOf(meta(c->region), t, c->chunk, *word); head != c->chunk) {
    *within += (c->chunk - head) * t.chunk_bytes();
    c->chunk = head;
    *word = OwnerWord::Decode(meta(c->region).Fetch(t.owner(head)));
  }
  return true;
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

void Allocator::CommitLocked(uint32_t region, IntentOp op, uint64_t first, uint64_t count,
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
    CommitLocked(r, IntentOp::kAllocate, first, count, head.Encode());
    return ChunkRef{r, first};
  }
  return NoSpace("the pool has no " + std::to_string(count) + " free contiguous chunk" +
                 (count > 1 ? "s" : "") + " of " + std::to_string(chunk_bytes() >> 10) +
                 " KiB; free objects or add a region");
}

// ---- allocation ------------------------------------------------------------------------

Result<ObjectOffset> Allocator::Alloc(uint64_t bytes, Fit fit) {
  if (bytes == 0) return InvalidArgument("cannot allocate 0 bytes");
  uint32_t me = node_.id();
  uint32_t inc = Inc20(node_.incarnation());
  const uint64_t slot = SlotBytesFor(bytes, fit);
  if (slot == 0) {
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
        const Result<bool> took = TakeFromLeaseLocked(&c);
        if (!took.ok() || *took) {
          pthread_mutex_unlock(&node_.local().header().heap_mu);
          if (!took.ok()) return took.status();
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
  sync::LockRobust(&node_.local().header().heap_mu);
  auto out = AllocSlotLocked(slot);
  pthread_mutex_unlock(&node_.local().header().heap_mu);
  return out;
}

Status Allocator::FenceOwnStore(const char* act, uint32_t life20) const {
  CXLKV_RETURN_IF_ERROR(node_.Fence(act));
  if (Inc20(node_.incarnation()) != life20) {
    return LeaseExpired(std::string(act) + " refused: node " + std::to_string(node_.id()) + "'s life " +
                        std::to_string(life20) + " (20 bits) has ended while this process was paused or starved; "
                        "what it held was recovered, retry");
  }
  return Status::Ok();
}

sync::LocalHeapClass& Allocator::ClassEntryLocked(uint64_t slot_bytes) {
  auto& heap = node_.local().header().heap;
  sync::LocalHeapClass* empty = nullptr;
  for (auto& e : heap) {
    const uint64_t key = e.slot_bytes.load();
    if (key == slot_bytes) return e;
    if (key == 0 && empty == nullptr) empty = &e;
  }
  // Node-local memory is shared by the node's processes (and a dead one's values stay): a
  // full table gives up one size's entry. Its slab is not lost, only found again by a scan.
  sync::LocalHeapClass& e = empty != nullptr ? *empty : heap[(slot_bytes / 64) % sync::kLocalSizeClasses];
  e.current_chunk.store(0);
  e.cursor.store(0);
  e.slot_bytes.store(slot_bytes);
  return e;
}

sync::LocalHeapClass* Allocator::CurrentEntryFor(uint64_t slot_bytes, uint64_t id) {
  for (auto& e : node_.local().header().heap) {
    if (e.slot_bytes.load() == slot_bytes && e.current_chunk.load() == id) return &e;
  }
  return nullptr;
}

bool Allocator::TrySlotIn(ChunkRef chunk, sync::LocalHeapClass& cls, uint64_t slot_bytes, uint32_t life20,
                          ObjectOffset* out, Status* fenced) {
  auto& m = meta(chunk.region);
  const ChunkTableLayout& t = tables_[chunk.region];
  const uint64_t line = t.header(chunk.chunk);
  // The owner node is the only writer of its slab headers, so its own copy is current.
  auto h = m.ReadStruct<HeapHeader>(line);
  if (!HeapHeaderValid(h, chunk_bytes()) || h.class_bytes != slot_bytes || h.used >= h.slots) return false;
  uint64_t words = (h.slots + 63) / 64;
  uint64_t start = cls.cursor.load() % words;
  for (uint64_t i = 0; i < words; ++i) {
    uint64_t wd = (start + i) % words;
    uint64_t off = SlotBitmapWord(t, chunk.chunk, h, wd);
    uint64_t bits = m.Load(off);
    uint64_t valid = wd + 1 == words && h.slots % 64 ? (uint64_t{1} << (h.slots % 64)) - 1 : ~uint64_t{0};
    uint64_t free_bits = ~bits & valid;
    if (free_bits == 0) continue;
    uint64_t bit = std::countr_zero(free_bits);
    if (test_before_heap_store_) test_before_heap_store_();
    if (Status f = FenceOwnStore("heap allocation", life20); !f.ok()) {
      *fenced = std::move(f);
      return false;
    }
    m.Store(off, bits | (uint64_t{1} << bit));
    m.Store(line + offsetof(HeapHeader, used), h.used + 1);
    if (!(h.first_slot == 0)) m.Flush(off, 8);  // P1: recovery and `cxlkv check` on other nodes read these
    m.Flush(line, 64);
    cls.cursor.store(wd);
    *out = OffsetOf(chunk, h.first_slot + (wd * 64 + bit) * h.class_bytes);
    return true;
  }
  return false;
}

bool Allocator::FindPartialChunk(uint64_t slot_bytes, ChunkRef* out) {
  uint64_t want = OwnerWord{ChunkKind::kHeap, node_.id(), Inc20(node_.incarnation()),
                            static_cast<uint32_t>(slot_bytes / 64)}.Encode();
  for (uint32_t r = 0; r < regions_.size(); ++r) {
    const ChunkTableLayout& t = tables_[r];
    for (uint64_t ch = 0; ch < t.chunks(); ++ch) {
      if (meta(r).Load(t.owner(ch)) != want) continue;
      auto h = meta(r).ReadStruct<HeapHeader>(t.header(ch));
      if (HeapHeaderValid(h, chunk_bytes()) && h.class_bytes == slot_bytes && h.used < h.slots) {
        *out = ChunkRef{r, ch};
        return true;
      }
    }
  }
  return false;
}

Result<Allocator::ChunkRef> Allocator::TakeSlabLocked(uint64_t slot_bytes, OwnerWord word, uint64_t* chunks) {
  const uint64_t planned = SlabChunksFor(chunk_bytes(), slot_bytes, max_slab_chunks_);
  const uint64_t fewest = MinSlabChunks(chunk_bytes(), slot_bytes);
  Result<ChunkRef> run = NoSpace("no slab");
  for (uint64_t k = planned; k >= fewest && k >= 1; --k) {
    run = TakeRunLocked(k, word);
    if (run.ok()) {
      *chunks = k;
      return run;
    }
    if (run.status().code() != StatusCode::kNoSpace) return run;
  }
  return run;
}

void Allocator::FreeSlabLocked(ChunkRef head) {
  CommitLocked(head.region, IntentOp::kFree, head.chunk, SlabRun(meta(head.region), tables_[head.region], head.chunk), 0);
}

Result<ObjectOffset> Allocator::AllocSlotLocked(uint64_t slot_bytes) {
  auto& cls = ClassEntryLocked(slot_bytes);
  const uint32_t detail = static_cast<uint32_t>(slot_bytes / 64);
  ObjectOffset out;
  for (int attempt = 0; attempt < 3; ++attempt) {
    uint64_t cur = cls.current_chunk.load();
    if (cur != 0) {
      ChunkRef ref{static_cast<uint32_t>((cur - 1) >> 40), (cur - 1) & ((uint64_t{1} << 40) - 1)};
      // Node-local values a dead process of the node may have left: checked before use.
      if (ref.region < tables_.size() && ref.chunk < tables_[ref.region].chunks()) {
        OwnerWord w = OwnerWord::Decode(meta(ref.region).Load(tables_[ref.region].owner(ref.chunk)));
        bool mine = w.kind == ChunkKind::kHeap && w.node == node_.id() &&
                    w.incarnation == Inc20(node_.incarnation()) && w.detail == detail;
        Status fenced;
        if (mine && TrySlotIn(ref, cls, slot_bytes, w.incarnation, &out, &fenced)) return out;
        if (!fenced.ok()) return fenced;
      }
    }
    ChunkRef next;
    if (FindPartialChunk(slot_bytes, &next)) {
      cls.current_chunk.store(((uint64_t{next.region} << 40) | next.chunk) + 1);
      continue;
    }
    // A fresh slab: owned under the allocator lock, then formatted by us (its only writer).
    OwnerWord word{ChunkKind::kHeap, node_.id(), Inc20(node_.incarnation()), detail};
    CXLKV_RETURN_IF_ERROR(LockAllocator());
    uint64_t chunks = 0;
    auto run = TakeSlabLocked(slot_bytes, word, &chunks);
    UnlockAllocator();
    if (!run.ok()) return run.status();
    // Taken but not formatted: if the life ended meanwhile, its recovery frees the slab (one
    // without a header of its owner word), and it may be another node's by the time this one resumes.
    CXLKV_RETURN_IF_ERROR(FenceOwnStore("heap slab format", word.incarnation));
    HeapGeometry g = GeometryFor(chunk_bytes(), slot_bytes, chunks);
    auto& m = meta(run->region);
    const uint64_t line = tables_[run->region].header(run->chunk);
    if (!g.inline_bitmap()) {
      const uint64_t base = ChunkBase(*run);
      std::vector<uint8_t> zeros(g.bitmap_bytes, 0);
      m.Write(base, zeros.data(), zeros.size());
      m.Flush(base, zeros.size());
    }
    HeapHeader h{kHeapMagic, static_cast<uint32_t>(chunks), slot_bytes, g.slots, 0, word.Encode(), g.first_slot, {0, 0}};
    m.WriteStruct(line, h);
    m.Flush(line, 64);  // header after bitmap: a header with a magic always has a clean bitmap
    cls.current_chunk.store(((uint64_t{run->region} << 40) | run->chunk) + 1);
    cls.cursor.store(0);
  }
  return Internal("heap could not place an object of " + std::to_string(slot_bytes) + " bytes");
}


Result<std::vector<ObjectOffset>> Allocator::AllocMany(uint64_t bytes, size_t n, Fit fit) {
  std::vector<ObjectOffset> out;
  out.reserve(n);
  auto undo = [&](Status s) -> Status {
    for (ObjectOffset o : out) (void)Free(o);
    return s;
  };
  const uint64_t count = SlotBytesFor(bytes, fit) == 0 ? (bytes + chunk_bytes() - 1) / chunk_bytes() : 0;
  if (count == 1 && LeaseAllowed() && n > 0) {
    // One refill sized for the whole batch, then every object from the lease.
    sync::LockRobust(&node_.local().header().heap_mu);
    ChunkRef c;
    bool refilled = false;
    while (out.size() < n) {
      const Result<bool> took = TakeFromLeaseLocked(&c);
      if (!took.ok()) {
        pthread_mutex_unlock(&node_.local().header().heap_mu);
        return undo(took.status());
      }
      if (*took) {
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
    auto a = Alloc(bytes, fit);
    if (!a.ok()) return undo(a.status());
    out.push_back(*a);
  }
  return out;
}

void Allocator::Trim() {
  DrainRemoteFrees();
  sync::LockRobust(&node_.local().header().heap_mu);
  for (auto& cls : node_.local().header().heap) {
    uint64_t cur = cls.current_chunk.load();
    if (cur == 0) continue;
    cls.current_chunk.store(0);
    ChunkRef ref{static_cast<uint32_t>((cur - 1) >> 40), (cur - 1) & ((uint64_t{1} << 40) - 1)};
    if (ref.region >= tables_.size() || ref.chunk >= tables_[ref.region].chunks()) continue;  // node-local: checked
    auto& m = meta(ref.region);
    uint64_t word = m.Load(tables_[ref.region].owner(ref.chunk));
    OwnerWord w = OwnerWord::Decode(word);
    auto h = m.ReadStruct<HeapHeader>(tables_[ref.region].header(ref.chunk));
    if (w.kind == ChunkKind::kHeap && w.node == node_.id() && h.used == 0) {
      if (LockAllocator().ok()) {
        if (meta(ref.region).Fetch(tables_[ref.region].owner(ref.chunk)) == word) FreeSlabLocked(ref);
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


void Allocator::AddReachability(std::function<void(std::vector<uint64_t>&)> provider) {
  std::lock_guard<std::mutex> lock(providers_mu_);
  providers_.push_back(std::move(provider));
}

}  // namespace cxlkv::alloc
