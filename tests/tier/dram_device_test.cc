// The DRAM tier: the same batch API and slot validation as the SSD tier; NUMA binding with a
// clean fallback; and the bandwidth probe on both kinds of device.
#include "tier/dram_device.h"

#include <gtest/gtest.h>

#include "tier/probe.h"
#include "tier/ssd_device.h"
#include "tier_test_util.h"

namespace cxlkv::tier {
namespace {

using testing::Payload;
using testing::RoundTrip;
using testing::ScratchDir;
using testing::Tag;

std::unique_ptr<DramDevice> MakeDram(uint64_t slot_bytes, uint64_t slots, int numa = -1,
                                     region::Platform* platform = nullptr) {
  DramOptions o;
  o.capacity_bytes = slot_bytes * slots;
  o.slot_bytes = slot_bytes;
  o.numa_node = numa;
  o.platform = platform;
  auto d = DramDevice::Create(o);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? std::move(*d) : nullptr;
}

TEST(TierDramDevice, BytesWrittenReadBackIdentical) {
  for (uint64_t slot : {uint64_t{4096}, uint64_t{64 << 10}, uint64_t{256 << 10}}) {
    auto dev = MakeDram(slot, 40);
    ASSERT_TRUE(dev);
    EXPECT_EQ(dev->kind(), TierKind::kMem);
    RoundTrip(*dev, 1, dev->payload_capacity(), 1);
    RoundTrip(*dev, 33, dev->payload_capacity() / 3 + 1, 2);
    RoundTrip(*dev, 4, 0, 3);
  }
}

TEST(TierDramDevice, ReusedSlotAndCorruptSlotAreMisses) {
  auto dev = MakeDram(8192, 4);
  ASSERT_TRUE(dev);
  auto slots = dev->AllocateSlots(std::vector<uint64_t>{5000, 5000});
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  const uint64_t used = (*slots)[0], never = (*slots)[1];
  auto a = Payload(1, 5000), b = Payload(2, 5000);
  std::span<const std::byte> pa(a), pb(b);
  WriteItem wa{used, Tag(1, 1), std::span(&pa, 1)}, wb{used, Tag(2, 2), std::span(&pb, 1)};
  ASSERT_TRUE(dev->Write(std::span(&wa, 1))[0].ok());
  ASSERT_TRUE(dev->Write(std::span(&wb, 1))[0].ok());
  std::vector<std::byte> out(5000);
  ReadItem r{used, Tag(1, 1), out};
  EXPECT_TRUE(IsMiss(dev->Read(std::span(&r, 1))[0]));
  EXPECT_EQ(r.verdict, SlotVerdict::kStale);
  ReadItem empty{never, Tag(1, 1), out};
  EXPECT_TRUE(IsMiss(dev->Read(std::span(&empty, 1))[0]));
  EXPECT_EQ(empty.verdict, SlotVerdict::kEmpty);
  // A destination smaller than the stored payload: the header's length is not trusted past it.
  std::vector<std::byte> small(100);
  ReadItem rs{used, Tag(2, 2), small};
  EXPECT_TRUE(IsMiss(dev->Read(std::span(&rs, 1))[0]));
  ReadItem rb{used, Tag(2, 2), out};
  ASSERT_TRUE(dev->Read(std::span(&rb, 1))[0].ok());
  EXPECT_EQ(out, b);
}

// The slot validation itself, on a slot image in memory: every single-bit flip of header or
// payload is a miss.
TEST(TierSlotFormat, EveryBitFlipIsAMiss) {
  std::vector<std::byte> slot(kSlotHeaderBytes + 300);
  auto p = Payload(9, 300);
  std::copy(p.begin(), p.end(), slot.begin() + kSlotHeaderBytes);
  SealSlot(slot.data(), Tag(4), 300);
  uint32_t n = 0;
  ASSERT_EQ(CheckSlot(slot.data(), slot.size(), 300, Tag(4), true, &n), SlotVerdict::kValid);
  ASSERT_EQ(n, 300u);
  for (size_t byte = 0; byte < slot.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      slot[byte] ^= static_cast<std::byte>(1 << bit);
      EXPECT_NE(CheckSlot(slot.data(), slot.size(), 300, Tag(4), true, &n), SlotVerdict::kValid)
          << "byte " << byte << " bit " << bit;
      slot[byte] ^= static_cast<std::byte>(1 << bit);
    }
  }
  EXPECT_EQ(CheckSlot(slot.data(), 10, 300, Tag(4), true, &n), SlotVerdict::kCorrupt) << "truncated image";
  EXPECT_EQ(CheckSlot(slot.data(), slot.size() - 1, 300, Tag(4), true, &n), SlotVerdict::kCorrupt)
      << "payload past what was read";
}

class NoNumaPlatform : public region::Platform {
 public:
  int NumaMaxNode() override { return -1; }
};

TEST(TierDramDevice, NumaUnavailableFallsBackUnboundAndSaysSo) {
  NoNumaPlatform p;
  auto dev = MakeDram(8192, 4, /*numa=*/0, &p);
  ASSERT_TRUE(dev);
  EXPECT_NE(dev->Describe().find("not NUMA-bound"), std::string::npos) << dev->Describe();
  RoundTrip(*dev, 3, 1000, 1);
}

TEST(TierDramDevice, NumaBoundWhereAvailable) {
  int max = region::Platform::Default().NumaMaxNode();
  if (max < 0) GTEST_SKIP() << "no NUMA support here";
  auto dev = MakeDram(8192, 4, 0);
  ASSERT_TRUE(dev);
  EXPECT_NE(dev->Describe().find("bound to NUMA node 0"), std::string::npos) << dev->Describe();
  RoundTrip(*dev, 3, 1000, 1);
  DramOptions o;
  o.capacity_bytes = 1 << 20;
  o.numa_node = max + 1;
  EXPECT_EQ(DramDevice::Create(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(TierDramDevice, CapacityBelowOneSlotIsRefused) {
  DramOptions o;
  o.capacity_bytes = 1000;
  o.slot_bytes = 4096;
  EXPECT_EQ(DramDevice::Create(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(TierProbe, MeasuresBothKindsAndLeavesNoSlotTaken) {
  auto dram = MakeDram(64 << 10, 64);
  ASSERT_TRUE(dram);
  ProbeOptions po;
  po.bytes = 2 << 20;
  auto r = ProbeBandwidth(*dram, po);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT(r->read_bytes_per_s, 0u);
  EXPECT_EQ(dram->bandwidth(), r->read_bytes_per_s);
  EXPECT_EQ(dram->free_slots(), 64u);

  ScratchDir dir;
  SsdOptions so;
  so.path = dir.File("tier");
  so.slot_bytes = 64 << 10;
  so.size_bytes = so.slot_bytes * 64;
  auto ssd = SsdDevice::Open(so);
  ASSERT_TRUE(ssd.ok()) << ssd.status().ToString();
  r = ProbeBandwidth(**ssd, po);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT((*ssd)->bandwidth(), 0u);
  EXPECT_EQ((*ssd)->free_slots(), 64u);
  std::cout << (*ssd)->Describe() << ": probe read " << r->read_bytes_per_s / 1e9 << " GB/s, write "
            << r->write_bytes_per_s / 1e9 << " GB/s\n";
}

}  // namespace
}  // namespace cxlkv::tier
