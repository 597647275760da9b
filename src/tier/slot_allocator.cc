#include "tier/slot_allocator.h"

#include <algorithm>
#include <iterator>

namespace cxlkv::tier {

bool AddExtent(SlotExtents& extents, uint64_t first, uint64_t length) {
  if (length == 0 || first + length < first) return false;
  auto next = extents.lower_bound(first);
  if (next != extents.end() && next->first < first + length) return false;
  if (next != extents.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > first) return false;
  }
  extents.emplace_hint(next, first, length);
  return true;
}

SlotAllocator::SlotAllocator(uint64_t count, std::string what) : count_(count), what_(std::move(what)) {
  std::lock_guard lock(mu_);
  if (count_ > 0) InsertFreeLocked(0, count_);
}

void SlotAllocator::EraseFreeLocked(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_length_.erase({it->second, it->first});
  free_granules_ -= it->second;
  free_.erase(it);
}

void SlotAllocator::InsertFreeLocked(uint64_t first, uint64_t length) {
  auto next = free_.lower_bound(first);
  if (next != free_.end() && next->first == first + length) {  // merge with the one after
    length += next->second;
    auto after = std::next(next);
    EraseFreeLocked(next);
    next = after;
  }
  if (next != free_.begin()) {  // and with the one before
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      length += prev->second;
      EraseFreeLocked(prev);
    }
  }
  free_.emplace(first, length);
  free_by_length_.insert({length, first});
  free_granules_ += length;
}

void SlotAllocator::TakeLocked(uint64_t first, uint64_t length) {
  auto it = std::prev(free_.upper_bound(first));
  const uint64_t f = it->first, l = it->second;
  EraseFreeLocked(it);
  if (first > f) InsertFreeLocked(f, first - f);
  if (first + length < f + l) InsertFreeLocked(first + length, f + l - first - length);
  used_.emplace(first, length);
}

Result<std::vector<uint64_t>> SlotAllocator::Allocate(std::span<const uint64_t> lengths) {
  std::lock_guard lock(mu_);
  std::vector<uint64_t> out;
  out.reserve(lengths.size());
  auto undo = [&] {
    for (uint64_t s : out) InsertFreeLocked(s, used_.extract(s).mapped());
  };
  for (uint64_t length : lengths) {
    if (length == 0 || length > count_) {
      undo();
      return InvalidArgument(what_ + ": a slot of " + std::to_string(length) + " granules was asked for (the device has " +
                             std::to_string(count_) + ")");
    }
    // Best fit: the shortest free extent that holds it, the lowest of those; carved from its start.
    auto fit = free_by_length_.lower_bound({length, 0});
    if (fit == free_by_length_.end()) {
      uint64_t asked = 0;
      for (uint64_t l : lengths) asked += l;
      undo();
      const uint64_t largest = free_by_length_.empty() ? 0 : free_by_length_.rbegin()->first;
      return NoSpace(what_ + " is full: " + std::to_string(lengths.size()) + " slot(s) of " + std::to_string(asked) +
                     " granules in all asked, " + std::to_string(free_granules_) + " of " + std::to_string(count_) +
                     " free (" + std::to_string(largest) + " in one piece); evict blocks from it or give it more space");
    }
    const uint64_t first = fit->second;
    TakeLocked(first, length);
    out.push_back(first);
  }
  return out;
}

Status SlotAllocator::Free(std::span<const uint64_t> slots) {
  std::lock_guard lock(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> taken;
  taken.reserve(slots.size());
  for (uint64_t s : slots) {
    auto it = used_.find(s);
    if (it == used_.end()) {
      for (auto [first, length] : taken) used_.emplace(first, length);  // all or nothing
      return InvalidArgument(what_ + ": slot " + std::to_string(s) + " is " +
                             (s >= count_ ? "out of range" : "not allocated (or named twice)") + "; nothing was freed");
    }
    taken.push_back(*it);
    used_.erase(it);
  }
  for (auto [first, length] : taken) InsertFreeLocked(first, length);
  return Status::Ok();
}

Status SlotAllocator::MarkAllocated(uint64_t first, uint64_t length) {
  std::lock_guard lock(mu_);
  auto it = free_.upper_bound(first);
  const bool inside = length != 0 && first < count_ && length <= count_ - first && it != free_.begin() &&
                      std::prev(it)->first + std::prev(it)->second >= first + length;
  if (!inside) {
    return InvalidArgument(what_ + ": slot " + std::to_string(first) + " of " + std::to_string(length) +
                           " granules cannot be marked allocated: " +
                           (length == 0 || first >= count_ || length > count_ - first ? "out of range"
                                                                                      : "not all of it is free"));
  }
  TakeLocked(first, length);
  return Status::Ok();
}

Status SlotAllocator::ResetUsed(const SlotExtents& used) {
  if (!used.empty()) {
    auto last = std::prev(used.end());
    if (last->first >= count_ || last->second > count_ - last->first) {
      return InvalidArgument(what_ + ": slot " + std::to_string(last->first) + " of " + std::to_string(last->second) +
                             " granules runs past the device's " + std::to_string(count_));
    }
  }
  std::lock_guard lock(mu_);
  free_.clear();
  free_by_length_.clear();
  free_granules_ = 0;
  used_ = used;
  uint64_t at = 0;
  for (auto [first, length] : used_) {
    if (first > at) InsertFreeLocked(at, first - at);
    at = std::max(at, first + length);
  }
  if (at < count_) InsertFreeLocked(at, count_ - at);
  return Status::Ok();
}

bool SlotAllocator::IsAllocated(uint64_t slot) const {
  std::lock_guard lock(mu_);
  return used_.contains(slot);
}

uint64_t SlotAllocator::LengthOf(uint64_t slot) const {
  std::lock_guard lock(mu_);
  auto it = used_.find(slot);
  return it == used_.end() ? 0 : it->second;
}

SlotExtents SlotAllocator::Allocated() const {
  std::lock_guard lock(mu_);
  return used_;
}

uint64_t SlotAllocator::free_count() const {
  std::lock_guard lock(mu_);
  return free_granules_;
}

uint64_t SlotAllocator::largest_free() const {
  std::lock_guard lock(mu_);
  return free_by_length_.empty() ? 0 : free_by_length_.rbegin()->first;
}

uint64_t SlotAllocator::allocated_slots() const {
  std::lock_guard lock(mu_);
  return used_.size();
}

}  // namespace cxlkv::tier
