// The prefix index's shared layout (TraCT §4.2, §4.3): the kIndex area of a pool's first region.
//
//   header (4 KiB)          written once by `init`
//   namespace table         kMaxNamespaces × 256 B, under the namespace lock
//   entries                 stripes × slots_per_stripe × 64 B; a stripe is an independent
//                           linear-probing table guarded by its own two-tier lock
//   access stamps           max_nodes × entries × 8 B: row n written only by node n
//   node counters           max_nodes × 256 B: row n written only by node n
//   pin directories         max_nodes × (pin_pages / 8) B, whole lines: row n written by node n
//   pin pages               max_nodes × pin_pages × 512 B: row n written by node n
//
// An entry's first word is its state: generation << 8 | state. Every reuse of a slot bumps the
// generation, so a reader that saw (gen, READY), pinned, and sees the same word again knows the
// entry did not change under it. Every struct here is part of the layout version.
#ifndef CXLKV_SRC_CACHE_LAYOUT_H_
#define CXLKV_SRC_CACHE_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "cxlkv/cache.h"

namespace cxlkv::cache {

inline constexpr uint64_t kIndexMagic = 0x5844494b564c5843ull;  // "CXLKVIDX"
// 2: writer words name the process slot; 3: capacity tiers; 4: pin tables (a lookup pins its
// whole chain in one contiguous record instead of one pin word per slot)
inline constexpr uint32_t kIndexVersion = 4;
inline constexpr uint32_t kMaxNamespaces = 64;
inline constexpr uint64_t kIndexHeaderBytes = 4096;
inline constexpr uint64_t kMaxBlockBytes = 0xffffffffull;
// `pct` percent of `bytes`, exactly (bytes / 100 * pct fell up to 99 bytes short: a watermark
// of 100% then sat just under the capacity, and a put that filled the pool exactly evicted).
inline constexpr uint64_t PercentOf(uint64_t bytes, uint64_t pct) { return bytes / 100 * pct + bytes % 100 * pct / 100; }

enum EntryState : uint64_t {
  kEmpty = 0,      // never used since the last cleanup: ends a probe sequence
  kWriting = 1,    // reserved by `writer`; payload being written; invisible to lookups
  kReady = 2,      // payload complete and flushed; may be pinned
  kEvicting = 3,   // an evictor holds the stripe lock and is checking pins / freeing
  kTombstone = 4,  // deleted: probing continues past it; reusable by inserts
};

inline uint64_t StateWord(uint64_t gen, EntryState s) { return (gen << 8) | s; }
inline EntryState StateOf(uint64_t word) { return static_cast<EntryState>(word & 0xff); }
inline uint64_t GenOf(uint64_t word) { return word >> 8; }
const char* StateName(EntryState s);

struct IndexHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t stripes;
  uint32_t slots_per_stripe;
  uint32_t max_nodes;
  uint32_t lock_base;         // stripe s uses lock lock_base + s; lock_base + stripes: namespaces
  uint32_t flags;             // kFlagChecksum | kFlagCentral
  uint64_t capacity_bytes;    // payload budget for the watermarks
  uint32_t high_watermark_pct;
  uint32_t low_watermark_pct;
  uint64_t epoch_us;          // origin of access stamps (realtime µs at init)
  uint64_t namespaces_offset; // region offsets of the parts
  uint64_t entries_offset;
  uint64_t stamps_offset;
  uint64_t counters_offset;
  uint64_t pin_dirs_offset;
  uint64_t pin_pages_offset;
  uint32_t pin_pages;         // per node
  uint32_t reserved32;
  uint64_t reserved[2];
};
static_assert(sizeof(IndexHeader) == 128);
inline constexpr uint32_t kFlagChecksum = 1;
inline constexpr uint32_t kFlagCentral = 2;  // metadata central: one service writes the index

struct NamespaceSlot {
  uint64_t state;             // 0 empty, 2 live (written last)
  uint64_t seed_lo, seed_hi;  // h_0 of its chains
  uint64_t identity_hash;     // model id, extra key, tp rank/size, pp stage
  uint64_t block_bytes;
  KvLayoutSignature layout;   // 40 bytes
  char model_id[96];
  char extra_key[64];
  uint64_t reserved[2];
};
static_assert(sizeof(KvLayoutSignature) == 40);
static_assert(sizeof(NamespaceSlot) == 256);

