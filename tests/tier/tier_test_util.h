// Helpers of the tier tests: a scratch directory on a real file system (O_DIRECT needs one;
// /tmp or /dev/shm may be tmpfs), payloads, tags, and a device round trip.
#ifndef CXLKV_TESTS_TIER_TIER_TEST_UTIL_H_
#define CXLKV_TESTS_TIER_TIER_TEST_UTIL_H_

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "tier/device.h"

namespace cxlkv::tier::testing {

// A directory under the working directory (ctest runs in the build tree, on the disk), removed
// at the end of the test.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "tier-scratch-" + std::to_string(::getpid()) + "-" + (info ? info->name() : "x");
    for (char& c : name) c = c == '/' ? '_' : c;  // parameterized test names hold '/'
    path_ = std::filesystem::current_path() / name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline std::vector<std::byte> Payload(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

inline SlotTag Tag(uint64_t i, uint64_t generation = 1, uint64_t ns = 7) {
  return SlotTag{BlockKey{0x1234000 + i, 0xabcdef00 + i * 3}, ns, generation};
}

// Writes `count` blocks of `payload_bytes` (each as three scatter pieces) in one batch and reads
// them back in one batch; expects every byte identical.
inline void RoundTrip(Device& dev, size_t count, size_t payload_bytes, uint64_t seed) {
  auto slots = dev.AllocateSlots(count);
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  std::vector<std::vector<std::byte>> data;
  std::vector<std::vector<std::span<const std::byte>>> pieces(count);
  std::vector<WriteItem> writes;
  for (size_t i = 0; i < count; ++i) data.push_back(Payload(seed + i, payload_bytes));
  for (size_t i = 0; i < count; ++i) {
    size_t a = payload_bytes / 3, b = payload_bytes / 2;
    std::span<const std::byte> all(data[i]);
    pieces[i] = {all.subspan(0, a), all.subspan(a, b - a), all.subspan(b)};
    writes.push_back({(*slots)[i], Tag(seed + i), pieces[i]});
  }
  auto ws = dev.Write(writes);
  for (size_t i = 0; i < count; ++i) ASSERT_TRUE(ws[i].ok()) << i << ": " << ws[i].ToString();
  std::vector<std::vector<std::byte>> out(count, std::vector<std::byte>(payload_bytes + 100));
  std::vector<ReadItem> reads;
  for (size_t i = 0; i < count; ++i) reads.push_back({(*slots)[i], Tag(seed + i), out[i]});
  auto rs = dev.Read(reads);
  for (size_t i = 0; i < count; ++i) {
    ASSERT_TRUE(rs[i].ok()) << i << ": " << rs[i].ToString();
    ASSERT_EQ(reads[i].payload_bytes, payload_bytes);
    ASSERT_EQ(reads[i].verdict, SlotVerdict::kValid);
    ASSERT_TRUE(std::equal(data[i].begin(), data[i].end(), out[i].begin())) << "block " << i << " differs";
  }
  ASSERT_TRUE(dev.FreeSlots(*slots).ok());
}

}  // namespace cxlkv::tier::testing

#endif  // CXLKV_TESTS_TIER_TIER_TEST_UTIL_H_
