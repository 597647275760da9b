// The capacity tiers of one node (Unified KV pooling §IV): its node-DRAM and SSD
// devices behind the shared region, run by the node's cxlkvd. The prefix index is the one
// lookup table over every device (Table I): an entry names the region, or a tier, device and
// slot of this node (docs/tiers.md, "Global lookup table").
//
//   spill    the region's least recently used unpinned blocks, when its use passes
//            `spill_start_pct` of the cache budget, are written to the devices (split by
//            Algorithm 1 in proportion to bandwidth; one worker per device, in parallel) and
//            their entries moved there (Index::MoveMany); the region space is freed. Spilling
//            runs ahead of need, so a writer's reserve rarely has to drop a block.
//   promote  a lookup that meets a block on a capacity tier asks the owning node's service
//            (tier-<node>, over the shared-memory RPC) to bring it in: the owner reads the slot
//            straight into fresh region space, validating key, namespace and generation (a
//            corrupt, torn or reused slot is a counted miss, its entry dropped), and moves the
//            entry back; the reader then pins it like any block.
//   full     a device without free slots drops its own least recently used blocks first.
//   adopt    at open, SSD blocks this node's earlier cxlkvd left in the index are taken over
//            (their slots marked used); DRAM blocks of an earlier process are dropped (their
//            bytes died with it); SSD blocks the catalog holds and no entry names — a region
//            lost or re-created — are named again (tier_restore.cc). Reconcile() repeats this
//            and frees slots no entry names.
//
// Thread-safety: all methods are thread-safe; moves are serialized by one mutex, so spill,
// promote and reconcile never see each other's slots half-owned.
#ifndef CXLKV_SRC_TIER_TIER_STORE_H_
#define CXLKV_SRC_TIER_TIER_STORE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/index.h"
#include "cxlkv/pool.h"
#include "tier/catalog.h"
#include "tier/device.h"
#include "tier/namespace_book.h"
#include "tier/placement.h"

namespace cxlkv::tier {

// One device of the node, as given on the command line: "dram:SIZE", "dram:SIZE:numa=N",
// "ssd:PATH:SIZE[:catalog=DIR]" (SIZE: 64G, 512M, ...; 0 reopens an existing SSD file at its
// size, or takes all of a device). An SSD tier keeps its restart catalog and namespace book in
// files beside PATH; a device (a block device or an NVMe generic device under /dev) has no
// "beside" that survives a reboot, so it names a directory for them with catalog=DIR.
struct TierSpec {
  TierKind kind = TierKind::kMem;
  std::string path;         // ssd only
  uint64_t bytes = 0;
  int numa_node = -1;       // dram only
  std::string catalog_dir;  // ssd only: where the catalog and book live ("" = beside path)

