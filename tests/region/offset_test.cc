#include "region/offset.h"

#include <gtest/gtest.h>

namespace cxlkv::region {
namespace {

struct Node {
  uint64_t a, b;
};

TEST(Offset, ZeroIsNullAndRegionIndexRoundTrips) {
  Offset<Node> null;
  EXPECT_TRUE(null.is_null());
  EXPECT_FALSE(static_cast<bool>(null));
  auto off = Offset<Node>::Make(3, 0x1000);
  EXPECT_FALSE(off.is_null());
  EXPECT_EQ(off.region_index(), 3u);
  EXPECT_EQ(off.byte_offset(), 0x1000u);
  EXPECT_EQ(off.Plus(64).byte_offset(), 0x1040u);
  EXPECT_EQ(off.Plus(64).region_index(), 3u);
  EXPECT_EQ(off.As<uint64_t>().raw(), off.raw());
}

TEST(Offset, ToPtrIsBaseRelative) {
  alignas(64) uint8_t buf[256] = {};
  auto off = Offset<Node>::Make(0, 64);
  Node* n = ToPtr(buf, sizeof buf, off);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(n), buf + 64);
  n->a = 7;
  EXPECT_EQ(ToPtr(buf, sizeof buf, off)->a, 7u);
}

// Every build: offsets are read from shared memory.
TEST(OffsetDeathTest, OutOfBoundsAbortsInEveryBuild) {
  alignas(64) uint8_t buf[128] = {};
  EXPECT_DEATH(ToPtr(buf, sizeof buf, Offset<Node>::Make(0, 120)), "out of bounds");
  EXPECT_DEATH(ToPtr(buf, sizeof buf, Offset<Node>()), "out of bounds");
}

}  // namespace
}  // namespace cxlkv::region
