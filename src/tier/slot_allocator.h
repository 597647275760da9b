// The user-space slot allocator of one capacity device: slots are fixed-size and numbered
// 0..count-1 (slot i lies at byte i·slot_bytes of the SSD file or DRAM area), so a block costs
// no file and no file-system metadata. A fresh device hands out ascending slot numbers, so one
// batch lands in one contiguous range (one LBA range per offload set, as the paper's
// SSD_Direct_Store does).
//
// Thread-safety: all methods are safe from any thread (one mutex).
#ifndef CXLKV_SRC_TIER_SLOT_ALLOCATOR_H_
#define CXLKV_SRC_TIER_SLOT_ALLOCATOR_H_

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::tier {

class SlotAllocator {
 public:
  // `what` names the device in messages ("ssd tier /data/kv.tier").
  SlotAllocator(uint64_t count, std::string what);

  // `n` slots, all or nothing: kNoSpace when fewer are free (nothing is taken then).
  Result<std::vector<uint64_t>> Allocate(size_t n);
  // Returns slots to the free list. InvalidArgument (and nothing freed) for a slot out of range
  // or not allocated.
  Status Free(std::span<const uint64_t> slots);
  // Marks a slot allocated (a restart that replays its log); InvalidArgument if it is not free.
  Status MarkAllocated(uint64_t slot);

  // Makes exactly the slots with used[slot] set allocated (a restart that adopts what the index
  // names), in one pass. InvalidArgument when `used` is not count() long.
  Status ResetUsed(const std::vector<bool>& used);
  bool IsAllocated(uint64_t slot) const;

  uint64_t count() const { return count_; }
  uint64_t free_count() const;

 private:
  const uint64_t count_;
  const std::string what_;
  mutable std::mutex mu_;
  std::vector<uint64_t> free_;   // GUARDED_BY(mu_): a stack, the lowest slot on top
  std::vector<bool> used_;       // GUARDED_BY(mu_)
};

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_SLOT_ALLOCATOR_H_
