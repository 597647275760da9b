// The restart record of one SSD capacity device: which slot holds which block,
// kept so that the device's contents survive a clean restart and a kill -9 of the daemon. A
// metadata checkpoint plus an append-only log with sequence numbers, replayed at Open; whatever
// cannot be proven current is dropped (docs/tiers.md, "Restart catalog").
//
// Contract. The caller appends kPut for a slot only after that slot's data write completed (the
// device's Write returned OK), and kFree when it lets a slot go. Append is a group commit: one
// write and one fdatasync per call; the records are durable when it returns OK. On any error
// (kNoSpace for a full file system) the in-memory map is unchanged and the caller must not index
// those blocks. Open replays checkpoint then log and ends with a Checkpoint, so the log on disk
// always follows a checkpoint this catalog wrote. The catalog is a hint, never the proof: a slot
// it names is still read through CheckSlot, whose key/namespace/generation check is the last word
// (a record lost to a bit flip can leave an entry whose slot now holds another block: that read
// is a stale miss, not wrong data).
//
// Thread-safety: every method is safe from any thread (one mutex); Append and Checkpoint
// serialize. One process opens a given base path at a time (the daemon's node lock ensures it).
//
// On-disk format (little-endian). Given the SSD tier's path P:
//   P.catalog, P.catalog.1  two checkpoint copies, written alternately; each is a 64-byte header
//                           {magic "CXKVCAT1", version, header/record bytes, sequence, entry
//                           count, slot count, CRC-32C of the entries, CRC-32C of the header}
//                           followed by one 64-byte kPut record per live slot, in slot order.
//                           A copy is used only when both CRCs hold; the newest valid one wins.
//   P.log                   a kBase record naming the checkpoint sequence the log follows, then
//                           kPut/kFree records with strictly increasing sequence numbers.
// A slot is the device's first granule of the block's extent (slot_allocator.h); the block's
// bytes give the extent's length, so a record names its whole slot. Format version 2.
// A record (64 bytes): magic u16 | op u8 | version u8 | tier kind u16 | flags u16 | sequence u64 |
// slot u64 | key lo u64 | key hi u64 | namespace u64 | generation u64 | bytes u32 | CRC-32C u32
// over bytes [0, 60).
#ifndef CXLKV_SRC_TIER_CATALOG_H_
#define CXLKV_SRC_TIER_CATALOG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"
#include "tier/io_platform.h"

namespace cxlkv::tier {

inline constexpr uint32_t kCatalogRecordBytes = 64;

// What one slot of the device holds.
struct CatalogEntry {
  uint64_t slot = 0;
  BlockKey key;
  uint64_t ns = 0;
  uint64_t generation = 0;
  uint32_t bytes = 0;        // payload bytes of the block
  uint16_t tier_kind = 2;    // TierKind (2: ssd)
  uint16_t flags = 0;        // the owner's; stored, not interpreted
  friend bool operator==(const CatalogEntry&, const CatalogEntry&) = default;
};

enum class CatalogOp : uint8_t {
  kPut = 2,    // entry.slot now holds entry (append only after the slot's data write completed)
  kFree = 3,   // entry.slot holds nothing any more (only entry.slot is read)
};

struct CatalogRecord {
  CatalogOp op = CatalogOp::kPut;
  CatalogEntry entry;
};

struct CatalogOptions {
  // The log is folded into a new checkpoint when an Append leaves it at least this long.
  // Default 64 MiB (one million records). 0: never automatically.
  uint64_t log_limit_bytes = uint64_t{64} << 20;
};

// What Open found. Records "covered" by the checkpoint are neither applied nor dropped.
struct ReplayStats {
  uint64_t checkpoint_entries = 0;   // live entries taken from the checkpoint
  uint64_t checkpoint_sequence = 0;  // the sequence of the checkpoint used (0: none)
  uint64_t log_records = 0;          // log records applied
  uint64_t covered_records = 0;      // log records already in the checkpoint (skipped)
  uint64_t dropped_records = 0;      // bad CRC/magic, torn tail, slot out of range, sequence not
                                     // increasing, or the whole log when it could not be linked
  uint64_t checkpoint_copies_dropped = 0;  // copies present but invalid (torn, bit flip)
  bool started_empty = false;        // state dropped: nothing could be proven current
  double replay_seconds = 0;         // reading and applying both files (not the Open checkpoint)
  std::string message;               // what was dropped and why; empty when nothing was
};

class Catalog {
 public:
  // Replays P.catalog/P.catalog.1 and P.log (missing files: an empty map, the first start), then
  // writes a checkpoint. `slot_count` is the device's granule count: records naming a slot >= it
  // are dropped.
  // Errors: a path that cannot be created or written (kNotFound, kPermissionDenied, kIoError,
  // kNoSpace), each naming the file and what to do.
  static Result<std::unique_ptr<Catalog>> Open(IoPlatform& io, const std::string& base_path,
                                               uint64_t slot_count, const CatalogOptions& options = {});
  // Replays as Open does and reports what it found, writing nothing (for `cxlkv check` and the
  // replay cost).
  static Result<ReplayStats> Inspect(IoPlatform& io, const std::string& base_path, uint64_t slot_count);
  ~Catalog();
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  // Appends the records in order (sequence numbers assigned here), one write + one fdatasync.
  // kInvalidArgument (nothing written) for a slot >= slot_count; kNoSpace when the file system is
  // full; other I/O errors as kIoError. On error the map is unchanged. May run an automatic
  // Checkpoint afterwards; its failure does not fail the Append (see last_checkpoint_status()).
  Status Append(std::span<const CatalogRecord> records);

