// The capacity devices' slot allocator: slots of each block's size, best fit, merged on free.
#include "tier/slot_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>

#include "tier/dram_device.h"
#include "tier_test_util.h"

namespace cxlkv::tier {
namespace {

TEST(TierSlotAllocator, AFreshDeviceHandsOutOneContiguousAscendingRun) {
  SlotAllocator a(100, "test device");
  auto s = a.Allocate(std::vector<uint64_t>{3, 5, 2});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(*s, (std::vector<uint64_t>{0, 3, 8}));
  EXPECT_EQ(a.free_count(), 90u);
  EXPECT_EQ(a.LengthOf(3), 5u);
  EXPECT_EQ(a.LengthOf(4), 0u) << "only a slot's first granule names it";
}

TEST(TierSlotAllocator, AllOrNothingWhenTheyDoNotAllFit) {
  SlotAllocator a(10, "test device");
  auto s = a.Allocate(std::vector<uint64_t>{4, 4, 4});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(s.status().message().find("test device is full"), std::string::npos) << s.status().ToString();
  EXPECT_EQ(a.free_count(), 10u) << "nothing taken";
  EXPECT_EQ(a.allocated_slots(), 0u);
  EXPECT_EQ(a.Allocate(std::vector<uint64_t>{0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Allocate(std::vector<uint64_t>{11}).status().code(), StatusCode::kInvalidArgument);
}

TEST(TierSlotAllocator, AFreedSlotIsTakenBackByItsSizeAndNeighboursMerge) {
  SlotAllocator a(20, "test device");
  auto s = a.Allocate(std::vector<uint64_t>{4, 4, 4, 4, 4});
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(a.Free(std::vector<uint64_t>{4}).ok());
  ASSERT_TRUE(a.Free(std::vector<uint64_t>{12}).ok());
  // Best fit: a block of 4 takes one of the holes of 4 (the lowest), not a piece of a larger one.
  auto again = a.Allocate(std::vector<uint64_t>{4});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)[0], 4u);
  // 8, 12 and 16 freed: one free extent of 12 granules, which holds a slot of 12.
  ASSERT_TRUE(a.Free(std::vector<uint64_t>{8, 16}).ok());
  EXPECT_EQ(a.largest_free(), 12u);
  auto big = a.Allocate(std::vector<uint64_t>{12});
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ((*big)[0], 8u);
  EXPECT_EQ(a.free_count(), 0u);
}

TEST(TierSlotAllocator, AFreeOfASlotNotAllocatedOrNamedTwiceFreesNothing) {
  SlotAllocator a(20, "test device");
  auto s = a.Allocate(std::vector<uint64_t>{4, 4});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(a.Free(std::vector<uint64_t>{0, 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Free(std::vector<uint64_t>{0, 2}).code(), StatusCode::kInvalidArgument) << "inside a slot";
  EXPECT_EQ(a.Free(std::vector<uint64_t>{99}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(a.IsAllocated(0));
  EXPECT_TRUE(a.IsAllocated(4));
  EXPECT_EQ(a.free_count(), 12u);
}

TEST(TierSlotAllocator, MarkAndResetTakeOnlyFreeSpace) {
  SlotAllocator a(20, "test device");
  ASSERT_TRUE(a.MarkAllocated(5, 3).ok());
  EXPECT_EQ(a.MarkAllocated(6, 2).code(), StatusCode::kInvalidArgument) << "overlaps";
  EXPECT_EQ(a.MarkAllocated(18, 3).code(), StatusCode::kInvalidArgument) << "past the end";
  EXPECT_EQ(a.free_count(), 17u);
  SlotExtents used;
  ASSERT_TRUE(AddExtent(used, 2, 2));
  ASSERT_TRUE(AddExtent(used, 10, 5));
  EXPECT_FALSE(AddExtent(used, 12, 1)) << "inside another";
  EXPECT_FALSE(AddExtent(used, 1, 2)) << "overlaps the start of another";
  ASSERT_TRUE(a.ResetUsed(used).ok());
  EXPECT_EQ(a.Allocated(), used);
  EXPECT_EQ(a.free_count(), 13u);
  EXPECT_EQ(a.largest_free(), 6u);  // [4, 10)
  SlotExtents past;
  ASSERT_TRUE(AddExtent(past, 15, 6));
  EXPECT_EQ(a.ResetUsed(past).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Allocated(), used) << "a refused reset changes nothing";
}

// Three models' block sizes churned through a device (oldest dropped first, as a full tier
// drops its LRU): the device stays ≥ 95% full of slots, however the sizes interleave.
TEST(TierSlotAllocator, ThreeSizesChurnedThroughAFullDeviceKeepItPacked) {
  const uint64_t kGranules = 64 * 1024;  // 256 MiB of 4 KiB units
  SlotAllocator a(kGranules, "test device");
  const uint64_t sizes[] = {225, 449, 577};  // 0.875, 1.75 and 2.25 MiB blocks with their header
  std::mt19937_64 rng(7);
  std::deque<uint64_t> held;
  uint64_t min_used = kGranules, allocations = 0;
  for (int i = 0; i < 20000; ++i) {
    const uint64_t want = sizes[rng() % 3];
    for (bool first = true;; first = false) {
      auto s = a.Allocate(std::span<const uint64_t>(&want, 1));
      if (s.ok()) {
        held.push_back((*s)[0]);
        ++allocations;
        break;
      }
      ASSERT_EQ(s.status().code(), StatusCode::kNoSpace);
      // Refused: the device counts as full now. What it holds in slots then is its packing.
      if (first) min_used = std::min(min_used, kGranules - a.free_count());
      ASSERT_FALSE(held.empty());
      ASSERT_TRUE(a.Free(std::span<const uint64_t>(&held.front(), 1)).ok());
      held.pop_front();
    }
  }
  EXPECT_EQ(allocations, 20000u);
  EXPECT_GE(static_cast<double>(min_used) / kGranules, 0.95) << "a full device held only " << min_used << " of "
                                                             << kGranules << " granules in slots";
}

// A DRAM device carves 64 B lines: blocks of any size fill it to within a line each.
TEST(TierSlotAllocator, ADramDeviceHoldsBlocksOfTheirOwnSize) {
  DramOptions o;
  o.capacity_bytes = 8 << 20;
  o.slot_bytes = (2 << 20) + 4096;
  auto dev = DramDevice::Create(o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_EQ((*dev)->granule_bytes(), 64u);
  // 20 KiB blocks: 408 of them in 8 MiB (20 KiB + the header each), not 3 (one per 2 MiB slot).
  std::vector<uint64_t> sizes(408, 20 << 10);
  auto slots = (*dev)->AllocateSlots(sizes);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  EXPECT_LT((*dev)->free_bytes(), (20u << 10) + 64);
  ASSERT_TRUE((*dev)->FreeSlots(*slots).ok());
  testing::RoundTrip(**dev, 3, 20 << 10, 5);
  EXPECT_EQ((*dev)->AllocateSlots(std::vector<uint64_t>{(2 << 20) + 4096}).status().code(), StatusCode::kInvalidArgument)
      << "larger than its largest slot";
}

}  // namespace
}  // namespace cxlkv::tier
