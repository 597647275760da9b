// The pool allocator: a global chunk allocator over one or more regions plus this node's heap
// (TraCT §3.5, Beluga §5.3 O9).
//
//   alloc::Allocator a(regions, node);
//   auto off = a.Alloc(20 << 10);        // a 20 KiB object: a slot of a 32 KiB-class heap slab
//   auto blk = a.Alloc(917504, Fit::kExact);  // a KV block: a slot of exactly its size
//   NtCopy(a.Ptr(*off, n), src, n);      // payload: non-temporal (rule P3)
//   a.Free(*off);                        // from any node
//
// Objects up to kMaxHeapObject come from per-node heaps: slabs of one size class (64 B ..
// 256 KiB, powers of two) whose header and slot bitmap are written only by the owner node; the
// node's current slab per class is kept in node-local DRAM (sync::LocalNode). Larger objects
// take a run of whole chunks. An exact-fit object (Fit::kExact: a namespace's KV block, whose
// size repeats) takes a slot of exactly its size rounded to 64 B, from a slab of one to
// kMaxSlabChunks chunks sized so its slots fill it (chunk_table.h, "Slabs"); a size the chunk
// divides, or one no slab would hold better than whole chunks, takes whole chunks instead. Single chunks are spread round-robin over the
// pool's regions (software interleaving across CXL devices); an offset names its region.
//
// Frees: the owner frees in place; another node pushes the offset into the owner's remote-free
// ring (one single-producer ring per pair of nodes), which the owner drains every heartbeat.
// Whole-chunk objects and orphaned heap chunks are freed under the allocator lock by anyone.
//
// Chunk leases: a node takes whole owner-word lines of free chunks (kLeaseLineChunks each,
// `AllocatorOptions::lease_chunks` per allocator-lock trip) and marks them kLeased with its
// node and life. A one-chunk object then comes from the lease with no global lock: under the
// node-local heap mutex the node rewrites its own owner word kLeased → kLeasedObject and
// flushes it. The lessee is the only writer of a leased line (P4/P5): frees of a leased object
// by other nodes go through the remote-free ring, like heap objects. A freed leased object
// goes back to the lease; a line wholly free again goes back to the global pool when the
// process still knows another free leased line.
//
// Node death: the lock manager's process calls Recover(node, incarnation). Everything the dead
// life owned that is not reachable from a published root (AddReachability) is freed; heap
// chunks that still hold published objects become orphans, freed object by object later.
//
// Thread-safety: all methods are thread-safe and may be called from any process of the node.
#ifndef CXLKV_SRC_ALLOC_ALLOCATOR_H_
#define CXLKV_SRC_ALLOC_ALLOCATOR_H_

#include <array>
#include <atomic>
#include <functional>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "alloc/chunk_table.h"
#include "region/offset.h"
#include "sync/node.h"

namespace cxlkv::alloc {

inline constexpr uint32_t kSizeClasses = 13;                  // 64 B .. 256 KiB
inline constexpr uint64_t kMaxHeapObject = uint64_t{64} << (kSizeClasses - 1);

using ObjectOffset = region::Offset<void>;

// How an allocation is sized. kRounded: a power-of-two heap class up to kMaxHeapObject, whole
// chunks above (for one-off objects: roots, digests, tables — their sizes never repeat enough
// to fill a slab of their own). kExact: a slot of exactly the size, rounded to 64 B, in a slab
// of that size (for objects whose size repeats: a namespace's blocks).
enum class Fit { kRounded, kExact };

struct AllocatorOptions {
  // Chunks a node leases per allocator-lock trip for one-chunk objects, rounded up to whole
  // owner-word lines (kLeaseLineChunks). Default 8; 0 turns leasing off (every whole-chunk
  // object takes the allocator lock).
  uint32_t lease_chunks = 8;
};

class Allocator {
 public:
  // `regions[0]` is the pool's first region (locks, rings). The node must outlive this.
  Allocator(std::vector<Region*> regions, sync::Node& node, AllocatorOptions options = {});

  // Errors: kInvalidArgument (0 bytes, larger than a region's data area), kNoSpace (pool full),
  // kTimeout (the allocator lock was not granted within 4 leases).
  Result<ObjectOffset> Alloc(uint64_t bytes, Fit fit = Fit::kRounded);
  // Errors: kInvalidArgument (not an allocated object: a double free or a foreign offset; the
  // pool is left untouched), kBusy (the owner's remote-free ring stayed full; retry).
  Status Free(ObjectOffset off) { return Free(off, 0); }
  // Payload pointer of `bytes` at `off`; nullptr when that range is not inside a data area of
  // this pool (checked in every build: offsets are read from the region).
  uint8_t* Ptr(ObjectOffset off, uint64_t bytes) const;
  // True when [off, off + bytes) lies inside one region's data area of this pool.
  bool Contains(ObjectOffset off, uint64_t bytes) const {
    if (off.region_index() >= tables_.size()) return false;
    const ChunkTableLayout& t = tables_[off.region_index()];
    const uint64_t begin = t.data_offset(), end = begin + t.chunks() * t.chunk_bytes();
    return off.byte_offset() >= begin && off.byte_offset() <= end && bytes <= end - off.byte_offset();
  }