// Where an entry's payload lives (Unified KV pooling Table I: the index is the one lookup table
// over every device). Tier 0 is the pool's regions; a capacity tier is a device of one node,
// served by that node's cxlkvd (docs/tiers.md, "Global lookup table").
enum EntryTier : uint16_t {
  kTierRegion = 0,  // payload: pool offset
  kTierMem = 1,     // payload: TierLocation in the owner's node-DRAM device (dies with its process)
  kTierSsd = 2,     // payload: TierLocation in the owner's SSD device (survives its process)
};
inline bool IsCapacityTier(uint16_t t) { return t == kTierMem || t == kTierSsd; }
// A capacity location: device index of the owner (16 bits) | slot of that device (48 bits).
inline uint64_t TierLocation(uint32_t device, uint64_t slot) {
  return (uint64_t{device & 0xffff} << 48) | (slot & 0xffffffffffffull);
}
inline uint32_t LocationDevice(uint64_t loc) { return static_cast<uint32_t>(loc >> 48); }
inline uint64_t LocationSlot(uint64_t loc) { return loc & 0xffffffffffffull; }

struct Entry {
  uint64_t state;             // StateWord(gen, state)
  uint64_t key_lo, key_hi;
  uint64_t payload;           // tier 0: pool offset; a capacity tier: TierLocation
  uint32_t bytes;             // payload length (a block is < 4 GiB)
  uint16_t tier;              // EntryTier
  uint16_t ns;                // namespace slot
  uint64_t writer;            // WriterWord: node, process slot and life of the reserver; on a
                              // capacity tier, of the cxlkvd process that owns the device
  uint64_t checksum;
  uint64_t stamp_us;          // commit time (the access stamp before any pin)
};
static_assert(sizeof(Entry) == 64);
static_assert(offsetof(Entry, state) == 0);

// node (16 bits) | process slot of the node (16) | life (32): the life ends with the node, the
// slot names the process, so what one dead process of a live node left is found too.
inline uint64_t WriterWord(uint32_t node, uint64_t inc, uint32_t process_slot) {
  return (uint64_t{node & 0xffff} << 48) | (uint64_t{process_slot & 0xffff} << 32) | (inc & 0xffffffffull);
}
inline uint32_t WriterNode(uint64_t w) { return static_cast<uint32_t>(w >> 48); }
inline uint32_t WriterSlot(uint64_t w) { return static_cast<uint32_t>((w >> 32) & 0xffff); }
inline uint64_t WriterInc(uint64_t w) { return w & 0xffffffffull; }

// Pin tables (docs/protocol.md, "Pins"). Each node has `pin_pages` pages of 64 words: word 0
// names the owning process (its WriterWord; 0 = free), words 1..63 each hold the fingerprint
// of one pinned key (0 = none). A lookup writes the fingerprints of its whole chain into
// consecutive words *before* it probes, so a chain of n keys publishes n/8 lines instead of n
// scattered ones. The node's directory has one bit per page that may hold pins: evictors read
// the directory, then only those pages. Access stamps (µs since the epoch, for LRU) are kept
// per node and slot apart from the pins: they are hints and are written back lazily.
inline constexpr uint32_t kPinPageWords = 64;
inline constexpr uint32_t kPinsPerPage = kPinPageWords - 1;
inline constexpr uint64_t kPinPageBytes = kPinPageWords * 8;
inline constexpr uint32_t kMinPinPages = 64;
inline constexpr uint32_t kMaxPinPages = 8192;  // 516 K keys pinned at once per node
// A key's fingerprint in a pin word: never 0. Two keys with one fingerprint only make an
// evictor keep a block it could have dropped.
inline uint64_t PinFingerprint(uint64_t key_lo, uint64_t key_hi) {
  uint64_t f = key_lo ^ (key_hi * 0x9e3779b97f4a7c15ull) ^ (key_hi >> 29);
  return f != 0 ? f : 1;
}
// BlockPin::pin_word: the pin's word (a region offset, < 2^44) and the low 20 bits of the life
// that took it, so that a release by a later life of the process (paused past its lease, its
// pages recovered and maybe claimed again) touches nothing.
inline constexpr uint64_t kPinRefWordBits = 44;
inline uint64_t PinRef(uint64_t word, uint64_t life) { return ((life & 0xfffff) << kPinRefWordBits) | word; }
inline uint64_t PinRefWord(uint64_t ref) { return ref & ((uint64_t{1} << kPinRefWordBits) - 1); }
inline uint64_t PinRefLife(uint64_t ref) { return ref >> kPinRefWordBits; }

