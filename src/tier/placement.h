// Bandwidth-proportional placement (Unified KV pooling §IV-A, Eq. 1–2, Algorithm 1).
//
// Device i with measured bandwidth b_i gets the placement ratio p_i = b_i / Σ b_j. An offload
// batch of n items (in layer order) is split as floor(p_i·n) items per device, and the
// remainder r = n − Σ floor(p_i·n) goes to the devices with the largest p_i, one item each,
// largest first, ties to the lowest index. (The paper's Algorithm 1 picks "the device with the
// largest p_i" for each remaining item; handing them all to one device could put it r−1 items
// past its share when there are 3+ devices, so each device takes at most one — r is always
// smaller than the number of devices with a fractional share, so every count stays within one
// item of p_i·n, and the largest device gets the first.) A device of bandwidth 0 gets nothing.
//
// Items are assigned in order as contiguous runs: device 0 takes items [0, c_0), device 1 the
// next c_1, ... — so one device's share of a request is one contiguous run (one contiguous slot
// range on an SSD, as the paper's SSD_Direct_Store allocates one LBA range per offload set).
//
// Arithmetic is exact: bandwidths are integers (bytes/s), floor(b_i·n / Σb) is computed in
// 128-bit integers, so the result does not depend on floating-point rounding.
// Thread-safety: pure functions.
#ifndef CXLKV_SRC_TIER_PLACEMENT_H_
#define CXLKV_SRC_TIER_PLACEMENT_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::tier {

// Items [first, first + count) of a batch go to device `device`.
struct PlacementRun {
  uint32_t device = 0;
  uint64_t first = 0;
  uint64_t count = 0;
};

// p_i = b_i / Σ b_j. InvalidArgument when `bandwidths` is empty or all zero.
Result<std::vector<double>> PlacementRatios(std::span<const uint64_t> bandwidths);

// How many of `n` items each device gets (Eq. 2). InvalidArgument when `bandwidths` is empty
// or all zero.
Result<std::vector<uint64_t>> PlacementCounts(std::span<const uint64_t> bandwidths, uint64_t n);

// The counts as contiguous runs in layer order, one per device with a non-zero count, in
// device order.
Result<std::vector<PlacementRun>> PlaceInLayerOrder(std::span<const uint64_t> bandwidths, uint64_t n);

// Algorithm 1 applied batch by batch starves the smaller devices when batches are small: a
// batch of one item always goes to the largest p_i (a spill thread that keeps up moves a few
// blocks at a time). A cursor carries each device's unspent share from batch to batch (smooth
// weighted round robin in exact integers: every item adds b_i to each device's credit and the
// device with the most credit, ties to the lowest index, takes the item and pays Σb), so over
// any run of batches device i's count stays within one item of p_i × the items placed, and a
// zero-bandwidth device gets nothing. Each batch is still laid out as contiguous runs in layer
// order, in device order.
// Thread-safety: not thread-safe (one per placing thread).
class PlacementCursor {
 public:
  // InvalidArgument (at Next) when `bandwidths` is empty or all zero.
  explicit PlacementCursor(std::vector<uint64_t> bandwidths);
  Result<std::vector<PlacementRun>> Next(uint64_t n);
  const std::vector<uint64_t>& placed() const { return placed_; }  // items per device so far

 private:
  __extension__ typedef __int128 Credit;  // b_i summed over items: beyond 64 bits
  std::vector<uint64_t> bandwidths_;
  std::vector<Credit> credit_;
  std::vector<uint64_t> placed_;
};

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_PLACEMENT_H_
