// The prefix index in decentralized mode (TraCT §4.2): every node reads and updates the table
// in the region directly. Lookups take no lock; inserts, evictions and recovery take the
// two-tier lock of the key's stripe (lock striping: unrelated keys do not contend).
//
// Protocol (docs/protocol.md, "prefix index"):
//   lookup   write the chain's key fingerprints into this node's pin table and flush them,
//            then invalidate + read the entries; the READY prefix is pinned, the rest unpinned.
//   reserve  allocate the payload, then under the stripe lock claim a slot: WRITING with this
//            life's writer word, flushed by the release.
//   commit   under the stripe lock, fenced: still WRITING by this life → flush checksum/stamp,
//            then publish READY (a writer paused past its lease commits nothing).
//   evict    under the stripe lock: publish EVICTING, read every node's pin table; the key
//            pinned → publish READY again; not → free the payload, publish TOMBSTONE.
// A pinner writes its pin then reads the state; an evictor writes the state then reads the
// pins: with both flushed before the read, at least one of them sees the other.
//
// Thread-safety: all methods are thread-safe.
#ifndef CXLKV_SRC_CACHE_INDEX_H_
#define CXLKV_SRC_CACHE_INDEX_H_

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <span>
#include <string>
#include <vector>

#include "alloc/allocator.h"
#include "cache/index_api.h"
#include "cache/layout.h"
#include "cxlkv/cache.h"
#include "region/coherence.h"
#include "sync/node.h"

namespace cxlkv::cache {

// Reads the index header of `region` (the pool's first). kNotFound when the pool has none;
// kCorrupted / kVersionMismatch when it is damaged or from another build.
Result<IndexLayout> ReadLayout(Region& region);

// Calls fn(word offset, key fingerprint) for every pin `node`'s pin table holds (the pages its
// directory lists). `invalidate`: drop this host's copies first (P2).
void ReadPinTable(region::MetaAccess& meta, const IndexLayout& l, uint32_t node, bool invalidate,
                  const std::function<void(uint64_t word, uint64_t fingerprint)>& fn);

class Index final : public IndexApi {
 public:
  Index(Region& region, IndexLayout layout, sync::Node& node, alloc::Allocator& allocator);

  const IndexLayout& layout() const { return layout_; }
  uint32_t node_id() const { return node_.id(); }
  uint64_t capacity() const { return capacity_; }
  bool checksums() const override { return layout_.h.flags & kFlagChecksum; }

  Result<NamespaceHandle> RegisterNamespace(const KeyNamespace& ns) override;
  // The namespace registered at `id`: its description and seed, checked against each other (a
  // slot that does not hash to its seed is kCorrupted). kNotFound for a free slot.
  struct RegisteredNamespace {
    KeyNamespace desc;
    BlockKey seed;
  };
  Result<RegisteredNamespace> NamespaceAt(uint32_t id);
  // The seed (h_0 of every chain) a namespace has in every pool: a hash of its description.
  static BlockKey SeedFor(const KeyNamespace& ns);

