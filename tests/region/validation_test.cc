// Everything read from the region is checked in every build. A superblock forged with
// a valid checksum (a buggy writer, or a damaged device that happens to pass) is refused by
// name; the metadata accessor's bounds checks stay on in optimized builds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "corrupt.h"
#include "region/region_internal.h"
#include "test_region.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::ForgeSuperblock;
using testing::TempRegionPath;

constexpr uint64_t kValidationRegionSize = 16 << 20;

Status AttachStatus(const std::string& path) {
  auto r = Region::Attach(path);
  return r.ok() ? Status::Ok() : r.status();
}

TEST(RegionValidation, OldLayoutVersionNamesBothVersions) {
  TempRegionPath path("oldver");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kValidationRegionSize));
  ASSERT_TRUE(ForgeSuperblock(path.path(), [](region::Superblock& sb) { sb.layout_version = 3; }));
  Status s = AttachStatus(path.path());
  EXPECT_EQ(s.code(), StatusCode::kVersionMismatch);
  EXPECT_THAT(s.message(), HasSubstr("layout version 3"));
  EXPECT_THAT(s.message(), HasSubstr("reads version " + std::to_string(kLayoutVersion)));
  EXPECT_THAT(s.message(), HasSubstr("cxlkv init"));
}

TEST(RegionValidation, PoolIdentityIsRecorded) {
  TempRegionPath path("ident");
  auto r = testing::CreateOrDie(path.path(), kValidationRegionSize);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->info().pool_id.size(), 32u);
  EXPECT_NE(r->info().pool_id, std::string(32, '0'));
  EXPECT_EQ(r->info().pool_index, 0u);
  EXPECT_EQ(r->info().pool_regions, 1u);
}

struct Forgery {
  const char* name;
  void (*edit)(region::Superblock&);
  const char* expect;  // in the message
};

TEST(RegionValidation, ForgedParametersAreRefusedByName) {
  const Forgery cases[] = {
      {"zero nodes", [](region::Superblock& sb) { sb.max_nodes = 0; }, "0 nodes"},
      {"too many nodes", [](region::Superblock& sb) { sb.max_nodes = 1000; }, "1000 nodes"},
      {"zero chunk", [](region::Superblock& sb) { sb.chunk_bytes = 0; }, "chunk size of 0"},
      {"odd chunk", [](region::Superblock& sb) { sb.chunk_bytes = 3 << 20; }, "chunk size of"},
      {"pool index", [](region::Superblock& sb) { sb.pool_index = 5; }, "region 5 of a pool of 1"},
      {"pool regions", [](region::Superblock& sb) { sb.pool_regions = 0; }, "pool of 0"},
      {"node table param",
       [](region::Superblock& sb) {
         const_cast<region::AreaDesc*>(region::FindArea(sb, region::AreaKind::kNodeTable))->param = 99;
       },
       "area node-table is corrupt"},
      {"data param",
       [](region::Superblock& sb) {
         const_cast<region::AreaDesc*>(region::FindArea(sb, region::AreaKind::kData))->param = 1u << 30;
       },
       "area data is corrupt"},
      {"unknown area kind", [](region::Superblock& sb) { sb.areas[0].kind = 77; }, "unknown kind 77"},
  };
  for (const Forgery& f : cases) {
    SCOPED_TRACE(f.name);
    TempRegionPath path("forge");
    ASSERT_TRUE(testing::CreateOrDie(path.path(), kValidationRegionSize));
    ASSERT_TRUE(ForgeSuperblock(path.path(), f.edit));
    Status s = AttachStatus(path.path());
    EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr(f.expect));
    EXPECT_THAT(s.message(), HasSubstr(path.path()));
    EXPECT_THAT(s.message(), HasSubstr("cxlkv init"));
  }
}

// The accessor's checks are not compiled out by NDEBUG: an access outside the region stops
// the process instead of writing past the mapping.
TEST(RegionValidationDeathTest, MetaAccessChecksBoundsInEveryBuild) {
  TempRegionPath path("meta-bounds");
  auto r = testing::CreateOrDie(path.path(), kValidationRegionSize);
  ASSERT_TRUE(r);
  auto& meta = r->impl().meta();
  EXPECT_DEATH(meta.Load(kValidationRegionSize), "outside region");
  EXPECT_DEATH(meta.Store(kValidationRegionSize + 4096, 1), "outside region");
  EXPECT_DEATH(meta.Invalidate(kValidationRegionSize - 8, 64), "outside region");
  EXPECT_DEATH((void)r->impl().PayloadPtr(~uint64_t{0} - 8, 16), "outside region");
}

}  // namespace
}  // namespace cxlkv