  // Writes the live map to the older checkpoint copy durably, then restarts the log after it.
  // A crash at any point replays to the same map.
  Status Checkpoint();

  // The live entries in slot order.
  std::vector<CatalogEntry> Live() const;
  // The entry of `slot`, if one is live.
  bool Find(uint64_t slot, CatalogEntry* out) const;
  uint64_t live_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return table_.size();
  }
  uint64_t slot_count() const { return slot_count_; }
  uint64_t last_sequence() const { return Locked(last_seq_); }
  uint64_t log_bytes() const { return Locked(log_end_); }  // the log's current length
  const ReplayStats& replay_stats() const { return replay_; }
  // Of the latest Checkpoint (automatic ones included).
  Status last_checkpoint_status() const { return Locked(last_checkpoint_); }

  // The files of base path P.
  static std::string CheckpointPath(const std::string& base_path, int copy);
  static std::string LogPath(const std::string& base_path);

 private:
  Catalog(IoPlatform& io, std::string base, uint64_t slot_count, const CatalogOptions& options);
  Status Replay();             // Fills the map from the files; writes nothing.
  Status CheckpointLocked();   // REQUIRES: mu_ held.
  Status RestartLogLocked();   // REQUIRES: mu_ held.
  void Apply(const CatalogRecord& r);  // REQUIRES: mu_ held (or not yet shared).
  template <typename T>
  T Locked(const T& field) const {
    std::lock_guard<std::mutex> lock(mu_);
    return field;
  }

  IoPlatform& io_;
  const std::string base_;
  const uint64_t slot_count_;
  const CatalogOptions options_;
  ReplayStats replay_;

  mutable std::mutex mu_;
  std::map<uint64_t, CatalogEntry> table_;  // GUARDED_BY(mu_): the live entries by slot
  uint64_t last_seq_ = 0;            // GUARDED_BY(mu_): highest sequence ever handed out or seen
  int ckpt_fd_[2] = {-1, -1};        // GUARDED_BY(mu_)
  int base_copy_ = -1;               // GUARDED_BY(mu_): the newest durable copy; never overwritten
  uint64_t base_seq_ = 0;            // GUARDED_BY(mu_): its sequence (what a restarted log follows)
  int log_fd_ = -1;                  // GUARDED_BY(mu_)
  uint64_t log_end_ = 0;             // GUARDED_BY(mu_): where the next record goes
  Status log_broken_;                // GUARDED_BY(mu_): the log restart failed; retried by Append
  uint64_t next_auto_checkpoint_ = 0;  // GUARDED_BY(mu_): log length that triggers one
  Status last_checkpoint_;           // GUARDED_BY(mu_)
};

// Recovery cost, for `cxlkv bench tier`: seconds to replay one million records from the log and
// from the checkpoint, with the files in the page cache (a kill -9) and after dropping their
// pages (as cold as a guest can make it), and to write a checkpoint of a million entries.
// Writes `records` records to base_path's catalog files and removes them afterwards.
struct ReplayCost {
  uint64_t records = 0;
  double log_warm_s_per_million = 0, log_cold_s_per_million = 0;
  double checkpoint_warm_s_per_million = 0, checkpoint_cold_s_per_million = 0;
  double checkpoint_write_s_per_million = 0;  // Checkpoint(): entries written + fdatasync + log restart
};
Result<ReplayCost> MeasureReplayCost(IoPlatform& io, const std::string& base_path,
                                     uint64_t records = 1'000'000);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_CATALOG_H_
