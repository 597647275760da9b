// Recovery orders the cache cannot choose: an evictor that dies mid-eviction of a payload whose
// owner's life ended (and was recovered) before it. Real processes on one region.
#include <signal.h>

#include <thread>

#include <gtest/gtest.h>

#include "cache_test_util.h"
#include "child.h"

namespace cxlkv {
namespace {

using testing::Child;
using testing::OpenCache;

alloc::RegionUsage Usage(const std::string& path) {
  auto regions = pool::AttachAll({path});
  EXPECT_TRUE(regions.ok());
  return alloc::InspectChunks(*(*regions)[0], 8);
}

void Sleep(double leases) {
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(leases * testing::kTestLeaseMs)));
}

// Node 2 publishes a block and leaves: its recovery keeps the payload (a READY entry reaches
// it) in an orphan heap chunk. Node 1 then marks the entry EVICTING and is killed before its
// free. The entry's repair (in node 1's recovery) cannot know whether the free happened; the
// allocator can: the payload is held by an ended life and nothing reaches it, so it is freed.
// Before, it stayed allocated for good — no later recovery of its owner would come.
TEST(CacheRecovery, AnEvictionCutShortOnAnOrphanedPayloadIsReclaimed) {
  testing::TempRegionPath path("evict-orphan");
  ASSERT_TRUE(testing::CreateCachePool(path.path(), 32 << 20, 1024).ok());
  const auto tokens = testing::Tokens(5, 16, 0, 0);
  // Node 0 lives throughout: it manages the pool and recovers nodes 2 and 1.
  Child survivor = Child::Fork([&](int in, int out) {
    auto o = OpenCache(path.path(), 0);
    if (!o.cache || !testing::Put(out, 1)) return 1;
    uint64_t done;
    (void)testing::Get(in, &done);
    return 0;
  });
  uint64_t ready;
  ASSERT_TRUE(survivor.Receive(&ready));
  auto put = testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 2);
    CHILD_CHECK(o.cache, "open");
    auto k = o.cache->ChainKeys(o.ns, tokens)[0];
    std::vector<uint8_t> data(4096);
    testing::FillForKey(k, data.data(), data.size());
    CHILD_CHECK(o.cache->Put(o.ns, k, data.data(), data.size()).ok(), "put");
    return 0;
  });
  ASSERT_EQ(put[0], 0);
  Sleep(2);  // node 0 recovered node 2's life: the payload is kept, in an orphan chunk
  ASSERT_EQ(Usage(path.path()).orphan, 1u);
  auto evict = testing::RunForked(1, [&](int) {
    auto o = OpenCache(path.path(), 1);
    CHILD_CHECK(o.cache, "open");
    o.pool->impl().index->TestCrashAt(cache::Index::CrashPoint::kEvictAfterMark);
    (void)o.cache->EvictAll();  // killed on the first READY entry, after marking it EVICTING
    return 3;
  });
  ASSERT_EQ(evict[0], 128 + SIGKILL);
  Sleep(4);  // node 0 declares node 1 dead, takes over its stripe lock and repairs the entry
  ASSERT_TRUE(survivor.Send(1));
  EXPECT_EQ(survivor.Wait(), 0);
  auto o = OpenCache(path.path(), 3);
  ASSERT_TRUE(o.cache);
  Sleep(3);  // in case node 0 left before the repair: node 3 recovers node 1 then
  EXPECT_TRUE(testing::LiveEntries(*o.pool).empty());
  o.pool.reset();
  const auto usage = Usage(path.path());
  EXPECT_EQ(usage.allocated_bytes, 0u) << "the payload of the cut-short eviction leaked";
  EXPECT_EQ(usage.orphan, 0u);
  auto regions = pool::AttachAll({path.path()});
  ASSERT_TRUE(regions.ok());
  for (const auto& p : pool::Check(*regions)) ADD_FAILURE() << p;
}

}  // namespace
}  // namespace cxlkv
