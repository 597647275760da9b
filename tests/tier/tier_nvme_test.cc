// A whole tier on an NVMe drive through passthrough (runs under scripts/nvme-vm, where
// CXLKV_TEST_NVME_NG names an emulated drive's generic device): spill, promote, the catalog
// directory a device needs, and a warm restart into a re-created region from that directory.
#include <gtest/gtest.h>

#include <cstdlib>

#include "../cache/cache_test_util.h"
#include "tier/tier_service.h"
#include "tier/tier_store.h"
#include "tier_test_util.h"
#include "tiering_test_util.h"

namespace cxlkv::tier {
namespace {

using cxlkv::testing::OpenCache;

TEST(NvmeDrive, ATierOnTheDriveSpillsPromotesAndRestartsFromItsCatalogDirectory) {
  const char* ng = std::getenv("CXLKV_TEST_NVME_NG");
  if (ng == nullptr) GTEST_SKIP() << "no NVMe drive (runs under scripts/nvme-vm)";
  cxlkv::testing::TempRegionPath path("tier-nvme");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048, /*checksum=*/true).ok());
  testing::ScratchDir dir;
  const std::string catalog_dir = dir.File("");
  constexpr size_t kCount = 30;
  std::vector<BlockKey> keys;
  {
    auto o = OpenCache(path.path(), 0);
    ASSERT_TRUE(o.cache);
    // A device keeps its catalog in a named directory: without one it is refused, saying so.
    auto refused = TierStore::Open(*o.pool, Options({Ssd(ng, 32 << 20)}));
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("catalog=DIR"), std::string::npos) << refused.status().message();

    auto store = TierStore::Open(*o.pool, Options({Ssd(ng, 32 << 20, catalog_dir)}));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto service = StartTierService(*o.pool, **store);
    ASSERT_TRUE(service.ok()) << service.status().ToString();
    Blocks b = PutChain(*o.cache, o.ns, 5, kCount);
    keys = b.keys;
    auto spilled = (*store)->Spill(~0ull);
    ASSERT_TRUE(spilled.ok()) << spilled.status().ToString();
    ASSERT_EQ(*spilled, kCount);
    EXPECT_EQ(EntriesByTier(*o.pool)[cache::kTierSsd], kCount);
    std::pair<size_t, size_t> brought_in;
    EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, std::vector<BlockKey>(keys.begin(), keys.begin() + 10), &brought_in),
              10u);
    EXPECT_EQ(brought_in.second, 10u);
    ASSERT_EQ(*(*store)->Spill(~0ull), 10u);  // back onto the drive
  }
  // The region is lost and made again; the drive's blocks come back from the catalog directory.
  Status again = cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048, /*checksum=*/true);
  ASSERT_TRUE(again.ok()) << again.ToString();
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(ng, 32 << 20, catalog_dir)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->Stats()["restored"], kCount) << (*store)->Stats().dump();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  std::pair<size_t, size_t> brought_in;
  EXPECT_EQ(LookupAndVerify(*o.cache, o.ns, keys, &brought_in), kCount);
  EXPECT_EQ(brought_in.second, kCount);
  service->reset();
  ExpectCheckClean(path.path());
}

}  // namespace
}  // namespace cxlkv::tier
