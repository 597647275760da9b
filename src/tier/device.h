// A capacity device of the unified KV pool (Unified KV pooling §IV): node DRAM or an
// SSD, carved into fixed-size slots, read and written in batches. The global lookup table (Table
// I) above it records, per block, {tier kind, device index, slot}; placement (placement.h) splits
// each offload batch across devices by their measured bandwidth.
//
// Every slot holds one block in the format of slot_format.h, so every device validates a read the
// same way: a read returns data only for the key, namespace and generation the caller expects;
// an empty, corrupt, torn or reused slot is a miss (StatusCode::kCorrupted, "miss: ..."; the
// item's verdict says which, and the device counts them) — never data.
//
// API: allocate slots (all or nothing, kNoSpace when the device is full), then Write a batch of
// {slot, tag, payload scatter list} and Read a batch of {slot, expected tag, destination}; each
// returns one Status per item. A batch may be any length (longer than the queue depth too).
//
// Thread-safety: Write, Read and the slot calls are safe from any thread; a device serializes its
// own batches (one I/O worker per device). The caller owns the slot's life: it does not read a
// slot while writing it, and bumps the generation when it reuses one.
#ifndef CXLKV_SRC_TIER_DEVICE_H_
#define CXLKV_SRC_TIER_DEVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "tier/slot_allocator.h"
#include "tier/slot_format.h"

namespace cxlkv::tier {

// Table I's device type. (The shared region itself is tier 0 and is not a Device.)
enum class TierKind : uint8_t { kMem = 1, kSsd = 2 };
std::string_view TierKindName(TierKind kind);

struct WriteItem {
  uint64_t slot = 0;
  SlotTag tag;
  std::span<const std::span<const std::byte>> payload;  // gathered in order into the slot
};

struct ReadItem {
  uint64_t slot = 0;
  SlotTag expect;
  std::span<std::byte> dst;   // at least the block's payload size
  bool dst_shared = false;    // dst is in the shared region: copied with non-temporal stores
  // Out:
  uint32_t payload_bytes = 0;          // on success: bytes written to dst
  SlotVerdict verdict = SlotVerdict::kEmpty;
};

// Counters of one device (monotonic; for `cxlkv stat` and the tier metrics).
struct DeviceStats {
  uint64_t writes = 0, write_bytes = 0, write_errors = 0;
  uint64_t reads = 0, read_bytes = 0, read_errors = 0;
  uint64_t miss_empty = 0, miss_corrupt = 0, miss_stale = 0;
};

// True for the Status of a read that found no valid block (count it, free the slot, go on).
inline bool IsMiss(const Status& s) { return s.code() == StatusCode::kCorrupted; }

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  TierKind kind() const { return kind_; }
  uint32_t index() const { return index_; }
  // The largest slot, header included: what the device was configured with (--tier-slot); a
  // block up to payload_capacity() fits. A slot takes only the granules its block needs.
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t payload_capacity() const { return slot_bytes_ - kSlotHeaderBytes; }
  // The unit slots are carved in (the SSD's 4 KiB I/O unit, a DRAM line); slot s lies at byte
  // SlotOffset(s).
  uint64_t granule_bytes() const { return granule_bytes_; }
  uint64_t granule_count() const { return allocator_.count(); }
  uint64_t SlotOffset(uint64_t slot) const { return slot * granule_bytes_; }
  // Granules of the slot a block of `payload_bytes` takes: header and payload, rounded up.
  uint64_t GranulesFor(uint64_t payload_bytes) const {
    return (kSlotHeaderBytes + payload_bytes + granule_bytes_ - 1) / granule_bytes_;
  }
  // How many largest slots the device holds (its size in --tier-slot units).
  uint64_t slot_count() const { return capacity_bytes() / slot_bytes_; }
  uint64_t capacity_bytes() const { return granule_bytes_ * allocator_.count(); }

  // Measured (probe.h) or configured retrieval bandwidth in bytes/s; 0 until known.
  uint64_t bandwidth() const { return bandwidth_.load(std::memory_order_relaxed); }
  void set_bandwidth(uint64_t bytes_per_s) { bandwidth_.store(bytes_per_s, std::memory_order_relaxed); }

