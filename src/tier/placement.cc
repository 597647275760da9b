#include "tier/placement.h"

#include <algorithm>
#include <numeric>

namespace cxlkv::tier {

namespace {

__extension__ typedef unsigned __int128 u128;  // exact b_i·n for any 64-bit inputs

Status CheckBandwidths(std::span<const uint64_t> bandwidths, u128* total) {
  if (bandwidths.empty()) {
    return InvalidArgument("placement needs at least one device: add a tier device first");
  }
  *total = 0;
  for (uint64_t b : bandwidths) *total += b;
  if (*total == 0) {
    return InvalidArgument("placement needs a device with non-zero bandwidth: every device measured 0 B/s "
                           "(probe the devices again or give their bandwidth in the config)");
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<double>> PlacementRatios(std::span<const uint64_t> bandwidths) {
  u128 total = 0;
  CXLKV_RETURN_IF_ERROR(CheckBandwidths(bandwidths, &total));
  std::vector<double> p;
  p.reserve(bandwidths.size());
  for (uint64_t b : bandwidths) p.push_back(static_cast<double>(b) / static_cast<double>(total));
  return p;
}

Result<std::vector<uint64_t>> PlacementCounts(std::span<const uint64_t> bandwidths, uint64_t n) {
  u128 total = 0;
  CXLKV_RETURN_IF_ERROR(CheckBandwidths(bandwidths, &total));
  const size_t devices = bandwidths.size();
  std::vector<uint64_t> counts(devices, 0);
  uint64_t assigned = 0;
  for (size_t i = 0; i < devices; ++i) {
    counts[i] = static_cast<uint64_t>(static_cast<u128>(bandwidths[i]) * n / total);  // floor(p_i·n)
    assigned += counts[i];
  }
  // Remainder: one each to the devices with the largest p_i, largest first, ties to the lowest
  // index (stable sort of the indices by descending bandwidth).
  std::vector<size_t> order(devices);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bandwidths[a] > bandwidths[b]; });
  uint64_t remainder = n - assigned;
  // remainder < the number of devices with a fractional share, all of which have b_i > 0; the
  // loop wraps only as a guard.
  for (size_t k = 0; remainder > 0; k = (k + 1) % devices) {
    if (bandwidths[order[k]] == 0) {
      k = devices - 1;  // the rest of `order` is zero-bandwidth: start over from the largest
      continue;
    }
    ++counts[order[k]];
    --remainder;
  }
  return counts;
}

Result<std::vector<PlacementRun>> PlaceInLayerOrder(std::span<const uint64_t> bandwidths, uint64_t n) {
  CXLKV_ASSIGN_OR_RETURN(std::vector<uint64_t> counts, PlacementCounts(bandwidths, n));
  std::vector<PlacementRun> runs;
  uint64_t next = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] == 0) continue;
    runs.push_back({static_cast<uint32_t>(i), next, counts[i]});
    next += counts[i];
  }
  return runs;
}

PlacementCursor::PlacementCursor(std::vector<uint64_t> bandwidths)
    : bandwidths_(std::move(bandwidths)), credit_(bandwidths_.size(), 0), placed_(bandwidths_.size(), 0) {}

Result<std::vector<PlacementRun>> PlacementCursor::Next(uint64_t n) {
  Credit total = 0;
  for (uint64_t b : bandwidths_) total += b;
  if (bandwidths_.empty() || total == 0) {
    return InvalidArgument("placement needs at least one device with a bandwidth above 0");
  }
  std::vector<uint64_t> counts(bandwidths_.size(), 0);
  for (uint64_t item = 0; item < n; ++item) {
    size_t best = 0;
    for (size_t i = 0; i < bandwidths_.size(); ++i) {
      credit_[i] += bandwidths_[i];
      if (credit_[i] > credit_[best]) best = i;
    }
    credit_[best] -= total;
    ++counts[best];
  }
  std::vector<PlacementRun> runs;
  uint64_t next = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    placed_[i] += counts[i];
    if (counts[i] == 0) continue;
    runs.push_back({static_cast<uint32_t>(i), next, counts[i]});
    next += counts[i];
  }
  return runs;
}

}  // namespace cxlkv::tier
