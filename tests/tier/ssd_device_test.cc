// The SSD tier on every I/O path: bytes read back identical, corrupt/torn/reused slots read as
// misses, a full device, and clear errors at open.
#include "tier/ssd_device.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <tuple>

#include "test_region.h"
#include "tier_test_util.h"

namespace cxlkv::tier {
namespace {

using testing::Payload;
using testing::RoundTrip;
using testing::ScratchDir;
using testing::Tag;

enum class PathKind { kUringRegistered, kUringUnregistered, kSync, kBufferedUring, kBufferedSync };

const char* PathName(PathKind k) {
  switch (k) {
    case PathKind::kUringRegistered: return "UringRegistered";
    case PathKind::kUringUnregistered: return "UringUnregistered";
    case PathKind::kSync: return "Sync";
    case PathKind::kBufferedUring: return "BufferedUring";
    case PathKind::kBufferedSync: return "BufferedSync";
  }
  return "?";
}

SsdOptions OptionsFor(PathKind k, const std::string& file, uint64_t slot_bytes, uint64_t slots, uint32_t depth) {
  SsdOptions o;
  o.path = file;
  o.slot_bytes = slot_bytes;
  o.size_bytes = slot_bytes * slots;
  o.queue_depth = depth;
  o.register_buffers = k == PathKind::kUringRegistered || k == PathKind::kBufferedUring;
  o.use_io_uring = k != PathKind::kSync && k != PathKind::kBufferedSync;
  o.direct_io = k != PathKind::kBufferedUring && k != PathKind::kBufferedSync;
  return o;
}

using RoundTripParam = std::tuple<PathKind, uint64_t /*slot bytes*/>;

class TierSsdRoundTrip : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(TierSsdRoundTrip, BytesWrittenReadBackIdenticalForEveryBatchSize) {
  auto [kind, slot_bytes] = GetParam();
  ScratchDir dir;
  const uint32_t depth = 8;
  auto dev = SsdDevice::Open(OptionsFor(kind, dir.File("tier"), slot_bytes, 64, depth));
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  const SsdIoPath& io = (*dev)->io_path();
  std::string why = (*dev)->Describe();
  switch (kind) {
    case PathKind::kUringRegistered:
      if (!io.io_uring) GTEST_SKIP() << "io_uring is refused here: " << why;
      if (!io.direct) GTEST_SKIP() << "O_DIRECT is refused on this file system: " << why;
      EXPECT_TRUE(io.registered_buffers) << why;
      break;
    case PathKind::kUringUnregistered:
      if (!io.io_uring) GTEST_SKIP() << "io_uring is refused here: " << why;
      EXPECT_FALSE(io.registered_buffers) << why;
      break;
    case PathKind::kSync:
      EXPECT_FALSE(io.io_uring) << why;
      EXPECT_NE(why.find("synchronous"), std::string::npos) << why;
      break;
    case PathKind::kBufferedUring:
    case PathKind::kBufferedSync:
      EXPECT_FALSE(io.direct) << why;
      EXPECT_NE(why.find("buffered"), std::string::npos) << why;
      break;
  }
  const uint64_t cap = (*dev)->payload_capacity();
  // One item, a few, a batch deeper than the queue (8), and odd payload sizes.
  RoundTrip(**dev, 1, cap, 100);
  RoundTrip(**dev, 5, cap / 2 + 3, 200);
  RoundTrip(**dev, 3 * depth + 1, cap, 300);
  RoundTrip(**dev, 17, 1, 400);
  RoundTrip(**dev, 2, 0, 500);
}

INSTANTIATE_TEST_SUITE_P(Paths, TierSsdRoundTrip,
                         ::testing::Combine(::testing::Values(PathKind::kUringRegistered, PathKind::kUringUnregistered,
                                                              PathKind::kSync, PathKind::kBufferedUring,
                                                              PathKind::kBufferedSync),
                                            ::testing::Values(4096, 64 << 10, 256 << 10)),
                         [](const ::testing::TestParamInfo<RoundTripParam>& info) {
                           return std::string(PathName(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param) >> 10) + "KiB";
                         });

// Overwrites bytes of the device file directly (what a bad sector, a bit flip or a buggy writer
// leaves behind).
void Poke(const std::string& file, uint64_t offset, const void* bytes, size_t n) {
  int fd = ::open(file.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes, n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::close(fd);
}

void FlipBit(const std::string& file, uint64_t offset, int bit) {
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= static_cast<unsigned char>(1u << bit);
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

class TierSsdMisses : public ::testing::Test {
 protected:
  void SetUp() override {
    SsdOptions o;
    o.path = dir_.File("tier");
    o.slot_bytes = kSlot;
    o.size_bytes = kSlot * 16;
    o.queue_depth = 4;
    auto d = SsdDevice::Open(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dev_ = std::move(*d);
  }
  // These tests name the i-th slot of kSlot bytes (at byte i·kSlot of the file): its first granule.
  static uint64_t SlotAt(uint64_t i) { return i * kSlot / 4096; }
  Status WriteOne(uint64_t i, const SlotTag& tag, const std::vector<std::byte>& data) {
    std::span<const std::byte> piece(data);
    WriteItem w{SlotAt(i), tag, std::span<const std::span<const std::byte>>(&piece, 1)};
    return dev_->Write(std::span<const WriteItem>(&w, 1))[0];
  }
  Status ReadOne(uint64_t i, const SlotTag& tag, std::vector<std::byte>* out, SlotVerdict* verdict = nullptr) {
    out->assign(kPayload, std::byte{0});
    ReadItem r{SlotAt(i), tag, *out};
    Status s = dev_->Read(std::span<ReadItem>(&r, 1))[0];
    if (verdict) *verdict = r.verdict;
    return s;
  }

  static constexpr uint64_t kSlot = 16 << 10;
  static constexpr size_t kPayload = 10000;
  ScratchDir dir_;
  std::unique_ptr<SsdDevice> dev_;
};

TEST_F(TierSsdMisses, NeverWrittenSlotIsAMissNotData) {
  std::vector<std::byte> out;
  SlotVerdict v;
  Status s = ReadOne(3, Tag(1), &out, &v);
  EXPECT_TRUE(IsMiss(s)) << s.ToString();
  EXPECT_EQ(v, SlotVerdict::kEmpty);
  EXPECT_EQ(dev_->stats().miss_empty, 1u);
}

TEST_F(TierSsdMisses, BitFlipInPayloadIsAMiss) {
  auto data = Payload(1, kPayload);
  ASSERT_TRUE(WriteOne(2, Tag(1), data).ok());
  std::vector<std::byte> out;
  ASSERT_TRUE(ReadOne(2, Tag(1), &out).ok());
  for (uint64_t at : {uint64_t{0}, uint64_t{4000}, uint64_t{kPayload - 1}}) {
    FlipBit(dir_.File("tier"), 2 * kSlot + kSlotHeaderBytes + at, 5);
    SlotVerdict v;
    Status s = ReadOne(2, Tag(1), &out, &v);
    EXPECT_TRUE(IsMiss(s)) << "flip at payload byte " << at << ": " << s.ToString();
    EXPECT_EQ(v, SlotVerdict::kCorrupt);
    FlipBit(dir_.File("tier"), 2 * kSlot + kSlotHeaderBytes + at, 5);  // undo: valid again
    EXPECT_TRUE(ReadOne(2, Tag(1), &out).ok());
  }
}

TEST_F(TierSsdMisses, BitFlipAnywhereInTheHeaderIsAMiss) {
  auto data = Payload(2, kPayload);
  ASSERT_TRUE(WriteOne(5, Tag(9), data).ok());
  std::vector<std::byte> out;
  for (uint32_t byte = 0; byte < kSlotHeaderBytes; ++byte) {
    for (int bit : {0, 7}) {
      FlipBit(dir_.File("tier"), 5 * kSlot + byte, bit);
      SlotVerdict v;
      Status s = ReadOne(5, Tag(9), &out, &v);
      EXPECT_TRUE(IsMiss(s)) << "header byte " << byte << " bit " << bit << ": " << s.ToString();
      EXPECT_NE(v, SlotVerdict::kValid);
      FlipBit(dir_.File("tier"), 5 * kSlot + byte, bit);
    }
  }
  ASSERT_TRUE(ReadOne(5, Tag(9), &out).ok());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), out.begin()));
}

TEST_F(TierSsdMisses, HeaderClaimingAHugeLengthIsAMissNotAnOverrun) {
  auto data = Payload(3, kPayload);
  ASSERT_TRUE(WriteOne(1, Tag(1), data).ok());
  uint32_t huge = 0xFFFFFFF0u;
  Poke(dir_.File("tier"), 1 * kSlot + 48, &huge, sizeof huge);
  std::vector<std::byte> out;
  SlotVerdict v;
  EXPECT_TRUE(IsMiss(ReadOne(1, Tag(1), &out, &v)));
  EXPECT_EQ(v, SlotVerdict::kCorrupt);
}

TEST_F(TierSsdMisses, ReusedSlotNeverValidatesForTheOldOwner) {
  auto a = Payload(10, kPayload), b = Payload(11, kPayload);
  const SlotTag ta = Tag(1, /*generation=*/1), tb = Tag(2, /*generation=*/2);
  ASSERT_TRUE(WriteOne(4, ta, a).ok());
  ASSERT_TRUE(WriteOne(4, tb, b).ok());
  std::vector<std::byte> out;
  SlotVerdict v;
  EXPECT_TRUE(IsMiss(ReadOne(4, ta, &out, &v)));
  EXPECT_EQ(v, SlotVerdict::kStale);
  // Same key as A, newer generation: still not A.
  EXPECT_TRUE(IsMiss(ReadOne(4, SlotTag{ta.key, ta.ns, 2}, &out, &v)));
  EXPECT_TRUE(IsMiss(ReadOne(4, SlotTag{tb.key, tb.ns + 1, 2}, &out, &v))) << "another namespace";
  ASSERT_TRUE(ReadOne(4, tb, &out).ok());
  EXPECT_TRUE(std::equal(b.begin(), b.end(), out.begin()));
  EXPECT_EQ(dev_->stats().miss_stale, 3u);
}

TEST_F(TierSsdMisses, TornWriteOverAnOlderBlockIsAMiss) {
  // A is complete; B's write reached the disk only for its first 4 KiB (header + the start of
  // its payload) — the rest of the slot still holds A's bytes. Neither A nor B validates.
  auto a = Payload(20, kPayload), b = Payload(21, kPayload);
  const SlotTag ta = Tag(1, 1), tb = Tag(1, 2);
  ASSERT_TRUE(WriteOne(6, ta, a).ok());
  // Build B's full image on another slot, then copy its first 4 KiB over slot 6.
  ASSERT_TRUE(WriteOne(7, tb, b).ok());
  std::vector<char> first(4096);
  int fd = ::open(dir_.File("tier").c_str(), O_RDONLY);
  ASSERT_EQ(::pread(fd, first.data(), first.size(), 7 * kSlot), 4096);
  ::close(fd);
  Poke(dir_.File("tier"), 6 * kSlot, first.data(), first.size());
  std::vector<std::byte> out;
  SlotVerdict v;
  EXPECT_TRUE(IsMiss(ReadOne(6, tb, &out, &v)));
  EXPECT_EQ(v, SlotVerdict::kCorrupt);
  EXPECT_TRUE(IsMiss(ReadOne(6, ta, &out, &v)));
}

TEST(TierSsdDevice, FullDeviceSaysSoAndLosesNothing) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.slot_bytes = 8192;
  o.size_bytes = 8192 * 4;
  auto dev = SsdDevice::Open(o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  auto slots = (*dev)->AllocateSlots(4);
  ASSERT_TRUE(slots.ok());
  std::vector<std::vector<std::byte>> data;
  std::vector<std::span<const std::byte>> pieces;
  std::vector<WriteItem> w;
  for (int i = 0; i < 4; ++i) data.push_back(Payload(i, 5000));
  for (int i = 0; i < 4; ++i) pieces.emplace_back(data[i]);
  for (int i = 0; i < 4; ++i) w.push_back({(*slots)[i], Tag(i), std::span(&pieces[i], 1)});
  for (const auto& s : (*dev)->Write(w)) ASSERT_TRUE(s.ok());
  auto more = (*dev)->AllocateSlots(1);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(more.status().message().find("is full"), std::string::npos) << more.status().ToString();
  EXPECT_EQ((*dev)->free_slots(), 0u);
  std::vector<std::vector<std::byte>> out(4, std::vector<std::byte>(5000));
  std::vector<ReadItem> r;
  for (int i = 0; i < 4; ++i) r.push_back({(*slots)[i], Tag(i), out[i]});
  auto rs = (*dev)->Read(r);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(rs[i].ok()) << rs[i].ToString();
    EXPECT_EQ(out[i], data[i]);
  }
  // Freeing one makes room again; freeing it twice is refused.
  ASSERT_TRUE((*dev)->FreeSlots(std::span(slots->data(), 1)).ok());
  EXPECT_FALSE((*dev)->FreeSlots(std::span(slots->data(), 1)).ok());
  EXPECT_TRUE((*dev)->AllocateSlots(1).ok());
}

TEST(TierSsdDevice, PayloadLargerThanASlotIsRefusedBeforeAnyIo) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.slot_bytes = 4096;
  o.size_bytes = 4096 * 2;
  auto dev = SsdDevice::Open(o);
  ASSERT_TRUE(dev.ok());
  auto big = Payload(1, 4096);  // 4096 + the 64-byte header does not fit
  std::span<const std::byte> piece(big);
  WriteItem w{0, Tag(1), std::span(&piece, 1)};
  auto s = (*dev)->Write(std::span(&w, 1));
  EXPECT_EQ(s[0].code(), StatusCode::kInvalidArgument);
  WriteItem oob{2, Tag(1), {}};
  EXPECT_EQ((*dev)->Write(std::span(&oob, 1))[0].code(), StatusCode::kInvalidArgument);
}