  // CRC verification on read (default on). Off only to measure its cost (bench tier).
  void set_verify_crc(bool on) { verify_crc_.store(on, std::memory_order_relaxed); }

  // One slot per block of these payload sizes, each exactly its GranulesFor; all or nothing
  // (kNoSpace when they do not all fit; InvalidArgument for one larger than payload_capacity()).
  Result<std::vector<uint64_t>> AllocateSlots(std::span<const uint64_t> payload_bytes);
  // `n` slots of the largest size (the probe's, and tests').
  Result<std::vector<uint64_t>> AllocateSlots(size_t n);
  Status FreeSlots(std::span<const uint64_t> slots) { return allocator_.Free(slots); }
  // A restart's: the slot at `slot` holds a block of `payload_bytes`.
  Status MarkSlotAllocated(uint64_t slot, uint64_t payload_bytes);
  // Free space in largest slots (what fits if nothing is fragmented) and in bytes.
  uint64_t free_slots() const { return free_bytes() / slot_bytes_; }
  uint64_t free_bytes() const { return allocator_.free_count() * granule_bytes_; }
  // Makes exactly these extents (granules, AddExtent-built) the allocated slots.
  Status ResetUsedSlots(const SlotExtents& used) { return allocator_.ResetUsed(used); }
  bool SlotAllocated(uint64_t slot) const { return allocator_.IsAllocated(slot); }
  SlotExtents AllocatedSlots() const { return allocator_.Allocated(); }
  uint64_t allocated_slots() const { return allocator_.allocated_slots(); }

  // One line for the log and `cxlkv stat`: kind, where, size, and the I/O path in use with every
  // fallback taken and why.
  virtual std::string Describe() const = 0;

  virtual std::vector<Status> Write(std::span<const WriteItem> items) = 0;
  virtual std::vector<Status> Read(std::span<ReadItem> items) = 0;

  DeviceStats stats() const;

 protected:
  // `capacity_bytes` is carved into granules of `granule_bytes` (the tail that is less than
  // one is not used).
  Device(TierKind kind, uint32_t index, uint64_t slot_bytes, uint64_t granule_bytes, uint64_t capacity_bytes,
         std::string name);

  const std::string& name() const { return name_; }
  bool verify_crc() const { return verify_crc_.load(std::memory_order_relaxed); }

  // Checks an item before any byte moves: slot in range, payload fits. Sets *payload_bytes.
  Status CheckWrite(const WriteItem& item, uint32_t* payload_bytes) const;
  Status CheckRead(const ReadItem& item) const;
  // The bytes of a slot a read of `item` must fetch: header + destination, at most the slot.
  uint64_t ReadSpan(const ReadItem& item) const;
  // The bytes of the slot at `slot`: its extent when allocated; otherwise (a caller that manages
  // slots itself) a largest slot, cut at the device's end.
  uint64_t ExtentBytes(uint64_t slot) const;
  // Validates a fetched slot image and copies the payload out; the item's verdict and the
  // counters are updated. Returns OK or the miss.
  Status FinishRead(ReadItem& item, const std::byte* image, size_t readable);
  void CountWrite(const Status& s, uint64_t bytes);
  void CountReadError() { read_errors_.fetch_add(1, std::memory_order_relaxed); }

 private:
  const TierKind kind_;
  const uint32_t index_;
  const uint64_t slot_bytes_;
  const uint64_t granule_bytes_;
  const std::string name_;
  SlotAllocator allocator_;
  std::atomic<uint64_t> bandwidth_{0};
  std::atomic<bool> verify_crc_{true};
  std::atomic<uint64_t> writes_{0}, write_bytes_{0}, write_errors_{0};
  std::atomic<uint64_t> reads_{0}, read_bytes_{0}, read_errors_{0};
  std::atomic<uint64_t> miss_empty_{0}, miss_corrupt_{0}, miss_stale_{0};
};

// Bytes of a payload scatter list.
uint64_t PayloadBytes(std::span<const std::span<const std::byte>> payload);
// Gathers a scatter list into dst (which holds PayloadBytes(payload)).
void GatherPayload(std::span<const std::span<const std::byte>> payload, std::byte* dst);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_DEVICE_H_
