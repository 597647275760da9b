// The global chunk allocator's state in the region (TraCT §3.5): per region of a pool, an owner
// word per chunk, a bitmap (bit set iff the chunk is allocated), and in the first region a
// redo intent record and the remote-free rings. Chunk tables change only under the allocator
// lock (sync::kAllocatorLock); heap-chunk headers only by their owner node.
//
// Crash rule (docs/protocol.md, "Recovery rule"): every multi-word change of a chunk table is
// first written as an intent record and flushed, then published by one word (intent.valid),
// applied, and retired by one word. The next holder of the allocator lock redoes a valid intent
// — the operations are idempotent — so a holder that dies mid-update leaves nothing torn.
#ifndef CXLKV_SRC_ALLOC_CHUNK_TABLE_H_
#define CXLKV_SRC_ALLOC_CHUNK_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cxlkv/region.h"
#include "region/region_internal.h"

namespace cxlkv::alloc {

// Owner word: [63:60] kind, [59:52] node, [51:32] incarnation (low 20 bits), [31:0] detail
// (heap: slot bytes / 64; large head: run length in chunks; large and heap tails: distance to
// the head).
enum class ChunkKind : uint64_t {
  kFree = 0,
  kHeap = 1,         // first chunk of a slab: one or more chunks split into slots of one size by
                     // its owner node
  kLargeHead = 2,    // first chunk of an object of one or more whole chunks
  kLargeTail = 3,    // a following chunk of such an object
  kOrphanHeap = 4,   // a heap chunk whose owner died with published objects in it
  kLeased = 5,       // free, but leased to a node (life): only that node allocates it
  kLeasedObject = 6, // a whole-chunk object the node allocated from its lease (detail: 1)
  kHeapTail = 7,     // a following chunk of a slab (detail: distance to its kHeap or kOrphanHeap head)
};

// Chunk leases (docs/protocol.md, "Chunk leases"): a node takes whole owner-word lines (8
// chunks, 64-byte aligned) under the allocator lock, so that a leased line's words have one
// writer — the lessee, without the lock — and no other node ever dirties that line (P5).
inline constexpr uint64_t kLeaseLineChunks = 8;

struct OwnerWord {
  ChunkKind kind = ChunkKind::kFree;
  uint32_t node = 0;
  uint32_t incarnation = 0;
  uint32_t detail = 0;
  uint64_t Encode() const {
    return (static_cast<uint64_t>(kind) << 60) | (uint64_t{node & 0xff} << 52) |
           (uint64_t{incarnation & 0xfffff} << 32) | detail;
  }
  static OwnerWord Decode(uint64_t w) {
    return {static_cast<ChunkKind>(w >> 60), static_cast<uint32_t>((w >> 52) & 0xff),
            static_cast<uint32_t>((w >> 32) & 0xfffff), static_cast<uint32_t>(w)};
  }
};
inline uint32_t Inc20(uint64_t incarnation) { return static_cast<uint32_t>(incarnation & 0xfffff); }

// Remote-free ring (owner node o, freeing node f): single producer f, single consumer o (or,
// once o's life has ended, its recovery under the allocator lock). Line 0, written by f: the
// tail and the pushing word; line 1, written by the consumer: the head; line 2, written by the
// recoverer of one of o's lives: the closed word; then the entries. One writer per line (P5):
// the closed word shared the head's line until layout version 5, and a stale copy of that line
// written back whole by one of its two writers could undo the other's word.
inline constexpr uint64_t kInboxEntries = 256;
inline constexpr uint64_t kInboxHeadOffset = 64;
inline constexpr uint64_t kInboxPushingOffset = 8;
inline constexpr uint64_t kInboxClosedOffset = 128;
inline constexpr uint64_t kInboxEntriesOffset = 192;
inline constexpr uint64_t kInboxBytes = kInboxEntriesOffset + kInboxEntries * 8;
// The pushing word: nonzero while f has decided to push for owner life `owner_inc` and has not
// published yet. Recovery of that life waits for it (see Allocator::PushRemoteFree).
inline uint64_t PushingWord(uint32_t owner_inc, uint32_t pusher_inc) {
  return (uint64_t{1} << 63) | (uint64_t{owner_inc & 0xfffff} << 32) | (pusher_inc & 0xfffff);
}
inline bool PushingFor(uint64_t word, uint32_t owner_inc) {
  return (word >> 63) != 0 && ((word >> 32) & 0xfffff) == (owner_inc & 0xfffff);
}
inline uint32_t PushingPusherInc(uint64_t word) { return static_cast<uint32_t>(word & 0xfffff); }
// The closed word (line 2, written by whoever recovers a life of the owner): the owner life
// whose recovery has begun. A pusher that announced its push and then finds the ring closed for
// the life it pushes to frees in place instead: a push after recovery consumed the ring would
// never be applied (the pushing word and this word are a Dekker pair).
inline uint64_t ClosedWord(uint32_t owner_inc) { return (uint64_t{1} << 63) | (owner_inc & 0xfffff); }
// The closed word once that recovery has consumed the ring: the ring is the owner's next life's
// to drain again (a pusher still treats the ring as closed for the recovered life).
inline constexpr uint64_t kClosedDoneBit = uint64_t{1} << 62;
inline uint64_t RecoveredWord(uint32_t owner_inc) { return ClosedWord(owner_inc) | kClosedDoneBit; }
inline bool ClosedFor(uint64_t word, uint32_t owner_inc) { return (word & ~kClosedDoneBit) == ClosedWord(owner_inc); }
// True while the recovery of an owner life other than `life` may be consuming the ring.
inline bool OtherLifesRecoveryUnderWay(uint64_t word, uint32_t life) {
  return (word >> 63) != 0 && (word & kClosedDoneBit) == 0 && (word & 0xfffff) != (life & 0xfffff);
}
// The drain word of owner o: nonzero while a drainer of o (one process at a time, under o's
// node-local drain_mu) consumes o's rings, naming its life. It sits in line 0 of o's own ring
// (o, o), which only o's processes write (a node frees its own objects in place), so no region
// layout changes. With the closed words it is a Dekker pair, each side flushing its word before
// reading the other's: a drainer announces, then reads each ring's closed word and leaves a
// ring alone while an older life's recovery is under way; a recoverer closes the rings, then
// waits (before taking the allocator lock) while a drainer of another life is announced. So a
// recovery and the next life's drain never consume one ring at the same time, and neither's
// head store can move the head back over entries the other applied.
inline constexpr uint64_t kInboxDrainingOffset = 16;
inline uint64_t DrainingWord(uint32_t life) { return (uint64_t{1} << 63) | (life & 0xfffff); }
// A ring's head and tail are read from the region: a consumer walks [head, tail) only when it
// holds at most kInboxEntries messages (a corrupted tail would otherwise loop for 2^64 steps).
inline bool RingSane(uint64_t head, uint64_t tail) { return head <= tail && tail - head <= kInboxEntries; }

// What an intent record does to its run of owner words.
enum IntentOp : uint64_t {
  kAllocate = 1,  // the head word is `owner`, the rest continuation words; bits set
  kFree = 2,      // every word and bit cleared
  kSetWord = 3,   // one word set to `owner`; its bit set unless `owner` is 0
  kLease = 4,     // every word set to `owner`; bits set
  kEndLease = 5,  // one whole lease line of the life `owner` (its kLeased word) stops being leased:
                  // that life's kLeased words cleared, its kLeasedObject words become one-chunk
                  // kLargeHead objects of the same life; any other word is left as it is. One
                  // intent for the line, so `check` never sees it half leased (P5), and redoing it
                  // changes nothing it changed already.
};

struct Intent {
  uint64_t valid;     // commit word: 1 while the intent must be (re)applied
  uint64_t op;        // an IntentOp (read from the region: checked by IntentValid)
  uint64_t region;
  uint64_t first;
  uint64_t count;
  uint64_t owner;     // encoded OwnerWord of the head (op 1, 3), of every chunk (op 4)
  uint64_t reserved[2];
};
static_assert(sizeof(Intent) == 64);

// Offsets of one region's chunk table.
class ChunkTableLayout {
 public:
  ChunkTableLayout() = default;
  ChunkTableLayout(const Region::Impl& region, uint32_t max_nodes);

