// Errors the OS can hand the region layer, injected through Platform: every one is reported with
// what went wrong and what to do, and leaves no half-made region behind.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "region/region_internal.h"
#include "test_region.h"

namespace cxlkv::region {
namespace {

using ::testing::HasSubstr;
using cxlkv::testing::TempRegionPath;

constexpr uint64_t kSize = 16 << 20;

// The real OS, with chosen calls made to fail, and optionally a tmpfs file dressed up as a
// device-DAX character device whose sysfs size is `dax_size`.
class FaultPlatform : public Platform {
 public:
  int open_errno = 0, fallocate_errno = 0, numa_max_node = 3, numa_bind_errno = 0;
  bool fake_dax = false;
  std::string dax_size = "";

  int Open(const std::string& path, int flags, mode_t mode) override {
    if (open_errno) return -open_errno;
    return Platform::Open(path, flags, mode);
  }
  int Fallocate(int fd, uint64_t size) override {
    if (fallocate_errno) return -fallocate_errno;
    return Platform::Fallocate(fd, size);
  }
  int NumaMaxNode() override { return numa_max_node; }
  int NumaBind(void*, size_t, int) override { return -numa_bind_errno; }
  bool IsCharDevice(const std::string& path) override {
    return fake_dax || Platform::IsCharDevice(path);
  }
  int Facts(int fd, FileFacts* out) override {
    int rc = Platform::Facts(fd, out);
    if (rc == 0 && fake_dax) {
      out->kind = FsKind::kCharDevice;
      out->size = 0;
    }
    return rc;
  }
  Result<std::string> ReadSysfs(const std::string& path) override {
    if (!fake_dax) return Platform::ReadSysfs(path);
    if (path.rfind("bus/dax/devices/", 0) != 0) return NotFound("unexpected sysfs path " + path);
    if (dax_size.empty()) return NotFound("no such attribute");
    return dax_size;
  }
};

bool Exists(const std::string& p) { return std::filesystem::exists(p); }

TEST(MappingFaults, FullMemoryIsNoSpaceAndLeavesNothingBehind) {
  TempRegionPath path("enospc");
  FaultPlatform os;
  os.fallocate_errno = ENOSPC;
  auto r = CreateRegion(path.path(), {.size = kSize}, os);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(r.status().message(), HasSubstr("smaller --size"));
  EXPECT_FALSE(Exists(path.path()));
  EXPECT_FALSE(Exists(path.path() + ".init-" + std::to_string(::getpid())));
}

TEST(MappingFaults, PermissionDeniedSaysSo) {
  TempRegionPath path("eacces");
  FaultPlatform os;
  os.open_errno = EACCES;
  auto created = CreateRegion(path.path(), {.size = kSize}, os);
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), StatusCode::kPermissionDenied);
  auto attached = AttachRegion(path.path(), {}, os);
  ASSERT_FALSE(attached.ok());
  EXPECT_EQ(attached.status().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(attached.status().message(), HasSubstr("Permission denied"));
}

TEST(MappingFaults, NumaNodeThatDoesNotExistIsNamed) {
  TempRegionPath path("numa");
  FaultPlatform os;
  os.numa_max_node = 1;
  auto r = CreateRegion(path.path(), {.size = kSize, .numa_node = 5}, os);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("nodes 0-1"));
  EXPECT_FALSE(Exists(path.path()));

  os.numa_max_node = -1;
  r = CreateRegion(path.path(), {.size = kSize, .numa_node = 0}, os);
  EXPECT_EQ(r.status().code(), StatusCode::kNotSupported);

  os.numa_max_node = 1;
  os.numa_bind_errno = EINVAL;
  r = CreateRegion(path.path(), {.size = kSize, .numa_node = 1}, os);
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_FALSE(Exists(path.path()));
}

TEST(MappingFaults, NumaBoundRegionOnAValidNodeWorks) {
  // The real binding: node 0 exists on every Linux machine with NUMA support.
  if (Platform::Default().NumaMaxNode() < 0) GTEST_SKIP() << "no NUMA support here";
  TempRegionPath path("numa0");
  auto r = Region::Create(path.path(), {.size = kSize, .numa_node = 0});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->info().numa_node, 0);
}

TEST(DevDax, SizeComesFromSysfsAndFormatsInPlace) {
  TempRegionPath path("dax");
  // The "device": a tmpfs file of the device's size (real devdax is a character device).
  ASSERT_TRUE(cxlkv::testing::CreateOrDie(path.path(), kSize));
  FaultPlatform os;
  os.fake_dax = true;
  os.dax_size = std::to_string(kSize) + "\n";
  auto r = CreateRegion(path.path(), {.overwrite = true}, os);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->info().backend, BackendKind::kDevDax);
  EXPECT_EQ((*r)->info().region_size, kSize);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*r)->impl().base()) % kHugeAlign, 0u);
  auto a = AttachRegion(path.path(), {}, os);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->info().region_id, (*r)->info().region_id);
}

TEST(DevDax, TooSmallMissingAndUnreadableSizesAreReported) {
  TempRegionPath path("daxsmall");
  ASSERT_TRUE(cxlkv::testing::CreateOrDie(path.path(), kSize));
  FaultPlatform os;
  os.fake_dax = true;
  os.dax_size = std::to_string(kSize);
  auto r = CreateRegion(path.path(), {.size = 2 * kSize, .overwrite = true}, os);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(r.status().message(), HasSubstr("too small"));

  os.dax_size = "";
  r = CreateRegion(path.path(), {.overwrite = true}, os);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("daxctl"));

  os.dax_size = "lots";
  r = CreateRegion(path.path(), {.overwrite = true}, os);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupted);

  // A device that holds a region refuses to be re-formatted unless forced.
  os.dax_size = std::to_string(kSize);
  r = CreateRegion(path.path(), {}, os);
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace cxlkv::region