  // `n` objects of `bytes` each (one lease refill at most for one-chunk objects). On error the
  // objects allocated so far are freed again.
  Result<std::vector<ObjectOffset>> AllocMany(uint64_t bytes, size_t n, Fit fit = Fit::kRounded);
  // The slot size an object of `bytes` takes with `fit`: 0 when it takes whole chunks.
  uint64_t SlotBytesFor(uint64_t bytes, Fit fit) const;

  void DrainRemoteFrees();
  // Drains remote frees and returns this node's empty heap chunks and wholly free leased lines
  // to the pool.
  void Trim();
  // Gives back the wholly free lines of the lease this process knows of (at a clean exit of a
  // process whose node lives on in other processes). Takes the allocator lock only when there
  // is a line to give back.
  void ReturnLease();
  // Ends this node's whole lease, of this life and of any ended one (at the clean exit of the
  // node's last process: a departed node holds no lease). Every line stops being leased: its
  // free chunks go back to the pool, its allocated chunks stay as ordinary one-chunk objects.
  // One allocator-lock trip when the node holds a line; none otherwise.
  void EndLease();
  // Test hook: runs after a remote free is decided (announced, its owner surely live) and
  // before it is published, so a test can end the owner's life in that window.
  void TestHookBeforePush(std::function<void()> hook) { test_before_push_ = std::move(hook); }
  // Test hook: runs in a heap allocation after it has chosen its slot and before the fence
  // and the stores that take it, so a test can pause the process there.
  void TestHookBeforeHeapStore(std::function<void()> hook) { test_before_heap_store_ = std::move(hook); }
  // Test hook: runs in an owner's free of a heap slot after it has found the slot's bit and
  // before the fence and the stores that clear it.
  void TestHookBeforeHeapFree(std::function<void()> hook) { test_before_heap_free_ = std::move(hook); }
  // Test hook: runs in Recover before it takes the allocator lock to consume the ended life's
  // rings, so a test can let the node's next life push and drain first.
  void TestHookBeforeRecoveryLock(std::function<void()> hook);
  // Test hooks of DrainRemoteFrees: `before` runs before a drain takes the node's drain lock
  // (a test holds a process's drains back with it); `after_claim` after a ring's entries are
  // claimed and its head is published, before any is applied (a test kills the drainer there);
  // `before_fence` once a non-empty ring's head and tail are read, before the drainer is fenced
  // and claims them (a test pauses the drainer there). Any may be empty. Safe to set while the
  // process's drains run.
  void TestHookDrain(std::function<void()> before, std::function<void()> after_claim,
                     std::function<void()> before_fence = {});
  // Allocator-lock acquisitions by this process (tests count lock round trips).
  uint64_t lock_acquisitions() const { return lock_acquisitions_.load(std::memory_order_relaxed); }
  // Reachability for recovery: a provider appends the raw offsets of every published object.
  void AddReachability(std::function<void(std::vector<uint64_t>&)> provider);
  // Reclaims what `node`'s life `incarnation` held (see above). Idempotent.
  void Recover(uint32_t node, uint64_t incarnation);
  // For a free that may or may not have happened (an eviction cut short by its evictor's
  // death): frees `off` when an ended life still holds it and nothing reaches it — no
  // published root, no index entry, no remote free on its way. True when it freed.
  Result<bool> ReclaimIfUnreachable(ObjectOffset off);
  // True when the object at `off` is held by a life that ended (an orphan heap chunk, or a
  // chunk whose owner's life is over): its recovery, not a Free, decides what happens to it.
  bool HeldByEndedLife(ObjectOffset off);

  static uint64_t ClassBytes(uint32_t c) { return uint64_t{64} << c; }
  // The smallest rounded heap class that holds `bytes` (<= kMaxHeapObject).
  static uint32_t ClassFor(uint64_t bytes) {
    uint32_t c = 0;
    while (ClassBytes(c) < bytes) ++c;
    return c;
  }
  // The longest slab this pool makes: a slab is at most a quarter of the smallest region.
  uint32_t max_slab_chunks() const { return max_slab_chunks_; }
  uint64_t chunk_bytes() const { return tables_[0].chunk_bytes(); }
  size_t region_count() const { return regions_.size(); }
  // Bytes of all data areas (every chunk of every region).
  uint64_t data_bytes() const {
    uint64_t n = 0;
    for (const auto& t : tables_) n += t.chunks() * t.chunk_bytes();
    return n;
  }

