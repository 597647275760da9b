#include "tier/slot_allocator.h"

#include <algorithm>

namespace cxlkv::tier {

SlotAllocator::SlotAllocator(uint64_t count, std::string what)
    : count_(count), what_(std::move(what)), used_(count, false) {
  free_.reserve(count);
  for (uint64_t s = count; s > 0; --s) free_.push_back(s - 1);
}

Result<std::vector<uint64_t>> SlotAllocator::Allocate(size_t n) {
  std::lock_guard lock(mu_);
  if (n > free_.size()) {
    return NoSpace(what_ + " is full: " + std::to_string(n) + " slots asked, " + std::to_string(free_.size()) +
                   " of " + std::to_string(count_) + " free; evict blocks from it or give it more space");
  }
  std::vector<uint64_t> out(free_.end() - static_cast<std::ptrdiff_t>(n), free_.end());
  std::reverse(out.begin(), out.end());
  free_.resize(free_.size() - n);
  for (uint64_t s : out) used_[s] = true;
  return out;
}

Status SlotAllocator::Free(std::span<const uint64_t> slots) {
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < slots.size(); ++i) {
    uint64_t s = slots[i];
    if (s >= count_ || !used_[s]) {
      for (size_t j = 0; j < i; ++j) used_[slots[j]] = true;  // all or nothing
      return InvalidArgument(what_ + ": slot " + std::to_string(s) + " is " +
                             (s >= count_ ? "out of range" : "not allocated (or named twice)") +
                             "; nothing was freed");
    }
    used_[s] = false;
  }
  free_.insert(free_.end(), slots.begin(), slots.end());
  return Status::Ok();
}

Status SlotAllocator::MarkAllocated(uint64_t slot) {
  std::lock_guard lock(mu_);
  if (slot >= count_ || used_[slot]) {
    return InvalidArgument(what_ + ": slot " + std::to_string(slot) + " cannot be marked allocated: " +
                           (slot >= count_ ? "out of range" : "already allocated"));
  }
  used_[slot] = true;
  free_.erase(std::find(free_.begin(), free_.end(), slot));
  return Status::Ok();
}

uint64_t SlotAllocator::free_count() const {
  std::lock_guard lock(mu_);
  return free_.size();
}

Status SlotAllocator::ResetUsed(const std::vector<bool>& used) {
  if (used.size() != count_) {
    return InvalidArgument(what_ + ": " + std::to_string(used.size()) + " slot flags given for " +
                           std::to_string(count_) + " slots");
  }
  std::lock_guard lock(mu_);
  used_ = used;
  free_.clear();
  for (uint64_t s = count_; s > 0; --s) {
    if (!used_[s - 1]) free_.push_back(s - 1);  // the lowest on top, as at construction
  }
  return Status::Ok();
}

bool SlotAllocator::IsAllocated(uint64_t slot) const {
  std::lock_guard lock(mu_);
  return slot < count_ && used_[slot];
}

}  // namespace cxlkv::tier