  // The base name of the SSD tier's state files (catalog.h, namespace_book.h): PATH, or
  // DIR/<PATH's last component> with catalog=DIR.
  std::string StateBase() const;
};
Result<TierSpec> ParseTierSpec(std::string_view text);

// The state files an SSD tier keeps — its catalog (checkpoint copies and log) and its namespace
// book — at `state_base` (TierSpec::StateBase). Not the device or file itself.
inline std::vector<std::string> SsdStateFiles(const std::string& state_base) {
  return {Catalog::CheckpointPath(state_base, 0), Catalog::CheckpointPath(state_base, 1), Catalog::LogPath(state_base),
          NamespaceBook::PathOf(state_base)};
}

// The index's tier of a device kind (cache::EntryTier).
inline uint16_t EntryTierOf(TierKind kind) { return kind == TierKind::kMem ? cache::kTierMem : cache::kTierSsd; }

struct TierStoreOptions {
  std::vector<TierSpec> tiers;            // required: at least one
  uint64_t slot_bytes = (2u << 20) + 4096;  // per device slot, header included: blocks up to
                                            // 2 MiB by default (larger ones are not spilled)
  uint32_t spill_start_pct = 80;          // of the cache budget: spill when the region's use passes it
  uint32_t spill_target_pct = 70;         // ... down to this
  size_t spill_batch = 64;                // blocks per spill round (one placement, one move batch)
  bool background = true;                 // run the spill thread (tests drive Spill themselves)
  std::chrono::milliseconds spill_poll{10};       // how often the spill thread looks at the region's use
  std::chrono::milliseconds reconcile_every{2000};
  // Bind each device's worker where its disk's completions land, memory workers elsewhere
  // (worker_affinity.h); only where the disk's interrupts are confined to some of our CPUs.
  bool bind_workers = true;
  // Say on stderr where the workers were bound (a daemon's log); the placement is in the
  // status document either way. Off where stderr is a terminal's progress display (`serve`).
  bool log_placement = true;
};

// What a promote request did.
struct PromoteResult {
  uint64_t promoted = 0;
  uint64_t missed = 0;     // slot invalid (entry dropped), device error, region full
  uint64_t not_mine = 0;   // not on this node's devices (moved or owned elsewhere)
};

class TierStore {
 public:
  // True on a thread inside a move of some TierStore (spill, promote): a reserve made there must
  // not ask the tiers' service to make room (the store is busy with this very thread);
  // MakeRoomInsideMove spills on that store directly. Returns the region bytes freed.
  static bool InsideMove();
  static uint64_t MakeRoomInsideMove(uint64_t bytes);
  // Opens every device (an unusable path fails with what to do), probes bandwidths, adopts
  // what the index names on this node, and starts the spill thread. The pool must have a
  // decentralized prefix index.
  static Result<std::unique_ptr<TierStore>> Open(Pool& pool, const TierStoreOptions& options);
  ~TierStore();
  TierStore(const TierStore&) = delete;
  TierStore& operator=(const TierStore&) = delete;

  // Spills up to `bytes` of the region's least recently used unpinned blocks. Returns the
  // blocks moved.
  Result<uint64_t> Spill(uint64_t bytes);
  // Spills while the region's use is above spill_start_pct, down to spill_target_pct.
  Result<uint64_t> SpillToWatermark();
  // Brings these keys' blocks on this node's devices into the region.
  PromoteResult Promote(std::span<const BlockKey> keys);
  // The streaming source: reads these keys' blocks on this node's devices into region space the
  // caller allocated (`staging[i]`, an allocated object of at least `capacity` bytes each —
  // checked, the offsets are untrusted), validated as a promote's reads are, without moving
  // them: the blocks stay where they are. Per key, the payload bytes read; 0 for a miss (not on
  // this node's devices, larger than `capacity`, an invalid slot — whose entry is dropped).
  std::vector<uint32_t> ReadOut(std::span<const BlockKey> keys, std::span<const uint64_t> staging, uint64_t capacity);
  // Takes over this node's capacity entries, drops the ones whose bytes are gone, frees slots
  // no entry names. Returns the entries dropped.
  uint64_t Reconcile();

  const std::vector<std::unique_ptr<Device>>& devices() const { return devices_; }
  // Payload bytes the region's entries hold now (every node's counters).
  uint64_t RegionUsedBytes() { return index_.UsedBytes(); }
  // Per device: kind, Describe(), slots used/free, bandwidth, counters; and the store's own.
  nlohmann::json Stats() const;