 private:
  struct ChunkRef {
    uint32_t region;
    uint64_t chunk;
  };
  uint64_t ChunkBase(ChunkRef c) const { return tables_[c.region].data_offset() + c.chunk * chunk_bytes(); }
  ObjectOffset OffsetOf(ChunkRef c, uint64_t within) const {
    return ObjectOffset::Make(c.region, ChunkBase(c) + within);
  }
  region::MetaAccess& meta(uint32_t r) const { return regions_[r]->impl().meta(); }
  // The chunk `off` lies in and its offset there; inside a slab's tail chunk, its head and the
  // offset from the slab's start. `*word`: that chunk's owner word, as read here (P2: fetched).
  bool Locate(ObjectOffset off, ChunkRef* c, uint64_t* within, OwnerWord* word) const;
  // SlotBytesFor's plan for an exact-fit size (SlabChunksFor over every slab length).
  uint64_t ExactSlotBytes(uint64_t bytes) const;

  // Allocator-lock helpers. REQUIRES for *Locked: the allocator lock is held.
  Status LockAllocator();
  void UnlockAllocator(std::span<const sync::Range> written = {});
  Status RedoIntentLocked();
  void CommitLocked(uint32_t region, IntentOp op, uint64_t first, uint64_t count, uint64_t owner);
  Result<ChunkRef> TakeRunLocked(uint64_t count, OwnerWord head);
  bool FindRunLocked(uint32_t r, uint64_t count, uint64_t* first);

  void ReturnFreeLeaseLinesLocked();
  // Ends the lease of line `first` of region `r` held by `life` (its kLeased word): one intent
  // (IntentOp::kEndLease). REQUIRES: the allocator lock.
  void EndLeaseLineLocked(uint32_t r, uint64_t first, uint64_t life);
  // Lines of this node's ended lives that are still leased: a wholly free one is adopted into
  // this life's lease (`adopt`), any other has its lease ended. `adopt` false: every such line,
  // and this life's own too, has its lease ended. Returns the lines adopted. REQUIRES: heap_mu
  // and the allocator lock.
  uint64_t SettleNodeLeasesLocked(bool adopt);
  // Lease helpers. REQUIRES: heap_mu held.
  // True with a chunk of the lease, false when the lease has none free; kLeaseExpired when this
  // node's lease lapsed (FenceOwnStore).
  Result<bool> TakeFromLeaseLocked(ChunkRef* out);
  // Leases `lines` more owner-word lines under the allocator lock (the first call of a
  // process adopts the node's existing lease instead, when it has one).
  Status RefillLeaseLocked(uint64_t lines);
  void ScanLeaseLocked();
  // Returns `line` to the global pool if every chunk of it is free in the lease.
  bool ReturnLineIfFreeLocked(ChunkRef line, uint64_t free_word);
  Status FreeLeasedLocked(ChunkRef chunk, OwnerWord w);
  // One free taken off this node's remote-free ring (DrainRemoteFrees).
  void ApplyRemoteFree(ObjectOffset off);
  // Applies what the node's drain claim still holds (entries a drainer took out of a ring and
  // died before applying), when the claim is this life's and its ring's head is where it was
  // published; otherwise drops it. REQUIRES: the node's drain_mu.
  void FinishDrainClaim();
  // Applies the claim's entries from `next` on, each marked started before it is applied.
  // REQUIRES: the node's drain_mu.
  void ApplyDrainClaim();
  void NoteLeaseLine(uint32_t region, uint64_t line);
  bool LeaseAllowed() const { return lease_lines_ > 0 && leasable_; }
  uint64_t LeaseWord() const;

