// Four real processes on one real region: each owns one line, writes it and flushes, publishes
// a round number, and reads every other process's line after invalidating it. Run once on the
// hardware and once with each process behind its own simulated non-coherent cache.
#include <unistd.h>

#include <gtest/gtest.h>

#include "region/region_internal.h"
#include "test_region.h"

namespace cxlkv {
namespace {

constexpr int kProcesses = 4;
constexpr uint64_t kRounds = 300;

// Line i of the data area belongs to process i: word 0 = round (the publish word), words 1..7 =
// round * 1000 + i * 10 + w (the payload).
uint64_t Expected(uint64_t round, int owner, int word) { return round * 1000 + owner * 10 + word; }

int Participant(const std::string& path, int me, uint64_t sim_seed) {
  RegionAttachOptions opts;
  opts.sim_seed = sim_seed;
  auto region = Region::Attach(path, opts);
  CHILD_CHECK(region.ok(), "%s", region.status().ToString().c_str());
  region::MetaAccess& meta = (*region)->impl().meta();
  const uint64_t base = (*region)->impl().area(region::AreaKind::kData).offset;
  auto line = [&](int p) { return base + uint64_t(p) * 64; };

  for (uint64_t round = 1; round <= kRounds; ++round) {
    uint64_t words[7];
    for (int w = 1; w <= 7; ++w) words[w - 1] = Expected(round, me, w);
    meta.Write(line(me) + 8, words, sizeof words);
    meta.Flush(line(me) + 8, sizeof words);
    meta.Publish(line(me), round);  // publish after payload
    for (int other = 0; other < kProcesses; ++other) {
      if (other == me) continue;
      uint64_t seen = 0;
      for (int spins = 0; (seen = meta.Fetch(line(other))) < round; ++spins) {
        if (spins > 64) ::usleep(50);  // two cores, four processes: do not burn a core
      }
      // The owner may already be one round further, never more: it waits for us.
      CHILD_CHECK(seen == round || seen == round + 1, "round %lu saw %lu", round, seen);
      meta.Invalidate(line(other) + 8, 56);
      uint64_t got[7];
      meta.Read(line(other) + 8, got, sizeof got);
      for (int w = 1; w <= 7; ++w) {
        bool ok = got[w - 1] == Expected(round, other, w) || got[w - 1] == Expected(round + 1, other, w);
        CHILD_CHECK(ok, "process %d round %lu: word %d of process %d is %lu", me, round, w, other,
                    got[w - 1]);
      }
    }
  }
  return 0;
}

void RunAll(uint64_t sim_seed) {
  testing::TempRegionPath path("mp");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), 16 << 20));
  auto codes = testing::RunForked(kProcesses, [&](int i) {
    return Participant(path.path(), i, sim_seed == 0 ? 0 : sim_seed + i);
  });
  for (int i = 0; i < kProcesses; ++i) EXPECT_EQ(codes[i], 0) << "process " << i;
}

TEST(MultiProcess, FourProcessesExchangeLinesThroughFlushAndInvalidate) { RunAll(0); }

TEST(MultiProcess, SameExchangeWithEveryProcessBehindASimulatedCache) {
  for (uint64_t seed : {11, 23, 37}) RunAll(seed * 100);
}

}  // namespace
}  // namespace cxlkv