TEST(TierSsdOpen, MissingDirectoryFailsWithAClearMessage) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("no/such/dir/tier");
  o.size_bytes = 1 << 20;
  auto dev = SsdDevice::Open(o);
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kNotFound);
  EXPECT_NE(dev.status().message().find("directory does not exist"), std::string::npos) << dev.status().ToString();
}

// A character device is taken for an NVMe generic device (/dev/ngXnY, driven by passthrough:
// ssd_nvme_test.cc); one that is not — /dev/null, whose real identify ioctl says ENOTTY — is
// refused with what to give instead, and nothing is written to it.
TEST(TierSsdOpen, ACharacterDeviceIsRefusedNamingTheBlockDeviceToUse) {
  SsdOptions o;
  o.path = "/dev/null";
  o.size_bytes = 1 << 20;
  auto dev = SsdDevice::Open(o);
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dev.status().message().find("not an NVMe namespace"), std::string::npos) << dev.status().ToString();
  EXPECT_NE(dev.status().message().find("/dev/nvmeXnY"), std::string::npos) << dev.status().ToString();
}

TEST(TierSsdOpen, MissingFileWithoutCreateOrSizeFails) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.create = false;
  o.size_bytes = 1 << 20;
  EXPECT_EQ(SsdDevice::Open(o).status().code(), StatusCode::kNotFound);
  o.create = true;
  o.size_bytes = 0;
  auto dev = SsdDevice::Open(o);
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dev.status().message().find("no size was given"), std::string::npos);
}

