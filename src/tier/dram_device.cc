#include "tier/dram_device.h"

#include <sys/mman.h>

#include <cstring>

#include "util/units.h"

namespace cxlkv::tier {

Result<std::unique_ptr<DramDevice>> DramDevice::Create(const DramOptions& options) {
  if (options.slot_bytes <= kSlotHeaderBytes || options.slot_bytes % 64 != 0 ||
      options.slot_bytes > (uint64_t{1} << 31)) {
    return InvalidArgument("dram tier: slot size " + std::to_string(options.slot_bytes) +
                           " must be a multiple of 64 above the 64-byte header and at most 2 GiB");
  }
  if (options.capacity_bytes < options.slot_bytes) {
    return InvalidArgument("dram tier: capacity " + std::to_string(options.capacity_bytes) +
                           " bytes holds no slot of " + std::to_string(options.slot_bytes) + " bytes: give more");
  }
  region::Platform& platform = options.platform ? *options.platform : region::Platform::Default();
  std::string numa_note;
  if (options.numa_node >= 0) {
    int max_node = platform.NumaMaxNode();
    if (max_node < 0) {
      numa_note = "not NUMA-bound (node " + std::to_string(options.numa_node) +
                  " asked, but this system reports no NUMA support)";
    } else if (options.numa_node > max_node) {
      return InvalidArgument("dram tier: NUMA node " + std::to_string(options.numa_node) +
                             " does not exist (highest is " + std::to_string(max_node) + ")");
    }
  }
  const size_t map_bytes = options.capacity_bytes / kDramGranule * kDramGranule;
  void* p = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return NoSpace("dram tier: cannot map " + std::to_string(map_bytes) + " bytes: " + std::strerror(errno) +
                   "; give a smaller capacity");
  }
  if (options.numa_node >= 0 && numa_note.empty()) {
    int rc = platform.NumaBind(p, map_bytes, options.numa_node);
    if (rc < 0) {
      ::munmap(p, map_bytes);
      return IoError("dram tier: binding to NUMA node " + std::to_string(options.numa_node) +
                     " failed: " + region::ErrnoText(rc));
    }
    numa_note = "bound to NUMA node " + std::to_string(options.numa_node);
  }
  // Touch every page now (after the bind) so a capacity the node cannot hold fails here, not on
  // a later write; and so the first reads do not pay the faults.
  if (platform.Populate(p, map_bytes) < 0) std::memset(p, 0, map_bytes);
  return std::unique_ptr<DramDevice>(
      new DramDevice(options, static_cast<std::byte*>(p), map_bytes, std::move(numa_note)));
}

DramDevice::DramDevice(const DramOptions& options, std::byte* base, size_t map_bytes, std::string numa_note)
    : Device(TierKind::kMem, options.index, options.slot_bytes, kDramGranule, map_bytes,
             "dram tier " + std::to_string(options.index)),
      base_(base),
      map_bytes_(map_bytes),
      numa_note_(std::move(numa_note)) {}

DramDevice::~DramDevice() { ::munmap(base_, map_bytes_); }

std::string DramDevice::Describe() const {
  std::string s = "mem[" + std::to_string(index()) + "] dram: " + util::FormatBytes(capacity_bytes()) +
                  ", slots of each block's size in 64 B lines, up to " + util::FormatBytes(slot_bytes());
  if (!numa_note_.empty()) s += "; " + numa_note_;
  return s;
}

std::vector<Status> DramDevice::Write(std::span<const WriteItem> items) {
  std::vector<Status> out(items.size());
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < items.size(); ++i) {
    uint32_t n = 0;
    out[i] = CheckWrite(items[i], &n);
    if (out[i].ok()) {
      std::byte* slot = SlotPtr(items[i].slot);
      GatherPayload(items[i].payload, slot + kSlotHeaderBytes);
      SealSlot(slot, items[i].tag, n);
    }
    CountWrite(out[i], n);
  }
  return out;
}

std::vector<Status> DramDevice::Read(std::span<ReadItem> items) {
  std::vector<Status> out(items.size());
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < items.size(); ++i) {
    out[i] = CheckRead(items[i]);
    if (!out[i].ok()) {
      CountReadError();
      continue;
    }
    out[i] = FinishRead(items[i], SlotPtr(items[i].slot), ReadSpan(items[i]));
  }
  return out;
}

}  // namespace cxlkv::tier