 private:
  TierStore(Pool& pool, cache::Index& index, const TierStoreOptions& options);
  // REQUIRES: move_mu_ held.
  Result<uint64_t> SpillLocked(uint64_t bytes);
  uint64_t ReconcileLocked(bool adopt);
  // Measures the devices' bandwidths (only those not measured yet, with a free slot, when
  // `only_unknown`) and resets placement when any changed.
  void ProbeLocked(bool only_unknown);
  // The SSD catalogs (catalog.h): puts once a slot's write completed, before the index names it
  // (an error: the blocks are not moved); frees before a slot can be reused.
  Status RecordPuts(uint32_t device, std::span<const CatalogEntry> entries);
  void RecordFrees(uint32_t device, std::span<const uint64_t> slots);
  // ---- tier_restore.cc: namespaces by fingerprint, and naming blocks again ----
  // The fingerprint a device slot carries for the pool's namespace `ns` (namespace_book.h).
  // False for a slot that is not a valid registered namespace. REQUIRES: move_mu_ held.
  bool FingerprintLocked(uint32_t ns, uint64_t* fingerprint);
  // Makes device `device`'s namespace book name the namespaces of these blocks before the
  // catalog does. REQUIRES: move_mu_ held.
  Status RecordNamespacesLocked(uint32_t device, std::span<const CatalogEntry> entries);
  // Names again in the index the catalog's blocks no entry names (marking their slots in
  // `named`); returns the slots of those that cannot be (to be freed). Those it could not decide
  // are marked too, and wait in awaiting_restore_. REQUIRES: move_mu_ held.
  std::vector<uint64_t> RestoreLocked(uint32_t device, std::span<const CatalogEntry> unnamed, SlotExtents& named);
  // Drops from the book the namespaces no block of the device's catalog uses any more.
  void RetainNamespacesLocked(uint32_t device);
  // Records the frees, then returns the slots to the device.
  void FreeSlots(uint32_t device, std::span<const uint64_t> slots);
  // The runs with each device's share beyond its free slots moved to devices that have some.
  std::vector<PlacementRun> SpreadOverflow(std::vector<PlacementRun> runs, uint64_t mean_slot_bytes) const;
  // Blocks whose slots read back invalid (empty, corrupt, torn, reused): their entries are
  // dropped, and the slots of those this drop removed freed. REQUIRES: move_mu_ held.
  void DropInvalidLocked(std::span<const cache::Index::TierBlock> invalid);
  // Slots for `n` blocks on `device`, dropping its least recently used blocks if it is full.
  Result<std::vector<uint64_t>> TakeSlots(Device& device, std::span<const uint64_t> payload_bytes);
  // Runs jobs[i] on device i's worker, all at once; returns when all are done.
  void RunOnDevices(std::vector<std::function<void()>>& jobs);
  void WorkerLoop(size_t device);
  void SpillLoop();
  bool Mine(const cache::Index::TierBlock& b) const;
  // Stats() as the pool's status document "tier-<node>", for `cxlkv stat` (pool/status_doc.h).
  void PublishStatus();
  // The region use at which the watermarks apply: the cache budget, or lower where evictions
  // showed the region fills before it.
  uint64_t EffectiveCapacity();

  Pool& pool_;
  cache::Index& index_;
  const TierStoreOptions options_;
  const uint32_t node_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<std::unique_ptr<Catalog>> catalogs_;  // per device; null for node DRAM
  std::vector<std::unique_ptr<NamespaceBook>> books_;  // per device; null for node DRAM
  std::map<uint32_t, uint64_t> fingerprints_;  // guarded by move_mu_: namespace slot → fingerprint
  // guarded by move_mu_, per device: slots a restore left undecided (kept used, retried by Reconcile)
  std::vector<std::set<uint64_t>> awaiting_restore_;

  std::mutex move_mu_;  // one move batch at a time (spill, promote, reconcile)
  std::unique_ptr<PlacementCursor> placement_;  // guarded by move_mu_
  std::set<uint64_t> promoting_;  // guarded by move_mu_: locations a promote is reading (not victims)

  // One I/O worker per device: jobs_[i] runs on worker i.
  struct Worker {
    std::thread thread;
    std::vector<int> cpus;      // bound to these (worker_affinity.h); empty: unbound
    std::function<void()> job;  // guarded by work_mu_
  };
  std::vector<Worker> workers_;
  std::string worker_placement_;  // set at Open
  std::mutex work_mu_;
  std::condition_variable work_cv_, done_cv_;
  size_t pending_ = 0;  // guarded by work_mu_
  bool stop_ = false;   // guarded by work_mu_ (and the spill thread's wait)

  std::mutex cap_mu_;
  uint64_t effective_cap_ = 0;       // guarded by cap_mu_
  uint64_t seen_evictions_ = ~0ull;  // guarded by cap_mu_: the evictions counter last read

  std::thread spill_thread_;
  std::condition_variable spill_cv_;

  // The store's counters.
  std::atomic<uint64_t> read_out_{0}, read_out_missed_{0};
  std::atomic<uint64_t> spilled_{0}, spill_failed_{0}, promoted_{0}, promote_missed_{0}, dropped_full_{0},
      dropped_lost_{0}, freed_orphans_{0}, adopted_{0}, unproven_{0}, restored_{0}, restore_skipped_{0};
};

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_TIER_STORE_H_
