#include "region/coherence.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "region/cpu.h"

namespace cxlkv::region {
namespace {

using CopyFn = void (*)(void*, const void*, size_t);

std::vector<std::pair<const char*, CopyFn>> Variants() {
  std::vector<std::pair<const char*, CopyFn>> v = {
      {"dispatch", &NtCopy}, {"unfenced", &NtCopyUnfenced}, {"scalar", &NtCopyScalar}};
  if (Cpu().avx2) v.push_back({"avx2", &NtCopyAvx2});
  if (Cpu().avx512f) v.push_back({"avx512", &NtCopyAvx512});
  return v;
}

TEST(NtCopy, EveryVariantCopiesExactlyForEverySizeAndAlignment) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> src(8192 + 256), dst(8192 + 256);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  const size_t sizes[] = {0, 1, 7, 8, 15, 31, 63, 64, 65, 127, 128, 200, 1000, 4096, 8191};
  for (auto [name, fn] : Variants()) {
    for (size_t n : sizes) {
      for (size_t dst_off : {0, 1, 8, 33, 63}) {
        for (size_t src_off : {0, 3, 64}) {
          std::fill(dst.begin(), dst.end(), 0xee);
          fn(dst.data() + dst_off, src.data() + src_off, n);
          ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, n), 0)
              << name << " n=" << n << " dst_off=" << dst_off << " src_off=" << src_off;
          // Nothing outside [dst, dst+n) is touched.
          for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xee) << name;
          for (size_t i = dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xee) << name << " n=" << n;
        }
      }
    }
  }
}

TEST(NtCopy, DispatchNamesAVariantThisCpuHas) {
  std::string v = NtCopyVariant();
  if (v == "avx512") {
    EXPECT_TRUE(Cpu().avx512f);
  }
  if (v == "avx2") {
    EXPECT_TRUE(Cpu().avx2);
  }
  EXPECT_TRUE(v == "avx512" || v == "avx2" || v == "scalar") << v;
}

TEST(Flush, EveryFlushKeepsTheDataAndHandlesPartialLines) {
  alignas(64) uint8_t buf[512];
  for (int round = 0; round < 3; ++round) {
    std::memset(buf, round + 1, sizeof buf);
    switch (round) {
      case 0: FlushLines(buf + 3, 300); break;
      case 1: if (Cpu().clflushopt) FlushOptLines(buf + 3, 300); break;
      case 2: if (Cpu().clwb) WritebackLines(buf + 3, 300); break;
    }
    InvalidateLines(buf, sizeof buf);
    for (uint8_t b : buf) ASSERT_EQ(b, round + 1);
  }
  FlushLines(buf, 0);  // empty range: no-op
}

TEST(Cpu, ClflushIsAlwaysThereOnX86_64) {
  EXPECT_TRUE(Cpu().clflush);
  EXPECT_NE(Cpu().ToString().find("clflush"), std::string::npos);
}

}  // namespace
}  // namespace cxlkv::region
