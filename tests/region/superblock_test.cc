// Create/Attach round trips and every way a region can be refused.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "region/region_internal.h"
#include "region/superblock.h"
#include "test_region.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::TempRegionPath;

constexpr uint64_t kSize = 16 << 20;

void PokeFile(const std::string& path, off_t at, const void* bytes, size_t n) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes, n, at), static_cast<ssize_t>(n));
  ::close(fd);
}

TEST(Region, CreateThenAttachSeesTheSameSuperblock) {
  TempRegionPath path("roundtrip");
  RegionCreateOptions opts;
  opts.size = kSize;
  opts.max_nodes = 8;
  auto created = Region::Create(path.path(), opts);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto attached = Region::Attach(path.path());
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  const RegionInfo& a = (*created)->info();
  const RegionInfo& b = (*attached)->info();
  EXPECT_EQ(b.layout_version, kLayoutVersion);
  EXPECT_EQ(b.region_size, kSize);
  EXPECT_EQ(b.max_nodes, 8u);
  EXPECT_EQ(b.backend, BackendKind::kShmFile);
  EXPECT_EQ(b.coherence, CoherenceMode::kSoftware);
  EXPECT_EQ(a.region_id, b.region_id);
  EXPECT_EQ(a.checksum, b.checksum);
  EXPECT_EQ(b.region_id.size(), 32u);
  EXPECT_GT(b.created_unix_ns, 0u);
  // Areas are inside the region, in order, and do not overlap.
  ASSERT_FALSE(b.areas.empty());
  uint64_t end = region::kSuperblockBytes;
  for (const AreaInfo& area : b.areas) {
    EXPECT_GE(area.offset, end) << area.name;
    end = area.offset + area.size;
  }
  EXPECT_LE(end, kSize);
  EXPECT_EQ(b.areas.back().name, "data");
  EXPECT_EQ(b.areas.back().offset % b.chunk_bytes, 0u);
}

TEST(Region, TwoRegionsGetDistinctIds) {
  TempRegionPath p1("id1"), p2("id2");
  auto r1 = testing::CreateOrDie(p1.path(), kSize);
  auto r2 = testing::CreateOrDie(p2.path(), kSize);
  ASSERT_TRUE(r1 && r2);
  EXPECT_NE(r1->info().region_id, r2->info().region_id);
}

TEST(Region, WritesThroughOneMappingAreSeenThroughAnother) {
  TempRegionPath path("shared");
  auto r1 = testing::CreateOrDie(path.path(), kSize);
  ASSERT_TRUE(r1);
  auto r2 = Region::Attach(path.path());
  ASSERT_TRUE(r2.ok());
  const auto& data = r1->impl().area(region::AreaKind::kData);
  r1->impl().meta().Publish(data.offset, 0xfeedface);
  EXPECT_EQ((*r2)->impl().meta().Fetch(data.offset), 0xfeedfaceu);
}

TEST(Region, RefusesToOverwriteUnlessForced) {
  TempRegionPath path("exists");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kSize));
  RegionCreateOptions opts;
  opts.size = kSize;
  auto again = Region::Create(path.path(), opts);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("--force"));
  opts.overwrite = true;
  EXPECT_TRUE(Region::Create(path.path(), opts).ok());
}

TEST(Region, BadCreateOptionsSayWhatIsWrong) {
  TempRegionPath path("badopts");
  RegionCreateOptions opts;
  opts.size = 0;
  EXPECT_THAT(Region::Create(path.path(), opts).status().message(), HasSubstr("needs a size"));
  opts.size = 1 << 20;
  EXPECT_THAT(Region::Create(path.path(), opts).status().message(), HasSubstr("too small"));
  opts.size = kSize + 100;
  EXPECT_THAT(Region::Create(path.path(), opts).status().message(), HasSubstr("multiple"));
  opts.size = kSize;
  opts.max_nodes = 0;
  EXPECT_EQ(Region::Create(path.path(), opts).status().code(), StatusCode::kInvalidArgument);
  opts.max_nodes = kMaxNodes + 1;
  EXPECT_EQ(Region::Create(path.path(), opts).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Region::Create("/dev/shm/no-such-dir-cxlkv/r", {.size = kSize}).status().code(),
            StatusCode::kNotFound);
  // A disk file system cannot hold a region.
  auto disk = Region::Create("/tmp/cxlkv-test-disk-" + std::to_string(::getpid()), {.size = kSize});
  if (!disk.ok()) {  // /tmp may itself be tmpfs on some machines
    EXPECT_THAT(disk.status().message(), HasSubstr("/dev/shm"));
  }
  ::unlink(("/tmp/cxlkv-test-disk-" + std::to_string(::getpid())).c_str());
}

TEST(Region, AttachToNothingSaysHowToCreate) {
  auto r = Region::Attach("/dev/shm/cxlkv-test-does-not-exist");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("cxlkv init"));
}

TEST(Superblock, BadMagicIsNotACxlkvRegion) {
  TempRegionPath path("magic");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kSize));
  PokeFile(path.path(), 0, "NOTCXLKV", 8);
  auto r = Region::Attach(path.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupted);
  EXPECT_THAT(r.status().message(), HasSubstr("not a cxlkv region"));
}

TEST(Superblock, OtherLayoutVersionNamesBothVersions) {
  TempRegionPath path("version");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kSize));
  uint32_t future = kLayoutVersion + 41;
  PokeFile(path.path(), offsetof(region::Superblock, layout_version), &future, 4);
  auto r = Region::Attach(path.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kVersionMismatch);
  EXPECT_THAT(r.status().message(), HasSubstr("version " + std::to_string(future)));
  EXPECT_THAT(r.status().message(), HasSubstr(std::to_string(kLayoutVersion)));
}

TEST(Superblock, ChecksumMismatchIsReported) {
  TempRegionPath path("checksum");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kSize));
  uint32_t nodes = 9;  // a plausible value: only the checksum can tell
  PokeFile(path.path(), offsetof(region::Superblock, max_nodes), &nodes, 4);
  auto r = Region::Attach(path.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupted);
  EXPECT_THAT(r.status().message(), HasSubstr("checksum mismatch"));
}

TEST(Superblock, TruncatedFileIsReported) {
  TempRegionPath path("trunc");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kSize));
  ASSERT_EQ(::truncate(path.path().c_str(), kSize / 2), 0);
  auto r = Region::Attach(path.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupted);
  EXPECT_THAT(r.status().message(), HasSubstr("truncated"));

  ASSERT_EQ(::truncate(path.path().c_str(), 100), 0);
  r = Region::Attach(path.path());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("truncated"));
}

TEST(Superblock, HalfFormattedRegionIsRefused) {
  // Format stores the magic last: a crash before it leaves zeros there.
  TempRegionPath path("half");
  ASSERT_TRUE(testing::CreateOrDie(path.path(), kSize));
  uint64_t zero = 0;
  PokeFile(path.path(), 0, &zero, 8);
  EXPECT_EQ(Region::Attach(path.path()).status().code(), StatusCode::kCorrupted);
}

TEST(Superblock, ValidationNeverReadsPastAShortBuffer) {
  region::Superblock sb{};
  EXPECT_EQ(region::ValidateSuperblock(&sb, 10, "x", &sb).code(), StatusCode::kCorrupted);
}

}  // namespace
}  // namespace cxlkv