TEST(TierSsdOpen, UnwritablePathFailsWithAClearMessage) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.size_bytes = 1 << 20;
  // A directory where the file should be.
  ASSERT_EQ(::mkdir(o.path.c_str(), 0700), 0);
  auto dev = SsdDevice::Open(o);
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument) << dev.status().ToString();
  ::rmdir(o.path.c_str());
  // A read-only file (root ignores file modes, so only checked as another user).
  if (::geteuid() != 0) {
    int fd = ::open(o.path.c_str(), O_CREAT | O_WRONLY, 0400);
    ::close(fd);
    dev = SsdDevice::Open(o);
    EXPECT_EQ(dev.status().code(), StatusCode::kPermissionDenied) << dev.status().ToString();
  }
  // A read-only file system (as root too).
  SsdOptions ro = o;
  ro.path = "/proc/cxlkv-tier-test";
  dev = SsdDevice::Open(ro);
  ASSERT_FALSE(dev.ok());
  EXPECT_NE(dev.status().message().find("cannot open"), std::string::npos) << dev.status().ToString();
}

TEST(TierSsdOpen, FileTooSmallForOneSlotIsRefused) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.slot_bytes = 64 << 10;
  o.size_bytes = 4096;
  auto dev = SsdDevice::Open(o);
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dev.status().message().find("too small"), std::string::npos) << dev.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(o.path)) << "a file we created is removed when open fails";
  o.slot_bytes = 5000;
  EXPECT_EQ(SsdDevice::Open(o).status().code(), StatusCode::kInvalidArgument) << "slot not a multiple of 4 KiB";
}

