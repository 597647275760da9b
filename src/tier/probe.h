// The short bandwidth probe run when a device is added (Unified KV pooling §IV-A2: placement
// ratios come from measured bandwidth): a few MB written and read back at the device's slot
// size in batches as deep as the device's queue, through the device's own batch API (header,
// CRC and all), so the figure is what placement will actually get.
//
// Thread-safety: uses the device like any caller; it needs free slots (it frees them after).
#ifndef CXLKV_SRC_TIER_PROBE_H_
#define CXLKV_SRC_TIER_PROBE_H_

#include <cstdint>

#include "cxlkv/status.h"
#include "tier/device.h"

namespace cxlkv::tier {

struct ProbeOptions {
  // Bytes per direction; default 0 = by kind: 16 MiB on an SSD (a few ms at its speed), 64 MiB
  // on DRAM — more than any last-level cache, or the probe would measure the cache (a probe of
  // 16 MiB read DRAM at 2× its real rate here and skewed placement). Bounded by free slots.
  uint64_t bytes = 0;
  uint32_t batch = 32;        // default 32 items per batch
  int rounds = 3;             // default 3: the median round is taken
};

struct ProbeResult {
  uint64_t write_bytes_per_s = 0;
  uint64_t read_bytes_per_s = 0;
};

// Measures and records the device's bandwidth (set_bandwidth(read bandwidth): retrieval is the
// latency-critical direction). kNoSpace when the device has no free slot for the probe.
Result<ProbeResult> ProbeBandwidth(Device& device, const ProbeOptions& options = {});

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_PROBE_H_
