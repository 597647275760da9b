// The user-space slot allocator of one capacity device. The device is a row of granules (the
// SSD's 4 KiB I/O unit, a DRAM device's 64 B line) numbered 0..count-1; a slot is an extent of
// whole granules, exactly as many as its block (header included) needs, named by its first
// granule (slot s lies at byte s·granule of the SSD file or DRAM area). So a block costs no file
// and no file-system metadata, and a block of any size wastes less than one granule: a device
// holds what its blocks add up to, not what a fixed slot size rounds them to.
//
// Placement is best fit by length, lowest address among equals, and a freed extent merges with
// its free neighbours. A model's blocks are all one size, so a block spilled after one was
// dropped takes exactly its extent back; several sizes share a device the way an offset
// allocator shares a segment. A fresh device hands out ascending slots, so one batch lands in one
// contiguous range (one LBA range per offload set, as the paper's SSD_Direct_Store does).
//
// Thread-safety: all methods are safe from any thread (one mutex).
#ifndef CXLKV_SRC_TIER_SLOT_ALLOCATOR_H_
#define CXLKV_SRC_TIER_SLOT_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::tier {

// Extents by first granule: first -> length in granules. What a device's slots are, and what a
// restart proves its index names.
using SlotExtents = std::map<uint64_t, uint64_t>;

// Adds [first, first + length) to `extents` unless it overlaps one already there (or is empty).
bool AddExtent(SlotExtents& extents, uint64_t first, uint64_t length);

class SlotAllocator {
 public:
  // `count` granules; `what` names the device in messages ("ssd tier /data/kv.tier").
  SlotAllocator(uint64_t count, std::string what);

  // One extent per entry of `lengths` (granules each), all or nothing: kNoSpace when they do not
  // all fit (nothing is taken then), InvalidArgument for an empty one.
  Result<std::vector<uint64_t>> Allocate(std::span<const uint64_t> lengths);
  // Returns slots (by first granule) to the free space. InvalidArgument (and nothing freed) for
  // one that is not allocated, or named twice.
  Status Free(std::span<const uint64_t> slots);
  // Marks [first, first + length) allocated (a restart that replays its log); InvalidArgument if
  // any of it is not free.
  Status MarkAllocated(uint64_t first, uint64_t length);

  // Makes exactly `used` allocated (a restart that adopts what the index names), in one pass.
  // InvalidArgument when an extent runs past the device (nothing changes then).
  Status ResetUsed(const SlotExtents& used);
  bool IsAllocated(uint64_t slot) const;
  // The length in granules of the slot that starts at `slot`; 0 when none does.
  uint64_t LengthOf(uint64_t slot) const;
  SlotExtents Allocated() const;

  uint64_t count() const { return count_; }
  uint64_t free_count() const;          // free granules
  uint64_t largest_free() const;        // the longest free extent, in granules
  uint64_t allocated_slots() const;

 private:
  void InsertFreeLocked(uint64_t first, uint64_t length);   // merges with its neighbours
  void EraseFreeLocked(std::map<uint64_t, uint64_t>::iterator it);
  void TakeLocked(uint64_t first, uint64_t length);          // REQUIRES: inside one free extent

  const uint64_t count_;
  const std::string what_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;                       // GUARDED_BY(mu_): first -> length
  std::set<std::pair<uint64_t, uint64_t>> free_by_length_;  // GUARDED_BY(mu_): (length, first)
  SlotExtents used_;                                        // GUARDED_BY(mu_)
  uint64_t free_granules_ = 0;                              // GUARDED_BY(mu_)
};

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_SLOT_ALLOCATOR_H_
