// The home ring (rack/home_ring.h): the same answer from any builder, shares near 1/N, and the
// exact movement consistent hashing promises when a rack leaves or joins.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "rack/home_ring.h"

namespace cxlkv::rack {
namespace {

uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<uint64_t> Chains(size_t n) {
  std::vector<uint64_t> out(n);
  uint64_t s = 42;
  for (auto& c : out) c = SplitMix(&s);
  return out;
}

std::vector<std::string> Racks(int n) {
  std::vector<std::string> r;
  for (int i = 0; i < n; ++i) r.push_back("rack-" + std::to_string(i));
  return r;
}

TEST(HomeRing, EveryBuilderGetsTheSameAnswerWhateverTheOrder) {
  const HomeRing a = HomeRing::Build({"b", "a", "c", "a"});
  const HomeRing b = HomeRing::Build({"c", "b", "a"});
  EXPECT_EQ(a.racks(), (std::vector<std::string>{"a", "b", "c"}));
  for (uint64_t c : Chains(5000)) {
    const auto x = a.HomesOf(c), y = b.HomesOf(c);
    ASSERT_EQ(x.home, y.home);
    ASSERT_EQ(x.replica, y.replica);
    ASSERT_NE(x.home, x.replica) << "a replica on the home rack protects nothing";
  }
  EXPECT_TRUE(HomeRing::Build({}).HomesOf(1).home.empty());
  const HomeRing one = HomeRing::Build({"solo"});
  EXPECT_EQ(one.HomesOf(7).home, "solo");
  EXPECT_EQ(one.HomesOf(7).replica, "");
  EXPECT_DOUBLE_EQ(one.Share("solo"), 1.0);
  EXPECT_EQ(one.Share("other"), 0.0);
}

TEST(HomeRing, SixteenRacksEachHoldNearAnEqualShare) {
  const HomeRing ring = HomeRing::Build(Racks(16));
  const std::vector<uint64_t> chains = Chains(160000);
  std::map<std::string, size_t> homed, replicas;
  for (uint64_t c : chains) {
    const auto h = ring.HomesOf(c);
    ++homed[h.home];
    ++replicas[h.replica];
  }
  double shares = 0;
  for (const std::string& r : ring.racks()) {
    const double share = ring.Share(r);
    shares += share;
    EXPECT_GT(share, 0.7 / 16) << r;
    EXPECT_LT(share, 1.3 / 16) << r;
    // The chains counted agree with the arcs measured.
    EXPECT_NEAR(static_cast<double>(homed[r]) / chains.size(), share, 0.006) << r;
    EXPECT_GT(replicas[r], chains.size() * 0.6 / 16) << r;
  }
  EXPECT_NEAR(shares, 1.0, 1e-9);
}

TEST(HomeRing, ALeaverHandsEachOfItsChainsToThatChainsReplicaAndMovesNoOther) {
  const std::vector<std::string> all = Racks(8);
  const HomeRing before = HomeRing::Build(all);
  std::vector<std::string> rest = all;
  rest.erase(rest.begin() + 3);
  const HomeRing after = HomeRing::Build(rest);
  size_t moved = 0;
  for (uint64_t c : Chains(40000)) {
    const auto b = before.HomesOf(c), a = after.HomesOf(c);
    if (b.home == all[3]) {
      ASSERT_EQ(a.home, b.replica) << "the replica already holds the entries: it must become the home";
      ++moved;
    } else {
      ASSERT_EQ(a.home, b.home) << "a chain moved that the leaver did not own";
    }
  }
  EXPECT_GT(moved, 0u);
}

TEST(HomeRing, AJoinerTakesChainsOnlyForItself) {
  const HomeRing before = HomeRing::Build(Racks(5));
  std::vector<std::string> more = Racks(5);
  more.push_back("rack-new");
  const HomeRing after = HomeRing::Build(more);
  size_t taken = 0;
  const std::vector<uint64_t> chains = Chains(40000);
  for (uint64_t c : chains) {
    const auto b = before.HomesOf(c), a = after.HomesOf(c);
    if (a.home != b.home) {
      ASSERT_EQ(a.home, "rack-new");
      ++taken;
    }
  }
  EXPECT_NEAR(static_cast<double>(taken) / chains.size(), after.Share("rack-new"), 0.01);
}

}  // namespace
}  // namespace cxlkv::rack