  static uint64_t Bytes(uint64_t chunks, uint32_t max_nodes, bool with_inboxes);
  // Checks the chunk-table area's parameter (chunk count) against its size and the data area,
  // at attach. `first`: the pool's first region, which also holds the remote-free rings.
  // Errors: kCorrupted naming the area, the value and what to do.
  static Status Validate(const Region::Impl& region, uint32_t max_nodes, bool first);
  // True when chunks [first, first + count) lie in the table and count >= 1.
  bool RunInRange(uint64_t first, uint64_t count) const {
    return count >= 1 && first < chunks_ && count <= chunks_ - first;
  }

  bool valid() const { return chunks_ != 0; }
  uint64_t chunks() const { return chunks_; }
  uint64_t intent() const { return base_; }
  uint64_t owner(uint64_t chunk) const { return base_ + 64 + chunk * 8; }
  uint64_t bitmap_word(uint64_t chunk) const { return bitmap_ + (chunk / 64) * 8; }
  // The slab header line of `chunk` (used while it heads a slab): a line of its own per chunk,
  // written only by the slab's owner node (P5), so the slab's own bytes are all slots.
  uint64_t header(uint64_t chunk) const { return headers_ + chunk * 64; }
  uint64_t chunk_base(uint64_t chunk) const { return data_offset_ + chunk * chunk_bytes_; }
  uint64_t inbox(uint32_t owner, uint32_t freer) const {
    return inboxes_ + (uint64_t{owner} * max_nodes_ + freer) * kInboxBytes;
  }
  bool has_inboxes() const { return has_inboxes_; }
  uint64_t data_offset() const { return data_offset_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }

