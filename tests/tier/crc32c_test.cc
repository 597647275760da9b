#include "tier/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace cxlkv::tier {
namespace {

TEST(TierCrc32c, StandardCheckValue) {
  // The CRC-32C check value (RFC 3720 B.4 convention: init and final xor 0xFFFFFFFF).
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  // RFC 3720 B.4: 32 bytes of zeros.
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(TierCrc32c, IncrementalOverSeveralSpansEqualsOneShot) {
  std::mt19937_64 rng(14);
  std::vector<unsigned char> buf(100000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const uint32_t whole = Crc32c(buf.data(), buf.size());
  for (int trial = 0; trial < 50; ++trial) {
    Crc32cState s;
    size_t at = 0;
    while (at < buf.size()) {
      size_t n = std::min<size_t>(buf.size() - at, rng() % 5000);
      s.Update(buf.data() + at, n);
      at += n;
    }
    EXPECT_EQ(s.Finish(), whole);
  }
}

}  // namespace
}  // namespace cxlkv::tier
