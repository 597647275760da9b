#include "tier/device.h"

#include <algorithm>
#include <cstring>

#include "region/coherence.h"

namespace cxlkv::tier {

std::string_view TierKindName(TierKind kind) {
  switch (kind) {
    case TierKind::kMem: return "mem";
    case TierKind::kSsd: return "ssd";
  }
  return "unknown";
}

uint64_t PayloadBytes(std::span<const std::span<const std::byte>> payload) {
  uint64_t n = 0;
  for (const auto& piece : payload) n += piece.size();
  return n;
}

void GatherPayload(std::span<const std::span<const std::byte>> payload, std::byte* dst) {
  for (const auto& piece : payload) {
    if (piece.empty()) continue;
    std::memcpy(dst, piece.data(), piece.size());
    dst += piece.size();
  }
}

Device::Device(TierKind kind, uint32_t index, uint64_t slot_bytes, uint64_t granule_bytes, uint64_t capacity_bytes,
               std::string name)
    : kind_(kind),
      index_(index),
      slot_bytes_(slot_bytes),
      granule_bytes_(granule_bytes),
      name_(name),
      allocator_(capacity_bytes / granule_bytes, std::move(name)) {}

Result<std::vector<uint64_t>> Device::AllocateSlots(std::span<const uint64_t> payload_bytes) {
  std::vector<uint64_t> lengths;
  lengths.reserve(payload_bytes.size());
  for (uint64_t n : payload_bytes) {
    if (n > payload_capacity()) {
      return InvalidArgument(name_ + ": a block of " + std::to_string(n) + " bytes is larger than its largest slot (" +
                             std::to_string(payload_capacity()) + " bytes after the header): give the tiers a larger "
                             "--tier-slot");
    }
    lengths.push_back(GranulesFor(n));
  }
  return allocator_.Allocate(lengths);
}

Result<std::vector<uint64_t>> Device::AllocateSlots(size_t n) {
  return allocator_.Allocate(std::vector<uint64_t>(n, GranulesFor(payload_capacity())));
}

Status Device::MarkSlotAllocated(uint64_t slot, uint64_t payload_bytes) {
  if (payload_bytes > payload_capacity()) {
    return InvalidArgument(name_ + ": slot " + std::to_string(slot) + " cannot hold a block of " +
                           std::to_string(payload_bytes) + " bytes (the largest is " +
                           std::to_string(payload_capacity()) + ")");
  }
  return allocator_.MarkAllocated(slot, GranulesFor(payload_bytes));
}

uint64_t Device::ExtentBytes(uint64_t slot) const {
  if (slot >= granule_count()) return 0;
  if (const uint64_t length = allocator_.LengthOf(slot); length != 0) return length * granule_bytes_;
  const uint64_t largest = GranulesFor(payload_capacity()) * granule_bytes_;
  return std::min(largest, (granule_count() - slot) * granule_bytes_);
}

DeviceStats Device::stats() const {
  DeviceStats s;
  s.writes = writes_.load(std::memory_order_relaxed);
  s.write_bytes = write_bytes_.load(std::memory_order_relaxed);
  s.write_errors = write_errors_.load(std::memory_order_relaxed);
  s.reads = reads_.load(std::memory_order_relaxed);
  s.read_bytes = read_bytes_.load(std::memory_order_relaxed);
  s.read_errors = read_errors_.load(std::memory_order_relaxed);
  s.miss_empty = miss_empty_.load(std::memory_order_relaxed);
  s.miss_corrupt = miss_corrupt_.load(std::memory_order_relaxed);
  s.miss_stale = miss_stale_.load(std::memory_order_relaxed);
  return s;
}

Status Device::CheckWrite(const WriteItem& item, uint32_t* payload_bytes) const {
  if (item.slot >= granule_count()) {
    return InvalidArgument(name_ + ": slot " + std::to_string(item.slot) + " is out of range (the device has " +
                           std::to_string(granule_count()) + " granules of " + std::to_string(granule_bytes_) +
                           " bytes)");
  }
  const uint64_t n = PayloadBytes(item.payload);
  const uint64_t extent = ExtentBytes(item.slot);
  if (kSlotHeaderBytes + n > extent) {
    return InvalidArgument(name_ + ": a payload of " + std::to_string(n) + " bytes does not fit slot " +
                           std::to_string(item.slot) + " of " + std::to_string(extent) + " bytes (" +
                           std::to_string(extent - std::min<uint64_t>(extent, kSlotHeaderBytes)) +
                           " after the header): allocate the slot for the block's size");
  }
  *payload_bytes = static_cast<uint32_t>(n);
  return Status::Ok();
}

Status Device::CheckRead(const ReadItem& item) const {
  if (item.slot >= granule_count() || ExtentBytes(item.slot) <= kSlotHeaderBytes) {
    return InvalidArgument(name_ + ": slot " + std::to_string(item.slot) + " is out of range (the device has " +
                           std::to_string(granule_count()) + " granules of " + std::to_string(granule_bytes_) +
                           " bytes)");
  }
  return Status::Ok();
}

uint64_t Device::ReadSpan(const ReadItem& item) const {
  const uint64_t extent = ExtentBytes(item.slot);
  return std::min<uint64_t>(extent, kSlotHeaderBytes + item.dst.size());
}

Status Device::FinishRead(ReadItem& item, const std::byte* image, size_t readable) {
  const uint64_t extent = ExtentBytes(item.slot);
  uint64_t limit = std::min<uint64_t>(item.dst.size(), extent - std::min<uint64_t>(extent, kSlotHeaderBytes));
  uint32_t n = 0;
  item.verdict = CheckSlot(image, readable, limit, item.expect, verify_crc(), &n);
  switch (item.verdict) {
    case SlotVerdict::kValid:
      // Into shared memory: non-temporal stores, so the bytes reach memory before the entry
      // that names them is published (rule P3); into private memory: a plain copy.
      if (n > 0 && item.dst_shared) {
        region::NtCopy(item.dst.data(), image + kSlotHeaderBytes, n);
      } else if (n > 0) {
        std::memcpy(item.dst.data(), image + kSlotHeaderBytes, n);
      }
      item.payload_bytes = n;
      reads_.fetch_add(1, std::memory_order_relaxed);
      read_bytes_.fetch_add(n, std::memory_order_relaxed);
      return Status::Ok();
    case SlotVerdict::kEmpty:
      miss_empty_.fetch_add(1, std::memory_order_relaxed);
      return Corrupted("miss: " + name_ + " slot " + std::to_string(item.slot) + " is empty");
    case SlotVerdict::kCorrupt:
      miss_corrupt_.fetch_add(1, std::memory_order_relaxed);
      return Corrupted("miss: " + name_ + " slot " + std::to_string(item.slot) +
                       " failed validation (bad header, length or CRC-32C: corrupt or torn)");
    case SlotVerdict::kStale:
      miss_stale_.fetch_add(1, std::memory_order_relaxed);
      return Corrupted("miss: " + name_ + " slot " + std::to_string(item.slot) +
                       " holds another key, namespace or generation (reused)");
  }
  return Internal("unknown slot verdict");
}

void Device::CountWrite(const Status& s, uint64_t bytes) {
  if (s.ok()) {
    writes_.fetch_add(1, std::memory_order_relaxed);
    write_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  } else {
    write_errors_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace cxlkv::tier
