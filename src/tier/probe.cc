#include "tier/probe.h"

#include <algorithm>
#include <chrono>

namespace cxlkv::tier {

namespace {

uint64_t Median(std::vector<uint64_t> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Result<ProbeResult> ProbeBandwidth(Device& device, const ProbeOptions& options) {
  const uint64_t payload = device.payload_capacity();
  uint64_t bytes = options.bytes;
  if (bytes == 0) bytes = device.kind() == TierKind::kMem ? (64ull << 20) : (16ull << 20);
  uint64_t want = std::max<uint64_t>(1, bytes / device.slot_bytes());
  want = std::min<uint64_t>(want, device.free_slots());
  if (want == 0) return NoSpace("bandwidth probe: the device has no free slot (run it before filling the device)");
  CXLKV_ASSIGN_OR_RETURN(std::vector<uint64_t> slots, device.AllocateSlots(want));
  std::vector<std::byte> src(payload), dst(payload);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 131 + 7);
  std::span<const std::byte> piece(src);
  std::span<const std::span<const std::byte>> scatter(&piece, 1);
  const uint32_t batch = std::max<uint32_t>(1, options.batch);
  std::vector<uint64_t> wr, rd;
  Status failed;
  for (int round = 0; round < std::max(1, options.rounds) && failed.ok(); ++round) {
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < slots.size() && failed.ok(); i += batch) {
      std::vector<WriteItem> items;
      for (size_t j = i; j < std::min<size_t>(slots.size(), i + batch); ++j) {
        items.push_back({slots[j], SlotTag{{j, 0x70726f6265ull}, 0, static_cast<uint64_t>(round)}, scatter});
      }
      for (const Status& s : device.Write(items)) {
        if (!s.ok()) failed = s;
      }
    }
    auto t1 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < slots.size() && failed.ok(); i += batch) {
      std::vector<ReadItem> items;
      for (size_t j = i; j < std::min<size_t>(slots.size(), i + batch); ++j) {
        // Every item reads into the same buffer: the probe measures the device, not the copies.
        items.push_back({slots[j], SlotTag{{j, 0x70726f6265ull}, 0, static_cast<uint64_t>(round)}, dst});
      }
      for (const Status& s : device.Read(items)) {
        if (!s.ok()) failed = s;
      }
    }
    auto t2 = std::chrono::steady_clock::now();
    double bytes = static_cast<double>(slots.size() * payload);
    wr.push_back(static_cast<uint64_t>(bytes / std::chrono::duration<double>(t1 - t0).count()));
    rd.push_back(static_cast<uint64_t>(bytes / std::chrono::duration<double>(t2 - t1).count()));
  }
  Status freed = device.FreeSlots(slots);
  if (!failed.ok()) return Status(failed.code(), "bandwidth probe: " + failed.message());
  CXLKV_RETURN_IF_ERROR(freed);
  ProbeResult r{Median(wr), Median(rd)};
  device.set_bandwidth(std::max<uint64_t>(1, r.read_bytes_per_s));
  return r;
}

}  // namespace cxlkv::tier