  // Heap helpers. REQUIRES: heap_mu held. A class is named by its slot bytes.
  Result<ObjectOffset> AllocSlotLocked(uint64_t slot_bytes);
  // This node's entry for slots of `slot_bytes` (taken over from another size when all are used).
  sync::LocalHeapClass& ClassEntryLocked(uint64_t slot_bytes);
  // The entry remembering the slab `id` (chunk id + 1) as current, or nullptr.
  sync::LocalHeapClass* CurrentEntryFor(uint64_t slot_bytes, uint64_t id);
  // A slot in `chunk`, this node's slab of life `life20`; false when it has none free or when
  // fenced (then `*fenced` says why).
  bool TrySlotIn(ChunkRef chunk, sync::LocalHeapClass& cls, uint64_t slot_bytes, uint32_t life20,
                 ObjectOffset* out, Status* fenced);
  bool FindPartialChunk(uint64_t slot_bytes, ChunkRef* out);
  // A fresh slab for slots of `slot_bytes` owned as `word`: the planned length, or the longest
  // shorter one that still holds a slot when no run that long is free. REQUIRES: the allocator lock.
  Result<ChunkRef> TakeSlabLocked(uint64_t slot_bytes, OwnerWord word, uint64_t* chunks);
  // Frees the slab headed by `head` (owner word `w`): its run as the owner words give it.
  // REQUIRES: the allocator lock.
  void FreeSlabLocked(ChunkRef head);
  // `life20`: the owner life of a chunk this node owns (not orphan), for FenceOwnStore.
  Status FreeSlot(ChunkRef chunk, uint64_t within, bool orphan, uint32_t life20 = 0);
  // Before a store into this node's own heap chunks or leased owner words: ok only while this
  // node's lease holds and it still runs as `life20`, the life those words were read under. A
  // process paused past its lease may find them recovered and handed to another node meanwhile;
  // its late stores would corrupt that node's chunk.
  Status FenceOwnStore(const char* act, uint32_t life20) const;
  Status Free(ObjectOffset off, int reroutes);
  // Pushes `off` into the ring of the life `owner` names while that life surely beats: true
  // once pushed; false once the life is over (the caller frees in place under the lock);
  // kBusy when it stays neither for two leases.
  Result<bool> PushWhileOwnerLives(OwnerWord owner, ObjectOffset off);
  // One attempt: false (nothing pushed) when the owner's life is not surely live, or its
  // recovery has closed the ring.
  Result<bool> PushRemoteFree(OwnerWord owner, ObjectOffset off);
  // True when the recovery of the owner life has begun: its ring from this node is closed
  // (kInboxClosedOffset), so a free of its object is applied in place, not pushed.
  bool RingClosed(OwnerWord owner);
  // REQUIRES: the allocator lock; `w` is the chunk's kLeasedObject word of an ended life.
  void FreeEndedLifeLeasedLocked(ChunkRef chunk, OwnerWord w);

  // Recovery helpers (recovery.cc).
  // Waits (bounded) until no node is between deciding to push into `dead`'s ring for life
  // `inc` and publishing that push.
  void WaitForPushesInFlight(uint32_t dead, uint32_t inc);
  // Waits (bounded) while a drainer of another life of `dead` is announced (chunk_table.h,
  // kInboxDrainingOffset). REQUIRES: the rings closed for `inc` (WaitForPushesInFlight).
  void WaitForDrainerOfAnotherLife(uint32_t dead, uint32_t inc);
  // Offsets in every ring not consumed yet: their frees are on their way.
  std::unordered_set<uint64_t> PendingRemoteFreesLocked();

  std::vector<Region*> regions_;
  std::vector<ChunkTableLayout> tables_;
  sync::Node& node_;
  uint32_t max_nodes_;
  std::atomic<uint32_t> next_region_{0};
  uint64_t lease_lines_ = 1;  // owner-word lines per lease refill
  uint32_t max_slab_chunks_ = 1;
  // SlotBytesFor's answers for exact sizes: (bytes << 32) | (slot / 64) << 1 | 1, by bytes / 64.
  mutable std::array<std::atomic<uint64_t>, 8> fit_memo_{};
  bool leasable_ = true;      // owner words are line-aligned in every region
  bool lease_scanned_ = false;  // guarded by heap_mu
  // Lines of this node's lease that this process knows of (region, first chunk): a hint,
  // verified against the owner words under heap_mu. Guarded by the node's heap_mu.
  std::vector<ChunkRef> lease_hint_;
  std::atomic<uint64_t> lock_acquisitions_{0};
  std::function<void()> test_before_push_;
  std::function<void()> test_before_heap_store_;
  std::function<void()> test_before_heap_free_;
  std::function<void()> test_before_recovery_lock_;  // guarded by test_hooks_mu_
  std::mutex test_hooks_mu_;  // guards the drain and recovery hooks (set by a test thread, run by others)
  std::atomic<bool> test_hooked_{false};  // any of the guarded hooks is set
  std::function<void()> test_before_drain_, test_after_drain_claim_, test_before_drain_fence_;
  std::mutex providers_mu_;
  std::vector<std::function<void(std::vector<uint64_t>&)>> providers_;
};

}  // namespace cxlkv::alloc

#endif  // CXLKV_SRC_ALLOC_ALLOCATOR_H_