  Result<LookupResult> Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin) override;
  Result<LookupResult> LookupImpl(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin, bool count);
  Result<LookupResult> LookupMore(const NamespaceHandle& ns, std::span<const BlockKey> keys, size_t earlier_hits,
                                  size_t capacity_run) override;
  void Release(std::span<const BlockPin> pins) override;
  Result<Reservation> Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes) override;
  Status Commit(Reservation& r) override;
  Status Abort(Reservation& r) override;
  // Batched forms (batch.cc); the single-key forms above call them.
  Result<std::vector<KeyReservation>> ReserveMany(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                                  uint64_t bytes) override;
  Status CommitMany(std::span<Reservation> rs) override;
  Status AbortMany(std::span<Reservation> rs) override;
  Result<std::vector<KeyPeek>> Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys) override;
  uint8_t* Payload(uint64_t offset, uint64_t bytes) override {
    return allocator_.Ptr(alloc::ObjectOffset(offset), bytes);
  }
  // Copies payload out, dropping this host's stale copies first where the mode needs it.
  void ReadPayload(void* dst, const uint8_t* p, uint64_t bytes) override {
    if (meta_.mode() == CoherenceMode::kSoftware) {
      region::CopyFromShared(dst, p, bytes);
    } else {
      std::memcpy(dst, p, bytes);
    }
  }
  void InvalidateForRead(const uint8_t* p, uint64_t bytes, bool fence) override {
    if (meta_.mode() != CoherenceMode::kSoftware) return;
    if (fence) {
      region::InvalidateLinesOpt(p, bytes);
    } else {
      region::InvalidateLinesOptUnfenced(p, bytes);
    }
  }
  void CountRead(uint64_t bytes) override { Add(kReadBytes, bytes); }
  void CountWrite(uint64_t bytes) override { Add(kWriteBytes, bytes); }
  void CountChecksumFailure() override { Add(kChecksumFailures, 1); }
  void CountCapacityHitsFromSsd(uint64_t n) override {
    if (!central_writer()) Add(kCapacityHitsSsd, n);
  }
  void CountStreamedHits(const NamespaceHandle& ns, uint64_t n) override;

  // Evicts these keys of `ns` (or every READY entry when `keys` is empty and `all`) if unpinned.
  Result<uint64_t> EvictKeys(const NamespaceHandle& ns, std::span<const BlockKey> keys) override;
  Result<uint64_t> EvictAll() override;
  Result<uint64_t> EvictNamespace(const NamespaceHandle& ns) override;
  // What a reserve asks to make room before it drops blocks (the pool installs its capacity
  // promoter: a node's tiers spill instead). Null: evict.
  void SetRoomMaker(CapacityPromoter* tiers) { room_maker_.store(tiers, std::memory_order_release); }
  // Evicts unpinned READY entries, least recently used first, until `bytes` are freed.
  // Returns the bytes freed (less when not enough is evictable).
  // Evicts the least recently used READY region blocks, at least `bytes` of them; of `only_bytes`
  // each when it is not 0 (a slot of that size is what the put waiting for room can use), and
  // only blocks this node wrote when `only_mine` (their slots are in this node's slabs).
  uint64_t EvictLru(uint64_t bytes, uint64_t only_bytes = 0, bool only_mine = false);
  // Payload bytes of WRITING, READY and EVICTING entries, from every node's counters. A
  // central writer reads its own node's row and the other rows' sums of the last sweep: only
  // service lives write these counters, and a row of a life that no longer serves is final.
  uint64_t UsedBytes();

  // Recovery handler (the manager's process): reclaims `node`'s WRITING entries of life `inc`,
  // finishes any eviction left half done, and drops the node's pins.
  void Recover(uint32_t node, uint64_t inc);
  // Process-recovery handler (a surviving process of this node, on the death of process `slot`
  // of it): tombstones the WRITING entries that process reserved in life `inc` and frees their
  // payloads (the node lives on: its own recovery will not). False when a stripe lock was not
  // granted: the node calls it again later.
  bool RecoverProcess(uint32_t slot, uint64_t inc, bool stop_at_first_miss = false);
  // At close: what this process reserved and never committed or aborted goes, as if it died.
  void AbandonOpenReservations();
  // At close: frees this process's pin pages (its open page, and pins a reader never released).
  void ReleaseProcessPins();
  // Reachability for the allocator's recovery: payloads of READY and EVICTING entries.
  void AppendReachable(std::vector<uint64_t>& out);
  // Publishes this node's counters (the membership thread calls it every beat).
  void PublishCounters();
  // Counts one pinning lookup of `asked` keys that hit `hit` on this node's row (the hit-rate
  // counters). Lookup does it itself, except as a central writer: the client counts its own.
  void CountLookup(const NamespaceHandle& ns, size_t asked, size_t hit);

  uint64_t NowStamp() const;

  // ---- central mode (Beluga §6.2; docs/metadata.md) ----
  // True when the pool's metadata is central: only the metadata service writes the index.
  bool central() const { return layout_.h.flags & kFlagCentral; }
  // Makes this process the index's one writer while `fence` (the metadata service's hold of
  // its lock in a valid lease) passes: stripe locks become one process-local mutex and `fence`
  // replaces the stripe lock's check before every commit. An empty `fence` ends the role.
  void BecomeCentralWriter(std::function<Status()> fence);
  bool central_writer() const { return central_writer_.load(std::memory_order_acquire); }
  // Rule P2 (invalidate before reading what others write) for entries and pin tables. A central
  // writer is their only writer: BecomeCentralWriter invalidates them all once, and from then on
  // the lines in its cache are the table, so its reads skip the invalidate (Beluga's service
  // keeps the index in its own cache). Everyone else invalidates every read.
  bool CacheIsTable() const { return central_writer(); }
  // One word of an entry or a pin table, read under rule P2 (see CacheIsTable).
  uint64_t FetchTableWord(uint64_t off) { return CacheIsTable() ? meta_.Load(off) : meta_.Fetch(off); }
  // The client the central writer acts for in the next operations (the service's thread only):
  // its writer word goes on reservations, its node's pin table takes its pins.
  // Refused (kLeaseExpired) when that life is over in this process's view: a paused client's
  // late request must not touch the row its node's next life pins in. A first request of a
  // node's new life drops the pins its previous life left.
  Status ActFor(uint32_t node, uint64_t writer);
  // Central writer: drops the WRITING entries of process `slot` of `node`'s life `inc` (-1:
  // every process of that life) and frees their payloads. Returns how many.
  uint64_t ReclaimWriter(uint32_t node, uint64_t inc, int64_t slot);
  // Central writer, every few hundred milliseconds: reclaims WRITING entries whose writer's life
  // ended, drops the pins of nodes whose life ended, and finishes evictions a predecessor left half done when `repair_all` (a takeover). Returns the
  // entries reclaimed.
  uint64_t SweepCentral(bool repair_all);

  // ---- capacity tiers (tiering.cc; docs/tiers.md, "Global lookup table") ----
  // A READY entry as the tier layer sees it when moving it between the region and a device.
  struct TierBlock {
    uint64_t slot = 0;
    uint64_t gen = 0;          // the generation it was READY at
    BlockKey key;
    uint32_t ns = 0;           // namespace slot
    uint16_t tier = 0;         // EntryTier
    uint64_t location = 0;     // pool offset (tier 0) or TierLocation
    uint32_t bytes = 0;
    uint64_t writer = 0;       // on a capacity tier: the owning cxlkvd process
    uint64_t stamp = 0;        // last access, µs since the epoch (commit, pin or release)
    uint64_t checksum = 0;     // the entry's xxh3 of the payload (0: unknown or checksums off)
  };
  // The least recently used unpinned READY region entries, oldest first, covering `bytes` (at
  // most `max` of them). A hint: MoveMany checks each again under its stripe lock.
  // Blocks larger than `max_block_bytes` are passed over (no device slot holds them).
  std::vector<TierBlock> SpillCandidates(uint64_t bytes, size_t max, uint64_t max_block_bytes);
  // READY capacity entries owned by a process of `node` (any life), least recently used first;
  // with `with_evicting`, EVICTING ones too (an evictor may still put one back to READY: until
  // it is gone, its slot is named).
  std::vector<TierBlock> CapacityEntriesOf(uint32_t node, bool with_evicting = false);
  // The READY capacity entries among `keys`, lock-free (a hint), in key order.
  std::vector<TierBlock> FindCapacity(std::span<const BlockKey> keys);
  // A move of one READY block to another tier.
  struct TierMove {
    TierBlock from;            // as read: slot, gen, tier and location must still hold
    uint16_t to_tier = 0;
    uint64_t to_location = 0;
    bool set_checksum = false; // into the region: the entry's checksum becomes `checksum`
    uint64_t checksum = 0;
    bool moved = false;        // out
  };
  // Makes each entry name its new place, under its stripe lock (one lock per stripe touched):
  // still READY at `from.gen` with `from`'s tier and location, and unpinned → EVICTING, the new
  // place written and flushed, READY at gen + 1; a region payload left behind is freed. A move
  // not made (changed, pinned, lock not granted) stays `moved = false`: the caller undoes its side
  // (frees the device slot it wrote, or the region copy it made). Fenced by the stripe lock.
  // REQUIRES: the payload at the new place is complete (written and flushed or on the device).
  void MoveMany(std::span<TierMove> moves);
  // A capacity block to name in the index again (a warm restart into a re-created region: the
  // device still holds it, no entry names it). Inserted READY at `gen` — the generation its slot
  // was sealed with — owned by this process, only where the key is absent, its stripe has a free
  // slot and that slot's generation is below `gen`. Fenced by the stripe lock.
  struct CapacityInsert {
    uint32_t ns = 0;           // namespace slot in this pool
    BlockKey key;
    uint16_t tier = 0;         // a capacity EntryTier
    uint64_t location = 0;     // TierLocation
    uint32_t bytes = 0;
    uint64_t gen = 0;
    // out: named; or not, because the key is present or its stripe full (kTaken: the device's
    // copy is not needed), or the stripe lock was not granted or its lease lapsed (kLocked: try
    // again later).
    enum class Outcome : uint8_t { kLocked, kTaken, kInserted };
    Outcome outcome = Outcome::kLocked;
  };
  void InsertCapacity(std::span<CapacityInsert> inserts);
  // Tombstones capacity entries still READY at their generation and location (the owner freed
  // or lost their slots). Returns how many; `dropped` (when given) says which: only their slots
  // are surely named by nothing now.
  uint64_t DropCapacity(std::span<const TierBlock> blocks, std::vector<bool>* dropped = nullptr);
  // Region space for a block being promoted, evicting at the watermarks as a reserve does.
  Result<uint64_t> AllocateRegionPayload(uint64_t bytes);
  void FreeRegionPayload(uint64_t offset) { FreePayloadNow(offset); }
  // The writer word this process puts on what it writes (a capacity entry's owner).
  uint64_t WriterOfThisProcess() const { return MyWriterWord(); }
  // The budget the watermarks are fractions of.
  uint64_t capacity_bytes() const { return capacity_; }
  // One counter summed over every node's row (each row invalidated first: P2).
  uint64_t SumCounter(Counter c);

  // Test hook: the process kills itself (SIGKILL) at this point of the protocol, to prove the
  // recovery paths. Never set outside tests.
  // kMovePauseAfterMark stops the process (SIGSTOP) once instead, for pause-past-the-lease tests.
  // kInsertPauseBeforeFence stops (SIGSTOP) once inside InsertCapacity, right before its fence.
  enum class CrashPoint { kNone, kReserveHoldingLock, kEvictAfterMark, kMoveAfterMark, kMoveAfterFields,
                          kMovePauseAfterMark, kInsertAfterFields, kInsertPauseBeforeFence };
  void TestCrashAt(CrashPoint p) { crash_at_.store(p); }
  // Stripe-lock acquisitions by this process (tests count lock round trips per batch).
  uint64_t stripe_locks_taken() const { return stripe_locks_taken_.load(std::memory_order_relaxed); }
  // Test hook: Lookup forgets to flush its pins (the protocol bug the simulator must catch).
  void TestSkipPinFlush(bool skip) { test_skip_pin_flush_.store(skip); }

 private:
  struct Probe {
    int64_t found = -1;       // slot holding the key (any live state), or -1
    int64_t free_slot = -1;   // first EMPTY or TOMBSTONE on the probe path, or -1
    Entry entry{};            // the found entry
  };
  uint64_t StripeOf(const BlockKey& k) const { return k.lo % layout_.h.stripes; }
  uint64_t SlotAt(uint64_t stripe, uint64_t i) const { return stripe * layout_.h.slots_per_stripe + i; }
  Entry ReadEntry(uint64_t slot);
  // Probes the key's stripe. Without the lock the answer is a hint.
  Probe Find(const BlockKey& key);
  // Every key's entry at once, without a lock: home slots invalidated in one batch, a key not
  // at home probed slot by slot. A hint (found = -1: absent).
  std::vector<Probe> FindMany(std::span<const BlockKey> keys);
  // Validates a block size for `ns` (Reserve's argument checks).
  Status CheckBlockBytes(const NamespaceHandle& ns, uint64_t bytes);
  // The outcome Reserve reports for a key found present (READY, WRITING, EVICTING).
  void PresentOutcome(const NamespaceHandle& ns, const Entry& e, KeyReservation& out);
  // REQUIRES: the stripe lock of `key` held. Claims a slot for `key` (WRITING, not flushed:
  // the caller flushes `*written`), reclaiming a dead writer's entry or evicting the stripe's
  // LRU entry when it is full. Sets `out`; true iff reserved (the payload is then used).
  bool ClaimLocked(const NamespaceHandle& ns, const BlockKey& key, uint64_t payload, uint64_t bytes,
                   KeyReservation& out, uint64_t* written);

  // Stripe lock helpers. On taking a lock whose holder died, repairs the stripe first.
  Status LockStripe(uint32_t stripe);
  void UnlockStripe(uint32_t stripe, std::span<const sync::Range> written = {});
  // The writers whose WRITING entries a repair drops: a node's life (any process), or one
  // process of it.
  struct DeadWriter {
    uint32_t node;
    uint64_t inc;
    int64_t process_slot = -1;  // -1: every process of that life
    bool Matches(uint64_t writer) const {
      return WriterNode(writer) == node && WriterInc(writer) == WriterInc(inc) &&
             (process_slot < 0 || WriterSlot(writer) == static_cast<uint32_t>(process_slot));
    }
  };
  // REQUIRES: stripe lock held. EVICTING leftovers become TOMBSTONE (their payload is reclaimed
  // only if nothing reaches it: see evict.cc); WRITING entries of `dead` (when given) too, their
  // payloads appended to `dead_payloads` when given (else the allocator's recovery frees them).
  // Returns the count.
  uint64_t RepairStripeLocked(uint32_t stripe, const DeadWriter* dead, std::vector<uint64_t>* dead_payloads = nullptr);
  uint64_t MyWriterWord() const {
    return central_writer() ? actor_writer_ : WriterWord(node_.id(), node_.incarnation(), node_.process_slot());
  }
  // The pin table this operation writes: this node's, or the client's a central writer
  // acts for (the service is then every row's one writer).
  uint32_t PinRow() const { return central_writer() ? actor_node_ : node_.id(); }
  // REQUIRES: stripe lock held. Publishes TOMBSTONE (and turns a tombstone run that ends at an
  // EMPTY slot back to EMPTY so probe sequences stay short).
  void TombstoneLocked(uint64_t slot, uint64_t gen);
  // REQUIRES: stripe lock held. Evicts `slot` if still READY at generation `gen` and unpinned
  // (TryEvictManyLocked of one); false when pinned or changed.
  bool TryEvictLocked(uint64_t slot, uint64_t gen);
  // REQUIRES: stripe lock held; `e` READY at `gen` was published EVICTING and no pin was seen
  // after that. Frees the payload and tombstones; returns the region bytes freed.
  uint64_t FinishEvictLocked(uint64_t slot, uint64_t gen, const Entry& e);
  // REQUIRES: the stripe lock of each. Evicts those still READY at their generation and
  // unpinned, reading the pin tables once for all. Returns the bytes freed; adds the count to
  // `*evicted` when given.
  uint64_t TryEvictManyLocked(std::span<const std::pair<uint64_t, uint64_t>> slot_gens, uint64_t* evicted = nullptr);
  // Every unpinned READY entry (of `only`'s namespace when given), stripe by stripe.
  Result<uint64_t> EvictReady(const NamespaceHandle* only);
  // READY entries (and EVICTING ones when `with_evicting`) that `want` accepts, with their last
  // access (the latest of the entry's stamp and every node's access stamp), least recently used
  // first; pinned ones left out when `skip_pinned`.
  std::vector<TierBlock> LruReady(const std::function<bool(const Entry&)>& want, bool skip_pinned = true,
                                  bool with_evicting = false);
  // REQUIRES: stripe lock held. One move of MoveMany.
  bool MoveLocked(const TierMove& m);
  // REQUIRES: stripe lock taken. True while this process surely still holds it (the lease fence).
  bool HoldsStripeFenced(uint32_t stripe);
  // Every entry / every access stamp of `node`'s row, read in batches (one invalidate + read each).
  template <typename Fn>
  void ScanEntries(Fn fn);  // fn(slot, const Entry&)
  template <typename Fn>
  void ScanStampRow(uint32_t node, Fn fn);  // fn(slot, stamp)

  // ---- pin tables (pins.cc; docs/protocol.md, "Pins") ----
  // Writes the fingerprints of `keys` into consecutive pin words of `owner` (a WriterWord) in
  // `row`, claiming pages as needed, and appends the lines to publish. Returns one word per
  // key pinned: fewer than keys.size() when the node's table is full.
  std::vector<uint64_t> WritePinWords(uint32_t row, uint64_t owner, std::span<const BlockKey> keys,
                                      std::vector<uint64_t>* lines);
  // Zeroes these words of `owner`'s pages and frees pages left empty; appends the lines.
  void ClearPinWords(uint32_t row, uint64_t owner, std::span<const uint64_t> words, std::vector<uint64_t>* lines);
  void ClearPinWordsLocked(uint32_t row, uint64_t owner, std::span<const uint64_t> words,
                           std::vector<uint64_t>* lines);
  // A central writer remembers which word holds each client's pin (the RPC carries the slot).
  void RememberPins(uint64_t owner, std::span<const BlockPin> pins);
  uint64_t FindPinWordLocked(uint32_t row, uint64_t owner, const BlockPin& pin);
  bool OwnPinWord(uint32_t row, uint64_t owner, uint64_t word);
  void ReleasePins(std::span<const BlockPin> pins);
  uint64_t ClaimPinPage(uint32_t row, uint64_t owner, std::vector<uint64_t>* lines);
  void FreePinPage(uint32_t row, uint64_t page, uint64_t owner, std::vector<uint64_t>* lines);
  void SetPinDirBit(uint32_t row, uint32_t page, bool set, std::vector<uint64_t>* lines);
  bool PinPageEmpty(uint64_t page);
  uint64_t PinPageOf(uint64_t word) const;
  void InvalidateOwnPinRow();
  // Every key fingerprint pinned now, sorted (an evictor reads this after publishing EVICTING).
  std::vector<uint64_t> PinnedFingerprints();
  static bool Pinned(const std::vector<uint64_t>& fingerprints, uint64_t key_lo, uint64_t key_hi);
  bool AnyPins(uint64_t key_lo, uint64_t key_hi) { return Pinned(PinnedFingerprints(), key_lo, key_hi); }
  // Frees `row`'s pages held by `dead`'s processes (every page when null), pins and all.
  void DropPinPages(uint32_t row, const DeadWriter* dead);
  // True when the life that wrote `writer` (a WriterWord) is live in this process's view.
  bool WriterLive(uint64_t writer);
  // Frees a payload no entry names any more (central mode: through the reachability-checked
  // reclaim when its owning service life ended).
  void FreePayload(uint64_t payload, uint64_t bytes);
  // Frees a payload an entry still names (EVICTING): the allocator's recovery keeps it, so a
  // plain free cannot race one.
  void FreePayloadNow(uint64_t payload);

  void Add(Counter c, uint64_t delta) { meta_.LocalFetchAdd(layout_.counter(node_.id(), c), delta); }
  Status CheckHandle(const NamespaceHandle& ns);
  Result<alloc::ObjectOffset> AllocatePayload(uint64_t bytes);

  Region& region_;
  region::MetaAccess& meta_;
  IndexLayout layout_;
  sync::Node& node_;
  alloc::Allocator& allocator_;
  const uint64_t capacity_;  // payload budget: the header's, or every data chunk of the pool
  std::atomic<CrashPoint> crash_at_{CrashPoint::kNone};
  std::atomic<bool> test_skip_pin_flush_{false};
  std::atomic<uint64_t> stripe_locks_taken_{0};
  std::atomic<bool> reserved_any_{false};  // this process made a reservation (close cleans up)
  struct VerifiedSeed {
    std::atomic<uint64_t> lo{0}, hi{0};
  };
  std::array<VerifiedSeed, kMaxNamespaces> verified_;  // handles CheckHandle has seen live
  // Central mode: the writer role (BecomeCentralWriter) and the client acted for (ActFor).
  std::atomic<bool> central_writer_{false};
  std::function<Status()> central_fence_;
  std::mutex central_mu_;  // the stripe locks of a central writer: one operation at a time
  // Central writer: the byte counters of every other node's row, summed by RefreshOtherRows.
  std::atomic<uint64_t> others_claimed_{0}, others_released_{0};
  void RefreshOtherRows();
  uint32_t actor_node_ = 0;
  uint64_t actor_writer_ = 0;
  // Per node, the life whose pins its row holds (kUnknownLife until a sweep or request says).
  static constexpr uint64_t kUnknownLife = ~0ull;
  std::vector<uint64_t> pinned_life_;
  void DropPinRow(uint32_t node) { DropPinPages(node, nullptr); }
  // Pin tables, this process's side: the page each owner fills next, and (central writer) the
  // words of each client's pins.
  struct OpenPinPage {
    uint64_t page = 0;
    uint32_t next = 1;
  };
  std::mutex pins_mu_;
  std::unordered_map<uint64_t, OpenPinPage> open_pin_pages_;                   // by owner
  std::map<std::pair<uint64_t, uint64_t>, std::vector<uint64_t>> held_pins_;  // (owner, slot)
  uint32_t pin_page_hint_ = 0;
  void MaybeCrash(CrashPoint p);
  // Frees about `bytes` of region space: spilled by the room maker when there is one and it
  // moves anything, else evicted (blocks of `only_bytes` each when it is not 0, this node's own
  // when `only_mine`). Returns the bytes freed.
  uint64_t MakeRoom(uint64_t bytes, uint64_t only_bytes = 0, bool only_mine = false);
  std::atomic<CapacityPromoter*> room_maker_{nullptr};
};

}  // namespace cxlkv::cache

#endif  // CXLKV_SRC_CACHE_INDEX_H_