// One node's counters (single writer: that node's processes, with local atomics).
enum Counter : uint32_t {
  kLookups = 0,        // Lookup calls (the denominator of hit rates)
  kLookupBlocks,       // keys asked for
  kHitBlocks,
  kHitTokens,
  kMissBlocks,         // keys asked for and not hit (a lookup stops at the first miss)
  kZeroHitLookups,
  kInserts,            // commits
  kInsertBytes,
  kDuplicates,         // reserve found the block READY
  kBusy,               // reserve found it being written or evicted
  kAborts,
  kEvictions,
  kEvictedBytes,
  kReclaimed,          // entries of dead nodes returned to EMPTY by recovery
  kBytesClaimed,       // payload bytes of entries this node made WRITING
  kBytesReleased,      // payload bytes of entries this node tombstoned
  kReadBytes,
  kWriteBytes,
  kChecksumFailures,
  kFullErrors,
  kSpills,             // blocks this node moved from the region to a capacity tier
  kSpilledBytes,
  kPromotes,           // blocks this node moved from a capacity tier back to the region
  kPromotedBytes,
  kCapacityHits,       // blocks a lookup found on a capacity tier and brought in
  kCapacityMisses,     // ... and could not (owner gone, slot invalid, region full)
  kTierDrops,          // capacity entries dropped (tier full, owner's DRAM gone, invalid slot)
  kCapacityHitsSsd,    // of kCapacityHits: blocks that were on an SSD tier (the rest: node DRAM)
  kCounterCount,
};
inline constexpr uint64_t kCounterRowBytes = 256;
static_assert(kCounterCount * 8 <= kCounterRowBytes);
const char* CounterName(Counter c);

// Where each part lives, from the header.
struct IndexLayout {
  uint64_t area_offset = 0;
  IndexHeader h{};

  uint64_t entries() const { return uint64_t{h.stripes} * h.slots_per_stripe; }
  uint64_t ns_slot(uint32_t i) const { return h.namespaces_offset + uint64_t{i} * sizeof(NamespaceSlot); }
  uint64_t entry(uint64_t slot) const { return h.entries_offset + slot * sizeof(Entry); }
  uint64_t stamp(uint32_t node, uint64_t slot) const {
    return h.stamps_offset + (uint64_t{node} * entries() + slot) * 8;
  }
  // Words of one node's pin directory: one bit per page, padded to whole lines.
  uint64_t pin_dir_words() const { return (uint64_t{h.pin_pages} + 511) / 512 * 8; }
  uint64_t pin_dir(uint32_t node) const { return h.pin_dirs_offset + uint64_t{node} * pin_dir_words() * 8; }
  uint64_t pin_page(uint32_t node, uint32_t page) const {
    return h.pin_pages_offset + (uint64_t{node} * h.pin_pages + page) * kPinPageBytes;
  }
  uint64_t counter(uint32_t node, Counter c) const {
    return h.counters_offset + uint64_t{node} * kCounterRowBytes + uint64_t{c} * 8;
  }
  uint32_t stripe_lock(uint32_t stripe) const { return h.lock_base + stripe; }
  uint32_t namespace_lock() const { return h.lock_base + h.stripes; }
  uint32_t stripe_of(uint64_t slot) const { return static_cast<uint32_t>(slot / h.slots_per_stripe); }
};

struct IndexOptions {
  uint64_t entries = 0;          // 0: one per 16 KiB of data, 1 Ki .. 4 Mi
  uint32_t stripes = 0;          // 0: up to 32
  uint64_t capacity_bytes = 0;   // 0: the data areas' total
  uint32_t high_watermark_pct = 95;
  uint32_t low_watermark_pct = 85;
  bool checksum = false;
  bool central = false;          // metadata central (kFlagCentral)
};

// Sizes the index for a pool whose regions hold `data_bytes` of data in all.
IndexHeader PlanIndex(const IndexOptions& options, uint64_t data_bytes, uint32_t max_nodes,
                      uint32_t lock_base);
// Pin pages per node for an index of `entries` (every entry pinnable once, within bounds).
uint32_t PinPagesFor(uint64_t entries);
// Bytes of the area for a planned header (offsets inside are relative to the area).
uint64_t IndexAreaBytes(const IndexHeader& planned);
// Locks the index needs (stripes + the namespace lock).
inline uint32_t IndexLocks(const IndexHeader& planned) { return planned.stripes + 1; }

}  // namespace cxlkv::cache

#endif  // CXLKV_SRC_CACHE_LAYOUT_H_
