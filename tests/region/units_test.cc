#include "util/units.h"

#include <gtest/gtest.h>

namespace cxlkv::util {
namespace {

TEST(ParseByteSize, AcceptsBinaryMultiplesInEverySpelling) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("64K"), 64u << 10);
  EXPECT_EQ(*ParseByteSize("64KiB"), 64u << 10);
  EXPECT_EQ(*ParseByteSize("512M"), 512u << 20);
  EXPECT_EQ(*ParseByteSize("2G"), uint64_t{2} << 30);
  EXPECT_EQ(*ParseByteSize("1T"), uint64_t{1} << 40);
}

TEST(ParseByteSize, RejectsGarbageWithAMessage) {
  for (const char* bad : {"", "abc", "12X", "-5", "1.5G", "99999999999999999999"}) {
    auto r = ParseByteSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_FALSE(r.status().message().empty());
  }
}

TEST(FormatBytes, PicksTheLargestExactishUnit) {
  EXPECT_EQ(FormatBytes(17), "17 B");
  EXPECT_EQ(FormatBytes(4096), "4 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{2} << 30), "2 GiB");
}

TEST(Hex, FormatsFixedWidth) {
  EXPECT_EQ(Hex64(0x1234), "0x0000000000001234");
  const uint8_t bytes[] = {0xde, 0xad, 0x01};
  EXPECT_EQ(HexBytes(bytes, 3), "dead01");
}

}  // namespace
}  // namespace cxlkv::util