 private:
  uint64_t base_ = 0, bitmap_ = 0, headers_ = 0, inboxes_ = 0, chunks_ = 0;
  uint64_t data_offset_ = 0, chunk_bytes_ = 0;
  uint32_t max_nodes_ = 0;
  bool has_inboxes_ = false;
};

// Slabs (docs/protocol.md, "Slabs"): a run of `slab_chunks` whole chunks carved into slots of
// exactly `class_bytes` (a multiple of 64: a namespace's block size, or a power-of-two class of
// the rounded heap). Its header is the table's header line of its first chunk, not part of the
// slab, so a slab of k chunks holds floor(k * chunk / class) slots; the slot bitmap sits in the
// header line while a slab has at most kInlineSlots slots, otherwise at the slab's start. Written
// by the owner node only (or, for an orphan, by the allocator-lock holder).
inline constexpr uint64_t kInlineSlots = 128;
inline constexpr uint32_t kMaxSlabChunks = 16;
struct HeapHeader {
  uint32_t magic;
  uint32_t slab_chunks;
  uint64_t class_bytes;
  uint64_t slots;
  uint64_t used;
  uint64_t owner;        // the owner word at the time the slab was formatted
  uint64_t first_slot;   // byte offset of slot 0 from the slab start (the in-slab bitmap's size)
  uint64_t inline_bits[kInlineSlots / 64];
};
static_assert(sizeof(HeapHeader) == 64);
inline constexpr uint32_t kHeapMagic = 0x42414c53u;  // "SLAB"

// The rounded heap's classes: powers of two from 64 B to 256 KiB (alloc::kMaxHeapObject).
inline constexpr uint64_t kMinClassBytes = 64;
inline constexpr uint64_t kMaxClassBytes = uint64_t{256} << 10;

// Slots, in-slab bitmap bytes and first-slot offset of a slab of `slab_chunks` chunks of
// `class_bytes` slots. REQUIRES: class_bytes >= 64, slab_chunks >= 1.
struct HeapGeometry {
  uint64_t slots, bitmap_bytes, first_slot;
  bool inline_bitmap() const { return bitmap_bytes == 0; }
};
HeapGeometry GeometryFor(uint64_t chunk_bytes, uint64_t class_bytes, uint64_t slab_chunks = 1);
// Share of a slab's bytes that its slots hold.
double SlabFill(uint64_t chunk_bytes, uint64_t class_bytes, uint64_t slab_chunks);
// The slab length for slots of `class_bytes`, at most `max_chunks`: the shortest within a point
// of the best fill any length up to `max_chunks` reaches (a short slab strands less of a small
// pool in a node's partly used slab). 0 when no slab up to `max_chunks` holds one slot.
uint32_t SlabChunksFor(uint64_t chunk_bytes, uint64_t class_bytes, uint32_t max_chunks);
// The fewest chunks a slab of `class_bytes` slots needs for one slot.
inline uint64_t MinSlabChunks(uint64_t chunk_bytes, uint64_t class_bytes) {
  return (class_bytes + chunk_bytes - 1) / chunk_bytes;
}

// True when a slab header read from the region can be used to index its slab: magic, a slot
// size and length that fit the table's limits, the geometry they imply, used <= slots.
// Everything that divides by class_bytes or walks the slot bitmap checks this first.
bool HeapHeaderValid(const HeapHeader& h, uint64_t chunk_bytes);
// Region offset of word `wd` of the slot bitmap of the slab headed by `chunk` (header `h`, valid).
inline uint64_t SlotBitmapWord(const ChunkTableLayout& t, uint64_t chunk, const HeapHeader& h, uint64_t wd) {
  return h.first_slot == 0 ? t.header(chunk) + offsetof(HeapHeader, inline_bits) + wd * 8
                           : t.chunk_base(chunk) + wd * 8;
}
// Chunks of the slab headed by `chunk` of region `meta`'s table, counted from the owner words:
// the head and the kHeapTail words after it that name it (same node and life, distance i).
// Capped at kMaxSlabChunks. The owner words change only under the allocator lock; read without
// it, the count is a snapshot.
uint64_t SlabRun(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk);
// The chunk that heads the slab `chunk` lies in: `chunk` itself unless its owner word `w` is a
// tail whose distance leads into its head's run (a corrupted distance is not followed).
uint64_t SlabHeadOf(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk, OwnerWord w);
// The header line of `chunk`, read past this process's cache (another node may have written it).
HeapHeader ReadSlabHeader(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk);
// Slots set in the bitmap of the slab headed by `chunk` (header `h`, valid), read past the cache
// (the header line was, by ReadSlabHeader).
uint64_t SlotsInUse(region::MetaAccess& meta, const ChunkTableLayout& t, uint64_t chunk, const HeapHeader& h);

// Applies an intent to region `r`'s table (idempotent). Returns false, writing nothing, when
// the intent's run or op is out of range (a corrupted record).
bool IntentValid(const ChunkTableLayout& table, const Intent& intent);
void ApplyIntent(region::MetaAccess& meta, const ChunkTableLayout& table, const Intent& intent);

// Read-only accounting and invariant checks for `cxlkv stat` / `cxlkv check` (no lock taken:
// run them on a quiet pool, or accept a snapshot).
struct RegionUsage {
  uint64_t chunks = 0, free = 0, heap = 0, large = 0, orphan = 0;
  uint64_t leased = 0;             // free chunks leased to a node (neither free nor allocated)
  uint64_t allocated_bytes = 0;    // objects: heap slots in use × class + whole-chunk runs
                                   // (leased chunks allocated as objects included)
  std::vector<uint64_t> per_node;  // chunks owned, by node
};
RegionUsage InspectChunks(Region& region, uint32_t max_nodes);

// Appends a line per violated invariant to `problems`: bit vs owner word, run heads and tails,
// heap headers (magic, used == bits set), leased lines (whole lines of one life), a pending
// intent.
void CheckChunks(Region& region, uint32_t region_index, uint32_t max_nodes,
                 std::vector<std::string>& problems);

// True when the object at byte offset `off` of `region` is allocated (for root checks).
bool IsAllocated(Region& region, uint64_t off, uint32_t max_nodes);

}  // namespace cxlkv::alloc

#endif  // CXLKV_SRC_ALLOC_CHUNK_TABLE_H_
