// The node-local DRAM tier (tier 1): an anonymous mapping carved into slots of each block's size
// (in 64-byte lines: slot_allocator.h), optionally bound to
// one NUMA node (mbind before first touch, through region::Platform). Same slot format and batch
// API as the SSD tier, so a read validates the same way on every device.
//
// Thread-safety: as Device. Batches are serialized by one mutex (one worker per device).
#ifndef CXLKV_SRC_TIER_DRAM_DEVICE_H_
#define CXLKV_SRC_TIER_DRAM_DEVICE_H_

#include <memory>
#include <mutex>
#include <string>

#include "region/platform.h"
#include "tier/device.h"

namespace cxlkv::tier {

inline constexpr uint64_t kDramGranule = 64;  // a DRAM tier's slots are whole lines

struct DramOptions {
  uint32_t index = 0;                 // the device's index in the pool (Table I device_idx)
  uint64_t capacity_bytes = 0;        // required, at least one largest slot; rounded down to 64 B
  uint64_t slot_bytes = 256 << 10;    // the largest slot: default 256 KiB, header included; a
                                      // multiple of 64
  int numa_node = -1;                 // -1: wherever the kernel puts it; else bind to this node
  region::Platform* platform = nullptr;  // default: region::Platform::Default()
};

class DramDevice final : public Device {
 public:
  // InvalidArgument for a capacity below one slot or a NUMA node that does not exist; when the
  // system has no NUMA support the memory is not bound, and Describe() says so.
  static Result<std::unique_ptr<DramDevice>> Create(const DramOptions& options);
  ~DramDevice() override;

  std::string Describe() const override;
  std::vector<Status> Write(std::span<const WriteItem> items) override;
  std::vector<Status> Read(std::span<ReadItem> items) override;

 private:
  DramDevice(const DramOptions& options, std::byte* base, size_t map_bytes, std::string numa_note);

  std::byte* SlotPtr(uint64_t slot) const { return base_ + SlotOffset(slot); }

  std::mutex mu_;
  std::byte* const base_;
  const size_t map_bytes_;
  const std::string numa_note_;
};

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_DRAM_DEVICE_H_