// Two stores on one file would hand out the same slots and overwrite each other's blocks and
// catalog: the second open is refused while the first holds the file (in this process or
// another), and succeeds once it is closed. The refused open leaves the file untouched.
TEST(TierSsdOpen, AFileInUseByAnotherStoreIsRefused) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.slot_bytes = 8192;
  o.size_bytes = 8192 * 8;
  auto data = Payload(9, 5000);
  {
    auto first = SsdDevice::Open(o);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    std::span<const std::byte> piece(data);
    WriteItem w{2, Tag(2), std::span(&piece, 1)};
    ASSERT_TRUE((*first)->Write(std::span(&w, 1))[0].ok());
    auto second = SsdDevice::Open(o);
    EXPECT_EQ(second.status().code(), StatusCode::kBusy);
    EXPECT_NE(second.status().message().find("in use by another process"), std::string::npos)
        << second.status().ToString();
    const std::string path = o.path;
    auto child = cxlkv::testing::RunForked(1, [&](int) {
      auto other = SsdDevice::Open(o);
      CHILD_CHECK(other.status().code() == StatusCode::kBusy, "another process opened a file in use: %s",
                  other.status().ToString().c_str());
      return 0;
    });
    EXPECT_EQ(child[0], 0);
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  auto again = SsdDevice::Open(o);  // the first one closed: the file is free
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  std::vector<std::byte> out(5000);
  ReadItem r{2, Tag(2), out};
  ASSERT_TRUE((*again)->Read(std::span(&r, 1))[0].ok());
  EXPECT_EQ(out, data);
}

TEST(TierSsdOpen, ExistingFileKeepsItsSlots) {
  ScratchDir dir;
  SsdOptions o;
  o.path = dir.File("tier");
  o.slot_bytes = 8192;
  o.size_bytes = 8192 * 8;
  auto data = Payload(5, 3000);
  {
    auto dev = SsdDevice::Open(o);
    ASSERT_TRUE(dev.ok());
    std::span<const std::byte> piece(data);
    WriteItem w{3, Tag(3), std::span(&piece, 1)};
    ASSERT_TRUE((*dev)->Write(std::span(&w, 1))[0].ok());
  }
  o.size_bytes = 0;  // reopen at the file's size
  auto dev = SsdDevice::Open(o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_EQ((*dev)->slot_count(), 8u);
  std::vector<std::byte> out(3000);
  ReadItem r{3, Tag(3), out};
  ASSERT_TRUE((*dev)->Read(std::span(&r, 1))[0].ok());
  EXPECT_EQ(out, data);
}

}  // namespace
}  // namespace cxlkv::tier
