#include "alloc/chunk_table.h"

#include <algorithm>
#include <bit>

namespace cxlkv::alloc {
namespace {

uint64_t RoundLine(uint64_t v) { return (v + 63) / 64 * 64; }

}  // namespace

uint64_t ChunkTableLayout::Bytes(uint64_t chunks, uint32_t max_nodes, bool with_inboxes) {
  uint64_t bytes = 64 + RoundLine(chunks * 8) + RoundLine((chunks + 63) / 64 * 8) + chunks * 64;
  if (with_inboxes) bytes += uint64_t{max_nodes} * max_nodes * kInboxBytes;
  return bytes;
}

ChunkTableLayout::ChunkTableLayout(const Region::Impl& region, uint32_t max_nodes) {
  const auto* table = region.find_area(region::AreaKind::kChunkTable);
  const auto* data = region.find_area(region::AreaKind::kData);
  if (table == nullptr || data == nullptr) return;
  max_nodes_ = max_nodes;
  chunk_bytes_ = region.superblock().chunk_bytes;
  data_offset_ = data->offset;
  chunks_ = std::min<uint64_t>(table->param, data->size / chunk_bytes_);
  base_ = table->offset;
  bitmap_ = base_ + 64 + RoundLine(table->param * 8);
  headers_ = bitmap_ + RoundLine((table->param + 63) / 64 * 8);
  inboxes_ = headers_ + table->param * 64;
  has_inboxes_ = table->size >= Bytes(table->param, max_nodes, true);
}

Status ChunkTableLayout::Validate(const Region::Impl& region, uint32_t max_nodes, bool first) {
  const auto* table = region.find_area(region::AreaKind::kChunkTable);
  const auto* data = region.find_area(region::AreaKind::kData);
  const std::string where = "region " + region.info().path + " area chunk-table is corrupt: ";
  const std::string recreate = ": re-create the pool with 'cxlkv init'";
  if (table == nullptr || data == nullptr) {
    return InvalidArgument("region " + region.info().path + " was not made as part of a pool (no chunk "
                           "table): create it with 'cxlkv init'");
  }
  // data->param == data->size / chunk_bytes was checked by the region layer.
  if (table->param < data->param || table->param > (uint64_t{1} << 40)) {
    return Corrupted(where + "parameter " + std::to_string(table->param) + " chunks, but the data area holds " +
                     std::to_string(data->param) + recreate);
  }
  if (Bytes(table->param, max_nodes, first) > table->size) {
    return Corrupted(where + "parameter " + std::to_string(table->param) + " chunks" +
                     (first ? " and the remote-free rings of " + std::to_string(max_nodes) + " nodes" : "") +
                     " do not fit its " + std::to_string(table->size) + " bytes" + recreate);
  }
  return Status::Ok();
}

bool HeapHeaderValid(const HeapHeader& h, uint64_t chunk_bytes) {
  if (h.magic != kHeapMagic || h.slab_chunks < 1 || h.slab_chunks > kMaxSlabChunks || h.class_bytes < kMinClassBytes ||
      h.class_bytes % 64 != 0 || h.class_bytes > uint64_t{h.slab_chunks} * chunk_bytes) {
    return false;
  }
  HeapGeometry g = GeometryFor(chunk_bytes, h.class_bytes, h.slab_chunks);
  return g.slots >= 1 && h.slots == g.slots && h.first_slot == g.first_slot && h.used <= h.slots;
}

uint64_t SlabRun(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk) {
  const OwnerWord head = OwnerWord::Decode(meta.Fetch(t.owner(chunk)));
  uint64_t n = 1;
  while (n < kMaxSlabChunks && chunk + n < t.chunks()) {
    const OwnerWord w = OwnerWord::Decode(meta.Fetch(t.owner(chunk + n)));
    if (w.kind != ChunkKind::kHeapTail || w.detail != n || w.node != head.node || w.incarnation != head.incarnation) break;
    ++n;
  }
  return n;
}

bool IntentValid(const ChunkTableLayout& table, const Intent& intent) {
  const bool line = intent.first % kLeaseLineChunks == 0 && intent.count == kLeaseLineChunks;
  return (intent.op >= IntentOp::kAllocate && intent.op <= IntentOp::kEndLease) &&
         table.RunInRange(intent.first, intent.count) && (intent.op != IntentOp::kSetWord || intent.count == 1) &&
         (intent.op != IntentOp::kEndLease || line);
}

HeapGeometry GeometryFor(uint64_t chunk_bytes, uint64_t class_bytes, uint64_t slab_chunks) {
  const uint64_t total = chunk_bytes * slab_chunks;
  if (total / class_bytes <= kInlineSlots) return {total / class_bytes, 0, 0};
  // Too many slots for the header line: the bitmap takes the slab's first lines.
  uint64_t slots = total * 8 / (8 * class_bytes + 1);
  for (;;) {
    uint64_t bitmap = RoundLine((slots + 63) / 64 * 8);
    if (bitmap + slots * class_bytes <= total) return {slots, bitmap, bitmap};
    --slots;
  }
}

double SlabFill(uint64_t chunk_bytes, uint64_t class_bytes, uint64_t slab_chunks) {
  const HeapGeometry g = GeometryFor(chunk_bytes, class_bytes, slab_chunks);
  return static_cast<double>(g.slots * class_bytes) / static_cast<double>(chunk_bytes * slab_chunks);
}

uint32_t SlabChunksFor(uint64_t chunk_bytes, uint64_t class_bytes, uint32_t max_chunks) {
  max_chunks = std::min(max_chunks, kMaxSlabChunks);
  const uint64_t first = MinSlabChunks(chunk_bytes, class_bytes);
  if (first > max_chunks) return 0;
  double best = 0;
  for (uint64_t k = first; k <= max_chunks; ++k) best = std::max(best, SlabFill(chunk_bytes, class_bytes, k));
  for (uint64_t k = first; k <= max_chunks; ++k) {
    if (SlabFill(chunk_bytes, class_bytes, k) >= best - 0.01) return static_cast<uint32_t>(k);
  }
  return static_cast<uint32_t>(first);
}

void ApplyIntent(region::MetaAccess& meta, const ChunkTableLayout& table, const Intent& intent) {
  if (!IntentValid(table, intent)) return;  // a corrupted record: callers report it
  {
    // P2 before writing: owner words and bitmap bits of neighbouring chunks share these lines
    // and other nodes changed them under the lock. Storing into a stale cached line and
    // flushing it would write their old values back (the simulator caught exactly that).
    meta.Invalidate(table.owner(intent.first), intent.count * 8);
    meta.Invalidate(table.bitmap_word(intent.first),
                    table.bitmap_word(intent.first + intent.count - 1) - table.bitmap_word(intent.first) + 8);
  }
  for (uint64_t i = 0; i < intent.count; ++i) {
    uint64_t c = intent.first + i;
    uint64_t word = 0;
    if (intent.op == IntentOp::kLease) {
      word = intent.owner;
    } else if (intent.op == IntentOp::kEndLease) {
      word = meta.Load(table.owner(c));  // current: invalidated above, written only under the lock now
      const OwnerWord now = OwnerWord::Decode(word), life = OwnerWord::Decode(intent.owner);
      if (now.node == life.node && now.incarnation == life.incarnation) {
        if (now.kind == ChunkKind::kLeased) word = 0;
        if (now.kind == ChunkKind::kLeasedObject) {
          word = OwnerWord{ChunkKind::kLargeHead, now.node, now.incarnation, 1}.Encode();
        }
      }
    } else if (intent.op == IntentOp::kAllocate || intent.op == IntentOp::kSetWord) {
      OwnerWord head = OwnerWord::Decode(intent.owner);
      if (i == 0) {
        word = intent.owner;
      } else {
        // A slab's tails name its head as a run's do, as kHeapTail: recovery, `check` and
        // frees find the slab from any of its chunks.
        const ChunkKind tail = head.kind == ChunkKind::kHeap ? ChunkKind::kHeapTail : ChunkKind::kLargeTail;
        word = OwnerWord{tail, head.node, head.incarnation, static_cast<uint32_t>(i)}.Encode();
      }
    }
    meta.Store(table.owner(c), word);
    uint64_t bit = uint64_t{1} << (c % 64);
    uint64_t bits = meta.Load(table.bitmap_word(c));
    meta.Store(table.bitmap_word(c), word != 0 ? (bits | bit) : (bits & ~bit));
  }
  {
    meta.Flush(table.owner(intent.first), intent.count * 8);
    meta.Flush(table.bitmap_word(intent.first),
               table.bitmap_word(intent.first + intent.count - 1) - table.bitmap_word(intent.first) + 8);
  }
}

RegionUsage InspectChunks(Region& region, uint32_t max_nodes) {
  RegionUsage u;
  u.per_node.assign(max_nodes, 0);
  ChunkTableLayout t(region.impl(), max_nodes);
  if (!t.valid()) return u;
  auto& meta = region.impl().meta();
  u.chunks = t.chunks();
  for (uint64_t c = 0; c < t.chunks(); ++c) {
    OwnerWord w = OwnerWord::Decode(meta.Fetch(t.owner(c)));
    switch (w.kind) {
      case ChunkKind::kFree: ++u.free; break;
      case ChunkKind::kHeap: ++u.heap; break;
      case ChunkKind::kLargeHead:
      case ChunkKind::kLargeTail: ++u.large; u.allocated_bytes += t.chunk_bytes(); break;
      case ChunkKind::kOrphanHeap: ++u.orphan; break;
      case ChunkKind::kLeased: ++u.leased; break;
      case ChunkKind::kLeasedObject: ++u.large; u.allocated_bytes += t.chunk_bytes(); break;
      case ChunkKind::kHeapTail: break;  // below
    }
    if (w.kind == ChunkKind::kHeap || w.kind == ChunkKind::kOrphanHeap) {
      const HeapHeader h = ReadSlabHeader(meta, t, c);
      if (HeapHeaderValid(h, t.chunk_bytes())) u.allocated_bytes += h.used * h.class_bytes;
    }
    if (w.kind == ChunkKind::kHeapTail) {
      ++u.heap;  // counted with its slab (an orphan's tails too: the head says which)
    }
    if (w.kind == ChunkKind::kHeap || w.kind == ChunkKind::kLargeHead || w.kind == ChunkKind::kLargeTail ||
        w.kind == ChunkKind::kLeased || w.kind == ChunkKind::kLeasedObject || w.kind == ChunkKind::kHeapTail) {
      if (w.node < max_nodes) ++u.per_node[w.node];
    }
  }
  return u;
}

void CheckChunks(Region& region, uint32_t region_index, uint32_t max_nodes,
                 std::vector<std::string>& problems) {
  ChunkTableLayout t(region.impl(), max_nodes);
  std::string where = "region " + std::to_string(region_index) + " ";
  if (!t.valid()) {
    problems.push_back(where + "has no chunk table");
    return;
  }
  auto& meta = region.impl().meta();
  meta.Invalidate(t.intent(), 64);
  auto intent = meta.ReadStruct<Intent>(t.intent());
  if (intent.valid && !IntentValid(t, intent)) {
    problems.push_back(where + "has a corrupted allocator intent (op " + std::to_string(intent.op) + ", chunks " +
                       std::to_string(intent.first) + " +" + std::to_string(intent.count) + " of " +
                       std::to_string(t.chunks()) + "): allocation refuses to run; re-create the pool");
  } else if (intent.valid) {
    problems.push_back(where + "has a pending allocator intent (a holder died mid-update; the next "
                       "allocation redoes it)");
  }
  if (t.has_inboxes()) {
    for (uint32_t o = 0; o < max_nodes; ++o) {
      for (uint32_t f = 0; f < max_nodes; ++f) {
        uint64_t ring = t.inbox(o, f), tail = meta.Fetch(ring), head = meta.Fetch(ring + kInboxHeadOffset);
        if (!RingSane(head, tail)) {
          problems.push_back(where + "remote-free ring of node " + std::to_string(o) + " from node " +
                             std::to_string(f) + " is corrupt (head " + std::to_string(head) + ", tail " +
                             std::to_string(tail) + "); its frees are not applied");
        }
      }
    }
  }
  for (uint64_t c = 0; c < t.chunks(); ++c) {
    uint64_t raw = meta.Fetch(t.owner(c));
    bool bit = (meta.Fetch(t.bitmap_word(c)) >> (c % 64)) & 1;
    OwnerWord w = OwnerWord::Decode(raw);
    std::string chunk = where + "chunk " + std::to_string(c) + ": ";
    if (bit != (raw != 0)) {
      problems.push_back(chunk + (bit ? "marked allocated but has no owner" : "owned but marked free"));
    }
    if (raw != 0 && w.node >= max_nodes) problems.push_back(chunk + "owner node out of range");
    if (w.kind == ChunkKind::kLeased || w.kind == ChunkKind::kLeasedObject) {
      // A leased line is written by its lessee without the lock: every word of the line must
      // belong to the same life, or a lock holder could dirty the line beside it (P5).
      const uint64_t first = c / kLeaseLineChunks * kLeaseLineChunks;
      for (uint64_t i = first; i < first + kLeaseLineChunks && i < t.chunks(); ++i) {
        OwnerWord o = OwnerWord::Decode(meta.Fetch(t.owner(i)));
        if ((o.kind != ChunkKind::kLeased && o.kind != ChunkKind::kLeasedObject) || o.node != w.node ||
            o.incarnation != w.incarnation) {
          problems.push_back(chunk + "leased to node " + std::to_string(w.node) + " but chunk " + std::to_string(i) +
                             " of its line is not");
          break;
        }
      }
      if (w.kind == ChunkKind::kLeasedObject && w.detail != 1) {
        problems.push_back(chunk + "leased object spans " + std::to_string(w.detail) + " chunks, not 1");
      }
    } else if (w.kind == ChunkKind::kLargeHead) {
      if (!t.RunInRange(c, w.detail)) {
        problems.push_back(chunk + "large run length " + std::to_string(w.detail) + " is out of range");
        continue;
      }
      for (uint64_t i = 1; i < w.detail; ++i) {
        OwnerWord tail = OwnerWord::Decode(meta.Fetch(t.owner(c + i)));
        if (tail.kind != ChunkKind::kLargeTail || tail.detail != i) {
          problems.push_back(chunk + "run of " + std::to_string(w.detail) + " broken at +" + std::to_string(i));
          break;
        }
      }
      c += w.detail - 1;
    } else if (w.kind == ChunkKind::kLargeTail) {
      problems.push_back(chunk + "a run tail without its head");
    } else if (w.kind == ChunkKind::kHeapTail) {
      problems.push_back(chunk + "a slab tail without its head");
    } else if (w.kind == ChunkKind::kHeap || w.kind == ChunkKind::kOrphanHeap) {
      const uint64_t run = SlabRun(meta, t, c);
      const HeapHeader h = ReadSlabHeader(meta, t, c);
      if (h.magic != kHeapMagic) {
        // An owner that died between taking the slab and formatting it; recovery frees it.
        if (w.kind == ChunkKind::kOrphanHeap) problems.push_back(chunk + "orphan slab without a header");
        c += run - 1;
        continue;
      }
      if (!HeapHeaderValid(h, t.chunk_bytes())) {
        problems.push_back(chunk + "heap header is corrupt (class " + std::to_string(h.class_bytes) + " bytes, " +
                           std::to_string(h.slab_chunks) + " chunks, " + std::to_string(h.slots) + " slots, " +
                           std::to_string(h.used) + " used)");
        c += run - 1;
        continue;
      }
      if (h.slab_chunks != run) {
        problems.push_back(chunk + "slab header says " + std::to_string(h.slab_chunks) + " chunks, the owner words " +
                           std::to_string(run));
      }
      const uint64_t set = SlotsInUse(meta, t, c, h);
      if (set != h.used) {
        problems.push_back(chunk + "heap header says " + std::to_string(h.used) + " objects, bitmap has " +
                           std::to_string(set));
      }
      c += run - 1;
    }
  }
}

bool IsAllocated(Region& region, uint64_t off, uint32_t max_nodes) {
  ChunkTableLayout t(region.impl(), max_nodes);
  if (!t.valid() || off < t.data_offset()) return false;
  uint64_t c = (off - t.data_offset()) / t.chunk_bytes();
  if (c >= t.chunks()) return false;
  auto& meta = region.impl().meta();
  OwnerWord w = OwnerWord::Decode(meta.Fetch(t.owner(c)));
  uint64_t within = off - t.data_offset() - c * t.chunk_bytes();
  if (const uint64_t head = SlabHeadOf(meta, t, c, w); head != c) {  // inside a slab: indexed from its head
    within += (c - head) * t.chunk_bytes();
    c = head;
    w = OwnerWord::Decode(meta.Fetch(t.owner(c)));
  }
  if (w.kind == ChunkKind::kLargeHead || w.kind == ChunkKind::kLeasedObject) return within == 0;
  if (w.kind != ChunkKind::kHeap && w.kind != ChunkKind::kOrphanHeap) return false;
  const HeapHeader h = ReadSlabHeader(meta, t, c);
  if (!HeapHeaderValid(h, t.chunk_bytes()) || within < h.first_slot || (within - h.first_slot) % h.class_bytes) {
    return false;
  }
  uint64_t slot = (within - h.first_slot) / h.class_bytes;
  if (slot >= h.slots) return false;
  return (meta.Fetch(SlotBitmapWord(t, c, h, slot / 64)) >> (slot % 64)) & 1;
}

uint64_t SlabHeadOf(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk, OwnerWord w) {
  if (w.kind != ChunkKind::kHeapTail || w.detail < 1 || w.detail >= kMaxSlabChunks || w.detail > chunk) return chunk;
  return SlabRun(meta, t, chunk - w.detail) > w.detail ? chunk - w.detail : chunk;
}

HeapHeader ReadSlabHeader(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk) {
  meta.Invalidate(t.header(chunk), 64);
  return meta.ReadStruct<HeapHeader>(t.header(chunk));
}

uint64_t SlotsInUse(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk, const HeapHeader& h) {
  const uint64_t words = (h.slots + 63) / 64;
  if (h.first_slot != 0) meta.Invalidate(t.chunk_base(chunk), words * 8);
  uint64_t set = 0;
  for (uint64_t wd = 0; wd < words; ++wd) {
    uint64_t bits = meta.Load(SlotBitmapWord(t, chunk, h, wd));
    if (wd + 1 == words && h.slots % 64) bits &= (uint64_t{1} << (h.slots % 64)) - 1;
    set += std::popcount(bits);
  }
  return set;
}

}  // namespace cxlkv::alloc
